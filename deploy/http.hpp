#pragma once

// The part of HTTP/1.1 the gateway speaks (RFC 9112): one request at a time from the front of a
// connection's buffer, bodies by Content-Length or in chunks, responses with a length or chunked (for
// server-sent events). Pure functions, no sockets and no CAF, so fuzz targets and tests use
// them directly. Every refusal carries the status to answer with and a sentence saying why.

#include <cstddef>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace baton::deploy::http {

struct limits {
  size_t max_header_bytes = 16 * 1024;  ///< request line + headers (431 beyond)
  size_t max_body_bytes = 1 << 20;      ///< Content-Length above this: 413
};

struct request {
  std::string method;
  std::string target;   ///< as sent: path and query
  std::string path;     ///< target without the query
  std::string version;  ///< HTTP/1.0 or HTTP/1.1
  std::vector<std::pair<std::string, std::string>> headers;  ///< names lower-cased
  std::string body;
  bool keep_alive = true;
  /// The first header of that (lower-case) name, or null.
  const std::string* header(std::string_view lower_name) const;
};

enum class parse_status { incomplete, complete, error };

struct parse_result {
  parse_status status = parse_status::incomplete;
  size_t consumed = 0;     ///< bytes of the buffer the request took (complete)
  int error_status = 0;    ///< 400, 411, 413, 417, 431 or 505 (error)
  std::string why;         ///< what was wrong (error)
  /// incomplete: the headers are in, the body is not, and they ask "Expect: 100-continue"
  bool expects_continue = false;
};

/// Where decoding a chunked body stopped while it was incomplete, so that the next parse of the
/// same request, with more of it in the buffer, resumes at the chunk it waited for: a body that
/// arrives in many reads is decoded once, not again from its start at every read (quadratic in
/// the reads). It belongs to one request: a parse that completes or fails clears it, and a head
/// of another length than the one it was saved behind starts it over.
struct chunked_progress {
  size_t head_bytes = 0;  ///< where the body starts in the request it was saved for
  size_t at = 0;          ///< framed bytes of the body taken (whole chunks); 0: nothing saved
  std::string body;       ///< their data
  void clear() {
    head_bytes = at = 0;
    body.clear();
  }
};

/// Parses one request from the front of `buf` into `out`. A body comes by Content-Length, or in
/// chunks (Transfer-Encoding: chunked, HTTP/1.1, no Content-Length beside it), decoded. A caller
/// that parses a growing buffer again after each read passes the same `progress` every time.
parse_result parse_request(std::string_view buf, const limits& lim, request* out, chunked_progress* progress = nullptr);
/// A chunked body (RFC 9112 §7.1) from the front of `buf`, decoded into `body`: complete with
/// the bytes it took (chunks, last chunk, trailer fields), incomplete, or an error (400 for bad
/// framing, 413 past max_body_bytes as soon as the sizes say so, 431 for trailers past
/// max_header_bytes). With `progress`, it resumes where an incomplete call with it stopped, and
/// an incomplete call leaves the decoded chunks there (not in `body`).
parse_result parse_chunked_body(std::string_view buf, const limits& lim, std::string* body,
                                chunked_progress* progress = nullptr);

using header_list = std::vector<std::pair<std::string, std::string>>;

/// A whole response with Content-Length.
std::string response(int status, std::string_view content_type, std::string_view body, bool keep_alive,
                     const header_list& extra = {});
/// The head of a chunked response (server-sent events); chunks follow, then last_chunk().
std::string chunked_head(int status, std::string_view content_type, const header_list& extra = {});
/// The same for an HTTP/1.0 client, which knows no chunks: the body is the raw events and ends
/// when the server closes the connection (RFC 9112 §6.3); no Content-Length, Connection: close.
std::string close_delimited_head(int status, std::string_view content_type, const header_list& extra = {});
std::string chunk(std::string_view data);
std::string last_chunk();

/// The reason phrase of a status the gateway answers with ("Unknown" for any other).
const char* reason_phrase(int status);

/// Compares two secrets in time that depends only on their lengths, not on where they differ.
bool constant_time_equal(std::string_view a, std::string_view b);

/// A path segment's percent-escapes decoded (RFC 3986 §2.1: SDKs encode an id such as
/// "org/model" as "org%2Fmodel"); false when an escape is not '%' and two hex digits.
bool percent_decode(std::string_view in, std::string* out);

/// ASCII case-insensitive equality (header values such as auth schemes).
bool iequals(std::string_view a, std::string_view b);

/// Why `origin` is not one a browser sends as its Origin (scheme, lower-case host, port; no
/// path, not even "/"), nor "*"; empty when it is. A CORS allow-list entry must match exactly.
std::string origin_problem(const std::string& origin);

/// The answer to a browser's CORS preflight (an OPTIONS with Access-Control-Request-Method) from
/// an allowed origin, for a route that allows `allow`: that it may call with those methods, and
/// send the headers it asks to (SDKs add their own, X-Stainless-* and the like) when they are
/// header names, else the two every call needs. Cached 10 minutes.
header_list preflight_headers(const request& req, const std::string& allow);

/// The request's own x-request-id into `id` (left alone when it sent none); a problem with it,
/// else empty. Bounded and printable: it is echoed in a header and written to the log.
std::string client_request_id(const request& req, std::string* id);

}  // namespace baton::deploy::http
