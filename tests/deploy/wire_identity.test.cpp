// Who a process is to its peers before any message: the cluster id and the build's wire
// fingerprint (actors/wire_identity.hpp) in CAF's handshake. Two builds whose messages differ
// must refuse each other at connect, by name, instead of misreading each other's messages.

#include <doctest/doctest.h>

#include <string>

#include <caf/event_based_actor.hpp>
#include <caf/io/middleman.hpp>

#include "actors/wire_identity.hpp"
#include "client/net_identity.hpp"
#include "tests/deploy/directory_fixture.hpp"

using namespace baton;

namespace {

/// A process of cluster `cluster`, whose build's handshake says `identity` (a real build's:
/// app_identifier(cluster)).
struct peer {
  caf::actor_system_config cfg;
  caf::actor_system sys;
  static caf::actor_system_config& init(caf::actor_system_config& c, const std::string& identity) {
    test::network_system::init(c);
    c.set("middleman.app-identifiers", std::vector<std::string>{identity});
    return c;
  }
  explicit peer(const std::string& identity) : sys(init(cfg, identity)) {}
};

}  // namespace

TEST_CASE("the wire fingerprint is a hex hash, and a process's handshake names its cluster and that fingerprint") {
  const std::string fp = wire_fingerprint();
  CHECK(fp.size() == 12);
  CHECK(fp.find_first_not_of("0123456789abcdef") == std::string::npos);
  CHECK(app_identifier("prod") == "baton-cluster:prod/wire:" + fp);
  caf::actor_system_config cfg;
  net::apply_identity(cfg, "prod", "", "", "");
  CHECK(caf::get_or(cfg, "middleman.app-identifiers", std::vector<std::string>{}) ==
        std::vector<std::string>{app_identifier("prod")});
}

TEST_CASE("a process of a build whose messages differ is refused at connect, and the error names the wire "
          "fingerprint to compare; one of the same build and cluster connects") {
  peer head{app_identifier("t")};
  auto echo = head.sys.spawn([]() -> caf::behavior { return {[](int32_t x) { return x; }}; });
  auto port = head.sys.middleman().publish(echo, 0, "127.0.0.1", true);
  REQUIRE(port);

  peer same{app_identifier("t")};
  auto ok = same.sys.middleman().remote_actor("127.0.0.1", *port);
  CHECK(ok);

  peer older{"baton-cluster:t/wire:000000000000"};
  auto refused = older.sys.middleman().remote_actor("127.0.0.1", *port);
  REQUIRE_FALSE(refused);
  CHECK(refused.error() == caf::sec::incompatible_application_ids);
  const auto why = net::explain_connect_error(older.sys, refused.error(), false);
  CHECK(why.find("another cluster") != std::string::npos);
  CHECK(why.find("wire fingerprint") != std::string::npos);
  CHECK(why.find(wire_fingerprint()) != std::string::npos);

  caf::anon_send_exit(echo, caf::exit_reason::user_shutdown);
}
