"""pykern.torch.moe_route / moe_experts: custom ops with autograd against torch eager references (CPU,
host backend), fake implementations, and torch.compile(fullgraph=True) through forward and backward."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import pykern.torch as pkt  # noqa: E402
from pykern.torch.moe import moe_experts, moe_route  # noqa: E402


def _eager_experts(x, gu, dn, ids, w):
    inter = dn.shape[2]
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if e < 0:
                continue
            h = gu[e] @ x[t]
            out[t] = out[t] + w[t, j] * (dn[e] @ (torch.nn.functional.silu(h[:inter]) * h[inter:]))
    return out


def _inputs(seed=0, t=12, h=16, inter=8, e=4, k=2, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g, dtype=dtype)
    gu = (torch.randn(e, 2 * inter, h, generator=g) / h**0.5).to(dtype)
    dn = (torch.randn(e, h, inter, generator=g) / inter**0.5).to(dtype)
    logits = torch.randn(t, e, generator=g)
    return x, gu, dn, logits


def test_route_and_experts_match_eager_with_gradients() -> None:
    x, gu, dn, logits = _inputs()
    leaves = [a.clone().requires_grad_() for a in (x, gu, dn, logits)]
    w, ids = moe_route(leaves[3], 2)
    assert ids.dtype == torch.int32 and not ids.requires_grad
    out = moe_experts(leaves[0], leaves[1], leaves[2], ids, w)
    dy = torch.randn_like(out)
    (out * dy).sum().backward()

    ref = [a.clone().requires_grad_() for a in (x, gu, dn, logits)]
    p = torch.softmax(ref[3], -1)
    rw, rids = torch.topk(p, 2, -1)
    rw = rw / rw.sum(-1, keepdim=True)
    torch.testing.assert_close(ids.long(), rids)
    rout = _eager_experts(ref[0], ref[1], ref[2], rids, rw)
    (rout * dy).sum().backward()
    torch.testing.assert_close(out, rout, atol=1e-5, rtol=1e-4)
    for a, b in zip(leaves, ref):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-4)


def test_sigmoid_route_gradient_matches_eager() -> None:
    logits = torch.randn(7, 10, generator=torch.Generator().manual_seed(3))
    bias = torch.linspace(-0.5, 0.5, 10)
    a = logits.clone().requires_grad_()
    w, ids = moe_route(a, 3, True, "sigmoid", bias)
    g = torch.randn_like(w)
    (w * g).sum().backward()
    b = logits.clone().requires_grad_()
    s = torch.sigmoid(b)
    sel = s.gather(-1, torch.topk(s.detach() + bias, 3, -1).indices)
    rw = sel / (sel.sum(-1, keepdim=True) + 1e-20)
    (rw * g).sum().backward()
    torch.testing.assert_close(w, rw.detach())
    torch.testing.assert_close(a.grad, b.grad)


def test_bf16_experts_gradients_have_the_weights_dtypes() -> None:
    x, gu, dn, logits = _inputs(dtype=torch.bfloat16)
    w, ids = moe_route(logits, 2)
    leaves = [a.clone().requires_grad_() for a in (x, gu, dn)]
    wl = w.clone().requires_grad_()
    out = moe_experts(*leaves, ids, wl)
    out.float().sum().backward()
    assert out.dtype == torch.bfloat16
    assert [a.grad.dtype for a in leaves] == [torch.bfloat16] * 3 and wl.grad.dtype == torch.float32


def test_compile_fullgraph_traces_forward_and_backward() -> None:
    x, gu, dn, logits = _inputs(seed=5)

    def f(x, gu, dn, logits):
        w, ids = pkt.moe.moe_route(logits, 2)
        return pkt.moe.moe_experts(x, gu, dn, ids, w)

    args = [a.clone().requires_grad_() for a in (x, gu, dn, logits)]
    out = torch.compile(f, fullgraph=True, backend="aot_eager")(*args)
    out.sum().backward()
    eager = [a.clone().requires_grad_() for a in (x, gu, dn, logits)]
    ref = f(*eager)
    ref.sum().backward()
    torch.testing.assert_close(out, ref)
    for a, b in zip(args, eager):
        torch.testing.assert_close(a.grad, b.grad)
