"""pykern.torch.flash_attention_varlen (flash-attn's flash_attn_varlen_func) on CPU tensors (the host backend):
forward and gradients against per-sequence dense attention under torch autograd in float64, the lse layout,
argument errors before any launch, and torch.compile(fullgraph=True) through forward and backward."""
from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

import pykern.torch as pt  # noqa: E402
from pykern.errors import ArgumentError, ArgumentTypeError  # noqa: E402
from pykern.tolerance import tolerance  # noqa: E402

from launch_spy import record_launches  # noqa: E402


def _close(got, ref, op: str, dtype: str) -> None:
    atol, rtol = tolerance(op, dtype)
    got, ref = got.detach().double(), ref.detach().double()
    assert got.shape == ref.shape, (got.shape, ref.shape)
    err = (got - ref).abs()
    bound = atol + rtol * ref.abs()
    assert bool(torch.isfinite(got).all()), f"{op}: non-finite"
    assert bool((err <= bound).all()), f"{op}/{dtype}: max err {err.max().item():.3g}, excess {(err - bound).max():.3g}"


def _dense_f64(q, k, v, causal: bool, window: tuple[int, int], softcap: float, scale: float):
    """(out, lse) of one sequence in float64 with torch ops (differentiable): bottom-right causal / window mask,
    GQA by repeating the kv heads, softcap c * tanh(x / c); a row that sees no key gives out 0, lse -inf."""
    n_q, h, _ = q.shape
    n_k, kvh, _ = k.shape
    kk, vv = k.repeat_interleave(h // kvh, dim=1), v.repeat_interleave(h // kvh, dim=1)
    s = torch.einsum("qhd,khd->hqk", q, kk) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    left, right = window
    if causal:
        right = 0
    rel = torch.arange(n_k)[None, :] - (torch.arange(n_q)[:, None] + (n_k - n_q))
    vis = torch.ones(n_q, n_k, dtype=torch.bool)
    if left >= 0:
        vis &= rel >= -left
    if right >= 0:
        vis &= rel <= right
    s = s.masked_fill(~vis, -math.inf)
    m = s.amax(-1, keepdim=True).detach() if n_k else torch.zeros(h, n_q, 1, dtype=s.dtype)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(s - m) * vis
    den = e.sum(-1, keepdim=True)
    p = e / torch.where(den > 0, den, torch.ones_like(den))
    out = torch.einsum("hqk,khd->qhd", p, vv)
    lse = torch.where(den[..., 0] > 0, torch.log(den[..., 0]) + m[..., 0], torch.full_like(den[..., 0], -math.inf))
    return out, lse.t()


def _ref(q, k, v, cq, ck, causal, window, softcap, scale):
    outs, lses = [], []
    for b in range(len(cq) - 1):
        o, l_ = _dense_f64(q[cq[b]:cq[b + 1]], k[ck[b]:ck[b + 1]], v[ck[b]:ck[b + 1]], causal, window, softcap, scale)
        outs.append(o)
        lses.append(l_)
    return torch.cat(outs), torch.cat(lses)


def _cu(lengths) -> torch.Tensor:
    return torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32)


CONFIGS = [
    # (dtype, query lengths, key lengths, heads, kv_heads, head_dim, causal, window_size, softcap)
    (torch.bfloat16, [5, 0, 1, 70], [9, 3, 1, 66], 4, 2, 64, True, (-1, -1), 0.0),
    (torch.float16, [20, 33], [40, 17], 2, 1, 128, True, (10, -1), 2.0),
    (torch.bfloat16, [12, 7, 1], [12, 7, 1], 4, 4, 96, False, (3, 3), 0.0),
    (torch.float16, [9, 30], [25, 30], 2, 1, 256, True, (-1, -1), 0.0),
    # float32: the fp32-FMA varlen backward (an empty sequence and one with keys but no query among them)
    (torch.float32, [6, 0, 17, 3], [6, 4, 20, 0], 4, 2, 64, True, (-1, -1), 0.0),
    (torch.float32, [11, 5], [9, 5], 2, 2, 80, False, (4, 2), 3.0),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{str(c[0])[6:]}-d{c[5]}-{'causal' if c[6] else 'full'}")
def test_forward_and_grads_match_per_sequence_dense_f64(cfg) -> None:
    dtype, lq, lk, h, kvh, d, causal, window, cap = cfg
    kind = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}[dtype]
    g = torch.Generator().manual_seed(3)
    cq, ck = _cu(lq), _cu(lk)
    q = torch.randn(int(cq[-1]), h, d, generator=g).to(dtype).requires_grad_()
    k = torch.randn(int(ck[-1]), kvh, d, generator=g).to(dtype).requires_grad_()
    v = torch.randn(int(ck[-1]), kvh, d, generator=g).to(dtype).requires_grad_()
    up = torch.randn(int(cq[-1]), h, d, generator=g)
    out = pt.flash_attention_varlen(q, k, v, cq, ck, max(lq), max(lk), causal=causal, window_size=window,
                                    softcap=cap)
    dq, dk, dv = torch.autograd.grad((out.float() * up).sum(), (q, k, v))

    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, _ = _ref(q64, k64, v64, cq.tolist(), ck.tolist(), causal, window, cap, 1.0 / math.sqrt(d))
    rq, rk, rv = torch.autograd.grad((ref * up.double()).sum(), (q64, k64, v64))
    _close(out, ref, "flash_attention_varlen", kind)
    for name, got, want in (("dq", dq, rq), ("dk", dk, rk), ("dv", dv, rv)):
        assert got.dtype == dtype, name
        _close(got, want, "flash_attention_varlen_backward", kind)


def test_return_lse_in_flash_attn_layout_and_scale() -> None:
    g = torch.Generator().manual_seed(4)
    lq, lk = [3, 0, 8], [5, 2, 8]
    cq, ck = _cu(lq), _cu(lk)
    q = torch.randn(11, 2, 64, generator=g).bfloat16().requires_grad_()
    k, v = (torch.randn(15, 1, 64, generator=g).bfloat16().requires_grad_() for _ in range(2))
    out, lse = pt.flash_attention_varlen(q, k, v, cq, ck, 8, 8, softmax_scale=0.3, causal=True, return_lse=True)
    assert lse.shape == (2, 11) and lse.dtype == torch.float32 and not lse.requires_grad
    ref_out, ref_lse = _ref(*(t.detach().double() for t in (q, k, v)), cq.tolist(), ck.tolist(), True, (-1, -1),
                            0.0, 0.3)
    _close(out, ref_out, "flash_attention_varlen", "bf16")
    # lse stays fp32-accurate: within the f32 attention bound of float64 (rows that see no key: -inf)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse.t()))
    fin = torch.isfinite(ref_lse.t())
    assert float((lse[fin].double() - ref_lse.t()[fin]).abs().max()) < 1e-3
    out.sum().backward()  # the lse output does not block the backward
    assert q.grad is not None and k.grad.shape == k.shape


def _args(**change):
    g = torch.Generator().manual_seed(5)
    kw = dict(q=torch.randn(7, 2, 64, generator=g).bfloat16(), k=torch.randn(7, 1, 64, generator=g).bfloat16(),
              v=torch.randn(7, 1, 64, generator=g).bfloat16(), cu_seqlens_q=_cu([3, 4]), cu_seqlens_k=_cu([5, 2]),
              max_seqlen_q=4, max_seqlen_k=5)
    kw.update(change)
    return kw


@pytest.mark.parametrize("change,exc,match", [
    (dict(dropout_p=0.1), ArgumentError, "dropout_p: expected 0.0"),
    (dict(cu_seqlens_q=_cu([3, 4]).long()), ArgumentTypeError, "cu_seqlens_q: expected an int32 array"),
    (dict(cu_seqlens_k=torch.tensor([0, 5, 6], dtype=torch.int32)), ArgumentError,
     "cu_seqlens_k: expected cu_seqlens_k.0. == 0 and cu_seqlens_k.-1. == total_k=7"),
    (dict(cu_seqlens_k=torch.tensor([0, 7], dtype=torch.int32)), ArgumentError, r"cu_seqlens_k: expected shape \(3,\)"),
    (dict(cu_seqlens_q=torch.tensor([0, 5, 4, 7], dtype=torch.int32)), ArgumentError,
     "cu_seqlens_q: expected a non-decreasing"),
    (dict(max_seqlen_k=4), ArgumentError, "max_seqlen_k: expected at least the longest sequence"),
    (dict(max_seqlen_q=4.0), ArgumentTypeError, "max_seqlen_q: expected an int"),
    (dict(q=torch.randn(7, 2, 64, dtype=torch.float64)), ArgumentTypeError,
     "q: expected dtype bfloat16 or float16 .* or float32, got torch.float64"),
])
def test_bad_arguments_raise_before_any_launch(change, exc, match, monkeypatch: pytest.MonkeyPatch) -> None:
    names = record_launches(monkeypatch)
    with pytest.raises(exc, match=match):
        pt.flash_attention_varlen(**_args(**change))
    assert names == []


@pytest.mark.parametrize("sm90", [False, True], ids=["mma_sync", "sm90a"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_192_128_forward_and_grads_match_dense_f64(dtype, sm90: bool, monkeypatch) -> None:
    """DeepSeek-V3's prefill shape (q, k head_dim 192, v 128) through autograd: out, dq, dk and dv equal float64.
    With PYKERN_HOST_ARCH=sm_90a the forward and the fused backward are the sm_90a _d192_dv128 kernels; without,
    dense_attn and the mma.sync backward run on v (and grad_out) padded with zero columns to 192."""
    kind = "bf16" if dtype == torch.bfloat16 else "f16"
    if sm90:
        monkeypatch.setenv("PYKERN_HOST_ARCH", "sm_90a")
        monkeypatch.delenv("PYKERN_HOST_SCHEDULE", raising=False)
    else:
        monkeypatch.setenv("PYKERN_HOST_ARCH", "")
    g = torch.Generator().manual_seed(6)
    lq, lk = [9, 0, 140], [30, 4, 150]
    cq, ck = _cu(lq), _cu(lk)
    q = torch.randn(int(cq[-1]), 4, 192, generator=g).to(dtype).requires_grad_()
    k = torch.randn(int(ck[-1]), 2, 192, generator=g).to(dtype).requires_grad_()
    v = torch.randn(int(ck[-1]), 2, 128, generator=g).to(dtype).requires_grad_()
    up = torch.randn(int(cq[-1]), 4, 128, generator=g)
    names = record_launches(monkeypatch)
    out = pt.flash_attention_varlen(q, k, v, cq, ck, max(lq), max(lk), causal=True, softcap=2.0)
    dq, dk, dv = torch.autograd.grad((out.float() * up).sum(), (q, k, v))
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, _ = _ref(q64, k64, v64, cq.tolist(), ck.tolist(), True, (-1, -1), 2.0, 1.0 / math.sqrt(192))
    rq, rk, rv = torch.autograd.grad((ref * up.double()).sum(), (q64, k64, v64))
    assert out.shape == (149, 4, 128) and out.dtype == dtype and dv.shape == v.shape
    _close(out, ref, "flash_attention_varlen", kind)
    for name, got, want in (("dq", dq, rq), ("dk", dk, rk), ("dv", dv, rv)):
        assert got.dtype == dtype, name
        _close(got, want, "flash_attention_varlen_backward", kind)
    sm90_names = {f"attention_fwd_varlen_sm90_d192_dv128_softcap_{kind}",
                  f"attention_bwd_varlen_sm90_fused_d192_dv128_softcap_{kind}"}
    assert (sm90_names <= set(names)) == sm90, names


def test_compiles_fullgraph_forward_and_backward() -> None:
    kw = _args()
    q, k, v = (kw.pop(n).requires_grad_() for n in ("q", "k", "v"))

    def step(q, k, v):
        return pt.flash_attention_varlen(q, k, v, **kw, causal=True).float().square().sum()

    eager = torch.autograd.grad(step(q, k, v), (q, k, v))
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    got = torch.autograd.grad(compiled(q, k, v), (q, k, v))
    for a, b in zip(eager, got):
        assert torch.equal(a, b)


def test_custom_ops_pass_opcheck() -> None:
    # schema, fake implementations (shapes / dtypes without data) and the autograd registration
    kw = _args()
    q, k, v = (kw[n].requires_grad_() for n in ("q", "k", "v"))
    cq, ck = kw["cu_seqlens_q"], kw["cu_seqlens_k"]
    torch.library.opcheck(torch.ops.pykern.flash_attention_varlen.default,
                          (q, k, v, cq, ck, 4, 5, True, 0.125, -1, -1, 0.0))
    out, lse = torch.ops.pykern.flash_attention_varlen.default(q.detach(), k.detach(), v.detach(), cq, ck, 4, 5,
                                                               True, 0.125, -1, -1, 0.0)
    g = torch.randn_like(out)
    torch.library.opcheck(torch.ops.pykern.flash_attention_varlen_backward.default,
                          (q.detach(), k.detach(), v.detach(), out, lse, g, cq, ck, 4, 5, True, 0.125, 3, -1, 1.5))


@pytest.mark.parametrize("cap", [0.0, 2.0])
def test_grads_run_on_the_sm90_backward_when_playing_hopper(monkeypatch, cap: float) -> None:
    """With PYKERN_HOST_ARCH=sm_90a the autograd backward runs the fused wgmma varlen kernel (attention_bwd_sm90.cu,
    VL; softcap: the _softcap one) and matches per-sequence float64."""
    monkeypatch.setenv("PYKERN_HOST_ARCH", "sm_90a")
    monkeypatch.delenv("PYKERN_HOST_SCHEDULE", raising=False)
    g = torch.Generator().manual_seed(6)
    lq, lk = [40, 0, 130], [70, 5, 150]
    cq, ck = _cu(lq), _cu(lk)
    q = torch.randn(int(cq[-1]), 4, 64, generator=g).bfloat16().requires_grad_()
    k, v = (torch.randn(int(ck[-1]), 2, 64, generator=g).bfloat16().requires_grad_() for _ in range(2))
    up = torch.randn(int(cq[-1]), 4, 64, generator=g)
    out = pt.flash_attention_varlen(q, k, v, cq, ck, max(lq), max(lk), causal=True, softcap=cap)
    names = record_launches(monkeypatch)
    dq, dk, dv = torch.autograd.grad((out.float() * up).sum(), (q, k, v))
    c = "_softcap" if cap else ""
    assert [n for n in names if "sm90" in n] == [f"attention_bwd_varlen_sm90_fused_d64{c}_bf16"], names
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, _ = _ref(q64, k64, v64, cq.tolist(), ck.tolist(), True, (-1, -1), cap, 1.0 / math.sqrt(64))
    rq, rk, rv = torch.autograd.grad((ref * up.double()).sum(), (q64, k64, v64))
    for got, want in ((dq, rq), (dk, rk), (dv, rv)):
        _close(got, want, "flash_attention_varlen_backward", "bf16")
