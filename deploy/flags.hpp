#pragma once

// Command-line flags bound directly to fields of the typed config structs, so a flag and the
// config key it sets are declared once. Unknown flags and malformed values are errors that
// name the flag.

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace baton::deploy {

class flag_set {
public:
  void add(std::string name, uint32_t* target, std::string help);
  void add(std::string name, uint64_t* target, std::string help);
  void add(std::string name, float* target, std::string help);
  void add(std::string name, double* target, std::string help);
  void add(std::string name, std::string* target, std::string help);
  void add(std::string name, std::vector<std::string>* target, std::string help);  ///< repeatable
  void add(std::string name, bool* target, std::string help);                      ///< no value

  /// Arguments that are neither flags nor a flag's value go here (`baton generate "prompt"`),
  /// rather than being refused as unknown flags.
  void collect_positional(std::vector<std::string>* out) { positional_ = out; }

  /// Parses args; returns an error sentence, or empty. "--help" sets help_requested().
  std::string parse(const std::vector<std::string>& args);
  bool help_requested() const { return help_; }
  /// Whether the last parse set flag `name` (a default that depends on other flags yields to it).
  bool given(const std::string& name) const;
  /// For a subcommand's main: parses; on a bad flag prints "baton <command>: <why>" and returns
  /// 2, on --help prints `usage_line` and the flags and returns 0; otherwise returns nothing.
  std::optional<int> parse_command_line(const std::vector<std::string>& args, const std::string& command,
                                        const std::string& usage_line);
  std::string usage() const;

private:
  struct flag {
    std::string name, help;
    bool takes_value = true;
    std::function<std::string(const std::string&)> set;  ///< returns an error or empty
    std::string current;
    bool given = false;
  };
  std::vector<flag> flags_;
  bool help_ = false;
  std::vector<std::string>* positional_ = nullptr;
};

struct net_security;
/// --cluster-id, --tls-cert, --tls-key, --tls-ca: one declaration for every networked command.
void add_security_flags(flag_set& flags, net_security* sec);

/// "a,b,,c" -> {"a", "b", "c"}: a comma-separated list, empty items dropped.
std::vector<std::string> split_list(const std::string& text);

/// Splits "HOST:PORT" (port 0..65535; 0 = any free port when listening). False and a sentence
/// naming `what` when malformed.
bool parse_host_port(const std::string& text, const std::string& what, std::string* host, uint16_t* port,
                     std::string* why);

}  // namespace baton::deploy
