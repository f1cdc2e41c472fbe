#pragma once

// The NCCL backend (issue 6): puts between the GPU memory of ranks that own GPUs, as grouped
// ncclSend/ncclRecv on the transport's own high-priority stream. A put is done when an event
// recorded after its group has passed, and the settled listener is called from a host callback
// queued behind it, so the owning actor polls at once.
//
// What it reaches: device memory only (register_region refuses host memory, naming it), and
// allocate_memory hands out device memory on the transport's GPU. Keys carry the communicator's
// fingerprint and the owner's NCCL rank, so a key from another communicator is refused.
//
// What it does not do yet: a put to another rank of the communicator. NCCL is two-sided, so the
// receiving rank must post the matching ncclRecv, and Baton has no control channel telling it to
// (vLLM's NCCL connector sends each put's descriptor over ZeroMQ first). Such a put fails with a
// fatal error that says so. On the one GPU here NCCL cannot even form a two-rank communicator
// (it refuses two ranks on one device), so that path could not be exercised. What runs is a
// one-rank communicator: grouped send/recv to itself, from one rank's device region into
// another's, which bench/nccl_bench.cpp and tests/gpu/nccl_transport.test.cpp compare with the
// host-staged path (device -> pinned host -> UCX -> host -> device).
//
// post_put calls into CUDA and NCCL, so it must not run inside a CUDA host callback (the CUDA
// executor announces a layer's KV from one: a rank whose pool lives on the device would have to
// post from another thread first).
//
// No CUDA or NCCL header here: CPU-only code includes it, and where the build has no NCCL,
// make_nccl_transport says so. NCCL itself is loaded at run time (dlopen of libnccl.so.2) by the
// first transport made, so binaries built with it start where it is missing.

#include <memory>
#include <string>

#include "transport/transport.hpp"

namespace baton::transport {

struct nccl_config {
  std::string name = {};      ///< this endpoint's rank name, for errors
  int device = 0;             ///< the CUDA device this rank owns
  int world_size = 1;         ///< ranks in the communicator
  int rank = 0;               ///< this rank's place in it
  /// The communicator's id as hex text (nccl_unique_id), the same on every rank; may be empty
  /// only for a one-rank communicator, which then makes its own.
  std::string unique_id = {};

  std::string validate() const;
};

/// True where this build has NCCL (it may still find no GPU at run time).
bool nccl_built();

/// A fresh communicator id as hex text, for rank 0 to hand to the others; empty and `*why` when
/// NCCL cannot make one (no NCCL in this build, or NCCL's own error).
std::string nccl_unique_id(std::string* why);

/// Joins the communicator (blocking until every rank has) and makes the endpoint; nothing and
/// `*why` when the config is wrong, the build has no NCCL, there is no such GPU, or NCCL refuses.
std::unique_ptr<transport> make_nccl_transport(const nccl_config& cfg, std::string* why);

}  // namespace baton::transport
