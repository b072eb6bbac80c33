"""The sm_90a forward's work-tile scheduler (kernels_cu/attention_fwd_sm90.cu, fa90_dense_tile and the tile loop of
fa90_forward; the grid from pykern/ops/_attention_sm90.py's forward_grid).

Causal and windowed launches get a persistent grid (on the host backend HOST_CTAS CTAs, fewer than the work
tiles), each CTA walking its tiles longest first, with the ring's mbarrier phases, the Q tile's and the
ping-pong's named barriers carried from one work tile to the next: the outputs equal float64 within the
flash_attention rows. A probe copy of the kernel records which CTA ran each query tile and in which turn, so the
order itself is checked; a copy without the ping-pong's per-tile closing is reported, not silently wrong.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pykern import ops
from pykern.difftest.cases.attention import fa_inputs, np_flash_attention
from pykern.errors import KernelExecutionError
from pykern.ops import _attention_sm90 as sm90
from pykern.ops._window import normalize
from attn_checks import check_lse, close, sm90_host  # noqa: F401 (a fixture)
from sm90_mutants import write_mutant

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "kernels_cu" / "attention_fwd_sm90.cu"
pytestmark = pytest.mark.usefixtures("sm90_host")
HOST = "host"


def _record_grids(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, object]]:
    """(kernel name, grid) of every launch of the test; the launches still run."""
    from pykern import launcher

    seen: list[tuple[str, object]] = []
    real = launcher.launch

    def spy(name, grid, *a, **kw):
        seen.append((name, grid))
        return real(name, grid, *a, **kw)

    monkeypatch.setattr(launcher, "launch", spy)
    return seen


def test_forward_grid_is_persistent_only_where_tiles_differ() -> None:
    # 2 heads x 5 query tiles: causal or windowed get sms CTAs, never more than the tiles; no window: one a tile
    assert sm90.forward_grid(128, 10, 600, 600, 600, 0, 3) == 3
    assert sm90.forward_grid(192, 10, 600, 600, 100, 600, 3) == 3  # a left window only
    assert sm90.forward_grid(128, 10, 600, 600, 600, 600, 3) == 10
    assert sm90.forward_grid(128, 2, 600, 600, 600, 0, 132) == 2
    # d64 and d256 walk several tiles a CTA as well
    assert sm90.forward_grid(64, 10, 600, 600, 600, 0, 3) == 3
    assert sm90.forward_grid(64, 10, 600, 600, 600, 600, 3) == 10
    assert sm90.forward_grid(256, 10, 600, 600, 600, 0, 3) == 3
    assert sm90.forward_grid(256, 10, 600, 600, 600, 600, 3) == 10
    assert sm90.sm_count("host", 0) == sm90.HOST_CTAS


@pytest.mark.parametrize("d, dv", [(128, 128), (192, 128), (64, 64), (256, 256), (96, 96)])
def test_causal_forward_walks_more_tiles_than_ctas(d: int, dv: int, monkeypatch) -> None:
    # batch 2 x 3 heads x 3 query tiles = 18 work tiles on HOST_CTAS = 3 CTAs: 6 each, the ring's phases and (d128,
    # d96) the ping-pong carried across them; n_q != n_k and GQA 3. d64 and d256: their pair loops' odd and tail steps
    # and the ring's slot carried across tiles of 330 keys (two key tiles of 192 at d64, six of 64 at d256, masked
    # or steady by query tile).
    rng = np.random.default_rng(d)
    q, k, v = fa_inputs(rng, 2, 300, 330, 3, 1, d, dv, "bf16")
    grids = _record_grids(monkeypatch)
    out, lse = ops.flash_attention(q, k, v, causal=True, return_lse=True, backend=HOST)
    shape = f"d{d}" if d == dv else f"d{d}_dv{dv}"
    assert grids == [(f"attention_fwd_sm90_{shape}_bf16", sm90.HOST_CTAS if sm90.PERSISTENT[d] else 18)]
    ref_out, ref_lse = np_flash_attention(q, k, v, True)
    close("out", out, ref_out, "flash_attention", "bf16")
    check_lse(lse, ref_lse)


def test_non_causal_forward_keeps_one_cta_a_tile(monkeypatch) -> None:
    rng = np.random.default_rng(3)
    q, k, v = fa_inputs(rng, 1, 300, 130, 2, 1, 64, 64, "bf16")
    grids = _record_grids(monkeypatch)
    out = ops.flash_attention(q, k, v, backend=HOST)
    assert grids == [("attention_fwd_sm90_d64_bf16", 2 * 3)]
    close("out", out, np_flash_attention(q, k, v, False)[0], "flash_attention", "bf16")


# The probe: after its epilogue each work tile writes, into the lse of its first row, 1000 * the CTA + its turn
# in that CTA's walk (the thread that wrote that lse writes it again: no race).
_PROBE_AT = "    pk_mbarrier_arrive(q_empty);  // done with this work tile's Q"
_PROBE = ("    if (wq == 0 && lane == 0 && c == 0 && q0 < n_q) lse[(o_row0 + q0) * n_heads + h] = blockIdx.x * 1000.0f + n;\n"
          + _PROBE_AT)


def _key_tiles(qt: int, n_q: int, n_k: int, wl: int, wr: int, bc: int) -> int:
    """Key tiles query tile qt visits (pk_attn_q_span's kt0..kt1 for the bottom-right aligned window)."""
    q0, q1 = qt * sm90.ROWS, min((qt + 1) * sm90.ROWS, n_q) - 1
    lo = max(0, q0 + n_k - n_q - wl)
    hi = min(n_k - 1, q1 + n_k - n_q + wr)
    return 0 if hi < lo else hi // bc - lo // bc + 1


@pytest.mark.parametrize("d, window, causal", [(128, (-1, -1), True), (128, (200, -1), False),
                                               (64, (-1, -1), True), (64, (200, -1), False), (256, (-1, -1), True)],
                         ids=["d128-causal", "d128-left-window", "d64-causal", "d64-left-window", "d256-causal"])
def test_each_cta_walks_its_tiles_longest_first(d, window, causal, tmp_path, monkeypatch) -> None:
    write_mutant(tmp_path, monkeypatch, SRC, _PROBE_AT, _PROBE, "fa90_probe.cu",
                 ("attention_fwd_sm90_d", "fa90_probe_d"))
    from pykern import launcher

    real = launcher.launch
    monkeypatch.setattr(launcher, "launch", lambda name, *a, **kw: real(
        name.replace("attention_fwd_sm90_d", "fa90_probe_d"), *a, **kw))
    n_q = n_k = 5 * sm90.ROWS - 60  # 5 query tiles, the last one partial
    rng = np.random.default_rng(11)
    q, k, v = fa_inputs(rng, 1, n_q, n_k, 2, 1, d, d, "bf16")
    out, lse = ops.flash_attention(q, k, v, causal=causal, window_size=window, return_lse=True, backend=HOST)
    ref_out, ref_lse = np_flash_attention(q, k, v, causal, window_size=window)
    close("out", out, ref_out, "flash_attention", "bf16")  # the probe leaves the outputs alone
    wl, wr = normalize(*window, causal, n_q, n_k)
    bc = sm90._CFG[d][0]
    walks: dict[int, list[tuple[int, int]]] = {}
    for h in range(2):
        for qt in range(5):
            tag = int(lse[0, qt * sm90.ROWS, h])
            walks.setdefault(tag // 1000, []).append((tag % 1000, qt))
    assert sorted(walks) == list(range(sm90.HOST_CTAS)), walks  # every CTA ran tiles, no other CTA existed
    for cta, walk in walks.items():
        turns = [t for t, _ in sorted(walk)]
        assert turns == list(range(len(walk))), (cta, walk)  # each tile once, one turn each
        work = [_key_tiles(qt, n_q, n_k, wl, wr, bc) for _, qt in sorted(walk)]
        assert work == sorted(work, reverse=True), (cta, sorted(walk), work)  # longest first
    # and the launch as a whole started the longest tiles: the CTAs' first turns hold the most work
    firsts = sorted(_key_tiles(qt, n_q, n_k, wl, wr, bc) for walk in walks.values() for t, qt in walk if t == 0)
    every = sorted(_key_tiles(qt, n_q, n_k, wl, wr, bc) for qt in range(5) for _ in range(2))
    assert firsts == every[-sm90.HOST_CTAS:], (firsts, every)
    fin = [r for r in range(n_q) if r % sm90.ROWS]  # rows the probe left alone
    check_lse(lse[:, fin], ref_lse[:, fin])


# Consumer 0's closing sync after the steady loop: the one-step loop's (d128) and the pair loop's (d64).
_CLOSING = {128: "                if (PP && c == 0) pk_bar_sync_aligned(FA90_BAR_PP, 256);\n",
            64: "            if (PP && c == 0 && stepped) pk_bar_sync_aligned(FA90_BAR_PP, 256);\n"}


@pytest.mark.parametrize("d", sorted(_CLOSING))
def test_a_ping_pong_left_open_across_work_tiles_is_reported(d: int, tmp_path, monkeypatch) -> None:
    # Without consumer 0 taking consumer 1's last hand-over, that arrival and the next tile's opening one meet at
    # named barrier 3 with no consumer-0 thread: the host reports it (on the GPU, a corrupted turn order). 520
    # queries and keys, causal: at d64 the last two query tiles have two steady key tiles of 192 (one step).
    write_mutant(tmp_path, monkeypatch, SRC, _CLOSING[d], "", "fa90_open.cu", ("attention_fwd_sm90_d", "fa90_open_d"),
                 keep=(f"attention_fwd_sm90_d{d}",))
    from pykern import launcher

    real = launcher.launch
    monkeypatch.setattr(launcher, "launch", lambda name, *a, **kw: real(
        name.replace("attention_fwd_sm90_d", "fa90_open_d"), *a, **kw))
    rng = np.random.default_rng(2)
    q, k, v = fa_inputs(rng, 1, 520, 520, 2, 1, d, d, "bf16")
    with pytest.raises(KernelExecutionError, match=r"named barrier [34]"):
        ops.flash_attention(q, k, v, causal=True, backend=HOST)


def test_the_attention_model_schedules_the_persistent_grid() -> None:
    # causal d128, d64 and d256 (PERSISTENT): the launch is persistent, its tiles walked in strides of the grid; the
    # measured build keeps the block scheduler's waves
    from pykern.bench import attention_model as am

    s = am.Shape(8, 16, 2048, 128, True)
    (lau,), _ = am.sm90_launches("fwd", s, ["attention_fwd_sm90_d128_bf16"])
    assert lau.persistent and lau.ctas == tuple(sorted(lau.ctas, reverse=True))
    (old,), _ = am.sm90_launches("fwd", s, ["attention_fwd_sm90_d128_bf16"], build=am.MEASURED_BUILD)
    assert not old.persistent
    (d64,), _ = am.sm90_launches("fwd", am.Shape(8, 16, 2048, 64, True), ["attention_fwd_sm90_d64_bf16"])
    assert d64.persistent and d64.ctas == tuple(sorted(d64.ctas, reverse=True))
    (d256,), _ = am.sm90_launches("fwd", am.Shape(8, 16, 2048, 256, True), ["attention_fwd_sm90_d256_bf16"])
    assert d256.persistent and d256.ctas == tuple(sorted(d256.ctas, reverse=True))
    assert not am.sm90_launches("fwd", am.Shape(8, 16, 2048, 128, False), ["attention_fwd_sm90_d128_bf16"])[0][0].persistent
    # 2 groups of tiles 4, 3, 2, 1 on 3 slots, longest first across the groups [4, 4, 3 | 3, 2, 2 | 1, 1], rounds
    # in snake order: CTA 0 takes 4, 2, 1; CTA 1 4, 2, 1; CTA 2 3, 3: 7, the greedy bound (a plain stride would
    # give CTA 0 4 + 3 + 1 = 8)
    assert am.strided_span([4, 4, 3, 3, 2, 2, 1, 1], 3) == 7
    assert am.strided_span([5, 1, 1, 1], 3) == 5
    lau2 = am.Launch("k", "f.cu", "sm_90a", 384, 0, (4, 3, 2, 1), 2, 128, 2, 0, (128, 128), persistent=True)
    assert lau2.schedule([4.0, 3.0, 2.0, 1.0], 3) == 7
    # two groups of tiles 6, 1 on 2 slots: [6, 6 | 1, 1], one long and one short tile a CTA
    assert lau2.schedule([6.0, 1.0], 2) == 7


# The dense forward's TMA-store epilogue stages O in the Q tile's rows, which the producer refills with the next work
# tile's Q once q_empty completes: the thread that issues the stores waits until they have read shared memory
# (cp.async.bulk.wait_group.read) before its arrival. The host performs a store at that wait (or at the thread's
# exit), so a copy without it stores whatever the buffer holds by then (later tiles' Q and O).
_STORE_READ = "            pk_tma_store_wait_read<0>();\n"
# The staging barrier (named barrier 1 + c over the consumer warpgroup) of every form's epilogue.
_STORE_BAR = "    pk_bar_sync_aligned(tx / 128, 128);  // the warpgroup's rows are all written"


def _spy_mutant(tmp_path, monkeypatch, old: str, new: str, tag: str, d: int = 128, form: str = "") -> None:
    """A copy of the source with `old` replaced (only the d{d} family of the form kept: "" dense, "varlen_"),
    launched by the ops in place of the real attention_fwd_{form}sm90_d{d} kernels."""
    from pykern import launcher

    real_name = f"attention_fwd_{form}sm90_d"
    write_mutant(tmp_path, monkeypatch, SRC, old, new, f"fa90_{tag}.cu", (real_name, f"fa90_{tag}_d"),
                 keep=(f"{real_name}{d}",))
    real = launcher.launch
    monkeypatch.setattr(launcher, "launch", lambda name, *a, **kw: real(
        name.replace(real_name, f"fa90_{tag}_d"), *a, **kw))


def test_the_epilogue_store_reads_o_before_the_next_q_lands(tmp_path, monkeypatch) -> None:
    rng = np.random.default_rng(5)
    q, k, v = fa_inputs(rng, 2, 300, 330, 3, 1, 128, 128, "bf16")  # 18 work tiles on HOST_CTAS = 3 CTAs
    ref_out, _ = np_flash_attention(q, k, v, True)
    _spy_mutant(tmp_path, monkeypatch, _STORE_READ, "", "noread")
    out = np.asarray(ops.flash_attention(q, k, v, causal=True, backend=HOST), np.float64)
    assert not np.allclose(out, ref_out, atol=0.05)


@pytest.mark.slow
def test_the_epilogue_is_clean_under_racecheck_and_needs_its_barrier(tmp_path, monkeypatch) -> None:
    # Racecheck counts a TMA store's box as read by the thread that starts it, when it starts: the warpgroup's named
    # barrier orders the other warps' rows before that; without it their writes race with the store.
    monkeypatch.setenv("PYKERN_HOST_RACECHECK", "1")
    rng = np.random.default_rng(6)
    q, k, v = fa_inputs(rng, 1, 300, 300, 2, 1, 128, 128, "bf16")
    _spy_mutant(tmp_path, monkeypatch, _STORE_BAR, _STORE_BAR, "rcsame")
    out = ops.flash_attention(q, k, v, causal=True, backend=HOST)
    close("out", out, np_flash_attention(q, k, v, True)[0], "flash_attention", "bf16")
    _spy_mutant(tmp_path, monkeypatch, _STORE_BAR, "    //", "rcnobar")  # the comment after it stays one
    with pytest.raises(KernelExecutionError, match=r"read-after-write race"):
        ops.flash_attention(q, k, v, causal=True, backend=HOST)


@pytest.mark.slow
def test_the_varlen_epilogue_is_clean_under_racecheck_and_needs_its_barrier(tmp_path, monkeypatch) -> None:
    # The varlen (and paged) epilogue: each thread of the warpgroup reads 16-byte pieces of rows other warps of it
    # wrote into the Q tile; the named barrier orders those writes before the reads. Without it racecheck reports
    # the reads. Sequences of 5 and 90 rows: rows past each sequence's end are neither written nor read.
    from pykern.ops.serving import flash_attention_varlen

    monkeypatch.setenv("PYKERN_HOST_RACECHECK", "1")
    rng = np.random.default_rng(7)
    lq, lk = [5, 90], [70, 90]
    q, k, v = (a[0] for a in fa_inputs(rng, 1, sum(lq), sum(lk), 2, 1, 128, 128, "bf16"))
    cu_q = np.array([0, 5, 95], np.int32)
    cu_k = np.array([0, 70, 160], np.int32)
    _spy_mutant(tmp_path, monkeypatch, _STORE_BAR, _STORE_BAR, "vrcsame", form="varlen_")
    out = flash_attention_varlen(q, k, v, cu_q, cu_k, causal=True, backend=HOST)
    ref = np.concatenate([np_flash_attention(q[None, 0:5], k[None, 0:70], v[None, 0:70], True)[0][0],
                          np_flash_attention(q[None, 5:95], k[None, 70:160], v[None, 70:160], True)[0][0]])
    close("out", out, ref, "flash_attention_varlen", "bf16")
    _spy_mutant(tmp_path, monkeypatch, _STORE_BAR, "    //", "vrcnobar", form="varlen_")
    with pytest.raises(KernelExecutionError, match=r"read-after-write race"):
        flash_attention_varlen(q, k, v, cu_q, cu_k, causal=True, backend=HOST)
