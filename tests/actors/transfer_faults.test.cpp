// A prefill rank whose KV puts fail in more than one way at once: the request is answered as
// soon as nothing of it can still land (not at its prefill timeout), the rank gives its pages
// back, and an answer that may leave a put in flight always says transfer_failed, so that the
// decode rank keeps the lease's pages out of reuse until the quarantine.

#include <doctest/doctest.h>

#include <thread>

#include "gpu/cpu_executor.hpp"
#include "gpu/fault_executor.hpp"
#include "tests/actors/cluster_fixture.hpp"
#include "transport/fault_proxy.hpp"

using namespace baton;

namespace {

using executor_hook = std::function<std::shared_ptr<gpu::executor>(std::shared_ptr<gpu::executor>)>;

/// One prefill and one decode rank; prefill-0's transport is `inner` wrapped in `outer` (two
/// fault proxies: the outer one sees each put first), for request 1 only.
struct two_fault_cluster {
  test::cluster_system t;
  local_cluster_config cfg;
  local_cluster cluster;
  std::unique_ptr<test::cluster_system::stopper> stop;
  two_fault_cluster(transport::fault_plan outer, transport::fault_plan inner, executor_hook hook = {}) {
    cfg.num_prefill_ranks = 1;
    cfg.num_decode_ranks = 1;
    cfg.executor.num_threads = 1;
    cfg.executor.num_kv_pages = 64;
    cfg.prefill.chunk_tokens = 16;
    cfg.router.request.max_attempts = 1;  // how one attempt's failure surfaces
    cfg.router.request.lease_ms = 300;
    // Far past the send timeout: a request answered only at this timeout would say so.
    cfg.router.request.prefill_timeout_ms = 40000;
    cfg.prefill.kv_send_timeout_ms = 300;
    cfg.decode.kv_quarantine_ms = 1500;
    // The prefill rank holds the source pages of a put it gave up as long (the transport may
    // still read them): one cluster, one quarantine.
    cfg.prefill.late_put_quarantine_ms = 1500;
    outer.for_request = 1;
    inner.for_request = 1;
    executor_factory make_exec;
    if (hook) {
      auto weights = std::make_shared<const gpu::model_weights>(gpu::make_seeded_weights(cfg.model, cfg.weights_seed));
      make_exec = [this, weights, hook](const std::string& name) -> std::shared_ptr<gpu::executor> {
        std::shared_ptr<gpu::executor> exec = gpu::make_cpu_executor(cfg.model, weights, cfg.executor);
        return name == "prefill-0" ? hook(exec) : exec;
      };
    }
    cluster = start_local_cluster(t.sys, cfg, make_exec,
                                  [outer, inner](std::unique_ptr<transport::transport> base,
                                                 const std::string& name) -> std::shared_ptr<transport::transport> {
                                    if (name != "prefill-0") return std::shared_ptr<transport::transport>{std::move(base)};
                                    return std::shared_ptr<transport::transport>{
                                        transport::make_fault_proxy(transport::make_fault_proxy(std::move(base), inner), outer)};
                                  });
    stop.reset(new test::cluster_system::stopper{t, cluster});
  }
  std::string fail_first() {
    generate_request req;
    req.prompt = "def fibonacci(n): return n if n < 2 else fibonacci(n-1)";  // several chunks
    req.max_tokens = 6;
    auto got = t.generate(cluster.router, req);
    return got ? std::string{"no error"} : t.sys.render(got.error());
  }
  /// Waits (bounded) until both ranks have every page free again.
  bool pages_back() {
    for (int i = 0; i < 500; ++i) {
      if (t.stats(cluster.decode[0].handle).num_free_pages == cfg.executor.num_kv_pages &&
          t.stats(cluster.prefill[0].handle).num_free_pages == t.stats(cluster.prefill[0].handle).num_total_pages)
        return true;
      std::this_thread::sleep_for(std::chrono::milliseconds{10});
    }
    return false;
  }
  bool decode_event(const std::string& kind) {
    for (const auto& e : t.events(cluster.decode[0].handle))
      if (e.kind == kind) return true;
    return false;
  }
  bool prefill_event(const std::string& kind) {
    for (const auto& e : t.events(cluster.prefill[0].handle))
      if (e.kind == kind) return true;
    return false;
  }
  void serves_next() {
    generate_request req;
    req.prompt = "and the next one";
    req.max_tokens = 3;
    auto got = t.generate(cluster.router, req);
    CHECK_MESSAGE(got, t.sys.render(got.error()));
  }
};

}  // namespace

TEST_CASE("a put that fails while the prompt's other layers stall: the request is answered once the stalled puts "
          "are given up (not at its prefill timeout), and both ranks get their pages back") {
  // The last layer's put fails; the puts of the layers before it, posted earlier, stall, and each
  // is given up at the send timeout, after the prompt has already failed. Each of those must
  // look at the answer again: the last one sends it.
  two_fault_cluster f{{transport::fault_kind::fail, 3, {}, 1, 1}, {transport::fault_kind::stall, {}, {}, 1000, 1}};
  const auto text = f.fail_first();
  CHECK_MESSAGE(text.find("transfer_failed") != std::string::npos, text);
  CHECK_MESSAGE(text.find("stage kv_send") != std::string::npos, text);
  CHECK_MESSAGE(text.find("layer 3") != std::string::npos, text);  // the first failure, not the prefill timeout
  CHECK(f.pages_back());
  CHECK(f.decode_event("quarantine_expired"));  // the given-up puts' pages waited out the quarantine
  // ... and so did their source pages on the prefill rank: a put given up is not recalled, and
  // the transport may read its source when it gets to it (reused, they would send another
  // prompt's KV).
  CHECK(f.prefill_event("pages_held"));
  CHECK(f.prefill_event("pages_unheld"));
  CHECK_FALSE(f.decode_event("step"));
  f.serves_next();
}

TEST_CASE("a prompt that fails in its executor while a layer's put stalls is answered transfer_failed once the put is "
          "given up: it may still land, so the lease's pages must wait out the quarantine") {
  // Layer 2's MLP fails after layers 0-2 were announced; layer 1's put stalls (the others land).
  two_fault_cluster f{{transport::fault_kind::stall, 1, {}, 1000, 1},
                      {transport::fault_kind::delay, {}, {}, 1, 1},
                      [](std::shared_ptr<gpu::executor> exec) { return gpu::make_fault_failing_prefill_executor(exec, 2); }};
  const auto text = f.fail_first();
  CHECK_MESSAGE(text.find("transfer_failed") != std::string::npos, text);
  CHECK_MESSAGE(text.find("may still land") != std::string::npos, text);
  CHECK(f.pages_back());
  CHECK(f.decode_event("quarantine_expired"));
}

TEST_CASE("a put refused as outside its region fails the request as layout_mismatch at once, with attempts left: "
          "another lease would be refused the same way; a put that merely failed is placed again") {
  for (const auto kind : {transport::fault_kind::refuse, transport::fault_kind::fail}) {
    CAPTURE(static_cast<int>(kind));
    test::cluster_system t;
    local_cluster_config cfg;
    cfg.num_prefill_ranks = 1;
    cfg.num_decode_ranks = 1;
    cfg.executor.num_threads = 1;
    cfg.executor.num_kv_pages = 64;
    cfg.router.request.max_attempts = 3;
    cfg.router.request.retry_backoff_ms = 1;
    // The first put only: a second attempt would find the transport sound.
    auto cluster = start_local_cluster(t.sys, cfg, {}, test::fault_proxy_on("prefill-0", {kind, 1u, {}, 1}));
    test::cluster_system::stopper stop{t, cluster};
    generate_request req;
    req.prompt = "a layout the decode rank does not share";
    req.max_tokens = 3;
    auto got = t.generate(cluster.router, req);
    if (kind == transport::fault_kind::refuse) {
      REQUIRE_FALSE(got);
      const auto text = t.sys.render(got.error());
      CHECK_MESSAGE(text.find("layout_mismatch") != std::string::npos, text);
      CHECK_MESSAGE(text.find("stage kv_send") != std::string::npos, text);
      CHECK_MESSAGE(text.find("out of bounds") != std::string::npos, text);
    } else {
      REQUIRE_MESSAGE(got, t.sys.render(got.error()));
      CHECK(got->failovers == 1);
    }
  }
}

TEST_CASE("KV checksums that the decode rank checks but no prefill rank makes are refused by name (every layer would "
          "fail); both off, as the sims' modelled KV, is allowed") {
  local_cluster_config cfg;
  cfg.prefill.checksum_kv = false;
  CHECK(cfg.validate().find("prefill.checksum_kv is off but decode.verify_kv_checksums is on") == 0);
  cfg.decode.verify_kv_checksums = false;
  CHECK(cfg.validate().empty());
}
