"""`python -m pykern.bench` without a GPU: the op table against pykern.ops, rates and % of peak from a fake
device's attributes and the fake driver's virtual clock, the --json schema, peers that do not import, the
no-GPU exit; and, on the CPU with tiny shapes, that each torch eager expression computes what the pykern op does."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from fake_driver import H100_SXM_ATTRIBUTES, FakeDriver
from pykern import bench
from pykern.bench import bytes_model as bm
from pykern.bench import cli, suite
from pykern.bench.runner import Impl
from pykern.errors import BackendUnavailable
from pykern.tolerance import tolerance

# pykern.ops exports (helpers included) that are compute-bound or not kernels, with the reason in suite.EXEMPT
EXPECTED_EXEMPT = {
    "flash_attention", "flash_attention_varlen", "paged_prefill_attention", "attention_backward",
    "flash_attention_varlen_backward",
    "fused_linear_cross_entropy", "decode_attention", "batched_decode_attention", "paged_decode_attention",
    "append_paged_kv_cache", "PagedDecodePlan", "attn_tiling", "decode_plan", "get_batch_indices_positions",
    "shared_prefix_decode", "MLAPagedDecodePlan", "chain_speculative_sampling", "gemm_fp8", "grouped_gemm_fp8",
    "fp8_quantize", "grouped_gemm_wgrad_tc",
    "sampling_from_probs", "top_k_sampling_from_probs", "top_p_sampling_from_probs", "min_p_sampling_from_probs",
    "top_k_top_p_sampling_from_probs", "top_k_renorm_probs", "top_p_renorm_probs", "top_k_mask_logits",
    "sampling_from_logits", "top_k_top_p_sampling_from_logits", "softmax",
    "grouped_gemm", "moe_experts", "moe_experts_backward", "moe_route", "moe_align",
}


def test_every_memory_bound_op_has_a_row():
    import pykern.ops

    exported = set(dir(pykern.ops))
    covered = {op for c in suite.CASES for op in c.ops}
    assert set(suite.EXEMPT) == EXPECTED_EXEMPT  # a new exemption is a reviewed change to this list
    missing = exported - covered - set(suite.EXEMPT)
    assert not missing, f"pykern.ops exports {sorted(missing)} with no row in pykern.bench.suite.CASES (or EXEMPT)"
    assert not covered - exported, "a row times an op pykern.ops does not export"
    assert not covered & set(suite.EXEMPT)
    names = [c.name for c in suite.CASES]
    assert len(names) == len(set(names))
    for name in ("rms_norm", "rms_norm_backward", "add_rms_norm", "layer_norm", "layer_norm_backward", "silu_gate",
                 "silu_gate_backward", "gelu_gate", "gelu_gate_backward", "rope", "rope_inverse", "rope_qk",
                 "qk_norm_rope", "qk_norm_rope_backward", "embedding",
                 "embedding_backward", "softmax_backward", "causal_attn_softmax", "transpose_2d",
                 "cross_entropy_fwd_bwd"):
        assert name in names
        assert hasattr(suite.Context, "_" + name)  # every row has a builder
    assert all(hasattr(suite.Context, "_" + n) for n in names)


def test_min_bytes_follow_the_bytes_model_at_full_shapes():
    d = suite.FULL
    for case in suite.CASES:
        for dt in case.dtypes:
            e = 2 if dt == "bf16" else 4
            if case.model and case.name != "rms_norm_backward":  # the model counts the fp32 inv_rms as input
                row = next(r for r in bm.rows("all", e) if r.op == case.model)
                assert case.min_bytes(d, e) == row.min_bytes, (case.name, dt)
                assert suite.model_hbm_bytes(case, dt, d) == row.hbm_bytes
    assert suite.model_hbm_bytes(suite.CASES[0], "bf16", suite.QUICK) is None  # model shapes only
    by = {c.name: c for c in suite.CASES}
    t, h, f, v = d["T"], d["H"], d["F"], d["V"]
    assert by["add_rms_norm"].min_bytes(d, 2) == 4 * t * h * 2 + h * 2
    assert by["layer_norm_backward"].min_bytes(d, 4) == 3 * t * h * 4 + 3 * h * 4
    assert by["gelu_gate_backward"].min_bytes(d, 2) == 5 * t * f * 2
    assert by["embedding_backward"].min_bytes(d, 2) == t * h * 2 + t * 8 + v * h * 4
    assert by["rms_norm_backward"].min_bytes(d, 2) == 3 * t * h * 2 + 2 * h * 2
    assert suite.select(["causal*"], ("bf16",)) == []  # f32 only
    assert [(c.name, dt) for c, dt in suite.select(["rope*", "transpose_2d"], ("bf16",))] == [
        ("rope", "bf16"), ("rope_qk", "bf16"), ("rope_inverse", "bf16"), ("transpose_2d", "bf16")]


def _h100() -> FakeDriver:
    fake = FakeDriver(cc=(9, 0), attributes=dict(H100_SXM_ATTRIBUTES), max_shared_optin=227 * 1024)
    fake.name = "Fake H100"
    return fake


def _clock_builder(fake: FakeDriver, ms: dict[str, float], fail: str = "") -> suite.Builder:
    """Implementations that advance the fake's virtual clock by ms[impl]; `fail` names an op whose pykern call raises."""
    def build(case: suite.Case, dtype: str, dims: dict) -> list[Impl]:
        def takes(t: float):
            def go():
                fake.clock_ms += t
            return go

        def boom():
            raise RuntimeError("CUDA_ERROR_ILLEGAL_ADDRESS")

        impls = [Impl("pykern", boom if case.name == fail else takes(ms["pykern"])), Impl("torch", takes(ms["torch"]))]
        impls.append(Impl("liger", None, "liger_kernel.ops.rms_norm not importable (ModuleNotFoundError)"))
        return impls
    return build


def test_rates_and_percent_of_peak_from_the_fake_device(capsys):
    fake = _h100()
    rc = cli.main(["--ops", "silu_gate", "--dtype", "bf16", "--repeats", "4", "--json"], driver_factory=lambda: fake,
                  build=_clock_builder(fake, {"pykern": 0.25, "torch": 0.5}), stream=7)
    assert rc == cli.EXIT_OK
    doc = json.loads(capsys.readouterr().out)
    peak = 2_619_000 * 1e3 * 5120 * 2 / 8  # MEMORY_CLOCK_RATE (kHz) x bus width (bits) x DDR / 8
    assert doc["peaks"]["bandwidth"] == peak
    rows = {r["impl"]: r for r in doc["rows"]}
    nbytes = 3 * 8192 * 14336 * 2
    p = rows["pykern"]
    assert p["min_bytes"] == nbytes and p["median_us"] == pytest.approx(250.0) and p["unit"] == "GB/s"
    assert p["rate"] == pytest.approx(nbytes / 0.25e-3 / 1e9) == pytest.approx(2818.57, rel=1e-5)
    assert p["pct_peak"] == pytest.approx(100 * nbytes / 0.25e-3 / peak) == pytest.approx(84.09, rel=1e-3)
    assert rows["torch"]["pct_peak"] == pytest.approx(42.05, rel=1e-3) and rows["torch"]["vs_pykern"] == pytest.approx(2.0)
    assert p["model_hbm_bytes"] == nbytes and rows["torch"]["model_hbm_bytes"] is None
    assert rows["liger"]["status"] == "skipped" and "not importable" in rows["liger"]["message"]
    # the timer recorded its events on the stream it was given
    assert all(c[1][1] == 7 for c in fake.calls if c[0] == "event_record")


def test_json_schema_and_a_failing_pykern_row(capsys):
    fake = _h100()
    rc = cli.main(["--ops", "rms_norm*,transpose_2d", "--quick", "--json"], driver_factory=lambda: fake,
                  build=_clock_builder(fake, {"pykern": 0.1, "torch": 0.2}, fail="transpose_2d"))
    assert rc == cli.EXIT_FAILED
    doc = json.loads(capsys.readouterr().out)
    assert set(doc) == {"version", "tool", "status", "exit_code", "device", "peaks", "options", "seconds", "rows"}
    assert doc["version"] == 1 and doc["tool"] == "pykern.bench" and doc["status"] == "FAIL" and doc["exit_code"] == 1
    assert doc["device"]["name"] == "Fake H100" and doc["device"]["arch"] == "sm_90" and doc["device"]["sms"] == 132
    assert doc["options"]["repeats"] == 5 and doc["options"]["dims"] == suite.QUICK
    keys = {"op", "shape", "dtype", "impl", "kind", "min_bytes", "median_us", "min_us", "rate", "unit", "pct_peak",
            "status", "message", "vs_pykern", "model_hbm_bytes"}
    assert all(set(r) == keys for r in doc["rows"])
    ops = [(r["op"], r["dtype"]) for r in doc["rows"] if r["impl"] == "pykern"]
    assert ops == [("rms_norm", "bf16"), ("rms_norm", "f32"), ("rms_norm_backward", "bf16"),
                   ("rms_norm_backward", "f32"), ("transpose_2d", "bf16"), ("transpose_2d", "f32")]
    tr = next(r for r in doc["rows"] if r["op"] == "transpose_2d" and r["impl"] == "pykern")
    assert tr["status"] == "error" and "CUDA_ERROR_ILLEGAL_ADDRESS" in tr["message"] and tr["rate"] is None
    d = suite.QUICK
    rn = next(r for r in doc["rows"] if r["op"] == "rms_norm" and r["dtype"] == "f32" and r["impl"] == "pykern")
    assert rn["shape"] == f"{d['T']}x{d['H']}" and rn["min_bytes"] == (2 * d["T"] * d["H"] + d["H"]) * 4
    assert rn["model_hbm_bytes"] is None  # quick shapes are not the model's


def test_table_output(capsys):
    fake = _h100()
    assert cli.main(["--ops", "embedding", "--dtype", "f32", "--repeats", "2"], driver_factory=lambda: fake,
                    build=_clock_builder(fake, {"pykern": 0.2, "torch": 0.3})) == 0
    out = capsys.readouterr().out
    assert "pykern.bench on Fake H100 (sm_90): peak DRAM bandwidth 3352 GB/s" in out
    line = next(x for x in out.splitlines() if x.startswith("embedding") and " pykern " in x)
    nbytes = 8192 * 8 + 2 * 8192 * 4096 * 4
    assert f"{nbytes / 0.2e-3 / 1e9:.0f}" in line and "200.0" in line and line.rstrip().endswith("ok")
    assert "skipped: liger_kernel.ops.rms_norm not importable" in out


def test_no_gpu_exit_code(capsys):
    def no_driver():
        raise BackendUnavailable("nvrtc backend: no CUDA driver")

    assert cli.main(["--json"], driver_factory=no_driver) == cli.EXIT_NO_GPU == 3
    cap = capsys.readouterr()
    assert json.loads(cap.out)["status"] == "NO GPU" and "needs a CUDA GPU" in cap.err
    assert cli.main([], driver_factory=lambda: FakeDriver(devices=0)) == 3
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_no_gpu_torch_without_cuda_and_usage_errors(capsys, monkeypatch):
    from pykern.bench import runner

    monkeypatch.setattr(cli, "torch_status", lambda: (False, "torch 2.x sees no CUDA device"))
    assert cli.main([], driver_factory=_h100) == cli.EXIT_NO_GPU
    assert "sees no CUDA device" in capsys.readouterr().err
    assert runner.torch_status()[0] is False  # the real check, on this CPU-only machine
    assert cli.main(["--ops", "no_such_op*"]) == cli.EXIT_USAGE
    assert cli.main(["--repeats", "0"]) == cli.EXIT_USAGE
    assert cli.main(["--warmup", "-1"]) == cli.EXIT_USAGE


def test_help_and_the_real_no_gpu_path():
    env_cmd = [sys.executable, "-m", "pykern.bench"]
    h = subprocess.run(env_cmd + ["--help"], capture_output=True, text=True, check=True).stdout
    flat = " ".join(h.split())
    for opt in ("--ops", "--dtype", "--repeats", "--quick", "--json", "--list"):
        assert opt in flat
    assert "3 needs a CUDA GPU" in flat and "MINIMUM bytes" in flat
    assert "is read (summed) before it" in flat and "zeroed" not in flat  # the flush reads, as l2_flush does
    assert "GPU sleep of about 1 ms (torch.cuda._sleep)" in flat
    assert all(c.name in flat for c in suite.CASES)
    p = subprocess.run(env_cmd + ["--ops", "rms_norm", "--json"], capture_output=True, text=True)
    assert p.returncode == 3 and json.loads(p.stdout)["status"] == "NO GPU"  # this machine has no GPU
    lst = subprocess.run(env_cmd + ["--list", "--quick"], capture_output=True, text=True, check=True).stdout
    assert len(lst.splitlines()) == len(suite.select()) and "causal_attn_softmax" in lst


def test_help_counts_the_calibrated_models_constants_from_fitted():
    """The --compare / --fit help states how many constants the calibrated model has, and how many a refit moves,
    as attention_model.FITTED and HELD hold them (seven, call_us held: six refitted), never a count written by hand."""
    from pykern.bench import attention_model as am

    flat = " ".join(cli._parser().format_help().split())
    names = list(am.FITTED.to_dict())
    assert len(names) == 7 and am.HELD == ("call_us",)
    assert "the bound plus seven constants for what does not overlap" in flat
    assert "refits six of them to JSON's pykern rows" in flat and "held at FITTED's value: call_us" in flat
    assert "refit six of the calibrated model's seven constants (held: call_us)" in flat
    assert ", ".join(names) in flat
    assert "six constants" not in flat


def test_peers_not_importable_are_skipped_and_a_broken_peer_is_an_error_row(monkeypatch):
    pytest.importorskip("torch")
    ctx = suite.Context("cpu", backend="host")
    d = dict(T=4, H=64, F=64, NH=2, KH=1, D=16, V=96, S=8, SH=2)
    by = {c.name: c for c in suite.CASES}
    impls = {i.name: i for i in ctx(by["rms_norm"], "f32", d)}
    for peer, mod in (("liger", "liger_kernel"), ("flashinfer", "flashinfer"), ("quack", "quack")):
        if suite.optional(mod)[0] is None:  # not installed here
            assert impls[peer].fn is None and "not importable" in impls[peer].skip
    # a peer that imports but lacks the function, and one whose call raises
    fake_mod = type(sys)("fakepeer")
    fake_mod.norm = type(sys)("fakepeer.norm")
    fake_mod.norm.rmsnorm = lambda *a: (_ for _ in ()).throw(TypeError("unexpected keyword"))
    monkeypatch.setitem(sys.modules, "fakepeer", fake_mod)
    assert ctx.peer("x", "fakepeer", "norm.nope", lambda f: f).skip == "fakepeer has no norm.nope"
    broken = ctx.peer("x", "fakepeer", "norm.rmsnorm", lambda f: lambda: f(1))
    fake = _h100()
    fake.set_current(0xC0)
    from pykern.bench.runner import Workload, run_benchmarks

    rows = run_benchmarks([Workload("rms_norm", "4x64", "f32", "memory", 1.0, [broken])], bench.EventTimer(fake),
                          bench.device_peaks(H100_SXM_ATTRIBUTES), 1, 2, float("inf"))
    assert rows[0]["status"] == "error" and "unexpected keyword" in rows[0]["message"]


def _np(x):
    import torch

    if isinstance(x, torch.Tensor):
        return x.detach().float().numpy().astype(np.float64)
    return np.asarray(x, dtype=np.float64)


@pytest.mark.parametrize("name,dtype", [(c.name, dt) for c in suite.CASES for dt in c.dtypes])
def test_torch_eager_expression_matches_the_pykern_op(name, dtype):
    """Host backend vs the row's torch expression on tiny inputs: the table compares like with like."""
    pytest.importorskip("torch")
    case = next(c for c in suite.CASES if c.name == name)
    d = dict(T=4, H=64, F=64, NH=2, KH=1, D=16, V=96, S=8, SH=2)
    impls = {i.name: i for i in suite.Context("cpu", backend="host")(case, dtype, d)}
    got, want = impls["pykern"].fn(), impls["torch"].fn()
    if name == "cross_entropy_fwd_bwd":
        got, want = (got[1],), want  # (loss, grad) vs torch's (grad,)
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    assert len(got) == len(want)
    # torch's own rounding (f32, or bf16 intermediates) is far below the table's entry for the dtype
    atol, rtol = tolerance(case.ops[0], dtype)
    for g, w in zip(got, want):
        assert np.isfinite(_np(w)).all() and np.abs(_np(w)).max() > 0, name
        np.testing.assert_allclose(_np(g), _np(w), rtol=rtol, atol=atol, err_msg=name)


def test_gpucheck_times_the_same_table():
    """gpucheck's bench step draws its memory-bound rows from pykern.bench.suite (bf16), built one at a time;
    inputs that cannot be built (no CUDA here) are error rows, never an exception."""
    pytest.importorskip("torch")
    from pykern.gpucheck import benchmarks

    wl = list(benchmarks.torch_workloads(quick=True))
    names = [w.op for w in wl]
    assert names == [c.name for c, _ in suite.select((), ("bf16",))] + ["attention"]
    assert all(w.dtype == "bf16" for w in wl)
    first = wl[0].impls[0]
    with pytest.raises(RuntimeError, match="building the inputs failed"):
        first.fn()
    with pytest.raises(RuntimeError, match="building the attention inputs failed"):
        wl[-1].impls[0].fn()


def test_the_cli_modules_import_no_torch():
    code = ("import sys, pykern.bench.cli, pykern.bench.suite, pykern.bench.runner, pykern.bench.bytes_model; "
            "print(sorted(m for m in ('torch', 'numba', 'cuda.bindings.driver') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_l2_flush_runs_before_every_timed_call_and_is_not_timed(capsys):
    fake = _h100()
    sizes, calls = [], []

    def flush(nbytes):
        sizes.append(nbytes)

        def go():
            calls.append(1)
            fake.clock_ms += 100.0  # a slow flush must not leak into the op's time
        return go

    build = _clock_builder(fake, {"pykern": 0.25, "torch": 0.5})
    assert cli.main(["--ops", "gelu", "--dtype", "bf16", "--repeats", "4", "--warmup", "2", "--json"],
                    driver_factory=lambda: fake, build=build, flush=flush) == 0
    doc = json.loads(capsys.readouterr().out)
    assert sizes == [2 * 50 * 2**20] and doc["options"]["flush_l2_bytes"] == 2 * 50 * 2**20  # 2 x H100's L2
    assert len(calls) == 2 * 4  # pykern and torch, once per timed repeat (not per warm-up call)
    rows = {r["impl"]: r for r in doc["rows"]}
    assert rows["pykern"]["median_us"] == pytest.approx(250.0) and rows["torch"]["median_us"] == pytest.approx(500.0)
    calls.clear()
    assert cli.main(["--ops", "gelu", "--dtype", "bf16", "--no-flush-l2", "--json"], driver_factory=lambda: fake,
                    build=build, flush=flush) == 0
    assert calls == [] and json.loads(capsys.readouterr().out)["options"]["flush_l2_bytes"] == 0


def test_the_gpu_is_kept_busy_while_each_timed_call_is_enqueued(capsys):
    fake = _h100()
    sleeps = []

    def busy():
        sleeps.append(fake.clock_ms)
        fake.clock_ms += 1000.0  # a sleep must never land inside a call's events

    build = _clock_builder(fake, {"pykern": 0.25, "torch": 0.5})
    assert cli.main(["--ops", "gelu", "--dtype", "bf16", "--repeats", "3", "--warmup", "1", "--json"],
                    driver_factory=lambda: fake, build=build, flush=lambda n: (lambda: None), busy=busy) == 0
    doc = json.loads(capsys.readouterr().out)
    assert len(sleeps) == 2 * 3 and doc["options"]["busy_sleep_cycles"] == 2_000_000
    rows = {r["impl"]: r for r in doc["rows"]}
    assert rows["pykern"]["median_us"] == pytest.approx(250.0) and rows["torch"]["median_us"] == pytest.approx(500.0)
    assert cli.main(["--ops", "gelu", "--dtype", "bf16", "--repeats", "2"], driver_factory=lambda: fake, build=build,
                    flush=lambda n: (lambda: None)) == 0
    assert "GPU idle while each is enqueued" in capsys.readouterr().out  # the table says when it could not sleep


def test_gpucheck_bench_step_flushes_l2_too(tmp_path, monkeypatch):
    from pykern.gpucheck import benchmarks
    from pykern.gpucheck import cli as gcli

    fake = _h100()
    calls = []

    def takes(ms):
        def go():
            fake.clock_ms += ms
        return go

    def flush(nbytes, device):
        calls.append((nbytes, device))
        return takes(50.0)

    wl = [benchmarks.Workload("rms_norm", "8192x4096", "bf16", "memory", 1e9, [benchmarks.Impl("pykern", takes(1.0))])]
    monkeypatch.setattr(benchmarks, "torch_status", lambda: (True, ""))
    monkeypatch.setattr(benchmarks, "setup", lambda quick, device=0: (wl, 0))
    monkeypatch.setattr(benchmarks, "l2_flush", flush)
    rc = gcli.main(["--out", str(tmp_path), "--skip", "limits", "--skip", "difftest", "--skip", "pytest",
                    "--skip", "sanitizer", "--repeats", "3"], driver_factory=lambda: fake)
    assert rc == 0
    doc = json.loads((tmp_path / "report.json").read_text())
    assert calls == [(2 * 50 * 2**20, 0)] and doc["bench"]["flush_l2_bytes"] == 2 * 50 * 2**20
    assert doc["bench"]["rows"][0]["median_us"] == pytest.approx(1000.0)  # the flush is outside the events
    assert doc["bench"]["rows"][0]["rate"] == pytest.approx(1000.0)  # 1 GB in 1 ms


def test_liger_cross_entropy_gets_the_weight_argument_its_version_takes():
    # Liger-Kernel 0.8.5 on the H200 run: LigerCrossEntropyFunction.forward(ctx, _input, target, weight, ...);
    # passing (logits, targets) alone was an error row. Older releases have no weight parameter.
    from pykern.bench.suite import _liger_weight

    class Old:
        @staticmethod
        def forward(ctx, _input, target, ignore_index=-100):  # noqa: ANN001, ANN205
            pass

    class New:
        @staticmethod
        def forward(ctx, _input, target, weight, ignore_index=-100):  # noqa: ANN001, ANN205
            pass

    assert _liger_weight(Old) == () and _liger_weight(New) == (None,)


def test_l2_flush_reads_its_buffer() -> None:
    # The flush is a read (a sum): a memset would leave L2 dirty and put the write-back inside the timed call.
    torch = pytest.importorskip("torch")
    from pykern.bench.runner import l2_flush

    go = l2_flush(4096, "cpu")
    s = go()
    assert isinstance(s, torch.Tensor) and s.item() == 1024.0  # 1024 float32 ones, unchanged by the flush
    assert go().item() == 1024.0


def test_compile_row_times_torch_compile_of_the_torch_expression(monkeypatch):
    """--compile adds an impl 'compile': torch.compile of the row's own torch expression (stubbed here: inductor
    would build C++ on this machine), so it computes what the torch row computes."""
    torch = pytest.importorskip("torch")
    compiled = []

    def fake_compile(fn, dynamic=None):
        compiled.append((fn, dynamic))
        return fn

    monkeypatch.setattr(torch, "compile", fake_compile)
    d = dict(T=4, H=64, F=64, NH=2, KH=1, D=16, V=96, S=8, SH=2)
    by = {c.name: c for c in suite.CASES}
    assert "compile" not in {i.name for i in suite.Context("cpu", backend="host")(by["rms_norm"], "f32", d)}
    impls = {i.name: i for i in suite.Context("cpu", backend="host", compile=True)(by["rms_norm"], "f32", d)}
    assert compiled == [(impls["torch"].fn, False)]
    np.testing.assert_array_equal(_np(impls["compile"].fn()), _np(impls["torch"].fn()))
