"""numba.cuda references for kernels_cu/decode_tc.cu: one thread per output row (its splits merged), after paged_attn's
reference (pykern/reference/serving.py), over the tensor-core kernels' parameter list (head_dim is the
kernel's compiled D; one query per sequence at position len - 1; splits of 64-key tiles, merged in the
same launch as the kernel's last split CTA merges them)."""
from __future__ import annotations

from typing import Any

from .base import reference
from .serving import _MAX_HEAD_DIM, _NEG_INF, _fp8, _helpers

_TILE = 64  # DTC_BC


def _decode_tc_ref(cuda: Any, d: int, eb: int) -> Any:
    import math

    import numba

    _find_row, window_range, score, _finish = _helpers(cuda)
    kvload = _fp8(cuda, eb)

    @cuda.jit
    def k(q, k_pages, v_pages, out, lse, part_o, part_lse, counters, kv_indptr, kv_indices, kv_last_page_len,
          num_qo_heads, num_kv_heads, page_size, s_page, s_tok, s_head, window_left, num_splits, batch, write_lse,
          scale, k_scale, v_scale, items_per_cta):
        # One thread per output row: each split's softmax over its range, merged as it goes (max-lse rescale);
        # the kernel does the same in one launch (the last split CTA merges), so out / lse are final and the
        # counters (zero before) stay zero. The partial buffers are the kernel's scratch: not written here, and
        # items_per_cta is the kernel's launch geometry only (how many work items a CTA streams).
        orow = cuda.grid(1)
        rows_total = batch * num_qo_heads
        if orow >= rows_total:
            return
        b = orow // num_qo_heads
        h = orow % num_qo_heads
        kvh = h // (num_qo_heads // num_kv_heads)
        np_ = kv_indptr[b + 1] - kv_indptr[b]
        last = min(max(kv_last_page_len[b], 0), page_size)
        length = (np_ - 1) * page_size + last if np_ > 0 else 0
        acc = cuda.local.array(_MAX_HEAD_DIM, numba.float32)
        tot = cuda.local.array(_MAX_HEAD_DIM, numba.float32)
        for dd in range(d):
            tot[dd] = 0.0
        big_m = _NEG_INF
        big_w = 0.0
        qo = orow * d
        for split in range(num_splits):
            begin, end = window_range(length, 1, 0, window_left, 0, num_splits, _TILE, 0, split)
            for dd in range(d):
                acc[dd] = 0.0
            m = _NEG_INF
            for pos in range(begin, end):
                base = kv_indices[kv_indptr[b] + pos // page_size] * s_page + (pos % page_size) * s_tok + kvh * s_head
                s = 0.0
                for dd in range(d):
                    s += q[qo + dd] * kvload(k_pages, base + dd) * k_scale
                m = max(m, score(s, scale, 0.0))
            l = 0.0
            for pos in range(begin, end):
                base = kv_indices[kv_indptr[b] + pos // page_size] * s_page + (pos % page_size) * s_tok + kvh * s_head
                s = 0.0
                for dd in range(d):
                    s += q[qo + dd] * kvload(k_pages, base + dd) * k_scale
                p = math.exp(score(s, scale, 0.0) - m)
                l += p
                for dd in range(d):
                    acc[dd] += p * kvload(v_pages, base + dd) * v_scale
            if l > 0.0:  # this split saw keys: lse_s = m + log l, o_s = acc / l, folded into the running merge
                lse_s = m + math.log(l)
                if lse_s > big_m:
                    f = math.exp(big_m - lse_s) if big_w > 0.0 else 0.0
                    for dd in range(d):
                        tot[dd] *= f
                    big_w *= f
                    big_m = lse_s
                w = math.exp(lse_s - big_m)
                big_w += w
                for dd in range(d):
                    tot[dd] += w * (acc[dd] / l)
        for dd in range(d):
            out[qo + dd] = tot[dd] / big_w if big_w > 0.0 else 0.0
        if write_lse != 0:
            lse[orow] = big_m + math.log(big_w) if big_w > 0.0 else _NEG_INF

    def config(args: Any) -> Any:
        n = args[19] * args[11]
        return ((n + 63) // 64,), (64,)

    return k, config


for _d in (64, 128):
    for _eb, _kv in ((0, ""), (4, "_e4m3kv"), (5, "_e5m2kv")):
        reference(f"decode_tc_paged_d{_d}{_kv}_bf16", f"decode_tc_paged_d{_d}{_kv}_f16")(
            lambda cuda, _d=_d, _eb=_eb: _decode_tc_ref(cuda, _d, _eb))

