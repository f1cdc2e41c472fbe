#include "gpu/job_queue.hpp"

#include <exception>
#include <string>

#include <algorithm>

namespace baton::gpu {

void job_queue::start(check_fn check, run_fn run, std::function<void()> on_thread, idle_work idle) {
  if (idle.doze) nudge_ = idle.nudge;
  thread_ = std::thread([this, check = std::move(check), run = std::move(run), on_thread = std::move(on_thread),
                         idle = std::move(idle)] {
    if (on_thread) on_thread();
    loop(check, run, idle);
  });
}

void job_queue::submit(forward_job job, std::shared_ptr<executor_sink> sink) {
  {
    std::lock_guard<std::mutex> lock{mutex_};
    queue_.emplace_back(std::move(job), std::move(sink));
  }
  wake_.notify_one();
  if (nudge_) nudge_();  // after the job is queued: a doze that missed it is woken
}

void job_queue::stop() {
  {
    std::lock_guard<std::mutex> lock{mutex_};
    stop_ = true;
  }
  wake_.notify_all();
  if (nudge_) nudge_();
  std::lock_guard<std::mutex> once{join_mutex_};
  if (thread_.joinable()) thread_.join();
}

void job_queue::loop(const check_fn& check, const run_fn& run, const idle_work& idle) {
  using clock = std::chrono::steady_clock;
  auto busy_at = clock::now();  // the last job or busy look
  for (;;) {
    std::pair<forward_job, std::shared_ptr<executor_sink>> item;
    {
      std::unique_lock<std::mutex> lock{mutex_};
      const auto ready = [this] { return stop_ || !queue_.empty(); };
      if (!idle.look) {
        wake_.wait(lock, ready);
      } else if (!ready()) {
        const auto quiet = std::chrono::duration_cast<std::chrono::microseconds>(clock::now() - busy_at);
        const auto interval = std::clamp(quiet / 100, idle.every, std::max(idle.every, idle.at_most));
        if (idle.doze) {  // outside the lock: submit() nudges after queuing
          lock.unlock();
          idle.doze(interval, [this] {
            std::lock_guard<std::mutex> again{mutex_};
            return stop_ || !queue_.empty();
          });
          lock.lock();
        } else {
          wake_.wait_for(lock, interval, ready);
        }
        if (!ready()) {  // nothing came: look
          lock.unlock();
          if (idle.look()) busy_at = clock::now();
          continue;
        }
      }
      if (queue_.empty()) {  // stopped with nothing left
        lock.unlock();
        if (idle.look) idle.look();  // a last look: finish a step a peer began before this stop
        return;
      }
      item = std::move(queue_.front());
      queue_.pop_front();
    }
    // An exception (a scratch buffer's std::bad_alloc, in the check or the pass) fails this job,
    // naming it, instead of ending the process from this thread; the rank fails the job's
    // requests over.
    try {
      if (auto err = check(item.first); !err.empty()) {
        item.second->on_failed(item.first.job_id, std::move(err));
        continue;
      }
      item.second->on_started(item.first.job_id);
      run(item.first, *item.second);
    } catch (const std::exception& e) {
      item.second->on_failed(item.first.job_id, std::string("the job threw: ") + e.what());
    } catch (...) {
      item.second->on_failed(item.first.job_id, "the job threw an exception that is not a std::exception");
    }
    busy_at = clock::now();
  }
}

}  // namespace baton::gpu
