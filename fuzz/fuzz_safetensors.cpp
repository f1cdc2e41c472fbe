// A *.safetensors file with any bytes: opened through the same mmap path as a model's.
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "gpu/safetensors.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const int fd = memfd_create("fuzz.safetensors", 0);
  if (fd < 0) return 0;
  if (size && ::write(fd, data, size) != static_cast<ssize_t>(size)) {
    ::close(fd);
    return 0;
  }
  std::string why;
  auto f = baton::gpu::safetensors_file::open("/proc/self/fd/" + std::to_string(fd), &why);
  if (f) {
    for (const auto& [name, t] : f->tensors()) (void)baton::gpu::to_f32(t);
  } else if (why.empty()) {
    __builtin_trap();
  }
  ::close(fd);
  return 0;
}
