// `baton generate`: one request to a running cluster's router through the C++ client library,
// its text printed as it streams in; with --score, each prompt's tokens' log-probabilities too
// (how well the served model predicts a text: its perplexity).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>

#include <unistd.h>

#include "client/baton/client.hpp"
#include "deploy/commands.hpp"
#include "deploy/flags.hpp"

namespace baton::deploy {

int run_generate(const std::vector<std::string>& args) {
  std::string router = "127.0.0.1:7100";
  std::vector<std::string> prompts;
  baton::client::request req;
  uint32_t max_tokens = 16;
  uint64_t seed = 0;
  bool chat = false, verbose = false, score = false;
  bool json_object = false;
  std::string json_schema, regex, gbnf;
  baton::client::connect_options conn_opts;
  flag_set flags;
  // Positional arguments are prompts too: `baton generate --router H:P "prompt"`.
  std::vector<std::string> positional;
  flags.collect_positional(&positional);
  flags.add("--cluster-id", &conn_opts.cluster_id, "the cluster's id");
  flags.add("--tls-cert", &conn_opts.tls_cert, "mutual TLS: this client's certificate (PEM)");
  flags.add("--tls-key", &conn_opts.tls_key, "mutual TLS: its key (PEM)");
  flags.add("--tls-ca", &conn_opts.tls_ca, "mutual TLS: the cluster CA (PEM)");
  flags.add("--router", &router, "HOST:PORT of the cluster's router");
  flags.add("--prompt", &prompts, "the prompt (repeat for several, sent one after another)");
  flags.add("--chat", &chat, "send the prompt as a user message through the model's chat template");
  flags.add("--max-tokens", &max_tokens,
            "tokens to generate (0: what the context leaves after the prompt, within the router's --default-max-tokens)");
  flags.add("--temperature", &req.temperature, "0 = greedy");
  flags.add("--seed", &seed, "sampling seed (default: a fresh one per prompt; give one to repeat a sampled answer)");
  flags.add("--top-p", &req.top_p, "nucleus sampling (1 = off)");
  flags.add("--top-k", &req.top_k, "top-k sampling (0 = off)");
  flags.add("--min-p", &req.min_p, "keep only tokens at least this fraction as likely as the best (0 = off)");
  flags.add("--min-tokens", &req.min_tokens, "no end of the answer (end tokens, stop strings) before this many tokens");
  flags.add("--stop", &req.stop, "a stop string (repeatable)");
  flags.add("--include-stop-str", &req.include_stop_str_in_output,
            "keep the stop string (or stop token's text) that ended the answer at its end");
  flags.add("--ignore-eos", &req.ignore_eos, "generate --max-tokens tokens even past <eos> (load tests)");
  flags.add("--json", &json_object, "answer with a JSON object (constrained decoding)");
  flags.add("--json-schema", &json_schema,
            "answer with JSON matching this JSON schema, given as its text (docs/structured-outputs.md)");
  flags.add("--json-compact", &req.json_compact, "with --json or --json-schema: no whitespace between JSON's tokens");
  flags.add("--regex", &regex, "answer with text this regular expression matches whole (constrained decoding)");
  flags.add("--gbnf", &gbnf, "answer with text this GBNF grammar's root matches, given as its text");
  flags.add("--score", &score,
            "also score the prompt: a line 'score: N tokens, log-probability S, perplexity P' after the text "
            "(with --verbose, each token's log-probability on stderr)");
  flags.add("--verbose", &verbose, "print the request's timings and ranks after its text");
  if (auto rc = flags.parse_command_line(args, "generate", "baton generate --router HOST:PORT [flags] PROMPT..."))
    return *rc;
  prompts.insert(prompts.end(), positional.begin(), positional.end());
  if (max_tokens > static_cast<uint32_t>(INT32_MAX)) {  // a request's max_tokens is an int32: 4294967295 became -1
    std::fprintf(stderr, "baton generate: --max-tokens must be at most 2147483647, got %u\n", max_tokens);
    return 2;
  }
  if (prompts.empty()) {
    std::fprintf(stderr, "baton generate: give a prompt (baton generate --router HOST:PORT \"prompt\")\n");
    return 2;
  }
  if (json_object + !json_schema.empty() + !regex.empty() + !gbnf.empty() > 1) {
    std::fprintf(stderr, "baton generate: give one of --json, --json-schema, --regex and --gbnf; an answer follows one\n");
    return 2;
  }
  using baton::client::output_kind;
  req.output = json_object            ? output_kind::json_object
               : !json_schema.empty() ? output_kind::json_schema
               : !regex.empty()       ? output_kind::regex
               : !gbnf.empty()        ? output_kind::gbnf
                                      : output_kind::text;
  req.output_spec = json_schema + regex + gbnf;  // the one given
  if (req.json_compact && req.output != output_kind::json_object && req.output != output_kind::json_schema) {
    std::fprintf(stderr, "baton generate: --json-compact shapes JSON; give it with --json or --json-schema\n");
    return 2;
  }
  std::string host, why;
  uint16_t port = 0;
  if (!parse_host_port(router, "--router", &host, &port, &why)) {
    std::fprintf(stderr, "baton generate: %s\n", why.c_str());
    return 2;
  }
  auto conn = baton::client::connection::connect(host, port, conn_opts, &why);
  if (!conn) {
    std::fprintf(stderr, "baton generate: %s\n", why.c_str());
    return 1;
  }
  req.max_tokens = static_cast<int32_t>(max_tokens);
  // Sampling without --seed draws a seed per prompt, as the HTTP gateway does: a fixed default
  // gave every run the same "random" text.
  const bool seed_given = std::any_of(args.begin(), args.end(), [](const std::string& a) {
    return a == "--seed" || a.rfind("--seed=", 0) == 0;
  });
  std::random_device entropy;
  req.seed = seed;
  req.prompt_logprobs = score;
  int failures = 0;
  for (const auto& p : prompts) {
    if (chat)
      req.messages = {{"user", p}};
    else
      req.prompt = p;
    if (!seed_given && req.temperature > 0) req.seed = (uint64_t{entropy()} << 32) | entropy();
    auto s = conn->submit(req);
    baton::client::token_chunk c;
    while (s->next(&c)) {
      std::fwrite(c.text.data(), 1, c.text.size(), stdout);
      std::fflush(stdout);
    }
    std::printf("\n");
    if (s->failed()) {
      ++failures;
      std::fprintf(stderr, "baton generate: %s: %s\n", s->error_info().code.c_str(), s->error_info().message.c_str());
      // Each prompt sent after it would wait out the client's grace to fail the same way.
      if (s->error_info().code == "router_gone") {
        if (const size_t left = prompts.size() - static_cast<size_t>(&p - prompts.data()) - 1; left > 0)
          std::fprintf(stderr, "baton generate: the router is gone: %zu more prompt(s) not sent\n", left);
        return 1;
      }
      continue;
    }
    if (s->timed_out()) {
      ++failures;
      std::fprintf(stderr, "baton generate: no answer in time\n");
      continue;
    }
    const auto& r = s->final_result();
    if (score) {
      // The first token has no log-probability (nothing precedes it): N - 1 terms.
      double sum = 0.0;
      for (size_t i = 1; i < r.prompt_logprobs.size(); ++i) {
        sum += r.prompt_logprobs[i].logprob;
        if (verbose)
          std::fprintf(stderr, "  %5zu %-16s %10.6f\n", i, ("'" + r.prompt_logprobs[i].text + "'").c_str(),
                       static_cast<double>(r.prompt_logprobs[i].logprob));
      }
      const size_t n = r.prompt_logprobs.size() > 1 ? r.prompt_logprobs.size() - 1 : 0;
      std::printf("score: %zu tokens, log-probability %.6f, perplexity %.6f\n", n, sum,
                  n ? std::exp(-sum / static_cast<double>(n)) : 1.0);
    }
    if (verbose) {
      // The first gap apart: the decode rank's first step (a rank waking from idleness shows there).
      std::string tbt;
      if (!r.tbt_us.empty()) {
        int64_t sum = 0, max = 0;
        for (auto t : r.tbt_us) sum += t, max = std::max(max, t);
        char buf[96];
        std::snprintf(buf, sizeof buf, ", TBT mean %.3f ms (first %.3f, max %.3f)",
                      static_cast<double>(sum) / static_cast<double>(r.tbt_us.size()) / 1000.0,
                      static_cast<double>(r.tbt_us.front()) / 1000.0, static_cast<double>(max) / 1000.0);
        tbt = buf;
      }
      // On one terminal, the stats start a line of their own, not the text's last one.
      std::fflush(stdout);
      if (isatty(STDOUT_FILENO) && isatty(STDERR_FILENO) && !r.text.empty() && r.text.back() != '\n')
        std::fputc('\n', stderr);
      std::fprintf(stderr, "[request %llu] %zu tokens (%s), %u prompt tokens (%u cached), TTFT %.3f ms%s, %s -> %s\n",
                   static_cast<unsigned long long>(r.request_id), r.tokens.size(), r.finish_reason.c_str(),
                   r.num_prompt_tokens, r.cached_tokens, static_cast<double>(r.ttft_us) / 1000.0, tbt.c_str(),
                   r.prefill_rank.c_str(), r.decode_rank.empty() ? "(no decode rank: one token)" : r.decode_rank.c_str());
      if (r.failovers)
        std::fprintf(stderr, "[request %llu] re-placed %u time(s) after a rank failed; the last: %s\n",
                     static_cast<unsigned long long>(r.request_id), r.failovers, r.failover_why.c_str());
      if (r.migrations)
        std::fprintf(stderr, "[request %llu] its decode moved %u time(s), KV and all, to another rank\n",
                     static_cast<unsigned long long>(r.request_id), r.migrations);
    }
  }
  return failures ? 1 : 0;
}

}  // namespace baton::deploy
