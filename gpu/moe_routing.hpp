#pragma once

// DeepSeek's expert routing, as a pure function of one token's router logits: which experts
// serve the token and with what weights. The CPU executor runs it per token; expert parallelism
// (dispatch) and EPLB's activation counts read the same choices.

#include <cstdint>

#include "gpu/model_config.hpp"

namespace baton::gpu {

/// Routes one token. `logits` holds n_routed_experts fp32 router outputs; `bias` the V3 score
/// correction bias (null: none). Writes num_experts_per_tok expert ids to `experts`, in
/// ascending order (so a token's experts are always summed in the same order), and each one's
/// weight to `weights`. `scratch` holds 2 * n_routed_experts + n_group floats.
///
/// Ties between equal scores go to the lower expert (or group) id, so the choice is
/// deterministic on every machine.
void moe_route(const model_config::moe_t& moe, const float* logits, const float* bias, uint32_t* experts,
               float* weights, float* scratch);

}  // namespace baton::gpu
