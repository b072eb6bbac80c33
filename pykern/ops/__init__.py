"""Typed, shape-level user functions; one module per kernel family, all names exported here.

Imported lazily: `pykern.ops.rms_norm` loads the family modules on first access.
"""
from __future__ import annotations

import importlib
import pkgutil
import sys
import types
from typing import Any

_table: dict[str, Any] | None = None


def _ops() -> dict[str, Any]:
    global _table
    if _table is None:
        table: dict[str, Any] = {}
        for m in pkgutil.iter_modules(__path__):
            if m.name.startswith("_"):
                continue
            mod = importlib.import_module(f"{__name__}.{m.name}")
            for name in getattr(mod, "__all__", ()):
                table[name] = getattr(mod, name)
        _table = table
    return _table


def __getattr__(name: str) -> Any:
    try:
        return _ops()[name]
    except KeyError:
        raise AttributeError(f"pykern.ops has no op {name!r}") from None


def __dir__() -> list[str]:
    return sorted(_ops())


class _OpsPackage(types.ModuleType):
    """A family module named after one of its ops (gemm_fp8.py defines gemm_fp8): the import system sets the
    package attribute to the submodule once it is loaded, which would shadow the op; the op stays there
    (`from pykern.ops.gemm_fp8 import ...` still reaches the module through sys.modules)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, types.ModuleType) and value.__name__ == f"{__name__}.{name}" and \
                name in getattr(value, "__all__", ()):
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _OpsPackage
