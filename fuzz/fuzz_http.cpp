// HTTP requests: the gateway parses whatever a socket sends, pipelined.
#include <cstddef>
#include <cstdint>
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
    if (r.status != baton::deploy::http::parse_status::complete) break;
    if (r.consumed == 0 || r.consumed > buf.size()) __builtin_trap();  // must make progress, in bounds
    buf.remove_prefix(r.consumed);
  }
  return 0;
}
