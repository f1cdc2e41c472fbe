#include "sims/sim_report.hpp"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <numeric>

#include <nlohmann/json.hpp>

namespace baton::sims {

std::string as_typed(double x) {
  char b[32];
  std::snprintf(b, sizeof b, "%g", x);
  return b;
}

void summarize_intervals(const std::vector<int64_t>& tbt_us, request_outcome* o) {
  if (tbt_us.empty()) return;
  std::vector<int64_t> sorted = tbt_us;
  std::sort(sorted.begin(), sorted.end(), std::greater<>());
  const size_t slow = std::max<size_t>(1, sorted.size() / 10);
  o->tbt_slow10_us = std::accumulate(sorted.begin(), sorted.begin() + static_cast<std::ptrdiff_t>(slow), 0.0) /
                     static_cast<double>(slow);
  o->tbt_mean_us = std::accumulate(sorted.begin(), sorted.end(), 0.0) / static_cast<double>(sorted.size());
  o->tbt_max_us = sorted.front();
}

percentiles percentiles_of(std::vector<double> v) {
  percentiles p;
  p.count = v.size();
  if (v.empty()) return p;
  std::sort(v.begin(), v.end());
  auto at = [&](double q) {
    const double pos = q * static_cast<double>(v.size() - 1);
    const auto lo = static_cast<size_t>(std::floor(pos));
    const size_t hi = std::min(lo + 1, v.size() - 1);
    return v[lo] + (v[hi] - v[lo]) * (pos - static_cast<double>(lo));
  };
  p.mean = std::accumulate(v.begin(), v.end(), 0.0) / static_cast<double>(v.size());
  p.p50 = at(0.5), p.p90 = at(0.9), p.p99 = at(0.99), p.max = v.back();
  return p;
}

sim_summary summarize(const std::vector<request_outcome>& outcomes, const slo& s) {
  sim_summary out;
  out.requests = outcomes.size();
  std::vector<double> ttft, tbt, tpot, e2e;
  uint64_t cached = 0, prompt = 0, tokens = 0, within = 0;
  int64_t first = outcomes.empty() ? 0 : outcomes.front().arrival_us, last = first;
  for (const auto& o : outcomes) {
    first = std::min(first, o.arrival_us);
    if (!o.ok) {
      ++out.failed;
      // Grouped by their words: numbers (request ids, sizes) become N.
      std::string kind;
      for (char c : o.error.substr(0, 160))
        if (!std::isdigit(static_cast<unsigned char>(c)))
          kind += c;
        else if (kind.empty() || kind.back() != 'N')
          kind += 'N';
      ++out.errors[kind];
      continue;
    }
    ++out.completed;
    // Over completed requests only: a failed one reports no cached tokens, so its prompt would
    // count as a miss however much of it the cache held.
    prompt += o.input_tokens;
    cached += o.cached_tokens;
    tokens += o.output_tokens;
    out.failovers += o.failovers;
    ttft.push_back(static_cast<double>(o.ttft_us) / 1e3);
    e2e.push_back(static_cast<double>(o.e2e_us) / 1e3);
    if (o.output_tokens > 1) {
      tbt.push_back(o.tbt_slow10_us / 1e3);
      tpot.push_back(o.tpot_us / 1e3);
    }
    last = std::max(last, o.arrival_us + o.e2e_us);
    ++out.prefill_requests[o.prefill_rank];
    if (!o.decode_rank.empty()) ++out.decode_requests[o.decode_rank];  // a one-token request has none
    if (static_cast<double>(o.ttft_us) <= s.ttft_ms * 1e3 && o.tbt_slow10_us <= s.tbt_ms * 1e3) ++within;
  }
  out.ttft_ms = percentiles_of(ttft);
  out.tbt_ms = percentiles_of(tbt);
  out.tpot_ms = percentiles_of(tpot);
  out.e2e_ms = percentiles_of(e2e);
  out.slo_attainment = out.requests ? static_cast<double>(within) / static_cast<double>(out.requests) : 0.0;
  out.cache_hit_ratio = prompt ? static_cast<double>(cached) / static_cast<double>(prompt) : 0.0;
  out.span_s = static_cast<double>(last - first) / 1e6;
  if (out.span_s > 0) {
    out.output_tokens_per_s = static_cast<double>(tokens) / out.span_s;
    out.requests_per_s = static_cast<double>(out.completed) / out.span_s;
  }
  return out;
}

namespace {

/// Numbers rounded to 4 significant decimals in a fixed format: the same doubles give the same
/// text on every run and library.
/// Non-finite numbers are null: JSON has no NaN or infinity ("nan" does not parse back).
nlohmann::ordered_json num(double x) {
  if (!std::isfinite(x)) return nullptr;
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.4f", x);
  return nlohmann::ordered_json::parse(buf);
}

nlohmann::ordered_json pct(const percentiles& p) {
  nlohmann::ordered_json j;
  j["count"] = p.count;
  j["mean"] = num(p.mean);
  j["p50"] = num(p.p50);
  j["p90"] = num(p.p90);
  j["p99"] = num(p.p99);
  j["max"] = num(p.max);
  return j;
}

}  // namespace

std::string report_json(const std::map<std::string, std::string>& config, const sim_summary& s,
                        const std::map<std::string, double>& extra, const timeline* tl) {
  nlohmann::ordered_json j;
  j["config"] = config;
  j["requests"] = s.requests;
  j["completed"] = s.completed;
  j["failed"] = s.failed;
  j["ttft_ms"] = pct(s.ttft_ms);
  j["tbt_ms"] = pct(s.tbt_ms);
  j["tpot_ms"] = pct(s.tpot_ms);
  j["e2e_ms"] = pct(s.e2e_ms);
  j["slo_attainment"] = num(s.slo_attainment);
  j["cache_hit_ratio"] = num(s.cache_hit_ratio);
  j["span_s"] = num(s.span_s);
  j["output_tokens_per_s"] = num(s.output_tokens_per_s);
  j["requests_per_s"] = num(s.requests_per_s);
  j["failovers"] = s.failovers;
  j["prefill_requests"] = s.prefill_requests;
  j["decode_requests"] = s.decode_requests;
  j["errors"] = s.errors;
  for (const auto& [k, v] : extra) j[k] = num(v);
  if (tl) {
    auto& t = j["timeline"];
    t["interval_s"] = num(tl->interval_s);
    auto series = [](const std::vector<double>& v) {
      auto a = nlohmann::ordered_json::array();
      for (double x : v) a.push_back(num(x));
      return a;
    };
    for (const auto& r : tl->ranks) {
      auto& o = t["ranks"][r.rank];
      o["busy"] = series(r.busy);
      o["running"] = series(r.running);
      o["waiting"] = series(r.waiting);
      o["kv_used"] = series(r.kv_used);
    }
  }
  // Replace, not throw, on a string that is not UTF-8 (config values and ranks are the caller's).
  return j.dump(2, ' ', false, nlohmann::ordered_json::error_handler_t::replace) + "\n";
}

}  // namespace baton::sims
