#pragma once

// A transport that wraps another and injects faults, for tests and sims only (never a default).
// Seeded: the same plan and seed damage the same byte of the same transfer on every run.

#include <memory>
#include <optional>

#include "transport/transport.hpp"

namespace baton::transport {

enum class fault_kind : uint8_t {
  corrupt_byte,  ///< the put lands, then one byte of it in the destination is flipped
  drop,          ///< the put does nothing but reports success (a silently lost write)
  delay,         ///< the put lands, but poll() says pending for the first `delay_polls` polls
  fail,          ///< the put does nothing and reports injected_failure
  /// The put does nothing and fails as one outside its region does (out_of_bounds, fatal: the
  /// two sides' layouts disagree).
  refuse,
  stall,         ///< the put does nothing and stays pending forever
  disconnect,    ///< this put and every later one fail with peer_unreachable
  /// The put stays pending, even after release(), until the test calls land_late(): then it
  /// reads its source and lands, as a zero-copy put long stuck in a network would.
  late,
};

struct fault_plan {
  fault_kind kind = fault_kind::corrupt_byte;
  std::optional<uint32_t> at_layer{};     ///< only puts of this layer (any layer when empty)
  std::optional<uint64_t> for_request{};  ///< only puts of this request (any when empty)
  uint32_t max_faults = 1;                ///< faults injected before the proxy turns transparent
  uint64_t seed = 1;                      ///< picks which segment and byte get corrupted
  uint32_t delay_polls = 1000;            ///< kind delay: polls that still see `pending`
};

/// Wraps `inner`. Regions must be registered through the proxy (it needs the local bytes to
/// corrupt a copy of them). `num_injected()` counts faults so tests can assert they happened.
class fault_proxy : public transport {
public:
  virtual uint32_t num_injected() const = 0;
  /// kind late: lands every put held back so far (reading its source now) and settles it.
  virtual void land_late() = 0;
};

std::unique_ptr<fault_proxy> make_fault_proxy(std::unique_ptr<transport> inner, fault_plan plan);

}  // namespace baton::transport
