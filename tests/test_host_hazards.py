"""Host backend v2: planted CUDA hazards are exposed, legal code runs (tests/host_kernels/hazards.cu)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import pykern
from pykern.errors import KernelExecutionError
from host_kernel_helpers import HOST_KERNELS, _host_kernels, launch  # noqa: F401 (an autouse fixture)


def schedule(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("PYKERN_HOST_SCHEDULE", value)


# ---- 1. block schedules -----------------------------------------------------------------
def test_accumulator_zeroed_by_block_0_is_an_inter_block_race(monkeypatch: pytest.MonkeyPatch) -> None:
    x = np.arange(1, 9, dtype=np.float32)
    acc = np.full(1, 123.0, np.float32)
    launch("pk_h_zero_then_add", 8, 32, acc, x)
    assert acc[0] == x.sum()  # index order happens to work
    schedule(monkeypatch, "reverse")
    acc[:] = 123.0
    launch("pk_h_zero_then_add", 8, 32, acc, x)
    assert acc[0] == x[0]  # block 0 runs last and wipes everyone else's sum


def test_last_block_chosen_by_index_is_exposed(monkeypatch: pytest.MonkeyPatch) -> None:
    x = np.arange(1, 7, dtype=np.float32)
    partial, out = np.zeros(6, np.float32), np.zeros(1, np.float32)
    launch("pk_h_last_block_by_index", 6, 32, partial, out, x)
    assert out[0] == 2 * x.sum()
    for sched in ("reverse", "random:3"):
        schedule(monkeypatch, sched)
        partial[:], out[:] = 0, 0
        launch("pk_h_last_block_by_index", 6, 32, partial, out, x)
        assert out[0] != 2 * x.sum(), sched


def test_float_atomic_sum_depends_on_block_order(monkeypatch: pytest.MonkeyPatch) -> None:
    x = np.array([1e8, 1.0, -1e8, 3.0, 0.5, 7.0, -2.5, 1e-3] * 4, np.float32)
    sums = set()
    for seed in range(12):
        schedule(monkeypatch, f"random:{seed}")
        acc = np.zeros(1, np.float32)
        launch("pk_h_float_atomic_order", x.size, 32, acc, x)
        sums.add(float(acc[0]))
    assert len(sums) > 1, sums


def test_block_order_is_reproducible_per_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    x = np.random.default_rng(0).standard_normal(64).astype(np.float32) * 1e4
    out = []
    for _ in range(2):
        schedule(monkeypatch, "random:77")
        acc = np.zeros(1, np.float32)
        launch("pk_h_float_atomic_order", 64, 32, acc, x)
        out.append(acc[0])
    assert out[0] == out[1]


def test_cross_block_spin_wait_finishes_when_interleaved(monkeypatch: pytest.MonkeyPatch) -> None:
    for sched in ("interleave", "interleave:5", "forward"):
        schedule(monkeypatch, sched)
        flag, data, out = np.zeros(1, np.int32), np.zeros(1, np.int32), np.zeros(1, np.int32)
        launch("pk_h_cross_block_spin", 2, 32, flag, data, out)
        assert out[0] == 42, sched


def test_cross_block_spin_wait_on_a_later_block_is_reported_not_hung(monkeypatch: pytest.MonkeyPatch) -> None:
    schedule(monkeypatch, "reverse")  # block 1 runs alone and waits for block 0 forever
    monkeypatch.setenv("PYKERN_HOST_WATCHDOG_S", "0.3")
    flag, data, out = np.zeros(1, np.int32), np.zeros(1, np.int32), np.zeros(1, np.int32)
    with pytest.raises(KernelExecutionError, match=r"kernel pk_h_cross_block_spin: block \(1,0,0\): thread \(0,0,0\).*PYKERN_HOST_WATCHDOG_S"):
        launch("pk_h_cross_block_spin", 2, 32, flag, data, out)


@pytest.mark.parametrize("sched", ["forward", "reverse", "random:9", "interleave", "interleave:2"])
def test_static_shared_memory_is_per_block(sched: str, monkeypatch: pytest.MonkeyPatch) -> None:
    schedule(monkeypatch, sched)
    blocks, threads = 6, 64
    out = np.zeros(1 + blocks * threads, np.int32)
    launch("pk_h_static_smem_per_block", blocks, threads, out)
    t = np.arange(threads)
    exp = (np.arange(blocks)[:, None] * 1000 + (t[None, :] + 1) % threads).ravel()
    np.testing.assert_array_equal(out[1:], exp)


# ---- 5. static shared memory is poisoned at every block start ------------------------------
def test_uninitialised_static_shared_reads_poison_every_launch() -> None:
    x = np.ones(4, np.float32)
    for _ in range(2):  # not 0 on the first launch, not a leftover on the second
        out = np.zeros(4, np.float32)
        launch("pk_h_uninit_static", 4, 32, x, out)
        assert np.isnan(out).all()


# ---- 6. legal code runs -----------------------------------------------------------------------
def test_full_mask_shuffle_after_lanes_exited_is_legal() -> None:
    out = np.full(128, -1.0, np.float32)
    launch("pk_t_err_mask", 1, 128, out)
    t = np.arange(128)
    live = (t % 32) < 16
    np.testing.assert_array_equal(out[live], (t + (t ^ 1))[live].astype(np.float32))
    assert (out[~live] == -1).all()


@pytest.mark.parametrize("sched", ["forward", "reverse", "random:4", "interleave:1"])
def test_activemask_warp_aggregated_atomic(sched: str, monkeypatch: pytest.MonkeyPatch) -> None:
    schedule(monkeypatch, sched)
    n = 128
    pred = (np.random.default_rng(2).random(n) < 0.6).astype(np.int32)
    pred[64:96] = 1  # one warp fully converged
    counter, slot, masks = np.zeros(1, np.int32), np.zeros(n, np.int32), np.zeros(n, np.uint32)
    launch("pk_h_warp_aggregated", 1, n, pred, counter, slot, masks)
    k = int(pred.sum())
    assert counter[0] == k
    assert sorted(slot[pred == 1].tolist()) == list(range(k))  # every active thread got its own slot
    for w in range(n // 32):
        lanes = pred[w * 32 : (w + 1) * 32]
        expect = sum(1 << l for l in range(32) if lanes[l])
        assert all(masks[w * 32 + l] == expect for l in range(32) if lanes[l]), (w, sched)


def test_warpsize_is_a_constant_not_a_macro() -> None:
    out = np.zeros(2, np.int32)
    launch("pk_h_warpsize", 1, 32, out)
    assert list(out) == [32, 7]


def test_spin_loop_without_meeting_point_is_reported_and_the_process_survives(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYKERN_HOST_WATCHDOG_S", "0.3")
    flag, out = np.zeros(1, np.int32), np.zeros(64, np.int32)
    with pytest.raises(KernelExecutionError, match=r"kernel pk_h_spin_forever: block \(0,0,0\): thread \(3,0,0\).*ran for more than 0.3 s"):
        launch("pk_h_spin_forever", 1, 64, flag, out)
    flag[0] = 1
    launch("pk_h_spin_forever", 1, 64, flag, out)
    assert (out == 1).all()


# ---- 4. faults are errors, not crashes ----------------------------------------------------------
def test_null_pointer_store_names_block_and_thread() -> None:
    with pytest.raises(KernelExecutionError, match=r"kernel pk_h_null_store: block \(1,0,0\): thread \(7,0,0\).*segmentation fault at address \(nil\)|0x0"):
        launch("pk_h_null_store", 2, 32, np.zeros(32, np.float32), 0)
    out = np.zeros(32, np.float32)
    launch("pk_h_null_store", 1, 32, out, 0)  # the process and the library still work
    assert (out == 2).all()


def test_160_kib_of_local_memory_fits() -> None:
    x = np.arange(64, dtype=np.float32)
    out = np.zeros(4, np.float32)
    n = 160 * 256
    launch("pk_h_local_array", 1, 4, x, out, n)
    i = np.arange(n)
    ref = (x[i % 64].astype(np.float64) + i).sum()
    np.testing.assert_allclose(out, ref, rtol=1e-4)


def test_stack_overflow_is_a_clear_error() -> None:
    with pytest.raises(KernelExecutionError, match=r"thread \(0,0,0\).*stack overflow.*PYKERN_HOST_STACK_KB"):
        launch("pk_h_huge_local_array", 1, 2, np.ones(64, np.float32), np.zeros(2, np.float32), 1 << 20)


# ---- 5. launch limits ---------------------------------------------------------------------------
def test_launch_bounds_is_enforced_before_launch() -> None:
    from pykern import registry
    from pykern.errors import ArgumentError

    assert registry.get("pk_h_bounded").max_threads == 128
    out = np.zeros(256, np.float32)
    launch("pk_h_bounded", 1, 128, out)
    assert (out[:128] == 1).all()
    for backend in ("host", "numba", "nvrtc"):  # refused before any backend is reached
        with pytest.raises(ArgumentError, match=r"__launch_bounds__\(128\).*256 threads"):
            pykern.launch("pk_h_bounded", 1, 256, out, backend=backend)


def test_static_shared_memory_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    out = np.zeros(64, np.float32)
    launch("pk_h_big_static", 1, 64, out, shared_mem=16 << 10)
    assert (out == 1).all()
    with pytest.raises(KernelExecutionError, match=r"static __shared__ memory exceeds 49152 bytes"):
        launch("pk_h_too_much_static", 1, 64, out)
    monkeypatch.setenv("PYKERN_HOST_ARCH", "sm_75")  # 64 KiB per block
    with pytest.raises(KernelExecutionError, match=r"static \(40960 bytes\) \+ dynamic \(32768 bytes\).*65536"):
        launch("pk_h_big_static", 1, 64, out, shared_mem=32 << 10)
    from pykern.errors import ArgumentError

    with pytest.raises(ArgumentError, match="shared_mem.*65536"):
        launch("pk_h_big_static", 1, 64, out, shared_mem=80 << 10)


# ---- 3. GPU numerics ------------------------------------------------------------------------------
def _fma_on_this_machine() -> bool:
    from pykern.host.build import fma_flags

    return "-ffp-contract=fast" in fma_flags()


def test_fma_contraction_like_nvrtc_and_off_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(4)
    a = rng.standard_normal(256).astype(np.float32)
    b = rng.standard_normal(256).astype(np.float32)
    out = np.zeros(256, np.float32)
    if not _fma_on_this_machine():
        pytest.skip("no FMA instructions on this CPU")
    launch("pk_h_fma_contract", 2, 128, a, b, a.copy(), b.copy(), out, 256)
    exact = a.astype(np.float64) * b.astype(np.float64)
    err = (exact - (a * b).astype(np.float64)).astype(np.float32)  # the rounding error of a*b
    assert (out != 0).sum() > 200
    assert np.array_equal(np.abs(out), np.abs(err))
    monkeypatch.setenv("PYKERN_HOST_FMA", "0")
    launch("pk_h_fma_contract", 2, 128, a, b, a.copy(), b.copy(), out, 256)
    assert (out == 0).all()


def test_fast_math_intrinsics_special_cases() -> None:
    x = np.array([80.0, np.inf, 1e-40, 2.0, -1.0, 0.0, 3e9, np.nan], np.float32)
    y = np.array([1e38, 2e38, 1.0, 1e-39, 1.0, 1.0, 1.0, 1.0], np.float32)
    out = np.zeros(x.size * 6, np.float32)
    launch("pk_h_fast_math", 1, 32, x, y, out, x.size)
    o = out.reshape(-1, 6)
    assert o[0, 0] == 0  # __fdividef(80, 1e38): 2^126 < |y| < 2^128 gives 0
    assert np.isnan(o[1, 0])  # ... and NaN for an infinite x
    assert o[2, 1] == 1 and o[2, 2] == -np.inf and o[2, 3] == np.inf  # subnormal input counts as 0
    assert o[3, 0] == np.inf  # 2 / subnormal -> 2 * rcp(0) = inf
    assert np.isnan(o[4, 2]) and np.isnan(o[4, 3])
    assert o[5, 3] == np.inf and o[5, 4] == 0
    assert o[6, 5] == 2147483647.0  # __float2int_rz saturates
    assert o[7, 5] == 0  # NaN -> 0
    np.testing.assert_allclose(o[4, 1], np.exp(-1.0), rtol=1e-6)


def test_integer_division_by_zero_gives_the_gpu_result() -> None:
    n = 6
    a = np.array([7, -7, 5, -2147483648, 9, 0], np.int32)
    b = np.array([2, 0, 0, -1, 3, 0], np.int32)
    ua = np.array([7, 8, 4000000000, 1, 9, 0], np.uint32)
    ub = np.array([2, 0, 0, 1, 0, 3], np.uint32)
    la = np.array([7, 1 << 40, -5, 3, 9, 0], np.int64)
    lb = np.array([2, 0, 0, 3, -9, 0], np.int64)
    q, r, uq, lq = np.zeros(n, np.int32), np.zeros(n, np.int32), np.zeros(n, np.uint32), np.zeros(n, np.int64)
    launch("pk_h_int_div", 1, 32, a, b, q, r, ua, ub, uq, la, lb, lq, n)
    assert list(q) == [3, -1, -1, -2147483648, 3, -1]
    assert list(r) == [1, -7, 5, 0, 0, 0]
    assert list(uq) == [3, 0xFFFFFFFF, 0xFFFFFFFF, 1, 0xFFFFFFFF, 0]
    assert list(lq) == [3, -1, -1, 1, -1, -1]


def test_mul24_and_sad_have_no_undefined_behaviour() -> None:
    a = np.array([0x7FFFFFFF, -0x80000000, 0x00800000, -5, 123456], np.int32)
    b = np.array([-0x80000000, 0x7FFFFFFF, 0x00800000, 7, -654321], np.int32)
    m, s = np.zeros(5, np.int32), np.zeros(5, np.uint32)
    launch("pk_h_mul24_sad", 1, 32, a, b, m, s, 5)

    def s24(v: int) -> int:
        v &= 0xFFFFFF
        return v - (1 << 24) if v & 0x800000 else v

    exp_m = [np.int64(s24(int(x)) * s24(int(y))).astype(np.int64) & 0xFFFFFFFF for x, y in zip(a, b)]
    assert [int(v) & 0xFFFFFFFF for v in m] == [int(v) for v in exp_m]
    assert [int(v) for v in s] == [(abs(int(x) - int(y)) + 1) & 0xFFFFFFFF for x, y in zip(a, b)]


# ---- 4. memory errors on every run ---------------------------------------------------------------
def test_out_of_bounds_write_is_caught_by_the_guard() -> None:
    out = np.zeros(100, np.float32)
    with pytest.raises(KernelExecutionError, match=r"kernel pk_h_oob_write: block \(3,0,0\): thread \(4,0,0\).*: out-of-bounds write of argument 0 \(float\* out, 400 bytes\) at byte offset 400 relative to its start \(past its end\)"):
        launch("pk_h_oob_write", 4, 32, out, 100)
    ok = np.zeros(101, np.float32)
    launch("pk_h_oob_write", 4, 32, ok, 100)
    assert (ok == 1).all()


def test_misaligned_float4_load_raises_at_the_access() -> None:
    x = np.arange(4 * 33, dtype=np.float32)
    out = np.zeros(4 * 32, np.float32)
    launch("pk_h_misaligned_float4", 1, 32, x, out, 4)  # x + 4 floats: 16-byte aligned, fine
    np.testing.assert_array_equal(out, x[4:])
    with pytest.raises(KernelExecutionError, match=r"kernel pk_h_misaligned_float4: block \(0,0,0\): thread \(0,0,0\).*misaligned"):
        launch("pk_h_misaligned_float4", 1, 32, x, out, 1)


# ---- 2. racecheck ---------------------------------------------------------------------------------
@pytest.fixture()
def racecheck(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYKERN_HOST_RACECHECK", "1")


LINE = r"hazards\.cu:\d+"


def test_racecheck_lost_update_on_global(racecheck: None) -> None:
    with pytest.raises(KernelExecutionError, match=(
        rf"kernel pk_h_lost_update: racecheck: .*race on argument 0 \(int\* counter\) at byte offset 0: "
        rf"block \(0,0,0\) thread \(\d+,0,0\) (wrote|read) at .*{LINE}, then block \(0,0,0\) thread \(\d+,0,0\) "
        rf"(wrote|read) at .*{LINE} with no __syncthreads")):
        launch("pk_h_lost_update", 1, 64, np.zeros(1, np.int32))


def test_racecheck_lost_update_on_shared_and_check_then_act(racecheck: None) -> None:
    with pytest.raises(KernelExecutionError, match=rf"racecheck: .*race on static __shared__ shared memory of block \(0,0,0\) at byte offset 0: .*{LINE}.*{LINE}"):
        launch("pk_h_lost_update_shared", 2, 64, np.zeros(2, np.int32))
    with pytest.raises(KernelExecutionError, match=rf"kernel pk_h_check_then_act: racecheck: .*{LINE}"):
        launch("pk_h_check_then_act", 1, 64, np.arange(64, dtype=np.float32), np.zeros(1, np.float32))


def test_racecheck_shuffle_is_not_a_memory_fence_but_syncwarp_is(racecheck: None) -> None:
    out = np.zeros(32, np.float32)
    with pytest.raises(KernelExecutionError, match=r"read-after-write race on static __shared__.*\(nor __syncwarp\(\)\)"):
        launch("pk_h_shuffle_fence", 1, 32, out, 0)
    launch("pk_h_shuffle_fence", 1, 32, out, 1)
    np.testing.assert_array_equal(out, (np.arange(32) + 1) % 32)


def test_racecheck_sees_each_lanes_ldmatrix_read(racecheck: None) -> None:
    # ldmatrix reads rows other lanes store: with no __syncwarp between, racecheck reports the pair (which
    # comes first depends on the schedule), the read at the wrapper, where each lane reads its own row as on
    # the GPU, not inside the collective that hands the rows out.
    out = np.zeros(32 * 4, np.uint32)
    with pytest.raises(KernelExecutionError, match=(
            r"kernel pk_h_ldmatrix_fence: racecheck: (read-after-write|write-after-read) race on static __shared__ "
            r"(.*hazards\.cu:\d+.*pk_ptx\.cuh:\d+|.*pk_ptx\.cuh:\d+.*hazards\.cu:\d+).* \(nor __syncwarp\(\)\)")):
        launch("pk_h_ldmatrix_fence", 1, 32, out, 0)
    launch("pk_h_ldmatrix_fence", 1, 32, out, 1)
    # matrix i row r is lane 8 i + r's row, (8 i + r + 1) % 32 + 1 in every element; lane l gets row l // 4
    want = [((8 * i + lane // 4 + 1) % 32 + 1) * 0x10001 for lane in range(32) for i in range(4)]
    np.testing.assert_array_equal(out, np.array(want, np.uint32))


def test_racecheck_missing_barrier_in_reduction(racecheck: None) -> None:
    x = np.zeros((4, 256), np.float32)
    with pytest.raises(KernelExecutionError, match=r"kernel pk_t_race: racecheck: .*emu\.cu:\d+"):
        pykern.launch("pk_t_race", 4, 256, x, np.zeros_like(x), np.zeros_like(x), 0, backend="host")


def test_racecheck_inter_block_race(racecheck: None) -> None:
    x = np.arange(1, 7, dtype=np.float32)
    with pytest.raises(KernelExecutionError, match=(
        r"kernel pk_h_last_block_by_index: racecheck: read-after-write race on argument 0 \(float\* partial\) at "
        r"byte offset 0: block \(0,0,0\) thread \(0,0,0\) wrote at .*, then block \(5,0,0\) thread \(0,0,0\) read at "
        r".*two blocks of one launch")):
        launch("pk_h_last_block_by_index", 6, 32, np.zeros(6, np.float32), np.zeros(1, np.float32), x)


@pytest.mark.parametrize("sched", ["forward", "reverse", "interleave", "interleave:4"])
def test_ticket_last_block_reads_partials_with_strong_loads(sched: str, racecheck: None,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    # The split-KV fixup pattern (decode_tc.cu): stores, fence, ticket; the last block fences and reads the
    # partials with pk_ld_relaxed_gpu. Right under every schedule, racecheck-clean, and the ticket is back at 0.
    schedule(monkeypatch, sched)
    x = np.arange(1, 8, dtype=np.float32)
    ticket, out = np.zeros(1, np.uint32), np.zeros(1, np.float32)
    for _ in range(2):  # a second launch finds the ticket at zero
        out[:] = 0
        launch("pk_h_ticket_sum_relaxed", 7, 32, np.zeros(7, np.float32), ticket, out, x)
        assert out[0] == 2 * x.sum() and ticket[0] == 0, sched


@pytest.mark.parametrize("sched", ["forward", "reverse", "interleave", "interleave:4"])
def test_acq_rel_ticket_last_block_reads_every_thread_s_partial(sched: str, racecheck: None,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # decode_tc.cu's split tail: every thread's stores, a barrier, thread 0's atom.acq_rel ticket (no fence);
    # the whole last block reads every block's partials with strong loads. Right, racecheck-clean, ticket at 0.
    schedule(monkeypatch, sched)
    x = np.arange(1, 8, dtype=np.float32)
    ticket, out = np.zeros(1, np.uint32), np.zeros(32, np.float32)
    want = 2 * x.sum() + 7 * np.arange(32, dtype=np.float32)
    for _ in range(2):  # a second launch finds the ticket at zero
        out[:] = 0
        launch("pk_h_ticket_sum_acq_rel", 7, 32, np.zeros(7 * 32, np.float32), ticket, out, x)
        np.testing.assert_array_equal(out, want)
        assert ticket[0] == 0, sched


def test_ticket_last_block_with_plain_loads_is_reported(racecheck: None) -> None:
    # Plain loads of the other blocks' partials: racecheck has no fence-atomic happens-before for plain
    # accesses, so it reports them (the kernels read such data with strong loads instead).
    x = np.arange(1, 8, dtype=np.float32)
    with pytest.raises(KernelExecutionError, match=r"pk_h_ticket_sum_plain: racecheck: read-after-write race on "
                                                   r"argument 0 \(float\* partial\).*two blocks of one launch"):
        launch("pk_h_ticket_sum_plain", 7, 32, np.zeros(7, np.float32), np.zeros(1, np.uint32), np.zeros(1, np.float32),
               x)


def test_racecheck_passes_correct_code_and_exempts_atomics(racecheck: None) -> None:
    x = np.random.default_rng(0).standard_normal(4 * 64).astype(np.float32)
    s = np.zeros(1, np.float32)
    launch("pk_h_clean_reduce", 4, 64, x, s)
    np.testing.assert_allclose(s[0], x.astype(np.float64).sum(), rtol=1e-5, atol=1e-5)
    counter, slot, masks = np.zeros(1, np.int32), np.zeros(64, np.int32), np.zeros(64, np.uint32)
    launch("pk_h_warp_aggregated", 1, 64, np.ones(64, np.int32), counter, slot, masks)
    assert counter[0] == 64


def test_racecheck_stress_shows_lost_updates(monkeypatch: pytest.MonkeyPatch) -> None:
    counter = np.zeros(1, np.int32)
    launch("pk_h_lost_update", 1, 64, counter)
    assert counter[0] == 64  # one thread at a time: the intended value, the bug hidden
    monkeypatch.setenv("PYKERN_HOST_RACECHECK", "stress")
    counter[0] = 0
    launch("pk_h_lost_update", 1, 64, counter)
    assert counter[0] < 64  # updates lost, as on a GPU
    out = np.zeros(2, np.int32)
    launch("pk_h_lost_update_shared", 2, 64, out)
    assert (out < 64).all()


def test_initcheck_uninitialised_shared_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYKERN_HOST_INITCHECK", "1")
    with pytest.raises(KernelExecutionError, match=rf"kernel pk_h_uninit_read: block \(0,0,0\): thread \(62,0,0\).*initcheck: read of static __shared__ shared memory at byte offset 252 at .*{LINE}"):
        launch("pk_h_uninit_read", 1, 64, np.zeros(64, np.float32))
    out = np.zeros(64, np.float32)
    launch("pk_h_clean_reduce", 1, 64, np.ones(64, np.float32), np.zeros(1, np.float32))


def test_misaligned_float4_in_the_checked_build_names_the_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYKERN_HOST_RACECHECK", "1")
    x = np.arange(4 * 33, dtype=np.float32)
    out = np.zeros(4 * 32, np.float32)
    with pytest.raises(KernelExecutionError, match=rf"thread \(0,0,0\).*misaligned 16-byte load at address .* at .*{LINE}"):
        launch("pk_h_misaligned_float4", 1, 32, x, out, 1)


@pytest.mark.parametrize("mode", ["PYKERN_HOST_RACECHECK", "PYKERN_HOST_INITCHECK"])
def test_checked_build_has_no_alignment_rule_for_aggregate_copies(monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    # 48-byte records at 48-byte steps (most not 48-byte aligned): the compiler's range hooks, not a vector
    # access. Before the fix the checked build reported "misaligned 48-byte store" (the sm_90a kernels' wgmma
    # operand record on the stack hit it under racecheck and initcheck).
    monkeypatch.setenv(mode, "1")
    x = np.arange(12 * 32, dtype=np.int32)
    out = np.zeros(12 * 32, np.int32)
    launch("pk_h_struct48_copy", 1, 32, x, out)
    np.testing.assert_array_equal(out, x)


def test_global_scratch_shared_by_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    x = np.arange(4 * 32, dtype=np.float32)
    exp = (2 * x.reshape(4, 32)[:, (np.arange(32) + 1) % 32]).ravel()
    out = np.zeros(4 * 32 + 1, np.float32)
    launch("pk_h_shared_scratch", 4, 32, x, np.zeros(32, np.float32), out)
    np.testing.assert_array_equal(out[:-1], exp)  # one block at a time hides it
    schedule(monkeypatch, "interleave")
    launch("pk_h_shared_scratch", 4, 32, x, np.zeros(32, np.float32), out)
    assert not np.array_equal(out[:-1], exp)
    schedule(monkeypatch, "forward")
    monkeypatch.setenv("PYKERN_HOST_RACECHECK", "1")
    with pytest.raises(KernelExecutionError, match=r"write-after-(write|read) race on argument 1 \(float\* scratch\).*two blocks"):
        launch("pk_h_shared_scratch", 4, 32, x, np.zeros(32, np.float32), out)


def test_inplace_op_reading_the_next_blocks_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    n = 4 * 32
    base = np.arange(n, dtype=np.float32)
    exp = np.append(base[1:], 0)
    x = base.copy()
    launch("pk_h_inplace_shift", 4, 32, x, n)
    np.testing.assert_array_equal(x, exp)  # index order: each block reads before the next writes
    schedule(monkeypatch, "reverse")
    x = base.copy()
    launch("pk_h_inplace_shift", 4, 32, x, n)
    assert not np.array_equal(x, exp)
    schedule(monkeypatch, "forward")
    monkeypatch.setenv("PYKERN_HOST_RACECHECK", "1")
    with pytest.raises(KernelExecutionError, match=r"write-after-read race on argument 0 \(float\* x\) at byte offset 128: block \(0,0,0\) thread \(31,0,0\) read.*block \(1,0,0\) thread \(0,0,0\) wrote.*two blocks"):
        launch("pk_h_inplace_shift", 4, 32, base.copy(), n)


def test_red_zone_copy_keeps_one_array_passed_twice_aliased() -> None:
    y = np.ones(32, np.float32)
    pykern.launch("pk_t_alias", 1, 32, y, y, backend="host")  # const x and y are one array
    assert (y == 10).all(), y


def test_two_shared_variables_in_one_statement_get_one_copy_per_block_each(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    # `__shared__ float a[32], b[32];` is split into two per-block arrays (it was a host build error).
    (tmp_path / "twoshared.cu").write_text(
        'extern "C" __global__ void pk_t_twoshared(float* x) {\n'
        "    __shared__ float a[32], b[32];\n"
        "    __shared__ __align__(16) int c[2][4],\n"
        "        d[3];\n"
        "    unsigned t = threadIdx.x;\n"
        "    a[t] = 1.0f + t; b[t] = 100.0f * (blockIdx.x + 1);\n"
        "    if (t < 8) c[t / 4][t % 4] = (int)t; if (t < 3) d[t] = 7;\n"
        "    __syncthreads();\n"
        "    x[blockIdx.x * 32 + t] = a[31 - t] + b[t] + c[t % 2][t % 4] + d[t % 3];\n}\n"
    )
    monkeypatch.setenv("PYKERN_KERNEL_PATH", str(tmp_path))
    x = np.zeros(64, np.float32)
    launch("pk_t_twoshared", 2, 32, x)
    t = np.arange(32)
    c = np.arange(8).reshape(2, 4)
    exp = np.concatenate([(32 - t) + 100.0 * (b + 1) + c[t % 2, t % 4] + 7 for b in (0, 1)])
    np.testing.assert_array_equal(x, exp.astype(np.float32))


def test_shared_declaration_the_host_cannot_split_is_a_clear_host_error(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from pykern.errors import CompileError

    (tmp_path / "ptrshared.cu").write_text(
        'extern "C" __global__ void pk_t_ptrshared(float* x) {\n'
        "    __shared__ float *p, q;\n"
        "    q = 1.0f; p = &q;\n    x[0] = *p;\n}\n"
    )
    monkeypatch.setenv("PYKERN_KERNEL_PATH", str(tmp_path))
    with pytest.raises(CompileError, match=r"ptrshared\.cu: .*line 2.*__shared__"):
        launch("pk_t_ptrshared", 1, 1, np.zeros(1, np.float32))
