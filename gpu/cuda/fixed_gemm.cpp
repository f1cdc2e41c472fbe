#include "gpu/cuda/fixed_gemm.hpp"

#include "gpu/cuda/blas_library.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <tuple>
#include <vector>

namespace baton::gpu::cuda {

namespace {

/// cuBLASLt, loaded by fixed_gemm::create before anything here runs.
const blas_library& blas() { return *load_blas(nullptr); }

/// The smallest row count of a bucket (the first also takes the few rows the weight-streaming
/// kernel cannot: inputs too wide for its shared memory).
uint32_t bucket_floor(uint32_t bucket) { return bucket == 64 ? 1 : bucket == 512 ? 65 : 513; }

/// The three layouts of one product, column-major as cuBLASLt sees row-major a, w and y:
/// yᵀ[n][m] = (w[n][k]ᵀ)ᵀ · aᵀ, i.e. TRANSA = T over w stored k x n.
struct layouts {
  cublasLtMatrixLayout_t w = nullptr, a = nullptr, y = nullptr;
  layouts(cudaDataType_t t, uint32_t m, uint32_t n, uint32_t k) {
    blas().cublasLtMatrixLayoutCreate(&w, t, k, n, k);
    blas().cublasLtMatrixLayoutCreate(&a, t, k, m, k);
    blas().cublasLtMatrixLayoutCreate(&y, CUDA_R_32F, n, m, n);
  }
  ~layouts() {
    for (auto l : {w, a, y})
      if (l) blas().cublasLtMatrixLayoutDestroy(l);
  }
  layouts(const layouts&) = delete;
  layouts& operator=(const layouts&) = delete;
};

struct plan {
  cublasLtMatmulAlgo_t algo{};
  size_t workspace = 0;  ///< bytes the algorithm needs (0 unless no candidate ran without)
  bool ok = false;
  std::string why;  ///< when not ok
};

/// Why candidates were turned down, for the sentence a failed search returns: the next device
/// run then says what to change.
struct tally {
  int offered = 0, failed_big = 0, failed_small = 0, too_much_workspace = 0;
  int big_status = 0, small_status = 0;
  std::string words() const {
    return std::to_string(offered) + " candidates: " + std::to_string(failed_big) + " refused at the largest size" +
           (failed_big ? " (status " + std::to_string(big_status) + ")" : "") + ", " + std::to_string(failed_small) +
           " at the smallest" + (failed_small ? " (status " + std::to_string(small_status) + ")" : "") + ", " +
           std::to_string(too_much_workspace) + " needing more workspace than allowed";
  }
};

bool same_config(const cublasLtMatmulAlgo_t& x, const cublasLtMatmulAlgo_t& y) {
  return std::memcmp(&x, &y, sizeof x) == 0;
}

}  // namespace

struct fixed_gemm::impl {
  /// The most workspace a plan may use. Tried only where no candidate runs without: a kernel
  /// given split-K 1 and no reduction sums each output in its tile's order, but what else a
  /// workspace holds is cuBLASLt's business, so the conformance case checks the bits per bucket.
  static constexpr size_t max_workspace = size_t{32} << 20;  // NVIDIA's advice for Hopper

  cudaDataType_t type = CUDA_R_16BF;
  cublasLtHandle_t lt = nullptr;
  cublasLtMatmulDesc_t op = nullptr;  ///< fp32 compute and scale, TRANSA = T
  std::map<std::tuple<uint32_t, uint32_t, uint32_t>, plan> plans;  ///< (n, k, bucket)
  void* workspace = nullptr;  ///< max_workspace bytes, made when a plan first needs it

  ~impl() {
    if (workspace) cudaFree(workspace);
    if (op) blas().cublasLtMatmulDescDestroy(op);
    if (lt) blas().cublasLtDestroy(lt);
  }

  /// The heuristic's candidates for one layout within a workspace limit, appended to `out`
  /// unless already there.
  void candidates(const layouts& l, uint64_t workspace_limit, std::vector<cublasLtMatmulAlgo_t>* out) {
    cublasLtMatmulPreference_t pref = nullptr;
    if (blas().cublasLtMatmulPreferenceCreate(&pref) != CUBLAS_STATUS_SUCCESS) return;
    blas().cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace_limit,
                                         sizeof workspace_limit);
    cublasLtMatmulHeuristicResult_t found[32];
    int count = 0;
    if (blas().cublasLtMatmulAlgoGetHeuristic(lt, op, l.w, l.a, l.y, l.y, pref, 32, found, &count) == CUBLAS_STATUS_SUCCESS)
      for (int i = 0; i < count; ++i)
        if (found[i].state == CUBLAS_STATUS_SUCCESS &&
            std::none_of(out->begin(), out->end(), [&](const auto& a) { return same_config(a, found[i].algo); }))
          out->push_back(found[i].algo);
    blas().cublasLtMatmulPreferenceDestroy(pref);
  }

  /// One algorithm for a (weight shape, row bucket). Candidates: the heuristic's picks at the
  /// bucket's largest and smallest sizes, without workspace first. Each is given split-K 1 and
  /// no reduction (nothing that sums over k in an order the grid decides) and must run at both
  /// sizes. The first that needs no workspace wins; failing that, the one needing least.
  const plan& plan_for(uint32_t n, uint32_t k, uint32_t bucket) {
    const auto key = std::make_tuple(n, k, bucket);
    if (auto i = plans.find(key); i != plans.end()) return i->second;
    plan& p = plans[key];
    const layouts big{type, bucket, n, k}, small{type, bucket_floor(bucket), n, k};
    std::vector<cublasLtMatmulAlgo_t> found;
    candidates(big, 0, &found);
    candidates(small, 0, &found);
    candidates(big, max_workspace, &found);
    candidates(small, max_workspace, &found);
    tally t;
    t.offered = static_cast<int>(found.size());
    const int32_t one_split = 1;
    const uint32_t no_reduction = CUBLASLT_REDUCTION_SCHEME_NONE;
    for (auto algo : found) {
      blas().cublasLtMatmulAlgoConfigSetAttribute(&algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &one_split, sizeof one_split);
      blas().cublasLtMatmulAlgoConfigSetAttribute(&algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &no_reduction, sizeof no_reduction);
      cublasLtMatmulHeuristicResult_t at_big{}, at_small{};
      if (auto rc = blas().cublasLtMatmulAlgoCheck(lt, op, big.w, big.a, big.y, big.y, &algo, &at_big); rc != CUBLAS_STATUS_SUCCESS) {
        ++t.failed_big, t.big_status = rc;
        continue;
      }
      if (auto rc = blas().cublasLtMatmulAlgoCheck(lt, op, small.w, small.a, small.y, small.y, &algo, &at_small);
          rc != CUBLAS_STATUS_SUCCESS) {
        ++t.failed_small, t.small_status = rc;
        continue;
      }
      const size_t need = std::max(at_big.workspaceSize, at_small.workspaceSize);
      if (need > max_workspace) {
        ++t.too_much_workspace;
        continue;
      }
      if (!p.ok || need < p.workspace) p.algo = algo, p.workspace = need, p.ok = true;
      if (need == 0) break;
    }
    // Made with the first plan, whether or not it needs any (see run()): 32 MiB of 141 GiB. A plan
    // that needs none runs without it where there is no room for it.
    if (p.ok && !workspace && cudaMalloc(&workspace, max_workspace) != cudaSuccess) {
      workspace = nullptr;
      cudaGetLastError();  // not sticky: the next launch must not report it
      if (p.workspace == 0) return p;
      p.ok = false;
      p.why = "no device memory for cuBLASLt's workspace of " + std::to_string(max_workspace >> 20) + " MiB";
      return p;
    }
    if (!p.ok)
      p.why = "cuBLASLt offers no algorithm without split-K for a " + std::to_string(n) + "x" + std::to_string(k) +
              " weight and " + std::to_string(bucket_floor(bucket)) + " to " + std::to_string(bucket) + " rows (" +
              t.words() + ")";
    return p;
  }
};

fixed_gemm::fixed_gemm(std::unique_ptr<impl> p) : impl_(std::move(p)) {}
fixed_gemm::~fixed_gemm() = default;

std::unique_ptr<fixed_gemm> fixed_gemm::create(dtype type, std::string* why) {
  if (!load_blas(why)) return nullptr;
  auto p = std::make_unique<impl>();
  p->type = type == dtype::bf16 ? CUDA_R_16BF : CUDA_R_32F;
  if (blas().cublasLtCreate(&p->lt) != CUBLAS_STATUS_SUCCESS ||
      blas().cublasLtMatmulDescCreate(&p->op, CUBLAS_COMPUTE_32F, CUDA_R_32F) != CUBLAS_STATUS_SUCCESS) {
    *why = "cuBLASLt could not start";
    return nullptr;
  }
  const cublasOperation_t transposed = CUBLAS_OP_T, plain = CUBLAS_OP_N;
  blas().cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSA, &transposed, sizeof transposed);
  blas().cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSB, &plain, sizeof plain);
  return std::unique_ptr<fixed_gemm>(new fixed_gemm(std::move(p)));
}

uint32_t fixed_gemm::row_bucket(uint32_t m) {
  for (uint32_t edge : {64u, 512u})
    if (m <= edge) return edge;
  return 8192;
}

std::string fixed_gemm::run(const void* a, const void* w, float* y, uint32_t m, uint32_t n, uint32_t k, float beta,
                            void* stream) {
  const auto& p = impl_->plan_for(n, k, row_bucket(m));
  if (!p.ok) return p.why;
  const float alpha = 1.0f;
  const layouts l{impl_->type, m, n, k};
  // One workspace for every plan: products run one at a time on the caller's stream. Every plan
  // gets all of it: needs were measured at the bucket's edges only, and a row count between them
  // may need more (a stream-K schedule sizes its partials by the grid).
  const auto rc = blas().cublasLtMatmul(impl_->lt, impl_->op, &alpha, w, l.w, a, l.a, &beta, y, l.y, y, l.y, &p.algo,
                                 impl_->workspace, impl_->workspace ? impl::max_workspace : 0,
                                 static_cast<cudaStream_t>(stream));
  if (rc == CUBLAS_STATUS_SUCCESS) return {};
  return "cuBLASLt matmul of " + std::to_string(m) + "x" + std::to_string(n) + "x" + std::to_string(k) +
         " failed (status " + std::to_string(rc) + ")";
}

std::string fixed_gemm::describe(uint32_t m, uint32_t n, uint32_t k) {
  const auto& p = impl_->plan_for(n, k, row_bucket(m));
  if (!p.ok) return p.why;
  auto get = [&](cublasLtMatmulAlgoConfigAttributes_t attr) {
    uint32_t v = 0;
    size_t written = 0;
    blas().cublasLtMatmulAlgoConfigGetAttribute(&p.algo, attr, &v, sizeof v, &written);
    return std::to_string(v);
  };
  int32_t split = 0;
  size_t written = 0;
  blas().cublasLtMatmulAlgoConfigGetAttribute(&p.algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &split, sizeof split, &written);
  return "algo " + get(CUBLASLT_ALGO_CONFIG_ID) + ", tile " + get(CUBLASLT_ALGO_CONFIG_TILE_ID) + ", stages " +
         get(CUBLASLT_ALGO_CONFIG_STAGES_ID) + ", split-K " + std::to_string(split) + ", bucket " +
         std::to_string(row_bucket(m)) + (p.workspace ? ", workspace " + std::to_string(p.workspace) + " B" : "");
}

}  // namespace baton::gpu::cuda
