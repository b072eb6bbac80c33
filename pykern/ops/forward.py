"""Forward / prefill ops: embedding, RoPE, SiLU gate, RMSNorm, causal softmax.

Kernels in kernels_cu/forward.cu (FlashAttention is the attention family's: pykern/ops/attention.py). Every op
validates shapes, dtypes and ranges before launching (ArgumentError /
ArgumentTypeError naming the argument), allocates its outputs next to the
inputs and accepts `backend=` ("nvrtc", "numba", "host" or None).
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from .. import arrays
from ..arrays import check_u32 as _check_u32, kernel_suffix as _suffix, same_kind as _same_dtype, size as _size
from ..errors import ArgumentError, ArgumentTypeError
from ._common import ids_like, norm_offset, row_geometry as _row_geometry

__all__ = ["embedding", "rope", "silu_gate", "silu_gate_backward", "rms_norm", "causal_attn_softmax"]

# flash_attention and its tensor-core helpers live in the attention family module; they stay importable from here.
from .attention import (  # noqa: E402,F401
    FA2_HEAD_DIMS, FA2_KEYS, FA2_ROWS, FA2_THREADS, FA_THREADS, TC_HEAD_DIMS, TC_ROWS, TC_THREADS, fa2_eligible,
    fa2_shared_bytes, flash_attention, tc_head_dim, tc_shared_bytes, tensor_cores_available,
)

_THREADS = 256
# Grid-stride kernels: a few waves of blocks on the largest GPUs is enough to
# saturate bandwidth; more blocks only add scheduling (and host fibers).
_MAX_BLOCKS = 4096
_INT_MAX = 2**31 - 1
_INT_DTYPES = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")


def _launch(name: str, grid: Any, block: Any, *args: Any, stream: Any = None, backend: str | None) -> None:
    from ..launcher import launch

    launch(name, grid, block, *args, stream=stream, backend=backend)


def _flat(a: Any) -> Any:
    """A 1-D view of a contiguous array (NumPy, torch and CuPy all have reshape)."""
    return a.reshape(-1)


def _blocks(units: int) -> int:
    return max(1, min(_MAX_BLOCKS, -(-units // _THREADS)))


def _f32_table(name: str, t: Any) -> Any:
    """RoPE tables are fp32 for every x dtype; NumPy tables of another float dtype are cast."""
    if isinstance(t, np.ndarray):
        if t.dtype.kind != "f" and arrays.dtype_name(t) != "bfloat16":
            raise ArgumentTypeError(f"{name}: expected a float32 table, got dtype {t.dtype.name}")
        return np.ascontiguousarray(t, dtype=np.float32)
    if arrays.is_torch(t) and arrays.dtype_name(t) in ("bfloat16", "float16", "float64"):
        t = arrays.astype(t, "float32")  # on its own device
    arrays.io_kind(name, t, ("f32",))
    return arrays.contiguous(t)


# --------------------------------------------------------------------------- embedding


@arrays.stream_scoped
def embedding(ids: Any, table: Any, *, out: Any = None, stream: Any = None, backend: str | None = None) -> Any:
    """Rows `table[ids]`: ids (n,) or (batch, seq) integers in [0, vocab), table (vocab, dim) f32, bf16 or f16
    -> (n, dim) or (batch, seq, dim).

    Host ids (NumPy, CPU tensors, lists) are checked before launch (an out-of-range id
    is an ArgumentError). Device ids of any integer dtype are converted to int64 on
    their device and trusted: the kernel writes a zero row for an id it cannot read.
    """
    kind = arrays.io_kind("table", table, arrays.IO_KINDS)
    vocab, dim = arrays.check_ndim("table", table, (2,), "(vocab, dim)")
    if isinstance(ids, (list, tuple)):
        ids = np.asarray(ids, dtype=np.int64) if len(ids) else np.zeros(0, np.int64)
    id_shape = tuple(arrays.check_ndim("ids", ids, (1, 2), ("(n,)", "(batch, seq_len)")))
    n = _size(id_shape)
    if arrays.dtype_name(ids, "ids") not in _INT_DTYPES:
        raise ArgumentTypeError(f"ids: expected an integer array, got dtype {arrays.dtype_name(ids)}")
    if arrays.is_host(ids):
        h = arrays.host_view(ids)
        if n and (int(h.min()) < 0 or int(h.max()) >= vocab):
            bad = h[(h < 0) | (h >= vocab)].reshape(-1)[0]
            raise ArgumentError(f"ids: expected every id in [0, {vocab}) (the rows of table), got {int(bad)}")
    ids = ids_like(ids, table)  # host ids for a device table: copied host-to-device by its library
    _check_u32("table.shape[1]", dim)
    table = arrays.contiguous(table)
    shape = id_shape + (dim,)
    if out is None:
        out = arrays.empty(shape, arrays.dtype_name(table), like=table)
    else:
        out = arrays.check_out(out, shape, arrays.dtype_name(table), table)
    if n == 0 or dim == 0:
        return out
    units = -(-n * dim // 4)
    _launch("embedding" + _suffix(kind), _blocks(units), _THREADS, _flat(ids), table, _flat(out), n, vocab, dim,
            stream=arrays.launch_stream(stream, table), backend=backend)
    return out


# --------------------------------------------------------------------------- rope

_STYLES = {"interleaved": 0, "half": 1}
_NO_POSITIONS = np.zeros(1, np.int64)  # the kernel's positions argument when it uses pos_offset


def _check_full_table(name: str, t: np.ndarray, rows: slice | np.ndarray, style: str, half: int) -> None:
    """An HF (max_pos, head_dim) table must repeat each pair's angle where the kernel does not read it."""
    used = t[rows]
    if style == "half":
        read, twin, how = used[:, :half], used[:, half:], f"columns i and i + {half} (HF's cat((freqs, freqs)))"
    else:
        read, twin, how = used[:, 0::2], used[:, 1::2], "columns 2i and 2i + 1 (each frequency repeated per pair)"
    bad = np.nonzero(~((read == twin) | (np.isnan(read) & np.isnan(twin))).all(axis=1))[0]
    if bad.size:
        row = int(np.arange(t.shape[0])[rows][bad[0]])
        raise ArgumentError(
            f"{name}: a (max_pos, {2 * half}) table with style={style!r} must hold equal {how}; "
            f"row {row} differs (pass a (max_pos, {half}) table for other layouts)"
        )


def _positions(position_ids: Any, x_shape: tuple[int, ...], max_pos: int) -> tuple[Any, int, np.ndarray | None]:
    """(int64 positions for the kernel, n_pos, the host copy or None) from position_ids.

    (n_tokens,) and (1, n_tokens) are shared by every batch row; (batch, n_tokens)
    gives each batch row its own. Host arrays (NumPy, CPU tensors, lists) of any
    integer dtype are checked against [0, max_pos) here; device arrays of any
    integer dtype are converted to int64 on their device and trusted (the kernel
    writes zeros for a position it cannot read).
    """
    n_tokens = x_shape[-3]
    batch = x_shape[0] if len(x_shape) == 4 else 1
    if isinstance(position_ids, (list, tuple)):
        position_ids = np.asarray(position_ids) if len(position_ids) else np.zeros(0, np.int64)
    pshape = tuple(arrays.check_ndim("position_ids", position_ids, (1, 2), ("(n_tokens,)", "(batch, n_tokens)")))
    if pshape not in ((n_tokens,), (1, n_tokens), (batch, n_tokens)):
        want = f"({n_tokens},) or (1, {n_tokens})" + (f" or ({batch}, {n_tokens})" if batch > 1 else "")
        raise ArgumentError(f"position_ids: expected shape {want} for x of shape {tuple(x_shape)}, got {pshape}")
    n_pos = n_tokens * (batch if len(pshape) == 2 and pshape[0] == batch else 1)
    if arrays.dtype_name(position_ids, "position_ids") not in _INT_DTYPES:
        raise ArgumentTypeError(f"position_ids: expected an integer array, got dtype {arrays.dtype_name(position_ids)}")
    if arrays.is_host(position_ids):
        h = arrays.host_view(position_ids)
        if h.size:
            lo, hi = int(h.min()), int(h.max())
            if lo < 0 or hi >= max_pos:
                bad = lo if lo < 0 else hi
                raise ArgumentError(f"position_ids: expected every position in [0, {max_pos}) (the rows of cos and "
                                    f"sin), "
                                    f"got {bad}")
        host = np.ascontiguousarray(h, dtype=np.int64).reshape(-1)
        return host, n_pos, host
    # device ids: converted to int64 on their device, trusted (the kernel zeroes a row it cannot read)
    return arrays.contiguous(arrays.astype(position_ids, "int64")), n_pos, None


@arrays.stream_scoped
def rope(
    x: Any,
    cos: Any,
    sin: Any,
    *,
    pos_offset: int = 0,
    position_ids: Any = None,
    style: str = "interleaved",
    inverse: bool = False,
    inplace: bool = False,
    out: Any = None,
    stream: Any = None,
    backend: str | None = None,
) -> Any:
    """Rotary position embedding of x (n_tokens, n_heads, head_dim) or (batch, n_tokens, n_heads, head_dim).

    Positions: token t (of every batch row) sits at position pos_offset + t, or
    at position_ids[t] / position_ids[b, t] when position_ids is given (integer
    array (n_tokens,), (1, n_tokens) or (batch, n_tokens) of any integer dtype,
    each in [0, max_pos); host arrays are checked before launch, device arrays
    are trusted and a row at a position outside the tables is written as zeros).
    pos_offset and position_ids are exclusive.

    Tables (fp32 for f32 and bf16 x), one of two layouts, cos and sin alike:
    - (max_pos, head_dim // 2): pair i of position p rotates by the angle with
      cos[p, i] / sin[p, i];
    - (max_pos, head_dim), Hugging Face's `rotary_emb` output: for style="half"
      columns i and i + head_dim/2 hold the same value (cat((freqs, freqs))), for
      style="interleaved" columns 2i and 2i+1 do (each frequency repeated per
      pair). The kernel reads column i (half) or 2i (interleaved); host tables
      are checked to repeat as described on the rows used.

    style="interleaved" rotates pairs (2i, 2i+1) (Meta / GPT-J layout),
    style="half" rotates (i, i + head_dim/2) like HF LLaMA's rotate_half.
    inverse=True rotates by the opposite angle (sin negated): the transpose of
    the rotation (its inverse too when cos^2 + sin^2 = 1), so rope's backward is
    grad_x = rope(grad_y, cos, sin, ..., inverse=True) with the same tables and
    positions, also for tables scaled like HF's attention_scaling.

    HF attention layers receive per-token cos/sin of shape (batch, n_tokens,
    head_dim) rather than a table: pass cos.reshape(batch * n_tokens, head_dim)
    (and sin alike) with position_ids = arange(batch * n_tokens).reshape(batch,
    n_tokens) (for batch 1, or shared positions, cos[0] with arange(n_tokens)).
    inplace=True writes into x (which must then be C-contiguous) and returns it;
    out= writes into a given array (x's shape, dtype and kind) instead.
    """
    kind = arrays.io_kind("x", x, arrays.IO_KINDS)
    shp = arrays.check_ndim("x", x, (3, 4), ("(n_tokens, num_heads, head_dim)",
                                            "(batch, n_tokens, num_heads, head_dim)"))
    if style not in _STYLES:
        raise ArgumentError(f"style: expected 'interleaved' or 'half', got {style!r}")
    if not isinstance(inverse, (bool, np.bool_)):
        raise ArgumentTypeError(f"inverse: expected a bool, got {type(inverse).__name__} {inverse!r}")
    n_tokens, n_heads, head_dim = shp[-3:]
    if head_dim % 2:
        raise ArgumentError(f"x: expected an even head_dim (last dimension), got {head_dim}")
    half = head_dim // 2
    cos, sin = _f32_table("cos", cos), _f32_table("sin", sin)
    widths = []
    for name, t in (("cos", cos), ("sin", sin)):
        ts = arrays.check_ndim(name, t, (2,), f"(max_pos, {half}) or (max_pos, {head_dim})")
        if ts[1] not in (half, head_dim):
            raise ArgumentError(
                f"{name}: expected shape (max_pos, {half}) or (max_pos, {head_dim}) for head_dim {head_dim}, got {ts}"
            )
        widths.append(ts[1])
    full = head_dim > 0 and widths[0] == head_dim
    if widths[0] != widths[1]:
        raise ArgumentError(f"sin: expected the layout of cos (width {widths[0]}), got width {widths[1]}")
    if tuple(arrays.shape_of(sin)) != tuple(arrays.shape_of(cos)):
        raise ArgumentError(f"sin: expected the shape of cos {tuple(arrays.shape_of(cos))}, got "
                            f"{tuple(arrays.shape_of(sin))}")
    max_pos = arrays.shape_of(cos)[0]
    if isinstance(pos_offset, bool) or not isinstance(pos_offset, (int, np.integer)) or pos_offset < 0:
        raise ArgumentError(f"pos_offset: expected an integer >= 0, got {pos_offset!r}")
    for name, v in (("x.shape[-3]", n_tokens), ("x.shape[-2]", n_heads), ("x.shape[-1]", head_dim),
                    ("cos.shape[0]", max_pos)):
        _check_u32(name, v)
    if position_ids is not None:
        if pos_offset:
            raise ArgumentError(f"pos_offset: expected 0 when position_ids is given, got {pos_offset}")
        positions, n_pos, host_pos = _positions(position_ids, shp, max_pos)
        _check_u32("batch * n_tokens of position_ids", n_pos)
        used: slice | np.ndarray | None = np.unique(host_pos) if host_pos is not None else None
    else:
        if pos_offset + n_tokens > max_pos:
            raise ArgumentError(
                f"pos_offset: positions {pos_offset}..{pos_offset + n_tokens - 1} need tables of at least "
                f"{pos_offset + n_tokens} rows, got {max_pos}"
            )
        _check_u32("pos_offset", int(pos_offset))
        positions, n_pos, used = None, n_tokens, slice(int(pos_offset), int(pos_offset) + n_tokens)
    if full and used is not None:
        for name, t in (("cos", cos), ("sin", sin)):
            if arrays.is_host(t):  # device tables are trusted
                _check_full_table(name, arrays.host_view(t), used, style, half)
    if inplace:
        if out is not None:
            raise ArgumentError("out: not allowed with inplace=True (the result is written into x)")
        if isinstance(x, np.ndarray) and (not x.flags.c_contiguous or not x.flags.writeable):
            raise ArgumentError("x: inplace=True needs a C-contiguous, writeable array")
        if arrays.is_torch(x) and not x.is_contiguous():
            raise ArgumentError("x: inplace=True needs a contiguous tensor")
        out = x
    else:
        x = arrays.contiguous(x)
        if out is None:
            out = arrays.empty(shp, arrays.dtype_name(x), like=x)
        else:
            out = arrays.check_out(out, shp, arrays.dtype_name(x), x)
    n_rows = _size(shp[:-1])
    if n_rows == 0 or half == 0:
        return out
    if positions is None:
        # never read when has_pos == 0: any int64 buffer on x's kind of memory will do
        positions = _NO_POSITIONS if isinstance(x, np.ndarray) else arrays.empty((1,), "int64", like=x)
    units = n_rows * max(1, half // 4)
    _launch(
        "rope" + _suffix(kind), _blocks(units), _THREADS,
        x, out, cos, sin, positions, n_rows, n_pos, n_heads, head_dim, int(pos_offset), max_pos,
        0 if position_ids is None else 1, 1 if full else 0, _STYLES[style], 1 if inverse else 0,
        stream=arrays.launch_stream(stream, x), backend=backend,
    )
    return out


# --------------------------------------------------------------------------- silu_gate


@arrays.stream_scoped
def silu_gate(gate: Any, up: Any, *, out: Any = None, stream: Any = None, backend: str | None = None) -> Any:
    """silu(gate) * up elementwise (SwiGLU), any shape, f32, bf16 or f16 (fp32 math)."""
    kind = arrays.io_kind("gate", gate, arrays.IO_KINDS)
    _same_dtype("up", up, kind, "gate")
    gs, us = arrays.shape_of(gate), arrays.shape_of(up)
    if gs != us:
        raise ArgumentError(f"up: expected the shape of gate {gs}, got {us}")
    gate, up = arrays.contiguous(gate), arrays.contiguous(up)
    out = _out(out, gs, arrays.dtype_name(gate), gate)
    n = _size(gs)
    if n == 0:
        return out
    _launch("silu_gate" + _suffix(kind), _blocks(-(-n // 4)), _THREADS, gate, up, out, n,
            stream=arrays.launch_stream(stream, gate), backend=backend)
    return out


@arrays.stream_scoped
def silu_gate_backward(
    gate: Any, up: Any, grad_out: Any, *, stream: Any = None, backend: str | None = None
) -> tuple[Any, Any]:
    """(grad_gate, grad_up) of out = silu(gate) * up given grad_out = dL/dout.

    With s = sigmoid(gate): grad_up = grad_out * gate * s and
    grad_gate = grad_out * up * s * (1 + gate * (1 - s)). Any shape (all three
    alike), f32, bf16 or f16 (all three alike), fp32 math, outputs in the input dtype.
    """
    kind = arrays.io_kind("gate", gate, arrays.IO_KINDS)
    _same_dtype("up", up, kind, "gate")
    _same_dtype("grad_out", grad_out, kind, "gate")
    gs = arrays.shape_of(gate)
    for name, a in (("up", up), ("grad_out", grad_out)):
        if arrays.shape_of(a) != gs:
            raise ArgumentError(f"{name}: expected the shape of gate {gs}, got {arrays.shape_of(a)}")
    gate, up, grad_out = arrays.contiguous(gate), arrays.contiguous(up), arrays.contiguous(grad_out)
    grad_gate = arrays.empty(gs, arrays.dtype_name(gate), like=gate)
    grad_up = arrays.empty(gs, arrays.dtype_name(gate), like=gate)
    n = _size(gs)
    if n == 0:
        return grad_gate, grad_up
    _launch("silu_gate_backward" + _suffix(kind), _blocks(-(-n // 4)), _THREADS,
            gate, up, grad_out, grad_gate, grad_up, n, stream=arrays.launch_stream(stream, gate), backend=backend)
    return grad_gate, grad_up


# --------------------------------------------------------------------------- row kernels


@arrays.stream_scoped
def rms_norm(
    x: Any, weight: Any, eps: float = 1e-6, *, offset: float = 0.0, out: Any = None, stream: Any = None,
    backend: str | None = None,
) -> Any:
    """x / sqrt(mean(x^2, -1) + eps) * (offset + weight) over the last axis; same dtype as x, statistics
    in fp32. offset=1.0 is Gemma's RMSNorm (x * (1 + w), the sum taken in fp32)."""
    kind = arrays.io_kind("x", x, arrays.IO_KINDS)
    _same_dtype("weight", weight, kind, "x")
    shp = arrays.shape_of(x)
    if len(shp) < 1:
        raise ArgumentError(f"x: expected at least 1 dimension, got shape {shp}")
    dim = shp[-1]
    if arrays.shape_of(weight) != (dim,):
        raise ArgumentError(f"weight: expected shape (hidden,) = ({dim},) (x's last axis), got "
                            f"{tuple(arrays.shape_of(weight))}")
    if not isinstance(eps, (int, float, np.floating)) or not eps >= 0 or not math.isfinite(eps):
        raise ArgumentError(f"eps: expected a finite number >= 0, got {eps!r}")
    offset = norm_offset(offset)
    _check_u32("x.shape[-1]", dim)
    x, weight = arrays.contiguous(x), arrays.contiguous(weight)
    out = _out(out, shp, arrays.dtype_name(x), x)
    n_rows = _size(shp[:-1])
    if n_rows == 0 or dim == 0:
        return out
    chunks = -(-dim // (4 if kind == "f32" else 8))
    grid, block = _row_geometry(n_rows, chunks)
    if block[0] > 32:  # enough threads that the kernel keeps the row in registers (<= 2 vectors each): one read
        block = (min(1024, max(block[0], -(-chunks // 64) * 32)), 1)
    _launch("rms_norm" + _suffix(kind), grid, block, x, weight, out, n_rows, dim, float(eps), offset,
            stream=arrays.launch_stream(stream, x), backend=backend)
    return out


@arrays.stream_scoped
def causal_attn_softmax(scores: Any, past_len: int = 0, *, stream: Any = None, backend: str | None = None) -> Any:
    """Causal softmax of attention scores (n_q, n_heads, kv_len), f32.

    Query q sees keys j <= past_len + q (past_len tokens already in the cache);
    masked entries are 0 in the result. Rows are max-shifted (numerically stable).
    """
    arrays.io_kind("scores", scores, ("f32",))
    n_q, n_heads, kv_len = arrays.check_ndim("scores", scores, (3,), "(n_q, num_heads, kv_len)")
    if isinstance(past_len, bool) or not isinstance(past_len, (int, np.integer)) or past_len < 0:
        raise ArgumentError(f"past_len: expected an integer >= 0, got {past_len!r}")
    _check_u32("past_len", int(past_len))
    _check_u32("scores.shape[1]", n_heads)
    _check_u32("scores.shape[2]", kv_len)
    scores = arrays.contiguous(scores)
    out = arrays.empty((n_q, n_heads, kv_len), "float32", like=scores)
    n_rows = n_q * n_heads
    if n_rows == 0 or kv_len == 0:
        return out
    grid, block = _row_geometry(n_rows, -(-kv_len // 4))
    _launch("causal_attn_softmax", grid, block, scores, out, n_rows, n_heads, kv_len, int(past_len),
            stream=arrays.launch_stream(stream, scores), backend=backend)
    return out


def _out(out: Any, shape: tuple[int, ...], dtype: str, like: Any) -> Any:
    """The op's output: a new array like `like`, or the caller's `out=` once validated."""
    if out is None:
        return arrays.empty(shape, dtype, like=like)
    return arrays.check_out(out, shape, dtype, like)
