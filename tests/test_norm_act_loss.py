"""The norm / activation / loss family (norm_act_loss.cu, ops/norm_act_loss.py) against torch float64 autograd (and float64 NumPy): cross-entropy options
(label smoothing, z-loss, soft-capping, reductions, in-place gradient, parallel mean), through
pykern.ops on NumPy / torch CPU tensors and through pykern.torch's autograd functions."""
from __future__ import annotations

import numpy as np
import pytest

import pykern
from pykern import ops
from pykern.difftest.cases import training as T
from pykern.errors import ArgumentError
from pykern.tolerance import tolerance

torch = pytest.importorskip("torch")
import pykern.torch as pt  # noqa: E402

F = torch.nn.functional
TORCH_DTYPE = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
NP_DTYPE = {"f32": np.float32, "bf16": None, "f16": np.float16}  # bf16: ml_dtypes, looked up when used


def _np_dtype(kind):
    return pykern.arrays.bfloat16() if kind == "bf16" else NP_DTYPE[kind]


def _close(out, ref, op: str, dtype: str = "f32", what: str = "") -> None:
    atol, rtol = tolerance(op, dtype)
    out = np.asarray(out.detach().double() if torch.is_tensor(out) else out, np.float64)
    ref = np.asarray(ref.detach().double() if torch.is_tensor(ref) else ref, np.float64)
    assert out.shape == ref.shape, (what, out.shape, ref.shape)
    assert np.isfinite(out).all(), f"{op} {what}: non-finite"
    err = np.abs(out - ref)
    bad = err > atol + rtol * np.abs(ref)
    assert not bad.any(), f"{op}/{dtype} {what}: max err {err.max():.3g} at {np.argwhere(bad)[:3].tolist()}"


# --------------------------------------------------------------------------- cross-entropy


def torch_ce_ref(x, t, ignore_index=-100, label_smoothing=0.0, z_loss=0.0, softcap=None, reduction="mean"):
    """torch float64 reference: F.cross_entropy on soft-capped logits + z_loss * lse^2 per live row."""
    z = softcap * torch.tanh(x / softcap) if softcap else x
    live = t != ignore_index
    rows = F.cross_entropy(z, t, ignore_index=ignore_index, reduction="none", label_smoothing=label_smoothing)
    rows = rows + z_loss * torch.logsumexp(z, -1).pow(2) * live
    if reduction == "none":
        return rows
    if reduction == "sum":
        return rows.sum()
    return rows.sum() / live.sum()


OPTS = [
    {},
    {"label_smoothing": 0.1},
    {"z_loss": 1e-3},
    {"softcap": 4.0},
    {"label_smoothing": 0.25, "z_loss": 2e-2, "softcap": 2.5},
]


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("opt", OPTS, ids=lambda o: "-".join(f"{k}{v}" for k, v in o.items()) or "plain")
@pytest.mark.parametrize("dtype", ["f32", "bf16", "f16"])
def test_ce_op_matches_torch_f64_autograd(dtype, opt, reduction):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(7, 37, generator=g) * 3
    if dtype != "f32":
        x = x.to(TORCH_DTYPE[dtype])
    t = torch.randint(0, 37, (7,), generator=g)
    t[[0, 3]] = -100
    loss, grad = ops.cross_entropy_fwd_bwd(x, t, label_smoothing=opt.get("label_smoothing", 0.0),
                                           z_loss=opt.get("z_loss", 0.0), softcap=opt.get("softcap"),
                                           reduction=reduction, backend="host")
    xr = x.double().requires_grad_(True)
    ref = torch_ce_ref(xr, t, reduction=reduction, **opt)
    (rg,) = torch.autograd.grad(ref.sum(), xr)  # "none": the gradient of the sum, as documented
    assert loss.dtype == torch.float32 and grad.dtype == x.dtype and tuple(loss.shape) == tuple(ref.shape)
    _close(loss, ref, "cross_entropy_fwd_bwd", dtype, "loss")
    _close(grad, rg, "cross_entropy_fwd_bwd", dtype, "grad")
    assert float(grad[0].abs().sum()) == 0.0 and (reduction != "none" or float(loss[3]) == 0.0)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_ce_all_ignored_one_row_vocab_1(reduction):
    opt = {"label_smoothing": 0.1, "z_loss": 1e-2, "softcap": 3.0}
    x = np.random.default_rng(2).standard_normal((4, 9)).astype(np.float32)
    loss, grad = ops.cross_entropy_fwd_bwd(x, np.full(4, -100), reduction=reduction, backend="host", **opt)
    assert not np.asarray(loss).any() and not grad.any()
    for shape, tgt in (((1, 50), [7]), ((5, 1), [0, -100, 0, 0, -100])):
        x = np.random.default_rng(3).standard_normal(shape).astype(np.float32)
        t = np.array(tgt)
        loss, grad = ops.cross_entropy_fwd_bwd(x, t, reduction=reduction, backend="host", **opt)
        xr = torch.from_numpy(x).double().requires_grad_(True)
        ref = torch_ce_ref(xr, torch.from_numpy(t), reduction=reduction, **opt)
        (rg,) = torch.autograd.grad(ref.sum(), xr)
        _close(loss, ref, "cross_entropy_fwd_bwd", "f32", f"{shape} loss")
        _close(grad, rg, "cross_entropy_fwd_bwd", "f32", f"{shape} grad")


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_ce_vocab_262144_with_options(dtype):
    rng = np.random.default_rng(4)
    x = (4.0 * rng.standard_normal((2, 262144))).astype(np.float32)
    if dtype == "bf16":
        x = x.astype(pykern.arrays.bfloat16())
    t = np.array([262143, 5])
    opt = {"label_smoothing": 0.1, "z_loss": 1e-3, "softcap": 15.0}
    loss, grad = ops.cross_entropy_fwd_bwd(x, t, backend="host", **opt)
    rl, rg = T.np_cross_entropy(x, t, -100, **opt)
    _close(loss, rl, "cross_entropy_fwd_bwd", dtype, "loss")
    _close(grad.astype(np.float64), rg, "cross_entropy_fwd_bwd", dtype, "grad")


def test_ce_inplace_writes_the_gradient_over_the_logits():
    rng = np.random.default_rng(5)
    for shape in ((6, 40), (3, 41)):  # vector and scalar paths
        x = (3 * rng.standard_normal(shape)).astype(np.float32)
        t = rng.integers(0, shape[1], shape[0])
        t[1] = -100
        loss0, grad0 = ops.cross_entropy_fwd_bwd(x, t, softcap=5.0, label_smoothing=0.1, backend="host")
        buf = x.copy()
        loss1, grad1 = ops.cross_entropy_fwd_bwd(buf, t, softcap=5.0, label_smoothing=0.1, inplace=True,
                                                 backend="host")
        assert grad1 is buf and np.array_equal(grad1, grad0) and float(loss1) == float(loss0)
    tx = torch.randn(4, 16)
    tt = torch.tensor([1, 2, -100, 3])
    ref = ops.cross_entropy_fwd_bwd(tx.clone(), tt, backend="host")
    _, g = ops.cross_entropy_fwd_bwd(tx, tt, inplace=True, backend="host")
    assert g.data_ptr() == tx.data_ptr() and torch.equal(tx, ref[1])
    with pytest.raises(ArgumentError, match="contiguous"):
        ops.cross_entropy_fwd_bwd(np.zeros((8, 4), np.float32)[::2], np.zeros(4, np.int64), inplace=True)


def test_ce_parallel_mean_two_levels_is_deterministic():
    """More rows than one reduce block sums: partial sums then one block, same bits every run."""
    rng = np.random.default_rng(6)
    n = 2 * ops.training.CE_REDUCE_ROWS + 37
    x = (2 * rng.standard_normal((n, 3))).astype(np.float32)
    t = rng.integers(0, 3, n)
    t[::3] = -100
    l1, g1 = ops.cross_entropy_fwd_bwd(x, t, z_loss=1e-3, backend="host")
    l2, _ = ops.cross_entropy_fwd_bwd(x, t, z_loss=1e-3, backend="host")
    rl, rg = T.np_cross_entropy(x, t, -100, z_loss=1e-3)
    assert np.asarray(l1).tobytes() == np.asarray(l2).tobytes()
    _close(l1, rl, "cross_entropy_fwd_bwd", "f32", "loss")
    _close(g1, rg, "cross_entropy_fwd_bwd", "f32", "grad")


def test_ce_rejects_bad_options():
    x, t = np.zeros((2, 3), np.float32), np.zeros(2, np.int64)
    for kw, word in (({"label_smoothing": 1.5}, "label_smoothing"), ({"label_smoothing": -0.1}, "label_smoothing"),
                     ({"z_loss": -1.0}, "z_loss"), ({"z_loss": float("nan")}, "z_loss"),
                     ({"softcap": 0.0}, "softcap"), ({"softcap": -2.0}, "softcap"),
                     ({"reduction": "avg"}, "reduction"), ({"inplace": 1}, "inplace")):
        with pytest.raises(ArgumentError, match=word):
            ops.cross_entropy_fwd_bwd(x, t, **kw)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_pykern_torch_cross_entropy_options_autograd(dtype, reduction):
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(9, 53, generator=g) * 4).to(dtype)
    t = torch.randint(0, 53, (9,), generator=g)
    t[[1, 4]] = -100
    opt = {"label_smoothing": 0.1, "z_loss": 1e-3, "softcap": 6.0}
    up = torch.randn(9, generator=g) if reduction == "none" else torch.tensor(0.7)
    xl = x.detach().requires_grad_(True)
    out = pt.functional.cross_entropy_f32(xl, t, -100, reduction, **opt)
    (gl,) = torch.autograd.grad((out * up).sum(), xl)
    xr = x.double().requires_grad_(True)
    ref = torch_ce_ref(xr, t, reduction=reduction, **opt)
    (rg,) = torch.autograd.grad((ref * up.double()).sum(), xr)
    kind = _kind(dtype)
    _close(out, ref, "cross_entropy_fwd_bwd", kind, "loss")
    _close(gl, rg, "cross_entropy_fwd_bwd", kind, "grad")
    mod = pt.CrossEntropyLoss(reduction=reduction, **opt)
    _close(mod(x.float(), t), torch_ce_ref(x.double(), t, reduction=reduction, **opt), "cross_entropy_fwd_bwd")
    assert torch.isnan(pt.cross_entropy(x.float(), torch.full((9,), -100), label_smoothing=0.1))


# --------------------------------------------------------------------------- norms and GELU (pykern.torch autograd)


def _kind(dtype):
    return {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}[dtype]


def _leaf(t, dtype):
    return t.to(dtype).detach().requires_grad_(True)


def _grads(fn, inputs, ups):
    out = fn(*inputs)
    outs = out if isinstance(out, tuple) else (out,)
    total = sum((o.float() * u.to(o.device).float()).sum() if o.dtype != torch.float64 else (o * u.double()).sum()
                for o, u in zip(outs, ups))
    return outs, torch.autograd.grad(total, [i for i in inputs if i is not None])


DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_autograd_matches_torch_f64(dtype):
    g = torch.Generator().manual_seed(11)
    x, r, w = torch.randn(3, 5, 48, generator=g), torch.randn(3, 5, 48, generator=g), 1 + 0.3 * torch.randn(48, generator=g)
    uy, uh = torch.randn(3, 5, 48, generator=g), torch.randn(3, 5, 48, generator=g)
    eps = 1e-6

    def ref(x, r, w):
        h = x + r
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * w, h

    ins = [_leaf(t, dtype) for t in (x, r, w)]
    outs, gr = _grads(lambda *a: pt.add_rms_norm(*a, eps=eps), ins, (uy, uh))
    routs, rgr = _grads(ref, [_leaf(t.to(dtype), torch.float64) for t in (x, r, w)], (uy, uh))
    k = _kind(dtype)
    for o, ro in zip(outs, routs):
        _close(o, ro, "add_rms_norm", k)
    for gg, rg, nm in zip(gr, rgr, ("x", "residual", "weight")):
        _close(gg, rg, "add_rms_norm_backward", k, nm)
    assert torch.equal(gr[0], gr[1])  # one gradient path


def test_add_rms_norm_inplace_and_deterministic_weight_grad():
    rng = np.random.default_rng(12)
    x, r = rng.standard_normal((70, 33)).astype(np.float32), rng.standard_normal((70, 33)).astype(np.float32)
    w = rng.standard_normal(33).astype(np.float32)
    y0, h0 = ops.add_rms_norm(x, r, w, backend="host")
    xi, ri = x.copy(), r.copy()
    y1, h1 = ops.add_rms_norm(xi, ri, w, inplace=True, backend="host")
    assert y1 is xi and h1 is ri and np.array_equal(y1, y0) and np.array_equal(h1, h0)
    ry, rh = T.np_add_rms_norm(x, r, w) if hasattr(T, "np_add_rms_norm") else (None, None)
    from pykern.difftest.cases import norm_act_loss as E

    ry, rh = E.np_add_rms_norm(x, r, w)
    _close(y0, ry, "add_rms_norm")
    g = rng.standard_normal((70, 33)).astype(np.float32)
    a = ops.add_rms_norm_backward(h0, w, g, None, backend="host")
    b = ops.add_rms_norm_backward(h0, w, g, None, backend="host")
    assert a[1].tobytes() == b[1].tobytes()
    _close(a[1], E.np_add_rms_norm_backward(h0, w, g)[1], "add_rms_norm_backward")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("has_w,has_b", [(True, True), (False, False), (True, False), (False, True)])
def test_layer_norm_autograd_matches_torch_f64(dtype, has_w, has_b):
    g = torch.Generator().manual_seed(13)
    x = torch.randn(4, 3, 40, generator=g) + 3.0
    w, b = 1 + 0.3 * torch.randn(40, generator=g), 0.5 * torch.randn(40, generator=g)
    up = torch.randn(4, 3, 40, generator=g)
    xs = _leaf(x, dtype)
    ws, bs = (_leaf(w, dtype) if has_w else None), (_leaf(b, dtype) if has_b else None)
    (out,), gr = _grads(lambda x, w, b: pt.layer_norm(x, w, b, 1e-5), [xs, ws, bs], (up,))
    xr = _leaf(x.to(dtype), torch.float64)
    wr = _leaf(w.to(dtype), torch.float64) if has_w else None
    br = _leaf(b.to(dtype), torch.float64) if has_b else None
    (rout,), rgr = _grads(lambda x, w, b: F.layer_norm(x, (40,), w, b, 1e-5), [xr, wr, br], (up,))
    k = _kind(dtype)
    _close(out, rout, "layer_norm", k)
    assert len(gr) == len(rgr)
    for gg, rg in zip(gr, rgr):
        _close(gg, rg, "layer_norm_backward", k)


def test_layer_norm_one_row_dim_1_and_deterministic():
    x = np.array([[2.5]], np.float32)
    np.testing.assert_array_equal(ops.layer_norm(x, backend="host"), [[0.0]])
    rng = np.random.default_rng(14)
    x, g = rng.standard_normal((600, 17)).astype(np.float32), rng.standard_normal((600, 17)).astype(np.float32)
    w = rng.standard_normal(17).astype(np.float32)
    r1 = ops.layer_norm_backward(x, w, g, backend="host")
    r2 = ops.layer_norm_backward(x, w, g, backend="host")
    assert all(a.tobytes() == b.tobytes() for a, b in zip(r1, r2))
    from pykern.difftest.cases import norm_act_loss as E

    for out, ref, nm in zip(r1, E.np_layer_norm_backward(x, w, g), ("gx", "gw", "gb")):
        _close(out, ref, "layer_norm_backward", "f32", nm)
    assert ops.layer_norm_backward(x, None, g, bias=False, backend="host")[1:] == (None, None)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_and_gelu_gate_autograd_match_torch_f64(dtype, approximate):
    g = torch.Generator().manual_seed(15)
    a, u, up = (torch.randn(6, 45, generator=g) * 3 for _ in range(3))
    k = _kind(dtype)
    (out,), (ga,) = _grads(lambda a: pt.gelu(a, approximate), [_leaf(a, dtype)], (up,))
    (rout,), (rga,) = _grads(lambda a: F.gelu(a, approximate=approximate), [_leaf(a.to(dtype), torch.float64)], (up,))
    _close(out, rout, "gelu", k)
    _close(ga, rga, "gelu_backward", k)
    (out,), (gg, gu) = _grads(lambda a, u: pt.gelu_gate(a, u, approximate), [_leaf(a, dtype), _leaf(u, dtype)], (up,))
    (rout,), (rgg, rgu) = _grads(lambda a, u: F.gelu(a, approximate=approximate) * u,
                                 [_leaf(a.to(dtype), torch.float64), _leaf(u.to(dtype), torch.float64)], (up,))
    _close(out, rout, "gelu_gate", k)
    _close(gg, rgg, "gelu_gate_backward", k, "gate")
    _close(gu, rgu, "gelu_gate_backward", k, "up")


# The exact form's Phi (kernels_cu/norm_act_loss.cu, pk_gelu_tail): one ex2 of a degree-7 fit instead of erff.
# Against float64 over a dense sweep (host backend: its ex2 is exp2f, the GPU's ex2.approx adds <= 2^-22 relative):
GELU_PHI_MAX_ABS_ERR = 3.1e-7  # |Phi(x) - Phi_exact(x)| over the reals (the fit's weighted minimax bound: 3.0e-7)
GELU_TAIL_MAX_REL_ERR = 2.5e-4  # |gelu(x) / gelu_exact(x) - 1| while Phi(x) >= 1e-8 (x >= -5.6): no 1 + erf cancel


def _phi64(x: np.ndarray) -> np.ndarray:
    from math import erfc, sqrt
    return np.array([0.5 * erfc(-v / sqrt(2.0)) for v in x.astype(np.float64)])


def test_gelu_exact_form_error_against_float64() -> None:
    x = np.concatenate([np.linspace(-12.0, 12.0, 200_001), np.float32([0.0, -0.0, 1e-30, -1e-30, 6.0, -6.0])])
    x = x.astype(np.float32)
    phi = _phi64(x)
    y = np.asarray(ops.gelu(x, "none", backend="host"), np.float64)
    dy = np.asarray(ops.gelu_backward(x, np.ones_like(x), "none", backend="host"), np.float64)
    xd = x.astype(np.float64)
    # gelu = x * Phi: its error over |x| bounds Phi's (plus the product's rounding, 2^-24 relative)
    err = np.abs(y - xd * phi) - np.abs(y) * 2.0 ** -24
    assert np.all(err <= np.abs(xd) * GELU_PHI_MAX_ABS_ERR), float(np.max(err / np.maximum(np.abs(xd), 1e-30)))
    tail = (phi >= 1e-8) & (xd < 0)
    rel = np.abs(y[tail] / (xd[tail] * phi[tail]) - 1.0)
    assert rel.max() <= GELU_TAIL_MAX_REL_ERR, (float(rel.max()), float(x[tail][rel.argmax()]))
    # gelu' = Phi + x phi(x): Phi's bound plus the Gaussian term's ex2 (relative 2^-22 of |x| phi(x) <= 0.25)
    dref = phi + xd * np.exp(-0.5 * xd * xd) / np.sqrt(2.0 * np.pi)
    assert np.max(np.abs(dy - dref)) <= GELU_PHI_MAX_ABS_ERR + 2e-7, float(np.max(np.abs(dy - dref)))
    assert np.all(np.isfinite(y)) and np.all(np.isfinite(dy))
    special = np.float32([np.inf, np.nan, -20.0, 20.0])
    ys = np.asarray(ops.gelu(special, "none", backend="host"))
    assert ys[0] == np.inf and np.isnan(ys[1]) and ys[2] == 0.0 and ys[3] == 20.0


# The tanh form (kernels_cu/norm_act_loss.cu, pk_gelu_tanh_s): s = 0.5 (1 + tanh u) = 1 / (1 + 2^(-2u log2 e)) by one
# ex2 and one reciprocal instead of tanhf. Against float64 over a dense sweep (host backend: exp2f and an exact
# division; the GPU's ex2.approx and rcp.approx add <= 2^-22 and 2^-23 relative to s):
GELU_TANH_MAX_ABS_ERR = 6e-7       # |gelu - gelu64| over the reals (5.2e-7 measured, at x ~ 2: x s rounds twice)
GELU_TANH_TAIL_MAX_REL_ERR = 1e-5  # |gelu / gelu64 - 1| while |gelu64| >= 1e-30 (x >= -9.3; 8.1e-6 measured at
#                                    x ~ -9.3: fp32 rounding of the ex2 argument, ~ 100 there, times ln 2)
GELU_TANH_GRAD_MAX_ABS_ERR = 2.5e-7  # |gelu' - gelu'64| over the reals (1.9e-7 measured)


def _gelu_tanh64(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(gelu, gelu') of the tanh form in float64, with 0.5 (1 + tanh u) as 1 / (1 + e^-2u): 1 + tanh u itself
    cancels in float64 for u < -19, which would make the reference, not the kernel, wrong in the tail."""
    xd = x.astype(np.float64)
    u = np.sqrt(2.0 / np.pi) * (xd + 0.044715 * xd**3)
    with np.errstate(over="ignore"):
        s = 1.0 / (1.0 + np.exp(-2.0 * u))
    return xd * s, s + xd * 2.0 * s * (1.0 - s) * np.sqrt(2.0 / np.pi) * (1.0 + 3.0 * 0.044715 * xd * xd)


def test_gelu_tanh_form_error_against_float64() -> None:
    x = np.concatenate([np.linspace(-12.0, 12.0, 200_001),
                        np.float32([0.0, -0.0, 1e-30, -1e-30, 1e-4, -1e-4, 30.0, -30.0])]).astype(np.float32)
    ref, dref = _gelu_tanh64(x)
    y = np.asarray(ops.gelu(x, "tanh", backend="host"), np.float64)
    dy = np.asarray(ops.gelu_backward(x, np.ones_like(x), "tanh", backend="host"), np.float64)
    assert np.max(np.abs(y - ref)) <= GELU_TANH_MAX_ABS_ERR, float(np.max(np.abs(y - ref)))
    tail = np.abs(ref) >= 1e-30  # near 0 and in the x < 0 tail gelu keeps its relative accuracy: no cancellation
    rel = np.abs(y[tail] / ref[tail] - 1.0)
    assert rel.max() <= GELU_TANH_TAIL_MAX_REL_ERR, (float(rel.max()), float(x[tail][rel.argmax()]))
    assert np.max(np.abs(dy - dref)) <= GELU_TANH_GRAD_MAX_ABS_ERR, float(np.max(np.abs(dy - dref)))
    assert np.all(np.isfinite(y)) and np.all(np.isfinite(dy))
    # gelu_gate_backward forms both from one s: grad_up = gelu(gate), grad_gate = gelu'(gate) (up = grad = 1)
    one = np.ones_like(x)
    gg, gu = (np.asarray(a, np.float64) for a in ops.gelu_gate_backward(x, one, one, "tanh", backend="host"))
    np.testing.assert_array_equal(gu, y)
    np.testing.assert_array_equal(gg, dy)
    # Large |x| as torch's: gelu(-inf) = -inf * 0 = NaN, gelu'(+-inf) NaN (x * 0), no NaN for finite x.
    special = np.float32([np.inf, -np.inf, np.nan, -20.0, 20.0, -1e20, 1e20])
    ys = np.asarray(ops.gelu(special, "tanh", backend="host"))
    ds = np.asarray(ops.gelu_backward(special, np.ones_like(special), "tanh", backend="host"))
    np.testing.assert_array_equal(ys, np.float32([np.inf, np.nan, np.nan, -0.0, 20.0, -0.0, 1e20]))
    np.testing.assert_array_equal(ds, np.float32([np.nan, np.nan, np.nan, 0.0, 1.0, 0.0, 1.0]))


def test_new_ops_reject_bad_arguments():
    x = np.zeros((2, 4), np.float32)
    with pytest.raises(ArgumentError, match="approximate"):
        ops.gelu(x, "fast")
    with pytest.raises(ArgumentError, match="up"):
        ops.gelu_gate(x, np.zeros((2, 5), np.float32))
    with pytest.raises(ArgumentError, match="weight"):
        ops.layer_norm(x, np.zeros(5, np.float32))
    with pytest.raises(ArgumentError, match="eps"):
        ops.add_rms_norm(x, x, np.zeros(4, np.float32), -1.0)
    with pytest.raises(ArgumentError, match="residual"):
        ops.add_rms_norm(x, np.zeros((3, 4), np.float32), np.zeros(4, np.float32))


# --------------------------------------------------------------------------- fused linear cross-entropy


def _flce_ref(h, w, t, b=None, reduction="mean", **opt):
    logits = h @ w.T + (b if b is not None else 0)
    return torch_ce_ref(logits, t, reduction=reduction, **opt)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("opt", OPTS[:1] + OPTS[-1:], ids=["plain", "all_options"])
@pytest.mark.parametrize("dtype", ["f32", "bf16", "f16"])
@pytest.mark.parametrize("frame", ["numpy", "torch"])
def test_flce_op_matches_torch_f64_autograd(frame, dtype, opt, reduction):
    g = torch.Generator().manual_seed(21)
    n, hd, v = 11, 24, 37
    h, w, b = torch.randn(n, hd, generator=g), torch.randn(v, hd, generator=g) * 0.5, torch.randn(v, generator=g)
    t = torch.randint(0, v, (n,), generator=g)
    t[[2, 5]] = -100
    tdt = TORCH_DTYPE[dtype]
    h, w, b = h.to(tdt), w.to(tdt), b.to(tdt)
    conv = (lambda a: a) if frame == "torch" else (lambda a: a.float().numpy().astype(_np_dtype(dtype)))
    kw = dict(label_smoothing=opt.get("label_smoothing", 0.0), z_loss=opt.get("z_loss", 0.0),
              softcap=opt.get("softcap"), reduction=reduction, chunk_size=4)
    loss, gh, gw, gb = ops.fused_linear_cross_entropy(conv(h), conv(w), t if frame == "torch" else t.numpy(),
                                                      conv(b), backend="host", **kw)
    ins = [_leaf(a, torch.float64) for a in (h, w, b)]
    ref = _flce_ref(*ins[:2], t, ins[2], reduction=reduction, **opt)
    rgh, rgw, rgb = torch.autograd.grad(ref.sum(), ins)
    atol, rtol = tolerance("fused_linear_cross_entropy", dtype)
    _close(np.asarray(loss.float() if frame == "torch" else loss), ref, "fused_linear_cross_entropy", dtype, "loss")
    for got, want, nm in ((gh, rgh, "grad_hidden"), (gw, rgw, "grad_weight"), (gb, rgb, "grad_bias")):
        # the float32 accumulators are the outputs, for bf16 inputs too
        assert got.dtype == (torch.float32 if frame == "torch" else np.float32), (nm, got.dtype)
        _close(got, want, "fused_linear_cross_entropy", dtype, nm)


@pytest.mark.parametrize("dtype", ["f32", "bf16", "f16"])
@pytest.mark.parametrize("frame", ["numpy", "torch"])
def test_flce_grad_dtype_input_casts_the_float32_gradients(frame, dtype):
    g = torch.Generator().manual_seed(24)
    tdt = TORCH_DTYPE[dtype]
    h, w, b = torch.randn(9, 16, generator=g), torch.randn(21, 16, generator=g) * 0.5, torch.randn(21, generator=g)
    t = torch.randint(0, 21, (9,), generator=g)
    t[4] = -100
    ins = [a.to(tdt) for a in (h, w, b)]
    if frame == "numpy":
        ins = [a.float().numpy().astype(_np_dtype(dtype)) for a in ins]
        t = t.numpy()
    kw = dict(z_loss=1e-3, chunk_size=4, backend="host")
    loss32, *g32 = ops.fused_linear_cross_entropy(*ins[:2], t, ins[2], **kw)
    loss_in, *g_in = ops.fused_linear_cross_entropy(*ins[:2], t, ins[2], grad_dtype="input", **kw)
    assert float(loss32) == float(loss_in)
    for a32, a_in, x in zip(g32, g_in, (ins[0], ins[1], ins[2])):
        assert a_in.dtype == x.dtype and a32.dtype == (torch.float32 if frame == "torch" else np.float32)
        # "input" is exactly the float32 result rounded once at the end (nothing accumulated in bf16)
        want = a32.to(x.dtype) if frame == "torch" else a32.astype(x.dtype)
        if frame == "torch":
            assert torch.equal(a_in, want)
        else:
            np.testing.assert_array_equal(np.asarray(a_in, np.float32), np.asarray(want, np.float32))
    with pytest.raises(ArgumentError, match="grad_dtype"):
        ops.fused_linear_cross_entropy(*ins[:2], t, grad_dtype="bf16")


def test_flce_blocked_accumulation_matches_the_product():
    """The row-block accumulation CuPy shares with NumPy (acc += a @ b through one (block, cols)
    buffer), run here with NumPy: every block size, ragged last block, transposed operand."""
    from pykern.ops.norm_act_loss import _Frame, flce_block_rows

    rng = np.random.default_rng(26)
    g, hc = rng.standard_normal((5, 23)).astype(np.float32), rng.standard_normal((5, 7)).astype(np.float32)
    fw = _Frame(g, None)
    fw.kind = "cupy"  # the CuPy branch, with NumPy as its array module
    for block in (1, 4, 22, 23, 64):
        acc = rng.standard_normal((23, 7)).astype(np.float32)
        want = acc.astype(np.float64) + g.T.astype(np.float64) @ hc
        fw.addmm(acc, g.T, hc, block)
        np.testing.assert_allclose(acc, want, rtol=1e-5, atol=1e-5)
    assert flce_block_rows(8, 1000, 256) == 32 and flce_block_rows(256, 128256, 4096) == 8016
    assert flce_block_rows(1, 5, 4096) == 5


def test_flce_float32_out_matmuls_only_for_half_operands_on_a_gpu():
    """The tensor-core float32-output matmuls (mm / addmm with out_dtype) exist in torch for CUDA only: torch CPU
    tensors, float32 operands and NumPy keep the float32-copy path the tests above check."""
    from pykern.ops.norm_act_loss import _Frame

    for a in (torch.zeros(2, 2, dtype=torch.bfloat16), torch.zeros(2, 2), np.zeros((2, 2), np.float32)):
        assert not _Frame(a, None).float32_out_matmuls(a)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bf16", "f16"])
def test_flce_torch_cuda_half_matches_torch_f64_autograd(dtype):
    """bf16 / f16 on a GPU: the products come out of the tensor cores in float32 (no float32 copies of the
    operands), with several chunks accumulating into grad_weight and a bias."""
    from pykern.ops.norm_act_loss import _Frame

    g = torch.Generator().manual_seed(29)
    n, hd, v = 300, 64, 1000
    tdt = TORCH_DTYPE[dtype]
    h, w = torch.randn(n, hd, generator=g).to(tdt), (torch.randn(v, hd, generator=g) * 0.2).to(tdt)
    b = torch.randn(v, generator=g).to(tdt)
    t = torch.randint(0, v, (n,), generator=g)
    t[::7] = -100
    dev = [a.cuda() for a in (h, w, b, t)]
    if hasattr(torch.ops.aten.addmm, "dtype_out"):
        assert _Frame(dev[0], None).float32_out_matmuls(dev[0])
    loss, gh, gw, gb = ops.fused_linear_cross_entropy(*dev[:2], dev[3], dev[2], chunk_size=128)
    ins = [_leaf(a, torch.float64) for a in (h, w, b)]
    ref = _flce_ref(*ins[:2], t, ins[2])
    rgh, rgw, rgb = torch.autograd.grad(ref.sum(), ins)
    _close(loss.float().cpu(), ref, "fused_linear_cross_entropy", dtype, "loss")
    for got, want, nm in ((gh, rgh, "grad_hidden"), (gw, rgw, "grad_weight"), (gb, rgb, "grad_bias")):
        assert got.dtype == torch.float32 and got.is_cuda, (nm, got.dtype)
        _close(got.cpu(), want, "fused_linear_cross_entropy", dtype, nm)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_flce_numpy_peak_extra_memory_is_chunk_by_vocab(dtype):
    """tracemalloc over the NumPy path: beyond its float32 outputs the call allocates O(chunk x V) +
    O(chunk x H), not a (V, H) temporary (the shape makes V x H 32x chunk x V)."""
    import tracemalloc

    from pykern.ops.norm_act_loss import flce_block_rows

    n, hd, v, chunk = 64, 256, 1000, 8
    rng = np.random.default_rng(25)
    npdt = np.float32 if dtype == "f32" else pykern.arrays.bfloat16()
    h = rng.standard_normal((n, hd)).astype(npdt)
    w = (rng.standard_normal((v, hd)) / 16).astype(npdt)
    b = rng.standard_normal(v).astype(npdt)
    t = rng.integers(0, v, n)
    t[::3] = -100
    run = lambda: ops.fused_linear_cross_entropy(h, w, t, b, chunk_size=chunk, backend="host")  # noqa: E731
    run()  # kernel build and caches are not the op's memory
    tracemalloc.start()
    try:
        out = run()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    outputs = sum(np.asarray(a).nbytes for a in out)
    assert outputs == (n * hd + v * hd + v) * 4 + 4
    blk = flce_block_rows(chunk, v, hd)
    assert blk * hd <= max(chunk * v, 32 * hd)
    # logits (chunk, V) + the host backend's staging of them + one float32 (chunk, V) block, two
    # (block, H) and four (chunk, H) float32 buffers, per-row losses and targets, 32 KiB of bookkeeping
    bound = 3 * chunk * v * 4 + 2 * blk * hd * 4 + 4 * chunk * hd * 4 + n * 16 + 32 * 1024
    assert peak - outputs <= bound, (peak - outputs, bound)
    assert bound < v * hd * 4 / 3  # the bound is far below one (V, H) float32 temporary
    ref = _flce_ref(*(torch.from_numpy(np.asarray(a, np.float64)) for a in (h, w)), torch.from_numpy(t),
                    torch.from_numpy(np.asarray(b, np.float64)))
    _close(out[0], ref, "fused_linear_cross_entropy", dtype, "loss")
    if dtype == "bf16":  # grad_dtype="input" casts one gradient at a time: its float32 copy is the peak
        tracemalloc.start()
        try:
            out = ops.fused_linear_cross_entropy(h, w, t, b, chunk_size=chunk, backend="host", grad_dtype="input")
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        outputs = sum(np.asarray(a).nbytes for a in out)
        assert outputs == (n * hd + v * hd + v) * 2 + 4
        cast_peak = max(n * hd * 4 + v * hd * 2, v * hd * 4) + v * 2
        assert peak - outputs <= max(bound, cast_peak + 32 * 1024), (peak - outputs, cast_peak)


def test_flce_edges_all_ignored_one_row_vocab_1_chunks():
    rng = np.random.default_rng(22)
    h, w = rng.standard_normal((5, 8)).astype(np.float32), rng.standard_normal((6, 8)).astype(np.float32)
    loss, gh, gw, gb = ops.fused_linear_cross_entropy(h, w, np.full(5, -100), backend="host")
    assert float(loss) == 0.0 and not gh.any() and not gw.any() and gb is None
    for n, v, chunk in ((1, 9, None), (5, 1, 2), (7, 13, 1), (7, 13, 100)):
        h = rng.standard_normal((n, 8)).astype(np.float32)
        w = rng.standard_normal((v, 8)).astype(np.float32)
        t = rng.integers(0, v, n)
        loss, gh, gw, _ = ops.fused_linear_cross_entropy(h, w, t, z_loss=1e-2, chunk_size=chunk, backend="host")
        ins = [torch.from_numpy(a).double().requires_grad_(True) for a in (h, w)]
        ref = _flce_ref(*ins, torch.from_numpy(t), z_loss=1e-2)
        rgh, rgw = torch.autograd.grad(ref, ins)
        _close(loss, ref, "fused_linear_cross_entropy", "f32", f"{n}x{v} loss")
        _close(gh, rgh, "fused_linear_cross_entropy", "f32", f"{n}x{v} gh")
        _close(gw, rgw, "fused_linear_cross_entropy", "f32", f"{n}x{v} gw")
    with pytest.raises(ArgumentError, match="targets"):
        ops.fused_linear_cross_entropy(h, w, np.full(7, 13))
    with pytest.raises(ArgumentError, match="chunk_size"):
        ops.fused_linear_cross_entropy(h, w, t, chunk_size=0)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_pykern_torch_flce_autograd(dtype, reduction):
    g = torch.Generator().manual_seed(23)
    h, w, b = torch.randn(10, 16, generator=g), torch.randn(29, 16, generator=g) * 0.5, torch.randn(29, generator=g)
    t = torch.randint(0, 29, (10,), generator=g)
    t[3] = -100
    opt = {"label_smoothing": 0.1, "z_loss": 1e-3, "softcap": 8.0}
    ins = [_leaf(a, dtype) for a in (h, w, b)]
    loss = pt.fused_linear_cross_entropy(*ins[:2], t, ins[2], reduction=reduction, chunk_size=3, **opt)
    gr = torch.autograd.grad(loss * 0.7, ins)
    rins = [_leaf(a.to(dtype), torch.float64) for a in (h, w, b)]
    ref = _flce_ref(*rins[:2], t, rins[2], reduction=reduction, **opt)
    rgr = torch.autograd.grad(ref * 0.7, rins)
    k = _kind(dtype)
    _close(loss, ref, "fused_linear_cross_entropy", k, "loss")
    for a, r, nm in zip(gr, rgr, ("hidden", "weight", "bias")):
        assert a.dtype == dtype
        _close(a, r, "fused_linear_cross_entropy", k, nm)
    assert torch.isnan(pt.fused_linear_cross_entropy(ins[0], ins[1], torch.full((10,), -100)))


def test_new_custom_ops_pass_torch_library_opcheck():
    g = torch.Generator().manual_seed(31)
    r = lambda *s: torch.randn(*s, generator=g, requires_grad=True)  # noqa: E731
    torch.library.opcheck(torch.ops.pykern.cross_entropy.default,
                          (r(5, 7), torch.tensor([1, -100, 6, 0, 2]), -100, "mean", 0.1, 1e-3, 4.0))
    torch.library.opcheck(torch.ops.pykern.add_rms_norm.default, (r(3, 8), r(3, 8), r(8), 1e-6))
    torch.library.opcheck(torch.ops.pykern.layer_norm.default, (r(3, 8), r(8), r(8), 1e-5))
    torch.library.opcheck(torch.ops.pykern.layer_norm.default, (r(3, 8), None, None, 1e-5))
    torch.library.opcheck(torch.ops.pykern.gelu.default, (r(3, 8), "tanh"))
    torch.library.opcheck(torch.ops.pykern.gelu_gate.default, (r(3, 8), r(3, 8), "none"))
    torch.library.opcheck(torch.ops.pykern.fused_linear_cross_entropy.default,
                          (r(6, 8), r(11, 8), torch.tensor([1, -100, 6, 0, 2, 10]), r(11), -100, 0.1, 1e-3, 0.0,
                           "mean", 4))


# --------------------------------------------------------------------------- torch tensors in, torch tensors out


def _tensor_cases(dt):
    from test_torch_ops import _f

    f = lambda *s: _f(s, dt)  # noqa: E731
    t = np.array([[3, -100, 0], [12, 5, -100]], np.int64)
    return [
        ("cross_entropy_opts", lambda x, t: ops.cross_entropy_fwd_bwd(x, t, label_smoothing=0.1, z_loss=1e-3,
                                                                      softcap=5.0, reduction="none"),
         [f(2, 3, 13), t], [0]),
        ("add_rms_norm", lambda x, r, w: ops.add_rms_norm(x, r, w), [f(3, 40), f(3, 40), f(40)], [0, 1, 2]),
        ("add_rms_norm_backward", lambda h, w, g, gr: ops.add_rms_norm_backward(h, w, g, gr),
         [f(70, 9), f(9), f(70, 9), f(70, 9)], [0, 1, 2, 3]),
        ("layer_norm", lambda x, w, b: ops.layer_norm(x, w, b), [f(3, 40), f(40), f(40)], [0, 1, 2]),
        ("layer_norm_backward", lambda x, w, g: ops.layer_norm_backward(x, w, g), [f(70, 9), f(9), f(70, 9)],
         [0, 1, 2]),
        ("gelu", lambda x: ops.gelu(x), [f(3, 7)], [0]),
        ("gelu_backward", lambda x, g: ops.gelu_backward(x, g, "tanh"), [f(3, 7), f(3, 7)], [0, 1]),
        ("gelu_gate", lambda a, b: ops.gelu_gate(a, b, "tanh"), [f(3, 7), f(3, 7)], [0, 1]),
        ("gelu_gate_backward", lambda a, b, g: ops.gelu_gate_backward(a, b, g), [f(3, 7), f(3, 7), f(3, 7)],
         [0, 1, 2]),
        ("fused_linear_cross_entropy", lambda h, w, t, b: ops.fused_linear_cross_entropy(h, w, t, b, chunk_size=2),
         [f(6, 8), f(13, 8), t.reshape(-1), f(13)], [0, 1, 3]),
    ]


@pytest.mark.parametrize("how", ["plain", "strided_grad"])
@pytest.mark.parametrize("dt", ["f32", "bf16"])
@pytest.mark.parametrize("op", [c[0] for c in _tensor_cases(np.float32)])
def test_new_ops_torch_cpu_equal_numpy(op, dt, how):
    """Each new op on torch CPU tensors (also strided, requires_grad) returns torch tensors with the
    same bits as on NumPy, and never writes its inputs."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from test_torch_ops import BF16, as_np, kinds, to_torch, variant

    dtype = np.float32 if dt == "f32" else BF16
    _, fn, args, float_idx = next(c for c in _tensor_cases(dtype) if c[0] == op)
    ref = fn(*args)
    targs = [variant(a, how) if i in float_idx else to_torch(a) for i, a in enumerate(args)]
    snapshot = [x.detach().clone() for x in targs]
    got = fn(*targs)
    assert all(k is torch.Tensor for k in kinds(got) if k is not type(None)), kinds(got)
    r, g = (ref, as_np(got)) if isinstance(ref, (tuple, list)) else ([ref], [as_np(got)])
    for a, b in zip(r, g):
        a, b = np.asarray(a), np.asarray(b)
        assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
        if op == "fused_linear_cross_entropy":  # the matmuls are each framework's own: not bit-equal
            _close(b.astype(np.float64), a.astype(np.float64), op, dt)
            continue
        np.testing.assert_array_equal(a.view(np.uint16) if a.dtype == BF16 else a,
                                      b.view(np.uint16) if b.dtype == BF16 else b)
    for x, s in zip(targs, snapshot):
        assert torch.equal(x.detach(), s)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_flce_vocab_262144(dtype):
    g = torch.Generator().manual_seed(41)
    tdt = torch.float32 if dtype == "f32" else torch.bfloat16
    h, w = torch.randn(3, 4, generator=g).to(tdt), torch.randn(262144, 4, generator=g).to(tdt)
    t = torch.tensor([262143, -100, 7])
    opt = {"label_smoothing": 0.1, "z_loss": 1e-3, "softcap": 15.0}
    loss, gh, gw, _ = ops.fused_linear_cross_entropy(h, w, t, chunk_size=2, backend="host", **opt)
    ins = [_leaf(a, torch.float64) for a in (h, w)]
    ref = _flce_ref(*ins, t, **opt)
    rgh, rgw = torch.autograd.grad(ref, ins)
    _close(loss, ref, "fused_linear_cross_entropy", dtype, "loss")
    _close(gh.float(), rgh, "fused_linear_cross_entropy", dtype, "grad_hidden")
    _close(gw.float(), rgw, "fused_linear_cross_entropy", dtype, "grad_weight")


def test_layer_norm_geometry_fits_the_register_cache():
    """rms_norm's shapes (warp per row for <= 64 chunks), and enough threads (<= 512) for <= LN_CACHE_VECS
    16-byte vectors a thread: the difftest rows 8192 f32 / 16384 bf16 are cached, 8196 / 16392 are not."""
    from pathlib import Path

    from pykern.ops.norm_act_loss import _LN_CACHE_VECS, _ln_geometry

    assert _ln_geometry(1000, 40, "f32") == ((125,), (32, 8))
    assert _ln_geometry(8192, 4096, "bf16") == ((8192,), (128, 1))
    assert _ln_geometry(8192, 4096, "f32") == ((8192,), (256, 1))
    for kind, cached, uncached in (("f32", 8192, 8196), ("bf16", 16384, 16392)):
        per = 4 if kind == "f32" else 8
        threads = _ln_geometry(2, cached, kind)[1][0]
        assert threads == 512 and cached // per <= _LN_CACHE_VECS * threads
        threads = _ln_geometry(2, uncached, kind)[1][0]
        assert threads == 512 and uncached // per > _LN_CACHE_VECS * threads
    cu = (Path(__file__).resolve().parents[1] / "kernels_cu" / "norm_act_loss.cu").read_text()
    assert f"#define LN_CACHE_VECS {_LN_CACHE_VECS}\n" in cu  # the op's copy of the kernel's constant


def test_layer_norm_backward_fuses_the_weight_gradient(monkeypatch):
    """Rows of whole 16-byte chunks beyond a warp's 64 and up to LNB_FUSE_VECS x 512 chunks: one row kernel of one
    wave of blocks (512 threads' worth an SM of 132) sums the weight / bias gradients in registers, and
    norm_grad_reduce adds its partial rows; norm_weight_grad (a second read of x and g) is not launched. A
    misaligned x or g takes the element path of the same kernel: bit-identical results."""
    from pathlib import Path

    from pykern.difftest.cases import norm_act_loss as E
    from pykern.ops import norm_act_loss as m

    assert m._lnb_fused_geometry(8192, 4096, "bf16") == ((264,), (256, 1))
    assert m._lnb_fused_geometry(8192, 4096, "f32") == ((132,), (512, 1))
    assert m._lnb_fused_geometry(8192, 1024, "bf16") == ((528,), (128, 1))
    assert m._lnb_fused_geometry(8192, 512, "bf16") is None  # 64 chunks: a warp per row
    assert m._lnb_fused_geometry(8192, 4100, "f32") is None  # 1025 chunks: more than 2 a thread of 512
    assert m._lnb_fused_geometry(8192, 4098, "bf16") is None  # not whole chunks
    cu = (Path(__file__).resolve().parents[1] / "kernels_cu" / "norm_act_loss.cu").read_text()
    assert f"#define LNB_FUSE_VECS {m._LNB_FUSE_VECS}\n" in cu

    from pykern.ops import _common

    seen = []
    real = _common.launch
    record = lambda name, *a, **k: (seen.append(name), real(name, *a, **k))[1]  # noqa: E731
    monkeypatch.setattr(m, "launch", record)
    monkeypatch.setattr(_common, "launch", record)  # sum_chunks' norm_grad_reduce
    rng = np.random.default_rng(43)
    rows, dim = 700, 1024  # 256 chunks: 128 threads, 528 blocks, some summing two rows
    x = (rng.standard_normal((rows, dim)) + 2.0).astype(np.float32)
    g = rng.standard_normal((rows, dim)).astype(np.float32)
    w = (1.0 + 0.3 * rng.standard_normal(dim)).astype(np.float32)
    out = ops.layer_norm_backward(x, w, g, backend="host")
    assert seen == ["layer_norm_backward", "norm_grad_reduce", "norm_grad_reduce"], seen
    for o, ref, nm in zip(out, E.np_layer_norm_backward(x, w, g), ("gx", "gw", "gb")):
        _close(o, ref, "layer_norm_backward", "f32", nm)
    # the same values 4 bytes off a 16-byte boundary: the element path, the same sums in the same order
    buf = np.empty(2 * rows * dim + 1, np.float32)
    xs, gs = buf[1:rows * dim + 1].reshape(rows, dim), buf[rows * dim + 1:].reshape(rows, dim)
    xs[...], gs[...] = x, g
    assert xs.ctypes.data % 16 and gs.ctypes.data % 16
    for a, b in zip(out, ops.layer_norm_backward(xs, w, gs, backend="host")):
        np.testing.assert_array_equal(a, b)
    seen.clear()
    gx, gw, gb = ops.layer_norm_backward(x, None, g, bias=True, backend="host")  # bias alone
    assert gw is None and seen == ["layer_norm_backward", "norm_grad_reduce"], seen
    np.testing.assert_array_equal(gb, out[2])


def test_add_rms_norm_backward_fuses_the_weight_gradient(monkeypatch):
    """layer_norm_backward's fused geometry: one row kernel summing h * r * grad_y per column, norm_grad_reduce
    over its partial rows, no norm_weight_grad; a misaligned h takes the element path: bit-identical."""
    from pykern.difftest.cases import norm_act_loss as E
    from pykern.ops import _common
    from pykern.ops import norm_act_loss as m

    seen = []
    real = _common.launch
    record = lambda name, *a, **k: (seen.append(name), real(name, *a, **k))[1]  # noqa: E731
    monkeypatch.setattr(m, "launch", record)
    monkeypatch.setattr(_common, "launch", record)
    rng = np.random.default_rng(44)
    rows, dim = 700, 1024
    h, g, gr = (rng.standard_normal((rows, dim)).astype(np.float32) for _ in range(3))
    w = (1.0 + 0.3 * rng.standard_normal(dim)).astype(np.float32)
    for gres in (None, gr):
        seen.clear()
        out = ops.add_rms_norm_backward(h, w, g, gres, 1e-6, backend="host")
        assert seen == ["add_rms_norm_backward", "norm_grad_reduce"], seen
        for o, ref, nm in zip(out, E.np_add_rms_norm_backward(h, w, g, gres, 1e-6), ("gh", "gw")):
            _close(o, ref, "add_rms_norm_backward", "f32", nm)
        buf = np.empty(rows * dim + 1, np.float32)
        hs = buf[1:].reshape(rows, dim)
        hs[...] = h
        for a, b in zip(out, ops.add_rms_norm_backward(hs, w, g, gres, 1e-6, backend="host")):
            np.testing.assert_array_equal(a, b)
