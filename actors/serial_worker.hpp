#pragma once

// One thread that runs posted functions in order, off an actor's thread: a block server does its
// blocking file I/O on one, and a decode rank checks landed KV layers (and expands those that
// came in a wire form) on one, so that its step scheduling never waits behind a layer's worth of
// memory traffic. Destruction runs what is queued, then joins.

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <utility>

namespace baton {

class serial_worker {
public:
  serial_worker() : thread_([this] { loop(); }) {}
  serial_worker(const serial_worker&) = delete;
  serial_worker& operator=(const serial_worker&) = delete;
  ~serial_worker() {
    {
      std::lock_guard<std::mutex> lock{mutex_};
      stop_ = true;
    }
    wake_.notify_one();
    thread_.join();
  }

  void post(std::function<void()> fn) {
    {
      std::lock_guard<std::mutex> lock{mutex_};
      queue_.push_back(std::move(fn));
    }
    wake_.notify_one();
  }

private:
  void loop() {
    for (;;) {
      std::function<void()> fn;
      {
        std::unique_lock<std::mutex> lock{mutex_};
        wake_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stopping, and nothing left
        fn = std::move(queue_.front());
        queue_.pop_front();
      }
      fn();
    }
  }

  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<std::function<void()>> queue_;
  bool stop_ = false;
  std::thread thread_;  ///< last: it starts once the members above exist
};

}  // namespace baton
