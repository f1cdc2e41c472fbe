#include "bench/kernel_trace.hpp"

#include <cupti.h>
#include <cuda_runtime.h>
#include <cxxabi.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <mutex>

namespace baton::bench {

namespace {

std::mutex totals_mutex;
std::map<std::string, kernel_total> totals;  // CUPTI calls back on its own thread

/// "void baton::gpu::cuda::(anonymous namespace)::gemv_kernel<4>(params)" -> "gemv_kernel".
std::string short_name(const char* mangled) {
  int status = 0;
  char* d = abi::__cxa_demangle(mangled, nullptr, nullptr, &status);
  std::string s = status == 0 && d ? d : mangled;
  std::free(d);
  const std::string anonymous = "(anonymous namespace)::";  // its parenthesis is not the parameters'
  for (auto p = s.find(anonymous); p != std::string::npos; p = s.find(anonymous)) s.erase(p, anonymous.size());
  if (auto p = s.find('('); p != std::string::npos) s.resize(p);
  if (auto p = s.find('<'); p != std::string::npos) s.resize(p);
  if (auto p = s.rfind(':'); p != std::string::npos) s = s.substr(p + 1);
  if (auto p = s.rfind(' '); p != std::string::npos) s = s.substr(p + 1);
  return s;
}

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *size = size_t{8} << 20;
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, *size));
  *max_records = 0;
}

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  CUpti_Activity* rec = nullptr;
  std::lock_guard lock{totals_mutex};
  while (cuptiActivityGetNextRecord(buffer, valid, &rec) == CUPTI_SUCCESS) {
    if (rec->kind != CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) continue;
    const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(rec);
    auto name = short_name(k->name);
    auto& t = totals[name];
    t.name = name;
    t.ms += static_cast<double>(k->end - k->start) * 1e-6;
    ++t.launches;
  }
  std::free(buffer);
}

}  // namespace

std::string kernel_trace_start() {
  {
    std::lock_guard lock{totals_mutex};
    totals.clear();
  }
  static const CUptiResult registered = cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed);
  if (registered != CUPTI_SUCCESS) return "CUPTI refused its callbacks (status " + std::to_string(registered) + ")";
  if (auto rc = cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL); rc != CUPTI_SUCCESS) {
    const char* what = nullptr;
    cuptiGetResultString(rc, &what);
    return std::string{"CUPTI kernel tracing refused: "} + (what ? what : "unknown");
  }
  return {};
}

std::vector<kernel_total> kernel_trace_stop() {
  cudaDeviceSynchronize();
  cuptiActivityDisable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
  cuptiActivityFlushAll(1);  // forced: hands over records of buffers not yet full
  std::vector<kernel_total> out;
  std::lock_guard lock{totals_mutex};
  for (auto& [name, t] : totals) out.push_back(t);
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.ms > b.ms; });
  return out;
}

}  // namespace baton::bench
