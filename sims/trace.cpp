#include "sims/trace.hpp"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <fstream>
#include <istream>
#include <limits>
#include <random>
#include <sstream>
#include <utility>

#include <nlohmann/json.hpp>

namespace baton::sims {

using nlohmann::json;

std::string trace_options::validate() const {
  if (!(rate_scale > 0) || !std::isfinite(rate_scale)) return "rate_scale must be > 0";
  if (window_start_s < 0 || window_s < 0 || !std::isfinite(window_start_s) || !std::isfinite(window_s))
    return "the time window must be >= 0";
  return {};
}

std::string synthetic_spec::validate() const {
  if (!(rate_per_s > 0) || !(duration_s > 0) || !(arrival_cv > 0)) return "rate, duration and arrival cv must be > 0";
  // The gaps are gamma with shape 1 / cv^2: an infinite cv, or one whose square overflows or
  // vanishes, makes the shape 0 or infinite and every gap NaN.
  if (const double sq = arrival_cv * arrival_cv; !std::isfinite(sq) || !std::isfinite(1.0 / sq))
    return "arrival_cv (--arrival-cv) must be finite, between about 1e-154 and 1e154 (the gaps' gamma shape is 1 / cv^2)";
  // The trace is held in memory: a rate of 1e12 ended in std::bad_alloc (or took all the RAM).
  constexpr double max_requests = 5e7;
  if (const double n = rate_per_s * duration_s * (1.0 + std::max(rate_swing, 0.0)); !(n <= max_requests))
    return "rate (--rate, scaled) x duration (--duration-s) makes about " + std::to_string(static_cast<uint64_t>(std::min(n, 1e19))) +
           " requests; a synthetic trace holds at most 50000000";
  for (const auto& [d, name] : {std::pair{&input, "input"}, std::pair{&output, "output"}}) {
    if (d->min == 0 || d->min > d->max || (d->kind != length_dist::uniform && !(d->mean > 0)) || !(d->cv >= 0))
      return "length distributions: need 1 <= min <= max, cv >= 0, and mean > 0 unless uniform";
    // An infinite cv, or one whose square overflows, makes the lognormal's sigma infinite and
    // every draw NaN.
    if (!std::isfinite(d->cv * d->cv))
      return std::string{name} + " cv must be finite, at most about 1e154 (the lognormal's sigma^2 is log(1 + cv^2))";
  }
  if (period_s < 0 || !(rate_swing >= 0 && rate_swing < 1)) return "a diurnal day needs period_s >= 0 and 0 <= rate_swing < 1";
  if (period_s > 0)
    for (const auto& [d, name] : {std::pair{&alt_input, "alt_input"}, std::pair{&alt_output, "alt_output"}}) {
      if (d->min == 0 || d->min > d->max || (d->kind != length_dist::uniform && !(d->mean > 0)) || !(d->cv >= 0))
        return "a diurnal day's alternative lengths: need 1 <= min <= max, cv >= 0, and mean > 0 unless uniform";
      if (!std::isfinite(d->cv * d->cv))
        return std::string{name} + " cv must be finite, at most about 1e154 (the lognormal's sigma^2 is log(1 + cv^2))";
    }
  return {};
}

double trace::span_s() const {
  if (requests.size() < 2) return 0;
  return static_cast<double>(requests.back().arrival_us - requests.front().arrival_us) / 1e6;
}

namespace {

/// One parsed line: arrival in seconds (absolute in the trace's own base) and the request.
struct parsed {
  double arrival_s = 0;
  trace_request r;
};

bool token_count(const json& j, const char* key, uint32_t* out, std::string* why) {
  auto it = j.find(key);
  if (it == j.end() || !it->is_number_integer() || it->get<int64_t>() < 0 ||
      it->get<int64_t>() > std::numeric_limits<uint32_t>::max()) {
    *why = std::string(key) + " must be a non-negative integer";
    return false;
  }
  *out = static_cast<uint32_t>(it->get<int64_t>());
  return true;
}

/// A prompt's length: at least one token. An empty prompt has nothing to prefill; it passed here
/// and failed the run ("prompt is empty") after any runs before it.
bool prompt_count(const json& j, const char* key, uint32_t* out, std::string* why) {
  if (!token_count(j, key, out, why)) return false;
  if (*out == 0) {
    *why = std::string(key) + " is 0: a request needs a prompt of at least one token";
    return false;
  }
  return true;
}

bool number(const json& j, const char* key, double* out, std::string* why) {
  auto it = j.find(key);
  if (it == j.end() || !it->is_number() || !std::isfinite(it->get<double>())) {
    *why = std::string(key) + " must be a number";
    return false;
  }
  *out = it->get<double>();
  return true;
}

bool parse_mooncake(const std::string& line, parsed* p, std::string* why) {
  auto j = json::parse(line, nullptr, false);
  if (j.is_discarded() || !j.is_object()) {
    *why = "not a JSON object";
    return false;
  }
  double ms = 0;
  if (!number(j, "timestamp", &ms, why) || !prompt_count(j, "input_length", &p->r.input_tokens, why) ||
      !token_count(j, "output_length", &p->r.output_tokens, why))
    return false;
  p->arrival_s = ms / 1000.0;
  auto ids = j.find("hash_ids");
  if (ids == j.end() || !ids->is_array()) {
    *why = "hash_ids must be an array of block ids";
    return false;
  }
  for (const auto& h : *ids) {
    if (!h.is_number_unsigned()) {
      *why = "hash_ids must hold non-negative integers";
      return false;
    }
    p->r.hash_ids.push_back(h.get<uint64_t>());
  }
  // One id per block of the prompt: fewer would turn a shared prefix into a unique one without
  // a word, more would describe tokens the prompt does not have.
  const size_t blocks = (size_t{p->r.input_tokens} + mooncake_block_tokens - 1) / mooncake_block_tokens;
  if (p->r.hash_ids.size() != blocks) {
    *why = "hash_ids has " + std::to_string(p->r.hash_ids.size()) + " ids, input_length " +
           std::to_string(p->r.input_tokens) + " needs " + std::to_string(blocks) + " (one per " +
           std::to_string(mooncake_block_tokens) + " tokens)";
    return false;
  }
  return true;
}

bool parse_vllm(const std::string& line, parsed* p, std::string* why) {
  auto j = json::parse(line, nullptr, false);
  if (j.is_discarded() || !j.is_object()) {
    *why = "not a JSON object";
    return false;
  }
  double queued = 0, first = 0, last = 0;
  if (!number(j, "arrival_time", &p->arrival_s, why) || !prompt_count(j, "input_toks", &p->r.input_tokens, why) ||
      !token_count(j, "output_toks", &p->r.output_tokens, why) || !number(j, "queued_ts", &queued, why) ||
      !number(j, "first_token_ts", &first, why) || !number(j, "last_token_ts", &last, why))
    return false;
  if (auto id = j.find("request_id"); id != j.end() && id->is_string()) p->r.id = id->get<std::string>();
  // The engine's own clock (README §3): TTFT from queueing, TPOT over the tokens after the first.
  p->r.measured_ttft_s = first - queued;
  p->r.measured_e2e_s = last - queued;
  if (p->r.output_tokens > 1) p->r.measured_tpot_s = (last - first) / (p->r.output_tokens - 1);
  return true;
}

/// Days since 1970-01-01 of a proleptic Gregorian date (H. Hinnant's days_from_civil).
int64_t days_from_civil(int64_t y, unsigned m, unsigned d) {
  y -= m <= 2;
  const int64_t era = (y >= 0 ? y : y - 399) / 400;
  const unsigned yoe = static_cast<unsigned>(y - era * 400);
  const unsigned doy = (153 * (m + (m > 2 ? -3 : 9)) + 2) / 5 + d - 1;
  const unsigned doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
  return era * 146097 + static_cast<int64_t>(doe) - 719468;
}

/// "2023-11-16 18:15:46.6805900" -> seconds since the epoch (naive, as the trace is).
bool azure_time(const std::string& t, double* out) {
  int y = 0;
  unsigned mo = 0, d = 0, h = 0, mi = 0;
  double s = 0;
  char tail = 0;
  if (std::sscanf(t.c_str(), "%4d-%2u-%2u %2u:%2u:%lf%c", &y, &mo, &d, &h, &mi, &s, &tail) != 6) return false;
  if (mo < 1 || mo > 12 || d < 1 || h > 23 || mi > 59 || !(s >= 0 && s < 61)) return false;
  static constexpr unsigned month_days[] = {31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31};
  const bool leap = (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
  if (d > month_days[mo - 1] + (mo == 2 && leap)) return false;  // 2023-02-31 is no date
  *out = static_cast<double>(days_from_civil(y, mo, d)) * 86400.0 + h * 3600.0 + mi * 60.0 + s;
  return true;
}

bool parse_azure(const std::string& line, parsed* p, std::string* why) {
  const auto c1 = line.find(',');
  const auto c2 = c1 == std::string::npos ? c1 : line.find(',', c1 + 1);
  if (c2 == std::string::npos || line.find(',', c2 + 1) != std::string::npos) {
    *why = "want TIMESTAMP,ContextTokens,GeneratedTokens";
    return false;
  }
  if (!azure_time(line.substr(0, c1), &p->arrival_s)) {
    *why = "bad timestamp '" + line.substr(0, std::min<size_t>(c1, 40)) + "'";
    return false;
  }
  // A count, spaces around it allowed (a trailing one was, a leading one was not); what is wrong
  // with it named, with its column.
  auto count = [&](size_t from, size_t to, uint32_t* out, const char* column) {
    std::string_view v(line.data() + from, to - from);
    while (!v.empty() && (v.back() == '\r' || v.back() == ' ')) v.remove_suffix(1);
    while (!v.empty() && v.front() == ' ') v.remove_prefix(1);
    const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), *out);
    if (ec == std::errc{} && end == v.data() + v.size() && !v.empty()) return true;
    *why = std::string{column} + " '" + std::string{v.substr(0, 24)} + "' " +
           (ec == std::errc::result_out_of_range ? "is more than 4294967295" : "is not a non-negative integer");
    return false;
  };
  if (!count(c1 + 1, c2, &p->r.input_tokens, "ContextTokens") ||
      !count(c2 + 1, line.size(), &p->r.output_tokens, "GeneratedTokens"))
    return false;
  if (p->r.input_tokens == 0) {
    *why = "ContextTokens is 0: a request needs a prompt of at least one token";
    return false;
  }
  return true;
}

}  // namespace

bool read_trace(std::istream& in, trace_format format, const std::string& source, const trace_options& opt,
                trace* out, std::string* why) {
  *out = trace{};
  if (auto e = opt.validate(); !e.empty()) {
    *why = source + ": " + e;
    return false;
  }
  std::vector<parsed> rows;
  std::string line;
  size_t number_of_line = 0;
  while (std::getline(in, line)) {
    ++number_of_line;
    // Blank lines (spaces, tabs, a CR) separate nothing: skipped, as empty ones are, rather than
    // refused as malformed rows.
    if (line.find_first_not_of(" \t\r\n\v\f") == std::string::npos) continue;
    // A UTF-8 byte-order mark (spreadsheets write one) is no part of the first field, in a CSV as
    // in JSONL.
    if (number_of_line == 1 && line.rfind("\xEF\xBB\xBF", 0) == 0) line.erase(0, 3);
    // The header row, in any letter case (a lowercase one was refused as a bad timestamp).
    if (format == trace_format::azure_csv && number_of_line == 1) {
      std::string head = line.substr(0, 9);
      for (auto& ch : head) ch = static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
      if (head == "TIMESTAMP") continue;
    }
    ++out->lines;
    parsed p;
    std::string what;
    const bool ok = format == trace_format::mooncake_jsonl ? parse_mooncake(line, &p, &what)
                    : format == trace_format::vllm_jsonl   ? parse_vllm(line, &p, &what)
                                                           : parse_azure(line, &p, &what);
    if (!ok) {
      const std::string where = source + ":" + std::to_string(number_of_line) + ": " + what;
      if (!opt.skip_malformed) {
        *why = where;
        return false;
      }
      if (out->skipped++ == 0) out->first_skipped = where;
      continue;
    }
    if (p.r.id.empty()) p.r.id = "line " + std::to_string(number_of_line);
    rows.push_back(std::move(p));
  }
  if (rows.empty()) {
    *why = source + ": no requests" + (out->skipped ? " (every line was malformed: " + out->first_skipped + ")" : std::string{});
    return false;
  }
  // Arrival order (the files are, but a merged or hand-made one need not be), then the window
  // on the original clock, then the rate scaling from the window's start.
  std::stable_sort(rows.begin(), rows.end(), [](const parsed& a, const parsed& b) { return a.arrival_s < b.arrival_s; });
  const double t0 = rows.front().arrival_s + opt.window_start_s;
  for (auto& p : rows) {
    const double since = p.arrival_s - t0;
    if (since < 0 || (opt.window_s > 0 && since >= opt.window_s)) continue;
    if (opt.max_requests && out->requests.size() >= opt.max_requests) break;
    // Microseconds in an int64 reach 292,000 years; a trace claiming more is malformed (found by
    // fuzzing: an absurd arrival time overflowed the conversion and broke the arrival order).
    const double us = since / opt.rate_scale * 1e6;
    if (!(us < 9.0e18)) {
      *why = source + ": request " + p.r.id + " arrives " + std::to_string(since) +
             " s after the first one: more than the 292,000 years a trace may span";
      out->requests.clear();
      return false;
    }
    p.r.arrival_us = static_cast<int64_t>(std::llround(us));
    // No output: a prefill-only request. It is replayed as one token, the first, which every
    // prefill samples anyway (max_tokens 0 would ask the runtime for all the context leaves),
    // and counted, so a run can say so.
    if (p.r.output_tokens == 0) {
      p.r.output_tokens = 1;
      ++out->zero_output_rows;
    }
    out->requests.push_back(std::move(p.r));
  }
  if (out->requests.empty()) {
    *why = source + ": no request falls in the window (" + std::to_string(opt.window_start_s) + " s from the first, " +
           (opt.window_s > 0 ? "for " + std::to_string(opt.window_s) + " s" : std::string{"to the end"}) + ")";
    return false;
  }
  return true;
}

std::optional<trace_format> format_of(const std::string& path) {
  auto ends = [&](const std::string& s) { return path.size() >= s.size() && path.compare(path.size() - s.size(), s.size(), s) == 0; };
  if (ends(".csv")) return trace_format::azure_csv;
  if (ends("_requests.jsonl")) return trace_format::vllm_jsonl;
  if (ends(".jsonl")) return trace_format::mooncake_jsonl;
  return std::nullopt;
}

bool load_trace(const std::string& path, const trace_options& opt, trace* out, std::string* why) {
  const auto fmt = format_of(path);
  if (!fmt) {
    *why = path + ": unknown trace format (want .jsonl: Mooncake, *_requests.jsonl: vLLM, .csv: Azure)";
    return false;
  }
  std::ifstream in(path);
  if (!in) {
    *why = path + ": cannot read it";
    return false;
  }
  // JSONL by its first row's fields where they tell: a Mooncake file named *_requests.jsonl was
  // read as a vLLM run ("arrival_time must be a number"), and the other way round. (Read whole
  // first, so a pipe serves as well as a file.)
  std::stringstream text;
  text << in.rdbuf();
  auto kind = *fmt;
  if (kind != trace_format::azure_csv) {
    const std::string& all = text.str();
    const size_t start = all.find_first_not_of(" \t\r\n\v\f");
    const std::string first = start == std::string::npos ? std::string{} : all.substr(start, all.find('\n', start) - start);
    if (first.find("\"input_length\"") != std::string::npos) kind = trace_format::mooncake_jsonl;
    else if (first.find("\"input_toks\"") != std::string::npos) kind = trace_format::vllm_jsonl;
  }
  return read_trace(text, kind, path, opt, out, why);
}

trace synthetic_trace(const synthetic_spec& spec) {
  trace out;
  std::mt19937_64 rng{spec.seed};
  // Inter-arrival times: exponential (cv 1) or gamma with shape 1/cv^2 (burstier for cv > 1),
  // mean 1/rate either way.
  const double shape = 1.0 / (spec.arrival_cv * spec.arrival_cv);
  // A diurnal day thins arrivals drawn at the peak rate (Lewis-Shedler): each is kept with
  // probability rate(t) / peak.
  const bool day = spec.period_s > 0;
  const double peak = spec.rate_per_s * (day ? 1.0 + spec.rate_swing : 1.0);
  std::gamma_distribution<double> gap{shape, 1.0 / (peak * shape)};
  std::uniform_real_distribution<double> coin{0.0, 1.0};
  constexpr double two_pi = 6.283185307179586;
  auto draw = [&](const length_dist& d) -> uint32_t {
    double v = d.mean;
    if (d.kind == length_dist::uniform) {
      v = std::uniform_real_distribution<double>{static_cast<double>(d.min), static_cast<double>(d.max) + 1.0}(rng);
    } else if (d.kind == length_dist::lognormal) {
      const double s2 = std::log(1.0 + d.cv * d.cv);  // the lognormal whose mean and cv are these
      v = std::lognormal_distribution<double>{std::log(d.mean) - s2 / 2, std::sqrt(s2)}(rng);
    }
    return static_cast<uint32_t>(std::clamp(std::floor(v), static_cast<double>(d.min), static_cast<double>(d.max)));
  };
  double t = 0;
  for (uint64_t i = 0;; ++i) {
    t += gap(rng);
    if (t >= spec.duration_s) break;
    bool alt = false;
    if (day) {
      const double phase = two_pi * t / spec.period_s;
      if (coin(rng) * peak > spec.rate_per_s * (1.0 + spec.rate_swing * std::sin(phase))) {
        --i;
        continue;
      }
      alt = coin(rng) < (1.0 - std::cos(phase)) / 2.0;
    }
    trace_request r;
    r.arrival_us = static_cast<int64_t>(std::llround(t * 1e6));
    r.input_tokens = draw(alt ? spec.alt_input : spec.input);
    r.output_tokens = draw(alt ? spec.alt_output : spec.output);
    r.id = "synthetic " + std::to_string(i);
    out.requests.push_back(std::move(r));
    ++out.lines;
  }
  if (!out.requests.empty()) {  // times from the first arrival, as for a file
    const auto first = out.requests.front().arrival_us;
    for (auto& r : out.requests) r.arrival_us -= first;
  }
  return out;
}

}  // namespace baton::sims
