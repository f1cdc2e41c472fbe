#pragma once

#include <condition_variable>
#include <cstddef>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace baton::gpu {

/// A fixed set of worker threads for data-parallel loops inside one executor.
///
/// `parallel_for` splits [0, n) into contiguous ranges, one per thread (the caller runs the
/// first). How work is split never changes results: every kernel gives each output element a
/// fixed reduction order of its own, so the thread count is a speed knob only.
class thread_pool {
public:
  explicit thread_pool(unsigned num_threads);
  ~thread_pool();
  thread_pool(const thread_pool&) = delete;
  thread_pool& operator=(const thread_pool&) = delete;

  unsigned num_threads() const { return static_cast<unsigned>(workers_.size()) + 1; }

  /// Runs fn(begin, end) over disjoint ranges covering [0, n); returns when all are done.
  /// Ranges are multiples of `grain` (except the last) so callers can keep tiles whole. An
  /// exception from any range (std::bad_alloc of a scratch buffer) is rethrown here once every
  /// range has ended, never on a worker (std::terminate) nor while workers still run `fn`.
  void parallel_for(size_t n, size_t grain, const std::function<void(size_t, size_t)>& fn);

private:
  void worker_loop(unsigned index);

  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::condition_variable done_;
  const std::function<void(size_t, size_t)>* job_ = nullptr;
  std::vector<std::pair<size_t, size_t>> ranges_;  ///< ranges_[i + 1] belongs to worker i
  uint64_t generation_ = 0;
  unsigned pending_ = 0;
  std::exception_ptr failure_;  ///< the first exception of the current parallel_for's ranges
  bool stop_ = false;
};

}  // namespace baton::gpu
