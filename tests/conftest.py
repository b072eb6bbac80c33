from __future__ import annotations

import os
from pathlib import Path

# One cache for the whole run (shared by xdist workers: the cache is safe under
# concurrent processes), kept out of the user's own cache.
os.environ.setdefault("PYKERN_CACHE_DIR", str(Path(__file__).resolve().parent.parent / ".cache" / "pykern-test"))

import sys

sys.path.insert(0, str(Path(__file__).resolve().parent))


def pytest_collection_modifyitems(config, items):
    from gpu import skip_gpu_tests

    skip_gpu_tests(items)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # A test that times the host is only meaningful with no neighbour on the other core: beside a busy xdist
        # worker (NVRTC builds, numba) its minimum CPU time rose 10-35% (shared caches), past its budget.
        import pytest

        skip = pytest.mark.skip(reason="times the host: runs alone, in the README's second call (pytest -m serial)")
        for item in items:
            if item.get_closest_marker("serial"):
                item.add_marker(skip)
