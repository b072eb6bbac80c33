"""Difftest cases for kernels_cu/gemm_fp8.cu and the float64 NumPy references of its ops: the 1 x 128
quantization (f32 / bf16 / f16 input, an all-zero tile, values that saturate) and the block-scaled GEMMs
(ragged M and N, one row, K = 128 and 384; grouped: empty groups, a group of one row).

The Hopper kernel (grouped_gemm_fp8_sm90 of kernels_cu/grouped_gemm_sm90.cu: TMA + QGMMA) has two cases that
declare arch sm_90a (as moe_sm90.py's): the host backend plays sm_90a for them, the others report them as not
applicable. They launch through the op's own helper (pykern/ops/gemm_fp8.py `_try_sm90`: its tensor maps, grid and
shared memory); a helper that declines is an error, never a fallback. Their activation scales differ by 2^12
between k-blocks, so a promotion that used the wrong k-block's scale is off by far more than rounding."""
from __future__ import annotations

from typing import Any, Iterator

import numpy as np

from ..case import Case, register_cases
from ._fp8 import e4m3_descale, e4m3_quantize
from .training import _cast, _ops, f64


def _token_groups(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(e4m3 codes [M, K], fp32 scales [M, K/128]) of fp32 x [M, K] in groups of 128 along a row, eps 1e-10."""
    m, k = x.shape
    t = x.reshape(m, k // 128, 128)
    s = e4m3_descale(np.maximum(np.abs(t).max(-1), np.float32(1e-10)))
    return e4m3_quantize(t, s[..., None]).reshape(m, k), s


def np_fp8_quantize(x: Any) -> tuple[np.ndarray, np.ndarray]:
    """vLLM's per_token_group_quant_fp8 (group 128, eps 1e-10) in fp32, as its definition: returns the codes'
    values (float64) and the scales."""
    q, s = _token_groups(np.asarray(x).astype(np.float32))
    return f64(q.astype(np.float32)), f64(s)


def np_gemm_fp8(a: Any, a_scale: Any, b: Any, b_scale: Any) -> np.ndarray:
    """float64 of the op's definition: the sum over 128-wide k-blocks kb of (a[:, kb] @ b[:, kb]^T) * a_scale[:, kb]
    * b_scale[n // 128, kb]. With finite scales that is the product of the dequantized inputs; an infinite scale
    multiplies each block's partial sum (+-inf, NaN only where the partial is 0), as the kernels' promotion does,
    where dequantizing first would give 0 * inf = NaN for every zero code."""
    a64, b64 = f64(np.asarray(a).astype(np.float32)), f64(np.asarray(b).astype(np.float32))
    (m, k), n = a64.shape, b64.shape[0]
    sa, sb = f64(a_scale), np.repeat(f64(b_scale), 128, axis=0)[:n]  # sb: [N, K / 128]
    out = np.zeros((m, n))
    for kb in range(k // 128):
        blk = slice(kb * 128, (kb + 1) * 128)
        out += (a64[:, blk] @ b64[:, blk].T) * sa[:, kb:kb + 1] * sb[None, :, kb]
    return out


def np_grouped_gemm_fp8(a: Any, a_scale: Any, b: Any, b_scale: Any, offsets: Any) -> np.ndarray:
    out = np.zeros((np.asarray(a).shape[0], np.asarray(b).shape[1]))
    for e in range(np.asarray(b).shape[0]):
        lo, hi = int(offsets[e]), int(offsets[e + 1])
        out[lo:hi] = np_gemm_fp8(np.asarray(a)[lo:hi], np.asarray(a_scale)[lo:hi], np.asarray(b)[e],
                                 np.asarray(b_scale)[e])
    return out


def fp8_weight(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """DeepSeek-V3's 128 x 128 weight blocks: (e4m3 [N, K], scales [ceil(N/128), K/128]) of w [N, K]."""
    n, k = w.shape
    nb = -(-n // 128)
    wp = np.zeros((nb * 128, k), np.float32)
    wp[:n] = w
    t = wp.reshape(nb, 128, k // 128, 128)
    s = e4m3_descale(np.maximum(np.abs(t).max((1, 3)), np.float32(1e-10)))
    q = e4m3_quantize(t, s[:, None, :, None]).reshape(nb * 128, k)[:n]
    return np.ascontiguousarray(q), s


def _act(rng: np.random.Generator, m: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    return _token_groups((rng.standard_normal((m, k)) * rng.uniform(0.1, 10.0, (m, 1))).astype(np.float32))


def _sm90_case(sizes: tuple[int, ...] | None, m: int, n: int, k: int, rng: np.random.Generator) -> Case:
    """sizes None: gemm_fp8 (one group of m rows, the dense op's launch); else the grouped op's groups."""
    import sys

    from ._sm90 import ARCH, declined as _declined, host_arch as _host_arch

    e = 1 if sizes is None else len(sizes)
    m = m if sizes is None else sum(sizes)
    a, sa = _act(rng, m, k)
    sa *= np.float32(2.0) ** (12 * (np.arange(k // 128, dtype=np.float32) % 2))  # k-blocks 2^12 apart
    ws = [fp8_weight(rng.standard_normal((n, k)).astype(np.float32) * 0.05 * (i + 1)) for i in range(e)]
    b, sb = np.stack([w[0] for w in ws]), np.stack([w[1] for w in ws])
    offsets = None if sizes is None else np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32)
    name = "grouped_gemm_fp8_sm90"

    def run(backend: str) -> dict[str, Any]:
        import pykern.ops.gemm_fp8  # noqa: F401 - the module (pykern.ops.gemm_fp8 the attribute is the op)

        mod = sys.modules["pykern.ops.gemm_fp8"]
        with _host_arch(backend):
            out = np.zeros((m, n), ml_bf16())
            if not mod._try_sm90(a, sa, b, sb, offsets, out, m, n, k, e, None, backend):
                raise _declined(name, backend)
        return {"out": f64(out.astype(np.float32))}

    def ref() -> dict[str, Any]:
        if offsets is None:
            return {"out": np_gemm_fp8(a, sa, b[0], sb[0])}
        return {"out": np_grouped_gemm_fp8(a, sa, b, sb, offsets)}

    shape = (f"{m}x{n}x{k}" if sizes is None else f"{'-'.join(map(str, sizes))}x{n}x{k}") + "-sm90a"
    return Case(op="gemm_fp8" if sizes is None else "grouped_gemm_fp8", dtype="bf16", shape=shape, kernels=(name,),
                run=run, reference=ref, arch=ARCH)


def ml_bf16() -> Any:
    from ...arrays import bfloat16

    return bfloat16()


@register_cases("gemm_fp8")
def cases(rng: np.random.Generator) -> Iterator[Case]:
    ops = _ops()
    for kind in ("f32", "bf16", "f16"):
        x = rng.standard_normal((3, 256)).astype(np.float32) * 3
        x[1, :128] = 0.0           # an all-zero tile
        x[2, 7] = 1e4              # one large value: its tile's others go subnormal / zero
        xk = _cast(x, kind)
        sfx = {"f32": "", "bf16": "_bf16", "f16": "_f16"}[kind]

        def run(backend: str, xk: Any = xk) -> dict[str, np.ndarray]:
            q, s = ops.fp8_quantize(xk, backend=backend)
            return {"q": f64(q.astype(np.float32)), "scales": f64(s)}

        def ref(xk: Any = xk) -> dict[str, np.ndarray]:
            q, s = np_fp8_quantize(xk)
            return {"q": q, "scales": s}

        yield Case(op="fp8_quantize", dtype=kind, shape="3x256", kernels=("gemm_fp8_quantize" + sfx,), run=run,
                   reference=ref)
    for m, n, k in ((1, 8, 128), (70, 136, 256), (65, 128, 384)):
        a, sa = _act(rng, m, k)
        b, sb = fp8_weight(rng.standard_normal((n, k)).astype(np.float32) * 0.05)
        yield Case(op="gemm_fp8", dtype="bf16", shape=f"{m}x{n}x{k}", kernels=("gemm_fp8",),
                   run=lambda backend, a=a, sa=sa, b=b, sb=sb: {
                       "out": f64(ops.gemm_fp8(a, sa, b, sb, backend=backend).astype(np.float32))},
                   reference=lambda a=a, sa=sa, b=b, sb=sb: {"out": np_gemm_fp8(a, sa, b, sb)},
                   note="big" if m * n * k > 2**20 else "")
    for sizes, n, k in (((0, 5, 1, 0, 70), 136, 256), ((1,), 8, 128)):
        m = sum(sizes)
        offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32)
        a, sa = _act(rng, m, k)
        ws = [fp8_weight(rng.standard_normal((n, k)).astype(np.float32) * 0.05) for _ in sizes]
        b = np.stack([w[0] for w in ws])
        sb = np.stack([w[1] for w in ws])
        yield Case(op="grouped_gemm_fp8", dtype="bf16", shape=f"{sizes}x{n}x{k}", kernels=("gemm_fp8_grouped",),
                   run=lambda backend, a=a, sa=sa, b=b, sb=sb, o=offsets: {
                       "out": f64(ops.grouped_gemm_fp8(a, sa, b, sb, o, backend=backend).astype(np.float32))},
                   reference=lambda a=a, sa=sa, b=b, sb=sb, o=offsets: {
                       "out": np_grouped_gemm_fp8(a, sa, b, sb, o)},
                   note="big" if m * n * k > 2**20 else "")
    # Hopper (sm_90a): the grouped op with ragged, empty and one-row groups, and the dense op (one group); three
    # k-blocks, N off the 128-column tile
    yield _sm90_case((0, 5, 1, 0, 130), 0, 136, 384, rng)
    yield _sm90_case(None, 70, 264, 384, rng)
