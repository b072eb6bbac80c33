#!/usr/bin/env python3
"""Where the host time of one pykern call goes, on a CUDA GPU: cProfile over repeated calls (the GPU kept
busy by a sleep so nothing waits on it) of the torch flash_attention forward and of PagedDecodePlan.run.

    python tools/profile_host.py [--top 25]
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch


def profile(name: str, fn, n: int, top: int) -> None:
    fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(400_000_000)  # ~0.2 s of GPU time: the calls below only enqueue
    pr = cProfile.Profile()
    t0 = time.perf_counter()
    pr.enable()
    for _ in range(n):
        fn()
    pr.disable()
    t = (time.perf_counter() - t0) / n
    torch.cuda.synchronize()
    print(f"=== {name}: {t * 1e6:.0f} us a call under cProfile")
    pstats.Stats(pr).sort_stats("tottime").print_stats(top)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--n", type=int, default=50)
    args = ap.parse_args()
    from measure_gpu import paged_case  # tools/ is this script's folder, first on sys.path

    from pykern.ops.serving import PagedDecodePlan
    from pykern.torch import flash_attention

    q, k, v = (torch.randn(4, 2048, 16, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    with torch.no_grad():
        profile("flash_attention (torch, sm_90a)", lambda: flash_attention(q, k, v, causal=True), args.n, args.top)
    b, g, kvh, d, ps, L = 8, 4, 8, 128, 16, 1024
    qd, kp, vp, indptr, idx, last = paged_case(b, g, kvh, d, ps, L)
    plan = PagedDecodePlan(b, kvh * g, kvh, d, ps, q_dtype="bf16", kv_dtype="bf16", max_kv_len=L, like=qd)
    profile("PagedDecodePlan.run", lambda: plan.run(qd, kp, vp, indptr, idx, last), args.n, args.top)


if __name__ == "__main__":
    main()
