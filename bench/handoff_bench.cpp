// Exposed KV transfer time of a disaggregated prefill: the moment every layer of KV has landed
// and been verified at the decode rank minus the moment the prefill's last layer finished
// computing, against (a) one layer's send time and (b) the time to send all layers after the
// prefill, both measured with the same transport in the same run. Layer-wise sends hide under
// compute when (exposed) is close to one layer's send, not to (b). A layer's send starts once
// its KV is written (executor_sink::on_layer_kv_ready), so the last layer's send can hide under
// that layer's own attention and MLP: the landed-minus-computed difference may be negative, and
// the exposed time is then zero. The table also gives the last layer's KV-written-to-landed
// time, the transfer's own latency whether or not compute hides it.
//
// Usage: baton_bench_handoff [--model tiny|100m|deepseek-v3-tiny] [--prompt-tokens N]
//        [--transport ucx|loopback] [--wire f32|int8|int4] [--verbose]  (per-layer posted -> ready
//        times on stderr; put it last). --wire sends the KV in that form (issue 6's wire
//        quantisation): the send columns then move the wire form's bytes, and the landed times
//        include the prefill rank's encoding and the decode rank's check and expansion.
//
//        baton_bench_handoff --compare-shapes [--prompt-tokens N] [--transport ucx|loopback]
//        KV bytes per token and the P->D transfer time of one request's KV, every layer sent
//        layer by layer as a prefill rank sends it, for the DeepSeek-V3 shape (MLA latent) against
//        a Llama-3-70B-like GQA shape at the same prompt length (issue 13's comparison).

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>

#include <caf/actor_system.hpp>
#include <caf/actor_system_config.hpp>
#include <caf/scoped_actor.hpp>

#include "actors/local_cluster.hpp"
#include "transport/kv_wire.hpp"
#include "transport/loopback.hpp"
#include "transport/ucx.hpp"
#include "bench/bench_flags.hpp"

using namespace baton;
using clock_type = std::chrono::steady_clock;

namespace {

std::unique_ptr<transport::transport> make(const std::string& kind, std::shared_ptr<transport::loopback_fabric> f,
                                           const std::string& name) {
  if (kind == "loopback") return transport::make_loopback_transport(std::move(f), name);
  std::string why;
  auto t = transport::make_ucx_transport({name}, &why);
  if (!t) std::fprintf(stderr, "ucx: %s\n", why.c_str());
  return t;
}

/// Microseconds to send `num_layers` layers of `layer_bytes` back to back (all posted, then all
/// awaited), median of 5.
double send_us(const std::string& kind, uint64_t layer_bytes, uint32_t num_layers) {
  auto fabric = transport::make_loopback_fabric();
  auto a = make(kind, fabric, "a");
  std::shared_ptr<transport::transport> b = make(kind, fabric, "b");
  std::vector<std::byte> src(layer_bytes * num_layers, std::byte{1});
  transport::xfer_error err;
  // The destination in b's own memory, as a decode rank's KV pool is (kv_pool_in).
  auto dst = transport::transport_memory(b, src.size(), &err);
  if (!dst) return std::fprintf(stderr, "no destination memory: %s\n", err.to_string().c_str()), -1.0;
  auto ka = a->register_region(src.data(), src.size(), &err);
  auto kb = b->register_region(dst.get(), src.size(), &err);
  std::vector<double> runs;
  for (int rep = 0; rep < 5; ++rep) {
    auto t0 = clock_type::now();
    std::vector<uint64_t> ids;
    for (uint32_t l = 0; l < num_layers; ++l)
      ids.push_back(a->post_put({0, l, "b", ka->region_id, *kb, {{l * layer_bytes, l * layer_bytes, layer_bytes}}}));
    for (auto id : ids) {
      while (a->poll(id, &err) == transport::xfer_state::pending) std::this_thread::yield();
      a->release(id);
    }
    runs.push_back(std::chrono::duration<double, std::micro>(clock_type::now() - t0).count());
  }
  std::sort(runs.begin(), runs.end());
  return runs[2];
}

/// Issue 13: what MLA's latent saves on the wire. Sizes come from the layouts (model_config);
/// times are measured here, sending fp32 pages (what Baton's CPU ranks hold) from registered
/// memory larger than the caches, layer by layer, median of 5.
/// Microseconds for one cold memcpy of `bytes` (buffers touched first, median of 5): the
/// in-host ceiling the transport's throughput is read against.
double memcpy_us(uint64_t bytes) {
  std::vector<std::byte> src(bytes, std::byte{1}), dst(bytes, std::byte{0});
  std::vector<double> runs;
  for (int rep = 0; rep < 5; ++rep) {
    auto t0 = clock_type::now();
    std::memcpy(dst.data(), src.data(), bytes);
    runs.push_back(std::chrono::duration<double, std::micro>(clock_type::now() - t0).count());
  }
  std::sort(runs.begin(), runs.end());
  return runs[2];
}

int compare_shapes(const std::string& kind, uint32_t prompt_tokens) {
  std::printf("| shape | KV per token per layer | KV per token, all layers (fp32 / bf16) | one request's KV at %u "
              "tokens (fp32) | P->D send, all layers (%s, measured) | throughput | memcpy of the same bytes |\n",
              prompt_tokens, kind.c_str());
  std::printf("|---|---|---|---|---|---|---|\n");
  double first_us = 0, first_bytes = 0;
  for (const auto& m : {gpu::llama3_70b_config(), gpu::deepseek_v3_config()}) {
    const uint64_t per_layer_token = uint64_t{m.kv_values_per_token()} * sizeof(float);
    const uint64_t per_token = per_layer_token * m.num_hidden_layers;
    const uint64_t layer_bytes = per_layer_token * prompt_tokens;
    const double us = send_us(kind, layer_bytes, m.num_hidden_layers);
    const double bytes = static_cast<double>(layer_bytes) * m.num_hidden_layers;
    const double copy = memcpy_us(static_cast<uint64_t>(bytes));
    std::printf("| %s (%s, %u layers) | %u values | %.1f KiB / %.1f KiB | %.1f MiB | %.1f ms | %.2f GB/s | %.1f ms, "
                "%.2f GB/s |\n",
                m.name.c_str(), m.is_mla() ? "MLA latent 512 + 64" : "GQA 8 KV heads x 128, K and V", m.num_hidden_layers,
                m.kv_values_per_token(), per_token / 1024.0, per_token / 2048.0, bytes / (1 << 20), us / 1e3,
                bytes / us / 1e3, copy / 1e3, bytes / copy / 1e3);
    if (first_us == 0) first_us = us, first_bytes = bytes;
    else std::printf("\nDeepSeek-V3 / Llama-3-70B: %.3fx the bytes, %.3fx the send time\n", bytes / first_bytes, us / first_us);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::string model = "100m", kind = "ucx", wire_word = "f32";
  uint32_t prompt_tokens = 512;
  bool verbose = false;
  bool shapes = false;
  bool no_checksum = false;
  deploy::flag_set flags;
  flags.add("--model", &model, "100m, tiny or deepseek-v3-tiny");
  flags.add("--prompt-tokens", &prompt_tokens, "prompt length");
  flags.add("--transport", &kind, "ucx or loopback");
  flags.add("--wire", &wire_word, "KV on the wire: f32, int8 or int4");
  flags.add("--verbose", &verbose, "print each repetition's timeline");
  flags.add("--compare-shapes", &shapes, "compare per-layer puts with one put per sequence instead");
  flags.add("--no-checksum", &no_checksum, "send and check no KV checksums");
  if (auto rc = bench::parse_flags(flags, argc, argv, "[--model M] [--prompt-tokens N] [--transport T] [--wire W] ...")) return *rc;
  const bool checksums = !no_checksum;
  if (model != "100m" && model != "tiny" && model != "deepseek-v3-tiny")
    return std::fprintf(stderr, "--model must be 100m, tiny or deepseek-v3-tiny, got '%s'\n", model.c_str()), 2;
  const auto wire = transport::wire_format_from(wire_word);
  if (!wire) return std::fprintf(stderr, "--wire must be f32, int8 or int4, got '%s'\n", wire_word.c_str()), 2;
  if (shapes) return compare_shapes(kind, prompt_tokens);
  local_cluster_config cfg;
  cfg.model = model == "tiny"               ? gpu::builtin_tiny_config()
              : model == "deepseek-v3-tiny" ? gpu::deepseek_tiny_config(true)
                                            : gpu::llama_100m_config();
  cfg.num_prefill_ranks = 1;
  cfg.num_decode_ranks = 1;
  cfg.transport = kind;
  cfg.prefill.chunk_tokens = prompt_tokens;
  cfg.prefill.checksum_kv = checksums;
  cfg.decode.verify_kv_checksums = checksums;
  cfg.router.request.kv_wire.chat = *wire;  // the bench's requests are chat's
  cfg.executor.num_kv_pages = (prompt_tokens + 64) / 16 + 8;
  caf::actor_system_config sys_cfg;
  register_message_types(sys_cfg);
  sys_cfg.set("scheduler.max-threads", 2);
  sys_cfg.set("work-stealing.moderate-poll-attempts", 0);
  caf::actor_system sys{sys_cfg};
  auto cluster = start_local_cluster(sys, cfg);
  caf::scoped_actor self{sys};

  const uint32_t layers = cfg.model.num_hidden_layers;
  // The actor system waits for the cluster's actors when main returns: stop them on every path.
  auto stop_cluster = [&] {
    for (auto& a : cluster.actors()) self->send_exit(a, caf::exit_reason::user_shutdown);
  };
  std::vector<double> exposed, lm_head, admitted, hidden_under, last_latency;
  for (int rep = 0; rep < 3; ++rep) {
    generate_request req;
    req.prompt_tokens.assign(prompt_tokens, 65);
    req.prompt_tokens[0] = cfg.model.bos_token_id;
    req.max_tokens = 2;
    req.ignore_eos = true;
    uint64_t id = 0;
    self->request(cluster.router, std::chrono::seconds{600}, generate_atom::value, req)
        .receive([&](completion& c) { id = c.request_id; }, [&](caf::error& e) { std::fprintf(stderr, "%s\n", sys.render(e).c_str()); });
    if (id == 0) return stop_cluster(), 1;
    int64_t last_compute = 0, last_kv = 0, first_token = 0, landed = 0, admit = 0;
    self->request(cluster.prefill[0].handle, std::chrono::seconds{10}, events_atom::value)
        .receive([&](std::vector<rank_event>& ev) {
                   std::vector<int64_t> posted(layers, 0);
                   for (auto& e : ev) {
                     if (e.request_id != id) continue;
                     if (e.kind == "compute_done" && e.layer == layers - 1) last_compute = e.wall_ns;
                     if (e.kind == "kv_written" && e.layer == layers - 1) last_kv = e.wall_ns;
                     if (e.kind == "first_token") first_token = e.wall_ns;
                     if (e.kind == "send_posted") posted[e.layer] = e.wall_ns;
                     if (e.kind == "layer_ready" && verbose)
                       std::fprintf(stderr, "layer %u: posted -> ready %.0f us\n", e.layer, (e.wall_ns - posted[e.layer]) / 1e3);
                     if (verbose && e.layer == layers - 1 && last_kv)
                       std::fprintf(stderr, "  last layer, prefill %s at +%.0f us after its KV was written\n", e.kind.c_str(),
                                    (e.wall_ns - last_kv) / 1e3);
                   }
                 },
                 [](caf::error&) {});
    self->request(cluster.decode[0].handle, std::chrono::seconds{10}, events_atom::value)
        .receive([&](std::vector<rank_event>& ev) {
                   for (auto& e : ev) {
                     if (e.request_id == id && e.kind == "admit") admit = e.wall_ns;
                     if (e.request_id == id && e.kind == "kv_landed") landed = e.wall_ns;
                     if (verbose && e.request_id == id && e.wall_ns >= last_kv)
                       std::fprintf(stderr, "  decode %s (layer %u) at +%.0f us after the last layer's KV was written\n",
                                    e.kind.c_str(), e.layer, (e.wall_ns - last_kv) / 1e3);
                   }
                 },
                 [](caf::error&) {});
    if (!last_kv || !last_compute || !first_token || !landed || !admit)
      return std::fprintf(stderr, "request %llu: an event is missing from the ranks' logs\n",
                          static_cast<unsigned long long>(id)),
             stop_cluster(), 1;
    exposed.push_back(static_cast<double>(landed - last_compute) / 1000.0);
    lm_head.push_back(static_cast<double>(first_token - last_compute) / 1000.0);
    admitted.push_back(static_cast<double>(admit - first_token) / 1000.0);
    hidden_under.push_back(static_cast<double>(last_compute - last_kv) / 1000.0);
    last_latency.push_back(static_cast<double>(landed - last_kv) / 1000.0);
  }
  for (auto* v : {&exposed, &lm_head, &admitted, &hidden_under, &last_latency}) std::sort(v->begin(), v->end());
  const uint64_t pages = (prompt_tokens + 15) / 16;
  const uint64_t layer_bytes = pages * transport::wire_bytes(*wire, 16 * cfg.model.kv_values_per_token());
  const double one = send_us(kind, layer_bytes, 1), all = send_us(kind, layer_bytes, layers);
  const double exposed_us = std::max(0.0, exposed[1]);
  std::printf("| model | transport | wire | prompt | KV per layer | one layer's send | all %u layers after prefill | "
              "last layer: KV written -> all KV landed | last layer: KV written -> computed | "
              "all KV landed - last layer computed | exposed | exposed / one layer | first token sampled - last layer computed | "
              "decode admission - first token sampled |\n",
              layers);
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  std::printf("| %s | %s | %s | %u tokens | %.2f MiB | %.0f us | %.0f us | %.0f us | %.0f us | %.0f us | %.0f us | %.2f | %.0f us | %.0f us |\n",
              cfg.model.name.c_str(), kind.c_str(), transport::to_string(*wire), prompt_tokens, static_cast<double>(layer_bytes) / (1 << 20), one, all,
              last_latency[1], hidden_under[1], exposed[1], exposed_us, exposed_us / one, lm_head[1], admitted[1]);
  stop_cluster();
  return 0;
}
