#pragma once

// A block server whose disk is modelled (issue 8): the sim's stand-in for a 3FS storage node.
// It speaks the real block server's protocol (actors/block_server.hpp) to the real block index
// and ranks, but keeps no files: it remembers which blocks were written (and their layer
// checksums, which is all a reader verifies against), and every read or write takes virtual
// time on one FIFO queue per server -- the node's disks and NIC together, at `gbps` -- so
// concurrent loads slow each other down. A read also crosses the reader's PCIe (host memory to
// GPU, seed 000 §2.3), one FIFO queue per reading instance shared by every server: a read moves
// at the slower of the two, and holds both. It announces each layer as its share of the time
// passes, so a prefill computing while its prefix streams in waits layer by layer. (Write-backs
// leave the GPU the other way, device to host, which nothing else in the sim uses: not queued.)
// Only actor .cpp files and tests include this header (it pulls in CAF).

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "actors/block_server.hpp"

namespace baton::sims {

struct modelled_store_config {
  double gbps = 40;          ///< one server's read/write bandwidth, GB/s (a 3FS node: ~37 GB/s of reads)
  double bytes_scale = 1.0;  ///< real bytes per carrier byte (the modelled model's KV over the carrier's)
  double latency_us = 100;   ///< per request (NVMe access and a network round trip)
  double pcie_gbps = 0;      ///< each reading instance's host-to-device bandwidth, GB/s; 0: not modelled
  /// When each reader's PCIe is next free, by reader name: shared by all servers of a sim.
  std::shared_ptr<std::map<std::string, std::chrono::steady_clock::time_point>> pcie_free =
      std::make_shared<std::map<std::string, std::chrono::steady_clock::time_point>>();
};

/// Spawns one modelled block server (the signature of local_cluster's block_server_factory).
block_server_actor spawn_modelled_block_server(caf::actor_system& sys, block_server_config cfg,
                                               std::shared_ptr<transport::transport> xport,
                                               std::vector<block_index_actor> index, modelled_store_config m);

}  // namespace baton::sims
