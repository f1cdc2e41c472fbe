#include <algorithm>
#include <cstdio>
#include <thread>

#include <caf/actor_system.hpp>
#include <caf/actor_system_config.hpp>
#include <caf/scoped_actor.hpp>

#include "actors/local_cluster.hpp"
#include "actors/messages.hpp"
#include "deploy/commands.hpp"
#include "deploy/flags.hpp"
#include "gpu/byte_tokenizer.hpp"

namespace baton::deploy {

namespace {

struct local_options {
  local_cluster_config cluster;
  std::vector<std::string> prompts = {
      "The capital of France is",
      "def fibonacci(n):",
      "Once upon a time, in a land far away,",
      "Prefill and decode, disaggregated:",
  };
  uint32_t max_tokens = 24;
  float temperature = 0.0f;
  uint32_t scheduler_threads = 0;  ///< 0 = number of hardware threads
  uint32_t timeout_ms = 120000;
};

double mean(const std::vector<int64_t>& xs) {
  if (xs.empty()) return 0.0;
  double s = 0;
  for (auto x : xs) s += static_cast<double>(x);
  return s / static_cast<double>(xs.size());
}

}  // namespace

int run_local(const std::vector<std::string>& args) {
  local_options opt;
  flag_set flags;
  flags.add("--prefill-ranks", &opt.cluster.num_prefill_ranks, "prefill ranks");
  flags.add("--decode-ranks", &opt.cluster.num_decode_ranks, "decode ranks");
  flags.add("--executor-threads", &opt.cluster.executor.num_threads, "math threads per rank's executor");
  flags.add("--kv-pages", &opt.cluster.executor.num_kv_pages, "KV pages per rank");
  flags.add("--page-tokens", &opt.cluster.executor.page_size_tokens, "tokens per KV page");
  flags.add("--chunk-tokens", &opt.cluster.prefill.chunk_tokens, "prefill chunk size in tokens");
  flags.add("--weights-seed", &opt.cluster.weights_seed, "seed of the built-in model's weights");
  flags.add("--prompt", &opt.prompts, "a prompt to answer (repeat for several)");
  flags.add("--max-tokens", &opt.max_tokens, "tokens to generate per prompt");
  flags.add("--temperature", &opt.temperature, "0 = greedy");
  flags.add("--scheduler-threads", &opt.scheduler_threads, "CAF scheduler threads (0 = hardware threads)");
  flags.add("--timeout-ms", &opt.timeout_ms, "give up on a request after this long");
  if (auto err = flags.parse(args); !err.empty()) {
    std::fprintf(stderr, "baton local: %s\n", err.c_str());
    return 2;
  }
  if (flags.help_requested()) {
    std::printf("usage: baton local [flags]\n\n%s", flags.usage().c_str());
    return 0;
  }
  if (auto err = opt.cluster.validate(); !err.empty()) {
    std::fprintf(stderr, "baton local: %s\n", err.c_str());
    return 2;
  }

  caf::actor_system_config cfg;
  register_message_types(cfg);
  const unsigned threads = opt.scheduler_threads ? opt.scheduler_threads : std::max(2u, std::thread::hardware_concurrency());
  cfg.set("scheduler.max-threads", threads);
  cfg.set("logger.console-verbosity", caf::atom("quiet"));
  caf::actor_system sys{cfg};

  const auto& m = opt.cluster.model;
  std::printf("baton local: model %s (%u layers, hidden %u, %.2fM parameters), %u prefill + %u decode ranks, "
              "executor %u thread(s) each\n",
              m.name.c_str(), m.num_hidden_layers, m.hidden_size, static_cast<double>(m.num_parameters()) / 1e6,
              opt.cluster.num_prefill_ranks, opt.cluster.num_decode_ranks, opt.cluster.executor.num_threads);
  auto cluster = start_local_cluster(sys, opt.cluster);

  caf::scoped_actor self{sys};
  struct pending {
    std::string prompt;
    decltype(self->request(cluster.router, caf::infinite, generate_atom::value, generate_request{})) handle;
  };
  std::vector<pending> inflight;
  for (const auto& p : opt.prompts) {
    generate_request req;
    req.prompt = p;
    req.max_tokens = static_cast<int32_t>(opt.max_tokens);
    req.temperature = opt.temperature;
    inflight.push_back({p, self->request(cluster.router, std::chrono::milliseconds{opt.timeout_ms},
                                         generate_atom::value, std::move(req))});
  }
  int failures = 0;
  for (auto& f : inflight) {
    f.handle.receive(
        [&](const completion& c) {
          std::printf("\n[request %llu] %s -> %s\n", static_cast<unsigned long long>(c.request_id),
                      c.prefill_rank.c_str(), c.decode_rank.c_str());
          std::printf("  prompt : %s\n", gpu::byte_tokenizer::escape(f.prompt).c_str());
          std::printf("  output : %s\n", gpu::byte_tokenizer::escape(c.text).c_str());
          std::printf("  tokens : %zu (%s)   TTFT %.3f ms   mean TBT %.3f ms\n", c.tokens.size(),
                      c.finish_reason.c_str(), static_cast<double>(c.ttft_us) / 1000.0, mean(c.tbt_us) / 1000.0);
        },
        [&](const caf::error& err) {
          ++failures;
          std::printf("\n[request] %s\n  error  : %s\n", gpu::byte_tokenizer::escape(f.prompt).c_str(),
                      sys.render(err).c_str());
        });
  }
  std::printf("\nbaton local: %zu requests, %d failed\n", inflight.size(), failures);
  self->send_exit(cluster.router, caf::exit_reason::user_shutdown);
  for (auto& r : cluster.prefill) self->send_exit(r.handle, caf::exit_reason::user_shutdown);
  for (auto& r : cluster.decode) self->send_exit(r.handle, caf::exit_reason::user_shutdown);
  return failures == 0 ? 0 : 1;
}

}  // namespace baton::deploy
