#pragma once

// cuBLAS and cuBLASLt, loaded (dlopen) when a CUDA executor first needs them rather than linked.
//
// Linked, they cost every Baton process 0.35 s at start and ~210 MB of resident pages (libcublasLt
// is 540 MB; the loader relocates it), measured on this project's 2-vCPU VM. Only a CUDA
// executor calls them, but the CLI, every `baton node`, every `baton experts` shard and every
// client start with the same binary. The CUDA runtime (0.7 MB) stays linked. Include only in
// CUDA-only sources: it pulls in the cuBLAS headers.

#include <cublasLt.h>
#include <cublas_v2.h>

#include <string>

namespace baton::gpu::cuda {

/// The entry points Baton calls, by their exported names (cublas_v2.h maps cublasCreate and
/// friends onto the _v2 names, so calls read as usual: `blas->cublasCreate(&h)`).
#define BATON_CUBLAS_FUNCTIONS(X) \
  X(cublasCreate_v2)              \
  X(cublasDestroy_v2)             \
  X(cublasSetStream_v2)
#define BATON_CUBLASLT_FUNCTIONS(X)       \
  X(cublasLtCreate)                       \
  X(cublasLtDestroy)                      \
  X(cublasLtMatmul)                       \
  X(cublasLtMatmulDescCreate)             \
  X(cublasLtMatmulDescDestroy)            \
  X(cublasLtMatmulDescSetAttribute)       \
  X(cublasLtMatrixLayoutCreate)           \
  X(cublasLtMatrixLayoutDestroy)          \
  X(cublasLtMatmulPreferenceCreate)       \
  X(cublasLtMatmulPreferenceDestroy)      \
  X(cublasLtMatmulPreferenceSetAttribute) \
  X(cublasLtMatmulAlgoGetHeuristic)       \
  X(cublasLtMatmulAlgoCheck)              \
  X(cublasLtMatmulAlgoConfigSetAttribute) \
  X(cublasLtMatmulAlgoConfigGetAttribute)

struct blas_library {
#define BATON_BLAS_MEMBER(f) decltype(&::f) f = nullptr;
  BATON_CUBLAS_FUNCTIONS(BATON_BLAS_MEMBER)
  BATON_CUBLASLT_FUNCTIONS(BATON_BLAS_MEMBER)
#undef BATON_BLAS_MEMBER
  /// cublas_api.h also declares a C++ overload of cublasGemmEx (an older compute-type form), so
  /// its type is spelled out.
  cublasStatus_t (*cublasGemmEx)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int, int, const void*,
                                 const void*, cudaDataType, int, const void*, cudaDataType, int, const void*, void*,
                                 cudaDataType, int, cublasComputeType_t, cublasGemmAlgo_t) = nullptr;
};

/// The loaded library, or null and why (the file that could not be loaded or lacks a function).
/// Loads once per process, on the first call; thread-safe.
const blas_library* load_blas(std::string* why);

}  // namespace baton::gpu::cuda
