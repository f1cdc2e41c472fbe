// Reading an answer's tool calls as it streams (tool_call_splitter): each call goes out as it
// is written -- its name once its head is read, its arguments' JSON as the model writes it --
// and the end reads the whole answer (read_tool_calls) to send what is left, so that the pieces
// join to exactly the calls the whole answer reads (fuzz/fuzz_tool_calls.cpp holds it to that).
// The forms themselves are openai_tool_call_forms.hpp's.

#include <algorithm>
#include <array>
#include <string_view>

#include "actors/text_stream.hpp"
#include "deploy/openai.hpp"
#include "deploy/openai_tool_call_forms.hpp"

namespace baton::deploy::openai {

using gpu::tool_call_format;

namespace {

/// The texts that start the calls in a marked format (Llama's have none): whichever comes first.
/// Qwen3-Coder's calls may come without their <tool_call> (vLLM reads those too).
std::array<std::string_view, 2> call_markers(tool_call_format f) {
  switch (f) {
    case tool_call_format::hermes: return {hermes_begin};
    case tool_call_format::qwen3_xml: return {xml_call_begin, xml_function_begin};
    case tool_call_format::mistral: return {mistral_calls};
    case tool_call_format::deepseek: return {deepseek_form.section_begin};
    case tool_call_format::kimi: return {kimi_form.section_begin};
    default: return {};
  }
}

/// `marker`'s first place in `s` from *from on. Where it is not there (yet), *from moves on to
/// the last marker.size() - 1 bytes, which more text may make the marker: however a text grows
/// (a byte at a time, say), each of its bytes is searched once, not once per piece.
size_t find_forward(std::string_view s, std::string_view marker, size_t* from) {
  const size_t at = s.find(marker, *from);
  if (at == npos && s.size() >= marker.size()) *from = std::max(*from, s.size() - marker.size() + 1);
  return at;
}

/// Where a stream stands on its next call: the call's head read (its name, and where its
/// arguments' object begins), more text needed, or none that can stream (the end reads the rest).
struct call_head {
  enum status_t { none, more, found } status = none;
  std::string name;
  size_t args = 0;
  /// Text that ends the call where the whole answer's reader looks for it (hermes_end, the
  /// call's end marker, a closing fence): the arguments stop there, whatever their JSON says.
  std::array<std::string_view, 2> ends{};
  std::string id{};  ///< tool_call::id
};

const call_head more_text{call_head::more, {}, 0, {}};

/// Whether `marker` is at `at`: yes, no, or not known yet (the text ends inside it).
enum class seen { yes, no, more };
seen see(std::string_view s, size_t at, std::string_view marker) {
  const auto rest = s.substr(std::min(at, s.size()));
  if (rest.size() >= marker.size()) return rest.substr(0, marker.size()) == marker ? seen::yes : seen::no;
  return marker.substr(0, rest.size()) == rest ? seen::more : seen::no;
}

/// A call object's head, the object starting at `at`: "name" (a string) first, then "arguments"
/// or "parameters" as an object. Anything else is for the end to read.
call_head object_head(std::string_view s, size_t at) {
  std::optional<std::string> name;
  for (size_t i = at + 1;; ++i) {  // at a member, after '{' or ','
    i = skip_space(s, i);
    if (i >= s.size()) return more_text;
    if (s[i] != '"') return {};
    const size_t key_end = value_extent(s, i);
    if (key_end == npos) return more_text;
    const auto key = string_token(s.substr(i, key_end - i));
    i = skip_space(s, key_end);
    if (!key || (i < s.size() && s[i] != ':')) return {};
    i = skip_space(s, i + 1);
    if (i >= s.size()) return more_text;
    if (arguments_key(*key)) {
      if (!name || s[i] != '{') return {};
      return {call_head::found, std::move(*name), i};
    }
    const size_t end = value_extent(s, i);
    if (end == npos) return more_text;
    if (*key == "name") {
      if (name || s[i] != '"') return {};
      name = string_token(s.substr(i, end - i));
      if (!name) return {};
    }
    i = skip_space(s, end);
    if (i >= s.size()) return more_text;
    if (s[i] != ',') return {};
  }
}

/// The arguments' object at `at`, for a call named `name`.
call_head args_at(std::string_view s, size_t at, std::string name) {
  if (at >= s.size()) return more_text;
  if (name.empty() || s[at] != '{') return {};
  return {call_head::found, std::move(name), at};
}

/// The next call object in a JSON list of calls: the first after the '[' at `open`, or the one
/// after the call whose arguments ended at `from`.
call_head list_head(std::string_view s, size_t open, size_t from, bool first) {
  size_t at = skip_space(s, first ? open + 1 : from);
  if (!first) {  // the call object closes, then a ',' and the next
    if (at < s.size() && s[at] == '}') at = skip_space(s, at + 1);
    if (at >= s.size()) return more_text;
    if (s[at] != ',') return {};
    at = skip_space(s, at + 1);
  }
  if (at >= s.size()) return more_text;
  return s[at] == '{' ? object_head(s, at) : call_head{};
}

/// Mistral's newer form at `at`: name, [CALL_ID]id optionally, [ARGS], the arguments' object.
call_head mistral_named_head(std::string_view s, size_t at) {
  size_t i = at;
  while (i < s.size() && name_char(s[i])) ++i;
  if (i >= s.size()) return more_text;
  std::string name{s.substr(at, i - at)};
  switch (see(s, i, mistral_call_id)) {
    case seen::more: return more_text;
    case seen::yes:
      i += mistral_call_id.size();
      while (i < s.size() && std::isalnum(static_cast<unsigned char>(s[i]))) ++i;
      if (i >= s.size()) return more_text;
      break;
    case seen::no: break;
  }
  switch (see(s, i, mistral_args)) {
    case seen::more: return more_text;
    case seen::no: return {};
    case seen::yes: break;
  }
  return args_at(s, skip_space(s, i + mistral_args.size()), std::move(name));
}

/// `*from`: where the last call's JSON ended, moved on as the text is searched (find_forward);
/// `*end_seen`: its </tool_call> is behind *from, the next <tool_call> is looked for.
call_head hermes_head(std::string_view s, size_t* from, bool* end_seen, bool first) {
  size_t at = hermes_begin.size();  // the text starts at the first call's marker
  if (!first) {  // after this call's end tag, the next call's marker (any text between is read at the end)
    if (!*end_seen) {
      const size_t end = find_forward(s, hermes_end, from);
      if (end == npos) return more_text;
      *from = end + hermes_end.size();
      *end_seen = true;
    }
    const size_t next = find_forward(s, hermes_begin, from);
    if (next == npos) return more_text;
    at = next + hermes_begin.size();
  }
  at = skip_space(s, at);
  if (at >= s.size()) return more_text;
  auto head = s[at] == '{' ? object_head(s, at) : call_head{};
  head.ends = {hermes_end};
  return head;
}

call_head llama_head(std::string_view s, size_t from, bool first) {
  size_t at = skip_space(s, first ? 0 : from);
  if (first) {
    switch (see(s, at, python_tag)) {
      case seen::more: return more_text;
      case seen::yes: at = skip_space(s, at + python_tag.size()); break;
      case seen::no: break;
    }
  } else {
    if (at < s.size() && s[at] == '}') at = skip_space(s, at + 1);  // the call object closes
    if (at < s.size() && s[at] == ';') at = skip_space(s, at + 1);
  }
  if (at >= s.size()) return more_text;
  return s[at] == '{' ? object_head(s, at) : call_head{};
}

call_head mistral_head(std::string_view s, size_t from, bool first) {
  const size_t open = skip_space(s, mistral_calls.size());  // the text starts at the first marker
  if (open >= s.size()) return more_text;
  if (s[open] == '[') return list_head(s, open, from, first);  // v0.3's list: its calls stream
  size_t at = first ? open : skip_space(s, from);
  if (!first) {
    // Another named call with a marker of its own streams. One without is read at the end: it
    // is a call only if its JSON reads, else text, which a stream cannot know yet.
    if (at >= s.size()) return more_text;
    switch (see(s, at, mistral_calls)) {
      case seen::more: return more_text;
      case seen::yes: at = skip_space(s, at + mistral_calls.size()); break;
      case seen::no: return {};
    }
  }
  return mistral_named_head(s, at);
}

/// `*from`: where the last call's JSON ended, moved on as the text is searched (find_forward).
/// `*scanned`: how far this call's head has been searched for its separator, its end marker and
/// (DeepSeek V3's name line) a line break, so that a long head is not searched again from its
/// start with every piece (all 0 for a call not yet begun).
call_head sectioned_head(std::string_view s, size_t* from, bool first, tool_call_format f, const sectioned_form& form,
                         std::array<size_t, 3>* scanned) {
  size_t at = form.section_begin.size();  // the text starts at the section's marker
  if (!first) {
    const size_t end = find_forward(s, form.call_end, from);
    if (end == npos) return more_text;
    at = end + form.call_end.size();
  }
  at = skip_space(s, at);
  switch (see(s, at, form.call_begin)) {
    case seen::more: return more_text;
    case seen::no: return {};
    case seen::yes: break;
  }
  const size_t head = at + form.call_begin.size();
  auto found = [&](size_t args, std::string name, std::string_view fence = {}) {
    auto h = args_at(s, args, std::move(name));
    h.ends = {form.call_end, fence};
    return h;
  };
  const auto search = [&](std::string_view marker, size_t start, size_t& resume) {
    resume = std::max(resume, start);
    return find_forward(s, marker, &resume);
  };
  const size_t sep = search(form.sep, head, (*scanned)[0]);
  const size_t end = search(form.call_end, head, (*scanned)[1]);
  if (end != npos && (sep == npos || end < sep)) return {};
  if (sep == npos) return more_text;
  const std::string_view head_text = s.substr(head, sep - head);
  const size_t right = sep + form.sep.size();
  if (f == tool_call_format::kimi) {
    auto h = found(skip_space(s, right), std::string{kimi_name(head_text)});
    h.id = kimi_id(head_text);
    return h;
  }
  if (head_text != "function") return found(skip_space(s, right), trimmed(head_text));
  // DeepSeek V3, R1: the name on its own line, then the arguments in a ```json block.
  const size_t line = search("\n", right, (*scanned)[2]);
  if (line == npos) return more_text;
  if (end != npos && end < line) return {};
  size_t args = skip_space(s, line + 1);
  switch (see(s, args, "```json")) {
    case seen::more: return more_text;
    case seen::yes: return found(skip_space(s, args + 7), trimmed(s.substr(right, line - right)), "```");
    case seen::no: break;
  }
  return found(args, trimmed(s.substr(right, line - right)));
}

/// Qwen3-Coder's next call: the next <function=NAME> tag from *from on (the first marker, then
/// the last call's </function>), in a <tool_call> block or not, named once its '>' is read; a
/// <function= that is no tag is text, passed over (read_qwen3_xml's rules: text among the calls
/// is read at the end). *from moves on as the text is searched (find_forward), stopping at a
/// <function= whose tag goes on; *tag_scanned: how far that tag has been looked at. Its arguments
/// (from just past the '>') are not JSON as written: stream_xml_arguments sends them whole at
/// </function>.
call_head xml_head(std::string_view s, size_t* from, size_t* tag_scanned) {
  for (;;) {
    const size_t at = find_forward(s, xml_function_begin, from);
    if (at == npos) return more_text;
    *from = at;
    auto tag = read_xml_tag_name(s, at + xml_function_begin.size(), *tag_scanned);
    if (tag.more) {
      *tag_scanned = s.size();
      return more_text;
    }
    *tag_scanned = 0;
    if (!tag.name.empty()) return {call_head::found, std::move(tag.name), tag.close + 1};
    *from = at + 1;
  }
}

call_head forced_head(std::string_view s, size_t from, bool first, const std::string& tool) {
  if (!tool.empty()) return first ? args_at(s, skip_space(s, 0), tool) : call_head{};
  const size_t open = skip_space(s, 0);
  if (open >= s.size()) return more_text;
  return s[open] == '[' ? list_head(s, open, from, first) : call_head{};
}

}  // namespace

tool_call_splitter tool_call_splitter::forced(std::string tool) {
  tool_call_splitter s{tool_call_format::none};
  s.forced_ = true;
  s.forced_tool_ = std::move(tool);
  s.calling_ = true;
  return s;
}

answer_parts tool_call_splitter::read_held() const {
  if (forced_) return read_forced_calls(held_, forced_tool_);
  return read_tool_calls(held_, format_, parameters_.get());  // (calls of undeclared functions: content)
}

std::string_view tool_call_splitter::sent_arguments(const sent_call& call) const {
  if (!call.built.empty()) return call.built;
  return std::string_view{held_}.substr(call.args_begin, call.args_sent - call.args_begin);
}

bool tool_call_splitter::stream_xml_arguments(answer_parts* out) {
  // The call's text from args_begin on; scan_.at: how far </function> has been looked for (each
  // byte is looked at once as the text grows; held_ only grows while calls stream). None before
  // the answer ends (cut by max_tokens): the end reads the call with the parameters so far, and
  // sends them as the rest of this call (sent_arguments is "" until then).
  const std::string_view s = held_;
  auto& call = sent_.back();
  const size_t end = find_forward(s, xml_function_end, &scan_.at);
  if (end == npos) return false;
  // Once named, a call always reads (text among its parameters is passed over): its arguments
  // are a JSON object, `{}` at least, never empty, so `built` tells a call whose arguments went.
  auto args = xml_call_arguments(call.name, s.substr(call.args_begin, end - call.args_begin), parameters_.get());
  const auto index = static_cast<uint32_t>(sent_.size() - 1);
  if (!out->tool_calls.empty() && out->tool_calls.back().index == index) out->tool_calls.back().arguments += args;
  else out->tool_calls.push_back({{}, args, index, false});
  call.built = std::move(args);
  args_open_ = false;
  next_from_ = end + xml_function_end.size();
  return true;
}

void tool_call_splitter::stream_calls(answer_parts* out) {
  const std::string_view s = held_;
  while (!stopped_) {
    if (args_open_ && format_ == tool_call_format::qwen3_xml && !stream_xml_arguments(out)) return;
    if (args_open_) {  // the last call's arguments so far; trailing whitespace waits (the end may trim it)
      auto& call = sent_.back();
      const bool ended = scan_json(s, scan_);
      size_t upto = ended ? scan_.at : s.size();
      bool cut = false;
      for (const std::string_view end : call.ends) {
        const size_t from = std::max(call.args_begin, call.args_sent >= end.size() ? call.args_sent - end.size() + 1 : 0);
        // An end marker inside one of the arguments' strings (a file's content with a ``` fence,
        // say) is text, not the end: only one outside every string cuts the arguments.
        for (size_t at = s.find(end, from); at < upto; at = s.find(end, at + 1)) {
          // Read on from where the last look stopped (each byte once, as the text grows); from
          // the start again only for a marker behind it (another end's).
          if (probe_.at > at) probe_ = json_scan{call.args_begin};
          scan_json(s.substr(0, at), probe_);
          if (probe_.in_string) continue;
          upto = at;
          cut = true;
          break;
        }
      }
      // A tail that may still become an end marker waits, as does half a UTF-8 character.
      if (!ended && !cut) upto = streamable_prefix(s.substr(0, upto), call.ends);
      while ((cut || !ended) && upto > call.args_sent && json_space(s[upto - 1])) --upto;
      upto = std::max(upto, call.args_sent);
      if (upto > call.args_sent) {
        const auto piece = s.substr(call.args_sent, upto - call.args_sent);
        const auto index = static_cast<uint32_t>(sent_.size() - 1);
        if (!out->tool_calls.empty() && out->tool_calls.back().index == index) out->tool_calls.back().arguments += piece;
        else out->tool_calls.push_back({{}, std::string{piece}, index, false});
        call.args_sent = upto;
      }
      if (cut) {  // the JSON did not end before the call did: the end reads it
        stopped_ = true;
        return;
      }
      if (!ended) return;
      args_open_ = false;
      next_from_ = scan_.at;
    }
    const bool first = sent_.empty();
    call_head head;
    if (forced_) {
      head = forced_head(s, next_from_, first, forced_tool_);
    } else {
      switch (format_) {
        case tool_call_format::hermes: head = hermes_head(s, &next_from_, &end_seen_, first); break;
        case tool_call_format::llama_json: head = llama_head(s, next_from_, first); break;
        case tool_call_format::mistral: head = mistral_head(s, next_from_, first); break;
        case tool_call_format::deepseek:
          head = sectioned_head(s, &next_from_, first, format_, deepseek_form, &head_scanned_);
          break;
        case tool_call_format::kimi: head = sectioned_head(s, &next_from_, first, format_, kimi_form, &head_scanned_); break;
        case tool_call_format::qwen3_xml: head = xml_head(s, &next_from_, &tag_scanned_); break;
        case tool_call_format::none: break;
      }
    }
    if (head.status == call_head::more) return;
    if (head.status == call_head::none || !declared(parameters_.get(), head.name)) {  // (another function's: content)
      stopped_ = true;
      return;
    }
    out->tool_calls.push_back({head.name, {}, static_cast<uint32_t>(sent_.size()), true, head.id});
    head_scanned_ = {};  // the next call's head is searched from its own start
    sent_.push_back({std::move(head.name), head.args, head.args, {}, {}});
    for (const auto end : head.ends)  // once per call, not per token
      if (!end.empty()) sent_.back().ends.emplace_back(end);
    scan_ = json_scan{head.args};
    probe_ = scan_;
    args_open_ = true;
    end_seen_ = false;
  }
}

answer_parts tool_call_splitter::feed(const std::string& content, bool last) {
  answer_parts out;
  held_ += content;
  if (plain_) {
    out.content = std::move(held_);
    held_.clear();
    return out;
  }
  if (!calling_ && format_ == tool_call_format::llama_json) {  // (a forced answer is calling_ from the start)
    // A Llama call is the answer itself: held while the answer may still start with one.
    const std::string_view rest = std::string_view{held_}.substr(skip_space(held_, 0));
    const bool undecided = rest.size() < python_tag.size() && python_tag.substr(0, rest.size()) == rest;
    if (undecided && !last) return out;
    calling_ = !undecided && (rest[0] == '{' || starts_with(rest, 0, python_tag));
    if (!calling_) {
      plain_ = true;
      out.content = std::move(held_);
      held_.clear();
      return out;
    }
  } else if (!calling_) {
    // held_ is the tail held back (what may start a marker) and the new piece: searched once.
    size_t at = npos;
    std::vector<std::string> markers;
    for (const auto marker : call_markers(format_))
      if (!marker.empty()) {
        at = std::min(at, held_.find(marker));
        markers.emplace_back(marker);
      }
    if (at != npos) {
      out.content = held_.substr(0, at);
      held_.erase(0, at);
      calling_ = true;
    } else {
      const size_t shown = last || markers.empty() ? held_.size() : streamable_prefix(held_, markers);
      out.content = held_.substr(0, shown);
      held_.erase(0, shown);
      shown_ |= !out.content.empty();
      return out;
    }
  }
  shown_ |= !out.content.empty();
  if (!last) {
    stream_calls(&out);
    return out;
  }
  auto calls = read_held();
  if (forced_ && calls.tool_calls.empty()) {
    // A forced answer cut before its JSON closed (max_tokens): the calls as far as they go --
    // named, their arguments so far, as OpenAI sends a cut call with finish_reason "length" --
    // never the grammar's JSON as text (a list of {name, parameters} the client never asked for).
    stream_calls(&out);
    if (!sent_.empty() && args_open_) {  // what the stream held back (trailing blanks) goes too
      auto& call = sent_.back();
      if (call.args_sent < held_.size()) {
        const auto index = static_cast<uint32_t>(sent_.size() - 1);
        auto piece = held_.substr(call.args_sent);
        if (!out.tool_calls.empty() && out.tool_calls.back().index == index) out.tool_calls.back().arguments += piece;
        else out.tool_calls.push_back({{}, std::move(piece), index, false});
      }
    }
    out.called = false;  // not finished calls: the finish_reason says what cut them
    out.cut = true;
    held_.clear();
    return out;
  }
  // The whole answer's calls must go on from the pieces already sent.
  bool agrees = !calls.tool_calls.empty() && calls.tool_calls.size() >= sent_.size();
  for (size_t i = 0; agrees && i < sent_.size(); ++i) {
    const auto& sent = sent_[i];
    agrees = calls.tool_calls[i].name == sent.name &&
             std::string_view{calls.tool_calls[i].arguments}.starts_with(sent_arguments(sent));
  }
  out.called = agrees || !sent_.empty();
  if (!agrees) {
    out.content += held_;  // no calls after all, or not the ones sent: the held text is content
  } else {
    for (auto& c : calls.tool_calls) {
      if (c.index < sent_.size()) {  // the rest of a call already begun
        c.arguments.erase(0, sent_arguments(sent_[c.index]).size());
        c.name.clear();
        c.first = false;
        if (c.arguments.empty()) continue;
      }
      out.tool_calls.push_back(std::move(c));
    }
    // The content before the first call already went out; what the calls leave (text between
    // and after them) follows it now.
    if (!calls.content.empty()) out.content += (shown_ ? "\n" : "") + calls.content;
  }
  held_.clear();
  return out;
}

}  // namespace baton::deploy::openai
