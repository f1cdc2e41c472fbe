#include "deploy/gateway_errors.hpp"

#include <caf/actor_system.hpp>
#include <caf/error.hpp>
#include <caf/sec.hpp>

#include "actors/atoms_and_errors.hpp"

namespace baton::deploy {

std::pair<int, std::string> status_of(caf::actor_system& sys, const caf::error& err) {
  if (err.category() == caf::atom("baton")) {
    std::string msg = err.context().match_elements<std::string>() ? err.context().get_as<std::string>(0) : sys.render(err);
    switch (static_cast<errc>(err.code())) {
      case errc::bad_request: return {400, msg};
      case errc::deadline_exceeded: return {504, msg};
      case errc::executor_failed:
      case errc::layout_mismatch: return {500, msg};
      case errc::cancelled: return {499, msg};
      case errc::overloaded: return {429, msg};
      default: return {503, msg};  // retryable: capacity, ranks, transfers, leases
    }
  }
  if (err == caf::sec::request_timeout) return {504, "the cluster did not answer in time"};
  if (err == caf::sec::request_receiver_down) return {503, "the router is not reachable"};
  // The router's process stopped, or the link to it was cut, before it answered.
  if (err.category() == caf::atom("exit"))
    return {503, "the cluster's head went away before answering (" + sys.render(err) + "); retry"};
  return {503, "the router failed the request: " + sys.render(err)};
}

// The router's checks start their sentence with the field ("max_tokens 300 exceeds ...",
// "top_p must be ...").
std::string param_of(std::string_view message) {
  // The decode balancer's "needs 207 tokens of KV, the largest decode rank holds 128 in all":
  // prompt plus max_tokens, of which max_tokens is what a client would lower.
  if (message.find("stage place_decode: needs ") != std::string_view::npos) return "max_tokens";
  constexpr std::string_view stage = "stage admission: ";
  const size_t at = message.find(stage);
  if (at == std::string_view::npos) return {};
  const auto rest = message.substr(at + stage.size());
  size_t n = 0;
  while (n < rest.size() && ((rest[n] >= 'a' && rest[n] <= 'z') || rest[n] == '_')) ++n;
  const auto word = rest.substr(0, n);
  // "prompt of 200 tokens plus max_tokens 100 exceeds the context": the number asked for.
  if (word == "prompt" && rest.find("plus max_tokens") != std::string_view::npos) return "max_tokens";
  for (std::string_view field : {"max_tokens", "prompt", "messages", "tools", "top_p", "temperature", "logit_bias", "stop",
                                 "stop_token_ids", "min_p", "min_tokens", "top_logprobs", "prompt_top_logprobs",
                                 "presence_penalty", "frequency_penalty", "repetition_penalty", "priority",
                                 "traffic_class", "chat_template_kwargs"})
    if (word == field) return std::string{field};
  return {};
}

openai::api_error api_error_of(int status, std::string message) {
  auto param = status == 400 ? param_of(message) : std::string{};
  // The router's refusals of a prompt (plus max_tokens) longer than the context all say so.
  std::string code = status == 400 && (message.find("the model's context of") != std::string::npos ||
                                       message.find("the largest decode rank holds") != std::string::npos)
                         ? "context_length_exceeded"
                         : "";
  // A 429 (the cluster's admission limit) is a limit on requests, OpenAI's type for one.
  const char* type = status == 429 ? "requests" : status < 500 ? "invalid_request_error" : "server_error";
  return {status, std::move(message), type, std::move(param), std::move(code)};
}

}  // namespace baton::deploy
