// GPU benchmarks of the CUDA executor (issues 11 and 12), each beside the ceiling it chases,
// measured in the same run: cuBLAS bf16 GEMM rate, read-only HBM bandwidth, pinned PCIe copies.
//
//   baton_bench_gpu [--quick] [--json FILE]
//
// 1. Overlap (issue 11), Llama-3-8B shape, random bf16 weights: a 2K-token prefill on a 30K-token
//    cached prefix, with the prefix resident on the device vs prefetched layer by layer from the
//    pinned host pool, with and without the per-layer sends; a per-stream timeline summary.
// 2. Decode step time at several batches and contexts against the HBM floor (issue 12).
// 3. Prefill TFLOP/s at 1K and 8K tokens against the GEMM rate (issue 12).
// 4. The price of batch invariance: the executor's products (fixed_gemm: one cuBLASLt algorithm
//    per row bucket, no split-K) against cuBLAS GemmEx's own pick, same shapes, same run.
// Prints a summary table last. Exits 2 without a GPU.

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "bench/bench_stats.hpp"
#include "gpu/cuda/fixed_gemm.hpp"
#ifdef BATON_HAVE_CUPTI
#include "bench/kernel_trace.hpp"
#endif
#include "gpu/cuda/kernels.hpp"
#include "gpu/cuda_executor.hpp"
#include "gpu/local_generate.hpp"
#include "bench/bench_flags.hpp"

using namespace baton::gpu;
#ifdef BATON_HAVE_CUPTI
using baton::bench::kernel_trace_start;
using baton::bench::kernel_trace_stop;
#endif
namespace cuda = baton::gpu::cuda;

using baton::bench::median;

namespace {

std::vector<std::string> summary;  // the table printed last
std::ostringstream json;           // the same figures as JSON lines
void row(const std::string& what, const std::string& value, const std::string& vs) {
  char buf[512];
  std::snprintf(buf, sizeof buf, "| %-58s | %-30s | %-40s |", what.c_str(), value.c_str(), vs.c_str());
  summary.push_back(buf);
}
std::string fmt(const char* f, double x) {
  char b[64];
  std::snprintf(b, sizeof b, f, x);
  return b;
}

#define CK(x)                                                                                   \
  do {                                                                                          \
    auto rc_ = (x);                                                                             \
    if (rc_ != 0) {                                                                             \
      std::fprintf(stderr, "baton_bench_gpu: %s failed (%d) at line %d\n", #x, int(rc_), __LINE__); \
      std::exit(1);                                                                             \
    }                                                                                           \
  } while (0)

struct timer {  // CUDA events on the default stream
  cudaEvent_t a, b;
  timer() {
    cudaEventCreate(&a);
    cudaEventCreate(&b);
  }
  ~timer() {
    cudaEventDestroy(a);
    cudaEventDestroy(b);
  }
  void start(cudaStream_t s = nullptr) { cudaEventRecord(a, s); }
  double stop_ms(cudaStream_t s = nullptr) {
    cudaEventRecord(b, s);
    cudaEventSynchronize(b);
    float ms = 0;
    cudaEventElapsedTime(&ms, a, b);
    return ms;
  }
};

// ---- ceilings -------------------------------------------------------------------------------

double gemm_tflops(uint32_t m, uint32_t n, uint32_t k, int reps) {
  cublasHandle_t h;
  CK(cublasCreate(&h));
  void *a, *w, *c;
  CK(cudaMalloc(&a, uint64_t{m} * k * 2));
  CK(cudaMalloc(&w, uint64_t{n} * k * 2));
  CK(cudaMalloc(&c, uint64_t{m} * n * 4));
  CK(cuda::launch_fill_random({a, cuda::dtype::bf16, uint64_t{m} * k, 1, 1.0f, 0.0f}, nullptr));
  CK(cuda::launch_fill_random({w, cuda::dtype::bf16, uint64_t{n} * k, 2, 1.0f, 0.0f}, nullptr));
  const float alpha = 1, beta = 0;
  auto run = [&] {
    CK(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, n, m, k, &alpha, w, CUDA_R_16BF, k, a, CUDA_R_16BF, k, &beta, c,
                    CUDA_R_32F, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  };
  for (int i = 0; i < 3; ++i) run();
  std::vector<double> t;
  timer tm;
  for (int i = 0; i < reps; ++i) {
    tm.start();
    run();
    t.push_back(tm.stop_ms());
  }
  cudaFree(a);
  cudaFree(w);
  cudaFree(c);
  cublasDestroy(h);
  return 2.0 * m * n * k / (median(t) * 1e-3) / 1e12;
}

/// The decode products alone: Llama-3-8B's four weight matrices streamed by launch_gemv at 1 and
/// 8 rows, with 4 and with 8 loads in flight per lane, as GB/s of weights read against the
/// read-only ceiling. Each launch reads another copy of the matrix (a 2 GiB ring), so none is
/// served from the 50 MB L2.
/// The weight-streaming product against the executor's cuBLASLt path (fixed_gemm, whose first
/// bucket takes 1-64 rows) at 1, 2, 4 and 8 rows, GB/s of weights over a 2 GiB ring (no L2
/// reuse): where cuBLASLt wins, the executor's row limit for the gemv (gemv_max_rows) should
/// drop. On 2026-12-04 a batch-8 decode step was slower than a batch-32 one.
void gemv_bench(bool quick, double read_bw_gbps) {
  struct shape {
    const char* name;
    uint32_t n, k;
  };
  const shape shapes[] = {{"qkv", 6144, 4096}, {"o", 4096, 4096}, {"gate|up", 28672, 4096}, {"down", 4096, 14336}};
  const uint64_t ring = uint64_t{2} << 30;
  void *w, *a, *y;
  CK(cudaMalloc(&w, ring));
  CK(cudaMalloc(&a, uint64_t{8} * 14336 * 2));
  CK(cudaMalloc(&y, uint64_t{8} * 28672 * 4));
  CK(cuda::launch_fill_random({w, cuda::dtype::bf16, ring / 2, 7, 0.02f, 0.0f}, nullptr));
  CK(cuda::launch_fill_random({a, cuda::dtype::bf16, uint64_t{8} * 14336, 8, 1.0f, 0.0f}, nullptr));
  std::string why;
  auto fixed = cuda::fixed_gemm::create(cuda::dtype::bf16, &why);
  std::printf("\nweight-streaming product (launch_gemv) against cuBLASLt (fixed_gemm), bf16, GB/s of weights; "
              "read-only ceiling %.0f GB/s\n", read_bw_gbps);
  std::printf("%-8s %5s %14s %14s %14s\n", "product", "rows", "4 in flight", "8 in flight", "cuBLASLt");
  for (uint32_t m : quick ? std::vector<uint32_t>{1u, 8u} : std::vector<uint32_t>{1u, 2u, 4u, 8u}) {
    double bytes_all = 0, ms_all[3] = {0, 0, 0};
    std::string which;
    for (const auto& s : shapes) {
      const bool gemv_fits = uint64_t{m} * s.k * 2 <= cuda::gemv_max_input_bytes;  // else the executor uses cuBLASLt
      const uint64_t mat = uint64_t{s.n} * s.k * 2, copies = ring / mat;
      double gbps[3] = {0, 0, 0};
      for (int v = 0; v < 3; ++v) {
        if (v < 2 && !gemv_fits) continue;
        if (v == 2 && !fixed) continue;
        const uint32_t loads = v == 1 ? 8 : 4;
        uint64_t next = 0;
        auto launch = [&] {
          const void* wi = static_cast<const char*>(w) + (next++ % copies) * mat;
          if (v < 2)
            CK(cuda::launch_gemv({a, wi, static_cast<float*>(y), m, s.n, s.k, 0.0f, cuda::dtype::bf16, loads}, nullptr));
          else if (auto e = fixed->run(a, wi, static_cast<float*>(y), m, s.n, s.k, 0.0f, nullptr); !e.empty())
            std::printf("cuBLASLt: %s\n", e.c_str());
        };
        for (int i = 0; i < 3; ++i) launch();
        const int reps = quick ? 10 : 40;
        timer tm;
        tm.start();
        for (int i = 0; i < reps; ++i) launch();
        const double ms = tm.stop_ms() / reps;
        gbps[v] = mat / (ms * 1e-3) / 1e9;
        if (gemv_fits) ms_all[v] += ms;
      }
      if (gemv_fits) {
        bytes_all += mat;
        which += std::string{which.empty() ? "" : ", "} + s.name;
        std::printf("%-8s %5u %9.0f GB/s %9.0f GB/s %9.0f GB/s\n", s.name, m, gbps[0], gbps[1], gbps[2]);
      } else {
        std::printf("%-8s %5u   (inputs exceed shared memory)  %9.0f GB/s\n", s.name, m, gbps[2]);
      }
      json << "{\"bench\":\"gemv\",\"product\":\"" << s.name << "\",\"rows\":" << m << ",\"gbps_4\":" << gbps[0]
           << ",\"gbps_8\":" << gbps[1] << ",\"gbps_cublaslt\":" << gbps[2] << "}\n";
    }
    row("gemv " + which + ", " + std::to_string(m) + " row(s): 4 / 8 loads / cuBLASLt",
        fmt("%.0f / ", bytes_all / (ms_all[0] * 1e-3) / 1e9) + fmt("%.0f / ", bytes_all / (ms_all[1] * 1e-3) / 1e9) +
            fmt("%.0f GB/s", ms_all[2] > 0 ? bytes_all / (ms_all[2] * 1e-3) / 1e9 : 0.0),
        fmt("read-only ceiling %.0f GB/s", read_bw_gbps));
  }
  cudaFree(w);
  cudaFree(a);
  cudaFree(y);
}

/// Llama-3-8B's four products at several row counts: TFLOP/s of fixed_gemm against GemmEx's
/// default pick, and whether they agree (max |Δ| over the first 64 rows, relative to the largest
/// output).
void invariant_gemm_bench(bool quick) {
  struct shape {
    const char* name;
    uint32_t n, k;
  };
  const shape shapes[] = {{"qkv", 6144, 4096}, {"o", 4096, 4096}, {"gate|up", 28672, 4096}, {"down", 4096, 14336}};
  const std::vector<uint32_t> rows = quick ? std::vector<uint32_t>{64, 2048} : std::vector<uint32_t>{16, 64, 256, 512, 2048, 8192};
  std::string why;
  auto fixed = cuda::fixed_gemm::create(cuda::dtype::bf16, &why);
  if (!fixed) {
    std::printf("fixed_gemm: %s\n", why.c_str());
    return;
  }
  cublasHandle_t h;
  CK(cublasCreate(&h));
  const uint32_t m_max = rows.back(), n_max = 28672, k_max = 14336;
  void *a, *w, *y1, *y2;
  CK(cudaMalloc(&a, uint64_t{m_max} * k_max * 2));
  CK(cudaMalloc(&w, uint64_t{n_max} * k_max * 2));
  CK(cudaMalloc(&y1, uint64_t{m_max} * n_max * 4));
  CK(cudaMalloc(&y2, uint64_t{m_max} * n_max * 4));
  CK(cuda::launch_fill_random({a, cuda::dtype::bf16, uint64_t{m_max} * k_max, 3, 1.0f, 0.0f}, nullptr));
  CK(cuda::launch_fill_random({w, cuda::dtype::bf16, uint64_t{n_max} * k_max, 4, 0.02f, 0.0f}, nullptr));
  std::printf("\nbatch-invariant products (fixed_gemm) vs cuBLAS GemmEx's own pick, bf16 in, fp32 out\n");
  std::printf("%-8s %6s %14s %14s %8s %12s  %s\n", "product", "rows", "fixed TFLOP/s", "GemmEx TFLOP/s", "ratio",
              "max rel diff", "algorithm");
  double fixed_ms = 0, ex_ms = 0;
  for (const auto& s : shapes)
    for (uint32_t m : rows) {
      const float alpha = 1, beta = 0;
      // A shape without a plan is reported in its row and the rest goes on (the executor falls
      // back to GemmEx there, without batch invariance).
      if (auto e = fixed->run(a, w, static_cast<float*>(y1), m, s.n, s.k, 0.0f, nullptr); !e.empty()) {
        std::printf("%-8s %6u   no plan: %s\n", s.name, m, e.c_str());
        json << "{\"bench\":\"invariant_gemm\",\"product\":\"" << s.name << "\",\"rows\":" << m << ",\"no_plan\":true}\n";
        continue;
      }
      auto run_fixed = [&] { fixed->run(a, w, static_cast<float*>(y1), m, s.n, s.k, 0.0f, nullptr); };
      auto run_ex = [&] {
        CK(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, s.n, m, s.k, &alpha, w, CUDA_R_16BF, s.k, a, CUDA_R_16BF, s.k, &beta,
                        y2, CUDA_R_32F, s.n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
      };
      auto time = [&](auto&& fn) {
        for (int i = 0; i < 2; ++i) fn();
        std::vector<double> t;
        timer tm;
        for (int i = 0; i < (quick ? 3 : 7); ++i) {
          tm.start();
          fn();
          t.push_back(tm.stop_ms());
        }
        return median(t);
      };
      const double tf = time(run_fixed), te = time(run_ex);
      fixed_ms += tf;
      ex_ms += te;
      std::vector<float> r1(uint64_t{std::min(m, 64u)} * s.n), r2(r1.size());  // the first rows suffice
      CK(cudaMemcpy(r1.data(), y1, r1.size() * 4, cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(r2.data(), y2, r2.size() * 4, cudaMemcpyDeviceToHost));
      float diff = 0, big = 0;
      for (size_t i = 0; i < r1.size(); ++i) {
        diff = std::max(diff, std::abs(r1[i] - r2[i]));
        big = std::max(big, std::abs(r2[i]));
      }
      const double flop = 2.0 * m * s.n * s.k;
      std::printf("%-8s %6u %14.1f %14.1f %8.2f %12.2e  %s\n", s.name, m, flop / tf / 1e9, flop / te / 1e9, te / tf,
                  big > 0 ? diff / big : 0.0, fixed->describe(m, s.n, s.k).c_str());
      json << "{\"bench\":\"invariant_gemm\",\"product\":\"" << s.name << "\",\"rows\":" << m
           << ",\"fixed_ms\":" << tf << ",\"gemmex_ms\":" << te << ",\"max_rel_diff\":" << (big > 0 ? diff / big : 0.0)
           << "}\n";
    }
  row("batch-invariant products, all shapes above", fmt("%.2f x GemmEx's time", fixed_ms / ex_ms),
      "cuBLAS GemmEx default pick, same run");
  for (void* p : {a, w, y1, y2}) cudaFree(p);
  cublasDestroy(h);
}

double read_gbps(uint64_t bytes) {
  void* x;
  float* sink;
  CK(cudaMalloc(&x, bytes));
  CK(cudaMalloc(&sink, 4));
  CK(cuda::launch_fill_random({x, cuda::dtype::f32, bytes / 4, 3, 1.0f, 0.0f}, nullptr));
  std::vector<double> t;
  timer tm;
  for (int i = 0; i < 12; ++i) {
    tm.start();
    CK(cuda::launch_read_probe({x, bytes / 16, sink}, nullptr));
    const double ms = tm.stop_ms();
    if (i >= 2) t.push_back(ms);
  }
  cudaFree(x);
  cudaFree(sink);
  return bytes / (median(t) * 1e-3) / 1e9;
}

/// Pinned host -> device: one large copy, and `piece`-byte copies back to back (the executor's
/// per-page pattern).
double h2d_gbps(uint64_t bytes, uint64_t piece) {
  void *h, *d;
  CK(cudaMallocHost(&h, bytes));
  CK(cudaMalloc(&d, bytes));
  std::memset(h, 1, bytes);
  std::vector<double> t;
  timer tm;
  for (int i = 0; i < 5; ++i) {
    tm.start();
    for (uint64_t off = 0; off < bytes; off += piece)
      CK(cudaMemcpyAsync(static_cast<char*>(d) + off, static_cast<char*>(h) + off, std::min(piece, bytes - off),
                         cudaMemcpyHostToDevice, nullptr));
    const double ms = tm.stop_ms();
    if (i >= 1) t.push_back(ms);
  }
  cudaFreeHost(h);
  cudaFree(d);
  return bytes / (median(t) * 1e-3) / 1e9;
}

// ---- executor runs --------------------------------------------------------------------------

/// A CUDA executor for a benchmark, or the process ends saying why not.
std::unique_ptr<executor> bench_executor(const model_config& cfg, const cuda_executor_config& ec) {
  std::string why;
  auto e = make_cuda_executor(cfg, nullptr, ec, &why);
  if (!e) {
    std::fprintf(stderr, "baton_bench_gpu: %s\n", why.c_str());
    std::exit(1);
  }
  return e;
}

/// One decode step of `batch` sequences at context `ctx`, as a decode rank asks for it: a
/// greedy token per sequence, picked on the device, no logits back. Sequence b holds the b-th
/// run of ctx / page_size + 1 pages of `pages`.
forward_job decode_job(const std::vector<uint32_t>& pages, uint32_t batch, uint32_t ctx, uint32_t page_size) {
  const uint32_t per = ctx / page_size + 1;
  forward_job job{1, {}, forward_job::decode};
  for (uint32_t b = 0; b < batch; ++b) {
    std::vector<uint32_t> sp(pages.begin() + b * per, pages.begin() + (b + 1) * per);
    job.seqs.push_back(forward_seq{b, {static_cast<int32_t>(b % 1000)}, ctx, sp, false});
    job.seqs.back().sample = seq_sampling{{}, ctx + 1, {}};
  }
  return job;
}

double wall_ms(executor& e, const forward_job& job) {
  const auto t0 = std::chrono::steady_clock::now();
  auto r = run_blocking(e, job);
  const auto t1 = std::chrono::steady_clock::now();
  if (!r.error.empty()) {
    std::fprintf(stderr, "baton_bench_gpu: job failed: %s\n", r.error.c_str());
    std::exit(1);
  }
  return std::chrono::duration<double, std::milli>(t1 - t0).count();
}

struct stream_summary {
  double compute_ms = 0, copy_ms = 0, h2d_ms = 0, send_ms = 0;
};
stream_summary summarise(const std::vector<stream_span>& spans) {
  stream_summary s;
  for (const auto& sp : spans) {
    const double d = sp.end_ms - sp.start_ms;
    if (sp.stream == "compute") s.compute_ms += d;
    if (sp.stream == "copy") s.copy_ms += d;
    if (sp.stream == "copy-h2d") s.h2d_ms += d;
    if (sp.stream == "send") s.send_ms += d;
  }
  return s;
}

void overlap_bench(bool quick, double pinned_big_gbps, double pinned_page_gbps) {
  const uint32_t cached = quick ? 4096 : 30720, fresh = quick ? 512 : 2048, ps = 16;
  auto cfg = llama3_8b_config(cached + fresh + 64);
  cuda_executor_config ec;
  ec.num_kv_pages = (cached + fresh) / ps + 8;
  ec.page_size_tokens = ps;
  ec.max_batch_tokens = fresh;
  ec.random_weights_seed = 11;
  ec.record_timeline = true;
  auto t0 = std::chrono::steady_clock::now();
  auto e = bench_executor(cfg, ec);
  auto* x = dynamic_cast<cuda_executor_extras*>(e.get());
  std::printf("overlap: %s, weights %.1f GB, made in %.1f s\n", e->describe().c_str(), x->weight_bytes() / 1e9,
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  auto& kv = e->kv();
  auto pages = *kv.kv_page_alloc(kv.pages_for_tokens(cached + fresh));
  std::vector<uint32_t> prefix(pages.begin(), pages.begin() + cached / ps);
  // The cached prefix in the host pool: pseudo-random (never zeros), 16 threads.
  {
    std::vector<std::thread> th;
    const uint32_t L = cfg.num_hidden_layers;
    for (unsigned t = 0; t < 16; ++t)
      th.emplace_back([&, t] {
        for (uint32_t l = t; l < L; l += 16)
          for (auto p : prefix) {
            float* f = kv.k_at(l, p, 0);
            uint32_t s = p * 2654435761u + l;
            for (uint64_t i = 0; i < kv.layout().page_bytes() / 4; ++i) {
              s = s * 1664525u + 1013904223u;
              f[i] = static_cast<float>(static_cast<int32_t>(s >> 8) % 2001) * 1e-3f;
            }
          }
      });
    for (auto& t : th) t.join();
  }
  std::vector<int32_t> tokens(fresh);
  for (uint32_t i = 0; i < fresh; ++i) tokens[i] = static_cast<int32_t>((i * 7919u) % cfg.vocab_size);
  const forward_job job{1, {forward_seq{1, tokens, cached, pages, true}}};
  struct variant {
    const char* name;
    bool prefetch, send, flash;
  };
  // The same four again with the tensor-core attention (cuda_executor_config::flash_attention),
  // where attention no longer hides everything else.
  const variant vs[] = {{"resident, no sends", false, false, false},
                        {"resident + per-layer sends", false, true, false},
                        {"prefetched layer by layer, no sends", true, false, false},
                        {"prefetched layer by layer + sends", true, true, false},
                        {"flash: resident, no sends", false, false, true},
                        {"flash: resident + per-layer sends", false, true, true},
                        {"flash: prefetched layer by layer, no sends", true, false, true},
                        {"flash: prefetched layer by layer + sends", true, true, true}};
  std::map<std::string, double> best;
  std::map<std::string, stream_summary> tl;
  (void)wall_ms(*e, job);  // warm-up; uploads the prefix once
  for (int rep = 0; rep < (quick ? 1 : 2); ++rep)
    for (const auto& v : vs) {
      x->set_mirror_to_host(v.send);
      x->set_flash_attention(v.flash);
      if (v.prefetch) kv.note_host_write(prefix);  // the device copy is stale: upload again
      const double ms = wall_ms(*e, job);
      auto s = summarise(x->last_timeline());
      if (!best.count(v.name) || ms < best[v.name]) {
        best[v.name] = ms;
        tl[v.name] = s;
      }
    }
  const double base = best["resident, no sends"];
  const uint64_t prefix_bytes = uint64_t{cfg.num_hidden_layers} * prefix.size() * kv.layout().page_bytes();
  std::printf("\noverlap: Llama-3-8B shape, %u cached + %u new tokens, bf16 (host pool fp32)\n", cached, fresh);
  std::printf("%-40s %10s %12s %12s %12s\n", "variant", "wall ms", "compute ms", "copy ms", "send ms");
  for (const auto& v : vs) {
    const auto& s = tl[v.name];
    std::printf("%-40s %10.1f %12.1f %12.1f %12.1f\n", v.name, best[v.name], s.compute_ms, s.copy_ms, s.send_ms);
    json << "{\"bench\":\"overlap\",\"variant\":\"" << v.name << "\",\"wall_ms\":" << best[v.name]
         << ",\"compute_ms\":" << s.compute_ms << ",\"copy_ms\":" << s.copy_ms << ",\"send_ms\":" << s.send_ms << "}\n";
  }
  const auto& pf = tl["prefetched layer by layer, no sends"];
  const double h2d_gbps = prefix_bytes / (pf.h2d_ms * 1e-3) / 1e9;
  std::printf("prefix upload: %.2f GB fp32; copy stream %.1f ms (%.1f GB/s), of it the PCIe copies %.1f ms = %.1f GB/s "
              "(pinned ceiling %.1f GB/s one large copy, %.1f GB/s 128 KiB copies)\n",
              prefix_bytes / 1e9, pf.copy_ms, prefix_bytes / (pf.copy_ms * 1e-3) / 1e9, pf.h2d_ms, h2d_gbps, pinned_big_gbps,
              pinned_page_gbps);
  row("prefetch / resident (2K new on 30K cached, 8B shape)", fmt("%.3f", best["prefetched layer by layer, no sends"] / base),
      "goal <= 1.10");
  row("sends / no sends (same, prefix resident)", fmt("%.3f", best["resident + per-layer sends"] / base), "goal <= 1.05");
  row("prefill 2K on 30K cached, resident", fmt("%.0f ms", base), "attention-bound: simple CUDA-core kernel");
  const double fbase = best["flash: resident, no sends"];
  row("tensor-core attention: prefetch / resident", fmt("%.3f", best["flash: prefetched layer by layer, no sends"] / fbase),
      "goal <= 1.10");
  row("tensor-core attention: sends / no sends", fmt("%.3f", best["flash: resident + per-layer sends"] / fbase), "goal <= 1.05");
  row("prefill 2K on 30K cached, resident, tensor-core attention", fmt("%.0f ms", fbase),
      fmt("CUDA-core kernel %.0f ms", base));
  row("layer-wise prefix upload, PCIe copies (fp32 pages)", fmt("%.1f GB/s", h2d_gbps),
      fmt("pinned ceiling %.1f GB/s", pinned_big_gbps) + fmt(" (%.0f%%; goal >= 90%%)", 100.0 * h2d_gbps / pinned_big_gbps));
}

/// Runs `step` (returning its wall ms) once to warm up, then four times with every kernel
/// recorded (CUPTI), and prints the kernels' device time per step, longest first: where a step's
/// time goes. Prints why not where CUPTI is missing or refuses.
template <typename Step>
void kernel_breakdown(const std::string& what, const char* json_name, Step&& step) {
#ifdef BATON_HAVE_CUPTI
  step();
  const int steps = 4;
  if (auto why = kernel_trace_start(); !why.empty()) {
    std::printf("kernels of %s: %s\n", what.c_str(), why.c_str());
    return;
  }
  double wall = 0;
  for (int i = 0; i < steps; ++i) wall += step();
  const auto kernels = kernel_trace_stop();
  double busy = 0;
  for (const auto& k : kernels) busy += k.ms;
  std::printf("\nkernels of %s: %.2f ms wall, %.2f ms of kernels (the rest: gaps between them)\n", what.c_str(),
              wall / steps, busy / steps);
  std::printf("%-36s %10s %8s %10s\n", "kernel", "ms/step", "share", "launches");
  for (size_t i = 0; i < kernels.size() && i < 14; ++i) {
    const auto& k = kernels[i];
    std::printf("%-36s %10.3f %7.1f%% %10.1f\n", k.name.substr(0, 36).c_str(), k.ms / steps, 100.0 * k.ms / busy,
                static_cast<double>(k.launches) / steps);
    json << "{\"bench\":\"" << json_name << "\",\"what\":\"" << what << "\",\"kernel\":\"" << k.name
         << "\",\"ms_per_step\":" << k.ms / steps << ",\"launches_per_step\":" << static_cast<double>(k.launches) / steps
         << "}\n";
  }
#else
  (void)step;
  std::printf("kernels of %s: built without CUPTI\n", what.c_str());
#endif
}

void decode_and_prefill_bench(bool quick, double read_bw_gbps, double gemm_rate) {
  const uint32_t ps = 16;
  struct point {
    uint32_t batch, ctx;
  };
  std::vector<point> pts = quick ? std::vector<point>{{1, 1024}, {8, 1024}}
                                 : std::vector<point>{{1, 1024}, {8, 1024}, {32, 1024}, {128, 1024},
                                                      {1, 8192}, {8, 8192}, {32, 8192}, {64, 8192}};
  uint32_t need = 0;
  for (auto p : pts) need = std::max(need, p.batch * (p.ctx / ps + 1));
  const uint32_t longest = quick ? 8192 : 32768;  // the longest prefill below
  auto cfg = llama3_8b_config(longest + 64);
  cuda_executor_config ec;
  ec.num_kv_pages = std::max(need, longest / ps + 8);
  ec.max_batch_tokens = longest;
  ec.random_weights_seed = 12;
  ec.host_pool = false;
  ec.mirror_to_host = false;
  ec.record_timeline = true;  // to split a step's wall time into GPU compute and the rest
  auto e = bench_executor(cfg, ec);
  auto* x = dynamic_cast<cuda_executor_extras*>(e.get());
  auto& kv = e->kv();
  std::vector<uint32_t> all(ec.num_kv_pages);
  for (uint32_t i = 0; i < all.size(); ++i) all[i] = i;
  auto pages = *kv.kv_page_alloc(ec.num_kv_pages);
  if (auto err = x->fill_device_kv_random(pages, 5); !err.empty()) {
    std::fprintf(stderr, "baton_bench_gpu: %s\n", err.c_str());
    std::exit(1);
  }
  const double kv_token_bytes = 2.0 * cfg.num_hidden_layers * cfg.kv_dim() * 2;  // bf16 K and V, all layers
  std::printf("\ndecode step, Llama-3-8B shape, bf16, weights %.2f GB; HBM read ceiling %.0f GB/s\n",
              x->weight_bytes() / 1e9, read_bw_gbps);
  std::printf("%6s %6s %12s %12s %8s %14s %12s %12s\n", "batch", "ctx", "step ms", "floor ms", "ratio", "layers' GPU ms",
              "launched ms", "graph ms");
  for (auto p : pts) {
    const auto job = decode_job(pages, p.batch, p.ctx, ps);
    std::vector<double> t, gpu;
    for (int i = 0; i < (quick ? 3 : 8); ++i) {
      const double ms = wall_ms(*e, job);
      if (i >= 2) {
        t.push_back(ms);
        gpu.push_back(summarise(x->last_timeline()).compute_ms);
      }
    }
    const double floor = (x->weight_bytes() + kv_token_bytes * p.batch * (p.ctx + 1)) / (read_bw_gbps * 1e9) * 1e3;
    const double ms = median(t);
    // The same step without the timeline's events: launched kernel by kernel, then as one
    // CUDA graph launch (cuda_graphs; its first two runs launch and capture).
    x->set_record_timeline(false);
    double plain_ms[2];
    for (int graphs = 0; graphs < 2; ++graphs) {
      x->set_cuda_graphs(graphs == 1);
      std::vector<double> tg;
      for (int i = 0; i < (quick ? 4 : 7); ++i) {
        const double one = wall_ms(*e, job);
        if (i >= 2) tg.push_back(one);
      }
      plain_ms[graphs] = median(tg);
    }
    x->set_cuda_graphs(false);
    x->set_record_timeline(true);
    std::printf("%6u %6u %12.2f %12.2f %8.2f %14.2f %12.2f %12.2f\n", p.batch, p.ctx, ms, floor, ms / floor, median(gpu),
                plain_ms[0], plain_ms[1]);
    json << "{\"bench\":\"decode\",\"batch\":" << p.batch << ",\"ctx\":" << p.ctx << ",\"step_ms\":" << ms
         << ",\"floor_ms\":" << floor << ",\"layers_gpu_ms\":" << median(gpu) << ",\"launched_ms\":" << plain_ms[0]
         << ",\"graph_ms\":" << plain_ms[1] << "}\n";
    row("decode step, batch " + std::to_string(p.batch) + ", ctx " + std::to_string(p.ctx), fmt("%.2f ms", ms),
        fmt("HBM floor %.2f ms", floor) + fmt(" (x%.2f; goal <= 1.3)", ms / floor));
    row("  the same, launched / one CUDA graph (no timeline)", fmt("%.2f / ", plain_ms[0]) + fmt("%.2f ms", plain_ms[1]),
        fmt("graph x%.2f of the floor", plain_ms[1] / floor));
  }
  std::printf("graph launches: %llu\n", static_cast<unsigned long long>(x->graph_replays()));
  // Where a step's time goes: every kernel of a few steps, launched (no graph, no timeline).
  x->set_record_timeline(false);
  for (auto p : {pts.front(), pts.back()}) {
    const auto job = decode_job(pages, p.batch, p.ctx, ps);
    kernel_breakdown("a decode step, batch " + std::to_string(p.batch) + ", ctx " + std::to_string(p.ctx),
                     "decode_kernels", [&] { return wall_ms(*e, job); });
  }
  x->set_record_timeline(true);
  // Prefill from scratch: matrix-product FLOPs (2 per weight per token, LM head on the last
  // token only) and causal attention FLOPs (4·d per (query, key) pair, half the square).
  const double layer_params = double(cfg.hidden_size) * (cfg.q_dim() + 2 * cfg.kv_dim()) +
                              double(cfg.q_dim()) * cfg.hidden_size + 3.0 * cfg.hidden_size * cfg.intermediate_size;
  for (uint32_t n : quick ? std::vector<uint32_t>{1024} : std::vector<uint32_t>{1024, 8192, 32768}) {
    std::vector<int32_t> tokens(n);
    for (uint32_t i = 0; i < n; ++i) tokens[i] = static_cast<int32_t>((i * 104729u) % cfg.vocab_size);
    std::vector<uint32_t> sp(pages.begin(), pages.begin() + n / ps);
    const forward_job job{1, {forward_seq{1, tokens, 0, sp, true}}};
    for (const bool flash : {false, true}) {
      if (!flash && n > 8192) continue;  // the CUDA-core kernel would take minutes
      x->set_flash_attention(flash);
      const char* kernel = flash ? "tensor-core attention" : "CUDA-core attention";
      std::vector<double> t;
      for (int i = 0; i < 3; ++i) t.push_back(wall_ms(*e, job));
      const double ms = median(t);
      const double mm = 2.0 * layer_params * cfg.num_hidden_layers * n + 2.0 * cfg.hidden_size * cfg.vocab_size;
      const double at = 4.0 * cfg.num_hidden_layers * cfg.q_dim() * (double(n) * (n + 1) / 2);
      const double tf = (mm + at) / (ms * 1e-3) / 1e12;
      std::printf("prefill %5u tokens, %s: %.1f ms, %.1f TFLOP/s (%.0f%% matrix products by FLOPs), GEMM ceiling %.0f "
                  "TFLOP/s\n",
                  n, kernel, ms, tf, 100.0 * mm / (mm + at), gemm_rate);
      json << "{\"bench\":\"prefill\",\"tokens\":" << n << ",\"flash\":" << flash << ",\"ms\":" << ms
           << ",\"tflops\":" << tf << "}\n";
      row("prefill " + std::to_string(n) + " tokens from scratch, " + kernel, fmt("%.1f TFLOP/s", tf) + fmt(" (%.0f ms)", ms),
          fmt("cuBLAS bf16 GEMM %.0f TFLOP/s", gemm_rate) + fmt(" (%.0f%%)", 100.0 * tf / gemm_rate));
      // Matrix products against attention, kernel by kernel (issue 12 asks for the split).
      if (flash && n == 8192)
        kernel_breakdown("a prefill of 8192 tokens, tensor-core attention", "prefill_kernels",
                         [&] { return wall_ms(*e, job); });
    }
    x->set_flash_attention(false);
  }
}

/// A decode rank's step with its host pool mirrored, as served (the store's write-back and
/// migrations read the host pool): no mirror, whole pages (16 slots per new row), and slot by
/// slot (cuda_executor_config::mirror_rows).
void decode_mirror_bench(bool quick) {
  const uint32_t ps = 16, batch = quick ? 8 : 32, ctx = 1024, per = ctx / ps + 1;
  auto cfg = llama3_8b_config(ctx + 64);
  cuda_executor_config ec;
  ec.num_kv_pages = batch * per;
  ec.page_size_tokens = ps;
  ec.max_batch_tokens = 256;
  ec.random_weights_seed = 13;
  ec.record_timeline = true;
  auto t0 = std::chrono::steady_clock::now();
  auto e = bench_executor(cfg, ec);
  auto* x = dynamic_cast<cuda_executor_extras*>(e.get());
  auto& kv = e->kv();
  auto pages = *kv.kv_page_alloc(ec.num_kv_pages);
  if (auto err = x->fill_device_kv_random(pages, 6); !err.empty()) {
    std::fprintf(stderr, "baton_bench_gpu: %s\n", err.c_str());
    std::exit(1);
  }
  x->set_mirror_rows(true);
  const bool rows_possible = x->mirrors_rows();
  std::printf("\ndecode step with the host pool mirrored: batch %u, ctx %u, %s, host pool %.1f GB (ready in %.1f s)%s\n",
              batch, ctx, e->describe().c_str(), kv.size_bytes() / 1e9,
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(),
              rows_possible ? "" : "; the pool could not be mapped: no slot-by-slot mirror");
  const auto job = decode_job(pages, batch, ctx, ps);
  struct variant {
    const char* name;
    bool mirror, rows;
  };
  std::map<std::string, std::pair<double, double>> got;  // step ms, send stream ms
  for (const variant v : {variant{"no mirror", false, false}, variant{"whole pages", true, false},
                          variant{"slot by slot", true, true}}) {
    if (v.rows && !rows_possible) continue;
    x->set_mirror_to_host(v.mirror);
    x->set_mirror_rows(v.rows);
    std::vector<double> t, send;
    for (int i = 0; i < (quick ? 3 : 8); ++i) {
      const double ms = wall_ms(*e, job);
      if (i >= 2) {
        t.push_back(ms);
        send.push_back(summarise(x->last_timeline()).send_ms);
      }
    }
    got[v.name] = {median(t), median(send)};
    std::printf("  %-14s step %.2f ms, send stream %.2f ms\n", v.name, median(t), median(send));
    json << "{\"bench\":\"decode_mirror\",\"variant\":\"" << v.name << "\",\"batch\":" << batch
         << ",\"step_ms\":" << median(t) << ",\"send_ms\":" << median(send) << "}\n";
  }
  const double off = got["no mirror"].first;
  row("decode step + mirror, batch " + std::to_string(batch) + " ctx 1K: whole pages", fmt("%.2f ms", got["whole pages"].first),
      fmt("no mirror %.2f ms", off));
  if (rows_possible)
    row("decode step + mirror, batch " + std::to_string(batch) + " ctx 1K: slot by slot",
        fmt("%.2f ms", got["slot by slot"].first), fmt("no mirror %.2f ms", off));
}

/// A DeepSeek-V3-shaped decode step and prefill (issue 14's CUDA path): V3's widths, 128 heads of
/// latent attention and 256 routed experts, but 3 layers (1 dense, 2 MoE) so the weights fit one
/// GPU, random bf16 weights. The decode floor reads every non-expert weight, the experts a batch
/// is expected to touch under uniform routing (E·(1 − (1 − k/E)^B) per MoE layer: random
/// weights route about uniformly; the group limit is ignored) and the batch's latents. Prefill
/// is priced by its matrix products over the active parameters (2 FLOP each per token, attention
/// scores excluded) against the same run's cuBLAS rate.
void deepseek_bench(bool quick, double read_bw_gbps, double gemm_rate) {
  const uint32_t ps = 16, ctx = 1024, per = ctx / ps + 1;
  std::vector<uint32_t> batches = quick ? std::vector<uint32_t>{1, 32} : std::vector<uint32_t>{1, 8, 32, 128};
  auto cfg = deepseek_v3_config();
  cfg.num_hidden_layers = 3;
  cfg.moe.first_k_dense_replace = 1;
  cuda_executor_config ec;
  ec.num_kv_pages = batches.back() * per;
  ec.page_size_tokens = ps;
  ec.max_batch_tokens = quick ? 1024 : 4096;  // the prefills below
  ec.random_weights_seed = 14;
  ec.host_pool = false;
  ec.mirror_to_host = false;
  // Written without a GPU: a failure here is reported and ends this part only; main runs it
  // last, with the other parts' figures already on file.
  const auto t0 = std::chrono::steady_clock::now();
  std::string why;
  auto e = make_cuda_executor(cfg, nullptr, ec, &why);
  auto* x = dynamic_cast<cuda_executor_extras*>(e.get());
  if (!e || !x) {
    std::printf("\nDeepSeek-V3-shaped decode: the executor did not start: %s\n", why.c_str());
    return;
  }
  auto pages = *e->kv().kv_page_alloc(ec.num_kv_pages);
  if (auto err = x->fill_device_kv_random(pages, 7); !err.empty()) {
    std::printf("\nDeepSeek-V3-shaped decode: %s\n", err.c_str());
    return;
  }
  const auto& m = cfg.moe;
  const double expert_bytes = 3.0 * m.moe_intermediate_size * cfg.hidden_size * 2, moe_layers = 2;
  const double embed_bytes = 2.0 * cfg.vocab_size * cfg.hidden_size;  // gathered row by row, not streamed
  const double fixed = x->weight_bytes() - embed_bytes - moe_layers * m.n_routed_experts * expert_bytes;
  std::printf("\ndecode step, DeepSeek-V3 shape with 3 layers (1 dense, 2 MoE), bf16, weights %.1f GB (ready in %.1f s), "
              "ctx %u; HBM read ceiling %.0f GB/s\n",
              x->weight_bytes() / 1e9, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), ctx,
              read_bw_gbps);
  // The routed experts' grouped products on CUDA cores, then on the tensor cores
  // (cuda_executor_config::moe_tensor_cores, the default).
  for (bool tc : {false, true}) {
    x->set_moe_tensor_cores(tc);
    const std::string how = tc ? ", experts on tensor cores" : ", experts on CUDA cores";
    std::printf("%s\n", how.c_str() + 2);
    for (uint32_t b : batches) {
      const auto job = decode_job(pages, b, ctx, ps);
      std::vector<double> t;
      for (int i = 0; i < (quick ? 3 : 6); ++i) {
        const auto s0 = std::chrono::steady_clock::now();
        const auto r = run_blocking(*e, job);
        if (!r.error.empty()) {
          std::printf("  batch %u: the step failed: %s\n", b, r.error.c_str());
          return;
        }
        if (i >= 2) t.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - s0).count());
      }
      const double touched = m.n_routed_experts * (1.0 - std::pow(1.0 - double(m.num_experts_per_tok) / m.n_routed_experts, b));
      const double bytes = fixed + moe_layers * touched * expert_bytes + 2.0 * b * (ctx + 1) * cfg.kv_dim() * cfg.num_hidden_layers;
      const double floor = bytes / (read_bw_gbps * 1e9) * 1e3, ms = median(t);
      std::printf("  batch %4u: step %.2f ms, floor %.2f ms (%.1fx), experts touched per MoE layer ~%.0f\n", b, ms, floor,
                  ms / floor, touched);
      row("DeepSeek-V3 shape (3 layers) decode, batch " + std::to_string(b) + " ctx 1K" + how, fmt("%.2f ms", ms),
          fmt("HBM floor %.2f ms", floor) + fmt(" (%.1fx)", ms / floor));
      json << "{\"bench\":\"deepseek_decode\",\"tensor_cores\":" << tc << ",\"batch\":" << b << ",\"ctx\":" << ctx << ",\"step_ms\":" << ms
           << ",\"floor_ms\":" << floor << "}\n";
      if (tc && (b == batches.front() || b == batches.back()))
        kernel_breakdown("a DeepSeek-V3-shaped decode step, batch " + std::to_string(b), "deepseek_kernels", [&] {
          const auto s0 = std::chrono::steady_clock::now();
          run_blocking(*e, job);
          return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - s0).count();
        });
    }
    // Prefill from scratch: one sequence of n tokens in one job.
    // Bytes of weights every token goes through (the LM head only for the last one: left out).
    const double active = fixed - 2.0 * cfg.vocab_size * cfg.hidden_size + moe_layers * m.num_experts_per_tok * expert_bytes;
    for (uint32_t n : quick ? std::vector<uint32_t>{1024} : std::vector<uint32_t>{1024, 4096}) {
      forward_job job{2, {}, forward_job::prefill};
      std::vector<int32_t> tokens(n);
      for (uint32_t i = 0; i < n; ++i) tokens[i] = static_cast<int32_t>(i % 1000);
      job.seqs.push_back(forward_seq{1, tokens, 0, std::vector<uint32_t>(pages.begin(), pages.begin() + n / ps + 1), false});
      job.seqs.back().sample = seq_sampling{{}, n, {}};
      std::vector<double> t;
      for (int i = 0; i < 3; ++i) {
        const auto s0 = std::chrono::steady_clock::now();
        const auto r = run_blocking(*e, job);
        if (!r.error.empty()) {
          std::printf("  prefill %u: failed: %s\n", n, r.error.c_str());
          return;
        }
        if (i >= 1) t.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - s0).count());
      }
      const double ms = median(t), tflops = active / 2 * 2 * n / (ms * 1e-3) / 1e12;  // bf16: bytes / 2 parameters
      std::printf("  prefill %u tokens: %.1f ms, %.1f TFLOP/s over the active parameters' products\n", n, ms, tflops);
      row("DeepSeek-V3 shape (3 layers) prefill " + std::to_string(n) + " tokens" + how,
          fmt("%.1f TFLOP/s", tflops) + fmt(" (%.0f ms)", ms),
          fmt("cuBLAS bf16 GEMM %.0f TFLOP/s", gemm_rate) + fmt(" (%.0f%%)", 100.0 * tflops / gemm_rate));
      json << "{\"bench\":\"deepseek_prefill\",\"tensor_cores\":" << tc << ",\"tokens\":" << n << ",\"ms\":" << ms << ",\"tflops\":" << tflops << "}\n";
      if (tc && n == 1024)
        kernel_breakdown("a DeepSeek-V3-shaped prefill of 1024 tokens", "deepseek_kernels", [&] {
          const auto s0 = std::chrono::steady_clock::now();
          run_blocking(*e, job);
          return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - s0).count();
        });
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  // Line by line into the device script's pipe: a run cut short by its timeout keeps what it printed.
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  bool quick = false;
  std::string json_path;
  baton::deploy::flag_set flags;
  flags.add("--quick", &quick, "fewer repetitions");
  flags.add("--json", &json_path, "also write the figures to this file");
  if (auto rc = baton::bench::parse_flags(flags, argc, argv, "[--quick] [--json FILE]")) return *rc;
  if (cuda::device_count() == 0) {
    std::printf("baton_bench_gpu: no CUDA device; nothing measured\n");
    return 2;
  }
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  std::printf("device: %s, %d SMs, %.0f GB\n", prop.name, prop.multiProcessorCount, prop.totalGlobalMem / 1e9);
  const double gemm = gemm_tflops(8192, 8192, 8192, quick ? 3 : 10);
  const double rd = read_gbps(uint64_t{4} << 30);
  const double h2d_big = h2d_gbps(uint64_t{1} << 30, uint64_t{1} << 30);
  const double h2d_page = h2d_gbps(uint64_t{1} << 30, 128 << 10);
  std::printf("ceilings: cuBLAS bf16 GEMM 8192^3 %.0f TFLOP/s; read-only HBM %.0f GB/s; pinned H2D %.1f GB/s (1 GiB copy), "
              "%.1f GB/s (128 KiB copies)\n",
              gemm, rd, h2d_big, h2d_page);
  json << "{\"bench\":\"ceilings\",\"gemm_tflops\":" << gemm << ",\"read_gbps\":" << rd << ",\"h2d_gbps\":" << h2d_big
       << ",\"h2d_128k_gbps\":" << h2d_page << "}\n";
  row("ceiling: cuBLAS bf16 GEMM 8192^3", fmt("%.0f TFLOP/s", gemm), "");
  row("ceiling: read-only HBM bandwidth", fmt("%.0f GB/s", rd), "");
  row("ceiling: pinned host->device, 1 GiB / 128 KiB copies", fmt("%.1f / ", h2d_big) + fmt("%.1f GB/s", h2d_page), "");
  overlap_bench(quick, h2d_big, h2d_page);
  gemv_bench(quick, rd);
  decode_and_prefill_bench(quick, rd, gemm);
  decode_mirror_bench(quick);
  invariant_gemm_bench(quick);
  // DeepSeek's path last, written without a GPU: a sticky CUDA error there must not cost the
  // figures above, so they are on file before it starts.
  if (!json_path.empty()) std::ofstream{json_path} << json.str();
  deepseek_bench(quick, rd, gemm);
  std::printf("\n| %-58s | %-30s | %-40s |\n", "measure", "value", "against");
  for (const auto& r : summary) std::printf("%s\n", r.c_str());
  if (!json_path.empty()) std::ofstream{json_path} << json.str();
  return 0;
}
