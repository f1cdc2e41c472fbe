// config.json of a Hugging Face model directory.
#include <cstddef>
#include <cstdint>
#include <string>

#include "gpu/hf_model.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  baton::gpu::model_config cfg;
  std::string why;
  if (baton::gpu::parse_hf_config(std::string(reinterpret_cast<const char*>(data), size), "config.json", &cfg, &why))
    (void)cfg.validate();
  else if (why.empty())
    __builtin_trap();
  return 0;
}
