#pragma once

// Grammars given as text (vLLM's guided_grammar and structured_outputs.grammar), in GBNF:
// llama.cpp's form, which xgrammar (vLLM's and SGLang's grammar backend) reads too.
//
//   root   ::= answer ("," ws answer)*      # the answer: what `root` matches, whole
//   answer ::= "yes" | "no" | [0-9]{1,3}
//   ws     ::= [ \t\n]*
//
// Rules are `name ::= alternatives`, one per line (a rule goes on across lines inside
// parentheses, or after `::=` and `|`). Elements: a rule's name, a "literal" (escapes \n \r \t
// \\ \" \xHH \uHHHH \UHHHHHHHH), a character class ([a-z], [^"\\], in regex_grammar.hpp's
// syntax; ranges between ASCII characters only), `.` (any character), a group (...), each
// optionally followed by *, +, ?, {m}, {m,} or {m,n} (counts up to 1,024). `#` starts a comment.
//
// Refused by name, with the line and column: rules used but never defined, rules defined twice,
// a grammar without `root`, and left recursion (`a ::= a "x" | "y"`; write it `a ::= "y" "x"*`),
// which the matcher cannot follow.

#include <string>
#include <string_view>

#include "gpu/grammar.hpp"

namespace baton::gpu {

/// The largest grammar text accepted, in bytes.
inline constexpr size_t max_gbnf_bytes = 64 * 1024;

/// Adds the rules of GBNF `text` to `g`; `*root` is its `root` rule. false and a sentence naming
/// what is wrong ("grammar: ..., at line L, column C") otherwise.
bool gbnf_rules(grammar& g, std::string_view text, uint32_t* root, std::string* why);

}  // namespace baton::gpu
