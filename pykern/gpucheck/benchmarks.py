"""gpucheck step 6: op timings (CUDA events, warm-up, median), achieved rate and % of the device's peak,
beside torch eager / SDPA and Liger-Kernel / FlashInfer when they import.

Memory-bound ops report GB/s of the bytes the op must move at least (inputs read once, outputs
written once) and % of peak DRAM bandwidth; attention reports TFLOP/s and % of the bf16 tensor-core
(or fp32) peak. Every implementation of a row gets the same inputs and the same timer.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from ..bench import DevicePeaks, EventTimer, attention_flops, percent, rate


@dataclass
class Impl:
    name: str  # "pykern", "torch", "liger", "flashinfer"
    fn: Callable[[], Any] | None
    skip: str = ""  # why it is not timed (not importable, no such op)


@dataclass
class Workload:
    op: str
    shape: str
    dtype: str  # "bf16" | "f32"
    kind: str  # "memory" (amount = bytes) | "compute" (amount = FLOP)
    amount: float
    impls: list[Impl] = field(default_factory=list)


def run_benchmarks(workloads: Sequence[Workload], timer: EventTimer, peaks: DevicePeaks, warmup: int, repeats: int,
                   deadline: float, log: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """One row per (workload, implementation). Only a pykern implementation that errors is a failure."""
    rows = []
    for w in workloads:
        for impl in w.impls:
            row: dict[str, Any] = {"op": w.op, "shape": w.shape, "dtype": w.dtype, "impl": impl.name, "kind": w.kind,
                                   "median_us": None, "min_us": None, "rate": None, "unit": "",
                                   "pct_peak": None, "status": "ok", "message": ""}
            if impl.fn is None:
                row.update(status="skipped", message=impl.skip)
            elif time.monotonic() > deadline:
                row.update(status="skipped", message="time budget used up")
            else:
                try:
                    t = timer.time(impl.fn, warmup, repeats)
                except Exception as e:  # one failing implementation must not end the table
                    row.update(status="error", message=f"{type(e).__name__}: {str(e)[:200]}")
                else:
                    row["median_us"], row["min_us"] = t.median_ms * 1e3, t.min_ms * 1e3
                    if w.kind == "memory":
                        r = rate(w.amount, t.seconds)
                        row.update(rate=r / 1e9, unit="GB/s", pct_peak=percent(r, peaks.bandwidth))
                    else:
                        r = rate(w.amount, t.seconds)
                        peak = peaks.bf16_tensor if w.dtype == "bf16" else peaks.fp32
                        row.update(rate=r / 1e12, unit="TFLOP/s", pct_peak=percent(r, peak))
            if log:
                shown = f"{row['median_us']:.1f} us" if row["median_us"] is not None else row["status"]
                log(f"bench {w.op:22s} {w.shape:28s} {impl.name:10s} {shown}")
            rows.append(row)
    return rows


# --------------------------------------------------------------------------------------------- torch workloads


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


def setup(quick: bool) -> tuple[list[Workload], int]:
    """(the workloads, the CUstream handle they run on: torch's current stream, which the ops use too)."""
    import torch

    torch.cuda.init()
    return torch_workloads(quick), int(torch.cuda.current_stream().cuda_stream)


def _optional(modname: str) -> tuple[Any, str]:
    import importlib

    try:
        return importlib.import_module(modname), ""
    except Exception as e:  # not installed, or an install that fails to import: skip, with the reason
        return None, f"{modname} not importable ({type(e).__name__})"


def torch_workloads(quick: bool) -> list[Workload]:
    """The benchmark set on CUDA tensors (bf16; LLaMA-8B-like sizes, smaller with quick)."""
    import torch
    import torch.nn.functional as F

    from .. import ops
    from ..difftest.cases.forward import rope_tables

    torch.manual_seed(0)
    dev, bf = "cuda", torch.bfloat16
    es = 2
    n_tok = 2048 if quick else 8192
    dim, ffn, vocab = 4096, 14336, 128256
    liger_rms, why_lr = _optional("liger_kernel.ops.rms_norm")
    liger_swiglu, why_ls = _optional("liger_kernel.ops.swiglu")
    liger_ce, why_lc = _optional("liger_kernel.ops.cross_entropy")
    fi, why_fi = _optional("flashinfer")

    def liger(mod: Any, why: str, attr: str, fn: Callable[[Any], Callable[[], Any]]) -> Impl:
        if mod is None or not hasattr(mod, attr):
            return Impl("liger", None, why or f"liger_kernel has no {attr}")
        return Impl("liger", fn(getattr(mod, attr)))

    def flashinfer(path: str, fn: Callable[[Any], Callable[[], Any]]) -> Impl:
        obj = fi
        for part in path.split("."):
            obj = getattr(obj, part, None) if obj is not None else None
        if obj is None:
            return Impl("flashinfer", None, why_fi or f"flashinfer has no {path}")
        return Impl("flashinfer", fn(obj))

    out: list[Workload] = []

    # rms_norm
    x, w = torch.randn(n_tok, dim, device=dev, dtype=bf), torch.randn(dim, device=dev, dtype=bf)
    rms_torch = (lambda: F.rms_norm(x, (dim,), w, 1e-6)) if hasattr(F, "rms_norm") else (
        lambda: (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(bf) * w)
    out.append(Workload("rms_norm", f"{n_tok}x{dim}", "bf16", "memory", (2 * n_tok * dim + dim) * es, [
        Impl("pykern", lambda: ops.rms_norm(x, w, 1e-6, backend="nvrtc")),
        Impl("torch", rms_torch),
        liger(liger_rms, why_lr, "LigerRMSNormFunction", lambda f: lambda: f.apply(x, w, 1e-6)),
        flashinfer("norm.rmsnorm", lambda f: lambda: f(x, w, 1e-6)),
    ]))

    # silu_gate (SwiGLU's elementwise part)
    g, u = torch.randn(n_tok, ffn, device=dev, dtype=bf), torch.randn(n_tok, ffn, device=dev, dtype=bf)
    gu = torch.cat([g, u], dim=-1)
    out.append(Workload("silu_gate", f"{n_tok}x{ffn}", "bf16", "memory", 3 * n_tok * ffn * es, [
        Impl("pykern", lambda: ops.silu_gate(g, u, backend="nvrtc")),
        Impl("torch", lambda: F.silu(g) * u),
        liger(liger_swiglu, why_ls, "LigerSiLUMulFunction", lambda f: lambda: f.apply(g, u)),
        flashinfer("activation.silu_and_mul", lambda f: lambda: f(gu)),
    ]))

    # embedding
    table = torch.randn(vocab, dim, device=dev, dtype=bf)
    ids = torch.randint(0, vocab, (n_tok,), device=dev, dtype=torch.int64)
    out.append(Workload("embedding", f"{n_tok} ids x {dim}", "bf16", "memory", n_tok * (8 + 2 * dim * es), [
        Impl("pykern", lambda: ops.embedding(ids, table, backend="nvrtc")),
        Impl("torch", lambda: F.embedding(ids, table)),
    ]))

    # rope (half style, as HF LLaMA)
    heads, hd = 32, 128
    xq = torch.randn(n_tok, heads, hd, device=dev, dtype=bf)
    cos_np, sin_np = rope_tables(n_tok, hd)
    cos, sin = torch.from_numpy(cos_np).to(dev), torch.from_numpy(sin_np).to(dev)
    cos_full = torch.cat([cos, cos], -1)[:, None, :].to(bf)
    sin_full = torch.cat([sin, sin], -1)[:, None, :].to(bf)

    def rope_torch() -> Any:
        x1, x2 = xq[..., : hd // 2], xq[..., hd // 2:]
        return xq * cos_full + torch.cat([-x2, x1], -1) * sin_full

    out.append(Workload("rope", f"{n_tok}x{heads}x{hd}", "bf16", "memory", 2 * xq.numel() * es, [
        Impl("pykern", lambda: ops.rope(xq, cos, sin, style="half", backend="nvrtc")),
        Impl("torch", rope_torch),
    ]))

    # softmax backward
    p = torch.softmax(torch.randn(n_tok, 4096, device=dev), -1).to(bf)
    gs = torch.randn(n_tok, 4096, device=dev, dtype=bf)
    out.append(Workload("softmax_backward", f"{n_tok}x4096", "bf16", "memory", 3 * p.numel() * es, [
        Impl("pykern", lambda: ops.softmax_backward(p, gs, backend="nvrtc")),
        Impl("torch", lambda: p * (gs - (p * gs).sum(-1, keepdim=True))),
    ]))

    # cross entropy forward + backward
    rows_ce = 1024 if quick else 4096
    logits = torch.randn(rows_ce, vocab, device=dev, dtype=bf)
    targets = torch.randint(0, vocab, (rows_ce,), device=dev, dtype=torch.int64)

    def ce_torch() -> Any:
        lg = logits.detach().requires_grad_(True)
        loss = F.cross_entropy(lg.float(), targets, ignore_index=-100)
        return torch.autograd.grad(loss, lg)

    def ce_liger(f: Any) -> Callable[[], Any]:
        def go() -> Any:
            lg = logits.detach().requires_grad_(True)
            loss = f.apply(lg, targets)
            loss = loss[0] if isinstance(loss, tuple) else loss
            return torch.autograd.grad(loss, lg)
        return go

    out.append(Workload("cross_entropy_fwd_bwd", f"{rows_ce}x{vocab}", "bf16", "memory", 2 * rows_ce * vocab * es, [
        Impl("pykern", lambda: ops.cross_entropy_fwd_bwd(logits, targets, backend="nvrtc")),
        Impl("torch", ce_torch),
        liger(liger_ce, why_lc, "LigerCrossEntropyFunction", ce_liger),
    ]))

    # decode attention: one token, memory-bound on K+V
    kvh, seq = 8, (4096 if quick else 16384)
    qd = torch.randn(heads, hd, device=dev, dtype=bf)
    kc, vc = (torch.randn(kvh, seq, hd, device=dev, dtype=bf) for _ in range(2))
    k_nhd, v_nhd = kc.transpose(0, 1).contiguous(), vc.transpose(0, 1).contiguous()
    sdpa = getattr(F, "scaled_dot_product_attention", None)
    out.append(Workload("decode_attention", f"h{heads}/{kvh} s{seq} d{hd}", "bf16", "memory",
                        (2 * kvh * seq * hd + 2 * heads * hd) * es, [
        Impl("pykern", lambda: ops.decode_attention(qd, kc, vc, seq, backend="nvrtc")),
        Impl("torch", (lambda: sdpa(qd[None, :, None], kc[None], vc[None], enable_gqa=True)) if sdpa else None,
             "" if sdpa else "no scaled_dot_product_attention"),
        flashinfer("single_decode_with_kv_cache", lambda f: lambda: f(qd, k_nhd, v_nhd)),
    ]))

    # flash attention (prefill): compute-bound
    shapes = [(1, 2048 if quick else 4096, 32, 8, 128, True), (4, 1024, 32, 32, 64, False)]
    for b, n, h, kv, d, causal in shapes:
        q = torch.randn(b, n, h, d, device=dev, dtype=bf)
        k, v = torch.randn(b, n, kv, d, device=dev, dtype=bf), torch.randn(b, n, kv, d, device=dev, dtype=bf)
        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        impls = [
            Impl("pykern", lambda q=q, k=k, v=v, c=causal: ops.flash_attention(q, k, v, causal=c, backend="nvrtc")),
            Impl("torch", (lambda qt=qt, kt=kt, vt=vt, c=causal: sdpa(qt, kt, vt, is_causal=c, enable_gqa=True))
                 if sdpa else None, "" if sdpa else "no scaled_dot_product_attention"),
        ]
        if b == 1:
            impls.append(flashinfer("single_prefill_with_kv_cache",
                                    lambda f, q=q, k=k, v=v, c=causal: lambda: f(q[0], k[0], v[0], causal=c)))
        else:
            impls.append(Impl("flashinfer", None, "batch > 1 needs the paged/ragged wrapper (not timed)"))
        out.append(Workload("flash_attention", f"b{b} n{n} h{h}/{kv} d{d}{' causal' if causal else ''}", "bf16",
                            "compute", attention_flops(b, h, n, n, d, causal), impls))
    return out
