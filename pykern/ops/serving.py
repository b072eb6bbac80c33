"""Serving attention: paged KV cache with FlashInfer's conventions, KV append,
paged decode (plan/run), paged prefill (chunked prefill / append) and flash-attn varlen prefill.

Kernels in `kernels_cu/paged.cu`. Conventions (see the README's "Serving" section):

- Pages: `k_pages`, `v_pages` of shape (num_pages, page_size, num_kv_heads, head_dim) for
  kv_layout="NHD" (default) or (num_pages, num_kv_heads, page_size, head_dim) for "HND".
- A batch's pages in CSR form: sequence b owns pages kv_indices[kv_indptr[b]:kv_indptr[b+1]];
  its last page holds kv_last_page_len[b] tokens (1..page_size), so its length is
  (n_pages - 1) * page_size + kv_last_page_len[b]; a sequence with no pages has length 0.
- Indices are int32 on the device; any integer dtype is accepted and converted (NumPy
  index arrays are validated on the host: indptr monotone, indices in range,
  last_page_len in [1, page_size] for non-empty sequences).
- Causal masks are aligned bottom-right: the qo_len queries of a sequence are its last
  qo_len tokens; query i sees keys j <= kv_len - qo_len + i.
- Sliding windows and logit softcapping: FlashInfer's window_left / logits_soft_cap on the
  paged ops (query p = kv_len - qo_len + i sees keys p - window_left .. p, or .. the end when
  not causal), flash-attn's window_size=(left, right) / softcap on flash_attention_varlen.
  Only positions some row of a CTA sees are read: the cost follows the window.
- lse (return_lse=True) is the natural-log log-sum-exp of the scaled scores, (total_q,
  num_heads) float32, -inf for a row that sees no key (whose output is 0).
  FlashInfer returns base-2 lse: multiply ours by log2(e) to compare.

All query heads of a GQA group run in the CTA that loads their kv head's K/V tile, so each
K/V element is read and converted to fp32 once per kv head (and row chunk: decode with
group * head_dim > 2048 needs more than one chunk).
"""
from __future__ import annotations

import os
from typing import Any

import numpy as np

from .. import arrays
from ._window import (
    check_softcap as _check_softcap,
    check_window_left as _check_window_left,
    normalize_serving as _normalize_serving,
)
from ..errors import ArgumentError, ArgumentTypeError
from ._common import H100_SMS
from ._common import attention_scale as _scale, check_enable_pdl as _check_enable_pdl, index_array as _index
from ..arrays import flat_view as _flat
from .attention import flash_attention_varlen  # noqa: F401  (the attention family's; importable from here)
from ._attention_sm90 import try_paged_prefill as _sm90_paged
from ._prefill import (  # the paged kernels' argument checks, shared with the varlen attention fallback
    MAX_LEN as _MAX_LEN, NT as _NT, Q_KINDS as _Q_KINDS, SUFFIX as _SUFFIX, check_indptr as _check_indptr,
    check_q as _check_q, dummy as _dummy, prefill_out as _prefill_out, row_chunks as _row_chunks,
    suffix as _suffix,
)
from ._decode_waves import cta_rate as _cta_rate
from ._decode_waves import persistent_items as _persistent_items
from ._decode_waves import split_time as _split_time
from ._decode_waves import wave_splits as _wave_splits
from ._kvcache import (
    FP8 as _FP8,
    KV_DTYPE_NAMES as _KV_DTYPE_NAMES,
    check_scale as _check_scale,
    is_combined as _is_combined,
    kv_kind as _kv_kind,
    page_view as _page_view,
    shift_combined as _shift_combined,
    split_cache as _split_cache,
)

__all__ = [
    "append_paged_kv_cache",
    "paged_decode_attention",
    "PagedDecodePlan",
    "paged_prefill_attention",
    "get_batch_indices_positions",
    "attn_tiling",
]

LAYOUTS = ("NHD", "HND")
MAX_HEAD_DIM = 256
_MAX_ACC = 16  # PA_MAX_ACC: rows * head_dim <= 2048
_SMEM_LIMIT = 48 * 1024  # static opt-in free on every arch
_GRID_YZ_MAX = 65535
_MIN_SPLIT = 64  # positions a split at least (as decode's split_k chunks)
_KV_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "e4m3": 1, "e5m2": 1}

# Tensor-core decode (kernels_cu/decode_tc.cu): the GQA group's query rows, padded to 16, are the M
# dimension of mma.sync m16n8k16, so one HMMA serves every head of the group (the scalar path redoes each
# dot product per head and is issue-bound). Picked for 16-bit q with K/V of q's type or FP8 (widened to
# q's type in registers), 1 <= group <= 16 (a tile costs the same whatever the group, so even MHA gains),
# head_dim 64 / 128, no softcap, 16-byte aligned pages; paged_attn otherwise.
TC_DECODE_HEAD_DIMS = (64, 128)
TC_DECODE_MIN_GROUP, TC_DECODE_MAX_GROUP = 1, 16
DTC_BC = 64  # keys a tile (DTC_BC in decode_tc.cu)
_DTC_STAGES = {(64, 2): 3, (128, 2): 2, (64, 1): 3, (128, 1): 3}  # DtcCfg<D, FP8>::STAGES by (D, K/V bytes)
_TC_SUFFIX = {"bf16": "_bf16", "f16": "_f16"}
_SM_SHARED = 228 * 1024  # shared memory an SM (sm_90; the split count only)


def dtc_stages(d: int, kv_bytes: int = 2) -> int:
    """Ring slots of the tensor-core decode kernel (DtcCfg<D, FP8>::STAGES)."""
    return _DTC_STAGES[(d, kv_bytes)]


def dtc_smem_bytes(d: int, kv_bytes: int = 2) -> int:
    """DTC_SMEM_BYTES: the K/V ring (stages x (K, V) x 64 rows of d * kv_bytes + 16 bytes), then Q (16 rows of
    d + 8 halves) or, for FP8 (which keeps Q in registers), the end-of-item merge rows of two warps (2 x 16 rows
    of d + 8 floats, the bytes of 4 x 16 rows of d + 8 halves)."""
    ring = dtc_stages(d, kv_bytes) * 2 * DTC_BC * (d * kv_bytes + 16)
    return ring + (4 if kv_bytes == 1 else 1) * 16 * (d + 8) * 2


def dtc_inflight_bytes(d: int, kv_bytes: int = 2, tiles: int | None = None) -> int:
    """HBM bytes a tensor-core decode CTA keeps in flight: its ring's STAGES - 1 tiles of 64 keys of K and V
    (fewer when the CTA has fewer tiles). pykern/ops/_decode_waves.py turns it into a streaming rate."""
    n = dtc_stages(d, kv_bytes) - 1
    return (n if tiles is None else min(tiles, n)) * 2 * DTC_BC * d * kv_bytes


def tc_decode_eligible(q_kind: str, kv_kind: str, group: int, head_dim: int, softcap: float) -> bool:
    """Whether the tensor-core decode kernel covers this shape (alignment and the backend are checked at run)."""
    return (q_kind in _TC_SUFFIX and kv_kind in (q_kind, *_FP8)
            and TC_DECODE_MIN_GROUP <= group <= TC_DECODE_MAX_GROUP
            and head_dim in TC_DECODE_HEAD_DIMS and softcap == 0.0)


def tc_decode_addressable(kv_kind: str, kf: Any, vf: Any, strides: tuple[int, ...], backend: str | None,
                          q: Any = None, out: Any = None) -> bool:
    """Whether the tensor-core decode kernel can read these K/V arrays (and q, when given) and write out (when
    given): it copies 16-byte chunks only, so element strides must be whole 16-byte multiples and the bases
    (q's too: its rows are copied as 16-byte chunks) 16-byte aligned, and it stores out 16 bytes at a time
    (out's base 16-byte aligned); and it needs sm_80+ (the nvrtc backend's arch). Anything else runs
    paged_attn / dense_attn with the same workspaces."""
    if any(s % (16 // _KV_BYTES.get(kv_kind, 2)) for s in strides):
        return False
    if not arrays.aligned16(*(a for a in (kf, vf, q, out) if a is not None)):
        return False
    from .attention import tensor_cores_available

    return tensor_cores_available(backend)


# --------------------------------------------------------------------------- shared helpers
def attn_tiling(head_dim: int, packed_rows: int, kv_bytes: int = 4) -> tuple[int, int, int]:
    """(rows, tile, shared bytes) of the tile kernel for head_dim, at most `packed_rows` rows a sequence
    and K/V elements of kv_bytes (4 f32, 2 bf16 / f16, 1 fp8; 4, the default, bounds the others).

    rows * head_dim <= 2048 (16 fp32 accumulators a thread at 128 threads); the K/V tile
    is the largest power of two <= 64 that keeps shared memory within 48 KiB.
    """
    head_dim = arrays.check_int("head_dim", head_dim, 1, _NT * _MAX_ACC)
    packed_rows = arrays.check_int("packed_rows", packed_rows, 1, 2**31 - 1)
    kv_bytes = arrays.check_int("kv_bytes", kv_bytes, 1, 4)
    if kv_bytes == 3:
        raise ArgumentError("kv_bytes: expected 1 (fp8), 2 (bf16 / f16) or 4 (f32), got 3")
    rows = max(1, min(64, (_NT * _MAX_ACC) // head_dim, max(1, packed_rows)))
    tile = 64
    while tile > 1 and _smem_bytes(head_dim, rows, tile, kv_bytes) > _SMEM_LIMIT:
        tile //= 2
    return rows, tile, _smem_bytes(head_dim, rows, tile, kv_bytes)


PA_STAGES = 2  # PA_STAGES in kernels_cu/pk_attn_tile.cuh: slots of the K/V cp.async ring


def _row_bytes(d: int, kv_bytes: int) -> int:
    """pa_row_bytes: a K/V row in shared memory, in its cache type, padded to 16 bytes plus 16."""
    return (d * kv_bytes + 15) // 16 * 16 + 16


def _smem_bytes(d: int, rows: int, tile: int, kv_bytes: int = 4) -> int:
    ring = PA_STAGES * 2 * tile * _row_bytes(d, kv_bytes)
    return ring + 4 * (rows * d + rows * tile + 3 * rows)


def _layout(kv_layout: Any) -> int:
    if kv_layout not in LAYOUTS:
        raise ArgumentError(f"kv_layout: expected one of {LAYOUTS}, got {kv_layout!r}")
    return LAYOUTS.index(kv_layout)


class _PageTable:
    """Validated CSR page table: int32 device arrays and, for host arrays, the sequence lengths."""

    def __init__(self, kv_indptr: Any, kv_indices: Any, kv_last_page_len: Any, batch: int | None, num_pages: int,
                 page_size: int, batch_of: str = "") -> None:
        # batch_of: where a given batch comes from (q's rows, the plan, qo_indptr), for kv_indptr's shape error
        self.indptr, ip = _index("kv_indptr", kv_indptr, None if batch is None else batch + 1,
                                 f"{batch_of} + 1" if batch_of else "")
        if batch is None:
            batch = arrays.shape_of(self.indptr)[0] - 1
            if batch < 0:
                raise ArgumentError("kv_indptr: expected shape (batch + 1,), got (0,)")
        self.batch = batch
        self.indices, ii = _index("kv_indices", kv_indices, None)
        self.last, il = _index("kv_last_page_len", kv_last_page_len, batch, "one per sequence of kv_indptr")
        nnz = arrays.shape_of(self.indices)[0]
        _check_indptr("kv_indptr", ip, nnz, "len(kv_indices)")
        self.lens: np.ndarray | None = None
        if ip is not None and ii is not None and il is not None:
            used = ii[int(ip[0]):int(ip[-1])] if ip.size else ii[:0]
            if used.size and (int(used.min()) < 0 or int(used.max()) >= num_pages):
                bad = int(used[(used < 0) | (used >= num_pages)][0])
                raise ArgumentError(f"kv_indices: expected page indices in [0, {num_pages}) (num_pages of "
                                    f"k_pages), got {bad}")
            npages = np.diff(ip.astype(np.int64))
            nonempty = npages > 0
            bad = nonempty & ((il < 1) | (il > page_size))
            if bad.any():
                b = int(np.argmax(bad))
                raise ArgumentError(f"kv_last_page_len: expected 1 <= kv_last_page_len[b] <= page_size={page_size} "
                                    f"for a sequence with pages, got kv_last_page_len[{b}]={int(il[b])}")
            self.lens = np.where(nonempty, (npages - 1) * page_size + il, 0)
            if self.lens.size and int(self.lens.max()) > _MAX_LEN:
                raise ArgumentError(f"kv_indptr: expected sequences of at most 2**30 tokens, got "
                                    f"{int(self.lens.max())}")


def _pages_shape(k_pages: Any, v_pages: Any, layout: int, narrower_v: bool = False) -> tuple[str, int, int, int, int]:
    """(kind, num_pages, page_size, num_kv_heads, head_dim) of a K / V cache pair. narrower_v: v_pages may hold
    fewer columns a row than k_pages (head_dim_v <= head_dim, paged_prefill_attention's DeepSeek-V3 shape)."""
    kind = _kv_kind("k_pages", k_pages)
    if _kv_kind("v_pages", v_pages) != kind:
        raise ArgumentTypeError(f"v_pages: expected the dtype of k_pages ({arrays.dtype_name(k_pages)}), got "
                                f"{arrays.dtype_name(v_pages)}")
    lay = "(num_pages, page_size, num_kv_heads, head_dim) (kv_layout='NHD')" if layout == 0 else \
        "(num_pages, num_kv_heads, page_size, head_dim) (kv_layout='HND')"
    ks = arrays.check_ndim("k_pages", k_pages, (4,), lay)
    vs = arrays.check_ndim("v_pages", v_pages, (4,), lay)
    if narrower_v and vs[:3] == ks[:3] and 1 <= vs[3] <= ks[3]:
        pass  # head_dim_v <= head_dim
    elif narrower_v:
        raise ArgumentError(f"v_pages: expected the shape of k_pages {ks} with a last dimension (head_dim_v) in "
                            f"[1, {ks[3]}], got {vs}")
    elif vs != ks:
        raise ArgumentError(f"v_pages: expected the shape of k_pages {ks}, got {vs}")
    if layout == 0:
        num_pages, page_size, kvh, d = ks
    else:
        num_pages, kvh, page_size, d = ks
    if page_size < 1 or kvh < 1 or not 1 <= d <= MAX_HEAD_DIM:
        lay = "(num_pages, page_size, num_kv_heads, head_dim)" if layout == 0 else \
            "(num_pages, num_kv_heads, page_size, head_dim)"
        raise ArgumentError(f"k_pages: expected {lay} with head_dim in [1, {MAX_HEAD_DIM}], got {ks}")
    return kind, num_pages, page_size, kvh, d


def _pages_views(k_pages: Any, v_pages: Any, layout: int, kind: str, writes: bool = False) -> tuple[Any, Any, tuple]:
    """Flat arrays over the pages' memory and their (s_page, s_tok, s_head) element strides (views as they are)."""
    raw = kind in _FP8
    kf, ks = _page_view("k_pages", k_pages, layout, raw, writes)
    vf, vs = _page_view("v_pages", v_pages, layout, raw, writes)
    if vs != ks:
        raise ArgumentError(f"v_pages: expected the strides of k_pages (page, token, head) {ks}, got {vs}")
    return kf, vf, ks


def _cache_positional(k_pages: Any, v_pages: Any, rest: tuple[Any, ...], kv_layout: Any, last_name: str) -> tuple:
    """(k_pages, v_pages, *rest) with FlashInfer's single paged_kv_cache form unpacked."""
    if not _is_combined(k_pages):
        if v_pages is None or rest[-1] is None:
            raise ArgumentError(f"{last_name}: missing (pass k_pages, v_pages or one paged_kv_cache)")
        return (k_pages, v_pages) + tuple(rest)
    k, v = _split_cache(k_pages, kv_layout if kv_layout in LAYOUTS else "NHD")
    a, b, tail = _shift_combined(k_pages, (v_pages,) + tuple(rest), last_name)
    return (k, v, a, b) + tuple(tail)


# --------------------------------------------------------------------------- append
@arrays.stream_scoped
def append_paged_kv_cache(
    k: Any,
    v: Any,
    batch_indices: Any,
    positions: Any,
    k_pages: Any,
    v_pages: Any = None,
    kv_indices: Any = None,
    kv_indptr: Any = None,
    kv_last_page_len: Any = None,
    *,
    kv_layout: str = "NHD",
    k_scale: float | None = None,
    v_scale: float | None = None,
    stream: Any = None,
    backend: str | None = None,
    enable_pdl: bool = False,
) -> None:
    """Write token t of k, v (nnz, num_kv_heads, head_dim) into the pages, in place (FlashInfer's append).

    Token t goes to position positions[t] of sequence batch_indices[t]: slot
    positions[t] % page_size of page kv_indices[kv_indptr[b] + positions[t] // page_size].
    The page table must already include the appended tokens (update kv_indptr,
    kv_indices and kv_last_page_len first): with host index arrays every position is
    checked to be below its sequence's length. A token with batch_indices[t] == -1 is padding
    (get_batch_indices_positions marks the tokens past append_indptr[-1] so on device arrays) and is
    skipped, as is, on device arrays (not checked on the host), any token whose sequence or page is out
    of range: such a token is never written to another sequence's slot.

    The pages: k_pages and v_pages, or FlashInfer's single `paged_kv_cache` in k_pages's place
    (a (k, v) pair, or one (pages, 2, ...) array whose [:, 0] / [:, 1] are K / V), followed
    directly by kv_indices, kv_indptr, kv_last_page_len. Views are written through (their
    strides reach the kernel); head_dim must be unit-stride.
    f32 / bf16 / f16 pages take k, v of their dtype (a bit copy). FP8 pages (float8_e4m3fn,
    float8_e5m2) take f32, bf16 or f16 k, v and store fp8(k / k_scale), fp8(v / v_scale) (vLLM's
    semantics: round to nearest even, saturate to the finite range, NaN stays NaN); the scales
    default to 1 and apply only to FP8 pages.

    enable_pdl: programmatic dependent launch on sm_90+ (nvrtc), as PagedDecodePlan.run: the kernel waits for
    the previous kernel of the stream before it reads, and lets a PDL decode launched next start early.
    """
    _check_enable_pdl(enable_pdl)
    k_pages, v_pages, kv_indices, kv_indptr, kv_last_page_len = _cache_positional(
        k_pages, v_pages, (kv_indices, kv_indptr, kv_last_page_len), kv_layout, "kv_last_page_len")
    layout = _layout(kv_layout)
    kind, num_pages, page_size, kvh, d = _pages_shape(k_pages, v_pages, layout)
    if kind in _FP8:
        in_kind = arrays.io_kind("k", k, _Q_KINDS)
        arrays.same_kind("v", v, in_kind, "k")
        name = "paged_append_kv" + arrays.kernel_suffix(in_kind) + "_" + kind
    else:
        arrays.same_kind("k", k, kind, "k_pages")
        arrays.same_kind("v", v, kind, "k_pages")
        name = "paged_append_kv" + arrays.kernel_suffix(kind)
        for nm, sc in (("k_scale", k_scale), ("v_scale", v_scale)):
            if sc is not None and _check_scale(nm, sc) != 1.0:
                raise ArgumentError(f"{nm}: scales apply to FP8 pages only; got {sc!r} for {kind} pages")
    ksc, vsc = _check_scale("k_scale", k_scale), _check_scale("v_scale", v_scale)
    ks = arrays.check_ndim("k", k, (3,), "(nnz, num_kv_heads, head_dim)")
    if ks[1:] != (kvh, d):
        raise ArgumentError(f"k: expected shape (nnz, {kvh}, {d}) (from k_pages), got {ks}")
    if arrays.shape_of(v) != ks:
        raise ArgumentError(f"v: expected the shape of k {ks}, got {arrays.shape_of(v)}")
    nnz = ks[0]
    if kvh * d >= 2**31:
        raise ArgumentError(f"k_pages: expected num_kv_heads * head_dim < 2**31, got {kvh * d}")
    table = _PageTable(kv_indptr, kv_indices, kv_last_page_len, None, num_pages, page_size)
    bi, hb = _index("batch_indices", batch_indices, nnz, "one per token of k")
    pos, hp = _index("positions", positions, nnz, "one per token of k")
    # batch index -1 marks a padding token (get_batch_indices_positions' mark on device arrays): skipped
    real = None if hb is None else hb != -1
    if hb is not None and nnz and (int(hb.min()) < -1 or int(hb.max()) >= table.batch):
        bad = int(np.argmax((hb < -1) | (hb >= table.batch)))
        raise ArgumentError(f"batch_indices: expected values in [0, {table.batch}) (batch from kv_indptr), or -1 "
                            f"for a padding token, got batch_indices[{bad}]={int(hb[bad])}")
    if hp is not None and nnz:
        hp_real = hp if real is None else hp[real]
        if hp_real.size and int(hp_real.min()) < 0:
            t = int(np.argmax((hp < 0) & (True if real is None else real)))
            raise ArgumentError(f"positions: expected values >= 0, got positions[{t}]={int(hp[t])}")
        if hb is not None and table.lens is not None and real.any():
            over = real & (hp >= table.lens[np.maximum(hb, 0)])
            if over.any():
                t = int(np.argmax(over))
                raise ArgumentError(
                    f"positions: expected positions[t] < the length of sequence batch_indices[t] (from the page "
                    f"table), got positions[{t}]={int(hp[t])} for sequence {int(hb[t])} of length "
                    f"{int(table.lens[hb[t]])}")
    # The destination views (checked before anything is launched; written through, never copied).
    kf, vf, (s_page, s_tok, s_head) = _pages_views(k_pages, v_pages, layout, kind, writes=True)
    if nnz == 0:
        return
    from ..launcher import launch

    k, v = arrays.contiguous(k), arrays.contiguous(v)
    launch(name, (nnz,), (_NT,), _flat(k), _flat(v), bi, pos, kf, vf, table.indices, table.indptr, table.batch, kvh,
           d, page_size, s_page, s_tok, s_head, ksc, vsc, stream=arrays.launch_stream(stream, k), backend=backend,
           pdl=enable_pdl)


def _host_ints(name: str, a: Any) -> np.ndarray | None:
    """An int64 NumPy copy of a host integer array (a list, NumPy, a CPU tensor), else None (device memory)."""
    if isinstance(a, (list, tuple)):
        a = np.asarray(a) if len(a) else np.zeros(0, np.int64)
    h = arrays.host_array_view(a)
    if h is None:
        return None
    if h.dtype.kind not in "iu":
        raise ArgumentTypeError(f"{name}: expected an integer array, got dtype {h.dtype}")
    return h.astype(np.int64)


@arrays.stream_scoped
def get_batch_indices_positions(append_indptr: Any, seq_lens: Any, nnz: int, *, stream: Any = None,
                                backend: str | None = None) -> tuple[Any, Any]:
    """(batch_indices, positions) int32 of nnz appended tokens (FlashInfer's helper).

    Sequence b appends append_indptr[b+1] - append_indptr[b] tokens that become the last
    tokens of its seq_lens[b] (the length after the append): token t of that range gets
    batch index b and position seq_lens[b] - (append_indptr[b+1] - t).

    Host arrays (lists, NumPy, CPU tensors) are checked and the result is NumPy: append_indptr
    non-decreasing from 0, nnz == append_indptr[-1], and each seq_lens[b] >= 0 and at least the tokens
    appended to b (no negative position). Device arrays are not read on the host (no sync): a kernel
    (paged_batch_indices_positions) fills arrays of their kind, and tokens the indptr does not cover
    (t >= append_indptr[-1], e.g. nnz padded to a CUDA graph's size) or whose position would be negative
    get batch index -1 and position -1, which append_paged_kv_cache skips. (FlashInfer leaves such tokens
    uninitialized.)
    """
    if isinstance(nnz, bool) or not isinstance(nnz, (int, np.integer)) or int(nnz) < 0:
        raise ArgumentError(f"nnz: expected an int >= 0, got {nnz!r}")
    nnz = int(nnz)
    arrays.check_u32("nnz", nnz)
    ip, sl = _host_ints("append_indptr", append_indptr), _host_ints("seq_lens", seq_lens)
    if ip is not None and sl is not None:
        if ip.ndim != 1 or ip.shape[0] < 1:
            raise ArgumentError(f"append_indptr: expected shape (batch + 1,), got {ip.shape}")
        batch = ip.shape[0] - 1
        if sl.shape != (batch,):
            raise ArgumentError(f"seq_lens: expected shape ({batch},) (batch from append_indptr), got {sl.shape}")
        if int(ip[0]) != 0:
            raise ArgumentError(f"append_indptr: expected append_indptr[0] == 0, got {int(ip[0])}")
        _check_indptr("append_indptr", ip, int(ip[-1]), "append_indptr[-1]")
        if nnz != int(ip[-1]):
            # a larger nnz would leave tokens that belong to no sequence: FlashInfer leaves them uninitialized,
            # and zeros would append them to sequence 0 at position 0, over its first token
            raise ArgumentError(f"nnz: expected append_indptr[-1]={int(ip[-1])} (the appended tokens), got {nnz}")
        n_app = np.diff(ip)
        if sl.size and int(sl.min()) < 0:
            b = int(np.argmax(sl < 0))
            raise ArgumentError(f"seq_lens: expected lengths >= 0, got seq_lens[{b}]={int(sl[b])}")
        short = sl < n_app
        if short.any():
            b = int(np.argmax(short))
            raise ArgumentError(f"seq_lens: expected seq_lens[b] >= the tokens appended to sequence b "
                                f"(append_indptr[b+1] - append_indptr[b], the length includes them), got "
                                f"seq_lens[{b}]={int(sl[b])} for {int(n_app[b])} appended tokens")
        if sl.size and int(sl.max()) > _MAX_LEN:
            raise ArgumentError(f"seq_lens: expected lengths of at most 2**30, got {int(sl.max())}")
        bi = np.repeat(np.arange(batch, dtype=np.int32), n_app)
        pos = (np.arange(nnz, dtype=np.int64) - np.repeat(ip[1:], n_app) + np.repeat(sl, n_app)).astype(np.int32)
        return bi, pos
    if ip is not None or sl is not None:
        host, dev = ("append_indptr", "seq_lens") if ip is not None else ("seq_lens", "append_indptr")
        raise ArgumentTypeError(f"{host}: expected device memory like {dev}, got a host array")
    ipd, _ = _index("append_indptr", append_indptr, None)
    batch = arrays.shape_of(ipd)[0] - 1
    if batch < 0:
        raise ArgumentError("append_indptr: expected shape (batch + 1,), got (0,)")
    sld, _ = _index("seq_lens", seq_lens, batch)
    bi = arrays.empty((nnz,), "int32", like=ipd)
    pos = arrays.empty((nnz,), "int32", like=ipd)
    if nnz:
        from ..launcher import launch

        launch("paged_batch_indices_positions", (-(-nnz // _NT),), (_NT,), ipd, sld, bi, pos, batch, nnz,
               stream=arrays.launch_stream(stream, ipd), backend=backend)
    return bi, pos


# --------------------------------------------------------------------------- decode
_PLAIN = (type(None), bool, int, float, str)


def _array_key(a: Any) -> Any:
    """What a step's use of device array `a` depends on: its identity, address, shape, strides, dtype and
    device; None (not memoizable) for host arrays, lists and anything else (their contents are checked)."""
    if a is None:
        return ()
    if arrays.is_torch(a):
        if not a.is_cuda:
            return None
        return id(a), a.data_ptr(), tuple(a.shape), a.stride(), a.dtype, a.get_device()
    if type(a) is np.ndarray or isinstance(a, (np.ndarray, list, tuple)):
        return None
    cai = getattr(a, "__cuda_array_interface__", None)
    if cai is None:
        return None
    return id(a), type(a), _frozen(cai)  # shape, typestr, data (address, read-only), strides, stream: all of it


def _frozen(x: Any) -> Any:
    """x with dicts and lists made tuples (a memo key must be hashable: the memo is a dict keyed by the pages')."""
    if isinstance(x, dict):
        return tuple(sorted((k, _frozen(v)) for k, v in x.items()))
    if isinstance(x, (list, tuple)):
        return tuple(_frozen(v) for v in x)
    return x


def _run_key(q: Any, k_pages: Any, v_pages: Any, indptr: Any, indices: Any, last: Any, out: Any, scale: Any,
             k_scale: Any, v_scale: Any, return_lse: Any, backend: Any, enable_pdl: Any = False) -> tuple | None:
    """PagedDecodePlan.run's memo key, or None when the call cannot be memoized."""
    scalars = (scale, k_scale, v_scale, return_lse, backend, enable_pdl,
               os.environ.get("PYKERN_BACKEND") if backend is None else None)  # what backend=None resolves to
    if any(type(x) not in _PLAIN for x in scalars):
        return None
    keys = []
    for a in (q, k_pages, v_pages, indptr, indices, last, out):
        k = _array_key(a)
        if k is None:
            return None
        keys.append(k)
    return (*scalars, *keys)


# Page arrays (KV caches: one a layer) whose last step a PagedDecodePlan memoizes at once.
_MEMO_CACHES = 256


def _memo_put(memos: dict, pkey: Any, entry: Any) -> None:
    """Store (or refresh) the memo of the page arrays keyed `pkey`, most recent last. When a cache comes round again
    (a layer loop's next step), the entries not used since its previous use belong to no layer of the loop: they
    are dropped (they hold their arrays, so their memory is released), as is the oldest past _MEMO_CACHES."""
    if pkey in memos:
        while (old := next(iter(memos))) != pkey:
            del memos[old]
        del memos[pkey]
    memos[pkey] = entry
    while len(memos) > _MEMO_CACHES:
        del memos[next(iter(memos))]


class PagedDecodePlan:
    """Launch geometry and workspaces for paged decode at a fixed batch shape (FlashInfer's plan/run).

    The plan fixes the grid, the number of KV splits and allocates the output, lse and
    split partials once, next to `like` (NumPy by default). `run(...)` then launches with
    no allocation and no host work beyond argument checks, so a decode step can be
    captured in a CUDA graph. The returned arrays are the plan's own and are overwritten
    by the next run.

    num_splits: KV splits a sequence. Default: on the tensor-core kernel, when batch * num_kv_heads CTAs would
    not fill the SMs, the fewest (a power of two) whose one wave keeps HBM busy, and from there on 2 to 4 splits
    only where the grid's last wave would be too thin to stream at HBM speed (pykern/ops/_decode_waves.py); on
    paged_attn, enough CTAs for two waves below the SM count. Capped at 32 and at max_kv_len / 64.
    max_kv_len: the longest sequence the plan will see (bounds the split count).
    window_left (FlashInfer's name; -1 = unbounded): the query, the last position p of its
    sequence, sees keys p - window_left .. p; only those are read (splits divide that range).
    logits_soft_cap c > 0: scores become c * tanh(scale * q.k / c) (0 = off).
    tensor_cores: None (default) runs groups of 1..16 query heads a kv head with 16-bit q and K/V at head_dim 64 / 128
    on the tensor-core kernel (decode_tc.cu) where the backend has them; False keeps paged_attn.
    items_per_cta: the tensor-core kernel's work items (sequence, kv head, split) a CTA. Default: 1 (a CTA an
    item) up to one wave of CTAs; beyond it, a persistent grid of one wave (several consecutive items a CTA,
    streamed through one ring) where the wave model (pykern/ops/_decode_waves.py) has it faster.

    Split-KV on the tensor-core kernel is one launch: each split CTA writes its partial (o in q's dtype, lse
    fp32) to the plan's part_o / part_lse, takes a ticket from `counters[b * num_kv_heads + kv_head]`, and the CTA with the
    last ticket merges the group's partials and writes out (no merge launch; `launches()` has one entry).
    `counters` is an int32 workspace of batch * num_kv_heads zeros, allocated and zeroed once here; every
    launch leaves it zero (the last ticket wraps it back), so steps and CUDA-graph replays need no reset.
    paged_attn (tensor_cores=False, f32 q, other shapes, or unaligned pages at run time) still merges in a
    second launch (paged_attn_merge). A plan's workspaces (partials, counters, out, lse) serve one step at a
    time: two runs of one plan in flight at once (e.g. on two streams) would share them; give each stream a
    plan of its own.

    A run with the same device arrays as the plan's previous run over the same pages (the same objects, at the
    same addresses, with the same shapes, strides and dtypes; int32 index arrays on the device) and the same
    scalars launches the arguments that run checked and converted, skipping every check (a decode loop's steady
    state). The memo is kept per KV cache (page arrays), so one plan shared by a model's layers, each with its
    own cache, q and out, hits it for every layer from the second step on. For that the plan keeps a reference
    to each cache's previous run's arrays until that cache's next run with others, or until a cache comes round
    again and the caches not used since its previous run are dropped (at most 256 caches are kept), so their
    memory cannot be freed and reused under the same address meanwhile. Host index arrays are checked every
    run.
    """

    def __init__(self, batch: int, num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int, *,
                 kv_layout: str = "NHD", q_dtype: str = "f32", kv_dtype: str | None = None,
                 max_kv_len: int | None = None, num_splits: int | None = None, return_lse: bool = False,
                 num_sms: int = H100_SMS, window_left: int = -1, logits_soft_cap: float = 0.0,
                 tensor_cores: bool | None = None, items_per_cta: int | None = None, like: Any = None) -> None:
        for name, val, lo in (("batch", batch, 1), ("num_qo_heads", num_qo_heads, 1), ("num_kv_heads", num_kv_heads, 1),
                              ("head_dim", head_dim, 1), ("page_size", page_size, 1), ("num_sms", num_sms, 1)):
            if isinstance(val, bool) or not isinstance(val, (int, np.integer)) or int(val) < lo:
                raise ArgumentError(f"{name}: expected an int >= {lo}, got {val!r}")
        num_sms = arrays.check_int("num_sms", num_sms, 1, 2**20)
        if max_kv_len is not None:
            max_kv_len = arrays.check_int("max_kv_len", max_kv_len, 0, 2**31 - 1)
        if num_splits is not None:
            num_splits = arrays.check_int("num_splits", num_splits, 1, 2**31 - 1)
        if head_dim > MAX_HEAD_DIM:
            raise ArgumentError(f"head_dim: expected <= {MAX_HEAD_DIM}, got {head_dim}")
        if num_qo_heads % num_kv_heads:
            raise ArgumentError(f"num_kv_heads: expected a divisor of num_qo_heads={num_qo_heads}, got {num_kv_heads}")
        self.layout = _layout(kv_layout)
        self.kv_layout = kv_layout
        self.window_left = _check_window_left(window_left)
        self.logits_soft_cap = _check_softcap(logits_soft_cap, "logits_soft_cap")
        self._wl, self._wr = _normalize_serving(self.window_left, -1, True)
        kinds = {"f32": "f32", "float32": "f32", "bf16": "bf16", "bfloat16": "bf16", "f16": "f16", "float16": "f16"}
        if not isinstance(q_dtype, str) or q_dtype not in kinds:
            raise ArgumentError(f"q_dtype: expected 'f32', 'bf16' or 'f16', got {q_dtype!r}")
        self.q_kind = kinds[q_dtype]
        kvd = q_dtype if kv_dtype is None else kv_dtype
        if not isinstance(kvd, str) or kvd not in _KV_DTYPE_NAMES:
            raise ArgumentError(f"kv_dtype: expected 'f32', 'bf16', 'f16', 'float8_e4m3fn' or 'float8_e5m2', got "
                                f"{kv_dtype!r}")
        self.kv_kind = _KV_DTYPE_NAMES[kvd]
        self.suffix = _suffix(self.q_kind, self.kv_kind)
        self.batch, self.num_qo_heads, self.num_kv_heads = int(batch), int(num_qo_heads), int(num_kv_heads)
        self.head_dim, self.page_size = int(head_dim), int(page_size)
        if self.batch * self.num_kv_heads >= 2**31:
            raise ArgumentError(f"batch: expected batch * num_kv_heads < 2**31, got {self.batch * self.num_kv_heads}")
        if self.batch * self.num_qo_heads * self.head_dim >= 2**31:  # the plan's output, allocated here
            raise ArgumentError(f"num_qo_heads: expected batch * num_qo_heads * head_dim < 2**31, got "
                                f"{self.batch * self.num_qo_heads * self.head_dim}")
        group = num_qo_heads // num_kv_heads
        self.rows, self.tile, self.smem = attn_tiling(self.head_dim, group, _KV_BYTES[self.kv_kind])
        self.row_chunks = -(-group // self.rows)
        # The tensor-core kernel: one CTA per (sequence, kv head, split) as paged_attn here (the group fits
        # one row chunk at these head_dims), so the split count and workspaces serve both kernels.
        self.tensor_cores = tc_decode_eligible(self.q_kind, self.kv_kind, group, self.head_dim,
                                               self.logits_soft_cap) and tensor_cores is not False
        if self.tensor_cores:
            assert self.row_chunks == 1
            self.tc_smem = dtc_smem_bytes(self.head_dim, _KV_BYTES.get(self.kv_kind, 2))
        ctas = self.batch * self.num_kv_heads * self.row_chunks
        if items_per_cta is not None and (isinstance(items_per_cta, bool)
                                          or not isinstance(items_per_cta, (int, np.integer)) or int(items_per_cta) < 1):
            raise ArgumentError(f"items_per_cta: expected an int >= 1 or None, got {items_per_cta!r}")
        span = None if max_kv_len is None else (
            int(max_kv_len) if self.window_left < 0 else min(int(max_kv_len), self.window_left + 1))
        if self.tensor_cores:
            # CTAs an SM by shared memory, at most 3 by registers; a CTA's streaming rate by its ring's bytes.
            slots = num_sms * min(3, _SM_SHARED // (self.tc_smem + 1024))
            eb = _KV_BYTES[self.kv_kind]
            kv = 2 * (span or 32768) * self.head_dim * eb  # the K/V bytes of an unsplit item
            rate = _cta_rate(dtc_inflight_bytes(self.head_dim, eb))
            partial = group * (2 * self.head_dim + 4)  # a split item's partial o (q's type) and lse
        persist = 1  # with the default split count, its persistent choice (below); None: an explicit count
        if num_splits is None:
            cap = 32 if span is None else min(32, max(1, -(-span // _MIN_SPLIT)))
            s = 1 if ctas >= num_sms else min(32, -(-2 * num_sms // ctas))
            if self.tensor_cores:
                # Below the SM count: the fewest splits (a power of two) that stream as fast as any, enough CTAs
                # in one wave to keep HBM busy. A full wave or more: split only where the last wave holds too
                # few CTAs to stream at HBM speed (e.g. 512 CTAs on 396 slots leave a tail of 116). _decode_waves.
                s = min(cap, _wave_splits(ctas, slots, kv, partial, cap, dtc_inflight_bytes(self.head_dim, eb),
                                          below_sms=ctas < num_sms))
                if ctas > slots and items_per_cta is None:
                    # More than one wave: a persistent grid of one wave, unsplit, instead, where the model has it
                    # faster than that split count (_decode_waves.persistent_items).
                    persist = _persistent_items(ctas, slots, kv, rate, _split_time(ctas, slots, kv, partial, s, rate))
                    s = 1 if persist > 1 else s
            num_splits = min(s, cap)
        elif isinstance(num_splits, bool) or not isinstance(num_splits, (int, np.integer)) or \
                not 1 <= num_splits <= _GRID_YZ_MAX:
            raise ArgumentError(f"num_splits: expected an int in [1, {_GRID_YZ_MAX}], got {num_splits!r}")
        else:
            persist = None
        self.num_splits = int(num_splits)
        self.return_lse = bool(return_lse)
        self.grid = (self.batch * self.num_kv_heads, self.row_chunks, self.num_splits)
        # The tensor-core kernel's grid: one CTA an item (sequence, kv head, split), or a persistent grid of one
        # wave, items_per_cta consecutive items a CTA streamed through one ring, where the wave model
        # (_decode_waves.persistent_items) has it faster than the waves: by default only beyond one wave.
        items = ctas * self.num_splits
        if items >= 2**31:
            raise ArgumentError(f"num_splits: expected batch * num_kv_heads * num_splits < 2**31, got {items}")
        self.items_per_cta = 1
        if self.tensor_cores:
            if items_per_cta is not None:
                self.items_per_cta = min(int(items_per_cta), items)
            elif persist is not None:
                self.items_per_cta = persist
            else:  # an explicit split count: the model's choice over its items
                item = kv / self.num_splits + (2 * partial if self.num_splits > 1 else 0)
                self.items_per_cta = _persistent_items(items, slots, item, rate)
        self.tc_grid = (-(-items // self.items_per_cta), 1, 1)
        self.block = (_NT,)
        rows_total = self.batch * self.num_qo_heads
        self.out = arrays.empty((self.batch, self.num_qo_heads, self.head_dim), self.q_kind, like=like)
        self.lse = arrays.empty((self.batch, self.num_qo_heads), "f32", like=like)
        if self.num_splits > 1:
            # decode_tc stores its partial o in q's type (as FlashInfer's split-KV decode: half the bytes;
            # lse and the merge stay fp32); paged_attn and paged_attn_merge in fp32.
            self.part_o = arrays.empty((self.num_splits * rows_total * self.head_dim,),
                                       self.q_kind if self.tensor_cores else "f32", like=like)
            self.part_lse = arrays.empty((self.num_splits * rows_total,), "f32", like=like)
        else:
            # Unused at one split; a buffer of its own (never the lse: backends that copy
            # arguments back one by one would let the untouched copy win).
            self.part_lse = arrays.empty((1,), "f32", like=like)
            self.part_o = arrays.empty((1,), self.q_kind, like=like) if self.tensor_cores else self.part_lse
        self._part_o_f32 = None if self.tensor_cores else self.part_o
        self._out_flat, self._lse_flat = _flat(self.out), _flat(self.lse)
        self.dummy_idx = arrays.zeros((1,), "int32", like=self.out)  # a fill on the device: capturable
        # The split tickets of the tensor-core kernel, one a (sequence, kv head): zero here, zero after each launch.
        self.counters = arrays.zeros((self.batch * self.num_kv_heads if self.tensor_cores and self.num_splits > 1
                                      else 1,), "int32", like=self.out)
        self.merge_grid = (-(-rows_total // (_NT // 32)),)
        # run()'s last step as prepared launches, keyed by its arguments (see _run_key): a decode loop that
        # passes the same device arrays again skips every check and conversion.
        # Keyed by the page arrays (_array_key of k_pages, v_pages): a plan shared by layers keeps each layer's.
        self._memo: dict[Any, tuple] = {}
        self._pages_memo: dict[Any, tuple] = {}  # each page arrays' shape and flat views

    def launches(self) -> list[tuple[str, tuple[int, ...], tuple[int, ...], int]]:
        """(kernel, grid, block, shared bytes) of each launch of a step (the tensor-core kernel merges its splits
        in the same launch; paged_attn's splits take a paged_attn_merge launch)."""
        ls = [(self._attn_name(True), self.tc_grid if self.tensor_cores else self.grid, self.block,
               self.tc_smem if self.tensor_cores else self.smem)]
        if self.num_splits > 1 and not self.tensor_cores:
            ls.append((self._merge_name(), self.merge_grid, self.block, 0))
        return ls

    def _attn_name(self, tc: bool) -> str:
        if tc and self.tensor_cores:
            fp8 = f"_{self.kv_kind}kv" if self.kv_kind in _FP8 else ""
            return f"decode_tc_paged_d{self.head_dim}{fp8}{_TC_SUFFIX[self.q_kind]}"
        return "paged_attn" + self.suffix

    def _merge_name(self) -> str:
        return "paged_attn_merge" + arrays.kernel_suffix(self.q_kind)

    def _use_tc(self, kf: Any, vf: Any, strides: tuple[int, int, int], backend: str | None, q: Any,
                out: Any = None) -> bool:
        """The tensor-core kernel where the plan picked it and the arrays allow it (tc_decode_addressable)."""
        return self.tensor_cores and tc_decode_addressable(self.kv_kind, kf, vf, strides, backend, q, out)

    def _launch(self, q: Any, kf: Any, vf: Any, strides: tuple[int, int, int], indptr: Any, indices: Any, last: Any,
                res_flat: Any, sc: float, ksc: float, vsc: float, want_lse: bool, stream: Any,
                backend: str | None, record: list | None = None, page_size: int | None = None,
                pdl: bool = False) -> bool:
        """The launches of one step on checked arguments (flat K/V over the pages' memory and their element
        strides; int32 index arrays); the dense decode ops reuse it with one page a sequence. Returns
        whether the tensor-core kernel ran. `record`: a list that receives each launch as prepared
        (launcher.prepare) for `run` to launch again. `page_size`: the pages' size when it is not the plan's
        (the dense ops keep a plan for a range of cache lengths; at most the plan's). `pdl`: launch the
        tensor-core kernel with programmatic dependent launch (paged_attn and its merge launch as usual)."""
        from ..launcher import launch as _plain, launch_prepared, prepare

        def launch(name: str, grid: Any, block: Any, *args: Any, shared_mem: int = 0, stream: Any = None,
                   backend: str | None = None, pdl: bool = False) -> None:
            if record is None:
                _plain(name, grid, block, *args, shared_mem=shared_mem, stream=stream, backend=backend, pdl=pdl)
                return
            prep = prepare(name, grid, block, *args, shared_mem=shared_mem, pdl=pdl)
            record.append(prep)
            launch_prepared(prep, stream, backend)

        s_page, s_tok, s_head = strides
        h, kvh, d = self.num_qo_heads, self.num_kv_heads, self.head_dim
        page_size = self.page_size if page_size is None else page_size
        q = arrays.contiguous(q)
        stream = arrays.launch_stream(stream, q)
        tc = self._use_tc(kf, vf, strides, backend, q, res_flat)
        if tc:
            launch(self._attn_name(True), self.tc_grid, self.block, _flat(q), kf, vf, res_flat, self._lse_flat,
                   self.part_o, self.part_lse, self.counters, indptr, indices, last, h, kvh, page_size, s_page,
                   s_tok, s_head, self._wl, self.num_splits, self.batch, int(want_lse), sc, ksc, vsc,
                   self.items_per_cta, shared_mem=self.tc_smem, stream=stream, backend=backend, pdl=pdl)
        else:
            if self._part_o_f32 is None:  # a decode_tc plan whose pages it cannot address: paged_attn's fp32
                self._part_o_f32 = arrays.empty((self.part_o.shape[0],), "f32", like=self.part_o)  # partials
            launch(self._attn_name(False), self.grid, self.block, _flat(q), kf, vf,
                   res_flat, self._lse_flat, self._part_o_f32, self.part_lse, self.dummy_idx, indptr,
                   indices, last, h, kvh, d, page_size, s_page, s_tok, s_head, 0, self._wl, self._wr,
                   self.rows, self.tile, self.num_splits, self.batch, int(want_lse), sc, self.logits_soft_cap, ksc,
                   vsc, shared_mem=self.smem, stream=stream, backend=backend)
        if self.num_splits > 1 and not tc:  # the tensor-core kernel merges its splits in the same launch
            launch(self._merge_name(), self.merge_grid, self.block,
                   self._part_o_f32, self.part_lse, res_flat, self._lse_flat, self.batch * h, d,
                   self.num_splits, int(want_lse), stream=stream, backend=backend)
        return tc

    def run(self, q: Any, k_pages: Any, v_pages: Any = None, kv_indptr: Any = None, kv_indices: Any = None,
            kv_last_page_len: Any = None, *, scale: float | None = None, k_scale: float | None = None,
            v_scale: float | None = None, return_lse: bool | None = None, out: Any = None, stream: Any = None,
            backend: str | None = None, enable_pdl: bool = False) -> Any:
        """One decode step: out (batch, num_qo_heads, head_dim), or (out, lse) with return_lse.

        k_pages, v_pages or FlashInfer's single paged_kv_cache (see append_paged_kv_cache); views are
        read through their strides, never copied. K and V count as k_scale * K, v_scale * V (FP8
        caches' dequantization, applied in registers; default 1). out: a contiguous output to write
        instead of the plan's own (the tensor-core kernel stores 16 bytes at a time: an out off a 16-byte
        boundary runs paged_attn).

        enable_pdl (FlashInfer's name): launch the tensor-core kernel with programmatic dependent launch on
        sm_90+ GPUs (nvrtc backend), so its launch and its CTAs' start overlap the end of the previous
        kernel of the stream; the kernel waits for that kernel before it reads anything. Elsewhere, and
        for paged_attn, an ordinary launch.
        """
        _check_enable_pdl(enable_pdl)
        key = _run_key(q, k_pages, v_pages, kv_indptr, kv_indices, kv_last_page_len, out, scale, k_scale, v_scale,
                       return_lse, backend, enable_pdl)
        # The pages' shape and flat views depend on the page arrays' layout only: a new page table over the same
        # cache (a new step's index arrays) reuses them.
        pkey: Any = (_array_key(k_pages), _array_key(v_pages))
        if None in pkey:
            pkey = None
        memo = self._memo.get(pkey) if pkey is not None else None
        if memo is not None and key is not None and key == memo[0]:
            # The same arrays (same objects at the same addresses, shapes, strides and dtypes) and scalars as the
            # step the memo was made from: every check passed then and every launch argument is what it was.
            from ..launcher import launch_prepared

            st = arrays.launch_stream(stream, q)
            if all(launch_prepared(prep, st, backend) for prep in memo[1]):
                _memo_put(self._memo, pkey, memo)
                pm = self._pages_memo.get(pkey)
                if pm is not None:  # in step with the run memo: the caches left out of the loop go from both
                    _memo_put(self._pages_memo, pkey, pm)
                res = self.out if out is None else out
                return (res, self.lse) if memo[2] else res
        if memo is not None:  # other arrays or scalars over this cache, or a kernel's source changed: afresh
            del self._memo[pkey]
        args_in = (q, k_pages, v_pages, kv_indptr, kv_indices, kv_last_page_len, out)
        hit = self._pages_memo.get(pkey) if pkey is not None else None
        k_pages, v_pages, kv_indptr, kv_indices, kv_last_page_len = _cache_positional(
            k_pages, v_pages, (kv_indptr, kv_indices, kv_last_page_len), self.kv_layout, "kv_last_page_len")
        if hit is not None:
            _memo_put(self._pages_memo, pkey, hit)
            kind, num_pages, page_size, kvh, d = hit[1]
        else:
            kind, num_pages, page_size, kvh, d = _pages_shape(k_pages, v_pages, self.layout)
        if (kind, page_size, kvh, d) != (self.kv_kind, self.page_size, self.num_kv_heads, self.head_dim):
            raise ArgumentError(f"k_pages: expected {self.kv_kind} pages with page_size={self.page_size}, "
                                f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim} (the plan), got "
                                f"{kind} {arrays.shape_of(k_pages)} ({self.kv_layout})")
        qk, n, h = _check_q(q, kvh, d, "batch")
        if (qk, n, h) != (self.q_kind, self.batch, self.num_qo_heads):
            raise ArgumentError(f"q: expected {self.q_kind} ({self.batch}, {self.num_qo_heads}, {d}) (the plan), "
                                f"got {qk} {arrays.shape_of(q)}")
        table = _PageTable(kv_indptr, kv_indices, kv_last_page_len, self.batch, num_pages, page_size,
                           "the plan's batch")
        sc = _scale(scale, d)
        ksc, vsc = _check_scale("k_scale", k_scale), _check_scale("v_scale", v_scale)
        want_lse = self.return_lse if return_lse is None else bool(return_lse)
        res, res_flat = self.out, self._out_flat
        if out is not None:
            res = arrays.check_out(out, (self.batch, self.num_qo_heads, self.head_dim), self.q_kind, q)
            res_flat = _flat(res)
        if hit is not None:
            kf, vf, (s_page, s_tok, s_head) = hit[2]
        else:
            kf, vf, (s_page, s_tok, s_head) = _pages_views(k_pages, v_pages, self.layout, kind)
            if pkey is not None:  # holds the page arrays (args_in[1:3]): their memory stays theirs meanwhile
                _memo_put(self._pages_memo, pkey, (pkey, (kind, num_pages, page_size, kvh, d),
                                                   (kf, vf, (s_page, s_tok, s_head)), args_in[1:3]))
        # Memoized only where nothing of the step depends on array contents or on copies made here: device
        # index arrays passed as int32 (no host validation, no conversion) and q used in place (a strided CuPy
        # q is copied to a contiguous one each step: a memo would keep reading the first copy).
        record: list | None = None
        if (key is not None and table.indptr is kv_indptr and table.indices is kv_indices
                and table.last is kv_last_page_len
                and arrays.data_address(arrays.contiguous(q)) == arrays.data_address(q)):
            record = []
        self._launch(q, kf, vf, (s_page, s_tok, s_head), table.indptr, table.indices, table.last, res_flat, sc, ksc,
                     vsc, want_lse, stream, backend, record, pdl=enable_pdl)
        if record is not None:
            # The memo holds this step's arrays (args_in): while it does, their memory cannot be freed and
            # reused, so an object at the same address with the same layout is the same memory.
            _memo_put(self._memo, pkey, (key, record, want_lse, args_in))
        return (res, self.lse) if want_lse else res


@arrays.stream_scoped
def paged_decode_attention(
    q: Any,
    k_pages: Any,
    v_pages: Any = None,
    kv_indptr: Any = None,
    kv_indices: Any = None,
    kv_last_page_len: Any = None,
    *,
    kv_layout: str = "NHD",
    scale: float | None = None,
    k_scale: float | None = None,
    v_scale: float | None = None,
    window_left: int | None = None,
    logits_soft_cap: float | None = None,
    return_lse: bool = False,
    out: Any = None,
    plan: PagedDecodePlan | None = None,
    stream: Any = None,
    backend: str | None = None,
    enable_pdl: bool = False,
) -> Any:
    """Decode attention of q (batch, num_qo_heads, head_dim) over a paged KV cache.

    f32, bf16 or f16 q with K/V of q's dtype (or 16-bit K/V under f32 q); fp32 math. Returns
    out (batch, num_qo_heads, head_dim) in q's dtype, or (out, lse). A sequence with no
    pages gets zeros (lse -inf). Without `plan` a PagedDecodePlan is made for this call
    (splits from the longest sequence when the index arrays are on the host); pass one
    to reuse its geometry and workspaces (no allocation per step).

    window_left (-1 = unbounded) and logits_soft_cap (0 = off) as FlashInfer's plan(): the
    query sees the last window_left + 1 keys of its sequence, and only those are read. With
    `plan`, they are the plan's (None, the default, takes them; other values must match).

    Pages: k_pages, v_pages, or FlashInfer's single paged_kv_cache in k_pages's place (a (k, v)
    pair or one (pages, 2, ...) array) followed by the index arrays; views are read through their
    strides, never copied. FP8 pages (float8_e4m3fn / float8_e5m2) are dequantized in registers:
    K and V count as k_scale * K and v_scale * V (FlashInfer's / vLLM's names; default 1, any
    cache dtype). out: a contiguous output array to write (else one is allocated). enable_pdl: as
    PagedDecodePlan.run (programmatic dependent launch of the tensor-core kernel on sm_90+).
    """
    k_pages, v_pages, kv_indptr, kv_indices, kv_last_page_len = _cache_positional(
        k_pages, v_pages, (kv_indptr, kv_indices, kv_last_page_len), kv_layout, "kv_last_page_len")
    if plan is None:
        layout = _layout(kv_layout)
        kind, num_pages, page_size, kvh, d = _pages_shape(k_pages, v_pages, layout)
        qk, n, h = _check_q(q, kvh, d, "batch")
        table = _PageTable(kv_indptr, kv_indices, kv_last_page_len, n, num_pages, page_size, "the rows of q")
        max_len = int(table.lens.max()) if table.lens is not None and table.lens.size else None
        plan = PagedDecodePlan(n, h, kvh, d, page_size, kv_layout=kv_layout, q_dtype=qk, kv_dtype=kind,
                               max_kv_len=max_len, return_lse=return_lse,
                               window_left=-1 if window_left is None else window_left,
                               logits_soft_cap=0.0 if logits_soft_cap is None else logits_soft_cap, like=q)
    else:
        if kv_layout != plan.kv_layout:
            raise ArgumentError(f"kv_layout: expected the plan's {plan.kv_layout!r}, got {kv_layout!r}")
        if window_left is not None and _check_window_left(window_left) != plan.window_left:
            raise ArgumentError(f"window_left: expected the plan's {plan.window_left}, got {window_left!r}")
        if logits_soft_cap is not None and \
                _check_softcap(logits_soft_cap, "logits_soft_cap") != plan.logits_soft_cap:
            raise ArgumentError(f"logits_soft_cap: expected the plan's {plan.logits_soft_cap}, got {logits_soft_cap!r}")
    return plan.run(q, k_pages, v_pages, kv_indptr, kv_indices, kv_last_page_len, scale=scale, k_scale=k_scale,
                    v_scale=v_scale, return_lse=return_lse, out=out, stream=stream, backend=backend,
                    enable_pdl=enable_pdl)


# --------------------------------------------------------------------------- prefill


@arrays.stream_scoped
def paged_prefill_attention(
    q: Any,
    qo_indptr: Any,
    k_pages: Any,
    v_pages: Any = None,
    kv_indptr: Any = None,
    kv_indices: Any = None,
    kv_last_page_len: Any = None,
    *,
    causal: bool = True,
    kv_layout: str = "NHD",
    scale: float | None = None,
    k_scale: float | None = None,
    v_scale: float | None = None,
    window_left: int = -1,
    logits_soft_cap: float = 0.0,
    return_lse: bool = False,
    out: Any = None,
    stream: Any = None,
    backend: str | None = None,
) -> Any:
    """Chunked prefill / append attention over a paged KV cache (FlashInfer's batch prefill).

    q (total_q, num_qo_heads, head_dim); the queries of sequence b are rows
    qo_indptr[b]:qo_indptr[b+1] and are its last qo_len KV tokens (append the new
    tokens' K/V first). causal=True masks bottom-right: query i of a sequence sees
    keys j <= kv_len - qo_len + i (a query that sees no key gets zeros, lse -inf).
    window_left (FlashInfer's; -1 = unbounded) also hides keys j < kv_len - qo_len + i - window_left;
    logits_soft_cap c > 0 makes scores c * tanh(scale * q.k / c). Only the positions some query
    of a CTA sees are read, so the cost follows the window.
    Returns out (total_q, num_qo_heads, head_dim_v) in q's dtype, or (out, lse).
    Pages, k_scale / v_scale (FP8 caches) and out= as paged_decode_attention; v_pages may hold
    fewer columns than k_pages (head_dim_v <= head_dim, e.g. DeepSeek-V3's 192 / 128), its
    other dimensions those of k_pages.
    """
    from ..launcher import launch

    k_pages, v_pages, kv_indptr, kv_indices, kv_last_page_len = _cache_positional(
        k_pages, v_pages, (kv_indptr, kv_indices, kv_last_page_len), kv_layout, "kv_last_page_len")
    layout = _layout(kv_layout)
    kind, num_pages, page_size, kvh, d = _pages_shape(k_pages, v_pages, layout, narrower_v=True)
    d_v = arrays.shape_of(v_pages)[3]
    qk, total_q, h = _check_q(q, kvh, d, "total_q")
    suf = _suffix(qk, kind)
    qo, qh = _index("qo_indptr", qo_indptr, None)
    batch = arrays.shape_of(qo)[0] - 1
    if batch < 1:
        raise ArgumentError(f"qo_indptr: expected shape (batch + 1,) with batch >= 1, got {arrays.shape_of(qo)}")
    _check_indptr("qo_indptr", qh, total_q, "total_q", exact=True)
    table = _PageTable(kv_indptr, kv_indices, kv_last_page_len, batch, num_pages, page_size,
                       "the sequences of qo_indptr")
    sc = _scale(scale, d)
    wl, wr = _normalize_serving(_check_window_left(window_left), -1, bool(causal))
    cap = _check_softcap(logits_soft_cap, "logits_soft_cap")
    group = h // kvh
    max_qo = int(np.diff(qh.astype(np.int64)).max()) if qh is not None else total_q
    rows, tile, smem = attn_tiling(d, max_qo * group)
    chunks = _row_chunks("qo_indptr", max_qo, group, rows)
    if batch * kvh >= 2**31:
        raise ArgumentError(f"qo_indptr: expected batch * num_kv_heads < 2**31, got {batch * kvh}")
    ksc, vsc = _check_scale("k_scale", k_scale), _check_scale("v_scale", v_scale)
    if d_v == d:
        kf, vf, (s_page, s_tok, s_head) = _pages_views(k_pages, v_pages, layout, kind)
        v_strides: tuple[int, ...] = ()
    else:  # V pages at their own head dim: strides of their own (the sm_90a kernels' _dv form)
        kf, (s_page, s_tok, s_head) = _page_view("k_pages", k_pages, layout, kind in _FP8)
        vf, v_strides = _page_view("v_pages", v_pages, layout, kind in _FP8)
    q = arrays.contiguous(q)
    res, lse = _prefill_out(total_q, h, d_v, qk, q, qh is not None)
    if out is not None:
        res = arrays.check_out(out, (total_q, h, d_v), qk, q)
        if qh is None:  # rows outside qo_indptr are never written
            res[...] = 0
    # The FlashAttention-2 core (kernels_cu/attention_fwd_tc.cu, paged_prefill_tc_d*; geometry from ops/attention.py): bf16 or f16 q with a
    # cache of the same type, head_dim 64 / 128, power-of-two pages, 16-byte aligned data and strides; FP8
    # caches keep paged_attn.
    from . import attention as _attn  # at call time: the attention module imports this one's helpers

    n_qt = -(-max_qo // _attn.FA2_ROWS)
    # Hopper (sm_90a): the TMA + wgmma forward with a paged producer (16-bit caches of q's type and FP8 caches,
    # any page size); PYKERN_SM90=0 or any other GPU keeps the kernels below.
    if total_q and _sm90_paged(q, kf, vf, _flat(res), _flat(lse), qo, (table.indptr, table.indices, table.last),
                               (batch, max_qo, h, kvh, d, page_size, d_v), (s_page, s_tok, s_head, *v_strides),
                               (qk, kind), sc * ksc, cap, vsc, wl, wr, arrays.launch_stream(stream, q), backend):
        return (res, lse) if return_lse else res
    user_out = res
    if d_v != d:
        # The kernels below read K and V at one head_dim: V pages padded with zero columns to head_dim (zero columns
        # of out, dropped after; the scores and lse do not change), K pages contiguous so that both have one set of
        # strides. One more copy of the V cache (and of a strided K cache) and of out.
        k_pages, v_pages = arrays.contiguous(k_pages), arrays.pad_last(v_pages, d)
        kf, vf, (s_page, s_tok, s_head) = _pages_views(k_pages, v_pages, layout, kind)
        res = arrays.zeros((total_q, h, d), qk, like=q)
    fa2 = (total_q and qk == kind and kind in ("bf16", "f16") and page_size & (page_size - 1) == 0
           and all(x % 8 == 0 for x in (s_page, s_tok, s_head)) and _attn.fa2_eligible(d, d, q, kf, vf, res)
           and batch <= _GRID_YZ_MAX and n_qt * h < 2**31)
    if fa2:
        launch(f"paged_prefill_tc_d{d}{'_softcap' if cap > 0 else ''}_{qk}", (n_qt * h, batch, 1),
               (_attn.FA2_THREADS,), _flat(q), kf, vf, _flat(res), _flat(lse), qo, table.indptr, table.indices,
               table.last, h, kvh, page_size.bit_length() - 1, s_page, s_tok, s_head, sc * ksc, wl, wr, cap, vsc,
               shared_mem=_attn.fa2_shared_bytes(d), stream=arrays.launch_stream(stream, q), backend=backend)
    elif total_q:
        launch("paged_attn" + suf, (batch * kvh, chunks, 1), (_NT,), _flat(q), kf, vf,
               _flat(res), _flat(lse), _dummy(q), _dummy(q), qo, table.indptr, table.indices, table.last, h, kvh, d,
               page_size, s_page, s_tok, s_head, 1, wl, wr, rows, tile, 1, total_q, 1, sc, cap, ksc, vsc,
               shared_mem=smem, stream=arrays.launch_stream(stream, q), backend=backend)
    if res is not user_out:  # head_dim_v < head_dim: out is res's first head_dim_v columns
        if out is None:
            user_out = arrays.narrow_last(res, d_v)
        else:
            user_out[...] = arrays.narrow_last(res, d_v)
    return (user_out, lse) if return_lse else user_out
