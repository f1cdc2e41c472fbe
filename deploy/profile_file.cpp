#include "deploy/profile_file.hpp"

#include <cmath>
#include <fstream>

#include <nlohmann/json.hpp>

namespace baton::deploy {

using nlohmann::json;

std::string write_profile(const std::string& path, const executor_profile& p) {
  json j;
  j["format"] = "baton-profile-1";
  j["executor"] = p.executor;
  j["model"] = p.model;
  j["machine"] = p.machine;
  j["date"] = p.date;
  j["prefill"] = {{"alpha_us", p.prefill.alpha_us},
                  {"beta_us", p.prefill.beta_us},
                  {"gamma_us", p.prefill.gamma_us},
                  {"delta_us", p.prefill.delta_us},
                  {"held_out_mean_rel_error", p.prefill_held_out.mean_rel},
                  {"held_out_max_rel_error", p.prefill_held_out.max_rel},
                  {"held_out_points", p.prefill_held_out.count}};
  j["decode"] = {{"step_base_us", p.decode.step_base_us},
                 {"per_seq_us", p.decode.per_seq_us},
                 {"per_context_token_us", p.decode.per_context_token_us},
                 {"held_out_mean_rel_error", p.decode_held_out.mean_rel},
                 {"held_out_max_rel_error", p.decode_held_out.max_rel},
                 {"held_out_points", p.decode_held_out.count}};
  j["prefill_samples"] = json::array();
  for (const auto& s : p.prefill_samples) j["prefill_samples"].push_back({{"q", s.q}, {"c", s.c}, {"us", s.us}});
  j["decode_samples"] = json::array();
  for (const auto& s : p.decode_samples)
    j["decode_samples"].push_back({{"num_seqs", s.num_seqs}, {"context_tokens", s.context_tokens}, {"us", s.us}});
  std::ofstream f{path};
  if (!f) return "cannot write profile file " + path;
  f << j.dump(2) << '\n';
  if (!f) return "error while writing profile file " + path;
  return {};
}

namespace {

bool read_profile_unchecked(const std::string& path, executor_profile* out, std::string* why) {
  std::ifstream f{path};
  if (!f) {
    *why = "profile file " + path + ": cannot open it";
    return false;
  }
  json j = json::parse(f, nullptr, /*allow_exceptions*/ false);
  if (j.is_discarded()) {
    *why = "profile file " + path + ": not valid JSON";
    return false;
  }
  // Whether section.key is there at all (optional fields are read only then).
  auto present = [&](const char* section, const char* key) {
    return j.contains(section) && j[section].is_object() && j[section].contains(key);
  };
  // Reads a required number; names the missing or mistyped key.
  auto number = [&](const json& obj, const char* section, const char* key, double* dst) {
    if (!present(section, key) || !obj[section][key].is_number()) {
      *why = "profile file " + path + ": missing or non-numeric " + section + "." + key;
      return false;
    }
    // Microseconds of one step at most 1e9 (a thousand seconds): 1e300 overflowed the sims'
    // integer durations (steps that took no time).
    const double x = obj[section][key].get<double>();
    if (!std::isfinite(x) || std::fabs(x) > 1e9) {
      *why = "profile file " + path + ": " + section + "." + key + " must be a number within +-1e9, got " +
             obj[section][key].dump();
      return false;
    }
    *dst = x;
    return true;
  };
  if (j.value("format", "") != "baton-profile-1") {
    *why = "profile file " + path + ": format is not baton-profile-1";
    return false;
  }
  executor_profile p;
  p.executor = j.value("executor", "");
  p.model = j.value("model", "");
  p.machine = j.value("machine", "");
  p.date = j.value("date", "");
  if (!number(j, "prefill", "alpha_us", &p.prefill.alpha_us) || !number(j, "prefill", "beta_us", &p.prefill.beta_us) ||
      !number(j, "prefill", "gamma_us", &p.prefill.gamma_us) ||
      !number(j, "prefill", "delta_us", &p.prefill.delta_us) ||
      !number(j, "decode", "step_base_us", &p.decode.step_base_us) ||
      !number(j, "decode", "per_seq_us", &p.decode.per_seq_us) ||
      !number(j, "decode", "per_context_token_us", &p.decode.per_context_token_us))
    return false;
  // The held-out errors are optional; given, they are numbers like the rest.
  for (auto [section, held] : {std::pair{"prefill", &p.prefill_held_out}, std::pair{"decode", &p.decode_held_out}}) {
    double points = 0;
    if ((present(section, "held_out_mean_rel_error") && !number(j, section, "held_out_mean_rel_error", &held->mean_rel)) ||
        (present(section, "held_out_max_rel_error") && !number(j, section, "held_out_max_rel_error", &held->max_rel)) ||
        (present(section, "held_out_points") && !number(j, section, "held_out_points", &points)))
      return false;
    if (points < 0 || points != std::floor(points)) {  // a cast of -1 or 1e30 to size_t is undefined
      *why = "profile file " + path + ": " + section + ".held_out_points must be a whole number >= 0";
      return false;
    }
    held->count = static_cast<size_t>(points);
  }
  if (j.contains("prefill_samples") && j["prefill_samples"].is_array())
    for (const auto& s : j["prefill_samples"])
      p.prefill_samples.push_back({s.value("q", uint64_t{0}), s.value("c", uint64_t{0}), s.value("us", 0.0)});
  if (j.contains("decode_samples") && j["decode_samples"].is_array())
    for (const auto& s : j["decode_samples"])
      p.decode_samples.push_back(
          {s.value("num_seqs", uint64_t{0}), s.value("context_tokens", uint64_t{0}), s.value("us", 0.0)});
  if (!p.prefill.usable()) {
    *why = "profile file " + path + ": prefill coefficients are not usable (need alpha, beta >= 0 and gamma > 0)";
    return false;
  }
  if (!p.decode.usable()) {
    *why = "profile file " + path + ": decode coefficients are not usable (need step_base_us, per_seq_us and "
           "per_context_token_us >= 0, not all 0): a negative term predicts negative steps for large batches";
    return false;
  }
  *out = std::move(p);
  return true;
}

}  // namespace

bool read_profile(const std::string& path, executor_profile* out, std::string* why) {
  // nlohmann throws on mistyped values inside the sample arrays; no exception leaves here.
  try {
    return read_profile_unchecked(path, out, why);
  } catch (const nlohmann::json::exception& e) {
    *why = "profile file " + path + ": " + e.what();
    return false;
  }
}

}  // namespace baton::deploy
