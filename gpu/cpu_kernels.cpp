#include "gpu/cpu_kernels.hpp"

#include <algorithm>
#include <cmath>
#include <vector>
#include <cstring>

#include "gpu/thread_pool.hpp"

namespace baton::gpu {

namespace {

using v8 = float __attribute__((vector_size(32)));

inline v8 load8(const float* p) {
  v8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

/// The one place that defines how 8 lane partial sums become a scalar.
inline float reduce8(v8 a) {
  return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
}

/// How far ahead the micro-kernel prefetches its weight rows, in floats. 1 KiB where the weights
/// are in cache (prefill: a tile's rows serve every row of x; attention's keys), 8 KiB where a
/// decode step streams them from memory: the hardware's prefetcher alone left it latency-bound
/// (1 KiB took a batch-8 step's products from 76 to 68 ms; 8 KiB, with the 8 x 3 tile, to about
/// 35). 8 KiB in prefill cost it up to 10 % on two threads (lines of the next tiles pushed out
/// the ones in use).
constexpr size_t near_ahead = 256, far_ahead = 2048;

/// R rows of x against C rows of w. Lane j of acc[r][c] sums x[r][i]·w[c][i] over i ≡ j (mod 8)
/// in increasing i; the tail k % 8 goes to lanes 0.. in order. Same per element for any R, C.
template <int R, int C>
#if defined(__x86_64__) && !defined(__AVX2__) && !defined(__clang__)  // clang: no target_clones on templates
__attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
#endif
void micro_kernel(const float* const* xs, const float* const* ws, size_t k, float* out /* [R][C] */, size_t ahead) {
  v8 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = v8{0, 0, 0, 0, 0, 0, 0, 0};
  size_t i = 0;
  for (; i + 8 <= k; i += 8) {
    v8 wv[C];
    for (int c = 0; c < C; ++c) {
      // A cache line of each weight row `ahead` floats on (see matmul_nt).
      if ((i & 15) == 0) __builtin_prefetch(ws[c] + i + ahead);
      wv[c] = load8(ws[c] + i);
    }
    for (int r = 0; r < R; ++r) {
      const v8 xv = load8(xs[r] + i);
      for (int c = 0; c < C; ++c) acc[r][c] += xv * wv[c];
    }
  }
  for (size_t j = 0; i + j < k; ++j)
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) acc[r][c][j] += xs[r][i + j] * ws[c][i + j];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) out[r * C + c] = reduce8(acc[r][c]);
}

/// Rows r..r+R-1 of x against the C rows of w at ws, into columns n0.. of y.
template <int R, int C>
void rows_block(const float* x, size_t r, size_t k, const float* const* ws, size_t n0, float* y, size_t n, size_t ahead) {
  const float* xs[R];
  for (int q = 0; q < R; ++q) xs[q] = x + (r + q) * k;
  float out[R * C];
  micro_kernel<R, C>(xs, ws, k, out, ahead);
  for (int q = 0; q < R; ++q)
    for (int c = 0; c < C; ++c) y[(r + q) * n + n0 + c] = out[q * C + c];
}

/// Every row of x against C rows of w, R_MAX (8 or 4) rows at a time (each loaded vector of w
/// serves that many rows), then 4, 2 and 1.
template <int C, int R_MAX>
void rows_against(const float* x, size_t m, size_t k, const float* w, size_t n0, float* y, size_t n, size_t ahead) {
  const float* ws[C];
  for (int c = 0; c < C; ++c) ws[c] = w + (n0 + c) * k;
  size_t r = 0;
  if constexpr (R_MAX >= 8)
    for (; r + 8 <= m; r += 8) rows_block<8, C>(x, r, k, ws, n0, y, n, ahead);
  for (; r + 4 <= m; r += 4) rows_block<4, C>(x, r, k, ws, n0, y, n, ahead);
  for (; r + 2 <= m; r += 2) rows_block<2, C>(x, r, k, ws, n0, y, n, ahead);
  for (; r < m; ++r) rows_block<1, C>(x, r, k, ws, n0, y, n, ahead);
}

/// Whether the 8 x 3 tile fits the vector registers: its 24 accumulators, 3 weight vectors and a
/// row of x need 28 of AVX-512's 32 (the x86-64-v4 clone). With AVX2's 16 they would spill.
bool wide_tiles() {
#if defined(__x86_64__) && !defined(__clang__)
  static const bool wide = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
                           __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
                           __builtin_cpu_supports("avx512cd");
  return wide;
#else
  return false;
#endif
}

}  // namespace

void argmax_rows(const float* x, size_t rows, size_t cols, int32_t* out) {
  for (size_t r = 0; r < rows; ++r) {
    const float* row = x + r * cols;
    size_t at = cols;  // none yet
    for (size_t i = 0; i < cols; ++i)
      if (!std::isnan(row[i]) && (at == cols || row[i] > row[at])) at = i;
    out[r] = at == cols ? 0 : static_cast<int32_t>(at);
  }
}

float dot_fixed(const float* a, const float* b, size_t k) {
  float out;
  const float* xs[1] = {a};
  const float* ws[1] = {b};
  micro_kernel<1, 1>(xs, ws, k, &out, near_ahead);
  return out;
}

void matmul_nt(const float* x, size_t m, size_t k, const float* w, size_t n, float* y, thread_pool* pool) {
  // Decode batches of 8 rows and more stream their weights from memory: with 4 x 4 tiles each
  // weight vector was loaded for rows 0-3 from memory and again for rows 4-7 from cache, and the
  // products ran at half the in-cache rate. 8 x 3 tiles load each once for 8 rows. Every element
  // still sums as dot_fixed does, so the tile never changes a result.
  const bool streams = m <= 64;  // few rows per weight: the weights' bytes bound the product
  const bool wide = m >= 8 && streams && wide_tiles();
  const size_t tile = wide ? 3 : 4, ahead = streams ? far_ahead : near_ahead;
  auto body = [&](size_t begin, size_t end) {
    size_t j = begin;
    if (wide)
      for (; j + 3 <= end; j += 3) rows_against<3, 8>(x, m, k, w, j, y, n, ahead);
    else
      for (; j + 4 <= end; j += 4) rows_against<4, 4>(x, m, k, w, j, y, n, ahead);
    for (; j < end; ++j) rows_against<1, 4>(x, m, k, w, j, y, n, ahead);
  };
  // Waking the pool costs tens of microseconds: not worth it for small products.
  constexpr size_t min_parallel_macs = size_t{1} << 20;
  if (pool && m * n * k >= min_parallel_macs)
    pool->parallel_for(n, tile, body);
  else
    body(0, n);
}

void rmsnorm(const float* x, const float* weight, size_t rows, size_t dim, float eps, float* y) {
  for (size_t r = 0; r < rows; ++r) {
    const float* xr = x + r * dim;
    float* yr = y + r * dim;
    const float mean_sq = dot_fixed(xr, xr, dim) / static_cast<float>(dim);
    const float inv = 1.0f / std::sqrt(mean_sq + eps);
    for (size_t i = 0; i < dim; ++i) yr[i] = weight[i] * (xr[i] * inv);
  }
}

void rope_apply(float* x, uint32_t num_heads, uint32_t head_dim, uint32_t pos, const float* inv_freq) {
  const uint32_t half = head_dim / 2;
  for (uint32_t i = 0; i < half; ++i) {
    const float angle = static_cast<float>(pos) * inv_freq[i];
    const float c = std::cos(angle), s = std::sin(angle);
    for (uint32_t h = 0; h < num_heads; ++h) {
      float* v = x + h * head_dim;
      const float x1 = v[i], x2 = v[i + half];
      v[i] = x1 * c - x2 * s;
      v[i + half] = x2 * c + x1 * s;
    }
  }
}

void rope_apply(float* x, uint32_t num_heads, uint32_t head_dim, uint32_t pos, float theta) {
  std::vector<float> inv_freq(head_dim / 2);
  for (uint32_t i = 0; i < head_dim / 2; ++i)
    inv_freq[i] = 1.0f / std::pow(theta, static_cast<float>(2 * i) / static_cast<float>(head_dim));
  rope_apply(x, num_heads, head_dim, pos, inv_freq.data());
}

void swiglu(const float* gate, const float* up, size_t n, float* a) {
  for (size_t i = 0; i < n; ++i) a[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
}

void swiglu_mlp(const float* x, size_t n, size_t h, const float* gate, const float* up, const float* down, size_t f,
                float* g, float* u, float* out, thread_pool* pool) {
  matmul_nt(x, n, h, gate, f, g, pool);
  matmul_nt(x, n, h, up, f, u, pool);
  swiglu(g, u, n * f, g);
  matmul_nt(g, n, f, down, h, out, pool);
}

namespace {

/// softmax(q·k_t · scale) over t < len, then Σ_t p_t v_t: the one attention order both layouts use.
template <class KeyAt, class ValueAt>
void attend(const float* q, uint32_t len, KeyAt key_at, uint32_t key_dim, ValueAt value_at, uint32_t value_dim,
            float scale, float* scores, float* out) {
  float max_score = -INFINITY;
  for (uint32_t t = 0; t < len; ++t) {
    scores[t] = dot_fixed(q, key_at(t), key_dim) * scale;
    max_score = std::max(max_score, scores[t]);
  }
  float sum = 0.0f;
  for (uint32_t t = 0; t < len; ++t) {
    scores[t] = std::exp(scores[t] - max_score);
    sum += scores[t];
  }
  std::fill_n(out, value_dim, 0.0f);
  for (uint32_t t = 0; t < len; ++t) {
    const float p = scores[t] / sum;
    const float* v = value_at(t);
    for (uint32_t d = 0; d < value_dim; ++d) out[d] += p * v[d];
  }
}

/// out[i][j] = dot_fixed(xs[i], ws[j]) for nx rows and nw ≤ 4 columns: the tiles of the micro
/// kernel (each loaded column vector serves up to 4 rows), so every element sums as dot_fixed's.
void dot_block(const float* const* xs, uint32_t nx, const float* const* ws, uint32_t nw, size_t k, float* out) {
  float tile[16];
  for (uint32_t i = 0; i < nx;) {
    const uint32_t rows = nx - i >= 4 ? 4 : nx - i >= 2 ? 2 : 1;
    for (uint32_t j = 0; j < nw;) {
      const uint32_t cols = nw - j >= 4 ? 4 : 1;
      if (rows == 4 && cols == 4) micro_kernel<4, 4>(xs + i, ws + j, k, tile, near_ahead);
      else if (rows == 2 && cols == 4) micro_kernel<2, 4>(xs + i, ws + j, k, tile, near_ahead);
      else if (rows == 1 && cols == 4) micro_kernel<1, 4>(xs + i, ws + j, k, tile, near_ahead);
      else if (rows == 4) micro_kernel<4, 1>(xs + i, ws + j, k, tile, near_ahead);
      else if (rows == 2) micro_kernel<2, 1>(xs + i, ws + j, k, tile, near_ahead);
      else micro_kernel<1, 1>(xs + i, ws + j, k, tile, near_ahead);
      for (uint32_t r = 0; r < rows; ++r)
        for (uint32_t c = 0; c < cols; ++c) out[(i + r) * nw + j + c] = tile[r * cols + c];
      j += cols;
    }
    i += rows;
  }
}

/// out[g][d] += probs[g][t] · vs[t][d] for the tokens t < count in order, the heads g < group
/// (at most 4) and d < n: the product rounded, then the sum, per element (as attend's loop), so
/// every element sums as attend's does. Each 8-lane chunk of the heads' outputs stays in
/// registers across the tokens, and each chunk of a value is loaded once for all heads.
#if defined(__x86_64__) && !defined(__AVX2__) && !defined(__clang__)
__attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
#endif
void add_scaled_tokens(float* out, uint32_t group, uint32_t n, const float* const* vs, const float* probs,
                       uint32_t count) {
  uint32_t d = 0;
  for (; d + 8 <= n; d += 8) {
    v8 acc[4];
    for (uint32_t g = 0; g < group; ++g) acc[g] = load8(out + size_t{g} * n + d);
    for (uint32_t t = 0; t < count; ++t) {
      const v8 v = load8(vs[t] + d);
      for (uint32_t g = 0; g < group; ++g) {
        const float p = probs[g * count + t];
        acc[g] += v8{p, p, p, p, p, p, p, p} * v;
      }
    }
    for (uint32_t g = 0; g < group; ++g) std::memcpy(out + size_t{g} * n + d, &acc[g], sizeof(v8));
  }
  for (; d < n; ++d)
    for (uint32_t g = 0; g < group; ++g)
      for (uint32_t t = 0; t < count; ++t) out[size_t{g} * n + d] += probs[g * count + t] * vs[t][d];
}

/// attend for the `group` query heads (q, `key_dim` apart) that read the same keys and values:
/// each head's scores, softmax and weighted sum are attend's, element by element, so each head's
/// output equals attend's for that head alone, bit for bit. What it saves is memory traffic and
/// calls: each key is loaded once for every head (4 keys at a time), and each value once.
template <class KeyAt, class ValueAt>
void attend_group(const float* q, uint32_t group, uint32_t len, KeyAt key_at, uint32_t key_dim, ValueAt value_at,
                  uint32_t value_dim, float scale, float* scores /* [group][len] */, float* out /* [group][value_dim] */) {
  // Scores 4 keys by up to 4 heads at a time, in stack tiles: this runs per row, KV head and
  // layer, so it allocates nothing for groups up to 16.
  for (uint32_t t = 0; t < len; t += 4) {
    const uint32_t nt = std::min(4u, len - t);
    const float* ks[4];
    for (uint32_t c = 0; c < nt; ++c) ks[c] = key_at(t + c);
    for (uint32_t g0 = 0; g0 < group; g0 += 4) {
      const uint32_t ng = std::min(4u, group - g0);
      const float* qs[4];
      for (uint32_t r = 0; r < ng; ++r) qs[r] = q + size_t{g0 + r} * key_dim;
      float tile[16];
      dot_block(qs, ng, ks, nt, key_dim, tile);
      for (uint32_t r = 0; r < ng; ++r)
        for (uint32_t c = 0; c < nt; ++c) scores[size_t{g0 + r} * len + t + c] = tile[r * nt + c] * scale;
    }
  }
  float few_sums[16];
  std::vector<float> many_sums(group > 16 ? group : 0);
  float* sums = group > 16 ? many_sums.data() : few_sums;
  for (uint32_t g = 0; g < group; ++g) {
    float* sg = scores + size_t{g} * len;
    float max_score = -INFINITY;
    for (uint32_t t = 0; t < len; ++t) max_score = std::max(max_score, sg[t]);
    float sum = 0.0f;
    for (uint32_t t = 0; t < len; ++t) {
      sg[t] = std::exp(sg[t] - max_score);
      sum += sg[t];
    }
    sums[g] = sum;
  }
  std::fill_n(out, size_t{group} * value_dim, 0.0f);
  // The values 16 tokens by up to 4 heads at a time (each head's weight p = score / sum, as
  // attend's), the tokens in order.
  constexpr uint32_t chunk = 16;
  const float* vs[chunk];
  float probs[4 * chunk];
  for (uint32_t t0 = 0; t0 < len; t0 += chunk) {
    const uint32_t nt = std::min(chunk, len - t0);
    for (uint32_t c = 0; c < nt; ++c) vs[c] = value_at(t0 + c);
    for (uint32_t g0 = 0; g0 < group; g0 += 4) {
      const uint32_t ng = std::min(4u, group - g0);
      for (uint32_t r = 0; r < ng; ++r)
        for (uint32_t c = 0; c < nt; ++c) probs[r * nt + c] = scores[size_t{g0 + r} * len + t0 + c] / sums[g0 + r];
      add_scaled_tokens(out + size_t{g0} * value_dim, ng, value_dim, vs, probs, nt);
    }
  }
}

}  // namespace

void attention_group_ref(const float* q, uint32_t group, uint32_t len, const float* kv_layer, const uint32_t* pages,
                         uint32_t page_size, uint32_t kv_dim, uint64_t page_elems, uint32_t kv_offset, uint32_t head_dim,
                         float scale, float* scores, float* out) {
  auto k_at = [&](uint32_t t) { return kv_layer + pages[t / page_size] * page_elems + uint64_t{t % page_size} * kv_dim + kv_offset; };
  const uint64_t v_skip = uint64_t{page_size} * kv_dim;
  attend_group(q, group, len, k_at, head_dim, [&](uint32_t t) { return k_at(t) + v_skip; }, head_dim, scale, scores, out);
}

void latent_attention_group_ref(const float* q, uint32_t heads, uint32_t len, const float* kv_layer,
                                const uint32_t* pages, uint32_t page_size, uint32_t latent_dim, uint64_t page_elems,
                                uint32_t value_dim, float scale, float* scores, float* out) {
  auto at = [&](uint32_t t) { return kv_layer + pages[t / page_size] * page_elems + uint64_t{t % page_size} * latent_dim; };
  attend_group(q, heads, len, at, latent_dim, at, value_dim, scale, scores, out);
}

void attention_ref(const float* q, uint32_t len, const float* kv_layer, const uint32_t* pages, uint32_t page_size,
                   uint32_t kv_dim, uint64_t page_elems, uint32_t kv_offset, uint32_t head_dim, float scale,
                   float* scores, float* out) {
  auto k_at = [&](uint32_t t) { return kv_layer + pages[t / page_size] * page_elems + uint64_t{t % page_size} * kv_dim + kv_offset; };
  const uint64_t v_skip = uint64_t{page_size} * kv_dim;
  attend(q, len, k_at, head_dim, [&](uint32_t t) { return k_at(t) + v_skip; }, head_dim, scale, scores, out);
}

void latent_attention_ref(const float* q, uint32_t len, const float* kv_layer, const uint32_t* pages,
                          uint32_t page_size, uint32_t latent_dim, uint64_t page_elems, uint32_t value_dim,
                          float scale, float* scores, float* out) {
  auto at = [&](uint32_t t) { return kv_layer + pages[t / page_size] * page_elems + uint64_t{t % page_size} * latent_dim; };
  attend(q, len, at, latent_dim, at, value_dim, scale, scores, out);
}

void rope_apply_interleaved(float* x, uint32_t dim, uint32_t pos, const float* inv_freq) {
  for (uint32_t i = 0; i < dim / 2; ++i) {
    const float angle = static_cast<float>(pos) * inv_freq[i];
    const float c = std::cos(angle), s = std::sin(angle);
    const float x1 = x[2 * i], x2 = x[2 * i + 1];
    x[2 * i] = x1 * c - x2 * s;
    x[2 * i + 1] = x2 * c + x1 * s;
  }
}

void add_inplace(float* x, const float* y, size_t n) {
  for (size_t i = 0; i < n; ++i) x[i] += y[i];
}

}  // namespace baton::gpu
