"""numba.cuda references of the attention family: the forward (kernels_cu/attention_fwd_fma.cu and the tensor-core
attention_fwd_tc.cu, which compute the same function) and the backward (attention_bwd_*.cu).

One thread per row (or output element), plain loops, no shuffles, no shared memory, no libdevice: obviously
right rather than fast. Arrays arrive flat (the numba backend flattens them) and bf16 / f16 arrays arrive
widened to float32, so one body serves each dtype twin. Parameters mirror the .cu kernels; the block/grid shape
of the CUDA launch is ignored (`config` picks its own). The varlen and paged-prefill FlashAttention-2 kernels
share the paged kernels' helpers and keep their references in reference/serving.py.
"""
from __future__ import annotations

import math
from typing import Any

from .base import capped_score, reference

_T = 64  # threads per block of every reference launch


def _grid1(n: int) -> tuple[tuple[int], tuple[int]]:
    return ((n + _T - 1) // _T,), (_T,)


# --------------------------------------------------------------------------- forward
_FA_NAMES = tuple(f"attention_fwd_fma_d{d}{c}{s}" for d in (64, 128, 256) for c in ("", "_softcap")
                  for s in ("", "_bf16", "_f16"))
# The tensor-core kernels (attention_fwd_tc.cu) take the same arguments and compute the same
# function (their P rounding to bf16 / f16 is inside the tolerance): the same reference serves them.
_FA_TC_NAMES = tuple(f"attention_fwd_tc_{p}d{d}{c}{s}" for p, ds in (("", (64, 96, 128, 256)), ("pad_", (64, 128)))
                     for d in ds for c in ("", "_softcap") for s in ("_bf16", "_f16"))


@reference(*_FA_NAMES, *_FA_TC_NAMES)
def _flash_attention(cuda):
    from numba import float32

    @cuda.jit
    def k(q, kk, v, out, lse, batch, n_q, n_k, n_heads, n_kv_heads, head_dim, head_dim_v, scale, window_left,
          window_right, softcap):
        # one thread per (batch, query, head) row: max pass, then exp-weighted sum pass over the keys
        # [first, last] of the row's window (normalized sides: causal is window_right = 0);
        # softcap > 0: scores softcap * tanh(scale * q.k / softcap)
        r = cuda.grid(1)
        if r < batch * n_q * n_heads:
            h = r % n_heads
            i = (r // n_heads) % n_q
            b = r // (n_heads * n_q)
            hk = h // (n_heads // n_kv_heads)
            first = max(0, i + n_k - n_q - window_left)
            last = min(n_k - 1, i + n_k - n_q + window_right)
            q_off = r * head_dim
            m = -math.inf
            for j in range(first, last + 1):
                k_off = ((b * n_k + j) * n_kv_heads + hk) * head_dim
                dot = 0.0
                for d in range(head_dim):
                    dot += q[q_off + d] * kk[k_off + d]
                x = dot * scale
                if softcap > 0.0:
                    x = softcap * math.tanh(x / softcap)
                m = max(m, x)
            acc = cuda.local.array(256, float32)
            for d in range(head_dim_v):
                acc[d] = 0.0
            l = 0.0
            for j in range(first, last + 1):
                k_off = ((b * n_k + j) * n_kv_heads + hk) * head_dim
                v_off = ((b * n_k + j) * n_kv_heads + hk) * head_dim_v
                dot = 0.0
                for d in range(head_dim):
                    dot += q[q_off + d] * kk[k_off + d]
                x = dot * scale
                if softcap > 0.0:
                    x = softcap * math.tanh(x / softcap)
                p = math.exp(x - m)
                l += p
                for d in range(head_dim_v):
                    acc[d] += p * v[v_off + d]
            o_off = r * head_dim_v
            for d in range(head_dim_v):
                out[o_off + d] = acc[d] / l if l > 0.0 else 0.0
            lse[r] = m + math.log(l) if l > 0.0 else -math.inf

    return k, lambda args: _grid1(args[5] * args[6] * args[8])


# --------------------------------------------------------------------------- attention backward
# Index helpers are inlined: q/dO/dq row (b, i, h) starts at ((b*n_q + i)*H + h)*D,
# k/v/dk/dv row (b, j, kvh) at ((b*n_k + j)*KVH + kvh)*D, lse/delta at (b*n_q + i)*H + h.
# Windows (normalized sides, causal is window_right = 0): query i sees keys
# [max(0, i + n_k - n_q - wl), min(n_k - 1, i + n_k - n_q + wr)]. softcap > 0: scores
# y = c * tanh(scale * q.k / c), and dS gets the factor dy/dx = 1 - (y / c)^2.


def _score_helpers(cuda: Any):
    score = capped_score(cuda)

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


@reference("attention_bwd_fma_naive", "attention_bwd_fma_naive_bf16", "attention_bwd_fma_naive_f16")
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


@reference(*(f"attention_bwd_fma_dq{c}{s}" for c in ("", "_softcap") for s in ("", "_bf16", "_f16")))
def _attention_dq(cuda: Any):
    body = _dq_body(cuda)

    @cuda.jit
    def k(q, kk, v, dout, lse, delta, dq, n_q, n_k, n_heads, n_kv_heads, head_dim, scale, wl, wr, softcap,
          group_lanes):
        batch = q.size // (n_q * n_heads * head_dim)
        body(cuda.grid(1), q, kk, v, dout, lse, delta, dq, batch, n_q, n_k, n_heads, n_kv_heads, head_dim, scale,
             wl, wr, softcap)

    return k, lambda a: _grid1(_batch(a, a[7], a[9], a[11]) * a[7] * a[9])


@reference(*(f"attention_bwd_fma_dkdv{c}{s}" for c in ("", "_softcap") for s in ("", "_bf16", "_f16")))
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


# Tensor-core backward (kernels_cu/attention_bwd_tc.cu): the same math as the flash references
# above, with the batch passed explicitly. The d256 pair (_dv / _dk) each writes one output on the GPU;
# the reference writes both, which the op's second launch makes equal.
_TC_DKDV = tuple(f"attention_bwd_tc_{n}{c}{s}" for n in ("dkdv_d64", "dkdv_d96", "dkdv_d128", "dv_d256", "dk_d256")
                 for c in ("", "_softcap") for s in ("_bf16", "_f16"))
_TC_DQ = tuple(f"attention_bwd_tc_dq_d{d}{c}{s}" for d in (64, 96, 128, 256) for c in ("", "_softcap")
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


# Varlen tensor-core backward (attention_bwd_varlen_tc_* in kernels_cu/attention_bwd_tc.cu): the same math per
# packed sequence. A thread finds its row's sequence by a scan of cu_seqlens (rows past cu_seqlens[batch] belong
# to none and are left alone), takes that sequence's lengths and clamps the window sides to them (the op passes
# unbounded sides as 2^30), then runs the dense formulas with the sequence's row offsets.
_TC_VL_DKDV = tuple(f"attention_bwd_varlen_tc_{n}{c}{s}" for n in ("dkdv_d64", "dkdv_d96", "dkdv_d128", "dv_d256",
                                                                   "dk_d256")
                    for c in ("", "_softcap") for s in ("_bf16", "_f16"))
_TC_VL_DQ = tuple(f"attention_bwd_varlen_tc_dq_d{d}{c}{s}" for d in (64, 96, 128, 256) for c in ("", "_softcap")
                  for s in ("_bf16", "_f16"))


def _seq_helper(cuda: Any):
    @cuda.jit(device=True)
    def seq_of(cu, batch, row):
        # the sequence b with cu[b] <= row < cu[b + 1] (empty sequences skipped), or -1 past cu[batch]
        if row >= cu[batch]:
            return -1
        b = 0
        while b + 1 < batch and cu[b + 1] <= row:
            b += 1
        return b

    return seq_of


def _varlen_dkdv_body(cuda: Any):
    # dK, dV of one (packed key row, kv head) t; shared by the tensor-core and fp32 varlen references.
    score, dcap, keys = _score_helpers(cuda)
    seq_of = _seq_helper(cuda)

    @cuda.jit(device=True)
    def body(t, q, kk, v, dout, lse, delta, dk, dv, cu_q, cu_k, batch, n_heads, n_kv_heads, head_dim, scale, wl, wr,
             softcap):
        total_k = kk.size // (n_kv_heads * head_dim)
        if t < total_k * n_kv_heads:
            kvh = t % n_kv_heads
            row = t // n_kv_heads
            b = seq_of(cu_k, batch, row)
            if b >= 0:
                q0, k0 = cu_q[b], cu_k[b]
                n_q, n_k = cu_q[b + 1] - q0, cu_k[b + 1] - k0
                wl_, wr_ = min(wl, n_k), min(wr, n_q)
                j = row - k0
                rep = n_heads // n_kv_heads
                first = max(0, j - (n_k - n_q) - wr_)  # the queries that see key j
                last = min(n_q - 1, j - (n_k - n_q) + wl_)
                ko = t * head_dim
                for d in range(head_dim):
                    dk[ko + d] = 0.0
                    dv[ko + d] = 0.0
                for hh in range(rep):
                    h = kvh * rep + hh
                    for i in range(first, last + 1):
                        r = (q0 + i) * n_heads + h
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


def _varlen_dq_body(cuda: Any):
    # dQ of one (packed query row, head) t; shared by the tensor-core and fp32 varlen references.
    score, dcap, keys = _score_helpers(cuda)
    seq_of = _seq_helper(cuda)

    @cuda.jit(device=True)
    def body(t, q, kk, v, dout, lse, delta, dq, cu_q, cu_k, batch, n_heads, n_kv_heads, head_dim, scale, wl, wr,
             softcap):
        total_q = q.size // (n_heads * head_dim)
        if t < total_q * n_heads:
            h = t % n_heads
            row = t // n_heads
            b = seq_of(cu_q, batch, row)
            if b >= 0:
                q0, k0 = cu_q[b], cu_k[b]
                n_q, n_k = cu_q[b + 1] - q0, cu_k[b + 1] - k0
                kvh = h // (n_heads // n_kv_heads)
                j0, j1 = keys(row - q0, n_q, n_k, min(wl, n_k), min(wr, n_q))
                qo = t * head_dim
                for d in range(head_dim):
                    dq[qo + d] = 0.0
                for j in range(j0, j1 + 1):
                    ko = ((k0 + j) * n_kv_heads + kvh) * head_dim
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


@reference(*_TC_VL_DKDV)
def _attention_tc_varlen_dkdv(cuda: Any):
    body = _varlen_dkdv_body(cuda)

    @cuda.jit
    def k(q, kk, v, dout, lse, delta, dk, dv, cu_q, cu_k, batch, max_q, max_k, n_heads, n_kv_heads, head_dim,
          scale, wl, wr, softcap):
        body(cuda.grid(1), q, kk, v, dout, lse, delta, dk, dv, cu_q, cu_k, batch, n_heads, n_kv_heads, head_dim,
             scale, wl, wr, softcap)

    return k, lambda a: _grid1(a[1].size // a[15])


@reference(*_TC_VL_DQ)
def _attention_tc_varlen_dq(cuda: Any):
    body = _varlen_dq_body(cuda)

    @cuda.jit
    def k(q, kk, v, dout, lse, delta, dq, cu_q, cu_k, batch, max_q, max_k, n_heads, n_kv_heads, head_dim, scale,
          wl, wr, softcap):
        body(cuda.grid(1), q, kk, v, dout, lse, delta, dq, cu_q, cu_k, batch, n_heads, n_kv_heads, head_dim, scale,
             wl, wr, softcap)

    return k, lambda a: _grid1(a[0].size // a[14])


# Varlen fp32 backward (attention_bwd_varlen_fma_* in kernels_cu/attention_bwd_fma.cu): the tensor-core varlen
# kernels' parameters and group_lanes (the CTA shape only), the same math.
@reference("attention_bwd_varlen_fma_dkdv", "attention_bwd_varlen_fma_dkdv_softcap")
def _attention_fma_varlen_dkdv(cuda: Any):
    body = _varlen_dkdv_body(cuda)

    @cuda.jit
    def k(q, kk, v, dout, lse, delta, dk, dv, cu_q, cu_k, batch, max_q, max_k, n_heads, n_kv_heads, head_dim,
          scale, wl, wr, softcap, group_lanes):
        body(cuda.grid(1), q, kk, v, dout, lse, delta, dk, dv, cu_q, cu_k, batch, n_heads, n_kv_heads, head_dim,
             scale, wl, wr, softcap)

    return k, lambda a: _grid1(a[1].size // a[15])


@reference("attention_bwd_varlen_fma_dq", "attention_bwd_varlen_fma_dq_softcap")
def _attention_fma_varlen_dq(cuda: Any):
    body = _varlen_dq_body(cuda)

    @cuda.jit
    def k(q, kk, v, dout, lse, delta, dq, cu_q, cu_k, batch, max_q, max_k, n_heads, n_kv_heads, head_dim, scale,
          wl, wr, softcap, group_lanes):
        body(cuda.grid(1), q, kk, v, dout, lse, delta, dq, cu_q, cu_k, batch, n_heads, n_kv_heads, head_dim, scale,
             wl, wr, softcap)

    return k, lambda a: _grid1(a[0].size // a[14])


# Fused tensor-core backward (kernels_cu/attention_bwd_tc_fused.cu) and its prep / dQ-reduce kernels.
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
            _n = f"attention_bwd_tc_fused_d{_d}{'_softcap' if _sc else ''}{'_det' if _det else ''}"
            reference(_n + "_bf16", _n + "_f16")(_fused_tc_factory(_d, _sc, _det))


def _dq_reduce_factory(D: int):
    # d96 narrows only the sm_90a fused kernel's accumulator, in the atomic mode (no runs read): AbfReduceBr<96>
    BR = _ABF_BR.get(D, 1)
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


for _d in (64, 96, 128):
    reference(f"attention_bwd_tc_dq_reduce_d{_d}_bf16", f"attention_bwd_tc_dq_reduce_d{_d}_f16")(_dq_reduce_factory(_d))
