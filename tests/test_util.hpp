#pragma once

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

}  // namespace baton::test
