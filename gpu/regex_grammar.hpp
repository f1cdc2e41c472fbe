#pragma once

// Regular expressions as grammar rules (grammar.hpp), for JSON schema's `pattern`, the string
// `format`s and `minLength`/`maxLength`: a rule that matches a JSON string, quotes included,
// whose decoded text matches the expression. The rule writes the text as JSON spells it: `"`,
// `\` and control characters escaped (\n, \t, ... or \u00XX), everything else as itself.
// Also a whole answer that must match an expression (text_matching), written as itself.
//
// The syntax is ECMA-262's, as JSON schema's `pattern` is: alternation, groups ((...) and
// (?:...)), quantifiers (?, *, +, {m}, {m,}, {m,n}; lazy ones match the same strings),
// classes ([a-z], [^...]), `.`, \d \w \s and their capitals, escaped characters. The anchors ^
// and $ only at the start and end. Without them the text need only contain a match, as the
// standard says. Refused by name: backreferences, lookarounds, word boundaries, Unicode property
// classes, counts above 1,024.

#include <string>
#include <string_view>

#include "gpu/grammar.hpp"

namespace baton::gpu {

/// The most a quantifier may count ({m,n}; minLength, maxLength).
inline constexpr uint32_t max_regex_count = 1024;

/// Reads a quantifier's count (decimal digits) at text[*at], moving *at past every digit; values
/// past UINT32_MAX read as UINT32_MAX. false when no digit is there.
bool read_count(std::string_view text, size_t* at, uint32_t* out);

/// Why a quantifier {lo,hi} is refused (hi below lo, or a count over max_regex_count; hi may be
/// grammar::unbounded); empty when it is taken. The regex and GBNF parsers share it.
std::string count_bounds_error(uint32_t lo, uint32_t hi);

/// The longest expression taken, in bytes.
inline constexpr size_t max_regex_bytes = 4096;

/// Adds to `g` a rule matching a JSON string whose text matches `pattern`; false and a
/// sentence naming what is not supported (or malformed) otherwise, starting "pattern: ".
bool json_string_matching(grammar& g, std::string_view pattern, uint32_t* rule, std::string* why);

/// Adds to `g` a rule matching text, as itself, that `pattern` matches whole (vLLM's
/// guided_regex, SGLang's regex): implicitly anchored at both ends, and `.` is any character
/// but \n (Python's re, which vLLM's backends follow; a JSON schema's pattern also keeps \r
/// out). false and a sentence starting with `name` ("regex: ...") otherwise.
bool text_matching(grammar& g, std::string_view pattern, uint32_t* rule, std::string* why,
                   const std::string& name = "regex");

}  // namespace baton::gpu
