"""The one place where pykern.torch hands tensors to pykern.ops.

pykern.ops accepts torch tensors (CPU: zero-copy views on the CPU backends;
CUDA: the nvrtc backend, launched on torch.cuda.current_stream(), outputs from
torch's allocator) and returns torch tensors, so a call is a plain op call.
Every tensor is detached first: inside a custom op the inputs are plain data.
Autocast is off inside: the kernels fix the precision (the functions in
functional/training apply torch's autocast policy before reaching the op).

Every training-step op call passes here, so the per-call work is kept to what a call needs: the op is
looked up once per name, and autocast is asked about only when some autocast is on.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from .. import ops
from . import _amp

_Tensor = torch.Tensor
_fns: dict[str, Callable[..., Any]] = {}  # op name -> pykern.ops function (the ops package resolves lazily)
_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", None)


def call(name: str, *args: Any, **kwargs: Any) -> Any:
    """pykern.ops.<name>(*args, **kwargs) on torch tensors, returning torch tensors."""
    fn = _fns.get(name)
    if fn is None:
        fn = _fns[name] = getattr(ops, name)
    args = tuple([a.detach() if isinstance(a, _Tensor) else a for a in args])
    if kwargs:
        for k, v in kwargs.items():
            if isinstance(v, _Tensor):
                kwargs[k] = v.detach()
    if _any_autocast is not None and not _any_autocast():
        return fn(*args, **kwargs)
    first = next((a for a in (*args, *kwargs.values()) if isinstance(a, _Tensor)), None)
    with _amp.disabled(first):  # the ops' own torch work (matmuls of the fused linear CE) stays in their dtypes
        return fn(*args, **kwargs)
