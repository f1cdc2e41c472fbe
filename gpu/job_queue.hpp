#pragma once

// The one thread that runs an executor's jobs in submission order, shared by the CPU and CUDA
// backends: each job is checked (check_forward_job), announced (on_started), then run.

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

#include "gpu/executor.hpp"

namespace baton::gpu {

/// What a job_queue's thread runs while it has no job, and how often.
struct idle_work {
  /// Runs while no job is queued (a data-parallel member joins its peers' steps there); true
  /// when it found something to do, which brings its next look back to `every`.
  std::function<bool()> look;
  std::chrono::microseconds every{100};
  /// The looks spread out as the thread stays idle: 1 % of the time since the last job or busy
  /// look, from `every` up to this. A quiet member of an idle group so wakes 500 times a second
  /// rather than 10,000, and one that has just been busy looks every `every`.
  std::chrono::microseconds at_most{2000};
  /// How the thread waits between looks; unset: on a condition variable, which a job ends. Set
  /// (a data-parallel member): sleeps up to the given time, ending early when `ready` (has a job
  /// or a stop come?) says so, when `nudge` is called, or when the look would find work (a peer
  /// started a step: its doorbell wakes the member), so a step starts at once after idleness.
  std::function<void(std::chrono::microseconds, const std::function<bool()>& ready)> doze = {};
  std::function<void()> nudge = {};  ///< with doze: called once a job or a stop is queued; any thread
};

class job_queue {
public:
  using check_fn = std::function<std::string(const forward_job&)>;   ///< empty string = sound
  using run_fn = std::function<void(const forward_job&, executor_sink&)>;

  job_queue() = default;
  job_queue(const job_queue&) = delete;
  job_queue& operator=(const job_queue&) = delete;
  ~job_queue() { stop(); }

  /// Starts the thread. `on_thread` runs first on it (a CUDA backend selects its device there).
  /// With `idle.look`, the thread runs it while no job is queued (see idle_work); without, an
  /// idle thread sleeps until a job comes.
  void start(check_fn check, run_fn run, std::function<void()> on_thread = {}, idle_work idle = {});
  void submit(forward_job job, std::shared_ptr<executor_sink> sink);
  /// Runs what is queued, then ends the thread; idempotent, and safe from two owners at once
  /// (elastic instances share one executor).
  void stop();

private:
  void loop(const check_fn& check, const run_fn& run, const idle_work& idle);

  std::mutex mutex_;
  std::mutex join_mutex_;
  std::condition_variable wake_;
  std::deque<std::pair<forward_job, std::shared_ptr<executor_sink>>> queue_;
  std::function<void()> nudge_;  ///< idle_work::nudge, set before the thread starts
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace baton::gpu
