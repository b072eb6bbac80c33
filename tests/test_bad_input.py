"""Inputs that used to give a plausible but wrong answer: each is now an error naming the argument (host
arrays, checked before any launch) or a defined result (device arrays, which are never read on the host)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from family_helpers import need as _need  # noqa: E402
from pykern import ArgumentError, ops  # noqa: E402
from pykern.difftest.cases.serving import make_paged  # noqa: E402


# --------------------------------------------------------------------------- get_batch_indices_positions
def test_batch_indices_positions_host_result() -> None:
    bi, pos = ops.get_batch_indices_positions(np.array([0, 2, 2, 5]), np.array([6, 4, 3]), 5)
    assert bi.tolist() == [0, 0, 2, 2, 2] and pos.tolist() == [4, 5, 0, 1, 2]
    assert bi.dtype == np.int32 and pos.dtype == np.int32


@pytest.mark.parametrize("nnz", [7, 4])
def test_batch_indices_positions_nnz_must_match_the_indptr(nnz: int) -> None:
    # nnz=7 used to pad two tokens as (sequence 0, position 0): the append then overwrote sequence 0's first token
    with pytest.raises(ArgumentError, match=rf"nnz: expected append_indptr\[-1\]=5 .*got {nnz}"):
        ops.get_batch_indices_positions([0, 2, 5], [2, 3], nnz=nnz)


def test_batch_indices_positions_rejects_negative_and_short_lengths() -> None:
    with pytest.raises(ArgumentError, match=r"seq_lens: expected lengths >= 0, got seq_lens\[0\]=-1"):
        ops.get_batch_indices_positions([0, 0, 3], [-1, 3], nnz=3)
    # 2 tokens appended to a sequence of length 1 after the append: positions -1, 0
    with pytest.raises(ArgumentError, match=r"seq_lens: .*got seq_lens\[0\]=1 for 2 appended tokens"):
        ops.get_batch_indices_positions([0, 2, 5], [1, 3], nnz=5)
    with pytest.raises(ArgumentError, match=r"append_indptr: expected a non-decreasing array"):
        ops.get_batch_indices_positions([0, 3, 2], [3, 3], nnz=2)
    with pytest.raises(ArgumentError, match=r"seq_lens: expected shape \(2,\)"):
        ops.get_batch_indices_positions([0, 2, 5], [2, 3, 4], nnz=5)


def test_append_skips_padding_tokens_marked_minus_one() -> None:
    _need("host")
    rng = np.random.default_rng(3)
    pc = make_paged(rng, [3, 2], 4, 1, 8)
    kp, vp = pc["k_pages"].copy(), pc["v_pages"].copy()
    k_new = rng.standard_normal((3, 1, 8)).astype(np.float32)
    # token 0 rewrites sequence 1's last slot; tokens 1, 2 are padding (batch -1)
    ops.append_paged_kv_cache(k_new, k_new, np.array([1, -1, -1]), np.array([1, -1, 0]), kp, vp, pc["kv_indices"],
                              pc["kv_indptr"], pc["kv_last_page_len"], backend="host")
    page1 = pc["kv_indices"][pc["kv_indptr"][1]]
    np.testing.assert_array_equal(kp[page1, 1], k_new[0])
    kp[page1, 1] = pc["k_pages"][page1, 1]
    np.testing.assert_array_equal(kp, pc["k_pages"])  # nothing else moved: sequence 0's token 0 included
    with pytest.raises(ArgumentError, match=r"batch_indices: .*or -1 for a padding token, got batch_indices\[1\]=-2"):
        ops.append_paged_kv_cache(k_new, k_new, np.array([1, -2, -1]), np.array([1, 0, 0]), kp, vp,
                                  pc["kv_indices"], pc["kv_indptr"], pc["kv_last_page_len"], backend="host")


_DEVICE_CHILD = r"""
import numpy as np
from numba import cuda
from pykern import ops
from pykern.difftest.cases.serving import make_paged

ip = cuda.to_device(np.array([0, 2, 2, 5], np.int32))
sl = cuda.to_device(np.array([2, 9, 1], np.int32))
for be in ("host", "numba"):
    bi, pos = ops.get_batch_indices_positions(ip, sl, 8, backend=be)
    assert type(bi).__module__.startswith("numba."), type(bi)
    # sequence 1 appends nothing; sequence 2 appends 3 tokens but has length 1 (two would be negative);
    # tokens 5..7 lie past append_indptr[-1] (padding)
    assert bi.copy_to_host().tolist() == [0, 0, -1, -1, 2, -1, -1, -1], (be, bi.copy_to_host())
    assert pos.copy_to_host().tolist() == [0, 1, -1, -1, 0, -1, -1, -1], (be, pos.copy_to_host())

# the padded helper output feeds the append: the padding tokens land nowhere
rng = np.random.default_rng(0)
pc = make_paged(rng, [2, 1], 4, 1, 8)
ip = cuda.to_device(np.array([0, 2, 3], np.int32))
bi, pos = ops.get_batch_indices_positions(ip, cuda.to_device(np.array([2, 1], np.int32)), 5, backend="host")
kp, vp = pc["k_pages"].copy(), pc["v_pages"].copy()
new = np.full((5, 1, 8), 99.0, np.float32)
ops.append_paged_kv_cache(new, new, bi, pos, kp, vp, pc["kv_indices"], pc["kv_indptr"], pc["kv_last_page_len"],
                          backend="host")
p0, p1 = pc["kv_indices"][0], pc["kv_indices"][1]
assert (kp[p0, :2] == 99).all() and (kp[p1, 0] == 99).all()
assert np.array_equal(np.isnan(kp), np.isnan(pc["k_pages"])), "a padding token was written"
assert int((kp == 99).sum()) == 3 * 8, int((kp == 99).sum())
print("ok")
"""


def test_batch_indices_positions_on_device_marks_padding() -> None:
    # Device index arrays are never read on the host: the kernel marks what it cannot place with -1, -1.
    # numba's simulator arrays stand in for device memory; it must be chosen before numba.cuda is imported.
    _need("host")
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", PYTHONPATH=str(Path(__file__).resolve().parent.parent))
    r = subprocess.run([sys.executable, "-c", _DEVICE_CHILD], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout[-2000:] + r.stderr[-4000:]


# --------------------------------------------------------------------------- lengths of the other ops
def test_negative_or_decreasing_lengths_name_the_argument() -> None:
    _need("host")
    q = np.zeros((4, 8), np.float32)
    cache = np.zeros((16, 2, 8), np.float32)
    with pytest.raises(ArgumentError, match=r"seq_len: expected 0 <= seq_len <= 16, got -1"):
        ops.decode_attention(q, cache, cache, -1, kv_layout="NHD", backend="host")
    with pytest.raises(ArgumentError, match=r"seq_len: expected every length in \[0, max_seq_len=16\], got -1"):
        ops.decode_attention(q, cache, cache, np.array([-1]), kv_layout="NHD", backend="host")
    bq = np.zeros((2, 4, 8), np.float32)
    bcache = np.zeros((2, 16, 2, 8), np.float32)
    with pytest.raises(ArgumentError, match=r"seq_lens: expected every length in \[0, max_seq_len=16\], got -3"):
        ops.batched_decode_attention(bq, bcache, bcache, np.array([4, -3]), kv_layout="NHD", backend="host")
    pages = np.zeros((4, 4, 1, 8), np.float32)
    pq = np.zeros((2, 1, 8), np.float32)
    with pytest.raises(ArgumentError, match=r"kv_last_page_len: .*got kv_last_page_len\[0\]=-1"):
        ops.paged_decode_attention(pq, pages, pages, np.array([0, 1, 2]), np.array([0, 1]), np.array([-1, 2]),
                                   backend="host")
    with pytest.raises(ArgumentError, match=r"kv_indptr: expected a non-decreasing array, got kv_indptr\[1\]=2"):
        ops.paged_decode_attention(pq, pages, pages, np.array([0, 2, 1]), np.array([0, 1]), np.array([1, 2]),
                                   backend="host")
    kv = np.zeros((6, 1, 8), np.float32)
    with pytest.raises(ArgumentError, match=r"cu_seqlens_q: expected a non-decreasing array"):
        ops.flash_attention_varlen(pq, kv, kv, np.array([0, 3, 2]), np.array([0, 4, 6]), backend="host")
    with pytest.raises(ArgumentError, match=r"cu_seqlens_k: expected a non-decreasing array"):
        ops.flash_attention_varlen(pq, kv, kv, np.array([0, 1, 2]), np.array([0, 4, 3]), backend="host")
    with pytest.raises(ArgumentError, match=r"qo_indptr: expected a non-decreasing array"):
        ops.paged_prefill_attention(pq, np.array([0, 3, 2]), pages, pages, np.array([0, 1, 2]), np.array([0, 1]),
                                    np.array([1, 2]), backend="host")


# --------------------------------------------------------------------------- shape errors say what is expected
@pytest.mark.parametrize("call, pattern", [
    # a q of the wrong rank: the message names the axes a right one has
    (lambda: ops.flash_attention(np.zeros((2, 3, 4, 5, 1), np.float32), np.zeros((2, 3, 4, 5), np.float32),
                                 np.zeros((2, 3, 4, 5), np.float32)),
     r"q: expected a 4-D array \(batch, n_q, num_heads, head_dim\), got shape \(2, 3, 4, 5, 1\)"),
    # a k whose head_dim differs from q's
    (lambda: ops.flash_attention(np.zeros((1, 3, 2, 8), np.float32), np.zeros((1, 3, 2, 4), np.float32),
                                 np.zeros((1, 3, 2, 4), np.float32)),
     r"k: expected shape \(batch, n_k, num_kv_heads, head_dim\) = \(1, n_k, num_kv_heads, 8\) .*got \(1, 3, 2, 4\)"),
    (lambda: ops.decode_attention(np.zeros((2, 3, 4, 5), np.float32), np.zeros((16, 2, 5), np.float32),
                                  np.zeros((16, 2, 5), np.float32), 3),
     r"q: expected a 2-D array \(num_heads, head_dim\), got shape \(2, 3, 4, 5\)"),
    (lambda: ops.decode_attention(np.zeros((4, 8), np.float32), np.zeros((1, 16, 2, 8), np.float32),
                                  np.zeros((1, 16, 2, 8), np.float32), 3),
     r"k_cache: expected a 3-D array \(max_seq_len, num_kv_heads, head_dim\) \(kv_layout='NHD'\), "
     r"got shape \(1, 16, 2, 8\)"),
    (lambda: ops.decode_attention(np.zeros((4, 8), np.float32), np.zeros((16, 2, 4), np.float32),
                                  np.zeros((16, 2, 4), np.float32), 3),
     r"k_cache: expected \(max_seq_len, num_kv_heads, head_dim\) \(kv_layout='NHD'\) with head_dim 8 \(from q\), "
     r"got shape \(16, 2, 4\)"),
    (lambda: ops.paged_decode_attention(np.zeros((2, 4, 8), np.float32), np.zeros((6, 5, 8), np.float32),
                                        np.zeros((6, 5, 8), np.float32), np.array([0, 1, 2]), np.array([0, 1]),
                                        np.array([1, 1])),
     r"k_pages: expected a 4-D array \(num_pages, page_size, num_kv_heads, head_dim\) \(kv_layout='NHD'\), "
     r"got shape \(6, 5, 8\)"),
    (lambda: ops.paged_decode_attention(np.zeros((2, 4), np.float32), np.zeros((6, 5, 2, 8), np.float32),
                                        np.zeros((6, 5, 2, 8), np.float32), np.array([0, 1, 2]), np.array([0, 1]),
                                        np.array([1, 1])),
     r"q: expected a 3-D array \(batch, num_heads, head_dim\), got shape \(2, 4\)"),
    (lambda: ops.rms_norm(np.zeros((3, 8), np.float32), np.ones(6, np.float32)),
     r"weight: expected shape \(hidden,\) = \(8,\) \(x's last axis\), got \(6,\)"),
    (lambda: ops.rope(np.zeros((4, 8), np.float32), np.ones((16, 4), np.float32), np.ones((16, 4), np.float32)),
     r"x: expected a 3-D array \(n_tokens, num_heads, head_dim\) or a 4-D array "
     r"\(batch, n_tokens, num_heads, head_dim\), got shape \(4, 8\)"),
    (lambda: ops.rope(np.zeros((4, 2, 8), np.float32), np.ones(16, np.float32), np.ones(16, np.float32)),
     r"cos: expected a 2-D array \(max_pos, 4\) or \(max_pos, 8\), got shape \(16,\)"),
])
def test_shape_errors_name_the_expected_layout(call, pattern) -> None:
    _need("host")
    with pytest.raises(ArgumentError, match=pattern):
        call()
