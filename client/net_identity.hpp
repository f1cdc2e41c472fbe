#pragma once

// Who a Baton process is to its peers, shared by the client library and deploy/'s commands:
// the cluster id and the build's wire fingerprint (CAF's middleman.app-identifiers: processes of
// different clusters, or of builds whose messages differ, refuse each other in the handshake)
// and, with certificate files, mutual TLS through CAF's OpenSSL module.
// Header-only and internal: included by CAF translation units (client.cpp, deploy/processes.cpp,
// deploy/net_security.hpp), never by client/baton/client.hpp.

#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include <caf/actor_system.hpp>
#include <caf/actor_system_config.hpp>
#include <caf/error.hpp>
#include <caf/io/middleman.hpp>
#include <caf/openssl/manager.hpp>
#include <caf/scoped_actor.hpp>
#include <caf/sec.hpp>

#include "actors/wire_identity.hpp"

namespace baton::net {

/// Puts the cluster id and, when `tls_cert` is set, the OpenSSL module and its files into `cfg`.
inline void apply_identity(caf::actor_system_config& cfg, const std::string& cluster_id, const std::string& tls_cert,
                           const std::string& tls_key, const std::string& tls_ca) {
  cfg.set("middleman.app-identifiers", std::vector<std::string>{app_identifier(cluster_id)});
  if (tls_cert.empty()) return;
  cfg.load<caf::openssl::manager>();
  cfg.openssl_certificate = tls_cert;
  cfg.openssl_key = tls_key;
  cfg.openssl_cafile = tls_ca;
}

/// A failed connection's error, rendered, with what to check when it is the cluster id or TLS.
inline std::string explain_connect_error(caf::actor_system& sys, const caf::error& err, bool tls) {
  // Not CAF's words here: they list every message of both interfaces, a screenful.
  if (err == caf::sec::unexpected_actor_messaging_interface)
    return "another Baton actor listens there, not the one asked for (a head publishes its router on "
           "--router-listen and its node directory on --cluster-listen; a store node its block store on --listen)";
  std::string out = sys.render(err);
  if (err == caf::sec::incompatible_application_ids)
    out += std::string{" (the peer belongs to another cluster, or is a Baton build whose messages differ from this "
                       "one's: check the cluster id, and that `baton --version` prints the same wire fingerprint, "
                       "here "} + wire_fingerprint() + ", on every host)";
  else if (err == caf::sec::disconnect_during_handshake)
    out += tls ? " (the TLS handshake failed: is the certificate signed by the peer's cluster CA, and does the peer "
                 "speak TLS?)"
               : " (the peer may require mutual TLS: give the cluster's certificate, key and CA)";
  return out;
}

/// Whether something at host:port accepts a TCP connection within `timeout_ms`: 0 if so,
/// ETIMEDOUT if nothing answered in time (packets dropped, a full listen queue), another errno
/// (ECONNREFUSED, ...) or EAI_FAIL-like -1 when the name does not resolve. The connection is
/// closed at once. (CAF's own connect waits out the kernel's SYN retries, minutes, when
/// packets are dropped.)
inline int tcp_probe(const std::string& host, uint16_t port, int timeout_ms) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found) != 0) return -1;
  int result = ECONNREFUSED;
  for (auto* a = found; a && result != 0; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    if (::connect(fd, a->ai_addr, a->ai_addrlen) == 0) {
      result = 0;
    } else if (errno == EINPROGRESS) {
      pollfd p{fd, POLLOUT, 0};
      int err = 0;
      socklen_t len = sizeof err;
      const int ready = ::poll(&p, 1, timeout_ms);
      if (ready == 0)
        result = ETIMEDOUT;
      else if (ready == 1 && ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) == 0)
        result = err;
    } else {
      result = errno;
    }
    ::close(fd);
  }
  ::freeaddrinfo(found);
  return result;
}

/// Connects to the CAF peer at host:port (plain TCP) within `limit`; an error when it cannot. CAF
/// waits for a peer's handshake without a limit, so a port where another kind of server listens
/// (an HTTP one waits for a request) hung the caller for good. On success the middleman keeps
/// the connection, and remote_actor then takes it at once, checking the published interface.
/// (A connect given up on stays pending in the middleman: asked again, host:port joins it.)
/// `via`: the middleman that connects (TLS: the OpenSSL manager's); null: the plain one.
inline caf::error handshake_within(caf::actor_system& sys, const std::string& host, uint16_t port,
                                   std::chrono::milliseconds limit = std::chrono::seconds{10},
                                   const caf::io::middleman_actor* via = nullptr) {
  caf::scoped_actor self{sys};
  caf::error out;
  self->request(via ? *via : sys.middleman().actor_handle(), limit, caf::connect_atom::value, host, port)
      .receive([](caf::node_id&, caf::strong_actor_ptr&, std::set<std::string>&) {},
               [&](caf::error& e) { out = std::move(e); });
  if (out == caf::sec::request_timeout)
    return caf::make_error(caf::sec::request_timeout,
                           "no Baton handshake from " + host + ":" + std::to_string(port) + " within " +
                               std::to_string(limit.count()) +
                               " ms (the name resolution, the TCP connection and the handshake together): nothing "
                               "reachable there, or another kind of server (an HTTP port, say)");
  return out;
}

}  // namespace baton::net
