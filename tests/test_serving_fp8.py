"""FP8 KV caches (float8_e4m3fn, float8_e5m2) on the serving ops, vLLM's semantics.

- append stores fp8(x / scale): round to nearest even, saturated to the finite range (e4m3fn 448,
  e5m2 57344; inf saturates too), NaN stays NaN; bit-exact against ml_dtypes on the clipped input, for
  every bf16 bit pattern and for the fp32 classes (ties, subnormals, saturation, NaN, +-0, random bits);
- attention widens every one of the 256 codes exactly (fp8 * scale), on the 16-byte and the scalar path;
- the sm_90 cubin converts in hardware (F2FP ... E4M3 / E5M2), sm_80 has no such instruction (its
  integer code is the host's, tested here).
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from family_helpers import need as _need  # noqa: E402
from pykern import ArgumentError, ArgumentTypeError, ops  # noqa: E402
from pykern.difftest.cases.serving import fp8_dtype, fp8_quantize, make_paged, make_q, np_ragged_attention  # noqa: E402
from sass_helpers import source_sass

ml_dtypes = pytest.importorskip("ml_dtypes")
ROOT = Path(__file__).resolve().parent.parent
KINDS = ("e4m3", "e5m2")
D = 64


def _append_bytes(x: np.ndarray, kind: str, scale: float = 1.0) -> np.ndarray:
    """The bytes append_paged_kv_cache stores for the values x (f32 or bf16), in order."""
    n = x.size
    pad = (-n) % D
    xs = np.concatenate([x.reshape(-1), np.zeros(pad, x.dtype)]).reshape(-1, 1, D)
    nnz = xs.shape[0]
    pages = np.zeros((nnz, 1, 1, D), fp8_dtype(kind))
    vpages = pages.copy()
    ops.append_paged_kv_cache(xs, xs, np.zeros(nnz, np.int32), np.arange(nnz, dtype=np.int32), pages, vpages,
                              np.arange(nnz, dtype=np.int32), np.array([0, nnz], np.int32), np.array([1], np.int32),
                              k_scale=scale, v_scale=scale, backend="host")
    assert np.array_equal(pages.view(np.uint8), vpages.view(np.uint8))
    return pages.reshape(-1)[:n].view(np.uint8)


def _check(x: np.ndarray, kind: str, scale: float = 1.0) -> None:
    got = _append_bytes(x, kind, scale)
    want = fp8_quantize(np.asarray(x, np.float32), kind, scale).view(np.uint8)
    nan_in = np.isnan(np.asarray(x, np.float32))
    # NaN stays NaN (with its sign); canonical NaNs get the canonical byte (checked below)
    assert np.isnan(got[nan_in].view(fp8_dtype(kind)).astype(np.float32)).all()
    assert ((got[nan_in] & 0x80) == (want[nan_in] & 0x80)).all()
    bad = np.flatnonzero((got != want) & ~nan_in)
    assert bad.size == 0, [(float(np.asarray(x, np.float32).reshape(-1)[i]), hex(got[i]), hex(want[i]))
                           for i in bad[:8]]


@pytest.mark.parametrize("kind", KINDS)
def test_every_bf16_pattern_is_bit_exact(kind: str) -> None:
    _need("host")
    x = np.arange(1 << 16, dtype=np.uint16).view(ml_dtypes.bfloat16)
    _check(x, kind)


def _fp32_classes(kind: str) -> np.ndarray:
    dt = fp8_dtype(kind)
    codes = np.arange(0x80, dtype=np.uint8).view(dt).astype(np.float64)
    codes = codes[np.isfinite(codes)]
    mids = (codes[1:] + codes[:-1]) / 2  # exact ties between neighbours (fp32 holds them exactly)
    assert (mids.astype(np.float32) == mids).all()
    near = np.concatenate([np.nextafter(mids.astype(np.float32), np.float32(np.inf)),
                           np.nextafter(mids.astype(np.float32), np.float32(-np.inf))])
    mx = float(ml_dtypes.finfo(dt).max)
    ulp = mx - float(codes[-2])
    sat = np.array([mx, mx + ulp / 2, np.nextafter(np.float32(mx + ulp / 2), np.float32(0)),
                    np.nextafter(np.float32(mx + ulp / 2), np.float32(np.inf)), 2 * mx, 1e30, 3.4e38, np.inf],
                   np.float32)
    tiny = float(ml_dtypes.finfo(dt).smallest_subnormal)
    sub = np.array([tiny, tiny / 2, np.nextafter(np.float32(tiny / 2), np.float32(1)), tiny / 4, 1.5 * tiny,
                    2.5 * tiny, 1e-40, 1.4e-45, 0.0], np.float32)  # 1e-40, 1.4e-45: fp32 subnormals
    special = np.array([np.nan, -np.nan], np.float32)
    rng = np.random.default_rng(0)
    rand = rng.integers(0, 2**32, 1 << 14, dtype=np.uint64).astype(np.uint32).view(np.float32)
    base = np.concatenate([codes.astype(np.float32), mids.astype(np.float32), near, sat, sub, special])
    return np.concatenate([base, -base, rand])


@pytest.mark.parametrize("kind", KINDS)
def test_fp32_classes_are_bit_exact(kind: str) -> None:
    _need("host")
    x = _fp32_classes(kind)
    _check(x, kind)
    # -0 keeps its sign, canonical NaNs their byte, inf saturates
    b = _append_bytes(np.array([-0.0, 0.0, np.nan, -np.nan, np.inf, -np.inf], np.float32), kind)
    top = 0x7E if kind == "e4m3" else 0x7B
    nan = 0x7F if kind == "e4m3" else 0x7E
    assert list(b) == [0x80, 0x00, nan, 0x80 | nan, top, 0x80 | top]


@pytest.mark.parametrize("kind", KINDS)
def test_scaled_append_divides_in_fp32(kind: str) -> None:
    _need("host")
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(1 << 14) * 300).astype(np.float32)
    _check(x, kind, 0.37)  # not a power of two: the fp32 division's rounding counts
    _check(x.astype(ml_dtypes.bfloat16), kind, 3.0)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("aligned", [True, False])
def test_attention_widens_every_code_exactly(kind: str, aligned: bool) -> None:
    """One key: softmax weight 1, so out = v_scale * V exactly, V holding all 256 codes (NaN, inf included)."""
    _need("host")
    d = 256
    pages = np.zeros((1, 1, 1, d + (0 if aligned else 1)), fp8_dtype(kind))
    kbuf = np.zeros_like(pages)
    v = pages[..., 1:] if not aligned else pages  # a 1-byte offset view: the scalar path
    k = kbuf[..., 1:] if not aligned else kbuf
    v.view(np.uint8)[0, 0, 0, :] = np.arange(256, dtype=np.uint8)
    q = np.ones((1, 1, d), np.float32)
    out = ops.paged_decode_attention(q, k, v, np.array([0, 1]), np.array([0]), np.array([1]), v_scale=2.0,
                                     backend="host")
    want = np.arange(256, dtype=np.uint8).view(fp8_dtype(kind)).astype(np.float32) * np.float32(2.0)
    np.testing.assert_array_equal(out.reshape(-1), want)  # NaN where the code is NaN


@pytest.mark.parametrize("kind", KINDS)
def test_torch_fp8_cache_append_and_decode(kind: str) -> None:
    _need("host")
    torch = pytest.importorskip("torch")
    tdt = torch.float8_e4m3fn if kind == "e4m3" else torch.float8_e5m2
    rng = np.random.default_rng(2)
    lens, ps, kvh, h = [9, 4], 4, 2, 8
    pc = make_paged(rng, lens, ps, kvh, D, "NHD", kind)
    cache = torch.zeros((pc["k_pages"].shape[0], 2) + pc["k_pages"].shape[1:], dtype=tdt)
    kn = torch.from_numpy(np.concatenate(pc["ks_raw"]))
    vn = torch.from_numpy(np.concatenate(pc["vs_raw"]))
    bi, pos = ops.get_batch_indices_positions(np.array([0, 9, 13]), lens, 13)
    t = torch.from_numpy
    ops.append_paged_kv_cache(kn, vn, t(bi), t(pos), cache, t(pc["kv_indices"]), t(pc["kv_indptr"]),
                              t(pc["kv_last_page_len"]), k_scale=pc["scales"][0], v_scale=pc["scales"][1],
                              backend="host")
    owned = pc["kv_indices"]
    np.testing.assert_array_equal(cache[:, 0].view(torch.uint8).numpy()[owned],
                                  np.nan_to_num(pc["k_pages"].astype(np.float32), nan=0).astype(
                                      fp8_dtype(kind)).view(np.uint8)[owned])
    q = make_q(rng, (2, h, D))
    out = ops.paged_decode_attention(t(q), cache, t(pc["kv_indptr"]), t(pc["kv_indices"]), t(pc["kv_last_page_len"]),
                                     k_scale=pc["scales"][0], v_scale=pc["scales"][1], backend="host")
    ref, _ = np_ragged_attention(q.astype(np.float64), np.arange(3), pc["ks"], pc["vs"])
    np.testing.assert_allclose(out.numpy(), ref, atol=1e-5, rtol=1e-5)


def test_fp8_arguments_are_checked() -> None:
    _need("host")
    rng = np.random.default_rng(3)
    pc = make_paged(rng, [5], 4, 1, 16, "NHD", "e4m3")
    k = np.zeros((1, 1, 16), np.float32)
    args = (np.zeros(1, np.int32), np.array([4], np.int32), pc["k_pages"], pc["v_pages"], pc["kv_indices"],
            pc["kv_indptr"], pc["kv_last_page_len"])
    with pytest.raises(ArgumentError, match="k_scale: expected a finite float > 0"):
        ops.append_paged_kv_cache(k, k, *args, k_scale=0.0, backend="host")
    with pytest.raises(ArgumentTypeError, match="k: expected dtype float32 or bfloat16"):
        ops.append_paged_kv_cache(k.astype(np.float64), k, *args, backend="host")
    f32 = make_paged(rng, [5], 4, 1, 16)
    with pytest.raises(ArgumentError, match="k_scale: scales apply to FP8 pages only"):
        ops.append_paged_kv_cache(k, k, args[0], args[1], f32["k_pages"], f32["v_pages"], f32["kv_indices"],
                                  f32["kv_indptr"], f32["kv_last_page_len"], k_scale=2.0, backend="host")
    with pytest.raises(ArgumentTypeError, match="v_pages: expected the dtype of k_pages"):
        ops.paged_decode_attention(make_q(rng, (1, 1, 16)), pc["k_pages"], pc["v_pages"].view(ml_dtypes.float8_e5m2),
                                   pc["kv_indptr"], pc["kv_indices"], pc["kv_last_page_len"], backend="host")


# --------------------------------------------------------------------------- SASS
def _sass(arch: str) -> dict[str, str]:
    text = source_sass("paged.cu", arch)
    out: dict[str, list[str]] = {}
    cur = None
    for line in text.splitlines():
        if "Function : " in line:
            cur = line.split("Function : ")[1].strip()
            out[cur] = []
        elif cur:
            out[cur].append(line)
    return {k: "\n".join(v) for k, v in out.items()}


FP8_KERNELS = [f"paged_attn{q}_{k}kv" for q in ("", "_bf16") for k in KINDS] + \
              [f"paged_append_kv{i}_{k}" for i in ("", "_bf16") for k in KINDS]


def test_sm90_converts_fp8_in_hardware_and_sm80_does_not() -> None:
    s90, s80 = _sass("sm_90"), _sass("sm_80")
    for name in FP8_KERNELS:
        fmt = "E4M3" if "e4m3" in name else "E5M2"
        want = f"F2FP.SATFINITE.{fmt}.F32" if "append" in name else f"F2FP.F16.{fmt}.UNPACK_B"
        assert want in s90[name], f"{name} sm_90: no {want}"
        assert "E4M3" not in s80[name] and "E5M2" not in s80[name], f"{name} sm_80 has an fp8 instruction"
    for name in ("paged_attn_e4m3kv", "paged_attn_bf16_e5m2kv"):  # fp8 pages stream by 16-byte cp.async
        assert "LDGSTS.E.BYPASS.128" in s90[name] and "LDGSTS.E.BYPASS.128" in s80[name]


def test_docs_serving_snippets_run_on_the_host() -> None:
    """Every ```python block of docs/serving.md (the whole examples) runs (host backend) and samples tokens;
    fragments that assume the reader's arrays are fenced ```py."""
    import os
    import re
    import subprocess

    _need("host")
    text = (ROOT / "docs" / "serving.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) == 2
    env = dict(os.environ, PYKERN_BACKEND="host", PYTHONPATH=str(ROOT))
    for code in blocks:
        if "import torch" in code:
            pytest.importorskip("torch")
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        assert re.search(r"\d", r.stdout), r.stdout
