#pragma once

// A real-threaded actor system with an in-process cluster, for actor tests.

#include <algorithm>
#include <thread>

#include <caf/actor_system.hpp>
#include <caf/actor_system_config.hpp>
#include <caf/scoped_actor.hpp>

#include "actors/local_cluster.hpp"
#include "actors/messages.hpp"
#include "gpu/byte_tokenizer.hpp"
#include "gpu/cpu_executor.hpp"
#include "gpu/fault_executor.hpp"
#include "gpu/local_generate.hpp"
#include "transport/fault_proxy.hpp"
#include "transport/kv_wire.hpp"

namespace baton::test {

/// The prefill chunk of small_cluster(): tests run their colocated references with the same.
inline constexpr uint32_t chunk_tokens = 16;

/// One prefill rank and one decode rank, one executor thread each, 64 KV pages, chunks of
/// chunk_tokens. Faults injected on prefill-0's transport meet every prompt.
inline local_cluster_config small_cluster() {
  local_cluster_config cfg;
  cfg.num_prefill_ranks = 1;
  cfg.num_decode_ranks = 1;
  cfg.executor.num_threads = 1;
  cfg.executor.num_kv_pages = 64;
  cfg.prefill.chunk_tokens = chunk_tokens;
  return cfg;
}

/// small_cluster, in hybrid PD when asked: short prompts are then prefilled on the decode rank,
/// whose step picks the first token, instead of on the prefill rank.
inline local_cluster_config small_cluster(bool hybrid) {
  auto cfg = small_cluster();
  if (hybrid) cfg.router.request.hybrid_prefill_below_tokens = 1000;
  return cfg;
}

/// The same prompt on one executor, same chunk schedule, same weights: the cluster's reference.
inline gpu::colocated_generation colocated(const local_cluster_config& cfg, const std::vector<int32_t>& prompt,
                                           uint32_t max_tokens, const gpu::sampling_config& sampling = {}) {
  auto weights = std::make_shared<const gpu::model_weights>(gpu::make_seeded_weights(cfg.model, cfg.weights_seed));
  auto exec = gpu::make_cpu_executor(cfg.model, weights, cfg.executor);
  return gpu::generate_colocated(*exec, prompt, max_tokens, chunk_tokens, sampling);
}

/// The built-in model's tokens of `text` (its byte tokenizer).
inline std::vector<int32_t> encode(const local_cluster_config& cfg, const std::string& text) {
  return gpu::byte_tokenizer{cfg.model.bos_token_id, cfg.model.eos_token_id}.encode(text);
}

/// Prompts of 1 chunk, several chunks, and 65 tokens (five pages of 16, the last holding one).
inline const std::vector<std::string> prompts = {
    "The capital of France is",                                  // < one chunk
    "def fibonacci(n): return n if n < 2 else fibonacci(n-1)",   // several chunks
    "Once upon a time, in a land far away, there lived a decode rank.",
};

/// What a handoff in wire form `f` does to a prompt's KV, for generate_colocated: every page
/// the prompt reaches, each layer, through the wire form and back, in place (as whole pages, as
/// the handoff sends them, the last page's rows past the prompt as zeros). The colocated run is
/// then the exact reference of that handoff.
inline gpu::after_prefill_fn wire_round_trip(transport::wire_format f) {
  return [f](gpu::kv_cache& kv, const std::vector<uint32_t>& pages, uint32_t prompt_tokens) {
    const auto& lay = kv.layout();
    const uint64_t values = lay.page_bytes() / sizeof(float), plane = uint64_t{lay.page_size_tokens} * lay.kv_dim;
    const uint32_t n = kv.pages_for_tokens(prompt_tokens), tail = prompt_tokens % lay.page_size_tokens;
    std::vector<uint8_t> wire(transport::wire_bytes(f, values));
    for (uint32_t l = 0; l < lay.num_layers; ++l)
      for (uint32_t i = 0; i < n; ++i) {
        float* page = kv.k_at(l, pages[i], 0);
        if (tail > 0 && i + 1 == n)
          for (uint64_t p = 0; p * plane < values; ++p)
            std::fill(page + p * plane + uint64_t{tail} * lay.kv_dim, page + (p + 1) * plane, 0.0f);
        // A value with no wire form leaves its page as it is: the handoff fails that request instead.
        if (!transport::wire_encode(f, page, values, wire.data()).empty()) continue;
        transport::wire_decode(f, wire.data(), values, page);
      }
  };
}

struct cluster_system {
  caf::actor_system_config cfg;
  caf::actor_system sys;
  static caf::actor_system_config& init(caf::actor_system_config& c) {
    register_message_types(c);
    c.set("scheduler.max-threads", 2);
    c.set("logger.console-verbosity", caf::atom("quiet"));
    return c;
  }
  cluster_system() : sys(init(cfg)) {}

  /// Sends one request and waits (bounded) for its completion or error.
  caf::expected<completion> generate(const router_actor& router, generate_request req) {
    caf::scoped_actor self{sys};
    caf::expected<completion> out{caf::error{}};
    self->request(router, std::chrono::seconds{60}, generate_atom::value, std::move(req))
        .receive([&](completion& c) { out = std::move(c); }, [&](caf::error& e) { out = std::move(e); });
    return out;
  }

  template <class Handle>
  std::vector<rank_event> events(const Handle& rank) {
    caf::scoped_actor self{sys};
    std::vector<rank_event> out;
    self->request(rank, std::chrono::seconds{10}, events_atom::value)
        .receive([&](std::vector<rank_event>& e) { out = std::move(e); }, [&](caf::error&) {});
    return out;
  }

  template <class Handle>
  rank_stats stats(const Handle& rank) {
    caf::scoped_actor self{sys};
    rank_stats out;
    self->request(rank, std::chrono::seconds{10}, stats_atom::value)
        .receive([&](rank_stats& s) { out = std::move(s); }, [&](caf::error&) {});
    return out;
  }

  /// Waits (bounded) until every in-process rank has registered with its balancer: ranks
  /// register by reporting their load once they start, asynchronously.
  bool wait_registered(const local_cluster& c) {
    return await_ranks_registered(sys, c.router, c.rank_names(), std::chrono::seconds{10}).empty();
  }

  /// Stops the cluster when the test leaves scope, also after a failed REQUIRE (the actor
  /// system's destructor waits for every actor).
  struct stopper {
    cluster_system& t;
    const local_cluster& c;
    ~stopper() { t.stop(c); }
  };

  void stop(const local_cluster& c) {
    caf::scoped_actor self{sys};
    for (auto& a : c.actors()) self->send_exit(a, caf::exit_reason::user_shutdown);
  }
};

/// Wraps rank `rank`'s transport in a fault proxy running `plan`; the other ranks' go unwrapped.
inline transport_wrapper fault_proxy_on(std::string rank, transport::fault_plan plan) {
  return [rank = std::move(rank), plan](std::unique_ptr<transport::transport> inner,
                                        const std::string& name) -> std::shared_ptr<transport::transport> {
    if (name != rank) return std::shared_ptr<transport::transport>{std::move(inner)};
    return std::shared_ptr<transport::transport>{transport::make_fault_proxy(std::move(inner), plan)};
  };
}

/// A cluster whose ranks named `prefix`... ("decode", "prefill") start each job `delay_ms` late (a
/// fault executor): work in progress stays in progress long enough for the test's next message to
/// find it, however loaded the machine.
inline local_cluster start_with_slow_ranks(caf::actor_system& sys, const local_cluster_config& cfg,
                                           const std::string& prefix, uint32_t delay_ms) {
  auto weights = std::make_shared<const gpu::model_weights>(gpu::make_seeded_weights(cfg.model, cfg.weights_seed));
  return start_local_cluster(sys, cfg, [cfg, weights, prefix, delay_ms](const std::string& name) -> std::shared_ptr<gpu::executor> {
    std::shared_ptr<gpu::executor> exec = gpu::make_cpu_executor(cfg.model, weights, cfg.executor);
    return name.rfind(prefix, 0) == 0 ? gpu::make_fault_slow_executor(exec, delay_ms) : exec;
  });
}

}  // namespace baton::test
