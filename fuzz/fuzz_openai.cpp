// OpenAI request bodies: any bytes a client POSTs, as a completion or a chat; what parses is
// rendered back as the answers would be.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "deploy/openai.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const bool chat = data[0] & 1;
  std::string_view body(reinterpret_cast<const char*>(data) + 1, size - 1);
  baton::deploy::openai::call c;
  baton::deploy::openai::api_error e;
  if (!baton::deploy::openai::parse_body(body, chat, "m", &c, &e)) {
    (void)baton::deploy::openai::error_json(e);
    return 0;
  }
  baton::completion done;
  done.text = c.req.prompt;  // arbitrary bytes: the JSON writer must cope with invalid UTF-8
  done.finish_reason = "stop";
  (void)baton::deploy::openai::completion_json(c, done, "id", 0);
  baton::stream_chunk chunk;
  chunk.text = c.req.prompt;
  (void)baton::deploy::openai::chunk_json(c, chunk, "id", 0, true);
  return 0;
}
