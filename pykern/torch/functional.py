"""Autograd-aware pykern kernels for PyTorch.

Each kernel is a `torch.library.custom_op` in the `pykern` namespace with a
fake (meta) implementation and a registered autograd formula whose backward is
itself a pykern custom op, so `torch.compile(fullgraph=True)` traces a model
built from these functions without graph breaks, forward and backward.

Layouts follow pykern.ops: attention tensors are (batch, seq, heads, head_dim),
RoPE rotates q and k of that layout in HF LLaMA's rotate_half convention.
Supported dtypes are float32, bfloat16 and float16 (fp32 accumulation inside), attention included.
DTensor arguments (tensor parallelism) run on the local shards where that is
exact and are gathered explicitly otherwise (see pykern.torch._dtensor). Under
torch.autocast each function follows its torch counterpart's autocast policy
(see pykern.torch._amp).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from ..errors import ArgumentError, ArgumentTypeError
from ..ops._window import check_softcap, check_window_size
from . import _amp, _dtensor as _dt, _fast
from ._bridge import call
from ._checks import checked

__all__ = ["rms_norm", "rope", "qk_norm_rope", "swiglu", "flash_attention", "flash_attention_varlen", "cross_entropy",
           "embedding"]


def _new(shape, dtype, like: Tensor) -> Tensor:
    return torch.empty(tuple(shape), dtype=dtype, device=like.device)


def _c(t: Tensor) -> Tensor:
    return t if t.is_contiguous() else t.contiguous()


# --------------------------------------------------------------------------- rms_norm


@_fast.custom_op("rms_norm")
def _rms_norm(x: Tensor, weight: Tensor, eps: float, offset: float = 0.0) -> Tensor:
    return call("rms_norm", _c(x), _c(weight), eps, offset=offset)


@_rms_norm.register_fake
def _(x, weight, eps, offset=0.0):
    return _new(x.shape, x.dtype, x)


@_fast.custom_op("rms_norm_backward")
def _rms_norm_backward(x: Tensor, weight: Tensor, grad_out: Tensor, eps: float,
                       offset: float = 0.0) -> tuple[Tensor, Tensor]:
    gx, gw = call("rms_norm_backward", _c(x), _c(weight), _c(grad_out), eps, offset=offset)
    return gx, gw.to(weight.dtype)


@_rms_norm_backward.register_fake
def _(x, weight, grad_out, eps, offset=0.0):
    return _new(x.shape, x.dtype, x), _new(weight.shape, weight.dtype, weight)


def _rms_norm_setup(ctx, inputs, output):
    x, weight, eps, offset = inputs
    ctx.save_for_backward(x, weight)
    ctx.eps, ctx.offset = eps, offset


def _rms_norm_bwd(ctx, grad):
    x, weight = ctx.saved_tensors
    gx, gw = _rms_norm_backward.fast(x, weight, grad, ctx.eps, ctx.offset)
    return gx, gw, None, None


_fast.register_autograd(_rms_norm, _rms_norm_bwd, _rms_norm_setup)


@checked
def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6, offset: float = 0.0) -> Tensor:
    """x / sqrt(mean(x^2, -1) + eps) * (offset + weight) over the last axis (x and weight of one dtype).

    offset=1.0 is Gemma's RMSNorm, x * (1 + weight) with the sum taken in float32 (as Gemma does);
    the weight's gradient is the same either way."""
    if _dt.active(x, weight):
        return _dt.run("rms_norm", lambda x, w: rms_norm(x, w, eps, offset), (x, weight), ("data", "param"),
                       local_ok=_dt.rows_only(x.dim()))
    amp = _amp.autocast_dtype(x)
    if amp is not None:
        return _amp.norm(lambda x, w: rms_norm(x, w, eps, offset), x, (x, weight), amp, op="rms_norm")
    return _rms_norm.fast(x, weight, float(eps), float(offset))


# --------------------------------------------------------------------------- swiglu


@_fast.custom_op("swiglu")
def _swiglu(gate: Tensor, up: Tensor) -> Tensor:
    return call("silu_gate", _c(gate), _c(up))


@_swiglu.register_fake
def _(gate, up):
    return _new(gate.shape, gate.dtype, gate)


@_fast.custom_op("swiglu_backward")
def _swiglu_backward(gate: Tensor, up: Tensor, grad_out: Tensor) -> tuple[Tensor, Tensor]:
    gg, gu = call("silu_gate_backward", _c(gate), _c(up), _c(grad_out))
    return gg, gu


@_swiglu_backward.register_fake
def _(gate, up, grad_out):
    return _new(gate.shape, gate.dtype, gate), _new(up.shape, up.dtype, up)


def _swiglu_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _swiglu_bwd(ctx, grad):
    gate, up = ctx.saved_tensors
    return _swiglu_backward.fast(gate, up, grad)


_fast.register_autograd(_swiglu, _swiglu_bwd, _swiglu_setup)


@checked
def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """silu(gate) * up elementwise (same shape and dtype)."""
    if _dt.active(gate, up):
        return _dt.run("swiglu", swiglu, (gate, up), ("data", "data"), local_ok=_dt.anything)
    if _amp.autocast_dtype(gate) is not None:
        return _amp.elementwise(swiglu, (gate, up))
    return _swiglu.fast(gate, up)


# --------------------------------------------------------------------------- rope


@_fast.custom_op("rope")
def _rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, position_ids: Tensor, inverse: bool) -> tuple[Tensor, Tensor]:
    # q (b, s, hq, d), k (b, s, hk, d); cos/sin (max_pos, d) float32 tables; position_ids (b or 1, s) int64.
    # one launch rotates both (pykern.ops.qk_norm_rope without weights)
    return call("qk_norm_rope", _c(q), _c(k), cos, sin, position_ids=position_ids, style="half", inverse=inverse)


@_rope.register_fake
def _(q, k, cos, sin, position_ids, inverse):
    return _new(q.shape, q.dtype, q), _new(k.shape, k.dtype, k)


def _rope_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[2], inputs[3], inputs[4])
    ctx.inverse = inputs[5]


def _rope_bwd(ctx, gq, gk):
    cos, sin, pos = ctx.saved_tensors
    # The rotation by -theta is the inverse and the transpose of the rotation by theta.
    dq, dk = _rope.fast(gq, gk, cos, sin, pos, not ctx.inverse)
    return dq, dk, None, None, None, None


_fast.register_autograd(_rope, _rope_bwd, _rope_setup)


def _tables(cos: Tensor, sin: Tensor, batch: int, seq: int, head_dim: int,
            position_ids: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """(cos table, sin table, position_ids) in the form pykern.ops.rope takes, from either HF table form."""
    if cos.shape != sin.shape:
        raise ArgumentError(f"sin: expected the shape of cos {tuple(cos.shape)}, got {tuple(sin.shape)}")
    if cos.shape[-1] != head_dim:
        raise ArgumentError(f"cos: expected a last dimension of head_dim={head_dim}, got shape {tuple(cos.shape)}")
    if cos.dim() == 2:  # HF (max_pos, head_dim) tables, indexed by position
        if position_ids is None:
            position_ids = torch.arange(seq, device=cos.device)
        if position_ids.dim() == 1:
            position_ids = position_ids.unsqueeze(0)
        if position_ids.dim() != 2 or position_ids.shape[-1] != seq or position_ids.shape[0] not in (1, batch):
            raise ArgumentError(
                f"position_ids: expected shape ({batch}, {seq}) or ({seq},), got {tuple(position_ids.shape)}"
            )
        if position_ids.dtype.is_floating_point or position_ids.dtype == torch.bool:
            raise ArgumentTypeError(f"position_ids: expected an integer tensor, got {position_ids.dtype}")
        pos = position_ids.to(device=cos.device, dtype=torch.int64)
        c, s = cos, sin
    elif cos.dim() == 3:  # HF rotary module output (batch or 1, seq, head_dim): one table row per token
        if position_ids is not None:
            raise ArgumentError("position_ids: must be None when cos/sin are per-token (batch, seq, head_dim)")
        if cos.shape[1] != seq or cos.shape[0] not in (1, batch):
            raise ArgumentError(f"cos: expected shape ({batch} or 1, {seq}, {head_dim}), got {tuple(cos.shape)}")
        c, s = cos.reshape(-1, head_dim), sin.reshape(-1, head_dim)
        pos = torch.arange(c.shape[0], device=cos.device).view(cos.shape[0], seq)
    else:
        raise ArgumentError(f"cos: expected (max_pos, head_dim) or (batch, seq, head_dim), got {tuple(cos.shape)}")
    return _c(c.detach().float()), _c(s.detach().float()), _c(pos)



@checked
def rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, position_ids: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """Rotary embedding of q and k together, HF LLaMA rotate_half layout.

    q (batch, seq, n_heads, head_dim), k (batch, seq, n_kv_heads, head_dim).
    cos/sin are HF tables, either (max_pos, head_dim) indexed by position_ids
    ((batch, seq), (1, seq) or (seq,); default 0..seq-1), or the (batch or 1,
    seq, head_dim) per-token rows HF's rotary module returns. As in HF the two
    halves of a table row are equal (emb = cat(freqs, freqs)). Gradients flow
    to q and k (cos/sin are constants, as in HF where they come from no_grad).
    """
    if _dt.active(q, k, cos, sin, position_ids):
        # heads are independent; batch rows too when every row uses the same table rows
        batch_free = (cos.dim() == 2 and (position_ids is None or position_ids.dim() == 1
                                          or position_ids.shape[0] == 1)) or (cos.dim() == 3 and cos.shape[0] == 1)
        return _dt.run("rope", rope, (q, k, cos, sin, position_ids), ("data", "data", "const", "const", "const"),
                       local_ok=lambda n: set(n) <= ({0, 2} if batch_free else {2}),
                       out_shapes=lambda a: (a[0].shape, a[1].shape))
    if _amp.autocast_dtype(q) is not None:
        # elementwise in torch (q * cos + rotate_half(q) * sin): each output promotes with the tables
        dq, dk = _amp.promoted(q, cos, sin), _amp.promoted(k, cos, sin)
        if not (q.dtype == dq == k.dtype == dk and _amp.plain(q, k)):
            return _amp.run(lambda q, k: rope(q, k, cos, sin, position_ids), (q, k),
                            torch.promote_types(dq, dk), (dq, dk))
    for name, t in (("q", q), ("k", k)):
        if t.dim() != 4:
            raise ArgumentError(f"{name}: expected (batch, seq, heads, head_dim), got shape {tuple(t.shape)}")
    b, s, _, d = q.shape
    if k.shape[0] != b or k.shape[1] != s or k.shape[3] != d:
        raise ArgumentError(f"k: expected shape ({b}, {s}, n_kv_heads, {d}) (batch, seq and head_dim of q), got "
                            f"{tuple(k.shape)}")
    for name, t in (("q", q), ("k", k)):  # checked here: pykern.ops.rope would name its own argument, x
        if t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ArgumentTypeError(f"{name}: expected dtype float32, bfloat16 or float16, got {t.dtype}")
    c, sn, pos = _tables(cos, sin, b, s, d, position_ids)
    return _rope.fast(q, k, c, sn, pos, False)


# --------------------------------------------------------------------------- qk_norm_rope


@_fast.custom_op("qk_norm_rope")
def _qk_norm_rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, position_ids: Tensor, q_weight: Tensor,
                  k_weight: Tensor, eps: float, offset: float) -> tuple[Tensor, Tensor]:
    return call("qk_norm_rope", _c(q), _c(k), cos, sin, position_ids=position_ids, q_weight=_c(q_weight),
                k_weight=_c(k_weight), eps=eps, weight_offset=offset, style="half")


@_qk_norm_rope.register_fake
def _(q, k, cos, sin, position_ids, q_weight, k_weight, eps, offset):
    return _new(q.shape, q.dtype, q), _new(k.shape, k.dtype, k)


@_fast.custom_op("qk_norm_rope_backward")
def _qk_norm_rope_backward(q: Tensor, k: Tensor, gq: Tensor, gk: Tensor, cos: Tensor, sin: Tensor,
                           position_ids: Tensor, q_weight: Tensor, k_weight: Tensor, eps: float,
                           offset: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return tuple(call("qk_norm_rope_backward", _c(q), _c(k), _c(gq), _c(gk), cos, sin, _c(q_weight),
                      _c(k_weight), position_ids=position_ids, eps=eps, weight_offset=offset, style="half"))


@_qk_norm_rope_backward.register_fake
def _(q, k, gq, gk, cos, sin, position_ids, q_weight, k_weight, eps, offset):
    return (_new(q.shape, q.dtype, q), _new(k.shape, k.dtype, k), _new(q_weight.shape, q_weight.dtype, q_weight),
            _new(k_weight.shape, k_weight.dtype, k_weight))


def _qk_norm_rope_setup(ctx, inputs, output):
    q, k, cos, sin, pos, wq, wk, eps, offset = inputs
    ctx.save_for_backward(q, k, cos, sin, pos, wq, wk)
    ctx.eps, ctx.offset = eps, offset


def _qk_norm_rope_bwd(ctx, gq, gk):
    q, k, cos, sin, pos, wq, wk = ctx.saved_tensors
    dq, dk, dwq, dwk = _qk_norm_rope_backward.fast(q, k, gq, gk, cos, sin, pos, wq, wk, ctx.eps, ctx.offset)
    return dq, dk, None, None, None, dwq, dwk, None, None


_fast.register_autograd(_qk_norm_rope, _qk_norm_rope_bwd, _qk_norm_rope_setup)


@checked
def qk_norm_rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, q_weight: Tensor, k_weight: Tensor,
                 eps: float = 1e-6, position_ids: Optional[Tensor] = None,
                 offset: float = 0.0) -> tuple[Tensor, Tensor]:
    """rope(rms_norm(q, q_weight), rms_norm(k, k_weight)) in one launch: Qwen3's (offset=0) and Gemma 3's
    (offset=1, x * (1 + weight)) q_norm / k_norm over head_dim of each head, then HF's rotate_half rotation.

    q (batch, seq, n_heads, head_dim), k (batch, seq, n_kv_heads, head_dim), weights (head_dim,) of q's dtype;
    cos / sin / position_ids as in rope. Gradients flow to q, k and both weights (the weight gradients are
    deterministic). The norm is computed in float32 and not rounded to q's dtype before the rotation.
    """
    for name, t in (("q", q), ("k", k)):
        if t.dim() != 4:
            raise ArgumentError(f"{name}: expected (batch, seq, heads, head_dim), got shape {tuple(t.shape)}")
        if t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ArgumentTypeError(f"{name}: expected dtype float32, bfloat16 or float16, got {t.dtype}")
    b, s, _, d = q.shape
    if k.shape[0] != b or k.shape[1] != s or k.shape[3] != d:
        raise ArgumentError(f"k: expected shape ({b}, {s}, n_kv_heads, {d}) (batch, seq and head_dim of q), got "
                            f"{tuple(k.shape)}")
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        if w.dtype != q.dtype:
            raise ArgumentTypeError(f"{name}: expected the dtype of q {q.dtype}, got {w.dtype}")
    c, sn, pos = _tables(cos, sin, b, s, d, position_ids)
    return _qk_norm_rope.fast(q, k, c, sn, pos, q_weight, k_weight, float(eps), float(offset))


# --------------------------------------------------------------------------- flash_attention


@_fast.custom_op("flash_attention")
def _flash_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, window_left: int = -1,
                     window_right: int = -1, softcap: float = 0.0) -> tuple[Tensor, Tensor]:
    out, lse = call("flash_attention", _c(q), _c(k), _c(v), causal=causal, scale=scale, return_lse=True,
                    window_size=(window_left, window_right), softcap=softcap)
    return out, lse


@_flash_attention.register_fake
def _(q, k, v, causal, scale, window_left=-1, window_right=-1, softcap=0.0):
    b, n_q, h, _ = q.shape
    return _new((b, n_q, h, v.shape[3]), q.dtype, q), _new((b, n_q, h), torch.float32, q)


@_fast.custom_op("flash_attention_backward")
def _flash_attention_backward(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, grad_out: Tensor,
                              causal: bool, scale: float, window_left: int = -1, window_right: int = -1,
                              softcap: float = 0.0, deterministic: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    dq, dk, dv = call("attention_backward", _c(q), _c(k), _c(v), _c(grad_out), out=_c(out), lse=_c(lse),
                      scale=scale, causal=causal, window_size=(window_left, window_right), softcap=softcap,
                      deterministic=deterministic)
    return dq, dk, dv


@_flash_attention_backward.register_fake
def _(q, k, v, out, lse, grad_out, causal, scale, window_left=-1, window_right=-1, softcap=0.0,
      deterministic=False):
    return _new(q.shape, q.dtype, q), _new(k.shape, k.dtype, k), _new(v.shape, v.dtype, v)


def _fa_setup(ctx, inputs, output):
    q, k, v, causal, scale, wl, wr, cap = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.causal, ctx.scale, ctx.window, ctx.softcap = causal, scale, (wl, wr), cap
    ctx.mark_non_differentiable(lse)


def _fa_bwd(ctx, grad_out, grad_lse):
    q, k, v, out, lse = ctx.saved_tensors
    # torch.use_deterministic_algorithms(True): dQ summed in a fixed order (bit-identical run to run)
    dq, dk, dv = _flash_attention_backward.fast(q, k, v, out, lse, grad_out, ctx.causal, ctx.scale,
                                                           ctx.window[0], ctx.window[1], ctx.softcap,
                                                           torch.are_deterministic_algorithms_enabled())
    return dq, dk, dv, None, None, None, None, None


_fast.register_autograd(_flash_attention, _fa_bwd, _fa_setup)


@_fast.custom_op("flash_attention_fp8")
def _flash_attention_fp8(q: Tensor, k: Tensor, v: Tensor, q_descale: Optional[Tensor], k_descale: Optional[Tensor],
                         v_descale: Optional[Tensor], causal: bool, scale: float, window_left: int = -1,
                         window_right: int = -1, softcap: float = 0.0) -> tuple[Tensor, Tensor]:
    out, lse = call("flash_attention", _c(q), _c(k), _c(v), causal=causal, scale=scale, return_lse=True,
                    window_size=(window_left, window_right), softcap=softcap, q_descale=q_descale,
                    k_descale=k_descale, v_descale=v_descale)
    return out, lse


@_flash_attention_fp8.register_fake
def _(q, k, v, q_descale, k_descale, v_descale, causal, scale, window_left=-1, window_right=-1, softcap=0.0):
    b, n_q, h, _ = q.shape
    return _new((b, n_q, h, v.shape[3]), torch.bfloat16, q), _new((b, n_q, h), torch.float32, q)


@checked
def flash_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool = False, scale: Optional[float] = None, *,
                    window_size: tuple[int, int] = (-1, -1), softcap: Optional[float] = None,
                    q_descale: Optional[Tensor] = None, k_descale: Optional[Tensor] = None,
                    v_descale: Optional[Tensor] = None) -> Tensor:
    """softmax(scale * q k^T) v; q (batch, n_q, heads, d), k (batch, n_k, kv_heads, d), v (batch, n_k, kv_heads,
    d_v) with d_v <= d (e.g. DeepSeek-V3's 192 / 128, forward and backward), GQA allowed.

    causal=False (the default, as flash-attn's flash_attn_func, torch's scaled_dot_product_attention and
    pykern.ops.flash_attention; it was True before) attends to every key; causal=True aligns the mask
    bottom-right (query i sees keys j <= i + n_k - n_q), as in a KV-cached decode step. window_size=(left, right) is flash-attn's sliding window
    (-1 = unbounded on that side; query i' = i + n_k - n_q sees keys i' - left <= j <= i' + right;
    causal sets right to 0): transformers' sliding_window=W is window_size=(W - 1, 0) with causal.
    softcap=c > 0 (Gemma 2 / 3's attn_logit_softcapping) turns the scores into c * tanh(scores / c)
    before the mask and the softmax. The forward saves out and the log-sum-exp; the backward is
    pykern's flash attention backward with the same window and softcap.

    FP8 (forward only): q, k, v torch.float8_e4m3fn with q_descale / k_descale / v_descale (None = 1, or float32
    tensors of shape () / (1,) or (batch, kv_heads) on q's device), as FlashAttention-3's flash_attn_func; out is
    bfloat16 (pykern.ops.flash_attention's FP8 path; window_size and softcap as above). There is no FP8 backward:
    a call that would record gradients (grad mode on and any of q, k, v requiring grad) raises ArgumentError.
    """
    if q.dim() != 4:
        raise ArgumentError(f"q: expected (batch, seq, heads, head_dim), got shape {tuple(q.shape)}")
    wl, wr = check_window_size(window_size)
    cap = 0.0 if softcap is None else check_softcap(softcap)
    if q.dtype == torch.float8_e4m3fn or any(x is not None for x in (q_descale, k_descale, v_descale)):
        if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
            raise ArgumentError("q, k, v: FP8 attention is forward only (no FP8 backward); got a tensor with "
                                "requires_grad=True: run it under torch.no_grad() or detach q, k and v")
        if scale is None:
            scale = 1.0 / math.sqrt(q.shape[-1])
        out, _ = _flash_attention_fp8.fast(q, k, v, q_descale, k_descale, v_descale, bool(causal), float(scale),
                                           wl, wr, cap)
        return out
    if _dt.active(q, k, v):
        # Sharded on heads: exact when each rank holds whole GQA groups (both head counts divide
        # evenly, so local query head i still maps to local kv head i // group). Batch rows are free.
        def heads_ok(n: dict[int, int]) -> bool:
            return set(n) <= {0, 2} and (2 not in n or (q.shape[2] % n[2] == 0 and k.shape[2] % n[2] == 0))

        return _dt.run("flash_attention",
                       lambda q, k, v: flash_attention(q, k, v, causal, scale, window_size=(wl, wr), softcap=cap),
                       (q, k, v), ("data", "data", "data"), local_ok=heads_ok,
                       out_shapes=lambda a: ((*a[0].shape[:3], a[2].shape[3]),))
    amp = _amp.autocast_dtype(q)
    if amp is not None:  # scaled_dot_product_attention is on torch's lower-precision list
        return _amp.run(lambda q, k, v: flash_attention(q, k, v, causal, scale, window_size=(wl, wr), softcap=cap),
                        (q, k, v), amp, amp, kernel_dtypes=_amp.ATTENTION_DTYPES)
    if scale is None:
        if q.dim() != 4 or q.shape[-1] < 1:
            raise ArgumentError(f"q: expected (batch, n_q, heads, head_dim) with head_dim >= 1, got shape "
                                f"{tuple(q.shape)}")
        scale = 1.0 / math.sqrt(q.shape[-1])
    out, _ = _flash_attention.fast(q, k, v, bool(causal), float(scale), wl, wr, cap)
    return out


# --------------------------------------------------------------------------- flash_attention_varlen


@_fast.custom_op("flash_attention_varlen")
def _flash_attention_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                            max_seqlen_q: int, max_seqlen_k: int, causal: bool, scale: float, window_left: int = -1,
                            window_right: int = -1, softcap: float = 0.0) -> tuple[Tensor, Tensor]:
    # max_seqlen_q / _k are inputs for the backward (its grid); the forward reads the lengths from cu_seqlens
    out, lse = call("flash_attention_varlen", _c(q), _c(k), _c(v), cu_seqlens_q, cu_seqlens_k, causal=causal,
                    scale=scale, window_size=(window_left, window_right), softcap=softcap, return_lse=True)
    return out, lse


@_flash_attention_varlen.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, window_left=-1,
      window_right=-1, softcap=0.0):
    total_q, h, _ = q.shape
    return _new((total_q, h, v.shape[2]), q.dtype, q), _new((total_q, h), torch.float32, q)


@_fast.custom_op("flash_attention_varlen_backward")
def _flash_attention_varlen_backward(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, grad_out: Tensor,
                                     cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
                                     max_seqlen_k: int, causal: bool, scale: float, window_left: int = -1,
                                     window_right: int = -1, softcap: float = 0.0,
                                     deterministic: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    dq, dk, dv = call("flash_attention_varlen_backward", _c(q), _c(k), _c(v), _c(grad_out), cu_seqlens_q,
                      cu_seqlens_k, out=_c(out), lse=_c(lse), max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                      causal=causal, scale=scale, window_size=(window_left, window_right), softcap=softcap,
                      deterministic=deterministic)
    return dq, dk, dv


@_flash_attention_varlen_backward.register_fake
def _(q, k, v, out, lse, grad_out, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale,
      window_left=-1, window_right=-1, softcap=0.0, deterministic=False):
    return _new(q.shape, q.dtype, q), _new(k.shape, k.dtype, k), _new(v.shape, v.dtype, v)


def _fav_setup(ctx, inputs, output):
    q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, wl, wr, cap = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
    ctx.max_seqlen, ctx.causal, ctx.scale, ctx.window, ctx.softcap = (max_q, max_k), causal, scale, (wl, wr), cap
    ctx.mark_non_differentiable(lse)


def _fav_bwd(ctx, grad_out, grad_lse):
    q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
    # torch.use_deterministic_algorithms(True): dQ summed in a fixed order (bit-identical run to run)
    dq, dk, dv = _flash_attention_varlen_backward.fast(q, k, v, out, lse, grad_out, cu_q, cu_k, ctx.max_seqlen[0],
                                                       ctx.max_seqlen[1], ctx.causal, ctx.scale, ctx.window[0],
                                                       ctx.window[1], ctx.softcap,
                                                       torch.are_deterministic_algorithms_enabled())
    return dq, dk, dv, None, None, None, None, None, None, None, None, None


_fast.register_autograd(_flash_attention_varlen, _fav_bwd, _fav_setup)


@_fast.custom_op("flash_attention_varlen_fp8")
def _flash_attention_varlen_fp8(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                                q_descale: Optional[Tensor], k_descale: Optional[Tensor], v_descale: Optional[Tensor],
                                causal: bool, scale: float, window_left: int = -1, window_right: int = -1,
                                softcap: float = 0.0) -> tuple[Tensor, Tensor]:
    out, lse = call("flash_attention_varlen", _c(q), _c(k), _c(v), cu_seqlens_q, cu_seqlens_k, causal=causal,
                    scale=scale, window_size=(window_left, window_right), softcap=softcap, return_lse=True,
                    q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)
    return out, lse


@_flash_attention_varlen_fp8.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, q_descale, k_descale, v_descale, causal, scale, window_left=-1,
      window_right=-1, softcap=0.0):
    total_q, h, _ = q.shape
    return _new((total_q, h, v.shape[2]), torch.bfloat16, q), _new((total_q, h), torch.float32, q)


@checked
def flash_attention_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                           max_seqlen_q: int, max_seqlen_k: int, dropout_p: float = 0.0,
                           softmax_scale: Optional[float] = None, causal: bool = False,
                           window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                           return_lse: bool = False, *, q_descale: Optional[Tensor] = None,
                           k_descale: Optional[Tensor] = None, v_descale: Optional[Tensor] = None):
    """flash-attn's flash_attn_varlen_func: attention over sequences packed without padding, with autograd.

    q (total_q, heads, d), k (total_k, kv_heads, d), v (total_k, kv_heads, d_v) with d_v <= d (GQA: heads %
    kv_heads == 0), bfloat16 or float16 (float32 too: the forward's fp32 kernel and the fp32-FMA varlen backward,
    which, as the 16-bit one, reads cu_seqlens on the device: CPU or CUDA cu_seqlens alike);
    cu_seqlens_q / cu_seqlens_k int32 (batch + 1,) on q's device: sequence b is q rows
    cu_seqlens_q[b]:cu_seqlens_q[b+1] against k / v rows cu_seqlens_k[b]:cu_seqlens_k[b+1]. max_seqlen_q /
    max_seqlen_k: the longest sequence of each (they size the backward's grid; host cu_seqlens are checked
    against them, device ones are not read back). dropout_p: only 0.0 (no dropout kernels). softmax_scale
    defaults to 1/sqrt(d). causal aligns the mask bottom-right per sequence; window_size=(left, right) and
    softcap as flash_attention. Returns out (total_q, heads, d_v), or (out, lse) with return_lse=True: lse
    (heads, total_q) float32, natural-log, flash-attn's layout (not differentiable).
    Forward pykern.ops.flash_attention_varlen, backward pykern.ops.flash_attention_varlen_backward, both with
    d_v < d as well (e.g. DeepSeek-V3's prefill, 192 / 128: the sm_90a kernels' own shape on Hopper; elsewhere the
    backward runs on v and grad_out padded with zero columns to d).

    FP8 (forward only, FlashAttention-3's flash_attn_varlen_func(q_descale=...)): q, k, v torch.float8_e4m3fn with
    q_descale / k_descale / v_descale (None = 1, or float32 tensors of shape () / (1,) or (batch, kv_heads) on q's
    device); out is bfloat16 (pykern.ops.flash_attention_varlen's FP8 path). A call that would record gradients
    (grad mode on and any of q, k, v requiring grad) raises ArgumentError.
    """
    from ..ops._prefill import check_cu_seqlens, check_max_seqlen

    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or dropout_p != 0.0:
        raise ArgumentError(f"dropout_p: expected 0.0 (pykern has no attention dropout), got {dropout_p!r}")
    fp8 = q.dtype == torch.float8_e4m3fn or any(x is not None for x in (q_descale, k_descale, v_descale))
    if fp8 and torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise ArgumentError("q, k, v: FP8 attention is forward only (no FP8 backward); got a tensor with "
                            "requires_grad=True: run it under torch.no_grad() or detach q, k and v")
    if not fp8 and q.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ArgumentTypeError(f"q: expected dtype bfloat16 or float16 (flash-attn's varlen dtypes) or float32, got "
                                f"{q.dtype}")
    if q.dim() != 3 or k.dim() != 3:
        bad = ("q", q) if q.dim() != 3 else ("k", k)
        raise ArgumentError(f"{bad[0]}: expected (total, heads, head_dim), got shape {tuple(bad[1].shape)}")
    wl, wr = check_window_size(window_size)
    cap = check_softcap(softcap)
    # Checked here, before the forward: a bad cu_seqlens_k would otherwise surface only in the backward. Under
    # torch.compile the values are not traced (a host read); the custom ops' own checks run when the graph does.
    hq = hk = None
    if not torch.compiler.is_compiling():
        _, hq = check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, None, "", q.shape[0], "total_q")
        _, hk = check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, cu_seqlens_q.shape[0], "the length of cu_seqlens_q",
                                 k.shape[0], "total_k")
    max_q = check_max_seqlen("max_seqlen_q", max_seqlen_q, hq, "cu_seqlens_q")
    max_k = check_max_seqlen("max_seqlen_k", max_seqlen_k, hk, "cu_seqlens_k")
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(q.shape[-1]) if q.shape[-1] else 1.0
    if fp8:  # the op checks the dtypes and descales, naming them
        out, lse = _flash_attention_varlen_fp8.fast(q, k, v, cu_seqlens_q, cu_seqlens_k, q_descale, k_descale,
                                                    v_descale, bool(causal), float(softmax_scale), wl, wr, cap)
        return (out, lse.t().contiguous()) if return_lse else out
    out, lse = _flash_attention_varlen.fast(q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k, bool(causal),
                                            float(softmax_scale), wl, wr, cap)
    return (out, lse.t().contiguous()) if return_lse else out


# --------------------------------------------------------------------------- cross_entropy

_REDUCTIONS = ("mean", "sum", "none")


@_fast.custom_op("cross_entropy")
def _cross_entropy(logits: Tensor, targets: Tensor, ignore_index: int, reduction: str, label_smoothing: float = 0.0,
                   z_loss: float = 0.0, softcap: float = 0.0,
                   weight: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    # One kernel pass gives the loss of the chosen reduction (fp32, the loss's dtype
    # here), its gradient and the z-loss part of the loss; "none" gives per-row losses (0 on ignored rows).
    loss, grad, zl = call("cross_entropy_fwd_bwd", _c(logits), _c(targets), ignore_index=ignore_index,
                          label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap if softcap > 0 else None,
                          reduction=reduction, weight=weight, return_z_loss=True)
    if reduction == "mean":
        # torch returns NaN for a batch with no valid row (0 / 0; with class weights: a zero sum of the
        # targets' weights); the kernel returns 0. The count stays on the device: no host synchronisation.
        live = targets != ignore_index
        if weight is None:
            den = live.sum()
        else:
            den = torch.where(live, weight.float()[targets.clamp(0, logits.shape[-1] - 1)], 0.0).sum()
        loss = torch.where(den != 0, loss, torch.full_like(loss, math.nan))
    return loss, grad, zl


@_cross_entropy.register_fake
def _(logits, targets, ignore_index, reduction, label_smoothing=0.0, z_loss=0.0, softcap=0.0, weight=None):
    shape = tuple(targets.shape) if reduction == "none" else ()
    return (_new(shape, torch.float32, logits), _new(logits.shape, logits.dtype, logits),
            _new(shape, torch.float32, logits))


def _ce_setup(ctx, inputs, output):
    ctx.reduction = inputs[3]
    ctx.save_for_backward(output[1])
    ctx.mark_non_differentiable(output[1], output[2])


def _ce_bwd(ctx, grad_loss, grad_grad, grad_z):
    # grad_z is dropped: the z-loss output is for logging (its gradient is in the loss's), as in Liger
    (g,) = ctx.saved_tensors
    scale = grad_loss.unsqueeze(-1) if ctx.reduction == "none" else grad_loss
    return (g * scale).to(g.dtype), None, None, None, None, None, None, None


_fast.register_autograd(_cross_entropy, _ce_bwd, _ce_setup)


def _check_ce_args(logits: Tensor, targets: Tensor, reduction: str, label_smoothing: float, z_loss: float,
                   softcap: Optional[float], weight: Optional[Tensor] = None) -> tuple[float, float, float]:
    from ..ops.training import check_ce_options

    eps, zl, cap = check_ce_options(label_smoothing, z_loss, softcap, reduction)
    if logits.dim() != 2:
        raise ArgumentError(f"logits: expected (N, vocab); reshape to 2-D first, got shape {tuple(logits.shape)}")
    if targets.shape != logits.shape[:1]:
        raise ArgumentError(f"targets: expected shape ({logits.shape[0]},) (the rows of logits), got "
                            f"{tuple(targets.shape)}")
    if targets.dtype.is_floating_point or targets.dtype == torch.bool:
        raise ArgumentTypeError(f"targets: expected an integer tensor, got {targets.dtype}")
    if weight is not None:
        if not isinstance(weight, Tensor) or not weight.is_floating_point():
            raise ArgumentTypeError(f"weight: expected a floating tensor of class weights, got {weight!r}")
        if tuple(weight.shape) != (logits.shape[1],):
            raise ArgumentError(f"weight: expected shape ({logits.shape[1]},) (vocab,), got {tuple(weight.shape)}")
    return eps, zl, cap


@checked
def cross_entropy(logits: Tensor, targets: Tensor, ignore_index: int = -100, reduction: str = "mean", *,
                  label_smoothing: float = 0.0, z_loss: float = 0.0, softcap: Optional[float] = None,
                  weight: Optional[Tensor] = None, lse_square_scale: Optional[float] = None,
                  return_z_loss: bool = False):
    """torch.nn.functional.cross_entropy(logits, targets, weight=, ignore_index=, reduction=,
    label_smoothing=) on pykern's fused kernel, plus z_loss (z_loss * logsumexp**2 per non-ignored
    row; Liger-Kernel's name lse_square_scale is accepted too) and softcap (logits -> softcap *
    tanh(logits / softcap) first, Gemma-style).

    logits (N, vocab) float32, bfloat16 or float16, targets (N,) integers, weight (vocab,) class
    weights or None. As torch: with weights a row's loss is w[t] * (1 - eps) * nll + eps / V *
    sum_c w[c] * (-log p_c), and "mean" divides by the sum of w[t] over non-ignored rows. The
    z-loss is never weighted and its "mean" divides by the non-ignored count (Liger's definition).
    "none" gives per-row losses whose gradients take any per-row upstream gradient. The loss has
    logits' dtype, like torch's; "mean" of a batch with every row ignored is NaN, as in torch.
    return_z_loss=True returns (loss, z_loss), the z-loss part of the loss for logging (its
    gradient flows through loss only), as LigerCrossEntropyLoss does. Loss and gradient come
    from one kernel pass for every reduction.
    """
    loss, zl = _cross_entropy_f32(logits, targets, ignore_index, reduction, label_smoothing, z_loss, softcap,
                                  weight, lse_square_scale)
    if not (_amp.autocast_dtype(logits) is not None or logits.dtype == torch.float32):
        # cross_entropy is on torch's float32 autocast list: a float32 loss under autocast
        loss, zl = loss.to(logits.dtype), zl.to(logits.dtype)
    return (loss, zl) if return_z_loss else loss


def cross_entropy_f32(logits: Tensor, targets: Tensor, ignore_index: int = -100, reduction: str = "mean", *,
                      label_smoothing: float = 0.0, z_loss: float = 0.0,
                      softcap: Optional[float] = None, weight: Optional[Tensor] = None,
                      lse_square_scale: Optional[float] = None) -> Tensor:
    """cross_entropy with the loss kept in float32 whatever the logits' dtype (the kernel's own precision)."""
    return _cross_entropy_f32(logits, targets, ignore_index, reduction, label_smoothing, z_loss, softcap, weight,
                              lse_square_scale)[0]


def _cross_entropy_f32(logits, targets, ignore_index, reduction, label_smoothing, z_loss, softcap, weight,
                       lse_square_scale) -> tuple[Tensor, Tensor]:
    from ..ops.training import ce_z_loss

    z_loss = ce_z_loss(z_loss, lse_square_scale)
    if _dt.active(logits, targets, weight):  # a mean over rows / a logsumexp over the vocab: needs everything
        fn = lambda lg, t, w: _cross_entropy_f32(lg, t, ignore_index, reduction, label_smoothing,  # noqa: E731
                                                 z_loss, softcap, w, None)
        return _dt.run("cross_entropy", fn, (logits, targets, weight), ("data", "data", "param"),
                       local_ok=_dt.never)
    if _amp.autocast_dtype(logits) is not None and logits.dtype not in _amp.KERNEL_DTYPES:
        # float32 autocast policy; bf16 logits go in as they are (the kernel widens them exactly)
        return _amp.run(lambda lg: _cross_entropy_f32(lg, targets, ignore_index, reduction, label_smoothing,
                                                      z_loss, softcap, weight, None),
                        (logits,), torch.float32, (torch.float32, torch.float32))
    eps, zl, cap = _check_ce_args(logits, targets, reduction, label_smoothing, z_loss, softcap, weight)
    loss, _, zpart = _cross_entropy.fast(logits, targets, int(ignore_index), reduction, eps, zl, cap,
                                                    None if weight is None else weight.detach())
    return loss, zpart


# --------------------------------------------------------------------------- embedding


@_fast.custom_op("embedding")
def _embedding(ids: Tensor, table: Tensor) -> Tensor:
    out = call("embedding", _c(ids.reshape(-1)), _c(table))
    return out.view(*ids.shape, table.shape[1])


@_embedding.register_fake
def _(ids, table):
    return _new((*ids.shape, table.shape[1]), table.dtype, table)


@_fast.custom_op("embedding_backward")
def _embedding_backward(grad_out: Tensor, ids: Tensor, vocab_size: int) -> Tensor:
    return call("embedding_backward", _c(grad_out), _c(ids), vocab_size)


@_embedding_backward.register_fake
def _(grad_out, ids, vocab_size):
    return _new((vocab_size, grad_out.shape[-1]), torch.float32, grad_out)


def _emb_setup(ctx, inputs, output):
    ids, table = inputs
    ctx.save_for_backward(ids)
    ctx.vocab, ctx.dtype = table.shape[0], table.dtype


def _emb_bwd(ctx, grad):
    (ids,) = ctx.saved_tensors
    g = _embedding_backward.fast(grad, ids, ctx.vocab)
    return None, g.to(ctx.dtype)


_fast.register_autograd(_embedding, _emb_bwd, _emb_setup)


@checked
def embedding(ids: Tensor, table: Tensor) -> Tensor:
    """table[ids] for integer ids of any shape; the table's gradient sums the rows of each id."""
    if _dt.active(ids, table):  # a vocab-sharded table needs masking and a sum: gathered instead
        return _dt.run("embedding", embedding, (ids, table), ("data", "param"), local_ok=_dt.never)
    if table.dim() != 2:
        raise ArgumentError(f"table: expected (vocab, dim), got shape {tuple(table.shape)}")
    if ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ArgumentTypeError(f"ids: expected an integer tensor, got {ids.dtype}")
    return _embedding.fast(ids.to(torch.int64), table)
