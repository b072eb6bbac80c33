"""Difftest cases for the training family (kernels_cu/training.cu, attention_bwd_fma.cu)
plus the NumPy float64 references of its ops.

Shapes cover the edges docs/design.md names ("Tests and tolerance"): sizes that are not multiples
of a block or of 4 (scalar paths) next to multiples of 4 (vector paths), one
row, vocab 1 .. 131072 with some / no / all rows padded, attention seq 1 .. 200
(2049 for flash), head_dim 32/64/80/96/128/256, GQA 1/2/4/8 and n_kv_heads = 1,
naive and flash methods, flash with and without a given out/lse. Cases that
would take the numba simulator minutes carry note="big" (host vs NumPy only).
"""
from __future__ import annotations

from typing import Any, Iterator

import numpy as np

from ..case import Case, register_case_groups

# --------------------------------------------------------------------------- NumPy float64 references


def f64(a: Any) -> np.ndarray:
    return np.asarray(a, dtype=np.float64)


def np_transpose_2d(x: Any) -> np.ndarray:
    return np.ascontiguousarray(np.swapaxes(f64(x), -1, -2))


def np_softmax_backward(probs: Any, grad_out: Any) -> np.ndarray:
    p, g = f64(probs), f64(grad_out)
    return p * (g - (p * g).sum(axis=-1, keepdims=True))


def np_rms_norm_backward(x: Any, weight: Any, grad_out: Any, eps: float = 1e-6,
                         offset: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    x, w, g = f64(x), offset + f64(weight), f64(grad_out)
    dim = x.shape[-1]
    r = 1.0 / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps)
    xwg = (x * w * g).sum(axis=-1, keepdims=True)
    gx = r * w * g - x * r**3 * xwg / dim
    gw = (x * r * g).reshape(-1, dim).sum(axis=0)
    return gx, gw


def np_embedding_backward(grad_out: Any, ids: Any, vocab_size: int) -> np.ndarray:
    g = f64(grad_out)
    dim = g.shape[-1]
    out = np.zeros((vocab_size, dim), np.float64)
    np.add.at(out, np.asarray(ids).reshape(-1), g.reshape(-1, dim))
    return out


def np_cross_entropy(logits: Any, targets: Any, pad_id: int = -100, *, label_smoothing: float = 0.0,
                     z_loss: float = 0.0, softcap: float | None = None, reduction: str = "mean",
                     weight: Any = None, grad_output: Any = None, return_z_loss: bool = False) -> tuple:
    """float64 (loss, grad[, z_loss]) of ops.cross_entropy_fwd_bwd with every option: torch's
    F.cross_entropy(weight=, label_smoothing=) definitions (the weighted mean divides by the sum of
    the targets' weights) plus Liger's z-loss (never weighted; its mean divides by the count)."""
    x = f64(logits)
    vocab = x.shape[-1]
    x2 = x.reshape(-1, vocab)
    t = np.asarray(targets).reshape(-1)
    live = t != pad_id
    count = int(live.sum())
    c = np.ones(vocab) if weight is None else f64(weight).reshape(-1)
    d = np.ones_like(x2)
    z = x2
    if softcap:
        th = np.tanh(x2 / softcap)
        z, d = softcap * th, 1.0 - th * th
    m = z.max(axis=-1, keepdims=True)
    e = np.exp(z - m)
    s = e.sum(axis=-1, keepdims=True)
    p = e / s
    lse = (m + np.log(s))[:, 0]
    rows = np.arange(x2.shape[0])
    tt = np.where(live, t, 0)
    wt = np.where(live, c[tt], 0.0)
    eps = label_smoothing
    ce = (1 - eps) * wt * (lse - z[rows, tt])
    if eps:  # 0 * (a sum holding -inf) would be NaN where torch's loss is finite
        ce = ce + eps / vocab * (c * (lse[:, None] - z)).sum(-1)
    zl = z_loss * lse * lse
    ce, zl = np.where(live, ce, 0.0), np.where(live, zl, 0.0)
    s_ce = s_z = 1.0
    if reduction == "mean":
        wsum = wt.sum()
        s_ce = 1.0 / wsum if wsum != 0 else 0.0
        s_z = 1.0 / count if count else 0.0
    gz = (p * ((1 - eps) * wt + eps / vocab * c.sum())[:, None] - eps / vocab * c[None, :]) * s_ce
    gz[rows, tt] -= (1.0 - eps) * wt * s_ce
    gz += p * (2 * z_loss * lse)[:, None] * s_z
    g = gz * d
    g[~live] = 0.0
    if grad_output is not None:
        g = g * f64(grad_output).reshape(-1, 1)
    row = ce * s_ce + zl * s_z
    if reduction == "none":
        out = (row.reshape(x.shape[:-1]), g.reshape(x.shape), (zl * s_z).reshape(x.shape[:-1]))
    else:
        out = (np.float64(row.sum()), g.reshape(x.shape), np.float64((zl * s_z).sum()))
    return out if return_z_loss else out[:2]


# --------------------------------------------------------------------------- input helpers


def _cast(a: np.ndarray, kind: str) -> np.ndarray:
    if kind == "bf16":
        from ...arrays import bfloat16

        return a.astype(bfloat16())
    return a.astype(np.float16 if kind == "f16" else np.float32)


def _sfx(kind: str) -> str:
    from ...arrays import kernel_suffix

    return kernel_suffix(kind)


def _ops():
    from ... import ops

    return ops


def _np(a: Any) -> np.ndarray:
    return np.asarray(a)


# --------------------------------------------------------------------------- cases


def _transpose_cases(rng: np.random.Generator, only: Any = None) -> Iterator[Case]:
    # 16-byte path: rows and cols multiples of 4 (f32) / 8 (bf16) on aligned bases, partial 64-tiles included;
    # element path: odd sizes, sizes not multiples of the vector width, a misaligned base
    for kind, shape, mis in only or (("f32", (1, 1), 0), ("f32", (7, 33), 0), ("f32", (33, 65), 0), ("f32", (2, 3, 40, 17), 0),
                             ("bf16", (7, 33), 0), ("bf16", (64, 32), 0), ("f32", (68, 132), 0), ("f32", (2, 8, 200), 0),
                             ("f32", (12, 6), 0), ("f32", (36, 20), 1), ("bf16", (72, 136), 0), ("bf16", (2, 16, 24), 0),
                             ("bf16", (12, 20), 0), ("bf16", (40, 24), 1)):
        x = _cast(rng.standard_normal(shape), kind)
        if mis:  # same values, base one element past a 16-byte boundary
            x = np.concatenate([x.ravel()[:1], x.ravel()])[1:].reshape(shape)
        yield Case(op="transpose_2d", dtype=kind, shape="x".join(map(str, shape)) + ("-misaligned" if mis else ""),
                   kernels=("transpose_2d" + _sfx(kind),),
                   run=lambda be, x=x: {"out": _np(_ops().transpose_2d(x, backend=be))},
                   reference=lambda x=x: {"out": np_transpose_2d(x)})


def _softmax_cases(rng: np.random.Generator, only: Any = None) -> Iterator[Case]:
    # 16-byte path (rows of a multiple of 4 f32 / 8 bf16, aligned) and its edges: 12 bf16 (not a multiple
    # of 8), 40 bf16 (5 vectors: the 2-way unroll's odd tail), a misaligned base
    for kind, shape, mis in only or (("f32", (1, 1), 0), ("f32", (7, 33), 0), ("f32", (5, 128), 0), ("f32", (2, 3, 1000), 0),
                             ("bf16", (7, 33), 0), ("bf16", (4, 256), 0), ("bf16", (3, 12), 0), ("bf16", (3, 40), 0),
                             ("f32", (3, 36), 1), ("bf16", (3, 48), 1)):
        z = rng.standard_normal(shape)
        p = np.exp(z - z.max(axis=-1, keepdims=True))
        p = _cast(p / p.sum(axis=-1, keepdims=True), kind)
        g = _cast(rng.standard_normal(shape), kind)
        if mis:  # same values, bases one element past a 16-byte boundary
            p = np.concatenate([p.ravel()[:1], p.ravel()])[1:].reshape(shape)
            g = np.concatenate([g.ravel()[:1], g.ravel()])[1:].reshape(shape)
        yield Case(op="softmax_backward", dtype=kind, shape="x".join(map(str, shape)) + ("-misaligned" if mis else ""),
                   kernels=("softmax_backward" + _sfx(kind),),
                   run=lambda be, p=p, g=g: {"grad_in": _np(_ops().softmax_backward(p, g, backend=be))},
                   reference=lambda p=p, g=g: {"grad_in": np_softmax_backward(p, g)})


def _rms_cases(rng: np.random.Generator, only: Any = None) -> Iterator[Case]:
    shapes = [("f32", (rows, dim), "") for dim in (1, 8, 769, 5125) for rows in (1, 7)]
    shapes += [("f32", (83, 1), ""), ("f32", (83, 8), ""), ("f32", (83, 769), ""), ("f32", (83, 5125), "big"),
               ("f32", (2, 300, 64), ""), ("bf16", (7, 769), ""), ("bf16", (83, 8), ""), ("bf16", (5, 1024), ""),
               ("bf16", (3, 12), ""), ("bf16", (4, 8200), ""), ("f32", (2, 8196), "")]  # bf16 16-byte path edges: 12 % 8 != 0; > 1 vector/thread
    for kind, shape, note in only or shapes:
        x = _cast(rng.standard_normal(shape), kind)
        w = _cast(1.0 + 0.5 * rng.standard_normal(shape[-1]), kind)
        g = _cast(rng.standard_normal(shape), kind)
        sfx = _sfx(kind)
        rows = int(np.prod(shape[:-1]))
        from ...ops.training import rms_backward_partials
        n_part = rms_backward_partials(rows, shape[-1])
        if n_part:  # fused weight gradient (+ the reduce of the blocks' partial rows)
            kern = ("rms_norm_backward" + sfx,) + (("norm_grad_reduce",) if n_part > 1 else ())
        else:
            kern = ("rms_norm_backward" + sfx, "rms_norm_backward_weight" + sfx)
            if rows > 32:
                kern += ("norm_grad_reduce",)

        def run(be, x=x, w=w, g=g):
            gx, gw = _ops().rms_norm_backward(x, w, g, 1e-6, backend=be)
            return {"grad_x": _np(gx), "grad_weight": _np(gw)}

        def ref(x=x, w=w, g=g):
            gx, gw = np_rms_norm_backward(x, w, g, 1e-6)
            return {"grad_x": gx, "grad_weight": gw}

        yield Case(op="rms_norm_backward", dtype=kind, shape="x".join(map(str, shape)), kernels=kern,
                   run=run, reference=ref, note=note)
    if only is None:  # Gemma's (1 + w): fused and unfused weight gradients, each dtype
        for kind, shape in (("f32", (7, 64)), ("f32", (3, 8200)), ("bf16", (7, 64)), ("f16", (7, 13)),
                            ("f16", (3, 8200))):
            x, g = (_cast(rng.standard_normal(shape), kind) for _ in range(2))
            w = _cast(0.1 * rng.standard_normal(shape[-1]), kind)
            from ...ops.training import rms_backward_partials
            rows = int(np.prod(shape[:-1]))
            sfx = _sfx(kind)
            kern = (("rms_norm_backward" + sfx,) if rms_backward_partials(rows, shape[-1])
                    else ("rms_norm_backward" + sfx, "rms_norm_backward_weight" + sfx))

            def run(be, x=x, w=w, g=g):
                gx, gw = _ops().rms_norm_backward(x, w, g, 1e-6, offset=1.0, backend=be)
                return {"grad_x": _np(gx), "grad_weight": _np(gw)}

            def ref(x=x, w=w, g=g):
                gx, gw = np_rms_norm_backward(x, w, g, 1e-6, offset=1.0)
                return {"grad_x": gx, "grad_weight": gw}

            yield Case(op="rms_norm_backward", dtype=kind, shape="x".join(map(str, shape)) + "-offset1",
                       kernels=kern, run=run, reference=ref)


def _embedding_cases(rng: np.random.Generator, only: Any = None) -> Iterator[Case]:
    for kind, n_shape, dim, vocab in only or (("f32", (13,), 7, 11), ("f32", (2, 9), 64, 5), ("f32", (6,), 3, 1),
                                      ("f32", (40,), 16, 1000), ("bf16", (13,), 7, 11), ("bf16", (3, 5), 32, 4),
                                      ("f32", (3, 100), 4, 4500), ("bf16", (4, 3), 12, 6)):
        g = _cast(rng.standard_normal(n_shape + (dim,)), kind)
        ids = rng.integers(0, vocab, size=n_shape).astype(np.int64)
        if vocab > 2048:  # several bucketing blocks and id tiles: repeats on both sides of a block edge
            ids.reshape(-1)[::3] = 2048
            ids.reshape(-1)[1::7] = 2047
        yield Case(op="embedding_backward", dtype=kind, shape=f"{'x'.join(map(str, n_shape))}x{dim}-v{vocab}",
                   kernels=("embedding_backward_bucket", "embedding_backward" + _sfx(kind)),
                   run=lambda be, g=g, ids=ids, vocab=vocab: {
                       "grad_weight": _np(_ops().embedding_backward(g, ids, vocab, backend=be))},
                   reference=lambda g=g, ids=ids, vocab=vocab: {"grad_weight": np_embedding_backward(g, ids, vocab)})


def _ce_cases(rng: np.random.Generator, only: Any = None) -> Iterator[Case]:
    specs = []
    for vocab, rows, note in ((1, 4, ""), (255, 6, ""), (32000, 2, ""), (131072, 2, "big")):
        for pad in ("some", "none", "all"):
            specs.append(("f32", vocab, rows, pad, -100, note, {}))
    specs += [("f32", 256, 5, "some", 0, "", {}), ("f32", 64, 5, "some", 3, "", {}),
              ("bf16", 255, 6, "some", -100, "", {}), ("bf16", 1000, 3, "none", -100, "", {}),
              ("bf16", 32000, 2, "some", -100, "big", {})]
    # options: label smoothing, z-loss, soft-capping, reductions, alone and together
    opts = [{"label_smoothing": 0.1}, {"z_loss": 1e-3}, {"softcap": 5.0}, {"reduction": "sum"},
            {"reduction": "none"},
            {"label_smoothing": 0.2, "z_loss": 1e-2, "softcap": 3.0, "reduction": "mean"}]
    for o in opts:
        for kind, vocab, rows in (("f32", 257, 5), ("f32", 64, 3), ("bf16", 255, 4)):
            specs.append((kind, vocab, rows, "some", -100, "", o))
    all_opts = {"label_smoothing": 0.1, "z_loss": 1e-3, "softcap": 30.0}
    specs += [("f32", 1, 3, "some", -100, "", all_opts), ("f32", 100, 1, "none", -100, "", all_opts),
              ("f32", 64, 4, "all", -100, "", dict(all_opts, reduction="sum")),
              ("f32", 64, 4, "all", -100, "", dict(all_opts, reduction="none")),
              ("bf16", 64, 4, "all", -100, "", all_opts),
              # bf16 takes 16-byte vectors (8 elements) when vocab % 8 == 0: one row length each side
              ("bf16", 1004, 3, "some", -100, "", {}), ("bf16", 264, 4, "some", -100, "", all_opts),
              ("f32", 300, 9000, "some", -100, "big", {}),  # two-level (parallel) mean: 9000 > 8192 rows
              ("f32", 262144, 2, "some", -100, "big", all_opts),
              ("bf16", 262144, 2, "none", -100, "big", dict(all_opts, reduction="sum"))]
    # Liger-Kernel's options: class weights with every reduction and with label smoothing, per-row
    # upstream gradients ("none"), the z-loss returned on its own; 16-byte and scalar rows
    for kind, vocab in (("f32", 257), ("f32", 64), ("bf16", 264), ("f16", 255)):
        for red in ("mean", "sum", "none"):
            specs.append((kind, vocab, 6, "some", -100, "", {"weight": "rand", "reduction": red}))
            specs.append((kind, vocab, 6, "some", -100, "", {"weight": "rand", "reduction": red,
                                                             "label_smoothing": 0.1, "z_loss": 1e-2,
                                                             "return_z_loss": True}))
    specs += [("f32", 64, 4, "all", -100, "", {"weight": "rand", "label_smoothing": 0.1}),
              ("f32", 300, 9000, "some", -100, "big", {"weight": "rand", "z_loss": 1e-3, "return_z_loss": True}),
              ("f32", 64, 5, "some", -100, "", {"reduction": "none", "z_loss": 1e-3, "softcap": 5.0,
                                                "return_z_loss": True})]
    for kind, vocab, rows, pad, pad_id, note, o in only or specs:
        logits = _cast(3.0 * rng.standard_normal((rows, vocab)), kind)
        t = rng.integers(0, vocab, size=rows).astype(np.int64)
        if pad == "all":
            t[:] = pad_id
        elif pad == "some":
            t[::2] = pad_id
        else:
            t[t == pad_id] = (pad_id + 1) % vocab
        sfx = _sfx(kind)
        tag = "".join(f"-{k}{v}" for k, v in o.items())
        if o.get("weight") == "rand":  # class weights (and per-row upstream gradients for "none")
            o = dict(o, weight=rng.uniform(0.25, 2.0, vocab).astype(np.float32))
            if o.get("reduction") == "none":
                o["grad_output"] = rng.standard_normal(rows).astype(np.float32)

        def run(be, x=logits, t=t, pad_id=pad_id, o=o):
            out = _ops().cross_entropy_fwd_bwd(x, t, pad_id, backend=be, **o)
            return {"loss": _np(out[0]), "grad": _np(out[1]), **({"z_loss": _np(out[2])} if len(out) > 2 else {})}

        def ref(x=logits, t=t, pad_id=pad_id, o=o):
            out = np_cross_entropy(x, t, pad_id, **o)
            return {"loss": out[0], "grad": out[1], **({"z_loss": out[2]} if len(out) > 2 else {})}

        red = () if o.get("reduction") == "none" else ("cross_entropy_loss_reduce",)
        yield Case(op="cross_entropy_fwd_bwd", dtype=kind, shape=f"{rows}x{vocab}-pad_{pad}{pad_id}{tag}",
                   kernels=("cross_entropy_count", "cross_entropy_fwd_bwd" + sfx) + red,
                   run=run, reference=ref, note=note)


def _f16_cases(rng: np.random.Generator) -> Iterator[Case]:
    """float16 I/O on the bf16 shapes that reach each path (16-byte vectors, tails, misaligned bases, the
    fused and unfused weight gradients). Drawn after every other case, so those keep their data."""
    yield from _transpose_cases(rng, (("f16", (7, 33), 0), ("f16", (72, 136), 0), ("f16", (2, 16, 24), 0),
                                      ("f16", (40, 24), 1)))
    yield from _softmax_cases(rng, (("f16", (7, 33), 0), ("f16", (4, 256), 0), ("f16", (3, 40), 0),
                                    ("f16", (3, 48), 1)))
    yield from _rms_cases(rng, (("f16", (7, 769), ""), ("f16", (83, 8), ""), ("f16", (3, 12), ""),
                                ("f16", (4, 8200), "")))
    yield from _embedding_cases(rng, (("f16", (13,), 7, 11), ("f16", (3, 5), 32, 4)))
    all_opts = {"label_smoothing": 0.1, "z_loss": 1e-3, "softcap": 30.0}
    yield from _ce_cases(rng, (("f16", 255, 6, "some", -100, "", {}), ("f16", 1004, 3, "none", -100, "", {}),
                               ("f16", 264, 4, "some", -100, "", all_opts), ("f16", 64, 4, "all", -100, "", all_opts),
                               ("f16", 255, 4, "some", -100, "", {"reduction": "none", "softcap": 5.0})))
    yield from _f32_to_16_cases(rng)


def _f32_to_16_cases(rng: np.random.Generator) -> Iterator[Case]:
    """training_f32_to_bf16 / _f16 on their own (the naive attention backward narrows its fp32 sums with
    them): finite values only, the conversions' specials are tests/test_*_narrow.py's."""
    import pykern

    for kind, n in (("bf16", 1000), ("f16", 1000), ("f16", 7)):
        src = (rng.standard_normal(n) * 100.0).astype(np.float32)

        def run(be, src=src, kind=kind):
            dst = np.zeros(src.size, _cast(np.zeros(1), kind).dtype)
            pykern.launch("training_f32_to" + _sfx(kind), (src.size + 255) // 256, 256, src, dst, src.size,
                          backend=be)
            return {"out": dst}

        yield Case(op="training_f32_to", dtype=kind, shape=f"{n}", kernels=("training_f32_to" + _sfx(kind),),
                   run=run, reference=lambda src=src, kind=kind: {"out": f64(_cast(src, kind))})


cases = register_case_groups(
    "training",
    _transpose_cases, _softmax_cases, _rms_cases, _embedding_cases, _ce_cases, _f16_cases,
)
