#include "deploy/flags.hpp"
#include "deploy/processes.hpp"

#include <cstdlib>
#include <charconv>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <limits>
#include <stdexcept>

namespace baton::deploy {

namespace {

template <class T>
std::string parse_integer(const std::string& v, T* out) {
  T x{};
  auto [p, ec] = std::from_chars(v.data(), v.data() + v.size(), x);
  if (ec == std::errc::result_out_of_range)
    return "is out of range: at most " + std::to_string(std::numeric_limits<T>::max()) + ", got '" + v + "'";
  if (ec != std::errc{} || p != v.data() + v.size()) return "expects a non-negative integer, got '" + v + "'";
  *out = x;
  return {};
}

}  // namespace

void flag_set::add(std::string name, uint32_t* t, std::string help) {
  flags_.push_back({std::move(name), std::move(help), true,
                    [t](const std::string& v) { return parse_integer(v, t); }, std::to_string(*t)});
}
void flag_set::add(std::string name, uint64_t* t, std::string help) {
  flags_.push_back({std::move(name), std::move(help), true,
                    [t](const std::string& v) { return parse_integer(v, t); }, std::to_string(*t)});
}
void flag_set::add(std::string name, float* t, std::string help) {
  flags_.push_back({std::move(name), std::move(help), true,
                    [t](const std::string& v) -> std::string {
                      try {
                        size_t used = 0;
                        const float x = std::stof(v, &used);
                        if (used != v.size() || !std::isfinite(x)) throw std::invalid_argument{v};
                        *t = x;
                        return {};
                      } catch (const std::exception&) {
                        return "expects a number, got '" + v + "'";
                      }
                    },
                    std::to_string(*t)});
}
void flag_set::add(std::string name, double* t, std::string help) {
  flags_.push_back({std::move(name), std::move(help), true,
                    [t](const std::string& v) -> std::string {
                      char* end = nullptr;
                      const double x = std::strtod(v.c_str(), &end);
                      if (v.empty() || end != v.c_str() + v.size() || !std::isfinite(x))
                        return "expects a number, got '" + v + "'";
                      *t = x;
                      return {};
                    },
                    std::to_string(*t)});
}
void flag_set::add(std::string name, std::string* t, std::string help) {
  flags_.push_back({std::move(name), std::move(help), true,
                    [t](const std::string& v) {
                      *t = v;
                      return std::string{};
                    },
                    *t});
}
void flag_set::add(std::string name, std::vector<std::string>* t, std::string help) {
  flags_.push_back({std::move(name), std::move(help), true,
                    [t, first = std::make_shared<bool>(true)](const std::string& v) {
                      if (*first) t->clear();  // given on the command line: replaces the defaults
                      *first = false;
                      t->push_back(v);
                      return std::string{};
                    },
                    "(repeatable)"});
}
void flag_set::add(std::string name, bool* t, std::string help) {
  // `--flag` alone sets it; `--flag=false` (or true, 1, 0) says which, rather than being taken as true.
  flags_.push_back({std::move(name), std::move(help), false,
                    [t](const std::string& v) {
                      if (v.empty() || v == "true" || v == "1") *t = true;
                      else if (v == "false" || v == "0") *t = false;
                      else return "takes true or false after '=', got '" + v.substr(0, 32) + "'";
                      return std::string{};
                    },
                    *t ? "true" : "false"});
}

std::string flag_set::parse(const std::vector<std::string>& args) {
  for (auto& f : flags_) f.given = false;  // given(): this parse's
  for (size_t i = 0; i < args.size(); ++i) {
    std::string arg = args[i], value;
    if (arg == "--help" || arg == "-h") {
      help_ = true;
      continue;
    }
    if (positional_ && arg.rfind("--", 0) != 0) {
      positional_->push_back(arg);
      continue;
    }
    const auto eq = arg.find('=');
    const bool inline_value = eq != std::string::npos;
    if (inline_value) {
      value = arg.substr(eq + 1);
      arg = arg.substr(0, eq);
    }
    auto f = std::find_if(flags_.begin(), flags_.end(), [&](const flag& x) { return x.name == arg; });
    if (f == flags_.end())
      return arg.rfind("-", 0) == 0 ? "unknown flag '" + arg + "' (see --help)"
                                    : "unexpected argument '" + arg + "': this command takes flags only (see --help)";
    if (f->takes_value && !inline_value) {
      if (i + 1 >= args.size()) return "flag " + arg + " needs a value";
      value = args[++i];
    }
    if (auto err = f->set(value); !err.empty()) return "flag " + arg + " " + err;
    // Given twice, the last one wins (as argparse's): wrappers add defaults their callers override.
    f->given = true;
  }
  return {};
}

bool flag_set::given(const std::string& name) const {
  return std::any_of(flags_.begin(), flags_.end(), [&](const flag& f) { return f.name == name && f.given; });
}

std::optional<int> flag_set::parse_command_line(const std::vector<std::string>& args, const std::string& command,
                                                const std::string& usage_line) {
  if (auto err = parse(args); !err.empty()) {
    std::fprintf(stderr, "baton %s: %s\n", command.c_str(), err.c_str());
    return 2;
  }
  if (help_) {
    std::printf("usage: %s\n\n%s", usage_line.c_str(), usage().c_str());
    return 0;
  }
  return std::nullopt;
}

std::string flag_set::usage() const {
  std::string out;
  for (const auto& f : flags_) {
    out += "  " + f.name + (f.takes_value ? " <value>" : "");
    out += std::string(f.name.size() < 24 ? 24 - f.name.size() : 1, ' ') + f.help + " [" + f.current + "]\n";
  }
  return out;
}

std::vector<std::string> split_list(const std::string& text) {
  std::vector<std::string> out;
  size_t from = 0;
  while (from <= text.size()) {
    const size_t comma = std::min(text.find(',', from), text.size());
    if (comma > from) out.push_back(text.substr(from, comma - from));
    from = comma + 1;
  }
  return out;
}

void add_security_flags(flag_set& flags, net_security* sec) {
  flags.add("--cluster-id", &sec->cluster_id, "the cluster's id: processes with another id are refused");
  flags.add("--tls-cert", &sec->tls_cert, "mutual TLS: this process's certificate (PEM), signed by --tls-ca");
  flags.add("--tls-key", &sec->tls_key, "mutual TLS: its private key (PEM)");
  flags.add("--tls-ca", &sec->tls_ca, "mutual TLS: the cluster CA's certificate (PEM); peers must be signed by it");
}

bool parse_host_port(const std::string& text, const std::string& what, std::string* host, uint16_t* port,
                     std::string* why) {
  const auto colon = text.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == text.size()) {
    *why = what + " needs HOST:PORT, got '" + text + "'";
    return false;
  }
  uint32_t p = 0;
  const auto port_text = text.substr(colon + 1);
  const auto [end, ec] = std::from_chars(port_text.data(), port_text.data() + port_text.size(), p);
  if (ec != std::errc{} || end != port_text.data() + port_text.size() || p > 65535) {
    *why = what + " has a bad port in '" + text + "'";
    return false;
  }
  *host = text.substr(0, colon);
  *port = static_cast<uint16_t>(p);
  return true;
}

}  // namespace baton::deploy
