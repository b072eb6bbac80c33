"""The "pykern" logger and PYKERN_LOG_LEVEL.

pykern logs through `logging.getLogger("pykern")` only: the backend chosen (info), every NVRTC compile with
file, arch and seconds (info), cache hits and misses (debug). Nothing is printed unless the application
configures logging, or PYKERN_LOG_LEVEL=info|debug|warning is set, which attaches one stderr handler.
"""
from __future__ import annotations

import logging
import os

log = logging.getLogger("pykern")
_configured = False


def configure() -> None:
    """Apply PYKERN_LOG_LEVEL once per process (a no-op when unset or already applied)."""
    global _configured
    if _configured:
        return
    _configured = True
    level = os.environ.get("PYKERN_LOG_LEVEL", "").strip().upper()
    if not level:
        return
    value = logging.getLevelName(level)
    if not isinstance(value, int):
        log.warning("PYKERN_LOG_LEVEL: expected debug, info, warning or error, got %r", level.lower())
        return
    log.setLevel(value)
    if not any(getattr(h, "_pykern", False) for h in log.handlers):
        h = logging.StreamHandler()
        h.setFormatter(logging.Formatter("%(name)s %(levelname)s: %(message)s"))
        h._pykern = True  # type: ignore[attr-defined]
        log.addHandler(h)
        log.propagate = False  # one line per record, not a second copy through the root logger
