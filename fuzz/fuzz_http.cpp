// HTTP requests: the gateway parses whatever a socket sends, pipelined.
#include <cstddef>
#include <cstdint>
#include <algorithm>
#include <string_view>

#include "deploy/http.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view buf(reinterpret_cast<const char*>(data), size);
  baton::deploy::http::limits lim;
  lim.max_body_bytes = 4096;
  lim.max_header_bytes = 2048;
  baton::deploy::http::request req;
  for (int i = 0; i < 16 && !buf.empty(); ++i) {  // as the gateway does: request after request
    const auto r = baton::deploy::http::parse_request(buf, lim, &req);
    // As the gateway does when a request arrives in pieces: parsed again as it grows, resuming
    // a chunked body where the last parse stopped. It must end as the one-shot parse does.
    baton::deploy::http::chunked_progress progress;
    baton::deploy::http::request piecewise;
    baton::deploy::http::parse_result p;
    const size_t step = 1 + buf.size() / 7;
    for (size_t end = std::min(step, buf.size());; end = std::min(end + step, buf.size())) {
      p = baton::deploy::http::parse_request(buf.substr(0, end), lim, &piecewise, &progress);
      if (p.status != baton::deploy::http::parse_status::incomplete || end == buf.size()) break;
    }
    // (Both may fail for different faults: a prefix shows an overlong head before the bare LF
    // the whole head holds further on. Only the outcome and a complete request must agree.)
    if (p.status != r.status || p.consumed != r.consumed) __builtin_trap();
    if (r.status == baton::deploy::http::parse_status::complete && piecewise.body != req.body) __builtin_trap();
    if (r.status != baton::deploy::http::parse_status::complete) break;
    if (r.consumed == 0 || r.consumed > buf.size()) __builtin_trap();  // must make progress, in bounds
    buf.remove_prefix(r.consumed);
  }
  return 0;
}
