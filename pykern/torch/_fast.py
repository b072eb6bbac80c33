"""Eager calls of pykern's custom ops without torch.library's per-call machinery.

A `torch.library.custom_op` call in eager mode goes through the dispatcher, torch.library's autograd wrapper
(a generated autograd.Function, fill_defaults, a redispatch below autograd) and a dynamo-disable frame before it
reaches the Python implementation: about 10 us a call without autograd and 20 us with it on a 2-core EPYC,
more than the rest of a norm's host path. `Op` calls the same implementation directly (no input needs a
gradient), or through a plain autograd.Function built from the same setup_context / backward formulas
(one does) — what the custom op would run, minus the wrapping.

It does so only when nothing else has to see the op: outside torch.compile / export tracing, with no torch
dispatch or function mode active (FakeTensorMode, make_fx's proxy mode, FlopCounterMode,
`torch.set_default_device`), no functorch transform (vmap, grad), the profiler off (its traces name the
custom op) and every tensor argument a plain `torch.Tensor` or `nn.Parameter` (a subclass may override
dispatch). Everything else takes `torch.ops.pykern.<name>` as before, so torch.compile(fullgraph=True), fake
tensors and `torch.library.opcheck` see the custom ops unchanged. A backward formula calls its backward op
through `Op` too: with create_graph=True (grad mode on in the backward) and an input that requires grad the
custom op runs, whose missing autograd formula raises as before instead of a silently detached gradient.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import Tensor
from torch.nn import Parameter

_C = torch._C
_grad_enabled = _C.is_grad_enabled
_any_requires_grad = _C._any_requires_grad
_dispatch_modes = _C._len_torch_dispatch_stack
_function_modes = _C._is_torch_function_mode_enabled
_functorch_level = _C._functorch.peek_interpreter_stack
_profiling = _C._autograd._profiler_enabled
_compiling = torch.compiler.is_compiling

# Set to False to send every call through torch.ops.pykern (tests compare both paths).
enabled = True


def eager(args: tuple) -> bool:
    """Whether the direct call is what the custom op would do for these arguments (see the module docstring)."""
    # is_compiling first: dynamo folds it to True while tracing and must not reach the C queries after it
    if _compiling() or not enabled or _dispatch_modes() or _function_modes() or _functorch_level() is not None \
            or _profiling():
        return False
    for a in args:
        t = type(a)
        if t is not Tensor and t is not Parameter and isinstance(a, Tensor):
            return False
    return True


class Op:
    """`torch.ops.pykern.<name>` with the eager shortcut; `impl` is the custom op's own implementation."""

    __slots__ = ("name", "impl", "op", "fn")

    def __init__(self, name: str, impl: Callable[..., Any]) -> None:
        self.name = name
        self.impl = impl
        self.op = getattr(torch.ops.pykern, name).default
        self.fn: Optional[type] = None

    def autograd(self, backward: Callable[..., Any], setup_context: Callable[..., Any]) -> None:
        """The autograd.Function of the eager path: the formulas given to the custom op's register_autograd."""
        self.fn = type(f"pykern_{self.name}", (torch.autograd.Function,), {
            "forward": staticmethod(self.impl),
            "setup_context": staticmethod(lambda ctx, inputs, output: setup_context(ctx, inputs, output)),
            "backward": staticmethod(backward),
        })

    def __call__(self, *args: Any) -> Any:
        """The op on positional arguments (every argument of its schema, defaults included)."""
        if eager(args):
            if not (_grad_enabled() and _any_requires_grad(*args)):
                return self.impl(*args)
            if self.fn is not None:
                return self.fn.apply(*args)
        return self.op(*args)


def custom_op(name: str, *, autograd: bool = False) -> Callable[[Callable[..., Any]], Any]:
    """`torch.library.custom_op("pykern::" + name, mutates_args=())` that also returns the eager `Op`:
    `_x = custom_op("x")(impl)` gives the CustomOpDef as `_x` and the Op as `_x.fast`."""

    def deco(impl: Callable[..., Any]) -> Any:
        op_def = torch.library.custom_op("pykern::" + name, mutates_args=())(impl)
        op_def.fast = Op(name, impl)
        return op_def

    return deco


def register_autograd(op_def: Any, backward: Callable[..., Any], setup_context: Callable[..., Any]) -> None:
    """op_def.register_autograd(backward, setup_context=) for the custom op, and the same formulas for its
    eager path."""
    op_def.register_autograd(backward, setup_context=setup_context)
    op_def.fast.autograd(backward, setup_context)
