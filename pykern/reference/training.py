"""numba.cuda references for kernels_cu/training.cu (the attention backward's: reference/attention.py).

One thread per row (or output element), plain loops, no shuffles, no shared
memory, no libdevice: obviously right rather than fast. Arrays arrive flat
(the numba backend flattens them) and bf16 arrays arrive widened to float32,
so one body serves each f32/bf16 twin. Parameters mirror the .cu kernels; the
block/grid shape of the CUDA launch is ignored (`config` picks its own).
"""
from __future__ import annotations

import math
from typing import Any

from .base import reference, rms_norm_grad_row, softmax_stats

_T = 64  # threads per block of every reference launch


def _grid1(n: int) -> tuple[tuple[int], tuple[int]]:
    return ((n + _T - 1) // _T,), (_T,)


@reference("transpose_2d", "transpose_2d_bf16", "transpose_2d_f16")
def _transpose(cuda: Any):
    @cuda.jit
    def k(inp, out, rows, cols, batch):
        t = cuda.grid(1)
        if t < batch * rows * cols:
            z = t // (rows * cols)
            rc = t - z * rows * cols
            r = rc // cols
            c = rc - r * cols
            out[z * rows * cols + c * rows + r] = inp[t]

    return k, lambda a: _grid1(a[2] * a[3] * a[4])


@reference("softmax_backward", "softmax_backward_bf16", "softmax_backward_f16")
def _softmax_backward(cuda: Any):
    @cuda.jit
    def k(probs, grad_out, grad_in, n_rows, row_len):
        row = cuda.grid(1)
        if row < n_rows:
            base = row * row_len
            dot = 0.0
            for i in range(row_len):
                dot += probs[base + i] * grad_out[base + i]
            for i in range(row_len):
                grad_in[base + i] = probs[base + i] * (grad_out[base + i] - dot)

    return k, lambda a: _grid1(a[3])


@reference("rms_norm_backward", "rms_norm_backward_bf16", "rms_norm_backward_f16")
def _rms_norm_backward(cuda: Any):
    grad_row = rms_norm_grad_row(cuda)

    @cuda.jit
    def k(x, w, g, gx, inv_rms, partial, n_rows, dim, eps, n_part, offset):
        t = cuda.grid(1)
        if t < n_rows:
            row = t
            base = row * dim
            inv_rms[row] = grad_row(x, w, g, g, 0, gx, base, dim, eps, offset)
        if t < n_part:  # fused weight gradient: partial row t sums rows t, t + n_part, ... in that order
            for col in range(dim):
                partial[t * dim + col] = 0.0
            for row in range(t, n_rows, n_part):
                ss = 0.0
                for i in range(dim):
                    ss += x[row * dim + i] * x[row * dim + i]
                r = 1.0 / math.sqrt(ss / dim + eps)
                for col in range(dim):
                    partial[t * dim + col] += x[row * dim + col] * r * g[row * dim + col]

    return k, lambda a: _grid1(max(a[6], a[9]))


@reference("rms_norm_backward_weight", "rms_norm_backward_weight_bf16", "rms_norm_backward_weight_f16")
def _rms_norm_backward_weight(cuda: Any):
    @cuda.jit
    def k(x, g, inv_rms, partial, n_rows, dim, rows_per_chunk):
        t = cuda.grid(1)
        n_chunks = (n_rows + rows_per_chunk - 1) // rows_per_chunk
        if t < n_chunks * dim:
            chunk = t // dim
            col = t - chunk * dim
            acc = 0.0
            for r in range(chunk * rows_per_chunk, min(n_rows, (chunk + 1) * rows_per_chunk)):
                acc += x[r * dim + col] * inv_rms[r] * g[r * dim + col]
            partial[t] = acc

    def config(a):
        n_chunks = (a[4] + a[6] - 1) // a[6]
        return _grid1(n_chunks * a[5])

    return k, config


@reference("norm_grad_reduce")
def _norm_grad_reduce(cuda: Any):
    @cuda.jit
    def k(partial, out, n_chunks, dim):
        c = cuda.grid(1)
        if c < dim:
            # a float64 sum rounded once: float() keeps it float64 in the simulator too, where NumPy 2 would
            # keep a 0.0 + float32 running sum in float32 (weaker than the kernel's 32 fp32 lane sums)
            s = 0.0
            for j in range(n_chunks):
                s += float(partial[j * dim + c])
            out[c] = s

    return k, lambda a: _grid1(a[3])


@reference("embedding_backward", "embedding_backward_bf16", "embedding_backward_f16")
def _embedding_backward(cuda: Any):
    @cuda.jit
    def k(grad_out, order, offsets, grad_weight, vocab_size, dim):
        vrow = cuda.grid(1)
        if vrow < vocab_size:
            for d in range(dim):
                acc = 0.0
                for kk in range(offsets[vrow], offsets[vrow + 1]):
                    acc += grad_out[order[kk] * dim + d]
                grad_weight[vrow * dim + d] = acc

    return k, lambda a: _grid1(a[4])


@reference("embedding_backward_bucket")
def _embedding_backward_bucket(cuda: Any):
    # One thread: a stable counting sort of positions by id (ids outside [0, vocab) skipped).
    @cuda.jit
    def k(ids, order, offsets, n_tok, vocab_size):
        if cuda.grid(1) == 0:
            for v in range(vocab_size + 1):
                offsets[v] = 0
            for i in range(n_tok):
                if 0 <= ids[i] < vocab_size:
                    offsets[ids[i] + 1] += 1
            for v in range(vocab_size):
                offsets[v + 1] += offsets[v]
            for v in range(vocab_size):
                slot = offsets[v]
                for i in range(n_tok):
                    if ids[i] == v:
                        order[slot] = i
                        slot += 1

    return k, lambda a: ((1,), (1,))


@reference("cross_entropy_count")
def _cross_entropy_count(cuda: Any):
    @cuda.jit
    def k(targets, class_weight, scale, n_rows, vocab, pad_id, mean, has_weight):
        if cuda.grid(1) == 0:
            c = 0
            w = 0.0
            for i in range(n_rows):
                t = targets[i]
                if t != pad_id:
                    c += 1
                    if has_weight and t >= 0 and t < vocab:
                        w += class_weight[t]
            inv_n = 1.0 / c if c > 0 else 0.0
            inv_w = inv_n
            if has_weight:
                inv_w = 1.0 / w if w != 0.0 else 0.0
            if mean:
                scale[0] = inv_w
                scale[1] = inv_n
            else:
                scale[0] = 1.0
                scale[1] = 1.0

    return k, lambda a: ((1,), (1,))


@reference("cross_entropy_fwd_bwd", "cross_entropy_fwd_bwd_bf16", "cross_entropy_fwd_bwd_f16")
def _cross_entropy(cuda: Any):
    stats = softmax_stats(cuda)

    @cuda.jit
    def k(logits, targets, grad, row_loss, z_row, scale_p, cw, grad_rows, n_rows, vocab, pad_id, eps, z_loss, cap,
          opts):
        row = cuda.grid(1)
        if row < n_rows:
            has_w = (opts & 1) != 0
            s_ce = scale_p[0]
            s_z = scale_p[1]
            base = row * vocab
            t = targets[row]
            if t != pad_id and (t < 0 or t >= vocab):
                for i in range(vocab):
                    grad[base + i] = math.nan
                row_loss[row] = math.nan
                if opts & 4:
                    z_row[row] = math.nan
            elif t == pad_id:
                for i in range(vocab):
                    grad[base + i] = 0.0
                row_loss[row] = 0.0
                if opts & 4:
                    z_row[row] = 0.0
            else:
                # z = cap * tanh(x / cap) when cap > 0; read every logit before writing
                # any gradient (grad may be the logits buffer itself)
                m, s = stats(logits, base, vocab, cap)
                zsum = 0.0
                wsum = 0.0
                for i in range(vocab):
                    z = logits[base + i]
                    if cap > 0:
                        z = cap * math.tanh(z / cap)
                    c = cw[i] if has_w else 1.0
                    zsum += c * z
                    wsum += c
                zt = logits[base + t]
                if cap > 0:
                    zt = cap * math.tanh(zt / cap)
                lse = m + math.log(s)  # a NaN or +inf logit has made s NaN through exp
                wt = cw[t] if has_w else 1.0
                ce = wt * (1.0 - eps) * (lse - zt)
                if eps != 0.0:  # 0 * (a sum holding -inf) would be NaN where torch's loss is finite
                    ce += eps / vocab * (wsum * lse - zsum)
                zl = z_loss * lse * lse
                row_loss[row] = ce * s_ce + zl * s_z
                if opts & 4:
                    z_row[row] = zl * s_z
                gr = grad_rows[row] if opts & 2 else 1.0
                for i in range(vocab):
                    x = logits[base + i]
                    z = x
                    d = 1.0
                    if cap > 0:
                        th = math.tanh(x / cap)
                        z = cap * th
                        d = 1.0 - th * th
                    c = cw[i] if has_w else 1.0
                    onehot = wt * (1.0 - eps) if i == t else 0.0
                    p = math.exp(z - m) / s
                    gz = s_ce * (p * (wt * (1.0 - eps) + eps / vocab * wsum) - onehot - eps / vocab * c)
                    gz += s_z * 2.0 * z_loss * lse * p
                    grad[base + i] = gz * gr * d

    return k, lambda a: _grid1(a[8])


@reference("cross_entropy_loss_reduce")
def _cross_entropy_loss_reduce(cuda: Any):
    @cuda.jit
    def k(inp, out, scale, n, per_block, apply_scale):
        b = cuda.grid(1)
        lo = b * per_block
        if lo < n:
            hi = min(lo + per_block, n)
            s = 0.0
            for i in range(lo, hi):
                s += inp[i]
            out[b] = s * scale[0] if apply_scale else s

    return k, lambda a: _grid1(-(-a[3] // a[4]))


@reference("training_zero_f32")
def _zero(cuda: Any):
    @cuda.jit
    def k(buf, n):
        i = cuda.grid(1)
        if i < n:
            buf[i] = 0.0

    return k, lambda a: _grid1(a[1])


@reference("training_f32_to_bf16", "training_f32_to_f16")
def _to_bf16(cuda: Any):
    # The numba backend narrows the (widened) bf16 output after the launch.
    @cuda.jit
    def k(src, dst, n):
        i = cuda.grid(1)
        if i < n:
            dst[i] = src[i]

    return k, lambda a: _grid1(a[2])
