"""pykern.arrays.host_view of CPU torch tensors: a zero-copy NumPy view that leaves the tensor's
storage resizable (FSDP2 frees parameters by resizing their storage to 0; Tensor.numpy() forbids it)."""
from __future__ import annotations

import gc

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from pykern import arrays, ops  # noqa: E402
from pykern.errors import ArgumentTypeError  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_storage_stays_resizable_after_a_view_and_an_op(dtype):
    t = (torch.randn(4, 8) * 10).to(dtype)
    v = arrays.host_view(t)
    assert v.ctypes.data == t.data_ptr()
    del v
    if dtype != torch.int64:
        ops.rms_norm(t, torch.ones(8, dtype=dtype), backend="host")
    t.untyped_storage().resize_(0)  # raises "not resizable" after Tensor.numpy()
    assert t.untyped_storage().nbytes() == 0
    t.untyped_storage().resize_(4 * 8 * t.element_size())  # and back, as FSDP2 does before the next forward


def test_parameter_storage_resizable_after_torch_layer_op():
    import pykern.torch as pt

    w = torch.nn.Parameter(torch.randn(8))
    x = torch.randn(3, 8, requires_grad=True)
    pt.rms_norm(x, w).sum().backward()
    w.untyped_storage().resize_(0)
    x.untyped_storage().resize_(0)


def test_strided_offset_views_share_memory_and_are_writeable():
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    t = base[1:, 1::2].T  # storage offset, non-unit strides, transposed
    v = arrays.host_view(t)
    np.testing.assert_array_equal(v, t.numpy())
    assert v.ctypes.data == t.data_ptr() and v.flags.writeable and not v.flags.c_contiguous
    v[0, 1] = -1.0
    assert base[2, 1].item() == -1.0


def test_bf16_is_the_same_bits_and_writes_through():
    t = torch.randn(5, 3).bfloat16()
    v = arrays.host_view(t)
    assert v.dtype == arrays.bfloat16() and v.ctypes.data == t.data_ptr()
    np.testing.assert_array_equal(v.view(np.int16), t.view(torch.int16).numpy())
    v[1, 2] = 3.5
    assert t[1, 2].item() == 3.5


def test_view_keeps_the_tensor_alive():
    v = arrays.host_view(torch.full((1000,), 7.0))
    gc.collect()
    torch.zeros(1000)  # would reuse freed memory
    assert (v == 7.0).all()


def test_zero_element_and_scalar_tensors():
    assert arrays.host_view(torch.empty(0, 3)).shape == (0, 3)
    assert arrays.host_view(torch.empty(0, dtype=torch.bfloat16)).dtype == arrays.bfloat16()
    s = arrays.host_view(torch.tensor(2.5))
    assert s.shape == () and s[()] == 2.5


def test_bad_tensors_name_the_problem():
    with pytest.raises(ArgumentTypeError, match="conjugate"):
        arrays.host_view(torch.randn(3, dtype=torch.complex64).conj())
    with pytest.raises(ArgumentTypeError, match="layout"):
        arrays.host_view(torch.eye(3).to_sparse())
