"""The host backend's emulation tests' shared setup: the kernels of tests/host_kernels/ on the registry's path,
the deterministic block schedule (blocks in order, so a race shows the same way every run unless a test asks for
another), and a launch on the host backend."""
from __future__ import annotations

from pathlib import Path

import pytest

import pykern

HOST_KERNELS = Path(__file__).resolve().parent / "host_kernels"


@pytest.fixture(autouse=True)
def _host_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """Imported into a test module, every test there sees tests/host_kernels/ and the forward schedule."""
    monkeypatch.setenv("PYKERN_KERNEL_PATH", str(HOST_KERNELS))
    monkeypatch.setenv("PYKERN_HOST_SCHEDULE", "forward")


def launch(name: str, grid: int, block: int, *args: object, shared_mem: int = 0) -> None:
    pykern.launch(name, grid, block, *args, shared_mem=shared_mem, backend="host")
