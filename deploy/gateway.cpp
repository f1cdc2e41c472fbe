#include "deploy/gateway.hpp"

#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <atomic>
#include <chrono>
#include <mutex>
#include <optional>
#include <random>
#include <string_view>
#include <thread>

#include <caf/actor_system.hpp>
#include <caf/io/broker.hpp>
#include <caf/event_based_actor.hpp>
#include <caf/io/middleman.hpp>
#include <caf/typed_event_based_actor.hpp>
#include <caf/actor_ostream.hpp>
#include <caf/scoped_actor.hpp>
#include <caf/send.hpp>

#include "deploy/access_log.hpp"
#include "deploy/gateway_call.hpp"
#include "deploy/gateway_errors.hpp"
#include "deploy/gateway_shared.hpp"
#include "deploy/metrics.hpp"
#include "deploy/openai.hpp"
#include "deploy/processes.hpp"

namespace baton::deploy {

namespace {

using shared_ptr = std::shared_ptr<gateway_shared>;

/// A lingering close ran its time (finish()).
using linger_atom = caf::atom_constant<caf::atom("linger")>;
/// How long a connection closing after its answer keeps reading (and dropping) what the client
/// still sends, so that the client reads the answer instead of a reset.
constexpr std::chrono::milliseconds linger_time{2000};

/// Connections taken past max_connections for /health and /metrics alone, and how long one may
/// idle.
constexpr uint32_t probe_connections = 16;
constexpr std::chrono::milliseconds probe_idle{2000};



/// One connection's progress. Requests on a connection are answered one at a time, in order
/// (HTTP/1.1 pipelining); `busy` holds the next one back until the current one is answered.
struct connection_state {
  std::string in;     ///< received; bytes before in_off are parsed (compacted once per pump)
  size_t in_off = 0;
  bool busy = false;
  bool keep_alive = true;
  bool closed = false;    ///< finish() closed it: nothing pipelined behind may start
  bool lingering = false;    ///< closed: the answer is being sent, then our side shut, input dropped
  bool half_closed = false;  ///< lingering and our side is shut (SHUT_WR): the client saw the end
  /// Bytes written and not yet sent (the socket's buffers full: a client that does not read).
  /// Past out_limit_bytes no further pipelined request starts and reads stop.
  uint64_t out_pending = 0;
  std::chrono::steady_clock::time_point out_progress = std::chrono::steady_clock::now();  ///< last bytes sent
  /// When the request being received began to arrive: it must be complete within the idle
  /// timeout however slowly it trickles in (slowloris).
  std::chrono::steady_clock::time_point request_started = std::chrono::steady_clock::now();
  bool pumping = false;   ///< pump()'s loop is running: finish() leaves the next request to it
  bool reading = true;    ///< false while reads are halted (a pipelined backlog past the limits)
  bool sent_continue = false;  ///< "100 Continue" written for the request being received
  http::chunked_progress body_progress;  ///< the chunks of the request being received decoded so far
  bool head_only = false;      ///< a HEAD request: the answer's head without its body
  bool chunked = true;         ///< the client speaks HTTP/1.1: a stream goes in chunks (1.0: until close)
  std::chrono::steady_clock::time_point last_activity = std::chrono::steady_clock::now();
  std::string route;
  // The answer in progress, if any.
  bool in_call = false;
  /// A tokenizer call (/tokenize, /detokenize) waits on the router: counted in flight, so a
  /// drain waits for its answer, but no generation (its refusals are the route's, not a call's).
  bool in_ask = false;
  uint64_t call_seq = 0;     ///< numbers the calls: a chunk of an earlier call is dropped
  caf::actor call_sink;      ///< renders the call's chunks; its exit cancels the generation
  std::string call_id;       ///< the call's answer id (cmpl-..., chatcmpl-...), also its x-request-id header
  bool token_seen = false;   ///< the call's first token came (its first-token deadline is void)
  uint64_t first_request = 0;  ///< the router's number of the generation whose token came first (0: none yet)
  /// When the call began: its first token is due within first_token_timeout_ms (the connection's
  /// timer checks; a timer message per call would pile up for the whole timeout at high rates).
  std::chrono::steady_clock::time_point call_started;
  bool head_sent = false;
  /// A streaming call (its go-between said so): until its first token, the head and a comment
  /// line go out at keepalive_due and every stream_keepalive_ms after.
  bool streaming = false;
  std::chrono::steady_clock::time_point keepalive_due;
  std::string cors_origin;  ///< the current request's Origin, when the gateway lets it call (cors_origins)
  /// The current request's own x-request-id (an ingress's, Envoy's or the client's), echoed in
  /// its answer and logged beside the call's id, so the id a client or proxy already logs finds
  /// the call; empty when it sent none.
  std::string client_request_id;
  api_key_ptr key;  ///< the current request's API key (null: the gateway has none, or the route needs none)
  std::string request_line;  ///< "METHOD /path" of the current request, for the log of a refusal
  bool probes_only = false;  ///< one of the connections past max_connections: /health and /metrics only
  uint64_t number = 0;       ///< the connection's number at the server (wake_later)
  std::atomic<uint64_t>* total_out = nullptr;  ///< gateway_shared::out_pending, which out_pending counts into
};
using state_ptr = std::shared_ptr<connection_state>;

/// Sends `what` to the connection `self` after `delay`, through the server. A broker that ends
/// with a delayed message to itself still pending is never freed (CAF 0.17.6, measured: every
/// connection's idle timer kept its 1.5 KB for good, a soak trial's steady growth); the server
/// lives as long as the gateway, and a connection that has ended is simply not woken. Its timers
/// name it by number, and it has the server forget its address as it ends: an address kept in a
/// timer kept the connection's storage as long as the timer (a connect-and-close flood held
/// hundreds of MB for the idle tick, a re-trial). Once the server has stopped (the process is
/// ending) the connection times itself: its lingering close and idle limit must still end it.
void wake_later(caf::io::broker* self, const shared_ptr& g, const state_ptr& st, std::chrono::milliseconds delay,
                caf::atom_value what) {
  auto server = caf::actor_cast<caf::actor>(g->server);
  if (server && !server->getf(caf::abstract_actor::is_terminated_flag))
    caf::anon_send(server, wake_atom::value, static_cast<uint32_t>(delay.count()), st->number, self->address(), what);
  else
    self->delayed_send(self, delay, what);
}

/// Answers queued for a client that does not read past this stop the connection's further
/// requests and reads; a whole streamed generation fits below it.
constexpr uint64_t out_limit_bytes = 1 << 20;

void write(caf::io::broker* self, caf::io::connection_handle hdl, const state_ptr& st, const std::string& data) {
  if (data.empty()) return;
  if (st->out_pending == 0) st->out_progress = std::chrono::steady_clock::now();
  st->out_pending += data.size();  // until the next data_transferred_msg says how much is left
  if (st->total_out) *st->total_out += data.size();
  self->write(hdl, data.size(), data.data());
  self->flush(hdl);
}

/// Closes at once, dropping what is still queued (the peer stopped reading, or went silent):
/// CAF's close waits for the buffers to drain, which a peer with a zero window prevents for ever.
/// The connection handle of CAF's default multiplexer is the socket.
void abort_connection(caf::io::broker* self, caf::io::connection_handle hdl) {
  const int fd = static_cast<int>(hdl.id());
  const linger hard{1, 0};  // RST: no FIN_WAIT with unsent data
  ::setsockopt(fd, SOL_SOCKET, SO_LINGER, &hard, sizeof hard);
  ::shutdown(fd, SHUT_RDWR);  // the scribe's next read or write fails and it closes
  self->close(hdl);
  self->quit();
}

void pump(caf::io::broker* self, caf::io::connection_handle hdl, const shared_ptr& g, const state_ptr& st);

/// The call's sink goes: a generation still running is cancelled (its request actor watches the
/// sink), and chunks still on their way find nobody.
void end_call(caf::io::broker* self, const shared_ptr& g, const state_ptr& st) {
  if (std::exchange(st->in_call, false)) --g->calls_in_flight;
  if (std::exchange(st->in_ask, false)) --g->calls_in_flight;
  if (st->call_sink) self->send_exit(st->call_sink, caf::exit_reason::user_shutdown);
  st->call_sink = nullptr;
}

/// Lingering: once the answer is all sent, our side is shut (the client reads its end).
void half_close_when_sent(caf::io::connection_handle hdl, const state_ptr& st) {
  if (!st->lingering || st->half_closed || st->out_pending > 0) return;
  st->half_closed = true;
  ::shutdown(static_cast<int>(hdl.id()), SHUT_WR);  // the scribe's socket (CAF's default multiplexer)
}

/// Ends the current answer: the next pipelined request may start, or the connection closes.
void finish(caf::io::broker* self, caf::io::connection_handle hdl, const shared_ptr& g, const state_ptr& st) {
  st->busy = false;
  st->last_activity = st->request_started = std::chrono::steady_clock::now();
  end_call(self, g, st);
  // Draining: a stream whose head said keep-alive still ends its connection after its last
  // chunk, so that the client's next call goes to another replica.
  if (g->draining) st->keep_alive = false;
  st->cors_origin.clear();  // the next answer's (a malformed request's, a timeout's) has none
  st->client_request_id.clear();
  st->request_line.clear();
  st->key = nullptr;  // a shared upstream connection's next bytes are no longer this key's
  if (!st->keep_alive) {
    st->closed = true;  // a request pipelined behind this one is never started
    // A lingering close (RFC 9112 §9.6): a client still sending (a body past the limit answered
    // 413 before it all came, pipelined requests) gets a reset for its unread bytes, and some
    // stacks drop the answer unread on a reset (Linux on loopback did not, in our test). So:
    // send the answer, shut our side, and read and drop what comes until the client closes or
    // linger_time passes.
    st->lingering = true;
    if (!st->reading) {
      st->reading = true;
      self->trigger(hdl);
    }
    wake_later(self, g, st, linger_time, linger_atom::value);
    half_close_when_sent(hdl, st);
    return;
  }
  if (!st->reading && st->out_pending < out_limit_bytes) {  // a backlog halted reads: take in more
    st->reading = true;
    self->trigger(hdl);
  }
  pump(self, hdl, g, st);
}

/// A browser page of an allowed origin may read the answer (CORS); caches keep answers apart by
/// origin.
void add_cors(const shared_ptr& g, const state_ptr& st, http::header_list* extra) {
  // Answers differ by Origin unless any origin may read them: caches must keep them apart.
  const auto& allowed = g->cfg.cors_origins;
  if (!allowed.empty() && !(allowed.size() == 1 && allowed[0] == "*")) extra->emplace_back("Vary", "Origin");
  if (st->cors_origin.empty()) return;
  extra->emplace_back("Access-Control-Allow-Origin", st->cors_origin);
  extra->emplace_back("Access-Control-Expose-Headers", "Retry-After, retry-after-ms, x-request-id");  // a 503's or 429's wait; the call's id
}


/// A call's answer names it as OpenAI's do (SDKs read x-request-id into `request_id`), with the
/// id its body carries, so a client's report can be matched to the gateway's logs; a request
/// that came with its own id gets that one back (as Envoy and nginx propagate theirs), and the
/// log line holds both.
void add_request_id(const state_ptr& st, http::header_list* extra) {
  if (!st->client_request_id.empty()) extra->emplace_back("x-request-id", st->client_request_id);
  else if (st->in_call && !st->call_id.empty()) extra->emplace_back("x-request-id", st->call_id);
}

/// The call's line in the request log (gateway_config::log_requests), as it ends. Written by
/// CAF's printer actor (aout), not here: a slow reader of standard output must not stall the
/// middleman's one I/O thread, which every connection shares.
void log_call(caf::io::broker* self, const shared_ptr& g, const state_ptr& st, int status, bool stream,
              const std::vector<completion>* choices, std::string error = {}) {
  if (!g->cfg.log_requests) return;
  const double took_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - st->call_started).count();
  caf::aout(self) << access_line({std::chrono::system_clock::now(), st->call_id, st->route, status, stream, took_ms,
                                  choices, std::move(error), st->client_request_id, g->cfg.log_placements,
                                  st->key ? st->key->cfg.name + (st->key->batch ? " (batch)" : "") : std::string{}})
                  << std::endl;
}

/// A request refused before any call began (a wrong key, no such route, a malformed request,
/// too many connections, a draining gateway): its line in the request log, so a client that
/// sees only 401s or 404s finds them there too.
void log_refusal(caf::io::broker* self, const shared_ptr& g, const state_ptr& st, int status, const std::string& why) {
  if (!g->cfg.log_requests) return;
  caf::aout(self) << access_line({std::chrono::system_clock::now(), "-", st->request_line.empty() ? st->route : st->request_line,
                                  status, false, 0.0, nullptr, why, st->client_request_id})
                  << std::endl;
}

void reply(caf::io::broker* self, caf::io::connection_handle hdl, const shared_ptr& g, const state_ptr& st, int status,
           const std::string& body, const char* content_type = "application/json", http::header_list extra = {}) {
  g->metrics.count_response(st->route, status, st->key.get());
  const bool told = std::any_of(extra.begin(), extra.end(), [](const auto& h) { return h.first == "Retry-After"; });
  if ((status == 503 || status == 429) && !told) extra.emplace_back("Retry-After", "1");
  if (g->draining) st->keep_alive = false;  // the client's next request goes to another replica
  add_request_id(st, &extra);
  add_cors(g, st, &extra);
  auto out = http::response(status, content_type, body, st->keep_alive, extra);
  if (st->head_only) out.resize(out.size() - body.size());  // Content-Length stays: HEAD's rule
  write(self, hdl, st, out);
  finish(self, hdl, g, st);
}

/// A failed call, counted by reason and timed from its arrival.
void count_call_failure(const shared_ptr& g, const state_ptr& st, const std::string& reason) {
  g->metrics.count_failure(reason);
  g->metrics.failed_after(reason, std::chrono::duration<double>(std::chrono::steady_clock::now() - st->call_started).count());
}

void reply_error(caf::io::broker* self, caf::io::connection_handle hdl, const shared_ptr& g, const state_ptr& st,
                 const openai::api_error& e, http::header_list extra = {}) {
  if (!st->in_call) {  // a call's failure is logged and counted as the call's
    log_refusal(self, g, st, e.status, e.message);
    // A probe's 503, a scrape's refusal, a path that is no route: no API call failed (a trial
    // saw readiness probes during an outage inflate the failed calls).
    const bool call_route = st->route != "/health" && st->route != "/metrics" && st->route != "other";
    if (call_route) g->metrics.count_failure(e.status == 400 ? "bad_request" : "http_" + std::to_string(e.status));
  }
  reply(self, hdl, g, st, e.status, openai::error_json(e), "application/json", std::move(extra));
}

void event(caf::io::broker* self, caf::io::connection_handle hdl, const state_ptr& st, const std::string& data) {
  const std::string e = "data: " + data + "\n\n";
  write(self, hdl, st, st->chunked ? http::chunk(e) : e);
}

/// The stream's end: the last chunk, or (HTTP/1.0) nothing: finish() closes the connection.
void end_stream(caf::io::broker* self, caf::io::connection_handle hdl, const state_ptr& st) {
  if (st->chunked) write(self, hdl, st, http::last_chunk());
}

void generate(caf::io::broker* self, const shared_ptr& g, const state_ptr& st, const http::request& req, bool chat) {
  // The call lives in its go-between until its answer is written (finish() ends it).
  st->head_sent = false;
  st->in_call = true;
  ++g->calls_in_flight;
  st->token_seen = false;
  st->first_request = 0;
  st->streaming = false;
  st->call_started = std::chrono::steady_clock::now();
  const uint64_t seq = ++st->call_seq;
  st->call_id = (chat ? "chatcmpl-" : "cmpl-") + g->id_prefix + "-" + std::to_string(++g->last_id);
  st->call_sink = caf::actor_cast<caf::actor>(
      spawn_call(self->system(), caf::actor_cast<caf::actor>(self), seq, g->router, req.body, chat, g->model,
                 st->call_id, g->calls, st->key));
  self->monitor(st->call_sink);  // one that ends without answering fails its call (the down handler)
}

/// The stream's head, once, before its first event.
void stream_head(caf::io::broker* self, caf::io::connection_handle hdl, const shared_ptr& g, const state_ptr& st) {
  if (st->head_sent) return;
  if (g->draining) st->keep_alive = false;
  http::header_list extra;
  add_request_id(st, &extra);
  add_cors(g, st, &extra);
  if (st->chunked) {
    extra.emplace_back("Connection", st->keep_alive ? "keep-alive" : "close");
    write(self, hdl, st, http::chunked_head(200, "text/event-stream", extra));
  } else {
    st->keep_alive = false;  // the close is what ends the body
    write(self, hdl, st, http::close_delimited_head(200, "text/event-stream", extra));
  }
  st->head_sent = true;
}

/// A streaming call waiting for its first token: its head, once, and an SSE comment (which
/// clients skip) that shows a proxy the connection is alive.
void keep_stream_alive(caf::io::broker* self, caf::io::connection_handle hdl, const shared_ptr& g, const state_ptr& st) {
  stream_head(self, hdl, g, st);
  const std::string comment = ": waiting for the first token\n\n";
  write(self, hdl, st, st->chunked ? http::chunk(comment) : comment);
}

/// The client went before its answer was done (closed, or read too little): counted as nginx
/// counts it (499), and a call's cut logged with why; the caller ends the call (end_call).
void client_cut(caf::io::broker* self, const shared_ptr& g, const state_ptr& st, const std::string& why) {
  g->metrics.count_response(st->route, 499, st->key.get());
  // The router's number, once a token named it: the line leads to the request's other traces.
  if (st->in_call)
    log_call(self, g, st, 499, st->head_sent, nullptr,
             why + (st->first_request ? " (request " + std::to_string(st->first_request) + ", after its first token)"
                                      : " (before its first token)"));
}

/// The call's answer: the whole completion, or the end of its stream.
void on_done(caf::io::broker* self, caf::io::connection_handle hdl, const shared_ptr& g, const state_ptr& st,
             const std::vector<completion>& choices, const std::string& json, bool stream) {
  for (const auto& c : choices) g->metrics.record(c);
  log_call(self, g, st, 200, stream, &choices);
  if (!stream) return reply(self, hdl, g, st, 200, json);
  g->metrics.count_response(st->route, 200, st->key.get());
  stream_head(self, hdl, g, st);
  if (!json.empty()) event(self, hdl, st, json);
  event(self, hdl, st, "[DONE]");
  end_stream(self, hdl, st);
  finish(self, hdl, g, st);
}

/// The call's failure with `status`: an error answer, or the stream's last event once it began.
void fail_call(caf::io::broker* self, caf::io::connection_handle hdl, const shared_ptr& g, const state_ptr& st,
               int status, const std::string& msg, const std::string& reason = {}) {
  auto error = api_error_of(status, msg);
  if (error.param == "prompt" && st->route == "/v1/chat/completions") error.param = "messages";  // a chat's prompt
  // The cluster's reason for a server-side failure (kv_capacity, rank_unavailable, ...) as the
  // error's code, which a client can test, and every failure counted by it: a 503 for want of
  // KV reads apart from any other; the cluster's admission limit, shared by every caller, is
  // `overloaded`, not a caller's own rate_limit_exceeded. (A 400 keeps OpenAI's codes.)
  if (error.code.empty() && (status >= 500 || status == 429)) error.code = reason;
  count_call_failure(g, st, reason.empty() ? "http_" + std::to_string(status) : reason);
  log_call(self, g, st, status, st->head_sent, nullptr, msg);
  if (!st->head_sent) return reply_error(self, hdl, g, st, std::move(error));
  // The stream has begun (status 200 is sent): the error travels as an event, as OpenAI's do.
  // Responses count what went on the wire (200, as a load balancer's logs have it); the failure
  // counts by its reason in baton_request_failures_total above.
  g->metrics.count_response(st->route, 200, st->key.get());
  event(self, hdl, st, openai::error_json(error));
  end_stream(self, hdl, st);
  finish(self, hdl, g, st);
}

void on_failed(caf::io::broker* self, caf::io::connection_handle hdl, const shared_ptr& g, const state_ptr& st,
               const caf::error& e) {
  auto [status, msg] = status_of(self->system(), e);
  fail_call(self, hdl, g, st, status, msg,
            e.category() == caf::atom("baton") ? to_string(static_cast<errc>(e.code())) : std::string{});
}

/// Asks the router for the cluster's numbers; `then` gets them, or null when it did not answer.
template <class F>
void with_cluster_stats(caf::io::broker* self, const shared_ptr& g, F then) {
  self->request(g->router, std::chrono::seconds{2}, stats_atom::value)
      .then([=](cluster_stats& s) mutable { then(&s); }, [=](caf::error&) mutable { then(nullptr); });
}

/// Takes the request's own x-request-id, if it sent one (http::client_request_id); a problem
/// with it, else empty.
std::string adopt_request_id(const state_ptr& st, const http::request& req) {
  st->client_request_id.clear();
  return http::client_request_id(req, &st->client_request_id);
}

bool authorized(const shared_ptr& g, const state_ptr& st, const http::request& req) {
  // Probes and Prometheus scrape without one, as vLLM's /health and /metrics (and /version):
  // the keys guard the model's API; the numbers name ranks and counts, no request's text.
  st->key = nullptr;
  if (g->keys.empty() || req.path == "/health" || req.path == "/metrics" || req.path == "/version") return true;
  const auto* auth = req.header("authorization");
  // The scheme is case-insensitive (RFC 9110 §11.1).
  if (!auth || auth->size() < 7 || !http::iequals(std::string_view{*auth}.substr(0, 7), "bearer ")) return false;
  st->key = find_api_key(g->keys, std::string_view{*auth}.substr(7));  // (in constant time)
  return st->key != nullptr;
}

void reply_unauthorized(caf::io::broker* self, caf::io::connection_handle hdl, const shared_ptr& g, const state_ptr& st) {
  reply_error(self, hdl, g, st,
              {401, "missing or wrong API key: send Authorization: Bearer <key>", "invalid_request_error", {}},
              {{"WWW-Authenticate", "Bearer"}});
}

// The routes' handlers (the table in dispatch), called once the method and the key are right.
using route_handler = void (*)(caf::io::broker*, caf::io::connection_handle, const shared_ptr&, const state_ptr&,
                               const http::request&);

void serve_completions(caf::io::broker* self, caf::io::connection_handle, const shared_ptr& g, const state_ptr& st,
                       const http::request& req) {
  generate(self, g, st, req, false);
}

void serve_chat(caf::io::broker* self, caf::io::connection_handle, const shared_ptr& g, const state_ptr& st,
                const http::request& req) {
  generate(self, g, st, req, true);
}

void serve_models(caf::io::broker* self, caf::io::connection_handle hdl, const shared_ptr& g, const state_ptr& st,
                  const http::request&) {
  std::vector<std::string> names{g->model};
  names.insert(names.end(), g->calls.model_aliases.begin(), g->calls.model_aliases.end());
  reply(self, hdl, g, st, 200, openai::models_json(names, g->started_s, g->context_tokens));
}

constexpr std::string_view models_prefix = "/v1/models/";

/// GET /v1/models/{id}: the one served model (the SDKs' models.retrieve).
void serve_model_by_id(caf::io::broker* self, caf::io::connection_handle hdl, const shared_ptr& g, const state_ptr& st,
                       const http::request& req) {
  std::string id;
  if (!http::percent_decode(req.path.substr(models_prefix.size()), &id))
    return reply_error(self, hdl, g, st,
                       {400, "the model id in the path has a malformed %-escape: '" +
                                 quoted_input(req.path.substr(models_prefix.size()), 128) + "'",
                        "invalid_request_error", "model"});
  const auto& aliases = g->calls.model_aliases;
  if (id != g->model && std::find(aliases.begin(), aliases.end(), id) == aliases.end())
    return reply_error(self, hdl, g, st,
                       {404, "the model '" + quoted_input(id, 128) + "' does not exist; this cluster serves '" + g->model + "'",
                        "invalid_request_error", "model"});
  reply(self, hdl, g, st, 200, openai::model_json(id, g->started_s, g->context_tokens));
}

void serve_health(caf::io::broker* self, caf::io::connection_handle hdl, const shared_ptr& g, const state_ptr& st,
                  const http::request&) {
  with_cluster_stats(self, g, [=](const cluster_stats* s) {
    auto [status, text] = cluster_health(s);
    if (status != 200) return reply_error(self, hdl, g, st, api_error_of(status, std::move(text)));
    reply(self, hdl, g, st, 200, text);
  });
}

/// vLLM's /tokenize and /detokenize, answered by the router's tokenizer (on a worker of its own);
/// a refusal names the field, as a call's does.
void reply_router_error(caf::io::broker* self, caf::io::connection_handle hdl, const shared_ptr& g, const state_ptr& st,
                        const caf::error& e) {
  auto [status, msg] = status_of(self->system(), e);
  reply_error(self, hdl, g, st, api_error_of(status, msg));
}

void begin_ask(const shared_ptr& g, const state_ptr& st) {
  st->in_ask = true;
  ++g->calls_in_flight;  // finish() (end_call) counts it out once its answer is written
}

void serve_tokenize(caf::io::broker* self, caf::io::connection_handle hdl, const shared_ptr& g, const state_ptr& st,
                    const http::request& req) {
  generate_request r;
  openai::api_error e;
  if (!openai::parse_tokenize_body(req.body, g->model, g->calls.model_aliases, &r, &e)) return reply_error(self, hdl, g, st, e);
  begin_ask(g, st);
  self->request(g->router, std::chrono::seconds{10}, tokenize_atom::value, std::move(r))
      .then([=](std::vector<int32_t>& ids) { reply(self, hdl, g, st, 200, openai::tokenize_json(ids, g->context_tokens)); },
            [=](caf::error& err) { reply_router_error(self, hdl, g, st, err); });
}

void serve_detokenize(caf::io::broker* self, caf::io::connection_handle hdl, const shared_ptr& g, const state_ptr& st,
                      const http::request& req) {
  std::vector<int32_t> ids;
  openai::api_error e;
  if (!openai::parse_detokenize_body(req.body, g->model, g->calls.model_aliases, &ids, &e)) return reply_error(self, hdl, g, st, e);
  begin_ask(g, st);
  self->request(g->router, std::chrono::seconds{10}, detokenize_atom::value, std::move(ids))
      .then([=](std::string& text) { reply(self, hdl, g, st, 200, openai::detokenize_json(text)); },
            [=](caf::error& err) { reply_router_error(self, hdl, g, st, err); });
}

void serve_version(caf::io::broker* self, caf::io::connection_handle hdl, const shared_ptr& g, const state_ptr& st,
                   const http::request&) {
  reply(self, hdl, g, st, 200, std::string{"{\"version\":\""} + BATON_VERSION + "\"}");
}

void serve_metrics(caf::io::broker* self, caf::io::connection_handle hdl, const shared_ptr& g, const state_ptr& st,
                   const http::request&) {
  with_cluster_stats(self, g, [=](const cluster_stats* s) {
    // The gateway's own: connections open (this scrape's among them) and calls in progress.
    std::string text = g->metrics.render(s);
    text += "# HELP baton_http_connections HTTP connections open at this gateway, this scrape's included\n"
            "# TYPE baton_http_connections gauge\nbaton_http_connections " +
            std::to_string(g->num_connections.load()) +
            "\n# HELP baton_http_calls_in_progress calls this gateway is answering\n"
            "# TYPE baton_http_calls_in_progress gauge\nbaton_http_calls_in_progress " +
            std::to_string(g->calls_in_flight.load()) + "\n";
    reply(self, hdl, g, st, 200, text, "text/plain; version=0.0.4; charset=utf-8");
  });
}

void dispatch(caf::io::broker* self, caf::io::connection_handle hdl, const shared_ptr& g, const state_ptr& st,
              const http::request& req) {
  struct route {
    const char* path;    ///< as /metrics' label; "{id}" stands for the rest of a prefix route's path
    const char* method;  ///< HEAD is taken wherever GET is (RFC 9110 §9.3.2: load balancers' probes)
    bool needs_cluster;  ///< calls and /health: 503 while the gateway drains or its head is away
    route_handler serve;
  };
  static constexpr route routes[] = {
      {"/v1/completions", "POST", true, serve_completions}, {"/v1/chat/completions", "POST", true, serve_chat},
      {"/v1/models", "GET", false, serve_models},            {"/health", "GET", true, serve_health},
      {"/metrics", "GET", false, serve_metrics},             {"/tokenize", "POST", true, serve_tokenize},
      {"/detokenize", "POST", true, serve_detokenize},       {"/version", "GET", false, serve_version},
      {"/v1/models/{id}", "GET", false, serve_model_by_id}};  // last: the prefix route
  const route* found = nullptr;
  for (const auto& r : routes)
    if (req.path == r.path) found = &r;
  if (!found && req.path.size() > models_prefix.size() && req.path.compare(0, models_prefix.size(), models_prefix) == 0)
    found = &routes[std::size(routes) - 1];
  st->route = found ? found->path : "other";
  st->request_line = quoted_input(req.method, 16) + " " + quoted_input(req.path, 128);
  st->cors_origin.clear();
  if (const auto* origin = req.header("origin"))
    for (const auto& o : g->cfg.cors_origins)
      if (o == "*" || o == *origin) st->cors_origin = o == "*" ? "*" : *origin;
  if (auto problem = adopt_request_id(st, req); !problem.empty())
    return reply_error(self, hdl, g, st, {400, problem, "invalid_request_error", {}});
  // RFC 9112 §3.2: a server must refuse an HTTP/1.1 request without one (every client sends it).
  if (req.version == "HTTP/1.1" && !req.header("host"))
    return reply_error(self, hdl, g, st, {400, "an HTTP/1.1 request needs a Host header", "invalid_request_error", {}});
  if (st->probes_only) st->keep_alive = false;  // one answer each
  if (st->probes_only && !(found && (found->serve == serve_health || found->serve == serve_metrics))) {
    return reply_error(self, hdl, g, st,
                       api_error_of(503, "too many connections; retry later (this one may ask /health and /metrics only)"));
  }
  if (!found)
    return reply_error(self, hdl, g, st, {404, "no route " + quoted_input(req.method, 16) + " " + quoted_input(req.path, 128), "invalid_request_error", {}});
  const std::string allow = std::string_view{found->method} == "GET" ? "GET, HEAD, OPTIONS" : found->method + std::string{", OPTIONS"};
  if (req.method == "OPTIONS") {
    // What the route allows; to a browser's preflight from an allowed origin, also that it may
    // send the key and a JSON body (no key needed: a preflight carries none).
    http::header_list extra{{"Allow", allow}};
    if (!st->cors_origin.empty() && req.header("access-control-request-method"))
      for (auto& h : http::preflight_headers(req, allow)) extra.push_back(std::move(h));
    return reply(self, hdl, g, st, 204, "", "text/plain", std::move(extra));
  }
  if (req.method != found->method && !(req.method == "HEAD" && std::string_view{found->method} == "GET"))
    return reply_error(self, hdl, g, st,
                       {405, quoted_input(req.path, 128) + " takes " + found->method + ", not " + quoted_input(req.method, 16), "invalid_request_error", {}},
                       {{"Allow", allow}});
  if (!authorized(g, st, req)) return reply_unauthorized(self, hdl, g, st);
  // A compressed body would read as invalid JSON: say what is wrong with it instead.
  if (const auto* enc = req.header("content-encoding"); enc && !http::iequals(*enc, "identity"))
    return reply_error(self, hdl, g, st,
                       {415, "Content-Encoding " + quoted_input(*enc, 32) + " is not supported: send the body uncompressed",
                        "invalid_request_error", {}},
                       {{"Accept-Encoding", "identity"}});
  // Shutting down, or the head is away: no call can be served here now, and a load balancer
  // (or a client's retry) should go to another replica or come back shortly.
  if (found->needs_cluster && (g->draining || !g->router_away.empty()))
    return reply_error(self, hdl, g, st,
                       api_error_of(503, g->draining ? "this gateway is shutting down; it finishes the calls it has "
                                                       "and takes no new ones: retry on another replica"
                                                     : g->router_away));
  found->serve(self, hdl, g, st, req);
}

/// Starts every complete request that may start now, one after another. A loop, not recursion:
/// a request answered at once (an error, /v1/models) calls finish(), which calls here again; a
/// client that pipelines thousands of those must not grow the stack with them.
void pump(caf::io::broker* self, caf::io::connection_handle hdl, const shared_ptr& g, const state_ptr& st) {
  if (st->pumping) return;  // the loop below takes the next one
  st->pumping = true;
  // Parsed from an offset, compacted once at the end: thousands of pipelined requests answered
  // in one pass must not each move the rest of the buffer.
  while (!st->busy && !st->closed && st->in_off < st->in.size() && st->out_pending < out_limit_bytes) {
    // Empty lines between requests (a CRLF a client sent after a POST body, RFC 9112 §2.2) are
    // not the start of a request: dropped now, so an idle connection holding one is idle (not
    // a request that never completes, answered 408 by the timer).
    while (st->in.compare(st->in_off, 2, "\r\n") == 0) st->in_off += 2;
    if (st->in_off == st->in.size()) break;
    http::request req;
    const auto r = http::parse_request(std::string_view{st->in}.substr(st->in_off), g->cfg.limits, &req, &st->body_progress);
    if (r.status == http::parse_status::incomplete) {
      // Headers in, body not: a client that asked to be told before it sends the body is told,
      // unless its key is wrong: then the 401 is the answer, and no body is invited.
      if (r.expects_continue && !st->sent_continue && !st->probes_only) {  // a probe has no body to invite
        if (!authorized(g, st, req)) {
          st->busy = true;
          st->keep_alive = false;  // the body may still come: the close reads and drops it
          st->route = "unauthorized";
          st->request_line = quoted_input(req.method, 16) + " " + quoted_input(req.path, 128);
          adopt_request_id(st, req);  // a bad one: the 401 is the answer all the same
          st->head_only = false;  // an earlier HEAD's: this answer has its body
          st->in.clear();
          st->in_off = 0;
          st->body_progress.clear();
          reply_unauthorized(self, hdl, g, st);
          break;
        }
        write(self, hdl, st, "HTTP/1.1 100 Continue\r\n\r\n");
        st->sent_continue = true;
      }
      break;
    }
    st->busy = true;
    st->sent_continue = false;
    st->head_only = false;
    if (r.status == http::parse_status::error) {
      st->keep_alive = false;  // the stream cannot be trusted past a malformed request
      st->route = "malformed";
      st->in.clear();
      st->in_off = 0;
      reply_error(self, hdl, g, st, {r.error_status, r.why, "invalid_request_error", {}});
      break;
    }
    st->in_off += r.consumed;
    st->request_started = std::chrono::steady_clock::now();  // the next one's clock, if any
    st->keep_alive = req.keep_alive && !st->probes_only;  // a probe's connection answers once, whatever it asks
    st->chunked = req.version == "HTTP/1.1";
    st->head_only = req.method == "HEAD";
    dispatch(self, hdl, g, st, req);
  }
  if (!st->closed && st->in_off > 0) {
    st->in.erase(0, st->in_off);
    st->in_off = 0;
  }
  st->pumping = false;
}

/// Whether the gateway's server has stopped (the connections' lingering answers are not waited on).
bool server_down(caf::io::broker*, const caf::actor& server) {
  return !server || server->getf(caf::abstract_actor::is_terminated_flag);
}

caf::behavior connection(caf::io::broker* self, caf::io::connection_handle hdl, shared_ptr g, caf::actor server) {
  auto st = std::make_shared<connection_state>();
  st->total_out = &g->out_pending;  // g outlives the connection (its functors hold it)
  st->number = ++g->last_connection;
  self->configure_read(hdl, caf::io::receive_policy::at_most(64 * 1024));
  self->ack_writes(hdl, true);  // data_transferred_msg: how much output is still queued
  // A monitor lives on the watched actor until it ends: the server's, one per connection ever
  // made, kept each connection's memory (a red-team trial: 1.5 KB a connection, never freed).
  self->attach_functor([self, g, st, server] {
    --g->num_connections;
    g->out_pending -= st->out_pending;  // what it left unsent goes with it
    if (auto s = caf::actor_cast<caf::actor>(g->server)) caf::anon_send(s, wake_forget_atom::value, st->number);
    if (st->in_call) --g->calls_in_flight;  // a connection gone without end_call: not in flight
    if (st->in_ask) --g->calls_in_flight;
    self->demonitor(server);
  });
  // The gateway stops (its process ends, after its drain): every connection closes now, instead
  // of serving on with a router that is gone, or holding the actor system's shutdown open.
  self->monitor(server);
  self->set_down_handler([=](caf::down_msg& m) {
    if (m.source != server.address()) {
      // A call's go-between ended. After its answer (or end_call) that is nothing; before, the
      // call fails now: a connection that had seen a token stayed busy, and a client that is not
      // streaming waited for its own timeout. (Its answer, sent before it ended, comes first.)
      if (st->in_call && st->call_sink && m.source == st->call_sink.address())
        fail_call(self, hdl, g, st, 500,
                  "the gateway's go-between for this call ended without an answer (" + self->system().render(m.reason) + ")");
      return;
    }
    // Stopped with a call unfinished (its drain ran out, or a second signal): the client is told
    // -- a 503, or its stream's last event and end -- and the call's sink goes, so its generation
    // stops and frees its KV. The connection then closes (a lingering close, bounded).
    st->keep_alive = false;
    if (st->busy && st->in_call)
      return fail_call(self, hdl, g, st, 503,
                       "this gateway stopped before the answer was done (its drain ran out, or a second signal "
                       "stopped it at once): retry");
    // An answer on its way: closed after it (linger_atom). A lingering close's timer went with
    // the server: armed again here, on the connection's own clock.
    if (st->lingering) wake_later(self, g, st, linger_time, linger_atom::value);
    if (st->busy || st->lingering) return;
    st->closed = true;
    // Answers a client never read would hold CAF's close (and the process's end) for ever.
    if (st->out_pending > 0) return abort_connection(self, hdl);
    self->close(hdl);
    self->quit();
  });
  // Slots of max_connections are not held for nothing: a connection idle for idle_timeout_ms
  // between requests is closed, and so is one whose request has not all arrived that long after
  // it began (however slowly it trickles: slowloris), or whose answers the client has not read
  // for that long.
  // Past max_connections a few more are taken for load balancers' probes and scrapes alone: when
  // clients (or idle sockets) hold every slot, /health still answers, and the replica is not
  // taken out of service for being busy (a red-team trial). Each answers one request, and may
  // idle 2 s at most: idle sockets cannot hold these slots too.
  const uint32_t n = ++g->num_connections;
  st->probes_only = n > g->cfg.max_connections && n <= g->cfg.max_connections + probe_connections;
  const auto idle = st->probes_only ? std::min(std::chrono::milliseconds{g->cfg.idle_timeout_ms}, probe_idle)
                                    : std::chrono::milliseconds{g->cfg.idle_timeout_ms};
  const auto first_token = std::chrono::milliseconds{g->cfg.first_token_timeout_ms};
  const auto tick = std::max(std::chrono::milliseconds{10}, std::min(idle, first_token) / 4);
  const auto keepalive = std::chrono::milliseconds{g->cfg.stream_keepalive_ms};
  wake_later(self, g, st, tick, timer_atom::value);
  if (n > g->cfg.max_connections + probe_connections) {
    st->keep_alive = false;
    st->busy = true;
    st->route = "refused";
    reply_error(self, hdl, g, st, api_error_of(503, "too many connections; retry later"));
  }
  return {
      [=](const caf::io::new_data_msg& msg) {
        if (st->closed) return;
        if (st->in_off == st->in.size() && !st->busy) st->request_started = std::chrono::steady_clock::now();
        st->in.append(msg.buf.begin(), msg.buf.end());
        pump(self, hdl, g, st);
        // Bounded buffering: while an answer is in progress (or answers wait to be read),
        // requests pipelined behind it wait here; past one request's limits, reading stops until
        // the answer is done and read.
        const bool held = st->busy || st->out_pending >= out_limit_bytes;
        if (!st->closed && held && st->reading &&
            st->in.size() - st->in_off > g->cfg.limits.max_header_bytes + g->cfg.limits.max_body_bytes) {
          st->reading = false;
          self->halt(hdl);
        }
      },
      [=](const caf::io::data_transferred_msg& msg) {
        if (msg.written > 0) st->out_progress = std::chrono::steady_clock::now();
        const bool was_full = st->out_pending >= out_limit_bytes;
        *st->total_out -= st->out_pending - std::min<uint64_t>(st->out_pending, msg.remaining);
        st->out_pending = std::min<uint64_t>(st->out_pending, msg.remaining);
        if (st->lingering) return half_close_when_sent(hdl, st);
        if (!was_full || st->out_pending >= out_limit_bytes || st->closed) return;
        if (!st->reading && !st->busy) {
          st->reading = true;
          self->trigger(hdl);
        }
        pump(self, hdl, g, st);  // requests held back while the client was not reading
      },
      [=](const caf::io::connection_closed_msg&) {  // cancels a generation in flight (its sink goes)
        if (st->in_call) client_cut(self, g, st, "the client closed the connection before the answer was done");
        end_call(self, g, st);
        self->quit();
      },
      [=](linger_atom) {
        // An answer still going out to a client that reads it (a large body, an HTTP/1.0 stream
        // at the reader's pace): wait on, as the idle limit allows any answer.
        // Not once the gateway has stopped: its process is ending, and waits for this connection.
        if (st->out_pending > 0 && std::chrono::steady_clock::now() - st->out_progress < idle && !server_down(self, server)) {
          wake_later(self, g, st, linger_time, linger_atom::value);
          return;
        }
        // The client neither closed nor stopped sending: close now (abort if the answer itself
        // is still stuck unsent: a client that does not read would hold CAF's close for ever).
        if (st->out_pending > 0) abort_connection(self, hdl);
        else self->close(hdl);
        self->quit();
      },
      // The current call's messages, rendered by its go-between (call_impl); an earlier call's
      // are dropped by their number.
      [=](uint64_t seq, std::string& event_json) {
        if (!st->in_call || seq != st->call_seq) return;
        stream_head(self, hdl, g, st);
        event(self, hdl, st, event_json);
        const bool all_full = g->out_pending > g->cfg.max_total_backlog_bytes && st->out_pending > out_limit_bytes;
        if (st->out_pending > g->cfg.max_stream_backlog_bytes || all_full) {
          // The client reads, but far slower than the stream is made (the idle limit counts only
          // a client that reads nothing): its events would pile up in memory without bound -- its
          // own, or with others' past the gateway's bound. The generation and the connection go.
          client_cut(self, g, st,
                     "the client read the stream too slowly: " +
                         (all_full ? std::to_string(st->out_pending) + " bytes waited unread, and the gateway's " +
                                         std::to_string(g->cfg.max_total_backlog_bytes) + " for all clients were held"
                                   : "more than " + std::to_string(g->cfg.max_stream_backlog_bytes) +
                                         " bytes waited unread"));
          end_call(self, g, st);
          abort_connection(self, hdl);
        }
      },
      [=](uint64_t seq, std::vector<completion>& choices, std::string& json, bool stream) {
        if (st->in_call && seq == st->call_seq) on_done(self, hdl, g, st, choices, json, stream);
      },
      [=](uint64_t seq, int32_t status, std::string& error_json, std::string& message, uint32_t retry_after_ms) {
        if (!st->in_call || seq != st->call_seq) return;
        // Refused before it began (the body's fault): counted as the router's refusals are, so the
        // failures by reason add up to the 4xx a client saw (a soak trial: 475 sent, 254 counted).
        count_call_failure(g, st, status == 400 ? "bad_request" : "http_" + std::to_string(status));
        log_call(self, g, st, status, false, nullptr, message);  // the sentence, as every other line has
        http::header_list wait;  // a 429 of a key's budget knows its wait (the OpenAI SDK reads the ms); others 1 s
        if (retry_after_ms > 0 && (status == 429 || status == 503))
          wait = {{"Retry-After", std::to_string((retry_after_ms + 999) / 1000)}, {"retry-after-ms", std::to_string(retry_after_ms)}};
        reply(self, hdl, g, st, status, error_json, "application/json", std::move(wait));
      },
      [=](uint64_t seq, caf::error& e, uint64_t generated) {
        // Tokens a failed call generated before it failed (a stream cut by its head's loss had
        // shown some): generated all the same, for throughput dashboards.
        if (!st->in_call || seq != st->call_seq) return;
        g->metrics.count_generated(generated);
        on_failed(self, hdl, g, st, e);
      },
      [=](uint64_t seq, token_seen_atom) {
        if (st->in_call && seq == st->call_seq) st->token_seen = true;
      },
      [=](uint64_t seq, first_token_atom, uint64_t request_id) {
        if (!st->in_call || seq != st->call_seq || st->first_request) return;
        st->first_request = request_id;
        g->metrics.first_token(std::chrono::duration<double>(std::chrono::steady_clock::now() - st->call_started).count());
      },
      // A streaming call: its keepalive wakes, on time, apart from the connection's timer.
      [=](uint64_t seq, streaming_atom) {
        if (!st->in_call || seq != st->call_seq || g->cfg.stream_keepalive_ms == 0) return;
        st->streaming = true;
        st->keepalive_due = st->call_started + keepalive;
        const auto now = std::chrono::steady_clock::now();
        const auto left = st->keepalive_due > now ? std::chrono::ceil<std::chrono::milliseconds>(st->keepalive_due - now)
                                                  : std::chrono::milliseconds{0};
        wake_later(self, g, st, left, streaming_atom::value);
      },
      [=](streaming_atom) {
        // A wake of an earlier call (this one's is not due yet) ends its chain.
        // (A millisecond early counts as due: timers are kept in whole milliseconds.)
        const auto now = std::chrono::steady_clock::now() + std::chrono::milliseconds{1};
        if (st->closed || !st->in_call || !st->streaming || st->token_seen || now < st->keepalive_due) return;
        keep_stream_alive(self, hdl, g, st);
        st->keepalive_due = now + keepalive;
        wake_later(self, g, st, keepalive, streaming_atom::value);
      },
      [=](timer_atom) {
        if (st->closed) return;
        const auto now = std::chrono::steady_clock::now();
        if (st->in_call && !st->token_seen && now - st->call_started >= first_token) {
          on_failed(self, hdl, g, st,
                    make_error(errc::deadline_exceeded,
                               "call " + st->call_id + ", stage first_token: no token within the gateway's "
                               "first-token timeout of " + std::to_string(g->cfg.first_token_timeout_ms) + " ms"));
          if (st->closed) return;
        }
        if (st->out_pending > 0 && now - st->out_progress >= idle) {
          // The client has read nothing of its answers for that long: whatever it is doing,
          // the queued bytes and the generation behind them go.
          client_cut(self, g, st, "the client read nothing of its answer within the idle limit");
          end_call(self, g, st);
          return abort_connection(self, hdl);
        }
        const bool receiving = st->in_off < st->in.size();
        if (!st->busy && !receiving && now - st->last_activity >= idle) {
          self->close(hdl);
          self->quit();
          return;
        }
        if (!st->busy && receiving && now - st->request_started >= idle) {
          st->keep_alive = false;
          st->busy = true;
          st->route = "incomplete";
          st->head_only = false;  // the last answer's HEAD does not strip this one's body
          st->in.clear();
          st->in_off = 0;
          st->body_progress.clear();
          return reply_error(self, hdl, g, st,
                             api_error_of(408, "the request did not arrive whole within " +
                                                   std::to_string(idle.count()) + " ms"));
        }
        wake_later(self, g, st, tick, timer_atom::value);
      },
  };
}

/// How a gateway's router changed (gateway_router_lost, gateway_set_router).
}  // namespace

caf::behavior gateway_connection(caf::io::broker* self, caf::io::connection_handle hdl, std::shared_ptr<gateway_shared> g,
                                 caf::actor server) {
  return connection(self, hdl, std::move(g), std::move(server));
}

}  // namespace baton::deploy
