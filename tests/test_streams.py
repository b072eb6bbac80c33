"""Streams on the nvrtc backend, against the recording fake driver (tests/fake_driver.py).

The inputs are CuPy-like device arrays (a stand-in `cupy` module whose arrays live in the
FakeDriver's memory and expose __cuda_array_interface__ v3 with CuPy's current stream). Every
op launches each kernel on the caller's stream (`stream=`, else CuPy's current stream), takes
outputs and workspaces from the array library's allocator (no driver allocation), and its
multi-launch paths copy nothing device-to-host and never synchronize. The real kernels are
compiled to PTX by NVRTC (no GPU needed); the fake checks every packed parameter against it.
"""
from __future__ import annotations

import hashlib
import sys
import types
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import pykern  # noqa: E402
from pykern import arrays, backends, ops  # noqa: E402
from pykern.backends.nvrtc import NvrtcBackend  # noqa: E402

from fake_driver import FakeDriver  # noqa: E402

CURRENT = 0x5000  # the fake CuPy's current stream
SIDE = 0x7000  # a stream passed explicitly
SOURCES = ("forward.cu", "attention_fwd_fma.cu", "paged.cu", "training.cu", "attention_bwd_fma.cu", "norm_act_loss.cu")


class _FakeCupyModule(types.ModuleType):
    def __init__(self, drv: FakeDriver) -> None:
        super().__init__("cupy")
        self.drv = drv
        self.current = CURRENT
        self.uint16 = np.uint16
        self.cuda = types.SimpleNamespace(get_current_stream=lambda device_id=-1: types.SimpleNamespace(ptr=self.current))

    def empty(self, shape, dtype=np.float32):
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        dt = np.dtype(dtype)
        n = int(np.prod(shape, dtype=np.int64))
        return ndarray(self, self.drv._alloc(max(n * dt.itemsize, 4)), shape, dt)

    def asarray(self, host):
        host = np.ascontiguousarray(host)
        a = self.empty(host.shape, host.dtype)
        a.set(host)
        return a

    def ascontiguousarray(self, a):
        return a  # the fake's arrays are always C-contiguous


class ndarray:  # noqa: N801  (named as CuPy's)
    __module__ = "cupy"

    def __init__(self, mod: _FakeCupyModule, ptr: int, shape: tuple, dtype: np.dtype) -> None:
        self.mod, self.ptr, self.shape, self.dtype = mod, ptr, tuple(shape), np.dtype(dtype)
        self.device = types.SimpleNamespace(id=0)  # cupy.cuda.Device(0)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def __cuda_array_interface__(self) -> dict:
        # CuPy reports its current stream as the producer's stream (CAI v3).
        return {"shape": self.shape, "typestr": self.dtype.str, "data": (self.ptr, False), "version": 3,
                "strides": None, "stream": self.mod.current}

    def _view(self) -> np.ndarray:
        return self.mod.drv.view(self.ptr, self.dtype, self.size).reshape(self.shape)

    def reshape(self, *shape):
        shape = shape[0] if len(shape) == 1 and isinstance(shape[0], tuple) else shape
        if -1 in shape:
            known = int(np.prod([d for d in shape if d != -1], dtype=np.int64)) or 1
            shape = tuple(self.size // known if d == -1 else d for d in shape)
        return ndarray(self.mod, self.ptr, shape, self.dtype)

    def astype(self, dtype):
        out = self.mod.empty(self.shape, dtype)
        out.set(self._view().astype(dtype))
        return out

    def fill(self, v) -> None:
        self._view()[...] = v

    def set(self, host) -> None:
        self._view()[...] = host

    def get(self) -> np.ndarray:
        return self._view().copy()


@pytest.fixture(scope="module")
def compiled():
    from pykern.sources import KERNELS_DIR
    from sass_helpers import nvrtc_module

    # through the run's cache (test_nvrtc_staging loads the same paged.cu PTX); a compute_XX image is the PTX text
    return {(KERNELS_DIR / s).resolve(): nvrtc_module(KERNELS_DIR / s, "compute_80") for s in SOURCES}


@pytest.fixture
def fake(compiled, monkeypatch):
    drv = FakeDriver()
    stubs = {}
    for src, mod in compiled.items():
        drv.register(mod.image, mod.image.decode())
        stubs[src] = type("M", (), {"image": mod.image, "digest": hashlib.sha256(mod.image).hexdigest()})
    be = NvrtcBackend(driver_factory=lambda: drv, get_module=lambda src, arch, kernel=None: stubs[Path(src).resolve()],
                      supported_archs=lambda: ("sm_75",))
    monkeypatch.setitem(backends._instances, "nvrtc", be)
    monkeypatch.setenv("PYKERN_BACKEND", "nvrtc")
    cp = _FakeCupyModule(drv)
    monkeypatch.setitem(sys.modules, "cupy", cp)
    drv.cupy = cp
    return drv


def _dev(drv: FakeDriver, host: np.ndarray) -> ndarray:
    return drv.cupy.asarray(host)


def _calls_since(drv: FakeDriver, start: int) -> list[str]:
    return [c[0] for c in drv.calls[start:]]


def _rng():
    return np.random.default_rng(7)


def _op_calls(drv):
    """(name, expected launch count, callable(stream)) for every op, on fake device arrays."""
    r = _rng()
    f = lambda *s: _dev(drv, r.standard_normal(s).astype(np.float32))  # noqa: E731
    ids = _dev(drv, r.integers(0, 11, size=(2, 3)).astype(np.int64))
    ids32 = _dev(drv, r.integers(0, 11, size=(2, 3)).astype(np.int32))
    targets = _dev(drv, np.array([[1, -100, 4], [0, 12, 3]], np.int64))
    lens = _dev(drv, np.array([5, 0, 300], np.uint32))
    tab = _dev(drv, np.ones((8, 4), np.float32))
    x, w = f(70, 9), f(9)
    q4, k4, v4 = f(1, 5, 4, 16), f(1, 6, 2, 16), f(1, 6, 2, 16)
    bq, bk, bv = f(3, 4, 16), f(3, 2, 300, 16), f(3, 2, 300, 16)
    aq, ak, av, ag = f(5, 4, 16), f(5, 2, 16), f(5, 2, 16), f(5, 4, 16)
    ao, alse = f(5, 4, 16), f(5, 4)
    return [
        ("embedding", 1, lambda s: ops.embedding(ids, f(11, 6), stream=s)),
        ("embedding_int32_ids", 1, lambda s: ops.embedding(ids32, f(11, 6), stream=s)),
        ("rope", 1, lambda s: ops.rope(f(5, 2, 8), tab, tab, stream=s)),
        ("silu_gate", 1, lambda s: ops.silu_gate(f(3, 7), f(3, 7), stream=s)),
        ("rms_norm", 1, lambda s: ops.rms_norm(x, w, stream=s)),
        ("causal_attn_softmax", 1, lambda s: ops.causal_attn_softmax(f(3, 2, 6), 2, stream=s)),
        ("flash_attention", 1, lambda s: ops.flash_attention(q4, k4, v4, causal=True, stream=s)),
        ("decode_attention", 1, lambda s: ops.decode_attention(f(4, 16), f(2, 300, 16), f(2, 300, 16),
                                                               _dev(drv, np.array([7], np.int32)), method="warp",
                                                               stream=s, kv_layout="HND")),
        ("batched_decode_split_k", 2, lambda s: ops.batched_decode_attention(bq, bk, bv, lens, method="split_k",
                                                                             stream=s, kv_layout="HND")),
        ("batched_decode_multi_warp", 2, lambda s: ops.batched_decode_attention(bq, bk, bv, lens,
                                                                                method="multi_warp", stream=s,
                                                                                    kv_layout="HND")),
        ("transpose_2d", 1, lambda s: ops.transpose_2d(f(2, 5, 33), stream=s)),
        ("softmax_backward", 1, lambda s: ops.softmax_backward(f(3, 10), f(3, 10), stream=s)),
        ("rms_norm_backward", 2, lambda s: ops.rms_norm_backward(x, w, f(70, 9), stream=s)),  # row kernel + fused dw reduce
        ("embedding_backward", 2, lambda s: ops.embedding_backward(f(2, 3, 5), ids, 11, stream=s)),
        ("cross_entropy_fwd_bwd", 3, lambda s: ops.cross_entropy_fwd_bwd(f(2, 3, 13), targets, stream=s)),
        ("cross_entropy_fwd_bwd_none", 2, lambda s: ops.cross_entropy_fwd_bwd(
            f(2, 3, 13), targets, label_smoothing=0.1, z_loss=1e-3, softcap=5.0, reduction="none", stream=s)),
        ("add_rms_norm", 1, lambda s: ops.add_rms_norm(f(3, 40), f(3, 40), f(40), stream=s)),
        ("add_rms_norm_backward", 2, lambda s: ops.add_rms_norm_backward(f(3, 40), f(40), f(3, 40), f(3, 40),
                                                                         stream=s)),
        ("layer_norm", 1, lambda s: ops.layer_norm(f(3, 40), f(40), f(40), stream=s)),
        ("layer_norm_backward", 2, lambda s: ops.layer_norm_backward(f(3, 40), f(40), f(3, 40), stream=s)),
        ("gelu", 1, lambda s: ops.gelu(f(3, 40), "tanh", stream=s)),
        ("gelu_backward", 1, lambda s: ops.gelu_backward(f(3, 40), f(3, 40), stream=s)),
        ("gelu_gate", 1, lambda s: ops.gelu_gate(f(3, 40), f(3, 40), stream=s)),
        ("gelu_gate_backward", 1, lambda s: ops.gelu_gate_backward(f(3, 40), f(3, 40), f(3, 40), stream=s)),
        ("attention_backward_flash", 3, lambda s: ops.attention_backward(aq, ak, av, ag, stream=s)),
        ("attention_backward_flash_out_lse", 3,
         lambda s: ops.attention_backward(aq, ak, av, ag, out=ao, lse=alse, stream=s)),
        ("attention_backward_naive", 3, lambda s: ops.attention_backward(aq, ak, av, ag, method="naive", stream=s)),
    ]


OPS = [c[0] for c in _op_calls(types.SimpleNamespace(cupy=types.SimpleNamespace(asarray=lambda h: h)))]


def _run(fake, op, stream):
    _, n_launch, fn = next(c for c in _op_calls(fake) if c[0] == op)
    start, first = len(fake.calls), len(fake.launches)
    res = fn(stream)
    return res, _calls_since(fake, start), fake.launches[first:], n_launch


@pytest.mark.parametrize("op", OPS)
def test_default_stream_is_the_libraries_current_stream(fake, op):
    """No stream=: every launch goes to CuPy's current stream; nothing is copied to the host, nothing
    synchronizes, nothing is allocated through the driver (outputs come from the array library)."""
    res, calls, launches, n_launch = _run(fake, op, None)
    assert len(launches) == n_launch, [x.name for x in launches]
    assert {x.stream for x in launches} == {CURRENT}
    for bad in ("memcpy_dtoh_async", "stream_synchronize", "mem_alloc", "mem_free", "memcpy_htod_async"):
        assert bad not in calls, (bad, calls)
    for r in (res if isinstance(res, tuple) else (res,)):
        assert type(r).__module__ == "cupy", type(r)


@pytest.mark.parametrize("op", OPS)
def test_explicit_stream_takes_every_launch(fake, op):
    """stream=SIDE: every launch (intermediates included) on SIDE. The inputs' CAI v3 says CuPy
    produced them on CURRENT, so the protocol may wait for CURRENT, but never copies to the host."""
    _, calls, launches, n_launch = _run(fake, op, SIDE)
    assert len(launches) == n_launch
    assert {x.stream for x in launches} == {SIDE}
    assert "memcpy_dtoh_async" not in calls and "mem_alloc" not in calls
    syncs = {c[1][0] for c in fake.calls if c[0] == "stream_synchronize"}
    assert syncs <= {CURRENT}


def test_stream_objects_are_accepted(fake):
    class TorchLike:
        cuda_stream = SIDE

    class CoreLike:
        def __cuda_stream__(self):
            return (0, SIDE + 0x100)

    _, _, launches, _ = _run(fake, "cross_entropy_fwd_bwd", TorchLike())
    assert {x.stream for x in launches} == {SIDE}
    _, _, launches, _ = _run(fake, "embedding_backward", CoreLike())
    assert {x.stream for x in launches} == {SIDE + 0x100}


def test_current_stream_followed_when_it_changes(fake):
    fake.cupy.current = 0x9000
    _, calls, launches, _ = _run(fake, "batched_decode_split_k", None)
    assert {x.stream for x in launches} == {0x9000} and "stream_synchronize" not in calls


def test_multi_launch_intermediates_are_shared_device_buffers(fake):
    """split-K: the chunk kernel's partial outputs are exactly the reduce kernel's inputs (device
    pointers from the array library), so nothing is staged between the two launches."""
    _, calls, launches, _ = _run(fake, "batched_decode_split_k", None)
    chunk, red = launches
    assert chunk.name.startswith("dense_attn") and red.name.startswith("paged_attn_merge")
    assert red.values[0] == chunk.values[5] and red.values[1] == chunk.values[6]  # part_o, part_lse
    _, _, launches, _ = _run(fake, "embedding_backward", None)
    bucket, gather = launches
    assert bucket.name == "embedding_backward_bucket"
    assert gather.values[1:3] == bucket.values[1:3]  # order, offsets
    _, _, launches, _ = _run(fake, "cross_entropy_fwd_bwd", None)
    count, main, mean = launches
    assert count.name == "cross_entropy_count" and main.values[5] == count.values[2] == mean.values[2]


def test_host_ids_for_a_device_op_go_host_to_device_only(fake):
    g = _dev(fake, np.ones((2, 3, 5), np.float32))
    start = len(fake.calls)
    ops.embedding_backward(g, np.array([[1, 2, 3], [0, 0, 10]]), 11)
    calls = _calls_since(fake, start)
    assert "memcpy_dtoh_async" not in calls and "stream_synchronize" not in calls


def test_host_ids_for_a_device_table_go_host_to_device_only(fake):
    tab = _dev(fake, np.ones((11, 4), np.float32))
    start = len(fake.calls)
    out = ops.embedding(np.array([[1, 2], [0, 10]]), tab)
    calls = _calls_since(fake, start)
    assert type(out).__module__ == "cupy" and out.shape == (2, 2, 4)
    assert "memcpy_dtoh_async" not in calls and "stream_synchronize" not in calls
    assert {x.stream for x in fake.launches} == {CURRENT}


def test_numpy_inputs_keep_staging_and_synchronizing(fake):
    """NumPy in, NumPy out: the nvrtc backend still stages (copy in, launch, copy out, sync)."""
    start = len(fake.calls)
    out = ops.silu_gate(np.ones(8, np.float32), np.ones(8, np.float32))
    assert isinstance(out, np.ndarray)
    calls = _calls_since(fake, start)
    assert "memcpy_dtoh_async" in calls and calls[-2:] == ["mem_free", "set_current"] and "stream_synchronize" in calls
    assert fake.current is None  # the caller had no context current: none is left behind
    assert {x.stream for x in fake.launches} == {0}


def test_device_view_launch_uses_the_pointer(fake):
    """What the launcher makes of a torch CUDA tensor (data_ptr(), never __cuda_array_interface__)."""
    a = _dev(fake, np.arange(8, dtype=np.float32))
    o = _dev(fake, np.zeros(8, np.float32))

    class Owner:
        pass

    view = arrays.DeviceView(a.ptr, (8,), "<f4", Owner())
    out = arrays.DeviceView(o.ptr, (8,), "<f4", Owner())
    pykern.launch("silu_gate", 1, 32, view, view, out, 8, stream=SIDE)
    (launch,) = fake.launches
    assert launch.values[:3] == [a.ptr, a.ptr, o.ptr] and launch.stream == SIDE
    assert "stream_synchronize" not in fake.names()


# --------------------------------------------------------------------------- in-kernel validation (host backend)


def test_cross_entropy_kernel_marks_bad_device_targets_nan():
    """Device targets are not checked on the host: the kernel gives a bad row NaN loss and gradient."""
    logits = np.random.default_rng(0).standard_normal((3, 5)).astype(np.float32)
    targets = np.array([1, 7, -100], np.int64)
    grad = np.zeros_like(logits)
    row_loss = np.zeros(3, np.float32)
    inv = np.zeros(2, np.float32)
    loss = np.zeros(1, np.float32)
    pykern.launch("cross_entropy_count", 1, 32, targets, inv, inv, 3, 5, -100, 1, 0, backend="host")
    assert inv[0] == inv[1] == np.float32(0.5)
    pykern.launch("cross_entropy_fwd_bwd", 3, 32, logits, targets, grad, row_loss, row_loss, inv, inv, row_loss,
                  3, 5, -100, 0.0, 0.0, 0.0, 0, backend="host")
    pykern.launch("cross_entropy_loss_reduce", 1, 32, row_loss, loss, inv, 3, 3, 0, backend="host")
    assert np.isnan(row_loss[1]) and np.isnan(grad[1]).all() and np.isnan(loss[0])
    assert np.isfinite(grad[0]).all() and not grad[2].any() and row_loss[2] == 0
    lse = np.log(np.exp(logits[0].astype(np.float64)).sum())
    np.testing.assert_allclose(row_loss[0], (lse - logits[0, 1]) / 2, rtol=1e-6)  # the mean's scale applied


@pytest.mark.parametrize("schedule", ["forward", "reverse"])
def test_bucket_kernel_is_a_stable_argsort_and_skips_bad_ids(schedule, monkeypatch):
    monkeypatch.setenv("PYKERN_HOST_SCHEDULE", schedule)
    rng = np.random.default_rng(3)
    vocab = 4200  # three blocks of 2048 rows
    ids = rng.integers(0, vocab, size=700).astype(np.int64)
    ids[::5] = 2048
    ids[1::9] = 2047
    ids[2::11] = 0
    bad = ids.copy()
    bad[[3, 100, 600]] = [-1, vocab, 2**40]
    order = np.full(700, -7, np.int32)
    offsets = np.full(vocab + 1, -7, np.int32)
    pykern.launch("embedding_backward_bucket", 3, 256, bad, order, offsets, 700, vocab, backend="host")
    good = (bad >= 0) & (bad < vocab)
    want = np.flatnonzero(good)[np.argsort(bad[good], kind="stable")]
    np.testing.assert_array_equal(order[: good.sum()], want)
    np.testing.assert_array_equal(offsets[1:] - offsets[:-1], np.bincount(bad[good], minlength=vocab))
    assert offsets[0] == 0 and offsets[-1] == good.sum()
