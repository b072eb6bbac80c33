"""numba.cuda reference kernels: simple, obviously right, one module per kernel family."""
from __future__ import annotations

import importlib
import pkgutil

_loaded = False


def _load_all() -> None:
    global _loaded
    if _loaded:
        return
    for m in pkgutil.iter_modules(__path__):
        if m.name != "base":
            importlib.import_module(f"{__name__}.{m.name}")
    _loaded = True
