"""Host backend: an out-of-bounds access to an array argument is stopped before it touches other memory.

Each array argument runs in a guarded copy (pykern/backends/host.py, _Staging): its last byte flush
against a PROT_NONE window of 1 TiB, the pages before its first page PROT_NONE too, faults caught by the
runtime and reported as KernelExecutionError naming the argument, read or write and the byte offset.
The few slack bytes before the copy's start (in its first page) are checked after the launch for writes
and read as NaN bytes; the checked build (PYKERN_HOST_RACECHECK=1) names those reads too.
The kernels are tests/bounds_cu/bounds.cu; offsets are in bytes relative to the argument's start.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import pykern
from pykern.errors import KernelExecutionError

ROOT = Path(__file__).resolve().parent.parent
BOUNDS_CU = Path(__file__).resolve().parent / "bounds_cu"
N = 64  # floats: a 256-byte argument
MIB = 1 << 20
# The argument lies inside a larger array, so an unguarded access at up to 1 MiB + 1 page either side
# lands in memory the test can see (the caller's neighbouring data), not in random heap memory.
PAD = (MIB + 8192) // 4
PAST = [1, 4096, MIB]  # the first byte past the end, one page and 1 MiB past it
BEFORE = [1, 4096, MIB]  # that many bytes before the start


@pytest.fixture(autouse=True)
def _bounds_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYKERN_KERNEL_PATH", str(BOUNDS_CU))
    monkeypatch.setenv("PYKERN_HOST_SCHEDULE", "forward")
    monkeypatch.delenv("PYKERN_HOST_RACECHECK", raising=False)
    monkeypatch.delenv("PYKERN_HOST_INITCHECK", raising=False)


def launch(name: str, *args: object, grid: int = 1, block: int = 32) -> None:
    pykern.launch(name, grid, block, *args, backend="host")


def _embedded() -> tuple[np.ndarray, np.ndarray]:
    """(whole, x): x is a 256-byte float view in the middle of `whole` (random values, no zero bytes)."""
    rng = np.random.default_rng(7)
    whole = rng.uniform(1.0, 2.0, 2 * PAD + N).astype(np.float32)
    return whole, whole[PAD : PAD + N]


def _works_after() -> None:
    x = np.arange(N, dtype=np.float32)
    y = np.zeros(N, np.float32)
    launch("pkbounds_twice", y, x, N, block=N)
    np.testing.assert_array_equal(y, 2 * x)


def _offset_re(off: int) -> str:
    return rf"at byte offset {off} relative to its start"


@pytest.mark.parametrize("dist", PAST)
def test_write_past_the_end_raises_and_touches_nothing(dist: int) -> None:
    whole, x = _embedded()
    keep = whole.copy()
    off = 4 * N - 1 + dist
    with pytest.raises(KernelExecutionError, match=(
            r"kernel pkbounds_write_byte: block \(0,0,0\): thread \(0,0,0\).*out-of-bounds write of argument 0 "
            rf"\(float\* x, 256 bytes\) {_offset_re(off)} \(past its end\)")):
        launch("pkbounds_write_byte", x, off)
    np.testing.assert_array_equal(whole, keep)  # neither the argument nor its neighbours changed
    _works_after()


@pytest.mark.parametrize("dist", PAST)
def test_read_past_the_end_raises(dist: int) -> None:
    whole, x = _embedded()
    keep = whole.copy()
    out = np.zeros(1, np.uint8)
    off = 4 * N - 1 + dist
    with pytest.raises(KernelExecutionError, match=(
            r"kernel pkbounds_read_byte: block \(0,0,0\): thread \(0,0,0\).*out-of-bounds read of argument 0 "
            rf"\(const float\* x, 256 bytes\) {_offset_re(off)} \(past its end\)")):
        launch("pkbounds_read_byte", x, out, off)
    assert out[0] == 0
    np.testing.assert_array_equal(whole, keep)
    _works_after()


@pytest.mark.parametrize("dist", BEFORE)
def test_write_before_the_start_raises_and_touches_nothing(dist: int) -> None:
    whole, x = _embedded()
    keep = whole.copy()
    if dist < 4096:
        # Within the copy's first page: the slack bytes there are checked after the launch.
        want = rf"kernel pkbounds_write_byte: out-of-bounds write before argument 0 \(float\* x, 256 bytes\): bytes \[-{dist}, {1 - dist}\) relative to its start"
    else:
        want = (r"kernel pkbounds_write_byte: block \(0,0,0\): thread \(0,0,0\).*out-of-bounds write of argument 0 "
                rf"\(float\* x, 256 bytes\) {_offset_re(-dist)} \(before its start\)")
    with pytest.raises(KernelExecutionError, match=want):
        launch("pkbounds_write_byte", x, -dist)
    np.testing.assert_array_equal(whole, keep)
    _works_after()


@pytest.mark.parametrize("dist", [d for d in BEFORE if d >= 4096])
def test_read_before_the_start_raises(dist: int) -> None:
    whole, x = _embedded()
    out = np.zeros(1, np.uint8)
    with pytest.raises(KernelExecutionError, match=(
            r"kernel pkbounds_read_byte: block \(0,0,0\): thread \(0,0,0\).*out-of-bounds read of argument 0 "
            rf"\(const float\* x, 256 bytes\) {_offset_re(-dist)} \(before its start\)")):
        launch("pkbounds_read_byte", x, out, -dist)
    assert out[0] == 0
    _works_after()


def test_read_just_before_the_start_sees_nan_bytes_and_racecheck_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    # Sub-page reads before the start stay in the copy's first page: the default build cannot fault there,
    # so the byte read is the NaN pattern's (0xff), never the caller's neighbouring data (1.0..2.0 floats:
    # their top byte is 0x3f or 0x40).
    whole, x = _embedded()
    out = np.zeros(1, np.uint8)
    launch("pkbounds_read_byte", x, out, -1)
    assert out[0] == 0xFF and whole.view(np.uint8)[4 * PAD - 1] in (0x3F, 0x40)
    # The checked build sees every access and reports it with its line.
    monkeypatch.setenv("PYKERN_HOST_RACECHECK", "1")
    with pytest.raises(KernelExecutionError, match=(
            r"kernel pkbounds_read_byte: block \(0,0,0\): thread \(0,0,0\).*out-of-bounds 1-byte read of argument 0 "
            rf"\(const float\* x, 256 bytes\) {_offset_re(-1)} \(before its start\) at .*bounds\.cu:\d+")):
        launch("pkbounds_read_byte", x, out, -1)
    monkeypatch.delenv("PYKERN_HOST_RACECHECK")
    _works_after()


def test_last_byte_and_first_byte_are_in_bounds() -> None:
    whole, x = _embedded()
    keep = whole.copy()
    out = np.zeros(1, np.uint8)
    for off in (0, 4 * N - 1):
        launch("pkbounds_read_byte", x, out, off)
        assert out[0] == x.view(np.uint8)[off]
        launch("pkbounds_write_byte", x, off)
        assert x.view(np.uint8)[off] == 0x5A
    changed = np.flatnonzero(whole.view(np.uint8) != keep.view(np.uint8))
    assert list(changed) == [4 * PAD, 4 * PAD + 4 * N - 1]  # exactly the two bytes written, nothing else


def test_overlapping_views_share_one_copy() -> None:
    # y = buf[16:64] and x = buf[0:48] overlap: the kernel must see one memory (forward schedule: thread i
    # runs to its end before thread i + 1, so x[16 + i] already holds y[i]'s new value).
    buf = np.arange(1, N + 1, dtype=np.float32)
    orig = buf.copy()
    launch("pkbounds_twice", buf[16:], buf[:48], 48, block=48)
    want = orig.copy()
    for i in range(48):
        want[16 + i] = 2 * want[i]
    np.testing.assert_array_equal(buf, want)
    # Past the union's end: named after the argument that ends last (y), offset relative to its start.
    with pytest.raises(KernelExecutionError, match=(
            r"out-of-bounds write of argument 0 \(float\* x, 192 bytes\) at byte offset 4288 relative to its start")):
        launch("pkbounds_write_byte", buf[16:], 4288)


def test_wild_address_is_an_error_naming_no_argument() -> None:
    out = np.zeros(1, np.float32)
    with pytest.raises(KernelExecutionError, match=(
            r"kernel pkbounds_read_address: block \(0,0,0\): thread \(0,0,0\).*segmentation fault at address "
            r"0x10.*not within any array argument's guard window")):
        launch("pkbounds_read_address", out, 0x10)
    # A non-canonical address (x86-64: a general protection fault, whose address the CPU does not report).
    with pytest.raises(KernelExecutionError, match=r"kernel pkbounds_read_address: block \(0,0,0\)"):
        launch("pkbounds_read_address", out, 1 << 62)
    _works_after()


def test_transpose_with_a_too_small_output_is_an_error_and_the_process_lives() -> None:
    # transpose_2d writes 128 x 96 floats into a 48 x 64 output: 36 KiB past its 12 KiB. The red zones
    # of earlier versions let the write land in the heap (a crash in the garbage collector afterwards).
    code = (
        "import gc, numpy as np, pykern\n"
        "a = np.random.rand(128, 96).astype(np.float32); t = np.empty((48, 64), np.float32)\n"
        "try:\n"
        "    pykern.launch('transpose_2d', (4, 4, 1), (32, 8), a, t, 128, 96, 1, backend='host')\n"
        "except pykern.KernelExecutionError as e:\n"
        "    print('caught:', e)\n"
        "gc.collect()\n"
        "b = np.random.rand(48, 64).astype(np.float32); u = np.empty((64, 48), np.float32)\n"
        "pykern.launch('transpose_2d', (2, 6, 1), (32, 8), b, u, 48, 64, 1, backend='host')\n"
        "assert (u == b.T).all()\n"
        "print('alive')\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYKERN_HOST_RACECHECK", "PYKERN_HOST_INITCHECK"))}
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "caught: kernel transpose_2d:" in r.stdout and "out-of-bounds write of argument 1 (float* output, 12288 bytes)" in r.stdout
    assert r.stdout.rstrip().endswith("alive"), r.stdout


# ---- shared memory ------------------------------------------------------------------------------------------------
SMEM = 1008  # the launches' dynamic shared bytes (63 x 16): the allocation is 1024-aligned, so 16 slack bytes follow


def _smem(off: int, mode: int) -> np.ndarray:
    src = np.arange(4, dtype=np.float32)
    out = np.zeros(32, np.float32)
    pykern.launch("pkbounds_smem", 1, 32, src, out, off, mode, shared_mem=SMEM, backend="host")
    return out


@pytest.mark.parametrize("off,mode,what,where", [
    (1024, 0, "write", "past its end"), (SMEM + 40000, 1, "read", "past its end"), (-8192, 0, "write", "before its start")])
def test_dynamic_shared_memory_sits_between_guards_in_the_plain_build(off: int, mode: int, what: str, where: str) -> None:
    # Its 1024-byte rounded end is flush against a PROT_NONE guard (the mapping starts 3 KiB below it here): a plain
    # store or load past that end, or below the page it starts in, faults and is reported before it lands.
    with pytest.raises(KernelExecutionError, match=(
            rf"kernel pkbounds_smem: block \(0,0,0\): thread \(1,0,0\) \[warp 0 lane 1\]: out-of-bounds {what} of "
            rf"dynamic shared memory \({SMEM} bytes: the launch's shared_mem\) at byte offset {off} relative to its "
            rf"start \({where}\).*stopped at the guard before it touched other memory")):
        _smem(off, mode)
    _works_after()


@pytest.mark.parametrize("off,mode,where", [
    (SMEM, 0, "past its end"), (SMEM - 2, 0, "running past its end"), (SMEM + 40000, 1, "past its end"),
    (-4, 1, "before its start"), (-60000, 0, "before its start")])
def test_checked_build_reports_dynamic_shared_memory_out_of_bounds(off: int, mode: int, where: str,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    if off == SMEM:
        _smem(off, mode)  # the plain build cannot see a store into the 16 slack bytes before the guard
    monkeypatch.setenv("PYKERN_HOST_RACECHECK", "1")
    what = "write" if mode == 0 else "read"
    with pytest.raises(KernelExecutionError, match=(
            rf"kernel pkbounds_smem: block \(0,0,0\): thread \(1,0,0\) \[warp 0 lane 1\]: out-of-bounds 4-byte {what} "
            rf"of dynamic shared memory \({SMEM} bytes: the launch's shared_mem\) at byte offset {off} relative to its "
            rf"start \({where}\) at .*bounds\.cu:\d+")):
        _smem(off, mode)
    monkeypatch.delenv("PYKERN_HOST_RACECHECK")
    _works_after()


def test_checked_build_reports_static_shared_memory_out_of_bounds_and_passes_the_last_bytes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYKERN_HOST_RACECHECK", "1")
    out = _smem(SMEM - 4, 1)  # the last float of the dynamic bytes (never written: the 0xff NaN pattern)
    assert np.isnan(out[0])
    _smem(SMEM - 4, 0)
    _smem(12, 5)  # the last float of st[4]
    with pytest.raises(KernelExecutionError, match=(
            r"thread \(1,0,0\) .*out-of-bounds 4-byte write of static __shared__ memory \(16 bytes laid out\) at byte "
            r"offset 16 relative to its start \(past its end\) at .*bounds\.cu:\d+")):
        _smem(16, 5)


@pytest.mark.parametrize("racecheck", [False, True])
@pytest.mark.parametrize("off,mode,what", [
    (SMEM, 2, r"read by ld\.shared\.v4 \(pk_ld_shared_v4 / pk_ld_shared_b128\)"),
    (SMEM, 3, r"write by pk_cp_async_16 \(its shared destination\)"),
    (SMEM - 31 * 16, 4, r"read by pk_ldmatrix_x4")])  # lane 31's row
def test_wrapper_shared_accesses_are_bounds_checked_in_every_build(off: int, mode: int, what: str, racecheck: bool,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    if racecheck:
        monkeypatch.setenv("PYKERN_HOST_RACECHECK", "1")
        # the checked build may see the lane's own load in the wrapper first (ldmatrix rows: 4-byte loads)
        what = rf"(?:16-byte shared-memory {what}|\d+-byte read of dynamic shared memory)"
    else:
        what = rf"16-byte shared-memory {what}"
    with pytest.raises(KernelExecutionError, match=(
            rf"kernel pkbounds_smem: block \(0,0,0\): thread \((?:1|31),0,0\) .*out-of-bounds {what}")):
        _smem(off, mode)
    _smem(off - 16, mode)  # 16 bytes lower: in bounds
