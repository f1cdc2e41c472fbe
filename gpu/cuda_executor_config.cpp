#include "gpu/cuda_executor.hpp"

#include "gpu/cpu_executor.hpp"
#include "gpu/cuda/kernels.hpp"

namespace baton::gpu {

std::string cuda_executor_config::validate() const {
  if (device < 0) return "device must be >= 0";
  if (num_kv_pages == 0) return "num_kv_pages (--kv-pages) must be >= 1";
  if (page_size_tokens == 0) return "page_size_tokens (--page-tokens) must be >= 1";
  if (max_batch_tokens == 0) return "max_batch_tokens must be >= 1";
  if (mirror_to_host && !host_pool) return "mirror_to_host needs host_pool";
  return {};
}

std::string backend_config::kind_problem() const {
  if (kind == "cpu" || kind == "cuda") return {};
  return "executor backend \"" + kind + "\" is unknown (cpu or cuda)";
}

std::string backend_config::validate() const {
  if (auto e = kind_problem(); !e.empty() || kind == "cpu") return e;
#ifndef BATON_HAVE_CUDA
  return "executor backend cuda: this build has no CUDA (nvcc was not found when it was configured)";
#else
  if (cuda::device_count() <= cuda_device)
    return "executor backend cuda: no CUDA device " + std::to_string(cuda_device) + " on this machine";
  return {};
#endif
}

backend_config backend_config::for_rank(uint32_t rank_index, int devices) const {
  backend_config out = *this;
  if (kind == "cuda" && devices > 0)
    out.cuda_device = static_cast<int>((static_cast<uint64_t>(cuda_device) + rank_index) % static_cast<uint64_t>(devices));
  return out;
}

int visible_cuda_devices() {
#ifdef BATON_HAVE_CUDA
  return cuda::device_count();
#else
  return 0;
#endif
}

namespace {

/// A rank whose device could not start: every job fails with the reason.
class refusing_executor final : public executor {
public:
  refusing_executor(model_config cfg, kv_layout layout, std::string why)
    : cfg_(std::move(cfg)), kv_(layout, false), why_(std::move(why)) {}
  const model_config& config() const override { return cfg_; }
  kv_cache& kv() override { return kv_; }
  std::string describe() const override { return "unavailable: " + why_; }
  void submit(forward_job job, std::shared_ptr<executor_sink> sink) override { sink->on_failed(job.job_id, why_); }

private:
  model_config cfg_;
  kv_cache kv_;
  std::string why_;
};

}  // namespace

std::shared_ptr<executor> make_refusing_executor(const model_config& model, const cpu_executor_config& pool,
                                                 std::string why) {
  return std::make_shared<refusing_executor>(model, model_kv_layout(model, pool.num_kv_pages, pool.page_size_tokens),
                                             std::move(why));
}

std::shared_ptr<executor> make_backend_executor(const backend_config& backend, const model_config& model,
                                                std::shared_ptr<const model_weights> weights,
                                                const cpu_executor_config& pool) {
  if (backend.kind != "cuda") return make_cpu_executor(model, std::move(weights), pool);
  if (pool.experts || pool.peers)  // dispatch and combine are the CPU executor's (gpu/expert_parallel.hpp)
    return make_refusing_executor(model, pool, "cuda executor: expert parallelism runs on the CPU executor only so far");
  cuda_executor_config c;
  c.device = backend.cuda_device;
  c.bf16 = backend.cuda_bf16;
  c.num_kv_pages = pool.num_kv_pages;
  c.page_size_tokens = pool.page_size_tokens;
  std::string why;
  if (auto e = make_cuda_executor(model, std::move(weights), c, &why)) return e;
  return make_refusing_executor(model, pool, "cuda executor: " + why);
}

#ifndef BATON_HAVE_CUDA
std::unique_ptr<executor> make_cuda_executor(model_config, std::shared_ptr<const model_weights>, cuda_executor_config,
                                             std::string* why) {
  *why = "this build has no CUDA backend (nvcc was not found when it was configured)";
  return nullptr;
}
#endif

}  // namespace baton::gpu
