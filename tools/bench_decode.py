"""Decode-attention report and benchmark: contiguous and paged decode steps.

    python tools/bench_decode.py                        # model: every method x LLaMA-8B/70B x batch x length
    python tools/bench_decode.py --resources            # also ptxas registers/spills of the kernels per arch
    python tools/bench_decode.py --time --dtype bf16    # also time each method on the GPU (needs torch + CUDA)
    python tools/bench_decode.py --roofline             # roofline of paged decode from OUR SASS (no GPU)
    python tools/bench_decode.py --roofline --kv bf16 e4m3 --summary   # only the old-vs-new table

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

import pykern.ops._decode_waves as _waves  # noqa: E402
from pykern.ops.decode import decode_plan  # noqa: E402
from pykern.ops.serving import TC_DECODE_MAX_GROUP, TC_DECODE_MIN_GROUP, PagedDecodePlan  # noqa: E402

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
    partials = 2 * splits * batch * heads * (head_dim + 1) * 4 if splits > 1 else 0  # write + read back
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


# --------------------------------------------------------------------------- roofline from our SASS
# H100 SXM: 132 SMs, 3.35 TB/s, 4 warp schedulers an SM issuing one warp-instruction a cycle each,
# at 1.755 GHz (sustained boost); HBM latency 700 ns (the middle of 600-800 ns); 228 KiB shared an SM.
# Nothing here is calibrated from a measured speed: the per-CTA instruction counts are the kernel's own
# SASS loop bodies (tools/sass_report.py inner_loops), the bytes the plan's.
CLOCK = 1.755e9
ISSUE = 4
HBM_LAT = 700e-9
SMEM_SM = 228 * 1024
KV_ELEM = {"bf16": 2, "e4m3": 1}
# Published rates of the GPUs the roofline can model (same GH100 SM and SM count; the clock is the published boost
# of the H200, the model's historical 1.755 GHz for the H100). set_gpu rebinds the module's rates.
GPU_NAME = "H100"
GPUS = {"h100": {"sms": 132, "bw": 3.35e12, "clock": 1.755e9},
        "h200": {"sms": 132, "bw": 4.8e12, "clock": 1.98e9}}


def set_gpu(name: str) -> None:
    """Model `name` (a GPUS key): rebinds H100_SMS / H100_BW / CLOCK and the rates derived from them."""
    global H100_SMS, H100_BW, CLOCK, TENSOR_SM, SMEM_BW
    g = GPUS[name]
    global GPU_NAME
    GPU_NAME = name.upper()
    H100_SMS, H100_BW, CLOCK = g["sms"], g["bw"], g["clock"]
    TENSOR_SM = 990e12 * 2 / 3 / H100_SMS
    SMEM_BW = 128 * CLOCK
GQA = (1, 4, 8)
RF_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
RF_LENGTHS = (1024, 4096, 16384, 32768)


def sass_costs(kernel: str, arch: str = "sm_90") -> dict[str, Any]:
    """Warp-instructions of the tile kernel's pieces, read from its SASS:
    fill: per 16-byte K+V chunk pair (the cp.async loop's body / its LDGSTS pairs);
    score: per 16-byte K chunk of one (row, position) dot product (LDS.128 loop body / its LDS.128);
    pv: per (output, position) FMA (the P V loop body / its FFMAs, the unrolled copy with the most FFMAs);
    tile: straight-line instructions of the tile loop outside its innermost loops, per warp and tile
    (all of it counted as executed: an upper bound, the unrolled accumulator guards included);
    registers (occupancy)."""
    import importlib.util

    from pykern import cache
    from pykern.registry import source_files

    spec = importlib.util.spec_from_file_location("pk_sass_report_bd", ROOT / "tools" / "sass_report.py")
    sr = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sr)
    src = next(s for s in source_files() if s.name == "paged.cu")
    mod = cache.get_module(src, arch)
    text = sr.disassemble(mod.image)
    loops = sr.inner_loops(text)[kernel]
    outer = sr.inner_loops(text, innermost=False)[kernel]

    def ops(r: dict, prefix: str) -> int:
        return sum(v for k, v in r["ops"].items() if k.startswith(prefix))

    fill = max((r for r in loops if ops(r, "LDGSTS")), key=lambda r: ops(r, "LDGSTS"))
    score = max((r for r in loops if ops(r, "LDS.128") and ops(r, "FFMA")), key=lambda r: ops(r, "FFMA"))
    pv = max((r for r in loops if ops(r, "FFMA") and not ops(r, "LDS.128") and r is not score),
             key=lambda r: ops(r, "FFMA"))
    tile = max(outer, key=lambda r: r["bar"])
    # The P V block is unrolled PA_MAX_ACC times (one per accumulator, guarded by i < nout): the
    # straight-line code of one copy is the gap between consecutive copies' main loops less the loop
    # bodies in it (16-byte SASS instructions); only the copies a row chunk uses run.
    mains = sorted(int(r["start"], 16) for r in loops if ops(r, "FFMA") == ops(pv, "FFMA") and r is not score)
    per_k = 0.0
    if len(mains) > 1:
        gaps = []
        for a, b in zip(mains, mains[1:]):
            inside = sum(r["insns"] for r in loops if a <= int(r["start"], 16) < b)
            gaps.append((b - a) // 16 - inside)
        per_k = sorted(gaps)[len(gaps) // 2]
    return {"fill": fill["insns"] / (ops(fill, "LDGSTS") / 2), "score": score["insns"] / ops(score, "LDS.128"),
            "pv": pv["insns"] / ops(pv, "FFMA"), "tile": tile["insns"] - tile["inner"], "per_k": per_k,
            "copies": len(mains), "registers": mod.resources[kernel].registers}


def roofline_row(batch: int, group: int, length: int, kv: str, costs: dict[str, Any], kv_heads: int = 8,
                 head_dim: int = 128, page_size: int = 16) -> dict[str, Any]:
    """Modelled H100 time of one paged decode step (bf16 q/out) and its binding term."""
    from pykern.ops.serving import PA_STAGES

    heads = kv_heads * group
    kvd = "bf16" if kv == "bf16" else "float8_e4m3fn"
    plan = PagedDecodePlan(batch, heads, kv_heads, head_dim, page_size, max_kv_len=length, q_dtype="bf16",
                           kv_dtype=kvd, tensor_cores=False)
    eb = KV_ELEM[kv]
    ctas = math.prod(plan.launches()[0][1])
    per_cta_pos = -(-length // plan.num_splits)
    T, R = plan.tile, plan.rows
    tiles = -(-per_cta_pos // T)
    nch = head_dim * eb // 16
    nout = min(R, group) * head_dim
    warps = _NT_WARPS
    # warp-instructions a CTA issues
    fill = warps * -(-T * nch // (32 * warps)) * costs["fill"]
    score = -(-R * T // 32) * nch * costs["score"]
    pv = -(-nout // 32) * T * costs["pv"]
    # straight-line code a warp runs a tile: all of it less the accumulator copies this chunk skips
    active_k = -(-nout // (32 * warps))
    straight = costs["tile"] - max(0, costs["copies"] - active_k) * costs["per_k"]
    per_cta = tiles * (fill + score + pv + warps * straight)
    per_cta_lo = tiles * (fill + score + pv)  # no straight-line code: the issue term's lower bound
    # bytes
    kv_min = 2 * batch * kv_heads * length * head_dim * eb
    qo = 2 * batch * heads * head_dim * 2
    table = batch * (-(-length // page_size)) * 4 * plan.row_chunks
    partials = 2 * plan.num_splits * batch * heads * (head_dim + 1) * 4 if plan.num_splits > 1 else 0
    read = kv_min * plan.row_chunks + qo + table + partials
    # occupancy: CTAs an SM by registers (rounded to 8 a thread, 256 a warp) and shared memory
    regs = -(-costs["registers"] // 8) * 8
    occ = max(1, min(65536 // (regs * 32 * warps), SMEM_SM // (plan.smem + 1024), 32))
    resident = min(occ, -(-ctas // H100_SMS))  # CTAs an SM holds at once
    waves = -(-ctas // (H100_SMS * occ))
    active_sms = min(H100_SMS, ctas)
    t_hbm = read / H100_BW
    t_issue = waves * resident * per_cta / (ISSUE * CLOCK)
    t_issue_lo = waves * resident * per_cta_lo / (ISSUE * CLOCK)
    # Little's law: an SM needs BW/SMs * latency bytes in flight; the ring keeps (stages - 1) tiles a CTA
    need = H100_BW / H100_SMS * HBM_LAT
    have = resident * (PA_STAGES - 1) * T * 2 * head_dim * eb
    bw_lat = min(H100_BW / H100_SMS, have / HBM_LAT) * active_sms
    t_lat = read / bw_lat
    launch = LAUNCH_S * (len(plan.launches()) - 1)
    terms = {"HBM": t_hbm, "issue": t_issue, "latency": t_lat}
    bind = max(terms, key=terms.get)
    t = terms[bind] + launch
    return {"ctas": ctas, "splits": plan.num_splits, "tile": T, "rows": R, "occ": occ, "need_kb": need / 1024,
            "have_kb": have / 1024, "x_min": read / (kv_min + qo), "t_hbm": t_hbm, "t_issue": t_issue,
            "t_lat": t_lat, "t": t, "bind": bind, "pct": 100 * (kv_min + qo) / t / H100_BW,
            "t_issue_lo": t_issue_lo,
            "pct_hi": 100 * (kv_min + qo) / (max(t_hbm, t_issue_lo, t_lat) + launch) / H100_BW}


_NT_WARPS = 4  # PA_NT / 32

# --------------------------------------------------------------------------- the tensor-core path
# kernels_cu/decode_tc.cu: a CTA of 4 warps per (sequence, kv head, split); every warp runs the whole tile
# loop body (fill of its share of 64 keys, 32 HMMAs at d128, softmax) once a 64-key tile. Its issue is
# read from the SASS as the tile loop's instructions (steady_state_loops: the loop with the MMAs, no inner
# loop; the refill and its zero-fill branch both counted: an upper bound) and the straight-line rest of
# the kernel (prologue, Q load, the cross-warp merge: counted once a warp, all of it), less the split fixup
# (the merge after the ticket), which only a group's last split CTA runs: it is the tail term.
TC_BC = 64
# Conversions an SM a clock: the CUDA C++ Programming Guide's arithmetic-instruction throughput table, compute
# capability 8.x and 9.0, "all other type conversions": 16 results (a warp-instruction every 2 clocks an SM,
# against 4 issue slots a clock). Which SASS opcodes run at that rate is not published: F2FP (cvt of 16-bit and
# FP8 pairs) is counted as a conversion ('cvt lo'), and so is HADD2.F32 (ptxas's cvt.f32.f16) in 'cvt'.
CVT_RATE = 16
MMA_FLOPS = 2 * 16 * 8 * 16  # one m16n8k16
TENSOR_SM = 990e12 * 2 / 3 / H100_SMS  # mma.sync at about 2/3 of the dense bf16 peak, per SM (docs/design.md)
SMEM_BW = 128 * CLOCK  # bytes/s an SM


def tc_sass_costs(kernel: str = "decode_tc_paged_d128_bf16", arch: str = "sm_90") -> dict[str, Any]:
    """Warp-instructions of the tensor-core decode kernel from its SASS: loop (the tile loop body, a warp,
    a tile), rest (everything else in the kernel, a warp, once), mma (m16n8k16 a warp a tile), registers."""
    import importlib.util

    from pykern import cache
    from pykern.registry import source_files

    spec = importlib.util.spec_from_file_location("pk_sass_report_bdtc", ROOT / "tools" / "sass_report.py")
    sr = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sr)
    src = next(s for s in source_files() if s.name == "decode_tc.cu")
    mod = cache.get_module(src, arch)
    text = sr.disassemble(mod.image)
    loop = sr.steady_state_loops(text)[kernel]
    total = sr.count_sass(text)[kernel]["total"]
    # The split fixup: the merge only the last split CTA of a group runs, i.e. the code the first conditional
    # forward branch after the ticket (ATOMG) jumps over (the CTAs that did not draw the last ticket go on to
    # their next work item); the rest runs in every CTA.
    ins = [(a, op, raw) for a, op, _, raw in sr._instructions(text)[kernel] if op != "NOP"]
    at = next((i for i, (_, op, _) in enumerate(ins) if op.startswith("ATOMG")), None)
    fixup = fixup_loop = 0
    if at is not None:
        i = next(j for j in range(at, len(ins)) if ins[j][1] == "BRA" and ins[j][2].lstrip().startswith("@")
                 and int(sr._BRA.search(ins[j][2]).group(1), 16) > ins[j][0])
        lo, hi = ins[i][0], int(sr._BRA.search(ins[i][2]).group(1), 16)
        fixup = sum(1 for a, _, _ in ins if lo < a < hi)
        # the merge's partial-load loop (pa_merge_group_cta): the innermost loop in it with the most 16-byte
        # strong loads
        body = [r for r in sr.inner_loops(text)[kernel] if lo < int(r["start"], 16) < hi]
        ld = [(sum(n for o, n in r["ops"].items() if o.startswith("LDG") and ".128" in o), r["insns"]) for r in body]
        fixup_loop = max(ld)[1] if ld and max(ld)[0] else 0
    fill_pro, refill, fill_next = tc_guarded_fills(sr, text, kernel, loop)
    # Out of line after the last EXIT: the paths a diverged warp's shuffles take (BRA.DIV), which the fill's
    # converged warps never run; not counted.
    last_exit = max(i for i, (_, op, _) in enumerate(ins) if op == "EXIT")
    ool = len(ins) - last_exit - 1
    # Conversions in the tile loop (a warp, a tile): F2FP (cvt to / from 16-bit and FP8 pairs), F2F / I2F / F2I,
    # and HADD2.F32 (ptxas's cvt.f32.f16: an f16 half widened to fp32), each counted once.
    lo, hi = int(loop["start"], 16), int(loop["end"], 16)
    body = [(op, raw) for a, op, _, raw in sr._instructions(text)[kernel] if lo <= a <= hi and op != "NOP"]
    f2fp = sum(1 for op, _ in body if op in ("F2FP", "F2F", "I2F", "F2I"))
    hadd_f32 = sum(1 for op, raw in body if op == "HADD2" and "HADD2.F32" in raw)
    return {"loop": loop["insns"], "cvt_f2fp": f2fp, "cvt_hadd2_f32": hadd_f32,
            "rest": total - loop["insns"] - fixup - ool, "fixup": fixup, "fixup_loop": fixup_loop, "ool": ool,
            "mma": loop["mma"], "ldgsts": loop["ldgsts"], "registers": mod.resources[kernel].registers,
            "fill_pro": fill_pro, "refill": refill, "fill_next": fill_next, "kernel": kernel}


def tc_guarded_fills(sr: Any, text: str, kernel: str, loop: dict[str, Any]) -> tuple[list[int], int, list[int]]:
    """The ring fills of decode_tc that a CTA runs only when it has the tile, read from the SASS as the
    instructions a branch skips: a forward conditional BRA over a range that holds the fill's LDGSTS (every
    branch inside it lands inside it or at its end) and lands before the LDGDEPBAR of the commit that follows
    `if (t0 < end) dtc_fill(...)` (no copy, barrier or branch between: what the compiler scheduled there runs
    either way). Before the tile loop these are the prologue fills, in order (fill s runs iff s < the CTA's
    tiles); inside it the refill of tile i + STAGES - 1 (runs iff i + STAGES - 1 < tiles); after it the next
    work item's first fills (a persistent CTA's; none after its last item). A skipped range is exactly what
    does not run when its condition fails. Returns (prologue fill sizes, refill size, next-item fill sizes)."""
    ins = [x for x in sr._instructions(text)[kernel] if x[1] != "NOP"]
    lo, hi = int(loop["start"], 16), int(loop["end"], 16)
    pro: list[int] = []
    refill: list[int] = []
    nxt: list[int] = []
    for i, (a, op, _m, raw) in enumerate(ins):
        if op != "BRA" or not raw.lstrip().startswith("@"):
            continue
        tgt = int(sr._BRA.search(raw).group(1), 16)
        if tgt <= a:
            continue
        region = [x for x in ins[i + 1:] if x[0] < tgt]
        if not any(x[1] == "LDGSTS" for x in region):
            continue
        # (BRA.DIV: the out-of-line path of a shuffle reached by a diverged warp, never taken by the converged
        # warps here: the fill's condition is the same for the whole CTA)
        inner = [int(sr._BRA.search(x[3]).group(1), 16) for x in region if x[1] == "BRA" and x[2] != ".DIV"]
        if any(not (a < t <= tgt) for t in inner):
            continue
        after = [x for x in ins if x[0] >= tgt]
        k = next((j for j, x in enumerate(after) if x[1] == "LDGDEPBAR"), None)
        if k is None or any(x[1] in ("BRA", "LDGSTS", "BAR", "EXIT") for x in after[:k]):
            continue
        (pro if a < lo else refill if a <= hi else nxt).append(len(region))
    if len(refill) != 1 or not pro or len(nxt) != len(pro):
        raise RuntimeError(f"{kernel}: guarded fills not found as expected (prologue {pro}, refill {refill}, "
                           f"next item {nxt})")
    return pro, refill[0], nxt


# pa_merge_group_cta (kernels_cu/pk_attn_tile.cuh): the constants of the whole-CTA merge of a group's splits.
TC_THREADS = 128  # DTC_THREADS


def tc_tail_round_trips(splits: int, group: int, head_dim: int) -> tuple[int, int]:
    """Dependent global round trips of decode_tc's split tail as the code makes them, and the passes of the
    merge's partial-load loop: the ticket's release (an atom.acq_rel.gpu after a barrier: its MEMBAR waits for
    the CTA's partial stores to be acknowledged), the ticket atomic itself (its acquire is a local L1
    invalidate, no round trip), then the partial rounds of thread 0 (the most loaded): its units (8 elements
    of a row's partial o, stored in the output's 16-bit type; P threads share one when the group has fewer
    units than threads, P the largest power of two with P * next_pow2(units) <= 128) one by one, its splits
    head_dim / 8 at a time, each split's lse and 16-byte piece of o loaded in the same round. (0, 0)
    unsplit."""
    if splits <= 1:
        return 0, 0
    units = group * head_dim // 8
    share = 1 if units >= TC_THREADS else TC_THREADS // (1 << (units - 1).bit_length())
    nk = 1 if share > 1 else -(-units // TC_THREADS)
    nb = head_dim // 8  # PA_CM_NB(D)
    passes = nk * -(-(-(-splits // share)) // nb)
    return 2 + passes, passes


def tc_roofline_row(batch: int, group: int, length: int, kv: str, costs: dict[str, Any], kv_heads: int = 8,
                    head_dim: int = 128, page_size: int = 16) -> dict[str, Any]:
    """Modelled H100 time of one paged decode step on the tensor-core kernel (bf16 q; bf16 or e4m3 K/V, the
    costs of that kernel) and its binding term (HBM, issue, latency, tensor, smem, launch)."""
    from pykern.ops.serving import dtc_inflight_bytes, dtc_smem_bytes, dtc_stages

    heads = kv_heads * group
    plan = PagedDecodePlan(batch, heads, kv_heads, head_dim, page_size, max_kv_len=length, q_dtype="bf16",
                           kv_dtype="bf16" if kv == "bf16" else "float8_e4m3fn")
    assert plan.tensor_cores, (group, head_dim)
    eb = KV_ELEM[kv]
    stages = dtc_stages(head_dim, eb)
    ctas = math.prod(plan.launches()[0][1])
    # A persistent grid (items_per_cta k > 1: one wave) runs k items a CTA: the per-CTA work below is k items'.
    k = plan.items_per_cta
    items = batch * kv_heads * plan.num_splits
    per_cta_pos = -(-length // plan.num_splits)
    tiles = -(-per_cta_pos // TC_BC)
    warps = _NT_WARPS
    # A warp's instructions a CTA: the tile loop once a tile and the rest once, less the fills a CTA of this
    # many tiles skips (tc_guarded_fills, exact: the ranges their branches jump over): prologue fills s >= tiles
    # and the loop's refill in its last STAGES - 1 iterations. The rest of the kernel is counted as written
    # (both sides of its other branches: an upper bound).
    pro = costs["fill_pro"]
    assert len(pro) == stages - 1, (pro, stages)
    skipped = sum(pro[min(tiles, len(pro)):]) + min(tiles, stages - 1) * costs["refill"]
    # the next item's first fills: an item followed by another runs those its tiles need, the CTA's last none
    nxt = costs["fill_next"]
    skipped_next = (k - 1) * sum(nxt[min(tiles, len(nxt)):]) + sum(nxt)
    per_cta = warps * (k * (tiles * costs["loop"] + costs["rest"] - skipped) - skipped_next)
    per_cta_lo = k * warps * (tiles * costs["loop"] - min(tiles, stages - 1) * costs["refill"])
    kv_min = 2 * batch * kv_heads * length * head_dim * eb
    qo = 2 * batch * heads * head_dim * 2
    table = batch * (-(-length // page_size)) * 4
    # Split partials (o in the output's type, bf16 here: 2 bytes an element; lse fp32: 4): the streaming phase
    # counts their WRITE only, by every split CTA as HBM bytes (no L2 residency assumed). Their read-back
    # happens only in the merge, after the ticket, in the tail: its rounds are priced below as round trips
    # plus issue (tc_tail_round_trips), so counting those reads here as well would count them twice.
    partials = plan.num_splits * batch * heads * (head_dim * 2 + 4) if plan.num_splits > 1 else 0
    read = kv_min + qo + table + partials
    regs = -(-costs["registers"] // 8) * 8
    smem = dtc_smem_bytes(head_dim, eb)
    occ = max(1, min(65536 // (regs * 32 * warps), SMEM_SM // (smem + 1024), 32))
    resident = min(occ, -(-ctas // H100_SMS))
    waves = -(-ctas // (H100_SMS * occ))
    t_hbm = read / H100_BW
    t_issue = waves * resident * per_cta / (ISSUE * CLOCK)
    t_issue_lo = waves * resident * per_cta_lo / (ISSUE * CLOCK)
    # tensor pipe: every warp's HMMAs of a tile; shared memory: the tile written once (cp.async) and read
    # once by ldmatrix (each warp its 16 keys of K and V); FP8 reads K's and V's bytes straight from the ring
    # too (V by ldmatrix.trans of byte pairs, no 16-bit V tile written and read back)
    t_tensor = waves * resident * warps * k * tiles * costs["mma"] * MMA_FLOPS / TENSOR_SM
    per_tile = 2 * (TC_BC * 2 * head_dim * eb)
    t_smem = waves * resident * k * tiles * per_tile / SMEM_BW
    # conversion pipe (CVT_RATE): every warp's conversions of a tile (F2FP and HADD2.F32; cvt lo: F2FP only)
    cvt_warp = waves * resident * warps * k * tiles * 32 / (CVT_RATE * CLOCK)
    t_cvt = cvt_warp * (costs["cvt_f2fp"] + costs["cvt_hadd2_f32"])
    t_cvt_lo = cvt_warp * costs["cvt_f2fp"]
    # Latency: the grid in waves, each CTA streaming at most at the rate its ring's bytes in flight give, the rate
    # measured on this kernel (pykern/ops/_decode_waves.py, the model the plan's split count comes from).
    inflight = dtc_inflight_bytes(head_dim, eb, tiles)
    have = resident * inflight
    # Each wave's fixed time (the ring's fill, the last tile, the stores) adds to whichever term binds: it is
    # the same whether the waves saturate HBM or not, so it is kept apart (t_wave) and the latency term is the
    # waves' streaming alone.
    # A persistent grid pays one wave's fixed time and an item switch between its items (_decode_waves).
    t_wave = _waves.fixed_waves(ctas, H100_SMS * occ) * _waves.WAVE_START_S + (k - 1) * _waves.ITEM_SWITCH_S
    t_lat = _waves.waves_streaming_time(ctas, H100_SMS * occ, k * read / items, _waves.cta_rate(inflight), H100_BW)
    t_lat = t_hbm if t_lat <= t_hbm * (1 + 1e-9) else t_lat  # every wave saturates: HBM binds (no rounding tie)
    launch = LAUNCH_S * (len(plan.launches()) - 1)  # 0: the splits merge in the same launch
    terms = {"HBM": t_hbm, "issue": t_issue, "latency": t_lat, "tensor": t_tensor, "smem": t_smem, "cvt": t_cvt}
    bind = max(terms, key=terms.get)
    t = terms[bind] + launch + t_wave
    if launch > terms[bind]:
        bind = "launch"
    # The split fixup's tail: after the last split of a group has streamed its keys, its CTA runs a chain of
    # dependent global round trips no other work overlaps (tc_tail_round_trips: the ticket's release, the
    # ticket, then the whole CTA's merge, pa_merge_group_cta, lse and o loaded in the same rounds). Priced at
    # HBM_LAT each: an upper bound (atomics, fences and just-written lines are served by L2, whose latency
    # the model has no published figure for). Reported beside the bound, not folded into it. Plus the
    # merge's own issue a warp: its SASS once (costs["fixup"], all of the code after the ticket) and the
    # partial-load loop's body again for every further pass.
    s = plan.num_splits
    rt, passes = tc_tail_round_trips(s, group, head_dim)
    tail = rt * HBM_LAT + ((costs["fixup"] + (passes - 1) * costs["fixup_loop"]) / CLOCK if s > 1 else 0.0)
    return {"ctas": ctas, "splits": plan.num_splits, "items_per_cta": k, "tile": TC_BC, "occ": occ,
            "have_kb": have / 1024,
            "x_min": read / (kv_min + qo), "t_hbm": t_hbm, "t_issue": t_issue, "t_issue_lo": t_issue_lo,
            "t_lat": t_lat, "t_tensor": t_tensor, "t_smem": t_smem, "t_cvt": t_cvt, "t_cvt_lo": t_cvt_lo,
            "launch": launch, "t_wave": t_wave, "t": t, "bind": bind, "min_bytes": kv_min + qo,
            "pct": 100 * (kv_min + qo) / t / H100_BW, "tail_rt": rt, "t_tail": tail,
            "pct_tail": 100 * (kv_min + qo) / (t + tail) / H100_BW}


SUMMARY_BATCHES = (1, 8, 64, 256)
SUMMARY_LENGTHS = (1024, 8192, 32768)
MEASURED = ROOT / "docs" / "measured" / "2026-11-28-h200" / "decode.json"
MEASURED_LABEL = ("measured on H200 (2026-11-28): docs/measured/2026-11-28-h200/decode.json, "
                  "`python tools/measure_gpu.py decode` (CUDA events, median of 20, L2 flushed before each call, "
                  "GPU time; measured device-to-device copy 4230 GB/s read+write)")


def load_measured(path: Path = MEASURED) -> dict[tuple[str, int, int, int], dict[str, Any]]:
    """The measured paged-decode records, {(kv, gqa, batch, ctx): record}; {} when the file is absent."""
    import json

    if not path.exists():
        return {}
    return {(r["kv"], r["gqa"], r["batch"], r["ctx"]): r for r in json.loads(path.read_text())
            if r.get("what") == "decode"}


def summary(args: argparse.Namespace, old_costs: dict[str, Any], tc_costs: dict[str, Any]) -> None:
    """Modelled % of H100 HBM, old path (paged_attn) vs the path the plan picks now, with binding terms."""
    for kv in args.kv:
        print(f"\nmodelled bound, % of {GPU_NAME} HBM ({H100_BW / 1e12:.2f} TB/s, {CLOCK / 1e9:.3f} GHz), {kv} KV, bf16 q, kv_heads 8, "
              f"head_dim 128, page 16: old = paged_attn, new = what PagedDecodePlan picks "
              f"(decode_tc for GQA {TC_DECODE_MIN_GROUP} to {TC_DECODE_MAX_GROUP}; paged_attn otherwise)")
        print("decode_tc: one launch (split partials merged by the last split CTA: no launch term); the partials' "
              "writes (o in bf16, lse fp32) counted as HBM bytes, their read-back in the tail; tail = the last CTA's dependent global "
              f"round trips (release, acq_rel ticket, lse + partial loads in the same rounds) at {HBM_LAT * 1e9:.0f} ns each (an upper "
              "bound, not in 'new %'), '+tail %' with it")
        meas = load_measured()
        if meas:
            print(f"model GB/s: minimum bytes / (new bound + tail) on the modelled GPU, of the kernels' SASS now; "
                  f"meas GB/s: {MEASURED_LABEL}, of the kernels as they were then, at the split count then "
                  "(sN; every step a CTA an item); "
                  "'-' where not measured")
        print("items: decode_tc's work items a CTA (1: a CTA an item, in waves; k > 1: a persistent grid of one "
              "wave, k items a CTA through one ring, an item switch each priced at one HBM round trip: unmeasured)")
        hdr = f"{'GQA':>3s} {'batch':>5s} {'ctx':>6s} {'splits':>6s} {'items':>5s} {'old %':>6s} {'old bound':>9s} " \
              f"{'new %':>6s} {'new bound':>9s} {'tail rt':>7s} {'tail us':>7s} {'+tail %':>7s} {'new kernel':>12s}" \
              + (f" {'model GB/s':>10s} {'meas GB/s':>10s}" if meas else "")
        print(hdr)
        print("-" * len(hdr))
        for g in args.gqa:
            for b in SUMMARY_BATCHES:
                for n in SUMMARY_LENGTHS:
                    o = roofline_row(b, g, n, kv, old_costs[kv])
                    if TC_DECODE_MIN_GROUP <= g <= TC_DECODE_MAX_GROUP:
                        r, kern = tc_roofline_row(b, g, n, kv, tc_costs[kv]), "decode_tc"
                    else:
                        r, kern = dict(o, tail_rt=0, t_tail=0.0, pct_tail=o["pct"]), "paged_attn"
                    print(f"{g:3d} {b:5d} {n:6d} {r['splits']:6d} {r.get('items_per_cta', 1):5d} "
                          f"{o['pct']:5.1f}% {o['bind']:>9s} "
                          f"{r['pct']:5.1f}% {r['bind']:>9s} {r['tail_rt']:7d} {r['t_tail'] * 1e6:7.1f} "
                          f"{r['pct_tail']:6.1f}% {kern:>12s}", end="")
                    if meas:
                        m = meas.get((kv, g, b, n))
                        model = r.get("min_bytes", o.get("min_bytes", 0)) / (r["t"] + r["t_tail"]) / 1e9 \
                            if kern == "decode_tc" else float("nan")
                        ms = f"{m['pykern_GBps']:.0f} s{m.get('splits', m['launches'][0][1][2])}" if m else "-"
                        print(f" {model:10.0f} {ms:>10s}", end="")
                    print()


def roofline(args: argparse.Namespace) -> None:
    set_gpu(args.gpu)
    old_costs = {kv: sass_costs("paged_attn_bf16" if kv == "bf16" else "paged_attn_bf16_e4m3kv") for kv in args.kv}
    tc = {kv: tc_sass_costs("decode_tc_paged_d128_bf16" if kv == "bf16" else "decode_tc_paged_d128_e4m3kv_bf16")
          for kv in args.kv}
    if args.summary:
        summary(args, old_costs, tc)
        return
    for kv in args.kv:
        kern = "paged_attn_bf16" if kv == "bf16" else "paged_attn_bf16_e4m3kv"
        c = old_costs[kv]
        print(f"\npaged decode roofline, bf16 q/out, {kv} KV, kv_heads 8, head_dim 128, page 16; H100 "
              f"{H100_SMS} SMs {H100_BW / 1e12:.2f} TB/s, {ISSUE} issue/clk/SM at {CLOCK / 1e9:.3f} GHz, HBM "
              f"latency {HBM_LAT * 1e9:.0f} ns")
        print(f"{kern} sm_90 SASS: regs {c['registers']}, warp-instructions per 16-B K+V fill chunk "
              f"{c['fill']:.1f}, per 16-B score chunk {c['score']:.1f}, per P.V FMA {c['pv']:.2f}, "
              f"tile straight-line {c['tile']} ({c['copies']} P.V copies of {c['per_k']} each, only those a "
              f"row chunk uses counted)")
        print("issue us counts the tile loop's straight-line code as all executed (upper bound); issue lo "
              "leaves it out, and % hi is the % of HBM with that lower bound")
        hdr = (f"{'GQA':>3s} {'batch':>5s} {'len':>6s} {'CTAs':>6s} {'splt':>4s} {'T':>3s} {'occ':>3s} "
               f"{'need KB':>7s} {'ring KB':>7s} {'x min':>6s} {'HBM us':>8s} {'issue us':>8s} {'lat us':>8s} "
               f"{'bound':>7s} {'% HBM':>6s} {'issue lo':>8s} {'% hi':>6s}")
        print(hdr)
        print("-" * len(hdr))
        for g in args.gqa:
            for b in args.rf_batch:
                for n in args.rf_length:
                    r = roofline_row(b, g, n, kv, c)
                    print(f"{g:3d} {b:5d} {n:6d} {r['ctas']:6d} {r['splits']:4d} {r['tile']:3d} {r['occ']:3d} "
                          f"{r['need_kb']:7.1f} {r['have_kb']:7.1f} {r['x_min']:6.3f} {r['t_hbm'] * 1e6:8.1f} "
                          f"{r['t_issue'] * 1e6:8.1f} {r['t_lat'] * 1e6:8.1f} {r['bind']:>7s} {r['pct']:5.1f}% "
                          f"{r['t_issue_lo'] * 1e6:8.1f} {r['pct_hi']:5.1f}%")
    for kv in args.kv:
        tc_table(args, tc[kv], kv)
    summary(args, old_costs, tc)


def tc_table(args: argparse.Namespace, c: dict[str, Any], kv: str) -> None:
    print(f"\ntensor-core paged decode roofline ({c['kernel']} sm_90 SASS: regs {c['registers']}, tile loop "
          f"{c['loop']} warp-instructions a warp a 64-key tile with {c['mma']:.0f} HMMA and {c['ldgsts']} "
          f"LDGSTS.128, {c['cvt_f2fp']} F2FP and {c['cvt_hadd2_f32']} HADD2.F32 conversions, {c['rest']} outside "
          f"the loop, {c['fixup']} in the split fixup), {kv} KV, kv_heads 8, "
          f"head_dim 128, page 16")
    hdr = (f"{'GQA':>3s} {'batch':>5s} {'len':>6s} {'CTAs':>6s} {'splt':>4s} {'occ':>3s} {'ring KB':>7s} "
           f"{'x min':>6s} {'HBM us':>8s} {'issue us':>8s} {'lat us':>8s} {'tc us':>7s} {'smem us':>7s} "
           f"{'cvt us':>7s} {'cvt lo':>7s} {'launch':>6s} {'bound':>7s} {'% HBM':>6s} {'tail us':>7s} {'+tail %':>7s}")
    print(hdr)
    print("-" * len(hdr))
    for g in (x for x in args.gqa if TC_DECODE_MIN_GROUP <= x <= TC_DECODE_MAX_GROUP):
        for b in args.rf_batch:
            for n in args.rf_length:
                r = tc_roofline_row(b, g, n, kv, c)
                print(f"{g:3d} {b:5d} {n:6d} {r['ctas']:6d} {r['splits']:4d} {r['occ']:3d} {r['have_kb']:7.1f} "
                      f"{r['x_min']:6.3f} {r['t_hbm'] * 1e6:8.1f} {r['t_issue'] * 1e6:8.1f} {r['t_lat'] * 1e6:8.1f} "
                      f"{r['t_tensor'] * 1e6:7.1f} {r['t_smem'] * 1e6:7.1f} {r['t_cvt'] * 1e6:7.1f} "
                      f"{r['t_cvt_lo'] * 1e6:7.1f} {r['launch'] * 1e6:6.1f} "
                      f"{r['bind']:>7s} {r['pct']:5.1f}% {r['t_tail'] * 1e6:7.1f} {r['pct_tail']:6.1f}%")


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
                    m: (lambda m=m: ops.batched_decode_attention(q, kc, vc, lens, method=m, kv_layout="HND"))
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
    ap.add_argument("--roofline", action="store_true", help="paged decode roofline from our SASS (only that)")
    ap.add_argument("--kv", nargs="+", choices=sorted(KV_ELEM), default=["bf16"], help="--roofline KV dtypes")
    ap.add_argument("--gqa", nargs="+", type=int, default=list(GQA), help="--roofline query heads a kv head")
    ap.add_argument("--rf-batch", nargs="+", type=int, default=list(RF_BATCHES))
    ap.add_argument("--rf-length", nargs="+", type=int, default=list(RF_LENGTHS))
    ap.add_argument("--gpu", choices=sorted(GPUS), default="h100", help="--roofline: the published rates to model")
    ap.add_argument("--summary", action="store_true",
                    help="--roofline: only the old-vs-new table (batch 1/8/64/256 x ctx 1k/32k x --gqa)")
    args = ap.parse_args(argv)
    if args.roofline:
        roofline(args)
        return
    report(args)
    if args.resources:
        resources(args)
    if args.time:
        bench(args)


if __name__ == "__main__":
    main()
