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
- causal-LM loss: `model.loss_function` set to pykern's fused cross-entropy;
- mixture-of-experts families: the experts and routers as hf_moe describes.

Attention runs on pykern when the mask is a plain bottom-right causal mask, or
that mask cut to the layer's causal sliding window (Mistral's sliding_window,
Qwen2/3 window layers, Gemma 2/3 local layers: window_size=(W - 1, 0) on the
kernel, with the attention softcap where the model has one), over the whole
cache (prefill, chunked prefill and KV-cached decode with a dynamic cache, whose
sliding layers keep the last W - 1 tokens, no padding; one-token inference steps whose
heads the tensor-core decode kernel takes run pykern.ops.batched_decode_attention on
the cache in place); any other mask (padding,
static-cache slots, packed sequences) is materialised and handed to
transformers' SDPA implementation (the eager formula when the layer has an
attention softcap, which SDPA lacks), never approximated.
"""
from __future__ import annotations

import sys
import types
import threading
import weakref
from typing import Any, Optional

import torch
from torch import nn

from .. import arrays
from ..errors import ArgumentTypeError
from . import _amp, _dtensor as _dt, functional as F, hf_moe
from .modules import RMSNorm, SwiGLUMLP
from ._checks import checked

__all__ = ["apply", "SUPPORTED_MODELS"]

# class name -> modeling module (under transformers.models)
SUPPORTED_MODELS = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    # mixture of experts (experts and routers: see hf_moe)
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "OlmoeForCausalLM": "olmoe",
}
# modeling module -> class-name prefix of its RMSNorm / MLP / Attention
_PREFIXES = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3", "mixtral": "Mixtral",
             "qwen2_moe": "Qwen2Moe", "qwen3_moe": "Qwen3Moe", "olmoe": "Olmoe"}
# Families past LLaMA's layout: class name -> (modeling module, class prefix, RMSNorm kind ("llama":
# w * x, "gemma": x * (1 + w)), MLP kind ("split": gate/up/down Linears, "fused": Phi-3's gate_up_proj),
# config attribute naming the MLP activation, rope only with default rope_parameters)
_FAMILIES = {
    "GemmaForCausalLM": ("gemma", "Gemma", "gemma", "split", "hidden_act", False),
    "Gemma2ForCausalLM": ("gemma2", "Gemma2", "gemma", "split", "hidden_activation", False),
    "Gemma3ForCausalLM": ("gemma3", "Gemma3", "gemma", "split", "hidden_activation", False),
    "Phi3ForCausalLM": ("phi3", "Phi3", "llama", "fused", "hidden_act", True),
}
SUPPORTED_MODELS.update({name: spec[0] for name, spec in _FAMILIES.items()})
_ATTN_NAME = "pykern"
# families whose attention applies q_norm / k_norm right before apply_rotary_pos_emb: fused (qk_norm_rope).
# Qwen3 normalises the (batch, seq, heads, d) projections and then transposes, Gemma 3 normalises the transposed
# (batch, heads, seq, d) views (its norms are x * (1 + w)); either way the norm comes first, then the rotation
# with the cos / sin the layer was given (Gemma 3's local and global layers have their own rope bases).
_QK_NORM_FAMILIES = ("qwen3", "qwen3_moe", "gemma3")
_state = threading.local()  # depth of patched attention forwards on this thread


# --------------------------------------------------------------------------- attention


def _plain_causal(kw: dict[str, Any]) -> bool:
    """Whether the mask HF asks for is the bottom-right causal mask over the whole key range, or that
    mask cut to a causal sliding window of `local_size` tokens (transformers' sliding_window=W: query p
    sees keys p - W < k <= p, which the attention applies as window_size=(W - 1, 0))."""
    import transformers.masking_utils as mu

    if not kw.get("allow_is_causal_skip", True):
        return False  # overlays, packed sequences or block ids: HF itself needs the full mask
    q_len, kv_len = kw["q_length"], kw["kv_length"]
    q_off, kv_off = kw.get("q_offset", 0), kw.get("kv_offset", 0)
    if isinstance(q_off, torch.Tensor) or isinstance(kv_off, torch.Tensor):
        return False  # static caches: positions are device data
    if q_off + q_len != kv_off + kv_len:
        return False  # static-cache slots: the newest key is not the newest query
    pad = kw.get("attention_mask")
    if pad is not None:
        if mu.is_tracing(pad):
            return False
        pad = mu.prepare_padding_mask(pad, kv_len, kv_off)
        if not bool(mu.fast_all(pad)):
            return False  # padding
    fn = kw.get("mask_function", mu.causal_mask_function)
    if fn is mu.causal_mask_function:
        return True
    return _causal_window_probe(fn, q_off, q_len, kv_off, kv_len, kw.get("local_size"))


def _causal_window_probe(fn, q_off: int, q_len: int, kv_off: int, kv_len: int, window: Optional[int]) -> bool:
    """Whether the mask function (absolute query / key positions) is causal, cut to `window` keys
    (None: unbounded), over these positions. Causal and sliding-window functions are monotone in the
    key, so the edges decide: for the oldest and the newest query, the newest key it may see, the one
    after, and the oldest key it may see and the one before, within the cache's key range."""
    t = lambda i: torch.tensor(i)  # noqa: E731
    z = t(0)
    lo, hi = kv_off, kv_off + kv_len - 1
    for p in {q_off, q_off + q_len - 1}:
        first = lo if window is None else max(lo, p - window + 1)
        want = {p: True, p + 1: False, first: True, first - 1: False}
        for k, visible in want.items():
            if lo <= k <= hi and bool(fn(z, z, t(p), t(k))) != visible:
                return False
    return True


def _mask(**kw: Any) -> Optional[torch.Tensor]:
    """AttentionMaskInterface entry: None for a plain causal or causal sliding-window mask (the attention
    applies the window it is given), else SDPA's full boolean mask."""
    import transformers.masking_utils as mu

    if _plain_causal(kw):
        return None
    kw = dict(kw, allow_is_causal_skip=False, allow_is_bidirectional_skip=False)
    return mu.sdpa_mask(**kw)


def _attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: Optional[torch.Tensor], dropout: float = 0.0, scaling: Optional[float] = None,
               **kwargs: Any) -> tuple[torch.Tensor, None]:
    """AttentionInterface entry. query (b, heads, n_q, d), key/value (b, kv_heads, n_k, d) -> (b, n_q, heads, d).

    With no mask (plain causal, or causal sliding window: see _mask) it runs pykern's flash attention
    with the layer's sliding_window (as window_size=(W - 1, 0)) and softcap; a materialised mask
    (padding, static caches) goes to transformers' SDPA, or, with a softcap SDPA lacks, to the eager
    formula."""
    is_causal = kwargs.get("is_causal", getattr(module, "is_causal", True))
    window = kwargs.get("sliding_window")
    softcap = kwargs.get("softcap")
    supported = (
        attention_mask is None
        and is_causal
        and not (dropout and module.training)
        and not kwargs.get("output_attentions", False)
        and _attention_dtypes_ok(query, key, value)
        and max(query.shape[-1], value.shape[-1]) <= 256
    )
    if not supported and attention_mask is not None and is_causal and not (dropout and module.training) \
            and not kwargs.get("output_attentions", False) and _attention_dtypes_ok(query, key, value):
        packed = _packed_sequences(query, key, value, attention_mask, kwargs.get("position_ids"), window)
        if packed is not None:  # sequences packed in a row (position_ids restart): flash_attention_varlen
            return _varlen(query, key, value, packed, scaling, window, softcap), None
    if not supported:
        if attention_mask is None and query.shape[2] > 1 and key.shape[2] != query.shape[2]:
            raise RuntimeError("pykern attention: a bottom-right causal fallback needs a mask; got None")
        return _fallback(module, query, key, value, attention_mask, dropout, scaling, window, softcap, is_causal,
                         kwargs)
    if query.shape[2] == 1 and _decode_ok(query, key, value, softcap):
        return _decode(query, key, value, scaling, window, getattr(module, "_pykern_enable_pdl", False)), None
    if query.shape[2] > 1 and module.training:
        # No mask, position_ids that restart (a packing collator's rows with a cache object present, where
        # transformers leaves the mask causal): the sequences as transformers' flash-attention path runs them.
        # Training only: the check reads position_ids on the host once a forward, which inference never pays.
        packed = _packed_sequences(query, key, value, None, kwargs.get("position_ids"), window)
        if packed is not None:
            return _varlen(query, key, value, packed, scaling, window, softcap), None
    out = F.flash_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                            causal=True, scale=scaling, window_size=(-1 if window is None else int(window) - 1, 0),
                            softcap=softcap)
    return out, None


def _packed_sequences(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: Optional[torch.Tensor],
                      position_ids: Optional[torch.Tensor], window: Optional[int]) -> Optional[tuple[torch.Tensor, int]]:
    """(cu_seqlens, max_seqlen) of sequences packed in each row, or None (one sequence a row, padding, overlays,
    caches, torch.compile).

    The packing is read from position_ids, as transformers' flash-attention integration does
    (prepare_fa_kwargs_from_position_ids): a position that does not follow its predecessor starts a sequence
    (transformers' find_packed_sequence_indices), and so does every row. With a mask (transformers built the
    packed sequences' block-causal mask: no cache object) the mask is compared with the one those sequences
    give, so a mask with anything else in it (padding, overlays) keeps the SDPA path, never approximated.
    Without one (transformers left the mask causal, as it does with a cache object present) position_ids that
    go back somewhere mark packing, as in transformers' flash-attention path; with no key beyond the queries
    (nothing cached). Every layer of a forward gets the same mask and position_ids objects: the answer is kept
    for them."""
    if position_ids is None or torch.compiler.is_compiling():
        return None
    b, _, n_q, _ = query.shape
    if (key.shape[2] != n_q or position_ids.shape[-1] != n_q or query.dtype not in _amp.ATTENTION_DTYPES
            or key.dtype != query.dtype or value.dtype != query.dtype or value.shape[-1] != query.shape[-1]):
        return None
    if mask is not None and (mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1] != 1
                             or tuple(mask.shape[2:]) != (n_q, n_q) or mask.shape[0] != b):
        return None
    seen = getattr(_state, "packed", None)
    if (seen is not None and (seen[0]() if seen[0] is not None else None) is mask and seen[1]() is position_ids
            and seen[2] == (window, b, n_q)):
        return seen[3]
    pos = position_ids.to(query.device).expand(b, -1)
    step = torch.diff(pos, prepend=pos[:, :1] - 1, dim=-1)
    start = step != 1
    start[:, 0] = True  # every row starts a sequence
    result = None
    if mask is None:
        packed = bool((step < 0).any())
    else:
        seg = start.cumsum(-1)
        idx = torch.arange(n_q, device=query.device)
        rel = idx[:, None] - idx[None, :]  # query index - key index: within a sequence, the position difference
        want = (seg[:, :, None] == seg[:, None, :]) & (rel >= 0)
        if window is not None:
            want &= rel < int(window)
        packed = int(start.sum()) > b and torch.equal(mask[:, 0], want)
    if packed:
        starts = start.reshape(-1).nonzero().view(-1).to(torch.int32)
        cu = torch.cat((starts, torch.tensor([b * n_q], dtype=torch.int32, device=query.device)))
        result = (cu, int(cu.diff().max()))
    _state.packed = (None if mask is None else weakref.ref(mask), weakref.ref(position_ids), (window, b, n_q), result)
    return result


def _varlen(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, packed: tuple[torch.Tensor, int],
            scaling: Optional[float], window: Optional[int], softcap: Any) -> torch.Tensor:
    """Packed sequences on pykern.torch.flash_attention_varlen: (b, heads, n, d) rows flattened to (b * n,
    heads, d), one cu_seqlens for queries and keys. Returns (b, n, heads, d)."""
    cu, longest = packed
    b, h, n, d = query.shape
    q, k, v = (t.transpose(1, 2).reshape(b * n, t.shape[1], t.shape[3]) for t in (query, key, value))
    out = F.flash_attention_varlen(q, k, v, cu, cu, longest, longest, softmax_scale=scaling, causal=True,
                                   window_size=(-1 if window is None else int(window) - 1, 0),
                                   softcap=float(softcap or 0.0))
    return out.view(b, n, h, value.shape[3])


def _decode_ok(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, softcap: Any) -> bool:
    """Whether a one-token step goes to the tensor-core decode kernel: no gradient wanted (it has no
    backward), not under torch.compile (it is not a custom op) or autocast, 16-bit q, K and V of one dtype and
    head_dim with unit-stride rows, and a shape the kernel takes (pykern.ops.serving.tc_decode_eligible); a
    cache the kernel cannot address (unaligned) runs the op's tile kernels, still in place."""
    from ..ops.serving import tc_decode_eligible

    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad):
        return False
    if torch.compiler.is_compiling() or _amp.autocast_dtype(query) is not None:
        return False
    d = query.shape[-1]
    if key.dtype != query.dtype or value.dtype != query.dtype or key.shape[-1] != d or value.shape != key.shape \
            or query.shape[1] % key.shape[1] or key.stride(-1) != 1 or value.stride(-1) != 1:
        return False
    kind = arrays.io_kind("query", query, arrays.IO_KINDS)  # f32 q: not eligible below
    return tc_decode_eligible(kind, kind, query.shape[1] // key.shape[1], d, float(softcap or 0.0))


def _decode(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: Optional[float],
            window: Optional[int], enable_pdl: bool = False) -> torch.Tensor:
    """One query token a sequence over the whole cache (bottom-right causal is every key; a sliding window W
    keeps the last W): pykern.ops.batched_decode_attention on the (b, kv_heads, n_k, d) cache read in place
    (HND), not flash attention on transposed, copied caches. Returns (b, 1, heads, d). enable_pdl: apply()'s, for
    the decode kernel's launch (programmatic dependent launch on sm_90+)."""
    b, n_k = query.shape[0], key.shape[2]
    lens = torch.full((b,), n_k, dtype=torch.int32, device=query.device)
    out = F.call("batched_decode_attention", query[:, :, 0, :], key, value, lens, kv_layout="HND", scale=scaling,
                 window_left=-1 if window is None else int(window) - 1, enable_pdl=enable_pdl)
    return out.unsqueeze(1)


def _fallback(module, query, key, value, mask, dropout, scaling, window, softcap, is_causal, kwargs):
    """transformers' SDPA path; with a softcap or a sliding window and no mask (which SDPA cannot take),
    the eager formula of Gemma 2: scores * scaling, softcap, mask, float32 softmax, dropout, @ value."""
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    if softcap is None and (window is None or mask is not None):
        return sdpa_attention_forward(module, query, key, value, mask, dropout=dropout, scaling=scaling, **kwargs)
    groups = query.shape[1] // key.shape[1]
    k, v = repeat_kv(key, groups), repeat_kv(value, groups)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    w = torch.matmul(query, k.transpose(2, 3)) * scale
    if softcap is not None:
        w = torch.tanh(w / softcap) * softcap
    n_q, n_k = query.shape[2], key.shape[2]
    if mask is not None:
        # the eager path's additive min (not -inf): a fully padded query row stays finite, as in HF
        w = w.masked_fill(~mask, torch.finfo(w.dtype).min) if mask.dtype == torch.bool else w + mask[..., :n_k]
    elif is_causal:  # bottom-right causal, cut to the window
        i = torch.arange(n_q, device=w.device)[:, None] + (n_k - n_q)
        j = torch.arange(n_k, device=w.device)[None, :]
        keep = (j <= i) & ((j > i - window) if window is not None else True)
        w = w.masked_fill(~keep, float("-inf"))
    w = nn.functional.softmax(w, dim=-1, dtype=torch.float32).to(query.dtype)
    w = nn.functional.dropout(w, p=dropout, training=module.training)
    out = torch.matmul(w, v).transpose(1, 2).contiguous()
    return out, w


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
    _state.qk = {}  # the deferred q_norm / k_norm inputs of this attention forward (QKNormDeferred)


def _exit(module: nn.Module, args: Any, output: Any) -> None:
    _state.depth = max(0, getattr(_state, "depth", 0) - 1)
    pending, _state.qk = getattr(_state, "qk", None), {}
    if pending:
        raise RuntimeError("pykern.torch.apply: a deferred q_norm / k_norm was never applied (the attention "
                           "forward did not call apply_rotary_pos_emb); patch with rope=False")


class QKNormDeferred(nn.Module):
    """Qwen3's / Gemma 3's q_norm / k_norm inside a patched attention: its input is handed on unnormalised and
    the norm is fused into the rotation (pykern.torch.qk_norm_rope) by the wrapped apply_rotary_pos_emb, which
    applies the wrapped norm itself where the fused kernel does not apply. The weight Parameter is the wrapped
    norm's; offset is the norm's weight offset (0: w * x, Qwen3's; 1: x * (1 + w), Gemma 3's)."""

    def __init__(self, norm: nn.Module, role: str, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = norm.weight  # the same Parameter under the same state_dict key (q_norm.weight)
        object.__setattr__(self, "norm", norm)  # not a submodule: its weight is registered above
        self.role = role
        self.offset = float(offset)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pending = getattr(_state, "qk", None)
        if not _rope_active() or pending is None:
            return self.norm(x)
        pending[self.role] = (self, x)
        return x


def _norm_eps(norm: nn.Module) -> float:
    return float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))


def _take_qk(q: torch.Tensor, k: torch.Tensor) -> Optional[tuple[Any, Any]]:
    """The deferred (q_norm, x) and (k_norm, x) of this attention forward when q and k are their transposes."""
    pending = getattr(_state, "qk", None)
    if not pending:
        return None
    got = pending.pop("q", None), pending.pop("k", None)
    if got[0] is None or got[1] is None:
        raise RuntimeError("pykern.torch.apply: q_norm and k_norm must both run before apply_rotary_pos_emb")
    return got


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a and b view the same storage the same way; data pointers cannot be compared while torch.compile
    traces, where shapes and strides are checked."""
    return (a.shape == b.shape and a.stride() == b.stride()
            and (torch.compiler.is_compiling() or a.data_ptr() == b.data_ptr()))


def _wrap_rotary(modeling: Any) -> None:
    """Install the dispatching apply_rotary_pos_emb in one modeling module (once)."""
    orig = modeling.apply_rotary_pos_emb
    if getattr(orig, "_pykern_original", None) is not None:
        return

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        qk = _take_qk(q, k)
        if qk is not None:
            (qn, xq), (kn, xk) = qk
            # q and k must be the deferred inputs (Gemma 3's attention normalises the (b, heads, seq, d) views it
            # hands on) or their transposes (Qwen3's normalises the (b, seq, heads, d) projections)
            same = ((_same_view(xq, q) and _same_view(xk, k))
                    or (_same_view(xq.transpose(1, 2), q) and _same_view(xk.transpose(1, 2), k)))
            if (same and unsqueeze_dim == 1 and q.dtype in _amp.KERNEL_DTYPES and k.dtype == q.dtype
                    and qn.weight.dtype == q.dtype and kn.weight.dtype == q.dtype and _amp.autocast_dtype(q) is None
                    and not _dt.active(q, k, cos, sin, qn.weight, kn.weight) and cos.dim() == 3
                    and cos.shape[-1] == q.shape[-1] == k.shape[-1]
                    and qn.offset == kn.offset and _norm_eps(qn.norm) == _norm_eps(kn.norm)):
                oq, ok = F.qk_norm_rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin, qn.weight, kn.weight,
                                        _norm_eps(qn.norm), offset=qn.offset)
                return oq.transpose(1, 2), ok.transpose(1, 2)
            q, k = qn.norm(q), kn.norm(k)  # the norms over head_dim, in HF's layout, then the rotation below
        if (
            _rope_active()
            and unsqueeze_dim == 1
            and q.dtype in _amp.KERNEL_DTYPES
            and k.dtype == q.dtype
            and q.dim() == 4
            and cos.dim() == 3
            and cos.shape[-1] == q.shape[-1] == k.shape[-1]  # partial rotary (Phi-3's option): HF's
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


def _flce_loss(hidden, lm_head, labels, num_items_in_batch=None, ignore_index: int = -100, shift_labels=None,
               softcap=None):
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
        return fused_linear_cross_entropy(h, w, shift_labels, b, ignore_index=ignore_index, reduction="mean",
                                          softcap=softcap)
    loss = fused_linear_cross_entropy(h, w, shift_labels, b, ignore_index=ignore_index, reduction="sum",
                                      softcap=softcap)
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
                      ignore_index=kwargs.get("ignore_index", -100), shift_labels=kwargs.get("shift_labels"),
                      softcap=getattr(self.config, "final_logit_softcapping", None))  # Gemma 2 / 3
    return CausalLMOutputWithPast(loss=loss, logits=None, past_key_values=outputs.past_key_values,
                                  hidden_states=outputs.hidden_states, attentions=outputs.attentions)


# --------------------------------------------------------------------------- families past LLaMA's layout


def _patch_family(model: nn.Module, spec: tuple, norm_cls: type, mlp_cls: type, *, rms_norm: bool,
                  swiglu: bool) -> None:
    """RMSNorm and MLP swaps of a _FAMILIES model (Gemma 1/2/3, Phi-3). `swiglu` turns the gated-MLP
    swap off or on, whatever the activation (GeGLU for Gemma)."""
    from .modules import GATE_ACTIVATIONS, FusedGateUpMLP, GatedMLP

    _, _, norm_kind, mlp_kind, act_attr, _ = spec
    if rms_norm:
        make = RMSNorm.from_gemma if norm_kind == "gemma" else RMSNorm.from_module
        _swap(model, lambda m: type(m) is norm_cls, make)
    if swiglu:
        act = getattr(model.config, act_attr, None)
        if act not in GATE_ACTIVATIONS:
            raise ArgumentTypeError(f"model: config.{act_attr}: pykern's gated MLP takes {sorted(GATE_ACTIVATIONS)}, "
                                    f"got {act!r}; pass swiglu=False")
        wrap = FusedGateUpMLP if mlp_kind == "fused" else GatedMLP
        _swap(model, lambda m: type(m) is mlp_cls, lambda m: wrap.from_module(m, act))


def _default_rope(config: Any) -> bool:
    """Whether every rope_parameters entry (or the legacy rope_scaling) is plain rope: other rope types
    (Phi-3's longrope, su, yarn) stay transformers' own."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    entries = params.values() if params and all(isinstance(v, dict) for v in params.values()) else [params]
    return all((e or {}).get("rope_type", (e or {}).get("type", "default")) == "default" for e in entries)


# --------------------------------------------------------------------------- apply


def _swap(model: nn.Module, pred, make) -> int:
    n = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if pred(child):
                setattr(parent, name, make(child))
                n += 1
    return n


@checked
def apply(model: nn.Module, *, rms_norm: bool = True, rope: bool = True, swiglu: bool = True,
          attention: bool = True, cross_entropy: bool = True,
          fused_linear_cross_entropy: bool = True, experts: bool = True, router: bool = True,
          enable_pdl: bool = False) -> nn.Module:
    """Patch a transformers LLaMA-family causal LM in place to run on pykern kernels; returns the model.

    Supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM,
    Qwen3ForCausalLM, GemmaForCausalLM, Gemma2ForCausalLM, Gemma3ForCausalLM (text),
    Phi3ForCausalLM, and the mixture-of-experts MixtralForCausalLM, Qwen2MoeForCausalLM,
    Qwen3MoeForCausalLM, OlmoeForCausalLM (subclasses too; docs/torch.md and docs/moe.md have what is
    patched in each), float32, bfloat16 or float16 weights (attention and the MoE experts and routers
    included). Sliding-window layers and attention
    softcaps run on pykern's kernels. Any other
    model raises ArgumentTypeError naming its class. The keyword flags turn
    single replacements off. Parameters are kept (not copied), so a model can be
    patched before or after building its optimizer.

    fused_linear_cross_entropy (with cross_entropy): a model in training mode
    called with labels computes its loss from the last hidden states with
    pykern's fused linear cross-entropy and returns logits=None (the (tokens,
    vocab) logits are never materialised); in eval mode, or without labels, it
    returns logits as usual (and the loss through the fused cross-entropy kernel).
    With router logits requested, an MoE model adds its load-balancing loss as transformers does.

    experts (MoE families): transformers' experts implementation "pykern" (pykern.torch.moe_experts);
    router (MoE families): top-k routing on pykern.torch.moe_route.

    enable_pdl (with attention): the one-token decode steps that run pykern.ops.batched_decode_attention launch
    its tensor-core kernel with programmatic dependent launch (FlashInfer's name; sm_90+ on the nvrtc backend,
    elsewhere an ordinary launch; docs/serving.md): the kernel waits inside for the one before it.
    """
    try:
        import transformers
    except ImportError as e:  # optional extra
        raise ImportError("pykern.torch.apply needs transformers (pip install transformers)") from e

    if type(enable_pdl) is not bool:
        raise ArgumentTypeError(f"enable_pdl: expected a bool, got {type(enable_pdl).__name__} {enable_pdl!r}")
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
    spec = next((v for k, v in _FAMILIES.items() if v[0] == family), None)
    prefix = spec[1] if spec else _PREFIXES[family]
    norm_cls = getattr(modeling, f"{prefix}RMSNorm")
    mlp_cls = getattr(modeling, f"{prefix}MLP", None)  # Mixtral has none (experts only)
    attn_cls = getattr(modeling, f"{prefix}Attention")
    config = model.config

    if spec is not None:
        _patch_family(model, spec, norm_cls, mlp_cls, rms_norm=rms_norm, swiglu=swiglu)
        rope = rope and (not spec[5] or _default_rope(config))
    elif rms_norm:
        _swap(model, lambda m: type(m) is norm_cls, RMSNorm.from_module)
    if swiglu and spec is None and mlp_cls is not None:
        act = getattr(config, "hidden_act", None)
        if act not in ("silu", "swish"):
            raise ArgumentTypeError(f"model: config.hidden_act: pykern's SwiGLU MLP needs 'silu', got {act!r}; "
                                    "pass swiglu=False")
        _swap(model, lambda m: type(m) is mlp_cls, SwiGLUMLP.from_module)
    if rope:
        _wrap_rotary(modeling)
        for m in model.modules():
            if family in _QK_NORM_FAMILIES and isinstance(m, attn_cls):
                for role in ("q", "k"):
                    norm = getattr(m, f"{role}_norm", None)
                    if isinstance(norm, nn.Module) and not isinstance(norm, QKNormDeferred):
                        # pykern's RMSNorm carries its offset; an unswapped HF norm (rms_norm=False) is the
                        # family's kind: Gemma's x * (1 + w)
                        offset = getattr(norm, "offset", 1.0 if spec is not None and spec[2] == "gemma" else 0.0)
                        setattr(m, f"{role}_norm", QKNormDeferred(norm, role, offset))
            if isinstance(m, attn_cls) and not getattr(m, "_pykern_rope_hooks", None):
                m._pykern_rope_hooks = (
                    m.register_forward_pre_hook(_enter),
                    m.register_forward_hook(_exit, always_call=True),
                )
    if attention:
        _register_attention()
        for m in model.modules():
            if isinstance(m, attn_cls):
                m._pykern_enable_pdl = enable_pdl  # read by the decode step (_attention -> _decode)
        model.set_attn_implementation(_ATTN_NAME)
        if config._attn_implementation != _ATTN_NAME:
            raise RuntimeError(f"pykern.torch.apply: {type(model).__name__} refused attn_implementation='pykern'")
    moe = family in hf_moe.FAMILIES
    if moe:
        hf_moe.patch(model, modeling, family, experts=experts, router=router)
    if cross_entropy:
        model.loss_function = _causal_lm_loss
        if fused_linear_cross_entropy:
            fwd = hf_moe.flce_forward(modeling) if moe else _flce_forward
            model.forward = types.MethodType(fwd, model)
    model._pykern_patched = True
    return model
