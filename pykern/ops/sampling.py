"""Sampling from probabilities with FlashInfer's names and semantics (kernels in kernels_cu/sampling.cu).

Ops: `sampling_from_probs`, `top_k_sampling_from_probs`, `top_p_sampling_from_probs`,
`min_p_sampling_from_probs`, `top_k_top_p_sampling_from_probs` (one int32 token per row),
`sampling_from_logits`, `top_k_top_p_sampling_from_logits` (the same over softmax(logits / T), fused: no
probability written) and `softmax` (float32 probabilities),
`top_k_renorm_probs`, `top_p_renorm_probs` (filtered, renormalized probabilities),
`top_k_mask_logits` (the other logits set to -inf) and `chain_speculative_sampling` (rejection
sampling of drafted token chains, docs/serving.md#speculative-decoding-chain_speculative_sampling).
probs / logits are (batch, vocab) float32,
bfloat16 or float16 (FlashInfer's dtypes), fp32 math; vocab up to 2**22.

Semantics (FlashInfer's, with the choices where it leaves room spelled out):
- Filters keep whole tie groups: top-k keeps every entry >= the k-th largest value (so more than
  k entries when the k-th value is tied), as FlashInfer's pivot search does. top_k = 0 or
  top_k >= vocab disables the filter (top_k_renorm_probs / top_k_mask_logits then return the
  input unchanged, as FlashInfer does for k >= vocab); top_k < 0 is an error.
- top-p keeps the largest values whose mass reaches top_p times the row's total mass: the
  smallest set of whole tie groups, taken from the top, with mass >= top_p * total (top_p in
  (0, 1]; 1 keeps everything). For normalized rows this is FlashInfer's threshold.
- min-p keeps p >= min_p * max(p) (min_p in [0, 1]).
- top_k_top_p: filter_apply_order="top_k_first" (default) applies top-p to the top-k
  renormalized distribution; "joint" keeps the entries that pass both filters on the raw row.
- A row without mass (all zeros) gets token 0 and valid=False (return_valid=True returns the flags).
- A row holding a NaN, an inf or a negative probability is no distribution: it also gets token 0
  and valid=False (never a token drawn from its other entries), and the renorm ops return it as a
  row of NaN (top_k_renorm_probs with the filter off, top_k = 0 or >= vocab, returns its input
  unchanged). check_nan=True (FlashInfer's flag) checks host probs first and raises ArgumentError
  naming `probs` and the first such entry; device probs are never read on the host (no sync), so
  there the valid flags are the check.
- Per-row parameters: a scalar or an array of shape (batch,) (indexed by output row). As FlashInfer
  (`.float()` / `.int()`), an integer array of top_p / min_p becomes float32 and a float array of
  top_k becomes int32 truncated toward zero, on the array's own device (host arrays are checked first).
- Samples are int32, or int64 when `indices` is an int64 array (FlashInfer's samples take the dtype
  of indices), widened on the device.

Reproducibility: every sampling op draws one 32-bit uniform per output row b from
Philox4x32-10 with key `seed` (64-bit) and counter (offset, b): the same (probs, parameters,
seed, offset) give the same tokens on every backend (the decision is integer arithmetic; see
kernels_cu/sampling.cu). Without `seed` one is drawn from `generator` (a NumPy Generator or a
torch.Generator; torch CUDA generators are read and advanced like FlashInfer does, with no
device work) or from fresh OS entropy. seed / offset may be per-row arrays (int64 / uint64,
length 1 or batch) for CUDA-graph capture. No host synchronisation: device parameter arrays are
trusted (a per-row top_k < 0 acts as 0, top_p outside (0, 1) and min_p > 1 as 1).
"""
from __future__ import annotations

import math
import os
from typing import Any

import numpy as np

from .. import arrays
from ..errors import ArgumentError, ArgumentTypeError
from ._common import enable_pdl_or_default, index_array

__all__ = [
    "sampling_from_probs",
    "top_k_sampling_from_probs",
    "top_p_sampling_from_probs",
    "min_p_sampling_from_probs",
    "top_k_top_p_sampling_from_probs",
    "softmax",
    "sampling_from_logits",
    "top_k_top_p_sampling_from_logits",
    "top_k_renorm_probs",
    "top_p_renorm_probs",
    "top_k_mask_logits",
    "chain_speculative_sampling",
]

NT = 512  # SP_NT in sampling.cu
MAX_VOCAB = 2**22  # 2^22 entries of at most 2^40 fixed-point mass fit in 64 bits
_INT_MAX = 2**31 - 1
_U64 = 2**64

# flags (kernels_cu/sampling.cu)
_INDICES, _TOP_K, _TOP_P, _MIN_P, _TOP_K_FIRST = 1, 2, 4, 8, 16
_K_ARR, _P_ARR, _MINP_ARR, _SEED_ARR, _OFFSET_ARR = 32, 64, 128, 256, 512
_T_ARR = 1024  # sampling_from_logits: per-row temperature array (SPF_T_ARR)
_SM_T_ARR = 1  # sampling_softmax (SMF_T_ARR)
# log2(e) rounded to float32 (SP_LOG2E, 0x3FB8AA3B): the scale c = log2(e) / T is one float32 division on every
# backend, here for a scalar temperature and in the kernel for a per-row one
_LOG2E = np.float32(1.4426950408889634)
_F32_MAX = float(np.finfo(np.float32).max)
_R_TOP_K, _R_K_ARR, _R_P_ARR = 1, 2, 4


# --------------------------------------------------------------------------- argument helpers
def _matrix(name: str, a: Any) -> tuple[Any, str, int, int]:
    kind = arrays.io_kind(name, a, arrays.IO_KINDS)  # f32, bf16, f16: FlashInfer's sampling dtypes
    shp = arrays.check_ndim(name, a, (2,), "(batch, vocab)")
    batch, vocab = shp
    if vocab < 1:
        raise ArgumentError(f"{name}: expected at least one column (vocab >= 1), got shape {shp}")
    if vocab > MAX_VOCAB:
        raise ArgumentError(f"{name}: expected vocab <= {MAX_VOCAB}, got {vocab}")
    if batch > _INT_MAX:
        raise ArgumentError(f"{name}: expected at most {_INT_MAX} rows, got {batch}")
    return arrays.contiguous(a), kind, batch, vocab


_UNUSED: dict[tuple[Any, ...], Any] = {}


def _unused(dtype: str, n: int, like: Any) -> Any:
    """The array argument of a parameter passed by value: never read or written (its flag is off), so one
    allocation a device and dtype, kept (never a host-to-device copy: a pageable copy synchronises the stream,
    measured ~100 us a call on an H200)."""
    mem = arrays.memory_key(like)
    if mem is None:
        return arrays.empty((n,), dtype, like=like)
    key = (mem, dtype, n)
    a = _UNUSED.get(key)
    if a is None:
        a = _UNUSED[key] = arrays.empty((n,), dtype, like=like)
    return a


def _is_scalar(x: Any) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool)


def _param(name: str, value: Any, batch: int, like: Any, integer: bool, lo: float, hi: float,
           lo_open: bool = False, rows: str = "probs") -> tuple[Any, float | int, bool]:
    """(array for the kernel or a dummy, scalar value, is_array) of a scalar-or-per-row parameter.

    Host values are checked against [lo, hi] (lo excluded with lo_open); device arrays are trusted. `rows`
    names the argument the batch comes from (probs, logits, or indices when given), for the messages."""
    # The common case first, with nothing formatted unless it fails (an op's host time is paid every step).
    t = type(value)
    if t is int or (t is float and not integer):  # (type(True) is bool, not int)
        v = float(value)
        if lo < v <= hi or (v == lo and not lo_open):
            return _unused("int32" if integer else "float32", 1, like), (value if integer else v), False
    want = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
    kind = "int" if integer else "float"
    if isinstance(value, (list, tuple)):
        value = np.asarray(value)
    if _is_scalar(value):
        if integer and not isinstance(value, (int, np.integer)):
            raise ArgumentTypeError(f"{name}: expected an int or an integer array of shape ({batch},), got {value!r}")
        v = float(value)
        if math.isnan(v) or v < lo or v > hi or (lo_open and v == lo):
            raise ArgumentError(f"{name}: expected a {kind} in {want}, got {value!r}")
        dummy = _unused("int32" if integer else "float32", 1, like)
        return dummy, (int(value) if integer else float(value)), False
    try:
        dt = arrays.dtype_name(value, name)
    except ArgumentTypeError:
        raise ArgumentTypeError(f"{name}: expected a {kind} or an array of shape ({batch},), got "
                                f"{type(value).__name__}") from None
    shp = arrays.shape_of(value, name)
    if shp != (batch,):
        raise ArgumentError(f"{name}: expected a {kind} or an array of shape ({batch},) (one value a row of "
                            f"{rows}), got shape {shp}")
    # FlashInfer converts either way (`.int()` of a top_k array, `.float()` of a top_p / min_p one): an integer
    # array of thresholds (torch.full((b,), 1) is int64) or a float array of top_k values is converted on its own
    # device, the float-to-int conversion truncating toward zero as `.int()` does.
    is_int = dt.startswith(("int", "uint"))
    if not is_int and not dt.startswith(("float", "bfloat")):
        raise ArgumentTypeError(f"{name}: expected an integer or float array, got dtype {dt}")
    if arrays.is_host(value):
        h = np.asarray(arrays.host_view(value), np.float64)
        if integer and not is_int:
            h = np.trunc(h)  # NaN stays NaN: refused below
        bad = np.isnan(h) | (h < lo) | (h > hi) | ((h == lo) if lo_open else False)
        if bad.any():
            i = int(np.argmax(bad))
            raise ArgumentError(f"{name}: expected every value in {want}, got {name}[{i}]={h[i]:g}")
        if integer and h.size and h.max() > _INT_MAX:
            raise ArgumentError(f"{name}: expected values < 2**31, got {h.max():g}")
        host = np.ascontiguousarray(h, np.int32 if integer else np.float32)
        return (host if arrays.same_memory_kind(host, like) else arrays.to_like(host, like)), 0, True
    if integer and not is_int and arrays.is_torch(value):
        # torch's float-to-int32 conversion truncates toward zero (FlashInfer's `.int()`)
        return arrays.contiguous(arrays.astype(value, "int32")), 0, True
    if integer and not is_int:
        value = arrays.astype(value, "float32")  # bf16 / f16 (CuPy has no cast from them to int) through fp32
    return arrays.contiguous(arrays.astype(value, "int32" if integer else "float32")), 0, True


def _words(name: str, value: Any, batch: int, like: Any) -> tuple[Any, int, bool]:
    """(uint32 (lo, hi) word pairs per row or a dummy, scalar value, is_array) of seed / offset."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        v = int(value)
        if not -2**63 <= v < _U64:
            raise ArgumentError(f"{name}: expected an int in [-2**63, 2**64), got {v}")
        return _unused("uint32", 2, like), v % _U64, False
    try:
        dt = arrays.dtype_name(value, name)
    except ArgumentTypeError:
        raise ArgumentTypeError(f"{name}: expected an int or an int64 / uint64 array, got "
                                f"{type(value).__name__}") from None
    if dt not in ("int64", "uint64"):
        raise ArgumentTypeError(f"{name}: expected an int64 or uint64 array, got dtype {dt}")
    shp = arrays.shape_of(value)
    if len(shp) != 1 or shp[0] not in (1, batch):
        raise ArgumentError(f"{name}: expected shape (1,) or ({batch},), got {shp}")
    if arrays.is_host(value):
        h = np.ascontiguousarray(arrays.host_view(value)).view(np.uint64)
        if h.shape[0] != batch:
            h = np.repeat(h, batch)
        w = np.ascontiguousarray(h).view(np.uint32).copy()
        return (w if arrays.same_memory_kind(w, like) else arrays.to_like(w, like)), 0, True
    v = arrays.contiguous(value)
    if shp[0] != batch:
        v = v.expand(batch).contiguous() if arrays.is_torch(v) else v.repeat(batch)
    if arrays.is_torch(v):
        import torch

        return v.view(torch.uint32), 0, True  # (lo, hi) pairs: little endian (the kernel's uint32 pointee)
    return v.view("uint32"), 0, True


def _seed_offset(seed: Any, offset: Any, generator: Any, like: Any) -> tuple[Any, Any]:
    """(seed, offset) with FlashInfer's defaults: both given, or drawn from `generator` / OS entropy."""
    if seed is not None and offset is not None:
        return seed, offset
    if seed is not None:
        return seed, 0
    if offset is not None:
        raise ArgumentError("offset: expected seed as well (offset alone does not make a stream)")
    if generator is None:
        return int.from_bytes(os.urandom(8), "little"), 0
    if isinstance(generator, np.random.Generator):
        return int(generator.integers(0, _U64, dtype=np.uint64)), 0
    torch = arrays.torch_module()
    if torch is not None and isinstance(generator, torch.Generator):
        if generator.device.type == "cuda":
            # Philox state (seed, offset) on the host, advanced as FlashInfer does: no device work.
            state = generator.get_state()
            s, o = (int(x) for x in state.view(torch.int64)[:2])
            generator.set_state(torch.tensor([s, o + 4], dtype=torch.int64).view(torch.uint8))
            return s % _U64, o
        return int(torch.randint(0, 2**63 - 1, (1,), generator=generator)), 0
    raise ArgumentTypeError(f"generator: expected a numpy.random.Generator or a torch.Generator, got "
                            f"{type(generator).__name__}")


def _indices(indices: Any, rows: int, like: Any, of: str = "probs") -> tuple[Any, int]:
    """(int32 indices for the kernel or a dummy, output batch); `of` names the matrix whose rows they pick."""
    if indices is None:
        return _unused("int32", 1, like), rows
    idx, h = index_array("indices", indices, None)
    n = arrays.shape_of(idx)[0]
    if h is not None and n and (int(h.min()) < 0 or int(h.max()) >= rows):
        raise ArgumentError(f"indices: expected rows of {of} in [0, {rows}), got range [{int(h.min())}, "
                            f"{int(h.max())}]")
    if h is not None and not arrays.same_memory_kind(h, like):
        idx = arrays.to_like(h, like)
    return idx, n


def _out_dtype(out: Any, indices: Any, stream: Any, like: Any) -> Any:
    """The samples in FlashInfer's dtype: int64 when indices are int64, else int32. The kernel writes int32 (token
    ids < 2**22); the widening runs on the samples' own device and stream, no host synchronisation."""
    if indices is None or isinstance(indices, (list, tuple)) or arrays.dtype_name(indices) != "int64":
        return out
    if stream is not None and arrays.is_torch(out) and not arrays.is_host(out):
        from .. import devices

        torch = arrays.torch_module()  # torch converts on its current stream: make it the op's
        with torch.cuda.stream(torch.cuda.ExternalStream(devices.stream_handle(stream), device=out.device)):
            return arrays.astype(out, "int64")
    return arrays.astype(out, "int64")


def _check_nan(name: str, a: Any) -> None:
    """check_nan=True on host probs: a NaN, inf or negative entry is an error naming it (FlashInfer's check_nan,
    extended to the other values that are no probability). Device probs are not read on the host (no sync): their
    bad rows come back as valid=False."""
    if arrays.is_host(a):
        h = np.asarray(arrays.host_view(a), np.float32)
        bad = ~((h >= 0.0) & (h < np.inf))  # NaN fails both tests
        if bad.any():
            r, c = (int(x) for x in np.argwhere(bad)[0])
            raise ArgumentError(f"{name}: expected probabilities in [0, inf) (check_nan=True), got {name}[{r}, {c}]="
                                f"{float(h[r, c])!r}")


def _check_logits(name: str, a: Any) -> None:
    """check_nan=True on host logits: a NaN or +inf entry (no softmax: the row gets valid=False) is an error naming
    it. Device logits are not read on the host (no sync): the valid flags are the check."""
    if arrays.is_host(a):
        h = np.asarray(arrays.host_view(a), np.float32)
        bad = ~(h < np.inf)  # NaN fails too
        if bad.any():
            r, c = (int(x) for x in np.argwhere(bad)[0])
            raise ArgumentError(f"{name}: expected logits without NaN or +inf (check_nan=True), got {name}[{r}, {c}]="
                                f"{float(h[r, c])!r}")


def _scale(temperature: Any, batch: int, like: Any, rows: str = "logits") -> tuple[Any, float, bool]:
    """(per-row float32 T for the kernel or a dummy, log2(e) / T for a scalar T, is_array) of a temperature.

    A scalar T must be a finite float32 > 0 whose log2(e) / T is finite too (the kernel's scale); host arrays are
    checked the same way; device arrays are trusted (a row whose T gives no scale >= 0, finite samples no token)."""
    if temperature is None:
        return _unused("float32", 1, like), float(_LOG2E), False
    if _is_scalar(temperature):
        t = np.float32(temperature) if math.isfinite(float(temperature)) else np.float32(np.nan)
        with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
            c = _LOG2E / t
        if not (t > 0 and np.isfinite(t) and np.isfinite(c)):
            raise ArgumentError(f"temperature: expected a finite float > 0 (as float32, with log2(e) / T finite), got "
                                f"{temperature!r}")
        return _unused("float32", 1, like), float(c), False
    if isinstance(temperature, (list, tuple)):
        temperature = np.asarray(temperature, np.float32)
    try:
        dt = arrays.dtype_name(temperature, "temperature")
    except ArgumentTypeError:
        raise ArgumentTypeError(f"temperature: expected None, a float or a float array of shape ({batch},), got "
                                f"{type(temperature).__name__}") from None
    if arrays.is_host(temperature) and dt.startswith(("float", "bfloat", "int", "uint")):
        h = np.asarray(arrays.host_view(temperature), np.float32)
        if h.shape == (batch,):  # (a wrong shape is _param's error)
            with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
                bad = ~((h > 0) & np.isfinite(h) & np.isfinite(_LOG2E / h))
            if bad.any():
                i = int(np.argmax(bad))
                raise ArgumentError(f"temperature: expected every value a finite float > 0 (as float32, with "
                                    f"log2(e) / T finite), got temperature[{i}]={float(h[i])!r}")
    arr, _, _ = _param("temperature", temperature, batch, like, False, 0.0, _F32_MAX, True, rows=rows)
    return arr, 0.0, True


def _valid_out(valid: Any, batch: int, like: Any) -> Any:
    """A caller's `valid` buffer (batch,), bool or uint8, as the kernel's uint8 (a view of the same memory)."""
    if arrays.dtype_name(valid, "valid") == "bool":
        arrays.check_out(valid, (batch,), "bool", like, "valid")
        return arrays.view_uint8(valid)
    return arrays.check_out(valid, (batch,), "uint8", like, "valid")


MAX_CTAS_PER_ROW = 16  # a split row's CTAs at most (sp_split_last): 16 x 512 threads keep ~4 chunks each at 128k


def _sm_count(backend: str | None, like: Any) -> int:
    """The device's SM count (nvrtc backend), else 1: the host and numba backends split rows only when asked."""
    from ..backends import get_backend
    from ..devices import array_device

    be: Any = get_backend(backend)
    if be.name != "nvrtc":
        return 1
    from ._common import nvrtc_sm_count

    dev = array_device(like)
    return nvrtc_sm_count(dev if isinstance(dev, int) and dev >= 0 else 0)


def _ctas_per_row(ctas_per_row: int | None, batch: int, vocab: int, kind: str, backend: str | None,
                  like: Any) -> int:
    """CTAs a row for the splittable draws (no top-k / top-p): the given count, or enough to fill the SMs at a small
    batch (one CTA a row from batch >= the SM count), at most one a 512-thread chunk of the row."""
    if ctas_per_row is not None:
        if isinstance(ctas_per_row, bool) or not isinstance(ctas_per_row, (int, np.integer)):
            raise ArgumentTypeError(f"ctas_per_row: expected an int or None, got {type(ctas_per_row).__name__}")
        if not 1 <= int(ctas_per_row) <= MAX_CTAS_PER_ROW:
            raise ArgumentError(f"ctas_per_row: expected an int in [1, {MAX_CTAS_PER_ROW}], got {int(ctas_per_row)}")
        return int(ctas_per_row)
    if not batch:
        return 1
    chunks = -(-vocab // (NT * (4 if kind == "f32" else 8)))
    return max(1, min(MAX_CTAS_PER_ROW, _sm_count(backend, like) // batch, chunks))


_WS: dict[tuple[Any, ...], tuple[Any, Any]] = {}


def _split_workspace(batch: int, split: int, stream: Any, like: Any) -> tuple[tuple[Any, ...], Any, Any]:
    """(cache key, partials, tickets) of split rows: >= batch * split uint64 partial masses and >= batch uint32 ticket
    counters, one pair a (device, stream), kept between calls. The kernel's last ticket of a row wraps its counter back
    to 0, so the counters stay zeroed with no fill a call (a CUDA graph replays them as they are); the partials are
    written before they are read. Launches on one stream run in order, so no two in flight share them."""
    from ..devices import array_device, stream_handle

    mem = arrays.memory_key(like)  # "host", a torch device, or None for other kinds
    key: tuple[Any, ...] = ("host",) if mem == "host" else (
        str(mem) if mem is not None else array_device(like), stream_handle(stream))
    ws = _WS.get(key)
    if ws is None or arrays.shape_of(ws[0])[0] < batch * split or arrays.shape_of(ws[1])[0] < batch:
        rows = max(batch, 256)
        ws = _WS[key] = (arrays.empty((rows * MAX_CTAS_PER_ROW,), "uint64", like=like),
                         arrays.zeros((rows,), "uint32", like=like))
    return key, ws[0], ws[1]


# --------------------------------------------------------------------------- sampling
def _sample(probs: Any, *, top_k: Any = None, top_p: Any = None, min_p: Any = None, top_k_first: bool = False,
            indices: Any = None, generator: Any = None, check_nan: bool = False, seed: Any = None,
            offset: Any = None, return_valid: bool = False, stream: Any = None, backend: str | None = None,
            logits: bool = False, temperature: Any = None, out: Any = None, valid: Any = None,
            ctas_per_row: int | None = None, enable_pdl: bool | None = None) -> Any:
    from ..launcher import launch

    pdl = enable_pdl_or_default(enable_pdl)
    name = "logits" if logits else "probs"
    probs, kind, rows, vocab = _matrix(name, probs)
    if check_nan:
        (_check_logits if logits else _check_nan)(name, probs)
    idx, batch = _indices(indices, rows, probs, name)
    flags = _INDICES if indices is not None else 0
    rows_of = "probs (indices not given)" if indices is None else "indices"
    k_arr, k_val, k_is = _param("top_k", 0 if top_k is None else top_k, batch, probs, True, 0, _INT_MAX,
                                rows=rows_of)
    p_arr, p_val, p_is = _param("top_p", 1.0 if top_p is None else top_p, batch, probs, False, 0.0, 1.0, True,
                                rows=rows_of)
    if logits:  # the min-p slot carries the temperature: log2(e) / T, or the per-row T array
        m_arr, m_val, m_is = _scale(temperature, batch, probs, rows_of.replace("probs", "logits"))
    else:
        m_arr, m_val, m_is = _param("min_p", 0.0 if min_p is None else min_p, batch, probs, False, 0.0, 1.0,
                                    rows=rows_of)
    flags |= (_TOP_K if top_k is not None else 0) | (_TOP_P if top_p is not None else 0)
    flags |= (_MIN_P if min_p is not None else 0) | (_TOP_K_FIRST if top_k_first else 0)
    flags |= (_K_ARR if k_is else 0) | (_P_ARR if p_is else 0)
    flags |= ((_T_ARR if logits else _MINP_ARR) if m_is else 0)
    s, o = _seed_offset(seed, offset, generator, probs)
    s_arr, s_val, s_is = _words("seed", s, batch, probs)
    o_arr, o_val, o_is = _words("offset", o, batch, probs)
    flags |= (_SEED_ARR if s_is else 0) | (_OFFSET_ARR if o_is else 0)
    given = out is not None
    out = arrays.empty((batch,), "int32", like=probs) if out is None else \
        arrays.check_out(out, (batch,), "int32", probs)
    valid = arrays.empty((batch,), "uint8", like=probs) if valid is None else _valid_out(valid, batch, probs)
    # rows split over several CTAs: the same tokens for every count; ws holds each row's partial masses and its
    # ticket counter. Top-k first then top-p keeps one CTA a row (its top-k radix select); the other top-k / top-p
    # rows split the maximum and the first draw's mass, and the row's last CTA runs the rejection rounds after it.
    split = _ctas_per_row(ctas_per_row, batch, vocab, kind, backend, probs)
    if top_k is not None and top_p is not None and top_k_first:
        split = 1
    if batch:
        lstream = arrays.launch_stream(stream, probs)
        if split == 1:
            ws_key, ws, tickets = None, _unused("uint64", 1, probs), _unused("uint32", 1, probs)
        else:
            ws_key, ws, tickets = _split_workspace(batch, split, lstream, probs)
        try:
            launch(("sampling_from_logits" if logits else "sampling_from_probs") + arrays.kernel_suffix(kind),
                   (batch, split), (NT,), probs.reshape(-1), out, valid,
                   idx, k_arr, p_arr, m_arr, s_arr, o_arr, vocab, flags, int(k_val), float(p_val), float(m_val),
                   s_val & 0xFFFFFFFF, s_val >> 32, o_val & 0xFFFFFFFF, o_val >> 32, ws, tickets, stream=lstream,
                   backend=backend, pdl=pdl)
        except BaseException:
            _WS.pop(ws_key, None)  # a launch stopped part way may leave counters set: the next call starts afresh
            raise
    if not given:  # a caller's out is int32 and returned as it is (a widening would be a new array)
        out = _out_dtype(out, indices, stream, probs)
    return (out, arrays.view_bool(valid)) if return_valid else out


def sampling_from_probs(probs: Any, indices: Any = None, deterministic: bool = True, generator: Any = None,
                        check_nan: bool = False, seed: Any = None, offset: Any = None, return_valid: bool = False,
                        *, out: Any = None, valid: Any = None, ctas_per_row: int | None = None,
                        enable_pdl: bool | None = None, stream: Any = None, backend: str | None = None) -> Any:
    """One token per row of probs (batch, vocab), drawn with probability p / sum(p): int32 (batch,).

    indices (n,) maps output i to row indices[i] of probs. deterministic is accepted for
    FlashInfer compatibility (the kernel is always deterministic). check_nan=True raises ArgumentError for a NaN,
    inf or negative entry of host probs. Returns samples, or (samples, valid) with return_valid (valid False,
    token 0, for a row without mass or with a NaN, inf or negative entry). ctas_per_row (1 to 16, None: enough to
    fill the GPU's SMs at a small batch, 1 on the host backend) splits each row over that many CTAs; the tokens are
    the same for every count.

    out / valid (every sampling op; pykern's, not FlashInfer's): a contiguous int32 (batch,) array to write the
    samples into, returned as it is (also with int64 indices: no widening), and a bool or uint8 (batch,) array for
    the valid flags. With both given, device seed / offset of shape (batch,) and device or scalar parameters, the
    op allocates nothing and reads nothing back: it can be captured in a CUDA graph (docs/serving.md).

    enable_pdl (every sampling op and softmax; FlashInfer's convention, keyword): programmatic dependent launch. The
    kernel waits inside for the kernel before it (the decode or the projection that wrote the row) before its first
    read, so its CTAs may start while that one finishes. None (the default) is on wherever the device takes it
    (sm_90+ on the nvrtc backend; elsewhere, and on the CPU backends, an ordinary launch), False off.
    """
    del deterministic
    return _sample(probs, indices=indices, generator=generator, check_nan=check_nan, seed=seed, offset=offset,
                   return_valid=return_valid, out=out, valid=valid, stream=stream, backend=backend,
                   ctas_per_row=ctas_per_row, enable_pdl=enable_pdl)


def top_k_sampling_from_probs(probs: Any, top_k: Any, indices: Any = None, deterministic: bool = True,
                              generator: Any = None, check_nan: bool = False, seed: Any = None, offset: Any = None,
                              return_valid: bool = False, *, out: Any = None, valid: Any = None,
                              ctas_per_row: int | None = None, enable_pdl: bool | None = None, stream: Any = None,
                              backend: str | None = None) -> Any:
    """Sampling restricted to the entries >= the k-th largest of the row (top_k: int or (batch,) array).

    Top-k and top-p draw by FlashInfer's rejection sampling with two pivots (docs/serving.md): each round draws from
    the entries above a pivot and one read counts the entries above two pivots. ctas_per_row as
    sampling_from_probs': the row's CTAs share the maximum and the first draw's reads, its last CTA runs the rounds
    after the first; the tokens are the same for every count."""
    del deterministic
    if top_k is None:
        raise ArgumentError("top_k: expected an int or an integer array, got None")
    return _sample(probs, top_k=top_k, indices=indices, generator=generator, check_nan=check_nan, seed=seed,
                   offset=offset, return_valid=return_valid, out=out, valid=valid, stream=stream, backend=backend,
                   ctas_per_row=ctas_per_row, enable_pdl=enable_pdl)


def top_p_sampling_from_probs(probs: Any, top_p: Any, indices: Any = None, deterministic: bool = True,
                              generator: Any = None, check_nan: bool = False, seed: Any = None, offset: Any = None,
                              return_valid: bool = False, *, out: Any = None, valid: Any = None,
                              ctas_per_row: int | None = None, enable_pdl: bool | None = None, stream: Any = None,
                              backend: str | None = None) -> Any:
    """Nucleus sampling: restricted to the largest entries whose mass reaches top_p (in (0, 1]) of the row's.
    The draw and ctas_per_row as top_k_sampling_from_probs'."""
    del deterministic
    if top_p is None:
        raise ArgumentError("top_p: expected a float or a float array, got None")
    return _sample(probs, top_p=top_p, indices=indices, generator=generator, check_nan=check_nan, seed=seed,
                   offset=offset, return_valid=return_valid, out=out, valid=valid, stream=stream, backend=backend,
                   ctas_per_row=ctas_per_row, enable_pdl=enable_pdl)


def min_p_sampling_from_probs(probs: Any, min_p: Any, indices: Any = None, deterministic: bool = True,
                              generator: Any = None, check_nan: bool = False, seed: Any = None, offset: Any = None,
                              return_valid: bool = False, *, out: Any = None, valid: Any = None,
                              ctas_per_row: int | None = None, enable_pdl: bool | None = None, stream: Any = None,
                              backend: str | None = None) -> Any:
    """Sampling restricted to p >= min_p * max(p) (min_p in [0, 1]); ctas_per_row as sampling_from_probs'."""
    del deterministic
    if min_p is None:
        raise ArgumentError("min_p: expected a float or a float array, got None")
    return _sample(probs, min_p=min_p, indices=indices, generator=generator, check_nan=check_nan, seed=seed,
                   offset=offset, return_valid=return_valid, out=out, valid=valid, stream=stream, backend=backend,
                   ctas_per_row=ctas_per_row, enable_pdl=enable_pdl)


def top_k_top_p_sampling_from_probs(probs: Any, top_k: Any, top_p: Any, indices: Any = None,
                                    filter_apply_order: str = "top_k_first", deterministic: bool = True,
                                    generator: Any = None, check_nan: bool = False, seed: Any = None,
                                    offset: Any = None, return_valid: bool = False, *, out: Any = None,
                                    valid: Any = None, ctas_per_row: int | None = None,
                                    enable_pdl: bool | None = None, stream: Any = None,
                                    backend: str | None = None) -> Any:
    """Top-k then top-p ("top_k_first": top-p of the top-k renormalized distribution) or both at once
    on the raw row ("joint"), in one kernel. The draw and ctas_per_row as top_k_sampling_from_probs'; "top_k_first"
    finds the top-k set by a radix select first and keeps one CTA a row (ctas_per_row is then 1)."""
    del deterministic
    if filter_apply_order not in ("top_k_first", "joint"):
        raise ArgumentError(f"filter_apply_order: expected 'top_k_first' or 'joint', got {filter_apply_order!r}")
    if top_k is None or top_p is None:
        raise ArgumentError(f"{'top_k' if top_k is None else 'top_p'}: expected a value, got None")
    return _sample(probs, top_k=top_k, top_p=top_p, top_k_first=filter_apply_order == "top_k_first",
                   indices=indices, generator=generator, check_nan=check_nan, seed=seed, offset=offset,
                   return_valid=return_valid, out=out, valid=valid, stream=stream, backend=backend,
                   ctas_per_row=ctas_per_row, enable_pdl=enable_pdl)


# --------------------------------------------------------------------------- from logits
@arrays.stream_scoped
def softmax(logits: Any, temperature: Any = None, enable_pdl: bool | None = None, *, stream: Any = None,
            backend: str | None = None) -> Any:
    """softmax(logits / temperature) over each row of logits (batch, vocab) (f32, bf16, f16): float32 (batch, vocab).

    temperature: None (1), a float, or a (batch,) array (a T per row), each a finite value > 0 (host values are
    checked; device arrays trusted). FlashInfer's online safe softmax: one CTA a row reads it twice (max and sum in
    one pass, then the write) in fp32, in base 2 (2^((x - max) * log2(e) / T)). A row holding a NaN or +inf comes
    back NaN; -inf entries give 0. enable_pdl (FlashInfer's): programmatic dependent launch, the kernel waiting for the
    one before it (the decode that wrote the logits) inside; None (the default) is on wherever the device takes it
    (sm_90+ on the nvrtc backend; elsewhere an ordinary launch), False off."""
    from ..launcher import launch

    pdl = enable_pdl_or_default(enable_pdl)
    logits, kind, batch, vocab = _matrix("logits", logits)
    t_arr, c_val, t_is = _scale(temperature, batch, logits)
    out = arrays.empty((batch, vocab), "float32", like=logits)
    if batch:
        launch("sampling_softmax" + arrays.kernel_suffix(kind), (batch,), (NT,), logits.reshape(-1), out.reshape(-1),
               t_arr, vocab, _SM_T_ARR if t_is else 0, float(c_val), stream=arrays.launch_stream(stream, logits),
               backend=backend, pdl=pdl)
    return out


def sampling_from_logits(logits: Any, indices: Any = None, deterministic: bool = True, generator: Any = None,
                         check_nan: bool = False, seed: Any = None, offset: Any = None, return_valid: bool = False,
                         *, temperature: Any = None, out: Any = None, valid: Any = None,
                         ctas_per_row: int | None = None, enable_pdl: bool | None = None, stream: Any = None,
                         backend: str | None = None) -> Any:
    """One token per row of logits (batch, vocab), drawn from softmax(logits / temperature): int32 (batch,).

    The softmax is fused: no probability is written; each entry's mass is 2^40 * 2^((x - max) * log2(e) / T) in
    64-bit fixed point, from three IEEE float operations and an integer polynomial (kernels_cu/sampling.cu,
    sp_exp_mass), so the token is the same on every backend. temperature (a pykern extension: FlashInfer's op has
    none) is None (1), a float or a (batch,) array, finite and > 0. A row holding a NaN or +inf logit, or only -inf,
    is no distribution: token 0, valid False (check_nan=True raises ArgumentError for such an entry of host logits).
    The other arguments are sampling_from_probs' (ctas_per_row included). Reads the row twice (max, then the mass
    with the draw)."""
    del deterministic
    return _sample(logits, indices=indices, generator=generator, check_nan=check_nan, seed=seed, offset=offset,
                   return_valid=return_valid, out=out, valid=valid, stream=stream, backend=backend, logits=True,
                   temperature=temperature, ctas_per_row=ctas_per_row, enable_pdl=enable_pdl)


def top_k_top_p_sampling_from_logits(logits: Any, top_k: Any, top_p: Any, indices: Any = None,
                                     filter_apply_order: str = "top_k_first", deterministic: bool = True,
                                     generator: Any = None, check_nan: bool = False, seed: Any = None,
                                     offset: Any = None, return_valid: bool = False, *, temperature: Any = None,
                                     out: Any = None, valid: Any = None, ctas_per_row: int | None = None,
                                     enable_pdl: bool | None = None, stream: Any = None,
                                    backend: str | None = None) -> Any:
    """top_k_top_p_sampling_from_probs over softmax(logits / temperature), the softmax fused (sampling_from_logits):
    top-k keeps the entries >= the k-th largest logit (softmax keeps the order), top-p thresholds the fixed-point
    softmax mass. The same tokens as the probs op on the fixed-point softmax, up to its accuracy."""
    del deterministic
    if filter_apply_order not in ("top_k_first", "joint"):
        raise ArgumentError(f"filter_apply_order: expected 'top_k_first' or 'joint', got {filter_apply_order!r}")
    if top_k is None or top_p is None:
        raise ArgumentError(f"{'top_k' if top_k is None else 'top_p'}: expected a value, got None")
    return _sample(logits, top_k=top_k, top_p=top_p, top_k_first=filter_apply_order == "top_k_first",
                   indices=indices, generator=generator, check_nan=check_nan, seed=seed, offset=offset,
                   return_valid=return_valid, out=out, valid=valid, stream=stream, backend=backend, logits=True,
                   temperature=temperature, ctas_per_row=ctas_per_row, enable_pdl=enable_pdl)


# --------------------------------------------------------------------------- renorm / mask
def _renorm(name: str, x: Any, top_k: Any, top_p: Any, stream: Any, backend: str | None) -> Any:
    from ..launcher import launch

    x, kind, batch, vocab = _matrix(name, x)
    if top_k is not None:
        k_arr, k_val, k_is = _param("top_k", top_k, batch, x, True, 0, _INT_MAX, rows=name)
        p_arr, p_val, p_is = _unused("float32", 1, x), 1.0, False
        flags = _R_TOP_K | (_R_K_ARR if k_is else 0)
    else:
        p_arr, p_val, p_is = _param("top_p", top_p, batch, x, False, 0.0, 1.0, True, rows=name)
        k_arr, k_val = _unused("int32", 1, x), 0
        flags = _R_P_ARR if p_is else 0
    out = arrays.empty((batch, vocab), kind, like=x)
    if batch:
        stream = arrays.launch_stream(stream, x)
        if name == "logits":
            launch("sampling_top_k_mask_logits" + arrays.kernel_suffix(kind), (batch,), (NT,), x.reshape(-1), out.reshape(-1),
                   k_arr, vocab, flags & _R_K_ARR, int(k_val), stream=stream, backend=backend)
        else:
            launch("sampling_renorm_probs" + arrays.kernel_suffix(kind), (batch,), (NT,), x.reshape(-1),
                   out.reshape(-1), k_arr, p_arr, vocab, flags, int(k_val), float(p_val), stream=stream,
                   backend=backend)
    return out


def top_k_renorm_probs(probs: Any, top_k: Any, is_deterministic: bool = False, *, stream: Any = None,
                       backend: str | None = None) -> Any:
    """probs with the entries below the k-th largest set to 0 and the rest divided by their sum.

    Ties with the k-th largest value are all kept. top_k = 0 or >= vocab returns probs unchanged.
    is_deterministic is accepted for FlashInfer compatibility (always deterministic)."""
    del is_deterministic
    if top_k is None:  # _renorm reads None as "the other filter"
        raise ArgumentTypeError("top_k: expected an int or an integer array, got None")
    return _renorm("probs", probs, top_k, None, stream, backend)


def top_p_renorm_probs(probs: Any, top_p: Any, is_deterministic: bool = False, *, stream: Any = None,
                       backend: str | None = None) -> Any:
    """probs restricted to the largest entries (whole tie groups) whose mass reaches top_p of the row's,
    renormalized; the rest 0."""
    del is_deterministic
    if top_p is None:
        raise ArgumentTypeError("top_p: expected a float or a float array, got None")
    return _renorm("probs", probs, None, top_p, stream, backend)


def top_k_mask_logits(logits: Any, top_k: Any, *, stream: Any = None, backend: str | None = None) -> Any:
    """logits with the entries below the k-th largest set to -inf (ties kept; top_k = 0 or >= vocab:
    unchanged). softmax of the result equals top_k_renorm_probs of softmax(logits)."""
    if top_k is None:
        raise ArgumentTypeError("top_k: expected an int or an integer array, got None")
    return _renorm("logits", logits, top_k, None, stream, backend)


# --------------------------------------------------------------------------- speculative sampling
def _counts(name: str, a: Any, batch: int, like: Any) -> Any:
    """An in/out (batch,) int32 count array, added into in place (FlashInfer's maybe_output_* arrays); None: zeros."""
    if a is None:
        return arrays.zeros((batch,), "int32", like=like)
    dt = arrays.dtype_name(a, name)
    if dt != "int32":
        raise ArgumentTypeError(f"{name}: expected an int32 array (the counts are added into it), got dtype {dt}")
    shp = arrays.shape_of(a)
    if shp != (batch,):
        raise ArgumentError(f"{name}: expected shape ({batch},), got {shp}")
    if not arrays.same_memory_kind(a, like):
        raise ArgumentError(f"{name}: expected an array on the device of draft_probs (it is written in place)")
    if arrays.contiguous(a) is not a:
        raise ArgumentError(f"{name}: expected a contiguous array (it is written in place)")
    return a


def chain_speculative_sampling(draft_probs: Any, draft_token_ids: Any, target_probs: Any,
                               maybe_output_accepted_token_num: Any = None,
                               maybe_output_emitted_draft_token_num: Any = None, deterministic: bool = True,
                               generator: Any = None, seed: Any = None, offset: Any = None, *, stream: Any = None,
                               backend: str | None = None) -> tuple[Any, Any, Any]:
    """Rejection sampling of a chain of drafted tokens (FlashInfer's chain_speculative_sampling).

    draft_probs (batch, n, vocab), draft_token_ids (batch, n) int32 / int64, target_probs (batch, n + 1, vocab),
    the two probability arrays of one dtype (f32, bf16, f16). Draft token i is accepted with probability
    min(1, p_i(x_i) / q_i(x_i)) (p target, q draft); at the first rejection the token is drawn from
    max(0, p_i - q_i) renormalized, and after n acceptances a bonus token from p_n: the emitted tokens follow the
    target model. Returns (output_token_ids (batch, n + 1) int32, the emitted tokens then -1,
    output_accepted_token_num, output_emitted_draft_token_num): (batch,) int32, the number of draft tokens that
    pass their test each on its own (tests after the first rejection still count), and the number emitted before
    the first rejection (the bonus / resampled token not included). The maybe_output_* arrays, when given (int32,
    on the probabilities' device), have the counts added into them in place and are returned. Decisions are
    integer arithmetic over one Philox4x32-10 word each (counter (offset, b, i), i <= n; kernels_cu/sampling.cu):
    the same inputs and seed give the same tokens on every backend. deterministic is accepted for FlashInfer
    compatibility (always deterministic).
    """
    from ..launcher import launch

    del deterministic
    kind = arrays.io_kind("draft_probs", draft_probs, arrays.IO_KINDS)
    tkind = arrays.io_kind("target_probs", target_probs, arrays.IO_KINDS)
    if tkind != kind:
        raise ArgumentTypeError(f"target_probs: expected the dtype of draft_probs ({kind}), got {tkind}")
    batch, n, vocab = arrays.check_ndim("draft_probs", draft_probs, (3,), "(batch, num_speculate_tokens, vocab)")
    tshape = arrays.check_ndim("target_probs", target_probs, (3,), "(batch, num_speculate_tokens + 1, vocab)")
    if tuple(tshape) != (batch, n + 1, vocab):
        raise ArgumentError(f"target_probs: expected shape ({batch}, {n + 1}, {vocab}) (one row more than draft_probs "
                            f"a request), got {tuple(tshape)}")
    if vocab < 1 or vocab > MAX_VOCAB:
        raise ArgumentError(f"draft_probs: expected vocab in [1, {MAX_VOCAB}], got {vocab}")
    if batch > _INT_MAX or n >= _INT_MAX:
        raise ArgumentError(f"draft_probs: expected fewer than 2**31 requests and tokens, got shape {(batch, n)}")
    ishape = arrays.shape_of(draft_token_ids, "draft_token_ids")
    if tuple(ishape) != (batch, n):
        raise ArgumentError(f"draft_token_ids: expected shape ({batch}, {n}), got {tuple(ishape)}")
    idt = arrays.dtype_name(draft_token_ids, "draft_token_ids")
    if idt not in ("int32", "int64"):
        raise ArgumentTypeError(f"draft_token_ids: expected an int32 or int64 array, got dtype {idt}")
    draft_probs, target_probs = arrays.contiguous(draft_probs), arrays.contiguous(target_probs)
    if arrays.is_host(draft_token_ids):
        h = np.asarray(arrays.host_view(draft_token_ids))
        bad = (h < 0) | (h >= vocab)
        if bad.any():
            r, c = (int(x) for x in np.argwhere(bad)[0])
            raise ArgumentError(f"draft_token_ids: expected token ids in [0, {vocab}), got draft_token_ids[{r}, {c}]="
                                f"{int(h[r, c])}")
        h = np.ascontiguousarray(h, np.int32)
        ids = h if arrays.same_memory_kind(h, draft_probs) else arrays.to_like(h, draft_probs)
    else:  # device ids are trusted (no sync): the kernel rejects one outside the vocabulary
        if not arrays.same_memory_kind(draft_token_ids, draft_probs):  # a meta tensor, another device
            raise ArgumentTypeError(f"draft_token_ids: expected an array on the device of draft_probs, got "
                                    f"{type(draft_token_ids).__name__} on {getattr(draft_token_ids, 'device', '?')}")
        ids = arrays.contiguous(arrays.astype(draft_token_ids, "int32"))
    acc = _counts("maybe_output_accepted_token_num", maybe_output_accepted_token_num, batch, draft_probs)
    emit = _counts("maybe_output_emitted_draft_token_num", maybe_output_emitted_draft_token_num, batch, draft_probs)
    s, o = _seed_offset(seed, offset, generator, draft_probs)
    s_arr, s_val, s_is = _words("seed", s, batch, draft_probs)
    o_arr, o_val, o_is = _words("offset", o, batch, draft_probs)
    out = arrays.empty((batch, n + 1), "int32", like=draft_probs)
    if batch:
        launch("sampling_chain_speculative" + arrays.kernel_suffix(kind), (batch,), (NT,), draft_probs.reshape(-1),
               ids.reshape(-1), target_probs.reshape(-1), out.reshape(-1), acc, emit, s_arr, o_arr, n, vocab,
               (1 if s_is else 0) | (2 if o_is else 0), s_val & 0xFFFFFFFF, s_val >> 32, o_val & 0xFFFFFFFF,
               o_val >> 32, stream=arrays.launch_stream(stream, draft_probs), backend=backend)
    return out, acc, emit
