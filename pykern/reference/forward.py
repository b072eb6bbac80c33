"""numba.cuda references of the forward / prefill kernels (kernels_cu/forward.cu, flash_attention.cu).

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


_FA_NAMES = tuple(f"flash_attention_d{d}{c}{s}" for d in (64, 128, 256) for c in ("", "_softcap")
                  for s in ("", "_bf16", "_f16"))
# The tensor-core kernels (flash_attention_tc.cu) take the same arguments and compute the same
# function (their P rounding to bf16 / f16 is inside the tolerance): the same reference serves them.
_FA_TC_NAMES = tuple(f"flash_attention_tc_{p}d{d}{c}{s}" for p, ds in (("", (64, 96, 128, 256)), ("pad_", (64, 128)))
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

    return k, lambda args: _grid(args[5] * args[6] * args[8])
