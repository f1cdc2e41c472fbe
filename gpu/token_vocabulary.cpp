// The vocabulary a grammar is walked over (grammar.hpp): each token's bytes, and a byte trie of
// the text tokens in depth-first order, built once per vocabulary.

#include <algorithm>
#include <map>
#include <memory>
#include <mutex>

#include "gpu/grammar.hpp"

namespace baton::gpu {

token_vocabulary::token_vocabulary(std::vector<std::string> text, std::vector<bool> special)
    : text_(std::move(text)), special_(std::move(special)) {
  special_.resize(text_.size(), false);
  std::vector<int32_t> ids;
  for (size_t i = 0; i < text_.size(); ++i)
    if (is_text(static_cast<int32_t>(i))) ids.push_back(static_cast<int32_t>(i));
  // In byte order, tokens sharing a prefix are neighbours: each new token adds nodes only past
  // the prefix it shares with the one before.
  std::stable_sort(ids.begin(), ids.end(), [&](int32_t a, int32_t b) { return text_[a] < text_[b]; });
  std::vector<uint32_t> path;  // the nodes of the previous token's text
  const std::string* prev = nullptr;
  for (int32_t id : ids) {
    const std::string& t = text_[id];
    size_t common = 0;
    if (prev)
      while (common < path.size() && common < t.size() && (*prev)[common] == t[common]) ++common;
    for (; path.size() > common; path.pop_back()) trie_[path.back()].skip = static_cast<uint32_t>(trie_.size());
    for (size_t k = path.size(); k < t.size(); ++k) {
      path.push_back(static_cast<uint32_t>(trie_.size()));
      trie_.push_back({0, static_cast<uint16_t>(std::min<size_t>(k + 1, UINT16_MAX)), static_cast<uint8_t>(t[k]), 0, 0});
    }
    auto& node = trie_[path.back()];
    if (node.end_token != trie_tokens_.size() || node.first_token == node.end_token)
      node.first_token = static_cast<uint32_t>(trie_tokens_.size());
    trie_tokens_.push_back(id);
    node.end_token = static_cast<uint32_t>(trie_tokens_.size());
    ++first_bytes_[static_cast<uint8_t>(t[0])];
    prev = &t;
  }
  for (; !path.empty(); path.pop_back()) trie_[path.back()].skip = static_cast<uint32_t>(trie_.size());
}

bool token_vocabulary::is_text(int32_t id) const {
  return id >= 0 && static_cast<size_t>(id) < text_.size() && !special_[id] && !text_[id].empty() &&
         text_[id].size() < UINT16_MAX;
}

namespace {

std::shared_ptr<const token_vocabulary> make_byte_vocabulary(uint32_t vocab_size) {
  std::vector<std::string> text(vocab_size);
  std::vector<bool> special(vocab_size, true);
  for (uint32_t i = 0; i < vocab_size && i < 256; ++i) {
    text[i] = std::string(1, static_cast<char>(i));
    special[i] = false;
  }
  return std::make_shared<token_vocabulary>(std::move(text), std::move(special));
}

}  // namespace

std::shared_ptr<const token_vocabulary> byte_vocabulary(uint32_t vocab_size) {
  // One per size in the process: the ranks of a process then share each grammar's cache of
  // stack tops (grammar::masks_for keys it by vocabulary).
  static std::mutex mutex;
  static std::map<uint32_t, std::shared_ptr<const token_vocabulary>> made;
  std::lock_guard lock{mutex};
  auto& v = made[vocab_size];
  if (!v) v = make_byte_vocabulary(vocab_size);
  return v;
}

}  // namespace baton::gpu
