#pragma once

// The bench binaries' flags, parsed as the baton commands parse theirs (deploy::flag_set):
// `--help` lists them with their defaults; an unknown flag or a malformed value stops the run,
// naming it, with exit code 2 -- never an uncaught exception from a number that did not parse.

#include <cstdio>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "deploy/flags.hpp"

namespace baton::bench {

/// Parses argv[1..] into `flags`: the exit code when the run stops here (0 after --help, 2 on
/// a bad flag), else nothing. `usage` follows the binary's name ("[--tokens N] [--dir DIR]").
inline std::optional<int> parse_flags(deploy::flag_set& flags, int argc, char** argv, const std::string& usage) {
  const std::string name = std::filesystem::path(argc > 0 ? argv[0] : "bench").filename().string();
  const std::vector<std::string> args(argv + (argc > 0 ? 1 : 0), argv + argc);
  if (const auto why = flags.parse(args); !why.empty()) {
    std::fprintf(stderr, "%s: %s\n", name.c_str(), why.c_str());  // the sentence points to --help
    return 2;
  }
  if (flags.help_requested()) {
    std::printf("usage: %s %s\n\n%s", name.c_str(), usage.c_str(), flags.usage().c_str());
    return 0;
  }
  return std::nullopt;
}

}  // namespace baton::bench
