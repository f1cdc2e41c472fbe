#pragma once

// `baton status`: what a running cluster is made of, as an operator reads it -- the head's node
// directory (each node process, its roles, pid, state and last heartbeat; nodes that went keep
// their entry as "gone") and the router's view of the ranks (taking work or why not, running,
// queued tokens, free KV pages). Pure: the command asks, these render.

#include <string>
#include <vector>

namespace baton {
struct node_status;
struct cluster_stats;
}  // namespace baton

namespace baton::deploy {

/// Two tables, "nodes" then "ranks"; either may be null (not asked, or its actor did not answer:
/// `nodes_why` / `ranks_why` say which, in place of the table).
std::string status_text(const std::vector<node_status>* nodes, const std::string& nodes_why,
                        const cluster_stats* ranks, const std::string& ranks_why);

/// The same as one JSON object: {"nodes": [...] | null, "nodes_error": "..."?, "ranks": [...] |
/// null, "ranks_error": "..."?, "placements_waiting": {"prefill": N, "decode": N}?, "store_servers":
/// {"total": N, "answering": M}? (with a store)}.
std::string status_json(const std::vector<node_status>* nodes, const std::string& nodes_why,
                        const cluster_stats* ranks, const std::string& ranks_why);

}  // namespace baton::deploy
