#pragma once

// The OpenAI API's JSON on top of Baton's messages: request bodies of /v1/completions and
// /v1/chat/completions into a generate_request, completions and stream chunks into response
// bodies, errors into OpenAI's error object. Pure functions (no sockets, no actors).
//
// OpenAI's logit_bias is honoured (token ids of the served model's vocabulary). Accepted beyond
// OpenAI's own fields, as vLLM does: top_k, repetition_penalty, ignore_eos,
// stop_token_ids, up to 20 log-probabilities per token; and Baton's traffic_class and priority.
// `n` choices are n requests (choice i draws with seed + i); a batch of prompts is n choices per
// prompt (call::choice_request). Completions' echo returns the
// prompt first, with its tokens' log-probabilities when logprobs is set (prompt scoring; max_tokens
// 0 for the prompt alone), streamed too; vLLM's `prompt_logprobs: k` gives them in vLLM's shape,
// on chat too. Chat takes tools (docs/chat-templates.md), a forced tool_choice too, and
// response_format's json_object and json_schema (docs/structured-outputs.md): those answers are
// constrained to JSON as they are generated. Completions' best_of runs best_of generations per
// prompt and answers the n with the highest log-probability per token. Fields Baton cannot
// honour (echo on chat, the old `functions`) are refused by name rather than ignored; unknown
// fields are ignored, as OpenAI's servers do.

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "actors/messages.hpp"
#include "gpu/tool_call_format.hpp"

namespace baton::deploy::openai {

/// How a Qwen3-Coder XML call's parameter value, raw text, becomes JSON: by the type its tool's
/// schema gives the parameter, as vLLM's qwen3_coder parser reads it (openai_tool_calls_xml.cpp).
enum class parameter_kind : uint8_t {
  text,     ///< a string type, no type, or a parameter the schema lacks: the text as a string
  integer,  ///< int*, uint*, long*, short*, unsigned*: an integer if it reads as one
  number,   ///< num*, float*: a number if it reads as one (an integral one as an integer)
  boolean,  ///< boolean, bool, binary: true or false if it reads as one
  json,     ///< object, array, any other type: the text's JSON if it reads as JSON
};
/// The request's tools' parameters: function name -> parameter name -> how its value is read.
/// The first tool of a name counts (vLLM's).
using tool_parameter_kinds = std::map<std::string, std::map<std::string, parameter_kind, std::less<>>, std::less<>>;

struct call {
  bool chat = false;           ///< /v1/chat/completions
  uint32_t n = 1;              ///< generations per prompt: n requests, generation i drawn with seed + i
  /// Completions' best_of > n: `n` holds best_of, and this many (fewer than n) of each prompt's
  /// generations are answered, those with the highest log-probability per token (0: all are).
  uint32_t best_of_keep = 0;
  /// best_of turned req.logprobs on to rank the generations; the answer shows none.
  bool logprobs_for_ranking = false;
  bool stream = false;         ///< answer as server-sent events
  bool include_usage = false;  ///< stream_options.include_usage: a last chunk with the usage
  /// The body gave `seed`: the same body draws the same text. Without one the gateway draws a
  /// seed per call, so that a retry or a "regenerate" samples anew (req.seed is 0 until then).
  bool seeded = false;
  /// The body gave temperature / top_p / top_k; the gateway fills those it did not from the
  /// model's defaults (router_config::default_temperature, ...).
  bool temperature_given = false, top_p_given = false, top_k_given = false, repetition_penalty_given = false;
  std::string model;           ///< the model the client named (echoed back)
  generate_request req;        ///< the request of every choice (its prompt: the first of a batch)
  /// A batch (completions' `prompt` as an array of strings, or of token-id arrays): choice i
  /// answers prompt i / n, drawn with seed + i % n, as OpenAI orders them. Empty: one prompt, req's.
  std::vector<std::string> batch_texts;
  std::vector<std::vector<int32_t>> batch_tokens;
  /// vLLM's `prompt_logprobs: k` (req.prompt_top_logprobs = k): each prompt token's log-probability,
  /// rank and the k most likely tokens at its position, in vLLM's shape (`prompt_logprobs` in each
  /// completions choice, at the top of a chat answer). Answered whole, never streamed.
  bool vllm_prompt_logprobs = false;
  /// The body's `separate_reasoning` (SGLang's; default true): false keeps a thinking model's
  /// reasoning in `content`, as generated.
  bool reasoning_wanted = true;
  /// Chat answers split into `reasoning_content` (up to the first </think>) and `content`, as
  /// DeepSeek's API gives R1's. Set by the gateway: a chat call, reasoning_wanted, and a model
  /// whose chat template knows <think> (cluster_stats::chat_reasoning).
  bool separate_reasoning = false;
  /// The request gave tools (req.tools_json): how the model writes its calls
  /// (cluster_stats::chat_tool_calls), set by the gateway. Answers' calls go to `tool_calls`.
  gpu::tool_call_format tool_calls = gpu::tool_call_format::none;
  bool max_tokens_given = false;  ///< the body gave max_tokens (or max_completion_tokens)
  /// tool_choice "none": the template shows the tools, but the answer is not read for calls.
  bool tool_choice_none = false;
  /// The calls the conversation made before this answer: the assistant messages' tool_calls,
  /// counted by parse_body. Kimi-K2's call ids number every call of a conversation, so each
  /// choice's go on from these (its calls' ids: openai.cpp, tool_call_id).
  uint32_t num_history_tool_calls = 0;
  /// The request's tools' parameter types (parse_body; null without tools): Qwen3-Coder's XML
  /// calls write each value as text, typed by these. Built once per request and shared, read-only,
  /// by its choices' readers (which may outlive a copy of the call).
  std::shared_ptr<const tool_parameter_kinds> tool_parameters;
  /// A forced tool_choice, answered as JSON under a grammar (req.output_format 2): the answer is the
  /// arguments of a call of this function ({type: "function", function: {name}}) ...
  std::string forced_tool;
  /// ... or, with "required", a list of calls, each {"name", "parameters"}.
  bool forced_calls = false;
  /// Which field asked for req.output_spec, as `param` ("response_format", "tools",
  /// "guided_json", ...), and how a refusal of it names it ("response_format.json_schema.schema",
  /// "tools[2].function.parameters"): a schema, expression or grammar that does not compile is
  /// refused here already, naming its field (check_constraint_compiles).
  std::string constraint_param, constraint_label;
  /// parallel_tool_calls false: at most one call -- the answer's first (later ones are dropped,
  /// as vLLM does; a "required" call's grammar allows one only).
  bool one_tool_call = false;

  uint32_t num_prompts() const {
    return static_cast<uint32_t>(std::max<size_t>(1, std::max(batch_texts.size(), batch_tokens.size())));
  }
  uint32_t num_choices() const { return num_prompts() * n; }
  /// Choice `index`'s request: its prompt and its seed.
  generate_request choice_request(uint32_t index) const;
};

struct api_error {
  int status = 400;
  std::string message;
  std::string type = "invalid_request_error";
  std::string param;  ///< the offending field, if one
  /// OpenAI's machine-readable code, which clients branch on (context_length_exceeded: trim and
  /// retry); empty: the one the status implies (error_json), else null.
  std::string code = {};
};

/// Default max_tokens: OpenAI's (and vLLM's) 16 for completions; for chat, 0, which the router
/// turns into what the context leaves after the prompt (OpenAI's and vLLM's chat default).
inline constexpr int32_t default_completion_tokens = 16;
inline constexpr int32_t default_chat_tokens = 0;
/// The most choices one call may ask for (`n`): each is a request of its own.
inline constexpr uint32_t max_choices = 64;
/// The most prompts in one batch, and the most requests (prompts times n) one call may start.
inline constexpr uint32_t max_batch_prompts = 256;
/// Deeper nesting than any OpenAI body (or a tool call's arguments) has: refused before parsing,
/// so that nothing (the parser, a message printing the value, the destructor) walks a million
/// levels deep.
inline constexpr size_t max_json_depth = 64;
/// Whether JSON text nests arrays and objects deeper than max_json_depth (strings skipped).
bool nested_too_deep(std::string_view text);
inline constexpr uint32_t max_call_requests = 1024;

/// A thinking model's answer, told apart as it streams: everything before the first </think> is
/// reasoning, everything after it content (the tag itself is neither). A tail that may be the
/// start of </think> is held back until the next piece, or the last, settles it. When the
/// template did not open <think> (`opened` false), an answer is reasoning only if it starts with
/// <think> (after whitespace); its start is held back until that is known.
/// A function call the model wrote (OpenAI's tool_calls entry): `arguments` is JSON text, as the
/// model wrote it. Read whole, a call is one piece. In a stream it comes in pieces: the first
/// (`first`) names it, and each carries the next part of its arguments; `index` is the call's
/// place in the answer, shared by its pieces.
struct tool_call {
  std::string name;
  std::string arguments;
  uint32_t index = 0;
  bool first = true;
  /// The id the model wrote for the call, where its format has one (Kimi-K2's functions.NAME:N);
  /// empty: the gateway makes one (tool_call_id).
  std::string id{};
};

/// What a piece of an answer shows, told apart: its reasoning, its content, and the tool calls
/// (or pieces of them) it made.
struct answer_parts {
  std::string reasoning;
  std::string content;
  std::vector<tool_call> tool_calls;
  bool called = false;  ///< on the answer's last piece: it made tool calls (its finish_reason is "tool_calls")
  /// On the last piece of a forced answer whose JSON did not close (max_tokens or a stop string
  /// cut it): its calls are as far as they went, and its finish_reason stays what it was.
  bool cut = false;
};

class reasoning_splitter {
public:
  explicit reasoning_splitter(bool opened = true) : undecided_(!opened) {}
  using parts = answer_parts;
  /// The next piece of the answer's text; `last`: nothing follows (what is held back goes out).
  parts feed(const std::string& text, bool last);
  /// </think> has been read (what follows is content).
  bool closed() const { return closed_; }

private:
  bool undecided_;        ///< not yet known whether the answer opens <think>
  bool closed_ = false;  ///< </think> seen (or no <think> opened): everything now is content
  std::string held_;     ///< the undecided start, or reasoning's tail that </think> may start with
};

/// A whole answer split the same way (reasoning_splitter).
reasoning_splitter::parts split_reasoning(const std::string& text, bool opened = true);

/// The tool calls in an answer's content, read as `format` writes them
/// (gpu/tool_call_format.hpp); the content is what comes before the first call, then any text
/// between and after them. All or nothing: an answer whose calls do not all read as JSON with a
/// name is content, whole (nothing is lost). A Llama call counts only where the answer starts.
/// Qwen3-Coder's XML calls are read leniently instead, as vLLM reads them: a call once named
/// always reads, text among its parameters passed over (openai_tool_calls_xml.hpp).
/// `parameters` (may be null: any function): the request's tools, which type a Qwen3-Coder XML
/// call's values; a call of a function not among them ends the calls -- it and what follows are
/// content, the calls before it stand (with none before it, the answer is content, whole).
answer_parts read_tool_calls(const std::string& content, gpu::tool_call_format format,
                             const tool_parameter_kinds* parameters = nullptr);

/// How far a JSON object or array has been read, so that reading it as it streams costs each
/// byte once: scan_json goes on from `at`.
struct json_scan {
  size_t at = 0;
  uint32_t depth = 0;
  bool in_string = false, escaped = false;
};

/// Reads on from scan.at to the end of `s`; true when the value that started at the scan's first
/// byte ends (scan.at is then one past it).
bool scan_json(std::string_view s, json_scan& scan);

/// The same as an answer streams: content before the first call's marker (<tool_call>,
/// [TOOL_CALLS], <｜tool▁calls▁begin｜>) goes out at once, a tail that may start the marker held
/// back. From the marker on, each call goes out as the model writes it: its name once read, then
/// its arguments' JSON as it grows (trailing whitespace held back). Whatever a stream cannot read
/// that way (arguments before the name, or written as a string; text between calls) waits for
/// the end, where the whole answer is read (read_tool_calls) and completes the calls. A Llama
/// answer is held while it may still start with a call ({ or <|python_tag|> after whitespace),
/// then streams as content, or as calls. A Qwen3-Coder XML call is named at its <function=NAME>
/// and its arguments go out in one piece at its </function>: a value is typed only once it ends
/// (an integer's "3" is 3, but "3 days" is text), and a piece sent cannot be taken back. Those
/// always read as the whole answer does; a call cut by max_tokens gets its arguments (the
/// parameters so far) at the answer's end.
///
/// A stream cannot take back what it sent: when the end does not read as the calls that went out
/// (the model broke its JSON; a cut answer's arguments just stop), the calls sent stand, and the
/// text from the first marker on follows as content, so nothing is lost. Read whole (one feed,
/// `last`), an answer is all calls or all content, as read_tool_calls reads it.
class tool_call_splitter {
public:
  /// `parameters` (may be null): the request's tools (call::tool_parameters), for Qwen3-Coder's
  /// XML calls.
  explicit tool_call_splitter(gpu::tool_call_format format,
                              std::shared_ptr<const tool_parameter_kinds> parameters = nullptr)
    : format_(format), parameters_(std::move(parameters)) {}
  /// A forced tool_choice's answer (read_forced_calls): JSON from its first byte, the arguments
  /// of `tool`, or (`tool` empty) a list of calls.
  static tool_call_splitter forced(std::string tool);
  answer_parts feed(const std::string& content, bool last);

private:
  /// A call whose first piece has gone out: its arguments are held_[args_begin, args_sent) so far,
  /// or `built`: a Qwen3-XML call's arguments are JSON made from its parameters, not its text.
  struct sent_call {
    std::string name;
    size_t args_begin = 0, args_sent = 0;
    std::vector<std::string> ends;  ///< markers that end the call (kept as streamable_prefix takes them)
    std::string built;
  };
  void stream_calls(answer_parts* out);
  /// The last Qwen3-XML call's arguments, whole, once its </function> is read: false until then
  /// (or for good, stopped_, where they do not read).
  bool stream_xml_arguments(answer_parts* out);
  answer_parts read_held() const;
  /// The arguments of `call` that have gone out.
  std::string_view sent_arguments(const sent_call& call) const;

  gpu::tool_call_format format_;
  std::shared_ptr<const tool_parameter_kinds> parameters_;
  bool forced_ = false;
  std::string forced_tool_;
  bool calling_ = false;  ///< a call's marker seen: what follows is calls until the end says otherwise
  bool plain_ = false;    ///< Llama: the answer did not start with a call, so it has none
  bool shown_ = false;    ///< content went out before the calls: what they leave follows on a new line
  std::string held_;      ///< from the first marker on (or the undecided start)
  std::vector<sent_call> sent_;
  bool args_open_ = false;  ///< the last sent call's arguments have not ended yet (scan_ reads them)
  json_scan scan_;
  json_scan probe_;         ///< where an end marker found in the arguments lies: in a string or not
  /// Where the next call is looked for: where the last sent call's arguments ended, then moved
  /// on (never back) past text searched that holds no marker looked for, so that text between
  /// and after the calls is searched once however it streams (a byte at a time, say).
  size_t next_from_ = 0;
  bool end_seen_ = false;   ///< Hermes: the last call's </tool_call> is behind next_from_
  size_t tag_scanned_ = 0;  ///< Qwen3-XML: the <function= at next_from_ holds no '>' before this
  std::array<size_t, 3> head_scanned_{};  ///< DeepSeek, Kimi: how far the next call's head was searched (sectioned_head)
  bool stopped_ = false;    ///< nothing more streams: the rest waits for the end
};

/// One choice's chat answer read as its call asks: the reasoning split out
/// (call::separate_reasoning), then tool calls read from the rest (call::tool_calls); else
/// the text is content as it is. Fed each streamed piece, or a whole answer once with `last`:
/// both read the same.
class answer_reader {
public:
  /// `prompt_thinking`: the router's word on this answer (completion::prompt_thinking, in every
  /// stream chunk): 1, the chat's prompt opened <think>, so the answer starts as reasoning;
  /// otherwise only an answer that itself opens <think> has any.
  answer_reader(const call& c, uint8_t prompt_thinking)
    : reasoning_(c.separate_reasoning),
      tools_(c.tool_calls != gpu::tool_call_format::none),
      forced_(!c.forced_tool.empty() || c.forced_calls),
      one_call_(c.one_tool_call),
      prompt_thinking_(prompt_thinking == 1),
      thinking_(prompt_thinking == 1),
      calls_(forced_ ? tool_call_splitter::forced(c.forced_tool)
                     : tool_call_splitter{c.tool_calls, c.tool_parameters}) {}
  /// Whether it tells anything apart (else a chunk's text is shown as it is).
  bool active() const { return reasoning_ || tools_ || forced_; }
  answer_parts feed(const std::string& text, bool last);

private:
  answer_parts read(const std::string& text, bool last);
  bool reasoning_, tools_, forced_;
  bool one_call_;             ///< call::one_tool_call
  bool prompt_thinking_;      ///< the prompt opened <think>: a forced call's JSON follows its </think>
  bool think_closed_ = false;  ///< ... and that </think> has been shown (separate_reasoning false)
  bool forced_started_ = false;  ///< a forced call's JSON has begun (after </think> and blank lines)
  reasoning_splitter thinking_;
  tool_call_splitter calls_;
};

/// A forced tool_choice's answer (call::forced_tool, call::forced_calls) read as its calls: the
/// JSON is the named function's arguments, or a list of {"name", "parameters"}. An answer that
/// does not read (cut by max_tokens) is content, whole.
answer_parts read_forced_calls(const std::string& text, const std::string& forced_tool);

/// Parses a request body; false and `err` (naming the field) when it is not acceptable.
/// `aliases`: more names a call may give the model by (it is answered under the one it gave).
bool parse_body(std::string_view body, bool chat, const std::string& served_model, call* out, api_error* err,
                const std::vector<std::string>& aliases = {});

/// OpenAI's finish_reason for Baton's: eos and stop -> "stop", length -> "length".
std::string finish_reason(const std::string& baton_reason);

/// A call's tokens as its answer's `usage` counts them: each prompt once (choices i·n ... i·n+n-1
/// share prompt i), every generated token (none for a prompt-only call's).
struct usage {
  uint64_t prompt = 0, generated = 0, cached = 0;
};
usage usage_counts(const std::vector<completion>& choices, uint32_t n, bool prompt_only);

/// The whole answer: one choice per completion, in order (usage: the prompt once, every choice's tokens).
std::string completion_json(const call& c, const std::vector<completion>& choices, const std::string& id, int64_t created);
/// best_of: each prompt's best_of_keep generations with the highest log-probability per token
/// (ties: the earlier), best first; every generation when the call has no best_of.
std::vector<completion> best_of_choices(const call& c, const std::vector<completion>& generations);
std::string completion_json(const call& c, const completion& done, const std::string& id, int64_t created);
/// One streamed chunk of choice `index`; `first` adds the chat's assistant role. `text_offset`:
/// the characters of the texts of that choice's tokens streamed before (completions'
/// logprobs.text_offset; utf8_chars). `split`: with call::separate_reasoning or
/// tool_calls, the chunk's text as that choice's splitters told it apart (chunk.text is then
/// not used); tool calls stream in pieces (tool_call), and the last chunk of an answer that
/// made any has finish_reason "tool_calls" (unless it was cut: "length").
std::string chunk_json(const call& c, const stream_chunk& chunk, const std::string& id, int64_t created, bool first,
                       uint64_t text_offset = 0, uint32_t index = 0, const answer_parts* split = nullptr);
/// Characters of UTF-8 text, counted by the bytes that start one (text_offset's unit).
uint64_t utf8_chars(const std::string& s);
/// The usage chunk that ends a stream when stream_options.include_usage is set.
std::string usage_chunk_json(const call& c, const std::vector<completion>& choices, const std::string& id, int64_t created);
std::string error_json(const api_error& e);
/// GET /v1/models: the served model under each of its names (vLLM's list), with vLLM's
/// max_model_len (its context) when known.
std::string models_json(const std::vector<std::string>& names, int64_t created, uint32_t context_tokens = 0);
/// GET /v1/models/{id}: the one model object.
std::string model_json(const std::string& model, int64_t created, uint32_t context_tokens = 0);

/// vLLM's POST /tokenize: a completions body's `prompt` (one text, or token ids) or a chat body's
/// `messages` (with its tools and template variables), and add_special_tokens, read into a
/// request whose prompt the router encodes (router_actor's tokenize_atom). return_token_strs is
/// refused: the ids' texts come from /detokenize.
bool parse_tokenize_body(std::string_view body, const std::string& served_model, const std::vector<std::string>& aliases,
                         generate_request* out, api_error* err);
/// vLLM's POST /detokenize: `tokens`, a non-empty array of token ids.
bool parse_detokenize_body(std::string_view body, const std::string& served_model,
                           const std::vector<std::string>& aliases, std::vector<int32_t>* out, api_error* err);
/// /tokenize's answer, vLLM's shape: {count, max_model_len, tokens, token_strs: null}.
std::string tokenize_json(const std::vector<int32_t>& tokens, uint32_t max_model_len);
/// /detokenize's answer: {prompt}.
std::string detokenize_json(const std::string& text);

}  // namespace baton::deploy::openai
