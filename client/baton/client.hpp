#pragma once

// Baton's C++ client: connect to a cluster's router over CAF's network layer, submit requests,
// receive their tokens as a stream of chunks, cancel. This header has no CAF in it; link the
// `baton::client` library (`find_package(baton)` after `cmake --install`).
//
//   std::string why;
//   auto conn = baton::client::connection::connect("127.0.0.1", 7100, &why);
//   if (!conn) { std::cerr << why; return 1; }
//   baton::client::request r;
//   r.prompt = "Hello";
//   r.max_tokens = 16;
//   auto s = conn->submit(r);
//   baton::client::token_chunk c;
//   while (s->next(&c)) std::cout << c.text << std::flush;
//   if (s->failed()) std::cerr << s->error_info().code << ": " << s->error_info().message;

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace baton::client {

/// This library's version ("0.1.0": the project's) and its wire fingerprint: it connects only to
/// routers whose processes carry the same fingerprint (`baton --version` prints theirs), and a
/// refusal names both. For a program's logs and its checks at start.
const char* library_version();
const char* wire_fingerprint();

/// What a constrained answer must be (request::output, request::output_spec).
enum class output_kind : uint8_t {
  text = 0,         ///< free text; no output_spec
  json_object = 1,  ///< any JSON object; no output_spec
  json_schema = 2,  ///< JSON matching the JSON schema whose text is output_spec
  regex = 3,        ///< text that the regular expression output_spec matches whole
  gbnf = 4,         ///< text that the GBNF grammar output_spec derives from its root
};

struct request {
  std::string prompt;                  ///< text (the cluster tokenizes it); or ...
  std::vector<int32_t> prompt_tokens;  ///< ... token ids; or ...
  std::vector<std::pair<std::string, std::string>> messages;  ///< ... a chat: (role, content)
  int32_t max_tokens = 16;             ///< 0: as many as the context leaves after the prompt
  float temperature = 0.0f;            ///< 0 = greedy
  uint64_t seed = 0;                   ///< sampling seed when temperature > 0
  uint32_t top_k = 0;                  ///< 0 = off
  float top_p = 1.0f;
  float repetition_penalty = 1.0f;
  float presence_penalty = 0.0f;       ///< per token the output has produced before
  float frequency_penalty = 0.0f;      ///< per time it has
  float min_p = 0.0f;                  ///< keep tokens at least this fraction as likely as the best (0 = off)
  uint32_t min_tokens = 0;             ///< no end of sequence (end tokens, stop strings) before this many tokens
  /// (token id, bias in [-100, 100]) added to that token's logit at every pick (OpenAI's logit_bias).
  std::vector<std::pair<int32_t, float>> logit_bias;
  /// Constrained decoding: what the answer must be (docs/structured-outputs.md), and the text
  /// that says it for the kinds that read one.
  output_kind output = output_kind::text;
  std::string output_spec;
  bool json_compact = false;  ///< with json_object or json_schema: no whitespace between JSON's tokens
  std::vector<std::string> stop;
  std::vector<int32_t> stop_token_ids;
  bool include_stop_str_in_output = false;  ///< keep the stop string (or stop token's text) that ended it
  bool ignore_eos = false;
  std::string traffic_class = "chat";  ///< chat | agent | batch
  std::string priority = "interactive";
  bool logprobs = false;               ///< each token's log-probability in token_chunk::logprobs...
  uint32_t top_logprobs = 0;           ///< ... with this many (<= 20) most likely tokens'
  /// Prompt scoring: each prompt token's log-probability given those before it, in
  /// result::prompt_logprobs (with top_logprobs alternatives). The prompt is then computed whole.
  bool prompt_logprobs = false;
};

/// A generated token's log-probability (request::logprobs), from the raw logits, and the most
/// likely tokens' at its step, most likely first.
struct token_logprob {
  int32_t token = 0;
  float logprob = 0.0f;
  std::string text;  ///< the token alone: may be part of a UTF-8 character
  std::vector<int32_t> top_tokens;
  std::vector<float> top_logprobs;
  std::vector<std::string> top_texts;
};

/// New tokens of a request, in order; the last chunk has a finish_reason.
struct token_chunk {
  uint64_t request_id = 0;
  uint32_t first_index = 0;     ///< index of tokens[0] among the generated tokens
  std::vector<int32_t> tokens;
  std::string text;             ///< never ends inside a UTF-8 character
  std::string finish_reason;    ///< empty until the last chunk: eos | stop | length
  std::vector<token_logprob> logprobs;  ///< tokens' log-probabilities, when the request asked
};

/// The whole answer, when the stream has ended well.
struct result {
  uint64_t request_id = 0;
  std::vector<int32_t> tokens;
  std::string text;
  std::string finish_reason;
  uint32_t num_prompt_tokens = 0;
  uint32_t cached_tokens = 0;       ///< prompt tokens loaded from a cache instead of computed
  int64_t ttft_us = 0;
  std::vector<int64_t> tbt_us;
  std::string prefill_rank, decode_rank;
  /// request::prompt_logprobs: entry i is prompt token i's; the first's logprob is NaN (nothing
  /// precedes it).
  std::vector<token_logprob> prompt_logprobs;
  /// Times the request was re-placed after a rank failed (its answer unchanged: a pause), and
  /// the last failure that did it; times its decode moved, KV and all, to another rank.
  uint32_t failovers = 0;
  std::string failover_why;
  uint32_t migrations = 0;
};

struct error {
  /// bad_request, kv_capacity, rank_unavailable, deadline_exceeded, cancelled, ...; router_gone:
  /// the router itself went away (its process, or the link to it): connect again before more.
  std::string code;
  std::string message;  ///< names the request, the rank and the stage
  bool retryable = false;
};

/// One request in flight. Not thread-safe: one thread reads it.
class stream {
 public:
  virtual ~stream() = default;
  /// Waits up to `timeout` for the next chunk; false when the stream has ended (see failed())
  /// or the wait timed out (see timed_out()).
  virtual bool next(token_chunk* out, std::chrono::milliseconds timeout = std::chrono::minutes{10}) = 0;
  /// Stops the generation; the stream then ends with error code "cancelled".
  virtual void cancel() = 0;
  virtual bool done() const = 0;       ///< the stream has ended (well or not)
  virtual bool failed() const = 0;     ///< ... with an error
  virtual bool timed_out() const = 0;  ///< the last next() gave up waiting
  virtual const result& final_result() const = 0;  ///< after a good end
  virtual const error& error_info() const = 0;     ///< after a failure
};

/// Who this client is to the cluster: its id, and for a cluster with mutual TLS the client's
/// certificate and key and the cluster CA (`baton launch` makes them and prints where).
struct connect_options {
  std::string cluster_id = "baton";
  std::string tls_cert, tls_key, tls_ca;  ///< PEM files; all three, or none
  /// How long connect() waits for the router's handshake (a port that is not a router's, a host
  /// that drops the packets) before it says why.
  uint32_t connect_timeout_ms = 10000;
};

/// A connection to one router. Thread-safe: several threads may submit. Destroying it cancels
/// the streams still going (their readers hear "cancelled", "the connection was closed before
/// the answer"); a stream may be read and destroyed after its connection. Once the router is gone (its process ended, the link lost) every stream in
/// flight fails at once with router_gone, and so does every later submit: connect again.
class connection {
 public:
  virtual ~connection() = default;
  /// Connects to the router published at host:port; null and why (which may be null) on failure.
  static std::unique_ptr<connection> connect(const std::string& host, uint16_t port, std::string* why);
  static std::unique_ptr<connection> connect(const std::string& host, uint16_t port, const connect_options& options,
                                             std::string* why);
  virtual std::unique_ptr<stream> submit(const request& r) = 0;
  /// The served model's name and context length, asked from the router (once it is gone: false
  /// at once, as submit).
  virtual bool model_info(std::string* name, uint32_t* context_tokens, std::string* why) = 0;
  /// False once the router is gone (its process ended, or the link to it was lost).
  virtual bool connected() const = 0;
};

}  // namespace baton::client
