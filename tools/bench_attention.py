#!/usr/bin/env python
"""Tensor-core FlashAttention (bf16) report, H100 model and GPU benchmark, forward and backward.

    python tools/bench_attention.py                    # resources per kernel + modelled H100 table
    python tools/bench_attention.py --json
    python tools/bench_attention.py --time             # on a GPU: measured TFLOP/s beside torch SDPA
                                                       # (and flash-attn / FlashInfer when importable)
    python tools/bench_attention.py --time --backend host --small   # smoke-test the timing path on the CPU

Shapes: LLaMA-3-8B (32 query / 8 kv heads, head_dim 128) and 70B (64 / 8, 128), batch 1, causal,
1K..16K tokens (n_q = n_k).

FLOPs: "useful" FLOPs as FlashAttention reports them: forward 4 * n_visible_pairs * d per head
(QK^T and PV), backward 2.5x that (5 matmuls). The kernels execute more: whole 64x64 tiles on the
causal diagonal, and the backward recomputes S in the dQ kernel (7 matmuls; 8 for d256).
Bytes: the minimum a call must move (q, k, v, out, lse; backward also dO, dq, dk, dv, delta).

Model (H100 SXM, 132 SMs, 990 TFLOP/s dense bf16, 3.35 TB/s), stated so it can be checked:
  * mma.sync (not wgmma) issues at most 2/3 of the Hopper tensor peak (FlashAttention-3 paper, s.1),
  * of which an FA2-style loop keeps MMA_SHARE = 0.55 busy (exp2, max/sum shuffles, ldmatrix and
    barriers in between; FA2 measures 335-370 TFLOP/s forward at d128 on H100, 0.66*990*0.55 = 360),
  * times occupancy: min(1, resident warps per SM / 8) (8 warps keep the 4 tensor cores fed, one
    MMA chain per warp),
  * times the tail wave: (CTAs / slots) / ceil(CTAs / slots), slots = 132 * CTAs per SM,
  * time = max(executed FLOPs / that rate, minimum bytes / 3.35 TB/s).
Registers and shared memory come from the compiler (ptxas) and the ops' launch sizes; CTAs/SM from
65536 registers (allocated per warp in units of 256), shared memory (sm_80: 164 KiB, sm_90: 228 KiB per
SM, 1 KiB reserved per CTA), 16 CTAs and 64 warps per SM.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

H100 = {"sms": 132, "peak": 990e12, "bw": 3.35e12}
MMA_SYNC_FRACTION = 2.0 / 3.0
MMA_SHARE = 0.55
SMEM_PER_SM = {"sm_80": 164 * 1024, "sm_90": 228 * 1024}
MODELS = {"llama3-8b": (32, 8, 128), "llama3-70b": (64, 8, 128)}
SEQS = (1024, 2048, 4096, 8192, 16384)


# --------------------------------------------------------------------------- kernels and resources

def kernels_for(d: int) -> dict[str, list[tuple[str, int, int]]]:
    """{"fwd"|"bwd": [(kernel, threads, dynamic smem)]} as the ops launch them at head_dim d."""
    from pykern.ops.forward import (FA2_HEAD_DIMS, FA2_THREADS, TC_THREADS, fa2_shared_bytes, tc_head_dim,
                                    tc_shared_bytes)
    from pykern.ops.training_attention import tc_backward_shared_bytes

    D = tc_head_dim(d)
    kv, dq = tc_backward_shared_bytes(D)
    bwd = ([(f"attention_backward_tc_dv_d{D}_bf16", TC_THREADS, kv), (f"attention_backward_tc_dk_d{D}_bf16", TC_THREADS, kv)]
           if D == 256 else [(f"attention_backward_tc_dkdv_d{D}_bf16", TC_THREADS, kv)])
    bwd.append((f"attention_backward_tc_dq_d{D}_bf16", TC_THREADS, dq))
    # head_dim 64 / 128 run the FlashAttention-2 core (128 queries, 8 warps a CTA), padded ones the _pad_ kernels
    fwd = ((f"flash_attention_tc_d{D}_bf16", FA2_THREADS, fa2_shared_bytes(D)) if d == D and D in FA2_HEAD_DIMS
           else (f"flash_attention_tc_{'pad_' if D in FA2_HEAD_DIMS else ''}d{D}_bf16", TC_THREADS, tc_shared_bytes(D)))
    return {"fwd": [fwd], "bwd": bwd}


def ctas_per_sm(regs: int, threads: int, smem: int, arch: str) -> int:
    warps = -(-threads // 32)
    regs_per_warp = -(-(max(regs, 1) * 32) // 256) * 256
    by_regs = 65536 // (regs_per_warp * warps)
    by_smem = SMEM_PER_SM[arch] // (smem + 1024) if smem else 16
    return max(0, min(by_regs, by_smem, 16, 64 // warps))


def resources(archs: tuple[str, ...] = ("sm_80", "sm_90")) -> list[dict[str, Any]]:
    from pykern import cache

    rows = []
    seen = set()
    for d in (64, 96, 128, 256):
        for phase, ks in kernels_for(d).items():
            for name, threads, smem in ks:
                if name in seen:
                    continue
                seen.add(name)
                src = ROOT / "kernels_cu" / ("flash_attention_tc.cu" if phase == "fwd" else "attention_backward_tc.cu")
                row: dict[str, Any] = {"kernel": name, "threads": threads, "smem": smem}
                for a in archs:
                    res = cache.get_module(src, a).resources[name]
                    row[a] = {"regs": res.registers, "spill": res.spill_stores + res.spill_loads,
                              "ctas_per_sm": ctas_per_sm(res.registers, threads, smem, a)}
                rows.append(row)
    return rows


# --------------------------------------------------------------------------- FLOPs, bytes, model

def visible_pairs(n_q: int, n_k: int, causal: bool) -> int:
    if not causal:
        return n_q * n_k
    shift = n_k - n_q  # query i sees keys j <= i + shift
    return sum(max(0, min(n_k, i + shift + 1)) for i in range(n_q)) if n_q < 4096 else \
        _pairs_closed(n_q, n_k, shift)


def _pairs_closed(n_q: int, n_k: int, shift: int) -> int:
    # rows with 0 < i + shift + 1 <= n_k contribute i + shift + 1; later rows n_k
    lo = max(0, -shift)  # first row that sees a key
    hi = min(n_q, n_k - shift)  # rows below see fewer than n_k
    s = 0
    if hi > lo:
        a, b = lo + shift + 1, hi - 1 + shift + 1
        s += (a + b) * (hi - lo) // 2
    s += max(0, n_q - max(hi, lo)) * n_k
    return s


def executed_tile_pairs(n_q: int, n_k: int, causal: bool, br: int, bc: int) -> int:
    """Query-key pairs the forward computes: whole tiles up to the causal diagonal."""
    shift, tot = n_k - n_q, 0
    n_kt = -(-n_k // bc)
    for qt in range(-(-n_q // br)):
        kt = n_kt
        if causal:
            last = min(qt * br + br, n_q) - 1 + shift
            kt = 0 if last < 0 else min(n_kt, last // bc + 1)
        tot += kt * br * bc
    return tot


def model(name: str, n: int, causal: bool = True, batch: int = 1) -> dict[str, Any]:
    from pykern.ops.forward import _TC_CFG, tc_head_dim

    h, kvh, d = MODELS[name]
    D = tc_head_dim(d)
    pairs = visible_pairs(n, n, causal) * batch * h
    fwd_flops = 4 * pairs * d
    bwd_flops = 2.5 * fwd_flops
    bc = _TC_CFG[D][0]
    exec_pairs = executed_tile_pairs(n, n, causal, 64, bc) * batch * h
    fwd_exec = 4 * exec_pairs * D
    bwd_exec = (8 if D == 256 else 7) * 2 * exec_pairs * D
    el = 2  # bf16
    q_b = batch * n * h * d * el
    kv_b = batch * n * kvh * d * el
    fwd_bytes = q_b + 2 * kv_b + q_b + batch * n * h * 4
    bwd_bytes = 3 * q_b + 2 * kv_b + q_b + 2 * kv_b + 2 * batch * n * h * 4  # q dO out | k v | dq | dk dv | lse D
    res = {r["kernel"]: r for r in resources(("sm_90",))}
    out: dict[str, Any] = {"model": name, "seq": n, "batch": batch, "causal": causal, "heads": h, "kv_heads": kvh,
                           "head_dim": d}
    for phase, flops, exe, nbytes in (("fwd", fwd_flops, fwd_exec, fwd_bytes), ("bwd", bwd_flops, bwd_exec, bwd_bytes)):
        t = 0.0
        ks = kernels_for(d)[phase]
        for kname, threads, smem in ks:
            cps = res[kname]["sm_90"]["ctas_per_sm"]
            if "dq" in kname or phase == "fwd":
                n_ctas, share = batch * h * -(-n // 64), (3 if "dq" in kname else 1)
            else:
                n_ctas, share = batch * kvh * -(-n // 64), 4 if D < 256 else (2 if "dv" in kname else 3)
            work = exe * share / (7 if phase == "bwd" and D < 256 else 8 if phase == "bwd" else 1)
            occ = min(1.0, cps * threads / 32 / 8)
            slots = H100["sms"] * cps
            waves = n_ctas / slots
            wave_eff = waves / math.ceil(waves) if waves > 0 else 1.0
            rate = H100["peak"] * MMA_SYNC_FRACTION * MMA_SHARE * occ * wave_eff
            t += work / rate
        t = max(t, nbytes / H100["bw"])
        out[phase] = {"flops": flops, "executed_flops": exe, "bytes": nbytes, "model_ms": t * 1e3,
                      "model_tflops": flops / t / 1e12, "model_pct_peak": 100 * flops / t / H100["peak"]}
    return out


# --------------------------------------------------------------------------- timing (--time)

def _timer(sync: Callable[[], None]) -> Callable[[Callable[[], Any], int], float]:
    def run(fn: Callable[[], Any], iters: int) -> float:
        fn()
        sync()
        best = math.inf
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            sync()
            best = min(best, (time.perf_counter() - t0) / iters)
        return best
    return run


def bench(args: argparse.Namespace) -> list[dict[str, Any]]:
    from pykern import ops

    rows = []
    if args.backend == "host":
        import numpy as np
        from pykern.difftest.cases.forward import fa_inputs

        timer = _timer(lambda: None)
        rng = np.random.default_rng(0)
        for name, (h, kvh, d) in MODELS.items():
            n = 64
            q, k, v = fa_inputs(rng, 1, n, n, h // 8, kvh // 8 or 1, d, d, "bf16")
            g = q.copy()
            out, lse = ops.flash_attention(q, k, v, causal=True, return_lse=True, backend="host")
            tf = timer(lambda: ops.flash_attention(q, k, v, causal=True, backend="host"), 1)
            tb = timer(lambda: ops.attention_backward(q[0], k[0], v[0], g[0], out=out[0], lse=lse[0], causal=True,
                                                      backend="host"), 1)
            rows.append({"model": name, "seq": n, "backend": "host", "fwd_ms": tf * 1e3, "bwd_ms": tb * 1e3})
        return rows

    import torch  # --time on a GPU: torch CUDA tensors through the nvrtc backend

    try:
        from pykern import bench as pkbench  # noqa: F401  (CUDA-event helpers, when that module exists)
    except ImportError:
        pkbench = None
    dev = torch.device("cuda")
    ev_timer = _timer(torch.cuda.synchronize)
    try:
        from flash_attn import flash_attn_func  # type: ignore
    except ImportError:
        flash_attn_func = None
    import torch.nn.functional as F

    seqs = (1024, 2048) if args.small else SEQS
    for name, (h, kvh, d) in MODELS.items():
        for n in seqs:
            q = torch.randn(1, n, h, d, device=dev, dtype=torch.bfloat16)
            k = torch.randn(1, n, kvh, d, device=dev, dtype=torch.bfloat16)
            v = torch.randn(1, n, kvh, d, device=dev, dtype=torch.bfloat16)
            g = torch.randn_like(q)
            m = model(name, n)
            out, lse = ops.flash_attention(q, k, v, causal=True, return_lse=True)
            iters = max(3, int(2e9 / max(m["fwd"]["flops"], 1)))
            t_f = ev_timer(lambda: ops.flash_attention(q, k, v, causal=True), iters)
            t_b = ev_timer(lambda: ops.attention_backward(q[0], k[0], v[0], g[0], out=out[0], lse=lse[0],
                                                          causal=True), iters)
            qt, kt, vt = (x.transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
            t_sf = ev_timer(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True), iters)
            o_t = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True)
            gt = g.transpose(1, 2)
            t_sb = ev_timer(lambda: torch.autograd.grad(o_t, (qt, kt, vt), gt, retain_graph=True), iters)
            row = {"model": name, "seq": n, "fwd": m["fwd"]["flops"], "bwd": m["bwd"]["flops"]}
            for label, tf, tb in (("pykern", t_f, t_b), ("sdpa", t_sf, t_sb)):
                row[label] = {"fwd_ms": tf * 1e3, "bwd_ms": tb * 1e3, "fwd_tflops": m["fwd"]["flops"] / tf / 1e12,
                              "bwd_tflops": m["bwd"]["flops"] / tb / 1e12}
            if flash_attn_func is not None:
                t_fa = ev_timer(lambda: flash_attn_func(q, k, v, causal=True), iters)
                row["flash_attn"] = {"fwd_ms": t_fa * 1e3, "fwd_tflops": m["fwd"]["flops"] / t_fa / 1e12}
            rows.append(row)
    return rows


# --------------------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--time", action="store_true", help="time on the GPU (nvrtc) beside torch SDPA")
    ap.add_argument("--backend", default=None, help="with --time: 'host' smoke-tests the timing path on the CPU")
    ap.add_argument("--small", action="store_true", help="tiny shapes")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    res = resources()
    models = [model(nm, n) for nm in MODELS for n in SEQS]
    timed = bench(args) if args.time else None
    if args.json:
        print(json.dumps({"resources": res, "model": models, "timed": timed}, indent=2))
        return 0
    print("kernel                                threads  smem(B)  regs sm_80/sm_90  spills  CTAs/SM sm_80/sm_90")
    for r in res:
        print(f"{r['kernel']:<38s}{r['threads']:>7d}{r['smem']:>9d}  {r['sm_80']['regs']:>8d}/{r['sm_90']['regs']:<5d}"
              f"  {r['sm_80']['spill'] + r['sm_90']['spill']:>6d}  {r['sm_80']['ctas_per_sm']:>10d}/{r['sm_90']['ctas_per_sm']}")
    print(f"\nmodelled H100 (causal, batch 1; mma.sync {MMA_SYNC_FRACTION:.2f} x MMA share {MMA_SHARE} x occupancy x tail):")
    print("model        seq    fwd GFLOP  fwd ms  fwd TFLOP/s (%peak)   bwd GFLOP  bwd ms  bwd TFLOP/s (%peak)")
    for m in models:
        f, b = m["fwd"], m["bwd"]
        print(f"{m['model']:<12s}{m['seq']:>6d}{f['flops'] / 1e9:>12.1f}{f['model_ms']:>8.3f}{f['model_tflops']:>10.0f} "
              f"({f['model_pct_peak']:>4.1f}%){b['flops'] / 1e9:>13.1f}{b['model_ms']:>8.3f}{b['model_tflops']:>10.0f} "
              f"({b['model_pct_peak']:>4.1f}%)")
    if timed:
        print("\nmeasured:")
        for t in timed:
            print(json.dumps(t))
    return 0


if __name__ == "__main__":
    sys.exit(main())
