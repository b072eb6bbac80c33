"""numba.cuda references of the forward / prefill kernels (kernels_cu/forward.cu; attention: reference/attention.py).

One thread per row or element, plain loops, no shuffles: obviously right beats
fast. bf16 twins share the fp32 body (the numba backend widens and narrows).
"""
from __future__ import annotations

import math

from .base import reference

_BLOCK = 64


def _grid(n: int) -> tuple[tuple[int], tuple[int]]:
    return (max(1, (int(n) + _BLOCK - 1) // _BLOCK),), (_BLOCK,)


@reference("embedding", "embedding_bf16", "embedding_f16")
def _embedding(cuda):
    @cuda.jit
    def k(ids, table, out, n_tokens, vocab, dim):
        t = cuda.grid(1)
        if t < n_tokens:
            tok = ids[t]
            for c in range(dim):
                out[t * dim + c] = table[tok * dim + c] if 0 <= tok < vocab else 0.0

    return k, lambda args: _grid(args[3])


@reference("rope", "rope_bf16", "rope_f16")
def _rope(cuda):
    @cuda.jit
    def k(q, q_out, kk, k_out, q_w, k_w, cos_t, sin_t, positions, n_tok, n_units, heads_per_unit, n_pos, hq, hk,
          head_dim, pos_offset, max_pos, has_pos, full_table, style, inverse, norm, eps, w_offset):
        row = cuda.grid(1)  # one thread per (token, head) row: q's heads, then k's
        if row < n_tok * (hq + hk):
            tt = row // (hq + hk)
            h = row - tt * (hq + hk)
            half = head_dim // 2
            slot = tt % n_pos
            pos = positions[slot] if has_pos != 0 else pos_offset + slot
            ok = 0 <= pos < max_pos
            isq = h < hq
            base = (tt * hq + h) * head_dim if isq else (tt * hk + h - hq) * head_dim
            rs = 1.0
            if norm != 0:
                ss = 0.0
                for j in range(head_dim):
                    v = q[base + j] if isq else kk[base + j]
                    ss += v * v
                rs = 1.0 / math.sqrt(ss / head_dim + eps)
            for i in range(half):
                # full tables (max_pos, head_dim): "half" reads column i, "interleaved" column 2i
                if full_table != 0:
                    t = pos * head_dim + (2 * i if style == 0 else i)
                else:
                    t = pos * half + i
                c = cos_t[t] if ok else 0.0
                s = sin_t[t] if ok else 0.0
                if inverse != 0:
                    s = -s
                ia = 2 * i if style == 0 else i
                ib = ia + 1 if style == 0 else i + half
                a = q[base + ia] if isq else kk[base + ia]
                b = q[base + ib] if isq else kk[base + ib]
                if norm != 0:
                    a = a * rs * (w_offset + (q_w[ia] if isq else k_w[ia]))
                    b = b * rs * (w_offset + (q_w[ib] if isq else k_w[ib]))
                if isq:
                    q_out[base + ia] = a * c - b * s
                    q_out[base + ib] = a * s + b * c
                else:
                    k_out[base + ia] = a * c - b * s
                    k_out[base + ib] = a * s + b * c

    return k, lambda args: _grid(args[9] * (args[13] + args[14]))


@reference("rope_norm_backward", "rope_norm_backward_bf16", "rope_norm_backward_f16")
def _rope_norm_backward(cuda):
    @cuda.jit
    def k(q, kk, gq_out, gk_out, gq, gk, q_w, k_w, cos_t, sin_t, positions, pw_q, pw_k, n_tok, n_units,
          heads_per_unit, n_pos, hq, hk, head_dim, pos_offset, max_pos, has_pos, full_table, style, eps, w_offset):
        # One thread per partial row: the kernel's block b (of `blocks`, the op's grid) owns the units of its 8
        # warps, b * 8 .. b * 8 + 7, then every blocks * 8 further; its row sums their weight gradients.
        blocks = min(4096, max(1, (n_units + 7) // 8))
        b = cuda.grid(1)
        if b < blocks:
            half = head_dim // 2
            H = hq + hk
            groups = (H + heads_per_unit - 1) // heads_per_unit
            for j in range(head_dim):
                pw_q[b * head_dim + j] = 0.0
                pw_k[b * head_dim + j] = 0.0
            u0 = b * 8
            while u0 < n_units:
                for u in range(u0, min(u0 + 8, n_units)):
                    tt = u // groups
                    h_lo = (u - tt * groups) * heads_per_unit
                    slot = tt % n_pos
                    pos = positions[slot] if has_pos != 0 else pos_offset + slot
                    ok = 0 <= pos < max_pos
                    for h in range(h_lo, min(h_lo + heads_per_unit, H)):
                        isq = h < hq
                        base = (tt * hq + h) * head_dim if isq else (tt * hk + h - hq) * head_dim
                        ss = 0.0
                        for j in range(head_dim):
                            v = q[base + j] if isq else kk[base + j]
                            ss += v * v
                        rs = 1.0 / math.sqrt(ss / head_dim + eps)
                        # gn = the inverse rotation of the output gradient, written to gq / gk first
                        dot = 0.0
                        for i in range(half):
                            t = (pos * head_dim + (2 * i if style == 0 else i)) if full_table != 0 else pos * half + i
                            c = cos_t[t] if ok else 0.0
                            s = sin_t[t] if ok else 0.0
                            ia = 2 * i if style == 0 else i
                            ib = ia + 1 if style == 0 else i + half
                            ya = gq_out[base + ia] if isq else gk_out[base + ia]
                            yb = gq_out[base + ib] if isq else gk_out[base + ib]
                            na = ya * c + yb * s
                            nb = -ya * s + yb * c
                            for side in range(2):
                                e = ia if side == 0 else ib
                                n = na if side == 0 else nb
                                x = q[base + e] if isq else kk[base + e]
                                wo = w_offset + (q_w[e] if isq else k_w[e])
                                dot += n * wo * x
                                if isq:
                                    gq[base + e] = n
                                    pw_q[b * head_dim + e] += n * x * rs
                                else:
                                    gk[base + e] = n
                                    pw_k[b * head_dim + e] += n * x * rs
                        for e in range(head_dim):
                            x = q[base + e] if isq else kk[base + e]
                            wo = w_offset + (q_w[e] if isq else k_w[e])
                            if isq:
                                gq[base + e] = rs * (wo * gq[base + e] - x * rs * rs * dot / head_dim)
                            else:
                                gk[base + e] = rs * (wo * gk[base + e] - x * rs * rs * dot / head_dim)
                u0 += blocks * 8

    return k, lambda args: _grid(min(4096, max(1, (int(args[14]) + 7) // 8)))


@reference("silu_gate", "silu_gate_bf16", "silu_gate_f16")
def _silu_gate(cuda):
    @cuda.jit
    def k(gate, up, out, n):
        i = cuda.grid(1)
        if i < n:
            g = gate[i]
            # below -80 the product is < 1e-33 (0 within any tolerance) and exp(-g) would overflow float32 in the simulator
            out[i] = g / (1.0 + math.exp(-g)) * up[i] if g > -80.0 else 0.0

    return k, lambda args: _grid(args[3])


@reference("silu_gate_backward", "silu_gate_backward_bf16", "silu_gate_backward_f16")
def _silu_gate_backward(cuda):
    @cuda.jit
    def k(gate, up, grad_out, grad_gate, grad_up, n):
        i = cuda.grid(1)
        if i < n:
            g = gate[i]
            # sigmoid(g) < 2e-35 below -80: both gradients are 0 within any tolerance
            s = 1.0 / (1.0 + math.exp(-g)) if g > -80.0 else 0.0
            grad_up[i] = grad_out[i] * g * s
            grad_gate[i] = grad_out[i] * up[i] * (s + g * s * (1.0 - s))

    return k, lambda args: _grid(args[5])


@reference("rms_norm", "rms_norm_bf16", "rms_norm_f16")
def _rms_norm(cuda):
    @cuda.jit
    def k(x, weight, out, n_rows, dim, eps, offset):
        row = cuda.grid(1)
        if row < n_rows:
            ss = 0.0
            for c in range(dim):
                v = x[row * dim + c]
                ss += v * v
            inv = 1.0 / math.sqrt(ss / dim + eps)
            for c in range(dim):
                out[row * dim + c] = x[row * dim + c] * inv * (offset + weight[c])

    return k, lambda args: _grid(args[3])


@reference("causal_attn_softmax")
def _causal_attn_softmax(cuda):
    @cuda.jit
    def k(scores, out, n_rows, n_heads, kv_len, past_len):
        row = cuda.grid(1)
        if row < n_rows:
            visible = min(kv_len, past_len + row // n_heads + 1)
            base = row * kv_len
            m = -math.inf
            for j in range(visible):
                m = max(m, scores[base + j])
            if m == -math.inf:
                m = 0.0
            s = 0.0
            for j in range(visible):
                s += math.exp(scores[base + j] - m)
            # s is 0 for a row of -inf only (it writes 0), NaN when a visible score is NaN or
            # +inf (exp(NaN - m), exp(inf - inf)): then every entry, masked ones too, is NaN
            for j in range(kv_len):
                if s == 0.0:
                    out[base + j] = 0.0
                elif j < visible:
                    out[base + j] = math.exp(scores[base + j] - m) / s
                else:
                    out[base + j] = 0.0 / s

    return k, lambda args: _grid(args[2])
