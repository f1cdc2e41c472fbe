#!/usr/bin/env python3
"""Independent reference for Baton's model code: tiny random-initialised models of each supported
family, created and saved by Hugging Face transformers itself, and transformers' own fp32 CPU
logits for them. Run it where torch and transformers exist (the H200 machine has both; Debian
has neither), then commit tests/data/hf_reference/. The C++ test
"independent reference: ..." in tests/gpu/hf_model.test.cpp compares against these files and is
skipped (pending) until they exist.

Usage: python3 scripts/hf_reference.py [--out tests/data/hf_reference]
"""
import argparse
import json
import os

import torch
from transformers import AutoConfig, AutoModelForCausalLM

torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False

COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              max_position_embeddings=256, rms_norm_eps=1e-6, initializer_range=0.2,
              bos_token_id=1, eos_token_id=2, torch_dtype="float32")

FAMILIES = {
    "llama_gqa": ("llama", dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)),
    "llama3_rope_scaled": ("llama", dict(num_attention_heads=4, num_key_value_heads=1, rope_theta=500000.0,
                                         rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                           high_freq_factor=4.0,
                                                           original_max_position_embeddings=32))),
    "mistral": ("mistral", dict(num_attention_heads=4, num_key_value_heads=2, sliding_window=None)),
    "qwen2_bias_tied": ("qwen2", dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)),
    "qwen3_qk_norm": ("qwen3", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                    tie_word_embeddings=False)),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="tests/data/hf_reference")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    names = []
    for name, (model_type, extra) in FAMILIES.items():
        torch.manual_seed(20261130)
        cfg = AutoConfig.for_model(model_type, **COMMON, **extra)
        model = AutoModelForCausalLM.from_config(cfg).float().eval()
        out = os.path.join(args.out, name)
        model.save_pretrained(os.path.join(out, "model"), safe_serialization=True)
        g = torch.Generator().manual_seed(7)
        tokens = torch.randint(3, cfg.vocab_size, (64,), generator=g)
        with torch.no_grad():
            logits = model(tokens[None, :]).logits[0].float()
        top2 = torch.topk(logits, 2, dim=-1).values
        margin = float((top2[:, 0] - top2[:, 1]).min())
        if margin < 1e-2:
            raise SystemExit(f"{name}: top-2 logit margin {margin} < 1e-2; raise initializer_range")
        prompt = tokens[:8]
        model.generation_config.eos_token_id = None
        model.generation_config.pad_token_id = 0
        with torch.no_grad():
            gen = model.generate(prompt[None, :], max_new_tokens=32, do_sample=False)[0, 8:]
        with open(os.path.join(out, "reference.json"), "w") as f:
            json.dump({"family": model_type, "min_top2_margin": margin, "tokens": tokens.tolist(),
                       "logits": logits.tolist(), "greedy_prompt": prompt.tolist(),
                       "greedy_tokens": gen.tolist()}, f)
        print(f"{name}: min top-2 margin {margin:.4f}")
        names.append(name)
    with open(os.path.join(args.out, "index.json"), "w") as f:
        json.dump(names, f)


if __name__ == "__main__":
    main()
