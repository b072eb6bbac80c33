"""DTensor arguments of the pykern.torch functions (tensor parallelism, FSDP2's sharded parameters).

The kernels see plain local tensors. A function given DTensors runs in one of two ways, never
silently on a shard where the op needs more than the shard:

- local: the op is computed on each rank's shard and the result wrapped back as a DTensor with
  the inputs' placements, when the placements make that exact (elementwise ops on identically
  placed inputs; row-wise norms not sharded along the normalised axis; attention sharded on
  heads with whole GQA groups per rank, or on batch). A replicated parameter used with sharded
  rows (a norm's weight) gets a Partial gradient, summed by DTensor, as DTensor's own ops do.
- gather: otherwise (cross-entropy, the fused linear cross-entropy, embedding, a sharded
  normalised axis, Partial inputs, other meshes' layouts) every DTensor is converted explicitly
  with full_tensor(), every rank computes the whole op, and the outputs are replicated DTensors.
  Plain tensors mixed with DTensors are taken as replicated (the same on every rank).

torch.distributed.tensor is never imported here: a DTensor can only exist once it was.
"""
from __future__ import annotations

import sys
from collections import Counter
from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor

from ..errors import ArgumentError

# (function name, "local" | "gather") -> calls; lets tests check which path ran
stats: Counter = Counter()


def _dtensor_cls() -> Any:
    mod = sys.modules.get("torch.distributed.tensor")
    return getattr(mod, "DTensor", None) if mod is not None else None


def active(*ts: Any) -> bool:
    """Whether any argument is a DTensor."""
    cls = _dtensor_cls()
    return cls is not None and any(isinstance(t, cls) for t in ts)


def shard_counts(placements: Sequence[Any], mesh: Any, ndim: int) -> Optional[dict[int, int]]:
    """{tensor dim: number of shards} of plain Shard placements, or None if a placement is neither
    Replicate nor plain Shard (Partial, FSDP+TP's strided shards): then only gather is exact."""
    from torch.distributed.tensor import Replicate, Shard

    counts: dict[int, int] = {}
    for i, p in enumerate(placements):
        if type(p) is Shard:
            d = p.dim % ndim
            counts[d] = counts.get(d, 1) * mesh.size(i)
        elif not isinstance(p, Replicate):
            return None
    return counts


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, acc = [], 1
    for d in reversed(tuple(shape)):
        stride.append(acc)
        acc *= max(int(d), 1)
    return tuple(reversed(stride))


def run(name: str, fn: Callable[..., Any], args: Sequence[Any], kinds: Sequence[str], *,
        local_ok: Callable[[dict[int, int]], bool],
        out_shapes: Optional[Callable[[Sequence[Any]], Sequence[Sequence[int]]]] = None) -> Any:
    """fn(*args) for arguments some of which are DTensors; returns DTensors.

    kinds, per argument: "data" (sharded activations: all DTensors of one placement), "param"
    (a weight every rank needs whole: a replicated DTensor, or None), "const" (no gradient,
    gathered whole), "other" (not a tensor). local_ok({sharded dim: shard count}) says whether the
    data's sharding lets fn run on the local shards exactly. out_shapes(args) gives the outputs' global
    shapes (default: the first data argument's shape for every output).
    """
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    dts = [a for a in args if isinstance(a, DTensor)]
    mesh = dts[0].device_mesh
    if any(t.device_mesh != mesh for t in dts):
        raise ArgumentError(f"{name}: DTensor arguments on different device meshes")
    data = [a for a, k in zip(args, kinds) if k == "data"]
    params = [a for a, k in zip(args, kinds) if k == "param" and a is not None]
    placements = data[0].placements if data and isinstance(data[0], DTensor) else None
    local = (
        placements is not None
        and all(isinstance(d, DTensor) and d.placements == placements for d in data)
        and all(isinstance(p, DTensor) and all(isinstance(q, Replicate) for q in p.placements) for p in params)
    )
    counts = shard_counts(placements, mesh, data[0].ndim) if local else None
    local = counts is not None and local_ok(counts)
    stats[(name, "local" if local else "gather")] += 1

    if local:
        # a replicated weight used with sharded rows: each rank's gradient is a partial sum
        grad_pl = [Partial() if type(p) is Shard else Replicate() for p in placements]
        conv = {"data": lambda t: t.to_local(), "param": lambda t: t.to_local(grad_placements=grad_pl)}
    else:
        placements = [Replicate()] * mesh.ndim
        conv = {}
    call_args = []
    for a, k in zip(args, kinds):
        if isinstance(a, DTensor):
            a = conv[k](a) if k in conv else a.full_tensor()
        call_args.append(a)
    out = fn(*call_args)
    outs = out if isinstance(out, tuple) else (out,)
    if local:
        shapes = out_shapes(args) if out_shapes is not None else [data[0].shape] * len(outs)
    else:
        shapes = [o.shape for o in outs]
    wrapped = tuple(
        DTensor.from_local(o, mesh, placements, run_check=False, shape=torch.Size(s), stride=_contiguous_stride(s))
        if isinstance(o, Tensor) else o
        for o, s in zip(outs, shapes)
    )
    return wrapped if isinstance(out, tuple) else wrapped[0]


def rows_only(ndim: int) -> Callable[[dict[int, int]], bool]:
    """local_ok for row-wise ops (norms over the last axis): sharded on any dim but the last."""
    return lambda counts: (ndim - 1) not in counts


def anything(counts: dict[int, int]) -> bool:
    """local_ok for elementwise ops on identically placed inputs."""
    return True


def never(counts: dict[int, int]) -> bool:
    """local_ok for ops that need whole rows or whole batches (cross-entropy means, embedding tables)."""
    return False
