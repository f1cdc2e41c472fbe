#include "gpu/sampling.hpp"

#include "gpu/grammar.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

namespace baton::gpu {

double draw_uniform(uint64_t seed, uint32_t position) {
  // splitmix64 of (seed, position) -> uniform in [0, 1)
  uint64_t z = seed + 0x9E3779B97F4A7C15ull * (uint64_t{position} + 1);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return static_cast<double>(z >> 11) * (1.0 / 9007199254740992.0);
}

namespace {

/// The penalties of sampling_config on a copy of the row (`x`), from the history's tokens.
void apply_penalties(std::vector<float>& x, const sampling_config& cfg, std::span<const int32_t> history,
                     std::vector<std::pair<int32_t, uint32_t>>& counts) {
  // Each distinct token of the history once, with how often the output (from output_from on)
  // holds it: sorted pairs, so a long history costs no hash set per row.
  counts.clear();
  for (size_t i = 0; i < history.size(); ++i)
    if (history[i] >= 0 && static_cast<size_t>(history[i]) < x.size())
      counts.emplace_back(history[i], i >= cfg.output_from ? 1u : 0u);
  std::sort(counts.begin(), counts.end());
  for (size_t i = 0; i < counts.size();) {
    const int32_t t = counts[i].first;
    uint32_t in_output = 0;
    for (; i < counts.size() && counts[i].first == t; ++i) in_output += counts[i].second;
    float& v = x[t];
    if (cfg.repetition_penalty != 1.0f) v = v > 0 ? v / cfg.repetition_penalty : v * cfg.repetition_penalty;
    if (in_output > 0) v -= cfg.presence_penalty + cfg.frequency_penalty * static_cast<float>(in_output);
  }
}

}  // namespace

int32_t sample_token(std::span<const float> raw, const sampling_config& cfg, uint32_t position,
                     std::span<const int32_t> history, sampling_scratch* scratch) {
  if (raw.empty()) return -1;
  sampling_scratch own;
  sampling_scratch& sc = scratch ? *scratch : own;
  std::span<const float> logits_in = raw;
  const bool penalise = cfg.penalised() && !history.empty();
  if (penalise || !cfg.bias_tokens.empty() || !cfg.banned_tokens.empty()) {
    sc.penalised.assign(raw.begin(), raw.end());
    if (penalise) apply_penalties(sc.penalised, cfg, history, sc.counts);
    for (size_t i = 0; i < cfg.bias_tokens.size() && i < cfg.bias_values.size(); ++i)
      if (const int32_t t = cfg.bias_tokens[i]; t >= 0 && static_cast<size_t>(t) < sc.penalised.size())
        sc.penalised[t] += cfg.bias_values[i];
    for (const int32_t t : cfg.banned_tokens)
      if (t >= 0 && static_cast<size_t>(t) < sc.penalised.size()) sc.penalised[t] = std::numeric_limits<float>::quiet_NaN();
    logits_in = sc.penalised;
  }
  const std::span<const float> logits = logits_in;
  // The largest logit, the lowest id among equal ones; a NaN is never picked (0 when no logit is
  // a number), as the CUDA executor's device pick (cuda::launch_argmax) does.
  size_t best = logits.size();
  for (size_t i = 0; i < logits.size(); ++i)
    if (!std::isnan(logits[i]) && (best == logits.size() || logits[i] > logits[best])) best = i;
  if (best == logits.size()) return 0;
  if (cfg.temperature <= 0.0f) return static_cast<int32_t>(best);
  const double u = draw_uniform(cfg.seed, position);
  // A NaN logit has no probability (the greedy pick above skips it too); the largest logit has 1,
  // also when it is infinite (inf - inf would be NaN).
  std::vector<double>& p = sc.p;
  p.resize(logits.size());
  for (size_t i = 0; i < logits.size(); ++i) {
    p[i] = logits[i] == logits[best] ? 1.0 : std::exp((static_cast<double>(logits[i]) - logits[best]) / cfg.temperature);
    if (std::isnan(p[i])) p[i] = 0.0;
  }
  // min-p: p is relative to the most likely token (which has 1), so the cut is min_p itself.
  if (cfg.min_p > 0.0f)
    for (double& x : p)
      if (x < cfg.min_p) x = 0.0;
  std::vector<uint32_t>& idx = sc.idx;
  idx.resize(p.size());
  std::iota(idx.begin(), idx.end(), 0u);
  const bool truncate = cfg.top_k > 0 || cfg.top_p < 1.0f;
  if (truncate) {
    // Candidates in a fixed order: probability, then id. It is a strict order, so putting only a
    // prefix in order gives exactly the prefix a full sort would: top-p usually keeps a few of a
    // vocabulary of 150K, and only as many are sorted as it reads (growing 4x at a time).
    const auto before = [&](uint32_t a, uint32_t b) { return p[a] > p[b] || (p[a] == p[b] && a < b); };
    const size_t candidates = cfg.top_k > 0 ? std::min<size_t>(cfg.top_k, idx.size()) : idx.size();
    size_t sorted = 0;
    auto sort_through = [&](size_t n) {  // idx[0, n) in order, every later id after them
      if (n < idx.size()) std::nth_element(idx.begin() + sorted, idx.begin() + n, idx.end(), before);
      std::sort(idx.begin() + sorted, idx.begin() + n, before);
      sorted = n;
    };
    if (cfg.top_k > 0) sort_through(candidates);
    size_t keep = candidates;
    if (cfg.top_p < 1.0f) {
      // The candidates' mass: the top-k in rank order, or the whole vocabulary in id order.
      double total = 0.0;
      if (cfg.top_k > 0)
        for (size_t j = 0; j < candidates; ++j) total += p[idx[j]];
      else
        for (double x : p) total += x;
      double acc = 0.0;
      for (keep = 0; keep < candidates;) {
        if (keep == sorted) sort_through(std::min(candidates, std::max<size_t>(64, sorted * 4)));
        acc += p[idx[keep++]] / total;
        if (acc >= cfg.top_p) break;
      }
      keep = std::max<size_t>(1, keep);  // never past `sorted`: the loop sorts before it reads
    }
    idx.resize(keep);
  }
  double total = 0.0;
  for (auto i : idx) total += p[i];
  double acc = 0.0;
  uint32_t last_possible = static_cast<uint32_t>(best);
  for (auto i : idx) {
    if (p[i] <= 0.0) continue;
    last_possible = i;
    acc += p[i] / total;
    if (u < acc) return static_cast<int32_t>(i);
  }
  // Rounding left the sum just under u: the last candidate that had a chance, never one with
  // none (a NaN or banned logit, a token min-p cut).
  return static_cast<int32_t>(last_possible);
}

token_logprobs logprobs_of(std::span<const float> logits, int32_t token, uint32_t top_n) {
  token_logprobs out;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  double max = -std::numeric_limits<double>::infinity();
  for (float x : logits)
    if (!std::isnan(x)) max = std::max<double>(max, x);
  // log-sum-exp in double around the largest logit. Degenerate rows as sample_token draws them:
  // the logits equal to an infinite largest one (+inf, or all -inf) share the mass evenly.
  double sum = 0.0;
  uint64_t at_max = 0, at_least = 0, counted = 0;
  const bool has_token = token >= 0 && static_cast<size_t>(token) < logits.size();
  const float mine = has_token ? logits[token] : neg_inf;
  for (float x : logits) {
    if (std::isnan(x)) continue;
    ++counted;
    if (std::isfinite(max)) sum += std::exp(static_cast<double>(x) - max);
    at_max += x == max;
    at_least += x >= mine;  // itself included
  }
  if (has_token) out.rank = static_cast<uint32_t>(std::isnan(mine) ? counted + 1 : at_least);
  const auto lp = [&](float x) -> float {
    if (std::isnan(x) || (std::isinf(max) && x != max)) return neg_inf;
    if (std::isinf(max)) return static_cast<float>(-std::log(static_cast<double>(at_max)));
    return static_cast<float>(static_cast<double>(x) - max - std::log(sum));
  };
  out.logprob = token >= 0 && static_cast<size_t>(token) < logits.size() ? lp(logits[token]) : neg_inf;
  top_n = std::min<uint32_t>({top_n, max_top_logprobs, static_cast<uint32_t>(logits.size())});
  if (top_n == 0) return out;
  // The top_n in a strict order (logit, then id; NaN last), found by one pass over the row.
  const auto before = [&](uint32_t a, uint32_t b) {
    const float x = std::isnan(logits[a]) ? neg_inf : logits[a], y = std::isnan(logits[b]) ? neg_inf : logits[b];
    return x > y || (x == y && a < b);
  };
  std::vector<uint32_t> best;
  best.reserve(top_n + 1);
  for (uint32_t i = 0; i < logits.size(); ++i) {
    if (best.size() == top_n && !before(i, best.back())) continue;
    best.insert(std::upper_bound(best.begin(), best.end(), i, before), i);
    if (best.size() > top_n) best.pop_back();
  }
  for (auto i : best) {
    out.top_tokens.push_back(static_cast<int32_t>(i));
    out.top_logprobs.push_back(lp(logits[i]));
  }
  return out;
}

int32_t sample_token(const std::vector<float>& logits, const sampling_config& cfg, uint32_t position,
                     const std::vector<int32_t>* history) {
  return sample_token(std::span<const float>(logits), cfg, position,
                      history ? std::span<const int32_t>(*history) : std::span<const int32_t>{});
}

int32_t sample_token(std::span<const float> logits, const seq_sampling& s, sampling_scratch* scratch) {
  const auto history = s.cfg.penalised() ? std::span<const int32_t>(s.history) : std::span<const int32_t>{};
  if (!s.grammar) return sample_token(logits, s.cfg, s.position, history, scratch);
  sampling_scratch own;
  sampling_scratch& sc = scratch ? *scratch : own;
  if (s.cfg.temperature <= 0.0f) {
    const int32_t best = sample_token(logits, s.cfg, s.position, history, &sc);
    if (s.grammar->allows(best)) return best;
  }
  const auto& ends = s.grammar->end_tokens();
  const int32_t fallback = ends.empty() ? 0 : ends.front();
  if (s.grammar->allowed(&sc.allowed) == 0) return fallback;
  // The grammar's mask is sized to its vocabulary; a row may be longer (padded embeddings).
  sc.masked.assign(logits.begin(), logits.end());
  int32_t first = -1;
  bool any_number = false;
  for (size_t i = 0; i < sc.masked.size(); ++i) {
    if (i >= sc.allowed.size() || !sc.allowed[i]) {
      sc.masked[i] = std::numeric_limits<float>::quiet_NaN();
      continue;
    }
    if (first < 0) first = static_cast<int32_t>(i);
    any_number = any_number || !std::isnan(sc.masked[i]);
  }
  if (first < 0) return fallback;
  if (!any_number) return first;  // every allowed logit NaN: sample_token would say 0
  return sample_token(std::span<const float>(sc.masked), s.cfg, s.position, history, &sc);
}

}  // namespace baton::gpu
