"""Timing a table of workloads: each implementation of an op (pykern, torch eager, Liger, FlashInfer, QuACK)
with the same inputs and the same CUDA-event timer; achieved rate and % of the device's peak.

Shared by `python -m pykern.bench` and `python -m pykern.gpucheck` (step 6). No torch import here.
"""
from __future__ import annotations

import importlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from . import DevicePeaks, EventTimer, percent, rate


@dataclass
class Impl:
    name: str  # "pykern", "torch", "liger", "flashinfer", "quack", "compile" (torch.compile of the torch row)
    fn: Callable[[], Any] | None
    skip: str = ""  # why it is not timed (not importable, no such op, not comparable)


@dataclass
class Workload:
    op: str
    shape: str
    dtype: str  # "bf16" | "f32"
    kind: str  # "memory" (amount = minimum bytes) | "compute" (amount = FLOP)
    amount: float
    impls: list[Impl] = field(default_factory=list)


def run_benchmarks(workloads: Iterable[Workload], timer: EventTimer, peaks: DevicePeaks, warmup: int, repeats: int,
                   deadline: float, log: Callable[[str], None] | None = None,
                   before: Callable[[], Any] | None = None) -> list[dict[str, Any]]:
    """One row per (workload, implementation); `before` runs ahead of each timed call, untimed (an L2 flush). A failing implementation is an "error" row, never an exception
    (the caller decides which errors fail the run: only pykern's do). `workloads` may be a generator, so each
    op's inputs are built just before it is timed and dropped after."""
    rows = []
    for w in workloads:
        for impl in w.impls:
            row: dict[str, Any] = {"op": w.op, "shape": w.shape, "dtype": w.dtype, "impl": impl.name, "kind": w.kind,
                                   "min_bytes": int(w.amount) if w.kind == "memory" else None,
                                   "median_us": None, "min_us": None, "rate": None, "unit": "",
                                   "pct_peak": None, "status": "ok", "message": ""}
            if impl.fn is None:
                row.update(status="skipped", message=impl.skip)
            elif time.monotonic() > deadline:
                row.update(status="skipped", message="time budget used up")
            else:
                try:
                    t = timer.time(impl.fn, warmup, repeats, before)
                except Exception as e:  # one failing implementation must not end the table
                    row.update(status="error", message=f"{type(e).__name__}: {str(e)[:200]}")
                else:
                    row["median_us"], row["min_us"] = t.median_ms * 1e3, t.min_ms * 1e3
                    r = rate(w.amount, t.seconds)
                    if w.kind == "memory":
                        row.update(rate=r / 1e9, unit="GB/s", pct_peak=percent(r, peaks.bandwidth))
                    else:
                        peak = peaks.bf16_tensor if w.dtype == "bf16" else peaks.fp32
                        row.update(rate=r / 1e12, unit="TFLOP/s", pct_peak=percent(r, peak))
            if log:
                shown = f"{row['median_us']:.1f} us" if row["median_us"] is not None else row["status"]
                log(f"bench {w.op:22s} {w.shape:28s} {w.dtype:4s} {impl.name:10s} {shown}")
            rows.append(row)
    return rows


def torch_status() -> tuple[bool, str]:
    """(torch with a usable CUDA device is importable, why not)."""
    try:
        import torch
    except Exception as e:
        return False, f"torch is not importable ({type(e).__name__}: {e})"
    try:
        if not torch.cuda.is_available():
            return False, f"torch {torch.__version__} sees no CUDA device"
    except Exception as e:
        return False, f"torch.cuda failed ({e})"
    return True, ""


def l2_flush(nbytes: int, device: int | str = "cuda") -> Callable[[], Any]:
    """The call that evicts L2 before a timed call: a sum over a float32 buffer of `nbytes` (twice the L2 size),
    one reduction kernel on torch's current stream, so it completes before the start event that follows it.

    It reads, so it leaves L2 full of clean lines. A memset (how this flushed before) leaves it full of dirty
    ones, and the timed call then writes them back as it evicts them: up to the L2's size in HBM writes (50-60 MiB:
    12-15 us at 4 TB/s) inside its events, which bends every step that reads tens of MB and more."""
    import torch

    dev = device if isinstance(device, str) else f"cuda:{device}"
    buf = torch.ones(max(1, int(nbytes) // 4), dtype=torch.float32, device=dev)
    out = torch.empty((), dtype=torch.float32, device=dev)
    return lambda: torch.sum(buf, dim=0, out=out)


def optional(modname: str) -> tuple[Any, str]:
    """(the module, "") or (None, why): a peer library that is missing or fails to import is skipped."""
    try:
        return importlib.import_module(modname), ""
    except Exception as e:  # not installed, or an install that fails to import (wrong CUDA, no triton)
        return None, f"{modname} not importable ({type(e).__name__})"


def lookup(mod: Any, why: str, path: str, what: str) -> tuple[Any, str]:
    """(mod.path, "") or (None, why): the attribute a peer exposes, or the reason it cannot be timed."""
    if mod is None:
        return None, why
    obj = mod
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None, f"{what} has no {path}"
    return obj, ""


__all__ = ["Impl", "Workload", "l2_flush", "lookup", "optional", "run_benchmarks", "torch_status"]
