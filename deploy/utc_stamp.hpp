#pragma once

// "2026-12-06T19:40:01.123Z": UTC to the millisecond, as the request log's lines, the head's node
// events and its decode-process restarts start, so that they line up. Header-only and free of
// CAF: every log line's writer may include it.

#include <chrono>
#include <cstdio>
#include <ctime>
#include <string>

namespace baton::deploy {

inline std::string utc_stamp(std::chrono::system_clock::time_point at = std::chrono::system_clock::now()) {
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(at.time_since_epoch()).count();
  const std::time_t secs = static_cast<std::time_t>(ms / 1000);
  std::tm tm{};
  gmtime_r(&secs, &tm);
  char out[64];
  std::snprintf(out, sizeof out, "%04d-%02d-%02dT%02d:%02d:%02d.%03dZ", tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday,
                tm.tm_hour, tm.tm_min, tm.tm_sec, static_cast<int>(ms % 1000));
  return out;
}

}  // namespace baton::deploy
