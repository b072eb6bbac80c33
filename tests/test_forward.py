"""Forward / prefill kernels: NumPy references, argument checks, the barrier-heavy
kernels' cases under a random host schedule (every case runs on the host under two schedules
and on the numba references in tests/test_difftest.py), the scalar (unaligned) paths, and
flash_attention's lse feeding attention_backward."""
from __future__ import annotations

import math

import numpy as np
import pytest

from pykern import ArgumentError, ArgumentTypeError, ops
from pykern.difftest.cases import attention as A, forward as F


from family_helpers import check as _check, need as _need


_CASES = list(F.cases(np.random.default_rng(0)))
# flash_attention's cases are the attention family's (portable kernels: the sm_90a ones play their arch)
_FA_CASES = [c for c in A.cases(np.random.default_rng(0)) if c.op == "flash_attention" and not c.arch]


# --------------------------------------------------------------------------- NumPy references


def test_np_flash_attention_matches_explicit_loops() -> None:
    rng = np.random.default_rng(3)
    q, k, v = A.fa_inputs(rng, 1, 5, 3, 4, 2, 6, 5, "f32")
    for causal in (False, True):
        out, lse = A.np_flash_attention(q, k, v, causal)
        for i in range(5):
            for h in range(4):
                keys = [j for j in range(3) if not causal or j <= i + 3 - 5]
                if not keys:  # n_q > n_k: the first rows see nothing
                    assert lse[0, i, h] == -np.inf and not out[0, i, h].any()
                    continue
                s = np.array([q[0, i, h].astype(np.float64) @ k[0, j, h // 2] for j in keys]) / math.sqrt(6)
                p = np.exp(s - s.max())
                np.testing.assert_allclose(out[0, i, h], (p / p.sum()) @ v[0, keys, h // 2].astype(np.float64))
                np.testing.assert_allclose(lse[0, i, h], np.log(np.exp(s).sum()))


def test_np_rope_half_style_is_rotate_half() -> None:
    rng = np.random.default_rng(4)
    x = rng.standard_normal((3, 2, 8))
    cos, sin = F.rope_tables(5, 8)
    c = np.concatenate([cos[1:4], cos[1:4]], -1)[:, None, :]  # HF duplicates the half table
    s = np.concatenate([sin[1:4], sin[1:4]], -1)[:, None, :]
    rot = np.concatenate([-x[..., 4:], x[..., :4]], -1)
    np.testing.assert_allclose(F.np_rope(x, cos, sin, 1, "half"), x * c + rot * s, rtol=1e-6)
    # interleaved on (x0, x1) is a plain 2-D rotation by the position's angle
    r = F.np_rope(x, cos, sin, 1, "interleaved")
    ang = np.arctan2(sin[2, 0], cos[2, 0])
    np.testing.assert_allclose(r[1, 0, 0], x[1, 0, 0] * math.cos(ang) - x[1, 0, 1] * math.sin(ang), rtol=1e-6)


def test_np_causal_softmax_rows_sum_to_one_over_visible_keys() -> None:
    s = np.random.default_rng(5).standard_normal((4, 2, 9)).astype(np.float32)
    p = F.np_causal_attn_softmax(s, past_len=3)
    for q in range(4):
        np.testing.assert_allclose(p[q].sum(-1), 1.0)
        assert not p[q, :, 3 + q + 1:].any()


# --------------------------------------------------------------------------- every case on the host backend


def test_every_case_runs_in_the_difftest_suite() -> None:
    # Every case of this family runs in tests/test_difftest.py: on the host under the forward and the reverse
    # schedule (test_host_schedules, each within tolerance of NumPy and of each other) and, big ones aside, on
    # the numba references (test_numba); the per-kernel small cases also under random / interleave / fma0 /
    # racecheck / initcheck (tests/test_host_modes.py).
    # Running them here again on one schedule (and a subset on numba) added nothing: registered is enough.
    from pykern.difftest.case import families

    assert _CASES and any(gen is F.cases for gen in families().values())


_SCHEDULE_OPS = ("flash_attention", "rms_norm", "causal_attn_softmax")


def test_barrier_kernels_agree_across_schedules(monkeypatch: pytest.MonkeyPatch) -> None:
    # the reverse schedule runs every case in tests/test_difftest.py; a seeded random order on top here
    _need("host")
    monkeypatch.setenv("PYKERN_HOST_SCHEDULE", "random:11")
    assert _FA_CASES
    for case in _CASES + _FA_CASES:
        if case.op in _SCHEDULE_OPS and case.note != "big":
            _check(case.run("host"), case.reference(), case.op, case.dtype)


# --------------------------------------------------------------------------- scalar (unaligned) paths


def _misaligned(a: np.ndarray) -> np.ndarray:
    """A C-contiguous copy of `a` whose data pointer is 4 bytes past a 16-byte boundary."""
    raw = np.zeros(a.nbytes + 32, np.uint8)
    start = (-raw.ctypes.data) % 16 + 4
    out = raw[start:start + a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    assert out.ctypes.data % 16 == 4
    return out


@pytest.mark.parametrize("kind", ["f32", "bf16"])
def test_unaligned_inputs_take_the_scalar_path(kind: str) -> None:
    _need("host")
    rng = np.random.default_rng(6)
    g = _misaligned(F._normal(rng, (3, 64), kind, 3.0))
    u = F._normal(rng, (3, 64), kind)
    _check({"o": ops.silu_gate(g, u, backend="host")}, {"o": F.np_silu_gate(g, u)}, "silu_gate", kind)
    w = F._normal(rng, (64,), kind)
    _check({"o": ops.rms_norm(g, w, backend="host")}, {"o": F.np_rms_norm(g, w)}, "rms_norm", kind)
    x = _misaligned(F._normal(rng, (4, 2, 16), kind))
    cos, sin = F.rope_tables(8, 16)
    for style in ("interleaved", "half"):
        _check({"o": ops.rope(x, cos, sin, pos_offset=2, style=style, backend="host")},
               {"o": F.np_rope(x, cos, sin, 2, style)}, "rope", kind)
    table = _misaligned(F._normal(rng, (10, 16), kind))
    ids = np.array([9, 0, 4])
    np.testing.assert_array_equal(ops.embedding(ids, table, backend="host"), table[ids])
    np.testing.assert_array_equal(ops.embedding(ids.astype(np.int32), table, backend="host"), table[ids])
    np.testing.assert_array_equal(ops.embedding([9, 1], table, backend="host"), table[[9, 1]])
    q, k, v = (_misaligned(a) for a in A.fa_inputs(rng, 1, 9, 40, 2, 1, 64, 64, kind))
    out, lse = ops.flash_attention(q, k, v, causal=True, return_lse=True, backend="host")
    ro, rl = A.np_flash_attention(q, k, v, True)
    _check({"out": out, "lse": lse}, {"out": ro, "lse": rl}, "flash_attention", kind)


# --------------------------------------------------------------------------- op semantics and argument checks


def test_rope_inplace_writes_into_x() -> None:
    _need("host")
    x = np.random.default_rng(7).standard_normal((2, 3, 2, 8)).astype(np.float32)
    cos, sin = F.rope_tables(10, 8)
    want = F.np_rope(x, cos, sin, 4, "half")
    y = ops.rope(x, cos, sin, pos_offset=4, style="half", inplace=True, backend="host")
    assert y is x
    _check({"x": x}, {"x": want}, "rope", "f32")


def test_flash_attention_rows_without_keys_are_zero_with_lse_minus_inf() -> None:
    _need("host")
    q, k, v = A.fa_inputs(np.random.default_rng(8), 1, 7, 3, 2, 1, 32, 32, "f32")
    out, lse = ops.flash_attention(q, k, v, causal=True, return_lse=True, backend="host")
    assert np.all(lse[0, :4] == -np.inf) and not out[0, :4].any()  # query i sees j <= i - 4
    assert np.all(np.isfinite(lse[0, 4:]))


def test_flash_attention_scale_and_default() -> None:
    _need("host")
    q, k, v = A.fa_inputs(np.random.default_rng(9), 1, 5, 6, 2, 2, 16, 16, "f32")
    got = ops.flash_attention(q, k, v, scale=0.3, backend="host")
    ref, _ = A.np_flash_attention(q, k, v, False, 0.3)
    _check({"o": got}, {"o": ref}, "flash_attention", "f32")


def test_argument_errors_name_the_argument() -> None:
    f32 = np.zeros((4, 8), np.float32)
    with pytest.raises(ArgumentError, match="ids"):
        ops.embedding(np.array([0, 4]), f32)
    with pytest.raises(ArgumentError, match="ids"):
        ops.embedding(np.array([-1]), f32)
    with pytest.raises(ArgumentTypeError, match="table"):
        ops.embedding(np.array([0]), f32.astype(np.float64))
    x = np.zeros((3, 2, 8), np.float32)
    cos, sin = F.rope_tables(4, 8)
    with pytest.raises(ArgumentError, match="pos_offset"):
        ops.rope(x, cos, sin, pos_offset=2)  # positions 2..4 need 5 rows
    with pytest.raises(ArgumentError, match="style"):
        ops.rope(x, cos, sin, style="neox")
    with pytest.raises(ArgumentError, match="cos"):
        ops.rope(x, cos[:, :3], sin)
    with pytest.raises(ArgumentError, match="head_dim"):
        ops.rope(np.zeros((3, 2, 7), np.float32), cos, sin)
    with pytest.raises(ArgumentError, match="up"):
        ops.silu_gate(f32, np.zeros((4, 9), np.float32))
    with pytest.raises(ArgumentTypeError, match="up"):
        ops.silu_gate(f32, f32.astype(F._cast(f32, "bf16").dtype))
    with pytest.raises(ArgumentError, match="weight"):
        ops.rms_norm(f32, np.zeros(7, np.float32))
    with pytest.raises(ArgumentError, match="past_len"):
        ops.causal_attn_softmax(np.zeros((2, 1, 3), np.float32), past_len=-1)
    with pytest.raises(ArgumentTypeError, match="scores"):
        ops.causal_attn_softmax(np.zeros((2, 1, 3), np.float64))
    q = np.zeros((1, 4, 6, 32), np.float32)
    with pytest.raises(ArgumentError, match="n_kv_heads"):
        ops.flash_attention(q, np.zeros((1, 4, 4, 32), np.float32), np.zeros((1, 4, 4, 32), np.float32))
    with pytest.raises(ArgumentError, match="head_dim"):
        big = np.zeros((1, 4, 1, 288), np.float32)
        ops.flash_attention(big, big, big)
    with pytest.raises(ArgumentError, match="k:"):
        ops.flash_attention(q, np.zeros((1, 4, 2, 16), np.float32), np.zeros((1, 4, 2, 16), np.float32))
    with pytest.raises(ArgumentError, match="v:"):
        ops.flash_attention(q, np.zeros((1, 4, 2, 32), np.float32), np.zeros((1, 5, 2, 32), np.float32))


# --------------------------------------------------------------------------- lse -> attention_backward


def _np_attention_grads(q, k, v, g):
    """float64 dq, dk, dv of causal attention, scale 1/sqrt(head_dim), GQA summed over the group."""
    q, k, v, g = (np.asarray(a).astype(np.float64) for a in (q, k, v, g))
    b, s, h, d = q.shape
    group = h // k.shape[2]
    kk, vv = np.repeat(k, group, 2), np.repeat(v, group, 2)
    scale = 1.0 / math.sqrt(d)
    sc = np.einsum("bqhd,bkhd->bhqk", q, kk) * scale
    sc = np.where(np.tril(np.ones((s, s), bool))[None, None], sc, -np.inf)
    p = np.exp(sc - sc.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    dv = np.einsum("bhqk,bqhd->bkhd", p, g)
    dp = np.einsum("bqhd,bkhd->bhqk", g, vv)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True)) * scale
    dq = np.einsum("bhqk,bkhd->bqhd", ds, kk)
    dk = np.einsum("bhqk,bqhd->bkhd", ds, q)
    fold = lambda t: t.reshape(b, s, k.shape[2], group, -1).sum(3)  # noqa: E731
    return dq, fold(dk), fold(dv)


@pytest.mark.parametrize("kind,s,h,kvh,d", [("f32", 37, 4, 2, 64), ("f32", 70, 2, 1, 80), ("bf16", 33, 2, 2, 128)])
def test_lse_feeds_attention_backward(kind: str, s: int, h: int, kvh: int, d: int) -> None:
    _need("host")
    if not hasattr(ops, "__dir__") or "attention_backward" not in dir(ops):
        pytest.skip("attention_backward is not in this checkout")
    rng = np.random.default_rng(10)
    q, k, v = A.fa_inputs(rng, 2, s, s, h, kvh, d, d, kind)
    g = F._normal(rng, q.shape, kind)
    out, lse = ops.flash_attention(q, k, v, causal=True, return_lse=True, backend="host")
    assert lse.shape == (2, s, h) and lse.dtype == np.float32
    dq, dk, dv = ops.attention_backward(q, k, v, g, out=out, lse=lse, backend="host")
    rq, rk, rv = _np_attention_grads(q, k, v, g)
    _check({"dq": dq, "dk": dk, "dv": dv}, {"dq": rq, "dk": rk, "dv": rv}, "attention_backward", kind)


# --------------------------------------------------------------------------- launch bounds
def test_every_kernel_declares_launch_bounds_covering_the_ops_blocks() -> None:
    # A block larger than a kernel can hold (its __launch_bounds__, or without one
    # whatever its register count allows: the row kernels run 1024 threads, so 64
    # registers at most) fails to launch on a GPU, which the host backend cannot show.
    from pykern.ops import forward as fwd
    from pykern.registry import parse_file
    from pykern.sources import KERNELS_DIR

    # the registry reads __launch_bounds__ also through macros (FA_THREADS) and PK_IO_KERNELS calls
    specs = {name: parse_file(KERNELS_DIR / name) for name in ("forward.cu", "attention_fwd_fma.cu")}
    unbounded = sorted(s.name for ss in specs.values() for s in ss if s.max_threads is None)
    assert not unbounded, f"kernels without __launch_bounds__: {unbounded}"
    bounds = {s.name: s.max_threads for ss in specs.values() for s in ss}
    # 6 families in f32, bf16 and f16 (rope_norm_backward the sixth), plus causal_attn_softmax (f32)
    assert len(specs["forward.cu"]) == 19 and "silu_gate_backward_f16" in bounds and "rope_norm_backward_f16" in bounds
    row_blocks = [fwd._row_geometry(1, n)[1] for n in (1, 64, 65, 1024, 1025, 4096, 4097, 10**6)]
    row_max = max(bx * by for bx, by in row_blocks)
    for k, bound in bounds.items():
        stem = k.removesuffix("_bf16").removesuffix("_f16")
        if stem in ("rms_norm", "causal_attn_softmax"):
            need = row_max
        elif stem.startswith("flash_attention"):
            need = fwd.FA_THREADS
        else:
            need = fwd._THREADS
        assert need <= bound, (k, need, bound)


def test_flash_attention_lengths_within_a_tile_of_int_max_are_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    # The kernel walks query and key tiles in int (q_tiles = n_q + ROWS - 1,
    # k0 += BK, row + n_k - n_q): a length within a tile of 2^31 - 1 would overflow
    # there, so the op must reject it from the shapes, before copying any input.
    from pykern.ops import forward as fwd

    def no_copy(a):
        raise AssertionError("the op copied its inputs before validating their shapes")

    monkeypatch.setattr(fwd.arrays, "contiguous", no_copy)
    z = np.zeros((1, 1, 1, 4), np.float32)
    big = np.broadcast_to(z, (1, 2**31 - 1, 1, 4))  # no memory behind it
    with pytest.raises(ArgumentError, match=r"k\.shape\[1\]"):
        fwd.flash_attention(z, big, big, backend="host")
    with pytest.raises(ArgumentError, match=r"q\.shape\[1\]"):
        fwd.flash_attention(big, z, z, causal=True, backend="host")
