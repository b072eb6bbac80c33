"""gpucheck step 6: op timings (CUDA events, warm-up, median), achieved rate and % of the device's peak,
beside torch eager / SDPA and Liger-Kernel / FlashInfer / QuACK when they import.

The memory-bound ops are `python -m pykern.bench`'s table (pykern.bench.suite, bf16 here), timed by the same
code (pykern.bench.runner): GB/s of the bytes the op must move at least (inputs read once, outputs written
once) and % of peak DRAM bandwidth. Decode and flash attention are added here: attention reports TFLOP/s and
% of the bf16 tensor-core (or fp32) peak. Every implementation of a row gets the same inputs and the same timer.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator

from ..bench import attention_flops
from ..bench.runner import Impl, Workload, l2_flush, lookup, optional, run_benchmarks, torch_status

_optional = optional  # the name this module used before the runner moved to pykern.bench


def setup(quick: bool, device: int = 0) -> tuple[Iterator[Workload], int]:
    """(the workloads on cuda:`device`, built one at a time as they are timed; the CUstream handle they run on:
    torch's current stream of that device, which the ops use too). Makes `device` torch's current device, so
    the events the timer records (in the current context) are that device's."""
    import torch

    torch.cuda.init()
    torch.cuda.set_device(device)
    return torch_workloads(quick, device), int(torch.cuda.current_stream(device).cuda_stream)


def torch_workloads(quick: bool, device: int = 0) -> Iterator[Workload]:
    """The benchmark set on CUDA tensors of `device` (bf16; LLaMA-8B-like sizes, smaller with quick):
    pykern.bench's memory-bound table, then decode and flash attention."""
    from ..bench import suite

    dims = suite.QUICK if quick else suite.FULL
    yield from suite.workloads(suite.select((), ("bf16",)), dims, suite.Context(f"cuda:{device}"))
    try:
        yield from _attention_workloads(quick, device)
    except Exception as e:  # inputs that cannot be built (out of memory): one error row, the table goes on
        msg = f"building the attention inputs failed: {type(e).__name__}: {e}"
        yield Workload("attention", "-", "bf16", "compute", 0.0, [Impl("pykern", suite._raiser(msg))])


def _attention_workloads(quick: bool, device: int = 0) -> Iterator[Workload]:
    import torch
    import torch.nn.functional as F

    from .. import ops

    torch.manual_seed(0)
    dev, bf = f"cuda:{device}", torch.bfloat16
    es = 2
    heads, hd = 32, 128
    fi, why_fi = optional("flashinfer")

    def flashinfer(path: str, fn: Callable[[Any], Callable[[], Any]]) -> Impl:
        obj, why = lookup(fi, why_fi, path, "flashinfer")
        return Impl("flashinfer", None, why) if obj is None else Impl("flashinfer", fn(obj))

    # decode attention: one token, memory-bound on K+V
    kvh, seq = 8, (4096 if quick else 16384)
    qd = torch.randn(heads, hd, device=dev, dtype=bf)
    kc, vc = (torch.randn(kvh, seq, hd, device=dev, dtype=bf) for _ in range(2))
    k_nhd, v_nhd = kc.transpose(0, 1).contiguous(), vc.transpose(0, 1).contiguous()
    sdpa = getattr(F, "scaled_dot_product_attention", None)
    yield Workload("decode_attention", f"h{heads}/{kvh} s{seq} d{hd}", "bf16", "memory",
                   (2 * kvh * seq * hd + 2 * heads * hd) * es, [
        Impl("pykern", lambda: ops.decode_attention(qd, kc, vc, seq, backend="nvrtc", kv_layout="HND")),
        Impl("torch", (lambda: sdpa(qd[None, :, None], kc[None], vc[None], enable_gqa=True)) if sdpa else None,
             "" if sdpa else "no scaled_dot_product_attention"),
        flashinfer("single_decode_with_kv_cache", lambda f: lambda: f(qd, k_nhd, v_nhd)),
    ])

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
        yield Workload("flash_attention", f"b{b} n{n} h{h}/{kv} d{d}{' causal' if causal else ''}", "bf16",
                       "compute", attention_flops(b, h, n, n, d, causal), impls)


__all__ = ["Impl", "Workload", "l2_flush", "run_benchmarks", "setup", "torch_status", "torch_workloads"]
