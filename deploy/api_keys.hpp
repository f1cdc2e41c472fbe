#pragma once

// The gateway's API keys as callers (teams, services) of a shared cluster: each key has a name,
// which the request log and /metrics carry, and what its calls may take -- how many generations
// run at once (its calls past that get 429, its own limit, while other keys' calls go on), how
// many calls and tokens a minute (policies::minute_budget), and whether they run as batch
// whatever they ask. Plain keys (--api-key, BATON_API_KEYS) are keys
// with no limits, named key-1, key-2, ... in the order given. Pure, but for the live numbers,
// which a gateway's connections and its calls' go-betweens share (atomics).

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "policies/minute_budget.hpp"

namespace baton::deploy {

/// One key, as the keys file gives it.
struct api_key {
  std::string name;  ///< [A-Za-z0-9_.-], 1 to 64: the request log's and /metrics' `key`
  std::string key;   ///< the bearer token, 8 characters or more
  /// Generations of this key's calls running at once through this gateway (each choice of n, each
  /// prompt of a batch, is one); a call that would pass it is refused with 429 (rate_limit_exceeded,
  /// naming the key's limit), one that asks more by itself with 400. 0: no limit of its own.
  uint32_t max_in_flight = 0;
  /// Its calls run as batch (generate_request::priority), whatever they ask: interactive calls
  /// of other keys go first at the chunker and the decode KV queue.
  bool batch = false;
  /// Each generation's max_tokens at most: a call asking more is refused (400), one that gives
  /// none gets at most this many (chat: what the context leaves, within it). 0: the cluster's limit.
  uint32_t max_tokens = 0;
  /// Calls of this key that may start per minute at this gateway (a burst of a minute's worth,
  /// then evenly: policies::minute_budget); one past it gets 429 naming the limit, with
  /// Retry-After the seconds until it may. 0: no limit.
  uint32_t requests_per_minute = 0;
  /// Prompt and generated tokens of this key's answers per minute at this gateway, as their usage
  /// counts them, charged as each answer ends: a call starts while the budget is not spent (429 and
  /// Retry-After otherwise). 0: no limit.
  uint64_t tokens_per_minute = 0;
};

/// Reads a keys file's text: {"keys": [{"name": ..., "key": ..., "max_in_flight": N, "max_tokens":
/// M, "priority": "batch" | "interactive"}, ...]}. False and why, naming the entry and field, for anything else
/// (an unknown field, a name or key given twice, a key shorter than 8 characters).
bool parse_api_keys(std::string_view text, std::vector<api_key>* out, std::string* why);

/// A keys file read and parsed (parse_api_keys); false and why, naming the file.
bool read_api_keys_file(const std::string& path, std::vector<api_key>* out, std::string* why);

/// The keys of `named` (a keys file's) and then `plain` (--api-key), named key-1, key-2, ...;
/// false and why when a key or a name comes twice.
bool merge_api_keys(std::vector<api_key> named, const std::vector<std::string>& plain, std::vector<api_key>* out,
                    std::string* why);

/// The keys as a gateway's start line tells them: each name with its limits ("search (at most 256
/// in flight), evals (batch; no limit of its own)"), so that a key left unlimited is seen at once.
std::string describe_api_keys(const std::vector<api_key>& keys);

/// What tells that a file changed: its inode, size and modification time ("" when it cannot be
/// looked at).
std::string file_stamp(const std::string& path);

/// A key's live numbers at one gateway. A keys file read again (gateway_config::keys_file) keeps
/// the state of each name it still has: its counters go on, its key and limits are the file's.
struct api_key_state {
  /// As first configured; `name` never changes, `key` only on the gateway's I/O thread (a
  /// reload), and the limits here are not read again: the atomics below are the current ones.
  api_key cfg;
  /// The limits as they are now (a reload changes them; calls on any thread read them here).
  std::atomic<uint32_t> max_in_flight{0};
  std::atomic<bool> batch{false};
  std::atomic<uint32_t> max_tokens{0};
  std::atomic<uint32_t> in_flight{0};  ///< generations of its calls running now
  std::atomic<uint64_t> prompt_tokens{0}, completion_tokens{0}, cached_tokens{0};  ///< as its answers' usage says
  std::atomic<uint64_t> limited{0};    ///< calls refused for its max_in_flight or its per-minute budgets
  std::atomic<uint64_t> limited_requests{0}, limited_tokens{0};  ///< of those, for each budget
  std::mutex mutex;                    ///< guards responses and the budgets
  std::map<int, uint64_t> responses;   ///< its calls' answers by HTTP status
  policies::minute_budget requests, tokens;  ///< requests_per_minute, tokens_per_minute

  explicit api_key_state(api_key k);
  void count_response(int status);
  std::map<int, uint64_t> responses_now();
  /// Whether a call may start now under the per-minute budgets (a request spent if so); if not,
  /// the sentence that says which, the budget ("requests" or "tokens", OpenAI's error type for
  /// it) and *retry_after_ms, how long until it may (a day at most).
  bool admit_call(std::string* why, std::string* budget, uint32_t* retry_after_ms);
  /// An answer's prompt and generated tokens, against tokens_per_minute.
  void charge_tokens(uint64_t n);
  /// A call the cluster refused before any work (overloaded, shutting down): its request back.
  void refund_request();
  /// The budgets' sizes now (per minute; 0: none), for /metrics.
  std::pair<double, double> budgets_now();
  /// The budgets after a keys file read again (each kept as spent, capped; see minute_budget).
  void set_budgets(uint32_t requests_per_minute, uint64_t tokens_per_minute);
};
using api_key_ptr = std::shared_ptr<api_key_state>;

/// The states for `keys` (a keys file's, read again): each name's state in `now` kept, with the
/// key and limits of `keys`; a new name a new state. Names `now` has and `keys` not are dropped
/// (their calls in progress keep their state to their end).
std::vector<api_key_ptr> renew_api_keys(const std::vector<api_key_ptr>& now, std::vector<api_key> keys);

/// The key `bearer` is, compared with every key in constant time (no early exit: the time does
/// not tell how much of a key was right); null when none.
api_key_ptr find_api_key(const std::vector<api_key_ptr>& keys, std::string_view bearer);

/// `n` generations of `key` held in flight until destroyed (a call's go-between keeps one while
/// any of its choices runs).
class in_flight_hold {
public:
  in_flight_hold() = default;
  in_flight_hold(const in_flight_hold&) = delete;
  in_flight_hold& operator=(const in_flight_hold&) = delete;
  ~in_flight_hold();
  /// Takes `n` more for `key`: false (taking none) when that would pass its max_in_flight, with
  /// how many it had in flight in *had. Once per hold, before it is shared.
  bool take(const api_key_ptr& key, uint32_t n, uint32_t* had);
  /// Gives them back now (once; later calls, and the destructor, do nothing): as the call's
  /// answer or failure goes out, so that a client at its limit may send its next call at once.
  /// Safe from any thread.
  void release();

private:
  api_key_ptr key_;
  std::atomic<uint32_t> n_{0};
};

}  // namespace baton::deploy
