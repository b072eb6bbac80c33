"""SASS of the sm_90a MLA decode kernels (kernels_cu/mla_sm90.cu), from the NVRTC sm_90a cubin with cuobjdump (no
GPU needed), as tests/test_sass_mla.py does for the mma.sync kernel:

- consumer 0's tile loop is flat (no inner loop) with the wgmmas of a 64-key tile: S = Q K^T as 36
  HGMMA.64x64x16 (SS) and its O += P V as 4 HGMMA.64x256x16 with P from registers; consumer 1's loop holds its
  O += P V as 4 HGMMA.64x256x16 with P from shared memory; each wgmma group is waited once (ptxas did not
  serialize the wgmmas, which it does when it takes a branch around them for divergent), and the descriptors
  are uniform-register adds;
- the latent rows gathered by 16-byte cp.async (LDGSTS.E.BYPASS.128) into the ring, mbarriers (SYNCS), setmaxnreg;
- no spills and no local memory.
"""
from __future__ import annotations

from collections import Counter
from functools import lru_cache
from pathlib import Path
from typing import Any

import pytest
from sass_helpers import guard, report, spills

ROOT = Path(__file__).resolve().parent.parent
KERNELS = ("mla_decode_sm90_bf16", "mla_decode_sm90_f16")


sr = report()


@lru_cache(maxsize=None)
def loops() -> dict[str, dict[str, Any]]:
    # "sm_90": the source is built for sm_90a only, which sass_report compiles for an sm_90 GPU
    return guard(lambda: {k: v["sm_90"] for k, v in sr.loop_metrics(list(KERNELS), ("sm_90",)).items()})


@lru_cache(maxsize=None)
def sass() -> str:
    from pykern import cache
    from pykern.registry import source_files

    src = next(s for s in source_files() if s.name == "mla_sm90.cu")
    return guard(lambda: sr.disassemble(cache.get_module(src, "sm_90a").image))


def _loop_ops(kernel: str) -> Counter:
    """Opcode (with modifiers) counts of the kernel's steady-state loop."""
    row = loops()[kernel]
    lo, hi = int(row["start"], 16), int(row["end"], 16)
    insns = sr._instructions(sass())[kernel]
    return Counter(op + mods for addr, op, mods, _ in insns if lo <= addr <= hi and op != "NOP")


@pytest.mark.parametrize("kernel", KERNELS)
def test_flat_tile_loop_of_hgmma(kernel: str) -> None:
    row = loops()[kernel]  # the loop with the most MMAs; absent when it holds an inner loop
    ops = _loop_ops(kernel)
    hg = {op: n for op, n in ops.items() if op.startswith("HGMMA")}
    assert sum(n for op, n in hg.items() if op.startswith("HGMMA.64x64x16.F32")) == 36, hg
    assert sum(n for op, n in hg.items() if op.startswith("HGMMA.64x256x16.F32")) == 4, hg
    # one wait a wgmma group (S, P V): serialized wgmmas would wait after each one
    assert sum(n for op, n in ops.items() if op.startswith("WARPGROUP.DEPBAR")) == 2, ops
    # B straight from shared memory; the two P hand-over rendezvous with consumer 1
    assert row["ldsm"] == 0 and row["bar"] == 2, row
    # static instructions of the loop per m16n8k16-equivalent (533 / 416 when written, the O rescale included):
    # more than 1.5 means the descriptors went back to vector registers (an R2UR pair a wgmma) or more came in
    assert row["per_mma"] < 1.5, row
    assert sum(n for op, n in ops.items() if op.startswith("R2UR")) <= 8, ops


@pytest.mark.parametrize("kernel", KERNELS)
def test_second_consumer_loop_reads_p_from_shared_memory(kernel: str) -> None:
    found = [r for r in guard(lambda: sr.inner_loops(sass()))[kernel]
             if sum(n for op, n in r["ops"].items() if op.startswith("HGMMA")) == 4]
    assert len(found) == 1, found
    ops = found[0]["ops"]
    assert sum(n for op, n in ops.items() if op.startswith("HGMMA.64x256x16.F32")) == 4, ops
    assert sum(n for op, n in ops.items() if op.startswith("WARPGROUP.DEPBAR")) == 1, ops
    assert found[0]["insns"] < 200, found[0]  # the factors, an optional rescale, 4 wgmmas, the hand-over


def test_cp_async_gathers_mbarriers_and_setmaxnreg() -> None:
    text = sass()
    assert "LDGSTS.E.BYPASS.128" in text and "LDGDEPBAR" in text
    assert "SYNCS.PHASECHK" in text and "SYNCS.ARRIVE" in text
    assert "USETMAXREG.TRY_ALLOC.CTAPOOL" in text and "USETMAXREG.DEALLOC.CTAPOOL" in text


def test_no_spills_and_no_serialization_warning() -> None:
    m = guard(lambda: sr.instruction_mix(list(KERNELS), ("sm_90",), with_resources=True))
    bad = spills(m)
    assert not bad, bad
    from sass_helpers import nvrtc_module

    # the ptxas log of the cached entry (instruction_mix above compiled it through the cache)
    log = guard(lambda: nvrtc_module(ROOT / "kernels_cu" / "mla_sm90.cu", "sm_90a").log)
    assert "C7519" not in log and "serialized" not in log, log
