"""The `python -m pykern.gpucheck` command line and the order of its steps (see pykern/gpucheck/__init__.py)."""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from . import EXIT_FAILED, EXIT_NO_GPU, EXIT_OK
from . import checks, report, sanitizer

STEPS = ("limits", "difftest", "pytest", "sanitizer", "bench")
REPO_ROOT = Path(__file__).resolve().parent.parent.parent


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m pykern.gpucheck",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "The GPU check in one command. On the machine's first CUDA device (or --device N) it:\n"
            "  1. prints the device, driver, NVRTC, compile arch and which backends are usable (and why not);\n"
            "  2. compiles every kernel for the device's arch (or loads the PYKERN_CUBIN_DIR bundle) and\n"
            "     reports any kernel whose registers x block size or shared memory cannot launch on it, at\n"
            "     the block sizes and shared memory the ops launch in the difftest cases;\n"
            "  3. runs every difftest case on nvrtc vs numba vs float64 (python -m pykern.difftest);\n"
            "  4. runs `pytest -m gpu` when pytest and the tests/ folder are present;\n"
            "  5. with compute-sanitizer (on PATH or --sanitizer), re-runs the first case of every kernel\n"
            "     under memcheck, racecheck, initcheck and synccheck and lists each finding;\n"
            "  6. times the ops with CUDA events (warm-up, median of repeats): GB/s or TFLOP/s and % of the\n"
            "     device's peak, beside torch eager/SDPA, Liger-Kernel, FlashInfer and QuACK when importable\n"
            "     (the memory-bound ops are `python -m pykern.bench`'s table, in bf16).\n"
            "Writes OUT/report.md and OUT/report.json. Stays within --budget seconds (default 540)."
        ),
        epilog=(
            f"Exit status: {EXIT_OK} every step that ran passed; {EXIT_FAILED} any failure (a kernel that cannot "
            "launch, a difftest or pytest failure, a sanitizer finding, a pykern benchmark error); 2 bad usage; "
            f"{EXIT_NO_GPU} no CUDA driver or no GPU (the report says why; nothing was checked)."
        ),
    )
    p.add_argument("--out", default="gpucheck-report", metavar="DIR",
                   help="report folder (default ./gpucheck-report): report.md, report.json, logs")
    p.add_argument("--sanitizer", metavar="PATH",
                   help="compute-sanitizer executable (default: the one on PATH; without one the step is skipped)")
    p.add_argument("--quick", action="store_true",
                   help="less work: no note=\"big\" cases, sanitizer memcheck + racecheck only, smaller benchmark "
                        "shapes and 5 timed repeats")
    p.add_argument("--skip-bench", action="store_true", help="leave out the benchmarks")
    p.add_argument("--skip", action="append", default=[], choices=STEPS, metavar="STEP",
                   help=f"leave out a step ({', '.join(STEPS)}); repeatable")
    p.add_argument("--arch", metavar="ARCH",
                   help="compile and check for this arch instead of the device's (e.g. sm_90); the device's "
                        "limits still apply")
    p.add_argument("--device", type=int, default=None, metavar="N",
                   help="CUDA device ordinal (default 0). Given, every step runs on device N alone: the probe, "
                        "limits and benchmarks here, and the difftest, pytest and sanitizer subprocesses with "
                        "CUDA_VISIBLE_DEVICES naming only N (where they see it as their device 0)")
    p.add_argument("--jobs", type=int, default=min(8, os.cpu_count() or 1), metavar="N",
                   help="parallel compiles and sanitizer runs (default %(default)s)")
    p.add_argument("--budget", type=float, default=540.0, metavar="SECONDS",
                   help="wall-clock budget for the whole run (default 540); work that would start after it "
                        "is reported as skipped")
    p.add_argument("--repeats", type=int, default=None, help="timed repeats per benchmark (default 20, --quick 5)")
    return p


class Run:
    """One gpucheck run: the report document being filled, failures, the clock."""

    def __init__(self, args: argparse.Namespace, argv: Sequence[str]) -> None:
        self.args = args
        self.t0 = time.monotonic()
        self.deadline = self.t0 + args.budget
        self.out = Path(args.out)
        self.failures: list[str] = []
        self.doc: dict[str, Any] = {
            "version": report.REPORT_VERSION, "tool": "pykern.gpucheck",
            "command": "python -m pykern.gpucheck " + " ".join(shlex.quote(a) for a in argv),
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "options": vars(args).copy(),
        }

    def log(self, msg: str) -> None:
        print(f"[gpucheck {time.monotonic() - self.t0:6.1f}s] {msg}", file=sys.stderr, flush=True)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def by(self, fraction: float) -> float:
        """The monotonic time at `fraction` of the budget."""
        return self.t0 + self.args.budget * fraction

    def skipped(self, step: str) -> bool:
        return step in self.args.skip or (step == "bench" and self.args.skip_bench)

    @property
    def device(self) -> int:
        return 0 if self.args.device is None else self.args.device

    def child_env(self) -> dict[str, str] | None:
        """The environment of the subprocesses: with --device N, CUDA_VISIBLE_DEVICES naming only device N
        (the N-th entry of an existing CUDA_VISIBLE_DEVICES: ordinals count the devices it leaves visible);
        None (inherit) without --device."""
        if self.args.device is None:
            return None
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        entries = [e.strip() for e in visible.split(",")] if visible is not None else None
        if entries is not None and self.device < len(entries):
            chosen = entries[self.device]
        else:
            chosen = str(self.device)
        return dict(os.environ, CUDA_VISIBLE_DEVICES=chosen)


# --------------------------------------------------------------------------------------------- steps


def step_limits(run: Run, info: checks.DeviceInfo, drv: Any) -> None:
    from ..backends.nvrtc import target_arch

    arch = run.args.arch
    if not arch:
        try:
            arch = target_arch(info.arch, info.nvrtc_archs or (info.arch,))
        except Exception as e:  # this NVRTC cannot target the GPU
            run.failures.append(f"limits: {e}")
            run.doc["limits"] = {"status": "FAIL", "arch": None, "rows": [], "errors": [str(e)]}
            return
    run.log(f"limits: modules for {arch}")
    resources, errors = checks.kernel_resources(arch, run.args.jobs)
    if arch == info.arch or (not run.args.arch and arch.startswith("compute_")):
        errors += checks.driver_resources(drv, arch, resources)
    launches, notes = checks.recorded_launches()
    from .. import registry

    # kernels of an arch-specific source (`// pykern: arch sm_90a`) only where `arch` is one of its targets
    kernels = [s.name for s in registry.kernels() if not s.archs or arch in s.archs]
    rows = checks.check_limits(info.attributes, resources, launches, kernels)
    failed = [r for r in rows if r["status"] != "ok"]
    for r in failed:
        run.failures.append(f"limits: {r['kernel']}: {'; '.join(r['problems'])}")
    for e in errors:
        run.failures.append(f"limits: {e.splitlines()[0]}")
    run.doc["limits"] = {"status": "FAIL" if failed or errors else "ok", "arch": arch, "rows": rows,
                         "failed": len(failed), "errors": errors, "notes": notes}


def _subprocess(cmd: Sequence[str], timeout: float, cwd: Path | None = None,
                env: dict[str, str] | None = None) -> tuple[int | None, str, str]:
    try:
        p = subprocess.run(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           timeout=max(1.0, timeout), cwd=cwd, env=env)
    except subprocess.TimeoutExpired as e:
        dec = lambda b: b if isinstance(b, str) else (b or b"").decode(errors="replace")  # noqa: E731
        return None, dec(e.stdout), dec(e.stderr)
    return p.returncode, p.stdout, p.stderr


def run_difftest(cmd: Sequence[str], timeout: float, env: dict[str, str] | None = None) -> tuple[int | None, str, str]:
    """(returncode, stdout, stderr) of the difftest subprocess (a hook the tests replace)."""
    return _subprocess(cmd, timeout, env=env)


def _env_kw(run: Run) -> dict[str, Any]:
    # Hooks are called with env= only under --device: a replacement hook without it keeps working.
    env = run.child_env()
    return {} if env is None else {"env": env}


def step_difftest(run: Run) -> None:
    # numba is the reference only on the GPU: its simulator would take far longer than the budget.
    numba = next((b for b in run.doc.get("backends", []) if b["backend"] == "numba"), None)
    numba_ok = numba is not None and numba["usable"] and "simulator" not in numba["why"]
    cmd = [sys.executable, "-m", "pykern.difftest", "--backends", "nvrtc,numba" if numba_ok else "nvrtc", "--json"]
    if not numba_ok:
        run.log("difftest: numba has no GPU here, so nvrtc is compared with float64 only")
    if run.args.quick:
        cmd.append("--no-big")
    run.log("difftest: " + " ".join(cmd[1:]))
    rc, out, err = run_difftest(cmd, run.by(0.45) - time.monotonic(), **_env_kw(run))
    (run.out / "difftest.log").write_text(err)
    doc: dict[str, Any] = {"command": " ".join(cmd), "returncode": rc, "cases": [], "failures": []}
    try:
        data = json.loads(out) if out.strip() else None
    except json.JSONDecodeError:
        data = None
    if not numba_ok:
        doc["note"] = "numba reference not run: " + (numba["why"] if numba else "no numba backend")
    if data is not None:
        doc["summary"] = s = data["summary"]
        doc["cases"] = data["cases"]
        doc["failures"] = [f for c in data["cases"] for f in c.get("failures", [])]
        doc["message"] = (f"{s['passed']}/{s['cases']} cases passed, {s['failed']} failed, {s['errors']} errors, "
                          f"{s['skipped']} skipped; backends {','.join(s.get('backends', []))}; {s.get('seconds')} s")
    if rc is None:
        doc["status"], doc["message"] = "FAIL", "timed out (budget)"
    elif data is None:
        doc["status"] = "FAIL"
        doc["message"] = f"exit {rc}, no JSON result: " + " | ".join(err.strip().splitlines()[-5:])
    else:
        doc["status"] = "ok" if rc == 0 else "FAIL"
    if doc["status"] != "ok":
        run.failures.append(f"difftest: {doc['message']}")
        run.failures += [f"difftest: {f}" for f in doc["failures"][:50]]
    run.doc["difftest"] = doc


def run_pytest(cmd: Sequence[str], timeout: float, cwd: Path,
               env: dict[str, str] | None = None) -> tuple[int | None, str, str]:
    return _subprocess(cmd, timeout, cwd, env)


def step_pytest(run: Run) -> None:
    import importlib.util

    tests = REPO_ROOT / "tests"
    if importlib.util.find_spec("pytest") is None or not tests.is_dir():
        why = "pytest is not installed" if importlib.util.find_spec("pytest") is None else f"no tests folder at {tests}"
        run.doc["pytest"] = {"status": "skipped", "message": why}
        return
    junit = (run.out / "pytest-gpu.xml").resolve()
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}",
           str(tests)]
    run.log("pytest -m gpu")
    rc, out, err = run_pytest(cmd, run.by(0.6) - time.monotonic(), REPO_ROOT, **_env_kw(run))
    (run.out / "pytest-gpu.log").write_text(out + err)
    counts = _junit_counts(junit)
    tail = " | ".join(out.strip().splitlines()[-1:])
    doc = {"command": " ".join(cmd), "returncode": rc, "counts": counts, "message": tail}
    if rc is None:
        doc["status"], doc["message"] = "FAIL", "timed out (budget)"
    elif rc == 5:  # pytest: no tests collected
        doc["status"] = "ok"
        doc["message"] = "no test is marked gpu"
    else:
        doc["status"] = "ok" if rc == 0 else "FAIL"
    if doc["status"] != "ok":
        run.failures.append(f"pytest -m gpu: {doc['message']}")
    run.doc["pytest"] = doc


def _junit_counts(path: Path) -> dict[str, int]:
    import xml.etree.ElementTree as ET

    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return {}
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    out = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for s in suites:
        for k in out:
            out[k] += int(s.get(k, 0) or 0)
    return out


def step_sanitizer(run: Run, runner: sanitizer.RunCommand | None = None) -> None:
    from ..difftest import runner as dt

    exe = sanitizer.find_sanitizer(run.args.sanitizer)
    if exe is None:
        if run.args.sanitizer:
            run.failures.append(f"sanitizer: --sanitizer {run.args.sanitizer} is not an executable")
            run.doc["sanitizer"] = {"status": "FAIL", "message": f"{run.args.sanitizer} is not an executable"}
        else:
            run.doc["sanitizer"] = {"status": "skipped", "message": "compute-sanitizer is not on PATH (give --sanitizer)"}
        return
    tools = ("memcheck", "racecheck") if run.args.quick else sanitizer.TOOLS
    big = not run.args.quick
    firsts = dt.first_case_per_kernel(dt.collect_cases(0, big=big))
    # a case the nvrtc backend does not run (arch-specific: sm_90a cases run on the host only) would make its
    # difftest command exit 1 with nothing run: left out, and counted in the message
    nvrtc = dt.parse_label("nvrtc")
    not_applicable = sorted(k for k, c in firsts.items() if dt.not_applicable(c, nvrtc))
    kernel_cases = {k: c.id for k, c in firsts.items() if k not in not_applicable}
    run.log(f"sanitizer: {len(tools)} tools x {len(kernel_cases)} kernels with {exe}")
    runs = sanitizer.run_all(exe, tools, kernel_cases, run.by(0.8), jobs=run.args.jobs, big=big,
                             runner=runner or sanitizer.run_command, log=run.log, env=run.child_env())
    logs = run.out / "sanitizer"
    for r in runs:
        if r.status in ("findings", "error"):  # clean runs' output is just the program's table
            logs.mkdir(exist_ok=True)
            r.message = (r.message + "; " if r.message else "") + f"log sanitizer/{r.tool}-{r.kernel}.log"
            (logs / f"{r.tool}-{r.kernel}.log").write_text(" ".join(r.command) + "\n\n" + r.output)
    findings = [f for r in runs for f in r.findings]
    errors = [r for r in runs if r.status == "error"]
    skipped = [r for r in runs if r.status == "skipped"]
    for f in findings:
        run.failures.append(f"sanitizer {f.tool}: {f.kernel} ({f.case}): {f.message}")
    for r in errors:
        run.failures.append(f"sanitizer {r.tool}: {r.kernel} ({r.case}): run failed: {r.message}")
    msg = (f"{len(runs)} runs ({len(tools)} tools x {len(kernel_cases)} kernels): {len(findings)} findings, "
           f"{len(errors)} failed runs, {len(skipped)} skipped (budget)"
           + (f"; {len(not_applicable)} kernels left out: their cases do not run on nvrtc "
              f"({dt.not_applicable(firsts[not_applicable[0]], nvrtc)})" if not_applicable else ""))
    run.doc["sanitizer"] = {"status": "FAIL" if findings or errors else "ok", "message": msg, "path": exe,
                            "tools": list(tools), "runs": [r.to_dict() for r in runs],
                            "findings": [f.to_dict() for f in findings]}


def step_bench(run: Run, drv: Any, peaks: Any) -> None:
    from ..bench import EventTimer, gpu_sleep
    from . import benchmarks

    ok, why = benchmarks.torch_status()
    if not ok:
        run.doc["bench"] = {"status": "skipped", "message": f"needs torch with CUDA: {why}", "rows": []}
        return
    repeats = run.args.repeats or (5 if run.args.quick else 20)
    run.log("bench: building inputs")
    try:
        workloads, stream = benchmarks.setup(run.args.quick, run.device)
    except Exception as e:
        run.failures.append(f"bench: could not build the inputs: {type(e).__name__}: {e}")
        run.doc["bench"] = {"status": "FAIL", "message": str(e), "rows": []}
        return
    timer = EventTimer(drv, stream, busy=gpu_sleep())  # the GPU busy while each call is enqueued
    before, flush_bytes = None, 0
    try:  # every timed call from a cold L2, as python -m pykern.bench does (the quick shapes fit in L2)
        flush_bytes = 2 * (int(drv.device_attribute(run.device, "L2_CACHE_SIZE")) or 64 * 2**20)
        before = benchmarks.l2_flush(flush_bytes, run.device)
    except Exception as e:
        flush_bytes = 0
        run.log(f"bench: L2 not flushed between calls ({type(e).__name__}: {str(e)[:120]})")
    rows = benchmarks.run_benchmarks(workloads, timer, peaks, warmup=3, repeats=repeats, deadline=run.deadline - 5,
                                     log=run.log, before=before)
    bad = [r for r in rows if r["impl"] == "pykern" and r["status"] == "error"]
    for r in bad:
        run.failures.append(f"bench: {r['op']} {r['shape']}: {r['message']}")
    run.doc["bench"] = {"status": "FAIL" if bad else "ok", "repeats": repeats, "warmup": 3, "rows": rows,
                        "flush_l2_bytes": flush_bytes,
                        "message": f"{len(rows)} timings, median of {repeats} repeats after 3 warm-up calls"}


# --------------------------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None, driver_factory: Callable[[], Any] | None = None,
         sanitizer_runner: sanitizer.RunCommand | None = None) -> int:
    """Run the check; `driver_factory` replaces the CUDA driver (the tests pass a fake)."""
    from ..backends.driver import CudaDriver
    from ..bench import device_peaks

    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    run = Run(args, argv)
    run.out.mkdir(parents=True, exist_ok=True)
    info, drv = checks.probe_device(driver_factory or CudaDriver, run.device)
    run.doc["device"] = dict(info.to_dict(), index=run.device)
    run.doc["backends"] = checks.backend_status(driver_factory, run.device)
    if info.gpu:
        run.log(f"device {run.device}: {info.name}, {info.arch}, driver {info.driver_version}, NVRTC {info.nvrtc}")
    else:
        run.log(f"no GPU: {info.reason}")
    for b in run.doc["backends"]:
        run.log(f"backend {b['backend']}: {'usable' if b['usable'] else 'unusable: ' + b['why']}")

    if not info.gpu:
        return _finish(run, EXIT_NO_GPU, "NO GPU")
    attrs = dict(info.attributes, COMPUTE_CAPABILITY_MAJOR=info.cc[0], COMPUTE_CAPABILITY_MINOR=info.cc[1])
    peaks = device_peaks(attrs)
    run.doc["peaks"] = peaks.to_dict()

    if not run.skipped("limits"):
        step_limits(run, info, drv)
    if not run.skipped("difftest"):
        step_difftest(run)
    if not run.skipped("pytest"):
        step_pytest(run)
    if not run.skipped("sanitizer"):
        step_sanitizer(run, sanitizer_runner)
    if not run.skipped("bench"):
        step_bench(run, drv, peaks)
    code = EXIT_FAILED if run.failures else EXIT_OK
    return _finish(run, code, "FAIL" if run.failures else "PASS")


def _finish(run: Run, code: int, status: str) -> int:
    run.doc.update(status=status, exit_code=code, seconds=round(time.monotonic() - run.t0, 2),
                   failures=run.failures)
    pj, pm = report.write(run.out, run.doc)
    print(summary(run.doc))
    run.log(f"{status}: exit {code}; wrote {pm} and {pj}")
    return code


def summary(doc: dict[str, Any]) -> str:
    """The few lines printed at the end (the tables are in report.md)."""
    dev = doc["device"]
    lines = [f"pykern gpucheck: {doc['status']} (exit {doc['exit_code']}, {doc['seconds']:.0f} s)"]
    if dev.get("gpu"):
        lines.append(f"device: {dev['name']} ({dev['arch']}), driver {dev['driver_version']}, NVRTC {dev['nvrtc']}")
    else:
        lines.append(f"no GPU: {dev.get('reason')}")
    for step in STEPS:
        part = doc.get(step)
        if part:
            lines.append(f"{step}: {part.get('status')}" + (f" - {part['message']}" if part.get("message") else ""))
    fails = doc.get("failures", [])
    lines += [f"  FAILED {f}" for f in fails[:30]]
    if len(fails) > 30:
        lines.append(f"  ... and {len(fails) - 30} more (report.md)")
    return "\n".join(lines)
