"""NVRTC compiles every Hopper wrapper of pk_ptx.cuh for sm_90a, and the SASS holds the instructions they
stand for (cuobjdump from the nvidia-cuda-cuobjdump wheel; no GPU needed). The same source refuses sm_90."""
from __future__ import annotations

import re
import warnings
from collections import Counter
from functools import lru_cache
from pathlib import Path

import pytest
from sass_helpers import compile_sass

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "tests" / "sm90_cu" / "pk_sm90_wrappers.cu"


@lru_cache(maxsize=None)
def _sass() -> dict[str, Counter]:
    mod, text = compile_sass(SRC, "sm_90a")
    out: dict[str, Counter] = {}
    cur = None
    for line in text.splitlines():
        m = re.search(r"Function : (\S+)", line)
        if m:
            cur = out.setdefault(m.group(1), Counter())
            continue
        m = re.search(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Za-z0-9_]+)*)", line)
        if m and cur is not None:
            cur[m.group(1)] += 1
    return out


def _count(kernel: str, prefix: str) -> int:
    return sum(n for op, n in _sass()[kernel].items() if op == prefix or op.startswith(prefix + "."))


def test_tma_wgmma_kernel_sass() -> None:
    k = "pk_sm90_tma_wgmma_ss"
    assert _count(k, "HGMMA") == 4  # four m64n64k16 wgmmas
    assert _sass()[k]["HGMMA.64x64x16.F32.BF16"] == 4
    assert _count(k, "UTMALDG") == 2 and _sass()[k]["UTMALDG.2D"] == 2
    assert _sass()[k]["UTMASTG.2D"] == 1
    assert _count(k, "SYNCS") >= 3  # mbarrier init, arrive.expect_tx, try_wait
    assert _count(k, "ELECT") >= 1 and _count(k, "WARPGROUP") >= 2


def test_register_a_kernel_sass() -> None:
    k = "pk_sm90_wgmma_rs"
    ops = _sass()[k]
    assert [op for op in ops if op.startswith("HGMMA")] == ["HGMMA.64x128x16.F32"]  # f16 has no type suffix
    assert ops["USETMAXREG.TRY_ALLOC.CTAPOOL"] == 1 and ops["USETMAXREG.DEALLOC.CTAPOOL"] == 1


def test_tma_nd_kernel_sass() -> None:
    ops = _sass()["pk_sm90_tma_nd"]
    assert ops["UTMALDG.3D"] == ops["UTMALDG.4D"] == ops["UTMALDG.5D"] == 1


def test_the_same_source_for_sm_90_fails_with_the_reason() -> None:
    from pykern import compiler
    from pykern.errors import CompileError

    _sass()  # skips without NVRTC
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(CompileError, match=r"wgmma / setmaxnreg need the sm_90a target"):
            compiler.compile(SRC, "sm_90")
