#pragma once

// What the two device-memory transports (NCCL, CUDA IPC) share: a put on the transport's own
// stream, settled when the event recorded after it has passed; the settled listener, called
// from a host callback queued behind each put; and the refusal of memory that is not the
// transport's device's, saying what it is. Internal: only their .cpp files include it, where the
// build has CUDA.

#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <mutex>
#include <string>

#include "transport/transport.hpp"

namespace baton::transport::cuda_detail {

/// Who the settled listener is; a host callback on the stream reads it.
struct listener_box {
  std::mutex mutex;
  std::function<void()> fn;
};

inline void CUDART_CB notify_settled(void* p) {
  auto* box = static_cast<listener_box*>(p);
  std::function<void()> fn;
  {
    std::lock_guard<std::mutex> lock{box->mutex};
    fn = box->fn;
  }
  if (fn) fn();
}

/// Empty when `base` is memory of `device`; else why `backend` cannot register it, naming what
/// it is (the query's error is cleared).
inline std::string not_device_memory(const std::string& backend, int device, const void* base) {
  cudaPointerAttributes attr{};
  const auto rc = cudaPointerGetAttributes(&attr, base);
  if (rc == cudaSuccess && attr.type == cudaMemoryTypeDevice && attr.device == device) return {};
  cudaGetLastError();
  return backend + " registers memory of device " + std::to_string(device) + " only: the region at " +
         std::to_string(reinterpret_cast<uintptr_t>(base)) + " is " +
         (rc != cudaSuccess || attr.type == cudaMemoryTypeUnregistered ? std::string{"host memory"}
          : attr.type == cudaMemoryTypeHost                           ? std::string{"pinned host memory"}
          : attr.type == cudaMemoryTypeManaged                        ? std::string{"managed memory"}
                                                                      : "memory of device " + std::to_string(attr.device));
}

/// A put on a stream; `done` is recorded after it.
struct stream_put {
  uint64_t request_id = 0;
  std::string peer;
  uint32_t layer = 0;
  cudaEvent_t done = nullptr;
  xfer_state state = xfer_state::pending;
  xfer_error err;
};

/// Marks the end of a put just queued on `stream`: its event, then, with a listener, the notice
/// queued behind it. Empty, or what failed (the caller fails the put).
inline std::string end_put(stream_put& x, cudaStream_t stream, listener_box* listener) {
  if (auto e = cudaEventCreateWithFlags(&x.done, cudaEventDisableTiming); e != cudaSuccess) {
    x.done = nullptr;
    cudaGetLastError();
    return std::string{"cannot create an event: "} + cudaGetErrorString(e);
  }
  if (auto e = cudaEventRecord(x.done, stream); e != cudaSuccess) {
    cudaGetLastError();
    return std::string{"cannot record an event: "} + cudaGetErrorString(e);
  }
  // Without the notice the owner still finds the put settled at its next poll.
  if (listener && cudaLaunchHostFunc(stream, notify_settled, listener) != cudaSuccess) cudaGetLastError();
  return {};
}

/// A pending put whose event has passed is done; one whose stream failed is failed, naming
/// CUDA's error; otherwise it stays pending.
inline void settle(stream_put& x) {
  if (x.state != xfer_state::pending) return;
  const auto q = cudaEventQuery(x.done);
  if (q == cudaSuccess) {
    x.state = xfer_state::done;
  } else if (q != cudaErrorNotReady) {
    x.state = xfer_state::failed;
    x.err = {xfer_errc::backend_error, false, x.request_id, x.peer, x.layer,
             std::string{"the put's stream failed: "} + cudaGetErrorString(q)};
  }
}

}  // namespace baton::transport::cuda_detail
