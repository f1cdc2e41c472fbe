#pragma once

// Reference CPU kernels of the executor. Each output element has one fixed reduction order
// (8 interleaved partial sums over k, combined pairwise), whatever the batch size, the tiling
// or the thread count: this is what makes a request's numbers independent of who shares its
// batch, and a chunked prefill equal to token-by-token decoding.

#include <cstddef>
#include <cstdint>

namespace baton::gpu {

class thread_pool;

/// out[r] = the index of row r's largest value, the lowest among equal values, NaNs never chosen
/// (0 when a row has no number): the reference of the CUDA argmax kernel.
void argmax_rows(const float* x, size_t rows, size_t cols, int32_t* out);

/// Fixed-order dot product of two length-k vectors.
float dot_fixed(const float* a, const float* b, size_t k);

/// y[m][n] = x[m][k] · w[n][k]ᵀ (w is row-major [out][in], as nn.Linear stores it).
/// `pool` may be null (single thread).
void matmul_nt(const float* x, size_t m, size_t k, const float* w, size_t n, float* y, thread_pool* pool);

/// y = x / sqrt(mean(x²) + eps) · weight, for `rows` rows of `dim` values.
void rmsnorm(const float* x, const float* weight, size_t rows, size_t dim, float eps, float* y);

/// Rotary embedding in Hugging Face's rotate_half convention (pairs i and i + head_dim/2),
/// applied in place to `num_heads` heads of one token at position `pos`.
void rope_apply(float* x, uint32_t num_heads, uint32_t head_dim, uint32_t pos, float theta);
/// The same with precomputed inverse frequencies (head_dim / 2 of them; see rope_inv_freq), which
/// is how scaled RoPE (Llama 3) enters: identical arithmetic to the theta form when unscaled.
void rope_apply(float* x, uint32_t num_heads, uint32_t head_dim, uint32_t pos, const float* inv_freq);

/// a[i] = silu(gate[i]) · up[i]
void swiglu(const float* gate, const float* up, size_t n, float* a);

/// out[n][h] = down · (silu(gate · x) ⊙ (up · x)) for n rows of x[n][h], f intermediate values:
/// the dense MLP and every expert. `g` and `u` are [n][f] scratch. `pool` may be null.
void swiglu_mlp(const float* x, size_t n, size_t h, const float* gate, const float* up, const float* down, size_t f,
                float* g, float* u, float* out, thread_pool* pool);

/// Causal attention of one query head over paged KV (the layout of kv_cache, one layer):
/// out[d] = Σ_t softmax_t(q·k_t · scale) v_t[d] over positions t in [0, len). `kv_layer` is the
/// layer's base, pages of `page_elems` floats ([k|v][slot][kv_dim]); `kv_offset` picks the KV
/// head inside a slot (kv_head · head_dim). The CPU executor's attention, and the reference of
/// the CUDA attention kernel.
void attention_ref(const float* q, uint32_t len, const float* kv_layer, const uint32_t* pages, uint32_t page_size,
                   uint32_t kv_dim, uint64_t page_elems, uint32_t kv_offset, uint32_t head_dim, float scale,
                   float* scores /* [len] scratch */, float* out);

/// attention_ref for `group` query heads that share one KV head (GQA: heads kv_head · group ..
/// onward; q and out hold them one after another, head_dim apart), each head's output equal to
/// attention_ref's bit for bit. The CPU executor's attention: each key and value is read once per
/// group rather than once per head.
void attention_group_ref(const float* q, uint32_t group, uint32_t len, const float* kv_layer, const uint32_t* pages,
                         uint32_t page_size, uint32_t kv_dim, uint64_t page_elems, uint32_t kv_offset, uint32_t head_dim,
                         float scale, float* scores /* [group][len] scratch */, float* out);

/// Attention of one query over the MLA latent cache (one plane of `latent_dim` floats per token):
/// scores are q·latent_t over all latent_dim values (the absorbed no-RoPE query against the
/// compressed KV, plus the RoPE query against the shared rotated key), and the output is
/// Σ_t p_t latent_t over the first `value_dim` values (the compressed KV, before W_UV).
void latent_attention_ref(const float* q, uint32_t len, const float* kv_layer, const uint32_t* pages,
                          uint32_t page_size, uint32_t latent_dim, uint64_t page_elems, uint32_t value_dim,
                          float scale, float* scores /* [len] scratch */, float* out);

/// latent_attention_ref for `heads` queries (latent_dim apart; outputs value_dim apart) over the
/// same latent cache, each equal to latent_attention_ref's bit for bit; every head reads the one
/// latent, so each token's is loaded once.
void latent_attention_group_ref(const float* q, uint32_t heads, uint32_t len, const float* kv_layer,
                                const uint32_t* pages, uint32_t page_size, uint32_t latent_dim, uint64_t page_elems,
                                uint32_t value_dim, float scale, float* scores /* [heads][len] scratch */, float* out);

/// Rotary embedding over adjacent pairs (2i, 2i + 1) of one `dim`-wide vector, as DeepSeek's MLA
/// rotates its decoupled key and query parts (transformers' complex form for V2, its interleave
/// option for V3: the same dot products).
void rope_apply_interleaved(float* x, uint32_t dim, uint32_t pos, const float* inv_freq);

/// In-place x[i] += y[i].
void add_inplace(float* x, const float* y, size_t n);

}  // namespace baton::gpu
