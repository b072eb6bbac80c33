"""What a serving step does besides its kernel launches, on a machine without a GPU.

A step that is to be captured in one CUDA graph (and replayed without host work) may launch kernels and
nothing else: no memory allocation (a fresh output each call would be another address each replay), no
synchronisation and no host read of a device value (a capture refuses both, and eagerly they stall the host
behind the GPU). `StepAudit` records, while a step runs inside `tools/bench_launch.py`'s `stubbed_gpu` (the
nvrtc backend over the test suite's fake driver, cuLaunchKernel stubbed, CPU tensors treated as device memory):

- every driver call the backend makes (`driver`: anything but a kernel launch, e.g. mem_alloc, memcpy_dtoh_async,
  stream_synchronize, event_synchronize), and the kernels launched (`kernels`);
- every torch op that makes new memory (`alloc`: an output whose storage is none of the inputs' —
  torch.empty, a .contiguous() or .to() copy, an expand().contiguous() —, seen through a TorchDispatchMode),
  and every host array placed next to the device ones (`alloc` too: torch.as_tensor / torch.tensor /
  torch.from_numpy, a host-to-device copy on a GPU);
- every synchronising torch op (`sync`: aten._local_scalar_dense behind .item() / int() / float(), is_nonzero
  behind bool(), equal);
- every host read of a tensor (`host_read`: Tensor.numpy / tolist / cpu / __array__, pykern's
  arrays.host_view). On CPU tensors `.cpu()` dispatches nothing, so it is caught at the Python method.

`audit.problems()` lists the events of all kinds but `launch`; a capturable step has none.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

import bench_launch  # noqa: E402

aten = torch.ops.aten

# Ops that read a device value into the host: a stream synchronisation on a GPU, refused under capture.
SYNC_OPS = {aten._local_scalar_dense.default, aten.is_nonzero.default, aten.equal.default, aten.item.default}

# Python-level reads of a tensor's values that dispatch nothing on a CPU tensor.
HOST_READS = ("numpy", "tolist", "cpu", "__array__")

# Host arrays becoming tensors: on a GPU a host-to-device copy into fresh memory.
HOST_TO_DEVICE = ("as_tensor", "tensor", "from_numpy")


_INHERITED = object()


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class _TorchOps(TorchDispatchMode):
    def __init__(self, record: Callable[[str, str], None]) -> None:
        super().__init__()
        self.record = record

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in SYNC_OPS:
            self.record("sync", str(func))
        out = func(*args, **kwargs)
        flat_in, _ = tree_flatten((args, kwargs))
        seen = {_storage(a) for a in flat_in if isinstance(a, torch.Tensor)}
        flat_out, _ = tree_flatten(out)
        for o in flat_out:
            if isinstance(o, torch.Tensor) and o.untyped_storage().nbytes() and _storage(o) not in seen:
                self.record("alloc", f"{func} -> {tuple(o.shape)} {o.dtype}")
                break
        return out


class StepAudit:
    """Inside a `stubbed_gpu` context: `with audit: step()` records what the step does (see the module doc)."""

    def __init__(self, gpu: "bench_launch.stubbed_gpu | None") -> None:
        """gpu: the stubbed_gpu context the step runs in; None for a step on the CPU backends (host, numba), whose
        driver is not there and whose kernels read tensors through arrays.host_view by design (not recorded)."""
        self.gpu = gpu
        self.events: list[tuple[str, str]] = []
        self._saved: list[tuple[Any, str, Any]] = []

    def record(self, kind: str, what: str) -> None:
        self.events.append((kind, what))

    @property
    def kernels(self) -> list[str]:
        return [w for k, w in self.events if k == "launch"]

    def problems(self) -> list[tuple[str, str]]:
        """Every event but the launches: what keeps the step from being one CUDA graph."""
        return [e for e in self.events if e[0] != "launch"]

    def _patch(self, owner: Any, name: str, new: Any) -> None:
        # (an attribute the owner only inherits is deleted again afterwards, not pinned on it)
        self._saved.append((owner, name, vars(owner).get(name, _INHERITED)))
        setattr(owner, name, new)

    def __enter__(self) -> "StepAudit":
        from pykern import arrays

        self.events = []
        rec = self.record
        if self.gpu is not None:
            drv, be = self.gpu.driver, self.gpu.backend
            self._patch(drv, "_call", lambda name, *a: None if name == "launch_kernel" else rec("driver", name))
            real_launch = be.launch
            self._patch(be, "launch",
                        lambda spec, *a, **kw: (rec("launch", spec.name), real_launch(spec, *a, **kw))[1])
        for name in HOST_READS:
            real = getattr(torch.Tensor, name)
            self._patch(torch.Tensor, name, self._reader(name, real))
        for name in HOST_TO_DEVICE:
            real = getattr(torch, name)
            self._patch(torch, name, self._wrap("alloc", f"torch.{name} (a host array onto the device)", real))
        real_view = arrays.host_view

        def host_view(a: Any) -> Any:
            if arrays.is_torch(a):
                rec("host_read", f"pykern.arrays.host_view of a tensor {tuple(a.shape)}")
            return real_view(a)

        if self.gpu is not None:
            self._patch(arrays, "host_view", host_view)
        self._mode = _TorchOps(rec)
        self._mode.__enter__()
        return self

    def _reader(self, name: str, real: Any) -> Any:
        rec = self.record

        def read(t: Any, *a: Any, **kw: Any) -> Any:
            rec("host_read", f"Tensor.{name} {tuple(t.shape)}")
            return real(t, *a, **kw)

        return read

    def _wrap(self, kind: str, what: str, real: Any) -> Any:
        rec = self.record

        def call(*a: Any, **kw: Any) -> Any:
            rec(kind, what)
            return real(*a, **kw)

        return call

    def __exit__(self, *exc: Any) -> None:
        self._mode.__exit__(*exc)
        while self._saved:
            owner, name, old = self._saved.pop()
            if old is _INHERITED:
                delattr(owner, name)
            else:
                setattr(owner, name, old)
