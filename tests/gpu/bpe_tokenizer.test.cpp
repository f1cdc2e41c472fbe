// The byte-level BPE tokenizer on a small hand-written tokenizer.json (mechanics: byte mapping,
// ranked merges, the Llama 3 split pattern, added tokens, streaming decode) and, when committed,
// the golden files made by Hugging Face's `tokenizers` (scripts/tokenizer_golden.py).

#include <doctest/doctest.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <fstream>

#include <nlohmann/json.hpp>

#include "gpu/byte_tokenizer.hpp"
#include "gpu/bpe_tokenizer.hpp"

using namespace baton::gpu;

namespace {

const char* llama3_split =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

/// Byte-level vocabulary (the 256 symbols, ids 0-255, in GPT-2's byte order) plus merges.
std::string tokenizer_json(const std::vector<std::pair<std::string, std::string>>& merges, bool llama3 = true) {
  nlohmann::json vocab = nlohmann::json::object();
  const auto& byte_sym = byte_level_symbols();
  for (int b = 0; b < 256; ++b) vocab[byte_sym[b]] = b;
  int next = 256;
  nlohmann::json m = nlohmann::json::array();
  for (const auto& [a, b] : merges) {
    m.push_back(a + " " + b);
    vocab[a + b] = next++;
  }
  nlohmann::json pre = llama3 ? nlohmann::json{{"type", "Sequence"},
                                               {"pretokenizers",
                                                {{{"type", "Split"},
                                                  {"pattern", {{"Regex", llama3_split}}},
                                                  {"behavior", "Isolated"},
                                                  {"invert", false}},
                                                 {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}}}}}
                              : nlohmann::json{{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}};
  nlohmann::json j = {{"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", m}}},
                      {"added_tokens", {{{"id", next}, {"content", "<|eot|>"}, {"special", true}}}},
                      {"pre_tokenizer", pre},
                      {"normalizer", nullptr}};
  return j.dump();
}

}  // namespace

TEST_CASE("BPE: ranked merges, the Llama 3 split, added tokens, and exact round trips of hard strings") {
  // "Ġ" is the byte-level symbol of a space.
  std::string why;
  auto t = bpe_tokenizer::from_json(
      tokenizer_json({{"h", "e"}, {"l", "l"}, {"he", "ll"}, {"hell", "o"}, {"Ġ", "w"}, {"o", "r"}, {"Ġw", "or"},
                      {"Ġwor", "ld"}, {"l", "d"}, {"1", "2"}, {"12", "3"}}),
      "tokenizer.json", &why);
  REQUIRE_MESSAGE(t, why);
  const int32_t hello = t->token_id("hello"), world = t->token_id(" world");
  CHECK(hello >= 256);
  CHECK(world >= 256);
  CHECK(t->encode("hello world") == std::vector<int32_t>{hello, world});
  // Digits split in groups of at most three before merging: "12345" -> "123" + "4" "5".
  const auto digits = t->encode("12345");
  REQUIRE(digits.size() == 3);
  CHECK(digits[0] == t->token_id("123"));
  // An added special token inside text is one id; decoding can skip it.
  const int32_t eot = t->token_id("<|eot|>");
  const auto ids = t->encode("hello<|eot|>hello");
  CHECK(ids == std::vector<int32_t>{hello, eot, hello});
  CHECK(t->decode(ids) == "hello<|eot|>hello");
  CHECK(t->decode(ids, true) == "hellohello");
  for (const std::string& s : std::vector<std::string>{"Grüße, 世界! 🎉🎉 naïve café", "   leading and trailing   ", "tabs\tand\nnewlines\r\n\n",
                              "x = f(a[1], {b: 2}) // 3.14159 + 42", "emoji 👩‍👩‍👧 and ZWJ", "0123456789",
                              "don't I'LL we've", std::string("\xf0\x9f\x98\x80 end")})
    CHECK_MESSAGE(t->decode(t->encode(s)) == s, s);
}

TEST_CASE("BPE with an NFC normalizer (Qwen's) composes the text first: a decomposed accent gives the composed "
          "character's tokens; without one, the bytes as given") {
  std::string why;
  auto j = nlohmann::json::parse(tokenizer_json({}));
  auto plain = bpe_tokenizer::from_json(j.dump(), "tokenizer.json", &why);
  REQUIRE_MESSAGE(plain, why);
  j["normalizer"] = {{"type", "NFC"}};
  auto nfc = bpe_tokenizer::from_json(j.dump(), "tokenizer.json", &why);
  REQUIRE_MESSAGE(nfc, why);
  const std::string composed = "caf\xc3\xa9", decomposed = "cafe\xcc\x81";  // é, and e + U+0301
  CHECK(nfc->encode(decomposed) == nfc->encode(composed));
  CHECK(nfc->encode(composed) == plain->encode(composed));
  CHECK(plain->encode(decomposed) != plain->encode(composed));
  CHECK(nfc->decode(nfc->encode(decomposed)) == composed);
  // Around an added token, and with bytes that are not UTF-8 (kept as they are).
  CHECK(nfc->encode(decomposed + "<|eot|>" + decomposed) == nfc->encode(composed + "<|eot|>" + composed));
  const std::string broken = "e\xcc\x81\xff";
  CHECK(nfc->decode(nfc->encode(broken)) == broken);
}

TEST_CASE("BPE merges lowest rank first and leftmost first, in time that grows gently with the piece") {
  std::string why;
  // "a a" (rank 0) before "aa a" (rank 1) before "aa aa" (rank 2): "aaa" merges its left pair
  // first; five letters become "aa" "aa" "a", then the lower-ranked "aa a" wins over "aa aa".
  auto t = bpe_tokenizer::from_json(tokenizer_json({{"a", "a"}, {"aa", "a"}, {"aa", "aa"}}), "tokenizer.json", &why);
  REQUIRE_MESSAGE(t, why);
  const int32_t a = t->token_id("a"), aa = t->token_id("aa"), aaa = t->token_id("aaa"), a4 = t->token_id("aaaa");
  CHECK(t->encode("aaa") == std::vector<int32_t>{aaa});  // "a a" first, then "aa a"
  CHECK(t->encode("aaaa") == std::vector<int32_t>{a4});
  CHECK(t->encode("aaaaa") == std::vector<int32_t>{aa, aaa});
  CHECK(t->encode("aaaaaa") == std::vector<int32_t>{a4, aa});
  // One letter 200,000 times is a single piece: it takes a moment, not the quadratic minutes it
  // used to (no timing asserted: the count and the round trip are).
  const std::string run(200000, 'a');
  const auto ids = t->encode(run);
  CHECK(ids.size() == 50000);
  CHECK(t->decode(ids) == run);
  // Thousands of special tokens in one prompt: each is one id, in order.
  std::string many;
  for (int i = 0; i < 5000; ++i) many += "a<|eot|>";
  const auto m = t->encode(many);
  REQUIRE(m.size() == 10000);
  CHECK(m[1] == t->token_id("<|eot|>"));
  CHECK(m[9998] == a);
  CHECK(t->decode(m) == many);
}

TEST_CASE("BPE streaming decode never emits half a UTF-8 character") {
  std::string why;
  auto t = bpe_tokenizer::from_json(tokenizer_json({}), "tokenizer.json", &why);
  REQUIRE(t);
  const auto ids = t->encode("a🎉b");  // no merges: 1 + 4 + 1 byte tokens
  REQUIRE(ids.size() == 6);
  bpe_tokenizer::stream s{*t};
  CHECK(s.push(ids[0]) == "a");
  CHECK(s.push(ids[1]).empty());
  CHECK(s.push(ids[2]).empty());
  CHECK(s.push(ids[3]).empty());
  CHECK(s.push(ids[4]) == "🎉");
  CHECK(s.push(ids[5]) == "b");
  CHECK(s.flush().empty());
  CHECK(s.push(ids[1]).empty());
  CHECK(s.flush() == "\xf0");  // an incomplete character at the very end comes out as it is
}

TEST_CASE("tokenizer.json files Baton cannot run are refused with a sentence") {
  std::string why;
  auto j = nlohmann::json::parse(tokenizer_json({}));
  auto load = [&](const nlohmann::json& x) { return bpe_tokenizer::from_json(x.dump(), "tokenizer.json", &why); };
  auto k = j;
  k["model"]["type"] = "WordPiece";
  CHECK_FALSE(load(k));
  CHECK(why.find("model type WordPiece is not supported") != std::string::npos);
  k = j;
  k["model"]["byte_fallback"] = true;
  CHECK_FALSE(load(k));
  CHECK(why.find("byte_fallback") != std::string::npos);
  k = j;
  k["pre_tokenizer"] = {{"type", "Metaspace"}};
  CHECK_FALSE(load(k));
  CHECK(why.find("pre_tokenizer Metaspace is not supported") != std::string::npos);
  k = j;
  k["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "(unclosed";
  CHECK_FALSE(load(k));
  CHECK(why.find("does not compile") != std::string::npos);
  for (int64_t id : {int64_t{-5}, int64_t{2147483647}}) {  // sized the id table from it: the process aborted
    k = j;
    k["added_tokens"][0]["id"] = id;
    CHECK_FALSE(load(k));
    CHECK(why.find("outside 0 to 2^24") != std::string::npos);
  }
  // A merge whose parts or result the vocabulary lacks (Hugging Face refuses these too).
  k = nlohmann::json::parse(tokenizer_json({{"h", "e"}}));
  k["model"]["merges"].push_back("he llo");
  CHECK_FALSE(load(k));
  CHECK(why == "tokenizer.json: merge 1 (he llo) names 'llo', which is not in the vocabulary");
  k = nlohmann::json::parse(tokenizer_json({{"h", "e"}}));
  k["model"]["merges"].push_back("h h");
  CHECK_FALSE(load(k));
  CHECK(why.find("names 'hh', which is not in the vocabulary") != std::string::npos);
  CHECK_FALSE(bpe_tokenizer::from_json("{", "tokenizer.json", &why));
  CHECK_FALSE(bpe_tokenizer::load("/nonexistent/tokenizer.json", &why));
  CHECK(why.find("cannot read") != std::string::npos);
  // Normalizers: none, NFC, or a Sequence of them (DeepSeek-V3's is an empty Sequence); others are
  // refused by name, inside a Sequence too.
  k = j;
  k["normalizer"] = {{"type", "Sequence"}, {"normalizers", nlohmann::json::array()}};
  CHECK(load(k));
  k["normalizer"]["normalizers"].push_back({{"type", "NFC"}});
  CHECK(load(k));
  k["normalizer"]["normalizers"].push_back({{"type", "Lowercase"}});
  CHECK_FALSE(load(k));
  CHECK(why.find("normalizer Lowercase is not supported") != std::string::npos);
  // GPT-2 style (ByteLevel with its own regex) loads too.
  CHECK(bpe_tokenizer::from_json(tokenizer_json({}, false), "tokenizer.json", &why));
}

namespace {
const std::string golden_dir = BATON_SOURCE_DIR "/tests/data/tokenizer_golden";
bool have_golden() { return std::filesystem::exists(golden_dir + "/expected.json"); }
}  // namespace

// The golden files were made by Hugging Face `tokenizers` 0.23 (scripts/tokenizer_golden.py, run on
// the H200 machine by scripts/device-refs.sh) and are committed: our own expectations would prove
// nothing.
TEST_CASE("golden: encode and decode equal Hugging Face tokenizers' exactly on hard strings") {
  REQUIRE_MESSAGE(have_golden(), "tests/data/tokenizer_golden/expected.json is missing");
  std::string why;
  auto t = bpe_tokenizer::load(golden_dir + "/tokenizer.json", &why);
  REQUIRE_MESSAGE(t, why);
  std::ifstream in{golden_dir + "/expected.json"};
  const auto cases = nlohmann::json::parse(in);
  for (const auto& c : cases) {
    const auto text = c["text"].get<std::string>();
    CAPTURE(text);
    CHECK(t->encode(text) == c["ids"].get<std::vector<int32_t>>());
    CHECK(t->decode(c["ids"].get<std::vector<int32_t>>()) == c["decoded"].get<std::string>());
  }
}

TEST_CASE("escape for the terminal: ASCII and well-formed UTF-8 as they are, newlines and the like as C escapes, "
          "anything else byte by byte") {
  using baton::gpu::byte_tokenizer;
  CHECK(byte_tokenizer::escape("plain text") == "plain text");
  CHECK(byte_tokenizer::escape("a\nb\tc\rd\\e") == "a\\nb\\tc\\rd\\\\e");
  CHECK(byte_tokenizer::escape("\x01\x7f") == "\\x01\\x7f");
  // Two-, three- and four-byte characters pass: é, 中文, 😀.
  CHECK(byte_tokenizer::escape("caf\xc3\xa9 \xe4\xb8\xad\xe6\x96\x87 \xf0\x9f\x98\x80") ==
        "caf\xc3\xa9 \xe4\xb8\xad\xe6\x96\x87 \xf0\x9f\x98\x80");
  // A character cut off by a token boundary, a stray continuation byte, an overlong form, a
  // surrogate, past U+10FFFF, and a C1 control: byte by byte.
  CHECK(byte_tokenizer::escape("\xe4\xb8") == "\\xe4\\xb8");
  CHECK(byte_tokenizer::escape("\x80x") == "\\x80x");
  CHECK(byte_tokenizer::escape("\xc0\xaf") == "\\xc0\\xaf");
  CHECK(byte_tokenizer::escape("\xe0\x80\xaf") == "\\xe0\\x80\\xaf");
  CHECK(byte_tokenizer::escape("\xed\xa0\x80") == "\\xed\\xa0\\x80");
  CHECK(byte_tokenizer::escape("\xf4\x90\x80\x80") == "\\xf4\\x90\\x80\\x80");
  CHECK(byte_tokenizer::escape("\xc2\x85") == "\\xc2\\x85");
  CHECK(byte_tokenizer::escape("\xc2\xa9") == "\xc2\xa9");  // ©, the first character after the C1 block
}
