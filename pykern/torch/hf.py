"""`apply(model)`: run a Hugging Face LLaMA-family causal LM on pykern kernels, in place.

Uses transformers' own extension points rather than copies of its modeling code:
- attention: a "pykern" entry in `AttentionInterface` (plus a matching entry in
  `AttentionMaskInterface`), selected with `model.set_attn_implementation`;
- RMSNorm and MLP: module swaps that keep the same Parameter objects, so the
  state_dict keys, tied weights and optimizer state stay valid;
- rotary embedding: the modeling module's `apply_rotary_pos_emb` (the function
  its attention layers call) is wrapped once; the wrapper runs pykern's RoPE
  only inside the forward of an attention layer of a patched model (forward
  hooks), and HF's own function everywhere else;
- causal-LM loss: `model.loss_function` set to pykern's fused cross-entropy.

Attention runs on pykern when the mask is a plain bottom-right causal mask over
the whole cache (prefill, chunked prefill and KV-cached decode with a dynamic
cache, no padding); any other mask (padding, static-cache slots, packed
sequences, sliding windows shorter than the cache) is materialised and handed
to transformers' SDPA implementation, never approximated.
"""
from __future__ import annotations

import sys
import types
import threading
from typing import Any, Optional

import torch
from torch import nn

from ..errors import ArgumentTypeError
from . import _amp, functional as F
from .modules import RMSNorm, SwiGLUMLP

__all__ = ["apply", "SUPPORTED_MODELS"]

# class name -> modeling module (under transformers.models)
SUPPORTED_MODELS = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
_ATTN_NAME = "pykern"
_state = threading.local()  # depth of patched attention forwards on this thread


# --------------------------------------------------------------------------- attention


def _plain_causal(kw: dict[str, Any]) -> bool:
    """Whether the mask HF asks for is the bottom-right causal mask over the whole key range."""
    import transformers.masking_utils as mu

    if not kw.get("allow_is_causal_skip", True):
        return False  # overlays, packed sequences or block ids: HF itself needs the full mask
    q_len, kv_len = kw["q_length"], kw["kv_length"]
    q_off, kv_off = kw.get("q_offset", 0), kw.get("kv_offset", 0)
    if isinstance(q_off, torch.Tensor) or isinstance(kv_off, torch.Tensor):
        return False  # static caches: positions are device data
    if kv_off != 0 or q_off + q_len != kv_len:
        return False  # sliding-window caches, static-cache slots: not the plain layout
    pad = kw.get("attention_mask")
    if pad is not None:
        if mu.is_tracing(pad):
            return False
        pad = mu.prepare_padding_mask(pad, kv_len, kv_off)
        if not bool(mu.fast_all(pad)):
            return False  # padding
    fn = kw.get("mask_function", mu.causal_mask_function)
    if fn is not mu.causal_mask_function:
        # Sliding-window / chunked causal functions are monotone: the plain mask holds
        # iff the newest query cannot see a key after it and the farthest pair is visible.
        t = lambda i: torch.tensor(i)  # noqa: E731
        z = t(0)
        if q_len > 1 and bool(fn(z, z, t(q_off), t(q_off + 1))):
            return False
        if not bool(fn(z, z, t(kv_len - 1), t(0))) or not bool(fn(z, z, t(q_off), t(0))):
            return False
    return True


def _mask(**kw: Any) -> Optional[torch.Tensor]:
    """AttentionMaskInterface entry: None for a plain causal mask, else SDPA's full boolean mask."""
    import transformers.masking_utils as mu

    if _plain_causal(kw):
        return None
    kw = dict(kw, allow_is_causal_skip=False, allow_is_bidirectional_skip=False)
    return mu.sdpa_mask(**kw)


def _attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: Optional[torch.Tensor], dropout: float = 0.0, scaling: Optional[float] = None,
               **kwargs: Any) -> tuple[torch.Tensor, None]:
    """AttentionInterface entry. query (b, heads, n_q, d), key/value (b, kv_heads, n_k, d) -> (b, n_q, heads, d)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    is_causal = kwargs.get("is_causal", getattr(module, "is_causal", True))
    window = kwargs.get("sliding_window")
    supported = (
        attention_mask is None
        and is_causal
        and not (dropout and module.training)
        and kwargs.get("softcap") is None
        and not kwargs.get("output_attentions", False)
        and _attention_dtypes_ok(query, key, value)
        and max(query.shape[-1], value.shape[-1]) <= 256
    )
    if attention_mask is None and window is not None and key.shape[2] > window:
        raise RuntimeError(
            f"pykern attention: got no mask for {key.shape[2]} keys with sliding_window={window}; "
            "refusing to attend outside the window"
        )
    if not supported:
        if attention_mask is None and query.shape[2] > 1 and key.shape[2] != query.shape[2]:
            raise RuntimeError("pykern attention: a bottom-right causal fallback needs a mask; got None")
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    out = F.flash_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                            causal=True, scale=scaling)
    return out, None


def _attention_dtypes_ok(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """q, k, v of one kernel dtype; or any floating dtypes under autocast, which casts all three to
    its dtype as it does for scaled_dot_product_attention (see pykern.torch._amp)."""
    if _amp.autocast_dtype(query) is not None:
        return all(t.is_floating_point() for t in (query, key, value))
    return query.dtype in _amp.ATTENTION_DTYPES and key.dtype == query.dtype == value.dtype


def _register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(_ATTN_NAME, _attention)
    AttentionMaskInterface.register(_ATTN_NAME, _mask)


# --------------------------------------------------------------------------- rotary


def _rope_active() -> bool:
    return getattr(_state, "depth", 0) > 0


def _enter(module: nn.Module, args: Any) -> None:
    _state.depth = getattr(_state, "depth", 0) + 1


def _exit(module: nn.Module, args: Any, output: Any) -> None:
    _state.depth = max(0, getattr(_state, "depth", 0) - 1)


def _wrap_rotary(modeling: Any) -> None:
    """Install the dispatching apply_rotary_pos_emb in one modeling module (once)."""
    orig = modeling.apply_rotary_pos_emb
    if getattr(orig, "_pykern_original", None) is not None:
        return

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        if (
            _rope_active()
            and unsqueeze_dim == 1
            and q.dtype in _amp.KERNEL_DTYPES
            and k.dtype == q.dtype
            and q.dim() == 4
            and cos.dim() == 3
        ):
            # HF passes q/k as (b, heads, seq, d) views of (b, seq, heads, d) projections.
            oq, ok = F.rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
            return oq.transpose(1, 2), ok.transpose(1, 2)
        return orig(q, k, cos, sin, unsqueeze_dim)

    apply_rotary_pos_emb._pykern_original = orig
    apply_rotary_pos_emb.__doc__ = orig.__doc__
    modeling.apply_rotary_pos_emb = apply_rotary_pos_emb


# --------------------------------------------------------------------------- loss


def _causal_lm_loss(logits, labels, vocab_size: int, num_items_in_batch=None, ignore_index: int = -100,
                    shift_labels=None, **kwargs):
    """transformers' ForCausalLMLoss with pykern's fused cross-entropy (logits are not upcast: the kernel is fp32)."""
    if shift_labels is None:
        labels = nn.functional.pad(labels, (0, 1), value=ignore_index)
        shift_labels = labels[..., 1:].contiguous()
    logits = logits.reshape(-1, vocab_size)
    if logits.dtype not in _amp.KERNEL_DTYPES:
        logits = logits.float()
    shift_labels = shift_labels.reshape(-1).to(logits.device)
    if num_items_in_batch is None:
        return F.cross_entropy_f32(logits, shift_labels, ignore_index, "mean")
    loss = F.cross_entropy_f32(logits, shift_labels, ignore_index, "sum")
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    return loss / num_items_in_batch


def _flce_loss(hidden, lm_head, labels, num_items_in_batch=None, ignore_index: int = -100, shift_labels=None):
    """_causal_lm_loss on the last hidden states through the fused linear cross-entropy: the
    (tokens, vocab) logits are never materialised (row chunks, gradients computed in the forward)."""
    from .training import fused_linear_cross_entropy

    if shift_labels is None:
        labels = nn.functional.pad(labels, (0, 1), value=ignore_index)
        shift_labels = labels[..., 1:].contiguous()
    h = hidden.reshape(-1, hidden.shape[-1])
    shift_labels = shift_labels.reshape(-1).to(h.device)
    w, b = lm_head.weight, lm_head.bias
    if h.dtype != w.dtype:
        h = h.to(w.dtype)
    if num_items_in_batch is None:
        return fused_linear_cross_entropy(h, w, shift_labels, b, ignore_index=ignore_index, reduction="mean")
    loss = fused_linear_cross_entropy(h, w, shift_labels, b, ignore_index=ignore_index, reduction="sum")
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    return loss / num_items_in_batch


def _flce_forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                  inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0, **kwargs):
    """The causal LM's forward, except in training with labels: the loss comes from the fused linear
    cross-entropy on the last hidden states and `logits` is None (as Liger-Kernel's patched models)."""
    if labels is None or not self.training:
        return type(self).forward(self, input_ids=input_ids, attention_mask=attention_mask,
                                  position_ids=position_ids, past_key_values=past_key_values,
                                  inputs_embeds=inputs_embeds, labels=labels, use_cache=use_cache,
                                  logits_to_keep=logits_to_keep, **kwargs)
    from transformers.modeling_outputs import CausalLMOutputWithPast

    outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache,
                         **kwargs)
    loss = _flce_loss(outputs.last_hidden_state, self.lm_head, labels,
                      num_items_in_batch=kwargs.get("num_items_in_batch"),
                      ignore_index=kwargs.get("ignore_index", -100), shift_labels=kwargs.get("shift_labels"))
    return CausalLMOutputWithPast(loss=loss, logits=None, past_key_values=outputs.past_key_values,
                                  hidden_states=outputs.hidden_states, attentions=outputs.attentions)


# --------------------------------------------------------------------------- apply


def _swap(model: nn.Module, pred, make) -> int:
    n = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if pred(child):
                setattr(parent, name, make(child))
                n += 1
    return n


def apply(model: nn.Module, *, rms_norm: bool = True, rope: bool = True, swiglu: bool = True,
          attention: bool = True, cross_entropy: bool = True,
          fused_linear_cross_entropy: bool = True) -> nn.Module:
    """Patch a transformers LLaMA-family causal LM in place to run on pykern kernels; returns the model.

    Supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM,
    Qwen3ForCausalLM (subclasses too), float32, bfloat16 or float16 weights (attention included). Any other
    model raises ArgumentTypeError naming its class. The keyword flags turn
    single replacements off. Parameters are kept (not copied), so a model can be
    patched before or after building its optimizer.

    fused_linear_cross_entropy (with cross_entropy): a model in training mode
    called with labels computes its loss from the last hidden states with
    pykern's fused linear cross-entropy and returns logits=None (the (tokens,
    vocab) logits are never materialised); in eval mode, or without labels, it
    returns logits as usual (and the loss through the fused cross-entropy kernel).
    """
    try:
        import transformers
    except ImportError as e:  # optional extra
        raise ImportError("pykern.torch.apply needs transformers (pip install transformers)") from e

    family = None
    for cls_name, mod in SUPPORTED_MODELS.items():
        cls = getattr(transformers, cls_name, None)
        if cls is not None and isinstance(model, cls):
            family = mod
            break
    if family is None:
        raise ArgumentTypeError(
            f"model: pykern.torch.apply supports {', '.join(SUPPORTED_MODELS)}; got {type(model).__name__}"
        )
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if not dtypes <= set(_amp.KERNEL_DTYPES):
        raise ArgumentTypeError(
            f"model: pykern kernels run float32, bfloat16 or float16 weights, got {sorted(str(d) for d in dtypes)}"
        )
    modeling = sys.modules[f"transformers.models.{family}.modeling_{family}"]
    prefix = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}[family]
    norm_cls = getattr(modeling, f"{prefix}RMSNorm")
    mlp_cls = getattr(modeling, f"{prefix}MLP")
    attn_cls = getattr(modeling, f"{prefix}Attention")
    config = model.config

    if rms_norm:
        _swap(model, lambda m: type(m) is norm_cls, RMSNorm.from_module)
    if swiglu:
        act = getattr(config, "hidden_act", None)
        if act not in ("silu", "swish"):
            raise ArgumentTypeError(f"model: config.hidden_act: pykern's SwiGLU MLP needs 'silu', got {act!r}; "
                                    "pass swiglu=False")
        _swap(model, lambda m: type(m) is mlp_cls, SwiGLUMLP.from_module)
    if rope:
        _wrap_rotary(modeling)
        for m in model.modules():
            if isinstance(m, attn_cls) and not getattr(m, "_pykern_rope_hooks", None):
                m._pykern_rope_hooks = (
                    m.register_forward_pre_hook(_enter),
                    m.register_forward_hook(_exit, always_call=True),
                )
    if attention:
        _register_attention()
        model.set_attn_implementation(_ATTN_NAME)
        if config._attn_implementation != _ATTN_NAME:
            raise RuntimeError(f"pykern.torch.apply: {type(model).__name__} refused attn_implementation='pykern'")
    if cross_entropy:
        model.loss_function = _causal_lm_loss
        if fused_linear_cross_entropy:
            model.forward = types.MethodType(_flce_forward, model)
    model._pykern_patched = True
    return model
