// Constrained decoding's schema compiler and grammar matcher (gpu/json_schema_grammar.hpp,
// gpu/grammar.hpp): the input is a JSON schema's text (or "re:" and a regular expression, or
// "gbnf:" and a GBNF grammar), a NUL, then an answer's bytes; an odd-sized input asks for compact
// JSON.
// Beyond not crashing or hanging: a schema either compiles or says why, and at every step of the
// answer the vocabulary walk allows exactly the tokens a token-by-token check allows.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "gpu/json_schema_grammar.hpp"

namespace {

std::shared_ptr<const baton::gpu::token_vocabulary> pieces() {
  static const auto vocab = [] {
    std::vector<std::string> text = {"{", "}", "[", "]", "\"", ":", ",", " ", "\n", "\n  ", "{\"", "\":", "\",", "\"}",
                                     "a", "name", "true", "false", "null", "0", "1", "-", ".", "e", "E", "+", "\\",
                                     "\\u", "00", "</think>", "<", "/", "think>", "é", "\xc3", "]}", "},", "<|end|>"};
    std::vector<bool> special(text.size(), false);
    special.back() = true;
    return std::make_shared<baton::gpu::token_vocabulary>(std::move(text), std::move(special));
  }();
  return vocab;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string input(reinterpret_cast<const char*>(data), size);
  const size_t cut = input.find('\0');
  const std::string schema = input.substr(0, cut);
  const std::string answer = cut == std::string::npos ? std::string{} : input.substr(cut + 1);
  using baton::gpu::output_format;
  std::string why;
  const bool thinking = !answer.empty() && answer[0] == '<';
  const bool regex = schema.rfind("re:", 0) == 0, gbnf = schema.rfind("gbnf:", 0) == 0;
  const auto kind = regex  ? output_format::regex
                    : gbnf ? output_format::gbnf
                           : schema.empty() ? output_format::object : output_format::schema;
  auto g = baton::gpu::compile_output_grammar(kind, regex ? schema.substr(3) : gbnf ? schema.substr(5) : schema,
                                              {.after_thinking = thinking, .compact = size % 2 == 1}, &why);
  if (!g) {
    if (why.empty()) std::abort();  // a refusal always says why
    return 0;
  }
  const auto vocab = pieces();
  const int32_t end = static_cast<int32_t>(vocab->size() - 1);
  baton::gpu::grammar_matcher m(g, vocab, {end});
  std::vector<uint8_t> mask;
  // Feed the answer a few bytes at a time, checking the walk against single checks as it goes.
  for (size_t at = 0; at <= answer.size() && at < 256; at += 7) {
    m.allowed(&mask);
    for (uint32_t t = 0; t < vocab->size(); ++t)
      if (static_cast<bool>(mask[t]) != m.allows(static_cast<int32_t>(t))) std::abort();
    if (at < answer.size() && !m.accept_bytes(answer.substr(at, 7))) break;
  }
  return 0;
}
