#include "gpu/prompt_lookup.hpp"

#include <algorithm>

namespace baton::gpu {

std::vector<int32_t> propose_by_lookup(std::span<const int32_t> history, uint32_t min_ngram, uint32_t max_ngram,
                                       uint32_t max_draft) {
  const size_t len = history.size();
  if (max_draft == 0 || min_ngram == 0 || max_ngram < min_ngram || len < 2) return {};
  // One pass from the end: an occurrence [end - k, end) of the history's last k tokens, followed
  // by history[end]. The longest k (up to max_ngram) wins, and among equals the latest: a recent
  // repeat is the likeliest to go on. Most positions cost one comparison (their last token), so
  // a step of 64 sequences with 32K-token histories stays near a millisecond.
  size_t best_end = 0, best_k = 0;
  const int32_t last = history[len - 1];
  for (size_t end = len - 1; end >= 1; --end) {
    if (history[end - 1] != last) continue;
    size_t k = 1;
    while (k < max_ngram && k < end && history[end - 1 - k] == history[len - 1 - k]) ++k;
    if (k > best_k) {
      best_k = k;
      best_end = end;
      if (k == max_ngram) break;
    }
  }
  if (best_k < min_ngram) return {};
  // What followed it; where that runs into the tail, the draft goes on repeating the same span
  // (as if the draft itself were history), so a loop of period p is drafted in full.
  std::vector<int32_t> draft;
  draft.reserve(max_draft);
  for (size_t i = 0; i < max_draft; ++i) {
    const size_t at = best_end + i;
    draft.push_back(at < len ? history[at] : draft[at - len]);
  }
  return draft;
}

}  // namespace baton::gpu
