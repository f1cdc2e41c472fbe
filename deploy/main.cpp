// The `baton` executable: one binary, subcommands (design.md).

#include <sys/prctl.h>
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "actors/wire_identity.hpp"
#include "deploy/commands.hpp"
#include "deploy/expert_processes.hpp"

namespace {

const char* usage =
    "usage: baton <command> [flags]\n"
    "\n"
    "commands:\n"
    "  local     run a disaggregated cluster (router, prefill and decode ranks) in this\n"
    "            process on the built-in model and answer sample prompts\n"
    "            (--decode-processes N puts the decode ranks in their own processes;\n"
    "            --serve with --router-listen/--http-listen serves clients instead)\n"
    "  node      one rank in its own process, joined to a head (what `local` starts)\n"
    "  launch    start every node of a cluster spec (JSON) as processes, here or over ssh\n"
    "  deploy    k8s|slurm: write Kubernetes manifests or a Slurm batch script for a spec\n"
    "  gateway   an OpenAI-compatible HTTP gateway in front of a running cluster's router\n"
    "  generate  send prompts to a running cluster's router and stream the answers\n"
    "  status    list a running cluster's nodes (joined, draining, gone) and ranks (load, KV)\n"
    "  profile   measure the CPU executor on the seeded random model, fit the prefill and\n"
    "            decode cost models, write a profile file (--out) that balancers and sims load\n"
    "  export-model  write the seeded random model (or a model directory) as a Hugging Face\n"
    "            directory that --model DIR loads\n"
    "  sim       run|goodput|compare: replay a request trace through the actors under\n"
    "            virtual time on modelled GPUs (roofline of H200/H100/H800)\n"
    "\n"
    "`baton <command> --help` lists a command's flags; `baton --version` the version and build.\n";

}  // namespace

int main(int argc, char** argv) {
  // Started by a baton launcher (spawn_process): go when it goes, as if told to stop (SIGTERM
  // drains a node). Checked once more after arming: it may have gone before.
  if (const char* parent = std::getenv("BATON_PARENT_PID")) {
    ::prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (std::to_string(::getppid()) != parent) std::raise(SIGTERM);
    ::unsetenv("BATON_PARENT_PID");
  }
  if (argc < 2) {
    std::fputs(usage, stderr);
    return 2;
  }
  const std::string cmd = argv[1];
  std::vector<std::string> args(argv + 2, argv + argc);
  if (cmd == "local") return baton::deploy::run_local(args);
  if (cmd == "node") return baton::deploy::run_node(args);
  if (cmd == "experts") return baton::deploy::run_experts(args);
  if (cmd == "profile") return baton::deploy::run_profile(args);
  if (cmd == "gateway") return baton::deploy::run_gateway(args);
  if (cmd == "launch") return baton::deploy::run_launch(args);
  if (cmd == "deploy") return baton::deploy::run_deploy(args);
  if (cmd == "generate") return baton::deploy::run_generate(args);
  if (cmd == "status") return baton::deploy::run_status(args);
  if (cmd == "sim") return baton::deploy::run_sim(args);
  if (cmd == "export-model") return baton::deploy::run_export_model(args);
  if (cmd == "--version" || cmd == "version") {
#ifdef BATON_HAVE_CUDA
    constexpr const char* cuda = "with the CUDA executor (sm_90)";
#else
    constexpr const char* cuda = "CPU executor only (built without nvcc)";
#endif
    // The wire fingerprint: processes of builds whose messages differ refuse each other at connect.
    std::printf("baton %s, %s, wire %s\n", BATON_VERSION, cuda, baton::wire_fingerprint());
    return 0;
  }
  if (cmd == "--help" || cmd == "-h" || cmd == "help") {
    std::fputs(usage, stdout);
    return 0;
  }
  std::fprintf(stderr, "baton: unknown command '%s'\n\n%s", cmd.c_str(), usage);
  return 2;
}
