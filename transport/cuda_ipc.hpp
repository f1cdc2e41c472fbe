#pragma once

// The CUDA IPC backend (issue 12, part 4): one-sided puts between the device memory of processes
// on the same host, for a prefill rank and a decode rank that are different processes on one GPU
// (or on GPUs of one host). A region's key carries its allocation's cudaIpcMemHandle; the writer
// opens it once (cudaIpcOpenMemHandle, kept for later puts) and copies device to device on its
// own high-priority stream. The owner takes no part: no receive to post, no progress to make,
// which is what the NCCL backend lacks between processes (nccl.hpp).
//
// baton_cuda_ipc_probe showed on 2026-12-04 (docs/perf.md) that legacy CUDA IPC works in the H200 machine's
// microVM. This backend itself has not run on a GPU yet: its cases are in the doctest suite
// "unverified" (tests/gpu/cuda_ipc_transport.test.cpp) and its figures come from the probe's
// transport stage, both run by bench/gpu/h200.sh.
//
// What it reaches: device memory of this host only. A key carries the owner's host (its boot
// id), so a key from another host is refused by name rather than opened, and the owner's process
// (a random number drawn once per process, as pids repeat across PID namespaces): a put into a
// region of the writer's own process (two ranks in one process) copies into it directly, as CUDA
// opens no handle of its own process. A region may lie anywhere inside a cudaMalloc allocation:
// IPC handles name whole allocations, so the key carries the offset into it, found with the
// driver's cuMemGetAddressRange. allocate_memory rounds sizes up to 2 MiB, so that no other
// allocation shares the block a handle exports.
//
// The caller orders the source bytes before the put: post_put copies on the transport's own
// stream, which waits for no other stream, so the bytes must be complete (the producing stream
// synchronised, or the put posted from what runs after it).
//
// Openings of peers' allocations are kept for later puts, at most cuda_ipc_config::
// max_open_peer_allocations of them, and each is closed after peer_idle_ms unused (a decode rank
// that went away is let go). Closing one waits for this transport's puts in flight.
//
// post_put calls into CUDA, so it must not run inside a CUDA host callback (as NCCL's).
//
// No CUDA header here: CPU-only code includes it; where the build has no CUDA,
// make_cuda_ipc_transport says so.

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "transport/transport.hpp"

namespace baton::transport {

struct cuda_ipc_config {
  std::string name = {};  ///< this endpoint's rank name, for errors
  int device = 0;         ///< the CUDA device whose memory this endpoint registers and allocates
  uint32_t max_open_peer_allocations = 32;
  uint32_t peer_idle_ms = 60000;

  std::string validate() const;
};

/// What a cuda_ipc region_key's packed bytes carry.
struct cuda_ipc_key {
  static constexpr uint32_t version = 1;
  uint64_t host = 0;     ///< the owner's host (cuda_ipc_host_id)
  uint32_t pid = 0;      ///< the owner's pid, for errors
  uint64_t process = 0;  ///< the owner's process (cuda_ipc_process_id): a put into its own needs no opening
  uint32_t device = 0;  ///< the owner's device
  uint64_t offset = 0;  ///< where the region starts in the allocation the handle names
  std::array<uint8_t, 64> handle{};  ///< cudaIpcMemHandle_t's bytes
};

/// This host's identity for keys: a hash of the kernel's boot id (the same in every container
/// and network namespace of one boot of one machine).
uint64_t cuda_ipc_host_id();
/// This process's identity for keys: drawn at random once (pids repeat across PID namespaces).
uint64_t cuda_ipc_process_id();

std::vector<uint8_t> pack_cuda_ipc_key(const cuda_ipc_key& k);
/// Reads a key's packed bytes back; nothing and `*why` (naming what is wrong) for a key of
/// another backend, another version, or the wrong length.
std::optional<cuda_ipc_key> unpack_cuda_ipc_key(const region_key& key, std::string* why);

/// True where this build has CUDA (it may still find no GPU at run time).
bool cuda_ipc_built();

/// Makes the endpoint; nothing and `*why` when the config is wrong, the build has no CUDA, or
/// there is no such GPU.
std::unique_ptr<transport> make_cuda_ipc_transport(const cuda_ipc_config& cfg, std::string* why);

}  // namespace baton::transport
