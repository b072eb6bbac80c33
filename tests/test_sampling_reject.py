"""Top-k / top-p draws by rejection sampling with two pivots (kernels_cu/sampling.cu, sp_reject): the host kernel,
the numba reference and the NumPy rule (np_reject) agree token for token; every token lies in the filtered set on
adversarial rows (ties at the boundary, one-hot, uniform, very peaked, a long flat tail); the rounds stay bounded; the
draws follow the renormalized distribution (chi-square); rows split over several CTAs give the one-CTA tokens; the
read model (tools/sampling_model.py) counts the reads of the rounds the rule takes."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from pykern import ops
from pykern.arrays import bfloat16
from pykern.difftest.cases.sampling import (make_logits, make_probs, np_filtered_dist, np_reject, np_sample,
                                            np_sample_logits)

ROOT = Path(__file__).resolve().parent.parent


def _model():
    spec = importlib.util.spec_from_file_location("sampling_model", ROOT / "tools" / "sampling_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# --------------------------------------------------------------------------- adversarial rows
def _adversarial(vocab: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(17)
    rows = {
        "one_hot": np.eye(1, vocab, vocab // 3, dtype=np.float32)[0],
        "uniform": np.full(vocab, 1.0 / vocab, np.float32),
        # 8 large values, then 40 tied at the top-k / top-p boundary, then a flat tail
        "tie_at_boundary": np.concatenate([np.full(8, 0.05), np.full(40, 0.01), np.full(vocab - 48, 1e-4)]),
        "very_peaked": np.concatenate([[1.0 - 1e-6], np.full(vocab - 1, 1e-6 / (vocab - 1))]),
        "flat_tail": np.concatenate([np.geomspace(0.2, 0.01, 20), rng.uniform(1e-5, 2e-5, vocab - 20)]),
        "two_ties": np.concatenate([np.full(2, 0.3), np.full(vocab - 2, 0.4 / (vocab - 2))]),
    }
    out = {}
    for name, r in rows.items():
        r = np.asarray(r, np.float32)
        out[name] = rng.permutation(r / r.sum()).astype(np.float32)  # the large values anywhere in the row
    return out


FILTERS = [
    {"top_k": 1}, {"top_k": 5}, {"top_k": 9}, {"top_k": 30},
    {"top_p": 0.01}, {"top_p": 0.5}, {"top_p": 0.95},
    {"top_k": 20, "top_p": 0.3, "order": "joint"}, {"top_k": 9, "top_p": 0.999, "order": "joint"},
    {"top_k": 20, "top_p": 0.5, "order": "top_k_first"},
]


def _call(probs: np.ndarray, filt: dict, seed: int, **kw) -> np.ndarray:
    if "top_k" in filt and "top_p" in filt:
        return ops.top_k_top_p_sampling_from_probs(probs, filt["top_k"], filt["top_p"],
                                                   filter_apply_order=filt["order"], seed=seed, **kw)
    if "top_k" in filt:
        return ops.top_k_sampling_from_probs(probs, filt["top_k"], seed=seed, **kw)
    return ops.top_p_sampling_from_probs(probs, filt["top_p"], seed=seed, **kw)


def test_adversarial_rows_sample_inside_the_filtered_set_with_bounded_rounds() -> None:
    vocab, copies = 300, 40  # each row 40 times: 40 Philox streams
    rows = _adversarial(vocab)
    names = list(rows)
    probs = np.repeat(np.stack([rows[n] for n in names]), copies, axis=0)
    for filt in FILTERS:
        got = _call(probs, filt, 123, backend="host")
        rounds: list = []
        want, valid = np_sample(probs, 123, top_k=filt.get("top_k"), top_p=filt.get("top_p"),
                                order=filt.get("order", "top_k_first"), rounds=rounds)
        np.testing.assert_array_equal(got, want, err_msg=str(filt))
        assert valid.all()
        assert max(d for d, _ in rounds) <= 34, filt  # the pivots halve the key range: bounded
        for i, name in enumerate(names):
            support = np_filtered_dist(rows[name], top_k=filt.get("top_k"), top_p=filt.get("top_p"),
                                       order=filt.get("order", "top_k_first")) > 0
            toks = got[i * copies:(i + 1) * copies]
            assert support[toks].all(), (filt, name, toks[~support[toks]])


def test_adversarial_rows_need_few_rounds() -> None:
    # one-hot and uniform rows are kept at the first draw with no count read (the draw reaches the maximum's key);
    # a row of one large value and a flat tail takes more rounds at top-k 1 (a draw in the tail is rejected)
    rows = _adversarial(300)
    for name in ("one_hot", "uniform"):
        rounds: list = []
        np_sample(np.tile(rows[name], (16, 1)), 5, top_k=3, rounds=rounds)
        assert rounds == [(1, 0)] * 16, name
    rounds = []
    np_sample(np.tile(rows["flat_tail"], (64, 1)), 5, top_k=1, rounds=rounds)
    assert max(d for d, _ in rounds) > 1 and all(r == d - 1 or r == d for d, r in rounds)


def test_rejection_can_fail_a_wrong_acceptance() -> None:
    # the membership check above can fail: with a count limit above the top-k (an off-by-one), tokens outside it
    # come out of the same rule
    row = _adversarial(300)["flat_tail"]
    keys = row.view(np.uint32).astype(np.int64)
    q = np.floor(np.ldexp(row.astype(np.float64), 40 - int(np.frexp(row.max())[1]))).astype(np.int64)
    support = np_filtered_dist(row, top_k=1) > 0
    toks = [np_reject(keys, q, 1, 40, None, lambda j, s=s: (s * 2654435761 + j * 40503) % 2**32)[0]
            for s in range(64)]
    assert not support[toks].all()


@pytest.mark.parametrize("kind", ["f32", "bf16", "f16"])
def test_host_numba_and_numpy_agree_on_every_filter(kind: str) -> None:
    pytest.importorskip("numba")
    rng = np.random.default_rng(29)
    probs = make_probs(rng, 24, 45, kind, ties=True)
    x32 = np.asarray(probs, np.float32)
    k = rng.integers(0, 46, 24).astype(np.int32)
    p = rng.uniform(0.05, 1.0, 24).astype(np.float32)
    mp = rng.uniform(0.0, 0.5, 24).astype(np.float32)
    calls = [
        (lambda bk: ops.top_k_sampling_from_probs(probs, k, seed=3, offset=1, backend=bk),
         np_sample(x32, 3, 1, top_k=k)[0]),
        (lambda bk: ops.top_p_sampling_from_probs(probs, p, seed=3, offset=1, backend=bk),
         np_sample(x32, 3, 1, top_p=p)[0]),
        (lambda bk: ops.top_k_top_p_sampling_from_probs(probs, k, p, filter_apply_order="joint", seed=3, backend=bk),
         np_sample(x32, 3, top_k=k, top_p=p, order="joint")[0]),
    ]
    for fn, want in calls:
        np.testing.assert_array_equal(fn("host"), want)
        np.testing.assert_array_equal(fn("numba"), want)
    # top-k with min-p (one kernel, sampling_from_probs' flags): the min-p floor starts the draws
    want = np_sample(x32, 8, top_k=k, min_p=mp)[0]
    from pykern.ops import sampling as S
    got = S._sample(probs, top_k=k, min_p=mp, seed=8, backend="host")
    np.testing.assert_array_equal(got, want)
    got = S._sample(probs, top_p=p, min_p=mp, seed=8, backend="host")  # top-p's mass over the whole row
    np.testing.assert_array_equal(got, np_sample(x32, 8, top_p=p, min_p=mp, order="joint")[0])


def test_logits_host_numba_and_numpy_agree_joint() -> None:
    pytest.importorskip("numba")
    rng = np.random.default_rng(31)
    x = make_logits(rng, 16, 40, ties=True)
    k = rng.integers(0, 41, 16).astype(np.int32)
    p = rng.uniform(0.05, 1.0, 16).astype(np.float32)
    want = np_sample_logits(x, 6, top_k=k, top_p=p, temperature=0.8, order="joint")[0]
    for bk in ("host", "numba"):
        got = ops.top_k_top_p_sampling_from_logits(x, k, p, filter_apply_order="joint", seed=6, temperature=0.8,
                                                   backend=bk)
        np.testing.assert_array_equal(got, want)


# --------------------------------------------------------------------------- distribution
ROW = np.array([0.25, 0.18, 0.12, 0.1, 0.1, 0.07, 0.05, 0.05, 0.04, 0.04, 0.0, 0.0], np.float32)
ROW = (ROW / ROW.sum()).astype(np.float32)


@pytest.mark.parametrize("filt", [{"top_k": 3, "top_p": 0.7, "order": "joint"},
                                  {"top_k": 4, "top_p": 0.99, "order": "joint"}], ids=["joint_tie", "joint_k"])
def test_joint_chi_square(filt) -> None:
    from tests.test_sampling import _chi_square  # the shared chi-square (support checked first)

    draws = 4000
    got = _call(np.tile(ROW, (draws, 1)), filt, 77, backend="host")
    stat, dof, pv = _chi_square(got, np_filtered_dist(ROW, top_k=filt["top_k"], top_p=filt["top_p"], order="joint"))
    assert pv > 1e-3, (stat, dof, pv)


# --------------------------------------------------------------------------- split rows
@pytest.mark.parametrize("kind", ["f32", "bf16"])
def test_split_top_k_top_p_rows_give_the_one_cta_tokens(kind: str) -> None:
    vocab = 20000
    rng = np.random.default_rng(41)
    x = np.asarray(make_probs(rng, 5, vocab, "f32"), np.float32)
    x[0] = rng.random(vocab) + 0.5  # nearly flat: many rounds at a small k
    x[1, : vocab - 50] *= 1e-6  # the mass at the end of the row
    x[2] = 0.0  # no mass: no token
    x = x / x.sum(1, keepdims=True).clip(1e-30)
    probs = x.astype(bfloat16() if kind == "bf16" else np.float32)
    x32 = np.asarray(probs, np.float32)
    for filt in ({"top_k": 7}, {"top_p": 0.3}, {"top_k": 50, "top_p": 0.2, "order": "joint"}):
        want, want_valid = np_sample(x32, 13, top_k=filt.get("top_k"), top_p=filt.get("top_p"),
                                     order=filt.get("order", "top_k_first"))
        for c in (1, 2, 7):
            got, valid = _call(probs, filt, 13, ctas_per_row=c, return_valid=True, backend="host")
            np.testing.assert_array_equal(got, want, err_msg=f"{filt} ctas_per_row={c}")
            np.testing.assert_array_equal(np.asarray(valid), want_valid)


def test_split_logits_and_min_p_rows_give_the_one_cta_tokens() -> None:
    rng = np.random.default_rng(43)
    x = make_logits(rng, 4, 9000)
    want = np_sample_logits(x, 2, top_k=11, top_p=0.6, order="joint")[0]
    for c in (1, 3):
        got = ops.top_k_top_p_sampling_from_logits(x, 11, 0.6, filter_apply_order="joint", seed=2, ctas_per_row=c,
                                                   backend="host")
        np.testing.assert_array_equal(got, want)
    from pykern.ops import sampling as S
    probs = make_probs(rng, 3, 9000)
    want = np_sample(probs, 4, top_p=0.4, min_p=0.05, order="joint")[0]  # top-p over the whole row: one more read
    for c in (1, 4):
        np.testing.assert_array_equal(S._sample(probs, top_p=0.4, min_p=0.05, seed=4, ctas_per_row=c,
                                                backend="host"), want)


def test_top_k_first_keeps_one_cta_and_its_tokens() -> None:
    rng = np.random.default_rng(47)
    probs = make_probs(rng, 3, 5000)
    want = np_sample(probs, 9, top_k=40, top_p=0.5)[0]
    got = ops.top_k_top_p_sampling_from_probs(probs, 40, 0.5, seed=9, ctas_per_row=4, backend="host")
    np.testing.assert_array_equal(got, want)


# --------------------------------------------------------------------------- read model
def test_model_counts_the_reads_of_the_rule_rounds() -> None:
    m = _model()
    # one round kept at the maximum: max, S (with the segment sums), one segment: 2 reads and a bit
    assert m.reject_reads(draws=1, count_reads=0, one_window=True) == pytest.approx(2.0, abs=0.01)
    # one round with its count read: 3 full reads; each further round one count read and a segment
    assert m.reject_reads(draws=1, count_reads=1, one_window=True) == pytest.approx(3.0, abs=0.01)
    assert m.reject_reads(draws=4, count_reads=4, one_window=True) == pytest.approx(6.0, abs=0.05)
    # past one window a draw reads the row up to the draw: half a row on average
    assert m.reject_reads(draws=2, count_reads=1, one_window=False) == pytest.approx(2 + 1 + 2 * 0.5)
    # the rule's rounds on a one-hot row: 2 reads at top-k, where the radix select took 4 (f32)
    rounds: list = []
    np_sample(np.eye(1, 1000, 7, dtype=np.float32), 1, top_k=5, rounds=rounds)
    assert rounds == [(1, 0)]
    assert m.reject_reads(*rounds[0], one_window=True) < m.RADIX_READS["top_k"]["f32"]
    # split rows: the first two reads over C CTAs, the rounds after the first in the last CTA
    # (every CTA reads the whole row for the maximum, its 1/C for S, the last the drawn range and the count reads)
    assert m.reject_reads(draws=1, count_reads=1, one_window=True, ctas=8) == pytest.approx(1 + 2 / 8 + 1)
    assert m.reject_reads(draws=3, count_reads=2, one_window=False, ctas=4) == pytest.approx(1 + 2 / 4 + 2 + 1.0)
    # a flat-tailed row at top-k 1 takes more rounds than a one-hot one, and the model charges them
    d, r = m.rule_rounds(top_k=1, vocab=4096, seeds=8)
    assert d >= 1 and r >= 1 and m.reject_reads(d, r) == pytest.approx(2 + r)
