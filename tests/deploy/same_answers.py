#!/usr/bin/env python3
"""Shared by the multi-process tests: every streamed answer WORK/<hit>I.txt (SSE from the gateway)
must be complete, error-free and equal to the undisturbed WORK/<calm>I.txt, for I in 1..N.
Usage: same_answers.py WORK N CALM HIT [FINISH]   (FINISH: the expected finish_reason, if any)"""
import json
import sys


def answer(path, finish):
    events = [l[6:] for l in open(path).read().split("\n") if l.startswith("data: ")]
    assert events and events[-1] == "[DONE]", f"{path}: no [DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert not any("error" in c for c in chunks), f"{path}: {[c for c in chunks if 'error' in c]}"
    if finish:
        assert chunks[-1]["choices"][0]["finish_reason"] == finish, f"{path}: {chunks[-1]}"
    return "".join(c["choices"][0]["text"] for c in chunks)


work, n, calm, hit = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
finish = sys.argv[5] if len(sys.argv) > 5 else ""
for i in range(1, n + 1):
    a, b = answer(f"{work}/{calm}{i}.txt", finish), answer(f"{work}/{hit}{i}.txt", finish)
    assert a == b, f"request {i}: undisturbed {a!r}\n  disturbed {b!r}"
