"""Difftest cases for the forward / prefill kernels (forward.cu, attention_fwd_fma.cu) and their NumPy float64 references.

Shape lists name the edge values one by one rather than as cross products:
flash_attention sweeps (n_q, n_k) at one head config, head_dim at one length,
GQA ratios at a short length, each causal and not; rms_norm covers dims 1, 8,
769, 5125, 65536. Cases that would take the numba simulator minutes (n = 300,
dim 65536, head_dim 256 at length 300) carry note="big".
"""
from __future__ import annotations

from typing import Any, Iterator

import numpy as np

from ..case import Case, register_case_groups

# --------------------------------------------------------------------------- NumPy float64 references


def _f64(a: Any) -> np.ndarray:
    return np.asarray(a).astype(np.float64)


def np_embedding(ids: np.ndarray, table: np.ndarray) -> np.ndarray:
    return _f64(table)[np.asarray(ids, np.int64)]


def np_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, pos_offset: int = 0,
            style: str = "interleaved", *, position_ids: Any = None, inverse: bool = False) -> np.ndarray:
    """float64 RoPE. Tables (max_pos, head_dim/2), or HF (max_pos, head_dim) applied the HF way:
    x * cos + rotate(x) * sin with rotate_half (style "half") or rotate_every_two ("interleaved")."""
    x = _f64(x)
    n_tokens, half = x.shape[-3], x.shape[-1] // 2
    if position_ids is None:
        pos = np.arange(pos_offset, pos_offset + n_tokens)
    else:
        pos = np.asarray(position_ids).astype(np.int64)
        if pos.ndim == 2 and pos.shape[0] == 1:
            pos = pos[0]
    # (tokens, 1, width) or (batch, tokens, 1, width): broadcasts over heads (and batch)
    c, s = _f64(cos)[pos][..., None, :], _f64(sin)[pos][..., None, :]
    if inverse:
        s = -s
    if _f64(cos).shape[-1] == x.shape[-1]:  # HF full tables
        if style == "half":
            rot = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
        else:
            rot = np.empty_like(x)
            rot[..., 0::2], rot[..., 1::2] = -x[..., 1::2], x[..., 0::2]
        return x * c + rot * s
    if style == "interleaved":
        a, b = x[..., 0::2], x[..., 1::2]
    else:
        a, b = x[..., :half], x[..., half:]
    ra, rb = a * c - b * s, a * s + b * c
    out = np.empty_like(x)
    if style == "interleaved":
        out[..., 0::2], out[..., 1::2] = ra, rb
    else:
        out[..., :half], out[..., half:] = ra, rb
    return out


def np_silu_gate(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    g = _f64(gate)
    return g / (1.0 + np.exp(-g)) * _f64(up)


def np_silu_gate_backward(gate: np.ndarray, up: np.ndarray, grad_out: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(grad_gate, grad_up) of silu(gate) * up in float64."""
    g, u, dy = _f64(gate), _f64(up), _f64(grad_out)
    with np.errstate(over="ignore"):
        s = 1.0 / (1.0 + np.exp(-g))
    return dy * u * (s + g * s * (1.0 - s)), dy * g * s


def np_rms_norm(x: np.ndarray, weight: np.ndarray, eps: float = 1e-6, offset: float = 0.0) -> np.ndarray:
    x = _f64(x)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * (offset + _f64(weight))


def np_causal_attn_softmax(scores: np.ndarray, past_len: int = 0) -> np.ndarray:
    s = _f64(scores)
    n_q, _, kv_len = s.shape
    visible = np.arange(kv_len)[None, :] <= past_len + np.arange(n_q)[:, None]  # (n_q, kv_len)
    s = np.where(visible[:, None, :], s, -np.inf)
    m = s.max(axis=-1, keepdims=True)  # NaN when a visible score is NaN
    m = np.where(m == -np.inf, 0.0, m)
    with np.errstate(invalid="ignore"):
        p = np.exp(s - m)  # +inf - +inf: NaN, as torch
        den = p.sum(axis=-1, keepdims=True)
        # torch's attention softmax: a row of -inf only is 0; a NaN / +inf score makes the row NaN
        return np.where(den == 0.0, 0.0, p / np.where(den == 0.0, 1.0, den))


# --------------------------------------------------------------------------- input helpers


def _cast(a: np.ndarray, kind: str) -> np.ndarray:
    if kind == "bf16":
        from ...arrays import bfloat16

        return a.astype(bfloat16())
    return a.astype(np.float16 if kind == "f16" else np.float32)


def _normal(rng: np.random.Generator, shape: tuple[int, ...], kind: str, scale: float = 1.0) -> np.ndarray:
    return _cast(rng.standard_normal(shape) * scale, kind)


def np_rms_heads(x: np.ndarray, w: np.ndarray, eps: float, offset: float) -> np.ndarray:
    """float64 RMS norm over the last axis (each head's head_dim): x / sqrt(mean(x^2) + eps) * (offset + w)."""
    x = _f64(x)
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * (offset + _f64(w))


def np_qk_norm_rope(q: np.ndarray, k: np.ndarray, cos: np.ndarray, sin: np.ndarray, wq: Any, wk: Any,
                    eps: float = 1e-6, offset: float = 0.0, style: str = "half", **kw: Any) -> dict:
    """float64 qk_norm_rope: each head of q and k RMS-normalised over head_dim (when wq / wk are given), then
    rotated as np_rope."""
    if wq is not None:
        q, k = np_rms_heads(q, wq, eps, offset), np_rms_heads(k, wk, eps, offset)
    return {"q_out": np_rope(q, cos, sin, style=style, **kw), "k_out": np_rope(k, cos, sin, style=style, **kw)}


def np_qk_norm_rope_backward(q: np.ndarray, k: np.ndarray, gq: np.ndarray, gk: np.ndarray, cos: np.ndarray,
                             sin: np.ndarray, wq: np.ndarray, wk: np.ndarray, eps: float = 1e-6,
                             offset: float = 0.0, style: str = "half", **kw: Any) -> dict:
    """float64 gradients of np_qk_norm_rope: the rotation's transpose (np_rope inverse) of the output gradient,
    then the RMS norm's backward over head_dim; the weight gradients summed over every row."""
    out = {}
    for name, x, g, w in (("q", q, gq, wq), ("k", k, gk, wk)):
        x = _f64(x)
        gn = np_rope(g, cos, sin, style=style, inverse=True, **kw)
        d = x.shape[-1]
        r = 1.0 / np.sqrt((x * x).mean(-1, keepdims=True) + eps)
        wo = offset + _f64(w)
        dot = (gn * wo * x).sum(-1, keepdims=True)
        out["grad_" + name] = r * (wo * gn - x * r * r * dot / d)
        out["grad_" + name + "_weight"] = (gn * x * r).reshape(-1, d).sum(0)
    return out


def rope_tables(max_pos: int, head_dim: int, base: float = 10000.0) -> tuple[np.ndarray, np.ndarray]:
    """fp32 cos/sin tables (max_pos, head_dim // 2) with the usual inverse-frequency spacing."""
    inv = base ** (-np.arange(0, head_dim // 2, dtype=np.float64) * 2.0 / head_dim)
    ang = np.arange(max_pos, dtype=np.float64)[:, None] * inv[None, :]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def hf_rope_tables(max_pos: int, head_dim: int, style: str = "half",
                   base: float = 10000.0) -> tuple[np.ndarray, np.ndarray]:
    """fp32 (max_pos, head_dim) tables as Hugging Face builds them: cat((freqs, freqs)) for style
    "half", each frequency repeated per pair (repeat_interleave(2)) for "interleaved"."""
    c, s = rope_tables(max_pos, head_dim, base)
    if style == "half":
        return np.concatenate([c, c], axis=-1), np.concatenate([s, s], axis=-1)
    return np.repeat(c, 2, axis=-1), np.repeat(s, 2, axis=-1)


def _sfx(kind: str) -> str:
    from ...arrays import kernel_suffix

    return kernel_suffix(kind)


# --------------------------------------------------------------------------- cases


def _embedding_cases(rng: np.random.Generator, specs: Any = None) -> Iterator[Case]:
    from ... import ops

    for kind, vocab, dim, n in specs or (("f32", 50, 64, 9), ("f32", 37, 33, 5), ("f32", 11, 1, 4),
                                         ("bf16", 50, 64, 9), ("bf16", 20, 13, 3), ("f32", 50_000, 8, 6)):
        table = _normal(rng, (vocab, dim), kind)
        ids = rng.integers(0, vocab, size=n).astype(np.int64)
        ids[0], ids[-1] = vocab - 1, 0
        if vocab == 20:  # an all-padding batch: every id is the pad id 0
            ids[:] = 0
        yield Case(op="embedding", dtype=kind, shape=f"{n}x{vocab}x{dim}", kernels=("embedding" + _sfx(kind),),
                   run=lambda b, ids=ids, t=table: {"out": ops.embedding(ids, t, backend=b)},
                   reference=lambda ids=ids, t=table: {"out": np_embedding(ids, t)})


def _rope_cases(rng: np.random.Generator, specs1: Any = None, specs2: Any = None) -> Iterator[Case]:
    from ... import ops

    # (kind, x shape, pos_offset, style, inplace); head_dim 6 (half 3) and 10 take the scalar path
    specs = (
        ("f32", (5, 3, 64), 0, "interleaved", False),
        ("f32", (5, 3, 64), 7, "half", False),
        ("f32", (2, 4, 2, 80), 3, "half", False),
        ("f32", (3, 2, 6), 1, "interleaved", False),
        ("f32", (3, 2, 10), 0, "half", True),
        ("f32", (1, 1, 128), 30, "interleaved", True),
        ("bf16", (5, 3, 64), 2, "interleaved", False),
        ("bf16", (2, 3, 2, 128), 0, "half", True),
        ("bf16", (3, 2, 6), 0, "half", False),
    )
    for kind, shp, off, style, inplace in specs1 or specs:
        x = _normal(rng, shp, kind)
        cos, sin = rope_tables(off + shp[-3] + 2, shp[-1])

        def run(b: str, x=x, cos=cos, sin=sin, off=off, style=style, inplace=inplace) -> dict:
            xx = x.copy()
            out = ops.rope(xx, cos, sin, pos_offset=off, style=style, inplace=inplace, backend=b)
            if inplace:
                assert out is xx
            return {"out": out}

        yield Case(op="rope", dtype=kind, shape="x".join(map(str, shp)) + f"-{style}-off{off}" + ("-inplace" if inplace else ""),
                   kernels=("rope" + _sfx(kind),), run=run,
                   reference=lambda x=x, cos=cos, sin=sin, off=off, style=style: {"out": np_rope(x, cos, sin, off, style)})

    # position_ids ("pid": 1-D shared, "pid1": (1, n) shared, "pidb": one row per batch), HF (max_pos, head_dim)
    # tables ("hf") and inverse rotation; vector (half % 4 == 0) and scalar paths, f32 and bf16.
    # (kind, x shape, style, positions, hf tables, inverse, pos_offset)
    default2 = (
        ("f32", (5, 3, 64), "half", "pid", False, False, 0),
        ("f32", (2, 5, 2, 64), "interleaved", "pidb", False, True, 0),
        ("f32", (2, 3, 2, 10), "half", "pid1", True, False, 0),
        ("f32", (4, 2, 64), "half", None, True, False, 3),
        ("f32", (4, 2, 64), "interleaved", None, True, True, 1),
        ("f32", (3, 2, 2, 6), "interleaved", "pidb", True, True, 0),
        ("f32", (7, 1, 128), "half", None, False, True, 5),
        ("f32", (2, 7, 2, 128), "half", "pidb", True, True, 0),
        ("bf16", (2, 5, 2, 64), "half", "pidb", True, False, 0),
        ("bf16", (5, 3, 64), "interleaved", "pid", True, True, 0),
        ("bf16", (3, 2, 6), "interleaved", None, True, True, 2),
    )
    for kind, shp, style, pid, hf, inverse, off in specs2 or default2:
        x = _normal(rng, shp, kind)
        max_pos = 40
        cos, sin = hf_rope_tables(max_pos, shp[-1], style) if hf else rope_tables(max_pos, shp[-1])
        n = shp[-3]
        if pid is None:
            position_ids = None
        elif pid == "pidb":
            position_ids = rng.integers(0, max_pos, size=(shp[0], n)).astype(np.int32)
            position_ids[0, 0] = max_pos - 1
        else:
            position_ids = rng.permutation(max_pos)[:n].astype(np.int64)
            position_ids[-1] = 0
            if pid == "pid1":
                position_ids = position_ids[None]

        def run(b: str, x=x, cos=cos, sin=sin, style=style, pids=position_ids, inverse=inverse, off=off) -> dict:
            return {"out": ops.rope(x, cos, sin, pos_offset=off, position_ids=pids, style=style, inverse=inverse,
                                    backend=b)}

        tag = "-".join(t for t in (style, pid or f"off{off}", "hf" if hf else "", "inv" if inverse else "") if t)
        yield Case(op="rope", dtype=kind, shape="x".join(map(str, shp)) + f"-{tag}",
                   kernels=("rope" + _sfx(kind),), run=run,
                   reference=lambda x=x, cos=cos, sin=sin, style=style, pids=position_ids, inverse=inverse, off=off:
                   {"out": np_rope(x, cos, sin, off, style, position_ids=pids, inverse=inverse)})


def _qk_norm_rope_cases(rng: np.random.Generator, specs: Any = None) -> Iterator[Case]:
    """q and k in one launch (GQA ratios 1, 2, 4, 8, num_kv_heads 1), with and without the fused norm, the
    norm's backward; 16-byte (head_dim 64 / 128 / 256 / 80) and scalar (head_dim 6 / 36) paths, per-row
    positions and HF tables, in-place, Gemma's offset."""
    from ... import ops

    # (kind, q shape, kv heads, style, norm, positions ("pidb" | None), hf tables, inplace, offset)
    default = (
        ("f32", (2, 5, 4, 64), 2, "half", True, None, False, False, 0.0),
        ("f32", (3, 8, 128), 1, "half", True, "pidb", True, False, 1.0),
        ("f32", (2, 3, 8, 80), 8, "interleaved", True, None, False, True, 0.0),
        ("f32", (4, 2, 6), 2, "half", True, None, False, False, 0.0),
        ("f32", (3, 4, 36), 1, "interleaved", False, "pidb", True, False, 0.0),
        ("bf16", (2, 5, 8, 128), 1, "half", True, "pidb", True, False, 0.0),
        ("bf16", (3, 4, 256), 2, "half", True, None, False, True, 1.0),
        ("bf16", (1, 1, 8, 64), 8, "interleaved", False, None, False, False, 0.0),
        ("bf16", (2, 3, 2, 6), 1, "half", True, None, False, False, 0.0),
    )
    for kind, qs, hk, style, norm, pid, hf, inplace, off in specs or default:
        ks = qs[:-2] + (hk, qs[-1])
        q, k = _normal(rng, qs, kind), _normal(rng, ks, kind)
        d = qs[-1]
        wq = _normal(rng, (d,), kind) if norm else None
        wk = _normal(rng, (d,), kind) if norm else None
        max_pos = 24
        cos, sin = hf_rope_tables(max_pos, d, style) if hf else rope_tables(max_pos, d)
        n = qs[-3]
        pshape = (qs[0], n) if len(qs) == 4 else (n,)  # per-row positions, or shared ones for 3-D q
        pids = rng.integers(0, max_pos, size=pshape).astype(np.int64) if pid else None
        kw = {} if pids is None else {"position_ids": pids}
        off_kw = {} if pids is not None else {"pos_offset": 2}
        tag = "x".join(map(str, qs)) + f"-kv{hk}-{style}" + "".join(
            t for t in ("-norm" if norm else "", "-pidb" if pid else "", "-hf" if hf else "",
                        "-inplace" if inplace else "", f"-off{off:g}" if norm else "") if t)

        def run(b: str, q=q, k=k, cos=cos, sin=sin, wq=wq, wk=wk, style=style, inplace=inplace, off=off,
                kw=kw, off_kw=off_kw) -> dict:
            qq, kk = q.copy(), k.copy()
            oq, ok = ops.qk_norm_rope(qq, kk, cos, sin, q_weight=wq, k_weight=wk, weight_offset=off, style=style,
                                      inplace=inplace, backend=b, **kw, **off_kw)
            if inplace:
                assert oq is qq and ok is kk
            return {"q_out": oq, "k_out": ok}

        def ref(q=q, k=k, cos=cos, sin=sin, wq=wq, wk=wk, style=style, off=off, kw=kw, off_kw=off_kw) -> dict:
            return np_qk_norm_rope(q, k, cos, sin, wq, wk, offset=off, style=style, **kw, **off_kw)

        yield Case(op="qk_norm_rope", dtype=kind, shape=tag, kernels=("rope" + _sfx(kind),), run=run, reference=ref)
        if not norm:
            continue
        gq, gk = _normal(rng, qs, kind), _normal(rng, ks, kind)

        def run_b(b: str, q=q, k=k, gq=gq, gk=gk, cos=cos, sin=sin, wq=wq, wk=wk, style=style, off=off, kw=kw,
                  off_kw=off_kw) -> dict:
            r = ops.qk_norm_rope_backward(q, k, gq, gk, cos, sin, wq, wk, weight_offset=off, style=style, backend=b,
                                          **kw, **off_kw)
            return dict(zip(("grad_q", "grad_k", "grad_q_weight", "grad_k_weight"), r))

        def ref_b(q=q, k=k, gq=gq, gk=gk, cos=cos, sin=sin, wq=wq, wk=wk, style=style, off=off, kw=kw,
                  off_kw=off_kw) -> dict:
            return np_qk_norm_rope_backward(q, k, gq, gk, cos, sin, wq, wk, offset=off, style=style, **kw, **off_kw)

        yield Case(op="qk_norm_rope_backward", dtype=kind, shape=tag,
                   kernels=("rope_norm_backward" + _sfx(kind), "norm_grad_reduce"), run=run_b, reference=ref_b)


def _silu_cases(rng: np.random.Generator, specs: Any = None) -> Iterator[Case]:
    from ... import ops

    for kind, shp in specs or (("f32", (1,)), ("f32", (7,)), ("f32", (3, 1003)), ("f32", (4, 1024)), ("bf16", (5,)),
                               ("bf16", (3, 1003)), ("bf16", (2, 2048))):
        gate = _normal(rng, shp, kind, 4.0)
        gate.reshape(-1)[:1] = _cast(np.array([-100.0]), kind)  # exp overflow side
        up = _normal(rng, shp, kind)
        yield Case(op="silu_gate", dtype=kind, shape="x".join(map(str, shp)), kernels=("silu_gate" + _sfx(kind),),
                   run=lambda b, g=gate, u=up: {"out": ops.silu_gate(g, u, backend=b)},
                   reference=lambda g=gate, u=up: {"out": np_silu_gate(g, u)})


def _silu_backward_cases(rng: np.random.Generator, specs: Any = None) -> Iterator[Case]:
    from ... import ops

    # sizes below, at and past the 4 / 8-element vectors, a tail, and one of the three inputs unaligned
    for kind, shp, unaligned in specs or (("f32", (1,), False), ("f32", (7,), False), ("f32", (3, 1003), False),
                                 ("f32", (4, 1024), False), ("f32", (2, 37), True), ("bf16", (5,), False),
                                 ("bf16", (3, 1003), False), ("bf16", (2, 2048), False), ("bf16", (2, 37), True)):
        gate = _normal(rng, shp, kind, 4.0)
        flat = gate.reshape(-1)
        flat[:1] = _cast(np.array([-100.0]), kind)  # exp overflow side
        if flat.size > 2:
            flat[1:3] = _cast(np.array([100.0, 0.0]), kind)
        up = _normal(rng, shp, kind)
        dy = _normal(rng, shp, kind)
        if unaligned:  # the same values one element past an aligned start: the scalar path
            buf = np.empty(dy.size + 1, dy.dtype)
            buf[1:] = dy.reshape(-1)
            dy = buf[1:].reshape(shp)

        def run(b: str, g=gate, u=up, dy=dy) -> dict:
            gg, gu = ops.silu_gate_backward(g, u, dy, backend=b)
            return {"grad_gate": gg, "grad_up": gu}

        def ref(g=gate, u=up, dy=dy) -> dict:
            gg, gu = np_silu_gate_backward(g, u, dy)
            return {"grad_gate": gg, "grad_up": gu}

        yield Case(op="silu_gate_backward", dtype=kind, shape="x".join(map(str, shp)) + ("-unaligned" if unaligned else ""),
                   kernels=("silu_gate_backward" + _sfx(kind),), run=run, reference=ref)


def _rms_cases(rng: np.random.Generator, only: Any = None) -> Iterator[Case]:
    from ... import ops

    specs = only or (("f32", (3, 1)), ("f32", (5, 8)), ("f32", (2, 3, 64)), ("f32", (3, 769)), ("f32", (2, 1024)),
             ("f32", (2, 5125)), ("f32", (1, 65536)), ("bf16", (5, 8)), ("bf16", (3, 769)), ("bf16", (2, 4096)),
             ("bf16", (2, 5125)), ("bf16", (1, 65536)),
             ("f32", (3, 1000)), ("bf16", (2, 1000)), ("bf16", (2, 16384)))  # register-cached rows, partial 2nd slot
    for kind, shp in specs:
        x = _normal(rng, shp, kind, 2.0)
        w = _cast(1.0 + 0.1 * rng.standard_normal(shp[-1]), kind)
        yield Case(op="rms_norm", dtype=kind, shape="x".join(map(str, shp)), kernels=("rms_norm" + _sfx(kind),),
                   run=lambda b, x=x, w=w: {"out": ops.rms_norm(x, w, 1e-6, backend=b)},
                   reference=lambda x=x, w=w: {"out": np_rms_norm(x, w, 1e-6)},
                   note="big" if shp[-1] >= 65536 else "")
    if only is None:  # Gemma: x * (1 + w) with w near 0, both paths (16-byte and scalar) in each dtype
        for kind, shp in (("f32", (3, 64)), ("f32", (2, 13)), ("bf16", (3, 64)), ("bf16", (2, 13)),
                          ("f16", (3, 64)), ("f16", (2, 13))):
            x = _normal(rng, shp, kind, 2.0)
            w = _cast(0.1 * rng.standard_normal(shp[-1]), kind)
            yield Case(op="rms_norm", dtype=kind, shape="x".join(map(str, shp)) + "-offset1",
                       kernels=("rms_norm" + _sfx(kind),),
                       run=lambda b, x=x, w=w: {"out": ops.rms_norm(x, w, 1e-6, offset=1.0, backend=b)},
                       reference=lambda x=x, w=w: {"out": np_rms_norm(x, w, 1e-6, offset=1.0)})


def _softmax_cases(rng: np.random.Generator) -> Iterator[Case]:
    from ... import ops

    # (n_q, n_heads, kv_len, past_len); the 1500-key rows take the block-per-row path
    # + float4 path edges: kv % 4 != 0 (scalar), visible ends inside a chunk, a misaligned base (scalar)
    for n_q, h, kv, past, misaligned in ((1, 2, 1, 0, 0), (5, 3, 12, 7, 0), (6, 2, 6, 0, 0), (17, 2, 300, 283, 0),
                                         (4, 1, 1500, 1496, 0), (3, 2, 40, 0, 0), (9, 2, 7, 0, 0), (9, 2, 64, 1, 0),
                                         (5, 1, 36, 2, 1), (3, 1, 1504, 1497, 1)):
        s = (rng.standard_normal((n_q, h, kv)) * 5.0).astype(np.float32)
        if misaligned:  # same values, base 4 bytes past a 16-byte boundary
            s = np.concatenate([np.zeros(1, np.float32), s.ravel()])[1:].reshape(s.shape)
        if kv > 4:
            s[0, 0, 1] = -np.inf  # a masked-out-by-caller score stays 0, the rest stays finite
        yield Case(op="causal_attn_softmax", dtype="f32",
                   shape=f"{n_q}x{h}x{kv}-past{past}" + ("-misaligned" if misaligned else ""),
                   kernels=("causal_attn_softmax",),
                   run=lambda b, s=s, p=past: {"out": ops.causal_attn_softmax(s, p, backend=b)},
                   reference=lambda s=s, p=past: {"out": np_causal_attn_softmax(s, p)})


def _f16_cases(rng: np.random.Generator) -> Iterator[Case]:
    """float16 I/O: the bf16 shapes that reach each path (vector, scalar tail, unaligned, register-cached
    rows, block per row). Drawn after every other case, so the f32/bf16 cases keep their data."""
    yield from _embedding_cases(rng, (("f16", 50, 64, 9), ("f16", 20, 13, 3)))
    yield from _rope_cases(rng, (("f16", (5, 3, 64), 2, "interleaved", False), ("f16", (2, 3, 2, 128), 0, "half", True),
                                 ("f16", (3, 2, 6), 0, "half", False)),
                           (("f16", (2, 5, 2, 64), "half", "pidb", True, False, 0),
                            ("f16", (3, 2, 6), "interleaved", None, True, True, 2)))
    yield from _qk_norm_rope_cases(rng, (("f16", (2, 5, 4, 128), 2, "half", True, "pidb", True, False, 0.0),
                                         ("f16", (3, 2, 6), 1, "interleaved", True, None, False, True, 1.0)))
    yield from _silu_cases(rng, (("f16", (5,)), ("f16", (3, 1003)), ("f16", (2, 2048))))
    yield from _silu_backward_cases(rng, (("f16", (5,), False), ("f16", (3, 1003), False), ("f16", (2, 37), True)))
    yield from _rms_cases(rng, (("f16", (5, 8)), ("f16", (3, 769)), ("f16", (2, 1000)), ("f16", (2, 4096)),
                                ("f16", (2, 16384)), ("f16", (1, 65536))))


cases = register_case_groups(
    "forward",
    _embedding_cases, _rope_cases, _qk_norm_rope_cases, _silu_cases, _silu_backward_cases, _rms_cases, _softmax_cases,
    _f16_cases,
)
