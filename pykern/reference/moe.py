"""numba.cuda references for kernels_cu/moe.cu: one thread per token, output element or (for the
integer bookkeeping of the expert alignment) one thread for the whole job; plain loops. Arrays arrive
flat, bf16 widened to float32, ids and offsets as int32."""
from __future__ import annotations

import math
from typing import Any

from .base import gelu_fns, reference, softmax_stats

_T = 64


def _grid1(n: int) -> tuple[tuple[int], tuple[int]]:
    return (max(1, (n + _T - 1) // _T),), (_T,)


def _one(_a: Any) -> tuple[tuple[int], tuple[int]]:
    return (1,), (1,)


@reference("moe_route", "moe_route_bf16", "moe_route_f16")
def _moe_route(cuda: Any):
    stats = softmax_stats(cuda)

    @cuda.jit
    def k(logits, bias, w, ids, n_tok, n_exp, top_k, renorm, sigm, has_bias):
        t = cuda.grid(1)
        if t < n_tok:
            base = t * n_exp
            mx, tot = stats(logits, base, n_exp, 0.0)
            for j in range(top_k):
                best = -math.inf
                bi = -1
                for e in range(n_exp):
                    taken = False
                    for i in range(j):
                        if ids[t * top_k + i] == e:
                            taken = True
                    if taken:
                        continue
                    if sigm:
                        v = 1.0 / (1.0 + math.exp(-logits[base + e]))
                        if has_bias:
                            v += bias[e]
                    else:
                        v = math.exp(logits[base + e] - mx) / tot
                        if has_bias:
                            v += bias[e]
                    if bi < 0 or v > best:
                        best = v
                        bi = e
                ids[t * top_k + j] = bi
                if sigm:
                    w[t * top_k + j] = 1.0 / (1.0 + math.exp(-logits[base + bi]))
                else:  # the unbiased probability: a bias only chooses
                    w[t * top_k + j] = math.exp(logits[base + bi] - mx) / tot
            if renorm:
                s = 0.0
                for j in range(top_k):
                    s += w[t * top_k + j]
                if sigm:
                    s += 1e-20
                for j in range(top_k):
                    w[t * top_k + j] = w[t * top_k + j] / s

    return k, lambda a: _grid1(a[4])


# ---- expert alignment: chunks of 256 slots, as the kernels (the chunk table is their interface)
_CHUNK = 256


@reference("moe_count")
def _moe_count(cuda: Any):
    @cuda.jit
    def k(ids, chunk_counts, sorted_slot, n_slots, n_exp, max_rows):
        if cuda.grid(1) == 0:
            n_chunks = (n_slots + _CHUNK - 1) // _CHUNK
            for i in range(n_chunks * n_exp):
                chunk_counts[i] = 0
            for s in range(n_slots):
                e = ids[s]
                if e >= 0 and e < n_exp:
                    chunk_counts[(s // _CHUNK) * n_exp + e] += 1
            for r in range(max_rows):
                sorted_slot[r] = -1

    return k, _one


@reference("moe_scan")
def _moe_scan(cuda: Any):
    @cuda.jit
    def k(chunk_counts, counts, offsets, n_chunks, n_exp, block):
        if cuda.grid(1) == 0:
            offsets[0] = 0
            for e in range(n_exp):
                run = 0
                for c in range(n_chunks):
                    v = chunk_counts[c * n_exp + e]
                    chunk_counts[c * n_exp + e] = run
                    run += v
                counts[e] = run
                offsets[e + 1] = offsets[e] + (run + block - 1) // block * block

    return k, _one


@reference("moe_place")
def _moe_place(cuda: Any):
    @cuda.jit
    def k(ids, chunk_counts, offsets, sorted_slot, slot_pos, n_slots, n_exp):
        if cuda.grid(1) == 0:
            for s in range(n_slots):
                e = ids[s]
                if e < 0 or e >= n_exp:
                    slot_pos[s] = -1
                    continue
                c = s // _CHUNK
                rank = 0
                for j in range(c * _CHUNK, s):
                    if ids[j] == e:
                        rank += 1
                pos = offsets[e] + chunk_counts[c * n_exp + e] + rank
                sorted_slot[pos] = s
                slot_pos[s] = pos

    return k, _one


# ---- permute / combine / elementwise


@reference("moe_gather", "moe_gather_bf16", "moe_gather_f16")
def _moe_gather(cuda: Any):
    @cuda.jit
    def k(src, sorted_slot, w, offsets, dst, max_rows, dim, top_k, n_exp, has_w):
        r = cuda.grid(1)
        if r < max_rows and r < offsets[n_exp]:
            s = sorted_slot[r]
            for c in range(dim):
                if s < 0:
                    dst[r * dim + c] = 0.0
                else:
                    v = src[(s // top_k) * dim + c]
                    if has_w:
                        v *= w[s]
                    dst[r * dim + c] = v

    return k, lambda a: _grid1(a[5])


@reference("moe_combine", "moe_combine_bf16", "moe_combine_f16")
def _moe_combine(cuda: Any):
    @cuda.jit
    def k(y, slot_pos, w, out, n_tok, dim, top_k, has_w):
        t = cuda.grid(1)
        if t < n_tok:
            for c in range(dim):
                acc = 0.0
                for j in range(top_k):
                    p = slot_pos[t * top_k + j]
                    if p >= 0:
                        sc = w[t * top_k + j] if has_w else 1.0
                        acc += sc * y[p * dim + c]
                out[t * dim + c] = acc

    return k, lambda a: _grid1(a[4])


@reference("moe_weight_grad")
def _moe_weight_grad(cuda: Any):
    @cuda.jit
    def k(dy, y, slot_pos, dw, n_slots, dim, top_k):
        s = cuda.grid(1)
        if s < n_slots:
            p = slot_pos[s]
            acc = 0.0
            if p >= 0:
                for c in range(dim):
                    acc += dy[(s // top_k) * dim + c] * y[p * dim + c]
            dw[s] = acc

    return k, lambda a: _grid1(a[4])


def _act_kernels(cuda: Any):
    gelu, gelu_grad = gelu_fns(cuda)

    @cuda.jit(device=True)
    def act_f(g, act):
        if act == 1:
            return gelu(g, 1)
        return g / (1.0 + math.exp(-g))

    @cuda.jit(device=True)
    def act_grad(g, act):
        if act == 1:
            return gelu_grad(g, 1)
        s = 1.0 / (1.0 + math.exp(-g))
        return s * (1.0 + g * (1.0 - s))

    return act_f, act_grad


@reference("moe_act", "moe_act_bf16", "moe_act_f16")
def _moe_act(cuda: Any):
    act_f, _ = _act_kernels(cuda)

    @cuda.jit
    def k(gu, h, offsets, max_rows, inter, n_exp, act):
        r = cuda.grid(1)
        if r < max_rows and r < offsets[n_exp]:
            for c in range(inter):
                h[r * inter + c] = act_f(gu[r * 2 * inter + c], act) * gu[r * 2 * inter + inter + c]

    return k, lambda a: _grid1(a[3])


@reference("moe_act_backward")
def _moe_act_backward(cuda: Any):
    act_f, act_grad = _act_kernels(cuda)

    @cuda.jit
    def k(gu, dh, dgu, sorted_slot, w, offsets, max_rows, inter, n_exp, act, has_w):
        r = cuda.grid(1)
        if r < max_rows and r < offsets[n_exp]:
            scale = 1.0
            if has_w:
                slot = sorted_slot[r]
                scale = w[slot] if slot >= 0 else 0.0
            for c in range(inter):
                g = gu[r * 2 * inter + c]
                u = gu[r * 2 * inter + inter + c]
                d = dh[r * inter + c] * scale
                dgu[r * 2 * inter + c] = d * u * act_grad(g, act)
                dgu[r * 2 * inter + inter + c] = d * act_f(g, act)

    return k, lambda a: _grid1(a[6])


# ---- grouped GEMMs: one thread per output element, its group found by a scan of the offsets


@reference("grouped_gemm_simt", "grouped_gemm_simt_bf16", "grouped_gemm_simt_f16")
def _grouped_gemm_simt(cuda: Any):
    @cuda.jit
    def k(a, b, offsets, out, M, N, K, n_groups, sbn, sbk):
        i = cuda.grid(1)
        if i < M * N:
            m = i // N
            n = i % N
            for e in range(n_groups):
                if offsets[e] <= m and m < offsets[e + 1]:
                    acc = 0.0
                    for kk in range(K):
                        acc += a[m * K + kk] * b[e * N * K + n * sbn + kk * sbk]
                    out[i] = acc

    return k, lambda a: _grid1(a[4] * a[5])


@reference("grouped_gemm_tc_bf16", "grouped_gemm_tc_f16", "grouped_gemm_tc_f32out_bf16", "grouped_gemm_tc_f32out_f16")
def _grouped_gemm_tc(cuda: Any):
    @cuda.jit
    def k(a, b, offsets, out, M, N, K, n_groups):
        i = cuda.grid(1)
        if i < M * N:
            m = i // N
            n = i % N
            for e in range(n_groups):
                if offsets[e] <= m and m < offsets[e + 1]:
                    acc = 0.0
                    for kk in range(K):
                        acc += a[m * K + kk] * b[(e * N + n) * K + kk]
                    out[i] = acc

    return k, lambda a: _grid1(a[4] * a[5])


@reference("moe_gemm_act_tc_bf16", "moe_gemm_act_tc_f16")
def _moe_gemm_act_tc(cuda: Any):
    act_f, _ = _act_kernels(cuda)

    @cuda.jit
    def k(a, b, offsets, out, M, N, K, n_groups, act):
        inter = N // 2
        i = cuda.grid(1)
        if i < M * inter:
            m = i // inter
            n = i % inter
            for e in range(n_groups):
                if offsets[e] <= m and m < offsets[e + 1]:
                    g = 0.0
                    u = 0.0
                    for kk in range(K):
                        g += a[m * K + kk] * b[(e * N + n) * K + kk]
                        u += a[m * K + kk] * b[(e * N + inter + n) * K + kk]
                    out[i] = act_f(g, act) * u

    return k, lambda a: _grid1(a[4] * (a[5] // 2))


@reference("grouped_gemm_wgrad")
def _grouped_gemm_wgrad(cuda: Any):
    @cuda.jit
    def k(a, b, offsets, out, M, N1, N2):
        i = cuda.grid(1)
        e = i // (N1 * N2)
        r = (i // N2) % N1
        c = i % N2
        if i < out.size:  # out holds E * N1 * N2 elements
            acc = 0.0
            lo = max(0, offsets[e])
            hi = min(offsets[e + 1], M)
            for m in range(lo, hi):
                acc += a[m * N1 + r] * b[m * N2 + c]
            out[i] = acc

    return k, lambda a: _grid1(a[3].size)


@reference("grouped_gemm_tc_nn_bf16", "grouped_gemm_tc_nn_f16", "grouped_gemm_tc_nn_f32out_bf16",
           "grouped_gemm_tc_nn_f32out_f16")
def _grouped_gemm_tc_nn(cuda: Any):
    @cuda.jit
    def k(a, b, offsets, out, M, N, K, n_groups):
        i = cuda.grid(1)
        if i < M * N:
            m = i // N
            n = i % N
            for e in range(n_groups):
                if offsets[e] <= m and m < offsets[e + 1]:
                    acc = 0.0
                    for kk in range(K):
                        acc += a[m * K + kk] * b[(e * K + kk) * N + n]
                    out[i] = acc

    return k, lambda a: _grid1(a[4] * a[5])


@reference("grouped_gemm_wgrad_tc_bf16", "grouped_gemm_wgrad_tc_f16")
def _grouped_gemm_wgrad_tc(cuda: Any):
    @cuda.jit
    def k(a, b, offsets, out, M, N, K, n_groups):
        i = cuda.grid(1)
        if i < n_groups * M * N:
            e = i // (M * N)
            r = (i // N) % M
            c = i % N
            acc = 0.0
            lo = max(0, offsets[e])
            hi = min(offsets[e + 1], K)
            for m in range(lo, hi):
                acc += a[m * M + r] * b[m * N + c]
            out[i] = acc

    return k, lambda a: _grid1(a[7] * a[4] * a[5])


# ---- split precision (moe_split16 and the split GEMMs): v as hi = round(v) and lo = round((v - hi) * scale) planes,
# scale 2^11 for f16 and 1 for bf16 (kernels_cu/moe.cu GG_LO_SCALE); the GEMMs take hi + lo / scale.


def _split_refs(kind: str, bits: int, min_exp: int, scale: float) -> None:
    def round16(cuda: Any):
        @cuda.jit(device=True)
        def r(v):  # v rounded to `bits` significant bits (half to even), the subnormal step 2^min_exp
            if v == 0.0 or v != v or abs(v) == math.inf:  # (rows past the used part may hold anything)
                return v
            _, ex = math.frexp(v)
            step = max(ex - bits, min_exp)
            return math.ldexp(float(round(math.ldexp(v, -step))), step)

        return r

    @reference("moe_split16_" + kind)
    def _split16(cuda: Any):
        r16 = round16(cuda)

        @cuda.jit
        def k(src, dst, n):
            i = cuda.grid(1)
            if i < n:
                v = src[i]
                hi = r16(v)
                dst[i] = hi
                dst[n + i] = (v - hi) * scale

        return k, lambda a: _grid1(a[2])

    @reference("grouped_gemm_tc_split_f32out_" + kind)
    def _split_f32out(cuda: Any):
        @cuda.jit
        def k(a, b, offsets, out, M, N, K, n_groups):
            i = cuda.grid(1)
            if i < M * N:
                m = i // N
                n = i % N
                for e in range(n_groups):
                    if offsets[e] <= m and m < offsets[e + 1]:
                        acc = 0.0
                        for kk in range(K):
                            av = a[m * K + kk] + a[M * K + m * K + kk] / scale
                            acc += av * b[(e * N + n) * K + kk]
                        out[i] = acc

        return k, lambda a: _grid1(a[4] * a[5])

    for split_b in (False, True):
        @reference(("grouped_gemm_wgrad_tc_split_ab_" if split_b else "grouped_gemm_wgrad_tc_split_a_") + kind)
        def _split_wgrad(cuda: Any, split_b=split_b):
            @cuda.jit
            def k(a, b, offsets, out, M, N, K, n_groups):
                i = cuda.grid(1)
                if i < n_groups * M * N:
                    e = i // (M * N)
                    r = (i // N) % M
                    c = i % N
                    acc = 0.0
                    lo = max(0, offsets[e])
                    hi = min(offsets[e + 1], K)
                    for m in range(lo, hi):
                        av = a[m * M + r] + a[K * M + m * M + r] / scale
                        bv = b[m * N + c]
                        if split_b:
                            bv += b[K * N + m * N + c] / scale
                        acc += av * bv
                    out[i] = acc

            return k, lambda a: _grid1(a[7] * a[4] * a[5])


_split_refs("bf16", 8, -133, 1.0)
_split_refs("f16", 11, -24, 2048.0)
