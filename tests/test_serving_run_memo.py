"""PagedDecodePlan.run's memo of its last step (nvrtc backend on tests/fake_driver.py, launches recorded).

A decode loop passes the same device arrays every step; run() then launches the arguments it prepared last
time instead of checking and converting them again. It must launch exactly what a fresh run would: each test
compares the recorded launches (kernel, geometry, every argument: addresses, shapes, dtypes, scalar values)
of a memoized step with those of the same step on a plan without a memo, and changes one thing at a time (a
new array at another address, the same object moved, another stride, dtype, scalar, out=, return_lse) to see
the memo miss. Host arrays and index arrays that need a conversion are never memoized (their contents are
checked each step).
"""
from __future__ import annotations

import ctypes

import ml_dtypes
import numpy as np
import pytest

from pykern import arrays, backends
from pykern.arrays import DeviceView
from pykern.backends.nvrtc import NvrtcBackend
from pykern.errors import ArgumentError
from pykern.ops.serving import PagedDecodePlan

from fake_driver import FakeDeviceArray, FakeDriver, FakeDriverError

BF16 = np.dtype(ml_dtypes.bfloat16)
B, G, KVH, D, PS, L = 2, 4, 2, 128, 16, 64
NPAGES = B * L // PS


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("PYKERN_HOST_ARCH", raising=False)
    drv = FakeDriver(cc=(9, 0), max_shared_optin=227 * 1024)

    def get_module(source, arch, kernel=None):
        raise FakeDriverError("nothing is compiled here")

    be = NvrtcBackend(driver_factory=lambda: drv, get_module=get_module, supported_archs=lambda: ("sm_80", "sm_90"))
    launches: list[tuple] = []

    def record(spec, grid, block, args, shared_mem, stream, device=None):
        launches.append((spec.name, grid, block, tuple(_norm(a) for a in args), shared_mem, stream))

    monkeypatch.setattr(be, "launch", record)
    real_empty, real_zeros = arrays.empty, arrays.zeros

    def empty(shape, dtype, like=None):
        if isinstance(like, FakeDeviceArray):
            return drv.device_array(np.empty(shape, arrays._resolve(dtype)))
        return real_empty(shape, dtype, like)

    def zeros(shape, dtype, like=None):
        if isinstance(like, FakeDeviceArray):
            return drv.device_array(np.zeros(shape, arrays._resolve(dtype)))
        return real_zeros(shape, dtype, like)

    monkeypatch.setattr(arrays, "empty", empty)
    monkeypatch.setattr(arrays, "zeros", zeros)
    monkeypatch.setitem(backends._instances, "nvrtc", be)
    return drv, launches


def _norm(a):
    """A launch argument as comparable data: arrays by address, shape, dtype (and strides); scalars by value."""
    if type(a) is DeviceView:
        return ("view", a.ptr, tuple(a.shape), a.typestr)
    cai = getattr(a, "__cuda_array_interface__", None)
    if cai is not None:
        return ("cai", cai["data"][0], tuple(cai["shape"]), cai["typestr"], cai.get("strides"))
    if isinstance(a, ctypes._SimpleCData):
        return (type(a).__name__, a.value)
    return ("bytes", bytes(a))


def _inputs(drv: FakeDriver, seed: int = 0):
    rng = np.random.default_rng(seed)
    q = drv.device_array(rng.standard_normal((B, KVH * G, D)).astype(BF16))
    kp = drv.device_array(rng.standard_normal((NPAGES, PS, KVH, D)).astype(BF16))
    vp = drv.device_array(rng.standard_normal((NPAGES, PS, KVH, D)).astype(BF16))
    indptr = drv.device_array(np.arange(0, NPAGES + 1, L // PS, dtype=np.int32))
    idx = drv.device_array(rng.permutation(NPAGES).astype(np.int32))
    last = drv.device_array(np.full((B,), PS, np.int32))
    return q, kp, vp, indptr, idx, last


def _plan(drv: FakeDriver, like, **kw) -> PagedDecodePlan:
    return PagedDecodePlan(B, KVH * G, KVH, D, PS, q_dtype="bf16", kv_dtype="bf16", max_kv_len=L, like=like, **kw)


def _only(memos: dict) -> tuple:
    """The one entry of a plan's memo (one KV cache seen)."""
    assert len(memos) == 1, len(memos)
    return next(iter(memos.values()))


def _fresh(plan: PagedDecodePlan, launches: list, *args, **kw) -> list:
    """The launches of a run with the memo dropped first (every check and conversion done afresh)."""
    plan._memo.clear()
    plan._pages_memo.clear()
    n = len(launches)
    plan.run(*args, **kw)
    return launches[n:]


def _step(plan: PagedDecodePlan, launches: list, *args, **kw) -> list:
    n = len(launches)
    plan.run(*args, **kw)
    return launches[n:]


def test_memoized_step_launches_exactly_what_a_fresh_run_does(fake) -> None:
    drv, launches = fake
    args = _inputs(drv)
    plan = _plan(drv, args[0])
    first = _step(plan, launches, *args, backend="nvrtc")
    assert len(plan._memo) == 1 and [x[0] for x in first] == ["decode_tc_paged_d128_bf16"]
    again = _step(plan, launches, *args, backend="nvrtc")
    assert again == first
    assert _fresh(plan, launches, *args, backend="nvrtc") == first
    # The memo's returned arrays are the plan's, as a fresh run's.
    assert plan.run(*args, backend="nvrtc") is plan.out


def test_new_arrays_or_moved_memory_miss(fake) -> None:
    drv, launches = fake
    q, kp, vp, indptr, idx, last = _inputs(drv)
    plan = _plan(drv, q)
    base = _step(plan, launches, q, kp, vp, indptr, idx, last, backend="nvrtc")
    # Another K array (same shape, another address): the launch reads the new address.
    kp2 = drv.device_array(np.zeros((NPAGES, PS, KVH, D), BF16))
    got = _step(plan, launches, q, kp2, vp, indptr, idx, last, backend="nvrtc")
    assert got != base and got[0][3][1] == ("view", kp2.ptr, (NPAGES * PS * KVH * D,), "<V2")
    assert got == _fresh(plan, launches, q, kp2, vp, indptr, idx, last, backend="nvrtc")
    # The same Python object now describing other memory (torch's set_, a re-pointed view): a miss as well.
    _step(plan, launches, q, kp, vp, indptr, idx, last, backend="nvrtc")
    other = drv.device_array(np.zeros((NPAGES, PS, KVH, D), BF16))
    kp.ptr = other.ptr
    kp._cai["data"] = (other.ptr, False)
    moved = _step(plan, launches, q, kp, vp, indptr, idx, last, backend="nvrtc")
    assert moved[0][3][1][1] == other.ptr
    assert moved == _fresh(plan, launches, q, kp, vp, indptr, idx, last, backend="nvrtc")
    # New index arrays (a new step's page table) at new addresses.
    idx2 = drv.device_array(np.arange(NPAGES, dtype=np.int32))
    got = _step(plan, launches, q, kp, vp, indptr, idx2, last, backend="nvrtc")
    assert idx2.ptr in [a[1] for a in got[0][3] if a[0] in ("view", "cai")]
    assert got == _fresh(plan, launches, q, kp, vp, indptr, idx2, last, backend="nvrtc")


def test_changed_stride_shape_or_dtype_misses(fake) -> None:
    drv, launches = fake
    q, kp, vp, indptr, idx, last = _inputs(drv)
    plan = _plan(drv, q)
    _step(plan, launches, q, kp, vp, indptr, idx, last, backend="nvrtc")
    # Same address, explicit (still C-order) strides, then a token stride twice as long: the kernel's
    # s_tok argument must follow.
    row = KVH * D * 2
    kp._cai["strides"] = (PS * row, row, D * 2, 2)
    same = _step(plan, launches, q, kp, vp, indptr, idx, last, backend="nvrtc")
    assert same == _fresh(plan, launches, q, kp, vp, indptr, idx, last, backend="nvrtc")
    big_k = drv.device_array(np.zeros((NPAGES, 2 * PS, KVH, D), BF16))
    big_v = drv.device_array(np.zeros((NPAGES, 2 * PS, KVH, D), BF16))
    k_view = FakeDeviceArray(drv, big_k.ptr, (NPAGES, PS, KVH, D), BF16, None, False)
    v_view = FakeDeviceArray(drv, big_v.ptr, (NPAGES, PS, KVH, D), BF16, None, False)
    for v in (k_view, v_view):
        v._cai["strides"] = (2 * PS * row, 2 * row, D * 2, 2)
    strided = _step(plan, launches, q, k_view, v_view, indptr, idx, last, backend="nvrtc")
    vals = [a[1] for a in strided[0][3] if a[0] == "c_long"]  # s_page, s_tok, s_head (int64)
    assert vals[:3] == [2 * PS * KVH * D, 2 * KVH * D, D]
    k_view._cai["strides"] = (PS * row, row, D * 2, 2)
    v_view._cai["strides"] = (PS * row, row, D * 2, 2)
    plain = _step(plan, launches, q, k_view, v_view, indptr, idx, last, backend="nvrtc")
    assert [a[1] for a in plain[0][3] if a[0] == "c_long"][:3] == [PS * KVH * D, KVH * D, D]
    # A dtype the plan does not take is refused on the step after a memoized one, as on any step.
    _step(plan, launches, q, kp, vp, indptr, idx, last, backend="nvrtc")
    f16_k = FakeDeviceArray(drv, kp.ptr, kp.shape, np.dtype(np.float16), None, False)
    f16_v = FakeDeviceArray(drv, vp.ptr, vp.shape, np.dtype(np.float16), None, False)
    with pytest.raises(ArgumentError, match="k_pages"):
        plan.run(q, f16_k, f16_v, indptr, idx, last, backend="nvrtc")


def test_changed_scalars_out_and_return_lse_miss(fake) -> None:
    drv, launches = fake
    args = _inputs(drv)
    plan = _plan(drv, args[0])
    base = _step(plan, launches, *args, backend="nvrtc")
    for kw in ({"scale": 0.5}, {"k_scale": 2.0}, {"v_scale": 0.25}, {"return_lse": True}):
        got = _step(plan, launches, *args, backend="nvrtc", **kw)
        assert got != base
        assert got == _step(plan, launches, *args, backend="nvrtc", **kw)  # and memoized in turn
        assert got == _fresh(plan, launches, *args, backend="nvrtc", **kw)
    out = drv.device_array(np.zeros((B, KVH * G, D), BF16))
    got = _step(plan, launches, *args, backend="nvrtc", out=out)
    assert ("view", out.ptr, (B * KVH * G * D,), "<V2") in got[0][3] or \
        any(a[0] == "cai" and a[1] == out.ptr for a in got[0][3])
    assert plan.run(*args, backend="nvrtc", out=out) is out
    res, lse = plan.run(*args, backend="nvrtc", out=out, return_lse=True)
    assert res is out and lse is plan.lse
    # Not a plain scalar: checked (and refused) as on a fresh run, never compared against the memo.
    with pytest.raises(ArgumentError, match="scale"):
        plan.run(*args, backend="nvrtc", scale=np.array([0.1, 0.2]))


def test_host_or_converted_index_arrays_are_checked_every_step(fake) -> None:
    drv, launches = fake
    q, kp, vp, indptr, idx, last = _inputs(drv)
    plan = _plan(drv, q)
    h_idx = np.arange(NPAGES, dtype=np.int32)
    _step(plan, launches, q, kp, vp, indptr.copy_to_host(), h_idx, last.copy_to_host(), backend="nvrtc")
    assert not plan._memo
    h_idx[3] = NPAGES + 5  # the same host array, now with a page out of range: refused
    with pytest.raises(ArgumentError, match="kv_indices"):
        plan.run(q, kp, vp, indptr.copy_to_host(), h_idx, last.copy_to_host(), backend="nvrtc")
    # int64 device indices are converted to int32 copies each step: no memo (a copy would go stale).
    idx64 = drv.device_array(np.arange(NPAGES, dtype=np.int64))
    idx64.astype = lambda dt: drv.device_array(idx64.copy_to_host().astype(dt))
    _step(plan, launches, q, kp, vp, indptr, idx64, last, backend="nvrtc")
    assert not plan._memo


def test_edited_kernel_source_drops_the_memo(fake, monkeypatch) -> None:
    drv, launches = fake
    args = _inputs(drv)
    plan = _plan(drv, args[0])
    base = _step(plan, launches, *args, backend="nvrtc")
    from pykern import launcher, registry

    spec = registry.get(base[0][0])
    clone = type(spec)(**{f: getattr(spec, f) for f in spec.__dataclass_fields__})  # a re-parsed spec
    monkeypatch.setattr(registry, "get", lambda name: clone if name == spec.name else spec)
    assert launcher.launch_prepared(_only(plan._memo)[1][0]) is False
    again = _step(plan, launches, *args, backend="nvrtc")
    assert again == base and _only(plan._memo)[1][0][0] is clone


def test_torch_keys_follow_address_shape_strides_dtype_and_device() -> None:
    torch = pytest.importorskip("torch")
    from pykern.ops.serving import _array_key

    assert _array_key(torch.zeros(4)) is None  # a CPU tensor: host memory, its contents are checked

    class Cuda(torch.Tensor):  # a stand-in for a CUDA tensor: only what the key reads
        __torch_function__ = torch._C._disabled_torch_function_impl
        is_cuda = True
        ptr, dev = 0x7000, 0

        def data_ptr(self):
            return self.ptr

        def get_device(self):
            return self.dev

    t = torch.zeros(4, 8).as_subclass(Cuda)
    k = _array_key(t)
    assert k == _array_key(t)
    t.ptr = 0x7100
    assert _array_key(t) != k
    t.ptr = 0x7000
    t.dev = 1
    assert _array_key(t) != k
    t.dev = 0
    u = torch.zeros(8, 4).t().as_subclass(Cuda)  # same shape, other strides
    assert _array_key(u)[2:4] == ((4, 8), (1, 4)) and k[2:4] == ((4, 8), (8, 1))
    h = torch.zeros(4, 8, dtype=torch.float16).as_subclass(Cuda)
    assert _array_key(h)[4] == torch.float16 and k[4] == torch.float32


def test_a_q_that_is_copied_to_be_contiguous_is_not_memoized(fake, monkeypatch) -> None:
    drv, launches = fake
    q, kp, vp, indptr, idx, last = _inputs(drv)
    plan = _plan(drv, q)
    real = arrays.contiguous

    def copying(a):  # as CuPy's ascontiguousarray of a strided array: new memory each call
        if a is q:
            return drv.device_array(q.copy_to_host())
        return real(a)

    monkeypatch.setattr(arrays, "contiguous", copying)
    _step(plan, launches, q, kp, vp, indptr, idx, last, backend="nvrtc")
    assert not plan._memo
    monkeypatch.setattr(arrays, "contiguous", real)
    _step(plan, launches, q, kp, vp, indptr, idx, last, backend="nvrtc")
    assert len(plan._memo) == 1


def test_new_page_table_over_the_same_pages_reuses_their_views_only(fake) -> None:
    drv, launches = fake
    q, kp, vp, indptr, idx, last = _inputs(drv)
    plan = _plan(drv, q)
    _step(plan, launches, q, kp, vp, indptr, idx, last, backend="nvrtc")
    views = _only(plan._pages_memo)[2]
    idx2 = drv.device_array(np.arange(NPAGES, dtype=np.int32)[::-1].copy())
    got = _step(plan, launches, q, kp, vp, indptr, idx2, last, backend="nvrtc")
    assert _only(plan._pages_memo)[2] is views  # the page views were reused, the table was not
    assert any(a[0] == "cai" and a[1] == idx2.ptr for a in got[0][3])
    assert got == _fresh(plan, launches, q, kp, vp, indptr, idx2, last, backend="nvrtc")
    # The page arrays re-pointed at other memory together with a new table: the views follow.
    other = drv.device_array(np.zeros((NPAGES, PS, KVH, D), BF16))
    vp.ptr = other.ptr
    vp._cai["data"] = (other.ptr, False)
    got = _step(plan, launches, q, kp, vp, indptr, idx, last, backend="nvrtc")
    assert got[0][3][2][1] == other.ptr
    assert got == _fresh(plan, launches, q, kp, vp, indptr, idx, last, backend="nvrtc")
    # Pages of another dtype on the same memory are refused, as on a fresh run.
    f16_k = FakeDeviceArray(drv, kp.ptr, kp.shape, np.dtype(np.float16), None, False)
    f16_v = FakeDeviceArray(drv, vp.ptr, vp.shape, np.dtype(np.float16), None, False)
    with pytest.raises(ArgumentError, match="k_pages"):
        plan.run(q, f16_k, f16_v, indptr, idx2, last, backend="nvrtc")


def test_one_plan_shared_by_layers_hits_its_memo_for_every_layer(fake, monkeypatch) -> None:
    # A model's layers share one plan (the same batch shape), each with its own KV cache, q and out: from the second
    # step on every layer's run is memoized; q is checked (the memo-miss path) once a layer, not once a layer a step.
    from pykern.ops import serving

    drv, launches = fake
    layers, steps = 3, 4
    per_layer = [_inputs(drv, seed) for seed in range(layers)]
    outs = [drv.device_array(np.zeros((B, KVH * G, D), BF16)) for _ in range(layers)]
    indptr, idx, last = per_layer[0][3:]  # one page table for all layers, as a serving step's
    plan = _plan(drv, per_layer[0][0])
    checked = []
    real_check_q = serving._check_q
    monkeypatch.setattr(serving, "_check_q", lambda *a: (checked.append(1), real_check_q(*a))[1])
    firsts = []
    for step in range(steps):
        for layer in range(layers):
            q, kp, vp = per_layer[layer][:3]
            got = _step(plan, launches, q, kp, vp, indptr, idx, last, out=outs[layer], backend="nvrtc")
            if step == 0:
                firsts.append(got)
            else:
                assert got == firsts[layer]  # the layer's own arrays, as its first (checked) run
    assert len(checked) == layers and len(plan._memo) == layers and len(plan._pages_memo) == layers
    assert [f[0][3][1][1] for f in firsts] == [per_layer[i][1].ptr for i in range(layers)]
    # A cache run once and then left out of the loop is dropped when a layer comes round again after a loop with
    # it missing (its arrays are no longer held); the layers' memos stay.
    stale = _inputs(drv, 99)
    _step(plan, launches, *stale[:3], indptr, idx, last, backend="nvrtc")
    assert len(plan._memo) == layers + 1
    for step in range(2):
        for layer in range(layers):
            q, kp, vp = per_layer[layer][:3]
            assert _step(plan, launches, q, kp, vp, indptr, idx, last, out=outs[layer], backend="nvrtc") == firsts[layer]
        assert len(plan._memo) == layers + 1 - step and len(plan._pages_memo) == layers + 1 - step
    assert len(checked) == layers + 1
