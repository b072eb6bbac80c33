"""pykern.torch.apply under torch.distributed: DDP, FSDP2 (fully_shard per decoder layer and on the
root) and tensor parallelism (parallelize_module, with local and with DTensor activations), two CPU
ranks on gloo launched by torchrun. Each must give the losses of unpatched single-process training."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
if not torch.distributed.is_available():
    pytest.skip("torch.distributed is not available", allow_module_level=True)

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "dist_train.py"
RTOL = 1e-4


def _run(args: list[str], timeout: int = 180) -> dict[str, object]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"{' '.join(args)} failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    out = {}
    for line in p.stdout.splitlines():
        if line.startswith("PYKERN_"):
            key, _, val = line.partition(" ")
            out[key] = json.loads(val)
    return out


@pytest.fixture(scope="module")
def reference() -> list[float]:
    return _run([str(SCRIPT), "--mode", "single", "--unpatched"])["PYKERN_LOSSES"]


def _torchrun(mode: str) -> dict[str, object]:
    # --standalone: a private rendezvous on a free port, so parallel test runs do not collide
    return _run(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(SCRIPT),
                 "--mode", mode])


@pytest.mark.parametrize("mode", ["ddp", "fsdp", "tp", "tp-dtensor"])
def test_patched_distributed_training_matches_single_process(mode, reference):
    got = _torchrun(mode)
    losses = got["PYKERN_LOSSES"]
    assert len(losses) == len(reference) == 5
    assert len(set(reference)) == 5  # the optimizer moves the model: later steps test the updates too
    for step, (a, b) in enumerate(zip(losses, reference)):
        assert abs(a - b) <= RTOL * abs(b), f"{mode} step {step}: {a} vs unpatched single-process {b}"
    paths = got["PYKERN_DTENSOR_PATHS"]
    if mode == "tp-dtensor":
        # DTensor activations sharded on heads / the intermediate axis run on the local shards
        for op in ("rope", "flash_attention", "swiglu"):
            assert paths.get(f"{op}:local", 0) > 0 and f"{op}:gather" not in paths, paths
    else:
        assert paths == {}, paths  # no DTensor reaches pykern (FSDP2 unshards; tp hands out local tensors)
