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
// Between rounds the lead also sends weights (live EPLB): an install chunk carries a piece of one
// expert's gate, up and down matrices, {u32 kind, u32 layer, u32 expert, u32 0, u64 offset,
// u64 total} then floats; an evict chunk {kind, layer, count} then `count` u32 experts to drop;
// an idle chunk is a header alone. Shards answer each with an empty chunk.

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <mutex>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "gpu/model_config.hpp"
#include "gpu/weights.hpp"
#include "policies/eplb.hpp"
#include "transport/transport.hpp"

namespace baton::transport {
class all_to_all;
}  // namespace baton::transport

namespace baton::gpu {

/// The experts' outputs for one dispatch chunk (any EP rank runs this on what it received).
/// False and a sentence when the chunk is malformed or names an expert this model lacks.
bool serve_expert_chunk(const model_config& cfg, const model_weights& w, std::span<const std::byte> chunk,
                        std::vector<std::byte>* out, std::string* why);

/// Live EPLB for an expert group: every `interval_rounds` MoE rounds, each layer's placement is
/// re-planned (policies::plan_eplb) from the copies its experts received since the last plan.
/// A shard holds the weights of the experts placed on it and no others (its contiguous block at
/// start, `slots_per_rank` per layer under a plan). Between rounds, make before break: the lead
/// sends each shard the experts it newly holds, the new placement applies, then the shards drop
/// the experts it no longer places there. Tokens never change (placement decides where an
/// expert runs, not which experts a token uses). The lead (EP rank 0) runs attention and keeps
/// the whole model, so it is the source of every expert's weights.
struct live_eplb_config {
  uint32_t slots_per_rank = 0;     ///< 0: EPLB off (contiguous blocks)
  uint32_t interval_rounds = 64;   ///< MoE rounds (layer passes) between plans
};

/// EP rank 0's side: owned by the executor, one per engine.
class expert_group {
public:
  /// `a2a` is rank 0 of a connected group of `a2a`'s size, over `t` (kept alive here). With a
  /// second group `b` over the same ranks, rounds run as dual-batch overlap (round_dual).
  expert_group(std::unique_ptr<transport::transport> t, std::unique_ptr<transport::all_to_all> a2a, uint32_t size,
               std::unique_ptr<transport::all_to_all> b = nullptr);
  bool dual_batch() const { return b_ != nullptr; }
  /// Tells the shards to exit.
  ~expert_group();
  /// Where the shards are processes: `gone(rank)` says why that rank's shard will never answer
  /// (its process exited), else nothing. An exchange waiting for it then fails at once with the
  /// reason, instead of at the timeout with none. Called from the executor's thread while it waits.
  void watch_shards(std::function<std::string(uint32_t rank)> gone);
  /// Looks at every shard as a waiting exchange would (an abort word, watch_shards' verdict)
  /// without an exchange: an idle engine notices a dead shard before a request finds out. True
  /// when failure() is set. Called from the executor's thread only, as exchanges are.
  bool check_shards();
  /// Non-empty once a shard is known to be out for good (it failed, or its process ended), saying
  /// which and how: no round can run any more. Thread-safe (ranks ask between jobs).
  std::string failure() const;
  expert_group(const expert_group&) = delete;
  expert_group& operator=(const expert_group&) = delete;

  uint32_t size() const { return size_; }
  /// The EP rank holding `expert` in contiguous blocks (the placement before any EPLB plan).
  uint32_t owner(uint32_t expert, uint32_t num_experts) const {
    return policies::block_owner(expert, size_, num_experts);
  }
  /// Turns live EPLB on for a model with `num_experts` routed experts (validated against the
  /// group: a slot budget that cannot hold every expert is refused with a sentence).
  bool enable_eplb(const live_eplb_config& cfg, uint32_t num_experts, std::string* why);
  /// The EP rank that runs this copy of `expert` in MoE layer `layer` (counted for EPLB): under a
  /// plan, one of its copies chosen by `copy_hash`; else its block's owner.
  uint32_t route(uint32_t layer, uint32_t expert, uint32_t num_experts, uint64_t copy_hash);
  /// Copies each EP rank received since the last call (the load EPLB evens out), then zeroed.
  std::vector<uint64_t> take_rank_copies();
  uint64_t plans() const { return plans_; }
  /// Weights moved to shards by EPLB plans so far (bytes), and experts dropped.
  uint64_t bytes_installed() const { return bytes_installed_; }
  uint64_t experts_evicted() const { return experts_evicted_; }
  /// One MoE layer: entries[d] (expert id and row, packed as above without the header) go to EP
  /// rank d; outputs[d] come back in entry order. Rank 0's own share is served here.
  bool round(const model_config& cfg, const model_weights& w, uint32_t layer,
             const std::vector<std::vector<std::byte>>& entries, std::vector<std::vector<std::byte>>* outputs,
             std::string* why);
  /// Dual-batch overlap (needs dual_batch()): two micro-batches' rounds interleaved on two
  /// channels, so one's dispatch or combine travels while the other's experts compute, here and
  /// on the shards. Outputs as round() gives them, per micro-batch.
  bool round_dual(const model_config& cfg, const model_weights& w, uint32_t layer,
                  const std::vector<std::vector<std::byte>>& entries_a, const std::vector<std::vector<std::byte>>& entries_b,
                  std::vector<std::vector<std::byte>>* outputs_a, std::vector<std::vector<std::byte>>* outputs_b,
                  std::string* why);
  /// round_dual in three steps, so the caller computes between them (DeepSeek's decode schedule:
  /// micro-batch B's attention runs while A's dispatch travels, A's next attention while B's
  /// combine does): post_dual_a starts A's dispatch; exchange_dual starts B's, runs both
  /// micro-batches' experts and returns A's outputs; finish_dual returns B's. Called in that
  /// order, once each, per MoE layer.
  bool post_dual_a(const model_config& cfg, uint32_t layer, std::vector<std::vector<std::byte>> entries_a,
                   std::string* why);
  bool exchange_dual(const model_config& cfg, const model_weights& w, std::vector<std::vector<std::byte>> entries_b,
                     std::vector<std::vector<std::byte>>* outputs_a, std::string* why);
  bool finish_dual(const model_config& cfg, const model_weights& w, std::vector<std::vector<std::byte>>* outputs_b,
                   std::string* why);
  /// Rounds a caller ran in three steps (post_dual_a), not through round_dual.
  uint64_t split_rounds() const { return split_rounds_; }

private:
  /// post_dual_a, uncounted (round_dual's first step).
  bool dual_begin(const model_config& cfg, uint32_t layer, std::vector<std::vector<std::byte>> entries_a,
                  std::string* why);
  bool replan(const model_config& cfg, const model_weights& w, std::string* why);
  bool after_round(const model_config& cfg, const model_weights& w, std::string* why);
  /// Sends each EP rank d its chunk (an idle one when empty) and waits for the empty answers.
  bool control(const std::vector<std::vector<std::byte>>& chunks, std::string* why);
  /// A round failed part-way (`why` says where): the lead and its shards are out of step (an
  /// exchange may still be open, a shard waiting in one), so the group is broken for good. The
  /// rank is told (failure(): it steps aside, and the keeper starts new shards) and the shards
  /// stop waiting (the channels' abort words). False, for the caller to return.
  bool lost(std::string* why);

  std::unique_ptr<transport::transport> t_;
  std::unique_ptr<transport::all_to_all> a2a_;
  std::unique_ptr<transport::all_to_all> b_;  ///< the second micro-batch's channel (dual-batch overlap)
  uint32_t size_;
  live_eplb_config eplb_;
  std::vector<std::vector<double>> counts_;              ///< [layer][expert]: copies since the last plan
  std::vector<policies::expert_placement> placement_;    ///< [layer]; empty until the first plan
  std::vector<uint64_t> rank_copies_;
  uint64_t rounds_ = 0, plans_ = 0, bytes_installed_ = 0, experts_evicted_ = 0;
  uint32_t dual_layer_ = 0;                              ///< the open dual round's layer
  std::vector<std::vector<std::byte>> dual_a_, dual_b_;  ///< its entries, until their outputs are back
  uint64_t split_rounds_ = 0;
  /// The verdict on shard `s` as channel `c` waits for it (see watch_shards); sets failure_.
  std::string judge(transport::all_to_all& c, uint32_t s);
  std::function<std::string(uint32_t)> gone_;  ///< watch_shards' verdict (executor thread only)
  std::string failure_;              ///< failure(): a shard out for good
  mutable std::mutex failure_mutex_;  ///< failure_ is read by ranks from other threads
};

/// An expert shard's loop (EP rank > 0): serves rank 0's dispatches until rank 0 says stop
/// (returns true) or the group fails (false, with the reason). With `b` (dual-batch overlap, as
/// rank 0's group has it), each layer's second micro-batch comes on `b` and its dispatch travels
/// while the first one's experts compute. It first drops from `w` every routed expert outside
/// its contiguous block, then installs and drops experts as the lead's EPLB plans say: `w` holds
/// exactly the experts placed on this rank (the others' matrices empty).
bool run_expert_shard(const model_config& cfg, model_weights& w, transport::all_to_all& a2a, std::string* why,
                      transport::all_to_all* b = nullptr);
/// Drops from `w` every routed expert outside EP rank `rank`'s contiguous block of `size`.
void keep_expert_block(const model_config& cfg, model_weights& w, uint32_t rank, uint32_t size);
/// The routed experts `w` holds weights for in MoE layer `layer`, ascending.
std::vector<uint32_t> held_experts(const model_config& cfg, const model_weights& w, uint32_t layer);

/// Data-parallel attention (seed 000 §3.3; how DeepSeek decodes with wide EP): every member of
/// the group is a whole engine with its own requests, KV pool and attention, and serves the
/// routed experts placed on it (its contiguous block of each MoE layer; under live EPLB, what the
/// plan gives it) for all of them. Per MoE layer every member sends the copies of its rows to the
/// members serving their experts, serves what the others sent it, and gets its outputs back: two
/// all-to-alls in which every member takes part. So members run in lockstep: a step is one round
/// per MoE layer, and a member with no work of its own -- idle, or its forward failed midway --
/// still takes its part in each round of a step a peer started (join(), which the executor runs
/// while idle and after every forward). Tokens and logits equal EP 1's bit for bit.
/// One member's handle; the group's transports outlive every member (make_peer_group).
class expert_peers {
public:
  struct shared;
  expert_peers(std::shared_ptr<shared> group, uint32_t rank, const model_config& cfg);
  ~expert_peers();
  expert_peers(const expert_peers&) = delete;
  expert_peers& operator=(const expert_peers&) = delete;

  uint32_t rank() const { return rank_; }
  uint32_t size() const;
  /// The member serving `expert` before any EPLB plan (contiguous blocks, as expert_group::owner).
  uint32_t owner(uint32_t expert, uint32_t num_experts) const {
    return policies::block_owner(expert, size(), num_experts);
  }
  /// Copies this member's contiguous block of every MoE layer's routed experts out of `w`: the
  /// experts it serves (the routed experts of the executor's own weights are never read, so a
  /// caller may drop them from `w` afterwards). Before the first step.
  void hold_block(const model_config& cfg, const model_weights& w);
  /// hold_block, moving the block's experts out of `w` instead of copying them: a process that
  /// loaded only its members' blocks never holds them twice.
  void take_block(const model_config& cfg, model_weights& w);
  /// Live EPLB for the group (every member the same config, before the first step): every
  /// `interval_rounds` MoE rounds, at the end of a step, the members swap their copy counts, each
  /// computes the same plan (policies::plan_eplb over the sums), the experts each member newly
  /// holds come from a current holder, the placement switches, then each drops what it no longer
  /// holds. Refused with a sentence when the slot budget cannot hold the experts.
  bool enable_eplb(const live_eplb_config& cfg, uint32_t num_experts, std::string* why);
  /// The member serving this copy of `expert` in MoE layer `layer` (counted for EPLB): under a
  /// plan one of its copies chosen by `copy_hash`, else its block's owner.
  uint32_t route(uint32_t layer, uint32_t expert, uint32_t num_experts, uint64_t copy_hash);
  /// This member's round of MoE layer `layer` (the step's next MoE layer): entries[d] go to
  /// member d, outputs[d] come back in entry order, and what the others sent this member is
  /// served meanwhile. False and a sentence naming the group, the layer and the peer.
  bool round(const model_config& cfg, uint32_t layer, const std::vector<std::vector<std::byte>>& entries,
             std::vector<std::vector<std::byte>>* outputs, std::string* why);
  /// Dual-batch overlap (the group was made with it): two micro-batches' rounds on two channels,
  /// B's dispatch travelling while A's experts run here and on every member, A's combine while
  /// B's run. Every member runs every round this way.
  bool dual_batch() const;
  bool round_dual(const model_config& cfg, uint32_t layer, const std::vector<std::vector<std::byte>>& entries_a,
                  const std::vector<std::vector<std::byte>>& entries_b, std::vector<std::vector<std::byte>>* outputs_a,
                  std::vector<std::vector<std::byte>>* outputs_b, std::string* why);
  /// round_dual in three steps, as expert_group's (the executor computes between them). When
  /// exchange_dual fails, the round is over (finish_dual is not called): the group broke, or
  /// this member's rows did not fit a slot, which fails the job alone.
  bool post_dual_a(const model_config& cfg, uint32_t layer, std::vector<std::vector<std::byte>> entries_a,
                   std::string* why);
  bool exchange_dual(const model_config& cfg, std::vector<std::vector<std::byte>> entries_b,
                     std::vector<std::vector<std::byte>>* outputs_a, std::string* why);
  bool finish_dual(const model_config& cfg, std::vector<std::vector<std::byte>>* outputs_b, std::string* why);
  /// Rounds this member ran in three steps (post_dual_a), not through round_dual or join.
  uint64_t split_rounds() const { return split_rounds_; }
  /// Takes part, with no rows of its own, in the rest of the current step, or in a whole step a
  /// peer has started; nothing when neither. Runs on the executor's thread.
  bool join(const model_config& cfg, std::string* why);
  /// While idle, between joins: sleeps up to `d`, ending early when a peer starts a step (its
  /// doorbell), nudge() is called, or `ready` says so (the executor's job thread idles here).
  void doze(std::chrono::microseconds d, const std::function<bool()>& ready);
  /// Ends a doze now (a job came). Any thread.
  void nudge();
  /// This member stops taking part: the others' next steps fail at once, naming it, instead of
  /// waiting out the all-to-all's timeout.
  void leave();
  /// Non-empty once this member can take part in no step: it stopped, it fell out of step, or
  /// another member did either (seen by flags in this process, by abort words from others).
  /// Any thread.
  std::string failure() const;
  /// Member `member` is lost with its process (the head saw its node go down or fall silent): a
  /// wait for it ends at once, and this member takes part in no more steps, saying `why`. A
  /// killed process leaves no abort word, so without this the others would notice only at the
  /// all-to-all's timeout, and never while idle. Any thread.
  void peer_lost(uint32_t member, const std::string& why);
  /// The group re-forms though no member failed (a member a shrunk group lacks came back): this
  /// member takes part in no more steps, saying `why`, and its waits for members in other
  /// processes end at once. Any thread.
  void retire(const std::string& why);
  /// Fault injection for tests only: the group falls out of step here, as after a failed exchange.
  void fault_break_for_test(const std::string& why);
  /// Steps this member took part in without rows of its own.
  uint64_t steps_joined() const { return joined_; }
  /// The routed experts this member holds in MoE layer `layer`, ascending.
  std::vector<uint32_t> held(uint32_t layer) const;
  uint64_t plans() const { return plans_.load(std::memory_order_relaxed); }
  /// Expert copies this member served since the last call (the load EPLB evens out), then zeroed.
  uint64_t take_copies_served() { return std::exchange(copies_served_, 0); }
  /// Expert weights this member received from others under EPLB plans (bytes), and experts it dropped.
  uint64_t bytes_installed() const { return bytes_installed_.load(std::memory_order_relaxed); }
  uint64_t experts_evicted() const { return experts_evicted_.load(std::memory_order_relaxed); }

private:
  /// post_dual_a without the refusal checks (join() runs it for a step a peer started).
  bool dual_start(const model_config& cfg, uint32_t layer, std::vector<std::vector<std::byte>> entries_a,
                  std::string* why);
  /// The round's bookkeeping once both channels are done: the step's next layer, EPLB between steps.
  bool end_round(const model_config& cfg, std::string* why);
  /// Any failure leaves the members out of step for good: records `stage` and `what` in `why`,
  /// marks the group broken and tells the other members. Returns false.
  bool fail_round(uint32_t layer, const std::string& stage, const std::string& what, std::string* why);
  /// One round on both channels (B's entries null: a single-channel group).
  bool exchange_round(const model_config& cfg, uint32_t layer, const std::vector<std::vector<std::byte>>& entries,
                      const std::vector<std::vector<std::byte>>* entries_b, std::vector<std::vector<std::byte>>* outputs,
                      std::vector<std::vector<std::byte>>* outputs_b, std::string* why);
  /// A channel's dispatch chunks for `entries`; header-only ones, and the reason, when they do not fit a slot.
  std::vector<std::vector<std::byte>> dispatch_chunks(const model_config& cfg, uint32_t layer,
                                                      const std::vector<std::vector<std::byte>>& entries,
                                                      std::string* too_big) const;
  /// What this member's experts give for every member's dispatch chunk; empty answers, and the
  /// reason, when one cannot be served.
  std::vector<std::vector<std::byte>> serve_all(const model_config& cfg, uint32_t layer,
                                                const std::vector<std::span<const std::byte>>& recv, std::string* refused);
  bool replan(const model_config& cfg, std::string* why);
  std::string gone_peer() const;
  std::string broken() const;
  /// Ends this member's sleeps on both channels: a flag its waits look at has changed.
  void nudge_all();
  /// Records that the group is out of step here, for good (later rounds fail with `why`).
  void mark_broken(const std::string& why);
  /// Why this member cannot run MoE layer `layer`'s round now (empty: it can).
  std::string refuse_round(uint32_t layer) const;

  std::shared_ptr<shared> group_;
  uint32_t rank_;
  std::vector<uint32_t> moe_layers_;  ///< a step's rounds, in order
  size_t next_ = 0;                   ///< this step's next round (0: between steps)
  std::string broken_;                ///< set when an exchange failed: the group is out of step for good
  mutable std::mutex broken_mutex_;   ///< broken_ is read by failure() from other threads
  uint64_t joined_ = 0;
  std::vector<std::vector<expert_weights>> store_;  ///< [layer][expert]: the experts served here
  uint32_t dual_layer_ = 0;                              ///< the open dual round's layer
  std::vector<std::vector<std::byte>> dual_a_, dual_b_;  ///< its entries, until their outputs are back
  std::string dual_too_big_, dual_refused_;              ///< its rows that did not fit; a chunk not served
  uint64_t split_rounds_ = 0;
  live_eplb_config eplb_;
  uint32_t num_experts_ = 0;
  std::vector<std::vector<double>> counts_;            ///< [layer][expert]: this member's copies since the last plan
  std::vector<policies::expert_placement> placement_;  ///< [layer]; empty until the first plan
  uint64_t rounds_ = 0, planned_at_ = 0, copies_served_ = 0;
  /// Read by other threads (a node's report while its executors may still join a step).
  std::atomic<uint64_t> plans_{0}, bytes_installed_{0}, experts_evicted_{0};
};

using peer_transport_maker =
    std::function<std::unique_ptr<transport::transport>(const std::string& name, std::string* why)>;
/// Swaps all-to-all keys among a group's processes, once per channel (0; 1 with dual-batch
/// overlap): posts this process's members' keys (member index, key) and returns every member's,
/// in index order, once all have posted.
using peer_rendezvous =
    std::function<bool(uint32_t channel, const std::vector<std::pair<uint32_t, transport::region_key>>& mine,
                       std::vector<transport::region_key>* all, std::string* why)>;

/// How a data-parallel group's all-to-alls are set up.
struct peer_group_config {
  uint64_t slot_bytes = 1 << 20;                 ///< expert_slot_bytes for the members' largest job
  std::chrono::milliseconds timeout{10'000};     ///< an exchange fails when a member is silent this long
  bool dual_batch = false;                       ///< dual-batch overlap: a second channel per member
};

/// The members of a data-parallel group of `names.size()` that this process hosts (`local`,
/// member indices), each over its own transport from `make_transport` (UCX; loopback in
/// tests); `rendezvous` brings the other processes' keys (the head's node directory, in
/// `baton node`). Empty and a sentence when a transport, an all-to-all or the rendezvous fails.
std::vector<std::shared_ptr<expert_peers>> make_peer_group(
    const std::vector<std::string>& names, const std::vector<uint32_t>& local, const model_config& cfg,
    const peer_group_config& group, const peer_transport_maker& make_transport, const peer_rendezvous& rendezvous,
    std::string* why);
/// The same with every member in this process.
std::vector<std::shared_ptr<expert_peers>> make_peer_group(const std::vector<std::string>& names,
                                                           const model_config& cfg, const peer_group_config& group,
                                                           const peer_transport_maker& make_transport,
                                                           std::string* why);

/// The dispatch slot an EP group needs for jobs of up to `max_rows` rows: every row's top-k
/// copies bound for one rank, plus the header (the combine answer is never larger).
uint64_t expert_slot_bytes(const model_config& cfg, uint64_t max_rows);

}  // namespace baton::gpu
