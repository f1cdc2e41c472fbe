// API keys files (--api-keys-file; a gateway reads its file again whenever it changes): whatever
// one holds. A refusal always says why; what parses merges with plain keys and is described for
// the start line, and a key read back finds itself.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "deploy/api_keys.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::vector<baton::deploy::api_key> keys;
  std::string why;
  if (!baton::deploy::parse_api_keys({reinterpret_cast<const char*>(data), size}, &keys, &why)) {
    if (why.empty()) __builtin_trap();
    return 0;
  }
  std::vector<baton::deploy::api_key> merged;
  if (!baton::deploy::merge_api_keys(keys, {"sk-plain-key-1"}, &merged, &why) && why.empty()) __builtin_trap();
  (void)baton::deploy::describe_api_keys(keys);
  const auto live = baton::deploy::renew_api_keys({}, keys);
  for (const auto& k : keys)
    if (!baton::deploy::find_api_key(live, k.key)) __builtin_trap();
  return 0;
}
