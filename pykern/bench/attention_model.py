"""Performance model of the tensor-core attention kernels, from their own SASS, launch geometry and the
hardware's published rates. Nothing in it is calibrated from a measured speed (ours or a peer's).

Per kernel and arch the SASS gives the steady-state loop (tools/sass_report.py):

* instr/MMA: warp-instructions (NOPs excluded) per m16n8k16-equivalent MMA (HMMA.16816 = 1, HGMMA m64nNk16
  = N/8). The loop is the flat steady-state loop (`steady_state_loops`: MMAs, no inner loop) when the kernel
  has one (the FlashAttention-2 forward core, the fused backward, the sm_90a kernels); otherwise (the d96 /
  d256 kernels: their tile loads are loops inside the MMA loop) the innermost loop that
  holds MMAs, every instruction of its body counted once -- every path, so the issue term over-counts code
  the steady state skips (fallback loads, diagonal-tile masks) -- except its cp.async tile-loader loops,
  which count `trips` x their shortest path through the 16-byte LDGSTS, trips = the bytes the launch
  geometry says a step writes to shared memory / the loaders' LDGSTS bytes per trip; other loops inside
  it (one-iteration row loads) count once;
* shared-memory bytes/MMA: LDSM (.x4 = 512 B a warp), LDS/STS (by width, at least one 128-byte wavefront),
  LDGSTS (the bytes it writes to shared memory), HGMMA m64nNk16 / QGMMA m64nNk32 (e4m3) operands read through
  descriptors (B: 32 N bytes; A: 2 KiB when it is a descriptor too), a quarter to each warp: the four warps of
  the warpgroup each issue the instruction, the operands are fetched once for the warpgroup;
* straight-line warp-instructions outside every loop, issued once per warp and CTA;
* registers and static shared memory from the compiler's resources.

The launch geometry (threads, rows per CTA, keys per step, dynamic shared memory, grid) is read from the ops
modules at call time (pykern.ops.attention, pykern.ops._attention_sm90), so the model follows the kernels
the ops launch today. Per kernel and shape, lower bounds on the time, each in SM clocks per CTA and then
scheduled over the GPU:

* issue: 4 schedulers per SM, one warp-instruction per clock each;
* shared memory: 128 bytes per clock per SM;
* tensor pipe: dense bf16 FLOP per clock per SM times the pipe fraction (mma.sync on sm_90: 2/3 of Hopper's
  dense peak; wgmma on sm_90a and mma.sync on sm_80: the full dense rate);
* special functions (mufu): the loop's MUFU warp-instructions (the softmax's exp2) at 16 results per clock
  per SM;
* FMA pipe (fma): the loop's fp32 FFMA / FADD / FMUL warp-instructions at 128 results per clock per SM (the
  softmax's scale-and-shift and sums, and the exp2s a kernel moves off the MUFU: pk_exp2_fma, one FADD.RM each);
* occupancy: CTAs per SM from registers (per warp, units of 256), shared memory (+1 KiB reserved per CTA),
  the 32-CTA and 64-warp limits; co-resident CTAs share their SM's rates;
* waves and tail: CTAs dispatched in launch order (the kernels' own block-to-tile order) to the first free of
  SMs x CTAs/SM slots, each CTA's cost the max of its three SM terms; the makespan is the compute time;
* HBM: the minimum bytes the kernel must move (each input read once, each output written once; the mma.sync
  fused backward's dQ also its fp32 RED adds or per-key-tile partials, one per query tile and key tile, the
  workspace being far larger than L2 at the table's shapes; the current sm_90a fused backward's dQ accumulator
  read once and written back once, while the part its CTAs in flight add into fits L2) at the published
  bandwidth; the backward's small memory-bound kernels (delta pre-pass; the fused backward's prep and dQ reduce)
  by their bytes alone;
* L2 atomics: the mma.sync fused backward's dQ REDs (one RED.E.ADD.F32 a float) have no published rate, so the bound
  counts only their bytes (HBM, above); the calibrated model adds their term ("l2 red", Calibration.l2_red_clk);
* L2 (l2): the current sm_90a fused backward's bulk reduce-adds (cp.reduce.async.bulk .add.f32, one contiguous
  run of a tile pair's dQ partial, issued by one producer thread, off the consumers' path) at an SM's share of
  the L2 bandwidth (Hardware.l2_bytes_clk: an assumption, no Hopper figure being published).

The FP8 (e4m3) sm_90a forward (`predict(..., fp8=True)`, `fp8_launch`): its QGMMAs counted as above (m64nNk32: 2N/8
m16n8k16-equivalents of 4096 FLOP a warp) and run at twice the bf16 rate (`Launch.tensor_rate`); its flat loop's
rate-p code issued by a fraction p of the tiles (`Launch.redo_p`; default `fp8_redo_rate`, random scores: the tiles
where a row of the warp finds a new max): the row-max-first tile's rescale of O and l, the block a warp vote skips
inside the body (`_rate_p_block`, the kernel today), or the lazy tile's out-of-line redo path (`_redo_path`: the
exact softmax a tile runs when its lazy one is not accepted; the kernel with FA90F8_MF 0).

The predicted time is max(compute makespan, HBM time) summed over the op's launches; the binding term is
the largest single term. A latency / dependency model is not included: every figure is a "modelled bound"
(no faster than this, under these counts: the issue term's all-paths count can exceed what the steady state
issues), not a forecast of a measurement. Launch overheads are left out.

`import pykern.bench.attention_model` imports nothing heavy; the SASS is read (through pykern's compile
cache and cuobjdump) only when a prediction needs it.
"""
from __future__ import annotations

import heapq
import importlib.util
import json
import re
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from ..errors import ArgumentError, BackendUnavailable
from . import FLOPS_PER_SM_CLOCK, KNOWN_PARTS

MMA_FLOP = 2 * 16 * 8 * 16  # one m16n8k16 MMA: 4096 FLOP


# ------------------------------------------------------------------------------------------- hardware
@dataclass(frozen=True)
class Hardware:
    """Published per-SM rates of one part. The dense bf16 tensor FLOP per SM per clock and the tensor clock
    come from pykern.bench (FLOPS_PER_SM_CLOCK, KNOWN_PARTS: the NVIDIA whitepapers' peaks divided by SMs and
    clock); the rest from the whitepapers and the CUDA programming guide's compute-capability tables."""

    part: str
    arch: str
    sms: int
    clock_hz: float
    tensor_flop_clk: int  # dense bf16, fp32 accumulate, per SM per clock
    mma_sync_fraction: float  # share of tensor_flop_clk that mma.sync (HMMA) reaches
    hbm_bytes_s: float
    smem_per_sm: int  # shared memory an SM can give its CTAs (bytes)
    smem_reserved_cta: int = 1024  # reserved per CTA (CUDA guide, cc 8.x / 9.0)
    regs_per_sm: int = 65536
    max_ctas_sm: int = 32
    max_warps_sm: int = 64
    issue_clk: int = 4  # warp schedulers per SM, one warp-instruction per clock each
    smem_bytes_clk: int = 128  # 32 banks x 4 bytes per clock per SM
    mufu_clk: int = 16  # special-function results (MUFU.EX2 ...) per clock per SM (CUDA guide, cc 8.0 / 9.0)
    fma_clk: int = 128  # fp32 add / multiply / multiply-add results per clock per SM (CUDA guide, cc 8.0 / 9.0)
    l2_bytes: int = 50 * 2**20  # L2 capacity
    # L2 bandwidth, bytes per clock for the whole GPU: the A100 whitepaper's 5120 (its L2 read bandwidth, 2.3x
    # V100's). NVIDIA publishes no Hopper figure, so the A100's stands in on sm_90 too: an assumption, not a
    # measurement (it binds nothing at the table's shapes)
    l2_bytes_clk: int = 5120

    @property
    def peak(self) -> float:
        """Dense bf16 tensor peak, FLOP/s."""
        return self.sms * self.clock_hz * self.tensor_flop_clk

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "peak": self.peak}


def _hw(part: str, arch: str, cc: tuple[int, int], sms: int, **kw: Any) -> Hardware:
    _name, mhz = KNOWN_PARTS[(*cc, sms)]
    flop = FLOPS_PER_SM_CLOCK[cc][0]
    assert flop is not None
    return Hardware(part, arch, sms, mhz * 1e6, flop, **kw)


# A100 SXM4 80 GB: 108 SMs, 1410 MHz, 312 TFLOP/s dense bf16, 2039 GB/s, 164 KiB shared per SM, 40 MB L2 (A100
# whitepaper, datasheet). H100 SXM5: 132 SMs, 1830 MHz tensor boost, 989 TFLOP/s dense bf16, 3.35 TB/s, 228 KiB shared
# per SM, 50 MB L2 (H100 whitepaper, datasheet). mma.sync reaches about 2/3 of Hopper's dense peak (FlashAttention-3 paper, s.1;
# only wgmma issues at the full rate); on Ampere mma.sync is the tensor-core instruction and reaches the full rate.
HARDWARE: dict[str, Hardware] = {
    "sm_80": _hw("A100 SXM4 80GB", "sm_80", (8, 0), 108, mma_sync_fraction=1.0, hbm_bytes_s=2.039e12,
                 smem_per_sm=164 * 1024, l2_bytes=40 * 2**20),
    "sm_90": _hw("H100 SXM5", "sm_90", (9, 0), 132, mma_sync_fraction=2.0 / 3.0, hbm_bytes_s=3.35e12,
                 smem_per_sm=228 * 1024, l2_bytes=50 * 2**20),
}


# The part our measurements ran on (docs/measured/2026-11-27-h200): H200 SXM, the H100's SMs, clocks and dense
# peak (989 TFLOP/s bf16) with HBM3e at 4.8 TB/s (datasheet). Its L2: 62914560 bytes (60 MiB), what the CUDA
# device attribute reported on our H200 (docs/measured/2026-11-27-h200/ceilings.json, l2_bytes; the H200 datasheet
# states none). The calibrated model is fitted on it.
H200 = Hardware("H200 SXM", "sm_90", 132, HARDWARE["sm_90"].clock_hz, HARDWARE["sm_90"].tensor_flop_clk,
                mma_sync_fraction=2.0 / 3.0, hbm_bytes_s=4.8e12, smem_per_sm=228 * 1024, l2_bytes=62914560)


def hardware(arch: str) -> Hardware:
    a = arch[:-1] if arch.endswith("a") else arch
    if a not in HARDWARE:
        raise ArgumentError(f"arch: expected one of {sorted(HARDWARE)} (or sm_90a), got {arch!r}")
    return HARDWARE[a]


# ------------------------------------------------------------------------------------------- SASS inputs
@dataclass(frozen=True)
class LoaderLoop:
    """An MMA-free loop inside the MMA loop that holds cp.async (LDGSTS): a tile loader. Its trip count is not
    in the SASS; the launch geometry gives it (the bytes a step writes to shared memory)."""

    insns: int  # static body, every path once
    smem: float  # static body's shared-memory bytes
    fast_insns: int  # the shortest head-to-back-branch path through its LDGSTS (the 16-byte path)
    fast_smem: float  # shared-memory bytes on that path (the LDGSTS)


@dataclass(frozen=True)
class LoopInputs:
    """What the model reads from one kernel's SASS (per warp)."""

    loop: str  # "flat" (steady_state_loops) or "inner" (innermost MMA loop; its MMA-free loops inside it)
    insns: int  # warp-instructions of the loop body, every path once, inner loops once
    mma: float  # m16n8k16-equivalents in the body
    ldsm: int  # LDSM instructions in the body
    smem_bytes: float  # shared-memory bytes the body moves (per warp), inner loops once
    straight: int  # warp-instructions outside every loop (once per warp and CTA)
    wgmma: bool = False  # HGMMA or QGMMA in the loop: the tensor pipe runs at the full dense rate
    inner_insns: int = 0  # of insns, those in MMA-free loops inside the body
    mufu: int = 0  # MUFU instructions in the body (the softmax's exp2)
    fma: int = 0  # fp32 FFMA / FADD / FMUL instructions in the body (the FMA pipe)
    exp2_fma: int = 0  # exp2s on the FMA pipe in the body (pk_exp2_fma: one FADD.RM, its floor, each)
    loaders: tuple[LoaderLoop, ...] = ()
    # the flat loop's rate-p code: the redo path (`_redo_path`: the FP8 forward's lazy tile redone with the exact
    # softmax when its test fails, issued after the whole body, out of line) or, where there is none, the block a
    # warp vote skips inside the body (`_rate_p_block`: the row-max-first tile's rescale, not in insns / mufu / fma
    # above); 0 where there is neither
    redo_insns: int = 0
    redo_mufu: int = 0
    redo_fma: int = 0
    redo_smem: float = 0.0

    def per_step(self, fill_per_warp: float = 0.0) -> tuple[float, float, float]:
        """(warp-instructions, shared bytes, loader trips) of one loop iteration: each loader loop runs
        `trips` times its fast path, trips = the cp.async bytes a warp writes per step / the LDGSTS bytes of one
        trip of every loader; everything else in the body once. Without loaders or fill: the static body."""
        if not self.loaders or fill_per_warp <= 0:
            return float(self.insns), self.smem_bytes, 0.0
        per_trip = sum(ld.fast_smem for ld in self.loaders)
        trips = fill_per_warp / per_trip if per_trip else 0.0
        insns = self.insns - sum(ld.insns for ld in self.loaders) + trips * sum(ld.fast_insns for ld in self.loaders)
        smem = self.smem_bytes - sum(ld.smem for ld in self.loaders) + trips * per_trip
        return insns, smem, trips

    @property
    def per_mma(self) -> float:
        return self.insns / self.mma

    @property
    def ldsm_per_mma(self) -> float:
        return self.ldsm / self.mma

    @property
    def smem_per_mma(self) -> float:
        return self.smem_bytes / self.mma

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "static_per_mma": round(self.per_mma, 3), "ldsm_per_mma": round(self.ldsm_per_mma, 3),
                "static_smem_per_mma": round(self.smem_per_mma, 1)}


def _width_bytes(mods: str) -> int:
    parts = mods.split(".")
    if "128" in parts:
        return 16
    if "64" in parts:
        return 8
    return 4  # 32-bit and narrower: one wavefront all the same


def smem_bytes(op: str, mods: str, operands: str = "") -> float:
    """Shared-memory bytes one warp-instruction moves (0 for an instruction that does not touch it).
    LDS/STS/LDGSTS: 32 lanes x width, at least one 128-byte wavefront; LDSM: 128 bytes per 8x8 matrix;
    HGMMA m64nNk16: B (N x 16 x 2 bytes) through its descriptor, A (64 x 16 x 2) too unless in registers, one
    fetch for the warpgroup whose four warps each issue it: a quarter a warp-instruction. QGMMA m64nNk32 (e4m3)
    reads the same bytes as HGMMA m64nNk16 (32 one-byte k where HGMMA has 16 two-byte ones)."""
    if op in ("LDS", "STS", "LDGSTS"):
        return 32 * _width_bytes(mods)
    if op == "LDSM":
        n = 4 if ".4" in mods else 2 if ".2" in mods else 1
        return 128 * n
    if op in ("HGMMA", "QGMMA"):
        m = re.search(r"\.64x(\d+)x(?:16|32)", mods)
        if not m:
            return 0.0
        ops = [o.strip() for o in operands.split(",")]
        a_desc = len(ops) > 1 and ops[1].startswith("gdesc")
        return (32 * int(m.group(1)) + (2048 if a_desc else 0)) / 4
    return 0.0


def _sass_report() -> Any:
    path = Path(__file__).resolve().parents[2] / "tools" / "sass_report.py"
    if not path.exists():
        raise BackendUnavailable(f"the attention model reads SASS through {path}, which this install lacks")
    spec = importlib.util.spec_from_file_location("pk_sass_report_am", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _operands(raw: str, op: str) -> str:
    """The operand text of one SASS instruction ("@P0 HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], R24" -> "R24, ...")."""
    for i, tok in enumerate(raw.split()):
        if tok.startswith(op):
            return " ".join(raw.split()[i + 1:])
    return ""


def _insn_smem(x: tuple[int, str, str, str]) -> float:
    """smem_bytes of one listed instruction; 0 for one predicated off for good (@!PT: issued, never executed,
    as ptxas pads cp.async sequences)."""
    _a, op, mods, raw = x
    if raw.lstrip().startswith("@!PT"):
        return 0.0
    return smem_bytes(op, mods, _operands(raw, op))


def _fast_path(body: list[tuple[int, str, str, str]], bra: "re.Pattern[str]") -> tuple[int, float] | None:
    """(instructions, shared bytes) of the shortest path from a loop's head to its back branch (the last
    instruction of `body`, NOPs left out) that passes an LDGSTS; None when none does."""
    n = len(body)
    addrs = [x[0] for x in body]

    def succ(i: int) -> list[int]:
        _a, op, _m, raw = body[i]
        cond = raw.lstrip().startswith("@")
        if op == "BRA":
            out = [i + 1] if cond and i + 1 < n else []
            b = bra.search(raw)
            if b:
                t = int(b.group(1), 16)
                j = next((k for k, a in enumerate(addrs) if a >= t), None)
                if j is not None and addrs[0] <= t <= addrs[-1]:
                    out.append(j)
            return out
        if op in ("EXIT", "RET") and not cond:
            return []
        return [i + 1] if i + 1 < n else []

    def bfs(src: int) -> dict[int, int]:
        par, todo = {src: -1}, [src]
        for i in todo:
            for j in succ(i):
                if j not in par:
                    par[j] = i
                    todo.append(j)
        return par

    def path(par: dict[int, int], dst: int) -> list[int]:
        out = [dst]
        while par[out[-1]] != -1:
            out.append(par[out[-1]])
        return out[::-1]

    head = bfs(0)
    best = None
    for L in (i for i, x in enumerate(body) if x[1] == "LDGSTS" and i in head):
        tail = bfs(L)
        if n - 1 not in tail:
            continue
        p = path(head, L) + path(tail, n - 1)[1:]
        if best is None or len(p) < len(best):
            best = p
    if best is None:
        return None
    return len(best), sum(_insn_smem(body[i]) for i in best)


# how far before a flat loop's head a redo path may re-enter it (the few instructions that reset the loop's state)
REDO_REENTRY_MAX = 16


def _redo_path(live: list[tuple[int, str, str, str]], lo: int, hi: int, bra: "re.Pattern[str]"
               ) -> list[tuple[int, str, str, str]]:
    """The instructions a tile that leaves the flat loop [lo, hi] by falling through its back branch issues before
    it re-enters the loop: the block right after the loop up to the first backward branch to the loop's head or at
    most REDO_REENTRY_MAX instructions before it, plus those re-entry instructions (the FP8 forward's redo: the
    lazy tile's warp vote fails, the loop falls through to the exact softmax from the kept scores and branches back
    to the head). Forward branches in the block (the loop's exit when the vote passed) are issued and counted. []
    when the block meets an MMA, an EXIT or a backward branch elsewhere first (a loop with no such path)."""
    after = [x for x in live if x[0] > hi]
    for i, x in enumerate(after):
        op = x[1]
        if op in ("EXIT", "RET", "HGMMA", "QGMMA", "HMMA"):
            return []
        if op != "BRA":
            continue
        b = bra.search(x[3])
        if not b or int(b.group(1), 16) > x[0]:
            continue  # a forward branch
        t = int(b.group(1), 16)
        entry = [y for y in live if t <= y[0] < lo]
        if t > lo or len(entry) > REDO_REENTRY_MAX or any(y[1] == "BRA" for y in entry):
            return []
        return after[:i + 1] + entry
    return []


def _voted(body: list[tuple[int, str, str, str]], k: int) -> bool:
    """Whether the BRA at body[k] is guarded by the predicate a VOTE.ANY before it wrote last (the latest earlier
    instruction whose first operand is that predicate, a guard not counting as a write, is that vote)."""
    g = re.match(r"\s*@!?(U?P[0-9])\s", body[k][3])
    if not g:
        return body[k - 1][1] == "VOTE" and ".ANY" in body[k - 1][2]
    pred = g.group(1)
    for _, op, mods, raw in reversed(body[:k]):
        ops = re.sub(r"^\s*@!?U?P[T0-9]+\s+", "", raw).split(None, 1)
        if len(ops) == 2 and re.match(rf"{pred}\b", ops[1].strip()):
            return op == "VOTE" and ".ANY" in mods
    return False


def _rate_p_block(body: list[tuple[int, str, str, str]], bra: "re.Pattern[str]") -> list[tuple[int, str, str, str]]:
    """The block inside a flat loop's body that a warp-uniform forward branch skips: a `BRA` guarded by the
    predicate a `VOTE.ANY` wrote (the warp agrees; the vote right before it, or earlier with no other write of that
    predicate between: the FP8 forward's overlapped step votes before its exp2s and branches after them) to a later
    instruction of the body, the block between them holding no MMA, barrier, branch or exit (the FP8 forward's
    row-max-first tile: O and l rescaled only where a row of the warp grew, at the rate its lazy tile was redone).
    [] when there is none."""
    for k in range(1, len(body)):
        a, op, _, rest = body[k]
        if op != "BRA" or not _voted(body, k):
            continue
        b = bra.search(rest)
        if not b or int(b.group(1), 16) <= a:
            continue
        t = int(b.group(1), 16)
        block = [x for x in body[k + 1:] if x[0] < t]
        if t > body[-1][0] or any(x[1] in ("BRA", "EXIT", "RET", "BAR", "HGMMA", "QGMMA", "HMMA") for x in block):
            continue
        return block
    return []


def loop_inputs(text: str, kernel: str, sr: Any = None, parsed: tuple[dict, dict] | None = None
                ) -> LoopInputs | None:
    """The model's SASS inputs of `kernel` from a cuobjdump -sass listing; None when it has no MMA loop.
    `parsed`: (sr._instructions(text), sr.steady_state_loops(text)) when the caller already has them."""
    sr = sr or _sass_report()
    funcs, flats = parsed if parsed is not None else (sr._instructions(text), sr.steady_state_loops(text))
    insns = funcs.get(kernel)
    if not insns:
        return None
    live = [x for x in insns if x[1] != "NOP"]
    loops = sr._back_branches(insns)

    def within(lo: int, hi: int) -> list[tuple[int, str, str, str]]:
        return [x for x in live if lo <= x[0] <= hi]

    def mma(body: Iterable[tuple[int, str, str, str]]) -> float:
        return sum(sr._mma_weight(op, mods) for _, op, mods, _ in body)

    flat = flats.get(kernel)
    if flat is not None:
        lo, hi, kind = int(flat["start"], 16), int(flat["end"], 16), "flat"
    else:
        mloops = [(lo, hi) for lo, hi in loops if mma(within(lo, hi))]
        leaves = [(lo, hi) for lo, hi in mloops
                  if not any(lo <= l2 and h2 <= hi and (l2, h2) != (lo, hi) for l2, h2 in mloops)]
        if not leaves:
            return None
        lo, hi = max(leaves, key=lambda r: (mma(within(*r)), -(r[1] - r[0])))
        kind = "inner"
    body = within(lo, hi)
    inside = [(l2, h2) for l2, h2 in loops if lo <= l2 and h2 <= hi and (l2, h2) != (lo, hi)]
    inner = {id(x) for l2, h2 in inside for x in within(l2, h2)}
    in_loop = {id(x) for l2, h2 in loops for x in within(l2, h2)}

    def sbytes(xs: Iterable[tuple[int, str, str, str]]) -> float:
        return sum(_insn_smem(x) for x in xs)

    redo = _redo_path(live, lo, hi, sr._BRA) if kind == "flat" else []
    if kind == "flat" and not redo:
        # the rate-p code inside the body instead (_rate_p_block): out of the body's every-tile counts, into redo_*
        redo = _rate_p_block(body, sr._BRA)
        skip = {id(x) for x in redo}
        body = [x for x in body if id(x) not in skip]
    loaders = []
    for l2, h2 in inside:  # outermost inner loops only (a loader nested in another inner loop counts once)
        if any(l3 <= l2 and h2 <= h3 and (l3, h3) != (l2, h2) for l3, h3 in inside):
            continue
        ib = within(l2, h2)
        fast = _fast_path(ib, sr._BRA)
        if fast is not None:
            loaders.append(LoaderLoop(len(ib), sbytes(ib), fast[0], fast[1]))
    return LoopInputs(
        loop=kind, insns=len(body), mma=mma(body), ldsm=sum(op == "LDSM" for _, op, _, _ in body),
        smem_bytes=sbytes(body), straight=sum(id(x) not in in_loop for x in live),
        wgmma=any(op in ("HGMMA", "QGMMA") for _, op, _, _ in body), inner_insns=len(inner), loaders=tuple(loaders),
        mufu=sum(op == "MUFU" for _, op, _, _ in body), fma=sum(op in ("FFMA", "FADD", "FMUL") for _, op, _, _ in body),
        exp2_fma=sum(op == "FADD" and ".RM" in mods for _, op, mods, _ in body),
        redo_insns=len(redo), redo_mufu=sum(op == "MUFU" for _, op, _, _ in redo),
        redo_fma=sum(op in ("FFMA", "FADD", "FMUL") for _, op, _, _ in redo), redo_smem=sbytes(redo))


# ------------------------------------------------------------------------------------------- occupancy
@dataclass(frozen=True)
class Occupancy:
    ctas: int  # CTAs per SM
    limiter: str  # "registers" | "shared memory" | "CTA limit" | "warp limit"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def occupancy(regs: int, threads: int, smem: int, hw: Hardware) -> Occupancy:
    """CTAs per SM from registers (a warp's registers are allocated in units of 256), shared memory (plus the
    per-CTA reservation), and the CTA and warp limits. 0 when one CTA does not fit."""
    warps = -(-threads // 32)
    regs_warp = -(-(max(regs, 1) * 32) // 256) * 256
    limits = {"registers": hw.regs_per_sm // (regs_warp * warps),
              "shared memory": hw.smem_per_sm // (smem + hw.smem_reserved_cta) if smem else 1 << 30,
              "CTA limit": hw.max_ctas_sm, "warp limit": hw.max_warps_sm // warps}
    lim = min(limits, key=lambda k: (limits[k], k != "registers"))
    return Occupancy(max(0, limits[lim]), lim)


# ------------------------------------------------------------------------------------------- geometry
@dataclass(frozen=True)
class Launch:
    """One kernel launch as the op makes it: `ctas` lists, in dispatch order, the query-key pairs each CTA of
    one group computes (whole tiles: the causal diagonal tile counts in full); the grid is `groups` copies.
    Executed FLOP per pair = 2 * head_dim * matmuls."""

    kernel: str
    source: str  # kernels_cu file name
    arch: str  # compile target (sm_90a for wgmma kernels)
    threads: int
    smem: int  # dynamic shared memory
    ctas: tuple[int, ...]
    groups: int
    head_dim: int  # compiled head_dim
    matmuls: int
    hbm_bytes: int
    step: tuple[int, int]  # (rows, keys) one loop iteration covers, per CTA (checked against the SASS)
    fill: int = 0  # bytes a CTA writes to shared memory with cp.async per loop iteration (the tile loads)
    mma_warps: int = 0  # warps that run the MMA loop (0: every warp; sm_90a: the consumer warpgroups only)
    chain_clk: float = 0.0  # SM clocks added once to the launch: the semaphore chain's fill (the _det fused kernel)
    # the head dims of the matmuls summed (a (query, key) pair costs 2 x this FLOP); 0: head_dim x matmuls. Set
    # where head_dim_v differs from head_dim (192 / 128: S and dK / dQ over 192, P V, dP and dV over 128)
    dims: int = 0
    # a persistent grid (the sm_90a forward's tile loop): `ctas` are then work tiles, taken across the groups in
    # the kernel's order (each of ctas in turn for every group: longest first) by SMs x CTAs/SM CTAs, a round at a
    # time in snake order (strided_span), no block-scheduler wave between them
    persistent: bool = False
    # bytes a (query, key) pair sends to L2 by bulk reduce-add (cp.reduce.async.bulk .add.f32: the current sm_90a
    # fused backward's dQ partials, issued by one producer thread off the consumers' path): the "l2" term
    l2_red_pair: float = 0.0
    # fp32 adds a (query, key) pair sends to L2 as RED.E.ADD.F32, one a float (the mma.sync fused backward's dQ in
    # its atomic mode: a query row's D floats per key tile of BC keys, so D / BC a pair; counted from the launch
    # geometry): the calibrated model's "l2 red" term at Calibration.l2_red_clk (the bound has no rate for it)
    l2_atomic_pair: float = 0.0
    # the tensor pipe's rate as a multiple of the dense bf16 one: 2 for the FP8 forward's e4m3 QGMMA (Hopper's dense
    # FP8 peak is twice its bf16 one: 1979 vs 989 TFLOP/s on H100 SXM). The MMA count stays in m16n8k16-equivalents
    # of 4096 FLOP (a QGMMA m64nNk32 is 2 N / 8 of them a warp), so the pipe runs twice as many a clock
    tensor_rate: float = 1.0
    # the share of loop iterations that also run the loop's rate-p code (LoopInputs.redo_*: the FP8 forward's
    # rescale where a row max grew, or its lazy tile's exact redo); the data's, not the kernel's: fp8_redo_rate
    # gives the random-score default
    redo_p: float = 0.0

    def schedule(self, costs: Sequence[float], slots: int) -> float:
        """The time the launch's last CTA ends, costs being one group's CTAs (or work tiles) in order."""
        if not self.persistent:
            return makespan(list(costs) * self.groups, slots)
        return strided_span([c for c in costs for _ in range(self.groups)], slots)

    @property
    def loop_warps(self) -> int:
        return self.mma_warps or -(-self.threads // 32)

    @property
    def pair_dims(self) -> int:
        """The head dims of the launch's matmuls summed: 2 x this is the FLOP of one (query, key) pair."""
        return self.dims or self.head_dim * self.matmuls

    @property
    def executed_flops(self) -> float:
        return 2.0 * self.pair_dims * sum(self.ctas) * self.groups


def _tiles(n_q: int, n_k: int, causal: bool, rows: int, keys: int, longest_first: bool) -> list[int]:
    """Pairs per query tile of `rows` queries stepping `keys` keys (bottom-right causal, as pk_attn_q_span)."""
    shift, n_kt, out = n_k - n_q, -(-n_k // keys), []
    for qt in range(-(-n_q // rows)):
        kt = n_kt
        if causal:
            last = min(qt * rows + rows, n_q) - 1 + shift
            kt = 0 if last < 0 else min(n_kt, last // keys + 1)
        out.append(kt * rows * keys)
    return out[::-1] if causal and longest_first else out


def _key_tiles(n_q: int, n_k: int, causal: bool, keys: int, rows: int, group: int) -> list[int]:
    """Pairs per key tile of `keys` keys stepping `rows` queries over `group` query heads (pk_attn_k_span)."""
    shift, n_it, out = n_k - n_q, -(-n_q // rows), []
    for kt in range(-(-n_k // keys)):
        it0 = 0
        if causal:
            first = kt * keys - shift  # the first query that sees key kt*keys
            it0 = min(n_it, max(0, first) // rows)
        out.append(group * (n_it - it0) * rows * keys)
    return out


@dataclass(frozen=True)
class Shape:
    """An attention shape: head_dim of q and k, head_dim_v of v, out and dO (None: head_dim; DeepSeek-V3's
    prefill is 192 / 128)."""

    batch: int
    heads: int
    seq: int
    head_dim: int
    causal: bool
    kv_heads: int | None = None
    head_dim_v: int | None = None

    @property
    def kvh(self) -> int:
        return self.heads if self.kv_heads is None else self.kv_heads

    @property
    def dv(self) -> int:
        return self.head_dim if self.head_dim_v is None else self.head_dim_v

    @property
    def label(self) -> str:
        """head_dim, or head_dim/head_dim_v where they differ ("192/128")."""
        return str(self.head_dim) if self.dv == self.head_dim else f"{self.head_dim}/{self.dv}"

    def check(self) -> None:
        for name in ("batch", "heads", "seq", "head_dim", "kvh", "dv"):
            if getattr(self, name) < 1:
                raise ArgumentError(f"{name}: expected >= 1, got {getattr(self, name)}")
        if self.heads % self.kvh:
            raise ArgumentError(f"kv_heads: must divide heads ({self.heads}), got {self.kvh}")
        if self.head_dim > 256:
            raise ArgumentError(f"head_dim: the tensor-core kernels take at most 256, got {self.head_dim}")
        if self.dv > self.head_dim:
            raise ArgumentError(f"head_dim_v: expected at most head_dim ({self.head_dim}), got {self.dv}")


def _padded(s: Shape) -> Shape:
    """s with v, out and dO at head_dim: what the mma.sync backward runs on where head_dim_v < head_dim (the op
    pads them with zero columns, dV sliced back)."""
    return replace(s, head_dim_v=None)


def useful_flops(s: Shape, phase: str) -> float:
    """FLOP as FlashAttention reports them: forward 2 * visible pairs * (d + dv) (S = Q K^T over d, P V over dv;
    4 * pairs * d when they are equal), backward 2 * pairs * (3 d + 2 dv) (S, dK, dQ over d; dP, dV over dv:
    2.5x the forward when they are equal)."""
    n = s.seq
    pairs = n * (n + 1) // 2 if s.causal else n * n
    dims = s.head_dim + s.dv if phase == "fwd" else 3 * s.head_dim + 2 * s.dv
    return 2.0 * pairs * dims * s.batch * s.heads


def _bytes(s: Shape) -> dict[str, int]:
    """bf16 bytes of q (and dq), o (out, dO, at head_dim_v), k, v, and a fp32 per query row (lse, delta)."""
    q = s.batch * s.seq * s.heads * s.head_dim * 2
    o = s.batch * s.seq * s.heads * s.dv * 2
    k = s.batch * s.seq * s.kvh * s.head_dim * 2
    v = s.batch * s.seq * s.kvh * s.dv * 2
    row = s.batch * s.seq * s.heads * 4
    return {"q": q, "o": o, "k": k, "v": v, "row": row}


def _fa2(fw: Any, s: Shape) -> bool:
    """Whether the forward runs the FlashAttention-2 core: the ops' own test (fa2_eligible) on the model's
    aligned, contiguous inputs: head_dim == head_dim_v in FA2_HEAD_DIMS)."""
    return fw.fa2_eligible(s.head_dim, s.dv)


def launches(phase: str, s: Shape, dq_mode: str = "atomic") -> list[Launch]:
    """The mma.sync tensor-core launches of `phase` ("fwd" | "bwd") at shape s, as pykern.ops makes them (bf16,
    aligned contiguous inputs) on sm_80 ... sm_90 without the sm_90a kernels. Backward at head_dim 64 / 128:
    the fused kernel (pykern.ops.attention._fused), its dQ summed by fp32 atomics (dq_mode "atomic")
    or as per-key-tile partials reduced in order ("deterministic"); other head_dims: the dK/dV + dQ pair."""
    from ..ops import attention as fw
    from ..ops import attention as ta

    if dq_mode not in DQ_MODES:
        raise ArgumentError(f"dq_mode: expected one of {DQ_MODES}, got {dq_mode!r}")
    if phase == "bwd" and s.dv != s.head_dim:
        # head_dim_v < head_dim: the op pads v and dO (and out) to head_dim and runs the kernels there; the pads'
        # copies are memory_kernels' (this shape's fused kernel is never the 192 / 128 one: it is not in
        # FUSED_HEAD_DIMS at head_dim 192)
        return launches(phase, _padded(s), dq_mode)
    D = fw.tc_head_dim(max(s.head_dim, s.dv))
    b = _bytes(s)
    group = s.heads // s.kvh
    if phase == "fwd":
        # the general kernel reads v and writes out at head_dim_v inside its D-column tiles
        if _fa2(fw, s):
            rows, bc, threads, smem = fw.FA2_ROWS, fw.FA2_KEYS, fw.FA2_THREADS, fw.fa2_shared_bytes(D)
        else:
            rows, bc, threads, smem = fw.TC_ROWS, fw._TC_CFG[D][0], fw.TC_THREADS, fw.tc_shared_bytes(D)
        pad = "pad_" if D in fw.FA2_HEAD_DIMS and not _fa2(fw, s) else ""
        ctas = _tiles(s.seq, s.seq, s.causal, rows, bc, True)
        return [Launch(f"attention_fwd_tc_{pad}d{D}_bf16", "attention_fwd_tc.cu", "", threads, smem,
                       tuple(ctas), s.batch * s.heads, D, 2, b["q"] + b["o"] + b["k"] + b["v"] + b["row"],
                       (rows, bc), 2 * bc * D * 2)]
    if phase != "bwd":
        raise ArgumentError(f"phase: expected 'fwd' or 'bwd', got {phase!r}")
    reads = b["q"] + b["o"] + b["k"] + b["v"] + 2 * b["row"]  # q, dO, k, v, lse, delta
    if s.head_dim in ta.FUSED_HEAD_DIMS:
        br, bc = ta._FUSED_BR[D], ta._FUSED_BC
        ctas = tuple(_key_tiles(s.seq, s.seq, s.causal, bc, br, group))
        det = dq_mode == "deterministic"
        # dQ: per query tile a key tile meets, BR x D fp32 -- RED.ADD to the workspace, or a partial stored
        dq_bytes = sum(ctas) // bc * D * 4 * s.batch * s.kvh
        name = f"attention_bwd_tc_fused_d{D}{'_det' if det else ''}_bf16"
        # cp.async per step: a Q and a dO tile of BR rows (lse / delta runs are small)
        return [Launch(name, "attention_bwd_tc_fused.cu", "", ta._TC_THREADS, ta.fused_shared_bytes(D), ctas,
                       s.batch * s.kvh, D, 5, reads + b["k"] + b["v"] + dq_bytes, (br, bc), 2 * br * D * 2,
                       l2_atomic_pair=0.0 if det else D / bc)]
    smem_kv, smem_q = ta.tc_backward_shared_bytes(D)
    # the dQ kernel's key step: the .cu's ABTC_DQ_BC, recovered from its shared-memory size (2 QR + 2 BC rows)
    dq_bc = (smem_q // ((D + 8) * 2) - 2 * ta._TC_QR) // 2
    kv_ctas = tuple(_key_tiles(s.seq, s.seq, s.causal, ta._TC_BC, ta._TC_BR, group))
    kv = [(f"attention_bwd_tc_dv_d{D}_bf16", 2, b["v"]), (f"attention_bwd_tc_dk_d{D}_bf16", 3, b["k"])] \
        if D == 256 else [(f"attention_bwd_tc_dkdv_d{D}_bf16", 4, b["k"] + b["v"])]
    # cp.async per step: the dK/dV loop loads a Q and a dO tile of BR rows, the dQ loop a K and a V tile
    out = [Launch(n, "attention_bwd_tc.cu", "", ta._TC_THREADS, smem_kv, kv_ctas, s.batch * s.kvh, D, mm,
                  reads + w, (ta._TC_BR, ta._TC_BC), 2 * ta._TC_BR * D * 2) for n, mm, w in kv]
    out.append(Launch(f"attention_bwd_tc_dq_d{D}_bf16", "attention_bwd_tc.cu", "", ta._TC_THREADS, smem_q,
                      tuple(_tiles(s.seq, s.seq, s.causal, ta._TC_QR, dq_bc, True)), s.batch * s.heads, D, 3,
                      reads + b["q"], (ta._TC_QR, dq_bc), 2 * dq_bc * D * 2))
    return out


DQ_MODES = ("atomic", "deterministic")


def memory_kernels(phase: str, s: Shape, variant: str = "mma.sync", dq_mode: str = "atomic",
                   sm90_fused: bool = False) -> list[tuple[str, int]]:
    """The op's small memory-bound kernels around the tensor-core launches, (name, HBM bytes): modelled by
    their bytes alone. Backward: the delta pre-pass (dO and out read, delta written), or for the fused kernel
    its prep (that, plus lse read, lse / delta runs written, the atomic mode's fp32 workspace zeroed) and its
    dQ reduce (atomic: the workspace read; deterministic: every partial read back, the running fp32 sum
    read and written between the launches of DET_WORKSPACE_BYTES of partials), dQ written."""
    if phase != "bwd":
        return []
    from ..ops import attention as ta

    b = _bytes(s)
    if variant != "wgmma" and s.dv != s.head_dim:
        # the mma.sync backward at head_dim_v < head_dim: v, dO and out copied with zero columns up to head_dim
        # (read at head_dim_v, written at head_dim), the kernels' dV narrowed back (read at head_dim, written at
        # head_dim_v); the rest as at head_dim
        p = _bytes(_padded(s))
        pads = [("pad v / grad_out / out to head_dim", b["v"] + p["v"] + 2 * (b["o"] + p["o"])),
                ("narrow dv to head_dim_v", p["v"] + b["v"])]
        return pads + memory_kernels(phase, _padded(s), variant, dq_mode, sm90_fused)
    if variant == "wgmma" and sm90_fused:
        # the sm_90a fused kernel (both modes): the prep zeroes the fp32 accumulator (rows padded to 64), the
        # reduce reads it and writes dQ (d256: the d128 reduce over the accumulator's head-dim halves; 192 / 128:
        # the d64 one over its thirds, the accumulator zeroed by a memset of the same bytes)
        from ..ops import _attention_sm90 as h

        n_ws = s.batch * s.heads * -(-s.seq // h.BWD_FUSED_PAD) * h.BWD_FUSED_PAD * s.head_dim
        rows_pad = s.batch * s.heads * -(-s.seq // h.BWD_FUSED_PAD) * h.BWD_FUSED_PAD * 4
        return [("attention_bwd_tc_prep_bf16", 2 * b["o"] + b["row"] + 2 * rows_pad + 4 * n_ws),
                (f"attention_bwd_tc_dq_reduce_d{h.bwd_fused_acc_split(s.head_dim, s.dv)[0]}_bf16", 4 * n_ws + b["q"])]
    if variant == "wgmma" or s.head_dim not in ta.FUSED_HEAD_DIMS:
        return [("attention_bwd_preprocess_bf16", 2 * b["o"] + b["row"])]  # dO and out read, delta written
    D, br, bc = s.head_dim, ta._FUSED_BR[s.head_dim], ta._FUSED_BC
    nq_pad = -(-s.seq // br) * br
    n_ws = s.batch * s.heads * nq_pad * D  # fp32 workspace elements
    rows_pad = s.batch * s.heads * nq_pad * 4
    zero = 4 * n_ws if dq_mode == "atomic" else 0
    prep = 2 * b["o"] + b["row"] + 2 * rows_pad + zero
    if dq_mode == "atomic":
        return [("attention_bwd_tc_prep_bf16", prep), (f"attention_bwd_tc_dq_reduce_d{D}_bf16", 4 * n_ws + b["q"])]
    n_kt = -(-s.seq // bc)
    chunk = max(1, min(n_kt, ta.DET_WORKSPACE_BYTES // (4 * n_ws)))
    launches_ = -(-n_kt // chunk)
    parts = sum(_key_tiles(s.seq, s.seq, s.causal, bc, br, s.heads // s.kvh)) // bc * D * 4 * s.batch * s.kvh
    acc = 2 * 4 * n_ws * (launches_ - 1)  # the running sum: written by every launch but the last, read by all but the first
    return [("attention_bwd_tc_prep_bf16", prep), (f"attention_bwd_tc_dq_reduce_d{D}_bf16", parts + acc + b["q"])]


# The sm_90a kernel versions the model knows. "2026-11-27": the builds of our H200 measurements (the forward's two
# consumer warpgroups with no ping-pong at any head_dim, the backward at head_dim 64 / 128 only, dense, no softcap;
# head_dim 256 on the mma.sync backward). "current": today's sources (the d128 forward's ping-pong, PING_PONG in
# pykern.ops._attention_sm90; softcap and varlen backward kernels; the d256 backward on wgmma: dK / dV with the head
# dim split across the consumers, dQ on 32-key tiles).
# Only the first was measured: the calibrated model is fitted to it, and what it says of "current" where the two
# differ is a modelled bound, not fitted.
BUILDS = ("2026-11-27", "current")
MEASURED_BUILD = "2026-11-27"
# head_dims of the measured build's sm_90a backward (today's adds 96 and 256)
MEASURED_BWD_HEAD_DIMS = (64, 128)


def _check_build(build: str) -> None:
    if build not in BUILDS:
        raise ArgumentError(f"build: expected one of {BUILDS}, got {build!r}")


def ping_pong(head_dim: int, build: str = "current") -> bool:
    """Whether the sm_90a forward of `build` at head_dim runs its consumer warpgroups in ping-pong (one's softmax
    beside the other's GEMMs): never in the measured 2026-11-27 build, PING_PONG in the current one."""
    _check_build(build)
    if build == MEASURED_BUILD:
        return False
    from ..ops import _attention_sm90 as h
    from ..ops import attention as fw

    return bool(h.PING_PONG.get(fw.tc_head_dim(head_dim), False))


# The FP8 forward's redo rate over random scores (docs/attention_sm90.md, "FP8 forward": a model of the lazy tile's
# acceptance on the test's fp8_inputs, one 128-query tile, reverse tile order): the share of steady tiles where one
# of a warp's rows finds a new max (the lazy tile's redo, the row-max-first tile's rescale), by keys. The upper end
# of each documented range (83-86% at 1024 keys, 39-65% at 4096, 29% at 16384): the bound of random inputs with the
# most rate-p work. Rows peaked on a few keys find fewer new maxima; the rate is the data's, not the kernel's.
FP8_REDO = {1024: 0.86, 4096: 0.65, 16384: 0.29}


def fp8_redo_rate(seq: int) -> float:
    """FP8_REDO at seq keys: linear in log2(seq) between its points, its end values beyond them."""
    import math

    pts = sorted(FP8_REDO.items())
    if seq <= pts[0][0]:
        return pts[0][1]
    for (n0, p0), (n1, p1) in zip(pts, pts[1:]):
        if seq <= n1:
            f = (math.log2(seq) - math.log2(n0)) / (math.log2(n1) - math.log2(n0))
            return p0 + f * (p1 - p0)
    return pts[-1][1]


def fp8_launch(s: Shape, kernels: Sequence[str], redo: float | None = None,
               softcap: bool = False) -> tuple[list[Launch], str]:
    """The FP8 forward's launch (kernels_cu/attention_fwd_fp8_sm90.cu, attention_fwd_sm90_d{64,128,256}[_softcap]_fp8,
    the _softcap kernel where softcap: the same launch, its loop a tanh a score more, the d64 / d128 ones with a
    quarter of their exp2s on the FMA pipe, FA90F8_FEX, all read from its SASS): the
    bf16 kernel's CTA (ROWS queries, a producer warpgroup and two consumer warpgroups) over key tiles of
    FP8_KEYS[d], one a loop iteration, fp8_shared_bytes(d) of shared memory, a grid of every query tile (not
    persistent; causal: longest first), the tensor pipe at the FP8 rate (tensor_rate 2), and a fraction `redo` of
    the steady tiles (None: fp8_redo_rate(seq)) running the loop's rate-p code. HBM: q, k, v one byte an element,
    out bf16, lse fp32. ([], why) where there is no such kernel."""
    from ..ops import _attention_sm90 as h

    d = s.head_dim
    cap = "_softcap" if softcap else ""
    name = h.fp8_kernel_name(d, float(softcap)) if d in h.FP8_HEAD_DIMS else f"attention_fwd_sm90_d{d}{cap}_fp8"
    if s.dv != d or d not in h.FP8_HEAD_DIMS or name not in kernels:
        return [], f"no {name} kernel (head_dim == head_dim_v in {h.FP8_HEAD_DIMS})"
    p = fp8_redo_rate(s.seq) if redo is None else float(redo)
    if not 0.0 <= p <= 1.0:
        raise ArgumentError(f"redo: expected a rate in [0, 1], got {redo!r}")
    b = _bytes(s)
    bc = h.FP8_KEYS[d]
    return [Launch(name, "attention_fwd_fp8_sm90.cu", "sm_90a", h.THREADS, h.fp8_shared_bytes(d),
                   tuple(_tiles(s.seq, s.seq, s.causal, h.ROWS, bc, True)), s.batch * s.heads, d, 2,
                   (b["q"] + b["k"] + b["v"]) // 2 + b["o"] + b["row"], (h.ROWS, bc),
                   mma_warps=(h.THREADS - 128) // 32, tensor_rate=2.0, redo_p=p)], ""


# SM clocks one link of the _det fused kernel's semaphore chain adds: the releasing CTA's red.release reaching L2
# and the next CTA's polling ld.acquire reading it (two L2 round trips, about 600 clocks each on H100 by published
# microbenchmarks), plus the named-barrier hand-off to the consumers. An assumption, not a measurement.
SEM_LINK_CLK = 1500


def sm90_launches(phase: str, s: Shape, kernels: Sequence[str], softcap: bool = False, varlen: bool = False,
                  build: str = "current", dq_mode: str = "atomic", hw: Hardware | None = None,
                  dq_bulk: bool = True, fp8: bool = False, redo: float | None = None) -> tuple[list[Launch], str]:
    """The sm_90a (wgmma) launches of `phase` at shape s when their kernels exist, geometry from
    pykern.ops._attention_sm90 (a producer warpgroup and two MMA warpgroups a CTA); else ([], why).
    softcap / varlen: the backward's _softcap / _varlen kernels (the same geometry; a varlen shape is `batch`
    sequences of `seq` tokens each, the packed layout's best case). At head_dim 256 the dK / dV kernel has 64-key
    CTAs and 32-query tiles (`bwd_dkdv_rows` / `bwd_dkdv_step`), its consumers splitting the head dim; without the
    fused kernel the dQ kernel runs beside it; the 2026-11-27 build had no sm_90a backward there (nor softcap /
    varlen ones). The current backward (dense or varlen, with or without softcap) at head_dim 64 / 96 / 128 / 256
    is the fused kernel when `kernels` has it (dq_mode "atomic" or "deterministic": _det, its
    semaphore chain's fill where the right side is unbounded, `SEM_LINK_CLK` a link; with a bounded right side
    (causal) the adds go in descending key-tile order, which the CTAs' walks already follow: no wait modelled).
    The fused kernel's dQ partials leave by bulk reduce-add (`l2_red_pair`: the "l2" term); their HBM bytes are the
    accumulator's lines read once and written back once when the accumulator runs the CTAs in flight add into fit
    `hw`'s L2 (default: the H100's, the smaller), else every add's (as the REDs were charged). dq_bulk=False charges
    them as per-float REDs to HBM (what the model counted before the kernel sent them in bulk: the "before" of
    format_bulk_dq). fp8: the FP8 forward (fp8_launch; redo its redo rate, None: fp8_redo_rate(seq))."""
    from ..ops import _attention_sm90 as h
    from ..ops import attention as fw

    if fp8:
        if phase != "fwd" or varlen:
            raise ArgumentError(f"fp8: the model covers the dense FP8 forward only (with or without softcap), got "
                                f"phase={phase!r}, varlen={varlen}")
        _check_build(build)
        if build == MEASURED_BUILD:
            return [], f"the {build} build had no FP8 forward"
        return fp8_launch(s, kernels, redo, softcap)
    if dq_mode not in DQ_MODES:
        raise ArgumentError(f"dq_mode: expected one of {DQ_MODES}, got {dq_mode!r}")

    _check_build(build)
    b = _bytes(s)
    mma_warps = (h.THREADS - 128) // 32  # the producer warpgroup (128 threads) issues no MMA
    d, dv = s.head_dim, s.dv
    if dv != d:  # head_dim_v < head_dim: the kernels of that shape (192 / 128), no padding
        return _sm90_dv_launches(phase, s, kernels, softcap, varlen, build, mma_warps, dq_mode, hw)
    D = fw.tc_head_dim(d)
    if phase == "fwd":
        if softcap or varlen:
            raise ArgumentError(f"softcap / varlen: the model covers the dense forward only, got softcap={softcap}, "
                                f"varlen={varlen}")
        # a head dim between the compiled ones runs the next one up (h.padded_dim, as the op dispatches): the
        # kernel's MMA work at D, the HBM bytes at the true head dim (the TMA does not read the zero-filled columns)
        D = h.padded_dim(d) or D
        name = f"attention_fwd_sm90_d{D}_bf16"
        if h.padded_dim(d) is None or name not in kernels:
            return [], f"no {name} kernel (head_dims {h.HEAD_DIMS}, and the multiples of 8 between them)"
        bc = h._CFG[D][0]
        # the current build's causal grid at the PERSISTENT head dims: SMs x CTAs/SM CTAs walking the work tiles
        # longest first (its tail: the short tiles fill in; no last wave of long tiles started late)
        persistent = build != MEASURED_BUILD and s.causal and h.PERSISTENT.get(D, False)
        return [Launch(name, "attention_fwd_sm90.cu", "sm_90a", h.THREADS, h.shared_bytes(D),
                       tuple(_tiles(s.seq, s.seq, s.causal, h.ROWS, bc, True)), s.batch * s.heads, D, 2,
                       b["q"] + b["o"] + b["k"] + b["v"] + b["row"], (h.ROWS, bc * h.LOOP_TILES[D]),
                       mma_warps=mma_warps,
                       persistent=persistent)], ""
    if build == MEASURED_BUILD and (softcap or varlen):
        return [], f"the {build} build had no softcap / varlen sm_90a backward"
    dims = MEASURED_BWD_HEAD_DIMS if build == MEASURED_BUILD else h.BWD_HEAD_DIMS
    names = [h.bwd_kernel_name(p, D, 1.0 if softcap else 0.0, "_bf16", varlen) for p in ("dkdv", "dq")]
    if s.head_dim not in dims or any(n not in kernels for n in names):
        return [], f"no {' / '.join(names)} kernels (head_dims {dims})"
    reads = b["q"] + b["o"] + b["k"] + b["v"] + 2 * b["row"]
    det = dq_mode == "deterministic"
    fused = h.bwd_fused_kernel_name(D, det, "_bf16", 1.0 if softcap else 0.0, varlen)
    if build != MEASURED_BUILD and s.head_dim in h.BWD_FUSED_HEAD_DIMS and fused in kernels:
        # d256: the split kernel's 64 keys a CTA (each consumer computes one of S^T / dP^T and half of dV, dK and
        # dQ^T, so the executed FLOP stay five matmuls a pair)
        c, rows = h.bwd_dkdv_step(D), h.bwd_dkdv_rows(D)
        ctas = _key_tiles(s.seq, s.seq, s.causal, rows, c, s.heads // s.kvh)
        groups = s.batch * s.kvh
        dq_bytes = sum(ctas) // rows * D * 4 * groups  # a C x D fp32 partial per tile pair, added into dQ's accumulator
        red_pair, dq_hbm = 0.0, dq_bytes
        if dq_bulk:
            # one bulk reduce-add of the partial's contiguous run(s) a tile pair, into L2 (where the reduction
            # happens). The accumulator runs of the (batch, kv head) groups the CTAs in flight walk (one CTA an SM at
            # these shared-memory sizes): while they fit L2, a line comes in from HBM once (the prep's zeros) and is
            # written back once, however many key tiles add into it
            hw = hw or HARDWARE["sm_90"]
            ws_group = (s.heads // s.kvh) * -(-s.seq // h.BWD_FUSED_PAD) * h.BWD_FUSED_PAD * D * 4
            per_sm = max(1, hw.smem_per_sm // (h.bwd_fused_shared_bytes(D) + hw.smem_reserved_cta))
            live = min(groups, -(-hw.sms * per_sm // len(ctas)) + 1) * ws_group
            red_pair = D * 4 / rows
            dq_hbm = 2 * groups * ws_group if live <= hw.l2_bytes else dq_bytes
        chain = SEM_LINK_CLK * (len(ctas) - 1) if det and not s.causal else 0.0
        # dQ^T in m64 tiles of the head dim: at d96 two tiles (rows 0.. and 32..), 128 rows executed for 96
        dq_rows = -(-D // 64) * 64
        return [Launch(fused, "attention_bwd_sm90.cu", "sm_90a", h.THREADS, h.bwd_fused_shared_bytes(D),
                       tuple(ctas[::-1] if det and s.causal else ctas), groups, D, 5,
                       reads + b["k"] + b["v"] + dq_hbm, (c, rows), mma_warps=mma_warps,
                       chain_clk=chain, dims=4 * D + dq_rows if dq_rows != D else 0, l2_red_pair=red_pair)], ""
    dq_step = h.bwd_dq_step(D)
    dq = Launch(names[1], "attention_bwd_sm90.cu", "sm_90a", h.THREADS, h.bwd_shared_bytes(D, dq_step),
                tuple(_tiles(s.seq, s.seq, s.causal, h.BWD_ROWS, dq_step, False)), s.batch * s.heads, D, 3,
                reads + b["q"], (h.BWD_ROWS, dq_step), mma_warps=mma_warps)
    # dK / dV: BWD_ROWS keys a CTA, or 64 where the consumers split the head dim (d256; each consumer computes one
    # of S^T / dP^T, so the executed FLOP stay four matmuls a pair)
    c, rows = h.bwd_dkdv_step(D), h.bwd_dkdv_rows(D)
    return [Launch(names[0], "attention_bwd_sm90.cu", "sm_90a", h.THREADS, h.bwd_dkdv_shared_bytes(D),
                   tuple(_key_tiles(s.seq, s.seq, s.causal, rows, c, s.heads // s.kvh)), s.batch * s.kvh,
                   D, 4, reads + b["k"] + b["v"], (c, rows), mma_warps=mma_warps), dq], ""

def _sm90_dv_launches(phase: str, s: Shape, kernels: Sequence[str], softcap: bool, varlen: bool, build: str,
                      mma_warps: int, dq_mode: str = "atomic", hw: Hardware | None = None
                      ) -> tuple[list[Launch], str]:
    """sm90_launches at head_dim_v < head_dim: the sm_90a kernels of that shape (pykern.ops._attention_sm90
    SHAPES / BWD_SHAPES: 192 / 128), their own tiles (the forward d128's; the backward's fused kernel, dq_mode
    "atomic" or "deterministic", on 96-key CTAs and 64-query tiles where `kernels` has it (with or without softcap),
    else the pair: dK / dV on 16-query tiles, dQ on 64-key ones) and matmul dims: forward S over d and P V over
    dv; dK / dV S^T and dK over d, dP^T and dV over dv; dQ S and dQ over d, dP over dv. The 2026-11-27 build had
    none."""
    from ..ops import _attention_sm90 as h

    d, dv = s.head_dim, s.dv
    b = _bytes(s)
    if build == MEASURED_BUILD:
        return [], f"the {build} build had no head_dim {d} / head_dim_v {dv} sm_90a kernels"
    if phase == "fwd":
        if softcap or varlen:
            raise ArgumentError(f"softcap / varlen: the model covers the dense forward only, got softcap={softcap}, "
                                f"varlen={varlen}")
        name = h.kernel_name(d, dv, 0.0, "_bf16")
        if (d, dv) not in h.SHAPES or name not in kernels:
            return [], f"no {name} kernel (shapes {h.SHAPES})"
        bc = h._CFG[d][0]
        return [Launch(name, "attention_fwd_sm90.cu", "sm_90a", h.THREADS, h.shared_bytes(d, dv),
                       tuple(_tiles(s.seq, s.seq, s.causal, h.ROWS, bc, True)), s.batch * s.heads, d, 2,
                       b["q"] + b["o"] + b["k"] + b["v"] + b["row"], (h.ROWS, bc * h.LOOP_TILES[d]),
                       mma_warps=mma_warps, dims=d + dv)], ""
    names = [h.bwd_kernel_name(p, d, 1.0 if softcap else 0.0, "_bf16", varlen, d_v=dv) for p in ("dkdv", "dq")]
    if (d, dv) not in h.BWD_SHAPES or any(n not in kernels for n in names):
        return [], f"no {' / '.join(names)} kernels (shapes {h.BWD_SHAPES})"
    reads = b["q"] + b["o"] + b["k"] + b["v"] + 2 * b["row"]
    det = dq_mode == "deterministic"
    fused = h.bwd_fused_kernel_name(d, det, "_bf16", 1.0 if softcap else 0.0, varlen, d_v=dv)
    if (d, dv) in h.BWD_FUSED_SHAPES and fused in kernels:
        # the fused kernel on FlashAttention-3's tiling (softcap or not): 96-key CTAs streaming
        # 64-query tiles, S, dK and dQ over d, dP and dV over dv; dQ's partial (64 queries x d fp32 a tile pair)
        # leaves by bulk reduce-add (the "l2" term), its HBM bytes as sm90_launches counts them at the other dims
        rows, c = h.bwd_fused_rows(d, dv), h.bwd_fused_step(d, dv)
        ctas = _key_tiles(s.seq, s.seq, s.causal, rows, c, s.heads // s.kvh)
        groups = s.batch * s.kvh
        hw = hw or HARDWARE["sm_90"]
        ws_group = (s.heads // s.kvh) * -(-s.seq // h.BWD_FUSED_PAD) * h.BWD_FUSED_PAD * d * 4
        per_sm = max(1, hw.smem_per_sm // (h.bwd_fused_shared_bytes(d, dv) + hw.smem_reserved_cta))
        live = min(groups, -(-hw.sms * per_sm // len(ctas)) + 1) * ws_group
        dq_bytes = sum(ctas) // rows * d * 4 * groups
        dq_hbm = 2 * groups * ws_group if live <= hw.l2_bytes else dq_bytes
        chain = SEM_LINK_CLK * (len(ctas) - 1) if det and not s.causal else 0.0
        return [Launch(fused, "attention_bwd_sm90.cu", "sm_90a", h.THREADS, h.bwd_fused_shared_bytes(d, dv),
                       tuple(ctas[::-1] if det and s.causal else ctas), groups, d, 5,
                       reads + b["k"] + b["v"] + dq_hbm, (c, rows), mma_warps=mma_warps, chain_clk=chain,
                       dims=3 * d + 2 * dv, l2_red_pair=d * 4 / rows)], ""
    c, dq_step = h.bwd_dkdv_step(d, dv), h.bwd_dq_step(d)
    return [Launch(names[0], "attention_bwd_sm90.cu", "sm_90a", h.THREADS, h.bwd_dkdv_shared_bytes(d, dv),
                   tuple(_key_tiles(s.seq, s.seq, s.causal, h.BWD_ROWS, c, s.heads // s.kvh)), s.batch * s.kvh,
                   d, 4, reads + b["k"] + b["v"], (c, h.BWD_ROWS), mma_warps=mma_warps, dims=2 * (d + dv)),
            Launch(names[1], "attention_bwd_sm90.cu", "sm_90a", h.THREADS, h.bwd_shared_bytes(d, dq_step, dv),
                   tuple(_tiles(s.seq, s.seq, s.causal, h.BWD_ROWS, dq_step, False)), s.batch * s.heads, d, 3,
                   reads + b["q"], (h.BWD_ROWS, dq_step), mma_warps=mma_warps, dims=2 * d + dv)], ""


# ------------------------------------------------------------------------------------------- the terms
@dataclass
class KernelInputs:
    """SASS loop inputs and compiler resources of one kernel on one arch."""

    kernel: str
    arch: str
    loop: LoopInputs
    regs: int
    static_smem: int
    spills: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"kernel": self.kernel, "arch": self.arch, "regs": self.regs, "static_smem": self.static_smem,
                "spills": self.spills, **self.loop.to_dict()}

    def to_record(self) -> dict[str, Any]:
        """Every field, the loop's as written (no derived ratios): what from_record reads back unchanged."""
        return asdict(self)

    @classmethod
    def from_record(cls, d: dict[str, Any]) -> "KernelInputs":
        lp = dict(d["loop"])
        lp["loaders"] = tuple(LoaderLoop(**x) for x in lp.get("loaders", ()))
        return cls(d["kernel"], d["arch"], LoopInputs(**lp), int(d["regs"]), int(d["static_smem"]),
                   int(d.get("spills", 0)))


def makespan(costs: Sequence[float], slots: int) -> float:
    """Greedy list scheduling: each cost, in order, goes to the first free of `slots` slots (as the block
    scheduler hands CTAs to free SM slots); the time the last one ends."""
    if slots <= 0:
        raise ArgumentError(f"slots: expected >= 1, got {slots}")
    if len(costs) <= slots:
        return max(costs, default=0.0)
    heap = [0.0] * slots
    for c in costs:
        t = heapq.heappop(heap)
        heapq.heappush(heap, t + c)
    return max(heap)


def strided_span(costs: Sequence[float], slots: int) -> float:
    """A persistent grid of `slots` CTAs walking the work tiles `costs` (in the kernel's order) a round of `slots`
    tiles at a time in snake order (CTA k takes tile k of even rounds, slots - 1 - k of odd ones, as
    fa90_forward's producer): the largest CTA's sum."""
    if slots <= 0:
        raise ArgumentError(f"slots: expected >= 1, got {slots}")
    sums = [0.0] * min(slots, len(costs))
    for i, c in enumerate(costs):
        r, k = divmod(i, slots)
        sums[slots - 1 - k if r & 1 else k] += c
    return max(sums, default=0.0)


def _launch_rates(lau: Launch, k: KernelInputs,
                  hw: Hardware) -> tuple[int, Occupancy, float, float, float, float, float, int, int]:
    """What kernel_bound and calibrated_launch both start from: (warps a CTA, occupancy, the tensor pipe's
    fraction, issued instructions and shared-memory bytes per MMA of the loop, MMAs per (query, key) tile pair,
    the loader's trips a step, CTAs of the grid, CTAs resident a SM). The block scheduler spreads CTAs over the
    SMs first: a grid smaller than SMs x CTAs/SM leaves fewer CTAs on each SM (each then gets a larger share)."""
    loop = k.loop
    occ = occupancy(k.regs, lau.threads, lau.smem + k.static_smem, hw)
    if occ.ctas == 0:
        raise ArgumentError(f"{lau.kernel}: one CTA does not fit an SM of {hw.part} ({occ.limiter})")
    insns_step, smem_step, trips = loop.per_step(lau.fill / lau.loop_warps)
    # a fraction redo_p of the steps also issue the rate-p code (the rescale block inside the body, or the redo
    # path after it)
    insns_step += lau.redo_p * loop.redo_insns
    smem_step += lau.redo_p * loop.redo_smem
    n_ctas = len(lau.ctas) * lau.groups
    return (-(-lau.threads // 32), occ, 1.0 if loop.wgmma else hw.mma_sync_fraction, insns_step / loop.mma,
            smem_step / loop.mma, 2.0 * lau.pair_dims / MMA_FLOP, trips, n_ctas,
            max(1, min(occ.ctas, -(-n_ctas // hw.sms))))


def kernel_bound(lau: Launch, k: KernelInputs, hw: Hardware) -> dict[str, Any]:
    """Per-term times (s) of one launch and the modelled bound. Each CTA's cost in SM clocks:
    issue (MMAs x instr/MMA + warps x straight-line) / 4; shared memory MMAs x bytes/MMA / 128; tensor MMAs x
    4096 / (FLOP per clock x pipe fraction); a slot (one of the r CTAs resident on an SM, r = CTAs/SM, fewer
    when the grid does not fill every SM that deep) runs at 1/r of the SM, so a CTA holds its slot for r x its
    cost (a tail CTA keeps that share: pessimistic for the last wave)."""
    loop = k.loop
    warps, occ, frac, per_mma, smem_per_mma, per_pair_mma, trips, n_ctas, resident = _launch_rates(lau, k, hw)
    slots = hw.sms * resident
    terms_clk: dict[str, Callable[[float], float]] = {
        "issue": lambda m: (m * per_mma + warps * loop.straight) / hw.issue_clk,
        "smem": lambda m: m * smem_per_mma / hw.smem_bytes_clk,
        "tensor": lambda m: m * MMA_FLOP / (hw.tensor_flop_clk * frac * lau.tensor_rate),
        "mufu": lambda m: m * (loop.mufu + lau.redo_p * loop.redo_mufu) / loop.mma * 32 / hw.mufu_clk,
        "fma": lambda m: m * (loop.fma + lau.redo_p * loop.redo_fma) / loop.mma * 32 / hw.fma_clk,
    }
    if lau.l2_red_pair:  # the bulk reduce-adds: an SM's share of the L2 bandwidth
        terms_clk["l2"] = lambda m: m / per_pair_mma * lau.l2_red_pair * hw.sms / hw.l2_bytes_clk
    # the slot time of each CTA of one group, per term; the grid repeats the group `groups` times
    group_mma = [p * per_pair_mma for p in lau.ctas]
    per_term = {name: [resident * f(m) for m in group_mma] for name, f in terms_clk.items()}
    worst = [max(c) for c in zip(*per_term.values())]
    times: dict[str, float] = {name: lau.schedule(c, slots) / hw.clock_hz for name, c in per_term.items()}
    combined = lau.schedule(worst, slots) / hw.clock_hz
    ideal = sum(worst) * lau.groups / slots / hw.clock_hz
    times["hbm"] = lau.hbm_bytes / hw.hbm_bytes_s
    # the deterministic dQ's semaphore chain: its fill is latency in series with the CTAs' work, not a resource
    chain = lau.chain_clk / hw.clock_hz
    t = max(combined + chain, times["hbm"])
    bind = max(times, key=lambda n: times[n])
    if chain:
        times["semaphore"] = chain
    return {"kernel": lau.kernel, "time_s": t, "binding": bind, "terms_s": times, "ctas": n_ctas,
            "ctas_per_sm": occ.ctas, "resident_per_sm": resident, "occupancy_limiter": occ.limiter,
            "waves": n_ctas / (hw.sms * occ.ctas),
            "tail_efficiency": ideal / combined if combined else 1.0, "executed_flops": lau.executed_flops,
            "tensor": "wgmma" if loop.wgmma else "mma.sync", "pipe_fraction": frac, "per_mma": per_mma,
            "smem_per_mma": smem_per_mma, "loader_trips": trips}


# ------------------------------------------------------------------------------------------- SASS access
class SassSource:
    """Loop inputs and resources per (kernel, arch), from pykern's compile cache and cuobjdump (each
    (source file, arch) disassembled once)."""

    def __init__(self) -> None:
        self._sr: Any = None
        self._text: dict[tuple[str, str], tuple[str, Any, tuple[dict, dict]]] = {}
        self._inputs: dict[tuple[str, str], KernelInputs] = {}
        self._where: dict[str, Path] | None = None

    def kernels(self) -> dict[str, Path]:
        if self._where is None:
            from ..registry import parse_file, source_files

            self._where = {}
            for src in source_files():
                if "attention" not in src.name:
                    continue
                for spec in parse_file(src):
                    self._where.setdefault(spec.name, src)
        return self._where

    def _listing(self, src: Path, arch: str) -> tuple[str, Any, tuple[dict, dict]]:
        key = (str(src), arch)
        if key not in self._text:
            from .. import cache

            if self._sr is None:
                self._sr = _sass_report()
            mod = cache.get_module(src, arch)
            if mod.kind != "cubin":
                raise BackendUnavailable(f"{src.name} for {arch}: no cubin to disassemble (got {mod.kind})")
            text = self._sr.disassemble(mod.image)
            self._text[key] = (text, mod.resources, (self._sr._instructions(text), self._sr.steady_state_loops(text)))
        return self._text[key]

    def compiled_name(self, kernel: str) -> str:
        """The name `kernel` has in the compiled sources (today's: itself)."""
        return kernel

    def inputs(self, kernel: str, arch: str) -> KernelInputs:
        if (kernel, arch) in self._inputs:
            return self._inputs[(kernel, arch)]
        where = self.kernels()
        if kernel not in where:
            raise ArgumentError(f"kernel: {kernel!r} is not a registered attention kernel")
        text, res, parsed = self._listing(where[kernel], arch)
        name = self.compiled_name(kernel)
        loop = loop_inputs(text, name, self._sr, parsed)
        if loop is None:
            raise ArgumentError(f"kernel: {kernel} has no MMA loop in its {arch} SASS")
        r = res[name]
        out = KernelInputs(kernel, arch, loop, r.registers, r.shared_bytes, r.spill_stores + r.spill_loads)
        self._inputs[(kernel, arch)] = out
        return out


# The loop inputs and resources of the kernels our 2026-11-27 H200 measurements ran, compiled from the sources of
# the commit that was measured (tools/attention_sass_snapshot.py writes it): the measured build's points must be
# modelled with the SASS that ran, not with today's (a faster loop today would otherwise pull the fitted constants
# up to absorb the old times).
MEASURED_SASS = Path(__file__).resolve().parents[2] / "docs" / "measured" / "2026-11-27-h200" / "sass_inputs.json"


class SassSnapshot:
    """SassSource's interface over a JSON snapshot of tools/attention_sass_snapshot.py: the KernelInputs of the
    kernels of one measured build (under today's kernel names), compiled from the sources of `commit`. Needs no
    NVRTC; a kernel or arch outside the snapshot is an ArgumentError."""

    def __init__(self, path: str | Path = MEASURED_SASS) -> None:
        try:
            doc = json.loads(Path(path).read_text())
            self.commit: str = doc["commit"]
            self.build: str = doc["build"]
            self._inputs = {(r["kernel"], r["arch"]): KernelInputs.from_record(r) for r in doc["kernels"]}
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ArgumentError(f"path: expected a SASS snapshot of tools/attention_sass_snapshot.py, "
                                f"got {str(path)!r} ({type(e).__name__}: {e})")
        self.path = Path(path)

    def kernels(self) -> dict[str, Path]:
        return {k: self.path for k, _a in self._inputs}

    def inputs(self, kernel: str, arch: str) -> KernelInputs:
        if (kernel, arch) not in self._inputs:
            raise ArgumentError(f"kernel: ({kernel!r}, {arch!r}) is not in the {self.build} SASS snapshot "
                                f"{self.path.name} (commit {self.commit[:12]})")
        return self._inputs[(kernel, arch)]


_SNAPSHOT: SassSnapshot | None = None


def sass_for(build: str) -> SassSource | SassSnapshot:
    """The SASS a build's kernels are modelled with: the measured build's snapshot (MEASURED_SASS, read once),
    or today's sources compiled now for "current"."""
    global _SNAPSHOT
    _check_build(build)
    if build == MEASURED_BUILD:
        if _SNAPSHOT is None:
            _SNAPSHOT = SassSnapshot()
        return _SNAPSHOT
    return SassSource()


# ------------------------------------------------------------------------------------------- predictions
@dataclass
class Prediction:
    arch: str
    part: str
    phase: str
    shape: Shape
    variant: str  # "mma.sync" (the tc kernels) or "wgmma" (sm_90a)
    time_s: float
    tflops: float  # useful FLOP / time
    pct_peak: float
    binding: str  # the largest term of the launch that takes longest ("issue (dq)", "hbm", ...)
    kernels: list[dict[str, Any]] = field(default_factory=list)
    inputs: list[dict[str, Any]] = field(default_factory=list)
    loop_note: str = ""
    dq_mode: str = ""  # the fused backward's dQ mode ("atomic" | "deterministic"); "" where none applies
    kind: str = ""  # the sm_90a backward's kernels: "" dense, "softcap", "varlen" or "softcap varlen"
    dtype: str = "bf16"  # the inputs' type: "bf16", or "e4m3" (the FP8 forward; pct_peak then of the FP8 peak)
    redo: float | None = None  # the FP8 forward's redo rate p (Launch.redo_p); None for the bf16 kernels

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["shape"] = asdict(self.shape)
        return d


def _short(kernel: str) -> str:
    for key, name in (("dq_reduce", "dq reduce"), ("preprocess", "preprocess"), ("_prep", "prep")):
        if key in kernel:
            return name
    m = re.search(r"_(dkdv|dq|dk|dv|fused_det|fused)_d\d+", kernel)
    return m.group(1) if m else "fwd"


def predict(arch: str, phase: str, shape: Shape, sass: SassSource | None = None, variant: str = "mma.sync",
            dq_mode: str = "atomic", softcap: bool = False, varlen: bool = False, fp8: bool = False,
            redo: float | None = None) -> Prediction:
    """Modelled bound of the bf16 tensor-core attention op `phase` at `shape` on the part of `arch`.
    arch "sm_90a" (or variant "wgmma" on sm_90): the Hopper wgmma kernels; "sm_80" / "sm_90": the mma.sync ones.
    dq_mode: the fused mma.sync backward's dQ ("atomic" or "deterministic"). fp8: the e4m3 forward on sm_90a
    (fp8_launch: the tensor pipe at the FP8 rate, its rate-p code at rate `redo`, None: fp8_redo_rate(seq)); its
    TFLOP/s counted as the bf16 forward's (useful_flops, as FlashAttention-3 counts FP8), pct_peak of the FP8 peak
    (twice the bf16 one)."""
    shape.check()
    hw = hardware(arch)
    sass = sass or SassSource()
    if arch == "sm_90a":
        variant = "wgmma"
    if variant == "wgmma":
        if hw.arch != "sm_90":
            raise ArgumentError(f"variant: wgmma kernels are sm_90a kernels, not for {arch}")
        lts, why = sm90_launches(phase, shape, list(sass.kernels()), softcap, varlen, dq_mode=dq_mode, hw=hw,
                                 fp8=fp8, redo=redo)
        if not lts:
            raise ArgumentError(f"variant: wgmma: {why}")
    elif fp8:
        raise ArgumentError(f"fp8: the FP8 forward is an sm_90a (wgmma) kernel, not variant {variant!r}")
    elif variant == "mma.sync":
        lts = launches(phase, shape, dq_mode)
    else:
        raise ArgumentError(f"variant: expected 'mma.sync' or 'wgmma', got {variant!r}")
    rows, inputs = [], []
    t = 0.0
    for lau in lts:
        k = sass.inputs(lau.kernel, lau.arch or hw.arch)
        r = kernel_bound(lau, k, hw)
        rows.append(r)
        inputs.append({**k.to_dict(), "per_mma": r["per_mma"], "smem_per_mma": r["smem_per_mma"],
                       "loader_trips": r["loader_trips"], "threads": lau.threads, "smem": lau.smem + k.static_smem,
                       "ctas_per_sm": r["ctas_per_sm"], "occupancy_limiter": r["occupancy_limiter"],
                       "step": list(lau.step)})
        t += r["time_s"]
    sm90_fused = any("_sm90_fused" in lau.kernel for lau in lts)
    for name, nbytes in memory_kernels(phase, shape, variant, dq_mode, sm90_fused):
        tp = nbytes / hw.hbm_bytes_s
        rows.append({"kernel": name, "time_s": tp, "binding": "hbm", "terms_s": {"hbm": tp}, "hbm_bytes": nbytes})
        t += tp
    top = max(rows, key=lambda r: r["time_s"])
    binding = top["binding"] + (f" ({_short(top['kernel'])})" if len(rows) > 1 else "")
    fl = useful_flops(shape, phase)
    note = "; ".join(sorted({f"{_short(i['kernel'])}: {'flat loop' if i['loop'] == 'flat' else 'no flat loop, innermost MMA loop'}"
                             for i in inputs}))
    label = "sm_90a" if variant == "wgmma" else hw.arch
    peak = hw.peak * (lts[0].tensor_rate if fp8 else 1.0)
    pred = Prediction(label, hw.part, phase, shape, variant, t, fl / t / 1e12, 100 * fl / t / peak, binding,
                      rows, inputs, note)
    if fp8:
        pred.dtype, pred.redo = "e4m3", lts[0].redo_p
    pred.kind = " ".join(n for n, on in (("softcap", softcap), ("varlen", varlen)) if on)
    pred.dq_mode = dq_mode if (phase == "bwd" and variant == "mma.sync" and shape.head_dim in _fused_dims()) \
        or sm90_fused else ""
    return pred


def _fused_dims() -> tuple[int, ...]:
    from ..ops import attention as ta

    return tuple(ta.FUSED_HEAD_DIMS)


# The table's shapes: FlashAttention-2's benchmark setting (batch x seq = 16k tokens, hidden 2048, so 32 heads
# of 64 or 16 heads of 128), which is also where FA2's published figures were measured.
SEQS = (1024, 4096, 16384)
HEAD_DIMS = (64, 128)
TOKENS = 16384
HIDDEN = 2048
ARCHS = ("sm_90", "sm_90a", "sm_80")  # H100 mma.sync, H100 wgmma (sm_90a kernels), A100 mma.sync


def default_shapes(seqs: Sequence[int] = SEQS, head_dims: Sequence[int] = HEAD_DIMS,
                   causal: Sequence[bool] = (False, True)) -> list[Shape]:
    return [Shape(max(1, TOKENS // n), HIDDEN // d, n, d, c) for d in head_dims for c in causal for n in seqs]


# head_dim 192 with head_dim_v 128 (DeepSeek-V3's prefill / MLA training shape): the same tokens, heads from the
# hidden size over head_dim_v (16)
DV_SHAPE = (192, 128)


def default_dv_shapes(seqs: Sequence[int] = SEQS, causal: Sequence[bool] = (False, True)) -> list[Shape]:
    d, dv = DV_SHAPE
    return [Shape(max(1, TOKENS // n), HIDDEN // dv, n, d, c, head_dim_v=dv) for c in causal for n in seqs]


# The sm_90a backward's kernel kinds beside the dense one: (softcap, varlen).
SM90_BWD_KINDS = ((False, False), (True, False), (False, True), (True, True))


def table_rows(archs: Sequence[str] = ARCHS, phases: Sequence[str] = ("fwd", "bwd"),
               shapes: Sequence[Shape] | None = None, sass: SassSource | None = None,
               dq_modes: Sequence[str] = DQ_MODES, sm90_bwd_shapes: Sequence[Shape] | None = None
               ) -> dict[str, Any]:
    """Every prediction plus the skipped ones with why. sm_90a: the wgmma kernels (skipped where there are
    none), the backward also with its softcap / varlen kernels (SM90_BWD_KINDS) and at `sm90_bwd_shapes`
    (default: with the default shapes, head_dim 96 (the fused kernel on 32-column boxes) and 256 (the fused
    kernel: dK / dV with the head dim split across the consumers, dQ's partials added from it) at the same seqs and
    hidden size); the fused
    mma.sync backward in each of `dq_modes`. The default shapes include 192 / 128 (default_dv_shapes) on every
    arch: forward and backward on the sm_90a kernels of that shape, on mma.sync the head_dim 256 kernels (the
    backward on v / dO padded)."""
    sass = sass or SassSource()
    if sm90_bwd_shapes is None:
        sm90_bwd_shapes = default_shapes(head_dims=(96, 256)) if shapes is None else ()
    shapes = list(shapes) if shapes is not None else default_shapes() + default_dv_shapes()
    preds, skipped = [], {}
    for arch in archs:
        for phase in phases:
            extra = list(sm90_bwd_shapes) if arch == "sm_90a" and phase == "bwd" else []
            for s in shapes + extra:
                kinds: Sequence[tuple[bool, bool]] = ((False, False),)
                if arch == "sm_90a":
                    kinds = SM90_BWD_KINDS if phase == "bwd" else kinds
                    kinds = [(sc, vl) for sc, vl in kinds
                             if sm90_launches(phase, s, list(sass.kernels()), sc, vl)[0]]
                    if not kinds:
                        skipped.setdefault(f"sm_90a {phase} d{s.label}",
                                           sm90_launches(phase, s, list(sass.kernels()))[1])
                        continue
                    for sc, vl in kinds:
                        # the fused backward (dense or varlen, with or without softcap) in each dQ mode
                        fused = phase == "bwd" and any("_sm90_fused" in lau.kernel for lau in sm90_launches(
                            phase, s, list(sass.kernels()), sc, vl)[0])
                        for m in (dq_modes if fused else ("atomic",)):
                            preds.append(predict(arch, phase, s, sass, dq_mode=m, softcap=sc, varlen=vl))
                    continue
                modes = dq_modes if (phase == "bwd" and s.head_dim in _fused_dims()) else ("atomic",)
                for m in modes:
                    preds.append(predict(arch, phase, s, sass, dq_mode=m))
    return {"hardware": {a: {**hardware(a).to_dict(), "arch": a} for a in archs},
            "predictions": [p.to_dict() for p in preds], "skipped": skipped}


def format_table(doc: dict[str, Any]) -> str:
    """The text table: per kernel and arch the SASS inputs, then per shape the modelled bound."""
    lines = ["Modelled bound of pykern's bf16 tensor-core attention (no faster than this; from our SASS, the ops'",
             "launch geometry and published rates; nothing calibrated from a measured speed).", ""]
    for a, hw in doc["hardware"].items():
        pipe = "wgmma kernels at the full rate" if a == "sm_90a" else \
            f"mma.sync kernels at {hw['mma_sync_fraction']:.2f} of it"
        lines.append(f"{a}: {hw['part']}, {hw['sms']} SMs at {hw['clock_hz'] / 1e6:.0f} MHz, "
                     f"{hw['peak'] / 1e12:.0f} TFLOP/s dense bf16 ({pipe}), "
                     f"{hw['hbm_bytes_s'] / 1e12:.2f} TB/s, {hw['issue_clk']} issue/clk/SM, "
                     f"{hw['smem_bytes_clk']} B/clk/SM shared")
    seen, inp = set(), []
    for p in doc["predictions"]:
        for i in p["inputs"]:
            key = (i["kernel"], p["arch"])
            if key not in seen:
                seen.add(key)
                inp.append((p["arch"], i))
    lines += ["", "SASS inputs per warp. loop 'inner': no flat loop, so the innermost loop holding MMAs, every path of its",
              "body once, its cp.async tile-loader loops at 'trips' x their 16-byte path (trips from the launch",
              "geometry), other loops inside it once; 'static' = the body with every inner loop once.",
              f"{'arch':6s} {'kernel':42s} {'loop':5s} {'instr/MMA':>9s} {'static':>6s} {'trips':>5s} {'ldsm/MMA':>8s} "
              f"{'smemB/MMA':>9s} {'mufu/MMA':>8s} {'fma/MMA':>7s} {'straight':>8s} {'regs':>4s} {'smem B':>7s} {'CTAs/SM':>7s} {'limiter':>13s}"]
    for a, i in inp:
        lines.append(f"{a:6s} {i['kernel']:42s} {i['loop']:5s} {i['per_mma']:9.2f} {i['static_per_mma']:6.2f} "
                     f"{i['loader_trips']:5.1f} {i['ldsm_per_mma']:8.3f} {i['smem_per_mma']:9.1f} "
                     f"{i['mufu'] / i['mma']:8.3f} {i.get('fma', 0) / i['mma']:7.3f} {i['straight']:8d} "
                     f"{i['regs']:4d} {i['smem']:7d} {i['ctas_per_sm']:7d} {i['occupancy_limiter']:>13s}")
    lines += ["", "Modelled bound, TFLOP/s of useful FLOP (FlashAttention's count), batch = 16384 / seq, "
              "hidden 2048. bwd: dQ by fp32 atomics (mma.sync: its RED bytes in the HBM term; the sm_90a fused kernel:",
              "bulk reduce-adds into L2, the l2 term); bwd det: the deterministic dQ (mma.sync: per-key-tile partials",
              "written and read back). Binding: the largest term of the longest launch.",
              "sm_90a bwd so / va: its softcap / varlen kernels (varlen: batch sequences of seq tokens each); sm_90a bwd",
              "d96 and d256: the fused wgmma kernel, as at d64 / d128. d 192/128: head_dim / head_dim_v",
              "(sm_90a: that shape's kernels; mma.sync: the d256 kernels, the backward on v / dO padded to 192, the",
              "copies in its bytes). sm_90a rows: the current build (the d128 forward's",
              "ping-pong); none of them fitted to a measurement.",
              f"{'arch':6s} {'pass':9s} {'d':>7s} {'causal':>6s} {'seq':>6s} {'batch':>5s} {'heads':>5s} "
              f"{'ms':>8s} {'TFLOP/s':>8s} {'% peak':>6s}  binding term"]
    for p in doc["predictions"]:
        s = p["shape"]
        ph = p["phase"] + (" det" if p.get("dq_mode") == "deterministic" else "") + \
            "".join(f" {k[:2]}" for k in p.get("kind", "").split())
        dl = str(s["head_dim"]) if s.get("head_dim_v") in (None, s["head_dim"]) else f"{s['head_dim']}/{s['head_dim_v']}"
        lines.append(f"{p['arch']:6s} {ph:9s} {dl:>7s} {str(s['causal']):>6s} {s['seq']:6d} "
                     f"{s['batch']:5d} {s['heads']:5d} {p['time_s'] * 1e3:8.3f} {p['tflops']:8.0f} "
                     f"{p['pct_peak']:6.1f}  {p['binding']}")
    for k, why in doc.get("skipped", {}).items():
        lines.append(f"skipped {k}: {why}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------- the FP8 forward
# head_dims of the FP8 forward's table (pykern.ops._attention_sm90.FP8_HEAD_DIMS)
FP8_TABLE_HEAD_DIMS = (64, 128, 256)
# ... and the _softcap kernels' rows at these (d64 / d128: the kernels whose MUFU binds, a tanh and an exp2 a score,
# where FA90F8_FEX moves a quarter of their exp2s to the FMA pipe)
FP8_TABLE_SOFTCAP_HEAD_DIMS = (64, 128)


def fp8_table_rows(shapes: Sequence[Shape] | None = None, sass: SassSource | None = None,
                   redo: float | None = None, softcap_shapes: Sequence[Shape] | None = None) -> dict[str, Any]:
    """The FP8 forward's modelled bound (predict(..., fp8=True)) on the H100's sm_90a part at `shapes` (default:
    the table's seqs and hidden size at FP8_TABLE_HEAD_DIMS, causal and not) and, with softcap, at
    `softcap_shapes` (default: the same at FP8_TABLE_SOFTCAP_HEAD_DIMS where `shapes` is None, else none), each at
    redo rate `redo` (None: fp8_redo_rate(seq)). Shapes without an FP8 kernel are skipped with why."""
    sass = sass or SassSource()
    if softcap_shapes is None:
        softcap_shapes = default_shapes(head_dims=FP8_TABLE_SOFTCAP_HEAD_DIMS) if shapes is None else []
    shapes = list(shapes) if shapes is not None else default_shapes(head_dims=FP8_TABLE_HEAD_DIMS)
    preds, skipped = [], {}
    for s, cap in [(s, False) for s in shapes] + [(s, True) for s in softcap_shapes]:
        lts, why = fp8_launch(s, list(sass.kernels()), redo, cap)
        if not lts:
            skipped[f"sm_90a fwd e4m3 d{s.label}{' softcap' if cap else ''}"] = why
            continue
        preds.append(predict("sm_90a", "fwd", s, sass, softcap=cap, fp8=True, redo=redo))
    return {"hardware": {"sm_90a": {**hardware("sm_90a").to_dict(), "arch": "sm_90a",
                                    "fp8_peak": 2 * hardware("sm_90a").peak}},
            "predictions": [p.to_dict() for p in preds], "skipped": skipped}


def format_fp8_table(doc: dict[str, Any]) -> str:
    """The FP8 forward's table: its kernels' SASS inputs (the steady loop and its rate-p code), then per shape the
    modelled bound at its rate p, with the tensor, mufu and issue terms."""
    hw = doc["hardware"]["sm_90a"]
    lines = ["Modelled bound of pykern's FP8 (e4m3) attention forward, sm_90a (no faster than this at redo rate p; from",
             "our SASS, the ops' launch geometry and published rates; nothing calibrated from a measured speed).",
             f"sm_90a: {hw['part']}, {hw['sms']} SMs at {hw['clock_hz'] / 1e6:.0f} MHz, {hw['fp8_peak'] / 1e12:.0f} "
             f"TFLOP/s dense e4m3 (QGMMA: twice the {hw['peak'] / 1e12:.0f} bf16), {hw['mufu_clk']} MUFU results/clk/SM, "
             f"{hw['hbm_bytes_s'] / 1e12:.2f} TB/s",
             "MMAs in m16n8k16-equivalents of 4096 FLOP (a QGMMA m64nNk32 is 2N/8 a warp), run at twice the bf16 rate.",
             "SASS inputs per warp and loop iteration (one key tile): the flat loop (static) without its rate-p code,",
             "and that code ('redo' columns), taken by a fraction p of the tiles (a row max of the warp grew): the",
             "rescale of O and l the row-max-first tile skips otherwise (or, a lazy tile's, its exact redo).",
             f"{'kernel':34s} {'MMA':>5s} {'static':>6s} {'redo':>5s} {'mufu':>5s} {'redo mufu':>9s} {'fma':>5s} "
             f"{'redo fma':>8s} {'smem B':>7s} {'straight':>8s} {'regs':>4s} {'smem':>7s} {'CTAs/SM':>7s}"]
    seen = set()
    for p in doc["predictions"]:
        for i in p["inputs"]:
            if i["kernel"] in seen:
                continue
            seen.add(i["kernel"])
            lines.append(f"{i['kernel']:34s} {i['mma']:5.0f} {i['insns']:6d} {i['redo_insns']:5d} {i['mufu']:5d} "
                         f"{i['redo_mufu']:9d} {i['fma']:5d} {i['redo_fma']:8d} {i['smem_bytes']:7.0f} "
                         f"{i['straight']:8d} {i['regs']:4d} {i['smem']:7d} {i['ctas_per_sm']:7d}")
    lines += ["", "Modelled bound, TFLOP/s of useful FLOP (FlashAttention-3's count for FP8: the bf16 forward's, 4 pairs d),",
              "batch = 16384 / seq, hidden 2048; % of the dense e4m3 peak; p: the rate a warp finds a new row max",
              "(default: random scores, fp8_redo_rate); terms: one launch's tensor / mufu / issue / smem time.",
              "Binding: the largest term (= the terms within 0.5% of it: a tie).",
              f"{'d':>4s} {'softcap':>7s} {'causal':>6s} {'seq':>6s} {'batch':>5s} {'heads':>5s} {'p':>5s} {'ms':>8s} "
              f"{'TFLOP/s':>8s} "
              f"{'% peak':>6s} {'tensor us':>9s} {'mufu us':>8s} {'issue us':>8s} {'smem us':>8s}  binding term"]
    for p in doc["predictions"]:
        s = p["shape"]
        t = p["kernels"][0]["terms_s"]
        ties = [n for n in t if n != p["binding"] and t[n] >= 0.995 * t[p["binding"]]]
        lines.append(f"{s['head_dim']:4d} {str('softcap' in p['kind']):>7s} {str(s['causal']):>6s} {s['seq']:6d} "
                     f"{s['batch']:5d} {s['heads']:5d} "
                     f"{p['redo']:5.2f} {p['time_s'] * 1e3:8.3f} {p['tflops']:8.0f} {p['pct_peak']:6.1f} "
                     f"{t['tensor'] * 1e6:9.0f} {t['mufu'] * 1e6:8.0f} {t['issue'] * 1e6:8.0f} {t['smem'] * 1e6:8.0f}  "
                     f"{' = '.join([p['binding'], *ties])}")
    for k, why in doc.get("skipped", {}).items():
        lines.append(f"skipped {k}: {why}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------- calibrated model
# The bound above takes every term of a CTA to overlap the others. The measured kernels do not: Nsight Compute on
# the sm_90a d128 forward (2026-11-27) shows the tensor pipe 60% active and 36.7% of issue gaps at a CTA barrier,
# because the softmax of a tile runs between that warpgroup's two GEMMs. The calibrated model adds, per CTA, the
# time that does not overlap, with seven constants, each with one physical meaning, fitted (least squares on the
# log of measured / modelled time; call_us held: HELD) to our own H200 measurements and to nobody else's:
#
# * sigma_tile_clk: the wgmma backward kernels, SM clocks per key (or query) tile a CTA steps through that do not
#   overlap the tensor pipe: the softmax's issue time between the warpgroup's S = QK^T wait and its dP / dS work,
#   plus the named / CTA barrier waits of the producer-consumer hand-off. Added to the CTA's overlapped cost.
# * fwd_tile_clk: the wgmma forward of the measured build (2026-11-27: no ping-pong), SM clocks per key tile a CTA
#   walks during which the tensor pipe idles: the softmax between a consumer warpgroup's S = QK^T wait and its PV
#   commit (both warpgroups in lock-step, held there by the CTA barrier of the producer hand-off: Nsight Compute
#   counted 36.7% of issue gaps at that barrier) plus the barrier stalls themselves. In series with the tensor term.
# * fwd_cta_clk: the same forward, SM clocks a CTA spends outside its loop beyond its edge bytes: barrier and tensor-map
#   set-up, the first TMA round trip before the first GEMM, the last PV's drain (weighs most where a CTA walks few
#   tiles: causal 1k).
# * rho_mma_sync: mma.sync kernels, the share of the non-binding terms (issue, shared memory, tensor, mufu) that
#   does not overlap the binding one (0: perfect overlap, the bound; 1: every term in series); shared memory and
#   tensor hide each other (_HIDDEN_BY), so a shared-memory-bound CTA adds rho x (issue + mufu), not its tensor time.
# * edge_bytes_clk: bytes per SM clock at which a CTA's prologue and epilogue tiles move (Q in / O out in the
#   forward, K, V in / dK, dV out in the dK/dV kernels, Q, dO in / dQ out in the dQ kernels), not overlapped with
#   its own loop (one CTA an SM on sm_90a, so nothing else hides them).
# * call_us: fixed GPU time per op call: kernel launches and gaps between them, allocations' memsets, the small
#   kernels outside the model.
# * l2_red_clk: fp32 adds per SM clock, for the whole GPU, that the L2's atomic units take as RED.E.ADD.F32 (one a
#   float): the fused mma.sync backward's dQ in its atomic mode (Launch.l2_atomic_pair, D / BC a (query, key) pair),
#   an SM's share of it per CTA, the "l2 red" term (NVIDIA publishes no L2 atomic rate). Fitted to our own 12 rows of
#   that kernel (d64 / d128, 1k / 4k / 16k, causal and not) with the others.
#
# The measured kernels are the 2026-11-27 builds, and the fit counts their own SASS (MEASURED_SASS: compiled from
# the measured commit's sources), so the constants do not absorb what today's kernels changed since; they do absorb
# the difference between the nominal 1830 MHz tensor clock and the measured 1.77-1.98 GHz.
@dataclass(frozen=True)
class Calibration:
    sigma_tile_clk: float
    rho_mma_sync: float
    edge_bytes_clk: float
    call_us: float
    fwd_tile_clk: float = 0.0
    fwd_cta_clk: float = 0.0
    l2_red_clk: float = 0.0

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


# What `fit(MEASURED)` returns on the measured build's SASS snapshot (python -m pykern.bench --attention-model --fit
# docs/measured/2026-11-27-h200/attention.json); tests/test_attention_model_fit.py checks that it still does.
FITTED = Calibration(sigma_tile_clk=1288.4, rho_mma_sync=0.62757, edge_bytes_clk=8.9746, call_us=0.0,
                     fwd_tile_clk=1580.0, fwd_cta_clk=1628.7, l2_red_clk=136.71)
MEASURED = Path(__file__).resolve().parents[2] / "docs" / "measured" / "2026-11-27-h200" / "attention.json"


def _edge_bytes(lau: Launch) -> int:
    """Bytes of the tiles a CTA of `lau` loads before its loop and stores after it."""
    k, D, (rows, keys) = lau.kernel, lau.head_dim, lau.step
    if "_fwd_" in k:
        return 2 * rows * D * 2  # Q in, O out
    if "_sm90_dkdv" in k or "_dkdv_" in k or "_fused_" in k:
        return 4 * keys * D * 2  # K, V in; dK, dV out
    if "_sm90_dq" in k:
        return 3 * rows * D * 2  # Q, dO in; dQ out
    if "_dv_" in k or "_dk_" in k:
        return 3 * keys * D * 2
    if "_dq_" in k:
        return 3 * rows * D * 2
    raise ArgumentError(f"kernel: no prologue / epilogue tiles known for {k!r}")


def _tiles_per_step(lau: Launch) -> int:
    """Key tiles one loop iteration of `lau` covers (the sm_90a forward unrolls LOOP_TILES of them)."""
    if lau.arch == "sm_90a" and "_fwd_" in lau.kernel:
        from ..ops import _attention_sm90 as h

        return h.LOOP_TILES[lau.head_dim]
    return 1


# The two pipes that hide each other in an mma.sync loop: the shared-memory reads (LDSM, through the MIO pipe) and
# the tensor pipe (HMMA). Each LDSM.x4 feeds the next two HMMAs of its warp, so while the larger of the two streams
# runs, the smaller runs beside it (the FlashAttention-2 forward core on the 2026-11-27 H200, Nsight Compute, d128
# causal 16k: HMMA pipe 51% and L1 71% of the active cycles, both what the model counts to within 1% and 8%). What
# does not run beside the binding stream: the issue slots of the other instructions and the softmax's MUFU work,
# during which a warp issues no LDSM and no HMMA (two warps a scheduler at one CTA an SM leave nothing to fill it).
#
# The fused backward's dQ REDs (its atomic mode: "l2 red", one RED.E.ADD.F32 a float at Calibration.l2_red_clk)
# leave through the same MIO queue as the LDSMs and wait on the L2's atomic units, not on a pipe of the SM: while the
# L2 drains them, the LDSM and HMMA streams of the other warps run beside them, the softmax's issue and MUFU work
# does not (rho x (issue + mufu), as for a shared-memory-bound CTA). Nsight Compute on the measured run (d64 / d128,
# 8192 keys): L2 84.1% / 83.0% of peak, DRAM 0.7%, the HMMA pipe 23%, MIO stalls 34-37% of issue gaps.
_HIDDEN_BY: dict[str, tuple[str, ...]] = {"smem": ("tensor",), "tensor": ("smem",), "l2 red": ("smem", "tensor")}


def _unhidden(t: dict[str, float], top: str) -> float:
    """The non-binding terms of an mma.sync CTA that rho_mma_sync scales: every term but the binding one and those
    it hides (_HIDDEN_BY: shared memory and tensor hide each other; both run beside the L2's dQ REDs, "l2 red")."""
    hidden = _HIDDEN_BY.get(top, ())
    return sum(v for n, v in t.items() if n != top and n not in hidden)


def calibrated_launch(lau: Launch, k: KernelInputs, hw: Hardware, cal: Calibration,
                      build: str = MEASURED_BUILD) -> dict[str, Any]:
    """One launch under the calibrated model: per CTA, its slot time is resident x (the binding SM term, plus
    on mma.sync rho x the other terms but the one its pipe hides: _unhidden) plus the serialization (wgmma: sigma
    x its tiles) plus its prologue / epilogue bytes at edge_bytes_clk; CTAs scheduled as in kernel_bound; never
    below the HBM time. Returns the time and the largest term (summed over the grid) that decides it."""
    loop = k.loop
    warps, occ, frac, per_mma, smem_per_mma, per_pair_mma, _trips, n_ctas, resident = _launch_rates(lau, k, hw)
    step_pairs = lau.step[0] * lau.step[1]
    edge = _edge_bytes(lau) / cal.edge_bytes_clk
    tps = _tiles_per_step(lau)
    fwd90 = loop.wgmma and "_fwd_" in lau.kernel
    pp = fwd90 and ping_pong(lau.head_dim, build)
    costs = []
    parts = {"issue": 0.0, "smem": 0.0, "tensor": 0.0, "mufu": 0.0, "serial": 0.0, "softmax+barrier": 0.0, "cta": 0.0,
             "edge": 0.0, "l2": 0.0, "l2 red": 0.0}
    for p in lau.ctas:
        m = p * per_pair_mma
        t = {"issue": (m * per_mma + warps * loop.straight) / hw.issue_clk, "smem": m * smem_per_mma / hw.smem_bytes_clk,
             "tensor": m * MMA_FLOP / (hw.tensor_flop_clk * frac * lau.tensor_rate),
             "mufu": m * (loop.mufu + lau.redo_p * loop.redo_mufu) / loop.mma * 32 / hw.mufu_clk}
        if lau.l2_red_pair:  # the bulk dQ reduce-adds: one more SM term (its own path to L2, no consumer issue slot)
            t["l2"] = p * lau.l2_red_pair * hw.sms / hw.l2_bytes_clk
        if lau.l2_atomic_pair and cal.l2_red_clk:  # the fused mma.sync backward's dQ REDs at an SM's share
            t["l2 red"] = p * lau.l2_atomic_pair * hw.sms / cal.l2_red_clk
        tiles = tps * p / step_pairs  # key tiles the CTA walks
        if fwd90:
            # the sm_90a forward. Measured build (no ping-pong): the tensor pipe, then per key tile the softmax and
            # barrier time it idles through (fwd_tile_clk), in series; plus the CTA's set-up / drain (fwd_cta_clk)
            # and edge bytes. Ping-pong build (current d128; a modelled bound, not fitted): one warpgroup's softmax
            # runs beside the other's GEMMs, so the per-tile time overlaps the pipe (the larger of the two counts).
            tensor, soft = resident * max(t["tensor"], t["issue"]), cal.fwd_tile_clk * tiles
            core = max(tensor, soft) if pp else tensor + soft
            costs.append(core + cal.fwd_cta_clk + edge)
            if pp:
                parts["tensor" if tensor >= soft else "softmax+barrier"] += core
            else:
                parts["tensor"] += tensor
                parts["softmax+barrier"] += soft
            parts["cta"] += cal.fwd_cta_clk
            parts["edge"] += edge
            continue
        top = max(t, key=lambda n: t[n])
        serial = cal.sigma_tile_clk * tiles if loop.wgmma else \
            resident * cal.rho_mma_sync * _unhidden(t, top)
        costs.append(resident * t[top] + serial + edge)
        parts[top] += resident * t[top]
        parts["serial"] += serial
        parts["edge"] += edge
    compute = lau.schedule(costs, hw.sms * resident) / hw.clock_hz
    hbm = lau.hbm_bytes / hw.hbm_bytes_s
    bind = "hbm" if hbm >= compute else max(parts, key=lambda n: parts[n])
    return {"kernel": lau.kernel, "time_s": max(compute, hbm), "binding": bind,
            "shares": {n: v / sum(parts.values()) for n, v in parts.items()}}


def calibrated(phase: str, shape: Shape, variant: str, sass: SassSource | SassSnapshot | None = None,
               cal: Calibration = FITTED, hw: Hardware = H200, build: str = MEASURED_BUILD,
               dq_bulk: bool = True) -> dict[str, Any]:
    """The calibrated model of the op `phase` at `shape` on `hw`: variant "wgmma" (the sm_90a kernels; the d256
    backward, which has none, runs the mma.sync kernels as the op does) or "mma.sync". Returns time_s, the
    bound's time_s ("bound_s", the uncalibrated model on the same part), and the binding term: the largest
    term of the launch that takes longest ("serial (dkdv)", "tensor (fwd)", ...), or "call" when the fixed
    per-call time is larger than every launch. sass: by default the build's own (sass_for): the measured build's
    snapshot, today's SASS for "current"."""
    shape.check()
    sass = sass or sass_for(build)
    lts: list[Launch] = []
    if variant == "wgmma":
        lts, _why = sm90_launches(phase, shape, list(sass.kernels()), build=build, hw=hw, dq_bulk=dq_bulk)
    if not lts:
        variant = "mma.sync"
        lts = launches(phase, shape)
    rows, bound = [], 0.0
    for lau in lts:
        k = sass.inputs(lau.kernel, lau.arch or hw.arch)
        rows.append(calibrated_launch(lau, k, hw, cal, build))
        bound += kernel_bound(lau, k, hw)["time_s"]
    sm90_fused = any("_sm90_fused" in lau.kernel for lau in lts)
    mem = sum(nbytes for _n, nbytes in memory_kernels(phase, shape, variant, sm90_fused=sm90_fused)) / hw.hbm_bytes_s
    t = sum(r["time_s"] for r in rows) + mem + cal.call_us * 1e-6
    top = max(rows, key=lambda r: r["time_s"])
    binding = "call" if cal.call_us * 1e-6 > top["time_s"] else f"{top['binding']} ({_short(top['kernel'])})"
    return {"time_s": t, "bound_s": bound + mem, "binding": binding, "variant": variant, "kernels": rows}


# (measured JSON entry, phase, variant) of the points the model is fitted to: every one of our own rows (the fused
# mma.sync backward at d64 / d128 too, since its dQ REDs have their term, "l2 red").
PATHS = (("pykern", "fwd", "wgmma"), ("pykern_mma_sync", "fwd", "mma.sync"), ("pykern", "bwd", "wgmma"),
         ("pykern_mma_sync", "bwd", "mma.sync"))


def measured_points(path: str | Path = MEASURED) -> list[dict[str, Any]]:
    """Our own measurements of pykern (never a peer's entry) from an attention.json of tools/measure_gpu.py:
    per row and path, the shape and the measured time (backward: fwd+bwd minus fwd)."""
    try:
        rows = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ArgumentError(f"path: expected an attention.json of tools/measure_gpu.py, got {str(path)!r} ({e})")
    out = []
    for r in rows:
        # the model's SASS is the bf16 kernels': rows of another dtype (measure_gpu.py --dtypes) are no points of
        # it; a row without "dtype" predates them and is bf16. "dv" (v's head dim, 192 / 128) is absent where = d.
        if r.get("what") != "attention" or r.get("dtype", "bf16") != "bf16":
            continue
        s = Shape(int(r["batch"]), int(r["heads"]), int(r["seq"]), int(r["d"]), bool(r["causal"]),
                  head_dim_v=int(r["dv"]) if "dv" in r else None)
        for entry, phase, variant in PATHS:
            m = r.get(entry) or {}
            if "fwd_us" not in m:
                continue
            us = m["fwd_us"] if phase == "fwd" else m["fwdbwd_us"] - m["fwd_us"]
            flop = r["fwd_flop"] if phase == "fwd" else r["bwd_flop"]
            out.append({"entry": entry, "phase": phase, "variant": variant, "shape": s, "measured_s": us * 1e-6,
                        "flop": flop, "fitted": True})
    return out


def compare(points: Sequence[dict[str, Any]], cal: Calibration = FITTED,
            sass: SassSource | SassSnapshot | None = None) -> list[dict[str, Any]]:
    """Per measured point: measured, the bound (before) and the calibrated model (after), their errors
    (model / measured - 1) and the binding term. sass: by default the measured build's snapshot (MEASURED_SASS)."""
    sass = sass or sass_for(MEASURED_BUILD)
    out = []
    for p in points:
        c = calibrated(p["phase"], p["shape"], p["variant"], sass, cal)
        out.append({**p, "shape": asdict(p["shape"]), "variant": c["variant"], "before_s": c["bound_s"],
                    "after_s": c["time_s"], "err_before": c["bound_s"] / p["measured_s"] - 1,
                    "err_after": c["time_s"] / p["measured_s"] - 1, "binding": c["binding"]})
    return out


# The constants of the sm_90a forward (fitted to its rows alone) and of everything else.
FWD_CONSTANTS = ("fwd_tile_clk", "fwd_cta_clk")
# Held, not fitted: call_us, which the least squares drove to zero (below 1e-12 us) once the sm_90a forward had its
# own constants -- the per-CTA terms cover the fixed time a call's launches spend -- so it stays 0, not a free 1e-18.
HELD = ("call_us",)


def _is_fwd90(p: dict[str, Any]) -> bool:
    return p["variant"] == "wgmma" and p["phase"] == "fwd"


def fit(path: str | Path = MEASURED, sass: SassSource | SassSnapshot | None = None, start: Calibration = FITTED,
        iters: int = 60) -> Calibration:
    """The constants by least squares on log(model / measured) over the fitted points of `path` (Levenberg-Marquardt
    on the constants' logs, so they stay positive; deterministic), in two steps: sigma_tile_clk, rho_mma_sync,
    edge_bytes_clk and l2_red_clk (call_us held: HELD) over every fitted point but the sm_90a forward's (which none of
    its terms touches but edge and call), then FWD_CONSTANTS over the sm_90a forward's rows alone, the others held.
    The second step minimizes the largest |model / measured - 1| of those rows rather than a sum of squares (the
    project holds the forward to every shape within 15%), by a compass search on the constants' logs from `start`'s values
    (step 0.25, halved down to 1e-4; deterministic). sass: by default the measured build's snapshot
    (MEASURED_SASS): the SASS of the kernels that were timed."""
    import numpy as np

    sass = sass or sass_for(MEASURED_BUILD)
    pts = [p for p in measured_points(path) if p["fitted"]]
    if not pts:
        raise ArgumentError(f"path: {str(path)!r} holds no pykern attention measurement to fit")
    cal = start
    names = list(start.to_dict())
    for group, sel, minimax in (([n for n in names if n not in FWD_CONSTANTS + HELD], lambda p: not _is_fwd90(p), False),
                                (list(FWD_CONSTANTS), _is_fwd90, True)):
        sub = [p for p in pts if sel(p)]
        if not sub:
            continue
        base = cal

        def res(u: Any, base: Calibration = base, group: list[str] = group, sub: list = sub) -> Any:
            c = Calibration(**{**base.to_dict(), **{n: float(x) for n, x in zip(group, np.exp(u))}})
            return np.array([np.log(calibrated(p["phase"], p["shape"], p["variant"], sass, c)["time_s"]
                                    / p["measured_s"]) for p in sub])

        u0 = np.log(np.array([getattr(base, n) for n in group], dtype=float))
        if minimax:
            u = _compass(lambda u, res=res: float(np.abs(np.expm1(res(u))).max()), u0)
        else:
            u = _levenberg_marquardt(res, u0, iters)
        cal = Calibration(**{**base.to_dict(), **{n: float(x) for n, x in zip(group, np.exp(u))}})
    return cal


def _compass(f: Callable[[Any], float], u: Any, step: float = 0.25, tol: float = 1e-4) -> Any:
    """Minimize f by compass search: try +-step along each coordinate in turn, move on the first improvement,
    halve the step when none improves, stop below tol."""
    best = f(u)
    while step >= tol:
        moved = False
        for j in range(len(u)):
            for sgn in (1.0, -1.0):
                v = u.copy()
                v[j] += sgn * step
                fv = f(v)
                if fv < best:
                    u, best, moved = v, fv, True
                    break
        if not moved:
            step /= 2
    return u


def _levenberg_marquardt(res: Callable[[Any], Any], u: Any, iters: int) -> Any:
    import numpy as np

    r, lam, h = res(u), 1e-2, 1e-4
    for _ in range(iters):
        J = np.empty((len(r), len(u)))
        for j in range(len(u)):
            du = u.copy()
            du[j] += h
            J[:, j] = (res(du) - r) / h
        JtJ = J.T @ J
        improved = False
        while lam < 1e8:
            step = np.linalg.solve(JtJ + lam * np.diag(np.diag(JtJ) + 1e-12), -J.T @ r)
            r2 = res(u + step)
            if r2 @ r2 < r @ r:
                u, r, lam, improved = u + step, r2, lam / 3, True
                break
            lam *= 4
        if not improved or np.abs(step).max() < 1e-6:
            break
    return u


def format_compare(rows: Sequence[dict[str, Any]], cal: Calibration) -> str:
    lines = ["Attention model of the measured (2026-11-27) kernel builds -- no ping-pong in the sm_90a forward -- beside our",
             "own 2026-11-27 H200 measurements (a model fitted to them, never to a peer):",
             "  " + ", ".join(f"{k} = {v:.4g}" for k, v in cal.to_dict().items()),
             f"{'path':15s} {'pass':4s} {'d':>4s} {'causal':>6s} {'seq':>6s} {'measured us':>11s} {'before us':>9s} "
             f"{'err':>7s} {'after us':>9s} {'err':>7s}  binding (after)"]
    for r in rows:
        s = r["shape"]
        tag = "" if r["fitted"] else "  (not fitted)"
        lines.append(f"{r['entry']:15s} {r['phase']:4s} {s['head_dim']:4d} {str(s['causal']):>6s} {s['seq']:6d} "
                     f"{r['measured_s'] * 1e6:11.0f} {r['before_s'] * 1e6:9.0f} {100 * r['err_before']:+6.1f}% "
                     f"{r['after_s'] * 1e6:9.0f} {100 * r['err_after']:+6.1f}%  {r['binding']}{tag}")
    fitted = [abs(r["err_after"]) for r in rows if r["fitted"]]
    if fitted:
        lines.append(f"max |error| after over the fitted points: {100 * max(fitted):.1f}%")
    return "\n".join(lines)


# head_dims of format_bulk_dq: the current sm_90a fused backward's
BULK_DQ_HEAD_DIMS = (64, 128, 256)


def bulk_dq_rows(sass: SassSource | SassSnapshot | None = None, cal: Calibration = FITTED, hw: Hardware = H200,
                 shapes: Sequence[Shape] | None = None) -> list[dict[str, Any]]:
    """The current build's sm_90a backward (the fused kernel) under the calibrated model, its dQ partials charged as
    per-float REDs to HBM (before: dq_bulk=False) and as the bulk reduce-adds it issues (after), per shape (default:
    the table's shapes at BULK_DQ_HEAD_DIMS), with the fused launch's bound terms in seconds (l2: the bulk adds at
    the L2 bandwidth; hbm before / after). A modelled bound: the current build was not measured."""
    sass = sass or sass_for("current")
    out = []
    for s in (shapes if shapes is not None else default_shapes(head_dims=BULK_DQ_HEAD_DIMS)):
        b = calibrated("bwd", s, "wgmma", sass, cal, hw, build="current", dq_bulk=False)
        a = calibrated("bwd", s, "wgmma", sass, cal, hw, build="current")
        terms = {}
        for bulk in (False, True):
            for lau in sm90_launches("bwd", s, list(sass.kernels()), build="current", hw=hw, dq_bulk=bulk)[0]:
                if "_sm90_fused" in lau.kernel:
                    bt = kernel_bound(lau, sass.inputs(lau.kernel, lau.arch), hw)["terms_s"]
                    terms[f"hbm_{'after' if bulk else 'before'}"] = bt["hbm"]
                    terms["l2"] = bt.get("l2", terms.get("l2", 0.0))
        fl = useful_flops(s, "bwd")
        out.append({"shape": asdict(s), "before_s": b["time_s"], "after_s": a["time_s"], "binding_before": b["binding"],
                    "binding_after": a["binding"], "tflops_before": fl / b["time_s"] / 1e12,
                    "tflops_after": fl / a["time_s"] / 1e12, "l2_s": terms.get("l2", 0.0),
                    "hbm_before_s": terms.get("hbm_before", 0.0), "hbm_after_s": terms.get("hbm_after", 0.0)})
    return out


def format_bulk_dq(rows: Sequence[dict[str, Any]]) -> str:
    lines = ["Modelled bound (not a measurement): the current build's sm_90a backward (the fused kernel) on an H200",
             "under the calibrated model (the measured build's constants), dQ's partials charged as per-float REDs to",
             "HBM (before) and as the bulk reduce-adds the kernel issues (after: into L2, the accumulator's lines read",
             "and written back once). The fused launch's bound terms: hbm before -> after (its HBM bytes), l2 (the bulk",
             "adds at the L2 bandwidth: their binding term, off the consumers' path).",
             f"{'d':>4s} {'causal':>6s} {'seq':>6s} {'before us':>9s} {'TFLOP/s':>7s} {'after us':>9s} {'TFLOP/s':>7s} "
             f"{'change':>7s} {'hbm us':>15s} {'l2 us':>6s}  binding before -> after"]
    for r in rows:
        s = r["shape"]
        lines.append(f"{s['head_dim']:4d} {str(s['causal']):>6s} {s['seq']:6d} {r['before_s'] * 1e6:9.0f} "
                     f"{r['tflops_before']:7.0f} {r['after_s'] * 1e6:9.0f} {r['tflops_after']:7.0f} "
                     f"{100 * (r['after_s'] / r['before_s'] - 1):+6.1f}% "
                     f"{r['hbm_before_s'] * 1e6:6.0f} -> {r['hbm_after_s'] * 1e6:5.0f} {r['l2_s'] * 1e6:6.0f}  "
                     f"{r['binding_before']} -> {r['binding_after']}")
    return "\n".join(lines)


__all__ = ["FP8_REDO", "FP8_TABLE_HEAD_DIMS", "fp8_launch", "fp8_redo_rate", "fp8_table_rows", "format_fp8_table",
           "BULK_DQ_HEAD_DIMS", "bulk_dq_rows", "format_bulk_dq", "FITTED", "H200", "MEASURED", "MEASURED_SASS", "SassSnapshot", "sass_for", "Calibration", "calibrated", "compare", "fit", "measured_points", "format_compare", "HARDWARE", "Hardware", "KernelInputs", "Launch", "LoopInputs", "Occupancy", "Prediction", "SassSource",
           "Shape", "DQ_MODES", "default_shapes", "format_table", "hardware", "kernel_bound", "launches", "loop_inputs",
           "makespan", "memory_kernels", "occupancy", "predict", "sm90_launches", "smem_bytes", "table_rows",
           "useful_flops"]
