#pragma once

// The C-like GPU boundary (design.md §7.5): flat parameter structs, one comment per field with
// its unit, `launch_<kernel>(params, stream)`. No CUDA headers here, so CPU-only code can
// include it; the stream is a cudaStream_t passed as void*.
// Every kernel has a CPU reference in gpu/cpu_kernels.hpp and a conformance test in
// tests/gpu/cuda_conformance.test.cpp (CTest label "gpu", skipped without a device).
//
// Storage types: weights, the matrix-product inputs and the KV pages are `dtype` (fp32 or bf16);
// the residual stream, matrix-product outputs, norms' and biases' weights and every reduction
// are fp32. Each launcher returns 0 on success, else the cudaError_t of the launch.

#include <cstdint>

namespace baton::gpu::cuda {

enum class dtype : uint32_t { f32 = 0, bf16 = 1 };
inline uint32_t dtype_bytes(dtype t) { return t == dtype::f32 ? 4u : 2u; }

/// Number of usable CUDA devices; 0 when the build has no CUDA or the machine has no driver.
int device_count();

struct rmsnorm_params {
  const float* x;       ///< device, [rows][dim] fp32 input
  const float* weight;  ///< device, [dim] fp32 scale
  float* y;             ///< device, [rows][dim] fp32 output (may alias x)
  uint32_t rows;        ///< number of rows (tokens)
  uint32_t dim;         ///< values per row (hidden size)
  float eps;            ///< added to the mean square before the reciprocal square root
};
int launch_rmsnorm(const rmsnorm_params& p, void* stream);

/// RMSNorm of selected fp32 rows into a matrix-product input of `type` (same lane order as
/// launch_rmsnorm, so the fp32 case is bit-identical to the CPU reference).
struct rmsnorm_cast_params {
  const float* x;           ///< device, fp32 rows of `dim`
  const uint32_t* row_ids;  ///< device, [rows] which rows of x to normalise; null = 0..rows-1
  const float* weight;      ///< device, [dim] fp32
  void* y;                  ///< device, [rows][dim] of `type`
  uint32_t rows;
  uint32_t dim;
  float eps;
  dtype type;
};
int launch_rmsnorm_cast(const rmsnorm_cast_params& p, void* stream);

/// x[r] = table[tokens[r]] (rows of `hidden`), widened to fp32.
struct embed_params {
  const void* table;      ///< device, [vocab][hidden] of `type`
  const int32_t* tokens;  ///< device, [rows] token ids (checked on the host before launch)
  float* x;               ///< device, [rows][hidden] fp32
  uint32_t rows;
  uint32_t hidden;
  dtype type;
};
int launch_embed(const embed_params& p, void* stream);

/// After the fused QKV product: bias (Qwen2), per-head RMSNorm of q and k (Qwen3), RoPE at each
/// row's position (rotate_half), then K and V written into the row's KV slot. q stays fp32 in
/// place for attention. Order of operations is the CPU executor's.
struct qkv_finish_params {
  float* qkv;                 ///< device, [rows][q_dim + 2·kv_dim] fp32: q | k | v
  const float* bias;          ///< device, [q_dim + 2·kv_dim] or null
  const float* q_norm;        ///< device, [head_dim] or null (then k_norm is null too)
  const float* k_norm;        ///< device, [head_dim]
  const float* inv_freq;      ///< device, [head_dim / 2] RoPE inverse frequencies (scaling applied)
  const uint32_t* positions;  ///< device, [rows] absolute position of each row
  const uint64_t* kv_slot;    ///< device, [rows] element offset of the row's K slot in the layer
  void* kv_layer;             ///< device, this layer's KV base, `type` elements
  uint32_t rows;
  uint32_t num_heads, num_kv_heads, head_dim;
  uint32_t page_size_tokens;  ///< V of a slot sits page_size_tokens·kv_dim elements after its K
  float eps;                  ///< for q_norm / k_norm
  dtype type;
};
int launch_qkv_finish(const qkv_finish_params& p, void* stream);

/// Causal attention of each query row over its own sequence's paged KV, positions [0, pos].
/// Rows are grouped into tiles of consecutive rows of one sequence so K and V are read once per
/// tile; each row's result does not depend on its tile-mates (batch invariance).
struct attention_params {
  const float* q;              ///< device, [rows][q_stride] fp32 (q of the fused qkv)
  uint32_t q_stride;           ///< floats between rows of q
  const void* kv_layer;        ///< device, this layer's KV base, `type` elements
  const uint32_t* positions;   ///< device, [rows] absolute position (attends to 0..pos)
  const uint32_t* page_table;  ///< device, flat page ids of all sequences
  const uint32_t* row_pages;   ///< device, [rows] offset of the row's sequence in page_table
  const uint32_t* tiles;       ///< device, [num_tiles] first row of each tile
  uint32_t num_tiles;
  uint32_t tile_rows;          ///< attention_tile_rows, or 1 when every tile holds one row (decode rows: a block
                               ///< then does no work for absent rows; the bits are the same either way)
  const uint32_t* tile_count;  ///< device, [num_tiles] rows in each tile (1..tile_rows)
  void* out;                   ///< device, [rows][num_heads·head_dim] of `type` (input of the o-projection)
  uint32_t rows;               ///< rows in the job (the partials' stride)
  uint32_t splits;             ///< 1, or split each tile's positions into this many ranges of
  uint32_t split_positions;    ///<   split_positions, each a block, merged after (long decodes)
  float* partial;              ///< device, splits > 1: [splits][rows][num_heads][head_dim + 2] scratch
  uint32_t num_heads, num_kv_heads, head_dim;
  uint32_t page_size_tokens;
  uint64_t page_elems;         ///< elements per page (K and V of every slot)
  float scale;                 ///< 1/sqrt(head_dim)
  dtype type;
};
/// The number of rows a tile may hold.
constexpr uint32_t attention_tile_rows = 4;
int launch_attention(const attention_params& p, void* stream);

/// The same attention for prefill rows on the tensor cores (gpu/cuda/flash_attention.cu): tiles of
/// 1 to flash_tile_rows consecutive rows of one sequence, positions ascending (its last row sees
/// the most), tile_rows must be flash_tile_rows and splits 1; bf16 KV (16-byte aligned layer base)
/// and output only, head_dim 64 or 128. The query is rounded to bf16, and so are the
/// probabilities before they weigh V; sums stay fp32.
constexpr uint32_t flash_tile_rows = 64;
bool flash_attention_supported(uint32_t head_dim, dtype type);
int launch_flash_attention(const attention_params& p, void* stream);

/// y[m][n] (fp32) = beta·y + a[m][k] · w[n][k]ᵀ for a few rows (decode), a and w of `type`:
/// one warp per column streams w once. k must be a multiple of 16 bytes' worth of elements, and
/// the input rows at most gemv_max_input_bytes.
constexpr uint32_t gemv_max_rows = 8;
constexpr uint32_t gemv_max_input_bytes = 200 * 1024;  ///< m·k·sizeof(type): the inputs fit in shared memory
struct gemv_params {
  const void* a;  ///< device, [m][k] of `type`
  const void* w;  ///< device, [n][k] of `type`
  float* y;       ///< device, [m][n] fp32
  uint32_t m, n, k;
  float beta;     ///< 0 (overwrite) or 1 (accumulate: the residual add)
  dtype type;
  /// 16-byte weight loads each lane has in flight: 4 (also 0) or 8. The results' bits are the
  /// same either way; the bench times both (the product reached about a third of the HBM rate
  /// at 4, docs/perf.md).
  uint32_t loads_in_flight = 0;
};
int launch_gemv(const gemv_params& p, void* stream);

/// a[r][i] = silu(gu[r][i]) · gu[r][f + i] into `type` (the fused gate|up product's output).
struct swiglu_params {
  const float* gate_up;  ///< device, [rows][2·f] fp32
  void* out;             ///< device, [rows][f] of `type`
  uint32_t rows;
  uint32_t f;            ///< intermediate size
  dtype type;
};
int launch_swiglu(const swiglu_params& p, void* stream);

/// dst[i] = src[i] converted (either direction between fp32 and `type`; same type copies).
struct convert_params {
  const void* src;
  dtype src_type;
  void* dst;
  dtype dst_type;
  uint64_t n;  ///< elements
};
int launch_convert(const convert_params& p, void* stream);

/// Deterministic pseudo-random fill (benchmarks' random weights, made on the device so an
/// 8B-parameter model costs no host memory): x[i] = offset + scale · u(i), u uniform in [-1, 1).
struct fill_random_params {
  void* x;
  dtype type;
  uint64_t n;
  uint64_t seed;
  float scale;
  float offset;
};
int launch_fill_random(const fill_random_params& p, void* stream);

/// Pages between a device KV pool of `type` and a pinned host staging area of fp32, in the
/// order the page list gives (one layer): gather packs the listed pages contiguously as fp32;
/// scatter unpacks fp32 pages into the listed device pages.
struct kv_pages_params {
  void* kv_layer;          ///< device, this layer's KV base, `type` elements
  float* staging;          ///< device, [num_pages][page_elems] fp32
  const uint32_t* pages;   ///< device, [num_pages]
  uint32_t num_pages;
  uint64_t page_elems;
  dtype type;
};
int launch_kv_gather(const kv_pages_params& p, void* stream);
int launch_kv_scatter(const kv_pages_params& p, void* stream);

/// Token slots from a device KV pool of `type` straight into a host pool of fp32 (page-locked
/// and mapped: `host_layer` is its device-side address), at the same element offsets: for each
/// listed slot, `planes` runs of `row_elems` values, `plane_stride` apart (K, then V). A decode
/// step writes one slot per sequence; copying its whole page (16 slots) to mirror it moved 16
/// times the bytes, which at batch 128 took longer over PCIe than the step's own compute.
struct kv_rows_params {
  const void* kv_layer;   ///< device, this layer's KV base, `type` elements
  float* host_layer;      ///< mapped host memory (device address), this layer's base, fp32 elements
  const uint64_t* slots;  ///< device, [rows] element offset of each slot's first plane in the layer
  uint32_t rows;
  uint32_t row_elems;     ///< values per plane of one slot (kv_dim)
  uint64_t plane_stride;  ///< elements from one plane of a slot to the next (page_size_tokens * kv_dim)
  uint32_t planes;        ///< 2 (K and V)
  dtype type;
};
int launch_kv_rows_to_host(const kv_rows_params& p, void* stream);

/// Page-locks `bytes` of host memory at `host` and maps it for the device; returns the address
/// kernels use for it (null when the driver refuses, say because the memory cannot be pinned).
void* host_register_mapped(void* host, uint64_t bytes);
void host_unregister(void* host);

/// Greedy sampling on the device: out[r] = the index of row r's largest value, the lowest index
/// among equal values, NaNs never chosen (0 for a row without a number). Without NaNs this is
/// sample_token's greedy pick, so a decode step returns a token per row instead of its logits.
struct argmax_params {
  const float* x;  ///< device, [rows][cols] fp32 (logits)
  int32_t* out;    ///< device, [rows]
  uint32_t rows;
  uint32_t cols;   ///< the vocabulary
};
int launch_argmax(const argmax_params& p, void* stream);

/// A draw at a temperature over the whole row (sample_token with no top-k, top-p or penalties):
/// out[r] = the first token whose running sum of exp((x - max) / T), in double, passes u[r] times
/// the row's total. NaNs have no probability. Agrees with sample_token except where a draw falls
/// within rounding of a boundary between two tokens.
struct draw_params {
  const float* logits;       ///< device, [rows][cols] fp32
  const float* temperature;  ///< device, [rows], each > 0
  const double* u;           ///< device, [rows] each row's draw in [0, 1) (draw_uniform); < 0: no draw, out untouched
  int32_t* out;              ///< device, [rows]
  uint32_t rows;
  uint32_t cols;
};
int launch_draw(const draw_params& p, void* stream);

/// Read-only bandwidth probe: sums n 16-byte vectors (the HBM floor's ceiling).
struct read_probe_params {
  const void* x;
  uint64_t n16;     ///< 16-byte vectors
  float* sink;      ///< device, one float (keeps the reads alive)
};
int launch_read_probe(const read_probe_params& p, void* stream);

/// Blocking helpers for the conformance tests: copy host <-> device, allocate, free.
void* device_alloc(uint64_t bytes);
void device_free(void* ptr);
void copy_to_device(void* dst, const void* src, uint64_t bytes);
void copy_to_host(void* dst, const void* src, uint64_t bytes);

}  // namespace baton::gpu::cuda
