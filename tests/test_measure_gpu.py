"""tools/measure_gpu.py without a GPU: the summary of the committed H200 figures, the exit status where there
is no GPU, the attention plan (--list: shapes, order, FLOPs, modelled seconds), the summary of rows with a dtype and
a v head dim, the rows written as they are measured, and the attention loop itself on CPU tensors with the GPU-only
parts (CUDA-event timing, pykern's kernels) stood in for. (The measurements themselves only run on a GPU:
docs/measured/.)"""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "docs" / "measured" / "2026-11-27-h200"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "tools" / "measure_gpu.py"), *args], capture_output=True,
                          text=True, cwd=ROOT, timeout=120)


def test_summary_of_the_h200_run_matches_the_report():
    r = _run("summary", *(str(DATA / f) for f in ("ceilings.json", "attention.json", "decode.json", "model.json")))
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert '"name": "NVIDIA H200"' in out and '"GBps_read_plus_write": 4258.04' in out
    # the rows docs/measured/2026-11-27-h200.md quotes
    # old rows (no "dtype", no "dv") read as bf16 with dv = d
    assert any(line.startswith("bf16 d128     causal  16384    540| 373") for line in out.splitlines())
    assert any(line.startswith("bf16  g4 b8    32768     277.0us    3877") for line in out.splitlines())
    assert out.count("\nbf16  g") == 33 and out.count("\ne4m3  g") == 33


@pytest.mark.parametrize("what", ["ceilings", "decode-graph"])
def test_no_gpu_exits_3_saying_why(what):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    r = _run(what)
    assert r.returncode == 3 and "needs a CUDA GPU" in r.stderr


def _mg():
    spec = importlib.util.spec_from_file_location("measure_gpu_under_test", ROOT / "tools" / "measure_gpu.py")
    mg = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mg)
    return mg


WANTED = ("--dtypes", "bf16", "f16", "--dims", "128", "64", "256", "192/128", "--extra-dims", "96")


def _list(*args: str) -> list[list[str]]:
    r = _run("attention", "--list", *args)
    assert r.returncode == 0, r.stderr
    return [line.split() for line in r.stdout.splitlines()[1:-1]]


def test_list_orders_the_most_wanted_rows_first():
    rows = _list(*WANTED)
    assert len(rows) == 2 * 4 * 2 * 3 + 2 * 3  # 2 dtypes x 4 dims x causal / not x 3 seqs, then d96's bf16 set
    key = [(r[1], r[2], r[3], int(r[4])) for r in rows]
    long = [k for k in key if k[3] >= 4096]
    # bf16 d128, d64, d256 at 4k and 16k, then 192 / 128, then f16 in the same order, then the 1k rows, d96 last
    assert [k[:2] for k in long[:16:4]] == [("bf16", "d128"), ("bf16", "d64"), ("bf16", "d256"), ("bf16", "d192/128")]
    assert [k[:2] for k in long[16:32:4]] == [("f16", "d128"), ("f16", "d64"), ("f16", "d256"), ("f16", "d192/128")]
    assert key.index(("bf16", "d128", "full", 1024)) == 32 and key[:32] == long[:32]
    assert [k[1] for k in key[-6:]] == ["d96"] * 6 and {k[0] for k in key[-6:]} == {"bf16"}
    # batch = 16384 / seq, heads = 2048 // d (q's head dim), cumulative seconds rising
    for r in rows:
        d = int(r[2][1:].split("/")[0])
        assert int(r[5]) == 16384 // int(r[4]) and int(r[6]) == 2048 // d
    cum = [float(r[-1]) for r in rows]
    assert cum == sorted(cum) and cum[0] > 0
    # bf16 rows time every implementation, f16 and d96 rows pykern and the peers
    assert {r[7] for r in rows if r[1] == "bf16" and r[2] != "d96"} == {"9"}
    assert {r[7] for r in rows if r[1] == "f16" or r[2] == "d96"} == {"5"}


def test_d256_is_an_alias_and_defaults_are_the_old_plan():
    old = _list("--d256")
    assert _list("--dims", "64", "128", "256") == old
    assert {(r[1], r[2]) for r in old} == {("bf16", "d64"), ("bf16", "d128"), ("bf16", "d256")} and len(old) == 18
    assert {(r[2], int(r[4])) for r in _list()} == {(d, n) for d in ("d64", "d128") for n in (1024, 4096, 16384)}
    assert {int(r[4]) for r in _list("--quick")} == {1024, 4096}
    bad = _run("attention", "--list", "--dims", "192/x")
    assert bad.returncode == 2 and "192/128" in bad.stderr


def test_plan_rows_carry_dtype_dv_and_flops():
    mg = _mg()
    plan = mg.attention_plan(("bf16", "f16"), [(128, 128), (192, 128)], [(96, 96)], (4096,))
    rows = [p["row"] for p in plan]
    dsv3 = next(r for r in rows if r["d"] == 192 and r["dtype"] == "f16" and r["causal"])
    assert dsv3["dv"] == 128 and dsv3["heads"] == 10 and dsv3["batch"] == 4
    # forward 2 * seq^2 * heads * batch * (d + dv), halved when causal; backward 2.5x
    assert dsv3["fwd_flop"] == 2 * 4096 ** 2 * 10 * 4 * (192 + 128) / 2 and dsv3["bwd_flop"] == 2.5 * dsv3["fwd_flop"]
    d128 = next(r for r in rows if r["d"] == 128 and r["dtype"] == "bf16" and not r["causal"])
    assert "dv" not in d128 and d128["fwd_flop"] == 4 * 4096 ** 2 * 128 * 16 * 4  # FA2's count where dv = d
    assert [r["d"] for r in rows if r["d"] == 96] == [96, 96] and {r["dtype"] for r in rows if r["d"] == 96} == {"bf16"}
    assert {p["impls"] for p in plan if p["row"]["dtype"] == "f16"} == {mg.ATTN_PRIMARY}
    assert "pykern_mma_sync" not in mg.ATTN_PRIMARY and "fa4" in mg.ATTN_PRIMARY and "sdpa_cudnn" in mg.ATTN_PRIMARY
    # FA4's compile is counted once a (dtype, d, dv, causal): the 16k row after the 4k one does not pay it again
    est = mg.attention_estimate(mg.attention_plan(("bf16",), [(128, 128)], [], (4096, 16384)), 10)
    compile_s = sum(mg.EST_FA4_COMPILE_S.values())
    assert est[0] > compile_s and est[1] < compile_s


def test_forward_only_plan_drops_the_backward_and_its_compiles():
    mg = _mg()
    both = mg.attention_plan(("bf16", "f16"), [(128, 128), (192, 128)], [], (4096, 16384))
    fwd = mg.attention_plan(("bf16", "f16"), [(128, 128), (192, 128)], [], (4096, 16384), fwd_only=True)
    assert [p["row"] for p in fwd] == [p["row"] for p in both]  # the same rows, in the same order
    assert all(p["bwd"] for p in both) and not any(p["bwd"] for p in fwd)
    # the deterministic backward's forward is pykern's: not timed twice
    assert all("pykern_deterministic" not in p["impls"] for p in fwd)
    assert any("pykern_deterministic" in p["impls"] for p in both)
    e_both, e_fwd = mg.attention_estimate(both, 10), mg.attention_estimate(fwd, 10)
    # the first bf16 row pays FA4's forward compile alone, no backward one, and no backward calls
    assert e_fwd[0] > mg.EST_FA4_COMPILE_S["fwd"] and e_both[0] - e_fwd[0] > mg.EST_FA4_COMPILE_S["bwd"]
    assert all(f < b for f, b in zip(e_fwd, e_both))


def _row(dtype=None, d=128, dv=None, causal=True, seq=4096, **entries):
    r = {"what": "attention", "d": d, "causal": causal, "seq": seq, "batch": 4, "heads": 16, "fwd_flop": 1.0,
         "bwd_flop": 2.5}
    if dtype:
        r["dtype"] = dtype
    if dv:
        r["dv"] = dv
    for name, (fwd, fb) in entries.items():
        r[name] = {"error": "RuntimeError: no"} if fwd is None else {
            "fwd_tflops": fwd, "rel_err_vs_first": 1e-3, "host_us": 50.0,
            **({"fwdbwd_tflops": fb} if fb is not None else {})}
    return r


def test_summary_prints_dtype_dv_and_the_ratio_to_the_best_peer(tmp_path):
    rows = [_row("f16", 192, 128, pykern=(600, 400), sdpa_flash=(None, None), sdpa_cudnn=(500, 420), fa4=(640, 380),
                 flashinfer=(700, None)),
            _row(pykern=(300, 200), sdpa_cudnn=(None, None)),  # an old row: bf16, dv = d; no peer ran
            _row("bf16", 64, pykern=(None, None), fa4=(500, 300))]
    f = tmp_path / "attention.json"
    f.write_text(json.dumps(rows))
    r = _run("summary", str(f))
    assert r.returncode == 0, r.stderr
    lines = [line for line in r.stdout.splitlines() if line.startswith(("f16 ", "bf16 "))]
    assert len(lines) == 3
    assert lines[0].startswith("f16  d192/128 causal   4096    600| 400")
    # forward: FlashInfer's 700 is the best peer; forward + backward: cuDNN's 420 (FlashInfer has no backward)
    assert lines[0].endswith("fwd 0.86x flashinfer | fwdbwd 0.95x sdpa_cudnn")
    assert lines[1].startswith("bf16 d128     causal   4096    300| 200") and lines[1].endswith("fwd - | fwdbwd -")
    assert lines[2].startswith("bf16 d64      causal") and " ERR" in lines[2] and lines[2].endswith("fwd - | fwdbwd -")
    assert "sdpa_flash, sdpa_cudnn, fa4, flashinfer" in r.stdout


def test_rows_reach_the_json_file_as_they_are_logged(tmp_path):
    mg = _mg()
    out = tmp_path / "attention.json"
    mg.JSON_OUT = str(out)
    mg.log({"what": "attention", "d": 64})
    assert json.loads(out.read_text()) == [{"what": "attention", "d": 64}]
    mg.log({"what": "attention", "d": 128})  # a kill after this row still leaves both
    assert [r["d"] for r in json.loads(out.read_text())] == [64, 128]
    assert not (tmp_path / "attention.json.tmp").exists()


def test_attention_model_reads_bf16_rows_with_their_v_head_dim(tmp_path):
    from pykern.bench import attention_model as am

    rows = [_row("f16", pykern=(500, 300)), _row("bf16", 192, 128, pykern=(500, 300)), _row(d=64, pykern=(500, 300))]
    for r in rows:
        r["pykern"].update(fwd_us=1000.0, fwdbwd_us=3000.0)
    f = tmp_path / "attention.json"
    f.write_text(json.dumps(rows))
    pts = am.measured_points(f)
    shapes = {(p["shape"].head_dim, p["shape"].head_dim_v) for p in pts}
    assert shapes == {(192, 128), (64, None)}  # the f16 row is no point of the bf16 model
    assert {p["phase"] for p in pts} == {"fwd", "bwd"}


class _CpuTorch:
    """torch with tensors made on the CPU whatever device is asked for."""

    def __init__(self, torch):
        self._t = torch

    def __getattr__(self, name):
        return getattr(self._t, name)

    def randn(self, *shape, device=None, **kw):
        return self._t.randn(*shape, **kw)


def test_attention_loop_writes_rows_with_dtype_dv_and_errors(tmp_path, monkeypatch):
    """The measuring loop on the CPU, small shapes: CUDA-event timing stood in for by a fixed time, pykern's
    flash_attention by torch's math (the GPU run times the real one). Each row carries dtype, dv where it differs,
    its reference, an entry per implementation (numbers, or the error that stopped it)."""
    import torch

    import pykern.torch as ptorch

    mg = _mg()
    monkeypatch.setattr(mg, "torch", _CpuTorch(torch))
    monkeypatch.setattr(mg, "timed", lambda fn, reps, flush=None, warmup=3: (fn(), 1e-3)[1])
    monkeypatch.setattr(mg, "host_overhead", lambda fn, n=50: 2e-5)

    def math_attention(q, k, v, causal=False):
        o = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2).float(), k.transpose(1, 2).float(), v.transpose(1, 2).float(), is_causal=causal)
        return o.transpose(1, 2).to(torch.bfloat16 if q.dtype == torch.float8_e4m3fn else q.dtype)
    monkeypatch.setattr(ptorch, "flash_attention", math_attention)
    plan = mg.attention_plan(("bf16", "f16"), [(64, 64), (96, 64)], [], (64,))
    for p in plan:
        p["row"].update(batch=1, heads=2)
    monkeypatch.setattr(mg, "attention_plan", lambda *a, **kw: plan)
    monkeypatch.setattr(mg, "peer", lambda module: None)  # the peers are not here: their entries are left out
    out = tmp_path / "attention.json"
    mg.JSON_OUT = str(out)  # as main sets it for --json
    mg.attention(mg.argparse.Namespace(quick=True, dims=None, d256=False, dtypes=None, extra_dims=None, seqs=None))
    rows = [r for r in json.loads(out.read_text()) if r["what"] == "attention"]
    assert [(r["dtype"], r["d"], r.get("dv"), r["causal"]) for r in rows] == [
        (dt, d, dv, c) for dt in ("bf16", "f16") for d, dv in ((64, None), (96, 64)) for c in (False, True)]
    for r in rows:
        names = set(mg.ATTN_FULL if r["dtype"] == "bf16" else mg.ATTN_PRIMARY) - {"flashinfer", "fa4"}
        assert names <= set(r) and not {"flashinfer", "fa4"} & set(r), (r["dtype"], sorted(r))
        mine = r["pykern"]
        assert mine["fwd_us"] == 1000.0 and mine["fwd_tflops"] == r["fwd_flop"] / 1e-3 / 1e12
        assert mine["fwdbwd_us"] == 1000.0 and mine["rel_err_vs_first"] < 1e-2
        assert r["ref"] in names and "fwd_us" in r[r["ref"]]
        assert "error" in r["sdpa_cudnn"]  # no cuDNN on the CPU: the entry says why, the row goes on
        # SDPA's flash backend refuses v's head dim unlike q's (as on the GPU): pykern is then the reference
        assert ("error" in r["sdpa_flash"]) == ("dv" in r) and r["ref"] == ("pykern" if "dv" in r else "sdpa_flash")
    assert {r["pykern_fp8"]["rel_err_vs_first"] < 0.1 for r in rows if r["dtype"] == "bf16"} == {True}
