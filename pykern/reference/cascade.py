"""numba.cuda references for kernels_cu/cascade.cu: one thread per (token, head) row, plain loops in the
states' index order. Arrays arrive flat, bf16 / f16 widened to float32. The references take the kernels'
arguments (seq_len, num_heads) but lay their own one-dimensional grid over the rows."""
from __future__ import annotations

import math
from typing import Any

from .base import reference

_T = 64


def _grid(rows: int) -> tuple[tuple[int], tuple[int]]:
    return (max(1, (rows + _T - 1) // _T),), (_T,)


def _weight(s: float, m: float) -> float:
    return 0.0 if s == -math.inf else math.exp(s - m)


@reference("merge_state", "merge_state_bf16", "merge_state_f16")
def _merge_state(cuda: Any):
    weight = cuda.jit(device=True)(_weight)

    @cuda.jit
    def k(v_a, s_a, v_b, s_b, mask, v_out, s_out, seq_len, num_heads, head_dim, has_mask):
        r = cuda.grid(1)
        if r < seq_len * num_heads and (has_mask == 0 or mask[r // num_heads] != 0):
            sa = s_a[r]
            sb = s_b[r]
            m = max(sa, sb)
            wa = weight(sa, m)
            wb = weight(sb, m)
            tot = wa + wb
            inv = 0.0 if tot == 0.0 else 1.0 / tot
            for d in range(head_dim):
                i = r * head_dim + d
                ta = wa * v_a[i] if wa != 0.0 else 0.0  # an empty state contributes nothing
                tb = wb * v_b[i] if wb != 0.0 else 0.0
                v_out[i] = (ta + tb) * inv
            s_out[r] = -math.inf if tot == 0.0 else m + math.log(tot)

    return k, lambda a: _grid(a[7] * a[8])


@reference("merge_states", "merge_states_bf16", "merge_states_f16")
def _merge_states(cuda: Any):
    weight = cuda.jit(device=True)(_weight)

    @cuda.jit
    def k(v, s, v_out, s_out, seq_len, num_states, num_heads, head_dim):
        r = cuda.grid(1)
        if r < seq_len * num_heads:
            t = r // num_heads
            h = r - t * num_heads
            m = -math.inf
            for i in range(num_states):
                m = max(m, s[(t * num_states + i) * num_heads + h])
            tot = 0.0
            for i in range(num_states):
                tot += weight(s[(t * num_states + i) * num_heads + h], m)
            inv = 0.0 if tot == 0.0 else 1.0 / tot
            for d in range(head_dim):
                acc = 0.0
                for i in range(num_states):
                    wi = weight(s[(t * num_states + i) * num_heads + h], m)
                    if wi != 0.0:  # an empty state contributes nothing
                        acc += wi * v[((t * num_states + i) * num_heads + h) * head_dim + d]
                v_out[r * head_dim + d] = acc * inv
            s_out[r] = -math.inf if tot == 0.0 else m + math.log(tot)

    return k, lambda a: _grid(a[4] * a[6])
