"""Autograd-aware pykern training ops (norm_act_loss.cu) for PyTorch: fused residual RMSNorm, LayerNorm,
GELU / GeGLU and the fused linear cross-entropy.

Like pykern.torch.functional: each op is a `torch.library.custom_op` in the
`pykern` namespace with a fake implementation and a registered autograd formula
whose backward is a pykern custom op too (torch.compile traces them whole).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..errors import ArgumentError
from . import _amp, _dtensor as _dt, _fast
from ._bridge import call
from ._checks import checked

__all__ = ["add_rms_norm", "layer_norm", "gelu", "gelu_gate", "fused_linear_cross_entropy"]


def _new(shape, dtype, like: Tensor) -> Tensor:
    return torch.empty(tuple(shape), dtype=dtype, device=like.device)


def _c(t: Tensor) -> Tensor:
    return t if t.is_contiguous() else t.contiguous()


# --------------------------------------------------------------------------- add_rms_norm


@_fast.custom_op("add_rms_norm")
def _add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float,
                  offset: float = 0.0) -> tuple[Tensor, Tensor]:
    y, h = call("add_rms_norm", _c(x), _c(residual), _c(weight), eps, offset=offset)
    return y, h


@_add_rms_norm.register_fake
def _(x, residual, weight, eps, offset=0.0):
    return _new(x.shape, x.dtype, x), _new(x.shape, x.dtype, x)


@_fast.custom_op("add_rms_norm_backward")
def _add_rms_norm_backward(h: Tensor, weight: Tensor, grad_y: Tensor, grad_h: Optional[Tensor],
                           eps: float, offset: float = 0.0) -> tuple[Tensor, Tensor]:
    gh, gw = call("add_rms_norm_backward", _c(h), _c(weight), _c(grad_y), None if grad_h is None else _c(grad_h), eps,
                  offset=offset)
    return gh, gw.to(weight.dtype)


@_add_rms_norm_backward.register_fake
def _(h, weight, grad_y, grad_h, eps, offset=0.0):
    return _new(h.shape, h.dtype, h), _new(weight.shape, weight.dtype, weight)


def _arn_setup(ctx, inputs, output):
    ctx.save_for_backward(output[1], inputs[2])
    ctx.eps, ctx.offset = inputs[3], inputs[4]


def _arn_bwd(ctx, grad_y, grad_h):
    h, weight = ctx.saved_tensors
    if grad_y is None:
        grad_y = torch.zeros_like(h)
    gh, gw = _add_rms_norm_backward.fast(h, weight, grad_y, grad_h, ctx.eps, ctx.offset)
    return gh, gh, gw, None, None  # x and residual share the one gradient path


_fast.register_autograd(_add_rms_norm, _arn_bwd, _arn_setup)


@checked
def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float = 1e-6,
                 offset: float = 0.0) -> tuple[Tensor, Tensor]:
    """(rms_norm(x + residual) * (offset + weight), x + residual) in one pass (x, residual, weight of one
    dtype; offset=1.0 is Gemma's (1 + weight))."""
    if _dt.active(x, residual, weight):
        return _dt.run("add_rms_norm", lambda x, r, w: add_rms_norm(x, r, w, eps, offset), (x, residual, weight),
                       ("data", "data", "param"), local_ok=_dt.rows_only(x.dim()))
    amp = _amp.autocast_dtype(x)
    if amp is not None:  # torch: h = x + residual (promotion), then the norm's policy on h
        hd = _amp.promoted(x, residual)
        return _amp.norm(lambda x, r, w: add_rms_norm(x, r, w, eps, offset), x, (x, residual, weight), amp,
                         out_dtypes=(torch.float32 if _amp.fp32_listed("rms_norm", x.device.type) else hd, hd),
                         op="rms_norm")
    return _add_rms_norm.fast(x, residual, weight, float(eps), float(offset))


# --------------------------------------------------------------------------- layer_norm


@_fast.custom_op("layer_norm")
def _layer_norm(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float) -> Tensor:
    return call("layer_norm", _c(x), None if weight is None else _c(weight), None if bias is None else _c(bias), eps)


@_layer_norm.register_fake
def _(x, weight, bias, eps):
    return _new(x.shape, x.dtype, x)


@_fast.custom_op("layer_norm_backward")
def _layer_norm_backward(x: Tensor, weight: Optional[Tensor], grad_out: Tensor, eps: float,
                         has_bias: bool) -> tuple[Tensor, Tensor, Tensor]:
    gx, gw, gb = call("layer_norm_backward", _c(x), None if weight is None else _c(weight), _c(grad_out), eps,
                      bias=has_bias)
    # custom ops return tensors only: an absent gradient is an empty placeholder (dropped by the caller)
    return (gx, (x.new_empty((0,)) if gw is None else gw.to(weight.dtype)),
            (x.new_empty((0,)) if gb is None else gb.to(x.dtype)))


@_layer_norm_backward.register_fake
def _(x, weight, grad_out, eps, has_bias):
    dim = x.shape[-1]
    return (_new(x.shape, x.dtype, x), _new((dim,) if weight is not None else (0,), x.dtype, x),
            _new((dim,) if has_bias else (0,), x.dtype, x))


def _ln_setup(ctx, inputs, output):
    x, weight, bias, eps = inputs
    ctx.save_for_backward(x, weight)
    ctx.eps, ctx.has_w, ctx.has_b = eps, weight is not None, bias is not None


def _ln_bwd(ctx, grad):
    x, weight = ctx.saved_tensors
    gx, gw, gb = _layer_norm_backward.fast(x, weight if ctx.has_w else None, grad, ctx.eps, ctx.has_b)
    return gx, (gw.to(weight.dtype) if ctx.has_w else None), (gb if ctx.has_b else None), None


_fast.register_autograd(_layer_norm, _ln_bwd, _ln_setup)


@checked
def layer_norm(x: Tensor, weight: Optional[Tensor] = None, bias: Optional[Tensor] = None,
               eps: float = 1e-5) -> Tensor:
    """torch.nn.functional.layer_norm over the last axis (weight / bias (dim,) of x's dtype, or None)."""
    if _dt.active(x, weight, bias):
        return _dt.run("layer_norm", lambda x, w, b: layer_norm(x, w, b, eps), (x, weight, bias),
                       ("data", "param", "param"), local_ok=_dt.rows_only(x.dim()))
    amp = _amp.autocast_dtype(x)
    if amp is not None:
        return _amp.norm(lambda x, w, b: layer_norm(x, w, b, eps), x, (x, weight, bias), amp)
    return _layer_norm.fast(x, weight, bias, float(eps))


# --------------------------------------------------------------------------- gelu / gelu_gate


@_fast.custom_op("gelu")
def _gelu(x: Tensor, approximate: str) -> Tensor:
    return call("gelu", _c(x), approximate)


@_gelu.register_fake
def _(x, approximate):
    return _new(x.shape, x.dtype, x)


@_fast.custom_op("gelu_backward")
def _gelu_backward(x: Tensor, grad_out: Tensor, approximate: str) -> Tensor:
    return call("gelu_backward", _c(x), _c(grad_out), approximate)


@_gelu_backward.register_fake
def _(x, grad_out, approximate):
    return _new(x.shape, x.dtype, x)


def _gelu_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])
    ctx.approximate = inputs[1]


def _gelu_bwd(ctx, grad):
    (x,) = ctx.saved_tensors
    return _gelu_backward.fast(x, grad, ctx.approximate), None


_fast.register_autograd(_gelu, _gelu_bwd, _gelu_setup)


@checked
def gelu(x: Tensor, approximate: str = "none") -> Tensor:
    """torch.nn.functional.gelu(x, approximate=) ("none": erf, "tanh")."""
    if _dt.active(x):
        return _dt.run("gelu", lambda x: gelu(x, approximate), (x,), ("data",), local_ok=_dt.anything)
    if _amp.autocast_dtype(x) is not None:
        return _amp.elementwise(lambda x: gelu(x, approximate), (x,))
    return _gelu.fast(x, approximate)


@_fast.custom_op("gelu_gate")
def _gelu_gate(gate: Tensor, up: Tensor, approximate: str) -> Tensor:
    return call("gelu_gate", _c(gate), _c(up), approximate)


@_gelu_gate.register_fake
def _(gate, up, approximate):
    return _new(gate.shape, gate.dtype, gate)


@_fast.custom_op("gelu_gate_backward")
def _gelu_gate_backward(gate: Tensor, up: Tensor, grad_out: Tensor, approximate: str) -> tuple[Tensor, Tensor]:
    gg, gu = call("gelu_gate_backward", _c(gate), _c(up), _c(grad_out), approximate)
    return gg, gu


@_gelu_gate_backward.register_fake
def _(gate, up, grad_out, approximate):
    return _new(gate.shape, gate.dtype, gate), _new(up.shape, up.dtype, up)


def _gg_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], inputs[1])
    ctx.approximate = inputs[2]


def _gg_bwd(ctx, grad):
    gate, up = ctx.saved_tensors
    gg, gu = _gelu_gate_backward.fast(gate, up, grad, ctx.approximate)
    return gg, gu, None


_fast.register_autograd(_gelu_gate, _gg_bwd, _gg_setup)


@checked
def gelu_gate(gate: Tensor, up: Tensor, approximate: str = "none") -> Tensor:
    """GeGLU: gelu(gate, approximate=) * up elementwise."""
    if _dt.active(gate, up):
        return _dt.run("gelu_gate", lambda g, u: gelu_gate(g, u, approximate), (gate, up), ("data", "data"),
                       local_ok=_dt.anything)
    if _amp.autocast_dtype(gate) is not None:
        return _amp.elementwise(lambda g, u: gelu_gate(g, u, approximate), (gate, up))
    return _gelu_gate.fast(gate, up, approximate)


# --------------------------------------------------------------------------- fused linear cross-entropy


@_fast.custom_op("fused_linear_cross_entropy")
def _flce(hidden: Tensor, weight: Tensor, targets: Tensor, bias: Optional[Tensor], ignore_index: int,
          label_smoothing: float, z_loss: float, softcap: float, reduction: str,
          chunk_size: int, ce_weight: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    # (loss, grad_hidden, grad_weight, grad_bias, z_loss part). "none": the gradients depend on the
    # per-row upstream gradients, known only in the backward (fused_linear_cross_entropy_backward):
    # empty placeholders here
    loss, gh, gw, gb, zl = call("fused_linear_cross_entropy", _c(hidden), _c(weight), _c(targets),
                                None if bias is None else _c(bias), ignore_index=ignore_index,
                                label_smoothing=label_smoothing, z_loss=z_loss,
                                softcap=softcap if softcap > 0 else None, reduction=reduction,
                                chunk_size=chunk_size if chunk_size > 0 else None, ce_weight=ce_weight,
                                return_z_loss=True)
    if reduction == "mean":  # torch: NaN for a batch with no valid row (0 / 0); the op returns 0
        live = targets != ignore_index
        if ce_weight is None:
            den = live.sum()
        else:
            den = torch.where(live, ce_weight.float()[targets.clamp(0, weight.shape[0] - 1)], 0.0).sum()
        loss = torch.where(den != 0, loss, torch.full_like(loss, float("nan")))
    empty = hidden.new_empty((0,), dtype=torch.float32)
    if reduction == "none":
        return loss, empty, empty.clone(), empty.clone(), zl
    return loss, gh, gw, (empty if gb is None else gb), zl


@_flce.register_fake
def _(hidden, weight, targets, bias, ignore_index, label_smoothing, z_loss, softcap, reduction, chunk_size,
      ce_weight=None):
    # the gradients are the op's float32 accumulators, whatever the input dtype
    shape = tuple(targets.shape) if reduction == "none" else ()
    if reduction == "none":
        grads = tuple(_new((0,), torch.float32, hidden) for _ in range(3))
    else:
        grads = (_new(hidden.shape, torch.float32, hidden), _new(weight.shape, torch.float32, weight),
                 _new((0,) if bias is None else bias.shape, torch.float32, hidden))
    return (_new(shape, torch.float32, hidden), *grads, _new(shape, torch.float32, hidden))


@_fast.custom_op("fused_linear_cross_entropy_backward")
def _flce_backward(hidden: Tensor, weight: Tensor, targets: Tensor, bias: Optional[Tensor], grad_rows: Tensor,
                   ignore_index: int, label_smoothing: float, z_loss: float, softcap: float, chunk_size: int,
                   ce_weight: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    """The gradients of sum_r grad_rows[r] * loss_r (reduction "none"): the chunks run again with each
    row's gradient scaled in the cross-entropy kernel before the matmuls."""
    _, gh, gw, gb = call("fused_linear_cross_entropy", _c(hidden), _c(weight), _c(targets),
                         None if bias is None else _c(bias), ignore_index=ignore_index,
                         label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap if softcap > 0 else None,
                         reduction="none", chunk_size=chunk_size if chunk_size > 0 else None, ce_weight=ce_weight,
                         grad_output=_c(grad_rows))
    return gh, gw, (hidden.new_empty((0,), dtype=torch.float32) if gb is None else gb)


@_flce_backward.register_fake
def _(hidden, weight, targets, bias, grad_rows, ignore_index, label_smoothing, z_loss, softcap, chunk_size,
      ce_weight=None):
    return (_new(hidden.shape, torch.float32, hidden), _new(weight.shape, torch.float32, weight),
            _new((0,) if bias is None else bias.shape, torch.float32, hidden))


def _flce_setup(ctx, inputs, output):
    hidden, weight, targets, bias = inputs[:4]
    ctx.has_bias = bias is not None
    ctx.dtypes = (hidden.dtype, weight.dtype, bias.dtype if ctx.has_bias else None)
    ctx.reduction = inputs[8]
    ctx.opts = (inputs[4], inputs[5], inputs[6], inputs[7], inputs[9])
    if ctx.reduction == "none":  # the backward reruns the chunks with the per-row gradients
        ctx.save_for_backward(hidden, weight, targets, bias, inputs[10])
    else:
        ctx.save_for_backward(output[1], output[2], output[3])
    ctx.mark_non_differentiable(output[1], output[2], output[3], output[4])


def _scaled(g: Tensor, s: Tensor, dtype: torch.dtype) -> Tensor:
    """g * s (float32 math) in the input's dtype; out= writes the cast product in one pass (on CUDA no
    float32 temporary; torch's CPU kernels stage one)."""
    if dtype == g.dtype:
        return g * s
    return torch.mul(g, s, out=torch.empty_like(g, dtype=dtype))


def _flce_bwd(ctx, grad_loss, *_):
    # the z-loss output's gradient is dropped: it is for logging, its gradient is in the loss's (Liger)
    dh, dw, db = ctx.dtypes
    if ctx.reduction == "none":
        hidden, weight, targets, bias, ce_weight = ctx.saved_tensors
        gh, gw, gb = _flce_backward.fast(
            hidden, weight, targets, bias, grad_loss.to(torch.float32), *ctx.opts, ce_weight)
        one = grad_loss.new_ones((), dtype=torch.float32)
        return (_scaled(gh, one, dh), _scaled(gw, one, dw), None, _scaled(gb, one, db) if ctx.has_bias else None,
                None, None, None, None, None, None, None)
    gh, gw, gb = ctx.saved_tensors
    s = grad_loss.to(torch.float32)
    return (_scaled(gh, s, dh), _scaled(gw, s, dw), None, _scaled(gb, s, db) if ctx.has_bias else None,
            None, None, None, None, None, None, None)


_fast.register_autograd(_flce, _flce_bwd, _flce_setup)


@checked
def fused_linear_cross_entropy(hidden: Tensor, weight: Tensor, targets: Tensor, bias: Optional[Tensor] = None, *,
                               ignore_index: int = -100, label_smoothing: float = 0.0, z_loss: float = 0.0,
                               softcap: Optional[float] = None, reduction: str = "mean",
                               chunk_size: Optional[int] = None, ce_weight: Optional[Tensor] = None,
                               lse_square_scale: Optional[float] = None, return_z_loss: bool = False):
    """cross_entropy(hidden @ weight.T + bias, targets) without materialising the (N, vocab) logits.

    hidden (N, H), weight (V, H), bias (V,) or None; reduction "mean" or "sum"
    (a float32 scalar) or "none" (float32 per-row losses). The options are
    pykern.torch.cross_entropy's, under Liger-Kernel's names where they differ:
    ce_weight (class weights, torch's weighted mean), lse_square_scale (= z_loss),
    return_z_loss (returns (loss, z_loss), the z-loss part for logging), softcap
    (Gemma 2's final-logit softcap, applied to hidden @ weight.T + bias). For "mean" / "sum" the forward
    computes the loss and the gradients chunk by chunk (pykern.ops.fused_linear_cross_entropy) and
    keeps the gradients; the backward only scales them by the incoming gradient. For "none" the
    backward receives one upstream gradient per row, and since the weight's gradient mixes rows it
    runs the chunks again with each row's logit gradient scaled by its upstream gradient before the
    matmuls (so "none" costs a second pass). "mean" of a batch with every row ignored is NaN, as in torch.

    The gradients returned to autograd have the inputs' dtype. For bf16 the op
    keeps its float32 accumulators from the forward to the backward ((N*H + V*H)
    * 4 bytes, twice bf16 gradients; the backward runs right after this last op of
    the forward) and the backward writes the scaled bf16 gradients from them in one
    pass, so the bf16 gradients are rounded once, after the scale.
    """
    from ..ops.training import ce_z_loss

    z_loss = ce_z_loss(z_loss, lse_square_scale)
    if reduction not in ("mean", "sum", "none"):
        raise ArgumentError(f"reduction: expected 'mean', 'sum' or 'none', got {reduction!r}")
    if ce_weight is not None and (not isinstance(ce_weight, Tensor) or tuple(ce_weight.shape) != (weight.shape[0],)):
        raise ArgumentError(f"ce_weight: expected class weights of shape ({weight.shape[0]},), got "
                            f"{tuple(ce_weight.shape) if isinstance(ce_weight, Tensor) else ce_weight!r}")
    if _dt.active(hidden, weight, targets, bias):  # needs every row and the whole vocabulary: gathered
        def fn(h, w, t, b):
            return fused_linear_cross_entropy(h, w, t, b, ignore_index=ignore_index, label_smoothing=label_smoothing,
                                              z_loss=z_loss, softcap=softcap, reduction=reduction,
                                              chunk_size=chunk_size, ce_weight=ce_weight,
                                              return_z_loss=return_z_loss)
        return _dt.run("fused_linear_cross_entropy", fn, (hidden, weight, targets, bias),
                       ("data", "param", "data", "param"), local_ok=_dt.never)
    amp = _amp.autocast_dtype(hidden)
    if amp is not None:
        # torch: linear on the lower-precision list (hidden, weight, bias in the autocast dtype), then
        # cross_entropy on the float32 list: the loss is float32, the gradients come back in the
        # inputs' dtypes through the casts
        def fn(h, w, b):
            return fused_linear_cross_entropy(h, w, targets, b, ignore_index=ignore_index,
                                              label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap,
                                              reduction=reduction, chunk_size=chunk_size, ce_weight=ce_weight,
                                              return_z_loss=return_z_loss)
        return _amp.run(fn, (hidden, weight, bias), amp, torch.float32)
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ArgumentError(f"chunk_size: expected an integer >= 1 or None, got {chunk_size!r}")
    loss, _, _, _, zl = _flce.fast(
        hidden, weight, targets, bias, int(ignore_index), float(label_smoothing), float(z_loss),
        0.0 if softcap is None else float(softcap), reduction, 0 if chunk_size is None else int(chunk_size),
        None if ce_weight is None else ce_weight.detach())
    return (loss, zl) if return_z_loss else loss
