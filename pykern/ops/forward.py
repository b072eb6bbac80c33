"""Forward / prefill ops: embedding, RoPE, SiLU gate, RMSNorm, causal softmax, FlashAttention.

Kernels in kernels_cu/forward.cu and kernels_cu/flash_attention.cu. Every op
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
from ._attention_sm90 import try_forward as _sm90_forward
from ._common import ids_like, norm_offset, row_geometry as _row_geometry
from ._window import (
    check_softcap as _check_softcap,
    check_window_size as _check_window_size,
    normalize as _normalize,
)

__all__ = ["embedding", "rope", "silu_gate", "silu_gate_backward", "rms_norm", "causal_attn_softmax", "flash_attention"]

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


# --------------------------------------------------------------------------- flash_attention

# (bucket, query rows per block): the kernel gives DMAX/16 threads to a query row, 256 threads a block.
_FA_BUCKETS = ((64, 64), (128, 32), (256, 16))
FA_THREADS = 256
# Tensor-core bf16 / f16 kernels (kernels_cu/flash_attention_tc.cu): compile-time head_dim D, other head_dims
# padded up to the next D; (D, keys per tile, Q in registers) as the .cu's FatcCfg.
TC_HEAD_DIMS = (64, 96, 128, 256)
_TC_CFG = {64: (64, 1), 96: (64, 1), 128: (64, 1), 256: (32, 0)}
TC_THREADS = 128
TC_ROWS = 64  # queries per CTA (FATC_BR)
# The FlashAttention-2 core (kernels_cu/pk_attn_core.cuh): flash_attention_tc_d64 / _d128 take
# head_dim == head_dim_v == D with 16-byte aligned q / k / v / out, 128 queries a CTA of 8 warps; other shapes
# at those D take flash_attention_tc_pad_d64 / _d128 (the general kernels above, padding head_dim).
FA2_HEAD_DIMS = (64, 128)
FA2_THREADS = 256
FA2_ROWS = 128  # PKFA_BR
FA2_KEYS = 64   # PKFA_BC


def fa2_shared_bytes(d: int) -> int:
    """Dynamic shared memory of the FlashAttention-2 core at head_dim d (PKFA_SMEM_BYTES)."""
    return (4 * FA2_KEYS + FA2_ROWS) * d * 2


def fa2_eligible(head_dim: int, head_dim_v: int, *arrays_: Any) -> bool:
    """Whether the FlashAttention-2 core runs this shape: head_dim == head_dim_v in FA2_HEAD_DIMS and every
    array's data 16-byte aligned (its tiles move in 16-byte cp.async chunks)."""
    if head_dim != head_dim_v or head_dim not in FA2_HEAD_DIMS:
        return False
    return arrays.aligned16(*arrays_)


def tc_head_dim(head_dim: int) -> int:
    """The compiled head_dim the tensor-core kernels use for a head_dim (the next of 64/96/128/256)."""
    return next(d for d in TC_HEAD_DIMS if head_dim <= d)


def tc_shared_bytes(d: int) -> int:
    """Dynamic shared memory of the tensor-core forward at compiled head_dim d (FATC_SMEM_BYTES)."""
    bc, qreg = _TC_CFG[d]
    return ((0 if qreg else TC_ROWS) + 4 * bc) * (d + 8) * 2


def tensor_cores_available(backend: str | None = None) -> bool:
    """Whether the bf16 / f16 tensor-core kernels can run on `backend`: mma.sync m16n8k16 needs sm_80+ on the
    nvrtc backend (sm_75 keeps the fp32-FMA kernels); the host backend emulates mma, numba runs the reference."""
    from ..backends import get_backend

    be = get_backend(backend)
    if be.name != "nvrtc":
        return True
    # A yes is remembered per backend object and arch (available() asks the driver and NVRTC each time): a
    # backend that once had a usable sm_80+ GPU keeps it; a changed arch asks again.
    arch = getattr(be, "arch", "") or ""
    seen = _tc_yes.get(id(be))
    if seen is not None and seen[0] is be and seen[1] == arch:
        return True
    ok, _ = be.available()
    arch = getattr(be, "arch", "") or ""
    yes = ok and arch.startswith("sm_") and int("".join(c for c in arch[3:] if c.isdigit())) >= 80
    if yes:
        _tc_yes[id(be)] = (be, arch)
    return yes


_tc_yes: dict[int, tuple[Any, str]] = {}  # id(backend) -> (backend, arch) where tensor cores were found


@arrays.stream_scoped
def flash_attention(
    q: Any,
    k: Any,
    v: Any,
    *,
    causal: bool = False,
    scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    return_lse: bool = False,
    out: Any = None,
    tensor_cores: bool | None = None,
    stream: Any = None,
    backend: str | None = None,
) -> Any:
    """softmax(scale * q k^T) v per (batch, head), without materialising the scores.

    q (batch, n_q, n_heads, head_dim), k (batch, n_k, n_kv_heads, head_dim),
    v (batch, n_k, n_kv_heads, head_dim_v); n_heads % n_kv_heads == 0 (query head
    h uses kv head h // (n_heads // n_kv_heads)); head_dim, head_dim_v <= 256.
    f32, bf16 or f16 (all three alike; out in the same dtype), fp32 accumulation. scale defaults to
    1/sqrt(head_dim).

    causal=True aligns the mask bottom-right: query i sees keys
    j <= i + n_k - n_q (with n_q == n_k the usual lower triangle; with n_q < n_k
    the queries are the last n_q positions of the sequence). When n_q > n_k the
    first n_q - n_k queries see no key: their output is 0 and their lse -inf.

    window_size=(left, right) (flash-attn's sliding window; -1 = unbounded on that side):
    query i sees keys i' - left <= j <= i' + right, i' = i + n_k - n_q (aligned bottom-right
    like the causal mask); causal=True sets right to 0. Key tiles wholly outside every window
    of a query tile are skipped (never read), so the cost follows the window. A row whose
    window holds no key gets out 0 and lse -inf. softcap=c > 0 (Gemma 2's attention logit
    softcapping): scores become c * tanh(scale * q.k / c) before the mask and softmax (separate
    kernels, so softcap=0 pays nothing for it); lse is then over the capped scores.

    Returns out (batch, n_q, n_heads, head_dim_v) (written into `out=` when given), or (out, lse) with
    return_lse=True: lse (batch, n_q, n_heads) float32 is the natural-log
    log-sum-exp of the scaled scores over the visible keys, the input
    `attention_backward(..., lse=)` expects.

    tensor_cores: bf16 and f16. None (default) runs the tensor-core kernels (mma.sync bf16 / f16, compiled
    head_dim 64/96/128/256, others padded up) wherever they can run: the nvrtc backend on sm_80 and
    newer, the host backend (emulated) and numba; sm_75 falls back to the fp32-FMA kernels. True
    requires them (ArgumentError where they cannot run), False forces the fp32-FMA kernels. The
    tensor-core path rounds the softmax probabilities to the input dtype for the P·V product, as
    FlashAttention-2 does. On a Hopper GPU (compute capability 9.0; on the host backend with
    PYKERN_HOST_ARCH=sm_90a) head_dim == head_dim_v in 64/128/256 without softcap runs the sm_90a kernel
    instead (TMA, wgmma, FlashAttention-3's producer / consumer warpgroups; same rounding of P). f32
    inputs always use the fp32 kernels. f16 outputs overflow to inf beyond
    65504, as on the GPU.
    """
    kind = arrays.io_kind("q", q, arrays.IO_KINDS)
    _same_dtype("k", k, kind, "q")
    _same_dtype("v", v, kind, "q")
    batch, n_q, n_heads, head_dim = arrays.check_ndim("q", q, (4,), "(batch, n_q, num_heads, head_dim)")
    ks = arrays.check_ndim("k", k, (4,), "(batch, n_k, num_kv_heads, head_dim)")
    vs = arrays.check_ndim("v", v, (4,), "(batch, n_k, num_kv_heads, head_dim_v)")
    if ks[0] != batch or ks[3] != head_dim:
        raise ArgumentError(f"k: expected shape (batch, n_k, num_kv_heads, head_dim) = ({batch}, n_k, num_kv_heads, "
                            f"{head_dim}) (batch and head_dim from q), got {ks}")
    n_k, n_kv_heads = ks[1], ks[2]
    if vs[:3] != (batch, n_k, n_kv_heads):
        raise ArgumentError(f"v: expected shape (batch, n_k, num_kv_heads, head_dim_v) = ({batch}, {n_k}, "
                            f"{n_kv_heads}, head_dim_v) (from q and k), got {vs}")
    head_dim_v = vs[3]
    if n_kv_heads < 1 or n_heads % n_kv_heads:
        raise ArgumentError(f"k: n_kv_heads must divide n_heads={n_heads}, got {n_kv_heads}")
    for name, d in (("q.shape[3] (head_dim)", head_dim), ("v.shape[3] (head_dim_v)", head_dim_v)):
        if not 1 <= d <= 256:
            raise ArgumentError(f"{name}: expected 1 <= value <= 256, got {d}")
    left, right = _check_window_size(window_size)
    softcap = _check_softcap(softcap)
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating)) or not math.isfinite(scale):
        raise ArgumentError(f"scale: expected a finite number, got {scale!r}")
    # The kernel steps query/key tiles in int (n_q + ROWS - 1, k0 + BK, row + n_k - n_q):
    # lengths keep a 256-element margin below 2^31 so those never overflow.
    for name, val, lim in (("q.shape[0]", batch, _INT_MAX), ("q.shape[1]", n_q, _INT_MAX - 256),
                           ("k.shape[1]", n_k, _INT_MAX - 256), ("q.shape[2]", n_heads, _INT_MAX)):
        if val > lim:
            raise ArgumentError(f"{name}: expected at most {lim}, got {val}")
    if tensor_cores not in (None, True, False):
        raise ArgumentError(f"tensor_cores: expected None, True or False, got {tensor_cores!r}")
    use_tc = False
    if kind != "f32" and tensor_cores is not False:
        use_tc = tensor_cores_available(backend)
        if tensor_cores and not use_tc:
            raise ArgumentError(f"tensor_cores: True needs {kind} mma (sm_80 or newer); this device has none")
    elif tensor_cores:
        raise ArgumentError(f"tensor_cores: True needs bf16 or f16 inputs, got {arrays.dtype_name(q)}")
    wl, wr = _normalize(left, right, bool(causal), n_q, n_k)
    cap = "_softcap" if softcap > 0.0 else ""
    if use_tc:
        bucket, rows = tc_head_dim(max(head_dim, head_dim_v)), TC_ROWS
    else:
        bucket, rows = next((b, r) for b, r in _FA_BUCKETS if max(head_dim, head_dim_v) <= b)
    n_blocks = batch * n_heads * -(-n_q // rows)
    if n_blocks > _INT_MAX:
        raise ArgumentError(f"q: batch * n_heads * ceil(n_q / {rows}) = {n_blocks} blocks exceeds {_INT_MAX}")

    q, k, v = arrays.contiguous(q), arrays.contiguous(k), arrays.contiguous(v)
    out = _out(out, (batch, n_q, n_heads, head_dim_v), arrays.dtype_name(q), q)
    lse = arrays.empty((batch, n_q, n_heads), "float32", like=q)
    stream = arrays.launch_stream(stream, q)
    if n_blocks == 0:
        pass
    elif n_k == 0:  # no key at all: every row is an empty softmax
        _fill(out, 0.0, stream)
        _fill(lse, -math.inf, stream)
    elif use_tc and _sm90_forward(q, k, v, out, lse, (batch, n_q, n_k, n_heads, n_kv_heads, head_dim, head_dim_v),
                                      float(scale), softcap, wl, wr, _suffix(kind), stream, backend):
        pass  # the Hopper kernel ran (kernels_cu/flash_attention_sm90.cu)
    elif use_tc:
        from ..launcher import launch

        args = (q, k, v, out, lse, batch, n_q, n_k, n_heads, n_kv_heads, head_dim, head_dim_v, float(scale),
                wl, wr, softcap)
        if fa2_eligible(head_dim, head_dim_v, q, k, v, out):
            launch(f"flash_attention_tc_d{bucket}{cap}{_suffix(kind)}", batch * n_heads * -(-n_q // FA2_ROWS),
                   FA2_THREADS, *args, shared_mem=fa2_shared_bytes(bucket), stream=stream, backend=backend)
        else:
            pad = "pad_" if bucket in FA2_HEAD_DIMS else ""
            launch(f"flash_attention_tc_{pad}d{bucket}{cap}{_suffix(kind)}", n_blocks, TC_THREADS, *args,
                   shared_mem=tc_shared_bytes(bucket), stream=stream, backend=backend)
    else:
        _launch(
            f"flash_attention_d{bucket}{cap}{_suffix(kind)}", n_blocks, FA_THREADS,
            q, k, v, out, lse, batch, n_q, n_k, n_heads, n_kv_heads, head_dim, head_dim_v, float(scale),
            wl, wr, softcap,
            stream=stream, backend=backend,
        )
    return (out, lse) if return_lse else out


def _fill(a: Any, value: float, stream: Any = None) -> None:
    if isinstance(a, np.ndarray):
        a.fill(value)
    elif hasattr(a, "fill_"):
        a.fill_(value)  # torch: on its current stream, which is the op's stream unless one was passed
    else:
        a.fill(value)


def _out(out: Any, shape: tuple[int, ...], dtype: str, like: Any) -> Any:
    """The op's output: a new array like `like`, or the caller's `out=` once validated."""
    if out is None:
        return arrays.empty(shape, dtype, like=like)
    return arrays.check_out(out, shape, dtype, like)
