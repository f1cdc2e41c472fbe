#pragma once

#include <string>
#include <vector>

namespace baton::deploy {

/// `baton local`: a whole disaggregated cluster in this process on the built-in model,
/// answering sample prompts. Returns the process exit code.
int run_local(const std::vector<std::string>& args);

}  // namespace baton::deploy
