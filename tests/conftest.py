from __future__ import annotations

import os
import re
from pathlib import Path

# One cache for the whole run (shared by xdist workers: the cache is safe under
# concurrent processes), kept out of the user's own cache.
os.environ.setdefault("PYKERN_CACHE_DIR", str(Path(__file__).resolve().parent.parent / ".cache" / "pykern-test"))
# The suite already runs one compile per CPU (xdist workers, test_compiler's pool of real compiles): a ptxas split
# over every CPU in each of them would oversubscribe the machine. The tests of the split set their own count.
os.environ.setdefault("PYKERN_COMPILE_THREADS", "1")

import sys

sys.path.insert(0, str(Path(__file__).resolve().parent))


def pytest_ignore_collect(collection_path: Path, config) -> bool | None:
    """`pytest -m serial` (the README's second call) runs only the host-time tests: a test file that does not
    name the marker is not imported there, so that call does not collect the whole suite again (every module's
    imports and parametrizations, the difftest cases among them) to deselect all but a few tests. A file with
    serial tests names the marker in its own text (`@pytest.mark.serial`, or `pytestmark` naming it)."""
    if (config.getoption("markexpr", "") or "").strip() != "serial":
        return None
    if collection_path.suffix != ".py" or not collection_path.name.startswith("test_"):
        return None
    try:
        text = collection_path.read_text(encoding="utf-8")
    except OSError:
        return None
    return None if re.search(r"\bmark\.serial\b", text) else True


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
