// client_app HOST PORT PROMPT: streams one completion from a Baton cluster to stdout.
// client_app --version: the library's version and wire fingerprint (a cluster's must match).
#include <baton/client.hpp>

#include <cstdio>
#include <cstdlib>
#include <string>

int main(int argc, char** argv) {
  if (argc == 2 && std::string{argv[1]} == "--version") {
    std::printf("baton client %s, wire %s\n", baton::client::library_version(), baton::client::wire_fingerprint());
    return 0;
  }
  if (argc != 4) {
    std::fprintf(stderr, "usage: client_app HOST PORT PROMPT | --version\n");
    return 2;
  }
  std::string why;
  auto conn = baton::client::connection::connect(argv[1], static_cast<uint16_t>(std::atoi(argv[2])), &why);
  if (!conn) {
    std::fprintf(stderr, "client_app: %s\n", why.c_str());
    return 1;
  }
  baton::client::request req;
  req.prompt = argv[3];
  req.max_tokens = 12;
  auto stream = conn->submit(req);
  baton::client::token_chunk chunk;
  while (stream->next(&chunk)) std::fputs(chunk.text.c_str(), stdout);
  if (stream->failed()) {
    std::fprintf(stderr, "client_app: %s: %s\n", stream->error_info().code.c_str(), stream->error_info().message.c_str());
    return 1;
  }
  std::printf("\n[%zu tokens, %s]\n", stream->final_result().tokens.size(), stream->final_result().finish_reason.c_str());
  return 0;
}
