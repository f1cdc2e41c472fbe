#pragma once

// SVG plots of a simulation run (issue 8): CDFs (TTFT, TBT) and series over time (throughput).
// Pure: numbers in, a standalone SVG document out; several series share one plot.

#include <string>
#include <utility>
#include <vector>

namespace baton::sims {

struct plot_series {
  std::string name;
  std::vector<std::pair<double, double>> points;  ///< (x, y), x ascending
};

/// The empirical CDF of `values` as a series (at most `max_points` points, evenly spaced in rank).
plot_series cdf_of(std::string name, std::vector<double> values, size_t max_points = 200);

/// A line plot; the x range ends at `x_max` when > 0 (a CDF cut at a tail, say), else at the data's.
std::string svg_plot(const std::string& title, const std::string& x_label, const std::string& y_label,
                     const std::vector<plot_series>& series, double x_max = 0);

}  // namespace baton::sims
