"""The `gpu` marker's skip logic: GPU-only tests run where the CUDA driver sees a GPU, else skip with why.

Use `@requires_gpu` on a test (it adds the `gpu` marker and the skip), or call `skip_gpu_tests(items)`
from a conftest's `pytest_collection_modifyitems` to apply the skip to everything marked `gpu`.
`pytest -m "not gpu"` deselects them outright.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Iterable

import pytest


@lru_cache(maxsize=None)
def gpu_status() -> tuple[bool, str]:
    """(a GPU is usable through the CUDA driver, why not) — probed once per process."""
    from pykern.backends.driver import CudaDriver
    from pykern.errors import PykernError

    try:
        drv = CudaDriver()
        drv.init()
        n = drv.device_count()
    except PykernError as e:
        return False, str(e)
    if n < 1:
        return False, "the CUDA driver reports no GPU"
    return True, ""


def skip_reason() -> str:
    ok, why = gpu_status()
    return "" if ok else f"needs a GPU: {why}"


def skip_gpu_tests(items: Iterable[pytest.Item]) -> None:
    """Add a skip (with the reason) to every collected test marked `gpu` when there is no GPU."""
    marked = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not marked:
        return
    reason = skip_reason()
    if reason:
        for item in marked:
            item.add_marker(pytest.mark.skip(reason=reason))


def requires_gpu(fn):  # type: ignore[no-untyped-def]
    """Mark a test `gpu` and skip it (saying why) where no GPU is usable."""
    reason = skip_reason()
    fn = pytest.mark.gpu(fn)
    return pytest.mark.skipif(bool(reason), reason=reason or "GPU present")(fn)
