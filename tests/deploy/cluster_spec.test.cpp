// The cluster spec: strict parsing with errors that name the field, the command lines it turns
// into, quoting for remote shells, and the Kubernetes/Slurm outputs against golden files
// (tests/data/deploy/; regenerate with `baton deploy k8s|slurm` after an intended change).

#include <doctest/doctest.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <tuple>

#include <unistd.h>

#include "deploy/cluster_spec.hpp"

using namespace baton::deploy;

namespace {

/// Why `spec` with `from` replaced by `to` is refused (and that it is).
std::string refusal(const std::string& spec, const std::string& from, const std::string& to) {
  auto text = spec;
  text.replace(text.find(from), from.size(), to);
  cluster_spec x;
  std::string why;
  CHECK_FALSE(parse_cluster_spec(text, "/base", &x, &why));
  return why;
}

std::string read(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

const std::string good = R"({
  "name": "t", "model": "m",
  "nodes": [
    {"name": "head", "roles": ["router", "prefill"], "ports": {"router": 7100, "cluster": 7101}},
    {"name": "d", "roles": ["decode"], "gpus": 2},
    {"name": "g", "roles": ["gateway"], "ports": {"http": 8000}}
  ]})";

/// The spec `good` with `from` replaced by `to`; the error sentence parsing it gives.
std::string error_of(const std::string& from, const std::string& to) {
  auto text = good;
  const auto at = text.find(from);
  REQUIRE(at != std::string::npos);
  text.replace(at, from.size(), to);
  cluster_spec s;
  std::string why;
  CHECK_FALSE(parse_cluster_spec(text, "/base", &s, &why));
  return why;
}

}  // namespace

TEST_CASE("a cluster spec parses into nodes and plans one command line per node process") {
  cluster_spec s;
  std::string why;
  REQUIRE_MESSAGE(parse_cluster_spec(good, "/base", &s, &why), why);
  CHECK(s.model == "/base/m");  // relative to the spec file
  CHECK(s.head().name == "head");
  {  // the store's directory too, not the launcher's working directory
    auto text = good;
    const auto swap = [&](const std::string& from, const std::string& to) { text.replace(text.find(from), from.size(), to); };
    swap(R"("model": "m",)", R"("model": "m", "store": {"dir": "cache/store"},)");
    swap(R"("roles": ["router", "prefill"])", R"("roles": ["router", "prefill", "store"])");
    cluster_spec st;
    REQUIRE_MESSAGE(parse_cluster_spec(text, "/base", &st, &why), why);
    CHECK(st.store_dir == "/base/cache/store");
  }
  {  // CORS origins go to every gateway: the separate one's command line, and the head's with one
    auto text = good;
    text.replace(text.find(R"("model": "m",)"), std::string{R"("model": "m",)"}.size(),
                 R"("model": "m", "cors_origins": ["https://app.example.com"],)");
    cluster_spec cs;
    REQUIRE_MESSAGE(parse_cluster_spec(text, "/base", &cs, &why), why);
    const auto p = plan_launch(cs, "/bin/baton", {"127.0.0.1", ""});
    const auto gw = std::find_if(p.begin(), p.end(), [](const node_launch& l) { return l.role == "gateway"; });
    REQUIRE(gw != p.end());
    const auto at = std::find(gw->argv.begin(), gw->argv.end(), "--cors-origin");
    REQUIRE(at != gw->argv.end());
    CHECK(*(at + 1) == "https://app.example.com");
    text.replace(text.find("https://app.example.com"), 23, "https://app.example.com/");
    CHECK_FALSE(parse_cluster_spec(text, "/base", &cs, &why));
    CHECK(why == "spec.cors_origins: 'https://app.example.com/' is not an origin as browsers send it "
                 "(http://host[:port] or https://host[:port], lower case, no path; or *)");
  }
  {  // log_requests: every gateway logs its calls (a trial had to run a gateway by hand for it)
    auto text = good;
    text.replace(text.find(R"("model": "m",)"), std::string{R"("model": "m",)"}.size(), R"("model": "m", "log_requests": true,)");
    cluster_spec ls;
    REQUIRE_MESSAGE(parse_cluster_spec(text, "/base", &ls, &why), why);
    size_t gateways = 0;
    for (const auto& l : plan_launch(ls, "/bin/baton", {"127.0.0.1", ""}))
      if (l.role == "gateway") {
        ++gateways;
        CHECK(std::find(l.argv.begin(), l.argv.end(), "--log-requests") != l.argv.end());
      }
    CHECK(gateways == 1);
    // A head with the gateway in its process gets it too.
    for (auto& n : ls.nodes)
      if (n.name == "head") n.roles.push_back("gateway"), n.http_port = 7180;
    const auto head = plan_launch(ls, "/bin/baton", {"127.0.0.1", ""}).at(0);
    REQUIRE(head.role == "head");
    CHECK(std::find(head.argv.begin(), head.argv.end(), "--log-requests") != head.argv.end());
    // chat_template: relative to the spec, to the head (its router renders the chats).
    auto templated = good;
    templated.replace(templated.find(R"("model": "m",)"), std::string{R"("model": "m",)"}.size(),
                      R"("model": "m", "chat_template": "t/chat.jinja",)");
    cluster_spec ts;
    REQUIRE_MESSAGE(parse_cluster_spec(templated, "/base", &ts, &why), why);
    const auto first = plan_launch(ts, "/bin/baton", {"127.0.0.1", ""}).at(0);
    REQUIRE(first.role == "head");
    const auto at = std::find(first.argv.begin(), first.argv.end(), "--chat-template");
    REQUIRE(at + 1 < first.argv.end());
    CHECK(*(at + 1) == "/base/t/chat.jinja");
    text.replace(text.find("\"log_requests\": true"), 20, "\"log_requests\": 1");
    CHECK_FALSE(parse_cluster_spec(text, "/base", &ls, &why));
    CHECK_MESSAGE(why.find("log_requests") != std::string::npos, why);
  }
  const auto plan = plan_launch(s, "/bin/baton", {"127.0.0.1", ""});
  REQUIRE(plan.size() == 3);
  CHECK(plan[0].role == "head");
  CHECK(plan[0].argv[1] == "local");
  CHECK(plan[1].role == "decode");
  const auto& d = plan[1].argv;
  CHECK(std::find(d.begin(), d.end(), "127.0.0.1:7101") != d.end());
  CHECK(d[std::find(d.begin(), d.end(), "--ranks") - d.begin() + 1] == "2");
  CHECK(plan[2].role == "gateway");
  CHECK(plan[2].env.empty());  // no keys in the spec
  s.api_keys = {"sk-secret-1"};
  const auto keyed = plan_launch(s, "/bin/baton", {"127.0.0.1", ""});
  CHECK(keyed[2].env.at("BATON_API_KEYS") == "sk-secret-1");
  for (const auto& a : keyed[2].argv) CHECK(a.find("sk-secret") == std::string::npos);  // never on a command line
  // Named keys: the launcher reads the spec's keys file and hands its text over the same way.
  s.api_keys_json = R"({"keys":[{"name":"search","key":"sk-search-0001"}]})";
  const auto named = plan_launch(s, "/bin/baton", {"127.0.0.1", ""});
  CHECK(named[2].env.at("BATON_API_KEYS_JSON") == s.api_keys_json);
  cluster_spec with_file;
  std::string text = good;
  text.replace(text.find(R"("model": "m",)"), std::string{R"("model": "m",)"}.size(), R"("model": "m", "api_keys_file": "keys.json",)");
  REQUIRE_MESSAGE(parse_cluster_spec(text, "/base", &with_file, &why), why);
  CHECK(with_file.api_keys_file == "/base/keys.json");  // next to the spec, as its model
}

TEST_CASE("each process of a plan joins the head's node directory under a name of its own: a gateway beside a "
          "decode node's ranks is <node>/gateway") {
  const std::string spec = R"({
    "name": "t", "model": "m",
    "nodes": [
      {"name": "head", "roles": ["router", "prefill"], "ports": {"router": 7100, "cluster": 7101}},
      {"name": "d", "roles": ["decode", "gateway"], "ports": {"http": 8000}},
      {"name": "g", "roles": ["gateway"], "ports": {"http": 8001}}
    ]})";
  cluster_spec s;
  std::string why;
  REQUIRE_MESSAGE(parse_cluster_spec(spec, "/base", &s, &why), why);
  const auto plan = plan_launch(s, "/bin/baton", {"127.0.0.1", ""});
  REQUIRE(plan.size() == 4);
  auto name_flag = [](const node_launch& n) { return *(std::find(n.argv.begin(), n.argv.end(), "--name") + 1); };
  CHECK(plan[1].role == "decode");
  CHECK(plan[1].process == "d");
  CHECK(name_flag(plan[1]) == "d");
  CHECK(plan[2].role == "gateway");
  CHECK(plan[2].name == "d");  // the node (its host, its certificate)
  CHECK(plan[2].process == "d/gateway");
  CHECK(name_flag(plan[2]) == "d/gateway");
  CHECK(plan[3].process == "g");  // alone on its node: the node's name
  CHECK(name_flag(plan[3]) == "g");
  std::set<std::string> names;
  for (const auto& l : plan) CHECK(names.insert(l.process).second);
}

TEST_CASE("prefill ranks and block servers in their own node processes: store nodes start first") {
  const std::string spec = R"({
    "name": "t", "model": "m", "store": {"dir": "/s", "block_tokens": 64, "rank_cache_blocks": 0},
    "executor": {"backend": "cuda"},
    "nodes": [
      {"name": "head", "host": "h0", "roles": ["router"], "ports": {"router": 7100, "cluster": 7101}},
      {"name": "p", "host": "h1", "roles": ["prefill"], "gpus": 4},
      {"name": "s", "host": "h2", "roles": ["store"], "ports": {"store": 9000}},
      {"name": "d", "host": "h1", "roles": ["decode"]}
    ]})";
  cluster_spec s;
  std::string why;
  REQUIRE_MESSAGE(parse_cluster_spec(spec, "/base", &s, &why), why);
  const auto plan = plan_launch(s, "baton", {"h0", ""});
  REQUIRE(plan.size() == 4);
  auto after = [](const node_launch& n, const std::string& flag) {
    const auto it = std::find(n.argv.begin(), n.argv.end(), flag);
    return it == n.argv.end() || it + 1 == n.argv.end() ? std::string{"(none)"} : *(it + 1);
  };
  CHECK(plan[0].role == "store");  // the head adopts it as it starts
  CHECK(after(plan[0], "--listen") == "h2:9000");
  CHECK(after(plan[0], "--store-dir") == "/s");
  CHECK(plan[1].role == "head");
  CHECK(after(plan[1], "--store-node") == "h2:9000");
  CHECK(after(plan[1], "--prefill-ranks") == "0");
  CHECK(after(plan[1], "--store-dir") == "(none)");  // no block server in the head's process
  CHECK(after(plan[1], "--chat-template") == "(none)");  // none given: the model directory's
  CHECK(after(plan[1], "--prefix-cache-blocks") == "(none)");  // no prefill rank there either
  CHECK(plan[2].role == "prefill");
  CHECK(after(plan[2], "--role") == "prefill");
  CHECK(after(plan[2], "--ranks") == "4");
  CHECK(after(plan[2], "--connect") == "h0:7101");
  CHECK(after(plan[2], "--prefix-cache-blocks") == "0");
  CHECK(plan[3].role == "decode");
  // Kubernetes reaches the store node through its Service, Slurm through its allocation node.
  CHECK(kubernetes_name_problem(s).empty());
  auto digit = s;  // a name Kubernetes refuses (a digit first; too long) is refused here, naming the node
  digit.name = "9lives";
  CHECK(kubernetes_name_problem(digit).find("is not a DNS-1035 label") != std::string::npos);
  digit.name = std::string(40, 'a');
  digit.nodes.front().name = std::string(40, 'b');
  CHECK(kubernetes_name_problem(digit) ==
        "node '" + digit.nodes.front().name + "': its Kubernetes name '" + std::string(40, 'a') + "-" + std::string(40, 'b') +
            "' is not a DNS-1035 label (at most 63 characters, a letter first, a letter or digit last): shorten or "
            "rename the spec or the node");
  const auto k8s = kubernetes_manifests(s);
  CHECK(k8s.find("- \"t-s:9000\"") != std::string::npos);
  CHECK(k8s.find("name: store\n") != std::string::npos);
  const auto slurm = slurm_script(s);
  CHECK(slurm.find("'--store-node' \"${HOSTS[2]}\"':9000'") != std::string::npos);
  CHECK(slurm.find("#SBATCH --gpus-per-node=4") != std::string::npos);  // the prefill node's GPUs
}

TEST_CASE("the transport's send mode and expert parallelism reach the engines that use them, small EP for prefill and "
          "wide EP for decode") {
  const std::string spec = R"({
    "name": "t", "model": "deepseek-v3-tiny", "transport": {"send": "am"},
    "expert_parallel": {"prefill": 2, "decode": 4, "dual_batch_overlap": true, "eplb_slots": 4, "eplb_interval": 32},
    "nodes": [
      {"name": "head", "roles": ["router", "prefill"], "ports": {"router": 7100, "cluster": 7101}},
      {"name": "p", "roles": ["prefill"]},
      {"name": "d", "roles": ["decode"]},
      {"name": "g", "roles": ["gateway"], "ports": {"http": 8000}}
    ]})";
  cluster_spec s;
  std::string why;
  REQUIRE_MESSAGE(parse_cluster_spec(spec, "/base", &s, &why), why);
  CHECK(s.model == "deepseek-v3-tiny");  // a seeded shape, not a path
  const auto plan = plan_launch(s, "baton", {"127.0.0.1", ""});
  REQUIRE(plan.size() == 4);
  auto after = [](const node_launch& n, const std::string& flag) {
    const auto it = std::find(n.argv.begin(), n.argv.end(), flag);
    return it == n.argv.end() ? std::string{"(none)"} : it + 1 == n.argv.end() ? std::string{"(last)"} : *(it + 1);
  };
  auto has = [](const node_launch& n, const std::string& flag) { return std::find(n.argv.begin(), n.argv.end(), flag) != n.argv.end(); };
  for (int i : {0, 1, 2}) {
    CAPTURE(plan[i].role);
    CHECK(std::count(plan[i].argv.begin(), plan[i].argv.end(), "--ucx-send") == 1);
    CHECK(after(plan[i], "--ucx-send") == "am");
    CHECK(has(plan[i], "--dual-batch-overlap"));
    CHECK(after(plan[i], "--eplb-slots") == "4");
    CHECK(after(plan[i], "--eplb-interval") == "32");
  }
  CHECK(after(plan[0], "--expert-parallel") == "2");  // the head's prefill ranks
  CHECK(after(plan[1], "--expert-parallel") == "2");
  CHECK(after(plan[2], "--expert-parallel") == "4");
  CHECK_FALSE(has(plan[3], "--expert-parallel"));  // the gateway runs no engine
  CHECK_FALSE(has(plan[3], "--ucx-send"));
  // Defaults add nothing, so existing specs keep their command lines.
  cluster_spec plain;
  REQUIRE(parse_cluster_spec(good, "/base", &plain, &why));
  for (const auto& n : plan_launch(plain, "baton", {"127.0.0.1", ""})) {
    CHECK_FALSE(has(n, "--ucx-send"));
    CHECK_FALSE(has(n, "--expert-parallel"));
  }
  CHECK(error_of(R"("model": "m")", R"("model": "m", "transport": {"send": "rdma"})") ==
        "spec.transport.send must be put (one-sided RMA: shared memory, RDMA) or am (rendezvous active messages: TCP), not 'rdma'");
  CHECK(error_of(R"("model": "m")", R"("model": "m", "transport": {"mode": "am"})") == "spec.transport: unknown field 'mode'");
  CHECK(error_of(R"("model": "m")", R"("model": "m", "ssh": {"user": "-oProxyCommand=x"})") ==
        "spec.ssh.user '-oProxyCommand=x' is not a user name");
  CHECK(error_of(R"("model": "m")", R"("model": "m", "ssh": {"user": "a@b"})") == "spec.ssh.user 'a@b' is not a user name");
  CHECK(error_of(R"("model": "m")", R"("model": "random", "expert_parallel": {"decode": 8})")
            .find("spec.expert_parallel needs a model with routed experts") == 0);
  CHECK(error_of(R"("model": "m")", R"("model": "m", "expert_parallel": {"decode": 0})") ==
        "spec.expert_parallel.decode must be an integer in [1, 256]");
  CHECK(error_of(R"("model": "m")", R"("model": "m", "expert_parallel": {"dual_batch_overlap": 1})") ==
        "spec.expert_parallel.dual_batch_overlap must be true or false");
  CHECK(error_of(R"("model": "m")", R"("model": "m", "expert_parallel": {"eplb_slots": 4})") ==
        "spec.expert_parallel.eplb_slots places expert copies over EP ranks: it needs prefill or decode >= 2");
}

TEST_CASE("expert_parallel.dp_attention groups each decode node's ranks, and only the decode nodes'; specs it cannot "
          "serve are refused naming why") {
  const std::string spec = R"({
    "name": "t", "model": "deepseek-v3-tiny",
    "expert_parallel": {"prefill": 2, "decode": 2, "dp_attention": true},
    "nodes": [
      {"name": "head", "roles": ["router", "prefill"], "ports": {"router": 7100, "cluster": 7101}},
      {"name": "d", "roles": ["decode"], "gpus": 4}
    ]})";
  cluster_spec s;
  std::string why;
  REQUIRE_MESSAGE(parse_cluster_spec(spec, "/base", &s, &why), why);
  CHECK(s.dp_attention);
  const auto plan = plan_launch(s, "baton", {"127.0.0.1", ""});
  auto has = [](const node_launch& n, const std::string& flag) { return std::find(n.argv.begin(), n.argv.end(), flag) != n.argv.end(); };
  REQUIRE(plan.size() == 2);
  CHECK_FALSE(has(plan[0], "--dp-attention"));  // the head's prefill ranks keep their expert processes
  CHECK(has(plan[1], "--dp-attention"));
  // Groups run across the decode nodes in spec order: each node is told where its ranks start.
  auto after = [](const node_launch& n, const std::string& flag) {
    const auto it = std::find(n.argv.begin(), n.argv.end(), flag);
    return it == n.argv.end() || it + 1 == n.argv.end() ? std::string{"(none)"} : *(it + 1);
  };
  CHECK(after(plan[1], "--dp-first-rank") == "0");
  {
    auto text = spec;
    const std::string from = R"({"name": "d", "roles": ["decode"], "gpus": 4})";
    text.replace(text.find(from), from.size(), R"({"name": "d", "roles": ["decode"], "gpus": 3},
      {"name": "e", "roles": ["decode"], "gpus": 1})");
    cluster_spec x;
    REQUIRE_MESSAGE(parse_cluster_spec(text, "/base", &x, &why), why);
    const auto p2 = plan_launch(x, "baton", {"127.0.0.1", ""});
    REQUIRE(p2.size() == 3);
    CHECK(after(p2[1], "--dp-first-rank") == "0");
    CHECK(after(p2[2], "--dp-first-rank") == "3");  // member 1 of group 1, with d's last rank
  }
  // The spec with `from` replaced by `to`, planned.
  auto plan_with = [&](const std::string& from, const std::string& to) {
    auto text = spec;
    text.replace(text.find(from), from.size(), to);
    cluster_spec x;
    REQUIRE_MESSAGE(parse_cluster_spec(text, "/base", &x, &why), why);
    return plan_launch(x, "baton", {"127.0.0.1", ""});
  };
  // The step timeout and the shrink delay: the defaults add no flag; others reach the decode
  // nodes only.
  for (const auto& [field, flag, value] : {std::tuple<std::string, std::string, std::string>{"dp_step_timeout_ms", "--dp-step-timeout-ms", "2500"},
                                           {"dp_shrink_after_s", "--dp-shrink-after-s", "20"}}) {
    CAPTURE(field);
    CHECK_FALSE(has(plan[1], flag));
    const auto p2 = plan_with(R"("dp_attention": true})", R"("dp_attention": true, ")" + field + "\": " + value + "}");
    CHECK_FALSE(has(p2[0], flag));
    CHECK(after(p2[1], flag) == value);
  }
  auto refused = [&](const std::string& from, const std::string& to) { return refusal(spec, from, to); };
  const std::string lead = "spec.expert_parallel.dp_attention groups the decode ranks by "
                           "expert_parallel.decode (>= 2), without elastic nodes, but ";
  CHECK(refused(R"("gpus": 4)", R"("gpus": 3)") == lead + "the decode nodes have 3 ranks in all, not a multiple of 2");
  CHECK(refused(R"("decode": 2,)", R"("decode": 1,)") == lead + "expert_parallel.decode is 1");
  CHECK(refused(R"("dp_attention": true)", R"("dp_attention": "yes")") ==
        "spec.expert_parallel.dp_attention must be true or false");
  CHECK(refused(R"("dp_attention": true)", R"("dp_attention": true, "dp_step_timeout_ms": 50)").find(
            "spec.expert_parallel.dp_step_timeout_ms") == 0);
  CHECK(refused(R"("dp_attention": true)", R"("dp_step_timeout_ms": 2500)") ==
        "spec.expert_parallel.dp_step_timeout_ms bounds a data-parallel group's steps: it needs dp_attention");
  CHECK(refused(R"("dp_attention": true)", R"("dp_shrink_after_s": 20)") ==
        "spec.expert_parallel.dp_shrink_after_s lets a data-parallel group shrink: it needs dp_attention");
  CHECK(refused(R"("dp_attention": true)", R"("dp_attention": true, "dp_shrink_after_s": 120)").find(
            "spec.expert_parallel.dp_shrink_after_s") == 0);
}

TEST_CASE("a spare node is planned but not numbered: standing in for a failed data-parallel node it takes that "
          "node's members; spares that could stand in for nothing are refused") {
  const std::string spec = R"({
    "name": "t", "model": "deepseek-v3-tiny",
    "expert_parallel": {"decode": 2, "dp_attention": true},
    "nodes": [
      {"name": "head", "host": "10.0.0.1", "roles": ["router", "prefill"], "ports": {"router": 7100, "cluster": 7101}},
      {"name": "d", "host": "10.0.0.1", "roles": ["decode"], "gpus": 2},
      {"name": "s", "host": "10.0.0.9", "roles": ["decode"], "gpus": 2, "spare": true},
      {"name": "e", "host": "10.0.0.1", "roles": ["decode"], "gpus": 2}
    ]})";
  cluster_spec s;
  std::string why;
  REQUIRE_MESSAGE(parse_cluster_spec(spec, "/base", &s, &why), why);
  const auto plan = plan_launch(s, "baton", {"10.0.0.1", ""});
  REQUIRE(plan.size() == 4);
  auto after = [](const node_launch& n, const std::string& flag) {
    const auto it = std::find(n.argv.begin(), n.argv.end(), flag);
    return it == n.argv.end() || it + 1 == n.argv.end() ? std::string{"(none)"} : *(it + 1);
  };
  CHECK_FALSE(plan[1].spare);
  CHECK(plan[2].spare);
  CHECK(plan[2].ranks == 2);
  // The spare holds no members: e's ranks follow d's directly.
  CHECK(after(plan[1], "--dp-first-rank") == "0");
  CHECK(after(plan[2], "--dp-first-rank") == "(none)");
  CHECK(after(plan[3], "--dp-first-rank") == "2");
  // In e's place it runs under its own name and host, with e's members.
  const auto in = stand_in(plan[2], plan[3]);
  CHECK_FALSE(in.spare);
  CHECK(in.name == "s");
  CHECK(in.host == "10.0.0.9");
  CHECK(after(in, "--name") == "s");
  CHECK(after(in, "--dp-first-rank") == "2");
  CHECK(std::count(in.argv.begin(), in.argv.end(), "--dp-first-rank") == 1);
  // Spares count for nothing until they stand in: a spare of 1 rank leaves the groups whole (4
  // ranks, not 5), and a spare alone is no decode node.
  {
    auto text = spec;
    const std::string from = R"("gpus": 2, "spare": true)";
    text.replace(text.find(from), from.size(), R"("gpus": 1, "spare": true)");
    cluster_spec x;
    CHECK_MESSAGE(parse_cluster_spec(text, "/base", &x, &why), why);
    for (const std::string gone : {R"({"name": "d", "host": "10.0.0.1", "roles": ["decode"], "gpus": 2},)",
                                   R"(,
      {"name": "e", "host": "10.0.0.1", "roles": ["decode"], "gpus": 2})"}) {
      REQUIRE(text.find(gone) != std::string::npos);
      text.erase(text.find(gone), gone.size());
    }
    CHECK_FALSE(parse_cluster_spec(text, "/base", &x, &why));
    CHECK_MESSAGE(why.find("at least one node must have the decode role") != std::string::npos, why);
  }
  CHECK(refusal(spec, R"("roles": ["decode"], "gpus": 2, "spare": true)", R"("roles": ["gateway"], "spare": true)") ==
        "node 's': a spare stands in for a failed decode, prefill or elastic node: it needs one of those roles, "
        "and no router, store or gateway");
  CHECK(refusal(spec, R"("spare": true)", R"("spare": 1)") == "nodes[2].spare must be true or false");
  // A spare with a store role, or ports, was planned as a store process of its own (or took a
  // port another node has).
  CHECK(refusal(spec, R"("roles": ["decode"], "gpus": 2, "spare": true)", R"("roles": ["decode", "store"], "spare": true)") ==
        "node 's': a spare stands in for a failed decode, prefill or elastic node: it needs one of those roles, "
        "and no router, store or gateway");
  CHECK(refusal(spec, R"("roles": ["decode"], "gpus": 2, "spare": true)",
                R"("roles": ["decode"], "gpus": 2, "spare": true, "ports": {"http": 7300})") ==
        "node 's': a spare listens on no port of its own (it takes the failed node's place)");
}

TEST_CASE("elastic nodes: their ranks start as prefill or decode, and the head runs the controller that moves them") {
  const std::string spec = R"({
    "name": "t", "model": "m", "elastic": {"ttft_ms": 2000, "tbt_ms": 100},
    "nodes": [
      {"name": "head", "roles": ["router"], "ports": {"router": 7100, "cluster": 7101}},
      {"name": "e", "roles": ["elastic"], "gpus": 4, "prefill_at_start": 1}
    ]})";
  cluster_spec s;
  std::string why;
  REQUIRE_MESSAGE(parse_cluster_spec(spec, "/base", &s, &why), why);  // one node serves both pools
  const auto plan = plan_launch(s, "baton", {"127.0.0.1", ""});
  REQUIRE(plan.size() == 2);
  auto after = [](const node_launch& n, const std::string& flag) {
    const auto it = std::find(n.argv.begin(), n.argv.end(), flag);
    return it == n.argv.end() ? std::string{"(none)"} : it + 1 == n.argv.end() ? std::string{"(last)"} : *(it + 1);
  };
  CHECK(std::find(plan[0].argv.begin(), plan[0].argv.end(), "--elastic-nodes") != plan[0].argv.end());
  CHECK(after(plan[0], "--elastic-ttft-ms") == "2000");
  CHECK(after(plan[0], "--elastic-tbt-ms") == "100");
  CHECK(plan[1].role == "elastic");
  CHECK(after(plan[1], "--role") == "elastic");
  CHECK(after(plan[1], "--ranks") == "4");
  CHECK(after(plan[1], "--prefill-at-start") == "1");
  // A GPU per rank with the CUDA executor, none with the CPU's.
  CHECK(kubernetes_manifests(s).find("nvidia.com/gpu") == std::string::npos);
  s.executor_backend = "cuda";
  CHECK(kubernetes_manifests(s).find("nvidia.com/gpu: 4") != std::string::npos);
  cluster_spec plain;
  REQUIRE(parse_cluster_spec(good, "/base", &plain, &why));
  CHECK(after(plan_launch(plain, "baton", {"127.0.0.1", ""})[0], "--elastic-nodes") == "(none)");
  auto refused = [&](const std::string& from, const std::string& to) { return refusal(spec, from, to); };
  CHECK(refused(R"("prefill_at_start": 1)", R"("prefill_at_start": 5)") ==
        "nodes[1] (e): prefill_at_start (5) exceeds its gpus (4)");
  CHECK(refused(R"("prefill_at_start": 1)", R"("prefill_at_start": 0)")
            .find("at least one node must have the prefill role") != std::string::npos);
  CHECK(refused(R"(["router"])", R"(["router", "elastic"])") ==
        "node 'head': elastic ranks run in their own node processes, not on the router's node");
  CHECK(refused(R"(["elastic"])", R"(["elastic", "decode"])").find("runs one of decode, prefill, elastic or store") !=
        std::string::npos);
  CHECK(refused(R"("model": "m")", R"("model": "deepseek-v3-tiny", "expert_parallel": {"decode": 2})") ==
        "an elastic rank serves both roles with one expert group: with elastic nodes, expert_parallel.prefill and "
        "expert_parallel.decode must be equal");
  {
    auto text = spec;
    const std::string from = R"("model": "m")";
    text.replace(text.find(from), from.size(), R"("model": "deepseek-v3-tiny", "expert_parallel": {"prefill": 2, "decode": 2})");
    cluster_spec x;
    std::string w;
    REQUIRE_MESSAGE(parse_cluster_spec(text, "/base", &x, &w), w);
    CHECK(after(plan_launch(x, "baton", {"127.0.0.1", ""})[1], "--expert-parallel") == "2");  // the elastic node
  }
  CHECK(refused(R"("ttft_ms": 2000)", R"("ttft_ms": 0)") == "spec.elastic.ttft_ms must be an integer in [1, 3600000]");
  CHECK(error_of(R"("gpus": 2)", R"("gpus": 2, "prefill_at_start": 1)") == "nodes[1] (d): prefill_at_start is for elastic nodes");
  CHECK(error_of(R"("model": "m")", R"("model": "m", "elastic": {"ttft_ms": 500})") ==
        "spec.elastic sets the planner of elastic nodes, but no node has the elastic role");
}

TEST_CASE("cluster spec errors name the field and the node") {
  CHECK(error_of(R"("gpus": 2)", R"("gpu": 2)") == "nodes[1]: unknown field 'gpu'");
  CHECK(error_of(R"("gpus": 2)", R"("gpus": 0)") == "nodes[1].gpus must be an integer in [1, 64]");
  CHECK(error_of(R"("name": "d")", R"("name": "head")") == "nodes: the name 'head' is used twice");
  CHECK(error_of(R"("name": "d")", R"("name": "D x")").find("nodes[1].name must be") == 0);
  CHECK(error_of(R"(["decode"])", R"(["decoder"])").find("unknown role 'decoder'") != std::string::npos);
  CHECK(error_of(R"(["decode"])", R"(["decode", "prefill"])").find("runs one of decode, prefill, elastic or store") != std::string::npos);
  CHECK(error_of(R"(["decode"])", R"(["decode", "store"])").find("runs one of decode, prefill, elastic or store") != std::string::npos);
  CHECK(error_of(R"("router", "prefill")", R"("router")").find("at least one node must have the prefill role") !=
        std::string::npos);
  CHECK(error_of(R"(["decode"], "gpus": 2)", R"(["store"])").find("a store node needs ports.store") != std::string::npos);
  CHECK(error_of(R"(["decode"], "gpus": 2)", R"(["decode"], "ports": {"store": 9000})").find("ports.store is for store nodes") !=
        std::string::npos);
  CHECK(error_of(R"({"http": 8000})", R"({"http": 8000}}, {"name": "s", "roles": ["store"], "ports": {"store": 9000})")
            .find("a node has the store role but store.dir is not set") != std::string::npos);
  CHECK(error_of(R"(["gateway"], "ports": {"http": 8000})", R"(["router", "prefill"], "ports": {"router": 1, "cluster": 2})") ==
        "nodes: exactly one node must have the router role, found 2");
  CHECK(error_of(R"("http": 8000)", R"("http": 7100)").find("port 7100 on 127.0.0.1 is taken") != std::string::npos);
  CHECK(error_of(R"({"http": 8000})", R"({})").find("a gateway needs ports.http") != std::string::npos);
  CHECK(error_of(R"("name": "t")", R"("name": "t", "store": {"dir": "/s"})").find("no node has the store role") != std::string::npos);
  CHECK(error_of(R"("model": "m")", R"("model": "m", "colour": 1)") == "spec: unknown field 'colour'");
  CHECK(error_of(R"("model": "m")", R"("model": 3)") == "spec.model must be a string");
  // Policy names are checked with the spec (so `--dry-run` refuses a typo), not first by the head.
  CHECK(error_of(R"("model": "m")", R"("model": "m", "policies": {"prefill": "leastloaded"})") ==
        "spec.policies.prefill must be seed, least_loaded, round_robin, cache_affinity or split, got 'leastloaded'");
  CHECK(error_of(R"("model": "m")", R"("model": "m", "policies": {"decode": "fifo"})") ==
        "spec.policies.decode must be seed, least_loaded or round_robin, got 'fifo'");
  CHECK(error_of(R"("roles": ["decode"])", R"("roles": ["decode"], "host": "a;b")").find("is not a host") != std::string::npos);
  // ssh would take "-oProxyCommand=..." as an option, not a host.
  CHECK(error_of(R"("roles": ["decode"])", R"("roles": ["decode"], "host": "-oProxyCommand=x")").find("is not a host") !=
        std::string::npos);
  // localhost and 127.0.0.1 are one machine: one port under both collides.
  CHECK(error_of(R"("roles": ["gateway"], "ports": {"http": 8000})",
                 R"("roles": ["gateway"], "host": "localhost", "ports": {"http": 7101})")
            .find("port 7101 on localhost is taken") != std::string::npos);
  // Other hosts cannot dial a head on loopback.
  CHECK(error_of(R"("roles": ["decode"])", R"("roles": ["decode"], "host": "10.0.0.2")")
            .find("would dial the router's node 'head' at 127.0.0.1") != std::string::npos);
  // A store block is whole KV pages.
  CHECK(error_of(R"("model": "m")", R"("model": "m", "store": {"dir": "/s", "block_tokens": 40})")
            .find("spec.store.block_tokens (40) must be a multiple of spec.executor.page_tokens (16)") != std::string::npos);
  cluster_spec s;
  std::string why;
  CHECK_FALSE(parse_cluster_spec("[1]", "", &s, &why));
  CHECK(why == "the spec is not a JSON object");
  CHECK_FALSE(load_cluster_spec("/nonexistent/spec.json", &s, &why));
  CHECK(why == "/nonexistent/spec.json: cannot read it");
  // Loaded by a relative path, a relative model path still becomes absolute: it travels to other
  // machines' processes, whose working directory is not ours.
  const auto dir = std::filesystem::temp_directory_path() / ("baton-relspec-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir / "conf");
  std::ofstream{dir / "conf" / "spec.json"} << good;
  const auto was = std::filesystem::current_path();
  std::filesystem::current_path(dir);
  const bool loaded = load_cluster_spec("conf/spec.json", &s, &why);
  std::filesystem::current_path(was);
  REQUIRE_MESSAGE(loaded, why);
  CHECK(s.model == (std::filesystem::canonical(dir) / "conf" / "m").string());
  std::filesystem::remove_all(dir);
}

TEST_CASE("shell quoting survives a real shell, so spec strings are never interpreted") {
  for (const std::string word : {"plain", "two words", "it's", "$HOME `id` \"q\" \\ ;|&", "", "'''"}) {
    const std::string cmd = "printf %s " + shell_quote(word);
    FILE* p = ::popen(cmd.c_str(), "r");
    REQUIRE(p);
    std::string out;
    char buf[256];
    while (size_t n = std::fread(buf, 1, sizeof(buf), p)) out.append(buf, n);
    CHECK(::pclose(p) == 0);
    CHECK(out == word);
  }
  cluster_spec s;
  s.ssh_user = "baton";
  node_launch n{"d", "10.0.0.2", "decode", {"/opt/baton", "node", "--name", "it's"}, {}};
  const auto argv = ssh_argv(s, "10.0.0.2", n);
  CHECK(argv[0] == "ssh");
  CHECK(argv[1] == "-tt");  // the remote process ends with the session
  CHECK(argv[argv.size() - 2] == "baton@10.0.0.2");
  CHECK(argv.back() == "exec '/opt/baton' 'node' '--name' 'it'\\''s'");
  CHECK(is_local_host("127.0.0.1"));
  CHECK(is_local_host("localhost"));
  CHECK_FALSE(is_local_host("10.0.0.1"));
}

namespace {

/// Runs `command` with /bin/sh, `input` on its stdin (when not empty) or its stdout read: what it
/// printed, and its exit status in *status.
std::string run_sh(const std::string& command, const std::string& input, int* status) {
  FILE* p = ::popen(command.c_str(), input.empty() ? "r" : "w");
  REQUIRE(p);
  std::string out;
  if (input.empty()) {
    char buf[256];
    while (size_t n = std::fread(buf, 1, sizeof(buf), p)) out.append(buf, n);
  } else {
    CHECK(std::fwrite(input.data(), 1, input.size(), p) == input.size());
  }
  *status = ::pclose(p);
  return out;
}

}  // namespace

TEST_CASE("a remote node's environment never travels in an argv: ssh's stdin writes it to a file there") {
  cluster_spec s;
  s.name = "demo";
  const std::string secret = "it's a $ecret `id` \"q\" \\ ;|& \n2nd line";
  node_launch n{"gw", "10.0.0.2", "gateway", {"sh", "-c", "printf %s \"$HF_TOKEN|$BATON_API_KEYS\""},
                {{"HF_TOKEN", secret}, {"BATON_API_KEYS", "sk-one,sk-two"}}, false, 0, "d/gateway"};
  const auto argv = ssh_argv(s, "10.0.0.2", n);
  const auto writer = env_file_argv(s, "10.0.0.2", n);
  const auto text = env_file_text(n);
  // No value in either command line, whole or in part ("$ecret" is the part a shell would eat).
  for (const auto* a : {&argv, &writer})
    for (const auto& word : *a)
      for (const std::string& value : {secret, std::string{"$ecret"}, std::string{"sk-one"}})
        CHECK(word.find(value) == std::string::npos);
  CHECK(argv[1] == "-tt");
  CHECK(std::find(writer.begin(), writer.end(), "-tt") == writer.end());  // a terminal would echo the text
  CHECK(writer[1] == "-T");
  CHECK(writer[writer.size() - 2] == "10.0.0.2");
  // One file per process (a gateway sharing a rank node's name), in the remote home.
  CHECK(remote_env_file(s, n) == ".baton/env.demo.d.gateway");
  CHECK(argv.back().find(".baton/env.demo.d.gateway") != std::string::npos);
  CHECK(writer.back().find(".baton/env.demo.d.gateway") != std::string::npos);
  // Each value single-quoted, the quote inside it closed and escaped.
  CHECK(text == "export BATON_API_KEYS='sk-one,sk-two'\nexport HF_TOKEN='it'\\''s a $ecret `id` \"q\" \\ ;|& \n2nd line'\n");
  // Both remote commands through a real shell, with a home of their own: the writer makes the
  // file (mode 0600, in a directory of mode 0700), the node's command applies it, removes it, and
  // runs the node, which sees every value exactly.
  const auto home = std::filesystem::temp_directory_path() / ("baton-envfile-" + std::to_string(::getpid()));
  std::filesystem::create_directories(home);
  const std::string in_home = "HOME=" + shell_quote(home.string()) + " sh -c ";
  int status = -1;
  run_sh(in_home + shell_quote(writer.back()), text, &status);
  CHECK(status == 0);
  const auto file = home / remote_env_file(s, n);
  REQUIRE(std::filesystem::exists(file));
  CHECK(read(file.string()) == text);
  using std::filesystem::perms;
  CHECK((std::filesystem::status(file).permissions() & perms::all) == (perms::owner_read | perms::owner_write));
  CHECK((std::filesystem::status(home / ".baton").permissions() & perms::all) == perms::owner_all);
  const auto out = run_sh(in_home + shell_quote(argv.back()), "", &status);
  CHECK(status == 0);
  CHECK(out == secret + "|sk-one,sk-two");
  CHECK_FALSE(std::filesystem::exists(file));  // gone before the node even started
  // Without the file (a writer that failed), the node does not start.
  run_sh(in_home + shell_quote(argv.back()) + " 2> /dev/null", "", &status);
  CHECK(status != 0);
  std::filesystem::remove_all(home);
  // Without an environment, no file at all.
  n.env.clear();
  CHECK(ssh_argv(s, "10.0.0.2", n).back() == "exec 'sh' '-c' 'printf %s \"$HF_TOKEN|$BATON_API_KEYS\"'");
}

TEST_CASE("Kubernetes manifests and the Slurm script match their golden files") {
  cluster_spec s;
  std::string why;
  const std::string dir = BATON_SOURCE_DIR "/tests/data/deploy/";
  REQUIRE_MESSAGE(load_cluster_spec(dir + "two-hosts.json", &s, &why), why);
  CHECK(kubernetes_manifests(s) == read(dir + "two-hosts.k8s.yaml"));
  CHECK(slurm_script(s) == read(dir + "two-hosts.slurm.sh"));
  // A binary path that would end the ${BATON:-...} expansion, or run a command, stays one word.
  s.binary = "/opt/b}$(touch x)";
  CHECK(slurm_script(s).find("BATON=${BATON:-'/opt/b}$(touch x)'}") != std::string::npos);
  // Spec text that looks like the script's placeholders is quoted like any other: "@HOST$(...)"
  // in a model path became ${HOSTS[$(...)]}, which bash runs as arithmetic, command and all.
  s.model = "/m/@HOST$(touch /tmp/pwned)@x";
  s.prefill_policy = "@HEAD@";
  const auto script = slurm_script(s);
  CHECK(script.find("HOSTS[$(") == std::string::npos);
  CHECK(script.find("'/m/@HOST$(touch /tmp/pwned)@x'") != std::string::npos);
  CHECK(script.find("'@HEAD@'") != std::string::npos);
  const auto k8s = kubernetes_manifests(s);
  CHECK(k8s.find("BATON_PROD_KEYS") == std::string::npos);  // keys come from a Secret, not the file
  CHECK(k8s.find("secretKeyRef") != std::string::npos);
  CHECK(k8s.find("nvidia.com/gpu: 4") != std::string::npos);
}

TEST_CASE("executor.backend cuda: rank processes get --executor cuda, Kubernetes and Slurm a GPU per rank; "
          "store directories get volumes; spares are not written for Kubernetes") {
  const std::string spec = R"({
    "name": "g", "model": "/m", "executor": {"backend": "cuda"},
    "store": {"dir": "/var/lib/baton/store", "capacity_gib": 40.5},
    "nodes": [
      {"name": "head", "roles": ["router", "prefill", "store"], "prefill_ranks": 2, "ports": {"router": 7100, "cluster": 7101}},
      {"name": "d", "roles": ["decode"], "gpus": 8},
      {"name": "s", "roles": ["decode"], "gpus": 8, "spare": true},
      {"name": "st", "roles": ["store"], "ports": {"store": 7200}},
      {"name": "gw", "roles": ["gateway"], "ports": {"http": 8000}},
      {"name": "dg", "roles": ["decode", "gateway"], "gpus": 2, "ports": {"http": 8001}}
    ]})";
  cluster_spec s;
  std::string why;
  REQUIRE_MESSAGE(parse_cluster_spec(spec, "/base", &s, &why), why);
  for (const auto& l : plan_launch(s, "baton", {"127.0.0.1", ""})) {
    const auto at = std::find(l.argv.begin(), l.argv.end(), "--executor");
    const bool ranks = l.role == "head" || l.role == "decode";
    CHECK_MESSAGE((at != l.argv.end() && at + 1 != l.argv.end() && *(at + 1) == "cuda") == ranks, l.name);
  }
  const auto k8s = kubernetes_manifests(s);
  CHECK(k8s.find("nvidia.com/gpu: 2\n") != std::string::npos);  // the head's prefill ranks
  CHECK(k8s.find("nvidia.com/gpu: 8\n") != std::string::npos);
  CHECK(k8s.find("name: g-s\n") == std::string::npos);            // the spare
  CHECK(k8s.find("# node s is a spare: not written") != std::string::npos);
  CHECK(k8s.find("kind: Pod\n") == std::string::npos);
  CHECK(k8s.find("name: g-d\n") != std::string::npos);
  // A claim per store directory (the head's and the store node's), sized by the budget, mounted
  // at the spec's directory.
  CHECK(k8s.find("name: g-head-store\n") != std::string::npos);
  CHECK(k8s.find("name: g-st-store\n") != std::string::npos);
  CHECK(k8s.find("storage: 41Gi\n") != std::string::npos);
  CHECK(k8s.find("mountPath: \"/var/lib/baton/store\"") != std::string::npos);
  CHECK(slurm_script(s).find("#SBATCH --gpus-per-node=8\n") != std::string::npos);
  // A decode node with a gateway beside its ranks: both processes, as two containers of its Pod
  // (the gateway was left out before); the GPUs go to the ranks, the http port to the gateway.
  const auto dg = k8s.substr(k8s.find("name: g-dg\n"));
  const auto ranks_at = dg.find("      - name: baton\n"), gateway_at = dg.find("      - name: gateway\n");
  REQUIRE(ranks_at != std::string::npos);
  REQUIRE(gateway_at != std::string::npos);
  CHECK(dg.find("nvidia.com/gpu: 2\n", ranks_at) < gateway_at);
  CHECK(dg.find("- \"dg/gateway\"", gateway_at) != std::string::npos);
  CHECK(dg.find("containerPort: 8001", gateway_at) != std::string::npos);
  CHECK(dg.find("containerPort: 8001") > gateway_at);  // not on the ranks' container
  CHECK(dg.find("readinessProbe", gateway_at) != std::string::npos);
  // The CPU executor asks for no GPU anywhere.
  s.executor_backend = "cpu";
  CHECK(kubernetes_manifests(s).find("nvidia.com/gpu") == std::string::npos);
  CHECK(slurm_script(s).find("--gpus-per-node") == std::string::npos);
  // Refused by name: a backend that does not exist; expert parallelism on CUDA (CPU only so far).
  CHECK(refusal(spec, R"("backend": "cuda")", R"("backend": "tpu")") ==
        "spec.executor.backend must be cpu or cuda, got 'tpu'");
  const std::string moe = R"({"name": "g", "model": "deepseek-v3-tiny", "executor": {"backend": "cuda"},
    "expert_parallel": {"decode": 2},
    "nodes": [{"name": "head", "roles": ["router"], "ports": {"router": 7100, "cluster": 7101}},
              {"name": "d", "roles": ["decode"], "gpus": 2}]})";
  CHECK(refusal(moe, R"("backend": "cuda")", R"("backend": "cuda")") ==
        "spec.expert_parallel runs on the CPU executor only so far: with spec.executor.backend cuda, leave it out");
}
