"""Which attention kernels the nvrtc backend picks on a compute-capability 9.0 GPU (tests/fake_driver.py, no GPU).

The sm_90a kernels read q, k, v (and dO) through TMA tensor maps, which hold device addresses: only arrays
already on the GPU (torch CUDA tensors, CuPy, __cuda_array_interface__ objects) can take them. Host arrays
(NumPy) are staged to device memory by the launcher at launch, after the tensor maps would have been made, so
flash_attention, attention_backward and flash_attention_varlen give them the mma.sync kernels, as on an sm_80
GPU; one host array among device ones does the same. The fake backend records each launch (kernel name and the
converted arguments, after every launcher check) instead of running it.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from pykern import arrays, backends, ops
from pykern.backends.nvrtc import NvrtcBackend
from pykern.ops import _attention_sm90 as sm90

from fake_driver import FakeDeviceArray, FakeDriver, FakeDriverError

BF16 = np.dtype(ml_dtypes.bfloat16)


@pytest.fixture
def cc90(monkeypatch: pytest.MonkeyPatch) -> tuple[FakeDriver, list[str]]:
    """A fake H100 (cc 9.0, 227 KB shared memory opt-in) as the nvrtc backend; launches are recorded, not run."""
    monkeypatch.delenv("PYKERN_HOST_ARCH", raising=False)
    drv = FakeDriver(cc=(9, 0), max_shared_optin=227 * 1024)

    def get_module(source, arch, kernel=None):
        raise FakeDriverError(f"nothing is compiled here (asked for {source} at {arch})")

    be = NvrtcBackend(driver_factory=lambda: drv, get_module=get_module, supported_archs=lambda: ("sm_80", "sm_90"))
    names: list[str] = []

    def record(spec, grid, block, args, shared_mem, stream, device=None):
        names.append(spec.name)

    monkeypatch.setattr(be, "launch", record)
    real_empty = arrays.empty

    def empty(shape, dtype, like=None):  # outputs next to a fake device array live in the fake
        if isinstance(like, FakeDeviceArray):
            return drv.device_array(np.empty(shape, arrays._resolve(dtype)))
        return real_empty(shape, dtype, like)

    monkeypatch.setattr(arrays, "empty", empty)
    monkeypatch.setitem(backends._instances, "nvrtc", be)
    return drv, names


def _qkv(b: int, n: int, h: int, d: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((b, n, h, d)).astype(BF16) for _ in range(3)]


def _on(drv: FakeDriver, arrays: list[np.ndarray]) -> list:
    return [drv.device_array(a) for a in arrays]


@pytest.mark.parametrize("d", [64, 96, 128])
def test_forward_host_arrays_take_mma_sync_device_arrays_sm90(cc90, d: int) -> None:
    drv, names = cc90
    q, k, v = _qkv(1, 80, 2, d)
    assert backends.kernel_variant("sm_90a", "nvrtc")  # the GPU takes sm_90a kernels
    ops.flash_attention(q, k, v, causal=True, backend="nvrtc")
    assert names == [f"attention_fwd_tc_d{d}_bf16"]
    assert not any(c[0] == "tensor_map_encode_tiled" for c in drv.calls)
    names.clear()
    out = ops.flash_attention(*_on(drv, [q, k, v]), causal=True, backend="nvrtc")
    assert names == [f"attention_fwd_sm90_d{d}_bf16"]
    # q, k, v and out (the epilogue's TMA stores: boxes of a consumer warpgroup's 64 rows by 64 head-dim columns,
    # 32 at d96, innermost first), the last one over out's own device memory
    maps = [c[1] for c in drv.calls if c[0] == "tensor_map_encode_tiled"]
    bc, cols = sm90._CFG[d][0], sm90.box(d)[0]
    assert cols == (32 if d == 96 else 64)
    assert [m[5] for m in maps] == [(cols, 1, 128, 1), (cols, 1, bc, 1), (cols, 1, bc, 1),
                                    (cols, 1, sm90.OUT_ROWS, 1)]
    assert maps[-1][2] == out.ptr and maps[-1][3] == (d, 2, 80, 1)
    names.clear()
    dq, dk, _ = _on(drv, [q, k, v])
    ops.flash_attention(dq, dk, v, causal=True, backend="nvrtc")  # one host array: no tensor map for it
    assert names == [f"attention_fwd_tc_d{d}_bf16"]


@pytest.mark.parametrize("d", [64, 128])
def test_backward_host_arrays_take_mma_sync_device_arrays_sm90(cc90, d: int) -> None:
    drv, names = cc90
    q, k, v = _qkv(1, 80, 2, d)
    g = _qkv(1, 80, 2, d, seed=1)[0]
    ops.attention_backward(q, k, v, g, backend="nvrtc")  # the mma.sync backward, as on sm_80
    assert f"attention_bwd_tc_fused_d{d}_bf16" in names and not any("sm90" in n for n in names), names
    assert not any(c[0] == "tensor_map_encode_tiled" for c in drv.calls)
    names.clear()
    ops.attention_backward(*_on(drv, [q, k, v, g]), backend="nvrtc")
    assert [n for n in names if "sm90" in n] == [f"attention_bwd_sm90_fused_d{d}_bf16"], names
    names.clear()
    ops.attention_backward(*_on(drv, [q, k, v]), g, backend="nvrtc")  # dO on the host: no tensor map for it
    assert f"attention_bwd_tc_fused_d{d}_bf16" in names and not any("sm90" in n for n in names), names


@pytest.mark.parametrize("d", [64, 128])
def test_varlen_host_arrays_take_mma_sync_device_arrays_sm90(cc90, d: int) -> None:
    drv, names = cc90
    rng = np.random.default_rng(2)
    cu = np.array([0, 37, 100], np.int32)
    q, k, v = (rng.standard_normal((100, 2, d)).astype(BF16) for _ in range(3))
    ops.flash_attention_varlen(q, k, v, cu, cu, causal=True, backend="nvrtc")
    assert names == [f"attention_fwd_varlen_tc_d{d}_bf16"]
    assert not any(c[0] == "tensor_map_encode_tiled" for c in drv.calls)
    names.clear()
    dq, dk, dv = _on(drv, [q, k, v])
    ops.flash_attention_varlen(dq, dk, dv, cu, cu, causal=True, backend="nvrtc")
    assert names == [f"attention_fwd_varlen_sm90_d{d}_bf16"]


@pytest.mark.parametrize("cap", [0.0, 2.0])
def test_varlen_backward_host_arrays_take_mma_sync_device_arrays_sm90(cc90, cap: float) -> None:
    """flash_attention_varlen_backward: device q, k, v, dO take the sm_90a varlen fused kernel (tensor maps over the
    packed rows), with softcap its _softcap form; host arrays, or dO on the host, the mma.sync pair."""
    drv, names = cc90
    rng = np.random.default_rng(4)
    cu = np.array([0, 37, 100], np.int32)
    q, k, v, g, out = (rng.standard_normal((100, 2, 64)).astype(BF16) for _ in range(5))
    lse = rng.standard_normal((100, 2)).astype(np.float32)
    c = "_softcap" if cap else ""
    ops.flash_attention_varlen_backward(q, k, v, g, cu, cu, out=out, lse=lse, causal=True, softcap=cap,
                                        backend="nvrtc")
    assert names == ["attention_bwd_preprocess_bf16", f"attention_bwd_varlen_tc_dkdv_d64{c}_bf16",
                     f"attention_bwd_varlen_tc_dq_d64{c}_bf16"]
    assert not any(c_[0] == "tensor_map_encode_tiled" for c_ in drv.calls)
    names.clear()
    dq_, dk_, dv_, dg, dout, dlse = _on(drv, [q, k, v, g, out, lse])
    ops.flash_attention_varlen_backward(dq_, dk_, dv_, dg, cu, cu, out=dout, lse=dlse, causal=True, softcap=cap,
                                        backend="nvrtc")
    # the fused kernel: the pre-pass over the packed rows, the kernel, the narrowing of its dQ accumulator
    assert names == ["attention_bwd_tc_prep_bf16", f"attention_bwd_varlen_sm90_fused_d64{c}_bf16",
                     "attention_bwd_tc_dq_reduce_d64_bf16"]
    assert sum(c_[0] == "tensor_map_encode_tiled" for c_ in drv.calls) == 4  # q, dO, k, v once
    names.clear()
    ops.flash_attention_varlen_backward(dq_, dk_, dv_, g, cu, cu, out=dout, lse=dlse, causal=True, softcap=cap,
                                        backend="nvrtc")
    assert names[1:] == [f"attention_bwd_varlen_tc_dkdv_d64{c}_bf16", f"attention_bwd_varlen_tc_dq_d64{c}_bf16"]


def test_usable_asks_every_tensor_map_array(cc90) -> None:
    drv, _ = cc90
    host = _qkv(1, 16, 1, 64)
    dev = _on(drv, host)
    assert sm90.usable(64, 64, 0.0, 0.125, dev[0], "nvrtc", *dev[1:])
    assert not sm90.usable(64, 64, 0.0, 0.125, host[0], "nvrtc", *host[1:])
    assert not sm90.usable(64, 64, 0.0, 0.125, dev[0], "nvrtc", dev[1], host[2])
    assert not sm90.usable(64, 64, 0.0, 0.125, host[0], "nvrtc", *dev[1:])


def test_host_backend_playing_sm90a_keeps_numpy_arrays(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYKERN_HOST_ARCH", "sm_90a")
    q, k, v = _qkv(1, 16, 1, 64)
    assert sm90.usable(64, 64, 0.0, 0.125, q, "host", k, v)


@pytest.mark.parametrize("d", [64, 128])
def test_pykern_sm90_0_gives_every_attention_op_the_mma_sync_kernels(cc90, monkeypatch: pytest.MonkeyPatch,
                                                                      d: int) -> None:
    """The public switch (what tools/gpu_no_sm90.py sets): on the same fake Hopper GPU with device arrays, the
    forward, varlen and backward launch sm_90a kernels by default and the sm_80 (mma.sync) ones under
    PYKERN_SM90=0."""
    drv, names = cc90
    q, k, v = _qkv(1, 80, 2, d)
    g = _qkv(1, 80, 2, d, seed=1)[0]
    rng = np.random.default_rng(3)
    cu = np.array([0, 37, 100], np.int32)
    pq, pk, pv = (rng.standard_normal((100, 2, d)).astype(BF16) for _ in range(3))

    def run() -> list[str]:
        names.clear()
        ops.flash_attention(*_on(drv, [q, k, v]), causal=True, backend="nvrtc")
        ops.flash_attention_varlen(*_on(drv, [pq, pk, pv]), cu, cu, causal=True, backend="nvrtc")
        ops.attention_backward(*_on(drv, [q, k, v, g]), backend="nvrtc")
        return list(names)

    monkeypatch.setenv("PYKERN_SM90", "1")
    assert run() == [f"attention_fwd_sm90_d{d}_bf16", f"attention_fwd_varlen_sm90_d{d}_bf16", "attention_bwd_lse_bf16",
                     "attention_bwd_tc_prep_bf16", f"attention_bwd_sm90_fused_d{d}_bf16",
                     f"attention_bwd_tc_dq_reduce_d{d}_bf16"]
    monkeypatch.setenv("PYKERN_SM90", "0")
    assert run() == [f"attention_fwd_tc_d{d}_bf16", f"attention_fwd_varlen_tc_d{d}_bf16", "attention_bwd_lse_bf16",
                     "attention_bwd_tc_prep_bf16", f"attention_bwd_tc_fused_d{d}_bf16",
                     f"attention_bwd_tc_dq_reduce_d{d}_bf16"]
    monkeypatch.delenv("PYKERN_SM90")
    assert run()[0] == f"attention_fwd_sm90_d{d}_bf16"  # unset: on


def test_pykern_sm90_host_arch_switch_and_bad_value(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the host backend playing sm_90a the same switch decides; a value other than 0 / 1 is an error naming
    the variable before anything launches."""
    from pykern.errors import ArgumentError

    monkeypatch.setenv("PYKERN_HOST_ARCH", "sm_90a")
    q, k, v = _qkv(1, 16, 1, 64)
    assert sm90.usable(64, 64, 0.0, 0.125, q, "host", k, v)
    monkeypatch.setenv("PYKERN_SM90", "0")
    assert not sm90.usable(64, 64, 0.0, 0.125, q, "host", k, v)
    monkeypatch.setenv("PYKERN_SM90", "off")
    with pytest.raises(ArgumentError, match=r"PYKERN_SM90: expected 0 or 1 \(or unset\), got 'off'"):
        ops.flash_attention(q, k, v, backend="host")
