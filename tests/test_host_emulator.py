"""The host backend's CUDA emulation: shuffles, votes, barriers, atomics, shared memory, errors."""
from __future__ import annotations

import re

import numpy as np
import pytest

import pykern
from pykern.errors import ArgumentError, KernelExecutionError
from host_kernel_helpers import HOST_KERNELS, _host_kernels, launch  # noqa: F401 (an autouse fixture)

FULL = 0xFFFFFFFF
SHFL_OPS = {"idx": 0, "up": 1, "down": 2, "xor": 3}
UNDEF = -1  # what the emulator returns when a shuffle reads a lane outside the mask


# ---- shuffles: expectations written from the CUDA programming guide's wording ------------
def expected_shfl(op: str, vals: np.ndarray, arg: int, width: int, mask: int) -> np.ndarray:
    out = np.full(vals.size, -7, np.int32)
    for t in range(vals.size):
        warp, lane = divmod(t, 32)
        if not (mask >> lane) & 1:
            continue
        seg = (lane // width) * width  # first lane of this lane's width-group
        if op == "idx":
            src = seg + arg % width
        elif op == "up":
            src = lane - arg if lane - arg >= seg else lane  # below the group: own value
        elif op == "down":
            src = lane + arg if lane + arg < seg + width else lane  # past the group: own value
        else:
            # Later groups give the own value; earlier ones may be read (guide, __shfl_xor_sync).
            src = lane ^ arg if (lane ^ arg) < seg + width else lane
        out[t] = vals[warp * 32 + src] if (mask >> src) & 1 else UNDEF
    return out


@pytest.mark.parametrize("op", list(SHFL_OPS))
@pytest.mark.parametrize("width", [2, 4, 8, 16, 32])
def test_shuffle_full_mask_every_width(op: str, width: int) -> None:
    vals = (np.arange(64, dtype=np.int32) * 10 + 3)
    for arg in sorted({0, 1, width // 2, width - 1, width, 5, 17, 31}):
        out = np.zeros(64, np.int32)
        launch("pk_t_shfl", 1, 64, vals, out, SHFL_OPS[op], arg, width, FULL)
        np.testing.assert_array_equal(out, expected_shfl(op, vals, arg, width, FULL), err_msg=f"{op} arg={arg}")


@pytest.mark.parametrize("op", list(SHFL_OPS))
@pytest.mark.parametrize("mask", [0x0000FFFF, 0xFFFF0000, 0x55555555, 0x0F0F00FF])
def test_shuffle_partial_masks(op: str, mask: int) -> None:
    vals = np.arange(64, dtype=np.int32) * 7 + 1
    for width, arg in [(32, 1), (32, 2), (16, 4), (8, 3), (32, 16)]:
        out = np.zeros(64, np.int32)
        launch("pk_t_shfl", 1, 64, vals, out, SHFL_OPS[op], arg, width, mask)
        np.testing.assert_array_equal(
            out, expected_shfl(op, vals, arg, width, mask), err_msg=f"{op} mask={mask:#x} width={width} arg={arg}"
        )


def test_shuffle_partial_last_warp() -> None:
    # 48 threads: warp 1 has lanes 0..15 only; a full mask then names lanes that do not exist.
    vals = np.arange(48, dtype=np.int32) + 100
    out = np.zeros(48, np.int32)
    launch("pk_t_shfl", 1, 48, vals, out, SHFL_OPS["down"], 4, 32, FULL)
    exp = expected_shfl("down", np.concatenate([vals, np.zeros(16, np.int32)]), 4, 32, FULL)[:48]
    exp[44:48] = UNDEF  # lanes 12..15 of warp 1 would read lanes 16..19, which do not exist
    np.testing.assert_array_equal(out, exp)


def test_shuffle_wide_and_float_payloads() -> None:
    d = np.arange(32, dtype=np.float64) * 1e300 / 7
    f = np.linspace(-3, 3, 32, dtype=np.float32)
    od, of = np.zeros_like(d), np.zeros_like(f)
    launch("pk_t_shfl_wide", 1, 32, d, od, f, of)
    exp_d = np.concatenate([d[1:], d[-1:]])
    np.testing.assert_array_equal(od, exp_d)
    np.testing.assert_array_equal(of, f[np.arange(32) ^ 5])


@pytest.mark.parametrize("mask", [FULL, 0x0000FFFF, 0x80000001, 0x00F000F0])
def test_votes(mask: int) -> None:
    rng = np.random.default_rng(mask & 0xFFFF)
    pred = (rng.random(64) < 0.5).astype(np.int32)
    pred[32:] = 1  # warp 1: all true under its mask
    ballot, anyv, allv = np.zeros(64, np.uint32), np.zeros(64, np.int32), np.zeros(64, np.int32)
    launch("pk_t_vote", 1, 64, pred, ballot, anyv, allv, mask)
    for w in range(2):
        lanes = [l for l in range(32) if (mask >> l) & 1]
        b = sum(1 << l for l in lanes if pred[w * 32 + l])
        for l in lanes:
            t = w * 32 + l
            assert ballot[t] == b
            assert anyv[t] == int(b != 0)
            assert allv[t] == int(all(pred[w * 32 + k] for k in lanes))
        for l in range(32):
            if not (mask >> l) & 1:
                assert ballot[w * 32 + l] == 0 and anyv[w * 32 + l] == 0


def test_match_and_reduce() -> None:
    v = (np.arange(64, dtype=np.int32) * 7) % 5
    v[32:] = 4  # warp 1: every lane holds the same value (even)
    outs = [np.zeros(64, np.uint32), np.zeros(64, np.uint32), np.zeros(64, np.int32), np.zeros(64, np.uint32),
            np.zeros(64, np.int32), np.zeros(64, np.uint32)]
    launch("pk_t_match_reduce", 1, 64, v, *outs)
    many, mall, pred, ssum, smin, uor = outs
    for w in range(2):
        lanes = v[w * 32 : (w + 1) * 32]
        par = lanes & 1
        for l in range(32):
            t = w * 32 + l
            assert many[t] == sum(1 << k for k in range(32) if lanes[k] == lanes[l])
            same = bool((par == par[0]).all())
            assert (mall[t], pred[t]) == ((0xFFFFFFFF, 1) if same else (0, 0))
            assert ssum[t] == lanes.sum() and smin[t] == lanes.min() - 5
            assert uor[t] == np.bitwise_or.reduce(np.uint32(1) << lanes.astype(np.uint32))


def test_syncthreads_count_and_or() -> None:
    for pred in (np.zeros(96, np.int32), np.ones(96, np.int32), (np.arange(96) % 3 == 0).astype(np.int32)):
        count, alls, anys = (np.zeros(96, np.int32) for _ in range(3))
        launch("pk_t_sync_count", 1, 96, pred, count, alls, anys)
        assert (count == pred.sum()).all()
        assert (alls == int(pred.all())).all()
        assert (anys == int(pred.any())).all()


@pytest.mark.parametrize("n_active", [1, 31, 33, 100, 128])
def test_barrier_with_threads_that_returned_early(n_active: int) -> None:
    x = np.arange(3 * 128, dtype=np.float32)
    out = np.full_like(x, -1.0)
    launch("pk_t_early_exit", 3, 128, x, out, n_active)
    for b in range(3):
        row = x[b * 128 : b * 128 + n_active]
        np.testing.assert_array_equal(out[b * 128 : b * 128 + n_active], row[::-1])
        assert (out[b * 128 + n_active : (b + 1) * 128] == -1.0).all()


def test_every_atomic() -> None:
    blocks, threads = 3, 64
    n = blocks * threads
    ic = np.array([0, -5, 5, 0, 0, 0, 77], np.int32)
    uc = np.array([0, 0, 0xFFFFFFFF, 5, 0, 0xFFFFFFFF, 0], np.uint32)
    fc = np.array([0.0, -1.0, 1.0, 0.0, 9.0, 0.0, 0.0], np.float32)
    dc = np.array([1.0], np.float64)
    launch("pk_t_atomics", blocks, threads, ic, uc, fc, dc)
    assert ic[0] == n
    assert ic[1] == n - 1
    assert ic[2] == -(n - 1)
    assert ic[3] == -2 * n
    assert ic[4] == 3 * n
    assert ic[5] == 77 + 1000 and ic[6] == 1234
    assert uc[0] == 2 * n
    assert uc[1] == 3 * (n - 1)
    assert uc[2] == 5
    assert uc[3] == 0xDEAD  # g == 5 swapped it; later g never equals 0xdead
    assert uc[4] == 99
    assert uc[5] == 0 and uc[6] == 0xFFFFFFFF
    assert fc[0] == 0.5 * n
    assert fc[1] == (n - 1) * 0.25
    assert fc[2] == -(n - 1) * 0.5
    assert fc[3] == 9.0 and fc[4] == 2.5
    assert fc[5] == 1.0 and fc[6] == 1.0  # forward: thread 0 of block 0 wins the CAS, nobody else
    assert dc[0] == 1.0 + 0.125 * n


@pytest.mark.parametrize("n,threads", [(100, 32), (256, 256), (1000, 128)])
def test_dynamic_shared_memory(n: int, threads: int) -> None:
    blocks = 3
    x = np.random.default_rng(n).standard_normal(blocks * n).astype(np.float32)
    out = np.zeros_like(x)
    launch("pk_t_dyn_smem", blocks, threads, x, out, n, shared_mem=4 * n)
    exp = x.reshape(blocks, n)[:, ::-1] + np.arange(blocks, dtype=np.float32)[:, None]
    np.testing.assert_array_equal(out.reshape(blocks, n), exp)


def test_dynamic_shared_memory_aligned_bytes_as_float4() -> None:
    x = np.arange(64 * 4, dtype=np.float32)
    out = np.zeros_like(x)
    launch("pk_t_dyn_smem_vec", 1, 64, x, out, shared_mem=64 * 16)
    np.testing.assert_array_equal(out, x[::-1])


def test_pk_common_helpers() -> None:
    rows, n = 5, 333
    x = np.random.default_rng(1).standard_normal((rows, n)).astype(np.float32)
    x[2, 7] = np.float32(1.00390625)  # exactly halfway between two bf16 values: rounds to even
    sums, maxes = np.zeros(rows, np.float32), np.zeros(rows, np.float32)
    bf = np.zeros((rows, n), np.uint16)
    launch("pk_t_common", rows, 128, x, sums, maxes, bf, n)
    np.testing.assert_allclose(sums, x.astype(np.float64).sum(1), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(maxes, x.max(1))
    import ml_dtypes

    np.testing.assert_array_equal(bf, x.astype(ml_dtypes.bfloat16).view(np.uint16))


def test_float_and_integer_intrinsics() -> None:
    x = np.linspace(-4, 4, 77, dtype=np.float32)
    out = np.zeros(77 * 20, np.float32)
    launch("pk_t_math", 2, 64, x, out, 77)
    o = out.reshape(77, 20).astype(np.float64)
    v = x.astype(np.float64)
    a = np.abs(v) + 0.5
    ref = [
        np.exp(v), np.exp(v), np.exp2(v), np.log(a), np.log(a), 1 / np.sqrt(a), np.sqrt(a),
        np.maximum(v, 0.25), np.minimum(v, 0.25), v / a, np.tanh(v), v * a + 1, -v,
        np.rint((np.abs(x) + np.float32(0.5)) * np.float32(3)),
        np.minimum(-3, np.trunc(v * 4)), np.maximum(2, np.trunc(v * 4)), np.minimum(7, np.trunc(a * 4)),
        np.log2(a) + a**1.5, np.clip(v, 0, 1),
        [bin(k).count("1") + (32 - (k + 1).bit_length()) for k in range(77)],
    ]
    for k, r in enumerate(ref):
        np.testing.assert_allclose(o[:, k], np.asarray(r, np.float64), rtol=2e-6, atol=1e-6, err_msg=f"column {k}")


def test_vector_types() -> None:
    x = np.arange(32 * 4, dtype=np.float32)
    u = np.arange(32 * 4, dtype=np.uint32) * 3
    out, uo = np.zeros(64, np.float32), np.zeros(64, np.uint32)
    launch("pk_t_vec", 1, 32, x, out, u, uo)
    q = x.reshape(32, 4)
    np.testing.assert_array_equal(out.reshape(32, 2), np.stack([q[:, 0] + q[:, 1], q[:, 2] * q[:, 3]], 1))
    w = u.reshape(32, 4)
    np.testing.assert_array_equal(uo.reshape(32, 2), np.stack([w[:, 0] ^ w[:, 1], w[:, 2] + w[:, 3]], 1))


def test_three_dimensional_geometry() -> None:
    grid, block = (2, 3, 2), (8, 4, 2)
    nt, nb = 64, 12
    out = np.zeros(nb * nt * 10, np.int32)
    pykern.launch("pk_t_dims", grid, block, out, backend="host")
    o = out.reshape(nb, nt, 10)
    for bz in range(2):
        for by in range(3):
            for bx in range(2):
                b = bx + 2 * (by + 3 * bz)
                for tz in range(2):
                    for ty in range(4):
                        for tx in range(8):
                            t = tx + 8 * (ty + 4 * tz)
                            assert list(o[b, t]) == [tx, ty, tz, bx, by, bz, 80402, 20302, t - t % 32, 32]


def test_device_arrays_are_refused_naming_the_argument() -> None:
    class FakeDeviceArray:
        __cuda_array_interface__ = {"shape": (32,), "typestr": "<f4", "data": (1 << 40, False), "version": 3}

    with pytest.raises(TypeError, match=r"pk_t_inb: argument 0 \(float\* out\): the host backend takes NumPy arrays"):
        launch("pk_t_inb", 1, 32, FakeDeviceArray(), 32)


# ---- schedules ------------------------------------------------------------------
def _race(fix: int, schedule: str, monkeypatch: pytest.MonkeyPatch) -> np.ndarray:
    """Per thread: the block sum of x and of x*x (pk_t_race), as one (2, 4, 256) array."""
    monkeypatch.setenv("PYKERN_HOST_SCHEDULE", schedule)
    x = np.random.default_rng(3).standard_normal((4, 256)).astype(np.float32)
    a, b = np.zeros_like(x), np.zeros_like(x)
    launch("pk_t_race", 4, 256, x, a, b, fix)
    return np.stack([a, b])


def _race_expected() -> np.ndarray:
    x = np.random.default_rng(3).standard_normal((4, 256)).astype(np.float64)
    return np.stack([np.repeat(x.sum(1)[:, None], 256, 1), np.repeat((x**2).sum(1)[:, None], 256, 1)])


def test_missing_barrier_differs_between_forward_and_reverse(monkeypatch: pytest.MonkeyPatch) -> None:
    fwd, rev = _race(0, "forward", monkeypatch), _race(0, "reverse", monkeypatch)
    assert not np.allclose(fwd, rev, rtol=1e-3, atol=1e-3)
    # Forward lets warp 0 run ahead and clobber the scratch later warps still read.
    assert not np.allclose(fwd, _race_expected(), rtol=1e-3, atol=1e-3)


def test_fixed_barrier_agrees_under_every_schedule(monkeypatch: pytest.MonkeyPatch) -> None:
    for schedule in ("forward", "reverse", "random:1", "random:12345"):
        np.testing.assert_allclose(_race(1, schedule, monkeypatch), _race_expected(), rtol=1e-5, atol=1e-5,
                                   err_msg=schedule)


def test_random_schedule_exposes_the_race_too(monkeypatch: pytest.MonkeyPatch) -> None:
    exp = _race_expected()
    assert all(not np.allclose(_race(0, f"random:{s}", monkeypatch), exp, rtol=1e-3, atol=1e-3) for s in range(3))


def test_random_schedule_is_reproducible(monkeypatch: pytest.MonkeyPatch) -> None:
    # Even a racy kernel gives bit-identical results for the same seed.
    np.testing.assert_array_equal(_race(0, "random:5", monkeypatch), _race(0, "random:5", monkeypatch))


@pytest.mark.parametrize("bad", ["backwards", "random", "random:x", "random:-1", "forward:3"])
def test_bad_schedule_is_an_argument_error(bad: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYKERN_HOST_SCHEDULE", bad)
    with pytest.raises(ArgumentError, match="PYKERN_HOST_SCHEDULE"):
        launch("pk_t_inb", 1, 32, np.zeros(32, np.float32), 32)


# ---- errors (each names kernel, block and thread) --------------------------------------
@pytest.mark.parametrize("schedule", ["forward", "reverse", "random:7"])
@pytest.mark.parametrize(
    "kernel,pattern",
    [
        ("pk_t_err_deadlock", r"__syncwarp\(mask 0xffffffff\) at .*emu\.cu:\d+ can never complete: lane 0 .* waits at __syncthreads\(\) at .*emu\.cu"),
        ("pk_t_err_exited_read", r"__shfl_xor_sync\(mask 0xffffffff\) at .*emu\.cu:\d+ reads the value of lane (1[6-9]|2\d|3[01]), which has exited"),
        ("pk_t_err_partial", r"__syncthreads\(\) at .*emu\.cu:\d+ reached by only part of the block: thread \(\d+,0,0\) waits at __syncthreads\(\) at .*emu\.cu:\d+ instead"),
        ("pk_t_err_self", r"__shfl_sync\(mask 0x00000001\) at .*emu\.cu:\d+: the mask does not name the calling lane"),
        ("pk_t_err_width", r"width must be a power of 2 in 1\.\.32, got 3"),
    ],
)
def test_runtime_errors(kernel: str, pattern: str, schedule: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYKERN_HOST_SCHEDULE", schedule)
    with pytest.raises(KernelExecutionError, match=pattern) as ei:
        launch(kernel, 2, 128, np.zeros(128, np.float32))
    msg = str(ei.value)
    # Blocks run in the schedule's order too: reverse starts with the last block.
    first = {"forward": "0", "reverse": "1"}.get(schedule, "[01]")
    assert re.match(rf"kernel {kernel}: block \({first},0,0\)", msg), msg
    assert "thread (" in msg


def test_device_assert_is_an_error_not_an_abort() -> None:
    with pytest.raises(KernelExecutionError, match=r"block \(0,0,0\): thread \(9,0,0\).*assertion `threadIdx.x != 9` failed"):
        launch("pk_t_err_assert", 1, 32, np.zeros(32, np.float32))


def test_trap_names_block_and_thread_and_the_next_launch_still_works() -> None:
    with pytest.raises(KernelExecutionError, match=r"kernel pk_t_err_trap: block \(1,0,0\): thread \(5,0,0\).*__trap"):
        launch("pk_t_err_trap", 3, 64, np.zeros(64, np.float32))
    out = np.zeros(64, np.float32)
    launch("pk_t_inb", 2, 32, out, 64)
    assert (out == 1).all()
