"""MLA paged decode on sm_90a (kernels_cu/mla_sm90.cu, wgmma): on the host backend playing sm_90a
(PYKERN_HOST_ARCH=sm_90a, the emulation of pykern/host/pk_host_sm90.cpp) MLAPagedDecodePlan.run launches
mla_decode_sm90 and matches the float64 reference within the bf16 / f16 rows of the tolerance table: heads 16 /
64 / 128 (and 80: a second, mostly masked CTA), page sizes 1 / 3 / 16 / 32 / 64, ragged lengths with 0 and 1, kv
splits merged by merge_states; scores that rise across tiles (the online softmax's rescale); the same answer as
the mma.sync kernel; and the mma.sync kernel on every other arch."""
from __future__ import annotations

import numpy as np
import pytest

from pykern import ops
from pykern.difftest.cases.mla import make_mla_inputs, np_mla_decode, run_mla
from pykern.ops.mla import MLA90_SMEM_BYTES, uses_sm90
from family_helpers import check
from launch_spy import record_launches

SCALE = 1.0 / np.sqrt(192.0)

# (kind, kv lengths, heads, page_size, num_splits)
SHAPES = [
    ("bf16", (1,), 16, 1, 1),
    ("f16", (150, 0, 1), 16, 16, 1),   # 3 tiles of 64 keys: the 2-slot ring wraps; an empty request
    ("bf16", (130, 33), 64, 64, 1),    # one full head tile; a page is a tile
    ("f16", (45, 1), 128, 16, 1),      # two head tiles
    ("bf16", (50,), 80, 1, 1),         # a second head tile with 48 rows past num_heads
    ("bf16", (130, 17, 0), 16, 16, 3),  # splits at multiples of 32 keys (the merge), empty ones for short requests
    ("f16", (200,), 128, 32, 2),       # a split of 100 keys -> 128: two tiles, the second one partial
    ("bf16", (70, 7), 16, 3, 1),       # pages of 3 keys: a tile's rows from 22 pages, one page across tiles
]


@pytest.fixture
def sm90(monkeypatch):
    monkeypatch.setenv("PYKERN_HOST_ARCH", "sm_90a")


def _ref(x: dict) -> dict:
    o, lse = np_mla_decode(x["q_nope"], x["q_pe"], x["ckv"], x["kpe"], x["kv_indptr"], x["kv_indices"], x["kv_len"],
                           SCALE)
    return {"out": o, "lse": lse}


@pytest.mark.parametrize("kind,lens,heads,ps,ns", SHAPES)
def test_matches_float64_and_runs_the_wgmma_kernel(kind, lens, heads, ps, ns, sm90, monkeypatch) -> None:
    x = make_mla_inputs(np.random.default_rng(len(lens) * 1000 + heads + ps + ns), kind, lens, heads, ps)
    names = record_launches(monkeypatch)
    got = run_mla(x, SCALE, "host", ns)
    sfx = "_" + kind
    assert names == ["mla_decode_sm90" + sfx] + (["merge_states" + sfx] if ns > 1 else [])
    check(got, _ref(x), "mla_decode", kind)
    empty = np.asarray(lens) == 0  # an empty request: out 0, lse -inf
    assert (got["out"][empty] == 0).all() and (got["lse"][empty] == -np.inf).all()
    assert np.isfinite(got["lse"][~empty]).all()


def test_scores_rising_across_tiles_rescale_the_output(sm90) -> None:
    # every 32 keys the scores of head 0 rise far above the earlier ones: each 64-key tile raises the row max, so
    # O and l are rescaled (by ~0), in both consumers; a kernel that kept the old base would overflow or weigh the
    # early keys
    x = make_mla_inputs(np.random.default_rng(11), "bf16", (128,), 16, 16)
    pages = x["kv_indices"][:8]
    ramp = np.repeat(np.arange(4, dtype=np.float32), 32).reshape(8, 16, 1)  # tile index of each key
    ckv = x["ckv"].astype(np.float32)
    ckv[pages] += 3.0 * ramp * np.sign(x["q_nope"][0, 0].astype(np.float32))
    x["ckv"] = ckv.astype(x["ckv"].dtype)
    check(run_mla(x, SCALE, "host"), _ref(x), "mla_decode", "bf16")


def test_same_answer_as_the_mma_sync_kernel(monkeypatch) -> None:
    x = make_mla_inputs(np.random.default_rng(2), "f16", (77, 5), 64, 16)
    names = record_launches(monkeypatch)
    monkeypatch.setenv("PYKERN_HOST_ARCH", "sm_80")
    tc = run_mla(x, SCALE, "host")
    monkeypatch.setenv("PYKERN_HOST_ARCH", "sm_90a")
    wg = run_mla(x, SCALE, "host")
    assert names == ["mla_decode_f16", "mla_decode_sm90_f16"]
    # the two kernels sum S in different orders (fp32): close, not equal
    np.testing.assert_allclose(wg["lse"], tc["lse"], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(wg["out"], tc["out"], rtol=0, atol=2e-3)


@pytest.mark.parametrize("arch", [None, "sm_80", "sm_89"])
def test_other_archs_keep_the_mma_sync_kernel(arch, monkeypatch) -> None:
    if arch is None:
        monkeypatch.delenv("PYKERN_HOST_ARCH", raising=False)
    else:
        monkeypatch.setenv("PYKERN_HOST_ARCH", arch)
    assert not uses_sm90("host") and not uses_sm90("numba")
    x = make_mla_inputs(np.random.default_rng(0), "bf16", (20,), 16, 1)
    names = record_launches(monkeypatch)
    run_mla(x, SCALE, "host")
    assert names == ["mla_decode_bf16"]


def test_launches_names_the_kernel_of_the_backend(sm90) -> None:
    plan = ops.MLAPagedDecodePlan()
    plan.plan(np.arange(3), np.array([0, 128, 256]), np.arange(256), np.full(2, 8192), 128, 512, 64, 64, False,
              SCALE, "bf16", num_splits=4)
    assert plan.launches("host") == [("mla_decode_sm90_bf16", (2, 2, 4), (384,), MLA90_SMEM_BYTES),
                                      ("merge_states_bf16", (1, 128), (256,), 0)]
    assert plan.launches("numba")[0][:3] == ("mla_decode_bf16", (8, 2, 4), (128,))
    assert MLA90_SMEM_BYTES <= 227 * 1024  # an H100 / H200 CTA's dynamic shared memory


def test_default_splits_fill_one_cta_a_sm_for_the_wgmma_kernel(monkeypatch) -> None:
    # 128 heads, batch 4: 8 wgmma CTAs (64 heads each, one a SM by shared memory) -> 17 splits for 132 SMs;
    # the mma.sync kernel's 32 CTAs (16 heads, two a SM) -> 9
    def splits() -> int:
        p = ops.MLAPagedDecodePlan(backend="host")
        p.plan(np.arange(5), np.arange(5) * 512, np.arange(2048), np.full(4, 32768), 128, 512, 64, 64, False, SCALE,
               "bf16")
        return p.num_splits

    monkeypatch.setenv("PYKERN_HOST_ARCH", "sm_90a")
    assert splits() == 17
    monkeypatch.setenv("PYKERN_HOST_ARCH", "sm_80")
    assert splits() == 9
