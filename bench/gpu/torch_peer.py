#!/usr/bin/env python3
"""The peer for issue 12's ratios: the same Llama-3-8B shape (random bf16 weights) in PyTorch /
transformers eager mode (no compilation; attention through torch's SDPA, transformers' default)
on the same GPU, in the same run as baton_bench_gpu. Prints one JSON line per measurement and a
short table. Skips (exit 0) where torch or a GPU is missing.

Usage: python3 bench/gpu/torch_peer.py [--quick] [--json FILE]
"""
import argparse
import json
import sys
import time

try:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
except ImportError as e:  # the dry run on a machine without torch
    print(f"torch_peer: skipped ({e})")
    sys.exit(0)


def timed(fn, reps):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end))
    out.sort()
    return out[len(out) // 2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("torch_peer: skipped (no GPU)")
        return
    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=16384,
                      rms_norm_eps=1e-5)
    t0 = time.time()
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).eval()
    torch.set_default_dtype(torch.float32)
    print(f"torch_peer: torch {torch.__version__}, model made in {time.time() - t0:.1f} s")
    rows = []
    g = torch.Generator(device="cuda").manual_seed(1)
    with torch.no_grad():
        for n in ([1024] if args.quick else [1024, 8192]):
            ids = torch.randint(0, cfg.vocab_size, (1, n), device="cuda", generator=g)
            ms = timed(lambda: model(ids, use_cache=False, logits_to_keep=1), 3)
            rows.append({"bench": "torch_prefill", "tokens": n, "ms": ms})
        for batch, ctx in ([(1, 1024), (8, 1024)] if args.quick else
                           [(1, 1024), (8, 1024), (32, 1024), (128, 1024), (1, 8192), (8, 8192), (32, 8192)]):
            ids = torch.randint(0, cfg.vocab_size, (batch, ctx), device="cuda", generator=g)
            out = model(ids, use_cache=True, logits_to_keep=1)
            cache = out.past_key_values
            step = torch.randint(0, cfg.vocab_size, (batch, 1), device="cuda", generator=g)
            pos = torch.full((batch, 1), ctx, device="cuda")

            def one():
                model(step, past_key_values=cache, position_ids=pos, use_cache=True, logits_to_keep=1)
                cache.crop(ctx)  # the same context every time

            ms = timed(one, 5)
            rows.append({"bench": "torch_decode", "batch": batch, "ctx": ctx, "step_ms": ms})
            del cache, out
            torch.cuda.empty_cache()
    for r in rows:
        print(json.dumps(r))
    if args.json:
        with open(args.json, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
