// A block file of the KV store with any bytes (a disk can hold anything): validated on open,
// read layer by layer when it passes.
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "store/block_file.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const int fd = memfd_create("fuzz.blk", 0);
  if (fd < 0) return 0;
  if (size && ::write(fd, data, size) != static_cast<ssize_t>(size)) {
    ::close(fd);
    return 0;
  }
  baton::store::block_header h;
  std::string why;
  const baton::store::block_key salt{1, 2}, key{3, 4};
  const int bfd = baton::store::open_block_file("/proc/self/fd/" + std::to_string(fd), salt, key, &h, &why);
  if (bfd >= 0) {
    if (h.layer_bytes <= (1u << 20) && h.num_layers <= 256) {
      std::vector<std::byte> layer(h.layer_bytes);
      for (uint32_t l = 0; l < h.num_layers; ++l) (void)baton::store::read_block_layer(bfd, h, l, layer.data());
    }
    ::close(bfd);
  } else if (why.empty()) {
    __builtin_trap();
  }
  ::close(fd);
  return 0;
}
