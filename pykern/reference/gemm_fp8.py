"""numba.cuda references for kernels_cu/gemm_fp8.cu: one thread per 1 x 128 tile (quantize) or per output
element (the GEMMs), plain loops. FP8 arrays arrive as their bytes (uint8), bf16 / f16 widened to float32;
e4m3 bytes are decoded and encoded by the format's definition (no lookup tables, no libdevice)."""
from __future__ import annotations

from typing import Any

import numpy as np

from .base import reference

_T = 64


def _decode(cuda: Any) -> Any:
    @cuda.jit(device=True)
    def e4m3(b):
        b = int(b)
        sgn = -1.0 if b & 0x80 else 1.0
        m = b & 0x7F
        if m == 0x7F:
            return np.float32(np.nan)
        e = m >> 3
        f = m & 7
        if e == 0:
            return np.float32(sgn * f * 2.0**-9)
        return np.float32(sgn * (1.0 + f / 8.0) * 2.0 ** (e - 7))

    return e4m3


@reference("gemm_fp8_quantize", "gemm_fp8_quantize_bf16", "gemm_fp8_quantize_f16")
def _quantize(cuda: Any):
    e4m3 = _decode(cuda)

    @cuda.jit
    def k(x, q, scales, M, K):
        tile = cuda.grid(1)
        if tile < M * (K // 128):
            base = tile * 128
            amax = np.float32(0.0)
            nan = False
            for i in range(128):
                amax = max(amax, abs(np.float32(x[base + i])))
                nan = nan or x[base + i] != x[base + i]
            amax = max(amax, np.float32(1e-10))
            s = np.float32(np.nan) if nan else np.float32(amax / np.float32(448.0))  # a NaN in the tile: all NaN
            scales[tile] = s
            for i in range(128):
                v = np.float32(np.float32(x[base + i]) / s)
                if v != v:
                    q[base + i] = 0x7F  # e4m3's NaN
                    continue
                a = min(abs(v), np.float32(448.0))  # saturate (|x| / s can round just above 448)
                best = 0
                bd = np.float32(np.inf)
                for c in range(0x7F):  # the nearest finite code, ties to the even one
                    dv = abs(e4m3(c) - a)
                    if dv < bd or (dv == bd and c % 2 == 0):
                        best = c
                        bd = dv
                q[base + i] = best | (0x80 if v < 0 else 0)

    def config(args):
        n = args[3] * (args[4] // 128)
        return (max(1, (n + _T - 1) // _T),), (_T,)

    return k, config


def _gemm_element(cuda: Any):
    e4m3 = _decode(cuda)

    @cuda.jit(device=True)
    def dot(a, a_scale, b, b_scale, row, col, e, N, K):
        nkb = K // 128
        nbn = (N + 127) // 128
        acc = np.float32(0.0)
        for kb in range(nkb):
            part = np.float32(0.0)
            for kk in range(128):
                k = kb * 128 + kk
                part += e4m3(a[row * K + k]) * e4m3(b[(e * N + col) * K + k])
            acc += part * (a_scale[row * nkb + kb] * b_scale[(e * nbn + col // 128) * nkb + kb])
        return acc

    return dot


@reference("gemm_fp8")
def _gemm(cuda: Any):
    dot = _gemm_element(cuda)

    @cuda.jit
    def k(a, a_scale, b, b_scale, out, M, N, K):
        i = cuda.grid(1)
        if i < M * N:
            out[i] = dot(a, a_scale, b, b_scale, i // N, i % N, 0, N, K)

    def config(args):
        n = args[5] * args[6]
        return (max(1, (n + _T - 1) // _T),), (_T,)

    return k, config


@reference("gemm_fp8_grouped")
def _gemm_grouped(cuda: Any):
    dot = _gemm_element(cuda)

    @cuda.jit
    def k(a, a_scale, b, b_scale, offsets, out, M, N, K, n_groups):
        i = cuda.grid(1)
        if i < M * N:
            row = i // N
            for e in range(n_groups):
                if offsets[e] <= row < offsets[e + 1]:
                    out[i] = dot(a, a_scale, b, b_scale, row, i % N, e, N, K)

    def config(args):
        n = args[6] * args[7]
        return (max(1, (n + _T - 1) // _T),), (_T,)

    return k, config
