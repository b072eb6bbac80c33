"""Multi-head latent attention (MLA, DeepSeek-V2 / V3) paged decode, in FlashInfer's
BatchMLAPagedAttentionWrapper plan / run convention. Kernels: kernels_cu/mla_sm90.cu (wgmma, 64 heads a CTA) on a
compute-capability 9.0 GPU and on the host backend with PYKERN_HOST_ARCH=sm_90a, kernels_cu/mla.cu (mma.sync, 16
heads a CTA) on sm_80 / sm_89 and everywhere else; the split merge is cascade.cu's merge_states.

Every query head attends to one latent KV shared by all heads: token t's key is [ckv[t] | kpe[t]] and its value
is ckv[t] itself, so with scores s = sm_scale * (q_nope . ckv + q_pe . kpe), out = softmax(s) . ckv.

- ckv_cache (num_pages, page_size, head_dim_ckv = 512), kpe_cache (num_pages, page_size, head_dim_kpe = 64),
  bf16 or f16 (q's dtype); views with a unit last stride and page / token strides of whole 16-byte chunks
  (e.g. the two slices of one (num_pages, page_size, 576) cache) are read in place.
- Request b owns pages kv_indices[kv_indptr[b]:kv_indptr[b+1]] and its first kv_len_arr[b] tokens are its keys
  (FlashInfer's MLA form: a length instead of a last-page length).
- Decode: one query a request, qo_indptr = arange(batch + 1); longer query rows are an error.
- q_nope (batch, num_heads, 512), q_pe (batch, num_heads, 64); out (batch, num_heads, 512) in q's dtype; lse
  (batch, num_heads) float32 is the natural-log log-sum-exp of the scaled scores (FlashInfer's MLA lse is base
  2: divide ours by ln 2 to compare), -inf with out 0 for an empty request.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from .. import arrays
from ..errors import ArgumentError, ArgumentTypeError
from ._kvcache import element_strides, strided_flat
from ._common import H100_SMS, index_array as _index, launch_warp_rows as _merge_launch

__all__ = ["MLAPagedDecodePlan"]

HEAD_DIM_CKV = 512
HEAD_DIM_KPE = 64
_BC = 32  # keys a tile (MLA_BC)
_THREADS = 128
_HEADS_CTA = 16  # heads a CTA: the M of mma.sync m16n8k16
# kernels_cu/mla.cu MLA_SMEM_BYTES: the 2-slot ring of 32 rows of 584 halves, then the S exchange (8 KB)
MLA_SMEM_BYTES = 2 * _BC * 584 * 2 + 4 * 4 * 32 * 16
# kernels_cu/mla_sm90.cu MLA90_SMEM_BYTES: Q (64 heads x 576, 72 KiB), the 2-slot ring of 64-key tiles (144 KiB),
# P (8 KiB), the rows' rescale factors, m and l, the mbarriers
MLA90_SMEM_BYTES = 64 * 576 * 2 + 2 * 64 * 576 * 2 + 64 * 128 + 3 * 64 * 4 + 64
_THREADS_SM90 = 384  # a producer warpgroup and two consumer warpgroups
_HEADS_CTA_SM90 = 64  # wgmma's M
_KINDS = {"bf16": "bf16", "bfloat16": "bf16", "f16": "f16", "float16": "f16"}
_MIN_SPLIT_KEYS = 256  # a split streams at least 8 tiles: fewer would pay the ring's fill and the merge for little
_MAX_SPLITS = 64
_GRID_YZ = 65535


def uses_sm90(backend: str | None = None, like: Any = None) -> bool:
    """Whether MLAPagedDecodePlan.run takes the wgmma kernel (mla_decode_sm90) on `backend` for arrays like
    `like`: on a compute-capability 9.0 GPU (nvrtc) or with PYKERN_HOST_ARCH=sm_90a (host); the mma.sync kernel
    elsewhere. No tensor map is involved (the producer gathers pages with cp.async), so host arrays staged by the
    launcher qualify too."""
    from ..backends import get_backend, kernel_variant
    from ..devices import array_device

    be = get_backend(backend)
    if be.name not in ("host", "nvrtc"):
        return False
    dev = array_device(like) if like is not None else 0
    return kernel_variant("sm_90a", be.name, dev if isinstance(dev, int) and dev >= 0 else 0)


def _kind(name: str, v: Any) -> str:
    if isinstance(v, str):
        key = v
    else:
        try:
            key = arrays.np_dtype_name(np.dtype(v))
        except TypeError:
            key = arrays.torch_dtype_name(v) if "torch" in type(v).__module__ else str(v)
    if key not in _KINDS:
        raise ArgumentTypeError(f"{name}: expected bfloat16 or float16 (the tensor-core kernel's types), got {v!r}")
    return _KINDS[key]


def _pos_int(name: str, v: Any, lo: int = 1) -> int:
    # the sizes reach the kernel (and the workspace shapes) as int: at most 2**31 - 1
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not lo <= int(v) <= 2**31 - 1:
        raise ArgumentError(f"{name}: expected an int in [{lo}, 2**31 - 1], got {v!r}")
    return int(v)


def _host_ints(name: str, a: Any, length: int | None, length_of: str = "") -> np.ndarray:
    """A host int32 copy of a plan index array (plan reads them on the host, as FlashInfer's plan does)."""
    if not isinstance(a, (list, tuple, np.ndarray)) and not arrays.is_host(a):
        a = _to_host(name, a)
    h = _index(name, a, length, length_of)[1]
    assert h is not None
    return h


def _to_host(name: str, a: Any) -> np.ndarray:
    if arrays.is_torch(a):
        if a.is_meta:  # no data to read
            from ..devices import meta_tensor

            raise meta_tensor(name)
        return a.detach().cpu().numpy()
    if hasattr(a, "get"):  # CuPy
        return a.get()
    if hasattr(a, "copy_to_host"):  # numba
        return a.copy_to_host()
    raise ArgumentTypeError(f"{name}: cannot read a {type(a).__name__} on the host")


def _cache(name: str, a: Any, kind: str, dim: int) -> tuple[Any, int, int, tuple[int, int]]:
    """(flat view, num_pages, page_size, (page stride, token stride) in elements) of a 3-D latent cache."""
    k = arrays.dtype_name(a, name)
    if k != arrays.IO_DTYPES[kind]:
        raise ArgumentTypeError(f"{name}: expected dtype {arrays.IO_DTYPES[kind]} (q_data_type / kv_data_type of "
                                f"the plan), got {k}")
    shp = tuple(arrays.shape_of(a, name))
    if len(shp) != 3 or shp[2] != dim:
        raise ArgumentError(f"{name}: expected shape (num_pages, page_size, {dim}) (the latent layout, head_dim "
                            f"{dim}), got {shp}")
    st = element_strides(name, a)
    if st[2] != 1:
        raise ArgumentError(f"{name}: expected a unit stride in the last dimension, got element strides {st}")
    if any(s < 0 or s % 8 for s, n in zip(st[:2], shp[:2]) if n > 1):
        raise ArgumentError(f"{name}: expected page and token strides of whole 16-byte chunks (multiples of 8 "
                            f"elements), got element strides {st}")
    flat = strided_flat(name, a, st, False)
    if not arrays.aligned16(flat):
        raise ArgumentError(f"{name}: expected a 16-byte aligned base address (the kernel copies 16-byte chunks)")
    return flat, shp[0], shp[1], (int(st[0]), int(st[1]))


class MLAPagedDecodePlan:
    """MLA paged decode (DeepSeek-V2 / V3 attention over a latent KV cache), FlashInfer's
    BatchMLAPagedAttentionWrapper: `plan(...)` once per batch shape (host work, workspaces), then `run(...)` each
    step with no allocation (CUDA-graph friendly). See the module docstring for the layouts.

    like: an array next to which the plan puts its workspaces and index arrays (NumPy by default; a torch CUDA
    tensor for the GPU). backend: the default backend of `run`.
    """

    def __init__(self, like: Any = None, backend: str | None = None) -> None:
        self.like = like
        self.backend = backend
        self._planned = False

    def plan(self, qo_indptr: Any, kv_indptr: Any, kv_indices: Any, kv_len_arr: Any, num_heads: int,
             head_dim_ckv: int = HEAD_DIM_CKV, head_dim_kpe: int = HEAD_DIM_KPE, page_size: int = 1,
             causal: bool = False, sm_scale: float | None = None, q_data_type: Any = "bf16",
             kv_data_type: Any = None, *, num_splits: int | None = None, num_sms: int = H100_SMS) -> None:
        """Fix the batch: index arrays (read on the host), the heads, the latent widths, the split count.

        qo_indptr: arange(batch + 1) (decode: one query a request). kv_indptr (batch + 1,), kv_indices, kv_len_arr
        (batch,): the page table and each request's length (at most its pages * page_size). num_heads >= 1
        (DeepSeek: 16 / 32 / 64 / 128 a tensor-parallel rank; a multiple of 16 fills every tensor-core row).
        head_dim_ckv / head_dim_kpe: 512 / 64, the only latent layout the kernel has. causal: accepted either
        way (one query sees every key of its request). sm_scale: the score scale, finite and > 0 (DeepSeek-V3:
        1 / sqrt(qk_nope_head_dim + qk_rope_head_dim) = 1 / sqrt(192), times its YaRN mscale^2). q_data_type /
        kv_data_type: bf16 or f16, the same (kv_data_type None: q's). num_splits: KV splits a request (None:
        enough CTAs for two a SM of num_sms, one a SM for the sm_90a kernel (`uses_sm90` with the plan's backend
        and `like`), while each split keeps >= 256 keys; at most 64).
        """
        if head_dim_ckv != HEAD_DIM_CKV:
            raise ArgumentError(f"head_dim_ckv: expected {HEAD_DIM_CKV} (the latent layout of the kernel), got "
                                f"{head_dim_ckv!r}")
        if head_dim_kpe != HEAD_DIM_KPE:
            raise ArgumentError(f"head_dim_kpe: expected {HEAD_DIM_KPE} (the latent layout of the kernel), got "
                                f"{head_dim_kpe!r}")
        h = _pos_int("num_heads", num_heads)
        ps = _pos_int("page_size", page_size)
        sms = _pos_int("num_sms", num_sms)
        if not isinstance(causal, (bool, np.bool_)):
            raise ArgumentTypeError(f"causal: expected a bool, got {causal!r}")
        if sm_scale is None or isinstance(sm_scale, bool) or not isinstance(
                sm_scale, (int, float, np.integer, np.floating)) or not (0 < float(sm_scale) < math.inf):
            # > 0: the kernel scales the masked scores (-inf) of a tile's keys past the range with it (a zero or
            # negative scale would make them NaN or +inf)
            raise ArgumentError(f"sm_scale: expected a finite float > 0 (DeepSeek: 1/sqrt(192) times mscale^2), "
                                f"got {sm_scale!r}")
        qk = _kind("q_data_type", q_data_type)
        kk = qk if kv_data_type is None else _kind("kv_data_type", kv_data_type)
        if kk != qk:
            raise ArgumentTypeError(f"kv_data_type: expected q_data_type's dtype ({arrays.IO_DTYPES[qk]}), got "
                                    f"{arrays.IO_DTYPES[kk]}")
        ip = _host_ints("kv_indptr", kv_indptr, None)
        batch = ip.shape[0] - 1
        if batch < 1:
            raise ArgumentError(f"kv_indptr: expected shape (batch + 1,) with batch >= 1, got {ip.shape}")
        qo = _host_ints("qo_indptr", qo_indptr, batch + 1, "batch + 1, the length of kv_indptr")
        if not np.array_equal(qo, np.arange(batch + 1)):
            raise ArgumentError(f"qo_indptr: expected arange(batch + 1) (decode: one query a request; longer query "
                                f"rows are not implemented), got {qo.tolist()[:8]}{'...' if qo.size > 8 else ''}")
        ii = _host_ints("kv_indices", kv_indices, None)
        lens = _host_ints("kv_len_arr", kv_len_arr, batch, "batch, from kv_indptr's length")
        if int(ip[0]) != 0 or (np.diff(ip.astype(np.int64)) < 0).any() or int(ip[-1]) > ii.shape[0]:
            raise ArgumentError(f"kv_indptr: expected non-decreasing from 0 to at most len(kv_indices)="
                                f"{ii.shape[0]}, got {ip.tolist()[:8]}{'...' if ip.size > 8 else ''}")
        pages = np.diff(ip.astype(np.int64))
        bad = (lens < 0) | (lens.astype(np.int64) > pages * ps)
        if bad.any():
            b = int(np.argmax(bad))
            raise ArgumentError(f"kv_len_arr: expected 0 <= kv_len_arr[b] <= pages * page_size (request {b}: "
                                f"{int(pages[b])} pages of {ps}), got kv_len_arr[{b}]={int(lens[b])}")
        used = ii[: int(ip[-1])]
        if used.size and int(used.min()) < 0:
            raise ArgumentError(f"kv_indices: expected page indices >= 0, got {int(used.min())}")
        if batch > _GRID_YZ:
            raise ArgumentError(f"kv_indptr: expected batch <= {_GRID_YZ} (the grid's y), got {batch}")
        tiles = -(-h // _HEADS_CTA)
        max_len = int(lens.max()) if lens.size else 0
        if num_splits is None:
            # the sm_90a kernel: 64 heads and 225 KiB of shared memory a CTA, one CTA a SM; mma.sync: two a SM
            sm90 = uses_sm90(self.backend, self.like)
            ctas, want = (-(-h // _HEADS_CTA_SM90), sms) if sm90 else (tiles, 2 * sms)
            ns = 1
            if ctas * batch < want:
                ns = max(1, min(-(-want // (ctas * batch)), max_len // _MIN_SPLIT_KEYS, _MAX_SPLITS))
        else:
            ns = _pos_int("num_splits", num_splits)
            if ns > _GRID_YZ:
                raise ArgumentError(f"num_splits: expected <= {_GRID_YZ}, got {ns}")
        self.batch, self.num_heads, self.page_size, self.num_splits = batch, h, ps, ns
        self.sm_scale, self.kind, self.causal = float(sm_scale), qk, bool(causal)
        self.max_page = int(used.max()) if used.size else -1
        self.lens = lens
        like = self.like
        dev = (lambda x: arrays.to_like(x, like))  # NumPy stays NumPy
        self._indptr, self._indices, self._len = dev(ip), dev(ii if ii.size else np.zeros(1, np.int32)), dev(lens)
        dt = arrays.IO_DTYPES[qk]
        self.out = arrays.empty((batch, h, HEAD_DIM_CKV), dt, like=like)
        self.lse = arrays.empty((batch, h), "float32", like=like)
        n_part = batch * ns * h if ns > 1 else 1
        self.part_o = arrays.empty((n_part * HEAD_DIM_CKV,), dt, like=like)
        self.part_lse = arrays.empty((n_part,), "float32", like=like)
        self.grid = (tiles, batch, ns)
        self.grid_sm90 = (-(-h // _HEADS_CTA_SM90), batch, ns)
        self._planned = True

    def _mla_launch(self, sm90: bool, suffix: str) -> tuple[str, tuple[int, ...], tuple[int, ...], int]:
        if sm90:  # the same splits (both kernels split at multiples of 32 keys), 64 heads a CTA
            return ("mla_decode_sm90" + suffix, self.grid_sm90, (_THREADS_SM90,), MLA90_SMEM_BYTES)
        return ("mla_decode" + suffix, self.grid, (_THREADS,), MLA_SMEM_BYTES)

    def launches(self, backend: str | None = None) -> list[tuple[str, tuple[int, ...], tuple[int, ...], int]]:
        """(kernel, grid, block, shared bytes) of each launch of a step on `backend` (default: the plan's): the MLA
        kernel (mla_decode_sm90 where `uses_sm90`, else mla_decode), then with splits the merge (cascade.cu's
        merge_states, 8 warps a block, a warp a (request, head) row)."""
        suffix = arrays.kernel_suffix(self.kind)
        be = self.backend if backend is None else backend
        ls = [self._mla_launch(uses_sm90(be, self.part_lse), suffix)]
        if self.num_splits > 1:
            ls.append(("merge_states" + suffix, (-(-self.batch // 8), self.num_heads), (256,), 0))
        return ls

    def run(self, q_nope: Any, q_pe: Any, ckv_cache: Any, kpe_cache: Any, out: Any = None, lse: Any = None,
            return_lse: bool = False, *, stream: Any = None, backend: str | None = None) -> Any:
        """out (batch, num_heads, 512) in q's dtype, or (out, lse) with return_lse: softmax(sm_scale * (q_nope .
        ckv + q_pe . kpe)) . ckv over each request's keys. out / lse: arrays to write (else the plan's own,
        overwritten by the next run)."""
        if not self._planned:
            raise ArgumentError("plan: call plan(...) before run(...)")
        backend = self.backend if backend is None else backend
        kind, b, h = self.kind, self.batch, self.num_heads
        dt = arrays.IO_DTYPES[kind]
        for name, a, dim in (("q_nope", q_nope, HEAD_DIM_CKV), ("q_pe", q_pe, HEAD_DIM_KPE)):
            k = arrays.dtype_name(a, name)
            if k != dt:
                raise ArgumentTypeError(f"{name}: expected dtype {dt} (q_data_type of the plan), got {k}")
            shp = tuple(arrays.shape_of(a, name))
            if shp != (b, h, dim):
                raise ArgumentError(f"{name}: expected shape ({b}, {h}, {dim}) (batch, num_heads, head_dim), "
                                    f"got {shp}")
        ckv, np_c, ps_c, (cs_p, cs_t) = _cache("ckv_cache", ckv_cache, kind, HEAD_DIM_CKV)
        kpe, np_k, ps_k, (ks_p, ks_t) = _cache("kpe_cache", kpe_cache, kind, HEAD_DIM_KPE)
        if (np_k, ps_k) != (np_c, ps_c):
            raise ArgumentError(f"kpe_cache: expected (num_pages, page_size) of ckv_cache {(np_c, ps_c)}, got "
                                f"{(np_k, ps_k)}")
        if ps_c != self.page_size:
            raise ArgumentError(f"ckv_cache: expected page_size {self.page_size} (the plan's), got {ps_c}")
        if self.max_page >= np_c:
            raise ArgumentError(f"kv_indices: expected page indices in [0, {np_c}) (num_pages of ckv_cache), got "
                                f"{self.max_page}")
        for name, a in (("q_pe", q_pe), ("ckv_cache", ckv_cache), ("kpe_cache", kpe_cache)):
            if not arrays.same_memory_kind(a, q_nope):
                raise ArgumentTypeError(f"{name}: expected the same kind of array on the same device as q_nope, "
                                        f"got {type(a).__name__}")
        if not arrays.same_memory_kind(q_nope, self.part_lse):  # the plan's workspaces are written every run
            raise ArgumentTypeError(f"q_nope: expected the kind of array (and device) of the plan's workspaces "
                                    f"({type(self.part_lse).__name__}; MLAPagedDecodePlan(like=...)), got "
                                    f"{type(q_nope).__name__}")
        res = self.out if out is None else arrays.check_out(out, (b, h, HEAD_DIM_CKV), dt, q_nope, "out")
        lres = self.lse if lse is None else arrays.check_out(lse, (b, h), "float32", q_nope, "lse")
        from .forward import tensor_cores_available

        if not tensor_cores_available(backend):
            raise ArgumentError("backend: MLA decode runs on mma.sync m16n8k16, which needs sm_80 or newer; this "
                                "device is older (use the host or numba backend)")
        qn, qp = arrays.contiguous(q_nope), arrays.contiguous(q_pe)
        if not arrays.aligned16(qn, qp):
            raise ArgumentError("q_nope: expected 16-byte aligned q_nope and q_pe")
        from ..launcher import launch

        st = arrays.launch_stream(stream, qn)
        suffix = arrays.kernel_suffix(kind)
        want_lse = bool(return_lse) or lse is not None
        res_flat, lse_flat = res.reshape(-1), lres.reshape(-1)
        ns = self.num_splits
        name, grid, block, smem = self._mla_launch(uses_sm90(backend, qn), suffix)
        launch(name, grid, block, qn.reshape(-1), qp.reshape(-1), ckv, kpe, res_flat, lse_flat, self.part_o,
               self.part_lse, self._indptr, self._indices, self._len, h, self.page_size, cs_p, cs_t, ks_p, ks_t, ns,
               int(want_lse or ns > 1), self.sm_scale, shared_mem=smem, stream=st, backend=backend)
        if ns > 1:  # the splits' partials (batch, ns, heads, 512) merged in index order
            _merge_launch("merge_states" + suffix, b, h, self.part_o, self.part_lse, res_flat, lse_flat, b, ns, h,
                          HEAD_DIM_CKV, stream=st, like=qn, backend=backend)
        return (res, lres) if return_lse else res
