"""The bad-input fuzzer's spec table: per public op, the role of each parameter, one valid call and the
float64 reference (tests/fuzz_engine.py explains the roles and the oracle).

Shapes are tiny: each host call should take milliseconds once the kernels are built."""
from __future__ import annotations

from typing import Any

import numpy as np

from pykern import ops
from pykern.errors import ArgumentError, ArgumentTypeError
from pykern.difftest.cases.forward import (np_causal_attn_softmax, np_embedding, np_qk_norm_rope,
                                           np_qk_norm_rope_backward, np_rms_norm, np_rope, np_silu_gate,
                                           np_silu_gate_backward)
from pykern.difftest.cases.gemm_fp8 import (_act, fp8_weight, np_fp8_quantize, np_gemm_fp8,
                                            np_grouped_gemm_fp8)
from pykern.difftest.cases.moe import np_grouped_gemm, np_moe_experts, np_moe_experts_backward, np_moe_route
from pykern.difftest.cases.sampling import (np_sample, np_sample_logits, np_softmax, np_top_k_mask, np_top_k_renorm,
                                            np_top_p_renorm)
from pykern.difftest.cases.training import (np_cross_entropy, np_embedding_backward,
                                            np_rms_norm_backward, np_softmax_backward, np_transpose_2d)
from pykern.difftest.cases.norm_act_loss import (np_add_rms_norm, np_add_rms_norm_backward, np_gelu, np_gelu_grad,
                                                np_layer_norm, np_layer_norm_backward)

from fuzz_engine import BOOL, ENUM, FARRAY, FIXED, FLOAT, IARRAY, INT, LENGTH, OUT, PROB, PTABLE, Spec, compare

HOST = {"backend": "host", "stream": None}
COMMON = {"stream": FIXED, "backend": FIXED}


def f32(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def probs(rng: np.random.Generator, b: int, v: int) -> np.ndarray:
    p = rng.random((b, v)).astype(np.float32) + np.float32(0.05)
    return (p / p.sum(-1, keepdims=True)).astype(np.float32)


def arr(a: Any) -> np.ndarray:
    return np.asarray(a)


def i64(a: Any) -> np.ndarray:
    """An integer index array of the reference's; anything else is the reference's error."""
    a = np.asarray(a)
    if a.dtype.kind not in "iu":
        raise TypeError(f"not integers: {a.dtype}")
    return a.astype(np.int64)


def need(cond: bool, what: str) -> None:
    """A reference-side precondition: the op accepted an input its contract does not define."""
    if not cond:
        raise ValueError(what)


def fdata(a: Any) -> np.ndarray:
    """A float array of the reference's: float16 / bfloat16 / float32 data (what the ops document)."""
    a = np.asarray(a)
    need(a.dtype.name in ("float32", "bfloat16", "float16"), f"dtype {a.dtype} is not an I/O dtype")
    return a.astype(np.float64)


def real(x: Any) -> float:
    need(isinstance(x, (int, float, np.floating, np.integer)) and not isinstance(x, bool), f"{x!r} is no number")
    return float(x)


def natural(x: Any) -> int:
    need(isinstance(x, (int, np.integer)) and not isinstance(x, bool) and x >= 0, f"{x!r} is no size")
    return int(x)


def flag(x: Any) -> bool:
    """Flags are read by their truth value, as NumPy and torch read theirs (documented in docs/fuzzing.md)."""
    return bool(x)


def choice(x: Any, allowed: tuple[str, ...]) -> str:
    need(isinstance(x, str) and x in allowed, f"{x!r} not in {allowed}")
    return x


SPECS: dict[str, Spec] = {}


def spec(s: Spec) -> Spec:
    SPECS[s.name] = s
    return s


# --------------------------------------------------------------------------- training
spec(Spec("transpose_2d", ops.transpose_2d, lambda r: dict(x=f32(r, 3, 5), **HOST), {"x": FARRAY, **COMMON},
          ref=lambda k: np_transpose_2d(fdata(k["x"])), kind_of="x"))
spec(Spec("softmax_backward", ops.softmax_backward,
          lambda r: dict(probs=probs(r, 3, 6), grad_out=f32(r, 3, 6), **HOST),
          {"probs": FARRAY, "grad_out": FARRAY, **COMMON},
          ref=lambda k: (need(fdata(k["probs"]).shape == fdata(k["grad_out"]).shape, "shapes"),
                         np_softmax_backward(fdata(k["probs"]), fdata(k["grad_out"])))[1], kind_of="probs"))


def _rmsb_ref(k: dict) -> Any:
    x, w, g = fdata(k["x"]), fdata(k["weight"]), fdata(k["grad_out"])
    need(x.shape == g.shape and w.shape == x.shape[-1:], "shapes")
    return np_rms_norm_backward(x, w, g, real(k["eps"]), real(k["offset"]))


spec(Spec("rms_norm_backward", ops.rms_norm_backward,
          lambda r: dict(x=f32(r, 3, 8), weight=f32(r, 8), grad_out=f32(r, 3, 8), eps=1e-6, offset=0.0, **HOST),
          {"x": FARRAY, "weight": FARRAY, "grad_out": FARRAY, "eps": FLOAT, "offset": FLOAT, **COMMON},
          ref=_rmsb_ref, kind_of="x"))


def _embb_ref(k: dict) -> Any:
    g, ids, v = fdata(k["grad_out"]), i64(k["ids"]), natural(k["vocab_size"])
    need(g.shape[:-1] == ids.shape and ((ids >= 0) & (ids < v)).all(), "ids")
    if g.shape[-1] == 0:  # (np_embedding_backward reshapes by dim, which 0 cannot do)
        return np.zeros((v, 0))
    return np_embedding_backward(g, ids, v)


spec(Spec("embedding_backward", ops.embedding_backward,
          lambda r: dict(grad_out=f32(r, 5, 4), ids=r.integers(0, 7, 5).astype(np.int64), vocab_size=7, **HOST),
          {"grad_out": FARRAY, "ids": IARRAY, "vocab_size": LENGTH, **COMMON}, ref=_embb_ref, kind_of="grad_out"))


def _ce_ref(k: dict) -> Any:
    if k.get("lse_square_scale") is not None:  # Liger's name for z_loss
        k = dict(k, z_loss=k["lse_square_scale"])
    x, t = fdata(k["logits"]), i64(k["targets"])
    need(x.shape[:-1] == t.shape and x.ndim >= 1, "shapes")
    pad = int(k["pad_id"] if k.get("ignore_index") is None else k["ignore_index"])
    need(((t == pad) | ((t >= 0) & (t < x.shape[-1]))).all(), "targets")
    red = choice(k["reduction"], ("mean", "sum", "none"))
    ls, z = real(k["label_smoothing"]), real(k["z_loss"])
    need(0 <= ls <= 1 and z >= 0 and np.isfinite(z), "options")
    sc = k.get("softcap")
    need(sc is None or real(sc) > 0 and np.isfinite(sc), "softcap")
    w = None if k.get("weight") is None else fdata(k["weight"])
    need(w is None or w.shape == (x.shape[-1],), "weight")
    return np_cross_entropy(x, t, pad, label_smoothing=ls, z_loss=z, softcap=sc, reduction=red, weight=w,
                            return_z_loss=flag(k.get("return_z_loss", False)))


spec(Spec("cross_entropy_fwd_bwd", ops.cross_entropy_fwd_bwd,
          lambda r: dict(logits=f32(r, 4, 9), targets=np.array([1, -100, 8, 0]), pad_id=-100, label_smoothing=0.1,
                         z_loss=0.0, softcap=None, reduction="mean", inplace=False, weight=None, grad_output=None,
                         return_z_loss=False, lse_square_scale=None, ignore_index=None, **HOST),
          {"logits": FARRAY, "targets": IARRAY, "pad_id": INT, "label_smoothing": PROB, "z_loss": FLOAT,
           "softcap": FLOAT, "reduction": ENUM, "inplace": BOOL, "weight": FARRAY, "grad_output": FARRAY,
           "return_z_loss": BOOL, "lse_square_scale": FLOAT, "ignore_index": INT, "_scale": FIXED, **COMMON},
          ref=_ce_ref, kind_of="logits",
          writes=lambda k: ("logits",) if k.get("inplace") else ()))


def nan_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray | None, causal: bool,
                  scale: float | None, window: tuple[int, int], softcap: float) -> tuple:
    """float64 attention of one sequence, q (n_q, H, D), k / v (n_k, KVH, D), bottom-right masks, and with
    grad_out g its (dq, dk, dv). Written for NaN: a NaN or inf score poisons its row as the math says
    (pykern.difftest's references guard the division and turn such rows into 0). Masked keys contribute
    exactly nothing; a row that sees no key gives out 0, lse -inf and no gradient."""
    from pykern.difftest.cases.attention import window_mask

    n_q, h, d = q.shape
    group = h // k.shape[1]
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    vis = window_mask(n_q, k.shape[0], causal, window)
    out, lse = np.zeros((n_q, h, v.shape[2])), np.full((n_q, h), -np.inf)
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    with np.errstate(all="ignore"):
        for hh in range(h):
            kk, vv = k[:, hh // group], v[:, hh // group]
            raw = q[:, hh] @ kk.T * scale
            t = np.tanh(raw / softcap) if softcap > 0 else None
            s = np.where(vis, softcap * t if softcap > 0 else raw, -np.inf)
            m = s.max(-1, keepdims=True) if s.shape[1] else np.full((n_q, 1), -np.inf)
            p = np.where(vis, np.exp(s - np.where(m == -np.inf, 0.0, m)), 0.0)
            den = p.sum(-1, keepdims=True)
            pn = np.where(den == 0, 0.0, p / np.where(den == 0, 1.0, den))
            out[:, hh] = pn @ vv
            lse[:, hh] = np.where(den[:, 0] == 0, -np.inf, m[:, 0] + np.log(den[:, 0]))
            if g is not None:
                go = g[:, hh]
                dp = go @ vv.T
                ds = np.where(vis, pn * (dp - (pn * dp).sum(-1, keepdims=True)), 0.0)
                if softcap > 0:
                    ds = np.where(vis, ds * (1.0 - t * t), 0.0)
                dv[:, hh // group] += pn.T @ go
                dq[:, hh] = ds @ kk * scale
                dk[:, hh // group] += ds.T @ q[:, hh] * scale
    return (dq, dk, dv) if g is not None else (out, lse)


def _na(q: np.ndarray, k: np.ndarray, v: np.ndarray, causal: bool, scale: float | None, window: tuple[int, int],
        softcap: float) -> tuple:
    """(out, lse) of nan_attention: the serving references' signature."""
    return nan_attention(q, k, v, None, causal, scale, window, softcap)


def _attb_ref(k: dict) -> Any:
    q, kk, v, g = (fdata(k[n]) for n in ("q", "k", "v", "grad_out"))
    need(q.shape == g.shape and kk.shape == v.shape and q.ndim == 3 and kk.ndim == 3, "shapes")
    need(q.shape[2] == kk.shape[2] and kk.shape[1] > 0 and q.shape[1] % kk.shape[1] == 0, "heads")
    ws = tuple(k["window_size"])
    need(len(ws) == 2 and all(isinstance(w, (int, np.integer)) and w >= -1 for w in ws), "window")
    ws = tuple(int(w) for w in ws)
    sc = k.get("scale")
    return nan_attention(q, kk, v, g, flag(k["causal"]), None if sc is None else real(sc), ws, real(k["softcap"]))


spec(Spec("attention_backward", ops.attention_backward,
          lambda r: dict(q=f32(r, 3, 2, 8), k=f32(r, 4, 1, 8), v=f32(r, 4, 1, 8), grad_out=f32(r, 3, 2, 8),
                         out=None, lse=None, scale=None, causal=True, window_size=(-1, -1), softcap=0.0,
                         method="auto", deterministic=False, **HOST),
          {"q": FARRAY, "k": FARRAY, "v": FARRAY, "grad_out": FARRAY, "out": FARRAY, "lse": FARRAY,
           "scale": FLOAT, "causal": BOOL, "window_size": INT, "softcap": FLOAT, "method": ENUM,
           "deterministic": BOOL, **COMMON},
          ref=_attb_ref, kind_of="q", writes=lambda k: (), examples=0.5))

# --------------------------------------------------------------------------- norm_act_loss


def _arn_ref(k: dict) -> Any:
    x, r_, w = fdata(k["x"]), fdata(k["residual"]), fdata(k["weight"])
    need(x.shape == r_.shape and w.shape == x.shape[-1:], "shapes")
    return np_add_rms_norm(x, r_, w, real(k["eps"]), real(k["offset"]))


spec(Spec("add_rms_norm", ops.add_rms_norm,
          lambda r: dict(x=f32(r, 3, 8), residual=f32(r, 3, 8), weight=f32(r, 8), eps=1e-6, offset=0.0,
                         inplace=False, **HOST),
          {"x": FARRAY, "residual": FARRAY, "weight": FARRAY, "eps": FLOAT, "offset": FLOAT, "inplace": BOOL,
           **COMMON}, ref=_arn_ref, kind_of="x",
          writes=lambda k: ("x", "residual") if k.get("inplace") else ()))


def _arnb_ref(k: dict) -> Any:
    h, w, g = fdata(k["new_residual"]), fdata(k["weight"]), fdata(k["grad_y"])
    gr = None if k.get("grad_new_residual") is None else fdata(k["grad_new_residual"])
    need(h.shape == g.shape and w.shape == h.shape[-1:] and (gr is None or gr.shape == h.shape), "shapes")
    return np_add_rms_norm_backward(h, w, g, gr, real(k["eps"]), real(k["offset"]))


spec(Spec("add_rms_norm_backward", ops.add_rms_norm_backward,
          lambda r: dict(new_residual=f32(r, 3, 8), weight=f32(r, 8), grad_y=f32(r, 3, 8),
                         grad_new_residual=f32(r, 3, 8), eps=1e-6, offset=0.0, **HOST),
          {"new_residual": FARRAY, "weight": FARRAY, "grad_y": FARRAY, "grad_new_residual": FARRAY, "eps": FLOAT,
           "offset": FLOAT, **COMMON}, ref=_arnb_ref, kind_of="new_residual"))


def _ln_ref(k: dict) -> Any:
    x = fdata(k["x"])
    w = None if k.get("weight") is None else fdata(k["weight"])
    b = None if k.get("bias") is None else fdata(k["bias"])
    need(all(a is None or a.shape == x.shape[-1:] for a in (w, b)), "shapes")
    return np_layer_norm(x, w, b, real(k["eps"]))


spec(Spec("layer_norm", ops.layer_norm,
          lambda r: dict(x=f32(r, 3, 8), weight=f32(r, 8), bias=f32(r, 8), eps=1e-5, **HOST),
          {"x": FARRAY, "weight": FARRAY, "bias": FARRAY, "eps": FLOAT, **COMMON}, ref=_ln_ref, kind_of="x"))


def _lnb_ref(k: dict) -> Any:
    x, g = fdata(k["x"]), fdata(k["grad_out"])
    w = None if k.get("weight") is None else fdata(k["weight"])
    need(x.shape == g.shape and (w is None or w.shape == x.shape[-1:]), "shapes")
    dx, dw, db = np_layer_norm_backward(x, w if w is not None else np.ones(x.shape[-1]), g, real(k["eps"]))
    return dx, (None if w is None else dw), (db if flag(k["bias"]) else None)


spec(Spec("layer_norm_backward", ops.layer_norm_backward,
          lambda r: dict(x=f32(r, 3, 8), weight=f32(r, 8), grad_out=f32(r, 3, 8), eps=1e-5, bias=True, **HOST),
          {"x": FARRAY, "weight": FARRAY, "grad_out": FARRAY, "eps": FLOAT, "bias": BOOL, **COMMON},
          ref=_lnb_ref, kind_of="x"))

GELU = ("none", "tanh")
spec(Spec("gelu", ops.gelu, lambda r: dict(x=f32(r, 3, 5), approximate="tanh", **HOST),
          {"x": FARRAY, "approximate": ENUM, **COMMON},
          ref=lambda k: np_gelu(fdata(k["x"]), choice(k["approximate"], GELU)), kind_of="x"))


def _gb_ref(k: dict) -> Any:
    x, g = fdata(k["x"]), fdata(k["grad_out"])
    need(x.shape == g.shape, "shapes")
    return g * np_gelu_grad(x, choice(k["approximate"], GELU))


spec(Spec("gelu_backward", ops.gelu_backward,
          lambda r: dict(x=f32(r, 3, 5), grad_out=f32(r, 3, 5), approximate="none", **HOST),
          {"x": FARRAY, "grad_out": FARRAY, "approximate": ENUM, **COMMON}, ref=_gb_ref, kind_of="x"))


def _gg_ref(k: dict) -> Any:
    g, u = fdata(k["gate"]), fdata(k["up"])
    need(g.shape == u.shape, "shapes")
    return np_gelu(g, choice(k["approximate"], GELU)) * u


spec(Spec("gelu_gate", ops.gelu_gate, lambda r: dict(gate=f32(r, 3, 5), up=f32(r, 3, 5), approximate="none", **HOST),
          {"gate": FARRAY, "up": FARRAY, "approximate": ENUM, **COMMON}, ref=_gg_ref, kind_of="gate"))


def _ggb_ref(k: dict) -> Any:
    g, u, d = fdata(k["gate"]), fdata(k["up"]), fdata(k["grad_out"])
    need(g.shape == u.shape == d.shape, "shapes")
    a = choice(k["approximate"], GELU)
    return d * u * np_gelu_grad(g, a), d * np_gelu(g, a)


spec(Spec("gelu_gate_backward", ops.gelu_gate_backward,
          lambda r: dict(gate=f32(r, 3, 5), up=f32(r, 3, 5), grad_out=f32(r, 3, 5), approximate="tanh", **HOST),
          {"gate": FARRAY, "up": FARRAY, "grad_out": FARRAY, "approximate": ENUM, **COMMON}, ref=_ggb_ref,
          kind_of="gate"))


def _flce_ref(k: dict) -> Any:
    if k.get("lse_square_scale") is not None:  # Liger's name for z_loss
        k = dict(k, z_loss=k["lse_square_scale"])
    h, w, t = fdata(k["hidden"]), fdata(k["weight"]), i64(k["targets"])
    b = None if k.get("bias") is None else fdata(k["bias"])
    need(h.ndim == 2 and w.ndim == 2 and h.shape[1] == w.shape[1] and t.shape == (h.shape[0],), "shapes")
    need(b is None or b.shape == (w.shape[0],), "bias")
    logits = h @ w.T + (0 if b is None else b)
    need(0 <= real(k["label_smoothing"]) <= 1 and 0 <= real(k["z_loss"]) < np.inf, "options")
    need(k.get("chunk_size") is None or natural(k["chunk_size"]) > 0, "chunk_size")
    need(((t == int(k["ignore_index"])) | ((t >= 0) & (t < w.shape[0]))).all(), "targets")
    loss, grad, zl = np_cross_entropy(logits, t, int(k["ignore_index"]), label_smoothing=real(k["label_smoothing"]),
                                      z_loss=real(k["z_loss"]), softcap=k.get("softcap"),
                                      reduction=choice(k["reduction"], ("mean", "sum", "none")), return_z_loss=True)
    res = (loss, grad @ w, grad.T @ h, (None if b is None else grad.sum(0)))
    return res + (zl,) if flag(k["return_z_loss"]) else res


spec(Spec("fused_linear_cross_entropy", ops.fused_linear_cross_entropy,
          lambda r: dict(hidden=f32(r, 4, 6), weight=f32(r, 9, 6), targets=np.array([2, 0, -100, 8]),
                         bias=f32(r, 9), ignore_index=-100, label_smoothing=0.0, z_loss=0.0, softcap=None,
                         reduction="sum", chunk_size=None, grad_dtype="float32", ce_weight=None, grad_output=None,
                         return_z_loss=False, lse_square_scale=None, **HOST),
          {"hidden": FARRAY, "weight": FARRAY, "targets": IARRAY, "bias": FARRAY, "ignore_index": INT,
           "label_smoothing": PROB, "z_loss": FLOAT, "softcap": FLOAT, "reduction": ENUM, "chunk_size": LENGTH,
           "grad_dtype": ENUM, "ce_weight": FARRAY, "grad_output": FARRAY, "return_z_loss": BOOL,
           "lse_square_scale": FLOAT, **COMMON}, ref=_flce_ref, kind_of="hidden"))

# --------------------------------------------------------------------------- forward


def _emb_ref(k: dict) -> Any:
    ids, t = i64(k["ids"]), fdata(k["table"])
    need(t.ndim == 2 and ids.ndim in (1, 2) and ((ids >= 0) & (ids < t.shape[0])).all(), "ids")
    return np_embedding(ids, t)


spec(Spec("embedding", ops.embedding,
          lambda r: dict(ids=r.integers(0, 6, 5).astype(np.int64), table=f32(r, 6, 4), out=None, **HOST),
          {"ids": IARRAY, "table": FARRAY, "out": OUT, **COMMON}, ref=_emb_ref, kind_of="table"))


def tables(a: Any) -> np.ndarray:
    """rope's tables: any float dtype (converted to fp32 by the op) is accepted."""
    a = np.asarray(a)
    need(a.dtype.kind == "f" or a.dtype.name == "bfloat16", f"tables of dtype {a.dtype}")
    return a.astype(np.float32).astype(np.float64)


def _rope_ref(k: dict) -> Any:
    x, c, s = fdata(k["x"]), tables(k["cos"]), tables(k["sin"])
    need(x.ndim in (3, 4) and c.shape == s.shape and c.ndim == 2 and c.shape[1] in (x.shape[-1] // 2, x.shape[-1])
         and x.shape[-1] % 2 == 0, "shapes")
    pos = k.get("position_ids")
    off = int(k["pos_offset"])
    need(off >= 0, "pos_offset")
    if pos is None:
        need(off + x.shape[-3] <= c.shape[0], "positions")
    else:
        pos = i64(pos)
        need(((pos >= 0) & (pos < c.shape[0])).all() and pos.shape[-1] == x.shape[-3], "positions")
    return np_rope(x, c, s, off, choice(k["style"], ("interleaved", "half")), position_ids=pos,
                   inverse=flag(k["inverse"]))


def _rope_build(r: np.random.Generator) -> dict:
    ang = r.random((6, 4))
    return dict(x=f32(r, 3, 2, 8), cos=np.cos(ang).astype(np.float32), sin=np.sin(ang).astype(np.float32),
                pos_offset=1, position_ids=None, style="interleaved", inverse=False, inplace=False, out=None, **HOST)


spec(Spec("rope", ops.rope, _rope_build,
          {"x": FARRAY, "cos": FARRAY, "sin": FARRAY, "pos_offset": INT, "position_ids": IARRAY, "style": ENUM,
           "inverse": BOOL, "inplace": BOOL, "out": OUT, **COMMON}, ref=_rope_ref, kind_of="x",
          writes=lambda k: ("out", "x") if k.get("inplace") else ("out",)))


def _rope_pos_build(r: np.random.Generator) -> dict:
    d = _rope_build(r)
    d.update(pos_offset=0, position_ids=r.integers(0, 6, 3).astype(np.int64))
    return d


spec(Spec("rope[position_ids]", ops.rope, _rope_pos_build, SPECS["rope"].roles, ref=_rope_ref, tol="rope",
          kind_of="x", writes=SPECS["rope"].writes))


def _qk_common(k: dict, names: tuple[str, ...]) -> tuple[list[np.ndarray], np.ndarray, np.ndarray, dict]:
    """The float64 q / k (and gradients), tables and np_rope keywords of a qk_norm_rope call, or the reference's
    error for a call the op's contract does not define."""
    xs = [fdata(k[n]) for n in names]
    q = xs[0]
    need(q.ndim in (3, 4) and q.shape[-1] % 2 == 0, "q")
    for x in xs[1:]:
        need(x.ndim == q.ndim and x.shape[:-2] == q.shape[:-2] and x.shape[-1] == q.shape[-1], "shapes")
    need(xs[2].shape == q.shape if len(xs) == 4 else True, "grad_q")
    need(xs[3].shape == xs[1].shape if len(xs) == 4 else True, "grad_k")
    c, s = tables(k["cos"]), tables(k["sin"])
    d = q.shape[-1]
    need(c.shape == s.shape and c.ndim == 2 and c.shape[1] in (d // 2, d), "tables")
    pos = k.get("position_ids")
    off = int(k["pos_offset"])
    need(off >= 0, "pos_offset")
    if pos is None:
        need(off + q.shape[-3] <= c.shape[0], "positions")
    else:
        pos = i64(pos)
        need(((pos >= 0) & (pos < c.shape[0])).all() and pos.shape[-1] == q.shape[-3], "positions")
    kw = dict(pos_offset=off, position_ids=pos, style=choice(k["style"], ("interleaved", "half")))
    return xs, c, s, kw


def _qk_weights(k: dict, d: int) -> tuple[Any, Any, float, float]:
    wq, wk = k["q_weight"], k["k_weight"]
    if wq is None and wk is None:
        return None, None, 0.0, 0.0
    need(wq is not None and wk is not None, "both weights")
    wq, wk = fdata(wq), fdata(wk)
    need(wq.shape == wk.shape == (d,), "weight shapes")
    eps = real(k["eps"])
    need(eps >= 0, "eps")
    return wq, wk, eps, real(k["weight_offset"])


def _qknr_ref(k: dict) -> Any:
    (q, kk), c, s, kw = _qk_common(k, ("q", "k"))
    wq, wk, eps, off = _qk_weights(k, q.shape[-1])
    inverse = flag(k["inverse"])
    need(not (inverse and wq is not None), "inverse with weights")
    if inverse:
        return np_rope(q, c, s, inverse=True, **kw), np_rope(kk, c, s, inverse=True, **kw)
    r = np_qk_norm_rope(q, kk, c, s, wq, wk, eps, off, **kw)
    return r["q_out"], r["k_out"]


def _qknr_build(r: np.random.Generator) -> dict:
    ang = r.random((6, 4))
    return dict(q=f32(r, 3, 2, 8), k=f32(r, 3, 1, 8), cos=np.cos(ang).astype(np.float32),
                sin=np.sin(ang).astype(np.float32), q_weight=f32(r, 8), k_weight=f32(r, 8), eps=1e-6,
                weight_offset=0.0, pos_offset=1, position_ids=None, style="half", inverse=False, inplace=False,
                q_out=None, k_out=None, **HOST)


spec(Spec("qk_norm_rope", ops.qk_norm_rope, _qknr_build,
          {"q": FARRAY, "k": FARRAY, "cos": FARRAY, "sin": FARRAY, "q_weight": FARRAY, "k_weight": FARRAY,
           "eps": FLOAT, "weight_offset": FLOAT, "pos_offset": INT, "position_ids": IARRAY, "style": ENUM,
           "inverse": BOOL, "inplace": BOOL, "q_out": OUT, "k_out": OUT, **COMMON}, ref=_qknr_ref, kind_of="q",
          writes=lambda k: ("q_out", "k_out", "q", "k") if k.get("inplace") else ("q_out", "k_out")))


def _qknr_plain_build(r: np.random.Generator) -> dict:
    d = _qknr_build(r)
    d.update(q_weight=None, k_weight=None, pos_offset=0, position_ids=r.integers(0, 6, 3).astype(np.int64),
             style="interleaved")
    return d


spec(Spec("qk_norm_rope[plain]", ops.qk_norm_rope, _qknr_plain_build, SPECS["qk_norm_rope"].roles, ref=_qknr_ref,
          tol="qk_norm_rope", kind_of="q", writes=SPECS["qk_norm_rope"].writes))


def _qknrb_ref(k: dict) -> Any:
    (q, kk, gq, gk), c, s, kw = _qk_common(k, ("q", "k", "grad_q", "grad_k"))
    wq, wk, eps, off = _qk_weights(k, q.shape[-1])
    need(wq is not None, "weights")
    r = np_qk_norm_rope_backward(q, kk, gq, gk, c, s, wq, wk, eps, off, **kw)
    return r["grad_q"], r["grad_k"], r["grad_q_weight"], r["grad_k_weight"]


spec(Spec("qk_norm_rope_backward", ops.qk_norm_rope_backward,
          lambda r: dict({k: v for k, v in _qknr_build(r).items() if k not in ("inverse", "inplace", "q_out", "k_out")},
                         grad_q=f32(r, 3, 2, 8), grad_k=f32(r, 3, 1, 8)),
          {"q": FARRAY, "k": FARRAY, "grad_q": FARRAY, "grad_k": FARRAY, "cos": FARRAY, "sin": FARRAY,
           "q_weight": FARRAY, "k_weight": FARRAY, "eps": FLOAT, "weight_offset": FLOAT, "pos_offset": INT,
           "position_ids": IARRAY, "style": ENUM, **COMMON}, ref=_qknrb_ref, kind_of="q"))


def _sg_ref(k: dict) -> Any:
    g, u = fdata(k["gate"]), fdata(k["up"])
    need(g.shape == u.shape, "shapes")
    return np_silu_gate(g, u)


spec(Spec("silu_gate", ops.silu_gate, lambda r: dict(gate=f32(r, 3, 5), up=f32(r, 3, 5), out=None, **HOST),
          {"gate": FARRAY, "up": FARRAY, "out": OUT, **COMMON}, ref=_sg_ref, kind_of="gate"))


def _sgb_ref(k: dict) -> Any:
    g, u, d = fdata(k["gate"]), fdata(k["up"]), fdata(k["grad_out"])
    need(g.shape == u.shape == d.shape, "shapes")
    return np_silu_gate_backward(g, u, d)


spec(Spec("silu_gate_backward", ops.silu_gate_backward,
          lambda r: dict(gate=f32(r, 3, 5), up=f32(r, 3, 5), grad_out=f32(r, 3, 5), **HOST),
          {"gate": FARRAY, "up": FARRAY, "grad_out": FARRAY, **COMMON}, ref=_sgb_ref, kind_of="gate"))


def _rms_ref(k: dict) -> Any:
    x, w = fdata(k["x"]), fdata(k["weight"])
    need(w.shape == x.shape[-1:] and x.ndim >= 1, "shapes")
    return np_rms_norm(x, w, real(k["eps"]), real(k["offset"]))


spec(Spec("rms_norm", ops.rms_norm,
          lambda r: dict(x=f32(r, 3, 8), weight=f32(r, 8), eps=1e-6, offset=0.0, out=None, **HOST),
          {"x": FARRAY, "weight": FARRAY, "eps": FLOAT, "offset": FLOAT, "out": OUT, **COMMON},
          ref=_rms_ref, kind_of="x"))


def _cas_ref(k: dict) -> Any:
    s = np.asarray(k["scores"])
    need(s.dtype == np.float32 and s.ndim == 3, "scores")
    p = k["past_len"]
    need(natural(p) >= 0, "past_len")
    if s.size == 0:  # (np_causal_attn_softmax reduces over the keys, which an empty array cannot)
        return s.astype(np.float64)
    return np_causal_attn_softmax(s, p)


spec(Spec("causal_attn_softmax", ops.causal_attn_softmax,
          lambda r: dict(scores=f32(r, 3, 2, 5), past_len=2, **HOST),
          {"scores": FARRAY, "past_len": LENGTH, **COMMON}, ref=_cas_ref, kind_of="scores"))


def _fa_ref(k: dict) -> Any:
    q, kk, v = fdata(k["q"]), fdata(k["k"]), fdata(k["v"])
    need(q.ndim == 4 and kk.ndim == 4 and v.ndim == 4 and q.shape[0] == kk.shape[0] == v.shape[0], "rank")
    need(kk.shape[:3] == v.shape[:3] and q.shape[3] == kk.shape[3] and kk.shape[2] > 0
         and q.shape[2] % kk.shape[2] == 0, "shapes")
    ws = tuple(k["window_size"])
    need(len(ws) == 2 and all(isinstance(w, (int, np.integer)) and w >= -1 for w in ws), "window")
    ws = tuple(int(w) for w in ws)
    sc = k.get("scale")
    pairs = [nan_attention(q[b], kk[b], v[b], None, flag(k["causal"]), None if sc is None else real(sc), ws,
                           real(k["softcap"])) for b in range(q.shape[0])]
    out = np.stack([o for o, _ in pairs]).reshape(q.shape[:3] + v.shape[3:])
    lse = np.stack([l_ for _, l_ in pairs]).reshape(q.shape[:3])
    return (out, lse) if flag(k["return_lse"]) else out


spec(Spec("flash_attention", ops.flash_attention,
          lambda r: dict(q=f32(r, 1, 3, 2, 8), k=f32(r, 1, 4, 1, 8), v=f32(r, 1, 4, 1, 8), causal=True, scale=None,
                         window_size=(-1, -1), softcap=0.0, return_lse=True, out=None, tensor_cores=None,
                         q_descale=None, k_descale=None, v_descale=None, **HOST),
          # the descales (FP8 q, k, v only): any value given with this float32 call is an error naming it
          {"q": FARRAY, "k": FARRAY, "v": FARRAY, "causal": BOOL, "scale": FLOAT, "window_size": INT,
           "softcap": FLOAT, "return_lse": BOOL, "out": OUT, "tensor_cores": BOOL, "q_descale": FLOAT,
           "k_descale": FLOAT, "v_descale": FLOAT, **COMMON},
          ref=_fa_ref, kind_of="q"))


def _fav_ref(k: dict) -> Any:
    q, kk, v = fdata(k["q"]), fdata(k["k"]), fdata(k["v"])
    cq, ck = i64(k["cu_seqlens_q"]), i64(k["cu_seqlens_k"])
    need(q.ndim == 3 and kk.shape == v.shape and kk.ndim == 3 and q.shape[2] == kk.shape[2], "shapes")
    need(kk.shape[1] > 0 and q.shape[1] % kk.shape[1] == 0, "heads")
    need(cq.ndim == 1 and cq.shape == ck.shape and cq.size >= 2 and cq[0] == 0 and ck[0] == 0, "cu_seqlens")
    need((np.diff(cq) >= 0).all() and (np.diff(ck) >= 0).all() and cq[-1] == q.shape[0]
         and ck[-1] == kk.shape[0], "cu_seqlens")
    ws = tuple(k["window_size"])
    need(len(ws) == 2 and all(isinstance(w, (int, np.integer)) and w >= -1 for w in ws), "window")
    ws = tuple(int(w) for w in ws)
    sc = k.get("scale")
    outs, lses = [], []
    for b in range(cq.size - 1):
        o, l_ = _na(q[cq[b]:cq[b + 1]], kk[ck[b]:ck[b + 1]], v[ck[b]:ck[b + 1]], flag(k["causal"]),
                             None if sc is None else real(sc), ws, real(k["softcap"]))
        outs.append(o)
        lses.append(l_)
    out, lse = np.concatenate(outs), np.concatenate(lses)
    return (out, lse) if flag(k["return_lse"]) else out


spec(Spec("flash_attention_varlen", ops.flash_attention_varlen,
          lambda r: dict(q=f32(r, 5, 2, 8), k=f32(r, 6, 1, 8), v=f32(r, 6, 1, 8),
                         cu_seqlens_q=np.array([0, 2, 5], np.int32), cu_seqlens_k=np.array([0, 3, 6], np.int32),
                         causal=True, scale=None, window_size=(-1, -1), softcap=0.0, return_lse=False,
                         q_descale=None, k_descale=None, v_descale=None, **HOST),
          # the descales (FP8 q, k, v only): any value given with this float32 call is an error naming it
          {"q": FARRAY, "k": FARRAY, "v": FARRAY, "cu_seqlens_q": PTABLE, "cu_seqlens_k": PTABLE, "causal": BOOL,
           "scale": FLOAT, "window_size": INT, "softcap": FLOAT, "return_lse": BOOL, "q_descale": FLOAT,
           "k_descale": FLOAT, "v_descale": FLOAT, **COMMON},
          ref=_fav_ref, kind_of="q"))

def _favb_build(r: np.random.Generator) -> dict:
    """A valid varlen backward call: f16 (the op runs on the tensor-core kernels), the forward's out / lse."""
    q, k, v, g = f16(r, 5, 2, 8), f16(r, 6, 1, 8), f16(r, 6, 1, 8), f16(r, 5, 2, 8)
    cq, ck = np.array([0, 2, 5], np.int32), np.array([0, 3, 6], np.int32)
    outs, lses = [], []
    for b in range(2):
        o, l_ = _na(fdata(q)[cq[b]:cq[b + 1]], fdata(k)[ck[b]:ck[b + 1]], fdata(v)[ck[b]:ck[b + 1]], True, None,
                    (-1, -1), 0.0)
        outs.append(o)
        lses.append(l_)
    return dict(q=q, k=k, v=v, grad_out=g, cu_seqlens_q=cq, cu_seqlens_k=ck,
                out=np.concatenate(outs).astype(np.float16), lse=np.concatenate(lses).astype(np.float32),
                max_seqlen_q=None, max_seqlen_k=None, causal=True, scale=None, window_size=(-1, -1), softcap=0.0,
                deterministic=False, **HOST)


def _favb_ref(k: dict) -> Any:
    """float64 of what the op computes from the forward's out / lse as given (flash-attn's backward contract):
    P = exp(s - lse) on the visible keys, delta = rowsum(grad_out * out), dS = P (dP - delta) (times the
    softcap's 1 - tanh^2); so a mutated out or lse has a defined answer too."""
    from pykern.difftest.cases.attention import window_mask

    q, kk, v, g, o = (fdata(k[n]) for n in ("q", "k", "v", "grad_out", "out"))
    lse = np.asarray(k["lse"])
    need(lse.dtype == np.float32, "lse dtype")
    lse = lse.astype(np.float64)
    cq, ck = i64(k["cu_seqlens_q"]), i64(k["cu_seqlens_k"])
    need(q.ndim == 3 and q.shape == g.shape == o.shape and kk.shape == v.shape and kk.ndim == 3
         and q.shape[2] == kk.shape[2] and lse.shape == q.shape[:2], "shapes")
    need(kk.shape[1] > 0 and q.shape[1] % kk.shape[1] == 0, "heads")
    need(cq.ndim == 1 and cq.shape == ck.shape and cq.size >= 2 and cq[0] == 0 and ck[0] == 0, "cu_seqlens")
    need((np.diff(cq) >= 0).all() and (np.diff(ck) >= 0).all() and cq[-1] == q.shape[0]
         and ck[-1] == kk.shape[0], "cu_seqlens")
    for n, cu in (("max_seqlen_q", cq), ("max_seqlen_k", ck)):
        need(k[n] is None or natural(k[n]) >= np.diff(cu).max(initial=0), n)
    ws = tuple(k["window_size"])
    need(len(ws) == 2 and all(isinstance(w, (int, np.integer)) and w >= -1 for w in ws), "window")
    ws = tuple(int(w) for w in ws)
    sc, cap = k.get("scale"), real(k["softcap"])
    scale = 1.0 / np.sqrt(q.shape[2]) if sc is None else real(sc)
    group = q.shape[1] // kk.shape[1]
    dq, dk, dv = np.zeros(q.shape), np.zeros(kk.shape), np.zeros(v.shape)
    with np.errstate(all="ignore"):
        for b in range(cq.size - 1):
            sq, sk = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
            vis = window_mask(sq.stop - sq.start, sk.stop - sk.start, flag(k["causal"]), ws)
            for h in range(q.shape[1]):
                qq, k_, v_, go = q[sq, h], kk[sk, h // group], v[sk, h // group], g[sq, h]
                raw = qq @ k_.T * scale
                t = np.tanh(raw / cap) if cap > 0 else None
                s_ = cap * t if cap > 0 else raw
                p = np.where(vis, np.exp(s_ - lse[sq, h][:, None]), 0.0)
                delta = (go * o[sq, h]).sum(-1, keepdims=True)
                ds = np.where(vis, p * (go @ v_.T - delta), 0.0)
                if cap > 0:
                    ds = np.where(vis, ds * (1.0 - t * t), 0.0)
                dq[sq, h] = ds @ k_ * scale
                dk[sk, h // group] += ds.T @ qq * scale
                dv[sk, h // group] += p.T @ go
    return dq, dk, dv


# The reference takes out / lse as given (the op's contract), so their values are fuzzed like the others.
spec(Spec("flash_attention_varlen_backward", ops.flash_attention_varlen_backward, _favb_build,
          {"q": FARRAY, "k": FARRAY, "v": FARRAY, "grad_out": FARRAY, "cu_seqlens_q": PTABLE,
           "cu_seqlens_k": PTABLE, "out": FARRAY, "lse": FARRAY, "max_seqlen_q": LENGTH, "max_seqlen_k": LENGTH,
           "causal": BOOL, "scale": FLOAT, "window_size": INT, "softcap": FLOAT, "deterministic": BOOL, **COMMON},
          ref=_favb_ref, kind_of="q", writes=lambda k: (), examples=0.5))

# --------------------------------------------------------------------------- decode (dense caches)
DECODE_ROLES = {"q": FARRAY, "kv_layout": ENUM, "scale": FLOAT, "window_left": INT, "logits_soft_cap": FLOAT,
                "method": ENUM, "num_warps": LENGTH, "chunk_size": LENGTH, "tensor_cores": BOOL, "out": OUT,
                "enable_pdl": BOOL, **COMMON}


def _dec_one(q: np.ndarray, kc: np.ndarray, vc: np.ndarray, n: int, k: dict) -> np.ndarray:
    """One sequence: q (H, D), caches HND (KVH, S, D)."""
    need(q.ndim == 2 and kc.ndim == 3 and kc.shape == vc.shape and q.shape[1] == kc.shape[2], "shapes")
    need(kc.shape[0] > 0 and q.shape[0] % kc.shape[0] == 0, "heads")
    wl = k["window_left"]
    need(isinstance(wl, (int, np.integer)) and wl >= -1 and real(k["logits_soft_cap"]) >= 0, "window")
    wl = int(wl)
    need(0 <= n <= kc.shape[1], "seq_len")
    sc = k.get("scale")
    out, _ = _na(q[None], kc.transpose(1, 0, 2)[:n], vc.transpose(1, 0, 2)[:n], False,
                          None if sc is None else real(sc), (wl, -1), real(k["logits_soft_cap"]))
    return out[0]


def _dec_ref(k: dict) -> Any:
    lay = choice(k["kv_layout"], ("HND", "NHD"))
    choice(k["method"], ("auto", "warp", "multi_warp", "split_k"))
    kc, vc = fdata(k["k_cache"]), fdata(k["v_cache"])
    if lay == "NHD":
        need(kc.ndim == 3 and vc.ndim == 3, "rank")
        kc, vc = kc.transpose(1, 0, 2), vc.transpose(1, 0, 2)
    n = k["seq_len"]
    n = int(i64(n).reshape(-1)[0]) if isinstance(n, np.ndarray) else natural(n)
    return _dec_one(fdata(k["q"]), kc, vc, n, k)


spec(Spec("decode_attention", ops.decode_attention,
          lambda r: dict(q=f32(r, 2, 8), k_cache=f32(r, 1, 6, 8), v_cache=f32(r, 1, 6, 8), seq_len=4,
                         kv_layout="HND", scale=None, window_left=-1, logits_soft_cap=0.0, method="auto",
                         num_warps=None, chunk_size=None, tensor_cores=None, out=None, enable_pdl=False, **HOST),
          {"k_cache": FARRAY, "v_cache": FARRAY, "seq_len": LENGTH, **DECODE_ROLES}, ref=_dec_ref, kind_of="q"))


def _bdec_ref(k: dict) -> Any:
    lay = choice(k["kv_layout"], ("HND", "NHD"))
    choice(k["method"], ("auto", "warp", "multi_warp", "split_k"))
    q, kc, vc = fdata(k["q"]), fdata(k["k_caches"]), fdata(k["v_caches"])
    need(q.ndim == 3 and kc.ndim == 4 and kc.shape == vc.shape and kc.shape[0] == q.shape[0], "shapes")
    if lay == "NHD":
        kc, vc = kc.transpose(0, 2, 1, 3), vc.transpose(0, 2, 1, 3)
    sl = i64(k["seq_lens"]).reshape(-1)
    need(sl.shape == (q.shape[0],), "seq_lens")
    return np.stack([_dec_one(q[b], kc[b], vc[b], int(sl[b]), k) for b in range(q.shape[0])])


spec(Spec("batched_decode_attention", ops.batched_decode_attention,
          lambda r: dict(q=f32(r, 2, 2, 8), k_caches=f32(r, 2, 1, 6, 8), v_caches=f32(r, 2, 1, 6, 8),
                         seq_lens=np.array([4, 6], np.int32), kv_layout="HND", scale=None, window_left=-1,
                         logits_soft_cap=0.0, method="auto", num_warps=None, chunk_size=None, tensor_cores=None,
                         out=None, enable_pdl=False, **HOST),
          {"k_caches": FARRAY, "v_caches": FARRAY, "seq_lens": IARRAY, **DECODE_ROLES}, ref=_bdec_ref,
          kind_of="q"))


def _plan_check(k: dict, res: Any) -> None:
    assert isinstance(res, dict) and res.get("method") in ("warp", "multi_warp", "split_k"), f"plan {res!r}"
    for n in ("batch", "num_heads", "num_kv_heads", "head_dim", "max_seq_len"):
        assert isinstance(k[n], int) and not isinstance(k[n], bool) and k[n] >= 1 or n == "max_seq_len" \
            and isinstance(k[n], int) and k[n] >= 0, f"{n}={k[n]!r} gave a plan"
    assert k["num_heads"] % k["num_kv_heads"] == 0 and k["head_dim"] <= 256, "bad heads gave a plan"
    for launch in res.get("launches", ()):
        grid = launch[1] if isinstance(launch, tuple) else launch.get("grid")
        assert all(0 < g < 2**31 for g in grid), f"grid {grid}"


spec(Spec("decode_plan", ops.decode_plan,
          lambda r: dict(batch=2, num_heads=4, num_kv_heads=2, head_dim=64, max_seq_len=100, method="auto",
                         seq_hint=None, num_warps=None, chunk_size=None),
          {"batch": LENGTH, "num_heads": LENGTH, "num_kv_heads": LENGTH, "head_dim": LENGTH, "max_seq_len": LENGTH,
           "method": ENUM, "seq_hint": LENGTH, "num_warps": LENGTH, "chunk_size": LENGTH}, check=_plan_check))


def _tiling_check(k: dict, res: Any) -> None:
    hd, pr, kb = k["head_dim"], k["packed_rows"], k["kv_bytes"]
    for n, v in (("head_dim", hd), ("packed_rows", pr), ("kv_bytes", kb)):
        assert isinstance(v, int) and not isinstance(v, bool) and v >= 1, f"{n}={v!r} gave a tiling"
    assert kb in (1, 2, 4), f"kv_bytes={kb} gave a tiling"
    rows, tile, smem = res
    assert 1 <= rows <= max(1, pr) and rows * hd <= 2048 or rows == 1, f"rows {rows}"
    assert 1 <= tile <= 64 and smem <= 48 * 1024, f"tile {tile} smem {smem} for head_dim {hd}"


spec(Spec("attn_tiling", ops.attn_tiling, lambda r: dict(head_dim=64, packed_rows=4, kv_bytes=2),
          {"head_dim": LENGTH, "packed_rows": LENGTH, "kv_bytes": LENGTH}, check=_tiling_check))

# --------------------------------------------------------------------------- serving (paged KV caches)
PAGE, KVH, HQ, D = 4, 1, 2, 8


def _paged(r: np.random.Generator, lens: tuple[int, ...] = (5, 3)) -> dict:
    """A paged NHD cache for sequences of these lengths (pages shuffled, one spare page)."""
    npages = [-(-n // PAGE) for n in lens]
    total = sum(npages) + 1
    perm = r.permutation(total).astype(np.int32)
    indptr = np.concatenate([[0], np.cumsum(npages)]).astype(np.int32)
    last = np.array([n - (p - 1) * PAGE for n, p in zip(lens, npages)], np.int32)
    return dict(k_pages=f32(r, total, PAGE, KVH, D), v_pages=f32(r, total, PAGE, KVH, D), kv_indptr=indptr,
                kv_indices=perm[:indptr[-1]].copy(), kv_last_page_len=last)


def _gather(k: dict, layout: str = "NHD") -> tuple[list, list]:
    """Each sequence's K and V (L, KVH, D) read through the (possibly mutated) page table."""
    kp, vp = fdata(k["k_pages"]), fdata(k["v_pages"])
    need(kp.ndim == 4 and kp.shape == vp.shape, "pages")
    if layout == "HND":
        kp, vp = kp.transpose(0, 2, 1, 3), vp.transpose(0, 2, 1, 3)
    ip, ix, last = i64(k["kv_indptr"]), i64(k["kv_indices"]), i64(k["kv_last_page_len"])
    need(ip.ndim == 1 and ix.ndim == 1 and last.shape == (ip.size - 1,) and ip.size >= 2 and ip[0] == 0, "table")
    need((np.diff(ip) >= 0).all() and ip[-1] <= ix.size and ((ix >= 0) & (ix < kp.shape[0])).all(), "table")
    ks, vs = [], []
    page = kp.shape[1]
    for b in range(ip.size - 1):
        pages = ix[ip[b]:ip[b + 1]]
        n = 0 if pages.size == 0 else (pages.size - 1) * page + int(last[b])
        need(pages.size == 0 or 1 <= last[b] <= page, "kv_last_page_len")
        ks.append(kp[pages].reshape(-1, *kp.shape[2:])[:n])
        vs.append(vp[pages].reshape(-1, *vp.shape[2:])[:n])
    return ks, vs


def _scaled(k: dict, ks: list, vs: list) -> tuple[list, list]:
    ksc = 1.0 if k.get("k_scale") is None else real(k["k_scale"])
    vsc = 1.0 if k.get("v_scale") is None else real(k["v_scale"])
    need(np.isfinite(ksc) and np.isfinite(vsc), "scales")
    return [x * ksc for x in ks], [x * vsc for x in vs]


def _pdec_ref(k: dict, layout: str | None = None, wl: int = -1, cap: float = 0.0) -> Any:
    layout = choice(k.get("kv_layout", layout), ("NHD", "HND"))
    ks, vs = _scaled(k, *_gather(k, layout))
    q = fdata(k["q"])
    need(q.ndim == 3 and q.shape[0] == len(ks) and q.shape[2] == fdata(k["k_pages"]).shape[3], "q")
    need(q.shape[1] % fdata(k["k_pages"]).shape[2 if layout == "NHD" else 1] == 0, "heads")
    wl = wl if k.get("window_left") is None else k["window_left"]
    cap = cap if k.get("logits_soft_cap") is None else real(k["logits_soft_cap"])
    need(isinstance(wl, (int, np.integer)) and wl >= -1 and cap >= 0, "window")
    wl = int(wl)
    sc = k.get("scale")
    outs, lses = [], []
    for b in range(q.shape[0]):
        o, l_ = _na(q[b:b + 1], ks[b], vs[b], False, None if sc is None else real(sc), (wl, -1), cap)
        outs.append(o[0])
        lses.append(l_[0])
    out, lse = np.stack(outs), np.stack(lses)
    return (out, lse) if flag(k["return_lse"]) else out


PAGED_ROLES = {"q": FARRAY, "k_pages": FARRAY, "v_pages": FARRAY, "kv_indptr": PTABLE, "kv_indices": PTABLE,
               "kv_last_page_len": PTABLE, "kv_layout": ENUM, "scale": FLOAT, "k_scale": FLOAT, "v_scale": FLOAT,
               "window_left": INT, "logits_soft_cap": FLOAT, "return_lse": BOOL, "out": OUT, **COMMON}

spec(Spec("paged_decode_attention", ops.paged_decode_attention,
          lambda r: dict(q=f32(r, 2, HQ, D), **_paged(r), kv_layout="NHD", scale=None, k_scale=None, v_scale=None,
                         window_left=None, logits_soft_cap=None, return_lse=True, out=None, plan=None,
                         enable_pdl=False, **HOST),
          {**PAGED_ROLES, "plan": FIXED, "enable_pdl": BOOL}, ref=_pdec_ref, kind_of="q"))


def _plan_build(r: np.random.Generator) -> dict:
    return dict(batch=2, num_qo_heads=HQ, num_kv_heads=KVH, head_dim=D, page_size=PAGE, kv_layout="NHD",
                q_dtype="f32", kv_dtype=None, max_kv_len=None, num_splits=None, return_lse=False, num_sms=132,
                window_left=-1, logits_soft_cap=0.0, tensor_cores=None, items_per_cta=None, like=None)


RUN_REJECTED = "run rejected"


def _plan_call(k: dict) -> Any:
    r = np.random.default_rng(0)
    plan = ops.PagedDecodePlan(**k)
    inputs = dict(q=f32(r, 2, HQ, D), **_paged(r))
    k["_run"] = inputs
    try:
        return plan.run(**inputs, backend="host")
    except (ArgumentError, ArgumentTypeError) as e:
        # a plan for another geometry (batch 1, 4 heads, ...) is valid; run() must then refuse the inputs
        # made for the spec's geometry, naming one of them
        assert any(n in str(e) for n in inputs), f"run() of a plan refused its inputs naming none: {e}"
        k["_rejected"] = True
        return RUN_REJECTED


def _plan_ref(k: dict) -> Any:
    for n in ("batch", "num_qo_heads", "num_kv_heads", "head_dim", "page_size", "num_sms"):
        need(natural(k[n]) >= 1, n)
    need(k["num_splits"] is None or natural(k["num_splits"]) >= 1, "num_splits")
    need(k["items_per_cta"] is None or natural(k["items_per_cta"]) >= 1, "items_per_cta")
    need(k["max_kv_len"] is None or natural(k["max_kv_len"]) >= 0, "max_kv_len")
    choice(k["q_dtype"], ("f32",))
    need(k["kv_dtype"] in (None, "f32"), "kv_dtype")
    if k.get("_rejected"):  # a valid plan of another geometry: the inputs did not fit it
        return RUN_REJECTED
    return _pdec_ref(dict(k["_run"], return_lse=flag(k["return_lse"]), kv_layout=k["kv_layout"]),
                     wl=k["window_left"], cap=real(k["logits_soft_cap"]))


spec(Spec("PagedDecodePlan", None, _plan_build,
          {"batch": LENGTH, "num_qo_heads": LENGTH, "num_kv_heads": LENGTH, "head_dim": LENGTH,
           "page_size": LENGTH, "kv_layout": ENUM, "q_dtype": ENUM, "kv_dtype": ENUM, "max_kv_len": LENGTH,
           "num_splits": LENGTH, "return_lse": BOOL, "num_sms": LENGTH, "window_left": INT,
           "logits_soft_cap": FLOAT, "tensor_cores": BOOL, "items_per_cta": LENGTH, "like": FIXED},
          ref=_plan_ref, tol="paged_decode_attention", call=_plan_call, signature_of=ops.PagedDecodePlan,
          writes=lambda k: ("_run", "_rejected")))


def _run_build(r: np.random.Generator) -> dict:
    return dict(q=f32(r, 2, HQ, D), **_paged(r), scale=None, k_scale=None, v_scale=None, return_lse=None,
                out=None, enable_pdl=False, **HOST)


_RUN_PLAN: dict[str, Any] = {}


def _run_call(k: dict) -> Any:
    # one plan per process: run() must leave it usable whatever the previous (bad) call was
    if "plan" not in _RUN_PLAN:
        _RUN_PLAN["plan"] = ops.PagedDecodePlan(2, HQ, KVH, D, PAGE, kv_layout="NHD", q_dtype="f32")
    return _RUN_PLAN["plan"].run(**k)


spec(Spec("PagedDecodePlan.run", None, _run_build,
          {"q": FARRAY, "k_pages": FARRAY, "v_pages": FARRAY, "kv_indptr": PTABLE, "kv_indices": PTABLE,
           "kv_last_page_len": PTABLE, "scale": FLOAT, "k_scale": FLOAT, "v_scale": FLOAT, "return_lse": BOOL,
           "out": OUT, "enable_pdl": BOOL, **COMMON},
          ref=lambda k: _pdec_ref(dict(k, return_lse=bool(k["return_lse"]) if k["return_lse"] is not None
                                       else False), layout="NHD"),
          tol="paged_decode_attention", kind_of="q", call=_run_call, signature_of=ops.PagedDecodePlan.run))


def _pre_ref(k: dict) -> Any:
    layout = choice(k["kv_layout"], ("NHD", "HND"))
    ks, vs = _scaled(k, *_gather(k, layout))
    q, qi = fdata(k["q"]), i64(k["qo_indptr"])
    need(q.ndim == 3 and qi.shape == (len(ks) + 1,) and qi[0] == 0 and qi[-1] == q.shape[0]
         and (np.diff(qi) >= 0).all(), "qo_indptr")
    need(q.shape[2] == fdata(k["k_pages"]).shape[3], "head_dim")
    need(q.shape[1] % fdata(k["k_pages"]).shape[2 if layout == "NHD" else 1] == 0, "heads")
    wl = k["window_left"]
    need(isinstance(wl, (int, np.integer)) and wl >= -1 and real(k["logits_soft_cap"]) >= 0, "window")
    wl = int(wl)
    sc = k.get("scale")
    outs, lses = [], []
    for b in range(len(ks)):
        o, l_ = _na(q[qi[b]:qi[b + 1]], ks[b], vs[b], flag(k["causal"]), None if sc is None else real(sc),
                             (wl, -1), real(k["logits_soft_cap"]))
        outs.append(o)
        lses.append(l_)
    out, lse = np.concatenate(outs), np.concatenate(lses)
    return (out, lse) if flag(k["return_lse"]) else out


spec(Spec("paged_prefill_attention", ops.paged_prefill_attention,
          lambda r: dict(q=f32(r, 4, HQ, D), qo_indptr=np.array([0, 3, 4], np.int32), **_paged(r), causal=True,
                         kv_layout="NHD", scale=None, k_scale=None, v_scale=None, window_left=-1,
                         logits_soft_cap=0.0, return_lse=False, out=None, **HOST),
          {**PAGED_ROLES, "qo_indptr": PTABLE, "causal": BOOL}, ref=_pre_ref, kind_of="q"))


def _append_build(r: np.random.Generator) -> dict:
    p = _paged(r)
    return dict(k=f32(r, 3, KVH, D), v=f32(r, 3, KVH, D), batch_indices=np.array([0, 0, 1], np.int32),
                positions=np.array([3, 4, 2], np.int32), **p, kv_layout="NHD", k_scale=None, v_scale=None,
                enable_pdl=False, **HOST)


def _append_call(k: dict) -> Any:
    # the pages before the call, for the reference (a meta tensor has none: the op must refuse it)
    k["_before"] = tuple(None if getattr(p, "is_meta", False) else np.array(to_host(p), copy=True)
                         for p in (k["k_pages"], k["v_pages"]))
    ops.append_paged_kv_cache(**{n: v for n, v in k.items() if n != "_before"})
    return to_host(k["k_pages"]), to_host(k["v_pages"])


def to_host(a: Any) -> Any:
    from fuzz_engine import to_numpy

    return to_numpy(a)


def _append_ref(k: dict) -> Any:
    choice(k["kv_layout"], ("NHD",))
    kk, vv = fdata(k["k"]), fdata(k["v"])
    kp, vp = (np.array(x, np.float64) for x in k["_before"])
    bi, pos = i64(k["batch_indices"]), i64(k["positions"])
    ip, ix, last = i64(k["kv_indptr"]), i64(k["kv_indices"]), i64(k["kv_last_page_len"])
    need(kk.shape == vv.shape and kk.ndim == 3 and kk.shape[1:] == kp.shape[2:] and bi.shape == pos.shape
         == kk.shape[:1], "shapes")
    # batch index -1 marks a padding token (get_batch_indices_positions' mark): skipped, never written
    need(ip.ndim == 1 and last.shape == (ip.size - 1,) and ((bi >= -1) & (bi < last.size)).all(), "batch_indices")
    need(np.isfinite([1.0 if k.get(s) is None else real(k[s]) for s in ("k_scale", "v_scale")]).all(), "scales")
    for t in range(kk.shape[0]):
        b = bi[t]
        if b == -1:
            continue
        n = (ip[b + 1] - ip[b] - 1) * kp.shape[1] + last[b]
        need(0 <= pos[t] < n, "positions")
        page = ix[ip[b] + pos[t] // kp.shape[1]]
        need(0 <= page < kp.shape[0], "kv_indices")
        kp[page, pos[t] % kp.shape[1]] = kk[t]
        vp[page, pos[t] % kp.shape[1]] = vv[t]
    return kp, vp


spec(Spec("append_paged_kv_cache", None, _append_build,
          {"k": FARRAY, "v": FARRAY, "batch_indices": IARRAY, "positions": IARRAY, "k_pages": OUT, "v_pages": OUT,
           "kv_indices": PTABLE, "kv_indptr": PTABLE, "kv_last_page_len": PTABLE, "kv_layout": ENUM,
           "k_scale": FLOAT, "v_scale": FLOAT, "enable_pdl": BOOL, **COMMON},
          ref=_append_ref, kind_of="k", call=_append_call, signature_of=ops.append_paged_kv_cache,
          writes=lambda k: ("k_pages", "v_pages", "_before")))


def _gbip_ref(k: dict) -> Any:
    ip, sl, nnz = i64(k["append_indptr"]), i64(k["seq_lens"]), natural(k["nnz"])
    need(ip.ndim == 1 and sl.shape == (ip.size - 1,) and ip[0] == 0 and (np.diff(ip) >= 0).all(), "indptr")
    need(ip[-1] == nnz and (sl >= np.diff(ip)).all(), "lengths")
    bi = np.repeat(np.arange(sl.size), np.diff(ip))
    pos = np.concatenate([np.arange(s - n, s) for s, n in zip(sl, np.diff(ip))] + [np.zeros(0, np.int64)])
    return bi.astype(np.int32), pos.astype(np.int32)


spec(Spec("get_batch_indices_positions", ops.get_batch_indices_positions,
          lambda r: dict(append_indptr=np.array([0, 2, 3], np.int32), seq_lens=np.array([5, 3], np.int32), nnz=3,
                         **HOST),
          {"append_indptr": PTABLE, "seq_lens": IARRAY, "nnz": LENGTH, **COMMON}, ref=_gbip_ref))

# --------------------------------------------------------------------------- sampling
SAMPLING_ROLES = {"probs": PROB, "indices": IARRAY, "deterministic": BOOL, "generator": FIXED, "check_nan": BOOL,
                  "seed": INT, "offset": INT, "return_valid": BOOL, "out": OUT, "valid": OUT, "enable_pdl": BOOL,
                  **COMMON}


def _sampling_check(extra: tuple[str, ...]) -> Any:
    def check(k: dict, res: Any) -> None:
        p = fdata(k["probs"]).astype(np.float32)
        assert p.ndim == 2 and p.size, f"probs {p.shape} sampled"
        # A row with a NaN, inf or negative entry is no distribution: token 0, valid False (np_sample says so);
        # check_nan=True must refuse such host probs instead.
        assert not k["check_nan"] or ((p >= 0) & (p < np.inf)).all(), "check_nan=True sampled a bad row"
        idx = None if k.get("indices") is None else i64(k["indices"])
        assert idx is None or (idx.ndim == 1 and ((idx >= 0) & (idx < p.shape[0])).all()), f"indices {idx}"
        filt = {}
        for n in extra:
            v = k[n]
            if n == "filter_apply_order":
                filt["order"] = choice(v, ("top_k_first", "joint"))
                continue
            a = np.asarray(v)
            assert a.dtype.kind in "iuf" and a.ndim in (0, 1), f"{n}={v!r} accepted"
            if n == "top_k":  # a float top_k array is truncated, as FlashInfer's .int() does
                assert np.isfinite(a).all() and (a >= 0).all() and (a < 2**31).all(), f"top_k={v!r} accepted"
                assert a.dtype.kind in "iu" or a.ndim == 1, f"top_k={v!r} accepted"
                v = v if a.ndim == 0 else np.trunc(a).astype(np.int64)
            else:
                assert np.isfinite(a).all() and ((a >= 0) & (a <= 1)).all(), f"{n}={v!r} accepted"
                assert n != "top_p" or (a > 0).all(), f"top_p={v!r} accepted"
            assert a.ndim == 0 or a.shape == ((p.shape[0],) if idx is None else idx.shape), f"{n} shape {a.shape}"
            filt[n] = v
        flag(k["return_valid"])
        samples = res[0] if k["return_valid"] else res
        seed, off = k.get("seed"), k.get("offset")
        if seed is None:  # drawn from OS entropy: only the support can be checked
            s = np.asarray(to_host(samples))
            rows = p if idx is None else p[idx]
            good = ((rows >= 0) & (rows < np.inf)).all(1) & (rows.sum(1) > 0)
            assert ((s >= 0) & (s < p.shape[1])).all() and (rows[np.arange(s.size), s] > 0)[good].all(), \
                f"samples {s}"
            assert (s[~good] == 0).all(), f"samples {s} of rows that are no distribution"
            return
        seed, off = _seed_offset(seed, off)
        _compare_tokens(k, res, np_sample(p, seed, off, indices=idx, **filt))
    return check


def _seed_offset(seed: Any, off: Any) -> tuple[Any, Any]:
    """The documented seed / offset: ints in [-2**63, 2**64) taken modulo 2**64, or int arrays of such."""
    for n, v in (("seed", seed), ("offset", 0 if off is None else off)):
        a = np.asarray(v)
        assert a.dtype.kind in "iu" and a.ndim <= 1 and all(-2**63 <= int(x) < 2**64 for x in
                                                            a.reshape(-1)), f"{n}={v!r}"
    seed = seed % 2**64 if isinstance(seed, int) else seed
    off = 0 if off is None else off % 2**64 if isinstance(off, int) else off
    return seed, off


def _compare_tokens(k: dict, res: Any, ref: tuple[np.ndarray, np.ndarray]) -> None:
    """Tokens (and valid flags under return_valid) exactly as the reference's (want, valid)."""
    want, valid = ref
    samples = res[0] if k["return_valid"] else res
    compare("sampling_from_probs", "f32", (samples, res[1]) if k["return_valid"] else samples,
            (want, valid) if k["return_valid"] else want)


def _sampling_build(**extra: Any) -> Any:
    def build(r: np.random.Generator) -> dict:
        return dict(probs=probs(r, 2, 7), **extra, indices=np.array([1, 0, 1], np.int32), deterministic=True,
                    generator=None, check_nan=False, seed=1234, offset=5, return_valid=False, **HOST)
    return build


for _name, _extra, _roles in (
        ("sampling_from_probs", {}, {"ctas_per_row": LENGTH}),
        ("top_k_sampling_from_probs", {"top_k": 3}, {"top_k": LENGTH, "ctas_per_row": LENGTH}),
        ("top_p_sampling_from_probs", {"top_p": 0.6}, {"top_p": PROB, "ctas_per_row": LENGTH}),
        ("min_p_sampling_from_probs", {"min_p": np.array([0.2, 0.5, 0.9], np.float32)},
         {"min_p": PROB, "ctas_per_row": LENGTH}),
        ("top_k_top_p_sampling_from_probs", {"top_k": np.array([2, 4, 0], np.int32), "top_p": 0.7,
                                             "filter_apply_order": "joint"},
         {"top_k": LENGTH, "top_p": PROB, "filter_apply_order": ENUM, "ctas_per_row": LENGTH})):
    spec(Spec(_name, getattr(ops, _name), _sampling_build(**_extra), {**SAMPLING_ROLES, **_roles},
              check=_sampling_check(tuple(_extra))))


def _temperature(t: Any, n: int) -> Any:
    """The documented temperature: None, or a scalar / (n,) array of finite values > 0 with log2(e) / T finite."""
    if t is None:
        return None
    a = np.asarray(t)
    assert a.dtype.kind in "iuf" and (a.ndim == 0 or a.shape == (n,)), f"temperature={t!r} accepted"
    a32 = a.astype(np.float32)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        ok = (a32 > 0) & np.isfinite(a32) & np.isfinite(np.float32(1.4426950408889634) / a32)
    assert ok.all(), f"temperature={t!r} accepted"
    return t if a.ndim == 0 else a32


def _logits_check(extra: tuple[str, ...]) -> Any:
    # sampling_from_logits / top_k_top_p_sampling_from_logits: tokens are integer-exact against the documented
    # rule (np_sample_logits: the fixed-point exp as the mass, the filters, one Philox word a row)
    def check(k: dict, res: Any) -> None:
        x = fdata(k["logits"]).astype(np.float32)
        assert x.ndim == 2 and x.size, f"logits {x.shape} sampled"
        idx = None if k.get("indices") is None else i64(k["indices"])
        assert idx is None or (idx.ndim == 1 and ((idx >= 0) & (idx < x.shape[0])).all()), f"indices {idx}"
        n = x.shape[0] if idx is None else idx.shape[0]
        filt: dict[str, Any] = {}
        for name in extra:
            v = k[name]
            if name == "filter_apply_order":
                filt["order"] = choice(v, ("top_k_first", "joint"))
                continue
            a = np.asarray(v)
            assert a.dtype.kind in "iuf" and a.ndim in (0, 1), f"{name}={v!r} accepted"
            assert a.ndim == 0 or a.shape == (n,), f"{name} shape {a.shape}"
            if name == "top_k":
                assert np.isfinite(a).all() and (a >= 0).all() and (a < 2**31).all(), f"top_k={v!r} accepted"
                filt["top_k"] = v if a.ndim == 0 else a.astype(np.int64)  # float arrays truncate, as FlashInfer
            else:
                assert np.isfinite(a).all() and ((a > 0) & (a <= 1)).all(), f"top_p={v!r} accepted"
                filt["top_p"] = v if a.ndim == 0 else a.astype(np.float32)
        temp = _temperature(k["temperature"], n)
        if k["check_nan"]:  # host logits with a NaN / +inf must have been refused
            assert (x < np.inf).all(), "check_nan=True sampled a row holding a NaN or +inf"
        flag(k["return_valid"])
        seed, off = k.get("seed"), k.get("offset")
        if seed is None:  # drawn from OS entropy: only the support can be checked
            return
        seed, off = _seed_offset(seed, off)
        _compare_tokens(k, res, np_sample_logits(x, seed, off, temperature=temp, indices=idx, **filt))
    return check


def _logits_build(**extra: Any) -> Any:
    def build(r: np.random.Generator) -> dict:
        return dict(logits=f32(r, 2, 7) * np.float32(2), **extra, indices=np.array([1, 0, 1], np.int32),
                    deterministic=True, generator=None, check_nan=False, seed=1234, offset=5, return_valid=False,
                    temperature=0.7, **HOST)
    return build


LOGITS_ROLES = {**{k: v for k, v in SAMPLING_ROLES.items() if k != "probs"}, "logits": FARRAY, "temperature": FLOAT}
for _name, _extra, _roles in (
        ("sampling_from_logits", {}, {"ctas_per_row": LENGTH}),
        ("top_k_top_p_sampling_from_logits", {"top_k": np.array([2, 4, 0], np.int32), "top_p": 0.7,
                                              "filter_apply_order": "joint"},
         {"top_k": LENGTH, "top_p": PROB, "filter_apply_order": ENUM, "ctas_per_row": LENGTH})):
    spec(Spec(_name, getattr(ops, _name), _logits_build(**_extra), {**LOGITS_ROLES, **_roles},
              check=_logits_check(tuple(_extra))))


def _softmax_ref(k: dict) -> Any:
    x = fdata(k["logits"])
    need(x.ndim == 2 and x.shape[1] >= 1, "shape")
    t = _temperature(k["temperature"], x.shape[0]) if True else None
    with np.errstate(invalid="ignore", over="ignore"):
        out = np_softmax(x, t)
    bad = ~(x < np.inf).all(1) | ~(x > -np.inf).any(1)  # a NaN / +inf, or only -inf: the row is NaN (documented)
    out[bad] = np.nan
    return out


spec(Spec("softmax", ops.softmax, lambda r: dict(logits=f32(r, 3, 9), temperature=np.array([0.5, 1.0, 2.0],
                                                                                          np.float32),
                                                 enable_pdl=None, **HOST),
          {"logits": FARRAY, "temperature": FLOAT, "enable_pdl": BOOL, **COMMON}, ref=_softmax_ref,
          kind_of="logits"))


def _renorm_ref(fn: Any, param: str, is_int: bool) -> Any:
    def ref(k: dict) -> Any:
        p = fdata(k["probs" if "probs" in k else "logits"])
        v = np.asarray(k[param])
        need(p.ndim == 2 and v.ndim in (0, 1) and (v.ndim == 0 or v.shape == p.shape[:1]), "shapes")
        need(v.dtype.kind in "iuf", "dtype")
        if is_int and v.dtype.kind == "f":  # a float top_k array is truncated, as FlashInfer's .int() does
            need(bool(np.isfinite(v).all()), param)
            v = np.trunc(v)
        need((v >= 0).all() and (v < 2**31).all() if is_int else ((v > 0) & (v <= 1)).all(), param)
        if is_int and v.ndim:
            v = v.astype(np.int64)
        # (negative, NaN and inf entries are the references' "no mass", as the kernels read them)
        return fn(p, k[param] if v.ndim == 0 else v)
    return ref


spec(Spec("top_k_renorm_probs", ops.top_k_renorm_probs,
          lambda r: dict(probs=probs(r, 2, 7), top_k=np.array([3, 0], np.int32), is_deterministic=False, **HOST),
          {"probs": PROB, "top_k": LENGTH, "is_deterministic": BOOL, **COMMON},
          ref=_renorm_ref(np_top_k_renorm, "top_k", True), kind_of="probs"))
spec(Spec("top_p_renorm_probs", ops.top_p_renorm_probs,
          lambda r: dict(probs=probs(r, 2, 7), top_p=0.5, is_deterministic=False, **HOST),
          {"probs": PROB, "top_p": PROB, "is_deterministic": BOOL, **COMMON},
          ref=_renorm_ref(np_top_p_renorm, "top_p", False), kind_of="probs"))
spec(Spec("top_k_mask_logits", ops.top_k_mask_logits,
          lambda r: dict(logits=f32(r, 2, 7), top_k=2, **HOST),
          {"logits": FARRAY, "top_k": LENGTH, **COMMON},
          ref=_renorm_ref(np_top_k_mask, "top_k", True), kind_of="logits"))

# --------------------------------------------------------------------------- mixture of experts


def _route_ref(k: dict) -> Any:
    x = fdata(k["router_logits"])
    tk = natural(k["top_k"])
    sc = choice(k["scoring"], ("softmax", "sigmoid"))
    need(x.ndim == 2 and 1 <= tk <= x.shape[1], "top_k")
    b = None if k.get("bias") is None else np.asarray(k["bias"])
    need(b is None or (b.dtype == np.float32 and b.shape == x.shape[1:]), "bias")
    w, ids = np_moe_route(x, tk, flag(k["renormalize"]), sc, b)
    # a row with a non-finite logit has NaN weights (compared) and unspecified ids (masked out)
    bad = ~np.isfinite(x).all(-1, keepdims=True) | np.isnan(w).any(-1, keepdims=True)
    return w, np.ma.MaskedArray(ids, mask=np.broadcast_to(bad, ids.shape))


spec(Spec("moe_route", ops.moe_route,
          lambda r: dict(router_logits=f32(r, 3, 6), top_k=2, renormalize=True, scoring="sigmoid",
                         bias=f32(r, 6), **HOST),
          {"router_logits": FARRAY, "top_k": LENGTH, "renormalize": BOOL, "scoring": ENUM, "bias": FARRAY,
           **COMMON}, ref=_route_ref, kind_of="router_logits"))


def _align_ref(k: dict) -> Any:
    ids, e, blk = i64(k["topk_ids"]), natural(k["n_experts"]), natural(k["block"])
    need(ids.ndim == 2 and e >= 1 and blk >= 1 and ((ids >= -1) & (ids < e)).all(), "ids")
    flat = ids.reshape(-1)
    counts = np.array([(flat == x).sum() for x in range(e)], np.int64)
    offsets = np.concatenate([[0], np.cumsum(-(-counts // blk) * blk)])
    rows = flat.size + min(e, flat.size) * (blk - 1)
    sorted_slot = np.full(max(rows, 0), -1)
    slot_pos = np.full(flat.size, -1)
    for x in range(e):
        slots = np.nonzero(flat == x)[0]
        sorted_slot[offsets[x]:offsets[x] + slots.size] = slots
        slot_pos[slots] = offsets[x] + np.arange(slots.size)
    return sorted_slot, slot_pos, offsets, counts


spec(Spec("moe_align", ops.moe_align,
          lambda r: dict(topk_ids=np.array([[0, 2], [2, -1], [1, 2]], np.int32), n_experts=3, block=4, **HOST),
          {"topk_ids": IARRAY, "n_experts": LENGTH, "block": LENGTH, **COMMON}, ref=_align_ref))




def _experts_common(k: dict) -> tuple:
    x, gu, dn, w = fdata(k["x"]), fdata(k["gate_up_proj"]), fdata(k["down_proj"]), fdata(k["topk_weights"])
    ids = i64(k["topk_ids"])
    need(x.ndim == 2 and gu.ndim == 3 and gu.shape[2] == x.shape[1] and gu.shape[1] % 2 == 0 and gu.shape[1]
         and dn.shape == (gu.shape[0], x.shape[1], gu.shape[1] // 2), "weights")
    need(ids.ndim == 2 and ids.shape[0] == x.shape[0] and w.shape == ids.shape, "routing")
    need(((ids >= -1) & (ids < gu.shape[0])).all(), "topk_ids")
    return x, gu, dn, ids, w, choice(k["activation"], ("silu", "gelu_tanh"))


def _experts_build(r: np.random.Generator) -> dict:
    return dict(x=f32(r, 3, 8), gate_up_proj=f32(r, 2, 8, 8) * np.float32(0.3), down_proj=f32(r, 2, 8, 4),
                topk_ids=np.array([[0, 1], [1, -1], [1, 0]], np.int32), topk_weights=r.random((3, 2)).astype(
                    np.float32), activation="silu", tensor_cores=None, **HOST)


spec(Spec("moe_experts", ops.moe_experts, _experts_build,
          {"x": FARRAY, "gate_up_proj": FARRAY, "down_proj": FARRAY, "topk_ids": IARRAY, "topk_weights": FARRAY,
           "activation": ENUM, "tensor_cores": BOOL, **COMMON},
          ref=lambda k: np_moe_experts(*_experts_common(k)), kind_of="x", examples=0.5))


def _experts_b_ref(k: dict) -> Any:
    g = fdata(k["grad_out"])
    c = _experts_common(k)
    need(g.shape == c[0].shape, "grad_out")
    return np_moe_experts_backward(g, *c)


spec(Spec("moe_experts_backward", ops.moe_experts_backward,
          lambda r: dict(grad_out=f32(r, 3, 8), **_experts_build(r)),
          {"grad_out": FARRAY, "x": FARRAY, "gate_up_proj": FARRAY, "down_proj": FARRAY, "topk_ids": IARRAY,
           "topk_weights": FARRAY, "activation": ENUM, "tensor_cores": BOOL, **COMMON},
          ref=_experts_b_ref, kind_of="x", examples=0.5))

# --------------------------------------------------------------------------- grouped GEMMs (moe.py, gemm_fp8.py)


def f16(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float16)


def bf16(rng: np.random.Generator, *shape: int) -> np.ndarray:
    import ml_dtypes

    return rng.standard_normal(shape).astype(np.float32).astype(ml_dtypes.bfloat16)


def row_offsets(off: Any, n_groups: int, m: int) -> np.ndarray:
    """Grouped-GEMM row offsets as the ops document them: int32 [E + 1], 0 first, M last, non-decreasing."""
    need(np.asarray(off).dtype == np.int32, "offsets dtype")
    off = i64(off)
    need(off.shape == (n_groups + 1,) and off[0] == 0 and off[-1] == m and (np.diff(off) >= 0).all(), "offsets")
    return off


def _gg_ref2(k: dict) -> Any:
    a, b = fdata(k["a"]), fdata(k["b"])
    layout = choice(k["layout"], ("nt", "nn"))
    need(a.ndim == 2 and b.ndim == 3, "ranks")
    if layout == "nn":  # b [E, K, N]: a[rows] @ b[e]
        b = np.swapaxes(b, 1, 2)
    need(a.shape[1] == b.shape[2], "K")
    off = row_offsets(k["offsets"], b.shape[0], a.shape[0])
    need(k.get("out") is None or fdata(k["out"]).shape == (a.shape[0], b.shape[1]), "out")
    return np_grouped_gemm(a, b, off)


spec(Spec("grouped_gemm", ops.grouped_gemm,
          lambda r: dict(a=f32(r, 5, 8), b=f32(r, 3, 4, 8), offsets=np.array([0, 2, 2, 5], np.int32), out=None,
                         tensor_cores=None, layout="nt", **HOST),
          {"a": FARRAY, "b": FARRAY, "offsets": PTABLE, "out": OUT, "tensor_cores": BOOL, "layout": ENUM,
           "out_dtype": FIXED, **COMMON},
          ref=_gg_ref2, kind_of="a"))
# layout="nn" (b [E, K, N]) in f16: the tensor-core kernel with k-major B tiles on the host backend
spec(Spec("grouped_gemm[nn]", ops.grouped_gemm,
          lambda r: dict(a=f16(r, 5, 8), b=f16(r, 3, 8, 6), offsets=np.array([0, 2, 2, 5], np.int32),
                         out=np.zeros((5, 6), np.float16), tensor_cores=None, layout="nn", **HOST),
          SPECS["grouped_gemm"].roles, ref=_gg_ref2, tol="grouped_gemm", kind_of="a"))


def _wgrad_ref(k: dict) -> Any:
    # (the dtypes: the op's to check; a torch bf16 tensor reaches the reference as float32)
    a, b = fdata(k["a"]), fdata(k["b"])
    need(a.ndim == 2 and b.ndim == 2 and a.shape[0] == b.shape[0], "shapes")
    need(np.ndim(k["offsets"]) == 1 and np.shape(k["offsets"])[0] >= 2, "E >= 1")
    off = row_offsets(k["offsets"], np.shape(k["offsets"])[0] - 1, a.shape[0])
    # (the difftest case's reference: out[e] = a[rows_e]^T @ b[rows_e], an empty expert a zero block)
    return np.stack([a[off[e]:off[e + 1]].T @ b[off[e]:off[e + 1]] for e in range(off.size - 1)])


spec(Spec("grouped_gemm_wgrad_tc", ops.grouped_gemm_wgrad_tc,
          lambda r: dict(a=bf16(r, 5, 8), b=bf16(r, 5, 6), offsets=np.array([0, 2, 2, 5], np.int32), **HOST),
          {"a": FARRAY, "b": FARRAY, "offsets": PTABLE, **COMMON}, ref=_wgrad_ref, tol="grouped_gemm", kind_of="a"))


def fp8(a: Any) -> np.ndarray:
    """An FP8 operand of the reference's: float8_e4m3fn codes (what gemm_fp8 documents)."""
    a = np.asarray(a)
    need(a.dtype.name == "float8_e4m3fn", f"dtype {a.dtype} is not float8_e4m3fn")
    return a


def scales(s: Any, shape: tuple[int, ...]) -> np.ndarray:
    s = np.asarray(s)
    need(s.dtype == np.float32 and s.shape == shape, f"scales {s.dtype} {s.shape}, want float32 {shape}")
    return s


def _q_ref(k: dict) -> Any:
    need(natural(k["block"]) == 128, "block")
    x = fdata(k["x"])
    need(x.ndim == 2 and x.shape[1] % 128 == 0, "x (M, K), K a multiple of 128")
    return np_fp8_quantize(np.asarray(k["x"]))


spec(Spec("fp8_quantize", ops.fp8_quantize,
          lambda r: dict(x=f32(r, 3, 256) * np.float32(3.0), block=128, **HOST),
          {"x": FARRAY, "block": LENGTH, **COMMON}, ref=_q_ref, kind_of="x"))


def bf16_out(op: str, ref: Any) -> Any:
    """The FP8 GEMMs' oracle: their result is bf16 whatever the inputs' dtype (all float8), so the tolerance row
    is (op, "bf16") and not the one an input's dtype would pick; the float64 reference's rejection of an
    accepted input fails as in the engine's reference path."""
    def check(k: dict, res: Any) -> None:
        try:
            with np.errstate(all="ignore"):
                want = ref(k)
        except Exception as e:
            raise AssertionError(f"the float64 reference rejects the input ({type(e).__name__}: {e})") from None
        assert str(getattr(res, "dtype", "")).endswith("bfloat16"), f"result dtype {getattr(res, 'dtype', res)!r}"
        compare(op, "bf16", res, want)
    return check


def _gemm_fp8_ref(k: dict) -> Any:
    a, b = fp8(k["a"]), fp8(k["b"])
    need(a.ndim == 2 and b.ndim == 2 and a.shape[1] == b.shape[1] and a.shape[1] % 128 == 0, "shapes")
    (m, kk), n = a.shape, b.shape[0]
    sa = scales(k["a_scale"], (m, kk // 128))
    sb = scales(k["b_scale"], (-(-n // 128), kk // 128))
    return np_gemm_fp8(a, sa, b, sb)


def _gemm_fp8_build(r: np.random.Generator) -> dict:
    a, sa = _act(r, 3, 256)
    b, sb = fp8_weight(f32(r, 130, 256) * np.float32(0.05))  # N = 130: two 128-row scale blocks, the second ragged
    return dict(a=a, a_scale=sa, b=b, b_scale=sb, **HOST)


spec(Spec("gemm_fp8", ops.gemm_fp8, _gemm_fp8_build,
          {"a": FARRAY, "a_scale": FARRAY, "b": FARRAY, "b_scale": FARRAY, **COMMON},
          check=bf16_out("gemm_fp8", _gemm_fp8_ref)))


def _ggfp8_ref(k: dict) -> Any:
    a, b = fp8(k["a"]), fp8(k["b"])
    need(a.ndim == 2 and b.ndim == 3 and a.shape[1] == b.shape[2] and a.shape[1] % 128 == 0, "shapes")
    (m, kk), (e, n) = a.shape, b.shape[:2]
    sa = scales(k["a_scale"], (m, kk // 128))
    sb = scales(k["b_scale"], (e, -(-n // 128), kk // 128))
    return np_grouped_gemm_fp8(a, sa, b, sb, row_offsets(k["offsets"], e, m))


def _ggfp8_build(r: np.random.Generator) -> dict:
    a, sa = _act(r, 5, 128)
    ws = [fp8_weight(f32(r, 4, 128) * np.float32(0.05)) for _ in range(3)]
    return dict(a=a, a_scale=sa, b=np.stack([w[0] for w in ws]), b_scale=np.stack([w[1] for w in ws]),
                offsets=np.array([0, 2, 2, 5], np.int32), **HOST)


spec(Spec("grouped_gemm_fp8", ops.grouped_gemm_fp8, _ggfp8_build,
          {"a": FARRAY, "a_scale": FARRAY, "b": FARRAY, "b_scale": FARRAY, "offsets": PTABLE, **COMMON},
          check=bf16_out("grouped_gemm_fp8", _ggfp8_ref)))

# --------------------------------------------------------------------------- pykern.torch (CPU tensors)


def torch_specs() -> dict[str, Spec]:
    """Specs of pykern.torch's public functions (imports torch: only called when those are fuzzed)."""
    import pykern.torch as pt

    out: dict[str, Spec] = {}

    def tspec(name: str, build: Any, roles: dict, ref: Any, tol: str, kind_of: str | None = None) -> None:
        out["torch." + name] = Spec("torch." + name, getattr(pt, name), build, roles, ref=ref, tol=tol,
                                    kind_of=kind_of, torch=True, writes=lambda k: ())

    tspec("rms_norm", lambda r: dict(x=f32(r, 3, 8), weight=f32(r, 8), eps=1e-6, offset=0.0),
          {"x": FARRAY, "weight": FARRAY, "eps": FLOAT, "offset": FLOAT}, _rms_ref, "rms_norm", "x")

    def rope_ref(k: dict) -> Any:
        q, kk = fdata(k["q"]), fdata(k["k"])
        c, s = (np.asarray(k[n]).astype(np.float32).astype(np.float64) for n in ("cos", "sin"))
        need(q.ndim == 4 and kk.ndim == 4 and q.shape[:2] == kk.shape[:2] and q.shape[3] == kk.shape[3], "qk")
        need(c.shape == s.shape and c.ndim == 2 and c.shape[1] == q.shape[3], "tables")
        # (any real dtype: the wrapper converts the tables with .float())
        pos = k.get("position_ids")
        pos = np.arange(q.shape[1]) if pos is None else i64(pos)
        need(((pos >= 0) & (pos < c.shape[0])).all() and pos.shape[-1] == q.shape[1], "positions")
        return (np_rope(q, c, s, 0, "half", position_ids=pos), np_rope(kk, c, s, 0, "half", position_ids=pos))

    def rope_build(r: np.random.Generator) -> dict:
        ang = r.random((6, 4))
        ang = np.concatenate([ang, ang], -1)
        return dict(q=f32(r, 1, 3, 2, 8), k=f32(r, 1, 3, 1, 8), cos=np.cos(ang).astype(np.float32),
                    sin=np.sin(ang).astype(np.float32), position_ids=np.array([[2, 0, 5]]))

    tspec("rope", rope_build, {"q": FARRAY, "k": FARRAY, "cos": FARRAY, "sin": FARRAY, "position_ids": IARRAY},
          rope_ref, "rope", "q")

    def qknr_ref(k: dict) -> Any:
        oq, ok = rope_ref(k)  # the checks of rope's, then the norm before the rotation
        q, kk = fdata(k["q"]), fdata(k["k"])
        wq, wk = fdata(k["q_weight"]), fdata(k["k_weight"])
        need(wq.shape == wk.shape == (q.shape[3],), "weights")
        eps, off = real(k["eps"]), real(k["offset"])
        need(eps >= 0, "eps")
        pos = k.get("position_ids")
        pos = np.arange(q.shape[1]) if pos is None else i64(pos)
        c, s = (np.asarray(k[n]).astype(np.float32).astype(np.float64) for n in ("cos", "sin"))
        r = np_qk_norm_rope(q, kk, c, s, wq, wk, eps, off, position_ids=pos)
        return r["q_out"], r["k_out"]

    def qknr_build(r: np.random.Generator) -> dict:
        d = rope_build(r)
        d.update(q_weight=f32(r, 8), k_weight=f32(r, 8), eps=1e-6, offset=0.0)
        return d

    tspec("qk_norm_rope", qknr_build, {"q": FARRAY, "k": FARRAY, "cos": FARRAY, "sin": FARRAY, "q_weight": FARRAY,
                                       "k_weight": FARRAY, "eps": FLOAT, "position_ids": IARRAY, "offset": FLOAT},
          qknr_ref, "qk_norm_rope", "q")
    tspec("swiglu", lambda r: dict(gate=f32(r, 3, 5), up=f32(r, 3, 5)), {"gate": FARRAY, "up": FARRAY}, _sg_ref,
          "silu_gate", "gate")

    def fa_ref(k: dict) -> Any:
        sc = k.get("softcap")
        return _fa_ref(dict(k, return_lse=False, softcap=0.0 if sc is None else sc))

    tspec("flash_attention", lambda r: dict(q=f32(r, 1, 3, 2, 8), k=f32(r, 1, 4, 1, 8), v=f32(r, 1, 4, 1, 8),
                                            causal=True, scale=None, window_size=(-1, -1), softcap=None,
                                            q_descale=None, k_descale=None, v_descale=None),
          {"q": FARRAY, "k": FARRAY, "v": FARRAY, "causal": BOOL, "scale": FLOAT, "window_size": INT,
           "softcap": FLOAT, "q_descale": FLOAT, "k_descale": FLOAT, "v_descale": FLOAT}, fa_ref, "flash_attention",
          "q")

    def ce_ref(k: dict) -> Any:
        z = k["z_loss"] if k.get("lse_square_scale") is None else k["lse_square_scale"]
        res = _ce_ref(dict(k, pad_id=k["ignore_index"], ignore_index=None, z_loss=z))
        return (res[0], res[2]) if flag(k["return_z_loss"]) else res[0]

    tspec("cross_entropy", lambda r: dict(logits=f32(r, 4, 9), targets=np.array([1, -100, 8, 0]), ignore_index=-100,
                                          reduction="mean", label_smoothing=0.0, z_loss=0.0, softcap=None,
                                          weight=None, lse_square_scale=None, return_z_loss=False),
          {"logits": FARRAY, "targets": IARRAY, "ignore_index": INT, "reduction": ENUM, "label_smoothing": PROB,
           "z_loss": FLOAT, "softcap": FLOAT, "weight": FARRAY, "lse_square_scale": FLOAT, "return_z_loss": BOOL},
          ce_ref, "cross_entropy_fwd_bwd", "logits")
    tspec("embedding", lambda r: dict(ids=r.integers(0, 6, 5), table=f32(r, 6, 4)),
          {"ids": IARRAY, "table": FARRAY}, _emb_ref, "embedding", "table")
    tspec("add_rms_norm", lambda r: dict(x=f32(r, 3, 8), residual=f32(r, 3, 8), weight=f32(r, 8), eps=1e-6,
                                         offset=0.0),
          {"x": FARRAY, "residual": FARRAY, "weight": FARRAY, "eps": FLOAT, "offset": FLOAT}, _arn_ref,
          "add_rms_norm", "x")
    tspec("layer_norm", lambda r: dict(x=f32(r, 3, 8), weight=f32(r, 8), bias=f32(r, 8), eps=1e-5),
          {"x": FARRAY, "weight": FARRAY, "bias": FARRAY, "eps": FLOAT}, _ln_ref, "layer_norm", "x")
    tspec("gelu", lambda r: dict(x=f32(r, 3, 5), approximate="tanh"), {"x": FARRAY, "approximate": ENUM},
          lambda k: np_gelu(fdata(k["x"]), choice(k["approximate"], GELU)), "gelu", "x")
    tspec("gelu_gate", lambda r: dict(gate=f32(r, 3, 5), up=f32(r, 3, 5), approximate="none"),
          {"gate": FARRAY, "up": FARRAY, "approximate": ENUM}, _gg_ref, "gelu_gate", "gate")

    def flce_ref(k: dict) -> Any:
        z = k["z_loss"] if k.get("lse_square_scale") is None else k["lse_square_scale"]
        need(k.get("ce_weight") is None, "ce_weight")
        res = _flce_ref(dict(k, z_loss=z))
        return (res[0], res[-1]) if flag(k["return_z_loss"]) else res[0]

    tspec("fused_linear_cross_entropy",
          lambda r: dict(hidden=f32(r, 4, 6), weight=f32(r, 9, 6), targets=np.array([2, 0, -100, 8]), bias=f32(r, 9),
                         ignore_index=-100, label_smoothing=0.0, z_loss=0.0, softcap=None, reduction="mean",
                         chunk_size=None, ce_weight=None, lse_square_scale=None, return_z_loss=False),
          {"hidden": FARRAY, "weight": FARRAY, "targets": IARRAY, "bias": FARRAY, "ignore_index": INT,
           "label_smoothing": PROB, "z_loss": FLOAT, "softcap": FLOAT, "reduction": ENUM, "chunk_size": LENGTH,
           "ce_weight": FARRAY, "lse_square_scale": FLOAT, "return_z_loss": BOOL},
          flce_ref, "fused_linear_cross_entropy", "hidden")
    tspec("moe_route", lambda r: dict(router_logits=f32(r, 3, 6), top_k=2, renormalize=True, scoring="softmax",
                                      bias=None),
          {"router_logits": FARRAY, "top_k": LENGTH, "renormalize": BOOL, "scoring": ENUM, "bias": FARRAY},
          _route_ref, "moe_route", "router_logits")

    def experts_build(r: np.random.Generator) -> dict:
        d = _experts_build(r)
        return {n: d[n] for n in ("x", "gate_up_proj", "down_proj", "topk_ids", "topk_weights", "activation")}

    tspec("moe_experts", experts_build,
          {"x": FARRAY, "gate_up_proj": FARRAY, "down_proj": FARRAY, "topk_ids": IARRAY, "topk_weights": FARRAY,
           "activation": ENUM}, lambda k: np_moe_experts(*_experts_common(k)), "moe_experts", "x")

    def fav_ref(k: dict) -> Any:
        need(real(k["dropout_p"]) == 0.0, "dropout")
        need(fdata(k["q"]).dtype != np.float32, "16-bit q")  # flash-attn's varlen dtypes
        cq, ck = i64(k["cu_seqlens_q"]), i64(k["cu_seqlens_k"])
        need(np.asarray(k["cu_seqlens_q"]).dtype == np.int32 and np.asarray(k["cu_seqlens_k"]).dtype == np.int32,
             "int32 cu_seqlens")
        need(cq.ndim == 1 and cq.size >= 2 and ck.shape == cq.shape, "cu_seqlens")
        need(natural(k["max_seqlen_q"]) >= np.diff(cq).max(initial=0)
             and natural(k["max_seqlen_k"]) >= np.diff(ck).max(initial=0), "max_seqlen")
        r = _fav_ref(dict(k, scale=k["softmax_scale"]))
        return (r[0], r[1].T) if flag(k["return_lse"]) else r  # lse (heads, total_q), flash-attn's layout

    tspec("flash_attention_varlen",
          lambda r: dict(q=f16(r, 5, 2, 8), k=f16(r, 6, 1, 8), v=f16(r, 6, 1, 8),
                         cu_seqlens_q=np.array([0, 2, 5], np.int32), cu_seqlens_k=np.array([0, 3, 6], np.int32),
                         max_seqlen_q=3, max_seqlen_k=3, dropout_p=0.0, softmax_scale=None, causal=True,
                         window_size=(-1, -1), softcap=0.0, return_lse=False, q_descale=None, k_descale=None,
                         v_descale=None),
          {"q": FARRAY, "k": FARRAY, "v": FARRAY, "cu_seqlens_q": PTABLE, "cu_seqlens_k": PTABLE,
           "max_seqlen_q": LENGTH, "max_seqlen_k": LENGTH, "dropout_p": FLOAT, "softmax_scale": FLOAT,
           "causal": BOOL, "window_size": INT, "softcap": FLOAT, "return_lse": BOOL, "q_descale": FLOAT,
           "k_descale": FLOAT, "v_descale": FLOAT},
          fav_ref, "flash_attention_varlen", "q")
    return out

# --------------------------------------------------------------------------- serving extensions: cascade merges,
# shared-prefix decode, MLA paged decode, speculative sampling
from pykern.difftest.cases.cascade import np_merge_states  # noqa: E402
from pykern.difftest.cases.mla import np_mla_decode  # noqa: E402
from pykern.difftest.cases.sampling import np_chain_speculative  # noqa: E402


def lse32(a: Any) -> np.ndarray:
    """A log-sum-exp array of the reference's: float32 only (what the merges document)."""
    a = np.asarray(a)
    need(a.dtype == np.float32, f"lse dtype {a.dtype}")
    return a.astype(np.float64)


def nan_merge_states(v: np.ndarray, s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """np_merge_states written for NaN, as the documented formula says (m = max s, w = exp(s - m)): a NaN or
    +inf lse, or a NaN in a weighed v, gives NaN (np_merge_states guards its division and turns such rows into 0
    / -inf, the "empty" state). A state of lse -inf weighs nothing."""
    out, lse = np_merge_states(v, s)
    with np.errstate(all="ignore"):
        m = s.max(1)
        bad = np.isnan(s).any(1) | (m == np.inf)  # (seq, heads): no finite weights
        w = np.where(s == -np.inf, 0.0, np.exp(s - np.where(np.isfinite(m), m, 0.0)[:, None]))
        vbad = (np.isnan(v) & (w[..., None] > 0)).any(1)  # a NaN entry of a state that weighs
    out = np.where(bad[..., None] | vbad, np.nan, out)
    lse = np.where(bad, np.nan, lse)
    return out, lse


def _ms_ref(k: dict) -> Any:
    va, vb = fdata(k["v_a"]), fdata(k["v_b"])
    sa, sb = lse32(k["s_a"]), lse32(k["s_b"])
    need(np.asarray(k["v_a"]).dtype == np.asarray(k["v_b"]).dtype, "dtypes")
    need(va.ndim == 3 and va.shape == vb.shape and sa.shape == sb.shape == va.shape[:2] and va.shape[2] >= 1,
         "shapes")
    return nan_merge_states(np.stack([va, vb], 1), np.stack([sa, sb], 1))


def _state_build(r: np.random.Generator, *names: str) -> dict:
    va, vb = f32(r, 3, 2, 8), f32(r, 3, 2, 8)
    sa, sb = (np.float32(3) * f32(r, 3, 2)), (np.float32(3) * f32(r, 3, 2))
    sa[0, 0] = -np.inf  # an empty segment
    return dict(zip(names, (va, sa, vb, sb)))


spec(Spec("merge_state", ops.merge_state, lambda r: dict(**_state_build(r, "v_a", "s_a", "v_b", "s_b"), **HOST),
          {"v_a": FARRAY, "s_a": FARRAY, "v_b": FARRAY, "s_b": FARRAY, **COMMON}, ref=_ms_ref, kind_of="v_a"))


def _msi_call(k: dict) -> Any:
    res = ops.merge_state_in_place(**k)
    assert res is None, f"merge_state_in_place returned {type(res).__name__}"
    return to_host(k["v"]), to_host(k["s"])


def _msi_ref(k: dict) -> Any:
    v0, s0 = fdata(k["v"]), lse32(k["s"])
    out, lse = _ms_ref(dict(v_a=k["v"], s_a=k["s"], v_b=k["v_other"], s_b=k["s_other"]))
    m = k.get("mask")
    if m is not None:
        m = np.asarray(m)
        need(m.dtype in (np.bool_, np.uint8) and m.shape == v0.shape[:1], "mask")
        keep = m == 0  # masked-off tokens keep their state
        out[keep], lse[keep] = v0[keep], s0[keep]
    return out, lse


spec(Spec("merge_state_in_place", None,
          lambda r: dict(**_state_build(r, "v", "s", "v_other", "s_other"), mask=np.array([True, False, True]),
                         **HOST),
          {"v": FARRAY, "s": FARRAY, "v_other": FARRAY, "s_other": FARRAY, "mask": FARRAY, **COMMON},
          ref=_msi_ref, tol="merge_state", kind_of="v", call=_msi_call, signature_of=ops.merge_state_in_place,
          writes=lambda k: ("v", "s")))


def _mss_ref(k: dict) -> Any:
    v, s = fdata(k["v"]), lse32(k["s"])
    need(v.ndim == 4 and s.shape == v.shape[:3] and v.shape[1] >= 1 and v.shape[3] >= 1, "shapes")
    return nan_merge_states(v, s)


def _mss_build(r: np.random.Generator) -> dict:
    s = np.float32(3) * f32(r, 2, 3, 2)
    s[0, 1, 0] = s[1, :, 1] = -np.inf  # an empty state, and a row of empty states
    return dict(v=f32(r, 2, 3, 2, 8), s=s, **HOST)


spec(Spec("merge_states", ops.merge_states, _mss_build, {"v": FARRAY, "s": FARRAY, **COMMON}, ref=_mss_ref,
          kind_of="v"))


def _spd_ref(k: dict) -> Any:
    layout = choice(k["kv_layout"], ("NHD", "HND"))
    ks, vs = _gather(k, layout)
    kp_dt = np.asarray(k["k_pages"]).dtype
    ksh, vsh = fdata(k["k_shared"]), fdata(k["v_shared"])
    need(np.asarray(k["k_shared"]).dtype == np.asarray(k["v_shared"]).dtype == kp_dt == np.asarray(k["q"]).dtype,
         "dtypes")
    need(ksh.ndim == 3 and ksh.shape == vsh.shape, "shared")
    if layout == "HND":
        ksh, vsh = ksh.transpose(1, 0, 2), vsh.transpose(1, 0, 2)
    q = fdata(k["q"])
    kvh = fdata(k["k_pages"]).shape[2 if layout == "NHD" else 1]
    need(q.ndim == 3 and q.shape[0] == len(ks) and q.shape[2] == fdata(k["k_pages"]).shape[3], "q")
    need(ksh.shape[1:] == (kvh, q.shape[2]) and kvh > 0 and q.shape[1] % kvh == 0, "heads")
    cap = real(k["logits_soft_cap"])
    need(cap >= 0 and np.isfinite(cap), "logits_soft_cap")
    sc = k.get("scale")
    sc = None if sc is None else real(sc)
    need(sc is None or np.isfinite(sc), "scale")
    outs, lses = [], []
    for b in range(q.shape[0]):
        o, l_ = _na(q[b:b + 1], np.concatenate([ksh, ks[b]]), np.concatenate([vsh, vs[b]]), False, sc, (-1, -1), cap)
        outs.append(o[0])
        lses.append(l_[0])
    out, lse = np.stack(outs), np.stack(lses)
    return (out, lse) if flag(k["return_lse"]) else out


spec(Spec("shared_prefix_decode", ops.shared_prefix_decode,
          lambda r: dict(q=f32(r, 2, HQ, D), k_shared=f32(r, 3, KVH, D), v_shared=f32(r, 3, KVH, D), **_paged(r),
                         kv_layout="NHD", scale=None, logits_soft_cap=0.0, return_lse=True, **HOST),
          {"q": FARRAY, "k_shared": FARRAY, "v_shared": FARRAY, "k_pages": FARRAY, "v_pages": FARRAY,
           "kv_indptr": PTABLE, "kv_indices": PTABLE, "kv_last_page_len": PTABLE, "kv_layout": ENUM, "scale": FLOAT,
           "logits_soft_cap": FLOAT, "return_lse": BOOL, **COMMON},
          ref=_spd_ref, tol="paged_decode_attention", kind_of="q"))

# MLA paged decode: bf16, latent widths 512 / 64 (the kernel's only layout), 2 heads, pages of 2 tokens
MLA_HEADS, MLA_PAGE, MLA_LENS = 2, 2, (5, 0, 2)


def as_bf16(a: np.ndarray) -> np.ndarray:
    from pykern.arrays import bfloat16

    return a.astype(bfloat16())


def _mla_inputs(r: np.random.Generator) -> dict:
    b, h = len(MLA_LENS), MLA_HEADS
    return dict(q_nope=as_bf16(f32(r, b, h, 512)), q_pe=as_bf16(f32(r, b, h, 64)),
                ckv_cache=as_bf16(f32(r, 7, MLA_PAGE, 512)), kpe_cache=as_bf16(f32(r, 7, MLA_PAGE, 64)))


def _mla_table(r: np.random.Generator) -> dict:
    per = [-(-n // MLA_PAGE) for n in MLA_LENS]
    return dict(qo_indptr=np.arange(len(MLA_LENS) + 1, dtype=np.int32),
                kv_indptr=np.concatenate([[0], np.cumsum(per)]).astype(np.int32),
                kv_indices=r.permutation(7)[:sum(per)].astype(np.int32), kv_len_arr=np.array(MLA_LENS, np.int32))


def _mla_ref(k: dict, t: dict, scale: float) -> Any:
    """out / lse of MLA decode over run inputs k and plan table t (need: what run checks)."""
    qn, qp, c, p = (np.asarray(k[n]) for n in ("q_nope", "q_pe", "ckv_cache", "kpe_cache"))
    need(all(a.dtype.name == "bfloat16" for a in (qn, qp, c, p)), "dtypes")
    ip, ix, ln = i64(t["kv_indptr"]), i64(t["kv_indices"]), i64(t["kv_len_arr"])
    b = ip.size - 1
    need(qn.shape == (b, t["num_heads"], 512) and qp.shape == (b, t["num_heads"], 64), "q")
    need(c.ndim == 3 and c.shape[2] == 512 and p.shape == c.shape[:2] + (64,) and c.shape[1] == t["page_size"],
         "caches")
    used = ix[:ip[-1]]
    need(((used >= 0) & (used < c.shape[0])).all(), "kv_indices")
    need(((ln >= 0) & (ln <= np.diff(ip) * c.shape[1])).all(), "kv_len_arr")
    return np_mla_decode(qn, qp, c, p, ip, ix, ln, scale)


def _mla_new_plan(qo_indptr: Any, kv_indptr: Any, kv_indices: Any, kv_len_arr: Any, num_heads: int,
                  head_dim_ckv: int = 512, head_dim_kpe: int = 64, page_size: int = 1, causal: bool = False,
                  sm_scale: float | None = None, q_data_type: Any = "bf16", kv_data_type: Any = None, *,
                  num_splits: int | None = None, num_sms: int = 132, like: Any = None,
                  backend: str | None = None) -> Any:
    """MLAPagedDecodePlan(like, backend).plan(...): the signature the plan spec's roles cover."""
    p = ops.MLAPagedDecodePlan(like=like, backend=backend)
    p.plan(qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_heads, head_dim_ckv, head_dim_kpe, page_size, causal,
           sm_scale, q_data_type, kv_data_type, num_splits=num_splits, num_sms=num_sms)
    return p


def _mla_plan_build(r: np.random.Generator) -> dict:
    return dict(**_mla_table(r), num_heads=MLA_HEADS, head_dim_ckv=512, head_dim_kpe=64, page_size=MLA_PAGE,
                causal=False, sm_scale=0.07, q_data_type="bf16", kv_data_type="bf16", num_splits=2, num_sms=132,
                like=None, backend="host")


MLA_RUN_INPUTS = ("q_nope", "q_pe", "ckv_cache", "kpe_cache")


def _mla_plan_call(k: dict) -> Any:
    plan = _mla_new_plan(**{n: v for n, v in k.items() if not n.startswith("_")})
    inputs = _mla_inputs(np.random.default_rng(0))
    k["_run"], k["_kind"] = inputs, inputs["q_nope"]
    try:
        return plan.run(**inputs, return_lse=True)
    except (ArgumentError, ArgumentTypeError) as e:
        # a plan of another geometry (3 heads, pages of 1, ...) is valid; run() must then refuse the inputs
        # made for the spec's geometry, naming one of them. Any other error (a page index past the cache's
        # pages, which only run can see) must name the plan's argument: the engine judges it.
        if str(e).split(":")[0] in MLA_RUN_INPUTS:
            k["_rejected"] = True
            return RUN_REJECTED
        raise


def _mla_plan_ref(k: dict) -> Any:
    for n in ("num_heads", "page_size", "num_sms"):
        need(natural(k[n]) >= 1, n)
    need(natural(k["head_dim_ckv"]) == 512 and natural(k["head_dim_kpe"]) == 64, "latent widths")
    need(k["num_splits"] is None or natural(k["num_splits"]) >= 1, "num_splits")
    need(isinstance(k["causal"], (bool, np.bool_)), "causal")
    sc = real(k["sm_scale"])
    need(np.isfinite(sc), "sm_scale")
    choice(k["q_data_type"], ("bf16", "bfloat16"))
    need(k["kv_data_type"] in (None, "bf16", "bfloat16"), "kv_data_type")
    qo, ip = i64(k["qo_indptr"]), i64(k["kv_indptr"])
    need(ip.ndim == 1 and ip.size >= 2 and qo.shape == ip.shape and (qo == np.arange(ip.size)).all(), "qo_indptr")
    ix, ln = i64(k["kv_indices"]), i64(k["kv_len_arr"])
    need(ix.ndim == 1 and ln.shape == (ip.size - 1,) and ip[0] == 0 and (np.diff(ip) >= 0).all()
         and ip[-1] <= ix.size, "kv_indptr")
    need(all(((a >= -2**31) & (a < 2**31)).all() for a in (qo, ip, ix, ln)), "int32 values")
    if k.get("_rejected"):
        return RUN_REJECTED
    return _mla_ref(k["_run"], dict(k, num_heads=int(k["num_heads"]), page_size=int(k["page_size"])), sc)


spec(Spec("MLAPagedDecodePlan", None, _mla_plan_build,
          {"qo_indptr": PTABLE, "kv_indptr": PTABLE, "kv_indices": PTABLE, "kv_len_arr": IARRAY, "num_heads": LENGTH,
           "head_dim_ckv": LENGTH, "head_dim_kpe": LENGTH, "page_size": LENGTH, "causal": BOOL, "sm_scale": FLOAT,
           "q_data_type": ENUM, "kv_data_type": ENUM, "num_splits": LENGTH, "num_sms": LENGTH, "like": FIXED,
           "backend": FIXED},
          ref=_mla_plan_ref, tol="mla_decode", kind_of="_kind", call=_mla_plan_call, signature_of=_mla_new_plan,
          writes=lambda k: ("_run", "_kind", "_rejected")))

_MLA_RUN_PLAN: dict[str, Any] = {}


def _mla_run_plan() -> Any:
    # one plan per process: run() must leave it usable whatever the previous (bad) call was
    if "plan" not in _MLA_RUN_PLAN:
        _MLA_RUN_PLAN["plan"] = _mla_new_plan(**_mla_plan_build(np.random.default_rng(0)))
    return _MLA_RUN_PLAN["plan"]


def _mla_run_call(k: dict) -> Any:
    return _mla_run_plan().run(**k)


def _mla_run_ref(k: dict) -> Any:
    t = _mla_plan_build(np.random.default_rng(0))
    for n, shape, dt in (("out", (len(MLA_LENS), MLA_HEADS, 512), "bfloat16"),
                         ("lse", (len(MLA_LENS), MLA_HEADS), "float32")):
        a = k.get(n)
        need(a is None or (isinstance(a, np.ndarray) and a.shape == shape and a.dtype.name == dt
                           and a.flags.c_contiguous), n)
    out, lse = _mla_ref(k, t, t["sm_scale"])
    return (out, lse) if flag(k["return_lse"]) else out


MLA_RUN_ROLES = {"q_nope": FARRAY, "q_pe": FARRAY, "ckv_cache": FARRAY, "kpe_cache": FARRAY, "out": OUT,
                 "lse": OUT, "return_lse": BOOL, **COMMON}
spec(Spec("MLAPagedDecodePlan.run", None,
          lambda r: dict(**_mla_inputs(r), out=None, lse=None, return_lse=True, stream=None, backend=None),
          MLA_RUN_ROLES, ref=_mla_run_ref, tol="mla_decode", kind_of="q_nope", call=_mla_run_call,
          signature_of=ops.MLAPagedDecodePlan.run, writes=lambda k: ("out", "lse")))
spec(Spec("MLAPagedDecodePlan.run[out]", None,
          lambda r: dict(**_mla_inputs(r), out=as_bf16(np.zeros((len(MLA_LENS), MLA_HEADS, 512), np.float32)),
                         lse=np.zeros((len(MLA_LENS), MLA_HEADS), np.float32), return_lse=False, stream=None,
                         backend=None),
          MLA_RUN_ROLES, ref=_mla_run_ref, tol="mla_decode", kind_of="q_nope", call=_mla_run_call,
          signature_of=ops.MLAPagedDecodePlan.run, writes=lambda k: ("out", "lse")))


def _spec_call(k: dict) -> Any:
    out, acc, emit = ops.chain_speculative_sampling(**k)
    for n, got in (("maybe_output_accepted_token_num", acc), ("maybe_output_emitted_draft_token_num", emit)):
        assert k[n] is None or got is k[n], f"{n}: the given array is not the one returned"
    return out, acc, emit


def _spec_ref(k: dict) -> Any:
    d, t = np.asarray(k["draft_probs"]), np.asarray(k["target_probs"])
    need(d.dtype == t.dtype and d.dtype.name in ("float32", "bfloat16", "float16"), "dtypes")
    need(d.ndim == 3 and t.shape == (d.shape[0], d.shape[1] + 1, d.shape[2]) and d.shape[2] >= 1, "shapes")
    ids = i64(k["draft_token_ids"])
    need(ids.shape == d.shape[:2] and ((ids >= 0) & (ids < d.shape[2])).all(), "draft_token_ids")
    words = {}
    for n in ("seed", "offset"):
        v = k[n]
        if n == "offset" and v is None:  # seed alone: offset 0 (FlashInfer's default)
            v = 0
        if isinstance(v, (int, np.integer)) and not isinstance(v, bool):
            need(-2**63 <= int(v) < 2**64, n)
            words[n] = int(v) % 2**64
        else:
            a = np.asarray(v)
            need(a.dtype in (np.int64, np.uint64) and a.ndim == 1 and a.shape[0] in (1, d.shape[0]), n)
            words[n] = np.broadcast_to(a.view(np.uint64), d.shape[:1])
    out, acc, emit = np_chain_speculative(d.astype(np.float32), ids, t.astype(np.float32), words["seed"],
                                          words["offset"])
    counts = []
    for n, c in (("maybe_output_accepted_token_num", acc), ("maybe_output_emitted_draft_token_num", emit)):
        start = k[n]
        if start is None:
            counts.append(c)
            continue
        start = np.asarray(start)
        need(start.dtype == np.int32 and start.shape == c.shape, n)
        counts.append((start.astype(np.int64) + c).astype(np.int32))  # added in place, int32 wraps
    return out, counts[0], counts[1]


def _spec_build(r: np.random.Generator) -> dict:
    b, n, v = 2, 3, 6
    d = r.random((b, n, v)).astype(np.float32)
    t = r.random((b, n + 1, v)).astype(np.float32)
    d, t = d / d.sum(-1, keepdims=True), t / t.sum(-1, keepdims=True)
    return dict(draft_probs=d.astype(np.float32), draft_token_ids=r.integers(0, v, (b, n)).astype(np.int32),
                target_probs=t.astype(np.float32), maybe_output_accepted_token_num=np.array([1, 0], np.int32),
                maybe_output_emitted_draft_token_num=np.array([0, 4], np.int32), deterministic=True, generator=None,
                seed=4321, offset=7, **HOST)


spec(Spec("chain_speculative_sampling", None, _spec_build,
          {"draft_probs": PROB, "draft_token_ids": IARRAY, "target_probs": PROB,
           "maybe_output_accepted_token_num": OUT, "maybe_output_emitted_draft_token_num": OUT,
           "deterministic": BOOL, "generator": FIXED, "seed": INT, "offset": INT, **COMMON},
          ref=_spec_ref, call=_spec_call, signature_of=ops.chain_speculative_sampling,
          writes=lambda k: ("maybe_output_accepted_token_num", "maybe_output_emitted_draft_token_num")))
