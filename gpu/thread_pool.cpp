#include "gpu/thread_pool.hpp"

namespace baton::gpu {

thread_pool::thread_pool(unsigned num_threads) {
  const unsigned extra = num_threads > 1 ? num_threads - 1 : 0;
  for (unsigned i = 0; i < extra; ++i) workers_.emplace_back([this, i] { worker_loop(i); });
}

thread_pool::~thread_pool() {
  {
    std::lock_guard<std::mutex> lock{mutex_};
    stop_ = true;
  }
  wake_.notify_all();
  for (auto& t : workers_) t.join();
}

void thread_pool::parallel_for(size_t n, size_t grain, const std::function<void(size_t, size_t)>& fn) {
  if (n == 0) return;
  if (grain == 0) grain = 1;
  const size_t num_tiles = (n + grain - 1) / grain;
  const size_t parts = std::min<size_t>(num_threads(), num_tiles);
  if (parts <= 1) {
    fn(0, n);
    return;
  }
  std::vector<std::pair<size_t, size_t>> ranges(num_threads(), {0, 0});
  for (size_t p = 0; p < parts; ++p) {
    const size_t begin = std::min(n, (num_tiles * p / parts) * grain);
    const size_t end = std::min(n, (num_tiles * (p + 1) / parts) * grain);
    ranges[p] = {begin, end};
  }
  {
    std::lock_guard<std::mutex> lock{mutex_};
    ranges_ = std::move(ranges);
    job_ = &fn;
    pending_ = static_cast<unsigned>(workers_.size());
    ++generation_;
  }
  wake_.notify_all();
  std::exception_ptr mine;
  try {
    if (ranges_[0].first < ranges_[0].second) fn(ranges_[0].first, ranges_[0].second);
  } catch (...) {
    mine = std::current_exception();
  }
  std::unique_lock<std::mutex> lock{mutex_};
  done_.wait(lock, [this] { return pending_ == 0; });  // `fn` lives in the caller's frame
  job_ = nullptr;
  const auto failure = mine ? mine : failure_;  // the caller's own first, else a worker's
  failure_ = nullptr;
  lock.unlock();
  if (failure) std::rethrow_exception(failure);
}

void thread_pool::worker_loop(unsigned index) {
  uint64_t seen = 0;
  for (;;) {
    std::pair<size_t, size_t> range;
    const std::function<void(size_t, size_t)>* job;
    {
      std::unique_lock<std::mutex> lock{mutex_};
      wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      range = ranges_[index + 1];
      job = job_;
    }
    std::exception_ptr failure;
    try {
      if (range.first < range.second) (*job)(range.first, range.second);
    } catch (...) {
      failure = std::current_exception();
    }
    {
      std::lock_guard<std::mutex> lock{mutex_};
      if (failure && !failure_) failure_ = failure;
      if (--pending_ == 0) done_.notify_one();
    }
  }
}

}  // namespace baton::gpu
