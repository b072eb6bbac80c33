"""Decode-attention report and benchmark (issues 7 and 13): contiguous and paged decode steps.

    python tools/bench_decode.py                        # model: every method x LLaMA-8B/70B x batch x length
    python tools/bench_decode.py --resources            # also ptxas registers/spills of the kernels per arch
    python tools/bench_decode.py --time --dtype bf16    # also time each method on the GPU (needs torch + CUDA)

Per (model, batch, length, method) the report prints: launches per decode step, CTAs of
the attention launch vs the SM count (132 on an H100), bytes read vs the minimum (K and V
read once per kv head, plus q and out), and a modelled H100 time at 3.35 TB/s:

    t = bytes_read / (3.35 TB/s * min(1, CTAs / SMs)) + 2 us per extra launch

(a CTA is assumed to pull at most one SM's share of HBM bandwidth; no launch-overlap).
With --time on a GPU it measures each method (torch tensors through pykern's nvrtc
backend, CUDA events) and prints the achieved GB/s and % of HBM peak, next to FlashInfer's
BatchDecodeWithPagedKVCacheWrapper when flashinfer is importable.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pykern.ops.decode import decode_plan  # noqa: E402
from pykern.ops.serving import PagedDecodePlan  # noqa: E402

H100_SMS = 132
H100_BW = 3.35e12
LAUNCH_S = 2e-6
MODELS = {"llama-8b": (32, 8, 128), "llama-70b": (64, 8, 128)}
BATCHES = (1, 8, 64)
LENGTHS = (512, 2048, 8192, 32768)
ELEM = {"f32": 4, "bf16": 2}


def step_model(method: str, batch: int, heads: int, kv_heads: int, head_dim: int, length: int,
               dtype: str, page_size: int = 16) -> dict[str, Any]:
    """Launches, CTAs, bytes read and modelled H100 time of one decode step."""
    e = ELEM[dtype]
    kv_min = 2 * batch * kv_heads * length * head_dim * e
    qo = 2 * batch * heads * head_dim * e
    if method == "paged":
        plan = PagedDecodePlan(batch, heads, kv_heads, head_dim, page_size, max_kv_len=length,
                               q_dtype=dtype, kv_dtype=dtype)
        launches = plan.launches()
        splits, chunks = plan.num_splits, plan.row_chunks
        table = batch * (-(-length // page_size)) * 4 * chunks  # page indices, read once per CTA row chunk
    else:
        p = decode_plan(batch, heads, kv_heads, head_dim, length, method=method)
        launches = p["launches"]
        splits = p["num_splits"]
        chunks = launches[0][1][1]
        table = 0
    ctas = math.prod(launches[0][1])
    partials = 2 * splits * batch * heads * (head_dim + 1) * 4 if len(launches) > 1 else 0  # write + read back
    read = kv_min * chunks + qo + partials + table
    t = read / (H100_BW * min(1.0, ctas / H100_SMS)) + LAUNCH_S * (len(launches) - 1)
    return {"launches": len(launches), "ctas": ctas, "splits": splits, "read": read, "min": kv_min + qo,
            "model_us": t * 1e6, "model_bw": read / t}


def report(args: argparse.Namespace) -> None:
    print(f"decode step model, dtype {args.dtype}, H100: {H100_SMS} SMs, {H100_BW / 1e12:.2f} TB/s")
    hdr = (f"{'model':10s} {'batch':>5s} {'len':>6s} {'method':12s} {'launch':>6s} {'CTAs':>6s} {'/SMs':>6s} "
           f"{'splits':>6s} {'MB read':>9s} {'x min':>6s} {'model us':>9s} {'% peak':>7s}")
    print(hdr)
    print("-" * len(hdr))
    for model in args.models:
        h, kvh, d = MODELS[model]
        for batch in args.batch:
            for length in args.length:
                for method in ("warp", "multi_warp", "split_k", "auto", "paged"):
                    r = step_model(method, batch, h, kvh, d, length, args.dtype)
                    print(f"{model:10s} {batch:5d} {length:6d} {method:12s} {r['launches']:6d} {r['ctas']:6d} "
                          f"{r['ctas'] / H100_SMS:6.2f} {r['splits']:6d} {r['read'] / 1e6:9.2f} "
                          f"{r['read'] / r['min']:6.3f} {r['model_us']:9.1f} {100 * r['model_bw'] / H100_BW:6.1f}%")


def resources(args: argparse.Namespace) -> None:
    from pykern import compiler
    from pykern.sources import Source

    archs = args.arch or ["sm_80", "sm_90"]
    for a in archs:
        res = compiler.compile(Source(ROOT / "kernels_cu" / "paged.cu"), a).resources
        for name in sorted(res):
            r = res[name]
            print(f"{a:6s} {name:24s} regs {r.registers:3d} spill {r.spill_stores}/{r.spill_loads} "
                  f"stack {r.stack_bytes}")


def bench(args: argparse.Namespace) -> None:  # pragma: no cover - needs a GPU
    import torch

    from pykern import ops

    if not torch.cuda.is_available():
        raise SystemExit("--time needs a CUDA GPU (torch.cuda.is_available() is False)")
    try:
        import flashinfer  # type: ignore
    except Exception:  # noqa: BLE001 - optional comparison
        flashinfer = None
    tdt = torch.float32 if args.dtype == "f32" else torch.bfloat16
    dev = "cuda"

    def timed(fn: Any, reps: int = 20) -> float:
        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / reps * 1e-3

    print(f"{'model':10s} {'batch':>5s} {'len':>6s} {'method':12s} {'us':>8s} {'GB/s':>8s} {'% peak':>7s}")
    for model in args.models:
        h, kvh, d = MODELS[model]
        for batch in args.batch:
            for length in args.length:
                ps = 16
                npages = batch * (-(-length // ps))
                q = torch.randn(batch, h, d, device=dev, dtype=tdt)
                kc = torch.randn(batch, kvh, length, d, device=dev, dtype=tdt)
                vc = torch.randn_like(kc)
                lens = torch.full((batch,), length, device=dev, dtype=torch.int32)
                kp = torch.randn(npages, ps, kvh, d, device=dev, dtype=tdt)
                vp = torch.randn_like(kp)
                indptr = torch.arange(0, npages + 1, npages // batch, device=dev, dtype=torch.int32)
                indices = torch.randperm(npages, device=dev, dtype=torch.int32)
                last = torch.full((batch,), length % ps or ps, device=dev, dtype=torch.int32)
                minimum = step_model("warp", batch, h, kvh, d, length, args.dtype)["min"]
                runs: dict[str, Any] = {
                    m: (lambda m=m: ops.batched_decode_attention(q, kc, vc, lens, method=m))
                    for m in ("warp", "multi_warp", "split_k", "auto")}
                plan = PagedDecodePlan(batch, h, kvh, d, ps, max_kv_len=length, q_dtype=args.dtype,
                                       kv_dtype=args.dtype, like=q)
                runs["paged"] = lambda: plan.run(q, kp, vp, indptr, indices, last)
                if flashinfer is not None:
                    try:
                        ws = torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device=dev)
                        fw = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
                        fw.plan(indptr, indices, last, h, kvh, d, ps, q_data_type=tdt, kv_data_type=tdt)
                        runs["flashinfer"] = lambda fw=fw: fw.run(q, (kp, vp))
                    except Exception as e:  # noqa: BLE001 - an API drift must not stop our own figures
                        print(f"flashinfer skipped: {type(e).__name__}: {e}")
                for name, fn in runs.items():
                    t = timed(fn)
                    print(f"{model:10s} {batch:5d} {length:6d} {name:12s} {t * 1e6:8.1f} {minimum / t / 1e9:8.1f} "
                          f"{100 * minimum / t / H100_BW:6.1f}%")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", choices=("f32", "bf16"), default="bf16")
    ap.add_argument("--models", nargs="+", choices=sorted(MODELS), default=sorted(MODELS))
    ap.add_argument("--batch", nargs="+", type=int, default=list(BATCHES))
    ap.add_argument("--length", nargs="+", type=int, default=list(LENGTHS))
    ap.add_argument("--resources", action="store_true", help="ptxas registers / spills of kernels_cu/paged.cu")
    ap.add_argument("--arch", action="append", help="arch for --resources (repeatable; default sm_80, sm_90)")
    ap.add_argument("--time", action="store_true", help="time each method on the GPU (torch + CUDA)")
    args = ap.parse_args(argv)
    report(args)
    if args.resources:
        resources(args)
    if args.time:
        bench(args)


if __name__ == "__main__":
    main()
