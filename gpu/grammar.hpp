#pragma once

// Constrained decoding (OpenAI's response_format and forced tool calls): a context-free grammar
// over bytes, a matcher that follows one sequence's output through it, and which tokens of a
// vocabulary may come next. json_schema_grammar.hpp writes the grammars; sampling.cpp applies a
// matcher to a row of logits (a token the grammar does not allow is never picked).
//
// Bytes, not characters: byte-level BPE tokens often end inside a UTF-8 character, so a token is
// checked byte by byte, and a grammar's "any character" is any byte of a multi-byte one.

#include <array>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace baton::gpu {

struct grammar_arena;  // grammar.cpp: interned stacks, a matcher's scratch
struct top_masks;      // grammar.cpp: what the tops of stacks allow, per vocabulary
class token_vocabulary;

/// Rules of alternatives of sequences; each element is a set of bytes or another rule. The
/// start rule matches the whole output. No rule may start with itself (left recursion): the
/// grammars here are written right-recursive (a list is `item rest`, `rest ::= "," item rest | ""`),
/// which the matcher follows in constant stack depth.
class grammar {
public:
  using byte_set = std::array<uint64_t, 4>;
  /// One symbol of an alternative: a byte from `set`, or what rule `rule` matches.
  struct symbol {
    bool is_rule = false;
    uint32_t rule = 0;
    byte_set set = {};
  };

  /// A rule with no alternatives yet (alternatives may name it: recursion).
  uint32_t add_rule();
  /// One way to match `rule`: the symbols in order (none: the empty string).
  void add_alternative(uint32_t rule, const std::vector<symbol>& symbols);
  void set_start(uint32_t rule) { start_ = rule; }
  /// What `max` is for a repeat without an upper bound.
  static constexpr uint32_t unbounded = UINT32_MAX;
  /// A new rule matching what `item` matches, `min` to `max` times (quantifiers of patterns and
  /// GBNF): the optional tail is right-recursive when unbounded, a chain of max - min otherwise.
  uint32_t add_repeat(uint32_t item, uint32_t min, uint32_t max);
  /// One alternative of `rule` per form of a well-formed UTF-8 character past ASCII (RFC 3629:
  /// no overlong forms, no surrogates, nothing past U+10FFFF).
  void add_utf8_multibyte(uint32_t rule);

  static symbol ref(uint32_t rule) { return {true, rule, {}}; }
  static symbol byte(uint8_t b);
  /// Any byte in [lo, hi].
  static symbol range(uint8_t lo, uint8_t hi);
  /// Any byte but these.
  static symbol except(std::string_view bytes);
  /// One symbol per byte of `text`.
  static std::vector<symbol> literal(std::string_view text);

  uint32_t rules() const { return static_cast<uint32_t>(alternatives_.size()); }
  uint32_t start() const { return start_; }

  // The matcher's view: alternatives flattened into `elements`, each ended by an `end` element.
  enum class kind : uint8_t { bytes, rule, end };
  struct element {
    kind k;
    uint32_t value;  ///< bytes: index into sets(); rule: the rule
  };
  const std::vector<element>& elements() const { return elements_; }
  const std::vector<byte_set>& sets() const { return sets_; }
  /// Where each alternative of `rule` starts in elements().
  const std::vector<uint32_t>& alternatives(uint32_t rule) const { return alternatives_[rule]; }
  static bool has(const byte_set& s, uint8_t b) { return (s[b >> 6] >> (b & 63)) & 1; }

  /// The most rules the matcher expands through without reading a byte; past it an expansion
  /// is cut, which would narrow the language (left_shape says whether a grammar goes past it).
  static constexpr uint32_t max_expand_depth = 2048;

  /// What the matcher can follow of the grammar, found once, before any answer uses it.
  struct shape {
    /// Some rule can reach itself again before reading a byte, with something left to follow it
    /// there (`a ::= a "x" | "y"`): left recursion, which the matcher cannot follow (it would
    /// expand without end, and cutting it would narrow the language); `rule` is one such rule.
    /// A rule that reaches itself only as the last thing of its alternatives, through rules
    /// that may match nothing (a repeat of something optional, `("a"?)*`), is not: it adds
    /// nothing new, and the matcher cuts it exactly.
    bool left_recursive = false;
    uint32_t rule = 0;
    /// A bound on the rules an expansion passes through before a byte (compare max_expand_depth).
    uint32_t deepest = 0;
    /// The start rule matches no text at all (`root ::= root`).
    bool matches_nothing = false;
  };
  shape left_shape() const;

  /// The most parses a matcher may keep alive at once. Each is walked for every token's mask,
  /// so an ambiguous expression that keeps thousands ((.{0,64}){64}: every way of sharing the text
  /// among the groups, 4,096 here) made each token cost seconds of a rank's time. Patterns people
  /// write keep far fewer: (\w+,?\s?){0,50} 200, .?.?.? ... (64 of them) 577 (about 0.2 s a
  /// token over a 1,024-token vocabulary on one core); a forced call among 128 tools, one per tool.
  static constexpr size_t max_parses = 1024;
  /// A greedy probe of ambiguity: from the start, up to `steps` bytes, each the byte that keeps
  /// the most parses alive (on a tie, one that moves on: not blank space the grammar loops
  /// over); stops once past `limit`. What it read, and the most parses alive after any byte.
  struct ambiguity {
    size_t parses = 0;
    std::string read;
    uint64_t work = 0;  ///< parses the probe's steps produced (max_probe_work)
  };
  /// What the probe may spend: past it, a grammar is refused as too costly to follow. Each parse a
  /// step produces is work every token's walk repeats over the vocabulary: \w? written 200 times
  /// keeps only 191 parses but produces about 200 for each (0.3 s a token over 1,024 tokens, a
  /// re-trial, when (\w?){200} still compiled so: regex_grammar.cpp now repeats non-empty items).
  static constexpr uint64_t max_probe_work = 300'000;
  /// The same for one token's choice on a rank, per node of the vocabulary's trie (a walk visits
  /// each for every parse): past it the walk stops, the token is picked among those it found, and
  /// the rank stops the answer. Ordinary patterns and schemas make under 300 per node (a review,
  /// on a 150,000-token vocabulary: a JSON string 10, (\w+,?\s?){0,50} 100, an anyOf of 30
  /// objects 290); (\w?){100} made thousands (10 s a token).
  static constexpr uint64_t max_mask_work_per_trie_node = 1000;
  ambiguity probe_ambiguity(uint32_t steps, size_t limit) const;

  /// What the top frames of stacks allow of `vocab`'s tokens, whatever lies below them, as
  /// grammar_matcher::allowed has needed them: filled as answers reach new tops, shared by every
  /// matcher of this grammar and vocabulary, thread-safe. A copy of the grammar starts empty, and
  /// adding rules empties it.
  std::shared_ptr<top_masks> masks_for(const std::shared_ptr<const token_vocabulary>& vocab) const;
  /// How many tops masks_for(vocab) holds (tests: that answers went through it).
  size_t cached_tops(const std::shared_ptr<const token_vocabulary>& vocab) const;

private:
  std::vector<element> elements_;
  std::vector<byte_set> sets_;
  std::vector<std::vector<uint32_t>> alternatives_;
  uint32_t start_ = 0;
  /// Per vocabulary (few: one per model a process serves). Not copied with the grammar.
  struct mask_slot {
    mask_slot() = default;
    mask_slot(const mask_slot&) {}
    mask_slot& operator=(const mask_slot&) {
      clear();
      return *this;
    }
    void clear() {
      std::lock_guard lock{mutex};
      by_vocab.clear();
    }
    std::mutex mutex;
    std::vector<std::pair<std::shared_ptr<const token_vocabulary>, std::shared_ptr<top_masks>>> by_vocab;
  };
  mutable mask_slot masks_;
};

/// A vocabulary as the grammar sees it: each token's bytes, and which tokens are not text (special
/// tokens, never allowed under a grammar, save the end tokens). A byte trie of the text tokens lets
/// one walk find every token a state allows, sharing the work of common prefixes.
class token_vocabulary {
public:
  /// `text[id]`: the token's bytes; `special[id]`: not text. Ids with empty text are never text.
  token_vocabulary(std::vector<std::string> text, std::vector<bool> special);
  uint32_t size() const { return static_cast<uint32_t>(text_.size()); }
  const std::string& text(int32_t id) const { return text_[static_cast<size_t>(id)]; }
  bool is_text(int32_t id) const;

  /// The trie in depth-first order: node i's subtree is [i, skip), its byte the last of its prefix.
  struct trie_node {
    uint32_t skip;
    uint16_t depth;  ///< prefix length (>= 1)
    uint8_t byte;
    uint32_t first_token, end_token;  ///< tokens whose whole text is this prefix: ids_[first, end)
  };
  const std::vector<trie_node>& trie() const { return trie_; }
  const std::vector<int32_t>& trie_tokens() const { return trie_tokens_; }
  /// How many text tokens start with each byte.
  const std::array<uint32_t, 256>& first_bytes() const { return first_bytes_; }

private:
  std::vector<std::string> text_;
  std::vector<bool> special_;
  std::vector<trie_node> trie_;
  std::vector<int32_t> trie_tokens_;
  std::array<uint32_t, 256> first_bytes_{};
};

/// The built-in byte model's vocabulary: ids 0-255 are bytes, the rest (<bos>, <eos>) special.
std::shared_ptr<const token_vocabulary> byte_vocabulary(uint32_t vocab_size);

/// Two sequences of symbols, one after the other (the schema and range compilers build
/// alternatives this way: lit("[") + seq{...}).
inline std::vector<grammar::symbol> operator+(std::vector<grammar::symbol> a, const std::vector<grammar::symbol>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

/// Where one sequence's output stands in a grammar, and what it may produce next. Not
/// thread-safe: one thread at a time (the rank's, then the executor's while a step picks).
class grammar_matcher {
public:
  /// `end_tokens`: the tokens that end the output (the model's end-of-sequence ids), allowed
  /// once the grammar has matched a whole output.
  grammar_matcher(std::shared_ptr<const grammar> g, std::shared_ptr<const token_vocabulary> vocab,
                  std::vector<int32_t> end_tokens);
  grammar_matcher(const grammar_matcher& other);
  grammar_matcher& operator=(const grammar_matcher&) = delete;
  ~grammar_matcher();

  /// Whether `token` may come next.
  bool allows(int32_t token) const;
  /// Follows `token`; false (and nothing changes) when the grammar does not allow it.
  bool accept(int32_t token);
  /// Follows raw bytes (tests, and a prompt's own start of the output); false when not allowed.
  bool accept_bytes(std::string_view bytes);
  /// allowed[id] = 1 for each token allowed next (sized to the vocabulary); how many. Each
  /// stack's top frames answer from the grammar's cache (grammar::masks_for), walked once per
  /// grammar, vocabulary and top; only the tokens that read past them are walked per answer.
  size_t allowed(std::vector<uint8_t>* allowed) const;
  /// The same answer from a walk of the whole trie from every stack, no cache taken or kept:
  /// the reference allowed() must equal (tests, the bench).
  size_t allowed_by_whole_walk(std::vector<uint8_t>* allowed) const;
  /// Whether the output so far is a whole sentence of the grammar (an end token may come).
  bool complete() const;
  /// Whether an end token came: the output is over (only end tokens may follow, for a request
  /// that ignores them).
  bool ended() const { return ended_; }
  /// Tokens accepted so far.
  size_t consumed() const { return consumed_; }
  /// The parses alive now (grammar::max_parses bounds what a rank follows).
  size_t parses() const { return stacks_.size(); }
  /// Parses the last mask's walk produced, and whether it was cut short for passing
  /// grammar::max_mask_work_per_trie_node (0 and false for a mask kept from before).
  uint64_t last_walk_work() const { return last_walk_work_; }
  bool last_walk_over_budget() const { return last_walk_over_; }
  const std::vector<int32_t>& end_tokens() const { return end_tokens_; }

private:
  std::shared_ptr<const grammar> g_;
  std::shared_ptr<const token_vocabulary> vocab_;
  std::vector<int32_t> end_tokens_;
  /// The live stacks, each the positions in grammar::elements() still to match, innermost last
  /// (the top is always a byte set); an empty stack: the whole output matched.
  std::vector<std::vector<uint32_t>> stacks_;
  size_t consumed_ = 0;
  bool ended_ = false;
  std::unique_ptr<grammar_arena> arena_;  ///< scratch for walks, kept between calls
  /// The last walk's answer and the stacks it was for: inside a string (or any run of one
  /// right-recursive rule) the stacks come back the same after each token, and the walk with
  /// them, so a long string costs one walk, not one per token.
  mutable std::vector<std::vector<uint32_t>> walked_stacks_;
  mutable std::vector<uint8_t> walked_mask_;
  mutable size_t walked_count_ = 0;
  mutable bool walked_ = false;
  std::shared_ptr<top_masks> masks_;  ///< the grammar's, for this vocabulary
  mutable uint64_t last_walk_work_ = 0;
  mutable bool last_walk_over_ = false;

  size_t allowed_by(std::vector<uint8_t>* allowed, bool cached) const;
  /// The whole trie walked from every stack at once (the reference; tops the cache cannot take);
  /// how many tokens it set that were not set before.
  size_t walk_all(std::vector<uint8_t>* mask) const;
  /// Per stack: the cached answer of its top frames, and a walk of only the tokens that read
  /// past them; how many tokens it set. nullopt (the caller walks whole, after clearing the
  /// mask) when there are too many stacks, a top is new (added to `first_tops`) or not worth
  /// keeping, the cache is full, or a walk hit the matcher's limits.
  std::optional<size_t> walk_cached(std::vector<uint8_t>* mask, std::vector<std::vector<uint32_t>>* first_tops) const;
  /// Whether the stacks' tops may take enough of the vocabulary for the cache to pay.
  bool worth_caching() const;
};

/// Why a rank stops following `m` (more than grammar::max_parses alive: each token's mask would
/// walk them all); empty while it may go on. The gateway's probe refuses most such grammars
/// before they run; this bounds the rest.
std::string too_ambiguous(const grammar_matcher& m);

}  // namespace baton::gpu
