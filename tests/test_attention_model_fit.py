"""The calibrated attention model against our own 2026-11-27 H200 measurements (docs/measured/2026-11-27-h200/
attention.json, pykern's entries only): every fitted point within 15%, the named unfitted family within what the
docs state, and the constants the code uses equal to what fit() returns on that file (a refit is checked)."""
from __future__ import annotations

import json

import pytest

from pykern.bench import attention_model as am
from pykern.errors import ArgumentError


@pytest.fixture(scope="module")
def sass():
    """The measured build's SASS: the snapshot compiled from the measured commit (no NVRTC needed)."""
    pytest.importorskip("numpy")
    return am.sass_for(am.MEASURED_BUILD)


def _snapshot_doc() -> dict:
    return json.loads(am.MEASURED_SASS.read_text())


def test_the_measured_build_reads_the_snapshot_of_the_measured_commit(sass):
    """fit / compare / calibrated model the measured build with the SASS of the commit that was timed, not with
    today's: the sm_90a dK/dV loop at d128 ran 4.188 warp-instructions per m16n8k16-equivalent on 2026-11-27
    (today's is leaner), and that is the figure the measured build's model reads."""
    doc = _snapshot_doc()
    assert doc["build"] == am.MEASURED_BUILD and doc["commit"] == "e20e39881212e7100b634554f548f1f4dd1c19ce"
    assert isinstance(sass, am.SassSnapshot) and sass.commit == doc["commit"]
    k = sass.inputs("attention_bwd_sm90_dkdv_d128_bf16", "sm_90a")
    assert k.loop.per_mma == pytest.approx(4.188, abs=5e-4) and k.regs == 168 and k.loop.wgmma
    rec = next(r for r in doc["kernels"] if r["kernel"] == k.kernel)
    assert rec["compiled_as"] == "attention_backward_sm90_dkdv_d128_bf16"  # its name before the 2026-11-29 rename
    assert am.KernelInputs.from_record(k.to_record()) == k
    # every (kernel, arch) the measured points launch is in the snapshot: the 15 of the wgmma and mma.sync paths
    assert len(doc["kernels"]) == 15
    # the default SASS of compare / calibrated is the snapshot: a model of the measured build equals one handed it
    s = am.Shape(4, 16, 4096, 128, False)
    assert am.calibrated("bwd", s, "wgmma")["time_s"] == am.calibrated("bwd", s, "wgmma", sass)["time_s"]
    with pytest.raises(ArgumentError, match="attention_bwd_sm90_dkdv_d256_bf16"):
        sass.inputs("attention_bwd_sm90_dkdv_d256_bf16", "sm_90a")  # no d256 sm_90a backward on 2026-11-27
    with pytest.raises(ArgumentError, match="path"):
        am.SassSnapshot(am.MEASURED)  # an attention.json is no snapshot


def test_the_snapshot_differs_from_todays_sass_where_the_kernels_changed(sass):
    """Today's sources compiled now (NVRTC) give a different dK/dV d128 loop: the reason the fit must not read them."""
    try:
        now = am.SassSource().inputs("attention_bwd_sm90_dkdv_d128_bf16", "sm_90a")
    except Exception as e:  # no cuobjdump / NVRTC here
        pytest.skip(f"SASS unavailable: {type(e).__name__}: {e}")
    old = sass.inputs("attention_bwd_sm90_dkdv_d128_bf16", "sm_90a")
    assert now.loop.per_mma < old.loop.per_mma - 1.0


def test_measured_points_are_ours_only(tmp_path):
    pts = am.measured_points()
    rows = json.loads(am.MEASURED.read_text())
    assert len(pts) == 4 * len(rows) == 72
    assert {p["entry"] for p in pts} == {"pykern", "pykern_mma_sync"}  # never sdpa_flash / sdpa_cudnn
    r0 = rows[0]
    fwd = next(p for p in pts if p["entry"] == "pykern" and p["phase"] == "fwd")
    bwd = next(p for p in pts if p["entry"] == "pykern" and p["phase"] == "bwd")
    assert fwd["measured_s"] == pytest.approx(r0["pykern"]["fwd_us"] * 1e-6)
    assert bwd["measured_s"] == pytest.approx((r0["pykern"]["fwdbwd_us"] - r0["pykern"]["fwd_us"]) * 1e-6)
    # every row is fitted: the fused mma.sync backward (d64 / d128) too, since its dQ REDs have the l2 red term
    assert all(p["fitted"] for p in pts)
    with pytest.raises(ArgumentError, match="path"):
        am.measured_points(tmp_path / "missing.json")


def test_every_fitted_shape_within_15_percent(sass):
    """Every fitted row within 15%: the sm_90a path's 36, and the mma.sync path's 36 -- among them the FlashAttention-2
    forward core at d64 / d128, once +15.5..+20.4% at d128 when rho_mma_sync also charged the tensor pipe's time
    that the core's shared-memory stream hides, and the fused backward at d64 / d128, 36-47% optimistic before its
    dQ REDs had the l2 red term."""
    rows = am.compare(am.measured_points(), am.FITTED, sass)
    errs = {(r["entry"], r["phase"], r["shape"]["head_dim"], r["shape"]["causal"], r["shape"]["seq"]): r["err_after"]
            for r in rows if r["fitted"]}
    assert len(errs) == 72
    bad = {k: round(100 * e, 1) for k, e in errs.items() if abs(e) > 0.15}
    assert not bad
    # the mma.sync forward: 18 rows, the d64 / d128 core bound by its shared-memory reads
    fwd = {k: e for k, e in errs.items() if k[:2] == ("pykern_mma_sync", "fwd")}
    assert len(fwd) == 18 and max(abs(e) for e in fwd.values()) <= 0.15
    assert all(r["binding"] == "smem (fwd)" for r in rows if r["entry"] == "pykern_mma_sync" and r["phase"] == "fwd"
               and r["shape"]["head_dim"] in (64, 128))
    for r in rows:
        assert r["binding"].split(" (")[0] in ("issue", "smem", "tensor", "mufu", "serial", "softmax+barrier", "cta",
                                               "edge", "hbm", "call", "l2", "l2 red")
        # the calibrated model adds time to the bound; it is never faster
        assert r["after_s"] > r["before_s"]
    # the fused mma.sync backward: its 12 rows bound by the L2's atomic rate (the bound was 47-60% optimistic there)
    fused = [r for r in rows
             if r["entry"] == "pykern_mma_sync" and r["phase"] == "bwd" and r["shape"]["head_dim"] < 256]
    assert len(fused) == 12 and all(r["binding"] == "l2 red (fused)" and abs(r["err_after"]) <= 0.15 for r in fused)
    assert all(r["err_before"] < -0.45 for r in fused)
    # before: the bound was 1.4-2.9x optimistic on the sm_90a forward
    assert max(r["err_before"] for r in rows if r["entry"] == "pykern" and r["phase"] == "fwd") < -0.3


def test_shared_memory_and_tensor_hide_each_other_in_an_mma_sync_cta():
    """rho_mma_sync scales the terms that do not run beside the binding one: a shared-memory-bound CTA adds rho x
    (issue + mufu), its tensor time hidden under the LDSM stream (and the other way round); an issue-bound one adds
    rho x everything else."""
    t = {"issue": 3.0, "smem": 10.0, "tensor": 7.0, "mufu": 2.0}
    assert am._unhidden(t, "smem") == 5.0
    assert am._unhidden({**t, "tensor": 12.0}, "tensor") == 5.0
    assert am._unhidden({**t, "issue": 20.0}, "issue") == 19.0


def test_code_constants_are_what_the_fit_returns(sass):
    got = am.fit(am.MEASURED, sass)
    for k, v in am.FITTED.to_dict().items():
        assert getattr(got, k) == pytest.approx(v, rel=2e-3), k


def _bwd_names(d: int) -> list[str]:
    from pykern.ops import _attention_sm90 as h

    return [h.bwd_kernel_name(p, d, 0.0, "_bf16", False) for p in ("dkdv", "dq")] + [
        h.bwd_fused_kernel_name(d, det, "_bf16", 0.0, False) for det in (False, True)]


def test_the_current_fused_backward_sends_dq_by_bulk_reduce_into_l2():
    """The current sm_90a fused backward adds each tile pair's dQ partial with one bulk reduce-add (its l2 term: the
    partials' bytes at the L2 bandwidth); while the accumulator of the CTAs in flight fits L2, its HBM bytes are the
    accumulator's lines read once and written back once, not an add's 4 bytes a float a key tile. The measured build
    (no fused sm_90a kernel; the mma.sync fused kernel's per-float REDs) has no such term."""
    from pykern.ops import _attention_sm90 as h

    for d in (64, 128, 256):
        s = am.Shape(1, 2, 4096, d, False)
        (lau,), why = am.sm90_launches("bwd", s, _bwd_names(d), hw=am.H200)
        (red,), _ = am.sm90_launches("bwd", s, _bwd_names(d), hw=am.H200, dq_bulk=False)
        keys = h.bwd_dkdv_rows(d)
        assert why == "" and "_sm90_fused" in lau.kernel and lau.l2_red_pair == d * 4 / keys
        assert red.l2_red_pair == 0
        ws = 2 * 4096 * d * 4  # both heads' fp32 accumulator
        n_kt = 4096 // keys
        assert red.hbm_bytes - lau.hbm_bytes == n_kt * ws - 2 * ws
        assert lau.hbm_bytes == red.hbm_bytes - sum(red.ctas) // keys * d * 4 * red.groups + 2 * ws
        k = am.KernelInputs(lau.kernel, "sm_90a", am.LoopInputs("flat", 300, 160.0, 0, 26624.0, 300, wgmma=True),
                            168, 0)
        terms = am.kernel_bound(lau, k, am.H200)["terms_s"]
        # the l2 term: every partial's bytes over the L2's bytes a clock (one CTA an SM, 32 key tiles over 132 SMs)
        assert terms["l2"] == pytest.approx(max(lau.ctas) * d * 4 / keys * 132 / am.H200.l2_bytes_clk
                                            / am.H200.clock_hz)
        assert "l2" not in am.kernel_bound(red, k, am.H200)["terms_s"]
    # an accumulator the CTAs in flight cannot keep in L2 (one head of 128k queries at d128: 64 MiB > 60 MiB): every
    # add's bytes again, the bulk's l2 term kept
    big = am.Shape(1, 1, 131072, 128, False)
    (lau,), _ = am.sm90_launches("bwd", big, _bwd_names(128), hw=am.H200)
    (red,), _ = am.sm90_launches("bwd", big, _bwd_names(128), hw=am.H200, dq_bulk=False)
    assert lau.hbm_bytes == red.hbm_bytes and lau.l2_red_pair > 0
    # the measured build: no fused sm_90a kernel, no bulk term; the mma.sync fused kernel keeps its REDs in HBM bytes
    s = am.Shape(1, 2, 4096, 128, False)
    old, _ = am.sm90_launches("bwd", s, _bwd_names(128), build="2026-11-27", hw=am.H200)
    assert [x.kernel for x in old] == _bwd_names(128)[:2] and all(x.l2_red_pair == 0 for x in old)
    (mma,) = am.launches("bwd", s)
    assert "_tc_fused" in mma.kernel and mma.l2_red_pair == 0


def test_bulk_dq_rows_are_labelled_a_modelled_bound(sass, monkeypatch, capsys):
    """--attention-model --bulk-dq: the current build's backward before (REDs to HBM) and after (bulk into L2); at the
    table's shapes the fused launch's HBM term falls, the l2 term is named, and shared memory binds both."""
    try:
        cur = am.sass_for("current")
        rows = am.bulk_dq_rows(cur, shapes=[am.Shape(4, 16, 4096, 128, False)])
    except Exception as e:  # no cuobjdump / NVRTC here
        pytest.skip(f"SASS unavailable: {type(e).__name__}: {e}")
    (r,) = rows
    assert r["hbm_after_s"] < r["hbm_before_s"] and r["l2_s"] > 0 and r["after_s"] <= r["before_s"]
    text = am.format_bulk_dq(rows)
    assert text.startswith("Modelled bound (not a measurement)")
    # the command that prints it (docs/attention_sm90.md quotes its output)
    from pykern.bench import cli

    monkeypatch.setattr(am, "bulk_dq_rows", lambda: rows)
    assert cli.main(["--attention-model", "--bulk-dq"]) == cli.EXIT_OK
    assert capsys.readouterr().out.strip() == text
    assert cli.main(["--attention-model", "--bulk-dq", "--json"]) == cli.EXIT_OK
    assert json.loads(capsys.readouterr().out)["model"] == "attention-bulk-dq"


def test_the_fused_mma_sync_backward_charges_its_dq_reds_to_the_l2_atomic_rate(sass):
    """The fused mma.sync backward's atomic dQ adds a query row's D floats per key tile of BC keys, one RED.E.ADD.F32 a
    float (its SASS: 16 REDG.E.ADD.F32 a warp per step of BR x BC pairs, 4 warps: BR x D floats), so D / BC a pair;
    the deterministic mode stores partials (no RED) and the dK/dV + dQ pair has none. The calibrated model charges
    them at l2_red_clk (floats per SM clock for the GPU); the bound, which takes no fitted constant, does not."""
    from pykern.ops import attention as ta

    for d in (64, 128):
        s = am.Shape(4, 2048 // d, 4096, d, False)
        (lau,) = am.launches("bwd", s)
        (det,) = am.launches("bwd", s, "deterministic")
        assert lau.l2_atomic_pair == d / ta._FUSED_BC and det.l2_atomic_pair == 0
        # BR x D floats a step of BR x BC pairs
        assert lau.l2_atomic_pair * lau.step[0] * lau.step[1] == ta._FUSED_BR[d] * d
        k = sass.inputs(lau.kernel, "sm_90")
        with_red = am.calibrated_launch(lau, k, am.H200, am.FITTED)
        without = am.calibrated_launch(lau, k, am.H200, am.Calibration(**{**am.FITTED.to_dict(), "l2_red_clk": 0.0}))
        assert with_red["binding"] == "l2 red" and with_red["time_s"] > without["time_s"]
        assert "l2 red" not in am.kernel_bound(lau, k, am.H200)["terms_s"]
    assert all(x.l2_atomic_pair == 0 for x in am.launches("bwd", am.Shape(4, 8, 4096, 256, False)))
    # the fitted rate against the 2026-11-27 Nsight Compute profile of the kernel (batch 2, 8192 keys, full, d64 and
    # d128, 32 / 16 heads: 2 x 32 x 8192^2 x (64 / 64) floats = 2 x 16 x 8192^2 x (128 / 64) in 32.9 / 33.4 M cycles
    # at 1.80 GHz, i.e. 130 / 129 floats a clock with the L2 at 84.1 / 83.0% of peak): above what the profile
    # achieved, below that over the L2's busy share
    achieved = 2 * 32 * 8192 ** 2 / 32924535
    assert achieved < am.FITTED.l2_red_clk < achieved / 0.83
