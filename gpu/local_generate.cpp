#include "gpu/local_generate.hpp"

#include "gpu/grammar.hpp"

#include <future>

namespace baton::gpu {

namespace {

class promise_sink final : public executor_sink {
public:
  void on_layer_kv_ready(uint64_t, uint32_t) override {}
  void on_done(uint64_t, forward_output out) override {
    promise_.set_value(
        forward_outcome{std::move(out.logits), {}, std::move(out.tokens), std::move(out.logprobs), std::move(out.scores),
                        std::move(out.row_tokens), std::move(out.row_logprobs)});
  }
  void on_failed(uint64_t, std::string what) override { promise_.set_value(forward_outcome{{}, std::move(what), {}, {}, {}}); }
  std::future<forward_outcome> future() { return promise_.get_future(); }

private:
  std::promise<forward_outcome> promise_;
};

}  // namespace

forward_outcome run_blocking(executor& exec, forward_job job) {
  auto sink = std::make_shared<promise_sink>();
  auto fut = sink->future();
  exec.submit(std::move(job), sink);
  return fut.get();
}

colocated_generation generate_colocated(executor& exec, const std::vector<int32_t>& prompt,
                                        uint32_t max_new_tokens, uint32_t chunk_tokens,
                                        const sampling_config& sampling, bool ignore_eos,
                                        const after_prefill_fn& after_prefill,
                                        std::shared_ptr<grammar_matcher> grammar) {
  colocated_generation out;
  auto& kv = exec.kv();
  const uint32_t total = static_cast<uint32_t>(prompt.size()) + max_new_tokens;
  auto pages = kv.kv_page_alloc(kv.pages_for_tokens(total));
  if (!pages) {
    out.error = "not enough free KV pages for " + std::to_string(total) + " tokens";
    return out;
  }
  out.pages = *pages;
  if (chunk_tokens == 0) chunk_tokens = static_cast<uint32_t>(prompt.size());
  std::vector<float> last;
  for (uint32_t start = 0; start < prompt.size(); start += chunk_tokens) {
    const uint32_t end = std::min<uint32_t>(static_cast<uint32_t>(prompt.size()), start + chunk_tokens);
    forward_job job{start, {forward_seq{1, {prompt.begin() + start, prompt.begin() + end}, start, *pages, true}}};
    auto r = run_blocking(exec, std::move(job));
    if (!r.error.empty()) {
      out.error = r.error;
      break;
    }
    last = std::move(r.logits[0]);
  }
  if (after_prefill && out.error.empty()) after_prefill(kv, *pages, static_cast<uint32_t>(prompt.size()));
  uint32_t pos = static_cast<uint32_t>(prompt.size());
  std::vector<int32_t> history = prompt;  // for the penalties: every token before the one sampled
  sampling_config how = sampling;
  how.output_from = static_cast<uint32_t>(prompt.size());  // presence and frequency: the output only
  while (out.error.empty() && out.tokens.size() < max_new_tokens) {
    const int32_t tok = sample_token(last, seq_sampling{how, pos, history, false, 0, grammar});
    if (grammar) grammar->accept(tok);
    history.push_back(tok);
    out.tokens.push_back(tok);
    out.step_logits.push_back(last);
    if ((tok == exec.config().eos_token_id && !ignore_eos) || out.tokens.size() == max_new_tokens) break;
    auto r = run_blocking(exec, forward_job{pos, {forward_seq{1, {tok}, pos, *pages, true}}, forward_job::decode});
    if (!r.error.empty()) {
      out.error = r.error;
      break;
    }
    last = std::move(r.logits[0]);
    ++pos;
  }
  kv.kv_page_free(*pages);
  return out;
}

}  // namespace baton::gpu
