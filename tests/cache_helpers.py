"""Shared setup of the cache / precompile tests: private copies of tests/cu's sources over an empty cache folder,
and a stderr stand-in that says it is (or is not) a terminal."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from pykern import cache

CU = Path(__file__).parent / "cu"
JIT_VARS = ("PYKERN_CUBIN_DIR", "PYKERN_DISABLE_JIT")  # a bundle or JIT off would keep the cache from compiling


def private_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *, on_path: bool = True,
                    unset: tuple[str, ...] = JIT_VARS) -> Path:
    """tests/cu copied to tmp_path/src (on PYKERN_KERNEL_PATH when on_path), an empty cache folder at
    tmp_path/cache, the `unset` variables removed and the in-process module memo emptied; returns the copy."""
    src = tmp_path / "src"
    shutil.copytree(CU, src)
    if on_path:
        monkeypatch.setenv("PYKERN_KERNEL_PATH", str(src))
    monkeypatch.setenv("PYKERN_CACHE_DIR", str(tmp_path / "cache"))
    for var in unset:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(cache, "_memory", {})
    return src


class FakeStderr:
    """A stderr that says it is a terminal (or not, tty=False) and keeps what was written."""

    def __init__(self, tty: bool = True) -> None:
        self.parts: list[str] = []
        self.tty = tty

    def write(self, s: str) -> int:
        self.parts.append(s)
        return len(s)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return self.tty

    @property
    def text(self) -> str:
        return "".join(self.parts)
