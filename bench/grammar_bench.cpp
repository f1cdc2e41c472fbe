// Constrained decoding's cost per token: finding every token a JSON grammar allows next
// (grammar_matcher::allowed), on a synthetic byte-level vocabulary of a real model's size, at the
// states an answer passes through. In the same run: the whole trie walked from the answer's
// stacks (allowed_by_whole_walk, the reference); the first and second answers to reach a stack
// top under a new grammar (the first sighting is answered by the whole walk; the second walks the
// top on its own and keeps it); and a later answer at the same top (the cache answers, and only
// the tokens that read past the top are walked). Next to
// them, what the walk replaces: checking each token on its own (grammar_matcher::allows, the
// per-token cost a sampler without a trie pays), and the greedy fast path's single check
// (sampling.cpp takes it whenever the model's own pick is allowed). A matcher also keeps its last
// answer for the same stacks, which inside a string recur token after token: that row shows the
// cost of a string's later tokens.
// Usage: baton_bench_grammar [--vocab N] [--reps N]

#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "bench/bench_stats.hpp"
#include "gpu/json_schema_grammar.hpp"
#include "bench/bench_flags.hpp"

using namespace baton::gpu;
using clock_type = std::chrono::steady_clock;

namespace {

/// Tokens as byte-level BPE vocabularies look: words with and without a leading space, word
/// pieces, numbers, punctuation runs, whitespace runs; every byte alone too.
std::shared_ptr<const token_vocabulary> synthetic_vocabulary(uint32_t n) {
  std::mt19937 rng(42);
  const std::string letters = "etaoinshrdlcumwfgypbvkjxqz";
  std::vector<std::string> text;
  for (int b = 0; b < 256; ++b) text.emplace_back(1, static_cast<char>(b));
  while (text.size() < n) {
    std::string t;
    const unsigned kind = rng() % 100;
    if (kind < 70) {  // a word or a piece of one
      if (rng() % 2) t += ' ';
      const unsigned len = 1 + rng() % 9;
      for (unsigned i = 0; i < len; ++i) t += letters[std::min<size_t>(rng() % 26, rng() % 26)];
      if (rng() % 8 == 0) t[t[0] == ' ' ? 1 : 0] = static_cast<char>(std::toupper(t[t[0] == ' ' ? 1 : 0]));
    } else if (kind < 80) {
      const unsigned len = 1 + rng() % 3;
      for (unsigned i = 0; i < len; ++i) t += static_cast<char>('0' + rng() % 10);
    } else if (kind < 95) {
      const std::string punct = "{}[]\":,.;!?()'-_/\\<>=+*&%$#@";
      const unsigned len = 1 + rng() % 3;
      for (unsigned i = 0; i < len; ++i) t += punct[rng() % punct.size()];
    } else {
      t = std::string(1 + rng() % 8, rng() % 2 ? ' ' : '\n');
    }
    text.push_back(std::move(t));
  }
  std::vector<bool> special(text.size(), false);
  text.push_back("<|end|>");
  special.push_back(true);
  return std::make_shared<token_vocabulary>(std::move(text), std::move(special));
}

template <class F>
double median_us(int reps, F&& f) {
  std::vector<double> us;
  for (int i = 0; i < reps; ++i) {
    const auto t0 = clock_type::now();
    f();
    us.push_back(std::chrono::duration<double, std::micro>(clock_type::now() - t0).count());
  }
  return baton::bench::median(us);
}

/// The median time of allowed() at `m`'s state, each on a copy (a matcher keeps its last answer
/// for the same stacks; the grammar's cache of tops is shared); the mask and its count come back.
double walk_us(const grammar_matcher& m, int reps, std::vector<uint8_t>* mask, size_t* allowed) {
  return median_us(reps, [&] {
    grammar_matcher copy(m);
    *allowed = copy.allowed(mask);
  });
}

/// The same for the whole walk (no cache taken or kept).
double whole_walk_us(const grammar_matcher& m, int reps, std::vector<uint8_t>* mask, size_t* allowed) {
  return median_us(reps, [&] { *allowed = m.allowed_by_whole_walk(mask); });
}

/// The median times of the first and the second answer to reach `text`'s state under a freshly
/// compiled grammar (its cache of tops empty): the first sighting of a top is answered by the
/// whole walk, the second walks the top on its own and keeps it. Compiling and following the
/// text are not timed.
std::pair<double, double> first_us(output_format kind, const std::string& spec, const std::string& text,
                                   const std::shared_ptr<const token_vocabulary>& vocab, int32_t end, int reps) {
  std::vector<double> first, second;
  std::vector<uint8_t> mask;
  for (int i = 0; i < reps; ++i) {
    std::string why;
    const auto g = compile_output_grammar(kind, spec, {}, &why);
    for (auto* us : {&first, &second}) {
      grammar_matcher m(g, vocab, {end});
      m.accept_bytes(text);
      const auto t0 = clock_type::now();
      m.allowed(&mask);
      us->push_back(std::chrono::duration<double, std::micro>(clock_type::now() - t0).count());
    }
  }
  return {baton::bench::median(first), baton::bench::median(second)};
}

}  // namespace

int main(int argc, char** argv) {
  uint32_t vocab_size = 151643;  // Qwen2.5's byte-level BPE vocabulary
  uint32_t reps_flag = 5;
  baton::deploy::flag_set flags;
  flags.add("--vocab", &vocab_size, "tokens in the synthetic byte-level vocabulary");
  flags.add("--reps", &reps_flag, "repetitions per measurement (the median is printed)");
  if (auto rc = baton::bench::parse_flags(flags, argc, argv, "[--vocab N] [--reps N]")) return *rc;
  if (reps_flag == 0 || vocab_size < 2) return std::fprintf(stderr, "baton_bench_grammar: --reps must be >= 1, --vocab >= 2\n"), 2;
  const int reps = static_cast<int>(std::min<uint32_t>(reps_flag, 1000000));
  const auto t0 = clock_type::now();
  const auto vocab = synthetic_vocabulary(vocab_size);
  const double build_ms = std::chrono::duration<double, std::milli>(clock_type::now() - t0).count();
  const int32_t end = static_cast<int32_t>(vocab->size() - 1);
  std::printf("vocabulary: %u tokens, trie of %zu nodes built in %.0f ms\n", vocab->size(), vocab->trie().size(), build_ms);
  const std::string schema = R"({"type":"object","properties":{"name":{"type":"string"},"age":{"type":"integer"},
      "tags":{"type":"array","items":{"enum":["red","green","blue"]}}},"required":["name","age","tags"]})";
  struct state {
    const char* what;
    bool any_object;
    std::string text;  // the answer so far
  };
  const std::vector<state> states = {
      {"json_object, at the start", true, ""},
      {"json_object, inside a string", true, "{\"note\": \"The quick brown"},
      {"schema, after a key", false, "{\"name\":"},
      {"schema, inside a number", false, "{\"name\": \"Ada\", \"age\": 3"},
      {"schema, an enum's string", false, "{\"name\": \"Ada\", \"age\": 36, \"tags\": [\"gr"},
  };
  std::printf("| state | allowed | whole walk us | first sighting us | second (fills) us | cached top us | "
              "per-token checks us | cached vs whole | one check us |\n");
  std::printf("|---|---:|---:|---:|---:|---:|---:|---:|---:|\n");
  for (const auto& s : states) {
    std::string why;
    const auto kind = s.any_object ? output_format::object : output_format::schema;
    const std::string spec = s.any_object ? "" : schema;
    auto g = compile_output_grammar(kind, spec, {}, &why);
    grammar_matcher m(g, vocab, {end});
    if (!m.accept_bytes(s.text)) {
      std::printf("bad state text: %s\n", s.text.c_str());
      return 1;
    }
    std::vector<uint8_t> mask, whole_mask;
    size_t allowed = 0, whole_allowed = 0;
    const double whole = whole_walk_us(m, reps, &whole_mask, &whole_allowed);
    const auto [first, second] = first_us(kind, spec, s.text, vocab, end, reps);
    const double walk = walk_us(m, reps, &mask, &allowed);
    if (mask != whole_mask || allowed != whole_allowed) {
      std::printf("MISMATCH: the cached answer allows %zu, the whole walk %zu\n", allowed, whole_allowed);
      return 1;
    }
    size_t checked = 0;
    const double each = median_us(std::max(1, reps / 2), [&] {
      checked = 0;
      for (uint32_t t = 0; t < vocab->size(); ++t) checked += m.allows(static_cast<int32_t>(t));
    });
    if (checked != allowed) {
      std::printf("MISMATCH: walk allows %zu, per-token checks %zu\n", allowed, checked);
      return 1;
    }
    int32_t some = 0;
    while (some < end && !mask[some]) ++some;
    const double one = median_us(reps * 20, [&] { (void)m.allows(some); });
    std::printf("| %s | %zu | %.0f | %.0f | %.0f | %.0f | %.0f | %.1fx | %.2f |\n", s.what, allowed, whole, first, second,
                walk, each, whole / walk, one);
    if (s.any_object && !s.text.empty()) {
      // The next token of the same string: the stacks are those of the last walk, whose answer
      // the matcher kept (a fresh matcher at that state has to walk).
      m.allowed(&mask);
      m.accept_bytes(" fox");
      const double again = median_us(reps, [&] { m.allowed(&mask); });
      std::printf("| ... the next token of that string (the kept answer) | %zu | | | | %.0f | | | |\n", allowed, again);
    }
  }
  // What a request pays before its first token: compiling its grammar, once per process for a
  // schema seen before (cached_output_grammar); and a GBNF grammar of JSON objects, the text form
  // of json_object, walked where the native one was.
  const std::string gbnf = R"(root   ::= object
value  ::= object | array | string | number | ("true" | "false" | "null")
object ::= "{" ws (member ("," ws member)*)? "}"
member ::= string ws ":" ws value ws
array  ::= "[" ws (value ws ("," ws value ws)*)? "]"
string ::= "\"" ([^"\\\x00-\x1F] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F]{4}))* "\""
number ::= "-"? ("0" | [1-9] [0-9]*) ("." [0-9]+)? ([eE] [-+]? [0-9]+)?
ws     ::= ("" | " " | "\n" [ \t]{0,24})
)";
  std::string why;
  const double compile = median_us(reps, [&] { (void)compile_output_grammar(output_format::schema, schema, {}, &why); });
  (void)cached_output_grammar(output_format::schema, schema, {}, &why);
  const double cached = median_us(reps * 20, [&] { (void)cached_output_grammar(output_format::schema, schema, {}, &why); });
  const double gbnf_compile = median_us(reps, [&] { (void)compile_output_grammar(output_format::gbnf, gbnf, {}, &why); });
  std::printf("\ncompile: the schema %.0f us, the same schema from the cache %.2f us, the GBNF grammar %.0f us\n", compile,
              cached, gbnf_compile);
  auto g = compile_output_grammar(output_format::gbnf, gbnf, {}, &why);
  if (!g) {
    std::printf("GBNF: %s\n", why.c_str());
    return 1;
  }
  grammar_matcher m(g, vocab, {end});
  if (!m.accept_bytes(states[1].text)) {
    std::printf("GBNF: refuses %s\n", states[1].text.c_str());
    return 1;
  }
  std::vector<uint8_t> mask;
  size_t allowed = 0;
  const double whole = whole_walk_us(m, reps, &mask, &allowed);
  const auto [first, second] = first_us(output_format::gbnf, gbnf, states[1].text, vocab, end, reps);
  const double walk = walk_us(m, reps, &mask, &allowed);
  std::printf("GBNF json object, inside a string: %zu allowed; whole walk %.0f us, first sighting %.0f us, second "
              "(fills) %.0f us, cached top %.0f us\n", allowed, whole, first, second, walk);
  return 0;
}
