"""A long run of the bad-input fuzzer (tests/test_fuzz_bad_input.py), with its findings as a table.

    python tools/fuzz_bad_input.py [--examples 2000] [--seed 7] [--ops 'rms_norm,paged_*,torch.*'] [--out F.jsonl]

Runs the test module in survey mode: every example's verdict (an error naming the argument, a result that
matched the reference, or a failure) is written to --out and nothing stops at the first failure. Prints,
per op and input class, what happened: how many calls raised, returned a matching result, or failed, and
the first failure message of each. Exit status 1 when anything failed. See docs/fuzzing.md.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--examples", type=int, default=2000, help="examples per op (CI runs 40)")
    ap.add_argument("--seed", type=int, default=None, help="hypothesis seed (default: derandomized, as CI)")
    ap.add_argument("--ops", default="", help="comma-separated globs of spec names (default: all)")
    ap.add_argument("--out", default=None, help="JSON lines of every verdict (default: a temporary file)")
    ap.add_argument("--shrink", action="store_true", help="minimise failing inputs (slow; off for a survey)")
    args = ap.parse_args(argv)

    out = Path(args.out or tempfile.mkstemp(prefix="pykern-fuzz-", suffix=".jsonl")[1])
    out.write_text("")
    env = dict(os.environ, PYKERN_FUZZ_EXAMPLES=str(args.examples), PYKERN_FUZZ_SURVEY=str(out),
               PYKERN_FUZZ_OPS=args.ops, PYKERN_FUZZ_SHRINK="1" if args.shrink else "0")
    if args.seed is not None:
        env["PYKERN_FUZZ_SEED"] = str(args.seed)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_fuzz_bad_input.py",
           "-k", "test_bad_input"]
    rc = subprocess.call(cmd, cwd=ROOT, env=env)

    rows: dict[tuple[str, str], collections.Counter] = collections.defaultdict(collections.Counter)
    first: dict[tuple[str, str], str] = {}
    for line in out.read_text().splitlines():
        v = json.loads(line)
        if v["what"] == "FAIL":
            # "op: param <- class: message"
            head = v["detail"].split(": ", 2)
            key = (v["op"], head[1] if len(head) > 2 else "?")
            first.setdefault(key, head[-1])
        else:
            key = (v["op"], f"{v['param']} <- {v['class']}")
        rows[key][v["what"]] += 1
    failed = sorted(k for k in rows if rows[k]["FAIL"])
    print(f"\n{sum(sum(c.values()) for c in rows.values())} calls, {len(rows)} (op, argument <- class) pairs, "
          f"{len(failed)} with failures; verdicts in {out}")
    for key in failed:
        print(f"FAIL  {key[0]:32s} {key[1]:40s} x{rows[key]['FAIL']}: {first[key][:200]}")
    if rc not in (0, 1) and not failed:  # pytest itself failed (a crash, a collection error)
        return rc
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
