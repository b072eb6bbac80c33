"""numba.cuda references for kernels_cu/sampling.cu: one thread per row, plain loops over values.

The kernels decide with integers (fixed-point mass, Philox words), so the references compute
the same integers the simple way and agree token for token:
- mass q = floor(p * 2^(40 - e)) with 2^(e-1) <= max(p) < 2^e, in float64 (exact: a float32
  times a power of two) and floor;
- thresholds by walking the distinct values from the top (no radix select): the k-th largest
  value with ties, the largest value whose mass at or above reaches the top-p target;
- Philox4x32-10 with 16-bit limb products, so every intermediate fits in int64 (the simulator's
  Python ints, NumPy int64 and numba's int64 all give the same bits).
Arrays arrive flat; bf16 / f16 arrays widened to float32.
"""
from __future__ import annotations

import math
from typing import Any

from .base import reference

_F = 40
_M32 = 0xFFFFFFFF
_OFF = 1 << 62  # a rejection filter that is off (count / mass limits no row reaches)


def _helpers(cuda: Any) -> Any:
    import math

    import numba

    @cuda.jit(device=True)
    def mul32(a, b):
        # (hi, lo) 32-bit words of a * b for a, b < 2^32, without a product above 2^48.
        a0 = a & 0xFFFF
        a1 = a >> 16
        b0 = b & 0xFFFF
        b1 = b >> 16
        p00 = a0 * b0
        mid = a1 * b0 + a0 * b1 + (p00 >> 16)  # < 2^34
        lo = ((mid & 0xFFFF) << 16) | (p00 & 0xFFFF)
        hi = a1 * b1 + (mid >> 16)
        return hi & _M32, lo & _M32

    @cuda.jit(device=True)
    def philox_word0(k0, k1, c0, c1, c2, c3):
        for r in range(10):
            if r > 0:
                k0 = (k0 + 0x9E3779B9) & _M32
                k1 = (k1 + 0xBB67AE85) & _M32
            hi0, lo0 = mul32(0xD2511F53, c0)
            hi1, lo1 = mul32(0xCD9E8D57, c2)
            n0 = hi1 ^ c1 ^ k0
            n2 = hi0 ^ c3 ^ k1
            c0, c1, c2, c3 = n0, lo1, n2, lo0
        return c0, c1, c2, c3

    @cuda.jit(device=True)
    def mul_frac(a, b):
        # floor(a * b / 2^32) for a < 2^62, b < 2^32
        hi, lo = mul32(a & _M32, b)
        return (a >> 32) * b + hi

    @cuda.jit(device=True)
    def clean(x):
        # NaN, negative and inf count as 0
        if x > 0.0 and x < math.inf:
            return x
        return 0.0

    @cuda.jit(device=True)
    def row_bad(probs, base, n):
        # some entry is NaN, inf or negative: no distribution (the kernels' SpRow::bad)
        for i in range(n):
            x = probs[base + i]
            if not (x >= 0.0 and x < math.inf):
                return True
        return False

    @cuda.jit(device=True)
    def row_scale(probs, base, n):
        # (max, 2^(40 - e)) with 2^(e-1) <= max < 2^e; max 0 for a row without mass
        m = 0.0
        for i in range(n):
            m = max(m, clean(probs[base + i]))
        if m == 0.0:
            return 0.0, 0.0
        s = 1.0  # 2^e
        e = 0
        while m >= s:
            s *= 2.0
            e += 1
        while m < s * 0.5:
            s *= 0.5
            e -= 1
        scale = 1.0
        for _ in range(abs(_F - e)):
            scale = scale * 2.0 if _F - e > 0 else scale * 0.5
        return m, scale

    @cuda.jit(device=True)
    def mass(x, scale):
        # float64 before the product: a float32 times a large power of two would overflow in float32
        return numba.int64(math.floor(numba.float64(clean(x)) * scale))

    @cuda.jit(device=True)
    def kth_largest(vals, base, n, k, logits):
        # the k-th largest value counting ties (value NaN sorts lowest for logits)
        hi = math.inf
        first = True
        while True:
            v = -math.inf
            found = False
            for i in range(n):
                x = vals[base + i] if logits else clean(vals[base + i])
                if x == x and (first or x < hi) and (not found or x > v):
                    v = x
                    found = True
            if not found:
                return -math.inf, False  # fewer than k numbers: NaNs are reached
            c = 0
            for i in range(n):
                x = vals[base + i] if logits else clean(vals[base + i])
                if x >= v:
                    c += 1
            if c >= k:
                return v, True
            hi = v
            first = False

    @cuda.jit(device=True)
    def top_p_value(probs, base, n, lo_v, target, scale):
        # the largest value v >= lo_v whose mass at or above v (among values >= lo_v) reaches target
        hi = math.inf
        while True:
            v = -1.0
            for i in range(n):
                x = clean(probs[base + i])
                if x >= lo_v and x < hi and x > 0.0 and x > v:
                    v = x
            if v < 0.0:
                return lo_v
            acc = 0
            for i in range(n):
                x = clean(probs[base + i])
                if x >= v:
                    acc += mass(x, scale)
            if acc >= target:
                return v
            hi = v

    @cuda.jit(device=True)
    def kept_mass(probs, base, n, lo_v, scale):
        acc = 0
        for i in range(n):
            x = clean(probs[base + i])
            if x >= lo_v and x > 0.0:
                acc += mass(x, scale)
        return acc

    @cuda.jit(device=True)
    def target(total, p):
        # ceil(top_p * total) with top_p = P / 2^32, P = floor(top_p * 2^32) >= 1
        big = numba.int64(math.floor(numba.float64(p) * 4294967296.0))
        if big < 1:
            big = 1
        hi, lo = mul32(total & _M32, big)
        return (total >> 32) * big + hi + (1 if lo != 0 else 0)

    return philox_word0, mul_frac, clean, row_scale, mass, kth_largest, top_p_value, kept_mass, target, row_bad


@reference("sampling_philox")
def _philox(cuda: Any) -> Any:
    philox_word0 = _helpers(cuda)[0]

    @cuda.jit
    def k(out, n, seed_lo, seed_hi, offset_lo, offset_hi):
        i = cuda.grid(1)
        if i >= n:
            return
        c0, c1, c2, c3 = philox_word0(seed_lo, seed_hi, offset_lo, offset_hi, i, 0)
        out[4 * i] = c0
        out[4 * i + 1] = c1
        out[4 * i + 2] = c2
        out[4 * i + 3] = c3

    def config(args: Any) -> Any:
        return ((args[1] + 63) // 64,), (64,)

    return k, config


@reference("sampling_mass")
def _mass(cuda: Any) -> Any:
    import numba

    clean = _helpers(cuda)[2]

    @cuda.jit
    def k(p, out, n, sh):
        i = cuda.grid(1)
        if i >= n:
            return
        scale = 1.0
        for _ in range(abs(sh)):
            scale = scale * 2.0 if sh > 0 else scale * 0.5
        out[i] = int(math.floor(numba.float64(clean(p[i])) * scale))  # float64: exact, and no float32 overflow

    def config(args: Any) -> Any:
        return ((args[2] + 63) // 64,), (64,)

    return k, config


@reference("sampling_from_probs", "sampling_from_probs_bf16", "sampling_from_probs_f16")
def _sampling(cuda: Any) -> Any:
    import numba

    (philox_word0, mul_frac, clean, row_scale, mass, kth_largest, top_p_value, kept_mass, target,
     row_bad) = _helpers(cuda)
    reject = _reject_helpers(cuda)[0]

    @cuda.jit
    def k(probs, out, valid, indices, top_k_arr, top_p_arr, min_p_arr, seed_arr, offset_arr, vocab, flags,
          top_k_val, top_p_val, min_p_val, seed_lo, seed_hi, offset_lo, offset_hi, ws, tickets):
        # ws, tickets: the split rows' partials and ticket counters (kernels_cu/sampling.cu, sp_split_last): one
        # thread a row here, whose token is the split kernel's for any number of CTAs a row
        b = cuda.grid(1)
        if b >= out.shape[0]:
            return
        r = indices[b] if flags & 1 else b
        base = r * vocab
        m, scale = row_scale(probs, base, vocab)
        out[b] = 0
        valid[b] = 0
        if m == 0.0 or row_bad(probs, base, vocab):
            return
        lo_v = 0.0  # keep x >= lo_v with x > 0
        if flags & 8:
            mp = numba.float32(min_p_arr[b] if flags & 128 else min_p_val)  # the kernel's C float
            if not mp < 1.0:
                mp = 1.0
            lo_v = max(lo_v, numba.float32(numba.float32(m) * numba.float32(mp)))
        kc = _OFF
        if flags & 2:
            kk = top_k_arr[b] if flags & 32 else top_k_val
            if kk > 0 and kk < vocab:
                kc = kk
        big = 0.0
        if flags & 4:
            p = numba.float32(top_p_arr[b] if flags & 64 else top_p_val)
            if p < 1.0:
                big = p
        s0 = numba.int64(seed_arr[2 * b]) if flags & 256 else seed_lo
        s1 = numba.int64(seed_arr[2 * b + 1]) if flags & 256 else seed_hi
        o0 = numba.int64(offset_arr[2 * b]) if flags & 512 else offset_lo
        o1 = numba.int64(offset_arr[2 * b + 1]) if flags & 512 else offset_hi
        if kc == _OFF and big == 0.0:  # the inverse CDF over the min-p set, one word
            total = kept_mass(probs, base, vocab, lo_v, scale)
            u, _, _, _ = philox_word0(s0, s1, o0, o1, b, 0)
            t = mul_frac(total, u)
            acc = 0
            for i in range(vocab):
                x = clean(probs[base + i])
                if x >= lo_v and x > 0.0:
                    acc += mass(x, scale)
                    if acc > t:
                        out[b] = i
                        valid[b] = 1
                        return
            return
        if kc != _OFF and big != 0.0 and flags & 16:  # top-k first: the draws start in the top-k set
            v, ok = kth_largest(probs, base, vocab, kc, False)
            lo_v = max(lo_v, v)
            kc = _OFF
        S = kept_mass(probs, base, vocab, lo_v, scale)
        tg = _OFF
        if big != 0.0:
            tg = target(kept_mass(probs, base, vocab, lo_v if flags & 16 else 0.0, scale), big)
        x = reject(probs, base, vocab, False, lo_v, False, S, kc, tg, s0, s1, o0, o1, b, m, 0.0, scale)
        if x >= 0:
            out[b] = x
            valid[b] = 1

    def config(args: Any) -> Any:
        n = args[1].shape[0]
        return ((n + 31) // 32,), (32,)

    return k, config


@reference("sampling_renorm_probs", "sampling_renorm_probs_bf16", "sampling_renorm_probs_f16")
def _renorm(cuda: Any) -> Any:
    import numba

    (philox_word0, mul_frac, clean, row_scale, mass, kth_largest, top_p_value, kept_mass, target,
     row_bad) = _helpers(cuda)

    @cuda.jit
    def k(probs, out, top_k_arr, top_p_arr, vocab, flags, top_k_val, top_p_val):
        b = cuda.grid(1)
        if b * vocab >= out.shape[0]:
            return
        base = b * vocab
        m, scale = row_scale(probs, base, vocab)
        copy = False
        lo_v = 0.0
        kk = top_k_arr[b] if flags & 2 else top_k_val
        if (not flags & 1 or (kk > 0 and kk < vocab)) and row_bad(probs, base, vocab):
            # an active filter over a NaN / inf / negative entry: a NaN row
            for i in range(vocab):
                out[base + i] = math.nan
            return
        if flags & 1:
            if m == 0.0 or kk <= 0 or kk >= vocab:
                copy = True
            else:
                v, ok = kth_largest(probs, base, vocab, kk, False)
                lo_v = v
        elif m > 0.0:
            p = numba.float32(top_p_arr[b] if flags & 4 else top_p_val)
            if p < 1.0:
                lo_v = top_p_value(probs, base, vocab, 0.0, target(kept_mass(probs, base, vocab, 0.0, scale), p),
                                   scale)
        if copy:
            for i in range(vocab):
                out[base + i] = probs[base + i]
            return
        total = kept_mass(probs, base, vocab, lo_v, scale) if m > 0.0 else 0
        inv = numba.float32(0.0)
        if total > 0:
            inv = numba.float32(1.0) / numba.float32(numba.float64(total) / scale)
        for i in range(vocab):
            x = clean(probs[base + i])
            out[base + i] = numba.float32(x) * inv if (x >= lo_v and x > 0.0) else 0.0

    def config(args: Any) -> Any:
        n = args[1].shape[0] // max(1, args[4])
        return ((n + 31) // 32,), (32,)

    return k, config


@reference("sampling_top_k_mask_logits", "sampling_top_k_mask_logits_bf16", "sampling_top_k_mask_logits_f16")
def _mask(cuda: Any) -> Any:
    import math

    kth_largest = _helpers(cuda)[5]

    @cuda.jit
    def k(logits, out, top_k_arr, vocab, flags, top_k_val):
        b = cuda.grid(1)
        if b * vocab >= out.shape[0]:
            return
        base = b * vocab
        kk = top_k_arr[b] if flags & 2 else top_k_val
        keep_all = kk <= 0 or kk >= vocab
        v = -math.inf
        if not keep_all:
            v, ok = kth_largest(logits, base, vocab, kk, True)
            keep_all = not ok  # fewer than k numbers: the NaNs are in the top k too
        for i in range(vocab):
            x = logits[base + i]
            out[base + i] = x if (keep_all or x >= v) else -math.inf

    def config(args: Any) -> Any:
        n = args[1].shape[0] // max(1, args[3])
        return ((n + 31) // 32,), (32,)

    return k, config


@reference("sampling_chain_speculative", "sampling_chain_speculative_bf16", "sampling_chain_speculative_f16")
def _chain_speculative(cuda: Any) -> Any:
    import numba

    philox_word0, mul_frac, clean = _helpers(cuda)[:3]

    @cuda.jit(device=True)
    def decode(x):
        # (m, e) with x = m * 2^e, m < 2^24 an integer: x a positive finite float32 value (float64 here, exact)
        f, e = math.frexp(x)
        return numba.int64(f * 16777216.0), e - 24

    @cuda.jit(device=True)
    def accept(r, p, q):
        # r / 2^32 * q < p, exactly, by the kernel's integer rule (sp_accept)
        p = clean(p)
        q = clean(q)
        if p == 0.0:
            return False
        if q == 0.0:
            return True
        mp, ep = decode(p)
        mq, eq = decode(q)
        a = numba.int64(r) * mq
        d = ep + 32 - eq
        if d >= 0:
            return True if d >= 64 else (a >> d) < mp
        s = -d
        if s >= 25:
            return a == 0
        return a < ((mp + (1 << s) - 1) >> s)

    @cuda.jit(device=True)
    def mass(x, scale):
        return numba.int64(math.floor(numba.float64(clean(x)) * scale))

    @cuda.jit(device=True)
    def residual(target, draft, tb, db, i, scale, diff):
        a = mass(target[tb + i], scale)
        b = mass(draft[db + i], scale) if diff else 0
        return a - b if a > b else 0

    @cuda.jit
    def k(draft, ids, target, out, acc_num, emit_num, seed_arr, offset_arr, n, vocab, flags, seed_lo, seed_hi,
          offset_lo, offset_hi):
        b = cuda.grid(1)
        if b >= acc_num.shape[0]:
            return
        k0 = numba.int64(seed_arr[2 * b]) if flags & 1 else seed_lo
        k1 = numba.int64(seed_arr[2 * b + 1]) if flags & 1 else seed_hi
        c0 = numba.int64(offset_arr[2 * b]) if flags & 2 else offset_lo
        c1 = numba.int64(offset_arr[2 * b + 1]) if flags & 2 else offset_hi
        o0 = b * (n + 1)
        pos = n
        accepted = 0
        for i in range(n):
            tok = ids[b * n + i]
            ok = False
            if tok >= 0 and tok < vocab:
                u, _, _, _ = philox_word0(k0, k1, c0, c1, b, i)
                ok = accept(u, target[(o0 + i) * vocab + tok], draft[(b * n + i) * vocab + tok])
            if not ok and pos == n:
                pos = i
            if ok:
                accepted += 1
            if pos == n:
                out[o0 + i] = tok
        acc_num[b] += accepted
        emit_num[b] += pos
        tb = (o0 + pos) * vocab
        diff = pos < n
        db = (b * n + (pos if diff else 0)) * vocab
        m = 0.0
        for i in range(vocab):
            m = max(m, clean(target[tb + i]))
            if diff:
                m = max(m, clean(draft[db + i]))
        token = 0
        if m > 0.0:
            f, e = math.frexp(m)  # 2^(e-1) <= m < 2^e
            scale = 1.0
            for _ in range(abs(_F - e)):
                scale = scale * 2.0 if _F - e > 0 else scale * 0.5
            total = 0
            for i in range(vocab):
                total += residual(target, draft, tb, db, i, scale, diff)
            if total == 0 and diff:  # p <= q everywhere at this resolution: draw from p
                diff = False
                for i in range(vocab):
                    total += residual(target, draft, tb, db, i, scale, diff)
            if total > 0:
                u, _, _, _ = philox_word0(k0, k1, c0, c1, b, n)
                t = mul_frac(total, u)
                run = 0
                for i in range(vocab):
                    run += residual(target, draft, tb, db, i, scale, diff)
                    if run > t:
                        token = i
                        break
        out[o0 + pos] = token
        for i in range(pos + 1, n + 1):
            out[o0 + i] = -1

    def config(args: Any) -> Any:
        nb = args[4].shape[0]
        return ((nb + 31) // 32,), (32,)

    return k, config


_EXP2_COEFS = (4294967296, 2977043887, 1031777011, 238307466, 41555748, 5354899, 928268)  # sp_exp2_fix's
_LOG2E = 1.44269502162933349609375  # SP_LOG2E: log2(e) rounded to float32


def _exp_helpers(cuda: Any) -> Any:
    import numba

    mul_frac = _helpers(cuda)[1]

    @cuda.jit(device=True)
    def f32(v):
        # round a float64 to float32 and back: a float32 +, -, *, / done in float64 and rounded once is the
        # correctly rounded float32 result (53 >= 2 * 24 + 2 bits), so this reproduces the kernel's __f*_rn, and no
        # compiler can contract it into an FMA across the rounding
        return numba.float64(numba.float32(v))

    @cuda.jit(device=True)
    def exp_mass(x, mx, c):
        # sp_exp_mass: f = (x - mx) * c in float32, n = floor(f), r = f - n, R = trunc(r 2^32), integer Horner
        f = f32(f32(numba.float64(x) - numba.float64(mx)) * numba.float64(c))
        if not f >= -40.0:
            return 0
        fl = math.floor(f)
        r = f32(f - fl)
        R = numba.int64(r * 4294967296.0)  # exact product; truncation (r >= 0)
        if R > _M32:
            R = _M32
        acc = numba.int64(928268)
        acc = 5354899 + mul_frac(acc, R)
        acc = 41555748 + mul_frac(acc, R)
        acc = 238307466 + mul_frac(acc, R)
        acc = 1031777011 + mul_frac(acc, R)
        acc = 2977043887 + mul_frac(acc, R)
        acc = 4294967296 + mul_frac(acc, R)
        sh = numba.int64(fl) + 8  # n + SP_F - 32
        return acc << sh if sh >= 0 else acc >> (-sh)

    @cuda.jit(device=True)
    def lkept(vals, base, n, lo_v, mx, c):
        acc = 0
        for i in range(n):
            x = vals[base + i]
            if x >= lo_v:
                acc += exp_mass(x, mx, c)
        return acc

    @cuda.jit(device=True)
    def ltop_p_value(vals, base, n, lo_v, target, mx, c):
        # the largest logit v >= lo_v whose mass at or above v (among logits >= lo_v) reaches target
        hi = math.inf
        first = True
        while True:
            v = -math.inf
            found = False
            for i in range(n):
                x = vals[base + i]
                if x >= lo_v and (first or x < hi) and (not found or x > v):
                    v = x
                    found = True
            if not found:
                return lo_v
            if lkept(vals, base, n, v, mx, c) >= target:
                return v
            hi = v
            first = False

    return exp_mass, lkept, ltop_p_value


def _reject_helpers(cuda: Any) -> Any:
    """The rejection sampling with two pivots (sp_reject) one thread a row: the draws and counts in values, the
    pivots' keys (the fp32 bits, sign-flipped for logits) by arithmetic, one key a round."""
    import numba

    philox_word0, mul_frac, clean, _, mass = _helpers(cuda)[:5]
    exp_mass = _exp_helpers(cuda)[0]

    @cuda.jit(device=True)
    def fbits(x):
        # the fp32 bits of x >= 0 (a float32 value): subnormals x * 2^149, normals (E + 127) << 23 | mantissa
        if x == 0.0:
            return 0
        if x == math.inf:
            return 0x7F800000
        if x < 1.1754943508222875e-38:  # 2^-126
            tiny = 1.0
            for _ in range(149):
                tiny *= 2.0
            return numba.int64(x * tiny)
        s = 1.0
        e = 0
        while x >= 2.0 * s:
            s *= 2.0
            e += 1
        while x < s:
            s *= 0.5
            e -= 1
        return ((e + 127) << 23) | numba.int64((x / s - 1.0) * 8388608.0)

    @cuda.jit(device=True)
    def bits_value(k):
        # the float32 value of the bits k (finite, >= 0)
        ex = k >> 23
        frac = numba.float64(k & 0x7FFFFF)
        if ex == 0:
            v = frac
            for _ in range(149):
                v *= 0.5
            return v
        v = 1.0 + frac / 8388608.0
        for _ in range(abs(ex - 127)):
            v = v * 2.0 if ex > 127 else v * 0.5
        return v

    @cuda.jit(device=True)
    def key_of(x, logits):
        if not logits:
            return fbits(clean(x))
        if x == 0.0:
            return 0x80000000
        if x > 0.0:
            return 0x80000000 | fbits(x)
        return 0x7FFFFFFF - fbits(-x)

    @cuda.jit(device=True)
    def value_of(k, logits):
        if not logits:
            return bits_value(k)
        if k >= 0x80000000:
            return bits_value(k - 0x80000000)
        return -bits_value(0x7FFFFFFF - k)

    @cuda.jit(device=True)
    def wmass(x, logits, mx, c, scale):
        return exp_mass(x, mx, c) if logits else mass(x, scale)

    @cuda.jit(device=True)
    def cand(x, logits, lo_v, strict):
        # a candidate of the draw: above lo_v (strict) or at or above it; a probability also > 0
        v = x if logits else clean(x)
        if not logits and not v > 0.0:
            return False
        return v > lo_v if strict else v >= lo_v

    @cuda.jit(device=True)
    def reject(vals, base, n, logits, lo_v, strict, S, kc, target, s0, s1, o0, o1, b, mx, c, scale):
        # kc / target: 2^62 for a filter that is off. The row's maximum key is hi at first.
        hi = key_of(mx, logits)
        rnd = 0
        while True:
            u, _, _, _ = philox_word0(s0, s1, o0, o1, b, rnd)
            t = mul_frac(S, u)
            acc = 0
            x = -1
            for i in range(n):
                if cand(vals[base + i], logits, lo_v, strict):
                    acc += wmass(vals[base + i], logits, mx, c, scale)
                    if acc > t:
                        x = i
                        break
            if x < 0:
                return -1
            k0 = key_of(vals[base + x], logits)
            if k0 >= hi:
                return x
            k1 = k0 + 1 + ((hi - k0 - 1) >> 1)
            if logits and k1 == 0x7FFFFFFF:
                k1 = 0x80000000
            v0 = value_of(k0, logits)
            v1 = value_of(k1, logits)
            c0 = 0
            c1 = 0
            m0 = 0
            m1 = 0
            for i in range(n):
                y = vals[base + i] if logits else clean(vals[base + i])
                if y > v0:
                    w = wmass(vals[base + i], logits, mx, c, scale)
                    c0 += 1
                    m0 += w
                    if y > v1:
                        c1 += 1
                        m1 += w
            if c0 < kc and m0 < target:
                return x
            strict = True
            if c1 < kc and m1 < target:
                lo_v = v0
                hi = k1
                S = m0
            else:
                lo_v = v1
                S = m1
            rnd += 1

    return reject, cand, wmass


@reference("sampling_exp_mass")
def _exp_mass(cuda: Any) -> Any:
    exp_mass = _exp_helpers(cuda)[0]

    @cuda.jit
    def k(x, out, n, mx, c):
        i = cuda.grid(1)
        if i < n:
            out[i] = exp_mass(x[i], mx, c)

    def config(args: Any) -> Any:
        return ((args[2] + 63) // 64,), (64,)

    return k, config


@reference("sampling_from_logits", "sampling_from_logits_bf16", "sampling_from_logits_f16")
def _sampling_logits(cuda: Any) -> Any:
    import numba

    (philox_word0, mul_frac, clean, row_scale, mass, kth_largest, top_p_value, kept_mass, target,
     row_bad) = _helpers(cuda)
    exp_mass, lkept, ltop_p_value = _exp_helpers(cuda)
    reject = _reject_helpers(cuda)[0]

    @cuda.jit
    def k(logits, out, valid, indices, top_k_arr, top_p_arr, temp_arr, seed_arr, offset_arr, vocab, flags,
          top_k_val, top_p_val, c_val, seed_lo, seed_hi, offset_lo, offset_hi, ws, tickets):  # ws, tickets: as _sampling's
        b = cuda.grid(1)
        if b >= out.shape[0]:
            return
        r = indices[b] if flags & 1 else b
        base = r * vocab
        out[b] = 0
        valid[b] = 0
        # c = log2(e) / T: one float32 division for a per-row T (the kernel's __fdiv_rn), else the host's
        c = numba.float64(numba.float32(numba.float64(_LOG2E) / numba.float64(temp_arr[b]))) if flags & 1024 \
            else numba.float64(numba.float32(c_val))
        mx = -math.inf
        for i in range(vocab):
            x = logits[base + i]
            if not x < math.inf:
                return  # a NaN or +inf logit: no distribution
            mx = max(mx, x)
        if not (mx > -math.inf and c >= 0.0 and c < math.inf):
            return
        lo_v = -math.inf  # keep x >= lo_v (-inf entries are kept with mass 0)
        kc = _OFF
        if flags & 2:
            kk = top_k_arr[b] if flags & 32 else top_k_val
            if kk > 0 and kk < vocab:
                kc = kk
        big = 0.0
        if flags & 4:
            p = numba.float32(top_p_arr[b] if flags & 64 else top_p_val)
            if p < 1.0:
                big = p
        s0 = numba.int64(seed_arr[2 * b]) if flags & 256 else seed_lo
        s1 = numba.int64(seed_arr[2 * b + 1]) if flags & 256 else seed_hi
        o0 = numba.int64(offset_arr[2 * b]) if flags & 512 else offset_lo
        o1 = numba.int64(offset_arr[2 * b + 1]) if flags & 512 else offset_hi
        if kc == _OFF and big == 0.0:
            total = lkept(logits, base, vocab, lo_v, mx, c)
            u, _, _, _ = philox_word0(s0, s1, o0, o1, b, 0)
            t = mul_frac(total, u)
            acc = 0
            for i in range(vocab):
                x = logits[base + i]
                if x >= lo_v:
                    acc += exp_mass(x, mx, c)
                    if acc > t:
                        out[b] = i
                        valid[b] = 1
                        return
            return
        if kc != _OFF and big != 0.0 and flags & 16:  # top-k first: the draws start in the top-k set
            v, ok = kth_largest(logits, base, vocab, kc, True)
            lo_v = v
            kc = _OFF
        S = lkept(logits, base, vocab, lo_v, mx, c)
        tg = _OFF
        if big != 0.0:
            tg = target(S, big)  # joint: lo_v = -inf, the whole row's mass; top-k first: the top-k set's
        x = reject(logits, base, vocab, True, lo_v, False, S, kc, tg, s0, s1, o0, o1, b, mx, c, 1.0)
        if x >= 0:
            out[b] = x
            valid[b] = 1

    def config(args: Any) -> Any:
        n = args[1].shape[0]
        return ((n + 31) // 32,), (32,)

    return k, config


@reference("sampling_softmax", "sampling_softmax_bf16", "sampling_softmax_f16")
def _softmax(cuda: Any) -> Any:
    @cuda.jit
    def k(logits, out, temp_arr, vocab, flags, c_val):
        b = cuda.grid(1)
        if b * vocab >= out.shape[0]:
            return
        base = b * vocab
        c = _LOG2E / temp_arr[b] if flags & 1 else c_val
        m = -math.inf
        nan = False
        for i in range(vocab):
            x = logits[base + i]
            if not x < math.inf:
                nan = True
            elif x > m:
                m = x
        d = 0.0
        for i in range(vocab):
            x = logits[base + i]
            if x > -math.inf:
                d += 2.0 ** ((x - m) * c)
        for i in range(vocab):
            x = logits[base + i]
            if nan or d == 0.0:
                out[base + i] = math.nan
            else:
                out[base + i] = 2.0 ** ((x - m) * c) / d if x > -math.inf else 0.0

    def config(args: Any) -> Any:
        n = args[1].shape[0] // max(1, args[3])
        return ((n + 31) // 32,), (32,)

    return k, config
