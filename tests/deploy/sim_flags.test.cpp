// `baton sim`'s flags are checked before anything runs, and the errors name the flag and its
// value; the goodput and run summaries say what their figures cover. In process, through the
// command's entry point (deploy::run_sim). Refusals run nothing; the two tests that do simulate
// use a few synthetic requests.

#include <doctest/doctest.h>

#include <unistd.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "deploy/commands.hpp"

namespace {

struct outcome {
  int rc = -1;
  std::string out, err;
};

std::string slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

/// `baton sim ARGS` in this process, its stdout and stderr caught in files (the command prints
/// with printf, so the streams are redirected at the descriptors).
outcome baton_sim(const std::vector<std::string>& args) {
  char out_path[] = "/tmp/baton-sim-flags-out-XXXXXX", err_path[] = "/tmp/baton-sim-flags-err-XXXXXX";
  const int out_fd = ::mkstemp(out_path), err_fd = ::mkstemp(err_path);
  REQUIRE((out_fd >= 0 && err_fd >= 0));
  std::fflush(stdout);
  std::fflush(stderr);
  const int saved_out = ::dup(1), saved_err = ::dup(2);
  ::dup2(out_fd, 1);
  ::dup2(err_fd, 2);
  outcome o;
  o.rc = baton::deploy::run_sim(args);
  std::fflush(stdout);
  std::fflush(stderr);
  ::dup2(saved_out, 1);
  ::dup2(saved_err, 2);
  for (int fd : {saved_out, saved_err, out_fd, err_fd}) ::close(fd);
  o.out = slurp(out_path);
  o.err = slurp(err_path);
  std::remove(out_path);
  std::remove(err_path);
  return o;
}

bool has(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

/// A refusal: exit code 2, `why` on stderr, and nothing run (no table, no summary on stdout).
void refused(const std::vector<std::string>& args, const std::string& why) {
  const auto o = baton_sim(args);
  INFO("stderr: " << o.err);
  INFO("stdout: " << o.out);
  CHECK(o.rc == 2);
  CHECK(has(o.err, why));
  CHECK(o.out.empty());
}

/// A small cluster that simulates a few requests in well under a second.
const std::vector<std::string> small = {"--rate", "2", "--duration-s", "5", "--model", "llama-3-8b", "--tp", "1",
                                        "--prefill-instances", "1", "--decode-instances", "1"};

std::vector<std::string> with(std::vector<std::string> head, const std::vector<std::string>& tail) {
  head.insert(head.end(), tail.begin(), tail.end());
  return head;
}

/// The same cluster without synthetic arrivals' flags, for a --trace.
const std::vector<std::string> small_cluster = {"--model", "llama-3-8b", "--tp", "1", "--prefill-instances", "1",
                                                "--decode-instances", "1"};

/// A Mooncake trace file of (timestamp ms, prompt tokens, output tokens) rows, each prompt one
/// block; removed when it goes.
struct trace_file {
  std::string path;
  explicit trace_file(const std::vector<std::array<int, 3>>& rows) {
    static int made = 0;
    path = (std::filesystem::temp_directory_path() /
            ("baton-sim-flags-" + std::to_string(::getpid()) + "-" + std::to_string(made++) + ".jsonl"))
               .string();
    std::ofstream out(path);
    for (const auto& [ms, input, output] : rows)
      out << "{\"timestamp\": " << ms << ", \"input_length\": " << input << ", \"output_length\": " << output
          << ", \"hash_ids\": [" << ms << "]}\n";
  }
  ~trace_file() { std::remove(path.c_str()); }
};

}  // namespace

TEST_CASE("sim goodput refuses a search range that is not one, before any run") {
  // These printed "0.000 x the trace's rate = 0.00 requests/s with >= 90% within ..." before.
  refused({"goodput", "--lo", "2", "--hi", "0.05"}, "--lo 2 must be below --hi 0.05");
  refused({"goodput", "--lo", "1", "--hi", "1"}, "--lo 1 must be below --hi 1");
  refused({"goodput", "--lo", "0"}, "--lo must be > 0 (a rate scale), got 0");
  refused({"goodput", "--lo", "-1"}, "--lo must be > 0 (a rate scale), got -1");
  refused({"goodput", "--steps", "0"}, "--steps must be between 1 and 40, got 0");
  refused({"goodput", "--steps", "1000"}, "--steps must be between 1 and 40, got 1000");
  refused({"goodput", "--target", "90"}, "--target must be a fraction in (0, 1] (0.9: 90% of requests), got 90");
  refused({"goodput", "--target", "0"}, "got 0");
  refused({"compare", "--lo", "2", "--hi", "0.05"}, "--lo 2 must be below --hi 0.05");
  // A synthetic trace too large at --hi was found only after the runs at the lower rates.
  refused({"goodput", "--rate", "1000000", "--duration-s", "10", "--hi", "8"}, "at --hi 8: ");
}

TEST_CASE("sim run checks --report and --svg can be written before it simulates, and leaves no file behind") {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("baton-sim-flags-" + std::to_string(::getpid()));
  fs::create_directories(dir);
  refused({"run", "--report", dir.string()}, "--report " + dir.string() + " is a directory, not a file (e.g. " +
                                                 (dir / "report.json").string() + ")");
  refused({"run", "--report", "/nonexistent-baton-dir/x.json"},
          "--report /nonexistent-baton-dir/x.json: the directory /nonexistent-baton-dir does not exist");
  refused({"run", "--report", (dir / "sub/").string()}, "names no file");
  refused({"run", "--svg", "/nonexistent-baton-dir/plots"},
          "--svg /nonexistent-baton-dir/plots: the directory /nonexistent-baton-dir does not exist");
  fs::create_directories(dir / "p-ttft.svg");
  refused({"run", "--svg", (dir / "p").string()}, (dir / "p-ttft.svg").string() + " is a directory, not a file");
  // A report path that can be written is tried by making the file, which is removed again.
  const auto report = dir / "report.json";
  refused({"run", "--report", report.string(), "--svg", "/nonexistent-baton-dir/plots"}, "--svg");
  CHECK_FALSE(fs::exists(report));
  fs::remove_all(dir);
  // Outputs a command never writes, and a trace to follow that is not there, are refused, not
  // silently ignored.
  refused({"goodput", "--report", "/tmp/r.json"}, "--report is written by `baton sim run` only, not by goodput");
  refused({"compare", "--report", "/tmp/r.json"}, "--report is written by `baton sim run` only, not by compare");
  // Nor inside a variant, where it was ignored without a word.
  refused({"compare", "--variant", "a=--report /tmp/x.json"}, "variant 'a': --report and --svg are not per variant");
  refused({"compare", "--variant", "a=--svg /tmp/x"}, "variant 'a': --report and --svg are not per variant");
  refused({"goodput", "--svg", "/tmp/p"}, "--svg is drawn by `baton sim run` and `compare` only, not by goodput");
  refused({"run", "--then-trace", "/tmp/t.jsonl"}, "--then-trace /tmp/t.jsonl follows a --trace, and none is given");
}

TEST_CASE("sim refuses a --tp the model's heads do not split over, and names the flags config checks are about") {
  refused({"run", "--model", "llama-3-70b", "--tp", "3"},
          "--tp 3 does not split llama-3-70b's 64 attention heads and 8 KV heads evenly over an instance's GPUs; "
          "llama-3-70b takes --tp 1, 2, 4, 8, 16, 32, 64");
  refused({"run", "--model", "deepseek-v3", "--tp", "3"}, "--tp 3 does not split deepseek-v3's 128 attention heads evenly");
  // Valid splits pass the check: the refusal that follows is the unwritable report's.
  for (const char* tp : {"1", "8"})
    refused({"run", "--model", "llama-3-70b", "--tp", tp, "--report", "/nonexistent-baton-dir/x.json"}, "--report");
  for (const char* tp : {"16", "64"})  // within a node of 64 GPUs
    refused({"run", "--model", "llama-3-70b", "--tp", tp, "--gpus-per-node", "64", "--report", "/nonexistent-baton-dir/x.json"},
            "--report");
  // Expert-parallel pools (both of them here) do not use --tp: given, it is refused, not dropped.
  refused({"run", "--model", "deepseek-v3", "--prefill-ep", "8", "--decode-ep", "8", "--tp", "3"},
          "--tp 3 applies to pools without expert parallelism");
  // These said "tp and decode_instances must be >= 1", config fields rather than flags.
  refused({"run", "--tp", "0"}, "--tp must be >= 1, got 0");
  refused({"run", "--decode-instances", "0"}, "--decode-instances must be >= 1, got 0");
  refused({"run", "--prefill-ep", "0"}, "--prefill-ep must be >= 1, got 0");
  refused({"run", "--model", "llama-3-8b", "--decode-ep", "4"},
          "--decode-ep 4 needs a model with routed experts; llama-3-8b has none");
  // The config's own checks, its fields given as the flags that set them.
  refused({"run", "--prefill-instances", "0"}, "a disaggregated cluster needs --prefill-instances >= 1");
  refused({"run", "--page-tokens", "48"}, "block_tokens must be a positive multiple of --page-tokens");
  refused({"run", "--sample-s", "0.0001"}, "--sample-s must be 0 (off) or between 0.001 and 1e6");
  refused({"run", "--kill", "decode-7@10"},
          "--kill decode-7@10: this cluster has no rank 'decode-7' (it has prefill-0 to prefill-3, decode-0 to decode-3)");
  refused({"run", "--rate-scale", "0"}, "--rate-scale must be > 0, got 0");
  // compare checks every variant before the first one runs.
  refused({"compare", "--model", "llama-3-8b", "--variant", "ok=--tp 1", "--variant", "bad=--tp 3"},
          "variant 'bad': --tp 3 does not split llama-3-8b's 32 attention heads and 8 KV heads");
}

TEST_CASE("sim goodput says so when even the lowest rate tried misses the target") {
  // A TTFT SLO of 1 ms that no request meets: the search stops after its run at --lo.
  const auto o = baton_sim(with({"goodput", "--ttft-slo-ms", "1"}, small));
  INFO("stdout: " << o.out);
  INFO("stderr: " << o.err);
  CHECK(o.rc == 1);
  CHECK(has(o.out, "baton sim goodput: even the lowest rate tried (0.250 x the trace's rate = "));
  CHECK(has(o.out, "meets the SLOs (TTFT <= 1 ms and TBT <= 100 ms) for only 0.0% of requests (target 90%)"));
  // A lower --lo need not help (misses a trace's own prompts cause): it says where to look.
  CHECK(has(o.out, "If a lower one does no better, the misses are not the load's"));
  CHECK(has(o.out, "`baton sim run --rate-scale 0.25` shows its TTFT and TBT percentiles against the SLOs"));
  CHECK_FALSE(has(o.out, "0.000 x the trace's rate"));
}

TEST_CASE("sim run says which span each figure covers, and why requests failed") {
  // Every decode rank killed at the start: every request fails, placed nowhere.
  const auto o = baton_sim(with({"run", "--kill", "decode-0@0"}, small));
  INFO("stdout: " << o.out);
  INFO("stderr: " << o.err);
  CHECK(o.rc == 1);
  CHECK(has(o.out, "requests arriving from "));
  CHECK(has(o.out, "; the sim ended at "));
  CHECK(has(o.out, "throughput: none (no request completed)"));
  CHECK(has(o.out, "failed 10 of 10 requests:"));
  CHECK(has(o.out, "10 x, e.g. baton::rank_unavailable: "));
  CHECK(has(o.out, "no decode rank in the cluster"));
}

TEST_CASE("baton sim --help names the modes on stdout and exits 0; no mode is still a usage error") {
  const auto help = baton_sim({"--help"});
  CHECK(help.rc == 0);
  CHECK(has(help.out, "run      replay a trace"));
  CHECK(has(help.out, "`baton sim MODE --help` lists each mode's flags"));
  const auto none = baton_sim({});
  CHECK(none.rc == 2);
  CHECK(has(none.err, "usage: baton sim run|goodput|compare"));
}

TEST_CASE("sim run's text summary counts the re-placements a --kill caused, as its JSON report does, and says what "
          "else re-places a request") {
  const auto o = baton_sim(with({"run", "--kill", "decode-0@3"}, with(small, {"--rate", "10", "--decode-instances", "2"})));
  INFO("stdout: " << o.out);
  CHECK(o.rc == 0);
  // The request actors count a decode rank's refusal for lack of KV as they count a failure:
  // "failovers ... after a rank failed" claimed faults that no run had.
  CHECK(has(o.out, "re-placements: 5 (a request placed again after a rank failed or timed out, or refused it for lack "
                   "of KV)"));
  CHECK_FALSE(has(o.out, "failovers:"));
}

TEST_CASE("sim compare checks every variant's policy names and trace before the first variant runs") {
  // The ok variant ran in full (its table row on stdout, and its goodput search) before these
  // were found: the balancers parsed the names, and the traces were read, only at each run.
  refused(with({"compare", "--variant", "ok=--prefill-instances 2", "--variant", "bad=--prefill-policy leastloaded"}, small),
          "variant 'bad': --prefill-policy must be seed, least_loaded, round_robin or cache_affinity, got 'leastloaded'");
  refused(with({"compare", "--variant", "ok=--prefill-instances 2", "--variant", "bad=--decode-policy fastest"}, small),
          "variant 'bad': --decode-policy must be seed, least_loaded or round_robin, got 'fastest'");
  // split parses but sims refuse it: the message for a bad name does not offer it.
  const auto o = baton_sim(with({"run", "--prefill-policy", "leastloaded"}, small));
  CHECK(o.rc == 2);
  CHECK_FALSE(has(o.err, "split"));
  refused(with({"run", "--prefill-policy", "split"}, small), "the split prefill policy is not supported in sims yet");
  const trace_file good({{0, 100, 4}, {1000, 100, 4}, {2000, 100, 4}});
  refused(with({"compare", "--variant", "ok=--trace " + good.path, "--variant", "bad=--trace /nonexistent-baton-dir/t.jsonl"},
               small_cluster),
          "variant 'bad': /nonexistent-baton-dir/t.jsonl: cannot read it");
  // Read, not only opened: a malformed row, named by file and line, is found before the runs too.
  const trace_file empty_prompt({{0, 100, 4}, {1000, 0, 4}});
  refused(with({"compare", "--variant", "ok=--trace " + good.path, "--variant", "bad=--trace " + empty_prompt.path},
               small_cluster),
          "variant 'bad': " + empty_prompt.path + ":2: input_length is 0: a request needs a prompt of at least one token");
}

TEST_CASE("sim goodput refuses a trace whose arrivals share one instant: it has no rate to scale") {
  // It printed ">= 8.000 x the trace's rate = >= 0.00 requests/s" and exited 0.
  const trace_file burst({{5000, 100, 4}, {5000, 200, 4}, {5000, 300, 4}});
  refused(with({"goodput", "--trace", burst.path}, small_cluster),
          burst.path + " has 3 requests, all arriving at the same instant: goodput scales a trace's arrival rate");
  refused(with({"compare", "--variant", "a=--trace " + burst.path}, small_cluster),
          "variant 'a': " + burst.path + " has 3 requests, all arriving at the same instant");
  // One instant of the trace, cut by --max-requests: the same.
  const trace_file spread({{0, 100, 4}, {1000, 100, 4}});
  refused(with({"goodput", "--trace", spread.path, "--max-requests", "1"}, small_cluster),
          spread.path + " holds one request: goodput scales a trace's arrival rate");
}

TEST_CASE("sim refuses negative or zero rates, bandwidths and SLOs, naming the flag and the value") {
  // --nic-gbps -3 ran exactly as the default; --ttft-slo-ms 0 failed every request.
  refused({"run", "--nic-gbps", "-3"}, "--nic-gbps must be > 0 GB/s (or 0: the GPU's own), got -3");
  refused({"run", "--pcie-gbps", "-1"}, "--pcie-gbps must be > 0 GB/s (or 0: the GPU's own), got -1");
  refused({"run", "--ttft-slo-ms", "0"}, "--ttft-slo-ms must be > 0 (milliseconds), got 0");
  refused({"run", "--ttft-slo-ms", "-5"}, "--ttft-slo-ms must be > 0 (milliseconds), got -5");
  refused({"run", "--tbt-slo-ms", "-1"}, "--tbt-slo-ms must be > 0 (milliseconds), got -1");
  refused({"run", "--store-gbps", "0"}, "--store-gbps must be > 0 (GB/s), got 0");
  refused({"run", "--horizon-s", "-1"}, "--horizon-s must be > 0 (seconds), got -1");
  refused({"run", "--elastic-interval-s", "-2"}, "--elastic-interval-s must be > 0 (seconds), got -2");
  refused({"run", "--sample-s", "-1"}, "--sample-s must be >= 0 (0: no timeline), got -1");
  refused({"run", "--expert-skew", "-0.5"}, "--expert-skew must be >= 0 (0: uniform), got -0.5");
  refused({"run", "--elastic-cold", "0.9"}, "--elastic-cold 0.9 and --elastic-hot 0.8: the planner needs 0 <= cold < hot");
  refused({"run", "--elastic-signal", "p99"}, "--elastic-signal must be mean or max, got 'p99'");
  refused({"goodput", "--ttft-slo-ms", "0"}, "--ttft-slo-ms must be > 0");
  refused({"compare", "--variant", "a=--tbt-slo-ms -1"}, "variant 'a': --tbt-slo-ms must be > 0 (milliseconds), got -1");
  // A fault's rate and time: "must be NAME@SECONDS=GBPS" said nothing of which part was wrong.
  refused({"run", "--degrade", "decode-1@30=0"}, "--degrade decode-1@30=0: GBPS must be > 0");
  refused({"run", "--degrade", "decode-1@30=-4"}, "--degrade decode-1@30=-4: GBPS must be > 0");
  refused({"run", "--degrade", "decode-1@-30=4"}, "--degrade decode-1@-30=4: SECONDS must be >= 0");
  refused({"run", "--kill", "decode-1@-5"}, "--kill decode-1@-5: SECONDS must be >= 0");
  refused({"run", "--kill", "decode-1@"}, "--kill must be RANK@SECONDS (e.g. decode-1@600), got 'decode-1@'");
}

TEST_CASE("sim refuses flags that the kind of arrivals given would ignore") {
  const trace_file t({{0, 100, 4}, {1000, 100, 4}});
  refused({"run", "--trace", t.path, "--rate", "5", "--input-mean", "100"},
          "--rate 5, --input-mean 100 shape synthetic arrivals, and --trace " + t.path +
              " replays a trace instead: drop them (--rate-scale scales a trace's rate)");
  refused({"run", "--trace", t.path, "--day-s", "600"}, "--day-s 600 shapes synthetic arrivals");
  refused({"run", "--max-requests", "10"},
          "--max-requests 10 cuts a --trace, and none is given: synthetic arrivals are as many as --rate and "
          "--duration-s make");
  refused({"run", "--window-start-s", "5", "--window-s", "60"}, "--window-start-s 5, --window-s 60 cut a --trace");
  // A synthetic day's flags without the day; means the lengths' cut would distort.
  refused({"run", "--day-swing", "0.9"}, "--day-swing 0.9 shapes a synthetic day, and --day-s is 0 (steady arrivals)");
  refused({"run", "--alt-input-mean", "100", "--alt-output-mean", "50"},
          "--alt-input-mean 100, --alt-output-mean 50 shape a synthetic day, and --day-s is 0");
  refused({"run", "--input-mean", "65536"},
          "--input-mean must be at most 8192, got 65536: synthetic lengths are lognormal (cv 1) cut at 32768 tokens");
  refused({"run", "--output-mean", "8192"}, "--output-mean must be at most 1024, got 8192");
  refused({"run", "--model", "llama-3-70b", "--tp", "1"},
          "the weights do not fit llama-3-70b on 1 x H200 (141 GB of weights, 141 GB of HBM (90% usable)): no room for KV");
  refused({"run", "--model", "llama-3-70b", "--tp", "16"},
          "--tp 16 spans more than one node (--gpus-per-node 8): tensor parallelism is timed over NVLink within a node only");
  refused({"run", "--model", "deepseek-v3", "--tp", "4", "--prefill-ep", "8", "--decode-ep", "16"},
          "--tp 4 applies to pools without expert parallelism");
  refused({"run", "--rate", "0.001", "--duration-s", "60"},
          "synthetic arrivals at --rate 0.001 over --duration-s 60 drew no request: raise either");
  refused({"run", "--day-s", "600", "--alt-output-mean", "2000"}, "--alt-output-mean must be at most 1024, got 2000");
  // In compare, over the variant's flags and the common ones together.
  refused({"compare", "--rate", "5", "--variant", "t=--trace " + t.path}, "variant 't': --rate 5 shapes synthetic arrivals");
  // Meaningful with either: --rate-scale, --seed (recorded with a trace).
  refused({"run", "--trace", t.path, "--rate-scale", "2", "--seed", "7", "--report", "/nonexistent-baton-dir/x.json"},
          "--report /nonexistent-baton-dir/x.json: the directory /nonexistent-baton-dir does not exist");
}

TEST_CASE("sim refuses KV pools this machine cannot hold in its own flag's words") {
  // The cluster refused them with "... lower --kv-pages", a flag of `baton local`'s, not sim's.
  const auto o = baton_sim(with({"run", "--kv-tokens", "99999999999"}, small));
  INFO("stderr: " << o.err);
  CHECK(o.rc == 2);
  CHECK(has(o.err, "a decode rank's KV pool of 1562499999 pages (99999999999 KV tokens per instance; "));
  CHECK(has(o.err, "in one allocation, more than this machine's"));
  CHECK(has(o.err, "give a smaller --kv-tokens"));
  CHECK_FALSE(has(o.err, "kv-pages"));
  CHECK(o.out.empty());
  // compare: before the first variant runs.
  refused(with({"compare", "--variant", "ok=", "--variant", "big=--kv-tokens 99999999999"}, small),
          "variant 'big': a decode rank's KV pool of 1562499999 pages");
}

TEST_CASE("sim run replays a trace's rows of 0 output tokens as prefill-only, and says how many") {
  const trace_file t({{0, 100, 0}, {1000, 100, 3}});
  const auto o = baton_sim(with({"run", "--trace", t.path}, small_cluster));
  INFO("stdout: " << o.out);
  INFO("stderr: " << o.err);
  CHECK(o.rc == 0);
  CHECK(has(o.out, "requests 2, completed 2, failed 0"));
  CHECK(has(o.out, "requests that record 0 output tokens: 1, replayed as prefill-only (1 token: the first)"));
}

TEST_CASE("sim goodput's help says how many runs --steps makes") {
  const auto o = baton_sim({"goodput", "--help"});
  CHECK(o.rc == 0);
  CHECK(has(o.out, "--steps"));
  CHECK(has(o.out, "after the runs at --lo and --hi: up to steps + 2 runs"));
}
