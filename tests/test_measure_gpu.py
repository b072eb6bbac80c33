"""tools/measure_gpu.py without a GPU: the summary of the committed H200 figures, and the exit status where there
is no GPU. (The measurements themselves only run on a GPU: docs/measured/.)"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "docs" / "measured" / "2026-11-27-h200"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "tools" / "measure_gpu.py"), *args], capture_output=True,
                          text=True, cwd=ROOT, timeout=120)


def test_summary_of_the_h200_run_matches_the_report():
    r = _run("summary", *(str(DATA / f) for f in ("ceilings.json", "attention.json", "decode.json", "model.json")))
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert '"name": "NVIDIA H200"' in out and '"GBps_read_plus_write": 4258.04' in out
    # the rows docs/measured/2026-11-27-h200.md quotes
    assert any(line.startswith("d128 causal  16384    540| 373") for line in out.splitlines())
    assert any(line.startswith("bf16  g4 b8    32768     277.0us    3877") for line in out.splitlines())
    assert out.count("\nbf16  g") == 33 and out.count("\ne4m3  g") == 33


@pytest.mark.parametrize("what", ["ceilings", "decode-graph"])
def test_no_gpu_exits_3_saying_why(what):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    r = _run(what)
    assert r.returncode == 3 and "needs a CUDA GPU" in r.stderr
