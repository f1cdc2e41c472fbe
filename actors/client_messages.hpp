#pragma once

// What clients send and get back: a generate_request (a prompt or a chat, and how to sample it)
// and its completion (tokens, text, log-probabilities and where the time went). Included by
// messages.hpp; the C++ client library and the gateway speak these.

#include <cstdint>
#include <string>
#include <vector>

#include <caf/meta/type_name.hpp>

#include "actors/logprob_messages.hpp"
#include "actors/wire_float.hpp"

namespace baton {

// --- client-facing ----------------------------------------------------------------------------
/// One message of a chat request.
struct chat_turn {
  std::string role;  ///< system | user | assistant | tool
  std::string content;
  /// The turn's other fields for the chat template, a JSON object's text (empty: none): an
  /// assistant's tool_calls (arguments as objects), a tool result's tool_call_id and name.
  std::string fields_json{};
};
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, chat_turn& x) {
  return f(caf::meta::type_name("chat_turn"), x.role, x.content, x.fields_json);
}

/// The most logit_bias entries a request may give (the gateway and the router refuse more).
inline constexpr uint32_t max_logit_bias = 1024;

struct generate_request {
  std::string prompt;                  ///< text, tokenized by the router; or ...
  std::vector<int32_t> prompt_tokens;  ///< ... token ids (give one of the two)
  int32_t max_tokens = 16;             ///< tokens to generate, >= 1; 0: as many as the context leaves
  /// With max_tokens 0, the most that default may be (an API key's cap, the gateway's); 0: none.
  uint32_t max_tokens_cap = 0;
  float temperature = 0.0f;            ///< 0 = greedy
  uint64_t seed = 0;                   ///< sampling seed when temperature > 0
  bool return_logits = false;          ///< attach each step's logits to the completion (tests)
  bool ignore_eos = false;             ///< generate max_tokens even past <eos> (benchmarks)
  std::string traffic_class = "chat";  ///< chat | agent | batch: store retention later
  std::string priority = "interactive";
  std::vector<chat_turn> messages;     ///< a chat instead of a prompt: rendered by the model's template
  /// More variables for that template, a JSON object's text (vLLM's chat_template_kwargs, e.g.
  /// {"enable_thinking": false} for Qwen3); empty: none.
  std::string chat_template_kwargs;
  /// The functions the model may call, OpenAI's `tools` array as JSON text (empty: none), for
  /// the chat template to show the model.
  std::string tools_json;
  uint32_t top_k = 0;                  ///< 0 = off
  float top_p = 1.0f;                  ///< 1 = off
  float repetition_penalty = 1.0f;     ///< 1 = off
  float presence_penalty = 0.0f;       ///< 0 = off; counts the output only (gpu::sampling_config)
  float frequency_penalty = 0.0f;      ///< 0 = off; per repeat in the output
  float min_p = 0.0f;                  ///< 0 = off; in [0, 1] (gpu::sampling_config::min_p)
  /// vLLM's min_tokens: no end of sequence before this many tokens (<= max_tokens): the end
  /// tokens (<eos> unless ignore_eos, the model's other end tokens, stop_token_ids) are never
  /// picked until then, and stop strings are looked for only in the text after them (vLLM v1).
  uint32_t min_tokens = 0;
  /// OpenAI's logit_bias: logit_bias_values[i] (in [-100, 100]) added to the logit of token
  /// logit_bias_tokens[i] when each token is picked (gpu::sampling_config); distinct tokens, at
  /// most max_logit_bias.
  std::vector<int32_t> logit_bias_tokens;
  std::vector<float> logit_bias_values;
  /// Constrained decoding: what the answer must be, as gpu::output_format numbers it: 0 free
  /// text; 1 any JSON object (OpenAI's json_object); 2 JSON matching the JSON schema whose text
  /// is output_spec (response_format's json_schema, forced tool calls); 3 text that the regular
  /// expression output_spec matches whole (vLLM's guided_regex and guided_choice); 4 text that
  /// the GBNF grammar output_spec derives from its root (guided_grammar). docs/structured-outputs.md
  /// says which schema keywords, expression syntax and grammar forms hold.
  uint8_t output_format = 0;
  std::string output_spec;     ///< the schema's, expression's or grammar's text; empty for 0 and 1
  bool json_compact = false;   ///< with 1 or 2: the JSON without whitespace between its tokens
  /// vLLM's add_special_tokens: 1 gives the prompt the model's begin-of-text token (a
  /// completion's default), 0 leaves it out (a chat's default: its template writes it); -1: the
  /// default.
  int8_t add_special_tokens = -1;
  std::vector<std::string> stop;       ///< generation ends when the text contains one (it is cut off)
  std::vector<int32_t> stop_token_ids; ///< ... or when one of these tokens is generated
  /// vLLM's include_stop_str_in_output: the stop string, or the text of the stop token (one of
  /// stop_token_ids or the model's other end tokens), that ended the answer stays at its end.
  /// Without it both are cut off, as vLLM does.
  bool include_stop_str_in_output = false;
  /// Each generated token's log-probability (completion::logprobs, stream_chunk::logprobs), with
  /// the top_logprobs (<= 20) most likely tokens' at its step.
  bool logprobs = false;
  uint32_t top_logprobs = 0;
  /// The prompt's tokens detokenized in the completion (completion::prompt_text), as OpenAI's
  /// echo shows them.
  bool echo = false;
  /// Each prompt token's log-probability given the tokens before it, with top_logprobs
  /// alternatives (completion::prompt_logprobs): prompt scoring, as evaluation harnesses ask with
  /// echo and logprobs. The prompt is then computed whole on one prefill rank (no cached prefix,
  /// no split, no prefill on the decode rank).
  bool prompt_logprobs = false;
  /// With prompt_logprobs: at least this many (<= 20) alternatives per prompt token, whatever
  /// top_logprobs asks for the generated ones (vLLM's `prompt_logprobs: k`); the prompt is scored
  /// with the larger of the two.
  uint32_t prompt_top_logprobs = 0;
  /// Echo with max_tokens 0: the one token the prefill picks (max_tokens is 1) is not shown and
  /// never fed back, so the prompt may fill the whole context.
  bool prompt_only = false;
};
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, generate_request& x) {
  return f(caf::meta::type_name("generate_request"), x.prompt, x.prompt_tokens, x.max_tokens,
           wire::f32{&x.temperature}, x.seed, x.return_logits, x.ignore_eos, x.traffic_class, x.priority, x.messages,
           x.top_k, wire::f32{&x.top_p}, wire::f32{&x.repetition_penalty}, wire::f32{&x.presence_penalty},
           wire::f32{&x.frequency_penalty}, x.stop, x.stop_token_ids, x.logprobs, x.top_logprobs, x.echo,
           x.prompt_logprobs, x.prompt_only, x.prompt_top_logprobs, x.chat_template_kwargs,
           x.tools_json, x.logit_bias_tokens, wire::f32s{&x.logit_bias_values}, x.output_format, x.output_spec,
           x.json_compact, wire::f32{&x.min_p}, x.min_tokens, x.include_stop_str_in_output, x.max_tokens_cap,
           x.add_special_tokens);
}

struct completion {
  uint64_t request_id = 0;
  uint32_t num_prompt_tokens = 0;
  std::vector<int32_t> tokens;                 ///< generated tokens, first one from prefill
  std::string text;                            ///< detokenized `tokens`
  std::string finish_reason;                   ///< "eos", "stop" (a stop string or token) or "length"
  /// What stopped it (vLLM's `stop_reason`): the stop string that matched, or the stop token
  /// (the request's stop_token_ids, or one of the model's extra end tokens); -1 and empty for
  /// the model's own end token and for length.
  std::string stop_string;
  int32_t stop_token = -1;
  int64_t ttft_us = 0;                         ///< arrival at the request actor -> first token
  std::vector<int64_t> tbt_us;                 ///< each interval between consecutive tokens
  std::vector<std::vector<float>> step_logits; ///< step_logits[i] chose tokens[i] (if asked)
  std::vector<token_logprob> logprobs;         ///< logprobs[i]: tokens[i]'s (generate_request::logprobs)
  std::string prompt_text;                     ///< the prompt's tokens detokenized (generate_request::echo)
  /// A chat of a thinking model: whether its rendered prompt ended inside <think> (1: the answer
  /// starts with reasoning) or not (2), as this request's own template variables made it (a
  /// DeepSeek-V3.1 chat's `thinking`, a Qwen3 chat's `enable_thinking`); 0: not such a chat.
  uint8_t prompt_thinking = 0;
  /// generate_request::prompt_logprobs: entry i is prompt token i's; the first's logprob is NaN
  /// (no token precedes it) and it has no alternatives.
  std::vector<token_logprob> prompt_logprobs;
  std::string prefill_rank;
  std::string decode_rank;
  // Where the time went, per stage (microseconds, actor clock: virtual in sims).
  int64_t place_us = 0;          ///< asking both balancers
  int64_t reserve_us = 0;        ///< KV lease round trip to the decode rank
  int64_t prefill_queue_us = 0;  ///< prefill order arrival -> its first chunk starts computing
  int64_t prefill_us = 0;        ///< prefill order sent -> first token back (queue + compute + send)
  int64_t decode_queue_us = 0;   ///< decode order arrival -> joins the batch (waits for KV layers)
  /// Why the balancers placed the request where they did: policy, inputs and choice.
  std::string prefill_placement_why;
  std::string decode_placement_why;
  int64_t check_us = 0;            ///< CHECK against the store's index
  uint32_t cached_tokens = 0;      ///< prompt tokens not computed (rank-local tier or store)
  uint32_t local_cached_tokens = 0;  ///< of those, found in the prefill rank's own pages
  uint32_t recomputed_blocks = 0;  ///< cached blocks that could not be used (recomputed)
  uint64_t kv_bytes = 0;           ///< KV shipped from prefill to decode rank (0: hybrid PD)
  int64_t kv_send_us = 0;          ///< first KV put posted -> last layer announced
  uint32_t failovers = 0;          ///< times the request was re-placed after a rank failed
  std::string failover_why;        ///< the last failure that re-placed it
  int64_t retry_wait_us = 0;       ///< paused before re-placing it (request_config::retry_backoff_ms)
  int64_t failed_attempts_us = 0;  ///< spent in attempts that failed before it was re-placed
  uint32_t migrations = 0;         ///< times its decode moved, KV and all, to another rank (no recompute)
};
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, completion& x) {
  return f(caf::meta::type_name("completion"), x.request_id, x.num_prompt_tokens, x.tokens, x.text, x.finish_reason,
           x.stop_string, x.stop_token,
           x.ttft_us, x.tbt_us, wire::f32_rows{&x.step_logits}, x.prefill_rank, x.decode_rank, x.place_us,
           x.reserve_us, x.prefill_queue_us, x.prefill_us, x.decode_queue_us, x.prefill_placement_why,
           x.decode_placement_why, x.check_us, x.cached_tokens, x.local_cached_tokens, x.recomputed_blocks,
           x.kv_bytes, x.kv_send_us, x.failovers, x.failover_why, x.migrations, x.logprobs, x.retry_wait_us, x.failed_attempts_us,
           x.prompt_text, x.prompt_logprobs, x.prompt_thinking);
}

}  // namespace baton
