#pragma once

// What the batching and KV-memory tests share, on small_cluster()s: requests that stream their
// logits, bounded waits, and the colocated reference their answers must equal bit for bit.

#include <doctest/doctest.h>

#include <thread>

#include "gpu/byte_tokenizer.hpp"
#include "gpu/cpu_executor.hpp"
#include "gpu/local_generate.hpp"
#include "tests/actors/cluster_fixture.hpp"
#include "tests/test_util.hpp"

namespace baton::test {

/// Waits (bounded) until the decode rank has run at least `n` steps.
inline void wait_for_steps(cluster_system& t, const decode_rank_actor& decode, uint64_t n) {
  for (int i = 0; i < 10000 && t.stats(decode).num_steps < n; ++i) std::this_thread::sleep_for(std::chrono::milliseconds{1});
  REQUIRE(t.stats(decode).num_steps >= n);
}

/// Each request's completion, in order; a failed request fails the test, naming it.
template <class Handle>
std::vector<completion> collect_all(cluster_system& t, std::vector<Handle>& handles) {
  std::vector<completion> done(handles.size());
  for (size_t i = 0; i < handles.size(); ++i)
    handles[i].receive([&](completion& c) { done[i] = std::move(c); },
                       [&](caf::error& e) { FAIL("request " << i << " failed: " << t.sys.render(e)); });
  return done;
}

/// A streaming request that returns its logits and ignores <eos>, sent from `self`.
inline auto send_request(caf::scoped_actor& self, const router_actor& router, const std::string& prompt, int32_t max_tokens) {
  generate_request req;
  req.prompt = prompt;
  req.max_tokens = max_tokens;
  req.return_logits = true;
  req.ignore_eos = true;
  return self->request(router, std::chrono::seconds{60}, generate_atom::value, std::move(req));
}

/// Each completion's tokens and logits equal its prompt run alone, colocated, in chunks of `chunk`.
inline void check_colocated(const local_cluster_config& cfg, const std::vector<std::string>& prompts,
                            const std::vector<completion>& done, uint32_t chunk = 16) {
  auto weights = std::make_shared<const gpu::model_weights>(gpu::make_seeded_weights(cfg.model, cfg.weights_seed));
  for (size_t i = 0; i < prompts.size(); ++i) {
    auto exec = gpu::make_cpu_executor(cfg.model, weights, cfg.executor);
    const auto prompt = gpu::byte_tokenizer{cfg.model.bos_token_id, cfg.model.eos_token_id}.encode(prompts[i]);
    auto ref = gpu::generate_colocated(*exec, prompt, done[i].tokens.size(), chunk, {}, true);
    CHECK(done[i].tokens == ref.tokens);
    REQUIRE(done[i].step_logits.size() == ref.step_logits.size());
    for (size_t k = 0; k < ref.step_logits.size(); ++k)
      CHECK_MESSAGE(same_bits(done[i].step_logits[k], ref.step_logits[k]), "request " << i << " step " << k);
  }
}

}  // namespace baton::test
