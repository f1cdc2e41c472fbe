// The tokenizer: arbitrary text through the built-in model's byte-level BPE must round-trip
// exactly; arbitrary ids must decode without fault; and arbitrary tokenizer.json must load or
// be refused with a reason. The first byte picks the mode.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>

#include "gpu/bpe_tokenizer.hpp"

namespace {
std::unique_ptr<baton::gpu::bpe_tokenizer> builtin;
}

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  std::ifstream in(BATON_SOURCE_DIR "/models/baton-kjv-tiny/tokenizer.json");
  std::stringstream ss;
  ss << in.rdbuf();
  std::string why;
  builtin = baton::gpu::bpe_tokenizer::from_json(ss.str(), "tokenizer.json", &why);
  if (!builtin) __builtin_trap();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::string rest(reinterpret_cast<const char*>(data) + 1, size - 1);
  switch (data[0] % 3) {
    case 0: {  // byte-level BPE is lossless: decode(encode(x)) == x for any bytes
      if (builtin->decode(builtin->encode(rest)) != rest) __builtin_trap();
      break;
    }
    case 1: {  // any ids, in range or not
      std::vector<int32_t> ids;
      for (size_t i = 0; i + 4 <= rest.size(); i += 4) {
        int32_t v;
        std::memcpy(&v, rest.data() + i, 4);
        ids.push_back(v);
      }
      (void)builtin->decode(ids);
      (void)builtin->decode(ids, true);
      break;
    }
    default: {
      std::string why;
      auto t = baton::gpu::bpe_tokenizer::from_json(rest, "fuzz.json", &why);
      if (!t && why.empty()) __builtin_trap();
      if (t) (void)t->decode(t->encode("hello, world"));
    }
  }
  return 0;
}
