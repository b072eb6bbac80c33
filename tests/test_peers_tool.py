"""tools/peers.py without the network or a GPU: the include closure that strips FlashInfer to the modules we time,
and the command's own errors and help."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import peers  # noqa: E402


def _tree(tmp_path: Path) -> tuple[Path, Path]:
    src, inc = tmp_path / "src", tmp_path / "inc"
    (inc / "lib" / "detail").mkdir(parents=True)
    src.mkdir()
    (src / "main.cu").write_text('#include "local.h"\n#include <lib/a.h>\n#include <cuda_runtime.h>\n')
    (src / "local.h").write_text("#pragma once\n")
    (inc / "lib" / "a.h").write_text('#if 0\n  #  include "detail/b.h"\n#endif\n')
    (inc / "lib" / "detail" / "b.h").write_text('#include <lib/a.h>\n')   # a cycle
    (inc / "lib" / "unused.h").write_text("")
    return src, inc


def test_include_closure_follows_local_and_search_path_includes(tmp_path):
    src, inc = _tree(tmp_path)
    got = {p.relative_to(tmp_path).as_posix() for p in peers.include_closure([src / "main.cu"], [inc])}
    # textual: the include under #if 0 counts (a superset of what a compile opens); a header the folders do not
    # hold (cuda_runtime.h, the toolkit's) is skipped; an unreferenced header is left out; the cycle ends
    assert got == {"src/main.cu", "src/local.h", "inc/lib/a.h", "inc/lib/detail/b.h"}


def test_include_closure_prefers_the_including_files_folder(tmp_path):
    src, inc = _tree(tmp_path)
    (inc / "local.h").write_text("")   # same name on the search path: the source's own folder wins
    got = {p.relative_to(tmp_path).as_posix() for p in peers.include_closure([src / "main.cu"], [inc])}
    assert "src/local.h" in got and "inc/local.h" not in got


def test_install_names_the_missing_part(tmp_path, monkeypatch):
    monkeypatch.setattr(peers, "CARRY", tmp_path / ".carry")
    monkeypatch.setattr(peers, "SITE", tmp_path / "site")
    with pytest.raises(SystemExit, match=r"\.carry/peers2 is missing: name it in the call's carry"):
        peers.main(["install", "--part", "2"])
    assert not (tmp_path / "site").exists()   # nothing half-made


def test_help_names_every_step():
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "peers.py"), "--help"], capture_output=True, text=True)
    assert r.returncode == 0
    for word in ("fetch", "pack", "install", "check", "64 MiB", "--part 1", "--part 2"):
        assert word in r.stdout, word


def test_build_names_unknown_groups():
    with pytest.raises(SystemExit, match=r"--groups: expected names from decode, decode_tc, prefill, sampling, mla, "
                                         r"got bogus"):
        peers.main(["build", "--groups", "decode,bogus"])


def test_gpu_attention_script_usage_and_its_default_plan(tmp_path):
    """tools/gpu_attention.sh: bash parses it; without a part (or with another) it prints its usage and exits 2;
    call 2 without OUT stops before unpacking anything, naming OUT; call 2's default options are a plan
    tools/measure_gpu.py takes (--list: the forward's 54 rows, no GPU)."""
    import re

    script = ROOT / "tools" / "gpu_attention.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    for argv in ([], ["3"]):
        r = subprocess.run(["bash", str(script), *argv], capture_output=True, text=True)
        assert r.returncode == 2 and "usage: tools/gpu_attention.sh 1|2" in r.stderr, r
    env = {k: v for k, v in __import__("os").environ.items() if k != "OUT"}
    r = subprocess.run(["bash", str(script), "2"], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert r.returncode != 0 and "OUT" in r.stderr and "unpack" not in r.stderr + r.stdout, r
    default = re.search(r"args=\((--fwd-only[^)]*)\)", script.read_text()).group(1).split()
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "measure_gpu.py"), "attention", "--list", *default],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert re.search(r"^54 rows, modelled \d+ s", r.stdout, re.M), r.stdout[-500:]
