"""The one place where pykern.torch hands tensors to pykern.ops.

pykern.ops accepts torch tensors (CPU: zero-copy views on the CPU backends;
CUDA: the nvrtc backend, launched on torch.cuda.current_stream(), outputs from
torch's allocator) and returns torch tensors, so a call is a plain op call.
Every tensor is detached first: inside a custom op the inputs are plain data.
Autocast is off inside: the kernels fix the precision (the functions in
functional/training apply torch's autocast policy before reaching the op).
"""
from __future__ import annotations

from typing import Any

import torch

from .. import ops
from . import _amp


def call(name: str, *args: Any, **kwargs: Any) -> Any:
    """pykern.ops.<name>(*args, **kwargs) on torch tensors, returning torch tensors."""
    fn = getattr(ops, name)
    conv = lambda a: a.detach() if isinstance(a, torch.Tensor) else a  # noqa: E731
    first = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
    with _amp.disabled(first):  # the ops' own torch work (matmuls of the fused linear CE) stays in their dtypes
        return fn(*(conv(a) for a in args), **{k: conv(v) for k, v in kwargs.items()})
