// Every message element of every actor interface can cross processes: each argument and reply
// type of each typed actor's signatures is registered with CAF (register_message_types). A type
// left out still works inside one process, and fails only between two, at run time ("cannot
// serialize message because a type was not added to the types list"): the block index's touch
// of a store node's server broke remote block stores for good after their first hit that way.

#include <doctest/doctest.h>

#include <cstdlib>
#include <string>
#include <type_traits>
#include <typeinfo>
#include <vector>

#include <cxxabi.h>

#include <caf/actor_system.hpp>
#include <caf/actor_system_config.hpp>
#include <caf/replies_to.hpp>
#include <caf/type_nr.hpp>
#include <caf/uniform_type_info_map.hpp>

#include "actors/messages.hpp"
#include "actors/node_messages.hpp"
#include "actors/store_messages.hpp"

using namespace baton;

namespace {

std::string readable(const std::type_info& t) {
  int status = 0;
  char* name = abi::__cxa_demangle(t.name(), nullptr, nullptr, &status);
  std::string out = status == 0 && name ? name : t.name();
  std::free(name);
  return out;
}

struct type_check {
  caf::actor_system& sys;
  std::vector<std::string> missing;

  template <class T>
  void element(const char* iface) {
    if constexpr (!std::is_void_v<T>) {
      using D = std::decay_t<T>;
      const auto& types = sys.types();
      if (types.portable_name(caf::type_nr<D>::value, &typeid(D)) == types.default_type_name())
        missing.push_back(std::string{iface} + ": " + readable(typeid(D)));
    }
  }

  template <class... Is, class... Os>
  void signature(const char* iface, caf::typed_mpi<caf::detail::type_list<Is...>, caf::output_tuple<Os...>>*) {
    (element<Is>(iface), ...);
    (element<Os>(iface), ...);
  }

  template <class... Sigs>
  void interface(const char* iface, caf::detail::type_list<Sigs...>) {
    (signature(iface, static_cast<Sigs*>(nullptr)), ...);
  }

  template <class Handle>
  void of(const char* iface) {
    interface(iface, typename Handle::signatures{});
  }
};

}  // namespace

TEST_CASE("every argument and reply of every actor interface is registered to cross processes") {
  caf::actor_system_config cfg;
  register_message_types(cfg);
  caf::actor_system sys{cfg};
  type_check c{sys, {}};
  c.of<request_actor>("request_actor");
  c.of<client_sink_actor>("client_sink_actor");
  c.of<decode_rank_actor>("decode_rank_actor");
  c.of<prefill_rank_actor>("prefill_rank_actor");
  c.of<prefill_balancer_actor>("prefill_balancer_actor");
  c.of<decode_balancer_actor>("decode_balancer_actor");
  c.of<elastic_controller_actor>("elastic_controller_actor");
  c.of<router_actor>("router_actor");
  c.of<block_server_actor>("block_server_actor");
  c.of<block_index_actor>("block_index_actor");
  c.of<store_host_actor>("store_host_actor");
  c.of<node_directory_actor>("node_directory_actor");
  c.of<node_agent_actor>("node_agent_actor");
  std::string list;
  for (const auto& m : c.missing) list += "\n  " + m;
  CHECK_MESSAGE(c.missing.empty(), "not registered:" << list);
  // The check itself: a type nobody registered is found.
  type_check self_test{sys, {}};
  self_test.element<std::vector<double>>("a test's");
  CHECK(self_test.missing.size() == 1);
}
