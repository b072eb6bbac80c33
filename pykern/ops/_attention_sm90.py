"""Dispatch to the Hopper (sm_90a) attention forward, kernels_cu/flash_attention_sm90.cu.

`flash_attention` asks `usable(...)` first on its tensor-core path: on a compute-capability 9.0 GPU (nvrtc) or
with PYKERN_HOST_ARCH=sm_90a (host backend), and for the shapes the kernel compiles (head_dim == head_dim_v in
64/128/256, no softcap, scale > 0: the kernel takes the row max on the raw scores), it runs the TMA + wgmma
kernel; anything else keeps the mma.sync kernels (flash_attention_tc.cu).
"""
from __future__ import annotations

from typing import Any

HEAD_DIMS = (64, 128, 256)
THREADS = 384  # FA90_THREADS: a producer warpgroup and two consumer warpgroups
ROWS = 128  # FA90_BR: queries per CTA
# (keys per tile, ring stages) as the .cu's Fa90Cfg.
_CFG = {64: (128, 3), 128: (128, 2), 256: (64, 2)}


def shared_bytes(d: int) -> int:
    """Dynamic shared memory of the sm_90a forward at head_dim d (FA90_SMEM_BYTES)."""
    bc, st = _CFG[d]
    return ROWS * d * 2 + 2 * st * bc * d * 2 + 1024


def usable(head_dim: int, head_dim_v: int, softcap: float, scale: float, q: Any, backend: str | None) -> bool:
    """Whether the sm_90a kernel runs this call (shape supported and the device takes sm_90a kernels)."""
    if head_dim != head_dim_v or head_dim not in HEAD_DIMS or softcap > 0.0 or not scale > 0.0:
        return False
    from ..backends import get_backend, kernel_variant
    from ..devices import array_device

    be = get_backend(backend)
    if be.name not in ("host", "nvrtc"):
        return False
    dev = array_device(q)
    return kernel_variant("sm_90a", be.name, dev if isinstance(dev, int) and dev >= 0 else 0)


def try_forward(q: Any, k: Any, v: Any, out: Any, lse: Any, dims: tuple[int, int, int, int, int, int, int],
                scale: float, softcap: float, wl: int, wr: int, suffix: str, stream: Any, backend: str | None) -> bool:
    """Run flash_attention_sm90_d{D}{suffix} when `usable` and the arrays suit TMA (16-byte aligned bases);
    False (nothing launched) otherwise. q, k, v contiguous (batch, n, heads, D)."""
    from ..backends import get_backend
    from ..errors import ArgumentError
    from ..launcher import launch
    from ..tensormap import make_tensor_map

    batch, n_q, n_k, n_heads, n_kv_heads, d, d_v = dims
    if not usable(d, d_v, softcap, scale, q, backend):
        return False
    bc, _ = _CFG[d]
    name = get_backend(backend).name
    try:  # boxes of 64 head-dim columns (128 bytes: the 128B swizzle's row) by ROWS queries / bc keys
        tq = make_tensor_map(q, (1, ROWS, 1, 64), "128B", backend=name)
        tk = make_tensor_map(k, (1, bc, 1, 64), "128B", backend=name)
        tv = make_tensor_map(v, (1, bc, 1, 64), "128B", backend=name)
    except ArgumentError:  # e.g. a view whose base is not 16-byte aligned: the mma.sync kernels take it
        return False
    n_blocks = batch * n_heads * -(-n_q // ROWS)
    launch(f"flash_attention_sm90_d{d}{suffix}", n_blocks, THREADS, tq, tk, tv, out, lse, batch, n_q, n_k, n_heads,
           n_kv_heads, float(scale), wl, wr, shared_mem=shared_bytes(d), stream=stream, backend=backend)
    return True
