#pragma once

// What a Baton process tells a peer about itself in CAF's handshake (middleman.app-identifiers),
// before any message: its cluster and its build's wire fingerprint. Defined in message_types.cpp;
// kept apart from messages.hpp so that `baton --version` need not include CAF.

#include <string>

namespace baton {

/// This build's wire fingerprint: a hash of the files that define the messages its processes
/// send each other (top-level CMakeLists.txt, BATON_WIRE_FILES). `baton --version` prints it.
const char* wire_fingerprint();

/// What a process of cluster `cluster_id` puts in the handshake: the cluster id and the wire
/// fingerprint, so that a process of another cluster, and one of a build whose messages differ,
/// are both refused at connect (instead of misreading each other's messages).
std::string app_identifier(const std::string& cluster_id);

}  // namespace baton
