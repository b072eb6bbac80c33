"""Memory of the fused linear cross-entropy (pykern.ops.fused_linear_cross_entropy) vs the unfused path.

    python tools/bench_flce.py                     # model at N=8192, V=128256, H=4096 + a CPU measurement
    python tools/bench_flce.py --n 1024 --v 16032 --h 512 --json   # (CPU host backend: ~1-2 min)

Computed (from the chunking, no allocation): peak extra bytes beyond the inputs and the
gradient outputs, at N=8192, V=128256, H=4096 (chunk from flce_chunk_rows):
  unfused (torch eager / HF): logits (N, V) + fp32 log-softmax kept for backward
          (N, V, 4 bytes) + grad_logits (N, V)
  fused, torch path: one chunk's logits, overwritten in place by their gradient (C, V),
          for bf16 its fp32 copy (C, V, 4), the chunk's hidden rows in fp32 (C, H, 4) and
          the chunk's bf16 grad_hidden (C, H, 2); per-row losses (N, 4). grad_weight
          accumulates with addmm_ into its float32 output: no (V, H) temporary.
  fused, NumPy path: logits (C, V) + weight blocks of B = flce_block_rows vocab rows:
          a (B, H) fp32 buffer for grad_weight[block] += G[:, block].T @ h (NumPy has no
          accumulating matmul), and for bf16 a (B, H) widened weight block, a (C, B) fp32
          logits/gradient block, (C, H) fp32 hidden and grad_hidden buffers, bias (V, 4).
The gradient outputs are float32 for f32 and bf16 inputs (the accumulators are the
outputs). Against bf16 gradients they are (N*H + V*H)*2 bytes larger; grad_dtype="input"
returns bf16 ones, casting one gradient at a time (max(N*H*4 + V*H*2, V*H*4) transient); the
pykern.torch autograd op keeps the float32 ones from its forward to its backward.
Measured: NumPy on the CPU (host backend) under tracemalloc at a scaled-down size,
peak bytes allocated during the call beyond its inputs and outputs, fused (f32, bf16)
vs unfused f32 (logits = h @ W.T, ops.cross_entropy_fwd_bwd, then the two gradient
matmuls). The host backend stages a copy of each launch's logits (C, V, 4 more bytes),
which a GPU launch does not.
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
    from pykern.ops.norm_act_loss import flce_block_rows

    bf16 = esz != 4
    blk = flce_block_rows(chunk, v, h)
    unfused = n * v * esz + n * v * 4 + n * v * esz
    torch_chunk = chunk * v * esz + (chunk * v * 4 + chunk * h * 4 + chunk * h * 2 if bf16 else 0) + n * 4
    numpy_chunk = chunk * v * esz + blk * h * 4 + n * 4
    if bf16:
        numpy_chunk += blk * h * 4 + chunk * blk * 4 + 2 * chunk * h * 4 + v * 4
    grads32 = (n * h + v * h) * 4
    return {"chunk": chunk, "block_rows": blk, "unfused_extra": unfused, "fused_extra_torch": torch_chunk,
            "fused_extra_numpy": numpy_chunk, "ratio_torch": unfused / torch_chunk,
            "float32_grads": grads32, "float32_grads_over_input_dtype": grads32 - grads32 * esz // 4,
            "grad_dtype_input_transient": max(n * h * 4 + v * h * 2, v * h * 4) if bf16 else 0,
            "old_fp32_accumulators_on_top": grads32 if bf16 else 0}


def measure(n: int, v: int, h: int, chunk: int | None, backend: str, dtype: str, unfused_too: bool) -> dict:
    from pykern import arrays, ops

    rng = np.random.default_rng(0)
    npdt = np.float32 if dtype == "f32" else arrays.bfloat16()
    hid = rng.standard_normal((n, h)).astype(npdt)
    w = (rng.standard_normal((v, h)) / np.sqrt(h)).astype(npdt)
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
        if name == "unfused" and not unfused_too:
            continue
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
    if unfused_too:
        out["max_abs_diff_loss"] = float(abs(np.float64(results["fused"][0]) - np.float64(results["unfused"][0])))
        out["max_abs_diff_grad_weight"] = float(np.abs(results["fused"][2] - results["unfused"][2]).max())
    return out


def main() -> None:
    from pykern.ops.norm_act_loss import flce_chunk_rows

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
    for dt, esz in (("f32", 4), ("bf16", 2)):
        rep["measured"][dt] = dict({"N": a.n, "V": a.v, "H": a.h, "chunk": chunk},
                                   **measure(a.n, a.v, a.h, chunk, a.backend, dt, dt == "f32"))
        rep["measured"][dt]["model"] = model_bytes(a.n, a.v, a.h, esz, chunk)
    if a.json:
        print(json.dumps(rep, indent=1))
        return
    gib = lambda b: f"{b / 2**30:8.3f} GiB"  # noqa: E731
    mib = lambda b: f"{b / 2**20:8.2f} MiB"  # noqa: E731
    print(f"computed, N={big['N']} V={big['V']} H={big['H']}, chunk {c} rows:")
    for dt, m in rep["model"].items():
        print(f"  {dt}: unfused extra {gib(m['unfused_extra'])}  fused extra: torch {gib(m['fused_extra_torch'])}"
              f" ({m['ratio_torch']:.0f}x less), NumPy {gib(m['fused_extra_numpy'])} (block {m['block_rows']} rows)")
        if dt == "bf16":
            over = gib(m['float32_grads_over_input_dtype'])
            print(f"        float32 gradient outputs {gib(m['float32_grads'])} (+{over}"
                  f" over bf16 ones); grad_dtype='input': {gib(m['grad_dtype_input_transient'])} transient at the"
                  f" cast; before this change the fp32 accumulators came on top: "
                  f"+{gib(m['old_fp32_accumulators_on_top'])}")
    for dt, m in rep["measured"].items():
        print(f"measured (NumPy, tracemalloc, {a.backend} backend), N={a.n} V={a.v} H={a.h} {dt}, chunk {chunk}:")
        for k in ("unfused", "fused"):
            if k in m:
                print(f"  {k:8s} peak {mib(m[k]['peak_bytes'])}  outputs {mib(m[k]['outputs_bytes'])}  "
                      f"extra {mib(m[k]['peak_extra_bytes'])}  {m[k]['seconds']} s")
        mm = m["model"]
        print(f"  model at this size: fused NumPy extra {mib(mm['fused_extra_numpy'])} + the host backend's staged "
              f"logits {mib(chunk * a.v * (4 if dt == 'f32' else 2))}; one (V, H) float32 temporary would be "
              f"{mib(a.v * a.h * 4)}")
        if "max_abs_diff_loss" in m:
            print(f"  |loss fused - unfused| {m['max_abs_diff_loss']:.3g}, max |grad_weight diff| "
                  f"{m['max_abs_diff_grad_weight']:.3g}")


if __name__ == "__main__":
    main()
