"""Snapshot the SASS inputs of the attention kernels a measured build ran, from the sources of the measured commit.

The attention model (pykern/bench/attention_model.py) is fitted to our own H200 measurements of 2026-11-27. Those
times belong to the kernels compiled then, so the fit must read the loop inputs (instructions, MMAs, shared-memory
bytes per loop iteration), the registers and the static shared memory of THOSE kernels, not of today's sources.
This tool writes them once:

    python tools/attention_sass_snapshot.py                      # docs/measured/2026-11-27-h200/sass_inputs.json
    python tools/attention_sass_snapshot.py --commit e20e398 --out /tmp/sass_inputs.json

It checks out `git show COMMIT:kernels_cu/<file>` for every source and header of kernels_cu/ at that commit into a
temporary folder (a source's own folder is searched first for its #includes, so the commit's headers are the ones
compiled), compiles the attention sources with today's NVRTC for every (kernel, arch) the measured build's launches
use -- sm_90a for the wgmma kernels, sm_90 for the mma.sync ones, as the model picks them for an H200 -- and writes
their KernelInputs under today's kernel names (the kernels were renamed on 2026-11-29; RENAMES maps each name
back to the one it was compiled under). attention_model.SassSnapshot reads the file; fit() / compare() and the
calibrated model of the measured build use it and need no NVRTC.

Needs NVRTC (cuda-python or the nvidia-cuda-nvrtc wheel) and cuobjdump, as tools/sass_report.py does.
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pykern.bench import attention_model as am  # noqa: E402
from pykern.registry import parse_file  # noqa: E402

# The commit our 2026-11-27 H200 run measured: the parent of the commit that added its raw figures (52a7963,
# 17:47 UTC), the last one before the run ended (17:45). kernels_cu/ is the same tree (f96a3ac) in every commit from
# 98a14f3 (16:05) to 52a7963, and pykern/compiler.py the same from 93db8d1 (17:35, -default-device, without which the
# fused mma.sync backward the run timed does not compile under NVRTC 13.0) on.
MEASURED_COMMIT = "e20e39881212e7100b634554f548f1f4dd1c19ce"

# today's kernel-name prefix -> the one of the measured sources (the 2026-11-29 rename onto one naming scheme)
RENAMES = (
    ("attention_fwd_varlen_sm90_", "flash_attention_varlen_sm90_"),
    ("attention_fwd_varlen_tc_", "flash_attention_varlen_tc_"),
    ("attention_fwd_sm90_", "flash_attention_sm90_"),
    ("attention_fwd_tc_", "flash_attention_tc_"),
    ("attention_bwd_sm90_", "attention_backward_sm90_"),
    ("attention_bwd_tc_", "attention_backward_tc_"),
)


def old_name(kernel: str) -> str:
    """The name today's `kernel` had in the measured sources."""
    for new, old in RENAMES:
        if kernel.startswith(new):
            return old + kernel[len(new):]
    return kernel


def new_name(kernel: str) -> str:
    """Today's name of a kernel of the measured sources."""
    for new, old in RENAMES:
        if kernel.startswith(old):
            return new + kernel[len(old):]
    return kernel


class CommitSass(am.SassSource):
    """SassSource over the attention sources of one commit, checked out into `folder`, under today's names."""

    def __init__(self, folder: Path) -> None:
        super().__init__()
        self.folder = folder
        self._old: dict[str, str] = {}

    def kernels(self) -> dict[str, Path]:
        if self._where is None:
            self._where = {}
            for src in sorted(self.folder.glob("*.cu")):
                if "attention" not in src.name:
                    continue
                for spec in parse_file(src, strict=False):
                    name = new_name(spec.name)
                    self._where.setdefault(name, src)
                    self._old.setdefault(name, spec.name)
        return self._where

    def compiled_name(self, kernel: str) -> str:
        self.kernels()
        return self._old.get(kernel, old_name(kernel))


def git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], check=True, capture_output=True, text=True).stdout


def checkout(commit: str, folder: Path) -> str:
    """kernels_cu/ of `commit` into `folder`; returns the tree's hash."""
    for name in git("ls-tree", "--name-only", f"{commit}:kernels_cu").split():
        if name.endswith((".cu", ".cuh", ".h")):
            (folder / name).write_bytes(subprocess.run(["git", "-C", str(ROOT), "show", f"{commit}:kernels_cu/{name}"],
                                                       check=True, capture_output=True).stdout)
    return git("rev-parse", f"{commit}:kernels_cu").strip()


def measured_kernels(sass: am.SassSource, path: Path) -> list[tuple[str, str]]:
    """(kernel, arch) of every launch the calibrated model makes for the measured points of `path` (as
    attention_model.calibrated picks them for the measured build on an H200)."""
    out: set[tuple[str, str]] = set()
    names = list(sass.kernels())
    for p in am.measured_points(path):
        lts: list[am.Launch] = []
        if p["variant"] == "wgmma":
            lts, _why = am.sm90_launches(p["phase"], p["shape"], names, build=am.MEASURED_BUILD)
        if not lts:
            lts = am.launches(p["phase"], p["shape"])
        out |= {(lau.kernel, lau.arch or am.H200.arch) for lau in lts}
    return sorted(out)


def snapshot(commit: str, measured: Path) -> dict[str, Any]:
    from pykern.compiler import nvrtc_version

    full = git("rev-parse", commit).strip()
    with tempfile.TemporaryDirectory(prefix="pk_sass_snapshot_") as tmp:
        folder = Path(tmp)
        tree = checkout(full, folder)
        sass = CommitSass(folder)
        rows = []
        for kernel, arch in measured_kernels(sass, measured):
            if kernel not in sass.kernels():
                raise SystemExit(f"{kernel} (compiled as {old_name(kernel)}) is not a kernel of {full[:12]}")
            k = sass.inputs(kernel, arch)
            rows.append({**k.to_record(), "compiled_as": sass.compiled_name(kernel),
                         "source": f"kernels_cu/{sass.kernels()[kernel].name}"})
    v = nvrtc_version()
    return {"build": am.MEASURED_BUILD, "commit": full, "kernels_cu_tree": tree,
            "measured": str(measured.relative_to(ROOT)) if measured.is_relative_to(ROOT) else str(measured),
            "nvrtc": ".".join(map(str, v)) if isinstance(v, tuple) else str(v),
            "written_by": "python tools/attention_sass_snapshot.py", "kernels": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--commit", default=MEASURED_COMMIT, help="the measured commit (default: %(default)s)")
    ap.add_argument("--measured", type=Path, default=am.MEASURED, help="its attention.json (default: ours)")
    ap.add_argument("--out", type=Path, default=am.MEASURED_SASS, help="the JSON to write (default: %(default)s)")
    args = ap.parse_args(argv)
    if not re.fullmatch(r"[0-9a-fA-F]{7,40}", args.commit):
        ap.error(f"--commit: expected a commit hash, got {args.commit!r}")
    doc = snapshot(args.commit, args.measured.resolve())
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"{args.out}: {len(doc['kernels'])} kernels of {doc['commit'][:12]}")
    for r in doc["kernels"]:
        print(f"  {r['kernel']:40s} {r['arch']:7s} {r['loop']['insns'] / r['loop']['mma']:7.3f} insns/MMA "
              f"{r['regs']:4d} regs {r['static_smem']:6d} B static smem  (as {r['compiled_as']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
