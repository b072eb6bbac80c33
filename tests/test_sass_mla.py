"""SASS of the MLA decode kernels (kernels_cu/mla.cu), from the sm_80 and sm_90 cubins with cuobjdump (no GPU
needed), as tests/test_sass_decode.py does for paged.cu:

- a flat steady-state tile loop (MMAs, no inner loop) of 68 HMMA a 32-key tile and warp (36 of S = Q K^T: 9
  k-steps x 4 n-tiles; 32 of O += P V: 2 k-steps x 16 n-tiles), 34 ldmatrix (18 K, 16 V), 18 16-byte cp.async
  (a thread's share of the next tile) and two barriers (the ring's and the S exchange's);
- the latent rows stream by 16-byte cp.async (LDGSTS.E.BYPASS.128) with commit / wait;
- no spills and no local memory.
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

import pytest
from sass_helpers import assert_cp_async_16, guard, report, spills

ROOT = Path(__file__).resolve().parent.parent
ARCHS = ("sm_80", "sm_90")
KERNELS = ("mla_decode_bf16", "mla_decode_f16")


sr = report()


@lru_cache(maxsize=None)
def loops() -> dict[str, dict[str, dict[str, Any]]]:
    return guard(lambda: sr.loop_metrics(list(KERNELS), ARCHS))


@lru_cache(maxsize=None)
def mix() -> dict[str, dict[str, dict[str, Any]]]:
    return guard(lambda: sr.instruction_mix(list(KERNELS), ARCHS, with_resources=True))


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("arch", ARCHS)
def test_flat_tile_loop_of_hmma(kernel: str, arch: str) -> None:
    row = loops()[kernel][arch]
    assert row["mma"] == 68, row
    assert row["ldsm"] == 34 and row["ldgsts"] == 18 and row["bar"] == 2, row
    # about 7 warp-instructions an MMA (docs/serving.md "MLA decode"): the S exchange, the online softmax and
    # the O rescale ride on a 32-key tile; more than 8 means something new entered the loop
    assert row["per_mma"] < 8.0, row


def test_cp_async_is_16_bytes_with_commit_and_wait() -> None:
    assert_cp_async_16("mla.cu", "sm_90")


def test_no_spills() -> None:
    m = mix()
    bad = spills(m)
    assert not bad, bad
    assert all(m[k][a]["HMMA"] >= 68 for k in KERNELS for a in ARCHS), m
