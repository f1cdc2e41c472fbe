// `baton status`'s rendering (deploy/status_view.hpp): what an operator reads of the nodes and
// ranks, and the JSON a script reads.

#include <doctest/doctest.h>

#include <nlohmann/json.hpp>

#include "actors/messages.hpp"
#include "actors/node_messages.hpp"
#include "deploy/status_view.hpp"

using namespace baton;
using namespace baton::deploy;

namespace {

std::vector<node_status> two_nodes() {
  node_status a{"dec-a", {"decode"}, 812, 120, "joined", {"dec-a"}, "", false};
  node_status b{"pre-x", {"prefill"}, 901, 61000, "gone", {}, "went down (exit_reason(kill))", false};
  return {a, b};
}

cluster_stats one_of_each() {
  cluster_stats s;
  rank_load p;
  p.name = "prefill-0";
  p.queued_tokens = 300;
  p.num_running = 1;
  p.num_free_pages = 500;
  p.num_total_pages = 512;
  rank_load d;
  d.name = "dec-a";
  d.num_running = 3;
  d.num_free_pages = 28;
  d.num_total_pages = 48;
  d.unavailable = "draining";
  s.prefill = {p};
  s.decode = {d};
  s.decode_parked = 2;
  s.num_active = 5;
  return s;
}

}  // namespace

TEST_CASE("baton status lists each node with its roles, pid, state and last heartbeat -- a node that went stays, "
          "'gone' -- and each rank with its load and whether it takes work") {
  const auto nodes = two_nodes();
  const auto ranks = one_of_each();
  const auto text = status_text(&nodes, "", &ranks, "");
  CHECK_MESSAGE(text.find("nodes:\n  NAME") != std::string::npos, text);
  CHECK_MESSAGE(text.find("  dec-a             decode          812       joined     120 ms      dec-a\n") != std::string::npos, text);
  CHECK_MESSAGE(text.find("pre-x             prefill         901       gone       61000 ms    (went down (exit_reason(kill)))\n") !=
                    std::string::npos,
                text);
  CHECK_MESSAGE(text.find("  prefill   prefill-0         1         300       500 of 512      taking work\n") != std::string::npos, text);
  CHECK_MESSAGE(text.find("  decode    dec-a             3         0         28 of 48        draining\n") != std::string::npos, text);
  CHECK_MESSAGE(text.find("placements waiting: prefill 0, decode 2 (the KV queue); requests in flight 5") != std::string::npos, text);
  CHECK(text.find("store servers") == std::string::npos);  // no store
  auto stored = ranks;
  stored.store_servers = 3;
  stored.store_servers_up = 2;  // a store node stalled: said here, as /health says it
  CHECK(status_text(&nodes, "", &stored, "").find("  store servers: 2 of 3 answering\n") != std::string::npos);
  const auto sj = nlohmann::json::parse(status_json(&nodes, "", &stored, ""));
  CHECK(sj["store_servers"]["answering"] == 2);
  CHECK(sj["store_servers"]["total"] == 3);
  // What did not answer is said in place of its table; what was not asked is left out.
  const auto half = status_text(nullptr, "the node directory at 127.0.0.1:1 could not be reached: refused", nullptr, "");
  CHECK(half == "nodes:\n  (the node directory at 127.0.0.1:1 could not be reached: refused)\n");
  const std::vector<node_status> none;
  CHECK(status_text(&none, "", nullptr, "").find("none has joined") != std::string::npos);
}

TEST_CASE("baton status --json: the same for scripts, with a failure in place of what did not answer") {
  const auto nodes = two_nodes();
  const auto ranks = one_of_each();
  const auto j = nlohmann::json::parse(status_json(&nodes, "", &ranks, ""));
  REQUIRE(j["nodes"].size() == 2);
  CHECK(j["nodes"][1]["state"] == "gone");
  CHECK(j["nodes"][1]["since_heartbeat_ms"] == 61000);
  CHECK(j["nodes"][1]["why"] == "went down (exit_reason(kill))");
  CHECK(j["nodes"][1]["left"] == false);
  CHECK(j["nodes"][0]["roles"][0] == "decode");
  REQUIRE(j["ranks"].size() == 2);
  CHECK(j["ranks"][0]["taking_work"] == true);
  CHECK(j["ranks"][1]["taking_work"] == false);
  CHECK(j["ranks"][1]["state"] == "draining");
  CHECK(j["ranks"][1]["free_kv_pages"] == 28);
  CHECK(j["placements_waiting"]["decode"] == 2);
  const auto down = nlohmann::json::parse(status_json(nullptr, "", nullptr, "the router at 127.0.0.1:1 did not answer"));
  CHECK(down["ranks"].is_null());
  CHECK(down["ranks_error"] == "the router at 127.0.0.1:1 did not answer");
  CHECK_FALSE(down.contains("nodes"));
}
