#pragma once

// The typed configuration of the actor layer: one struct per component, defaults written once,
// units in the names, validate() returns an empty string or a sentence naming the bad field.

#include <cstdint>
#include <string>

namespace baton {

struct prefill_rank_config {
  std::string name = "prefill-0";
  uint32_t chunk_tokens = 64;           ///< prefill chunk size (a time budget replaces it later)
  uint32_t kv_send_timeout_ms = 2000;   ///< a layer's put pending longer than this fails the request
  uint32_t poll_interval_us = 100;      ///< how often pending puts are polled

  std::string validate() const {
    if (name.empty()) return "prefill rank name must not be empty";
    if (chunk_tokens == 0) return "prefill chunk_tokens must be >= 1";
    if (kv_send_timeout_ms == 0) return "prefill kv_send_timeout_ms must be >= 1";
    return {};
  }
};

struct decode_rank_config {
  std::string name = "decode-0";
  uint32_t max_batch_size = 64;  ///< sequences in one decode step
  bool verify_kv_checksums = true;  ///< check every landed layer against the sender's checksum

  std::string validate() const {
    if (name.empty()) return "decode rank name must not be empty";
    if (max_batch_size == 0) return "decode max_batch_size must be >= 1";
    return {};
  }
};

/// Deadlines of a request's hops. Each failure names the hop (stage) that timed out.
struct request_config {
  uint32_t place_timeout_ms = 5000;     ///< a balancer answers a placement
  uint32_t reserve_timeout_ms = 5000;   ///< decode rank answers a KV reservation
  uint32_t prefill_timeout_ms = 60000;  ///< prefill rank computes and ships every layer
  uint32_t token_timeout_ms = 30000;    ///< decode rank produces the next token
  /// A KV reservation expires this long after its last progress (the grant, or a layer landing)
  /// unless decode has begun: a stalled handoff strands pages for at most this long.
  uint32_t lease_ms = 2000;

  std::string validate() const {
    if (!place_timeout_ms || !reserve_timeout_ms || !prefill_timeout_ms || !token_timeout_ms || !lease_ms)
      return "request timeouts and lease_ms must all be >= 1 ms";
    return {};
  }
};

struct router_config {
  request_config request;
  /// Upper bound on max_tokens per request; 0 = the model's context length.
  uint32_t max_new_tokens_limit = 0;
};

}  // namespace baton
