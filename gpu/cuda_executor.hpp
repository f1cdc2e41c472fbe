#pragma once

// The CUDA backend of the executor (issue 11, part one): the same Llama math as the CPU
// executor, with weights and KV pages on the device, matrix products through cuBLAS and the
// kernels of gpu/cuda/. No CUDA headers here: CPU-only code may include it, and
// make_cuda_executor says why it cannot build one where the build or the machine has no CUDA.
//
// Three streams per executor:
//   compute - the layers, in order;
//   copy    - host -> device upload of KV pages the device does not hold yet (a cached prefix
//             that arrived in the host pool from the store or from a prefill rank), layer by
//             layer, one layer ahead of compute; layer l's attention waits for its event;
//   send    - device -> host mirror of the KV each layer wrote, then the sink's on_layer_kv_ready,
//             so a transport can ship layer l while layer l + 1 computes.
// Per-layer events order them; nothing synchronises the device until the job's end.
//
// The host pool (kv()) stays authoritative for pages the device has not uploaded since their
// last allocation or note_host_write (kv_cache::generation); the device copy is authoritative
// after that, mirrored to the host per layer when mirror_to_host is on.

#include <memory>
#include <string>
#include <vector>

#include "gpu/executor.hpp"
#include "gpu/weights.hpp"

namespace baton::gpu {

struct cuda_executor_config {
  int device = 0;
  uint32_t num_kv_pages = 512;
  uint32_t page_size_tokens = 16;
  bool bf16 = true;               ///< weights, KV and matrix inputs in bf16; false: fp32 throughout (conformance)
  bool mirror_to_host = true;     ///< copy each layer's new KV to the host pool (sends, store write-back)
  bool host_pool = true;          ///< false: no host page memory (device-resident benchmarks; implies no mirror)
  bool pin_host_pool = true;      ///< page-lock the host pool once, so uploads and mirrors run at PCIe speed
  uint32_t max_batch_tokens = 8192;  ///< activation buffers hold this many rows; larger jobs are refused
  uint64_t random_weights_seed = 0;  ///< non-zero: weights drawn on the device (benchmarks; `weights` unused)
  bool record_timeline = false;   ///< per-layer events on every stream (benchmarks)
  /// Prefill rows (sequences with more than one token in a job) attend on the tensor cores
  /// (cuda::launch_flash_attention) where it supports the model (bf16, head_dim 64 or 128);
  /// single-token rows keep the CUDA-core kernel. On since its conformance cases passed on the
  /// H200: prefill of 8K tokens on the Llama-3-8B shape took 354 ms against 1863 ms (docs/perf.md).
  bool flash_attention = true;
  /// A sequence with fewer new rows than a page (a decode step) mirrors only its new slots: a
  /// kernel writes them into the page-locked, mapped host pool. Off: every written page is
  /// copied whole (16 times a decode row's bytes at 16-token pages). Needs the pool mapped;
  /// where the driver refuses, pages are copied whatever this says. On since its conformance
  /// cases passed on the H200: at batch 32 the send stream took 4.1 ms a step against 9.8 ms.
  bool mirror_rows = true;
  /// Decode jobs run as one CUDA graph launch per step instead of about a dozen kernel launches
  /// per layer: a graph per (rows, head rows, context splits, ...) key, captured at the key's
  /// second job and replayed after. Only jobs without prefill rows, uploads or page mirrors
  /// (mirror_rows on, or no mirror) and without record_timeline. On since its conformance case
  /// passed on the H200 (replays give the launched bits); a batch-1 step took 10.05 ms against
  /// 10.48 ms launched.
  bool cuda_graphs = true;
  /// DeepSeek's routed experts' grouped products on the tensor cores (bf16; see
  /// cuda::grouped_gemm_params::tensor_cores). On since its conformance cases passed on the
  /// H200: a DeepSeek-V3-shaped decode step at batch 32 took 23 ms against 47 ms on CUDA cores.
  bool moe_tensor_cores = true;

  std::string validate() const;
};

/// One piece of work on one stream, relative to the job's start (record_timeline).
struct stream_span {
  std::string stream;  ///< "compute", "copy" (its "copy-h2d" part: the PCIe copies alone) or "send"
  uint32_t layer;
  double start_ms;
  double end_ms;
};

/// What the CUDA executor offers beyond the executor interface (benchmarks and tests reach it
/// through dynamic_cast).
class cuda_executor_extras {
public:
  virtual ~cuda_executor_extras() = default;
  /// The last finished job's spans (empty unless record_timeline).
  virtual std::vector<stream_span> last_timeline() const = 0;
  /// Benchmarks: fill these pages' device KV with pseudo-random values and treat them as held on
  /// the device (no upload), for contexts whose host pool would not fit in memory.
  virtual std::string fill_device_kv_random(const std::vector<uint32_t>& pages, uint64_t seed) = 0;
  /// Turns the per-layer host mirror (the sends) on or off between jobs (benchmarks compare
  /// the two; on needs a host pool).
  virtual void set_mirror_to_host(bool on) = 0;
  /// The same for cuda_executor_config::flash_attention (benchmarks time both kernels).
  virtual void set_flash_attention(bool on) = 0;
  /// The same for cuda_executor_config::mirror_rows (benchmarks compare the two).
  virtual void set_mirror_rows(bool on) = 0;
  /// Whether decode rows are mirrored slot by slot (mirror_rows, and the host pool is mapped).
  virtual bool mirrors_rows() const = 0;
  /// The same for cuda_executor_config::cuda_graphs, and how many jobs ran as a graph launch.
  virtual void set_cuda_graphs(bool on) = 0;
  /// The same for cuda_executor_config::moe_tensor_cores.
  virtual void set_moe_tensor_cores(bool on) = 0;
  virtual uint64_t graph_replays() const = 0;
  /// Turns record_timeline off and on again (on only if the executor started with it); graphs
  /// need it off.
  virtual void set_record_timeline(bool on) = 0;
  /// Bytes of weights on the device (for the HBM floor).
  virtual uint64_t weight_bytes() const = 0;
};

/// Which backend a rank's executor runs on: the command lines' --executor cpu|cuda.
struct backend_config {
  std::string kind = "cpu";  ///< "cpu" (the reference, fp32) or "cuda"
  bool cuda_bf16 = true;     ///< cuda: bf16 weights and KV (false: fp32, for conformance)
  int cuda_device = 0;

  /// Empty when usable here, else a sentence naming the problem (no device, unknown kind).
  std::string validate() const;
  /// The kind alone (cpu or cuda), for a process that runs no rank and so needs no device.
  std::string kind_problem() const;
  /// How the KV values are computed, for the block store's keys: blocks of two backends differ.
  std::string kv_dtype() const { return kind == "cuda" ? (cuda_bf16 ? "cuda-bf16" : "cuda-f32") : "f32"; }
  /// The backend of a process's `rank_index`-th rank, given the `devices` it sees (CUDA's count,
  /// which CUDA_VISIBLE_DEVICES chooses): its ranks spread over them from cuda_device on, one rank
  /// per GPU as a node's `gpus` means; more ranks than devices share them in turn (one H200 holds
  /// a whole local cluster). The CPU backend, or no device seen, is returned as it is.
  backend_config for_rank(uint32_t rank_index, int devices) const;
};

/// CUDA devices this process sees; 0 in a build without CUDA.
int visible_cuda_devices();

/// The executor `backend` names, sized by `pool` (pages, page size; threads for the CPU). A CUDA
/// executor that cannot start (out of device memory, ...) comes back as one that refuses every
/// job with the reason, so the rank reports it instead of the process dying.
std::shared_ptr<executor> make_backend_executor(const backend_config& backend, const model_config& model,
                                                std::shared_ptr<const model_weights> weights,
                                                const cpu_executor_config& pool);

/// An executor that fails every job with `why`: a rank whose backend could not start reports
/// the reason on each request instead of the process dying.
std::shared_ptr<executor> make_refusing_executor(const model_config& model, const cpu_executor_config& pool,
                                                 std::string why);

/// Null with `why` set when this build has no CUDA, the machine no device, or the device
/// refuses (out of memory, ...).
std::unique_ptr<executor> make_cuda_executor(model_config cfg, std::shared_ptr<const model_weights> weights,
                                             cuda_executor_config exec_cfg, std::string* why);

}  // namespace baton::gpu
