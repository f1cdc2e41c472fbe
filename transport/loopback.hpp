#pragma once

#include <memory>

#include "transport/transport.hpp"

namespace baton::transport {

/// The regions of one process, shared by every loopback endpoint in it: the in-process
/// "network". Ranks in one process each get an endpoint on the same fabric.
class loopback_fabric;

std::shared_ptr<loopback_fabric> make_loopback_fabric();

/// An in-process backend that really copies bytes (memcpy) from the local region into the
/// peer's region; puts complete during post.
std::unique_ptr<transport> make_loopback_transport(std::shared_ptr<loopback_fabric> fabric, std::string name);
/// The same, but a put is checked (regions, bounds) and completes without copying a byte: the
/// link of sims whose modelled executors write no KV (copying it would be most of their time).
std::unique_ptr<transport> make_modelled_link(std::shared_ptr<loopback_fabric> fabric, std::string name);

}  // namespace baton::transport
