#include <doctest/doctest.h>

#include <unistd.h>

#include "actors/config.hpp"
#include "actors/kv_wire_staging.hpp"
#include "actors/local_cluster.hpp"
#include "actors/node_agent.hpp"
#include "deploy/commands.hpp"
#include "deploy/flags.hpp"
#include "deploy/node_options.hpp"
#include "deploy/processes.hpp"

using baton::deploy::flag_set;

TEST_CASE("flags set the config fields they are bound to, and name what is wrong") {
  uint32_t ranks = 1;
  float temp = 0;
  std::vector<std::string> prompts = {"default"};
  bool verbose = false;
  flag_set f;
  f.add("--ranks", &ranks, "ranks");
  f.add("--temperature", &temp, "t");
  f.add("--prompt", &prompts, "p");
  f.add("--verbose", &verbose, "v");
  CHECK(f.parse({"--ranks", "3", "--temperature=0.5", "--prompt", "a", "--prompt=b", "--verbose"}).empty());
  CHECK(ranks == 3);
  CHECK(temp == 0.5f);
  CHECK(prompts == std::vector<std::string>{"a", "b"});
  CHECK(verbose);
  CHECK(f.parse({"--ranks", "-2"}) == "flag --ranks expects a non-negative integer, got '-2'");
  CHECK(f.parse({"--ranks", "99999999999"}) == "flag --ranks is out of range: at most 4294967295, got '99999999999'");
  CHECK(f.parse({"--ranks"}) == "flag --ranks needs a value");
  CHECK(f.parse({"--rank", "2"}) == "unknown flag '--rank' (see --help)");
  CHECK(f.parse({"--temperature", "hot"}) == "flag --temperature expects a number, got 'hot'");
  // A boolean flag with a value says which (`--serve=false` turned serving on before).
  CHECK(f.parse({"--verbose=false"}).empty());
  CHECK_FALSE(verbose);
  CHECK(f.parse({"--verbose=1"}).empty());
  CHECK(verbose);
  CHECK(f.parse({"--verbose=maybe"}) == "flag --verbose takes true or false after '=', got 'maybe'");
  CHECK(f.parse({"loose"}) == "unexpected argument 'loose': this command takes flags only (see --help)");
  // Given twice, the last one wins (as argparse's): a wrapper's default, then its caller's value.
  CHECK(f.parse({"--ranks", "2", "--ranks", "5"}).empty());
  CHECK(ranks == 5);
  // Positional arguments, when collected: whatever is neither a flag nor a flag's value, so a
  // boolean flag never swallows the next flag (baton generate --json-compact --max-tokens 9 "p").
  std::vector<std::string> positional;
  f.collect_positional(&positional);
  CHECK(f.parse({"first", "--verbose", "--ranks", "4", "second", "--prompt", "-x", "-5 degrees"}).empty());
  CHECK(positional == std::vector<std::string>{"first", "second", "-5 degrees"});
  CHECK(ranks == 4);
  CHECK(prompts.back() == "-x");
}

TEST_CASE("--kv-wire reads one form for every traffic class or CLASS=FORM pairs, and names what is wrong") {
  baton::kv_wire_config w;
  using baton::transport::wire_format;
  CHECK(w.for_class("chat") == wire_format::f32);  // off by default
  CHECK(w.parse("int8").empty());
  CHECK((w.chat == wire_format::int8 && w.agent == wire_format::int8 && w.batch == wire_format::int8));
  CHECK(w.parse("chat=f32,batch=int4").empty());
  CHECK((w.chat == wire_format::f32 && w.agent == wire_format::int8 && w.batch == wire_format::int4));
  CHECK(w.for_class("batch") == wire_format::int4);
  CHECK(w.for_class("nonsense") == wire_format::f32);
  CHECK(w.parse("int2") == "KV wire form must be f32, int8 or int4, got 'int2'");
  CHECK(w.parse("chat=int8,bulk=int4") ==
        "KV wire form 'bulk=int4': the traffic class must be chat, agent or batch, got 'bulk'");
  CHECK(w.parse("chat=int9") == "KV wire form 'chat=int9' must be CLASS=FORM with FORM f32, int8 or int4");
  CHECK(w.parse("chat=int8,") == "KV wire form '' must be CLASS=FORM with FORM f32, int8 or int4");
  // A refused spec changes nothing.
  CHECK((w.chat == wire_format::f32 && w.agent == wire_format::int8 && w.batch == wire_format::int4));
}

TEST_CASE("a quantised KV wire form counts the ranks' wire-form staging against memory: pools that fit alone but "
          "not with it are refused, naming it") {
  baton::local_cluster_config cfg;
  const auto one = baton::gpu::model_kv_layout(cfg.model, 1, cfg.executor.page_size_tokens);
  const uint64_t memory = static_cast<uint64_t>(::sysconf(_SC_PHYS_PAGES)) * static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  const uint32_t pools = cfg.num_prefill_ranks + cfg.num_decode_ranks + cfg.num_elastic_ranks;
  // Pools taking 90 % of this machine's memory: they fit; INT8 staging (over a fifth of a pool) does not.
  cfg.executor.num_kv_pages = static_cast<uint32_t>(memory * 9 / 10 / (one.page_bytes() * one.num_layers) / pools);
  REQUIRE(baton::kv_wire_staging::bytes_for(one, cfg.executor.num_kv_pages) * pools > memory / 10);
  CHECK(cfg.validate().find("memory") == std::string::npos);
  REQUIRE(cfg.router.request.kv_wire.parse("batch=int8").empty());
  CHECK(cfg.router.request.kv_wire.any_quantised());
  const auto e = cfg.validate();
  CHECK_MESSAGE(e.find("MiB of wire-form staging") != std::string::npos, e);
  CHECK(e.find("lower --kv-pages") != std::string::npos);
}

TEST_CASE("baton node's flags are checked before a model loads: each refusal names its flag") {
  using baton::deploy::node_options;
  // The node's defaults are the head's and the agent's own.
  CHECK(node_options{}.weights_seed == baton::local_cluster_config{}.weights_seed);
  CHECK(node_options{}.drain_timeout_ms == baton::node_agent_config{}.drain_timeout_ms);
  const auto ranks = [] {
    node_options o;
    o.connect = "127.0.0.1:7000";
    return o;
  };
  auto o = ranks();
  CHECK(o.validate().empty());
  CHECK(o.name == "decode-0");
  CHECK(o.head_host == "127.0.0.1");
  CHECK(o.head_port == 7000);
  CHECK(o.rank_name(0) == "decode-0");
  o.num_ranks = 2;
  CHECK(o.rank_name(1) == "decode-0-1");
  const auto refusal = [&](auto change) {
    auto x = ranks();
    change(x);
    return x.validate();
  };
  CHECK(refusal([](node_options& x) { x.role = "router"; }) ==
        "--role must be decode, prefill, store or elastic (got 'router')");
  CHECK(refusal([](node_options& x) { x.connect = "127.0.0.1:0"; }) == "--connect needs a non-zero port");
  CHECK(refusal([](node_options& x) { x.connect.clear(); }).find("--connect") != std::string::npos);
  CHECK(refusal([](node_options& x) { x.num_ranks = 0; }) == "--ranks must be >= 1");
  CHECK(refusal([](node_options& x) {
          x.role = "elastic";
          x.prefill_at_start = 3;
        }) == "--prefill-at-start 3 exceeds --ranks 1");
  CHECK(refusal([](node_options& x) { x.eplb.slots_per_rank = 3; }) ==
        "--eplb-slots places expert copies over EP ranks: it needs --expert-parallel N >= 2");
  CHECK(refusal([](node_options& x) { x.dp_first_rank = 2; }) ==
        "--dp-first-rank numbers data-parallel members: it needs --dp-attention");
  CHECK(refusal([](node_options& x) { x.dp_meet_timeout_s = 0; }) == "--dp-meet-timeout-s must be at least 1");
  CHECK(refusal([](node_options& x) {
          x.dp_attention = true;
          x.expert_parallel = 2;
          x.dp_shrink_after_s = 120;
        }) == "--dp-shrink-after-s 120 needs --dp-attention and must be below --dp-meet-timeout-s (120): a meeting "
              "must be able to shrink before it times out");
  CHECK(refusal([](node_options& x) { x.dp_step_timeout_ms = 50; }) == "--dp-step-timeout-ms must be at least 100");
  CHECK(refusal([](node_options& x) {
          x.role = "prefill";
          x.dp_attention = true;
          x.expert_parallel = 2;
        }) == "--dp-attention groups decode ranks: it needs --role decode and --expert-parallel N >= 2");
  CHECK(refusal([](node_options& x) { x.exec.page_size_tokens = 0; }).find("page") != std::string::npos);
  // A store node needs where to listen and where its blocks live, and is never a spare.
  CHECK(refusal([](node_options& x) { x.role = "store"; }) == "--role store needs --listen HOST:PORT and --store-dir DIR");
  CHECK(refusal([](node_options& x) {
          x.role = "store";
          x.standby = true;
        }) == "--standby is for decode, prefill and elastic nodes (a spare), not store nodes");
  auto store = ranks();
  store.role = "store";
  store.listen = "127.0.0.1:0";
  store.store_dir = "/tmp/blocks";
  CHECK(store.validate().empty());
  CHECK(store.name == "store");

  // What the model rules out.
  baton::gpu::model_config model;
  model.name = "tiny-moe";
  model.moe.n_routed_experts = 2;
  auto ep = ranks();
  ep.expert_parallel = 4;
  REQUIRE(ep.validate().empty());
  CHECK(ep.validate_for(model) == "--expert-parallel 4 needs a model with at least that many routed experts "
                                  "(tiny-moe has 2)");
  auto big = ranks();
  big.exec.num_kv_pages = 4'000'000'000u;
  REQUIRE(big.validate().empty());
  const auto too_big = big.validate_for(baton::local_cluster_config{}.model);
  CHECK_MESSAGE(too_big.find("more than this machine's") != std::string::npos, too_big);
}

TEST_CASE("parse_node_options reads the flags over the environment's fault injection, and ends the command on a "
          "bad one") {
  using baton::deploy::node_options;
  using baton::deploy::parse_node_options;
  node_options o;
  CHECK_FALSE(parse_node_options({"--connect", "127.0.0.1:7000", "--ranks", "2", "--name", "d", "--fault-job-delay-ms",
                                  "5", "--cuda-fp32"},
                                 &o));
  CHECK(o.num_ranks == 2);
  CHECK(o.rank_name(1) == "d-1");
  CHECK(o.rank.name == "d");
  CHECK(o.fault_job_delay_ms == 5);
  CHECK_FALSE(o.backend.cuda_bf16);
  CHECK(o.prefill.step_budget_us > 0);  // the serving prefill defaults, as the head's ranks chunk
  node_options help;
  CHECK(parse_node_options({"--help"}, &help) == 0);
  node_options bad;
  CHECK(parse_node_options({"--connect", "127.0.0.1:7000", "--rank", "2"}, &bad) == 2);
  node_options nonsense;
  CHECK(parse_node_options({"--connect", "127.0.0.1:7000", "--dp-first-rank", "1"}, &nonsense) == 2);
  ::setenv("BATON_FAULT_LAYER_DELAY_MS", "slow", 1);
  node_options env;
  CHECK(parse_node_options({"--connect", "127.0.0.1:7000"}, &env) == 2);
  ::setenv("BATON_FAULT_LAYER_DELAY_MS", "250", 1);
  node_options from_env;
  CHECK_FALSE(parse_node_options({"--connect", "127.0.0.1:7000"}, &from_env));
  CHECK(from_env.fault_layer_delay_ms == 250);
  ::unsetenv("BATON_FAULT_LAYER_DELAY_MS");
}

TEST_CASE("BATON_API_KEYS: keys are trimmed of the blanks around them; set but holding no key is refused, never "
          "read as no authentication") {
  struct restore {
    ~restore() { ::unsetenv("BATON_API_KEYS"); }
  } r;
  std::vector<std::string> keys;
  std::string why;
  ::unsetenv("BATON_API_KEYS");
  CHECK(baton::deploy::api_keys_from_env(&keys, &why));
  CHECK(keys.empty());
  ::setenv("BATON_API_KEYS", "k1, k2 ,,k3", 1);
  CHECK(baton::deploy::api_keys_from_env(&keys, &why));
  CHECK(keys == std::vector<std::string>{"k1", "k2", "k3"});
  for (const char* none : {"", ",", " , "}) {
    CAPTURE(none);
    ::setenv("BATON_API_KEYS", none, 1);
    keys.clear();
    CHECK_FALSE(baton::deploy::api_keys_from_env(&keys, &why));
    CHECK(why.find("BATON_API_KEYS is set but holds no key") == 0);
  }
}

TEST_CASE("baton local refuses flags it would ignore or a transport that moves no KV, naming the flag, before a "
          "model loads") {
  // Each once answered its prompts and exited 0, listening nowhere, or failed every request.
  CHECK(baton::deploy::run_local({"--router-listen", "127.0.0.1:0"}) == 2);
  CHECK(baton::deploy::run_local({"--http-listen", "127.0.0.1:0"}) == 2);
  CHECK(baton::deploy::run_local({"--cluster-listen", "127.0.0.1:0", "--decode-ranks", "1"}) == 2);
  CHECK(baton::deploy::run_local({"--transport", "modelled"}) == 2);
  CHECK(baton::deploy::run_local({"--temperature", "-1"}) == 2);
  // A config check names the flag that sets the field.
  CHECK(baton::deploy::run_local({"--kv-pages", "0"}) == 2);
  baton::local_cluster_config c;
  c.executor.num_kv_pages = 0;
  CHECK(c.validate().find("num_kv_pages (--kv-pages) must be >= 1") != std::string::npos);
}

TEST_CASE("a port that cannot be listened on is explained as the system explains it (CAF says only 'tcp socket "
          "creation failed')") {
  // A port held by a listening socket of this test (the gateway's kind, on a port of the system's choosing).
  uint16_t port = 0;
  std::string why;
  const int fd = baton::deploy::open_tcp_listener("127.0.0.1", 0, &port, &why, "test");
  REQUIRE_MESSAGE(fd >= 0, why);
  CHECK(baton::deploy::why_cannot_bind("127.0.0.1", port) == "Address already in use");
  ::close(fd);
  CHECK(baton::deploy::why_cannot_bind("127.0.0.1", port).empty());
  CHECK(baton::deploy::why_cannot_bind("192.0.2.1", 0) == "Cannot assign requested address");  // not this host's
}
