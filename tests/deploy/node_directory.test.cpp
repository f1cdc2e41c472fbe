// The node directory on its own, against stand-ins for nodes' agents and processes: who may join
// under which name, heartbeats and their loss, and the rendezvous where data-parallel groups meet.

#include <doctest/doctest.h>

#include <atomic>
#include <thread>

#include "actors/local_cluster.hpp"
#include "gpu/model_config.hpp"
#include "tests/test_util.hpp"
#include "tests/deploy/directory_fixture.hpp"

using namespace baton;
using namespace baton::test;

TEST_CASE("the node directory refuses a node whose model is not the head's, naming both; one with the same model, or "
          "none (a gateway), joins") {
  network_system n;
  node_directory_config dc;
  dc.model = model_fingerprint(gpu::builtin_tiny_config());
  auto dir = spawn_node_directory(n.sys, dc, {});
  caf::scoped_actor self{n.sys};
  const auto join = [&](const std::string& model) {
    std::string out = "joined";
    self->request(dir, std::chrono::seconds{10}, join_atom::value, node_hello{"node-x", {"decode"}, 1, model})
        .receive([](cluster_welcome&) {}, [&](caf::error& e) { out = n.sys.render(e); });
    return out;
  };
  auto other = gpu::builtin_tiny_config();
  other.name = "baton-kjv-tiny";
  const auto refused = join(model_fingerprint(other));
  CHECK_MESSAGE(refused.find("node node-x serves model 'baton-kjv-tiny'") != std::string::npos, refused);
  CHECK_MESSAGE(refused.find("but this cluster serves model 'baton-tiny'") != std::string::npos, refused);
  CHECK(join(dc.model) == "joined");
  CHECK(join("") == "joined");
  self->send_exit(dir, caf::exit_reason::user_shutdown);
}

TEST_CASE("the node directory refuses a node with the head's model but other weights (another checkpoint, another "
          "seed) or another KV page size, naming what differs and the flag to fix it") {
  network_system n;
  node_directory_config dc;
  dc.model = model_fingerprint(gpu::builtin_tiny_config());
  dc.weights = weights_identity("", 20261130);
  dc.page_tokens = 16;
  auto dir = spawn_node_directory(n.sys, dc, {});
  caf::scoped_actor self{n.sys};
  const auto join = [&](const std::string& weights, uint32_t page_tokens) {
    std::string out = "joined";
    node_hello h{"node-x", {"decode"}, 1, dc.model};
    h.weights = weights;
    h.page_tokens = page_tokens;
    self->request(dir, std::chrono::seconds{10}, join_atom::value, h)
        .receive([](cluster_welcome&) {}, [&](caf::error& e) { out = n.sys.render(e); });
    return out;
  };
  auto refused = join(weights_identity("", 2), 16);
  CHECK_MESSAGE(refused.find("node node-x serves the model with weights drawn from seed 2, but this cluster's are "
                             "weights drawn from seed 20261130") != std::string::npos,
                refused);
  {  // two checkpoints
    node_directory_config dc2 = dc;
    dc2.weights = weights_identity("00000000000000bb", 0);
    auto dir2 = spawn_node_directory(n.sys, dc2, {});
    node_hello h{"node-y", {"decode"}, 1, dc.model};
    h.weights = weights_identity("00000000000000aa", 0);
    h.page_tokens = 16;
    self->request(dir2, std::chrono::seconds{10}, join_atom::value, h)
        .receive([&](cluster_welcome&) { refused = "joined"; }, [&](caf::error& e) { refused = n.sys.render(e); });
    CHECK_MESSAGE(refused.find("with weights 00000000000000aa, but this cluster's are weights 00000000000000bb") !=
                      std::string::npos,
                  refused);
    CHECK_MESSAGE(refused.find("--model directory or --weights-seed") != std::string::npos, refused);
    self->send_exit(dir2, caf::exit_reason::user_shutdown);
  }
  refused = join(dc.weights, 32);
  CHECK_MESSAGE(refused.find("node node-x keeps KV in pages of 32 tokens, but this cluster's are 16") != std::string::npos,
                refused);
  CHECK_MESSAGE(refused.find("start it with --page-tokens 16") != std::string::npos, refused);
  CHECK(join(dc.weights, 16) == "joined");
  CHECK(join("", 0) == "joined");  // not said (a gateway): not checked
  // A checkpoint against a seed is not compared: `baton export-model` writes the seed's weights
  // into a directory, which a node may serve beside a head that draws them.
  CHECK(join(weights_identity("00000000000000aa", 0), 16) == "joined");
  self->send_exit(dir, caf::exit_reason::user_shutdown);
}

TEST_CASE("the node directory says in the head's log when a node joins and when it is given up, and why") {
  network_system n;
  node_directory_config dc;
  test::captured_lines log;
  dc.log = log.sink();
  auto dir = spawn_node_directory(n.sys, dc, {});
  caf::scoped_actor a{n.sys}, b{n.sys};
  const auto join = [&](caf::scoped_actor& self, int32_t pid, uint64_t incarnation) {
    bool ok = false;
    self->request(dir, std::chrono::seconds{10}, join_atom::value, node_hello{"node-x", {"decode"}, pid, "", incarnation})
        .receive([&](cluster_welcome&) { ok = true; }, [&](caf::error& e) { FAIL(n.sys.render(e)); });
    return ok;
  };
  REQUIRE(join(a, 11, 1));
  REQUIRE(join(b, 12, 2));  // a new process under its name: the old one is given up
  const auto lines = log.lines();
  REQUIRE(lines.size() == 3);
  CHECK(lines[0] == "node node-x: in the cluster (decode, pid 11)");
  CHECK(lines[1] == "node node-x (decode, pid 11) was replaced by a new process (pid 12) under its name");
  CHECK(lines[2] == "node node-x: in the cluster (decode, pid 12)");
  a->send_exit(dir, caf::exit_reason::user_shutdown);
}

TEST_CASE("the node directory's rendezvous: each process posts its members' cards and all get every card in member "
          "order once the last one posts; a member posting twice, a late one and a misfit are refused with a sentence") {
  network_system n;
  auto dir = spawn_node_directory(n.sys, {}, {});
  caf::scoped_actor a{n.sys}, b{n.sys};
  // Process A hosts members 0 and 1 of group g; B hosts member 2. A's answer waits for B. (A's
  // post is in the directory's mailbox before any of B's, all being sent from this thread.)
  std::vector<std::string> got_a, got_b;
  auto pending = a->request(dir, std::chrono::seconds{30}, rendezvous_atom::value, std::string{"g"}, uint32_t{3},
                            uint32_t{0}, std::vector<std::string>{"k0", "k1"}, std::string{"node-a"}, int32_t{1}, uint32_t{0});
  std::string refused;
  auto post = [&](caf::scoped_actor& self, const std::string& group, uint32_t size, uint32_t at, std::vector<std::string> cards,
                  std::string node = "node-b") {
    std::vector<std::string> out;
    refused.clear();
    self->request(dir, std::chrono::seconds{30}, rendezvous_atom::value, group, size, at, cards, node, int32_t{1}, uint32_t{0})
        .receive([&](std::vector<std::string>& c) { out = std::move(c); },
                 [&](caf::error& e) { refused = n.sys.render(e); });
    return out;
  };
  CHECK(post(b, "g", 3, 1, {"again"}).empty());
  CHECK(refused.find("rendezvous g: member 1 posted twice") != std::string::npos);
  CHECK(post(b, "g", 4, 2, {"k2"}).empty());
  CHECK(refused.find("rendezvous g: a post for a group of 4, but the group has 3 members") != std::string::npos);
  CHECK(post(b, "h", 3, 2, {"k2", "k3"}).empty());
  CHECK(refused.find("rendezvous h: members 2 to 3 do not fit a group of 3") != std::string::npos);
  got_b = post(b, "g", 3, 2, {"k2"});
  pending.receive([&](std::vector<std::string>& c) { got_a = std::move(c); }, [&](caf::error&) {});
  const std::vector<std::string> all{"k0", "k1", "k2"};
  CHECK(got_a == all);
  CHECK(got_b == all);
  CHECK(post(b, "g", 3, 2, {"k2"}, "node-c").empty());
  CHECK(refused.find("rendezvous g: the group already met; member 2 cannot join it again") != std::string::npos);
  // A node that posts again replaces its own earlier post (its process gave up or died while
  // waiting): the old post is answered void, and the new one completes the meeting.
  auto stale = a->request(dir, std::chrono::seconds{30}, rendezvous_atom::value, std::string{"r"}, uint32_t{2}, uint32_t{0},
                          std::vector<std::string>{"old"}, std::string{"node-x"}, int32_t{1}, uint32_t{0});
  caf::scoped_actor x2{n.sys};
  auto renewed = x2->request(dir, std::chrono::seconds{30}, rendezvous_atom::value, std::string{"r"}, uint32_t{2},
                             uint32_t{0}, std::vector<std::string>{"new"}, std::string{"node-x"}, int32_t{2}, uint32_t{0});
  std::string voided;
  stale.receive([](std::vector<std::string>&) {}, [&](caf::error& e) { voided = n.sys.render(e); });
  CHECK(voided.find("rendezvous r: node node-x posted again; this post is void") != std::string::npos);
  CHECK(post(b, "r", 2, 1, {"y"}, "node-y") == std::vector<std::string>{"new", "y"});
  std::vector<std::string> got_x;
  renewed.receive([&](std::vector<std::string>& c) { got_x = c; }, [](caf::error&) {});
  CHECK(got_x == std::vector<std::string>{"new", "y"});
  a->send_exit(dir, caf::exit_reason::user_shutdown);
}

TEST_CASE("the node directory tells the other nodes of a data-parallel group when a node that hosted members goes "
          "down; a meeting it had posted to can no longer complete; once all its nodes are gone, the group meets afresh") {
  network_system n;
  auto dir = spawn_node_directory(n.sys, stand_in_directory(), {});
  auto agent = [&](const std::string& name, std::shared_ptr<gone_log> log) { return spawn_agent_stand_in(n.sys, dir, name, log); };
  auto log_a = std::make_shared<gone_log>(), log_b = std::make_shared<gone_log>();
  auto agent_a = agent("node-a", log_a), agent_b = agent("node-b", log_b);
  caf::scoped_actor a{n.sys}, b{n.sys};
  auto joined = [&] {
    size_t k = 0;
    a->request(dir, std::chrono::seconds{5}, stats_atom::value).receive([&](std::vector<node_status>& s) { k = s.size(); },
                                                                         [](caf::error&) {});
    return k;
  };
  for (int i = 0; i < 200 && joined() < 2; ++i) std::this_thread::sleep_for(std::chrono::milliseconds{10});
  REQUIRE(joined() == 2);

  // Group g met: members 0 and 1 on node-a, 2 on node-b. Group h is still meeting: node-b posted
  // member 1, node-a member 0, and member 2 has not come.
  auto post = [&](caf::scoped_actor& self, const std::string& group, uint32_t at, std::vector<std::string> cards,
                  const std::string& node) {
    return self->request(dir, std::chrono::seconds{30}, rendezvous_atom::value, group, uint32_t{3}, at, std::move(cards), node,
                         int32_t{1}, uint32_t{0});
  };
  auto g_a = post(a, "g", 0, {"k0", "k1"}, "node-a");
  std::vector<std::string> met;
  post(b, "g", 2, {"k2"}, "node-b").receive([&](std::vector<std::string>& c) { met = c; }, [](caf::error&) {});
  g_a.receive([](std::vector<std::string>&) {}, [](caf::error&) {});
  REQUIRE(met.size() == 3);
  post(b, "h", 1, {"hb"}, "node-b");  // its answer is never awaited: node-b "dies"
  auto h_a = post(a, "h", 0, {"ha"}, "node-a");

  a->send_exit(agent_b, caf::exit_reason::kill);  // node-b's process dies
  std::string refused;
  h_a.receive([](std::vector<std::string>&) {}, [&](caf::error& e) { refused = n.sys.render(e); });
  CHECK(refused.find("rendezvous h: node node-b, which hosted 1 of its 3 members, went down") != std::string::npos);
  std::vector<std::tuple<std::string, std::vector<uint32_t>, std::string>> got;
  for (int i = 0; i < 500; ++i) {
    {
      std::lock_guard<std::mutex> lock{log_a->m};
      got = log_a->got;
    }
    if (got.size() >= 2) break;
    std::this_thread::sleep_for(std::chrono::milliseconds{10});
  }
  REQUIRE(got.size() == 2);  // one notice per meeting node-a shares with node-b
  std::sort(got.begin(), got.end());
  CHECK(std::get<0>(got[0]) == "g");
  CHECK(std::get<1>(got[0]) == std::vector<uint32_t>{2});
  CHECK(std::get<2>(got[0]).find("node node-b, which hosted 1 of its 3 members, went down") != std::string::npos);
  CHECK(std::get<0>(got[1]) == "h");
  CHECK(std::get<1>(got[1]) == std::vector<uint32_t>{1});
  // node-b restarts and posts its member of g again, and a node-c posts the other two members.
  // Both wait: node-a, alive, still holds members of the lost meeting. Once node-a has gone too,
  // g meets afresh with both posts.
  auto poster = [&](uint32_t first, std::vector<std::string> cards, std::string node) {
    return post_async(n.sys, dir, {"g", 3, first, std::move(cards), std::move(node), 2, 0});
  };
  auto again_b = poster(2, {"n2"}, "node-b"), new_c = poster(0, {"c0", "c1"}, "node-c");
  for (int i = 0; i < 500 && !(sent(again_b) && sent(new_c)); ++i) std::this_thread::sleep_for(std::chrono::milliseconds{10});
  REQUIRE(joined() == 2);  // a round trip to the directory: it has both posts by now
  CHECK_FALSE(answered(again_b));  // a meeting started at once would have completed with them
  CHECK_FALSE(answered(new_c));
  a->send_exit(agent_a, caf::exit_reason::kill);
  for (int i = 0; i < 500 && !(answered(again_b) && answered(new_c)); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds{10});
  const std::vector<std::string> fresh{"c0", "c1", "n2"};
  CHECK(cards(again_b) == fresh);
  CHECK(cards(new_c) == fresh);
  a->send_exit(dir, caf::exit_reason::user_shutdown);
}

TEST_CASE("the node directory: survivors re-forming a group that lost a node for good meet without it after their "
          "shrink delay (its card says absent, with the shrunk group's number); a group's first meeting never "
          "shrinks; once the lost member comes back, the survivors are told and the group meets at full size") {
  network_system n;
  auto dir = spawn_node_directory(n.sys, stand_in_directory(), {});
  auto log_a = std::make_shared<gone_log>(), log_b = std::make_shared<gone_log>(), log_c = std::make_shared<gone_log>();
  auto agent_a = spawn_agent_stand_in(n.sys, dir, "node-a", log_a);
  auto agent_b = spawn_agent_stand_in(n.sys, dir, "node-b", log_b);
  auto agent_c = spawn_agent_stand_in(n.sys, dir, "node-c", log_c);
  caf::scoped_actor self{n.sys};
  auto joined = [&] {
    size_t k = 0;
    self->request(dir, std::chrono::seconds{5}, stats_atom::value)
        .receive([&](std::vector<node_status>& s) { k = s.size(); }, [](caf::error&) {});
    return k;
  };
  for (int i = 0; i < 200 && joined() < 3; ++i) std::this_thread::sleep_for(std::chrono::milliseconds{10});
  REQUIRE(joined() == 3);
  auto notices = [](const std::shared_ptr<gone_log>& log, size_t at_least) {
    for (int i = 0; i < 500; ++i) {
      {
        std::lock_guard<std::mutex> lock{log->m};
        if (log->got.size() >= at_least) return log->got;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds{10});
    }
    std::lock_guard<std::mutex> lock{log->m};
    return log->got;
  };
  auto post = [&](uint32_t first, std::string card, std::string node, uint32_t shrink_ms) {
    return post_async(n.sys, dir, {"g", 3, first, {std::move(card)}, std::move(node), 1, shrink_ms});
  };
  // g meets with all three; then node-c dies for good.
  auto a1 = post(0, "a0", "node-a", 0), b1 = post(1, "b1", "node-b", 0), c1 = post(2, "c2", "node-c", 0);
  REQUIRE(await_answers({a1, b1, c1}));
  CHECK(cards(a1) == std::vector<std::string>{"a0", "b1", "c2"});
  self->send_exit(agent_c, caf::exit_reason::kill);
  REQUIRE(notices(log_a, 1).size() == 1);
  REQUIRE(notices(log_b, 1).size() == 1);
  // Both survivors post again, letting the meeting shrink after 100 ms: it closes without member 2.
  auto a2 = post(0, "a0'", "node-a", 100), b2 = post(1, "b1'", "node-b", 100);
  REQUIRE(await_answers({a2, b2}));
  const std::vector<std::string> shrunk{"a0'", "b1'", "absent#1"};
  CHECK(cards(a2) == shrunk);
  CHECK(cards(b2) == shrunk);
  // A group's first meeting waits for everyone, whatever its posts allow.
  auto h_a = post_async(n.sys, dir, {"h", 3, 0, {"ha"}, "node-a", 1, 50});
  auto h_d = post_async(n.sys, dir, {"h", 3, 1, {"hd"}, "node-d", 1, 50});
  for (int i = 0; i < 500 && !(sent(h_a) && sent(h_d)); ++i) std::this_thread::sleep_for(std::chrono::milliseconds{10});
  std::this_thread::sleep_for(std::chrono::milliseconds{200});  // 4x the shrink delay
  CHECK_FALSE(answered(h_a));
  CHECK_FALSE(answered(h_d));
  auto h_e = post_async(n.sys, dir, {"h", 3, 2, {"he"}, "node-e", 1, 0});
  REQUIRE(await_answers({h_a, h_d, h_e}));
  CHECK(cards(h_a) == std::vector<std::string>{"ha", "hd", "he"});
  // node-c comes back (a new process) and posts member 2: the survivors hear that it came back,
  // its post waits for them, and once both have posted again, g meets at full size.
  auto c3 = post(2, "c2'", "node-c", 100);
  const auto told_a = notices(log_a, 2), told_b = notices(log_b, 2);
  REQUIRE(told_a.size() == 2);
  REQUIRE(told_b.size() == 2);
  CHECK(std::get<0>(told_a[1]) == "g");
  CHECK(std::get<1>(told_a[1]) == std::vector<uint32_t>{2});
  CHECK(std::get<2>(told_a[1]) == "member 2 came back (node node-c): the group meets again at full size");
  CHECK(std::get<2>(told_b[1]) == std::get<2>(told_a[1]));
  {
    std::lock_guard<std::mutex> lock{log_a->m};
    CHECK(log_a->returns == 1);  // said as a return, not as a loss
  }
  CHECK_FALSE(answered(c3));
  auto a3 = post(0, "a0''", "node-a", 100), b3 = post(1, "b1''", "node-b", 100);
  REQUIRE(await_answers({a3, b3, c3}));
  const std::vector<std::string> full{"a0''", "b1''", "c2'"};
  CHECK(cards(a3) == full);
  CHECK(cards(c3) == full);
  for (auto agent : {agent_a, agent_b}) self->send_exit(agent, caf::exit_reason::kill);
  self->send_exit(dir, caf::exit_reason::user_shutdown);
}

TEST_CASE("the node directory: a node given up for lost (missed heartbeats) that heartbeats again has each of its "
          "ranks asked to report its load, so that an idle rank rejoins its balancer, and the elastic controller hears "
          "it is back") {
  network_system n;
  node_directory_config dc;
  dc.heartbeat_interval_ms = 50;
  dc.missed_heartbeats = 2;  // gone after 100 ms of silence
  // A stand-in for the elastic controller: it counts what it hears of the node's ranks.
  auto forgotten = std::make_shared<std::atomic<int>>(0), back = std::make_shared<std::atomic<int>>(0);
  cluster_welcome welcome;
  welcome.elastic_controller = caf::actor_cast<elastic_controller_actor>(n.sys.spawn([=](caf::event_based_actor*) -> caf::behavior {
    return {[=](drain_atom, const node_ranks&) { ++*forgotten; }, [=](rejoin_atom, const node_ranks&) { ++*back; }};
  }));
  auto dir = spawn_node_directory(n.sys, dc, welcome);
  // A stand-in for the node's decode rank: it counts the directory's requests to report.
  auto asked = std::make_shared<std::atomic<int>>(0);
  auto rank = caf::actor_cast<decode_rank_actor>(n.sys.spawn([asked](caf::event_based_actor*) -> caf::behavior {
    return {[asked](health_atom) { ++*asked; }};
  }));
  auto log = std::make_shared<gone_log>();
  // It never heartbeats.
  auto agent = spawn_agent_stand_in(n.sys, dir, "node-a", log, node_ranks{{rank}, {}, {"node-a"}});
  caf::scoped_actor self{n.sys};
  auto state = [&] { return state_of(self, dir, "node-a"); };
  for (int i = 0; i < 200 && state().empty(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds{5});
  for (int i = 0; i < 400 && state() != "gone"; ++i) std::this_thread::sleep_for(std::chrono::milliseconds{5});
  REQUIRE(state() == "gone");
  CHECK(asked->load() == 0);
  self->send(dir, heartbeat_atom::value, std::string{"node-a"}, uint64_t{0});  // back after a partition
  // Asked right behind the heartbeat (one sender's messages arrive in order): joined again, before
  // its next silence can count.
  CHECK(state() == "joined");
  for (int i = 0; i < 2000 && asked->load() == 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds{5});
  CHECK(asked->load() == 1);
  // The controller forgot its ranks when it went (drain) and may move them again now (rejoin).
  for (int i = 0; i < 2000 && back->load() == 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds{5});
  CHECK(forgotten->load() == 1);
  CHECK(back->load() == 1);
  self->send_exit(dir, caf::exit_reason::user_shutdown);
  self->send_exit(agent, caf::exit_reason::user_shutdown);
  self->send_exit(rank, caf::exit_reason::user_shutdown);
  self->send_exit(welcome.elastic_controller, caf::exit_reason::user_shutdown);
}

TEST_CASE("the node directory: a node whose agent went down is not revived by a heartbeat that was still in flight "
          "(a start pulse's): only a node gone silent comes back by heartbeating") {
  network_system n;
  auto dir = spawn_node_directory(n.sys, stand_in_directory(), {});
  auto log = std::make_shared<gone_log>();
  auto agent = spawn_agent_stand_in(n.sys, dir, "node-a", log);
  caf::scoped_actor self{n.sys};
  auto state = [&] { return state_of(self, dir, "node-a"); };
  for (int i = 0; i < 2000 && state().empty(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds{5});
  REQUIRE(state() == "joined");
  self->send_exit(agent, caf::exit_reason::kill);
  for (int i = 0; i < 2000 && state() != "gone"; ++i) std::this_thread::sleep_for(std::chrono::milliseconds{5});
  REQUIRE(state() == "gone");
  self->send(dir, heartbeat_atom::value, std::string{"node-a"}, uint64_t{0});  // the stand-in joined as incarnation 0
  CHECK(state() == "gone");  // read right behind the heartbeat: it was handled, and ignored
  self->send_exit(dir, caf::exit_reason::user_shutdown);
}

TEST_CASE("the node directory says how each node went: one that drained on purpose left, one that left to be "
          "restarted and one that died are lost (baton_node_state, baton status)") {
  network_system n;
  auto dir = spawn_node_directory(n.sys, stand_in_directory(), {});
  auto log = std::make_shared<gone_log>();
  caf::scoped_actor self{n.sys};
  const auto status_of = [&](const std::string& name) {
    node_status out;
    self->request(dir, std::chrono::seconds{5}, stats_atom::value)
        .receive([&](std::vector<node_status>& s) { for (auto& x : s) if (x.name == name) out = x; }, [](caf::error&) {});
    return out;
  };
  const auto gone = [&](const std::string& name) {
    for (int i = 0; i < 2000 && status_of(name).state != "gone"; ++i) std::this_thread::sleep_for(std::chrono::milliseconds{5});
    return status_of(name);
  };
  const auto joined = [&](const std::string& name) {
    auto agent = spawn_agent_stand_in(n.sys, dir, name, log);
    for (int i = 0; i < 2000 && status_of(name).state != "joined"; ++i) std::this_thread::sleep_for(std::chrono::milliseconds{5});
    REQUIRE(status_of(name).state == "joined");
    return agent;
  };
  const auto drained = [&](const std::string& name, const caf::actor& agent, bool for_restart) {
    self->send(caf::actor_cast<node_agent_actor>(agent), drain_atom::value, for_restart);
    for (int i = 0; i < 2000 && status_of(name).state != "draining"; ++i) std::this_thread::sleep_for(std::chrono::milliseconds{5});
    REQUIRE(status_of(name).state == "draining");
  };
  auto on_purpose = caf::actor_cast<caf::actor>(joined("on-purpose"));
  drained("on-purpose", on_purpose, false);
  self->send_exit(on_purpose, caf::exit_reason::user_shutdown);  // a drain past its timeout ends so, too
  auto a = gone("on-purpose");
  CHECK(a.left);
  auto for_restart = caf::actor_cast<caf::actor>(joined("for-restart"));
  drained("for-restart", for_restart, true);
  self->send_exit(for_restart, caf::exit_reason::user_shutdown);
  auto b = gone("for-restart");
  CHECK_FALSE(b.left);
  auto died = caf::actor_cast<caf::actor>(joined("died"));
  self->send_exit(died, caf::exit_reason::kill);
  auto c = gone("died");
  CHECK_FALSE(c.left);
  CHECK_MESSAGE(c.why.find("went down (") == 0, c.why);
  self->send_exit(dir, caf::exit_reason::user_shutdown);
}

TEST_CASE("the node directory: a node restarted under its name that met its group afresh is not lost when its old "
          "process is given up for lost later (a partition): losses are by process, not by name") {
  network_system n;
  auto dir = spawn_node_directory(n.sys, stand_in_directory(), {});
  auto log_a = std::make_shared<gone_log>(), log_b = std::make_shared<gone_log>();
  auto agent_a = spawn_agent_stand_in(n.sys, dir, "node-a", log_a);
  auto agent_b = spawn_agent_stand_in(n.sys, dir, "node-b", log_b);  // node-b's first process (pid 1)
  caf::scoped_actor a{n.sys}, b{n.sys};
  auto states = [&] {
    std::map<std::string, std::string> out;
    a->request(dir, std::chrono::seconds{5}, stats_atom::value)
        .receive([&](std::vector<node_status>& s) { for (const auto& x : s) out[x.name] = x.state; }, [](caf::error&) {});
    return out;
  };
  for (int i = 0; i < 200 && states().size() < 2; ++i) std::this_thread::sleep_for(std::chrono::milliseconds{10});
  REQUIRE(states().size() == 2);
  auto post = [&](caf::scoped_actor& self, uint32_t at, std::vector<std::string> cards, const std::string& node, int32_t pid) {
    return self->request(dir, std::chrono::seconds{30}, rendezvous_atom::value, std::string{"g"}, uint32_t{2}, at,
                         std::move(cards), node, pid, uint32_t{0});
  };
  auto cards_of = [&](auto&& pending) {
    std::vector<std::string> out;
    pending.receive([&](std::vector<std::string>& c) { out = c; }, [](caf::error&) {});
    return out;
  };
  // g meets: node-a's member 0, node-b's member 1 (both first processes).
  auto first_a = post(a, 0, {"a0"}, "node-a", 1);
  CHECK(cards_of(post(b, 1, {"b1"}, "node-b", 1)) == std::vector<std::string>{"a0", "b1"});
  cards_of(first_a);
  // node-b restarts (process 2) and posts again before the directory saw its first process go:
  // node-a is told its group broke, posts again itself, and g meets afresh with process 2.
  caf::scoped_actor b2{n.sys};
  auto second_b = post(b2, 1, {"b1'"}, "node-b", 2);
  for (int i = 0; i < 500; ++i) {
    {
      std::lock_guard<std::mutex> lock{log_a->m};
      if (!log_a->got.empty()) break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds{10});
  }
  {
    std::lock_guard<std::mutex> lock{log_a->m};
    REQUIRE(log_a->got.size() == 1);
    CHECK(std::get<2>(log_a->got[0]).find("posted to meet again") != std::string::npos);
  }
  CHECK(cards_of(post(a, 0, {"a0'"}, "node-a", 1)) == std::vector<std::string>{"a0'", "b1'"});
  CHECK(cards_of(second_b) == std::vector<std::string>{"a0'", "b1'"});
  // Now node-b's first process is given up for lost (its agent goes down). The new meeting holds
  // process 2's member: it stands, and node-a hears nothing more.
  a->send_exit(agent_b, caf::exit_reason::kill);
  for (int i = 0; i < 500 && states()["node-b"] != "gone"; ++i) std::this_thread::sleep_for(std::chrono::milliseconds{10});
  REQUIRE(states()["node-b"] == "gone");
  caf::anon_send(agent_a, drain_atom::value);  // after anything the directory sent node-a while marking node-b gone
  for (int i = 0; i < 500; ++i) {
    {
      std::lock_guard<std::mutex> lock{log_a->m};
      if (log_a->drains == 1) break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds{10});
  }
  std::lock_guard<std::mutex> lock{log_a->m};
  REQUIRE(log_a->drains == 1);
  CHECK(log_a->got.size() == 1);
  a->send_exit(agent_a, caf::exit_reason::kill);
  a->send_exit(dir, caf::exit_reason::user_shutdown);
}

TEST_CASE("the node directory's rendezvous: a post whose process went down before its meeting met is taken back, "
          "so a stand-in may take its member's place and the meeting never completes with a card of the dead") {
  network_system n;
  auto dir = spawn_node_directory(n.sys, {}, {});
  struct stop_dir {  // also after a failed REQUIRE: the actor system's end waits for it
    node_directory_actor d;
    ~stop_dir() { caf::anon_send_exit(d, caf::exit_reason::user_shutdown); }
  } stop{dir};
  // Node x posts member 0 of a group of 2 (once told to) and goes down while it waits.
  auto box = std::make_shared<answer_box>();
  auto x = n.sys.spawn([dir, box](caf::event_based_actor* self) -> caf::behavior {
    return {[=](timer_atom) {
      self->request(dir, std::chrono::seconds{30}, rendezvous_atom::value, std::string{"g"}, uint32_t{2}, uint32_t{0},
                    std::vector<std::string>{"x0"}, std::string{"node-x"}, int32_t{7}, uint32_t{0})
          .then([](std::vector<std::string>&) {}, [](caf::error&) {});
      std::lock_guard<std::mutex> lock{box->m};
      box->sent = true;
    }};
  });
  // Watched from here before the directory watches it: CAF tells the later watcher first, so
  // once this side hears x went down, the directory's word of it is already in its mailbox,
  // ahead of every post below.
  caf::scoped_actor self{n.sys};
  self->monitor(x);
  self->send(x, timer_atom::value);
  for (int i = 0; i < 1000 && !sent(box); ++i) std::this_thread::sleep_for(std::chrono::milliseconds{5});
  REQUIRE(sent(box));
  self->send_exit(x, caf::exit_reason::kill);
  bool down = false;
  self->receive([&](caf::down_msg&) { down = true; }, caf::after(std::chrono::seconds{5}) >> [] {});
  REQUIRE(down);
  // A spare stands in for member 0: refused while x's post held the slot ("member 0 posted
  // twice"), which it did for good before.
  auto s = post_async(n.sys, dir, {"g", 2, 0, {"s0"}, "node-s", 8, 0});
  auto y = post_async(n.sys, dir, {"g", 2, 1, {"y1"}, "node-y", 9, 0});
  REQUIRE(await_answers({s, y}));
  CHECK(cards(s) == std::vector<std::string>{"s0", "y1"});
  CHECK(cards(y) == std::vector<std::string>{"s0", "y1"});
}

TEST_CASE("the node directory: another kind of process under a live node's name is refused by name; the same kind "
          "replaces it, the old process's ranks are forgotten at once, it is told to leave (at once and at each "
          "heartbeat after: it ran on, serving nothing), and its heartbeats keep nothing alive") {
  network_system n;
  // A stand-in for the decode balancer: it records the ranks the directory tells it to forget.
  auto forgotten = std::make_shared<std::atomic<int>>(0);
  auto balancer = caf::actor_cast<decode_balancer_actor>(n.sys.spawn([forgotten](caf::event_based_actor*) -> caf::behavior {
    return {[forgotten](forget_atom, const decode_rank_actor&) { ++*forgotten; }};
  }));
  auto rank = caf::actor_cast<decode_rank_actor>(n.sys.spawn([](caf::event_based_actor*) -> caf::behavior {
    return {[](health_atom) {}};
  }));
  cluster_welcome welcome;
  welcome.decode_balancer = balancer;
  node_directory_config dc;
  dc.heartbeat_interval_ms = 200;
  dc.missed_heartbeats = 5;  // gone after 1 s without a heartbeat that counts: room for a stalled machine
  auto dir = spawn_node_directory(n.sys, dc, welcome);
  caf::scoped_actor first{n.sys}, second{n.sys};
  auto join = [&](caf::scoped_actor& as, std::vector<std::string> roles, int32_t pid, uint64_t incarnation) {
    std::string error;
    as->request(dir, std::chrono::seconds{5}, join_atom::value, node_hello{"node-a", std::move(roles), pid, "", incarnation})
        .receive([](cluster_welcome&) {}, [&](caf::error& e) { error = n.sys.render(e); });
    return error;
  };
  auto state = [&] {
    std::pair<std::string, int32_t> out;
    first->request(dir, std::chrono::seconds{5}, stats_atom::value)
        .receive([&](std::vector<node_status>& s) { for (const auto& x : s) if (x.name == "node-a") out = {x.state, x.pid}; },
                 [](caf::error&) {});
    return out;
  };
  REQUIRE(join(first, {"decode"}, 41, 11).empty());
  first->send(dir, std::string{"node-a"}, node_ranks{{rank}, {}, {"node-a"}});
  // A gateway started with the decode node's name is refused, and the decode node stays as it was.
  first->send(dir, heartbeat_atom::value, std::string{"node-a"}, uint64_t{11});
  const auto refused = join(second, {"gateway"}, 42, 22);
  CHECK(refused.find("node name node-a is held by a live decode process (pid 41)") != std::string::npos);
  CHECK(refused.find("give this gateway process a --name of its own") != std::string::npos);
  CHECK(state() == std::pair<std::string, int32_t>{"joined", 41});
  CHECK(forgotten->load() == 0);
  // The same kind of process under the name: a restart the directory did not see coming. The old
  // process's rank is forgotten at its join, not when a network timeout notices.
  REQUIRE(join(second, {"decode"}, 43, 33).empty());
  const auto told_to_leave = [&] {
    int32_t by = 0;
    first->receive([&](replaced_atom, int32_t pid) { by = pid; }, caf::after(std::chrono::seconds{5}) >> [] {});
    return by;
  };
  CHECK(told_to_leave() == 43);  // the old process (first joined it) hears which process took its name
  first->send(dir, heartbeat_atom::value, std::string{"node-a"}, uint64_t{33});  // before the look, in order
  CHECK(state() == std::pair<std::string, int32_t>{"joined", 43});
  for (int i = 0; i < 500 && forgotten->load() == 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds{5});
  CHECK(forgotten->load() == 1);
  // The old process's late word applies to the new one no more: its drain, and its ranks (which
  // would have replaced the new one's, to be forgotten again when it goes).
  first->send(dir, drain_atom::value, std::string{"node-a"}, false);
  first->send(dir, std::string{"node-a"}, node_ranks{{rank}, {}, {"node-a"}});
  CHECK(state() == std::pair<std::string, int32_t>{"joined", 43});
  // Only the old process heartbeats now: that keeps nothing alive, and the silent new one is
  // given up (before, the old process's beats held the entry up for good).
  for (int i = 0; i < 3000 && state().first != "gone"; ++i) {
    first->send(dir, heartbeat_atom::value, std::string{"node-a"}, uint64_t{11});
    std::this_thread::sleep_for(std::chrono::milliseconds{5});
  }
  CHECK(state() == std::pair<std::string, int32_t>{"gone", 43});
  CHECK(forgotten->load() == 1);  // the new process had announced no ranks
  CHECK(told_to_leave() == 43);   // and each of the old one's heartbeats was answered so
  for (auto a : {caf::actor_cast<caf::actor>(dir), caf::actor_cast<caf::actor>(balancer), caf::actor_cast<caf::actor>(rank)})
    first->send_exit(a, caf::exit_reason::user_shutdown);
}

TEST_CASE("the node directory: a node given up for silence (a partition) and then replaced under its name is told "
          "to leave when it comes back, not left running with forgotten ranks") {
  network_system n;
  node_directory_config dc;
  dc.heartbeat_interval_ms = 50;
  dc.missed_heartbeats = 2;  // gone after 100 ms of silence
  auto dir = spawn_node_directory(n.sys, dc, cluster_welcome{});
  caf::scoped_actor old_process{n.sys}, new_process{n.sys};
  auto join = [&](caf::scoped_actor& as, int32_t pid, uint64_t incarnation) {
    bool ok = false;
    as->request(dir, std::chrono::seconds{5}, join_atom::value, node_hello{"node-b", {"decode"}, pid, "", incarnation})
        .receive([&](cluster_welcome&) { ok = true; }, [](caf::error&) {});
    return ok;
  };
  REQUIRE(join(old_process, 51, 111));
  // Silent (cut off): the directory gives it up.
  for (int i = 0; i < 3000 && state_of(new_process, dir, "node-b") != "gone"; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds{2});
  REQUIRE(state_of(new_process, dir, "node-b") == "gone");
  // Restarted elsewhere under its name (a supervisor that saw it silent).
  REQUIRE(join(new_process, 52, 222));
  const auto told = [&] {
    int32_t by = 0;
    old_process->receive([&](replaced_atom, int32_t pid) { by = pid; }, caf::after(std::chrono::seconds{5}) >> [] {});
    return by;
  };
  CHECK(told() == 52);  // at once
  old_process->send(dir, heartbeat_atom::value, std::string{"node-b"}, uint64_t{111});  // back from the partition
  CHECK(told() == 52);
  // The new process is the node.
  new_process->send(dir, heartbeat_atom::value, std::string{"node-b"}, uint64_t{222});
  CHECK(state_of(new_process, dir, "node-b") == "joined");
  new_process->send_exit(dir, caf::exit_reason::user_shutdown);
}
