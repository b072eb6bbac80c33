"""What `import pykern` costs over a bare interpreter, measured in fresh subprocesses.

    python tools/bench_import.py [--runs 15] [--json] [--importtime]

Each run starts a new interpreter (so nothing is cached in sys.modules). Two measures:
  * import_cost_ms: timed inside the fresh interpreter around `import pykern` alone (the
    interpreter's own start-up, e.g. site-packages .pth hooks, is excluded: it is not pykern's).
  * wall_difference_ms: median wall time of `python -c "import pykern"` minus `python -c "pass"`
    (the same thing seen from outside; noisier on a busy machine).
Budget: import_cost_ms <= 100 ms. `first_use_ms` is informational: `import pykern` plus what the first
launch loads (numpy, the launcher, the registry, the nvrtc backend module).
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
_TIMED = "import time; t = time.perf_counter(); {stmt}; print((time.perf_counter() - t) * 1e3)"


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def _wall(code: str) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, env=_env(), cwd=ROOT)
    return (time.perf_counter() - t0) * 1e3


def _inside(stmt: str) -> float:
    r = subprocess.run([sys.executable, "-c", _TIMED.format(stmt=stmt)], check=True, env=_env(), cwd=ROOT,
                       capture_output=True, text=True)
    return float(r.stdout.strip().splitlines()[-1])


def _importtime(top: int = 12) -> list[tuple[float, str]]:
    r = subprocess.run([sys.executable, "-X", "importtime", "-c", "import pykern"], env=_env(), cwd=ROOT,
                       capture_output=True, text=True, check=True)
    rows = []
    for line in r.stderr.splitlines():
        parts = line.split("|")
        # site's own start-up (.pth hooks) is in every interpreter: list pykern's subtree only
        if len(parts) == 3 and parts[1].strip().isdigit() and parts[2].strip().startswith("pykern"):
            rows.append((int(parts[1]) / 1e3, parts[2].rstrip()))
    return sorted(rows, reverse=True)[:top]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--importtime", action="store_true", help="also list the slowest imports (cumulative ms)")
    args = ap.parse_args(argv)

    inside, first, bare, wall = [], [], [], []
    for _ in range(args.runs):  # interleaved so load drift hits every measure alike
        inside.append(_inside("import pykern"))
        first.append(_inside("import pykern; pykern.launch; import pykern.backends.nvrtc"))
        bare.append(_wall("pass"))
        wall.append(_wall("import pykern"))
    res = {
        "import_cost_ms": statistics.median(inside),
        "import_cost_min_ms": min(inside),
        "wall_difference_ms": statistics.median(wall) - statistics.median(bare),
        "bare_interpreter_ms": statistics.median(bare),
        "first_use_ms": statistics.median(first),
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
        print("slowest imports under `import pykern` (cumulative ms):")
        for ms, name in _importtime():
            print(f"  {ms:8.2f}  {name}")
    return 0 if res["within_budget"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
