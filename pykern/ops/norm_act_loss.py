"""The norm / activation / loss family beside training.py's basic training ops: fused residual-add RMSNorm,
LayerNorm, GELU / GeGLU, forward and backward, and the fused linear cross-entropy.

Kernels in kernels_cu/norm_act_loss.cu (the cross-entropy kernel is training.cu's).
Every op validates its arguments before launching (ArgumentError /
ArgumentTypeError naming the argument), takes NumPy arrays, torch tensors (CPU
or CUDA) or CuPy arrays, allocates outputs next to the inputs, and takes
`stream=` and `backend=` like the other ops. Leading batch dims are rows.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from .. import arrays
from ..arrays import check_u32 as _check_u32, kernel_suffix as _suffix, same_kind as _same_kind, size as _size
from ..errors import ArgumentError, ArgumentTypeError
from ._common import (
    GRID_X_MAX, H100_SMS, ROW_THREADS_MAX, cached_row_threads, flat, ids_like, int_array, launch, norm_offset, row_geometry, row_threads,
    same_shape, sum_chunks, weight_chunks,
)

__all__ = [
    "add_rms_norm",
    "add_rms_norm_backward",
    "layer_norm",
    "layer_norm_backward",
    "gelu",
    "gelu_backward",
    "gelu_gate",
    "gelu_gate_backward",
    "fused_linear_cross_entropy",
]

_UINT_MAX = 2**32 - 1
_EW_THREADS = 256
_EW_BLOCKS_MAX = 65535 * 8  # elementwise kernels are grid-stride: a cap only bounds the launch


def _eps(v: Any, name: str = "eps") -> float:
    ok = isinstance(v, (int, float, np.floating, np.integer)) and not isinstance(v, bool)
    f = float(v) if ok else math.nan
    if not (math.isfinite(f) and f >= 0.0):
        raise ArgumentError(f"{name}: expected a finite number >= 0, got {v!r}")
    return f


def _rows(name: str, x: Any) -> tuple[tuple[int, ...], int, int]:
    shape = tuple(arrays.shape_of(x))
    if len(shape) < 1:
        raise ArgumentError(f"{name}: expected at least 1 dimension, got shape {shape}")
    dim = shape[-1]
    if dim < 1:
        raise ArgumentError(f"{name}.shape[-1]: expected at least 1, got {dim}")
    if dim > _UINT_MAX - 32:  # column tiles of the weight-gradient kernel must not wrap 32 bits
        raise ArgumentError(f"{name}.shape[-1]: expected at most {_UINT_MAX - 32}, got {dim}")
    return shape, dim, _size(shape[:-1])


def _row_grid(n_rows: int, dim: int) -> tuple[tuple[int], tuple[int]]:
    return (min(n_rows, GRID_X_MAX),), (row_threads(dim),)


# kernels_cu/norm_act_loss.cu's ARN_CACHE_VECS: 16-byte chunks of its row an add_rms_norm thread keeps in registers.
_ARN_CACHE_VECS = 2


# kernels_cu/norm_act_loss.cu's LN_CACHE_VECS: 16-byte vectors a thread keeps of a layer_norm row.
_LN_CACHE_VECS = 4


def _ln_geometry(n_rows: int, dim: int, kind: str) -> tuple[tuple[int], tuple[int, int]]:
    """rms_norm's geometry for the layer_norm kernels: a warp per row (8 rows a block) for rows of at most
    64 16-byte chunks, else a block per row with enough threads (<= 512, the kernels' launch bound) that the
    row fits the kernel's register cache (<= _LN_CACHE_VECS chunks a thread: one read of x); rows too long
    for it get 512 threads."""
    chunks = -(-dim // (4 if kind == "f32" else 8))
    grid, block = row_geometry(n_rows, chunks)
    if block[0] > 32:
        need = -(-chunks // (_LN_CACHE_VECS * 32)) * 32
        block = (ROW_THREADS_MAX if need > ROW_THREADS_MAX else max(block[0], need), 1)
    return (grid,), block


# kernels_cu/norm_act_loss.cu's LNB_FUSE_VECS: 16-byte chunks a thread of the fused layer_norm_backward keeps.
_LNB_FUSE_VECS = 2
# Blocks (= fp32 partial rows of the weight / bias gradient) of the fused layer_norm_backward: one wave on a
# 132-SM H100 / H200, 512 / threads blocks an SM (the kernel's __launch_bounds__(512, 1) caps registers at 128,
# so 512 threads' worth of blocks always fit an SM's 64K registers). At 8192 x 4096 bf16 (256 threads, 264
# blocks) the partials add 264 x 4096 x 4 bytes written and read back (8.7 MB a gradient) to the 201 MB of x, g
# and grad_x, where norm_weight_grad read x and g a second time (134 MB).
_LNB_WAVE_THREADS = 512 * H100_SMS


def _lnb_fused_geometry(n_rows: int, dim: int, kind: str) -> tuple[tuple[int], tuple[int, int]] | None:
    """(grid, block) of the fused layer_norm_backward, or None where the unfused kernels run: rows of at most
    64 16-byte chunks (a warp per row there), not whole chunks, or too long for _LNB_FUSE_VECS chunks a thread
    of 512."""
    per = 4 if kind == "f32" else 8
    chunks = dim // per
    if chunks <= 64 or dim % per:
        return None
    threads = max(128, -(-chunks // (_LNB_FUSE_VECS * 32)) * 32)
    if threads > ROW_THREADS_MAX:
        return None
    return (min(n_rows, _LNB_WAVE_THREADS // threads),), (threads, 1)


def _norm_param_grads(x: Any, g: Any, mean: Any, rstd: Any, n_rows: int, dim: int, kind: str, want_bias: bool,
                      *, stream: Any, backend: str | None) -> tuple[Any, Any]:
    """Deterministic float32 (grad_weight, grad_bias or None): per-chunk column partial sums, then a
    fixed-order sum over chunks (no float atomics)."""
    n_chunks, rows_per_chunk = weight_chunks(n_rows, dim)
    gw = arrays.empty((dim,), np.float32, like=x)
    gb = arrays.empty((dim,), np.float32, like=x) if want_bias else None
    # pb is never written without want_bias, but it gets its own 1-element buffer: aliasing pw would
    # make a backend that copies arguments (numba) copy the unwritten pb back over pw
    dummy = None if want_bias else arrays.empty((1,), np.float32, like=x)
    if n_chunks == 1:
        pw, pb = gw, (gb if want_bias else dummy)
    else:
        pw = arrays.empty((n_chunks * dim,), np.float32, like=x)
        pb = arrays.empty((n_chunks * dim,), np.float32, like=x) if want_bias else dummy
    has_mean = mean is not None
    launch("norm_weight_grad" + _suffix(kind), (-(-dim // 32), n_chunks), (32, 8), flat(x), flat(g),
            mean if has_mean else rstd, rstd, pw, pb, n_rows, dim, rows_per_chunk, int(has_mean), int(want_bias),
            stream=stream, backend=backend)
    if n_chunks > 1:
        sum_chunks(pw, gw, n_chunks, dim, stream=stream, backend=backend)
        if want_bias:
            sum_chunks(pb, gb, n_chunks, dim, stream=stream, backend=backend)
    return gw, gb


# --------------------------------------------------------------------------- add_rms_norm


@arrays.stream_scoped
def add_rms_norm(
    x: Any, residual: Any, weight: Any, eps: float = 1e-6, *, offset: float = 0.0, inplace: bool = False,
    stream: Any = None, backend: str | None = None,
) -> tuple[Any, Any]:
    """(y, new_residual) with new_residual = x + residual and y = rms_norm(new_residual) * (offset + weight),
    one pass (offset 1: Gemma's (1 + weight)).

    x, residual (..., dim) and weight (dim,) share one dtype (f32, bf16 or f16; math
    in fp32; new_residual is stored in that dtype and y is computed from the
    stored value, as the unfused add then norm would). `inplace=True` writes y
    into x and new_residual into residual (both must be contiguous and
    writeable) and returns (x, residual).
    """
    kind = arrays.io_kind("x", x, arrays.IO_KINDS)
    _same_kind("residual", residual, kind, "x")
    _same_kind("weight", weight, kind, "x")
    shape, dim, n_rows = _rows("x", x)
    same_shape("residual", residual, shape, "x")
    same_shape("weight", weight, (dim,), "x's last axis")
    eps = _eps(eps)
    offset = norm_offset(offset)
    if not isinstance(inplace, bool):
        raise ArgumentError(f"inplace: expected a bool, got {inplace!r}")
    weight = arrays.contiguous(weight)
    if inplace:
        x, residual = arrays.in_place("x", x), arrays.in_place("residual", residual)
        y, new_res = x, residual
    else:
        x, residual = arrays.contiguous(x), arrays.contiguous(residual)
        y, new_res = arrays.empty(shape, kind, like=x), arrays.empty(shape, kind, like=x)
    if n_rows == 0:
        return y, new_res
    # 2 chunks a thread of a row the kernel keeps in registers: x's and residual's 4 loads in flight at once
    grid, block = (min(n_rows, GRID_X_MAX),), (cached_row_threads(dim, kind, _ARN_CACHE_VECS),)
    launch("add_rms_norm" + _suffix(kind), grid, block, flat(x), flat(residual), weight, flat(y),
            flat(new_res), n_rows, dim, eps, offset, stream=arrays.launch_stream(stream, x), backend=backend)
    return y, new_res


@arrays.stream_scoped
def add_rms_norm_backward(
    new_residual: Any, weight: Any, grad_y: Any, grad_new_residual: Any = None, eps: float = 1e-6, *,
    offset: float = 0.0, stream: Any = None, backend: str | None = None,
) -> tuple[Any, Any]:
    """Backward of add_rms_norm (with the same `offset`): (grad_h, grad_weight float32 (dim,)).

    grad_h = rms_norm_backward(new_residual, weight, grad_y) + grad_new_residual
    is the gradient of both x and residual (one path: new_residual = x + residual).
    grad_new_residual may be None (no gradient reaches new_residual). grad_weight
    is reduced in a fixed order without atomics (identical run to run).
    """
    kind = arrays.io_kind("new_residual", new_residual, arrays.IO_KINDS)
    _same_kind("weight", weight, kind, "new_residual")
    _same_kind("grad_y", grad_y, kind, "new_residual")
    shape, dim, n_rows = _rows("new_residual", new_residual)
    same_shape("weight", weight, (dim,), "new_residual's last axis")
    same_shape("grad_y", grad_y, shape, "new_residual")
    if grad_new_residual is not None:
        _same_kind("grad_new_residual", grad_new_residual, kind, "new_residual")
        same_shape("grad_new_residual", grad_new_residual, shape, "new_residual")
        grad_new_residual = arrays.contiguous(grad_new_residual)
    eps = _eps(eps)
    offset = norm_offset(offset)
    h, weight, grad_y = arrays.contiguous(new_residual), arrays.contiguous(weight), arrays.contiguous(grad_y)
    gh = arrays.empty(shape, kind, like=h)
    if n_rows == 0:
        return gh, arrays.zeros((dim,), np.float32, like=h)
    stream = arrays.launch_stream(stream, h)
    rstd = arrays.empty((n_rows,), np.float32, like=h)
    gres = grad_y if grad_new_residual is None else grad_new_residual
    has_gres = int(grad_new_residual is not None)
    fused = _lnb_fused_geometry(n_rows, dim, kind)
    if fused is not None:
        # one read of h and grad_y: each block sums h * r * grad_y of its rows per column in registers and
        # writes one fp32 partial row; norm_grad_reduce adds them in a fixed order (layer_norm_backward's scheme)
        grid, block = fused
        n_part = grid[0]
        gw = arrays.empty((dim,), np.float32, like=h)
        pw = gw if n_part == 1 else arrays.empty((n_part * dim,), np.float32, like=h)
        launch("add_rms_norm_backward" + _suffix(kind), grid, block, flat(h), weight, flat(grad_y), flat(gres),
               flat(gh), rstd, pw, n_rows, dim, eps, has_gres, offset, n_part, stream=stream, backend=backend)
        if n_part > 1:
            sum_chunks(pw, gw, n_part, dim, stream=stream, backend=backend)
        return gh, gw
    grid, block = _row_grid(n_rows, dim)
    launch("add_rms_norm_backward" + _suffix(kind), grid, block, flat(h), weight, flat(grad_y), flat(gres),
           flat(gh), rstd, rstd, n_rows, dim, eps, has_gres, offset, 0, stream=stream, backend=backend)
    gw, _ = _norm_param_grads(h, grad_y, None, rstd, n_rows, dim, kind, False, stream=stream, backend=backend)
    return gh, gw


# --------------------------------------------------------------------------- layer_norm


def _optional_param(name: str, p: Any, kind: str, dim: int) -> Any:
    if p is None:
        return None
    _same_kind(name, p, kind, "x")
    same_shape(name, p, (dim,), "x's last axis")
    return arrays.contiguous(p)


@arrays.stream_scoped
def layer_norm(
    x: Any, weight: Any = None, bias: Any = None, eps: float = 1e-5, *, stream: Any = None,
    backend: str | None = None,
) -> Any:
    """torch.nn.functional.layer_norm over the last axis: (x - mean) / sqrt(var + eps) * weight + bias.

    x (..., dim), weight / bias (dim,) of x's dtype (f32, bf16 or f16) or None;
    statistics in fp32 (biased variance, as torch).
    """
    kind = arrays.io_kind("x", x, arrays.IO_KINDS)
    shape, dim, n_rows = _rows("x", x)
    weight, bias = _optional_param("weight", weight, kind, dim), _optional_param("bias", bias, kind, dim)
    eps = _eps(eps)
    x = arrays.contiguous(x)
    y = arrays.empty(shape, kind, like=x)
    if n_rows == 0:
        return y
    grid, block = _ln_geometry(n_rows, dim, kind)
    launch("layer_norm" + _suffix(kind), grid, block, flat(x), x if weight is None else weight,
            x if bias is None else bias, flat(y), n_rows, dim, eps, int(weight is not None), int(bias is not None),
            stream=arrays.launch_stream(stream, x), backend=backend)
    return y


@arrays.stream_scoped
def layer_norm_backward(
    x: Any, weight: Any, grad_out: Any, eps: float = 1e-5, *, bias: bool = True, stream: Any = None,
    backend: str | None = None,
) -> tuple[Any, Any, Any]:
    """(grad_x like x, grad_weight float32 (dim,) or None, grad_bias float32 (dim,) or None) of layer_norm.

    weight None: the forward had no weight (grad_weight is None). `bias=False`:
    skip grad_bias (returned as None). Weight and bias gradients are per-chunk
    partial sums reduced in a fixed order (no float atomics): identical run to run.
    """
    kind = arrays.io_kind("x", x, arrays.IO_KINDS)
    _same_kind("grad_out", grad_out, kind, "x")
    shape, dim, n_rows = _rows("x", x)
    same_shape("grad_out", grad_out, shape, "x")
    weight = _optional_param("weight", weight, kind, dim)
    eps = _eps(eps)
    if not isinstance(bias, bool):
        raise ArgumentError(f"bias: expected a bool (compute grad_bias or not), got {bias!r}")
    x, grad_out = arrays.contiguous(x), arrays.contiguous(grad_out)
    gx = arrays.empty(shape, kind, like=x)
    if n_rows == 0:
        z = lambda: arrays.zeros((dim,), np.float32, like=x)  # noqa: E731
        return gx, (z() if weight is not None else None), (z() if bias else None)
    stream = arrays.launch_stream(stream, x)
    mean = arrays.empty((n_rows,), np.float32, like=x)
    rstd = arrays.empty((n_rows,), np.float32, like=x)
    has_w = weight is not None
    w_arg = x if weight is None else weight
    fused = _lnb_fused_geometry(n_rows, dim, kind) if (has_w or bias) else None
    if fused is not None:
        # one read of x and g: each of the n_part blocks sums g * xhat (and g) of its rows per column in
        # registers and writes one fp32 partial row; norm_grad_reduce adds them in a fixed order
        grid, block = fused
        n_part = grid[0]
        gw = arrays.empty((dim,), np.float32, like=x) if has_w else None
        gb = arrays.empty((dim,), np.float32, like=x) if bias else None
        part = lambda out: out if n_part == 1 else arrays.empty((n_part * dim,), np.float32, like=x)  # noqa: E731
        pw = part(gw) if has_w else None
        pb = part(gb) if bias else None
        launch("layer_norm_backward" + _suffix(kind), grid, block, flat(x), w_arg, flat(grad_out), flat(gx), mean,
               rstd, pw if has_w else pb, pb if bias else pw, n_rows, dim, eps, int(has_w), n_part, int(bias),
               stream=stream, backend=backend)
        if n_part > 1:
            if has_w:
                sum_chunks(pw, gw, n_part, dim, stream=stream, backend=backend)
            if bias:
                sum_chunks(pb, gb, n_part, dim, stream=stream, backend=backend)
        return gx, gw, gb
    grid, block = _ln_geometry(n_rows, dim, kind)
    launch("layer_norm_backward" + _suffix(kind), grid, block, flat(x), w_arg, flat(grad_out), flat(gx), mean, rstd,
           mean, rstd, n_rows, dim, eps, int(has_w), 0, 0, stream=stream, backend=backend)
    gw = gb = None
    if has_w or bias:
        gw, gb = _norm_param_grads(x, grad_out, mean, rstd, n_rows, dim, kind, bias, stream=stream,
                                   backend=backend)
    return gx, (gw if has_w else None), gb


# --------------------------------------------------------------------------- GELU / GeGLU

_APPROX = {"none": 0, "tanh": 1}


def _approx(a: Any) -> int:
    if a not in _APPROX:
        raise ArgumentError(f"approximate: expected 'none' or 'tanh', got {a!r}")
    return _APPROX[a]


def _ew(name: str, kind: str, n: int, *args: Any, stream: Any, backend: str | None) -> None:
    # the kernels take one 16-byte vector per thread (4 f32, 8 bf16 / f16) when the pointers are aligned,
    # then a scalar tail (grid-stride loops keep a misaligned launch correct with the same grid)
    per_thread = 4 if kind == "f32" else 8
    blocks = min(-(-n // (_EW_THREADS * per_thread)), _EW_BLOCKS_MAX)
    launch(name + _suffix(kind), (blocks,), (_EW_THREADS,), *args, stream=stream, backend=backend)


def _same_inputs(names: tuple[str, ...], arrs: tuple[Any, ...]) -> tuple[str, tuple[int, ...], list[Any]]:
    kind = arrays.io_kind(names[0], arrs[0], arrays.IO_KINDS)
    shape = tuple(arrays.shape_of(arrs[0]))
    for nm, a in zip(names[1:], arrs[1:]):
        _same_kind(nm, a, kind, names[0])
        same_shape(nm, a, shape, names[0])
    return kind, shape, [arrays.contiguous(a) for a in arrs]


def _map(kernel: str, names: tuple[str, ...], arrs: tuple[Any, ...], approximate: str, stream: Any,
         backend: str | None) -> Any:
    """The one-output GELU ops: validate (approximate first, then the inputs against the first), allocate the
    output like the first input and launch `kernel` over the flat inputs."""
    ap = _approx(approximate)
    kind, shape, ins = _same_inputs(names, arrs)
    out = arrays.empty(shape, kind, like=ins[0])
    n = _size(shape)
    if n:
        _ew(kernel, kind, n, *(flat(a) for a in ins), flat(out), n, ap, stream=arrays.launch_stream(stream, ins[0]),
            backend=backend)
    return out


@arrays.stream_scoped
def gelu(x: Any, approximate: str = "none", *, stream: Any = None, backend: str | None = None) -> Any:
    """torch.nn.functional.gelu(x, approximate=) elementwise (f32, bf16 or f16, fp32 math)."""
    return _map("gelu", ("x",), (x,), approximate, stream, backend)


@arrays.stream_scoped
def gelu_backward(x: Any, grad_out: Any, approximate: str = "none", *, stream: Any = None,
                  backend: str | None = None) -> Any:
    """grad_x = grad_out * gelu'(x) (f32, bf16 or f16, fp32 math)."""
    return _map("gelu_backward", ("x", "grad_out"), (x, grad_out), approximate, stream, backend)


@arrays.stream_scoped
def gelu_gate(gate: Any, up: Any, approximate: str = "none", *, stream: Any = None,
              backend: str | None = None) -> Any:
    """GeGLU: gelu(gate, approximate=) * up elementwise (f32, bf16 or f16, fp32 math)."""
    return _map("gelu_gate", ("gate", "up"), (gate, up), approximate, stream, backend)


@arrays.stream_scoped
def gelu_gate_backward(gate: Any, up: Any, grad_out: Any, approximate: str = "none", *, stream: Any = None,
                       backend: str | None = None) -> tuple[Any, Any]:
    """(grad_gate, grad_up) of gelu_gate: grad_out * up * gelu'(gate) and grad_out * gelu(gate)."""
    ap = _approx(approximate)
    kind, shape, (gate, up, grad_out) = _same_inputs(("gate", "up", "grad_out"), (gate, up, grad_out))
    gg, gu = arrays.empty(shape, kind, like=gate), arrays.empty(shape, kind, like=gate)
    n = _size(shape)
    if n:
        _ew("gelu_gate_backward", kind, n, flat(gate), flat(up), flat(grad_out), flat(gg), flat(gu), n, ap,
            stream=arrays.launch_stream(stream, gate), backend=backend)
    return gg, gu


# --------------------------------------------------------------------------- fused linear cross-entropy


def flce_chunk_rows(n_rows: int, vocab: int, hidden: int) -> int:
    """Default row chunk of fused_linear_cross_entropy (Liger's rule): the (chunk, vocab) logits block
    about the size of the (rows, hidden) input, rounded up to a power of two."""
    per = max(1, -(-vocab // max(1, hidden)))
    c = max(1, -(-n_rows // per))
    return 1 << (c - 1).bit_length()


class _Frame:
    """The caller's array framework (NumPy, torch or CuPy): matmuls and small element ops run there,
    on the caller's device and stream; only the cross-entropy itself is a pykern kernel."""

    def __init__(self, like: Any, stream: Any) -> None:
        self.kind, self.xp = arrays.framework(like)
        self.stream = stream

    def scope(self) -> Any:
        """CuPy with an explicit stream: run CuPy's own work there too (torch's is handled by
        arrays.stream_scoped, NumPy has no stream)."""
        import contextlib

        if self.kind == "cupy" and self.stream is not None:
            from ..devices import stream_handle

            return self.xp.cuda.ExternalStream(stream_handle(self.stream))
        return contextlib.nullcontext()

    def f32(self, a: Any) -> Any:
        return a.float() if self.kind == "torch" else a.astype(np.float32, copy=False)

    def float32_out_matmuls(self, like: Any) -> bool:
        """torch on a GPU with bf16 / f16 operands, and a torch whose mm and addmm take out_dtype (2.8 on):
        products written in float32 straight from the tensor cores. Without it the float32 gradients come
        from float32 copies of the operands, which torch multiplies on the SIMT cores (TF32 is off by
        default): measured 24.5 ms of a patched Llama training step on an H200 (2026-11-28,
        docs/measured/2026-11-28-h200-b.md) where these take 3.8."""
        if self.kind != "torch" or like.device.type != "cuda" or like.dtype == self.xp.float32:
            return False
        ops = self.xp.ops.aten
        return hasattr(ops.mm, "dtype_out") and hasattr(ops.addmm, "dtype_out")

    def cast(self, a: Any, like: Any) -> Any:
        if self.kind == "torch":
            return a.to(like.dtype)
        return a.astype(like.dtype, copy=False)

    def zeros(self, shape: tuple[int, ...], like: Any) -> Any:
        return arrays.zeros(shape, np.float32, like=like)

    def addmm(self, acc: Any, a: Any, b: Any, block: int) -> None:
        """acc += a @ b in float32 with no temporary of acc's size: torch accumulates in place
        (addmm_); CuPy has no accumulating matmul, so acc's rows go by blocks of `block` through
        one (block, cols) buffer."""
        if self.kind == "torch":
            acc.addmm_(a, b)
            return
        buf = self.xp.empty((min(block, acc.shape[0]) * acc.shape[1],), np.float32)
        for vs in range(0, acc.shape[0], block):
            ve = min(acc.shape[0], vs + block)
            tmp = buf[:(ve - vs) * acc.shape[1]].reshape(ve - vs, acc.shape[1])
            self.xp.matmul(a[vs:ve], b, out=tmp)
            acc[vs:ve] += tmp


def flce_block_rows(chunk: int, vocab: int, hidden: int) -> int:
    """Vocab rows per block where the NumPy/CuPy paths of fused_linear_cross_entropy walk the
    weight: a (block, hidden) float32 buffer no larger than the (chunk, vocab) logits, but at
    least 32 rows so every matmul stays BLAS-sized, and at most vocab."""
    return max(1, min(vocab, max(32, chunk * vocab // max(1, hidden))))


def _bf16_f32(a: np.ndarray, out: np.ndarray) -> np.ndarray:
    """bfloat16 or float16 -> float32 into a preallocated buffer (exact). For bf16 the bits are the top
    half of the float32's (ml_dtypes' astype would allocate); float16 is NumPy's own cast."""
    if a.dtype == np.float16:
        out[...] = a
        return out
    u = out.view(np.uint32)
    u[...] = a.view(np.uint16)
    u <<= 16
    return out


def _flce_numpy(hidden: np.ndarray, weight: np.ndarray, bias: Any, chunk: int, ce: Any, gh: np.ndarray,
                gw: np.ndarray, gb: Any, rows: np.ndarray) -> None:
    """The NumPy loop of fused_linear_cross_entropy, with extra memory O(chunk x V) + O(chunk x H).

    NumPy has neither an accumulating matmul nor a fast bf16 one, so the weight is walked in
    blocks of flce_block_rows vocab rows through preallocated float32 buffers: grad_weight[block]
    += G[:, block].T @ hidden_chunk goes through one (block, H) buffer (never a (V, H)
    temporary), and for bf16 each weight block is widened into a (block, H) buffer twice per
    chunk (logits, then grad_hidden) instead of holding a float32 copy of the whole weight."""
    n, h = hidden.shape
    v = weight.shape[0]
    bf16 = hidden.dtype != np.float32
    c_max = min(chunk, n)
    blk = flce_block_rows(c_max, v, h)
    gwbuf = np.empty((blk * h,), np.float32)
    if bf16:
        wbuf = np.empty((blk * h,), np.float32)
        lbuf = np.empty((c_max * blk,), np.float32)  # a logits / gradient block in float32
        hbuf = np.empty((c_max * h,), np.float32)
        ghbuf = np.empty((c_max * h,), np.float32)
        b32 = None if bias is None else bias.astype(np.float32)
    for s in range(0, n, chunk):
        e = min(n, s + chunk)
        c = e - s
        if bf16:
            hc = _bf16_f32(hidden[s:e], hbuf[:c * h].reshape(c, h))
            logits = np.empty((c, v), hidden.dtype)
            for vs in range(0, v, blk):
                ve = min(v, vs + blk)
                wb = _bf16_f32(weight[vs:ve], wbuf[:(ve - vs) * h].reshape(ve - vs, h))
                lb = np.matmul(hc, wb.T, out=lbuf[:c * (ve - vs)].reshape(c, ve - vs))
                if b32 is not None:
                    lb += b32[vs:ve]
                logits[:, vs:ve] = lb  # rounds to bf16 / f16, as a bf16 / f16 matmul's output would
        else:
            hc = hidden[s:e]
            logits = hc @ weight.T
            if bias is not None:
                logits += bias
        rows[s:e], g = ce(logits, s, e)  # g is logits, overwritten by the unscaled gradient
        if not bf16:
            np.matmul(g, weight, out=gh[s:e])
        for vs in range(0, v, blk):
            ve = min(v, vs + blk)
            b = ve - vs
            if bf16:
                gblk = _bf16_f32(g[:, vs:ve], lbuf[:c * b].reshape(c, b))
                wb = _bf16_f32(weight[vs:ve], wbuf[:b * h].reshape(b, h))
                gh[s:e] += np.matmul(gblk, wb, out=ghbuf[:c * h].reshape(c, h))
            else:
                gblk = g[:, vs:ve]
            gw[vs:ve] += np.matmul(gblk.T, hc, out=gwbuf[:b * h].reshape(b, h))
            if gb is not None:
                gb[vs:ve] += gblk.sum(0)
        del logits, g, gblk  # gblk may view g: the next chunk's logits must not meet this one's


@arrays.stream_scoped
def fused_linear_cross_entropy(
    hidden: Any, weight: Any, targets: Any, bias: Any = None, *, ignore_index: int = -100,
    label_smoothing: float = 0.0, z_loss: float = 0.0, softcap: float | None = None, reduction: str = "mean",
    chunk_size: int | None = None, grad_dtype: str = "float32", ce_weight: Any = None, grad_output: Any = None,
    return_z_loss: bool = False, lse_square_scale: float | None = None, stream: Any = None,
    backend: str | None = None,
) -> tuple[Any, ...]:
    """Cross-entropy of `hidden @ weight.T (+ bias)` and its gradients without the (N, vocab) logits.

    hidden (N, H), weight (V, H), bias (V,) or None, one dtype (f32, bf16 or f16);
    targets (N,) integers. Walks rows in chunks of `chunk_size` (default
    flce_chunk_rows): each chunk's logits come from the caller's framework matmul
    (NumPy @, torch.matmul, CuPy; on the caller's stream), then the cross-entropy
    kernel writes the gradient in place over them, and grad_hidden /
    grad_weight / grad_bias accumulate in float32 buffers that are the outputs:
    peak extra memory is O(chunk x V) + O(chunk x H) (tools/bench_flce.py; NumPy
    walks the weight in blocks of flce_block_rows vocab rows, torch accumulates
    with addmm_). Options and reductions as cross_entropy_fwd_bwd ("none": per-row
    losses; gradients of their sum).
    Returns (loss float32, grad_hidden, grad_weight, grad_bias or None). The
    gradients are float32 for f32, bf16 and f16 inputs alike (as rms_norm_backward's
    grad_weight): for bf16 the float32 accumulators ARE the outputs.
    grad_dtype="input" casts them to the inputs' dtype at the end instead, one
    at a time; for bf16 the casts hold max(N*H*4 + V*H*2, V*H*4) (+ V*2 with a
    bias) bytes beyond the bf16 outputs at their peak. A batch with no live row gives loss 0 and zero
    gradients ("mean").

    Liger-Kernel's options, as cross_entropy_fwd_bwd defines them: `ce_weight` (vocab,) class
    weights (Liger's name; torch's weighted mean), `lse_square_scale` (= z_loss),
    `return_z_loss=True` (returns (loss, grad_hidden, grad_weight, grad_bias, z_loss)), and
    `softcap` for a final-logit softcap (Gemma 2). With reduction "none" the loss is per row and
    `grad_output` (N,) gives each row's upstream gradient: the gradients returned are then those of
    sum_r grad_output[r] * loss_r (the rows are scaled before the matmuls, since grad_weight mixes
    rows); without it they are those of the plain sum.
    """
    from .training import (ce_class_weight, ce_row_grads, ce_scales, ce_z_loss,
                           check_ce_options, cross_entropy_fwd_bwd)

    kind = arrays.io_kind("hidden", hidden, arrays.IO_KINDS)
    _same_kind("weight", weight, kind, "hidden")
    n, h = arrays.check_ndim("hidden", hidden, (2,), "(num_tokens, hidden)")
    v, h2 = arrays.check_ndim("weight", weight, (2,), "(vocab, hidden)")
    if h2 != h:
        raise ArgumentError(f"weight: expected shape (vocab, {h}) (hidden's last axis), got {(v, h2)}")
    for name, a in (("weight", weight), ("bias", bias)):
        # the chunks' logits come from the framework's matmul of hidden and weight: one kind of array
        if a is not None and not arrays.same_memory_kind(a, hidden):
            raise ArgumentTypeError(f"{name}: expected the kind of array hidden is ({type(hidden).__name__}), got "
                                    f"{type(a).__name__}")
    if v < 1:
        raise ArgumentError(f"weight.shape[0] (vocab): expected at least 1, got {v}")
    _check_u32("weight.shape[0] (vocab)", v)
    if bias is not None:
        _same_kind("bias", bias, kind, "hidden")
        same_shape("bias", bias, (v,), "(vocab,) (the rows of weight)")
    z_loss = ce_z_loss(z_loss, lse_square_scale)
    check_ce_options(label_smoothing, z_loss, softcap, reduction)
    if grad_output is not None and reduction != "none":
        raise ArgumentError(f"grad_output: per-row upstream gradients go with reduction='none', got {reduction!r}")
    if not isinstance(return_z_loss, bool):
        raise ArgumentError(f"return_z_loss: expected a bool, got {return_z_loss!r}")
    if not isinstance(ignore_index, (int, np.integer)) or isinstance(ignore_index, bool) \
            or not -(2**31) <= ignore_index < 2**31:
        raise ArgumentError(f"ignore_index: expected an int32 value, got {ignore_index!r}")
    ignore_index = int(ignore_index)
    targets = int_array("targets", targets)
    if tuple(arrays.shape_of(targets)) != (n,):
        raise ArgumentError(f"targets: expected shape ({n},) (the rows of hidden), got "
                            f"{tuple(arrays.shape_of(targets))}")
    if grad_dtype not in ("float32", "input"):
        raise ArgumentError(f"grad_dtype: expected 'float32' or 'input', got {grad_dtype!r}")
    if chunk_size is None:
        chunk_size = flce_chunk_rows(n, v, h)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, (int, np.integer)) or chunk_size < 1:
        raise ArgumentError(f"chunk_size: expected an integer >= 1, got {chunk_size!r}")
    if n and arrays.is_host(targets):  # all rows checked up front: no partial work on a bad batch
        t = arrays.host_view(targets).astype(np.int64, copy=False)
        bad = np.flatnonzero((t != ignore_index) & ((t < 0) | (t >= v)))
        if bad.size:
            k = int(bad[0])
            raise ArgumentError(f"targets: expected values in [0, {v}) or ignore_index={ignore_index}, "
                                f"got {int(t[k])} at index {k}")
    hidden, weight = arrays.contiguous(hidden), arrays.contiguous(weight)
    bias = None if bias is None else arrays.contiguous(bias)
    fw = _Frame(hidden, stream)
    if fw.kind == "torch" and not arrays.is_torch(targets):
        targets = fw.xp.as_tensor(np.ascontiguousarray(arrays.host_view(targets)), device=hidden.device)
    elif fw.kind == "cupy" and arrays.is_host(targets):
        targets = fw.xp.asarray(arrays.host_view(targets))
    elif fw.kind == "numpy":
        targets = arrays.host_view(targets)
    with fw.scope():
        gh = fw.zeros((n, h), hidden)
        gw = fw.zeros((v, h), hidden)
        gb = fw.zeros((v,), hidden) if bias is not None else None
        rows = fw.zeros((n,), hidden)
        zrows = fw.zeros((n,), hidden) if return_z_loss else None
        cw = ce_class_weight(ce_weight, v, hidden, "ce_weight")
        gro = None if grad_output is None else ce_row_grads(grad_output, (n,), hidden)
        # the mean's two scales (1 / the live targets' weight sum, 1 / the live count) over the whole
        # batch, on the device: each chunk's rows and gradients come out already scaled
        scale = None
        if n:
            scale = ce_scales(ids_like(targets, hidden), cw, n, v, ignore_index, reduction == "mean", hidden,
                              stream=arrays.launch_stream(stream, hidden), backend=backend)

        def ce(logits: Any, s: int, e: int) -> tuple[Any, Any]:
            out = cross_entropy_fwd_bwd(logits, targets[s:e], ignore_index, label_smoothing=label_smoothing,
                                        z_loss=z_loss, softcap=softcap, reduction="none", inplace=True,
                                        weight=cw, grad_output=None if gro is None else gro[s:e],
                                        return_z_loss=return_z_loss, _scale=scale, stream=stream, backend=backend)
            if return_z_loss:
                zrows[s:e] = out[2]
            return out[0], out[1]

        chunk_size = int(chunk_size)
        if fw.kind == "numpy":
            _flce_numpy(hidden, weight, bias, chunk_size, ce, gh, gw, gb, rows)
        mixed = fw.float32_out_matmuls(hidden)
        for s in range(0, n if fw.kind != "numpy" else 0, chunk_size):
            e = min(n, s + chunk_size)
            hc = hidden[s:e]
            logits = hc @ weight.T
            if bias is not None:
                logits += bias
            rows[s:e], g = ce(arrays.contiguous(logits), s, e)
            if mixed:  # bf16 / f16 operands, float32 products and accumulators
                fw.xp.mm(g, weight, out_dtype=fw.xp.float32, out=gh[s:e])
                fw.xp.addmm(gw, g.T, hc, out_dtype=fw.xp.float32, out=gw)
                if gb is not None:
                    gb += g.sum(0, dtype=fw.xp.float32)
            else:
                if kind == "f32":
                    fw.xp.matmul(g, weight, out=gh[s:e])
                else:  # the native-dtype matmul (fp32 accumulation inside), no fp32 weight copy
                    gh[s:e] = g @ weight
                g32 = fw.f32(g)
                fw.addmm(gw, g32.T, fw.f32(hc), flce_block_rows(chunk_size, v, h))
                if gb is not None:
                    gb += g32.sum(0)
                del g32
            del logits, g
        zl = zrows
        if reduction == "none":
            loss = rows
        else:  # the rows carry the mean's scales already
            loss = rows.sum()
            zl = None if zrows is None else zrows.sum()
            if fw.kind == "numpy":
                loss = np.asarray(loss, np.float32)
                zl = None if zl is None else np.asarray(zl, np.float32)
        if grad_dtype == "input" and kind != "f32":  # one at a time: each float32 buffer dies at its cast
            gh = fw.cast(gh, hidden)
            gw = fw.cast(gw, weight)
            gb = None if gb is None else fw.cast(gb, bias)
        if return_z_loss:
            return loss, gh, gw, gb, zl
        return loss, gh, gw, gb
