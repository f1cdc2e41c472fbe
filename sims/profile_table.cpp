#include "sims/profile_table.hpp"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <sstream>

namespace baton::sims {

double measured_curve::at(double v) const {
  if (x.empty()) return 0.0;
  if (x.size() == 1) return y[0];
  // The segment holding v, or the first/last one to extrapolate from.
  size_t i = static_cast<size_t>(std::upper_bound(x.begin(), x.end(), v) - x.begin());
  i = std::clamp<size_t>(i, 1, x.size() - 1);
  const double t = (v - x[i - 1]) / (x[i] - x[i - 1]);
  return std::max(0.0, y[i - 1] + t * (y[i] - y[i - 1]));
}

namespace {

/// The numbers of a CSV line after `skip` text columns; false if one does not parse.
bool numbers(const std::string& line, size_t skip, std::vector<double>* out, std::vector<std::string>* text) {
  std::stringstream ss{line};
  std::string cell;
  out->clear();
  for (size_t col = 0; std::getline(ss, cell, ','); ++col) {
    if (col < skip) {
      text->push_back(cell);
      continue;
    }
    char* end = nullptr;
    const double v = std::strtod(cell.c_str(), &end);
    if (cell.empty() || end != cell.c_str() + cell.size() || !std::isfinite(v) || v < 0) return false;
    out->push_back(v);
  }
  return true;
}

/// Reads a table: each data line is `skip` text columns then `width` non-negative numbers.
bool read_table(const std::string& path, const std::string& header, size_t skip, size_t width,
                std::vector<std::pair<std::vector<std::string>, std::vector<double>>>* rows, std::string* why) {
  std::ifstream in{path};
  if (!in) {
    *why = path + ": cannot open (a profile needs _dense.csv, _attention.csv and _per_sequence.csv)";
    return false;
  }
  std::string line;
  size_t n = 0;
  while (std::getline(in, line)) {
    ++n;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (n == 1) {
      if (line != header) {
        *why = path + ":1: expected the header '" + header + "'";
        return false;
      }
      continue;
    }
    if (line.empty()) continue;
    std::vector<std::string> text;
    std::vector<double> v;
    if (!numbers(line, skip, &v, &text) || v.size() != width) {
      *why = path + ":" + std::to_string(n) + ": expected " + std::to_string(skip) + " name and " +
             std::to_string(width) + " non-negative numbers";
      return false;
    }
    rows->push_back({std::move(text), std::move(v)});
  }
  if (rows->empty()) {
    *why = path + ": no rows";
    return false;
  }
  return true;
}

/// Named curves from `name,x,time_us` rows.
std::map<std::string, measured_curve> curves(const std::vector<std::pair<std::vector<std::string>, std::vector<double>>>& rows) {
  std::map<std::string, std::map<double, double>> sorted;
  for (const auto& [text, v] : rows) sorted[text[0]][v[0]] = v[1];
  std::map<std::string, measured_curve> out;
  for (const auto& [name, points] : sorted)
    for (const auto& [x, y] : points) {
      out[name].x.push_back(x);
      out[name].y.push_back(y);
    }
  return out;
}

/// Interpolates linearly between the two measured keys around `v` (extrapolates from the last
/// two beyond either end), `at(child, v_rest)` evaluating each.
template <class Map, class F>
double between(const Map& m, double v, F&& at) {
  if (m.size() == 1) return at(m.begin()->second);
  auto hi = m.upper_bound(v);
  if (hi == m.begin()) ++hi;
  if (hi == m.end()) --hi;
  auto lo = std::prev(hi);
  const double t = (v - lo->first) / (hi->first - lo->first);
  return at(lo->second) + t * (at(hi->second) - at(lo->second));
}

}  // namespace

std::optional<profile_table> profile_table::load(const std::string& prefix, std::string* why) {
  profile_table t;
  t.source_ = prefix;
  std::vector<std::pair<std::vector<std::string>, std::vector<double>>> dense, attention, per_seq;
  if (!read_table(prefix + "_dense.csv", "layer,tokens,time_us", 1, 2, &dense, why) ||
      !read_table(prefix + "_attention.csv", "prefill_chunk,kv_prefill,n_decode,kv_decode,time_us", 0, 5, &attention, why) ||
      !read_table(prefix + "_per_sequence.csv", "layer,sequences,time_us", 1, 2, &per_seq, why))
    return std::nullopt;
  t.dense_ = curves(dense);
  t.per_seq_ = curves(per_seq);
  for (const char* op : {"embedding", "final_layernorm"})
    if (!t.dense_.count(op)) {
      *why = prefix + "_dense.csv: no '" + op + "' rows";
      return std::nullopt;
    }
  for (const char* op : {"lm_head", "sampler"})
    if (!t.per_seq_.count(op)) {
      *why = prefix + "_per_sequence.csv: no '" + op + "' rows";
      return std::nullopt;
    }
  std::map<double, std::map<double, std::map<double, std::map<double, double>>>> grid;
  for (const auto& [text, v] : attention) grid[v[0]][v[1]][v[2]][v[3]] = v[4];
  // A step needs decode-only rows (no prefill chunk) and prefill-only rows (no decodes).
  if (!grid.count(0) || grid.size() < 2 || !grid.rbegin()->second.begin()->second.count(0)) {
    *why = prefix + "_attention.csv: needs rows without a prefill chunk and rows of a chunk without decodes";
    return std::nullopt;
  }
  for (const auto& [p, by_kvp] : grid)
    for (const auto& [kvp, by_n] : by_kvp)
      for (const auto& [n, by_kvd] : by_n) {
        auto& c = t.attention_[p][kvp][n];
        for (const auto& [kvd, us] : by_kvd) {
          c.x.push_back(kvd);
          c.y.push_back(us);
        }
      }
  return t;
}

double profile_table::attention_us(double prefill_chunk, double kv_prefill, double n_decode, double kv_decode) const {
  // The profile's grid is not a full product (its axes interleave two series), so interpolate
  // one axis at a time over the values measured under the enclosing ones. Missing combinations
  // (e.g. 256 decodes beside a chunk) extrapolate from their neighbours.
  const double us = between(attention_, prefill_chunk, [&](const auto& by_kvp) {
    return between(by_kvp, kv_prefill, [&](const auto& by_n) {
      return between(by_n, n_decode, [&](const measured_curve& c) { return c.at(kv_decode); });
    });
  });
  return std::max(0.0, us);
}

double profile_table::step_us(const std::vector<step_seq>& seqs, uint32_t num_layers) const {
  double tokens = 0, chunk = 0, chunk_context = 0, decodes = 0, decode_context = 0;
  for (const auto& s : seqs) {
    tokens += s.tokens;
    if (s.tokens > 1) {
      chunk += s.tokens;
      chunk_context += static_cast<double>(s.tokens) * s.context;
    } else if (s.tokens == 1) {
      decodes += 1;
      decode_context += s.context + 1;  // the new token attends to itself too
    }
  }
  if (tokens == 0) return 0.0;
  double layer = attention_us(chunk, chunk > 0 ? chunk_context / chunk : 0.0, decodes,
                              decodes > 0 ? decode_context / decodes : 0.0);
  for (const auto& [op, curve] : dense_)
    if (op != "embedding" && op != "final_layernorm") layer += curve.at(tokens);
  const double n = static_cast<double>(seqs.size());
  return num_layers * layer + dense_.at("embedding").at(tokens) + dense_.at("final_layernorm").at(tokens) +
         per_seq_.at("lm_head").at(n) + per_seq_.at("sampler").at(n);
}

}  // namespace baton::sims
