"""Every op in pykern.ops on torch CPU tensors equals the NumPy path, bit for bit (the same kernel
runs on a zero-copy view), for f32 and bf16, contiguous, strided and requires_grad inputs; outputs
are tensors. Plus the pieces of the general mechanism: kinds, names in errors, out=, stream=."""
from __future__ import annotations

import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from pykern import arrays, ops  # noqa: E402
from pykern.errors import ArgumentError, ArgumentTypeError  # noqa: E402
from pykern.tolerance import tolerance  # noqa: E402

BF16 = np.dtype(ml_dtypes.bfloat16)
RNG = np.random.default_rng(1234)


def _f(shape, dtype, scale=1.0):
    return (RNG.standard_normal(shape) * scale).astype(np.float32).astype(dtype)


def to_torch(a: np.ndarray) -> "torch.Tensor":
    if a.dtype == BF16:
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(a.copy())


def strided(t: "torch.Tensor") -> "torch.Tensor":
    """Same values, non-contiguous memory (every other element of a wider buffer)."""
    wide = torch.stack([t, torch.zeros_like(t)], dim=-1)
    s = wide[..., 0]
    assert t.numel() <= 1 or not s.is_contiguous()
    return s


def variant(a: np.ndarray, how: str) -> "torch.Tensor":
    t = to_torch(a)
    if how in ("strided", "strided_grad"):
        t = strided(t)
    if how in ("grad", "strided_grad") and t.dtype.is_floating_point:
        t = t.requires_grad_()
    return t


def as_np(x):
    if isinstance(x, (tuple, list)):
        return [as_np(y) for y in x]
    assert isinstance(x, torch.Tensor), type(x)
    return arrays.host_view(x)


def kinds(x):
    return [type(y) for y in x] if isinstance(x, (tuple, list)) else [type(x)]


def _cases(dt):
    """(op name, callable, numpy args, indices of args that are float data)."""
    f = lambda *s, **kw: _f(s, dt, **kw)  # noqa: E731
    half = 4
    pos = np.arange(8)[:, None] * (1.0 / 10000 ** (np.arange(half) / half))[None, :]
    cos, sin = np.cos(pos).astype(np.float32), np.sin(pos).astype(np.float32)
    ids = RNG.integers(0, 11, size=(2, 3)).astype(np.int64)
    targets = RNG.integers(0, 13, size=(2, 3)).astype(np.int64)
    targets[0, 1] = -100
    seq_lens = np.array([5, 0, 9], np.uint32)
    probs = np.abs(_f((3, 10), np.float32)) + 0.1
    probs = (probs / probs.sum(-1, keepdims=True)).astype(dt)
    return [
        ("embedding", lambda i, t: ops.embedding(i, t), [ids, f(11, 6)], [1]),
        ("rope", lambda x, c, s: ops.rope(x, c, s, pos_offset=1, style="half"), [f(5, 2, 8), cos, sin], [0]),
        ("silu_gate", lambda g, u: ops.silu_gate(g, u), [f(3, 7), f(3, 7)], [0, 1]),
        ("rms_norm", lambda x, w: ops.rms_norm(x, w, 1e-5), [f(3, 40), f(40)], [0, 1]),
        ("flash_attention", lambda q, k, v: ops.flash_attention(q, k, v, causal=True, return_lse=True),
         [f(1, 5, 4, 16), f(1, 6, 2, 16), f(1, 6, 2, 16)], [0, 1, 2]),
        ("decode_attention", lambda q, k, v: ops.decode_attention(q, k, v, 7, kv_layout="HND"),
         [f(4, 16), f(2, 12, 16), f(2, 12, 16)], [0, 1, 2]),
        ("batched_decode_attention", lambda q, k, v, s: ops.batched_decode_attention(q, k, v, s, kv_layout="HND"),
         [f(3, 4, 16), f(3, 2, 12, 16), f(3, 2, 12, 16), seq_lens], [0, 1, 2]),
        ("batched_decode_split_k", lambda q, k, v, s: ops.batched_decode_attention(q, k, v, s, method="split_k",
                                                                                   chunk_size=4, kv_layout="HND"),
         [f(3, 4, 16), f(3, 2, 12, 16), f(3, 2, 12, 16), seq_lens], [0, 1, 2]),
        ("transpose_2d", lambda x: ops.transpose_2d(x), [f(2, 5, 33)], [0]),
        ("softmax_backward", lambda p, g: ops.softmax_backward(p, g), [probs, f(3, 10)], [0, 1]),
        ("rms_norm_backward", lambda x, w, g: ops.rms_norm_backward(x, w, g, 1e-5),
         [f(70, 9), f(9), f(70, 9)], [0, 1, 2]),
        ("embedding_backward", lambda g, i: ops.embedding_backward(g, i, 11), [f(2, 3, 5), ids], [0]),
        ("cross_entropy_fwd_bwd", lambda x, t: ops.cross_entropy_fwd_bwd(x, t), [f(2, 3, 13), targets], [0]),
        ("attention_backward", lambda q, k, v, g: ops.attention_backward(q, k, v, g),
         [f(5, 4, 16), f(5, 2, 16), f(5, 2, 16), f(5, 4, 16)], [0, 1, 2, 3]),
    ]


def _f32_only(name):
    return name in ("causal_attn_softmax",)


OPS = [c[0] for c in _cases(np.float32)]


def test_every_op_is_covered():
    public = set(dir(ops)) - {"decode_plan"}
    covered = set(OPS) | {"causal_attn_softmax"}
    # Ops other helpers add test their own tensor paths; these are the ones this file owns.
    mine = {"embedding", "rope", "silu_gate", "rms_norm", "causal_attn_softmax", "flash_attention",
            "decode_attention", "batched_decode_attention", "transpose_2d", "softmax_backward",
            "rms_norm_backward", "embedding_backward", "cross_entropy_fwd_bwd", "attention_backward"}
    assert mine <= public and mine <= covered


@pytest.mark.parametrize("how", ["plain", "strided", "grad", "strided_grad"])
@pytest.mark.parametrize("dt", ["f32", "bf16"])
@pytest.mark.parametrize("op", OPS)
def test_torch_cpu_equals_numpy(op, dt, how):
    dtype = np.float32 if dt == "f32" else BF16
    name, fn, args, float_idx = next(c for c in _cases(dtype) if c[0] == op)
    ref = fn(*args)
    targs = [variant(a, how) if (i in float_idx or how != "plain") else to_torch(a) for i, a in enumerate(args)]
    snapshot = [t.detach().clone() for t in targs]
    got = fn(*targs)
    assert all(k is torch.Tensor for k in kinds(got)), kinds(got)
    for g in (got if isinstance(got, (tuple, list)) else [got]):
        assert g.device.type == "cpu" and not g.requires_grad
    r, g = (ref, as_np(got)) if isinstance(ref, (tuple, list)) else ([ref], [as_np(got)])
    assert len(r) == len(g)
    for a, b in zip(r, g):
        assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
        np.testing.assert_array_equal(a.view(np.uint16) if a.dtype == BF16 else a,
                                      b.view(np.uint16) if b.dtype == BF16 else b)
    for t, s in zip(targs, snapshot):  # inputs are read, never written
        assert torch.equal(t.detach(), s)


def test_causal_attn_softmax_torch():
    s = _f((3, 2, 6), np.float32)
    for how in ("plain", "strided", "grad"):
        got = ops.causal_attn_softmax(variant(s, how), 2)
        np.testing.assert_array_equal(got.numpy(), ops.causal_attn_softmax(s, 2))


def test_int32_ids_and_targets():
    table = _f((11, 6), np.float32)
    ids = RNG.integers(0, 11, size=(2, 3))
    ref = ops.embedding(ids.astype(np.int64), table)
    got = ops.embedding(torch.from_numpy(ids.astype(np.int32)), torch.from_numpy(table))
    np.testing.assert_array_equal(got.numpy(), ref)
    np.testing.assert_array_equal(
        ops.embedding_backward(torch.from_numpy(_f((2, 3, 4), np.float32)), torch.from_numpy(ids.astype(np.int32)),
                               11).numpy().shape, (11, 4))


def test_inplace_rope_on_a_tensor_writes_it():
    x = _f((3, 2, 8), np.float32)
    pos = np.arange(4)[:, None] * np.ones(4)[None, :]
    cos, sin = np.cos(pos).astype(np.float32), np.sin(pos).astype(np.float32)
    t = torch.from_numpy(x.copy())
    r = ops.rope(t, torch.from_numpy(cos), torch.from_numpy(sin), inplace=True)
    assert r is t
    np.testing.assert_array_equal(t.numpy(), ops.rope(x, cos, sin))


class _DLPackOnly:
    """A host array seen only through DLPack (as a JAX or other library array would be)."""

    def __init__(self, a: np.ndarray) -> None:
        self._a = a

    def __dlpack__(self, **kw):
        return self._a.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self._a.__dlpack_device__()


def test_dlpack_inputs_give_numpy_outputs():
    x, w = _f((3, 8), np.float32), _f((8,), np.float32)
    got = ops.rms_norm(_DLPackOnly(x), _DLPackOnly(w))
    assert isinstance(got, np.ndarray)
    np.testing.assert_array_equal(got, ops.rms_norm(x, w))
    ids = np.array([1, 0, 2])
    np.testing.assert_array_equal(ops.embedding(_DLPackOnly(ids), _DLPackOnly(x)), x[ids])


def test_not_an_array_is_named():
    w = torch.ones(4)
    with pytest.raises(ArgumentTypeError, match=r"^x: expected an array .* got list"):
        ops.rms_norm([1.0, 2.0, 3.0, 4.0], w)
    with pytest.raises(ArgumentTypeError, match=r"^weight: expected an array .* got str"):
        ops.rms_norm(w, "w")
    with pytest.raises(ArgumentTypeError, match=r"^q: expected an array .* got dict"):
        ops.flash_attention({}, w, w)


def test_float16_tensor_runs_the_f16_kernel_and_other_dtypes_are_rejected_by_name():
    x = torch.randn(3, 40, dtype=torch.float64).to(torch.float16)
    w = (1 + 0.3 * torch.randn(40, dtype=torch.float64)).to(torch.float16)
    out = ops.rms_norm(x, w)
    assert out.dtype == torch.float16
    xd, wd = x.double(), w.double()
    ref = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6) * wd
    atol, rtol = tolerance("rms_norm", "f16")
    assert ((out.double() - ref).abs() <= atol + rtol * ref.abs()).all()
    with pytest.raises(ArgumentTypeError, match=r"x: expected dtype float32 or bfloat16 or float16, got float64"):
        ops.rms_norm(x.double(), w.double())
    with pytest.raises(ArgumentTypeError, match=r"weight: expected the dtype of x \(f16\), got bf16"):
        ops.rms_norm(x, w.bfloat16())


def test_launch_takes_tensors_directly():
    import pykern

    x = torch.arange(8, dtype=torch.float32)
    out = torch.empty(8)
    pykern.launch("silu_gate", 1, 32, x, torch.ones(8, requires_grad=True), out, 8)
    np.testing.assert_array_equal(out.numpy(), ops.silu_gate(x.numpy(), np.ones(8, np.float32)))
    with pytest.raises(ArgumentError, match=r"contiguous tensor"):
        pykern.launch("silu_gate", 1, 32, strided(x), x, out, 8)
    with pytest.raises(ArgumentTypeError, match=r"float32 tensor, got dtype torch.float64"):
        pykern.launch("silu_gate", 1, 32, x.double(), x, out, 8)
    with pytest.raises(ArgumentTypeError, match=r"argument 0 .*expected a CPU or CUDA tensor, got one on meta"):
        pykern.launch("silu_gate", 1, 32, x.to("meta"), x, out, 8)


# --------------------------------------------------------------------------- out=


def _out_cases():
    x = _f((3, 8), np.float32)
    pos = np.arange(4)[:, None] * np.ones(2)[None, :]
    cos, sin = np.cos(pos).astype(np.float32), np.sin(pos).astype(np.float32)
    q, k, v = _f((1, 3, 2, 8), np.float32), _f((1, 3, 1, 8), np.float32), _f((1, 3, 1, 8), np.float32)
    dq, kc, vc = _f((2, 8), np.float32), _f((1, 5, 8), np.float32), _f((1, 5, 8), np.float32)
    bq, bk, bv = _f((2, 2, 8), np.float32), _f((2, 1, 5, 8), np.float32), _f((2, 1, 5, 8), np.float32)
    lens = np.array([3, 5], np.uint32)
    return [
        ("rms_norm", lambda o, **kw: ops.rms_norm(x, x[0], out=o, **kw), (3, 8)),
        ("rope", lambda o, **kw: ops.rope(x.reshape(2, 3, 4)[:, :1].copy(), cos, sin, out=o, **kw), (2, 1, 4)),
        ("silu_gate", lambda o, **kw: ops.silu_gate(x, x, out=o, **kw), (3, 8)),
        ("embedding", lambda o, **kw: ops.embedding(np.array([2, 0]), x, out=o, **kw), (2, 8)),
        ("flash_attention", lambda o, **kw: ops.flash_attention(q, k, v, out=o, **kw), (1, 3, 2, 8)),
        ("decode_attention", lambda o, **kw: ops.decode_attention(dq, kc, vc, 4, kv_layout="HND", out=o, **kw), (2, 8)),
        ("batched_decode_attention", lambda o, **kw: ops.batched_decode_attention(bq, bk, bv, lens, kv_layout="HND",
                                                                                  out=o,
                                                                                       **kw),
         (2, 2, 8)),
    ]


@pytest.mark.parametrize("case", _out_cases(), ids=lambda c: c[0])
def test_out_is_written_and_returned(case):
    name, fn, shape = case
    ref = fn(None)
    out = np.full(shape, np.nan, np.float32)
    got = fn(out)
    assert got is out
    np.testing.assert_array_equal(out, ref)
    with pytest.raises(ArgumentError, match=r"^out: expected shape"):
        fn(np.empty(shape + (1,), np.float32))
    with pytest.raises(ArgumentTypeError, match=r"^out: expected dtype float32, got float64"):
        fn(np.empty(shape, np.float64))
    with pytest.raises(ArgumentTypeError, match=r"^out: expected a ndarray"):
        fn(torch.empty(shape))
    with pytest.raises(ArgumentError, match=r"^out: expected a C-contiguous"):
        fn(np.empty(shape[::-1], np.float32).T)


def test_out_tensor_for_tensor_inputs():
    x = torch.from_numpy(_f((3, 8), np.float32))
    out = torch.empty(3, 8)
    assert ops.rms_norm(x, x[0], out=out) is out
    np.testing.assert_array_equal(out.numpy(), ops.rms_norm(x.numpy(), x[0].numpy()))
    with pytest.raises(ArgumentTypeError, match=r"^out: expected a Tensor"):
        ops.rms_norm(x, x[0], out=np.empty((3, 8), np.float32))
    with pytest.raises(ArgumentError, match=r"^out: expected a contiguous tensor"):
        ops.rms_norm(x, x[0], out=torch.empty(8, 3).t())


# --------------------------------------------------------------------------- item 7 consistency


def test_embedding_batch_seq_ids():
    table = _f((9, 4), np.float32)
    ids = np.array([[1, 8, 0], [3, 3, 2]])
    got = ops.embedding(ids, table)
    assert got.shape == (2, 3, 4)
    np.testing.assert_array_equal(got, table[ids])
    with pytest.raises(ArgumentError, match=r"ids: expected every id in \[0, 9\) \(the rows of table\), got 9"):
        ops.embedding(np.array([[1, 9]]), table)
    with pytest.raises(ArgumentError,
                       match=r"ids: expected a 1-D array \(n,\) or a 2-D array \(batch, seq_len\), got shape \(1, 1, 1\)"):
        ops.embedding(np.zeros((1, 1, 1), np.int64), table)


@pytest.mark.parametrize("kw, match", [
    (dict(batch=0), r"batch: expected 1 <= batch <= 65535, got 0"),
    (dict(num_kv_heads=0), r"num_kv_heads: expected 1 <= num_kv_heads"),
    (dict(num_heads=0), r"num_heads: expected 1 <= num_heads"),
    (dict(num_kv_heads=3), r"num_kv_heads: expected a divisor of num_heads=4"),
    (dict(head_dim=0), r"head_dim: expected 1 <= head_dim <= 256"),
    (dict(max_seq_len=0), r"max_seq_len: expected 1 <= max_seq_len"),
    (dict(seq_hint=-1), r"seq_hint: expected 0 <= seq_hint <= 64"),
])
def test_decode_plan_validates(kw, match):
    args = dict(batch=2, num_heads=4, num_kv_heads=2, head_dim=16, max_seq_len=64)
    args.update(kw)
    with pytest.raises(ArgumentError, match=match):
        ops.decode_plan(**args)


def test_decode_plan_never_plans_an_empty_grid():
    for method in ("warp", "multi_warp", "split_k", "auto"):
        plan = ops.decode_plan(1, 1, 1, 1, 1, method=method, seq_hint=0)
        for _, grid, block, _ in plan["launches"]:
            assert min(grid) >= 1 and min(block) >= 1


def test_batched_decode_with_no_sequence():
    q, k = np.zeros((0, 4, 16), np.float32), np.zeros((0, 2, 8, 16), np.float32)
    got = ops.batched_decode_attention(q, k, k, np.zeros(0, np.uint32), kv_layout="HND")
    assert got.shape == (0, 4, 16) and got.dtype == np.float32
    got = ops.batched_decode_attention(torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(k), [],
                                       kv_layout="HND")
    assert isinstance(got, torch.Tensor) and got.shape == (0, 4, 16)


@pytest.mark.parametrize("dtype", [np.int8, np.uint8, np.int16, np.int32, np.int64, np.uint64])
def test_seq_lens_any_integer_dtype(dtype):
    q, k, v = _f((2, 4, 16), np.float32), _f((2, 2, 8, 16), np.float32), _f((2, 2, 8, 16), np.float32)
    ref = ops.batched_decode_attention(q, k, v, np.array([3, 8], np.uint32), kv_layout="HND")
    np.testing.assert_array_equal(ops.batched_decode_attention(q, k, v, np.array([3, 8], dtype), kv_layout="HND"), ref)
    tq, tk, tv = map(torch.from_numpy, (q, k, v))
    if dtype != np.uint64 or hasattr(torch, "uint64"):
        lens = torch.from_numpy(np.array([3, 8], dtype))
        np.testing.assert_array_equal(ops.batched_decode_attention(tq, tk, tv, lens, kv_layout="HND").numpy(), ref)
    np.testing.assert_array_equal(ops.decode_attention(q[0], k[0], v[0], np.array([3], dtype), kv_layout="HND"), ref[0])


def test_seq_lens_out_of_range_named():
    q, k = _f((2, 4, 16), np.float32), _f((2, 2, 8, 16), np.float32)
    with pytest.raises(ArgumentError, match=r"seq_lens: expected every length in \[0, max_seq_len=8\], got -1"):
        ops.batched_decode_attention(q, k, k, np.array([-1, 2], np.int32), kv_layout="HND")
    with pytest.raises(ArgumentError, match=r"seq_lens: expected every length in \[0, max_seq_len=8\], got 9"):
        ops.batched_decode_attention(q, k, k, np.array([9, 2], np.int64), kv_layout="HND")
    with pytest.raises(ArgumentTypeError, match=r"seq_lens: expected an integer array, got dtype float32"):
        ops.batched_decode_attention(q, k, k, np.array([1, 2], np.float32), kv_layout="HND")


# --------------------------------------------------------------------------- imports


def test_import_pykern_ops_does_not_import_torch():
    code = (
        "import sys, numpy as np\n"
        "import pykern, pykern.ops, pykern.arrays, pykern.launcher\n"
        "dir(pykern.ops)\n"
        "pykern.ops.rms_norm(np.ones((2, 4), np.float32), np.ones(4, np.float32), backend='host')\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "print('ok')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


# --------------------------------------------------------------------------- GPU only (skip here)

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
from gpu import requires_gpu  # noqa: E402

needs_torch_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA build of torch and a GPU")


def _cuda(a: np.ndarray, grad: bool = False) -> "torch.Tensor":
    t = to_torch(a).cuda()
    return t.requires_grad_() if grad and t.dtype.is_floating_point else t


@requires_gpu
@needs_torch_cuda
@pytest.mark.parametrize("dt", ["f32", "bf16"])
@pytest.mark.parametrize("op", OPS)
def test_torch_cuda_on_a_side_stream_equals_numpy(op, dt):
    """Every op on CUDA tensors (strided, requires_grad) inside `torch.cuda.stream(side)`: the same
    bits as the NumPy path, outputs are CUDA tensors, and the work ran on the side stream (the
    default stream is busy with a long matmul chain that must not be waited for)."""
    dtype = np.float32 if dt == "f32" else BF16
    _, fn, args, float_idx = next(c for c in _cases(dtype) if c[0] == op)
    ref = fn(*args)
    side = torch.cuda.Stream()
    big = torch.randn(2048, 2048, device="cuda")
    with torch.cuda.stream(side):
        targs = [strided(_cuda(a, i in float_idx)) if i in float_idx else _cuda(a) for i, a in enumerate(args)]
        got = fn(*targs)
    for _ in range(20):  # keeps the default stream busy meanwhile
        big = big @ big / 2048
    side.synchronize()
    torch.cuda.synchronize()
    got = got if isinstance(got, (tuple, list)) else [got]
    ref = ref if isinstance(ref, (tuple, list)) else [ref]
    for a, g in zip(ref, got):
        assert g.is_cuda
        b = arrays.host_view(g.cpu())
        np.testing.assert_array_equal(a.view(np.uint16) if a.dtype == BF16 else a,
                                      b.view(np.uint16) if b.dtype == BF16 else b)


@requires_gpu
@needs_torch_cuda
@pytest.mark.parametrize("method", ["warp", "multi_warp", "split_k"])
def test_cuda_graph_capture_and_replay_of_a_decode_step(method):
    """A decode step (RMSNorm + batched decode attention with device seq_lens) captured in a CUDA
    graph: replays follow new inputs written in place, and match the NumPy path."""
    r = np.random.default_rng(5)
    M, H, KVH, D, S = 3, 8, 2, 64, 600
    q0 = r.standard_normal((M, H, D)).astype(np.float32)
    w = r.standard_normal(D).astype(np.float32)
    kc = r.standard_normal((M, KVH, S, D)).astype(np.float32)
    vc = r.standard_normal((M, KVH, S, D)).astype(np.float32)
    lens0 = np.array([1, 300, 600], np.int64)
    q, wt, k, v, lens = (torch.from_numpy(a).cuda() for a in (q0, w, kc, vc, lens0))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm up: compile/load the kernels outside the capture
        ops.batched_decode_attention(ops.rms_norm(q, wt), k, v, lens, method=method, kv_layout="HND")
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = ops.batched_decode_attention(ops.rms_norm(q, wt), k, v, lens, method=method, kv_layout="HND")
    for step in range(3):
        qn = r.standard_normal((M, H, D)).astype(np.float32)
        ln = np.array([1 + step, 299 - step, 600 - 7 * step], np.int64)
        q.copy_(torch.from_numpy(qn))
        lens.copy_(torch.from_numpy(ln))
        g.replay()
        torch.cuda.synchronize()
        want = ops.batched_decode_attention(ops.rms_norm(qn, w), kc, vc, ln.astype(np.uint32), method=method,
                                            kv_layout="HND")
        np.testing.assert_array_equal(out.cpu().numpy(), want)


@requires_gpu
@needs_torch_cuda
@pytest.mark.parametrize("pdl", [False, True])
def test_cuda_graph_capture_of_a_paged_decode_step_with_sampling(pdl):
    """A serving step captured in one CUDA graph: per layer, append_paged_kv_cache and PagedDecodePlan.run on the
    tensor-core kernel (bf16, GQA 4, 4 KV splits: its tickets must come back to zero for the replays), then
    top_k_top_p_sampling_from_logits with seed / offset as (batch,) device arrays into preallocated tokens / valid
    (tools/measure_gpu.py's DecodeStep, the step tests/test_capture_step.py audits on the CPU). Replays with new
    queries, K / V and logits written in place and the offset advanced give what eager steps on the same inputs give,
    bit for bit; the tokens change with the offset. With pdl, the append and decode kernels launch with programmatic
    dependent launch (an ordinary launch before sm_90)."""
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent.parent / "tools"))
    from measure_gpu import DecodeStep, capture_decode_step

    st = DecodeStep(2, 3, 128, heads=8, kv_heads=2, vocab=4096, num_splits=4, pdl=pdl)
    assert st.plan.tensor_cores and st.plan.num_splits == 4
    _, check = capture_decode_step(st)
    assert check == {"replays_identical": [True] * 3, "offsets_draw_differently": True, "counters_zero": True}


def test_cpu_tensors_are_viewed_not_copied():
    for t in (torch.randn(3, 5), torch.randn(3, 5).bfloat16(), torch.arange(4), torch.randn(4, requires_grad=True)):
        v = arrays.host_view(t)
        assert v.ctypes.data == t.data_ptr() and v.shape == tuple(t.shape)
    b = torch.randn(6).bfloat16()
    assert arrays.host_view(b).dtype == BF16
    np.testing.assert_array_equal(arrays.host_view(b).astype(np.float32), b.float().numpy())


def test_numba_backend_takes_cpu_tensors():
    g, u = _f((2, 9), np.float32), _f((2, 9), np.float32)
    got = ops.silu_gate(torch.from_numpy(g), strided(torch.from_numpy(u)), backend="numba")
    assert isinstance(got, torch.Tensor)
    np.testing.assert_array_equal(got.numpy(), ops.silu_gate(g, u, backend="numba"))
