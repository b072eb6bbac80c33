"""pykern.gpucheck without a GPU: the orchestration through the fake driver, the report's format, the
compute-sanitizer command lines and output parsing, peaks from device attributes, event timing."""
from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest

from fake_driver import A100_SXM_ATTRIBUTES, H100_SXM_ATTRIBUTES, FakeDriver
from pykern import bench, registry
from pykern.backends.driver import DriverError
from pykern.difftest import runner
from pykern.errors import ArgumentError, BackendUnavailable
from pykern.gpucheck import EXIT_FAILED, EXIT_NO_GPU, EXIT_OK, checks, cli, sanitizer

ALL_STEPS = ["--skip", "difftest", "--skip", "pytest", "--skip", "sanitizer", "--skip-bench"]


def _load(out: Path) -> tuple[dict, str]:
    return json.loads((out / "report.json").read_text()), (out / "report.md").read_text()


def _fake(**kw) -> FakeDriver:
    fake = FakeDriver(**kw)
    fake.name = "Fake A100"
    return fake


def _resources(overrides: dict[str, checks.KernelResources] | None = None) -> dict[str, checks.KernelResources]:
    """Plain resources for every registered kernel (32 registers, no static shared memory)."""
    res = {s.name: checks.KernelResources(s.name, 32, 0, 1024, 0, "test") for s in registry.kernels()}
    res.update(overrides or {})
    return res


@pytest.fixture
def no_compile(monkeypatch):
    """The limits step without NVRTC compiles: canned resources, no module loads on the fake."""
    state = {"resources": _resources()}
    monkeypatch.setattr(checks, "kernel_resources", lambda arch, jobs=0: (dict(state["resources"]), []))
    monkeypatch.setattr(checks, "driver_resources", lambda drv, arch, res: [])
    return state


# ----------------------------------------------------------------------------------------------- no GPU


def test_no_driver_reports_no_gpu_with_its_own_exit_code(tmp_path):
    def no_driver():
        raise BackendUnavailable("nvrtc backend: no CUDA driver (DynamicLibNotFoundError: libcuda.so.1)")

    out = tmp_path / "r"
    assert cli.main(["--out", str(out)], driver_factory=no_driver) == EXIT_NO_GPU == 3
    doc, md = _load(out)
    assert doc["status"] == "NO GPU" and doc["exit_code"] == 3
    assert doc["device"]["gpu"] is False and "no CUDA driver" in doc["device"]["reason"]
    nvrtc = next(b for b in doc["backends"] if b["backend"] == "nvrtc")
    assert nvrtc["usable"] is False and "no CUDA driver" in nvrtc["why"]
    assert {b["backend"] for b in doc["backends"]} == {"nvrtc", "numba", "host"}
    assert "**No GPU**: nvrtc backend: no CUDA driver" in md
    for step in cli.STEPS:  # nothing ran
        assert step not in doc


def test_driver_without_devices_is_no_gpu(tmp_path):
    fake = _fake(devices=0)
    assert cli.main(["--out", str(tmp_path)], driver_factory=lambda: fake) == EXIT_NO_GPU
    doc, _ = _load(tmp_path)
    assert doc["device"]["reason"] == "the CUDA driver reports no GPU"
    assert doc["device"]["driver_version"] == "12.4"


# ----------------------------------------------------------------------------------------------- limits


def test_fake_device_whose_limits_reject_kernels_is_reported(tmp_path, no_compile):
    # A small device: 16 KB of shared memory per block, 16K registers per block.
    attrs = dict(A100_SXM_ATTRIBUTES, MAX_REGISTERS_PER_BLOCK=16384)
    fake = _fake(attributes=attrs, max_shared_optin=16 * 1024)
    no_compile["resources"] = _resources({
        "attention_fwd_fma_d128": checks.KernelResources("attention_fwd_fma_d128", 64, 32768, 256, 0, "test"),
        "rms_norm": checks.KernelResources("rms_norm", 30, 128, 1024, 0, "test"),
    })
    rc = cli.main(["--out", str(tmp_path), *ALL_STEPS], driver_factory=lambda: fake)
    assert rc == EXIT_FAILED
    doc, md = _load(tmp_path)
    rows = {r["kernel"]: r for r in doc["limits"]["rows"]}
    assert set(rows) == {s.name for s in registry.kernels() if not s.archs}  # one row per kernel built for sm_80
    # static shared memory alone is over the 16 KB limit
    fa = rows["attention_fwd_fma_d128"]
    assert fa["status"] == "FAIL"
    assert "0 dynamic = 32768 bytes of shared memory per block > device limit 16384" in fa["problems"][0]
    # rms_norm sizes its blocks to the row (672 threads for a one-read row, 1024 for long rows): 30 regs ->
    # 32 per thread after per-warp rounding (960 -> 1024 per warp); 21 warps x 1024 = 21504 and
    # 32 warps x 1024 = 32768, both > 16384
    assert [p for p in rows["rms_norm"]["problems"] if "registers" in p] == [
        "30 registers x 672 threads = 21504 registers per block (per-warp allocation) > device limit 16384",
        "30 registers x 1024 threads = 32768 registers per block (per-warp allocation) > device limit 16384"]
    # the flash backward's dynamic shared memory (2*16*d*4 bytes: 32768 at head_dim 256) is recorded from the ops
    assert any("32768 dynamic" in p for p in rows["attention_bwd_fma_dq"]["problems"])
    assert rows["embedding"]["status"] == "ok" and rows["embedding"]["launches"] == [[256, 0]]
    assert any(f.startswith("limits: attention_fwd_fma_d128: ") for f in doc["failures"])
    assert "| attention_fwd_fma_d128 | 64 | 32768 | 256 |" in md
    # the same kernels fit an H100
    fake_h100 = _fake(attributes=dict(H100_SXM_ATTRIBUTES), cc=(9, 0), max_shared_optin=227 * 1024)
    assert cli.main(["--out", str(tmp_path / "h100"), *ALL_STEPS], driver_factory=lambda: fake_h100) == EXIT_OK


def test_check_limits_thread_limit_from_launch_bounds_and_occupancy():
    attrs = dict(H100_SXM_ATTRIBUTES)
    res = {"k": checks.KernelResources("k", 64, 0, 256, 0, "t")}
    rows = checks.check_limits(attrs, res, {"k": {(512, 0), (256, 0)}}, ["k"])
    assert rows[0]["problems"] == ["512 threads per block > the kernel's limit 256 (launch bounds / registers)"]
    # 64 regs x 256 threads = 16384 registers a block: 4 blocks fill the 65536 of an SM
    assert checks.blocks_per_sm(attrs, 256, 64, 0) == 4
    assert checks.regs_per_block(30, 1024) == 32 * 1024
    assert checks.blocks_per_sm(attrs, 128, 32, 200 * 1024) == 1
    assert checks.launch_problems(attrs, res["k"], 2048, 0)[0] == "2048 threads per block > device limit 1024"


def test_driver_resources_come_from_the_loaded_cubin(monkeypatch):
    from types import SimpleNamespace

    from fake_driver import TEST_SOURCE, compile_test_kernels
    from pykern import cache

    compiled = compile_test_kernels("sm_80")
    fake = FakeDriver(func_attributes={"pktest_axpy": {"NUM_REGS": 40, "MAX_THREADS_PER_BLOCK": 768,
                                                       "SHARED_SIZE_BYTES": 512}})
    fake.register(compiled.image, compiled.ptx)
    fake.set_current(fake.primary_context(0))
    mod = SimpleNamespace(image=compiled.image, kernels=compiled.kernels, resources=compiled.resources)
    monkeypatch.setattr(registry, "source_files", lambda: [TEST_SOURCE])
    monkeypatch.setattr(cache, "get_module", lambda src, arch, **kw: mod)
    res = {"pktest_axpy": checks.KernelResources("pktest_axpy", 20, 0, 1024, 0, "cache")}
    assert checks.driver_resources(fake, "sm_80", res) == []
    assert res["pktest_axpy"] == checks.KernelResources("pktest_axpy", 40, 512, 768, 0, "driver")
    assert set(res) == set(compiled.kernels)  # every kernel of the module got the driver's figures
    asked = {c[1][1] for c in fake.calls if c[0] == "func_attribute"}
    assert asked == {"NUM_REGS", "SHARED_SIZE_BYTES", "MAX_THREADS_PER_BLOCK"}


def test_arch_override_compiles_for_that_arch_and_skips_the_device_load(tmp_path, monkeypatch, no_compile):
    asked = []
    monkeypatch.setattr(checks, "kernel_resources", lambda arch, jobs=0: (asked.append(arch), (_resources(), []))[1])
    monkeypatch.setattr(checks, "driver_resources", lambda *a: pytest.fail("an sm_80 cubin cannot load on sm_90"))
    fake = _fake(attributes=dict(H100_SXM_ATTRIBUTES), cc=(9, 0), max_shared_optin=227 * 1024)
    assert cli.main(["--out", str(tmp_path), "--arch", "sm_80", *ALL_STEPS], driver_factory=lambda: fake) == EXIT_OK
    doc, _ = _load(tmp_path)
    assert asked == ["sm_80"] and doc["limits"]["arch"] == "sm_80" and doc["device"]["arch"] == "sm_90"


def test_launch_bounds_resolve_macros_and_literals():
    root = Path(registry.__file__).resolve().parent.parent / "kernels_cu"
    fa = checks.launch_bounds(root / "attention_fwd_fma.cu")  # __launch_bounds__(FA_THREADS, FA_MIN_BLOCKS)
    assert fa["attention_fwd_fma_d128"] == 256
    tr = checks.launch_bounds(root / "training.cu")
    assert tr["transpose_2d"] == 256 and tr["softmax_backward"] == 512
    # one table with the launcher: the kernels the registry bounds, with the registry's values
    assert fa == {s.name: s.max_threads for s in registry.kernels() if s.source.name == "attention_fwd_fma.cu"}


def test_recorded_launches_cover_every_kernel_with_the_ops_geometry():
    seen, notes = checks.recorded_launches()
    # every kernel, the arch-specific (sm_90a) ones included: their cases play sm_90a on the host (PYKERN_HOST_ARCH),
    # which the recorder follows, so their launches show the wgmma kernels' geometry
    assert set(seen) == {s.name for s in registry.kernels()} and not notes, notes
    assert seen["attention_fwd_sm90_d128_bf16"] == {(384, 164864)}  # 3 warpgroups, Q + 2 x (K + V) + barriers
    assert (1024, 0) in seen["rms_norm"]  # long rows take the block-per-row shape
    assert all(t <= 1024 for ks in seen.values() for t, _ in ks)


# ----------------------------------------------------------------------------------------------- report


def test_report_format_and_a_failing_difftest_case_fails_the_run(tmp_path, monkeypatch, no_compile):
    case = {"id": "rms_norm[f32]3x1", "op": "rms_norm", "kernels": ["rms_norm"], "shape": "3x1", "dtype": "f32",
            "note": "", "atol": 1e-5, "rtol": 1e-5, "verdict": "FAIL", "pair_max": 0.5, "pair_ok": False,
            "backends": [{"label": "nvrtc", "status": "fail", "seconds": 0.01, "max_abs": 0.5, "max_rel": 0.5,
                          "message": "", "outputs": []},
                         {"label": "numba", "status": "ok", "seconds": 0.2, "max_abs": 0.0, "max_rel": 0.0,
                          "message": "", "outputs": []}],
            "failures": ["rms_norm[f32]3x1 on nvrtc: output 'out': 3/3 elements out of tolerance"]}
    ok_case = dict(case, id="silu_gate[f32]7", op="silu_gate", kernels=["silu_gate"], verdict="ok", failures=[],
                   backends=[dict(b, status="ok", max_abs=1e-7) for b in case["backends"]])
    summary = {"cases": 2, "passed": 1, "failed": 1, "errors": 0, "skipped": 0, "skipped_backend_runs": 0,
               "kernels": 2, "backends": ["nvrtc", "numba"], "seconds": 1.0, "seed": 0}
    calls = []

    def fake_difftest(cmd, timeout):
        calls.append(cmd)
        return 1, json.dumps({"summary": summary, "cases": [case, ok_case]}), "progress\n"

    monkeypatch.setattr(cli, "run_difftest", fake_difftest)
    fake = _fake()
    out = tmp_path / "rep"
    rc = cli.main(["--out", str(out), "--skip", "pytest", "--skip", "sanitizer", "--skip-bench"],
                  driver_factory=lambda: fake)
    assert rc == EXIT_FAILED
    # numba is the CUDA simulator on this machine: far too slow for a GPU run, so nvrtc vs float64 only
    assert calls[0][1:] == ["-m", "pykern.difftest", "--backends", "nvrtc", "--json"]
    doc, md = _load(out)
    for key in ("version", "tool", "command", "started", "options", "device", "backends", "peaks", "limits",
                "difftest", "status", "exit_code", "seconds", "failures"):
        assert key in doc, key
    assert doc["status"] == "FAIL" and doc["exit_code"] == 1
    assert doc["device"]["name"] == "Fake A100" and doc["device"]["arch"] == "sm_80"
    assert doc["device"]["attributes"]["MULTIPROCESSOR_COUNT"] == 108
    assert "numba reference not run: numba CUDA simulator" in doc["difftest"]["note"]
    assert doc["difftest"]["status"] == "FAIL" and [c["id"] for c in doc["difftest"]["cases"]] == [
        "rms_norm[f32]3x1", "silu_gate[f32]7"]
    assert "difftest: rms_norm[f32]3x1 on nvrtc: output 'out': 3/3 elements out of tolerance" in doc["failures"]
    assert doc["peaks"]["bandwidth"] == pytest.approx(1215e6 * 5120 * 2 / 8)
    # report.md: one table row per case and per kernel, and the sections a person looks for
    assert md.startswith("# pykern GPU check: FAIL")
    for heading in ("## Device", "## Backends", "## Kernel launch limits", "## Difftest", "## Failures"):
        assert heading in md
    assert "| rms_norm[f32]3x1 | rms_norm | nvrtc\\|numba | 0.50 | 0.50 | FAIL |" in md
    assert md.count("\n| silu_gate[f32]7 |") == 1
    assert sum(1 for ln in md.splitlines() if ln.startswith("| ") and "| ok |" in ln) >= len(
        [s for s in registry.kernels() if not s.archs])  # an A100: the sm_90a kernels have no row


def test_pytest_step_is_skipped_without_tests_folder(tmp_path, monkeypatch, no_compile):
    monkeypatch.setattr(cli, "REPO_ROOT", tmp_path / "nowhere")
    fake = _fake()
    rc = cli.main(["--out", str(tmp_path), "--skip", "limits", "--skip", "difftest", "--skip", "sanitizer",
                   "--skip-bench"], driver_factory=lambda: fake)
    assert rc == EXIT_OK
    doc, md = _load(tmp_path)
    assert doc["pytest"]["status"] == "skipped" and "no tests folder" in doc["pytest"]["message"]


def test_pytest_step_counts_and_failure(tmp_path, monkeypatch, no_compile):
    seen = []

    def fake_pytest(cmd, timeout, cwd):
        seen.append(cmd)
        junit = Path(next(a for a in cmd if a.startswith("--junitxml=")).split("=", 1)[1])
        junit.write_text('<?xml version="1.0"?><testsuites><testsuite name="pytest" tests="8" failures="1" '
                         'errors="0" skipped="2"/></testsuites>')
        return 1, "1 failed, 5 passed, 2 skipped in 3.1s\n", ""

    monkeypatch.setattr(cli, "run_pytest", fake_pytest)
    fake = _fake()
    rc = cli.main(["--out", str(tmp_path), "--skip", "limits", "--skip", "difftest", "--skip", "sanitizer",
                   "--skip-bench"], driver_factory=lambda: fake)
    assert rc == EXIT_FAILED
    assert seen[0][1:6] == ["-m", "pytest", "-m", "gpu", "-q"] and seen[0][-1].endswith("tests")
    doc, md = _load(tmp_path)
    assert doc["pytest"]["counts"] == {"tests": 8, "failures": 1, "errors": 0, "skipped": 2}
    assert "pytest -m gpu: 1 failed, 5 passed, 2 skipped in 3.1s" in doc["failures"]


# ----------------------------------------------------------------------------------------------- sanitizer

MEMCHECK_OUT = """\
========= COMPUTE-SANITIZER
# nvrtc: NVIDIA H100 80GB HBM3 (sm_90)
========= Invalid __global__ read of size 4 bytes
=========     at rms_norm+0x3b0
=========     by thread (255,0,0) in block (2,0,0)
=========     Address 0x7f3a4c000c00 is out of bounds
=========     and is 1 bytes after the nearest allocation at 0x7f3a4c000000 of size 3071 bytes
=========     Saved host backtrace up to driver entry point at kernel launch time
=========         Host Frame: [0x2e6f4f] in /lib/x86_64-linux-gnu/libcuda.so.1
=========         Host Frame: [0x14f3e] in /usr/lib/python3/dist-packages/cuda/bindings/_bindings/cydriver.so
=========
========= Program hit CUDA_ERROR_LAUNCH_FAILED (error 719) due to "unspecified launch failure" on CUDA API call to cuStreamSynchronize.
=========     Saved host backtrace up to driver entry point at error
=========         Host Frame: [0x2f1b3c] in /lib/x86_64-linux-gnu/libcuda.so.1
=========
rms_norm[f32]3x1  rms_norm  3x1  f32  nvrtc  ERROR
========= Target application returned an error
========= ERROR SUMMARY: 2 errors
"""

RACECHECK_OUT = """\
========= COMPUTE-SANITIZER
========= Error: Race reported between Write access at softmax_backward+0x2d0
=========     and Read access at softmax_backward+0x350 [2048 hazards]
=========
========= Warning: Race reported between Read access at 0x1f0 in training.cu:131:softmax_backward
=========     and Write access at 0x2d0 in training.cu:120:softmax_backward [32 hazards]
=========
========= RACECHECK SUMMARY: 2 hazards displayed (1 error, 1 warning)
"""

INITCHECK_OUT = """\
========= COMPUTE-SANITIZER
========= Uninitialized __global__ memory read of size 4 bytes
=========     at 0x1a0 in decode_attn_split_reduce
=========     by thread (3,0,0) in block (0,0,0)
=========     Address 0x7f1c2e000200
=========
========= ERROR SUMMARY: 1 error
"""

SYNCCHECK_OUT = """\
========= COMPUTE-SANITIZER
========= Barrier error detected. Divergent thread(s) in block
=========     at attention_fwd_fma_d64+0x7c0
=========     by thread (37,0,0) in block (0,0,0)
=========
========= ERROR SUMMARY: 1 error
"""

CLEAN_OUT = "========= COMPUTE-SANITIZER\nrms_norm[f32]3x1 ... ok\n========= ERROR SUMMARY: 0 errors\n"


def test_sanitizer_command_line_per_tool():
    cs = "/opt/cuda/bin/compute-sanitizer"
    tail = ["/usr/bin/python3", "-m", "pykern.difftest", "--backends", "nvrtc", "--kernels", "rms_norm",
            "--case-limit", "1", "--seed", "0"]
    head = [cs, "--tool"]
    common = ["--error-exitcode", "99", "--print-limit", "20"]
    assert sanitizer.command(cs, "memcheck", "rms_norm", python="/usr/bin/python3") == [
        *head, "memcheck", *common, *tail]
    assert sanitizer.command(cs, "racecheck", "rms_norm", python="/usr/bin/python3") == [
        *head, "racecheck", *common, *tail]
    assert sanitizer.command(cs, "initcheck", "rms_norm", python="/usr/bin/python3") == [
        *head, "initcheck", *common, *tail]
    assert sanitizer.command(cs, "synccheck", "rms_norm", python="/usr/bin/python3", big=False) == [
        *head, "synccheck", *common, *tail, "--no-big"]
    with pytest.raises(ValueError, match="tool: expected one of memcheck"):
        sanitizer.command(cs, "leakcheck", "rms_norm")


def test_sanitizer_output_parsing():
    f = sanitizer.parse_output(MEMCHECK_OUT, "memcheck", "rms_norm", "rms_norm[f32]3x1")
    assert [(x.tool, x.kernel, x.case, x.message) for x in f] == [
        ("memcheck", "rms_norm", "rms_norm[f32]3x1", "Invalid __global__ read of size 4 bytes"),
        ("memcheck", "rms_norm", "rms_norm[f32]3x1",
         'Program hit CUDA_ERROR_LAUNCH_FAILED (error 719) due to "unspecified launch failure" on CUDA API call '
         "to cuStreamSynchronize."),
    ]
    assert f[0].details[:2] == ["at rms_norm+0x3b0", "by thread (255,0,0) in block (2,0,0)"]
    assert not any("Host Frame" in d for d in f[0].details)
    r = sanitizer.parse_output(RACECHECK_OUT, "racecheck", "softmax_backward", "softmax_backward[f32]1x1")
    assert [(x.kernel, x.message) for x in r] == [
        ("softmax_backward", "Error: Race reported between Write access at softmax_backward+0x2d0"),
        ("softmax_backward", "Warning: Race reported between Read access at 0x1f0 in training.cu:131:softmax_backward"),
    ]
    assert r[0].details == ["and Read access at softmax_backward+0x350 [2048 hazards]"]
    assert sanitizer.summary_count(RACECHECK_OUT) == 2
    # the kernel named in the report wins over the kernel the run was for (a case launches several)
    i = sanitizer.parse_output(INITCHECK_OUT, "initcheck", "decode_attn_split_chunk", "c")
    assert [(x.kernel, x.message) for x in i] == [
        ("decode_attn_split_reduce", "Uninitialized __global__ memory read of size 4 bytes")]
    s = sanitizer.parse_output(SYNCCHECK_OUT, "synccheck", "attention_fwd_fma_d64", "c")
    assert [(x.kernel, x.message) for x in s] == [
        ("attention_fwd_fma_d64", "Barrier error detected. Divergent thread(s) in block")]
    assert sanitizer.parse_output(CLEAN_OUT, "memcheck", "rms_norm", "c") == []
    assert sanitizer.summary_count(CLEAN_OUT) == 0


def test_sanitizer_judge_statuses():
    mk = lambda: sanitizer.Run("memcheck", "rms_norm", "c", ["x"])  # noqa: E731
    assert sanitizer.judge(mk(), 0, CLEAN_OUT).status == "clean"
    assert sanitizer.judge(mk(), 99, MEMCHECK_OUT).status == "findings"
    r = sanitizer.judge(mk(), 99, "========= ERROR SUMMARY: 3 errors\n")
    assert r.status == "findings" and "sanitizer reported 3" in r.findings[0].message
    r = sanitizer.judge(mk(), 1, "difftest: 0/1 cases passed\n========= ERROR SUMMARY: 0 errors\n")
    assert r.status == "error" and r.message.startswith("exit 1")
    assert sanitizer.judge(mk(), None, "").message == "timed out"


def test_sanitizer_step_end_to_end_with_a_finding(tmp_path, monkeypatch, no_compile):
    exe = tmp_path / "compute-sanitizer"
    exe.write_text("#!/bin/sh\nexit 0\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    seen = []

    def fake_run(cmd, timeout):
        seen.append(list(cmd))
        kernel, tool = cmd[cmd.index("--kernels") + 1], cmd[2]
        if tool == "racecheck" and kernel == "softmax_backward":
            return 99, RACECHECK_OUT
        return 0, CLEAN_OUT

    fake = _fake()
    out = tmp_path / "rep"
    rc = cli.main(["--out", str(out), "--sanitizer", str(exe), "--quick", "--skip", "limits", "--skip", "difftest",
                   "--skip", "pytest", "--skip-bench", "--jobs", "2"], driver_factory=lambda: fake,
                  sanitizer_runner=fake_run)
    assert rc == EXIT_FAILED
    # arch-specific (sm_90a) kernels' cases run on the host only: no nvrtc command for them, and the step says so
    n = len([s for s in registry.kernels() if not s.archs])
    n_arch = len(registry.kernels()) - n
    assert len(seen) == 2 * n  # --quick: memcheck + racecheck, one run per kernel
    doc, md = _load(out)
    sz = doc["sanitizer"]
    assert sz["tools"] == ["memcheck", "racecheck"] and len(sz["runs"]) == 2 * n
    assert f"; {n_arch} kernels left out: their cases do not run on nvrtc (not applicable (sm_90a): " in sz["message"]
    first = runner.first_case_per_kernel(runner.collect_cases(0, big=False))["softmax_backward"].id
    assert [(f["tool"], f["kernel"], f["case"]) for f in sz["findings"]] == [
        ("racecheck", "softmax_backward", first)] * 2
    assert f"| racecheck | softmax_backward | {first} | Error: Race reported between Write access" in md
    assert any(f.startswith("sanitizer racecheck: softmax_backward") for f in doc["failures"])
    assert f"{2 * n - 1} runs clean" in md
    log = (out / "sanitizer" / "racecheck-softmax_backward.log").read_text()
    assert log.startswith(str(exe) + " --tool racecheck") and "RACECHECK SUMMARY: 2 hazards" in log


def test_sanitizer_runs_past_the_budget_are_skipped():
    import time

    runs = sanitizer.run_all("cs", ["memcheck"], {"rms_norm": "c1", "embedding": "c2"}, time.monotonic() - 1,
                             runner=lambda cmd, t: pytest.fail("nothing may start after the deadline"))
    assert [(r.kernel, r.status, r.message) for r in runs] == [
        ("embedding", "skipped", "time budget used up"), ("rms_norm", "skipped", "time budget used up")]


def test_missing_sanitizer_skips_and_a_bad_path_fails(tmp_path, monkeypatch, no_compile):
    monkeypatch.setenv("PATH", str(tmp_path))
    fake = _fake()
    skip = ["--skip", "limits", "--skip", "difftest", "--skip", "pytest", "--skip-bench"]
    assert cli.main(["--out", str(tmp_path / "a"), *skip], driver_factory=lambda: fake) == EXIT_OK
    assert _load(tmp_path / "a")[0]["sanitizer"]["status"] == "skipped"
    rc = cli.main(["--out", str(tmp_path / "b"), "--sanitizer", str(tmp_path / "nope"), *skip],
                  driver_factory=lambda: fake)
    assert rc == EXIT_FAILED


# ----------------------------------------------------------------------------------------------- difftest


def test_difftest_case_limit_picks_the_first_case_per_kernel(capsys):
    from pykern.difftest.__main__ import main as difftest_main

    cases = runner.collect_cases(0)
    first = runner.first_case_per_kernel(cases)
    picked = runner.limit_cases(runner.collect_cases(0, "rms_norm"), 1, "rms_norm")
    assert [c.id for c in picked] == [first["rms_norm"].id]
    assert difftest_main(["--kernels", "rms_norm", "--case-limit", "1", "--list"]) == 0
    assert capsys.readouterr().out.splitlines() == [f"{first['rms_norm'].id}  kernels=rms_norm"]
    two = runner.limit_cases(cases, 2)
    assert len(two) < len(cases)
    for k in first:  # every kernel keeps min(2, its case count) cases at least
        assert sum(k in c.kernels for c in two) >= min(2, sum(k in c.kernels for c in cases)), k
    with pytest.raises(ArgumentError, match="--case-limit"):
        runner.limit_cases(cases, 0)


# ----------------------------------------------------------------------------------------------- peaks, timing


def test_peak_bandwidth_from_h100_attributes():
    # H100 SXM: MEMORY_CLOCK_RATE 2619000 kHz, GLOBAL_MEMORY_BUS_WIDTH 5120 bits -> 3.35 TB/s
    bw = bench.peak_bandwidth(2_619_000, 5120)
    assert bw == pytest.approx(3.352e12, rel=1e-3)
    peaks = bench.device_peaks(H100_SXM_ATTRIBUTES)
    assert peaks.bandwidth == bw
    assert peaks.bf16_tensor == pytest.approx(989.4e12, rel=1e-3)  # 132 SMs x 4096 x 1830 MHz
    assert peaks.fp32 == pytest.approx(66.9e12, rel=1e-3)  # 132 x 256 x 1980 MHz
    assert peaks.part == "H100 SXM / H200"
    a100 = bench.device_peaks(A100_SXM_ATTRIBUTES)
    assert a100.bf16_tensor == pytest.approx(312e12, rel=1e-2) and a100.fp32 == pytest.approx(19.5e12, rel=1e-2)
    assert a100.bandwidth == pytest.approx(1.555e12, rel=1e-3)
    unknown = bench.device_peaks(dict(H100_SXM_ATTRIBUTES, COMPUTE_CAPABILITY_MAJOR=6))
    assert unknown.bf16_tensor is None and "no FLOP table entry" in unknown.note and unknown.bandwidth == bw
    with pytest.raises(ArgumentError):
        bench.peak_bandwidth(0, 5120)


def test_event_timer_median_of_repeats_after_warmup():
    fake = FakeDriver()
    fake.set_current(0xC0)
    times = iter([9.0, 9.0, 1.0, 5.0, 2.0, 100.0, 3.0])  # two warm-up calls, then five timed
    calls = []

    def step():
        calls.append(1)
        fake.clock_ms += next(times)

    t = bench.EventTimer(fake, stream=7).time(step, warmup=2, repeats=5)
    assert t.samples_ms == [1.0, 5.0, 2.0, 100.0, 3.0] and t.median_ms == 3.0 and t.seconds == 0.003
    assert len(calls) == 7
    assert fake.events == {}  # every event destroyed
    assert ("event_record", (next(c[1][0] for c in fake.calls if c[0] == "event_record"), 7)) in fake.calls
    with pytest.raises(ArgumentError):
        bench.EventTimer(fake).time(step, repeats=0)


def test_event_timer_keeps_the_gpu_busy_before_each_start_event():
    # The sleep goes on the stream after the flush and before the start event of every timed call (not of the
    # warm-up calls), so host time spent enqueuing the call lands under the sleep, outside the events.
    fake = FakeDriver()
    fake.set_current(0xC0)
    order = []
    real_record = fake.event_record

    def record(ev, stream):
        order.append(("record", stream))
        real_record(ev, stream)

    fake.event_record = record
    timer = bench.EventTimer(fake, stream=7, busy=lambda: order.append("sleep"))
    timer.time(lambda: order.append("call"), warmup=1, repeats=3, before=lambda: order.append("flush"))
    assert order == ["call"] + ["flush", "sleep", ("record", 7), "call", ("record", 7)] * 3
    assert bench.EventTimer(fake).busy is None  # opt-in: a driver-only caller has nothing to sleep with


def test_gpu_sleep_needs_torch_with_cuda(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.gpu_sleep() is None
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "_sleep", lambda n: calls.append(n))
    bench.gpu_sleep(123)()
    assert calls == [123] and bench.SLEEP_CYCLES == 2_000_000


def test_event_elapsed_of_unrecorded_event_is_a_driver_error():
    fake = FakeDriver()
    fake.set_current(0xC0)
    a, b = fake.event_create(), fake.event_create()
    with pytest.raises(DriverError, match="cuEventElapsedTime"):
        fake.event_elapsed_ms(a, b)


def test_run_benchmarks_rates_and_percent_of_peak():
    from pykern.gpucheck import benchmarks

    fake = FakeDriver()
    fake.set_current(0xC0)

    def takes(ms):
        def go():
            fake.clock_ms += ms
        return go

    def boom():
        raise RuntimeError("launch failed")

    peaks = bench.device_peaks(H100_SXM_ATTRIBUTES)
    wl = [
        benchmarks.Workload("rms_norm", "1x1", "bf16", "memory", 3.352e9, [
            benchmarks.Impl("pykern", takes(2.0)), benchmarks.Impl("liger", None, "liger_kernel not importable")]),
        benchmarks.Workload("flash_attention", "b1", "bf16", "compute", 989.4e9, [
            benchmarks.Impl("pykern", takes(4.0)), benchmarks.Impl("torch", boom)]),
    ]
    rows = benchmarks.run_benchmarks(wl, bench.EventTimer(fake), peaks, warmup=1, repeats=3, deadline=1e18)
    by = {(r["op"], r["impl"]): r for r in rows}
    r = by["rms_norm", "pykern"]
    assert r["median_us"] == pytest.approx(2000.0) and r["unit"] == "GB/s"
    assert r["rate"] == pytest.approx(1676.0) and r["pct_peak"] == pytest.approx(50.0, rel=1e-3)
    assert by["rms_norm", "liger"]["status"] == "skipped"
    fa = by["flash_attention", "pykern"]
    assert fa["unit"] == "TFLOP/s" and fa["rate"] == pytest.approx(247.35) and fa["pct_peak"] == pytest.approx(25.0, rel=1e-3)
    assert by["flash_attention", "torch"]["status"] == "error" and "launch failed" in by[
        "flash_attention", "torch"]["message"]


def test_bench_step_end_to_end_on_the_fake_clock(tmp_path, monkeypatch, no_compile):
    from pykern.gpucheck import benchmarks

    fake = _fake(attributes=dict(H100_SXM_ATTRIBUTES), cc=(9, 0), max_shared_optin=227 * 1024)

    def takes(ms):
        def go():
            fake.clock_ms += ms
        return go

    wl = [benchmarks.Workload("silu_gate", "8192x14336", "bf16", "memory", 3 * 8192 * 14336 * 2, [
              benchmarks.Impl("pykern", takes(0.25)), benchmarks.Impl("torch", takes(0.5)),
              benchmarks.Impl("flashinfer", None, "flashinfer not importable (ModuleNotFoundError)")]),
          benchmarks.Workload("flash_attention", "b1 n4096 h32/8 d128 causal", "bf16", "compute",
                              bench.attention_flops(1, 32, 4096, 4096, 128, True), [
              benchmarks.Impl("pykern", lambda: (_ for _ in ()).throw(RuntimeError("CUDA_ERROR_ILLEGAL_ADDRESS")))])]
    monkeypatch.setattr(benchmarks, "torch_status", lambda: (True, ""))
    monkeypatch.setattr(benchmarks, "setup", lambda quick, device=0: (wl, 0))
    rc = cli.main(["--out", str(tmp_path), "--skip", "limits", "--skip", "difftest", "--skip", "pytest",
                   "--skip", "sanitizer", "--repeats", "4"], driver_factory=lambda: fake)
    assert rc == EXIT_FAILED  # the pykern attention errored
    doc, md = _load(tmp_path)
    rows = {(r["op"], r["impl"]): r for r in doc["bench"]["rows"]}
    silu = rows["silu_gate", "pykern"]
    # 704.6 MB in 0.25 ms = 2818.6 GB/s = 84.1 % of the H100 SXM peak 3352 GB/s
    assert silu["median_us"] == pytest.approx(250.0) and silu["rate"] == pytest.approx(2818.6, rel=1e-4)
    assert silu["pct_peak"] == pytest.approx(84.09, rel=1e-3)
    assert rows["silu_gate", "torch"]["pct_peak"] == pytest.approx(42.05, rel=1e-3)
    assert rows["silu_gate", "flashinfer"]["status"] == "skipped"
    assert rows["flash_attention", "pykern"]["status"] == "error"
    assert "bench: flash_attention b1 n4096 h32/8 d128 causal: RuntimeError: CUDA_ERROR_ILLEGAL_ADDRESS" in doc["failures"]
    assert doc["bench"]["repeats"] == 4
    assert "| silu_gate | 8192x14336 | bf16 | pykern | 250.00 | 2818.57 | GB/s | 84.08 | ok |" in md


def test_bench_is_skipped_without_torch_cuda(tmp_path, no_compile):
    fake = _fake()
    rc = cli.main(["--out", str(tmp_path), "--skip", "limits", "--skip", "difftest", "--skip", "pytest",
                   "--skip", "sanitizer"], driver_factory=lambda: fake)
    assert rc == EXIT_OK
    doc, _ = _load(tmp_path)
    assert doc["bench"]["status"] == "skipped" and doc["bench"]["message"].startswith("needs torch with CUDA")


def test_importing_gpucheck_and_bench_stays_light():
    import subprocess

    code = ("import sys, pykern.gpucheck.cli, pykern.gpucheck.sanitizer, pykern.bench; "
            "print(sorted(m for m in ('torch', 'numba', 'cuda.bindings.driver') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=dict(os.environ)).stdout
    assert out.strip() == "[]"


def test_attention_flops():
    assert bench.attention_flops(1, 2, 3, 5, 4, False) == 4 * 1 * 2 * 3 * 5 * 4
    assert bench.attention_flops(1, 2, 8, 8, 4, True) == 2 * 1 * 2 * 8 * 8 * 4


def test_help_tells_exit_codes_and_options(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for opt in ("--out", "--sanitizer", "--quick", "--skip-bench", "--arch", "--budget"):
        assert opt in text
    assert "3 no CUDA driver or no GPU" in " ".join(text.split())
