"""flash_attention_varlen on the Hopper (sm_90a) forward, kernels_cu/attention_fwd_sm90.cu with its VARLEN
template parameter (attention_fwd_varlen_sm90_d64/96/128/256 and d192_dv128, and their _softcap kernels), and its backward,
kernels_cu/attention_bwd_sm90.cu with its VL template parameter (attention_bwd_varlen_sm90_{dkdv,dq}_d64/96/128/256
and d192_dv128 [_softcap]).

On the host backend playing sm_90a (PYKERN_HOST_ARCH=sm_90a: TMA, mbarrier and wgmma emulated) the op picks
the sm_90a kernel and equals float64 NumPy per sequence within the flash_attention_varlen tolerance rows:
ragged sequences (lengths 0 and 1, off every tile, a key tile that runs into the next sequence), n_q != n_k per
sequence both ways (bottom-right causal: rows that see no key get out 0, lse -inf), empty sequences, GQA,
windows, softcap, head_dim 64/128/256 and 192 with head_dim_v 128, bf16 and f16 (192 / 128 off sm_90a: dense_attn on
v padded to 192, the same values). Where the sm_90a kernel does not apply (d80, no key at
all, a base off 16 bytes, not playing Hopper) the op keeps the mma.sync kernels; the two agree. Likewise
flash_attention_varlen_backward (head_dim 64 / 96 / 128 / 256 and 192 / 128, with and without softcap): dQ, dK, dV equal float64 per
sequence (zero for a sequence without queries / keys), the same bits under every host schedule.
"""
from __future__ import annotations

import numpy as np
import pytest

from pykern.difftest.cases.attention import fa_inputs, np_flash_attention
from pykern.ops import _attention_sm90 as sm90
from pykern.ops.serving import flash_attention_varlen
from launch_spy import record_launches as _record
from attn_checks import check_lse, close, sm90_host  # noqa: F401 (a fixture)

pytestmark = pytest.mark.usefixtures("sm90_host")

HOST = "host"


def _ragged(rng, lq, lk, h, kvh, d, kind, dv=None):
    """Packed q, k, v of head_dim d (v: dv, default d) and the cu_seqlens of the q / k lengths."""
    q, k, v = fa_inputs(rng, 1, sum(lq), sum(lk), h, kvh, d, d if dv is None else dv, kind)
    cu_q = np.concatenate([[0], np.cumsum(lq)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lk)]).astype(np.int32)
    return q[0], k[0], v[0], cu_q, cu_k


def _np_varlen(q, k, v, cu_q, cu_k, causal, win=(-1, -1), cap=0.0):
    """float64 per sequence with v's own head_dim; a sequence without keys: out 0, lse -inf."""
    out = np.zeros(q.shape[:2] + v.shape[2:])
    lse = np.full(q.shape[:2], -np.inf)
    for b in range(len(cu_q) - 1):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if cu_q[b + 1] == cu_q[b] or cu_k[b + 1] == cu_k[b]:
            continue
        o, l_ = np_flash_attention(q[None, qs], k[None, ks], v[None, ks], causal, None, win, cap)
        out[qs], lse[qs] = o[0], l_[0]
    return out, lse


VARLEN = [
    # (q lengths, k lengths, heads, kv_heads, head_dim, causal, window, dtype)
    # lengths 0 and 1, a sequence without keys, key tiles crossing into the next sequence; GQA 2
    ([5, 130, 0, 1, 7], [9, 200, 3, 0, 140], 4, 2, 64, True, (-1, -1), "bf16"),
    # n_q > n_k (the first rows see no key) and n_q < n_k; one whole steady key tile (256 keys) in the middle one
    ([70, 1, 150], [33, 300, 20], 2, 1, 64, False, (-1, -1), "f16"),
    ([150, 3, 60], [20, 130, 260], 2, 1, 128, True, (-1, -1), "bf16"),
    ([40, 129], [200, 129], 4, 4, 128, False, (-1, -1), "f16"),
    ([129, 30], [260, 30], 2, 1, 64, True, (70, -1), "bf16"),   # causal + left window
    ([100, 1], [190, 64], 2, 2, 64, False, (50, 20), "f16"),    # both sides of a window
    ([70, 0, 9], [90, 5, 130], 2, 1, 256, True, (-1, -1), "bf16"),  # d256: 64-key tiles
    ([33, 65], [140, 65], 4, 2, 256, False, (-1, -1), "f16"),
]


@pytest.mark.parametrize("case", VARLEN, ids=lambda c: "{}-d{}-h{}/{}-c{}-w{},{}-q{}".format(c[7], c[4], c[2], c[3], int(c[5]), *c[6], ",".join(map(str, c[0]))))
def test_varlen_sm90_vs_float64(case, monkeypatch) -> None:
    lq, lk, h, kvh, d, causal, win, kind = case
    q, k, v, cu_q, cu_k = _ragged(np.random.default_rng(d + sum(lq) + sum(lk)), lq, lk, h, kvh, d, kind)
    names = _record(monkeypatch)
    out, lse = flash_attention_varlen(q, k, v, cu_q, cu_k, causal=causal, window_size=win, return_lse=True,
                                      backend=HOST)
    assert names == [f"attention_fwd_varlen_sm90_d{d}_{kind}"]
    assert np.asarray(out).dtype == q.dtype and np.asarray(lse).dtype == np.float32
    ref_out, ref_lse = _np_varlen(q, k, v, cu_q, cu_k, causal, win)
    close("out", out, ref_out, "flash_attention_varlen", kind)
    check_lse(lse, ref_lse)


# softcap (attention_fwd_varlen_sm90_d*_softcap): ragged lengths with empty sequences and one without keys, key tiles
# into the next sequence, steady tiles (the lazy softmax on capped scores), windows, GQA.
VARLEN_SOFTCAP = [
    # (q lengths, k lengths, heads, kv_heads, head_dim, causal, window, softcap, dtype)
    ([5, 130, 0, 1], [9, 450, 3, 0], 4, 2, 64, False, (-1, -1), 2.0, "bf16"),
    ([90, 1, 20], [60, 300, 0], 2, 1, 128, True, (-1, -1), 3.0, "f16"),
    ([129, 30], [260, 30], 2, 1, 128, True, (70, -1), 5.0, "bf16"),
    ([70, 20], [150, 40], 2, 2, 256, False, (30, 5), 1.5, "f16"),
]


@pytest.mark.parametrize("case", VARLEN_SOFTCAP, ids=lambda c: "{}-d{}-c{}-w{},{}-cap{}".format(
    c[8], c[4], int(c[5]), *c[6], c[7]))
def test_varlen_sm90_softcap_vs_float64(case, monkeypatch) -> None:
    lq, lk, h, kvh, d, causal, win, cap, kind = case
    q, k, v, cu_q, cu_k = _ragged(np.random.default_rng(d + sum(lq) + 7), lq, lk, h, kvh, d, kind)
    names = _record(monkeypatch)
    out, lse = flash_attention_varlen(q, k, v, cu_q, cu_k, causal=causal, window_size=win, softcap=cap,
                                      return_lse=True, backend=HOST)
    assert names == [f"attention_fwd_varlen_sm90_d{d}_softcap_{kind}"]
    ref_out, ref_lse = _np_varlen(q, k, v, cu_q, cu_k, causal, win, cap)
    close("out", out, ref_out, "flash_attention_varlen", kind)
    check_lse(lse, ref_lse)


def test_varlen_cases_cover_the_epilogue_rows() -> None:
    # The varlen / paged epilogue stores O a row at a time (16-byte pieces, rows past the sequence's end skipped):
    # for every head dim the cases here and the difftest's hold a sequence whose length is not a multiple of 64 (a
    # consumer warpgroup's 64 rows end inside the sequence's last query tile) and one of 1 to 7 rows (fewer rows
    # than a quad's g rows; the second consumer stores nothing).
    from pykern.difftest.cases import attention as dc

    lens: dict[int, list[int]] = {}
    for d, shapes in dc.SM90_VARLEN.items():
        for lq, _ in shapes:
            lens.setdefault(d, []).extend(lq)
    for (lq, _), d, *_ in dc.SM90_VARLEN_SOFTCAP:
        lens.setdefault(d, []).extend(lq)
    for (lq, _), *_ in dc.SM90_VARLEN_192:
        lens.setdefault(192, []).extend(lq)
    for lq, _, _, _, d, *_ in VARLEN + VARLEN_SOFTCAP:
        lens.setdefault(d, []).extend(lq)
    for lq, *_ in VARLEN_192:
        lens.setdefault(192, []).extend(lq)
    assert sorted(lens) == [64, 128, 192, 256]
    for d, ls in lens.items():
        assert any(n % 64 for n in ls) and any(0 < n < 8 for n in ls), (d, ls)


@pytest.mark.parametrize("d,dv", [(64, 64), (128, 128), (256, 256), (192, 128)])
def test_varlen_epilogue_reads_are_bank_conflict_free(d: int, dv: int, monkeypatch) -> None:
    # The epilogue's 16-byte reads of the staged O rows (pk_ld_shared_b128; the host backend's 16-byte bank model,
    # pykern.backends.host.shared_v4_bank_stats: a quarter-warp a phase): 8 consecutive lanes read 8 pieces of one
    # 128-byte row of a box, whose 16-byte units the 128B swizzle permutes: one wavefront a phase. The varlen
    # kernel's other shared accesses are TMA / wgmma ones, which the model does not count, so every phase is the
    # epilogue's: one a row and 64 head-dim columns (a full phase: a row's pieces are stored or skipped together).
    from pykern.backends.host import shared_v4_bank_model, shared_v4_bank_stats

    lq, lk, h = [5, 90], [70, 90], 2
    q, k, v, cu_q, cu_k = _ragged(np.random.default_rng(d + 11), lq, lk, h, 1, d, "bf16", dv)
    names = _record(monkeypatch)
    shared_v4_bank_model(True)
    try:
        shared_v4_bank_stats(reset=True)
        out, lse = flash_attention_varlen(q, k, v, cu_q, cu_k, causal=True, return_lse=True, backend=HOST)
        st = shared_v4_bank_stats()["attention_fwd_sm90"]
    finally:
        shared_v4_bank_model(False)
    assert names == [sm90.kernel_name(d, dv, 0.0, "_bf16", varlen=True)]
    assert st["phases"] == sum(lq) * h * dv // 64, st
    assert st["wavefronts"] == st["phases"] and st["worst"] == 1, st
    ref_out, ref_lse = _np_varlen(q, k, v, cu_q, cu_k, True)
    close("out", out, ref_out, "flash_attention_varlen", "bf16")
    check_lse(lse, ref_lse)


def test_varlen_sm90_other_schedule_and_agrees_with_mma_sync(monkeypatch) -> None:
    # a reversed thread / block schedule gives the same bits; the mma.sync kernel (not playing Hopper) agrees
    # as the dense kernels do: both round P to f16 for P V and differ in fp32 summation order only
    q, k, v, cu_q, cu_k = _ragged(np.random.default_rng(3), [60, 140, 1], [100, 140, 30], 4, 2, 128, "f16")
    a, la = flash_attention_varlen(q, k, v, cu_q, cu_k, causal=True, return_lse=True, backend=HOST)
    monkeypatch.setenv("PYKERN_HOST_SCHEDULE", "reverse")
    r, lr = flash_attention_varlen(q, k, v, cu_q, cu_k, causal=True, return_lse=True, backend=HOST)
    np.testing.assert_array_equal(np.asarray(a).view(np.uint16), np.asarray(r).view(np.uint16))
    np.testing.assert_array_equal(la, lr)
    monkeypatch.delenv("PYKERN_HOST_SCHEDULE")
    monkeypatch.setenv("PYKERN_HOST_ARCH", "")
    names = _record(monkeypatch)
    b, lb = flash_attention_varlen(q, k, v, cu_q, cu_k, causal=True, return_lse=True, backend=HOST)
    assert names == ["attention_fwd_varlen_tc_d128_f16"]
    assert np.abs(a.astype(np.float64) - b.astype(np.float64)).max() <= 2 * 2.0 ** -11 * np.abs(b).max()
    np.testing.assert_array_equal(np.isneginf(la), np.isneginf(lb))
    assert np.abs(la[np.isfinite(lb)] - lb[np.isfinite(lb)]).max() < 1e-5


def test_varlen_chooses_sm90_only_where_it_applies(monkeypatch) -> None:
    rng = np.random.default_rng(1)
    names = _record(monkeypatch)
    q, k, v, cu_q, cu_k = _ragged(rng, [20, 5], [30, 9], 2, 1, 128, "bf16")
    flash_attention_varlen(q, k, v, cu_q, cu_k, causal=True, backend=HOST)
    flash_attention_varlen(q, k, v, cu_q, cu_k, softcap=30.0, backend=HOST)  # softcap: sm_90a too
    q96, k96, v96 = (a[..., :96].copy() for a in (q, k, v))
    flash_attention_varlen(q96, k96, v96, cu_q, cu_k, backend=HOST)  # d96: sm_90a too (32-column boxes)
    q80, k80, v80 = (a[..., :80].copy() for a in (q, k, v))
    flash_attention_varlen(q80, k80, v80, cu_q, cu_k, backend=HOST)  # d80: the general kernel
    buf = np.zeros(q.size + 1, q.dtype)  # a base off 16 bytes is no TMA source
    q_odd = buf[1:].reshape(q.shape)
    q_odd[...] = q
    flash_attention_varlen(q_odd, k, v, cu_q, cu_k, backend=HOST)  # (nor FlashAttention-2 core data)
    kz = k[:0].copy()  # no key in any sequence: no tensor map over k; the mma.sync kernel writes 0 / -inf
    out, lse = flash_attention_varlen(q, kz, kz, cu_q, np.zeros(3, np.int32), return_lse=True, backend=HOST)
    assert not np.asarray(out, np.float32).any() and np.isneginf(lse).all()
    monkeypatch.setenv("PYKERN_HOST_ARCH", "")
    flash_attention_varlen(q, k, v, cu_q, cu_k, causal=True, backend=HOST)  # not playing Hopper
    assert names == ["attention_fwd_varlen_sm90_d128_bf16", "attention_fwd_varlen_sm90_d128_softcap_bf16",
                     "attention_fwd_varlen_sm90_d96_bf16", "dense_attn_bf16", "dense_attn_bf16",
                     "attention_fwd_varlen_tc_d128_bf16",
                     "attention_fwd_varlen_tc_d128_bf16"]


# --------------------------------------------------------------------------- head_dim 192 / head_dim_v 128
def _run_192_128(monkeypatch, seed: int, lq, lk, h, kvh, causal, win, cap, kind) -> list:
    """flash_attention_varlen at head_dim 192 / head_dim_v 128 against float64: out (total_q, h, 128), C-contiguous
    in q's dtype, and lse. Returns the kernels it launched."""
    q, k, v, cu_q, cu_k = _ragged(np.random.default_rng(seed), lq, lk, h, kvh, 192, kind, dv=128)
    names = _record(monkeypatch)
    out, lse = flash_attention_varlen(q, k, v, cu_q, cu_k, causal=causal, window_size=win, softcap=cap,
                                      return_lse=True, backend=HOST)
    out_a = np.asarray(out)
    assert out_a.shape == (sum(lq), h, 128) and out_a.dtype == q.dtype and out_a.flags.c_contiguous
    ref_out, ref_lse = _np_varlen(q, k, v, cu_q, cu_k, causal, win, cap)
    close("out", out, ref_out, "flash_attention_varlen", kind)
    check_lse(lse, ref_lse)
    return names


# DeepSeek-V3's prefill shape (attention_fwd_varlen_sm90_d192_dv128[_softcap]): (q lengths, k lengths, heads,
# kv_heads, causal, window, softcap, dtype). Ragged lengths with an empty sequence and one without keys, key tiles
# into the next sequence, steady tiles (300 keys), GQA, windows, softcap.
VARLEN_192 = [
    ([5, 140, 0, 1], [9, 300, 3, 0], 4, 1, False, (-1, -1), 0.0, "bf16"),
    ([90, 1, 20], [60, 200, 0], 2, 1, True, (50, -1), 0.0, "f16"),
    ([70, 20], [260, 40], 2, 2, False, (-1, -1), 2.0, "bf16"),
    ([130, 1, 20], [60, 300, 0], 4, 2, True, (-1, -1), 2.5, "f16"),
]


@pytest.mark.parametrize("case", VARLEN_192, ids=lambda c: "{}-h{}/{}-c{}-w{},{}-cap{}".format(
    c[7], c[2], c[3], int(c[4]), *c[5], c[6]))
def test_varlen_sm90_192_128_vs_float64(case, monkeypatch) -> None:
    lq, lk, h, kvh, causal, win, cap, kind = case
    names = _run_192_128(monkeypatch, sum(lq) + sum(lk), lq, lk, h, kvh, causal, win, cap, kind)
    assert names == [f"attention_fwd_varlen_sm90_d192_dv128{'_softcap' if cap else ''}_{kind}"]


@pytest.mark.parametrize("where", ["sm90_off", "not_hopper", "f32"])
def test_varlen_192_128_fallback_pads_v_vs_float64(where, monkeypatch) -> None:
    """Where the sm_90a kernel does not apply, dense_attn runs on v padded to head_dim 192 and out is sliced back
    to 128 columns: the same float64 values as the sm_90a kernel's."""
    kind = "f32" if where == "f32" else "bf16"
    if where == "sm90_off":
        monkeypatch.setenv("PYKERN_SM90", "0")
    elif where == "not_hopper":
        monkeypatch.setenv("PYKERN_HOST_ARCH", "")
    names = _run_192_128(monkeypatch, 7, [40, 0, 7], [70, 5, 0], 4, 2, True, (-1, -1), 3.0, kind)
    assert names == ["dense_attn" + ("" if kind == "f32" else "_bf16")]


def test_varlen_head_dim_v_errors_name_v() -> None:
    from pykern.errors import ArgumentError

    q, k, v, cu_q, cu_k = _ragged(np.random.default_rng(3), [4], [6], 2, 1, 128, "bf16", dv=192)
    with pytest.raises(ArgumentError, match=r"v\.shape\[2\] \(head_dim_v\): expected 1 <= head_dim_v <= "
                                            r"head_dim=128 .*got 192"):
        flash_attention_varlen(q, k, v, cu_q, cu_k, backend=HOST)  # a v wider than q / k
    with pytest.raises(ArgumentError, match=r"v: expected shape \(total_k, num_kv_heads, head_dim_v\) = \(6, 1, "):
        flash_attention_varlen(q, k, np.concatenate([v, v], axis=1)[..., :64], cu_q, cu_k, backend=HOST)


# --------------------------------------------------------------------------- backward (attention_bwd_sm90.cu, VL)
def _np_varlen_grads(q, k, v, g, cu_q, cu_k, causal, win=(-1, -1), cap=0.0):
    """(out, lse, dq, dk, dv) in float64, per sequence (np_varlen_backward: zero gradients where a sequence has no
    query or no key)."""
    from pykern.difftest.cases.attention import np_varlen_backward

    return np_varlen_backward(q, k, v, g, cu_q, cu_k, causal=causal, window_size=win, softcap=cap)


VARLEN_BWD = [
    # (q lengths, k lengths, heads, kv_heads, head_dim, causal, window, softcap, dtype)
    # a sequence with keys but no query (zero dK / dV), one with queries but no key (zero dQ), lengths 1, key /
    # query tiles that run into the next sequence; GQA 2
    ([5, 130, 0, 1, 7], [9, 200, 3, 0, 140], 4, 2, 64, True, (-1, -1), 0.0, "bf16"),
    ([70, 1, 150], [33, 300, 20], 2, 1, 128, False, (-1, -1), 0.0, "f16"),
    ([129, 30, 0], [260, 30, 5], 2, 1, 64, True, (70, -1), 2.0, "f16"),
    ([100, 1, 40], [190, 64, 0], 4, 2, 128, False, (50, 20), 3.0, "bf16"),
    # d96 (32-column boxes, 64B swizzle)
    ([5, 130, 0, 1, 7], [9, 200, 3, 0, 140], 4, 2, 96, True, (-1, -1), 0.0, "f16"),
    ([129, 30, 0], [260, 30, 5], 2, 1, 96, False, (70, 10), 2.0, "bf16"),
    # d256 (the fused kernel: 64-key CTAs, the head dim split across the consumers, 32-query tiles)
    ([5, 70, 0, 1, 40], [9, 130, 3, 0, 70], 4, 2, 256, True, (-1, -1), 0.0, "bf16"),
    ([90, 30, 0], [150, 30, 5], 2, 1, 256, False, (50, 20), 2.0, "f16"),
]


@pytest.mark.parametrize("case", VARLEN_BWD, ids=lambda c: "{}-d{}-c{}-w{},{}-cap{}".format(
    c[8], c[4], int(c[5]), *c[6], c[7]))
def test_varlen_backward_sm90_vs_float64(case, monkeypatch) -> None:
    from pykern.ops import flash_attention_varlen_backward

    lq, lk, h, kvh, d, causal, win, cap, kind = case
    rng = np.random.default_rng(d + sum(lq) + sum(lk))
    q, k, v, cu_q, cu_k = _ragged(rng, lq, lk, h, kvh, d, kind)
    g = fa_inputs(rng, 1, sum(lq), 1, h, 1, d, d, kind)[0][0]
    out64, lse64, rq, rk, rv = _np_varlen_grads(q, k, v, g, cu_q, cu_k, causal, win, cap)
    out, lse = out64.astype(q.dtype), lse64.astype(np.float32)
    names = _record(monkeypatch)
    dq, dk, dv = flash_attention_varlen_backward(q, k, v, g, cu_q, cu_k, out=out, lse=lse, causal=causal,
                                                 window_size=win, softcap=cap, backend=HOST)
    c = "_softcap" if cap > 0 else ""
    if d in sm90.BWD_FUSED_HEAD_DIMS:
        # the fused kernel (with and without softcap): the pre-pass over the packed rows (delta, the lse / delta
        # runs, the zeroed dQ accumulator), the kernel, the narrowing of the accumulator
        # (d256: the d128 convert pass over the accumulator's head-dim halves)
        assert names == [f"attention_bwd_tc_prep_{kind}", f"attention_bwd_varlen_sm90_fused_d{d}{c}_{kind}",
                         f"attention_bwd_tc_dq_reduce_d{sm90.bwd_fused_acc_split(d)[0]}_{kind}"]
    else:  # a head dim the fused kernel does not cover: the dK/dV kernel and the dQ kernel
        assert names == [f"attention_bwd_preprocess_{kind}", f"attention_bwd_varlen_sm90_dkdv_d{d}{c}_{kind}",
                         f"attention_bwd_varlen_sm90_dq_d{d}{c}_{kind}"]
    for name, got, ref in (("dq", dq, rq), ("dk", dk, rk), ("dv", dv, rv)):
        close(name, got, ref, "flash_attention_varlen_backward", kind)
    # a sequence with keys but no query gets zero dK / dV; one with queries but no key zero dQ
    for b in range(len(lq)):
        if lq[b] == 0 and lk[b]:
            assert not np.asarray(dk[cu_k[b]:cu_k[b + 1]], np.float32).any()
            assert not np.asarray(dv[cu_k[b]:cu_k[b + 1]], np.float32).any()
        if lk[b] == 0 and lq[b]:
            assert not np.asarray(dq[cu_q[b]:cu_q[b + 1]], np.float32).any()


@pytest.mark.parametrize("d", [96, 128])
def test_varlen_backward_sm90_same_bits_under_every_schedule_and_near_mma_sync(d: int, monkeypatch) -> None:
    """deterministic=True: the semaphore-ordered fused kernel (dQ's adds in key-tile order per sequence, head and
    query tile): forward, reverse and random thread orders give the same bits; the mma.sync kernels (not playing
    Hopper) agree within the tolerance of float64 as well."""
    from pykern.ops import flash_attention_varlen_backward

    rng = np.random.default_rng(8)
    lq, lk = [60, 140, 0, 1], [100, 140, 9, 30]
    q, k, v, cu_q, cu_k = _ragged(rng, lq, lk, 4, 2, d, "f16")
    g = fa_inputs(rng, 1, sum(lq), 1, 4, 1, d, d, "f16")[0][0]
    out, lse = flash_attention_varlen(q, k, v, cu_q, cu_k, causal=True, softcap=2.5, return_lse=True, backend=HOST)
    runs = []
    names = _record(monkeypatch)
    for schedule in ("forward", "reverse", "random:3"):
        monkeypatch.setenv("PYKERN_HOST_SCHEDULE", schedule)
        runs.append(flash_attention_varlen_backward(q, k, v, g, cu_q, cu_k, out=out, lse=lse, causal=True,
                                                    softcap=2.5, deterministic=True, backend=HOST))
    assert names[:3] == ["attention_bwd_tc_prep_f16", f"attention_bwd_varlen_sm90_fused_det_d{d}_softcap_f16",
                         f"attention_bwd_tc_dq_reduce_d{d}_f16"]
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            np.testing.assert_array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16))
    monkeypatch.delenv("PYKERN_HOST_SCHEDULE")
    monkeypatch.setenv("PYKERN_HOST_ARCH", "")
    names.clear()
    tc = flash_attention_varlen_backward(q, k, v, g, cu_q, cu_k, out=out, lse=lse, causal=True, softcap=2.5,
                                         backend=HOST)
    assert names[1:] == [f"attention_bwd_varlen_tc_dkdv_d{d}_softcap_f16", f"attention_bwd_varlen_tc_dq_d{d}_softcap_f16"]
    _, _, rq, rk, rv = _np_varlen_grads(q, k, v, g, cu_q, cu_k, True, cap=2.5)
    for name, a, b, ref in zip(("dq", "dk", "dv"), runs[0], tc, (rq, rk, rv)):
        close(name, a, ref, "flash_attention_varlen_backward", "f16")
        close(name, b, ref, "flash_attention_varlen_backward", "f16")


def test_varlen_backward_d256_det_same_bits_under_every_schedule(monkeypatch) -> None:
    """deterministic=True at head_dim 256: the semaphore-ordered fused d256 kernel (each consumer adds its half of
    the head dim into a run of its own); forward, reverse and random thread orders give the same bits, equal to
    float64. Sequences with keys but no query and queries but no key, key tiles that run into the next sequence."""
    rng = np.random.default_rng(9)
    lq, lk = [50, 0, 70, 20], [100, 7, 90, 0]
    q, k, v, cu_q, cu_k = _ragged(rng, lq, lk, 2, 1, 256, "bf16")
    g = fa_inputs(rng, 1, sum(lq), 1, 2, 1, 256, 256, "bf16")[0][0]
    _det_same_bits_as_float64(monkeypatch, q, k, v, g, cu_q, cu_k, 0.0,
                              ["attention_bwd_tc_prep_bf16", "attention_bwd_varlen_sm90_fused_det_d256_bf16",
                               "attention_bwd_tc_dq_reduce_d128_bf16"])


def _det_same_bits_as_float64(monkeypatch, q, k, v, g, cu_q, cu_k, cap: float, launches: list[str]) -> None:
    """Causal deterministic=True on the host under the forward, reverse and random schedules: the launches begin
    with `launches`, the three runs give the same bits, and the first equals float64 within the bf16 rows."""
    from pykern.ops import flash_attention_varlen_backward

    out64, lse64, rq, rk, rv = _np_varlen_grads(q, k, v, g, cu_q, cu_k, True, (-1, -1), cap)
    out, lse = out64.astype(q.dtype), lse64.astype(np.float32)
    runs = []
    names = _record(monkeypatch)
    for schedule in ("forward", "reverse", "random:4"):
        monkeypatch.setenv("PYKERN_HOST_SCHEDULE", schedule)
        runs.append(flash_attention_varlen_backward(q, k, v, g, cu_q, cu_k, out=out, lse=lse, causal=True,
                                                    softcap=cap, deterministic=True, backend=HOST))
    assert names[:len(launches)] == launches
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            np.testing.assert_array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16))
    for name, got, ref in zip(("dq", "dk", "dv"), runs[0], (rq, rk, rv)):
        close(name, got, ref, "flash_attention_varlen_backward", "bf16")


@pytest.mark.parametrize("cap", [0.0, 2.0])
def test_varlen_backward_192_128_det_same_bits_under_every_schedule(cap: float, monkeypatch) -> None:
    """deterministic=True at 192 / 128: the semaphore-ordered fused kernel on FlashAttention-3's tiling (96-key
    CTAs, 64-query tiles, three accumulator runs a head), without and with softcap; forward, reverse and random
    thread orders give the same bits, equal to float64. An empty sequence, one with keys but no query, one with
    queries but no key, key tiles that run into the next sequence, GQA 2."""
    rng = np.random.default_rng(10)
    lq, lk = [50, 0, 0, 130, 20], [100, 0, 7, 110, 0]
    q, k, v, cu_q, cu_k = _ragged(rng, lq, lk, 4, 2, 192, "bf16", dv=128)
    g = fa_inputs(rng, 1, sum(lq), 1, 4, 1, 128, 128, "bf16")[0][0]
    _det_same_bits_as_float64(monkeypatch, q, k, v, g, cu_q, cu_k, cap,
                              ["attention_bwd_tc_prep_bf16",
                               f"attention_bwd_varlen_sm90_fused_det_d192_dv128{'_softcap' if cap else ''}_bf16",
                               "attention_bwd_tc_dq_reduce_d64_bf16"])


def test_varlen_backward_keeps_mma_sync_where_sm90_does_not_apply(monkeypatch) -> None:
    from pykern.ops import flash_attention_varlen_backward

    rng = np.random.default_rng(2)
    q, k, v, cu_q, cu_k = _ragged(rng, [20, 5], [30, 9], 2, 1, 80, "bf16")
    g = q.copy()
    out, lse = flash_attention_varlen(q, k, v, cu_q, cu_k, return_lse=True, backend=HOST)
    names = _record(monkeypatch)
    flash_attention_varlen_backward(q, k, v, g, cu_q, cu_k, out=out, lse=lse, backend=HOST)  # d80 (padded to 96)
    assert names[1:] == ["attention_bwd_varlen_tc_dkdv_d96_bf16", "attention_bwd_varlen_tc_dq_d96_bf16"]


@pytest.mark.parametrize("case", VARLEN_192, ids=lambda c: "{}-h{}/{}-c{}-w{},{}-cap{}".format(
    c[7], c[2], c[3], int(c[4]), *c[5], c[6]))
def test_varlen_backward_sm90_192_128_vs_float64(case, monkeypatch) -> None:
    """head_dim 192, head_dim_v 128: the varlen backward is the sm_90a fused _d192_dv128[_softcap] kernel, dq / dk /
    dv equal float64 per sequence (zero where a sequence has no query or no key)."""
    from pykern.ops import flash_attention_varlen_backward

    lq, lk, h, kvh, causal, win, cap, kind = case
    rng = np.random.default_rng(sum(lq) + 3 * sum(lk))
    q, k, v, cu_q, cu_k = _ragged(rng, lq, lk, h, kvh, 192, kind, dv=128)
    g = fa_inputs(rng, 1, sum(lq), 1, h, 1, 128, 128, kind)[0][0]
    out64, lse64, rq, rk, rv = _np_varlen_grads(q, k, v, g, cu_q, cu_k, causal, win, cap)
    names = _record(monkeypatch)
    dq, dk, dv = flash_attention_varlen_backward(q, k, v, g, cu_q, cu_k, out=out64.astype(q.dtype),
                                                 lse=lse64.astype(np.float32), causal=causal, window_size=win,
                                                 softcap=cap, backend=HOST)
    # the fused kernel (FlashAttention-3's tiling), its accumulator's three 64-column runs narrowed by d64's pass
    assert names == [f"attention_bwd_tc_prep_{kind}",
                     f"attention_bwd_varlen_sm90_fused_d192_dv128{'_softcap' if cap > 0 else ''}_{kind}",
                     f"attention_bwd_tc_dq_reduce_d64_{kind}"]
    assert np.asarray(dv).shape == v.shape
    for name, got, ref in (("dq", dq, rq), ("dk", dk, rk), ("dv", dv, rv)):
        close(name, got, ref, "flash_attention_varlen_backward", kind)


def test_varlen_backward_192_128_off_hopper_pads_v(monkeypatch) -> None:
    """Not playing Hopper, the mma.sync varlen backward runs on v and grad_out padded with zero columns to 192:
    the same float64 values, dv sliced back to 128 columns."""
    from pykern.ops import flash_attention_varlen_backward

    monkeypatch.setenv("PYKERN_HOST_ARCH", "")
    lq, lk = [40, 0, 7], [70, 5, 0]
    rng = np.random.default_rng(77)
    q, k, v, cu_q, cu_k = _ragged(rng, lq, lk, 4, 2, 192, "f16", dv=128)
    g = fa_inputs(rng, 1, sum(lq), 1, 4, 1, 128, 128, "f16")[0][0]
    out64, lse64, rq, rk, rv = _np_varlen_grads(q, k, v, g, cu_q, cu_k, True)
    names = _record(monkeypatch)
    dq, dk, dv = flash_attention_varlen_backward(q, k, v, g, cu_q, cu_k, out=out64.astype(q.dtype),
                                                 lse=lse64.astype(np.float32), causal=True, backend=HOST)
    assert names == ["attention_bwd_preprocess_f16", "attention_bwd_varlen_tc_dv_d256_f16",
                     "attention_bwd_varlen_tc_dk_d256_f16", "attention_bwd_varlen_tc_dq_d256_f16"]
    assert np.asarray(dv).shape == v.shape and np.asarray(dv).flags.c_contiguous
    for name, got, ref in (("dq", dq, rq), ("dk", dk, rk), ("dv", dv, rv)):
        close(name, got, ref, "flash_attention_varlen_backward", "f16")


def test_torch_varlen_deterministic_algorithms_take_the_semaphore_ordered_fused_kernel(monkeypatch) -> None:
    """pykern.torch's flash_attention_varlen on sm_90a: torch.use_deterministic_algorithms(True) runs the _det
    varlen fused kernel (dQ's adds in key-tile order per sequence, head and query tile), the default the atomic
    one; both gradients equal float64 within the tolerance rows."""
    torch = pytest.importorskip("torch")
    import ml_dtypes

    import pykern.torch as pt

    names = _record(monkeypatch)
    gen = torch.Generator().manual_seed(7)
    lq, lk = [40, 90], [70, 60]
    q, k, v = (torch.randn(n, 2, 64, generator=gen).bfloat16().requires_grad_() for n in (sum(lq), sum(lk), sum(lk)))
    go = torch.randn(sum(lq), 2, 64, generator=gen).bfloat16()
    cu_q, cu_k = (torch.tensor(np.concatenate([[0], np.cumsum(x)]), dtype=torch.int32) for x in (lq, lk))
    as_np = [t.detach().float().numpy().astype(ml_dtypes.bfloat16) for t in (q, k, v, go)]
    _, _, *ref = _np_varlen_grads(*as_np, cu_q.numpy(), cu_k.numpy(), True)
    for det in (False, True):
        prev = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(det)
        try:
            names.clear()
            out = pt.flash_attention_varlen(q, k, v, cu_q, cu_k, max(lq), max(lk), causal=True)
            grads = torch.autograd.grad(out, (q, k, v), go)
        finally:
            torch.use_deterministic_algorithms(prev)
        assert ("attention_bwd_varlen_sm90_fused_det_d64_bf16" in names) == det, names
        assert ("attention_bwd_varlen_sm90_fused_d64_bf16" in names) == (not det), names
        for name, got, want in zip(("dq", "dk", "dv"), grads, ref):
            close(name, got.float().numpy(), want, "flash_attention_varlen_backward", "bf16")
