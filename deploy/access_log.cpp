#include "deploy/access_log.hpp"

#include <algorithm>
#include <cstdio>
#include <ctime>
#include <map>

#include "actors/atoms_and_errors.hpp"
#include "deploy/utc_stamp.hpp"

namespace baton::deploy {

namespace {

std::string ms(double v) {
  char out[32];
  std::snprintf(out, sizeof out, "%.1f ms", v);
  return out;
}

std::string ms_of_us(int64_t us) { return ms(static_cast<double>(us) / 1000.0); }

/// A request's ranks and times; its failovers and moves when it had any; why it was placed where
/// it was, when asked.
std::string generation(const completion& c, bool placements) {
  std::string out = "request " + std::to_string(c.request_id) + " " + (c.prefill_rank.empty() ? "-" : c.prefill_rank) +
                    " -> " + (c.decode_rank.empty() ? "-" : c.decode_rank) + ", prompt " +
                    std::to_string(c.num_prompt_tokens);
  if (c.cached_tokens) out += " (cached " + std::to_string(c.cached_tokens) + ")";
  // TTFT and the stages it is made of, so that a slow first token is placed from the log alone
  // (a trial could not place 1.2 s of one: the KV lease and the prefill were missing).
  out += ", " + std::to_string(c.tokens.size()) + " tokens (" + c.finish_reason + "), TTFT " + ms_of_us(c.ttft_us) +
         // After a failover TTFT runs from the request's arrival, the stages are its last attempt's.
         (c.failovers ? "; its last attempt: check " : " = check ") + ms_of_us(c.check_us) + " + place " + ms_of_us(c.place_us) + " + KV lease " +
         ms_of_us(c.reserve_us) + " + prefill " + ms_of_us(c.prefill_us) + " (queue " + ms_of_us(c.prefill_queue_us) +
         "), decode queue " + ms_of_us(c.decode_queue_us);
  if (!c.tbt_us.empty()) {
    int64_t sum = 0, most = 0;
    for (auto us : c.tbt_us) sum += us, most = std::max(most, us);
    out += ", TBT mean " + ms(static_cast<double>(sum) / static_cast<double>(c.tbt_us.size()) / 1000.0) + " max " +
           ms_of_us(most);
  }
  if (c.failovers)
    out += ", " + std::to_string(c.failovers) + " failover(s) (" + ms_of_us(c.failed_attempts_us) + " in failed attempts, " +
           ms_of_us(c.retry_wait_us) + " paused), the last: " + c.failover_why;
  if (c.migrations) out += ", moved " + std::to_string(c.migrations) + " time(s)";
  // Quoted: the balancers' reasons hold ';' and brackets, as the line's own separators.
  if (placements)
    out += ", placed: prefill \"" + c.prefill_placement_why + "\" decode \"" + c.decode_placement_why + "\"";
  return out;
}

}  // namespace

std::string access_line(const access_entry& e) {
  // What a client sent is escaped and bounded (quoted_input): one line per call, whatever it sent.
  std::string out = utc_stamp(e.at) + " call " + e.call_id +
                    (e.client_request_id.empty() ? "" : " (x-request-id " + quoted_input(e.client_request_id, 128) + ")") +
                    (e.key.empty() ? "" : " key " + e.key) +
                    " " + quoted_input(e.route, 160) + " " + std::to_string(e.status) + (e.stream ? " stream " : " ") +
                    ms(e.took_ms);
  if (!e.error.empty()) return out + ": " + quoted_input(e.error, 2048);
  if (!e.choices) return out;
  // A batch call's generations (up to 1,024) one by one made one line of 220 KB, which log
  // shippers cut (Docker's at 16 KiB): past max_logged_generations the rest are summed up.
  const auto& all = *e.choices;
  for (size_t i = 0; i < std::min(all.size(), max_logged_generations); ++i) out += (i == 0 ? ": " : "; ") + generation(all[i], e.placements);
  if (all.size() <= max_logged_generations) return out;
  uint64_t prompt = 0, cached = 0, tokens = 0, failovers = 0;
  int64_t worst_ttft = 0;
  std::map<std::string, uint32_t> reasons;
  for (size_t i = max_logged_generations; i < all.size(); ++i) {
    const auto& c = all[i];
    prompt += c.num_prompt_tokens, cached += c.cached_tokens, tokens += c.tokens.size(), failovers += c.failovers;
    worst_ttft = std::max(worst_ttft, c.ttft_us);
    ++reasons[c.finish_reason];
  }
  out += "; and " + std::to_string(all.size() - max_logged_generations) + " more generations: prompts " +
         std::to_string(prompt) + " (cached " + std::to_string(cached) + ", each generation's counted), " +
         std::to_string(tokens) + " tokens (";
  for (auto it = reasons.begin(); it != reasons.end(); ++it)
    out += (it == reasons.begin() ? "" : ", ") + std::to_string(it->second) + " " + it->first;
  out += "), TTFT at most " + ms_of_us(worst_ttft) + (failovers ? ", " + std::to_string(failovers) + " failover(s)" : "");
  return out;
}

}  // namespace baton::deploy
