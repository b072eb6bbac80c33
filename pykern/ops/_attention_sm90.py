"""Dispatch to the Hopper (sm_90a) attention forward, kernels_cu/attention_fwd_sm90.cu.

`flash_attention` asks `usable(...)` first on its tensor-core path: on a compute-capability 9.0 GPU (nvrtc) or
with PYKERN_HOST_ARCH=sm_90a (host backend), and for the shapes the kernel compiles (head_dim == head_dim_v in
64/96/128/256, or head_dim 192 with head_dim_v 128; with or without softcap; scale > 0 without softcap: the kernel
then takes the row max on the raw scores), it runs the TMA + wgmma kernel; the dense forward also takes any other
head_dim == head_dim_v that is a multiple of 8 up to 256, on the next compiled kernel up (`padded_dim`: the TMA
zero-fills the columns past head_dim); anything else keeps the mma.sync kernels (attention_fwd_tc.cu). FP8 q, k, v
(float8_e4m3fn) ask `try_forward_fp8` (kernels_cu/attention_fwd_fp8_sm90.cu, head_dim == head_dim_v in
64/128/256). `flash_attention_varlen` asks `try_varlen` under the same conditions (the same kernel with its VARLEN
template parameter, at the compiled shapes only: its epilogue's generic stores cover the kernel's head dim). The
backward (kernels_cu/attention_bwd_sm90.cu: head_dim 64 / 96 / 128 / 256 and 192 / head_dim_v 128, with or
without softcap) serves `attention_backward`
(`try_backward`) and `flash_attention_varlen_backward` (`try_varlen_backward`).

PYKERN_SM90=0 turns this path off everywhere (forward, varlen and backward): a Hopper GPU then runs the mma.sync
kernels as an sm_80 GPU does (e.g. to compare the two on one machine). Read at each call.
"""
from __future__ import annotations

import os
from typing import Any

import numpy as np

from ..backends import get_backend, kernel_variant
from ..devices import HOST, META, array_device
from ..errors import ArgumentError

HEAD_DIMS = (64, 96, 128, 256)
# (head_dim, head_dim_v) the forward compiles: the HEAD_DIMS with head_dim_v == head_dim, and DeepSeek-V3's
# prefill shape 192 / 128.
SHAPES = (*((d, d) for d in HEAD_DIMS), (192, 128))
THREADS = 384  # FA90_THREADS: a producer warpgroup and two consumer warpgroups
ROWS = 128  # FA90_BR: queries per CTA
# Rows of one TMA store of the dense forward's epilogue: a consumer warpgroup's share of the query tile (the box of
# out's tensor map; the varlen forward stores with st.global, a box would run into the next sequence's rows).
OUT_ROWS = 64
# (keys per tile, ring stages) as the .cu's Fa90Cfg, by head_dim (192 comes with head_dim_v 128 only).
_CFG = {64: (192, 2), 96: (128, 2), 128: (128, 2), 192: (128, 2), 256: (64, 2)}
# Key tiles one iteration of the forward's steady-state loop covers (Fa90Cfg PAIR: two at d64 / d256).
LOOP_TILES = {64: 2, 96: 1, 128: 1, 192: 1, 256: 2}
# Head dims whose steady-state loop ping-pongs the two consumer warpgroups (Fa90Cfg PP: named barriers 3 and 4):
# d128, d96 and d64, dense and varlen, with and without softcap, and the paged prefill at d128, d96 and d64.
PING_PONG = {64: True, 96: True, 128: True, 192: False, 256: False}
# Whether the steady-state step overlaps the softmax of the next key tile with O += P V of the previous one (FA3's
# intra-warpgroup overlap: the .cu's Fa90Ovl), by head_dim, without / with softcap: on everywhere (at d64 with
# softcap since its two exp2 n-tiles in four on the FMA pipe: with one in four the in-place P spilled).
OVERLAP = {64: (True, True), 96: (True, True), 128: (True, True), 192: (True, True), 256: (True, True)}
# Of every 4 n-tiles (8 keys) of a steady-state key tile, how many take their exp2 on the FMA pipe (pk_exp2_fma)
# rather than the MUFU, by head_dim, without / with softcap (the .cu's Fa90Fex): at d64 with softcap the MUFU binds
# alone (the softcap's tanh doubles its work): two in four take it to 1.5 clocks an MMA, instruction issue to 1.25
# (the steps outside the hot loop take one in four: Fa90FexEdge). Without softcap the d64 MUFU only ties with the
# tensor pipe, so moving exp2s would add instructions (8 an exp2) and lower no bound.
FMA_EXP2 = {64: (0, 2), 96: (0, 0), 128: (0, 0), 192: (0, 0), 256: (0, 0)}
# Head dims whose dense forward walks several work tiles a CTA (Fa90Cfg PERSIST: the tile loop of fa90_forward): all
# of them (d256 since its producer fits the tile loop in its 24 registers: 0 spills; its pair loop 404 a pair, 0.789).
PERSISTENT = {64: True, 96: True, 128: True, 192: True, 256: True}
# The dense forward's persistent grid on the host backend (fa90_forward walks work tiles in strides of the grid): a
# few CTAs, so each walks several work tiles and the pipeline state carries across them as on a GPU.
HOST_CTAS = 3
# CTAs of the forward one SM holds: 384 threads at 168 registers take the register file (and d64's 113 KiB of
# shared memory fits once beside the L1).
CTAS_PER_SM = 1


def box(d: int) -> tuple[int, str]:
    """(head-dim columns per TMA box, swizzle) of the sm_90a forward and backward at head_dim d (the .cu's
    PkAttnBox): 64 columns (128-byte rows, 128B swizzle) where d is a multiple of 64, else 32 (64-byte rows, 64B
    swizzle: d96 is three boxes, FA3's layout)."""
    return (32, "64B") if d % 64 else (64, "128B")


def shared_bytes(d: int, d_v: int | None = None) -> int:
    """Dynamic shared memory of the sm_90a forward at head_dim d, head_dim_v d_v (default d) (FA90_SMEM_BYTES):
    Q, then the ring of K and V tiles, then the mbarriers."""
    bc, st = _CFG[d]
    d_v = d if d_v is None else d_v
    return ROWS * d * 2 + st * bc * (d + d_v) * 2 + 1024


def sm_count(backend: str, dev: int) -> int:
    """The SMs the dense forward's persistent grid fills: the device's (nvrtc), HOST_CTAS on the host backend."""
    if backend == "host":
        return HOST_CTAS
    from ._common import nvrtc_sm_count

    return nvrtc_sm_count(dev)


def forward_grid(d: int, n_tiles: int, n_q: int, n_k: int, wl: int, wr: int, sms: int) -> int:
    """CTAs of the dense forward at head_dim d over n_tiles work tiles (batch * heads * query tiles). Without a
    window (wl >= n_k and wr >= n_q: every tile has the same work) one CTA a tile, launched in order; with one
    (causal, sliding) the tiles differ and the kernel orders them longest first (fa90_dense_tile), and where it
    walks several a CTA (PERSISTENT) a grid of sms * CTAS_PER_SM CTAs each takes them in strides of the grid: the
    long tiles start first, the short ones fill the tail, and no CTA waits for the block scheduler between tiles."""
    if (wl >= n_k and wr >= n_q) or not PERSISTENT[d]:
        return n_tiles
    return max(1, min(n_tiles, sms * CTAS_PER_SM))


def padded_dim(d: int) -> int | None:
    """The compiled head dim of the dense forward that serves head_dim == head_dim_v == d: d itself in HEAD_DIMS,
    else the next one up (d <= 64 -> 64, <= 96 -> 96, <= 128 -> 128, else 256) for d a multiple of 8 up to 256 (as
    FlashAttention-3 rounds up to its compiled head dims); None for any other d. The kernel runs at the compiled
    dim over tensor maps of the true d: the TMA loads zero-fill the box columns past d (zero columns add nothing
    to Q K^T and give zero columns of P V) and the epilogue's TMA store writes only the columns below d. The
    kernel takes no head-dim parameter (every global access of the dense form goes through the maps, lse is per
    row), so nothing else changes. The varlen and paged epilogues store D columns a row with generic stores
    (past d they would write into the next head): those keep their exact head dims."""
    if d in HEAD_DIMS:
        return d
    if d % 8 or not 8 <= d <= 256:  # a multiple of 8: the maps' row strides (d * 2 bytes) stay 16-byte multiples
        return None
    return next(c for c in HEAD_DIMS if d <= c)


def forward_shape(d: int, d_v: int) -> tuple[int, int] | None:
    """(head_dim, head_dim_v) of the dense forward kernel that serves (d, d_v): (d, d_v) where SHAPES has it, else
    (padded_dim(d),) * 2 where d == d_v and `padded_dim` has one; None otherwise."""
    if (d, d_v) in SHAPES:
        return d, d_v
    p = padded_dim(d) if d == d_v else None
    return None if p is None else (p, p)


def kernel_name(d: int, d_v: int, softcap: float, suffix: str, varlen: bool = False) -> str:
    """attention_fwd[_varlen]_sm90_<shape>[_softcap]<suffix>: <shape> d{D} when d == d_v, else d{d}_dv{d_v}."""
    shape = f"d{d}" if d == d_v else f"d{d}_dv{d_v}"
    return f"attention_fwd{'_varlen' if varlen else ''}_sm90_{shape}{'_softcap' if softcap > 0.0 else ''}{suffix}"


def enabled() -> bool:
    """Whether the sm_90a kernels may run: PYKERN_SM90 unset, empty or 1; 0 turns them off."""
    value = os.environ.get("PYKERN_SM90", "").strip()
    if value not in ("", "0", "1"):
        raise ArgumentError(f"PYKERN_SM90: expected 0 or 1 (or unset), got {value!r}")
    return value != "0"


def usable(head_dim: int, head_dim_v: int, softcap: float, scale: float, q: Any, backend: str | None,
           *more: Any, shapes: tuple[tuple[int, int], ...] = SHAPES) -> bool:
    """Whether the sm_90a kernel runs this call (shape supported and the device takes sm_90a kernels).

    q and `more` are the arrays the kernel reads through tensor maps (q, k, v; dO for the backward). On the nvrtc
    backend a tensor map holds a device address, so each must already live on the GPU: host arrays (NumPy, CPU
    tensors), which the launcher stages to device memory only at launch, take the mma.sync kernels as on an sm_80
    GPU. The host backend (PYKERN_HOST_ARCH=sm_90a) maps host memory itself and takes them all. PYKERN_SM90=0:
    never. shapes: the (head_dim, head_dim_v) pairs compiled (the forward's SHAPES, or the backward's)."""
    if not enabled():
        return False
    # Without softcap the kernel takes the row max on the raw scores (max of scale * s = scale * max s needs
    # scale > 0); with one it takes it on the capped scores, whatever the scale's sign.
    if (head_dim, head_dim_v) not in shapes or not (scale > 0.0 or softcap > 0.0):
        return False
    be = get_backend(backend)
    if be.name not in ("host", "nvrtc"):
        return False
    dev = array_device(q)
    if be.name == "nvrtc" and any(array_device(a) in (HOST, META) for a in (q, *more)):
        return False
    return kernel_variant("sm_90a", be.name, dev if isinstance(dev, int) and dev >= 0 else 0)


def try_forward(q: Any, k: Any, v: Any, out: Any, lse: Any, dims: tuple[int, int, int, int, int, int, int],
                scale: float, softcap: float, wl: int, wr: int, suffix: str, stream: Any, backend: str | None) -> bool:
    """Run attention_fwd_sm90_<shape>[_softcap]{suffix} (`kernel_name`; <shape> from `forward_shape`: a head_dim
    == head_dim_v that is a multiple of 8 up to 256 runs the next compiled kernel up, over tensor maps of the true
    head dim) when `usable` and the arrays suit TMA (16-byte aligned bases); False (nothing launched) otherwise. q,
    k contiguous (batch, n, heads, head_dim), v (batch, n_k, kv_heads, head_dim_v); out (batch, n_q, heads,
    head_dim_v) contiguous, written by TMA stores (each consumer warpgroup's 64 rows of a query tile, one box per
    `box` head-dim columns of the kernel's head_dim_v: OUT_ROWS)."""
    from ..launcher import launch
    from ..tensormap import make_tensor_map

    batch, n_q, n_k, n_heads, n_kv_heads, d, d_v = dims
    shape = forward_shape(d, d_v)  # the compiled kernel's head dims (d, d_v, or the next compiled ones up)
    if shape is None or not usable(*shape, softcap, scale, q, backend, k, v, out):
        return False
    d, d_v = shape  # from here on the kernel's head dims; the maps keep the arrays' true ones
    bc, _ = _CFG[d]
    name = get_backend(backend).name
    (cq, sq), (cv, sv) = box(d), box(d_v)
    # boxes of `box` head-dim columns (a swizzle atom's row) by ROWS queries / bc keys, the kernel's; where the
    # arrays' head dim is below the kernel's (`padded_dim`), the boxes past it load zeros and store nothing
    try:
        tq = make_tensor_map(q, (1, ROWS, 1, cq), sq, backend=name)
        tk = make_tensor_map(k, (1, bc, 1, cq), sq, backend=name)
        tv = make_tensor_map(v, (1, bc, 1, cv), sv, backend=name)
        to = make_tensor_map(out, (1, OUT_ROWS, 1, cv), sv, backend=name)
    except ArgumentError:  # e.g. a view whose base is not 16-byte aligned: the mma.sync kernels take it
        return False
    dev = array_device(q)
    sms = sm_count(name, dev if isinstance(dev, int) and dev >= 0 else 0)
    n_blocks = forward_grid(d, batch * n_heads * -(-n_q // ROWS), n_q, n_k, wl, wr, sms)
    cap = (float(softcap),) if softcap > 0.0 else ()  # the _softcap kernels' last parameter
    launch(kernel_name(d, d_v, softcap, suffix), n_blocks, THREADS, tq, tk, tv, to, lse, batch, n_q, n_k,
           n_heads, n_kv_heads, float(scale), wl, wr, *cap, shared_mem=shared_bytes(d, d_v), stream=stream,
           backend=backend)
    return True



# ---- FP8 forward (kernels_cu/attention_fwd_fp8_sm90.cu) ------------------------------------------
FP8_HEAD_DIMS = (64, 128, 256)  # head_dim == head_dim_v
# FA90F8_BC: keys per tile (a 2-slot ring of K and V, 2 or 4 slots of the transposed V); 64 at d256, where the
# next tile's S beside O's 256 columns fits a thread's registers only so
FP8_KEYS = {64: 128, 128: 128, 256: 64}
# FA90F8_PP: head dims whose steady loop ping-pongs the two consumer warpgroups (their V^T takes 4 slots)
FP8_PING_PONG = {64: False, 128: True, 256: True}


def fp8_shared_bytes(d: int) -> int:
    """Dynamic shared memory of the FP8 forward at head_dim d (FA90F8_SMEM_BYTES): Q, the K ring of 2 slots, the
    V ring of 2 slots of max(keys, ROWS) * d bytes (a consumer's 64 rows of O in bf16 are staged in one), the V^T
    slots (4 where the loop ping-pongs, else 2; one byte an element), the mbarriers."""
    keys = FP8_KEYS[d]
    return ROWS * d + (2 + (4 if FP8_PING_PONG[d] else 2)) * keys * d + 2 * max(keys, ROWS) * d + 1024


def fp8_kernel_name(d: int, softcap: float = 0.0) -> str:
    """attention_fwd_sm90_d{d}[_softcap]_fp8 (the _softcap kernels when softcap > 0)."""
    return f"attention_fwd_sm90_d{d}{'_softcap' if softcap > 0.0 else ''}_fp8"


def try_forward_fp8(q: Any, k: Any, v: Any, out: Any, lse: Any, descales: tuple[tuple[Any, int], ...],
                    dims: tuple[int, int, int, int, int, int, int], scale: float, wl: int, wr: int, stream: Any,
                    backend: str | None, softcap: float = 0.0) -> bool:
    """Run attention_fwd_sm90_d{D}[_softcap]_fp8 (`fp8_kernel_name`; softcap > 0: the _softcap kernel) when
    head_dim == head_dim_v in FP8_HEAD_DIMS, `usable` (the sign of scale
    does not matter here: the kernel scales the scores before the row max) and the arrays suit TMA; False (nothing
    launched) otherwise. q, k, v contiguous float8_e4m3fn; out bf16, lse f32; descales ((array, stride), ...) for
    q, k, v: flat fp32 arrays read at (b * n_kv_heads + kvh) * stride."""
    from .. import arrays
    from ..launcher import launch
    from ..tensormap import make_tensor_map

    batch, n_q, n_k, n_heads, n_kv_heads, d, d_v = dims
    if d != d_v or d not in FP8_HEAD_DIMS or not usable(d, d, 0.0, 1.0, q, backend, k, v):
        return False
    name = get_backend(backend).name
    try:  # the e4m3 bytes in boxes of 64 head-dim columns (64 bytes: the 64B swizzle's row)
        tq = make_tensor_map(arrays.view_uint8(q), (1, ROWS, 1, 64), "64B", backend=name)
        tk = make_tensor_map(arrays.view_uint8(k), (1, FP8_KEYS[d], 1, 64), "64B", backend=name)
        tv = make_tensor_map(arrays.view_uint8(v), (1, FP8_KEYS[d], 1, 64), "64B", backend=name)
    except ArgumentError:  # e.g. a base that is not 16-byte aligned: the bf16 path takes it
        return False
    (qd, qs), (kd, ks), (vd, vs) = descales
    cap = (float(softcap),) if softcap > 0.0 else ()  # the _softcap kernels' last parameter
    launch(fp8_kernel_name(d, softcap), batch * n_heads * -(-n_q // ROWS), THREADS, tq, tk, tv, out, lse, qd, kd, vd,
           qs, ks, vs, batch, n_q, n_k, n_heads, n_kv_heads, float(scale), wl, wr, *cap, shared_mem=fp8_shared_bytes(d),
           stream=stream, backend=backend)
    return True

def fp8_varlen_kernel_name(d: int, softcap: float = 0.0) -> str:
    """attention_fwd_varlen_sm90_d{d}[_softcap]_fp8 (the _softcap kernels when softcap > 0)."""
    return f"attention_fwd_varlen_sm90_d{d}{'_softcap' if softcap > 0.0 else ''}_fp8"


def try_varlen_fp8(q: Any, k: Any, v: Any, out: Any, lse: Any, cu_q: Any, cu_k: Any,
                   descales: tuple[tuple[Any, int], ...], dims: tuple[int, int, int, int, int], scale: float,
                   softcap: float, wl: int, wr: int, stream: Any, backend: str | None) -> bool:
    """flash_attention_varlen with float8_e4m3fn q, k, v: run attention_fwd_varlen_sm90_d{D}[_softcap]_fp8
    (`fp8_varlen_kernel_name`) when head_dim in FP8_HEAD_DIMS, `usable` and the packed arrays suit TMA, else False
    (nothing launched). q (total_q, heads, D), k / v (total_k, kv_heads, D) contiguous e4m3, out (total_q, heads,
    D) bf16 / lse (total_q, heads) f32 flat; cu_q / cu_k int32 (batch + 1,); descales as try_forward_fp8's (b the
    sequence); dims (batch, max_q, heads, kv_heads, D), max_q the longest sequence's queries (the grid's query
    tiles); (wl, wr) normalized per sequence (serving ops)."""
    from .. import arrays
    from ..launcher import launch
    from ..tensormap import make_tensor_map

    batch, max_q, n_heads, n_kv_heads, d = dims
    if d not in FP8_HEAD_DIMS or not usable(d, d, 0.0, 1.0, q, backend, k, v):
        return False
    n_qt = -(-max_q // ROWS)
    if n_qt * n_heads >= 2**31:
        return False
    name = get_backend(backend).name
    total_q, total_k = arrays.shape_of(q)[0], arrays.shape_of(k)[0]
    try:  # the packed bytes as one batch of total rows: the kernel adds each sequence's first row
        tq = make_tensor_map(arrays.view_uint8(q).reshape((1, total_q, n_heads, d)), (1, ROWS, 1, 64), "64B",
                             backend=name)
        tk = make_tensor_map(arrays.view_uint8(k).reshape((1, total_k, n_kv_heads, d)), (1, FP8_KEYS[d], 1, 64), "64B",
                             backend=name)
        tv = make_tensor_map(arrays.view_uint8(v).reshape((1, total_k, n_kv_heads, d)), (1, FP8_KEYS[d], 1, 64), "64B",
                             backend=name)
    except ArgumentError:  # no key at all, or a base that is not 16-byte aligned: the bf16 path takes it
        return False
    (qd, qs), (kd, ks), (vd, vs) = descales
    cap = (float(softcap),) if softcap > 0.0 else ()  # the _softcap kernels' last parameter
    launch(fp8_varlen_kernel_name(d, softcap), (n_qt * n_heads, batch, 1), (THREADS,), tq, tk, tv, out, lse, qd, kd,
           vd, qs, ks, vs, cu_q, cu_k, n_heads, n_kv_heads, float(scale), wl, wr, *cap,
           shared_mem=fp8_shared_bytes(d), stream=stream, backend=backend)
    return True


def try_varlen(q: Any, k: Any, v: Any, out: Any, lse: Any, cu_q: Any, cu_k: Any,
               dims: tuple[int, int, int, int, int, int], scale: float, softcap: float, wl: int, wr: int,
               suffix: str, stream: Any, backend: str | None) -> bool:
    """flash_attention_varlen: run attention_fwd_varlen_sm90_<shape>[_softcap]{suffix} (`kernel_name`) when `usable`
    and the packed arrays suit TMA (and out its 16-byte stores), else False (nothing launched). q (total_q, heads,
    D), k (total_k, kv_heads, D) and v (total_k, kv_heads, DV) contiguous, out / lse (total_q, heads[, DV]); cu_q /
    cu_k int32 (batch + 1,); dims (batch, max_q, heads, kv_heads, D, DV), max_q the longest sequence's queries (the
    grid's query tiles); (wl, wr) normalized per sequence (serving ops)."""
    from .. import arrays
    from ..backends import get_backend
    from ..errors import ArgumentError
    from ..launcher import launch
    from ..tensormap import make_tensor_map

    batch, max_q, n_heads, n_kv_heads, d, d_v = dims
    if not usable(d, d_v, softcap, scale, q, backend, k, v):
        return False
    n_qt = -(-max_q // ROWS)
    # out: the epilogue's 16-byte stores (its rows' strides, n_heads * DV elements, keep that alignment)
    if n_qt * n_heads >= 2**31 or not arrays.aligned16(out):
        return False
    bc, _ = _CFG[d]
    name = get_backend(backend).name
    total_q, total_k = arrays.shape_of(q)[0], arrays.shape_of(k)[0]
    try:  # the packed arrays as one batch of total rows: the kernel adds each sequence's first row
        (cq, sq), (cv, sv) = box(d), box(d_v)
        tq = make_tensor_map(q.reshape((1, total_q, n_heads, d)), (1, ROWS, 1, cq), sq, backend=name)
        tk = make_tensor_map(k.reshape((1, total_k, n_kv_heads, d)), (1, bc, 1, cq), sq, backend=name)
        tv = make_tensor_map(v.reshape((1, total_k, n_kv_heads, d_v)), (1, bc, 1, cv), sv, backend=name)
    except ArgumentError:  # no key at all, or a base that is not 16-byte aligned: the mma.sync kernels take it
        return False
    cap = (float(softcap),) if softcap > 0.0 else ()  # the _softcap kernels' last parameter
    launch(kernel_name(d, d_v, softcap, suffix, varlen=True), (n_qt * n_heads, batch, 1), (THREADS,), tq, tk, tv,
           out, lse, cu_q, cu_k, n_heads, n_kv_heads, float(scale), wl, wr, *cap, shared_mem=shared_bytes(d, d_v),
           stream=stream, backend=backend)
    return True


# ---- paged prefill (paged_prefill_attention: fa90_forward's paged producer) ---------------------
PAGED_HEAD_DIMS = (64, 96, 128, 256)
# (head_dim, head_dim_v) of the paged kernels: the PAGED_HEAD_DIMS with head_dim_v == head_dim and DeepSeek-V3's
# 192 / 128 (V pages of 128 columns beside K pages of 192, each with its own strides).
PAGED_SHAPES = (*((d, d) for d in PAGED_HEAD_DIMS), (192, 128))
# Cache element kinds a bf16 / f16 query runs over here: its own type, or FP8 (widened to it by the producer).
PAGED_FP8 = ("e4m3", "e5m2")
# Head dims whose FP8 paged kernels stage the cache's bytes in shared memory before widening them (d256: its
# producer runs in the TMA producer's 24 registers, Fa90PagedRegs, where widening loaded pieces in registers
# spilled): BC * (head_dim + head_dim_v) bytes after the mbarriers (FA90_PAGED_FP8_STAGE, fa90_gather_rows_staged).
PAGED_FP8_STAGED = (256,)


def _paged_fp8_staged(d: int, kv_kind: str) -> bool:
    """Whether paged_prefill_sm90 at head_dim d stages kv_kind's bytes in shared memory (PAGED_FP8_STAGED)."""
    return kv_kind in PAGED_FP8 and d in PAGED_FP8_STAGED


def paged_shared_bytes(d: int, d_v: int, kv_kind: str) -> int:
    """Dynamic shared memory of paged_prefill_sm90_*: the forward's (`shared_bytes`), and the FP8 staging buffer
    where d is in PAGED_FP8_STAGED and the cache is FP8."""
    return shared_bytes(d, d_v) + (_CFG[d][0] * (d + d_v) if _paged_fp8_staged(d, kv_kind) else 0)


def paged_kernel_name(d: int, softcap: float, q_kind: str, kv_kind: str, d_v: int | None = None) -> str:
    """paged_prefill_sm90_<shape>[_softcap]_{bf16,f16}[_{e4m3,e5m2}kv]: <shape> d{d} when head_dim_v d_v is d (or
    None), else d{d}_dv{d_v}."""
    tail = f"_{kv_kind}kv" if kv_kind in PAGED_FP8 else ""
    shape = f"d{d}" if d_v in (None, d) else f"d{d}_dv{d_v}"
    return f"paged_prefill_sm90_{shape}{'_softcap' if softcap > 0.0 else ''}_{q_kind}{tail}"


def try_paged_prefill(q: Any, kf: Any, vf: Any, out: Any, lse: Any, qo: Any, table: tuple[Any, Any, Any],
                      dims: tuple[int, ...], strides: tuple[int, ...], kinds: tuple[str, str],
                      scale: float, softcap: float, v_scale: float, wl: int, wr: int, stream: Any,
                      backend: str | None) -> bool:
    """paged_prefill_attention: run paged_prefill_sm90_* (`paged_kernel_name`) when `usable`, else False (nothing
    launched). q (total_q, heads, D) contiguous bf16 / f16; kf / vf the flat caches of q's type or FP8 (kinds: (q
    kind, cache kind)); out / lse flat (total_q, heads[, D]); qo int32 (batch + 1,); table (kv_indptr, kv_indices,
    kv_last_page_len); dims (batch, max_qo, heads, kv_heads, D, page_size[, DV]) (DV, v's and out's head dim,
    default D); strides (s_page, s_tok, s_head) of both caches in elements, or those of K then those of V (six: V
    pages at their own head dim); scale with k_scale folded in; (wl, wr) normalized per sequence (serving ops). The
    producer reads the cache in 16-byte (16-bit; FP8 in PAGED_FP8_STAGED) or 8-byte (other FP8) pieces: bases and
    strides must keep them aligned.
    Any page size."""
    from .. import arrays
    from ..launcher import launch
    from ..tensormap import make_tensor_map

    batch, max_qo, n_heads, n_kv_heads, d, page_size = dims[:6]
    d_v = dims[6] if len(dims) > 6 else d
    q_kind, kv_kind = kinds
    if q_kind not in ("bf16", "f16") or kv_kind not in (q_kind, *PAGED_FP8) or (d, d_v) not in PAGED_SHAPES:
        return False
    if not usable(d, d_v, softcap, scale, q, backend, kf, vf):
        return False
    # the kernels with V's own strides are those whose head dims differ; the others read V at K's strides
    if d_v != d and len(strides) == 3 or d_v == d and len(strides) == 6 and strides[:3] != strides[3:]:
        return False
    strides = tuple(strides[:3]) + (tuple(strides[3:]) if d_v != d else ())
    # elements a 16-byte (16-bit) or 8-byte (FP8) piece; 16 where FP8 bytes are staged (16-byte cp.async)
    piece = 16 if _paged_fp8_staged(d, kv_kind) else 8
    if any(st % piece for st in strides) or not arrays.aligned16(q, kf, vf, out):
        return False
    n_qt = -(-max_qo // ROWS)
    if n_qt * n_heads >= 2**31 or batch > 65535:
        return False
    total_q = arrays.shape_of(q)[0]
    cq, sq = box(d)  # the forward's Q box (d96: 32 columns, 64B swizzle), which the gather's K / V boxes match
    try:  # the packed queries as one batch of total_q rows, as the varlen forward's
        tq = make_tensor_map(q.reshape((1, total_q, n_heads, d)), (1, ROWS, 1, cq), sq,
                             backend=get_backend(backend).name)
    except ArgumentError:
        return False
    cap = (float(softcap),) if softcap > 0.0 else ()  # the _softcap kernels' last parameter
    indptr, indices, last = table
    launch(paged_kernel_name(d, softcap, q_kind, kv_kind, d_v), (n_qt * n_heads, batch, 1), (THREADS,), tq, kf, vf,
           out, lse, qo, indptr, indices, last, n_heads, n_kv_heads, page_size, *strides, float(scale), wl, wr,
           float(v_scale), *cap, shared_mem=paged_shared_bytes(d, d_v, kv_kind), stream=stream, backend=backend)
    return True


# ---- backward (kernels_cu/attention_bwd_sm90.cu) -------------------------------------------------
BWD_HEAD_DIMS = (64, 96, 128, 256)
# (head_dim, head_dim_v) of both backward kernels (dK/dV and dQ): the BWD_HEAD_DIMS with head_dim_v == head_dim, and
# DeepSeek-V3's prefill shape 192 / 128 (the DV template parameter of ab90_dkdv / ab90_dq)
BWD_SHAPES = (*((d, d) for d in BWD_HEAD_DIMS), (192, 128))
BWD_ROWS = 128  # AB90_ROWS: keys (dK/dV, below head_dim 256) or queries (dQ) per CTA
BWD_STEP = 64  # AB90_DQ_STEP below head_dim 256: keys per streamed tile of the dQ kernel


def bwd_dq_step(d: int) -> int:
    """Keys per streamed tile of the dQ kernel (AB90_DQ_STEP): 32 at d256 (shared memory), else BWD_STEP."""
    return 32 if d >= 256 else BWD_STEP


def bwd_dkdv_step(d: int, d_v: int | None = None) -> int:
    """Queries per streamed tile of the dK/dV kernel (AB90_DKDV_STEP): 32 where dK and dV take 96 accumulator
    registers a thread or more (head_dim + head_dim_v >= 192) and at d256 (where the consumers split the head dim,
    `bwd_dkdv_split`: 128 of them, and neither consumer holds both S^T and dP^T), 16 at 192 / 128 (160 of them),
    else 64."""
    both = d + (d if d_v is None else d_v)
    return 32 if both >= 512 else 16 if both >= 320 else 32 if both >= 192 else 64


def bwd_dkdv_split(d: int, d_v: int | None = None) -> bool:
    """Whether the dK/dV kernel splits the head dim across its consumers (AB90_DKDV_SPLIT: d256): the CTA owns
    64 keys, consumer 0 computes S^T and turns it into P^T, consumer 1 dP^T and turns it into dP^T - delta, they
    swap them through shared memory, and each accumulates half of dK's and dV's columns."""
    return d + (d if d_v is None else d_v) >= 512


def bwd_dkdv_rows(d: int, d_v: int | None = None) -> int:
    """Keys per CTA of the dK/dV kernel (AB90_DKDV_ROWS): 64 where the head dim is split, else BWD_ROWS."""
    return 64 if bwd_dkdv_split(d, d_v) else BWD_ROWS


def bwd_dkdv_shared_bytes(d: int, d_v: int | None = None) -> int:
    """Dynamic shared memory of the dK/dV kernel (AB90_DKDV_SMEM_BYTES(d, d_v, 0)): the resident pair at its rows,
    the 2-stage ring at its step, the split's swap buffers (AB90_XCH_BYTES: 2 tile parities x 3 slots (P^T,
    dP^T - delta, softcap's P^T (1 - t^2)) x step / 2 floats x 128 threads), the mbarriers."""
    d_v = d if d_v is None else d_v
    c, rows = bwd_dkdv_step(d, d_v), bwd_dkdv_rows(d, d_v)
    xch = 2 * 3 * (c // 2) * 128 * 4 if bwd_dkdv_split(d, d_v) else 0
    return rows * (d + d_v) * 2 + 2 * c * (d + d_v) * 2 + xch + 1024


def bwd_shared_bytes(d: int, step: int, d_v: int | None = None) -> int:
    """Dynamic shared memory of a backward kernel at head_dim d, head_dim_v d_v (default d) with `step` rows a
    streamed tile (AB90_SMEM_BYTES; the dQ kernel's, and the dK/dV kernel's where it keeps BWD_ROWS keys and does
    not split): the resident pair, the 2-stage ring of pairs, the mbarriers."""
    d_v = d if d_v is None else d_v
    return BWD_ROWS * (d + d_v) * 2 + 2 * step * (d + d_v) * 2 + 1024


def bwd_kernel_name(part: str, d: int, softcap: float, suffix: str, varlen: bool = False,
                    d_v: int | None = None) -> str:
    """attention_bwd[_varlen]_sm90_{part}_<shape>[_softcap]{suffix}, part "dkdv" or "dq"; <shape> d{d} when
    head_dim_v d_v is d (or None), else d{d}_dv{d_v}."""
    shape = f"d{d}" if d_v in (None, d) else f"d{d}_dv{d_v}"
    return f"attention_bwd{'_varlen' if varlen else ''}_sm90_{part}_{shape}{'_softcap' if softcap > 0.0 else ''}{suffix}"


def backward_usable(d: int, softcap: float, scale: float, q: Any, backend: str | None, *more: Any,
                    d_v: int | None = None) -> bool:
    """Whether the sm_90a backward (both kernels) runs this call: (head_dim, head_dim_v) in BWD_SHAPES (d_v None:
    head_dim) (with or without softcap: the _softcap kernels) and `usable` (q and `more`: q, k, v, dO)."""
    d_v = d if d_v is None else d_v
    return usable(d, d_v, softcap, scale, q, backend, *more, shapes=BWD_SHAPES)


def _tensor_maps(name: str, rows: tuple[int, int], q4: Any, g4: Any, k4: Any, v4: Any,
                 qk_box: tuple[int, str] | None = None) -> list:
    """The backward's tensor maps over q, dO, k, v (4-D views): boxes of `box` columns by rows[0] (q, dO) /
    rows[1] (k, v) rows, each array at its own head dim (q, k: head_dim; v, dO: head_dim_v); qk_box: q's and k's
    (columns, swizzle) instead (`bwd_fused_qk_box`)."""
    from .. import arrays
    from ..tensormap import make_tensor_map

    out = []
    for i, (a, r) in enumerate(((q4, rows[0]), (g4, rows[0]), (k4, rows[1]), (v4, rows[1]))):
        cols, swizzle = qk_box if qk_box is not None and i in (0, 2) else box(arrays.shape_of(a)[3])
        out.append(make_tensor_map(a, (1, r, 1, cols), swizzle, backend=name))
    return out


def try_backward(q: Any, k: Any, v: Any, g: Any, lse: Any, delta: Any, dims: tuple[int, ...], scale: float,
                 win: tuple[int, int, float], kind: str, suffix: str, stream: Any, backend: str | None) -> Any:
    """(dq, dk, dv) from the sm_90a backward kernels when they apply (`backward_usable`), else None (nothing
    launched). q, k, v, g
    contiguous; lse and delta fp32 per (batch, query, head). dims (batch, n_q, n_k, heads, kv_heads, head_dim[,
    head_dim_v]): v and g at head_dim_v (default head_dim; 192 / 128 runs the _d192_dv128 kernels)."""
    from .. import arrays
    from ..backends import get_backend
    from ..errors import ArgumentError
    from ..launcher import launch

    b, n_q, n_k, h, kvh, d = dims[:6]
    d_v = dims[6] if len(dims) > 6 else d
    wl, wr, softcap = win
    if not backward_usable(d, softcap, scale, q, backend, k, v, g, d_v=d_v):
        return None
    name = get_backend(backend).name
    c = bwd_dkdv_step(d, d_v)
    q4, k4 = q.reshape((b, n_q, h, d)), k.reshape((b, n_k, kvh, d))
    g4, v4 = g.reshape((b, n_q, h, d_v)), v.reshape((b, n_k, kvh, d_v))
    try:  # q, dO, k, v; boxes of `box` head-dim columns
        kv_maps = _tensor_maps(name, (c, bwd_dkdv_rows(d, d_v)), q4, g4, k4, v4)
        q_maps = _tensor_maps(name, (BWD_ROWS, bwd_dq_step(d)), q4, g4, k4, v4)
    except ArgumentError:  # e.g. a base that is not 16-byte aligned: the mma.sync kernels take it
        return None
    dq = arrays.empty(arrays.shape_of(q), kind, like=q)
    dk = arrays.empty(arrays.shape_of(k), kind, like=q)
    dv = arrays.empty(arrays.shape_of(v), kind, like=q)
    cap = (float(softcap),) if softcap > 0.0 else ()  # the _softcap kernels' last parameter
    tail = (b, n_q, n_k, h, kvh, float(scale), wl, wr, *cap)
    tq, tdo, tk, tv = kv_maps
    launch(bwd_kernel_name("dkdv", d, softcap, suffix, d_v=d_v), b * kvh * -(-n_k // bwd_dkdv_rows(d, d_v)),
           THREADS, tq, tk, tv, tdo, lse, delta, dk, dv, *tail, shared_mem=bwd_dkdv_shared_bytes(d, d_v),
           stream=stream, backend=backend)
    tq, tdo, tk, tv = q_maps
    launch(bwd_kernel_name("dq", d, softcap, suffix, d_v=d_v), b * h * -(-n_q // BWD_ROWS), THREADS, tq, tk, tv,
           tdo, lse, delta, dq, *tail, shared_mem=bwd_shared_bytes(d, bwd_dq_step(d), d_v), stream=stream,
           backend=backend)
    return dq, dk, dv


# The fused dK / dV / dQ kernels (attention_bwd[_varlen]_sm90_fused[_det]_{d64,d96,d128,d256,d192_dv128}[_softcap]):
# dense and varlen, with or without softcap.
# the fused kernel's dQ^T split: two consumers of 32 queries (d64) or 64 head-dim rows (d128; d96: rows 0.. and
# 32.. of its three 32-column boxes, rows 32..63 computed twice), or at d256 the split dK/dV kernel's 64 keys with
# 128 head-dim rows a consumer (`bwd_dkdv_split`); at 192 / 128 FlashAttention-3's tiling (`bwd_fused_kt`: 96-key
# CTAs, 64-query tiles, dQ's head-dim columns split between the consumers)
BWD_FUSED_HEAD_DIMS = (64, 96, 128, 256)
BWD_FUSED_SHAPES = (*((d, d) for d in BWD_FUSED_HEAD_DIMS), (192, 128))
BWD_FUSED_PAD = 64  # the fp32 dQ accumulator's query rows are padded to a multiple of this (every query tile)


def bwd_fused_kt(d: int, d_v: int | None = None) -> bool:
    """Whether the fused kernel at (d, d_v) is FlashAttention-3's tiling (ab90_fused_kt: 192 / 128): 96-key CTAs
    (AB90_KT_ROWS), 64-query tiles (AB90_KT_STEP), q and k in 32-column boxes (`bwd_fused_qk_box`)."""
    return d_v is not None and d_v != d


def bwd_fused_rows(d: int, d_v: int | None = None) -> int:
    """Keys per CTA of the fused kernel: 96 on FlashAttention-3's tiling (192 / 128), else the dK/dV kernel's."""
    return 96 if bwd_fused_kt(d, d_v) else bwd_dkdv_rows(d)


def bwd_fused_step(d: int, d_v: int | None = None) -> int:
    """Queries per streamed tile of the fused kernel: 64 on FlashAttention-3's tiling (192 / 128), else the dK/dV
    kernel's (the query tile of its _det semaphores too)."""
    return 64 if bwd_fused_kt(d, d_v) else bwd_dkdv_step(d)


def bwd_fused_qk_box(d: int, d_v: int | None = None) -> tuple[int, str] | None:
    """q's and k's TMA boxes of the fused kernel where they are not `box`'s: 32 columns, 64B swizzle on
    FlashAttention-3's tiling (its dQ halves read K MN-major 96 columns wide, three 32-column atoms)."""
    return (32, "64B") if bwd_fused_kt(d, d_v) else None


def bwd_fused_shared_bytes(d: int, d_v: int | None = None) -> int:
    """Dynamic shared memory of the fused kernel (AB90_DKDV_SMEM_BYTES(d, d_v, DQA > 0)): the dK/dV kernel's
    (`bwd_dkdv_shared_bytes`, the split's swap buffers included at d256), two dS buffers of its keys
    (`bwd_dkdv_rows`) x the streamed tile's queries and fp32 dQ tiles of the streamed tile's queries x d, the
    sources of its bulk reduce-adds (AB90_DQ_BUFS: two, double-buffered; one at d256, where two would not fit)."""
    if bwd_fused_kt(d, d_v):
        # AB90_KT_SMEM_BYTES: K, V resident, the 2-stage ring of (Q, dO), P^T and dS^T, one fp32 dQ tile, mbarriers
        assert d_v is not None
        rows, c = bwd_fused_rows(d, d_v), bwd_fused_step(d, d_v)
        return rows * (d + d_v) * 2 + 2 * c * (d + d_v) * 2 + 2 * rows * c * 2 + c * d * 4 + 1024
    c = bwd_dkdv_step(d)
    dq_tiles = (1 if bwd_dkdv_split(d) else 2) * c * d * 4
    return bwd_dkdv_shared_bytes(d) + 2 * bwd_dkdv_rows(d) * c * 2 + dq_tiles


def bwd_fused_acc_split(d: int, d_v: int | None = None) -> tuple[int, int]:
    """(head-dim columns, runs a head) of the fused kernel's fp32 dQ accumulator: (d, 1) below d256, where it is
    (batch, heads, nq_pad, d); (128, 2) at d256 (`bwd_dkdv_split`), where each consumer adds its half of the head
    dim into a run of its own, (batch, heads, 2, nq_pad, 128): a d128 accumulator with twice the heads, which the
    d128 convert pass (attention_bwd_tc_dq_reduce_d128) reads as dQ's (batch, query, 2 * heads, 128); (64, 3) at
    192 / 128, each 64-column third of the head dim a run of its own (a tile's dQ leaves as three bulk
    reduce-adds), (batch, heads, 3, nq_pad, 64), read by the d64 convert pass as dQ's (batch, query, 3 * heads,
    64)."""
    if d_v is not None and d_v != d:
        return 64, d // 64
    return (128, 2) if bwd_dkdv_split(d) else (d, 1)


def bwd_fused_kernel_name(d: int, deterministic: bool, suffix: str, softcap: float = 0.0,
                          varlen: bool = False, d_v: int | None = None) -> str:
    """attention_bwd[_varlen]_sm90_fused[_det]_<shape>[_softcap]{suffix}, <shape> d{d} when head_dim_v d_v is d
    (or None), else d{d}_dv{d_v}."""
    shape = f"d{d}" if d_v in (None, d) else f"d{d}_dv{d_v}"
    return (f"attention_bwd{'_varlen' if varlen else ''}_sm90_fused{'_det' if deterministic else ''}_{shape}"
            f"{'_softcap' if softcap > 0.0 else ''}{suffix}")


def backward_fused_usable(d: int, softcap: float, scale: float, q: Any, backend: str | None, *more: Any,
                          d_v: int | None = None) -> bool:
    """Whether the fused sm_90a backward runs this call (dense or varlen): `backward_usable` and (head_dim,
    head_dim_v) in BWD_FUSED_SHAPES (d_v None: head_dim), with or without softcap (the _softcap kernels)."""
    d_v = d if d_v is None else d_v
    if (d, d_v) not in BWD_FUSED_SHAPES:
        return False
    return backward_usable(d, softcap, scale, q, backend, *more, d_v=d_v)


def try_backward_fused(q: Any, k: Any, v: Any, g: Any, lse2: Any, dlt: Any, dq_acc: Any, dk: Any, dv: Any,
                       dims: tuple[int, ...], nq_pad: int, scale: float, win: tuple[int, int], deterministic: bool,
                       suffix: str, stream: Any, backend: str | None, softcap: float = 0.0) -> bool:
    """Run attention_bwd_sm90_fused[_det]_d{D}[_softcap]{suffix} into dk, dv and the fp32 dQ accumulator dq_acc (batch,
    heads, nq_pad, D) (d256: (batch, heads, 2, nq_pad, 128), `bwd_fused_acc_split`), zeroed, when the arrays suit TMA; False (nothing launched) otherwise. lse2 (times log2 e) and
    dlt are attention_bwd_tc_prep's (batch, heads, nq_pad) runs; nq_pad a multiple of BWD_FUSED_PAD. The caller
    checked `backward_fused_usable`. deterministic: the semaphore-ordered kernel (its int32 semaphores are
    allocated and zeroed here)."""
    from .. import arrays
    from ..launcher import launch

    b, n_q, n_k, h, kvh, d = dims[:6]
    d_v = dims[6] if len(dims) > 6 else d
    wl, wr = win
    rows = bwd_fused_rows(d, d_v)
    n_blocks = b * kvh * -(-n_k // rows)
    if n_blocks >= 2**31 or nq_pad % BWD_FUSED_PAD or nq_pad < n_q:
        return False
    name = get_backend(backend).name
    c = bwd_fused_step(d, d_v)
    q4, g4 = q.reshape((b, n_q, h, d)), g.reshape((b, n_q, h, d_v))
    k4, v4 = k.reshape((b, n_k, kvh, d)), v.reshape((b, n_k, kvh, d_v))
    try:  # boxes as the dK/dV kernel's: `box` head-dim columns by c queries / `rows` keys
        tq, tdo, tk, tv = _tensor_maps(name, (c, rows), q4, g4, k4, v4, bwd_fused_qk_box(d, d_v))
    except ArgumentError:  # e.g. a base that is not 16-byte aligned: the caller takes another path
        return False
    # one semaphore per (batch, head, query tile of c); the atomic kernel never reads it
    sem = arrays.zeros((max(b * h * -(-n_q // c), 1) if deterministic else 1,), np.int32, like=dq_acc)
    cap = (float(softcap),) if softcap > 0.0 else ()  # the _softcap kernels' last parameter
    launch(bwd_fused_kernel_name(d, deterministic, suffix, softcap, d_v=d_v), n_blocks, THREADS, tq, tk, tv, tdo,
           lse2, dlt, dk, dv, dq_acc, sem, b, n_q, n_k, h, kvh, nq_pad, float(scale), wl, wr, *cap,
           shared_mem=bwd_fused_shared_bytes(d, d_v), stream=stream, backend=backend)
    return True


def bwd_varlen_fused_pad(total_q: int) -> int:
    """The varlen fused kernel's accumulator rows a head (nq_pad): total_q plus one query tile, rounded up to
    BWD_FUSED_PAD (the kernel adds zeros for a tile's rows past its sequence's end, unchecked)."""
    return -(-(total_q + BWD_FUSED_PAD) // BWD_FUSED_PAD) * BWD_FUSED_PAD


def try_varlen_backward_fused(q: Any, k: Any, v: Any, g: Any, lse2: Any, dlt: Any, dq_acc: Any, dk: Any, dv: Any,
                              cu_q: Any, cu_k: Any, dims: tuple[int, ...], nq_pad: int, scale: float,
                              win: tuple[int, int], softcap: float, deterministic: bool, suffix: str, stream: Any,
                              backend: str | None) -> bool:
    """flash_attention_varlen_backward: run attention_bwd_varlen_sm90_fused[_det]_d{D}[_softcap]{suffix} into dk,
    dv and the fp32 dQ accumulator dq_acc (heads, nq_pad, D) (d256: (heads, 2, nq_pad, 128)) over the packed rows
    (a token's row at its packed index), zeroed, when the packed arrays suit TMA; False (nothing launched) otherwise. q, g (total_q, heads, D),
    k, v (total_k, kv_heads, D); lse2 (times log2 e) and dlt attention_bwd_tc_prep's (heads, nq_pad) runs of the
    packed rows as one batch; nq_pad a multiple of BWD_FUSED_PAD >= total_q + BWD_FUSED_PAD (`bwd_varlen_fused_pad`:
    a query tile's zero adds past a sequence's end stay inside the head's run); dims (batch, max_q, max_k, heads,
    kv_heads, D); (wl, wr) normalized (unbounded = 2^30), clamped per sequence by the kernel. The caller checked
    `backward_fused_usable`. deterministic: one int32 semaphore per (sequence, head, query tile of max_q)."""
    from .. import arrays
    from ..launcher import launch

    batch, max_q, max_k, h, kvh, d = dims[:6]
    d_v = dims[6] if len(dims) > 6 else d
    wl, wr = win
    rows = bwd_fused_rows(d, d_v)
    n_blocks = batch * kvh * -(-max_k // rows)
    total_q, total_k = arrays.shape_of(q)[0], arrays.shape_of(k)[0]
    if n_blocks >= 2**31 or nq_pad % BWD_FUSED_PAD or nq_pad < bwd_varlen_fused_pad(total_q):
        return False
    name = get_backend(backend).name
    c = bwd_fused_step(d, d_v)
    q4, g4 = q.reshape((1, total_q, h, d)), g.reshape((1, total_q, h, d_v))
    k4, v4 = k.reshape((1, total_k, kvh, d)), v.reshape((1, total_k, kvh, d_v))
    try:  # the packed rows as one batch; boxes as the dense fused kernel's
        tq, tdo, tk, tv = _tensor_maps(name, (c, rows), q4, g4, k4, v4, bwd_fused_qk_box(d, d_v))
    except ArgumentError:  # no query or key at all, or a base off 16 bytes: the caller takes another path
        return False
    sem = arrays.zeros((max(batch * h * -(-max_q // c), 1) if deterministic else 1,), np.int32, like=dq_acc)
    cap = (float(softcap),) if softcap > 0.0 else ()
    if n_blocks:
        launch(bwd_fused_kernel_name(d, deterministic, suffix, softcap, varlen=True, d_v=d_v), n_blocks, THREADS, tq,
               tk, tv, tdo, lse2, dlt, dk, dv, dq_acc, sem, cu_q, cu_k, batch, max_q, max_k, h, kvh, nq_pad,
               float(scale), wl, wr, *cap, shared_mem=bwd_fused_shared_bytes(d, d_v), stream=stream, backend=backend)
    return True


def try_varlen_backward(q: Any, k: Any, v: Any, g: Any, lse: Any, delta: Any, dq: Any, dk: Any, dv: Any,
                        cu_q: Any, cu_k: Any, dims: tuple[int, ...], scale: float, wl: int,
                        wr: int, softcap: float, suffix: str, stream: Any, backend: str | None) -> bool:
    """flash_attention_varlen_backward: run attention_bwd_varlen_sm90_{dkdv,dq}_<shape>[_softcap]{suffix}
    (`bwd_kernel_name`) into dq, dk, dv when `backward_usable` and the packed arrays suit TMA, else False (nothing
    launched). q (total_q, heads, D), k (total_k, kv_heads, D), v (total_k, kv_heads, DV), g (total_q, heads, DV)
    contiguous; lse, delta fp32 (total_q, heads); cu_q / cu_k int32 (batch + 1,); dims (batch, max_q, max_k, heads,
    kv_heads, D[, DV]) (DV default D), the longest sequence's lengths sizing the grid; (wl, wr) normalized per
    sequence (unbounded = 2^30), clamped by the kernels."""
    from .. import arrays
    from ..launcher import launch

    batch, max_q, max_k, h, kvh, d = dims[:6]
    d_v = dims[6] if len(dims) > 6 else d
    if not backward_usable(d, softcap, scale, q, backend, k, v, g, d_v=d_v):
        return False
    n_kv_blocks, n_q_blocks = batch * kvh * -(-max_k // bwd_dkdv_rows(d, d_v)), batch * h * -(-max_q // BWD_ROWS)
    if max(n_kv_blocks, n_q_blocks) >= 2**31:  # the kernels' 1-D grid
        return False
    name = get_backend(backend).name
    c = bwd_dkdv_step(d, d_v)
    total_q, total_k = arrays.shape_of(q)[0], arrays.shape_of(k)[0]
    q4, g4 = q.reshape((1, total_q, h, d)), g.reshape((1, total_q, h, d_v))
    k4, v4 = k.reshape((1, total_k, kvh, d)), v.reshape((1, total_k, kvh, d_v))
    try:  # the packed rows as one batch; boxes as the dense backward's
        kv_maps = _tensor_maps(name, (c, bwd_dkdv_rows(d, d_v)), q4, g4, k4, v4)
        q_maps = _tensor_maps(name, (BWD_ROWS, bwd_dq_step(d)), q4, g4, k4, v4)
    except ArgumentError:  # no query or key at all, or a base off 16 bytes: the mma.sync kernels take it
        return False
    cap = (float(softcap),) if softcap > 0.0 else ()
    tail = (cu_q, cu_k, batch, max_q, max_k, h, kvh, float(scale), wl, wr, *cap)
    if n_kv_blocks:
        tq, tdo, tk, tv = kv_maps
        launch(bwd_kernel_name("dkdv", d, softcap, suffix, varlen=True, d_v=d_v), n_kv_blocks, THREADS, tq, tk, tv,
               tdo, lse, delta, dk, dv, *tail, shared_mem=bwd_dkdv_shared_bytes(d, d_v), stream=stream,
               backend=backend)
    if n_q_blocks:
        tq, tdo, tk, tv = q_maps
        launch(bwd_kernel_name("dq", d, softcap, suffix, varlen=True, d_v=d_v), n_q_blocks, THREADS, tq, tk, tv, tdo,
               lse, delta, dq, *tail, shared_mem=bwd_shared_bytes(d, bwd_dq_step(d), d_v), stream=stream,
               backend=backend)
    return True

