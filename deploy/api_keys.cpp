#include "deploy/api_keys.hpp"

#include <sys/stat.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>

#include <nlohmann/json.hpp>

#include "deploy/http.hpp"
#include "gpu/text_file.hpp"

namespace baton::deploy {

namespace {

using nlohmann::json;

bool valid_name(const std::string& name) {
  return !name.empty() && name.size() <= 64 && std::all_of(name.begin(), name.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-' || c == '.';
  });
}

/// What a client can send after "Bearer ": visible ASCII, no spaces.
bool bearer_token(const std::string& key) {
  return std::all_of(key.begin(), key.end(), [](char c) { return c > 0x20 && c < 0x7f; });
}

}  // namespace

bool parse_api_keys(std::string_view text, std::vector<api_key>* out, std::string* why) {
  const auto j = json::parse(text, nullptr, false);
  if (j.is_discarded()) {
    *why = "the keys file is not JSON";
    return false;
  }
  if (!j.is_object() || !j.contains("keys") || !j["keys"].is_array()) {
    *why = "the keys file must be {\"keys\": [{\"name\": ..., \"key\": ...}, ...]}";
    return false;
  }
  for (const auto& [field, v] : j.items())
    if (field != "keys") {
      *why = "the keys file has the unknown field '" + field + "' beside \"keys\"";
      return false;
    }
  std::vector<api_key> keys;
  for (size_t i = 0; i < j["keys"].size(); ++i) {
    const auto& e = j["keys"][i];
    const std::string at = "keys[" + std::to_string(i) + "]";
    if (!e.is_object()) {
      *why = at + " must be an object";
      return false;
    }
    api_key k;
    for (const auto& [field, v] : e.items()) {
      if (field == "name" && v.is_string() && valid_name(v.get<std::string>())) {
        k.name = v.get<std::string>();
      } else if (field == "name") {
        *why = at + ".name must be 1 to 64 letters, digits, _, - or ., got " + v.dump();
        return false;
      } else if (field == "key" && v.is_string() && v.get<std::string>().size() >= 8 && bearer_token(v.get<std::string>())) {
        k.key = v.get<std::string>();
      } else if (field == "key") {  // (never the key itself in the error: logs)
        *why = at + ".key must be a string of at least 8 visible ASCII characters, no spaces (a client sends it in an "
                    "Authorization: Bearer header)";
        return false;
      } else if (field == "max_in_flight" && v.is_number_unsigned() && v.get<uint64_t>() <= UINT32_MAX) {
        k.max_in_flight = v.get<uint32_t>();
      } else if (field == "max_in_flight") {
        *why = at + ".max_in_flight must be an integer from 0 (no limit) to 4294967295, got " + v.dump();
        return false;
      } else if (field == "max_tokens" && v.is_number_unsigned() && v.get<uint64_t>() >= 1 && v.get<uint64_t>() <= INT32_MAX) {
        k.max_tokens = v.get<uint32_t>();
      } else if (field == "max_tokens") {
        *why = at + ".max_tokens must be an integer from 1 to 2147483647, got " + v.dump();
        return false;
      } else if (field == "requests_per_minute" && v.is_number_unsigned() && v.get<uint64_t>() <= UINT32_MAX) {
        k.requests_per_minute = v.get<uint32_t>();
      } else if (field == "requests_per_minute") {
        *why = at + ".requests_per_minute must be an integer from 0 (no limit) to 4294967295, got " + v.dump();
        return false;
      } else if (field == "tokens_per_minute" && v.is_number_unsigned()) {
        k.tokens_per_minute = v.get<uint64_t>();
      } else if (field == "tokens_per_minute") {
        *why = at + ".tokens_per_minute must be an integer from 0 (no limit), got " + v.dump();
        return false;
      } else if (field == "priority" && (v == "batch" || v == "interactive")) {
        k.batch = v == "batch";
      } else if (field == "priority") {
        *why = at + ".priority must be \"interactive\" (the calls choose) or \"batch\" (always), got " + v.dump();
        return false;
      } else {
        *why = at + " has the unknown field '" + field +
               "' (name, key, max_in_flight, max_tokens, requests_per_minute, tokens_per_minute and priority are known)";
        return false;
      }
    }
    if (k.name.empty() || k.key.empty()) {
      *why = at + " needs a name and a key";
      return false;
    }
    keys.push_back(std::move(k));
  }
  if (keys.empty()) {
    *why = "the keys file lists no key (serving without authentication asks for no file)";
    return false;
  }
  *out = std::move(keys);
  return true;
}

bool read_api_keys_file(const std::string& path, std::vector<api_key>* out, std::string* why) {
  std::string text;
  if (!gpu::read_text_file(path, &text)) {
    *why = "cannot read the API keys file " + path;
    return false;
  }
  if (parse_api_keys(text, out, why)) return true;
  *why = path + ": " + *why;
  return false;
}

bool merge_api_keys(std::vector<api_key> named, const std::vector<std::string>& plain, std::vector<api_key>* out,
                    std::string* why) {
  // A plain key given twice (--api-key and BATON_API_KEYS alike) is one caller: kept once.
  size_t number = 0;
  for (size_t i = 0; i < plain.size(); ++i)
    if (!bearer_token(plain[i])) {
      *why = "API key " + std::to_string(i + 1) + " (--api-key, BATON_API_KEYS) has a space or a control character: no "
             "client could send it";
      return false;
    } else if (std::find(plain.begin(), plain.begin() + static_cast<std::ptrdiff_t>(i), plain[i]) == plain.begin() + static_cast<std::ptrdiff_t>(i))
      named.push_back({"key-" + std::to_string(++number), plain[i], 0, false});
  std::map<std::string, std::string> names, secrets;  // name -> the key's, key -> its name
  for (const auto& k : named) {
    if (!names.emplace(k.name, k.key).second) {
      *why = "the API key name '" + k.name + "' is given twice" +
             (k.name.rfind("key-", 0) == 0 ? " (plain keys are named key-1, key-2, ...)" : "");
      return false;
    }
    if (auto [at, fresh] = secrets.emplace(k.key, k.name); !fresh) {
      *why = "the API key named '" + k.name + "' is the same key as '" + at->second +
             "' (one key, one name: its calls are counted and limited under it)";
      return false;
    }
  }
  *out = std::move(named);
  return true;
}

std::string describe_api_keys(const std::vector<api_key>& keys) {
  std::string out;
  for (const auto& k : keys) {
    out += (out.empty() ? "" : ", ") + k.name + " (" + (k.batch ? "batch; " : "") +
           (k.max_in_flight ? "at most " + std::to_string(k.max_in_flight) + " in flight"
            : k.max_tokens || k.requests_per_minute || k.tokens_per_minute ? std::string{"no in-flight limit"}
                                                                           : std::string{"no limit of its own"}) +
           (k.max_tokens ? "; max_tokens at most " + std::to_string(k.max_tokens) : "") +
           (k.requests_per_minute ? "; " + std::to_string(k.requests_per_minute) + " calls a minute" : "") +
           (k.tokens_per_minute ? "; " + std::to_string(k.tokens_per_minute) + " tokens a minute" : "") + ")";
  }
  return out;
}

std::string file_stamp(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return {};
  return std::to_string(st.st_ino) + ":" + std::to_string(st.st_size) + ":" + std::to_string(st.st_mtim.tv_sec) + "." +
         std::to_string(st.st_mtim.tv_nsec);
}

std::vector<api_key_ptr> renew_api_keys(const std::vector<api_key_ptr>& now, std::vector<api_key> keys) {
  std::vector<api_key_ptr> out;
  for (auto& k : keys) {
    const auto same = std::find_if(now.begin(), now.end(), [&](const api_key_ptr& s) { return s->cfg.name == k.name; });
    if (same == now.end()) {
      out.push_back(std::make_shared<api_key_state>(std::move(k)));
      continue;
    }
    auto& s = **same;
    s.max_in_flight = k.max_in_flight;  // (cfg's limits stay as first read: nothing reads them)
    s.batch = k.batch;
    s.max_tokens = k.max_tokens;
    s.set_budgets(k.requests_per_minute, k.tokens_per_minute);
    s.cfg.key = std::move(k.key);
    out.push_back(*same);
  }
  return out;
}

namespace {

double seconds_now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

api_key_state::api_key_state(api_key k)
  : cfg(std::move(k)), max_in_flight(cfg.max_in_flight), batch(cfg.batch), max_tokens(cfg.max_tokens) {
  const double now = seconds_now();
  requests = policies::minute_budget::full(cfg.requests_per_minute, now);
  tokens = policies::minute_budget::full(static_cast<double>(cfg.tokens_per_minute), now);
}

bool api_key_state::admit_call(std::string* why, std::string* budget, uint32_t* retry_after_ms) {
  std::lock_guard<std::mutex> lock{mutex};
  const double now = seconds_now();
  double wait = 0;
  // Tokens first: a call refused for them spends no request.
  if (!tokens.admit(now, 0, &wait)) {
    *why = "the API key '" + cfg.name + "' has used its tokens_per_minute (" +
           std::to_string(static_cast<uint64_t>(tokens.per_minute)) + " prompt and generated tokens a minute)";
    ++limited_tokens;
    *budget = "tokens";
  } else if (!requests.admit(now, 1, &wait)) {
    *why = "the API key '" + cfg.name + "' has used its requests_per_minute (" +
           std::to_string(static_cast<uint64_t>(requests.per_minute)) + " calls a minute)";
    ++limited_requests;
    *budget = "requests";
  } else {
    return true;
  }
  // (A day at most: a key overspent by far more is better told to ask again then.)
  *retry_after_ms = static_cast<uint32_t>(std::clamp(std::ceil(wait * 1000.0), 1.0, 86400e3));
  *why += ": retry in " + std::to_string((*retry_after_ms + 999) / 1000) + " s";
  ++limited;
  return false;
}

void api_key_state::charge_tokens(uint64_t n) {
  std::lock_guard<std::mutex> lock{mutex};
  tokens.charge(seconds_now(), static_cast<double>(n));
}

void api_key_state::refund_request() {
  std::lock_guard<std::mutex> lock{mutex};
  requests.charge(seconds_now(), -1.0);
}

std::pair<double, double> api_key_state::budgets_now() {
  std::lock_guard<std::mutex> lock{mutex};
  return {requests.per_minute, tokens.per_minute};
}

void api_key_state::set_budgets(uint32_t requests_per_minute, uint64_t tokens_per_minute) {
  std::lock_guard<std::mutex> lock{mutex};
  const double now = seconds_now();
  requests.set_rate(requests_per_minute, now);
  tokens.set_rate(static_cast<double>(tokens_per_minute), now);
}

void api_key_state::count_response(int status) {
  std::lock_guard<std::mutex> lock{mutex};
  ++responses[status];
}

std::map<int, uint64_t> api_key_state::responses_now() {
  std::lock_guard<std::mutex> lock{mutex};
  return responses;
}

api_key_ptr find_api_key(const std::vector<api_key_ptr>& keys, std::string_view bearer) {
  api_key_ptr found;
  for (const auto& k : keys)  // every key compared: no early exit
    if (http::constant_time_equal(bearer, k->cfg.key) && !found) found = k;
  return found;
}

in_flight_hold::~in_flight_hold() { release(); }

void in_flight_hold::release() {
  if (const uint32_t n = n_.exchange(0); n && key_) key_->in_flight -= n;
}

bool in_flight_hold::take(const api_key_ptr& key, uint32_t n, uint32_t* had) {
  const uint32_t limit = key->max_in_flight.load();
  uint32_t now = key->in_flight.load();
  do {
    *had = now;
    if (limit && (now > limit || n > limit - now)) {
      ++key->limited;
      return false;
    }
  } while (!key->in_flight.compare_exchange_weak(now, now + n));
  release();  // (a hold is taken once; a second take moves it)
  key_ = key;
  n_ = n;
  return true;
}

}  // namespace baton::deploy
