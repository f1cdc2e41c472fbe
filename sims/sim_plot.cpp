#include "sims/sim_plot.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>

namespace baton::sims {

plot_series cdf_of(std::string name, std::vector<double> values, size_t max_points) {
  plot_series s{std::move(name), {}};
  if (values.empty() || max_points < 2) return s;
  std::sort(values.begin(), values.end());
  const size_t n = values.size(), k = std::min(n, max_points);
  for (size_t i = 0; i < k; ++i) {
    const size_t at = k == 1 ? 0 : i * (n - 1) / (k - 1);
    s.points.push_back({values[at], static_cast<double>(at + 1) / static_cast<double>(n)});
  }
  return s;
}

namespace {

std::string fmt(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.6g", x);
  return buf;
}

std::string escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '<') out += "&lt;";
    else if (c == '>') out += "&gt;";
    else if (c == '&') out += "&amp;";
    else out += c;
  }
  return out;
}

}  // namespace

std::string svg_plot(const std::string& title, const std::string& x_label, const std::string& y_label,
                     const std::vector<plot_series>& series, double x_max) {
  constexpr double w = 640, h = 400, left = 70, right = 20, top = 40, bottom = 50;
  double xmax = x_max, ymax = 0;
  for (const auto& s : series)
    for (const auto& [x, y] : s.points) {
      if (x_max <= 0) xmax = std::max(xmax, x);
      ymax = std::max(ymax, y);
    }
  if (xmax <= 0) xmax = 1;
  if (ymax <= 0) ymax = 1;
  auto px = [&](double x) { return left + std::min(x, xmax) / xmax * (w - left - right); };
  auto py = [&](double y) { return h - bottom - y / ymax * (h - top - bottom); };
  static const char* colours[] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b"};
  std::ostringstream o;
  o << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << w << "\" height=\"" << h << "\" font-family=\"sans-serif\" "
    << "font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
    << "<text x=\"" << w / 2 << "\" y=\"22\" text-anchor=\"middle\" font-size=\"14\">" << escape(title) << "</text>\n";
  // Axes with five ticks each.
  o << "<line x1=\"" << left << "\" y1=\"" << h - bottom << "\" x2=\"" << w - right << "\" y2=\"" << h - bottom
    << "\" stroke=\"black\"/>\n<line x1=\"" << left << "\" y1=\"" << top << "\" x2=\"" << left << "\" y2=\"" << h - bottom
    << "\" stroke=\"black\"/>\n";
  for (int i = 0; i <= 5; ++i) {
    const double xv = xmax * i / 5, yv = ymax * i / 5;
    o << "<text x=\"" << fmt(px(xv)) << "\" y=\"" << h - bottom + 16 << "\" text-anchor=\"middle\">" << fmt(xv) << "</text>\n"
      << "<text x=\"" << left - 6 << "\" y=\"" << fmt(py(yv) + 4) << "\" text-anchor=\"end\">" << fmt(yv) << "</text>\n";
  }
  o << "<text x=\"" << (left + w - right) / 2 << "\" y=\"" << h - 12 << "\" text-anchor=\"middle\">" << escape(x_label)
    << "</text>\n<text x=\"16\" y=\"" << (top + h - bottom) / 2 << "\" text-anchor=\"middle\" transform=\"rotate(-90 16 "
    << (top + h - bottom) / 2 << ")\">" << escape(y_label) << "</text>\n";
  for (size_t i = 0; i < series.size(); ++i) {
    const auto* colour = colours[i % 6];
    o << "<polyline fill=\"none\" stroke=\"" << colour << "\" stroke-width=\"1.5\" points=\"";
    for (const auto& [x, y] : series[i].points) o << fmt(px(x)) << "," << fmt(py(y)) << " ";
    o << "\"/>\n<text x=\"" << w - right - 8 << "\" y=\"" << top + 16 * (i + 1) << "\" text-anchor=\"end\" fill=\"" << colour
      << "\">" << escape(series[i].name) << "</text>\n";
  }
  o << "</svg>\n";
  return o.str();
}

}  // namespace baton::sims
