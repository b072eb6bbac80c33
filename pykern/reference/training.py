"""numba.cuda references for kernels_cu/training.cu and kernels_cu/attention_backward.cu.

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
            s = 0.0
            for j in range(n_chunks):
                s += partial[j * dim + c]
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


# --------------------------------------------------------------------------- attention backward
# Index helpers are inlined: q/dO/dq row (b, i, h) starts at ((b*n_q + i)*H + h)*D,
# k/v/dk/dv row (b, j, kvh) at ((b*n_k + j)*KVH + kvh)*D, lse/delta at (b*n_q + i)*H + h.
# Windows (normalized sides, causal is window_right = 0): query i sees keys
# [max(0, i + n_k - n_q - wl), min(n_k - 1, i + n_k - n_q + wr)]. softcap > 0: scores
# y = c * tanh(scale * q.k / c), and dS gets the factor dy/dx = 1 - (y / c)^2.


def _score_helpers(cuda: Any):
    @cuda.jit(device=True)
    def score(s, scale, softcap):
        x = s * scale
        if softcap > 0.0:
            x = softcap * math.tanh(x / softcap)
        return x

    @cuda.jit(device=True)
    def dcap(y, softcap):
        if softcap > 0.0:
            t = y / softcap
            return 1.0 - t * t
        return 1.0

    @cuda.jit(device=True)
    def keys(i, n_q, n_k, wl, wr):
        return max(0, i + n_k - n_q - wl), min(n_k - 1, i + n_k - n_q + wr)

    return score, dcap, keys


def _batch(a: Any, seq: int, heads: int, head_dim: int) -> int:
    return a[0].size // (seq * heads * head_dim)


@reference("attention_backward_naive", "attention_backward_naive_bf16", "attention_backward_naive_f16")
def _attention_naive(cuda: Any):
    # One thread per (query, head): three passes over the visible keys (max, sum, delta),
    # then dq directly and dk/dv with atomics (other query threads share rows).
    score, dcap, keys = _score_helpers(cuda)

    @cuda.jit
    def k(q, kk, v, dout, dq, dk_acc, dv_acc, n_q, n_k, n_heads, n_kv_heads, head_dim, scale, wl, wr, softcap):
        t = cuda.grid(1)
        batch = q.size // (n_q * n_heads * head_dim)
        if t < batch * n_q * n_heads:
            h = t % n_heads
            i = (t // n_heads) % n_q
            b = t // (n_heads * n_q)
            kvh = h // (n_heads // n_kv_heads)
            j0, j1 = keys(i, n_q, n_k, wl, wr)
            qo = t * head_dim
            for d in range(head_dim):
                dq[qo + d] = 0.0
            if j1 >= j0:
                m = -math.inf
                for j in range(j0, j1 + 1):
                    ko = ((b * n_k + j) * n_kv_heads + kvh) * head_dim
                    s = 0.0
                    for d in range(head_dim):
                        s += q[qo + d] * kk[ko + d]
                    m = max(m, score(s, scale, softcap))
                l = 0.0
                delta = 0.0
                for j in range(j0, j1 + 1):
                    ko = ((b * n_k + j) * n_kv_heads + kvh) * head_dim
                    s = 0.0
                    dp = 0.0
                    for d in range(head_dim):
                        s += q[qo + d] * kk[ko + d]
                        dp += dout[qo + d] * v[ko + d]
                    e = math.exp(score(s, scale, softcap) - m)
                    l += e
                    delta += e * dp
                delta = delta / l
                for j in range(j0, j1 + 1):
                    ko = ((b * n_k + j) * n_kv_heads + kvh) * head_dim
                    s = 0.0
                    dp = 0.0
                    for d in range(head_dim):
                        s += q[qo + d] * kk[ko + d]
                        dp += dout[qo + d] * v[ko + d]
                    y = score(s, scale, softcap)
                    p = math.exp(y - m) / l
                    ds = p * (dp - delta) * dcap(y, softcap)
                    for d in range(head_dim):
                        dq[qo + d] += ds * kk[ko + d] * scale
                        cuda.atomic.add(dk_acc, ko + d, ds * q[qo + d] * scale)
                        cuda.atomic.add(dv_acc, ko + d, p * dout[qo + d])

    def config(a):
        return _grid1(_batch(a, a[7], a[9], a[11]) * a[7] * a[9])

    return k, config


@reference("attention_bwd_preprocess", "attention_bwd_preprocess_bf16", "attention_bwd_preprocess_f16")
def _attention_preprocess(cuda: Any):
    @cuda.jit
    def k(dout, out, delta, n_rows, head_dim):
        r = cuda.grid(1)
        if r < n_rows:
            s = 0.0
            for d in range(head_dim):
                s += dout[r * head_dim + d] * out[r * head_dim + d]
            delta[r] = s

    return k, lambda a: _grid1(a[3])


@reference(*(f"attention_bwd_lse{c}{s}" for c in ("", "_softcap") for s in ("", "_bf16", "_f16")))
def _attention_lse(cuda: Any):
    # lse and delta = sum_j p_j (dO . v_j) (equal to rowsum(dO * O)) by two passes;
    # a row that sees no key gets lse -inf and delta 0.
    score, dcap, keys = _score_helpers(cuda)

    @cuda.jit
    def k(q, kk, v, dout, lse, delta, n_q, n_k, n_heads, n_kv_heads, head_dim, scale, wl, wr, softcap, group_lanes):
        t = cuda.grid(1)
        batch = q.size // (n_q * n_heads * head_dim)
        if t < batch * n_q * n_heads:
            h = t % n_heads
            i = (t // n_heads) % n_q
            b = t // (n_heads * n_q)
            kvh = h // (n_heads // n_kv_heads)
            j0, j1 = keys(i, n_q, n_k, wl, wr)
            qo = t * head_dim
            m = -math.inf
            for j in range(j0, j1 + 1):
                ko = ((b * n_k + j) * n_kv_heads + kvh) * head_dim
                s = 0.0
                for d in range(head_dim):
                    s += q[qo + d] * kk[ko + d]
                m = max(m, score(s, scale, softcap))
            l = 0.0
            acc = 0.0
            for j in range(j0, j1 + 1):
                ko = ((b * n_k + j) * n_kv_heads + kvh) * head_dim
                s = 0.0
                dp = 0.0
                for d in range(head_dim):
                    s += q[qo + d] * kk[ko + d]
                    dp += dout[qo + d] * v[ko + d]
                e = math.exp(score(s, scale, softcap) - m)
                l += e
                acc += e * dp
            if j1 >= j0:
                lse[t] = m + math.log(l)
                delta[t] = acc / l
            else:
                lse[t] = -math.inf
                delta[t] = 0.0

    return k, lambda a: _grid1(_batch(a, a[6], a[8], a[10]) * a[6] * a[8])


def _dq_body(cuda: Any):
    # dQ of one (batch, query, head) row t; shared by the flash and tensor-core references (same math).
    score, dcap, keys = _score_helpers(cuda)

    @cuda.jit(device=True)
    def body(t, q, kk, v, dout, lse, delta, dq, batch, n_q, n_k, n_heads, n_kv_heads, head_dim, scale, wl, wr,
             softcap):
        if t < batch * n_q * n_heads:
            h = t % n_heads
            i = (t // n_heads) % n_q
            b = t // (n_heads * n_q)
            kvh = h // (n_heads // n_kv_heads)
            j0, j1 = keys(i, n_q, n_k, wl, wr)
            qo = t * head_dim
            for d in range(head_dim):
                dq[qo + d] = 0.0
            for j in range(j0, j1 + 1):
                ko = ((b * n_k + j) * n_kv_heads + kvh) * head_dim
                s = 0.0
                dp = 0.0
                for d in range(head_dim):
                    s += q[qo + d] * kk[ko + d]
                    dp += dout[qo + d] * v[ko + d]
                y = score(s, scale, softcap)
                ds = math.exp(y - lse[t]) * (dp - delta[t]) * dcap(y, softcap)
                for d in range(head_dim):
                    dq[qo + d] += ds * kk[ko + d] * scale

    return body


def _dkdv_body(cuda: Any):
    # dK, dV of one (batch, key, kv head) t: sums over the group's query heads and the queries that see
    # key j. Shared by the flash and tensor-core references.
    score, dcap, keys = _score_helpers(cuda)

    @cuda.jit(device=True)
    def body(t, q, kk, v, dout, lse, delta, dk, dv, batch, n_q, n_k, n_heads, n_kv_heads, head_dim, scale, wl, wr,
             softcap):
        if t < batch * n_k * n_kv_heads:
            kvh = t % n_kv_heads
            j = (t // n_kv_heads) % n_k
            b = t // (n_kv_heads * n_k)
            rep = n_heads // n_kv_heads
            first = max(0, j - (n_k - n_q) - wr)  # the queries that see key j
            last = min(n_q - 1, j - (n_k - n_q) + wl)
            ko = t * head_dim
            for d in range(head_dim):
                dk[ko + d] = 0.0
                dv[ko + d] = 0.0
            for hh in range(rep):
                h = kvh * rep + hh
                for i in range(first, last + 1):
                    r = (b * n_q + i) * n_heads + h
                    qo = r * head_dim
                    s = 0.0
                    dp = 0.0
                    for d in range(head_dim):
                        s += q[qo + d] * kk[ko + d]
                        dp += dout[qo + d] * v[ko + d]
                    y = score(s, scale, softcap)
                    p = math.exp(y - lse[r])
                    ds = p * (dp - delta[r]) * dcap(y, softcap)
                    for d in range(head_dim):
                        dk[ko + d] += ds * q[qo + d] * scale
                        dv[ko + d] += p * dout[qo + d]

    return body


@reference(*(f"attention_backward_flash_dq{c}{s}" for c in ("", "_softcap") for s in ("", "_bf16", "_f16")))
def _attention_dq(cuda: Any):
    body = _dq_body(cuda)

    @cuda.jit
    def k(q, kk, v, dout, lse, delta, dq, n_q, n_k, n_heads, n_kv_heads, head_dim, scale, wl, wr, softcap,
          group_lanes):
        batch = q.size // (n_q * n_heads * head_dim)
        body(cuda.grid(1), q, kk, v, dout, lse, delta, dq, batch, n_q, n_k, n_heads, n_kv_heads, head_dim, scale,
             wl, wr, softcap)

    return k, lambda a: _grid1(_batch(a, a[7], a[9], a[11]) * a[7] * a[9])


@reference(*(f"attention_backward_flash_dkdv{c}{s}" for c in ("", "_softcap") for s in ("", "_bf16", "_f16")))
def _attention_dkdv(cuda: Any):
    body = _dkdv_body(cuda)

    @cuda.jit
    def k(q, kk, v, dout, lse, delta, dk, dv, n_q, n_k, n_heads, n_kv_heads, head_dim, scale, wl, wr, softcap,
          group_lanes):
        batch = kk.size // (n_k * n_kv_heads * head_dim)
        body(cuda.grid(1), q, kk, v, dout, lse, delta, dk, dv, batch, n_q, n_k, n_heads, n_kv_heads, head_dim,
             scale, wl, wr, softcap)

    def config(a):
        n_k, kvh, hd = a[9], a[11], a[12]
        return _grid1((a[1].size // (n_k * kvh * hd)) * n_k * kvh)

    return k, config


# Tensor-core backward (kernels_cu/attention_backward_tc.cu): the same math as the flash references
# above, with the batch passed explicitly. The d256 pair (_dv / _dk) each writes one output on the GPU;
# the reference writes both, which the op's second launch makes equal.
_TC_DKDV = tuple(f"attention_backward_tc_{n}{c}{s}" for n in ("dkdv_d64", "dkdv_d96", "dkdv_d128", "dv_d256", "dk_d256")
                 for c in ("", "_softcap") for s in ("_bf16", "_f16"))
_TC_DQ = tuple(f"attention_backward_tc_dq_d{d}{c}{s}" for d in (64, 96, 128, 256) for c in ("", "_softcap")
               for s in ("_bf16", "_f16"))


@reference(*_TC_DKDV)
def _attention_tc_dkdv(cuda: Any):
    body = _dkdv_body(cuda)

    @cuda.jit
    def k(q, kk, v, dout, lse, delta, dk, dv, batch, n_q, n_k, n_heads, n_kv_heads, head_dim, scale, wl, wr,
          softcap):
        body(cuda.grid(1), q, kk, v, dout, lse, delta, dk, dv, batch, n_q, n_k, n_heads, n_kv_heads, head_dim,
             scale, wl, wr, softcap)

    return k, lambda a: _grid1(a[8] * a[10] * a[12])


@reference(*_TC_DQ)
def _attention_tc_dq(cuda: Any):
    body = _dq_body(cuda)

    @cuda.jit
    def k(q, kk, v, dout, lse, delta, dq, batch, n_q, n_k, n_heads, n_kv_heads, head_dim, scale, wl, wr, softcap):
        body(cuda.grid(1), q, kk, v, dout, lse, delta, dq, batch, n_q, n_k, n_heads, n_kv_heads, head_dim, scale,
             wl, wr, softcap)

    return k, lambda a: _grid1(a[7] * a[8] * a[10])


# Fused tensor-core backward (kernels_cu/attention_backward_fused_tc.cu) and its prep / dQ-reduce kernels.
# Workspace layout as on the GPU: lse2 / dlt (batch, head, nq_pad), dQ rows (batch, head, nq_pad, head_dim).
# The kernels' T roundings of P and dS are not reproduced (the references stay fp32: closer to float64).
_LOG2E = 1.4426950408889634
_ABF_BC = 64  # keys per key tile (ABF_BC)
_ABF_BR = {64: 32, 128: 16}  # queries per query tile (AbfCfg<D>::BR)


@reference("attention_bwd_tc_prep_bf16", "attention_bwd_tc_prep_f16")
def _attention_tc_prep(cuda: Any):
    # One thread per (batch, query, head) row: lse * log2e and delta moved to the padded (batch, head, nq_pad)
    # layout (padded rows are the op's zeros), delta from rowsum(dO * O) or delta_in; zero_ws zeroes the row's
    # dQ workspace row.
    @cuda.jit
    def k(dout, out, lse, delta_in, lse2, dlt, dq_ws, n_rows, n_q, n_heads, nq_pad, head_dim, have_out, zero_ws):
        r = cuda.grid(1)
        if r < n_rows:
            acc = 0.0
            if have_out:
                for d in range(head_dim):
                    acc += dout[r * head_dim + d] * out[r * head_dim + d]
            else:
                acc = delta_in[r]
            bq = r // n_heads
            h = r % n_heads
            o = ((bq // n_q) * n_heads + h) * nq_pad + bq % n_q
            if zero_ws:
                for d in range(head_dim):
                    dq_ws[o * head_dim + d] = 0.0
            lse2[o] = lse[r] * _LOG2E
            dlt[o] = acc

    return k, lambda a: _grid1(a[7])


def _fused_tc_factory(D: int, SC: bool, DET: bool):
    BR = _ABF_BR[D]
    BC = _ABF_BC

    def factory(cuda: Any):
        # Threads [0, n_a): one per (key tile, kv head, batch, key of the tile): dK / dV of its key over every
        # query of the group's heads that sees it; atomic mode adds its dS K terms into dq_ws (unscaled).
        # Det mode, threads [n_a, n_a + n_b): one per (key tile, kv head, batch, group head, padded query row)
        # of the query tiles the key tile's walk visits: that row's partial over the tile's keys, stored at
        # slice [key tile - kt_begin] (ws_stride apart); rows no key of the tile reaches store 0.
        @cuda.jit(device=True)
        def ds_p(q, kk, v, dout, lse2, dlt, qo, ko, o, scale, softcap):
            s = 0.0
            dp = 0.0
            for d in range(D):
                s += q[qo + d] * kk[ko + d]
                dp += dout[qo + d] * v[ko + d]
            th = 0.0
            if SC:
                th = math.tanh(s * scale / softcap)
                y = softcap * th
            else:
                y = s * scale
            p = math.pow(2.0, y * _LOG2E - lse2[o])
            ds = p * (dp - dlt[o])
            if SC:
                ds *= 1.0 - th * th
            return p, ds

        @cuda.jit
        def k(q, kk, v, dout, lse2, dlt, dq_ws, dk, dv, n_q, n_k, n_heads, n_kv_heads, nq_pad, kt_begin, ws_stride,
              scale, wl, wr, softcap):
            t = cuda.grid(1)
            batch = lse2.size // (n_heads * nq_pad)
            rep = n_heads // n_kv_heads
            nx = (n_k + BC - 1) // BC - kt_begin
            if DET:
                nx = min(nx, dq_ws.size // ws_stride)
            n_a = nx * n_kv_heads * batch * BC
            if t < n_a:
                jj = t % BC
                x = t // BC
                kvh = x % n_kv_heads
                x = x // n_kv_heads
                b = x // nx
                x = x % nx
                j = (kt_begin + x) * BC + jj
                if j < n_k:
                    first = max(0, j - (n_k - n_q) - wr)
                    last = min(n_q - 1, j - (n_k - n_q) + wl)
                    ko = ((b * n_k + j) * n_kv_heads + kvh) * D
                    for d in range(D):
                        dk[ko + d] = 0.0
                        dv[ko + d] = 0.0
                    for hh in range(rep):
                        h = kvh * rep + hh
                        for i in range(first, last + 1):
                            qo = ((b * n_q + i) * n_heads + h) * D
                            o = (b * n_heads + h) * nq_pad + i
                            p, ds = ds_p(q, kk, v, dout, lse2, dlt, qo, ko, o, scale, softcap)
                            for d in range(D):
                                dk[ko + d] += ds * q[qo + d]
                                dv[ko + d] += p * dout[qo + d]
                                if not DET:
                                    cuda.atomic.add(dq_ws, o * D + d, ds * kk[ko + d])
                    for d in range(D):
                        dk[ko + d] *= scale
            elif DET and t < n_a + nx * n_kv_heads * batch * rep * nq_pad:
                u = t - n_a
                row = u % nq_pad
                u = u // nq_pad
                hh = u % rep
                u = u // rep
                kvh = u % n_kv_heads
                u = u // n_kv_heads
                b = u // nx
                x = u % nx
                h = kvh * rep + hh
                k0 = (kt_begin + x) * BC
                k1 = min(k0 + BC, n_k) - 1
                lo = min(max(k0 + n_q - n_k - wr, 0), n_q)  # pk_attn_k_span: the queries the tile's keys reach
                hi = min(max(k1 + n_q - n_k + wl, -1), n_q - 1)
                if lo <= hi and lo // BR <= row // BR and row // BR <= hi // BR:
                    o = (b * n_heads + h) * nq_pad + row
                    w = x * ws_stride + o * D
                    for d in range(D):
                        dq_ws[w + d] = 0.0
                    if row < n_q:
                        j0 = max(k0, row + n_k - n_q - wl)
                        j1 = min(k1, row + n_k - n_q + wr)
                        qo = ((b * n_q + row) * n_heads + h) * D
                        for j in range(j0, j1 + 1):
                            ko = ((b * n_k + j) * n_kv_heads + kvh) * D
                            p, ds = ds_p(q, kk, v, dout, lse2, dlt, qo, ko, o, scale, softcap)
                            for d in range(D):
                                dq_ws[w + d] += ds * kk[ko + d]

        def config(a):
            n_q, n_k, n_heads, kvh, nq_pad, kt_begin, ws_stride = a[9], a[10], a[11], a[12], a[13], a[14], a[15]
            batch = a[4].size // (n_heads * nq_pad)
            nx = (n_k + BC - 1) // BC - kt_begin
            if DET:
                nx = min(nx, a[6].size // ws_stride)
            n = nx * kvh * batch * BC
            if DET:
                n += nx * kvh * batch * (n_heads // kvh) * nq_pad
            return _grid1(n)

        return k, config

    return factory


for _d in (64, 128):
    for _sc in (False, True):
        for _det in (False, True):
            _n = f"attention_backward_tc_fused_d{_d}{'_softcap' if _sc else ''}{'_det' if _det else ''}"
            reference(_n + "_bf16", _n + "_f16")(_fused_tc_factory(_d, _sc, _det))


def _dq_reduce_factory(D: int):
    BR = _ABF_BR[D]
    BC = _ABF_BC

    def factory(cuda: Any):
        # One thread per dq element: the partials of the key tiles [kt_begin, kt_begin + kt_count) that its
        # query tile meets, added in key-tile order to acc (first: to 0); last: dq = scale * sum, else the sum
        # goes back to acc. The atomic mode passes kt_count 0, first 0: acc is the finished sum.
        @cuda.jit
        def k(part, acc, dq, n, n_q, n_k, n_heads, nq_pad, kt_begin, kt_count, ws_stride, scale, wl, wr, first, last):
            i = cuda.grid(1)
            if i < n:
                rest = i // D
                bq = rest // n_heads
                qi = bq % n_q
                q0 = qi // BR * BR
                w = (((bq // n_q) * n_heads + rest % n_heads) * nq_pad + qi) * D + i % D
                x = 0.0
                if not first:
                    x = acc[w]
                q1 = min(q0 + BR, n_q) - 1
                lo = min(max(q0 + n_k - n_q - wl, 0), n_k)  # pk_attn_q_span: the keys the query tile sees
                hi = min(max(q1 + n_k - n_q + wr, -1), n_k - 1)
                if lo <= hi:
                    for kt in range(max(lo // BC, kt_begin), min(hi // BC, kt_begin + kt_count - 1) + 1):
                        x += part[(kt - kt_begin) * ws_stride + w]
                if last:
                    dq[i] = x * scale
                else:
                    acc[w] = x

        return k, lambda a: _grid1(a[3])

    return factory


for _d in (64, 128):
    reference(f"attention_bwd_tc_dq_reduce_d{_d}_bf16", f"attention_bwd_tc_dq_reduce_d{_d}_f16")(_dq_reduce_factory(_d))
