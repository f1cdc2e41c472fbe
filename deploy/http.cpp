#include "deploy/http.hpp"

#include <algorithm>
#include <cctype>
#include <charconv>

namespace baton::deploy::http {

namespace {

std::string lower(std::string_view s) {
  std::string out(s);
  for (auto& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

bool is_token_char(char c) {  // RFC 9110 tchar: what a method or header name may contain
  return std::isalnum(static_cast<unsigned char>(c)) || std::string_view{"!#$%&'*+-.^_`|~"}.find(c) != std::string_view::npos;
}

parse_result fail(int status, std::string why) { return {parse_status::error, 0, status, std::move(why)}; }

}  // namespace

const std::string* request::header(std::string_view lower_name) const {
  for (const auto& [k, v] : headers)
    if (k == lower_name) return &v;
  return nullptr;
}

static parse_result parse_request_at(std::string_view buf, const limits& lim, request* out, chunked_progress* progress);

parse_result parse_chunked_body(std::string_view buf, const limits& lim, std::string* body, chunked_progress* progress) {
  body->clear();
  constexpr size_t max_line = 4096;  // a chunk's size line with its extensions
  size_t at = 0;
  if (progress && progress->at > 0 && progress->at <= buf.size()) {
    at = progress->at;
    body->swap(progress->body);
  }
  if (progress) {
    progress->at = 0;
    progress->body.clear();
  }
  size_t chunk_at = at;  // where the chunk being read starts (its size line)
  // Incomplete: the chunks before chunk_at are decoded for good; the next call starts there.
  auto wait = [&]() -> parse_result {
    if (progress) {
      progress->at = chunk_at;
      progress->body.swap(*body);
    }
    return {};
  };
  // One line from `at`, without its CRLF; false while it is not all here (or a bare LF / an
  // overlong line, which *err says).
  auto line = [&](std::string_view* l, parse_result* err) {
    const auto end = buf.find("\r\n", at);
    const auto lf = buf.find('\n', at);
    if (lf != std::string_view::npos && (end == std::string_view::npos || lf < end))
      return *err = fail(400, "a line of the chunked body ends in a bare LF"), false;
    if (end == std::string_view::npos) {
      if (buf.size() - at > max_line) *err = fail(400, "a chunk size line longer than " + std::to_string(max_line) + " bytes");
      return false;
    }
    if (end - at > max_line) return *err = fail(400, "a chunk size line longer than " + std::to_string(max_line) + " bytes"), false;
    *l = buf.substr(at, end - at);
    if (l->find('\r') != std::string_view::npos) return *err = fail(400, "a bare CR in a line of the chunked body"), false;
    at = end + 2;
    return true;
  };
  // Framing counts too: a body of tiny chunks with long extensions must not hold the connection's
  // buffer far past the limit.
  const size_t max_framed = 2 * lim.max_body_bytes + lim.max_header_bytes;
  for (;;) {
    chunk_at = at;
    if (at > max_framed)
      return fail(413, "the chunked body with its framing exceeds " + std::to_string(max_framed) + " bytes");
    std::string_view l;
    parse_result err;
    if (!line(&l, &err)) return err.status == parse_status::error ? err : wait();
    // 1*HEXDIG, then optional whitespace before extensions (";name=value", ignored) and nothing else.
    auto size_text = l.substr(0, l.find(';'));
    if (l.find(';') != std::string_view::npos)
      while (!size_text.empty() && (size_text.back() == ' ' || size_text.back() == '\t')) size_text.remove_suffix(1);
    size_t size = 0;
    const auto [end, ec] = std::from_chars(size_text.data(), size_text.data() + size_text.size(), size, 16);
    // All hex digits, past size_t: a chunk past any limit, not a malformed one (as Content-Length).
    if (ec == std::errc::result_out_of_range && end == size_text.data() + size_text.size())
      return fail(413, "the chunked body exceeds the limit of " + std::to_string(lim.max_body_bytes) + " bytes");
    if (size_text.empty() || ec != std::errc{} || end != size_text.data() + size_text.size())
      return fail(400, "chunk size '" + std::string(size_text.substr(0, 32)) + "' is not a hexadecimal number");
    if (size > lim.max_body_bytes || body->size() + size > lim.max_body_bytes)
      return fail(413, "the chunked body exceeds the limit of " + std::to_string(lim.max_body_bytes) + " bytes");
    if (size == 0) break;
    if (buf.size() < at + size + 2) return wait();
    if (buf.substr(at + size, 2) != "\r\n") return fail(400, "a chunk's data is not followed by CRLF");
    body->append(buf.substr(at, size));
    at += size + 2;
  }
  // Trailer fields, read and dropped (none is needed), then the empty line.
  const size_t trailers_at = at;
  for (;;) {
    std::string_view l;
    parse_result err;
    if (!line(&l, &err)) return err.status == parse_status::error ? err : wait();  // from the last chunk again
    if (l.empty()) break;
    if (at - trailers_at > lim.max_header_bytes)
      return fail(431, "the chunked body's trailer fields exceed " + std::to_string(lim.max_header_bytes) + " bytes");
    if (l.find(':') == std::string_view::npos || l.front() == ':') return fail(400, "malformed trailer field (want Name: value)");
  }
  return {parse_status::complete, at, 0, {}};
}

parse_result parse_request(std::string_view whole, const limits& lim, request* out, chunked_progress* progress) {
  // Empty lines before a request line are ignored (RFC 9112 §2.2: a client may send a CRLF after
  // a POST body).
  size_t lead = 0;
  while (whole.substr(lead, 2) == "\r\n") lead += 2;
  if (lead > lim.max_header_bytes) {
    if (progress) progress->clear();
    return fail(431, "more than " + std::to_string(lim.max_header_bytes) + " bytes of empty lines before a request");
  }
  auto r = parse_request_at(whole.substr(lead), lim, out, progress);
  if (r.status == parse_status::complete) r.consumed += lead;
  if (progress && r.status != parse_status::incomplete) progress->clear();  // the request is over
  return r;
}

static parse_result parse_request_at(std::string_view buf, const limits& lim, request* out, chunked_progress* progress) {
  const auto head_end = buf.find("\r\n\r\n");
  // A bare LF in the head (a hand-typed request, netcat without -C) would never make the CRLF
  // CRLF this parser waits for: refused at once, rather than left to the idle limit.
  const std::string_view head_so_far = buf.substr(0, head_end == std::string_view::npos ? buf.size() : head_end + 4);
  for (size_t i = head_so_far.find('\n'); i != std::string_view::npos; i = head_so_far.find('\n', i + 1))
    if (i == 0 || head_so_far[i - 1] != '\r') return fail(400, "a line of the request head ends in a bare LF: HTTP/1.1 wants CRLF");
  if (head_end == std::string_view::npos) {
    if (buf.size() > lim.max_header_bytes)
      return fail(431, "the request line and headers exceed " + std::to_string(lim.max_header_bytes) + " bytes");
    return {};
  }
  if (head_end + 4 > lim.max_header_bytes)
    return fail(431, "the request line and headers exceed " + std::to_string(lim.max_header_bytes) + " bytes");
  *out = request{};
  std::string_view head = buf.substr(0, head_end);
  const auto line_end = head.find("\r\n");
  const std::string_view line = head.substr(0, line_end);
  const auto sp1 = line.find(' ');
  const auto sp2 = sp1 == std::string_view::npos ? sp1 : line.find(' ', sp1 + 1);
  if (sp1 == std::string_view::npos || sp2 == std::string_view::npos || line.find(' ', sp2 + 1) != std::string_view::npos)
    return fail(400, "malformed request line (want METHOD TARGET HTTP/1.1)");
  out->method = std::string(line.substr(0, sp1));
  out->target = std::string(line.substr(sp1 + 1, sp2 - sp1 - 1));
  out->version = std::string(line.substr(sp2 + 1));
  if (out->method.empty() || !std::all_of(out->method.begin(), out->method.end(), is_token_char))
    return fail(400, "malformed method in the request line");
  // The absolute form (`POST http://host:8000/v1/completions`), which RFC 9112 §3.2.2 has every
  // server accept (proxies send it): its path is the target. The authority is not checked
  // against Host: the gateway serves one origin.
  for (std::string_view scheme : {"http://", "https://"})
    if (out->target.size() > scheme.size() && http::iequals(std::string_view{out->target}.substr(0, scheme.size()), scheme)) {
      const auto end = out->target.find_first_of("/?#", scheme.size());  // of the authority
      out->target = end == std::string::npos ? "/" : out->target[end] == '/' ? out->target.substr(end) : "/" + out->target.substr(end);
      break;
    }
  if (out->target.empty() || out->target.front() != '/')
    return fail(400, "the request target must start with '/' (or be an absolute http:// URL)");
  if (out->version != "HTTP/1.1" && out->version != "HTTP/1.0")
    return fail(505, "HTTP version '" + out->version.substr(0, 16) + "' is not supported (HTTP/1.1 or 1.0)");
  out->path = out->target.substr(0, out->target.find('?'));
  out->keep_alive = out->version == "HTTP/1.1";
  if (line_end != std::string_view::npos) {
    std::string_view rest = head.substr(line_end + 2);
    while (!rest.empty()) {
      const auto e = rest.find("\r\n");
      const std::string_view h = rest.substr(0, e);
      rest = e == std::string_view::npos ? std::string_view{} : rest.substr(e + 2);
      const auto colon = h.find(':');
      if (colon == std::string_view::npos || colon == 0)
        return fail(400, "malformed header line (want Name: value)");
      const auto name = h.substr(0, colon);
      if (!std::all_of(name.begin(), name.end(), is_token_char))
        return fail(400, "malformed header name '" + std::string(name.substr(0, 64)) + "'");
      const auto value = h.substr(colon + 1);
      // RFC 9112 §5.5: a value holds no control character but HTAB. A bare CR or a NUL read one
      // way here and another by a proxy in front is how requests are smuggled past it.
      if (std::any_of(value.begin(), value.end(), [](char c) { return (c >= 0 && c < 0x20 && c != '\t') || c == 0x7f; }))
        return fail(400, "header '" + std::string(name.substr(0, 64)) + "' has a control character in its value");
      out->headers.emplace_back(lower(name), std::string(trim(value)));
    }
  }
  // One Host (RFC 9112 §3.2), one Authorization: two would be read one way here and another
  // by a proxy in front (which key, which virtual host).
  for (const char* once : {"host", "authorization"})
    if (std::count_if(out->headers.begin(), out->headers.end(), [&](const auto& h) { return h.first == once; }) > 1)
      return fail(400, std::string{"more than one "} + (once[0] == 'h' ? "Host" : "Authorization") + " header");
  // A Host is one host[:port] (RFC 9110 §7.2): a list would name two, read apart by a proxy.
  if (const auto* host = out->header("host"); host && host->find(',') != std::string::npos)
    return fail(400, "the Host header names more than one host");
  // Every Connection header's options together, and "close" wins: a keep-alive in one header
  // must not keep open a connection another header closes. Options are tokens ("x-enclosed"
  // is not "close").
  bool close = false, keep = false;
  for (const auto& [k, v] : out->headers)
    if (k == "connection")
      for (std::string_view rest = v; !rest.empty();) {
        const auto comma = rest.find(',');
        const auto option = lower(std::string(trim(rest.substr(0, comma))));
        close |= option == "close";
        keep |= option == "keep-alive";
        rest = comma == std::string_view::npos ? std::string_view{} : rest.substr(comma + 1);
      }
  // An expectation other than 100-continue cannot be met (RFC 9110 §10.1.1), in any Expect header.
  for (const auto& [k, v] : out->headers)
    if (k == "expect" && lower(v) != "100-continue")
      return fail(417, "Expect: " + v.substr(0, 32) + " is not supported (only 100-continue)");
  if (close) out->keep_alive = false;
  else if (keep) out->keep_alive = true;
  // Every Transfer-Encoding header, not the first: "identity" then "chunked" framed by its
  // Content-Length here would be framed by its chunks behind a proxy (request smuggling). The
  // codings, all headers' lists together, must be "chunked" alone: a body is never compressed.
  std::string codings;
  bool has_codings = false;  // an empty Transfer-Encoding is one too: never framed by Content-Length
  for (const auto& [k, v] : out->headers)
    if (k == "transfer-encoding") {
      codings += (has_codings ? "," : "") + lower(v);
      has_codings = true;
    }
  if (has_codings) {
    std::string list;
    for (char c : codings)
      if (c != ' ' && c != '\t') list.push_back(c);
    if (list != "chunked")
      return fail(501, "Transfer-Encoding '" + codings.substr(0, 32) +
                           "' is not supported for request bodies: send it chunked or with a Content-Length");
    // Both framings at once: which one a proxy in front used cannot be told (RFC 9112 §6.1).
    if (out->header("content-length")) return fail(400, "both Transfer-Encoding and Content-Length");
    if (out->version == "HTTP/1.0") return fail(400, "Transfer-Encoding in an HTTP/1.0 request");
    if (progress && progress->head_bytes != head_end + 4) {  // saved behind another head: not this request's
      progress->clear();
      progress->head_bytes = head_end + 4;
    }
    const auto r = parse_chunked_body(buf.substr(head_end + 4), lim, &out->body, progress);
    if (r.status != parse_status::complete) {
      parse_result wait = r;
      const auto* expect = out->header("expect");
      wait.expects_continue = r.status == parse_status::incomplete && expect && lower(*expect) == "100-continue" &&
                              out->version == "HTTP/1.1";
      return wait;
    }
    return {parse_status::complete, head_end + 4 + r.consumed, 0, {}};
  }
  size_t length = 0;
  // Two Content-Length headers that disagree: which body is meant cannot be told (RFC 9112 §6.3).
  const std::string* first_length = nullptr;
  for (const auto& [k, v] : out->headers)
    if (k == "content-length") {
      if (first_length && *first_length != v) return fail(400, "two Content-Length headers that disagree");
      first_length = &v;
    }
  if (out->method == "POST" && !out->header("content-length"))
    return fail(411, "a POST needs a Content-Length header (or a chunked body)");
  if (const auto* cl = out->header("content-length")) {
    const auto [end, ec] = std::from_chars(cl->data(), cl->data() + cl->size(), length);
    // All digits, past size_t: a length past any limit, not a malformed one.
    if (ec == std::errc::result_out_of_range && end == cl->data() + cl->size())
      return fail(413, "the body of " + cl->substr(0, 32) + " bytes exceeds the limit of " +
                           std::to_string(lim.max_body_bytes));
    if (cl->empty() || ec != std::errc{} || end != cl->data() + cl->size())
      return fail(400, "Content-Length '" + cl->substr(0, 32) + "' is not a number");
    if (length > lim.max_body_bytes)
      return fail(413, "the body of " + std::to_string(length) + " bytes exceeds the limit of " +
                           std::to_string(lim.max_body_bytes));
  }
  const size_t body_at = head_end + 4;
  if (buf.size() < body_at + length) {
    parse_result wait;
    const auto* expect = out->header("expect");
    wait.expects_continue = expect && lower(*expect) == "100-continue" && out->version == "HTTP/1.1";
    return wait;
  }
  out->body = std::string(buf.substr(body_at, length));
  return {parse_status::complete, body_at + length, 0, {}};
}

const char* reason_phrase(int status) {
  switch (status) {
    case 200: return "OK";
    case 204: return "No Content";
    case 400: return "Bad Request";
    case 401: return "Unauthorized";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 408: return "Request Timeout";
    case 411: return "Length Required";
    case 413: return "Content Too Large";
    case 415: return "Unsupported Media Type";
    case 417: return "Expectation Failed";
    case 429: return "Too Many Requests";
    case 431: return "Request Header Fields Too Large";
    case 499: return "Client Closed Request";
    case 500: return "Internal Server Error";
    case 501: return "Not Implemented";
    case 503: return "Service Unavailable";
    case 504: return "Gateway Timeout";
    case 505: return "HTTP Version Not Supported";
  }
  return "Unknown";
}

namespace {
std::string head(int status, std::string_view content_type, const header_list& extra) {
  std::string out = "HTTP/1.1 " + std::to_string(status) + " " + reason_phrase(status) + "\r\n";
  if (status != 204) {  // no content, no type
    out += "Content-Type: ";
    out += content_type;
    out += "\r\n";
  }
  for (const auto& [k, v] : extra) out += k + ": " + v + "\r\n";
  return out;
}
}  // namespace

std::string response(int status, std::string_view content_type, std::string_view body, bool keep_alive,
                     const header_list& extra) {
  std::string out = head(status, content_type, extra);
  if (status != 204) out += "Content-Length: " + std::to_string(body.size()) + "\r\n";  // RFC 9110 §8.6: none on 204
  out += keep_alive ? "Connection: keep-alive\r\n\r\n" : "Connection: close\r\n\r\n";
  out += body;
  return out;
}

std::string chunked_head(int status, std::string_view content_type, const header_list& extra) {
  return head(status, content_type, extra) + "Transfer-Encoding: chunked\r\nCache-Control: no-cache\r\n\r\n";
}

std::string close_delimited_head(int status, std::string_view content_type, const header_list& extra) {
  return head(status, content_type, extra) + "Cache-Control: no-cache\r\nConnection: close\r\n\r\n";
}

std::string chunk(std::string_view data) {
  if (data.empty()) return {};  // an empty chunk would end the body
  char size[24];
  const auto [end, ec] = std::to_chars(size, size + sizeof(size), data.size(), 16);
  std::string out(size, end);
  out += "\r\n";
  out += data;
  out += "\r\n";
  return out;
}

std::string last_chunk() { return "0\r\n\r\n"; }

bool iequals(std::string_view a, std::string_view b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(), [](char x, char y) {
           return std::tolower(static_cast<unsigned char>(x)) == std::tolower(static_cast<unsigned char>(y));
         });
}

bool constant_time_equal(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

bool percent_decode(std::string_view in, std::string* out) {
  out->clear();
  for (size_t i = 0; i < in.size(); ++i) {
    if (in[i] != '%') {
      out->push_back(in[i]);
      continue;
    }
    unsigned byte = 0;  // two hex digits, no sign (from_chars takes none for an unsigned)
    const auto r = i + 2 < in.size() ? std::from_chars(in.data() + i + 1, in.data() + i + 3, byte, 16)
                                     : std::from_chars_result{nullptr, std::errc::invalid_argument};
    if (r.ec != std::errc{} || r.ptr != in.data() + i + 3) return false;
    out->push_back(static_cast<char>(byte));
    i += 2;
  }
  return true;
}

std::string origin_problem(const std::string& o) {
  if (o == "*") return {};
  const auto rest = o.rfind("https://", 0) == 0 ? o.substr(8) : o.rfind("http://", 0) == 0 ? o.substr(7) : std::string{};
  const bool host_ok = !rest.empty() && std::all_of(rest.begin(), rest.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '.' || c == '-' || c == ':' || c == '[' || c == ']';
  });
  if (host_ok) return {};
  return "'" + o + "' is not an origin as browsers send it (http://host[:port] or https://host[:port], lower case, no "
         "path; or *)";
}

header_list preflight_headers(const request& req, const std::string& allow) {
  header_list out{{"Access-Control-Allow-Methods", allow}};
  std::string headers = "Authorization, Content-Type";
  if (const auto* asked = req.header("access-control-request-headers");
      asked && !asked->empty() && asked->size() <= 1024 && std::all_of(asked->begin(), asked->end(), [](char c) {
        return std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == ',' || c == ' ';
      }))
    headers = *asked;
  out.emplace_back("Access-Control-Allow-Headers", headers);
  out.emplace_back("Vary", "Access-Control-Request-Headers");
  out.emplace_back("Access-Control-Max-Age", "600");
  return out;
}

std::string client_request_id(const request& req, std::string* id) {
  const auto* given = req.header("x-request-id");
  if (!given) return {};
  if (std::count_if(req.headers.begin(), req.headers.end(), [](const auto& h) { return h.first == "x-request-id"; }) > 1)
    return "more than one x-request-id header";
  const bool ok = !given->empty() && given->size() <= 128 &&
                  std::all_of(given->begin(), given->end(), [](char c) { return c > 0x20 && c < 0x7f; });
  if (!ok)
    return "x-request-id must be 1 to 128 visible ASCII characters (no spaces); this one has " +
           std::to_string(given->size()) + " bytes";
  *id = *given;
  return {};
}

}  // namespace baton::deploy::http
