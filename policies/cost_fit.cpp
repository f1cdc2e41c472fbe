#include "policies/cost_fit.hpp"

#include <algorithm>
#include <cmath>

namespace baton::policies {

std::optional<std::vector<double>> least_squares(const std::vector<std::vector<double>>& rows,
                                                 const std::vector<double>& y, const std::vector<double>& weights) {
  if (rows.empty()) return std::nullopt;
  const size_t n = rows.front().size();
  // A handful of cost terms; the bound also tells the compiler n + 1 cannot wrap.
  if (n == 0 || n > 64) return std::nullopt;
  // Columns are scaled to unit max magnitude first: q² and q·c are ~1e7 where q is ~1e3, and
  // unscaled normal equations would lose most of their digits.
  std::vector<double> scale(n, 0.0);
  for (const auto& r : rows)
    for (size_t j = 0; j < n; ++j) scale[j] = std::max(scale[j], std::abs(r[j]));
  for (auto& s : scale)
    if (s == 0.0) return std::nullopt;  // a column that is zero everywhere cannot be fitted
  std::vector<std::vector<double>> ata(n, std::vector<double>(n + 1, 0.0));
  for (size_t i = 0; i < rows.size(); ++i) {
    const double w2 = weights[i] * weights[i];
    for (size_t a = 0; a < n; ++a) {
      const double xa = rows[i][a] / scale[a];
      for (size_t b = 0; b < n; ++b) ata[a][b] += w2 * xa * rows[i][b] / scale[b];
      ata[a][n] += w2 * xa * y[i];
    }
  }
  double largest_pivot = 0.0;
  for (size_t k = 0; k < n; ++k) largest_pivot = std::max(largest_pivot, std::abs(ata[k][k]));
  for (size_t k = 0; k < n; ++k) {
    size_t p = k;
    for (size_t r = k + 1; r < n; ++r)
      if (std::abs(ata[r][k]) > std::abs(ata[p][k])) p = r;
    std::swap(ata[k], ata[p]);
    if (std::abs(ata[k][k]) <= 1e-12 * largest_pivot) return std::nullopt;
    for (size_t r = 0; r < n; ++r) {
      if (r == k) continue;
      const double f = ata[r][k] / ata[k][k];
      for (size_t c = k; c <= n; ++c) ata[r][c] -= f * ata[k][c];
    }
  }
  std::vector<double> x(n);
  for (size_t k = 0; k < n; ++k) x[k] = ata[k][n] / ata[k][k] / scale[k];
  return x;
}

namespace {

template <class Sample, class Row>
std::optional<std::vector<double>> fit_relative(const std::vector<Sample>& samples, Row row, size_t unknowns,
                                                std::string* why) {
  auto fail = [&](std::string s) -> std::optional<std::vector<double>> {
    if (why) *why = std::move(s);
    return std::nullopt;
  };
  if (samples.size() < unknowns)
    return fail("need at least " + std::to_string(unknowns) + " samples, got " + std::to_string(samples.size()));
  std::vector<std::vector<double>> rows;
  std::vector<double> y, w;
  for (const auto& s : samples) {
    if (!(s.us > 0.0) || !std::isfinite(s.us)) return fail("a sample has a non-positive or non-finite time");
    rows.push_back(row(s));
    y.push_back(s.us);
    w.push_back(1.0 / s.us);
  }
  auto x = least_squares(rows, y, w);
  if (!x) return fail("the samples do not determine every coefficient (vary each input across the grid)");
  return x;
}

template <class Model, class Sample, class Predict>
fit_error evaluate_with(const std::vector<Sample>& samples, Predict predict) {
  fit_error e;
  for (const auto& s : samples) {
    const double rel = std::abs(predict(s) - s.us) / s.us;
    e.mean_rel += rel;
    e.max_rel = std::max(e.max_rel, rel);
  }
  e.count = samples.size();
  if (e.count) e.mean_rel /= static_cast<double>(e.count);
  return e;
}

}  // namespace

std::optional<cost_model> fit_cost_model(const std::vector<prefill_sample>& samples, std::string* why) {
  auto x = fit_relative(
      samples,
      [](const prefill_sample& s) {
        const double q = static_cast<double>(s.q), c = static_cast<double>(s.c);
        return std::vector<double>{q * q, q * c, q, 1.0};
      },
      4, why);
  if (x && (*x)[3] >= 0.0) return cost_model{(*x)[0], (*x)[1], (*x)[2], (*x)[3]};
  auto y = fit_relative(
      samples,
      [](const prefill_sample& s) {
        const double q = static_cast<double>(s.q), c = static_cast<double>(s.c);
        return std::vector<double>{q * q, q * c, q};
      },
      3, why);
  if (!y) return std::nullopt;
  return cost_model{(*y)[0], (*y)[1], (*y)[2], 0.0};
}

std::optional<decode_cost_model> fit_decode_cost_model(const std::vector<decode_sample>& samples, std::string* why) {
  // Least squares may give a term a negative coefficient (noise over a narrow range of batch
  // sizes), and the model then predicts negative steps for large batches. A term that comes out
  // negative is dropped (held at 0) and the rest refitted: a small active-set solve.
  bool on[3] = {true, true, true};
  for (int round = 0; round < 3; ++round) {
    std::vector<int> terms;
    for (int i = 0; i < 3; ++i)
      if (on[i]) terms.push_back(i);
    auto x = fit_relative(
        samples,
        [&](const decode_sample& s) {
          const double all[3] = {1.0, static_cast<double>(s.num_seqs), static_cast<double>(s.context_tokens)};
          std::vector<double> row;
          for (int i : terms) row.push_back(all[i]);
          return row;
        },
        terms.size(), why);
    if (!x) return std::nullopt;
    double c[3] = {0, 0, 0};
    bool negative = false;
    for (size_t k = 0; k < terms.size(); ++k) {
      c[terms[k]] = (*x)[k];
      if ((*x)[k] < 0) on[terms[k]] = false, negative = true;
    }
    if (!negative) return decode_cost_model{c[0], c[1], c[2]};
    if (std::none_of(std::begin(on), std::end(on), [](bool b) { return b; })) break;
  }
  if (why) *why = "every decode term fits negative: the samples do not grow with batch or context";
  return std::nullopt;
}

fit_error evaluate(const cost_model& m, const std::vector<prefill_sample>& samples) {
  return evaluate_with<cost_model>(samples, [&](const prefill_sample& s) { return m.prefill_us(s.q, s.c); });
}

fit_error evaluate(const decode_cost_model& m, const std::vector<decode_sample>& samples) {
  return evaluate_with<decode_cost_model>(samples,
                                          [&](const decode_sample& s) { return m.step_us(s.num_seqs, s.context_tokens); });
}

}  // namespace baton::policies
