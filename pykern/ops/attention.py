"""Attention, one family: `flash_attention`, `flash_attention_varlen`, `attention_backward` and
`flash_attention_varlen_backward`.

The dispatch between the three kinds of kernels lives here, in one place:
- fp32-FMA kernels (any dtype, sm_75 and f32): kernels_cu/attention_fwd_fma.cu, attention_bwd_fma.cu;
- mma.sync tensor-core kernels (bf16 / f16 on sm_80+, the host backend and numba): kernels_cu/attention_fwd_tc.cu
  (the FlashAttention-2 core for head_dim 64 / 128, padded kernels for the rest), attention_bwd_tc.cu,
  attention_bwd_fused_tc.cu;
- sm_90a kernels (TMA + wgmma, Hopper or PYKERN_HOST_ARCH=sm_90a; off with PYKERN_SM90=0): asked first on the
  tensor-core path through the private helper module `_attention_sm90`.
Paged prefill (pykern.ops.serving.paged_prefill_attention) launches the same FlashAttention-2 core with its page
table and takes its geometry from here. Every op validates before launching (ArgumentError / ArgumentTypeError
naming the argument) and accepts `backend=` ("nvrtc", "numba", "host" or None).
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from .. import arrays
from ..arrays import kernel_suffix as _suffix, same_kind as _same_kind, size as _size
from ..errors import ArgumentError, ArgumentTypeError
from ._attention_sm90 import (
    BWD_FUSED_PAD as _SM90_FUSED_PAD,
    backward_fused_usable as _sm90_fused_usable,
    backward_usable as _sm90_backward_usable,
    bwd_fused_acc_split as _sm90_fused_acc_split,
    bwd_varlen_fused_pad as _sm90_varlen_fused_pad,
    try_backward_fused as _sm90_backward_fused,
    try_backward as _sm90_backward,
    try_forward as _sm90_forward,
    try_forward_fp8 as _sm90_forward_fp8,
    try_varlen as _sm90_varlen,
    try_varlen_fp8 as _sm90_varlen_fp8,
    try_varlen_backward as _sm90_varlen_backward,
    try_varlen_backward_fused as _sm90_varlen_backward_fused,
)
from ._window import (
    check_softcap as _check_softcap,
    check_window_size as _check_window_size,
    normalize as _normalize,
    normalize_serving as _normalize_serving,
)
from ._common import flat as _flat, launch as _launch, same_shape as _same_shape

__all__ = ["flash_attention", "flash_attention_varlen", "attention_backward", "flash_attention_varlen_backward"]

_INT_MAX = 2**31 - 1
_GRID_YZ_MAX = 65535  # grid y / z


# --------------------------------------------------------------------------- flash_attention (forward)

# (bucket, query rows per block): the kernel gives DMAX/16 threads to a query row, 256 threads a block.
_FA_BUCKETS = ((64, 64), (128, 32), (256, 16))
FA_THREADS = 256
# Tensor-core bf16 / f16 kernels (kernels_cu/attention_fwd_tc.cu): compile-time head_dim D, other head_dims
# padded up to the next D; (D, keys per tile, Q in registers) as the .cu's FatcCfg.
TC_HEAD_DIMS = (64, 96, 128, 256)
_TC_CFG = {64: (64, 1), 96: (64, 1), 128: (64, 1), 256: (32, 0)}
TC_THREADS = 128
TC_ROWS = 64  # queries per CTA (FATC_BR)
# The FlashAttention-2 core (kernels_cu/pk_attn_core.cuh): attention_fwd_tc_d64 / _d128 take
# head_dim == head_dim_v == D with 16-byte aligned q / k / v / out, 128 queries a CTA of 8 warps; other shapes
# at those D take attention_fwd_tc_pad_d64 / _d128 (the general kernels above, padding head_dim).
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


def _qkv_shapes(q: Any, k: Any, v: Any) -> tuple[int, int, int, int, int, int, tuple[int, ...]]:
    """(batch, n_q, n_heads, head_dim, n_k, n_kv_heads, v's shape) of flash_attention's q, k, v, checked: k shares
    q's batch and head_dim, v k's batch, length and heads (its head_dim_v is free)."""
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
    return batch, n_q, n_heads, head_dim, n_k, n_kv_heads, vs


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
    q_descale: Any = None,
    k_descale: Any = None,
    v_descale: Any = None,
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
    PYKERN_HOST_ARCH=sm_90a) head_dim == head_dim_v in 64/96/128/256, and head_dim 192 with head_dim_v 128
    (DeepSeek-V3's prefill shape), with or without softcap, run the sm_90a kernel instead (TMA, wgmma,
    FlashAttention-3's producer / consumer warpgroups; same rounding of P), as does any other head_dim ==
    head_dim_v that is a multiple of 8 up to 256, on the next of those kernels up (its TMA loads zero-fill the
    columns past head_dim, its store writes only those below). f32
    inputs always use the fp32 kernels. f16 outputs overflow to inf beyond
    65504, as on the GPU.

    FP8 (FlashAttention-3's flash_attn_func(q_descale=...)): q, k, v float8_e4m3fn (NumPy ml_dtypes /
    torch.float8_e4m3fn) stand for q * q_descale, k * k_descale, v * v_descale; each descale is None (1), a
    float, or a float32 array of shape () / (1,) (per tensor) or (batch, n_kv_heads) (query head h takes kv head
    h // (n_heads // n_kv_heads)), on the memory q lives on. out is bf16 (lse float32 as above). On Hopper (and
    the host backend with PYKERN_HOST_ARCH=sm_90a), head_dim == head_dim_v in 64/128/256, with or without softcap
    and window, the FP8 kernel runs (e4m3 wgmma for both products, V transposed in shared memory, P rounded to e4m3
    with the softmax shifted by 2^3, fp32 accumulation; docs/attention_sm90.md). Everywhere else q, k, v are dequantized
    to bf16 (q * q_descale rounded once) and the bf16 path above runs, so every backend takes FP8 inputs.
    """
    if (arrays.dtype_name(q, "q") == "float8_e4m3fn"
            or any(x is not None for x in (q_descale, k_descale, v_descale))):
        return _flash_attention_fp8(q, k, v, (q_descale, k_descale, v_descale), causal, scale, window_size, softcap,
                                    return_lse, out, tensor_cores, stream, backend)
    kind = arrays.io_kind("q", q, arrays.IO_KINDS)
    _same_kind("k", k, kind, "q")
    _same_kind("v", v, kind, "q")
    batch, n_q, n_heads, head_dim, n_k, n_kv_heads, vs = _qkv_shapes(q, k, v)
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
    out_shape = (batch, n_q, n_heads, head_dim_v)
    out = (arrays.empty(out_shape, arrays.dtype_name(q), like=q) if out is None
           else arrays.check_out(out, out_shape, arrays.dtype_name(q), q))
    lse = arrays.empty((batch, n_q, n_heads), "float32", like=q)
    stream = arrays.launch_stream(stream, q)
    if n_blocks == 0:
        pass
    elif n_k == 0:  # no key at all: every row is an empty softmax
        _fill(out, 0.0, stream)
        _fill(lse, -math.inf, stream)
    elif use_tc and _sm90_forward(q, k, v, out, lse, (batch, n_q, n_k, n_heads, n_kv_heads, head_dim, head_dim_v),
                                      float(scale), softcap, wl, wr, _suffix(kind), stream, backend):
        pass  # the Hopper kernel ran (kernels_cu/attention_fwd_sm90.cu)
    elif use_tc:
        from ..launcher import launch

        args = (q, k, v, out, lse, batch, n_q, n_k, n_heads, n_kv_heads, head_dim, head_dim_v, float(scale),
                wl, wr, softcap)
        if fa2_eligible(head_dim, head_dim_v, q, k, v, out):
            launch(f"attention_fwd_tc_d{bucket}{cap}{_suffix(kind)}", batch * n_heads * -(-n_q // FA2_ROWS),
                   FA2_THREADS, *args, shared_mem=fa2_shared_bytes(bucket), stream=stream, backend=backend)
        else:
            pad = "pad_" if bucket in FA2_HEAD_DIMS else ""
            launch(f"attention_fwd_tc_{pad}d{bucket}{cap}{_suffix(kind)}", n_blocks, TC_THREADS, *args,
                   shared_mem=tc_shared_bytes(bucket), stream=stream, backend=backend)
    else:
        _launch(
            f"attention_fwd_fma_d{bucket}{cap}{_suffix(kind)}", n_blocks, FA_THREADS,
            q, k, v, out, lse, batch, n_q, n_k, n_heads, n_kv_heads, head_dim, head_dim_v, float(scale),
            wl, wr, softcap,
            stream=stream, backend=backend,
        )
    return (out, lse) if return_lse else out


_FP8 = "float8_e4m3fn"


def _descale(name: str, x: Any, q: Any, batch: int, n_kv_heads: int) -> tuple[Any, int]:
    """(a flat float32 array on q's memory, its stride per (batch, kv head): 0 per tensor, 1 per head) for one
    descale argument (None = 1, a float, or a float32 array of shape (), (1,) or (batch, n_kv_heads))."""
    if x is None or (isinstance(x, (int, float, np.floating)) and not isinstance(x, bool)):
        value = 1.0 if x is None else float(x)
        if not math.isfinite(value):
            raise ArgumentError(f"{name}: expected a finite number, got {x!r}")
        return arrays.to_like(np.full((1,), value, np.float32), q), 0
    dt = arrays.dtype_name(x, name)
    if dt != "float32":
        raise ArgumentTypeError(f"{name}: expected dtype float32, got {dt}")
    shape = arrays.shape_of(x, name)
    if shape not in ((), (1,), (batch, n_kv_heads)):
        raise ArgumentError(f"{name}: expected shape () or (1,) (per tensor) or (batch, num_kv_heads) = "
                            f"({batch}, {n_kv_heads}), got {shape}")
    if not arrays.same_memory_kind(x, q):
        raise ArgumentTypeError(f"{name}: expected an array on the memory q lives on ({type(q).__name__}), got a "
                                f"{type(x).__name__}")
    return arrays.flat_view(arrays.contiguous(x)), 0 if len(shape) < 2 else 1


def _flash_attention_fp8(q, k, v, descales, causal, scale, window_size, softcap, return_lse, out, tensor_cores,
                         stream, backend):
    """flash_attention with float8_e4m3fn q, k, v (its docstring): the sm_90a FP8 kernel, else bf16."""
    _check_fp8_dtypes(q, k, v, descales)
    batch, n_q, n_heads, head_dim, n_k, n_kv_heads, vs = _qkv_shapes(q, k, v)
    if n_kv_heads < 1 or n_heads % n_kv_heads:
        raise ArgumentError(f"k: n_kv_heads must divide n_heads={n_heads}, got {n_kv_heads}")
    ds = tuple(_descale(nm, x, q, batch, n_kv_heads)
               for nm, x in zip(("q_descale", "k_descale", "v_descale"), descales))
    head_dim_v = vs[3]
    left, right = _check_window_size(window_size)
    softcap = _check_softcap(softcap)
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating)) or not math.isfinite(scale):
        raise ArgumentError(f"scale: expected a finite number, got {scale!r}")
    # The kernel steps tiles in int, as the bf16 kernels: the same length limits (the bf16 path checks its own).
    if (tensor_cores is not False and head_dim == head_dim_v and n_q and n_k and batch
            and n_heads and max(n_q, n_k) <= _INT_MAX - 256 and batch * n_heads * -(-n_q // 128) <= _INT_MAX):
        q, k, v = arrays.contiguous(q), arrays.contiguous(k), arrays.contiguous(v)
        out_shape = (batch, n_q, n_heads, head_dim_v)
        o = (arrays.empty(out_shape, "bfloat16", like=q) if out is None
             else arrays.check_out(out, out_shape, "bfloat16", q))
        lse = arrays.empty((batch, n_q, n_heads), "float32", like=q)
        wl, wr = _normalize(left, right, bool(causal), n_q, n_k)
        if _sm90_forward_fp8(q, k, v, o, lse, ds, (batch, n_q, n_k, n_heads, n_kv_heads, head_dim, head_dim_v),
                             float(scale), wl, wr, arrays.launch_stream(stream, q), backend, softcap):
            return (o, lse) if return_lse else o
    # Elsewhere: dequantize to bf16 (one rounding of x * descale) and run the bf16 path.
    qb, kb, vb = (arrays.dequantize_heads(a, d, n_kv_heads) for a, (d, _) in zip((q, k, v), ds))
    return flash_attention(qb, kb, vb, causal=causal, scale=scale, window_size=window_size, softcap=softcap,
                           return_lse=return_lse, out=out, tensor_cores=tensor_cores, stream=stream, backend=backend)


def _check_fp8_dtypes(q: Any, k: Any, v: Any, descales: tuple[Any, Any, Any]) -> None:
    """q, k and v all float8_e4m3fn (the error names the odd one; a descale with a q of another dtype names it)."""
    dt = arrays.dtype_name(q, "q")
    if dt != _FP8:  # a descale with a q of another dtype: the descale is the odd one out
        name = next(nm for nm, x in zip(("q_descale", "k_descale", "v_descale"), descales) if x is not None)
        raise ArgumentTypeError(f"{name}: expected it with {_FP8} q, k and v (FP8 attention), got q of dtype {dt}")
    for name, a in (("k", k), ("v", v)):
        dt = arrays.dtype_name(a, name)
        if dt != _FP8:
            raise ArgumentTypeError(f"{name}: expected dtype {_FP8} (as q), got {dt}")


def _check_cu_seqlens(cu_seqlens_q: Any, cu_seqlens_k: Any, total_q: int, total_k: int) -> tuple[Any, Any, Any, Any, int]:
    """The varlen ops' sequence bounds: (cq, host cq or None, ck, host ck or None, batch), each checked against
    the packed rows (an ArgumentError naming the array)."""
    from ._common import index_array as _index
    from ._prefill import check_indptr as _check_indptr

    cq, hq = _index("cu_seqlens_q", cu_seqlens_q, None)
    batch = arrays.shape_of(cq)[0] - 1
    if batch < 1:
        raise ArgumentError(f"cu_seqlens_q: expected shape (batch + 1,) with batch >= 1, got {arrays.shape_of(cq)}")
    ck, hk = _index("cu_seqlens_k", cu_seqlens_k, batch + 1, "the length of cu_seqlens_q")
    _check_indptr("cu_seqlens_q", hq, total_q, "total_q", exact=True)
    _check_indptr("cu_seqlens_k", hk, total_k, "total_k")
    return cq, hq, ck, hk, batch


def _flash_attention_varlen_fp8(q, k, v, cu_seqlens_q, cu_seqlens_k, descales, causal, scale, window_size, softcap,
                                return_lse, stream, backend):
    """flash_attention_varlen with float8_e4m3fn q, k, v (its docstring): the sm_90a FP8 varlen kernel, else the
    bf16 path on the dequantized inputs."""
    from ._common import attention_scale as _scale
    from ._prefill import prefill_out as _prefill_out

    _check_fp8_dtypes(q, k, v, descales)
    ks = arrays.check_ndim("k", k, (3,), "(total_k, num_kv_heads, head_dim)")
    vs = arrays.check_ndim("v", v, (3,), "(total_k, num_kv_heads, head_dim_v)")
    qs = arrays.check_ndim("q", q, (3,), "(total_q, num_heads, head_dim)")
    if vs[:2] != ks[:2]:
        raise ArgumentError(f"v: expected shape (total_k, num_kv_heads, head_dim_v) = ({ks[0]}, {ks[1]}, head_dim_v) "
                            f"(from k), got {vs}")
    total_k, kvh, d = ks
    total_q, h, d_q = qs
    if d_q != d:
        raise ArgumentError(f"q: expected shape (total_q, num_heads, {d}) (head_dim {d} from the K/V), got {qs}")
    if kvh < 1 or h < 1 or h % kvh:
        raise ArgumentError(f"q: expected num_heads a multiple of num_kv_heads={kvh}, got {h}")
    cq, hq, ck, hk, batch = _check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, total_q, total_k)
    ds = tuple(_descale(nm, x, q, batch, kvh) for nm, x in zip(("q_descale", "k_descale", "v_descale"), descales))
    sc = _scale(scale, d)
    left, right = _check_window_size(window_size)
    cap = _check_softcap(softcap)
    if total_q and d == vs[2] and batch <= _GRID_YZ_MAX:
        wl, wr = _normalize_serving(left, right, bool(causal))
        max_qo = int(np.diff(hq.astype(np.int64)).max()) if hq is not None else total_q
        q, k, v = arrays.contiguous(q), arrays.contiguous(k), arrays.contiguous(v)
        out, lse = _prefill_out(total_q, h, d, "bf16", q, hq is not None)
        if _sm90_varlen_fp8(q, k, v, arrays.flat_view(out), arrays.flat_view(lse), cq, ck, ds,
                            (batch, max_qo, h, kvh, d), sc, cap, wl, wr, arrays.launch_stream(stream, q), backend):
            return (out, lse) if return_lse else out
    # Elsewhere: dequantize to bf16 (one rounding of x * its sequence's descale) and run the bf16 path.
    qb = arrays.dequantize_varlen(q, ds[0][0], cq, kvh)
    kb, vb = (arrays.dequantize_varlen(a, dd, ck, kvh) for a, (dd, _) in zip((k, v), ds[1:]))
    return flash_attention_varlen(qb, kb, vb, cu_seqlens_q, cu_seqlens_k, causal=causal, scale=scale,
                                  window_size=window_size, softcap=softcap, return_lse=return_lse, stream=stream,
                                  backend=backend)


def _fill(a: Any, value: float, stream: Any = None) -> None:
    if isinstance(a, np.ndarray):
        a.fill(value)
    elif hasattr(a, "fill_"):
        a.fill_(value)  # torch: on its current stream, which is the op's stream unless one was passed
    else:
        a.fill(value)


# --------------------------------------------------------------------------- flash_attention_varlen


@arrays.stream_scoped
def flash_attention_varlen(
    q: Any,
    k: Any,
    v: Any,
    cu_seqlens_q: Any,
    cu_seqlens_k: Any,
    *,
    causal: bool = False,
    scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    return_lse: bool = False,
    stream: Any = None,
    backend: str | None = None,
    q_descale: Any = None,
    k_descale: Any = None,
    v_descale: Any = None,
) -> Any:
    """flash-attn's varlen attention: sequences packed without padding.

    q (total_q, num_heads, head_dim), k (total_k, num_kv_heads, head_dim), v (total_k, num_kv_heads,
    head_dim_v) with head_dim_v <= head_dim (e.g. DeepSeek-V3's prefill: head_dim 192, head_dim_v 128); sequence b
    is q rows cu_seqlens_q[b]:cu_seqlens_q[b+1] against k/v rows
    cu_seqlens_k[b]:cu_seqlens_k[b+1]. causal=True aligns the mask bottom-right per
    sequence. window_size=(left, right) and softcap as `flash_attention` (flash-attn's
    semantics, per sequence; positions outside every window of a CTA are never read). Returns out (total_q,
    num_heads, head_dim_v) in q's dtype, or (out, lse) with lse (total_q, num_heads) natural-log float32.

    Kernels: on sm_90a (Hopper, or the host backend with PYKERN_HOST_ARCH=sm_90a; bf16 / f16) the TMA + wgmma
    forward at head_dim == head_dim_v in 64 / 96 / 128 / 256 and at 192 / 128 (attention_fwd_varlen_sm90_d192_dv128),
    with or without softcap; else the FlashAttention-2 core at head_dim == head_dim_v in 64 / 128; else the tile
    kernel dense_attn, which reads K and V at one head_dim: there a head_dim_v < head_dim runs on a copy of v
    padded with zero columns up to head_dim, and out is sliced back to head_dim_v (one more copy of v and of out).

    FP8 (FlashAttention-3's flash_attn_varlen_func(q_descale=...)): float8_e4m3fn q, k, v with descales as
    `flash_attention`'s (None, a float, or float32 of shape () / (1,) per tensor or (batch, num_kv_heads), batch the
    number of sequences) give a bf16 out: on sm_90a at head_dim == head_dim_v in 64 / 128 / 256 the FP8 kernel
    attention_fwd_varlen_sm90_d{D}[_softcap]_fp8, elsewhere q, k, v dequantized to bf16 (each row times its
    sequence's descale, one rounding) for the bf16 path.
    """
    if (arrays.dtype_name(q, "q") == _FP8
            or any(x is not None for x in (q_descale, k_descale, v_descale))):
        return _flash_attention_varlen_fp8(q, k, v, cu_seqlens_q, cu_seqlens_k, (q_descale, k_descale, v_descale),
                                           causal, scale, window_size, softcap, return_lse, stream, backend)
    # At call time (serving re-exports this op, so it imports this module first). The op validates and falls back
    # as the serving ops do: dense_attn in kernels_cu/paged.cu.
    from ._common import attention_scale as _scale
    from ._prefill import (
        MAX_LEN as _MAX_LEN, NT as _NT, Q_KINDS as _Q_KINDS, check_q as _check_q,
        dummy as _dummy, prefill_out as _prefill_out, row_chunks as _row_chunks, suffix as _serving_suffix,
    )
    from ..arrays import flat_view as _sflat
    from .serving import attn_tiling
    from ..launcher import launch

    kind = arrays.io_kind("k", k, _Q_KINDS)
    arrays.same_kind("v", v, kind, "k")
    ks = arrays.check_ndim("k", k, (3,), "(total_k, num_kv_heads, head_dim)")
    vs = arrays.check_ndim("v", v, (3,), "(total_k, num_kv_heads, head_dim_v)")
    if vs[:2] != ks[:2]:
        raise ArgumentError(f"v: expected shape (total_k, num_kv_heads, head_dim_v) = ({ks[0]}, {ks[1]}, head_dim_v) "
                            f"(from k), got {vs}")
    total_k, kvh, d = ks
    d_v = vs[2]
    if kvh < 1 or not 1 <= d <= MAX_HEAD_DIM:
        raise ArgumentError(f"k: expected (total_k, num_kv_heads, head_dim) with head_dim <= {MAX_HEAD_DIM}, got {ks}")
    if not 1 <= d_v <= d:  # the fallback pads v up to head_dim (below); a wider v has no kernel
        raise ArgumentError(f"v.shape[2] (head_dim_v): expected 1 <= head_dim_v <= head_dim={d} (q and k), got {d_v}")
    qk, total_q, h = _check_q(q, kvh, d, "total_q")
    suf = _serving_suffix(qk, kind)
    cq, hq, ck, hk, batch = _check_cu_seqlens(cu_seqlens_q, cu_seqlens_k, total_q, total_k)
    if hk is not None and hk.size and int(np.diff(hk.astype(np.int64)).max(initial=0)) > _MAX_LEN:
        raise ArgumentError("cu_seqlens_k: expected sequences of at most 2**30 keys")
    sc = _scale(scale, d)
    left, right = _check_window_size(window_size)
    wl, wr = _normalize_serving(left, right, bool(causal))
    cap = _check_softcap(softcap)
    group = h // kvh
    max_qo = int(np.diff(hq.astype(np.int64)).max()) if hq is not None else total_q
    rows, tile, smem = attn_tiling(d, max_qo * group)
    chunks = _row_chunks("cu_seqlens_q", max_qo, group, rows)
    q, k, v = arrays.contiguous(q), arrays.contiguous(k), arrays.contiguous(v)
    out, lse = _prefill_out(total_q, h, d_v, qk, q, hq is not None)
    # On sm_90a the TMA + wgmma forward (kernels_cu/attention_fwd_sm90.cu, VARLEN: bf16 or f16, head_dim ==
    # head_dim_v in 64 / 96 / 128 / 256 or 192 / 128, softcap or not, 16-byte aligned bases). Else the FlashAttention-2
    # core (kernels_cu/attention_fwd_tc.cu): bf16 or f16 q, K and V of one type, head_dim == head_dim_v in 64 / 128,
    # 16-byte aligned data. Both: grid (query tiles of the longest sequence * heads, batch).
    n_qt = -(-max_qo // FA2_ROWS)
    fa2 = (total_q and qk == kind and kind in ("bf16", "f16") and fa2_eligible(d, d_v, q, k, v, out)
           and batch <= _GRID_YZ_MAX and n_qt * h < 2**31)
    stream_ = arrays.launch_stream(stream, q)
    if (total_q and qk == kind and kind in ("bf16", "f16") and batch <= _GRID_YZ_MAX
            and _sm90_varlen(q, k, v, _sflat(out), _sflat(lse), cq, ck, (batch, max_qo, h, kvh, d, d_v), sc, cap,
                             wl, wr, f"_{qk}", stream_, backend)):
        pass  # the Hopper kernel ran (kernels_cu/attention_fwd_sm90.cu, VARLEN)
    elif fa2:
        launch(f"attention_fwd_varlen_tc_d{d}{'_softcap' if cap > 0 else ''}_{qk}", (n_qt * h, batch, 1),
               (FA2_THREADS,), _sflat(q), _sflat(k), _sflat(v), _sflat(out), _sflat(lse), cq, ck, h, kvh, n_qt, sc,
               wl, wr, cap, shared_mem=fa2_shared_bytes(d), stream=stream_, backend=backend)
    elif total_q:
        # dense_attn reads K and V at one head_dim: a narrower v is padded with zero columns to head_dim (they add
        # zero columns to out, dropped below; the scores and lse do not change).
        v_d, out_d = (v, out) if d_v == d else (arrays.pad_last(v, d), arrays.zeros((total_q, h, d), qk, like=q))
        # k_mode 0 (keys at cu_seqlens_k) never reads seq_lens: an allocation, not a host-to-device copy (a
        # pageable copy synchronises the stream)
        launch("dense_attn" + suf, (batch * kvh, chunks, 1), (_NT,), _sflat(q), _sflat(k), _sflat(v_d),
               _sflat(out_d), _sflat(lse), _dummy(q), _dummy(q), cq, ck, _dummy(q, "uint32"), h, kvh, d, 0, kvh * d,
               d, 0, 1, 0, wl, wr, rows, tile, 1, 0, total_q, 1, sc, cap, shared_mem=smem,
               stream=arrays.launch_stream(stream, q), backend=backend)
        if out_d is not out:
            out = arrays.narrow_last(out_d, d_v)
    return (out, lse) if return_lse else out


# --------------------------------------------------------------------------- attention_backward

MAX_HEAD_DIM = 256
# The naive kernel keeps two floats per key in shared memory (2 * seq * 4 bytes
# plus 2 * head_dim floats); 4096 keys stay well inside the 48 KiB a block gets
# without an opt-in on every arch.
NAIVE_MAX_SEQ = 4096
_FLASH_THREADS = 256
_STAGE = 16  # PK_ATT_STAGE in the .cu
_NAIVE_THREADS = 128
_NAIVE_SMEM = 48 * 1024  # dynamic shared memory a block gets without an opt-in
METHODS = ("auto", "naive", "flash", "tensor_cores")
# Tensor-core kernels (kernels_cu/attention_bwd_tc.cu): tiles as the .cu's ABTC_* constants.
_TC_THREADS = 128
_TC_BC = 64  # keys per dK/dV CTA
_TC_BR = 16  # queries per dK/dV step
_TC_QR = 64  # queries per dQ CTA


def tc_backward_shared_bytes(d: int) -> tuple[int, int]:
    """(dK/dV kernel, dQ kernel) dynamic shared memory at compiled head_dim d (ABTC_*_SMEM in the .cu)."""
    dq_bc = 32 if d <= 128 else 16
    return (2 * _TC_BC + 2 * _TC_BR) * (d + 8) * 2 + 2 * _TC_BR * 4, (2 * _TC_QR + 2 * dq_bc) * (d + 8) * 2
# Fused kernels (kernels_cu/attention_bwd_tc_fused.cu): head_dims, keys per CTA, queries per streamed tile.
FUSED_HEAD_DIMS = (64, 128)
_FUSED_BC = 64
_FUSED_BR = {64: 32, 128: 16}
# The deterministic mode keeps one fp32 dQ partial per key tile: at most this many bytes of them at a time
# (more key tiles run as several launches, each reduced into the fp32 sum in key-tile order).
DET_WORKSPACE_BYTES = 1 << 30


def fused_available(backend: str | None = None) -> bool:
    """Whether the fused backward runs on `backend`: sm_80 ... sm_90 on nvrtc (sm_100 / sm_120 keep the dK/dV +
    dQ pair: ptxas there spills the fused kernel), the host backend."""
    from ..backends import get_backend

    be = get_backend(backend)
    if be.name != "nvrtc":
        return True
    arch = getattr(be, "arch", "") or ""
    num = "".join(c for c in arch[3:] if c.isdigit()) if arch.startswith("sm_") else ""
    return bool(num) and 80 <= int(num) < 100


def fused_shared_bytes(d: int) -> int:
    """Dynamic shared memory of the fused backward at head_dim d (ABF_SMEM in the .cu)."""
    br = _FUSED_BR[d]
    return (2 * _FUSED_BC + 4 * br) * (d + 8) * 2 + _FUSED_BC * (br + 8) * 2 + 4 * br * 4


def group_lanes(head_dim: int) -> int:
    """Lanes per key/query row in the flash kernels: each lane holds at most 16 dims in registers."""
    return 4 if head_dim <= 64 else 8 if head_dim <= 128 else 16


def _zero(buf: Any, n: int, backend: str | None, stream: Any = None) -> None:
    _launch("training_zero_f32", (max(1, min(-(-n // 256), 4096)),), (256,), buf, n, stream=stream, backend=backend)


def naive_max_seq(head_dim: int, softcap: float) -> int:
    """Keys the naive kernel holds in shared memory: NAIVE_MAX_SEQ, fewer with a softcap (a third float a key)."""
    if softcap <= 0.0:
        return NAIVE_MAX_SEQ
    return min(NAIVE_MAX_SEQ, (_NAIVE_SMEM - 8 * head_dim) // 12)


def _naive(q, k, v, g, kind, dims, scale, win, backend, stream=None):
    b, n_q, n_k, h, kvh, d = dims
    wl, wr, softcap = win
    limit = naive_max_seq(d, softcap)
    if n_k > limit:
        raise ArgumentError(
            f"k.shape[-3] (n_k): method='naive' handles seq_len <= {limit}"
            f"{' with a softcap' if softcap > 0 else ''}, got {n_k}; use method='flash'"
        )
    if n_q > _INT_MAX:
        raise ArgumentError(f"q.shape[-3] (n_q): method='naive' launches a block per query, at most {_INT_MAX}, "
                            f"got {n_q}; use method='flash'")
    dq = arrays.empty(arrays.shape_of(q), kind, like=q)
    kv_shape = tuple(arrays.shape_of(k))
    n_kv = _size(kv_shape)
    dk_acc = arrays.empty((n_kv,), np.float32, like=q)
    dv_acc = arrays.empty((n_kv,), np.float32, like=q)
    _zero(dk_acc, n_kv, backend, stream)
    _zero(dv_acc, n_kv, backend, stream)
    shared = (2 * d + (3 if softcap > 0 else 2) * n_k) * 4
    _launch(
        "attention_bwd_fma_naive" + _suffix(kind), (n_q, h, b), (_NAIVE_THREADS,),
        _flat(q), _flat(k), _flat(v), _flat(g), _flat(dq), dk_acc, dv_acc, n_q, n_k, h, kvh, d, scale,
        wl, wr, softcap, shared_mem=shared, stream=stream, backend=backend,
    )
    if kind == "f32":
        return dq, dk_acc.reshape(kv_shape), dv_acc.reshape(kv_shape)
    dk = arrays.empty(kv_shape, kind, like=q)
    dv = arrays.empty(kv_shape, kind, like=q)
    blocks = (max(1, min(-(-n_kv // 256), 4096)),)
    _launch("training_f32_to" + _suffix(kind), blocks, (256,), dk_acc, _flat(dk), n_kv, stream=stream, backend=backend)
    _launch("training_f32_to" + _suffix(kind), blocks, (256,), dv_acc, _flat(dv), n_kv, stream=stream, backend=backend)
    return dq, dk, dv


def _flash(q, k, v, g, out, lse, kind, dims, scale, win, backend, stream=None):
    """The fp32-FMA backward (any dtype, any length, deterministic)."""
    b, n_q, n_k, h, kvh, d = dims
    G = group_lanes(d)
    rows = _FLASH_THREADS // G
    sfx = ("_softcap" if win[2] > 0 else "") + _suffix(kind)
    n_rows = b * n_q * h
    if out is not None and lse is not None:
        lse_buf = lse
        delta = arrays.empty((n_rows,), np.float32, like=q)
        _launch(
            "attention_bwd_preprocess" + _suffix(kind), (-(-n_rows // (_FLASH_THREADS // 32)),), (_FLASH_THREADS,),
            _flat(g), _flat(out), delta, n_rows, d, stream=stream, backend=backend,
        )
    else:
        lse_buf = arrays.empty((n_rows,), np.float32, like=q)
        delta = arrays.empty((n_rows,), np.float32, like=q)
        _launch(
            "attention_bwd_lse" + sfx, (-(-n_q // rows), h, b), (_FLASH_THREADS,),
            _flat(q), _flat(k), _flat(v), _flat(g), lse_buf, delta, n_q, n_k, h, kvh, d, scale, *win, G,
            shared_mem=2 * _STAGE * d * 4, stream=stream, backend=backend,
        )
    dq, dk, dv = (arrays.empty(arrays.shape_of(a), kind, like=q) for a in (q, k, v))
    _launch(
        "attention_bwd_fma_dkdv" + sfx, (-(-n_k // rows), kvh, b), (_FLASH_THREADS,),
        _flat(q), _flat(k), _flat(v), _flat(g), _flat(lse_buf), delta, _flat(dk), _flat(dv),
        n_q, n_k, h, kvh, d, scale, *win, G, shared_mem=(2 * _STAGE * d + 2 * _STAGE) * 4, stream=stream,
        backend=backend,
    )
    _launch(
        "attention_bwd_fma_dq" + sfx, (-(-n_q // rows), h, b), (_FLASH_THREADS,),
        _flat(q), _flat(k), _flat(v), _flat(g), _flat(lse_buf), delta, _flat(dq),
        n_q, n_k, h, kvh, d, scale, *win, G, shared_mem=2 * _STAGE * d * 4, stream=stream, backend=backend,
    )
    return dq, dk, dv


def _tensor_cores(q, k, v, g, out, lse, kind, dims, scale, win, backend, stream=None):
    """bf16 / f16 on tensor cores: delta pre-pass, one dK/dV kernel per key tile (the CTA sums the GQA group's
    heads itself), one dQ kernel per query tile; every output element has one writer: deterministic. dims may
    carry head_dim_v last (< head_dim: the sm_90a kernels only, given out and lse; None when they do not run)."""
    b, n_q, n_k, h, kvh, d = dims[:6]
    d_v = dims[6] if len(dims) > 6 else d
    cap = "_softcap" if win[2] > 0 else ""
    sfx = _suffix(kind)
    n_rows = b * n_q * h
    delta = arrays.empty((n_rows,), np.float32, like=q)
    if out is not None and lse is not None:  # the training flow: the forward's own out and lse
        _launch("attention_bwd_preprocess" + sfx, (-(-n_rows // (_FLASH_THREADS // 32)),), (_FLASH_THREADS,),
                _flat(g), _flat(out), delta, n_rows, d_v, stream=stream, backend=backend)
    else:
        # lse and delta = sum_j P_ij dP_ij in fp32 by the pre-pass kernel, not rowsum(dO * out) of a 16-bit
        # out: that out's rounding would enter delta, and dK sums it over every query of the GQA group.
        G = group_lanes(d)
        lse = arrays.empty((n_rows,), np.float32, like=q)
        _launch("attention_bwd_lse" + cap + sfx, (-(-n_q // (_FLASH_THREADS // G)), h, b), (_FLASH_THREADS,),
                _flat(q), _flat(k), _flat(v), _flat(g), lse, delta, n_q, n_k, h, kvh, d, scale, *win,
                G, shared_mem=2 * _STAGE * d * 4, stream=stream, backend=backend)
    grads = _sm90_backward(q, k, v, g, _flat(lse), delta, dims, scale, win, kind, sfx, stream, backend)
    if grads is not None:  # Hopper: the wgmma kernels (kernels_cu/attention_bwd_sm90.cu)
        return grads
    if d_v != d:  # not taken (e.g. a base off 16 bytes): the caller pads v
        return None
    D = tc_head_dim(d)
    dq = arrays.empty(arrays.shape_of(q), kind, like=q)
    dk = arrays.empty(arrays.shape_of(k), kind, like=q)
    dv = arrays.empty(arrays.shape_of(v), kind, like=q)
    smem_kv, smem_q = tc_backward_shared_bytes(D)
    args = (_flat(q), _flat(k), _flat(v), _flat(g), _flat(lse), delta)
    tail = (b, n_q, n_k, h, kvh, d, scale, *win)
    kv_grid = b * kvh * -(-n_k // _TC_BC)
    names = ((f"attention_bwd_tc_dv_d{D}{cap}{sfx}", f"attention_bwd_tc_dk_d{D}{cap}{sfx}") if D == 256
             else (f"attention_bwd_tc_dkdv_d{D}{cap}{sfx}",))
    for name in names:
        _launch(name, (kv_grid,), (_TC_THREADS,), *args, _flat(dk), _flat(dv), *tail, shared_mem=smem_kv,
                stream=stream, backend=backend)
    _launch(f"attention_bwd_tc_dq_d{D}{cap}{sfx}", (b * h * -(-n_q // _TC_QR),), (_TC_THREADS,), *args,
            _flat(dq), *tail, shared_mem=smem_q, stream=stream, backend=backend)
    return dq, dk, dv


def _sm90_fused(q, k, v, g, out, lse, kind, dims, scale, win, deterministic, backend, stream=None):
    """sm_90a, head_dim 64 / 96 / 128 / 256 and 192 / head_dim_v 128 (dims' 7th, given the forward's out and
    lse), with or without softcap: FlashAttention-3's backward, one kernel per key tile
    (kernels_cu/attention_bwd_sm90.cu's fused kernels) computing dK, dV and adding dQ's partials into an fp32
    accumulator (bulk reduce-adds; deterministic: in key-tile order per query tile, through semaphores); the
    pre-pass (delta, the lse / delta runs) zeroes the accumulator in the same launch (not at 192 / 128, whose
    accumulator runs are not the pre-pass's rows: it starts zeroed), and a small kernel narrows it times scale.
    None (nothing launched) when the arrays do not suit TMA."""
    b, n_q, n_k, h, kvh, d = dims[:6]
    d_v = dims[6] if len(dims) > 6 else d
    wl, wr, softcap = win
    sfx = _suffix(kind)
    cap = "_softcap" if softcap > 0 else ""
    n_rows = b * n_q * h
    nq_pad = -(-n_q // _SM90_FUSED_PAD) * _SM90_FUSED_PAD
    n_ws = b * h * nq_pad * d
    # padded rows of the runs stay zero (the kernel reads lse +inf past n_q); the accumulator's padded rows take
    # zero adds (their dS is 0) and are never read
    lse2 = arrays.zeros((b * h * nq_pad,), np.float32, like=q)
    dlt = arrays.zeros((b * h * nq_pad,), np.float32, like=q)
    dr, runs = _sm90_fused_acc_split(d, d_v)
    # the pre-pass zeroes the (batch, head, query) rows of d columns, which are the accumulator's when it has one
    # run a head (d256's two runs a head cover the same elements when nq_pad == n_q); 192 / 128's three runs of 64
    # are not rows of 192, so that workspace starts zeroed
    zero_ws = runs < 3
    dq_ws = (arrays.empty if nq_pad == n_q and zero_ws else arrays.zeros)((n_ws,), np.float32, like=q)
    dk = arrays.empty(arrays.shape_of(k), kind, like=q)
    dv = arrays.empty(arrays.shape_of(v), kind, like=q)
    if out is not None and lse is not None:
        delta_in = dlt  # unused (out given)
    else:
        G = group_lanes(d)
        lse = arrays.empty((n_rows,), np.float32, like=q)
        delta_in = arrays.empty((n_rows,), np.float32, like=q)
        _launch("attention_bwd_lse" + cap + sfx, (-(-n_q // (_FLASH_THREADS // G)), h, b), (_FLASH_THREADS,),
                _flat(q), _flat(k), _flat(v), _flat(g), lse, delta_in, n_q, n_k, h, kvh, d, scale, wl, wr,
                softcap, G, shared_mem=2 * _STAGE * d * 4, stream=stream, backend=backend)
        out = None
    _launch("attention_bwd_tc_prep" + sfx, (-(-n_rows // 8),), (256,), _flat(g),
            _flat(out if out is not None else g), _flat(lse), delta_in, lse2, dlt, dq_ws, n_rows, n_q, h, nq_pad, d_v,
            int(out is not None), int(zero_ws), stream=stream, backend=backend)
    if not _sm90_backward_fused(q, k, v, g, lse2, dlt, dq_ws, _flat(dk), _flat(dv), dims, nq_pad, scale, (wl, wr),
                                deterministic, sfx, stream, backend, softcap):
        return None
    dq = arrays.empty(arrays.shape_of(q), kind, like=q)
    n_dq = n_rows * d
    # d256 / 192 / 128: the accumulator's runs are the head dim's halves / 64-column thirds, read as a d128 / d64
    # one with twice / three times the heads
    _launch(f"attention_bwd_tc_dq_reduce_d{dr}{sfx}", (max(1, min(-(-n_dq // 256), 8192)),), (256,), dq_ws, dq_ws,
            _flat(dq), n_dq, n_q, n_k, h * runs, nq_pad, 0, 0, 0, scale, wl, wr, 0, 1, stream=stream,
            backend=backend)
    return dq, dk, dv


def _sm90_varlen_fused(q, k, v, g, out, lse, dq, dk, dv, cq, ck, dims, scale, win, softcap, deterministic, sfx,
                       stream, backend):
    """flash_attention_varlen_backward on sm_90a, head_dim 64 / 96 / 128 / 256 and 192 / head_dim_v 128 (dims' 7th):
    the fused dK/dV/dQ kernel (attention_bwd_varlen_sm90_fused[_det]_<shape>[_softcap]). The packed rows are one batch of total_q queries to
    the pre-pass (delta, the (heads, nq_pad) lse / delta runs, the zeroed fp32 dQ accumulator, a token's row at
    its packed index) and to the narrowing kernel (times scale into dq). None (nothing but the pre-pass launched)
    when the packed arrays do not suit TMA."""
    batch, max_q, max_k, h, kvh, d = dims[:6]
    d_v = dims[6] if len(dims) > 6 else d
    total_q = arrays.shape_of(q)[0]
    n_rows = total_q * h
    nq_pad = _sm90_varlen_fused_pad(total_q)  # one query tile beyond total_q: the kernel's unchecked zero adds
    n_ws = h * nq_pad * d
    lse2 = arrays.zeros((h * nq_pad,), np.float32, like=q)
    dlt = arrays.zeros((h * nq_pad,), np.float32, like=q)
    # rows < total_q zeroed by the pre-pass; the rows past it take only zero adds and are never read. d256: the
    # runs are the head dim's halves, (heads, 2, nq_pad, 128) (192 / 128: thirds, (heads, 3, nq_pad, 64)), whose
    # rows < total_q are not the pre-pass's, so the workspace starts zeroed instead
    dr, runs = _sm90_fused_acc_split(d, d_v)
    dq_ws = (arrays.zeros if runs > 1 else arrays.empty)((n_ws,), np.float32, like=q)
    _launch("attention_bwd_tc_prep" + sfx, (-(-n_rows // 8),), (256,), _flat(g), _flat(out), _flat(lse), dlt, lse2,
            dlt, dq_ws, n_rows, total_q, h, nq_pad, d_v, 1, int(runs == 1), stream=stream, backend=backend)
    if not _sm90_varlen_backward_fused(q, k, v, g, lse2, dlt, dq_ws, _flat(dk), _flat(dv), cq, ck, dims, nq_pad,
                                       scale, win, softcap, deterministic, sfx, stream, backend):
        return None
    n_dq = n_rows * d
    wl, wr = win
    _launch(f"attention_bwd_tc_dq_reduce_d{dr}{sfx}", (max(1, min(-(-n_dq // 256), 8192)),), (256,), dq_ws, dq_ws,
            _flat(dq), n_dq, total_q, max_k, h * runs, nq_pad, 0, 0, 0, scale, wl, wr, 0, 1, stream=stream,
            backend=backend)
    return dq, dk, dv


def _fused(q, k, v, g, out, lse, kind, dims, scale, win, deterministic, backend, stream=None):
    """head_dim 64 / 128 on tensor cores, FlashAttention-2's backward: one kernel per key tile doing the five
    matmuls, dQ summed in an fp32 workspace (atomics; or, deterministic, per-key-tile partials reduced in a
    fixed order), then narrowed by a small kernel."""
    b, n_q, n_k, h, kvh, d = dims
    wl, wr, softcap = win
    cap = "_softcap" if softcap > 0 else ""
    sfx = _suffix(kind)
    br = _FUSED_BR[d]
    n_rows = b * n_q * h
    nq_pad = -(-n_q // br) * br
    lse2 = arrays.zeros((b * h * nq_pad,), np.float32, like=q)
    dlt = arrays.zeros((b * h * nq_pad,), np.float32, like=q)
    n_dq = n_rows * d
    n_ws = b * h * nq_pad * d  # (batch, head, nq_pad, head_dim): a tile's rows at compile-time strides
    dq_ws = arrays.empty((n_ws,), np.float32, like=q)
    if out is not None and lse is not None:
        delta_in = dlt  # unused (out given)
    else:
        G = group_lanes(d)
        lse = arrays.empty((n_rows,), np.float32, like=q)
        delta_in = arrays.empty((n_rows,), np.float32, like=q)
        _launch("attention_bwd_lse" + cap + sfx, (-(-n_q // (_FLASH_THREADS // G)), h, b), (_FLASH_THREADS,),
                _flat(q), _flat(k), _flat(v), _flat(g), lse, delta_in, n_q, n_k, h, kvh, d, scale, wl, wr, softcap,
                G, shared_mem=2 * _STAGE * d * 4, stream=stream, backend=backend)
        out = None
    _launch("attention_bwd_tc_prep" + sfx, (-(-n_rows // 8),), (256,), _flat(g),
            _flat(out if out is not None else g), _flat(lse), delta_in, lse2, dlt, dq_ws, n_rows, n_q, h, nq_pad, d,
            int(out is not None), 0 if deterministic else 1, stream=stream, backend=backend)
    dq = arrays.empty(arrays.shape_of(q), kind, like=q)
    dk = arrays.empty(arrays.shape_of(k), kind, like=q)
    dv = arrays.empty(arrays.shape_of(v), kind, like=q)
    n_kt = -(-n_k // _FUSED_BC)
    smem = fused_shared_bytes(d)
    head = (_flat(q), _flat(k), _flat(v), _flat(g), lse2, dlt)
    red_blocks = (max(1, min(-(-n_dq // 256), 8192)),)
    if not deterministic:
        _launch(f"attention_bwd_tc_fused_d{d}{cap}{sfx}", (n_kt, kvh, b), (_TC_THREADS,), *head, dq_ws,
                _flat(dk), _flat(dv), n_q, n_k, h, kvh, nq_pad, 0, 0, scale, wl, wr, softcap,
                shared_mem=smem, stream=stream, backend=backend)
        _launch(f"attention_bwd_tc_dq_reduce_d{d}{sfx}", red_blocks, (256,), dq_ws, dq_ws, _flat(dq), n_dq, n_q, n_k,
                h, nq_pad, 0, 0, 0, scale, wl, wr, 0, 1, stream=stream, backend=backend)
        return dq, dk, dv
    chunk = max(1, min(n_kt, DET_WORKSPACE_BYTES // (4 * n_ws)))
    part = arrays.empty((chunk * n_ws,), np.float32, like=q)
    for kt0 in range(0, n_kt, chunk):
        cnt = min(chunk, n_kt - kt0)
        _launch(f"attention_bwd_tc_fused_d{d}{cap}_det{sfx}", (cnt, kvh, b), (_TC_THREADS,), *head, part,
                _flat(dk), _flat(dv), n_q, n_k, h, kvh, nq_pad, kt0, n_ws, scale, wl, wr, softcap,
                shared_mem=smem, stream=stream, backend=backend)
        _launch(f"attention_bwd_tc_dq_reduce_d{d}{sfx}", red_blocks, (256,), part, dq_ws, _flat(dq), n_dq, n_q, n_k,
                h, nq_pad, kt0, cnt, n_ws, scale, wl, wr, int(kt0 == 0), int(kt0 + cnt == n_kt), stream=stream,
                backend=backend)
    return dq, dk, dv


@arrays.stream_scoped
def _backward_scale(scale: Any, d: int) -> float:
    """The backward's softmax scale (attention_backward and its varlen form): 1/sqrt(d) for None, else a finite
    number, rounded to fp32, the type the kernels take."""
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating)) or not math.isfinite(scale):
        raise ArgumentError(f"scale: expected a finite number, got {scale!r}")
    return float(np.float32(scale))


def attention_backward(
    q: Any,
    k: Any,
    v: Any,
    grad_out: Any,
    *,
    out: Any = None,
    lse: Any = None,
    scale: float | None = None,
    causal: bool = True,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    method: str = "auto",
    deterministic: bool = False,
    stream: Any = None,
    backend: str | None = None,
) -> tuple[Any, Any, Any]:
    """(dq, dk, dv) of out = softmax(scale * q k^T) v per (batch, head), given grad_out = dL/dout.

    q: (n_q, n_heads, head_dim) or (batch, n_q, n_heads, head_dim); k: (n_k, n_kv_heads, head_dim) with the
    same leading batch dimension; v: as k with head_dim_v <= head_dim columns, grad_out (and out) as q with
    head_dim_v columns (DeepSeek-V3's 192 / 128: the sm_90a kernels' own shape given out and lse; elsewhere the
    kernels run on v and grad_out padded with zero columns to head_dim, dv sliced back).
    Grouped-query attention: n_heads % n_kv_heads == 0, query head h uses kv
    head h // (n_heads // n_kv_heads). head_dim <= 256. Outputs have the
    inputs' dtype (f32, bf16 or f16), accumulation is fp32. scale defaults to
    1/sqrt(head_dim), as in `flash_attention`.

    causal=True (the default) aligns the mask bottom-right exactly like
    `flash_attention`: query i sees keys j <= i + n_k - n_q. When n_q > n_k the
    first n_q - n_k queries see no key: their dq is 0 and they add nothing to
    dk/dv. causal=False lets every query see every key.

    window_size=(left, right) and softcap: as `flash_attention` (flash-attn's semantics; pass the
    forward's values). Every kernel walks only the tiles the window reaches. With softcap c the
    gradient flows through c * tanh(x / c): dS is multiplied by 1 - tanh^2.

    method="naive": one block per (query, head), n_k <= NAIVE_MAX_SEQ;
    dk/dv are summed with fp32 atomics (on a GPU the summation order, hence
    the last bits, may vary run to run); `out`/`lse` are not needed.
    method="tensor_cores" (and "auto" for bf16 / f16 where mma.sync runs: sm_80+ on nvrtc, the host
    backend, numba): FlashAttention-2 on tensor cores (dK/dV summed over the GQA group inside one CTA);
    head_dim compiled as 64/96/128/256 (others padded). Pass the forward's `out`/`lse` (as training
    does): without them an fp32 pre-pass (not on tensor cores) computes lse and D exactly, which costs
    about a forward.
    At head_dim 64 / 128 (host backend, sm_80 ... sm_90) the tensor-core path is one fused kernel per key
    tile (kernels_cu/attention_bwd_tc_fused.cu): dQ is summed with fp32 atomics (on a GPU the last
    bits may vary run to run) unless deterministic=True, which sums per-key-tile partials in a fixed order
    (bit-identical run to run; more memory traffic, see docs/attention_tc.md). The torch autograd path sets
    it from torch.are_deterministic_algorithms_enabled().
    method="flash" (and "auto" otherwise): tiled over keys, any length, deterministic.
    It uses D = rowsum(grad_out * out) and each row's lse; when both `out` and
    `lse` are given (from `flash_attention(q, k, v, causal=, scale=,
    return_lse=True)` with the same causal and scale) they are used, otherwise
    a pre-pass kernel computes both from q, k, v and grad_out.
    """
    if method not in METHODS:
        raise ArgumentError(f"method: expected one of {METHODS}, got {method!r}")
    if not isinstance(deterministic, (bool, np.bool_)):
        raise ArgumentTypeError(f"deterministic: expected a bool, got {type(deterministic).__name__} "
                                f"{deterministic!r}")
    if not isinstance(causal, (bool, np.bool_)):
        raise ArgumentTypeError(f"causal: expected a bool, got {type(causal).__name__} {causal!r}")
    kind = arrays.io_kind("q", q, arrays.IO_KINDS)
    for name, a in (("k", k), ("v", v), ("grad_out", grad_out)):
        _same_kind(name, a, kind, "q")
    qs = tuple(arrays.check_ndim("q", q, (3, 4), ("(n_q, num_heads, head_dim)",
                                                           "(batch, n_q, num_heads, head_dim)")))
    ks = tuple(arrays.check_ndim("k", k, (len(qs),), ("(batch, " if len(qs) == 4 else "(")
                                 + "n_k, num_kv_heads, head_dim), as q"))
    batched = len(qs) == 4
    b = qs[0] if batched else 1
    n_q, h, d = qs[-3:]
    if ks[:-3] != qs[:-3] or ks[-1] != d:
        want = qs[:-3] + ("n_k", "n_kv_heads", d)
        raise ArgumentError(f"k: expected shape {want} (batch/head_dim of q), got {ks}")
    n_k, kvh = ks[-3], ks[-2]
    vs = tuple(arrays.check_ndim("v", v, (len(qs),), "as k, with head_dim_v last"))
    d_v = vs[-1]
    if vs[:-1] != ks[:-1]:
        raise ArgumentError(f"v: expected the shape of k {ks[:-1] + ('head_dim_v',)}, got {vs}")
    if not 1 <= d_v <= d:
        raise ArgumentError(f"v.shape[-1] (head_dim_v): expected 1 <= head_dim_v <= head_dim={d} (q and k), got {d_v}")
    gs = qs[:-1] + (d_v,)  # grad_out and out: head_dim_v columns
    _same_shape("grad_out", grad_out, gs, "out (q's with v's head_dim_v)")
    if not 1 <= d <= MAX_HEAD_DIM:
        raise ArgumentError(f"q.shape[-1] (head_dim): expected 1..{MAX_HEAD_DIM}, got {d}")
    if h < 1 or kvh < 1 or h % kvh:
        raise ArgumentError(f"k.shape[-2] (n_kv_heads): expected a divisor of n_heads={h}, got {kvh}")
    if h > _GRID_YZ_MAX or b > _GRID_YZ_MAX:
        raise ArgumentError(f"q: expected n_heads and batch <= {_GRID_YZ_MAX}, got n_heads={h}, batch={b}")
    # The kernels step query/key tiles in unsigned int (i0 + rows_per_block, j0 += 16) and take
    # window bounds in int: a 256-row margin below 2^31 keeps those from wrapping.
    for name, n in (("q.shape[-3] (seq_len)", n_q), ("k.shape[-3] (seq_len)", n_k)):
        if n > _INT_MAX - 256:
            raise ArgumentError(f"{name}: expected at most {_INT_MAX - 256}, got {n}")
    left, right = _check_window_size(window_size)
    softcap = _check_softcap(softcap)
    scale = _backward_scale(scale, d)
    if out is not None:
        _same_kind("out", out, kind, "q")
        _same_shape("out", out, gs, "out (q's with v's head_dim_v)")
        out = arrays.contiguous(out)
    if lse is not None:
        arrays.io_kind("lse", lse, ("f32",))
        ls = tuple(arrays.shape_of(lse))
        if ls not in ((b, n_q, h), qs[:-1]):
            raise ArgumentError(f"lse: expected shape {qs[:-1]} or {(b, n_q, h)} (float32), got {ls}")
        lse = arrays.contiguous(lse)
    q, k, v, grad_out = (arrays.contiguous(a) for a in (q, k, v, grad_out))
    if b * n_q * h == 0 or n_k == 0:  # nothing to launch: no query or no key gives zero gradients
        return (arrays.zeros(qs, kind, like=q), arrays.zeros(ks, kind, like=q), arrays.zeros(vs, kind, like=q))
    dims = (b, n_q, n_k, h, kvh, d)
    win = (*_normalize(left, right, bool(causal), n_q, n_k), softcap)
    stream = arrays.launch_stream(stream, q)
    if d_v != d:
        # head_dim_v < head_dim (DeepSeek-V3's 192 / 128): the sm_90a kernels' DV (given the forward's out and lse:
        # the lse pre-pass reads v at head_dim)
        if (method in ("auto", "tensor_cores") and kind != "f32" and out is not None and lse is not None
                and tensor_cores_available(backend)
                and _sm90_backward_usable(d, softcap, scale, q, backend, k, v, grad_out, d_v=d_v)):
            # the fused dK/dV/dQ kernel where it applies (softcap or not), else the dK/dV + dQ pair
            if _sm90_fused_usable(d, softcap, scale, q, backend, k, v, grad_out, d_v=d_v):
                grads = _sm90_fused(q, k, v, grad_out, out, lse, kind, (*dims, d_v), scale, win,
                                    bool(deterministic), backend, stream)
                if grads is not None:
                    return grads
            grads = _tensor_cores(q, k, v, grad_out, out, lse, kind, (*dims, d_v), scale, win, backend, stream)
            if grads is not None:
                return grads
        # Every other kernel reads v, dO and out at one head_dim: zero columns up to head_dim leave P, dP, delta,
        # hence dQ and dK, as they are, and add zero columns to dV, dropped here (one more copy of each).
        out_d = None if out is None else arrays.pad_last(out, d)
        dq, dk, dv = attention_backward(q, k, arrays.pad_last(v, d), arrays.pad_last(grad_out, d), out=out_d,
                                        lse=lse, scale=scale, causal=causal, window_size=window_size,
                                        softcap=softcap, method=method, deterministic=deterministic, stream=stream,
                                        backend=backend)
        return dq, dk, arrays.narrow_last(dv, d_v)
    if method == "naive":
        return _naive(q, k, v, grad_out, kind, dims, scale, win, backend, stream)
    if method in ("auto", "tensor_cores") and kind != "f32":
        if tensor_cores_available(backend):
            # On sm_90a the wgmma kernels come first: the fused dK/dV/dQ kernel where it applies (dQ by atomics,
            # or semaphore-ordered when deterministic), else the dK/dV + dQ pair (in _tensor_cores, after its
            # pre-pass), where every output element has one writer.
            hopper = _sm90_backward_usable(d, softcap, scale, q, backend, k, v, grad_out)
            if hopper and _sm90_fused_usable(d, softcap, scale, q, backend, k, v, grad_out):
                grads = _sm90_fused(q, k, v, grad_out, out, lse, kind, dims, scale, win, bool(deterministic),
                                    backend, stream)
                if grads is not None:
                    return grads
            if d in FUSED_HEAD_DIMS and fused_available(backend) and not hopper:
                return _fused(q, k, v, grad_out, out, lse, kind, dims, scale, win, bool(deterministic), backend,
                              stream)
            return _tensor_cores(q, k, v, grad_out, out, lse, kind, dims, scale, win, backend, stream)
        if method == "tensor_cores":
            raise ArgumentError(f"method: 'tensor_cores' needs {kind} mma (sm_80 or newer); this device has none")
    elif method == "tensor_cores":
        raise ArgumentError(f"method: 'tensor_cores' needs bf16 or f16 inputs, got {arrays.dtype_name(q)}")
    return _flash(q, k, v, grad_out, out, lse, kind, dims, scale, win, backend, stream)


# --------------------------------------------------------------------------- flash_attention_varlen_backward


@arrays.stream_scoped
def flash_attention_varlen_backward(
    q: Any,
    k: Any,
    v: Any,
    grad_out: Any,
    cu_seqlens_q: Any,
    cu_seqlens_k: Any,
    *,
    out: Any,
    lse: Any,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    causal: bool = False,
    scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    deterministic: bool = False,
    stream: Any = None,
    backend: str | None = None,
) -> tuple[Any, Any, Any]:
    """(dq, dk, dv) of `flash_attention_varlen`, given grad_out = dL/dout: packed sequences, flash-attn's layout.

    q (total_q, num_heads, head_dim); k (total_k, num_kv_heads, head_dim); v (total_k, num_kv_heads, head_dim_v)
    and grad_out, out (total_q, num_heads, head_dim_v), head_dim_v <= head_dim (192 / 128 on sm_90a: its own
    kernels; elsewhere v and grad_out padded with zero columns to head_dim, dv sliced back); lse (total_q,
    num_heads) float32, the forward's (`flash_attention_varlen(..., return_lse=True)`). Sequence b is q rows
    cu_seqlens_q[b]:cu_seqlens_q[b+1] against k / v rows cu_seqlens_k[b]:cu_seqlens_k[b+1]; cu_seqlens_q and
    cu_seqlens_k are int32 (batch + 1,), start at 0, never decrease and end at total_q / total_k. A sequence may be
    empty (its gradients are 0). causal, window_size, softcap and scale: the forward's values, per sequence, the
    causal mask aligned bottom-right as `flash_attention`. GQA: num_heads % num_kv_heads == 0.

    max_seqlen_q / max_seqlen_k size the grid (a CTA per 64-row tile of the longest sequence, batch and head;
    CTAs past a sequence's end exit). None reads them from cu_seqlens, which must then be on the host; with
    device cu_seqlens pass them (as flash-attn's callers do): no value is read back to the host.

    bf16 or f16 on the tensor-core kernels (kernels_cu/attention_bwd_tc.cu, attention_bwd_varlen_tc_*: the dense
    backward's dK/dV and dQ kernels with a per-sequence prologue): fp32 accumulation, one writer per output
    element (deterministic), dK / dV summed over the GQA group inside one CTA. sm_80 or newer on the nvrtc
    backend, the host backend, numba. On sm_90a at head_dim 64 / 96 / 128 / 256 (head_dim_v = head_dim) and 192 /
    128, softcap or not, one fused wgmma kernel per key tile computes dK, dV and adds dQ's partials into an fp32 accumulator (red.global.add.f32, the
    summation order varying run to run; deterministic=True: added in key-tile order per (sequence, head, query
    tile) through semaphores, bit-identical run to run).
    float32 (every arch and backend): kernels_cu/attention_bwd_fma.cu's attention_bwd_varlen_fma_dkdv / _dq, the
    dense fp32-FMA backward's kernels (`attention_backward(method="flash")`) with the same per-sequence prologue
    (host or device cu_seqlens alike, read on the device): one writer per output element (deterministic), dK /
    dV summed over the GQA group inside one CTA.
    """
    from ._prefill import check_cu_seqlens, check_max_seqlen

    kind = arrays.io_kind("q", q, ("bf16", "f16", "f32"))
    for name, a in (("k", k), ("v", v), ("grad_out", grad_out), ("out", out)):
        _same_kind(name, a, kind, "q")
    total_q, h, d = arrays.check_ndim("q", q, (3,), "(total_q, num_heads, head_dim)")
    ks = tuple(arrays.check_ndim("k", k, (3,), "(total_k, num_kv_heads, head_dim)"))
    total_k, kvh = ks[0], ks[1]
    if ks[2] != d:
        raise ArgumentError(f"k: expected shape (total_k, num_kv_heads, {d}) (head_dim of q), got {ks}")
    vs = tuple(arrays.check_ndim("v", v, (3,), "(total_k, num_kv_heads, head_dim_v)"))
    d_v = vs[2]
    if vs[:2] != ks[:2]:
        raise ArgumentError(f"v: expected the shape of k ({ks[0]}, {ks[1]}, head_dim_v), got {vs}")
    if not 1 <= d_v <= d:
        raise ArgumentError(f"v.shape[2] (head_dim_v): expected 1 <= head_dim_v <= head_dim={d} (q and k), got {d_v}")
    qs = (total_q, h, d)
    _same_shape("grad_out", grad_out, (total_q, h, d_v), "out (q's with v's head_dim_v)")
    _same_shape("out", out, (total_q, h, d_v), "out (q's with v's head_dim_v)")
    arrays.io_kind("lse", lse, ("f32",))
    if tuple(arrays.shape_of(lse)) != (total_q, h):
        raise ArgumentError(f"lse: expected shape {(total_q, h)} (total_q, num_heads) float32, "
                            f"got {tuple(arrays.shape_of(lse))}")
    if not 1 <= d <= MAX_HEAD_DIM:
        raise ArgumentError(f"q.shape[2] (head_dim): expected 1..{MAX_HEAD_DIM}, got {d}")
    if h < 1 or kvh < 1 or h % kvh:
        raise ArgumentError(f"k.shape[1] (num_kv_heads): expected a divisor of num_heads={h}, got {kvh}")
    cq, hq = check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, None, "", total_q, "total_q")
    batch = arrays.shape_of(cq)[0] - 1
    ck, hk = check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, batch + 1, "the length of cu_seqlens_q", total_k,
                               "total_k")
    max_q = check_max_seqlen("max_seqlen_q", max_seqlen_q, hq, "cu_seqlens_q")
    max_k = check_max_seqlen("max_seqlen_k", max_seqlen_k, hk, "cu_seqlens_k")
    if not isinstance(causal, (bool, np.bool_)):
        raise ArgumentTypeError(f"causal: expected a bool, got {type(causal).__name__} {causal!r}")
    left, right = _check_window_size(window_size)
    softcap = _check_softcap(softcap)
    if not isinstance(deterministic, (bool, np.bool_)):
        raise ArgumentTypeError(f"deterministic: expected a bool, got {type(deterministic).__name__} {deterministic!r}")
    scale = _backward_scale(scale, d)
    D = tc_head_dim(d)
    # CTA rows: the fp32 kernels' 256 / group_lanes keys or queries, the tensor-core kernels' 64
    rows_k, rows_q = (_FLASH_THREADS // group_lanes(d),) * 2 if kind == "f32" else (_TC_BC, _TC_QR)
    kv_grid = batch * kvh * -(-max_k // rows_k)
    q_grid = batch * h * -(-max_q // rows_q)
    for name, n in (("max_seqlen_k", kv_grid), ("max_seqlen_q", q_grid)):
        if n > _INT_MAX:  # the kernels' 1-D grid
            raise ArgumentError(f"{name}: batch * heads * tiles = {n} CTAs exceeds {_INT_MAX}")
    wl, wr = _normalize_serving(left, right, bool(causal))  # unbounded = 2^30; the kernels clamp per sequence
    # Rows outside every sequence (device cu_seqlens, unchecked) get no writer: start from zeros there.
    alloc = arrays.empty if hq is not None and hk is not None else arrays.zeros
    if kind == "f32":
        return _varlen_f32(q, k, v, grad_out, out, lse, cq, ck, (batch, max_q, max_k, h, kvh, d, d_v),
                           (kv_grid, q_grid), scale, (wl, wr), softcap, alloc, stream, backend)
    if not tensor_cores_available(backend):
        raise ArgumentError(f"q: the varlen backward runs on {kind} mma (sm_80 or newer); this device has none")
    q, k, v, grad_out, out, lse = (arrays.contiguous(a) for a in (q, k, v, grad_out, out, lse))
    dq = alloc(qs, kind, like=q)
    dk = alloc(ks, kind, like=q)
    dv = alloc(vs, kind, like=q)
    if total_q * h == 0 or total_k == 0 or batch == 0:
        for a in (dq, dk, dv):
            _fill(a, 0.0)
        return dq, dk, dv
    stream = arrays.launch_stream(stream, q)
    sfx = _suffix(kind)
    cap = "_softcap" if softcap > 0 else ""
    n_rows = total_q * h
    if _sm90_fused_usable(d, softcap, scale, q, backend, k, v, grad_out, d_v=d_v):
        grads = _sm90_varlen_fused(q, k, v, grad_out, out, lse, dq, dk, dv, cq, ck,
                                   (batch, max_q, max_k, h, kvh, d, d_v), scale, (wl, wr), softcap, bool(deterministic),
                                   sfx, stream, backend)
        if grads is not None:
            return grads
    delta = arrays.empty((n_rows,), np.float32, like=q)
    _launch("attention_bwd_preprocess" + sfx, (-(-n_rows // (_FLASH_THREADS // 32)),), (_FLASH_THREADS,),
            _flat(grad_out), _flat(out), delta, n_rows, d_v, stream=stream, backend=backend)
    if max_q == 0 and max_k == 0:
        return dq, dk, dv
    # On sm_90a the wgmma kernels (kernels_cu/attention_bwd_sm90.cu, VL: head_dim 64 / 96 / 128 and 192 / 128)
    # where they apply
    if _sm90_varlen_backward(q, k, v, grad_out, _flat(lse), delta, _flat(dq), _flat(dk), _flat(dv), cq, ck,
                             (batch, max_q, max_k, h, kvh, d, d_v), scale, wl, wr, softcap, sfx, stream, backend):
        return dq, dk, dv
    if d_v != d:
        # The mma.sync kernels read v and dO at one head_dim: zero columns up to head_dim leave P, dP (delta is
        # computed above), hence dQ and dK, as they are and add zero columns to dV, dropped here (one more copy
        # of v, dO and dV).
        v, grad_out, dv_d = arrays.pad_last(v, d), arrays.pad_last(grad_out, d), alloc(ks, kind, like=q)
    else:
        dv_d = dv
    smem_kv, smem_q = tc_backward_shared_bytes(D)
    args = (_flat(q), _flat(k), _flat(v), _flat(grad_out), _flat(lse), delta)
    tail = (cq, ck, batch, max_q, max_k, h, kvh, d, scale, wl, wr, softcap)
    names = ((f"attention_bwd_varlen_tc_dv_d{D}{cap}{sfx}", f"attention_bwd_varlen_tc_dk_d{D}{cap}{sfx}")
             if D == 256 else (f"attention_bwd_varlen_tc_dkdv_d{D}{cap}{sfx}",))
    if kv_grid:
        for name in names:
            _launch(name, (kv_grid,), (_TC_THREADS,), *args, _flat(dk), _flat(dv_d), *tail, shared_mem=smem_kv,
                    stream=stream, backend=backend)
    if q_grid:
        _launch(f"attention_bwd_varlen_tc_dq_d{D}{cap}{sfx}", (q_grid,), (_TC_THREADS,), *args, _flat(dq), *tail,
                shared_mem=smem_q, stream=stream, backend=backend)
    return dq, dk, (dv if dv_d is dv else arrays.narrow_last(dv_d, d_v))


def _varlen_f32(q, k, v, g, out, lse, cq, ck, dims, grids, scale, win, softcap, alloc, stream, backend):
    """float32 varlen backward: the delta pre-pass, then attention_bwd_varlen_fma_dkdv (a CTA per key tile, kv head
    and sequence) and attention_bwd_varlen_fma_dq (a CTA per query tile, head and sequence): the dense fp32-FMA
    kernels with a prologue that reads the sequence's bounds from cu_seqlens on the device, so host and device
    cu_seqlens take one path and nothing is read back. Empty sequences get zero gradients from their CTAs."""
    batch, max_q, max_k, h, kvh, d, d_v = dims
    kv_grid, q_grid = grids
    q, k, v, g, out, lse = (arrays.contiguous(a) for a in (q, k, v, g, out, lse))
    total_q, total_k = arrays.shape_of(q)[0], arrays.shape_of(k)[0]
    dq = alloc(tuple(arrays.shape_of(q)), "f32", like=q)
    dk = alloc(tuple(arrays.shape_of(k)), "f32", like=q)
    dv = alloc(tuple(arrays.shape_of(v)), "f32", like=q)
    if total_q * h == 0 or total_k == 0 or batch == 0:
        for a in (dq, dk, dv):
            _fill(a, 0.0)
        return dq, dk, dv
    stream = arrays.launch_stream(stream, q)
    n_rows = total_q * h
    delta = arrays.empty((n_rows,), np.float32, like=q)
    _launch("attention_bwd_preprocess", (-(-n_rows // (_FLASH_THREADS // 32)),), (_FLASH_THREADS,), _flat(g),
            _flat(out), delta, n_rows, d_v, stream=stream, backend=backend)
    if d_v != d:
        # the fp32 kernels read v and dO at one head_dim: zero columns up to head_dim leave P and dP (delta is
        # computed above), hence dQ and dK, as they are and add zero columns to dV, dropped below
        v, g, dv_d = arrays.pad_last(v, d), arrays.pad_last(g, d), alloc(tuple(arrays.shape_of(k)), "f32", like=q)
    else:
        dv_d = dv
    cap = "_softcap" if softcap > 0 else ""
    args = (_flat(q), _flat(k), _flat(v), _flat(g), _flat(lse), delta)
    tail = (cq, ck, batch, max_q, max_k, h, kvh, d, scale, *win, softcap, group_lanes(d))
    if kv_grid:
        _launch("attention_bwd_varlen_fma_dkdv" + cap, (kv_grid,), (_FLASH_THREADS,), *args, _flat(dk), _flat(dv_d),
                *tail, shared_mem=(2 * _STAGE * d + 2 * _STAGE) * 4, stream=stream, backend=backend)
    if q_grid:
        _launch("attention_bwd_varlen_fma_dq" + cap, (q_grid,), (_FLASH_THREADS,), *args, _flat(dq), *tail,
                shared_mem=2 * _STAGE * d * 4, stream=stream, backend=backend)
    return dq, dk, (dv if dv_d is dv else arrays.narrow_last(dv_d, d_v))
