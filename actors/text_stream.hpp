#pragma once

// What of a growing text may be shown now: pure, shared by the request actor (streamed chunks,
// stop strings) and the gateway (a thinking model's </think>), and fuzzed with the OpenAI layer.

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

namespace baton {

/// How much of `text` may be streamed now: all of it but an unfinished UTF-8 character at
/// its end and the longest tail that is the start of one of the stop strings (which a later
/// token could complete, and which would then be cut off).
size_t streamable_prefix(std::string_view text, const std::vector<std::string>& stop);

}  // namespace baton
