"""SASS of the decode / serving attention kernels (kernels_cu/paged.cu), from the sm_80 and sm_90 cubins
with cuobjdump (no GPU needed), in the style of tests/test_sass.py:

- K/V tiles stream into shared memory by 16-byte cp.async (LDGSTS.E.BYPASS.128) in every paged_attn* and
  dense_attn* kernel, with commit/wait (LDGDEPBAR / DEPBAR) and no 16-byte register load of K/V left;
- no spills and no local memory in any paged.cu kernel.
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

import pytest
from sass_helpers import assert_cp_async_16, guard, report, spills

ROOT = Path(__file__).resolve().parent.parent
ARCHS = ("sm_80", "sm_90")


sr = report()


def _kernels() -> list[str]:
    from pykern.registry import parse_file, source_files

    return [s.name for src in source_files() if src.name == "paged.cu" for s in parse_file(src)]


@lru_cache(maxsize=None)
def mix() -> dict[str, dict[str, dict[str, Any]]]:
    return guard(lambda: sr.instruction_mix(_kernels(), ARCHS, with_resources=True))


ATTN = [k for k in _kernels() if k.startswith(("paged_attn", "dense_attn")) and "merge" not in k]


def test_attention_kernels_are_listed() -> None:
    assert len(ATTN) == 16, ATTN  # 11 paged (f32, bf16, f16, bf16kv, f16kv, 6 fp8) + 5 dense


@pytest.mark.parametrize("kernel", ATTN)
def test_kv_streams_by_16_byte_cp_async(kernel: str) -> None:
    m = mix()
    for a in ARCHS:
        row = m[kernel][a]
        # K and V: one LDGSTS each in the async fill (the fill loop may be unrolled: >= 2)
        assert row["LDGSTS"] >= 2, f"{kernel} {a}: no cp.async: {row}"
        # K/V no longer pass through registers as 16-byte loads (q and indices are narrower)
        assert row["LDG128"] == 0, f"{kernel} {a}: a 16-byte register load is left: {row}"


def test_cp_async_is_16_bytes_with_commit_and_wait() -> None:
    assert_cp_async_16("paged.cu", "sm_90")


def test_no_spills() -> None:
    m = mix()
    bad = spills(m)
    assert not bad, bad
