"""numba.cuda references for kernels_cu/decode.cu: one thread per (sequence, query head).

Arrays arrive flat (the ops pass 1-D views); bf16 arrays arrive widened to float32
(the numba backend narrows outputs back), so one fp32 body serves every twin.
Two passes over the cache (max, then exp-sum and weighted V): obviously right,
and positions >= seq_len are never touched. Split-K partials use natural-exp
(m, l, acc), consistent between the chunk and reduce references.
"""
from __future__ import annotations

from typing import Any

from .base import reference

_MAX_HEAD_DIM = 256
_NEG_INF = float("-inf")


def _attend_factory(cuda: Any) -> Any:
    import math

    @cuda.jit(device=True)
    def attend(q, k, v, qo, kvo, head_dim, begin, end, scale, acc):
        # Returns (m, l) over positions [begin, end); acc[d] = sum exp(s - m) * v[d].
        for d in range(head_dim):
            acc[d] = 0.0
        m = _NEG_INF
        for pos in range(begin, end):
            s = 0.0
            for d in range(head_dim):
                s += q[qo + d] * k[kvo + pos * head_dim + d]
            s *= scale
            if s > m:
                m = s
        l = 0.0
        for pos in range(begin, end):
            s = 0.0
            for d in range(head_dim):
                s += q[qo + d] * k[kvo + pos * head_dim + d]
            p = math.exp(s * scale - m)
            l += p
            for d in range(head_dim):
                acc[d] += p * v[kvo + pos * head_dim + d]
        return m, l

    return attend


@reference("decode_attn_warp", "decode_attn_warp_bf16", "decode_attn_warp_bf16kv",
           "decode_attn_multi_warp", "decode_attn_multi_warp_bf16", "decode_attn_multi_warp_bf16kv")
def _decode_attn(cuda: Any) -> Any:
    import numba

    attend = _attend_factory(cuda)

    @cuda.jit
    def k(q, k_cache, v_cache, out, seq_lens, num_heads, num_kv_heads, head_dim, max_seq_len, scale):
        i = cuda.grid(1)
        batch = seq_lens.shape[0]
        if i >= batch * num_heads:
            return
        b = i // num_heads
        h = i % num_heads
        sl = seq_lens[b]
        if sl > max_seq_len:
            sl = max_seq_len
        kvh = h // (num_heads // num_kv_heads)
        qo = (b * num_heads + h) * head_dim
        kvo = (b * num_kv_heads + kvh) * max_seq_len * head_dim
        acc = cuda.local.array(_MAX_HEAD_DIM, numba.float32)
        m, l = attend(q, k_cache, v_cache, qo, kvo, head_dim, 0, sl, scale, acc)
        for d in range(head_dim):
            out[qo + d] = acc[d] / l if l > 0.0 else 0.0

    def config(args: Any) -> Any:
        n = args[4].shape[0] * args[5]
        return ((n + 63) // 64,), (64,)

    return k, config


@reference("decode_attn_split_chunk", "decode_attn_split_chunk_bf16", "decode_attn_split_chunk_bf16kv")
def _decode_attn_split_chunk(cuda: Any) -> Any:
    import numba

    attend = _attend_factory(cuda)

    @cuda.jit
    def k(q, k_cache, v_cache, part_o, part_ml, seq_lens, num_heads, num_kv_heads, head_dim, max_seq_len, scale,
          chunk_size, max_chunks):
        i = cuda.grid(1)
        batch = seq_lens.shape[0]
        if i >= batch * num_heads * max_chunks:
            return
        c = i % max_chunks
        bh = i // max_chunks
        b = bh // num_heads
        h = bh % num_heads
        sl = seq_lens[b]
        if sl > max_seq_len:
            sl = max_seq_len
        begin = min(c * chunk_size, sl)
        end = min(begin + chunk_size, sl)
        kvh = h // (num_heads // num_kv_heads)
        qo = (b * num_heads + h) * head_dim
        kvo = (b * num_kv_heads + kvh) * max_seq_len * head_dim
        acc = cuda.local.array(_MAX_HEAD_DIM, numba.float32)
        m, l = attend(q, k_cache, v_cache, qo, kvo, head_dim, begin, end, scale, acc)
        slot = bh * max_chunks + c
        for d in range(head_dim):
            part_o[slot * head_dim + d] = acc[d]
        part_ml[2 * slot] = m
        part_ml[2 * slot + 1] = l

    def config(args: Any) -> Any:
        n = args[5].shape[0] * args[6] * args[12]
        return ((n + 63) // 64,), (64,)

    return k, config


@reference("decode_attn_split_reduce", "decode_attn_split_reduce_bf16")
def _decode_attn_split_reduce(cuda: Any) -> Any:
    import math

    @cuda.jit
    def k(part_o, part_ml, out, seq_lens, num_heads, head_dim, max_seq_len, chunk_size, max_chunks):
        i = cuda.grid(1)
        batch = seq_lens.shape[0]
        if i >= batch * num_heads:
            return
        sl = seq_lens[i // num_heads]
        if sl > max_seq_len:
            sl = max_seq_len
        n = min((sl + chunk_size - 1) // chunk_size, max_chunks)
        base = i * max_chunks
        m = _NEG_INF
        for c in range(n):
            m = max(m, part_ml[2 * (base + c)])
        l = 0.0
        for c in range(n):
            if part_ml[2 * (base + c)] > _NEG_INF:
                l += part_ml[2 * (base + c) + 1] * math.exp(part_ml[2 * (base + c)] - m)
        for d in range(head_dim):
            o = 0.0
            for c in range(n):
                mc = part_ml[2 * (base + c)]
                if mc > _NEG_INF:
                    o += part_o[(base + c) * head_dim + d] * math.exp(mc - m)
            out[i * head_dim + d] = o / l if l > 0.0 else 0.0

    def config(args: Any) -> Any:
        n = args[3].shape[0] * args[4]
        return ((n + 63) // 64,), (64,)

    return k, config
