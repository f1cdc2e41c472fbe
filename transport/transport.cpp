#include "transport/transport.hpp"

namespace baton::transport {

std::string xfer_error::to_string() const {
  std::string out = "request " + std::to_string(request_id);
  if (!peer.empty()) out += ", peer " + peer;
  out += ", layer " + std::to_string(layer) + ": " + what;
  out += retryable ? " (retryable)" : " (fatal)";
  return out;
}

}  // namespace baton::transport
