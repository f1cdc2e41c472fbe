// The gateway's HTTP/1.1 parser and helpers (deploy/http.hpp), without sockets: whole, partial
// and bad requests, pipelining, chunked bodies, limits, and the small helpers the gateway uses.

#include <doctest/doctest.h>

#include <string>

#include "deploy/http.hpp"

using namespace baton;

TEST_CASE("the HTTP parser takes whole requests, waits for partial ones and refuses bad ones with a status") {
  deploy::http::limits lim;
  lim.max_body_bytes = 100;
  deploy::http::request req;
  const std::string two = "POST /v1/completions HTTP/1.1\r\nContent-Length: 2\r\nX-A:  b \r\n\r\n{}GET /health HTTP/1.0\r\n\r\n";
  auto r = deploy::http::parse_request(two, lim, &req);
  REQUIRE(r.status == deploy::http::parse_status::complete);
  CHECK(req.method == "POST");
  CHECK(req.body == "{}");
  CHECK(*req.header("x-a") == "b");
  CHECK(req.keep_alive);
  r = deploy::http::parse_request(std::string_view{two}.substr(r.consumed), lim, &req);
  REQUIRE(r.status == deploy::http::parse_status::complete);
  CHECK(req.path == "/health");
  CHECK_FALSE(req.keep_alive);  // HTTP/1.0 without keep-alive
  CHECK(deploy::http::parse_request("POST / HTTP/1.1\r\nContent-Length: 5\r\n\r\nab", lim, &req).status ==
        deploy::http::parse_status::incomplete);
  CHECK(deploy::http::parse_request("GET / HTTP/1.1\r\nHost: x", lim, &req).status == deploy::http::parse_status::incomplete);
  auto status = [&](const std::string& text) { return deploy::http::parse_request(text, lim, &req).error_status; };
  CHECK(status("POST / HTTP/1.1\r\nContent-Length: 101\r\n\r\n") == 413);
  CHECK(status("POST / HTTP/1.1\r\nContent-Length: -1\r\n\r\n") == 400);
  CHECK(status("POST / HTTP/1.1\r\nTransfer-Encoding: gzip, chunked\r\n\r\n") == 501);
  CHECK(status("POST / HTTP/1.1\r\nTransfer-Encoding: identity\r\nTransfer-Encoding: chunked\r\nContent-Length: 2\r\n\r\n{}") == 501);
  CHECK(status("GET / HTTP/2.0\r\n\r\n") == 505);
  // The absolute form (RFC 9112 §3.2.2, as proxies send it): its path is the target.
  REQUIRE(deploy::http::parse_request("GET http://gw.example:8000/health?x=1 HTTP/1.1\r\n\r\n", lim, &req).status ==
          deploy::http::parse_status::complete);
  CHECK(req.path == "/health");
  CHECK(req.target == "/health?x=1");
  REQUIRE(deploy::http::parse_request("GET HTTPS://gw HTTP/1.1\r\n\r\n", lim, &req).status ==
          deploy::http::parse_status::complete);
  CHECK(req.path == "/");
  REQUIRE(deploy::http::parse_request("GET http://gw?a=/b HTTP/1.1\r\n\r\n", lim, &req).status ==
          deploy::http::parse_status::complete);
  CHECK(req.target == "/?a=/b");
  CHECK(req.path == "/");
  CHECK(status("GET * HTTP/1.1\r\n\r\n") == 400);
  CHECK(status("GET ftp://x/ HTTP/1.1\r\n\r\n") == 400);
  // Control characters in a header's value (a bare CR, a NUL): refused, naming the header.
  CHECK(status("GET / HTTP/1.1\r\nX-A: a\rb\r\n\r\n") == 400);
  CHECK(status(std::string("GET / HTTP/1.1\r\nX-A: a") + '\0' + "b\r\n\r\n") == 400);
  CHECK(deploy::http::parse_request("GET / HTTP/1.1\r\nX-B: a\x01\r\n\r\n", lim, &req).why ==
        "header 'X-B' has a control character in its value");
  CHECK(deploy::http::parse_request("GET / HTTP/1.1\r\nX-A: a\tb\r\n\r\n", lim, &req).status ==
        deploy::http::parse_status::complete);  // HTAB is a value's character
  // Connection: every header's options, close winning.
  REQUIRE(deploy::http::parse_request("GET / HTTP/1.1\r\nConnection: keep-alive\r\nConnection: close\r\n\r\n", lim, &req)
              .status == deploy::http::parse_status::complete);
  CHECK_FALSE(req.keep_alive);
  REQUIRE(deploy::http::parse_request("GET / HTTP/1.0\r\nConnection: Keep-Alive\r\n\r\n", lim, &req).status ==
          deploy::http::parse_status::complete);
  CHECK(req.keep_alive);
  // Options are tokens: one that merely contains "close" keeps the connection.
  REQUIRE(deploy::http::parse_request("GET / HTTP/1.1\r\nConnection: x-enclosed, keep-alive\r\n\r\n", lim, &req).status ==
          deploy::http::parse_status::complete);
  CHECK(req.keep_alive);
  REQUIRE(deploy::http::parse_request("GET / HTTP/1.1\r\nConnection: TE,  Close\r\n\r\n", lim, &req).status ==
          deploy::http::parse_status::complete);
  CHECK_FALSE(req.keep_alive);
  // Two Hosts or two keys: read one way here, another by a proxy in front.
  CHECK(deploy::http::parse_request("GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", lim, &req).why ==
        "more than one Host header");
  CHECK(deploy::http::parse_request("GET / HTTP/1.1\r\nAuthorization: Bearer a\r\nauthorization: Bearer b\r\n\r\n", lim,
                                    &req).why == "more than one Authorization header");
  // An expectation other than 100-continue: 417. A length past any number: 413, not "not a number".
  CHECK(status("GET / HTTP/1.1\r\nExpect: 200-ok\r\n\r\n") == 417);
  CHECK(status("GET / HTTP/1.1\r\nExpect: 100-continue\r\nExpect: 200-ok\r\n\r\n") == 417);  // any of them
  CHECK(status("POST / HTTP/1.1\r\nContent-Length: 99999999999999999999999\r\n\r\n") == 413);
  CHECK(status("POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nffffffffffffffffffffff\r\n") == 413);
  CHECK(deploy::http::parse_request("GET / HTTP/1.1\r\nHost: a, b\r\n\r\n", lim, &req).why ==
        "the Host header names more than one host");
  CHECK(status("GET /\r\n\r\n") == 400);
  // Bare LFs (netcat without -C): refused at once, not left waiting for a CRLF CRLF.
  CHECK(status("GET / HTTP/1.1\nHost: x\n\n") == 400);
  CHECK(status("GET / HTTP/1.1\r\nHost: x\n") == 400);  // even before the head is complete
  CHECK(deploy::http::parse_request("POST / HTTP/1.1\r\nContent-Length: 3\r\n\r\na\nb", lim, &req).status ==
        deploy::http::parse_status::complete);  // a body may hold LFs
  CHECK(status("GET nope HTTP/1.1\r\n\r\n") == 400);
  CHECK(status("GET / HTTP/1.1\r\nno colon\r\n\r\n") == 400);
  CHECK(status(std::string(20000, 'a')) == 431);
  CHECK(status("POST /v1/completions HTTP/1.1\r\nHost: x\r\n\r\n") == 411);  // no Content-Length: say so
  // Empty lines before a request are skipped (RFC 9112 §2.2), and counted in what it consumed;
  // an endless run of them is not.
  r = deploy::http::parse_request("\r\n\r\nGET /health HTTP/1.1\r\n\r\n", lim, &req);
  REQUIRE(r.status == deploy::http::parse_status::complete);
  CHECK(req.path == "/health");
  CHECK(r.consumed == 4 + 24);
  std::string blank;
  for (int i = 0; i < 10000; ++i) blank += "\r\n";
  CHECK(status(blank) == 431);
  CHECK(status("POST / HTTP/1.1\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}x") == 400);  // which body?
  CHECK(deploy::http::parse_request("POST / HTTP/1.1\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\n{}", lim, &req).status ==
        deploy::http::parse_status::complete);
  // Headers in, body not, "Expect: 100-continue": the caller is told to say "100 Continue".
  CHECK(deploy::http::parse_request("POST / HTTP/1.1\r\nExpect: 100-Continue\r\nContent-Length: 2\r\n\r\n", lim, &req)
            .expects_continue);
  CHECK_FALSE(deploy::http::parse_request("POST / HTTP/1.1\r\nContent-Length: 2\r\n\r\n", lim, &req).expects_continue);
  // Chunked bodies (curl -T -, SDKs streaming a body): decoded, extensions and trailers dropped,
  // each framing error named, the limit enforced as the sizes arrive.
  const std::string chunked = "POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: Chunked\r\nExpect: 100-continue\r\n\r\n";
  const std::string chunks = "5;name=value\r\n{\"a\":\r\nA\r\n1234567890\r\n0\r\nX-Trailer: t\r\n\r\n";
  r = deploy::http::parse_request(chunked + chunks + "GET /health HTTP/1.1\r\n\r\n", lim, &req);
  REQUIRE(r.status == deploy::http::parse_status::complete);
  CHECK(req.body == "{\"a\":1234567890");
  CHECK(r.consumed == chunked.size() + chunks.size());
  for (size_t cut = 0; cut < chunks.size(); ++cut) {  // every prefix waits for the rest
    CAPTURE(cut);
    const auto part = deploy::http::parse_request(chunked + chunks.substr(0, cut), lim, &req);
    CHECK(part.status == deploy::http::parse_status::incomplete);
    CHECK(part.expects_continue);
  }
  // Fed as it arrives, a growing buffer parsed again after each byte with one chunked_progress:
  // the chunks already decoded are not decoded again (the parse resumes at the chunk it waited
  // for), and the result is the one-shot parse's.
  {
    deploy::http::chunked_progress progress;
    const std::string whole = chunked + chunks + "GET /health HTTP/1.1\r\n\r\n";
    const size_t first_chunk_end = chunked.size() + std::string("5;name=value\r\n{\"a\":\r\n").size();
    deploy::http::parse_result last;
    for (size_t end = 1; end <= chunked.size() + chunks.size(); ++end) {
      CAPTURE(end);
      last = deploy::http::parse_request(std::string_view{whole}.substr(0, end), lim, &req, &progress);
      if (end < chunked.size() + chunks.size()) {
        REQUIRE(last.status == deploy::http::parse_status::incomplete);
        if (end >= first_chunk_end) {  // the first chunk is taken for good
          CHECK(progress.at >= first_chunk_end - chunked.size());
          CHECK(progress.body.rfind("{\"a\":", 0) == 0);
        } else {
          CHECK(progress.at == 0);
        }
      }
    }
    REQUIRE(last.status == deploy::http::parse_status::complete);
    CHECK(req.body == "{\"a\":1234567890");
    CHECK(last.consumed == chunked.size() + chunks.size());
    CHECK(progress.at == 0);  // cleared with the request
    CHECK(progress.body.empty());
    // Progress saved behind another head is not this request's: it starts over.
    progress.head_bytes = 3;
    progress.at = 6;
    progress.body = "stale!";
    last = deploy::http::parse_request(whole, lim, &req, &progress);
    REQUIRE(last.status == deploy::http::parse_status::complete);
    CHECK(req.body == "{\"a\":1234567890");
  }
  CHECK(status(chunked + "zz\r\n") == 400);                        // not hexadecimal
  CHECK(status(chunked + "2\r\nabc\r\n") == 400);                 // data longer than its size
  CHECK(status(chunked + "2\nab\r\n") == 400);                     // bare LF
  CHECK(status(chunked + "65\r\n") == 413);                         // 101 bytes: past the limit at once
  CHECK(status(chunked + "32\r\n" + std::string(50, 'x') + "\r\n33\r\n") == 413);  // 50 + 51
  std::string tiny;  // a body of tiny chunks with long extensions: framing past the bound
  for (int i = 0; i < 200; ++i) tiny += "0001;" + std::string(200, 'e') + "\r\nx\r\n";
  CHECK(status(chunked + tiny) == 413);
  CHECK(status("POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\nContent-Length: 2\r\n\r\n0\r\n\r\n") == 400);
  CHECK(status("POST / HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n") == 400);
  CHECK(status(chunked + "0\r\nno colon\r\n\r\n") == 400);
  CHECK(status(chunked + " 5\r\n") == 400);             // no whitespace before the size
  CHECK(status(chunked + "5 \r\n") == 400);             // nor after it without an extension
  CHECK(status(chunked + "5\r;x\r\n") == 400);         // a bare CR
  CHECK(deploy::http::parse_request(chunked + "2 ;x=y\r\nab\r\n0\r\n\r\n", lim, &req).status ==
        deploy::http::parse_status::complete);  // whitespace before an extension is allowed
  CHECK(status("POST / HTTP/1.1\r\nTransfer-Encoding:\r\nContent-Length: 2\r\n\r\n{}") == 501);  // empty: still there
  CHECK(deploy::http::iequals("Bearer ", "bEARER "));
  CHECK(deploy::http::chunk("") == "");  // an empty chunk would end the body early
  CHECK(deploy::http::constant_time_equal("sk-1", "sk-1"));
  CHECK_FALSE(deploy::http::constant_time_equal("sk-1", "sk-2"));
  CHECK_FALSE(deploy::http::constant_time_equal("sk-1", "sk-12"));
}

TEST_CASE("percent_decode: an SDK's encoded path segment decodes; a malformed escape is refused") {
  std::string out;
  CHECK(deploy::http::percent_decode("org%2Fmodel%20one%2f", &out));
  CHECK(out == "org/model one/");
  CHECK(deploy::http::percent_decode("plain", &out));
  CHECK(out == "plain");
  CHECK(deploy::http::percent_decode("", &out));
  CHECK(out.empty());
  for (const char* bad : {"%", "a%2", "%zz", "%2g", "x%"}) {
    CAPTURE(bad);
    CHECK_FALSE(deploy::http::percent_decode(bad, &out));
  }
}
