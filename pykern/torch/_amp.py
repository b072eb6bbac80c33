"""torch.autocast for the pykern.torch functions: each behaves as its torch counterpart does under
autocast, because a custom op is not on any of torch's autocast lists (it would run on whatever
dtypes it is handed, with autocast still on inside it).

The policies, from torch's own lists (aten ops with an AutocastCPU / AutocastCUDA kernel):
- lower precision (linear, scaled_dot_product_attention): flash_attention and the matmul of
  fused_linear_cross_entropy cast their floating inputs to the autocast dtype;
- float32 (cross_entropy on CPU and CUDA; layer_norm on CUDA, and rms_norm on CUDA where the installed torch
  lists it: torch 2.11 did not, 2.13 does; `fp32_listed` asks the dispatcher): the loss is float32, those
  norms compute and return float32;
- none (silu, gelu, mul, embedding; the norms on CPU): the inputs' dtypes, with torch's type
  promotion for elementwise ops and the input's dtype for the CPU norms (mixed with a float32
  weight they compute in float32, as torch does).

The kernels take float32, bfloat16 and float16 (fp32 accumulation inside), attention too
(ATTENTION_DTYPES). Where the policy gives a dtype an op's kernels lack, the
inputs are rounded to it exactly where torch rounds them, the kernel runs in float32 on those
values, and the outputs are cast back: torch's results up to float32-vs-16-bit arithmetic inside.
"""
from __future__ import annotations

from contextlib import nullcontext
from functools import lru_cache
from typing import Any, Callable, Optional, Sequence, Union

import torch
from torch import Tensor

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ATTENTION_DTYPES = KERNEL_DTYPES  # flash_attention / attention_backward: f32, bf16, f16 (tensor cores for 16-bit)
_AUTOCAST_DEVICES = ("cpu", "cuda")


# One C query for "is any autocast on": every eager call asks, and t.device builds an object.
_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", None)


def autocast_dtype(t: Tensor) -> Optional[torch.dtype]:
    """The autocast dtype active for t's device type, or None when autocast is off there."""
    if _any_autocast is not None and not _any_autocast():
        return None
    dev = t.device.type
    if dev in _AUTOCAST_DEVICES and torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return None


def disabled(t: Any) -> Any:
    """A context with autocast off for t's device type (the kernels dictate precision inside an op); a null
    context when it is off already (entering torch.autocast costs a few microseconds a call)."""
    dev = t.device.type if isinstance(t, Tensor) else "cpu"
    dev = dev if dev in _AUTOCAST_DEVICES else "cpu"
    if not torch.is_autocast_enabled(dev):
        return nullcontext()
    return torch.autocast(dev, enabled=False)


def _floating(a: Any) -> bool:
    return isinstance(a, Tensor) and a.is_floating_point()


def promoted(*ts: Any) -> torch.dtype:
    """torch's result dtype of an elementwise op over the floating tensors ts."""
    out = None
    for t in ts:
        if _floating(t):
            out = t.dtype if out is None else torch.promote_types(out, t.dtype)
    return out if out is not None else torch.float32


def run(fn: Callable[..., Any], args: Sequence[Any], cast_to: torch.dtype,
        out_dtypes: Union[torch.dtype, Sequence[Optional[torch.dtype]]], *, cast: Sequence[bool] = (),
        kernel_dtypes: Sequence[torch.dtype] = KERNEL_DTYPES) -> Any:
    """fn(*args) with the floating tensor args (those marked in `cast`, default all) cast to `cast_to`
    (rounded there first, then widened to float32 when the kernels lack `cast_to`), autocast off
    inside, and the floating outputs cast to `out_dtypes` (one per output; None keeps it)."""
    compute = cast_to if cast_to in kernel_dtypes else torch.float32
    flags = list(cast) or [True] * len(args)

    def conv(a: Any, on: bool) -> Any:
        if not (on and _floating(a)) or a.dtype == compute:
            return a
        return a.to(cast_to).to(compute)

    call_args = [conv(a, on) for a, on in zip(args, flags)]
    first = next((a for a in args if isinstance(a, Tensor)), None)
    with disabled(first):
        out = fn(*call_args)
    outs = out if isinstance(out, tuple) else (out,)
    dts = [out_dtypes] * len(outs) if isinstance(out_dtypes, torch.dtype) else list(out_dtypes)
    res = tuple(o.to(d) if (d is not None and _floating(o) and o.dtype != d) else o for o, d in zip(outs, dts))
    return res if isinstance(out, tuple) else res[0]


def plain(*ts: Any) -> bool:
    """Whether the floating tensors ts share one dtype the kernels take (nothing to cast)."""
    dts = {t.dtype for t in ts if _floating(t)}
    return len(dts) <= 1 and dts <= set(KERNEL_DTYPES)


@lru_cache(maxsize=None)
def fp32_listed(op: str, device_type: str) -> bool:
    """Whether this torch's autocast runs aten::op in float32 on device_type: it registered an Autocast<Device>
    kernel for it (the norms are only ever on the float32 lists). Asked of the dispatcher, not hard-coded,
    because the lists change between releases (rms_norm joined CUDA's after torch 2.11)."""
    key = {"cuda": "AutocastCUDA", "cpu": "AutocastCPU"}.get(device_type)
    if key is None:
        return False
    try:
        return bool(torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{op}", key))
    except Exception:  # noqa: BLE001 - a torch without this private query: the lists as of torch 2.13
        return device_type == "cuda" and op in ("layer_norm", "rms_norm")


def norm(fn: Callable[..., Any], x: Tensor, args: Sequence[Any], amp: torch.dtype,
         out_dtypes: Optional[Sequence[torch.dtype]] = None, op: str = "layer_norm") -> Any:
    """A norm under autocast: float32 where torch's autocast lists aten::op for x's device (fp32_listed);
    elsewhere x's dtype, computed in float32 when the dtypes are mixed or not a kernel dtype (torch's
    mixed-dtype norms compute in float32 and return the input's dtype)."""
    if fp32_listed(op, x.device.type):
        return run(fn, args, torch.float32, out_dtypes or torch.float32)
    if plain(*args):
        with disabled(x):
            return fn(*args)
    return run(fn, args, torch.float32, out_dtypes or x.dtype)


def elementwise(fn: Callable[..., Any], args: Sequence[Any],
                out_dtypes: Optional[Sequence[torch.dtype]] = None) -> Any:
    """An elementwise op under autocast (no autocast entry in torch): type promotion."""
    d = promoted(*args)
    if plain(*args):
        with disabled(next(a for a in args if isinstance(a, Tensor))):
            return fn(*args)
    return run(fn, args, d, out_dtypes or d)
