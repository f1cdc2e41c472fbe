#pragma once

// Expert parallelism of one engine (seed 000 §3.3), in its attention-lead form: the process that
// owns the executor (EP rank 0) runs attention and the dense layers; the routed experts of every
// MoE layer are split in contiguous blocks over `size` EP ranks, itself included, the others
// expert shards in their own processes. Per MoE layer the lead packs the tokens bound for each
// rank's experts together and one all-to-all (transport/all_to_all) dispatches them; each rank
// runs its experts over what it received, and a second all-to-all combines the outputs back. The
// lead weighs and sums them per token in ascending expert order, exactly as without EP, and the
// fixed-order kernels make an expert's output for a row independent of the other rows it ran
// with: tokens and logits are bit-identical for every EP size.
//
// Wire format of a dispatch chunk: {u32 kind, u32 layer, u32 count}, then `count` entries of
// {u32 expert, f32 x[hidden]}; the answer is `count` rows of f32 y[hidden], in entry order.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "gpu/model_config.hpp"
#include "gpu/weights.hpp"

namespace baton::transport {
class transport;
class all_to_all;
}  // namespace baton::transport

namespace baton::gpu {

/// The experts' outputs for one dispatch chunk (any EP rank runs this on what it received).
/// False and a sentence when the chunk is malformed or names an expert this model lacks.
bool serve_expert_chunk(const model_config& cfg, const model_weights& w, std::span<const std::byte> chunk,
                        std::vector<std::byte>* out, std::string* why);

/// EP rank 0's side: owned by the executor, one per engine.
class expert_group {
public:
  /// `a2a` is rank 0 of a connected group of `a2a`'s size, over `t` (kept alive here).
  expert_group(std::unique_ptr<transport::transport> t, std::unique_ptr<transport::all_to_all> a2a, uint32_t size);
  /// Tells the shards to exit.
  ~expert_group();
  expert_group(const expert_group&) = delete;
  expert_group& operator=(const expert_group&) = delete;

  uint32_t size() const { return size_; }
  /// The EP rank holding `expert` (contiguous blocks).
  uint32_t owner(uint32_t expert, uint32_t num_experts) const {
    return static_cast<uint32_t>(uint64_t{expert} * size_ / num_experts);
  }
  /// One MoE layer: entries[d] (expert id and row, packed as above without the header) go to EP
  /// rank d; outputs[d] come back in entry order. Rank 0's own share is served here.
  bool round(const model_config& cfg, const model_weights& w, uint32_t layer,
             const std::vector<std::vector<std::byte>>& entries, std::vector<std::vector<std::byte>>* outputs,
             std::string* why);

private:
  std::unique_ptr<transport::transport> t_;
  std::unique_ptr<transport::all_to_all> a2a_;
  uint32_t size_;
};

/// An expert shard's loop (EP rank > 0): serves rank 0's dispatches until rank 0 says stop
/// (returns true) or the group fails (false, with the reason).
bool run_expert_shard(const model_config& cfg, const model_weights& w, transport::all_to_all& a2a, std::string* why);

/// The dispatch slot an EP group needs for jobs of up to `max_rows` rows: every row's top-k
/// copies bound for one rank, plus the header (the combine answer is never larger).
uint64_t expert_slot_bytes(const model_config& cfg, uint64_t max_rows);

}  // namespace baton::gpu
