#include "actors/executor_bridge.hpp"

#include <caf/actor.hpp>
#include <caf/actor_cast.hpp>
#include <caf/send.hpp>

namespace baton {

void forwarding_sink::on_started(uint64_t job_id) {
  if (!report_start_) return;
  if (auto owner = caf::actor_cast<caf::actor>(owner_)) caf::anon_send(owner, exec_start_atom::value, job_id);
}

void forwarding_sink::on_layer_done(uint64_t job_id, uint32_t layer) {
  if (on_layer_) on_layer_(job_id, layer);
}

void forwarding_sink::on_done(uint64_t job_id, std::vector<std::vector<float>> logits) {
  if (auto owner = caf::actor_cast<caf::actor>(owner_))
    caf::anon_send(owner, exec_done_atom::value, job_id, std::move(logits));
}

void forwarding_sink::on_failed(uint64_t job_id, std::string what) {
  if (auto owner = caf::actor_cast<caf::actor>(owner_))
    caf::anon_send(owner, exec_fail_atom::value, job_id, std::move(what));
}

void timer_runner::run_after(std::chrono::nanoseconds delay, std::function<void()> fn) {
  const uint64_t id = ++last_id_;
  pending_.emplace(id, std::move(fn));
  if (auto owner = caf::actor_cast<caf::actor>(owner_)) caf::delayed_anon_send(owner, delay, timer_atom::value, id);
}

void timer_runner::fire(uint64_t id) {
  auto i = pending_.find(id);
  if (i == pending_.end()) return;
  auto fn = std::move(i->second);
  pending_.erase(i);
  fn();
}

}  // namespace baton
