"""pykern.torch pieces that model families need: the RMSNorm offset (Gemma's x * (1 + w)), the loss
options as torch / Liger-Kernel define them, and window / softcap attention through the custom ops.
References are torch's own ops in float64."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import pykern.torch as pt  # noqa: E402
from test_torch_autograd import assert_close, grads, leaf  # noqa: E402  (the torch op tests' comparison)

F = torch.nn.functional


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


# --------------------------------------------------------------------------- RMSNorm offset


def _gemma_norm(x, w, eps):  # transformers' GemmaRMSNorm.forward
    out = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return (out * (1.0 + w.float())).type_as(x)


@pytest.mark.parametrize("offset", [0.0, 1.0, 0.5])
def test_rms_norm_offset_forward_and_grads_match_f64(offset):
    g = gen(1)
    x, w, up = torch.randn(3, 5, 40, generator=g), 0.1 * torch.randn(40, generator=g), torch.randn(3, 5, 40, generator=g)

    def ref(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (offset + w)

    out, (gx, gw) = grads(lambda a, b: pt.rms_norm(a, b, 1e-6, offset=offset), (leaf(x), leaf(w)), up)
    rout, (rgx, rgw) = grads(ref, (leaf(x, torch.float64), leaf(w, torch.float64)), up.double())
    assert_close(out, rout, "rms_norm")
    assert_close(gx, rgx, "rms_norm_backward")
    assert_close(gw, rgw, "rms_norm_backward")
    r = torch.randn(3, 5, 40, generator=g)
    (y, h), (gx2, gr2, gw2) = grads(lambda a, b, c: pt.add_rms_norm(a, b, c, 1e-6, offset=offset),
                                    (leaf(x), leaf(r), leaf(w)), (up, up))
    (ry, rh), (rgx2, _, rgw2) = grads(lambda a, b, c: (ref(a + b, c), a + b),
                                      (leaf(x, torch.float64), leaf(r, torch.float64), leaf(w, torch.float64)),
                                      (up.double(), up.double()))
    assert_close(y, ry, "add_rms_norm")
    assert_close(gx2, rgx2, "add_rms_norm_backward")
    assert_close(gw2, rgw2, "add_rms_norm_backward")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gemma_rms_norm_module_equals_hf_formula(dtype):
    g = gen(2)
    x = torch.randn(4, 64, generator=g).to(dtype)
    w = torch.nn.Parameter((0.2 * torch.randn(64, generator=g)).to(dtype))
    m = pt.RMSNorm(64, 1e-6, weight=w, offset=1.0)
    out, ref = m(x), _gemma_norm(x, w, 1e-6)
    assert out.dtype == ref.dtype == dtype
    d = "f32" if dtype == torch.float32 else ("bf16" if dtype == torch.bfloat16 else "f16")
    # both round one fp32 value to dtype: at most one unit of the last place apart
    assert_close(out.float(), _gemma_norm(x.double(), w.double(), 1e-6), "rms_norm", d)
    assert_close(ref.float(), _gemma_norm(x.double(), w.double(), 1e-6), "rms_norm", d)


def test_rms_norm_offset_opcheck():
    g = gen(3)
    x, w = torch.randn(3, 8, generator=g, requires_grad=True), torch.randn(8, generator=g, requires_grad=True)
    torch.library.opcheck(torch.ops.pykern.rms_norm.default, (x, w, 1e-6, 1.0))
    r = torch.randn(3, 8, generator=g, requires_grad=True)
    torch.library.opcheck(torch.ops.pykern.add_rms_norm.default, (x, r, w, 1e-6, 1.0))


# --------------------------------------------------------------------------- losses (torch / Liger-Kernel)


def _liger_ref(logits, t, *, weight=None, eps=0.0, zl=0.0, cap=None, reduction="mean", ignore_index=-100):
    """float64 loss and z-loss as torch's F.cross_entropy(weight=, label_smoothing=) plus Liger's z-loss
    (lse_square_scale * lse^2 per non-ignored row, never weighted, its mean over the count)."""
    z = cap * torch.tanh(logits / cap) if cap else logits
    ce = F.cross_entropy(z, t, weight=weight, ignore_index=ignore_index, label_smoothing=eps, reduction=reduction)
    live = (t != ignore_index).to(z.dtype)
    zrow = zl * torch.logsumexp(z, -1) ** 2 * live
    zpart = {"mean": zrow.sum() / live.sum(), "sum": zrow.sum(), "none": zrow}[reduction]
    return ce + zpart, zpart


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("opts", [dict(weight=True), dict(weight=True, eps=0.1), dict(eps=0.2, zl=1e-2),
                                  dict(weight=True, eps=0.1, zl=1e-2, cap=5.0)])
def test_cross_entropy_options_match_torch_and_liger_f64(reduction, opts):
    g = gen(7)
    logits = torch.randn(11, 53, generator=g) * 4
    t = torch.randint(0, 53, (11,), generator=g)
    t[[1, 4]] = -100
    w = torch.rand(53, generator=g) * 1.75 + 0.25 if opts.get("weight") else None
    up = torch.randn(11, generator=g) if reduction == "none" else torch.tensor(0.7)
    kw = dict(label_smoothing=opts.get("eps", 0.0), lse_square_scale=opts.get("zl", 0.0), softcap=opts.get("cap"))
    (out, zout), (gl,) = grads(lambda x: pt.cross_entropy(x, t, reduction=reduction, weight=w, return_z_loss=True,
                                                         **kw), (leaf(logits),), (up, torch.zeros_like(up)))
    (rout, rz), (rgl,) = grads(lambda x: _liger_ref(x, t, weight=None if w is None else w.double(),
                                                    eps=kw["label_smoothing"], zl=kw["lse_square_scale"],
                                                    cap=kw["softcap"], reduction=reduction),
                               (leaf(logits, torch.float64),), (up.double(), torch.zeros_like(up).double()))
    assert out.dtype == torch.float32 and out.shape == rout.shape
    assert_close(out, rout, "cross_entropy_fwd_bwd")
    assert_close(zout, rz, "cross_entropy_fwd_bwd")
    assert_close(gl, rgl, "cross_entropy_fwd_bwd")
    assert float(gl[1].abs().sum()) == 0.0
    # the module, under torch's and Liger's keywords
    m = pt.CrossEntropyLoss(w, reduction=reduction, label_smoothing=kw["label_smoothing"],
                            lse_square_scale=kw["lse_square_scale"], softcap=kw["softcap"])
    assert_close(m(logits, t), rout, "cross_entropy_fwd_bwd")


def test_cross_entropy_weighted_mean_of_zero_weights_is_nan_as_torch():
    logits, t = torch.randn(3, 5), torch.tensor([1, 2, -100])
    w = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0])
    assert torch.isnan(F.cross_entropy(logits, t, weight=w)) and torch.isnan(pt.cross_entropy(logits, t, weight=w))
    assert float(pt.cross_entropy(logits, t, weight=w, reduction="sum")) == 0.0


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_linear_cross_entropy_options_and_none_grads(reduction, dtype):
    g = gen(9)
    n, hd, v = 13, 24, 41
    h, wt = torch.randn(n, hd, generator=g), torch.randn(v, hd, generator=g) * 0.4
    b = torch.randn(v, generator=g) * 0.1
    t = torch.randint(0, v, (n,), generator=g)
    t[[0, 5]] = -100
    cw = torch.rand(v, generator=g) + 0.5
    up = torch.randn(n, generator=g) if reduction == "none" else torch.tensor(1.3)
    kw = dict(ce_weight=cw, label_smoothing=0.1, lse_square_scale=1e-2, softcap=6.0, reduction=reduction,
              chunk_size=4, return_z_loss=True)
    (out, zout), gr = grads(lambda a, c, d: pt.fused_linear_cross_entropy(a, c, t, d, **kw),
                            (leaf(h, dtype), leaf(wt, dtype), leaf(b, dtype)), (up, torch.zeros_like(up)))
    (rout, rz), rgr = grads(lambda a, c, d: _liger_ref(a @ c.T + d, t, weight=cw.double(), eps=0.1, zl=1e-2, cap=6.0,
                                                       reduction=reduction),
                            tuple(leaf(x.to(dtype), torch.float64) for x in (h, wt, b)),
                            (up.double(), torch.zeros_like(up).double()))
    d = "f32" if dtype == torch.float32 else "bf16"
    assert out.dtype == torch.float32 and out.shape == rout.shape
    assert_close(out, rout, "fused_linear_cross_entropy", d)
    assert_close(zout, rz, "fused_linear_cross_entropy", d)
    for a, r in zip(gr, rgr):
        assert a.dtype == dtype
        assert_close(a.float(), r, "fused_linear_cross_entropy", d)


def test_loss_ops_pass_opcheck_and_compile_fullgraph():
    g = gen(14)
    logits = torch.randn(5, 7, generator=g, requires_grad=True)
    t = torch.tensor([1, -100, 6, 0, 2])
    w = torch.rand(7, generator=g) + 0.5
    for red in ("mean", "sum", "none"):
        torch.library.opcheck(torch.ops.pykern.cross_entropy.default, (logits, t, -100, red, 0.1, 1e-3, 0.0, w))
    h = torch.randn(5, 8, generator=g, requires_grad=True)
    wt = torch.randn(7, 8, generator=g, requires_grad=True)
    for red in ("mean", "none"):
        torch.library.opcheck(torch.ops.pykern.fused_linear_cross_entropy.default,
                              (h, wt, t, None, -100, 0.1, 1e-3, 5.0, red, 2, w))
    torch.library.opcheck(torch.ops.pykern.fused_linear_cross_entropy_backward.default,
                          (h.detach(), wt.detach(), t, None, torch.randn(5, generator=g), -100, 0.1, 1e-3, 5.0, 2, w))

    def f(h, wt):
        loss = pt.fused_linear_cross_entropy(h, wt, t, ce_weight=w, reduction="none", softcap=5.0)
        return (loss * torch.arange(5.0)).sum() + pt.cross_entropy(h @ wt.T, t, weight=w, label_smoothing=0.1)

    ref = f(h, wt)
    rg = torch.autograd.grad(ref, (h, wt))
    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(h, wt)
    gg = torch.autograd.grad(got, (h, wt))
    assert_close(got, ref.double(), "fused_linear_cross_entropy")
    for a, b in zip(gg, rg):
        assert_close(a, b.double(), "fused_linear_cross_entropy")


# --------------------------------------------------------------------------- window / softcap attention


def _ref_attention(q, k, v, scale, window, cap):
    """float64 (b, n, h, d) attention, bottom-right causal cut to window_size=(left, 0), scores softcapped."""
    b, n_q, h, d = q.shape
    n_k, hk = k.shape[1], k.shape[2]
    k, v = k.repeat_interleave(h // hk, 2), v.repeat_interleave(h // hk, 2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if cap:
        s = cap * torch.tanh(s / cap)
    i = torch.arange(n_q)[:, None] + (n_k - n_q)
    j = torch.arange(n_k)[None, :]
    keep = (j <= i) & ((j >= i - window[0]) if window[0] >= 0 else True)
    s = s.masked_fill(~keep, float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1), v)


@pytest.mark.parametrize("n_q,n_k,window,cap", [(9, 9, (3, 0), None), (9, 9, (3, 0), 1.5), (1, 6, (3, 0), None),
                                                (4, 11, (2, 0), 2.0), (7, 7, (-1, 0), 1.0)])
def test_flash_attention_window_and_softcap_forward_and_grads_match_f64(n_q, n_k, window, cap):
    g = gen(21)
    q, k, v = (torch.randn(2, n, hh, 16, generator=g) for n, hh in ((n_q, 4), (n_k, 2), (n_k, 2)))
    up = torch.randn(2, n_q, 4, 16, generator=g)
    out, gr = grads(lambda a, b, c: pt.flash_attention(a, b, c, True, 0.3, window_size=window, softcap=cap),
                    (leaf(q), leaf(k), leaf(v)), up)
    rout, rgr = grads(lambda a, b, c: _ref_attention(a, b, c, 0.3, window, cap),
                      tuple(leaf(x, torch.float64) for x in (q, k, v)), up.double())
    assert_close(out, rout, "flash_attention")
    for a, r in zip(gr, rgr):
        assert_close(a, r, "attention_backward")


def test_flash_attention_window_softcap_opcheck_and_compile_fullgraph():
    g = gen(22)
    q, k, v = (torch.randn(1, 6, hh, 8, generator=g, requires_grad=True) for hh in (2, 1, 1))
    torch.library.opcheck(torch.ops.pykern.flash_attention.default, (q, k, v, True, 8 ** -0.5, 2, 0, 1.5))

    def f(q, k, v):
        return (pt.flash_attention(q, k, v, causal=True, window_size=(2, 0), softcap=1.5) ** 2).sum()

    ref = f(q, k, v)
    rg = torch.autograd.grad(ref, (q, k, v))
    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v)
    gg = torch.autograd.grad(got, (q, k, v))
    assert_close(got, ref.double(), "flash_attention")
    for a, b in zip(gg, rg):
        assert_close(a, b.double(), "attention_backward")
