// Request traces in any of the three formats (the first byte picks it), strict and skipping.
#include <cstddef>
#include <cstdint>
#include <sstream>
#include <string>

#include "sims/trace.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const auto format = static_cast<baton::sims::trace_format>(data[0] % 3);
  const std::string text(reinterpret_cast<const char*>(data) + 1, size - 1);
  for (bool skip : {false, true}) {
    baton::sims::trace_options opt;
    opt.skip_malformed = skip;
    opt.rate_scale = 1 + (data[0] >> 4);
    std::istringstream in{text};
    baton::sims::trace t;
    std::string why;
    if (!baton::sims::read_trace(in, format, "fuzz", opt, &t, &why) && why.empty()) __builtin_trap();
    for (size_t i = 1; i < t.requests.size(); ++i)
      if (t.requests[i].arrival_us < t.requests[i - 1].arrival_us) __builtin_trap();  // arrival order
  }
  return 0;
}
