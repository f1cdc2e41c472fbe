#pragma once

// Waiting for a transfer in tests: poll until it leaves pending, bounded so a lost transfer
// fails its test instead of hanging it.

#include <chrono>
#include <thread>

#include "transport/transport.hpp"

namespace baton::test {

/// Polls transfer `id` until it is done or failed; pending after 10 s.
inline transport::xfer_state settle(transport::transport& t, uint64_t id, transport::xfer_error* err) {
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds{10};
  transport::xfer_state s;
  while ((s = t.poll(id, err)) == transport::xfer_state::pending && std::chrono::steady_clock::now() < give_up)
    std::this_thread::yield();
  return s;
}

}  // namespace baton::test
