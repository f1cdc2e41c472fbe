#include "gpu/grammar.hpp"

#include <algorithm>
#include <bit>
#include <climits>
#include <cstring>
#include <atomic>
#include <map>
#include <optional>

namespace baton::gpu {

// --- grammar -------------------------------------------------------------------------------------

uint32_t grammar::add_rule() {
  // A grammar being built is not shared yet: no lock needed to see whether masks were kept.
  if (!masks_.by_vocab.empty()) masks_.clear();
  alternatives_.emplace_back();
  return static_cast<uint32_t>(alternatives_.size() - 1);
}

void grammar::add_alternative(uint32_t rule, const std::vector<symbol>& symbols) {
  if (!masks_.by_vocab.empty()) masks_.clear();
  alternatives_[rule].push_back(static_cast<uint32_t>(elements_.size()));
  for (const auto& s : symbols) {
    if (s.is_rule) {
      elements_.push_back({kind::rule, s.rule});
      continue;
    }
    // Sets repeat (every string's body is the same set): one copy each.
    auto it = std::find(sets_.begin(), sets_.end(), s.set);
    if (it == sets_.end()) it = sets_.insert(sets_.end(), s.set);
    elements_.push_back({kind::bytes, static_cast<uint32_t>(it - sets_.begin())});
  }
  elements_.push_back({kind::end, 0});
}

uint32_t grammar::add_repeat(uint32_t item, uint32_t min, uint32_t max) {
  uint32_t tail = add_rule();
  add_alternative(tail, {});
  if (max == unbounded) {
    add_alternative(tail, {ref(item), ref(tail)});
  } else {
    for (uint32_t k = min; k < max; ++k) {
      const uint32_t more = add_rule();
      add_alternative(more, {});
      add_alternative(more, {ref(item), ref(tail)});
      tail = more;
    }
  }
  std::vector<symbol> parts(min, ref(item));
  parts.push_back(ref(tail));
  const uint32_t whole = add_rule();
  add_alternative(whole, parts);
  return whole;
}

void grammar::add_utf8_multibyte(uint32_t rule) {
  const symbol tail = range(0x80, 0xBF);
  add_alternative(rule, {range(0xC2, 0xDF), tail});
  add_alternative(rule, {byte(0xE0), range(0xA0, 0xBF), tail});
  add_alternative(rule, {range(0xE1, 0xEC), tail, tail});
  add_alternative(rule, {byte(0xED), range(0x80, 0x9F), tail});
  add_alternative(rule, {range(0xEE, 0xEF), tail, tail});
  add_alternative(rule, {byte(0xF0), range(0x90, 0xBF), tail, tail});
  add_alternative(rule, {range(0xF1, 0xF3), tail, tail, tail});
  add_alternative(rule, {byte(0xF4), range(0x80, 0x8F), tail, tail});
}

grammar::symbol grammar::byte(uint8_t b) { return range(b, b); }

grammar::symbol grammar::range(uint8_t lo, uint8_t hi) {
  symbol s;
  for (unsigned b = lo; b <= hi; ++b) s.set[b >> 6] |= uint64_t{1} << (b & 63);
  return s;
}

grammar::symbol grammar::except(std::string_view bytes) {
  symbol s = range(0, 255);
  for (char c : bytes) {
    const auto b = static_cast<uint8_t>(c);
    s.set[b >> 6] &= ~(uint64_t{1} << (b & 63));
  }
  return s;
}

std::vector<grammar::symbol> grammar::literal(std::string_view text) {
  std::vector<symbol> out;
  for (char c : text) out.push_back(byte(static_cast<uint8_t>(c)));
  return out;
}

namespace {

/// A rule holds when one of its alternatives does, and an alternative holds when each of its rule
/// elements does and (unless `bytes_hold`) it has no byte set. With bytes_hold false: the rules
/// that match the empty string; true: the rules that match any text at all. A worklist, linear in
/// the grammar's size.
std::vector<bool> rules_that_hold(const grammar& g, bool bytes_hold) {
  const uint32_t n = g.rules();
  const auto& el = g.elements();
  std::vector<bool> holds(n, false);
  std::vector<uint32_t> missing, owner;          // per alternative: rule elements not yet holding; its rule
  std::vector<std::vector<uint32_t>> used_in(n);  // per rule: alternatives naming it (once per use)
  std::vector<uint32_t> ready;
  for (uint32_t r = 0; r < n; ++r)
    for (uint32_t start : g.alternatives(r)) {
      uint32_t rule_elements = 0;
      bool has_bytes = false;
      for (size_t p = start; el[p].k != grammar::kind::end; ++p) {
        if (el[p].k == grammar::kind::rule) ++rule_elements;
        else has_bytes = true;
      }
      if (has_bytes && !bytes_hold) continue;
      const auto a = static_cast<uint32_t>(owner.size());
      owner.push_back(r);
      missing.push_back(rule_elements);
      for (size_t p = start; el[p].k != grammar::kind::end; ++p)
        if (el[p].k == grammar::kind::rule) used_in[el[p].value].push_back(a);
      if (rule_elements == 0 && !holds[r]) {
        holds[r] = true;
        ready.push_back(r);
      }
    }
  while (!ready.empty()) {
    const uint32_t s = ready.back();
    ready.pop_back();
    for (uint32_t a : used_in[s])
      if (--missing[a] == 0 && !holds[owner[a]]) {
        holds[owner[a]] = true;
        ready.push_back(owner[a]);
      }
  }
  return holds;
}

}  // namespace

grammar::shape grammar::left_shape() const {
  const uint32_t n = rules();
  shape out;
  out.matches_nothing = !rules_that_hold(*this, true)[start_];
  const auto nullable = rules_that_hold(*this, false);
  // The left graph: r -> s when s may come first in an alternative of r (after nullable rules).
  // The edge grows the stack when something follows s there (the matcher keeps a frame for it).
  struct edge {
    uint32_t to;
    bool grows;
  };
  std::vector<std::vector<edge>> left(n);
  for (uint32_t r = 0; r < n; ++r)
    for (uint32_t start : alternatives_[r])
      for (size_t p = start; elements_[p].k == kind::rule; ++p) {
        left[r].push_back({elements_[p].value, elements_[p + 1].k != kind::end});
        if (!nullable[elements_[p].value]) break;
      }
  // Strongly connected components (Tarjan's, without recursion: grammars run to 50,000 rules);
  // left recursion is a growing edge inside one. Components come out sinks first.
  constexpr uint32_t unseen = UINT32_MAX;
  std::vector<uint32_t> index(n, unseen), low(n, 0), component(n, unseen), sizes;
  std::vector<bool> on_stack(n, false);
  std::vector<uint32_t> stack;
  std::vector<std::pair<uint32_t, size_t>> calls;  // (rule, next edge)
  uint32_t next_index = 0;
  for (uint32_t root = 0; root < n; ++root) {
    if (index[root] != unseen) continue;
    calls.push_back({root, 0});
    index[root] = low[root] = next_index++;
    stack.push_back(root);
    on_stack[root] = true;
    while (!calls.empty()) {
      auto& [v, e] = calls.back();
      if (e < left[v].size()) {
        const uint32_t w = left[v][e++].to;
        if (index[w] == unseen) {
          index[w] = low[w] = next_index++;
          stack.push_back(w);
          on_stack[w] = true;
          calls.push_back({w, 0});  // v and e are not used again before this call returns
        } else if (on_stack[w]) {
          low[v] = std::min(low[v], index[w]);
        }
        continue;
      }
      const uint32_t done = v;
      calls.pop_back();
      if (!calls.empty()) low[calls.back().first] = std::min(low[calls.back().first], low[done]);
      if (low[done] == index[done]) {
        uint32_t w;
        sizes.push_back(0);
        do {
          w = stack.back();
          stack.pop_back();
          on_stack[w] = false;
          component[w] = static_cast<uint32_t>(sizes.size() - 1);
          ++sizes.back();
        } while (w != done);
      }
    }
  }
  // The deepest expansion: the heaviest path of components (each counted by its size, a bound
  // on the rules an expansion passes inside it), sinks first so each edge's far end is known.
  std::vector<std::vector<uint32_t>> members(sizes.size());
  for (uint32_t r = 0; r < n; ++r) members[component[r]].push_back(r);
  std::vector<uint32_t> depth(sizes.size(), 0);
  for (uint32_t c = 0; c < sizes.size(); ++c) {
    uint32_t below = 0;
    for (uint32_t r : members[c])
      for (const auto& e : left[r]) {
        if (component[e.to] != c) below = std::max(below, depth[component[e.to]]);
        else if (e.grows && !out.left_recursive) {
          out.left_recursive = true;
          out.rule = r;
        }
      }
    depth[c] = sizes[c] + below;
    out.deepest = std::max(out.deepest, depth[c]);
  }
  return out;
}

// --- grammar_matcher -----------------------------------------------------------------------------

/// Stacks as shared, interned linked lists: a stack is the id of its top node, a node is (position,
/// the stack below it), and equal stacks get equal ids. So following a byte copies no stack, and a
/// set of stacks is a sorted list of ids. Id 0 is the empty stack (the output matched).
struct grammar_arena {
  struct node {
    uint32_t pos, below;
  };
  std::vector<node> nodes;
  std::unordered_map<uint64_t, uint32_t> ids;
  /// What a node whose top is a rule expands to (the byte-set tops and 0), computed once.
  std::unordered_map<uint32_t, std::vector<uint32_t>> expanded;
  std::vector<uint32_t> in_progress;  ///< the nodes being expanded, outermost first
  std::vector<uint32_t> work;
  /// A walk of a stack's top frames alone (top_masks): the node standing for whatever lies below
  /// them. Expanding it gives itself, and no byte moves it on. none: no such node.
  static constexpr uint32_t none = UINT32_MAX;
  uint32_t boundary = none;
  /// A walk hit the matcher's limits (an expansion cut at max_expand_depth, parses dropped past
  /// max_live_stacks): its answer is narrowed, and depends on what was expanded before it, so
  /// the cache neither keeps nor trusts it.
  bool limited = false;
  /// Parses produced by advances (before duplicates go), since the owner last zeroed it: what a
  /// walk cost, whatever the grammar's shape (reset() keeps it).
  uint64_t produced = 0;
  /// A walk of the vocabulary stops once `produced` passes this (0: no bound), and says so.
  uint64_t budget = 0;
  bool over_budget = false;

  void reset() {
    nodes.assign(1, {0, 0});
    ids.clear();
    expanded.clear();
    in_progress.clear();
    boundary = none;
    limited = false;
  }
  uint32_t intern(uint32_t pos, uint32_t below) {
    const uint64_t key = uint64_t{pos} << 32 | below;
    auto [it, fresh] = ids.try_emplace(key, static_cast<uint32_t>(nodes.size()));
    if (fresh) nodes.push_back({pos, below});
    return it->second;
  }
};

namespace {

/// Right recursion never deepens a stack (a rule's last symbol leaves nothing behind), so only a
/// runaway chain of rules that each start with the next nests this deep: it is cut off there
/// rather than loop (the compilers refuse schemas and patterns nested anywhere near it).
constexpr int max_expand_depth = static_cast<int>(grammar::max_expand_depth);
/// More parses alive at once than any JSON grammar keeps (an ambiguous one could multiply them):
/// past it the rest are dropped, which only narrows what may follow, never widens it.
constexpr size_t max_live_stacks = 4096;
constexpr int no_cycle = INT32_MAX;

/// The stacks a stack becomes once every rule on its top is expanded: tops that are byte sets, and
/// 0 when the stack empties (the output may end here).
///
/// A rule may reach itself again without reading a byte (a pattern's (a?)*: the repeat's tail,
/// an empty item, the tail again). The second visit adds nothing the first does not, so it is
/// cut; but a node between the two has then seen only part of what it reaches, and is not
/// remembered (the node the cycle returns to is complete, and is). Returns the depth of the
/// shallowest node still being expanded that this expansion reached (no_cycle: none).
int expand(const grammar& g, grammar_arena& a, uint32_t id, std::vector<uint32_t>& out, int depth = 0) {
  if (id == 0 || id == a.boundary) {  // the end of the output; or, walking top frames alone, what is below them
    out.push_back(id);
    return no_cycle;
  }
  const auto [pos, below] = a.nodes[id];
  const auto& e = g.elements()[pos];
  if (e.k == grammar::kind::bytes) {
    out.push_back(id);
    return no_cycle;
  }
  if (depth > max_expand_depth) {  // cut: nothing above it is remembered either
    a.limited = true;
    return -1;
  }
  if (auto it = a.expanded.find(id); it != a.expanded.end()) {
    out.insert(out.end(), it->second.begin(), it->second.end());
    return no_cycle;
  }
  // Being expanded further up this walk: its depth there (a short path, searched in place).
  for (size_t k = 0; k < a.in_progress.size(); ++k)
    if (a.in_progress[k] == id) return static_cast<int>(k);
  a.in_progress.push_back(id);
  std::vector<uint32_t> mine;
  int low = no_cycle;
  // What follows the rule in its alternative; nothing when the rule ends it (no frame is kept for
  // a finished alternative, so right recursion runs in constant depth).
  const uint32_t after = g.elements()[pos + 1].k == grammar::kind::end ? below : a.intern(pos + 1, below);
  for (uint32_t start : g.alternatives(e.value))
    low = std::min(low, expand(g, a, g.elements()[start].k == grammar::kind::end ? after : a.intern(start, after),
                               mine, depth + 1));
  a.in_progress.pop_back();
  std::sort(mine.begin(), mine.end());
  mine.erase(std::unique(mine.begin(), mine.end()), mine.end());
  out.insert(out.end(), mine.begin(), mine.end());
  if (low < depth) return low;  // part of a cycle through a node further up: not complete yet
  a.expanded.emplace(id, std::move(mine));
  return no_cycle;
}

/// The stacks after byte `b`: each top whose set holds it moves on (and expands).
void advance(const grammar& g, grammar_arena& a, const std::vector<uint32_t>& tops, uint8_t b,
             std::vector<uint32_t>& out) {
  out.clear();
  for (uint32_t id : tops) {
    if (id == 0 || id == a.boundary) continue;
    const auto [pos, below] = a.nodes[id];
    if (!grammar::has(g.sets()[g.elements()[pos].value], b)) continue;
    expand(g, a, g.elements()[pos + 1].k == grammar::kind::end ? below : a.intern(pos + 1, below), out);
  }
  a.produced += out.size();
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  if (out.size() > max_live_stacks) {
    out.resize(max_live_stacks);
    a.limited = true;
  }
}

}  // namespace

// --- top_masks -----------------------------------------------------------------------------------

/// What a stack's top frames allow, whatever lies below them. Inside a JSON string almost every
/// token fits and a walk of the whole trie costs milliseconds; but only the few tokens that read
/// past the string's closing quote depend on what comes after it. So each new top is walked once,
/// with a stand-in for the frames below, and kept: the tokens it allows on its own (`accepted`),
/// and the trie paths to the tokens that read past it, which each answer then walks from its own
/// stack. xgrammar's adaptive token mask cache keys positions the same way.
struct top_entry {
  /// The tokens the top frames allow alone: a bit per token id, or (when they are few, as under
  /// a UTF-8 lead byte's top) their ids, which cost less to keep and to merge.
  std::vector<uint64_t> accepted;
  std::vector<int32_t> accepted_ids;
  /// Trie nodes, in trie order, leading to tokens that read past the frames (each node's
  /// ancestors are here too, so a walk of only these nodes sees every parent before its child).
  std::vector<uint32_t> reaching;
  /// So many tokens read past the frames that one more frame is worth a key of its own (a
  /// character's rule under a string's: the character ends after a byte).
  bool deeper = false;
  /// The walk hit the matcher's limits (grammar_arena::limited): answer such tops whole.
  bool limited = false;
  /// What the entry holds, in 64-bit words, with its key's (for the budgets).
  size_t words = 0;
};

/// The words of every top_masks alive in the process (grammars are kept by the process-wide
/// cache of cached_output_grammar, 64 of them, each with its tops).
static std::atomic<size_t> all_top_words{0};

struct top_masks {
  std::shared_ptr<const token_vocabulary> vocab;
  std::mutex mutex;
  /// Key: the frames, top first; one more element, whole_stack, when they are the whole stack.
  std::map<std::vector<uint32_t>, std::shared_ptr<const top_entry>> entries;
  /// Tops (one-frame keys) seen before, and whether the whole walk there allowed enough of the
  /// vocabulary for the cache to pay. A top is walked on its own only when it comes back to a
  /// state that allowed many tokens: an answer that passes a state once (a schema seen once), or
  /// a state where few tokens fit (the whole walk prunes at once), pays what it did without it.
  std::map<std::vector<uint32_t>, bool> verdict;
  size_t words = 0;  ///< the entries' size in 64-bit words, over all of them
  static constexpr uint32_t whole_stack = UINT32_MAX;
  /// Memory bounds: per grammar and vocabulary, and over the process. Past either, new tops are
  /// walked whole each time.
  static constexpr size_t max_words = size_t{1} << 19;          // 4 MiB: about 220 tops of a 151K vocabulary
  static constexpr size_t max_process_words = size_t{1} << 23;  // 64 MiB
  static constexpr size_t max_frames = 8;

  ~top_masks() { all_top_words -= words; }
  /// Whether `more` words fit both budgets.
  bool fits(size_t more) const { return words + more <= max_words && all_top_words + more <= max_process_words; }
};

std::shared_ptr<top_masks> grammar::masks_for(const std::shared_ptr<const token_vocabulary>& vocab) const {
  std::lock_guard lock{masks_.mutex};
  for (const auto& [v, m] : masks_.by_vocab)
    if (v == vocab) return m;
  auto m = std::make_shared<top_masks>();
  m->vocab = vocab;
  masks_.by_vocab.emplace_back(vocab, m);
  return m;
}

size_t grammar::cached_tops(const std::shared_ptr<const token_vocabulary>& vocab) const {
  auto m = masks_for(vocab);
  std::lock_guard lock{m->mutex};
  return m->entries.size();
}

namespace {

/// The entry for `key`: the trie walked from its frames alone, the node below them the arena's
/// boundary (or the empty stack, for a whole stack).
std::shared_ptr<top_entry> walk_top(const grammar& g, const token_vocabulary& v, const std::vector<uint32_t>& key) {
  const bool whole = key.back() == top_masks::whole_stack;
  const size_t frames = key.size() - (whole ? 1 : 0);
  grammar_arena a;
  a.reset();
  uint32_t id = 0;
  if (!whole) id = a.boundary = a.intern(grammar_arena::none, 0);
  for (size_t k = frames; k-- > 0;) id = a.intern(key[k], id);
  auto e = std::make_shared<top_entry>();
  e->accepted.assign((v.size() + 63) / 64, 0);
  const auto& trie = v.trie();
  const auto& tokens = v.trie_tokens();
  std::vector<std::vector<uint32_t>> level(1, std::vector<uint32_t>{id});
  std::vector<uint8_t> past(1, 0);  // per depth: some parse read past the frames on the way here
  std::vector<uint32_t> path;       // the trie nodes of the prefix, by depth - 1
  std::vector<uint8_t> mark(trie.size(), 0);
  size_t reaching_tokens = 0;
  for (size_t i = 0; i < trie.size();) {
    const auto& node = trie[i];
    const size_t d = node.depth;
    if (level.size() <= d) level.resize(d + 1), past.resize(d + 1);
    path.resize(d);
    path[d - 1] = static_cast<uint32_t>(i);
    auto& here = level[d];
    advance(g, a, level[d - 1], node.byte, here);
    bool at_boundary = false;
    if (auto b = std::find(here.begin(), here.end(), a.boundary); b != here.end()) {
      here.erase(b);
      at_boundary = true;
    }
    past[d] = past[d - 1] || at_boundary;
    if (here.empty()) {
      // Dead here on the frames alone; if a parse read past them on the way, what lies below
      // decides every token from here on.
      if (past[d]) {
        for (size_t j = i; j < node.skip; ++j) {
          mark[j] = 1;
          reaching_tokens += trie[j].end_token - trie[j].first_token;
        }
        for (size_t up = 0; up + 1 < d; ++up) mark[path[up]] = 1;
      }
      i = node.skip;
      continue;
    }
    for (uint32_t k = node.first_token; k < node.end_token; ++k)
      e->accepted[static_cast<uint32_t>(tokens[k]) >> 6] |= uint64_t{1} << (tokens[k] & 63);
    ++i;
  }
  const size_t key_words = (key.size() + 1) / 2 + 8;  // the key, and the map's node about it
  if (a.limited) {
    *e = top_entry{};
    e->limited = true;
    e->words = key_words;
    return e;
  }
  for (size_t j = 0; j < trie.size(); ++j)
    if (mark[j]) e->reaching.push_back(static_cast<uint32_t>(j));
  e->deeper = !whole && frames < top_masks::max_frames && reaching_tokens > v.size() / 16;
  if (e->deeper) {
    *e = top_entry{};  // only the answer to look one frame further is kept
    e->deeper = true;
    e->words = key_words;
    return e;
  }
  size_t count = 0;
  for (uint64_t w : e->accepted) count += static_cast<size_t>(std::popcount(w));
  if (count * 2 < e->accepted.size()) {  // ids take less room than the bits
    for (size_t w = 0; w < e->accepted.size(); ++w)
      for (uint64_t x = e->accepted[w]; x; x &= x - 1)
        e->accepted_ids.push_back(static_cast<int32_t>(w * 64 + static_cast<size_t>(std::countr_zero(x))));
    e->accepted.clear();
    e->accepted.shrink_to_fit();
  }
  e->words = key_words + e->accepted.size() + (e->accepted_ids.size() + e->reaching.size() + 1) / 2;
  return e;
}

/// Sets mask[t] (to 1) and counts it if it was not set yet.
inline size_t set_token(std::vector<uint8_t>& mask, size_t t) {
  const size_t fresh = mask[t] ^ 1;
  mask[t] = 1;
  return fresh;
}

/// mask[t] = 1 for every bit of `bits` (a bit per token id), leaving the rest as they are; how
/// many were not set before.
size_t or_bits(const std::vector<uint64_t>& bits, std::vector<uint8_t>& mask) {
  const size_t n = mask.size();
  size_t added = 0;
  for (size_t w = 0; w < bits.size(); ++w) {
    uint64_t x = bits[w];
    if (x == 0) continue;
    const size_t base = w * 64;
    if (x == ~uint64_t{0} && base + 64 <= n) {  // a run of 64: count what was set, then set all
      size_t was = 0;
      for (size_t k = 0; k < 64; k += 8) {
        uint64_t b;
        std::memcpy(&b, mask.data() + base + k, 8);
        was += (b * 0x0101010101010101ull) >> 56;  // the sum of eight bytes of 0 or 1
      }
      std::memset(mask.data() + base, 1, 64);
      added += 64 - was;
      continue;
    }
    for (; x; x &= x - 1) {
      const size_t t = base + static_cast<size_t>(std::countr_zero(x));
      if (t < n) added += set_token(mask, t);
    }
  }
  return added;
}

/// The trie walked from `tops` (interned in `a`), in trie order: a node's parses are its parent's
/// after its byte, and a node no parse survives is skipped with its whole subtree (every token
/// that starts with its prefix). All nodes, or only those in `only` (sorted, each node's
/// ancestors in it too). Each surviving node's tokens are set in `mask`; how many were not set.
size_t walk_trie(const grammar& g, grammar_arena& a, std::vector<uint32_t> tops, const token_vocabulary& v,
                 const std::vector<uint32_t>* only, std::vector<uint8_t>& mask) {
  const auto& trie = v.trie();
  const auto& tokens = v.trie_tokens();
  std::vector<std::vector<uint32_t>> level(1, std::move(tops));
  size_t added = 0, next = 0;  // next: the position in `only`
  for (uint32_t i = 0;;) {
    if (only) {
      while (next < only->size() && (*only)[next] < i) ++next;
      if (next == only->size()) break;
      i = (*only)[next];
    } else if (i >= trie.size()) {
      break;
    }
    const auto& node = trie[i];
    if (level.size() <= node.depth) level.resize(node.depth + 1);
    advance(g, a, level[node.depth - 1], node.byte, level[node.depth]);
    if (a.budget && a.produced > a.budget) {  // the rest unwalked: only tokens found allowed are set
      a.over_budget = true;
      break;
    }
    if (level[node.depth].empty()) {
      i = node.skip;
      continue;
    }
    for (uint32_t k = node.first_token; k < node.end_token; ++k) added += set_token(mask, tokens[k]);
    ++i;
  }
  return added;
}

}  // namespace

grammar_matcher::grammar_matcher(std::shared_ptr<const grammar> g, std::shared_ptr<const token_vocabulary> vocab,
                                 std::vector<int32_t> end_tokens)
    : g_(std::move(g)),
      vocab_(std::move(vocab)),
      end_tokens_(std::move(end_tokens)),
      arena_(std::make_unique<grammar_arena>()),
      masks_(g_->masks_for(vocab_)) {
  arena_->reset();
  std::vector<uint32_t> tops;
  for (uint32_t start : g_->alternatives(g_->start()))
    expand(*g_, *arena_, g_->elements()[start].k == grammar::kind::end ? 0 : arena_->intern(start, 0),
                         tops);
  std::sort(tops.begin(), tops.end());
  tops.erase(std::unique(tops.begin(), tops.end()), tops.end());
  for (uint32_t id : tops) {
    std::vector<uint32_t> stack;
    for (; id != 0; id = arena_->nodes[id].below) stack.push_back(arena_->nodes[id].pos);
    std::reverse(stack.begin(), stack.end());
    stacks_.push_back(std::move(stack));
  }
}

grammar_matcher::grammar_matcher(const grammar_matcher& o)
    : g_(o.g_), vocab_(o.vocab_), end_tokens_(o.end_tokens_), stacks_(o.stacks_), consumed_(o.consumed_),
      ended_(o.ended_), arena_(std::make_unique<grammar_arena>()), masks_(o.masks_) {}

grammar_matcher::~grammar_matcher() = default;

namespace {

/// The matcher's stacks as arena ids (a fresh arena: ids from earlier walks are gone).
std::vector<uint32_t> load(grammar_arena& a, const std::vector<std::vector<uint32_t>>& stacks) {
  a.reset();
  std::vector<uint32_t> tops;
  for (const auto& s : stacks) {
    uint32_t id = 0;
    for (uint32_t pos : s) id = a.intern(pos, id);
    tops.push_back(id);
  }
  std::sort(tops.begin(), tops.end());
  tops.erase(std::unique(tops.begin(), tops.end()), tops.end());
  return tops;
}

bool follows(const grammar& g, grammar_arena& a, std::vector<uint32_t>& tops, std::string_view bytes) {
  std::vector<uint32_t> next;
  for (char c : bytes) {
    advance(g, a, tops, static_cast<uint8_t>(c), next);
    if (next.empty()) return false;
    tops.swap(next);
  }
  return true;
}

}  // namespace

grammar::ambiguity grammar::probe_ambiguity(uint32_t steps, size_t limit) const {
  grammar_arena a;
  a.reset();
  std::vector<uint32_t> tops;
  for (uint32_t start : alternatives(start_))
    expand(*this, a, elements()[start].k == kind::end ? 0 : a.intern(start, 0), tops);
  std::sort(tops.begin(), tops.end());
  tops.erase(std::unique(tops.begin(), tops.end()), tops.end());
  ambiguity out{tops.size(), {}};
  std::vector<uint32_t> next, best;
  // Bytes every top takes or refuses alike lead to the same parses: one of each such class is
  // tried (a handful, where 256 made .?.?.? ... cost a second to compile).
  std::vector<uint32_t> set_ids;
  std::vector<int> candidates;
  for (uint32_t step = 0; step < steps && out.parses <= limit && a.produced <= max_probe_work; ++step) {
    set_ids.clear();
    for (uint32_t id : tops)
      if (id != 0) set_ids.push_back(elements()[a.nodes[id].pos].value);
    std::sort(set_ids.begin(), set_ids.end());
    set_ids.erase(std::unique(set_ids.begin(), set_ids.end()), set_ids.end());
    candidates.clear();
    if (set_ids.size() <= 64) {
      std::vector<uint64_t> seen;
      for (int b = 0; b < 256; ++b) {
        uint64_t signature = 0;
        for (size_t k = 0; k < set_ids.size(); ++k)
          if (has(sets()[set_ids[k]], static_cast<uint8_t>(b))) signature |= uint64_t{1} << k;
        if (signature == 0 || std::find(seen.begin(), seen.end(), signature) != seen.end()) continue;
        seen.push_back(signature);
        candidates.push_back(b);
      }
    } else {
      for (int b = 0; b < 256; ++b) candidates.push_back(b);
    }
    int best_byte = -1;
    bool best_moves = false;
    for (int b : candidates) {
      advance(*this, a, tops, static_cast<uint8_t>(b), next);
      if (next.empty() || (next.size() == 1 && next[0] == 0)) continue;  // nothing, or only the end
      const bool moves = next != tops;
      if (best_byte < 0 || next.size() > best.size() || (next.size() == best.size() && moves && !best_moves)) {
        best.swap(next);
        best_byte = b;
        best_moves = moves;
      }
    }
    if (best_byte < 0) break;
    tops.swap(best);
    out.read.push_back(static_cast<char>(best_byte));
    out.parses = std::max(out.parses, tops.size());
  }
  out.work = a.produced;
  return out;
}

bool grammar_matcher::complete() const {
  return !ended_ && std::any_of(stacks_.begin(), stacks_.end(), [](const auto& s) { return s.empty(); });
}

bool grammar_matcher::allows(int32_t token) const {
  if (std::find(end_tokens_.begin(), end_tokens_.end(), token) != end_tokens_.end()) return ended_ || complete();
  if (ended_) return false;
  if (!vocab_->is_text(token)) return false;
  auto tops = load(*arena_, stacks_);
  return follows(*g_, *arena_, tops, vocab_->text(token));
}

bool grammar_matcher::accept(int32_t token) {
  if (std::find(end_tokens_.begin(), end_tokens_.end(), token) != end_tokens_.end()) {
    if (!ended_ && !complete()) return false;
    ended_ = true;
    ++consumed_;
    return true;
  }
  if (ended_ || !vocab_->is_text(token) || !accept_bytes(vocab_->text(token))) return false;
  ++consumed_;
  return true;
}

bool grammar_matcher::accept_bytes(std::string_view bytes) {
  if (ended_) return false;
  auto tops = load(*arena_, stacks_);
  if (!follows(*g_, *arena_, tops, bytes)) return false;
  stacks_.clear();
  for (uint32_t id : tops) {
    std::vector<uint32_t> stack;
    for (; id != 0; id = arena_->nodes[id].below) stack.push_back(arena_->nodes[id].pos);
    std::reverse(stack.begin(), stack.end());
    stacks_.push_back(std::move(stack));
  }
  return true;
}

size_t grammar_matcher::allowed(std::vector<uint8_t>* mask) const { return allowed_by(mask, true); }

size_t grammar_matcher::allowed_by_whole_walk(std::vector<uint8_t>* mask) const { return allowed_by(mask, false); }

size_t grammar_matcher::allowed_by(std::vector<uint8_t>* mask, bool cached) const {
  last_walk_work_ = 0;  // a mask kept or trivial costs no walk
  last_walk_over_ = false;
  if (ended_) {  // only more end tokens (a request that ignores them goes on to max_tokens)
    mask->assign(vocab_->size(), 0);
    size_t n = 0;
    for (int32_t t : end_tokens_)
      if (t >= 0 && static_cast<size_t>(t) < mask->size() && !(*mask)[t]) {
        (*mask)[t] = 1;
        ++n;
      }
    return n;
  }
  if (cached && walked_ && walked_stacks_ == stacks_) {
    *mask = walked_mask_;
    return walked_count_;
  }
  mask->assign(vocab_->size(), 0);
  size_t n = 0;
  arena_->produced = 0;
  arena_->over_budget = false;
  arena_->budget = grammar::max_mask_work_per_trie_node * std::max<uint64_t>(1, vocab_->trie().size());
  std::optional<size_t> by_tops;
  std::vector<std::vector<uint32_t>> first_tops;  // seen for the first time: the whole walk's count is their verdict
  if (cached && worth_caching()) {
    by_tops = walk_cached(mask, &first_tops);
    if (!by_tops) std::fill(mask->begin(), mask->end(), 0);  // what it set before it gave up
  }
  n = by_tops ? *by_tops : walk_all(mask);
  if (!first_tops.empty()) {
    std::lock_guard lock{masks_->mutex};
    for (auto& top : first_tops) masks_->verdict.emplace(std::move(top), n * 16 > vocab_->size());
  }
  if (complete())
    for (int32_t t : end_tokens_)
      if (t >= 0 && static_cast<size_t>(t) < mask->size()) n += set_token(*mask, static_cast<size_t>(t));
  last_walk_work_ = arena_->produced;
  last_walk_over_ = arena_->over_budget;
  arena_->budget = 0;  // accept() and allows() walk no vocabulary
  if (cached) {
    walked_stacks_ = stacks_;
    walked_mask_ = *mask;
    walked_count_ = n;
    walked_ = true;
  }
  return n;
}

size_t grammar_matcher::walk_all(std::vector<uint8_t>* mask) const {
  return walk_trie(*g_, *arena_, load(*arena_, stacks_), *vocab_, nullptr, *mask);
}

bool grammar_matcher::worth_caching() const {
  // The tokens whose first byte some stack's top takes: a bound on those allowed. Where it is
  // small the whole walk prunes at the first byte and costs microseconds, less than walking a new
  // top on its own (which a stand-in below the frames keeps wider); where most of the vocabulary
  // may fit (a string), the cache saves nearly the whole walk.
  grammar::byte_set firsts{};
  for (const auto& stack : stacks_) {
    if (stack.empty()) continue;
    const auto& set = g_->sets()[g_->elements()[stack.back()].value];
    for (size_t w = 0; w < firsts.size(); ++w) firsts[w] |= set[w];
  }
  size_t could = 0;
  for (int b = 0; b < 256; ++b)
    if (grammar::has(firsts, static_cast<uint8_t>(b))) could += vocab_->first_bytes()[b];
  return could * 16 > vocab_->size();
}

std::optional<size_t> grammar_matcher::walk_cached(std::vector<uint8_t>* mask,
                                                   std::vector<std::vector<uint32_t>>* first_tops) const {
  // Many live parses (an ambiguous grammar) share one whole walk better than they walk apart.
  constexpr size_t max_stacks = 64;
  if (stacks_.size() > max_stacks) return std::nullopt;
  // A top is walked on its own only when it comes back to a state that allowed many tokens
  // (top_masks::verdict); till then the whole walk answers, and tells the verdict.
  {
    bool whole = false;
    std::lock_guard lock{masks_->mutex};
    for (const auto& stack : stacks_) {
      if (stack.empty()) continue;
      std::vector<uint32_t> top{stack.back()};
      if (stack.size() == 1) top.push_back(top_masks::whole_stack);
      if (masks_->entries.count(top)) continue;
      auto it = masks_->verdict.find(top);
      if (it == masks_->verdict.end()) first_tops->push_back(std::move(top));
      whole = whole || it == masks_->verdict.end() || !it->second;
    }
    if (whole) return std::nullopt;
  }
  // At most a bit per token and some paths: what a new entry may take.
  const size_t entry_words = (vocab_->size() + 63) / 64 * 2;
  std::vector<std::shared_ptr<const top_entry>> found(stacks_.size());
  for (size_t s = 0; s < stacks_.size(); ++s) {
    const auto& stack = stacks_[s];
    if (stack.empty()) continue;  // the output may end here: the end tokens, set by the caller
    std::vector<uint32_t> key;
    for (size_t k = 1;; ++k) {
      key.assign(stack.rbegin(), stack.rbegin() + static_cast<std::ptrdiff_t>(k));
      if (k == stack.size()) key.push_back(top_masks::whole_stack);
      std::shared_ptr<const top_entry> e;
      {
        std::lock_guard lock{masks_->mutex};
        if (auto it = masks_->entries.find(key); it != masks_->entries.end()) e = it->second;
        else if (!masks_->fits(entry_words)) return std::nullopt;
      }
      if (!e) {
        // Walked outside the lock: two threads reaching the same new top only repeat work.
        auto fresh = walk_top(*g_, *vocab_, key);
        std::lock_guard lock{masks_->mutex};
        auto [it, added] = masks_->entries.emplace(key, fresh);
        if (added) {
          masks_->words += fresh->words;
          all_top_words += fresh->words;
        }
        e = it->second;
      }
      if (e->limited) return std::nullopt;
      if (!e->deeper) {
        found[s] = std::move(e);
        break;
      }
    }
  }
  size_t added = 0;
  for (size_t s = 0; s < stacks_.size(); ++s) {
    if (!found[s]) continue;
    added += or_bits(found[s]->accepted, *mask);
    for (int32_t t : found[s]->accepted_ids) added += set_token(*mask, static_cast<size_t>(t));
    if (found[s]->reaching.empty()) continue;
    arena_->reset();
    uint32_t id = 0;
    for (uint32_t pos : stacks_[s]) id = arena_->intern(pos, id);
    added += walk_trie(*g_, *arena_, {id}, *vocab_, &found[s]->reaching, *mask);
    if (arena_->limited) return std::nullopt;  // the caller clears what was set and walks whole
  }
  return added;
}

std::string too_ambiguous(const grammar_matcher& m) {
  if (m.last_walk_over_budget())
    return "the answer's grammar is too costly to follow: after " + std::to_string(m.consumed()) +
           " tokens one token's choice passed " + std::to_string(m.last_walk_work()) + " parse steps (at most " +
           std::to_string(grammar::max_mask_work_per_trie_node) +
           " per node of the vocabulary's trie) and was cut short; many optional items one after another, such "
           "as \\w? written 200 times, do this";
  if (m.parses() <= grammar::max_parses) return {};
  return "the answer's grammar is too ambiguous to follow: after " + std::to_string(m.consumed()) +
         " tokens it can be read " + std::to_string(m.parses()) + " ways at once (at most " +
         std::to_string(grammar::max_parses) + "); nested counts of optional items, such as (.{0,64}){64}, do this";
}

}  // namespace baton::gpu
