"""Host-side cost of one `pykern.launch` on the nvrtc backend: validation + conversion + packing.

The driver is the test suite's fake (tests/fake_driver.py) with its recording launch replaced by a
no-op, so what is timed is pykern's own work per launch plus one Python method call per driver
call. Device arrays (`__cuda_array_interface__`) are the hot path; NumPy arrays additionally pay
for alloc + copy in/out + sync + free (here against fake device memory, so only indicative).

    python tools/bench_launch.py [--n 20000] [--json]
    python tools/bench_launch.py --ops [--n 50 --repeats 40] [--save F] [--before F] [--only rms_norm,rope]

--ops adds whole-op rows on a fake compute-capability 9.0 GPU (device arrays through
__cuda_array_interface__, the backend's launch real up to a no-op cuLaunchKernel): one
flash_attention forward on the sm_90a (TMA) path, its three tensor maps included, one
PagedDecodePlan.run (bf16, tensor-core decode) and one top_k_top_p_sampling_from_probs (batch 1, vocabulary
128256, fp32). torch CUDA tensors cannot exist here, so torch's
custom_op wrapper (pykern.torch) and the torch-specific argument conversion are outside these rows.

Budget: <= 10 us per launch with device arrays.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

BUDGET_US = 10.0


def _time(fn: Callable[[], Any], n: int, repeats: int) -> float:
    """Best-of-`repeats` mean microseconds per call over `n` calls. Many short repeats and the
    minimum filter out time slices lost to other processes on a shared machine."""
    for _ in range(min(n, 500)):
        fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n)
    return best * 1e6


def _fake_h100(host_memory: bool) -> tuple[Any, Any]:
    """(driver, backend): the nvrtc backend over the test suite's fake driver (compute capability 9.0, an H100 /
    H200) whose cuLaunchKernel does nothing and whose function handles come without a module (nothing is
    compiled: the launch packs as on a GPU). The sm_90a tensor maps are encoded by the real cuda.bindings encode
    (its C call stubbed) when cuda.bindings is installed, else by the fake's (its checks). host_memory: host
    addresses count as device memory (CPU tensors stand in for CUDA ones)."""
    from fake_driver import FakeDriver

    from pykern.backends import nvrtc

    drv = FakeDriver(cc=(9, 0), max_shared_optin=227 * 1024)
    drv.launch_kernel = lambda *a, **k: None  # type: ignore[method-assign]
    drv.set_current = lambda ctx: setattr(drv, "current", ctx)  # type: ignore[method-assign]
    drv.current_context = lambda: drv.current  # type: ignore[method-assign]
    drv._call = lambda *a: None  # type: ignore[method-assign]  # no call log growing over the run
    if host_memory:
        drv._find = lambda ptr, nbytes: (None, 0)  # type: ignore[method-assign]

    def get_module(source: Any, arch: str, kernel: Any = None) -> Any:
        raise AssertionError("the plans are stubbed: nothing is compiled")

    be = nvrtc.NvrtcBackend(driver_factory=lambda: drv, get_module=get_module,
                            supported_archs=lambda: ("sm_80", "sm_90"))

    def plan(dev: Any, spec: Any) -> Any:  # a function handle without a module
        p = nvrtc._Plan(spec, 1, 0)
        p.smem_set = 1 << 30
        dev.plans[id(spec)] = p
        return p

    be._plan = plan  # type: ignore[method-assign]
    try:  # the real driver's encode (cuda.bindings argument objects), only the C call itself stubbed
        from cuda.bindings import driver as cu

        from pykern.backends.driver import CudaDriver

        class _Cu:
            def __getattr__(self, name: str) -> Any:
                return getattr(cu, name)

            @staticmethod
            def cuTensorMapEncodeTiled(*a: Any) -> Any:
                return cu.CUresult.CUDA_SUCCESS, cu.CUtensorMap()

        real = object.__new__(CudaDriver)
        real._cu, real._ok = _Cu(), cu.CUresult.CUDA_SUCCESS
        drv.tensor_map_encode_tiled = real.tensor_map_encode_tiled  # type: ignore[method-assign]
    except ImportError:
        pass
    return drv, be


def _op_rows(n: int, reps: int) -> dict[str, float]:
    """Host microseconds of one flash_attention (sm_90a path), one PagedDecodePlan.run and one
    top_k_top_p_sampling_from_probs on a fake H100."""
    import ml_dtypes
    import numpy as np

    try:  # where these calls matter torch is loaded, which switches on pykern's torch checks (devices, streams)
        import torch  # noqa: F401
    except ImportError:
        pass
    from fake_driver import FakeDeviceArray

    from pykern import arrays, backends, ops
    from pykern.ops.serving import PagedDecodePlan

    drv, be = _fake_h100(host_memory=False)
    saved = backends._instances.get("nvrtc"), arrays.empty, arrays.zeros
    backends._instances["nvrtc"] = be
    real_empty, real_zeros = arrays.empty, arrays.zeros

    # New outputs (flash_attention's lse each call) come from one fake allocation, as a caching allocator
    # hands them out: the fake's own allocator scans its memory map and would dominate the row.
    pool = drv.device_array(np.zeros(1 << 22, np.uint8))

    def empty(shape: Any, dtype: Any, like: Any = None) -> Any:
        if isinstance(like, FakeDeviceArray):
            return FakeDeviceArray(drv, pool.ptr, shape, arrays._resolve(dtype), None, False)
        return real_empty(shape, dtype, like)

    def zeros(shape: Any, dtype: Any, like: Any = None) -> Any:
        if isinstance(like, FakeDeviceArray):
            return drv.device_array(np.zeros(shape, arrays._resolve(dtype)))
        return real_zeros(shape, dtype, like)

    arrays.empty, arrays.zeros = empty, zeros
    try:
        bf16 = np.dtype(ml_dtypes.bfloat16)
        rng = np.random.default_rng(0)
        q, k, v = (drv.device_array(rng.standard_normal((4, 256, 16, 128)).astype(bf16)) for _ in range(3))
        out = drv.device_array(np.zeros((4, 256, 16, 128), bf16))
        names: list[str] = []
        real_launch = be.launch
        be.launch = lambda spec, *a, **kw: (names.append(spec.name), real_launch(spec, *a, **kw))  # type: ignore
        ops.flash_attention(q, k, v, causal=True, out=out, backend="nvrtc")
        assert names == ["attention_fwd_sm90_d128_bf16"], names
        b, g, kvh, d, ps, L = 8, 4, 8, 128, 16, 64
        npages = b * L // ps
        qd = drv.device_array(rng.standard_normal((b, kvh * g, d)).astype(bf16))
        kp = drv.device_array(rng.standard_normal((npages, ps, kvh, d)).astype(bf16))
        vp = drv.device_array(rng.standard_normal((npages, ps, kvh, d)).astype(bf16))
        indptr = drv.device_array(np.arange(0, npages + 1, L // ps, dtype=np.int32))
        idx = drv.device_array(rng.permutation(npages).astype(np.int32))
        last = drv.device_array(np.full((b,), ps, np.int32))
        dplan = PagedDecodePlan(b, kvh * g, kvh, d, ps, q_dtype="bf16", kv_dtype="bf16", max_kv_len=1024, like=qd)
        names.clear()
        dplan.run(qd, kp, vp, indptr, idx, last, backend="nvrtc")
        assert names == ["decode_tc_paged_d128_bf16"], names
        be.launch = real_launch  # type: ignore[method-assign]
        idx2 = drv.device_array(rng.permutation(npages).astype(np.int32))
        turn = [idx, idx2]

        def new_table() -> None:  # another page table every step: nothing of the previous step applies
            turn.reverse()
            dplan.run(qd, kp, vp, indptr, turn[0], last, backend="nvrtc")

        probs = drv.device_array(np.full((1, 128256), 1 / 128256, np.float32))
        names.clear()
        be.launch = lambda spec, *a, **kw: (names.append(spec.name), real_launch(spec, *a, **kw))  # type: ignore
        ops.top_k_top_p_sampling_from_probs(probs, 50, 0.9, seed=1, backend="nvrtc")
        assert names == ["sampling_from_probs"], names
        be.launch = real_launch  # type: ignore[method-assign]
        return {
            "op_top_k_top_p_sampling_us": _time(
                lambda: ops.top_k_top_p_sampling_from_probs(probs, 50, 0.9, seed=1, backend="nvrtc"), n, reps),
            "op_flash_attention_sm90_us": _time(
                lambda: ops.flash_attention(q, k, v, causal=True, out=out, backend="nvrtc"), n, reps),
            "op_paged_decode_plan_run_us": _time(
                lambda: dplan.run(qd, kp, vp, indptr, idx, last, backend="nvrtc"), n, reps),
            "op_paged_decode_plan_run_new_table_us": _time(new_table, n, reps),
        }
    finally:
        if saved[0] is None:
            backends._instances.pop("nvrtc", None)
        else:
            backends._instances["nvrtc"] = saved[0]
        arrays.empty, arrays.zeros = saved[1], saved[2]


# --------------------------------------------------------------------------- pykern.torch calls, launch stubbed

# (op, shape label): the pykern.torch calls of a training step. "fwd" rows time the public function on
# tensors that need no gradient (the custom op, its checks, pykern.ops, pykern.launch, the backend's packing);
# "bwd" rows time torch.autograd.grad over a graph built once (the autograd engine, the registered backward
# formula, the backward custom op and its launches). Small shapes: the Python work does not depend on them,
# and small CPU allocations stay out of the kernel's mmap / munmap.
TORCH_ROWS = (
    ("flash_attention", "fwd q,k,v (1,256,8,128) bf16 causal"),
    ("flash_attention", "bwd"),
    ("rms_norm", "fwd x (256,512) bf16"),
    ("rms_norm", "bwd"),
    ("add_rms_norm", "fwd x,res (256,512) bf16"),
    ("add_rms_norm", "bwd"),
    ("layer_norm", "fwd x (256,512) bf16, w, b"),
    ("layer_norm", "bwd"),
    ("rope", "fwd q (2,128,8,64) k (2,128,2,64) bf16"),
    ("rope", "bwd"),
    ("swiglu", "fwd gate,up (256,512) bf16"),
    ("swiglu", "bwd"),
    ("gelu_gate", "fwd gate,up (256,512) bf16 tanh"),
    ("gelu_gate", "bwd"),
    ("gelu", "fwd x (256,512) bf16"),
    ("gelu", "bwd"),
    ("cross_entropy", "fwd logits (64,256) bf16 mean"),
    ("cross_entropy", "bwd"),
)


def _median_us(fn: Callable[[], Any], n: int, repeats: int) -> float:
    """Median over `repeats` of the mean microseconds per call of `n` calls (after a warm-up), in CPU time of
    this process (time.process_time): on a shared machine the wall clock also counts the time slices other
    processes take, which swings the rows by several times from one minute to the next."""
    import statistics

    clock = time.process_time
    for _ in range(min(max(n, 20), 200)):
        fn()
    per = []
    for _ in range(repeats):
        t0 = clock()
        for _ in range(n):
            fn()
        per.append((clock() - t0) / n)
    return statistics.median(per) * 1e6


class stubbed_gpu:
    """A context in which pykern.torch calls on CPU tensors take the CUDA path up to the driver launch.

    - The default backend is the nvrtc backend over the test suite's fake driver (compute capability 9.0,
      an H100 / H200), whose cuLaunchKernel does nothing; function handles come without a module (nothing
      is compiled). Everything before the launch runs as on a GPU: plan lookup, packing of the kernel
      parameters, context checks; the sm_90a kernels are chosen and their tensor maps encoded by the real
      cuda.bindings encode (its C call stubbed) when cuda.bindings is installed, else by the fake's.
    - The launcher converts CPU tensors as it converts CUDA ones (a DeviceView: data_ptr, shape, dtype), not
      into NumPy views, tensor maps read them as CUDA tensors, and `arrays.is_host` calls a tensor
      device memory and `devices.array_device` places it on cuda:0, so the ops skip the value checks they
      make only on host arrays (rope's position ids, the embedding's ids) and flash attention takes its
      sm_90a (TMA) kernels, as on an H100 / H200.
    What differs from a GPU host: torch's own dispatch is its CPU one (allocations from the CPU allocator,
    no CUDA caching allocator), and `arrays.launch_stream` does not ask torch for the current CUDA stream
    (on a GPU that is one more torch call per op).
    """

    def __enter__(self) -> "stubbed_gpu":
        from pykern import backends, launcher, tensormap

        drv, be = _fake_h100(host_memory=True)
        real_device_view = tensormap._device_view

        def device_view(array: Any) -> Any:  # tensormap's CUDA-tensor reading, on a CPU tensor
            if type(array).__module__.startswith("torch"):
                es = array.element_size()
                return (array.data_ptr(), tuple(array.shape), tuple([s * es for s in array.stride()]),
                        str(array.dtype).removeprefix("torch."))
            return real_device_view(array)

        from pykern import arrays

        real_is_host = arrays.is_host

        def is_host(a: Any) -> bool:  # a tensor is device memory here: no host-only value checks
            return False if arrays.is_torch(a) else real_is_host(a)

        from pykern import devices
        from pykern.ops import _attention_sm90

        real_array_device = devices.array_device

        def array_device(a: Any) -> Any:  # a CPU tensor is on cuda:0 (the sm_90a kernels' tensor maps take it)
            d = real_array_device(a)
            return 0 if d == devices.HOST and arrays.is_torch(a) else d

        self._saved = (backends._instances.get("nvrtc"), backends._default, launcher._cpu_as_device,
                       tensormap._device_view, arrays.is_host, devices.array_device, _attention_sm90.array_device)
        devices.array_device = _attention_sm90.array_device = array_device
        backends._instances["nvrtc"] = be
        backends._default = "nvrtc"
        launcher._cpu_as_device = True
        tensormap._device_view = device_view
        arrays.is_host = is_host
        self.backend = be
        self.driver = drv  # tests/step_audit.py records its calls again
        return self

    def __exit__(self, *exc: Any) -> None:
        from pykern import backends, launcher, tensormap

        from pykern import arrays

        from pykern import devices
        from pykern.ops import _attention_sm90

        nv, default, view, tview, arrays.is_host, devices.array_device, _attention_sm90.array_device = self._saved
        if nv is None:
            backends._instances.pop("nvrtc", None)
        else:
            backends._instances["nvrtc"] = nv
        backends._default = default
        launcher._cpu_as_device = view
        tensormap._device_view = tview


def torch_calls() -> dict[tuple[str, str], Callable[[], Any]]:
    """The call of each TORCH_ROWS row (tensors made once)."""
    import torch

    import pykern.torch as pt

    g = torch.Generator().manual_seed(0)
    bf = torch.bfloat16

    def t(*shape: int, grad: bool = False, dtype: Any = bf) -> Any:
        return torch.randn(*shape, generator=g).to(dtype).requires_grad_(grad)

    calls: dict[tuple[str, str], Callable[[], Any]] = {}

    def both(op: str, fwd: Callable[..., Any], args: tuple, nograd: tuple, outputs: Callable[[Any], Any]) -> None:
        label = next(s for o, s in TORCH_ROWS if o == op and s.startswith("fwd"))
        calls[(op, label)] = lambda: fwd(*nograd)
        out = outputs(fwd(*args))
        inputs = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
        grads = [torch.ones_like(o) for o in out]
        calls[(op, "bwd")] = lambda: torch.autograd.grad(out, inputs, grads, retain_graph=True)

    q, k, v = (t(1, 256, 8, 128, grad=True) for _ in range(3))
    both("flash_attention", lambda q, k, v: pt.flash_attention(q, k, v, causal=True), (q, k, v),
         (q.detach(), k.detach(), v.detach()), lambda o: (o,))
    x, w, b = t(256, 512, grad=True), t(512, grad=True), t(512, grad=True)
    res = t(256, 512, grad=True)
    both("rms_norm", pt.rms_norm, (x, w), (x.detach(), w.detach()), lambda o: (o,))
    both("add_rms_norm", pt.add_rms_norm, (x, res, w), (x.detach(), res.detach(), w.detach()), lambda o: o)
    both("layer_norm", pt.layer_norm, (x, w, b), (x.detach(), w.detach(), b.detach()), lambda o: (o,))
    rq, rk = t(2, 128, 8, 64, grad=True), t(2, 128, 2, 64, grad=True)
    pos = torch.arange(128)
    inv = 1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64))
    emb = torch.cat([torch.outer(torch.arange(4096).float(), inv)] * 2, -1)
    cos, sin = emb.cos(), emb.sin()
    both("rope", lambda q, k: pt.rope(q, k, cos, sin, pos), (rq, rk), (rq.detach(), rk.detach()), lambda o: o)
    gate, up = t(256, 512, grad=True), t(256, 512, grad=True)
    both("swiglu", pt.swiglu, (gate, up), (gate.detach(), up.detach()), lambda o: (o,))
    both("gelu_gate", lambda a, c: pt.gelu_gate(a, c, "tanh"), (gate, up), (gate.detach(), up.detach()),
         lambda o: (o,))
    both("gelu", pt.gelu, (x,), (x.detach(),), lambda o: (o,))
    logits = t(64, 256, grad=True)  # small: its backward is torch arithmetic, here computed on the CPU
    tgt = torch.randint(0, 256, (64,), generator=g)
    both("cross_entropy", lambda lg, tg: pt.cross_entropy(lg, tg), (logits, tgt), (logits.detach(), tgt),
         lambda o: (o,))
    return calls


def reference_calls() -> dict[str, Callable[[], Any]]:
    """torch calls timed beside the rows, in the same process: what this machine's Python and torch's
    dispatcher cost (the budgets of tests/test_host_time.py are ratios against `torch_add`)."""
    import torch
    import torch.nn.functional as F

    a, b = torch.ones(4), torch.ones(4)
    q = torch.randn(1, 1, 1, 8)  # SDPA's entry and dispatch with next to no arithmetic (CPU)
    return {
        "torch_add": lambda: torch.add(a, b),
        "sdpa_cpu_1x1x1x8": lambda: F.scaled_dot_product_attention(q, q, q, is_causal=True),
    }


def torch_rows(n: int, repeats: int, only: Any = None) -> dict[tuple[str, str], float]:
    """Median microseconds per call of each TORCH_ROWS row (or those in `only`) with the launch stubbed."""
    out: dict[tuple[str, str], float] = {}
    with stubbed_gpu():
        calls = torch_calls()
        for key in TORCH_ROWS:
            if only is None or key in only or key[0] in only:
                out[key] = _median_us(calls[key], n, repeats)
    return out


def _print_torch_rows(rows: dict[tuple[str, str], float], refs: dict[str, float], before: dict[str, float],
                      as_json: bool) -> None:
    if as_json:
        print(json.dumps({"rows": {f"{o}  {s}": v for (o, s), v in rows.items()}, "reference": refs}, indent=2))
        return
    print(f"{'op':16s} {'shape':42s} {'before_us':>10s} {'now_us':>8s}")
    for (o, s), v in rows.items():
        b = before.get(f"{o}  {s}")
        print(f"{o:16s} {s:42s} {('%.1f' % b) if b is not None else '-':>10s} {v:8.1f}")
    for name, v in refs.items():
        print(f"{'(' + name + ')':16s} {'':42s} {'':>10s} {v:8.1f}")


def _main_ops(args: Any) -> int:
    import torch

    torch.set_num_threads(1)  # one core's Python: the other threads would only add noise on a shared machine
    only = set(args.only.split(",")) if args.only else None
    rows = torch_rows(args.n, args.repeats, only)
    refs = {name: _median_us(fn, args.n, args.repeats) for name, fn in reference_calls().items()}
    before = json.loads(Path(args.before).read_text())["rows"] if args.before else {}
    _print_torch_rows(rows, refs, before, args.json)
    if args.save:
        Path(args.save).write_text(json.dumps({"rows": {f"{o}  {s}": v for (o, s), v in rows.items()},
                                               "reference": refs}, indent=2) + "\n")
    if not args.json and only is None:
        print()
        for k, v in _op_rows(args.n, args.repeats).items():
            print(f"{k:55s} {v:.2f}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=100, help="launches per timing repeat (short: fewer preemptions)")
    ap.add_argument("--repeats", type=int, default=400, help="timing repeats (the best one counts)")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    ap.add_argument("--ops", action="store_true",
                    help="time whole calls instead of bare launches: the pykern.torch calls of a training step "
                         "(forward and backward, rows `op shape before_us now_us`, median us a call) on CPU tensors "
                         "with the driver launch stubbed, then pykern.ops' flash_attention (sm_90a), "
                         "PagedDecodePlan.run and the sampler on device arrays")
    ap.add_argument("--save", metavar="FILE", help="--ops: also write the rows to FILE (JSON), for --before")
    ap.add_argument("--before", metavar="FILE", help="--ops: a file written by --save, shown as before_us")
    ap.add_argument("--only", metavar="OPS", help="--ops: comma-separated op names (default: all rows)")
    args = ap.parse_args(argv)
    if args.ops:
        return _main_ops(args)

    from fake_driver import LAUNCH_CU, make_fake

    os.environ["PYKERN_KERNEL_PATH"] = str(LAUNCH_CU)
    import numpy as np

    import pykern
    from pykern import backends, launcher, registry
    from pykern.backends.nvrtc import NvrtcBackend

    fake, get_module = make_fake()
    fake.launch_kernel = lambda *a: None  # type: ignore[method-assign]  # time pykern, not the fake's checks
    fake.set_current = lambda ctx: setattr(fake, "current", ctx)  # type: ignore[method-assign]
    fake.current_context = lambda: fake.current  # type: ignore[method-assign]
    be = NvrtcBackend(driver_factory=lambda: fake, get_module=get_module, supported_archs=lambda: ("sm_80",))
    backends._instances["nvrtc"] = be
    launch = pykern.launch

    n = 1 << 16
    x = np.ones(n, np.float32)
    y = np.zeros(n, np.float32)
    dx, dy = fake.device_array(x, readonly=True), fake.device_array(y)
    small_x, small_y = np.ones(256, np.float32), np.zeros(256, np.float32)
    out = fake.device_array(np.zeros(12))
    scalars = (-1, 1, -1, 1, -1, 1, -1, 1, 1.0, 1.0, False, -1)
    axpy = registry.get("pktest_axpy")
    grid, block = (n // 256,), (256,)

    def bare_backend() -> None:  # the backend alone, arguments already converted
        be.launch(axpy, (256, 1, 1), (256, 1, 1), conv, 0, None)

    conv = launcher.convert_args(axpy, (dy, dx, 2.0, n))
    class CoreStream:  # the cuda.core stream protocol
        def __cuda_stream__(self) -> tuple[int, int]:
            return (0, 7)

    core = CoreStream()
    from pykern.arrays import DeviceView

    vx, vy = DeviceView(dx.ptr, (n,), "<f4", dx), DeviceView(dy.ptr, (n,), "<f4", dy)
    reps = args.repeats
    results = {
        "launch_axpy_device_arrays_us": _time(
            lambda: launch("pktest_axpy", grid, block, dy, dx, 2.0, n, backend="nvrtc"), args.n, reps),
        "launch_all_types_13_params_us": _time(
            lambda: launch("pktest_all_types", 1, 1, out, *scalars, backend="nvrtc"), args.n, reps),
        "launch_axpy_cuda_stream_obj_us": _time(
            lambda: launch("pktest_axpy", grid, block, dy, dx, 2.0, n, stream=core, backend="nvrtc"), args.n, reps),
        # What a torch CUDA tensor becomes in the launcher (its data_ptr(), no CAI dict per launch).
        "launch_axpy_device_view_us": _time(
            lambda: launch("pktest_axpy", grid, block, vy, vx, 2.0, n, stream=0, backend="nvrtc"), args.n, reps),
        "backend_only_axpy_us": _time(bare_backend, args.n, reps),
        "launcher_checks_only_axpy_us": _time(
            lambda: (launcher.check_geometry(grid, block, 0), launcher.convert_args(axpy, (dy, dx, 2.0, n))),
            args.n, reps),
        "launch_axpy_numpy_256_us (alloc+copies on the fake)": _time(
            lambda: launch("pktest_axpy", 1, 256, small_y, small_x, 2.0, 256, backend="nvrtc"), args.n // 4, reps),
    }
    # Several GPUs: each launch also finds its device (here a plain CAI pointer: one driver query per array).
    fake8, get_module8 = make_fake(devices=8)
    fake8.launch_kernel = lambda *a: None  # type: ignore[method-assign]
    fake8.set_current = lambda ctx: setattr(fake8, "current", ctx)  # type: ignore[method-assign]
    fake8.current_context = lambda: fake8.current  # type: ignore[method-assign]
    be8 = NvrtcBackend(driver_factory=lambda: fake8, get_module=get_module8, supported_archs=lambda: ("sm_80",))
    d8x, d8y = fake8.device_array(x, readonly=True, device=3), fake8.device_array(y, device=3)
    owner = fake8.alloc_device
    fake8.pointer_device = lambda p: owner[p]  # type: ignore[method-assign]  # a dict lookup, not the fake's scan
    fake8.set_current(0xC3)  # the caller's context is the arrays' device's (the usual torch case)
    conv8 = launcher.convert_args(axpy, (d8y, d8x, 2.0, n))
    results["backend_only_axpy_8_gpus_us"] = _time(
        lambda: be8.launch(axpy, (256, 1, 1), (256, 1, 1), conv8, 0, None), args.n, reps)
    noop = lambda: None  # noqa: E731
    results["calibration_empty_call_us"] = _time(noop, args.n * 10, args.repeats)
    results["budget_us"] = BUDGET_US
    results["within_budget"] = results["launch_axpy_device_arrays_us"] <= BUDGET_US
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        for k, v in results.items():
            print(f"{k:55s} {v:.2f}" if isinstance(v, float) else f"{k:55s} {v}")
    return 0 if results["within_budget"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
