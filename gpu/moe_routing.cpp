#include "gpu/moe_routing.hpp"

#include <algorithm>
#include <cmath>

#include "gpu/moe_topk.hpp"

namespace baton::gpu {

void moe_route(const model_config::moe_t& m, const float* logits, const float* bias, uint32_t* experts,
               float* weights, float* scratch) {
  const uint32_t n = m.n_routed_experts, k = m.num_experts_per_tok;
  float* scores = scratch;
  float* choice = scratch + n;
  float* group_score = scratch + 2 * n;
  // The method's names, compared once per token rather than per expert.
  const bool sigmoid = m.scoring == "sigmoid", noaux = m.topk_method == "noaux_tc", greedy = m.topk_method == "greedy";
  if (sigmoid) {
    for (uint32_t e = 0; e < n; ++e) scores[e] = 1.0f / (1.0f + std::exp(-logits[e]));
  } else {
    const float mx = *std::max_element(logits, logits + n);
    float sum = 0.0f;
    for (uint32_t e = 0; e < n; ++e) sum += scores[e] = std::exp(logits[e] - mx);
    for (uint32_t e = 0; e < n; ++e) scores[e] /= sum;
  }
  // The bias only steers the choice (V3's auxiliary-loss-free balancing); weights use the scores.
  for (uint32_t e = 0; e < n; ++e) choice[e] = scores[e] + (bias && noaux ? bias[e] : 0.0f);

  if (!greedy) {
    const uint32_t per = n / m.n_group;
    for (uint32_t g = 0; g < m.n_group; ++g) {
      const float* c = choice + g * per;
      if (noaux) {  // sum of the group's two best
        uint32_t two[2];
        top_k_indices(c, per, 2, two);
        group_score[g] = c[two[0]] + c[two[1]];
      } else {  // group_limited_greedy: the group's best
        group_score[g] = *std::max_element(c, c + per);
      }
    }
    uint32_t chosen[model_config::max_expert_groups];
    const uint32_t tg = m.topk_group;
    top_k_indices(group_score, m.n_group, tg, chosen);
    // Experts of groups not chosen score 0, not -inf, exactly as the reference implementations
    // mask them: with negative biased scores a masked expert can still win.
    for (uint32_t g = 0; g < m.n_group; ++g)
      if (std::find(chosen, chosen + tg, g) == chosen + tg) std::fill_n(choice + g * per, per, 0.0f);
  }
  top_k_indices(choice, n, k, experts);
  std::sort(experts, experts + k);
  float sum = 0.0f;
  for (uint32_t j = 0; j < k; ++j) sum += weights[j] = scores[experts[j]];
  for (uint32_t j = 0; j < k; ++j) {
    if (m.norm_topk_prob) weights[j] /= sum + 1e-20f;
    weights[j] *= m.routed_scaling_factor;
  }
}

}  // namespace baton::gpu
