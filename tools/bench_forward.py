"""Forward / prefill kernels: ptxas resources and theoretical occupancy per arch, and GPU timings.

    python tools/bench_forward.py                     # registers, spills, smem, occupancy (needs only NVRTC)
    python tools/bench_forward.py --arch sm_80 --arch sm_90
    python tools/bench_forward.py --time --dtype f32  # also time every op on the GPU (nvrtc backend, torch inputs)

Occupancy is the theoretical one at the block size the op launches with
(ops/forward.py): registers are allocated per warp in units of 256, shared
memory per block plus the 1 KB the driver reserves on sm_80+. --time reports
effective bandwidth (bytes the op must move / time) for the memory-bound ops
and GFLOP/s (4 * b * h * n_q * n_k * d, halved when causal) for flash_attention,
each with % of the device's peak; times are CUDA-event medians (pykern.bench).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# arch -> (max warps/SM, max blocks/SM, registers/SM, shared bytes/SM usable by blocks, reserved smem per block)
ARCH = {
    "sm_75": (32, 16, 65536, 64 * 1024, 0),
    "sm_80": (64, 32, 65536, 164 * 1024, 1024),
    "sm_86": (48, 16, 65536, 100 * 1024, 1024),
    "sm_89": (48, 24, 65536, 100 * 1024, 1024),
    "sm_90": (64, 32, 65536, 228 * 1024, 1024),
    "sm_100": (64, 32, 65536, 228 * 1024, 1024),
    "sm_120": (48, 32, 65536, 100 * 1024, 1024),
}

# kernel -> the block sizes the op uses (threads); row kernels have a warp-per-row and a block-per-row shape
BLOCKS = {
    "embedding": (256,), "embedding_bf16": (256,), "rope": (256,), "rope_bf16": (256,),
    "silu_gate": (256,), "silu_gate_bf16": (256,), "silu_gate_backward": (256,), "silu_gate_backward_bf16": (256,),
    "rms_norm": (256, 1024), "rms_norm_bf16": (256, 1024), "causal_attn_softmax": (256, 1024),
}
FA_THREADS = 256


def occupancy(arch: str, threads: int, regs: int, smem: int) -> tuple[float, int]:
    max_warps, max_blocks, regs_sm, smem_sm, reserved = ARCH[arch]
    warps = -(-threads // 32)
    regs_per_warp = -(-regs * 32 // 256) * 256
    by_regs = (regs_sm // regs_per_warp) // warps if regs_per_warp else max_blocks
    by_smem = smem_sm // (smem + reserved) if smem + reserved else max_blocks
    by_warps = max_warps // warps
    blocks = min(by_regs, by_smem, by_warps, max_blocks)
    return blocks * warps / max_warps, blocks


def report(archs: list[str]) -> int:
    from pykern import compiler

    bad = 0
    print(f"{'arch':7s} {'kernel':28s} {'regs':>4s} {'spill':>5s} {'smem':>6s} {'block':>5s} {'blocks/SM':>9s} {'occupancy':>9s}")
    for arch in archs:
        for src in ("forward.cu", "attention_fwd_fma.cu"):
            res = compiler.compile(ROOT / "kernels_cu" / src, arch).resources
            for name in sorted(res):
                r = res[name]
                bad += r.spill_bytes > 0
                for threads in BLOCKS.get(name, (FA_THREADS,)):
                    occ, blocks = occupancy(arch, threads, r.registers, r.shared_bytes)
                    print(f"{arch:7s} {name:28s} {r.registers:4d} {r.spill_bytes:5d} {r.shared_bytes:6d} {threads:5d} "
                          f"{blocks:9d} {occ:9.1%}")
    print(f"\nkernels with spills: {bad}")
    return bad


_GPU: list = []  # (driver, peaks) once opened


def _gpu():
    from pykern import bench

    if not _GPU:
        drv = bench.open_device()
        _GPU.append((drv, bench.gpu_peaks(drv)))
    return _GPU[0]


def _time(fn, reps: int) -> float:
    """Median seconds per call: CUDA events around each call after 2 warm-up calls (pykern.bench)."""
    from pykern import bench

    return bench.time_gpu(fn, warmup=2, repeats=reps, driver=_gpu()[0]).seconds


def timings(kind: str, reps: int) -> None:
    """Needs torch with CUDA: ops allocate outputs next to their inputs, which pykern.arrays does for torch/CuPy."""
    import torch

    from pykern import ops
    from pykern.difftest.cases.forward import rope_tables

    dt = torch.float32 if kind == "f32" else torch.bfloat16
    es = 4 if kind == "f32" else 2
    torch.manual_seed(0)

    def dev(shape, scale=1.0):
        return (torch.randn(shape, device="cuda") * scale).to(dt)

    rows = []
    n_tok, dim = 8192, 4096
    x, w = dev((n_tok, dim)), dev((dim,))
    t = _time(lambda: ops.rms_norm(x, w, backend="nvrtc"), reps)
    rows.append(("rms_norm", f"{n_tok}x{dim}", 2 * n_tok * dim * es / t / 1e9, "GB/s", t))
    g, u = dev((n_tok, 14336)), dev((n_tok, 14336))
    t = _time(lambda: ops.silu_gate(g, u, backend="nvrtc"), reps)
    rows.append(("silu_gate", f"{n_tok}x14336", 3 * g.numel() * es / t / 1e9, "GB/s", t))
    dy = dev((n_tok, 14336))
    t = _time(lambda: ops.silu_gate_backward(g, u, dy, backend="nvrtc"), reps)
    rows.append(("silu_gate_backward", f"{n_tok}x14336", 5 * g.numel() * es / t / 1e9, "GB/s", t))
    table = dev((128256, dim))
    ids = torch.randint(0, 128256, (n_tok,), device="cuda", dtype=torch.int64)
    t = _time(lambda: ops.embedding(ids, table, backend="nvrtc"), reps)
    rows.append(("embedding", f"{n_tok}x{dim}", 2 * n_tok * dim * es / t / 1e9, "GB/s", t))
    cos, sin = (torch.from_numpy(a).cuda() for a in rope_tables(n_tok, 128))
    xq = dev((n_tok, 32, 128))
    for style in ("interleaved", "half"):
        t = _time(lambda: ops.rope(xq, cos, sin, style=style, inplace=True, backend="nvrtc"), reps)
        rows.append((f"rope[{style}]", f"{n_tok}x32x128", 2 * xq.numel() * es / t / 1e9, "GB/s", t))
    # the backward as a LLaMA step runs it: HF (max_pos, head_dim) tables, per-token position_ids, inverse
    hc, hs = (torch.cat([a, a], -1).contiguous() for a in (cos, sin))
    pid = torch.arange(n_tok, device="cuda")
    t = _time(lambda: ops.rope(xq, hc, hs, position_ids=pid, style="half", inverse=True, inplace=True,
                               backend="nvrtc"), reps)
    rows.append(("rope[half,hf,pid,inv]", f"{n_tok}x32x128", 2 * xq.numel() * es / t / 1e9, "GB/s", t))
    if kind == "f32":
        sc = dev((2048, 32, 2048))
        t = _time(lambda: ops.causal_attn_softmax(sc, 0, backend="nvrtc"), reps)
        rows.append(("causal_attn_softmax", "2048x32x2048", 2 * sc.numel() * 4 / t / 1e9, "GB/s", t))
    for b, n, h, kvh, d, causal in ((1, 4096, 32, 8, 128, True), (4, 1024, 32, 32, 64, False),
                                    (1, 2048, 16, 16, 256, True)):
        q, k, v = dev((b, n, h, d)), dev((b, n, kvh, d)), dev((b, n, kvh, d))
        t = _time(lambda: ops.flash_attention(q, k, v, causal=causal, backend="nvrtc"), max(1, reps // 5))
        flops = 4 * b * h * n * n * d * (0.5 if causal else 1.0)
        rows.append(("flash_attention", f"b{b} n{n} h{h}/{kvh} d{d}{' causal' if causal else ''}", flops / t / 1e9,
                     "GFLOP/s", t))
    from pykern.bench import pct_text

    peaks = _gpu()[1]
    for name, shape, rate, unit, t in rows:
        peak = peaks.bandwidth if unit == "GB/s" else (peaks.bf16_tensor if kind == "bf16" else peaks.fp32)
        print(f"{name:22s} {shape:28s} {rate:10.1f} {unit:8s} {t * 1e6:10.1f} us  {pct_text(rate * 1e9, peak)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", action="append", help="arch(es) for the resource report (default sm_75..sm_120)")
    ap.add_argument("--time", action="store_true", help="time the ops on the GPU (nvrtc backend)")
    ap.add_argument("--dtype", choices=("f32", "bf16"), default="f32")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", action="store_true", help="print the bytes model (tools/bytes_model.py) as JSON and exit")
    args = ap.parse_args()
    import bytes_model  # tools/: min / issued / HBM bytes per op at LLaMA-sized shapes, modelled H100 time

    if args.json:
        print(bytes_model.json.dumps([r.to_dict() for d in ("bf16", "f32")
                                      for r in bytes_model.rows("forward", 2 if d == "bf16" else 4)], indent=2))
        return
    bad = report(args.arch or ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"])
    print()
    print(bytes_model.table(bytes_model.rows("forward", 2 if args.dtype == "bf16" else 4)))
    if args.time:
        timings(args.dtype, args.reps)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
