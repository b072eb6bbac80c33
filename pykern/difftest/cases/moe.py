"""Difftest cases for kernels_cu/moe.cu plus the float64 NumPy references of its ops: routing (softmax
and sigmoid + bias, with and without renormalisation, ties), grouped GEMM (empty groups, ragged rows,
K and N off the tile, one row; tensor cores and the FMA kernel), the experts block forward and
backward (dropped tokens, an expert nobody picks, both activations)."""
from __future__ import annotations

import math
from typing import Any, Iterator

import numpy as np

from ..case import Case, register_case_groups
from .training import _cast, _np, _ops, f64

# --------------------------------------------------------------------------- NumPy float64 references


def np_moe_route(logits: Any, top_k: int, renormalize: bool = True, scoring: str = "softmax",
                 bias: Any = None) -> tuple[np.ndarray, np.ndarray]:
    x = f64(logits)
    if scoring == "softmax":
        p = np.exp(x - x.max(-1, keepdims=True))
        score = p / p.sum(-1, keepdims=True)
    else:
        score = 1.0 / (1.0 + np.exp(-x))
    choice = score + (f64(bias) if bias is not None else 0.0)  # the bias chooses; the score weighs
    ids = np.argsort(-choice, axis=-1, kind="stable")[:, :top_k]  # stable: ties to the lower index
    w = np.take_along_axis(score, ids, -1)
    if renormalize:
        w = w / (w.sum(-1, keepdims=True) + (1e-20 if scoring == "sigmoid" else 0.0))
    return w, ids.astype(np.int32)


def np_grouped_gemm(a: Any, b: Any, offsets: Any) -> np.ndarray:
    a, b = f64(a), f64(b)
    out = np.zeros((a.shape[0], b.shape[1]))
    for e in range(b.shape[0]):
        out[offsets[e]:offsets[e + 1]] = a[offsets[e]:offsets[e + 1]] @ b[e].T
    return out


_S2PI = math.sqrt(2.0 / math.pi)


def np_act(g: np.ndarray, activation: str) -> np.ndarray:
    if activation == "gelu_tanh":
        return 0.5 * g * (1.0 + np.tanh(_S2PI * (g + 0.044715 * g**3)))
    return g / (1.0 + np.exp(-g))


def np_act_grad(g: np.ndarray, activation: str) -> np.ndarray:
    if activation == "gelu_tanh":
        th = np.tanh(_S2PI * (g + 0.044715 * g**3))
        return 0.5 * (1 + th) + 0.5 * g * (1 - th * th) * _S2PI * (1 + 3 * 0.044715 * g * g)
    s = 1.0 / (1.0 + np.exp(-g))
    return s * (1.0 + g * (1.0 - s))


def _routed(x: np.ndarray, gate_up: np.ndarray, ids: Any) -> Any:
    """(token t, slot j, expert e, gate_up[e] @ x[t]) of every routed slot, in order (an id < 0 routes nowhere)."""
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if e >= 0:
                yield t, j, e, gate_up[e] @ x[t]


def np_moe_experts(x: Any, gate_up: Any, down: Any, ids: Any, w: Any, activation: str = "silu") -> np.ndarray:
    x, gate_up, down, w = f64(x), f64(gate_up), f64(down), f64(w)
    inter = down.shape[2]
    out = np.zeros_like(x)
    for t, j, e, gu in _routed(x, gate_up, ids):
        out[t] += w[t, j] * (down[e] @ (np_act(gu[:inter], activation) * gu[inter:]))
    return out


def np_moe_experts_backward(dy: Any, x: Any, gate_up: Any, down: Any, ids: Any, w: Any,
                            activation: str = "silu") -> tuple[np.ndarray, ...]:
    dy, x, gate_up, down, w = f64(dy), f64(x), f64(gate_up), f64(down), f64(w)
    inter = down.shape[2]
    dx, dgu_w, ddown, dw = np.zeros_like(x), np.zeros_like(gate_up), np.zeros_like(down), np.zeros(w.shape)
    for t, j, e, gu in _routed(x, gate_up, ids):
        g, u = gu[:inter], gu[inter:]
        h = np_act(g, activation) * u
        dw[t, j] = dy[t] @ (down[e] @ h)
        dys = w[t, j] * dy[t]
        ddown[e] += np.outer(dys, h)
        dh = down[e].T @ dys
        dgu = np.concatenate([dh * u * np_act_grad(g, activation), dh * np_act(g, activation)])
        dgu_w[e] += np.outer(dgu, x[t])
        dx[t] += gate_up[e].T @ dgu
    return dx, dgu_w, ddown, dw


# --------------------------------------------------------------------------- cases


def _sfx(kind: str) -> str:
    return {"f32": "", "bf16": "_bf16", "f16": "_f16"}[kind]


def _route_cases(rng: np.random.Generator) -> Iterator[Case]:
    for kind, (t, e), k, renorm, scoring, biased in (
            ("f32", (1, 4), 1, True, "softmax", False), ("f32", (37, 60), 4, True, "softmax", False),
            ("f32", (9, 8), 2, False, "softmax", False), ("bf16", (20, 64), 8, True, "softmax", False),
            ("f32", (13, 40), 6, True, "sigmoid", True), ("bf16", (5, 33), 3, False, "sigmoid", True),
            ("f16", (20, 64), 8, True, "softmax", False), ("f16", (5, 33), 3, False, "sigmoid", True),
            ("f32", (11, 24), 3, True, "softmax", True), ("bf16", (6, 40), 4, False, "softmax", True)):
        x = _cast(rng.standard_normal((t, e)), kind)
        if t > 3:
            x[3, 1] = x[3, 2] = _cast(np.array(f64(x[3]).max() + 1.0), kind)  # a tie: the lower index first
        # Softmax probabilities are ~1/e each: a bias of their size changes the choice, as the sigmoid's does.
        bias = ((0.3 if scoring == "sigmoid" else 0.05) * rng.standard_normal(e)).astype(np.float32) if biased else None

        def run(be, x=x, k=k, renorm=renorm, scoring=scoring, bias=bias):
            w, ids = _ops().moe_route(x, k, renorm, scoring, bias, backend=be)
            return {"weights": _np(w), "ids": _np(ids)}

        def ref(x=x, k=k, renorm=renorm, scoring=scoring, bias=bias):
            w, ids = np_moe_route(x, k, renorm, scoring, bias)
            return {"weights": w, "ids": ids}

        yield Case(op="moe_route", dtype=kind,
                   shape=f"{t}x{e}-k{k}-{scoring}" + ("-bias" if biased and scoring == "softmax" else "")
                   + ("" if renorm else "-raw"),
                   kernels=("moe_route" + _sfx(kind),), run=run, reference=ref)


def _offsets(sizes: list[int]) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32)


_GEMM_SHAPES = (  # (group sizes, N, K)
    ([130, 0, 5, 200], 136, 72),  # empty group, ragged rows, N off the tile
    ([1], 3, 5),                  # one row, K % 8 != 0: the element-wise path only
    ([64, 70], 128, 272),         # 8 full k-tiles + a remainder: steady state, drain and tail
    ([0, 0, 3], 8, 40),
)


def _gemm_cases(rng: np.random.Generator) -> Iterator[Case]:
    for kind in ("f32", "bf16", "f16"):
        for sizes, n, k in _GEMM_SHAPES:
            off = _offsets(sizes)
            a = _cast(rng.standard_normal((int(off[-1]), k)), kind)
            b = _cast(rng.standard_normal((len(sizes), n, k)) / math.sqrt(k), kind)
            for tc in ((True, False) if kind != "f32" else (None,)):
                name = ("grouped_gemm_tc" if tc else "grouped_gemm_simt") + _sfx(kind)

                def run(be, a=a, b=b, off=off, tc=tc):
                    return {"out": _np(_ops().grouped_gemm(a, b, off, tensor_cores=tc, backend=be))}

                yield Case(op="grouped_gemm", dtype=kind,
                           shape=f"{'-'.join(map(str, sizes))}x{n}x{k}" + ("" if tc is None else ("-tc" if tc else "-fma")),
                           kernels=(name,), run=run, reference=lambda a=a, b=b, off=off: {"out": np_grouped_gemm(a, b, off)})


def _gemm_nn_and_wgrad_cases(rng: np.random.Generator) -> Iterator[Case]:
    # The backward's layouts on tensor cores: a @ b[e] with b [E, K, N] (grouped_gemm layout="nn"), and the
    # K-grouped weight gradient out[e] = a[rows_e]^T @ b[rows_e] (an empty expert: a zero tile).
    for kind in ("bf16", "f16"):
        for sizes, n, k in _GEMM_SHAPES[:3]:
            off = _offsets(sizes)
            a = _cast(rng.standard_normal((int(off[-1]), k)), kind)
            b = _cast(rng.standard_normal((len(sizes), k, n)) / math.sqrt(k), kind)
            shape = f"{'-'.join(map(str, sizes))}x{n}x{k}"

            def run(be, a=a, b=b, off=off):
                return {"out": _np(_ops().grouped_gemm(a, b, off, layout="nn", tensor_cores=True, backend=be))}

            def ref(a=a, b=b, off=off):
                return {"out": np_grouped_gemm(a, np.swapaxes(f64(b), 1, 2), off)}

            yield Case(op="grouped_gemm", dtype=kind, shape=shape + "-nn", kernels=("grouped_gemm_tc_nn" + _sfx(kind),),
                       run=run, reference=ref)
            # The fp32-result variants (the backward's exact-operand products), held to the f32 row: nothing is
            # rounded after the fp32 accumulation.
            bt = _cast(np.swapaxes(f64(b), 1, 2).copy(), kind)  # [E, N, K] for layout "nt"
            for lay, nm in (("nt", "grouped_gemm_tc_f32out"), ("nn", "grouped_gemm_tc_nn_f32out")):
                # a cast of its own per case (the same values): the runner marks a case as needing ml_dtypes when
                # its generation asks for bfloat16, and a case without ml_dtypes must not run on stand-in data
                bb = bt if lay == "nt" else _cast(f64(b), kind)

                def run_f(be, a=a, bb=bb, off=off, lay=lay):
                    return {"out": _np(_ops().grouped_gemm(a, bb, off, layout=lay, out_dtype="float32",
                                                           tensor_cores=True, backend=be))}

                yield Case(op="grouped_gemm", dtype="f32", shape=f"{shape}-{lay}-f32out-{kind}",
                           kernels=(nm + _sfx(kind),), run=run_f, reference=ref)
            g = _cast(rng.standard_normal((int(off[-1]), n)), kind)

            def run_w(be, a=a, g=g, off=off):
                return {"out": _np(_ops().grouped_gemm_wgrad_tc(a, g, off, backend=be))}

            def ref_w(a=a, g=g, off=off):
                a64, g64 = f64(a), f64(g)
                return {"out": np.stack([a64[off[e]:off[e + 1]].T @ g64[off[e]:off[e + 1]] for e in range(len(off) - 1)])}

            yield Case(op="grouped_gemm", dtype=kind, shape=shape + "-wgrad",
                       kernels=("grouped_gemm_wgrad_tc" + _sfx(kind),), run=run_w, reference=ref_w)


def _experts_inputs(rng: np.random.Generator, kind: str, t: int, h: int, inter: int, e: int, k: int):
    x = _cast(rng.standard_normal((t, h)), kind)
    gu = _cast(rng.standard_normal((e, 2 * inter, h)) / math.sqrt(h), kind)
    dn = _cast(rng.standard_normal((e, h, inter)) / math.sqrt(inter), kind)
    logits = rng.standard_normal((t, e))
    logits[:, e - 1] -= 50.0  # the last expert is never chosen: an empty group
    w, ids = np_moe_route(logits, k)
    ids = ids.copy()
    if t > 2:
        ids[2, k - 1] = -1  # a dropped slot
    dy = _cast(rng.standard_normal((t, h)), kind)
    return x, gu, dn, ids, w.astype(np.float32), dy


_EXPERT_SHAPES = (("f32", 37, 48, 40, 6, 2, "silu"), ("bf16", 37, 48, 40, 6, 2, "silu"),
                  ("bf16", 5, 64, 24, 4, 3, "gelu_tanh"), ("f32", 1, 16, 8, 3, 1, "gelu_tanh"),
                  ("f16", 37, 48, 40, 6, 2, "silu"), ("f16", 5, 64, 24, 4, 3, "gelu_tanh"))


def _experts_cases(rng: np.random.Generator) -> Iterator[Case]:
    align = ("moe_count", "moe_scan", "moe_place")
    for kind, t, h, inter, e, k, act in _EXPERT_SHAPES:
        x, gu, dn, ids, w, dy = _experts_inputs(rng, kind, t, h, inter, e, k)
        s = _sfx(kind)
        for tc in ((True, False) if kind != "f32" else (None,)):
            shape = f"t{t}-h{h}-i{inter}-e{e}-k{k}-{act}" + ("" if tc is None else ("-tc" if tc else "-fma"))
            gemm = ("grouped_gemm_tc" if tc else "grouped_gemm_simt") + s
            first = ("moe_gemm_act_tc" + s,) if tc else ("grouped_gemm_simt" + s, "moe_act" + s)

            def run(be, x=x, gu=gu, dn=dn, ids=ids, w=w, act=act, tc=tc):
                return {"out": _np(_ops().moe_experts(x, gu, dn, ids, w, act, tensor_cores=tc, backend=be))}

            yield Case(op="moe_experts", dtype=kind, shape=shape,
                       kernels=align + ("moe_gather" + s, gemm, "moe_combine" + s) + first, run=run,
                       reference=lambda x=x, gu=gu, dn=dn, ids=ids, w=w, act=act: {
                           "out": np_moe_experts(x, gu, dn, ids, w, act)})

            def run_b(be, x=x, gu=gu, dn=dn, ids=ids, w=w, act=act, tc=tc, dy=dy):
                dx, dgu, ddn, dw = _ops().moe_experts_backward(dy, x, gu, dn, ids, w, act, tensor_cores=tc,
                                                               backend=be)
                return {"grad_x": _np(dx), "grad_gate_up_proj": _np(dgu), "grad_down_proj": _np(ddn),
                        "grad_topk_weights": _np(dw)}

            def ref_b(x=x, gu=gu, dn=dn, ids=ids, w=w, act=act, dy=dy):
                dx, dgu, ddn, dw = np_moe_experts_backward(dy, x, gu, dn, ids, w, act)
                return {"grad_x": dx, "grad_gate_up_proj": dgu, "grad_down_proj": ddn, "grad_topk_weights": dw}

            # with tensor cores: the exact-operand products on the fp32-result kernels, d(x_perm) on a 16-bit one,
            # y and the weight gradients on the split-precision ones (hi + lo planes of the fp32 intermediates)
            if tc:
                ks = ("moe_gather", "moe_act", "moe_act_backward", "moe_weight_grad", "moe_gather" + s,
                      "grouped_gemm_tc_f32out" + s, "grouped_gemm_tc_nn_f32out" + s, "grouped_gemm_tc_nn" + s,
                      "moe_combine" + s, "moe_split16" + s, "grouped_gemm_tc_split_f32out" + s,
                      "grouped_gemm_wgrad_tc_split_a" + s, "grouped_gemm_wgrad_tc_split_ab" + s)
            else:
                ks = ("moe_gather", "grouped_gemm_simt", "moe_act", "moe_act_backward", "moe_weight_grad",
                      "grouped_gemm_wgrad", "moe_combine")
            yield Case(op="moe_experts_backward", dtype=kind, shape=shape, kernels=align + ks, run=run_b,
                       reference=ref_b)


moe_cases = register_case_groups("moe", _route_cases, _gemm_cases, _gemm_nn_and_wgrad_cases, _experts_cases)
