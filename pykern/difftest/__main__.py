"""`python -m pykern.difftest`: run every difftest case on two or more backends and the NumPy float64 reference.

Exit status: 0 when every case passes, 1 when any case fails or errors, 2 for
bad usage or a named backend that cannot run here.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Sequence

from ..errors import PykernError
from . import runner


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m pykern.difftest",
        description="Differential test of every registered kernel: backends vs each other and vs NumPy float64.",
        epilog="Arch-specific kernels (the sm_90a attention kernels: TMA, mbarrier, wgmma) run on the host backend "
               "playing sm_90a (each case sets PYKERN_HOST_ARCH=sm_90a for its run, the emulation of "
               "pykern/host/pk_host_sm90.cpp) against the float64 reference; numba (no wgmma / TMA) and nvrtc (TMA "
               "tensor maps need device arrays; the cases' inputs are NumPy) skip them as 'not applicable "
               "(sm_90a)', counted in the summary. E.g. --kernels 'attention_fwd*sm90*,attention_bwd*sm90*'. "
               "Exit status: 0 when every case passes, 1 when any case fails or errors, 2 for bad usage "
               "or a named backend that cannot run here.",
    )
    p.add_argument("--backends", help="comma-separated: nvrtc, numba, host[:forward|:reverse|:random:SEED|:sanitize] "
                   "(default: nvrtc,numba with a GPU, host,numba without; a default one that cannot run here "
                   "is left out and named in the summary, a named one is an error)")
    p.add_argument("--kernels", action="append",
                   help="only cases launching a kernel that matches this glob (',' separates globs; "
                        "the option may be repeated)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random case data (default 0)")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    p.add_argument("--no-big", action="store_true", help='leave out the cases marked note="big"')
    p.add_argument("--list", action="store_true", help="list the selected cases and exit")
    p.add_argument("--case-limit", type=int, default=None, metavar="N",
                   help="at most N cases per kernel (of those --kernels selects), in collection order; "
                        "--kernels NAME --case-limit 1 runs the first case launching NAME")
    p.add_argument("--extra", default=None,
                   help=f"extra case/reference modules or .py files to load (also ${runner.EXTRA_ENV})")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.kernels:  # repeated --kernels: every glob counts, as with one comma-separated list
        args.kernels = ",".join(args.kernels)
    t0 = time.perf_counter()
    try:
        runner.load_extra()
        if args.extra:
            runner.load_extra(args.extra)
        not_run: dict[str, str] = {}
        if args.backends:
            labels = runner.parse_labels(args.backends)
        else:
            labels, not_run = runner.usable_default_labels()
        if _needs_reexec(labels) and not args.list:
            # The child collects the cases itself: collecting them here too would build every case twice.
            return _reexec_sanitized(sys.argv[1:] if argv is None else list(argv))
        cases = runner.collect_cases(args.seed, args.kernels, big=not args.no_big)
        if args.case_limit is not None:
            cases = runner.limit_cases(cases, args.case_limit, args.kernels)
    except PykernError as e:
        print(f"difftest: {e}", file=sys.stderr)
        return 2
    for why in runner.SKIPPED:  # an optional package missing: say which extra brings those cases back
        print(f"difftest: skipped {why}", file=sys.stderr)
    for why, n in runner.pending_skips(cases).items():
        print(f"difftest: {n} of the {len(cases)} selected cases will be skipped: {why}", file=sys.stderr)
    if args.list:
        for c in cases:
            print(f"{c.id}  kernels={','.join(c.kernels)}")
        return 0
    if not cases:
        print(f"difftest: no case matches --kernels {args.kernels!r}", file=sys.stderr)
        return 2
    if not labels:  # the default run and no backend can run here
        for name, why in not_run.items():
            print(f"difftest: backend {name!r} is unavailable: {why}", file=sys.stderr)
        return 2
    problems = runner.check_available(labels)
    if problems:
        for m in problems:
            print(f"difftest: {m}", file=sys.stderr)
        if any(m.startswith("backend 'numba'") for m in problems) and not runner.importable("numba.cuda"):
            print("difftest: the numba backend comes with an extra: pip install 'pykern[numba]' "
                  "(or pip install 'pykern[test]'); or leave it out: --backends host", file=sys.stderr)
        return 2

    out = sys.stdout
    if not args.json:
        from ..backends import get_backend

        for lb in labels:
            be = get_backend(lb.backend)
            desc = be.describe() if hasattr(be, "describe") else lb.backend
            if lb.backend == "host" and not any(k == "PYKERN_HOST_SCHEDULE" for k, _ in lb.env):
                desc += f", schedule {os.environ.get('PYKERN_HOST_SCHEDULE') or 'forward (default)'}"
            env = " ".join(f"{k}={v}" for k, v in lb.env)
            print(f"# {lb.text}: {desc}{' with ' + env if env else ''}", file=out)
        for name, why in not_run.items():
            if not any(lb.backend == name for lb in labels):
                print(f"# {name}: not run: {why}", file=out)
        print(f"# {len(cases)} cases, seed {args.seed}", file=out)
    results = []
    header_done = False
    w = _widths(cases, labels)
    for case in cases:
        res = runner.run_case(case, labels)
        results.append(res)
        if not args.json:
            if not header_done:
                print(_line(runner.COLUMNS, w), file=out)
                header_done = True
            print(_line(runner.row(res), w), file=out, flush=True)
    seconds = time.perf_counter() - t0
    summary = runner.summarize(results)
    if args.json:
        print(runner.to_json(results, labels, seconds, args.seed, not_run=not_run, not_collected=runner.SKIPPED),
              file=out)
    else:
        fails = [m for r in results for m in r.failures()]
        if fails:
            print("\nFailures:", file=out)
            for m in fails:
                print(f"  {m}", file=out)
        print(f"\n{summary['passed']}/{summary['cases']} cases passed, {summary['failed']} failed, "
              f"{summary['errors']} errors, {summary['skipped']} skipped (no backend could run them), "
              f"{summary['skipped_backend_runs']} backend runs skipped; "
              f"{summary['kernels']} kernels; backends {','.join(lb.text for lb in labels)}; "
              f"{seconds:.1f} s", file=out)
        print(runner.format_summary(results, labels, not_run, runner.SKIPPED), file=out)
    ok = summary["failed"] == summary["errors"] == 0 and summary["passed"] > 0
    return 0 if ok else 1


def _needs_reexec(labels: Sequence[runner.Label]) -> bool:
    """A host:sanitize label in a process without the ASan runtime preloaded."""
    return any(("PYKERN_HOST_SANITIZE", "1") in lb.env for lb in labels) and "libasan" not in os.environ.get(
        "LD_PRELOAD", "")


def _reexec_sanitized(argv: list[str]) -> int:
    """host:sanitize needs the ASan runtime preloaded: run this command again in a child that has it."""
    import subprocess

    from ..backends.host import sanitized_env

    if os.environ.get("PYKERN_DIFFTEST_REEXEC"):
        print("difftest: LD_PRELOAD of libasan did not take effect in the child", file=sys.stderr)
        return 2
    try:
        env = sanitized_env()
    except PykernError as e:
        print(f"difftest: {e}", file=sys.stderr)
        return 2
    env.pop("PYKERN_HOST_SANITIZE", None)  # only the host:sanitize label turns it on, per run
    env["PYKERN_DIFFTEST_REEXEC"] = "1"
    return subprocess.run([sys.executable, "-m", "pykern.difftest", *argv], env=env).returncode


def _widths(cases: Sequence[runner.Case], labels: Sequence[runner.Label]) -> list[int]:
    cols = runner.COLUMNS
    w = [len(c) for c in cols]
    for c in cases:
        w[0] = max(w[0], len(c.id))
        w[1] = max(w[1], min(len(",".join(c.kernels)), 41))
        w[2] = max(w[2], len(c.shape))
    w[3] = max(w[3], 4)
    w[4] = max(w[4], len("|".join(lb.text for lb in labels)))
    w[5] = w[6] = w[7] = 8
    w[8] = max(w[8], 13)
    return w


def _line(values: Sequence[str], w: Sequence[int]) -> str:
    vals = list(values)
    if len(vals[1]) > 41:
        vals[1] = vals[1][:40] + "…"
    return "  ".join(v.ljust(n) for v, n in zip(vals[:-1], w)) + "  " + vals[-1]


if __name__ == "__main__":
    sys.exit(main())
