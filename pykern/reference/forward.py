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
    def k(x, out, cos_t, sin_t, positions, n_rows, n_pos, n_heads, head_dim, pos_offset, max_pos, has_pos,
          full_table, style, inverse):
        row = cuda.grid(1)
        if row < n_rows:
            half = head_dim // 2
            tok = (row // n_heads) % n_pos
            pos = positions[tok] if has_pos != 0 else pos_offset + tok
            ok = 0 <= pos < max_pos
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
                if style == 0:
                    ia = row * head_dim + 2 * i
                    ib = ia + 1
                else:
                    ia = row * head_dim + i
                    ib = ia + half
                a = x[ia]
                b = x[ib]
                out[ia] = a * c - b * s
                out[ib] = a * s + b * c

    return k, lambda args: _grid(args[5])


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
