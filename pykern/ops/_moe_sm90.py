"""Dispatch to the Hopper (sm_90a) grouped GEMM, kernels_cu/grouped_gemm_sm90.cu.

`grouped_gemm` (both layouts), `moe_experts` (both grouped GEMMs, the gate_up one with its activation fused) and
`moe_experts_backward` (d(x_perm), layout "nn") ask `try_launch` first on their tensor-core path, and
`grouped_gemm_wgrad_tc` asks `try_launch_wgrad`: on a compute-capability 9.0 GPU (nvrtc, device arrays) or with
PYKERN_HOST_ARCH=sm_90a (host backend), bf16 / f16, every TMA source's row stride a multiple of 16 bytes (K, and
for layout "nn" N; the weight gradient's N1 and N2: multiples of 8) and 16-byte aligned bases, it runs the TMA +
wgmma kernel; anything else keeps the mma.sync kernels of kernels_cu/moe.cu (as on sm_80 / sm_89).
"""
from __future__ import annotations

from typing import Any

from ..backends import get_backend, kernel_variant
from ..devices import HOST, META, array_device
from ..errors import ArgumentError

THREADS = 384  # GG90_THREADS: a producer warpgroup and two consumer warpgroups
BM = 128  # GG90_BM: rows a tile
BN = 256  # GG90_BN: B rows a tile (act: 128 gate and 128 up rows, 128 output columns)
BK = 64  # GG90_BK
STAGES = 4  # GG90_ST
SMEM_FIXED = STAGES * (BM + BN) * BK * 2 + 2 * STAGES * 8  # GG90_SMEM_FIXED
MAX_GROUPS = 4096  # the tile prefix lives in shared memory: 4 * (E + 1) bytes
HOST_CTAS = 3  # the host backend's persistent grid: few CTAs, so each walks several tiles as on a GPU
_INT_MAX = 2**31 - 1


def shared_bytes(n_groups: int) -> int:
    """Dynamic shared memory of a launch over n_groups groups (the ring, its mbarriers, the tile prefix)."""
    return SMEM_FIXED + 4 * (n_groups + 1)


def _sm_count(backend: str, dev: int) -> int:
    if backend == "host":
        return HOST_CTAS
    from ._common import nvrtc_sm_count

    return nvrtc_sm_count(dev)


def tiles_bound(m: int, n: int, n_groups: int, act: bool) -> int:
    """An upper bound of the tiles of a launch: sum_e ceil(m_e / BM) <= M / BM + E row tiles, times the column
    tiles (act: BN / 2 output columns a tile)."""
    cols = n // 2 if act else n
    return (m // BM + n_groups) * -(-cols // (BN // 2 if act else BN))


def usable(kind: str, k: int, n_groups: int, backend: str | None, *arrs: Any) -> bool:
    """Whether the sm_90a kernel can run this call (before the tensor maps, which may still decline)."""
    if kind not in ("bf16", "f16") or k % 8 or k <= 0 or n_groups > MAX_GROUPS:
        return False
    be = get_backend(backend)
    if be.name not in ("host", "nvrtc"):
        return False
    dev = array_device(arrs[0])
    # A tensor map holds a device address: host arrays on the nvrtc backend (staged only at launch) keep mma.sync.
    if be.name == "nvrtc" and any(array_device(a) in (HOST, META) for a in arrs):
        return False
    return kernel_variant("sm_90a", be.name, dev if isinstance(dev, int) and dev >= 0 else 0)


def try_launch(a: Any, b: Any, offsets: Any, out: Any, m: int, n: int, k: int, n_groups: int, kind: str,
               act: int | None, stream: Any, backend: str | None, nn: bool = False, f32out: bool = False,
               split: bool = False) -> bool:
    """Run grouped_gemm_sm90 (act None), moe_gemm_act_sm90 or, with nn, grouped_gemm_nn_sm90 when `usable` and the
    arrays suit TMA; False (nothing launched) otherwise. a [m, k] and b [n_groups, n, k] (nn: [n_groups, k, n])
    contiguous (flat views accepted), out [m, n] (act: [m, n / 2]); offsets int32 [n_groups + 1]. f32out: out is
    float32 and the _f32out variant runs (the fp32 accumulators stored; not with act). split (with f32out, layout
    "nt"): a holds split-precision planes, [2, m, k] (hi, then lo: moe.cu's moe_split16), and
    grouped_gemm_sm90_split_f32out accumulates lo·b then hi·b in fp32."""
    from ..launcher import launch
    from ..tensormap import make_tensor_map

    if act is not None and (nn or f32out):
        raise AssertionError("the fused activation is the gate_up GEMM's (layout nt, 16-bit out)")  # never asked
    if split and (nn or not f32out):
        raise AssertionError("the split-precision product is the fp32-result nt one")  # never asked
    if not usable(kind, k, n_groups, backend, a, b, out) or (nn and n % 8):  # nn: b's rows are N long
        return False
    bound = tiles_bound(m, n, n_groups, act is not None)
    if bound > _INT_MAX:  # the kernel's tile indices are int32
        return False
    name = get_backend(backend).name
    try:  # boxes of 64 k-columns (128 bytes: the 128B swizzle's row) by 128 rows
        # (split: the two planes as one [2m, k] map, the lo plane m rows further)
        ta = make_tensor_map(a.reshape((2 * m if split else m, k)), (BM, BK), "128B", backend=name)
        if nn:  # b [E, K, N]: boxes of 64 n-columns by BK k-rows, read MN-major
            tb = make_tensor_map(b.reshape((n_groups, k, n)), (1, BK, 64), "128B", backend=name)
        else:
            tb = make_tensor_map(b.reshape((n_groups, n, k)), (1, BN // 2, BK), "128B", backend=name)
    except ArgumentError:  # e.g. a view whose base is not 16-byte aligned: the mma.sync kernels take it
        return False
    dev = array_device(a)
    grid = max(1, min(bound, _sm_count(name, dev if isinstance(dev, int) and dev >= 0 else 0)))
    sfx = "_bf16" if kind == "bf16" else "_f16"
    if act is None:
        name = (("grouped_gemm_nn_sm90" if nn else "grouped_gemm_sm90") + ("_split" if split else "")
                + ("_f32out" if f32out else "") + sfx)
        launch(name, grid, THREADS, ta, tb, offsets, out, m, n, k, n_groups,
               shared_mem=shared_bytes(n_groups), stream=stream, backend=backend)
    else:
        launch("moe_gemm_act_sm90" + sfx, grid, THREADS, ta, tb, offsets, out, m, n, k, n_groups, act,
               shared_mem=shared_bytes(n_groups), stream=stream, backend=backend)
    return True


def try_launch_wgrad(a: Any, b: Any, offsets: Any, out: Any, m: int, n1: int, n2: int, n_groups: int, kind: str,
                     stream: Any, backend: str | None, split: int = 0) -> bool:
    """Run grouped_gemm_wgrad_sm90, out[e] = a[rows_e]^T @ b[rows_e] ([n_groups, n1, n2]), when `usable` and the
    arrays suit TMA; False (nothing launched) otherwise. a [m, n1] and b [m, n2] contiguous; offsets int32
    [n_groups + 1]. Every group's tiles are written (zeros for a group with no rows). split 1: a holds
    split-precision planes [2, m, n1] (grouped_gemm_wgrad_sm90_split_a: lo·b, then hi·b); split 2: b too, [2, m,
    n2] (_split_ab: lo_a·hi_b + hi_a·lo_b, then hi·hi); fp32 accumulation, one rounding to `kind`."""
    from ..launcher import launch
    from ..tensormap import make_tensor_map

    if n2 % 8 or m == 0 or not usable(kind, n1, n_groups, backend, a, b, out):  # both row strides: 16 bytes
        return False
    tiles = n_groups * -(-n1 // BM) * -(-n2 // BN)
    if tiles > _INT_MAX:
        return False
    name = get_backend(backend).name
    try:  # boxes of 64 columns (one 128-byte swizzled row) by BK rows, read MN-major
        # (split: the planes as one map of 2m rows, the lo plane m rows further)
        ta = make_tensor_map(a.reshape((2 * m if split else m, n1)), (BK, 64), "128B", backend=name)
        tb = make_tensor_map(b.reshape((2 * m if split == 2 else m, n2)), (BK, 64), "128B", backend=name)
    except ArgumentError:
        return False
    dev = array_device(a)
    grid = max(1, min(tiles, _sm_count(name, dev if isinstance(dev, int) and dev >= 0 else 0)))
    variant = ("", "_split_a", "_split_ab")[split]
    launch("grouped_gemm_wgrad_sm90" + variant + ("_bf16" if kind == "bf16" else "_f16"), grid, THREADS, ta, tb,
           offsets, out, n1, n2, m, n_groups, shared_mem=SMEM_FIXED + 4, stream=stream, backend=backend)
    return True
