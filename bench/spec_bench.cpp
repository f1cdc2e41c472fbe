// Speculative decoding by prompt lookup (decode_rank_config::speculative_tokens) against decoding
// one token a step, in the same run, on the same requests: an in-process cluster (one prefill,
// one decode rank) per setting, greedy answers of --tokens tokens.
//
// Two workloads from the trained model's held-out text (models/baton-kjv-tiny/heldout.txt):
// "quote" -- a passage, then its first words again, so an answer that goes on quoting finds its
// drafts in the prompt (RAG answers, code edits, summaries) -- and "fresh" -- a passage to go on
// from, where drafts come only from the answer's own repeats. Batch 1 (one request at a time:
// the memory-bound case speculation is for) and batch 8 (eight 48-token prompts at once), with
// drafts in every step and under the default speculative_max_batch.
//
// The ceiling it chases: a step that checks drafts costing no more than a step without, so the
// speed-up would equal the tokens per step. The table gives both: tokens per step (the ideal)
// and the measured speed-up (what verification rows cost on this executor is the gap).
// Usage: baton_bench_spec [--drafts K] [--tokens N] [--threads T] [--shape kjv|100m|0.5b]

#include <cstdio>
#include <future>
#include <string>
#include <vector>

#include <caf/actor_system.hpp>
#include <caf/actor_system_config.hpp>
#include <caf/scoped_actor.hpp>

#include "actors/local_cluster.hpp"
#include "bench/bench_flags.hpp"
#include "bench/bench_models.hpp"
#include "gpu/hf_model.hpp"
#include "gpu/text_file.hpp"
#include "gpu/tokenizer.hpp"

using namespace baton;

namespace {

struct outcome {
  double decode_tok_s = 0;   ///< tokens per second while every sequence decodes (see run)
  uint64_t tokens = 0;       ///< all requests' tokens
  uint64_t steps = 0;        ///< the decode rank's steps
  uint64_t drafted = 0, accepted = 0;
  std::vector<std::vector<int32_t>> answers;
  bool ok = true;
  bool whole_span = false;  ///< no window in which all decoded at once: speed over the whole span
};

outcome run(caf::actor_system& sys, local_cluster_config cfg, uint32_t drafts,
            const std::vector<std::vector<int32_t>>& prompts, uint32_t max_tokens, uint32_t max_batch = 0) {
  cfg.decode.speculative_tokens = drafts;
  cfg.decode.speculative_max_batch = max_batch;
  auto cluster = start_local_cluster(sys, cfg);
  outcome out;
  caf::scoped_actor self{sys};
  std::vector<std::future<caf::expected<completion>>> sent;
  for (const auto& p : prompts)
    sent.push_back(std::async(std::launch::async, [&sys, &cluster, p, max_tokens] {
      caf::scoped_actor s{sys};
      generate_request req;
      req.prompt_tokens = p;
      req.max_tokens = max_tokens;
      req.ignore_eos = true;
      caf::expected<completion> got{caf::error{}};
      s->request(cluster.router, std::chrono::seconds{3600}, generate_atom::value, std::move(req))
          .receive([&](completion& c) { got = std::move(c); }, [&](caf::error& e) { got = std::move(e); });
      return got;
    }));
  // Each token's time since its request arrived (all arrive together): the first token's TTFT,
  // then the intervals. Decode speed is read while every sequence decodes and no prompt is being
  // prefilled -- from the last first token to the first last token -- as the tokens in that
  // window over its length (prefills share the cores, and would blur it). Batch prompts are short
  // for it (main); a window that closes before it opens falls back to the whole span, marked.
  std::vector<std::vector<double>> times;
  for (auto& f : sent) {
    auto got = f.get();
    if (!got) {
      std::fprintf(stderr, "request failed: %s\n", sys.render(got.error()).c_str());
      out.ok = false;
      continue;
    }
    std::vector<double> at{static_cast<double>(got->ttft_us) / 1e6};
    for (auto us : got->tbt_us) at.push_back(at.back() + static_cast<double>(us) / 1e6);
    times.push_back(std::move(at));
    out.tokens += got->tokens.size();
    out.answers.push_back(got->tokens);
  }
  double from = 0, to = 1e30, first = 1e30, last = 0;
  uint64_t all_decoded = 0;
  for (const auto& at : times) {
    from = std::max(from, at.front());
    to = std::min(to, at.back());
    first = std::min(first, at.front());
    last = std::max(last, at.back());
    all_decoded += at.size() - 1;
  }
  uint64_t in_window = 0;
  for (const auto& at : times)
    for (double x : at) in_window += x > from && x <= to;
  out.whole_span = !(to > from) || in_window == 0;
  out.decode_tok_s = !out.whole_span ? static_cast<double>(in_window) / (to - from)
                     : last > first  ? static_cast<double>(all_decoded) / (last - first)
                                     : 0;
  rank_stats st;
  self->request(cluster.decode[0].handle, std::chrono::seconds{10}, stats_atom::value).receive([&](rank_stats& s) { st = s; }, [](caf::error&) {});
  out.steps = st.num_steps;
  out.drafted = st.drafted_tokens;
  out.accepted = st.accepted_tokens;
  for (auto& a : cluster.actors()) self->send_exit(a, caf::exit_reason::user_shutdown);
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  uint32_t drafts = 4, tokens = 96, threads = 2;
  std::string shape = "kjv";
  deploy::flag_set flags;
  flags.add("--drafts", &drafts, "draft tokens per sequence and step (speculative_tokens) in the speculative runs");
  flags.add("--tokens", &tokens, "tokens per answer");
  flags.add("--threads", &threads, "executor threads per rank");
  flags.add("--shape", &shape, "kjv (the trained built-in model), 100m or 0.5b (Llama shapes, seeded weights, same tokens)");
  if (auto rc = bench::parse_flags(flags, argc, argv, "[--drafts K] [--tokens N] [--threads T] [--shape kjv|100m|0.5b]"))
    return *rc;
  if (drafts == 0 || drafts > 16) return std::fprintf(stderr, "baton_bench_spec: --drafts must be 1 to 16\n"), 2;
  gpu::hf_model kjv;
  std::string why;
  const std::string dir = BATON_MODELS_DIR "/baton-kjv-tiny";
  if (!gpu::load_hf_model(dir, &kjv, &why)) return std::fprintf(stderr, "baton_bench_spec: %s\n", why.c_str()), 1;
  auto tok = gpu::load_model_tokenizer(dir, kjv.config, &why);
  if (!tok) return std::fprintf(stderr, "baton_bench_spec: %s\n", why.c_str()), 1;
  std::string text;
  if (!gpu::read_text_file(dir + "/heldout.txt", &text)) return std::fprintf(stderr, "baton_bench_spec: cannot read %s/heldout.txt\n", dir.c_str()), 1;

  local_cluster_config cfg;
  cfg.num_prefill_ranks = 1;
  cfg.num_decode_ranks = 1;
  cfg.executor.num_threads = threads;
  cfg.executor.num_kv_pages = 8 * 24 + 16;
  if (shape == "kjv") {
    cfg.model = kjv.config;
    cfg.weights = kjv.weights;
    cfg.weights_id = kjv.weights_id;
  } else if (shape == "100m" || shape == "0.5b") {
    cfg.model = shape == "0.5b" ? bench::llama_500m_config() : gpu::llama_100m_config();
  } else {
    return std::fprintf(stderr, "baton_bench_spec: --shape must be kjv, 100m or 0.5b, got '%s'\n", shape.c_str()), 2;
  }
  // Prompts that leave room for the answer in the trained model's 256-token context.
  const uint32_t room = kjv.config.max_position_embeddings > tokens + 8 ? kjv.config.max_position_embeddings - tokens - 8 : 0;
  if (room < 48) return std::fprintf(stderr, "baton_bench_spec: --tokens leaves no room for a prompt\n"), 2;
  const auto all = tok->encode_prompt(text);
  const auto passage = [&](size_t at, size_t len) {
    return std::vector<int32_t>(all.begin() + static_cast<ptrdiff_t>(at), all.begin() + static_cast<ptrdiff_t>(at + len));
  };
  // Batch 1 prompts fill the room; batch 8 prompts are short (48 tokens), so that the eight
  // prefills end long before the first answer does and the eight decode together.
  const int32_t bos = tok->bos_id() >= 0 ? tok->bos_id() : cfg.model.bos_token_id;
  const auto make = [&](size_t length, std::vector<std::vector<int32_t>>* quote, std::vector<std::vector<int32_t>>* fresh) {
    for (size_t i = 0; i < 8; ++i) {
      const size_t at = 1 + i * 211;
      if (at + 2 * length >= all.size()) break;
      auto q = passage(at, length - 12);
      const auto again = passage(at, 12);  // its first words again: the answer may go on quoting
      q.insert(q.end(), again.begin(), again.end());
      q.insert(q.begin(), bos);
      quote->push_back(std::move(q));
      auto f = passage(at + length, length);
      f.insert(f.begin(), bos);
      fresh->push_back(std::move(f));
    }
  };
  std::vector<std::vector<int32_t>> quote, fresh, quote8, fresh8;
  make(room, &quote, &fresh);
  make(48, &quote8, &fresh8);
  cfg.model.max_position_embeddings = std::max<uint32_t>(cfg.model.max_position_embeddings, room + tokens + 16);

  caf::actor_system_config sys_cfg;
  register_message_types(sys_cfg);
  sys_cfg.set("scheduler.max-threads", 2);
  sys_cfg.set("logger.console-verbosity", caf::atom("quiet"));
  caf::actor_system sys{sys_cfg};
  std::printf("model %s, %u executor thread(s), %u tokens per answer, greedy, %u drafts at most\n\n", cfg.model.name.c_str(),
              threads, tokens, drafts);
  std::printf("| workload | batch | decode tok/s, 1 a step | with drafts | speed-up | tokens per step (the ideal) | "
              "drafts kept | same tokens |\n|---|---|---|---|---|---|---|---|\n");
  int rc = 0;
  const auto row = [&](const char* workload, const std::string& batch, const outcome& base, const outcome& spec) {
    const bool same = base.ok && spec.ok && base.answers == spec.answers;
    const double per_step = static_cast<double>(base.steps) / std::max<uint64_t>(1, spec.steps);
    const char* mark = base.whole_span || spec.whole_span ? " (whole span)" : "";
    std::printf("| %s | %s%s | %.1f | %.1f | %.2fx | %.2f | %.0f %% (%llu of %llu) | %s |\n", workload, batch.c_str(), mark,
                base.decode_tok_s, spec.decode_tok_s, spec.decode_tok_s / std::max(1e-9, base.decode_tok_s), per_step,
                100.0 * static_cast<double>(spec.accepted) / std::max<uint64_t>(1, spec.drafted),
                static_cast<unsigned long long>(spec.accepted), static_cast<unsigned long long>(spec.drafted),
                same ? "yes" : "NO");
    std::fflush(stdout);
    return same ? 0 : 1;
  };
  const uint32_t limit = decode_rank_config{}.speculative_max_batch;
  for (const auto* w : {&quote, &fresh}) {
    const char* name = w == &quote ? "quote" : "fresh";
    const auto& short_prompts = w == &quote ? quote8 : fresh8;
    // Batch 1: four prompts, each alone in turn (speeds averaged, counts summed).
    outcome base, spec;
    const size_t alone = std::min<size_t>(w->size(), 4);
    for (size_t i = 0; i < alone; ++i) {
      auto b = run(sys, cfg, 0, {(*w)[i]}, tokens), s = run(sys, cfg, drafts, {(*w)[i]}, tokens);
      base.decode_tok_s += b.decode_tok_s / static_cast<double>(alone);
      spec.decode_tok_s += s.decode_tok_s / static_cast<double>(alone);
      base.steps += b.steps, spec.steps += s.steps;
      spec.drafted += s.drafted, spec.accepted += s.accepted;
      base.ok &= b.ok, spec.ok &= s.ok;
      base.whole_span |= b.whole_span, spec.whole_span |= s.whole_span;
      base.answers.insert(base.answers.end(), b.answers.begin(), b.answers.end());
      spec.answers.insert(spec.answers.end(), s.answers.begin(), s.answers.end());
    }
    rc |= row(name, "1", base, spec);
    if (short_prompts.size() < 8) continue;
    // Batch 8: all at once (answers come back in the order sent), drafts in every step, then as
    // the default limit has it (speculative_max_batch: none in steps of more sequences).
    const std::vector<std::vector<int32_t>> eight(short_prompts.begin(), short_prompts.begin() + 8);
    base = run(sys, cfg, 0, eight, tokens);
    rc |= row(name, "8, drafts in every step", base, run(sys, cfg, drafts, eight, tokens, 0));
    rc |= row(name, "8, default limit (" + std::to_string(limit) + ")", base, run(sys, cfg, drafts, eight, tokens, limit));
  }
  return rc;
}
