#include "actors/executor_bridge.hpp"

#include "gpu/json_schema_grammar.hpp"

#include <caf/actor.hpp>
#include <caf/actor_cast.hpp>
#include <caf/local_actor.hpp>
#include <caf/send.hpp>

namespace baton {

void forwarding_sink::on_started(uint64_t job_id) {
  if (!report_start_) return;
  if (auto owner = caf::actor_cast<caf::actor>(owner_)) caf::anon_send(owner, exec_start_atom::value, job_id);
}

void forwarding_sink::on_layer_kv_ready(uint64_t job_id, uint32_t layer) {
  if (on_kv_ready_) on_kv_ready_(job_id, layer);
}

void forwarding_sink::on_layer_computed(uint64_t job_id, uint32_t layer) {
  if (on_computed_) on_computed_(job_id, layer);
}

void forwarding_sink::on_done(uint64_t job_id, gpu::forward_output out) {
  if (auto owner = caf::actor_cast<caf::actor>(owner_)) caf::anon_send(owner, exec_done_atom::value, job_id, std::move(out));
}

void forwarding_sink::on_failed(uint64_t job_id, std::string what) {
  if (auto owner = caf::actor_cast<caf::actor>(owner_))
    caf::anon_send(owner, exec_fail_atom::value, job_id, std::move(what));
}

caf::expected<std::shared_ptr<gpu::grammar_matcher>> rank_core::follow_grammar(const output_grammar& g,
                                                                               std::span<const int32_t> output,
                                                                               const std::string& stage) {
  if (g.kind == 0) return std::shared_ptr<gpu::grammar_matcher>{};
  std::string why;
  auto compiled = gpu::cached_output_grammar(static_cast<gpu::output_format>(g.kind), g.text,
                                             {.after_thinking = g.after_thinking, .compact = g.compact}, &why);
  if (!compiled) return make_error(errc::bad_request, stage + ": " + why);
  if (!vocabulary) vocabulary = gpu::byte_vocabulary(exec->config().vocab_size);
  auto m = std::make_shared<gpu::grammar_matcher>(std::move(compiled), vocabulary, g.end_tokens);
  for (size_t i = 0; i < output.size(); ++i)
    if (!m->accept(output[i]))
      return make_error(errc::bad_request, stage + ": output token " + std::to_string(i) + " (id " +
                                               std::to_string(output[i]) + ") strays from the answer's grammar");
  if (auto why = gpu::too_ambiguous(*m); !why.empty()) return make_error(errc::bad_request, stage + ": " + why);
  return m;
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

const kv_wire_staging* rank_core::wire_staging(std::string* why) {
  if (wire) return wire.get();
  if (wire_error.empty()) {
    const auto& lay = exec->kv().layout();
    auto w = std::make_shared<kv_wire_staging>();
    w->num_pages = lay.num_pages;
    w->page_values = lay.page_bytes() / sizeof(float);
    w->slot_bytes = kv_wire_staging::slot_bytes_for(lay);
    const uint64_t bytes = kv_wire_staging::bytes_for(lay, lay.num_pages);
    transport::xfer_error err;
    // Transport memory: a peer on this host then puts into it with plain stores (UCX shared memory).
    w->memory = transport::transport_memory(xport, bytes, &err);
    std::optional<transport::region_key> key;
    if (w->memory) key = xport->register_region(w->memory.get(), bytes, &err);
    if (key) {
      w->key = *key;
      // Deregistered, then freed, only when the transport's other users are gone (rank_core::start's
      // shutdown order): a peer's late put must not land in freed memory.
      outlive_transport->push_back(std::shared_ptr<void>(nullptr, [xp = xport, mem = w->memory, id = key->region_id](void*) {
        xp->deregister_region(id);
      }));
      wire = std::move(w);
      return wire.get();
    }
    wire_error = "no wire-form staging of " + std::to_string(bytes >> 20) + " MiB for the KV pool (" + err.what +
                 "): KV travels as f32";
  }
  if (why) *why = wire_error;
  return nullptr;
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
  // Shutdown order. CAF destroys the actor's state before it runs attached functors, so this
  // functor holds the executor and the transport: the executor stops first (no callback can
  // post a put any more), then the pool leaves the transport and the transport stops moving
  // bytes (quiesce: its progress thread joined, so no peer's put can land in the pool and no
  // released put of ours reads a buffer any more), and only then are the pool (with the
  // executor) and the other buffers freed. Freed in the other order, a put arriving from a peer
  // wrote into freed memory (seen as a SIGSEGV in ucp_put_handler when a decode node lost its
  // head). Quiesced, not just let go: other holders (the buffers' deregistering deleters, the
  // pool's memory, a rank's other functors) may keep the transport itself alive past this.
  self->attach_functor([xp = xport, ex = exec, region = pool_key->region_id, keep = outlive_transport]() mutable {
    ex->stop();
    xp->deregister_region(region);
    xp->quiesce();
    xp.reset();
    ex.reset();
    keep.reset();  // other registered buffers, freed only now
  });
}

}  // namespace baton
