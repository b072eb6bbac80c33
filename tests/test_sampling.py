"""Sampling ops (FlashInfer's names): chi-square of many draws against the exact filtered
distribution, exact renorm / mask against NumPy float64, the seed contract, per-row parameters,
argument errors, a 256k-vocabulary row, host == numba token for token, and the SASS facts."""
from __future__ import annotations

import math
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest

from pykern import ArgumentError, ArgumentTypeError, ops
from pykern.arrays import bfloat16
from pykern.difftest.cases.sampling import (make_logits, make_probs, make_speculative, np_chain_speculative,
                                            np_exp_mass, np_filtered_dist, np_logit_scale, np_philox, np_sample,
                                            np_sample_logits, np_softmax, np_top_k_mask, np_top_k_renorm,
                                            np_top_p_renorm)
from pykern.tolerance import tolerance
from sass_helpers import guard, report, source_sass

ROOT = Path(__file__).resolve().parent.parent

# A fixed 12-token row with ties (0.1, 0.1) and (0.05, 0.05) at the filter boundaries and two zeros.
ROW = np.array([0.25, 0.18, 0.12, 0.1, 0.1, 0.07, 0.05, 0.05, 0.04, 0.04, 0.0, 0.0], np.float32)
ROW = (ROW / ROW.sum()).astype(np.float32)
DRAWS = 4000  # rows of one launch: the host backend runs 4000 CTAs in about 7 s


# --------------------------------------------------------------------------- chi-square
def _chi2_sf(x: float, dof: int) -> float:
    """P(X > x) for X ~ chi2(dof): the regularized upper incomplete gamma Q(dof/2, x/2)."""
    a, z = dof / 2.0, x / 2.0
    if z <= 0:
        return 1.0
    lg = math.lgamma(a)
    if z < a + 1:  # series for P
        term = s = 1.0 / a
        n = a
        for _ in range(1000):
            n += 1
            term *= z / n
            s += term
            if term < s * 1e-15:
                break
        return max(0.0, 1.0 - s * math.exp(-z + a * math.log(z) - lg))
    b = z + 1 - a  # continued fraction for Q (Lentz)
    c, d = 1e300, 1 / b
    h = d
    for i in range(1, 1000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = 1e-300 if abs(d) < 1e-300 else d
        c = b + an / c
        c = 1e-300 if abs(c) < 1e-300 else c
        d = 1 / d
        h *= d * c
        if abs(d * c - 1) < 1e-15:
            break
    return math.exp(-z + a * math.log(z) - lg) * h


def test_chi2_sf_matches_known_values() -> None:
    assert _chi2_sf(3.841458820694124, 1) == pytest.approx(0.05, rel=1e-9)
    assert _chi2_sf(23.209251158954356, 10) == pytest.approx(0.01, rel=1e-9)
    assert _chi2_sf(2.0, 2) == pytest.approx(math.exp(-1.0), rel=1e-12)


def _chi_square(samples: np.ndarray, dist: np.ndarray) -> tuple[float, int, float]:
    counts = np.bincount(samples, minlength=dist.size)
    support = dist > 0
    assert counts[~support].sum() == 0, f"tokens outside the filtered support: {np.nonzero(counts * ~support)[0]}"
    exp = dist[support] * samples.size
    stat = float(((counts[support] - exp) ** 2 / exp).sum())
    dof = int(support.sum()) - 1
    return stat, dof, _chi2_sf(stat, dof)


SAMPLING = [
    ("sampling_from_probs", (), {}),
    ("top_k_sampling_from_probs", (7,), {"top_k": 7}),  # the 7th value (0.05) is tied: 8 tokens kept
    ("top_p_sampling_from_probs", (0.6,), {"top_p": 0.6}),  # 0.55 < 0.6: both 0.1 join, 5 kept
    ("min_p_sampling_from_probs", (0.25,), {"min_p": 0.25}),  # >= 0.0625: 6 kept
    ("top_k_top_p_sampling_from_probs", (7, 0.9), {"top_k": 7, "top_p": 0.9}),  # 0.9 of the top 8 ends in the 0.05 tie: 8 kept
]
CHI2 = {}  # op -> (statistic, dof, p), printed by the last test for the report


@pytest.mark.parametrize("op,args,filt", SAMPLING, ids=[s[0] for s in SAMPLING])
def test_chi_square_against_the_exact_filtered_distribution(op, args, filt) -> None:
    # 4000 draws in one launch (4000 copies of the row, row b its own Philox stream) with a fixed
    # seed: deterministic. A correct sampler fails p < 1e-3 with probability 1e-3 per seed; this
    # seed's figures are fixed, and a wrong filter (a tie group dropped, an off-by-one k, top-p
    # relative to the wrong total) moves 2.5%+ of the mass and gives p < 1e-10 at this size.
    probs = np.tile(ROW, (DRAWS, 1))
    samples = getattr(ops, op)(probs, *args, seed=20240611 + len(op), backend="host")
    assert samples.dtype == np.int32 and samples.shape == (DRAWS,)
    stat, dof, p = _chi_square(samples, np_filtered_dist(ROW, **filt))
    CHI2[op] = (stat, dof, p)
    assert p > 1e-3, (op, stat, dof, p)


def test_chi_square_detects_a_wrong_distribution() -> None:
    # The test can fail: top-k draws judged against the unfiltered distribution.
    samples = ops.top_k_sampling_from_probs(np.tile(ROW, (DRAWS, 1)), 4, seed=1, backend="host")
    with pytest.raises(AssertionError, match="outside"):
        _chi_square(samples, np_filtered_dist(ROW, top_k=3))
    stat, dof, p = _chi_square(samples, np.where(np_filtered_dist(ROW, top_k=4) > 0, 1.0 / 5, 0.0))
    assert p < 1e-10


def test_filters_keep_whole_tie_groups() -> None:
    assert np.count_nonzero(np_filtered_dist(ROW, top_k=4)) == 5  # 0.1 tied at rank 4 and 5
    assert np.count_nonzero(np_filtered_dist(ROW, top_k=7)) == 8  # 0.05 tied at rank 7 and 8
    # top_k_first: top-p of the top-k renormalized row; joint: of the raw row
    kf = np_filtered_dist(ROW, top_k=3, top_p=0.7)
    jt = np_filtered_dist(ROW, top_k=3, top_p=0.7, order="joint")
    assert np.count_nonzero(kf) == 3 - 1 and np.count_nonzero(jt) == 3


@pytest.mark.parametrize("order", ["top_k_first", "joint"])
def test_filter_apply_order_matches_the_numpy_rule(order) -> None:
    rng = np.random.default_rng(3)
    probs = make_probs(rng, 64, 50, ties=True)
    got = ops.top_k_top_p_sampling_from_probs(probs, 8, 0.5, filter_apply_order=order, seed=4, offset=2,
                                              backend="host")
    ref, _ = np_sample(probs, 4, 2, top_k=8, top_p=0.5, order=order)
    np.testing.assert_array_equal(got, ref)


# --------------------------------------------------------------------------- seed contract
def test_philox_known_answers() -> None:
    # Random123's published philox4x32-10 vectors, then the kernel against the NumPy generator.
    assert [hex(w) for w in np_philox(0, 0, np.array([0]))[0]] == ["0x6627e8d5", "0xe169c58d", "0xbc57ac4c",
                                                                   "0x9b00dbd8"]
    from pykern import launch

    out = np.zeros(4 * 3, np.uint32)
    launch("sampling_philox", (1,), (256,), out, 3, 0xA4093822, 0x299F31D0, 0x243F6A88, 0x85A308D3,
           backend="host")
    np.testing.assert_array_equal(out.reshape(3, 4), np_philox(0x299F31D0A4093822, 0x85A308D3243F6A88,
                                                               np.arange(3)))


def test_same_seed_same_samples_other_seed_or_offset_differs() -> None:
    probs = make_probs(np.random.default_rng(0), 256, 40)
    a = ops.top_p_sampling_from_probs(probs, 0.9, seed=11, backend="host")
    np.testing.assert_array_equal(a, ops.top_p_sampling_from_probs(probs, 0.9, seed=11, backend="host"))
    assert (a != ops.top_p_sampling_from_probs(probs, 0.9, seed=12, backend="host")).mean() > 0.5
    assert (a != ops.top_p_sampling_from_probs(probs, 0.9, seed=11, offset=1, backend="host")).mean() > 0.5
    # per-row seed / offset arrays (int64 or uint64) equal the scalars row by row
    seeds = np.full(256, 11, np.uint64)
    np.testing.assert_array_equal(a, ops.top_p_sampling_from_probs(probs, 0.9, seed=seeds, offset=np.zeros(1, np.int64),
                                                                   backend="host"))
    # a generator gives reproducible streams
    g1, g2 = np.random.default_rng(5), np.random.default_rng(5)
    np.testing.assert_array_equal(ops.sampling_from_probs(probs, generator=g1, backend="host"),
                                  ops.sampling_from_probs(probs, generator=g2, backend="host"))


def test_host_and_numba_agree_token_for_token() -> None:
    pytest.importorskip("numba")
    rng = np.random.default_rng(1)
    probs = make_probs(rng, 24, 33, ties=True)
    k = rng.integers(0, 34, 24).astype(np.int32)
    p = rng.uniform(0.05, 1.0, 24).astype(np.float32)
    for fn in (lambda bk: ops.top_k_top_p_sampling_from_probs(probs, k, p, seed=9, backend=bk),
               lambda bk: ops.min_p_sampling_from_probs(probs, 0.25, seed=9, backend=bk)):
        np.testing.assert_array_equal(fn("host"), fn("numba"))


# --------------------------------------------------------------------------- exact renorm / mask
def _close(out, ref, op, dtype) -> None:
    atol, rtol = tolerance(op, dtype)
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert (np.isneginf(out) == np.isneginf(ref)).all()
    fin = np.isfinite(ref)
    assert np.all(np.abs(out[fin] - ref[fin]) <= atol + rtol * np.abs(ref[fin]))


@pytest.mark.parametrize("kind", ["f32", "bf16", "f16"])
@pytest.mark.parametrize("vocab", [37, 64])
def test_renorm_and_mask_against_float64(kind, vocab) -> None:
    rng = np.random.default_rng(vocab)
    probs = make_probs(rng, 6, vocab, kind, ties=True)
    x32 = np.asarray(probs, np.float32)
    k = np.array([1, 2, 5, 0, vocab, 9], np.int32)
    p = np.array([0.05, 0.3, 0.5, 0.8, 1.0, 0.95], np.float32)
    _close(ops.top_k_renorm_probs(probs, k, backend="host").astype(np.float32), np_top_k_renorm(x32, k),
           "top_k_renorm_probs", kind)
    _close(ops.top_p_renorm_probs(probs, p, backend="host").astype(np.float32), np_top_p_renorm(x32, p),
           "top_p_renorm_probs", kind)
    with np.errstate(divide="ignore"):
        logits = np.log(x32).astype(probs.dtype)
    got = ops.top_k_mask_logits(logits, k, backend="host")
    np.testing.assert_array_equal(np.asarray(got, np.float64), np_top_k_mask(np.asarray(logits, np.float32), k))


# (low key bits the element type leaves 0, width of the radix select's last digit): f32 keys need all 32 bits
# (digits of 11, 11, 10), bf16 / f16 ones stop at bit 16 / 13 (digits of 11 and 5 / 8).
LAST_DIGIT = {"f32": (0, 10), "bf16": (16, 5), "f16": (13, 8)}


def _last_pass_rows(rows: int, vocab: int, kind: str) -> np.ndarray:
    """Rows whose filter thresholds are decided in the radix select's last pass: most entries share every
    key bit above the last digit (2**width consecutive values from 2**-11, many tied), 16 lie above that
    range, 24 below it and 8 are 0. As float32: every value is exact in `kind`."""
    low, width = LAST_DIGIT[kind]
    rng = np.random.default_rng(31)
    bits = (0x3A000000 + (rng.integers(0, 2 ** width, (rows, vocab)) << low)).astype(np.uint32)
    probs = bits.view(np.float32).copy()
    for r in range(rows):
        cols = rng.permutation(vocab)
        probs[r, cols[:16]] = np.float32(2.0 ** -9) * (1 + rng.integers(0, 64, 16).astype(np.float32) / 64)
        probs[r, cols[16:40]] = np.float32(2.0 ** -14)
        probs[r, cols[40:48]] = 0.0
    return probs


@pytest.mark.parametrize("kind", ["f32", "bf16", "f16"])
def test_thresholds_decided_in_the_last_radix_pass(kind) -> None:
    rows, vocab = 24, 4096
    x32 = _last_pass_rows(rows, vocab, kind)
    probs = x32.astype(bfloat16() if kind == "bf16" else np.float16 if kind == "f16" else np.float32)
    assert (probs.astype(np.float32) == x32).all()
    rng = np.random.default_rng(32)
    k = rng.integers(17, 3000, rows).astype(np.int32)  # the k-th largest lies in the dense range
    p = rng.uniform(0.1, 0.9, rows).astype(np.float32)
    _close(np.asarray(ops.top_k_renorm_probs(probs, k, backend="host"), np.float32), np_top_k_renorm(x32, k),
           "top_k_renorm_probs", kind)
    _close(np.asarray(ops.top_p_renorm_probs(probs, p, backend="host"), np.float32), np_top_p_renorm(x32, p),
           "top_p_renorm_probs", kind)
    for sign in (1, -1):  # negative logits: keys whose low bits are all 1
        np.testing.assert_array_equal(np.asarray(ops.top_k_mask_logits(sign * probs, k, backend="host"), np.float64),
                                      np_top_k_mask(sign * x32, k))
    for seed in (5, 6):
        np.testing.assert_array_equal(ops.top_k_sampling_from_probs(probs, k, seed=seed, backend="host"),
                                      np_sample(x32, seed, top_k=k)[0])
        np.testing.assert_array_equal(ops.top_p_sampling_from_probs(probs, p, seed=seed, backend="host"),
                                      np_sample(x32, seed, top_p=p)[0])
        for order in ("top_k_first", "joint"):
            # joint: top-k's threshold often above top-p's, in every third row above its whole range
            kk = np.where(np.arange(rows) % 3 == 0, 1 + k % 15, k // 4).astype(np.int32) if order == "joint" else k
            np.testing.assert_array_equal(
                ops.top_k_top_p_sampling_from_probs(probs, kk, p, seed=seed, filter_apply_order=order, backend="host"),
                np_sample(x32, seed, top_k=kk, top_p=p, order=order)[0])


def test_renorm_ties_and_disabled_k() -> None:
    probs = ROW[None, :].copy()
    out = ops.top_k_renorm_probs(probs, 4, backend="host")[0]
    assert np.count_nonzero(out) == 5 and out.sum() == pytest.approx(1.0, abs=1e-6)  # both 0.1 kept
    np.testing.assert_array_equal(ops.top_k_renorm_probs(probs, 0, backend="host"), probs)  # unchanged
    np.testing.assert_array_equal(ops.top_k_renorm_probs(probs, 12, backend="host"), probs)
    m = ops.top_k_mask_logits(np.array([[1.0, 3.0, 3.0, 2.0, np.nan]], np.float32), 2, backend="host")
    np.testing.assert_array_equal(m, [[-np.inf, 3.0, 3.0, -np.inf, -np.inf]])


def test_row_without_mass_is_invalid() -> None:
    probs = np.stack([ROW, np.zeros(12, np.float32), np.full(12, np.nan, np.float32)])
    s, v = ops.sampling_from_probs(probs, seed=1, return_valid=True, backend="host")
    assert v.dtype == np.bool_ and v.tolist() == [True, False, False] and s[1] == s[2] == 0


@pytest.mark.parametrize("bad", [np.nan, -0.01, np.inf])
@pytest.mark.parametrize("op,args", [
    ("sampling_from_probs", ()), ("top_k_sampling_from_probs", (3,)), ("top_p_sampling_from_probs", (0.8,)),
    ("min_p_sampling_from_probs", (0.1,)), ("top_k_top_p_sampling_from_probs", (4, 0.9)),
])
def test_row_with_a_bad_probability_is_invalid(op: str, args: tuple, bad: float) -> None:
    # one NaN / negative / inf entry next to real mass used to count as 0, and the row drew a token marked valid
    probs = np.stack([ROW, ROW, ROW])
    probs[1, 5] = bad
    s, v = getattr(ops, op)(probs, *args, seed=3, return_valid=True, backend="host")
    assert v.tolist() == [True, False, True] and s[1] == 0
    clean, _ = getattr(ops, op)(np.stack([ROW, ROW, ROW]), *args, seed=3, return_valid=True, backend="host")
    assert s[0] == clean[0] and s[2] == clean[2]  # the other rows draw as they would without the bad one
    with pytest.raises(ArgumentError, match=r"probs: expected probabilities in \[0, inf\) \(check_nan=True\), "
                                             r"got probs\[1, 5\]="):
        getattr(ops, op)(probs, *args, seed=3, check_nan=True, backend="host")
    getattr(ops, op)(np.stack([ROW, ROW]), *args, seed=3, check_nan=True, backend="host")  # clean rows pass


@pytest.mark.parametrize("bad", [np.nan, -0.01, np.inf])
def test_renorm_of_a_row_with_a_bad_probability_is_nan(bad: float) -> None:
    probs = np.stack([ROW, ROW])
    probs[1, 2] = bad
    for out in (ops.top_k_renorm_probs(probs, 3, backend="host"), ops.top_p_renorm_probs(probs, 0.7, backend="host")):
        assert np.isnan(out[1]).all() and not np.isnan(out[0]).any()
        assert out[0].sum() == pytest.approx(1.0, abs=1e-6)
    # the filter off (top_k = 0): the row comes back unchanged, as any row does
    np.testing.assert_array_equal(ops.top_k_renorm_probs(probs, 0, backend="host"), probs)


def test_indices_map_outputs_to_rows() -> None:
    probs = np.eye(4, dtype=np.float32)
    s = ops.sampling_from_probs(probs, indices=np.array([3, 3, 0, 2]), seed=0, backend="host")
    assert s.tolist() == [3, 3, 0, 2]


def test_indices_dtype_sets_the_samples_dtype() -> None:
    # FlashInfer's samples take the dtype of indices (int64 -> int64); int32 indices and no indices give int32
    probs = np.eye(4, dtype=np.float32)
    for dt in (np.int64, np.int32):
        s, v = ops.top_k_sampling_from_probs(probs, 2, indices=np.array([3, 3, 0, 2], dt), seed=0,
                                             return_valid=True, backend="host")
        assert s.dtype == dt and s.tolist() == [3, 3, 0, 2] and v.all()
    assert ops.sampling_from_probs(probs, seed=0, backend="host").dtype == np.int32
    torch = pytest.importorskip("torch")
    t = ops.min_p_sampling_from_probs(torch.from_numpy(probs), 0.5, indices=torch.tensor([1, 2]), seed=0,
                                      backend="host")
    assert t.dtype == torch.int64 and t.tolist() == [1, 2]


# FlashInfer converts threshold arrays of the other kind (`.float()` of top_p / min_p, `.int()` of top_k): an engine's
# torch.full((b,), 1) is int64, and a float top_k array truncates toward zero.
THRESHOLD_ARRAYS = [
    ("min_p_sampling_from_probs", (np.full(3, 1, np.int64),), (1.0,)),
    ("min_p_sampling_from_probs", (np.zeros(3, np.int32),), (0.0,)),
    ("top_p_sampling_from_probs", (np.full(3, 1, np.int64),), (1.0,)),
    ("top_k_sampling_from_probs", (np.full(3, 3.0, np.float32),), (3,)),
    ("top_k_sampling_from_probs", (np.full(3, 2.9, np.float64),), (2,)),
    ("top_k_top_p_sampling_from_probs", (np.full(3, 5.0, np.float32), np.ones(3, np.int64)), (5, 1.0)),
]


@pytest.mark.parametrize("op,arrs,scalars", THRESHOLD_ARRAYS, ids=[f"{t[0]}-{t[1][0].dtype}" for t in THRESHOLD_ARRAYS])
def test_threshold_arrays_of_the_other_numeric_kind_are_converted(op, arrs, scalars) -> None:
    probs = np.tile(ROW, (3, 1))
    got = getattr(ops, op)(probs, *arrs, seed=7, backend="host")
    np.testing.assert_array_equal(got, getattr(ops, op)(probs, *scalars, seed=7, backend="host"))


def test_renorm_and_mask_threshold_arrays_of_the_other_numeric_kind() -> None:
    probs = np.tile(ROW, (3, 1))
    np.testing.assert_array_equal(ops.top_k_renorm_probs(probs, np.full(3, 4.0, np.float32), backend="host"),
                                  ops.top_k_renorm_probs(probs, 4, backend="host"))
    np.testing.assert_array_equal(ops.top_p_renorm_probs(probs, np.ones(3, np.int64), backend="host"),
                                  ops.top_p_renorm_probs(probs, 1.0, backend="host"))
    logits = np.log(np.maximum(probs, 1e-9)).astype(np.float32)
    np.testing.assert_array_equal(ops.top_k_mask_logits(logits, np.full(3, 3.5), backend="host"),
                                  ops.top_k_mask_logits(logits, 3, backend="host"))
    torch = pytest.importorskip("torch")
    t = ops.min_p_sampling_from_probs(torch.from_numpy(probs), torch.full((3,), 1), seed=1, backend="host")
    assert t.tolist() == [0, 0, 0]  # min_p = 1 keeps the maximum alone (ROW[0])


# --------------------------------------------------------------------------- chain speculative sampling
# Two 12-token target rows and draft rows that disagree with them (the draft favours the tail), so about half the
# drafts are rejected and the residual max(0, p - q) carries the correction.
SPEC_P = np.stack([ROW, ROW[::-1].copy(), ROW]).astype(np.float32)  # target rows 0, 1 and the bonus row 2
SPEC_Q = np.stack([ROW[::-1], ROW]).astype(np.float32)
SPEC_Q = (SPEC_Q / SPEC_Q.sum(1, keepdims=True)).astype(np.float32)


def _speculative_draws(draws: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    q64 = SPEC_Q.astype(np.float64)
    ids = np.stack([rng.choice(12, draws, p=q64[i] / q64[i].sum()) for i in range(2)], 1).astype(np.int32)
    return ops.chain_speculative_sampling(np.tile(SPEC_Q, (draws, 1, 1)), ids, np.tile(SPEC_P, (draws, 1, 1)),
                                          seed=seed, backend="host")


def test_chain_speculative_sampling_keeps_the_target_distribution() -> None:
    # Rejection sampling must emit tokens distributed as the target: the first token as p_0 over every request,
    # the second as p_1 over the requests that accepted the first draft (the accepted draft, or the resampled
    # residual, or the bonus row when both drafts pass). Same significance as the other chi-square tests.
    out, acc, emit = _speculative_draws(DRAWS, 20240612)
    stat, dof, p = _chi_square(out[:, 0], SPEC_P[0].astype(np.float64) / SPEC_P[0].sum())
    CHI2["chain_speculative_sampling[0]"] = (stat, dof, p)
    assert p > 1e-3, (stat, dof, p)
    second = out[emit >= 1, 1]
    assert 0.2 * DRAWS < second.size < 0.9 * DRAWS  # both outcomes are exercised
    stat, dof, p = _chi_square(second, SPEC_P[1].astype(np.float64) / SPEC_P[1].sum())
    CHI2["chain_speculative_sampling[1]"] = (stat, dof, p)
    assert p > 1e-3, (stat, dof, p)
    # the counts: emitted <= accepted <= n, -1 after the emitted token, the bonus only after n acceptances
    assert ((emit <= acc) & (acc <= 2)).all()
    for e in range(3):
        rows = out[emit == e]
        assert (rows[:, e] >= 0).all() and (rows[:, e + 1:] == -1).all()
    # acceptance rate of the first draft: sum min(p, q) exactly, to sampling error (4 sigma)
    rate = float(np.minimum(SPEC_P[0].astype(np.float64), SPEC_Q[0]).sum())
    assert abs((emit >= 1).mean() - rate) < 4 * math.sqrt(rate * (1 - rate) / DRAWS)


def test_chain_speculative_chi_square_detects_the_draft_distribution() -> None:
    # The test can fail: the emitted first tokens are not distributed as the draft's row (which has no mass where
    # the target's two largest are), nor as the even mix of the draft and the target.
    out, _, _ = _speculative_draws(DRAWS, 20240612)
    with pytest.raises(AssertionError, match="outside"):
        _chi_square(out[:, 0], SPEC_Q[0].astype(np.float64))
    mix = 0.5 * (SPEC_P[0].astype(np.float64) + SPEC_Q[0])
    _, _, p = _chi_square(out[:, 0], mix / mix.sum())
    assert p < 1e-10


def test_chain_speculative_sampling_bit_exact_on_host_numba_and_numpy() -> None:
    rng = np.random.default_rng(8)
    draft, ids, target = make_speculative(rng, 8, 3, 40)
    ref = np_chain_speculative(draft, ids, target, 77, 5)
    got = ops.chain_speculative_sampling(draft, ids, target, seed=77, offset=5, backend="host")
    for g, r in zip(got, ref):
        np.testing.assert_array_equal(g, r)
    # FlashInfer's documented example: the first draft (p 0.6 >= q 0.3) always passes, the second (p 0) never does,
    # and the residual max(0, p - q) of the second row is token 0 alone.
    d = np.array([[[0.1, 0.2, 0.3, 0.4], [0.2, 0.3, 0.4, 0.1]]], np.float32)
    t = np.array([[[0.0, 0.1, 0.6, 0.3], [1.0, 0.0, 0.0, 0.0], [0.7, 0.1, 0.1, 0.1]]], np.float32)
    acc, emit = np.array([10], np.int32), np.array([20], np.int32)
    out, a, e = ops.chain_speculative_sampling(d, np.array([[2, 1]]), t, acc, emit, seed=1, backend="host")
    assert out.tolist() == [[2, 0, -1]] and a is acc and e is emit and acc.tolist() == [11] and emit.tolist() == [21]
    pytest.importorskip("numba")
    got_numba = ops.chain_speculative_sampling(draft, ids, target, seed=77, offset=5, backend="numba")
    for g, r in zip(got_numba, ref):
        np.testing.assert_array_equal(g, r)


def test_chain_speculative_device_ids_elsewhere_are_named() -> None:
    # ids on another device than the probabilities (here: meta) reached the launch, whose error named the
    # kernel's argument
    torch = pytest.importorskip("torch")
    ids = torch.zeros((2, 2), dtype=torch.int32, device="meta")
    with pytest.raises(ArgumentTypeError, match="draft_token_ids: expected an array on the device of draft_probs"):
        ops.chain_speculative_sampling(np.full((2, 2, 4), 0.25, np.float32), ids, np.full((2, 3, 4), 0.25, np.float32),
                                       seed=1, offset=0, backend="host")


@pytest.mark.parametrize("call,err,pattern", [
    (lambda d, i, t: ops.chain_speculative_sampling(d, i, t[:, :2]), ArgumentError,
     r"target_probs: expected shape \(2, 3, 4\) \(one row more"),
    (lambda d, i, t: ops.chain_speculative_sampling(d, i[:, :1], t), ArgumentError,
     r"draft_token_ids: expected shape \(2, 2\)"),
    (lambda d, i, t: ops.chain_speculative_sampling(d, i + 3, t), ArgumentError,
     r"draft_token_ids: expected token ids in \[0, 4\), got draft_token_ids\[0, 0\]=4"),
    (lambda d, i, t: ops.chain_speculative_sampling(d, i.astype(np.float32), t), ArgumentTypeError,
     "draft_token_ids: expected an int32 or int64 array"),
    (lambda d, i, t: ops.chain_speculative_sampling(d, i, t.astype(np.float16)), ArgumentTypeError,
     r"target_probs: expected the dtype of draft_probs \(f32\)"),
    (lambda d, i, t: ops.chain_speculative_sampling(d[0], i, t), ArgumentError, "draft_probs: expected a 3-D array"),
    (lambda d, i, t: ops.chain_speculative_sampling(d, i, t, np.zeros(2, np.int64)), ArgumentTypeError,
     "maybe_output_accepted_token_num: expected an int32 array"),
    (lambda d, i, t: ops.chain_speculative_sampling(d, i, t, None, np.zeros(3, np.int32)), ArgumentError,
     r"maybe_output_emitted_draft_token_num: expected shape \(2,\)"),
])
def test_chain_speculative_bad_arguments_name_the_argument(call, err, pattern) -> None:
    d = np.full((2, 2, 4), 0.25, np.float32)
    with pytest.raises(err, match=pattern):
        call(d, np.array([[1, 2], [0, 3]], np.int64), np.full((2, 3, 4), 0.25, np.float32))


# --------------------------------------------------------------------------- from logits
# A 12-token row of logits with a tie (1.5, 1.5) and a -inf; the draws follow softmax(LROW / T).
LROW = np.array([2.0, 1.5, 1.5, 0.7, 0.0, -0.3, -1.0, -2.5, -4.0, -np.inf, 1.0, -0.6], np.float32)
LDRAWS = 2000  # rows of one launch (host: ~4 s)


@pytest.mark.parametrize("temperature", [1.0, 0.6, 2.5])
def test_sampling_from_logits_chi_square_against_softmax(temperature) -> None:
    # A fixed seed: deterministic. A correct sampler fails p < 1e-3 with probability 1e-3 a seed.
    samples = ops.sampling_from_logits(np.tile(LROW, (LDRAWS, 1)), seed=77, temperature=temperature, backend="host")
    assert samples.dtype == np.int32 and samples.shape == (LDRAWS,)
    stat, dof, p = _chi_square(samples, np_softmax(LROW[None], temperature)[0])
    CHI2[f"sampling_from_logits T={temperature}"] = (stat, dof, p)
    assert p > 1e-3, (temperature, stat, dof, p)


def test_sampling_from_logits_per_row_temperature_chi_square() -> None:
    # rows alternate T = 0.5 and T = 3: each half follows its own softmax
    t = np.where(np.arange(LDRAWS) % 2 == 0, 0.5, 3.0).astype(np.float32)
    samples = ops.sampling_from_logits(np.tile(LROW, (LDRAWS, 1)), seed=78, temperature=t, backend="host")
    for parity, temp in ((0, 0.5), (1, 3.0)):
        stat, dof, p = _chi_square(samples[parity::2], np_softmax(LROW[None], temp)[0])
        assert p > 1e-3, (temp, stat, dof, p)


def test_logits_chi_square_detects_an_ignored_temperature() -> None:
    # The test can fail: draws at T = 0.5 judged against softmax at T = 1.
    samples = ops.sampling_from_logits(np.tile(LROW, (LDRAWS, 1)), seed=79, temperature=0.5, backend="host")
    stat, dof, p = _chi_square(samples, np_softmax(LROW[None], 1.0)[0])
    assert p < 1e-10


@pytest.mark.parametrize("order", ["top_k_first", "joint"])
def test_top_k_top_p_from_logits_follows_the_probs_op_on_the_softmax(order) -> None:
    # top-k 6 keeps 6 tokens (the 1.5 tie inside); top-p 0.8 of those (or of the whole row, joint): the logits op
    # must draw from the distribution the probs op draws from on softmax(x / T)
    temp = 0.8
    dist = np_filtered_dist(np_softmax(LROW[None], temp)[0], top_k=6, top_p=0.8, order=order)
    samples = ops.top_k_top_p_sampling_from_logits(np.tile(LROW, (LDRAWS, 1)), 6, 0.8, filter_apply_order=order,
                                                   seed=80, temperature=temp, backend="host")
    stat, dof, p = _chi_square(samples, dist)
    CHI2[f"top_k_top_p_sampling_from_logits {order}"] = (stat, dof, p)
    assert p > 1e-3, (order, stat, dof, p)
    probs = np.tile(np_softmax(LROW[None], temp).astype(np.float32), (LDRAWS, 1))
    ref = ops.top_k_top_p_sampling_from_probs(probs, 6, 0.8, filter_apply_order=order, seed=80, backend="host")
    np.testing.assert_array_equal(np.bincount(samples, minlength=12) > 0, np.bincount(ref, minlength=12) > 0)


@pytest.mark.parametrize("kind", ["f32", "f16"])
def test_logits_ops_bit_exact_against_the_numpy_rule(kind) -> None:
    rng = np.random.default_rng(5)
    x = make_logits(rng, 8, 37, kind, ties=True)
    k = np.array([0, 1, 3, 5, 9, 37, 2, 6], np.int32)
    p = np.array([0.1, 0.5, 0.9, 1.0, 0.3, 0.7, 0.95, 0.05], np.float32)
    t = np.array([0.05, 0.3, 1.0, 2.0, 7.0, 0.9, 1.3, 100.0], np.float32)
    xf = np.asarray(x, np.float32)
    for temp in (None, 0.7, t):
        s, v = ops.sampling_from_logits(x, seed=11, offset=4, temperature=temp, return_valid=True, backend="host")
        rs, rv = np_sample_logits(xf, 11, 4, temperature=temp)
        np.testing.assert_array_equal(s, rs)
        np.testing.assert_array_equal(v, rv)
        for order in ("top_k_first", "joint"):
            s = ops.top_k_top_p_sampling_from_logits(x, k, p, filter_apply_order=order, seed=12, temperature=temp,
                                                     backend="host")
            np.testing.assert_array_equal(s, np_sample_logits(xf, 12, 0, temperature=temp, top_k=k, top_p=p,
                                                              order=order)[0])


def test_exp_mass_is_the_fixed_point_softmax() -> None:
    # the mass of the maximum is 2^40 exactly, the others 2^40 * 2^(n + r) within 3e-9 relative (the polynomial)
    # and the truncation to an integer, n + r the kernel's float32 split of f = (x - m) * c
    from pykern.launcher import launch

    x = np.linspace(-20, 3, 4001).astype(np.float32)
    c = float(np_logit_scale(0.8, 1)[0])
    out = np.zeros(x.size, np.uint64)
    launch("sampling_exp_mass", (-(-x.size // 256),), (256,), x, out, x.size, 3.0, c, backend="host")
    out = out.astype(np.int64)
    np.testing.assert_array_equal(out, np_exp_mass(x, 3.0, c))
    assert out[-1] == 2**40
    f = ((x - np.float32(3.0)) * np.float32(c)).astype(np.float32)  # the kernel's f, floor and r (float32)
    fl = np.floor(f)
    r = (f - fl).astype(np.float32)
    exact = 2.0**40 * np.exp2(fl.astype(np.float64)) * np.exp2(r.astype(np.float64))
    big = exact > 2**20
    assert np.all(np.abs(out[big] - exact[big]) <= exact[big] * 3e-9 + 1)
    assert np.all(np.diff(out) >= 0)  # the mass never decreases as the logit grows


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_logit_row_with_nan_or_inf_or_only_minus_inf_is_invalid(bad) -> None:
    x = np.tile(LROW, (3, 1))
    x[1, 4] = bad
    x[2, :] = -np.inf
    s, v = ops.sampling_from_logits(x, seed=3, return_valid=True, backend="host")
    np.testing.assert_array_equal(v, [True, False, False])
    np.testing.assert_array_equal(s[1:], [0, 0])
    s, v = ops.top_k_top_p_sampling_from_logits(x, 3, 0.5, seed=3, return_valid=True, backend="host")
    np.testing.assert_array_equal(v, [True, False, False])


@pytest.mark.parametrize("kind", ["f32", "f16"])
def test_softmax_against_float64(kind) -> None:
    rng = np.random.default_rng(6)
    x = make_logits(rng, 4, 64, kind)
    for temp in (None, 0.5, np.array([0.3, 1.0, 2.0, 9.0], np.float32)):
        out = ops.softmax(x, temp, backend="host")
        assert out.dtype == np.float32 and out.shape == (4, 64)
        rtol, atol = tolerance("softmax", kind)
        np.testing.assert_allclose(out, np_softmax(np.asarray(x, np.float32), temp), rtol=rtol, atol=atol)
    y = np.tile(LROW, (2, 1))
    y[1, 2] = np.nan
    out = ops.softmax(y, backend="host")
    assert out[0, 9] == 0.0 and np.isnan(out[1]).all()


def test_host_and_numba_agree_from_logits() -> None:
    pytest.importorskip("numba")
    rng = np.random.default_rng(7)
    x = make_logits(rng, 12, 33, ties=True, poison=(float("nan"), float("inf")))
    k = rng.integers(0, 34, 12).astype(np.int32)
    p = rng.uniform(0.05, 1.0, 12).astype(np.float32)
    t = rng.uniform(0.1, 4.0, 12).astype(np.float32)
    for fn in (lambda bk: ops.top_k_top_p_sampling_from_logits(x, k, p, seed=9, temperature=t, backend=bk),
               lambda bk: ops.sampling_from_logits(x, seed=9, temperature=0.7, backend=bk)):
        np.testing.assert_array_equal(fn("host"), fn("numba"))


@pytest.mark.parametrize("call,err,pattern", [
    (lambda x: ops.sampling_from_logits(x, temperature=0.0), ArgumentError, "temperature: expected a finite float > 0"),
    (lambda x: ops.sampling_from_logits(x, temperature=-1.0), ArgumentError, "temperature"),
    (lambda x: ops.sampling_from_logits(x, temperature=float("nan")), ArgumentError, "temperature"),
    (lambda x: ops.sampling_from_logits(x, temperature=float("inf")), ArgumentError, "temperature"),
    (lambda x: ops.sampling_from_logits(x, temperature=1e-45), ArgumentError, "log2"),
    (lambda x: ops.sampling_from_logits(x, temperature=np.array([1.0, 0.0, 1.0], np.float32)), ArgumentError,
     r"temperature\[1\]=0"),
    (lambda x: ops.sampling_from_logits(x, temperature=np.array([1.0, 1.0], np.float32)), ArgumentError,
     r"temperature: .*shape \(3,\)"),
    (lambda x: ops.sampling_from_logits(x, temperature="hot"), ArgumentTypeError, "temperature"),
    (lambda x: ops.softmax(x, np.array([1.0, np.inf, 1.0], np.float32)), ArgumentError, r"temperature\[1\]=inf"),
    (lambda x: ops.softmax(x[0]), ArgumentError, r"logits: expected a 2-D array"),
    (lambda x: ops.softmax(x.astype(np.int32)), ArgumentTypeError, "logits: expected dtype"),
    (lambda x: ops.sampling_from_logits(x.astype(np.float64)), ArgumentTypeError, "logits: expected dtype"),
    (lambda x: ops.sampling_from_logits(np.where(np.arange(4) == 2, np.nan, x).astype(np.float32), check_nan=True),
     ArgumentError, r"logits: .*got logits\[0, 2\]=nan"),
    (lambda x: ops.top_k_top_p_sampling_from_logits(x, 2, 0.5, filter_apply_order="x"), ArgumentError,
     "filter_apply_order"),
    (lambda x: ops.top_k_top_p_sampling_from_logits(x, -1, 0.5), ArgumentError, "top_k"),
])
def test_logits_bad_arguments_name_the_argument(call, err, pattern, monkeypatch) -> None:
    from pykern import launcher

    def no_launch(*a, **k):  # every check happens before any launch
        raise AssertionError("launched")

    monkeypatch.setattr(launcher, "launch", no_launch)
    with pytest.raises(err, match=pattern):
        call(np.tile(LROW[:4], (3, 1)))


# --------------------------------------------------------------------------- arguments
@pytest.mark.parametrize("call,err,pattern", [
    (lambda p: ops.top_k_sampling_from_probs(p, -1), ArgumentError, "top_k: expected a int in"),
    (lambda p: ops.top_k_sampling_from_probs(p, 2.5), ArgumentTypeError, "top_k: expected an int"),
    (lambda p: ops.top_p_sampling_from_probs(p, 0.0), ArgumentError, r"top_p: expected a float in \(0, 1\]"),
    (lambda p: ops.top_p_sampling_from_probs(p, 1.5), ArgumentError, "top_p"),
    (lambda p: ops.top_p_sampling_from_probs(p, np.array([0.5, 2.0, 0.5], np.float32)), ArgumentError,
     r"top_p\[1\]=2"),
    (lambda p: ops.top_k_sampling_from_probs(p, np.array([1, 2])), ArgumentError, r"top_k: .*shape \(3,\)"),
    (lambda p: ops.min_p_sampling_from_probs(p, -0.1), ArgumentError, "min_p"),
    (lambda p: ops.top_k_top_p_sampling_from_probs(p, 2, 0.5, filter_apply_order="x"), ArgumentError,
     "filter_apply_order"),
    (lambda p: ops.sampling_from_probs(p, seed=2**64), ArgumentError, "seed"),
    (lambda p: ops.sampling_from_probs(p, seed=1, offset=np.zeros(3, np.float32)), ArgumentTypeError, "offset"),
    (lambda p: ops.sampling_from_probs(p, offset=3), ArgumentError, "offset"),
    (lambda p: ops.sampling_from_probs(p, indices=np.array([0, 3])), ArgumentError, "indices"),
    (lambda p: ops.sampling_from_probs(p[0]), ArgumentError,
     r"probs: expected a 2-D array \(batch, vocab\), got shape \(4,\)"),
    (lambda p: ops.sampling_from_probs(p.astype(np.float64)), ArgumentTypeError, "probs: expected dtype"),
    (lambda p: ops.sampling_from_probs(np.full((3, 4), np.nan, np.float32), check_nan=True), ArgumentError,
     r"probs: .*got probs\[0, 0\]=nan"),
    (lambda p: ops.top_k_mask_logits(p, -2), ArgumentError, "top_k"),
    (lambda p: ops.min_p_sampling_from_probs(p, np.array([0, 2, 0])), ArgumentError, r"min_p\[1\]=2"),
    (lambda p: ops.top_k_sampling_from_probs(p, np.array([1.0, np.nan, 2.0])), ArgumentError, r"top_k\[1\]=nan"),
    (lambda p: ops.top_p_sampling_from_probs(p, np.array([True, True, True])), ArgumentTypeError,
     "top_p: expected an integer or float array, got dtype bool"),
])
def test_bad_arguments_name_the_argument(call, err, pattern) -> None:
    with pytest.raises(err, match=pattern):
        call(np.tile(ROW[:4], (3, 1)))


# --------------------------------------------------------------------------- large vocab, dtypes, torch
def test_vocab_256k_row_on_host() -> None:
    rng = np.random.default_rng(2)
    v = 256 * 1024
    probs = (rng.random((2, v)) ** 8).astype(np.float32)
    probs /= probs.sum(1, keepdims=True)
    probs[1, 123457] = 0.5  # a dominant token far into the row
    probs[1] /= probs[1].sum()
    got = ops.top_k_top_p_sampling_from_probs(probs, 1000, 0.9, seed=3, backend="host")
    ref, _ = np_sample(probs, 3, 0, top_k=1000, top_p=0.9)
    np.testing.assert_array_equal(got, ref)
    r = ops.top_k_renorm_probs(probs, 3, backend="host")
    assert np.count_nonzero(r[1]) == 3 and r[1, 123457] == pytest.approx(
        probs[1, 123457] / np.sort(probs[1])[-3:].astype(np.float64).sum(), rel=1e-5)


@pytest.mark.parametrize("kind, vocab", [("f32", 18440), ("f32", 18441), ("bf16", 36872)])
def test_rows_that_end_in_a_partial_group_of_loads(kind, vocab) -> None:
    # Row walks issue their loads 4 chunks at a time (3 in renorm / mask); these rows end inside a group: 10 chunks
    # of 512 threads x 4 f32 (18440), 37 one-element chunks (18441), 9 chunks of 8 bf16 (36872). The draw is forced
    # into the last chunks by a dominant entry there, and the filters' thresholds come from the whole row.
    rng = np.random.default_rng(vocab)
    probs = make_probs(rng, 4, vocab, kind)
    x = np.asarray(probs, np.float32)
    x[1, vocab - 3] = x[1].sum() * 4  # most of row 1's mass in its last chunk
    x[2, vocab - 1] = x[2].sum()
    probs = x.astype(probs.dtype) if kind == "f32" else np.asarray(x, probs.dtype)
    x = np.asarray(probs, np.float32)
    for args in ({}, {"top_k": 100}, {"top_p": 0.9}, {"top_k": 100, "top_p": 0.9}):
        op = {0: "sampling_from_probs", 1: "top_k_sampling_from_probs" if "top_k" in args else
              "top_p_sampling_from_probs", 2: "top_k_top_p_sampling_from_probs"}[len(args)]
        for seed in (1, 2, 3):
            got = getattr(ops, op)(probs, *args.values(), seed=seed, backend="host")
            ref, _ = np_sample(x, seed, 0, **args)
            np.testing.assert_array_equal(got, ref, err_msg=f"{op} {args} seed {seed}")
    k = np.array([1, 100, 5000, 0], np.int32)
    _close(ops.top_k_renorm_probs(probs, k, backend="host").astype(np.float32), np_top_k_renorm(x, k),
           "top_k_renorm_probs", kind)
    p = np.array([0.5, 0.9, 0.99, 1.0], np.float32)
    _close(ops.top_p_renorm_probs(probs, p, backend="host").astype(np.float32), np_top_p_renorm(x, p),
           "top_p_renorm_probs", kind)
    logits = np.log(np.maximum(x, 1e-30)).astype(probs.dtype)
    np.testing.assert_array_equal(np.asarray(ops.top_k_mask_logits(logits, k, backend="host"), np.float64),
                                  np_top_k_mask(np.asarray(logits, np.float32), k))


@pytest.mark.parametrize("kind", ["f32", "bf16"])
def test_draws_past_the_first_window_of_segment_sums(kind) -> None:
    # The draw sums the row a window of 128 chunks at a time (sp_find_draw); 70001 entries are read one a thread
    # (not a multiple of the 16-byte vector), so 137 chunks of 512: two windows, the second of 9 chunks. Row 1's
    # draw is forced just past the first window, row 2's onto the first window's last entry, row 3's onto the
    # row's last entry; row 0 has most of its mass spread over the second window, which the first one's mass
    # precedes.
    vocab = 70001
    rng = np.random.default_rng(7)
    x = np.asarray(make_probs(rng, 4, vocab, kind), np.float32)
    x[0, :65536] *= 0.01
    for r, at in ((1, 65536 + 300), (2, 65535), (3, vocab - 1)):
        x[r, at] = x[r].sum() * 8
    probs = x if kind == "f32" else x.astype(bfloat16())
    x = np.asarray(probs, np.float32)
    for op, args in (("sampling_from_probs", {}), ("top_p_sampling_from_probs", {"top_p": 0.95}),
                     ("min_p_sampling_from_probs", {"min_p": 0.5})):
        for seed in (1, 2):
            got = getattr(ops, op)(probs, *args.values(), seed=seed, backend="host")
            ref, _ = np_sample(x, seed, 0, **args)
            np.testing.assert_array_equal(got, ref, err_msg=f"{op} {args} seed {seed}")
            if op == "min_p_sampling_from_probs":
                assert list(got[1:]) == [65536 + 300, 65535, vocab - 1]


def test_bf16_probs_sample_like_their_f32_values() -> None:
    probs = make_probs(np.random.default_rng(4), 32, 64, "bf16")
    a = ops.top_p_sampling_from_probs(probs, 0.8, seed=5, backend="host")
    b = ops.top_p_sampling_from_probs(np.asarray(probs, np.float32), 0.8, seed=5, backend="host")
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("op, args", [("top_p_sampling_from_probs", (0.8,)), ("top_k_sampling_from_probs", (7,)),
                                      ("min_p_sampling_from_probs", (0.1,)), ("sampling_from_probs", ())])
def test_f16_probs_sample_like_their_f32_values(op, args) -> None:
    # float16 probs (FlashInfer's sampling takes fp16/bf16/fp32): the decisions are integer arithmetic on
    # the widened values, so the tokens equal those of the same values in float32, and the f16 kernel ran
    probs = make_probs(np.random.default_rng(8), 32, 64, "f16")
    assert probs.dtype == np.float16
    a = getattr(ops, op)(probs, *args, seed=5, backend="host")
    b = getattr(ops, op)(np.asarray(probs, np.float32), *args, seed=5, backend="host")
    np.testing.assert_array_equal(a, b)
    odd = make_probs(np.random.default_rng(9), 5, 37, "f16")  # one-element path (vocab not a multiple of 8)
    np.testing.assert_array_equal(getattr(ops, op)(odd, *args, seed=2, backend="host"),
                                  getattr(ops, op)(odd.astype(np.float32), *args, seed=2, backend="host"))


def test_torch_cpu_tensors_in_and_out() -> None:
    torch = pytest.importorskip("torch")
    probs = torch.from_numpy(make_probs(np.random.default_rng(6), 8, 40))
    s = ops.top_k_top_p_sampling_from_probs(probs, torch.full((8,), 5, dtype=torch.int32), 0.9, seed=1,
                                            backend="host")
    assert isinstance(s, torch.Tensor) and s.dtype == torch.int32
    np.testing.assert_array_equal(s.numpy(), ops.top_k_top_p_sampling_from_probs(probs.numpy(), 5, 0.9, seed=1,
                                                                                 backend="host"))
    r = ops.top_p_renorm_probs(probs.to(torch.bfloat16), 0.5, backend="host")
    assert isinstance(r, torch.Tensor) and r.dtype == torch.bfloat16
    h = probs.to(torch.float16)
    r16 = ops.top_k_renorm_probs(h, 5, backend="host")
    assert isinstance(r16, torch.Tensor) and r16.dtype == torch.float16
    _close(r16.float().numpy(), np_top_k_renorm(h.float().numpy(), np.full(8, 5, np.int32)), "top_k_renorm_probs",
           "f16")
    s16 = ops.top_k_top_p_sampling_from_probs(h, 5, 0.9, seed=1, backend="host")
    np.testing.assert_array_equal(s16.numpy(), ops.top_k_top_p_sampling_from_probs(h.float().numpy(), 5, 0.9, seed=1,
                                                                                   backend="host"))
    g = torch.Generator().manual_seed(3)
    assert ops.sampling_from_probs(probs, generator=g, backend="host").shape == (8,)


# --------------------------------------------------------------------------- SASS
KERNELS = [f"{k}{s}" for k in ("sampling_from_probs", "sampling_from_logits", "sampling_renorm_probs",
                                "sampling_top_k_mask_logits", "sampling_softmax")
           for s in ("", "_bf16", "_f16")]


@lru_cache(maxsize=None)
def _mix():
    return guard(lambda: report().instruction_mix(KERNELS, ["sm_80", "sm_90"], with_resources=True))


@pytest.mark.parametrize("kernel", KERNELS)
def test_sass_no_spills_and_16_byte_loads(kernel) -> None:
    for arch in ("sm_80", "sm_90"):
        row = _mix()[kernel][arch]
        assert row["spill_stores"] == row["spill_loads"] == row["LDL"] == row["STL"] == 0, (kernel, arch, row)
        assert row["LDG128"] > 0, (kernel, arch, row)


@lru_cache(maxsize=None)
def _listing(arch: str) -> dict:
    """{kernel: instructions} of sampling.cu's cubin for arch."""
    return report()._instructions(source_sass("sampling.cu", arch))


@pytest.mark.parametrize("kernel", KERNELS)
def test_sass_row_walks_keep_several_16_byte_loads_in_flight(kernel) -> None:
    # One CTA reads a whole row, so its read time is latency x chunks / chunks in flight: each walk issues
    # SP_AHEAD (4; 3 in the 64-register kernels) 16-byte loads a thread before it uses the first. One load at a
    # time measured ~0.5 us a chunk on an H200 at batch 1 (docs/measured/2026-11-28-h200/sampling.json).
    want = 4 if kernel.startswith(("sampling_from_probs", "sampling_from_logits")) else 3
    for arch in ("sm_80", "sm_90"):
        ops = [(op, mods) for _, op, mods, _ in _listing(arch)[kernel]]
        most = max(sum(1 for op, mods in ops[i:i + 24] if op == "LDG" and ".128" in mods) for i in range(len(ops)))
        assert most >= want, (kernel, arch, most)


@pytest.mark.parametrize("kernel", KERNELS)
def test_sass_shared_histograms_have_no_compare_and_swap_loops(kernel) -> None:
    # A 64-bit shared-memory add compiles to a compare-and-swap loop that retries under contention (every entry of
    # similar size shares a bin); the mass histograms add 32-bit words with a carry (sp_hist_add) and the count
    # select counts in 32 bits, both native adds.
    for arch in ("sm_80", "sm_90"):
        ops = [(op, mods) for _, op, mods, _ in _listing(arch)[kernel]]
        assert not [m for op, m in ops if op == "ATOMS" and "CAS" in m], (kernel, arch)
        # (the mask and the softmax keep no histogram: they select nothing by mass)
        assert any(op == "ATOMS" for op, _ in ops) or "mask" in kernel or "softmax" in kernel, (kernel, arch)


def test_zz_report_chi_square_figures(capsys) -> None:
    with capsys.disabled():
        for op, (stat, dof, p) in sorted(CHI2.items()):
            print(f"\nchi2 {op}: statistic {stat:.2f}, dof {dof}, p {p:.3f}")
