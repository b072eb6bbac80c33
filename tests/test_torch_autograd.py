"""pykern.torch functions: forward and gradients against torch's own ops in float64, bf16 forwards,
the nn.Modules, argument errors, and torch.compile(fullgraph=True) over a module built from them."""
from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

import pykern.torch as pt  # noqa: E402
from pykern.errors import ArgumentError, ArgumentTypeError  # noqa: E402
from pykern.tolerance import tolerance  # noqa: E402

from gpu import requires_gpu  # noqa: E402
from launch_spy import record_launches

F = torch.nn.functional


def assert_close(out, ref, op: str, dtype: str = "f32") -> None:
    atol, rtol = tolerance(op, dtype)
    out = out.detach().double()
    ref = ref.detach().double()
    assert out.shape == ref.shape, (out.shape, ref.shape)
    err = (out - ref).abs()
    bound = atol + rtol * ref.abs()
    assert bool(torch.isfinite(out).all()), f"{op}: non-finite output"
    assert bool((err <= bound).all()), f"{op}/{dtype}: max err {err.max().item():.3g}, worst excess {(err - bound).max().item():.3g}"


def leaf(t, dtype=torch.float32):
    return t.to(dtype).detach().requires_grad_(True)


def grads(fn, inputs, upstream):
    """Outputs of fn(*inputs) and d(sum(out * upstream))/d(inputs)."""
    out = fn(*inputs)
    outs = out if isinstance(out, tuple) else (out,)
    ups = upstream if isinstance(upstream, tuple) else (upstream,)
    total = sum((o * u.to(o.dtype)).sum() for o, u in zip(outs, ups))
    g = torch.autograd.grad(total, inputs)
    return out, g


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


# --------------------------------------------------------------------------- rms_norm


def test_rms_norm_forward_and_grads_match_torch_f64():
    g = gen(1)
    x = torch.randn(3, 5, 40, generator=g)
    w = torch.randn(40, generator=g)
    up = torch.randn(3, 5, 40, generator=g)
    eps = 1e-5

    def ref(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    out, (gx, gw) = grads(lambda a, b: pt.rms_norm(a, b, eps), (leaf(x), leaf(w)), up)
    rout, (rgx, rgw) = grads(ref, (leaf(x, torch.float64), leaf(w, torch.float64)), up.double())
    assert out.dtype == torch.float32
    assert_close(out, rout, "rms_norm")
    assert_close(gx, rgx, "rms_norm_backward")
    assert_close(gw, rgw, "rms_norm_backward")


def test_rms_norm_non_contiguous_input():
    g = gen(2)
    x = torch.randn(40, 6, generator=g).t()  # (6, 40), not contiguous
    w = torch.randn(40, generator=g)
    out = pt.rms_norm(x, w, 1e-6)
    xd = x.double()
    assert_close(out, xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double(), "rms_norm")


# --------------------------------------------------------------------------- swiglu


def test_swiglu_forward_and_grads_match_torch_f64():
    g = gen(3)
    a, b, up = (torch.randn(4, 37, generator=g) * 3 for _ in range(3))
    out, (ga, gb) = grads(pt.swiglu, (leaf(a), leaf(b)), up)
    rout, (rga, rgb) = grads(lambda x, y: F.silu(x) * y, (leaf(a, torch.float64), leaf(b, torch.float64)), up.double())
    assert_close(out, rout, "silu_gate")
    assert_close(ga, rga, "silu_gate_backward")
    assert_close(gb, rgb, "silu_gate_backward")


# --------------------------------------------------------------------------- rope


def hf_tables(max_pos, d, dtype=torch.float64):
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    freqs = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def rope_ref(q, k, cos_tok, sin_tok):
    # q (b, s, h, d); cos_tok (b or 1, s, d): HF's apply_rotary_pos_emb with unsqueeze_dim=2
    c, s = cos_tok.unsqueeze(2), sin_tok.unsqueeze(2)
    return q * c + rotate_half(q) * s, k * c + rotate_half(k) * s


@pytest.mark.parametrize("form", ["table_positions", "table_default", "per_token", "per_token_b1"])
def test_rope_forward_and_grads_match_torch_f64(form):
    g = gen(4)
    b, s, hq, hk, d, max_pos = 2, 5, 4, 2, 16, 12
    q, k = torch.randn(b, s, hq, d, generator=g), torch.randn(b, s, hk, d, generator=g)
    uq, uk = torch.randn(b, s, hq, d, generator=g), torch.randn(b, s, hk, d, generator=g)
    cos, sin = hf_tables(max_pos, d)
    if form == "table_positions":
        pos = torch.randint(0, max_pos, (b, s), generator=g)
        args, ctok, stok = (cos.float(), sin.float(), pos), cos[pos], sin[pos]
    elif form == "table_default":
        args, ctok, stok = (cos.float(), sin.float()), cos[:s][None], sin[:s][None]
    elif form == "per_token":
        pos = torch.randint(0, max_pos, (b, s), generator=g)
        args, ctok, stok = (cos[pos].float(), sin[pos].float()), cos[pos], sin[pos]
    else:
        args, ctok, stok = (cos[3:3 + s][None].float(), sin[3:3 + s][None].float()), cos[3:3 + s][None], sin[3:3 + s][None]
    (oq, ok), (gq, gk) = grads(lambda x, y: pt.rope(x, y, *args), (leaf(q), leaf(k)), (uq, uk))
    (rq, rk), (rgq, rgk) = grads(lambda x, y: rope_ref(x, y, ctok, stok),
                                 (leaf(q, torch.float64), leaf(k, torch.float64)), (uq.double(), uk.double()))
    for o, r in ((oq, rq), (ok, rk), (gq, rgq), (gk, rgk)):
        assert_close(o, r, "rope")
    # the backward is a rotation by -theta: it is the inverse of the forward as well
    assert not torch.allclose(gq, uq)


def test_rope_rejects_bad_tables():
    q = torch.randn(1, 3, 2, 8)
    cos, sin = hf_tables(8, 8, torch.float32)
    with pytest.raises(ArgumentError, match="cos"):
        pt.rope(q, q, cos[:, :6], sin[:, :6])
    with pytest.raises(ArgumentError, match="position_ids"):
        pt.rope(q, q, cos, sin, torch.zeros(2, 4, dtype=torch.int64))


# --------------------------------------------------------------------------- flash_attention


def attention_ref(q, k, v, causal, scale):
    # (b, s, h, d) layout, GQA by repeating kv heads, causal aligned bottom-right
    h, hk = q.shape[2], k.shape[2]
    k = k.repeat_interleave(h // hk, dim=2)
    v = v.repeat_interleave(h // hk, dim=2)
    sc = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    n_q, n_k = q.shape[1], k.shape[1]
    if causal:
        i = torch.arange(n_q)[:, None]
        j = torch.arange(n_k)[None, :]
        sc = sc.masked_fill(j > i + n_k - n_q, float("-inf"))
    # a query that sees no key (n_q > n_k, causal) gives 0, as pykern defines it
    p = torch.where(torch.isinf(sc).all(-1, keepdim=True), torch.zeros_like(sc), torch.softmax(sc, -1))
    return torch.einsum("bhqk,bkhd->bqhd", p, v)



@pytest.mark.parametrize(
    "n_q,n_k,h,hk,causal,scale",
    [
        (6, 6, 4, 2, True, None),  # training prefill, GQA 2
        (5, 5, 2, 1, True, None),  # MQA
        (3, 7, 4, 2, True, None),  # chunk after a cache: bottom-right
        (4, 6, 2, 2, False, 0.3),  # non-causal, explicit scale
        (7, 4, 2, 1, True, None),  # n_q > n_k: the first 3 queries see no key
    ],
)
def test_flash_attention_forward_and_grads_match_torch_f64(n_q, n_k, h, hk, causal, scale):
    g = gen(5)
    b, d = 2, 16
    q = torch.randn(b, n_q, h, d, generator=g)
    k, v = torch.randn(b, n_k, hk, d, generator=g), torch.randn(b, n_k, hk, d, generator=g)
    up = torch.randn(b, n_q, h, d, generator=g)
    sc = scale if scale is not None else 1 / math.sqrt(d)
    out, (gq, gk, gv) = grads(lambda a, bb, c: pt.flash_attention(a, bb, c, causal=causal, scale=scale),
                              (leaf(q), leaf(k), leaf(v)), up)
    rout, (rq, rk, rv) = grads(lambda a, bb, c: attention_ref(a, bb, c, causal, sc),
                               (leaf(q, torch.float64), leaf(k, torch.float64), leaf(v, torch.float64)), up.double())
    assert_close(out, rout, "flash_attention")
    for o, r in ((gq, rq), (gk, rk), (gv, rv)):
        assert_close(o, r, "attention_backward")


@pytest.mark.parametrize("sm90", [False, True], ids=["mma_sync", "sm90a"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_flash_attention_192_128_grads_match_torch_f64(dtype, sm90: bool, monkeypatch):
    """v narrower than q / k (DeepSeek-V3's prefill, head_dim 192, head_dim_v 128) through autograd: out, dq, dk
    and dv equal float64. PYKERN_HOST_ARCH=sm_90a: the forward and the fused backward kernel are the sm_90a
    _d192_dv128 ones; without it the backward runs on v and grad_out padded with zero columns to 192."""
    kind = "bf16" if dtype == torch.bfloat16 else "f16"
    if sm90:
        monkeypatch.setenv("PYKERN_HOST_ARCH", "sm_90a")
        monkeypatch.delenv("PYKERN_HOST_SCHEDULE", raising=False)
    else:
        monkeypatch.setenv("PYKERN_HOST_ARCH", "")
    g = gen(19)
    q = leaf(torch.randn(2, 140, 4, 192, generator=g), dtype)
    k = leaf(torch.randn(2, 150, 2, 192, generator=g), dtype)
    v = leaf(torch.randn(2, 150, 2, 128, generator=g), dtype)
    up = torch.randn(2, 140, 4, 128, generator=g)
    names = record_launches(monkeypatch)
    out, (gq, gk, gv) = grads(lambda a, bb, c: pt.flash_attention(a, bb, c, causal=True), (q, k, v), up)
    rout, (rq, rk, rv) = grads(lambda a, bb, c: attention_ref(a, bb, c, True, 192 ** -0.5),
                               tuple(leaf(t.detach(), torch.float64) for t in (q, k, v)), up.double())
    assert out.shape == (2, 140, 4, 128) and gv.shape == v.shape
    assert_close(out, rout, "flash_attention", kind)
    for o, r in ((gq, rq), (gk, rk), (gv, rv)):
        assert o.dtype == dtype
        assert_close(o, r, "attention_backward", kind)
    sm90_names = {f"attention_fwd_sm90_d192_dv128_{kind}", f"attention_bwd_sm90_fused_d192_dv128_{kind}"}
    assert (sm90_names <= set(names)) == sm90, names


def test_flash_attention_default_is_not_causal_as_flash_attn_and_ops():
    # pykern.torch's default was causal=True while pykern.ops.flash_attention, flash-attn's flash_attn_func and
    # SDPA default to full attention: the same call gave a different answer through the torch wrapper
    import pykern.ops

    g = gen(61)
    q, k, v = (torch.randn(1, 5, 2, 16, generator=g) for _ in range(3))
    out = pt.flash_attention(q, k, v)
    assert_close(out, attention_ref(q.double(), k.double(), v.double(), False, 16 ** -0.5), "flash_attention")
    assert_close(out, torch.from_numpy(pykern.ops.flash_attention(q.numpy(), k.numpy(), v.numpy(), backend="host")),
                 "flash_attention")
    causal = pt.flash_attention(q, k, v, causal=True)
    assert_close(causal, attention_ref(q.double(), k.double(), v.double(), True, 16 ** -0.5), "flash_attention")
    assert not torch.allclose(out, causal)  # the case tells the two apart


def test_flash_attention_decode_step_forward():
    g = gen(6)
    q, k, v = torch.randn(1, 1, 4, 32, generator=g), torch.randn(1, 9, 2, 32, generator=g), torch.randn(1, 9, 2, 32, generator=g)
    out = pt.flash_attention(q, k, v, causal=True)
    assert_close(out, attention_ref(q.double(), k.double(), v.double(), True, 32 ** -0.5), "flash_attention")


# --------------------------------------------------------------------------- cross_entropy


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_matches_torch_f64(reduction):
    g = gen(7)
    logits = torch.randn(9, 53, generator=g) * 4
    t = torch.randint(0, 53, (9,), generator=g)
    t[[1, 4]] = -100
    up = torch.randn(9, generator=g) if reduction == "none" else torch.tensor(0.7)
    out, (gl,) = grads(lambda x: pt.cross_entropy(x, t, reduction=reduction), (leaf(logits),), up)
    rout, (rgl,) = grads(lambda x: F.cross_entropy(x, t, ignore_index=-100, reduction=reduction),
                         (leaf(logits, torch.float64),), up.double())
    assert out.dtype == torch.float32 and out.shape == rout.shape
    assert_close(out, rout, "cross_entropy_fwd_bwd")
    assert_close(gl, rgl, "cross_entropy_fwd_bwd")
    assert float(gl[1].abs().sum()) == 0.0


def test_cross_entropy_other_ignore_index_and_all_ignored():
    g = gen(8)
    logits = torch.randn(4, 10, generator=g)
    t = torch.tensor([3, 0, 0, 7])
    ref = F.cross_entropy(logits.double(), t, ignore_index=0)
    assert_close(pt.cross_entropy(logits, t, ignore_index=0), ref, "cross_entropy_fwd_bwd")
    all_ign = torch.full((4,), -100)
    assert torch.isnan(pt.cross_entropy(logits, all_ign))  # torch: 0 / 0
    assert torch.isnan(F.cross_entropy(logits, all_ign))
    assert float(pt.cross_entropy(logits, all_ign, reduction="sum")) == 0.0
    assert float(pt.CrossEntropyLoss(reduction="none")(logits, all_ign).abs().sum()) == 0.0


def test_cross_entropy_rejects_bad_arguments():
    x = torch.randn(3, 5)
    with pytest.raises(ArgumentError, match="reduction"):
        pt.cross_entropy(x, torch.zeros(3, dtype=torch.int64), reduction="avg")
    with pytest.raises(ArgumentError, match="logits"):
        pt.cross_entropy(x[None], torch.zeros(1, 3, dtype=torch.int64))
    with pytest.raises(ArgumentTypeError, match="targets"):
        pt.cross_entropy(x, torch.zeros(3))
    with pytest.raises(ArgumentError, match="targets"):
        pt.cross_entropy(x, torch.tensor([0, 5, 1]))


# --------------------------------------------------------------------------- embedding


def test_embedding_forward_and_grad_match_torch_f64():
    g = gen(9)
    table = torch.randn(11, 8, generator=g)
    ids = torch.tensor([[1, 4, 4, 0, 10], [4, 2, 1, 1, 9]])
    up = torch.randn(2, 5, 8, generator=g)
    out, (gt,) = grads(lambda w: pt.embedding(ids, w), (leaf(table),), up)
    rout, (rgt,) = grads(lambda w: F.embedding(ids, w), (leaf(table, torch.float64),), up.double())
    assert torch.equal(out, table[ids])
    assert_close(gt, rgt, "embedding_backward")


# --------------------------------------------------------------------------- bf16 forwards


def bf(t):
    return t.to(torch.bfloat16)


def test_bf16_forwards_match_f64_on_rounded_inputs():
    g = gen(10)
    x, w = bf(torch.randn(4, 64, generator=g)), bf(torch.randn(64, generator=g))
    out = pt.rms_norm(x, w, 1e-6)
    xd = x.double()
    assert out.dtype == torch.bfloat16
    assert_close(out, xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double(), "rms_norm", "bf16")

    a, b = bf(torch.randn(5, 24, generator=g)), bf(torch.randn(5, 24, generator=g))
    assert_close(pt.swiglu(a, b), F.silu(a.double()) * b.double(), "silu_gate", "bf16")

    q, k = bf(torch.randn(2, 4, 2, 16, generator=g)), bf(torch.randn(2, 4, 1, 16, generator=g))
    cos, sin = hf_tables(8, 16)
    pos = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]])
    oq, ok = pt.rope(q, k, cos.float(), sin.float(), pos)
    rq, rk = rope_ref(q.double(), k.double(), cos[pos], sin[pos])
    assert_close(oq, rq, "rope", "bf16")
    assert_close(ok, rk, "rope", "bf16")

    q = bf(torch.randn(1, 5, 4, 16, generator=g))
    kk, vv = bf(torch.randn(1, 5, 2, 16, generator=g)), bf(torch.randn(1, 5, 2, 16, generator=g))
    fa = pt.flash_attention(q, kk, vv, causal=True)
    assert_close(fa, attention_ref(q.double(), kk.double(), vv.double(), True, 0.25), "flash_attention", "bf16")

    logits = bf(torch.randn(6, 40, generator=g) * 3)
    t = torch.tensor([1, -100, 39, 0, 5, 5])
    loss = pt.cross_entropy(logits, t)
    assert loss.dtype == torch.bfloat16
    assert_close(loss, F.cross_entropy(logits.double(), t), "cross_entropy_fwd_bwd", "bf16")

    table = bf(torch.randn(7, 8, generator=g))
    assert torch.equal(pt.embedding(torch.tensor([6, 0, 3]), table), table[[6, 0, 3]])


def test_f16_attention_runs_the_f16_kernels_forward_and_backward(monkeypatch):
    names = record_launches(monkeypatch)
    g = gen(13)
    q = leaf(torch.randn(1, 9, 4, 32, generator=g), torch.float16)
    k = leaf(torch.randn(1, 9, 2, 32, generator=g), torch.float16)
    v = leaf(torch.randn(1, 9, 2, 32, generator=g), torch.float16)
    up = torch.randn(1, 9, 4, 32, generator=g).half()
    out, (gq, gk, gv) = grads(lambda q, k, v: pt.flash_attention(q, k, v, causal=True), (q, k, v), up)
    assert out.dtype == gq.dtype == gk.dtype == gv.dtype == torch.float16
    # head_dim 32 is padded to 64: the general forward (attention_fwd_tc_pad_d64), not the FlashAttention-2 core
    assert names == ["attention_fwd_tc_pad_d64_f16", "attention_bwd_preprocess_f16",
                     "attention_bwd_tc_dkdv_d64_f16", "attention_bwd_tc_dq_d64_f16"]
    qd, kd, vd = (leaf(t.detach(), torch.float64) for t in (q, k, v))
    ref, (rq, rk, rv) = grads(lambda q, k, v: attention_ref(q, k, v, True, 32 ** -0.5), (qd, kd, vd), up.double())
    assert_close(out, ref, "flash_attention", "f16")
    for got, want in ((gq, rq), (gk, rk), (gv, rv)):
        assert_close(got, want, "attention_backward", "f16")
    # autocast float16 (SDPA's policy: inputs cast to f16) runs the same f16 kernels, no f32 stand-in
    names.clear()
    with torch.autocast("cpu", dtype=torch.float16):
        o = pt.flash_attention(q.detach().float(), k.detach().float(), v.detach().float(), causal=True)
    assert o.dtype == torch.float16 and names == ["attention_fwd_tc_pad_d64_f16"]
    assert torch.equal(o, out.detach())


def test_bf16_backward_runs_in_bf16():
    g = gen(11)
    x, w = leaf(torch.randn(3, 32, generator=g), torch.bfloat16), leaf(torch.randn(32, generator=g), torch.bfloat16)
    up = torch.randn(3, 32, generator=g)
    _, (gx, gw) = grads(lambda a, b: pt.rms_norm(a, b, 1e-6), (x, w), up)
    xd, wd = leaf(x.detach(), torch.float64), leaf(w.detach(), torch.float64)
    _, (rgx, rgw) = grads(lambda a, b: a * torch.rsqrt(a.pow(2).mean(-1, keepdim=True) + 1e-6) * b, (xd, wd),
                          bf(up).double())
    assert gx.dtype == gw.dtype == torch.bfloat16
    assert_close(gx, rgx, "rms_norm_backward", "bf16")
    assert_close(gw, rgw, "rms_norm_backward", "bf16")


# --------------------------------------------------------------------------- modules


def test_modules_match_functional():
    g = gen(12)
    norm = pt.RMSNorm(16, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(16, generator=g))
    x = torch.randn(2, 3, 16, generator=g)
    assert torch.equal(norm(x), pt.rms_norm(x, norm.weight, 1e-5))
    mlp = pt.SwiGLUMLP(16, 24)
    ref = mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
    assert_close(mlp(x), ref.double(), "silu_gate")
    logits, t = torch.randn(5, 9, generator=g), torch.tensor([1, 2, -100, 8, 0])
    assert_close(pt.CrossEntropyLoss(reduction="sum")(logits, t), F.cross_entropy(logits.double(), t, reduction="sum"),
                 "cross_entropy_fwd_bwd")


def test_rms_norm_module_mixed_dtypes_follow_hf():
    # bf16 activations, fp32 weight: HF normalises in fp32, casts to bf16, then multiplies by the weight.
    g = gen(13)
    norm = pt.RMSNorm(16)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(16, generator=g))
    x = bf(torch.randn(4, 16, generator=g))
    out = norm(x)
    xd = x.double()
    ref = norm.weight.double() * (xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6))
    assert out.dtype == torch.float32
    assert_close(out, ref, "rms_norm", "bf16")


# --------------------------------------------------------------------------- torch.compile


class TinyBlock(torch.nn.Module):
    def __init__(self, vocab=32, dim=32, heads=2, kv_heads=1):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, dim // heads
        self.emb = torch.nn.Parameter(torch.randn(vocab, dim) * 0.5)
        self.norm = pt.RMSNorm(dim)
        self.q = torch.nn.Linear(dim, dim, bias=False)
        self.kv = torch.nn.Linear(dim, 2 * kv_heads * self.hd, bias=False)
        self.mlp = pt.SwiGLUMLP(dim, 48)
        self.head = torch.nn.Linear(dim, vocab, bias=False)
        cos, sin = hf_tables(16, self.hd, torch.float32)
        self.register_buffer("cos", cos)
        self.register_buffer("sin", sin)
        self.loss = pt.CrossEntropyLoss()

    def forward(self, ids, targets):
        b, s = ids.shape
        x = pt.embedding(ids, self.emb)
        h = self.norm(x)
        q = self.q(h).view(b, s, self.heads, self.hd)
        k, v = self.kv(h).view(b, s, 2 * self.kv_heads, self.hd).split(self.kv_heads, dim=2)
        q, k = pt.rope(q, k, self.cos, self.sin)
        x = x + pt.flash_attention(q, k, v.contiguous(), causal=True).reshape(b, s, -1)
        x = x + self.mlp(self.norm(x))
        return self.loss(self.head(x).view(b * s, -1), targets.view(-1))


def test_torch_compile_fullgraph_matches_eager_with_backward():
    torch.manual_seed(0)
    model = TinyBlock()
    ids = torch.randint(0, 32, (2, 6))
    targets = torch.randint(0, 32, (2, 6))
    targets[0, 0] = -100
    loss = model(ids, targets)
    ref = torch.autograd.grad(loss, list(model.parameters()))
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    closs = compiled(ids, targets)
    got = torch.autograd.grad(closs, list(model.parameters()))
    assert_close(closs, loss.double(), "cross_entropy_fwd_bwd")
    for a, b in zip(got, ref):
        assert_close(a, b.double(), "attention_backward")


@requires_gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs torch with CUDA")
def test_cuda_tensors_match_cpu_forward_and_backward():
    torch.manual_seed(0)
    model = TinyBlock()
    ids = torch.randint(0, 32, (2, 6))
    targets = torch.randint(0, 32, (2, 6))
    loss = model(ids, targets)
    ref = torch.autograd.grad(loss, list(model.parameters()))
    model = model.cuda()
    with torch.cuda.stream(torch.cuda.Stream()):  # pykern launches on torch's current stream
        closs = model(ids.cuda(), targets.cuda())
        got = torch.autograd.grad(closs, list(model.parameters()))
    torch.cuda.synchronize()
    assert_close(closs.cpu(), loss.double(), "cross_entropy_fwd_bwd")
    for a, b in zip(got, ref):
        assert_close(a.cpu(), b.double(), "attention_backward")


def test_custom_ops_pass_torch_library_opcheck():
    # torch's own checker: schema, fake implementation vs real outputs, autograd registration.
    g = gen(14)
    x, w = torch.randn(3, 8, generator=g, requires_grad=True), torch.randn(8, generator=g, requires_grad=True)
    torch.library.opcheck(torch.ops.pykern.rms_norm.default, (x, w, 1e-6))
    a, b = torch.randn(4, 6, generator=g, requires_grad=True), torch.randn(4, 6, generator=g, requires_grad=True)
    torch.library.opcheck(torch.ops.pykern.swiglu.default, (a, b))
    logits = torch.randn(5, 7, generator=g, requires_grad=True)
    t = torch.tensor([1, -100, 6, 0, 2])
    for red in ("mean", "sum", "none"):
        torch.library.opcheck(torch.ops.pykern.cross_entropy.default, (logits, t, -100, red))
    q = torch.randn(1, 4, 2, 8, generator=g, requires_grad=True)
    k = torch.randn(1, 4, 1, 8, generator=g, requires_grad=True)
    v = torch.randn(1, 4, 1, 8, generator=g, requires_grad=True)
    torch.library.opcheck(torch.ops.pykern.flash_attention.default, (q, k, v, True, 8 ** -0.5))
    ids = torch.tensor([[0, 3], [3, 1]])
    torch.library.opcheck(torch.ops.pykern.embedding.default, (ids, torch.randn(4, 8, generator=g, requires_grad=True)))


def test_flash_attention_backward_is_deterministic_under_torch_deterministic_mode(monkeypatch):
    # torch.use_deterministic_algorithms(True) makes the tensor-core backward sum dQ in a fixed order
    # (the fused kernel's _det variant); the default keeps the fp32 atomics. Both match each other.
    names = record_launches(monkeypatch)
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 40, 2, 64, generator=g).bfloat16().requires_grad_() for _ in range(3))
    grads_by_mode = {}
    for det in (False, True):
        prev = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(det)
        try:
            names.clear()
            out = pt.flash_attention(q, k, v, causal=True)
            grads_by_mode[det] = torch.autograd.grad(out.float().sum(), (q, k, v))
        finally:
            torch.use_deterministic_algorithms(prev)
        assert ("attention_bwd_tc_fused_d64_det_bf16" in names) == det, names
        assert ("attention_bwd_tc_fused_d64_bf16" in names) == (not det), names
    for a, b in zip(grads_by_mode[False], grads_by_mode[True]):
        torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2)
