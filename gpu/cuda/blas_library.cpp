#include "gpu/cuda/blas_library.hpp"

#include <dlfcn.h>

#include <type_traits>

namespace baton::gpu::cuda {

namespace {

/// Opens `soname` where the dynamic linker looks (LD_LIBRARY_PATH, this binary's run path, the
/// system's directories), then in the CUDA toolkit this build was configured with.
void* open_library(const std::string& soname, std::string* why) {
  void* lib = dlopen(soname.c_str(), RTLD_NOW | RTLD_LOCAL);
  const char* e = lib ? nullptr : dlerror();
  const std::string first_error = e ? e : "not found";
#ifdef BATON_CUDA_LIBRARY_DIR
  if (!lib) lib = dlopen((std::string{BATON_CUDA_LIBRARY_DIR} + "/" + soname).c_str(), RTLD_NOW | RTLD_LOCAL);
#endif
  if (!lib) *why = "cannot load " + soname + ": " + first_error;
  return lib;
}

template <class Fn>
void find(void* lib, const std::string& file, Fn& fn, const char* name, std::string* error) {
  fn = reinterpret_cast<Fn>(dlsym(lib, name));
  if (!fn && error->empty()) *error = file + " lacks " + name;
}

struct loaded {
  blas_library lib;
  std::string error;  ///< empty: every function was found
};

loaded load() {
  loaded out;
  const std::string lt_file = "libcublasLt.so." + std::to_string(CUBLAS_VER_MAJOR);
  const std::string blas_file = "libcublas.so." + std::to_string(CUBLAS_VER_MAJOR);
  // The handles stay open for the process's life: executors may come and go.
  void* lt = open_library(lt_file, &out.error);
  void* blas = lt ? open_library(blas_file, &out.error) : nullptr;
  if (!blas) return out;
#define BATON_FIND_BLAS(f) find(blas, blas_file, out.lib.f, #f, &out.error);
#define BATON_FIND_LT(f) find(lt, lt_file, out.lib.f, #f, &out.error);
  BATON_CUBLAS_FUNCTIONS(BATON_FIND_BLAS)
  BATON_CUBLASLT_FUNCTIONS(BATON_FIND_LT)
#undef BATON_FIND_BLAS
#undef BATON_FIND_LT
  find(blas, blas_file, out.lib.cublasGemmEx, "cublasGemmEx", &out.error);
  return out;
}

}  // namespace

const blas_library* load_blas(std::string* why) {
  static const loaded once = load();  // thread-safe: a function-local static
  if (!once.error.empty()) {
    if (why) *why = once.error;
    return nullptr;
  }
  return &once.lib;
}

}  // namespace baton::gpu::cuda
