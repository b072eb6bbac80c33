#!/usr/bin/env python
"""Tensor-core FlashAttention (bf16) report, modelled bound and GPU benchmark, forward and backward.

    python tools/bench_attention.py                    # resources per kernel + modelled H100 / A100 bound
    python tools/bench_attention.py --json
    python tools/bench_attention.py --table            # the full model table (python -m pykern.bench --attention-model)
    python tools/bench_attention.py --time             # on a GPU: measured TFLOP/s beside torch SDPA
                                                       # (and flash-attn / FlashInfer when importable), and
                                                       # the FP8 forward (e4m3 q, k, v) beside the bf16 one
    python tools/bench_attention.py --time --backend host --small   # smoke-test the timing path on the CPU

Shapes: LLaMA-3-8B (32 query / 8 kv heads, head_dim 128) and 70B (64 / 8, 128), batch 1, causal,
1K..16K tokens (n_q = n_k).

FLOPs: "useful" FLOPs as FlashAttention reports them: forward 4 * n_visible_pairs * d per head
(QK^T and PV), backward 2.5x that (5 matmuls). The kernels execute more: whole tiles on the causal
diagonal, and the backward recomputes S in the dQ kernel (7 matmuls; 8 for d256).

Model: pykern.bench.attention_model (see its docstring and docs/attention_tc.md, "Performance model"): per
kernel the steady-state loop of its own SASS (instructions, shared-memory bytes and MMAs per iteration),
registers and shared memory (CTAs per SM), the ops' launch geometry (grid, rows and keys per step), and the
published per-SM rates (4 issue slots, 128 B/clk shared memory, the tensor pipe: mma.sync at 2/3 of Hopper's
dense peak, the full rate on A100) and HBM bandwidth; waves and tail by scheduling the CTAs over the SMs.
Every figure is a modelled bound with its binding term. Nothing is calibrated from a measured speed; FA2's
published figures are printed beside it, labelled, for comparison only.
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

MODELS = {"llama3-8b": (32, 8, 128), "llama3-70b": (64, 8, 128)}
SEQS = (1024, 2048, 4096, 8192, 16384)
# FlashAttention-2's published figures, for comparison beside the model (never an input to it):
FA2_PUBLISHED = (
    "FA2's published numbers (comparison only, not a model input): forward d128 on H100 SXM 335-370 TFLOP/s "
    "(the FA2 baseline in the FlashAttention-3 paper); on A100 50-73 % of the 312 TFLOP/s peak "
    "(FlashAttention-2 paper, abstract)."
)


# --------------------------------------------------------------------------- kernels and resources

def kernels_for(d: int) -> dict[str, list[tuple[str, int, int, str]]]:
    """{"fwd"|"bwd": [(kernel, threads, dynamic smem, kernels_cu file)]} as the ops launch them at head_dim d
    (mma.sync kernels)."""
    from pykern.bench import attention_model as am

    return {ph: [(la.kernel, la.threads, la.smem, la.source) for la in am.launches(ph, am.Shape(1, 1, 64, d, False))]
            for ph in ("fwd", "bwd")}


def resources(archs: tuple[str, ...] = ("sm_80", "sm_90")) -> list[dict[str, Any]]:
    from pykern import cache
    from pykern.bench import attention_model as am

    rows = []
    seen = set()
    for d in (64, 96, 128, 256):
        for phase, ks in kernels_for(d).items():
            for name, threads, smem, source in ks:
                if name in seen:
                    continue
                seen.add(name)
                src = ROOT / "kernels_cu" / source
                row: dict[str, Any] = {"kernel": name, "threads": threads, "smem": smem}
                for a in archs:
                    res = cache.get_module(src, a).resources[name]
                    occ = am.occupancy(res.registers, threads, smem + res.shared_bytes, am.hardware(a))
                    row[a] = {"regs": res.registers, "spill": res.spill_stores + res.spill_loads,
                              "ctas_per_sm": occ.ctas}
                rows.append(row)
    return rows


# --------------------------------------------------------------------------- the model

_SASS: Any = None

def model(name: str, n: int, causal: bool = True, batch: int = 1, arch: str = "sm_90",
          sass: Any = None) -> dict[str, Any]:
    """Modelled bound (pykern.bench.attention_model) of one LLaMA shape on the part of `arch`."""
    from pykern.bench import attention_model as am

    global _SASS
    if sass is None:  # one disassembly per (source, arch) for every call of this process
        sass = _SASS = _SASS or am.SassSource()
    h, kvh, d = MODELS[name]
    shape = am.Shape(batch, h, n, d, causal, kvh)
    out: dict[str, Any] = {"model": name, "seq": n, "batch": batch, "causal": causal, "heads": h, "kv_heads": kvh,
                           "head_dim": d, "arch": arch}
    for phase in ("fwd", "bwd"):
        p = am.predict(arch, phase, shape, sass)
        out[phase] = {"flops": am.useful_flops(shape, phase),
                      "executed_flops": sum(k.get("executed_flops", 0.0) for k in p.kernels),
                      "model_ms": p.time_s * 1e3, "model_tflops": p.tflops, "model_pct_peak": p.pct_peak,
                      "binding": p.binding}
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
        from pykern.difftest.cases.attention import fa_inputs

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
            # FP8 forward: e4m3 q, k, v with per-tensor descales (the sm_90a kernel with PYKERN_HOST_ARCH=sm_90a)
            import ml_dtypes

            q8, k8, v8 = (x.astype(np.float32).astype(ml_dtypes.float8_e4m3fn) for x in (q, k, v))
            one = np.ones((1,), np.float32)
            t8 = timer(lambda: ops.flash_attention(q8, k8, v8, causal=True, q_descale=one, k_descale=one,
                                                   v_descale=one, backend="host"), 1)
            rows.append({"model": name, "seq": n, "backend": "host", "fwd_ms": tf * 1e3, "bwd_ms": tb * 1e3,
                         "fp8_fwd_ms": t8 * 1e3})
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
            # FP8 forward (e4m3 q, k, v, per-tensor descales; kernels_cu/attention_fwd_fp8_sm90.cu on Hopper)
            q8, k8, v8 = (x.to(torch.float8_e4m3fn) for x in (q, k, v))
            one = torch.ones(1, device=dev, dtype=torch.float32)
            t_8 = ev_timer(lambda: ops.flash_attention(q8, k8, v8, causal=True, q_descale=one, k_descale=one,
                                                       v_descale=one), iters)
            row["pykern_fp8"] = {"fwd_ms": t_8 * 1e3, "fwd_tflops": m["fwd"]["flops"] / t_8 / 1e12}
            rows.append(row)
    return rows


# --------------------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--time", action="store_true", help="time on the GPU (nvrtc) beside torch SDPA")
    ap.add_argument("--backend", default=None, help="with --time: 'host' smoke-tests the timing path on the CPU")
    ap.add_argument("--small", action="store_true", help="tiny shapes")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--table", action="store_true",
                    help="print the model table of pykern.bench.attention_model (FA2's benchmark shapes) and exit")
    args = ap.parse_args(argv)
    from pykern.bench import attention_model as am

    if args.table:
        doc = am.table_rows()
        print(json.dumps(doc, indent=1) if args.json else am.format_table(doc))
        if not args.json:
            print("\n" + FA2_PUBLISHED)
        return 0
    sass = am.SassSource()
    res = resources()
    models = [model(nm, n, arch=a, sass=sass) for a in ("sm_90", "sm_80") for nm in MODELS for n in SEQS]
    timed = bench(args) if args.time else None
    if args.json:
        print(json.dumps({"resources": res, "model": models, "timed": timed, "fa2_published": FA2_PUBLISHED},
                         indent=2))
        return 0
    print("kernel                                threads  smem(B)  regs sm_80/sm_90  spills  CTAs/SM sm_80/sm_90")
    for r in res:
        print(f"{r['kernel']:<38s}{r['threads']:>7d}{r['smem']:>9d}  {r['sm_80']['regs']:>8d}/{r['sm_90']['regs']:<5d}"
              f"  {r['sm_80']['spill'] + r['sm_90']['spill']:>6d}  {r['sm_80']['ctas_per_sm']:>10d}/{r['sm_90']['ctas_per_sm']}")
    print("\nmodelled bound (pykern.bench.attention_model: our SASS, launch geometry, published rates), causal, batch 1:")
    print("arch   model        seq   fwd GFLOP  fwd ms  fwd TFLOP/s (%peak) binding       bwd GFLOP  bwd ms  "
          "bwd TFLOP/s (%peak) binding")
    for m in models:
        f, b = m["fwd"], m["bwd"]
        print(f"{m['arch']:<7s}{m['model']:<12s}{m['seq']:>6d}{f['flops'] / 1e9:>11.1f}{f['model_ms']:>8.3f}"
              f"{f['model_tflops']:>10.0f} ({f['model_pct_peak']:>4.1f}%) {f['binding']:<13s}"
              f"{b['flops'] / 1e9:>10.1f}{b['model_ms']:>8.3f}{b['model_tflops']:>10.0f} ({b['model_pct_peak']:>4.1f}%) "
              f"{b['binding']}")
    print("\n" + FA2_PUBLISHED)
    if timed:
        print("\nmeasured:")
        for t in timed:
            print(json.dumps(t))
    return 0


if __name__ == "__main__":
    sys.exit(main())
