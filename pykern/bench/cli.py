"""`python -m pykern.bench`: every memory-bound op on the GPU beside torch eager and the peers, in one run."""
from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, Callable, Sequence

from . import SLEEP_CYCLES, EventTimer, device_peaks, gpu_sleep, open_device, read_attributes
from . import suite
from .runner import l2_flush, run_benchmarks, torch_status

EXIT_OK = 0  # every pykern row ran (peers may have errored or been skipped)
EXIT_FAILED = 1  # a pykern row errored
EXIT_USAGE = 2  # bad command line (argparse), or --ops matched nothing
EXIT_NO_GPU = 3  # no CUDA driver, no CUDA device, or torch sees no CUDA device: nothing was timed
JSON_VERSION = 1


def _calibration_words() -> dict[str, str]:
    """The calibrated model's constants as the help states them, read from attention_model's FITTED and HELD so the
    help cannot fall behind the model: how many there are ("six"), their names, how many --fit refits ("five": those
    not HELD) and the held ones ("call_us")."""
    from .attention_model import FITTED, HELD

    words = ("no", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")
    names = list(FITTED.to_dict())
    fitted = [n for n in names if n not in HELD]
    return {"count": words[len(names)] if len(names) < len(words) else str(len(names)),
            "names": ", ".join(names),
            "fitted": words[len(fitted)] if len(fitted) < len(words) else str(len(fitted)),
            "held": ", ".join(n for n in names if n in HELD) or "none"}


def _parser() -> argparse.ArgumentParser:
    names = ", ".join(c.name for c in suite.CASES)
    cw = _calibration_words()
    p = argparse.ArgumentParser(
        prog="python -m pykern.bench",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Times every memory-bound pykern op on a CUDA GPU (--device; nvrtc backend, torch CUDA tensors) at\n"
            "LLaMA-3-8B-sized shapes (8192 tokens, hidden 4096, FFN 14336, 32 heads of 128, vocabulary 128256;\n"
            "the shapes of pykern.bench.bytes_model), side by side with the equivalent torch eager expression\n"
            "and with Liger-Kernel, FlashInfer and QuACK where they are importable and have the op.\n"
            "Per row: the CUDA-event median after warm-up calls, the achieved GB/s of the op's MINIMUM bytes\n"
            "(each input read once, each output written once; the same figure for every implementation) and\n"
            "its % of the device's peak DRAM bandwidth, computed from the device's attributes\n"
            "(MEMORY_CLOCK_RATE x GLOBAL_MEMORY_BUS_WIDTH x 2 / 8). A peer that is missing is a 'skipped'\n"
            "row and one that fails is an 'error' row; neither fails the run. Every timed call starts from a\n"
            "cold L2: a float32 buffer of twice the device's L2_CACHE_SIZE is read (summed) before it, outside\n"
            "the timed events (--no-flush-l2 keeps the cache warm). Reading, not zeroing, leaves L2 full of clean\n"
            "lines, so the timed call writes back nothing it did not write itself. Then a GPU sleep of about 1 ms\n"
            "(torch.cuda._sleep) is enqueued, so that the GPU is still busy while the host enqueues the start\n"
            "event, the call and the end event: the events time the call's GPU work, not the host time of its\n"
            "Python and launch (which would otherwise count against Python-launched kernels: pykern's, Liger's).\n\n"
            f"ops: {names}.\n"
            "Needs a CUDA GPU and torch with CUDA; there is no CPU fallback.\n\n"
            "--attention-model instead prints, without a GPU, the modelled bound of the bf16 tensor-core attention\n"
            "(forward and backward, head_dim 64 and 128, 1K-16K tokens, causal and not, on H100 SXM and A100 SXM;\n"
            "the sm_90a backward also with its softcap and varlen kernels and at head_dim 256):\n"
            "per kernel its SASS inputs (instructions and ldmatrix per MMA of its loop, registers, shared memory,\n"
            "CTAs per SM) and per shape the predicted TFLOP/s with the binding term (issue, shared memory, tensor\n"
            "pipe or HBM). It needs pykern's compiler and cuobjdump (pykern.bench.attention_model; the bound is\n"
            "calibrated from no measured speed).\n"
            "--attention-model --fp8 prints the FP8 (e4m3) sm_90a forward's bound instead (head_dim 64 / 128 / 256,\n"
            "and the d64 / d128 softcap kernels):\n"
            "QGMMA at twice the bf16 rate, its rescale of O and l at the random-score rate p (a row max grew).\n\n"
            f"--attention-model --compare [JSON] prints the calibrated model (the bound plus {cw['count']} constants for what\n"
            "does not overlap, fitted to our own H200 measurements of 2026-11-27, never to a peer's) beside each\n"
            "pykern measurement of an attention.json (default docs/measured/2026-11-27-h200/attention.json): measured,\n"
            "the bound (before), the calibrated model (after), their errors and the binding term.\n"
            f"--attention-model --fit JSON refits {cw['fitted']} of them to JSON's pykern rows (least squares on the log\n"
            f"error; held at FITTED's value: {cw['held']}), prints them and the same comparison.\n"
            f"The constants (pykern.bench.attention_model.FITTED):\n{cw['names']}."
        ),
        epilog=(f"Exit status: {EXIT_OK} every pykern row ran (or the model was printed); {EXIT_FAILED} a pykern row "
                f"errored, or --attention-model could not read the kernels' SASS; {EXIT_USAGE} bad "
                f"usage or --ops matched no op; {EXIT_NO_GPU} needs a CUDA GPU: no CUDA driver, no device, or torch "
                "without CUDA (nothing was timed)."),
    )
    p.add_argument("--ops", action="append", default=[], metavar="GLOB",
                   help="only the ops whose name matches this shell glob (e.g. 'rms_norm*'); repeatable, or "
                        "comma-separated; default all")
    p.add_argument("--dtype", choices=("bf16", "f32", "all"), default="all",
                   help="element type (default all: bf16 and f32 where the op supports it)")
    p.add_argument("--repeats", type=int, default=None, metavar="N",
                   help="timed calls per row, the median is reported (default 20, --quick 5)")
    p.add_argument("--warmup", type=int, default=3, metavar="N", help="untimed calls first (default 3)")
    p.add_argument("--quick", action="store_true",
                   help=f"smaller shapes ({suite.QUICK['T']} tokens, {suite.QUICK['S']}-long score rows) and 5 repeats")
    p.add_argument("--json", action="store_true", help="print one JSON document (for dashboards) instead of the table")
    p.add_argument("--device", type=int, default=0, help="CUDA device ordinal (default 0)")
    p.add_argument("--no-flush-l2", dest="flush_l2", action="store_false",
                   help="do not read a buffer of twice the L2 size before each timed call (by default every "
                        "call starts from a cold L2, so inputs smaller than L2, e.g. with --quick, are read from "
                        "DRAM and %% of HBM peak stays meaningful)")
    p.add_argument("--compile", action="store_true",
                   help="also time torch.compile (inductor) of each row's torch expression, as impl 'compile' "
                        "(each op compiles once, untimed: seconds to a minute each)")
    p.add_argument("--list", action="store_true", help="list the ops, shapes and minimum bytes and exit (no GPU needed)")
    p.add_argument("--attention-model", action="store_true",
                   help="print the modelled bound of the tensor-core attention (H100 and A100, fwd/bwd, d64/d128, "
                        "seq 1K-16K, causal and not; binding term and SASS inputs) and exit; no GPU needed; "
                        "--ops/--dtype do not apply, --json prints it as JSON")
    p.add_argument("--compare", nargs="?", const="", default=None, metavar="JSON",
                   help="with --attention-model: the calibrated model beside the pykern rows of an attention.json "
                        "(default: the 2026-11-27 H200 run's), before / after and the binding term")
    p.add_argument("--fit", default=None, metavar="JSON",
                   help=f"with --attention-model: refit {cw['fitted']} of the calibrated model's {cw['count']} "
                        f"constants (held: {cw['held']}) to the pykern rows of this attention.json (never a peer's) "
                        "and print them with the comparison")
    p.add_argument("--fp8", action="store_true",
                   help="with --attention-model: the FP8 (e4m3) sm_90a forward's modelled bound instead (d64 / d128 / "
                        "d256, and d64 / d128 with softcap, seq 1K-16K, causal and not; the tensor pipe at the FP8 rate, "
                        "its rescale of O and l at the random-score rate p a row max grows, named in each row)")
    p.add_argument("--bulk-dq", action="store_true",
                   help="with --attention-model: the current sm_90a fused backward under the calibrated model, its "
                        "dQ partials as per-float REDs (before) and as its bulk reduce-adds into L2 (after); a "
                        "modelled bound")
    return p


def _patterns(raw: Sequence[str]) -> list[str]:
    return [p.strip() for r in raw for p in r.split(",") if p.strip()]


def main(argv: Sequence[str] | None = None, driver_factory: Callable[[], Any] | None = None,
         build: suite.Builder | None = None, stream: int | None = None,
         flush: Callable[[int], Callable[[], Any]] | None = None, busy: Callable[[], Any] | None = None) -> int:
    """Run the benchmark. The tests pass a fake driver, a builder of implementations, a stream and `flush`
    (L2 size in bytes -> the call that evicts it); on a GPU the builder is suite.Context (torch CUDA tensors,
    nvrtc backend) on torch's current stream and the flush zeroes a torch buffer of twice the L2 size."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    if args.attention_model:
        return _attention_model(args)
    dtypes = suite.BF16_F32 if args.dtype == "all" else (args.dtype,)
    selected = suite.select(_patterns(args.ops), dtypes)
    if not selected:
        print(f"pykern.bench: --ops {','.join(_patterns(args.ops))} --dtype {args.dtype} matches no op "
              f"(ops: {', '.join(c.name for c in suite.CASES)})", file=sys.stderr)
        return EXIT_USAGE
    if args.repeats is not None and args.repeats < 1:
        print(f"pykern.bench: --repeats must be >= 1, got {args.repeats}", file=sys.stderr)
        return EXIT_USAGE
    if args.warmup < 0:
        print(f"pykern.bench: --warmup must be >= 0, got {args.warmup}", file=sys.stderr)
        return EXIT_USAGE
    dims = suite.QUICK if args.quick else suite.FULL
    if args.list:
        for case, dt in selected:
            print(f"{case.name:24s} {dt:5s} {case.shape(dims):32s} {case.min_bytes(dims, 2 if dt == 'bf16' else 4) / 1e6:10.1f} MB")
        return EXIT_OK
    repeats = args.repeats or (5 if args.quick else 20)

    try:
        drv = open_device(args.device, driver_factory)
    except Exception as e:  # no libcuda, CUDA_ERROR_NO_DEVICE, no such ordinal
        return _no_gpu(args, f"{type(e).__name__}: {e}")
    if build is None:
        ok, why = torch_status()
        if not ok:
            return _no_gpu(args, why)
        import torch

        torch.cuda.set_device(args.device)
        build = suite.Context(f"cuda:{args.device}", compile=args.compile)
        stream = int(torch.cuda.current_stream().cuda_stream)
        if flush is None:
            flush = lambda n: l2_flush(n, args.device)  # noqa: E731
        if busy is None:
            busy = gpu_sleep()
    attrs = read_attributes(drv, args.device)
    cc = drv.compute_capability(args.device)
    attrs.update(COMPUTE_CAPABILITY_MAJOR=cc[0], COMPUTE_CAPABILITY_MINOR=cc[1])
    peaks = device_peaks(attrs)
    device = {"index": args.device, "name": drv.device_name(args.device), "arch": f"sm_{cc[0]}{cc[1]}",
              "memory_clock_khz": attrs.get("MEMORY_CLOCK_RATE"), "bus_width_bits": attrs.get("GLOBAL_MEMORY_BUS_WIDTH"),
              "sms": attrs.get("MULTIPROCESSOR_COUNT")}
    t0 = time.monotonic()
    log = None if args.json else (lambda m: print(m, file=sys.stderr, flush=True))
    l2 = int(attrs.get("L2_CACHE_SIZE", 0)) or 64 * 2**20  # an attribute the driver refused: 64 MB covers H100/A100
    before = None
    if args.flush_l2 and flush is not None:
        try:
            before = flush(2 * l2)
        except Exception as e:  # out of memory for the buffer: time with a warm L2 and say so
            print(f"pykern.bench: L2 not flushed ({type(e).__name__}: {str(e)[:120]})", file=sys.stderr)
    rows = run_benchmarks(suite.workloads(selected, dims, build), EventTimer(drv, stream or 0, busy=busy), peaks,
                          args.warmup, repeats, deadline=float("inf"), log=log, before=before)
    _annotate(rows, selected, dims)
    bad = [r for r in rows if r["impl"] == "pykern" and r["status"] == "error"]
    code = EXIT_FAILED if bad else EXIT_OK
    doc = {"version": JSON_VERSION, "tool": "pykern.bench", "status": "FAIL" if bad else "ok", "exit_code": code,
           "device": device, "peaks": peaks.to_dict(),
           "options": {"ops": _patterns(args.ops), "dtypes": list(dtypes), "quick": args.quick, "repeats": repeats,
                       "warmup": args.warmup, "dims": dims, "flush_l2_bytes": 2 * l2 if before else 0,
                       "busy_sleep_cycles": SLEEP_CYCLES if busy is not None else 0},
           "seconds": round(time.monotonic() - t0, 2), "rows": rows}
    print(json.dumps(doc, indent=1) if args.json else table(doc))
    return code


def _annotate(rows: list[dict[str, Any]], selected: Sequence[tuple[suite.Case, str]], dims: dict[str, int]) -> None:
    """vs_pykern (an implementation's median / pykern's: > 1 means pykern is faster) and, on pykern's rows at the
    full shapes, the bytes model's HBM bytes (`model_hbm_bytes`) and what time they take at the device's peak."""
    cases = {(c.name, dt): c for c, dt in selected}
    base = {(r["op"], r["dtype"]): r["median_us"] for r in rows if r["impl"] == "pykern"}
    for r in rows:
        p = base.get((r["op"], r["dtype"]))
        r["vs_pykern"] = r["median_us"] / p if p and r["median_us"] else None
        case = cases.get((r["op"], r["dtype"]))
        r["model_hbm_bytes"] = (suite.model_hbm_bytes(case, r["dtype"], dims)
                                if case is not None and r["impl"] == "pykern" else None)


def _sass_table(args: argparse.Namespace, model: str, build: Any, fmt: Any, fields: Any) -> int:
    """An --attention-model table read from today's SASS (--fp8, --bulk-dq): build() its rows, print fmt(rows),
    or with --json the document with fields(rows); EXIT_FAILED where the SASS cannot be read here."""
    try:
        rows = build()
    except Exception as e:  # no cuobjdump, no NVRTC: today's SASS cannot be read here
        print(f"pykern.bench --attention-model: {type(e).__name__}: {e}", file=sys.stderr)
        return EXIT_FAILED
    if args.json:
        print(json.dumps({"version": JSON_VERSION, "tool": "pykern.bench", "model": model, **fields(rows)}, indent=1))
    else:
        print(fmt(rows))
    return EXIT_OK


def _attention_model(args: argparse.Namespace) -> int:
    from . import attention_model as am

    if args.fp8:
        return _sass_table(args, "attention-fp8", am.fp8_table_rows, am.format_fp8_table, lambda doc: doc)
    if args.bulk_dq:
        return _sass_table(args, "attention-bulk-dq", am.bulk_dq_rows, am.format_bulk_dq, lambda rows: {"rows": rows})
    if args.fit is not None or args.compare is not None:
        path = args.fit if args.fit is not None else (args.compare or am.MEASURED)
        try:
            cal = am.fit(path) if args.fit is not None else am.FITTED
            rows = am.compare(am.measured_points(path), cal)
        except Exception as e:  # a bad JSON path, or the SASS cannot be read here
            print(f"pykern.bench --attention-model: {type(e).__name__}: {e}", file=sys.stderr)
            return EXIT_USAGE if isinstance(e, ValueError) else EXIT_FAILED
        if args.json:
            print(json.dumps({"version": JSON_VERSION, "tool": "pykern.bench", "model": "attention-calibrated",
                              "calibration": cal.to_dict(), "rows": rows}, indent=1))
        else:
            print(am.format_compare(rows, cal))
        return EXIT_OK
    try:
        doc = am.table_rows()
    except Exception as e:  # no cuobjdump, no NVRTC: the SASS cannot be read here
        print(f"pykern.bench --attention-model: {type(e).__name__}: {e}", file=sys.stderr)
        return EXIT_FAILED
    if args.json:
        print(json.dumps({"version": JSON_VERSION, "tool": "pykern.bench", "model": "attention", **doc}, indent=1))
    else:
        print(am.format_table(doc))
    return EXIT_OK


def _no_gpu(args: argparse.Namespace, why: str) -> int:
    msg = f"pykern.bench needs a CUDA GPU (and torch with CUDA): {why}"
    if args.json:
        print(json.dumps({"version": JSON_VERSION, "tool": "pykern.bench", "status": "NO GPU",
                          "exit_code": EXIT_NO_GPU, "reason": why, "rows": []}, indent=1))
    print(msg, file=sys.stderr)
    return EXIT_NO_GPU


def table(doc: dict[str, Any]) -> str:
    dev, pk = doc["device"], doc["peaks"]
    bw = f"{pk['bandwidth'] / 1e9:.0f} GB/s" if pk.get("bandwidth") else "unknown"
    head = ["op", "shape", "dtype", "impl", "median us", "GB/s", "% peak", "vs pykern", "status"]
    body = []
    for r in doc["rows"]:
        f = lambda v, fmt: "" if v is None else format(v, fmt)  # noqa: E731
        status = r["status"] if r["status"] == "ok" else f"{r['status']}: {r['message']}"
        body.append([r["op"], r["shape"], r["dtype"], r["impl"], f(r["median_us"], ".1f"), f(r["rate"], ".0f"),
                     f(r["pct_peak"], ".1f"), f(r["vs_pykern"], ".2f"), status])
    w = [max(len(x[i]) for x in [head, *body]) for i in range(len(head) - 1)]
    fmt = lambda x: "  ".join([*(c.ljust(w[i]) if i < 4 else c.rjust(w[i]) for i, c in enumerate(x[:-1])), x[-1]])  # noqa: E731
    return "\n".join([
        f"pykern.bench on {dev['name']} ({dev['arch']}): peak DRAM bandwidth {bw} (device attributes); "
        f"median of {doc['options']['repeats']} after {doc['options']['warmup']} warm-up calls"
        + (", L2 flushed before each" if doc["options"]["flush_l2_bytes"] else ", L2 not flushed")
        + (", GPU busy while each is enqueued" if doc["options"].get("busy_sleep_cycles") else
           ", GPU idle while each is enqueued (host time may count)")
        + "; GB/s of the minimum bytes; vs pykern = time / pykern's time",
        fmt(head), fmt(["-" * n for n in w] + ["------"]), *map(fmt, body)])


__all__ = ["EXIT_FAILED", "EXIT_NO_GPU", "EXIT_OK", "EXIT_USAGE", "main", "table"]
