#include "gpu/cuda_executor.hpp"

namespace baton::gpu {

std::string cuda_executor_config::validate() const {
  if (device < 0) return "device must be >= 0";
  if (num_kv_pages == 0) return "num_kv_pages must be >= 1";
  if (page_size_tokens == 0) return "page_size_tokens must be >= 1";
  if (max_batch_tokens == 0) return "max_batch_tokens must be >= 1";
  if (mirror_to_host && !host_pool) return "mirror_to_host needs host_pool";
  return {};
}

#ifndef BATON_HAVE_CUDA
std::unique_ptr<executor> make_cuda_executor(model_config, std::shared_ptr<const model_weights>, cuda_executor_config,
                                             std::string* why) {
  *why = "this build has no CUDA backend (nvcc was not found when it was configured)";
  return nullptr;
}
#endif

}  // namespace baton::gpu
