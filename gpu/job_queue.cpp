#include "gpu/job_queue.hpp"

namespace baton::gpu {

void job_queue::start(check_fn check, run_fn run, std::function<void()> on_thread, std::function<void()> idle,
                      std::chrono::microseconds idle_every) {
  thread_ = std::thread([this, check = std::move(check), run = std::move(run), on_thread = std::move(on_thread),
                         idle = std::move(idle), idle_every] {
    if (on_thread) on_thread();
    loop(check, run, idle, idle_every);
  });
}

void job_queue::submit(forward_job job, std::shared_ptr<executor_sink> sink) {
  {
    std::lock_guard<std::mutex> lock{mutex_};
    queue_.emplace_back(std::move(job), std::move(sink));
  }
  wake_.notify_one();
}

void job_queue::stop() {
  {
    std::lock_guard<std::mutex> lock{mutex_};
    stop_ = true;
  }
  wake_.notify_all();
  std::lock_guard<std::mutex> once{join_mutex_};
  if (thread_.joinable()) thread_.join();
}

void job_queue::loop(const check_fn& check, const run_fn& run, const std::function<void()>& idle,
                     std::chrono::microseconds every) {
  for (;;) {
    std::pair<forward_job, std::shared_ptr<executor_sink>> item;
    {
      std::unique_lock<std::mutex> lock{mutex_};
      const auto ready = [this] { return stop_ || !queue_.empty(); };
      if (!idle) {
        wake_.wait(lock, ready);
      } else if (!wake_.wait_for(lock, every, ready)) {
        lock.unlock();
        idle();
        continue;
      }
      if (queue_.empty()) {  // stopped with nothing left
        lock.unlock();
        if (idle) idle();  // a last look: finish a step a peer began before this stop
        return;
      }
      item = std::move(queue_.front());
      queue_.pop_front();
    }
    if (auto err = check(item.first); !err.empty()) {
      item.second->on_failed(item.first.job_id, std::move(err));
      continue;
    }
    item.second->on_started(item.first.job_id);
    run(item.first, *item.second);
  }
}

}  // namespace baton::gpu
