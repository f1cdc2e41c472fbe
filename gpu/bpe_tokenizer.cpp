#include "gpu/bpe_tokenizer.hpp"

#include <algorithm>
#include <queue>

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <unicode/bytestream.h>
#include <unicode/normalizer2.h>
#include <unicode/utf8.h>

#include <nlohmann/json.hpp>

#include "gpu/json_file.hpp"
#include "gpu/text_file.hpp"

namespace baton::gpu {

namespace {

using nlohmann::json;

/// GPT-2's ByteLevel pre-tokenizer pattern (use_regex: true).
const char* gpt2_pattern = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

std::string utf8(uint32_t cp) {
  std::string s;
  if (cp < 0x80) {
    s.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    s.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    s.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    s.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    s.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    s.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
  return s;
}

/// Length of the UTF-8 sequence starting with byte b (1 for continuation or invalid bytes).
size_t utf8_len(unsigned char b) {
  if (b >= 0xF0) return 4;
  if (b >= 0xE0) return 3;
  if (b >= 0xC0) return 2;
  return 1;
}

pcre2_code* compile(const std::string& pattern, std::string* why) {
  int err = 0;
  PCRE2_SIZE off = 0;
  auto* re = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.c_str()), PCRE2_ZERO_TERMINATED,
                           PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF, &err, &off, nullptr);
  if (!re) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(err, msg, sizeof msg);
    *why = "split pattern does not compile at offset " + std::to_string(off) + ": " + reinterpret_cast<char*>(msg);
    return nullptr;
  }
  pcre2_jit_compile(re, PCRE2_JIT_COMPLETE);  // best effort: the interpreter is used if JIT is unavailable
  return re;
}

/// Splits every piece at the pattern's matches, keeping matches and the gaps between them
/// (Hugging Face's Split with behavior "Isolated").
std::vector<std::string> split_isolated(pcre2_code* re, const std::vector<std::string>& pieces) {
  std::vector<std::string> out;
  auto* md = pcre2_match_data_create_from_pattern(re, nullptr);
  for (const auto& p : pieces) {
    size_t at = 0, gap_start = 0;
    while (at <= p.size()) {
      const int rc = pcre2_match(re, reinterpret_cast<PCRE2_SPTR>(p.data()), p.size(), at, 0, md, nullptr);
      if (rc < 0) break;
      const auto* ov = pcre2_get_ovector_pointer(md);
      const size_t b = ov[0], e = ov[1];
      if (e == b) {  // empty match: step over one character
        at = b + (b < p.size() ? utf8_len(static_cast<unsigned char>(p[b])) : 1);
        continue;
      }
      if (b > gap_start) out.push_back(p.substr(gap_start, b - gap_start));
      out.push_back(p.substr(b, e - b));
      gap_start = at = e;
    }
    if (gap_start < p.size()) out.push_back(p.substr(gap_start));
  }
  pcre2_match_data_free(md);
  return out;
}

}  // namespace

const std::vector<std::string>& byte_level_symbols() {
  static const std::vector<std::string> symbols = [] {
    std::vector<int> bs;
    for (int b = '!'; b <= '~'; ++b) bs.push_back(b);
    for (int b = 0xA1; b <= 0xAC; ++b) bs.push_back(b);
    for (int b = 0xAE; b <= 0xFF; ++b) bs.push_back(b);
    std::vector<int> cs = bs;
    int n = 0;
    for (int b = 0; b < 256; ++b)
      if (std::find(bs.begin(), bs.end(), b) == bs.end()) {
        bs.push_back(b);
        cs.push_back(256 + n++);
      }
    std::vector<std::string> out(256);
    for (size_t i = 0; i < bs.size(); ++i) out[bs[i]] = utf8(static_cast<uint32_t>(cs[i]));
    return out;
  }();
  return symbols;
}

bpe_tokenizer::~bpe_tokenizer() {
  for (auto* p : patterns_) pcre2_code_free(static_cast<pcre2_code*>(p));
}

std::unique_ptr<bpe_tokenizer> bpe_tokenizer::load(const std::string& path, std::string* why) {
  std::string text;
  if (!read_text_file(path, &text)) {
    *why = path + ": cannot read it";
    return nullptr;
  }
  return from_json(text, path, why);
}

std::unique_ptr<bpe_tokenizer> bpe_tokenizer::from_json(const std::string& text, const std::string& source,
                                                        std::string* why) {
  auto fail = [&](const std::string& s) -> std::unique_ptr<bpe_tokenizer> {
    *why = source + ": " + s;
    return nullptr;
  };
  try {
    json j;
    if (!parse_json_object(text, source, &j, why)) return nullptr;
    if (!j.contains("model") || !j["model"].is_object()) return fail("no \"model\"");
    const auto& m = j["model"];
    if (m.value("type", std::string{}) != "BPE") return fail("model type " + m.value("type", std::string{"?"}) + " is not supported (BPE is)");
    if (m.value("byte_fallback", false)) return fail("byte_fallback BPE (SentencePiece-style) is not supported");
    std::unique_ptr<bpe_tokenizer> t{new bpe_tokenizer};
    t->ignore_merges_ = m.value("ignore_merges", false);
    const auto& symbols = byte_level_symbols();
    for (int b = 0; b < 256; ++b) {
      t->byte_to_symbol_[b] = symbols[b];
      t->symbol_to_byte_[symbols[b]] = static_cast<uint8_t>(b);
    }
    if (!m.contains("vocab") || !m["vocab"].is_object()) return fail("model has no vocab");
    for (auto it = m["vocab"].begin(); it != m["vocab"].end(); ++it) {
      if (!it.value().is_number_integer() || it.value().get<int64_t>() < 0 || it.value().get<int64_t>() > (1 << 24))
        return fail("vocab entry " + it.key() + " has no valid id");
      const auto id = it.value().get<int32_t>();
      t->vocab_[it.key()] = id;
      if (static_cast<size_t>(id) >= t->id_to_token_.size()) t->id_to_token_.resize(id + 1);
      t->id_to_token_[id] = it.key();
    }
    for (int b = 0; b < 256; ++b) {
      auto i = t->vocab_.find(symbols[b]);
      t->byte_id_[b] = i == t->vocab_.end() ? -1 : i->second;
    }
    if (m.contains("merges") && m["merges"].is_array()) {
      uint32_t rank = 0;
      for (const auto& mg : m["merges"]) {
        std::string left, right;
        if (mg.is_string()) {
          const auto pair = mg.get<std::string>();
          const auto space = pair.find(' ');
          if (space == std::string::npos) return fail("merge " + std::to_string(rank) + " '" + pair + "' has no space");
          left = pair.substr(0, space), right = pair.substr(space + 1);
        } else if (mg.is_array() && mg.size() == 2 && mg[0].is_string() && mg[1].is_string()) {
          left = mg[0].get<std::string>(), right = mg[1].get<std::string>();
        } else {
          return fail("merge " + std::to_string(rank) + " is neither \"a b\" nor [a, b]");
        }
        // As Hugging Face's tokenizers insists: both parts and the result are vocabulary tokens
        // (a result outside it could only be dropped, losing text silently).
        const auto l = t->vocab_.find(left), r = t->vocab_.find(right), lr = t->vocab_.find(left + right);
        if (l == t->vocab_.end() || r == t->vocab_.end() || lr == t->vocab_.end())
          return fail("merge " + std::to_string(rank) + " (" + left + " " + right + ") names '" +
                      (l == t->vocab_.end() ? left : r == t->vocab_.end() ? right : left + right) +
                      "', which is not in the vocabulary");
        const uint64_t key = uint64_t{static_cast<uint32_t>(l->second)} << 32 | static_cast<uint32_t>(r->second);
        t->merges_.emplace(key, merge{rank++, lr->second});  // a repeated pair keeps its first rank
      }
    }
    if (j.contains("added_tokens") && j["added_tokens"].is_array())
      for (const auto& a : j["added_tokens"]) {
        if (!a.contains("id") || !a.contains("content") || !a["id"].is_number_integer() || !a["content"].is_string())
          return fail("an added token needs an id and a content");
        // Bounded as vocabulary ids are: a negative or huge id would size the table from it.
        if (a["id"].get<int64_t>() < 0 || a["id"].get<int64_t>() > (1 << 24))
          return fail("added token '" + a["content"].get<std::string>().substr(0, 32) + "' has id " +
                      std::to_string(a["id"].get<int64_t>()) + ", outside 0 to 2^24");
        const auto id = a["id"].get<int32_t>();
        const auto special = a.contains("special") && a["special"].is_boolean() && a["special"].get<bool>();
        t->added_.push_back({a["content"].get<std::string>(), id, special});
        if (static_cast<size_t>(id) >= t->id_to_token_.size()) t->id_to_token_.resize(id + 1);
      }
    std::sort(t->added_.begin(), t->added_.end(), [](auto& a, auto& b) { return a.content.size() > b.content.size(); });
    t->is_special_.assign(t->id_to_token_.size(), false);
    for (size_t k = 0; k < t->added_.size(); ++k) {
      t->is_special_[t->added_[k].id] = t->added_[k].special;
      t->added_by_id_.emplace(t->added_[k].id, k);
    }
    if (j.contains("normalizer") && !j["normalizer"].is_null()) {
      // NFC (Qwen's): text is composed before it is split, as Hugging Face does, so "e" and a
      // combining acute accent are the tokens of "é". A Sequence is its members in turn
      // (DeepSeek-V3's is empty: no normalisation at all).
      std::vector<const json*> pending{&j["normalizer"]};
      for (size_t seen = 0; !pending.empty(); ++seen) {
        const json& n = *pending.back();
        pending.pop_back();
        if (seen > 64 || !n.is_object()) return fail("normalizer: not an object, or nested too deep");
        const auto type = n.value("type", std::string{});
        if (type == "Sequence" && n.contains("normalizers") && n["normalizers"].is_array()) {
          for (const auto& m : n["normalizers"]) pending.push_back(&m);
        } else if (type == "NFC") {
          t->nfc_ = true;
        } else {
          return fail("normalizer " + type + " is not supported (none, NFC, or a Sequence of them)");
        }
      }
    }
    // The pre-tokenizer: ByteLevel, Split(Isolated) or a Sequence of them.
    std::vector<const json*> steps;  // pointers: a copy of a value is recursive
    if (j.contains("pre_tokenizer") && j["pre_tokenizer"].is_object()) {
      const auto& p = j["pre_tokenizer"];
      if (p.value("type", std::string{}) == "Sequence" && p.contains("pretokenizers"))
        for (const auto& s : p["pretokenizers"]) steps.push_back(&s);
      else
        steps.push_back(&p);
    }
    bool byte_level = false;
    for (const auto* step : steps) {
      const auto& s = *step;
      const auto type = s.value("type", std::string{});
      std::string pattern;
      if (type == "ByteLevel") {
        byte_level = true;
        t->add_prefix_space_ = s.value("add_prefix_space", false);
        if (!s.value("use_regex", true)) continue;
        pattern = gpt2_pattern;
      } else if (type == "Split") {
        if (s.value("behavior", std::string{}) != "Isolated" || s.value("invert", false))
          return fail("Split pre-tokenizer behaviour " + s.value("behavior", std::string{"?"}) +
                      " is not supported (Isolated is)");
        if (!s.contains("pattern") || !s["pattern"].is_object()) return fail("Split pre-tokenizer has no pattern");
        const auto& pat = s["pattern"];
        if (pat.contains("Regex")) pattern = pat["Regex"].get<std::string>();
        else if (pat.contains("String")) pattern = "\\Q" + pat["String"].get<std::string>() + "\\E";
        else return fail("Split pattern is neither Regex nor String");
      } else {
        return fail("pre_tokenizer " + type + " is not supported (ByteLevel, Split, Sequence)");
      }
      std::string err;
      auto* re = compile(pattern, &err);
      if (!re) return fail(err);
      t->patterns_.push_back(re);
    }
    if (!byte_level) return fail("not a byte-level BPE (no ByteLevel pre-tokenizer)");
    return t;
  } catch (const json::exception& e) {
    return fail(e.what());
  }
}

bool bpe_tokenizer::show_special(const std::string& content) {
  const int32_t id = token_id(content);
  if (id < 0 || static_cast<size_t>(id) >= is_special_.size()) return false;
  is_special_[id] = false;
  return true;
}

int32_t bpe_tokenizer::token_id(const std::string& content) const {
  for (const auto& a : added_)
    if (a.content == content) return a.id;
  std::string sym;
  for (unsigned char c : content) sym += byte_to_symbol_[c];
  auto i = vocab_.find(sym);
  return i == vocab_.end() ? -1 : i->second;
}

// Merges lowest rank first, the leftmost of equal ranks first, as Hugging Face's tokenizers
// does: a min-heap of candidate pairs over a linked list of symbols, O(n log n) in the piece's
// length (a run of one letter is a single piece, and an O(n^2) loop stalled on long ones).
void bpe_tokenizer::encode_piece(const std::string& piece, std::vector<int32_t>* out) const {
  if (ignore_merges_) {
    std::string whole;
    for (unsigned char c : piece) whole += byte_to_symbol_[c];
    if (auto i = vocab_.find(whole); i != vocab_.end()) {
      out->push_back(i->second);
      return;
    }
  }
  std::vector<int32_t> id;
  for (unsigned char c : piece)
    if (byte_id_[c] >= 0) id.push_back(byte_id_[c]);
  const auto n = static_cast<int32_t>(id.size());
  std::vector<int32_t> next(n), prev(n);
  for (int32_t i = 0; i < n; ++i) next[i] = i + 1 < n ? i + 1 : -1, prev[i] = i - 1;
  struct candidate {
    uint32_t rank;
    int32_t pos, left, right, merged;
    bool operator>(const candidate& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  std::priority_queue<candidate, std::vector<candidate>, std::greater<>> heap;
  auto consider = [&](int32_t pos) {
    if (pos < 0 || next[pos] < 0) return;
    const auto r = id[next[pos]];
    if (auto m = merges_.find(uint64_t{static_cast<uint32_t>(id[pos])} << 32 | static_cast<uint32_t>(r));
        m != merges_.end())
      heap.push({m->second.rank, pos, id[pos], r, m->second.id});
  };
  for (int32_t i = 0; i + 1 < n; ++i) consider(i);
  std::vector<bool> gone(n, false);
  while (!heap.empty()) {
    const auto c = heap.top();
    heap.pop();
    // Stale when either side has merged since: ids only ever grow into longer tokens.
    if (gone[c.pos] || id[c.pos] != c.left || next[c.pos] < 0 || id[next[c.pos]] != c.right) continue;
    const int32_t j = next[c.pos];
    id[c.pos] = c.merged;
    gone[j] = true;
    next[c.pos] = next[j];
    if (next[j] >= 0) prev[next[j]] = c.pos;
    consider(prev[c.pos]);
    consider(c.pos);
  }
  for (int32_t i = n > 0 ? 0 : -1; i >= 0; i = next[i]) out->push_back(id[i]);
}

namespace {

/// `text` in Unicode's NFC (ICU's) in `*out`, true; false where it is left as it is: ASCII,
/// already NFC, or not well-formed UTF-8 (which no Hugging Face input can be: it is left to the
/// byte-level tokens). The common case, ASCII, copies nothing.
bool composed(const std::string& text, std::string* out) {
  if (std::all_of(text.begin(), text.end(), [](char c) { return static_cast<unsigned char>(c) < 0x80; })) return false;
  if (text.size() > static_cast<size_t>(INT32_MAX)) return false;
  const auto n = static_cast<int32_t>(text.size());
  for (int32_t i = 0; i < n;) {
    UChar32 c;
    U8_NEXT(text.data(), i, n, c);
    if (c < 0) return false;
  }
  UErrorCode status = U_ZERO_ERROR;
  const icu::Normalizer2* nfc = icu::Normalizer2::getNFCInstance(status);
  if (U_FAILURE(status)) return false;
  if (nfc->isNormalizedUTF8(text, status) && U_SUCCESS(status)) return false;
  status = U_ZERO_ERROR;
  icu::StringByteSink<std::string> sink(out);
  nfc->normalizeUTF8(0, text, sink, nullptr, status);
  return U_SUCCESS(status);
}

}  // namespace

void bpe_tokenizer::encode_plain(const std::string& raw, std::vector<int32_t>* out) const {
  if (raw.empty()) return;
  std::string normalized;
  const std::string& text = nfc_ && composed(raw, &normalized) ? normalized : raw;
  std::vector<std::string> pieces{add_prefix_space_ && text[0] != ' ' ? " " + text : text};
  for (auto* p : patterns_) pieces = split_isolated(static_cast<pcre2_code*>(p), pieces);
  for (const auto& p : pieces) encode_piece(p, out);
}

std::vector<int32_t> bpe_tokenizer::encode(const std::string& text) const {
  std::vector<int32_t> out;
  size_t at = 0;
  // Where each added token next occurs: searched again only once `at` has passed it, so a prompt
  // full of special tokens costs one forward scan per token kind, not one per occurrence.
  constexpr size_t unsearched = std::string::npos - 1;
  std::vector<size_t> found(added_.size(), unsearched);
  while (at < text.size()) {
    // The earliest added token at or after `at` (the longest one at a tie).
    size_t best_pos = std::string::npos;
    const added* best = nullptr;
    for (size_t k = 0; k < added_.size(); ++k) {
      const auto& a = added_[k];
      if (a.content.empty()) continue;
      if (found[k] == unsearched || (found[k] != std::string::npos && found[k] < at))
        found[k] = text.find(a.content, at);
      if (found[k] < best_pos) {
        best_pos = found[k];
        best = &a;
      }
    }
    if (!best) {
      encode_plain(text.substr(at), &out);
      break;
    }
    encode_plain(text.substr(at, best_pos - at), &out);
    out.push_back(best->id);
    at = best_pos + best->content.size();
  }
  return out;
}

std::string bpe_tokenizer::decode(const std::vector<int32_t>& ids, bool skip_special) const {
  std::string out;
  for (auto id : ids) {
    if (id < 0 || static_cast<size_t>(id) >= id_to_token_.size()) continue;
    if (is_special_[id]) {
      if (skip_special) continue;
    }
    if (auto a = added_by_id_.find(id); a != added_by_id_.end()) {
      out += added_[a->second].content;
      continue;
    }
    const auto& tok = id_to_token_[id];
    for (size_t i = 0; i < tok.size();) {
      const size_t len = utf8_len(static_cast<unsigned char>(tok[i]));
      auto b = symbol_to_byte_.find(tok.substr(i, len));
      if (b != symbol_to_byte_.end()) out.push_back(static_cast<char>(b->second));
      i += len;
    }
  }
  return out;
}

std::string bpe_tokenizer::stream::push(int32_t id) {
  pending_ += t_.decode({id}, skip_);
  // Emit the longest prefix that ends on a character boundary.
  size_t i = 0, complete = 0;
  while (i < pending_.size()) {
    const size_t len = utf8_len(static_cast<unsigned char>(pending_[i]));
    if (i + len > pending_.size()) break;
    i += len;
    complete = i;
  }
  std::string out = pending_.substr(0, complete);
  pending_.erase(0, complete);
  return out;
}

std::string bpe_tokenizer::stream::flush() {
  std::string out;
  out.swap(pending_);
  return out;
}

}  // namespace baton::gpu
