#pragma once

// The gateway's request log (--log-requests): one line per call as it ends, so that a client's
// complaint -- its answer's id, which the x-request-id header carries too -- leads to the
// router's request numbers, the ranks that served each generation, and where its time went.
// Pure: the gateway writes the lines.

#include <chrono>
#include <string>
#include <vector>

#include "actors/client_messages.hpp"

namespace baton::deploy {

struct access_entry {
  std::chrono::system_clock::time_point at;  ///< when the call ended
  std::string call_id;                        ///< cmpl-..., chatcmpl-...
  std::string route;                          ///< /v1/completions, /v1/chat/completions
  int status = 200;                           ///< the HTTP status (a stream's is 200 even when it ends in an error event)
  bool stream = false;
  double took_ms = 0;                         ///< the call's whole time at the gateway
  const std::vector<completion>* choices = nullptr;  ///< its generations, when it finished
  std::string error;                          ///< why it failed (names the request, rank and stage)
  std::string client_request_id;              ///< the x-request-id the request came with, if any
  bool placements = false;                    ///< each generation's placement reasons too, quoted (--explain)
  std::string key = {};                       ///< the API key's name, when the gateway has keys
};

/// "2026-12-06T19:40:01.123Z call cmpl-...-28 /v1/completions 200 stream 12.1 ms: request 36
/// prefill-0 -> decode-1, prompt 137 (cached 128), 8 tokens (stop), TTFT 4.4 ms = check 0.1 ms +
/// place 0.3 ms + KV lease 0.2 ms + prefill 3.6 ms (queue 0.1 ms), decode queue 0.0 ms, TBT mean
/// 1.2 ms max 2.0 ms" -- one generation after another (TTFT's parts add up to it but for the
/// router's own hops; after a failover they are the last attempt's); a failure's sentence after
/// its status. A request refused before a call began has "-" for its call id
/// and "METHOD /path" for its route; one that came with its own x-request-id has
/// "(x-request-id ...)" after the call's id, and one that came with an API key "key NAME".
std::string access_line(const access_entry& e);

/// Generations a line tells one by one; the rest of a batch call's are summed up in one clause.
inline constexpr size_t max_logged_generations = 16;

}  // namespace baton::deploy
