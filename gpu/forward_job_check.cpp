#include "gpu/forward_job_check.hpp"

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

namespace baton::gpu {

std::string check_forward_job(const forward_job& job, const model_config& cfg, const kv_layout& layout) {
  const uint32_t page = layout.page_size_tokens;
  // A sequence's pages are distinct where it has tokens: one page at two places of its list
  // would have its later tokens overwrite its earlier ones' KV, and attention read the wrong
  // keys with no error. A stamp per page (this thread's, reused) keeps the check linear, in the
  // one pass over the pages that checks them.
  thread_local std::vector<uint64_t> listed_by;
  thread_local uint64_t stamp = 0;
  if (listed_by.size() < layout.num_pages) listed_by.assign(layout.num_pages, 0);
  for (const auto& s : job.seqs) {
    const auto tag = "sequence " + std::to_string(s.seq_id) + ": ";
    if (s.tokens.empty()) return tag + "no tokens to run";
    if (!s.row_samples.empty() && s.row_samples.size() + 1 != s.tokens.size())
      return tag + std::to_string(s.row_samples.size()) + " row picks for " + std::to_string(s.tokens.size()) +
             " rows (one per row before the last)";
    if (!s.row_samples.empty() && !s.sample) return tag + "row picks without the last row's (sample)";
    for (const auto& pick : s.row_samples)
      if (pick.grammar || !pick.history.empty()) return tag + "a row pick with its own grammar or history (it reads sample's)";
    for (auto t : s.tokens)
      if (t < 0 || static_cast<uint32_t>(t) >= cfg.vocab_size)
        return tag + "token id " + std::to_string(t) + " outside the vocabulary [0, " +
               std::to_string(cfg.vocab_size) + ")";
    const uint64_t end = uint64_t{s.start_pos} + s.tokens.size();
    if (end > cfg.max_position_embeddings)
      return tag + "position " + std::to_string(end - 1) + " beyond the context limit " +
             std::to_string(cfg.max_position_embeddings);
    if (uint64_t{s.pages.size()} * page < end)
      return tag + std::to_string(s.pages.size()) + " KV pages cannot hold " + std::to_string(end) + " tokens";
    ++stamp;
    const uint64_t used = (end + page - 1) / page;  // the pages holding its tokens
    for (size_t k = 0; k < s.pages.size(); ++k) {
      const uint32_t p = s.pages[k];
      if (p >= layout.num_pages) return tag + "KV page " + std::to_string(p) + " does not exist";
      if (k >= used) continue;
      if (listed_by[p] == stamp) return tag + "KV page " + std::to_string(p) + " appears twice among the pages of its tokens";
      listed_by[p] = stamp;
    }
  }
  // Pages a job writes (those holding its new tokens) belong to one sequence each: two writing
  // one page would corrupt each other's KV in a way no later check could see. Shared pages of a
  // cached prefix are read only, so they may appear in several sequences.
  if (job.seqs.size() < 2) return {};
  std::vector<std::pair<uint32_t, size_t>> written;  // (page, sequence index)
  for (size_t i = 0; i < job.seqs.size(); ++i) {
    const auto& s = job.seqs[i];
    const uint64_t end = uint64_t{s.start_pos} + s.tokens.size();
    for (uint64_t k = s.start_pos / page; k * page < end; ++k) written.emplace_back(s.pages[k], i);
  }
  std::sort(written.begin(), written.end());
  for (size_t k = 1; k < written.size(); ++k)
    if (written[k].first == written[k - 1].first && written[k].second != written[k - 1].second)
      return "sequences " + std::to_string(job.seqs[written[k - 1].second].seq_id) + " and " +
             std::to_string(job.seqs[written[k].second].seq_id) + " both write KV page " +
             std::to_string(written[k].first);
  return {};
}

std::string row_picks_refusal(const forward_job& job, const std::string& executor) {
  for (const auto& s : job.seqs)
    if (!s.row_samples.empty())
      return "sequence " + std::to_string(s.seq_id) + ": picks after every row (speculative decoding) are not supported by " +
             executor;
  return {};
}

}  // namespace baton::gpu
