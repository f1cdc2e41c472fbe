#!/usr/bin/python3
"""Trains Baton's built-in model: a tiny Llama-architecture model on the King James Bible (public
domain; Debian's bible-kjv package prints it), with its own byte-level BPE tokenizer. Writes a
Hugging Face model directory that Baton loads like any other: config.json, model.safetensors,
tokenizer.json, tokenizer_config.json, generation_config.json, plus heldout.txt (text the model
never trained on, for the "has learned" test) and TRAINING.md (what was run and the losses).

Run with Debian's python3 and python3-torch (apt-get install python3-torch bible-kjv); Debian has
no transformers, tokenizers or safetensors packages, so this script writes those files itself.
Training is never part of CI.

Usage: /usr/bin/python3 scripts/train_builtin.py [--out models/baton-kjv-tiny] [--minutes 20] [--threads 2]
"""
import argparse
import collections
import json
import math
import os
import re
import struct
import subprocess
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

# GPT-2's pre-tokenizer split. tokenizer.json carries the real one (\p{L}, \p{N}); this ASCII form
# splits the (pure ASCII) corpus identically, and Python's re has no Unicode classes.
SPLIT_ASCII = re.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]+|\s+(?!\S)|\s+""")


def bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def corpus():
    text = subprocess.run(["bible", "Gen1:1-Rev22:21"], capture_output=True, text=True, check=True).stdout
    # One verse per line, without the verse numbers: plain prose to model.
    lines = []
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        line = re.sub(r"^\d+ ", "", line)
        lines.append(line)
    return "\n".join(lines) + "\n"


def train_bpe(text, num_merges, b2u):
    words = collections.Counter(SPLIT_ASCII.findall(text))
    vocab = {w: tuple(b2u[b] for b in w.encode()) for w in words}
    merges = []
    for _ in range(num_merges):
        pairs = collections.Counter()
        for w, n in words.items():
            s = vocab[w]
            for a, b in zip(s, s[1:]):
                pairs[(a, b)] += n
        if not pairs:
            break
        best = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))[0]
        merges.append(best)
        for w in words:
            s = vocab[w]
            if len(s) < 2:
                continue
            out, i = [], 0
            while i < len(s):
                if i + 1 < len(s) and (s[i], s[i + 1]) == best:
                    out.append(s[i] + s[i + 1])
                    i += 2
                else:
                    out.append(s[i])
                    i += 1
            vocab[w] = tuple(out)
    return merges


def encode(text, b2u, ranks, tok_id):
    ids = []
    for piece in SPLIT_ASCII.findall(text):
        s = [b2u[b] for b in piece.encode()]
        while len(s) > 1:
            best = min(((ranks.get((a, b), 1 << 30), i) for i, (a, b) in enumerate(zip(s, s[1:]))))
            if best[0] == 1 << 30:
                break
            r = best[0]
            out, i = [], 0
            while i < len(s):
                if i + 1 < len(s) and ranks.get((s[i], s[i + 1])) == r:
                    out.append(s[i] + s[i + 1])
                    i += 2
                else:
                    out.append(s[i])
                    i += 1
            s = out
        ids.extend(tok_id[t] for t in s)
    return ids


class RMSNorm(nn.Module):
    def __init__(self, d, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        h, hd = c["hidden_size"], c["head_dim"]
        self.nh, self.nkv, self.hd = c["num_attention_heads"], c["num_key_value_heads"], hd
        self.input_layernorm = RMSNorm(h, c["rms_norm_eps"])
        self.post_attention_layernorm = RMSNorm(h, c["rms_norm_eps"])
        self.q_proj = nn.Linear(h, self.nh * hd, bias=False)
        self.k_proj = nn.Linear(h, self.nkv * hd, bias=False)
        self.v_proj = nn.Linear(h, self.nkv * hd, bias=False)
        self.o_proj = nn.Linear(self.nh * hd, h, bias=False)
        f = c["intermediate_size"]
        self.gate_proj = nn.Linear(h, f, bias=False)
        self.up_proj = nn.Linear(h, f, bias=False)
        self.down_proj = nn.Linear(f, h, bias=False)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        y = self.input_layernorm(x)
        q = self.q_proj(y).view(b, t, self.nh, self.hd).transpose(1, 2)
        k = self.k_proj(y).view(b, t, self.nkv, self.hd).transpose(1, 2)
        v = self.v_proj(y).view(b, t, self.nkv, self.hd).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        rep = self.nh // self.nkv
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.hd)
        mask = torch.ones(t, t, dtype=torch.bool).triu(1)
        a = scores.masked_fill(mask, float("-inf")).softmax(-1) @ v
        x = x + self.o_proj(a.transpose(1, 2).reshape(b, t, -1))
        y = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(y)) * self.up_proj(y))


class Llama(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        self.embed_tokens = nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.layers = nn.ModuleList(Block(c) for _ in range(c["num_hidden_layers"]))
        self.norm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.lm_head = nn.Linear(c["hidden_size"], c["vocab_size"], bias=False)
        hd = c["head_dim"]
        inv = 1.0 / (c["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
        pos = torch.arange(c["max_position_embeddings"]).float()
        freqs = torch.outer(pos, inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)

    def forward(self, ids):
        t = ids.shape[1]
        x = self.embed_tokens(ids)
        cos, sin = self.cos[:t][None, None], self.sin[:t][None, None]
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))


def save_safetensors(path, tensors):
    header, blobs, off = {}, [], 0
    for name, t in tensors.items():
        data = t.detach().float().contiguous().numpy().tobytes()
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [off, off + len(data)]}
        blobs.append(data)
        off += len(data)
    header["__metadata__"] = {"format": "pt"}
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="models/baton-kjv-tiny")
    ap.add_argument("--minutes", type=float, default=20.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--merges", type=int, default=766)
    args = ap.parse_args()
    torch.manual_seed(20261130)
    torch.set_num_threads(args.threads)
    os.makedirs(args.out, exist_ok=True)
    text = corpus()
    split = int(len(text) * 0.98)
    train_text, held_text = text[:split], text[split:]
    b2u = bytes_to_unicode()
    t0 = time.time()
    merges = train_bpe(train_text[:1_500_000], args.merges, b2u)
    vocab = {b2u[b]: b for b in range(256)}
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    bos, eos = len(vocab), len(vocab) + 1
    tokenizer = {
        "version": "1.0",
        "added_tokens": [
            {"id": bos, "content": "<|bos|>", "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": False, "special": True},
            {"id": eos, "content": "<|eos|>", "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": False, "special": True},
        ],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        # Training slices never start with <|bos|>, so prompts must not either.
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "vocab": vocab, "merges": [a + " " + b for a, b in merges]},
    }
    ranks = {m: i for i, m in enumerate(merges)}
    ids = torch.tensor(encode(train_text, b2u, ranks, vocab), dtype=torch.long)
    held = torch.tensor(encode(held_text, b2u, ranks, vocab), dtype=torch.long)
    print(f"tokenizer: {len(vocab)} tokens + 2 special, {len(ids)} training tokens ({time.time() - t0:.0f} s)")
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "_name_or_path": "baton-kjv-tiny",
           "vocab_size": len(vocab) + 2, "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
           # The context it was trained on: positions beyond it were never seen.
           "max_position_embeddings": 256,
           "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False, "bos_token_id": bos,
           "eos_token_id": eos, "torch_dtype": "float32", "hidden_act": "silu", "attention_bias": False}
    model = Llama(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01, betas=(0.9, 0.95))
    seq, batch = 256, 16
    deadline = time.time() + args.minutes * 60
    step, log = 0, []
    est_steps = 4000
    while time.time() < deadline:
        lr = 3e-3 * max(0.05, 0.5 * (1 + math.cos(math.pi * min(1.0, step / est_steps))))
        for g in opt.param_groups:
            g["lr"] = lr
        starts = torch.randint(0, len(ids) - seq - 1, (batch,))
        x = torch.stack([ids[s:s + seq] for s in starts])
        y = torch.stack([ids[s + 1:s + seq + 1] for s in starts])
        loss = F.cross_entropy(model(x).reshape(-1, cfg["vocab_size"]), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % 100 == 0:
            elapsed = time.time() - (deadline - args.minutes * 60)
            est_steps = max(step + 1, int(step * args.minutes * 60 / elapsed))
            log.append((step, float(loss)))
            print(f"step {step} loss {float(loss):.3f} lr {lr:.2e}", flush=True)
    model.eval()
    with torch.no_grad():  # in windows of the trained context, each from a fresh start
        windows = [held[i:i + seq] for i in range(0, 2048, seq)]
        ce = sum(float(F.cross_entropy(model(w[None])[0, :-1], w[1:])) for w in windows) / len(windows)
    counts = collections.Counter(held[:2048].tolist())
    n = sum(counts.values())
    unigram = -sum(c / n * math.log(c / n) for c in counts.values())
    print(f"held-out cross-entropy {ce:.3f} nats/token, unigram entropy {unigram:.3f}: {100 * (1 - ce / unigram):.0f}% below")
    sd = model.state_dict()
    tensors = {"model.embed_tokens.weight": sd["embed_tokens.weight"], "model.norm.weight": sd["norm.weight"],
               "lm_head.weight": sd["lm_head.weight"]}
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        q = f"model.layers.{i}."
        for a, b in [("input_layernorm", "input_layernorm"), ("post_attention_layernorm", "post_attention_layernorm")]:
            tensors[q + b + ".weight"] = sd[p + a + ".weight"]
        for a in ["q_proj", "k_proj", "v_proj", "o_proj"]:
            tensors[q + "self_attn." + a + ".weight"] = sd[p + a + ".weight"]
        for a in ["gate_proj", "up_proj", "down_proj"]:
            tensors[q + "mlp." + a + ".weight"] = sd[p + a + ".weight"]
    save_safetensors(os.path.join(args.out, "model.safetensors"), tensors)
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    with open(os.path.join(args.out, "tokenizer.json"), "w") as f:
        json.dump(tokenizer, f)
    with open(os.path.join(args.out, "tokenizer_config.json"), "w") as f:
        json.dump({"add_bos_token": False, "bos_token": "<|bos|>", "eos_token": "<|eos|>",
                   "model_max_length": cfg["max_position_embeddings"]}, f, indent=1)
    with open(os.path.join(args.out, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": bos, "eos_token_id": eos, "do_sample": False}, f, indent=1)
    with open(os.path.join(args.out, "heldout.txt"), "w") as f:
        f.write(held_text[:8000])
    with open(os.path.join(args.out, "TRAINING.md"), "w") as f:
        f.write(f"# baton-kjv-tiny\n\nTrained by `/usr/bin/python3 scripts/train_builtin.py --minutes {args.minutes} "
                f"--threads {args.threads}` on the King James Bible (public domain; Debian's bible-kjv), "
                f"torch {torch.__version__}, {step} steps of {batch}x{seq} tokens, AdamW, cosine learning rate.\n\n"
                f"Held-out (last 2% of the text, first 2,048 tokens in windows of {seq}): cross-entropy {ce:.3f} nats/token, unigram "
                f"entropy {unigram:.3f} ({100 * (1 - ce / unigram):.0f}% below).\n\nLoss every 100 steps: "
                + ", ".join(f"{s}:{l:.2f}" for s, l in log[::5]) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
