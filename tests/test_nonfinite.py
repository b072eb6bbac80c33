"""NaN / +inf / -inf inputs behave as in torch: cross-entropy (plain, options, fused linear),
softmax (causal_attn_softmax, softmax_backward) and the norms with their backwards.

Every test builds its reference with torch on the CPU in float64 from the same (dtype-rounded)
inputs, checks that torch in the dtype itself gives the same NaN / +inf / -inf / finite pattern,
and then asks the op (host backend: the .cu itself; numba backend: the references) for exactly
that pattern, with the finite values inside the tolerance table. A bad value goes where a
reduction tree is most likely to lose it: lane 0, lane 31, the first element of the last busy
thread of the 16-byte path, the last element, and whole rows of it.

One deliberate difference from torch, documented in README.md ("Non-finite inputs"): a row
whose target is ignore_index gets a zero gradient without its logits being read, where torch's
log_softmax backward turns NaN / +inf logits of an ignored row into a NaN gradient row.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

import pykern
from pykern import ops
from pykern.tolerance import tolerance

from family_helpers import need as _need

torch = pytest.importorskip("torch")
F = torch.nn.functional

NAN, INF = math.nan, math.inf
# IEEE arithmetic on NaN / inf in the NumPy-scalar references (and NumPy's matmul) warns; it is
# the point of these tests
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

BAD = {"nan": NAN, "+inf": INF, "-inf": -INF}
BACKENDS = ["host", "numba"]
DTYPES = ["f32", "bf16"]
_TDT = {"f32": torch.float32, "bf16": torch.bfloat16}
_LABELS = np.array(["finite", "nan", "+inf", "-inf"])


# --------------------------------------------------------------------------- helpers


def _np_dtype(dtype: str):
    return np.float32 if dtype == "f32" else pykern.arrays.bfloat16()


def _f64(a) -> np.ndarray:
    if torch.is_tensor(a):
        return a.detach().double().numpy()
    return np.asarray(a, np.float64) if np.asarray(a).dtype != np.float64 else np.asarray(a)


def _kinds(a) -> np.ndarray:
    """0 finite, 1 NaN, 2 +inf, 3 -inf, element by element."""
    a = _f64(a)
    return np.select([np.isnan(a), a == INF, a == -INF], [1, 2, 3], 0)


def _same_pattern(got, want, what: str) -> None:
    g, w = _kinds(got), _kinds(want)
    assert g.shape == w.shape, (what, g.shape, w.shape)
    bad = np.argwhere(g != w)
    assert not bad.size, (f"{what}: {len(bad)} positions differ from torch, first "
                          + ", ".join(f"{tuple(i.tolist())}: got {_LABELS[g[tuple(i)]]}, torch {_LABELS[w[tuple(i)]]}"
                                      for i in bad[:4]))


def _like_torch(got, want, op: str, dtype: str, what: str) -> None:
    """The same NaN/inf/finite pattern as torch, the finite values inside the tolerance table."""
    _same_pattern(got, want, f"{op}/{dtype} {what}")
    g, w = _f64(got), _f64(want)
    fin = np.isfinite(w)
    atol, rtol = tolerance(op, dtype)
    err = np.abs(g[fin] - w[fin])
    lim = atol + rtol * np.abs(w[fin])
    assert (err <= lim).all(), f"{op}/{dtype} {what}: max err {err.max():.3g} (finite part)"


def _torch_same_pattern_in_dtype(ref64, ref_dt, what: str) -> None:
    """torch in the I/O dtype agrees with torch in float64 on the pattern: the reference is not an
    artefact of float64."""
    _same_pattern(ref_dt, ref64, f"torch float64 vs torch's own dtype, {what}")


def _rounded(a: np.ndarray, dtype: str) -> np.ndarray:
    """a in the I/O dtype (NumPy, ml_dtypes bf16 for bf16)."""
    return np.asarray(a, np.float32).astype(_np_dtype(dtype))


def _t(a: np.ndarray, dt=torch.float64, grad: bool = False):
    t = torch.from_numpy(_f64(a).copy()).to(dt)
    return t.requires_grad_(grad)


def _need_backend(backend: str) -> None:
    _need(backend)


# --------------------------------------------------------------------------- cross-entropy


_VOCABS = [203, 256, 4104]  # scalar path; 16-byte path, one vector a thread; 16-byte path, several


def _ce_rows(vocab: int, bad: float, rng: np.random.Generator, pad: int = -100):
    """(logits (rows, vocab) float32, targets): a clean row, then the bad value at lane 0, lane 31, the
    first element of thread 31 on the f32 / bf16 16-byte paths, mid-row, the last element, two places,
    on the target itself, a whole row of it, and two ignored rows holding it."""
    where = [[0], [31], [124], [248], [vocab // 2 + 1], [vocab - 1], [0, vocab - 1]]
    where = [w for w in where if max(w) < vocab]
    rows = 1 + len(where) + 1 + 1 + 2 + 1
    x = rng.standard_normal((rows, vocab)).astype(np.float32) * 2.0
    t = rng.integers(0, vocab, rows)
    r = 1
    for w in where:
        x[r, w] = bad
        t[r] = 7 if 7 not in w else 8
        r += 1
    x[r, 5] = bad  # the target is the bad logit
    t[r] = 5
    r += 1
    x[r, :] = bad  # a whole row
    r += 1
    x[r, [0, 31]] = bad  # ignored rows: loss 0, do not poison the mean
    x[r + 1, :] = bad
    t[r], t[r + 1] = pad, pad
    return x, t


def _torch_ce(x, t, *, reduction: str, pad: int = -100, label_smoothing: float = 0.0, softcap=None,
              dt=torch.float64):
    """(loss, grad of the reduction) from torch, with pykern's one difference: the logit gradient of
    an ignored row is 0 (torch's is NaN when that row's logits hold NaN / +inf)."""
    xt = _t(x, dt, grad=True)
    tt = torch.from_numpy(np.asarray(t, np.int64))
    z = softcap * torch.tanh(xt / softcap) if softcap else xt
    loss = F.cross_entropy(z, tt, ignore_index=pad, reduction=reduction, label_smoothing=label_smoothing)
    (g,) = torch.autograd.grad(loss.sum(), xt)
    g = g.detach().clone()
    g[tt == pad] = 0.0
    return loss.detach(), g


@pytest.mark.parametrize("vocab", _VOCABS)
@pytest.mark.parametrize("bad", list(BAD), ids=list(BAD))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_cross_entropy_nonfinite_logits_like_torch(backend, dtype, bad, vocab):
    _need_backend(backend)
    x32, t = _ce_rows(vocab, BAD[bad], np.random.default_rng(vocab))
    x = _rounded(x32, dtype)
    for reduction in ("none", "mean", "sum"):
        want_l, want_g = _torch_ce(x, t, reduction=reduction)
        dt_l, dt_g = _torch_ce(x, t, reduction=reduction, dt=_TDT[dtype])
        _torch_same_pattern_in_dtype(want_l, dt_l, f"ce loss {reduction}")
        _torch_same_pattern_in_dtype(want_g, dt_g, f"ce grad {reduction}")
        loss, grad = ops.cross_entropy_fwd_bwd(x, t, -100, reduction=reduction, backend=backend)
        _like_torch(loss, want_l, "cross_entropy_fwd_bwd", dtype, f"loss ({reduction}, {bad})")
        _like_torch(grad, want_g, "cross_entropy_fwd_bwd", dtype, f"grad ({reduction}, {bad})")


@pytest.mark.parametrize("bad", list(BAD), ids=list(BAD))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_cross_entropy_ignored_nonfinite_rows_do_not_poison_the_mean(backend, dtype, bad):
    _need_backend(backend)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, 64)).astype(np.float32)
    x[1, 0], x[3, :] = BAD[bad], BAD[bad]
    t = np.array([3, -100, 9, -100, 0])
    x = _rounded(x, dtype)
    want_l, want_g = _torch_ce(x, t, reduction="mean")
    assert math.isfinite(float(want_l))
    loss, grad = ops.cross_entropy_fwd_bwd(x, t, -100, backend=backend)
    _like_torch(loss, want_l, "cross_entropy_fwd_bwd", dtype, "mean loss")
    _like_torch(grad, want_g, "cross_entropy_fwd_bwd", dtype, "grad")
    assert not _f64(grad)[[1, 3]].any(), "an ignored row's gradient is 0"


@pytest.mark.parametrize("opt", [{"label_smoothing": 0.1}, {"label_smoothing": 1.0}, {"softcap": 5.0},
                                 {"label_smoothing": 0.2, "softcap": 3.0}],
                         ids=["smooth0.1", "smooth1", "softcap5", "smooth0.2-softcap3"])
@pytest.mark.parametrize("bad", list(BAD), ids=list(BAD))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_cross_entropy_options_with_nonfinite_logits_like_torch(backend, dtype, bad, opt):
    _need_backend(backend)
    x32, t = _ce_rows(256, BAD[bad], np.random.default_rng(5))
    x = _rounded(x32, dtype)
    for reduction in ("none", "mean"):
        want_l, want_g = _torch_ce(x, t, reduction=reduction, **opt)
        loss, grad = ops.cross_entropy_fwd_bwd(x, t, -100, reduction=reduction, backend=backend, **opt)
        _like_torch(loss, want_l, "cross_entropy_fwd_bwd", dtype, f"loss ({reduction}, {opt})")
        _like_torch(grad, want_g, "cross_entropy_fwd_bwd", dtype, f"grad ({reduction}, {opt})")


@pytest.mark.parametrize("bad", list(BAD), ids=list(BAD))
@pytest.mark.parametrize("backend", BACKENDS)
def test_cross_entropy_z_loss_with_nonfinite_logits(backend, bad):
    # torch has no z-loss: the pattern is that of lse**2 added to torch's row loss
    _need_backend(backend)
    x, t = _ce_rows(256, BAD[bad], np.random.default_rng(6))
    xt = _t(x)
    rows = F.cross_entropy(xt, torch.from_numpy(t), reduction="none")
    rows = rows + torch.where(torch.from_numpy(t != -100), 1e-2 * torch.logsumexp(xt, -1).pow(2), 0.0)
    loss, _ = ops.cross_entropy_fwd_bwd(x, t, -100, reduction="none", z_loss=1e-2, backend=backend)
    _like_torch(loss, rows, "cross_entropy_fwd_bwd", "f32", "z_loss rows")


@pytest.mark.parametrize("dtype", DTYPES)
def test_pykern_torch_cross_entropy_nan_logit_like_torch(dtype):
    # the torch layer gives NaN where torch does, at every position of the NaN in the row
    _need("host")
    import pykern.torch as pt

    x = torch.randn(40, 96).to(_TDT[dtype])
    for r in range(40):
        x[r, (r * 7) % 96] = NAN if r % 2 else INF
    t = torch.randint(0, 96, (40,))
    t[5] = -100
    got = pt.cross_entropy(x, t, reduction="none")
    want = F.cross_entropy(x.double(), t, reduction="none")
    _like_torch(got, want, "cross_entropy_fwd_bwd", dtype, "pykern.torch rows")


# --------------------------------------------------------------------------- fused linear cross-entropy


def _flce_torch(h, w, b, t, reduction: str):
    """(loss, grad_hidden, grad_weight, grad_bias) of F.linear + F.cross_entropy in float64, the logit
    gradient of ignored rows taken as 0 (see the module docstring)."""
    ht, wt, bt = _t(h, grad=True), _t(w, grad=True), _t(b, grad=True)
    logits = F.linear(ht, wt, bt)
    tt = torch.from_numpy(np.asarray(t, np.int64))
    loss = F.cross_entropy(logits, tt, reduction=reduction)
    (gl,) = torch.autograd.grad(loss.sum(), logits)
    gl = gl.clone()
    gl[tt == -100] = 0.0
    hd, wd = ht.detach(), wt.detach()
    return loss.detach(), gl @ wd, gl.T @ hd, gl.sum(0)


@pytest.mark.parametrize("case", ["hidden_row", "hidden_ignored_row", "weight_row", "bias"])
@pytest.mark.parametrize("bad", list(BAD), ids=list(BAD))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("frame", ["numpy", "torch"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_linear_cross_entropy_nonfinite_like_torch(backend, frame, dtype, bad, case):
    _need_backend(backend)
    rng = np.random.default_rng(11)
    n, hd, v = 7, 16, 40
    h = rng.standard_normal((n, hd)).astype(np.float32)
    w = (rng.standard_normal((v, hd)) * 0.5).astype(np.float32)
    b = rng.standard_normal(v).astype(np.float32)
    t = rng.integers(0, v, n)
    t[4], t[1] = -100, 0
    if case == "hidden_row":
        h[2, 3] = BAD[bad]
    elif case == "hidden_ignored_row":
        h[4, 0] = BAD[bad]
    elif case == "weight_row":
        w[0, 5] = BAD[bad]  # logit 0 of every row: lane 0, where a dropped NaN went unseen
    else:
        b[0] = BAD[bad]  # logit 0 of every row, row 1's target
    h, w, b = (_rounded(a, dtype) for a in (h, w, b))
    conv = (lambda a: torch.from_numpy(_f64(a)).to(_TDT[dtype])) if frame == "torch" else (lambda a: a)
    for reduction in ("none", "mean"):
        loss, gh, gw, gb = ops.fused_linear_cross_entropy(conv(h), conv(w), t, conv(b), reduction=reduction,
                                                          chunk_size=3, backend=backend)
        ref = _flce_torch(h, w, b, t, reduction)
        for got, want, nm in zip((loss, gh, gw, gb), ref, ("loss", "grad_hidden", "grad_weight", "grad_bias")):
            _like_torch(got, want, "fused_linear_cross_entropy", dtype, f"{nm} ({case}, {reduction})")


# --------------------------------------------------------------------------- softmax


def _causal_ref(s: np.ndarray, past_len: int, dt=torch.float64):
    """torch's attention softmax (SDPA's _safe_softmax: a row with no finite score is 0) of the
    causally masked scores."""
    st = _t(s, dt)
    n_q, _, kv = s.shape
    vis = torch.arange(kv)[None, :] <= past_len + torch.arange(n_q)[:, None]
    return torch._safe_softmax(st.masked_fill(~vis[:, None, :], -INF), -1)


@pytest.mark.parametrize("kv_len", [37, 40, 300, 1024])  # scalar / 16-byte, warp per row / block per row
@pytest.mark.parametrize("bad", list(BAD), ids=list(BAD))
@pytest.mark.parametrize("backend", BACKENDS)
def test_causal_attn_softmax_nonfinite_scores_like_torch(backend, bad, kv_len):
    _need_backend(backend)
    rng = np.random.default_rng(kv_len)
    n_q, heads = 9, 2
    past = kv_len - n_q
    s = rng.standard_normal((n_q, heads, kv_len)).astype(np.float32)
    b = BAD[bad]
    s[0, 0, 0] = b                    # the first visible key of the shortest row
    s[1, 1, 31] = b                   # lane 31
    s[2, 0, kv_len - 1] = b           # masked for this query: must not matter
    s[8, 0, kv_len - 1] = b           # the last visible key of the last query
    s[8, 1, :] = b                    # a whole row
    s[4, 1, [0, past + 4]] = b        # two places
    s[5, 0, :past + 6] = b            # every visible key, the masked tail finite
    s[6, 0, min(124, kv_len - 1)] = b  # the first element of thread 31 (16-byte path)
    want = _causal_ref(s, past)
    _torch_same_pattern_in_dtype(want, _causal_ref(s, past, torch.float32), "causal softmax")
    got = ops.causal_attn_softmax(s, past, backend=backend)
    _like_torch(got, want, "causal_attn_softmax", "f32", bad)


@pytest.mark.parametrize("where", ["probs", "grad_out"])
@pytest.mark.parametrize("bad", list(BAD), ids=list(BAD))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_softmax_backward_nonfinite_like_torch(backend, dtype, bad, where):
    _need_backend(backend)
    rng = np.random.default_rng(8)
    n = 256
    x = rng.standard_normal((6, n))
    p = np.exp(x) / np.exp(x).sum(-1, keepdims=True)
    g = rng.standard_normal((6, n))
    a = p if where == "probs" else g
    a[1, 0] = a[2, 31] = a[3, n - 1] = BAD[bad]
    a[4, :] = BAD[bad]
    p, g = _rounded(p, dtype), _rounded(g, dtype)

    def ref(dt):
        return torch._softmax_backward_data(_t(g, dt), _t(p, dt), -1, dt)

    want = ref(torch.float64)
    _torch_same_pattern_in_dtype(want, ref(_TDT[dtype]), "softmax backward")
    _like_torch(ops.softmax_backward(p, g, backend=backend), want, "softmax_backward", dtype, f"{where} {bad}")


# --------------------------------------------------------------------------- norms


_NORM_DIMS = [64, 1000, 4099]  # warp per row / one read kept in registers / scalar path


def _norm_rows(dim: int, bad: float, rng: np.random.Generator) -> np.ndarray:
    """(6, dim) float32: clean, bad at lane 0, lane 31, the last element, two places, a whole row."""
    x = rng.standard_normal((6, dim)).astype(np.float32)
    x[1, 0], x[2, 31], x[3, dim - 1] = bad, bad, bad
    x[4, [0, dim - 1]] = bad
    x[5, :] = bad
    return x


def _norm_fwd(op: str, x, w, b, res, backend):
    """The op's outputs as a tuple: (y,), or (y, new_residual) for add_rms_norm."""
    if op == "rms_norm":
        return (ops.rms_norm(x, w, 1e-6, backend=backend),)
    if op == "add_rms_norm":
        return ops.add_rms_norm(x, res, w, 1e-6, backend=backend)
    return (ops.layer_norm(x, w, b, 1e-5, backend=backend),)


def _norm_fwd_ref(op: str, x, w, b, res, dtype: str, dt):
    """torch's forward in `dt`; add_rms_norm's sum is stored in the I/O dtype first, as the op's is."""
    xt, wt, bt = _t(x, dt), _t(w, dt), _t(b, dt)
    dim = x.shape[-1]
    if op == "rms_norm":
        return (F.rms_norm(xt, (dim,), wt, 1e-6),)
    if op == "add_rms_norm":
        h = (_t(x, _TDT[dtype]) + _t(res, _TDT[dtype])).to(dt)
        return F.rms_norm(h, (dim,), wt, 1e-6), h
    return (F.layer_norm(xt, (dim,), wt, bt, 1e-5),)


@pytest.mark.parametrize("dim", _NORM_DIMS)
@pytest.mark.parametrize("bad", list(BAD), ids=list(BAD))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ["rms_norm", "add_rms_norm", "layer_norm"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_norm_forward_nonfinite_rows_like_torch(backend, op, dtype, bad, dim):
    _need_backend(backend)
    rng = np.random.default_rng(dim)
    x = _rounded(_norm_rows(dim, BAD[bad], rng), dtype)
    w = _rounded(rng.standard_normal(dim), dtype)
    b = _rounded(rng.standard_normal(dim), dtype)
    res = _rounded(rng.standard_normal(x.shape), dtype)
    want = _norm_fwd_ref(op, x, w, b, res, dtype, torch.float64)
    _torch_same_pattern_in_dtype(want[0], _norm_fwd_ref(op, x, w, b, res, dtype, _TDT[dtype])[0], op)
    got = _norm_fwd(op, x, w, b, res, backend)
    for g, r, nm in zip(got, want, ("y", "new_residual")):
        _like_torch(g, r, op, dtype, f"{nm} ({bad})")


@pytest.mark.parametrize("bad", list(BAD), ids=list(BAD))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ["rms_norm", "add_rms_norm", "layer_norm"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_norm_forward_nonfinite_weight_like_torch(backend, op, dtype, bad):
    # a bad weight / bias column poisons that column of every row and nothing else
    _need_backend(backend)
    rng = np.random.default_rng(4)
    dim = 256
    x = _rounded(rng.standard_normal((4, dim)), dtype)
    w = rng.standard_normal(dim)
    b = rng.standard_normal(dim)
    w[31] = BAD[bad]
    b[200] = BAD[bad]
    w, b = _rounded(w, dtype), _rounded(b, dtype)
    res = _rounded(rng.standard_normal(x.shape), dtype)
    want = _norm_fwd_ref(op, x, w, b, res, dtype, torch.float64)
    got = _norm_fwd(op, x, w, b, res, backend)
    _like_torch(got[0], want[0], op, dtype, f"y ({bad} weight)")


def _norm_bwd_ref(op: str, x, w, g, dt, fused: bool = False):
    """torch autograd of the forward: (grad_x, grad_weight[, grad_bias]).

    LayerNorm's reference is the autograd of its formula (mean, biased variance, rsqrt): with an
    infinite upstream gradient torch's fused kernels give a data-dependent mix of +-inf and NaN
    in the grad_x row (CPU and CUDA differ), the formula's autograd a NaN row, which pykern
    follows. `fused=True` gives F.layer_norm's own backward."""
    xt, wt, gt = _t(x, dt, grad=True), _t(w, dt, grad=True), _t(g, dt)
    dim = x.shape[-1]
    if op == "layer_norm":
        bt = torch.zeros(dim, dtype=dt, requires_grad=True)
        if fused:
            y = F.layer_norm(xt, (dim,), wt, bt, 1e-5)
        else:
            mu = xt.mean(-1, keepdim=True)
            var = (xt - mu).pow(2).mean(-1, keepdim=True)
            y = (xt - mu) * torch.rsqrt(var + 1e-5) * wt + bt
        return torch.autograd.grad(y, (xt, wt, bt), gt)
    y = F.rms_norm(xt, (dim,), wt, 1e-6)
    return torch.autograd.grad(y, (xt, wt), gt)


# dims 64, 1000: rms_norm_backward's fused weight partials; 8200: its separate weight kernel (a .cu
# path only: the numba references have none, so the simulator skips it)
_BWD = [(b, d) for b in BACKENDS for d in (64, 1000, 8200) if not (b == "numba" and d == 8200)]
_WHERE = ["x", "grad_out", "weight"]
_POS = ["lane0", "lane31", "last", "row"]


def _bwd_points() -> list[tuple]:
    """(backend, dim, bad, where, pos): the full bad x where x pos product at dims 64 and 1000; at 8200 (the
    host's slowest rows, 4x the run time of the rest together) every (where, pos) once with the bad value
    rotating, so that every pair of the three axes still occurs there (pairwise), for every op and dtype."""
    out = []
    for backend, dim in _BWD:
        for w, where in enumerate(_WHERE):
            for p, pos in enumerate(_POS):
                for b, bad in enumerate(BAD):
                    if dim != 8200 or b == (w + p) % len(BAD):
                        out.append((backend, dim, bad, where, pos))
    return out


_BWD_POINTS = _bwd_points()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ["rms_norm", "add_rms_norm", "layer_norm"])
@pytest.mark.parametrize("backend,dim,bad,where,pos", _BWD_POINTS, ids=["-".join(map(str, t)) for t in _BWD_POINTS])
def test_norm_backward_nonfinite_like_torch(backend, dim, op, dtype, bad, where, pos):
    # one bad row among clean ones: its grad_x row follows torch, the other rows stay finite, and the
    # weight / bias gradients are poisoned exactly where torch's are
    _need_backend(backend)
    rng = np.random.default_rng(dim + 1)
    x = rng.standard_normal((5, dim))
    g = rng.standard_normal((5, dim))
    w = rng.standard_normal(dim)
    idx = {"lane0": [0], "lane31": [31], "last": [dim - 1], "row": slice(None)}[pos]
    if where == "weight":
        w[idx] = BAD[bad]
    else:
        (x if where == "x" else g)[2, idx] = BAD[bad]
    x, g, w = _rounded(x, dtype), _rounded(g, dtype), _rounded(w, dtype)
    want = _norm_bwd_ref(op, x, w, g, torch.float64)
    _torch_same_pattern_in_dtype(want[0], _norm_bwd_ref(op, x, w, g, _TDT[dtype])[0], f"{op} backward")
    if op == "layer_norm":  # the fused kernel agrees on which entries are finite, and on the params
        fused = _norm_bwd_ref(op, x, w, g, torch.float64, fused=True)
        assert (np.isfinite(_f64(fused[0])) == np.isfinite(_f64(want[0]))).all()
        for a, b_ in zip(fused[1:], want[1:]):
            _same_pattern(a, b_, "layer_norm params: fused vs formula")
    if op == "rms_norm":
        got = ops.rms_norm_backward(x, w, g, 1e-6, backend=backend)
        opname = "rms_norm_backward"
    elif op == "add_rms_norm":
        got = ops.add_rms_norm_backward(x, w, g, None, 1e-6, backend=backend)
        opname = "add_rms_norm_backward"
    else:
        got = ops.layer_norm_backward(x, w, g, 1e-5, backend=backend)
        opname = "layer_norm_backward"
    for gg, r, nm in zip(got, want, ("grad_x", "grad_weight", "grad_bias")):
        _like_torch(gg, r, opname, dtype, f"{nm} ({bad} in {where} at {pos})")
