"""Bad-input fuzzing of every public op (docs/fuzzing.md).

Each op's valid call (tests/fuzz_specs.py) gets exactly one argument replaced by a wrong or edge input (wrong
dtype / rank / shape, empty, strided, NaN / inf, out-of-range indices, huge ints, NumPy + torch mixed, meta
tensors, wrong Python types, bad enum strings). The call must raise ArgumentError / ArgumentTypeError naming
that argument, or return what the float64 reference returns, with its inputs unchanged and nothing written
next to them (tests/fuzz_engine.py).

CI runs a fixed number of derandomized examples per op (FUZZ_EXAMPLES below, scaled by the op's weight);
a longer run: PYKERN_FUZZ_EXAMPLES=2000 [PYKERN_FUZZ_SEED=N] [PYKERN_FUZZ_OPS=rms_norm,torch.*]
python -m pytest -q tests/test_fuzz_bad_input.py
"""
from __future__ import annotations

import fnmatch
import json
import inspect
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

import pykern.ops
from fuzz_engine import ROLES, call_and_judge, classes_for, run_case, signature_params
from fuzz_specs import SPECS, torch_specs

# Examples per op in CI (an op's Spec.examples scales it): 40 x 60 specs keeps the module near 25 s on
# one core once the host kernels are built (measured: docs/fuzzing.md).
FUZZ_EXAMPLES = int(os.environ.get("PYKERN_FUZZ_EXAMPLES", "40"))
FUZZ_SEED = os.environ.get("PYKERN_FUZZ_SEED")
# PYKERN_FUZZ_SURVEY=file.jsonl: record every verdict there (one JSON line each) and fail nothing: a long
# run's list of findings (tools/fuzz_bad_input.py summarises it)
SURVEY = os.environ.get("PYKERN_FUZZ_SURVEY")
FUZZ_OPS = [g for g in os.environ.get("PYKERN_FUZZ_OPS", "").split(",") if g]

try:
    import torch  # noqa: F401

    ALL = {**SPECS, **torch_specs()}
except ImportError:  # pykern[torch] not installed: the NumPy ops are still fuzzed
    ALL = dict(SPECS)


def _selected(name: str) -> bool:
    return not FUZZ_OPS or any(fnmatch.fnmatchcase(name, g) for g in FUZZ_OPS)


NAMES = [n for n in ALL if _selected(n)]


def _public_ops() -> set[str]:
    names = set()
    for n in dir(pykern.ops):
        if n.startswith("_"):
            continue
        obj = getattr(pykern.ops, n)
        names.add(n)
        if isinstance(obj, type):  # a plan object: its public methods that take arrays are ops too
            names.update(f"{n}.{m}" for m in ("run",) if callable(getattr(obj, m, None)))
    return names


def _spec_base(name: str) -> str:
    return name.split("[")[0]


def test_every_public_op_is_fuzzed() -> None:
    # A new public op (or torch function) fails here until the spec table knows it.
    public = _public_ops()
    assert len([n for n in dir(pykern.ops) if not n.startswith("_")]) >= 45
    known = {_spec_base(n) for n in SPECS}
    assert public - known == set(), f"public ops the fuzzer does not know: {sorted(public - known)}"
    assert known - public == set(), f"specs of ops that are gone: {sorted(known - public)}"


def test_every_torch_function_is_fuzzed() -> None:
    pytest.importorskip("torch")
    import pykern.torch as pt

    funcs = {n for n in pt.__all__ if inspect.isfunction(getattr(pt, n))} - {"apply"}
    known = {n[len("torch."):] for n in ALL if n.startswith("torch.")}
    assert funcs - known == set(), f"pykern.torch functions the fuzzer does not know: {sorted(funcs - known)}"


@pytest.mark.parametrize("name", sorted(ALL))
def test_spec_covers_the_signature(name: str) -> None:
    # The spec gives every parameter of the signature a role (a new parameter fails here until it has one).
    spec = ALL[name]
    params = signature_params(spec)
    assert set(spec.roles) == set(params), (
        f"{name}: roles for {sorted(set(spec.roles) - set(params))} that the signature lacks, none for "
        f"{sorted(set(params) - set(spec.roles))}")
    assert set(spec.roles.values()) <= set(ROLES)
    kw = spec.build(np.random.default_rng(0))
    assert set(kw) <= set(params), f"{name}: the valid call passes {sorted(set(kw) - set(params))}"
    assert any(classes_for(spec.roles[p], kw[p]) for p in kw), f"{name}: nothing to fuzz"


@pytest.mark.parametrize("name", NAMES)
def test_valid_call_matches_reference(name: str) -> None:
    # The engine starts from this call: it must be valid and agree with the reference, or every verdict
    # on its mutations means nothing.
    spec = ALL[name]
    kw = spec.build(np.random.default_rng(1))
    if spec.torch:
        from fuzz_engine import to_torch

        kw = {k: to_torch(v) for k, v in kw.items()}
    outcome = call_and_judge(spec, kw, param="", cls="valid")  # any error fails: "" names no parameter
    assert outcome.what == "result"


# PYKERN_FUZZ_SHRINK=0 reports a failing input as found (a long run's survey), without minimising it
PHASES = tuple(Phase) if os.environ.get("PYKERN_FUZZ_SHRINK", "1") != "0" else (Phase.generate,)


def _settings(n: int) -> settings:
    return settings(max_examples=n, derandomize=FUZZ_SEED is None, deadline=None, database=None,
                    suppress_health_check=list(HealthCheck), print_blob=True, phases=PHASES)


@pytest.mark.parametrize("name", NAMES)
def test_bad_input(name: str) -> None:
    spec = ALL[name]
    n = max(1, round(FUZZ_EXAMPLES * spec.examples))

    @_settings(n)
    @given(st.data())
    def fuzz(data: st.DataObject) -> None:
        if SURVEY is None:
            run_case(spec, data)
            return
        try:
            outcome = run_case(spec, data)
            line = {"op": name, "param": outcome.param, "class": outcome.cls, "what": outcome.what,
                    "detail": outcome.detail}
        except AssertionError as e:
            line = {"op": name, "what": "FAIL", "detail": str(e).splitlines()[0][:400]}
        with open(SURVEY, "a") as f:
            f.write(json.dumps(line) + "\n")

    if FUZZ_SEED is not None:
        fuzz = seed(int(FUZZ_SEED))(fuzz)
    fuzz()


def test_torch_apply_rejects_non_models() -> None:
    # apply(model) is covered by a lighter property: a non-model argument is an error naming `model`, and
    # a bad flag type is an error naming the flag.
    pytest.importorskip("torch")
    import pykern.torch as pt
    from pykern.errors import ArgumentError, ArgumentTypeError

    for bad in (None, "llama", 3, np.zeros(3)):
        with pytest.raises((ArgumentError, ArgumentTypeError), match="model"):
            pt.apply(bad)
