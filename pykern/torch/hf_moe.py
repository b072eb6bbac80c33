"""The mixture-of-experts families of `apply(model)`: Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE.

What this module adds to hf.py's patches (attention, RMSNorm, dense SwiGLU MLPs, RoPE, loss), all
through transformers' extension points, with no modeling code copied:
- experts: a "pykern" entry in transformers' experts-implementation registry
  (`ALL_EXPERTS_FUNCTIONS`, the one `@use_experts_implementation` dispatches through), selected
  with `model.set_experts_implementation`. It receives the routed (top_k_index, top_k_weights)
  and runs pykern.torch.moe_experts. Layouts it does not cover (biases, transposed or interleaved
  weights, no gate, a custom gate, post-expert norms, expert parallelism, activations other
  than SiLU / tanh-GELU, dtypes other than float32 / bfloat16 / float16) go to transformers'
  "grouped_mm".
- router: each TopKRouter changes class in place to a subclass whose forward computes the same
  logits (F.linear) and routes with pykern.torch.moe_route: fp32 softmax over all experts, top-k,
  renormalised as the family does (Mixtral always; the others by `config.norm_topk_prob`), the
  weights cast back to the logits' dtype where the family does. The instance keeps its Parameter
  and hooks and stays an instance of the family's router, so transformers' router-logits
  recorder (output_router_logits) and the load-balancing loss see the logits it computes.
- training with labels under the fused linear cross-entropy: the loss comes from the last hidden
  states, plus the family's own `load_balancing_loss_func` times `router_aux_loss_coef` when
  router logits are requested, as the family's forward adds it.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from . import moe as _moe
from ..log import log

__all__ = ["FAMILIES", "patch", "flce_forward"]

_EXPERTS_NAME = "pykern"
# config.hidden_act -> pykern.ops.moe_experts activation (exact equivalents only)
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_ROUTE_MAX_K, _ROUTE_MAX_EXPERTS = 32, 3072  # pykern.ops.moe_route's limits


@dataclass(frozen=True)
class Family:
    prefix: str  # class-name prefix in the modeling module
    renormalize: Callable[[nn.Module], bool]  # router -> whether the k weights are divided by their sum
    cast_weights: bool  # whether the router casts its weights back to the logits' dtype


# modeling-module name -> how its router routes (read from each model's TopKRouter.forward)
FAMILIES = {
    "mixtral": Family("Mixtral", lambda r: True, cast_weights=False),
    "qwen2_moe": Family("Qwen2Moe", lambda r: bool(r.norm_topk_prob), cast_weights=True),
    "qwen3_moe": Family("Qwen3Moe", lambda r: bool(r.norm_topk_prob), cast_weights=True),
    "olmoe": Family("Olmoe", lambda r: bool(r.norm_topk_prob), cast_weights=True),
}


# --------------------------------------------------------------------------- experts


_FELL_BACK: set[str] = set()  # experts classes whose fallback to grouped_mm has been logged


def _experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                     top_k_weights: torch.Tensor) -> torch.Tensor:
    """ALL_EXPERTS_FUNCTIONS["pykern"]: the experts of one layer on pykern's grouped GEMMs."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, _default_apply_gate

    act = _ACTIVATIONS.get(getattr(getattr(self, "config", None), "hidden_act", None))
    covered = (
        act is not None
        and getattr(self, "has_gate", False)
        and not getattr(self, "has_bias", True)
        and not getattr(self, "is_transposed", True)
        and getattr(self, "is_concatenated", False)
        and not getattr(self, "has_post_expert_norm", True)
        and not getattr(self, "_is_expert_parallel", True)
        and getattr(type(self), "_apply_gate", None) is _default_apply_gate
        and hidden_states.dim() == 2
        and hidden_states.dtype in _DTYPES
        and self.gate_up_proj.dtype == hidden_states.dtype == self.down_proj.dtype
        and top_k_weights.is_floating_point()
    )
    if not covered:
        name = type(self).__name__
        if name not in _FELL_BACK:  # said once a class: the patch is not in effect there
            _FELL_BACK.add(name)
            log.info("%s: a layout, dtype or activation pykern's experts do not cover; transformers' grouped_mm "
                     "runs its experts", name)
        return ALL_EXPERTS_FUNCTIONS["grouped_mm"](self, hidden_states, top_k_index, top_k_weights)
    return _moe.moe_experts(hidden_states, self.gate_up_proj, self.down_proj, top_k_index, top_k_weights, act)


def _register_experts() -> None:
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register(_EXPERTS_NAME, _experts_forward)


# --------------------------------------------------------------------------- router


def _router_forward(self: nn.Module, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(router_logits, top-k weights, top-k expert ids), as the family's router returns them."""
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    logits = nn.functional.linear(hidden_states, self.weight)
    if (logits.dtype not in _DTYPES or not 1 <= self.top_k <= min(_ROUTE_MAX_K, logits.shape[-1])
            or logits.shape[-1] > _ROUTE_MAX_EXPERTS):
        return super(type(self), self).forward(hidden_states)  # the family's own routing
    weights, ids = _moe.moe_route(logits, self.top_k, self._pykern_family.renormalize(self), "softmax")
    if self._pykern_family.cast_weights:
        weights = weights.to(logits.dtype)
    return logits, weights, ids.long()  # int64 ids, as torch.topk gives them


def _router_class(cls: type, family: Family) -> type:
    """The pykern subclass of a family's router class (made once, reachable by name for pickle)."""
    name = f"Pykern{cls.__name__}"
    mod = sys.modules[__name__]
    sub = getattr(mod, name, None)
    if sub is None or sub.__bases__ != (cls,):
        sub = type(name, (cls,), {"forward": _router_forward, "_pykern_family": family, "__module__": __name__,
                                  "__doc__": f"{cls.__name__} routing with pykern.torch.moe_route."})
        setattr(mod, name, sub)
    return sub


# --------------------------------------------------------------------------- apply


def patch(model: nn.Module, modeling: Any, family: str, *, experts: bool = True, router: bool = True) -> None:
    """Select the pykern experts implementation and swap the routers of a model of one MoE family."""
    fam = FAMILIES[family]
    if router:
        router_cls = getattr(modeling, f"{fam.prefix}TopKRouter")
        sub = _router_class(router_cls, fam)
        for m in model.modules():
            if type(m) is router_cls:
                m.__class__ = sub
    if experts:
        _register_experts()
        model.set_experts_implementation(_EXPERTS_NAME)
        if model.config._experts_implementation != _EXPERTS_NAME:
            raise RuntimeError(f"pykern.torch.apply: {type(model).__name__} refused experts_implementation='pykern'")


def flce_forward(modeling: Any) -> Callable:
    """The MoE causal LM's forward, except in training with labels: the loss comes from the fused
    linear cross-entropy on the last hidden states (logits=None) plus, when router logits are
    requested, the family's load-balancing loss as its own forward adds it."""
    aux_loss_fn = modeling.load_balancing_loss_func

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, labels=None, use_cache=None, output_router_logits=None, logits_to_keep=0,
                **kwargs):
        if labels is None or not self.training:
            return type(self).forward(self, input_ids=input_ids, attention_mask=attention_mask,
                                      position_ids=position_ids, past_key_values=past_key_values,
                                      inputs_embeds=inputs_embeds, labels=labels, use_cache=use_cache,
                                      output_router_logits=output_router_logits, logits_to_keep=logits_to_keep,
                                      **kwargs)
        from transformers.modeling_outputs import MoeCausalLMOutputWithPast

        from .hf import _flce_loss

        if output_router_logits is None:
            output_router_logits = self.config.output_router_logits
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache,
                             output_router_logits=output_router_logits, **kwargs)
        loss = _flce_loss(outputs.last_hidden_state, self.lm_head, labels,
                          num_items_in_batch=kwargs.get("num_items_in_batch"),
                          ignore_index=kwargs.get("ignore_index", -100), shift_labels=kwargs.get("shift_labels"))
        aux_loss = None
        if output_router_logits:
            aux_loss = aux_loss_fn(outputs.router_logits, self.num_experts, self.num_experts_per_tok, attention_mask)
            loss = loss + self.router_aux_loss_coef * aux_loss.to(loss.device)
        return MoeCausalLMOutputWithPast(loss=loss, aux_loss=aux_loss, logits=None,
                                         past_key_values=outputs.past_key_values, hidden_states=outputs.hidden_states,
                                         attentions=outputs.attentions, router_logits=outputs.router_logits)

    return forward
