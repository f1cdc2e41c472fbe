// baton_gpu_tests' main: takes its two path options (gpu_test_paths.hpp), hands the rest to
// doctest, and refuses an option of ours without a value. `--cuda-ipc-put-child` makes it the
// second process of a cross-process case instead (cuda_ipc_transport.test.cpp).

#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cstdio>
#include <string>
#include <vector>

#include "tests/gpu/gpu_test_paths.hpp"

namespace baton::test {
int cuda_ipc_put_child();
gpu_test_paths& gpu_paths() {
  static gpu_test_paths p;
  return p;
}
}  // namespace baton::test

int main(int argc, char** argv) {
  if (argc == 2 && std::string{argv[1]} == "--cuda-ipc-put-child") return baton::test::cuda_ipc_put_child();
  std::vector<char*> rest{argv[0]};
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto take = [&](const std::string& flag, std::string* dst) {
      if (a.rfind(flag + "=", 0) != 0) return false;
      *dst = a.substr(flag.size() + 1);
      return true;
    };
    auto& p = baton::test::gpu_paths();
    if (take("--source-dir", &p.source_dir) || take("--hf-reference-dir", &p.hf_reference_dir)) {
      if (p.source_dir.empty()) {
        std::fprintf(stderr, "baton_gpu_tests: --source-dir needs a directory\n");
        return 2;
      }
      continue;
    }
    rest.push_back(argv[i]);
  }
  doctest::Context ctx;
  ctx.applyCommandLine(static_cast<int>(rest.size()), rest.data());
  return ctx.run();
}
