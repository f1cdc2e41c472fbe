#pragma once

// Who may talk to whom between Baton's processes (issue 10): every process carries its
// cluster's id (CAF's middleman.app-identifiers: a process of another cluster is refused in the
// handshake), and with a certificate, key and cluster CA every connection is mutual TLS through
// CAF's OpenSSL module: a peer without a certificate signed by the cluster CA cannot connect
// (`baton launch` makes the CA and the certificates when the spec asks for TLS). CAF 0.17's own
// network layer puts no cap on a message's size: a peer that passes these checks is trusted.
// Only deploy/ and client/ command files include this header (it pulls in CAF's network layer).

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <thread>

#include <caf/actor_system.hpp>
#include <caf/actor_system_config.hpp>
#include <caf/expected.hpp>
#include <caf/io/middleman.hpp>
#include <caf/openssl/manager.hpp>
#include <caf/openssl/publish.hpp>
#include <caf/openssl/remote_actor.hpp>

#include "client/net_identity.hpp"
#include "deploy/processes.hpp"

namespace baton::deploy {

/// Puts the cluster id and, with TLS, the OpenSSL module and its files into `cfg`.
void apply_net_security(caf::actor_system_config& cfg, const net_security& sec);

/// Publishes `handle` (typed: its interface is published too) over TLS or plain TCP.
template <class Handle>
caf::expected<uint16_t> publish_actor(caf::actor_system& sys, const net_security& sec, const Handle& handle,
                                      uint16_t port, const std::string& host) {
  auto bound = sec.tls() ? caf::openssl::publish(handle, port, host.c_str(), true)
                         : sys.middleman().publish(handle, port, host.c_str(), true);
  if (!bound && bound.error() == caf::sec::cannot_open_port)  // CAF says only "tcp socket creation failed"
    if (auto why = why_cannot_bind(host, port); !why.empty())
      return caf::make_error(caf::sec::cannot_open_port, host + ":" + std::to_string(port) + ": " + why);
  return bound;
}

using net::explain_connect_error;

/// Connects to the actor published at host:port over TLS or plain TCP (the handshake within 10 s:
/// net::handshake_within).
template <class Handle>
caf::expected<Handle> connect_actor(caf::actor_system& sys, const net_security& sec, const std::string& host,
                                    uint16_t port) {
  if (sec.tls()) {
    if (auto err = net::handshake_within(sys, host, port, std::chrono::seconds{10}, &sys.openssl_manager().actor_handle()))
      return err;
    return caf::openssl::remote_actor<Handle>(sys, host, port);
  }
  if (auto err = net::handshake_within(sys, host, port)) return err;
  return sys.middleman().remote_actor<Handle>(host, port);
}

/// connect_actor, tried again every 250 ms until it works, `deadline` passes or `give_up()` says
/// so (a head that is starting, or restarting); `*last` holds the last failure's sentence. An
/// answer that is `gone` (the actor that went away: CAF's middleman hands out its cached proxy
/// until it has processed the loss) does not count.
template <class Handle>
std::optional<Handle> connect_actor_until(caf::actor_system& sys, const net_security& sec, const std::string& host,
                                          uint16_t port, std::chrono::steady_clock::time_point deadline,
                                          const std::function<bool()>& give_up, std::string* last,
                                          const Handle& gone = {}) {
  while (!give_up() && std::chrono::steady_clock::now() < deadline) {
    auto d = connect_actor<Handle>(sys, sec, host, port);
    if (d && (!gone || *d != gone)) return *d;
    *last = d ? std::string{"only the head that went away answers there"} : explain_connect_error(sys, d.error(), sec.tls());
    std::this_thread::sleep_for(std::chrono::milliseconds{250});
  }
  return std::nullopt;
}

}  // namespace baton::deploy
