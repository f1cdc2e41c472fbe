#include "actors/executor_bridge.hpp"

#include <caf/actor.hpp>
#include <caf/actor_cast.hpp>
#include <caf/local_actor.hpp>
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

void rank_core::start(caf::local_actor* self, std::shared_ptr<gpu::executor> executor,
                      std::shared_ptr<transport::transport> transport) {
  exec = std::move(executor);
  xport = std::move(transport);
  runner = std::make_unique<timer_runner>(self->address());
  exec->bind_runner(runner.get());
  transport::xfer_error err;
  pool_key = xport->register_region(exec->kv().data(), exec->kv().size_bytes(), &err);
  if (!pool_key) {
    setup_error = "cannot register the KV pool with the transport: " + err.what;
    return;
  }
  self->attach_functor([xp = xport, region = pool_key->region_id] { xp->deregister_region(region); });
}

}  // namespace baton
