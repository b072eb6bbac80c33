"""FP8 block-scaled GEMMs in DeepSeek-V3's scaling convention (DeepGEMM's operands): kernels_cu/gemm_fp8.cu.

- `fp8_quantize(x)`: per 1 x 128 tile of each row, scale = max(amax, 1e-10) / 448 and x_fp8 = e4m3(x / scale)
  (round to nearest even, saturated): vLLM's per_token_group_quant_fp8 (DeepGEMM's reference casts clamp amax
  at 1e-4 instead; either way an all-zero tile gets a tiny positive scale and zero codes).
- `gemm_fp8(a, a_scale, b, b_scale)`: out [M, N] bf16 = a (M, K) e4m3 x a_scale (M, K/128) times b (N, K) e4m3
  x b_scale (ceil(N/128), K/128), each 128-wide k-block's tensor-core partial scaled into an fp32 accumulator.
- `grouped_gemm_fp8(..., offsets)`: the same per group of rows, b (E, N, K), b_scale (E, ceil(N/128), K/128),
  offsets int32 [E + 1] as pykern.ops.grouped_gemm's.

FP8 arrays are float8_e4m3fn: ml_dtypes.float8_e4m3fn NumPy arrays or torch.float8_e4m3fn tensors (the kernels
read their bytes). On a compute-capability 9.0 GPU (device arrays) and on the host backend with
PYKERN_HOST_ARCH=sm_90a the GEMMs run grouped_gemm_fp8_sm90 (kernels_cu/grouped_gemm_sm90.cu: TMA, QGMMA, a
warp-specialised persistent CTA; gemm_fp8 as one group); elsewhere mma.sync .e4m3 (sm_89 or newer on the nvrtc
backend; the host backend emulates it and numba runs the reference). Both load 16-byte chunks: an operand whose
base is off 16 bytes (a view into a bigger buffer) is copied to a fresh, aligned buffer first.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .. import arrays
from ..errors import ArgumentError, ArgumentTypeError
from ._common import check_offsets

__all__ = ["fp8_quantize", "gemm_fp8", "grouped_gemm_fp8"]

BLOCK = 128  # the scale block along K (and along N for b)
E4M3_MAX = 448.0
BM, BN = 64, 128  # GF_BM / GF_BN: the GEMM's CTA tile
SM90_BM, SM90_BN = 128, 128  # grouped_gemm_fp8_sm90's tile (GG90_BM; its FP8 BN)
SM90_STAGES = 6  # its ring: stages of 128 A rows and 128 B rows of 128 bytes
# the ring, each stage's SM90_BM pre-multiplied fp32 scales, the mbarriers
SM90_SMEM_FIXED = SM90_STAGES * (SM90_BM + SM90_BN) * 128 + SM90_STAGES * SM90_BM * 4 + 2 * SM90_STAGES * 8
THREADS = 256  # GF_THREADS
SMEM = 3 * (BM + BN) * 144  # GF_SMEM_BYTES: 3 stages of A and B tiles, rows of 128 + 16 bytes
_QWARPS = 8  # warps a quantize block (256 threads), one 1 x 128 tile a warp
_INT_MAX = 2**31 - 1
_GRID_YZ_MAX = 65535
_E4M3 = "float8_e4m3fn"


def _launch(name: str, grid: Any, block: Any, *args: Any, shared_mem: int = 0, stream: Any = None,
            backend: str | None = None) -> None:
    from ..launcher import launch

    launch(name, grid, block, *args, shared_mem=shared_mem, stream=stream, backend=backend)


def _bytes(a: Any) -> Any:
    """A contiguous float8 array as a flat uint8 array over the same memory (the kernels take bytes)."""
    if isinstance(a, np.ndarray):
        return a.reshape(-1).view(np.uint8)
    if arrays.is_torch(a):
        return a.detach().reshape(-1).view(arrays.torch_module().uint8)
    cai = getattr(a, "__cuda_array_interface__", None)
    if cai is not None:
        return arrays.DeviceView(int(cai["data"][0]), (arrays.size(tuple(cai["shape"])),), "|u1", a)
    return arrays.host_view(a).reshape(-1).view(np.uint8)


def _fp8_arg(name: str, a: Any, layout: str, ndim: int) -> tuple[int, ...]:
    got = arrays.dtype_name(a, name)
    if got != _E4M3:
        raise ArgumentTypeError(f"{name}: expected dtype float8_e4m3fn (torch.float8_e4m3fn or "
                                f"ml_dtypes.float8_e4m3fn), got {got}")
    return tuple(arrays.check_ndim(name, a, (ndim,), layout))


def _scale_arg(name: str, s: Any, want: tuple[int, ...], layout: str) -> Any:
    got = arrays.dtype_name(s, name)
    if got != "float32":
        raise ArgumentTypeError(f"{name}: expected dtype float32, got {got}")
    shp = tuple(arrays.shape_of(s, name))
    if shp != want:
        raise ArgumentError(f"{name}: expected shape {want} {layout}, got {shp}")
    return arrays.contiguous(s)


def _check_k(k: int, name: str) -> None:
    if k % BLOCK:
        raise ArgumentError(f"{name} (K): expected a multiple of {BLOCK} (the scale block), got {k}")


def _check_sizes(m: int, n: int, k: int) -> None:
    for name, v in (("a.shape[0] (M)", m), ("N", n), ("K", k)):
        if v > _INT_MAX - 256:
            raise ArgumentError(f"{name}: expected at most {_INT_MAX - 256}, got {v}")
    if -(-n // BN) > _GRID_YZ_MAX:
        raise ArgumentError(f"N: expected at most {_GRID_YZ_MAX * BN}, got {n}")


def fp8_mma_available(backend: str | None = None) -> tuple[bool, str]:
    """(usable, the device's arch) for the mma .e4m3 kernels: the nvrtc backend needs sm_89 or newer; the host
    backend emulates the instruction and numba runs the reference (("", True) there)."""
    from ..backends import get_backend

    be = get_backend(backend)
    if be.name != "nvrtc":
        return True, ""
    ok, why = be.available()
    arch = getattr(be, "arch", "") or ""
    if not ok:
        return False, why
    digits = "".join(c for c in arch[3:] if c.isdigit())
    return bool(digits) and int(digits) >= 89, arch


def _require_fp8_mma(backend: str | None) -> None:
    ok, arch = fp8_mma_available(backend)
    if not ok:
        raise ArgumentError(f"backend: gemm_fp8 runs mma.sync .e4m3, which needs sm_89 or newer (Ada, Hopper, "
                            f"Blackwell); this device is {arch or 'unknown'}")


@arrays.stream_scoped
def fp8_quantize(x: Any, block: int = BLOCK, *, stream: Any = None, backend: str | None = None) -> tuple[Any, Any]:
    """(x_fp8 float8_e4m3fn [M, K], scales float32 [M, K / 128]) of x [M, K] (float32, bfloat16 or float16).

    Per 1 x 128 tile of a row: scale = max(amax, 1e-10) / 448, x_fp8 = x / scale rounded to the nearest e4m3
    (ties to even) and saturated to +-448, as vLLM's per_token_group_quant_fp8. x_fp8 is the caller's kind:
    a torch.float8_e4m3fn tensor for a tensor, an ml_dtypes.float8_e4m3fn NumPy array for NumPy.
    """
    if isinstance(block, bool) or block != BLOCK:
        raise ArgumentError(f"block: expected {BLOCK} (DeepSeek-V3's 1 x 128 tiles), got {block!r}")
    kind = arrays.io_kind("x", x, arrays.IO_KINDS)
    m, k = arrays.check_ndim("x", x, (2,), "(M, K)")
    _check_k(k, "x.shape[1]")
    if m > _INT_MAX or k > _INT_MAX:
        raise ArgumentError(f"x: expected at most {_INT_MAX} rows and columns, got {(m, k)}")
    x = arrays.contiguous(x)
    q = arrays.empty((m, k), arrays._ml_dtype(_E4M3), like=x)
    scales = arrays.empty((m, k // BLOCK), "float32", like=x)
    tiles = m * (k // BLOCK)
    if tiles:
        grid = (min(-(-tiles // _QWARPS), 65536),)
        _launch("gemm_fp8_quantize" + arrays.kernel_suffix(kind), grid, (32 * _QWARPS,), x.reshape(-1), _bytes(q),
                scales.reshape(-1), m, k, stream=arrays.launch_stream(stream, x), backend=backend)
    return q, scales


def _try_sm90(a: Any, a_scale: Any, b: Any, b_scale: Any, offsets: Any, out: Any, m: int, n: int, k: int,
              n_groups: int, stream: Any, backend: str | None) -> bool:
    """Run grouped_gemm_fp8_sm90 when the sm_90a kernels are usable (compute capability 9.0 with device arrays,
    or the host backend playing sm_90a) and TMA takes the operands; False (nothing launched) otherwise. a [m, k]
    and b [n_groups, n, k] contiguous e4m3, offsets int32 [n_groups + 1] on a's memory (None: gemm_fp8, one group
    of all m rows), out bf16 [m, n]."""
    from ..backends import get_backend, kernel_variant
    from ..devices import HOST, META, array_device
    from ..launcher import launch
    from ..tensormap import make_tensor_map
    from . import _moe_sm90 as sm90

    be = get_backend(backend)
    if be.name not in ("host", "nvrtc") or n_groups > sm90.MAX_GROUPS:
        return False
    dev = array_device(a)
    # A tensor map holds a device address: host arrays on the nvrtc backend (staged only at launch) keep mma.sync.
    if be.name == "nvrtc" and any(array_device(x) in (HOST, META) for x in (a, b, out)):
        return False
    devno = dev if isinstance(dev, int) and dev >= 0 else 0
    if not kernel_variant("sm_90a", be.name, devno):
        return False
    tiles = (m // SM90_BM + n_groups) * -(-n // SM90_BN)  # >= sum_e ceil(m_e / 128) * ceil(n / 128)
    if tiles > _INT_MAX:  # the kernel's tile indices are int32
        return False
    try:  # boxes of 128 k-bytes (one 128B-swizzled row, one scale block) by 128 rows
        ta = make_tensor_map(_bytes(a).reshape((m, k)), (SM90_BM, BLOCK), "128B", backend=be.name)
        tb = make_tensor_map(_bytes(b).reshape((n_groups, n, k)), (1, SM90_BN, BLOCK), "128B", backend=be.name)
    except ArgumentError:  # e.g. strides or sizes TMA cannot describe (bases are aligned by then): mma.sync
        return False
    if offsets is None:
        offsets = arrays.to_like(np.array([0, m], np.int32), a)
    grid = max(1, min(tiles, sm90._sm_count(be.name, devno)))
    launch("grouped_gemm_fp8_sm90", grid, sm90.THREADS, ta, tb, a_scale.reshape(-1), b_scale.reshape(-1), offsets,
           out.reshape(-1), m, n, k, n_groups, shared_mem=SM90_SMEM_FIXED + 4 * (n_groups + 1), stream=stream,
           backend=backend)
    return True


def _aligned(name: str, a: Any) -> Any:
    """`a`, or an aligned copy of it when its base is off 16 bytes: both GEMM kernels load 16-byte chunks (mma.sync
    by cp.async, the sm_90a one by TMA), which fault on a misaligned address (e.g. a view at an odd byte offset
    into a bigger buffer). Rows are K bytes, K a multiple of 128, so an aligned base aligns every chunk."""
    if arrays.aligned16(a):
        return a
    copy = arrays.aligned_copy(a)
    if copy is None:
        raise ArgumentError(f"{name}: the FP8 GEMMs load 16-byte chunks: expected a 16-byte aligned base address, "
                            f"got {arrays.data_address(a)} (this kind of array cannot be copied here)")
    return copy


def _operands(a: Any, b: Any, m: int, n: int, k: int, backend: str | None) -> tuple[Any, Any, Any]:
    """(a, b, result or None): contiguous operands, and the whole result when no kernel is needed (an empty one;
    zeros for K = 0); otherwise the backend must have the FP8 mma (ArgumentError naming it)."""
    a, b = _aligned("a", arrays.contiguous(a)), _aligned("b", arrays.contiguous(b))
    if m == 0 or n == 0:
        return a, b, arrays.empty((m, n), "bf16", like=a)
    if k == 0:
        return a, b, arrays.zeros((m, n), "bf16", like=a)
    _require_fp8_mma(backend)
    return a, b, None


@arrays.stream_scoped
def gemm_fp8(a: Any, a_scale: Any, b: Any, b_scale: Any, *, stream: Any = None, backend: str | None = None) -> Any:
    """out [M, N] bfloat16 = sum over 128-wide k-blocks kb of (a[:, kb] @ b[:, kb]^T) * a_scale[:, kb] *
    b_scale[n // 128, kb] (DeepGEMM's fp8 GEMM with fp32 promotion per k-block).

    a [M, K] and b [N, K] float8_e4m3fn; a_scale [M, K / 128] and b_scale [ceil(N / 128), K / 128] float32;
    K a multiple of 128.
    """
    m, k = _fp8_arg("a", a, "(M, K)", 2)
    n, kb = _fp8_arg("b", b, "(N, K)", 2)
    if kb != k:
        raise ArgumentError(f"b: expected shape (N, {k}) (K of a), got {(n, kb)}")
    _check_k(k, "a.shape[1]")
    a_scale = _scale_arg("a_scale", a_scale, (m, k // BLOCK), "(M, K / 128)")
    b_scale = _scale_arg("b_scale", b_scale, (-(-n // BLOCK), k // BLOCK), "(ceil(N / 128), K / 128)")
    _check_sizes(m, n, k)
    a, b, out = _operands(a, b, m, n, k, backend)
    if out is not None:
        return out
    out = arrays.empty((m, n), "bf16", like=a)
    st = arrays.launch_stream(stream, a)
    if _try_sm90(a, a_scale, b, b_scale, None, out, m, n, k, 1, st, backend):
        return out
    _launch("gemm_fp8", (-(-m // BM), -(-n // BN)), (THREADS,), _bytes(a), a_scale.reshape(-1), _bytes(b),
            b_scale.reshape(-1), out.reshape(-1), m, n, k, shared_mem=SMEM,
            stream=arrays.launch_stream(stream, a), backend=backend)
    return out


@arrays.stream_scoped
def grouped_gemm_fp8(a: Any, a_scale: Any, b: Any, b_scale: Any, offsets: Any, *, stream: Any = None,
                     backend: str | None = None) -> Any:
    """Grouped gemm_fp8: rows offsets[e]:offsets[e+1] of the [M, N] bfloat16 result use b[e] and b_scale[e].

    a [M, K] float8_e4m3fn with a_scale [M, K / 128]; b [E, N, K] float8_e4m3fn with b_scale
    [E, ceil(N / 128), K / 128]; offsets int32 [E + 1] (0 first, M last, non-decreasing, empty groups allowed;
    checked when it lives on the host, as pykern.ops.grouped_gemm's).
    """
    m, k = _fp8_arg("a", a, "(M, K)", 2)
    e, n, kb = _fp8_arg("b", b, "(E, N, K)", 3)
    if kb != k:
        raise ArgumentError(f"b: expected shape (E, N, {k}) (K of a), got {(e, n, kb)}")
    _check_k(k, "a.shape[1]")
    a_scale = _scale_arg("a_scale", a_scale, (m, k // BLOCK), "(M, K / 128)")
    b_scale = _scale_arg("b_scale", b_scale, (e, -(-n // BLOCK), k // BLOCK), "(E, ceil(N / 128), K / 128)")
    offsets = check_offsets(offsets, e, m)
    _check_sizes(m, n, k)
    if e > _INT_MAX - m // BM:
        raise ArgumentError(f"b.shape[0] (E): expected at most {_INT_MAX - m // BM}, got {e}")
    a, b, out = _operands(a, b, m, n, k, backend)
    if out is not None:
        return out
    out = arrays.empty((m, n), "bf16", like=a)
    if _try_sm90(a, a_scale, b, b_scale, offsets, out, m, n, k, e, arrays.launch_stream(stream, a), backend):
        return out
    _launch("gemm_fp8_grouped", (m // BM + e, -(-n // BN)), (THREADS,), _bytes(a), a_scale.reshape(-1), _bytes(b),
            b_scale.reshape(-1), offsets, out.reshape(-1), m, n, k, e, shared_mem=SMEM,
            stream=arrays.launch_stream(stream, a), backend=backend)
    return out
