// The answer's text as it grows (request_state.hpp): detokenizing, stop tokens and strings, and
// the log-probability entries that follow the text.

#include <algorithm>

#include "actors/request_state.hpp"
#include "gpu/byte_tokenizer.hpp"

namespace baton::request_detail {

/// The request's prompt detokenized (echo).
std::string prompt_text(const request_state& st) {
  const auto& p = st.plan.prompt_tokens;
  return st.plan.tokenizer ? st.plan.tokenizer->decode(p) : gpu::byte_tokenizer{-1, -1}.decode(p);
}

/// A token alone as text, by the request's tokenizer.
std::string token_text(const request_state& st, int32_t token) {
  return st.plan.tokenizer ? st.plan.tokenizer->decode({token}) : gpu::byte_tokenizer{-1, -1}.decode({token});
}

/// The text of the first `n` generated tokens (all of them by default).
std::string decode_text(const request_state& st, size_t n) {
  const std::vector<int32_t> some(st.out.tokens.begin(), st.out.tokens.begin() + static_cast<std::ptrdiff_t>(std::min(n, st.out.tokens.size())));
  const auto& tokens = n < st.out.tokens.size() ? some : st.out.tokens;
  if (st.plan.tokenizer) return st.plan.tokenizer->decode(tokens);
  return gpu::byte_tokenizer{-1, -1}.decode(tokens);
}

/// How many log-probability entries lie wholly within the first `sent` bytes of the text (each
/// entry's text is its token's, which the text grew by: hits_stop). An empty one waits for the
/// text after it, or for the end.
size_t logprobs_ready(request_state& st, size_t sent) {
  size_t n = st.emitted_logprobs;
  for (; n < st.out.logprobs.size(); ++n) {
    const size_t len = st.out.logprobs[n].text.size();
    if (st.logprob_bytes + len > sent || (len == 0 && st.logprob_bytes >= sent)) break;
    st.logprob_bytes += len;
  }
  return n;
}

/// A stop string cut the text at byte `kept` of `text`: the log-probability entries follow, so
/// that their texts join to the answer's, as its tokens' would have had the model stopped there
/// -- those after the cut go, and the token the cut runs through keeps its text before it.
void cut_logprobs(request_state& st, size_t kept) {
  size_t at = 0, n = 0;
  auto& lps = st.out.logprobs;
  for (; n < lps.size() && at < kept; ++n) {
    if (at + lps[n].text.size() > kept) lps[n].text.resize(kept - at);
    at += lps[n].text.size();
  }
  lps.resize(n);
}

/// Stop conditions of the request: a stop token, or a stop string in the text so far (the text
/// is cut before it). True when generation should end here.
bool hits_stop(request_state& st, int32_t token) {
  const auto& p = st.plan.params;
  // Byte-level tokens decode independently, so the text grows by this token's bytes; a stop
  // string can only end inside them, so only the tail needs searching (not the whole text
  // again at every token). Streaming sends this text as it grows.
  const size_t before = st.text.size();
  if (st.plan.sink || !p.stop.empty())
    st.text += token_text(st, token);
  // A stop token's text is not part of the answer unless asked for (vLLM v1's detokenizer
  // leaves it out the same way); the token itself stays among the tokens.
  const auto text_to_stop_token = [&] {
    return decode_text(st, p.include_stop_str_in_output ? st.out.tokens.size() : st.out.tokens.size() - 1);
  };
  if (!p.ignore_eos && std::find(st.plan.extra_eos_token_ids.begin(), st.plan.extra_eos_token_ids.end(), token) !=
                           st.plan.extra_eos_token_ids.end()) {
    st.out.text = text_to_stop_token();
    st.out.stop_token = token;  // vLLM's stop_reason names a generation config's end token too
    st.eos_hit = true;
    return true;
  }
  if (std::find(p.stop_token_ids.begin(), p.stop_token_ids.end(), token) != p.stop_token_ids.end()) {
    st.out.text = text_to_stop_token();
    st.out.stop_token = token;
    return true;
  }
  // min_tokens: stop strings are looked for only in the text after its first min_tokens tokens
  // (as vLLM v1's detokenizer does); the end tokens above were never picked before then.
  if (p.stop.empty()) return false;
  if (st.out.tokens.size() <= p.min_tokens) {
    st.stop_from = st.text.size();
    return false;
  }
  // Each stop string must end inside this token's text (an earlier end was found at its own
  // token, or lies in the text min_tokens shields), and start after what min_tokens shields.
  // The earliest wins; at the same place the first listed.
  size_t cut = std::string::npos;
  const std::string* matched = nullptr;
  for (const auto& s : p.stop) {
    const size_t at = s.empty() ? std::string::npos : st.text.find(s, std::max(st.stop_from, before >= s.size() ? before - s.size() + 1 : 0));
    if (at < cut) {
      cut = at;
      matched = &s;
    }
  }
  if (cut == std::string::npos) return false;
  const size_t cut_length = matched->size();
  st.out.stop_string = *matched;
  st.out.text = st.text.substr(0, p.include_stop_str_in_output ? cut + cut_length : cut);
  if (p.logprobs) cut_logprobs(st, st.out.text.size());
  return true;
}

}  // namespace baton::request_detail
