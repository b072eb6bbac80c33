"""The one place where pykern.torch hands tensors to pykern.ops.

`call(op_name, *args, **kw)` runs a pykern op on torch tensors and returns torch
tensors. CPU tensors become zero-copy NumPy views (bf16 through an int16 view
reinterpreted as ml_dtypes.bfloat16) and the op's NumPy outputs are wrapped back
with torch.from_numpy, so nothing is copied on the CPU backends. CUDA tensors are
handed to the op as they are: pykern.ops accepts torch CUDA tensors and returns
torch CUDA tensors on the caller's stream.

Every tensor is detached first: inside a custom op the inputs are plain data,
and a CUDA tensor that requires grad refuses `__cuda_array_interface__`.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .. import ops


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach()
    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def _to_torch(a: Any) -> Any:
    if isinstance(a, np.ndarray):
        if not a.flags.c_contiguous:  # (np.ascontiguousarray would turn a 0-d array into 1-d)
            a = a.copy(order="C")
        if a.dtype.name == "bfloat16":
            return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(a)
    if isinstance(a, tuple):
        return tuple(_to_torch(x) for x in a)
    if isinstance(a, list):
        return [_to_torch(x) for x in a]
    return a


def has_op(name: str) -> bool:
    """Whether pykern.ops provides `name` (ops added by other work land without touching callers)."""
    try:
        getattr(ops, name)
    except AttributeError:
        return False
    return True


def call(name: str, *args: Any, **kwargs: Any) -> Any:
    """pykern.ops.<name>(*args, **kwargs) on torch tensors, returning torch tensors."""
    fn = getattr(ops, name)
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    if any(t.device.type != "cpu" for t in tensors):
        # Device tensors go to the op as they are (it reads them through
        # __cuda_array_interface__ / data_ptr and allocates outputs with torch).
        conv = lambda a: a.detach() if isinstance(a, torch.Tensor) else a  # noqa: E731
        return fn(*(conv(a) for a in args), **{k: conv(v) for k, v in kwargs.items()})
    conv = lambda a: _to_numpy(a) if isinstance(a, torch.Tensor) else a  # noqa: E731
    return _to_torch(fn(*(conv(a) for a in args), **{k: conv(v) for k, v in kwargs.items()}))
