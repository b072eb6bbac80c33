"""Test helper: record the kernel names the launches of a test ask for (the launches still run)."""
from __future__ import annotations

import pytest


def record_launches(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Kernel names every launch of this test asks for, in order; the launches still run."""
    from pykern import launcher

    names: list[str] = []
    real = launcher.launch

    def spy(name, *a, **kw):
        names.append(name)
        return real(name, *a, **kw)

    monkeypatch.setattr(launcher, "launch", spy)  # the ops import it at call time
    return names
