#!/usr/bin/env python3
"""Measure pykern on a CUDA GPU beside the peers that torch carries, in one short run.

    python tools/measure_gpu.py ceilings            # device-to-device copy GB/s, 8192^3 bf16 GEMM TFLOP/s
    python tools/measure_gpu.py attention           # fwd and fwd+bwd TFLOP/s: pykern (sm_90a and mma.sync
                                                    # paths, deterministic mode, the FP8 forward), SDPA's flash
                                                    # (FlashAttention-2) and cuDNN backends (cuDNN FP8 where
                                                    # torch takes float8 inputs)
    python tools/measure_gpu.py attention --dtypes bf16 f16 --dims 128 64 256 192/128 --extra-dims 96
                                                    # the shapes the Hopper work needs (192/128: q, k head dim
                                                    # 192, v 128); --list prints the planned rows and their
                                                    # modelled seconds without a GPU
    python tools/measure_gpu.py decode              # paged decode GB/s (bf16 and e4m3 KV, GQA 1/4/8) beside
                                                    # torch SDPA on a contiguous cache; correctness and
                                                    # run-to-run identity of the one-launch split merge
    python tools/measure_gpu.py decode --pdl        # also chains of 8 steps (a layer each) with and without
                                                    # programmatic dependent launch (enable_pdl; sm_90+)
    python tools/measure_gpu.py decode-graph        # a 32-layer decode step (append, paged decode, sampling) in
                                                    # one CUDA graph: replays checked against eager steps, GPU /
                                                    # wall / host time beside eager and the sum of its kernels
    python tools/measure_gpu.py sampling            # the sampling ops on a 128256 vocabulary beside torch's
                                                    # sort + filter + multinomial
    python tools/measure_gpu.py mla                 # MLA paged decode (latent 512 + rope 64) GB/s beside torch
                                                    # and FlashInfer, heads 16 / 128, batch 1-256, 4k / 32k
    python tools/measure_gpu.py model               # a training step of a Llama-shaped and a Qwen3-MoE-shaped
                                                    # model four ways (unpatched, pykern.torch.apply, apply +
                                                    # torch.compile, Liger's patch), greedy decode (Llama)
    python tools/measure_gpu.py model-profile       # that training step's GPU time by op (torch.profiler)
    python tools/measure_gpu.py all --quick --json OUT.json

Peers that torch does not carry (FA4's Hopper path, FlashInfer) are timed too where they import: carry them with
tools/peers.py and put its site folder on PYTHONPATH. Each gets its own entry in the rows (`fa4` beside `pykern`
in attention rows; `flashinfer_*` keys in decode rows; `flashinfer ...` ops in sampling). FlashInfer builds its
JIT modules with the machine's nvcc on first use (minutes a module: decode, prefill for its tensor-core decode,
sampling); that happens before the timed calls.
    python tools/measure_gpu.py summary OUT.json ...  # compact tables of saved rows (no GPU needed)

Timing: CUDA events around each call, the median of 5 to 20 calls after 3 warm-up calls. Before every
timed call torch.cuda._sleep keeps the GPU busy while the host enqueues the start event, the call and
the end event, so the events time GPU work alone; the host time of a call is measured on its own
(host_overhead: calls enqueued behind a long GPU sleep). Before every timed decode and sampling call a
buffer of twice the L2 is read (summed, outside the events: pykern.bench's flush), so data that would fit
the L2 is still read from HBM, and no dirty line is left for the timed call to write back.
Attention shapes follow FlashAttention-2's benchmark: 16k tokens a batch (batch = 16384 / seq),
hidden 2048 (heads = 2048 // head_dim of q and k); FLOPs as FA2 counts them (forward 2 * seq^2 * heads * batch *
(d + dv), i.e. 4 * seq^2 * d * heads * batch where dv = d, halved when causal; backward 2.5x that). Each attention
output is compared with the row's first implementation that ran on the same inputs (SDPA's flash backend, or
cuDNN's where flash refuses the shape: rel_err_vs_first, `ref` in the row), and each decode output with fp32 SDPA
on the gathered cache. Attention rows carry "dtype" ("bf16" or "f16"; rows written before it are bf16) and "dv"
where v's head dim differs from d.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F

# GPU cycles of torch.cuda._sleep before each timed call, pykern.bench's constant (about 1 ms at 1.98 GHz): the GPU
# is still busy when the host has enqueued the start event, the call and the end event, so the events time the GPU
# work alone, not the host's launch overhead (host_overhead() measures that).
from pykern.bench import SLEEP_CYCLES

ROWS: list[dict[str, Any]] = []
# --json's file, rewritten after every row (main sets it): a run that its time limit stops (timeout's SIGTERM ends
# the process without running main's finally) still leaves every row it finished there.
JSON_OUT: str | None = None


def log(row: dict[str, Any]) -> None:
    ROWS.append(row)
    print(json.dumps(row), flush=True)
    if JSON_OUT:
        write_rows(JSON_OUT)


def write_rows(path: str) -> None:
    """ROWS to path, whole or not at all (a temporary file renamed over it: a kill mid-write leaves the last one)."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(ROWS, f, indent=1)
    os.replace(tmp, path)


def timed(fn: Callable[[], Any], reps: int, flush: Callable[[], Any] | None = None, warmup: int = 3) -> float:
    """Median seconds of GPU time of one call of fn (CUDA events; host overhead hidden behind a GPU sleep)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    pairs = []
    for _ in range(reps):
        if flush is not None:
            flush()
        torch.cuda._sleep(SLEEP_CYCLES)
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        pairs.append((s, e))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in pairs) * 1e-3


def host_overhead(fn: Callable[[], Any], n: int = 50) -> float:
    """Seconds of host time per call of fn, the GPU kept ahead by a sleep (the calls only enqueue)."""
    fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES * 20)
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t = (time.perf_counter() - t0) / n
    torch.cuda.synchronize()
    return t


def paged_case(batch: int, gqa: int, kv_heads: int, head_dim: int, page: int, ctx: int) -> tuple:
    """(q, k_pages, v_pages, kv_indptr, kv_indices, kv_last_page_len) of a bf16 paged decode step: every sequence
    ctx tokens long in whole pages, the pages in random order; q has kv_heads * gqa heads."""
    pages_per = ctx // page
    npages = batch * pages_per
    q = torch.randn(batch, kv_heads * gqa, head_dim, device="cuda", dtype=torch.bfloat16)
    kp = torch.randn(npages, page, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    vp = torch.randn_like(kp)
    indptr = torch.arange(0, npages + 1, pages_per, device="cuda", dtype=torch.int32)
    indices = torch.randperm(npages, device="cuda").to(torch.int32)
    last = torch.full((batch,), page, device="cuda", dtype=torch.int32)
    return q, kp, vp, indptr, indices, last


def l2_flusher() -> Callable[[], Any]:
    """pykern.bench's L2 flush (a read of twice the L2: clean lines, no write-back inside the timed call)."""
    from pykern.bench.runner import l2_flush

    return l2_flush(2 * torch.cuda.get_device_properties(0).L2_cache_size)


PEER_ERRORS: dict[str, str] = {}
_FI_WORKSPACE: list[torch.Tensor] = []   # FlashInfer's float workspace, one for every wrapper


def peer(module: str) -> Any | None:
    """A peer library carried to the GPU machine (tools/peers.py), or None where it does not import (the reason is
    kept in PEER_ERRORS and logged once)."""
    import importlib
    if module in PEER_ERRORS:
        return None
    try:
        return importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - an absent or broken peer leaves its columns out, nothing else
        PEER_ERRORS[module] = f"{type(e).__name__}: {str(e)[:300]}"
        log({"what": "peer", "module": module, "error": PEER_ERRORS[module]})
        return None


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


# --------------------------------------------------------------------------- ceilings

def ceilings(args: argparse.Namespace) -> None:
    p = torch.cuda.get_device_properties(0)
    log({"what": "device", "name": p.name, "sms": p.multi_processor_count, "l2_bytes": p.L2_cache_size,
         "mem_bytes": p.total_memory, "torch": torch.__version__, "cuda": torch.version.cuda,
         "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())})
    n = (1 << 28) if args.quick else (1 << 30)  # bytes per buffer
    a = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    b = torch.empty_like(a)
    t = timed(lambda: b.copy_(a), 20)
    log({"what": "copy", "bytes_each_way": n, "us": t * 1e6, "GBps_read_plus_write": 2 * n / t / 1e9})
    del a, b
    m = 4096 if args.quick else 8192
    x = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    t = timed(lambda: x @ y, 10)
    log({"what": "gemm_bf16", "m": m, "us": t * 1e6, "TFLOPs": 2 * m ** 3 / t / 1e12})
    # what timed() reads for one launch that does no work: the floor under every small step's figure
    tiny = torch.zeros(1, device="cuda")
    t = timed(lambda: tiny.add_(1.0), 50)
    log({"what": "launch_floor", "op": "torch add_ on 1 element", "us": t * 1e6})


# --------------------------------------------------------------------------- attention

# The implementations each row times, in this order (the first that runs is the reference of every rel_err_vs_first).
# The bf16 rows time all of them; rows of another dtype, and the rows of --extra-dims, only pykern's sm_90a path and
# the peers (pykern_mma_sync, pykern_deterministic and the FP8 pair are bf16 questions: a second dtype would only
# double their time).
ATTN_FULL = ("sdpa_flash", "sdpa_cudnn", "pykern", "pykern_mma_sync", "pykern_deterministic", "pykern_fp8",
             "sdpa_cudnn_fp8", "flashinfer", "fa4")
ATTN_PRIMARY = ("sdpa_flash", "sdpa_cudnn", "pykern", "flashinfer", "fa4")
# the peers pykern's ratio is taken against (summary): the best of these that ran, per row and per phase
ATTN_PEERS = ("sdpa_flash", "sdpa_cudnn", "fa4", "flashinfer")
ATTN_DTYPES = ("bf16", "f16")
# Modelled cost of the plan (--list): rates a little under the mean of the four implementations the 2026-11-27 H200
# run timed over its 18 shapes (forward 382 TFLOP/s, forward + backward 265), so the estimate errs long; FA4's CuTe
# DSL compile of a new (dtype, d, dv, causal), forward and backward, as FA4's users report it (about 8 s for a dense
# forward specialisation, tens of seconds for a backward); a cuDNN graph build per row and direction. FlashInfer
# costs nothing here: its prefill is timed only where its JIT module is built already (flashinfer_prefill_built).
EST_FWD_FLOPS, EST_FWDBWD_FLOPS = 350e12, 250e12
EST_FA4_COMPILE_S = {"fwd": 10.0, "bwd": 30.0}
EST_CUDNN_GRAPH_S = 0.5
EST_ROW_SETUP_S = 0.3


def parse_dim(s: str) -> tuple[int, int]:
    """'128' -> (128, 128); '192/128' -> (192, 128): q and k's head_dim, then v's (and out's)."""
    try:
        parts = [int(p) for p in str(s).split("/")]
    except ValueError:
        parts = []
    if len(parts) not in (1, 2) or min(parts) < 1:
        raise argparse.ArgumentTypeError(f"expected a head_dim (128) or q,k / v head dims (192/128), got {s!r}")
    return parts[0], parts[-1]


def attention_flop(batch: int, heads: int, seq: int, d: int, dv: int, causal: bool) -> float:
    """Forward FLOPs as FA2 counts them: two GEMMs, q k^T (d) and p v (dv), 2 * seq^2 * heads * batch * (d + dv)
    (4 * seq^2 * d * heads * batch when dv = d), halved when causal. The backward is counted as 2.5x that (FA2's
    convention, exact when dv = d; its five GEMMs give (3d + 2dv) / (d + dv) = 2.6x at 192 / 128, so there the
    backward TFLOP/s is 4% under the work done)."""
    return 2.0 * batch * heads * seq * seq * (d + dv) / (2 if causal else 1)


def attention_plan(dtypes: Any = ("bf16",), dims: Any = ((64, 64), (128, 128)), extra_dims: Any = (),
                   seqs: Any = (1024, 4096, 16384), fwd_only: bool = False) -> list[dict[str, Any]]:
    """The rows `attention` measures, in the order it measures them (most wanted first, so that a run stopped by its
    time limit keeps those): sequences of 4k and up for each dtype in the order given and each head dim in the order
    given, then the shorter sequences the same way, then the --extra-dims rows (first dtype only) long then short.
    Shapes follow FA2's benchmark: 16k tokens a batch (batch = 16384 / seq), heads = 2048 // d (q and k's d).
    fwd_only: the forward alone (each entry's "bwd" False): no backward timed, no FA4 backward compiled, and no
    pykern_deterministic (its forward is pykern's)."""
    seqs = tuple(seqs)
    long, short = [n for n in seqs if n >= 4096], [n for n in seqs if n < 4096]
    rows: list[dict[str, Any]] = []

    def add(dt: str, dd: Any, ns: list[int], impls: tuple[str, ...]) -> None:
        for d, dv in dd:
            for causal in (False, True):
                for n in ns:
                    b, h = max(1, 16384 // n), max(1, 2048 // d)
                    fl = attention_flop(b, h, n, d, dv, causal)
                    row = {"what": "attention", "dtype": dt, "d": d, **({"dv": dv} if dv != d else {}),
                           "causal": causal, "seq": n, "batch": b, "heads": h, "fwd_flop": fl, "bwd_flop": 2.5 * fl}
                    rows.append({"row": row, "bwd": not fwd_only,
                                 "impls": tuple(i for i in impls if not (fwd_only and i == "pykern_deterministic"))})
    for group in (long, short):
        for dt in dtypes:
            add(dt, dims, group, ATTN_FULL if dt == "bf16" else ATTN_PRIMARY)
    for group in (long, short):
        add(dtypes[0], extra_dims, group, ATTN_PRIMARY)
    return rows


def attention_estimate(plan: list[dict[str, Any]], reps: int) -> list[float]:
    """Modelled seconds each planned row takes (see EST_*): the timed calls at the modelled rates, the GPU sleep ahead
    of each (SLEEP_CYCLES, about 1 ms), FA4's compile the first time a (dtype, d, dv, causal) comes, cuDNN's graph
    builds. An estimate of our own making, not a measurement: it orders and sizes the stage, nothing more."""
    seen: set[tuple] = set()
    sleep = SLEEP_CYCLES / 1.98e9
    out = []
    for p in plan:
        r = p["row"]
        tf, tfb = r["fwd_flop"] / EST_FWD_FLOPS, 3.5 * r["fwd_flop"] / EST_FWDBWD_FLOPS
        s = EST_ROW_SETUP_S
        for name in p["impls"]:
            bwd = p.get("bwd", True) and name not in ("pykern_fp8", "sdpa_cudnn_fp8", "flashinfer")
            if name == "flashinfer":
                continue  # timed only where already built: its calls are as cheap as the others', left out
            # forward: 3 warm-up calls, the reference call, reps timed, host_overhead's 1 + 20 behind a 20x sleep
            s += (3 + 1 + reps + 21) * tf + reps * sleep + 20 * sleep
            if bwd:
                s += (3 + reps) * tfb + reps * sleep
            if name == "fa4":
                key = (r["dtype"], r["d"], r.get("dv", r["d"]), r["causal"])
                if key not in seen:
                    seen.add(key)
                    s += EST_FA4_COMPILE_S["fwd"] + (EST_FA4_COMPILE_S["bwd"] if bwd else 0.0)
            if name.startswith("sdpa_cudnn"):
                s += EST_CUDNN_GRAPH_S * (2 if bwd else 1)
        out.append(s)
    return out


def attention_args(args: argparse.Namespace) -> tuple[tuple[str, ...], list[tuple[int, int]], list[tuple[int, int]],
                                                        tuple[int, ...]]:
    """(dtypes, dims, extra_dims, seqs) of the options: --dims (default 64 128; --d256, kept for gpu_session.sh
    and the docs, adds 256), --dtypes (default bf16), --extra-dims, --seqs (default 1k 4k 16k; --quick 1k 4k)."""
    dims = list(args.dims or [(64, 64), (128, 128)])
    if args.d256 and (256, 256) not in dims:
        dims.append((256, 256))
    seqs = tuple(args.seqs or ((1024, 4096) if args.quick else (1024, 4096, 16384)))
    return tuple(args.dtypes or ("bf16",)), dims, list(args.extra_dims or []), seqs


def attention_list(args: argparse.Namespace) -> None:
    """--list: the planned rows, their implementations and the modelled seconds each (no GPU needed)."""
    plan = attention_plan(*attention_args(args), fwd_only=getattr(args, "fwd_only", False))
    est = attention_estimate(plan, 5 if args.quick else 10)
    total = 0.0
    print(f"{'#':>3s} {'dtype':5s} {'d':9s} {'mask':6s} {'seq':>6s} {'batch':>5s} {'heads':>5s} impls  est_s  cum_s")
    for i, (p, s) in enumerate(zip(plan, est)):
        r = p["row"]
        total += s
        d = f"d{r['d']}" + (f"/{r['dv']}" if "dv" in r else "")
        print(f"{i:3d} {r['dtype']:5s} {d:9s} {'causal' if r['causal'] else 'full':6s} {r['seq']:6d} {r['batch']:5d} "
              f"{r['heads']:5d} {len(p['impls']):5d} {s:6.1f} {total:6.1f}")
    print(f"{len(plan)} rows, modelled {total:.0f} s (timed calls at {EST_FWD_FLOPS / 1e12:.0f} / "
          f"{EST_FWDBWD_FLOPS / 1e12:.0f} TFLOP/s fwd / fwd+bwd, FA4 compiles {EST_FA4_COMPILE_S['fwd']:.0f} + "
          f"{EST_FA4_COMPILE_S['bwd']:.0f} s a (dtype, d, dv, causal)); pykern's own NVRTC compiles are not in it: "
          "compile its attention sources first (tools/gpu_attention.sh 1)")


def flashinfer_prefill_built(dtype: Any, d: int, dv: int) -> str | None:
    """None where FlashInfer's batch prefill module for (dtype, d, dv) is built already (tools/peers.py build
    --groups prefill, or an AOT copy), else why it is not timed: its JIT build takes minutes a module, which would
    spend the stage's time limit compiling."""
    try:
        from flashinfer.jit.attention import modules as m
    except Exception as e:  # noqa: BLE001
        return f"cannot tell whether FlashInfer's prefill module is built ({type(e).__name__}: {str(e)[:200]})"
    for backend in ("fa3", "fa2"):
        try:
            spec = m.gen_batch_prefill_module(backend, dtype, dtype, dtype, torch.int32, d, dv, 0, False, False, False)
            if spec.is_aot or spec.jit_library_path.exists():
                return None
        except Exception:  # noqa: BLE001 - a backend without this head dim: try the other
            continue
    return (f"FlashInfer's prefill module for {dtype} d{d}/{dv} is not built (tools/peers.py build --groups prefill): "
            "not timed, its JIT build would take minutes")


def attention(args: argparse.Namespace) -> None:
    """Every row of attention_plan: each implementation's forward (and forward + backward where it has one) beside
    the others on the same inputs. q and k are (batch, seq, heads, d), v (batch, seq, heads, dv).

    192 / 128 (dv != d): torch's SDPA flash backend (FA2) takes only q, k, v of one head dim (sdp_utils.cpp,
    check_head_dim_size_flash), so its entry carries that error; the cuDNN backend takes d_qk 192 with d_v 128 on
    sm_90 / sm_100 from cuDNN 9.11 (check_cudnn_tensor_shapes, and check_cudnn_d256_bprop_head_dim for the backward),
    as read in torch's main-branch source (the GPU machine's torch 2.11 was not read line by line: a refusal there
    is an error entry); FA4's flash_attn_func takes head_dim_v != head_dim on sm_90 (8 to 256 each). A
    reference is the first implementation that ran (`ref` in the row)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from pykern.torch import flash_attention

    def sm90_on(on: bool) -> None:  # PYKERN_SM90 is read at each call
        os.environ["PYKERN_SM90"] = "1" if on else "0"
    reps = 5 if args.quick else 10
    for p in attention_plan(*attention_args(args), fwd_only=getattr(args, "fwd_only", False)):
        row, wanted = dict(p["row"]), p["impls"]
        dt = {"bf16": torch.bfloat16, "f16": torch.float16}[row["dtype"]]
        b, n, h, causal = row["batch"], row["seq"], row["heads"], row["causal"]
        d, dv = row["d"], row.get("dv", row["d"])
        fl = row["fwd_flop"]
        q, k = (torch.randn(b, n, h, d, device="cuda", dtype=dt, requires_grad=True) for _ in range(2))
        v = torch.randn(b, n, h, dv, device="cuda", dtype=dt, requires_grad=True)
        g = torch.randn(b, n, h, dv, device="cuda", dtype=dt)
        qt, kt, vt = (x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
        gt = g.transpose(1, 2).contiguous()

        def sdpa(backend: Any, a: tuple) -> Callable[[], Any]:
            def f() -> Any:
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(*a, is_causal=causal)
            return f

        def fb(f: Callable[[], Any], grad: torch.Tensor, leaves: tuple) -> Callable[[], Any]:
            def run() -> Any:  # autograd.grad: no .grad accumulation kernels in the timed region
                return torch.autograd.grad(f(), leaves, grad)
            return run

        ref, ref_name = None, None
        impls: dict[str, tuple[Callable[[], Any], torch.Tensor | None, tuple]] = {}
        q8 = k8 = v8 = qt8 = kt8 = vt8 = None
        for name in wanted:
            if name == "sdpa_flash":
                impls[name] = (sdpa(SDPBackend.FLASH_ATTENTION, (qt, kt, vt)), gt, (qt, kt, vt))
            elif name == "sdpa_cudnn":
                impls[name] = (sdpa(SDPBackend.CUDNN_ATTENTION, (qt, kt, vt)), gt, (qt, kt, vt))
            elif name in ("pykern", "pykern_mma_sync", "pykern_deterministic"):
                # pykern_mma_sync runs with PYKERN_SM90=0; pykern_deterministic under
                # torch.use_deterministic_algorithms(True) (the semaphore-ordered backward): both set in the loop below
                impls[name] = (lambda: flash_attention(q, k, v, causal=causal), g, (q, k, v))
            elif name == "pykern_fp8":
                # FP8 forward (e4m3 q, k, v with unit descales: randn fits e4m3's range), out bf16; its error is
                # against the reference (a bf16 row), so it also reports the FP8 kernel's accuracy on these inputs
                q8, k8, v8 = (x.detach().to(torch.float8_e4m3fn) for x in (q, k, v))
                impls[name] = (lambda: flash_attention(q8, k8, v8, causal=causal), None, ())
            elif name == "sdpa_cudnn_fp8":  # cuDNN's FP8 SDPA where torch exposes it (an error entry otherwise)
                qt8, kt8, vt8 = (x.detach().to(torch.float8_e4m3fn) for x in (qt, kt, vt))
                impls[name] = (sdpa(SDPBackend.CUDNN_ATTENTION, (qt8, kt8, vt8)), None, ())
            elif name == "flashinfer":  # FlashInfer's batch prefill (FA3 backend on sm_90a), forward only
                fi = peer("flashinfer")
                if fi is not None:
                    why = flashinfer_prefill_built(dt, d, dv)
                    try:
                        if why is None:
                            impls[name] = (flashinfer_prefill(fi, q, k, v, causal), None, ())
                    except Exception as e:  # noqa: BLE001 - its plan() refusing the shape costs only its entry
                        why = f"{type(e).__name__}: {str(e)[:300]}"
                    if why is not None:
                        row[name] = {"error": why}
            elif name == "fa4":  # FA4's Hopper path (the FA3 design in CuTe DSL); (b, n, h, d) as ours
                fa4 = peer("flash_attn.cute")
                if fa4 is not None:
                    impls[name] = (lambda: _first(fa4.flash_attn_func(q, k, v, causal=causal)), g, (q, k, v))
        for name, (f, grad, leaves) in impls.items():
            sm90_on(name != "pykern_mma_sync")
            if name == "pykern_deterministic":
                torch.use_deterministic_algorithms(True)
            try:
                with torch.no_grad():
                    o = f()
                o_bnhd = o if name.startswith(("pykern", "fa4", "flashinfer")) else o.transpose(1, 2)
                if ref is None:
                    ref, ref_name = o_bnhd.float(), name
                err = rel(o_bnhd.float(), ref)
                with torch.no_grad():
                    tf = timed(f, reps)
                    th = host_overhead(f, 20)
                row[name] = {"host_us": th * 1e6, "fwd_us": tf * 1e6, "fwd_tflops": fl / tf / 1e12,
                             "rel_err_vs_first": err}
                if grad is not None and p["bwd"]:  # FlashInfer's prefill and the FP8 forwards have none
                    tfb = timed(fb(f, grad, leaves), reps)
                    tb = max(tfb - tf, 1e-9)
                    row[name].update({"fwdbwd_us": tfb * 1e6, "bwd_tflops": 2.5 * fl / tb / 1e12,
                                      "fwdbwd_tflops": 3.5 * fl / tfb / 1e12})
            except Exception as e:  # noqa: BLE001 - one failing implementation must not stop the table
                row[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            finally:
                sm90_on(True)
                torch.use_deterministic_algorithms(False)
        row["ref"] = ref_name
        log(row)  # written to --json at once: a run stopped by its time limit keeps every row it finished
        del q, k, v, qt, kt, vt, g, gt, ref, q8, k8, v8, qt8, kt8, vt8, impls
        torch.cuda.empty_cache()


def flashinfer_prefill(fi: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool
                       ) -> Callable[[], torch.Tensor]:
    """FlashInfer's BatchPrefillWithRaggedKVCacheWrapper over the (b, n, h, d) batch as b sequences of n (v's head
    dim dv may differ from d: head_dim_vo)."""
    b, n, h, d = q.shape
    dv = v.shape[3]
    if not _FI_WORKSPACE:
        _FI_WORKSPACE.append(torch.empty(256 << 20, dtype=torch.uint8, device="cuda"))
    indptr = torch.arange(0, b * n + 1, n, device="cuda", dtype=torch.int32)
    w = fi.BatchPrefillWithRaggedKVCacheWrapper(_FI_WORKSPACE[0], "NHD")
    w.plan(indptr, indptr, h, k.shape[2], d, head_dim_vo=dv, causal=causal, q_data_type=q.dtype)
    qf, kf, vf = (x.detach().reshape(b * n, x.shape[2], x.shape[3]) for x in (q, k, v))
    return lambda: w.run(qf, kf, vf).view(b, n, h, dv)


def _first(r: Any) -> Any:
    """The output of a call that returns (out, lse, ...) or out."""
    return r[0] if isinstance(r, (tuple, list)) else r


# --------------------------------------------------------------------------- decode

def flashinfer_decode(row: dict[str, Any], fi: Any, gqa: int, heads: int, kv_heads: int, head_dim: int, page: int,
                      q: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor, indptr: Any, indices: Any, last: Any,
                      out: torch.Tensor, minimum: int, reps: int, flush: Callable[[], Any]) -> None:
    """FlashInfer's BatchDecodeWithPagedKVCacheWrapper on the same pages (NHD, separate K and V caches), with
    tensor cores from GQA 4 up as FlashInfer recommends; its output beside ours, GPU and host time."""
    if not _FI_WORKSPACE:
        _FI_WORKSPACE.append(torch.empty(256 << 20, dtype=torch.uint8, device="cuda"))
    try:
        w = fi.BatchDecodeWithPagedKVCacheWrapper(_FI_WORKSPACE[0], "NHD", use_tensor_cores=gqa >= 4)
        w.plan(indptr, indices, last, heads, kv_heads, head_dim, page, q_data_type=torch.bfloat16,
               kv_data_type=kp.dtype)
        run = lambda: w.run(q, (kp, vp))  # noqa: E731
        row["flashinfer_rel_err_vs_pykern"] = rel(run().float(), out.float())
        t = timed(run, reps, flush)
        row["flashinfer_us"], row["flashinfer_GBps"] = t * 1e6, minimum / t / 1e9
        row["flashinfer_host_us"] = host_overhead(run) * 1e6
        row["flashinfer_tensor_cores"] = gqa >= 4
    except Exception as e:  # noqa: BLE001
        row["flashinfer_error"] = f"{type(e).__name__}: {str(e)[:300]}"


def decode(args: argparse.Namespace) -> None:
    from pykern.ops.serving import PagedDecodePlan

    flush = l2_flusher()
    kvh, d, ps = 8, 128, 16
    batches = args.batches or ((1, 8, 64) if args.quick else (1, 8, 64, 256))
    lengths = args.lengths or ((1024, 8192) if args.quick else (1024, 8192, 32768))
    reps = 10 if args.quick else 20
    for kv in args.kv or ("bf16", "e4m3"):
        for g in args.gqa or (1, 4, 8):
            h = kvh * g
            for batch in batches:
                for length in lengths:
                    if batch * length > 256 * 8192 and batch > 64:
                        continue  # b256 x 32k: 34 GB of bf16 KV; the 64 x 32k row already streams 8.6 GB
                    pages_per = length // ps
                    q, kf, vf, indptr, indices, last = paged_case(batch, g, kvh, d, ps, length)
                    if kv == "e4m3":
                        kp, vp = kf.to(torch.float8_e4m3fn), vf.to(torch.float8_e4m3fn)
                        kv_name, elem = "float8_e4m3fn", 1
                    else:
                        kp, vp, kv_name, elem = kf, vf, "bf16", 2
                    plan = PagedDecodePlan(batch, h, kvh, d, ps, q_dtype="bf16", kv_dtype=kv_name,
                                           max_kv_len=length, like=q)
                    run = lambda: plan.run(q, kp, vp, indptr, indices, last)  # noqa: E731
                    minimum = 2 * batch * length * kvh * d * elem + 2 * batch * h * d * 2
                    row: dict[str, Any] = {"what": "decode", "kv": kv, "gqa": g, "batch": batch, "ctx": length,
                                           "min_bytes": minimum, "launches": [(l[0], list(l[1])) for l in plan.launches()]
                                           if hasattr(plan, "launches") else None,
                                           "splits": plan.num_splits, "items_per_cta": getattr(plan, "items_per_cta", 1)}
                    try:
                        out = run().clone()
                        # reference: the same KV (dequantized), gathered contiguous, SDPA in fp32
                        order = indices.long().view(batch, pages_per)
                        kc = kp[order].to(torch.float32).reshape(batch, length, kvh, d).transpose(1, 2)
                        vc = vp[order].to(torch.float32).reshape(batch, length, kvh, d).transpose(1, 2)
                        if batch * length <= 64 * 8192:
                            refo = F.scaled_dot_product_attention(q.float().unsqueeze(2), kc, vc,
                                                                  enable_gqa=True).squeeze(2)
                            row["rel_err"] = rel(out.float(), refo)
                        same = all(torch.equal(run(), out) for _ in range(20))
                        row["identical_20_runs"] = same
                        t = timed(run, reps, flush)
                        row["pykern_us"], row["pykern_GBps"] = t * 1e6, minimum / t / 1e9
                        row["pykern_host_us"] = host_overhead(run) * 1e6
                        def at_splits(ns: int, items_per_cta: int = 1) -> float:
                            """GPU seconds of the same step at ns splits (a CTA an item, or items_per_cta)."""
                            alt = PagedDecodePlan(batch, h, kvh, d, ps, q_dtype="bf16", kv_dtype=kv_name,
                                                  max_kv_len=length, num_splits=ns, items_per_cta=items_per_cta,
                                                  like=q)
                            return timed(lambda: alt.run(q, kp, vp, indptr, indices, last), reps, flush)

                        if row["items_per_cta"] > 1:
                            # a persistent grid (one wave, several items a CTA): the plain grid beside it
                            tp = at_splits(1)
                            row["plain_grid_us"], row["plain_grid_GBps"] = tp * 1e6, minimum / tp / 1e9

                        sms = torch.cuda.get_device_properties(0).multi_processor_count
                        if plan.num_splits > 1 and batch * kvh >= sms:
                            # a split taken to fill the last wave (pykern/ops/_decode_waves.py): one split beside it
                            t1 = at_splits(1)
                            row["one_split_us"], row["one_split_GBps"] = t1 * 1e6, minimum / t1 / 1e9
                        elif plan.num_splits == 1 and batch * kvh < 4 * sms:
                            # one split where the wave model priced a second one's extra wave over its fuller waves
                            t2 = at_splits(2)
                            row["two_split_us"], row["two_split_GBps"] = t2 * 1e6, minimum / t2 / 1e9
                        for ns in args.splits or ():  # the same step at each split count asked for
                            row.setdefault("splits_us", {})[ns] = at_splits(ns) * 1e6
                        if args.pdl:
                            pdl_chain(row, plan, q, kp, vp, indptr, indices, last, out, minimum, reps, flush)
                        fi = peer("flashinfer")
                        if fi is not None:
                            flashinfer_decode(row, fi, g, h, kvh, d, ps, q, kp, vp, indptr, indices, last, out,
                                              minimum, reps, flush)
                        if kv == "bf16":
                            kb, vb = kc.to(torch.bfloat16), vc.to(torch.bfloat16)
                            qb = q.unsqueeze(2)
                            ts = timed(lambda: F.scaled_dot_product_attention(qb, kb, vb, enable_gqa=True), reps, flush)
                            row["sdpa_us"], row["sdpa_GBps"] = ts * 1e6, minimum / ts / 1e9
                            row["sdpa_host_us"] = host_overhead(
                                lambda: F.scaled_dot_product_attention(qb, kb, vb, enable_gqa=True)) * 1e6
                            del kb, vb
                        del kc, vc
                    except Exception as e:  # noqa: BLE001
                        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                    log(row)
                    del q, kf, vf, kp, vp, plan
                    torch.cuda.empty_cache()


# Steps of a --pdl chain: one a layer, each over its own cache (so each reads its bytes from HBM after the flush),
# as a model's decode step runs its layers' attention; only where the caches fit PDL_CHAIN_BYTES.
PDL_LAYERS = 8
PDL_CHAIN_BYTES = 2 << 30


def pdl_chain(row: dict[str, Any], plan: Any, q: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor, indptr: Any,
              indices: Any, last: Any, out: torch.Tensor, minimum: int, reps: int, flush: Callable[[], Any]) -> None:
    """GPU time a step of PDL_LAYERS back-to-back decode launches, with and without programmatic dependent launch
    (enable_pdl): what overlapping a launch with the previous kernel's tail saves. Each step's output is checked
    bit-identical to the plain launch's."""
    if PDL_LAYERS * minimum > PDL_CHAIN_BYTES:
        row["pdl_chain"] = f"skipped: {PDL_LAYERS} caches of {minimum} bytes exceed {PDL_CHAIN_BYTES}"
        return
    ks = [kp] + [kp.clone() for _ in range(PDL_LAYERS - 1)]
    vs = [vp] + [vp.clone() for _ in range(PDL_LAYERS - 1)]

    def chain(pdl: bool) -> Callable[[], Any]:
        def f() -> Any:
            for kk, vv in zip(ks, vs):
                res = plan.run(q, kk, vv, indptr, indices, last, enable_pdl=pdl)
            return res
        return f

    row["pdl_identical"] = bool(torch.equal(chain(True)(), out))
    row["chain_layers"] = PDL_LAYERS
    t0 = timed(chain(False), reps, flush) / PDL_LAYERS
    t1 = timed(chain(True), reps, flush) / PDL_LAYERS
    row["chain_us"], row["chain_GBps"] = t0 * 1e6, minimum / t0 / 1e9
    row["chain_pdl_us"], row["chain_pdl_GBps"] = t1 * 1e6, minimum / t1 / 1e9
    del ks, vs


# --------------------------------------------------------------------------- a decode step in one CUDA graph

class DecodeStep:
    """The arrays of a serving decode step over `layers` layers, made once as a serving loop keeps them, and the
    step: per layer, append the new token's K / V (append_paged_kv_cache) and paged decode (PagedDecodePlan.run into
    that layer's preallocated output); then one token a sequence from the logits (top_k_top_p_sampling_from_logits,
    top-k 50, top-p 0.9, seed / offset as (batch,) device arrays, into preallocated tokens / valid). Every argument
    follows docs/serving.md's CUDA-graph rules, so the step launches 2 * layers + 1 kernels and nothing else: it is
    captured whole by capture_decode_step, and audited on the CPU by tests/test_capture_step.py (device "cpu").

    Sequence b holds ctx - (5 b mod page) tokens (ctx a multiple of page), the last one the token appended; its
    pages are the pages_per = ctx / page pages kv_indices[b * pages_per:(b + 1) * pages_per], in random order.
    `sample_kw` overrides the sampling call's keywords; `pdl` launches the append, decode and sampling kernels with
    programmatic dependent launch (enable_pdl; False: every launch without it)."""

    def __init__(self, batch: int, layers: int, ctx: int, *, heads: int = 32, kv_heads: int = 8, head_dim: int = 128,
                 page: int = 16, vocab: int = 128256, num_splits: int | None = None, device: str = "cuda",
                 pdl: bool = False, seed: int = 0) -> None:
        from pykern import ops

        assert ctx % page == 0 and ctx >= page, (ctx, page)
        self.ops, self.pdl, self.layers = ops, pdl, layers
        self.batch, self.heads, self.kv_heads, self.head_dim, self.vocab = batch, heads, kv_heads, head_dim, vocab
        self.gen = torch.Generator(device=device).manual_seed(seed)
        bf, i32 = torch.bfloat16, torch.int32
        pages_per = ctx // page
        npages = batch * pages_per

        def randn(*shape: int, dtype: Any = bf) -> torch.Tensor:
            return torch.randn(*shape, generator=self.gen, device=device).to(dtype)

        self.kc = [randn(npages, page, kv_heads, head_dim) for _ in range(layers)]
        self.vc = [randn(npages, page, kv_heads, head_dim) for _ in range(layers)]
        self.k = [randn(batch, kv_heads, head_dim) for _ in range(layers)]
        self.v = [randn(batch, kv_heads, head_dim) for _ in range(layers)]
        self.q = [randn(batch, heads, head_dim) for _ in range(layers)]
        lens = ctx - (torch.arange(batch, device=device) * 5) % page
        self.indptr = torch.arange(0, npages + 1, pages_per, device=device, dtype=i32)
        self.indices = torch.randperm(npages, generator=self.gen, device=device).to(i32)
        self.last = (lens - (pages_per - 1) * page).to(i32)
        self.batch_indices = torch.arange(batch, device=device, dtype=i32)
        self.positions = (lens - 1).to(i32)  # the token just appended
        self.logits = randn(batch, vocab, dtype=torch.float32)
        self.seed = torch.full((batch,), 1234, device=device, dtype=torch.int64)
        self.offset = torch.zeros(batch, device=device, dtype=torch.int64)
        self.tokens = torch.empty(batch, device=device, dtype=i32)
        self.valid = torch.empty(batch, device=device, dtype=torch.bool)
        self.plan = ops.PagedDecodePlan(batch, heads, kv_heads, head_dim, page, q_dtype="bf16", kv_dtype="bf16",
                                        max_kv_len=ctx, num_splits=num_splits, like=self.q[0])
        self.attn: list[Any] = [torch.empty(batch, heads, head_dim, device=device, dtype=bf) for _ in range(layers)]
        self.sample_kw: dict[str, Any] = dict(out=self.tokens, valid=self.valid, return_valid=True)
        self.min_bytes = 2 * layers * int(lens.sum()) * kv_heads * head_dim * 2 + batch * vocab * 4

    def append(self, layer: int) -> None:
        self.ops.append_paged_kv_cache(self.k[layer], self.v[layer], self.batch_indices, self.positions,
                                       self.kc[layer], self.vc[layer], self.indices, self.indptr, self.last,
                                       enable_pdl=self.pdl)

    def decode(self, layer: int) -> Any:
        return self.plan.run(self.q[layer], self.kc[layer], self.vc[layer], self.indptr, self.indices, self.last,
                             out=self.attn[layer], enable_pdl=self.pdl)

    def sample(self) -> Any:
        kw = dict(top_k=50, top_p=0.9, seed=self.seed, offset=self.offset, enable_pdl=self.pdl)
        kw.update(self.sample_kw)
        return self.ops.top_k_top_p_sampling_from_logits(self.logits, **kw)

    def __call__(self, inject: Callable[[], Any] | None = None) -> Any:
        """The step; `inject` runs after the second layer (tests/test_capture_step.py puts faults there)."""
        for layer in range(self.layers):
            self.append(layer)
            self.decode(layer)
            if inject is not None and layer == min(1, self.layers - 1):
                inject()
        return self.sample()

    def refresh(self, i: int) -> None:
        """New queries, new K / V for the appended token and new logits, written in place; the offset set to i (what a
        serving loop changes between replays)."""
        for t in (*self.q, *self.k, *self.v, self.logits):
            t.copy_(torch.randn(t.shape, generator=self.gen, device=t.device).to(t.dtype))
        self.offset.fill_(i)

    def outputs(self) -> list[torch.Tensor]:
        """Copies of what the step wrote: each layer's attention, the tokens and their flags, each layer's cache."""
        return [t.clone() for t in (*self.attn, self.tokens, self.valid, *self.kc, *self.vc)]


def capture_decode_step(st: DecodeStep, replays: int = 3) -> tuple[Any, dict[str, Any]]:
    """(torch.cuda.CUDAGraph of the whole step, check): the step warmed up on a side stream (kernels loaded, the ops'
    kept dummies made), captured, then replayed `replays` times with new inputs written in place, each replay's
    outputs compared bit for bit with an eager step on the same inputs; then uniform logits replayed at two offsets
    (their tokens must differ: a seed or offset frozen into the graph would repeat them)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        st()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        st()
    identical = []
    for i in range(replays):
        st.refresh(i)
        g.replay()
        torch.cuda.synchronize()
        got = st.outputs()
        st()
        torch.cuda.synchronize()
        identical.append(all(torch.equal(a, b) for a, b in zip(got, st.outputs())))
    st.logits.fill_(0.0)  # uniform rows: every token passes top-k / top-p ties
    drawn = set()
    for i in range(4):
        st.offset.fill_(100 + i)
        g.replay()
        drawn.add(tuple(st.tokens.tolist()))
    check = {"replays_identical": identical, "offsets_draw_differently": len(drawn) > 1,
             "counters_zero": not bool(st.plan.counters.any())}
    return g, check


def decode_graph(args: argparse.Namespace) -> None:
    """A decode step of a Llama-3-8B-shaped model (32 layers, 32 query / 8 KV heads of 128, pages of 16, vocabulary
    128256) captured in one CUDA graph and replayed, beside the same step run eagerly and the sum of its kernels each
    timed alone: GPU time (CUDA events behind a GPU sleep), wall time of back-to-back steps (what a serving loop
    sees: host included) and host time a step. Replays are checked bit for bit against eager steps first."""
    flush = l2_flusher()
    layers = args.layers or (8 if args.quick else 32)
    reps = 5 if args.quick else 10
    pdls = (False, True) if torch.cuda.get_device_capability(0)[0] >= 9 else (False,)
    for batch in args.batches or ((1, 8) if args.quick else (1, 8, 64)):
        for ctx in args.lengths or (1024,):
            for pdl in pdls:
                row: dict[str, Any] = {"what": "decode_graph", "batch": batch, "ctx": ctx, "layers": layers,
                                       "heads": 32, "kv_heads": 8, "head_dim": 128, "vocab": 128256, "pdl": pdl}
                try:
                    st = DecodeStep(batch, layers, ctx, pdl=pdl)
                    row["splits"], row["min_bytes"] = st.plan.num_splits, st.min_bytes
                    g, check = capture_decode_step(st)
                    row.update(check)
                    row["graph_us"] = timed(g.replay, reps, flush) * 1e6
                    row["eager_us"] = timed(st, reps, flush) * 1e6
                    kernels = [lambda l=l: st.append(l) for l in range(layers)]
                    kernels += [lambda l=l: st.decode(l) for l in range(layers)] + [st.sample]
                    row["sum_of_kernels_us"] = sum(timed(k, reps, flush) for k in kernels) * 1e6
                    row["graph_host_us"] = host_overhead(g.replay, 20) * 1e6
                    row["eager_host_us"] = host_overhead(st, 5) * 1e6
                    for name, fn in (("graph_wall_us", g.replay), ("eager_wall_us", st)):
                        fn()
                        torch.cuda.synchronize()
                        t0 = time.perf_counter()
                        for _ in range(reps):
                            fn()
                        torch.cuda.synchronize()
                        row[name] = (time.perf_counter() - t0) / reps * 1e6
                    row["graph_GBps"] = st.min_bytes / row["graph_us"] / 1e3
                    del g
                except Exception as e:  # noqa: BLE001
                    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                log(row)
                st = None  # noqa: F841
                torch.cuda.empty_cache()


# --------------------------------------------------------------------------- sampling

def sampling(args: argparse.Namespace) -> None:
    """The sampling ops on Llama-3's vocabulary (128256, fp32 probabilities), GB/s of one read of the rows, beside
    torch's sort-based top-k / top-p filter + multinomial (the usual eager path: it sorts every row)."""
    from pykern import ops

    flush = l2_flusher()
    vocab = 128256
    reps = 10 if args.quick else 20
    for batch in ((1, 64) if args.quick else (1, 64, 256)):
        probs = torch.softmax(torch.randn(batch, vocab, device="cuda") * 3, dim=-1)
        row_bytes = batch * vocab * 4

        def torch_top_k_top_p(k: int = 50, p: float = 0.9) -> torch.Tensor:
            sp, si = torch.sort(probs, dim=-1, descending=True)
            cum = sp.cumsum(-1)
            sp = sp.masked_fill((cum - sp > p) | (torch.arange(vocab, device="cuda") >= k), 0.0)
            return si.gather(-1, torch.multinomial(sp, 1)).squeeze(-1)

        logits = torch.log(probs)

        cases = {
            "sampling_from_logits": lambda: ops.sampling_from_logits(logits, seed=1),
            "top_k_top_p_sampling_from_logits k50 p0.9": lambda: ops.top_k_top_p_sampling_from_logits(
                logits, 50, 0.9, seed=1),
            "torch softmax + multinomial": lambda: torch.multinomial(torch.softmax(logits, -1), 1),
            "sampling_from_probs": lambda: ops.sampling_from_probs(probs, seed=1),
            "top_k_sampling_from_probs k50": lambda: ops.top_k_sampling_from_probs(probs, 50, seed=1),
            "top_p_sampling_from_probs p0.9": lambda: ops.top_p_sampling_from_probs(probs, 0.9, seed=1),
            "top_k_top_p_sampling_from_probs k50 p0.9": lambda: ops.top_k_top_p_sampling_from_probs(probs, 50, 0.9,
                                                                                                     seed=1),
            "top_k_renorm_probs k50": lambda: ops.top_k_renorm_probs(probs, 50),
            "top_p_renorm_probs p0.9": lambda: ops.top_p_renorm_probs(probs, 0.9),
            "torch sort + top-k/top-p + multinomial": torch_top_k_top_p,
        }
        fi = peer("flashinfer")
        if fi is not None:  # FlashInfer's rejection samplers on the same rows (its JIT module builds on first use)
            fs = fi.sampling
            cases.update({
                "flashinfer sampling_from_logits": lambda: fs.sampling_from_logits(logits),
                "flashinfer top_k_top_p_sampling_from_logits k50 p0.9":
                    lambda: fs.top_k_top_p_sampling_from_logits(logits, 50, 0.9),
                "flashinfer sampling_from_probs": lambda: fs.sampling_from_probs(probs),
                "flashinfer top_k_sampling_from_probs k50": lambda: fs.top_k_sampling_from_probs(probs, 50),
                "flashinfer top_p_sampling_from_probs p0.9": lambda: fs.top_p_sampling_from_probs(probs, 0.9),
                "flashinfer top_k_top_p_sampling_from_probs k50 p0.9":
                    lambda: fs.top_k_top_p_sampling_from_probs(probs, 50, 0.9),
                "flashinfer top_k_renorm_probs k50": lambda: fs.top_k_renorm_probs(probs, 50),
                "flashinfer top_p_renorm_probs p0.9": lambda: fs.top_p_renorm_probs(probs, 0.9),
            })
        for name, fn in cases.items():
            row: dict[str, Any] = {"what": "sampling", "op": name, "batch": batch, "vocab": vocab}
            try:
                t = timed(fn, reps, flush)
                row["us"], row["GBps_one_read"] = t * 1e6, row_bytes / t / 1e9
                if not name.startswith("torch "):
                    row["host_us"] = host_overhead(fn) * 1e6
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            log(row)
        del probs, logits
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------- MLA decode

def mla(args: argparse.Namespace) -> None:
    """MLA paged decode (DeepSeek-V2/V3: latent 512 + rope 64, absorbed queries, pages of 64): pykern's
    MLAPagedDecodePlan beside FlashInfer's BatchMLAPagedAttentionWrapper (when carried) and torch (two bf16 matmuls
    and a softmax over the cache gathered contiguous, the gather untimed); GB/s of the minimum bytes (the latent
    cache read once, q read and out written once)."""
    from pykern.ops import MLAPagedDecodePlan

    flush = l2_flusher()
    ps, sm = 64, 1 / math.sqrt(192)
    reps = 10 if args.quick else 20
    fi = peer("flashinfer")
    for heads in (16, 128):
        for batch in ((1, 64) if args.quick else (1, 64, 256)):
            for length in ((4096,) if args.quick else (4096, 32768)):
                pages_per = length // ps
                npages = batch * pages_per
                ckv = torch.randn(npages, ps, 512, device="cuda", dtype=torch.bfloat16)
                kpe = torch.randn(npages, ps, 64, device="cuda", dtype=torch.bfloat16)
                qn = torch.randn(batch, heads, 512, device="cuda", dtype=torch.bfloat16)
                qp = torch.randn(batch, heads, 64, device="cuda", dtype=torch.bfloat16)
                qo = torch.arange(batch + 1, dtype=torch.int32)
                indptr = torch.arange(0, npages + 1, pages_per, dtype=torch.int32)
                indices = torch.randperm(npages).to(torch.int32)
                lens = torch.full((batch,), length, dtype=torch.int32)
                minimum = batch * length * 576 * 2 + batch * heads * (576 + 512) * 2
                row: dict[str, Any] = {"what": "mla", "heads": heads, "batch": batch, "ctx": length, "page": ps,
                                       "min_bytes": minimum}
                try:
                    plan = MLAPagedDecodePlan(like=qn)
                    plan.plan(qo, indptr, indices, lens, heads, 512, 64, ps, False, sm, "bf16")
                    run = lambda: plan.run(qn, qp, ckv, kpe)  # noqa: E731
                    out = run().clone()
                    row["kernels"] = [k[0] for k in plan.launches()] if hasattr(plan, "launches") else None
                    order = indices.long().cuda().view(batch, pages_per)
                    cc, kc = ckv[order].reshape(batch, length, 512), kpe[order].reshape(batch, length, 64)

                    def torch_mla() -> torch.Tensor:
                        s_ = (qn @ cc.transpose(1, 2) + qp @ kc.transpose(1, 2)).float() * sm
                        return torch.softmax(s_, -1).to(torch.bfloat16) @ cc

                    if batch * length <= 64 * 4096:
                        s_ = (qn.float() @ cc.float().transpose(1, 2) + qp.float() @ kc.float().transpose(1, 2)) * sm
                        row["rel_err"] = rel(out.float(), torch.softmax(s_, -1) @ cc.float())
                    t = timed(run, reps, flush)
                    row["pykern_us"], row["pykern_GBps"] = t * 1e6, minimum / t / 1e9
                    row["pykern_host_us"] = host_overhead(run) * 1e6
                    tt = timed(torch_mla, reps, flush)
                    row["torch_us"], row["torch_GBps"] = tt * 1e6, minimum / tt / 1e9
                    del cc, kc
                    if fi is not None:
                        try:
                            if not _FI_WORKSPACE:
                                _FI_WORKSPACE.append(torch.empty(256 << 20, dtype=torch.uint8, device="cuda"))
                            w = fi.mla.BatchMLAPagedAttentionWrapper(_FI_WORKSPACE[0])
                            dev = [x.cuda() for x in (qo, indptr, indices, lens)]
                            w.plan(*dev, heads, 512, 64, ps, False, sm, torch.bfloat16, torch.bfloat16)
                            frun = lambda: w.run(query=(qn, qp), kv_cache=(ckv, kpe))  # noqa: E731
                            row["flashinfer_rel_err_vs_pykern"] = rel(_first(frun()).float(), out.float())
                            tf = timed(frun, reps, flush)
                            row["flashinfer_us"], row["flashinfer_GBps"] = tf * 1e6, minimum / tf / 1e9
                        except Exception as e:  # noqa: BLE001
                            row["flashinfer_error"] = f"{type(e).__name__}: {str(e)[:300]}"
                except Exception as e:  # noqa: BLE001
                    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                log(row)
                del ckv, kpe, qn, qp
                torch.cuda.empty_cache()


# --------------------------------------------------------------------------- a Llama-shaped model

MODEL_VARIANTS = ("unpatched", "pykern", "pykern_compile", "liger")   # liger last: it patches classes for good
MODELS = ("llama", "qwen3_moe")


def _model(name: str, variant: str, batch: int, seq: int) -> tuple[Any, Any, torch.Tensor, Any]:
    """(model, AdamW, input ids, module to call) of a random-weight bf16 model, seeded so every variant starts
    alike:

    - llama: hidden 2048, 8 layers, 16 heads / 8 kv heads, FFN 5632, vocabulary 32000;
    - qwen3_moe: a Qwen3-30B-A3B layer shape (hidden 2048, 32 heads / 4 kv heads, head_dim 128, QK-norm, 128
      experts of 768, top 8, renormalized) in 4 layers, vocabulary 32000.

    variant: unpatched (transformers as it is), pykern (pykern.torch.apply), pykern_compile (apply, then
    torch.compile of the model), liger (Liger's apply_liger_kernel_to_* before the model is built)."""
    import transformers

    from pykern.torch import apply

    if name == "llama":
        cfg = transformers.LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=8,
                                       num_attention_heads=16, num_key_value_heads=8, vocab_size=32000,
                                       max_position_embeddings=4096)
        cls = transformers.LlamaForCausalLM
    else:
        cfg = transformers.Qwen3MoeConfig(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                                          num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=4,
                                          head_dim=128, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                                          vocab_size=32000, max_position_embeddings=4096)
        cls = transformers.Qwen3MoeForCausalLM
    if variant == "liger":
        import liger_kernel.transformers as lk
        getattr(lk, f"apply_liger_kernel_to_{name}")()
    torch.manual_seed(0)
    m = cls(cfg).to("cuda", torch.bfloat16)
    if variant.startswith("pykern"):
        apply(m)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4, foreach=True)
    call = torch.compile(m) if variant == "pykern_compile" else m
    return m, opt, torch.randint(0, cfg.vocab_size, (batch, seq), device="cuda"), call


def _top_kernels(step: Callable[[], Any], n: int = 15) -> tuple[float, list[dict[str, Any]]]:
    """(kernel ms, the n kernels with the most GPU time) of one profiled step (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    ev = prof.key_averages()
    dev = "self_device_time_total" if hasattr(ev[0], "self_device_time_total") else "self_cuda_time_total"
    kernels = [e for e in ev if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
    top = sorted(kernels, key=lambda e: -getattr(e, dev))[:n]
    return (sum(getattr(e, dev) for e in kernels) / 1e3,
            [{"name": e.key[:120], "calls": e.count, "gpu_us": getattr(e, dev)} for e in top])


def model_step(args: argparse.Namespace) -> None:
    """One training step (forward, backward, AdamW) of each model in each variant: tokens/s over 5 steps after 2
    warm-up steps (torch.compile compiles in the first), peak memory, the first loss, the top kernels of one
    profiled step; for the dense model also greedy decode at batch 1 (not under torch.compile)."""
    seq = 2048
    for name in args.models or MODELS:
        batch = 4 if name == "llama" else 2
        for variant in args.variants or MODEL_VARIANTS:
            row: dict[str, Any] = {"what": "model", "model": name, "variant": variant,
                                   "patched": variant.startswith("pykern"), "batch": batch, "seq": seq}
            try:
                m, opt, ids, call = _model(name, variant, batch, seq)

                def step() -> Any:
                    loss = call(input_ids=ids, labels=ids).loss
                    loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    return loss

                m.train()
                t0 = time.perf_counter()
                row["first_loss"] = float(step())
                step()
                torch.cuda.synchronize()
                row["warmup_s"] = time.perf_counter() - t0
                torch.cuda.reset_peak_memory_stats()
                t0 = time.perf_counter()
                for _ in range(5):
                    step()
                torch.cuda.synchronize()
                t = (time.perf_counter() - t0) / 5
                row.update({"train_tokens_per_s": batch * seq / t, "train_step_ms": t * 1e3,
                            "peak_GiB": torch.cuda.max_memory_allocated() / 2**30})
                row["kernel_ms_per_step"], row["top_kernels"] = _top_kernels(step)
                if name == "llama" and variant != "pykern_compile":
                    m.eval()
                    prompt = ids[:1, :512]
                    with torch.no_grad():
                        m.generate(prompt, max_new_tokens=4, do_sample=False)  # warm-up
                        torch.cuda.synchronize()
                        t1 = time.perf_counter()
                        out = m.generate(prompt, max_new_tokens=64, do_sample=False, min_new_tokens=64)
                        torch.cuda.synchronize()
                    row["decode_ms_per_token_b1"] = (time.perf_counter() - t1) / 64 * 1e3
                    row["greedy_tail"] = out[0, -8:].tolist()
                del m, opt, call
            except Exception as e:  # noqa: BLE001 - one failing variant must not stop the others
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            log(row)
            torch.cuda.empty_cache()


def model_profile(args: argparse.Namespace) -> None:
    """Where a training step of model_step's Llama spends its GPU time, patched and not: torch.profiler over two
    steps after two warm-up steps; the ops with the most self GPU time, the step's wall time and its kernels' time."""
    from torch.profiler import ProfilerActivity, profile

    seq, batch, steps = 2048, 4, 2
    for patched in (False, True):
        m, opt, ids, _ = _model("llama", "pykern" if patched else "unpatched", batch, seq)
        m.train()

        def step() -> None:
            m(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        for _ in range(2):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            for _ in range(steps):
                step()
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) / steps
        ev = prof.key_averages()
        dev = "self_device_time_total" if hasattr(ev[0], "self_device_time_total") else "self_cuda_time_total"
        top = sorted(ev, key=lambda e: -getattr(e, dev))[:30]
        # kernels alone: an op's self device time is its kernels' time again
        kernels = [e for e in ev if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
        gpu = sum(getattr(e, dev) for e in kernels) / steps
        print(f"--- patched={patched}: wall {wall * 1e3:.1f} ms a step (profiled), kernel time {gpu / 1e3:.1f} ms")
        print(ev.table(sort_by=dev, row_limit=30, max_name_column_width=70))
        log({"what": "model_profile", "patched": patched, "wall_ms_per_step": wall * 1e3,
             "kernel_ms_per_step": gpu / 1e3,
             "top": [{"name": e.key, "calls_per_step": e.count / steps,
                      "self_gpu_us_per_step": getattr(e, dev) / steps,
                      "cpu_us_per_step": e.cpu_time_total / steps} for e in top]})
        del m, opt, prof
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------- one shape each, for ncu

def profile_target(args: argparse.Namespace) -> None:
    from pykern.ops.serving import PagedDecodePlan
    from pykern.torch import flash_attention

    if args.sampling:  # each sampling op once on one row of Llama-3's vocabulary
        from pykern import ops

        probs = torch.softmax(torch.randn(1, 128256, device="cuda") * 3, dim=-1)
        ops.sampling_from_probs(probs, seed=1)
        ops.top_k_sampling_from_probs(probs, 50, seed=1)
        ops.top_p_sampling_from_probs(probs, 0.9, seed=1)
        ops.top_k_top_p_sampling_from_probs(probs, 50, 0.9, seed=1)
        ops.top_k_renorm_probs(probs, 50)
        ops.top_p_renorm_probs(probs, 0.9)
        torch.cuda.synchronize()
        return
    if args.mma_sync:  # the sm_80 (mma.sync) kernels on this Hopper GPU
        os.environ["PYKERN_SM90"] = "0"
    for d in () if args.decode_only else (64, 128):
        q, k, v = (torch.randn(2, 8192, 2048 // d, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        o = flash_attention(q, k, v, causal=False)
        o.backward(torch.randn_like(o))
    torch.cuda.synchronize()
    b, g, kvh, d, ps, L = args.decode_shape
    q, kp, vp, indptr, idx, last = paged_case(b, g, kvh, d, ps, L)
    for kv in ("bf16", "float8_e4m3fn"):  # one launch of each cache dtype's decode kernel
        if kv != "bf16":
            kp, vp = kp.to(torch.float8_e4m3fn), vp.to(torch.float8_e4m3fn)
        plan = PagedDecodePlan(b, kvh * g, kvh, d, ps, q_dtype="bf16", kv_dtype=kv, max_kv_len=L, like=q)
        plan.run(q, kp, vp, indptr, idx, last)
    torch.cuda.synchronize()


def attention_label(r: dict[str, Any]) -> str:
    """dtype, head dims (d192/128 where v's differs), mask and sequence of an attention row; a row without "dtype"
    (written before f16 was measured) is bf16."""
    dims = f"d{r['d']}" + (f"/{r['dv']}" if r.get("dv", r["d"]) != r["d"] else "")
    return f"{r.get('dtype', 'bf16'):4s} {dims:8s} {'causal' if r['causal'] else 'full  '} {r['seq']:>6d}"


def versus_best_peer(r: dict[str, Any]) -> str:
    """pykern's TFLOP/s over the best peer's that ran in this row, forward and forward + backward, the peer named
    ('-' where pykern or every peer failed or was not timed)."""
    out = []
    for w in ("fwd", "fwdbwd"):
        mine = r.get("pykern", {}).get(f"{w}_tflops")
        peers = [(r[p][f"{w}_tflops"], p) for p in ATTN_PEERS if f"{w}_tflops" in r.get(p, {})]
        if mine is None or not peers:
            out.append(f"{w} -")
            continue
        best, name = max(peers)
        out.append(f"{w} {mine / best:.2f}x {name}")
    return " | ".join(out)


def summary(files: list[str]) -> None:
    """Compact tables of the rows in measure JSON files."""
    rows = [r for f in files if os.path.exists(f) for r in json.load(open(f))]
    for r in rows:
        if r["what"] in ("device", "copy", "gemm_bf16", "launch_floor"):
            print(json.dumps(r))
    print("attention TFLOP/s fwd | fwd+bwd (rel err of fwd vs the row's first implementation) h host us; "
          "then pykern / the best peer that ran (" + ", ".join(ATTN_PEERS) + "), fwd and fwd+bwd")
    names = ("pykern", "pykern_mma_sync", "pykern_deterministic", "pykern_fp8", "sdpa_flash", "sdpa_cudnn",
             "sdpa_cudnn_fp8", "fa4", "flashinfer")
    for r in (r for r in rows if r["what"] == "attention"):
        cells = []
        for n in names:
            c = r.get(n, {})
            cells.append(f"{c['fwd_tflops']:5.0f}|{c.get('fwdbwd_tflops', float('nan')):4.0f}"
                         f"({c['rel_err_vs_first']:.0e})h{c.get('host_us', 0):.0f}"
                         if "fwd_tflops" in c else f"{'ERR' if 'error' in c else '-':>17s}")
        print(f"{attention_label(r)}  " + "  ".join(cells) + "  " + versus_best_peer(r))
    print(f"{'':27s}" + "  ".join(f"{n:>17s}" for n in names))
    print("decode GB/s (min bytes / median GPU time): pykern | sdpa | flashinfer; host us a call; rel err, "
          "identical over 20 runs")
    for r in rows:
        if r["what"] in ("model", "decode_graph"):
            print(json.dumps(r))
    for r in (r for r in rows if r["what"] == "decode"):
        if "error" in r:
            print(f"{r['kv']:5s} g{r['gqa']} b{r['batch']:<3d} {r['ctx']:>6d} ERROR {r['error']}")
            continue
        print(f"{r['kv']:5s} g{r['gqa']} b{r['batch']:<3d} {r['ctx']:>6d} {r['pykern_us']:9.1f}us "
              f"{r['pykern_GBps']:7.0f} | {r.get('sdpa_GBps', float('nan')):7.0f} | "
              f"{r.get('flashinfer_GBps', float('nan')):7.0f}  host "
              f"{r.get('pykern_host_us', float('nan')):5.0f}|{r.get('sdpa_host_us', float('nan')):4.0f}us "
              f"{r.get('rel_err', float('nan')):.1e} {r.get('identical_20_runs')}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("ceilings", "attention", "decode", "decode-graph", "sampling", "mla", "model",
                                     "model-profile", "all", "profile-target", "summary"))
    ap.add_argument("files", nargs="*", help="summary: measure JSON files")
    ap.add_argument("--quick", action="store_true", help="fewer and smaller shapes, fewer repeats")
    ap.add_argument("--d256", action="store_true", help="attention: head_dim 256 too (as --dims 64 128 256)")
    ap.add_argument("--dims", type=parse_dim, nargs="+", metavar="D[/DV]",
                    help="attention: these head dims, most wanted first (default 64 128); D/DV: q and k's head dim "
                         "D, v's DV (192/128: DeepSeek-V3's prefill)")
    ap.add_argument("--extra-dims", type=parse_dim, nargs="+", metavar="D[/DV]",
                    help="attention: head dims timed after every other row, first dtype only, pykern and the peers")
    ap.add_argument("--dtypes", nargs="+", choices=ATTN_DTYPES, help="attention: these dtypes, in order (default "
                    "bf16); rows of a dtype other than bf16 time pykern's sm_90a path and the peers only")
    ap.add_argument("--seqs", type=int, nargs="+", help="attention: these sequence lengths (default 1024 4096 16384)")
    ap.add_argument("--fwd-only", action="store_true",
                    help="attention: time the forward alone (no backward, no FA4 backward compiles)")
    ap.add_argument("--list", action="store_true",
                    help="attention: print the planned rows and their modelled seconds, measure nothing (no GPU)")
    ap.add_argument("--json", metavar="FILE", help="also write every row to FILE")
    ap.add_argument("--decode-only", action="store_true", help="profile-target: only the decode launches")
    ap.add_argument("--mma-sync", action="store_true", help="profile-target: the mma.sync attention kernels")
    ap.add_argument("--sampling", action="store_true", help="profile-target: only each sampling op once at batch 1")
    ap.add_argument("--batches", type=int, nargs="+", help="decode, decode-graph: these batch sizes only")
    ap.add_argument("--lengths", type=int, nargs="+", help="decode, decode-graph: these context lengths only")
    ap.add_argument("--layers", type=int, help="decode-graph: layers a step (default 32; 8 with --quick)")
    ap.add_argument("--gqa", type=int, nargs="+", help="decode: these GQA group sizes only")
    ap.add_argument("--kv", nargs="+", choices=("bf16", "e4m3"), help="decode: these KV cache types only")
    ap.add_argument("--splits", type=int, nargs="+", help="decode: also time each step at these split counts")
    ap.add_argument("--models", nargs="+", choices=MODELS, help="model: these models only (default: all)")
    ap.add_argument("--variants", nargs="+", choices=MODEL_VARIANTS,
                    help="model: these variants only, in this order (default: all; liger last, as it patches "
                         "transformers' classes for the rest of the process)")
    ap.add_argument("--pdl", action="store_true",
                    help=f"decode: also time chains of {PDL_LAYERS} steps (one a layer, each over its own cache) "
                         "with and without programmatic dependent launch (enable_pdl); sm_90+")
    ap.add_argument("--decode-shape", type=int, nargs=6, default=(8, 4, 8, 128, 16, 32768),
                    metavar=("BATCH", "GQA", "KV_HEADS", "HEAD_DIM", "PAGE", "CTX"), help="profile-target's decode")
    args = ap.parse_args(argv)
    if args.what == "summary":
        summary(args.files)
        return 0
    if args.list:
        if args.what != "attention":
            ap.error("--list: attention only")
        attention_list(args)
        return 0
    if not torch.cuda.is_available():
        print("needs a CUDA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 3
    steps = {"ceilings": [ceilings], "attention": [attention], "decode": [decode], "decode-graph": [decode_graph],
             "sampling": [sampling],
             "mla": [mla], "model": [model_step], "model-profile": [model_profile],
             "all": [ceilings, attention, decode, decode_graph, sampling, mla, model_step],
             "profile-target": [profile_target]}[args.what]
    global JSON_OUT
    JSON_OUT = args.json
    try:
        for step in steps:
            step(args)
    finally:
        if args.json:
            write_rows(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
