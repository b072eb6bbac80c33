"""gpucheck step 5: one difftest case per kernel under NVIDIA compute-sanitizer, findings parsed.

Each (tool, kernel) pair is its own subprocess:

    compute-sanitizer --tool memcheck --error-exitcode 99 --print-limit 20 \\
        python -m pykern.difftest --backends nvrtc --kernels NAME --case-limit 1

so a finding is tied to one kernel and one case, and a kernel that faults (a sticky CUDA error
poisons its context) cannot hide the others. Pairs run in parallel on the one GPU.
"""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

TOOLS = ("memcheck", "racecheck", "initcheck", "synccheck")
ERROR_EXITCODE = 99  # what --error-exitcode makes the sanitizer return when it reports anything

# Extra options per tool. None today: racecheck's default "analysis" report gives one
# "Race reported between ..." finding per racing pair of instructions (its "hazard" mode would
# print every conflicting thread pair), and its warnings are reported as findings too.
TOOL_OPTIONS: dict[str, tuple[str, ...]] = {
    "memcheck": (),
    "racecheck": (),
    "initcheck": (),
    "synccheck": (),
}


def find_sanitizer(given: str | None = None) -> str | None:
    """The compute-sanitizer executable: `given` (a path or a name on PATH), else the one on PATH;
    None when that is not an executable."""
    return shutil.which(given or "compute-sanitizer")


def command(sanitizer: str, tool: str, kernel: str, python: str = sys.executable, big: bool = True,
            seed: int = 0) -> list[str]:
    """The exact command line for one (tool, kernel): the first difftest case that launches `kernel`,
    on the nvrtc backend only (the numba reference is not under test here)."""
    if tool not in TOOLS:
        raise ValueError(f"tool: expected one of {', '.join(TOOLS)}, got {tool!r}")
    cmd = [sanitizer, "--tool", tool, "--error-exitcode", str(ERROR_EXITCODE), "--print-limit", "20",
           *TOOL_OPTIONS[tool],
           python, "-m", "pykern.difftest", "--backends", "nvrtc", "--kernels", kernel, "--case-limit", "1",
           "--seed", str(seed)]
    if not big:
        cmd.append("--no-big")
    return cmd


# --------------------------------------------------------------------------------------------- parsing


@dataclass
class Finding:
    tool: str
    kernel: str
    case: str
    message: str
    details: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


_PREFIX = "========="
# Header lines that are not findings.
_NOT_FINDING = re.compile(
    r"^(COMPUTE-SANITIZER|ERROR SUMMARY|RACECHECK SUMMARY|LEAK SUMMARY|Target application returned|"
    r"Saved host backtrace|Process ID|No kernels were|Note:|Error: process didn't terminate successfully)", re.I)
# "at rms_norm+0x60", "at rms_norm(const float *, ...)+0x60 in f.cu:9", "at 0x70 in f.cu:8:vectorAdd(int *)",
# "at 0x1234 in SomeKernel"; racecheck: "... access at kernel+0x140 ..." / "... at 0xd0 in f.cu:25:Basic(int *)".
_AT_SYMBOL = re.compile(r"\bat\s+([A-Za-z_][\w:]*)\s*(?:\([^)]*\))?\s*\+0x[0-9a-fA-F]+")
_AT_IN = re.compile(r"\bat\s+0x[0-9a-fA-F]+\s+in\s+(?:\S*?:\d+:)?([A-Za-z_][\w:]*)")
_SUMMARY_ERRORS = re.compile(r"ERROR SUMMARY:\s*(\d+) errors?")
_RACE_SUMMARY = re.compile(r"RACECHECK SUMMARY:\s*(\d+) hazards? displayed\s*\((\d+) errors?,\s*(\d+) warnings?\)")


def _kernel_in(lines: Sequence[str]) -> str | None:
    for ln in lines:
        for rx in (_AT_SYMBOL, _AT_IN):
            m = rx.search(ln)
            if m:
                return m.group(1)
    return None


def parse_output(text: str, tool: str, kernel: str, case: str) -> list[Finding]:
    """Findings in compute-sanitizer output: each unindented `========= Message` line opens one, the
    indented lines under it are its details. The kernel is the one named in the report ("at NAME+0x..")
    when it names one, else `kernel` (the kernel the run was for); `case` is the case that ran."""
    findings: list[Finding] = []
    current: Finding | None = None
    for raw in text.splitlines():
        if not raw.startswith(_PREFIX):
            continue  # the program's own output, interleaved
        body = raw[len(_PREFIX):]
        stripped = body.strip()
        if not stripped:
            current = None
            continue
        indented = body.startswith("  ")  # details are indented by 4+ spaces after the prefix
        if indented and current is not None:
            if not stripped.startswith(("Host Frame", "in /", "Device Frame")) and len(current.details) < 8:
                current.details.append(stripped)
            continue
        if indented or _NOT_FINDING.match(stripped):
            current = None
            continue
        current = Finding(tool, kernel, case, stripped)
        findings.append(current)
    for f in findings:
        name = _kernel_in([f.message, *f.details])
        if name:
            f.kernel = name
    return findings


def summary_count(text: str) -> int | None:
    """Errors the tool says it reported (ERROR SUMMARY, or RACECHECK SUMMARY errors + warnings)."""
    m = _RACE_SUMMARY.search(text)
    if m:
        return int(m.group(2)) + int(m.group(3))
    m = _SUMMARY_ERRORS.search(text)
    return int(m.group(1)) if m else None


# --------------------------------------------------------------------------------------------- running


@dataclass
class Run:
    tool: str
    kernel: str
    case: str
    command: list[str]
    returncode: int | None = None
    seconds: float = 0.0
    status: str = ""  # "clean" | "findings" | "error" | "skipped"
    message: str = ""
    findings: list[Finding] = field(default_factory=list)
    output: str = field(default="", repr=False)  # the full sanitizer + program output (written as a log)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("output")
        d["findings"] = [f.to_dict() for f in self.findings]
        return d


RunCommand = Callable[..., "tuple[int | None, str]"]  # (cmd, timeout[, env=...])


def run_command(cmd: Sequence[str], timeout: float, env: dict[str, str] | None = None) -> tuple[int | None, str]:
    """(returncode, combined stdout+stderr); returncode None when it ran past `timeout` seconds. `env`
    replaces the environment (gpucheck --device: CUDA_VISIBLE_DEVICES naming one device)."""
    try:
        p = subprocess.run(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           timeout=max(1.0, timeout), env=env)
    except subprocess.TimeoutExpired as e:
        out = e.stdout if isinstance(e.stdout, str) else (e.stdout or b"").decode(errors="replace")
        return None, out
    except OSError as e:  # the sanitizer path is not executable
        return 127, f"cannot run {cmd[0]}: {e}"
    return p.returncode, p.stdout


def judge(run: Run, rc: int | None, out: str) -> Run:
    """Fill status, message and findings of one finished run from its exit code and output."""
    run.returncode = rc
    run.output = out
    run.findings = parse_output(out, run.tool, run.kernel, run.case)
    count = summary_count(out)
    if rc is None:
        run.status, run.message = "error", "timed out"
    elif run.findings:
        run.status = "findings"
    elif rc == ERROR_EXITCODE or (count or 0) > 0:
        run.status = "findings"
        run.findings = [Finding(run.tool, run.kernel, run.case,
                                f"sanitizer reported {count if count is not None else 'errors'} (exit {rc}), "
                                "no finding could be parsed; see the log")]
    elif rc != 0:
        run.status = "error"
        tail = [ln for ln in out.splitlines() if ln.strip()][-6:]
        run.message = f"exit {rc}: " + " | ".join(tail)
    else:
        run.status = "clean"
    return run


def run_all(sanitizer: str, tools: Sequence[str], kernel_cases: dict[str, str], deadline: float, jobs: int = 4,
            big: bool = True, runner: RunCommand = run_command, per_run_timeout: float = 120.0,
            log: Callable[[str], None] | None = None, env: dict[str, str] | None = None) -> list[Run]:
    """Every (tool, kernel) run, in parallel; pairs that would start after `deadline` (time.monotonic)
    are reported as skipped. `env` (when given) is passed to `runner` as env=."""
    extra = {} if env is None else {"env": env}
    pending = [Run(tool, k, kernel_cases[k], command(sanitizer, tool, k, big=big))
               for tool in tools for k in sorted(kernel_cases)]

    def one(run: Run) -> Run:
        left = deadline - time.monotonic()
        if left < 5:
            run.status, run.message = "skipped", "time budget used up"
            return run
        t0 = time.monotonic()
        rc, out = runner(run.command, min(per_run_timeout, left), **extra)
        run.seconds = round(time.monotonic() - t0, 2)
        judge(run, rc, out)
        if log:
            log(f"sanitizer {run.tool:9s} {run.kernel:36s} {run.status}")
        return run

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        return list(pool.map(one, pending))
