// DeepSeek-V2/V3 on the CPU executor: multi-head latent attention over a latent KV cache, the
// families' expert routing, and their checkpoints. The executor's absorbed attention is checked
// against a naive reference written here the way transformers computes it (per-head K and V
// expanded from the latent, transformers' rotary form, double accumulation); the comparison with
// transformers itself uses files made by scripts/hf_reference.py on a machine with torch.

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <numeric>

#include <unistd.h>

#include <nlohmann/json.hpp>

#include "gpu/cpu_executor.hpp"
#include "gpu/cuda_executor.hpp"
#include "transport/all_to_all.hpp"
#include "gpu/expert_parallel.hpp"
#include "gpu/hf_export.hpp"
#include "gpu/hf_model.hpp"
#include "gpu/local_generate.hpp"
#include "gpu/moe_routing.hpp"
#include "gpu/safetensors.hpp"
#include "policies/eplb.hpp"
#include "tests/test_util.hpp"

using namespace baton;
using namespace baton::gpu;

namespace {

using vec = std::vector<double>;

/// y[r] = W x[r] for W [out][in] row-major, in double.
std::vector<vec> linear(const std::vector<vec>& x, const std::vector<float>& w, size_t out) {
  std::vector<vec> y(x.size(), vec(out));
  const size_t in = x.empty() ? 0 : x[0].size();
  for (size_t r = 0; r < x.size(); ++r)
    for (size_t o = 0; o < out; ++o) {
      double s = 0;
      for (size_t i = 0; i < in; ++i) s += w[o * in + i] * x[r][i];
      y[r][o] = s;
    }
  return y;
}

vec rms(const vec& x, const std::vector<float>& w, double eps) {
  double ss = 0;
  for (double v : x) ss += v * v;
  const double inv = 1.0 / std::sqrt(ss / x.size() + eps);
  vec y(x.size());
  for (size_t i = 0; i < x.size(); ++i) y[i] = w[i] * x[i] * inv;
  return y;
}

/// RoPE as transformers sets it up, in double: inverse frequencies (default or YaRN), the factor
/// cos and sin are scaled by, and the softmax scale (with DeepSeek's YaRN mscale squared).
struct rope_ref {
  vec inv_freq;
  double factor = 1, softmax_scale = 1;
};

rope_ref make_rope_ref(const model_config& c) {
  rope_ref r;
  const size_t d = c.mla.qk_rope_head_dim;
  const double base = c.rope_theta;
  const auto& y = c.rope_scaling;
  auto mscale = [](double s, double m) { return s <= 1 ? 1.0 : 0.1 * m * std::log(s) + 1; };
  r.softmax_scale = 1 / std::sqrt(double(c.mla.qk_nope_head_dim + c.mla.qk_rope_head_dim));
  for (size_t i = 0; i < d / 2; ++i) r.inv_freq.push_back(1 / std::pow(base, double(2 * i) / d));
  if (y.type != "yarn") return r;
  auto corr = [&](double rot) { return d * std::log(y.original_max_position_embeddings / (rot * 2 * M_PI)) / (2 * std::log(base)); };
  const double lo = std::max(std::floor(corr(y.beta_fast)), 0.0), hi = std::min(std::ceil(corr(y.beta_slow)), double(d - 1));
  for (size_t i = 0; i < d / 2; ++i) {
    const double keep = 1 - std::clamp((i - lo) / (hi - lo), 0.0, 1.0);  // 1: the original frequency
    r.inv_freq[i] = r.inv_freq[i] / y.factor * (1 - keep) + r.inv_freq[i] * keep;
  }
  r.factor = mscale(y.factor, y.mscale) / mscale(y.factor, y.mscale_all_dim);
  r.softmax_scale *= mscale(y.factor, y.mscale_all_dim) * mscale(y.factor, y.mscale_all_dim);
  return r;
}

/// transformers' DeepSeek-V3 rotary form: de-interleave (x0 x2 .. x1 x3 ..), then rotate halves.
vec rotary(const vec& x, uint32_t pos, const rope_ref& rr) {
  const size_t d = x.size(), half = d / 2;
  vec y(d), out(d);
  for (size_t i = 0; i < half; ++i) {
    y[i] = x[2 * i];
    y[i + half] = x[2 * i + 1];
  }
  for (size_t i = 0; i < half; ++i) {
    const double a = pos * rr.inv_freq[i];
    out[i] = (y[i] * std::cos(a) - y[i + half] * std::sin(a)) * rr.factor;
    out[i + half] = (y[i + half] * std::cos(a) + y[i] * std::sin(a)) * rr.factor;
  }
  return out;
}

vec swiglu_mlp(const vec& x, const std::vector<float>& g, const std::vector<float>& u, const std::vector<float>& dn,
               size_t f) {
  auto gv = linear({x}, g, f)[0], uv = linear({x}, u, f)[0];
  vec a(f);
  for (size_t i = 0; i < f; ++i) a[i] = gv[i] / (1 + std::exp(-gv[i])) * uv[i];
  return linear({a}, dn, x.size())[0];
}

/// Indices of the k largest, ties to the lower index.
std::vector<size_t> largest(const vec& v, size_t k) {
  std::vector<size_t> idx(v.size());
  std::iota(idx.begin(), idx.end(), 0);
  std::stable_sort(idx.begin(), idx.end(), [&](size_t a, size_t b) { return v[a] > v[b]; });
  idx.resize(k);
  return idx;
}

/// The routed experts' weighted sum for one token, as transformers routes.
vec routed(const model_config& c, const layer_weights& lw, const vec& x) {
  const auto& m = c.moe;
  const size_t n = m.n_routed_experts;
  auto logits = linear({x}, lw.router, n)[0];
  vec score(n);
  if (m.scoring == "sigmoid") {
    for (size_t e = 0; e < n; ++e) score[e] = 1 / (1 + std::exp(-logits[e]));
  } else {
    const double mx = *std::max_element(logits.begin(), logits.end());
    double s = 0;
    for (size_t e = 0; e < n; ++e) s += score[e] = std::exp(logits[e] - mx);
    for (auto& v : score) v /= s;
  }
  vec choice = score;
  if (!lw.router_bias.empty())
    for (size_t e = 0; e < n; ++e) choice[e] += lw.router_bias[e];
  if (m.topk_method != "greedy") {
    const size_t per = n / m.n_group;
    vec group(m.n_group);
    for (size_t g = 0; g < m.n_group; ++g) {
      vec part(choice.begin() + g * per, choice.begin() + (g + 1) * per);
      auto best = largest(part, 2);
      group[g] = m.topk_method == "noaux_tc" ? part[best[0]] + part[best[1]] : part[best[0]];
    }
    auto keep = largest(group, m.topk_group);
    for (size_t e = 0; e < n; ++e)
      if (std::find(keep.begin(), keep.end(), e / per) == keep.end()) choice[e] = 0;
  }
  auto top = largest(choice, m.num_experts_per_tok);
  double sum = 0;
  for (auto e : top) sum += score[e];
  vec y(x.size(), 0.0);
  for (auto e : top) {
    double wgt = score[e] * (m.norm_topk_prob ? 1 / (sum + 1e-20) : 1) * m.routed_scaling_factor;
    auto out = swiglu_mlp(x, lw.experts[e].gate, lw.experts[e].up, lw.experts[e].down, m.moe_intermediate_size);
    for (size_t i = 0; i < y.size(); ++i) y[i] += wgt * out[i];
  }
  return y;
}

/// Logits at every position of `tokens`, recomputed from scratch with expanded per-head K and V.
std::vector<vec> naive_logits(const model_config& c, const model_weights& w, const std::vector<int32_t>& tokens) {
  const size_t T = tokens.size(), h = c.hidden_size, H = c.num_attention_heads;
  const auto& m = c.mla;
  const size_t qk = m.qk_nope_head_dim + m.qk_rope_head_dim, kvb = m.qk_nope_head_dim + m.v_head_dim;
  const auto rr = make_rope_ref(c);
  std::vector<vec> x(T, vec(h));
  for (size_t t = 0; t < T; ++t)
    for (size_t i = 0; i < h; ++i) x[t][i] = w.embed[tokens[t] * h + i];
  for (uint32_t l = 0; l < c.num_hidden_layers; ++l) {
    const auto& lw = w.layers[l];
    std::vector<vec> hn(T);
    for (size_t t = 0; t < T; ++t) hn[t] = rms(x[t], lw.attn_norm, c.rms_norm_eps);
    std::vector<vec> q;
    if (m.q_lora_rank) {
      auto qa = linear(hn, lw.wq_a, m.q_lora_rank);
      for (auto& r : qa) r = rms(r, lw.q_a_norm, 1e-6);
      q = linear(qa, lw.wq_b, H * qk);
    } else {
      q = linear(hn, lw.wq, H * qk);
    }
    auto ckv = linear(hn, lw.wkv_a, m.kv_lora_rank + m.qk_rope_head_dim);
    std::vector<vec> latent(T), k_pe(T);
    for (size_t t = 0; t < T; ++t) {
      latent[t] = rms(vec(ckv[t].begin(), ckv[t].begin() + m.kv_lora_rank), lw.kv_a_norm, 1e-6);
      k_pe[t] = rotary(vec(ckv[t].begin() + m.kv_lora_rank, ckv[t].end()), t, rr);
    }
    auto kv = linear(latent, lw.wkv_b, H * kvb);  // per head: k_nope then v
    std::vector<vec> attn(T, vec(H * m.v_head_dim));
    for (size_t t = 0; t < T; ++t)
      for (size_t hd = 0; hd < H; ++hd) {
        const double* qh = q[t].data() + hd * qk;
        auto q_pe = rotary(vec(qh + m.qk_nope_head_dim, qh + qk), t, rr);
        vec s(t + 1);
        double mx = -1e300;
        for (size_t u = 0; u <= t; ++u) {
          double d = 0;
          for (size_t i = 0; i < m.qk_nope_head_dim; ++i) d += qh[i] * kv[u][hd * kvb + i];
          for (size_t i = 0; i < m.qk_rope_head_dim; ++i) d += q_pe[i] * k_pe[u][i];
          s[u] = d * rr.softmax_scale;
          mx = std::max(mx, s[u]);
        }
        double z = 0;
        for (auto& v : s) z += v = std::exp(v - mx);
        for (size_t u = 0; u <= t; ++u)
          for (size_t i = 0; i < m.v_head_dim; ++i)
            attn[t][hd * m.v_head_dim + i] += s[u] / z * kv[u][hd * kvb + m.qk_nope_head_dim + i];
      }
    auto o = linear(attn, lw.wo, h);
    for (size_t t = 0; t < T; ++t)
      for (size_t i = 0; i < h; ++i) x[t][i] += o[t][i];
    for (size_t t = 0; t < T; ++t) {
      auto hm = rms(x[t], lw.mlp_norm, c.rms_norm_eps);
      vec y = c.is_moe_layer(l) ? routed(c, lw, hm) : vec(h, 0.0);
      if (const size_t f = c.mlp_intermediate(l)) {
        auto dense = swiglu_mlp(hm, lw.w_gate, lw.w_up, lw.w_down, f);
        for (size_t i = 0; i < h; ++i) y[i] += dense[i];
      }
      for (size_t i = 0; i < h; ++i) x[t][i] += y[i];
    }
  }
  const auto& head = w.lm_head.empty() ? w.embed : w.lm_head;
  std::vector<vec> out;
  for (size_t t = 0; t < T; ++t) out.push_back(linear({rms(x[t], w.final_norm, c.rms_norm_eps)}, head, c.vocab_size)[0]);
  return out;
}

}  // namespace

TEST_CASE("MoE routing: softmax top-k, V2 group-limited and V3 noaux_tc choices and weights, ties to the lower id") {
  uint32_t experts[4];
  float weights[4], scratch[64];
  model_config::moe_t m;
  m.n_routed_experts = 8;
  m.num_experts_per_tok = 2;
  m.moe_intermediate_size = 4;
  const float logits[8] = {0.1f, 2.0f, -1.0f, 0.5f, 2.0f, 1.5f, 0.0f, -3.0f};
  SUBCASE("softmax greedy: the two largest (the tie at 2.0 keeps both), softmax weights, ascending ids") {
    moe_route(m, logits, nullptr, experts, weights, scratch);
    CHECK(experts[0] == 1);
    CHECK(experts[1] == 4);
    double z = 0;
    for (float l : logits) z += std::exp(l - 2.0);
    CHECK(weights[0] == doctest::Approx(1.0 / z).epsilon(1e-6));
    CHECK(weights[1] == doctest::Approx(1.0 / z).epsilon(1e-6));
    m.num_experts_per_tok = 1;  // a tie for one place goes to the lower id
    moe_route(m, logits, nullptr, experts, weights, scratch);
    CHECK(experts[0] == 1);
  }
  SUBCASE("group_limited_greedy: groups ranked by their best expert, the rest masked") {
    m.topk_method = "group_limited_greedy";
    m.n_group = 4;  // groups {0,1} {2,3} {4,5} {6,7}: best 2.0, 0.5, 2.0, 0.0
    m.topk_group = 1;
    m.routed_scaling_factor = 2.0f;
    moe_route(m, logits, nullptr, experts, weights, scratch);
    CHECK(experts[0] == 0);  // group 0 wins the tie with group 2: experts 1 and 0
    CHECK(experts[1] == 1);
    double z = 0;
    for (float l : logits) z += std::exp(l - 2.0);
    CHECK(weights[1] == doctest::Approx(2.0 / z).epsilon(1e-6));  // scaled, not renormalised
  }
  SUBCASE("noaux_tc: the bias steers the choice, the unbiased sigmoid scores weigh, renormalised and scaled") {
    m.scoring = "sigmoid";
    m.topk_method = "noaux_tc";
    m.n_group = 4;
    m.topk_group = 2;
    m.norm_topk_prob = true;
    m.routed_scaling_factor = 2.5f;
    // The bias lifts expert 6 (group 3) over experts 1 and 4 and sinks group 0.
    const float bias[8] = {-1.0f, -1.0f, 0.0f, 0.0f, 0.0f, 0.0f, 1.0f, 0.0f};
    moe_route(m, logits, bias, experts, weights, scratch);
    // Group scores (top-2 sums of biased scores): g0 low, g1 0.27+0.62, g2 0.88+0.82, g3 1.5+0.05.
    CHECK(experts[0] == 4);
    CHECK(experts[1] == 6);
    auto sig = [](double x) { return 1 / (1 + std::exp(-x)); };
    const double s4 = sig(2.0), s6 = sig(0.0);
    CHECK(weights[0] == doctest::Approx(2.5 * s4 / (s4 + s6)).epsilon(1e-6));
    CHECK(weights[1] == doctest::Approx(2.5 * s6 / (s4 + s6)).epsilon(1e-6));
  }
  SUBCASE("noaux_tc masks other groups' experts to 0, not -inf: one can beat negative biased scores") {
    m.scoring = "sigmoid";
    m.topk_method = "noaux_tc";
    m.n_group = 4;
    m.topk_group = 1;
    m.num_experts_per_tok = 3;
    const float bias[8] = {-5, -5, -5, -5, -5, -5, 0, 0};  // only group 3 stays positive
    moe_route(m, logits, bias, experts, weights, scratch);
    // Group 3 is chosen (experts 6 and 7 positive); the third place is a masked expert at 0,
    // the lowest id among them: expert 0.
    CHECK(experts[0] == 0);
    CHECK(experts[1] == 6);
    CHECK(experts[2] == 7);
  }
}

/// The tiny shape with YaRN as DeepSeek's checkpoints configure it (scaled down to its context):
/// an attention factor other than 1 and the softmax's mscale squared both in play.
model_config with_yarn(model_config c) {
  c.rope_scaling.type = "yarn";
  c.rope_scaling.factor = 4.0f;
  c.rope_scaling.original_max_position_embeddings = 64;
  c.rope_scaling.mscale = 1.0f;
  c.rope_scaling.mscale_all_dim = 0.707f;
  return c;
}

TEST_CASE("MLA and MoE: the executor's absorbed latent attention matches a naive expanded reference for "
          "DeepSeek-V2 and V3 shapes, with and without YaRN, and the cache holds the latent, one plane") {
  for (int variant = 0; variant < 4; ++variant) {
    const bool v3 = variant % 2, yarn = variant >= 2;
    CAPTURE(v3);
    CAPTURE(yarn);
    const auto cfg = yarn ? with_yarn(deepseek_tiny_config(v3)) : deepseek_tiny_config(v3);
    REQUIRE(cfg.validate().empty());
    auto w = std::make_shared<model_weights>(make_seeded_weights(cfg, 7));
    auto exec = make_cpu_executor(cfg, w, {});
    CHECK(exec->kv().layout().planes == 1);
    CHECK(exec->kv().layout().kv_dim == cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim);
    std::vector<int32_t> tokens;
    for (int i = 0; i < 40; ++i) tokens.push_back((i * 37 + 11) % 256);
    const auto ref = naive_logits(cfg, *w, tokens);
    auto pages = *exec->kv().kv_page_alloc(exec->kv().pages_for_tokens(40));
    // A 24-token prefill chunk, then one token per step: both kinds of row.
    std::vector<int32_t> first(tokens.begin(), tokens.begin() + 24);
    auto out = run_blocking(*exec, {1, {{1, first, 0, pages, true}}});
    REQUIRE(out.error.empty());
    std::vector<std::vector<float>> got{out.logits[0]};
    for (uint32_t pos = 24; pos < 40; ++pos) {
      out = run_blocking(*exec, {pos, {{1, {tokens[pos]}, pos, pages, true}}});
      REQUIRE(out.error.empty());
      got.push_back(out.logits[0]);
    }
    for (size_t i = 0; i < got.size(); ++i) {
      const auto& r = ref[23 + i];
      double max_abs = 0, max_diff = 0;
      for (size_t k = 0; k < r.size(); ++k) {
        max_abs = std::max(max_abs, std::abs(r[k]));
        max_diff = std::max(max_diff, std::abs(got[i][k] - r[k]));
      }
      CHECK_MESSAGE(max_diff <= 1e-4 * max_abs, "position " << 23 + i << ": max |diff| " << max_diff);
    }
    exec->kv().kv_page_free(pages);
  }
}

TEST_CASE("MLA and MoE keep the executor's invariants: chunked prefill equals token-by-token decoding and a "
          "sequence's numbers do not depend on its batch (bit for bit)") {
  for (bool v3 : {false, true}) {
    CAPTURE(v3);
    const auto cfg = deepseek_tiny_config(v3);
    auto w = std::make_shared<model_weights>(make_seeded_weights(cfg, 11));
    auto exec = make_cpu_executor(cfg, w, {});
    std::vector<int32_t> a, b;
    for (int i = 0; i < 30; ++i) a.push_back((i * 53 + 7) % 256), b.push_back((i * 29 + 101) % 256);
    const auto chunked = generate_colocated(*exec, a, 6, 16, {}, true);
    const auto stepwise = generate_colocated(*exec, a, 6, 1, {}, true);
    REQUIRE(chunked.error.empty());
    CHECK(chunked.tokens == stepwise.tokens);
    CHECK(test::same_bits(chunked.step_logits, stepwise.step_logits));
    // a and b in one job (their rows share expert batches) against each alone.
    auto& kv = exec->kv();
    auto pa = *kv.kv_page_alloc(kv.pages_for_tokens(30)), pb = *kv.kv_page_alloc(kv.pages_for_tokens(30));
    auto together = run_blocking(*exec, {1, {{1, a, 0, pa, true}, {2, b, 0, pb, true}}});
    auto alone_b = run_blocking(*exec, {2, {{2, b, 0, pb, true}}});
    auto alone_a = run_blocking(*exec, {3, {{1, a, 0, pa, true}}});
    REQUIRE(together.error.empty());
    CHECK(test::same_bits(together.logits[0], alone_a.logits[0]));
    CHECK(test::same_bits(together.logits[1], alone_b.logits[0]));
    kv.kv_page_free(pa);
    kv.kv_page_free(pb);
  }
}

namespace {

/// The library's config.json for `c`, as JSON to edit.
nlohmann::json deepseek_config_json(const model_config& c) {
  std::string why;
  const auto text = hf_config_json(c, &why);
  REQUIRE_MESSAGE(!text.empty(), why);
  return nlohmann::json::parse(text);
}

/// Seeded DeepSeek weights under transformers' tensor names; experts one tensor each, or fused.
std::vector<st_write_tensor> deepseek_tensors(const model_config& c, const model_weights& w, bool fused) {
  return hf_tensors(c, w, {.fused_experts = fused});
}

std::string fresh_dir(const std::string& name) {
  auto d = std::filesystem::temp_directory_path() / ("baton-ds-" + name + "-" + std::to_string(::getpid()));
  std::filesystem::remove_all(d);
  std::filesystem::create_directories(d);
  return d.string();
}

}  // namespace

TEST_CASE("YaRN RoPE from config.json: DeepSeek-V3's settings give the interpolated frequencies, attention factor 1 "
          "and the softmax scaled by mscale squared") {
  auto j = deepseek_config_json(deepseek_tiny_config(true));
  j["rope_parameters"] = {{"rope_type", "yarn"},  {"rope_theta", 10000.0}, {"factor", 40.0},
                          {"original_max_position_embeddings", 64}, {"beta_fast", 32.0}, {"beta_slow", 1.0},
                          {"mscale", 1.0}, {"mscale_all_dim", 1.0}};
  model_config c;
  std::string why;
  REQUIRE_MESSAGE(parse_hf_config(j.dump(), "config.json", &c, &why), why);
  CHECK(c.rope_scaling.type == "yarn");
  const auto f = rope_inv_freq(c);
  const auto ref = make_rope_ref(c);
  REQUIRE(f.size() == ref.inv_freq.size());
  for (size_t i = 0; i < f.size(); ++i) CHECK(f[i] == doctest::Approx(ref.inv_freq[i]).epsilon(1e-5));
  CHECK(f[0] == doctest::Approx(1.0).epsilon(1e-6));                    // fast dimensions keep theirs
  CHECK(f.back() == doctest::Approx(ref.inv_freq.back()).epsilon(1e-6));  // slow ones interpolated
  CHECK(f.back() < 1.0 / std::pow(10000.0, 14.0 / 16) / 39);
  CHECK(rope_attention_factor(c) == 1.0f);
  const double m = 0.1 * std::log(40.0) + 1;
  CHECK(attention_softmax_scale(c) == doctest::Approx(m * m / std::sqrt(48.0)).epsilon(1e-6));
  j["rope_parameters"].erase("original_max_position_embeddings");
  CHECK_FALSE(parse_hf_config(j.dump(), "config.json", &c, &why));
  CHECK_MESSAGE(why.find("yarn needs original_max_position_embeddings") != std::string::npos, why);
  j["rope_parameters"] = {{"rope_type", "longrope"}, {"rope_theta", 10000.0}};
  CHECK_FALSE(parse_hf_config(j.dump(), "config.json", &c, &why));
  CHECK_MESSAGE(why.find("type longrope is not supported (llama3 and yarn are)") != std::string::npos, why);
  // A model card's rope_scaling added to a config whose RoPE transformers 5 wrote in
  // rope_parameters: its settings count (they were ignored), as transformers 5 reads them.
  j["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 10000.0}};
  j["rope_scaling"] = {{"type", "yarn"}, {"factor", 40.0}, {"original_max_position_embeddings", 64}, {"beta_fast", 32.0},
                       {"beta_slow", 1.0}, {"mscale", 1.0}, {"mscale_all_dim", 1.0}};
  REQUIRE_MESSAGE(parse_hf_config(j.dump(), "config.json", &c, &why), why);
  CHECK(c.rope_scaling.type == "yarn");
  CHECK(rope_inv_freq(c).back() == doctest::Approx(ref.inv_freq.back()).epsilon(1e-6));
  j["rope_scaling"] = {{"type", "linear"}, {"factor", 2.0}};
  CHECK_FALSE(parse_hf_config(j.dump(), "config.json", &c, &why));
  CHECK_MESSAGE(why.find("type linear is not supported") != std::string::npos, why);
}

TEST_CASE("config.json: DeepSeek-V2 and V3 fields, transformers' defaults and family rules, and clear refusals") {
  model_config c;
  std::string why;
  auto v3 = deepseek_config_json(deepseek_tiny_config(true));
  REQUIRE_MESSAGE(parse_hf_config(v3.dump(), "config.json", &c, &why), why);
  CHECK(c.is_mla());
  CHECK(c.kv_dim() == 64 + 16);
  CHECK(c.kv_planes() == 1);
  CHECK(c.head_dim == 16);
  CHECK(c.mla.q_lora_rank == 48);
  CHECK(c.moe.scoring == "sigmoid");
  CHECK(c.moe.topk_method == "noaux_tc");
  CHECK(c.moe.n_group == 4);
  CHECK(c.is_moe_layer(1));
  CHECK_FALSE(c.is_moe_layer(0));
  auto v2 = deepseek_config_json(deepseek_tiny_config(false));
  v2["norm_topk_prob"] = false;  // as the published V2 checkpoints say
  REQUIRE_MESSAGE(parse_hf_config(v2.dump(), "config.json", &c, &why), why);
  CHECK(c.mla.q_lora_rank == 0);  // null: q_proj
  CHECK(c.moe.scoring == "softmax");
  CHECK_FALSE(c.moe.norm_topk_prob);
  auto dense = v2;
  dense["n_routed_experts"] = nullptr;
  REQUIRE_MESSAGE(parse_hf_config(dense.dump(), "config.json", &c, &why), why);
  CHECK_FALSE(c.is_moe_layer(2));

  auto refused = [&](nlohmann::json j, const std::string& expect) {
    CAPTURE(expect);
    CHECK_FALSE(parse_hf_config(j.dump(), "config.json", &c, &why));
    CHECK_MESSAGE(why.find(expect) != std::string::npos, why);
  };
  auto j = v2;
  j["moe_layer_freq"] = 2;
  refused(j, "moe_layer_freq 2 is not supported");
  j = v2;
  j["topk_method"] = "noaux_tc";
  refused(j, "topk_method noaux_tc is not one DeepSeek-V2 defines");
  // transformers' V2 ignores it, vLLM renormalises: the two answer differently, so refused.
  j = v2;
  j["norm_topk_prob"] = true;
  refused(j, "norm_topk_prob true is not supported for DeepSeek-V2");
  j = v3;
  j["attention_bias"] = true;
  refused(j, "attention_bias is not supported for DeepSeek");
  j = v3;
  j["n_group"] = 3;
  refused(j, "n_group (3) must divide n_routed_experts (8)");
  j = v3;
  j["num_experts_per_tok"] = 9;
  refused(j, "num_experts_per_tok must be in [1, n_routed_experts (8)]");
  j = v3;
  j["qk_rope_head_dim"] = 15;
  refused(j, "head_dim must be even");
  j = v3;
  j["kv_lora_rank"] = -4;
  refused(j, "kv_lora_rank must be a positive integer");
  j = v3;
  j["hidden_act"] = "gelu";
  refused(j, "hidden_act \"gelu\" is not supported (silu is)");
}

TEST_CASE("a DeepSeek model directory (experts one tensor each, or fused as transformers 5 holds them) loads to "
          "bit-identical logits; a missing expert is named") {
  for (bool v3 : {false, true})
    for (bool fused : {false, true}) {
      CAPTURE(v3);
      CAPTURE(fused);
      const auto cfg = deepseek_tiny_config(v3);
      auto w = std::make_shared<model_weights>(make_seeded_weights(cfg, 5));
      const auto dir = fresh_dir(std::string{v3 ? "v3" : "v2"} + (fused ? "f" : "s"));
      std::ofstream{dir + "/config.json"} << deepseek_config_json(cfg).dump();
      auto tensors = deepseek_tensors(cfg, *w, fused);
      REQUIRE(write_safetensors(dir + "/model.safetensors", tensors).empty());
      hf_model m;
      std::string why;
      REQUIRE_MESSAGE(load_hf_model(dir, &m, &why), why);
      auto seeded = make_cpu_executor(cfg, w, {});
      auto loaded = make_cpu_executor(m.config, m.weights, {});
      const std::vector<int32_t> prompt{72, 101, 108, 108, 111, 44, 32, 77, 76, 65};
      const auto a = generate_colocated(*seeded, prompt, 4, 16, {}, true);
      const auto b = generate_colocated(*loaded, prompt, 4, 16, {}, true);
      REQUIRE(b.error.empty());
      CHECK(a.tokens == b.tokens);
      CHECK(test::same_bits(a.step_logits, b.step_logits));
      if (!fused) {
        std::erase_if(tensors, [](const st_write_tensor& t) { return t.name == "model.layers.2.mlp.experts.5.up_proj.weight"; });
        REQUIRE(write_safetensors(dir + "/model.safetensors", tensors).empty());
        CHECK_FALSE(load_hf_model(dir, &m, &why));
        CHECK_MESSAGE(why.find("missing tensor model.layers.2.mlp.experts.5.up_proj.weight") != std::string::npos, why);
      }
      std::filesystem::remove_all(dir);
    }
}

TEST_CASE("seeded weights drawn with an expert filter are the whole draw's for the kept experts, bit for bit, and "
          "empty for the others; everything after the experts is drawn the same") {
  const auto cfg = deepseek_tiny_config(true);
  const auto whole = make_seeded_weights(cfg, 9);
  const expert_filter odd = [](const model_config&, uint32_t layer, uint32_t e) { return (e + layer) % 2 == 1; };
  const auto part = make_seeded_weights(cfg, 9, odd);
  for (uint32_t l = 0; l < cfg.num_hidden_layers; ++l) {
    CAPTURE(l);
    CHECK(test::same_bits(part.layers[l].wo, whole.layers[l].wo));  // drawn after an earlier layer's experts
    CHECK(test::same_bits(part.layers[l].router, whole.layers[l].router));
    REQUIRE(part.layers[l].experts.size() == whole.layers[l].experts.size());
    for (uint32_t e = 0; e < part.layers[l].experts.size(); ++e) {
      const bool kept = (e + l) % 2 == 1;
      CHECK(test::same_bits(part.layers[l].experts[e].down, kept ? whole.layers[l].experts[e].down : std::vector<float>{}));
      CHECK(test::same_bits(part.layers[l].experts[e].gate, kept ? whole.layers[l].experts[e].gate : std::vector<float>{}));
    }
  }
  CHECK(test::same_bits(part.lm_head, whole.lm_head));  // drawn last
  CHECK(test::same_bits(part.final_norm, whole.final_norm));
}

TEST_CASE("an expert-filtered load keeps only the chosen routed experts, bit for bit, and reads nothing else of "
          "theirs; a damaged expert it skips is still refused by name") {
  for (bool fused : {false, true}) {
    CAPTURE(fused);
    const auto cfg = deepseek_tiny_config(true);
    const auto w = make_seeded_weights(cfg, 9);
    const auto dir = fresh_dir(std::string{"filter"} + (fused ? "f" : "s"));
    REQUIRE(save_hf_model(dir, cfg, w, {.fused_experts = fused}).empty());
    // Member 1 of 2's block, as an expert-parallel node of data-parallel attention loads it.
    uint32_t asked = 0;
    const expert_filter block_1 = [&](const model_config& c, uint32_t, uint32_t e) {
      ++asked;
      return policies::block_owner(e, 2, c.moe.n_routed_experts) == 1;
    };
    hf_model m;
    std::string why;
    REQUIRE_MESSAGE(load_hf_model(dir, &m, &why, block_1), why);
    uint32_t moe_layers = 0;
    for (uint32_t l = 0; l < cfg.num_hidden_layers; ++l) {
      const auto& got = m.weights->layers[l];
      CHECK(got.router == w.layers[l].router);  // everything but the other experts is whole
      CHECK(got.wkv_b == w.layers[l].wkv_b);
      if (!cfg.is_moe_layer(l)) continue;
      ++moe_layers;
      REQUIRE(got.experts.size() == cfg.moe.n_routed_experts);
      for (uint32_t e = 0; e < cfg.moe.n_routed_experts; ++e) {
        CAPTURE(e);
        const bool mine = policies::block_owner(e, 2, cfg.moe.n_routed_experts) == 1;
        CHECK(test::same_bits(got.experts[e].gate, mine ? w.layers[l].experts[e].gate : std::vector<float>{}));
        CHECK(test::same_bits(got.experts[e].up, mine ? w.layers[l].experts[e].up : std::vector<float>{}));
        CHECK(test::same_bits(got.experts[e].down, mine ? w.layers[l].experts[e].down : std::vector<float>{}));
      }
    }
    CHECK(asked == moe_layers * cfg.moe.n_routed_experts);
    CHECK(held_experts(cfg, *m.weights, cfg.moe.first_k_dense_replace).size() == cfg.moe.n_routed_experts / 2);
    // A skipped expert with a wrong shape: refused all the same, so every process of a group
    // agrees on whether the checkpoint is sound.
    auto tensors = hf_tensors(cfg, w, {.fused_experts = fused});
    const std::string bad = fused ? "model.layers.1.mlp.experts.down_proj" : "model.layers.1.mlp.experts.0.down_proj.weight";
    auto it = std::find_if(tensors.begin(), tensors.end(), [&](const st_write_tensor& t) { return t.name == bad; });
    REQUIRE(it != tensors.end());
    it->shape.back() -= 1;
    it->values.resize(it->values.size() / (it->shape.back() + 1) * it->shape.back());
    REQUIRE(write_safetensors(dir + "/model.safetensors", tensors).empty());
    CHECK_FALSE(load_hf_model(dir, &m, &why, block_1));
    CHECK_MESSAGE(why.find("tensor " + bad + " has shape") != std::string::npos, why);
    std::filesystem::remove_all(dir);
  }
}

TEST_CASE("the CUDA executor refuses a DeepSeek shape its kernels cannot take, naming the field, before it looks "
          "for a device; and expert parallelism on it, naming why") {
  auto big = deepseek_tiny_config(true);
  big.moe.n_routed_experts = 1024;  // past the routing kernel's 512
  big.moe.n_group = 8;
  std::string why;
  CHECK(make_cuda_executor(big, nullptr, {.random_weights_seed = 1}, &why) == nullptr);
#ifdef BATON_HAVE_CUDA
  CHECK_MESSAGE(why.find("n_routed_experts 1024 is beyond the CUDA kernels' 512") != std::string::npos, why);
  auto wide = deepseek_tiny_config(false);
  wide.mla.kv_lora_rank = 2048;
  CHECK(make_cuda_executor(wide, nullptr, {.random_weights_seed = 1}, &why) == nullptr);
  CHECK_MESSAGE(why.find("kv_lora_rank 2048") != std::string::npos, why);
#else
  CHECK_MESSAGE(why.find("this build has no CUDA backend") != std::string::npos, why);
#endif
  // Expert parallelism's dispatch is the CPU executor's: a CUDA rank in a group refuses its jobs.
  const auto cfg = deepseek_tiny_config(true);
  cpu_executor_config pool;
  pool.peers = nullptr;
  pool.experts = std::make_shared<expert_group>(nullptr, nullptr, 2);
  auto exec = make_backend_executor({.kind = "cuda"}, cfg, std::make_shared<const model_weights>(make_seeded_weights(cfg, 3)), pool);
  const auto out = run_blocking(*exec, {1, {{1, {1, 2}, 0, *exec->kv().kv_page_alloc(1), true}}});
  CHECK_MESSAGE(out.error.find("expert parallelism runs on the CPU executor only so far") != std::string::npos, out.error);
}
