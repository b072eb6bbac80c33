"""Modelled bound of the MLA paged decode (kernels_cu/mla.cu) on an H100 SXM, from the kernel's own SASS counts
(its steady-state tile loop, cuobjdump of the sm_90 cubin; no GPU needed) and its launch geometry
(pykern.ops.MLAPagedDecodePlan). A model, not a measurement: it names the binding term of

  - HBM: the latent cache's bytes (576 halves a key, read once a request; the head tiles of a request share
    them through L2) plus q and out, at 3.35 TB/s;
  - tensor pipe: the loop's m16n8k16 MMAs at mma.sync's ~2/3 of the 990 TFLOP/s dense bf16 peak;
  - issue: the loop's warp-instructions at 4 a clock an SM;
  - shared memory: the loop's shared-memory bytes (ldmatrix, LDS / STS, the cp.async fill landing) at 128 B a
    clock an SM;

each SM term over the busiest SM (ceil(CTAs / 132) CTAs of a wave-free grid, every CTA ceil(keys / 32) tiles).
Fixed costs (launch, the ring's first fill, the split merge) are left out: it is a lower bound.

    python tools/mla_model.py [--heads 16 --heads 128] [--arch sm_90]
"""
from __future__ import annotations

import argparse
import importlib.util
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's pykern
SMS, CLOCK, HBM = 132, 1.83e9, 3.35e12
MMA_PER_CLK = 990e12 * 2 / 3 / SMS / CLOCK / 4096  # m16n8k16 a clock an SM at mma.sync's rate
SMEM_B_PER_CLK, ISSUE_PER_CLK = 128, 4
KEY_BYTES = 576 * 2


def _sr():
    spec = importlib.util.spec_from_file_location("pk_sass_report_mla", ROOT / "tools" / "sass_report.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def loop_counts(arch: str = "sm_90", kernel: str = "mla_decode_bf16") -> dict[str, float]:
    """Warp-instructions, MMAs and shared-memory bytes (a warp) of one tile of the steady-state loop."""
    from pykern import cache
    from pykern.registry import source_files

    sr = _sr()
    src = next(s for s in source_files() if s.name == "mla.cu")
    text = sr.disassemble(cache.get_module(src, arch).image)
    loop = sr.steady_state_loops(text)[kernel]
    lo, hi = int(loop["start"], 16), int(loop["end"], 16)
    body = [x for x in sr._instructions(text)[kernel] if lo <= x[0] <= hi and x[1] != "NOP"]
    smem = 0
    for _, op, mods, _ in body:
        width = 16 if ".128" in mods else 8 if ".64" in mods else 4
        if op == "LDSM":  # .16.M88.4 / .MT88.4: four 8x8 matrices of 16-bit words, 128 bytes each
            smem += 128 * int(mods.rsplit(".", 1)[1])
        elif op in ("LDS", "STS"):
            smem += 32 * width
        elif op == "LDGSTS":  # lands 16 bytes a lane in shared memory
            smem += 32 * width
    return {"insns": len(body), "mma": loop["mma"], "smem": smem}


def plan_geometry(batch: int, heads: int, keys: int) -> tuple[int, int]:
    """(CTAs, tiles a CTA) of MLAPagedDecodePlan's default split choice."""
    import numpy as np

    from pykern.ops.mla import MLAPagedDecodePlan

    p = MLAPagedDecodePlan()
    pages = -(-keys // 64)
    p.plan(np.arange(batch + 1), np.arange(batch + 1) * pages, np.zeros(batch * pages, np.int32),
           np.full(batch, keys), heads, 512, 64, 64, False, 1.0, "bf16")
    tiles_x, b, ns = p.grid
    per = -(-keys // ns)
    per = -(-per // 32) * 32
    return tiles_x * b * ns, -(-min(per, keys) // 32)


def model(batch: int, heads: int, keys: int, c: dict[str, float]) -> dict[str, float]:
    ctas, tiles = plan_geometry(batch, heads, keys)
    per_sm = math.ceil(ctas / SMS) * tiles  # CTA-tiles on the busiest SM
    warps = 4
    t = {
        "hbm": (batch * keys * KEY_BYTES + batch * heads * (576 + 512) * 2) / HBM,
        "tensor": per_sm * warps * c["mma"] / MMA_PER_CLK / CLOCK,
        "issue": per_sm * warps * c["insns"] / ISSUE_PER_CLK / CLOCK,
        "smem": per_sm * warps * c["smem"] / SMEM_B_PER_CLK / CLOCK,
    }
    t["ctas"], t["tiles"] = ctas, tiles
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", type=int, action="append")
    ap.add_argument("--arch", default="sm_90")
    a = ap.parse_args()
    c = loop_counts(a.arch)
    print(f"loop ({a.arch}): {c['insns']} warp-instructions, {c['mma']:.0f} MMAs, {c['smem']} shared bytes a warp "
          f"a 32-key tile")
    print(f"{'heads':>5} {'batch':>5} {'keys':>6} {'CTAs':>5} {'tiles':>5} {'HBM us':>8} {'tensor us':>9} "
          f"{'issue us':>8} {'smem us':>8}  binds")
    for h in a.heads or [16, 128]:
        for b in (1, 64, 256):
            for n in (4096, 32768):
                t = model(b, h, n, c)
                terms = {k: t[k] for k in ("hbm", "tensor", "issue", "smem")}
                bind = max(terms, key=terms.get)
                print(f"{h:>5} {b:>5} {n:>6} {t['ctas']:>5} {t['tiles']:>5} {t['hbm'] * 1e6:>8.1f} "
                      f"{t['tensor'] * 1e6:>9.1f} {t['issue'] * 1e6:>8.1f} {t['smem'] * 1e6:>8.1f}  {bind}")


if __name__ == "__main__":
    main()
