#pragma once

// How the cluster's failures read over HTTP: each error's status, and OpenAI's error object with
// the request field it is about (`param`) and, for a few, OpenAI's `code`.

#include <string>
#include <string_view>
#include <utility>

#include "deploy/openai.hpp"

namespace caf {
class actor_system;
class error;
}  // namespace caf

namespace baton::deploy {

/// The HTTP status and message for a failed generation.
std::pair<int, std::string> status_of(caf::actor_system& sys, const caf::error& err);

/// The request field a router's refusal is about, as OpenAI's `param` (empty: none).
std::string param_of(std::string_view message);

/// OpenAI's error object for an answer of `status` saying `message`.
openai::api_error api_error_of(int status, std::string message);

}  // namespace baton::deploy
