"""Rows split over several CTAs (kernels_cu/sampling.cu, sp_split_last): plain, min-p and from-logits draws (and the
top-k / top-p rejection rounds, tests/test_sampling_reject.py) give the same tokens for 1, 2 and 7 CTAs a row as the one-thread NumPy rule, under the host backend's forward, reverse,
random and interleaved block orders and under racecheck and initcheck (the partials and the ticket are ordered by an
acquire-release atomic increment), and the SASS keeps that ticket and the strong loads of the partials."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pykern import ArgumentError, ArgumentTypeError, ops
from pykern.arrays import bfloat16
from pykern.difftest.cases.sampling import make_logits, make_probs, np_sample, np_sample_logits
from sass_helpers import report, source_sass

ROOT = Path(__file__).resolve().parent.parent
VOCAB = 20000  # f32: 10 chunks of 2048 (16-byte loads), bf16 / f16: 5 of 4096; 7 CTAs own 1 or 2 (or 0) each
SEEDS = (3, 11)


def _rows(kind: str) -> tuple[np.ndarray, np.ndarray]:
    """Six rows whose draws land in different CTAs' ranges: nearly flat rows (the draw anywhere), a row with its mass
    at the end (the last range), one at the start, a row without mass and a row with a NaN (no token, no ticket)."""
    rng = np.random.default_rng(5)
    x = np.asarray(make_probs(rng, 6, VOCAB, "f32"), np.float32)
    x[0] = rng.random(VOCAB) + 0.5
    x[1] = rng.random(VOCAB) + 0.5
    x[2, : VOCAB - 50] *= 1e-6
    x[3, 40:] *= 1e-6
    x[4] = 0.0
    x[5, 123] = np.nan
    x = x / np.nansum(x, 1, keepdims=True).clip(1e-30)
    probs = x.astype(bfloat16() if kind == "bf16" else np.float16 if kind == "f16" else np.float32)
    return probs, np.asarray(probs, np.float32)


@pytest.mark.parametrize("kind", ["f32", "bf16", "f16"])
def test_split_rows_give_the_one_cta_tokens(kind: str) -> None:
    probs, x = _rows(kind)
    for seed in SEEDS:
        want, want_valid = np_sample(x, seed, 9)
        assert list(want_valid) == [True] * 4 + [False, False]
        for ctas in (1, 2, 7):
            got, valid = ops.sampling_from_probs(probs, seed=seed, offset=9, return_valid=True, ctas_per_row=ctas,
                                                 backend="host")
            np.testing.assert_array_equal(got, want, err_msg=f"{kind} seed {seed} ctas {ctas}")
            np.testing.assert_array_equal(np.asarray(valid), want_valid)
    # the draws fall in several CTAs' ranges (10 chunks over 7 CTAs in f32: ranges of 1 or 2 chunks)
    assert want[2] >= VOCAB - 50 and want[3] < 40


def test_split_min_p_and_logits_give_the_one_cta_tokens() -> None:
    probs, x = _rows("f32")
    rng = np.random.default_rng(8)
    logits = make_logits(rng, 4, VOCAB + 1, "f32")  # odd: one element a thread
    logits[3, 7] = np.inf  # no distribution: no token
    t = np.array([0.5, 1.0, 3.0, 1.0], np.float32)
    for seed in SEEDS:
        want_p, _ = np_sample(x, seed, 0, min_p=0.4)
        want_l, want_lv = np_sample_logits(logits, seed, 0, temperature=t)
        assert not want_lv[3]
        for ctas in (2, 7):
            got = ops.min_p_sampling_from_probs(probs, 0.4, seed=seed, ctas_per_row=ctas, backend="host")
            np.testing.assert_array_equal(got, want_p, err_msg=f"min_p seed {seed} ctas {ctas}")
            got, valid = ops.sampling_from_logits(logits, seed=seed, return_valid=True, temperature=t,
                                                  ctas_per_row=ctas, backend="host")
            np.testing.assert_array_equal(got, want_l, err_msg=f"logits seed {seed} ctas {ctas}")
            np.testing.assert_array_equal(np.asarray(valid), want_lv)


def test_split_rows_reuse_their_workspace_and_many_rows() -> None:
    # 40 rows, one ticket counter each, kept between calls: the last ticket wraps it to 0, so calls with other CTA
    # counts and batches after it find it zeroed (a counter left at C, or one laid out by C, fails the later calls)
    rng = np.random.default_rng(2)
    x = np.asarray(make_probs(rng, 40, 5000, "f32"), np.float32)
    want, _ = np_sample(x, 77, 1)
    for ctas, rows in ((3, 40), (3, 40), (7, 40), (2, 11), (5, 40)):
        got = ops.sampling_from_probs(x[:rows], seed=77, offset=1, ctas_per_row=ctas, backend="host")
        np.testing.assert_array_equal(got, want[:rows], err_msg=f"ctas {ctas} rows {rows}")


_SCHEDULE_SCRIPT = r"""
import numpy as np
from pykern import ops
from pykern.difftest.cases.sampling import make_probs, np_sample
rng = np.random.default_rng(4)
x = np.asarray(make_probs(rng, 3, 9000, "f32"), np.float32)
x[1] = rng.random(9000) + 0.5
x[1] /= x[1].sum()
want, _ = np_sample(x, 5, 2)
for ctas in (2, 7):
    got = ops.sampling_from_probs(x, seed=5, offset=2, ctas_per_row=ctas, backend="host")
    assert list(got) == list(want), (ctas, got, want)
# the rejection rounds (sp_reject): one CTA (the pivots' segment sums swapped in shared memory) and split rows
rounds = []
want, _ = np_sample(x, 5, 2, top_k=20, top_p=0.5, order="joint", rounds=rounds)
assert max(d for d, _ in rounds) > 2, rounds  # the flat row takes several rounds
for ctas in (1, 3):
    got = ops.top_k_top_p_sampling_from_probs(x, 20, 0.5, filter_apply_order="joint", seed=5, offset=2,
                                              ctas_per_row=ctas, backend="host")
    assert list(got) == list(want), (ctas, got, want)
print("ok")
"""


@pytest.mark.parametrize("env", [{"PYKERN_HOST_SCHEDULE": "reverse"}, {"PYKERN_HOST_SCHEDULE": "random:13"},
                                 {"PYKERN_HOST_SCHEDULE": "interleave:3"}, {"PYKERN_HOST_RACECHECK": "1"},
                                 {"PYKERN_HOST_INITCHECK": "1"}],
                         ids=["reverse", "random", "interleave", "racecheck", "initcheck"])
def test_split_rows_under_other_block_orders_and_racecheck(env: dict[str, str]) -> None:
    import os

    e = {k: v for k, v in os.environ.items() if not k.startswith("PYKERN_HOST_")}
    e.update(env)
    e["PYTHONPATH"] = str(ROOT) + os.pathsep + e.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", _SCHEDULE_SCRIPT], cwd=ROOT, env=e, capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout[-2000:] + r.stderr[-4000:]


@pytest.mark.parametrize("value, err, pattern", [
    (0, ArgumentError, r"ctas_per_row: expected an int in \[1, 16\], got 0"),
    (17, ArgumentError, r"ctas_per_row: expected an int in \[1, 16\], got 17"),
    (2.0, ArgumentTypeError, r"ctas_per_row: expected an int or None, got float"),
    (True, ArgumentTypeError, r"ctas_per_row: expected an int or None, got bool"),
])
def test_ctas_per_row_is_checked(value: object, err: type, pattern: str) -> None:
    with pytest.raises(err, match=pattern):
        ops.sampling_from_probs(np.full((1, 8), 0.125, np.float32), seed=1, ctas_per_row=value, backend="host")


SPLIT_KERNELS = [f"sampling_from_{w}{s}" for w in ("probs", "logits") for s in ("", "_bf16", "_f16")]


def _listing(arch: str) -> dict:
    """{kernel: instructions} of sampling.cu's cubin for arch (skips without NVRTC or cuobjdump)."""
    return report()._instructions(source_sass("sampling.cu", arch))


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_sass_split_ticket_is_an_acq_rel_inc_and_partials_strong_loads(arch: str) -> None:
    # The ticket is one GPU-scope atomic increment (atom.acq_rel.gpu.inc: it wraps the last ticket to 0) and the last
    # CTA reads the partials with strong GPU-scope loads (never a stale L1 line); plain loads there would read what
    # L1 held, and a plain atomicAdd would leave the counter set for the next launch.
    ins = _listing(arch)
    for k in SPLIT_KERNELS:
        ops = {op + m for _, op, m, _ in ins[k]}
        assert "ATOMG.E.INC.STRONG.GPU" in ops, (k, arch, sorted(o for o in ops if o.startswith("ATOM")))
        assert "LDG.E.STRONG.GPU" in ops, (k, arch)
        assert not any(o.startswith(("LDL", "STL")) for o in ops), (k, arch)  # no spills, no stack arrays


def test_split_rows_follow_indices() -> None:
    # indices map output b to row indices[b]: each output's CTAs, partials, ticket and Philox word are output b's
    # (a repeated row draws twice, with two words)
    probs, x = _rows("f32")
    idx = np.array([1, 0, 1, 3, 5, 1], np.int32)
    want, want_valid = np_sample(x, 21, 4, indices=idx)
    assert want[0] != want[2] or want[2] != want[5]  # the repeats draw differently
    for ctas in (2, 7):
        got, valid = ops.sampling_from_probs(probs, indices=idx, seed=21, offset=4, return_valid=True,
                                             ctas_per_row=ctas, backend="host")
        np.testing.assert_array_equal(got, want, err_msg=f"ctas {ctas}")
        np.testing.assert_array_equal(np.asarray(valid), want_valid)
