#include "actors/store_host.hpp"

#include <optional>

#include <caf/actor_system.hpp>
#include <caf/send.hpp>
#include <caf/stateful_actor.hpp>
#include <caf/typed_event_based_actor.hpp>

#include "actors/block_server.hpp"
#include "store/block_file.hpp"
#include "transport/transport.hpp"

namespace baton {

namespace {

struct store_host_state {
  store_host_config cfg;
  store_transport_factory make_transport;
  /// Shared with the exit functor: CAF destroys the state before attached functors run.
  std::shared_ptr<block_server_actor> server = std::make_shared<block_server_actor>();
  /// An adoption that replaces a running server, waiting for it to stop: two servers must never
  /// share the directory (the new one's scan would race the old one's last writes and deletes).
  struct waiting_adoption {
    store_adoption adoption;
    std::shared_ptr<transport::transport> xport;
    caf::typed_response_promise<block_server_actor> rp;
  };
  std::optional<waiting_adoption> waiting;
  static inline const char* name = "baton.store_host";
};

using pointer = store_host_actor::stateful_pointer<store_host_state>;

block_server_actor start_server(pointer self, store_adoption& a, std::shared_ptr<transport::transport> xport) {
  auto& st = self->state;
  block_server_config bc;
  bc.server_id = a.server_id;
  bc.name = st.cfg.name;
  bc.dir = st.cfg.dir + "/server-" + std::to_string(a.server_id);
  bc.identity = {a.model_id, a.num_layers, a.kv_dim, a.block_tokens, a.page_tokens, a.dtype};
  if (a.staging_bytes) bc.staging_bytes = a.staging_bytes;
  bc.retention.chat_ttl_s = a.chat_ttl_s;
  bc.retention.agent_ttl_s = a.agent_ttl_s;
  bc.retention.batch_ttl_s = a.batch_ttl_s;
  bc.fault_layer_delay_ms = st.cfg.fault_layer_delay_ms;
  bc.capacity_bytes = st.cfg.capacity_bytes;
  *st.server = spawn_block_server(self->system(), std::move(bc), std::move(xport), std::move(a.index));
  return *st.server;
}

store_host_actor::behavior_type store_host_impl(pointer self, store_host_config cfg, store_transport_factory make) {
  self->state.cfg = std::move(cfg);
  self->state.make_transport = std::move(make);
  self->attach_functor([server = self->state.server] {
    if (*server) caf::anon_send_exit(*server, caf::exit_reason::user_shutdown);
  });
  self->set_down_handler([=](caf::down_msg& dm) {
    // The old server stopped (its I/O thread joined before its down message): the one waiting starts.
    auto& st = self->state;
    if (!st.waiting || dm.source != caf::actor_cast<caf::actor_addr>(*st.server)) return;
    auto w = std::move(*st.waiting);
    st.waiting.reset();
    w.rp.deliver(start_server(self, w.adoption, std::move(w.xport)));
  });
  return {
      [=](adopt_atom, store_adoption& a) -> caf::result<block_server_actor> {
        auto& st = self->state;
        if (a.index.empty() || a.num_layers == 0 || a.kv_dim == 0 || a.block_tokens == 0 || a.page_tokens == 0)
          return make_error(errc::bad_request, "store node " + st.cfg.name +
                                                   ", stage adopt: the adoption lacks an index or a KV layout");
        if (const uint64_t file = store::block_disk_bytes(store::block_header::fixed_header_bytes + a.block_bytes);
            st.cfg.capacity_bytes && a.block_bytes && file > st.cfg.capacity_bytes)
          return make_error(errc::bad_request, "store node " + st.cfg.name + ", stage adopt: --store-capacity-gib allows " +
                                                   std::to_string(st.cfg.capacity_bytes) + " bytes, less than one block file of " +
                                                   "the head's model (" + std::to_string(file) + " bytes on disk)");
        std::string why;
        auto xport = st.make_transport(st.cfg.name, &why);
        if (!xport)
          return make_error(errc::executor_failed, "store node " + st.cfg.name + ", stage adopt: transport: " + why);
        if (st.waiting) {  // a head asked again before the old server stopped: the latest asker wins
          st.waiting->rp.deliver(make_error(errc::cancelled, "store node " + st.cfg.name +
                                                                 ", stage adopt: a newer adoption replaced this one"));
          st.waiting.reset();
        }
        if (!*st.server) return start_server(self, a, std::move(xport));
        self->monitor(*st.server);
        self->send_exit(*st.server, caf::exit_reason::user_shutdown);
        auto rp = self->make_response_promise<block_server_actor>();
        st.waiting.emplace(store_host_state::waiting_adoption{std::move(a), std::move(xport), rp});
        return rp;
      },
  };
}

}  // namespace

store_host_actor spawn_store_host(caf::actor_system& sys, store_host_config cfg, store_transport_factory make_transport) {
  return sys.spawn(store_host_impl, std::move(cfg), std::move(make_transport));
}

}  // namespace baton
