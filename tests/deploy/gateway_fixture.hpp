#pragma once

// What the gateway's tests share: raw sockets on 127.0.0.1 (send, read one answer, chunked
// bodies joined), request builders, the server-sent events' text, and a served cluster (the
// trained built-in model behind a gateway on an ephemeral port). Included by
// gateway.test.cpp and gateway_openai.test.cpp only.

#include <doctest/doctest.h>

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>

#include <caf/actor_system.hpp>
#include <caf/actor_system_config.hpp>
#include <caf/io/middleman.hpp>
#include <caf/scoped_actor.hpp>
#include <nlohmann/json.hpp>

#include "actors/local_cluster.hpp"
#include "actors/messages.hpp"
#include "actors/request.hpp"
#include "client/baton/client.hpp"
#include "deploy/commands.hpp"
#include "deploy/gateway.hpp"
#include "deploy/http.hpp"
#include "deploy/openai.hpp"
#include "gpu/cpu_executor.hpp"
#include "gpu/fault_executor.hpp"

namespace baton::test_gateway {

using nlohmann::json;

/// A whole HTTP response as read off the socket (a chunked body already joined).
struct http_answer {
  int status = 0;
  std::string head;
  std::string body;
};

inline int connect_to(uint16_t port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  timeval tv{30, 0};  // bounded: a test never waits forever on a silent gateway
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  ::inet_pton(AF_INET, "127.0.0.1", &addr.sin_addr);
  REQUIRE(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0);
  return fd;
}

inline void send_all(int fd, const std::string& data) {
  size_t off = 0;
  while (off < data.size()) {
    const auto n = ::send(fd, data.data() + off, data.size() - off, MSG_NOSIGNAL);
    REQUIRE(n > 0);
    off += static_cast<size_t>(n);
  }
}

/// Reads one response from `buf` + the socket; what follows it stays in `buf`.
inline http_answer read_answer(int fd, std::string& buf) {
  auto fill = [&] {
    char tmp[65536];
    const auto n = ::recv(fd, tmp, sizeof(tmp), 0);
    if (n <= 0) return false;
    buf.append(tmp, static_cast<size_t>(n));
    return true;
  };
  http_answer a;
  size_t head_end;
  while ((head_end = buf.find("\r\n\r\n")) == std::string::npos)
    if (!fill()) return a;
  a.head = buf.substr(0, head_end);
  a.status = std::stoi(a.head.substr(9, 3));
  buf.erase(0, head_end + 4);
  if (a.head.find("Transfer-Encoding: chunked") != std::string::npos) {
    for (;;) {
      size_t line;
      while ((line = buf.find("\r\n")) == std::string::npos)
        if (!fill()) return a;
      const size_t size = std::stoul(buf.substr(0, line), nullptr, 16);
      while (buf.size() < line + 2 + size + 2)
        if (!fill()) return a;
      a.body += buf.substr(line + 2, size);
      buf.erase(0, line + 2 + size + 2);
      if (size == 0) return a;
    }
  }
  const auto cl = a.head.find("Content-Length: ");
  if (cl == std::string::npos) return a;  // a 204: no body
  const size_t length = std::stoul(a.head.substr(cl + 16));
  while (buf.size() < length)
    if (!fill()) return a;
  a.body = buf.substr(0, length);
  buf.erase(0, length);
  return a;
}

/// `got` and whatever else comes until the gateway closes the connection (bounded: recv's
/// timeout is 30 s); `closed`, if given, says whether it did (not the timeout).
inline std::string read_to_close(int fd, std::string got = {}, bool* closed = nullptr) {
  char tmp[65536];
  for (int i = 0; i < 10000; ++i) {
    const auto n = ::recv(fd, tmp, sizeof tmp, 0);
    if (closed) *closed = n == 0;
    if (n <= 0) break;
    got.append(tmp, static_cast<size_t>(n));
  }
  return got;
}

/// Reads up to the end of an answer's head (a "100 Continue" is all head) into a fresh string.
inline std::string read_head(int fd) {
  std::string buf;
  char tmp[4096];
  while (buf.find("\r\n\r\n") == std::string::npos) {
    const auto n = ::recv(fd, tmp, sizeof(tmp), 0);
    REQUIRE(n > 0);
    buf.append(tmp, static_cast<size_t>(n));
  }
  return buf;
}

inline std::string post(const std::string& path, const std::string& body, const std::string& key = "sk-test") {
  return "POST " + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n" +
         (key.empty() ? std::string{} : "Authorization: Bearer " + key + "\r\n") +
         "Content-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body;
}

inline std::string get(const std::string& path, const std::string& key = "sk-test") {
  return "GET " + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\n" +
         (key.empty() ? std::string{} : "Authorization: Bearer " + key + "\r\n") + "\r\n";
}

inline http_answer round_trip(uint16_t port, const std::string& raw) {
  const int fd = connect_to(port);
  send_all(fd, raw);
  std::string buf;
  auto a = read_answer(fd, buf);
  ::close(fd);
  return a;
}

/// The text of a server-sent-event stream's events, joined; the parsed events in `events`.
inline std::string sse_text(const std::string& body, std::vector<json>* events, bool chat = false) {
  std::string text;
  size_t pos = 0;
  while ((pos = body.find("data: ", pos)) != std::string::npos) {
    const auto end = body.find("\n\n", pos);
    const auto data = body.substr(pos + 6, end - pos - 6);
    pos = end;
    if (data == "[DONE]") {
      events->push_back("[DONE]");
      continue;
    }
    auto j = json::parse(data);
    events->push_back(j);
    if (j.contains("choices") && !j["choices"].empty()) {
      const auto& c = j["choices"][0];
      if (chat && c["delta"].contains("content")) text += c["delta"]["content"].get<std::string>();
      if (!chat) text += c["text"].get<std::string>();
    }
  }
  return text;
}

struct served_cluster {
  caf::actor_system_config cfg;
  caf::actor_system sys;
  local_cluster cluster;
  deploy::gateway_handle gateway;
  static caf::actor_system_config& init(caf::actor_system_config& c) {
    register_message_types(c);
    c.load<caf::io::middleman>();
    c.set("scheduler.max-threads", 2);
    c.set("logger.console-verbosity", caf::atom("quiet"));
    return c;
  }
  /// Prefill and decode jobs may start late (a fault executor), to test deadlines. The model: the
  /// trained built-in one by default (its text is real UTF-8; a random model's bytes would not be).
  explicit served_cluster(deploy::gateway_config gc = {}, uint32_t prefill_delay_ms = 0, uint32_t decode_delay_ms = 0,
                          const std::string& model_dir = BATON_SOURCE_DIR "/models/baton-kjv-tiny",
                          uint32_t max_active_requests = 0)
      : sys(init(cfg)) {
    local_cluster_config cc;
    std::string why;
    REQUIRE_MESSAGE(deploy::load_model_into(model_dir, &cc, &why), why);
    if (max_active_requests) cc.router.max_active_requests = max_active_requests;
    executor_factory make_exec;
    if (prefill_delay_ms > 0 || decode_delay_ms > 0)
      make_exec = [model = cc.model, weights = cc.weights, ec = cc.executor, prefill_delay_ms,
                   decode_delay_ms](const std::string& name) -> std::shared_ptr<gpu::executor> {
        std::shared_ptr<gpu::executor> exec = gpu::make_cpu_executor(model, weights, ec);
        const uint32_t delay = name.rfind("prefill", 0) == 0 ? prefill_delay_ms : decode_delay_ms;
        return delay > 0 ? gpu::make_fault_slow_executor(exec, delay) : exec;
      };
    cluster = start_local_cluster(sys, cc, make_exec);
    gc.port = 0;
    if (gc.api_keys.empty()) gc.api_keys = {"sk-other", "sk-test"};
    REQUIRE_MESSAGE(deploy::spawn_gateway(sys, gc, cluster.router, &gateway, &why), why);
    wait_registered();
  }
  ~served_cluster() {
    caf::scoped_actor self{sys};
    self->send_exit(gateway.server, caf::exit_reason::user_shutdown);
    for (auto& a : cluster.actors()) self->send_exit(a, caf::exit_reason::user_shutdown);
  }
  cluster_stats stats() {
    caf::scoped_actor self{sys};
    cluster_stats out;
    self->request(cluster.router, std::chrono::seconds{5}, stats_atom::value)
        .receive([&](cluster_stats& s) { out = std::move(s); }, [](caf::error&) {});
    return out;
  }
  void wait_registered() {
    for (int i = 0; i < 1000; ++i) {
      auto s = stats();
      if (s.prefill.size() == cluster.prefill.size() && s.decode.size() == cluster.decode.size()) return;
      std::this_thread::sleep_for(std::chrono::milliseconds{2});
    }
    FAIL("ranks did not register");
  }
  completion direct(generate_request req) {
    caf::scoped_actor self{sys};
    completion out;
    self->request(cluster.router, std::chrono::seconds{60}, generate_atom::value, std::move(req))
        .receive([&](completion& c) { out = std::move(c); }, [&](caf::error& e) { FAIL(sys.render(e)); });
    return out;
  }
  /// Waits (bounded) until no request is alive and every decode rank's pages are free again.
  bool settles() {
    for (int i = 0; i < 2000; ++i) {
      auto s = stats();
      bool free = s.num_active == 0 && s.decode.size() == cluster.decode.size();
      for (const auto& d : s.decode) free = free && d.num_free_pages == d.num_total_pages && d.num_running == 0;
      if (free) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds{5});
    }
    return false;
  }
};

/// The built-in model (its weights and tokenizer, linked) under another chat template, in a
/// temporary directory removed with the object.
struct templated_model {
  std::filesystem::path path;
  /// `add_bos`: its tokenizer puts <|bos|> before every text prompt (tokenizer_config.json).
  templated_model(const std::string& name, const std::string& chat_template, bool add_bos = false) {
    path = std::filesystem::temp_directory_path() / ("baton-chat-" + name + "-" + std::to_string(::getpid()));
    std::filesystem::create_directories(path);
    const std::filesystem::path src = BATON_SOURCE_DIR "/models/baton-kjv-tiny";
    for (const char* f : {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"})
      std::filesystem::create_symlink(src / f, path / f);
    std::ofstream{path / "tokenizer_config.json"} << json{{"add_bos_token", add_bos}, {"chat_template", chat_template}}.dump();
  }
  ~templated_model() { std::filesystem::remove_all(path); }
};

}  // namespace baton::test_gateway
