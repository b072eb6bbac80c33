"""Argument checks shared by op families (no family imports another's private names: they live here)."""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from .. import arrays
from ..errors import ArgumentError, ArgumentTypeError


def dtype_is(name: str, a: Any, want: str) -> None:
    """ArgumentTypeError naming `name` unless `a`'s dtype is `want`."""
    got = arrays.dtype_name(a, name)
    if got != want:
        raise ArgumentTypeError(f"{name}: expected dtype {want}, got {got}")


def host_values(a: Any) -> np.ndarray | None:
    """The values of a host array (NumPy, CPU tensor) for validation, or None for device memory (never
    copied back: the kernels treat bad values safely and the caller keeps the device path sync-free)."""
    if not arrays.is_host(a):
        return None
    return arrays.host_view(a)


def check_offsets(offsets: Any, n_groups: int, m: int) -> Any:
    """Grouped-GEMM row offsets: int32 [n_groups + 1]; on the host also 0 first, `m` last and non-decreasing
    (device offsets are used as they are: the kernels treat decreasing ones as empty groups). Returns them
    contiguous."""
    dtype_is("offsets", offsets, "int32")
    if tuple(arrays.shape_of(offsets)) != (n_groups + 1,):
        raise ArgumentError(f"offsets: expected shape ({n_groups + 1},) (the groups of b + 1), "
                            f"got {tuple(arrays.shape_of(offsets))}")
    offsets = arrays.contiguous(offsets)
    v = host_values(offsets)
    if v is not None:
        if int(v[0]) != 0 or int(v[-1]) != m:
            raise ArgumentError(f"offsets: expected offsets[0] == 0 and offsets[-1] == {m} (rows of a), "
                                f"got {int(v[0])} and {int(v[-1])}")
        if n_groups and bool((np.diff(v.astype(np.int64)) < 0).any()):
            bad = int(np.argmax(np.diff(v.astype(np.int64)) < 0))
            raise ArgumentError(f"offsets: expected non-decreasing row starts, got offsets[{bad}] = {int(v[bad])} "
                                f"> offsets[{bad + 1}] = {int(v[bad + 1])}")
    return offsets


# --------------------------------------------------------------------------- launch geometry and the launch itself

GRID_X_MAX = 2**31 - 1  # grid x of a launch
GRID_YZ_MAX = 65535  # grid y and z of a launch
# Row kernels are compiled with __launch_bounds__(512): more threads per row
# would cap registers low enough to spill on sm_100/sm_120.
ROW_THREADS_MAX = 512
H100_SMS = 132  # SMs of an H100 / H200: the default of the planners that size a split-KV grid to one wave
_MERGE_WARPS = 8  # rows (token, head) a block of the merge-state kernels: one warp each
_MERGE_GRID_MAX = 65535 * 8  # the merge kernels are grid-stride over tokens: a cap only bounds the launch


def launch(
    name: str, grid: Any, block: Any, *args: Any, shared_mem: int = 0, stream: Any = None, backend: str | None,
    cluster: tuple[int, int, int] | None = None,
) -> None:
    """`pykern.launch` for the op modules, imported at call time (the launcher pulls in the backends, which
    `import pykern.ops` must not pay for). `cluster`: thread-block cluster dims (passed on only when given)."""
    from ..launcher import launch as _launch

    if cluster is None:
        _launch(name, grid, block, *args, shared_mem=shared_mem, stream=stream, backend=backend)
    else:
        _launch(name, grid, block, *args, shared_mem=shared_mem, stream=stream, backend=backend, cluster=cluster)


def launch_warp_rows(name: str, seq_len: int, heads: int, *args: Any, stream: Any, like: Any,
                     backend: str | None) -> None:
    """Launch a merge-state kernel (kernels_cu/cascade.cu): one warp a (token, head) row, 8 warps a block, blocks
    grid-stride over tokens, grid y over heads; on the stream of `like` unless `stream` is given."""
    grid = (max(1, min(-(-seq_len // _MERGE_WARPS), _MERGE_GRID_MAX)), heads)
    launch(name, grid, (32 * _MERGE_WARPS,), *args, stream=arrays.launch_stream(stream, like), backend=backend)


def flat(a: Any) -> Any:
    """A 1-D view of a contiguous array (NumPy, torch and CuPy all have reshape)."""
    return a.reshape(-1)


def row_threads(row_len: int) -> int:
    """Threads for a one-block-per-row kernel: enough for 4 elements each, a multiple of 32."""
    per4 = -(-row_len // 4)
    return max(32, min(ROW_THREADS_MAX, -(-per4 // 32) * 32))


def cached_row_threads(row_len: int, kind: str, cache_vecs: int) -> int:
    """Threads for a one-block-per-row kernel that keeps a row of at most cache_vecs 16-byte chunks a thread (at
    ROW_THREADS_MAX threads) in registers: cache_vecs chunks a thread, so its loads of them are all in flight at
    once and the small blocks fill an SM's register file (128 threads for 2048 bf16 columns at 2); rows it
    streams, or that are no whole number of chunks, row_threads."""
    per = 4 if kind == "f32" else 8  # elements of a 16-byte chunk
    chunks = row_len // per
    if row_len % per == 0 and chunks <= cache_vecs * ROW_THREADS_MAX:
        return max(32, -(-chunks // (cache_vecs * 32)) * 32)
    return row_threads(row_len)


def row_geometry(n_rows: int, row_len_chunks: int) -> tuple[int, tuple[int, int]]:
    """(blocks, block) of the norm kernels: a warp per row (8 rows a block) for short rows, else a block per row
    sized to the row."""
    if row_len_chunks <= 64:
        rows_per_block = 8
        return max(1, min(65535, -(-n_rows // rows_per_block))), (32, rows_per_block)
    threads = 128 if row_len_chunks <= 1024 else (256 if row_len_chunks <= 4096 else 1024)
    return max(1, min(65535, n_rows)), (threads, 1)


# norm_grad_reduce's block (kernels_cu/training.cu): 8 x 4 columns, 32 chunk lanes.
NORM_GRAD_REDUCE_BLOCK = (8, 32)
_NORM_GRAD_REDUCE_COLS = 32


def sum_chunks(partial: Any, out: Any, n_chunks: int, dim: int, *, stream: Any, backend: str | None) -> None:
    """out = the column sums of the (n_chunks, dim) float32 partial rows (norm_grad_reduce: a fixed order that
    depends on the shape only, no atomics: identical run to run). One block per 32 columns."""
    grid = (max(1, min(-(-dim // _NORM_GRAD_REDUCE_COLS), GRID_X_MAX)),)
    launch("norm_grad_reduce", grid, NORM_GRAD_REDUCE_BLOCK, partial, out, n_chunks, dim, stream=stream,
           backend=backend)


def weight_chunks(n_rows: int, dim: int) -> tuple[int, int]:
    """(n_chunks, rows_per_chunk) for the column reduction of a norm's weight (and bias) gradient.

    Enough row chunks that the (column tile x chunk) grid fills a large GPU
    (~1024 blocks), but at least 32 rows per chunk so the final per-column sum
    over chunks stays small. Depends only on the shape, so the summation order
    (and the result) is the same on every run.
    """
    col_tiles = -(-dim // 32)
    want = max(1, min(-(-n_rows // 32), -(-1024 // col_tiles), GRID_YZ_MAX))
    rows_per_chunk = -(-n_rows // want)
    return -(-n_rows // rows_per_chunk), rows_per_chunk


# --------------------------------------------------------------------------- argument checks


def same_shape(name: str, a: Any, shape: tuple[int, ...], ref_name: str) -> None:
    """ArgumentError naming `name` unless its shape is `shape` (the shape of the argument `ref_name`)."""
    s = arrays.shape_of(a)
    if tuple(s) != tuple(shape):
        raise ArgumentError(f"{name}: expected the shape of {ref_name} {tuple(shape)}, got {tuple(s)}")


def attention_scale(scale: Any, head_dim: int) -> float:
    """The softmax scale of an attention op: 1/sqrt(head_dim) for None, else a finite number."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.integer, np.floating)) or not math.isfinite(
            float(scale)):
        raise ArgumentError(f"scale: expected a finite float, got {scale!r}")
    return float(scale)


def int_in_range(name: str, v: Any, lo: int, hi: int) -> int:
    """A Python / NumPy int with lo <= v <= hi (a bool, float or other type is a type error naming `name`)."""
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise ArgumentTypeError(f"{name}: expected an int, got {type(v).__name__} {v!r}")
    if not lo <= int(v) <= hi:
        raise ArgumentError(f"{name}: expected {lo} <= {name} <= {hi}, got {int(v)}")
    return int(v)


def norm_offset(offset: Any) -> float:
    """The validated `offset` of the RMSNorm ops (a finite number: 0 LLaMA, 1 Gemma)."""
    ok = isinstance(offset, (int, float, np.floating, np.integer)) and not isinstance(offset, bool)
    if not ok or not math.isfinite(float(offset)):
        raise ArgumentError(f"offset: expected a finite number, got {offset!r}")
    return float(offset)


def check_enable_pdl(enable_pdl: Any) -> None:
    """The ops' enable_pdl (programmatic dependent launch of the kernels that wait for their predecessor): a bool."""
    if type(enable_pdl) is not bool:
        raise ArgumentTypeError(f"enable_pdl: expected a bool, got {type(enable_pdl).__name__} {enable_pdl!r}")


def enable_pdl_or_default(enable_pdl: Any) -> bool:
    """The sampling ops' enable_pdl, FlashInfer's convention (its softmax's `Optional[bool] = None`): None means on
    wherever the device takes it (FlashInfer's device_support_pdl: sm_90+), which is what a PDL launch does here
    already (the nvrtc backend asks the driver for it from sm_90 on; older GPUs and the CPU backends launch as
    usual), so None is True; else a bool."""
    if enable_pdl is None:
        return True
    if type(enable_pdl) is not bool:
        raise ArgumentTypeError(f"enable_pdl: expected a bool or None, got {type(enable_pdl).__name__} {enable_pdl!r}")
    return enable_pdl


INT_DTYPES = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")


def int_array(name: str, a: Any) -> Any:
    """An integer array of any kind (lists become NumPy int64); the dtype is checked by name."""
    if isinstance(a, (list, tuple)):
        a = np.asarray(a, dtype=np.int64) if len(a) else np.zeros(0, np.int64)
    dt = arrays.dtype_name(a, name)
    if dt not in INT_DTYPES:
        raise ArgumentTypeError(f"{name}: expected an integer dtype, got {dt}")
    return a


def ids_like(ids: Any, like: Any) -> Any:
    """Contiguous int64 indices next to `like`: converted on their own device; host indices for a
    device op are copied host-to-device (never the other way)."""
    ids = arrays.contiguous(arrays.astype(ids, "int64"))
    if arrays.is_host(ids) and not arrays.is_host(like):
        return arrays.to_like(np.ascontiguousarray(arrays.host_view(ids)), like)
    return ids


def index_array(name: str, a: Any, length: int | None, length_of: str = "") -> tuple[Any, np.ndarray | None]:
    """(int32 array for the kernel, host copy or None) of an integer index array of shape (length,).

    length_of says where the length comes from (another argument), for the shape error."""
    of = f" ({length_of})" if length_of else ""
    if isinstance(a, (list, tuple)):
        a = np.asarray(a, dtype=np.int64) if len(a) else np.zeros(0, np.int64)
    h = arrays.host_array_view(a)
    if h is not None:
        if h.dtype.kind not in "iu":
            raise ArgumentTypeError(f"{name}: expected an integer array, got dtype {h.dtype}")
        if h.ndim != 1 or (length is not None and h.shape[0] != length):
            want = f"({length},){of}" if length is not None else "1 dimension"
            raise ArgumentError(f"{name}: expected shape {want}, got {h.shape}")
        if h.size and (int(h.min()) < -2**31 or int(h.max()) >= 2**31):
            raise ArgumentError(f"{name}: expected values that fit in int32, got range [{h.min()}, {h.max()}]")
        if h.dtype != np.int32 or not h.flags.c_contiguous:
            h = np.ascontiguousarray(h, np.int32)
        return h, h
    dt = arrays.dtype_name(a, name)
    shp = arrays.shape_of(a, name)
    if len(shp) != 1 or (length is not None and shp[0] != length):
        raise ArgumentError(f"{name}: expected shape ({length},){of}, got {shp}")
    if dt == "int32":
        return a, None
    if not dt.startswith(("int", "uint")):
        raise ArgumentTypeError(f"{name}: expected an integer array, got dtype {dt}")
    try:
        return arrays.astype(a, "int32"), None  # on its own device: never a device-to-host copy
    except ArgumentTypeError:
        if hasattr(a, "astype"):  # another library's device array converts itself
            return a.astype("int32"), None
        raise ArgumentTypeError(f"{name}: expected an int32 device array, got dtype {dt}") from None


_SM_COUNTS: dict[int, int] = {}


def nvrtc_sm_count(dev: int) -> int:
    """The SM count of CUDA device `dev` (the nvrtc backend's driver), cached: the persistent grids and the split
    choices size themselves by it."""
    if dev not in _SM_COUNTS:
        from ..backends import get_backend

        be: Any = get_backend("nvrtc")
        drv = be._driver or be._start()
        _SM_COUNTS[dev] = int(drv.device_attribute(dev, "MULTIPROCESSOR_COUNT"))
    return _SM_COUNTS[dev]
