"""Decode-attention report and benchmark for one decode step (default: a LLaMA-8B-shaped step).

    python tools/bench_decode.py                      # launch plan + ptxas resources per method and arch
    python tools/bench_decode.py --time --dtype bf16  # also time each method on the GPU (nvrtc backend)

The report needs only NVRTC. --time needs a GPU: caches live in numba device
arrays and each method's launches are issued through `pykern.launch` on the
nvrtc backend; the bandwidth column is K+V bytes read per step / time.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pykern.ops.decode import decode_plan  # noqa: E402

SUFFIX = {"f32": "", "bf16": "_bf16"}


def report(args: argparse.Namespace) -> None:
    from pykern import compiler

    archs = args.arch or ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"]
    res = {a: compiler.compile(ROOT / "kernels_cu" / "decode.cu", a).resources for a in archs}
    print(f"step: batch {args.batch}, {args.heads} heads, {args.kv_heads} kv heads, head_dim {args.head_dim}, "
          f"max_seq_len {args.seq_len}, dtype {args.dtype}")
    for method in ("warp", "multi_warp", "split_k"):
        plan = decode_plan(args.batch, args.heads, args.kv_heads, args.head_dim, args.seq_len, method=method)
        extra = {k: v for k, v in plan.items() if k not in ("method", "launches")}
        print(f"\n{method}: {len(plan['launches'])} launch(es) per decode step {extra or ''}")
        for stem, grid, block, smem in plan["launches"]:
            name = stem + (SUFFIX[args.dtype] if "reduce" not in stem or args.dtype == "bf16" else "")
            regs = " ".join(f"{a}:{res[a][name].registers}r/{res[a][name].spill_bytes}sp" for a in archs)
            blocks = math.prod(grid)
            print(f"  {name:34s} grid={grid} ({blocks} blocks) block={block} dyn_smem={smem}B "
                  f"static_smem={res[archs[0]][name].shared_bytes}B\n    {regs}")


def bench(args: argparse.Namespace) -> None:
    from numba import cuda

    import pykern
    from pykern import bench
    from pykern.arrays import bfloat16

    drv = bench.open_device()
    peaks = bench.gpu_peaks(drv)
    m, h, kvh, d, s = args.batch, args.heads, args.kv_heads, args.head_dim, args.seq_len
    dt = np.float32 if args.dtype == "f32" else bfloat16()
    rng = np.random.default_rng(0)
    host = {n: rng.standard_normal(shape).astype(np.float32).astype(dt).view(np.uint16 if args.dtype == "bf16"
                                                                             else np.float32)
            for n, shape in (("q", (m, h, d)), ("k", (m, kvh, s, d)), ("v", (m, kvh, s, d)))}
    dev = {n: cuda.to_device(a.reshape(-1)) for n, a in host.items()}
    seq = cuda.to_device(np.full(m, s, np.uint32))
    out = cuda.device_array(m * h * d, host["q"].dtype)
    kv_bytes = 2 * m * kvh * s * d * host["k"].itemsize
    geom = (h, kvh, d, s, 1.0 / math.sqrt(d))
    for method in ("warp", "multi_warp", "split_k"):
        plan = decode_plan(m, h, kvh, d, s, method=method)
        calls = []
        if method == "split_k":
            mc = plan["max_chunks"]
            po = cuda.device_array(m * h * mc * d, np.float32)
            pml = cuda.device_array(m * h * mc * 2, np.float32)
            (s1, g1, b1, _), (s2, g2, b2, _) = plan["launches"]
            red = s2 + ("_bf16" if args.dtype == "bf16" else "")
            calls.append((s1 + SUFFIX[args.dtype], g1, b1, 0,
                          (dev["q"], dev["k"], dev["v"], po, pml, seq, *geom, plan["chunk_size"], mc)))
            calls.append((red, g2, b2, 0, (po, pml, out, seq, h, d, s, plan["chunk_size"], mc)))
        else:
            stem, grid, block, smem = plan["launches"][0]
            calls.append((stem + SUFFIX[args.dtype], grid, block, smem, (dev["q"], dev["k"], dev["v"], out, seq, *geom)))

        def step() -> None:
            for name, grid, block, smem, a in calls:
                pykern.launch(name, grid, block, *a, shared_mem=smem, backend="nvrtc")

        # CUDA-event median per step after warm-up (pykern.bench), on the stream the launches use (0).
        us = bench.time_gpu(step, warmup=3, repeats=args.iters, driver=drv).median_ms * 1e3
        print(f"{method:10s} {us:9.2f} us/step  {kv_bytes / us / 1e3:8.1f} GB/s (K+V bytes / time)  "
              f"{bench.pct_text(kv_bytes / us * 1e6, peaks.bandwidth)}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--dtype", choices=("f32", "bf16"), default="bf16")
    p.add_argument("--arch", action="append", help="arch for the resource report (repeatable)")
    p.add_argument("--time", action="store_true", help="time each method on the GPU")
    p.add_argument("--iters", type=int, default=200)
    args = p.parse_args()
    report(args)
    if args.time:
        print()
        bench(args)


if __name__ == "__main__":
    main()
