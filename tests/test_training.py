"""Training kernels: NumPy references, flash vs naive attention backward under
both host schedules, run-to-run determinism, unaligned (scalar) paths, argument checks
before launch, NVRTC resources (0 spills), and flash_attention's lse feeding
attention_backward. Every case of the family runs on the host under two schedules and on
the numba references in tests/test_difftest.py."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from pykern import ArgumentError, ArgumentTypeError, ops
from pykern.difftest.cases import attention as A, training as T
from pykern.difftest.runner import compare
from pykern.tolerance import tolerance

ROOT = Path(__file__).resolve().parent.parent
SOURCES = (ROOT / "kernels_cu" / "training.cu", ROOT / "kernels_cu" / "attention_bwd_fma.cu")


from family_helpers import check as _check, check_central_differences, need as _need


_CASES = list(T.cases(np.random.default_rng(0)))


# --------------------------------------------------------------------------- NumPy references


def test_np_attention_backward_matches_finite_differences() -> None:
    rng = np.random.default_rng(1)
    q, k, v, g = (a.astype(np.float64) for a in A.attention_inputs(rng, None, 5, 4, 2, 3, "f32"))

    def loss(q_, k_, v_):
        return float((A.np_attention_forward(q_, k_, v_)[0] * g).sum())

    check_central_differences(loss, [q, k, v], A.np_attention_backward(q, k, v, g),
                              indices=lambda arr: [(0, 0, 0), (3, 1, 2), (4, arr.shape[1] - 1, 1)])


def test_np_lse_is_logsumexp_of_scaled_visible_scores() -> None:
    rng = np.random.default_rng(2)
    q, k, v, _ = A.attention_inputs(rng, None, 4, 2, 1, 8, "f32")
    _, lse = A.np_attention_forward(q, k, v)
    i, h = 2, 1
    s = np.array([q[i, h].astype(np.float64) @ k[j, 0] for j in range(i + 1)]) / np.sqrt(8)
    np.testing.assert_allclose(lse[i, h], np.log(np.exp(s).sum()))


def test_np_cross_entropy_gradient_is_softmax_minus_onehot() -> None:
    x = np.array([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]])
    loss, grad = T.np_cross_entropy(x, np.array([2, -100]), -100)
    p = np.exp(x[0]) / np.exp(x[0]).sum()
    np.testing.assert_allclose(loss, -np.log(p[2]))
    np.testing.assert_allclose(grad[0], p - [0, 0, 1])
    assert not grad[1].any()


# --------------------------------------------------------------------------- every case on the host backend


def test_every_case_runs_in_the_difftest_suite() -> None:
    # Every case of this family runs in tests/test_difftest.py: on the host under the forward and the reverse
    # schedule (test_host_schedules, each within tolerance of NumPy and of each other) and, big ones aside, on
    # the numba references (test_numba); the per-kernel small cases also under random / interleave / fma0 /
    # racecheck / initcheck (tests/test_host_modes.py).
    # Running them here again on one schedule (and a subset on numba) added nothing: registered is enough.
    from pykern.difftest.case import families

    assert _CASES and any(gen is T.cases for gen in families().values())


def test_every_kernel_has_a_case() -> None:
    names = set()
    for src in SOURCES:
        names |= set(re.findall(r'extern "C" __global__ void(?: __launch_bounds__\([^)]*\))? (\w+)\(', src.read_text()))
    cases = _CASES + list(A.cases(np.random.default_rng(0)))  # the backward's: the attention family's
    covered = {k for c in cases for k in c.kernels}
    assert names and names <= covered, f"kernels without a case: {sorted(names - covered)}"


@pytest.mark.parametrize("schedule", ["forward", "reverse"])
def test_flash_and_naive_attention_agree(schedule: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _need("host")
    monkeypatch.setenv("PYKERN_HOST_SCHEDULE", schedule)
    rng = np.random.default_rng(7)
    atol, rtol = tolerance("attention_backward", "f32")
    for batch, seq, heads, kvh, hd in ((None, 65, 4, 2, 32), (2, 33, 8, 1, 80)):
        q, k, v, g = A.attention_inputs(rng, batch, seq, heads, kvh, hd, "f32")
        ref = A.np_attention_backward(q, k, v, g)
        naive = ops.attention_backward(q, k, v, g, method="naive", backend="host")
        flash = ops.attention_backward(q, k, v, g, method="flash", backend="host")
        for n, a, b, r in zip(("dq", "dk", "dv"), naive, flash, ref):
            assert compare(n, a, r, atol, rtol).ok
            assert compare(n, b, r, atol, rtol).ok
            assert compare(n, a, b, atol, rtol).ok  # each other, not only the reference


def test_deterministic_kernels_are_bitwise_stable_across_schedules(monkeypatch: pytest.MonkeyPatch) -> None:
    """No float atomics in rms_norm grad_weight, embedding_backward, cross-entropy or flash backward."""
    _need("host")
    rng = np.random.default_rng(8)
    x = rng.standard_normal((83, 769)).astype(np.float32)
    w = rng.standard_normal(769).astype(np.float32)
    g = rng.standard_normal((83, 769)).astype(np.float32)
    ids = rng.integers(0, 5, size=83)
    logits = rng.standard_normal((6, 300)).astype(np.float32)
    tgt = rng.integers(0, 300, size=6)
    tgt[1] = -100
    q, k, v, go = A.attention_inputs(rng, None, 40, 2, 1, 32, "f32")
    runs = []
    for schedule in ("forward", "reverse", "random:5"):
        monkeypatch.setenv("PYKERN_HOST_SCHEDULE", schedule)
        runs.append(
            [ops.rms_norm_backward(x, w, g, backend="host")[1], ops.embedding_backward(g, ids, 5, backend="host")]
            + list(ops.cross_entropy_fwd_bwd(logits, tgt, -100, backend="host"))
            + list(ops.attention_backward(q, k, v, go, method="flash", backend="host"))
        )
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert np.array_equal(np.asarray(a), np.asarray(b))


# --------------------------------------------------------------------------- unaligned (scalar) paths


def _unaligned(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """A C-contiguous float32 view whose data pointer is 4 bytes past a 16-byte boundary."""
    n = int(np.prod(shape))
    buf = np.empty(n + 8, np.float32)
    off = next(o for o in range(4) if (buf.ctypes.data + 4 * o) % 16 == 4)
    view = buf[off:off + n].reshape(shape)
    view[...] = rng.standard_normal(shape)
    assert view.flags.c_contiguous and view.ctypes.data % 16
    return view


def test_row_kernels_take_the_scalar_path_on_unaligned_rows() -> None:
    _need("host")
    rng = np.random.default_rng(9)
    x, g = _unaligned(rng, (5, 16)), _unaligned(rng, (5, 16))
    w = _unaligned(rng, (16,))
    p = np.exp(x) / np.exp(x).sum(-1, keepdims=True)
    pu = _unaligned(rng, (5, 16))
    pu[...] = p
    _check({"g": ops.softmax_backward(pu, g, backend="host")}, {"g": T.np_softmax_backward(pu, g)},
           "softmax_backward", "f32")
    gx, gw = ops.rms_norm_backward(x, w, g, backend="host")
    rx, rw = T.np_rms_norm_backward(x, w, g)
    _check({"gx": gx, "gw": gw}, {"gx": rx, "gw": rw}, "rms_norm_backward", "f32")
    loss, grad = ops.cross_entropy_fwd_bwd(x, np.array([1, 2, -100, 15, 0]), -100, backend="host")
    rl, rg = T.np_cross_entropy(x, np.array([1, 2, -100, 15, 0]), -100)
    _check({"l": loss, "g": grad}, {"l": rl, "g": rg}, "cross_entropy_fwd_bwd", "f32")
    ids = np.array([3, 0, 3, 1, 3])
    _check({"e": ops.embedding_backward(g, ids, 4, backend="host")},
           {"e": T.np_embedding_backward(g, ids, 4)}, "embedding_backward", "f32")


# --------------------------------------------------------------------------- documented edges


def test_all_padding_gives_zero_loss_and_zero_gradient() -> None:
    _need("host")
    logits = np.random.default_rng(10).standard_normal((3, 50)).astype(np.float32)
    loss, grad = ops.cross_entropy_fwd_bwd(logits, np.full(3, 7), pad_id=7, backend="host")
    assert loss.shape == () and loss.dtype == np.float32 and float(loss) == 0.0
    assert grad.shape == logits.shape and not grad.any()


def test_cross_entropy_vocab_262144() -> None:
    _need("host")
    rng = np.random.default_rng(11)
    logits = (4 * rng.standard_normal((2, 262144))).astype(np.float32)
    t = np.array([262143, -100])
    loss, grad = ops.cross_entropy_fwd_bwd(logits, t, -100, backend="host")
    rl, rg = T.np_cross_entropy(logits, t, -100)
    _check({"loss": loss, "grad": grad}, {"loss": rl, "grad": rg}, "cross_entropy_fwd_bwd", "f32")


def test_output_dtypes() -> None:
    _need("host")
    rng = np.random.default_rng(13)
    x = T._cast(rng.standard_normal((3, 8)), "bf16")
    gx, gw = ops.rms_norm_backward(x, x[0], x, backend="host")
    assert gx.dtype == x.dtype and gw.dtype == np.float32 and gw.shape == (8,)
    loss, grad = ops.cross_entropy_fwd_bwd(x, np.array([1, 2, 3]), backend="host")
    assert loss.dtype == np.float32 and grad.dtype == x.dtype
    assert ops.embedding_backward(x, np.array([0, 1, 0]), 2, backend="host").dtype == np.float32
    q, k, v, g = A.attention_inputs(rng, None, 3, 2, 1, 8, "bf16")
    for method in ("naive", "flash"):
        dq, dk, dv = ops.attention_backward(q, k, v, g, method=method, backend="host")
        assert dq.dtype == dk.dtype == dv.dtype == q.dtype and dk.shape == k.shape


def test_transpose_batched_is_swapaxes() -> None:
    _need("host")
    x = np.arange(2 * 3 * 5, dtype=np.float32).reshape(2, 3, 5)
    assert np.array_equal(ops.transpose_2d(x, backend="host"), np.swapaxes(x, -1, -2))


def test_flash_attention_lse_feeds_attention_backward() -> None:
    _need("host")
    rng = np.random.default_rng(12)
    q, k, v, g = A.attention_inputs(rng, 1, 37, 4, 2, 32, "f32")
    try:
        out, lse = ops.flash_attention(q, k, v, causal=True, return_lse=True, backend="host")
    except Exception as e:  # owned by the forward family; its failure is reported there
        pytest.skip(f"flash_attention unavailable: {type(e).__name__}: {e}")
    ref = A.np_attention_backward(q, k, v, g)
    atol, rtol = tolerance("attention_backward", "f32")
    for qq, kk, vv, gg, oo, ll, r in ((q, k, v, g, out, lse, ref),
                                      (q[0], k[0], v[0], g[0], out[0], lse[0], [a[0] for a in ref])):
        got = ops.attention_backward(qq, kk, vv, gg, out=oo, lse=ll, method="flash", backend="host")
        for n, a, b in zip(("dq", "dk", "dv"), got, r):
            c = compare(n, a, b, atol, rtol)
            assert c.ok, c.detail


# --------------------------------------------------------------------------- argument checks (nothing launches)


@pytest.fixture
def no_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*a, **k):
        raise AssertionError("a bad input reached launch")

    monkeypatch.setattr("pykern.launcher.launch", boom)


def test_bad_ids_and_targets_are_rejected_before_launch(no_launch) -> None:
    g = np.zeros((3, 4), np.float32)
    with pytest.raises(ArgumentError, match=r"ids: expected values in \[0, vocab_size=5\), got 5"):
        ops.embedding_backward(g, np.array([0, 5, 1]), 5)
    with pytest.raises(ArgumentError, match="ids: .*got -1"):
        ops.embedding_backward(g, np.array([0, -1, 1]), 5)
    with pytest.raises(ArgumentTypeError, match="ids: expected an integer dtype"):
        ops.embedding_backward(g, np.array([0.0, 1.0, 1.0]), 5)
    with pytest.raises(ArgumentError, match="ids: expected shape"):
        ops.embedding_backward(g, np.array([0, 1]), 5)
    with pytest.raises(ArgumentError, match=r"targets: expected values in \[0, 4\) \(the vocab of logits\) or "
                                            r"pad_id / ignore_index=-100, got 4"):
        ops.cross_entropy_fwd_bwd(g, np.array([0, 4, -100]), -100)
    with pytest.raises(ArgumentError, match="targets: .*got -1"):
        ops.cross_entropy_fwd_bwd(g, np.array([0, -1, 2]), -100)
    with pytest.raises(ArgumentTypeError, match="logits: expected dtype"):
        ops.cross_entropy_fwd_bwd(g.astype(np.float64), np.array([0, 1, 2]), -100)


def test_bad_shapes_and_dtypes_are_rejected_before_launch(no_launch) -> None:
    x = np.zeros((3, 8), np.float32)
    with pytest.raises(ArgumentError, match="weight: expected the shape"):
        ops.rms_norm_backward(x, np.zeros(7, np.float32), x)
    with pytest.raises(ArgumentTypeError, match="grad_out: expected the dtype of x"):
        ops.rms_norm_backward(x, np.zeros(8, np.float32), x.astype(T._cast(x, "bf16").dtype))
    with pytest.raises(ArgumentError, match="grad_out: expected the shape of probs"):
        ops.softmax_backward(x, x[:2])
    with pytest.raises(ArgumentError, match="x: expected at least 2 dimensions"):
        ops.transpose_2d(np.zeros(4, np.float32))


def test_attention_arguments_are_checked_before_launch(no_launch) -> None:
    q = np.zeros((5, 4, 8), np.float32)
    k = np.zeros((5, 2, 8), np.float32)
    with pytest.raises(ArgumentError, match="n_kv_heads"):
        ops.attention_backward(q, np.zeros((5, 3, 8), np.float32), np.zeros((5, 3, 8), np.float32), q)
    with pytest.raises(ArgumentError, match="head_dim"):
        big = np.zeros((2, 1, 257), np.float32)
        ops.attention_backward(big, big, big, big)
    with pytest.raises(ArgumentError, match="method"):
        ops.attention_backward(q, k, k, q, method="fast")
    with pytest.raises(ArgumentError, match="lse: expected shape"):
        ops.attention_backward(q, k, k, q, out=q, lse=np.zeros((5, 3), np.float32))
    with pytest.raises(ArgumentTypeError, match="lse: expected dtype float32"):
        ops.attention_backward(q, k, k, q, out=q, lse=np.zeros((5, 4), np.float64))
    with pytest.raises(ArgumentError, match="v: expected the shape of k"):
        ops.attention_backward(q, k, k[:4], q)
    with pytest.raises(ArgumentError, match="method='naive' handles seq_len <= 4096, got 4097"):
        long = np.zeros((4097, 1, 1), np.float32)
        ops.attention_backward(long, long, long, long, method="naive")


# --------------------------------------------------------------------------- NVRTC resources


@pytest.mark.parametrize("arch", ["sm_80", "sm_90", "sm_120"])
def test_kernels_compile_without_spills(arch: str) -> None:
    try:
        from pykern import compiler

        if arch not in compiler.supported_archs():
            pytest.skip(f"NVRTC here does not support {arch}")
    except Exception as e:
        pytest.skip(f"NVRTC unavailable: {type(e).__name__}: {e}")
    from sass_helpers import nvrtc_module

    for src in SOURCES:  # through the run's cache: test_compiler compiles the same (source, arch)
        mod = nvrtc_module(src, arch)
        assert mod.resources, f"no resource report for {src.name}"
        spills = {k: (r.spill_stores, r.spill_loads) for k, r in mod.resources.items() if r.spill_stores or r.spill_loads}
        assert not spills, f"{src.name} {arch}: {spills}"


# --------------------------------------------------------------------------- launch bounds
def test_every_launch_fits_the_kernels_launch_bounds_and_shared_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    # A block larger than a kernel's __launch_bounds__, or more than 48 KiB of shared
    # memory without an opt-in, fails to launch on a GPU; the host backend cannot show
    # it. Record the geometry every op picks at its largest shapes and check it
    # against the bounds and static shared memory declared in the source.
    from pykern.ops import attention as ta, training as tr
    from pykern.sources import KERNELS_DIR

    from pykern.registry import parse_file

    bounds: dict[str, int] = {}
    for name in ("training.cu", "attention_bwd_fma.cu"):  # the registry also reads PK_IO_KERNELS calls
        for spec in parse_file(KERNELS_DIR / name):
            assert spec.max_threads, f"{spec.name} has no __launch_bounds__"
            bounds[spec.name] = spec.max_threads
    assert "cross_entropy_fwd_bwd_f16" in bounds
    seen: list[tuple[str, int, int]] = []

    def record(name, grid, block, *args, shared_mem=0, stream=None, backend=None):
        block = block if isinstance(block, tuple) else (block,)
        seen.append((name, int(np.prod(block)), shared_mem))

    monkeypatch.setattr(tr, "launch", record)  # training calls _common.launch by that name
    monkeypatch.setattr(ta, "_launch", record)
    from pykern.ops import _common

    monkeypatch.setattr(_common, "launch", record)  # the shared column-sum launch (sum_chunks) calls it there
    rng = np.random.default_rng(0)
    f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    tr.transpose_2d(f(3, 40, 70))
    tr.softmax_backward(f(2, 5000), f(2, 5000))
    tr.rms_norm_backward(f(70, 5000), f(5000), f(70, 5000))  # fused weight gradient
    tr.rms_norm_backward(f(70, 8200), f(8200), f(70, 8200))  # rows too long for it: the weight kernel
    tr.embedding_backward(f(3, 5000), np.array([0, 2, 2]), 3)
    tr.cross_entropy_fwd_bwd(f(600, 4096), np.zeros(600, np.int64))
    for d in (1, 64, 65, 128, 129, 256):
        q, g = f(1, 4, d), f(1, 4, d)
        ta.attention_backward(q, f(1, 1, d), f(1, 1, d), g, method="flash")
        ta.attention_backward(q, f(1, 1, d), f(1, 1, d), g, out=f(1, 4, d), lse=f(1, 4), method="flash")
        cu_q, cu_k = np.array([0, 1, 4], np.int32), np.array([0, 2, 3], np.int32)  # the float32 varlen kernels
        ta.flash_attention_varlen_backward(f(4, 2, d), f(3, 1, d), f(3, 1, d), f(4, 2, d), cu_q, cu_k,
                                           out=f(4, 2, d), lse=f(4, 2), softcap=1.0 if d == 65 else 0.0)
    s, d = ta.NAIVE_MAX_SEQ, ta.MAX_HEAD_DIM
    ta.attention_backward(f(s, 1, d), f(s, 1, d), f(s, 1, d), f(s, 1, d), method="naive")
    assert {n for n, _, _ in seen} >= {"rms_norm_backward_weight", "norm_grad_reduce",
                                       "attention_bwd_fma_naive", "attention_bwd_lse",
                                       "attention_bwd_varlen_fma_dkdv", "attention_bwd_varlen_fma_dq_softcap"}
    static = 32 * 4  # kernels with dynamic shared memory declare at most scratch[32] floats statically
    for name, threads, smem in seen:
        assert threads <= bounds[name], (name, threads, bounds[name])
        assert smem + static <= 48 * 1024, (name, smem)


def test_attention_seq_len_within_a_tile_of_uint_max_is_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    # The flash kernels step query/key tiles in unsigned int (i0 + rows_per_block,
    # j0 += 16): a seq_len within a tile of 2^32 - 1 would wrap there, so the op must
    # reject it from the shapes, before copying any input.
    from pykern.ops import attention as ta

    def no_copy(a):
        raise AssertionError("the op copied its inputs before validating their shapes")

    monkeypatch.setattr(ta.arrays, "contiguous", no_copy)
    big = np.broadcast_to(np.zeros((1, 1, 1), np.float32), (2**32 - 1, 1, 1))  # no memory behind it
    with pytest.raises(ArgumentError, match="seq_len"):
        ta.attention_backward(big, big, big, big, method="flash")


@pytest.mark.parametrize("n_chunks,dim", [(300, 4096), (300, 37), (5, 130), (129, 8)])
def test_norm_grad_reduce_is_lane_parallel_in_a_fixed_order(n_chunks: int, dim: int) -> None:
    """norm_grad_reduce sums chunk lanes k = y, y + 32, ... (ascending) and then the 32 lane sums in order, on the
    16-byte path (dim % 4 == 0) and the scalar one alike: bit-exact against that order in float32, and within
    float32 rounding of the float64 sum."""
    from pykern.ops._common import sum_chunks

    rng = np.random.default_rng(n_chunks * 7919 + dim)
    part = rng.standard_normal((n_chunks, dim)).astype(np.float32)
    out = np.full(dim, np.nan, np.float32)
    sum_chunks(part.reshape(-1), out, n_chunks, dim, stream=None, backend="host")
    lanes = np.zeros((32, dim), np.float32)
    for k in range(n_chunks):
        lanes[k % 32] += part[k]
    want = lanes[0].copy()
    for lane in lanes[1:]:
        want += lane
    np.testing.assert_array_equal(out, want)
    np.testing.assert_allclose(out, part.astype(np.float64).sum(0), rtol=1e-5, atol=1e-4)


def test_rms_norm_backward_fused_geometry_is_one_wave() -> None:
    """Fused rms_norm_backward: threads for RMSB_ACC columns each (2 16-byte chunks of bf16, 4 of f32), blocks
    at most one wave of a 132-SM GPU (512 threads' worth an SM) and at most 512 partial rows; rows longer than
    16 x 512 columns take the weight kernel."""
    from pathlib import Path

    from pykern.ops.training import _RMS_BWD_ACC, rms_backward_geometry

    assert rms_backward_geometry(8192, 4096) == (264, 256)
    assert rms_backward_geometry(8192, 8192) == (132, 512)
    assert rms_backward_geometry(8192, 1024) == (512, 64)
    assert rms_backward_geometry(7, 64) == (7, 32)
    assert rms_backward_geometry(8192, 8200)[0] == 0
    cu = (Path(__file__).resolve().parents[1] / "kernels_cu" / "training.cu").read_text()
    assert f"#define RMSB_ACC {_RMS_BWD_ACC}\n" in cu


@pytest.mark.parametrize("row_len, kind, threads", [(2048, "bf16", 128), (2048, "f16", 128), (2048, "f32", 256),
                                                    (8192, "bf16", 512), (1000, "f32", 128), (8, "bf16", 32),
                                                    (16384, "bf16", 512), (4100, "f32", 512), (7, "f32", 32)])
def test_softmax_backward_gives_a_thread_two_chunks_of_a_cached_row(row_len: int, kind: str, threads: int) -> None:
    """Rows the kernel keeps in registers (<= 2 16-byte chunks a thread of 512) get 2 chunks a thread: its 4 loads
    in flight at once; longer or unvectorizable rows keep row_threads (4 elements a thread, at most 512).
    add_rms_norm takes the same geometry (ops._common.cached_row_threads)."""
    from pykern.ops._common import cached_row_threads
    from pykern.ops.training import _softmax_backward_threads

    assert _softmax_backward_threads(row_len, kind) == threads
    assert cached_row_threads(row_len, kind, 2) == threads
