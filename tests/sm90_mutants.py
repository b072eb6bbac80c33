"""The sm_90a tests' mutants: a copy of a kernel source with one piece of text replaced, its kernels renamed so
they do not collide with the real ones, found through PYKERN_KERNEL_PATH. A check that passes the real kernel
must fail each mutant: that is what shows the check can see the defect the mutant plants."""
from __future__ import annotations

from pathlib import Path

import pytest


def write_mutant(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, src: Path, old: str, new: str, file_name: str,
                 rename: tuple[str, str]) -> None:
    """src with `old` (which must stand there exactly once) replaced by `new` and every rename[0] in it spelled
    rename[1], written to tmp_path / file_name, which goes on PYKERN_KERNEL_PATH."""
    text = src.read_text()
    assert text.count(old) == 1, old
    (tmp_path / file_name).write_text(text.replace(old, new).replace(*rename))
    monkeypatch.setenv("PYKERN_KERNEL_PATH", str(tmp_path))


def launch_mutants(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, src: Path, old: str, new: str, file_name: str,
                   real: str, mutant: str) -> None:
    """write_mutant with `real` spelled `mutant`, and the launcher spied so that the ops, asking for their real
    kernel names, launch the mutant's kernels instead."""
    from pykern import launcher

    write_mutant(tmp_path, monkeypatch, src, old, new, file_name, (real, mutant))
    launch = launcher.launch
    monkeypatch.setattr(launcher, "launch", lambda name, *a, **kw: launch(name.replace(real, mutant), *a, **kw))
