"""Waves of the tensor-core paged decode: how long a grid of equal streaming CTAs takes, and the KV split
count that keeps its last wave from running the GPU below HBM speed.

Each decode_tc CTA streams its keys through a cp.async ring that keeps (stages - 1) tiles of 64 keys in flight:
32 KiB for bf16 d128 (1 x 64 x 128 x 2 bytes x (K, V)), FP8 d128 and bf16 d64 (2 x 16 KiB), 16 KiB for FP8 d64.
A CTA alone therefore streams at about (bytes in flight) / (loaded latency), below an SM's share of HBM, and a
wave of fewer CTAs than HBM needs runs the GPU at a fraction of its bandwidth.

The model's two constants are our own kernel's, fit on an H200 (2026-11-28, docs/measured/2026-11-28-h200/decode.json,
`python tools/measure_gpu.py decode`) to the 18 bf16 steps at batch 64 x 8 kv heads (GQA 1, 4, 8; 1k, 8k and 32k
keys), each timed with one split and with two (least squares of the relative error, tests/test_decode_waves.py):
with one split 512 CTAs are a full wave of 396 (3 an SM) and a tail of 116, with two 1024 CTAs are two full waves
and a tail of 232, so the pairs separate a CTA's streaming rate from a wave's fixed time. CTA_STREAM_BPS is the
rate of one CTA with its ring's 32 KiB in flight (by Little's law a ring with other bytes in flight streams in
proportion: cta_rate); WAVE_START_S is what a wave costs beside its bytes (the ring's fill before the first tile,
the last tile's math and the stores: not overlapped while a wave's CTAs run in step). HBM then needs
HBM_SATURATING_CTAS = 4258 GB/s / 23.4 GB/s (about 180) such CTAs streaming at once; the model of the step is

    t = sum over waves of (WAVE_START_S + (bytes of a CTA) / min(cta_rate, HBM_BPS / CTAs of the wave))

with every wave but the last holding `slots` CTAs (CTAs an SM x SMs) and the CTAs of a wave in step (equal
lengths), except after DRIFT_WAVES full waves. Nothing here comes from a peer's speed. The model is coarse: two
constants fit on one kernel (bf16 d128), and no launch latency.

A persistent grid (decode_tc's items_per_cta = k > 1) is one wave of ceil(items / k) CTAs, each streaming k
consecutive items through one ring, so

    t = WAVE_START_S + (k - 1) x ITEM_SWITCH_S + k x (bytes of an item) / min(cta_rate, HBM_BPS / CTAs)

(persistent_time). An item's switch: the kernel issues the next item's first tiles (and, 16-bit, its Q) after
the last tile of the current one, while that one merges, so the ring runs dry for about one loaded HBM round
trip an item; ITEM_SWITCH_S prices it at HBM_LAT_S (FP8 keeps Q in registers and loads it at the item's
start, from L1: prefetched during the merge): a modelled figure (not measured: no persistent step has run on a
GPU yet), where a wave's fixed time (WAVE_START_S) also pays the launch, the CTAs' start and the first
page-table loads.
"""
from __future__ import annotations

# A decode_tc CTA's streaming rate with its ring's 32 KiB in flight, and a wave's fixed time (fit on our kernel's
# measured steps; see above).
CTA_STREAM_BPS = 23.4e9
WAVE_START_S = 5.9e-6
CTA_STREAM_INFLIGHT = 32 * 1024
# The measured H200 device-to-device copy (read + write) the rate above was taken against.
HBM_BPS = 4258e9
HBM_SATURATING_CTAS = HBM_BPS / CTA_STREAM_BPS
# A loaded HBM round trip (the latency the bench_decode model uses), and what a persistent CTA's switch from one
# item to the next costs beside its bytes (see above).
HBM_LAT_S = 700e-9
ITEM_SWITCH_S = HBM_LAT_S
# The split merge's tail after the last split CTA of a group has streamed: 3-4 dependent global round trips
# at 700 ns (tools/bench_decode.py's tail term, an upper bound) plus the merge's issue.
MERGE_TAIL_S = 3e-6
# A larger split count must gain more than this fraction of the step to be taken (partials, merge work and
# one more launch geometry to test are not free, and the model is coarse).
MIN_GAIN = 0.02
MAX_WAVE_SPLITS = 4
# A persistent grid is taken only where the model has it this much faster than the best split count: no
# persistent step has been measured yet, and the split counts it would replace were.
PERSIST_MIN_GAIN = 0.05
# From this many full waves on, the CTAs of a grid no longer finish in step and the last wave's CTAs start one by
# one as slots free, overlapping the others: measured at batch 256 x 8 kv heads, 8k keys (2048 CTAs, 5 full waves
# and 68 more), one split streamed at 99% of copy speed, where an in-step last wave would lose 6%. The model
# streams such a last wave at the GPU's speed.
DRIFT_WAVES = 4


def waves_streaming_time(ctas: int, slots: int, cta_bytes: float, rate: float = CTA_STREAM_BPS,
                         bw: float = HBM_BPS) -> float:
    """Seconds the waves of grid_stream_time spend streaming their bytes, without their fixed time."""
    if ctas <= 0 or cta_bytes <= 0:
        return 0.0
    full, rem = divmod(ctas, slots)
    t = full * cta_bytes / min(rate, bw / slots)
    if rem:
        t += rem * cta_bytes / bw if full >= DRIFT_WAVES else cta_bytes / min(rate, bw / rem)
    return t


def grid_stream_time(ctas: int, slots: int, cta_bytes: float, rate: float = CTA_STREAM_BPS,
                     bw: float = HBM_BPS) -> float:
    """Seconds to stream `ctas` CTAs of `cta_bytes` each, `slots` of them resident at once, in waves, each CTA
    at most at `rate` and the GPU at most at `bw`, each wave (but a drifting last one) WAVE_START_S more."""
    if ctas <= 0 or cta_bytes <= 0:
        return 0.0
    return waves_streaming_time(ctas, slots, cta_bytes, rate, bw) + fixed_waves(ctas, slots) * WAVE_START_S


def fixed_waves(ctas: int, slots: int) -> int:
    """How many of the grid's waves grid_stream_time charges WAVE_START_S (a drifting last wave overlaps)."""
    if ctas <= 0:
        return 0
    full, rem = divmod(ctas, slots)
    return full + (1 if rem and full < DRIFT_WAVES else 0)


def cta_rate(inflight_bytes: int) -> float:
    """Bytes a second one CTA streams with `inflight_bytes` of its ring in flight (Little's law on the measured
    CTA_STREAM_BPS at CTA_STREAM_INFLIGHT)."""
    return CTA_STREAM_BPS * inflight_bytes / CTA_STREAM_INFLIGHT


def wave_efficiency(ctas: int, slots: int, rate: float = CTA_STREAM_BPS) -> float:
    """Fraction of HBM speed a grid of equal streaming CTAs reaches over its waves, their streaming alone (no
    wave's fixed time; 1.0: every wave saturates)."""
    return ctas / (waves_streaming_time(ctas, slots, 1.0, rate) * HBM_BPS)


def split_time(ctas: int, slots: int, kv_bytes: float, partial_bytes: float, splits: int,
               rate: float = CTA_STREAM_BPS) -> float:
    """Seconds of a grid of `ctas` unsplit CTAs cut into `splits` (wave_splits' arguments): grid_stream_time of the
    split CTAs, each also writing its partial (and the merge reading it back), plus the merge's tail."""
    extra = 2 * partial_bytes if splits > 1 else 0
    return (grid_stream_time(ctas * splits, slots, kv_bytes / splits + extra, rate)
            + (MERGE_TAIL_S if splits > 1 else 0.0))


def wave_splits(ctas: int, slots: int, kv_bytes: int, partial_bytes: int, max_splits: int,
                inflight_bytes: int = CTA_STREAM_INFLIGHT, below_sms: bool = False) -> int:
    """KV splits for a grid of `ctas` unsplit CTAs: the fewest splits within MIN_GAIN of the fastest, by
    grid_stream_time plus, when split, each CTA's partial write and the merge's tail. kv_bytes: the K/V bytes an
    unsplit CTA streams; partial_bytes: the bytes a split CTA writes (and its merge reads back) for its partial o
    and lse; inflight_bytes: the ring's bytes in flight a CTA; at most max_splits.

    A grid that fills the SMs splits only to fill a thin last wave (1 to MAX_WAVE_SPLITS). Below the SM count
    (below_sms) the counts are the powers of two from 2: the fewest whose one wave holds enough CTAs to keep HBM
    busy ties with any more. Measured on the H200 (docs/measured/2026-11-28-h200-b/decode_splits.json, 8 kv
    heads): batch 8 at 1k / 8k keys fastest at 4 splits (6% / 1.5% ahead of the 6 that one wave of slots holds),
    batch 1 at 16 (1k, within 2% of 32) and 32 (8k); the counts between were not measured, and the model's
    saturation point is too coarse a fit to choose among them."""
    rate = cta_rate(inflight_bytes)
    cand = [c for c in ((2, 4, 8, 16, 32) if below_sms else range(1, MAX_WAVE_SPLITS + 1)) if c <= max_splits]
    if not cand:
        return max(1, min(max_splits, 2 if below_sms else 1))
    times = [split_time(ctas, slots, kv_bytes, partial_bytes, s, rate) for s in cand]
    best = min(times)
    return next(s for s, t in zip(cand, times) if t <= best * (1 + MIN_GAIN))


def persistent_time(items: int, slots: int, item_bytes: float, k: int, rate: float = CTA_STREAM_BPS,
                    bw: float = HBM_BPS) -> float:
    """Seconds a persistent grid of ceil(items / k) CTAs (at most `slots`: one wave) takes, each streaming k
    consecutive items of `item_bytes` through one ring (the last CTA fewer): one wave's fixed time, an item
    switch (ITEM_SWITCH_S) between items, and k items at the rate each CTA gets (its ring's, or its share of
    HBM)."""
    grid = -(-items // k)
    if grid > slots:
        raise ValueError(f"k: {k} items a CTA leave {grid} CTAs, more than one wave of {slots}")
    return WAVE_START_S + (k - 1) * ITEM_SWITCH_S + k * item_bytes / min(rate, bw / grid)


def persistent_items(items: int, slots: int, item_bytes: float, rate: float = CTA_STREAM_BPS,
                     wave_time: float | None = None) -> int:
    """Items a CTA for a grid of `items` equal items: 1 (one CTA an item, grid_stream_time's waves, or
    `wave_time` when given: the time of the plan's best split count) unless a persistent grid of one wave
    (persistent_time) is modelled faster by more than PERSIST_MIN_GAIN; then the k of the fastest, among the
    fewest items a CTA that fit one wave and the next few (a smaller grid can divide the items more evenly)."""
    if items <= slots or item_bytes <= 0:
        return 1
    plain = grid_stream_time(items, slots, item_bytes, rate) if wave_time is None else wave_time
    k0 = -(-items // slots)
    best_k, best_t = 1, plain
    for k in range(k0, k0 + 4):
        t = persistent_time(items, slots, item_bytes, k, rate)
        if t < best_t:
            best_k, best_t = k, t
    return best_k if best_t < plain * (1 - PERSIST_MIN_GAIN) else 1
