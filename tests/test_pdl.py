"""Programmatic dependent launch: which kernels may take it, what the launcher and the nvrtc backend do with
`pdl=True`, what the CUDA driver is asked for, what the kernels compile to, and enable_pdl on the paged decode.

A PDL launch lets a grid start while the previous kernel of its stream still runs; it is only safe for a kernel
that waits for that kernel (griddepcontrol.wait) before its first access, so the registry knows those kernels
(`// pykern: pdl` lines) and the launcher refuses the others. Whether it saves time needs a GPU
(tools/measure_gpu.py decode --pdl); here: correctness of the launch path and of the kernels' code."""
from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the helper modules beside this file

import pykern  # noqa: E402
from pykern import backends, launcher, registry  # noqa: E402
from pykern.backends.nvrtc import NvrtcBackend  # noqa: E402
from pykern.errors import ArgumentError, ArgumentTypeError  # noqa: E402

from fake_driver import LAUNCH_CU, compile_test_kernels, make_fake, sim_axpy  # noqa: E402
from sass_helpers import report, source_sass

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def kernel_path(monkeypatch):
    monkeypatch.setenv("PYKERN_KERNEL_PATH", str(LAUNCH_CU))


def _fake(monkeypatch, arch: str):
    drv, get_module = make_fake(compile_test_kernels(arch))
    drv.simulate["pktest_axpy_pdl"] = sim_axpy
    be = NvrtcBackend(driver_factory=lambda: drv, get_module=get_module, supported_archs=lambda: (arch,))
    monkeypatch.setitem(backends._instances, "nvrtc", be)
    return drv


def test_registry_marks_only_the_kernels_that_wait():
    marked = sorted(s.name for s in registry.kernels() if s.pdl)
    assert "pktest_axpy_pdl" in marked and not registry.get("pktest_axpy").pdl
    real = [k for k in marked if not k.startswith("pktest_")]
    decode = [k for k in real if k.startswith("decode_tc_paged_")]
    append = [k for k in real if k.startswith("paged_append_kv")]
    sampling = [k for k in real if k.startswith("sampling_")]
    assert len(decode) == 12  # d64 / d128 x (16-bit, e4m3, e5m2) x (bf16, f16 q)
    assert len(append) == 9  # f32 / bf16 / f16 pages, and f32 / bf16 / f16 values into e4m3 / e5m2 pages
    # the draws from probs and from logits and the softmax, each f32 / bf16 / f16 (a decode step's last kernel)
    assert sorted(sampling) == sorted(f"sampling_{f}{t}" for f in ("from_probs", "from_logits", "softmax")
                                      for t in ("", "_bf16", "_f16"))
    assert sorted(decode + append + sampling) == real


def test_source_pdl_patterns():
    text = "// pykern: pdl a_*, b\n  //pykern: pdl c\n// pykern: arch sm_90a\nint x; // pykern: pdl not_a_line\n"
    assert registry.source_pdl(text) == ("a_*", "b", "c")


@pytest.mark.parametrize("arch, expect", [("sm_90", True), ("sm_80", False)])
def test_nvrtc_launch_asks_the_driver_for_pdl_from_sm90(monkeypatch, arch, expect):
    drv = _fake(monkeypatch, arch)
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal(300).astype(np.float32), rng.standard_normal(300).astype(np.float32)
    y0 = y.copy()
    pykern.launch("pktest_axpy_pdl", 2, 256, y, x, 1.5, 300, backend="nvrtc", pdl=True)
    np.testing.assert_array_equal(y, np.float32(1.5) * x + y0)
    pykern.launch("pktest_axpy_pdl", 2, 256, y, x, 1.5, 300, backend="nvrtc")  # an ordinary launch of it
    assert [ln.pdl for ln in drv.launches] == [expect, False]


def test_devices_take_pdl_from_sm90():
    from pykern.backends.nvrtc import _Device

    assert [_Device(0, None, a, 0).pdl for a in ("sm_75", "sm_86", "sm_89", "sm_90", "sm_100", "sm_120")] == \
        [False, False, False, True, True, True]


def test_prepared_launch_keeps_pdl(monkeypatch):
    drv = _fake(monkeypatch, "sm_90")
    x, y = np.ones(64, np.float32), np.zeros(64, np.float32)
    prep = launcher.prepare("pktest_axpy_pdl", 1, 64, y, x, 2.0, 64, pdl=True)
    assert launcher.launch_prepared(prep, backend="nvrtc")
    assert launcher.launch_prepared(launcher.prepare("pktest_axpy", 1, 64, y, x, 2.0, 64), backend="nvrtc")
    assert [(ln.name, ln.pdl) for ln in drv.launches] == [("pktest_axpy_pdl", True), ("pktest_axpy", False)]
    np.testing.assert_array_equal(y, np.full(64, 4.0, np.float32))


def test_pdl_refused_for_a_kernel_that_does_not_wait(monkeypatch):
    drv = _fake(monkeypatch, "sm_90")
    x, y = np.ones(8, np.float32), np.zeros(8, np.float32)
    with pytest.raises(ArgumentError, match=r"^pdl: pktest_axpy does not wait for the previous kernel"):
        pykern.launch("pktest_axpy", 1, 8, y, x, 1.0, 8, backend="nvrtc", pdl=True)
    with pytest.raises(ArgumentError, match=r"^pdl: pktest_axpy does not wait"):
        launcher.prepare("pktest_axpy", 1, 8, y, x, 1.0, 8, pdl=True)
    with pytest.raises(ArgumentTypeError, match=r"^pdl: expected a bool, got int 1"):
        pykern.launch("pktest_axpy_pdl", 1, 8, y, x, 1.0, 8, backend="nvrtc", pdl=1)
    assert not drv.launches and not y.any()


def test_host_backend_runs_a_pdl_launch_as_an_ordinary_one():
    rng = np.random.default_rng(1)
    x, y = rng.standard_normal(100).astype(np.float32), rng.standard_normal(100).astype(np.float32)
    want = np.float32(-0.5) * x + y
    pykern.launch("pktest_axpy_pdl", 1, 128, y, x, -0.5, 100, backend="host", pdl=True)
    np.testing.assert_array_equal(y, want)


def test_cuda_driver_launches_with_programmatic_stream_serialization():
    """CudaDriver's PDL launch builds cuLaunchKernelEx's config from cuda.bindings' own types."""
    cu = pytest.importorskip("cuda.bindings.driver")
    from pykern.backends.driver import CudaDriver

    seen = []

    def launch_ex(cfg, func, params, extra):
        seen.append((cfg, func, params, extra))
        return (cu.CUresult.CUDA_SUCCESS,)

    drv = CudaDriver()
    drv._cu = types.SimpleNamespace(**{k: getattr(cu, k) for k in ("CUlaunchAttribute", "CUlaunchAttributeID",
                                                                 "CUlaunchConfig", "CUresult")},
                                    cuLaunchKernelEx=launch_ex)
    drv.launch_kernel("f", (3, 2, 1), (128, 1, 1), 4096, 0x1234, 0xabc0, pdl=True)
    (cfg, func, params, extra), = seen
    assert (func, params, extra) == ("f", 0xabc0, 0)
    assert (cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ, cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ) == (3, 2, 1, 128, 1, 1)
    assert cfg.sharedMemBytes == 4096 and int(cfg.hStream) == 0x1234 and cfg.numAttrs == 1
    attr = cfg.attrs[0]
    assert attr.id == cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    assert attr.value.programmaticStreamSerializationAllowed == 1


# -- the kernels' code: the wait comes before every global access ------------------------------------------

_GLOBAL = re.compile(r"^(LDG|LDGSTS|STG|ATOMG|ATOM|RED|LD|ST|CCTL)$")


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("source", ["decode_tc.cu", "paged.cu", "sampling.cu"])
def test_pdl_kernels_wait_before_their_first_global_access(arch, source):
    """Every kernel a `// pykern: pdl` line names: on sm_90 one ACQBULK (griddepcontrol.wait) before its first
    global load, store or atomic, and one PREEXIT (launch_dependents); before sm_90 neither."""
    src = ROOT / "kernels_cu" / source
    funcs = report()._instructions(source_sass(source, arch))
    names = [s.name for s in registry.parse_file(src) if s.pdl]
    assert len(names) == {"decode_tc.cu": 12, "paged.cu": 9, "sampling.cu": 9}[source] and set(names) <= set(funcs)
    for k in names:
        ops = [op.split(".")[0] for _, op, _, _ in funcs[k]]
        if arch == "sm_80":  # no griddepcontrol before sm_90: the wrappers compile to nothing
            assert "ACQBULK" not in ops and "PREEXIT" not in ops, k
            continue
        first = next(i for i, op in enumerate(ops) if _GLOBAL.match(op))
        assert ops.count("ACQBULK") == 1 and ops.index("ACQBULK") < first, (k, ops[:first + 1])
        assert ops.count("PREEXIT") == 1, k


# -- enable_pdl on the paged decode ----------------------------------------------------------------------

def _paged_case(rng, batch=2, kvh=2, group=4, d=64, page=16, lens=(40, 70)):
    import ml_dtypes

    bf = ml_dtypes.bfloat16
    pages = [-(-n // page) for n in lens]
    num_pages = sum(pages)
    k = rng.standard_normal((num_pages, page, kvh, d)).astype(bf)
    v = rng.standard_normal((num_pages, page, kvh, d)).astype(bf)
    q = rng.standard_normal((batch, kvh * group, d)).astype(bf)
    indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
    indices = rng.permutation(num_pages).astype(np.int32)
    last = np.array([n - (p - 1) * page for n, p in zip(lens, pages)], np.int32)
    return q, k, v, indptr, indices, last


@pytest.fixture
def host_launches(monkeypatch):
    """(kernel, pdl) of each host-backend launch from here on."""
    host = backends.get_backend("host")
    calls: list = []
    real = type(host).launch

    def spy(self, spec, *a, **kw):
        calls.append((spec.name, kw.get("pdl", False)))
        return real(self, spec, *a, **kw)

    monkeypatch.setattr(type(host), "launch", spy)
    return calls


def test_enable_pdl_reaches_the_tensor_core_launch_only(host_launches):
    from pykern.ops.serving import PagedDecodePlan

    rng = np.random.default_rng(2)
    q, k, v, indptr, indices, last = _paged_case(rng)
    plain = pykern.ops.paged_decode_attention(q, k, v, indptr, indices, last, backend="host")
    calls = host_launches
    calls.clear()
    out = pykern.ops.paged_decode_attention(q, k, v, indptr, indices, last, backend="host", enable_pdl=True)
    np.testing.assert_array_equal(out.view(np.uint16), plain.view(np.uint16))
    assert calls == [("decode_tc_paged_d64_bf16", True)]
    # A plan's memoized steps keep it; paged_attn (f32 q here) launches as usual whatever enable_pdl says.
    plan = PagedDecodePlan(2, 8, 2, 64, 16, q_dtype="bf16", max_kv_len=70)
    calls.clear()
    for pdl in (True, True, False):
        plan.run(q, k, v, indptr, indices, last, backend="host", enable_pdl=pdl)
    assert calls == [("decode_tc_paged_d64_bf16", True)] * 2 + [("decode_tc_paged_d64_bf16", False)]
    calls.clear()
    qf = q.astype(np.float32)
    pykern.ops.paged_decode_attention(qf, k.astype(np.float32), v.astype(np.float32), indptr, indices, last,
                                      backend="host", enable_pdl=True)
    assert calls and all(not pdl for _, pdl in calls), calls
    with pytest.raises(ArgumentTypeError, match=r"^enable_pdl: expected a bool, got str 'yes'"):
        plan.run(q, k, v, indptr, indices, last, backend="host", enable_pdl="yes")


def test_append_enable_pdl(host_launches):
    rng = np.random.default_rng(3)
    q, k, v, indptr, indices, last = _paged_case(rng)
    nk = rng.standard_normal((2, 2, 64)).astype(k.dtype)
    nv = rng.standard_normal((2, 2, 64)).astype(k.dtype)
    bi, pos = np.array([0, 1], np.int32), np.array([39, 69], np.int32)
    pykern.ops.append_paged_kv_cache(nk, nv, bi, pos, k, v, indices, indptr, last, backend="host", enable_pdl=True)
    assert host_launches == [("paged_append_kv_bf16", True)]
    for t, (b, p) in enumerate(zip(bi, pos)):  # token t at slot p % 16 of its sequence's page p // 16
        page = indices[indptr[b] + p // 16]
        np.testing.assert_array_equal(k[page, p % 16].view(np.uint16), nk[t].view(np.uint16))
        np.testing.assert_array_equal(v[page, p % 16].view(np.uint16), nv[t].view(np.uint16))
    with pytest.raises(ArgumentTypeError, match=r"^enable_pdl: expected a bool, got NoneType None"):
        pykern.ops.append_paged_kv_cache(nk, nv, bi, pos, k, v, indices, indptr, last, backend="host",
                                         enable_pdl=None)


def test_dense_decode_ops_enable_pdl(host_launches):
    """decode_attention / batched_decode_attention run the tensor-core kernel as a paged cache of one page a
    sequence: enable_pdl reaches that launch, the result is the plain launch's; the tile kernels ignore it."""
    import ml_dtypes

    rng = np.random.default_rng(4)
    bf = ml_dtypes.bfloat16
    q = rng.standard_normal((2, 8, 64)).astype(bf)
    kc = rng.standard_normal((2, 2, 100, 64)).astype(bf)
    vc = rng.standard_normal((2, 2, 100, 64)).astype(bf)
    lens = np.array([100, 37], np.int32)
    plain = pykern.ops.batched_decode_attention(q, kc, vc, lens, backend="host", kv_layout="HND")
    host_launches.clear()
    got = pykern.ops.batched_decode_attention(q, kc, vc, lens, backend="host", enable_pdl=True, kv_layout="HND")
    np.testing.assert_array_equal(got.view(np.uint16), plain.view(np.uint16))
    one = pykern.ops.decode_attention(q[1], kc[1], vc[1], 37, backend="host", enable_pdl=True, kv_layout="HND")
    np.testing.assert_array_equal(one.view(np.uint16), plain[1].view(np.uint16))
    assert host_launches == [("decode_tc_paged_d64_bf16", True)] * 2
    host_launches.clear()
    pykern.ops.decode_attention(q[1], kc[1], vc[1], 37, backend="host", tensor_cores=False, enable_pdl=True,
                                kv_layout="HND")
    assert host_launches and all(not pdl for _, pdl in host_launches), host_launches
    with pytest.raises(ArgumentTypeError, match=r"^enable_pdl: expected a bool, got int 1"):
        pykern.ops.decode_attention(q[1], kc[1], vc[1], 37, backend="host", enable_pdl=1, kv_layout="HND")


# -- on a GPU -------------------------------------------------------------------------------------------------

from gpu import requires_gpu  # noqa: E402


@requires_gpu
def test_pdl_decode_reads_what_the_previous_kernel_wrote_and_captures():
    """Each step's q and split counters are written by the kernel just before it (a torch copy, the previous
    decode): launched early, the decode must still see them. Eager and CUDA-graph replays against the plain
    launch, bit for bit."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    from pykern.ops.serving import PagedDecodePlan

    torch.manual_seed(0)
    b, h, kvh, d, ps, pages_per = 4, 16, 4, 128, 16, 64
    kp = torch.randn(b * pages_per, ps, kvh, d, device="cuda", dtype=torch.bfloat16)
    vp = torch.randn_like(kp)
    indptr = torch.arange(0, b * pages_per + 1, pages_per, device="cuda", dtype=torch.int32)
    indices = torch.randperm(b * pages_per, device="cuda").to(torch.int32)
    last = torch.full((b,), ps, device="cuda", dtype=torch.int32)
    qs = [torch.randn(b, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(6)]
    q = torch.empty_like(qs[0])
    plan = PagedDecodePlan(b, h, kvh, d, ps, q_dtype="bf16", num_splits=4, like=q)
    assert plan.tensor_cores

    def steps(pdl):
        outs = []
        for src in qs:
            q.copy_(src)
            outs.append(plan.run(q, kp, vp, indptr, indices, last, enable_pdl=pdl).clone())
        return outs

    want = steps(False)
    torch.cuda.synchronize()
    for got, w in zip(steps(True), want):
        assert torch.equal(got, w)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        steps(True)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs_g = steps(True)
    g.replay()
    torch.cuda.synchronize()
    for got, w in zip(outs_g, want):
        assert torch.equal(got, w)


# -- enable_pdl on the sampling ops (FlashInfer's convention: None is on where the device takes it) ----------

_SAMPLING_OPS = [
    ("sampling_from_probs", (), "sampling_from_probs"),
    ("top_k_sampling_from_probs", (3,), "sampling_from_probs"),
    ("top_p_sampling_from_probs", (0.8,), "sampling_from_probs"),
    ("min_p_sampling_from_probs", (0.1,), "sampling_from_probs"),
    ("top_k_top_p_sampling_from_probs", (3, 0.8), "sampling_from_probs"),
    ("sampling_from_logits", (), "sampling_from_logits"),
    ("top_k_top_p_sampling_from_logits", (3, 0.8), "sampling_from_logits"),
]


@pytest.mark.parametrize("op, args, kernel", _SAMPLING_OPS)
def test_sampling_ops_enable_pdl(host_launches, op, args, kernel):
    """Every sampling op a decode step ends with takes enable_pdl: None (the default) and True launch with PDL,
    False without; the tokens are the plain launch's, split rows (ctas_per_row 3: tickets and partials) included;
    anything else is refused before a launch."""
    rng = np.random.default_rng(5)
    x = rng.random((3, 1500)).astype(np.float32)
    if "probs" in op:
        x /= x.sum(1, keepdims=True)
    fn = getattr(pykern.ops, op)
    kw = dict(seed=77, offset=3, backend="host", return_valid=True)
    for split in (1, 3):
        want, want_valid = fn(x, *args, enable_pdl=False, ctas_per_row=split, **kw)
        for pdl in (None, True):
            got, got_valid = fn(x, *args, enable_pdl=pdl, ctas_per_row=split, **kw)
            np.testing.assert_array_equal(got, want)
            np.testing.assert_array_equal(got_valid, want_valid)
    assert host_launches == [(kernel, p) for _ in (1, 3) for p in (False, True, True)]
    host_launches.clear()
    with pytest.raises(ArgumentTypeError, match=r"^enable_pdl: expected a bool or None, got int 1"):
        fn(x, *args, enable_pdl=1, **kw)
    assert host_launches == []


def test_softmax_enable_pdl(host_launches):
    rng = np.random.default_rng(6)
    x = rng.standard_normal((2, 300)).astype(np.float32)
    want = pykern.ops.softmax(x, 0.7, enable_pdl=False, backend="host")
    for pdl in (None, True):
        np.testing.assert_array_equal(pykern.ops.softmax(x, 0.7, pdl, backend="host"), want)
    assert host_launches == [("sampling_softmax", False), ("sampling_softmax", True), ("sampling_softmax", True)]
    with pytest.raises(ArgumentTypeError, match=r"^enable_pdl: expected a bool or None, got str 'on'"):
        pykern.ops.softmax(x, enable_pdl="on", backend="host")

