#pragma once

// Byte-level BPE tokenizers from a Hugging Face `tokenizer.json` (the GPT-2, Llama 3 and Qwen2
// families): added and special tokens, the pre-tokenizer's split patterns (Unicode classes
// through PCRE2 with UTF and UCP), ByteLevel byte<->symbol mapping, ranked merges, and a
// streaming decoder that never emits half a UTF-8 character.

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

namespace baton::gpu {

/// GPT-2's reversible byte -> printable symbol map (UTF-8 of each byte's symbol), which byte-level
/// BPE vocabularies are written in.
const std::vector<std::string>& byte_level_symbols();

class bpe_tokenizer {
 public:
  /// Loads tokenizer.json; nullptr and a sentence naming what is unsupported or malformed.
  static std::unique_ptr<bpe_tokenizer> load(const std::string& path, std::string* why);
  static std::unique_ptr<bpe_tokenizer> from_json(const std::string& text, const std::string& source, std::string* why);
  ~bpe_tokenizer();

  /// Token ids of `text`; added tokens (special or not) are recognised by their exact content.
  std::vector<int32_t> encode(const std::string& text) const;
  /// The bytes of `ids` (special tokens included unless skip_special).
  std::string decode(const std::vector<int32_t>& ids, bool skip_special = false) const;
  /// The id of a token's content (e.g. "<|im_start|>"), or -1.
  int32_t token_id(const std::string& content) const;
  /// Decoding keeps this special token's text even where special tokens are skipped (a tool-call
  /// marker such as Mistral's [TOOL_CALLS], which the answer's reader needs to see). False when
  /// the vocabulary has no such token.
  bool show_special(const std::string& content);
  uint32_t vocab_size() const { return static_cast<uint32_t>(id_to_token_.size()); }
  /// Whether the id is a special token (an added token marked special).
  bool is_special(int32_t id) const { return id >= 0 && static_cast<size_t>(id) < is_special_.size() && is_special_[id]; }

  /// Decodes a stream of ids, emitting only complete UTF-8 characters: bytes of a character split
  /// across tokens wait for the rest.
  class stream {
   public:
    explicit stream(const bpe_tokenizer& t, bool skip_special = true) : t_(t), skip_(skip_special) {}
    std::string push(int32_t id);
    /// Whatever is left (an incomplete character at the very end), as it is.
    std::string flush();

   private:
    const bpe_tokenizer& t_;
    bool skip_;
    std::string pending_;
  };

 private:
  bpe_tokenizer() = default;
  void encode_piece(const std::string& piece, std::vector<int32_t>* out) const;
  void encode_plain(const std::string& text, std::vector<int32_t>* out) const;

  std::unordered_map<std::string, int32_t> vocab_;
  std::vector<std::string> id_to_token_;             ///< byte-level symbol strings
  struct merge {
    uint32_t rank;  ///< lower merges first
    int32_t id;     ///< the merged token
  };
  /// (left id << 32 | right id) -> the merge of that pair; every id is checked against the vocab.
  std::unordered_map<uint64_t, merge> merges_;
  int32_t byte_id_[256];  ///< each byte's own token, -1 when the vocabulary lacks it (dropped, as HF does)
  struct added {
    std::string content;
    int32_t id;
    bool special;
  };
  std::vector<added> added_;  ///< longest content first
  std::unordered_map<int32_t, size_t> added_by_id_;  ///< id -> index in added_
  std::vector<bool> is_special_;
  std::vector<void*> patterns_;  ///< compiled pcre2 split patterns, applied in order (Isolated)
  bool ignore_merges_ = false;
  bool add_prefix_space_ = false;
  bool nfc_ = false;  ///< the normalizer composes text to NFC (Qwen's) before it is split
  std::string byte_to_symbol_[256];
  std::unordered_map<std::string, uint8_t> symbol_to_byte_;
};

}  // namespace baton::gpu
