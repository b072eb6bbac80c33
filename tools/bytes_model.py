#!/usr/bin/env python
"""Bytes model of pykern's memory-bound ops at LLaMA-sized shapes (no GPU needed): a thin wrapper around
pykern.bench.bytes_model, kept so `python tools/bytes_model.py` and the tools that `import bytes_model` work.

    python tools/bytes_model.py [--group forward|training] [--dtype bf16|f32] [--json]
"""
from __future__ import annotations

import json  # noqa: F401  (tools/bench_*.py call bytes_model.json.dumps)
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout's pykern, when not installed

from pykern.bench.bytes_model import *  # noqa: E402,F401,F403
from pykern.bench.bytes_model import (  # noqa: E402,F401  (names the star import leaves out)
    FFN, H100_BW, H100_L2, H100_SMS, HEAD_DIM, HEADS, HIDDEN, KV_HEADS, SEQ, TOKENS, VOCAB, Row, forward_rows,
    main, rows, table, training_rows,
)

if __name__ == "__main__":
    sys.exit(main())
