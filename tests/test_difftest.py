"""The differential tests under pytest: every case on two host schedules (they must agree), on the numba
simulator, and (with a GPU) on nvrtc; plus coverage of the registry and the harness's own failure path."""
from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import pykern
from pykern.difftest import runner
from pykern.reference.base import references
from pykern.tolerance import TOLERANCES

from family_helpers import difftest_cases

ROOT = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent
CASES = list(difftest_cases())  # runner.collect_cases(seed=0), shared with tests/test_host_modes.py
IDS = [c.id for c in CASES]


def _nvrtc_why() -> str:
    from pykern.backends import get_backend

    ok, why = get_backend("nvrtc").available()
    return "" if ok else why


def _check(res: runner.CaseResult) -> None:
    assert res.passed, "\n".join(res.failures()) or f"{res.case.id}: verdict {res.verdict}"


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_host_schedules(case: runner.Case) -> None:
    # forward and reverse each within tolerance of NumPy, and within tolerance of each other:
    # a missing barrier shows up as a disagreement between the two orders.
    _check(runner.run_case(case, runner.parse_labels("host:forward,host:reverse")))


def _numba_cases() -> list[runner.Case]:
    """The cases test_numba runs: every case, except that where several element types of one shape launch
    kernels with the same numba references (bf16 and f16 instantiations share one reference: the
    simulator runs the same Python on inputs widened to float32), the simulator runs that shape once, in
    the type of the op that has run least so far (and each type of an op at least once). So every shape of every op and every (op, dtype) still
    runs on the simulator (test_numba_subset_keeps_every_shape_and_dtype), and the host runs every case
    in every type under two schedules (test_host_schedules); it halves the slowest simulator rows (the
    tensor-core attention backward's, tens of seconds a case)."""
    refs = references()
    groups: dict[object, list[runner.Case]] = {}
    for c in CASES:
        try:
            key: object = (c.op, c.shape, c.note, frozenset(id(refs[k]) for k in c.kernels))
        except KeyError:  # a kernel without a reference: test_every_kernel_has_reference_and_cases says so
            key = c.id
        groups.setdefault(key, []).append(c)
    used: dict[tuple[str, str], int] = {}
    keep = set()
    for cs in groups.values():
        pick = min(cs, key=lambda c: used.get((c.op, c.dtype), 0))  # ties: the first (CASES order)
        used[(pick.op, pick.dtype)] = used.get((pick.op, pick.dtype), 0) + 1
        keep.add(pick.id)
    for c in CASES:  # an op with fewer shapes than types: its first case of each type left out
        if (c.op, c.dtype) not in used:
            used[(c.op, c.dtype)] = 1
            keep.add(c.id)
    return [c for c in CASES if c.id in keep]


NUMBA_CASES = _numba_cases()


def test_numba_subset_keeps_every_shape_and_dtype() -> None:
    small = [c for c in CASES if c.note != "big"]
    run = [c for c in NUMBA_CASES if c.note != "big"]
    assert {(c.op, c.dtype) for c in run} == {(c.op, c.dtype) for c in small}
    assert {(c.op, c.shape) for c in run} == {(c.op, c.shape) for c in small}
    assert len(run) < len(small)


def _skip_not_applicable(case: runner.Case, labels: list[runner.Label]) -> None:
    """Skip, saying why, when none of `labels` can run the case (an sm_90a case off the host backend)."""
    why = [runner.not_applicable(case, lb) for lb in labels]
    if all(why):
        pytest.skip("; ".join(f"{lb.text}: {w}" for lb, w in zip(labels, why)))


@pytest.mark.parametrize("case", NUMBA_CASES, ids=[c.id for c in NUMBA_CASES])
def test_numba(case: runner.Case) -> None:
    if case.note == "big":
        pytest.skip("big case: the numba simulator is too slow (host vs NumPy covers it)")
    labels = runner.parse_labels("numba")
    _skip_not_applicable(case, labels)
    _check(runner.run_case(case, labels))


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_nvrtc(case: runner.Case) -> None:
    why = _nvrtc_why()
    if why:
        pytest.skip(f"needs a GPU: {why}")
    labels = runner.parse_labels("nvrtc,numba")
    _skip_not_applicable(case, labels)
    _check(runner.run_case(case, labels))


def test_every_kernel_has_reference() -> None:
    # Kernels built only for an arch-specific target (`// pykern: arch sm_90a`: TMA tensor maps, wgmma) have no
    # numba reference (numba has neither): their cases (pykern/difftest/cases/_sm90.py helpers) run on the host backend
    # playing sm_90a against float64. That every kernel, those included, has a case: test_difftest_coverage.py.
    refs = references()
    names = [s.name for s in pykern.kernels() if not s.archs]
    assert names, "the registry is empty"
    assert [n for n in names if n not in refs] == [], "kernels without a numba reference"


def test_cases_are_well_formed() -> None:
    assert len(set(IDS)) == len(IDS), sorted({i for i in IDS if IDS.count(i) > 1})
    known = {s.name for s in pykern.kernels()}
    for c in CASES:
        assert (c.op, c.dtype) in TOLERANCES, c.id
        assert set(c.kernels) <= known, (c.id, set(c.kernels) - known)


def test_reference_signatures_match_specs() -> None:
    from pykern.backends import get_backend

    cuda = get_backend("numba").cuda_module()
    refs = references()
    for spec in (s for s in pykern.kernels() if not s.archs):  # arch-specific kernels: see above
        kernel, config = refs[spec.name].build(cuda)
        params = list(inspect.signature(kernel.py_func).parameters)
        assert len(params) == len(spec.params), (spec.name, params, [p.name for p in spec.params])
        assert callable(config), spec.name


_PTX_SCRIPT = r"""
import sys, types
import numpy as np, numba, numba.cuda as cuda
import numba.cuda.dispatcher as dispatcher
import pykern
from pykern.reference.base import references
assert not cuda.jit.__module__.startswith("numba.cuda.simulator")
# Device functions ask the current device for its arch; there is none here, so name one.
dispatcher.get_current_device = lambda: types.SimpleNamespace(compute_capability=(7, 5))
DT = {"float": np.float32, "double": np.float64, "int": np.int32, "unsigned int": np.uint32,
      "long long": np.int64, "unsigned long long": np.uint64, "unsigned char": np.uint8, "char": np.int8,
      "signed char": np.int8, "short": np.int16, "bool": np.bool_}
SC = {"float": numba.float32, "double": numba.float64, "bool": numba.boolean}
def argtype(p):
    if p.is_pointer:  # bf16 / f16 arrays reach references widened to float32
        base = "float" if p.pointee in ("unsigned short", "__nv_bfloat16", "__half") else p.pointee
        return numba.types.Array(numba.from_dtype(np.dtype(DT[base])), 1, "C")
    return SC.get(p.ctype, numba.int64)  # integers arrive as Python ints
done, bad = set(), []
for spec in pykern.kernels():
    if spec.archs:  # arch-specific kernels (wgmma, TMA) have no numba reference: see above
        continue
    ref = references()[spec.name]
    if id(ref) in done:
        continue
    done.add(id(ref))
    kernel, _ = ref.build(cuda)
    try:
        cuda.compile_ptx(kernel.py_func, tuple(argtype(p) for p in spec.params), cc=(7, 5))
    except Exception as e:
        bad.append(f"{spec.name}: {type(e).__name__}: {str(e)[:400]}")
print("\n".join(bad) or f"ok {len(done)}")
sys.exit(1 if bad else 0)
"""


def test_references_compile_for_a_real_gpu() -> None:
    # The simulator runs plain Python; a GPU runs numba's typed compile. Compile every reference to
    # PTX (numba-cuda with libNVVM, no device needed) so a GPU user's numba fallback works too.
    probe = subprocess.run([sys.executable, "-c", "import numba.cuda.cudadrv.nvvm as n; n.NVVM()"],
                           capture_output=True, text=True, cwd=ROOT, env=_env(NUMBA_ENABLE_CUDASIM="0"))
    if probe.returncode != 0:
        pytest.skip(f"libNVVM not found: {probe.stderr.strip().splitlines()[-1:]}")
    r = subprocess.run([sys.executable, "-c", _PTX_SCRIPT], capture_output=True, text=True, cwd=ROOT,
                       env=_env(NUMBA_ENABLE_CUDASIM="0"), timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]


# ----------------------------------------------------------------------------------------------- the CLI
def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYKERN_KERNEL_PATH", "PYKERN_DIFFTEST_EXTRA",
                                                              "NUMBA_ENABLE_CUDASIM")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def _difftest(*args: str, timeout: float = 300, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pykern.difftest", *args], capture_output=True, text=True,
                          cwd=ROOT, env=_env(**env), timeout=timeout)


def test_harness_catches_wrong_kernel() -> None:
    # tests/wrong_cu holds pk_test_scale with an off-by-one bound; tests/difftest_extra/cu holds correct
    # test kernels. Only the wrong one's case may fail, and the failure must name it.
    path = os.pathsep.join([str(HERE / "difftest_extra" / "cu"), str(HERE / "wrong_cu")])
    r = _difftest("--kernels", "pk_test*", "--backends", "host,numba",
                  PYKERN_KERNEL_PATH=path, PYKERN_DIFFTEST_EXTRA=str(HERE / "difftest_extra" / "pk_test.py"))
    assert r.returncode == 1, r.stdout + r.stderr
    rows = {line.split()[0]: line for line in r.stdout.splitlines() if line.startswith("pk_test")}
    assert rows["pk_test_scale[f32]100"].rstrip().endswith("FAIL"), r.stdout
    assert [k for k, v in rows.items() if not v.rstrip().endswith("ok")] == ["pk_test_scale[f32]100"], r.stdout
    failures = r.stdout.split("Failures:")[1]
    assert "pk_test_scale[f32]100 on host: output 'y'" in failures and "worst at (99,)" in failures, failures
    assert "on numba" not in failures  # the reference itself is right
    assert "host vs numba on 'y'" in failures  # and the backends disagree


def _kernels_by_source() -> dict[str, list[str]]:
    from pykern import registry

    out: dict[str, list[str]] = {}
    for spec in registry.kernels():
        out.setdefault(spec.source.name, []).append(spec.name)
    return out


KERNELS_BY_SOURCE = _kernels_by_source()


def _sanitizer_parts() -> dict[str, list[str]]:
    """The sanitizer run's parts: one per .cu file, and a file with many kernels split by element type
    (f32 / _bf16 / _f16 / other suffixes), so no single ASan subprocess grows with every new instantiation.
    A case whose kernels span two parts runs in both: coverage over time."""
    parts: dict[str, list[str]] = {}
    for source, names in KERNELS_BY_SOURCE.items():
        if len(names) <= 12:
            parts[source] = names
            continue
        for n in names:
            kind = "bf16" if "_bf16" in n else "f16" if "_f16" in n else "f32"
            parts.setdefault(f"{source}:{kind}", []).append(n)
    return parts


SANITIZER_PARTS = _sanitizer_parts()


def test_sanitizer_families_cover_every_case() -> None:
    # The sanitizer run below is split per .cu file (one ASan build and one subprocess each, spread over
    # the pytest workers); together the parts must still cover every non-big case.
    every = {k for names in SANITIZER_PARTS.values() for k in names}
    assert every == {k for names in KERNELS_BY_SOURCE.values() for k in names}
    assert all(set(c.kernels) <= every for c in CASES if c.note != "big")


# Ordered by element type, then file: the parts of one file (one ASan library, built by whichever part comes
# first and then cached) sit a file apart, so two pytest workers do not build the same library side by side.
@pytest.mark.parametrize("part", sorted(SANITIZER_PARTS, key=lambda p: (p.partition(":")[2], p)))
def test_all_cases_under_sanitizer(part: str) -> None:
    # Every (non-big) case through the AddressSanitizer + UBSan host build: out-of-bounds reads and
    # writes, which the plain build may survive, fail here. The CLI re-runs itself with ASan preloaded.
    from pykern.backends.host import sanitizer_preload

    if sanitizer_preload() is None:
        pytest.skip("the C++ compiler has no libasan.so")
    names = SANITIZER_PARTS[part]
    want = [c for c in CASES if c.note != "big" and any(k in names for k in c.kernels)]
    if not want:
        pytest.skip(f"no non-big case launches a kernel of {part}")
    r = _difftest("--backends", "host:sanitize", "--no-big", "--json", "--kernels", ",".join(names), timeout=900)
    assert r.returncode == 0, r.stdout[-5000:] + r.stderr[-5000:]
    summary = json.loads(r.stdout)["summary"]
    assert summary["cases"] == summary["passed"] == len(want), summary


def test_harness_passes_good_test_kernels_json() -> None:
    r = _difftest("--kernels", "pk_test*", "--backends", "host:forward,host:reverse,numba", "--json",
                  PYKERN_KERNEL_PATH=str(HERE / "difftest_extra" / "cu"),
                  PYKERN_DIFFTEST_EXTRA=str(HERE / "difftest_extra" / "pk_test.py"))
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads(r.stdout)
    assert doc["summary"]["cases"] == doc["summary"]["passed"] == 6
    assert doc["summary"]["backends"] == ["host:forward", "host:reverse", "numba"]
    bf16 = next(c for c in doc["cases"] if c["id"] == "pk_test_axpy[bf16]200")
    assert [b["status"] for b in bf16["backends"]] == ["ok", "ok", "ok"]
    assert 0 < bf16["backends"][0]["max_abs"] <= bf16["atol"] + bf16["rtol"] * 4  # bf16 rounding, not zero


def test_cli_usage_errors() -> None:
    r = _difftest("--kernels", "no_such_kernel_*")
    assert r.returncode == 2 and "no case matches" in r.stderr
    r = _difftest("--backends", "host,cuda")
    assert r.returncode == 2 and "'cuda'" in r.stderr
    r = _difftest("--backends", "host:sideways")
    assert r.returncode == 2 and "sideways" in r.stderr


# ----------------------------------------------------------------------------------------------- comparison
def test_compare_flags_nan_inf_and_shape() -> None:
    ref = np.array([1.0, -2.0, 0.0])
    assert runner.compare("y", ref.astype(np.float32), ref, 1e-5, 1e-4).ok
    bad = runner.compare("y", np.array([1.0, np.nan, 0.0]), ref, 1e-5, 1e-4)
    assert not bad.ok and "(1,)" in bad.detail and bad.max_abs == np.inf
    assert not runner.compare("y", np.array([1.0, -2.0, 1e-4]), ref, 1e-5, 1e-4).ok  # atol at ref = 0
    assert runner.compare("y", np.array([np.inf, np.nan]), np.array([np.inf, np.nan]), 0, 0).ok
    assert not runner.compare("y", np.array([-np.inf, 1.0]), np.array([np.inf, 1.0]), 0, 0).ok
    assert not runner.compare("y", np.zeros((2, 3)), np.zeros(6), 0, 0).ok
    assert runner.pair_diff(np.array([1.0, 2.0]), np.array([1.0, 2.0001]), np.array([1.0, 2.0]), 1e-5, 1e-4)[1]
    assert not runner.pair_diff(np.array([1.0, 2.0]), np.array([1.0, 2.1]), np.array([1.0, 2.0]), 1e-5, 1e-4)[1]


def test_labels() -> None:
    lbs = runner.parse_labels("host:random:7,numba,host:sanitize")
    assert [(lb.backend, lb.env) for lb in lbs] == [
        ("host", (("PYKERN_HOST_SCHEDULE", "random:7"),)), ("numba", ()), ("host", (("PYKERN_HOST_SANITIZE", "1"),))
    ]
    # Any schedule PYKERN_HOST_SCHEDULE accepts is a valid label (one parser for both).
    assert runner.parse_label("host:random:0x1f").env == (("PYKERN_HOST_SCHEDULE", "random:0x1f"),)
    with pytest.raises(pykern.ArgumentError, match="random:SEED"):
        runner.parse_label("host:random:-3")
    with pytest.raises(pykern.ArgumentError, match="listed twice"):
        runner.parse_labels("host,host")
    with pytest.raises(pykern.ArgumentError, match="only host"):
        runner.parse_labels("numba:reverse")


def test_missing_extra_module_is_a_usage_error(capsys) -> None:
    from pykern.difftest.__main__ import main

    with pytest.raises(pykern.ArgumentError, match=r"expected a module name or an existing \.py file, got "
                                                     r"'no_such_mod_xyz'"):
        runner.load_extra("no_such_mod_xyz")
    assert main(["--extra", "no_such_mod_xyz", "--list"]) == 2  # not a traceback
    assert "no_such_mod_xyz" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------- summary
def _summary_block(stdout: str) -> str:
    return stdout.split("\nSummary: ", 1)[1]


def test_cli_summary_names_each_backend_and_what_did_not_run() -> None:
    r = _difftest("--kernels", "transpose_2d", "--backends", "host,numba")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr
    block = _summary_block(r.stdout)
    assert block.startswith("8 cases\n"), block
    assert "  host   ran 8: 8 passed, 0 failed, 0 errors\n" in block, block
    assert "  numba  ran 8: 8 passed, 0 failed, 0 errors" in block, block


def test_cli_bare_install_runs_what_it_can_and_says_why_not_the_rest(monkeypatch, capsys) -> None:
    # After the main install neither ml_dtypes nor numba is there: the default run goes on with host,
    # runs the f32 and f16 cases, and names what skipped the rest and which extra brings it back.
    from pykern import arrays
    from pykern.backends import get_backend
    from pykern.difftest.__main__ import main
    from pykern.errors import MissingDependency

    def no_ml_dtypes():
        raise MissingDependency("ml_dtypes", "test", "bfloat16 NumPy arrays")

    monkeypatch.setattr(arrays, "bfloat16", no_ml_dtypes)
    monkeypatch.setattr(get_backend("numba"), "available", lambda: (False, "numba backend: numba-cuda is not importable"))
    monkeypatch.setattr(runner, "importable", lambda name: name != "numba.cuda")
    nvrtc_ok = not _nvrtc_why()
    assert main(["--kernels", "transpose_2d*", "--backends", "host"] if nvrtc_ok else
                ["--kernels", "transpose_2d*"]) == 0
    cap = capsys.readouterr()
    assert "difftest: 6 of the 18 selected cases will be skipped: missing ml_dtypes: pip install 'pykern[test]'" \
        in cap.err
    block = _summary_block(cap.out)
    assert "  host   ran 12: 12 passed, 0 failed, 0 errors; skipped 6\n" in block, block  # f32 and f16
    assert "6 skipped: missing ml_dtypes: pip install 'pykern[test]'" in block, block
    if not nvrtc_ok:
        assert "numba  not run: numba backend: numba-cuda is not importable (pip install 'pykern[numba]')" in block
        assert "nvrtc  not run: " in block and "(needs a CUDA GPU and driver)" in block
    rows = [ln for ln in cap.out.splitlines() if ln.startswith("transpose_2d[bf16]")]
    assert len(rows) == 6 and all(ln.endswith("skip (host skipped: missing ml_dtypes: pip install 'pykern[test]')")
                                  for ln in rows), rows
    # A backend named on the command line that cannot run stays a usage error.
    assert main(["--kernels", "transpose_2d*", "--backends", "host,numba"]) == 2
    assert "pip install 'pykern[numba]'" in capsys.readouterr().err


def test_without_ml_dtypes_every_case_is_collected_and_the_runnable_ones_keep_their_data(monkeypatch) -> None:
    # bf16 data is drawn as float32 stand-ins so the random streams stay those of a full install: a case
    # that still runs must see exactly the data (and so the reference) it sees with ml_dtypes.
    from pykern import arrays
    from pykern.errors import MissingDependency

    full = {c.id: c for c in CASES}

    def no_ml_dtypes():
        raise MissingDependency("ml_dtypes", "test", "bfloat16 NumPy arrays")

    monkeypatch.setattr(arrays, "bfloat16", no_ml_dtypes)
    bare = runner.collect_cases(seed=0)
    assert [c.id for c in bare] == IDS and not runner.SKIPPED
    pending = runner.pending_skips(bare)
    # bf16 and fp8 (whose NumPy types are ml_dtypes') cases need it, and so do f16 queries over an FP8 KV
    # cache and the fp32-result GEMMs of bf16 inputs; the other f32 and f16 ones run
    def needs(c) -> bool:
        return (c.dtype in ("bf16", "fp8") or "e4m3kv" in c.id or "e5m2kv" in c.id or "f32out-bf16" in c.id
                or "f32out-from-bf16" in c.id)

    assert pending == {"missing ml_dtypes: pip install 'pykern[test]'": sum(needs(c) for c in CASES)}
    runnable = [c for c in bare if not getattr(c.run, "skip_reason", None)]
    assert len(runnable) == sum(not needs(c) for c in CASES) > 300  # f16 is NumPy's own
    for c in runnable:
        got, want = c.reference(), full[c.id].reference()
        assert set(got) == set(want)
        for k in want:
            np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]), err_msg=f"{c.id} {k}")
    res = runner.run_case(next(c for c in bare if c.dtype == "bf16"), runner.parse_labels("host:forward,numba"))
    assert res.verdict == "skip" and [lr.status for lr in res.labels] == ["skip", "skip"]
    assert res.labels[0].message == "missing ml_dtypes: pip install 'pykern[test]'"


def test_summary_groups_skip_reasons_per_backend() -> None:
    case = CASES[0]
    big = runner.LabelResult("numba", "skip", message=runner.BIG_SIMULATOR)
    results = [
        runner.CaseResult(case, 0, 0, [runner.LabelResult("host", "ok"), big]),
        runner.CaseResult(case, 0, 0, [runner.LabelResult("host", "fail"), runner.LabelResult("numba", "ok")]),
        runner.CaseResult(case, 0, 0, [runner.LabelResult("host", "error"), big]),
    ]
    per = runner.by_backend(results)
    assert per["host"] == {"ran": 3, "passed": 1, "failed": 1, "errors": 1, "skipped": 0, "skip_reasons": {}}
    assert per["numba"] == {"ran": 1, "passed": 1, "failed": 0, "errors": 0, "skipped": 2,
                            "skip_reasons": {runner.BIG_SIMULATOR: 2}}
    text = runner.format_summary(results, runner.parse_labels("host,numba"), {"nvrtc": "no GPU (needs a CUDA GPU)"},
                                 ["family x: its remaining cases, because y"])
    assert text.splitlines() == [
        "Summary: 3 cases",
        "  host   ran 3: 1 passed, 1 failed, 1 errors",
        "  numba  ran 1: 1 passed, 0 failed, 0 errors; skipped 2",
        f"           2 skipped: {runner.BIG_SIMULATOR}",
        "  nvrtc  not run: no GPU (needs a CUDA GPU)",
        "  not collected: family x: its remaining cases, because y",
    ]


def test_repeated_kernels_option_selects_every_glob() -> None:
    # `--kernels a --kernels b` selects both, as `--kernels a,b` does (argparse would keep only the last)
    from pykern.difftest.__main__ import main
    import contextlib
    import io

    def listed(*argv: str) -> set[str]:
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            assert main(["--list", *argv]) == 0
        return {line.split()[0] for line in buf.getvalue().splitlines() if "kernels=" in line}

    both = listed("--kernels", "transpose_2d", "--kernels", "softmax_backward")
    assert both == listed("--kernels", "transpose_2d,softmax_backward")
    assert both > listed("--kernels", "softmax_backward") and both > listed("--kernels", "transpose_2d")
