"""numba.cuda references for kernels_cu/paged.cu: one thread per output row (or appended token).

Arrays arrive flat; bf16 arrays arrive widened to float32 (the numba backend narrows
outputs back). Attention is two passes over the visible keys (max, then exp-sum and
weighted V) in natural exp; split partials store lse in the log2 domain, as the kernel
does, over the same per-split ranges (ceil(len / splits) rounded up to the tile).
Windows (normalized sides: causal is window_right = 0, unbounded is 2^30): a row sees
positions [p - window_left, p + window_right], p = len - qo_len + qi, and splits divide
that range as the kernel's do; softcap > 0 makes scores softcap * tanh(scale * q.k / softcap).
"""
from __future__ import annotations

from typing import Any

from .base import capped_score, reference

_MAX_HEAD_DIM = 256
_NEG_INF = float("-inf")
_LOG2E = 1.4426950408889634


def _helpers(cuda: Any) -> Any:
    import math

    @cuda.jit(device=True)
    def find_row(qo_indptr, q_mode, row, batch):
        # (sequence b, query index qi, qo_len) of global query row `row`; b = -1 when no sequence has it.
        if q_mode == 0:
            return row, 0, 1
        for b in range(batch):
            if qo_indptr[b] <= row < qo_indptr[b + 1]:
                return b, row - qo_indptr[b], qo_indptr[b + 1] - qo_indptr[b]
        return -1, 0, 0

    @cuda.jit(device=True)
    def split_range(length, num_splits, tile, split):
        if num_splits <= 1:
            return 0, length
        per = (length + num_splits - 1) // num_splits
        per = (per + tile - 1) // tile * tile
        begin = min(per * split, length)
        return begin, min(begin + per, length)

    @cuda.jit(device=True)
    def finish(out, lse, part_o, part_lse, acc, m, l, orow, head_dim, split, num_splits, rows_total, write_lse):
        if num_splits > 1:
            slot = split * rows_total + orow
            for d in range(head_dim):
                part_o[slot * head_dim + d] = acc[d] / l if l > 0.0 else 0.0
            part_lse[slot] = (m + math.log(l)) * _LOG2E if l > 0.0 else _NEG_INF
        else:
            for d in range(head_dim):
                out[orow * head_dim + d] = acc[d] / l if l > 0.0 else 0.0
            if write_lse != 0:
                lse[orow] = m + math.log(l) if l > 0.0 else _NEG_INF

    @cuda.jit(device=True)
    def window_range(length, qo_len, qi, window_left, window_right, num_splits, tile, chunk, split):
        # [begin, end) of this split inside the row's window (the kernel's CTA range, split alike)
        # 64-bit: lengths may arrive as uint32 and the unbounded sides are 2^30
        n = int(length)
        p = n - int(qo_len) + int(qi)
        lo = min(max(p - int(window_left), 0), n)
        hi = max(lo, min(p + int(window_right) + 1, n))
        if chunk > 0:
            begin = min(lo + chunk * split, hi)
            return begin, min(begin + chunk, hi)
        begin, end = split_range(hi - lo, num_splits, tile, split)
        return lo + begin, lo + end

    return find_row, window_range, capped_score(cuda), finish


def _fp8(cuda: Any, eb: int) -> Any:
    """Element readers: eb 0 = the value itself; 4 / 5 = an e4m3fn / e5m2 byte decoded by its definition."""
    import math

    if eb == 0:
        @cuda.jit(device=True)
        def load(a, i):
            return a[i]
        return load

    mb = 7 - eb
    bias = (1 << (eb - 1)) - 1

    @cuda.jit(device=True)
    def load8(a, i):
        b = int(a[i])
        sgn = -1.0 if b & 0x80 else 1.0
        m = b & 0x7F
        if eb == 4 and m == 0x7F:
            return math.nan
        if eb == 5 and m >= 0x7C:
            return sgn * math.inf if m == 0x7C else math.nan
        e = m >> mb
        f = m & ((1 << mb) - 1)
        if e == 0:
            return sgn * f * 2.0 ** (1 - bias - mb)
        return sgn * (1.0 + f / (1 << mb)) * 2.0 ** (e - bias)

    return load8


def _fp8_encode(cuda: Any, eb: int) -> Any:
    """fp8 byte of x: the nearest finite value (ties to the even code), saturated; NaN -> 0x7f / 0x7e."""
    import math

    load8 = _fp8(cuda, eb)
    top = 0x7E if eb == 4 else 0x7B

    @cuda.jit(device=True)
    def enc(x, table):
        neg = x < 0.0 or (x == 0.0 and math.copysign(1.0, x) < 0.0)
        sgn = 0x80 if neg else 0
        if x != x:
            return sgn | (0x7F if eb == 4 else 0x7E)
        a = abs(x)
        best = 0
        bd = math.inf
        for c in range(top + 1):
            table[0] = c
            dv = abs(load8(table, 0) - a)
            if dv < bd or (dv == bd and c % 2 == 0):
                best = c
                bd = dv
        return sgn | best

    return enc


_PAGED_NAMES = {0: ("paged_attn", "paged_attn_bf16", "paged_attn_bf16kv", "paged_attn_f16", "paged_attn_f16kv"),
                4: ("paged_attn_e4m3kv", "paged_attn_bf16_e4m3kv", "paged_attn_f16_e4m3kv"),
                5: ("paged_attn_e5m2kv", "paged_attn_bf16_e5m2kv", "paged_attn_f16_e5m2kv")}


def _paged_attn_ref(cuda: Any, eb: int) -> Any:
    import math

    import numba

    find_row, window_range, score, finish = _helpers(cuda)
    kvload = _fp8(cuda, eb)

    @cuda.jit
    def k(q, k_pages, v_pages, out, lse, part_o, part_lse, qo_indptr, kv_indptr, kv_indices, kv_last_page_len,
          num_qo_heads, num_kv_heads, head_dim, page_size, s_page, s_tok, s_head, q_mode, window_left, window_right,
          rows, tile, num_splits, total_q, write_lse, scale, softcap, k_scale, v_scale):
        i = cuda.grid(1)
        rows_total = total_q * num_qo_heads
        if i >= num_splits * rows_total:
            return
        split = i // rows_total
        orow = i % rows_total
        row = orow // num_qo_heads
        h = orow % num_qo_heads
        batch = kv_indptr.shape[0] - 1
        b, qi, qo_len = find_row(qo_indptr, q_mode, row, batch)
        if b < 0:
            return
        kvh = h // (num_qo_heads // num_kv_heads)
        np_ = kv_indptr[b + 1] - kv_indptr[b]
        last = min(max(kv_last_page_len[b], 0), page_size)
        length = (np_ - 1) * page_size + last if np_ > 0 else 0
        begin, end = window_range(length, qo_len, qi, window_left, window_right, num_splits, tile, 0, split)
        acc = cuda.local.array(_MAX_HEAD_DIM, numba.float32)
        for d in range(head_dim):
            acc[d] = 0.0
        qo = orow * head_dim
        m = _NEG_INF
        for pos in range(begin, end):
            base = kv_indices[kv_indptr[b] + pos // page_size] * s_page + (pos % page_size) * s_tok + kvh * s_head
            s = 0.0
            for d in range(head_dim):
                s += q[qo + d] * kvload(k_pages, base + d) * k_scale
            m = max(m, score(s, scale, softcap))
        l = 0.0
        for pos in range(begin, end):
            base = kv_indices[kv_indptr[b] + pos // page_size] * s_page + (pos % page_size) * s_tok + kvh * s_head
            s = 0.0
            for d in range(head_dim):
                s += q[qo + d] * kvload(k_pages, base + d) * k_scale
            p = math.exp(score(s, scale, softcap) - m)
            l += p
            for d in range(head_dim):
                acc[d] += p * kvload(v_pages, base + d) * v_scale
        finish(out, lse, part_o, part_lse, acc, m, l, orow, head_dim, split, num_splits, rows_total, write_lse)

    def config(args: Any) -> Any:
        n = args[23] * args[24] * args[11]
        return ((n + 63) // 64,), (64,)

    return k, config


for _eb, _names in _PAGED_NAMES.items():
    reference(*_names)(lambda cuda, _eb=_eb: _paged_attn_ref(cuda, _eb))


@reference("dense_attn", "dense_attn_bf16", "dense_attn_bf16kv", "dense_attn_f16", "dense_attn_f16kv")
def _dense_attn(cuda: Any) -> Any:
    import math

    import numba

    find_row, window_range, score, finish = _helpers(cuda)

    @cuda.jit
    def k(q, kk, vv, out, lse, part_o, part_lse, cu_seqlens_q, cu_seqlens_k, seq_lens, num_qo_heads, num_kv_heads,
          head_dim, s_b, s_tok, s_head, max_len, q_mode, k_mode, window_left, window_right, rows, tile, num_splits,
          chunk, total_q, write_lse, scale, softcap):
        i = cuda.grid(1)
        rows_total = total_q * num_qo_heads
        if i >= num_splits * rows_total:
            return
        split = i // rows_total
        orow = i % rows_total
        row = orow // num_qo_heads
        h = orow % num_qo_heads
        batch = cu_seqlens_k.shape[0] - 1 if k_mode == 0 else seq_lens.shape[0]
        b, qi, qo_len = find_row(cu_seqlens_q, q_mode, row, batch)
        if b < 0:
            return
        kvh = h // (num_qo_heads // num_kv_heads)
        if k_mode == 0:
            length = max(cu_seqlens_k[b + 1] - cu_seqlens_k[b], 0)
            base0 = cu_seqlens_k[b] * s_tok + kvh * s_head
        else:
            length = min(seq_lens[b], max_len)
            base0 = b * s_b + kvh * s_head
        begin, end = window_range(length, qo_len, qi, window_left, window_right, num_splits, tile, chunk, split)
        acc = cuda.local.array(_MAX_HEAD_DIM, numba.float32)
        for d in range(head_dim):
            acc[d] = 0.0
        qo = orow * head_dim
        m = _NEG_INF
        for pos in range(begin, end):
            s = 0.0
            for d in range(head_dim):
                s += q[qo + d] * kk[base0 + pos * s_tok + d]
            m = max(m, score(s, scale, softcap))
        l = 0.0
        for pos in range(begin, end):
            s = 0.0
            for d in range(head_dim):
                s += q[qo + d] * kk[base0 + pos * s_tok + d]
            p = math.exp(score(s, scale, softcap) - m)
            l += p
            for d in range(head_dim):
                acc[d] += p * vv[base0 + pos * s_tok + d]
        finish(out, lse, part_o, part_lse, acc, m, l, orow, head_dim, split, num_splits, rows_total, write_lse)

    def config(args: Any) -> Any:
        n = args[23] * args[25] * args[10]
        return ((n + 63) // 64,), (64,)

    return k, config


@reference("paged_attn_merge", "paged_attn_merge_bf16", "paged_attn_merge_f16")
def _paged_attn_merge(cuda: Any) -> Any:
    import math

    @cuda.jit
    def k(part_o, part_lse, out, lse, total_rows, head_dim, num_splits, write_lse):
        row = cuda.grid(1)
        if row >= total_rows:
            return
        m = _NEG_INF
        for s in range(num_splits):
            m = max(m, part_lse[s * total_rows + row])
        w = 0.0
        for s in range(num_splits):
            if part_lse[s * total_rows + row] > _NEG_INF:
                w += 2.0 ** (part_lse[s * total_rows + row] - m)
        for d in range(head_dim):
            o = 0.0
            for s in range(num_splits):
                ls = part_lse[s * total_rows + row]
                if ls > _NEG_INF:
                    o += 2.0 ** (ls - m) * part_o[(s * total_rows + row) * head_dim + d]
            out[row * head_dim + d] = o / w if w > 0.0 else 0.0
        if write_lse != 0:
            lse[row] = (m + math.log2(w)) / _LOG2E if w > 0.0 else _NEG_INF

    def config(args: Any) -> Any:
        n = args[4]
        return ((n + 63) // 64,), (64,)

    return k, config


def _append_ref(cuda: Any, eb: int) -> Any:
    import numba

    if eb:
        enc = _fp8_encode(cuda, eb)
    else:
        @cuda.jit(device=True)
        def enc(x, table):
            return x

    @cuda.jit
    def k(kk, vv, batch_indices, positions, k_pages, v_pages, kv_indices, kv_indptr, batch, num_kv_heads, head_dim,
          page_size, s_page, s_tok, s_head, k_scale, v_scale):
        t = cuda.grid(1)
        if t >= batch_indices.shape[0]:
            return
        b = batch_indices[t]
        pos = positions[t]
        if b < 0 or b >= batch or pos < 0:
            return
        slot = kv_indptr[b] + pos // page_size
        if slot >= kv_indptr[b + 1]:
            return
        page = kv_indices[slot]
        n = num_kv_heads * head_dim
        table = cuda.local.array(1, numba.uint8)
        for h in range(num_kv_heads):
            for d in range(head_dim):
                dst = page * s_page + (pos % page_size) * s_tok + h * s_head + d
                k_pages[dst] = enc(kk[t * n + h * head_dim + d] / k_scale, table)
                v_pages[dst] = enc(vv[t * n + h * head_dim + d] / v_scale, table)

    def config(args: Any) -> Any:
        n = args[2].shape[0]
        return ((n + 63) // 64,), (64,)

    return k, config


for _eb, _names in {0: ("paged_append_kv", "paged_append_kv_bf16", "paged_append_kv_f16"),
                    4: ("paged_append_kv_e4m3", "paged_append_kv_bf16_e4m3", "paged_append_kv_f16_e4m3"),
                    5: ("paged_append_kv_e5m2", "paged_append_kv_bf16_e5m2", "paged_append_kv_f16_e5m2")}.items():
    reference(*_names)(lambda cuda, _eb=_eb: _append_ref(cuda, _eb))


@reference("paged_batch_indices_positions")
def _batch_indices_positions(cuda: Any) -> Any:
    @cuda.jit
    def k(append_indptr, seq_lens, batch_indices, positions, batch, nnz):
        # one thread a token, a linear scan for its sequence; uncovered tokens and negative positions: -1, -1
        t = cuda.grid(1)
        if t >= nnz:
            return
        b = -1
        pos = -1
        for s in range(batch):
            if append_indptr[s] <= t < append_indptr[s + 1]:
                p = seq_lens[s] - (append_indptr[s + 1] - t)
                if p >= 0:
                    b = s
                    pos = p
                break
        batch_indices[t] = b
        positions[t] = pos

    def config(args: Any) -> Any:
        return ((args[5] + 63) // 64,), (64,)

    return k, config


# flash_attention_varlen's FlashAttention-2 kernels (kernels_cu/attention_fwd_tc.cu): the same function as
# dense_attn over cu_seqlens, with their own parameter list; head_dim = out's size / lse's size.
_VARLEN_TC_NAMES = tuple(f"attention_fwd_varlen_tc_d{d}{c}{t}" for d in (64, 128) for c in ("", "_softcap")
                          for t in ("_bf16", "_f16"))


@reference(*_VARLEN_TC_NAMES)
def _varlen_tc(cuda: Any) -> Any:
    import math

    import numba

    find_row, window_range, score, finish = _helpers(cuda)

    @cuda.jit
    def k(q, kk, vv, out, lse, cu_seqlens_q, cu_seqlens_k, num_qo_heads, num_kv_heads, n_qt, scale, window_left,
          window_right, softcap):
        orow = cuda.grid(1)
        rows_total = lse.shape[0]
        if orow >= rows_total:
            return
        head_dim = out.shape[0] // rows_total
        row = orow // num_qo_heads
        h = orow % num_qo_heads
        b, qi, qo_len = find_row(cu_seqlens_q, 1, row, cu_seqlens_k.shape[0] - 1)
        if b < 0:
            return
        kvh = h // (num_qo_heads // num_kv_heads)
        s_tok = num_kv_heads * head_dim
        length = max(cu_seqlens_k[b + 1] - cu_seqlens_k[b], 0)
        base0 = cu_seqlens_k[b] * s_tok + kvh * head_dim
        begin, end = window_range(length, qo_len, qi, window_left, window_right, 1, 64, 0, 0)
        acc = cuda.local.array(_MAX_HEAD_DIM, numba.float32)
        for d in range(head_dim):
            acc[d] = 0.0
        qo = orow * head_dim
        m = _NEG_INF
        for pos in range(begin, end):
            s = 0.0
            for d in range(head_dim):
                s += q[qo + d] * kk[base0 + pos * s_tok + d]
            m = max(m, score(s, scale, softcap))
        l = 0.0
        for pos in range(begin, end):
            s = 0.0
            for d in range(head_dim):
                s += q[qo + d] * kk[base0 + pos * s_tok + d]
            p = math.exp(score(s, scale, softcap) - m)
            l += p
            for d in range(head_dim):
                acc[d] += p * vv[base0 + pos * s_tok + d]
        finish(out, lse, out, lse, acc, m, l, orow, head_dim, 0, 1, rows_total, 1)

    def config(args: Any) -> Any:
        n = int(args[4].shape[0])
        return ((n + 63) // 64,), (64,)

    return k, config


# paged_prefill_attention's FlashAttention-2 kernels (kernels_cu/attention_fwd_tc.cu), 16-bit caches: the
# same function as paged_attn (q_mode 1), with their own parameter list (page_size = 1 << ps_log2, scale
# holding k_scale); head_dim = out's size / lse's size.
_PAGED_TC_NAMES = tuple(f"paged_prefill_tc_d{d}{c}{t}" for d in (64, 128) for c in ("", "_softcap")
                          for t in ("_bf16", "_f16"))


@reference(*_PAGED_TC_NAMES)
def _paged_prefill_tc(cuda: Any) -> Any:
    import math

    import numba

    find_row, window_range, score, finish = _helpers(cuda)

    @cuda.jit
    def k(q, k_pages, v_pages, out, lse, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, num_qo_heads,
          num_kv_heads, ps_log2, s_page, s_tok, s_head, scale, window_left, window_right, softcap, v_scale):
        orow = cuda.grid(1)
        rows_total = lse.shape[0]
        if orow >= rows_total:
            return
        head_dim = out.shape[0] // rows_total
        page_size = 1 << ps_log2
        row = orow // num_qo_heads
        h = orow % num_qo_heads
        b, qi, qo_len = find_row(qo_indptr, 1, row, kv_indptr.shape[0] - 1)
        if b < 0:
            return
        kvh = h // (num_qo_heads // num_kv_heads)
        np_ = kv_indptr[b + 1] - kv_indptr[b]
        last = min(max(kv_last_page_len[b], 0), page_size)
        length = (np_ - 1) * page_size + last if np_ > 0 else 0
        begin, end = window_range(length, qo_len, qi, window_left, window_right, 1, 64, 0, 0)
        acc = cuda.local.array(_MAX_HEAD_DIM, numba.float32)
        for d in range(head_dim):
            acc[d] = 0.0
        qo = orow * head_dim
        m = _NEG_INF
        for pos in range(begin, end):
            base = kv_indices[kv_indptr[b] + pos // page_size] * s_page + (pos % page_size) * s_tok + kvh * s_head
            s = 0.0
            for d in range(head_dim):
                s += q[qo + d] * k_pages[base + d]
            m = max(m, score(s, scale, softcap))
        l = 0.0
        for pos in range(begin, end):
            base = kv_indices[kv_indptr[b] + pos // page_size] * s_page + (pos % page_size) * s_tok + kvh * s_head
            s = 0.0
            for d in range(head_dim):
                s += q[qo + d] * k_pages[base + d]
            p = math.exp(score(s, scale, softcap) - m)
            l += p
            for d in range(head_dim):
                acc[d] += p * v_pages[base + d] * v_scale
        finish(out, lse, out, lse, acc, m, l, orow, head_dim, 0, 1, rows_total, 1)

    def config(args: Any) -> Any:
        n = int(args[4].shape[0])
        return ((n + 63) // 64,), (64,)

    return k, config
