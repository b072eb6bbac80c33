"""Run difftest cases on backends, compare with the NumPy float64 reference, format rows and JSON.

A backend *label* is a backend name plus the environment it runs under:
`host`, `host:reverse`, `host:random:7` (PYKERN_HOST_SCHEDULE), `host:sanitize`
(PYKERN_HOST_SANITIZE=1), `nvrtc`, `numba`. Each label's outputs are checked
against the reference with `tolerance(op, dtype)`; every pair of labels must also
agree within the same bound (that is how two host schedules expose a race).
"""
from __future__ import annotations

import fnmatch
import importlib
import importlib.util
import json
import os
import sys
import time
import zlib
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import numpy as np

from ..errors import ArgumentError, MissingDependency
from ..tolerance import tolerance
from .case import Case, families

EXTRA_ENV = "PYKERN_DIFFTEST_EXTRA"


# ----------------------------------------------------------------------------------------------- backends
@dataclass(frozen=True)
class Label:
    """One column of a comparison: a backend name and the environment it runs under."""

    text: str
    backend: str
    env: tuple[tuple[str, str], ...] = ()


def parse_label(text: str) -> Label:
    """`host[:forward|:reverse|:random:SEED|:sanitize]`, `nvrtc`, `numba`."""
    from ..backends import NAMES

    t = text.strip()
    name, _, rest = t.partition(":")
    if name not in NAMES:
        raise ArgumentError(f"--backends: expected names from {', '.join(NAMES)} (host may take :SCHEDULE), got {t!r}")
    if not rest:
        return Label(t, name)
    if name != "host":
        raise ArgumentError(f"--backends: only host takes a ':' option (a schedule or sanitize), got {t!r}")
    if rest == "sanitize":
        return Label(t, name, (("PYKERN_HOST_SANITIZE", "1"),))
    from ..backends.host import parse_schedule  # the parser PYKERN_HOST_SCHEDULE goes through

    try:
        parse_schedule(rest)
    except ArgumentError:
        raise ArgumentError(
            f"--backends: host option must be forward, reverse, random:SEED or sanitize, got {rest!r} in {t!r}"
        ) from None
    return Label(t, name, (("PYKERN_HOST_SCHEDULE", rest),))


def parse_labels(text: str) -> list[Label]:
    labels = [parse_label(t) for t in text.split(",") if t.strip()]
    if not labels:
        raise ArgumentError(f"--backends: expected at least one backend, got {text!r}")
    if len({lb.text for lb in labels}) != len(labels):
        raise ArgumentError(f"--backends: a backend is listed twice in {text!r}")
    return labels


def default_labels() -> list[Label]:
    """nvrtc,numba where a GPU is usable (the CI-on-GPU use), else host,numba."""
    from ..backends import get_backend

    ok, _ = get_backend("nvrtc").available()
    return parse_labels("nvrtc,numba" if ok else "host,numba")


def importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a parent package missing, or blocked in sys.modules
        return False


def _hint(backend: str) -> str:
    """What brings an unavailable backend back (named in the CLI's summary)."""
    if backend == "numba":
        return "pip install 'pykern[numba]'" if not importable("numba.cuda") else ""
    return {"nvrtc": "needs a CUDA GPU and driver", "host": "needs a C++17 compiler (g++ or clang++)"}.get(backend, "")


def usable_default_labels() -> tuple[list[Label], dict[str, str]]:
    """The default labels that can run here, and {backend: why it does not run} for every other backend.

    Without --backends the CLI runs what it can (after the main install: host alone) and says what it
    left out and what brings it back, instead of refusing; a backend named on the command line that
    cannot run stays an error.
    """
    from ..backends import NAMES, get_backend

    labels, not_run = [], {}
    for name in NAMES:
        try:
            ok, why = get_backend(name).available()
        except Exception as e:  # e.g. a backend module that fails to import
            ok, why = False, f"{type(e).__name__}: {e}"
        if not ok:
            hint = _hint(name)
            not_run[name] = f"{why} ({hint})" if hint else why
    for lb in default_labels():
        if lb.backend in not_run:
            continue
        labels.append(lb)
    return labels, not_run


def check_available(labels: Sequence[Label]) -> list[str]:
    """One message per label whose backend cannot run here (empty when all can)."""
    from ..backends import get_backend

    problems = []
    for lb in labels:
        try:
            ok, why = get_backend(lb.backend).available()
        except Exception as e:  # e.g. a backend module that fails to import
            ok, why = False, f"{type(e).__name__}: {e}"
        if not ok:
            problems.append(f"backend {lb.text!r} is unavailable: {why}")
    return problems


def is_simulator(label: Label) -> bool:
    if label.backend != "numba":
        return False
    from ..backends import get_backend

    return bool(getattr(get_backend("numba"), "simulator", False))


# Why a backend cannot run an arch-specific case (Case.arch), per backend; the host plays the arch instead.
_NOT_APPLICABLE = {
    "numba": "numba has no wgmma / TMA",
    "nvrtc": "its TMA tensor maps need device arrays and the difftest's inputs are NumPy",
}


def not_applicable(case: Case, label: Label) -> str:
    """Why `label` does not run `case` ("" when it does): an arch-specific case (`case.arch`, e.g. sm_90a) runs
    on the host backend only, which plays that arch; the summary counts the others as skipped, not passed."""
    if not case.arch or label.backend == "host":
        return ""
    return f"not applicable ({case.arch}): {_NOT_APPLICABLE.get(label.backend, 'only the host backend plays it')}"


@contextmanager
def _environ(pairs: Sequence[tuple[str, str]]) -> Iterator[None]:
    old = {k: os.environ.get(k) for k, _ in pairs}
    os.environ.update(dict(pairs))
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# ----------------------------------------------------------------------------------------------- cases
def load_extra(spec: str | None = None) -> list[str]:
    """Import extra case/reference modules (test-only kernels): module names or .py paths, ',' or os.pathsep."""
    spec = os.environ.get(EXTRA_ENV, "") if spec is None else spec
    loaded = []
    for item in spec.replace(os.pathsep, ",").split(","):
        item = item.strip()
        if not item:
            continue
        if item.endswith(".py"):
            path = Path(item).expanduser().resolve()
            if not path.is_file():
                raise ArgumentError(f"{EXTRA_ENV}: expected a module name or an existing .py file, got {item!r}")
            mod_name = "pykern_difftest_extra_" + path.stem + "_" + format(zlib.crc32(str(path).encode()), "x")
            if mod_name not in sys.modules:  # loading twice would register its references twice
                spec_ = importlib.util.spec_from_file_location(mod_name, path)
                assert spec_ is not None and spec_.loader is not None
                mod = importlib.util.module_from_spec(spec_)
                sys.modules[mod_name] = mod
                try:
                    spec_.loader.exec_module(mod)
                except BaseException:
                    del sys.modules[mod_name]
                    raise
        else:
            try:
                importlib.import_module(item)
            except ModuleNotFoundError as e:
                if e.name is None or not item.startswith(e.name):
                    raise  # the module exists; something it imports is missing: show that error
                raise ArgumentError(
                    f"{EXTRA_ENV}/--extra: expected a module name or an existing .py file, got {item!r}"
                ) from None
        loaded.append(item)
    return loaded


def family_rng(seed: int, family: str) -> np.random.Generator:
    """Each family draws from its own stream, so --kernels filtering never changes a case's data."""
    return np.random.default_rng([int(seed), zlib.crc32(family.encode())])


def collect_cases(seed: int = 0, kernels: str | None = None, big: bool = True) -> list[Case]:
    """Every registered family's cases (sorted by family), filtered by a kernel glob (',' = or) and note="big".

    Without ml_dtypes the cases are still all collected: bf16 data is drawn as float32 stand-ins (the
    random streams stay those of a full install), and a case whose data needed bf16 is replaced by
    one that raises MissingDependency, which `run_case` reports as skipped with the extra to install.
    """
    globs = [g.strip() for g in (kernels or "").split(",") if g.strip()]
    out: list[Case] = []
    SKIPPED.clear()
    missing = _missing_bf16()
    for family, gen in sorted(families().items()):
        used = [False]
        try:
            with _bf16_stand_in(missing, used):
                for case in gen(family_rng(seed, family)):
                    # A bf16 case needs bf16 arrays even when its generator fetched the dtype once for
                    # several cases; any other case that asked for bf16 while being built does too.
                    if missing is not None and (used[0] or case.dtype == "bf16"):
                        case, used[0] = _needs(case, missing), False
                    if not big and case.note == "big":
                        continue
                    if not globs or any(fnmatch.fnmatchcase(k, g) for k in case.kernels for g in globs):
                        out.append(case)
        except MissingDependency as e:  # another optional package: the other families still run
            SKIPPED.append(f"family {family}: its remaining cases, because {e}")
    return out


def _missing_bf16() -> MissingDependency | None:
    from ..arrays import bfloat16

    try:
        bfloat16()
    except MissingDependency as e:
        return e
    return None


@contextmanager
def _bf16_stand_in(missing: MissingDependency | None, used: list[bool]) -> Iterator[None]:
    """While a family generates its cases without ml_dtypes: `arrays.bfloat16()` is float32, and `used`
    records that the case being generated asked for it (the case modules look it up at call time)."""
    if missing is None:
        yield
        return
    from .. import arrays

    real = arrays.bfloat16

    def stand_in() -> np.dtype:
        used[0] = True
        return np.dtype(np.float32)

    arrays.bfloat16 = stand_in  # type: ignore[assignment]
    try:
        yield
    finally:
        arrays.bfloat16 = real  # type: ignore[assignment]


def _needs(case: Case, missing: MissingDependency) -> Case:
    """The case with its data discarded: running it (or its reference) raises `missing`."""
    def unavailable(*_: Any) -> Any:
        raise missing

    unavailable.skip_reason = skip_reason(missing)  # type: ignore[attr-defined]
    return replace(case, run=unavailable, reference=unavailable)


def pending_skips(cases: Sequence[Case]) -> dict[str, int]:
    """{reason: count} of the cases that will skip because an optional package is missing."""
    out: dict[str, int] = {}
    for c in cases:
        why = getattr(c.run, "skip_reason", None)
        if why:
            out[why] = out.get(why, 0) + 1
    return out


def skip_reason(e: MissingDependency) -> str:
    """One line per missing package, the same for every case it skips (the summary groups by it)."""
    return f"missing {e.package}: pip install 'pykern[{e.extra}]'"


def limit_cases(cases: Sequence[Case], per_kernel: int, kernels: str | None = None) -> list[Case]:
    """At most `per_kernel` cases for each kernel (those matching the `kernels` globs, or all), in order.

    A case is kept while one of its kernels still has room; `--kernels NAME --case-limit 1` is then
    exactly the first case that launches NAME (what gpucheck runs under compute-sanitizer).
    """
    if per_kernel < 1:
        raise ArgumentError(f"--case-limit: expected >= 1, got {per_kernel}")
    globs = [g.strip() for g in (kernels or "").split(",") if g.strip()]
    counts: dict[str, int] = {}
    out: list[Case] = []
    for case in cases:
        ks = [k for k in case.kernels if not globs or any(fnmatch.fnmatchcase(k, g) for g in globs)]
        if any(counts.get(k, 0) < per_kernel for k in ks):
            out.append(case)
            for k in ks:
                counts[k] = counts.get(k, 0) + 1
    return out


def first_case_per_kernel(cases: Sequence[Case]) -> dict[str, Case]:
    """kernel name -> the first case (in collection order) that launches it, a portable case (no arch) first: a
    portable kernel that an arch-specific case also launches (cross_entropy_count beside the sm_90a cluster
    kernel) keeps a case that every backend runs."""
    out: dict[str, Case] = {}
    for portable in (True, False):
        for case in cases:
            if bool(case.arch) != portable:
                for k in case.kernels:
                    out.setdefault(k, case)
    return out


# Why cases were left out by the last collect_cases (the CLI prints these).
SKIPPED: list[str] = []


# ----------------------------------------------------------------------------------------------- comparison
@dataclass
class Check:
    """One output of one label against the reference."""

    output: str
    ok: bool
    max_abs: float = 0.0
    max_rel: float = 0.0
    detail: str = ""


def _as_f64(a: Any) -> np.ndarray:
    return np.asarray(a).astype(np.float64)


def compare(name: str, got: Any, ref: Any, atol: float, rtol: float) -> Check:
    """|got - ref| <= atol + rtol*|ref| everywhere; a non-finite reference must be matched exactly."""
    g, r = _as_f64(got), _as_f64(ref)
    if g.shape != r.shape:
        return Check(name, False, float("inf"), float("inf"), f"shape {g.shape} != reference shape {r.shape}")
    if g.size == 0:
        return Check(name, True)
    fin = np.isfinite(r)
    with np.errstate(invalid="ignore", over="ignore"):
        d = np.abs(g - r)
        d = np.where(np.isnan(d) & fin, np.inf, d)  # NaN (or Inf) where the reference is finite
        bad = fin & ~(d <= atol + rtol * np.abs(r))
        bad |= ~fin & ~((np.isnan(r) & np.isnan(g)) | (g == r))
        df = np.where(fin, d, 0.0)
        # Relative error where it means something: entries above atol (a reference of 1e-17 from float64
        # cancellation would otherwise report a huge relative error that atol already covers).
        big = fin & (np.abs(r) > atol) & (r != 0)
        rel = np.where(big, df / np.where(big, np.abs(r), 1.0), 0.0)
    max_abs, max_rel = float(df.max()), float(rel.max())
    if not bad.any():
        return Check(name, True, max_abs, max_rel)
    n_bad = int(bad.sum())
    # Name the worst element: the largest excess over the bound; non-finite mismatches rank first.
    with np.errstate(invalid="ignore", over="ignore"):
        excess = np.where(bad, np.where(fin, df - (atol + rtol * np.abs(r)), np.inf), -np.inf)
        flat = int(np.argmax(excess))
        idx = np.unravel_index(flat, r.shape)
        bound = atol + rtol * abs(r[idx]) if np.isfinite(r[idx]) else r[idx]
    where = tuple(int(i) for i in idx)
    detail = (f"{n_bad}/{r.size} elements out of tolerance; worst at {where}: "
              f"got {float(g[idx]):.9g}, reference {float(r[idx]):.9g}, bound {float(bound):.3g}")
    return Check(name, False, max_abs, max_rel, detail)


def pair_diff(a: Any, b: Any, ref: Any, atol: float, rtol: float) -> tuple[float, bool]:
    """Max |a - b| over finite reference entries, and whether it stays within the tolerance bound everywhere."""
    x, y, r = _as_f64(a), _as_f64(b), _as_f64(ref)
    if x.shape != y.shape or x.shape != r.shape:
        return float("inf"), False
    if x.size == 0:
        return 0.0, True
    fin = np.isfinite(r)
    with np.errstate(invalid="ignore", over="ignore"):
        d = np.abs(x - y)
        same = (x == y) | (np.isnan(x) & np.isnan(y))
        d = np.where(same, 0.0, np.where(np.isnan(d), np.inf, d))
        ok = bool(np.all(~fin | (d <= atol + rtol * np.abs(r))) and np.all(fin | same))
    return float(np.where(fin, d, 0.0).max()), ok


# ----------------------------------------------------------------------------------------------- running
@dataclass
class LabelResult:
    label: str
    status: str  # "ok" | "fail" | "error" | "skip"
    seconds: float = 0.0
    checks: list[Check] = field(default_factory=list)
    message: str = ""

    @property
    def max_abs(self) -> float:
        return max((c.max_abs for c in self.checks), default=0.0)

    @property
    def max_rel(self) -> float:
        return max((c.max_rel for c in self.checks), default=0.0)


@dataclass
class CaseResult:
    case: Case
    atol: float
    rtol: float
    labels: list[LabelResult]
    pair_max: float = 0.0
    pair_ok: bool = True
    pair_detail: str = ""

    @property
    def ran(self) -> list[LabelResult]:
        return [lr for lr in self.labels if lr.status != "skip"]

    @property
    def passed(self) -> bool:
        return bool(self.ran) and all(lr.status == "ok" for lr in self.ran) and self.pair_ok

    @property
    def verdict(self) -> str:
        if any(lr.status == "error" for lr in self.labels):
            return "ERROR"
        if not self.ran:
            return "skip"  # e.g. a big case with only the numba simulator chosen
        return "ok" if self.passed else "FAIL"

    @property
    def note(self) -> str:
        return "; ".join(f"{lr.label} skipped: {lr.message}" for lr in self.labels if lr.status == "skip")

    def failures(self) -> list[str]:
        """Human-readable reasons, each naming the case."""
        out = []
        for lr in self.labels:
            if lr.status == "error":
                out.append(f"{self.case.id} on {lr.label}: {lr.message}")
            for c in lr.checks:
                if not c.ok:
                    out.append(f"{self.case.id} on {lr.label}: output {c.output!r}: {c.detail}")
        if not self.pair_ok:
            out.append(f"{self.case.id}: backends disagree beyond tolerance: {self.pair_detail}")
        return out


def run_on(case: Case, label: Label) -> Mapping[str, Any]:
    with _environ(label.env):
        outs = case.run(label.backend)
    return {k: np.asarray(v) for k, v in outs.items()}


BIG_SIMULATOR = "big case, numba simulator too slow"


def run_case(case: Case, labels: Sequence[Label], skip_big_simulator: bool = True) -> CaseResult:
    """Run one case on every label; compare each with the reference and every pair with each other."""
    atol, rtol = tolerance(case.op, case.dtype)
    try:
        ref = {k: _as_f64(v) for k, v in case.reference().items()}
    except MissingDependency as e:  # the environment's, not the case's: every backend skips it
        return CaseResult(case, atol, rtol, [LabelResult(lb.text, "skip", message=skip_reason(e)) for lb in labels])
    except Exception as e:  # a broken NumPy reference is the case's failure, not the harness's
        msg = f"NumPy reference raised {type(e).__name__}: {e}"
        return CaseResult(case, atol, rtol, [LabelResult("reference", "error", message=msg)])
    results: list[LabelResult] = []
    outputs: dict[str, Mapping[str, Any]] = {}
    for lb in labels:
        if skip_big_simulator and case.note == "big" and is_simulator(lb):
            results.append(LabelResult(lb.text, "skip", message=BIG_SIMULATOR))
            continue
        why = not_applicable(case, lb)
        if why:
            results.append(LabelResult(lb.text, "skip", message=why))
            continue
        t0 = time.perf_counter()
        try:
            outs = run_on(case, lb)
        except MissingDependency as e:
            results.append(LabelResult(lb.text, "skip", message=skip_reason(e)))
            continue
        except Exception as e:
            results.append(LabelResult(lb.text, "error", time.perf_counter() - t0,
                                       message=f"{type(e).__name__}: {e}".strip()))
            continue
        dt = time.perf_counter() - t0
        checks = []
        for name in sorted(set(ref) | set(outs)):
            if name not in outs:
                checks.append(Check(name, False, float("inf"), float("inf"), "missing from the run's outputs"))
            elif name not in ref:
                checks.append(Check(name, False, float("inf"), float("inf"), "missing from the reference"))
            else:
                checks.append(compare(name, outs[name], ref[name], atol, rtol))
        results.append(LabelResult(lb.text, "ok" if all(c.ok for c in checks) else "fail", dt, checks))
        outputs[lb.text] = outs
    res = CaseResult(case, atol, rtol, results)
    names = list(outputs)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            for out in ref:
                if out in outputs[a] and out in outputs[b]:
                    d, ok = pair_diff(outputs[a][out], outputs[b][out], ref[out], atol, rtol)
                    res.pair_max = max(res.pair_max, d)
                    if not ok:
                        res.pair_ok = False
                        res.pair_detail += f"{a} vs {b} on {out!r}: max |diff| {d:.3g}; "
    return res


# ----------------------------------------------------------------------------------------------- output
COLUMNS = ("case", "kernels", "shape", "dtype", "backends", "max_abs", "max_rel", "pair_max", "atol/rtol", "verdict")


def _num(x: float) -> str:
    return "0" if x == 0 else f"{x:.2e}"


def row(res: CaseResult) -> tuple[str, ...]:
    c = res.case
    ran = [lr.label for lr in res.ran]
    backends = "|".join(ran) if ran else "-"
    verdict = res.verdict + (f" ({res.note})" if res.note else "")
    return (c.id, ",".join(c.kernels), c.shape, c.dtype, backends, _num(max((lr.max_abs for lr in res.ran), default=0)),
            _num(max((lr.max_rel for lr in res.ran), default=0)), _num(res.pair_max),
            f"{res.atol:g}/{res.rtol:g}", verdict)


def format_table(results: Sequence[CaseResult]) -> str:
    rows = [COLUMNS] + [row(r) for r in results]
    # The kernels column can be long (a case may launch several); cap it so rows stay readable.
    rows = [r[:1] + ((r[1][:40] + "…") if len(r[1]) > 41 else r[1],) + r[2:] for r in rows]
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS) - 1)]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(r, widths)) + "  " + r[-1] for r in rows)


def to_json(results: Sequence[CaseResult], labels: Sequence[Label], seconds: float, seed: int,
            not_run: Mapping[str, str] | None = None, not_collected: Sequence[str] = ()) -> str:
    cases = []
    for r in results:
        cases.append({
            "id": r.case.id, "op": r.case.op, "kernels": list(r.case.kernels), "shape": r.case.shape,
            "dtype": r.case.dtype, "note": r.case.note, "atol": r.atol, "rtol": r.rtol, "verdict": r.verdict,
            "pair_max": _finite(r.pair_max), "pair_ok": r.pair_ok,
            "backends": [{"label": lr.label, "status": lr.status, "seconds": round(lr.seconds, 4),
                          "max_abs": _finite(lr.max_abs), "max_rel": _finite(lr.max_rel), "message": lr.message,
                          "outputs": [{"name": c.output, "ok": c.ok, "max_abs": _finite(c.max_abs),
                                       "max_rel": _finite(c.max_rel), "detail": c.detail} for c in lr.checks]}
                         for lr in r.labels],
            "failures": r.failures(),
        })
    summary = summarize(results)
    summary.update({"backends": [lb.text for lb in labels], "seconds": round(seconds, 2), "seed": seed,
                    "not_run": {k: v for k, v in (not_run or {}).items() if not any(lb.backend == k for lb in labels)},
                    "not_collected": list(not_collected)})
    return json.dumps({"summary": summary, "cases": cases}, indent=1)


def _finite(x: float) -> float | str:
    return x if np.isfinite(x) else str(x)


def summarize(results: Sequence[CaseResult]) -> dict[str, Any]:
    return {
        "cases": len(results),
        "passed": sum(r.passed for r in results),
        "failed": sum(r.verdict == "FAIL" for r in results),
        "errors": sum(r.verdict == "ERROR" for r in results),
        "skipped": sum(r.verdict == "skip" for r in results),
        "skipped_backend_runs": sum(lr.status == "skip" for r in results for lr in r.labels),
        "kernels": len({k for r in results for k in r.case.kernels}),
        "by_backend": by_backend(results),
    }


def by_backend(results: Sequence[CaseResult]) -> dict[str, dict[str, Any]]:
    """Per label: cases it ran, passed (within tolerance of the reference), failed, errors, and the cases
    it skipped, counted per reason (a reason names what brings the cases back)."""
    out: dict[str, dict[str, Any]] = {}
    for r in results:
        for lr in r.labels:
            d = out.setdefault(lr.label, {"ran": 0, "passed": 0, "failed": 0, "errors": 0, "skipped": 0,
                                          "skip_reasons": {}})
            if lr.status == "skip":
                d["skipped"] += 1
                d["skip_reasons"][lr.message] = d["skip_reasons"].get(lr.message, 0) + 1
                continue
            d["ran"] += 1
            d[{"ok": "passed", "fail": "failed", "error": "errors"}[lr.status]] += 1
    return out


def format_summary(results: Sequence[CaseResult], labels: Sequence[Label], not_run: Mapping[str, str],
                   not_collected: Sequence[str] = ()) -> str:
    """The CLI's closing block: per backend what ran, what passed, what was skipped and why."""
    per = by_backend(results)
    lines = [f"Summary: {len(results)} cases"]
    width = max([len(lb.text) for lb in labels] + [len(n) for n in not_run] + [1])
    for lb in labels:
        d = per.get(lb.text, {"ran": 0, "passed": 0, "failed": 0, "errors": 0, "skipped": 0, "skip_reasons": {}})
        line = f"  {lb.text.ljust(width)}  ran {d['ran']}: {d['passed']} passed, {d['failed']} failed, {d['errors']} errors"
        if d["skipped"]:
            line += f"; skipped {d['skipped']}"
        lines.append(line)
        for why, n in sorted(d["skip_reasons"].items(), key=lambda kv: -kv[1]):
            lines.append(f"  {' ' * width}    {n} skipped: {why}")
    for name, why in not_run.items():
        if not any(lb.backend == name for lb in labels):
            lines.append(f"  {name.ljust(width)}  not run: {why}")
    for why in not_collected:
        lines.append(f"  not collected: {why}")
    return "\n".join(lines)
