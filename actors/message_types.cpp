#include <caf/actor_system_config.hpp>
#include <caf/message.hpp>

#include "actors/messages.hpp"
#include "actors/wire_identity.hpp"
#include "baton/wire_fingerprint.hpp"

namespace baton {

std::string to_string(errc x) {
  switch (x) {
    case errc::bad_request: return "bad_request";
    case errc::kv_capacity: return "kv_capacity";
    case errc::rank_unavailable: return "rank_unavailable";
    case errc::deadline_exceeded: return "deadline_exceeded";
    case errc::transfer_failed: return "transfer_failed";
    case errc::executor_failed: return "executor_failed";
    case errc::lease_expired: return "lease_expired";
    case errc::layout_mismatch: return "layout_mismatch";
    case errc::cancelled: return "cancelled";
    case errc::overloaded: return "overloaded";
    case errc::shutting_down: return "shutting_down";
    case errc::router_unavailable: return "router_unavailable";
  }
  return "unknown";
}

bool is_retryable(errc x) {
  switch (x) {
    case errc::kv_capacity:
    case errc::rank_unavailable:
    case errc::deadline_exceeded:
    case errc::transfer_failed:
    case errc::lease_expired:
    case errc::overloaded:
    case errc::shutting_down:
    case errc::router_unavailable: return true;
    default: return false;
  }
}

const char* wire_fingerprint() { return BATON_WIRE_FINGERPRINT; }

std::string app_identifier(const std::string& cluster_id) {
  return "baton-cluster:" + cluster_id + "/wire:" + wire_fingerprint();
}

caf::error make_error(errc code, std::string context) {
  return caf::error{static_cast<uint8_t>(code), caf::atom("baton"), caf::make_message(std::move(context))};
}

std::string where(uint64_t request_id, const std::string& rank, const std::string& stage) {
  std::string out = "request " + std::to_string(request_id);
  if (!rank.empty()) out += ", rank " + rank;
  return out + ", stage " + stage;
}

std::string quoted_input(std::string_view value, size_t max_bytes) {
  std::string out;
  for (size_t i = 0; i < value.size() && i < max_bytes; ++i) {
    const auto c = static_cast<unsigned char>(value[i]);
    if (c < 0x20 || c >= 0x7f || c == '\\') {  // a backslash too: "\\x0a" sent is not a newline
      static constexpr char hex[] = "0123456789abcdef";
      out += "\\x";
      out += hex[c >> 4];
      out += hex[c & 15];
    } else {
      out += static_cast<char>(c);
    }
  }
  if (value.size() > max_bytes) out += "...";
  return out;
}

void register_message_types(caf::actor_system_config& cfg) {
  cfg.add_message_type<chat_turn>("baton::chat_turn")
      .add_message_type<std::vector<chat_turn>>("std::vector<baton::chat_turn>")
      .add_message_type<generate_request>("baton::generate_request")
      .add_message_type<completion>("baton::completion")
      .add_message_type<kv_lease_reserve>("baton::kv_lease_reserve")
      .add_message_type<kv_region_desc>("baton::kv_region_desc")
      .add_message_type<kv_wire_region>("baton::kv_wire_region")
      .add_message_type<kv_lease_grant>("baton::kv_lease_grant")
      .add_message_type<kv_layer_ready>("baton::kv_layer_ready")
      .add_message_type<token_event>("baton::token_event")
      .add_message_type<decode_summary>("baton::decode_summary")
      .add_message_type<prefill_result>("baton::prefill_result")
      .add_message_type<rank_event>("baton::rank_event")
      .add_message_type<std::vector<rank_event>>("std::vector<baton::rank_event>")
      .add_message_type<rank_stats>("baton::rank_stats")
      .add_message_type<role_change>("baton::role_change")
      .add_message_type<controller_join>("baton::controller_join")
      .add_message_type<std::vector<role_change>>("std::vector<baton::role_change>")
      .add_message_type<decode_order>("baton::decode_order")
      .add_message_type<prefill_order>("baton::prefill_order")
      .add_message_type<rank_load>("baton::rank_load")
      .add_message_type<std::vector<rank_load>>("std::vector<baton::rank_load>")
      .add_message_type<prefill_placement>("baton::prefill_placement")
      .add_message_type<place_query>("baton::place_query")
      .add_message_type<block_ref>("baton::block_ref")
      .add_message_type<std::vector<block_ref>>("std::vector<baton::block_ref>")
      .add_message_type<store_read_order>("baton::store_read_order")
      .add_message_type<store_read_result>("baton::store_read_result")
      .add_message_type<store_layer_landed>("baton::store_layer_landed")
      .add_message_type<split_peer>("baton::split_peer")
      .add_message_type<split_layer>("baton::split_layer")
      .add_message_type<split_abort>("baton::split_abort")
      .add_message_type<std::vector<prefill_rank_actor>>("std::vector<baton::prefill_rank_actor>")
      .add_message_type<std::vector<caf::actor>>("std::vector<caf::actor>")
      .add_message_type<store_write_order>("baton::store_write_order")
      .add_message_type<store_write_begin>("baton::store_write_begin")
      .add_message_type<store_write_slot>("baton::store_write_slot")
      .add_message_type<block_commit>("baton::block_commit")
      .add_message_type<std::vector<block_commit>>("std::vector<baton::block_commit>")
      .add_message_type<store_stats>("baton::store_stats")
      .add_message_type<store_info>("baton::store_info")
      .add_message_type<std::vector<block_index_actor>>("std::vector<baton::block_index_actor>")
      .add_message_type<std::vector<std::vector<uint64_t>>>("std::vector<std::vector<uint64_t>>")
      .add_message_type<std::vector<uint64_t>>("std::vector<uint64_t>")  // touch_atom's keys
      .add_message_type<std::vector<uint32_t>>("std::vector<uint32_t>")  // member_gone_atom's members
      .add_message_type<std::vector<int32_t>>("std::vector<int32_t>")
      .add_message_type<gpu::forward_output>("baton::gpu::forward_output")  // exec_done_atom's
      .add_message_type<gpu::token_logprobs>("baton::gpu::token_logprobs")
      .add_message_type<std::vector<gpu::token_logprobs>>("std::vector<baton::gpu::token_logprobs>")
      .add_message_type<token_logprob>("baton::token_logprob")
      .add_message_type<std::vector<token_logprob>>("std::vector<baton::token_logprob>")
      .add_message_type<block_server_actor>("baton::block_server_actor")
      .add_message_type<block_index_actor>("baton::block_index_actor")
      .add_message_type<std::vector<block_server_actor>>("std::vector<baton::block_server_actor>")
      .add_message_type<placement_record>("baton::placement_record")
      .add_message_type<std::vector<placement_record>>("std::vector<baton::placement_record>")
      .add_message_type<decode_placement>("baton::decode_placement")
      .add_message_type<std::vector<std::vector<float>>>("std::vector<std::vector<float>>")
      // Actor handles that travel as message elements (load reports, placements, orders).
      .add_message_type<request_actor>("baton::request_actor")
      .add_message_type<decode_rank_actor>("baton::decode_rank_actor")
      .add_message_type<prefill_rank_actor>("baton::prefill_rank_actor")
      .add_message_type<prefill_balancer_actor>("baton::prefill_balancer_actor")
      .add_message_type<decode_balancer_actor>("baton::decode_balancer_actor")
      .add_message_type<router_actor>("baton::router_actor")
      .add_message_type<node_stats_actor>("baton::node_stats_actor")
      .add_message_type<stream_chunk>("baton::stream_chunk")
      .add_message_type<client_sink_actor>("baton::client_sink_actor")
      .add_message_type<cluster_stats>("baton::cluster_stats")
      .add_message_type<node_hello>("baton::node_hello")
      .add_message_type<cluster_welcome>("baton::cluster_welcome")
      .add_message_type<node_ranks>("baton::node_ranks")
      .add_message_type<store_adoption>("baton::store_adoption")
      .add_message_type<store_host_actor>("baton::store_host_actor")
      .add_message_type<node_status>("baton::node_status")
      .add_message_type<std::vector<node_status>>("std::vector<baton::node_status>")
      .add_message_type<node_directory_actor>("baton::node_directory_actor")
      .add_message_type<std::vector<decode_rank_actor>>("std::vector<baton::decode_rank_actor>")
      .add_message_type<std::vector<std::string>>("std::vector<std::string>");
  // Every Baton process carries a cluster id in CAF's handshake; this is the default one
  // (deploy's --cluster-id replaces it: processes of different clusters refuse each other).
  cfg.set("middleman.app-identifiers", std::vector<std::string>{app_identifier("baton")});
  cfg.add_error_category(caf::atom("baton"), [](uint8_t code, caf::atom_value, const caf::message& ctx) {
    std::string out = "baton::" + to_string(static_cast<errc>(code));
    if (ctx.match_elements<std::string>()) out += ": " + ctx.get_as<std::string>(0);
    return out;
  });
}

}  // namespace baton
