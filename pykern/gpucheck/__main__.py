"""`python -m pykern.gpucheck`; see pykern/gpucheck/cli.py and docs/gpu-ci.md."""
from __future__ import annotations

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
