"""Argument checks of pykern.torch's public functions, from their annotations, before any torch work.

A wrong Python type (a str for a tensor, a list for a float) or a meta tensor would otherwise surface as
torch.library's RuntimeError, an AttributeError or a ValueError from float(): the checks raise pykern's
ArgumentTypeError naming the argument instead. Flags (bool) are read by their truth value, as torch does.
"""
from __future__ import annotations

import functools
import inspect
import math
import numbers
from typing import Any, Callable

import torch

from ..devices import meta_tensor
from ..errors import ArgumentError, ArgumentTypeError

_TENSOR, _OPT_TENSOR, _FLOAT, _OPT_FLOAT, _INT, _OPT_INT, _STR, _PAIR, _MODULE = range(9)
_KINDS = {"Tensor": _TENSOR, "Optional[Tensor]": _OPT_TENSOR, "float": _FLOAT, "Optional[float]": _OPT_FLOAT,
          "float | None": _OPT_FLOAT, "int": _INT, "Optional[int]": _OPT_INT, "int | None": _OPT_INT,
          "str": _STR, "tuple[int, int]": _PAIR, "nn.Module": _MODULE}


def _int64(name: str, v: int) -> None:
    # torch.library's int is int64: a bigger Python int would be its RuntimeError
    if not -2**63 <= v < 2**63:
        raise ArgumentError(f"{name}: expected an int64 value, got {v}")


def _check(name: str, kind: int, v: Any) -> None:
    if v is None and kind in (_OPT_TENSOR, _OPT_FLOAT, _OPT_INT):
        return
    if kind in (_TENSOR, _OPT_TENSOR):
        if not isinstance(v, torch.Tensor):
            raise ArgumentTypeError(f"{name}: expected a torch.Tensor{' or None' if kind == _OPT_TENSOR else ''}, "
                                    f"got {type(v).__name__}")
        if v.is_meta:
            raise meta_tensor(name)
    elif kind in (_FLOAT, _OPT_FLOAT):
        if isinstance(v, bool) or not isinstance(v, numbers.Real) and not (
                isinstance(v, torch.Tensor) and v.dim() == 0 and v.is_floating_point()):
            raise ArgumentTypeError(f"{name}: expected a float, got {type(v).__name__} {v!r:.40}")
        if isinstance(v, numbers.Real) and math.isnan(v):
            raise ArgumentError(f"{name}: expected a number, got nan")
    elif kind in (_INT, _OPT_INT):
        if isinstance(v, bool) or not isinstance(v, numbers.Integral):
            raise ArgumentTypeError(f"{name}: expected an int, got {type(v).__name__} {v!r:.40}")
        _int64(name, int(v))
    elif kind == _STR:
        if not isinstance(v, str):
            raise ArgumentTypeError(f"{name}: expected a str, got {type(v).__name__} {v!r:.40}")
    elif kind == _PAIR:
        if not isinstance(v, (tuple, list)) or len(v) != 2 or not all(
                isinstance(x, int) and not isinstance(x, bool) for x in v):
            raise ArgumentTypeError(f"{name}: expected a pair of ints (left, right), got {v!r:.60}")
        for i, x in enumerate(v):
            _int64(f"{name}[{i}]", x)
    elif kind == _MODULE:
        if not isinstance(v, torch.nn.Module):
            raise ArgumentTypeError(f"{name}: expected a torch.nn.Module, got {type(v).__name__}")


def checked(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` with its annotated arguments checked first (Tensor, Optional[Tensor], float, int, str, pairs)."""
    params = list(inspect.signature(fn).parameters.values())
    plan = [(i, p.name, _KINDS[str(p.annotation)]) for i, p in enumerate(params)
            if str(p.annotation) in _KINDS]
    by_name = {name: kind for _, name, kind in plan}

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        for i, name, kind in plan:
            if i < len(args):
                _check(name, kind, args[i])
        for name, v in kwargs.items():
            kind = by_name.get(name)
            if kind is not None:
                _check(name, kind, v)
        return fn(*args, **kwargs)

    return wrapper
