// The gateway's request log line (deploy/access_log.hpp): what an on-call engineer matches a
// client's answer id against.

#include <doctest/doctest.h>

#include "deploy/access_log.hpp"

using namespace baton;
using namespace baton::deploy;

TEST_CASE("a request log line names the call, its status and time, and each generation's router request, ranks, "
          "tokens and stage times; a failure its sentence") {
  completion a;
  a.request_id = 36;
  a.prefill_rank = "prefill-0";
  a.decode_rank = "decode-1";
  a.num_prompt_tokens = 137;
  a.cached_tokens = 128;
  a.tokens = {1, 2, 3, 4, 5, 6, 7, 8};
  a.finish_reason = "stop";
  a.ttft_us = 4400;
  a.check_us = 100;
  a.place_us = 300;
  a.reserve_us = 200;
  a.prefill_us = 3600;
  a.prefill_queue_us = 100;
  a.decode_queue_us = 20;
  a.tbt_us = {1000, 1200, 2000, 1000, 1000, 1000, 1200};
  a.prefill_placement_why = "least_loaded: 0 queued";
  a.decode_placement_why = "seed 2D: fits";
  completion b = a;
  b.request_id = 37;
  b.cached_tokens = 0;
  b.tbt_us.clear();
  b.failovers = 1;
  b.failover_why = "request 37, rank decode-0, stage decode: went down";
  b.failed_attempts_us = 4'500'000;
  b.retry_wait_us = 100'000;
  const std::vector<completion> both{a, b};
  // 2026-12-06T19:40:01.123Z
  const auto at = std::chrono::system_clock::time_point{std::chrono::milliseconds{1796586001123}};
  // TTFT with the stages it is made of, and the token intervals' mean and worst (a trial could
  // not place 1.2 s of a slow first token from the line); after a failover, the last attempt's.
  CHECK(access_line({at, "cmpl-1796583301-28", "/v1/completions", 200, true, 12.14, &both, {}, {}}) ==
        "2026-12-06T19:40:01.123Z call cmpl-1796583301-28 /v1/completions 200 stream 12.1 ms: request 36 prefill-0 -> "
        "decode-1, prompt 137 (cached 128), 8 tokens (stop), TTFT 4.4 ms = check 0.1 ms + place 0.3 ms + KV lease "
        "0.2 ms + prefill 3.6 ms (queue 0.1 ms), decode queue 0.0 ms, TBT mean 1.2 ms max 2.0 ms; request 37 "
        "prefill-0 -> decode-1, prompt 137, 8 tokens (stop), TTFT 4.4 ms; its last attempt: check 0.1 ms + place 0.3 ms + KV lease "
        "0.2 ms + prefill 3.6 ms (queue 0.1 ms), decode queue 0.0 ms, 1 failover(s) (4500.0 ms in failed attempts, "
        "100.0 ms paused), the last: request 37, rank decode-0, stage decode: went down");
  // --explain: why each generation went where it did.
  const std::vector<completion> one{a};
  const auto explained = access_line({at, "cmpl-1-5", "/v1/completions", 200, false, 5.0, &one, {}, {}, true});
  CHECK_MESSAGE(explained.find("TBT mean 1.2 ms max 2.0 ms, placed: prefill \"least_loaded: 0 queued\" decode \"seed 2D: "
                               "fits\"") != std::string::npos,
                explained);
  CHECK(access_line({at, "chatcmpl-1-2", "/v1/chat/completions", 503, false, 4500.0, nullptr,
                     "request 12, stage place_decode: no decode rank had room", {}}) ==
        "2026-12-06T19:40:01.123Z call chatcmpl-1-2 /v1/chat/completions 503 4500.0 ms: request 12, stage place_decode: "
        "no decode rank had room");
}

TEST_CASE("a request log line holds what a client sent escaped and bounded: no forged line, no terminal escape, no "
          "megabyte") {
  const auto at = std::chrono::system_clock::time_point{std::chrono::milliseconds{1796586001123}};
  const std::string forged = "request 9, stage admission: traffic_class must be chat, agent or batch, got 'x\n"
                             "2026-12-06T22:00:00.000Z call cmpl-FORGED /v1/completions 200 1.0 ms\x1b[31mRED'";
  const auto line = access_line({at, "cmpl-1-1", "/v1/completions", 400, false, 0.2, nullptr, forged, "id\x01"});
  CHECK(line.find('\n') == std::string::npos);
  CHECK(line.find('\x1b') == std::string::npos);
  CHECK(line.find("got 'x\\x0a2026-12-06T22:00:00.000Z call cmpl-FORGED") != std::string::npos);
  CHECK(line.find("1.0 ms\\x1b[31mRED'") != std::string::npos);
  CHECK(line.find("(x-request-id id\\x01)") != std::string::npos);
  // A backslash the client sent is escaped too: its "\x0a" does not read as an escaped newline.
  CHECK(access_line({at, "cmpl-1-3", "/v1/completions", 400, false, 0.2, nullptr, "got 'a\\x0a'", {}})
            .find("got 'a\\x5cx0a'") != std::string::npos);
  const auto huge = access_line({at, "cmpl-1-2", "/v1/completions", 400, false, 0.2, nullptr, std::string(1'000'000, 'A'), {}});
  CHECK(huge.size() < 2300);
  CHECK(huge.substr(huge.size() - 3) == "...");
}
