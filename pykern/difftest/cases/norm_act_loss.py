"""Difftest cases for kernels_cu/norm_act_loss.cu plus the float64 NumPy references of its
ops: add_rms_norm (+ backward), layer_norm (+ backward, with / without weight and bias), GELU,
GeGLU (+ backwards), both approximations. Edge shapes: one row, dim 1, dims not a multiple of a
warp, rows enough for several weight-gradient chunks."""
from __future__ import annotations

import math
from typing import Any, Iterator

import numpy as np

from ..case import Case, register_cases
from .training import _cast, _np, _ops, f64

# --------------------------------------------------------------------------- NumPy float64 references


def np_add_rms_norm(x: Any, residual: Any, weight: Any, eps: float = 1e-6,
                    offset: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    h = f64(x) + f64(residual)
    r = 1.0 / np.sqrt((h * h).mean(-1, keepdims=True) + eps)
    return h * r * (offset + f64(weight)), h


def np_add_rms_norm_backward(h: Any, weight: Any, gy: Any, gres: Any = None,
                             eps: float = 1e-6, offset: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    h, w, g = f64(h), offset + f64(weight), f64(gy)
    dim = h.shape[-1]
    r = 1.0 / np.sqrt((h * h).mean(-1, keepdims=True) + eps)
    gh = r * w * g - h * r**3 * (h * w * g).sum(-1, keepdims=True) / dim
    if gres is not None:
        gh = gh + f64(gres)
    return gh, (h * r * g).reshape(-1, dim).sum(0)


def np_layer_norm(x: Any, weight: Any = None, bias: Any = None, eps: float = 1e-5) -> np.ndarray:
    x = f64(x)
    mu = x.mean(-1, keepdims=True)
    y = (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + eps)
    if weight is not None:
        y = y * f64(weight)
    if bias is not None:
        y = y + f64(bias)
    return y


def np_layer_norm_backward(x: Any, weight: Any, g: Any, eps: float = 1e-5) -> tuple[np.ndarray, ...]:
    x, g = f64(x), f64(g)
    dim = x.shape[-1]
    mu = x.mean(-1, keepdims=True)
    rstd = 1.0 / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + eps)
    xh = (x - mu) * rstd
    gh = g * (f64(weight) if weight is not None else 1.0)
    mg, mgx = gh.mean(-1, keepdims=True), (gh * xh).mean(-1, keepdims=True)
    with np.errstate(invalid="ignore"):
        mg = mg + (mg - mg) + (mgx - mgx)  # an infinite statistic: the whole row NaN, as the kernel
        gx = rstd * (gh - mg - xh * mgx)
    return gx, (xh * g).reshape(-1, dim).sum(0), g.reshape(-1, dim).sum(0)


_erf = np.vectorize(math.erf)
_S2PI = math.sqrt(2.0 / math.pi)


def np_gelu(x: Any, approximate: str = "none") -> np.ndarray:
    x = f64(x)
    if approximate == "tanh":
        return 0.5 * x * (1.0 + np.tanh(_S2PI * (x + 0.044715 * x**3)))
    return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))


def np_gelu_grad(x: Any, approximate: str = "none") -> np.ndarray:
    x = f64(x)
    if approximate == "tanh":
        t = np.tanh(_S2PI * (x + 0.044715 * x**3))
        return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * _S2PI * (1 + 3 * 0.044715 * x * x)
    return 0.5 * (1.0 + _erf(x / math.sqrt(2.0))) + x * np.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)


# --------------------------------------------------------------------------- cases

_NORM_SHAPES = (("f32", (1, 1)), ("f32", (1, 33)), ("f32", (5, 64)), ("f32", (3, 4, 37)), ("f32", (300, 20)),
                ("bf16", (3, 40)), ("bf16", (2, 129)))


def _sfx(kind: str) -> str:
    from ...arrays import kernel_suffix

    return kernel_suffix(kind)


def _wchunks(n_rows: int, dim: int) -> bool:
    from ...ops._common import weight_chunks

    return weight_chunks(n_rows, dim)[0] > 1


def _lnb_fused(n_rows: int, dim: int, kind: str) -> int | None:
    """Blocks of the fused layer_norm_backward (its weight-gradient partial rows), None where it is not fused."""
    from ...ops.norm_act_loss import _lnb_fused_geometry

    g = _lnb_fused_geometry(n_rows, dim, kind)
    return None if g is None else g[0][0]


def _add_rms_cases(rng: np.random.Generator, only: Any = None) -> Iterator[Case]:
    for kind, shape in only or _NORM_SHAPES:
        x, r, g, gr = (_cast(rng.standard_normal(shape), kind) for _ in range(4))
        w = _cast(1.0 + 0.3 * rng.standard_normal(shape[-1]), kind)
        s = _sfx(kind)
        n_rows = int(np.prod(shape[:-1]))

        def run(be, x=x, r=r, w=w):
            y, h = _ops().add_rms_norm(x, r, w, 1e-6, backend=be)
            return {"y": _np(y), "new_residual": _np(h)}

        def ref(x=x, r=r, w=w):
            y, h = np_add_rms_norm(x, r, w, 1e-6)
            return {"y": y, "new_residual": h}

        yield Case(op="add_rms_norm", dtype=kind, shape="x".join(map(str, shape)), kernels=("add_rms_norm" + s,),
                   run=run, reference=ref)
        h = _cast(f64(x) + f64(r), kind)
        for with_gres in (False, True):
            red = ("norm_grad_reduce",) if _wchunks(n_rows, shape[-1]) else ()

            def run_b(be, h=h, w=w, g=g, gr=gr if with_gres else None):
                gh, gw = _ops().add_rms_norm_backward(h, w, g, gr, 1e-6, backend=be)
                return {"grad_h": _np(gh), "grad_weight": _np(gw)}

            def ref_b(h=h, w=w, g=g, gr=gr if with_gres else None):
                gh, gw = np_add_rms_norm_backward(h, w, g, gr, 1e-6)
                return {"grad_h": gh, "grad_weight": gw}

            fused = _lnb_fused(n_rows, shape[-1], kind)  # the row kernel sums the weight gradient itself
            kern = (("add_rms_norm_backward" + s,) + (("norm_grad_reduce",) if fused > 1 else ()) if fused
                    else ("add_rms_norm_backward" + s, "norm_weight_grad" + s) + red)
            yield Case(op="add_rms_norm_backward", dtype=kind,
                       shape="x".join(map(str, shape)) + ("-gres" if with_gres else ""),
                       kernels=kern, run=run_b, reference=ref_b)
    if only is None:  # Gemma's (1 + w), forward and backward, each dtype
        for kind, shape in (("f32", (5, 64)), ("bf16", (5, 64)), ("f16", (3, 13))):
            x, r, g = (_cast(rng.standard_normal(shape), kind) for _ in range(3))
            w = _cast(0.1 * rng.standard_normal(shape[-1]), kind)
            s = _sfx(kind)
            tag = "x".join(map(str, shape)) + "-offset1"

            def run(be, x=x, r=r, w=w):
                y, h = _ops().add_rms_norm(x, r, w, 1e-6, offset=1.0, backend=be)
                return {"y": _np(y), "new_residual": _np(h)}

            def ref(x=x, r=r, w=w):
                y, h = np_add_rms_norm(x, r, w, 1e-6, offset=1.0)
                return {"y": y, "new_residual": h}

            yield Case(op="add_rms_norm", dtype=kind, shape=tag, kernels=("add_rms_norm" + s,), run=run,
                       reference=ref)
            h = _cast(f64(x) + f64(r), kind)

            def run_b(be, h=h, w=w, g=g):
                gh, gw = _ops().add_rms_norm_backward(h, w, g, None, 1e-6, offset=1.0, backend=be)
                return {"grad_h": _np(gh), "grad_weight": _np(gw)}

            def ref_b(h=h, w=w, g=g):
                gh, gw = np_add_rms_norm_backward(h, w, g, None, 1e-6, offset=1.0)
                return {"grad_h": gh, "grad_weight": gw}

            yield Case(op="add_rms_norm_backward", dtype=kind, shape=tag,
                       kernels=("add_rms_norm_backward" + s, "norm_weight_grad" + s), run=run_b, reference=ref_b)


def _layer_norm_cases(rng: np.random.Generator, only: Any = None, mean: float = 2.0, tag: str = "",
                      backward: bool = True) -> Iterator[Case]:
    for kind, shape in only or _NORM_SHAPES:
        x = _cast(rng.standard_normal(shape) + mean, kind)  # a row mean far from 0: the two-pass variance
        g = _cast(rng.standard_normal(shape), kind)
        w = _cast(1.0 + 0.3 * rng.standard_normal(shape[-1]), kind)
        b = _cast(0.5 * rng.standard_normal(shape[-1]), kind)
        s = _sfx(kind)
        n_rows = int(np.prod(shape[:-1]))
        for has_w, has_b in ((True, True), (False, False), (True, False)):
            ww, bb = (w if has_w else None), (b if has_b else None)
            name = "x".join(map(str, shape)) + ("-w" if has_w else "") + ("-b" if has_b else "") + tag

            def run(be, x=x, ww=ww, bb=bb):
                return {"y": _np(_ops().layer_norm(x, ww, bb, 1e-5, backend=be))}

            def ref(x=x, ww=ww, bb=bb):
                return {"y": np_layer_norm(x, ww, bb, 1e-5)}

            yield Case(op="layer_norm", dtype=kind, shape=name, kernels=("layer_norm" + s,), run=run, reference=ref)
            if not backward:
                continue
            red = ("norm_grad_reduce",) if _wchunks(n_rows, shape[-1]) else ()

            def run_b(be, x=x, ww=ww, g=g, has_b=has_b):
                gx, gw, gb = _ops().layer_norm_backward(x, ww, g, 1e-5, bias=has_b, backend=be)
                out = {"grad_x": _np(gx)}
                if gw is not None:
                    out["grad_weight"] = _np(gw)
                if gb is not None:
                    out["grad_bias"] = _np(gb)
                return out

            def ref_b(x=x, ww=ww, g=g, has_b=has_b):
                gx, gw, gb = np_layer_norm_backward(x, ww, g, 1e-5)
                out = {"grad_x": gx}
                if ww is not None:
                    out["grad_weight"] = gw
                if has_b:
                    out["grad_bias"] = gb
                return out

            fused = _lnb_fused(n_rows, shape[-1], kind)
            if fused is not None:  # the row kernel sums the weight / bias gradient: one partial row a block
                kern = ("layer_norm_backward" + s,) + (("norm_grad_reduce",) if fused > 1 and (has_w or has_b) else ())
            else:
                kern = ("layer_norm_backward" + s,) + (("norm_weight_grad" + s,) + red if (has_w or has_b) else ())
            yield Case(op="layer_norm_backward", dtype=kind, shape=name, kernels=kern, run=run_b, reference=ref_b)


def _gelu_cases(rng: np.random.Generator, only: Any = None) -> Iterator[Case]:
    for kind, shape in only or (("f32", (1,)), ("f32", (7, 33)), ("f32", (2, 3, 300)), ("bf16", (5, 77)),
                        ("bf16", (1000,))):
        x, up, g = (_cast(2.5 * rng.standard_normal(shape), kind) for _ in range(3))
        s = _sfx(kind)
        tag0 = "x".join(map(str, shape))
        for ap in ("none", "tanh"):
            tag = f"{tag0}-{ap}"

            def run(be, x=x, ap=ap):
                return {"y": _np(_ops().gelu(x, ap, backend=be))}

            def ref(x=x, ap=ap):
                return {"y": np_gelu(x, ap)}

            yield Case(op="gelu", dtype=kind, shape=tag, kernels=("gelu" + s,), run=run, reference=ref)

            def run_gb(be, x=x, g=g, ap=ap):
                return {"grad_x": _np(_ops().gelu_backward(x, g, ap, backend=be))}

            def ref_gb(x=x, g=g, ap=ap):
                return {"grad_x": f64(g) * np_gelu_grad(x, ap)}

            yield Case(op="gelu_backward", dtype=kind, shape=tag, kernels=("gelu_backward" + s,), run=run_gb,
                       reference=ref_gb)

            def run_gg(be, x=x, up=up, ap=ap):
                return {"out": _np(_ops().gelu_gate(x, up, ap, backend=be))}

            def ref_gg(x=x, up=up, ap=ap):
                return {"out": np_gelu(x, ap) * f64(up)}

            yield Case(op="gelu_gate", dtype=kind, shape=tag, kernels=("gelu_gate" + s,), run=run_gg,
                       reference=ref_gg)

            def run_ggb(be, x=x, up=up, g=g, ap=ap):
                gg, gu = _ops().gelu_gate_backward(x, up, g, ap, backend=be)
                return {"grad_gate": _np(gg), "grad_up": _np(gu)}

            def ref_ggb(x=x, up=up, g=g, ap=ap):
                return {"grad_gate": f64(g) * f64(up) * np_gelu_grad(x, ap), "grad_up": f64(g) * np_gelu(x, ap)}

            yield Case(op="gelu_gate_backward", dtype=kind, shape=tag, kernels=("gelu_gate_backward" + s,),
                       run=run_ggb, reference=ref_ggb)


@register_cases("norm_act_loss")
def cases(rng: np.random.Generator) -> Iterator[Case]:
    yield from _add_rms_cases(rng)
    yield from _layer_norm_cases(rng)
    yield from _gelu_cases(rng)
    # float16 (drawn last, so the cases above keep their data): 16-byte rows (40, 256: 8-element vectors),
    # element rows (129), and elementwise sizes with a scalar tail (385) or none (1000)
    f16_norm = (("f16", (3, 40)), ("f16", (2, 129)), ("f16", (4, 256)))
    yield from _add_rms_cases(rng, f16_norm)
    yield from _layer_norm_cases(rng, f16_norm)
    yield from _gelu_cases(rng, (("f16", (5, 77)), ("f16", (1000,))))
    # layer_norm rows on either side of the register cache (LN_CACHE_VECS 16-byte vectors a thread, 512
    # threads: 8192 f32 / 16384 bf16 columns), a partly filled cache (1000 f32: 128 threads, 250 vectors),
    # and f32 rows with a large mean (1e4 + N(0, 1)), where a one-pass E[x^2] - mean^2 variance would fail
    yield from _layer_norm_cases(rng, (("f32", (3, 1000)), ("f32", (2, 8192)), ("f32", (2, 8196)),
                                       ("bf16", (2, 16384)), ("bf16", (2, 16392))), mean=2.0)
    # (forward only: norm_weight_grad recomputes x - mean from the fp32 mean, whose rounding near 1e4 costs
    # about 1e-3 of grad_weight; the row kernel's grad_x is shifted like the forward)
    yield from _layer_norm_cases(rng, (("f32", (2, 1000)), ("f32", (2, 8192)), ("f32", (2, 8196))), mean=1e4,
                                 tag="-mean1e4", backward=False)
    # (drawn last, so the cases above keep their data)
    # the fused layer_norm_backward with more rows than blocks (each block sums several rows' gradients): 16-byte
    # chunks (bf16 1032: 129 chunks, 128 threads, 528 blocks; f32 4092: 1023 chunks, 512 threads, 132 blocks, 2
    # chunks a thread but the last)
    yield from _layer_norm_cases(rng, (("bf16", (600, 1032)), ("f32", (140, 4092))), mean=2.0, tag="-fused")
    yield from _add_rms_cases(rng, (("bf16", (600, 1032)), ("f32", (140, 4092))))  # its fused backward, as above
