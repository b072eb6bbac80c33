"""pykern.bench.attention_model: the FP8 (e4m3) sm_90a forward's modelled bound. QGMMA counted and run at twice the
bf16 rate, the rate-p code read from a listing (the lazy tile's out-of-line redo path, or the row-max-first tile's
rescale block a warp vote skips), the tensor term by hand, the binding term and the redo
rate's effect; the SASS inputs from the FP8 kernels' own names, through a snapshot (no compile) and, where the
compile cache and cuobjdump are here, the real SASS."""
from __future__ import annotations

import json
import math

import pytest

from pykern.bench import attention_model as am
from pykern.errors import ArgumentError

H100 = am.HARDWARE["sm_90"]

# The FP8 kernels' SASS inputs (NVRTC sm_90a, the flat loop without its rescale block and that block, taken where a
# row of the warp grew, as loop_inputs reads them; the real SASS test below checks the fields the model uses against
# today's compile): (insns, mma, smem, mufu, fma, rate-p insns, rate-p mufu, rate-p fma, straight)
FP8_SASS = {64: (515, 128, 9216, 64, 196, 39, 2, 36, 534), 128: (524, 256, 14336, 64, 196, 71, 2, 68, 559),
            256: (360, 256, 16384, 32, 100, 135, 2, 132, 555)}
# The d64 and d128 _softcap kernels' (the table's softcap rows): a tanh a score more on MUFU, and a quarter of the
# exp2s on the FMA pipe (FA90F8_FEX: 16 a thread a tile, 48 left on MUFU; 112 MUFU with the 64 tanhs)
FP8_SASS_SOFTCAP = {64: (772, 128, 9216, 112, 356, 39, 2, 36, 549), 128: (781, 256, 14336, 112, 356, 71, 2, 68, 573)}


def fp8_inputs(d: int, softcap: bool = False) -> am.KernelInputs:
    n, mma, smem, mufu, fma, rn, rm, rf, straight = (FP8_SASS_SOFTCAP if softcap else FP8_SASS)[d]
    loop = am.LoopInputs("flat", n, float(mma), 0, float(smem), straight, wgmma=True, mufu=mufu, fma=fma,
                         redo_insns=rn, redo_mufu=rm, redo_fma=rf)
    return am.KernelInputs(f"attention_fwd_sm90_d{d}{'_softcap' if softcap else ''}_fp8", "sm_90a", loop, 168, 0)


@pytest.fixture()
def snapshot(tmp_path) -> am.SassSnapshot:
    """A SassSnapshot of the FP8 kernels the table reads (the interface the model reads; no NVRTC, no cuobjdump)."""
    doc = {"commit": "0" * 40, "build": "current", "kernels": [fp8_inputs(d).to_record() for d in FP8_SASS]
           + [fp8_inputs(d, True).to_record() for d in FP8_SASS_SOFTCAP]}
    path = tmp_path / "fp8_sass.json"
    path.write_text(json.dumps(doc))
    return am.SassSnapshot(path)


def sass_listing(body: list[str]) -> str:
    """cuobjdump -sass text of one function "k" whose instructions are `body`, 16 bytes apart from 0x0."""
    lines = ["\t\tFunction : k"]
    for i, t in enumerate(body):
        lines.append(f"        /*{16 * i:04x}*/                   {t} ;                /* 0x0000000000000000 */")
    return "\n".join(lines) + "\n"


def fp8_listing() -> str:
    """A flat QGMMA loop whose warp vote falls through to a redo block that branches back to two instructions
    before the loop's head (the FP8 forward's shape): re-entry, loop, exit branch, redo, back branch."""
    body = ["IMAD.MOV.U32 R1, RZ, RZ, R2",
            "FADD R204, R201, -3",  # 0x10: the re-entry
            "QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR4], R24, gsb0",  # 0x20: the loop's head
            "QGMMA.64x128x32.F32.E4M3.E4M3 R88, R160, gdesc[UR8], R88, gsb0",
            "MUFU.EX2 R1, R2",
            "VOTE.ALL P1, !P1",
            "@P1 BRA P2, 0x20",  # 0x60: the back branch (accepted and more tiles)
            "@P1 BRA 0xc0",  # the exit (accepted, the last tile)
            "MUFU.EX2 R1, R2",  # the redo
            "FMUL R3, R3, R4",
            "FFMA R5, R5, R6, R7",
            "@P1 BRA 0x10",  # 0xb0: back to the re-entry
            "EXIT"]
    return sass_listing(body)


def test_qgmma_counts_2n_over_8_and_its_operand_bytes_and_the_redo_path_is_read():
    li = am.loop_inputs(fp8_listing(), "k")
    assert li is not None and li.loop == "flat" and li.wgmma
    assert li.insns == 5  # 0x20 .. 0x60
    assert li.mma == 2 * 2 * 128 / 8  # a warp's m16x128x32 share: 2N/8 m16n8k16-equivalents of 4096 FLOP each
    assert li.mma * am.MMA_FLOP == 2 * 16 * 128 * 32 * 2  # the two QGMMAs' FLOP a warp
    # S (SS): B 128 x 32 bytes and A 64 x 32 through descriptors; P V (RS): B only; a quarter a warp
    assert li.smem_bytes == (32 * 128 + 2048) / 4 + 32 * 128 / 4
    assert am.smem_bytes("QGMMA", ".64x128x32.F32.E4M3.E4M3", "R24, gdesc[UR4], R24") == \
        am.smem_bytes("HGMMA", ".64x128x16.F32.BF16", "R24, gdesc[UR4], R24")
    # redo: the exit branch, MUFU, FMUL, FFMA, the back branch, and the re-entry's FADD
    assert (li.redo_insns, li.redo_mufu, li.redo_fma) == (6, 1, 3)
    assert (li.mufu, li.fma) == (1, 0)


def test_a_loop_without_a_redo_path_has_none():
    text = fp8_listing().replace("@P1 BRA 0x10", "BRA 0xc0")  # the block leaves forward: no way back
    li = am.loop_inputs(text, "k")
    assert li is not None and (li.redo_insns, li.redo_mufu, li.redo_fma) == (0, 0, 0)


def mf_listing() -> str:
    """A flat QGMMA loop whose body holds a block a warp vote skips (the row-max-first tile's rescale): loop head,
    VOTE.ANY, the forward branch over the block, the block, the rest of the body, the back branch."""
    body = ["QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR4], R24, gsb0",  # 0x00: the loop's head
            "MUFU.EX2 R1, R2",
            "VOTE.ANY P1, P1",
            "@!P1 BRA 0x70",  # 0x30: no row of the warp grew
            "MUFU.EX2 R3, R4",  # the block
            "FMUL R5, R5, R3",
            "FMUL R6, R6, R3",
            "FADD R7, R7, R1",  # 0x70
            "@P0 BRA 0x0",  # the back branch
            "EXIT"]
    return sass_listing(body)


def test_the_rescale_block_a_vote_skips_is_the_rate_p_code():
    li = am.loop_inputs(mf_listing(), "k")
    assert li is not None and li.loop == "flat"
    assert li.insns == 6 and (li.mufu, li.fma) == (1, 1)  # the body less the block
    assert (li.redo_insns, li.redo_mufu, li.redo_fma) == (3, 1, 2)
    # a forward branch not after a VOTE.ANY (a lane's own condition) is no rate-p block: counted every tile
    li = am.loop_inputs(mf_listing().replace("VOTE.ANY P1, P1", "ISETP.NE.AND P1, PT, R1, RZ, PT"), "k")
    assert li.insns == 9 and li.redo_insns == 0


def test_fp8_launch_follows_the_fp8_geometry():
    from pykern.ops import _attention_sm90 as h

    s = am.Shape(1, 16, 16384, 128, False)
    (lau,), why = am.fp8_launch(s, ["attention_fwd_sm90_d128_fp8"], redo=0.5)
    assert not why and lau.kernel == "attention_fwd_sm90_d128_fp8" and lau.source == "attention_fwd_fp8_sm90.cu"
    assert lau.threads == h.THREADS and lau.smem == h.fp8_shared_bytes(128) and not lau.persistent
    assert lau.step == (128, 128) and lau.ctas == (16384 * 16384 // 128,) * 128 and lau.groups == 16
    assert lau.tensor_rate == 2.0 and lau.redo_p == 0.5 and lau.mma_warps == 8
    # q, k, v one byte an element, out bf16, lse fp32
    assert lau.hbm_bytes == 3 * 16384 * 16 * 128 + 2 * 16384 * 16 * 128 + 4 * 16384 * 16
    (l256,), _ = am.fp8_launch(am.Shape(1, 8, 1024, 256, True), ["attention_fwd_sm90_d256_fp8"])
    assert l256.step == (128, 64) and l256.redo_p == am.fp8_redo_rate(1024) == am.FP8_REDO[1024]
    assert l256.ctas == tuple(sorted(l256.ctas, reverse=True))  # causal: longest query tiles first
    assert am.fp8_launch(am.Shape(1, 8, 1024, 96, False), ["attention_fwd_sm90_d96_fp8"])[0] == []
    assert am.fp8_launch(am.Shape(1, 8, 1024, 128, False), [])[0] == []
    with pytest.raises(ArgumentError, match="redo"):
        am.fp8_launch(s, ["attention_fwd_sm90_d128_fp8"], redo=1.5)
    with pytest.raises(ArgumentError, match="fp8"):
        am.sm90_launches("bwd", s, ["attention_fwd_sm90_d128_fp8"], fp8=True)
    assert am.sm90_launches("fwd", s, ["attention_fwd_sm90_d128_fp8"], build="2026-11-27", fp8=True)[0] == []


def test_redo_rate_default_follows_the_documented_random_score_rates():
    assert [am.fp8_redo_rate(n) for n in (512, 1024, 4096, 16384, 65536)] == [0.86, 0.86, 0.65, 0.29, 0.29]
    assert am.fp8_redo_rate(1024) > am.fp8_redo_rate(2048) > am.fp8_redo_rate(4096) > am.fp8_redo_rate(8192) \
        > am.fp8_redo_rate(16384)


def test_tensor_term_by_hand_and_the_binding_term_at_d128_16k():
    """d128, seq 16384, 16 heads, not causal: 2048 CTAs, one an SM (shared memory), 16 rounds of 128 key tiles of
    8 warps x 256 m16n8k16-equivalents, each 4096 FLOP, at twice the bf16 FLOP a clock."""
    s = am.Shape(1, 16, 16384, 128, False)
    (lau,), _ = am.fp8_launch(s, ["attention_fwd_sm90_d128_fp8"], redo=0.29)
    k = fp8_inputs(128)
    r = am.kernel_bound(lau, k, H100)
    assert r["ctas_per_sm"] == 1 and r["ctas"] == 2048
    tile_clk = 8 * 256 * am.MMA_FLOP / (2 * H100.tensor_flop_clk)
    want = math.ceil(2048 / 132) * 128 * tile_clk / H100.clock_hz
    assert r["terms_s"]["tensor"] == pytest.approx(want, rel=1e-12)
    # mufu: every score's exp2 on MUFU (64 a warp a tile) plus the rescale block's 2 at p, 16 results a clock
    mufu = math.ceil(2048 / 132) * 128 * 8 * (64 + 0.29 * 2) * 32 / 16 / H100.clock_hz
    assert r["terms_s"]["mufu"] == pytest.approx(mufu, rel=1e-12)
    # issue: (524 + 0.29 x 71) a warp a tile, 4 a clock, plus the straight-line code of 12 warps
    issue = math.ceil(2048 / 132) * (128 * 8 * (524 + 0.29 * 71) + 12 * 559) / 4 / H100.clock_hz
    assert r["terms_s"]["issue"] == pytest.approx(issue, rel=1e-12)
    assert r["binding"] == "issue" and r["time_s"] == pytest.approx(issue, rel=1e-12)
    # the same kernel with the bf16 pipe's rate would take twice the tensor time
    slow = am.kernel_bound(am.replace(lau, tensor_rate=1.0), k, H100)
    assert slow["terms_s"]["tensor"] == pytest.approx(2 * want, rel=1e-12)


def test_redo_rate_raises_the_bound_monotonically(snapshot):
    for d in (64, 128, 256):
        s = am.Shape(4, 2048 // d, 4096, d, False)
        ts = [am.predict("sm_90a", "fwd", s, snapshot, fp8=True, redo=p).time_s for p in (0.0, 0.25, 0.5, 0.75, 1.0)]
        assert ts == sorted(ts), (d, ts)
        # d256: shared memory binds at every p (its issue at p = 1, 360 + 135, stays below it)
        assert ts[-1] > ts[0] if d < 256 else ts[-1] == ts[0], d
    # d128: the issue term binds at any p (524 + 71 p instructions a warp a tile); MUFU (64 + 2 p exp2, as many
    # clocks as the FP8 tensor term at p = 0) no longer grows with the rate
    s = am.Shape(1, 16, 16384, 128, False)
    a, b = (am.predict("sm_90a", "fwd", s, snapshot, fp8=True, redo=p) for p in (0.2, 0.6))
    assert a.binding == b.binding == "issue"
    per = lambda p: 128 * 8 * (524 + p * 71) + 12 * 559  # noqa: E731 - a warp's instructions, all its tiles
    assert b.time_s / a.time_s == pytest.approx(per(0.6) / per(0.2), rel=1e-3)


def test_fp8_rows_from_the_fp8_kernel_names(snapshot):
    doc = am.fp8_table_rows(sass=snapshot)
    preds = doc["predictions"]
    assert len(preds) == (3 + 2) * 3 * 2 and not doc["skipped"]  # the d64 and d128 softcap rows last
    for p in preds:
        d, n = p["shape"]["head_dim"], p["shape"]["seq"]
        cap = "_softcap" if p["kind"] == "softcap" else ""
        assert p["kind"] == ("softcap" if preds.index(p) >= 18 else "")
        assert [i["kernel"] for i in p["inputs"]] == [f"attention_fwd_sm90_d{d}{cap}_fp8"]
        assert p["dtype"] == "e4m3" and p["redo"] == am.fp8_redo_rate(n) and p["variant"] == "wgmma"
        assert p["binding"] in ("issue", "smem", "tensor", "mufu", "fma", "hbm")
        # no faster than the FP8 pipe: at most the dense e4m3 peak
        assert 0 < p["pct_peak"] < 100 and p["tflops"] < 2 * H100.peak / 1e12
        assert p["tflops"] == pytest.approx(am.useful_flops(am.Shape(**p["shape"]), "fwd") / p["time_s"] / 1e12)
    by = {(p["shape"]["head_dim"], p["kind"], p["shape"]["causal"], p["shape"]["seq"]): p for p in preds}
    assert by[(128, "", False, 16384)]["binding"] == "issue" and by[(64, "", False, 16384)]["binding"] == "issue"
    assert by[(64, "softcap", False, 16384)]["binding"] == "mufu"  # a tanh and 3 / 4 of the exp2s a score
    assert by[(128, "softcap", False, 16384)]["binding"] == "mufu"
    text = am.format_fp8_table(doc)
    assert "Modelled bound" in text and "redo" in text and "e4m3" in text
    json.dumps(doc)
    # the bf16 rows are untouched by it: predict without fp8 asks for the bf16 kernel
    with pytest.raises(ArgumentError, match="kernel"):
        am.predict("sm_90a", "fwd", am.Shape(1, 16, 1024, 128, False), snapshot)


def test_bench_cli_prints_the_fp8_table(snapshot, monkeypatch, capsys):
    from pykern.bench import cli

    real = am.fp8_table_rows
    monkeypatch.setattr(am, "fp8_table_rows", lambda: real(shapes=[am.Shape(1, 16, 16384, 128, False)], sass=snapshot))
    assert cli.main(["--attention-model", "--fp8"]) == cli.EXIT_OK
    out = capsys.readouterr().out
    assert "FP8 (e4m3)" in out and "mufu" in out and " 0.29 " in out
    assert cli.main(["--attention-model", "--fp8", "--json"]) == cli.EXIT_OK
    doc = json.loads(capsys.readouterr().out)
    assert doc["model"] == "attention-fp8" and len(doc["predictions"]) == 1


def test_real_fp8_kernels_sass_inputs():
    """Today's FP8 kernels (compile cache + cuobjdump; skipped where they are not here): the loop's QGMMAs match
    the launch geometry, the rescale block is found, and the inputs FP8_SASS pins are today's."""
    pytest.importorskip("numpy")
    src = am.SassSource()
    try:
        src.inputs("attention_fwd_sm90_d128_fp8", "sm_90a")
    except Exception as e:  # no cuobjdump / NVRTC here
        pytest.skip(f"SASS unavailable: {type(e).__name__}: {e}")
    for d in FP8_SASS:
        (lau,), why = am.fp8_launch(am.Shape(1, 2, 256, d, False), list(src.kernels()))
        k = src.inputs(lau.kernel, "sm_90a")
        assert k.loop.mma * lau.loop_warps * am.MMA_FLOP == 2 * lau.pair_dims * lau.step[0] * lau.step[1]
        assert k.loop.loop == "flat" and k.loop.wgmma and k.spills == 0
        # every score's exp2 on MUFU in the kernels without softcap (FA90F8_FEX 0), once: the rate-p block is the
        # rescale of O and l (one exp2 a row of the thread, an FMUL an O register: D / 2 + 2 of the block's FP32 ops)
        assert k.loop.mufu * 32 * lau.loop_warps == lau.step[0] * lau.step[1] and k.loop.exp2_fma == 0
        assert k.loop.redo_mufu == 2 and k.loop.redo_fma >= d // 2 + 2
        got = (k.loop.insns, k.loop.mma, k.loop.smem_bytes, k.loop.mufu, k.loop.fma, k.loop.redo_insns,
               k.loop.redo_mufu, k.loop.redo_fma, k.loop.straight)
        assert got == FP8_SASS[d], (d, got)
    # the softcap kernels: a tanh a score on MUFU, and of their exp2s a quarter on the FMA pipe (one FADD.RM each)
    for d in FP8_SASS_SOFTCAP:
        (lau,), why = am.fp8_launch(am.Shape(1, 2, 256, d, False), list(src.kernels()), softcap=True)
        assert lau.kernel == f"attention_fwd_sm90_d{d}_softcap_fp8", why
        k = src.inputs(lau.kernel, "sm_90a")
        scores = lau.step[0] * lau.step[1] // (32 * lau.loop_warps)  # a warp's scores a tile, over its 32 lanes
        assert k.loop.exp2_fma == scores // 4 and k.loop.mufu == scores + scores - scores // 4
        got = (k.loop.insns, k.loop.mma, k.loop.smem_bytes, k.loop.mufu, k.loop.fma, k.loop.redo_insns,
               k.loop.redo_mufu, k.loop.redo_fma, k.loop.straight)
        assert got == FP8_SASS_SOFTCAP[d], (d, got)


@pytest.mark.parametrize("d", sorted(FP8_SASS_SOFTCAP))
def test_softcap_moves_a_quarter_of_its_exp2s_off_the_binding_mufu(d, snapshot):
    """The d64 / d128 softcap kernels' MUFU term (a tanh and an exp2 a score: 128 a thread a tile) bound them; with
    a quarter of the exp2s on the FMA pipe (16 fewer MUFU, about 129 more instructions) MUFU still binds, 112 / 128
    of the all-MUFU term, above the issue term it raised: the FA90F8_FEX choice, as modelled bounds."""
    s = am.Shape(1, 2048 // d, 16384, d, False)
    p = am.predict("sm_90a", "fwd", s, snapshot, softcap=True, fp8=True)
    assert p.kind == "softcap" and p.binding == "mufu"
    assert p.inputs[0]["kernel"] == f"attention_fwd_sm90_d{d}_softcap_fp8"
    t = p.kernels[0]["terms_s"]
    assert t["issue"] < t["mufu"]
    all_mufu = t["mufu"] * (128 + 2 * p.redo) / (112 + 2 * p.redo)  # every exp2 back on MUFU
    dense = am.predict("sm_90a", "fwd", s, snapshot, fp8=True)  # the kernel without softcap: issue binds
    assert dense.binding == "issue" and all_mufu > p.time_s > dense.time_s


def test_the_docs_fp8_table_is_the_models_output(snapshot):
    """docs/attention_sm90.md's FP8 table (FP8 forward, modelled bound) is what the model prints on FP8_SASS."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "attention_sm90.md").read_text()
    start = text.index("Modelled bound (**not a measurement**; `python -m pykern.bench --attention-model --fp8`")
    sec = text[start:text.index("Against the goal of 1100 TFLOP/s", start)]
    rows = [line.split("|")[1:-1] for line in sec.splitlines()
            if line.startswith("| ") and line.split("|")[1].strip().isdigit()]
    doc = am.fp8_table_rows(sass=snapshot)
    by = {(p["shape"]["head_dim"], p["kind"] == "softcap", p["shape"]["causal"], p["shape"]["seq"]): p
          for p in doc["predictions"]}
    assert len(rows) == len(by) == 30
    for r in rows:
        d, softcap, causal, seq, _bh, p, ms, tflops, pct, binding = (c.strip() for c in r)
        pr = by[(int(d), softcap == "True", causal == "True", int(seq))]
        assert (float(p), float(ms), int(tflops), float(pct)) == \
            (round(pr["redo"], 2), round(pr["time_s"] * 1e3, 3), round(pr["tflops"]), round(pr["pct_peak"], 1)), r
        assert binding.split(" = ")[0] == pr["binding"], r
