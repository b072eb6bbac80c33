"""Difftest cases for kernels_cu/sampling.cu, plus the NumPy references (float64 / exact integers).

Samples are compared exactly (tolerance 0): the NumPy reference draws the same Philox word and
applies the documented rule (fixed-point mass, thresholds on values, inverse CDF) with sorting,
an independent third implementation. Renorm / mask outputs are compared in float64.
"""
from __future__ import annotations

from typing import Any, Iterator

import numpy as np

from ..case import Case, register_cases

F = 40
_M32 = np.uint64(0xFFFFFFFF)


# --------------------------------------------------------------------------- NumPy references
def np_philox(seed: Any, offset: Any, rows: np.ndarray) -> np.ndarray:
    """(n, 4) uint32 Philox4x32-10 blocks: key (seed lo, hi), counter (offset lo, hi, row, 0); seed / offset
    scalars or per-row arrays."""
    rows = np.asarray(rows, np.uint64)
    s = np.broadcast_to(np.asarray(seed, dtype=np.uint64) if not isinstance(seed, int) else np.uint64(seed % 2**64),
                        rows.shape)
    o = np.broadcast_to(np.asarray(offset, dtype=np.uint64) if not isinstance(offset, int)
                        else np.uint64(offset % 2**64), rows.shape)
    k0, k1 = s & _M32, s >> np.uint64(32)
    c = [o & _M32, o >> np.uint64(32), rows & _M32, np.zeros_like(rows)]
    for r in range(10):
        if r:
            k0 = (k0 + np.uint64(0x9E3779B9)) & _M32
            k1 = (k1 + np.uint64(0xBB67AE85)) & _M32
        p0 = np.uint64(0xD2511F53) * c[0]
        p1 = np.uint64(0xCD9E8D57) * c[2]
        c = [(p1 >> np.uint64(32)) ^ c[1] ^ k0, p1 & _M32, (p0 >> np.uint64(32)) ^ c[3] ^ k1, p0 & _M32]
    return np.stack(c, 1).astype(np.uint32)


def _clean(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float64)
    return np.where((x > 0) & np.isfinite(x), x, 0.0)


def _bad(x: np.ndarray) -> bool:
    """A NaN, inf or negative entry: the row is no distribution (no token; the renorm ops give a NaN row)."""
    x = np.asarray(x, np.float64)
    return bool((~((x >= 0) & (x < np.inf))).any())


def np_mass(row: np.ndarray) -> np.ndarray:
    """Fixed-point mass floor(p * 2^(40 - e)) of a cleaned row (2^(e-1) <= max < 2^e), as Python-exact int64."""
    m = row.max()
    if m == 0:
        return np.zeros(row.shape, np.int64)
    e = int(np.frexp(m)[1])  # m = f * 2^e, f in [0.5, 1)
    return np.floor(np.ldexp(row, F - e)).astype(np.int64)


def _kth(vals: np.ndarray, k: int) -> float:
    return float(np.sort(vals)[::-1][k - 1])


def _top_p_value(row: np.ndarray, q: np.ndarray, base: float, p: float) -> float:
    """Largest value v >= base (v > 0) with mass(row >= v, row >= base) >= ceil(floor(p 2^32) S / 2^32)."""
    sel = (row >= base) & (row > 0)
    total = int(q[sel].sum())
    big = max(1, int(np.floor(np.float64(np.float32(p)) * 2.0**32)))
    need = -(-(total * big) // 2**32)
    for v in np.unique(row[sel])[::-1]:
        if int(q[sel & (row >= v)].sum()) >= need:
            return float(v)
    return base


def _row_word(seed: Any, offset: Any, b: int, j: int) -> int:
    """Word 0 of Philox at counter (offset, row b, j) under row b's seed (seed / offset scalars or per-row arrays)."""
    pick = lambda v: int(v[b]) if np.ndim(v) else int(v)  # noqa: E731
    return _philox_word(pick(seed) % 2**64, pick(offset) % 2**64, b, j)


def _top_p_big(p: Any) -> int:
    """top_p as the kernel's integer P = floor(top_p * 2^32) >= 1 (top_p < 1)."""
    return max(1, int(np.floor(np.float64(np.float32(p)) * 2.0**32)))


def np_reject(keys: np.ndarray, q: np.ndarray, lo: int, kc: int | None, target: int | None,
              word: Any, logits: bool = False) -> tuple[int, int, int]:
    """The rejection sampling with two pivots (kernels_cu/sampling.cu, sp_reject) over integer keys (ordered as the
    values) and exact masses: (token, draws, count reads). Round j draws with word(j) from the entries with key >= lo
    by the inverse CDF; the draw is kept at once when its key reaches hi (the row maximum's at first), else one
    read counts the entries above its key key0 and above key1 = the middle of [key0 + 1, hi] and decides: keep it
    (fewer than kc above key0 and less mass than target), or narrow [lo, hi] to [key0 + 1, key1] or [key1 + 1, hi]."""
    keys = keys.astype(np.int64)
    hi = int(keys.max())
    big = 1 << 64
    kc = big if kc is None else int(kc)
    target = big if target is None else int(target)
    reads = 0
    for rnd in range(64):
        w = np.where(keys >= lo, q, 0)
        t = (int(w.sum()) * int(word(rnd))) >> 32
        x = int(np.argmax(np.cumsum(w) > t))
        key0 = int(keys[x])
        if key0 >= hi:
            return x, rnd + 1, reads
        key1 = key0 + 1 + ((hi - key0 - 1) >> 1)
        if logits and key1 == 0x7FFFFFFF:
            key1 = 0x80000000
        reads += 1
        g0, g1 = keys > key0, keys > key1
        if int(g0.sum()) < kc and int(q[g0].sum()) < target:
            return x, rnd + 1, reads
        if int(g1.sum()) < kc and int(q[g1].sum()) < target:
            lo, hi = key0 + 1, key1
        else:
            lo = key1 + 1
    raise AssertionError("the rejection rounds are bounded by the 32-bit keys")


def _prob_keys(row: np.ndarray) -> np.ndarray:
    """The kernel's probability keys: the fp32 bits of the cleaned values (they order like the values)."""
    return np.asarray(row, np.float32).view(np.uint32).astype(np.int64)


def np_logit_keys(x: np.ndarray) -> np.ndarray:
    """sp_logit_key: sign-flipped fp32 bits (NaN 0, -0 == +0)."""
    x = np.asarray(x, np.float32)
    b = x.view(np.uint32).astype(np.int64)
    k = np.where(b & 0x80000000, (~b) & 0xFFFFFFFF, b | 0x80000000)
    k = np.where(x == 0, 0x80000000, k)
    return np.where(np.isnan(x), 0, k)


def np_sample(probs: np.ndarray, seed: Any, offset: Any = 0, *, top_k: Any = None, top_p: Any = None,
              min_p: Any = None, order: str = "top_k_first", indices: Any = None,
              rounds: list | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(samples int32, valid bool) by the documented rule, for every output row. Without top-k / top-p: the inverse
    CDF over the min-p set with one Philox word; with them: np_reject from the min-p set (top-k first with top-p:
    from the top-k set, the threshold by sorting). rounds: gets (draws, count reads) per filtered row."""
    probs = np.asarray(probs, np.float32)
    n = probs.shape[0] if indices is None else len(indices)
    idx = np.arange(n) if indices is None else np.asarray(indices)
    per = lambda v, b: None if v is None else (v[b] if np.ndim(v) else v)  # noqa: E731
    out, valid = np.zeros(n, np.int32), np.zeros(n, bool)
    for b in range(n):
        row = _clean(probs[idx[b]])
        if row.max() == 0 or _bad(probs[idx[b]]):
            continue
        q = np_mass(row)
        keys = _prob_keys(row)
        lo = 1  # keys >= 1: the entries > 0
        mp = per(min_p, b)
        if mp is not None:
            floor = np.float32(np.float32(row.max()) * np.float32(min(float(np.float32(mp)), 1.0)))
            lo = max(lo, int(_prob_keys(_clean(np.array([floor])))[0]))  # the key of a NaN or negative floor: 0
        k = per(top_k, b)
        kc = int(k) if k is not None and 0 < int(k) < row.size else None
        p = per(top_p, b)
        big = _top_p_big(p) if p is not None and np.float32(p) < 1 else None
        word = lambda j, b=b: _row_word(seed, offset, b, j)  # noqa: E731
        if kc is None and big is None:
            w = np.where(keys >= lo, q, 0)
            t = (int(w.sum()) * word(0)) >> 32
            out[b], valid[b] = int(np.argmax(np.cumsum(w) > t)), True
            continue
        if kc is not None and big is not None and order == "top_k_first":
            lo = max(lo, int(_prob_keys(np.array([_kth(row, kc)]))[0]))
            kc = None
            total = int(q[keys >= lo].sum())
        else:
            total = int(q[keys >= (lo if order == "top_k_first" else 1)].sum())
        target = None if big is None else -(-(total * big) // 2**32)
        tok, draws, reads = np_reject(keys, q, lo, kc, target, word)
        if rounds is not None:
            rounds.append((draws, reads))
        out[b], valid[b] = tok, True
    return out, valid


# sp_exp_mass's polynomial: 2^32 * 2^r, r = R / 2^32, by Horner in 32-bit fixed point (the constant 2^32 first)
EXP2_COEFS = (4294967296, 2977043887, 1031777011, 238307466, 41555748, 5354899, 928268)
LOG2E = np.float32(1.4426950408889634)  # SP_LOG2E, 0x3FB8AA3B


def np_logit_scale(temperature: Any, n: int) -> np.ndarray:
    """(n,) float32 c = log2(e) / T per output row: one float32 division, as the op (scalar) and kernel (array)."""
    t = np.broadcast_to(np.asarray(1.0 if temperature is None else temperature, np.float32), (n,))
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        return (LOG2E / t).astype(np.float32)


def np_exp_mass(x: np.ndarray, mx: float, c: float) -> np.ndarray:
    """sp_exp_mass in NumPy: f = (x - mx) * c in float32 (IEEE, each operation rounded), n = floor(f), r = f - n
    (float32), R = trunc(r * 2^32) (clamped to 2^32 - 1), the fixed-point polynomial, shifted by n + 8. int64."""
    with np.errstate(invalid="ignore", over="ignore"):
        x = np.asarray(x, np.float32)
        f = (x - np.float32(mx)) * np.float32(c)  # float32 operands: float32 results, correctly rounded
        ok = f >= np.float32(-F)
        f = np.where(ok, f, np.float32(0.0)).astype(np.float32)
        fl = np.floor(f)
        r = (f - fl).astype(np.float32)
    R = np.minimum((r.astype(np.float64) * 2.0**32).astype(np.uint64), np.uint64(0xFFFFFFFF))
    acc = np.full(x.shape, EXP2_COEFS[-1], np.uint64)
    for a in EXP2_COEFS[-2::-1]:  # floor(acc * R / 2^32) without a product above 2^64
        acc = np.uint64(a) + (acc >> np.uint64(32)) * R + (((acc & _M32) * R) >> np.uint64(32))
    sh = fl.astype(np.int64) + (F - 32)
    out = np.where(sh >= 0, acc << np.maximum(sh, 0).astype(np.uint64), acc >> np.maximum(-sh, 0).astype(np.uint64))
    return np.where(ok, out, np.uint64(0)).astype(np.int64)


def np_sample_logits(logits: np.ndarray, seed: Any, offset: Any = 0, *, temperature: Any = None, top_k: Any = None,
                     top_p: Any = None, order: str = "top_k_first", indices: Any = None
                     ) -> tuple[np.ndarray, np.ndarray]:
    """(samples int32, valid bool) of sampling_from_logits / top_k_top_p_sampling_from_logits by the documented
    rule: np_exp_mass as the mass, top-k on the logits, top-p on the mass, the inverse CDF over one Philox word."""
    logits = np.asarray(logits, np.float32)
    n = logits.shape[0] if indices is None else len(indices)
    idx = np.arange(n) if indices is None else np.asarray(indices)
    cs = np_logit_scale(temperature, n)
    per = lambda v, b: None if v is None else (v[b] if np.ndim(v) else v)  # noqa: E731
    out, valid = np.zeros(n, np.int32), np.zeros(n, bool)
    for b in range(n):
        row = logits[idx[b]]
        c = cs[b]
        if not (row < np.inf).all() or not (row.max() > -np.inf) or not (c >= 0 and c < np.inf):
            continue  # a NaN / +inf logit, a row of -inf, no scale: no distribution
        q = np_exp_mass(row, float(row.max()), float(c))
        keys = np_logit_keys(row)
        word = lambda j, b=b: _row_word(seed, offset, b, j)  # noqa: E731
        k = per(top_k, b)
        kc = int(k) if k is not None and 0 < int(k) < row.size else None
        p = per(top_p, b)
        big = _top_p_big(p) if p is not None and np.float32(p) < 1 else None
        lo = 1
        if kc is None and big is None:
            w = np.where(keys >= lo, q, 0)
            t = (int(w.sum()) * word(0)) >> 32
            out[b], valid[b] = int(np.argmax(np.cumsum(w) > t)), True
            continue
        if kc is not None and big is not None and order == "top_k_first":
            lo = int(np_logit_keys(np.array([_kth(row, kc)], np.float32))[0])
            kc = None
        target = None if big is None else -(-(int(q[keys >= lo].sum()) * big) // 2**32)
        out[b], valid[b] = np_reject(keys, q, lo, kc, target, word, logits=True)[0], True
    return out, valid


def np_softmax(logits: np.ndarray, temperature: Any = None) -> np.ndarray:
    """float64 softmax(logits / T) per row (T a scalar or a per-row array)."""
    x = np.asarray(logits, np.float64)
    t = np.broadcast_to(np.asarray(1.0 if temperature is None else temperature, np.float64), (x.shape[0],))
    y = (x - x.max(1, keepdims=True)) / t[:, None]
    e = np.exp(y)
    return e / e.sum(1, keepdims=True)


def np_filtered_dist(row: np.ndarray, *, top_k: int | None = None, top_p: float | None = None,
                     min_p: float | None = None, order: str = "top_k_first") -> np.ndarray:
    """float64 distribution the sampling ops draw from (the exact filter, no fixed point)."""
    r = _clean(row)
    keep = r > 0
    if min_p is not None:
        keep &= r >= min_p * r.max()
    if top_k is not None and 0 < top_k < r.size:
        keep &= r >= _kth(r, top_k)
    if top_p is not None and top_p < 1:
        base = keep.copy() if order == "top_k_first" else (r > 0)
        total = r[base].sum()
        for v in np.unique(r[base])[::-1]:
            if r[base & (r >= v)].sum() >= top_p * total * (1 - 1e-12):
                keep &= r >= v
                break
    d = np.where(keep, r, 0.0)
    return d / d.sum()


def np_top_k_renorm(probs: np.ndarray, top_k: Any) -> np.ndarray:
    probs = np.asarray(probs, np.float64)
    out = np.empty_like(probs)
    for b, row in enumerate(probs):
        k = int(top_k[b]) if np.ndim(top_k) else int(top_k)
        r = _clean(row)
        if k <= 0 or k >= r.size:
            out[b] = row
            continue
        if _bad(row):
            out[b] = np.nan
            continue
        if r.max() == 0:
            out[b] = row
            continue
        keep = (r >= _kth(r, k)) & (r > 0)
        out[b] = np.where(keep, r, 0.0) / r[keep].sum()
    return out


def np_top_p_renorm(probs: np.ndarray, top_p: Any) -> np.ndarray:
    probs = np.asarray(probs, np.float64)
    out = np.zeros_like(probs)
    for b, row in enumerate(probs):
        p = float(top_p[b]) if np.ndim(top_p) else float(top_p)
        r = _clean(row)
        if _bad(row):
            out[b] = np.nan
            continue
        if r.max() == 0:
            continue
        d = np_filtered_dist(r, top_p=p)
        out[b] = d
    return out


def np_top_k_mask(logits: np.ndarray, top_k: Any) -> np.ndarray:
    x = np.asarray(logits, np.float64)
    out = x.copy()
    for b, row in enumerate(x):
        k = int(top_k[b]) if np.ndim(top_k) else int(top_k)
        num = row[~np.isnan(row)]
        if k <= 0 or k >= row.size or num.size < k:
            continue
        v = _kth(num, k)
        out[b] = np.where(row >= v, row, -np.inf)
    return out


def np_chain_speculative(draft: np.ndarray, ids: np.ndarray, target: np.ndarray, seed: Any, offset: Any = 0
                         ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(output_token_ids, accepted, emitted) of chain_speculative_sampling by the documented rule, in exact
    rationals (fractions.Fraction of the float values) and Python integers: decision i of request b accepts iff
    r * q < p * 2^32 (r the Philox word at counter (offset, b, i)); the final draw (word at (offset, b, n)) inverts
    the CDF of max(0, mass(p) - mass(q)), the fixed-point mass at the binade of the larger row maximum."""
    from fractions import Fraction

    draft, target = np.asarray(draft, np.float32), np.asarray(target, np.float32)
    batch, n, vocab = draft.shape
    out = np.full((batch, n + 1), -1, np.int32)
    acc, emit = np.zeros(batch, np.int32), np.zeros(batch, np.int32)
    for b in range(batch):
        sb = int(seed[b] if np.ndim(seed) else seed) % 2**64
        ob = int(offset[b] if np.ndim(offset) else offset) % 2**64

        def word(j: int) -> int:
            return _philox_word(sb, ob, b, j)

        pos = n
        for i in range(n):
            x = int(ids[b, i])
            ok = False
            if 0 <= x < vocab:
                p, q = float(_clean(target[b, i, x])), float(_clean(draft[b, i, x]))
                ok = Fraction(word(i)) * Fraction(q) < Fraction(p) * 2**32
            if not ok and pos == n:
                pos = i
            acc[b] += ok
            if pos == n:
                out[b, i] = x
        emit[b] = pos
        tp = _clean(target[b, pos])
        dq = _clean(draft[b, pos]) if pos < n else np.zeros(vocab)
        m = max(tp.max(), dq.max())
        token = 0
        if m > 0:
            e = int(np.frexp(m)[1])
            qp = [int(v) for v in np.floor(np.ldexp(tp, F - e))]
            qq = [int(v) for v in np.floor(np.ldexp(dq, F - e))]
            w = [max(0, a - c) for a, c in zip(qp, qq)]
            if sum(w) == 0:
                w = qp
            total = sum(w)
            if total:
                t = (total * word(n)) >> 32
                run = 0
                for i, v in enumerate(w):
                    run += v
                    if run > t:
                        token = i
                        break
        out[b, pos] = token
    return out, acc, emit


def _philox_word(seed: int, offset: int, row: int, j: int) -> int:
    """Word 0 of Philox4x32-10 at counter (offset lo, offset hi, row, j), key (seed lo, seed hi), in Python ints."""
    m = 0xFFFFFFFF
    k0, k1 = seed & m, seed >> 32
    c = [offset & m, offset >> 32, row & m, j & m]
    for r in range(10):
        if r:
            k0, k1 = (k0 + 0x9E3779B9) & m, (k1 + 0xBB67AE85) & m
        p0, p1 = 0xD2511F53 * c[0], 0xCD9E8D57 * c[2]
        c = [(p1 >> 32) ^ c[1] ^ k0, p1 & m, (p0 >> 32) ^ c[3] ^ k1, p0 & m]
    return c[0]


# --------------------------------------------------------------------------- inputs and cases
_SUFFIX = {"f32": "", "bf16": "_bf16", "f16": "_f16"}  # the kernels' instantiations (PK_IO_KERNELS)


def make_probs(rng: np.random.Generator, batch: int, vocab: int, kind: str = "f32", ties: bool = False,
               zeros: int = 2, poison: tuple[float, ...] = ()) -> np.ndarray:
    from ...arrays import bfloat16

    x = rng.random((batch, vocab)) ** 3
    if ties:
        x = np.round(x * 6) / 6
    for b in range(batch):
        x[b, rng.integers(0, vocab, zeros)] = 0
    x = x / x.sum(1, keepdims=True)
    for b, v in zip(range(1, batch), poison):  # rows 1, 2, ...: one entry that is no probability
        x[b, rng.integers(0, vocab)] = v
    # bfloat16() only for bf16: it needs ml_dtypes, which the f32 and f16 cases must not
    return x.astype(bfloat16() if kind == "bf16" else np.float16 if kind == "f16" else np.float32)


def _sampling_case(rng: np.random.Generator, op: str, kind: str, batch: int, vocab: int, ties: bool = False,
                   note: str = "", poison: tuple[float, ...] = (), ctas: int | None = None, **params: Any) -> Case:
    from ... import ops

    probs = make_probs(rng, batch, vocab, kind, ties, poison=poison)
    seed, offset = int(rng.integers(0, 2**63)), int(rng.integers(0, 1000))
    fn = getattr(ops, op)
    args = [params[k] for k in ("top_k", "top_p", "min_p") if k in params]
    order = params.get("filter_apply_order", "top_k_first")
    extra = {"filter_apply_order": order} if op == "top_k_top_p_sampling_from_probs" else {}
    if ctas is not None:  # rows split over that many CTAs (sp_split_last): the reference's tokens all the same
        extra["ctas_per_row"] = ctas

    def run(backend: str) -> dict[str, Any]:
        s, v = fn(probs, *args, seed=seed, offset=offset, return_valid=True, backend=backend, **extra)
        return {"samples": np.asarray(s), "valid": np.asarray(v).astype(np.int32)}

    def ref() -> dict[str, Any]:
        s, v = np_sample(np.asarray(probs, np.float32), seed, offset, top_k=params.get("top_k"),
                         top_p=params.get("top_p"), min_p=params.get("min_p"), order=order)
        return {"samples": s, "valid": v.astype(np.int32)}

    shape = f"B{batch}-V{vocab}" + "".join(f"-{k}{'arr' if np.ndim(v) else v}" for k, v in params.items())
    bad = f"-bad{list(poison)}" if poison else ""
    split = "" if ctas is None else f"-ctas{ctas}"
    return Case(op=op, dtype=kind, shape=shape + ("-ties" if ties else "") + bad + split,
                kernels=("sampling_from_probs" + _SUFFIX[kind],), run=run, reference=ref,
                note=note)


def make_logits(rng: np.random.Generator, batch: int, vocab: int, kind: str = "f32", ties: bool = False,
                poison: tuple[float, ...] = ()) -> np.ndarray:
    """Logits with a spread of 3 (some entries far below the maximum, at the fixed point's end), a -inf entry a row,
    ties (rounded) on request; rows 1, 2, ... get one poison entry each (NaN, +inf: no distribution)."""
    from ...arrays import bfloat16

    x = rng.standard_normal((batch, vocab)) * 3.0
    if ties:
        x = np.round(x)
    x[np.arange(batch), rng.integers(0, vocab, batch)] = -np.inf
    for b, v in zip(range(1, batch), poison):
        x[b, rng.integers(0, vocab)] = v
    return x.astype(bfloat16() if kind == "bf16" else np.float16 if kind == "f16" else np.float32)


def _logits_case(rng: np.random.Generator, op: str, kind: str, batch: int, vocab: int, ties: bool = False,
                 poison: tuple[float, ...] = (), temperature: Any = None, ctas: int | None = None,
                 **params: Any) -> Case:
    from ... import ops

    logits = make_logits(rng, batch, vocab, kind, ties, poison)
    seed, offset = int(rng.integers(0, 2**63)), int(rng.integers(0, 1000))
    fn = getattr(ops, op)
    args = [params[k] for k in ("top_k", "top_p") if k in params]
    order = params.get("filter_apply_order", "top_k_first")
    extra = {"filter_apply_order": order} if op == "top_k_top_p_sampling_from_logits" else {}
    if ctas is not None:  # as _sampling_case's
        extra["ctas_per_row"] = ctas

    def run(backend: str) -> dict[str, Any]:
        s, v = fn(logits, *args, seed=seed, offset=offset, return_valid=True, temperature=temperature,
                  backend=backend, **extra)
        return {"samples": np.asarray(s), "valid": np.asarray(v).astype(np.int32)}

    def ref() -> dict[str, Any]:
        s, v = np_sample_logits(np.asarray(logits, np.float32), seed, offset, temperature=temperature,
                                top_k=params.get("top_k"), top_p=params.get("top_p"), order=order)
        return {"samples": s, "valid": v.astype(np.int32)}

    t = "" if temperature is None else f"-T{'arr' if np.ndim(temperature) else temperature}"
    shape = f"B{batch}-V{vocab}" + "".join(f"-{k}{'arr' if np.ndim(v) else v}" for k, v in params.items()) + t
    bad = f"-bad{list(poison)}" if poison else ""
    split = "" if ctas is None else f"-ctas{ctas}"
    return Case(op=op, dtype=kind, shape=shape + ("-ties" if ties else "") + bad + split,
                kernels=("sampling_from_logits" + _SUFFIX[kind],), run=run, reference=ref)


def _softmax_case(rng: np.random.Generator, kind: str, batch: int, vocab: int, temperature: Any = None) -> Case:
    from ... import ops

    logits = make_logits(rng, batch, vocab, kind)

    def run(backend: str) -> dict[str, Any]:
        return {"probs": np.asarray(ops.softmax(logits, temperature, backend=backend), np.float64)}

    def ref() -> dict[str, Any]:
        return {"probs": np_softmax(np.asarray(logits, np.float32), temperature)}

    t = "" if temperature is None else f"-T{'arr' if np.ndim(temperature) else temperature}"
    return Case(op="softmax", dtype=kind, shape=f"B{batch}-V{vocab}{t}", kernels=("sampling_softmax" + _SUFFIX[kind],),
                run=run, reference=ref)


def _exp_mass_case(rng: np.random.Generator) -> Case:
    from ...launcher import launch

    # logits below the maximum 3 at scales from T = 100 to T = 0.01 and c = 0 (T = inf): f from 0 down past -40;
    # edges: the maximum itself, -0, a value just below it (r rounds up to 1), -inf, NaN
    x = np.concatenate([(rng.standard_normal(1024) * 20).astype(np.float32),
                        np.array([3.0, 0.0, -0.0, np.nextafter(np.float32(3), np.float32(0)), -np.inf, np.nan,
                                  -1e-30, 2.9999], np.float32)])
    x = np.minimum(x, np.float32(3.0)).astype(np.float32)
    scales = [float(np_logit_scale(t, 1)[0]) for t in (100.0, 1.0, 0.7, 0.01)] + [0.0]

    def run(backend: str) -> dict[str, Any]:
        res = {}
        for j, c in enumerate(scales):
            out = np.zeros(x.size, np.uint64)
            launch("sampling_exp_mass", (-(-x.size // 256),), (256,), x, out, x.size, 3.0, c, backend=backend)
            res[f"c{j}"] = out.astype(np.int64)  # <= 2^40
        return res

    def ref() -> dict[str, Any]:
        return {f"c{j}": np_exp_mass(x, 3.0, c) for j, c in enumerate(scales)}

    return Case(op="sampling_exp_mass", dtype="f32", shape=f"n{x.size}-c{len(scales)}", kernels=("sampling_exp_mass",),
                run=run, reference=ref)


def _renorm_case(rng: np.random.Generator, op: str, kind: str, batch: int, vocab: int, param: Any,
                 ties: bool = False, note: str = "", poison: tuple[float, ...] = ()) -> Case:
    from ... import ops

    probs = make_probs(rng, batch, vocab, kind, ties, poison=poison)
    if op == "top_k_mask_logits":
        with np.errstate(divide="ignore"):
            x = np.log(np.asarray(probs, np.float32)).astype(probs.dtype)
        kernel, refn = "sampling_top_k_mask_logits", np_top_k_mask
    else:
        x = probs
        kernel = "sampling_renorm_probs"
        refn = np_top_k_renorm if op == "top_k_renorm_probs" else np_top_p_renorm

    def run(backend: str) -> dict[str, Any]:
        return {"out": np.asarray(getattr(ops, op)(x, param, backend=backend), np.float32)}

    def ref() -> dict[str, Any]:
        return {"out": refn(np.asarray(x, np.float32), param)}

    return Case(op=op, dtype=kind, shape=f"B{batch}-V{vocab}-{'arr' if np.ndim(param) else param}"
                + ("-ties" if ties else "") + (f"-bad{list(poison)}" if poison else ""),
                kernels=(kernel + _SUFFIX[kind],), run=run, reference=ref, note=note)


def make_speculative(rng: np.random.Generator, batch: int, n: int, vocab: int, kind: str = "f32",
                     close: float = 0.5) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(draft_probs, draft_token_ids, target_probs): the draft a mix of the target and noise (close: the target's
    weight, so acceptances and rejections both occur), the drafted tokens drawn from the draft."""
    from ...arrays import bfloat16

    target = make_probs(rng, batch * (n + 1), vocab).astype(np.float64).reshape(batch, n + 1, vocab)
    noise = make_probs(rng, batch * n, vocab).astype(np.float64).reshape(batch, n, vocab)
    draft = close * target[:, :n] + (1 - close) * noise
    ids = np.array([[rng.choice(vocab, p=draft[b, i] / draft[b, i].sum()) for i in range(n)] for b in range(batch)],
                   np.int32).reshape(batch, n)
    dt = bfloat16() if kind == "bf16" else np.float16 if kind == "f16" else np.float32
    return draft.astype(dt), ids, target.astype(dt)


def _speculative_case(rng: np.random.Generator, kind: str, batch: int, n: int, vocab: int, close: float = 0.5,
                      per_row_seed: bool = False) -> Case:
    from ... import ops

    draft, ids, target = make_speculative(rng, batch, n, vocab, kind, close)
    seed: Any = int(rng.integers(0, 2**63))
    offset: Any = int(rng.integers(0, 1000))
    if per_row_seed:
        seed = rng.integers(0, 2**63, batch).astype(np.int64)
        offset = rng.integers(0, 1000, batch).astype(np.int64)
    start = rng.integers(0, 5, batch).astype(np.int32)  # the maybe_output_* arrays are added into

    def run(backend: str) -> dict[str, Any]:
        acc, emit = start.copy(), start.copy()
        out, a, e = ops.chain_speculative_sampling(draft, ids, target, acc, emit, seed=seed, offset=offset,
                                                   backend=backend)
        return {"tokens": np.asarray(out), "accepted": np.asarray(a), "emitted": np.asarray(e)}

    def ref() -> dict[str, Any]:
        out, a, e = np_chain_speculative(np.asarray(draft, np.float32), ids, np.asarray(target, np.float32), seed,
                                         offset)
        return {"tokens": out, "accepted": a + start, "emitted": e + start}

    return Case(op="chain_speculative_sampling", dtype=kind,
                shape=f"B{batch}-n{n}-V{vocab}-close{close}" + ("-rowseed" if per_row_seed else ""),
                kernels=("sampling_chain_speculative" + _SUFFIX[kind],), run=run, reference=ref)


def _philox_case() -> Case:
    from ...launcher import launch

    def run(backend: str) -> dict[str, Any]:
        out = np.zeros(4 * 37, np.uint32)
        launch("sampling_philox", (1,), (256,), out, 37, 0x12345678, 0x9ABCDEF0, 7, 1, backend=backend)
        return {"words": out.reshape(37, 4).astype(np.int64)}

    def ref() -> dict[str, Any]:
        return {"words": np_philox(0x9ABCDEF012345678, (1 << 32) + 7, np.arange(37)).astype(np.int64)}

    return Case(op="sampling_philox", dtype="f32", shape="n37", kernels=("sampling_philox",), run=run, reference=ref)


# the shifts of a finite row maximum's binade span [-88, 188]; 127 / 128 bracket the split of 2^sh in two factors
MASS_SHIFTS = (-88, -30, 0, 40, 126, 127, 128, 150, 188)


def mass_inputs(rng: np.random.Generator, sh: int) -> np.ndarray:
    """float32 values of every kind (random bit patterns: subnormals, NaN, inf, negatives; and edges), the positive
    finite ones brought below 2^(41 - sh) by their exponent alone, as a row's entries sit below its maximum's."""
    x = np.concatenate([rng.integers(0, 2**32, 2048, dtype=np.uint64).astype(np.uint32).view(np.float32),
                        np.array([0.0, -0.0, 1e-45, 3e-45, 2.0**-127, 2.0**-126, 0.5, 1.0, 3.0, 2.0**40,
                                  np.float32(2.0**41) * np.float32(0.99999994), np.nan, np.inf, -1.0], np.float32)])
    pos = np.isfinite(x) & (x > 0)
    m, e = np.frexp(x[pos].astype(np.float64))
    x[pos] = np.ldexp(m, np.minimum(e, 41 - sh)).astype(np.float32)  # x < 2^e <= 2^(41 - sh)
    return x


def _mass_case(rng: np.random.Generator) -> Case:
    from ...launcher import launch

    xs = {sh: mass_inputs(rng, sh) for sh in MASS_SHIFTS}

    def run(backend: str) -> dict[str, Any]:
        res = {}
        for sh, x in xs.items():
            out = np.zeros(x.size, np.uint64)
            launch("sampling_mass", (-(-x.size // 256),), (256,), x, out, x.size, sh, backend=backend)
            res[f"sh{sh}"] = out.astype(np.int64)  # < 2^41
        return res

    def ref() -> dict[str, Any]:
        return {f"sh{sh}": np.floor(np.ldexp(_clean(x).astype(np.float64), sh)).astype(np.int64)
                for sh, x in xs.items()}

    return Case(op="sampling_mass", dtype="f32", shape=f"n{xs[0].size}-sh{len(MASS_SHIFTS)}", kernels=("sampling_mass",),
                run=run, reference=ref)


@register_cases("sampling")
def cases(rng: np.random.Generator) -> Iterator[Case]:
    yield _philox_case()
    yield _mass_case(rng)
    yield _exp_mass_case(rng)
    for kind in ("f32", "bf16", "f16"):
        # vocab 37 (odd: the one-element path), 64 and 96 (16-byte vectors), ties at thresholds
        yield _sampling_case(rng, "sampling_from_probs", kind, 5, 37)
        yield _sampling_case(rng, "top_k_sampling_from_probs", kind, 5, 64, top_k=np.array([1, 3, 5, 64, 0]))
        yield _sampling_case(rng, "top_k_sampling_from_probs", kind, 4, 96, ties=True, top_k=7)
        yield _sampling_case(rng, "top_p_sampling_from_probs", kind, 5, 37, top_p=0.6)
        yield _sampling_case(rng, "top_p_sampling_from_probs", kind, 4, 64, ties=True,
                             top_p=np.array([0.1, 0.5, 0.9, 1.0], np.float32))
        yield _sampling_case(rng, "min_p_sampling_from_probs", kind, 4, 40, min_p=0.2)
        yield _sampling_case(rng, "top_k_top_p_sampling_from_probs", kind, 4, 64, top_k=9, top_p=0.5)
        yield _sampling_case(rng, "top_k_top_p_sampling_from_probs", kind, 4, 37, ties=True, top_k=6, top_p=0.4,
                             filter_apply_order="joint")
        yield _renorm_case(rng, "top_k_renorm_probs", kind, 4, 64, 5)
        yield _renorm_case(rng, "top_k_renorm_probs", kind, 3, 37, np.array([2, 0, 37]), ties=True)
        yield _renorm_case(rng, "top_p_renorm_probs", kind, 4, 64, 0.7)
        yield _renorm_case(rng, "top_p_renorm_probs", kind, 3, 37, np.array([0.3, 1.0, 0.55], np.float32), ties=True)
        yield _renorm_case(rng, "top_k_mask_logits", kind, 4, 64, 6)
        # rows 1..3 hold a NaN, a negative or an inf entry: no token (valid 0), and a NaN row from renorm
        # (top_k off, k = 0 or >= vocab: the row unchanged)
        bad = (float("nan"), -0.25, float("inf"))
        yield _sampling_case(rng, "sampling_from_probs", kind, 4, 64, poison=bad)
        yield _sampling_case(rng, "top_k_sampling_from_probs", kind, 4, 37, poison=bad, top_k=3)
        yield _sampling_case(rng, "top_p_sampling_from_probs", kind, 4, 64, poison=bad, top_p=0.7)
        yield _renorm_case(rng, "top_k_renorm_probs", kind, 4, 37, np.array([3, 2, 0, 5]), poison=bad)
        yield _renorm_case(rng, "top_p_renorm_probs", kind, 4, 64, 0.8, poison=bad)
        yield _renorm_case(rng, "top_k_mask_logits", kind, 3, 37, np.array([1, 0, 12]), ties=True)
        yield _speculative_case(rng, kind, 6, 3, 37)
        # from logits: the fused softmax mass, temperature scalar and per row, NaN / +inf rows without a token
        yield _logits_case(rng, "sampling_from_logits", kind, 5, 37)
        yield _logits_case(rng, "sampling_from_logits", kind, 4, 64, temperature=np.array([0.3, 1.0, 2.5, 0.05],
                                                                                         np.float32))
        yield _logits_case(rng, "sampling_from_logits", kind, 3, 64, poison=(float("nan"), float("inf")))
        yield _logits_case(rng, "top_k_top_p_sampling_from_logits", kind, 4, 64, ties=True, temperature=0.7,
                           top_k=np.array([3, 0, 64, 9]), top_p=0.6)
        yield _logits_case(rng, "top_k_top_p_sampling_from_logits", kind, 4, 37, top_k=5,
                           top_p=np.array([0.2, 0.5, 0.9, 1.0], np.float32), filter_apply_order="joint")
        yield _softmax_case(rng, kind, 3, 37)
        yield _softmax_case(rng, kind, 3, 64, temperature=np.array([0.5, 1.0, 4.0], np.float32))
        yield _speculative_case(rng, kind, 4, 4, 64, close=0.9, per_row_seed=True)
        # rows split over 2 and 7 CTAs (sp_split_last): 9000 entries are 5 chunks of 16-byte loads in f32, 3 in
        # bf16 / f16 (7 CTAs: some own no chunk); 37 is the one-element path; a NaN / +inf row takes no ticket
        yield _sampling_case(rng, "sampling_from_probs", kind, 3, 9000, ctas=2)
        yield _sampling_case(rng, "sampling_from_probs", kind, 4, 9000, ctas=7, poison=(float("nan"),))
        yield _sampling_case(rng, "min_p_sampling_from_probs", kind, 3, 37, ctas=7, min_p=0.3)
        yield _logits_case(rng, "sampling_from_logits", kind, 3, 9000, ctas=7, poison=(float("inf"),),
                           temperature=0.8)
        # top-k / top-p rejection rounds on split rows: round 0 over the CTAs, the later rounds in the last one
        yield _sampling_case(rng, "top_k_sampling_from_probs", kind, 3, 9000, ctas=3, top_k=np.array([1, 40, 0]))
        yield _sampling_case(rng, "top_k_top_p_sampling_from_probs", kind, 3, 9000, ctas=2, top_k=30, top_p=0.4,
                             filter_apply_order="joint")
        yield _logits_case(rng, "top_k_top_p_sampling_from_logits", kind, 3, 9000, ctas=7, top_k=9,
                           top_p=np.array([0.3, 0.9, 1.0], np.float32), filter_apply_order="joint")
    yield _sampling_case(rng, "top_k_top_p_sampling_from_probs", "f32", 2, 5000, top_k=50, top_p=0.9, note="big")
    yield _speculative_case(rng, "f32", 3, 2, 1500, close=0.3)  # rows of three chunks: the draw's walk past one
