"""Training ops: transpose, softmax / RMSNorm / embedding backward, fused cross-entropy.

Kernels in kernels_cu/training.cu; attention backward is in `attention_backward.py`.
Every op validates shapes, dtypes and ranges before launching (ArgumentError /
ArgumentTypeError naming the argument), allocates outputs next to the inputs
and takes `backend=` ("nvrtc", "numba", "host" or None). Leading batch dims are
flattened into rows.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from .. import arrays
from ..arrays import UINT_MAX as _UINT_MAX, check_u32 as _check_u32, kernel_suffix as _suffix, same_kind as _same_kind, size as _size
from ..errors import ArgumentError, ArgumentTypeError
from ._common import (
    GRID_X_MAX, GRID_YZ_MAX, H100_SMS, ROW_THREADS_MAX, cached_row_threads, flat, ids_like, int_array, launch,
    norm_offset, row_threads,
    same_shape, sum_chunks, weight_chunks,
)

__all__ = [
    "transpose_2d",
    "softmax_backward",
    "rms_norm_backward",
    "embedding_backward",
    "cross_entropy_fwd_bwd",
]

_INT_MAX = 2**31 - 1


# --------------------------------------------------------------------------- transpose


@arrays.stream_scoped
def transpose_2d(x: Any, *, stream: Any = None, backend: str | None = None) -> Any:
    """Contiguous `x.T` of a 2-D array (f32, bf16 or f16, bit-exact).

    With leading batch dims (..., rows, cols) each trailing matrix is transposed:
    the result is (..., cols, rows), i.e. `np.swapaxes(x, -1, -2)`.
    """
    kind = arrays.io_kind("x", x, arrays.IO_KINDS)
    shape = tuple(arrays.shape_of(x))
    if len(shape) < 2:
        raise ArgumentError(f"x: expected at least 2 dimensions, got shape {shape}")
    x = arrays.contiguous(x)
    rows, cols = shape[-2], shape[-1]
    batch = _size(shape[:-2])
    # tile origins + 63 must not wrap the kernel's 32-bit row/column indices
    for name, n in (("x.shape[-2] (rows)", rows), ("x.shape[-1] (cols)", cols)):
        if n > _UINT_MAX - 64:
            raise ArgumentError(f"{name}: expected at most {_UINT_MAX - 64}, got {n}")
    _check_u32("x batch size", batch)
    out = arrays.empty(shape[:-2] + (cols, rows), kind, like=x)
    if rows * cols * batch == 0:
        return out
    # 64 x 64 tiles (the kernel moves them in 16-byte vectors when rows, cols and bases allow)
    col_tiles = -(-cols // 64)
    if col_tiles > GRID_X_MAX:
        raise ArgumentError(f"x.shape[-1]: expected at most {GRID_X_MAX * 64}, got {cols}")
    grid = (col_tiles, min(-(-rows // 64), GRID_YZ_MAX), min(batch, GRID_YZ_MAX))
    launch("transpose_2d" + _suffix(kind), grid, (32, 8), flat(x), flat(out), rows, cols, batch,
            stream=arrays.launch_stream(stream, x), backend=backend)
    return out


# --------------------------------------------------------------------------- softmax backward

# kernels_cu/training.cu's SMB_CACHE_VECS: 16-byte chunks of its row a softmax_backward thread keeps in registers.
_SMB_CACHE_VECS = 2


def _softmax_backward_threads(row_len: int, kind: str) -> int:
    """Threads of softmax_backward's block: 2 chunks a thread of a row it keeps in registers (its 4 loads of p and
    g in flight at once), else row_threads."""
    return cached_row_threads(row_len, kind, _SMB_CACHE_VECS)



@arrays.stream_scoped
def softmax_backward(probs: Any, grad_out: Any, *, stream: Any = None, backend: str | None = None) -> Any:
    """grad_in = probs * (grad_out - rowsum(probs * grad_out)) over the last axis (f32, bf16 or f16)."""
    kind = arrays.io_kind("probs", probs, arrays.IO_KINDS)
    _same_kind("grad_out", grad_out, kind, "probs")
    shape = tuple(arrays.shape_of(probs))
    if len(shape) < 1:
        raise ArgumentError(f"probs: expected at least 1 dimension, got shape {shape}")
    same_shape("grad_out", grad_out, shape, "probs")
    row_len = shape[-1]
    _check_u32("probs.shape[-1]", row_len)
    n_rows = _size(shape[:-1])
    probs, grad_out = arrays.contiguous(probs), arrays.contiguous(grad_out)
    out = arrays.empty(shape, kind, like=probs)
    if n_rows * row_len == 0:
        return out
    launch(
        "softmax_backward" + _suffix(kind), (min(n_rows, GRID_X_MAX),), (_softmax_backward_threads(row_len, kind),),
        flat(probs), flat(grad_out), flat(out), n_rows, row_len, stream=arrays.launch_stream(stream, probs),
        backend=backend,
    )
    return out


# --------------------------------------------------------------------------- RMSNorm backward


# Fused rms_norm_backward: blocks of the row kernel (each a grad_weight partial row). At most one wave of a
# 132-SM H100 / H200 (512 threads' worth of blocks an SM: the kernel's __launch_bounds__(512, 1) caps registers
# at 128, so they always fit) and at most _RMS_BWD_PARTS, so the partials (n_part x dim fp32, written and read
# back) stay a few % of the 3N bytes: 264 blocks of 256 threads at dim 4096 (8.7 MB beside 201 MB in bf16).
_RMS_BWD_PARTS = 512
_RMS_BWD_ACC = 16  # columns a thread can hold (RMSB_ACC in training.cu)
_RMS_BWD_WAVE_THREADS = 512 * H100_SMS


def rms_backward_geometry(n_rows: int, dim: int) -> tuple[int, int]:
    """(blocks, threads) of the fused rms_norm_backward, blocks 0 where the row is too long for the registers
    (_RMS_BWD_ACC columns a thread of at most 512: the weight kernel runs then). Threads: enough for
    _RMS_BWD_ACC columns each (2 16-byte chunks of bf16 / f16, 4 of f32), at least a warp."""
    threads = max(32, -(-dim // (_RMS_BWD_ACC * 32)) * 32)
    if threads > ROW_THREADS_MAX:
        return 0, row_threads(dim)
    return min(n_rows, _RMS_BWD_PARTS, _RMS_BWD_WAVE_THREADS // threads), threads


def rms_backward_partials(n_rows: int, dim: int) -> int:
    """Blocks of the fused rms_norm_backward (0: row too long for the registers, use the weight kernel)."""
    return rms_backward_geometry(n_rows, dim)[0]


# sm_90a rows wider than one CTA holds (rms_backward_geometry's 0: more than _RMS_BWD_ACC columns a thread of 512):
# rms_norm_backward_cluster (kernels_cu/norm_sm90.cu) splits each row over a thread-block cluster of 2..8 CTAs of at
# most _RMS_CLUSTER_COLS columns each, the row sums combined through distributed shared memory, so x and grad_y are
# read once up to 8 x 8192 columns (hidden 16k-64k) where the one-CTA kernels read them twice.
_RMS_CLUSTER_COLS = _RMS_BWD_ACC * ROW_THREADS_MAX
_RMS_CLUSTER_MAX = 8


def rms_backward_cluster_plan(n_rows: int, dim: int) -> tuple[int, int, int, int] | None:
    """(clusters, CTAs a cluster, columns a CTA, threads a CTA) of rms_norm_backward_cluster, or None where a row
    fits one CTA (the fused rms_norm_backward) or not even 8. The slice is a whole number of 16-byte chunks; the
    clusters are one wave of 512-thread CTAs of an H100 / H200 (each a partial row of the weight gradient)."""
    if dim <= _RMS_CLUSTER_COLS:
        return None
    nc = 2
    while nc < _RMS_CLUSTER_MAX and dim > nc * _RMS_CLUSTER_COLS:
        nc *= 2
    slice_ = -(-(-(-dim // nc)) // 16) * 16
    if slice_ > _RMS_CLUSTER_COLS:
        return None
    threads = max(32, -(-slice_ // (_RMS_BWD_ACC * 32)) * 32)
    clusters = min(n_rows, _RMS_BWD_PARTS, max(1, _RMS_BWD_WAVE_THREADS // (threads * nc)))
    return clusters, nc, slice_, threads


@arrays.stream_scoped
def rms_norm_backward(
    x: Any, weight: Any, grad_out: Any, eps: float = 1e-6, *, offset: float = 0.0, stream: Any = None,
    backend: str | None = None,
) -> tuple[Any, Any]:
    """Backward of y = x * rsqrt(mean(x^2, -1) + eps) * (offset + weight) (offset 1: Gemma).

    x, grad_out (..., dim) and weight (dim,) share one dtype (f32, bf16 or f16).
    Returns (grad_x like x, grad_weight float32 (dim,)); grad_weight is reduced
    in fp32 in a fixed order (no atomics), so it is identical run to run.
    x and grad_out are read once for rows of up to 8192 columns, and on sm_90a up
    to 65536 (rms_norm_backward_cluster: a thread-block cluster splits the row).
    """
    kind = arrays.io_kind("x", x, arrays.IO_KINDS)
    _same_kind("weight", weight, kind, "x")
    _same_kind("grad_out", grad_out, kind, "x")
    shape = tuple(arrays.shape_of(x))
    if len(shape) < 1:
        raise ArgumentError(f"x: expected at least 1 dimension, got shape {shape}")
    dim = shape[-1]
    same_shape("weight", weight, (dim,), "x's last axis")
    same_shape("grad_out", grad_out, shape, "x")
    if not (isinstance(eps, (int, float, np.floating)) and float(eps) >= 0.0):
        raise ArgumentError(f"eps: expected a number >= 0, got {eps!r}")
    offset = norm_offset(offset)
    if dim < 1:
        raise ArgumentError(f"x.shape[-1]: expected at least 1, got {dim}")
    if dim > _UINT_MAX - 32:  # the grad_weight kernel's column tiles must not wrap 32 bits
        raise ArgumentError(f"x.shape[-1]: expected at most {_UINT_MAX - 32}, got {dim}")
    n_rows = _size(shape[:-1])
    x, weight, grad_out = arrays.contiguous(x), arrays.contiguous(weight), arrays.contiguous(grad_out)
    grad_x = arrays.empty(shape, kind, like=x)
    if n_rows == 0:
        return grad_x, arrays.zeros((dim,), np.float32, like=x)
    stream = arrays.launch_stream(stream, x)
    grad_w = arrays.empty((dim,), np.float32, like=x)
    inv_rms = arrays.empty((n_rows,), np.float32, like=x)
    sfx = _suffix(kind)
    plan = rms_backward_cluster_plan(n_rows, dim) if _cluster_usable(backend, x) else None
    if plan is not None:
        # sm_90: a cluster of nc CTAs splits each row, x and grad_y read once (norm_sm90.cu); one partial row of
        # the weight gradient a cluster, added in order by norm_grad_reduce
        clusters, nc, slice_, threads = plan
        partial = grad_w if clusters == 1 else arrays.empty((clusters * dim,), np.float32, like=x)
        launch(
            "rms_norm_backward_cluster" + sfx, (clusters * nc,), (threads,),
            flat(x), weight, flat(grad_out), flat(grad_x), inv_rms, partial, n_rows, dim, slice_, float(eps), offset,
            stream=stream, backend=backend, cluster=(nc, 1, 1),
        )
        if clusters > 1:
            sum_chunks(partial, grad_w, clusters, dim, stream=stream, backend=backend)
        return grad_x, grad_w
    n_part, threads = rms_backward_geometry(n_rows, dim)
    if n_part:
        # fused: the row kernel's n_part blocks each sum their rows' x * r * g per column in registers;
        # the reduce kernel adds the n_part partial rows in order (deterministic, 3N bytes)
        partial = grad_w if n_part == 1 else arrays.empty((n_part * dim,), np.float32, like=x)
        launch(
            "rms_norm_backward" + sfx, (n_part,), (threads,),
            flat(x), weight, flat(grad_out), flat(grad_x), inv_rms, partial, n_rows, dim, float(eps), n_part, offset,
            stream=stream, backend=backend,
        )
        if n_part > 1:
            sum_chunks(partial, grad_w, n_part, dim, stream=stream, backend=backend)
        return grad_x, grad_w
    launch(
        "rms_norm_backward" + sfx, (min(n_rows, GRID_X_MAX),), (threads,),
        flat(x), weight, flat(grad_out), flat(grad_x), inv_rms, grad_w, n_rows, dim, float(eps), 0, offset,
        stream=stream, backend=backend,
    )
    n_chunks, rows_per_chunk = weight_chunks(n_rows, dim)
    partial = grad_w if n_chunks == 1 else arrays.empty((n_chunks * dim,), np.float32, like=x)
    launch(
        "rms_norm_backward_weight" + sfx, (-(-dim // 32), n_chunks), (32, 8),
        flat(x), flat(grad_out), inv_rms, partial, n_rows, dim, rows_per_chunk,
        stream=stream, backend=backend,
    )
    if n_chunks > 1:
        sum_chunks(partial, grad_w, n_chunks, dim, stream=stream, backend=backend)
    return grad_x, grad_w


# --------------------------------------------------------------------------- embedding backward


@arrays.stream_scoped
def embedding_backward(
    grad_out: Any, ids: Any, vocab_size: int, *, stream: Any = None, backend: str | None = None
) -> Any:
    """grad_weight (vocab_size, dim) float32: row v = sum of grad_out rows whose id is v.

    grad_out (..., dim) f32, bf16 or f16, ids (...) integers of any integer dtype in
    [0, vocab_size). Host ids (NumPy, CPU tensors) are checked before launch;
    device ids never travel to the host: an id outside the range is skipped on
    the device. A bucketing kernel sorts token positions by id (stable, on the
    device) and the gather kernel sums each vocab row's tokens in position order,
    so the result is deterministic (no atomics) and unused rows are written as 0.
    """
    kind = arrays.io_kind("grad_out", grad_out, arrays.IO_KINDS)
    shape = tuple(arrays.shape_of(grad_out))
    if len(shape) < 1:
        raise ArgumentError(f"grad_out: expected at least 1 dimension, got shape {shape}")
    if not isinstance(vocab_size, (int, np.integer)) or isinstance(vocab_size, bool) or not 1 <= vocab_size <= _INT_MAX:
        raise ArgumentError(f"vocab_size: expected an integer in [1, {_INT_MAX}], got {vocab_size!r}")
    vocab_size = int(vocab_size)
    dim = shape[-1]
    _check_u32("grad_out.shape[-1]", dim)
    ids = int_array("ids", ids)
    id_shape = tuple(arrays.shape_of(ids))
    if id_shape != shape[:-1]:
        raise ArgumentError(f"ids: expected shape {shape[:-1]} (grad_out without its last axis), got {id_shape}")
    n_tok = _size(id_shape)
    if n_tok > _INT_MAX:
        raise ArgumentError(f"ids: expected at most {_INT_MAX} tokens, got {n_tok}")
    if n_tok and arrays.is_host(ids):
        flat_ids = arrays.host_view(ids).reshape(-1)
        bad = np.flatnonzero((flat_ids < 0) | (flat_ids >= vocab_size))
        if bad.size:
            k = int(bad[0])
            raise ArgumentError(
                f"ids: expected values in [0, vocab_size={vocab_size}), got {int(flat_ids[k])} at flat index {k}"
            )
    grad_out = arrays.contiguous(grad_out)
    out = arrays.empty((vocab_size, dim), np.float32, like=grad_out)
    if dim == 0:
        return out
    stream = arrays.launch_stream(stream, grad_out)
    ids = ids_like(ids, grad_out)
    order = arrays.empty((max(1, n_tok),), "int32", like=grad_out)  # 1: a valid pointer when there is no token
    offsets = arrays.empty((vocab_size + 1,), "int32", like=grad_out)
    launch(
        "embedding_backward_bucket", (-(-vocab_size // EMB_ROWS_PER_BLOCK),), (EMB_TILE,),
        flat(ids), order, offsets, n_tok, vocab_size, stream=stream, backend=backend,
    )
    launch(
        "embedding_backward" + _suffix(kind), (min(vocab_size, GRID_X_MAX),), (row_threads(dim),),
        flat(grad_out), order, offsets, flat(out), vocab_size, dim, stream=stream, backend=backend,
    )
    return out


# PK_EMB_ROWS / PK_EMB_TILE in training.cu: vocab rows a bucketing block owns, its threads.
EMB_ROWS_PER_BLOCK = 2048
EMB_TILE = 256

# --------------------------------------------------------------------------- cross-entropy


_CE_REDUCTIONS = ("mean", "sum", "none")
# Rows one cross_entropy_loss_reduce block sums; more rows than this take two launches
# (per-block partial sums, then one block over the partials): a parallel, fixed-order mean.
CE_REDUCE_ROWS = 8192


def _finite_float(name: str, v: Any, lo: float, hi: float | None = None, lo_open: bool = False) -> float:
    ok = isinstance(v, (int, float, np.floating, np.integer)) and not isinstance(v, bool)
    f = float(v) if ok else math.nan
    if not (math.isfinite(f) and (f > lo if lo_open else f >= lo) and (hi is None or f <= hi)):
        rng = f"({lo}" if lo_open else f"[{lo}"
        rng += f", {hi}]" if hi is not None else ", inf)"
        raise ArgumentError(f"{name}: expected a finite number in {rng}, got {v!r}")
    return f


def ce_z_loss(z_loss: Any, lse_square_scale: Any) -> Any:
    """z_loss, or Liger's name for it (lse_square_scale); both given and different is an error."""
    if lse_square_scale is None:
        return z_loss
    _finite_float("lse_square_scale", lse_square_scale, 0.0)
    if z_loss not in (0, 0.0) and z_loss != lse_square_scale:
        raise ArgumentError(f"lse_square_scale: {lse_square_scale!r} contradicts z_loss={z_loss!r} (the same "
                            "option under Liger-Kernel's name); give one of them")
    return lse_square_scale


def check_ce_options(label_smoothing: Any, z_loss: Any, softcap: Any, reduction: Any) -> tuple[float, float, float]:
    """Validated (label_smoothing, z_loss, softcap) of the cross-entropy ops; softcap None is 0.0 (off)."""
    if reduction not in _CE_REDUCTIONS:
        raise ArgumentError(f"reduction: expected one of {_CE_REDUCTIONS}, got {reduction!r}")
    eps = _finite_float("label_smoothing", label_smoothing, 0.0, 1.0)
    zl = _finite_float("z_loss", z_loss, 0.0)
    cap = 0.0 if softcap is None else _finite_float("softcap", softcap, 0.0, lo_open=True)
    return eps, zl, cap


def ce_reduce(row_loss: Any, scale: Any, n_rows: int, out: Any, *, stream: Any, backend: str | None) -> None:
    """out[()] = sum(row_loss) (the rows carry the mean's scales already), deterministic: one block for few rows, else
    partial sums over CE_REDUCE_ROWS-row slices in parallel and one block over them."""
    threads = 512 if n_rows >= 512 else max(32, -(-n_rows // 32) * 32)
    if n_rows <= CE_REDUCE_ROWS:
        launch("cross_entropy_loss_reduce", (1,), (threads,), row_loss, out, scale, n_rows, n_rows, 0,
                stream=stream, backend=backend)
        return
    blocks = -(-n_rows // CE_REDUCE_ROWS)
    partial = arrays.empty((blocks,), np.float32, like=row_loss)
    launch("cross_entropy_loss_reduce", (blocks,), (threads,), row_loss, partial, scale, n_rows,
            CE_REDUCE_ROWS, 0, stream=stream, backend=backend)
    t2 = 512 if blocks >= 512 else max(32, -(-blocks // 32) * 32)
    launch("cross_entropy_loss_reduce", (1,), (t2,), partial, out, scale, blocks, blocks, 0,
            stream=stream, backend=backend)


def _f32_like(name: str, a: Any, like: Any) -> Any:
    """A floating array as contiguous float32 (flat) next to `like` (host data is copied host-to-device)."""
    if isinstance(a, (list, tuple)):
        a = np.asarray(a, np.float64)
    dt = arrays.dtype_name(a, name)
    if dt not in ("float16", "bfloat16", "float32", "float64"):
        raise ArgumentTypeError(f"{name}: expected a floating array, got {dt}")
    f = arrays.contiguous(arrays.astype(a, "float32"))
    f = f.reshape(-1)
    if arrays.is_host(f) and not arrays.is_host(like):
        return arrays.to_like(np.ascontiguousarray(arrays.host_view(f)), like)
    return f


def ce_class_weight(weight: Any, vocab: int, like: Any, name: str = "weight") -> Any:
    """The validated class weights (vocab,) of the cross-entropy ops as float32 beside `like`, or None."""
    if weight is None:
        return None
    shape = tuple(arrays.shape_of(weight, name))
    if shape != (vocab,):
        raise ArgumentError(f"{name}: expected class weights of shape ({vocab},) (vocab,), got {shape}")
    return _f32_like(name, weight, like)


def ce_row_grads(grad_output: Any, shape: tuple[int, ...], like: Any) -> Any:
    """The per-row upstream gradients of reduction "none" as float32 (n_rows,) beside `like`."""
    got = tuple(arrays.shape_of(grad_output))
    if got != tuple(shape):
        raise ArgumentError(f"grad_output: expected the per-row loss shape {tuple(shape)}, got {got}")
    return _f32_like("grad_output", grad_output, like)


def ce_scales(targets_flat: Any, weight: Any, n_rows: int, vocab: int, pad_id: int, mean: bool, like: Any, *,
              stream: Any, backend: str | None) -> Any:
    """The (2,) float32 device scales of cross_entropy_fwd_bwd's kernel: (1 / sum of the live targets'
    class weights (their count without weights), 1 / live count) for "mean", else (1, 1)."""
    scale = arrays.empty((2,), np.float32, like=like)
    threads = max(32, min(ROW_THREADS_MAX, -(-n_rows // 32) * 32))
    # an unused pointer gets its own 1-float buffer: the numba backend copies arguments in and out by
    # their constness, so an alias of an output would be written back stale
    unused = arrays.zeros((1,), np.float32, like=like) if weight is None else weight
    launch("cross_entropy_count", (1,), (threads,), targets_flat, unused, scale,
            n_rows, vocab, pad_id, int(mean), int(weight is not None), stream=stream, backend=backend)
    return scale


# The sm_90 cluster kernel (cross_entropy_fwd_bwd_cluster): each CTA of a row's cluster keeps about this much of
# the row in shared memory (QuACK's sizing: a 128k bf16 vocabulary is 8 CTAs of 32 KiB), 2..8 CTAs a cluster;
# a row whose slice would pass CE_CLUSTER_SMEM_MAX even at 8 CTAs takes the two-sweep kernel.
CE_CLUSTER_SLICE_BYTES = 32 << 10
CE_CLUSTER_MAX = 8
CE_CLUSTER_SMEM_MAX = 200 << 10


def cross_entropy_cluster_plan(vocab: int, itemsize: int) -> tuple[int, int, int] | None:
    """(CTAs a cluster, columns a CTA, threads a CTA) of cross_entropy_fwd_bwd_cluster for rows of `vocab` elements
    of `itemsize` bytes, or None when a row does not fit 8 CTAs' shared memory. The slice is a whole number of
    16-byte chunks."""
    row = vocab * itemsize
    nc = 2
    while nc < CE_CLUSTER_MAX and row > nc * CE_CLUSTER_SLICE_BYTES:
        nc *= 2
    per16 = 16 // itemsize
    slice_ = -(-(-(-vocab // nc)) // per16) * per16
    if slice_ * itemsize > CE_CLUSTER_SMEM_MAX:
        return None
    chunks = -(-slice_ // per16)
    return nc, slice_, min(ROW_THREADS_MAX, max(32, -(-chunks // 32) * 32))


def _cluster_usable(backend: str | None, like: Any) -> bool:
    """Whether the cluster kernel can run: sm_90 clusters on the nvrtc backend, or the host backend playing
    Hopper (PYKERN_HOST_ARCH=sm_90a); the numba references have no clusters."""
    from ..backends import get_backend, kernel_variant
    from ..devices import array_device

    be = get_backend(backend)
    if be.name not in ("host", "nvrtc"):
        return False
    dev = array_device(like)
    return kernel_variant("sm_90a", be.name, dev if isinstance(dev, int) and dev >= 0 else 0)


@arrays.stream_scoped
def cross_entropy_fwd_bwd(
    logits: Any, targets: Any, pad_id: int = -100, *, label_smoothing: float = 0.0, z_loss: float = 0.0,
    softcap: float | None = None, reduction: str = "mean", inplace: bool = False, weight: Any = None,
    grad_output: Any = None, return_z_loss: bool = False, lse_square_scale: float | None = None,
    ignore_index: int | None = None, _scale: Any = None, stream: Any = None, backend: str | None = None,
) -> tuple[Any, ...]:
    """Cross-entropy loss over non-pad rows and its gradient, in one launch over the logits.

    logits (..., vocab) f32, bf16 or f16 (softmax and loss in fp32), targets (...)
    integers of any integer dtype; rows whose target equals `pad_id` are ignored
    (loss 0, gradient 0). Options, as torch.nn.functional.cross_entropy:
    `label_smoothing` in [0, 1]; `z_loss` adds z_loss * lse**2 per non-ignored row;
    `softcap` (> 0) replaces the logits by softcap * tanh(logits / softcap) first
    (the gradient flows through the tanh); `reduction` "mean" (over non-ignored
    rows), "sum" or "none" (float32 per-row losses of targets' shape, 0 on ignored
    rows). The gradient is that of the chosen reduction ("none": of the sum).
    `inplace=True` writes the gradient over `logits` (which must then be a
    contiguous, writeable array) and returns it.

    Liger-Kernel / torch options: `weight` (vocab,) class weights, as
    F.cross_entropy(weight=): a row's loss is w[t] * (1 - eps) * nll + eps / V *
    sum_c w[c] * (-log p_c), and "mean" divides by the sum of w[t] over non-ignored
    rows (torch's weighted mean). The z-loss is never weighted and "mean" divides it
    by the count of non-ignored rows (Liger's definition). `lse_square_scale` is
    Liger's name for z_loss (give one of them) and `ignore_index` torch's for pad_id.
    `return_z_loss=True` returns (loss, grad, z_loss): the z-loss part of `loss`
    (same reduction), for logging. `grad_output` (reduction "none" only): the
    per-row upstream gradients dL/dloss_r, of the per-row losses' shape; the
    gradient returned is then d(sum_r grad_output[r] * loss_r)/dlogits, each row
    scaled in the kernel (what autograd's backward of "none" needs; without it the
    gradient of "none" is that of the plain sum).

    Any target other than pad_id must lie in [0, vocab): host targets (NumPy, CPU
    tensors) are checked before launch; device targets are checked in the kernel,
    which gives a bad row a NaN loss and gradient instead of reading out of bounds,
    and never copies them to the host. The count of non-pad rows is taken on the
    device too. Returns (loss float32, grad like logits). A batch that is all
    padding gives loss 0.0 and a zero gradient.
    """
    kind = arrays.io_kind("logits", logits, arrays.IO_KINDS)
    shape = tuple(arrays.shape_of(logits))
    if len(shape) < 1:
        raise ArgumentError(f"logits: expected at least 1 dimension, got shape {shape}")
    vocab = shape[-1]
    if vocab < 1:
        raise ArgumentError(f"logits.shape[-1] (vocab): expected at least 1, got {vocab}")
    _check_u32("logits.shape[-1] (vocab)", vocab)
    if not isinstance(pad_id, (int, np.integer)) or isinstance(pad_id, bool) or not -(2**31) <= pad_id <= _INT_MAX:
        raise ArgumentError(f"pad_id: expected an int32 value, got {pad_id!r}")
    pad_id = int(pad_id)
    if ignore_index is not None:
        if pad_id != -100 and pad_id != ignore_index:
            raise ArgumentError(f"ignore_index: {ignore_index!r} contradicts pad_id={pad_id}; give one of them")
        if not isinstance(ignore_index, (int, np.integer)) or isinstance(ignore_index, bool) \
                or not -(2**31) <= ignore_index <= _INT_MAX:
            raise ArgumentError(f"ignore_index: expected an int32 value, got {ignore_index!r}")
        pad_id = int(ignore_index)
    z_loss = ce_z_loss(z_loss, lse_square_scale)
    eps, zl, cap = check_ce_options(label_smoothing, z_loss, softcap, reduction)
    if grad_output is not None and reduction != "none":
        raise ArgumentError(f"grad_output: per-row upstream gradients go with reduction='none', got {reduction!r} "
                            "(scale the gradient of a scalar loss instead)")
    if not isinstance(return_z_loss, bool):
        raise ArgumentError(f"return_z_loss: expected a bool, got {return_z_loss!r}")
    if not isinstance(inplace, bool):
        raise ArgumentError(f"inplace: expected a bool, got {inplace!r}")
    targets = int_array("targets", targets)
    t_shape = tuple(arrays.shape_of(targets))
    if t_shape != shape[:-1]:
        raise ArgumentError(f"targets: expected shape {shape[:-1]} (logits without its last axis), got {t_shape}")
    n_rows = _size(t_shape)
    if n_rows and arrays.is_host(targets):
        flat_t = arrays.host_view(targets).reshape(-1).astype(np.int64, copy=False)
        live = flat_t != pad_id
        bad = np.flatnonzero(live & ((flat_t < 0) | (flat_t >= vocab)))
        if bad.size:
            k = int(bad[0])
            raise ArgumentError(
                f"targets: expected values in [0, {vocab}) (the vocab of logits) or pad_id / ignore_index={pad_id}, "
                f"got {int(flat_t[k])} at flat index {k}"
            )
    if inplace:
        logits = arrays.in_place("logits", logits, "the gradient")
        grad = logits
    else:
        logits = arrays.contiguous(logits)
        grad = arrays.empty(shape, kind, like=logits)
    loss_shape = t_shape if reduction == "none" else ()
    cw = ce_class_weight(weight, vocab, logits)
    gro = None if grad_output is None else ce_row_grads(grad_output, t_shape, logits)
    if n_rows == 0:
        zero = arrays.zeros(loss_shape, np.float32, like=logits)
        return (zero, grad, arrays.zeros(loss_shape, np.float32, like=logits)) if return_z_loss else (zero, grad)
    stream = arrays.launch_stream(stream, logits)
    targets = ids_like(targets, logits)
    row_loss = arrays.empty((n_rows,), np.float32, like=logits)
    # pointers an option leaves unused get one float each (never an alias of an output: see ce_scales)
    unused = arrays.zeros((1,), np.float32, like=logits) if cw is None or gro is None or not return_z_loss else None
    z_row = arrays.empty((n_rows,), np.float32, like=logits) if return_z_loss else arrays.zeros((1,), np.float32,
                                                                                             like=logits)
    # _scale: the (2,) scales of a caller that reduces over more rows than these (the fused linear
    # cross-entropy's chunks); else they come from these targets
    scale = _scale if _scale is not None else ce_scales(flat(targets), cw, n_rows, vocab, pad_id,
                                                        reduction == "mean", logits, stream=stream, backend=backend)
    opts = (1 if cw is not None else 0) | (2 if gro is not None else 0) | (4 if return_z_loss else 0)
    plan = cross_entropy_cluster_plan(vocab, 4 if kind == "f32" else 2) if _cluster_usable(backend, logits) else None
    if plan is not None:
        # sm_90: a cluster of nc CTAs holds each row in shared memory, the logits read once (training.cu)
        nc, slice_, threads = plan
        clusters = min(n_rows, GRID_X_MAX // nc)
        launch(
            "cross_entropy_fwd_bwd_cluster" + _suffix(kind), (clusters * nc,), (threads,),
            flat(logits), flat(targets), flat(grad), row_loss, z_row, scale, unused if cw is None else cw,
            unused if gro is None else gro, n_rows, vocab, slice_, pad_id, eps, zl, cap, opts,
            shared_mem=slice_ * (4 if kind == "f32" else 2), stream=stream, backend=backend, cluster=(nc, 1, 1),
        )
    else:
        launch(
            "cross_entropy_fwd_bwd" + _suffix(kind), (min(n_rows, GRID_X_MAX),), (row_threads(vocab),),
            flat(logits), flat(targets), flat(grad), row_loss, z_row, scale, unused if cw is None else cw,
            unused if gro is None else gro, n_rows, vocab, pad_id, eps, zl, cap, opts,
            stream=stream, backend=backend,
        )
    if reduction == "none":
        if return_z_loss:
            return row_loss.reshape(t_shape), grad, z_row.reshape(t_shape)
        return row_loss.reshape(t_shape), grad
    # the kernel has applied the mean's scales to each row: the reduction is a plain sum
    loss = arrays.empty((), np.float32, like=logits)
    ce_reduce(row_loss, scale, n_rows, flat(loss), stream=stream, backend=backend)
    if return_z_loss:
        zsum = arrays.empty((), np.float32, like=logits)
        ce_reduce(z_row, scale, n_rows, flat(zsum), stream=stream, backend=backend)
        return loss, grad, zsum
    return loss, grad
