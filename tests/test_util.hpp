#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace baton::test {

/// Bit-for-bit equality of float vectors (NaN patterns included): "equal" in our invariants
/// means identical bits, not within a tolerance.
inline bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

inline bool same_bits(const std::vector<std::vector<float>>& a, const std::vector<std::vector<float>>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (!same_bits(a[i], b[i])) return false;
  return true;
}

/// The lines an actor logs through a std::function<void(const std::string&)> (store_log,
/// node_directory_config::log, ...), kept for a test to read; actors call it from their threads.
class captured_lines {
 public:
  std::function<void(const std::string&)> sink() const {
    return [s = state_](const std::string& line) {
      std::lock_guard<std::mutex> lock{s->mutex};
      s->lines.push_back(line);
    };
  }
  std::vector<std::string> lines() const {
    std::lock_guard<std::mutex> lock{state_->mutex};
    return state_->lines;
  }

 private:
  struct shared {
    std::mutex mutex;
    std::vector<std::string> lines;
  };
  std::shared_ptr<shared> state_ = std::make_shared<shared>();
};

/// A TCP socket bound to a free port of 127.0.0.1, not listening until told; closed at the end
/// (or by close()). fd < 0 when the system refused one.
struct loopback_socket {
  int fd = -1;
  uint16_t port = 0;
  loopback_socket() : fd(::socket(AF_INET, SOCK_STREAM, 0)) {
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof a;
    if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 ||
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
      close();
      return;
    }
    port = ntohs(a.sin_port);
  }
  loopback_socket(const loopback_socket&) = delete;
  loopback_socket& operator=(const loopback_socket&) = delete;
  ~loopback_socket() { close(); }
  bool listen(int backlog = 4) { return fd >= 0 && ::listen(fd, backlog) == 0; }
  void close() {
    if (fd >= 0) ::close(fd);
    fd = -1;
  }
};

}  // namespace baton::test
