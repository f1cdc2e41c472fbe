#include "gpu/cuda/fixed_gemm.hpp"

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <map>
#include <tuple>

namespace baton::gpu::cuda {

namespace {

/// The smallest row count of a bucket (the first also takes the few rows the weight-streaming
/// kernel cannot: inputs too wide for its shared memory).
uint32_t bucket_floor(uint32_t bucket) { return bucket == 64 ? 1 : bucket == 512 ? 65 : 513; }

/// The three layouts of one product, column-major as cuBLASLt sees row-major a, w and y:
/// yᵀ[n][m] = (w[n][k]ᵀ)ᵀ · aᵀ, i.e. TRANSA = T over w stored k x n.
struct layouts {
  cublasLtMatrixLayout_t w = nullptr, a = nullptr, y = nullptr;
  layouts(cudaDataType_t t, uint32_t m, uint32_t n, uint32_t k) {
    cublasLtMatrixLayoutCreate(&w, t, k, n, k);
    cublasLtMatrixLayoutCreate(&a, t, k, m, k);
    cublasLtMatrixLayoutCreate(&y, CUDA_R_32F, n, m, n);
  }
  ~layouts() {
    for (auto l : {w, a, y})
      if (l) cublasLtMatrixLayoutDestroy(l);
  }
  layouts(const layouts&) = delete;
  layouts& operator=(const layouts&) = delete;
};

struct plan {
  cublasLtMatmulAlgo_t algo{};
  bool ok = false;
  std::string why;  ///< when not ok
};

}  // namespace

struct fixed_gemm::impl {
  cudaDataType_t type = CUDA_R_16BF;
  cublasLtHandle_t lt = nullptr;
  cublasLtMatmulDesc_t op = nullptr;  ///< fp32 compute and scale, TRANSA = T
  std::map<std::tuple<uint32_t, uint32_t, uint32_t>, plan> plans;  ///< (n, k, bucket)

  ~impl() {
    if (op) cublasLtMatmulDescDestroy(op);
    if (lt) cublasLtDestroy(lt);
  }

  const plan& plan_for(uint32_t n, uint32_t k, uint32_t bucket) {
    const auto key = std::make_tuple(n, k, bucket);
    if (auto i = plans.find(key); i != plans.end()) return i->second;
    plan& p = plans[key];
    cublasLtMatmulPreference_t pref = nullptr;
    cublasLtMatmulPreferenceCreate(&pref);
    // No workspace: split-K's partial sums and stream-K's fix-ups both need one. (A reduction
    // scheme mask of NONE, which is 0, might filter out every candidate, so none is set.)
    const uint64_t no_workspace = 0;
    const uint32_t no_reduction = CUBLASLT_REDUCTION_SCHEME_NONE;
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &no_workspace, sizeof no_workspace);
    const layouts big{type, bucket, n, k}, small{type, bucket_floor(bucket), n, k};
    cublasLtMatmulHeuristicResult_t found[16];
    int count = 0;
    const auto rc = cublasLtMatmulAlgoGetHeuristic(lt, op, big.w, big.a, big.y, big.y, pref, 16, found, &count);
    cublasLtMatmulPreferenceDestroy(pref);
    for (int i = 0; rc == CUBLAS_STATUS_SUCCESS && i < count && !p.ok; ++i) {
      if (found[i].state != CUBLAS_STATUS_SUCCESS) continue;
      auto algo = found[i].algo;
      const int32_t one_split = 1;
      cublasLtMatmulAlgoConfigSetAttribute(&algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &one_split, sizeof one_split);
      cublasLtMatmulAlgoConfigSetAttribute(&algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &no_reduction, sizeof no_reduction);
      cublasLtMatmulHeuristicResult_t check{};
      if (cublasLtMatmulAlgoCheck(lt, op, big.w, big.a, big.y, big.y, &algo, &check) != CUBLAS_STATUS_SUCCESS ||
          check.workspaceSize > 0 ||
          cublasLtMatmulAlgoCheck(lt, op, small.w, small.a, small.y, small.y, &algo, &check) != CUBLAS_STATUS_SUCCESS ||
          check.workspaceSize > 0)
        continue;
      p.algo = algo;
      p.ok = true;
    }
    if (!p.ok)
      p.why = "cuBLASLt offers no algorithm without split-K or workspace for a " + std::to_string(n) + "x" +
              std::to_string(k) + " weight and " + std::to_string(bucket_floor(bucket)) + " to " + std::to_string(bucket) +
              " rows (heuristic status " + std::to_string(rc) + ", " + std::to_string(count) + " candidates)";
    return p;
  }
};

fixed_gemm::fixed_gemm(std::unique_ptr<impl> p) : impl_(std::move(p)) {}
fixed_gemm::~fixed_gemm() = default;

std::unique_ptr<fixed_gemm> fixed_gemm::create(dtype type, std::string* why) {
  auto p = std::make_unique<impl>();
  p->type = type == dtype::bf16 ? CUDA_R_16BF : CUDA_R_32F;
  if (cublasLtCreate(&p->lt) != CUBLAS_STATUS_SUCCESS ||
      cublasLtMatmulDescCreate(&p->op, CUBLAS_COMPUTE_32F, CUDA_R_32F) != CUBLAS_STATUS_SUCCESS) {
    *why = "cuBLASLt could not start";
    return nullptr;
  }
  const cublasOperation_t transposed = CUBLAS_OP_T, plain = CUBLAS_OP_N;
  cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSA, &transposed, sizeof transposed);
  cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSB, &plain, sizeof plain);
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
  const auto rc = cublasLtMatmul(impl_->lt, impl_->op, &alpha, w, l.w, a, l.a, &beta, y, l.y, y, l.y, &p.algo, nullptr, 0,
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
    cublasLtMatmulAlgoConfigGetAttribute(&p.algo, attr, &v, sizeof v, &written);
    return std::to_string(v);
  };
  int32_t split = 0;
  size_t written = 0;
  cublasLtMatmulAlgoConfigGetAttribute(&p.algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &split, sizeof split, &written);
  return "algo " + get(CUBLASLT_ALGO_CONFIG_ID) + ", tile " + get(CUBLASLT_ALGO_CONFIG_TILE_ID) + ", stages " +
         get(CUBLASLT_ALGO_CONFIG_STAGES_ID) + ", split-K " + std::to_string(split) + ", bucket " +
         std::to_string(row_bucket(m));
}

}  // namespace baton::gpu::cuda
