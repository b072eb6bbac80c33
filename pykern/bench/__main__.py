"""`python -m pykern.bench` (see pykern/bench/cli.py and `--help`)."""
from __future__ import annotations

import sys

from .cli import main

sys.exit(main())
