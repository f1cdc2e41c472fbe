// The client library's one translation unit: an actor system of its own, the router as a remote
// actor, and per request a small sink actor that turns stream_chunk messages into a queue that
// the caller's thread reads.

#include "client/baton/client.hpp"

#include <fcntl.h>
#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <condition_variable>
#include <deque>
#include <mutex>

#include <caf/actor_system.hpp>
#include <caf/actor_system_config.hpp>
#include <caf/event_based_actor.hpp>
#include <caf/io/middleman.hpp>
#include <caf/openssl/manager.hpp>
#include <caf/openssl/remote_actor.hpp>
#include <caf/scoped_actor.hpp>
#include <caf/send.hpp>

#include "actors/messages.hpp"
#include "actors/wire_identity.hpp"
#include "client/net_identity.hpp"
#include "gpu/json_schema_grammar.hpp"

namespace baton::client {

namespace {

/// What the sink actor hands to the reading thread. The sink pushes, the reader pops.
struct channel {
  std::mutex mutex;
  std::condition_variable cv;
  std::deque<token_chunk> chunks;
  bool ended = false;
  bool failed = false;
  result done;
  error err;
  /// The request's sink actor, held here (not by the stream) so that a connection going away
  /// takes every handle of its actor system with it, from streams that outlive it too.
  caf::actor sink;
};

error to_client_error(caf::actor_system& sys, const caf::error& e) {
  error out;
  if (e.category() == caf::atom("baton")) {
    const auto code = static_cast<errc>(e.code());
    out.code = to_string(code);
    out.retryable = is_retryable(code);
    out.message = e.context().match_elements<std::string>() ? e.context().get_as<std::string>(0) : sys.render(e);
  } else {
    out.code = e == caf::sec::request_receiver_down ? "rank_unavailable" : "transport";
    out.retryable = true;
    out.message = "the router: " + sys.render(e);
  }
  return out;
}

// The client's kinds travel as the router's numbers.
static_assert(static_cast<uint8_t>(output_kind::json_object) == static_cast<uint8_t>(gpu::output_format::object) &&
              static_cast<uint8_t>(output_kind::json_schema) == static_cast<uint8_t>(gpu::output_format::schema) &&
              static_cast<uint8_t>(output_kind::regex) == static_cast<uint8_t>(gpu::output_format::regex) &&
              static_cast<uint8_t>(output_kind::gbnf) == static_cast<uint8_t>(gpu::output_format::gbnf));

generate_request to_request(const request& r) {
  generate_request g;
  g.prompt = r.prompt;
  g.prompt_tokens = r.prompt_tokens;
  for (const auto& [role, content] : r.messages) g.messages.push_back({role, content});
  g.max_tokens = r.max_tokens;
  g.temperature = r.temperature;
  g.seed = r.seed;
  g.top_k = r.top_k;
  g.top_p = r.top_p;
  g.repetition_penalty = r.repetition_penalty;
  g.presence_penalty = r.presence_penalty;
  g.frequency_penalty = r.frequency_penalty;
  g.min_p = r.min_p;
  g.min_tokens = r.min_tokens;
  for (const auto& [token, bias] : r.logit_bias) {
    g.logit_bias_tokens.push_back(token);
    g.logit_bias_values.push_back(bias);
  }
  g.output_format = static_cast<uint8_t>(r.output);
  g.output_spec = r.output_spec;
  g.json_compact = r.json_compact;
  g.stop = r.stop;
  g.stop_token_ids = r.stop_token_ids;
  g.include_stop_str_in_output = r.include_stop_str_in_output;
  g.ignore_eos = r.ignore_eos;
  g.traffic_class = r.traffic_class;
  g.priority = r.priority;
  g.logprobs = r.logprobs;
  g.top_logprobs = r.top_logprobs;
  g.prompt_logprobs = r.prompt_logprobs;
  return g;
}

/// A watched actor went before the answer came: the stream fails after this grace (sink_impl).
using gone_atom = caf::atom_constant<caf::atom("gone")>;
constexpr std::chrono::seconds answer_grace{5};

/// Whether the connection's router is still there: set once, by the connection's watcher, when
/// the router actor ends or the link to its process is lost.
struct link_state {
  std::atomic<bool> lost{false};
  std::mutex mutex;
  std::string why;  ///< once lost
};

caf::behavior sink_impl(caf::event_based_actor* self, router_actor router, generate_request req,
                        std::shared_ptr<channel> ch) {
  auto end = [ch](auto&& fill) {
    std::lock_guard<std::mutex> guard{ch->mutex};
    if (ch->ended) return;
    fill();
    ch->ended = true;
    ch->cv.notify_all();
  };
  // The router until the first chunk, then the request actor that sent it, are watched: one
  // that goes before the answer (its node or link gone, an actor that failed) would leave the
  // request unanswered -- CAF 0.17 does not always fail it -- and the reader waiting out its
  // whole timeout. An answer sent just before a normal end may still be behind the down message
  // (a short request's actor can end before this node learns of it): it has the grace to come.
  const auto router_addr = caf::actor_cast<caf::actor_addr>(router);
  self->monitor(router);
  // Ended another way (the connection closed, a cancel): a reader waiting on the stream hears so.
  self->attach_functor([=] {
    end([&] {
      ch->failed = true;
      ch->err = {"cancelled", "the connection was closed before the answer", false};
    });
  });
  auto watching_request = std::make_shared<bool>(false);
  self->set_down_handler([=](caf::down_msg& dm) {
    const bool from_router = dm.source == router_addr;
    // The link to the router's process is gone (its request actors live there too): no answer
    // can come behind this, so no grace.
    if (dm.reason == caf::exit_reason::remote_link_unreachable) {
      end([&] {
        ch->failed = true;
        ch->err = {"router_gone", "the connection to the router was lost before the answer", true};
      });
      return self->quit();
    }
    self->delayed_send(self, answer_grace, gone_atom::value, from_router,
                       std::string{from_router ? "the router" : "the request's actor"} + " ended before the answer (" +
                           self->system().render(dm.reason) + ")");
  });
  self->request(router, caf::infinite, generate_atom::value, std::move(req), caf::actor_cast<client_sink_actor>(self))
      .then(
          [=](completion& c) {
            end([&] {
              ch->done = {};
              ch->done.request_id = c.request_id;
              ch->done.tokens = std::move(c.tokens);
              ch->done.text = std::move(c.text);
              ch->done.finish_reason = std::move(c.finish_reason);
              ch->done.num_prompt_tokens = c.num_prompt_tokens;
              ch->done.cached_tokens = c.cached_tokens;
              ch->done.ttft_us = c.ttft_us;
              ch->done.tbt_us = std::move(c.tbt_us);
              ch->done.prefill_rank = c.prefill_rank;
              ch->done.decode_rank = c.decode_rank;
              for (auto& t : c.prompt_logprobs)
                ch->done.prompt_logprobs.push_back({t.token, t.logprob, std::move(t.text), std::move(t.top_tokens),
                                                    std::move(t.top_logprobs), std::move(t.top_texts)});
              ch->done.failovers = c.failovers;
              ch->done.failover_why = std::move(c.failover_why);
              ch->done.migrations = c.migrations;
            });
            self->quit();
          },
          [=](caf::error& e) {
            end([&] {
              ch->failed = true;
              ch->err = to_client_error(self->system(), e);
            });
            self->quit();
          });
  return {
      [=](gone_atom, bool from_router, std::string& why) {
        if (from_router && *watching_request) return;  // the request's own actor speaks for it now
        end([&] {
          ch->failed = true;
          ch->err = {from_router ? "router_gone" : "rank_unavailable", why, true};
        });
        self->quit();
      },
      [=](stream_chunk& c) {
        if (!*watching_request) {
          *watching_request = true;
          if (auto from = self->current_sender()) self->monitor(from);
        }
        std::lock_guard<std::mutex> guard{ch->mutex};
        token_chunk out{c.request_id, c.first_index, std::move(c.tokens), std::move(c.text), std::move(c.finish_reason), {}};
        for (auto& t : c.logprobs)
          out.logprobs.push_back({t.token, t.logprob, std::move(t.text), std::move(t.top_tokens), std::move(t.top_logprobs),
                                  std::move(t.top_texts)});
        ch->chunks.push_back(std::move(out));
        ch->cv.notify_all();
      },
  };
}

class stream_impl final : public stream {
 public:
  explicit stream_impl(std::shared_ptr<channel> ch) : ch_(std::move(ch)) {}
  ~stream_impl() override {
    if (!done()) cancel();
    caf::actor sink;  // let go outside the lock (the sink's arguments hold the channel: no cycle left)
    std::lock_guard<std::mutex> guard{ch_->mutex};
    sink = std::move(ch_->sink);
  }

  bool next(token_chunk* out, std::chrono::milliseconds timeout) override {
    std::unique_lock<std::mutex> lock{ch_->mutex};
    timed_out_ = !ch_->cv.wait_for(lock, timeout, [&] { return !ch_->chunks.empty() || ch_->ended; });
    if (ch_->chunks.empty()) return false;
    *out = std::move(ch_->chunks.front());
    ch_->chunks.pop_front();
    return true;
  }
  void cancel() override {
    caf::actor sink;
    {
      std::lock_guard<std::mutex> guard{ch_->mutex};
      if (ch_->ended) return;
      ch_->ended = ch_->failed = true;
      ch_->err = {"cancelled", "cancelled by the client", false};
      ch_->cv.notify_all();
      sink = ch_->sink;
    }
    // The request actor watches its sink: the sink's exit cancels the generation and frees its KV.
    if (sink) caf::anon_send_exit(sink, caf::exit_reason::user_shutdown);
  }
  bool done() const override {
    std::lock_guard<std::mutex> guard{ch_->mutex};
    return ch_->ended && ch_->chunks.empty();
  }
  bool failed() const override {
    std::lock_guard<std::mutex> guard{ch_->mutex};
    return ch_->failed;
  }
  bool timed_out() const override { return timed_out_; }
  const result& final_result() const override { return ch_->done; }
  const error& error_info() const override { return ch_->err; }

 private:
  std::shared_ptr<channel> ch_;
  bool timed_out_ = false;
};

caf::actor_system_config& client_config(caf::actor_system_config& cfg, const connect_options& o) {
  register_message_types(cfg);
  cfg.load<caf::io::middleman>();
  net::apply_identity(cfg, o.cluster_id, o.tls_cert, o.tls_key, o.tls_ca);
  cfg.set("scheduler.max-threads", 2);
  cfg.set("work-stealing.moderate-poll-attempts", 0);
  cfg.set("logger.console-verbosity", caf::atom("quiet"));
  return cfg;
}

class connection_impl final : public connection {
 public:
  explicit connection_impl(connect_options o) : options_(std::move(o)), sys_{client_config(cfg_, options_)} {}
  /// Streams still going are cancelled (their generations stop, their readers hear "cancelled"):
  /// the actor system's end waits for every actor, and a sink waits for its answer.
  ~connection_impl() override {
    std::lock_guard<std::mutex> guard{channels_mutex_};
    for (auto& w : channels_)
      if (auto ch = w.lock()) {
        caf::actor sink;
        {
          std::lock_guard<std::mutex> lock{ch->mutex};
          sink = std::move(ch->sink);
        }
        if (sink) caf::anon_send_exit(sink, caf::exit_reason::user_shutdown);
      }
    if (watcher_) caf::anon_send_exit(watcher_, caf::exit_reason::user_shutdown);
  }

  bool open(const std::string& host, uint16_t port, std::string* why) {
    const bool tls = !options_.tls_cert.empty();
    const auto limit = std::chrono::milliseconds{options_.connect_timeout_ms};
    // CAF's connect would wait out the kernel's SYN retries (minutes) where packets are dropped.
    if (net::tcp_probe(host, port, static_cast<int>(options_.connect_timeout_ms)) == ETIMEDOUT) {
      *why = "cannot reach a Baton router at " + host + ":" + std::to_string(port) + ": nothing accepted a TCP connection within " +
             std::to_string(options_.connect_timeout_ms) + " ms (packets dropped on the way, or a full listen queue)";
      return false;
    }
    if (auto err = net::handshake_within(sys_, host, port, limit,
                                         tls ? &sys_.openssl_manager().actor_handle() : nullptr)) {
      *why = "cannot reach a Baton router at " + host + ":" + std::to_string(port) + ": " +
             net::explain_connect_error(sys_, err, tls);
      return false;
    }
    auto r = options_.tls_cert.empty() ? sys_.middleman().remote_actor<router_actor>(host, port)
                                       : caf::openssl::remote_actor<router_actor>(sys_, host, port);
    if (!r) {
      *why = "cannot reach a Baton router at " + host + ":" + std::to_string(port) + ": " +
             net::explain_connect_error(sys_, r.error(), !options_.tls_cert.empty());
      return false;
    }
    router_ = *r;
    const auto where = host + ":" + std::to_string(port);
    watcher_ = sys_.spawn([link = link_, router = router_, where](caf::event_based_actor* self) -> caf::behavior {
      self->monitor(router);
      self->set_down_handler([=](caf::down_msg& dm) {
        {
          std::lock_guard<std::mutex> guard{link->mutex};
          link->why = dm.reason == caf::exit_reason::remote_link_unreachable
                          ? "the connection to the router at " + where + " was lost: connect again"
                          : "the router at " + where + " has ended (" + self->system().render(dm.reason) + "): connect again";
        }
        link->lost = true;
        self->quit();
      });
      return {[](int32_t) {}};  // it only watches
    });
    return true;
  }

  std::unique_ptr<stream> submit(const request& r) override {
    auto ch = std::make_shared<channel>();
    if (link_->lost) {  // at once, not after a watch of a router known to be gone
      std::lock_guard<std::mutex> guard{link_->mutex};
      ch->ended = ch->failed = true;
      ch->err = {"router_gone", link_->why, true};
      return std::make_unique<stream_impl>(std::move(ch));
    }
    auto sink = sys_.spawn(sink_impl, router_, to_request(r), ch);
    {
      std::lock_guard<std::mutex> lock{ch->mutex};
      ch->sink = std::move(sink);
    }
    {
      std::lock_guard<std::mutex> guard{channels_mutex_};
      // Those of streams gone are dropped as new ones come: the list stays as long as the streams kept.
      channels_.erase(std::remove_if(channels_.begin(), channels_.end(), [](const auto& w) { return w.expired(); }),
                      channels_.end());
      channels_.push_back(ch);
    }
    return std::make_unique<stream_impl>(std::move(ch));
  }

  bool connected() const override { return !link_->lost; }

  bool model_info(std::string* name, uint32_t* context_tokens, std::string* why) override {
    if (link_->lost) {
      std::lock_guard<std::mutex> guard{link_->mutex};
      *why = link_->why;
      return false;
    }
    caf::scoped_actor self{sys_};
    bool ok = false;
    self->request(router_, std::chrono::seconds{10}, stats_atom::value)
        .receive(
            [&](cluster_stats& s) {
              *name = s.model;
              *context_tokens = s.context_tokens;
              ok = true;
            },
            [&](caf::error& e) { *why = "the router did not answer: " + sys_.render(e); });
    return ok;
  }

 private:
  connect_options options_;
  caf::actor_system_config cfg_;
  caf::actor_system sys_;
  router_actor router_;
  std::shared_ptr<link_state> link_ = std::make_shared<link_state>();
  caf::actor watcher_;
  std::mutex channels_mutex_;
  std::vector<std::weak_ptr<channel>> channels_;  ///< each stream's, for the destructor
};

}  // namespace

const char* library_version() { return BATON_VERSION; }

const char* wire_fingerprint() { return baton::wire_fingerprint(); }

std::unique_ptr<connection> connection::connect(const std::string& host, uint16_t port, std::string* why) {
  return connect(host, port, connect_options{}, why);
}

std::unique_ptr<connection> connection::connect(const std::string& host, uint16_t port, const connect_options& options,
                                                std::string* why) {
  std::string ignored;
  if (!why) why = &ignored;
  if (options.connect_timeout_ms == 0) {
    *why = "connect_timeout_ms must be >= 1";
    return nullptr;
  }
  const int given = !options.tls_cert.empty() + !options.tls_key.empty() + !options.tls_ca.empty();
  if (given != 0 && given != 3) {
    *why = "TLS needs all three of tls_cert, tls_key and tls_ca";
    return nullptr;
  }
  // Each file read now: CAF's TLS would fail on its I/O thread (an exception printed to stderr)
  // and the connect would wait out its handshake for a sentence about the wrong port.
  for (const auto& [name, path] : {std::pair{"tls_cert", &options.tls_cert}, {"tls_key", &options.tls_key},
                                   {"tls_ca", &options.tls_ca}}) {
    if (path->empty()) continue;
    struct stat info {};
    const int fd = ::open(path->c_str(), O_RDONLY);
    const int err = fd < 0 ? errno : (::fstat(fd, &info) != 0 ? errno : 0);
    if (fd >= 0) ::close(fd);
    if (err != 0 || !S_ISREG(info.st_mode)) {
      *why = std::string{name} + ": cannot read " + *path + " (" + (err ? std::strerror(err) : "not a file") + ")";
      return nullptr;
    }
  }
  // The certificates must be PEM certificates (a file of something else made CAF throw on its
  // I/O thread, leak, and the connect wait out its time). The key is left to CAF: it may be
  // one this check could only read by asking for a passphrase.
  for (const auto& [name, path] : {std::pair{"tls_cert", &options.tls_cert}, {"tls_ca", &options.tls_ca}}) {
    if (path->empty()) continue;
    FILE* f = std::fopen(path->c_str(), "r");
    X509* cert = f ? PEM_read_X509(f, nullptr, nullptr, nullptr) : nullptr;
    const bool ok = cert != nullptr;
    X509_free(cert);
    if (f) std::fclose(f);
    ERR_clear_error();
    if (!ok) {
      *why = std::string{name} + ": " + *path + " holds no PEM certificate";
      return nullptr;
    }
  }
  auto c = std::make_unique<connection_impl>(options);
  if (!c->open(host, port, why)) return nullptr;
  return c;
}

}  // namespace baton::client
