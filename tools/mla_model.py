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

`--kernel sm90` models the sm_90a kernel (kernels_cu/mla_sm90.cu, wgmma) on an H200 instead (published rates:
4.8 TB/s HBM, 989 TFLOP/s dense bf16, 132 SMs; 1.83 GHz, the clock at which 989 TFLOP/s is 4096 flops a clock an
SM), with its own terms:

  - tensor pipe: the wgmmas' flops of a 64-head CTA tile (S 64 x 64 x 576, O += P V 64 x 64 x 512; heads past
    num_heads are padded rows and cost the same) at the full dense rate;
  - issue: the instructions a 64-key tile executes, per warp from the SASS, once the row maxima have settled
    (the O rescale skipped): 4 warps of consumer 0 (S, softmax, P hand-over, P V), 4 of consumer 1 (P V), 4
    producer warps (36 cp.async a thread);
  - shared memory: what the wgmmas read (SS: Q, 64 x 576, and the K tile for S; the V boxes and consumer 1's P
    for P V), the P hand-over and the cp.async landing, at 128 B a clock an SM;
  - HBM as above at 4.8 TB/s;

the busiest SM runs ceil(CTAs / 132) CTAs (one a SM: 225 KiB of shared memory) of the plan's default split,
each ceil(keys / 64) tiles.

    python tools/mla_model.py --kernel sm90 [--heads 16 --heads 128]
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


def plan_geometry(batch: int, heads: int, keys: int, sm90: bool = False) -> tuple[int, int]:
    """(CTAs, tiles a CTA) of MLAPagedDecodePlan's default split choice (sm90: the wgmma kernel's, as the plan
    makes it on the host backend playing sm_90a)."""
    import os

    import numpy as np

    from pykern.ops.mla import MLAPagedDecodePlan

    old = os.environ.get("PYKERN_HOST_ARCH")
    os.environ["PYKERN_HOST_ARCH"] = "sm_90a" if sm90 else "sm_80"
    try:
        p = MLAPagedDecodePlan(backend="host")
        pages = -(-keys // 64)
        p.plan(np.arange(batch + 1), np.arange(batch + 1) * pages, np.zeros(batch * pages, np.int32),
               np.full(batch, keys), heads, 512, 64, 64, False, 1.0, "bf16")
    finally:
        if old is None:
            os.environ.pop("PYKERN_HOST_ARCH", None)
        else:
            os.environ["PYKERN_HOST_ARCH"] = old
    tiles_x, b, ns = p.grid_sm90 if sm90 else p.grid
    per = -(-keys // ns)
    per = -(-per // 32) * 32  # both kernels split at multiples of 32 keys
    return tiles_x * b * ns, -(-min(per, keys) // (SM90_BC if sm90 else 32))


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


# ---- the sm_90a kernel (kernels_cu/mla_sm90.cu) on an H200
H200_HBM, H200_FLOPS = 4.8e12, 989e12
SM90_BC = 64  # keys a tile
SM90_TILE_FLOPS = 2 * 64 * SM90_BC * 576 + 2 * 64 * SM90_BC * 512  # S and O += P V of one 64-head CTA tile
# shared-memory bytes of one CTA tile: the wgmmas' operands (S, SS: Q 64 x 576 and K 64 x 576 halves; P V: V 64 x
# 512 halves, consumer 1's P 64 x 64 halves as its A), consumer 0's P stores, the rows' factors (64 stores, 256
# loads of 4 bytes) and the gathers' landing (64 x 576 halves)
SM90_TILE_SMEM = (64 * 576 * 2 + SM90_BC * 576 * 2 + SM90_BC * 512 * 2 + 2 * 64 * SM90_BC * 2 + 4 * (64 + 256)
                  + SM90_BC * 576 * 2)


def _skipped(insns: list, lo: int, hi: int) -> int:
    """Instructions in [lo, hi] that the forward branch after a VOTE.ANY skips (the O rescale, not taken once
    the row maxima have settled)."""
    n = 0
    for k, (addr, op, mods, _b) in enumerate(insns):
        if lo <= addr <= hi and op == "VOTE" and mods.startswith(".ANY"):
            for addr2, op2, _m, body2 in insns[k + 1:]:
                if op2 == "BRA":
                    tgt = int(body2.split("BRA", 1)[1].split(";")[0].strip().split()[-1], 16)
                    n += sum(addr2 < a < tgt for a, *_ in insns)
                    break
    return n


def sm90_counts(kernel: str = "mla_decode_sm90_bf16") -> dict[str, float]:
    """Instructions a warp executes a tile in the steady state (row maxima settled), from the sm_90a SASS:
    consumer 0 (S, softmax, P hand-over, its P V), consumer 1 (its P V) and a producer warp (the gathers)."""
    from pykern import cache
    from pykern.registry import source_files

    sr = _sr()
    src = next(s for s in source_files() if s.name == "mla_sm90.cu")
    text = sr.disassemble(cache.get_module(src, "sm_90a").image)
    insns = [x for x in sr._instructions(text)[kernel] if x[1] != "NOP"]
    out: dict[str, float] = {}
    for row in sr.inner_loops(text, innermost=False)[kernel]:
        lo, hi = int(row["start"], 16), int(row["end"], 16)
        ops = row["ops"]
        hg = sum(n for op, n in ops.items() if op.startswith("HGMMA"))
        gathers = sum(n for op, n in ops.items() if op.startswith("LDGSTS"))
        leaf = row["inner"] == row["insns"]  # a loop without inner loops counts itself
        if hg and leaf:
            key = "consumer0" if hg > 4 else "consumer1"
            out[key] = row["insns"] - _skipped(insns, lo, hi)
            out[key + "_static"] = row["insns"]
        elif gathers and not leaf:  # the producer's tile loop around its chunk loop (4 gathers an iteration)
            inner = next(r for r in sr.inner_loops(text)[kernel]
                         if lo <= int(r["start"], 16) and int(r["end"], 16) <= hi
                         and any(op.startswith("LDGSTS") for op in r["ops"]))
            per = sum(n for op, n in inner["ops"].items() if op.startswith("LDGSTS"))
            out["producer"] = row["insns"] - inner["insns"] + (36 // per) * inner["insns"]
    return out


def sm90_model(batch: int, heads: int, keys: int, c: dict[str, float]) -> dict[str, float]:
    ctas, tiles = plan_geometry(batch, heads, keys, sm90=True)
    per_sm = math.ceil(ctas / SMS) * tiles
    t = {
        "hbm": (batch * keys * KEY_BYTES + batch * heads * (576 + 512) * 2) / H200_HBM,
        "tensor": per_sm * SM90_TILE_FLOPS / (H200_FLOPS / SMS),
        "issue": per_sm * 4 * (c["consumer0"] + c["consumer1"] + c["producer"]) / ISSUE_PER_CLK / CLOCK,
        "smem": per_sm * SM90_TILE_SMEM / SMEM_B_PER_CLK / CLOCK,
    }
    t["ctas"], t["tiles"] = ctas, tiles
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", type=int, action="append")
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--kernel", choices=("mma", "sm90"), default="mma")
    a = ap.parse_args()
    if a.kernel == "sm90":
        c = sm90_counts()
        print(f"sm_90a, a warp and 64-key tile in the steady state: consumer 0 {c['consumer0']} instructions "
              f"({c['consumer0_static']} with the O rescale), consumer 1 {c['consumer1']} "
              f"({c['consumer1_static']}), producer {c['producer']}; {SM90_TILE_SMEM} shared bytes and "
              f"{SM90_TILE_FLOPS / 1e6:.2f} MFLOP a CTA tile (H200 rates)")
        _table(a.heads, lambda b, h, n: sm90_model(b, h, n, c))
        return
    c = loop_counts(a.arch)
    print(f"loop ({a.arch}): {c['insns']} warp-instructions, {c['mma']:.0f} MMAs, {c['smem']} shared bytes a warp "
          f"a 32-key tile")
    _table(a.heads, lambda b, h, n: model(b, h, n, c))


def _table(heads: list[int] | None, fn) -> None:
    print(f"{'heads':>5} {'batch':>5} {'keys':>6} {'CTAs':>5} {'tiles':>5} {'HBM us':>8} {'tensor us':>9} "
          f"{'issue us':>8} {'smem us':>8}  binds")
    for h in heads or [16, 128]:
        for b in (1, 64, 256):
            for n in (4096, 32768):
                t = fn(b, h, n)
                terms = {k: t[k] for k in ("hbm", "tensor", "issue", "smem")}
                bind = max(terms, key=terms.get)
                print(f"{h:>5} {b:>5} {n:>6} {t['ctas']:>5} {t['tiles']:>5} {t['hbm'] * 1e6:>8.1f} "
                      f"{t['tensor'] * 1e6:>9.1f} {t['issue'] * 1e6:>8.1f} {t['smem'] * 1e6:>8.1f}  {bind}")


if __name__ == "__main__":
    main()
