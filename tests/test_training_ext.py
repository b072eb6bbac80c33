"""Issue 15 training ops against torch float64 autograd (and float64 NumPy): cross-entropy options
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
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_ce_op_matches_torch_f64_autograd(dtype, opt, reduction):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(7, 37, generator=g) * 3
    if dtype == "bf16":
        x = x.bfloat16()
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
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
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
    kind = "f32" if dtype == torch.float32 else "bf16"
    _close(out, ref, "cross_entropy_fwd_bwd", kind, "loss")
    _close(gl, rg, "cross_entropy_fwd_bwd", kind, "grad")
    mod = pt.CrossEntropyLoss(reduction=reduction, **opt)
    _close(mod(x.float(), t), torch_ce_ref(x.double(), t, reduction=reduction, **opt), "cross_entropy_fwd_bwd")
    assert torch.isnan(pt.cross_entropy(x.float(), torch.full((9,), -100), label_smoothing=0.1))
