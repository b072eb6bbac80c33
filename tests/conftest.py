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
