"""What `import pykern` costs over a bare interpreter, measured in fresh subprocesses.

    python tools/bench_import.py [--runs 15] [--json] [--importtime]

Each run starts a new interpreter (so no module is cached); the reported cost is the median of
`python -c "import pykern"` minus the median of `python -c "pass"`. Budget: <= 100 ms.
--importtime prints the slowest modules of one `-X importtime` run (to see what to make lazy).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUDGET_MS = 100.0


def _run(code: str) -> float:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=ROOT)
    return (time.perf_counter() - t0) * 1e3


def _importtime(top: int = 12) -> list[tuple[float, str]]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-X", "importtime", "-c", "import pykern"], env=env, cwd=ROOT,
                       capture_output=True, text=True, check=True)
    rows = []
    for line in r.stderr.splitlines():
        parts = line.split("|")
        if len(parts) == 3 and parts[1].strip().isdigit():
            rows.append((int(parts[1]) / 1e3, parts[2].rstrip()))
    return sorted(rows, reverse=True)[:top]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--importtime", action="store_true", help="also list the slowest imports (cumulative ms)")
    args = ap.parse_args(argv)

    bare, imp = [], []
    for _ in range(args.runs):  # interleaved so drift hits both alike
        bare.append(_run("pass"))
        imp.append(_run("import pykern"))
    res = {
        "bare_interpreter_ms": statistics.median(bare),
        "import_pykern_ms": statistics.median(imp),
        "import_cost_ms": statistics.median(imp) - statistics.median(bare),
        "budget_ms": BUDGET_MS,
        "runs": args.runs,
    }
    res["within_budget"] = res["import_cost_ms"] <= BUDGET_MS
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        for k, v in res.items():
            print(f"{k:22s} {v:.1f}" if isinstance(v, float) else f"{k:22s} {v}")
    if args.importtime:
        print("slowest imports (cumulative ms):")
        for ms, name in _importtime():
            print(f"  {ms:8.2f}  {name}")
    return 0 if res["within_budget"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
