#include <doctest/doctest.h>

#include <unistd.h>

#include "actors/config.hpp"
#include "actors/kv_wire_staging.hpp"
#include "actors/local_cluster.hpp"
#include "deploy/flags.hpp"

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
  CHECK(f.parse({"--ranks"}) == "flag --ranks needs a value");
  CHECK(f.parse({"--rank", "2"}) == "unknown flag '--rank' (see --help)");
  CHECK(f.parse({"--temperature", "hot"}) == "flag --temperature expects a number, got 'hot'");
  // A boolean flag with a value says which (`--serve=false` turned serving on before).
  CHECK(f.parse({"--verbose=false"}).empty());
  CHECK_FALSE(verbose);
  CHECK(f.parse({"--verbose=1"}).empty());
  CHECK(verbose);
  CHECK(f.parse({"--verbose=maybe"}) == "flag --verbose takes true or false after '=', got 'maybe'");
  CHECK(f.parse({"loose"}) == "unknown flag 'loose' (see --help)");
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
