"""Benchmark: one launch of a shared-memory + warp-shuffle block reduction on the host backend,
side by side with the same computation on the numba CUDA simulator.

    python tools/bench_host.py [--blocks 64] [--threads 256] [--per-thread 4] [--repeat 20] [--json]

The launch shape is the same on both (blocks x threads). The numba simulator has no warp
shuffles, so its kernel does the warp stage as a shared-memory tree (same sums, same
barrier count order of magnitude). The budget it checks: host <= 20 ms per launch,
simulator >= 100x slower; PYKERN_HOST_RACECHECK=1 at most 10x the default mode.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

# The simulator must be chosen before numba.cuda is imported anywhere.
os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

# Set by bench_numba_sim: the simulator swaps a kernel's *global* `cuda` for its fake module.
cuda = None
float32 = None

KERNEL = r"""
extern "C" __global__ void pk_bench_block_reduce(const float* __restrict__ x, float* __restrict__ out,
                                                 long long per_block) {
    __shared__ float scratch[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int n_warps = (blockDim.x + 31) >> 5;
    const float* row = x + (long long)blockIdx.x * per_block;
    float s = 0.0f;
    for (long long i = threadIdx.x; i < per_block; i += blockDim.x) s += row[i];
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) s += __shfl_down_sync(0xffffffffu, s, off);
    if (lane == 0) scratch[warp] = s;
    __syncthreads();
    if (warp == 0) {
        s = lane < n_warps ? scratch[lane] : 0.0f;
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) s += __shfl_down_sync(0xffffffffu, s, off);
        if (lane == 0) out[blockIdx.x] = s;
    }
}
"""


def bench_host(x: np.ndarray, blocks: int, threads: int, repeat: int) -> tuple[list[float], np.ndarray]:
    import pykern
    from pykern import registry

    tmp = tempfile.mkdtemp(prefix="pykern-bench-")
    (Path(tmp) / "bench_reduce.cu").write_text(KERNEL)
    os.environ["PYKERN_KERNEL_PATH"] = tmp
    registry.refresh()
    out = np.zeros(blocks, np.float32)
    per_block = x.size // blocks
    pykern.launch("pk_bench_block_reduce", blocks, threads, x, out, per_block, backend="host")  # build + warm up
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        pykern.launch("pk_bench_block_reduce", blocks, threads, x, out, per_block, backend="host")
        times.append(time.perf_counter() - t0)
    return times, out


def bench_numba_sim(x: np.ndarray, blocks: int, threads: int) -> tuple[float, np.ndarray]:
    import numba
    import numba.cuda

    globals()["cuda"], globals()["float32"] = numba.cuda, numba.float32
    per_block = x.size // blocks

    @numba.cuda.jit
    def block_reduce(x, out, per_block):
        sh = cuda.shared.array(1024, float32)
        t = cuda.threadIdx.x
        s = float32(0.0)
        i = t
        while i < per_block:
            s += x[cuda.blockIdx.x * per_block + i]
            i += cuda.blockDim.x
        sh[t] = s
        cuda.syncthreads()
        stride = cuda.blockDim.x // 2
        while stride > 0:
            if t < stride:
                sh[t] += sh[t + stride]
            cuda.syncthreads()
            stride //= 2
        if t == 0:
            out[cuda.blockIdx.x] = sh[0]

    out = np.zeros(blocks, np.float32)
    t0 = time.perf_counter()
    block_reduce[blocks, threads](x, out, per_block)
    return time.perf_counter() - t0, out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--threads", type=int, default=256)
    ap.add_argument("--per-thread", type=int, default=4, help="elements each thread sums")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--skip-numba", action="store_true")
    ap.add_argument("--skip-racecheck", action="store_true", help="do not measure PYKERN_HOST_RACECHECK=1")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)

    rng = np.random.default_rng(0)
    x = rng.standard_normal(a.blocks * a.threads * a.per_thread).astype(np.float32)
    expect = x.reshape(a.blocks, -1).astype(np.float64).sum(1)

    host_times, host_out = bench_host(x, a.blocks, a.threads, a.repeat)
    host_ms = statistics.median(host_times) * 1e3
    res = {
        "launch": f"{a.blocks} blocks x {a.threads} threads, {a.per_thread} elements/thread",
        "schedule": os.environ.get("PYKERN_HOST_SCHEDULE", "forward"),
        "host_ms_median": round(host_ms, 3),
        "host_ms_min": round(min(host_times) * 1e3, 3),
        "host_max_abs_err": float(np.abs(host_out - expect).max()),
        "host_budget_ms": 20.0,
        "host_ok": host_ms <= 20.0,
    }
    if not a.skip_racecheck:
        # The checked build (every shared/global access goes through the race detector).
        os.environ["PYKERN_HOST_RACECHECK"] = "1"
        try:
            rc_times, rc_out = bench_host(x, a.blocks, a.threads, a.repeat)
        finally:
            del os.environ["PYKERN_HOST_RACECHECK"]
        rc_ms = statistics.median(rc_times) * 1e3
        res.update(
            racecheck_ms_median=round(rc_ms, 3),
            racecheck_max_abs_err=float(np.abs(rc_out - expect).max()),
            racecheck_overhead=round(rc_ms / host_ms, 2),
            racecheck_budget=10.0,
            racecheck_ok=rc_ms / host_ms <= 10.0,
        )
    if not a.skip_numba:
        sim_s, sim_out = bench_numba_sim(x, a.blocks, a.threads)
        res.update(
            numba_sim_ms=round(sim_s * 1e3, 1),
            numba_max_abs_err=float(np.abs(sim_out - expect).max()),
            speedup=round(sim_s * 1e3 / host_ms, 1),
            speedup_ok=sim_s * 1e3 / host_ms >= 100.0,
        )
    if a.json:
        print(json.dumps(res, indent=2))
    else:
        for k, v in res.items():
            print(f"{k:>18}: {v}")
    ok = res["host_ok"] and res.get("speedup_ok", True) and res.get("racecheck_ok", True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
