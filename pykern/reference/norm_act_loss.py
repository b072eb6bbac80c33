"""numba.cuda references for kernels_cu/norm_act_loss.cu: one thread per row (or element, or
column), plain loops, float64 Python math (the layer_norm ones widen loads with float(): NumPy 2 keeps
float32 + a Python float in float32). Arrays arrive flat, bf16 widened to float32."""
from __future__ import annotations

import math
from typing import Any

from .base import device_function, gelu_fns, reference, rms_norm_grad_row

_T = 64


def _grid1(n: int) -> tuple[tuple[int], tuple[int]]:
    return ((n + _T - 1) // _T,), (_T,)


@reference("add_rms_norm", "add_rms_norm_bf16", "add_rms_norm_f16")
def _add_rms_norm(cuda: Any):
    @cuda.jit
    def k(x, res, w, y, new_res, n_rows, dim, eps, offset):
        row = cuda.grid(1)
        if row < n_rows:
            base = row * dim
            ss = 0.0
            for i in range(dim):
                new_res[base + i] = x[base + i] + res[base + i]
                ss += new_res[base + i] * new_res[base + i]
            r = 1.0 / math.sqrt(ss / dim + eps)
            for i in range(dim):
                y[base + i] = new_res[base + i] * r * (offset + w[i])

    return k, lambda a: _grid1(a[5])


@reference("add_rms_norm_backward", "add_rms_norm_backward_bf16", "add_rms_norm_backward_f16")
def _add_rms_norm_backward(cuda: Any):
    grad_row = rms_norm_grad_row(cuda)

    @cuda.jit
    def k(h, w, gy, gres, gh, rstd, pw, n_rows, dim, eps, has_gres, offset, n_part):
        t = cuda.grid(1)
        if t < n_part:  # fused weight gradient: partial row t sums rows t, t + n_part, ... in that order
            for col in range(dim):
                pw[t * dim + col] = 0.0
            for r in range(t, n_rows, n_part):
                ss = 0.0
                for i in range(dim):
                    ss += float(h[r * dim + i]) * float(h[r * dim + i])
                rr = 1.0 / math.sqrt(ss / dim + eps)
                for col in range(dim):
                    pw[t * dim + col] += float(h[r * dim + col]) * rr * float(gy[r * dim + col])
        row = t
        if row < n_rows:
            rstd[row] = grad_row(h, w, gy, gres, has_gres, gh, row * dim, dim, eps, offset)

    return k, lambda a: _grid1(max(a[7], a[12]))


def _ln_stats(x: Any, base: int, dim: int, eps: float) -> tuple[float, float]:
    """(mean, rstd) of the row x[base : base + dim]: two passes (mean, then the biased variance), as torch."""
    s = 0.0
    for i in range(dim):
        s += float(x[base + i])
    mean = s / dim
    v = 0.0
    for i in range(dim):
        d = float(x[base + i]) - mean
        v += d * d
    return mean, 1.0 / math.sqrt(v / dim + eps)


@reference("layer_norm", "layer_norm_bf16", "layer_norm_f16")
def _layer_norm(cuda: Any):
    stats = device_function(cuda, _ln_stats)

    @cuda.jit
    def k(x, w, b, y, n_rows, dim, eps, has_w, has_b):
        row = cuda.grid(1)
        if row < n_rows:
            base = row * dim
            mean, rstd = stats(x, base, dim, eps)
            for i in range(dim):
                o = (float(x[base + i]) - mean) * rstd
                if has_w:
                    o *= float(w[i])
                if has_b:
                    o += float(b[i])
                y[base + i] = o

    return k, lambda a: _grid1(a[4])


@reference("layer_norm_backward", "layer_norm_backward_bf16", "layer_norm_backward_f16")
def _layer_norm_backward(cuda: Any):
    stats = device_function(cuda, _ln_stats)

    @cuda.jit
    def k(x, w, g, gx, mean_out, rstd_out, pw, pb, n_rows, dim, eps, has_w, n_part, want_b):
        t = cuda.grid(1)
        if t < n_part:  # fused weight / bias gradient: partial row t sums rows t, t + n_part, ... in that order
            for col in range(dim):
                if has_w:
                    pw[t * dim + col] = 0.0
                if want_b:
                    pb[t * dim + col] = 0.0
            for r in range(t, n_rows, n_part):
                mean, rstd = stats(x, r * dim, dim, eps)
                for col in range(dim):
                    gv = float(g[r * dim + col])
                    if has_w:
                        pw[t * dim + col] += (float(x[r * dim + col]) - mean) * rstd * gv
                    if want_b:
                        pb[t * dim + col] += gv
        row = t
        if row < n_rows:
            base = row * dim
            mean, rstd = stats(x, base, dim, eps)
            mean_out[row] = mean
            rstd_out[row] = rstd
            sg = 0.0
            sgx = 0.0
            for i in range(dim):
                gh = float(g[base + i]) * (float(w[i]) if has_w else 1.0)
                sg += gh
                sgx += gh * (float(x[base + i]) - mean) * rstd
            mg = sg / dim
            mgx = sgx / dim
            mg += (mg - mg) + (mgx - mgx)  # an infinite statistic makes the whole row NaN (as the .cu)
            for i in range(dim):
                gh = float(g[base + i]) * (float(w[i]) if has_w else 1.0)
                xh = (float(x[base + i]) - mean) * rstd
                gx[base + i] = rstd * (gh - mg - xh * mgx)

    return k, lambda a: _grid1(max(a[8], a[12]))


@reference("norm_weight_grad", "norm_weight_grad_bf16", "norm_weight_grad_f16")
def _norm_weight_grad(cuda: Any):
    @cuda.jit
    def k(x, g, mean, rstd, pw, pb, n_rows, dim, rows_per_chunk, has_mean, want_bias):
        t = cuda.grid(1)
        n_chunks = (n_rows + rows_per_chunk - 1) // rows_per_chunk
        if t < n_chunks * dim:
            chunk = t // dim
            c = t - chunk * dim
            aw = 0.0
            ab = 0.0
            for r in range(chunk * rows_per_chunk, min(n_rows, (chunk + 1) * rows_per_chunk)):
                xv = x[r * dim + c] - (mean[r] if has_mean else 0.0)
                aw += xv * rstd[r] * g[r * dim + c]
                ab += g[r * dim + c]
            pw[t] = aw
            if want_bias:
                pb[t] = ab

    return k, lambda a: _grid1(((a[6] + a[8] - 1) // a[8]) * a[7])


@reference("gelu", "gelu_bf16", "gelu_f16")
def _gelu(cuda: Any):
    f, _ = gelu_fns(cuda)

    @cuda.jit
    def k(x, y, n, approx):
        i = cuda.grid(1)
        if i < n:
            y[i] = f(x[i], approx)

    return k, lambda a: _grid1(a[2])


@reference("gelu_backward", "gelu_backward_bf16", "gelu_backward_f16")
def _gelu_backward(cuda: Any):
    _, d = gelu_fns(cuda)

    @cuda.jit
    def k(x, g, gx, n, approx):
        i = cuda.grid(1)
        if i < n:
            gx[i] = g[i] * d(x[i], approx)

    return k, lambda a: _grid1(a[3])


@reference("gelu_gate", "gelu_gate_bf16", "gelu_gate_f16")
def _gelu_gate(cuda: Any):
    f, _ = gelu_fns(cuda)

    @cuda.jit
    def k(gate, up, out, n, approx):
        i = cuda.grid(1)
        if i < n:
            out[i] = f(gate[i], approx) * up[i]

    return k, lambda a: _grid1(a[3])


@reference("gelu_gate_backward", "gelu_gate_backward_bf16", "gelu_gate_backward_f16")
def _gelu_gate_backward(cuda: Any):
    f, d = gelu_fns(cuda)

    @cuda.jit
    def k(gate, up, g, gg, gu, n, approx):
        i = cuda.grid(1)
        if i < n:
            gg[i] = g[i] * up[i] * d(gate[i], approx)
            gu[i] = g[i] * f(gate[i], approx)

    return k, lambda a: _grid1(a[5])
