"""Plain C++ float-to-int conversions and big shifts give the GPU's results on the host backend.

tests/host_kernels/gpuconv.cu (and gpuconv.cuh) are rewritten by pykern/host/gpu_conv.py before
g++: `cvt.rzi` saturation (NaN -> 0) and `shl`/`shr` clamping, where x86 gives INT_MIN and a
masked shift count. The references here are written out from those PTX semantics.
"""
from __future__ import annotations

import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest

import pykern
from pykern.host import gpu_conv

HOST_KERNELS = Path(__file__).resolve().parent / "host_kernels"

pytestmark = pytest.mark.skipif(isinstance(gpu_conv._cindex(), Exception), reason="libclang is not installed")

INT_MIN, INT_MAX, UINT_MAX = -(2**31), 2**31 - 1, 2**32 - 1
LL_MIN, LL_MAX, ULL_MAX = -(2**63), 2**63 - 1, 2**64 - 1


@pytest.fixture(autouse=True)
def _host_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYKERN_KERNEL_PATH", str(HOST_KERNELS))
    monkeypatch.delenv("PYKERN_HOST_GPU_CONVERSIONS", raising=False)


def cvt_rzi(x: float, lo: int, hi: int) -> int:
    """PTX cvt.rzi to an integer type with range [lo, hi]: truncate, saturate, NaN -> 0."""
    if np.isnan(x):
        return 0
    if np.isinf(x):
        return hi if x > 0 else lo
    return int(min(max(int(np.trunc(x)), lo), hi))


def shift(a: int, s: int, bits: int, left: bool, signed: bool) -> int:
    """PTX shl/shr.{b,u,s}{32,64}: the count is a u32, >= bits clamps (0, or the sign for shr.s)."""
    s &= 0xFFFFFFFF
    mask = (1 << bits) - 1
    if left:
        r = 0 if s >= bits else (a << s) & mask
        return r - (1 << bits) if signed and r >> (bits - 1) else r
    if s >= bits:
        return -1 if signed and a < 0 else 0
    return a >> s  # Python's >> on a negative int is the arithmetic shift


CAST_X = np.concatenate([
    np.array([3e9, -3e9, np.nan, -1.5, 5e9, 1e30, -1e30, np.inf, -np.inf, 2.7, -2.7, 0.0, -0.0,
              2147483520.0, -2147483648.0, 4294967040.0, -0.99], np.float32),
    np.random.default_rng(0).uniform(-2e9, 2e9, 15).astype(np.float32),  # in range: unchanged
])


def _casts(x: np.ndarray) -> dict[str, np.ndarray]:
    n = x.size
    names = ("oi", "ou", "oll", "oull", "oimp", "ostat", "ofunc", "ohdr", "odbl")
    types = (np.int32, np.uint32, np.int64, np.uint64, np.int32, np.int32, np.int32, np.int32, np.int64)
    outs = {k: np.zeros(n, t) for k, t in zip(names, types)}
    pykern.launch("pk_g_casts", 1, 32, x, x.astype(np.float64), *outs.values(), n, backend="host")
    return outs


def test_float_to_int_conversions_saturate_like_cvt_rzi() -> None:
    o = _casts(CAST_X)
    i32 = [cvt_rzi(float(v), INT_MIN, INT_MAX) for v in CAST_X]
    for k in ("oi", "oimp", "ostat", "ofunc", "ohdr"):  # C cast, implicit, static_cast, int(x), in a header
        assert o[k].tolist() == i32, k
    assert o["ou"].tolist() == [cvt_rzi(float(v), 0, UINT_MAX) for v in CAST_X]
    assert o["oll"].tolist() == [cvt_rzi(float(v), LL_MIN, LL_MAX) for v in CAST_X]
    assert o["odbl"].tolist() == o["oll"].tolist()  # from double
    assert o["oull"].tolist() == [cvt_rzi(float(v), 0, ULL_MAX) for v in CAST_X]
    # The out-of-range and NaN inputs, value by value.
    assert o["oi"][:3].tolist() == [INT_MAX, INT_MIN, 0]  # 3e9, -3e9, NaN
    assert o["ou"][3] == 0 and o["ou"][4] == UINT_MAX  # -1.5, 5e9
    assert o["oll"][5] == LL_MAX  # 1e30
    assert o["oimp"][0] == INT_MAX  # int j = f;


def _shifts(a: np.ndarray, s: np.ndarray) -> dict[str, np.ndarray]:
    n = a.size
    u, al = a.view(np.uint32).copy(), a.astype(np.int64) * 3
    names = ("oshl", "oshru", "oshrs", "oshl64", "ocomp", "ocompu", "olit", "olitu", "olits", "otmpl", "oconst")
    types = (np.int32, np.uint32, np.int32, np.int64, np.int32, np.uint32, np.int32, np.uint32, np.int32,
             np.int32, np.int32)
    outs = {k: np.zeros(n, t) for k, t in zip(names, types)}
    pykern.launch("pk_g_shifts", 1, 32, a, u, al, s, *outs.values(), n, backend="host")
    return outs


def test_shifts_by_the_width_or_more_clamp_like_shl_shr() -> None:
    rng = np.random.default_rng(1)
    a = np.concatenate([np.array([5, -8, 7, -1, 1, 123, INT_MIN, 3, -8, 9], np.int32),
                        rng.integers(INT_MIN, INT_MAX, 22, dtype=np.int64).astype(np.int32)])
    s = np.concatenate([np.array([32, 40, 33, 31, 0, -1, 64, 3, 40, 63], np.int32),
                        rng.integers(0, 32, 22).astype(np.int32)])  # in range: unchanged
    o = _shifts(a, s)
    ai, ui, si = a.tolist(), a.view(np.uint32).tolist(), s.tolist()
    shl = [shift(x, c, 32, True, True) for x, c in zip(ai, si)]
    assert o["oshl"].tolist() == shl
    assert o["ocomp"].tolist() == shl  # x <<= s
    assert o["otmpl"].tolist() == shl  # in a function template
    assert o["oshru"].tolist() == [shift(x, c, 32, False, False) for x, c in zip(ui, si)]
    assert o["ocompu"].tolist() == o["oshru"].tolist()  # x >>= s
    assert o["oshrs"].tolist() == [shift(x, c, 32, False, True) for x, c in zip(ai, si)]
    assert o["oshl64"].tolist() == [shift(3 * x, c, 64, True, True) for x, c in zip(ai, si)]
    # Literal counts >= the width: x << 32 == 0, u >> 40 == 0, -8 >> 40 == -1.
    assert (o["olit"] == 0).all() and (o["olitu"] == 0).all()
    assert o["olits"].tolist() == [-1 if x < 0 else 0 for x in ai]
    assert o["oshl"][2] == 0 and a[2] == 7 and s[2] == 33  # a runtime count of 33
    assert o["olits"][1] == -1 and a[1] == -8
    # Constant expressions in the kernel still compile and evaluate (2 << k, 1u << k, case labels).
    # buf[t] = t << 1; under `case 2` (s in 2, 10, 18, 26) a shift by s + 30 >= 32.
    assert o["oconst"].tolist() == [0 if c & 7 == 2 else 2 * 6 for c in si]
    assert any(c & 7 == 2 for c in si)


def test_explicit_casts_with_template_dependent_types() -> None:
    x = CAST_X
    n = x.size
    k = np.arange(-6, n - 6, dtype=np.int32)
    o, oto, ofrom, oi = (np.zeros(n, np.int32) for _ in range(4))
    ol = np.zeros(n, np.int64)
    pykern.launch("pk_g_template_casts", 1, 32, x, k, o, ol, oto, ofrom, oi, n, backend="host")
    i32 = [cvt_rzi(float(v), INT_MIN, INT_MAX) for v in x]
    assert o.tolist() == i32 and oto.tolist() == i32 and ofrom.tolist() == i32
    assert ol.tolist() == [cvt_rzi(float(v), LL_MIN, LL_MAX) for v in x]
    assert oi.tolist() == (2 * k).tolist()


def test_default_argument_and_macro_argument_still_build() -> None:
    o = np.zeros(2, np.int32)
    pykern.launch("pk_g_misc", 1, 32, np.array([3e9, 1.5], np.float32), o, 2, backend="host")
    assert o.tolist() == [2, 2]


def test_off_switch_gives_x86_results(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYKERN_HOST_GPU_CONVERSIONS", "0")
    o = _casts(CAST_X[:3])
    assert o["oi"].tolist() == [INT_MIN, INT_MIN, INT_MIN]  # x86's "integer indefinite"
    a, s = np.array([7, -8], np.int32), np.array([33, 40], np.int32)
    r = _shifts(a, s)
    assert r["oshl"].tolist() == [14, -8 << 8]  # the count masked to 5 bits: 33 -> 1, 40 -> 8


USER = textwrap.dedent(
    """\
    #include "pk_common.cuh"
    #include "sub/conv_a.cuh"
    extern "C" __global__ void pk_u_conv(const float* x, const int* s, int* o, int* t, int n) {
        const int i = threadIdx.x;
        if (i < n) { o[i] = (int)x[i]; t[i] = pk_u_shl(1, s[i]); }
    }
    """
)
# A header in a subfolder that includes its neighbour, which holds the shift.
USER_HEADERS = {
    "sub/conv_a.cuh": '#pragma once\n#include "conv_b.cuh"\n',
    "sub/conv_b.cuh": "#pragma once\n__device__ inline int pk_u_shl(int a, int s) { return a << s; }\n",
}


def _user_launch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[list[int], list[int], list[str]]:
    kdir = tmp_path / "k"
    kdir.mkdir()
    (kdir / "conv.cu").write_text(USER)
    for name, text in USER_HEADERS.items():
        (kdir / name).parent.mkdir(exist_ok=True)
        (kdir / name).write_text(text)
    monkeypatch.setenv("PYKERN_KERNEL_PATH", str(kdir))
    monkeypatch.setenv("PYKERN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(gpu_conv, "_warned", set())
    x, s = np.array([3e9, 2.5], np.float32), np.array([32, 3], np.int32)
    o, t = np.zeros(2, np.int32), np.zeros(2, np.int32)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        pykern.launch("pk_u_conv", 1, 32, x, s, o, t, 2, backend="host")
    return o.tolist(), t.tolist(), [str(m.message) for m in w if "pykern host backend" in str(m.message)]


def test_user_kernel_is_rewritten(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    o, t, warned = _user_launch(tmp_path, monkeypatch)
    assert (o, t, warned) == ([INT_MAX, 2], [0, 8], [])


def test_unparsable_source_builds_unrewritten_with_one_warning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Without the compiler's builtin headers libclang cannot find <cfloat>'s float.h: a parse error.
    monkeypatch.setattr(gpu_conv, "_builtin_include", lambda cxx: None)
    o, t, warned = _user_launch(tmp_path, monkeypatch)
    assert (o, t) == ([INT_MIN, 2], [1, 8])  # x86's results, but it builds and runs
    assert len(warned) == 1 and "could not parse" in warned[0] and "conv.cu" in warned[0]


def test_missing_libclang_builds_unrewritten_with_one_warning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu_conv, "_cindex", lambda: ImportError("No module named 'clang'"))
    o, t, warned = _user_launch(tmp_path, monkeypatch)
    assert (o, t) == ([INT_MIN, 2], [1, 8])
    assert len(warned) == 1 and "pip install libclang" in warned[0] and "PYKERN_HOST_GPU_CONVERSIONS=0" in warned[0]
