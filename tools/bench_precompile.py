"""Cold vs warm `python -m pykern.precompile`: a warm run (all cache hits) must cost <= 10% of a cold one.

Usage:
    python tools/bench_precompile.py [--arch sm_80 --arch sm_90] [--kernels GLOB] [--jobs N] [--max-ratio 0.10]

Each run is a fresh `python -m pykern.precompile` process (so interpreter start-up and imports count, as
they do for a user), against a new temporary cache folder. Exits 1 if warm/cold exceeds --max-ratio.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _run(args: list[str], cache_dir: str) -> tuple[float, dict]:
    env = {**os.environ, "PYKERN_CACHE_DIR": cache_dir}
    env.pop("PYKERN_CUBIN_DIR", None)
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "pykern.precompile", *args, "--json"], cwd=ROOT, env=env,
                         capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if out.returncode != 0:
        sys.stderr.write(out.stderr)
        raise SystemExit(f"precompile failed with exit status {out.returncode}")
    return wall, json.loads(out.stdout)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", action="append", help="archs to compile (default: sm_75..sm_120, six archs)")
    ap.add_argument("--kernels", help="kernel name glob passed to precompile")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--max-ratio", type=float, default=0.10)
    a = ap.parse_args(argv)
    archs = a.arch or ["sm_75,sm_80,sm_86,sm_90,sm_100,sm_120"]
    args = [x for arch in archs for x in ("--arch", arch)] + ["--jobs", str(a.jobs)]
    if a.kernels:
        args += ["--kernels", a.kernels]
    with tempfile.TemporaryDirectory(prefix="pykern-bench-") as d:
        cold, c = _run(args, d)
        warm, w = _run(args, d)
    ratio = warm / cold
    print(f"archs {', '.join(c['archs'])}; {c['jobs']} compiles of {len({r['source'] for r in c['results']})} "
          f"sources, {len({r['kernel'] for r in c['results']})} kernels; --jobs {a.jobs}")
    print(f"cold: {cold:7.2f} s  ({c['compiled']} compiled, {c['hits']} hits)")
    print(f"warm: {warm:7.2f} s  ({w['compiled']} compiled, {w['hits']} hits)")
    print(f"warm/cold = {ratio:.3f} (limit {a.max_ratio:.2f})")
    ok = ratio <= a.max_ratio and w["compiled"] == 0 and w["hits"] == w["jobs"]
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
