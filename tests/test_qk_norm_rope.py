"""RoPE of q and k in one launch (pykern.ops.qk_norm_rope, the kernel behind pykern.ops.rope too) and the fused
q_norm / k_norm of Qwen3 / Gemma 3 before the rotation, forward and backward, against float64 on the host
backend: GQA ratios 1 / 2 / 4 / 8 and one kv head, the 16-byte and the scalar paths, decode (one token), units of
part of a token's heads and of all of them, in-place; the weight gradients are deterministic."""
from __future__ import annotations

import numpy as np
import pytest

from pykern import ArgumentError, ops
from pykern.difftest.cases import forward as F
from pykern.difftest.runner import compare
from pykern.ops import forward as fwd_mod
from pykern.tolerance import tolerance

from family_helpers import need as _need
from launch_spy import record_launches

ml_dtypes = pytest.importorskip("ml_dtypes")


def _ok(name: str, got, ref, op: str, dtype: str) -> None:
    atol, rtol = tolerance(op, dtype)
    c = compare(name, np.asarray(got), ref, atol, rtol)
    assert c.ok, f"{name}: {c.detail}"


def _data(rng, kind: str, qs: tuple, hk: int):
    dt = np.float32 if kind == "f32" else ml_dtypes.bfloat16
    ks = qs[:-2] + (hk, qs[-1])
    q, k = rng.standard_normal(qs).astype(dt), rng.standard_normal(ks).astype(dt)
    d = qs[-1]
    wq, wk = (1 + 0.3 * rng.standard_normal(d)).astype(dt), (1 + 0.3 * rng.standard_normal(d)).astype(dt)
    return q, k, wq, wk


@pytest.mark.parametrize("kind", ["f32", "bf16"])
@pytest.mark.parametrize("qs,hk,style", [
    ((2, 5, 4, 128), 4, "half"),          # GQA 1
    ((2, 5, 8, 128), 4, "half"),          # GQA 2
    ((3, 16, 64), 4, "interleaved"),      # GQA 4
    ((1, 1, 8, 128), 1, "half"),          # decode: one token, GQA 8, one kv head
    ((2, 3, 6, 80), 2, "half"),           # half / 16 bytes not a power of two: padded lane groups
    ((4, 3, 6), 1, "interleaved"),        # head_dim 6: the scalar path
])
def test_q_and_k_match_float64_in_one_launch(monkeypatch, kind, qs, hk, style) -> None:
    """rope of q and k, and the fused RMS norm + rope, against float64; one rope launch rotates both."""
    _need("host")
    rng = np.random.default_rng(5)
    q, k, wq, wk = _data(rng, kind, qs, hk)
    cos, sin = F.rope_tables(12, qs[-1])
    names = record_launches(monkeypatch)
    oq, ok = ops.qk_norm_rope(q, k, cos, sin, pos_offset=2, style=style, backend="host")
    assert [n for n in names if n.startswith("rope")] == ["rope" + ("" if kind == "f32" else "_bf16")]
    _ok("q", oq, F.np_rope(q, cos, sin, 2, style), "qk_norm_rope", kind)
    _ok("k", ok, F.np_rope(k, cos, sin, 2, style), "qk_norm_rope", kind)
    # the same rotation, element for element, as rope on one tensor: the same bits
    np.testing.assert_array_equal(np.asarray(oq).view(np.uint8),
                                  np.asarray(ops.rope(q, cos, sin, pos_offset=2, style=style, backend="host")
                                             ).view(np.uint8))
    names.clear()
    nq, nk = ops.qk_norm_rope(q, k, cos, sin, q_weight=wq, k_weight=wk, eps=1e-5, pos_offset=2, style=style,
                              backend="host")
    assert [n for n in names if n.startswith("rope")] == ["rope" + ("" if kind == "f32" else "_bf16")]
    want = F.np_qk_norm_rope(q, k, cos, sin, wq, wk, 1e-5, 0.0, style=style, pos_offset=2)
    _ok("q normed", nq, want["q_out"], "qk_norm_rope", kind)
    _ok("k normed", nk, want["k_out"], "qk_norm_rope", kind)


@pytest.mark.parametrize("units", [8192, 1])
def test_units_of_part_or_all_of_a_tokens_heads(monkeypatch, units) -> None:
    """With few tokens a warp takes part of a token's heads (the tables re-read per unit); with many (here forced
    by a small _ROPE_UNITS) one unit takes all of them (tables read once a token): the same result, in place too,
    with device-style positions per batch row and Gemma's weight offset."""
    _need("host")
    monkeypatch.setattr(fwd_mod, "_ROPE_UNITS", units)
    hpu, n_units = fwd_mod._rope_units(2 * 7, 16 + 4, 128, 2)
    assert (hpu == 20) == (units == 1) and n_units == 2 * 7 * -(-20 // hpu)
    rng = np.random.default_rng(6)
    q, k, wq, wk = _data(rng, "bf16", (2, 7, 16, 128), 4)
    cos, sin = F.hf_rope_tables(20, 128, "half")
    pos = rng.integers(0, 20, size=(2, 7))
    want = F.np_qk_norm_rope(q, k, cos, sin, wq, wk, 1e-6, 1.0, style="half", position_ids=pos)
    qq, kk = q.copy(), k.copy()
    oq, ok = ops.qk_norm_rope(qq, kk, cos, sin, q_weight=wq, k_weight=wk, weight_offset=1.0, position_ids=pos,
                              inplace=True, backend="host")
    assert oq is qq and ok is kk
    _ok("q", oq, want["q_out"], "qk_norm_rope", "bf16")
    _ok("k", ok, want["k_out"], "qk_norm_rope", "bf16")


@pytest.mark.parametrize("kind,qs,hk,style,offset", [
    ("f32", (2, 20, 4, 64), 2, "half", 0.0),
    ("f32", (30, 8, 128), 1, "interleaved", 1.0),
    ("bf16", (2, 20, 8, 128), 2, "half", 0.0),
    ("f32", (5, 2, 6), 1, "half", 0.0),  # the scalar path
])
def test_backward_matches_float64_and_is_deterministic(kind, qs, hk, style, offset) -> None:
    """Gradients of q, k and both weights against float64 (several blocks' partial rows summed by
    norm_grad_reduce); a second run gives the same bits."""
    _need("host")
    rng = np.random.default_rng(7)
    q, k, wq, wk = _data(rng, kind, qs, hk)
    gq, gk = (rng.standard_normal(a.shape).astype(a.dtype) for a in (q, k))
    cos, sin = F.rope_tables(40, qs[-1])
    got = ops.qk_norm_rope_backward(q, k, gq, gk, cos, sin, wq, wk, weight_offset=offset, style=style,
                                    backend="host")
    want = F.np_qk_norm_rope_backward(q, k, gq, gk, cos, sin, wq, wk, 1e-6, offset, style=style)
    for name, g in zip(("grad_q", "grad_k", "grad_q_weight", "grad_k_weight"), got):
        assert g.dtype == q.dtype, name
        _ok(name, g, want[name], "qk_norm_rope_backward", kind)
    again = ops.qk_norm_rope_backward(q, k, gq, gk, cos, sin, wq, wk, weight_offset=offset, style=style,
                                      backend="host")
    for a, b in zip(got, again):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


def test_norm_arguments_are_checked_before_launch(monkeypatch) -> None:
    def boom(*a, **k):
        raise AssertionError("a bad input reached launch")

    from pykern import launcher

    monkeypatch.setattr(launcher, "launch", boom)
    q, k = np.zeros((3, 4, 64), np.float32), np.zeros((3, 2, 64), np.float32)
    w = np.ones(64, np.float32)
    cos, sin = F.rope_tables(8, 64)
    with pytest.raises(ArgumentError, match="k_weight"):
        ops.qk_norm_rope(q, k, cos, sin, q_weight=w)
    with pytest.raises(ArgumentError, match="inverse"):
        ops.qk_norm_rope(q, k, cos, sin, q_weight=w, k_weight=w, inverse=True)
    with pytest.raises(ArgumentError, match=r"q_weight: expected shape \(64,\)"):
        ops.qk_norm_rope(q, k, cos, sin, q_weight=w[:32], k_weight=w)
    with pytest.raises(ArgumentError, match="k: expected shape"):
        ops.qk_norm_rope(q, np.zeros((4, 2, 64), np.float32), cos, sin)
    with pytest.raises(ArgumentError, match="eps"):
        ops.qk_norm_rope(q, k, cos, sin, q_weight=w, k_weight=w, eps=-1.0)
    big = np.zeros((3, 4, 1024), np.float32)  # 128 16-byte chunks a head: past the norm's 32 lanes
    bc, bs = F.rope_tables(8, 1024)
    with pytest.raises(ArgumentError, match="head_dim 1024"):
        ops.qk_norm_rope(big, big, bc, bs, q_weight=np.ones(1024, np.float32), k_weight=np.ones(1024, np.float32))


def test_torch_qk_norm_rope_forward_and_grads_match_float64() -> None:
    """pykern.torch.qk_norm_rope (Qwen3's q_norm / k_norm, then rotate_half) and its autograd against float64
    torch on HF's formula, per-token cos / sin as HF's rotary module gives them."""
    torch = pytest.importorskip("torch")
    _need("host")
    import pykern.torch as pt

    g = torch.Generator().manual_seed(3)
    b, s, hq, hk, d = 2, 5, 4, 2, 64
    leaves = [torch.randn(b, s, hq, d, generator=g), torch.randn(b, s, hk, d, generator=g),
              1 + 0.3 * torch.randn(d, generator=g), 1 + 0.3 * torch.randn(d, generator=g)]
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).double() / d))
    ang = torch.outer(torch.arange(s).double(), inv)
    emb = torch.cat((ang, ang), -1)[None].expand(b, s, d)
    cos, sin = emb.cos(), emb.sin()
    gq, gk = torch.randn(b, s, hq, d, generator=g), torch.randn(b, s, hk, d, generator=g)

    def hf(q, k, wq, wk):
        def norm(x, w):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w

        def rot(x):
            return torch.cat((-x[..., d // 2:], x[..., : d // 2]), -1)

        c, sn = cos[:, :, None], sin[:, :, None]
        qn, kn = norm(q, wq), norm(k, wk)
        return qn * c + rot(qn) * sn, kn * c + rot(kn) * sn

    ours = [t.clone().requires_grad_() for t in leaves]
    oq, ok = pt.qk_norm_rope(*ours[:2], cos.float(), sin.float(), *ours[2:])
    torch.autograd.backward((oq, ok), (gq, gk))
    ref = [t.double().requires_grad_() for t in leaves]
    rq, rk = hf(*ref)
    torch.autograd.backward((rq, rk), (gq.double(), gk.double()))
    _ok("q", oq.detach().numpy(), rq.detach().numpy(), "qk_norm_rope", "f32")
    _ok("k", ok.detach().numpy(), rk.detach().numpy(), "qk_norm_rope", "f32")
    for name, a, r in zip(("q", "k", "q_weight", "k_weight"), ours, ref):
        _ok("grad " + name, a.grad.numpy(), r.grad.numpy(), "qk_norm_rope_backward", "f32")


def test_unaligned_inputs_past_head_dim_64_still_take_the_16_byte_norm(monkeypatch) -> None:
    """The norm reduces a head over at most 32 lanes, so head_dim 128 needs the 16-byte path: a q at an odd
    element offset (a valid contiguous view) is copied to an aligned array first, and an unaligned output is an
    ArgumentError naming it."""
    _need("host")
    rng = np.random.default_rng(8)
    q, k, wq, wk = _data(rng, "bf16", (3, 4, 128), 2)
    buf = np.empty(q.size + 1, q.dtype)
    qv = buf[1:].reshape(q.shape)  # 2 bytes past a 16-byte boundary
    qv[...] = q
    assert qv.ctypes.data % 16
    cos, sin = F.rope_tables(8, 128)
    oq, ok = ops.qk_norm_rope(qv, k, cos, sin, q_weight=wq, k_weight=wk, backend="host")
    want = F.np_qk_norm_rope(q, k, cos, sin, wq, wk, 1e-6, 0.0)
    _ok("q", oq, want["q_out"], "qk_norm_rope", "bf16")
    _ok("k", ok, want["k_out"], "qk_norm_rope", "bf16")
    gq, gk = (rng.standard_normal(a.shape).astype(a.dtype) for a in (q, k))
    got = ops.qk_norm_rope_backward(qv, k, gq, gk, cos, sin, wq, wk, backend="host")
    want = F.np_qk_norm_rope_backward(q, k, gq, gk, cos, sin, wq, wk)
    _ok("grad_q", got[0], want["grad_q"], "qk_norm_rope_backward", "bf16")
    _ok("grad_q_weight", got[2], want["grad_q_weight"], "qk_norm_rope_backward", "bf16")
    with pytest.raises(ArgumentError, match="q_out"):
        ops.qk_norm_rope(q, k, cos, sin, q_weight=wq, k_weight=wk, q_out=qv, backend="host")
