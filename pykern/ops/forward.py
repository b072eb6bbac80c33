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
from ._common import ids_like, norm_offset, row_geometry as _row_geometry, sum_chunks

__all__ = ["embedding", "rope", "qk_norm_rope", "qk_norm_rope_backward", "silu_gate", "silu_gate_backward", "rms_norm",
           "causal_attn_softmax"]

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


# A warp of the rope kernel rotates a unit of consecutive heads of one token (q's heads, then k's); each lane
# loads its cos / sin entries once per unit. _ROPE_UNITS units fill the largest GPUs with warps; past that a
# unit takes every head of its token, so the tables are read once per token.
_ROPE_WARPS = 8  # kernels_cu/forward.cu ROPE_WARPS: 256 threads
_ROPE_RU = 2  # kernels_cu/forward.cu ROPE_RU: heads a lane loads before converting
_ROPE_UNITS = 8192
_ROPE_BWD_MAX_D = 512
_F32_MAX = float(np.finfo(np.float32).max)  # kernels_cu/forward.cu ROPE_BWD_MAX_D: the backward's shared row


def _rope_chunks(head_dim: int, itemsize: int) -> tuple[int, int]:
    """(chunks per head, lanes per head) of the kernel's 16-byte path (its scalar path when half is not a
    multiple of 16 bytes' elements)."""
    half = head_dim // 2
    v = 16 // itemsize
    w = v if half % v == 0 else 1
    nc = half // w
    cp = 1
    while cp < nc and cp < 32:
        cp *= 2
    return nc, cp


def _rope_units(n_tok: int, heads: int, head_dim: int, itemsize: int) -> tuple[int, int]:
    """(heads per unit, number of units) for n_tok tokens of `heads` q + k heads."""
    _, cp = _rope_chunks(head_dim, itemsize)
    step = (32 // cp) * _ROPE_RU  # heads a warp covers per pass
    passes = -(-heads // step)
    per_unit = max(1, min(passes, -(-n_tok * passes // _ROPE_UNITS)))
    hpu = min(heads, per_unit * step)
    return hpu, n_tok * -(-heads // hpu)


def _rope_prepare(xs: list[tuple[str, Any]], cos: Any, sin: Any, pos_offset: Any, position_ids: Any, style: str,
                  inverse: Any) -> dict[str, Any]:
    """Validate rope's arguments for the tensors xs [(name, x)] (the same leading shape and head_dim; their own
    head counts) and return the kernel's table / position arguments."""
    name0, x0 = xs[0]
    kind = arrays.io_kind(name0, x0, arrays.IO_KINDS)
    shp = arrays.check_ndim(name0, x0, (3, 4), ("(n_tokens, num_heads, head_dim)",
                                                "(batch, n_tokens, num_heads, head_dim)"))
    for name, x in xs[1:]:
        _same_dtype(name, x, kind, name0)
        s = tuple(arrays.shape_of(x))
        if len(s) != len(shp) or s[:-2] != tuple(shp[:-2]) or s[-1] != shp[-1]:
            lead = ", ".join(map(str, shp[:-2]))
            raise ArgumentError(f"{name}: expected shape ({lead}, num_heads, {shp[-1]}) (the tokens and head_dim of "
                                f"{name0}), got {s}")
    if style not in _STYLES:
        raise ArgumentError(f"style: expected 'interleaved' or 'half', got {style!r}")
    if not isinstance(inverse, (bool, np.bool_)):
        raise ArgumentTypeError(f"inverse: expected a bool, got {type(inverse).__name__} {inverse!r}")
    n_tokens, _, head_dim = shp[-3:]
    if head_dim % 2:
        raise ArgumentError(f"{name0}: expected an even head_dim (last dimension), got {head_dim}")
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
    checks = [(f"{name}.shape[-2]", arrays.shape_of(x)[-2]) for name, x in xs]
    for name, v in [(f"{name0}.shape[-3]", n_tokens)] + checks + [(f"{name0}.shape[-1]", head_dim),
                                                                   ("cos.shape[0]", max_pos)]:
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
    if positions is None:
        # never read when has_pos == 0: any int64 buffer on x's kind of memory will do
        positions = _NO_POSITIONS if isinstance(x0, np.ndarray) else arrays.empty((1,), "int64", like=x0)
    return dict(kind=kind, shape=tuple(shp), cos=cos, sin=sin, positions=positions, n_pos=n_pos, max_pos=max_pos,
                has_pos=0 if position_ids is None else 1, full=1 if full else 0, head_dim=head_dim,
                n_tok=_size(shp[:-2]), pos_offset=int(pos_offset), style=_STYLES[style])


def _rope_dest(name: str, x: Any, inplace: bool, out: Any, out_name: str) -> tuple[Any, Any]:
    """(x as the kernel reads it, the array it writes) for inplace / out= / a new array."""
    shp = tuple(arrays.shape_of(x))
    if inplace:
        if out is not None:
            raise ArgumentError(f"{out_name}: not allowed with inplace=True (the result is written into {name})")
        if isinstance(x, np.ndarray) and (not x.flags.c_contiguous or not x.flags.writeable):
            raise ArgumentError(f"{name}: inplace=True needs a C-contiguous, writeable array")
        if arrays.is_torch(x) and not x.is_contiguous():
            raise ArgumentError(f"{name}: inplace=True needs a contiguous tensor")
        return x, x
    x = arrays.contiguous(x)
    if out is None:
        return x, arrays.empty(shp, arrays.dtype_name(x), like=x)
    return x, arrays.check_out(out, shp, arrays.dtype_name(x), x, name=out_name)


def _norm_weight(name: str, w: Any, head_dim: int, kind: str, like_name: str) -> Any:
    arrays.io_kind(name, w, arrays.IO_KINDS)
    _same_dtype(name, w, kind, like_name)
    if tuple(arrays.shape_of(w)) != (head_dim,):
        raise ArgumentError(f"{name}: expected shape ({head_dim},) (head_dim), got {tuple(arrays.shape_of(w))}")
    return arrays.contiguous(w)


def _norm_args(p: dict[str, Any], q_weight: Any, k_weight: Any, eps: Any, weight_offset: Any
               ) -> tuple[float, float, Any, Any]:
    """Checks of the fused norm's arguments (qk_norm_rope's and its backward's): eps, weight_offset, the head_dim
    limit of the kernel and the two weights. Returns (eps, weight_offset, q_weight, k_weight)."""
    for name, v in (("eps", eps), ("weight_offset", weight_offset)):
        if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)) or not math.isfinite(v) \
                or abs(float(v)) > _F32_MAX:  # the kernel takes fp32
            raise ArgumentError(f"{name}: expected a finite float32 number, got {v!r}")
    if eps < 0:
        raise ArgumentError(f"eps: expected a float >= 0, got {eps!r}")
    itemsize = _isz(p["kind"])
    nc, _ = _rope_chunks(p["head_dim"], itemsize)
    d = p["head_dim"]
    if nc > 32 or d > _ROPE_BWD_MAX_D:
        v = 16 // itemsize
        raise ArgumentError(f"q: the fused norm takes head_dim <= {min(64 * v, _ROPE_BWD_MAX_D)} with head_dim/2 a "
                            f"multiple of {v}, or head_dim <= 64, got head_dim {d}")
    q_weight = _norm_weight("q_weight", q_weight, d, p["kind"], "q")
    k_weight = _norm_weight("k_weight", k_weight, d, p["kind"], "q")
    return float(eps), float(weight_offset), q_weight, k_weight


def _norm_aligned(names_arrays: list[tuple[str, Any, bool]], head_dim: int) -> list[Any]:
    """The fused norm reduces a head across at most 32 lanes: past head_dim 64 it needs the 16-byte path, so every
    array 16-byte aligned. Unaligned inputs are copied (fresh allocations are aligned); an unaligned array the
    op writes into is an ArgumentError naming it. names_arrays: (name, array, written)."""
    if head_dim <= 64:
        return [a for _, a, _ in names_arrays]
    out = []
    for name, a, written in names_arrays:
        if not arrays.aligned16(a):
            if written:
                raise ArgumentError(f"{name}: the fused norm at head_dim {head_dim} writes 16-byte chunks: expected "
                                    "a 16-byte aligned base address")
            a = arrays.aligned_copy(a)
            if a is None:
                raise ArgumentError(f"{name}: the fused norm at head_dim {head_dim} reads 16-byte chunks: expected a "
                                    "16-byte aligned base address")
        out.append(a)
    return out


def _norm_operands(p: dict[str, Any], names_arrays: list[tuple[str, Any, bool]], q_weight: Any, k_weight: Any
                   ) -> tuple[dict[str, Any], list[Any]]:
    """_norm_aligned over names_arrays, then the two weights and p's cos / sin tables (read only): (p with the
    aligned tables, [the aligned names_arrays..., q_weight, k_weight])."""
    got = _norm_aligned(names_arrays + [("q_weight", q_weight, False), ("k_weight", k_weight, False),
                                        ("cos", p["cos"], False), ("sin", p["sin"], False)], p["head_dim"])
    return dict(p, cos=got[-2], sin=got[-1]), got[:-2]


def _launch_rope(p: dict[str, Any], q: Any, q_out: Any, k: Any, k_out: Any, hq: int, hk: int, q_w: Any, k_w: Any,
                 inverse: bool, norm: bool, eps: float, w_offset: float, itemsize: int, stream: Any,
                 backend: str | None) -> None:
    hpu, n_units = _rope_units(p["n_tok"], hq + hk, p["head_dim"], itemsize)
    _launch(
        "rope" + _suffix(p["kind"]), max(1, min(_MAX_BLOCKS, -(-n_units // _ROPE_WARPS))), _THREADS,
        _flat(q), _flat(q_out), _flat(k), _flat(k_out), q_w, k_w, p["cos"], p["sin"], p["positions"], p["n_tok"],
        n_units, hpu, p["n_pos"], hq, hk, p["head_dim"], p["pos_offset"], p["max_pos"], p["has_pos"], p["full"],
        p["style"], 1 if inverse else 0, 1 if norm else 0, eps, w_offset,
        stream=arrays.launch_stream(stream, q), backend=backend,
    )


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
    q and k of one attention layer rotate in one launch with qk_norm_rope (without weights).
    """
    p = _rope_prepare([("x", x)], cos, sin, pos_offset, position_ids, style, inverse)
    x, out = _rope_dest("x", x, inplace, out, "out")
    shp = p["shape"]
    if p["n_tok"] * shp[-2] == 0 or p["head_dim"] == 0:
        return out
    # k (0 heads) is never touched; its output slot gets a scratch of its own because the numba backend writes
    # every non-const array back and two slots on `out` would overwrite each other
    spare = arrays.empty((8,), arrays.dtype_name(x), like=x)
    _launch_rope(p, x, out, x, spare, shp[-2], 0, x, x, inverse, False, 0.0, 0.0, _isz(p["kind"]), stream, backend)
    return out


def _isz(kind: str) -> int:
    return 4 if kind == "f32" else 2


@arrays.stream_scoped
def qk_norm_rope(
    q: Any,
    k: Any,
    cos: Any,
    sin: Any,
    *,
    q_weight: Any = None,
    k_weight: Any = None,
    eps: float = 1e-6,
    weight_offset: float = 0.0,
    pos_offset: int = 0,
    position_ids: Any = None,
    style: str = "half",
    inverse: bool = False,
    inplace: bool = False,
    q_out: Any = None,
    k_out: Any = None,
    stream: Any = None,
    backend: str | None = None,
) -> tuple[Any, Any]:
    """RoPE of q (…, n_tokens, n_heads, head_dim) and k (…, n_tokens, n_kv_heads, head_dim) in one launch, each
    head first RMS-normalised over head_dim when q_weight and k_weight are given (Qwen3 / Gemma 3's q_norm and
    k_norm): x / sqrt(mean(x^2) + eps) * (weight_offset + weight), then rotated. Returns (q_out, k_out).

    q and k share their leading dimensions and head_dim, and every table / position argument of rope (style
    defaults to "half", HF's rotate_half). Weights are (head_dim,) of q's dtype, both or neither; weight_offset=1
    is Gemma's (1 + weight). The norm needs head_dim <= 64 x (16 bytes / element size) (512 for bf16, 256 for
    f32) with head_dim/2 a multiple of 16 bytes' elements, or head_dim <= 64. inverse=True (rope's backward)
    is for the plain rotation only. inplace=True writes into q and k; q_out= / k_out= into given arrays.
    Backward: qk_norm_rope_backward (with weights), or this op with inverse=True (without).
    """
    p = _rope_prepare([("q", q), ("k", k)], cos, sin, pos_offset, position_ids, style, inverse)
    norm = q_weight is not None or k_weight is not None
    if norm:
        if q_weight is None or k_weight is None:
            missing = "q_weight" if q_weight is None else "k_weight"
            raise ArgumentError(f"{missing}: expected both q_weight and k_weight (or neither), got None")
        if inverse:
            raise ArgumentError("inverse: expected False with the norm weights (its backward is "
                                "qk_norm_rope_backward), got True")
        eps, weight_offset, q_weight, k_weight = _norm_args(p, q_weight, k_weight, eps, weight_offset)
    if inplace and q is k:
        raise ArgumentError("k: inplace=True needs k and q to be different arrays")
    q, qo = _rope_dest("q", q, inplace, q_out, "q_out")
    k, ko = _rope_dest("k", k, inplace, k_out, "k_out")
    hq, hk = arrays.shape_of(q)[-2], arrays.shape_of(k)[-2]
    if p["n_tok"] * (hq + hk) == 0 or p["head_dim"] == 0:
        return qo, ko
    if norm:
        p, (q, k, qo, ko, q_weight, k_weight) = _norm_operands(
            p, [("q", q, inplace), ("k", k, inplace), ("q_out", qo, True), ("k_out", ko, True)], q_weight, k_weight)
    qw, kw = (q_weight, k_weight) if norm else (q, q)  # never read without the norm
    _launch_rope(p, q, qo, k, ko, hq, hk, qw, kw, inverse, norm, float(eps) if norm else 0.0,
                 float(weight_offset) if norm else 0.0, _isz(p["kind"]), stream, backend)
    return qo, ko


@arrays.stream_scoped
def qk_norm_rope_backward(
    q: Any,
    k: Any,
    grad_q: Any,
    grad_k: Any,
    cos: Any,
    sin: Any,
    q_weight: Any,
    k_weight: Any,
    *,
    eps: float = 1e-6,
    weight_offset: float = 0.0,
    pos_offset: int = 0,
    position_ids: Any = None,
    style: str = "half",
    stream: Any = None,
    backend: str | None = None,
) -> tuple[Any, Any, Any, Any]:
    """Gradients of qk_norm_rope with weights: (grad of q, grad of k, grad of q_weight, grad of k_weight) from
    the forward's inputs q, k and the gradients grad_q, grad_k of its outputs. The weight gradients (fp32 sums,
    returned in the weights' dtype) are deterministic: per-block partial rows added in a fixed order."""
    p = _rope_prepare([("q", q), ("k", k), ("grad_q", grad_q), ("grad_k", grad_k)], cos, sin, pos_offset,
                      position_ids, style, False)
    for name, g, x in (("grad_q", grad_q, q), ("grad_k", grad_k, k)):
        if tuple(arrays.shape_of(g)) != tuple(arrays.shape_of(x)):
            ref = "q" if name == "grad_q" else "k"
            raise ArgumentError(f"{name}: expected the shape of {ref} {tuple(arrays.shape_of(x))}, got "
                                f"{tuple(arrays.shape_of(g))}")
    eps, weight_offset, q_weight, k_weight = _norm_args(p, q_weight, k_weight, eps, weight_offset)
    q, k, grad_q, grad_k = (arrays.contiguous(a) for a in (q, k, grad_q, grad_k))
    p, (q, k, grad_q, grad_k, q_weight, k_weight) = _norm_operands(
        p, [("q", q, False), ("k", k, False), ("grad_q", grad_q, False), ("grad_k", grad_k, False)], q_weight,
        k_weight)
    dtype = arrays.dtype_name(q)
    gq = arrays.empty(tuple(arrays.shape_of(q)), dtype, like=q)
    gk = arrays.empty(tuple(arrays.shape_of(k)), dtype, like=q)
    d = p["head_dim"]
    gwq, gwk = arrays.empty((d,), dtype, like=q), arrays.empty((d,), dtype, like=q)
    hq, hk = arrays.shape_of(q)[-2], arrays.shape_of(k)[-2]
    isz = _isz(p["kind"])
    hpu, n_units = _rope_units(p["n_tok"], hq + hk, d, isz)
    blocks = max(1, min(_MAX_BLOCKS, -(-n_units // _ROPE_WARPS)))
    st = arrays.launch_stream(stream, q)
    pw = arrays.empty((2, blocks, d), "float32", like=q)
    pw_q, pw_k = pw[0], pw[1]
    _launch(
        "rope_norm_backward" + _suffix(p["kind"]), blocks, _THREADS,
        _flat(q), _flat(k), _flat(grad_q), _flat(grad_k), _flat(gq), _flat(gk), q_weight, k_weight, p["cos"],
        p["sin"], p["positions"], pw_q, pw_k, p["n_tok"], n_units, hpu, p["n_pos"], hq, hk, d, p["pos_offset"],
        p["max_pos"], p["has_pos"], p["full"], p["style"], eps, weight_offset, stream=st, backend=backend,
    )
    if dtype == "float32":
        sum_chunks(pw_q, gwq, blocks, d, stream=st, backend=backend)
        sum_chunks(pw_k, gwk, blocks, d, stream=st, backend=backend)
    else:
        sums = arrays.empty((2, d), "float32", like=q)
        sum_chunks(pw_q, sums[0], blocks, d, stream=st, backend=backend)
        sum_chunks(pw_k, sums[1], blocks, d, stream=st, backend=backend)
        gwq, gwk = arrays.astype(sums[0], dtype), arrays.astype(sums[1], dtype)
    return gq, gk, gwq, gwk


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
