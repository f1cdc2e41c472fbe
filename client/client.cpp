// The client library's one translation unit: an actor system of its own, the router as a remote
// actor, and per request a small sink actor that turns stream_chunk messages into a queue that
// the caller's thread reads.

#include "client/baton/client.hpp"

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
  auto watching_request = std::make_shared<bool>(false);
  self->set_down_handler([=](caf::down_msg& dm) {
    const bool from_router = dm.source == router_addr;
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
  stream_impl(caf::actor sink, std::shared_ptr<channel> ch) : sink_(std::move(sink)), ch_(std::move(ch)) {}
  ~stream_impl() override {
    if (!done()) cancel();
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
    {
      std::lock_guard<std::mutex> guard{ch_->mutex};
      if (ch_->ended) return;
      ch_->ended = ch_->failed = true;
      ch_->err = {"cancelled", "cancelled by the client", false};
      ch_->cv.notify_all();
    }
    // The request actor watches its sink: the sink's exit cancels the generation and frees its KV.
    caf::anon_send_exit(sink_, caf::exit_reason::user_shutdown);
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
  caf::actor sink_;
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
  ~connection_impl() override = default;

  bool open(const std::string& host, uint16_t port, std::string* why) {
    const bool tls = !options_.tls_cert.empty();
    if (auto err = net::handshake_within(sys_, host, port, std::chrono::seconds{10},
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
    return true;
  }

  std::unique_ptr<stream> submit(const request& r) override {
    auto ch = std::make_shared<channel>();
    auto sink = sys_.spawn(sink_impl, router_, to_request(r), ch);
    return std::make_unique<stream_impl>(std::move(sink), std::move(ch));
  }

  bool model_info(std::string* name, uint32_t* context_tokens, std::string* why) override {
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
};

}  // namespace

std::unique_ptr<connection> connection::connect(const std::string& host, uint16_t port, std::string* why) {
  return connect(host, port, connect_options{}, why);
}

std::unique_ptr<connection> connection::connect(const std::string& host, uint16_t port, const connect_options& options,
                                                std::string* why) {
  const int given = !options.tls_cert.empty() + !options.tls_key.empty() + !options.tls_ca.empty();
  if (given != 0 && given != 3) {
    *why = "TLS needs all three of tls_cert, tls_key and tls_ca";
    return nullptr;
  }
  auto c = std::make_unique<connection_impl>(options);
  if (!c->open(host, port, why)) return nullptr;
  return c;
}

}  // namespace baton::client
