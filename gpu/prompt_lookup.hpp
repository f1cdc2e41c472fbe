#pragma once

// Drafts for speculative decoding by prompt lookup (n-gram matching): a sequence's next tokens
// are guessed from its own history -- answers that quote, copy or repeat their prompt (RAG,
// code edits, summaries, JSON echoing a schema) repeat its n-grams -- with no draft model. The
// target model then checks the guesses in one step (actors/decode_rank.cpp); what it would not
// have picked is dropped, so the guesses change the speed, never the tokens.

#include <cstdint>
#include <span>
#include <vector>

namespace baton::gpu {

/// The draft after `history` (every token so far, the next input last): the longest earlier
/// occurrence of its last n tokens, n from `min_ngram` to `max_ngram` (the latest of equals), and
/// the `max_draft` tokens that followed it; where those run into the end of the history, the
/// draft repeats the span (a loop is drafted whole). Empty when no n-gram of those lengths
/// occurs earlier, or `max_draft` is 0. One pass over the history.
std::vector<int32_t> propose_by_lookup(std::span<const int32_t> history, uint32_t min_ngram, uint32_t max_ngram,
                                       uint32_t max_draft);

}  // namespace baton::gpu
