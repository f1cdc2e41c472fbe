#include <doctest/doctest.h>

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
}
