"""Mixture-of-experts ops: routing, grouped GEMM, the experts block (forward and backward).

Kernels in kernels_cu/moe.cu. Layouts follow transformers 5.x: `gate_up_proj` [E, 2I, H] (gate rows
first, then up), `down_proj` [E, H, I]. Every op validates before launching (ArgumentError /
ArgumentTypeError naming the argument), takes NumPy arrays, torch tensors (CPU or CUDA) or CuPy
arrays, allocates outputs next to its inputs and takes `stream=` and `backend=` like the other ops.
No op reads device memory back to the host: group offsets may live on the device.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .. import arrays
from ..arrays import kernel_suffix as _suffix, same_kind as _same_kind
from ..errors import ArgumentError, ArgumentTypeError
from ._common import launch as _launch
from ._common import int_in_range as _int_arg
from . import _moe_sm90 as _sm90
from ._common import check_offsets as _check_offsets, dtype_is as _dtype_is, host_values as _host_values

__all__ = ["moe_route", "grouped_gemm", "grouped_gemm_wgrad_tc", "moe_align", "moe_experts", "moe_experts_backward"]

_ROUTE_WARPS = 4
_ROUTE_MAX_EXPERTS = 3072  # 4 warps x E floats of shared memory stay under 48 KB
_ROUTE_MAX_K = 32  # one selected expert per lane
_GRID_X_MAX = 2**31 - 1
_GRID_YZ_MAX = 65535
_INT_MAX = 2**31 - 1
_SCORINGS = ("softmax", "sigmoid")
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}


# --------------------------------------------------------------------------- moe_route


@arrays.stream_scoped
def moe_route(
    router_logits: Any, top_k: int, renormalize: bool = True, scoring: str = "softmax", bias: Any = None, *,
    stream: Any = None, backend: str | None = None,
) -> tuple[Any, Any]:
    """(topk_weights float32 [T, k], topk_ids int32 [T, k]) from router logits [T, E] (f32, bf16 or f16).

    scoring="softmax": probabilities in fp32 over all E experts; scoring="sigmoid": sigmoid scores. The k
    largest are chosen (ties to the lower index), by score + `bias` when a bias is given (float32 [E], a
    correction bias as DeepSeek-V3's, under either scoring as vLLM's fused_topk_bias), and weighted by the
    score alone. `renormalize` divides the k weights by their sum (+1e-20 for sigmoid, as DeepSeek-V3).
    One fused kernel, one warp per token.
    """
    kind = arrays.io_kind("router_logits", router_logits, arrays.IO_KINDS)
    shape = arrays.check_ndim("router_logits", router_logits, (2,), "(num_tokens, num_experts)")
    n_tok, n_exp = int(shape[0]), int(shape[1])
    if not 1 <= n_exp <= _ROUTE_MAX_EXPERTS:
        raise ArgumentError(f"router_logits.shape[1] (experts): expected 1..{_ROUTE_MAX_EXPERTS}, got {n_exp}")
    top_k = _int_arg("top_k", top_k, 1, min(n_exp, _ROUTE_MAX_K))
    if not isinstance(renormalize, bool):
        raise ArgumentTypeError(f"renormalize: expected a bool, got {type(renormalize).__name__}")
    if scoring not in _SCORINGS:
        raise ArgumentError(f"scoring: expected one of {_SCORINGS}, got {scoring!r}")
    if bias is not None:
        _dtype_is("bias", bias, "float32")
        if tuple(arrays.shape_of(bias)) != (n_exp,):
            raise ArgumentError(f"bias: expected shape ({n_exp},) (the experts of router_logits), got "
                                f"{tuple(arrays.shape_of(bias))}")
        bias = arrays.contiguous(bias)
    logits = arrays.contiguous(router_logits)
    w = arrays.empty((n_tok, top_k), np.float32, like=logits)
    ids = arrays.empty((n_tok, top_k), np.int32, like=logits)
    if n_tok == 0:
        return w, ids
    bias_arg = bias if bias is not None else w  # never read without has_bias
    blocks = min(-(-n_tok // _ROUTE_WARPS), _GRID_X_MAX)
    _launch("moe_route" + _suffix(kind), (blocks,), (32 * _ROUTE_WARPS,), logits.reshape(-1), bias_arg.reshape(-1),
            w.reshape(-1), ids.reshape(-1), n_tok, n_exp, top_k, int(renormalize), int(scoring == "sigmoid"),
            int(bias is not None), shared_mem=4 * _ROUTE_WARPS * n_exp,
            stream=arrays.launch_stream(stream, logits), backend=backend)
    return w, ids


# --------------------------------------------------------------------------- grouped GEMM

TC_BM = 128  # rows per tensor-core tile (GG_BM); the experts pad each group to it
TC_BN = 128
TC_SMEM = 4 * 2 * TC_BM * 40 * 2  # GG_SMEM_BYTES: 4 stages of A and B tiles, rows padded to 40 halves
SIMT_T = 32


def _tc(backend: str | None, kind: str, tensor_cores: bool | None = None) -> bool:
    if tensor_cores not in (None, True, False):
        raise ArgumentError(f"tensor_cores: expected None, True or False, got {tensor_cores!r}")
    if kind == "f32":  # mma.sync .bf16 / .f16: the 16-bit kinds only
        if tensor_cores:
            raise ArgumentError("tensor_cores: True needs bf16 or f16 inputs, got float32")
        return False
    if tensor_cores is False:
        return False
    from .forward import tensor_cores_available

    ok = tensor_cores_available(backend)
    if tensor_cores and not ok:
        raise ArgumentError("tensor_cores: True needs bf16 / f16 mma (sm_80 or newer); this device has none")
    return ok


def _gemm_launch(a: Any, b: Any, offsets: Any, out: Any, m: int, n: int, k: int, n_groups: int, kind: str, *,
                 nn: bool = False, act: int | None = None, tc: bool, stream: Any, backend: str | None,
                 f32out: bool = False) -> None:
    """out = per-group a @ b[e]^T (b [E, N, K]) or, with nn, a @ b[e] (b [E, K, N]); act: the fused
    act(gate) * up epilogue (out has N / 2 columns); f32out (tensor cores, 16-bit a and b): out is float32, the
    fp32 accumulators stored (the _f32out kernels). Sizes were validated by the caller."""
    if m == 0 or n == 0:
        return
    if f32out and (not tc or act is not None):
        raise AssertionError("the fp32 result is a tensor-core, plain-product variant")  # callers never ask
    sfx = ("_f32out" if f32out else "") + _suffix(kind)
    if tc and nn:
        # Hopper (sm_90a): the same TMA + wgmma kernel, B read MN-major (pykern/ops/_moe_sm90.py)
        if _sm90.try_launch(a, b, offsets, out, m, n, k, n_groups, kind, None, stream, backend, nn=True,
                            f32out=f32out):
            return
        grid = (m // TC_BM + n_groups, -(-n // TC_BN))
        _launch("grouped_gemm_tc_nn" + sfx, grid, (128,), a, b, offsets, out, m, n, k, n_groups,
                shared_mem=TC_SMEM, stream=stream, backend=backend)
        return
    if tc and not nn:
        # Hopper (sm_90a): the TMA + wgmma persistent kernel where it applies (pykern/ops/_moe_sm90.py)
        if _sm90.try_launch(a, b, offsets, out, m, n, k, n_groups, kind, act, stream, backend, f32out=f32out):
            return
        if act is None:
            grid = (m // TC_BM + n_groups, -(-n // TC_BN))
            _launch("grouped_gemm_tc" + sfx, grid, (128,), a, b, offsets, out, m, n, k, n_groups,
                    shared_mem=TC_SMEM, stream=stream, backend=backend)
        else:
            grid = (m // TC_BM + n_groups, -(-(n // 2) // 64))
            _launch("moe_gemm_act_tc" + _suffix(kind), grid, (128,), a, b, offsets, out, m, n, k, n_groups, act,
                    shared_mem=TC_SMEM, stream=stream, backend=backend)
        return
    if act is not None:
        raise AssertionError("the fused activation is a tensor-core epilogue")  # callers never ask otherwise
    grid = (m // SIMT_T + n_groups, -(-n // SIMT_T))
    sbn, sbk = (1, n) if nn else (k, 1)
    _launch("grouped_gemm_simt" + _suffix(kind), grid, (256,), a, b, offsets, out, m, n, k, n_groups, sbn, sbk,
            stream=stream, backend=backend)


@arrays.stream_scoped
def grouped_gemm(a: Any, b: Any, offsets: Any, *, out: Any = None, tensor_cores: bool | None = None,
                 layout: str = "nt", out_dtype: str | None = None, stream: Any = None,
                 backend: str | None = None) -> Any:
    """Grouped GEMM: rows offsets[e]:offsets[e+1] of the [M, N] result are a[rows] @ b[e].T.

    a [M, K] holds each group's rows contiguously; b [E, N, K] (f32, bf16 or f16, a's dtype); offsets int32
    [E + 1] (0 first, M last, non-decreasing; empty groups allowed; checked when it lives on the host,
    never copied back from a device). bf16 and f16 run on tensor cores (mma.sync, 4-stage cp.async, fp32
    accumulation) where the device has them; f32 runs an fp32 FMA kernel. The result has a's dtype.
    tensor_cores=False runs bf16 / f16 on the FMA kernel; True insists on tensor cores.
    layout="nn": b is [E, K, N] and the groups are a[rows] @ b[e] (the data gradients' layout; on tensor
    cores the same kernel with its B tiles k-major, ldmatrix .trans).
    On sm_90a (a compute-capability 9.0 GPU, or the host backend with PYKERN_HOST_ARCH=sm_90a) both layouts run
    a TMA + wgmma persistent kernel instead (layout "nn" reads b MN-major through the wgmma descriptor's
    transpose bit), where K (and for "nn" N) is a multiple of 8 and the bases are 16-byte aligned (docs/moe.md).
    out_dtype="float32" (bf16 / f16 inputs): the result is the fp32 accumulators, not rounded to 16 bits (the
    _f32out kernels on tensor cores; without them, the fp32 FMA kernel on widened copies).
    """
    if layout not in ("nt", "nn"):
        raise ArgumentError(f"layout: expected 'nt' or 'nn', got {layout!r}")
    if out_dtype not in (None, "float32"):
        raise ArgumentError(f"out_dtype: expected None (a's dtype) or 'float32', got {out_dtype!r}")
    nn = layout == "nn"
    kind = arrays.io_kind("a", a, arrays.IO_KINDS)
    _same_kind("b", b, kind, "a")
    m, k = arrays.check_ndim("a", a, (2,), "(M, K)")
    if nn:
        n_groups, kb, n = arrays.check_ndim("b", b, (3,), "(E, K, N)")
    else:
        n_groups, n, kb = arrays.check_ndim("b", b, (3,), "(E, N, K)")
    if kb != k:
        want = f"(E, {k}, N)" if nn else f"(E, N, {k})"
        raise ArgumentError(f"b: expected shape {want} (K of a), got {tuple(arrays.shape_of(b))}")
    offsets = _check_offsets(offsets, n_groups, m)
    tc = _tc(backend, kind, tensor_cores)
    for name, v in (("a.shape[0] (M)", m), ("a.shape[1] (K)", k), ("b.shape[1] (N)", n)):
        if v > _INT_MAX - 256:
            raise ArgumentError(f"{name}: expected at most {_INT_MAX - 256}, got {v}")
    if -(-n // SIMT_T) > _GRID_YZ_MAX:
        raise ArgumentError(f"b.shape[1] (N): expected at most {_GRID_YZ_MAX * SIMT_T}, got {n}")
    a, b = arrays.contiguous(a), arrays.contiguous(b)
    f32out = out_dtype == "float32" and kind != "f32"
    okind = "f32" if f32out else kind
    if out is None:
        out = arrays.empty((m, n), okind, like=a)
    else:
        # (its shape first, saying where each size comes from: a wrong N may be b's fault as well as out's)
        if tuple(arrays.shape_of(out, "out")) != (m, n):
            raise ArgumentError(f"out: expected shape {(m, n)} (M of a, N of b), got {tuple(arrays.shape_of(out))}")
        out = arrays.check_out(out, (m, n), okind, a)
    if m and n and k == 0:
        return arrays.fill_zero(out)
    if f32out and not tc:  # exact 16-bit operands widened: the fp32 FMA kernel computes the same product
        a, b = (arrays.contiguous(arrays.astype(v, "float32")) for v in (a, b))
        kind = "f32"
    _gemm_launch(a.reshape(-1), b.reshape(-1), offsets, out.reshape(-1), m, n, k, n_groups, kind, nn=nn, tc=tc,
                 f32out=f32out and tc, stream=arrays.launch_stream(stream, a), backend=backend)
    return out


@arrays.stream_scoped
def grouped_gemm_wgrad_tc(a: Any, b: Any, offsets: Any, *, stream: Any = None, backend: str | None = None) -> Any:
    """K-grouped GEMM on tensor cores: out[e] = a[rows]^T @ b[rows], rows = offsets[e]:offsets[e+1] ([E, N1, N2]).

    a [M, N1], b [M, N2] (bf16 or f16, the same); offsets int32 [E + 1] as grouped_gemm's. One CTA per
    128 x 128 output tile contracts the expert's rows in a fixed order (an empty expert: a zero
    gradient): deterministic, no atomics; fp32 accumulation, the result in a's dtype. On sm_90a it runs a TMA +
    wgmma persistent kernel where N1 and N2 are multiples of 8 and the bases 16-byte aligned (docs/moe.md).
    """
    kind = arrays.io_kind("a", a, ("bf16", "f16"))
    _same_kind("b", b, kind, "a")
    m, n1 = arrays.check_ndim("a", a, (2,), "(M, N1)")
    mb, n2 = arrays.check_ndim("b", b, (2,), "(M, N2)")
    if mb != m:
        raise ArgumentError(f"b: expected shape ({m}, N2) (rows of a), got {tuple(arrays.shape_of(b))}")
    off_shape = tuple(arrays.shape_of(offsets, "offsets"))
    n_exp = int(off_shape[0]) - 1 if off_shape else -1
    if n_exp < 1:
        raise ArgumentError(f"offsets: expected shape (E + 1,) with E >= 1, got {off_shape}")
    offsets = _check_offsets(offsets, n_exp, m)
    if not _tc(backend, kind, True):
        raise AssertionError("unreachable: _tc raises without tensor cores")
    a, b = arrays.contiguous(a), arrays.contiguous(b)
    out = arrays.empty((n_exp, n1, n2), kind, like=a)
    if n1 and n2:
        _wgrad_tc(a, b, offsets, out, m, n1, n2, n_exp, kind, stream=arrays.launch_stream(stream, a), backend=backend)
    return out


# --------------------------------------------------------------------------- the experts block

_CHUNK = 256  # MOE_CHUNK: slots per histogram chunk of the alignment


def _check_ids(topk_ids: Any, n_exp: int, name: str = "topk_ids", bound: str = "n_experts") -> Any:
    dt = arrays.dtype_name(topk_ids, name)
    if dt not in ("int32", "int64"):
        raise ArgumentTypeError(f"{name}: expected dtype int32 or int64, got {dt}")
    v = _host_values(topk_ids)
    if v is not None and v.size:
        lo, hi = int(v.min()), int(v.max())
        if lo < -1 or hi >= n_exp:
            bad = lo if lo < -1 else hi
            raise ArgumentError(f"{name}: expected expert ids in [0, {n_exp}) ({bound}) or -1 (dropped), got {bad}")
    return arrays.contiguous(arrays.astype(topk_ids, "int32"))


@arrays.stream_scoped
def moe_align(topk_ids: Any, n_experts: int, block: int = TC_BM, *, stream: Any = None,
              backend: str | None = None) -> tuple[Any, Any, Any, Any]:
    """vLLM's moe_align_block_size: (sorted_slot, slot_pos, offsets, counts), all int32.

    Slots (t * k + j) are grouped by expert, each group padded to a multiple of `block` rows:
    offsets [E + 1] are the padded row starts, sorted_slot[row] the slot of a row (-1: padding or
    unused), slot_pos[slot] its row (-1: dropped, id -1), counts [E] the slots per expert. Within an
    expert the slots keep their order, so the layout is deterministic. sorted_slot has
    T*k + min(E, T*k) * (block - 1) rows, the most the padding can need (no host round-trip).
    """
    shape = arrays.check_ndim("topk_ids", topk_ids, (2,), "(num_tokens, top_k)")
    n_exp = _int_arg("n_experts", n_experts, 1, 2**20)
    block = _int_arg("block", block, 1, 1024)
    ids = _check_ids(topk_ids, n_exp)
    n_slots = int(shape[0]) * int(shape[1])
    if n_slots + min(n_exp, n_slots) * (block - 1) > _INT_MAX:
        raise ArgumentError(f"topk_ids: {n_slots} slots are too many for int32 row offsets")
    max_rows = n_slots + min(n_exp, n_slots) * (block - 1)
    stream = arrays.launch_stream(stream, ids)
    sorted_slot = arrays.empty((max(max_rows, 1),), np.int32, like=ids)
    slot_pos = arrays.empty((n_slots,), np.int32, like=ids)
    offsets = arrays.empty((n_exp + 1,), np.int32, like=ids)
    counts = arrays.empty((n_exp,), np.int32, like=ids)
    n_chunks = max(1, -(-n_slots // _CHUNK))
    chunk_counts = arrays.empty((n_chunks * n_exp,), np.int32, like=ids)
    flat = ids.reshape(-1) if n_slots else arrays.zeros((1,), np.int32, like=ids)
    _launch("moe_count", (n_chunks,), (_CHUNK,), flat, chunk_counts, sorted_slot, n_slots, n_exp, max_rows,
            shared_mem=4 * n_exp, stream=stream, backend=backend)
    _launch("moe_scan", (1,), (256,), chunk_counts, counts, offsets, n_chunks, n_exp, block,
            stream=stream, backend=backend)
    if n_slots:
        _launch("moe_place", (n_chunks,), (_CHUNK,), flat, chunk_counts, offsets, sorted_slot, slot_pos, n_slots,
                n_exp, stream=stream, backend=backend)
    return sorted_slot[:max_rows], slot_pos, offsets, counts


def _experts_args(x: Any, gate_up_proj: Any, down_proj: Any, topk_ids: Any, topk_weights: Any,
                  activation: str) -> tuple:
    kind = arrays.io_kind("x", x, arrays.IO_KINDS)
    _same_kind("gate_up_proj", gate_up_proj, kind, "x")
    _same_kind("down_proj", down_proj, kind, "x")
    n_tok, hid = arrays.check_ndim("x", x, (2,), "(num_tokens, hidden)")
    gshape = arrays.check_ndim("gate_up_proj", gate_up_proj, (3,), "(E, 2 * intermediate, hidden)")
    n_exp, two_i, gh = gshape
    if gh != hid or two_i % 2 or two_i == 0:
        raise ArgumentError(f"gate_up_proj: expected shape (E, 2 * intermediate, {hid}) (hidden of x), got {gshape}")
    inter = two_i // 2
    dshape = tuple(arrays.shape_of(down_proj))
    if dshape != (n_exp, hid, inter):
        raise ArgumentError(f"down_proj: expected shape {(n_exp, hid, inter)} (E, hidden, intermediate) of "
                            f"gate_up_proj and x, got {dshape}")
    ishape = arrays.check_ndim("topk_ids", topk_ids, (2,), "(num_tokens, top_k)")
    if ishape[0] != n_tok:
        raise ArgumentError(f"topk_ids: expected {n_tok} rows (tokens of x), got shape {ishape}")
    wshape = tuple(arrays.shape_of(topk_weights, "topk_weights"))
    if wshape != tuple(ishape):
        raise ArgumentError(f"topk_weights: expected the shape of topk_ids {tuple(ishape)}, got {wshape}")
    wdt = arrays.dtype_name(topk_weights, "topk_weights")
    if wdt not in ("float32", "bfloat16", "float16"):
        raise ArgumentTypeError(f"topk_weights: expected a float dtype, got {wdt}")
    if activation not in ACTIVATIONS:
        raise ArgumentError(f"activation: expected one of {tuple(ACTIVATIONS)}, got {activation!r}")
    for name, v in (("x.shape[0]", n_tok * ishape[1]), ("hidden", hid), ("intermediate", two_i)):
        if v > _INT_MAX // 2:
            raise ArgumentError(f"{name}: expected at most {_INT_MAX // 2}, got {v}")
    ids = _check_ids(topk_ids, n_exp, bound="the experts of gate_up_proj")
    w = arrays.contiguous(arrays.astype(topk_weights, "float32"))
    return kind, n_tok, hid, n_exp, inter, int(ishape[1]), ids, w


class _Routing:
    """The permutation of one call: rows, offsets and the grouped GEMM's row count."""

    def __init__(self, ids: Any, n_exp: int, block: int, stream: Any, backend: str | None) -> None:
        self.sorted_slot, self.slot_pos, self.offsets, _ = moe_align(ids, n_exp, block, stream=stream,
                                                                     backend=backend)
        self.rows = int(arrays.shape_of(self.sorted_slot)[0])


def _gather(src: Any, r: _Routing, w: Any, dim: int, top_k: int, n_exp: int, kind: str, stream: Any,
            backend: str | None) -> Any:
    dst = arrays.empty((max(r.rows, 1), dim), kind, like=src)
    if r.rows:
        _launch("moe_gather" + _suffix(kind), (min(r.rows, _GRID_X_MAX),), (256,), src.reshape(-1), r.sorted_slot,
                w.reshape(-1) if w is not None else arrays.empty((1,), np.float32, like=src), r.offsets, dst.reshape(-1), r.rows, dim, top_k,
                n_exp, int(w is not None), stream=stream, backend=backend)
    return dst


def _combine(y: Any, r: _Routing, w: Any, n_tok: int, dim: int, top_k: int, kind: str, stream: Any,
             backend: str | None) -> Any:
    out = arrays.empty((n_tok, dim), kind, like=y)
    if n_tok:
        _launch("moe_combine" + _suffix(kind), (min(n_tok, _GRID_X_MAX),), (256,), y.reshape(-1), r.slot_pos,
                w.reshape(-1) if w is not None else arrays.empty((1,), np.float32, like=y), out.reshape(-1), n_tok, dim, top_k,
                int(w is not None), stream=stream, backend=backend)
    return out


def _ew_grid(n: int) -> tuple[int]:
    return (max(1, min(-(-n // 256), 65535 * 8)),)


@arrays.stream_scoped
def moe_experts(
    x: Any, gate_up_proj: Any, down_proj: Any, topk_ids: Any, topk_weights: Any, activation: str = "silu", *,
    tensor_cores: bool | None = None, stream: Any = None, backend: str | None = None,
) -> Any:
    """The experts block of an MoE layer, [T, H]:
    out[t] = sum_j w[t, j] * down[e] @ (act(gate[e] @ x[t]) * (up[e] @ x[t])), e = topk_ids[t, j].

    x [T, H]; gate_up_proj [E, 2I, H] (gate rows first); down_proj [E, H, I] (x's dtype, f32, bf16 or f16);
    topk_ids int32/int64 [T, k] (-1: dropped, contributes nothing); topk_weights [T, k] (used in
    fp32). Tokens are permuted by expert (padded to the GEMM tile), the activation and gate are fused
    into the first grouped GEMM's epilogue (tensor cores), and the weighted combine on unpermute
    runs in a fixed order: deterministic, no atomics. activation: "silu" or "gelu_tanh".
    """
    kind, n_tok, hid, n_exp, inter, top_k, ids, w = _experts_args(x, gate_up_proj, down_proj, topk_ids,
                                                                  topk_weights, activation)
    tc = _tc(backend, kind, tensor_cores)
    act = ACTIVATIONS[activation]
    x, gate_up_proj, down_proj = arrays.contiguous(x), arrays.contiguous(gate_up_proj), arrays.contiguous(down_proj)
    stream = arrays.launch_stream(stream, x)
    if n_tok == 0:
        return arrays.empty((0, hid), kind, like=x)
    r = _Routing(ids, n_exp, TC_BM if tc else SIMT_T, stream, backend)
    xp = _gather(x, r, None, hid, top_k, n_exp, kind, stream, backend)
    h = arrays.empty((max(r.rows, 1), inter), kind, like=x)
    if tc:
        _gemm_launch(xp.reshape(-1), gate_up_proj.reshape(-1), r.offsets, h.reshape(-1), r.rows, 2 * inter, hid,
                     n_exp, kind, act=act, tc=True, stream=stream, backend=backend)
    else:
        gu = arrays.empty((max(r.rows, 1), 2 * inter), kind, like=x)
        _gemm_launch(xp.reshape(-1), gate_up_proj.reshape(-1), r.offsets, gu.reshape(-1), r.rows, 2 * inter, hid,
                     n_exp, kind, tc=False, stream=stream, backend=backend)
        _launch("moe_act" + _suffix(kind), _ew_grid(r.rows * inter), (256,), gu.reshape(-1), h.reshape(-1),
                r.offsets, r.rows, inter, n_exp, act, stream=stream, backend=backend)
    y = arrays.empty((max(r.rows, 1), hid), kind, like=x)
    _gemm_launch(h.reshape(-1), down_proj.reshape(-1), r.offsets, y.reshape(-1), r.rows, hid, inter, n_exp, kind,
                 tc=tc, stream=stream, backend=backend)
    return _combine(y, r, w, n_tok, hid, top_k, kind, stream, backend)


@arrays.stream_scoped
def moe_experts_backward(
    grad_out: Any, x: Any, gate_up_proj: Any, down_proj: Any, topk_ids: Any, topk_weights: Any,
    activation: str = "silu", *, tensor_cores: bool | None = None, stream: Any = None, backend: str | None = None,
) -> tuple[Any, Any, Any, Any]:
    """Gradients of moe_experts: (grad_x [T, H], grad_gate_up_proj [E, 2I, H], grad_down_proj [E, H, I],
    grad_topk_weights float32 [T, k]).

    The forward's permuted intermediates are recomputed (nothing is saved but the inputs) and kept in fp32; the
    gradients come back in the inputs' dtype. bf16 / f16 with tensor cores run the recomputed gate / up and
    dy_perm @ down_proj[e] on fp32-result tensor-core GEMMs and d(x_perm) on a 16-bit one; y and the weight
    gradients, whose fp32 operands would lose accuracy rounded to 16 bits, run on split-precision tensor-core GEMMs
    (hi + lo 16-bit planes, fp32 accumulation; docs/moe.md). Weight
    gradients are per-expert GEMMs over each expert's rows, one CTA per output tile: no atomics, deterministic.
    """
    kind, n_tok, hid, n_exp, inter, top_k, ids, w = _experts_args(x, gate_up_proj, down_proj, topk_ids,
                                                                  topk_weights, activation)
    _same_kind("grad_out", grad_out, kind, "x")
    if tuple(arrays.shape_of(grad_out)) != (n_tok, hid):
        raise ArgumentError(f"grad_out: expected shape {(n_tok, hid)} (of the output), "
                            f"got {tuple(arrays.shape_of(grad_out))}")
    tc16 = _tc(backend, kind, tensor_cores)
    act = ACTIVATIONS[activation]
    if tc16:
        return _backward_tc16(grad_out, x, gate_up_proj, down_proj, ids, w, act, kind, n_tok, hid, n_exp, inter,
                              top_k, stream, backend)
    if kind != "f32":
        # No tensor cores (or tensor_cores=False): every product in fp32 on widened copies.
        f = lambda a: arrays.contiguous(arrays.astype(a, "float32"))  # noqa: E731
        gx, ggu, gdn, gw = _backward_f32(f(grad_out), f(x), f(gate_up_proj), f(down_proj), ids, w, act, n_tok, hid,
                                         n_exp, inter, top_k, stream, backend)
        return tuple(arrays.astype(g, arrays.IO_DTYPES[kind]) for g in (gx, ggu, gdn)) + (gw,)
    return _backward_f32(grad_out, x, gate_up_proj, down_proj, ids, w, act, n_tok, hid, n_exp, inter, top_k, stream,
                         backend)


def _backward_tc16(grad_out: Any, x: Any, gate_up_proj: Any, down_proj: Any, ids: Any, w: Any, act: int, kind: str,
                   n_tok: int, hid: int, n_exp: int, inter: int, top_k: int, stream: Any,
                   backend: str | None) -> tuple:
    """The bf16 / f16 backward with tensor cores. Which product runs where (docs/moe.md, the accuracy table):
    - on tensor cores with an fp32 result (the _f32out kernels; sm_90a: their wgmma forms), the products whose
      operands are exact 16-bit values: gate / up = x_perm @ gate_up_proj[e]^T, and dy_perm @ down_proj[e]
      (d(h) = w * that, the weight applied in fp32 by moe_act_backward);
    - on tensor cores with a rounded operand: d(x_perm) = d(gate_up) @ gate_up_proj[e] (within the rows);
    - on split-precision tensor-core GEMMs (sm_90a: their wgmma forms): y = h @ down_proj[e]^T (for
      grad_topk_weights) and both weight gradients, whose fp32 intermediates (h, w * dy, d(gate_up)) rounded to 16
      bits once miss the float64 rows: each travels as hi + lo planes, two or three products into fp32.
    No atomics: deterministic."""
    f = lambda a: arrays.contiguous(arrays.astype(a, "float32"))  # noqa: E731
    x, gate_up_proj, down_proj = arrays.contiguous(x), arrays.contiguous(gate_up_proj), arrays.contiguous(down_proj)
    dy = arrays.contiguous(grad_out)
    dt = arrays.IO_DTYPES[kind]
    stream = arrays.launch_stream(stream, x)
    if n_tok == 0:
        return (arrays.empty((0, hid), kind, like=x), arrays.zeros((n_exp, 2 * inter, hid), kind, like=x),
                arrays.zeros((n_exp, hid, inter), kind, like=x), arrays.empty((0, top_k), np.float32, like=x))
    r = _Routing(ids, n_exp, TC_BM, stream, backend)
    rows = max(r.rows, 1)
    kw = dict(stream=stream, backend=backend)
    xp = _gather(x, r, None, hid, top_k, n_exp, kind, stream, backend)  # 16-bit rows, exact
    gu = arrays.empty((rows, 2 * inter), "f32", like=x)
    _gemm_launch(xp.reshape(-1), gate_up_proj.reshape(-1), r.offsets, gu.reshape(-1), r.rows, 2 * inter, hid, n_exp,
                 kind, tc=True, f32out=True, **kw)
    h = arrays.empty((rows, inter), "f32", like=x)
    _launch("moe_act", _ew_grid(r.rows * inter), (256,), gu.reshape(-1), h.reshape(-1), r.offsets, r.rows, inter,
            n_exp, act, **kw)
    # h, w * dy and d(gate_up) are fp32 intermediates: their products run split (hi + lo planes of the 16-bit
    # type, docs/moe.md): one 16-bit rounding misses the float64 rows.
    h2 = _split16(h, r.rows * inter, kind, **kw)
    y = arrays.empty((rows, hid), "f32", like=x)
    # (sm_90a: the wgmma form where it applies, pykern/ops/_moe_sm90.py)
    if r.rows and not _sm90.try_launch(h2, down_proj.reshape(-1), r.offsets, y.reshape(-1), r.rows, hid, inter, n_exp,
                                       kind, None, stream, backend, f32out=True, split=True):
        _launch("grouped_gemm_tc_split_f32out" + _suffix(kind), (r.rows // TC_BM + n_exp, -(-hid // TC_BN)), (128,),
                h2, down_proj.reshape(-1), r.offsets, y.reshape(-1), r.rows, hid, inter, n_exp, shared_mem=TC_SMEM,
                **kw)
    dy32 = f(dy)
    n_slots = n_tok * top_k
    dw = arrays.empty((n_tok, top_k), np.float32, like=x)
    _launch("moe_weight_grad", (max(1, min(-(-n_slots // 8), _GRID_X_MAX)),), (256,), dy32.reshape(-1),
            y.reshape(-1), r.slot_pos, dw.reshape(-1), n_slots, hid, top_k, **kw)
    dyp = _gather(dy, r, None, hid, top_k, n_exp, kind, stream, backend)  # unweighted 16-bit rows, exact
    dh = arrays.empty((rows, inter), "f32", like=x)
    _gemm_launch(dyp.reshape(-1), down_proj.reshape(-1), r.offsets, dh.reshape(-1), r.rows, inter, hid, n_exp, kind,
                 nn=True, tc=True, f32out=True, **kw)
    # zeros: rows past the used part stay finite for the 16-bit cast before d(x_perm)
    dgu = arrays.zeros((rows, 2 * inter), "f32", like=x)
    _launch("moe_act_backward", _ew_grid(r.rows * inter), (256,), gu.reshape(-1), dh.reshape(-1), dgu.reshape(-1),
            r.sorted_slot, w.reshape(-1), r.offsets, r.rows, inter, n_exp, act, 1, **kw)
    dyw = _gather(dy32, r, w, hid, top_k, n_exp, "f32", stream, backend)  # w[t, j] * dy[t] in fp32
    g_down = arrays.empty((n_exp, hid, inter), kind, like=x)
    g_gu = arrays.empty((n_exp, 2 * inter, hid), kind, like=x)
    # grad_down_proj = (w * dy)^T h: both operands split (3 MMAs); grad_gate_up_proj = d(gate_up)^T x_perm: d(gate_up)
    # split, x_perm exact (2 MMAs). fp32 accumulation, one rounding to the 16-bit result.
    _wgrad_split(_split16(dyw, r.rows * hid, kind, **kw), h2, r, g_down, hid, inter, n_exp, kind, True, **kw)
    dgu2 = _split16(dgu, r.rows * 2 * inter, kind, **kw)
    _wgrad_split(dgu2, xp, r, g_gu, 2 * inter, hid, n_exp, kind, False, **kw)
    dxp = arrays.empty((rows, hid), kind, like=x)
    # d(x_perm) takes d(gate_up) rounded to 16 bits: the hi plane (the first r.rows * 2I elements)
    _gemm_launch(dgu2[:r.rows * 2 * inter], gate_up_proj.reshape(-1), r.offsets, dxp.reshape(-1), r.rows, hid, 2 * inter,
                 n_exp, kind, nn=True, tc=True, **kw)
    gx = _combine(dxp, r, None, n_tok, hid, top_k, kind, stream, backend)
    return gx, g_gu, g_down, dw


def _split16(v: Any, n: int, kind: str, *, stream: Any, backend: str | None) -> Any:
    """The first n elements of fp32 v as split-precision planes (flat, 2n elements of `kind`): hi = round(v), then
    lo = round((v - hi) * scale), scale 2^11 for f16 (kernels_cu/moe.cu moe_split16), 1 for bf16."""
    out = arrays.empty((max(2 * n, 2),), kind, like=v)
    if n:
        _launch("moe_split16" + _suffix(kind), _ew_grid(n), (256,), v.reshape(-1), out, n, stream=stream,
                backend=backend)
    return out


def _wgrad_split(a2: Any, b: Any, r: _Routing, out: Any, n1: int, n2: int, n_exp: int, kind: str, split_b: bool, *,
                 stream: Any, backend: str | None) -> None:
    """out[e] = a[rows of e]^T @ b[rows of e] ([E, n1, n2], in `kind`) on tensor cores with a split a (planes
    from _split16 of a [r.rows, n1]) and, with split_b, a split b; b otherwise exact 16-bit [r.rows, n2]. One CTA
    per output tile, no atomics (sm_80+; sm_90a: the wgmma form where it applies)."""
    if _sm90.try_launch_wgrad(a2, b, r.offsets, out, r.rows, n1, n2, n_exp, kind, stream, backend,
                              split=2 if split_b else 1):
        return
    if n_exp > _GRID_YZ_MAX or -(-n2 // TC_BN) > _GRID_YZ_MAX:
        raise ArgumentError(f"weight gradient of {n_exp} experts x {n2} columns is past the grid's y/z limits")
    name = "grouped_gemm_wgrad_tc_split_" + ("ab" if split_b else "a") + _suffix(kind)
    _launch(name, (-(-n1 // TC_BM), -(-n2 // TC_BN), n_exp), (128,), a2, b.reshape(-1), r.offsets, out.reshape(-1),
            n1, n2, r.rows, n_exp, shared_mem=TC_SMEM, stream=stream, backend=backend)


def _backward_f32(grad_out: Any, x: Any, gate_up_proj: Any, down_proj: Any, ids: Any, w: Any, act: int, n_tok: int,
                  hid: int, n_exp: int, inter: int, top_k: int, stream: Any, backend: str | None) -> tuple:
    """The fp32 backward on FMA kernels: (dx, dgate_up, ddown, dw)."""
    kind = "f32"
    tc = False
    x, gate_up_proj, down_proj = arrays.contiguous(x), arrays.contiguous(gate_up_proj), arrays.contiguous(down_proj)
    dy = arrays.contiguous(grad_out)
    stream = arrays.launch_stream(stream, x)
    if n_tok == 0:
        return (arrays.empty((0, hid), kind, like=x), arrays.zeros((n_exp, 2 * inter, hid), kind, like=x),
                arrays.zeros((n_exp, hid, inter), kind, like=x), arrays.empty((0, top_k), np.float32, like=x))
    r = _Routing(ids, n_exp, SIMT_T, stream, backend)
    rows = max(r.rows, 1)
    kw = dict(stream=stream, backend=backend)
    xp = _gather(x, r, None, hid, top_k, n_exp, kind, stream, backend)
    gu = arrays.empty((rows, 2 * inter), kind, like=x)
    _gemm_launch(xp.reshape(-1), gate_up_proj.reshape(-1), r.offsets, gu.reshape(-1), r.rows, 2 * inter, hid, n_exp,
                 kind, tc=tc, **kw)
    h = arrays.empty((rows, inter), kind, like=x)
    _launch("moe_act" + _suffix(kind), _ew_grid(r.rows * inter), (256,), gu.reshape(-1), h.reshape(-1), r.offsets,
            r.rows, inter, n_exp, act, **kw)
    y = arrays.empty((rows, hid), kind, like=x)
    _gemm_launch(h.reshape(-1), down_proj.reshape(-1), r.offsets, y.reshape(-1), r.rows, hid, inter, n_exp, kind,
                 tc=tc, **kw)
    n_slots = n_tok * top_k
    dw = arrays.empty((n_tok, top_k), np.float32, like=x)
    _launch("moe_weight_grad", (max(1, min(-(-n_slots // 8), _GRID_X_MAX)),), (256,), dy.reshape(-1),
            y.reshape(-1), r.slot_pos, dw.reshape(-1), n_slots, hid, top_k, **kw)
    dyp = _gather(dy, r, w, hid, top_k, n_exp, kind, stream, backend)  # w[t, j] * dy[t] per row
    dh = arrays.empty((rows, inter), kind, like=x)
    _gemm_launch(dyp.reshape(-1), down_proj.reshape(-1), r.offsets, dh.reshape(-1), r.rows, inter, hid, n_exp, kind,
                 nn=True, tc=tc, **kw)
    dgu = arrays.empty((rows, 2 * inter), kind, like=x)
    _launch("moe_act_backward", _ew_grid(r.rows * inter), (256,), gu.reshape(-1), dh.reshape(-1),
            dgu.reshape(-1), r.sorted_slot, w.reshape(-1), r.offsets, r.rows, inter, n_exp, act, 0, **kw)
    g_down = arrays.empty((n_exp, hid, inter), kind, like=x)
    g_gu = arrays.empty((n_exp, 2 * inter, hid), kind, like=x)
    _wgrad(dyp, h, r, g_down, hid, inter, n_exp, kind, **kw)
    _wgrad(dgu, xp, r, g_gu, 2 * inter, hid, n_exp, kind, **kw)
    dxp = arrays.empty((rows, hid), kind, like=x)
    _gemm_launch(dgu.reshape(-1), gate_up_proj.reshape(-1), r.offsets, dxp.reshape(-1), r.rows, hid, 2 * inter,
                 n_exp, kind, nn=True, tc=tc, **kw)
    dx = _combine(dxp, r, None, n_tok, hid, top_k, kind, stream, backend)
    return dx, g_gu, g_down, dw


def _wgrad_tc(a: Any, b: Any, offsets: Any, out: Any, m: int, n1: int, n2: int, n_exp: int, kind: str, *,
              stream: Any, backend: str | None) -> None:
    """out[e] = a[rows of e]^T @ b[rows of e] ([E, n1, n2], a [m, n1], b [m, n2]) on tensor cores (sm_90a: the
    TMA + wgmma kernel where it applies)."""
    if _sm90.try_launch_wgrad(a, b, offsets, out, m, n1, n2, n_exp, kind, stream, backend):
        return
    if n_exp > _GRID_YZ_MAX or -(-n2 // TC_BN) > _GRID_YZ_MAX:
        raise ArgumentError(f"weight gradient of {n_exp} experts x {n2} columns is past the grid's y/z limits")
    _launch("grouped_gemm_wgrad_tc" + _suffix(kind), (-(-n1 // TC_BM), -(-n2 // TC_BN), n_exp), (128,),
            a.reshape(-1), b.reshape(-1), offsets, out.reshape(-1), n1, n2, m, n_exp, shared_mem=TC_SMEM,
            stream=stream, backend=backend)


def _wgrad(a: Any, b: Any, r: _Routing, out: Any, n1: int, n2: int, n_exp: int, kind: str, *, stream: Any,
           backend: str | None) -> None:
    """out[e] = a[rows of e]^T @ b[rows of e] ([E, n1, n2]); one CTA per output tile, no atomics."""
    if -(-n1 // SIMT_T) > _GRID_YZ_MAX or n_exp > _GRID_YZ_MAX:
        raise ArgumentError(f"weight gradient of {n_exp} experts x {n1} rows is past the grid's y/z limits")
    _launch("grouped_gemm_wgrad", (-(-n2 // SIMT_T), -(-n1 // SIMT_T), n_exp), (256,), a.reshape(-1),
            b.reshape(-1), r.offsets, out.reshape(-1), r.rows, n1, n2, stream=stream, backend=backend)
