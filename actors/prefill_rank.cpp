#include "actors/prefill_rank.hpp"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <mutex>
#include <deque>
#include <map>
#include <optional>

#include <caf/actor_system.hpp>
#include <caf/stateful_actor.hpp>
#include <caf/typed_event_based_actor.hpp>

#include "actors/executor_bridge.hpp"
#include "actors/store_access.hpp"
#include "store/prefix_cache.hpp"
#include "gpu/executor.hpp"
#include "policies/cost_model.hpp"
#include "policies/placement.hpp"
#include "gpu/sampling.hpp"
#include "transport/transport.hpp"

namespace baton {

namespace {

/// Everything the executor thread needs to ship one chunk's layers. Immutable once built, so the
/// executor thread and the actor can both read it.
struct chunk_sender {
  uint64_t request_id;
  uint32_t attempt;
  uint32_t chunk;
  bool last;                      ///< the last chunk: its layers complete the prompt's KV
  uint32_t first_page, end_page;  ///< pages [first, end) of the sequence hold this chunk's tokens
  std::vector<uint32_t> local_pages, remote_pages;
  gpu::kv_layout local_layout, remote_layout;
  uint64_t local_region;
  transport::region_key remote_key;
  std::string peer;

  transport::put_desc put_for_layer(uint32_t layer) const {
    transport::put_desc d{request_id, layer, peer, local_region, remote_key, {}};
    for (uint32_t i = first_page; i < end_page; ++i)
      d.segments.push_back({local_layout.offset_bytes(layer, local_pages[i]),
                            remote_layout.offset_bytes(layer, remote_pages[i]), local_layout.page_bytes()});
    return d;
  }
};

struct pending_put {
  uint64_t request_id;
  uint32_t layer;
  uint64_t xfer_id;
  uint64_t checksum;  ///< non-zero on the last chunk's put
  caf::actor_clock::time_point posted_at;
  uint32_t attempt;
  int32_t peer = -1;  ///< split: index into the request's peers (-1: a put to the decode rank)
};

/// The consumer end of the store -> pages pipeline (seed 000 §2.3): the executor thread waits
/// here before a layer's attention until the actor has verified that layer of every cached block.
class prefix_gate final : public gpu::layer_gate {
public:
  bool wait(uint32_t layer) const override {
    std::unique_lock<std::mutex> lock{mutex_};
    // Bounded: an actor that vanished without aborting must not hang the executor forever.
    cv_.wait_for(lock, std::chrono::seconds{30}, [&] { return aborted_ || layer < open_; });
    return !aborted_ && layer < open_;
  }
  void open_through(uint32_t layers) {
    {
      std::lock_guard<std::mutex> lock{mutex_};
      open_ = std::max(open_, layers);
    }
    cv_.notify_all();
  }
  void abort() {
    {
      std::lock_guard<std::mutex> lock{mutex_};
      aborted_ = true;
    }
    cv_.notify_all();
  }

private:
  mutable std::mutex mutex_;
  mutable std::condition_variable cv_;
  uint32_t open_ = 0;
  bool aborted_ = false;
};

/// Loading a prompt's cached prefix from the block store: per block, where it is tried and how
/// it went. A block that fails on one server is retried on its next replica.
///
/// Streaming (cfg.overlap_prefix_load): the prompt computes optimistically while its prefix
/// arrives, each layer gated on that layer of every block being verified. A block that fails
/// aborts the attempt; once the reads settle, compute restarts after the blocks that are good.
struct prefix_load {
  enum status : int8_t { pending, in_flight, retrying, ok, failed };
  std::vector<block_ref> blocks;
  std::vector<status> state;
  std::vector<uint32_t> tried;  ///< index into blocks[b].servers of the server asked
  std::vector<std::string> errors;
  uint32_t outstanding = 0;     ///< read orders of the current round not yet answered
  std::vector<uint32_t> verified;  ///< per block: leading layers landed and verified this round
  std::shared_ptr<prefix_gate> gate;  ///< streaming: the running attempt's gate
  bool aborted = false;               ///< streaming: a block failed; compute restarts after the reads
};
using prefill_load_state = prefix_load;

/// Dynamic prefill split (seed 002): this rank computes one part of a prompt. Earlier parts'
/// KV streams into our pages layer by layer (each earlier rank puts it and says so), gating our
/// layers; our part's KV goes to the decode rank and to every later part's pages. The last part
/// announces each layer to the decode rank once all parts have it there.
struct split_state {
  struct peer {
    uint32_t part = 0;
    kv_region_desc region;
    std::vector<uint32_t> pages;
    caf::actor rank;
  };
  bool active = false;
  uint32_t index = 0, parts = 1;
  uint32_t begin = 0, end = 0;       ///< our part's tokens
  std::vector<uint32_t> seen;        ///< per layer: earlier parts whose KV landed in our pages
  std::vector<bool> layer_done;      ///< per layer: our decode puts of it all landed
  std::vector<peer> peers;           ///< later parts that told us their pages
  uint32_t peer_puts_landed = 0;     ///< (peer, layer) puts landed
  bool last() const { return index + 1 == parts; }
};

/// A prompt in flight on this rank.
///
///   computing --all chunks done and every layer's puts landed--> answered (pages freed)
///       |
///       +--executor or transport failure--> failed (answered with the error; pages freed once
///                                           the executor has finished the queued chunks)
struct prefill_job_state {
  prefill_order order;
  caf::typed_response_promise<prefill_result> promise;
  std::vector<uint32_t> local_pages;
  std::vector<uint32_t> chunk_sizes;  ///< the chunk plan (fixed size, or sized by time budget)
  uint32_t cached_tokens = 0;         ///< leading tokens not computed (local tier or store)
  std::vector<store::block_key> keys; ///< the prompt's full blocks (rank-local tier on)
  uint32_t shared_blocks = 0;         ///< leading blocks on pages shared from the local tier
  uint32_t recomputed_blocks = 0;     ///< cached blocks that could not be used
  prefix_load load;
  uint32_t num_chunks = 0;            ///< chunks that will run (cut short to those submitted on failure)
  uint32_t chunks_submitted = 0;
  uint32_t chunks_done = 0;
  uint64_t tokens_left = 0;          ///< prompt tokens of chunks not yet computed
  caf::actor_clock::time_point arrived_at;
  int64_t queue_us = 0;              ///< arrival -> first chunk started
  std::vector<uint32_t> puts_done;   ///< per layer: chunks whose put of this layer landed
  std::vector<uint64_t> checksums;   ///< per layer: the prompt's KV checksum, from the last chunk
  uint32_t layers_ready = 0;         ///< layers announced to the decode rank
  std::vector<bool> announced;       ///< per layer: announced (a restarted attempt does not repeat it)
  uint32_t attempt = 0;              ///< bumped when a streaming prefix load aborts the computation
  uint32_t jobs_in_executor = 0;     ///< chunk jobs of any attempt not yet finished
  std::optional<uint32_t> restart_from;  ///< after an abort: recompute from here once jobs drain
  split_state split;
  bool have_logits = false;
  int32_t first_token = -1;
  std::vector<float> logits;
  bool failed = false;
  caf::error failure;                 ///< answered once no queued chunk can still post a put
  /// Read by the executor thread before each post: a failed request ships nothing more.
  std::shared_ptr<std::atomic<bool>> cancelled = std::make_shared<std::atomic<bool>>(false);
};

/// The tokens this rank computes end here: the prompt's end, or its part's with a split.
uint32_t prompt_end(const prefill_job_state& r) {
  return r.split.active ? r.split.end : static_cast<uint32_t>(r.order.tokens.size());
}

/// A prompt accepted but not yet started: it waits for local KV pages.
struct waiting_order {
  prefill_order order;
  caf::typed_response_promise<prefill_result> promise;
  caf::actor_clock::time_point arrived_at;
};

/// A chunk job in the executor: which request, and how many of its tokens.
struct chunk_job {
  uint64_t request_id;
  uint32_t tokens;
  uint32_t attempt;
};

/// Chunk jobs kept in the executor at once: one computing, one queued behind it, so the
/// executor never idles between chunks while the next chunk is still chosen per step (which
/// is what lets an interactive prompt overtake a long batch prompt at a chunk boundary).
constexpr uint32_t max_chunks_in_executor = 2;

struct prefill_state {
  prefill_rank_config cfg;
  rank_core core;
  uint64_t last_job = 0;
  uint64_t num_jobs_done = 0;
  std::unordered_map<uint64_t, chunk_job> job_to_request;
  std::unordered_map<uint64_t, prefill_job_state> requests;
  /// Accepted, waiting for local KV pages: interactive first, batch after at most
  /// cfg.batch_max_bypass interactive prompts.
  policies::priority_classes<waiting_order> waiting{4};
  /// Started prompts with chunks left to submit, chosen the same way per chunk. A prompt goes
  /// back to the head of its class after each chunk, so within a class prompts run in order.
  policies::priority_classes<uint64_t> runnable{4};
  uint32_t chunks_in_executor = 0;
  std::vector<pending_put> pending;
  bool poll_scheduled = false;
  prefill_balancer_actor balancer;  ///< told our load after every change (may be null)
  store_access store;               ///< the block store (off when it has no index)
  std::optional<store::prefix_cache> local;  ///< the rank-local prefix tier (store on)
  std::unordered_map<uint64_t, std::vector<split_peer>> early_peers;  ///< split: peers before our launch
  store::block_key salt;
  bool keepalive_scheduled = false;
  static inline const char* name = "baton.prefill_rank";
};

using prefill_pointer = prefill_rank_actor::stateful_pointer<prefill_state>;

void report_load(prefill_pointer self) {
  auto& st = self->state;
  if (!st.balancer) return;
  uint64_t queued = 0;
  double predicted = 0.0;
  for (const auto& [id, r] : st.requests) {
    queued += r.tokens_left;
    uint64_t start = r.cached_tokens;
    for (uint32_t c = 0; c < r.num_chunks; ++c) {
      if (c >= r.chunks_done) predicted += st.cfg.cost.prefill_us(r.chunk_sizes[c], start);
      start += r.chunk_sizes[c];
    }
  }
  st.waiting.for_each([&](const waiting_order& w) {
    queued += w.order.tokens.size();
    predicted += st.cfg.cost.prefill_us(w.order.tokens.size(), 0);
  });
  const auto& kv = st.core.exec->kv();
  rank_load load{st.cfg.name, queued, static_cast<uint32_t>(st.requests.size() + st.waiting.size()),
                 kv.num_free_pages(), kv.layout().num_pages};
  load.page_size_tokens = kv.layout().page_size_tokens;
  load.predicted_us = predicted;
  self->send(st.balancer, load_atom::value, std::move(load), caf::actor_cast<prefill_rank_actor>(self));
}

void drain_waiting(prefill_pointer self);

/// Counts a finished executor job and returns the request it belonged to (forgetting the job).
std::optional<chunk_job> take_job(prefill_pointer self, uint64_t job_id) {
  auto& st = self->state;
  ++st.num_jobs_done;
  auto j = st.job_to_request.find(job_id);
  if (j == st.job_to_request.end()) return std::nullopt;
  const chunk_job cj = j->second;
  st.job_to_request.erase(j);
  if (st.chunks_in_executor > 0) --st.chunks_in_executor;
  return cj;
}

/// Gives a finished prompt's pages back: shared ones are unpinned; after a success its own full
/// blocks join the rank-local tier (their KV is the prompt's, computed or loaded and verified);
/// the rest is freed.
void return_pages(prefill_pointer self, prefill_job_state& r, bool success) {
  auto& st = self->state;
  auto& kv = st.core.exec->kv();
  if (!st.local) {
    kv.kv_page_free(r.local_pages);
    return;
  }
  const uint32_t ppb = st.local->pages_per_block();
  st.local->release(r.keys, r.shared_blocks);
  size_t own_from = size_t{r.shared_blocks} * ppb;
  if (success) {
    const size_t full = r.keys.size();
    for (size_t b = full; b-- > r.shared_blocks;)
      kv.kv_page_free(st.local->insert(
          r.keys[b], {r.local_pages.begin() + b * ppb, r.local_pages.begin() + (b + 1) * ppb}));
    own_from = full * ppb;
    kv.kv_page_free(st.local->evict(0));  // down to capacity
  }
  kv.kv_page_free({r.local_pages.begin() + std::min(own_from, r.local_pages.size()), r.local_pages.end()});
}

void finish_if_done(prefill_pointer self, uint64_t request_id) {
  auto& st = self->state;
  auto i = st.requests.find(request_id);
  if (i == st.requests.end()) return;
  auto& r = i->second;
  const bool compute_finished = r.chunks_done == r.num_chunks && r.num_chunks > 0;
  const uint32_t layers = st.core.exec->config().num_hidden_layers;
  bool done = compute_finished && r.have_logits && r.layers_ready == layers;
  if (r.split.active && !r.split.last()) {  // an earlier part: done when every later part has our KV
    const auto peers_expected = r.split.parts - 1 - r.split.index;
    done = compute_finished && std::all_of(r.split.layer_done.begin(), r.split.layer_done.end(), [](bool b) { return b; }) &&
           r.split.peers.size() == peers_expected && r.split.peer_puts_landed == peers_expected * layers;
  }
  if (!r.failed && !done) return;
  // A failure is answered only when the executor is done with the request: after that no put
  // of it can still be posted, so the decode rank may safely reuse the lease's pages.
  if (r.failed && r.jobs_in_executor > 0) return;
  if (r.failed)
    r.promise.deliver(std::move(r.failure));
  else
    r.promise.deliver(prefill_result{request_id, r.first_token, std::move(r.logits), st.cfg.name, r.queue_us,
                                     r.split.active ? 0 : r.cached_tokens, r.recomputed_blocks,
                                     r.shared_blocks * st.store.block_tokens()});
  return_pages(self, r, !r.failed);
  st.requests.erase(i);
  drain_waiting(self);  // freed pages may start a waiting prompt; reports the load
}

void fail_request(prefill_pointer self, uint64_t request_id, errc code, const std::string& stage,
                  const std::string& what) {
  auto i = self->state.requests.find(request_id);
  if (i == self->state.requests.end() || i->second.failed) return;
  i->second.failed = true;
  i->second.cancelled->store(true);
  i->second.num_chunks = i->second.chunks_submitted;  // chunks not yet submitted never will be
  i->second.failure = make_error(code, where(request_id, self->state.cfg.name, stage) + ": " + what);
  finish_if_done(self, request_id);
}

/// Tells the decode rank that layer `layer` of the whole prompt is in its pages.
void announce_layer(prefill_pointer self, prefill_job_state& r, uint32_t layer) {
  if (r.announced[layer]) return;
  // A layer announced by an aborted attempt stays announced: its bytes were computed from a
  // verified prefix layer, and the restart rewrites them identically.
  r.announced[layer] = true;
  ++r.layers_ready;
  self->state.core.log->add({0, "layer_ready", r.order.request_id, 0, layer, {}, {}});
  self->send(r.order.decode, kv_layer_ready{r.order.request_id, r.order.grant.lease_id, layer,
                                            static_cast<uint32_t>(r.order.tokens.size()), r.checksums[layer]});
}

void track_put(prefill_pointer self, pending_put p);

/// Split: our part's layer `layer` into a later part's pages.
void put_to_peer(prefill_pointer self, prefill_job_state& r, size_t peer, uint32_t layer) {
  auto& st = self->state;
  const auto& pr = r.split.peers[peer];
  const auto& lay = st.core.exec->kv().layout();
  const auto& reg = pr.region;
  const gpu::kv_layout remote{reg.num_layers, reg.num_pages, reg.page_size_tokens, reg.kv_dim};
  transport::put_desc d{r.order.request_id, layer, "part-" + std::to_string(pr.part), st.core.pool_key->region_id,
                        transport::region_key{reg.backend, reg.region_id, reg.size_bytes, reg.packed_key}, {}};
  const uint32_t ps = lay.page_size_tokens;
  for (uint32_t pg = r.split.begin / ps; pg < (r.split.end + ps - 1) / ps && pg < pr.pages.size(); ++pg)
    d.segments.push_back({lay.offset_bytes(layer, r.local_pages[pg]), remote.offset_bytes(layer, pr.pages[pg]),
                          lay.page_bytes()});
  track_put(self, {r.order.request_id, layer, st.core.xport->post_put(d), 0, self->clock().now(), r.attempt,
                   static_cast<int32_t>(peer)});
}

/// Split, the last part: a layer is announced once our puts and every earlier part's have it.
void maybe_announce_split(prefill_pointer self, prefill_job_state& r, uint32_t layer) {
  if (r.split.last() && r.split.layer_done[layer] && r.split.seen[layer] == r.split.index)
    announce_layer(self, r, layer);
}

void on_put_landed(prefill_pointer self, uint64_t request_id, uint32_t layer, uint64_t checksum, uint32_t attempt) {
  auto& st = self->state;
  auto i = st.requests.find(request_id);
  if (i == st.requests.end() || i->second.failed || i->second.attempt != attempt) return;  // stale attempt
  auto& r = i->second;
  if (checksum != 0) r.checksums[layer] = checksum;
  // Chunks before the last make progress the decode rank cannot see (a layer completes only with
  // the last chunk): each of their landed layers renews the lease.
  if (r.puts_done[layer] + 1 < r.num_chunks)
    self->send(r.order.decode, keepalive_atom::value, request_id, r.order.grant.lease_id);
  if (++r.puts_done[layer] == r.num_chunks) {
    if (!r.split.active) {
      announce_layer(self, r, layer);
    } else {
      r.split.layer_done[layer] = true;
      for (size_t p = 0; p < r.split.peers.size(); ++p) put_to_peer(self, r, p, layer);
      maybe_announce_split(self, r, layer);
    }
  }
  finish_if_done(self, request_id);
}

/// Split: our layer landed in a later part's pages (and, before that, in the decode rank's).
void on_peer_put_landed(prefill_pointer self, uint64_t request_id, int32_t peer, uint32_t layer) {
  auto& st = self->state;
  auto i = st.requests.find(request_id);
  if (i == st.requests.end() || i->second.failed) return;
  auto& r = i->second;
  caf::anon_send(r.split.peers[peer].rank, split_layer{request_id, r.split.index, layer});
  ++r.split.peer_puts_landed;
  finish_if_done(self, request_id);
}

/// Polls one transfer; returns true when it is finished (landed or failed).
bool settle(prefill_pointer self, const pending_put& p) {
  auto& st = self->state;
  transport::xfer_error err;
  if (auto i = st.requests.find(p.request_id); i != st.requests.end() && i->second.attempt != p.attempt) {
    if (st.core.xport->poll(p.xfer_id, &err) == transport::xfer_state::pending) return false;
    st.core.xport->release(p.xfer_id);  // an aborted attempt's put: its outcome no longer matters
    return true;
  }
  switch (st.core.xport->poll(p.xfer_id, &err)) {
    case transport::xfer_state::pending: {
      const auto waited = self->clock().now() - p.posted_at;
      if (waited < std::chrono::milliseconds{st.cfg.kv_send_timeout_ms}) return false;
      st.core.xport->release(p.xfer_id);
      fail_request(self, p.request_id, errc::transfer_failed, "kv_send",
                   "put of layer " + std::to_string(p.layer) + " still pending after " +
                       std::to_string(st.cfg.kv_send_timeout_ms) + " ms");
      return true;
    }
    case transport::xfer_state::done:
      st.core.xport->release(p.xfer_id);
      if (p.peer >= 0)
        on_peer_put_landed(self, p.request_id, p.peer, p.layer);
      else
        on_put_landed(self, p.request_id, p.layer, p.checksum, p.attempt);
      return true;
    case transport::xfer_state::failed:
      st.core.xport->release(p.xfer_id);
      fail_request(self, p.request_id, errc::transfer_failed, "kv_send", err.to_string());
      return true;
  }
  return true;
}

/// Polls `p` from now on (never settles it on the spot: callers may be iterating state it changes).
void track_put(prefill_pointer self, pending_put p) {
  auto& st = self->state;
  st.pending.push_back(p);
  if (!st.poll_scheduled) {
    st.poll_scheduled = true;
    self->delayed_send(self, std::chrono::microseconds{st.cfg.poll_interval_us}, poll_atom::value);
  }
}

/// Submits one chunk of a started prompt. Its layers' puts are posted from the executor thread.
void submit_chunk(prefill_pointer self, uint64_t rid) {
  auto& st = self->state;
  auto& r = st.requests.at(rid);
  const auto& order = r.order;
  const auto& local = st.core.exec->kv().layout();
  const auto& reg = order.grant.region;
  gpu::kv_layout remote_layout{reg.num_layers, reg.num_pages, reg.page_size_tokens, reg.kv_dim};
  transport::region_key remote_key{reg.backend, reg.region_id, reg.size_bytes, reg.packed_key};
  const auto num_tokens = prompt_end(r);
  const uint32_t c = r.chunks_submitted++;
  uint32_t start = r.cached_tokens;
  for (uint32_t k = 0; k < c; ++k) start += r.chunk_sizes[k];
  const uint32_t end = start + r.chunk_sizes[c];
  const uint32_t ps = local.page_size_tokens;
  // The first chunk also ships the prefix loaded from the store: the decode rank needs all of it.
  auto sender = std::make_shared<const chunk_sender>(chunk_sender{
      rid, r.attempt, c, end == num_tokens, c == 0 && !r.split.active ? 0 : start / ps, (end + ps - 1) / ps, r.local_pages,
      order.grant.page_ids, local, remote_layout, st.core.pool_key->region_id, remote_key, order.grant.rank});
  // Runs on the executor thread right after layer `l` is computed, before layer l + 1: the
  // put is posted in stream order, and the actor polls it.
  // Raw pointers on purpose: the callback runs on the executor's thread, and if it held the last
  // reference to the executor, the executor would be destroyed on (and try to join) its own thread.
  // rank_core destroys the executor (joining its thread) before the transport, so both outlive
  // every callback.
  auto on_layer = [sender, xport = st.core.xport.get(), log = st.core.log, exec = st.core.exec.get(),
                   owner = self->address(),
                   cancelled = r.cancelled](uint64_t, uint32_t l) {
    log->add({0, "compute_done", sender->request_id, sender->chunk, l, {}, {}});
    if (cancelled->load()) return;
    // The last chunk completes layer l of the whole prompt: its checksum goes with the
    // layer-ready signal so the decode rank can prove the layer landed intact.
    const uint64_t checksum =
        sender->last ? std::max<uint64_t>(1, exec->kv().kv_layer_checksum(l, sender->local_pages, sender->end_page)) : 0;
    const uint64_t xfer = xport->post_put(sender->put_for_layer(l));
    log->add({0, "send_posted", sender->request_id, sender->chunk, l, {}, {}});
    if (auto h = caf::actor_cast<caf::actor>(owner))
      caf::anon_send(h, xfer_atom::value, sender->request_id, l, xfer, checksum, sender->attempt);
  };
  const uint64_t job_id = ++st.last_job;
  st.job_to_request[job_id] = chunk_job{rid, end - start, r.attempt};
  ++st.chunks_in_executor;
  ++r.jobs_in_executor;
  gpu::forward_job job{job_id, {gpu::forward_seq{rid, {order.tokens.begin() + start, order.tokens.begin() + end},
                                                 start, r.local_pages, end == num_tokens}}};
  if (r.load.gate && !r.load.aborted) job.seqs[0].gate = r.load.gate;  // streaming prefix: wait per layer
  st.core.exec->submit(std::move(job),
                       std::make_shared<forwarding_sink>(self->address(), std::move(on_layer), /*report_start*/ c == 0));
}

/// Keeps the executor fed: picks the next chunk by priority class while fewer than
/// max_chunks_in_executor are in it.
void pump(prefill_pointer self) {
  auto& st = self->state;
  while (st.chunks_in_executor < max_chunks_in_executor) {
    auto rid = st.runnable.pop();
    if (!rid) return;
    auto i = st.requests.find(*rid);
    if (i == st.requests.end() || i->second.failed || i->second.chunks_submitted >= i->second.chunk_sizes.size())
      continue;
    submit_chunk(self, *rid);
    if (i->second.chunks_submitted < i->second.chunk_sizes.size())
      st.runnable.push_front(*rid, i->second.order.batch_priority);
  }
}

/// Plans the chunks of a prompt whose first `cached` tokens already have KV in its pages, and
/// makes it runnable.
void start_compute(prefill_pointer self, uint64_t rid, uint32_t cached) {
  auto& st = self->state;
  auto& r = st.requests.at(rid);
  const auto num_tokens = prompt_end(r);
  r.cached_tokens = cached;
  const uint32_t todo = num_tokens - cached;
  r.chunk_sizes.clear();
  r.chunks_submitted = r.chunks_done = 0;
  std::fill(r.puts_done.begin(), r.puts_done.end(), 0);
  std::fill(r.checksums.begin(), r.checksums.end(), 0);
  r.have_logits = false;
  // Seed 000 §3.1 level 4: with a step budget, each chunk is the largest whose predicted cost
  // fits it, so chunks shrink as the context grows; chunk_tokens caps them either way.
  if (st.cfg.step_budget_us > 0)
    r.chunk_sizes = policies::plan_chunks(st.cfg.cost, cached, todo, st.cfg.step_budget_us, st.cfg.chunk_tokens);
  else
    for (uint32_t done = 0; done < todo; done += st.cfg.chunk_tokens)
      r.chunk_sizes.push_back(std::min(st.cfg.chunk_tokens, todo - done));
  r.num_chunks = static_cast<uint32_t>(r.chunk_sizes.size());
  r.tokens_left = todo;
  st.runnable.push(rid, r.order.batch_priority);
  pump(self);
  report_load(self);
}

void load_round(prefill_pointer self, uint64_t rid);
void schedule_keepalive(prefill_pointer self);

/// Streaming: a cached block failed, so the optimistic computation cannot stand. Its jobs are
/// told to stop (the gate) and their results become stale (the attempt number).
void abort_attempt(prefill_pointer self, prefill_job_state& r) {
  auto& ld = r.load;
  if (!ld.gate || ld.aborted) return;
  ld.aborted = true;
  ld.gate->abort();
  ++r.attempt;
  r.cancelled->store(true);  // the old attempt's layers post nothing more
  r.cancelled = std::make_shared<std::atomic<bool>>(false);
  r.chunk_sizes.clear();
  r.num_chunks = r.chunks_submitted = r.chunks_done = 0;
  self->state.core.log->add({0, "prefix_abort", r.order.request_id, r.attempt, 0, {}, {}});
}

/// After an abort: recompute from `restart_from` once the old attempt's jobs have left the
/// executor (they fail at the gate quickly).
void maybe_restart(prefill_pointer self, uint64_t rid) {
  auto& st = self->state;
  auto i = st.requests.find(rid);
  if (i == st.requests.end() || !i->second.restart_from || i->second.jobs_in_executor > 0) return;
  const uint32_t from = *i->second.restart_from;
  i->second.restart_from.reset();
  start_compute(self, rid, from);
}

/// Streaming: layer `ev.layer` of some blocks landed. Each is verified in our pages; when that
/// layer of every block is good, the gate lets the computation's layer through.
void on_layer_landed(prefill_pointer self, const store_layer_landed& ev) {
  auto& st = self->state;
  auto i = st.requests.find(ev.request_id);
  if (i == st.requests.end()) return;
  auto& r = i->second;
  auto& ld = r.load;
  if (!ld.gate || ld.aborted) return;
  auto& kv = st.core.exec->kv();
  const uint32_t ppb = r.order.block_tokens / kv.layout().page_size_tokens;
  for (size_t k = 0; k < ev.block_index.size() && k < ev.checksums.size(); ++k) {
    const uint32_t b = ev.block_index[k];
    if (b >= ld.verified.size() || ld.verified[b] != ev.layer) continue;  // out of order: the final answer decides
    std::vector<uint32_t> pages(r.local_pages.begin() + b * ppb, r.local_pages.begin() + (b + 1) * ppb);
    if (std::max<uint64_t>(1, kv.kv_layer_checksum(ev.layer, pages, ppb)) == std::max<uint64_t>(1, ev.checksums[k]))
      ++ld.verified[b];
    else
      return abort_attempt(self, r);  // the final answer marks the block failed
  }
  uint32_t open = kv.layout().num_layers;
  for (size_t b = r.shared_blocks; b < ld.verified.size(); ++b) open = std::min(open, ld.verified[b]);
  ld.gate->open_through(open);
}

/// The reads of a round are all answered: verify what landed, retry failed blocks on their next
/// replica, or start computing after the longest verified prefix.
void on_round_done(prefill_pointer self, uint64_t rid) {
  auto& st = self->state;
  auto& r = st.requests.at(rid);
  auto& ld = r.load;
  self->send(r.order.decode, keepalive_atom::value, rid, r.order.grant.lease_id);  // loading is progress
  bool retry = false;
  for (size_t b = 0; b < ld.state.size(); ++b)
    if (ld.state[b] == prefix_load::retrying) {
      ld.state[b] = prefix_load::pending;
      retry = true;
    }
  if (retry) return load_round(self, rid);
  uint32_t good = 0;
  while (good < ld.state.size() && ld.state[good] == prefix_load::ok) ++good;
  r.recomputed_blocks = static_cast<uint32_t>(ld.state.size()) - good;
  st.core.log->add({0, "prefix_loaded", rid, good, 0, {}, {}});
  if (r.recomputed_blocks) st.core.log->add({0, "prefix_recompute", rid, r.recomputed_blocks, 0, {}, {}});
  if (!ld.gate) return start_compute(self, rid, good * r.order.block_tokens);
  if (r.recomputed_blocks == 0 && !ld.aborted) {
    ld.gate->open_through(st.core.exec->kv().layout().num_layers);  // every layer verified
    return;
  }
  abort_attempt(self, r);
  r.restart_from = good * r.order.block_tokens;
  maybe_restart(self, rid);
}

/// Marks block b failed on its current server: the next replica gets it next round, if any.
void block_failed(prefill_load_state& ld, size_t b, const std::string& why) {
  ld.errors[b] = why;
  ld.state[b] = ++ld.tried[b] < ld.blocks[b].servers.size() ? prefix_load::retrying : prefix_load::failed;
  if (b < ld.verified.size()) ld.verified[b] = 0;  // a replica streams it again from layer 0
}

/// Asks each block's current server for the pending blocks, one read order per server.
void load_round(prefill_pointer self, uint64_t rid) {
  auto& st = self->state;
  auto& r = st.requests.at(rid);
  auto& ld = r.load;
  std::map<uint32_t, store_read_order> orders;
  const auto& pool = st.core.exec->kv();
  for (size_t b = 0; b < ld.state.size(); ++b) {
    if (ld.state[b] != prefix_load::pending) continue;
    const uint32_t server = ld.blocks[b].servers[ld.tried[b]];
    if (server >= st.store.servers.size()) {
      block_failed(ld, b, "unknown block server " + std::to_string(server));
      continue;
    }
    auto& o = orders[server];
    if (o.blocks.empty()) {
      const auto& lay = pool.layout();
      o.request_id = rid;
      o.block_tokens = r.order.block_tokens;
      o.region = kv_region_desc{st.core.pool_key->backend, st.core.pool_key->region_id, st.core.pool_key->size_bytes,
                                st.core.pool_key->packed, lay.num_layers, lay.num_pages, lay.page_size_tokens,
                                lay.kv_dim};
      o.page_ids = r.local_pages;
      o.reader = st.cfg.name;
      if (r.load.gate) o.reader_actor = caf::actor_cast<caf::actor>(self);
    }
    o.blocks.push_back(ld.blocks[b]);
    o.block_index.push_back(static_cast<uint32_t>(b));
    ld.state[b] = prefix_load::in_flight;
  }
  if (orders.empty()) return on_round_done(self, rid);
  ld.outstanding = static_cast<uint32_t>(orders.size());
  schedule_keepalive(self);  // a slow read must not let the decode rank's lease expire
  for (auto& [server, order] : orders) {
    const std::vector<uint32_t> asked = order.block_index;
    auto on_reply = [=](store_read_result& res) {
      auto& st = self->state;
      auto i = st.requests.find(rid);
      if (i == st.requests.end()) return;
      auto& r = i->second;
      auto& kv = st.core.exec->kv();
      const uint32_t ppb = r.order.block_tokens / kv.layout().page_size_tokens;
      for (size_t k = 0; k < res.block_index.size() && k < res.errors.size(); ++k) {
        const uint32_t b = res.block_index[k];
        if (!res.errors[k].empty()) {
          block_failed(r.load, b, res.errors[k]);
          continue;
        }
        // End to end: the bytes now in our pages must match what the writer checksummed.
        std::vector<uint32_t> pages(r.local_pages.begin() + b * ppb, r.local_pages.begin() + (b + 1) * ppb);
        bool intact = res.checksums[k].size() == kv.layout().num_layers;
        for (uint32_t l = 0; intact && l < kv.layout().num_layers; ++l)
          intact = std::max<uint64_t>(1, kv.kv_layer_checksum(l, pages, ppb)) == std::max<uint64_t>(1, res.checksums[k][l]);
        if (intact)
          r.load.state[b] = prefix_load::ok;
        else
          block_failed(r.load, b, "block failed its checksum after landing");
      }
      for (auto b : asked)  // blocks the server did not mention
        if (r.load.state[b] == prefix_load::in_flight) block_failed(r.load, b, "not in the server's answer");
      if (r.load.gate && std::any_of(r.load.state.begin(), r.load.state.end(), [](auto x) {
            return x == prefix_load::retrying || x == prefix_load::failed;
          }))
        abort_attempt(self, r);  // the optimistic computation read a block that is not good
      if (--r.load.outstanding == 0) on_round_done(self, rid);
    };
    auto on_error = [=](caf::error& err) {
      auto& st = self->state;
      auto i = st.requests.find(rid);
      if (i == st.requests.end()) return;
      for (auto b : asked)
        if (i->second.load.state[b] == prefix_load::in_flight)
          block_failed(i->second.load, b, "block server " + std::to_string(server) + ": " + self->system().render(err));
      abort_attempt(self, i->second);
      if (--i->second.load.outstanding == 0) on_round_done(self, rid);
    };
    self->request(st.store.servers[server], std::chrono::milliseconds{st.store.read_timeout_ms}, std::move(order))
        .then(std::move(on_reply), std::move(on_error));
  }
}

void on_split_peer(prefill_pointer self, split_peer peer);

/// Split: starts our part. The earlier parts' ranks learn where our pages are, so they can put
/// their KV there; each of our layers waits for theirs.
void launch_split(prefill_pointer self, uint64_t rid) {
  auto& st = self->state;
  auto& r = st.requests.at(rid);
  const auto& o = r.order;
  const uint32_t layers = st.core.exec->kv().layout().num_layers;
  auto& sp = r.split;
  sp.active = true;
  sp.index = o.part_index;
  sp.parts = static_cast<uint32_t>(o.part_ranks.size());
  sp.begin = o.part_bounds.at(sp.index);
  sp.end = o.part_bounds.at(sp.index + 1);
  sp.seen.assign(layers, 0);
  sp.layer_done.assign(layers, false);
  st.core.log->add({0, "split_part", rid, sp.index, 0, {}, {}});
  if (sp.index > 0) {
    r.load.gate = std::make_shared<prefix_gate>();
    const auto& lay = st.core.exec->kv().layout();
    const auto& key = *st.core.pool_key;
    kv_region_desc region{key.backend, key.region_id, key.size_bytes, key.packed, lay.num_layers, lay.num_pages,
                          lay.page_size_tokens, lay.kv_dim};
    for (uint32_t j = 0; j < sp.index; ++j)
      caf::anon_send(o.part_ranks[j], split_peer{rid, sp.index, region, r.local_pages, caf::actor_cast<caf::actor>(self)});
  }
  if (auto e = st.early_peers.find(rid); e != st.early_peers.end()) {
    auto peers = std::move(e->second);
    st.early_peers.erase(e);
    for (auto& p : peers) on_split_peer(self, std::move(p));
  }
  start_compute(self, rid, sp.begin);
}

/// Split: a later part's pages are known: every layer we have finished goes there now, the rest
/// as they finish.
void on_split_peer(prefill_pointer self, split_peer peer) {
  auto& st = self->state;
  auto i = st.requests.find(peer.request_id);
  if (i == st.requests.end() || !i->second.split.active) {
    auto& early = st.early_peers[peer.request_id];  // our order has not started yet
    if (early.size() < 64) early.push_back(std::move(peer));
    return;
  }
  auto& r = i->second;
  r.split.peers.push_back({peer.part_index, std::move(peer.region), std::move(peer.page_ids), std::move(peer.rank)});
  const size_t p = r.split.peers.size() - 1;
  for (uint32_t l = 0; l < r.split.layer_done.size(); ++l)
    if (r.split.layer_done[l]) put_to_peer(self, r, p, l);
  finish_if_done(self, r.order.request_id);
}

/// Split: an earlier part's layer landed in our pages; the layer gate follows the slowest part.
void on_split_layer(prefill_pointer self, const split_layer& ev) {
  auto& st = self->state;
  auto i = st.requests.find(ev.request_id);
  if (i == st.requests.end() || !i->second.split.active || ev.layer >= i->second.split.seen.size()) return;
  auto& r = i->second;
  ++r.split.seen[ev.layer];
  uint32_t open = 0;
  while (open < r.split.seen.size() && r.split.seen[open] == r.split.index) ++open;
  if (r.load.gate) r.load.gate->open_through(open);
  maybe_announce_split(self, r, ev.layer);
  finish_if_done(self, ev.request_id);
}

/// Starts a prompt whose local pages are allocated: loads its cached prefix from the block
/// store first when CHECK found one, then computes the rest.
void launch(prefill_pointer self, waiting_order w, std::vector<uint32_t> pages, std::vector<store::block_key> keys,
            uint32_t shared_blocks) {
  auto& st = self->state;
  const auto rid = w.order.request_id;
  auto& r = st.requests[rid];
  r.promise = std::move(w.promise);
  r.local_pages = std::move(pages);
  r.keys = std::move(keys);
  r.shared_blocks = shared_blocks;
  if (shared_blocks) st.core.log->add({0, "prefix_local_hit", rid, shared_blocks, 0, {}, {}});
  const auto& local = st.core.exec->kv().layout();
  r.puts_done.assign(local.num_layers, 0);
  r.checksums.assign(local.num_layers, 0);
  r.announced.assign(local.num_layers, false);
  r.arrived_at = w.arrived_at;
  r.order = std::move(w.order);
  const auto& o = r.order;
  if (o.part_ranks.size() > 1) return launch_split(self, rid);
  const bool can_load = st.store.enabled() && st.core.pool_key && o.prefix.size() > shared_blocks &&
                        o.block_tokens > 0 && o.block_tokens % local.page_size_tokens == 0 &&
                        uint64_t{o.prefix.size()} * o.block_tokens < o.tokens.size();
  if (!can_load) return start_compute(self, rid, shared_blocks * st.store.block_tokens());
  auto& ld = r.load;
  ld.blocks = o.prefix;
  ld.state.assign(o.prefix.size(), prefix_load::pending);
  for (uint32_t b = 0; b < shared_blocks; ++b) ld.state[b] = prefix_load::ok;  // already in our pages
  ld.tried.assign(o.prefix.size(), 0);
  ld.errors.assign(o.prefix.size(), {});
  for (size_t b = shared_blocks; b < ld.blocks.size(); ++b)
    if (ld.blocks[b].servers.empty()) block_failed(ld, b, "no server holds the block");
  st.core.log->add({0, "prefix_load_start", rid, static_cast<uint32_t>(ld.blocks.size() - shared_blocks), 0, {}, {}});
  ld.verified.assign(o.prefix.size(), local.num_layers);  // shared blocks: all layers in place
  for (size_t b = shared_blocks; b < ld.blocks.size(); ++b) ld.verified[b] = 0;
  const bool streaming = st.cfg.overlap_prefix_load &&
                         std::none_of(ld.state.begin(), ld.state.end(), [](auto x) { return x == prefix_load::failed || x == prefix_load::retrying; });
  if (streaming) {
    // Seed 000 §2.3: compute while the prefix streams in, each layer gated on its arrival.
    ld.gate = std::make_shared<prefix_gate>();
    start_compute(self, rid, static_cast<uint32_t>(ld.blocks.size()) * o.block_tokens);
  }
  load_round(self, rid);
}

/// Starts waiting prompts, in priority order, while local KV pages last; then feeds the
/// executor. While a prompt waits, the keepalive tick renews its lease at the decode rank (a
/// lease otherwise lives only as long as progress: once computing, every landed layer renews it).
void drain_waiting(prefill_pointer self) {
  auto& st = self->state;
  auto& kv = st.core.exec->kv();
  while (const auto* w = st.waiting.peek()) {
    const bool split = w->order.part_ranks.size() > 1;
    const auto len = split ? w->order.part_bounds.at(w->order.part_index + 1) : static_cast<uint32_t>(w->order.tokens.size());
    std::vector<store::block_key> keys;
    size_t hit = 0;
    std::vector<uint32_t> shared;
    if (st.local && !split) {
      // The rank-local tier first: blocks already in our pages are shared, pinned, not copied.
      keys = store::chain_keys(st.salt, w->order.tokens, st.store.block_tokens());
      hit = std::min<size_t>(st.local->match(keys), (len - 1) / st.store.block_tokens());
      shared = st.local->acquire(keys, hit);
    }
    const auto fresh_needed = static_cast<uint32_t>(kv.pages_for_tokens(len) - shared.size());
    auto fresh = kv.kv_page_alloc(fresh_needed);
    if (!fresh && st.local) {  // make room from unpinned local blocks, oldest first
      kv.kv_page_free(st.local->evict(fresh_needed - std::min(fresh_needed, kv.num_free_pages())));
      fresh = kv.kv_page_alloc(fresh_needed);
    }
    if (!fresh) {
      if (st.local) st.local->release(keys, hit);
      break;
    }
    shared.insert(shared.end(), fresh->begin(), fresh->end());
    launch(self, std::move(*st.waiting.pop()), std::move(shared), std::move(keys), static_cast<uint32_t>(hit));
  }
  pump(self);
  report_load(self);
}

/// Arms the keepalive tick while prompts wait, at a third of the shortest waiting lease.
void schedule_keepalive(prefill_pointer self) {
  auto& st = self->state;
  uint32_t lease_ms = UINT32_MAX;
  st.waiting.for_each([&](const waiting_order& w) { lease_ms = std::min(lease_ms, w.order.grant.lease_ms); });
  for (const auto& [id, r] : st.requests)  // prompts whose prefix is still being read from the store
    if (r.load.outstanding > 0) lease_ms = std::min(lease_ms, r.order.grant.lease_ms);
  if (st.keepalive_scheduled || lease_ms == UINT32_MAX) return;
  st.keepalive_scheduled = true;
  self->delayed_send(self, std::chrono::milliseconds{std::max<uint32_t>(1, lease_ms / 3)}, keepalive_atom::value);
}

/// Checks an order and queues it; it starts as soon as local KV pages are free.
caf::result<prefill_result> accept_prefill(prefill_pointer self, prefill_order order) {
  auto& st = self->state;
  const auto rid = order.request_id;
  const auto stage = where(rid, st.cfg.name, "prefill");
  if (!st.core.setup_error.empty()) return make_error(errc::executor_failed, stage + ": " + st.core.setup_error);
  bool duplicate = st.requests.count(rid) > 0;
  st.waiting.for_each([&](const waiting_order& w) { duplicate = duplicate || w.order.request_id == rid; });
  if (duplicate) return make_error(errc::bad_request, stage + ": request id already in progress");
  auto& kv = st.core.exec->kv();
  const auto& local = kv.layout();
  const auto& reg = order.grant.region;
  if (reg.num_layers != local.num_layers || reg.page_size_tokens != local.page_size_tokens ||
      reg.kv_dim != local.kv_dim)
    return make_error(errc::layout_mismatch,
                      stage + ": decode rank " + order.grant.rank + " pages are " + std::to_string(reg.num_layers) +
                          " layers x " + std::to_string(reg.page_size_tokens) + " tokens x " +
                          std::to_string(reg.kv_dim) + " values, this rank's are " +
                          std::to_string(local.num_layers) + " x " + std::to_string(local.page_size_tokens) +
                          " x " + std::to_string(local.kv_dim));
  const auto num_tokens = static_cast<uint32_t>(order.tokens.size());
  const uint32_t num_pages = kv.pages_for_tokens(num_tokens);
  if (num_tokens == 0) return make_error(errc::bad_request, stage + ": empty prompt");
  if (order.grant.page_ids.size() < num_pages)
    return make_error(errc::layout_mismatch, stage + ": lease has " + std::to_string(order.grant.page_ids.size()) +
                                                 " pages, the prompt needs " + std::to_string(num_pages));
  if (num_pages > local.num_pages)
    return make_error(errc::kv_capacity, stage + ": the prompt needs " + std::to_string(num_pages) +
                                             " KV pages, this rank has " + std::to_string(local.num_pages) + " in all");
  auto promise = self->make_response_promise<prefill_result>();
  const bool batch = order.batch_priority;
  st.waiting.push(waiting_order{std::move(order), promise, self->clock().now()}, batch);
  drain_waiting(self);
  schedule_keepalive(self);
  return promise;
}

prefill_rank_actor::behavior_type prefill_rank_impl(prefill_pointer self, prefill_rank_config cfg,
                                                    std::shared_ptr<gpu::executor> exec,
                                                    std::shared_ptr<transport::transport> xport,
                                                    prefill_balancer_actor balancer, store_access store) {
  auto& st = self->state;
  st.store = std::move(store);
  if (st.store.enabled() && cfg.prefix_cache_blocks > 0 && st.store.block_tokens() % exec->kv().layout().page_size_tokens == 0) {
    st.local.emplace(st.store.block_tokens() / exec->kv().layout().page_size_tokens, cfg.prefix_cache_blocks);
    st.salt = store::salt_of(st.store.identity);
  }
  st.balancer = std::move(balancer);
  st.waiting = policies::priority_classes<waiting_order>{cfg.batch_max_bypass};
  st.runnable = policies::priority_classes<uint64_t>{cfg.batch_max_bypass};
  st.cfg = std::move(cfg);
  st.core.start(self, std::move(exec), std::move(xport));
  report_load(self);  // registers this rank with its balancer
  return {
      [=](prefill_order& order) { return accept_prefill(self, std::move(order)); },
      [=](stats_atom) {
        auto& s = self->state;
        const auto& kv = s.core.exec->kv();
        return rank_stats{s.cfg.name, kv.num_free_pages(), kv.layout().num_pages,
                          static_cast<uint32_t>(s.requests.size()), static_cast<uint32_t>(s.waiting.size()),
                          s.num_jobs_done};
      },
      [=](events_atom) { return self->state.core.log->snapshot(); },
      [=](exec_done_atom, uint64_t job_id, std::vector<std::vector<float>>& logits) {
        auto& s = self->state;
        const auto cj = take_job(self, job_id);
        if (!cj) return;
        pump(self);
        const auto rid = &cj->request_id;
        auto i = s.requests.find(*rid);
        if (i == s.requests.end()) return;
        auto& r = i->second;
        --r.jobs_in_executor;
        if (cj->attempt != r.attempt) return maybe_restart(self, *rid);  // an aborted attempt's chunk
        ++r.chunks_done;
        r.tokens_left -= std::min<uint64_t>(r.tokens_left, cj->tokens);
        if (r.chunks_done == r.num_chunks && !logits.empty() && !logits[0].empty()) {
          const gpu::sampling_config sc{r.order.temperature, r.order.seed, r.order.top_k, r.order.top_p,
                                        r.order.repetition_penalty, r.order.presence_penalty};
          r.first_token =
              gpu::sample_token(logits[0], sc, static_cast<uint32_t>(r.order.tokens.size()), &r.order.tokens);
          if (r.order.return_logits) r.logits = std::move(logits[0]);
          r.have_logits = true;
        }
        finish_if_done(self, *rid);
      },
      [=](exec_fail_atom, uint64_t job_id, std::string& what) {
        const auto cj = take_job(self, job_id);
        if (!cj) return;
        if (auto i = self->state.requests.find(cj->request_id); i != self->state.requests.end()) {
          --i->second.jobs_in_executor;
          if (cj->attempt != i->second.attempt) {  // stopped at the gate of an aborted attempt
            maybe_restart(self, cj->request_id);
            pump(self);
            return;
          }
          ++i->second.chunks_done;
        }
        fail_request(self, cj->request_id, errc::executor_failed, "prefill", what);
        finish_if_done(self, cj->request_id);
        pump(self);
      },
      [=](exec_start_atom, uint64_t job_id) {
        auto& s = self->state;
        auto j = s.job_to_request.find(job_id);
        if (j == s.job_to_request.end()) return;
        if (auto i = s.requests.find(j->second.request_id); i != s.requests.end())
          i->second.queue_us =
              std::chrono::duration_cast<std::chrono::microseconds>(self->clock().now() - i->second.arrived_at).count();
      },
      [=](timer_atom, uint64_t id) { self->state.core.runner->fire(id); },
      [=](store_layer_landed& ev) { on_layer_landed(self, ev); },
      [=](split_peer& p) { on_split_peer(self, std::move(p)); },
      [=](split_layer& ev) { on_split_layer(self, ev); },
      [=](xfer_atom, uint64_t request_id, uint32_t layer, uint64_t xfer_id, uint64_t checksum, uint32_t attempt) {
        pending_put p{request_id, layer, xfer_id, checksum, self->clock().now(), attempt};
        if (settle(self, p)) return;
        track_put(self, p);
      },
      [=](keepalive_atom) {
        auto& s = self->state;
        s.keepalive_scheduled = false;
        s.waiting.for_each([&](const waiting_order& w) {
          self->send(w.order.decode, keepalive_atom::value, w.order.request_id, w.order.grant.lease_id);
        });
        for (const auto& [id, r] : s.requests)
          if (r.load.outstanding > 0) self->send(r.order.decode, keepalive_atom::value, id, r.order.grant.lease_id);
        schedule_keepalive(self);
      },
      [=](poll_atom) {
        auto& s = self->state;
        s.poll_scheduled = false;
        std::vector<pending_put> still;
        for (const auto& p : s.pending)
          if (!settle(self, p)) still.push_back(p);
        s.pending = std::move(still);
        if (!s.pending.empty()) {
          s.poll_scheduled = true;
          self->delayed_send(self, std::chrono::microseconds{s.cfg.poll_interval_us}, poll_atom::value);
        }
      },
  };
}

}  // namespace

prefill_rank_actor spawn_prefill_rank(caf::actor_system& sys, prefill_rank_config cfg,
                                      std::shared_ptr<gpu::executor> exec,
                                      std::shared_ptr<transport::transport> xport,
                                      prefill_balancer_actor balancer, store_access store) {
  return sys.spawn(prefill_rank_impl, std::move(cfg), std::move(exec), std::move(xport), std::move(balancer),
                   std::move(store));
}

}  // namespace baton
