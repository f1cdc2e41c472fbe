#!/usr/bin/env python3
"""Golden files for Baton's BPE tokenizer, made by Hugging Face `tokenizers` (pip install
tokenizers; it trains offline). Trains a byte-level BPE with the Llama 3 pre-tokenizer split on a
corpus of hard strings, then records its encodings. Commit tests/data/tokenizer_golden/; the C++
test "golden: ..." in tests/gpu/bpe_tokenizer.test.cpp is skipped (pending) until then.

Usage: python3 scripts/tokenizer_golden.py [--out tests/data/tokenizer_golden]
"""
import argparse
import json
import os

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")

HARD = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "Grüße aus Köln — naïve café, résumé, Ångström.",
    "世界你好，这是一个测试。日本語のテキストも。한국어 텍스트.",
    "emoji 🎉🚀👩‍👩‍👧‍👦 and flags 🇩🇪🇯🇵 and skin tones 👍🏽",
    "    four leading spaces, trailing tabs\t\t\n\n\nthree newlines",
    "numbers 1234567890 3.14159 -42 1e-9 0x1F 2026-11-30",
    "def f(x):\n    return {'a': [1, 2, 3], \"b\": x ** 2}  # comment\n",
    "I'm, you're, we've, they'll, she'd, IT'S, DON'T",
    "<|eot|> special in the middle <|eot|> and at the end<|eot|>",
    "zero\u200bwidth space and soft\u00adhyphen and nbsp\u00a0here",
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="tests/data/tokenizer_golden")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    tok = Tokenizer(models.BPE(ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<|eot|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(HARD * 20, trainer=trainer)
    tok.save(os.path.join(args.out, "tokenizer.json"))
    cases = []
    for text in HARD:
        ids = tok.encode(text).ids
        cases.append({"text": text, "ids": ids, "decoded": tok.decode(ids, skip_special_tokens=False)})
    with open(os.path.join(args.out, "expected.json"), "w", encoding="utf-8") as f:
        json.dump(cases, f, ensure_ascii=False, indent=1)
    print(f"wrote {len(cases)} cases")


if __name__ == "__main__":
    main()
