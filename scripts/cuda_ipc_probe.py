#!/usr/bin/env python3
"""Does CUDA IPC work on this machine (issue 12 asks before relying on it; the H200 machine is a
microVM)? A child process opens a parent's device buffer through torch's CUDA IPC handles and
writes into it; the parent checks the write. Prints 'cuda ipc: works' or the failure."""
import torch
import torch.multiprocessing as mp


def child(q, done):
    t = q.get()
    t.fill_(7.0)
    torch.cuda.synchronize()
    done.put("ok")


def main():
    if not torch.cuda.is_available():
        print("cuda ipc: no GPU")
        return
    ctx = mp.get_context("spawn")
    q, done = ctx.Queue(), ctx.Queue()
    t = torch.zeros(1 << 20, device="cuda")
    p = ctx.Process(target=child, args=(q, done))
    p.start()
    q.put(t)
    try:
        done.get(timeout=60)
        torch.cuda.synchronize()
        print("cuda ipc:", "works" if bool((t == 7.0).all()) else "child wrote nothing visible")
    except Exception as e:  # noqa: BLE001 - a probe reports whatever happened
        print("cuda ipc: failed:", repr(e))
    p.join(timeout=30)


if __name__ == "__main__":
    main()
