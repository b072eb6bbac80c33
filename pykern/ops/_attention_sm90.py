"""Dispatch to the Hopper (sm_90a) attention forward, kernels_cu/attention_fwd_sm90.cu.

`flash_attention` asks `usable(...)` first on its tensor-core path: on a compute-capability 9.0 GPU (nvrtc) or
with PYKERN_HOST_ARCH=sm_90a (host backend), and for the shapes the kernel compiles (head_dim == head_dim_v in
64/128/256, or head_dim 192 with head_dim_v 128; with or without softcap; scale > 0 without softcap: the kernel
then takes the row max on the raw scores), it runs the TMA + wgmma kernel; anything else keeps the mma.sync
kernels (attention_fwd_tc.cu). `flash_attention_varlen` asks `try_varlen` under the same conditions (the same
kernel with its VARLEN template parameter, at the same shapes). The backward
(kernels_cu/attention_bwd_sm90.cu: head_dim 64 / 128, with or without softcap; at 256 its dQ kernel alone) serves
`attention_backward`
(`try_backward`) and `flash_attention_varlen_backward` (`try_varlen_backward`).

PYKERN_SM90=0 turns this path off everywhere (forward, varlen and backward): a Hopper GPU then runs the mma.sync
kernels as an sm_80 GPU does (e.g. to compare the two on one machine). Read at each call.
"""
from __future__ import annotations

import os
from typing import Any

from ..backends import get_backend, kernel_variant
from ..devices import HOST, META, array_device
from ..errors import ArgumentError

HEAD_DIMS = (64, 128, 256)
# (head_dim, head_dim_v) the forward compiles: the HEAD_DIMS with head_dim_v == head_dim, and DeepSeek-V3's
# prefill shape 192 / 128.
SHAPES = (*((d, d) for d in HEAD_DIMS), (192, 128))
THREADS = 384  # FA90_THREADS: a producer warpgroup and two consumer warpgroups
ROWS = 128  # FA90_BR: queries per CTA
# (keys per tile, ring stages) as the .cu's Fa90Cfg, by head_dim (192 comes with head_dim_v 128 only).
_CFG = {64: (192, 2), 128: (128, 2), 192: (128, 2), 256: (64, 2)}
# Key tiles one iteration of the forward's steady-state loop covers (Fa90Cfg PAIR: two at d64 / d256).
LOOP_TILES = {64: 2, 128: 1, 192: 1, 256: 2}
# Head dims whose steady-state loop ping-pongs the two consumer warpgroups (Fa90Cfg PP: named barriers 3 and 4).
PING_PONG = {64: False, 128: True, 192: False, 256: False}
# Whether the steady-state step overlaps the softmax of the next key tile with O += P V of the previous one (FA3's
# intra-warpgroup overlap: Fa90Cfg's OVL); off at d64, where its extra wgmma wait lifts the loop past 2.0
# warp-instructions per m16n8k16-equivalent.
OVERLAP = {64: False, 128: True, 192: True, 256: True}


def shared_bytes(d: int, d_v: int | None = None) -> int:
    """Dynamic shared memory of the sm_90a forward at head_dim d, head_dim_v d_v (default d) (FA90_SMEM_BYTES):
    Q, then the ring of K and V tiles, then the mbarriers."""
    bc, st = _CFG[d]
    d_v = d if d_v is None else d_v
    return ROWS * d * 2 + st * bc * (d + d_v) * 2 + 1024


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
           *more: Any) -> bool:
    """Whether the sm_90a kernel runs this call (shape supported and the device takes sm_90a kernels).

    q and `more` are the arrays the kernel reads through tensor maps (q, k, v; dO for the backward). On the nvrtc
    backend a tensor map holds a device address, so each must already live on the GPU: host arrays (NumPy, CPU
    tensors), which the launcher stages to device memory only at launch, take the mma.sync kernels as on an sm_80
    GPU. The host backend (PYKERN_HOST_ARCH=sm_90a) maps host memory itself and takes them all. PYKERN_SM90=0:
    never."""
    if not enabled():
        return False
    # Without softcap the kernel takes the row max on the raw scores (max of scale * s = scale * max s needs
    # scale > 0); with one it takes it on the capped scores, whatever the scale's sign.
    if (head_dim, head_dim_v) not in SHAPES or not (scale > 0.0 or softcap > 0.0):
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
    """Run attention_fwd_sm90_<shape>[_softcap]{suffix} (`kernel_name`) when `usable` and the arrays suit TMA
    (16-byte aligned bases); False (nothing launched) otherwise. q, k contiguous (batch, n, heads, head_dim), v
    (batch, n_k, kv_heads, head_dim_v)."""
    from ..launcher import launch
    from ..tensormap import make_tensor_map

    batch, n_q, n_k, n_heads, n_kv_heads, d, d_v = dims
    if not usable(d, d_v, softcap, scale, q, backend, k, v):
        return False
    bc, _ = _CFG[d]
    name = get_backend(backend).name
    try:  # boxes of 64 head-dim columns (128 bytes: the 128B swizzle's row) by ROWS queries / bc keys
        tq = make_tensor_map(q, (1, ROWS, 1, 64), "128B", backend=name)
        tk = make_tensor_map(k, (1, bc, 1, 64), "128B", backend=name)
        tv = make_tensor_map(v, (1, bc, 1, 64), "128B", backend=name)
    except ArgumentError:  # e.g. a view whose base is not 16-byte aligned: the mma.sync kernels take it
        return False
    n_blocks = batch * n_heads * -(-n_q // ROWS)
    cap = (float(softcap),) if softcap > 0.0 else ()  # the _softcap kernels' last parameter
    launch(kernel_name(d, d_v, softcap, suffix), n_blocks, THREADS, tq, tk, tv, out, lse, batch, n_q, n_k,
           n_heads, n_kv_heads, float(scale), wl, wr, *cap, shared_mem=shared_bytes(d, d_v), stream=stream,
           backend=backend)
    return True


def try_varlen(q: Any, k: Any, v: Any, out: Any, lse: Any, cu_q: Any, cu_k: Any,
               dims: tuple[int, int, int, int, int, int], scale: float, softcap: float, wl: int, wr: int,
               suffix: str, stream: Any, backend: str | None) -> bool:
    """flash_attention_varlen: run attention_fwd_varlen_sm90_<shape>[_softcap]{suffix} (`kernel_name`) when `usable`
    and the packed arrays suit TMA, else False (nothing launched). q (total_q, heads, D), k (total_k, kv_heads, D)
    and v (total_k, kv_heads, DV) contiguous, out / lse (total_q, heads[, DV]); cu_q / cu_k int32 (batch + 1,); dims
    (batch, max_q, heads, kv_heads, D, DV), max_q the longest sequence's queries (the grid's query tiles); (wl, wr)
    normalized per sequence (serving ops)."""
    from .. import arrays
    from ..backends import get_backend
    from ..errors import ArgumentError
    from ..launcher import launch
    from ..tensormap import make_tensor_map

    batch, max_q, n_heads, n_kv_heads, d, d_v = dims
    if not usable(d, d_v, softcap, scale, q, backend, k, v):
        return False
    n_qt = -(-max_q // ROWS)
    if n_qt * n_heads >= 2**31:
        return False
    bc, _ = _CFG[d]
    name = get_backend(backend).name
    total_q, total_k = arrays.shape_of(q)[0], arrays.shape_of(k)[0]
    try:  # the packed arrays as one batch of total rows: the kernel adds each sequence's first row
        tq = make_tensor_map(q.reshape((1, total_q, n_heads, d)), (1, ROWS, 1, 64), "128B", backend=name)
        tk = make_tensor_map(k.reshape((1, total_k, n_kv_heads, d)), (1, bc, 1, 64), "128B", backend=name)
        tv = make_tensor_map(v.reshape((1, total_k, n_kv_heads, d_v)), (1, bc, 1, 64), "128B", backend=name)
    except ArgumentError:  # no key at all, or a base that is not 16-byte aligned: the mma.sync kernels take it
        return False
    cap = (float(softcap),) if softcap > 0.0 else ()  # the _softcap kernels' last parameter
    launch(kernel_name(d, d_v, softcap, suffix, varlen=True), (n_qt * n_heads, batch, 1), (THREADS,), tq, tk, tv,
           out, lse, cu_q, cu_k, n_heads, n_kv_heads, float(scale), wl, wr, *cap, shared_mem=shared_bytes(d, d_v),
           stream=stream, backend=backend)
    return True


# ---- backward (kernels_cu/attention_bwd_sm90.cu) -------------------------------------------------
BWD_HEAD_DIMS = (64, 128)
BWD_ROWS = 128  # AB90_ROWS: keys (dK/dV) or queries (dQ) per CTA
BWD_STEP = 64  # AB90_DQ_STEP at head_dim 64 / 128: keys per streamed tile of the dQ kernel
# head_dims of the dQ kernel: BWD_HEAD_DIMS and 256 (whose dK / dV the mma.sync kernels compute)
BWD_DQ_HEAD_DIMS = (*BWD_HEAD_DIMS, 256)


def bwd_dq_step(d: int) -> int:
    """Keys per streamed tile of the dQ kernel (AB90_DQ_STEP): 32 at d256 (shared memory), else BWD_STEP."""
    return 32 if d >= 256 else BWD_STEP


def bwd_dkdv_step(d: int) -> int:
    """Queries per streamed tile of the dK/dV kernel (AB90_DKDV_STEP)."""
    return 32 if d >= 128 else 64


def bwd_shared_bytes(d: int, step: int) -> int:
    """Dynamic shared memory of a backward kernel at head_dim d with `step` rows a streamed tile."""
    return 2 * BWD_ROWS * d * 2 + 2 * 2 * step * d * 2 + 1024


def bwd_kernel_name(part: str, d: int, softcap: float, suffix: str, varlen: bool = False) -> str:
    """attention_bwd[_varlen]_sm90_{part}_d{d}[_softcap]{suffix}, part "dkdv" or "dq"."""
    return f"attention_bwd{'_varlen' if varlen else ''}_sm90_{part}_d{d}{'_softcap' if softcap > 0.0 else ''}{suffix}"


def backward_usable(d: int, softcap: float, scale: float, q: Any, backend: str | None, *more: Any) -> bool:
    """Whether the sm_90a backward runs this call: head_dim == head_dim_v in BWD_HEAD_DIMS (with or without
    softcap: the _softcap kernels) and `usable` (q and `more`: q, k, v, dO)."""
    return d in BWD_HEAD_DIMS and usable(d, d, softcap, scale, q, backend, *more)


def try_backward(q: Any, k: Any, v: Any, g: Any, lse: Any, delta: Any, dims: tuple[int, ...], scale: float,
                 win: tuple[int, int, float], kind: str, suffix: str, stream: Any, backend: str | None) -> Any:
    """(dq, dk, dv) from the sm_90a backward kernels when they apply (`backward_usable`); at head_dim 256
    (dQ kernel only) (dq, None, None), the caller computing dK and dV; else None (nothing launched). q, k, v, g
    contiguous; lse and delta fp32 per (batch, query, head)."""
    from .. import arrays
    from ..backends import get_backend
    from ..errors import ArgumentError
    from ..launcher import launch
    from ..tensormap import make_tensor_map

    b, n_q, n_k, h, kvh, d = dims
    wl, wr, softcap = win
    if d not in BWD_DQ_HEAD_DIMS or not usable(d, d, softcap, scale, q, backend, k, v, g):
        return None
    dq_only = d not in BWD_HEAD_DIMS
    name = get_backend(backend).name
    c = bwd_dkdv_step(d)
    q4, g4 = (a.reshape((b, n_q, h, d)) for a in (q, g))
    k4, v4 = (a.reshape((b, n_k, kvh, d)) for a in (k, v))

    def maps(q_rows: int, k_rows: int) -> list:  # q, dO, k, v; boxes of 64 head-dim columns (128B swizzle rows)
        return [make_tensor_map(a, (1, r, 1, 64), "128B", backend=name)
                for a, r in ((q4, q_rows), (g4, q_rows), (k4, k_rows), (v4, k_rows))]

    try:
        kv_maps = None if dq_only else maps(c, BWD_ROWS)
        q_maps = maps(BWD_ROWS, bwd_dq_step(d))
    except ArgumentError:  # e.g. a base that is not 16-byte aligned: the mma.sync kernels take it
        return None
    dq = arrays.empty(arrays.shape_of(q), kind, like=q)
    dk = dv = None
    cap = (float(softcap),) if softcap > 0.0 else ()  # the _softcap kernels' last parameter
    tail = (b, n_q, n_k, h, kvh, float(scale), wl, wr, *cap)
    if kv_maps is not None:
        dk = arrays.empty(arrays.shape_of(k), kind, like=q)
        dv = arrays.empty(arrays.shape_of(v), kind, like=q)
        tq, tdo, tk, tv = kv_maps
        launch(bwd_kernel_name("dkdv", d, softcap, suffix), b * kvh * -(-n_k // BWD_ROWS), THREADS, tq, tk, tv,
               tdo, lse, delta, dk, dv, *tail, shared_mem=bwd_shared_bytes(d, c), stream=stream, backend=backend)
    tq, tdo, tk, tv = q_maps
    launch(bwd_kernel_name("dq", d, softcap, suffix), b * h * -(-n_q // BWD_ROWS), THREADS, tq, tk, tv, tdo,
           lse, delta, dq, *tail, shared_mem=bwd_shared_bytes(d, bwd_dq_step(d)), stream=stream, backend=backend)
    return dq, dk, dv


def try_varlen_backward(q: Any, k: Any, v: Any, g: Any, lse: Any, delta: Any, dq: Any, dk: Any, dv: Any,
                        cu_q: Any, cu_k: Any, dims: tuple[int, int, int, int, int, int], scale: float, wl: int,
                        wr: int, softcap: float, suffix: str, stream: Any, backend: str | None) -> bool:
    """flash_attention_varlen_backward: run attention_bwd_varlen_sm90_{dkdv,dq}_d{D}[_softcap]{suffix}
    (`bwd_kernel_name`) into dq, dk, dv when `backward_usable` and the packed arrays suit TMA, else False (nothing
    launched). q, g (total_q, heads, D), k, v (total_k, kv_heads, D) contiguous; lse, delta fp32 (total_q, heads);
    cu_q / cu_k int32 (batch + 1,); dims (batch, max_q, max_k, heads, kv_heads, D), the longest sequence's lengths
    sizing the grid; (wl, wr) normalized per sequence (unbounded = 2^30), clamped by the kernels."""
    from .. import arrays
    from ..launcher import launch
    from ..tensormap import make_tensor_map

    batch, max_q, max_k, h, kvh, d = dims
    if not backward_usable(d, softcap, scale, q, backend, k, v, g):
        return False
    n_kv_blocks, n_q_blocks = batch * kvh * -(-max_k // BWD_ROWS), batch * h * -(-max_q // BWD_ROWS)
    if max(n_kv_blocks, n_q_blocks) >= 2**31:  # the kernels' 1-D grid
        return False
    name = get_backend(backend).name
    c = bwd_dkdv_step(d)
    total_q, total_k = arrays.shape_of(q)[0], arrays.shape_of(k)[0]
    q4, g4 = (a.reshape((1, total_q, h, d)) for a in (q, g))
    k4, v4 = (a.reshape((1, total_k, kvh, d)) for a in (k, v))

    def maps(q_rows: int, k_rows: int) -> list:  # the packed rows as one batch; boxes as the dense backward's
        return [make_tensor_map(a, (1, r, 1, 64), "128B", backend=name)
                for a, r in ((q4, q_rows), (g4, q_rows), (k4, k_rows), (v4, k_rows))]

    try:
        kv_maps, q_maps = maps(c, BWD_ROWS), maps(BWD_ROWS, BWD_STEP)
    except ArgumentError:  # no query or key at all, or a base off 16 bytes: the mma.sync kernels take it
        return False
    cap = (float(softcap),) if softcap > 0.0 else ()
    tail = (cu_q, cu_k, batch, max_q, max_k, h, kvh, float(scale), wl, wr, *cap)
    if n_kv_blocks:
        tq, tdo, tk, tv = kv_maps
        launch(bwd_kernel_name("dkdv", d, softcap, suffix, varlen=True), n_kv_blocks, THREADS, tq, tk, tv, tdo, lse,
               delta, dk, dv, *tail, shared_mem=bwd_shared_bytes(d, c), stream=stream, backend=backend)
    if n_q_blocks:
        tq, tdo, tk, tv = q_maps
        launch(bwd_kernel_name("dq", d, softcap, suffix, varlen=True), n_q_blocks, THREADS, tq, tk, tv, tdo, lse,
               delta, dq, *tail, shared_mem=bwd_shared_bytes(d, BWD_STEP), stream=stream, backend=backend)
    return True
