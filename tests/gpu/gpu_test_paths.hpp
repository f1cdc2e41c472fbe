#pragma once

// Where baton_gpu_tests finds the repository's data: compiled in, or given on its command line
// when the binary runs from another checkout (the GPU machine: bench/gpu/h200.sh passes
//   --source-dir=DIR        the repository (models/, tests/data/)
//   --hf-reference-dir=DIR  Hugging Face references remade in the same run
// before doctest's own options).

#include <string>

namespace baton::test {

struct gpu_test_paths {
  std::string source_dir = BATON_SOURCE_DIR;
  std::string hf_reference_dir;  ///< empty: source_dir + "/tests/data/hf_reference"

  std::string hf_reference() const {
    return hf_reference_dir.empty() ? source_dir + "/tests/data/hf_reference" : hf_reference_dir;
  }
};

/// Set once by the test binary's main before any test runs.
gpu_test_paths& gpu_paths();

}  // namespace baton::test
