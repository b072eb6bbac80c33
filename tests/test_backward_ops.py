"""Backward pieces of a LLaMA training step: silu_gate_backward, rope(inverse=True)
with HF tables and position_ids, attention_backward with scale / causal=False / n_q != n_k.

Checked against float64 NumPy models (finite differences, explicit matrices), torch float64
autograd, Hugging Face's own apply_rotary_pos_emb, and flash_attention's out/lse."""
from __future__ import annotations

import math

import numpy as np
import pytest

from pykern import ArgumentError, ArgumentTypeError, ops
from pykern.difftest.cases import attention as A, forward as F
from pykern.difftest.cases import training as T
from pykern.difftest.runner import compare
from pykern.tolerance import tolerance

from family_helpers import check_central_differences, need as _need
from test_streams import compiled, fake  # noqa: F401  (fake-driver fixtures, used by the stream test)


def _ok(name: str, got, ref, op: str, dtype: str = "f32") -> None:
    atol, rtol = tolerance(op, dtype)
    c = compare(name, np.asarray(got), ref, atol, rtol)
    assert c.ok, f"{name}: {c.detail}"


@pytest.fixture
def no_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*a, **k):
        raise AssertionError("a bad input reached launch")

    monkeypatch.setattr("pykern.launcher.launch", boom)


# --------------------------------------------------------------------------- silu_gate_backward


def _silu_loss(g: np.ndarray, u: np.ndarray, dy: np.ndarray) -> float:
    return float((g / (1.0 + np.exp(-g)) * u * dy).sum())


def test_silu_gate_backward_matches_finite_differences_of_a_float64_model() -> None:
    _need("host")
    rng = np.random.default_rng(20)
    shp = (3, 37)  # 111 elements: vector body + scalar tail
    g = (rng.standard_normal(shp) * 3).astype(np.float32)
    g[0, :3] = [-30.0, 0.0, 30.0]
    u = rng.standard_normal(shp).astype(np.float32)
    dy = rng.standard_normal(shp).astype(np.float32)
    gg, gu = ops.silu_gate_backward(g, u, dy, backend="host")
    g64, u64, dy64 = (a.astype(np.float64) for a in (g, u, dy))
    eps = 1e-6
    fd_g, fd_u = np.empty(shp), np.empty(shp)
    for idx in np.ndindex(shp):
        for arr, fd in ((g64, fd_g), (u64, fd_u)):
            keep = arr[idx]
            arr[idx] = keep + eps
            lp = _silu_loss(g64, u64, dy64)
            arr[idx] = keep - eps
            lm = _silu_loss(g64, u64, dy64)
            arr[idx] = keep
            fd[idx] = (lp - lm) / (2 * eps)
    _ok("grad_gate", gg, fd_g, "silu_gate_backward")
    _ok("grad_up", gu, fd_u, "silu_gate_backward")
    # and the closed form used by the difftest cases agrees with the same differences
    ref_g, ref_u = F.np_silu_gate_backward(g, u, dy)
    np.testing.assert_allclose(ref_g, fd_g, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(ref_u, fd_u, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dt", ["f32", "bf16"])
def test_silu_gate_backward_matches_torch_autograd(dt: str) -> None:
    _need("host")
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(21)
    shp = (2, 5, 24)
    g, u, dy = (F._normal(rng, shp, dt, s) for s in (3.0, 1.0, 1.0))
    gg, gu = ops.silu_gate_backward(g, u, dy, backend="host")
    assert np.asarray(gg).dtype == g.dtype and np.asarray(gu).dtype == g.dtype
    tg, tu = (torch.tensor(a.astype(np.float64), requires_grad=True) for a in (g, u))
    (torch.nn.functional.silu(tg) * tu).backward(torch.tensor(dy.astype(np.float64)))
    _ok("grad_gate", np.asarray(gg).astype(np.float64), tg.grad.numpy(), "silu_gate_backward", dt)
    _ok("grad_up", np.asarray(gu).astype(np.float64), tu.grad.numpy(), "silu_gate_backward", dt)
    # torch tensors in (requires_grad ones read as data), torch tensors out, bitwise the NumPy path
    to_t = (lambda a: torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)) if dt == "bf16" else torch.from_numpy
    tgg, tgu = ops.silu_gate_backward(to_t(g).requires_grad_(True), to_t(u), to_t(dy), backend="host")
    assert isinstance(tgg, torch.Tensor) and isinstance(tgu, torch.Tensor)
    for a, b in ((tgg, gg), (tgu, gu)):
        a = a.view(torch.int16).numpy() if dt == "bf16" else a.numpy()
        np.testing.assert_array_equal(a, np.asarray(b).view(np.int16) if dt == "bf16" else b)


def test_silu_gate_backward_arguments_are_checked_before_launch(no_launch) -> None:
    a = np.zeros((2, 3), np.float32)
    with pytest.raises(ArgumentError, match=r"grad_out: expected the shape of gate \(2, 3\)"):
        ops.silu_gate_backward(a, a, np.zeros((3, 2), np.float32))
    with pytest.raises(ArgumentTypeError, match="up: expected the dtype of gate"):
        ops.silu_gate_backward(a, a.astype(F._cast(a, "bf16").dtype), a)
    with pytest.raises(ArgumentTypeError, match="gate: expected dtype"):
        ops.silu_gate_backward(a.astype(np.float64), a, a)
    e = np.zeros((0, 3), np.float32)
    gg, gu = ops.silu_gate_backward(e, e, e)
    assert gg.shape == gu.shape == (0, 3)


# --------------------------------------------------------------------------- rope backward


def _rotation_matrices(n_tokens: int, head_dim: int, cos, sin, style: str, positions, inverse: bool) -> np.ndarray:
    """(n_tokens, head_dim, head_dim) float64 matrices of np_rope acting on one head (columns = images of e_i)."""
    eye = np.eye(head_dim)
    mats = np.empty((n_tokens, head_dim, head_dim))
    for c in range(head_dim):
        x = np.zeros((n_tokens, 1, head_dim))
        x[:, 0, :] = eye[c]
        mats[:, :, c] = F.np_rope(x, cos, sin, 0, style, position_ids=positions, inverse=inverse)[:, 0, :]
    return mats


@pytest.mark.parametrize("style", ["half", "interleaved"])
@pytest.mark.parametrize("hf", [False, True])
def test_rope_inverse_is_the_exact_adjoint(style: str, hf: bool) -> None:
    _need("host")
    rng = np.random.default_rng(22)
    n, h, d, max_pos = 6, 3, 16, 50
    cos, sin = F.hf_rope_tables(max_pos, d, style) if hf else F.rope_tables(max_pos, d)
    pos = rng.integers(0, max_pos, size=n)
    # float64 model: the inverse rotation's matrix is the transpose of the forward one
    fwd = _rotation_matrices(n, d, cos, sin, style, pos, False)
    inv = _rotation_matrices(n, d, cos, sin, style, pos, True)
    np.testing.assert_allclose(inv, fwd.transpose(0, 2, 1), atol=1e-15)
    # kernels: <rope(x), y> == <x, rope(y, inverse)>, and rope(rope(x), inverse) == x
    x = rng.standard_normal((n, h, d)).astype(np.float32)
    y = rng.standard_normal((n, h, d)).astype(np.float32)
    rx = ops.rope(x, cos, sin, position_ids=pos, style=style, backend="host")
    ry = ops.rope(y, cos, sin, position_ids=pos, style=style, inverse=True, backend="host")
    lhs = float((rx.astype(np.float64) * y).sum())
    rhs = float((x.astype(np.float64) * ry).sum())
    assert abs(lhs - rhs) <= 1e-5 * (np.abs(x).sum() + np.abs(y).sum())
    back = ops.rope(rx, cos, sin, position_ids=pos, style=style, inverse=True, backend="host")
    _ok("x", back, x.astype(np.float64), "rope")
    # and each kernel matches its float64 model
    _ok("rope(x)", rx, np.einsum("tij,thj->thi", fwd, x.astype(np.float64)), "rope")
    _ok("rope(y, inverse)", ry, np.einsum("tij,thj->thi", inv, y.astype(np.float64)), "rope")


def test_rope_backward_matches_finite_differences() -> None:
    # L = sum(rope(x) * g): dL/dx = rope(g, inverse=True) with the same positions
    _need("host")
    rng = np.random.default_rng(23)
    b, n, h, d = 2, 3, 2, 8
    cos, sin = F.hf_rope_tables(20, d, "half")
    pos = rng.integers(0, 20, size=(b, n))
    x = rng.standard_normal((b, n, h, d))
    g = rng.standard_normal((b, n, h, d)).astype(np.float32)
    grad = ops.rope(g, cos, sin, position_ids=pos, style="half", inverse=True, backend="host")
    fd = np.empty_like(x)
    eps = 1e-6
    for idx in np.ndindex(x.shape):
        xp, xm = x.copy(), x.copy()
        xp[idx] += eps
        xm[idx] -= eps
        lp = (F.np_rope(xp, cos, sin, style="half", position_ids=pos) * g).sum()
        lm = (F.np_rope(xm, cos, sin, style="half", position_ids=pos) * g).sum()
        fd[idx] = (lp - lm) / (2 * eps)
    _ok("grad_x", grad, fd, "rope")


@pytest.mark.parametrize("dt", ["f32", "bf16"])
def test_rope_with_hugging_face_tables_matches_apply_rotary_pos_emb(dt: str) -> None:
    # HF's rotary_emb output over positions 0..max_pos-1 is the (max_pos, head_dim) table;
    # HF applies it per token with position_ids. Forward and backward (torch float64 autograd).
    _need("host")
    torch = pytest.importorskip("torch")
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    from transformers import LlamaConfig

    b, n, h, d, max_pos = 2, 5, 3, 16, 32
    cfg = LlamaConfig(hidden_size=h * d, num_attention_heads=h, max_position_embeddings=max_pos)
    rot = llama.LlamaRotaryEmbedding(cfg)
    probe = torch.zeros(1, dtype=torch.float32)
    cos_t, sin_t = rot(probe, torch.arange(max_pos)[None])
    cos_t, sin_t = cos_t[0], sin_t[0]  # (max_pos, head_dim) float32
    rng = np.random.default_rng(24)
    x = F._normal(rng, (b, n, h, d), dt)
    gy = F._normal(rng, (b, n, h, d), dt)
    pos = torch.from_numpy(rng.integers(0, max_pos, size=(b, n)).astype(np.int32))  # a CPU tensor, int32
    to_t = (lambda a: torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)) if dt == "bf16" else torch.from_numpy
    y = ops.rope(to_t(x), cos_t, sin_t, position_ids=pos, style="half", backend="host")
    gx = ops.rope(to_t(gy), cos_t, sin_t, position_ids=pos, style="half", inverse=True, backend="host")
    assert isinstance(y, torch.Tensor) and isinstance(gx, torch.Tensor)
    # HF in float64: (batch, heads, seq, head_dim) layout, cos/sin gathered per token
    xt = torch.tensor(x.astype(np.float64)).transpose(1, 2).requires_grad_(True)
    c64, s64 = cos_t.double()[pos.long()], sin_t.double()[pos.long()]
    ref, _ = llama.apply_rotary_pos_emb(xt, xt, c64, s64)
    ref.backward(torch.tensor(gy.astype(np.float64)).transpose(1, 2))
    _ok("out", y.float().numpy().astype(np.float64), ref.detach().transpose(1, 2).numpy(), "rope", dt)
    _ok("grad_x", gx.float().numpy().astype(np.float64), xt.grad.transpose(1, 2).numpy(), "rope", dt)


def test_rope_position_ids_equal_to_the_offsets_give_the_same_bits() -> None:
    _need("host")
    rng = np.random.default_rng(25)
    for shp in ((7, 2, 64), (2, 7, 2, 64), (3, 2, 6)):
        x = rng.standard_normal(shp).astype(np.float32)
        c, s = F.rope_tables(30, shp[-1])
        for style in ("half", "interleaved"):
            a = ops.rope(x, c, s, pos_offset=4, style=style, backend="host")
            for pid in (np.arange(4, 4 + shp[-3]), np.arange(4, 4 + shp[-3], dtype=np.uint8)[None],
                        list(range(4, 4 + shp[-3]))):
                np.testing.assert_array_equal(ops.rope(x, c, s, position_ids=pid, style=style, backend="host"), a)
            # HF full tables read the same angles
            fc, fs = F.hf_rope_tables(30, shp[-1], style)
            np.testing.assert_array_equal(ops.rope(x, fc, fs, pos_offset=4, style=style, backend="host"), a)


def test_rope_kernel_zeroes_a_row_at_a_position_outside_the_tables() -> None:
    # Host position arrays are checked by the op; device ones are trusted, so the kernel
    # itself must not read outside the tables. Launch it directly with bad positions.
    _need("host")
    from pykern import launch

    rng = np.random.default_rng(26)
    for d in (16, 6):  # vector and scalar paths
        cos, sin = F.rope_tables(8, d)
        x = rng.standard_normal((4, 1, d)).astype(np.float32)
        out = np.full_like(x, np.nan)
        pos = np.array([3, -1, 8, 7], np.int64)
        spare = np.zeros(8, np.float32)  # k's output: k has 0 heads here
        # q, q_out, k, k_out, q_w, k_w, tables, positions, n_tok, n_units, heads_per_unit, n_pos, hq, hk, head_dim,
        # pos_offset, max_pos, has_pos, full_table, style, inverse, norm, eps, w_offset
        launch("rope", 1, 64, x, out, x, spare, x, x, cos, sin, pos, 4, 4, 1, 4, 1, 0, d, 0, 8, 1, 0, 1, 0, 0, 0.0,
               0.0, backend="host")
        assert not out[1].any() and not out[2].any()
        ref = F.np_rope(x[[0, 3]], cos, sin, style="half", position_ids=pos[[0, 3]])
        _ok("rows in range", out[[0, 3]], ref, "rope")


def test_rope_arguments_are_checked_before_launch(no_launch) -> None:
    x = np.zeros((2, 3, 4, 8), np.float32)
    cos, sin = F.rope_tables(10, 8)
    hc, hs = F.hf_rope_tables(10, 8, "half")
    with pytest.raises(ArgumentError, match=r"position_ids: expected every position in \[0, 10\).*got 10"):
        ops.rope(x, cos, sin, position_ids=np.array([0, 1, 10]))
    with pytest.raises(ArgumentError, match=r"position_ids: expected every position in \[0, 10\).*got -1"):
        ops.rope(x, cos, sin, position_ids=np.array([[0, 1, 2], [0, -1, 2]], np.int16))
    with pytest.raises(ArgumentError, match=r"position_ids: expected shape \(3,\) or \(1, 3\) or \(2, 3\)"):
        ops.rope(x, cos, sin, position_ids=np.zeros((3, 3), np.int64))
    with pytest.raises(ArgumentTypeError, match="position_ids: expected an integer array, got dtype float32"):
        ops.rope(x, cos, sin, position_ids=np.zeros(3, np.float32))
    with pytest.raises(ArgumentError, match="pos_offset: expected 0 when position_ids is given"):
        ops.rope(x, cos, sin, pos_offset=1, position_ids=np.zeros(3, np.int64))
    with pytest.raises(ArgumentError, match=r"cos: expected shape \(max_pos, 4\) or \(max_pos, 8\)"):
        ops.rope(x, cos[:, :3], sin)
    with pytest.raises(ArgumentError, match="sin: expected the layout of cos"):
        ops.rope(x, hc, sin)
    with pytest.raises(ArgumentTypeError, match="inverse: expected a bool"):
        ops.rope(x, cos, sin, inverse=1)
    # HF half tables used with the interleaved pairing (or any table whose twin columns differ)
    with pytest.raises(ArgumentError, match=r"cos: a \(max_pos, 8\) table with style='interleaved'.*row 1 differs"):
        ops.rope(x, hc, hs, style="interleaved")
    bad = hc.copy()
    bad[5, 6] += 1.0
    with pytest.raises(ArgumentError, match="cos: .*row 5 differs"):
        ops.rope(x, bad, hs, position_ids=np.array([0, 5, 2]), style="half")


def test_hf_table_check_only_reads_the_rows_in_use() -> None:
    _need("host")
    x = np.ones((3, 1, 8), np.float32)
    hc, hs = F.hf_rope_tables(10, 8, "half")
    hc[9, 7] = 5.0  # a row no token uses
    out = ops.rope(x, hc, hs, position_ids=np.array([0, 4, 2]), style="half", backend="host")
    _ok("out", out, F.np_rope(x, hc[:, :4], hs[:, :4], style="half", position_ids=[0, 4, 2]), "rope")


# --------------------------------------------------------------------------- attention backward

# (batch, n_q, n_k, heads, kv_heads, head_dim, causal, scale)
_ATT = [
    (None, 5, 9, 4, 2, 32, True, None),
    (None, 9, 5, 4, 1, 32, True, None),   # the first 4 queries see no key
    (2, 7, 11, 4, 4, 64, False, 0.2),
    (None, 11, 7, 8, 2, 80, False, None),
    (None, 1, 6, 2, 1, 128, True, 0.05),
    (1, 6, 1, 2, 2, 32, True, None),      # one key: only the last query sees it
]


def test_np_attention_backward_matches_finite_differences_for_new_shapes() -> None:
    rng = np.random.default_rng(27)
    for batch, n_q, n_k, h, kvh, d, causal, scale in ((None, 5, 3, 4, 2, 3, True, 0.7),
                                                      (None, 3, 5, 2, 1, 4, False, None),
                                                      (None, 3, 6, 2, 2, 3, True, None)):
        q, k, v, g = (a.astype(np.float64) for a in A.attention_inputs(rng, batch, n_q, h, kvh, d, "f32", n_k))

        def loss(q_, k_, v_):
            return float((A.np_attention_forward(q_, k_, v_, causal=causal, scale=scale)[0] * g).sum())

        check_central_differences(loss, [q, k, v], A.np_attention_backward(q, k, v, g, causal=causal, scale=scale))


def test_np_attention_forward_uses_flash_attentions_mask() -> None:
    rng = np.random.default_rng(28)
    for n_q, n_k in ((4, 9), (9, 4), (5, 5)):
        for causal in (True, False):
            q, k, v, _ = A.attention_inputs(rng, 2, n_q, 4, 2, 8, "f32", n_k)
            out, lse = A.np_attention_forward(q, k, v, causal=causal, scale=0.3)
            fo, fl = A.np_flash_attention(q, k, v, causal, 0.3)
            np.testing.assert_allclose(out, fo, atol=1e-12)
            np.testing.assert_allclose(lse, fl, atol=1e-12)


def test_attention_backward_matches_torch_autograd_float64() -> None:
    _need("host")
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(29)
    for batch, n_q, n_k, h, kvh, d, causal, scale in _ATT[:4]:
        q, k, v, g = A.attention_inputs(rng, batch, n_q, h, kvh, d, "f32", n_k)
        lead = q.ndim == 3
        tq, tk, tv = (torch.tensor((a[None] if lead else a).astype(np.float64), requires_grad=True)
                      for a in (q, k, v))
        rep = h // kvh
        s = torch.einsum("bqhd,bkhd->bhqk", tq, tk.repeat_interleave(rep, 2)) * (
            scale if scale is not None else 1 / math.sqrt(d))
        if causal:
            vis = torch.arange(n_k)[None, :] <= torch.arange(n_q)[:, None] + (n_k - n_q)
            s = s.masked_fill(~vis, -math.inf)
        p = torch.nan_to_num(torch.softmax(s, -1))  # rows with no key: 0, like flash_attention
        o = torch.einsum("bhqk,bkhd->bqhd", p, tv.repeat_interleave(rep, 2))
        o.backward(torch.tensor((g[None] if lead else g).astype(np.float64)))
        ref = [t.grad.numpy()[0] if lead else t.grad.numpy() for t in (tq, tk, tv)]
        for method in ("naive", "flash"):
            got = ops.attention_backward(q, k, v, g, causal=causal, scale=scale, method=method, backend="host")
            for name, a, r in zip(("dq", "dk", "dv"), got, ref):
                _ok(f"{method} {name}", a, r, "attention_backward")


@pytest.mark.parametrize("dt", ["f32", "bf16"])
def test_flash_attention_out_and_lse_feed_attention_backward(dt: str) -> None:
    _need("host")
    rng = np.random.default_rng(30)
    for batch, n_q, n_k, h, kvh, d, causal, scale in _ATT:
        q, k, v, g = A.attention_inputs(rng, batch if batch else 1, n_q, h, kvh, d, dt, n_k)
        out, lse = ops.flash_attention(q, k, v, causal=causal, scale=scale, return_lse=True, backend="host")
        ref = A.np_attention_backward(q, k, v, g, causal=causal, scale=scale)
        for kw in ({"out": out, "lse": lse, "method": "flash"}, {"method": "flash"}, {"method": "naive"}):
            got = ops.attention_backward(q, k, v, g, causal=causal, scale=scale, backend="host", **kw)
            for name, a, r in zip(("dq", "dk", "dv"), got, ref):
                assert np.asarray(a).dtype == q.dtype
                _ok(f"{kw['method']}{'+lse' if 'lse' in kw else ''} {name}", np.asarray(a).astype(np.float64), r,
                    "attention_backward", dt)
            if causal and n_q > n_k:  # queries that see no key: exactly zero gradient
                assert not np.asarray(got[0])[:, : n_q - n_k].astype(np.float32).any()


@pytest.mark.parametrize("schedule", ["reverse", "random:3"])
def test_new_shapes_flash_naive_agree_and_flash_is_bitwise_stable(schedule: str,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    _need("host")
    rng = np.random.default_rng(31)
    atol, rtol = tolerance("attention_backward", "f32")
    q, k, v, g = A.attention_inputs(rng, 2, 70, 4, 2, 32, "f32", 33)  # two query tiles, n_q > n_k
    base = ops.attention_backward(q, k, v, g, causal=True, scale=0.1, method="flash", backend="host")
    monkeypatch.setenv("PYKERN_HOST_SCHEDULE", schedule)
    flash = ops.attention_backward(q, k, v, g, causal=True, scale=0.1, method="flash", backend="host")
    naive = ops.attention_backward(q, k, v, g, causal=True, scale=0.1, method="naive", backend="host")
    for a, b, c in zip(base, flash, naive):
        assert np.array_equal(a, b)
        assert compare("naive", c, b.astype(np.float64), atol, rtol).ok


def test_attention_backward_edges_without_a_launch(no_launch) -> None:
    q = np.ones((3, 2, 8), np.float32)
    empty_k = np.zeros((0, 1, 8), np.float32)
    dq, dk, dv = ops.attention_backward(q, empty_k, empty_k, q)  # no key: zero dq
    assert dq.shape == q.shape and not dq.any() and dk.shape == dv.shape == (0, 1, 8)
    k = np.ones((4, 1, 8), np.float32)
    dq, dk, dv = ops.attention_backward(np.zeros((0, 2, 8), np.float32), k, k, np.zeros((0, 2, 8), np.float32))
    assert dq.shape == (0, 2, 8) and not dk.any() and not dv.any() and dk.shape == (4, 1, 8)


def test_attention_backward_arguments_are_checked_before_launch(no_launch) -> None:
    q = np.zeros((2, 5, 4, 8), np.float32)
    k = np.zeros((2, 7, 2, 8), np.float32)
    with pytest.raises(ArgumentError, match="scale: expected a finite number"):
        ops.attention_backward(q, k, k, q, scale=float("nan"))
    with pytest.raises(ArgumentTypeError, match="causal: expected a bool"):
        ops.attention_backward(q, k, k, q, causal="yes")
    with pytest.raises(ArgumentError, match=r"k: expected shape \(2, 'n_k', 'n_kv_heads', 8\)"):
        ops.attention_backward(q, np.zeros((3, 7, 2, 8), np.float32), k, q)
    with pytest.raises(ArgumentError, match=r"lse: expected shape \(2, 5, 4\)"):
        ops.attention_backward(q, k, k, q, out=q, lse=np.zeros((2, 7, 4), np.float32))
    with pytest.raises(ArgumentError, match=r"method='naive' handles seq_len <= 4096, got 4097"):
        long = np.zeros((4097, 1, 1), np.float32)
        ops.attention_backward(long[:3], long, long, long[:3], method="naive")


def test_rope_with_hf_per_token_cos_sin_as_a_table() -> None:
    # What an HF attention layer receives: cos/sin (batch, n_tokens, head_dim) for its
    # position_ids. Flattened into a table indexed by arange(batch * n_tokens).
    _need("host")
    torch = pytest.importorskip("torch")
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    from transformers import LlamaConfig

    b, n, h, d = 2, 5, 3, 16
    cfg = LlamaConfig(hidden_size=h * d, num_attention_heads=h, max_position_embeddings=64)
    pid = torch.tensor([[3, 4, 5, 6, 7], [0, 1, 2, 9, 20]])
    x = torch.from_numpy(np.random.default_rng(32).standard_normal((b, n, h, d)).astype(np.float32))
    cos, sin = llama.LlamaRotaryEmbedding(cfg)(x, pid)
    flat = torch.arange(b * n).reshape(b, n)
    y = ops.rope(x, cos.reshape(b * n, d), sin.reshape(b * n, d), position_ids=flat, style="half", backend="host")
    ref, _ = llama.apply_rotary_pos_emb(x.transpose(1, 2), x.transpose(1, 2), cos, sin)
    _ok("out", y.numpy().astype(np.float64), ref.transpose(1, 2).double().numpy(), "rope")


# --------------------------------------------------------------------------- streams (fake driver, nvrtc backend)


def _stream_cases(drv):
    from test_streams import _dev

    r = np.random.default_rng(33)
    f = lambda *s: _dev(drv, r.standard_normal(s).astype(np.float32))  # noqa: E731
    hc, hs = (_dev(drv, t) for t in F.hf_rope_tables(8, 8, "half"))
    pid32 = _dev(drv, np.array([[1, 7, 0], [2, 2, 5]], np.int32))  # device ids of another int dtype
    q, k, v, g = f(1, 5, 4, 16), f(1, 7, 2, 16), f(1, 7, 2, 16), f(1, 5, 4, 16)
    return [
        (1, lambda s: ops.silu_gate_backward(f(3, 7), f(3, 7), f(3, 7), stream=s)),
        (1, lambda s: ops.rope(f(2, 3, 2, 8), hc, hs, position_ids=pid32, style="half", inverse=True, stream=s)),
        (1, lambda s: ops.rope(f(2, 3, 2, 8), hc, hs, pos_offset=2, style="half", stream=s)),
        (3, lambda s: ops.attention_backward(q, k, v, g, causal=False, scale=0.3, stream=s)),
        (3, lambda s: ops.attention_backward(q, k, v, g, out=f(1, 5, 4, 16), lse=f(1, 5, 4), stream=s)),
        (3, lambda s: ops.attention_backward(q, k, v, g, method="naive", stream=s)),
    ]


def test_new_ops_launch_on_the_callers_stream_without_host_copies(request) -> None:
    """Device (CUDA-array-interface) inputs: every launch on stream= (else the library's current
    stream), no device-to-host copy, no driver allocation, no synchronization beyond CAI v3's wait
    for the inputs' producer stream; the fake driver also
    checks each packed argument against the kernel's PTX signature."""
    fake = request.getfixturevalue("fake")
    from test_streams import CURRENT, SIDE, _calls_since

    for stream, want in ((None, CURRENT), (SIDE, SIDE)):
        for n_launch, fn in _stream_cases(fake):
            start, first = len(fake.calls), len(fake.launches)
            fn(stream)
            launches, calls = fake.launches[first:], _calls_since(fake, start)
            assert len(launches) == n_launch, [x.name for x in launches]
            assert {x.stream for x in launches} == {want}
            for bad in ("memcpy_dtoh_async", "mem_alloc"):
                assert bad not in calls, (bad, calls)
            # the inputs' CAI v3 says they were produced on CURRENT: a side stream may wait for it, nothing else
            syncs = {c[1][0] for c in fake.calls[start:] if c[0] == "stream_synchronize"}
            assert syncs <= ({CURRENT} if stream == SIDE else set()), syncs
