#!/usr/bin/env python
"""A modelled bound (not a measurement) of the sampling kernels' time at vocab 128256, fp32, batch 1 / 64 / 256 on an
H200 (4.8 TB/s HBM, 132 SMs, 1.98 GHz), one CTA a row (before) and rows split over several CTAs (after:
kernels_cu/sampling.cu, sp_split_last; `ctas_per_row`'s default). Top-k / top-p: the radix selects (before) beside
the rejection rounds with two pivots (after: sp_reject), their rounds from the NumPy rule on a Zipf-like row
(reject_reads and rule_rounds give the reads a row).

    python tools/sampling_model.py [--arch sm_90] [--json]

Instructions per element come from the SASS (tools/sass_report.py, inner_loops): the innermost loops that hold
16-byte global loads are the row walks, sorted by what they do: "max" (an unsigned max, no float-to-int conversion:
the maximum pass), "mass" (the truncating conversion of sp_mass / sp_exp_mass, no shared atomics: the kept-mass
walks), "hist" (shared atomics: the radix-select passes). A loop's warp-instructions per element is its body over
the elements its loads bring (one LDG.128 a lane: 4 fp32 values, 128 a warp); each class takes its leanest loop (the
steady state of the unrolled walk). Per CTA: the warp-instructions of its passes over the SM's issue rate (4 a clock:
one a scheduler), the bytes it reads over an SM's L2 bandwidth (64 B a clock), and the batch's bytes over HBM; a
CTA of 512 threads at these register counts runs alone on its SM, so CTAs beyond 132 run in waves. The binding term
is the largest. Nsight Compute measured about 2 warp-instructions a clock on the one busy SM at batch 1
(docs/measured/2026-11-28-h200-b.md), half the issue bound used here.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's pykern

from pykern.bench.attention_model import H200  # noqa: E402  (after the path: this checkout's pykern)

SMS, CLOCK, HBM = 132, 1.98e9, 4.8e12
ISSUE_PER_CLK = 4  # warp-instructions a clock an SM (4 schedulers)
L2_B_PER_CLK = 64  # bytes a clock an SM from L2
# H200's L2 (a row batch that fits in half of it is read from HBM once): the attention model's, 62914560 bytes
# (60 MiB), what the CUDA device attribute reported on our H200 (docs/measured/2026-11-27-h200/ceilings.json).
L2_BYTES = H200.l2_bytes
VOCAB, VEC = 128256, 4  # fp32: 4 values a 16-byte load
NT = 512
MAX_CTAS = 16  # pykern.ops.sampling.MAX_CTAS_PER_ROW
BATCHES = (1, 64, 256)


def _sr() -> Any:
    spec = importlib.util.spec_from_file_location("pk_sass_report_sampling", ROOT / "tools" / "sass_report.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def walk_costs(arch: str = "sm_90",
               kernels: tuple[str, ...] = ("sampling_from_probs", "sampling_from_logits")) -> dict[str, Any]:
    """{kernel: {"loops": [...], "max" / "mass" / "hist": warp-instructions per fp32 element}} from the SASS."""
    from pykern import cache
    from pykern.registry import source_files

    sr = _sr()
    src = next(s for s in source_files() if s.name == "sampling.cu")
    loops = sr.inner_loops(sr.disassemble(cache.get_module(src, arch).image))
    out: dict[str, Any] = {}
    for k in kernels:
        if k not in loops:
            continue
        rows = []
        for lp in loops[k]:
            ops = lp["ops"]
            ldg = sum(n for op, n in ops.items() if op.startswith("LDG") and ".128" in op)
            if not ldg:
                continue
            has = lambda p: any(op.startswith(p) for op in ops)  # noqa: E731
            kind = "hist" if has("ATOMS") else "mass" if has("F2I") else "max" if has("IMNMX") or has("VIMNMX") \
                else "other"
            rows.append({"start": lp["start"], "insns": lp["insns"], "ldg128": ldg, "kind": kind,
                         "per_elem": lp["insns"] / (ldg * 32 * VEC)})
        best = {c: min((r["per_elem"] for r in rows if r["kind"] == c), default=None) for c in ("max", "mass", "hist")}
        # the rejection rounds' count read (sp_count_pivots: two masses, two counts and the segment sums of both a
        # chunk) is the heaviest walk with the mass conversion and no shared atomics: costed by that loop
        best["count"] = max((r["per_elem"] for r in rows if r["kind"] == "mass"), default=None)
        out[k] = {"loops": rows, **best}
    return out


def ctas_per_row(batch: int) -> int:
    chunks = -(-VOCAB // (NT * VEC))
    return max(1, min(MAX_CTAS, SMS // batch, chunks))


def model(batch: int, c: dict[str, Any], split: bool, hist_passes: int = 0) -> dict[str, Any]:
    """Terms (seconds) of one launch: a plain draw (max; mass; the drawn segment) or, with hist_passes, a select's
    passes before it (one CTA a row)."""
    C = ctas_per_row(batch) if split and not hist_passes else 1
    ipe_max, ipe_mass, ipe_hist = c["max"] or 0.0, c["mass"] or 0.0, c.get("hist") or 0.0
    if C == 1:
        insns = VOCAB * (ipe_max + ipe_mass + hist_passes * ipe_hist)  # the draw's segment: 32 x VEC entries
        reads = 2 + hist_passes
        cta_bytes = reads * VOCAB * 4
    else:  # the critical CTA: the whole row's max, its range's mass, then (last) the walk of one range
        insns = VOCAB * ipe_max + 2 * VOCAB / C * ipe_mass
        cta_bytes = (1 + 2 / C) * VOCAB * 4
        reads = 1
    ctas = batch * C
    waves = math.ceil(ctas / SMS)
    row_bytes = batch * VOCAB * 4
    hbm_reads = 1 if row_bytes <= L2_BYTES // 2 else (reads if C == 1 else 2)
    t = {"ctas_per_row": C, "ctas": ctas, "waves": waves,
         "hbm_us": row_bytes * hbm_reads / HBM * 1e6,
         "l2_us": waves * cta_bytes / L2_B_PER_CLK / CLOCK * 1e6,
         "issue_us": waves * insns / ISSUE_PER_CLK / CLOCK * 1e6}  # insns: warp-instructions of the CTA
    t["bound_us"] = max(t["hbm_us"], t["l2_us"], t["issue_us"])
    t["binding"] = max(("hbm", "l2", "issue"), key=lambda k: t[k + "_us"])
    return t


# Full reads of a row by the radix-select path the top-k / top-p draws took before the rejection rounds (one CTA a
# row; kernels_cu/sampling.cu's header table: the selects' passes, the maximum riding along, and the draw's scan).
RADIX_READS = {"top_k": {"f32": 4, "bf16": 3}, "top_p": {"f32": 5, "bf16": 4}, "top_k_top_p": {"f32": 7, "bf16": 5}}


def reject_reads(draws: int, count_reads: int, one_window: bool = True, ctas: int = 1) -> float:
    """Row reads (in row lengths) on the critical path of a top-k / top-p row drawn by the rejection rounds
    (kernels_cu/sampling.cu, sp_reject), for `draws` draws and `count_reads` reads of the two pivots (np_sample's
    `rounds` gives both for a row). One CTA: the maximum, the first draw's mass S (with the segment sums of a row of
    one window, 256k fp32 entries), one read a rejected draw; a draw reads one warp's segment (32 x 4 fp32 entries:
    counted 0) where the segment sums are kept, else half the row on average. C CTAs: the maximum in every CTA (the
    whole row), S over 1/C, the first draw over the 1/C range that holds it, then the last CTA alone: the count reads
    and the later draws."""
    later = 0.0 if one_window else 0.5
    if ctas == 1:
        return 2 + count_reads + later * draws
    return 1 + 2 / ctas + count_reads + later * (draws - 1)


def rule_rounds(top_k: int | None = None, top_p: float | None = None, order: str = "joint", vocab: int = VOCAB,
                seeds: int = 32) -> tuple[float, float]:
    """Mean (draws, count reads) the rejection rule takes (np_sample's rounds: the kernels take the same rounds, the
    host backend agreeing token for token) on a Zipf-like row, p ~ 1 / (i + 10)^1.1 in a random order, over `seeds`
    Philox streams. A modelled input, not a measurement: real rows' rounds depend on their distribution."""
    import numpy as np

    from pykern.difftest.cases.sampling import np_sample

    rng = np.random.default_rng(0)
    p = rng.permutation(1.0 / (np.arange(vocab) + 10.0) ** 1.1)
    row = (p / p.sum()).astype(np.float32)
    rounds: list = []
    np_sample(np.tile(row, (seeds, 1)), 1234, top_k=top_k, top_p=top_p, order=order, rounds=rounds)
    return float(np.mean([d for d, _ in rounds])), float(np.mean([r for _, r in rounds]))


def model_reject(batch: int, c: dict[str, Any], draws: float, count_reads: float, split: bool) -> dict[str, Any]:
    """The terms (seconds) of a top-k / top-p launch drawn by the rejection rounds (`draws`, `count_reads` a row, a
    row of one window); a count read is costed by the count loop (walk_costs' "count": the heaviest mass walk)."""
    C = ctas_per_row(batch) if split else 1
    ipe_max, ipe_mass = c["max"] or 0.0, c["mass"] or 0.0
    ipe_count = c.get("count") or ipe_mass
    if C == 1:
        insns = VOCAB * (ipe_max + ipe_mass + ipe_count * count_reads)
    else:
        insns = VOCAB * ipe_max + 2 * VOCAB / C * ipe_mass + count_reads * VOCAB * ipe_count
    cta_bytes = reject_reads(draws, count_reads, True, C) * VOCAB * 4
    ctas = batch * C
    waves = math.ceil(ctas / SMS)
    row_bytes = batch * VOCAB * 4
    hbm_reads = 1 if row_bytes <= L2_BYTES // 2 else 2 + count_reads
    t = {"ctas_per_row": C, "ctas": ctas, "waves": waves, "reads": reject_reads(draws, count_reads, True, C),
         "hbm_us": row_bytes * hbm_reads / HBM * 1e6,
         "l2_us": waves * cta_bytes / L2_B_PER_CLK / CLOCK * 1e6,
         "issue_us": waves * insns / ISSUE_PER_CLK / CLOCK * 1e6}
    t["bound_us"] = max(t["hbm_us"], t["l2_us"], t["issue_us"])
    t["binding"] = max(("hbm", "l2", "issue"), key=lambda k: t[k + "_us"])
    return t


def table(arch: str = "sm_90") -> dict[str, Any]:
    costs = walk_costs(arch)
    rows: dict[str, Any] = {"arch": arch, "costs": costs, "model": []}
    probs, logits = costs["sampling_from_probs"], costs["sampling_from_logits"]
    for op, c, passes in (("sampling_from_probs / min_p", probs, 0), ("sampling_from_logits", logits, 0)):
        for b in BATCHES:
            rows["model"].append({"op": op, "batch": b, "before": model(b, c, False, passes),
                                  "after": model(b, c, True, passes)})
    # top-k / top-p: before, the radix selects (hist passes: top-k 2 beside the maximum's, top-p 3, both 5; one CTA a
    # row) costed by this build's radix loop (top-k-first's select, which keeps one); after, the rejection rounds the
    # rule takes on a Zipf-like row (rule_rounds), split at a small batch
    for op, filt, passes in (("top_k_sampling_from_probs (k=50)", {"top_k": 50}, 2),
                             ("top_p_sampling_from_probs (p=0.9)", {"top_p": 0.9}, 3),
                             ("top_k_top_p joint (k=50, p=0.9)", {"top_k": 50, "top_p": 0.9}, 5)):
        draws, reads = rule_rounds(**filt)
        rows.setdefault("rounds", {})[op] = {"draws": draws, "count_reads": reads}
        for b in BATCHES:
            rows["model"].append({"op": op, "batch": b, "before": model(b, probs, False, passes),
                                  "after": model_reject(b, probs, draws, reads, True)})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    r = table(a.arch)
    if a.json:
        print(json.dumps(r, indent=1))
        return 0
    print(f"Modelled bound (not measured): H200, {SMS} SMs, {CLOCK / 1e9:.2f} GHz, {HBM / 1e12:.1f} TB/s; vocab {VOCAB} "
          f"fp32; SASS {a.arch}")
    for k, c in r["costs"].items():
        fmt = lambda v: "-" if v is None else f"{v:.4f}"  # noqa: E731
        print(f"  {k}: warp-instructions an element: max {fmt(c['max'])}, mass {fmt(c['mass'])}, "
              f"count {fmt(c['count'])}, hist {fmt(c['hist'])} ({len(c['loops'])} row-walk loops)")
    print(f"{'op':44} {'batch':>5} | {'C':>2} {'hbm':>6} {'l2':>6} {'issue':>6} {'bound':>6} {'binds':>5} | "
          f"{'C':>2} {'hbm':>6} {'l2':>6} {'issue':>6} {'bound':>6} {'binds':>5}")
    for m in r["model"]:
        cells = []
        for side in ("before", "after"):
            t = m[side]
            cells.append(f"{t['ctas_per_row']:>2} {t['hbm_us']:6.1f} {t['l2_us']:6.1f} {t['issue_us']:6.1f} "
                         f"{t['bound_us']:6.1f} {t['binding']:>5}")
        print(f"{m['op']:44} {m['batch']:>5} | {cells[0]} | {cells[1]}")
    for op, rr in r.get("rounds", {}).items():
        print(f"  {op}: the rule's mean rounds on a Zipf-like row: {rr['draws']:.2f} draws, "
              f"{rr['count_reads']:.2f} count reads (modelled input)")
    print("(us; before: one CTA a row (top-k / top-p: the radix selects); after: the default ctas_per_row "
          "(top-k / top-p: the rejection rounds); C: CTAs a row)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
