"""Training-kernel report and benchmark (kernels_cu/training.cu, kernels_cu/attention_bwd_fma.cu).

    python tools/bench_training.py                       # ptxas registers / smem / spills, sm_80 and sm_90
    python tools/bench_training.py --arch sm_75 --arch sm_120
    python tools/bench_training.py --time                # time every op on the GPU (nvrtc backend)
    python tools/bench_training.py --time --backend host --small   # smoke-test the timing path on the CPU

The report needs only NVRTC. --time issues the same launches as pykern.ops
(same geometry helpers) through `pykern.launch`, on numba device arrays for
nvrtc (NumPy for host). Bandwidth = bytes the op must move / time; attention
reports TFLOP/s of the 5 causal matmuls of a backward pass.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SOURCES = ("training.cu", "attention_bwd_fma.cu", "norm_act_loss.cu")


def report(archs: list[str]) -> None:
    from pykern import compiler
    from pykern.ops.attention import group_lanes

    print("kernel                                   " + "  ".join(f"{a:>26s}" for a in archs))
    print("                                         " + "  ".join(f"{'regs  static_smem  spill':>26s}" for _ in archs))
    for src in SOURCES:
        res = {a: compiler.compile(ROOT / "kernels_cu" / src, a).resources for a in archs}
        for name in sorted(res[archs[0]]):
            cells = []
            for a in archs:
                r = res[a][name]
                cells.append(f"{r.registers:4d}  {r.shared_bytes:9d}B  {r.spill_stores + r.spill_loads:5d}B")
            print(f"{name:40s} " + "  ".join(f"{c:>26s}" for c in cells))
    print("\ndynamic shared memory per launch (attention, fp32 staging):")
    for d in (32, 64, 80, 128, 256):
        g = group_lanes(d)
        print(f"  head_dim {d:3d}: flash dkdv {(2 * 16 * d + 32) * 4:6d}B, flash dq / lse pre-pass {2 * 16 * d * 4:6d}B, "
              f"{256 // g} rows per 256-thread block (G={g}); naive (2*head_dim + 2*seq)*4 B, seq <= 4096")


class Env:
    """Allocation and synchronisation for the chosen backend."""

    def __init__(self, backend: str) -> None:
        self.backend = backend
        if backend == "nvrtc":
            from numba import cuda

            self.cuda = cuda

    def put(self, a: np.ndarray) -> Any:
        a = np.ascontiguousarray(a).reshape(-1)
        if self.backend == "nvrtc":
            return self.cuda.to_device(a.view(np.uint16) if a.dtype.name == "bfloat16" else a)
        return a

    def empty(self, n: int, dtype: Any) -> Any:
        dt = np.dtype(dtype)
        if self.backend == "nvrtc":
            return self.cuda.device_array(n, np.uint16 if dt.name == "bfloat16" else dt)
        return np.empty(n, dt)

    def sync(self) -> None:
        if self.backend == "nvrtc":
            self.cuda.synchronize()

    def time(self, step: Callable[[], None], iters: int) -> float:
        from pykern import bench

        if not hasattr(self, "drv"):
            self.drv = bench.open_device()
            self.peaks = bench.gpu_peaks(self.drv)
        return bench.time_gpu(step, warmup=2, repeats=iters, driver=self.drv).seconds

    def pct(self, value: float, kind: str) -> str:
        """% of the device's peak (bandwidth for "bw", bf16 tensor FLOP/s for "flops"), GPU only."""
        if self.backend != "nvrtc":
            return ""
        from pykern.bench import pct_text

        return pct_text(value, self.peaks.bandwidth if kind == "bw" else self.peaks.bf16_tensor)


def _timed(env: Env, step: Callable[[], None], iters: int) -> float:
    """Seconds per step: on the GPU the CUDA-event median after warm-up (pykern.bench); on the host
    backend wall time (there are no events on the CPU)."""
    if env.backend == "nvrtc":
        return env.time(step, iters)
    step()
    env.sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        step()
    env.sync()
    return (time.perf_counter() - t0) / iters


def bench(args: argparse.Namespace) -> None:
    import pykern
    from pykern.arrays import bfloat16
    from pykern.ops._common import row_threads as _row_threads, weight_chunks as _weight_chunks
    from pykern.ops.attention import group_lanes

    env = Env(args.backend)
    kind = args.dtype
    dt = bfloat16() if kind == "bf16" else np.dtype(np.float32)
    sfx = "_bf16" if kind == "bf16" else ""
    esz = dt.itemsize
    rng = np.random.default_rng(0)
    small = args.small
    iters = 2 if small else args.iters

    def launch(name: str, grid: Any, block: Any, *a: Any, smem: int = 0) -> None:
        pykern.launch(name, grid, block, *a, shared_mem=smem, backend=args.backend)

    def rnd(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32).astype(dt)

    def line(op: str, shape: str, sec: float, nbytes: float) -> None:
        print(f"{op:24s} {shape:34s} {sec * 1e6:10.1f} us  {nbytes / sec / 1e9:8.1f} GB/s  "
              f"{env.pct(nbytes / sec, 'bw')}")

    # transpose
    r, c = (100, 70) if small else (8192, 8192)
    x, out = env.put(rnd(r, c)), env.empty(r * c, dt)
    t = _timed(env, lambda: launch("transpose_2d" + sfx, (-(-c // 32), min(-(-r // 32), 65535), 1), (32, 8),
                                   x, out, r, c, 1), iters)
    line("transpose_2d", f"{r}x{c} {kind}", t, 2 * r * c * esz)

    # softmax backward
    rows, n = (6, 1000) if small else (8192, 4096)
    p, g, o = env.put(rnd(rows, n)), env.put(rnd(rows, n)), env.empty(rows * n, dt)
    t = _timed(env, lambda: launch("softmax_backward" + sfx, (rows,), (_row_threads(n),), p, g, o, rows, n), iters)
    line("softmax_backward", f"{rows}x{n} {kind}", t, 3 * rows * n * esz)

    # rms_norm backward (+ grad_weight reduction)
    rows, d = (83, 769) if small else (16384, 4096)
    xx, w, gg = env.put(rnd(rows, d)), env.put(rnd(d)), env.put(rnd(rows, d))
    gx, inv, gw = env.empty(rows * d, dt), env.empty(rows, np.float32), env.empty(d, np.float32)
    nch, rpc = _weight_chunks(rows, d)
    part = env.empty(nch * d, np.float32)

    def rms() -> None:
        launch("rms_norm_backward" + sfx, (rows,), (_row_threads(d),), xx, w, gg, gx, inv, gw, rows, d, 1e-6, 0, 0.0)
        launch("rms_norm_backward_weight" + sfx, (-(-d // 32), nch), (32, 8), xx, gg, inv,
               part if nch > 1 else gw, rows, d, rpc)
        if nch > 1:
            launch("norm_grad_reduce", (-(-d // 32),), (8, 32), part, gw, nch, d)

    line("rms_norm_backward", f"{rows}x{d} {kind} ({nch} chunks)", _timed(env, rms, iters), 6 * rows * d * esz)

    # embedding backward: device bucketing of the ids (stable counting sort) + the gather
    ntok, d, vocab = (40, 64, 100) if small else (8192, 4096, 32000)
    ids_d = env.put(rng.integers(0, vocab, size=ntok).astype(np.int64))
    order, offs_d = env.empty(ntok, np.int32), env.empty(vocab + 1, np.int32)
    go, gwt = env.put(rnd(ntok, d)), env.empty(vocab * d, np.float32)

    def emb() -> None:
        launch("embedding_backward_bucket", (-(-vocab // 2048),), (256,), ids_d, order, offs_d, ntok, vocab)
        launch("embedding_backward" + sfx, (vocab,), (_row_threads(d),), go, order, offs_d, gwt, vocab, d)

    t = _timed(env, emb, iters)
    line("embedding_backward", f"{ntok} tok x {d}, vocab {vocab} {kind}", t, ntok * d * esz + vocab * d * 4)

    # cross-entropy: count of live rows on the device, fused fwd+bwd (2 reads of the logits), mean
    rows, vocab = (4, 32000) if small else (4096, 128256)
    lg, gr = env.put(rnd(rows, vocab)), env.empty(rows * vocab, dt)
    tg = rng.integers(0, vocab, size=rows).astype(np.int64)
    tg[::7] = -100
    tg_d, rl, loss = env.put(tg), env.empty(rows, np.float32), env.empty(1, np.float32)
    inv_count = env.empty(2, np.float32)  # (1 / weight sum, 1 / count)

    def ce() -> None:
        launch("cross_entropy_count", (1,), (512,), tg_d, inv_count, inv_count, rows, vocab, -100, 1, 0)
        launch("cross_entropy_fwd_bwd" + sfx, (rows,), (_row_threads(vocab),), lg, tg_d, gr, rl, rl, inv_count,
               inv_count, rl, rows, vocab, -100, 0.0, 0.0, 0.0, 0)
        launch("cross_entropy_loss_reduce", (1,), (512,), rl, loss, inv_count, rows, rows, 0)

    line("cross_entropy_fwd_bwd", f"{rows}x{vocab} {kind}", _timed(env, ce, iters), 3 * rows * vocab * esz)

    # attention backward, flash (pre-pass computing lse and delta included)
    b, s, h, kvh, hd = (1, 130, 4, 2, 64) if small else (1, 2048, 32, 8, 128)
    q, gq = env.put(rnd(b, s, h, hd)), env.put(rnd(b, s, h, hd))
    k, v = env.put(rnd(b, s, kvh, hd)), env.put(rnd(b, s, kvh, hd))
    lse, delta = env.empty(b * s * h, np.float32), env.empty(b * s * h, np.float32)
    dq, dk, dv = env.empty(b * s * h * hd, dt), env.empty(b * s * kvh * hd, dt), env.empty(b * s * kvh * hd, dt)
    G = group_lanes(hd)
    rows_blk = 256 // G
    scale = float(np.float32(1 / math.sqrt(hd)))

    def attn() -> None:
        launch("attention_bwd_lse" + sfx, (-(-s // rows_blk), h, b), (256,), q, k, v, gq, lse, delta,
               s, s, h, kvh, hd, scale, s, 0, 0.0, G, smem=2 * 16 * hd * 4)
        launch("attention_bwd_fma_dkdv" + sfx, (-(-s // rows_blk), kvh, b), (256,), q, k, v, gq, lse, delta,
               dk, dv, s, s, h, kvh, hd, scale, s, 0, 0.0, G, smem=(2 * 16 * hd + 32) * 4)
        launch("attention_bwd_fma_dq" + sfx, (-(-s // rows_blk), h, b), (256,), q, k, v, gq, lse, delta,
               dq, s, s, h, kvh, hd, scale, s, 0, 0.0, G, smem=2 * 16 * hd * 4)

    t = _timed(env, attn, max(1, iters // 20))
    flops = 5 * 2 * b * h * hd * s * (s + 1) / 2
    print(f"{'attention_backward':24s} {f'flash b{b} s{s} h{h}/{kvh} d{hd} {kind}':34s} {t * 1e6:10.1f} us  "
          f"{flops / t / 1e12:8.2f} TFLOP/s  {env.pct(flops / t, 'flops') if kind == 'bf16' else ''}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", action="append", help="arch for the resource report (repeatable; default sm_80, sm_90)")
    p.add_argument("--time", action="store_true", help="time every op")
    p.add_argument("--backend", choices=("nvrtc", "host"), default="nvrtc")
    p.add_argument("--dtype", choices=("f32", "bf16"), default="bf16")
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--small", action="store_true", help="tiny shapes (to smoke-test --time on the host backend)")
    p.add_argument("--no-report", action="store_true")
    p.add_argument("--json", action="store_true", help="print the bytes model (tools/bytes_model.py) as JSON and exit")
    args = p.parse_args()
    import bytes_model  # tools/: min / issued / HBM bytes per op at LLaMA-sized shapes, modelled H100 time

    if args.json:
        print(bytes_model.json.dumps([r.to_dict() for d in ("bf16", "f32")
                                      for r in bytes_model.rows("training", 2 if d == "bf16" else 4)], indent=2))
        return
    if not args.no_report:
        report(args.arch or ["sm_80", "sm_90"])
        print()
        print(bytes_model.table(bytes_model.rows("training", 2 if args.dtype == "bf16" else 4)))
    if args.time:
        print()
        bench(args)


if __name__ == "__main__":
    main()
