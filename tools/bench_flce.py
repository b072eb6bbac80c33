"""Memory of the fused linear cross-entropy (pykern.ops.fused_linear_cross_entropy) vs the unfused path.

    python tools/bench_flce.py                     # model at N=8192, V=128256, H=4096 + a CPU measurement
    python tools/bench_flce.py --n 1024 --v 16032 --h 512 --json   # (CPU host backend: ~1-2 min)

Computed (from the chunking, no allocation): peak extra bytes, beyond the inputs and
the gradient outputs every path returns (grad_hidden (N, H), grad_weight (V, H)):
  unfused (torch eager / HF): logits (N, V) + fp32 log-softmax kept for backward
          (N, V, 4 bytes) + grad_logits (N, V)
  fused:  one chunk's logits, overwritten in place by their gradient (C, V), its
          fp32 copy for the fp32 accumulation when the dtype is bf16 (C, V, 4),
          the chunk's hidden rows in fp32 (C, H, 4), per-row losses (N, 4), and, for
          bf16, the fp32 gradient accumulators (N, H, 4) + (V, H, 4) (cast to bf16 at the
          end; for f32 they are the outputs themselves)
Measured: NumPy on the CPU (host backend) under tracemalloc at a scaled-down size,
peak bytes allocated during the call beyond its inputs, fused vs unfused
(logits = h @ W.T, ops.cross_entropy_fwd_bwd, then the two gradient matmuls). NumPy
has no accumulate-in-place matmul, so the fused NumPy path also holds one (V, H)
temporary per chunk for grad_weight += G.T @ h (torch uses addmm_ in place); the
computed model above is the torch one.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def model_bytes(n: int, v: int, h: int, esz: int, chunk: int) -> dict:
    unfused = n * v * esz + n * v * 4 + n * v * esz
    upcast = chunk * v * 4 if esz != 4 else 0
    fused_chunk = chunk * v * esz + upcast + chunk * h * 4 + n * 4
    acc = (n * h + v * h) * 4 if esz != 4 else 0  # f32: the accumulators are the outputs themselves
    return {"chunk": chunk, "unfused_extra": unfused, "fused_extra_chunk": fused_chunk,
            "fused_extra_with_fp32_accumulators": fused_chunk + acc, "ratio_chunk": unfused / fused_chunk,
            "ratio_with_accumulators": unfused / (fused_chunk + acc)}


def measure(n: int, v: int, h: int, chunk: int | None, backend: str) -> dict:
    from pykern import ops

    rng = np.random.default_rng(0)
    hid = rng.standard_normal((n, h)).astype(np.float32)
    w = (rng.standard_normal((v, h)) / np.sqrt(h)).astype(np.float32)
    t = rng.integers(0, v, n)
    t[::5] = -100

    def unfused():
        logits = hid @ w.T
        loss, g = ops.cross_entropy_fwd_bwd(logits, t, backend=backend)
        return loss, g @ w, g.T @ hid

    def fused():
        loss, gh, gw, _ = ops.fused_linear_cross_entropy(hid, w, t, chunk_size=chunk, backend=backend)
        return loss, gh, gw

    out = {}
    results = {}
    for name, fn in (("unfused", unfused), ("fused", fused)):
        fn()  # warm-up: kernel builds and caches are not the op's memory
        tracemalloc.start()
        t0 = time.perf_counter()
        res = fn()
        dt = time.perf_counter() - t0
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        outputs = sum(np.asarray(a).nbytes for a in res)
        out[name] = {"peak_bytes": peak, "outputs_bytes": outputs, "peak_extra_bytes": peak - outputs,
                     "seconds": round(dt, 3)}
        results[name] = res
    out["max_abs_diff_loss"] = float(abs(np.float64(results["fused"][0]) - np.float64(results["unfused"][0])))
    out["max_abs_diff_grad_weight"] = float(np.abs(results["fused"][2] - results["unfused"][2]).max())
    return out


def main() -> None:
    from pykern.ops.training_ext import flce_chunk_rows

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=512, help="rows of the CPU measurement")
    ap.add_argument("--v", type=int, default=8016, help="vocab of the CPU measurement (V/H as LLaMA-3's)")
    ap.add_argument("--h", type=int, default=256, help="hidden size of the CPU measurement")
    ap.add_argument("--chunk", type=int, default=None)
    ap.add_argument("--backend", default="host")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    big = {"N": 8192, "V": 128256, "H": 4096}
    rep = {"model": {}, "measured": {}}
    c = flce_chunk_rows(big["N"], big["V"], big["H"])
    for dt, esz in (("bf16", 2), ("f32", 4)):
        rep["model"][dt] = dict(big, **model_bytes(big["N"], big["V"], big["H"], esz, c))
    chunk = a.chunk or flce_chunk_rows(a.n, a.v, a.h)
    rep["measured"] = dict({"N": a.n, "V": a.v, "H": a.h, "chunk": chunk, "dtype": "f32"},
                           **measure(a.n, a.v, a.h, chunk, a.backend))
    rep["measured"]["model_f32"] = model_bytes(a.n, a.v, a.h, 4, chunk)
    if a.json:
        print(json.dumps(rep, indent=1))
        return
    gib = lambda b: f"{b / 2**30:8.3f} GiB"  # noqa: E731
    mib = lambda b: f"{b / 2**20:8.2f} MiB"  # noqa: E731
    print(f"computed, N={big['N']} V={big['V']} H={big['H']}, chunk {c} rows:")
    for dt, m in rep["model"].items():
        print(f"  {dt}: unfused extra {gib(m['unfused_extra'])}  fused extra (chunk) {gib(m['fused_extra_chunk'])}"
              f"  (+ fp32 accumulators {gib(m['fused_extra_with_fp32_accumulators'])})  ratio {m['ratio_chunk']:.0f}x"
              f" ({m['ratio_with_accumulators']:.1f}x with accumulators)")
    m = rep["measured"]
    print(f"measured (NumPy, tracemalloc, {a.backend} backend), N={a.n} V={a.v} H={a.h} f32, chunk {chunk}:")
    for k in ("unfused", "fused"):
        print(f"  {k:8s} peak {mib(m[k]['peak_bytes'])}  outputs {mib(m[k]['outputs_bytes'])}  "
              f"extra {mib(m[k]['peak_extra_bytes'])}  {m[k]['seconds']} s")
    mm = m["model_f32"]
    print(f"  model at this size: unfused extra {mib(mm['unfused_extra'] - a.n * a.v * 4)} (no fp32 log-softmax copy in "
          f"this NumPy path), fused extra {mib(mm['fused_extra_with_fp32_accumulators'])} + one (V, H) temporary "
          f"{mib(a.v * a.h * 4)}")
    print(f"  |loss fused - unfused| {m['max_abs_diff_loss']:.3g}, max |grad_weight diff| "
          f"{m['max_abs_diff_grad_weight']:.3g}")


if __name__ == "__main__":
    main()
