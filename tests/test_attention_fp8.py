"""FP8 attention forward: flash_attention with float8_e4m3fn q, k, v and fp32 descales (FlashAttention-3's
flash_attn_func(q_descale=...)), kernels_cu/attention_fwd_fp8_sm90.cu on sm_90a.

On the host backend playing sm_90a (PYKERN_HOST_ARCH=sm_90a: TMA, mbarrier and the e4m3 wgmma SS / RS emulated)
the FP8 kernel is the one launched and its bf16 output is within the relative-RMS row ("flash_attention_rel_rms",
"fp8") of float64 attention on the dequantized inputs (x8 * descale), causal and not, head_dim 64 / 128 / 256, GQA,
n_q != n_k both ways, per-tensor and per-(batch, kv head) descales, softcap (the _softcap kernels); its lse is the
float64 one's; its steady loop stays pipelined (SASS: QGMMA, UTMALDG, no spills, the loop bars); it gives the same
bits under every host schedule (the in-kernel V transpose and its barrier carry no race); its epilogue (O staged in
V slot c) is clean under racecheck and needs its warpgroup barrier. Without sm_90a the op dequantizes to bf16 and
runs the bf16 path within the same bound. Bad descales or mixed dtypes are errors naming the argument before any
launch; pykern.torch.flash_attention takes fp8 tensors and refuses requires_grad.
"""
from __future__ import annotations

import re
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from pykern import ops
from pykern.difftest.cases.attention import np_flash_attention, window_mask
from pykern.errors import ArgumentError, ArgumentTypeError
from pykern.ops import _attention_sm90 as sm90
from pykern.tolerance import tolerance
from launch_spy import record_launches as _record
from attn_checks import sm90_host  # noqa: F401 (a fixture)

E4M3 = ml_dtypes.float8_e4m3fn
E4M3_MAX = 448.0


def quantize(x: np.ndarray, n_kv: int, per_head: bool) -> tuple[np.ndarray, np.ndarray]:
    """(x8, descale) as FP8 callers make them: descale = amax / 448 over the tensor (shape (1,)) or per (batch,
    kv head) (shape (batch, n_kv); a query head's rows go with its kv head), x8 = e4m3(x / descale)."""
    b, _, h, _ = x.shape
    g = h // n_kv
    if per_head:
        amax = np.abs(x).reshape(b, x.shape[1], n_kv, g, -1).max(axis=(1, 3, 4))
        ds = (amax / E4M3_MAX).astype(np.float32)
        full = np.repeat(ds, g, axis=1)[:, None, :, None]
    else:
        ds = np.array([np.abs(x).max() / E4M3_MAX], np.float32)
        full = ds[0]
    return (x / full).astype(E4M3), ds


def dequantized(x8: np.ndarray, ds: np.ndarray, n_kv: int) -> np.ndarray:
    """x8 * descale in float64 (the values the FP8 op stands for)."""
    x = x8.astype(np.float64)
    if ds.size == 1:
        return x * float(ds.reshape(-1)[0])
    return x * np.repeat(ds.astype(np.float64), x.shape[2] // n_kv, axis=1)[:, None, :, None]


def fp8_inputs(seed: int, b: int, n_q: int, n_k: int, h: int, n_kv: int, d: int, per_head: bool):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, n_q, h, d)).astype(np.float32)
    k = rng.standard_normal((b, n_k, n_kv, d)).astype(np.float32)
    v = rng.standard_normal((b, n_k, n_kv, d)).astype(np.float32)
    if per_head:  # heads of different ranges, so a descale applied to the wrong head shows
        q *= rng.uniform(0.5, 2.0, (b, 1, h, 1)).astype(np.float32)
        v *= rng.uniform(0.5, 2.0, (b, 1, n_kv, 1)).astype(np.float32)
    (q8, qd), (k8, kd), (v8, vd) = (quantize(x, n_kv, per_head) for x in (q, k, v))
    return q8, k8, v8, qd, kd, vd


def rel_rms(got: np.ndarray, ref: np.ndarray) -> float:
    got = np.asarray(got).astype(np.float64)
    return float(np.sqrt(np.mean((got - ref) ** 2) / np.mean(ref ** 2)))


def check(out, lse, q8, k8, v8, qd, kd, vd, n_kv, causal, window_size=(-1, -1)) -> float:
    ref, ref_lse = np_flash_attention(dequantized(q8, qd, n_kv), dequantized(k8, kd, n_kv),
                                      dequantized(v8, vd, n_kv), causal, None, window_size)
    assert np.asarray(out).dtype == ml_dtypes.bfloat16
    err = rel_rms(out, ref)
    assert err <= tolerance("flash_attention_rel_rms", "fp8")[1], err
    # rows that see no key: out 0, lse -inf; lse elsewhere from fp32 scores of the exact e4m3 products
    empty = np.isneginf(ref_lse)
    np.testing.assert_array_equal(np.isneginf(lse), empty)
    assert not np.asarray(out).astype(np.float32)[empty].any()
    atol, rtol = tolerance("flash_attention", "bf16")
    fin = ~empty
    assert np.all(np.abs(lse[fin] - ref_lse[fin]) <= atol + rtol * np.abs(ref_lse[fin]))
    return err


SHAPES = [
    # (batch, n_q, n_k, heads, kv_heads, head_dim, causal, per-head descales)
    (1, 130, 200, 2, 1, 64, False, False),  # off the 128-query / 128-key tiles, GQA 2
    (1, 257, 257, 2, 2, 64, True, True),    # three query and key tiles: masked and full ones
    (2, 100, 300, 4, 1, 128, True, True),   # n_q < n_k, GQA 4, batch 2
    (1, 200, 70, 2, 1, 128, True, False),   # n_q > n_k: the first 130 rows see no key
    (1, 129, 384, 8, 2, 128, False, True),  # full tiles only, GQA 4
    (1, 70, 200, 2, 1, 256, True, False),   # d256
]


@pytest.mark.usefixtures("sm90_host")
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}-q{}-k{}-h{}/{}-d{}-{}-{}".format(
    *s[:6], "causal" if s[6] else "full", "head" if s[7] else "tensor"))
def test_fp8_forward_sm90_vs_float64(shape, monkeypatch) -> None:
    b, n_q, n_k, h, n_kv, d, causal, per_head = shape
    q8, k8, v8, qd, kd, vd = fp8_inputs(1, b, n_q, n_k, h, n_kv, d, per_head)
    names = _record(monkeypatch)
    out, lse = ops.flash_attention(q8, k8, v8, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd,
                                   return_lse=True, backend="host")
    assert names == [sm90.fp8_kernel_name(d)]
    check(out, lse, q8, k8, v8, qd, kd, vd, n_kv, causal)


@pytest.mark.usefixtures("sm90_host")
def test_fp8_forward_sm90_window_and_scale(monkeypatch) -> None:
    q8, k8, v8, qd, kd, vd = fp8_inputs(2, 1, 150, 260, 2, 1, 64, True)
    names = _record(monkeypatch)
    out, lse = ops.flash_attention(q8, k8, v8, window_size=(100, 20), q_descale=qd, k_descale=kd, v_descale=vd,
                                   return_lse=True, backend="host")
    assert names == [sm90.fp8_kernel_name(64)]
    check(out, lse, q8, k8, v8, qd, kd, vd, 1, False, (100, 20))


def e4m3_floor(q: np.ndarray, k: np.ndarray, v: np.ndarray, causal: bool, keys: int) -> np.ndarray:
    """The FP8 forward's algorithm in float64 but for P: fp32 scores in log2 units, the exact online softmax over
    key tiles of `keys` in the kernel's order (the last tile first), P = 2^(s - m + 3) rounded to e4m3 (so each
    tile's new row max gives P = 8 exactly), l summed from the unrounded P, out rounded to bf16. What any kernel
    that rounds P to e4m3 this way reaches: the floor of its relative RMS error. q (B, n_q, H, D), k, v (B, n_k,
    KV, D) dequantized; returns out (B, n_q, H, D)."""
    n_q, d, n_k = q.shape[1], q.shape[3], k.shape[1]
    g = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
    s = (np.einsum("bqhd,bkhd->bhqk", q, k) / (np.sqrt(d) * np.log(2.0))).astype(np.float32).astype(np.float64)
    s = np.where(window_mask(n_q, n_k, causal, (-1, -1))[None, None], s, -np.inf)
    m = np.full(s.shape[:-1] + (1,), -np.inf)
    l, o = np.zeros_like(m), np.zeros(s.shape[:-1] + (d,))
    for j in reversed(range(0, n_k, keys)):
        t = s[..., j:j + keys]
        mn = np.maximum(m, t.max(-1, keepdims=True))
        base = np.where(np.isfinite(mn), mn, 0.0)
        al = np.where(np.isfinite(m), np.exp2(m - base), 0.0)
        p = np.exp2(t - base + 3)
        l = l * al + p.sum(-1, keepdims=True)
        o = o * al + np.einsum("bhqk,bkhd->bhqd", p.astype(np.float32).astype(E4M3).astype(np.float64),
                               v[:, j:j + keys])
        m = mn
    o = np.divide(o, l, out=np.zeros_like(o), where=l > 0)
    return o.transpose(0, 2, 1, 3).astype(ml_dtypes.bfloat16)


# The floor (e4m3_floor) over a sweep of d 64 / 128 / 256, n_q and n_k in 64 .. 1000, causal and not, two seeds,
# per-tensor and per-head descales (432 shapes, as fp8_inputs makes them): 1.12e-2 to 2.54e-2, above 2.5e-2 on
# two (diffuse rows over random v: a head whose q range is small). No e4m3-P kernel meets the 2.5e-2 bound there,
# so these, the sweep's hardest, hold the kernel to the floor instead: (seed, n_q, n_k, heads, kv heads, head_dim,
# causal, per-head descales, the floor). The lazy softmax that let a row max grow unrounded measured 1.05 to 1.38
# times the floor on them.
FLOOR_SHAPES = [
    (10, 700, 1000, 2, 1, 256, False, True, 2.541e-2),  # the floor above 2.5e-2
    (10, 64, 1000, 2, 1, 256, True, True, 2.432e-2),
    (10, 130, 700, 2, 1, 64, False, True, 2.473e-2),
    (1, 129, 384, 8, 2, 128, False, True, 1.727e-2),    # 1.38 times the floor before
]


@pytest.mark.usefixtures("sm90_host")
@pytest.mark.parametrize("shape", FLOOR_SHAPES, ids=lambda s: "s{}-q{}-k{}-h{}/{}-d{}-{}".format(
    *s[:6], "causal" if s[6] else "full"))
def test_fp8_forward_sm90_reaches_the_e4m3_floor(shape, monkeypatch) -> None:
    seed, n_q, n_k, h, n_kv, d, causal, per_head, want = shape
    q8, k8, v8, qd, kd, vd = fp8_inputs(seed, 1, n_q, n_k, h, n_kv, d, per_head)
    names = _record(monkeypatch)
    out = ops.flash_attention(q8, k8, v8, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd, backend="host")
    assert names == [sm90.fp8_kernel_name(d)]
    deq = [dequantized(x, ds, n_kv) for x, ds in ((q8, qd), (k8, kd), (v8, vd))]
    ref, _ = np_flash_attention(*deq, causal)
    floor = rel_rms(e4m3_floor(*deq, causal, sm90.FP8_KEYS[d]), ref)
    assert abs(floor - want) <= 1e-3 * want, floor  # the floor the docs state
    # within 1% of it: the kernel's tiles are the model's (the row max first: each tile's exact online softmax) but
    # for ex2.approx and fp32 sums; it measures 1.0000 times the floor on all four
    err = rel_rms(out, ref)
    assert err <= 1.01 * floor, (err, floor)


@pytest.mark.usefixtures("sm90_host")
@pytest.mark.parametrize("schedule", ["reverse", "random:7"])
def test_fp8_forward_sm90_same_bits_under_other_schedules(schedule, monkeypatch) -> None:
    q8, k8, v8, qd, kd, vd = fp8_inputs(3, 1, 129, 300, 2, 1, 128, True)
    run = lambda: ops.flash_attention(q8, k8, v8, causal=True, q_descale=qd, k_descale=kd, v_descale=vd,  # noqa: E731
                                      return_lse=True, backend="host")
    out0, lse0 = run()
    monkeypatch.setenv("PYKERN_HOST_SCHEDULE", schedule)
    out1, lse1 = run()
    np.testing.assert_array_equal(out0.view(np.uint16), out1.view(np.uint16))
    np.testing.assert_array_equal(lse0, lse1)


# ---- the d128 / d256 ping-pong (FA90F8_PP): the two consumer warpgroups take turns issuing their steady steps'
# wgmmas, the hand-over publishing the warpgroup's half of the tile's V^T (4 V^T slots there). Five full key tiles
# (128 keys at d128, 64 at d256): the first peeled off, four steps of the ping-pong loop (the V^T slots wrap).
PP_SHAPE = {d: (1, 130, 5 * sm90.FP8_KEYS[d], 2, 1, d, False, True) for d in (128, 256)}


def _pp_run(d: int = 128, seed: int = 10):
    b, n_q, n_k, h, n_kv, d, causal, per_head = PP_SHAPE[d]
    q8, k8, v8, qd, kd, vd = fp8_inputs(seed, b, n_q, n_k, h, n_kv, d, per_head)
    out, lse = ops.flash_attention(q8, k8, v8, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd,
                                   return_lse=True, backend="host")
    return out, lse, (q8, k8, v8, qd, kd, vd, n_kv, causal)


@pytest.mark.usefixtures("sm90_host")
@pytest.mark.parametrize("d", sorted(PP_SHAPE))
def test_fp8_ping_pong_steps_match_float64_under_every_schedule(d, monkeypatch) -> None:
    names = _record(monkeypatch)
    out0, lse0, args = _pp_run(d)
    assert names == [sm90.fp8_kernel_name(d)] and sm90.FP8_PING_PONG[d]
    check(out0, lse0, *args)
    for schedule in ("reverse", "random:3", "random:11"):
        monkeypatch.setenv("PYKERN_HOST_SCHEDULE", schedule)
        out1, lse1, _ = _pp_run(d)
        np.testing.assert_array_equal(out0.view(np.uint16), out1.view(np.uint16), err_msg=schedule)
        np.testing.assert_array_equal(lse0, lse1, err_msg=schedule)


SRC = Path(__file__).resolve().parent.parent / "kernels_cu" / "attention_fwd_fp8_sm90.cu"
_OPENING = "        if (PP && c == 1 && steps) pk_bar_arrive_aligned(FA90F8_BAR_PP, 256);\n"


def _pp_mutant(tmp_path, monkeypatch, old: str, new: str) -> None:
    """The FP8 source with old replaced and its kernels renamed fa90f8_mutant_d*; the op launches the mutant's."""
    from pykern import launcher
    from sm90_mutants import write_mutant

    # the varlen kernels renamed first (into a folder off the kernel path), so no name is defined twice
    (tmp_path / "src").mkdir()
    src = tmp_path / "src" / SRC.name
    src.write_text(SRC.read_text().replace("attention_fwd_varlen_sm90_d", "fa90f8_mutant_varlen_d"))
    write_mutant(tmp_path, monkeypatch, src, old, new, "fa90f8_mutant.cu", ("attention_fwd_sm90_d", "fa90f8_mutant_d"))
    launch = launcher.launch
    monkeypatch.setattr(launcher, "launch", lambda name, *a, **kw: launch(
        name.replace("attention_fwd_sm90_d", "fa90f8_mutant_d"), *a, **kw))


@pytest.mark.usefixtures("sm90_host")
@pytest.mark.parametrize("d", sorted(PP_SHAPE))
def test_fp8_ping_pong_never_opened_is_a_deadlock_naming_its_barriers(d, tmp_path, monkeypatch) -> None:
    # Consumer 1 never gives consumer 0 its first turn: consumer 0 waits on named barrier 3, consumer 1 on 4,
    # forever (a hang on the GPU); the host names both barriers and their arrivals.
    from pykern.errors import KernelExecutionError

    _pp_mutant(tmp_path, monkeypatch, _OPENING, "")
    with pytest.raises(KernelExecutionError, match=(
            rf"kernel fa90f8_mutant_d{d}_fp8: block \(\d+,0,0\): .*128 of 256 threads arrived at named barrier 3 "
            r"\(first at .*fa90f8_mutant\.cu:\d+\); 128 of 256 threads arrived at named barrier 4")):
        _pp_run(d)


# ---- d64's overlapped steps (FA90F8_OVL without the ping-pong): S and P V^T two groups, the softmax under P V^T,
# wait<0>, then the V^T barrier (the 2 V^T slots alternate). Five full key tiles: the first peeled off, four steps.
OVL64_SHAPE = (1, 130, 5 * sm90.FP8_KEYS[64], 2, 1, 64, False, True)
_OVL64_VT_BAR = "                    if constexpr (!PP) pk_bar_sync_aligned(FA90F8_BAR_VT, 256);\n"
_OVL64_SOFTMAX = "                    const bool any = fa90f8_softmax_mf_p<D, FEX>(s, m, mo, sum, sl2);\n"


def _ovl64_run(seed: int = 10):
    b, n_q, n_k, h, n_kv, d, causal, per_head = OVL64_SHAPE
    q8, k8, v8, qd, kd, vd = fp8_inputs(seed, b, n_q, n_k, h, n_kv, d, per_head)
    out, lse = ops.flash_attention(q8, k8, v8, causal=causal, q_descale=qd, k_descale=kd, v_descale=vd,
                                   return_lse=True, backend="host")
    return out, lse, (q8, k8, v8, qd, kd, vd, n_kv, causal)


@pytest.mark.usefixtures("sm90_host")
@pytest.mark.parametrize("where", ["before-wait", "none"])
def test_fp8_d64_overlap_is_clean_under_racecheck_and_needs_the_vt_barrier_after_its_wait(where, tmp_path,
                                                                                           monkeypatch) -> None:
    # Racecheck-clean over four overlapped steps. The V^T barrier met before this warpgroup's wait<0> (right after
    # its softmax, its P V^T of tile n - 1 possibly still reading the V^T slot): the other warpgroup's next
    # transpose into that slot is a write after the wgmma's read, which only a wait retires. No V^T barrier: a
    # wgmma reads the half of V^T the other warpgroup wrote with nothing ordering that write before it. (The plain
    # build gets both wrong too, far outside the FP8 tolerance, under the default schedule.)
    from pykern.errors import KernelExecutionError

    names = _record(monkeypatch)
    monkeypatch.setenv("PYKERN_HOST_RACECHECK", "1")
    out, lse, args = _ovl64_run()
    assert names == [sm90.fp8_kernel_name(64)] and not sm90.FP8_PING_PONG[64]
    check(out, lse, *args)
    if where == "before-wait":
        src = SRC.read_text()
        assert src.count(_OVL64_VT_BAR) == 1 and src.count(_OVL64_SOFTMAX) == 1
        _pp_mutant(tmp_path, monkeypatch, _OVL64_SOFTMAX, _OVL64_SOFTMAX + _OVL64_VT_BAR)
        # the barrier now stands twice: the mutant drops the one after the wait (write_mutant replaced once)
        text = (tmp_path / "fa90f8_mutant.cu").read_text()
        head, tail = text.split(_OVL64_SOFTMAX + _OVL64_VT_BAR, 1)
        (tmp_path / "fa90f8_mutant.cu").write_text(head + _OVL64_SOFTMAX + _OVL64_VT_BAR + tail.replace(
            _OVL64_VT_BAR, "", 1))
    else:
        _pp_mutant(tmp_path, monkeypatch, _OVL64_VT_BAR, "")
    race = {"before-wait": "write-after-read", "none": "read-after-write"}[where]
    with pytest.raises(KernelExecutionError, match=rf"racecheck: {race} race through the async proxy"):
        _ovl64_run()


@pytest.mark.usefixtures("sm90_host")
@pytest.mark.parametrize("d", [64, 128])
def test_fp8_softcap_steps_with_fma_exp2s_match_float64(d, monkeypatch) -> None:
    """The d64 and d128 softcap kernels' overlapped steps (five key tiles: OVL64_SHAPE, PP_SHAPE with the ping-pong
    at d128), a quarter of their exp2s on the FMA pipe (FA90F8_FEX: pk_exp2_fma, relative error 8.6e-5 before P's
    e4m3 rounding): within the FP8 row of float64 attention with the cap, racecheck-clean."""
    b, n_q, n_k, h, n_kv, d, causal, per_head = OVL64_SHAPE if d == 64 else PP_SHAPE[d]
    q8, k8, v8, qd, kd, vd = fp8_inputs(12, b, n_q, n_k, h, n_kv, d, per_head)
    names = _record(monkeypatch)
    monkeypatch.setenv("PYKERN_HOST_RACECHECK", "1")
    sc, cap = 4.0 / np.sqrt(d), 6.0  # scores up to about 16-20: c = 6 changes the result
    out, lse = ops.flash_attention(q8, k8, v8, causal=causal, softcap=cap, scale=sc, q_descale=qd, k_descale=kd,
                                   v_descale=vd, return_lse=True, backend="host")
    assert names == [sm90.fp8_kernel_name(d, cap)] and FP8_EXP2_FMA[d, 1.0] == 1
    dq_, dk_, dv_ = (dequantized(x, s, n_kv) for x, s in ((q8, qd), (k8, kd), (v8, vd)))
    ref, ref_lse = np_flash_attention(dq_, dk_, dv_, causal, sc, (-1, -1), cap)
    err = rel_rms(out, ref)
    assert err <= tolerance("flash_attention_rel_rms", "fp8")[1], err
    assert rel_rms(np_flash_attention(dq_, dk_, dv_, causal, sc)[0], ref) > 10 * err  # the cap applied
    atol, rtol = tolerance("flash_attention", "bf16")
    assert np.all(np.abs(lse - ref_lse) <= atol + rtol * np.abs(ref_lse))


@pytest.mark.usefixtures("sm90_host")
def test_fp8_descales_fold_into_the_result(monkeypatch) -> None:
    """Descales of 1 against per-tensor ones: out scales with v_descale, the softmax with q_descale * k_descale."""
    q8, k8, v8, _, _, _ = fp8_inputs(4, 1, 64, 128, 2, 2, 64, False)
    one = np.ones((1,), np.float32)
    base = ops.flash_attention(q8, k8, v8, q_descale=one, k_descale=one, v_descale=one, backend="host")
    same = ops.flash_attention(q8, k8, v8, backend="host")  # None: 1
    np.testing.assert_array_equal(base.view(np.uint16), same.view(np.uint16))
    vd = ops.flash_attention(q8, k8, v8, v_descale=np.full((1, 2), 4.0, np.float32), backend="host")
    np.testing.assert_allclose(vd.astype(np.float32), 4.0 * base.astype(np.float32), rtol=0, atol=0)
    # q_descale 2 with the scale halved: the same scores, the same bits
    sc = 0.5 / np.sqrt(64)
    two = ops.flash_attention(q8, k8, v8, q_descale=np.float32(2.0) * one, scale=sc, backend="host")
    np.testing.assert_array_equal(two.view(np.uint16), base.view(np.uint16))


@pytest.mark.parametrize("where", ["numba", "host-sm80", "host-sm90-off"])
def test_fp8_forward_elsewhere_dequantizes_to_bf16(where, monkeypatch) -> None:
    q8, k8, v8, qd, kd, vd = fp8_inputs(5, 1, 70, 90, 4, 2, 64, True)
    monkeypatch.setenv("PYKERN_HOST_ARCH", "" if where == "host-sm80" else "sm_90a")
    monkeypatch.setenv("PYKERN_SM90", "0" if where == "host-sm90-off" else "1")
    names = _record(monkeypatch)
    out, lse = ops.flash_attention(q8, k8, v8, causal=True, q_descale=qd, k_descale=kd, v_descale=vd,
                                   return_lse=True, backend="numba" if where == "numba" else "host")
    assert names and not any("fp8" in n for n in names)
    check(out, lse, q8, k8, v8, qd, kd, vd, 2, True)


def test_fp8_errors_name_the_argument_before_any_launch(monkeypatch) -> None:
    q8, k8, v8, qd, kd, vd = fp8_inputs(6, 2, 8, 8, 4, 2, 64, True)
    names = _record(monkeypatch)
    bf = ml_dtypes.bfloat16
    with pytest.raises(ArgumentTypeError, match=r"^k: expected dtype float8_e4m3fn \(as q\), got bfloat16"):
        ops.flash_attention(q8, k8.astype(bf), v8, backend="host")
    with pytest.raises(ArgumentTypeError, match=r"^v: expected dtype float8_e4m3fn \(as q\), got float32"):
        ops.flash_attention(q8, k8, v8.astype(np.float32), backend="host")
    with pytest.raises(ArgumentTypeError, match=r"^k_descale: expected it with float8_e4m3fn q, k and v .*got q of "
                                                r"dtype bfloat16"):
        ops.flash_attention(q8.astype(bf), k8.astype(bf), v8.astype(bf), k_descale=kd, backend="host")
    with pytest.raises(ArgumentTypeError, match=r"^v_descale: expected dtype float32, got float64"):
        ops.flash_attention(q8, k8, v8, v_descale=vd.astype(np.float64), backend="host")
    with pytest.raises(ArgumentError, match=r"^k_descale: expected shape \(\) or \(1,\).*\(2, 2\), got \(2, 4\)"):
        ops.flash_attention(q8, k8, v8, k_descale=np.ones((2, 4), np.float32), backend="host")
    with pytest.raises(ArgumentError, match=r"^q_descale: expected a finite number, got nan"):
        ops.flash_attention(q8, k8, v8, q_descale=float("nan"), backend="host")
    assert names == []


def test_fp8_torch_forward_and_no_autograd() -> None:
    torch = pytest.importorskip("torch")
    import pykern.torch as pt

    q8, k8, v8, qd, kd, vd = fp8_inputs(7, 1, 40, 50, 2, 1, 64, False)
    tq, tk, tv = (torch.from_numpy(x.view(np.uint8)).view(torch.float8_e4m3fn) for x in (q8, k8, v8))
    out = pt.flash_attention(tq, tk, tv, causal=True, q_descale=torch.from_numpy(qd), k_descale=torch.from_numpy(kd),
                             v_descale=torch.from_numpy(vd))
    assert out.dtype == torch.bfloat16 and out.shape == (1, 40, 2, 64)
    ref = np_flash_attention(dequantized(q8, qd, 1), dequantized(k8, kd, 1), dequantized(v8, vd, 1), True)[0]
    assert rel_rms(out.float().numpy(), ref) <= tolerance("flash_attention_rel_rms", "fp8")[1]
    with pytest.raises(ArgumentError, match=r"requires_grad"):
        pt.flash_attention(tq.float().requires_grad_().to(torch.float8_e4m3fn), tk, tv)


# The steady-state loop's warp-instructions per m16n8k16-equivalent (tools/sass_report.py --loops; an e4m3 wgmma
# m64nNk32 counts 2N/8). The first kernel ran an exact softmax (row max, shuffles, rescale of O) and the mask check
# on every tile, one tile's S, transpose, softmax and P V^T after another: 6.289 at d64, 3.27 at d128. Now (lazy
# softmax, the mask only on boundary tiles, S of the next tile issued with P V^T of the previous one) 3.0 / 1.488:
# pinned there so neither grows. The _softcap kernels add an FMUL and a tanh.approx (MUFU) a score, 128
# instructions a tile: 4.0 / 2.008. d128 ping-pongs its consumer warpgroups (FA90F8_PP): the turn's BAR.SYNC and
# BAR.ARV replace the V^T barrier's BAR.SYNC; the plain loop stays at 381 instructions (1.488), the _softcap one
# takes 518 (2.023, from 514): the BAR.ARV and 3 register moves (the two barrier ids live through its tanh-heavier
# loop). d256 ran a tile at a time (its transpose a two-pass loop: no flat loop); with 64-key tiles it has the
# d128 loop, ping-pong included: 279 instructions for 256 (1.09), with softcap 344 (1.344). The lazy tile's test
# on its e4m3 words (accepted only where no P rounds above 8: an IADD a word, ORed, in place of two FSETP of the
# partial sums) took d64 384 -> 396 (3.094), d128 381 -> 397 (1.551), d256 279 -> 286 (1.117), with softcap
# 512 -> 524 (4.094), 518 -> 525 (2.051), 344 -> 352 (1.375). The row max first (FA90F8_MF: the max, its shuffles
# and the vote every tile, the rescale of O and l inline behind the vote, no redo path after the loop: the static
# body counts the rescale, which a tile issues only where a row of the warp grew) takes them to d64 552 (4.312),
# d128 593 (2.316), d256 493 (1.926), with softcap 680 (5.312), 721 (2.816), 557 (2.176); without the rescale block
# (42 / 74 / 138) 510 / 519 / 355, where the lazy loop added its redo (410 / 444 / 332) at the same rate. FA3's
# intra-warpgroup overlap at d128 / d256 (FA90F8_OVL: S and P V^T two groups, wait<1>, the max / exp2 / l, then
# wait<0> and the rescale of O) takes d128 to 595 (2.324), d256 495 (1.934), with softcap 723 (2.824), 559 (2.184):
# the second commit and wait, the old max kept for the rescale's factor, the rescale block's wait; without the
# rescale block (71 / 135) 524 / 360. The same overlap at d64 (no ping-pong: the V^T barrier after the caller's
# wait<0>) takes d64 552 -> 554 (4.328), with softcap 680 -> 682; a quarter of the softcap tile's exp2s on the FMA
# pipe (FA90F8_FEX: 16 pk_exp2_fma, about 8 instructions more each than a MUFU.EX2) then 682 -> 811 (6.336): more
# instructions for a lighter MUFU, its binding term (the attention model's --fp8 terms, a modelled bound). The same
# at d128 with softcap (MUFU-bound too): 723 -> 852 (3.328).
FP8_LOOP_BAR = {(64, 0.0): 4.328, (128, 0.0): 2.324, (256, 0.0): 1.934, (64, 1.0): 6.336, (128, 1.0): 3.328,
                (256, 1.0): 2.184}
# FA90F8_FEX: of every 4 n-tiles (8 keys) of a steady tile, those whose exp2s run on the FMA pipe (pk_exp2_fma)
FP8_EXP2_FMA = {(64, 1.0): 1, (128, 1.0): 1}


@pytest.fixture(scope="module")
def fp8_sass():
    from pathlib import Path
    from sass_helpers import compile_sass, report

    src = Path(__file__).resolve().parent.parent / "kernels_cu" / "attention_fwd_fp8_sm90.cu"
    mod, text = compile_sass(src, "sm_90a")
    return mod, text, report().steady_state_loops(text)


@pytest.mark.parametrize("d,cap", sorted(FP8_LOOP_BAR))
def test_fp8_steady_loop_is_pipelined(d, cap, fp8_sass) -> None:
    mod, text, loops = fp8_sass
    loop = loops[sm90.fp8_kernel_name(d, cap)]
    # S (keys x d) and P V^T (d x keys) of one tile a warp: 2 * keys * d / 128 m16n8k16-equivalents
    assert loop["mma"] == 2 * sm90.FP8_KEYS[d] * d // 128
    assert loop["per_mma"] <= FP8_LOOP_BAR[d, cap], loop
    # the V^T barrier only; at d128 / d256 (ping-pong) the turn's BAR.SYNC and BAR.ARV instead (test below)
    assert loop["bar"] == (2 if sm90.FP8_PING_PONG[d] else 1) and loop["ldsm"] == 0 and loop["ldgsts"] == 0


_INSN = re.compile(r"/\*([0-9a-f]{4,6})\*/\s+((?:@!?U?P\w+\s+)?[A-Z][^;]*);")


def _loop_insns(fp8_sass, name: str) -> tuple[str, list[str]]:
    """(the kernel's SASS, the instructions of its steady loop in order) from the fp8_sass fixture."""
    _, text, loops = fp8_sass
    body = text.split(f"Function : {name}\n", 1)[1].split("Function :", 1)[0]
    lo, hi = int(loops[name]["start"], 16), int(loops[name]["end"], 16)
    return body, [m[2].strip() for m in _INSN.finditer(body) if lo <= int(m[1], 16) <= hi]


@pytest.mark.parametrize("d,cap", sorted(FP8_LOOP_BAR))
def test_fp8_steady_loop_ping_pongs_from_d128(d, cap, fp8_sass) -> None:
    # FA3's warp scheduler barriers, as the bf16 d128 kernel (here at d128 and d256): each step's QGMMA group is issued between a BAR.SYNC
    # on this warpgroup's named barrier (id in a register: 3 or 4) and a BAR.ARV on the other's, both over the two
    # consumer warpgroups (256 threads = 0x100); no QGMMA of the loop lies outside a turn, and the V^T barrier
    # (BAR.SYNC 0x1) is out of the loop. Consumer 1 opens the game once outside it (BAR.ARV 0x3, 0x100). d64
    # keeps its V^T barrier in the loop and has no turns.
    body, insns = _loop_insns(fp8_sass, sm90.fp8_kernel_name(d, cap))
    sync = re.compile(r"BAR\.SYNC(\.DEFER_BLOCKING)? R\d+, 0x100$")
    arv = re.compile(r"BAR\.ARV R\d+, 0x100$")
    vt = re.compile(r"BAR\.SYNC(\.DEFER_BLOCKING)? 0x1, 0x100$")
    if not sm90.FP8_PING_PONG[d]:
        assert sum(bool(vt.match(i)) for i in insns) == 1 and "BAR.ARV" not in body
        assert not any(sync.match(i) for i in insns)
        return
    assert not any(vt.match(i) for i in insns)
    assert sum(bool(sync.match(i)) for i in insns) == 1 and sum(bool(arv.match(i)) for i in insns) == 1
    inside, group, outside = False, 0, 0
    for i in insns:
        if sync.match(i):
            inside = True
        elif arv.match(i):
            # S's d / 32 k-steps and P V^T's keys / 32 (d128: 4 + 4, d256: 8 + 2)
            assert inside and group == d // 32 + sm90.FP8_KEYS[d] // 32, group
            inside = False
        elif i.startswith("QGMMA"):
            group, outside = group + inside, outside + (not inside)
    assert outside == 0 and not inside
    assert len(re.findall(r"BAR\.ARV 0x3, 0x100\s*;", body)) == 1


@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("d,cap", sorted(FP8_LOOP_BAR))
def test_fp8_steady_loop_overlaps_the_softmax_with_p_v(d, cap, varlen, fp8_sass) -> None:
    # FA3's intra-warpgroup overlap at every head dim (FA90F8_OVL), dense and varlen: S's QGMMAs close a group (gsb0)
    # before P V^T's open theirs, the loop waits for S alone (DEPBAR.LE gsb0, 0x1), and every MUFU of the tile (the
    # exp2s, with softcap the tanhs) but the rescale block's 2 lies between that wait and the first wait for P V^T
    # (0x0): ptxas hoists that wait above them when it shares their block (see fa90f8_forward's steady loop). d64
    # (no ping-pong): its V^T barrier (BAR.SYNC 0x1) after both waits. The exp2s FA90F8_FEX moves to the FMA pipe
    # (one FADD.RM each, pk_exp2_fma's floor) lie there too, and the MUFU.EX2 count is what is left.
    name = (sm90.fp8_varlen_kernel_name if varlen else sm90.fp8_kernel_name)(d, cap)
    _, insns = _loop_insns(fp8_sass, name)
    w1 = [k for k, i in enumerate(insns) if i.startswith("WARPGROUP.DEPBAR.LE gsb0, 0x1")]
    w0 = [k for k, i in enumerate(insns) if i.startswith("WARPGROUP.DEPBAR.LE gsb0, 0x0")]
    mufu = [k for k, i in enumerate(insns) if i.startswith("MUFU")]
    ex2 = [k for k, i in enumerate(insns) if i.startswith("MUFU.EX2")]
    fex = [k for k, i in enumerate(insns) if i.startswith("FADD.RM")]
    qg = [i for i in insns if i.startswith("QGMMA")]
    assert len(w1) == 1 and len(w0) == 2 and w1[0] < w0[0]  # the second: after the rescale block's
    s_steps, pv_steps = d // 32, sm90.FP8_KEYS[d] // 32
    assert len(qg) == s_steps + pv_steps and qg[s_steps - 1].endswith("gsb0") and qg[-1].endswith("gsb0")
    assert sum(q.endswith("gsb0") for q in qg) == 2
    under = [k for k in mufu if w1[0] < k < w0[0]]
    # a score's exp2 (and tanh) each: keys x 64 rows / 128 threads = keys / 2 a thread; FEX of every 4 n-tiles (keys
    # / 8 n-tiles, 4 scores a thread each) on the FMA pipe
    keys, fx = sm90.FP8_KEYS[d], FP8_EXP2_FMA.get((d, cap), 0)
    moved = fx * (keys // 8 // 4) * 4
    assert len(fex) == moved and all(w1[0] < k < w0[0] for k in fex), fex
    assert len(ex2) == keys // 2 - moved + 2  # + the rescale block's 2
    assert len(under) == (keys // 2) * (2 if cap else 1) - moved == len(mufu) - 2, (len(under), len(mufu))
    vt = [k for k, i in enumerate(insns) if re.match(r"BAR\.SYNC(\.DEFER_BLOCKING)? 0x1, 0x100$", i)]
    assert len(vt) == (0 if sm90.FP8_PING_PONG[d] else 1) and all(k > w0[1] for k in vt)


@pytest.mark.parametrize("cap", [0.0, 1.0])
@pytest.mark.parametrize("d", sm90.FP8_HEAD_DIMS)
def test_fp8_kernels_use_qgmma_and_tma_without_spills(d, cap, fp8_sass) -> None:
    from sass_helpers import kernel_ops

    mod, text, _ = fp8_sass
    name = sm90.fp8_kernel_name(d, cap)
    ops_ = kernel_ops(text, name)
    assert ("MUFU.TANH" in ops_) == (cap > 0)  # the tanh only in the _softcap kernels
    assert any(op.startswith(f"QGMMA.64x{sm90.FP8_KEYS[d]}x32.F32.E4M3.E4M3") for op in ops_)  # S = Q K^T
    assert any(op.startswith(f"QGMMA.64x{d}x32.F32.E4M3.E4M3") for op in ops_)  # O += P V^T
    assert sum(op.startswith("UTMALDG.4D") for op in ops_) >= 3
    res = mod.resources[name]
    assert res.spill_stores == 0 and res.spill_loads == 0


@pytest.mark.usefixtures("sm90_host")
@pytest.mark.parametrize("d,causal,window", [(64, True, (-1, -1)), (128, False, (90, 30)), (256, True, (-1, -1))])
def test_fp8_softcap_runs_the_fp8_kernel(d, causal, window, monkeypatch) -> None:
    """softcap (Gemma's c * tanh(s / c)) with e4m3 inputs launches attention_fwd_sm90_d{D}_softcap_fp8 (it used to
    dequantize to bf16), within the FP8 row of float64 attention on the dequantized inputs, window included."""
    q8, k8, v8, qd, kd, vd = fp8_inputs(8, 1, 150, 300, 4, 2, d, True)
    names = _record(monkeypatch)
    # scale 4 / sqrt(d): scores up to about 16-20 here, so c = 6 changes the result (a flat softmax, c of 2 or
    # less, is where e4m3's P rounding alone reaches the row, capped or not)
    sc, cap = 4.0 / np.sqrt(d), 6.0
    out, lse = ops.flash_attention(q8, k8, v8, causal=causal, window_size=window, softcap=cap, scale=sc,
                                   q_descale=qd, k_descale=kd, v_descale=vd, return_lse=True, backend="host")
    assert names == [sm90.fp8_kernel_name(d, cap)] == [f"attention_fwd_sm90_d{d}_softcap_fp8"]
    dq_, dk_, dv_ = (dequantized(x, s, 2) for x, s in ((q8, qd), (k8, kd), (v8, vd)))
    ref, ref_lse = np_flash_attention(dq_, dk_, dv_, causal, sc, window, cap)
    err = rel_rms(out, ref)
    print(f"d{d} softcap rel rms {err:.4g}")
    assert err <= tolerance("flash_attention_rel_rms", "fp8")[1], err
    nocap = np_flash_attention(dq_, dk_, dv_, causal, sc, window)[0]
    assert rel_rms(nocap, ref) > 10 * err  # the cap is visible: the kernel applied it
    fin = ~np.isneginf(ref_lse)
    np.testing.assert_array_equal(np.isneginf(lse), ~fin)
    atol, rtol = tolerance("flash_attention", "bf16")
    assert np.all(np.abs(lse[fin] - ref_lse[fin]) <= atol + rtol * np.abs(ref_lse[fin]))


def test_fp8_torch_forward_takes_softcap() -> None:
    """pykern.torch.flash_attention passes softcap (and the window) to the FP8 op (it used to refuse softcap)."""
    torch = pytest.importorskip("torch")
    import pykern.torch as pt

    q8, k8, v8, qd, kd, vd = fp8_inputs(9, 1, 40, 60, 2, 1, 64, False)
    tq, tk, tv = (torch.from_numpy(x.view(np.uint8)).view(torch.float8_e4m3fn) for x in (q8, k8, v8))
    sc = 4.0 / np.sqrt(64)
    out = pt.flash_attention(tq, tk, tv, causal=True, scale=sc, window_size=(30, 0), softcap=6.0,
                             q_descale=torch.from_numpy(qd), k_descale=torch.from_numpy(kd),
                             v_descale=torch.from_numpy(vd))
    deq = [dequantized(x, s, 1) for x, s in ((q8, qd), (k8, kd), (v8, vd))]
    ref = np_flash_attention(*deq, True, sc, (30, 0), 6.0)[0]
    err = rel_rms(out.float().numpy(), ref)
    assert err <= tolerance("flash_attention_rel_rms", "fp8")[1], err
    assert rel_rms(np_flash_attention(*deq, True, sc, (30, 0))[0], ref) > 10 * err  # the cap was applied


# ---- FP8 varlen (flash_attention_varlen with e4m3 q, k, v: FA3's flash_attn_varlen_func(q_descale=...)) ----------
def fp8_varlen_inputs(seed: int, lens_q: list[int], lens_k: list[int], h: int, n_kv: int, d: int, per_head: bool):
    """Packed e4m3 q (total_q, h, d), k, v (total_k, n_kv, d), cu_seqlens, and descales per tensor (shape (1,)) or
    per (sequence, kv head) (amax / 448 over that sequence's rows of the kv head's group), as FP8 callers make
    them; sequences of different ranges, so a descale applied to the wrong sequence shows."""
    rng = np.random.default_rng(seed)
    cq = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    ck = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    parts = {n: [] for n in "qkv"}
    for lq, lk in zip(lens_q, lens_k):
        for name, rows, heads in (("q", lq, h), ("k", lk, n_kv), ("v", lk, n_kv)):
            x = rng.standard_normal((1, rows, heads, d)).astype(np.float32)
            x *= rng.uniform(0.5, 2.0, (1, 1, heads, 1)).astype(np.float32)
            parts[name].append(x)
    out = []
    for name, heads in (("q", h), ("k", n_kv), ("v", n_kv)):
        if per_head:  # quantize each sequence with its own (1, n_kv) descales
            pairs = [quantize(x, n_kv, True) if x.shape[1] else (x.astype(E4M3), np.ones((1, n_kv), np.float32))
                     for x in parts[name]]
            x8 = np.concatenate([p[0][0] for p in pairs])
            ds = np.concatenate([p[1] for p in pairs]).astype(np.float32)
        else:
            x8, ds = quantize(np.concatenate(parts[name], axis=1), n_kv, False)
            x8 = x8[0]
        out += [x8, ds]
    q8, qd, k8, kd, v8, vd = out
    return q8, k8, v8, qd, kd, vd, cq, ck


def varlen_reference(q8, k8, v8, qd, kd, vd, cq, ck, n_kv, causal, window=(-1, -1), sc=None, cap=0.0):
    """float64 attention of each sequence on its dequantized rows: (out (total_q, h, d), lse (total_q, h))."""
    outs, lses = [], []
    for b in range(cq.size - 1):
        sel = (lambda ds: ds[b:b + 1]) if qd.size > 1 else (lambda ds: ds)
        x = [dequantized(a[None, lo:hi], sel(ds), n_kv) for a, ds, lo, hi in
             ((q8, qd, cq[b], cq[b + 1]), (k8, kd, ck[b], ck[b + 1]), (v8, vd, ck[b], ck[b + 1]))]
        o, l_ = np_flash_attention(*x, causal, sc, window, cap) if cap else np_flash_attention(*x, causal, sc, window)
        outs.append(o[0])
        lses.append(l_[0])
    return np.concatenate(outs), np.concatenate(lses)


def check_varlen(out, lse, ref, ref_lse) -> float:
    assert np.asarray(out).dtype == ml_dtypes.bfloat16
    err = rel_rms(out, ref)
    assert err <= tolerance("flash_attention_rel_rms", "fp8")[1], err
    empty = np.isneginf(ref_lse)
    np.testing.assert_array_equal(np.isneginf(lse), empty)
    assert not np.asarray(out).astype(np.float32)[empty].any()
    atol, rtol = tolerance("flash_attention", "bf16")
    fin = ~empty
    assert np.all(np.abs(lse[fin] - ref_lse[fin]) <= atol + rtol * np.abs(ref_lse[fin]))
    return err


VARLEN_SHAPES = [
    # (query lengths, key lengths, heads, kv_heads, head_dim, causal, per-(sequence, kv head) descales)
    ([70, 200, 1], [150, 300, 5], 4, 2, 64, True, True),      # a one-query sequence; n_q < n_k
    ([130, 0, 90], [130, 40, 300], 2, 1, 128, False, True),   # an empty query sequence; full tiles (ping-pong)
    ([200, 60], [70, 60], 2, 2, 128, True, False),            # n_q > n_k: rows that see no key; per tensor
    ([50, 80], [100, 200], 2, 1, 256, True, True),            # d256
]


@pytest.mark.usefixtures("sm90_host")
@pytest.mark.parametrize("shape", VARLEN_SHAPES, ids=lambda s: "q{}-k{}-h{}/{}-d{}-{}-{}".format(
    "_".join(map(str, s[0])), "_".join(map(str, s[1])), *s[2:5], "causal" if s[5] else "full",
    "head" if s[6] else "tensor"))
def test_fp8_varlen_sm90_vs_float64(shape, monkeypatch) -> None:
    lens_q, lens_k, h, n_kv, d, causal, per_head = shape
    q8, k8, v8, qd, kd, vd, cq, ck = fp8_varlen_inputs(20, lens_q, lens_k, h, n_kv, d, per_head)
    names = _record(monkeypatch)
    out, lse = ops.flash_attention_varlen(q8, k8, v8, cq, ck, causal=causal, q_descale=qd, k_descale=kd,
                                          v_descale=vd, return_lse=True, backend="host")
    assert names == [sm90.fp8_varlen_kernel_name(d)] == [f"attention_fwd_varlen_sm90_d{d}_fp8"]
    check_varlen(out, lse, *varlen_reference(q8, k8, v8, qd, kd, vd, cq, ck, n_kv, causal))


@pytest.mark.usefixtures("sm90_host")
@pytest.mark.parametrize("d", [64, 128, 256])
def test_fp8_varlen_epilogue_reads_are_bank_conflict_free(d: int, monkeypatch) -> None:
    # The epilogue's 16-byte reads of the bf16 rows staged in V slot c (pk_attn_store_staged_o; the host's 16-byte
    # bank model, a quarter-warp a phase): 8 consecutive lanes read the 8 pieces of one 128-byte row of a box, which
    # the 128B swizzle permutes: one wavefront a phase. The kernel's other shared accesses (TMA, wgmma, the
    # transposes' 4-byte loads and plain stores) are not counted, so every phase is the epilogue's: one a stored row
    # and 64 head-dim columns (rows past each sequence's end, here 123 of 128 and 38, are neither read nor stored).
    from pykern.backends.host import shared_v4_bank_model, shared_v4_bank_stats

    lens_q, h = [5, 90], 2
    q8, k8, v8, qd, kd, vd, cq, ck = fp8_varlen_inputs(22, lens_q, [70, 90], h, 1, d, True)
    names = _record(monkeypatch)
    shared_v4_bank_model(True)
    try:
        shared_v4_bank_stats(reset=True)
        out, lse = ops.flash_attention_varlen(q8, k8, v8, cq, ck, causal=True, q_descale=qd, k_descale=kd,
                                              v_descale=vd, return_lse=True, backend="host")
        st = shared_v4_bank_stats()["attention_fwd_fp8_sm90"]
    finally:
        shared_v4_bank_model(False)
    assert names == [sm90.fp8_varlen_kernel_name(d)]
    assert st["phases"] == sum(lens_q) * h * d // 64, st
    assert st["wavefronts"] == st["phases"] and st["worst"] == 1, st
    check_varlen(out, lse, *varlen_reference(q8, k8, v8, qd, kd, vd, cq, ck, 1, True))


@pytest.mark.usefixtures("sm90_host")
def test_fp8_varlen_softcap_and_window(monkeypatch) -> None:
    q8, k8, v8, qd, kd, vd, cq, ck = fp8_varlen_inputs(21, [150, 40], [300, 90], 4, 2, 128, True)
    names = _record(monkeypatch)
    sc, cap = 4.0 / np.sqrt(128), 6.0  # scores up to about 16-20: c = 6 changes the result
    out, lse = ops.flash_attention_varlen(q8, k8, v8, cq, ck, window_size=(90, 30), softcap=cap, scale=sc,
                                          q_descale=qd, k_descale=kd, v_descale=vd, return_lse=True, backend="host")
    assert names == [sm90.fp8_varlen_kernel_name(128, cap)] == ["attention_fwd_varlen_sm90_d128_softcap_fp8"]
    ref, ref_lse = varlen_reference(q8, k8, v8, qd, kd, vd, cq, ck, 2, False, (90, 30), sc, cap)
    err = check_varlen(out, lse, ref, ref_lse)
    nocap = varlen_reference(q8, k8, v8, qd, kd, vd, cq, ck, 2, False, (90, 30), sc)[0]
    assert rel_rms(nocap, ref) > 10 * err  # the cap is visible: the kernel applied it


@pytest.mark.usefixtures("sm90_host")
@pytest.mark.parametrize("schedule", ["reverse", "random:5"])
def test_fp8_varlen_same_bits_under_other_schedules(schedule, monkeypatch) -> None:
    q8, k8, v8, qd, kd, vd, cq, ck = fp8_varlen_inputs(22, [129, 60], [520, 200], 2, 1, 128, True)
    run = lambda: ops.flash_attention_varlen(q8, k8, v8, cq, ck, causal=True, q_descale=qd,  # noqa: E731
                                             k_descale=kd, v_descale=vd, return_lse=True, backend="host")
    out0, lse0 = run()
    monkeypatch.setenv("PYKERN_HOST_SCHEDULE", schedule)
    out1, lse1 = run()
    np.testing.assert_array_equal(out0.view(np.uint16), out1.view(np.uint16))
    np.testing.assert_array_equal(lse0, lse1)


@pytest.mark.parametrize("where", ["host-sm80", "host-sm90-off"])
def test_fp8_varlen_elsewhere_dequantizes_to_bf16(where, monkeypatch) -> None:
    q8, k8, v8, qd, kd, vd, cq, ck = fp8_varlen_inputs(23, [70, 30], [90, 50], 4, 2, 64, True)
    monkeypatch.setenv("PYKERN_HOST_ARCH", "" if where == "host-sm80" else "sm_90a")
    monkeypatch.setenv("PYKERN_SM90", "0" if where == "host-sm90-off" else "1")
    names = _record(monkeypatch)
    out, lse = ops.flash_attention_varlen(q8, k8, v8, cq, ck, causal=True, q_descale=qd, k_descale=kd,
                                          v_descale=vd, return_lse=True, backend="host")
    assert names and not any("fp8" in n for n in names)
    check_varlen(out, lse, *varlen_reference(q8, k8, v8, qd, kd, vd, cq, ck, 2, True))


def test_fp8_varlen_errors_name_the_argument_before_any_launch(monkeypatch) -> None:
    q8, k8, v8, qd, kd, vd, cq, ck = fp8_varlen_inputs(24, [5, 3], [4, 6], 4, 2, 64, True)
    names = _record(monkeypatch)
    bf = ml_dtypes.bfloat16
    call = lambda q=q8, k=k8, v=v8, **kw: ops.flash_attention_varlen(q, k, v, cq, ck, backend="host", **kw)  # noqa
    with pytest.raises(ArgumentTypeError, match=r"^k: expected dtype float8_e4m3fn \(as q\), got bfloat16"):
        call(k=k8.astype(bf))
    with pytest.raises(ArgumentTypeError, match=r"^v_descale: expected it with float8_e4m3fn q, k and v .*got q of "
                                                r"dtype bfloat16"):
        call(q=q8.astype(bf), k=k8.astype(bf), v=v8.astype(bf), v_descale=vd)
    # per (sequence, kv head): 2 sequences of 2 kv heads
    with pytest.raises(ArgumentError, match=r"^q_descale: expected shape \(\) or \(1,\).*\(2, 2\), got \(3, 2\)"):
        call(q_descale=np.ones((3, 2), np.float32))
    with pytest.raises(ArgumentTypeError, match=r"^k_descale: expected dtype float32, got float64"):
        call(k_descale=kd.astype(np.float64))
    with pytest.raises(ArgumentError, match=r"^cu_seqlens_q: "):
        ops.flash_attention_varlen(q8, k8, v8, np.array([0, 5, 9], np.int32), ck, q_descale=qd, backend="host")
    assert names == []


def test_fp8_torch_varlen_forward_and_no_autograd() -> None:
    torch = pytest.importorskip("torch")
    import pykern.torch as pt

    q8, k8, v8, qd, kd, vd, cq, ck = fp8_varlen_inputs(25, [40, 7], [50, 30], 2, 1, 64, True)
    tq, tk, tv = (torch.from_numpy(x.view(np.uint8)).view(torch.float8_e4m3fn) for x in (q8, k8, v8))
    tcq, tck = torch.from_numpy(cq), torch.from_numpy(ck)
    out, lse = pt.flash_attention_varlen(tq, tk, tv, tcq, tck, 40, 50, causal=True, return_lse=True,
                                         q_descale=torch.from_numpy(qd), k_descale=torch.from_numpy(kd),
                                         v_descale=torch.from_numpy(vd))
    assert out.dtype == torch.bfloat16 and out.shape == (47, 2, 64) and lse.shape == (2, 47)  # flash-attn's lse
    ref, ref_lse = varlen_reference(q8, k8, v8, qd, kd, vd, cq, ck, 1, True)
    assert rel_rms(out.float().numpy(), ref) <= tolerance("flash_attention_rel_rms", "fp8")[1]
    atol, rtol = tolerance("flash_attention", "bf16")  # here (no sm_90a) the bf16 path on dequantized inputs
    np.testing.assert_allclose(lse.t().numpy(), ref_lse, rtol=rtol, atol=atol)
    with pytest.raises(ArgumentError, match=r"requires_grad"):
        pt.flash_attention_varlen(tq.float().requires_grad_().to(torch.float8_e4m3fn), tk, tv, tcq, tck, 40, 50)
    # the custom op's fake (shapes and dtypes for torch.compile) and its registration; opcheck's schema test cannot
    # run on e4m3 tensors (torch has no CPU multiply for them)
    torch.library.opcheck(torch.ops.pykern.flash_attention_varlen_fp8.default,
                          (tq, tk, tv, tcq, tck, torch.from_numpy(qd), torch.from_numpy(kd), torch.from_numpy(vd),
                           True, 0.125), test_utils=("test_faketensor", "test_autograd_registration"))



_EPI_BAR = "    pk_bar_sync_aligned(tx / 128 + (FA90F8_BAR_EPI - 1), 128);"


@pytest.mark.slow
@pytest.mark.usefixtures("sm90_host")
@pytest.mark.parametrize("d", sorted(PP_SHAPE))
def test_fp8_epilogue_is_clean_under_racecheck_and_needs_its_barrier(d, tmp_path, monkeypatch) -> None:
    # The epilogue stages each consumer's bf16 rows of O in V slot c with no barrier of the two consumers: a V slot is
    # read only by the transposes (generic loads: racecheck sees them), which the other consumer finished before the
    # last hand-over. Clean under racecheck at the ping-pong shapes (5 key tiles, the V^T slots wrapping; d256:
    # the stage is twice its 64-key V tile, the slot sized for it). Without the warpgroup's barrier, the 16-byte
    # reads of rows other warps staged race with their writes.
    from pykern.errors import KernelExecutionError

    monkeypatch.setenv("PYKERN_HOST_RACECHECK", "1")
    out, lse, args = _pp_run(d)
    check(out, lse, *args)
    _pp_mutant(tmp_path, monkeypatch, _EPI_BAR, "    //")  # the comment after it stays one
    with pytest.raises(KernelExecutionError, match=r"read-after-write race"):
        _pp_run(d)
