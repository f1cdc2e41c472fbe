// Trace readers against the public traces committed under traces/ (their README gives the
// figures checked here), malformed lines,
// windows and rate scaling, and synthetic arrivals.

#include <doctest/doctest.h>

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>

#include "sims/trace.hpp"

using namespace baton::sims;

namespace {
const std::string traces = BATON_SOURCE_DIR "/traces/";
}  // namespace

TEST_CASE("the Mooncake conversation trace: 12,031 requests over 59 minutes, one hash id per 512-token block") {
  trace t;
  std::string why;
  REQUIRE_MESSAGE(load_trace(BATON_SOURCE_DIR "/traces/mooncake_conversation_trace.jsonl", {}, &t, &why), why);
  REQUIRE(t.requests.size() == 12031);
  CHECK(t.skipped == 0);
  CHECK(std::lround(t.span_s()) == 3537);
  double input = 0;
  for (const auto& r : t.requests) {
    input += r.input_tokens;
    CHECK(r.hash_ids.size() == (r.input_tokens + 511) / 512);
  }
  CHECK(std::lround(input / 12031) == 12035);
  CHECK(t.requests.front().hash_ids.front() == 0);  // the shared leading block (README)
}

TEST_CASE("the Azure 2023 traces and the measured vLLM runs read as their README says") {
  trace code, conv, vllm;
  std::string why;
  REQUIRE_MESSAGE(load_trace(traces + "azure2023_code.csv", {}, &code, &why), why);
  REQUIRE_MESSAGE(load_trace(traces + "azure2023_conv.csv", {}, &conv, &why), why);
  CHECK(code.requests.size() == 8819);
  CHECK(conv.requests.size() == 19366);
  CHECK(std::lround(code.span_s()) == 3436);
  CHECK(std::lround(conv.span_s()) == 3502);
  REQUIRE_MESSAGE(load_trace(traces + "vllm_measured/rtx4090_llama-3.1-8b_requests.jsonl", {}, &vllm, &why), why);
  REQUIRE(vllm.requests.size() == 300);
  double ttft = 0;
  for (const auto& r : vllm.requests) ttft += r.measured_ttft_s;
  CHECK(std::lround(ttft / 300 * 1000) == 65457);  // README: TTFT mean 65,457 ms
  CHECK(vllm.requests.front().id == "bench-0");
}

TEST_CASE("a malformed trace line is an error naming file and line, or skipped and counted") {
  const std::string text =
      "{\"timestamp\": 0, \"input_length\": 600, \"output_length\": 5, \"hash_ids\": [0, 1]}\n"
      "{\"timestamp\": 1000, \"input_length\": -4, \"output_length\": 5, \"hash_ids\": []}\n"
      "not json at all\n"
      "{\"timestamp\": 3000, \"input_length\": 10, \"output_length\": 2, \"hash_ids\": [0]}\n";
  trace t;
  std::string why;
  std::istringstream a{text};
  CHECK_FALSE(read_trace(a, trace_format::mooncake_jsonl, "t.jsonl", {}, &t, &why));
  CHECK(why == "t.jsonl:2: input_length must be a non-negative integer");
  trace_options skip;
  skip.skip_malformed = true;
  std::istringstream b{text};
  REQUIRE(read_trace(b, trace_format::mooncake_jsonl, "t.jsonl", skip, &t, &why));
  CHECK(t.requests.size() == 2);
  CHECK(t.skipped == 2);
  CHECK(t.first_skipped == "t.jsonl:2: input_length must be a non-negative integer");
  std::istringstream c{"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.9799600,4808,10\n2023-13-16 18:17:04,1,1\n"};
  CHECK_FALSE(read_trace(c, trace_format::azure_csv, "a.csv", {}, &t, &why));
  CHECK(why.rfind("a.csv:3: bad timestamp", 0) == 0);
  // One hash id per 512 prompt tokens, no fewer (a shared prefix would pass for unique), no more.
  std::istringstream ids{"{\"timestamp\": 0, \"input_length\": 6000, \"output_length\": 1, \"hash_ids\": []}\n"};
  CHECK_FALSE(read_trace(ids, trace_format::mooncake_jsonl, "m.jsonl", {}, &t, &why));
  CHECK(why == "m.jsonl:1: hash_ids has 0 ids, input_length 6000 needs 12 (one per 512 tokens)");
  // A date that does not exist is not rolled into the next month.
  std::istringstream feb{"2023-02-29 10:00:00,5,5\n"};
  CHECK_FALSE(read_trace(feb, trace_format::azure_csv, "a.csv", {}, &t, &why));
  CHECK(why.rfind("a.csv:1: bad timestamp", 0) == 0);
  std::istringstream leap{"2024-02-29 10:00:00,5,5\n"};
  CHECK(read_trace(leap, trace_format::azure_csv, "a.csv", {}, &t, &why));
  // A spreadsheet's CSV: a byte-order mark, a lowercase header, spaces around the counts.
  std::istringstream sheet{"\xEF\xBB\xBFtimestamp,contexttokens,generatedtokens\r\n2024-02-29 10:00:00, 5 ,7\r\n"};
  REQUIRE_MESSAGE(read_trace(sheet, trace_format::azure_csv, "s.csv", {}, &t, &why), why);
  CHECK(t.requests.size() == 1);
  CHECK(t.requests[0].input_tokens == 5);
  // A count that is not one names its column and value.
  std::istringstream big{"2024-02-29 10:00:00,5,99999999999\n"};
  CHECK_FALSE(read_trace(big, trace_format::azure_csv, "b.csv", {}, &t, &why));
  CHECK(why == "b.csv:1: GeneratedTokens '99999999999' is more than 4294967295");
  std::istringstream word{"2024-02-29 10:00:00,five,5\n"};
  CHECK_FALSE(read_trace(word, trace_format::azure_csv, "w.csv", {}, &t, &why));
  CHECK(why == "w.csv:1: ContextTokens 'five' is not a non-negative integer");
  // Nothing to replay is an error, not an empty success (a sim of it reported goodput 0).
  std::istringstream empty{""};
  CHECK_FALSE(read_trace(empty, trace_format::mooncake_jsonl, "e.jsonl", {}, &t, &why));
  CHECK(why == "e.jsonl: no requests");
  trace_options late;
  late.window_start_s = 1e6;
  std::istringstream one{"{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 2, \"hash_ids\": [0]}\n"};
  CHECK_FALSE(read_trace(one, trace_format::mooncake_jsonl, "w.jsonl", late, &t, &why));
  CHECK(why.rfind("w.jsonl: no request falls in the window", 0) == 0);
  CHECK_FALSE(load_trace("/nonexistent/x.jsonl", {}, &t, &why));
  CHECK(why == "/nonexistent/x.jsonl: cannot read it");
  CHECK_FALSE(load_trace("trace.parquet", {}, &t, &why));
  // A Mooncake file named as a vLLM run's is read by its rows' fields, not its name.
  const auto named = std::filesystem::temp_directory_path() / ("baton-trace-" + std::to_string(::getpid()) + "_requests.jsonl");
  {
    std::ofstream f{named};
    f << "\n{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 2, \"hash_ids\": [0]}\n";
  }
  CHECK_MESSAGE(load_trace(named.string(), {}, &t, &why), why);
  CHECK(t.requests.size() == 1);
  std::filesystem::remove(named);
}

TEST_CASE("trace rows: an empty prompt is malformed (file and line), 0 output tokens a prefill-only request replayed "
          "as 1, and a line of blanks is skipped") {
  trace t;
  std::string why;
  // Empty prompts passed here and failed the run ("prompt is empty"), after any runs before it.
  const std::string mooncake =
      "{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 2, \"hash_ids\": [0]}\n"
      "{\"timestamp\": 5, \"input_length\": 0, \"output_length\": 3, \"hash_ids\": []}\n";
  std::istringstream m{mooncake};
  CHECK_FALSE(read_trace(m, trace_format::mooncake_jsonl, "m.jsonl", {}, &t, &why));
  CHECK(why == "m.jsonl:2: input_length is 0: a request needs a prompt of at least one token");
  std::istringstream a{"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.9799600,4808,10\n2023-11-16 18:17:04,0,0\n"};
  CHECK_FALSE(read_trace(a, trace_format::azure_csv, "a.csv", {}, &t, &why));
  CHECK(why == "a.csv:3: ContextTokens is 0: a request needs a prompt of at least one token");
  std::istringstream v{"{\"request_id\": \"a\", \"input_toks\": 0, \"output_toks\": 1, \"arrival_time\": 1, "
                       "\"queued_ts\": 1, \"first_token_ts\": 2, \"last_token_ts\": 3}\n"};
  CHECK_FALSE(read_trace(v, trace_format::vllm_jsonl, "v_requests.jsonl", {}, &t, &why));
  CHECK(why == "v_requests.jsonl:1: input_toks is 0: a request needs a prompt of at least one token");
  // Like any malformed row, skipped and counted when asked.
  trace_options skip;
  skip.skip_malformed = true;
  std::istringstream m2{mooncake};
  REQUIRE_MESSAGE(read_trace(m2, trace_format::mooncake_jsonl, "m.jsonl", skip, &t, &why), why);
  CHECK(t.requests.size() == 1);
  CHECK(t.skipped == 1);
  // No output: replayed as one token (the first, which the prefill samples), and counted; a line
  // of spaces, tabs and a CR separates nothing, as an empty one (it was refused as "not a JSON
  // object").
  std::istringstream zero{"{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 0, \"hash_ids\": [0]}\n"
                          "   \t \r\n"
                          "{\"timestamp\": 1000, \"input_length\": 10, \"output_length\": 4, \"hash_ids\": [0]}\n"};
  REQUIRE_MESSAGE(read_trace(zero, trace_format::mooncake_jsonl, "z.jsonl", {}, &t, &why), why);
  REQUIRE(t.requests.size() == 2);
  CHECK(t.lines == 2);
  CHECK(t.requests[0].output_tokens == 1);
  CHECK(t.requests[1].output_tokens == 4);
  CHECK(t.zero_output_rows == 1);
}

TEST_CASE("regression (fuzz): an absurd arrival time is refused, not overflowed out of arrival order") {
  const std::string text =
      "{\"request_id\": \"a\", \"input_toks\": 1, \"output_toks\": 1, \"arrival_time\": 17872679828070.4, "
      "\"queued_ts\": 1, \"first_token_ts\": 2, \"last_token_ts\": 3}\n"
      "{\"request_id\": \"b\", \"input_toks\": 1, \"output_toks\": 1, \"arrival_time\": -3.5e12, "
      "\"queued_ts\": 1, \"first_token_ts\": 2, \"last_token_ts\": 3}\n";
  trace t;
  std::string why;
  std::istringstream in{text};
  CHECK_FALSE(read_trace(in, trace_format::vllm_jsonl, "v.jsonl", {}, &t, &why));
  CHECK(why.find("v.jsonl: request a arrives") == 0);
  CHECK(t.requests.empty());
}

TEST_CASE("a time window and a rate scale cut and compress the trace") {
  std::string text;
  for (int i = 0; i < 10; ++i)
    text += "{\"timestamp\": " + std::to_string(i * 1000) + ", \"input_length\": 1, \"output_length\": 1, \"hash_ids\": [0]}\n";
  trace t;
  std::string why;
  trace_options o;
  o.window_start_s = 2;
  o.window_s = 5;
  o.rate_scale = 2;
  std::istringstream in{text};
  REQUIRE(read_trace(in, trace_format::mooncake_jsonl, "w", o, &t, &why));
  REQUIRE(t.requests.size() == 5);  // seconds 2..6 of the original
  CHECK(t.requests.front().arrival_us == 0);
  CHECK(t.requests.back().arrival_us == 2000000);  // 4 s later in the original, at twice the rate
  o.rate_scale = 0;
  std::istringstream again{text};
  CHECK_FALSE(read_trace(again, trace_format::mooncake_jsonl, "w", o, &t, &why));
}

TEST_CASE("synthetic arrivals: the asked rate, bursty with a larger cv, the same for a seed, different for another") {
  synthetic_spec s;
  s.rate_per_s = 20;
  s.duration_s = 500;
  s.input = {length_dist::lognormal, 1000, 1.0, 1, 32768};
  s.output = {length_dist::uniform, 0, 0, 10, 20};
  REQUIRE(s.validate().empty());
  auto huge = s;  // held in memory: 1e12 per second ended in std::bad_alloc
  huge.rate_per_s = 1e12;
  CHECK(huge.validate() ==
        "rate (--rate, scaled) x duration (--duration-s) makes about 500000000000000 requests; a synthetic trace holds at "
        "most 50000000");
  const auto a = synthetic_trace(s), b = synthetic_trace(s);
  REQUIRE(a.requests.size() == b.requests.size());
  for (size_t i = 0; i < a.requests.size(); ++i) CHECK(a.requests[i].arrival_us == b.requests[i].arrival_us);
  CHECK(std::abs(static_cast<double>(a.requests.size()) / 500 - 20) < 1.0);  // 10,000 arrivals: within 5 %
  double input = 0;
  for (const auto& r : a.requests) {
    input += r.input_tokens;
    CHECK(r.output_tokens >= 10);
    CHECK(r.output_tokens <= 20);
  }
  CHECK(std::abs(input / static_cast<double>(a.requests.size()) - 1000) < 60);
  s.seed = 2;
  CHECK(synthetic_trace(s).requests[5].arrival_us != a.requests[5].arrival_us);
  // Burstiness: the variance of arrivals per second grows with the inter-arrival cv.
  auto per_second_cv = [](const trace& t) {
    std::vector<double> n(501, 0);
    for (const auto& r : t.requests) n[static_cast<size_t>(r.arrival_us / 1000000)] += 1;
    double m = 0, v = 0;
    for (double x : n) m += x;
    m /= static_cast<double>(n.size());
    for (double x : n) v += (x - m) * (x - m);
    return std::sqrt(v / static_cast<double>(n.size())) / m;
  };
  s.seed = 1;
  s.arrival_cv = 4;
  CHECK(per_second_cv(synthetic_trace(s)) > 2 * per_second_cv(a));
}

TEST_CASE("synthetic day: the rate swings with the period and the mix drifts to the alternative lengths and back") {
  synthetic_spec s;
  s.rate_per_s = 20;
  s.duration_s = 4000;
  s.period_s = 4000;
  s.rate_swing = 0.5;
  s.input = {length_dist::fixed, 4096, 1, 4096, 4096};
  s.output = {length_dist::fixed, 64, 1, 64, 64};
  s.alt_input = {length_dist::fixed, 512, 1, 512, 512};
  s.alt_output = {length_dist::fixed, 1024, 1, 1024, 1024};
  REQUIRE(s.validate().empty());
  const auto t = synthetic_trace(s);
  // Quarters of the day: the rate peaks in the first two (sin > 0) and dips in the last two;
  // the alternative workload is rare near the start and dominant near the middle.
  size_t n[4] = {}, alt[4] = {}, mixed = 0;
  const int64_t first = 0;  // (arrivals count from the first one, a fraction of a second in)
  for (const auto& r : t.requests) {
    const size_t q = std::min<size_t>(3, static_cast<size_t>((r.arrival_us - first) / 1'000'000 / 1000));
    ++n[q];
    alt[q] += r.input_tokens == 512 ? 1 : 0;
    mixed += (r.input_tokens == 512) != (r.output_tokens == 1024);  // a request is one workload or the other
  }
  CHECK(mixed == 0);
  // Expected counts per quarter: 20/s x 1000 s x (1 +- 0.5 x 2/pi) = 20,000 +- 6,366.
  CHECK(n[0] > 24000);
  CHECK(n[1] > 24000);
  CHECK(n[2] < 16000);
  CHECK(n[3] < 16000);
  // Alternative share: 1/2 - 1/pi in the first and last quarters (0.18), 1/2 + 1/pi in the middle ones (0.82).
  CHECK(static_cast<double>(alt[0]) / n[0] < 0.25);
  CHECK(static_cast<double>(alt[1]) / n[1] > 0.75);
  CHECK(static_cast<double>(alt[2]) / n[2] > 0.75);
  CHECK(static_cast<double>(alt[3]) / n[3] < 0.25);
  s.rate_swing = 1.0;
  CHECK(s.validate() == "a diurnal day needs period_s >= 0 and 0 <= rate_swing < 1");
}

TEST_CASE("synthetic spec: an infinite cv, or one whose square overflows, is refused naming the field (it made every "
          "gap or length NaN)") {
  synthetic_spec s;
  REQUIRE(s.validate().empty());
  const double inf = std::numeric_limits<double>::infinity();
  const std::string arrival =
      "arrival_cv (--arrival-cv) must be finite, between about 1e-154 and 1e154 (the gaps' gamma shape is 1 / cv^2)";
  for (double cv : {inf, 1e200, 1e-200}) {  // the square: infinite, infinite, 0
    CAPTURE(cv);
    auto bad = s;
    bad.arrival_cv = cv;
    CHECK(bad.validate() == arrival);
  }
  auto bad = s;
  bad.input.cv = inf;
  CHECK(bad.validate() == "input cv must be finite, at most about 1e154 (the lognormal's sigma^2 is log(1 + cv^2))");
  bad = s;
  bad.output.cv = 1e200;
  CHECK(bad.validate() == "output cv must be finite, at most about 1e154 (the lognormal's sigma^2 is log(1 + cv^2))");
  bad = s;
  bad.period_s = 100;
  REQUIRE(bad.validate().empty());
  bad.alt_input.cv = inf;
  CHECK(bad.validate() == "alt_input cv must be finite, at most about 1e154 (the lognormal's sigma^2 is log(1 + cv^2))");
}
