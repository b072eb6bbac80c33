"""The softmax attention backward's former module path: `attention_backward` and its sizing helpers live in
pykern/ops/attention.py (the attention family); importing them from here keeps working."""
from __future__ import annotations

from .attention import (  # noqa: F401
    DET_WORKSPACE_BYTES,
    FUSED_HEAD_DIMS,
    MAX_HEAD_DIM,
    METHODS,
    NAIVE_MAX_SEQ,
    attention_backward,
    fused_available,
    fused_shared_bytes,
    group_lanes,
    naive_max_seq,
    tc_backward_shared_bytes,
)

__all__: list[str] = []  # pykern.ops takes attention_backward from the attention module
