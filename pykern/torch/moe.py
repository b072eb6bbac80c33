"""Mixture-of-experts custom ops for PyTorch: `moe_route` and `moe_experts`.

Both are `torch.library.custom_op`s in the `pykern` namespace with fake implementations and
registered autograd, so `torch.compile(fullgraph=True)` traces them. moe_experts' backward is the
pykern custom op `moe_experts_backward` (grouped GEMMs, no atomics); moe_route's backward (to the
router logits through the selected weights) is a few torch ops on [T, E].
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ._bridge import call
from ._checks import checked

__all__ = ["moe_route", "moe_experts"]

_lib = "pykern::"


def _c(t: Tensor) -> Tensor:
    return t if t.is_contiguous() else t.contiguous()


# --------------------------------------------------------------------------- routing


@torch.library.custom_op(_lib + "moe_route", mutates_args=())
def _moe_route(logits: Tensor, top_k: int, renormalize: bool, scoring: str,
               bias: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    return call("moe_route", _c(logits), top_k, renormalize, scoring, None if bias is None else _c(bias))


@_moe_route.register_fake
def _(logits, top_k, renormalize, scoring, bias):
    shape = (logits.shape[0], top_k)
    return (torch.empty(shape, dtype=torch.float32, device=logits.device),
            torch.empty(shape, dtype=torch.int32, device=logits.device))


def _route_setup(ctx, inputs, output):
    logits, top_k, renormalize, scoring, bias = inputs
    ctx.save_for_backward(logits, output[1])
    ctx.renormalize, ctx.scoring = renormalize, scoring
    ctx.mark_non_differentiable(output[1])


def _route_bwd(ctx, grad_w, _grad_ids):
    logits, ids = ctx.saved_tensors
    x = logits.float()
    idx = ids.long()
    score = torch.softmax(x, -1) if ctx.scoring == "softmax" else torch.sigmoid(x)
    s = score.gather(-1, idx)  # the selected scores [T, k]
    g = grad_w.float()
    if ctx.renormalize:
        tot = s.sum(-1, keepdim=True) + (1e-20 if ctx.scoring == "sigmoid" else 0.0)
        g = g / tot - (g * s).sum(-1, keepdim=True) / (tot * tot)
    dscore = torch.zeros_like(x).scatter_add(-1, idx, g)
    if ctx.scoring == "softmax":
        dx = score * (dscore - (dscore * score).sum(-1, keepdim=True))
    else:
        dx = dscore * score * (1.0 - score)
    return dx.to(logits.dtype), None, None, None, None


_moe_route.register_autograd(_route_bwd, setup_context=_route_setup)


@checked
def moe_route(router_logits: Tensor, top_k: int, renormalize: bool = True, scoring: str = "softmax",
              bias: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """(topk_weights float32 [T, k], topk_ids int32 [T, k]); see pykern.ops.moe_route. Differentiable
    in the logits (through the selected weights)."""
    return torch.ops.pykern.moe_route(router_logits, top_k, bool(renormalize), scoring, bias)


# --------------------------------------------------------------------------- experts


@torch.library.custom_op(_lib + "moe_experts", mutates_args=())
def _moe_experts(x: Tensor, gate_up_proj: Tensor, down_proj: Tensor, topk_ids: Tensor, topk_weights: Tensor,
                 activation: str) -> Tensor:
    return call("moe_experts", _c(x), _c(gate_up_proj), _c(down_proj), _c(topk_ids), _c(topk_weights), activation)


@_moe_experts.register_fake
def _(x, gate_up_proj, down_proj, topk_ids, topk_weights, activation):
    return torch.empty(tuple(x.shape), dtype=x.dtype, device=x.device)


@torch.library.custom_op(_lib + "moe_experts_backward", mutates_args=())
def _moe_experts_backward(grad_out: Tensor, x: Tensor, gate_up_proj: Tensor, down_proj: Tensor, topk_ids: Tensor,
                          topk_weights: Tensor, activation: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    gx, ggu, gdn, gw = call("moe_experts_backward", _c(grad_out), _c(x), _c(gate_up_proj), _c(down_proj),
                            _c(topk_ids), _c(topk_weights), activation)
    return gx, ggu, gdn, gw.to(topk_weights.dtype)


@_moe_experts_backward.register_fake
def _(grad_out, x, gate_up_proj, down_proj, topk_ids, topk_weights, activation):
    e = lambda t, dt=None: torch.empty(tuple(t.shape), dtype=dt or t.dtype, device=t.device)  # noqa: E731
    return e(x), e(gate_up_proj), e(down_proj), e(topk_weights)


def _experts_setup(ctx, inputs, output):
    x, gate_up_proj, down_proj, topk_ids, topk_weights, activation = inputs
    ctx.save_for_backward(x, gate_up_proj, down_proj, topk_ids, topk_weights)
    ctx.activation = activation


def _experts_bwd(ctx, grad):
    x, gu, dn, ids, w = ctx.saved_tensors
    gx, ggu, gdn, gw = torch.ops.pykern.moe_experts_backward(_c(grad), x, gu, dn, ids, w, ctx.activation)
    return gx, ggu, gdn, None, gw, None


_moe_experts.register_autograd(_experts_bwd, setup_context=_experts_setup)


@checked
def moe_experts(x: Tensor, gate_up_proj: Tensor, down_proj: Tensor, topk_ids: Tensor, topk_weights: Tensor,
                activation: str = "silu") -> Tensor:
    """The experts block [T, H] (transformers' stacked layout); see pykern.ops.moe_experts. Gradients
    for x, gate_up_proj, down_proj and topk_weights."""
    return torch.ops.pykern.moe_experts(x, gate_up_proj, down_proj, topk_ids, topk_weights, activation)
