"""numba.cuda reference for kernels_cu/mla.cu: one thread per (request, split, head) row, two plain passes over
the split's keys (the max, then the weights and the weighted ckv sum) in fp32. Arrays arrive flat, bf16 / f16
widened to float32; the split's keys and the partial layout are the kernel's (see mla.cu)."""
from __future__ import annotations

import math
from typing import Any

from .base import reference

_T = 32
_DC = 512
_DP = 64
_BC = 32


@reference("mla_decode_bf16", "mla_decode_f16")
def _mla_decode(cuda: Any):
    from numba import float32

    @cuda.jit(device=True)
    def score(q_nope, q_pe, ckv, kpe, qrow, co, po):  # q . k of one key (both passes): the ckv part, then the rope part
        s = 0.0
        for d in range(_DC):
            s += q_nope[qrow * _DC + d] * ckv[co + d]
        for d in range(_DP):
            s += q_pe[qrow * _DP + d] * kpe[po + d]
        return s

    @cuda.jit
    def k(q_nope, q_pe, ckv, kpe, out, lse, part_o, part_lse, kv_indptr, kv_indices, kv_len, num_heads, page_size,
          ckv_sp, ckv_st, kpe_sp, kpe_st, num_splits, write_lse, sm_scale):
        batch = kv_len.shape[0]
        r = cuda.grid(1)
        if r >= batch * num_splits * num_heads:
            return
        h = r % num_heads
        bs = r // num_heads
        split = bs % num_splits
        b = bs // num_splits
        length = kv_len[b]
        begin = 0
        end = length
        if num_splits > 1:
            per = (length + num_splits - 1) // num_splits
            per = (per + _BC - 1) // _BC * _BC
            begin = min(per * split, length)
            end = min(begin + per, length)
        qrow = (b * num_heads + h)
        m = -math.inf
        for t in range(begin, end):
            page = kv_indices[kv_indptr[b] + t // page_size]
            co = page * ckv_sp + (t % page_size) * ckv_st
            po = page * kpe_sp + (t % page_size) * kpe_st
            s = score(q_nope, q_pe, ckv, kpe, qrow, co, po)
            m = max(m, s * sm_scale)
        acc = cuda.local.array(_DC, float32)
        for d in range(_DC):
            acc[d] = 0.0
        tot = 0.0
        for t in range(begin, end):
            page = kv_indices[kv_indptr[b] + t // page_size]
            co = page * ckv_sp + (t % page_size) * ckv_st
            po = page * kpe_sp + (t % page_size) * kpe_st
            s = score(q_nope, q_pe, ckv, kpe, qrow, co, po)
            w = math.exp(s * sm_scale - m)
            tot += w
            for d in range(_DC):
                acc[d] += w * ckv[co + d]
        inv = 1.0 / tot if tot > 0.0 else 0.0
        ls = m + math.log(tot) if tot > 0.0 else -math.inf
        if num_splits > 1:
            row = (b * num_splits + split) * num_heads + h
            for d in range(_DC):
                part_o[row * _DC + d] = acc[d] * inv
            part_lse[row] = ls
        else:
            for d in range(_DC):
                out[qrow * _DC + d] = acc[d] * inv
            if write_lse != 0:
                lse[qrow] = ls

    def config(a):
        rows = a[10].shape[0] * a[17] * a[11]
        return (max(1, (rows + _T - 1) // _T),), (_T,)

    return k, config
