"""Difftest cases for kernels_cu/mla.cu (MLA paged decode, pykern.ops.MLAPagedDecodePlan) and its float64 NumPy
reference: bf16 and f16, 16 and 32 heads, page sizes 1 and 16, lengths 1, 17 and 200 with an empty request,
pages in shuffled order, split-KV (merged by cascade.cu's merge_states) and one split. Small: the host backend
runs each CTA's 128 threads as fibers.

The sm_90a kernel (kernels_cu/mla_sm90.cu, wgmma) has its own cases (`-sm90a` in the shape, `arch="sm_90a"`): they
play sm_90a on the host backend (pykern/difftest/cases/_sm90.py's helpers) and fail, rather than fall back to the
mma.sync kernel, when the op would not take it; numba and nvrtc report them as not applicable."""
from __future__ import annotations

from typing import Any, Iterator

import numpy as np

from ...arrays import bfloat16
from ..case import Case, register_cases


def np_mla_decode(q_nope: Any, q_pe: Any, ckv: Any, kpe: Any, kv_indptr: Any, kv_indices: Any, kv_len: Any,
                  sm_scale: float) -> tuple[np.ndarray, np.ndarray]:
    """float64 MLA decode: out (batch, heads, 512) and the natural-log lse (batch, heads); 0 / -inf when empty."""
    qn, qp = np.asarray(q_nope, np.float64), np.asarray(q_pe, np.float64)
    c, p = np.asarray(ckv, np.float64), np.asarray(kpe, np.float64)
    batch, heads, dc = qn.shape
    ps = c.shape[1]
    out = np.zeros((batch, heads, dc))
    lse = np.full((batch, heads), -np.inf)
    for b in range(batch):
        n = int(kv_len[b])
        if n == 0:
            continue
        pages = np.asarray(kv_indices)[int(kv_indptr[b]):int(kv_indptr[b + 1])]
        kc = c[pages].reshape(-1, dc)[:n]
        kp = p[pages].reshape(-1, p.shape[2])[:n]
        s = sm_scale * (qn[b] @ kc.T + qp[b] @ kp.T)  # (heads, n)
        m = s.max(1, keepdims=True)
        w = np.exp(s - m)
        out[b] = (w @ kc) / w.sum(1, keepdims=True)
        lse[b] = m[:, 0] + np.log(w.sum(1))
    return out, lse


def make_mla_inputs(rng: np.random.Generator, kind: str, lens: tuple[int, ...], heads: int, page_size: int,
                    spare_pages: int = 2) -> dict[str, Any]:
    """Random q / caches of dtype kind and a shuffled page table holding requests of the given lengths."""
    dt = bfloat16() if kind == "bf16" else np.float16
    per = [-(-n // page_size) for n in lens]
    num_pages = sum(per) + spare_pages
    order = rng.permutation(num_pages)[: sum(per)].astype(np.int32)
    indptr = np.concatenate([[0], np.cumsum(per)]).astype(np.int32)
    batch = len(lens)
    return {
        "q_nope": rng.standard_normal((batch, heads, 512)).astype(dt),
        "q_pe": rng.standard_normal((batch, heads, 64)).astype(dt),
        "ckv": rng.standard_normal((num_pages, page_size, 512)).astype(dt),
        "kpe": rng.standard_normal((num_pages, page_size, 64)).astype(dt),
        "kv_indptr": indptr, "kv_indices": order, "kv_len": np.asarray(lens, np.int32),
        "qo_indptr": np.arange(batch + 1, dtype=np.int32), "heads": heads, "page_size": page_size, "kind": kind,
    }


def run_mla(x: dict[str, Any], sm_scale: float, backend: str | None, num_splits: int | None = None) -> dict:
    from ... import ops

    plan = ops.MLAPagedDecodePlan()
    plan.plan(x["qo_indptr"], x["kv_indptr"], x["kv_indices"], x["kv_len"], x["heads"], 512, 64, x["page_size"],
              False, sm_scale, x["kind"], x["kind"], num_splits=num_splits)
    o, lse = plan.run(x["q_nope"], x["q_pe"], x["ckv"], x["kpe"], return_lse=True, backend=backend)
    return {"out": np.asarray(o).astype(np.float64), "lse": np.asarray(lse).astype(np.float64)}


@register_cases("mla")
def mla_cases(rng: np.random.Generator) -> Iterator[Case]:
    # (kind, lens, heads, page_size, num_splits). The first case of each dtype is the one tests/test_host_modes.py
    # runs under racecheck and random schedules: several tiles (the ring's slots and the S exchange reused) and,
    # bf16, splits with an empty request and the merge.
    for kind, lens, heads, ps, ns in (("bf16", (40, 0), 16, 1, 2),
                                      ("f16", (70,), 16, 16, 1),
                                      ("bf16", (200, 17, 1), 32, 16, 2),
                                      ("f16", (200, 0), 32, 1, 3),
                                      ("bf16", (17,), 16, 16, 1)):
        x = make_mla_inputs(rng, kind, lens, heads, ps)
        scale = 1.0 / np.sqrt(192.0)

        def run(be, x=x, scale=scale, ns=ns):
            return run_mla(x, scale, be, ns)

        def ref(x=x, scale=scale):
            o, lse = np_mla_decode(x["q_nope"], x["q_pe"], x["ckv"], x["kpe"], x["kv_indptr"], x["kv_indices"],
                                   x["kv_len"], scale)
            return {"out": o, "lse": lse}

        sfx = "_bf16" if kind == "bf16" else "_f16"
        kernels = ("mla_decode" + sfx,) + (("merge_states" + sfx,) if ns > 1 else ())
        yield Case(op="mla_decode", dtype=kind, shape=f"b{len(lens)}xh{heads}xp{ps}xL{max(lens)}", kernels=kernels,
                   run=run, reference=ref, note=f"splits={ns}")
    yield from _sm90_cases(rng)


def _sm90_cases(rng: np.random.Generator) -> Iterator[Case]:
    # 16 heads (48 masked rows), 64 (one full CTA) and 80 (a second CTA, mostly masked); page sizes 1 and 16;
    # lengths 0, 1, 17 and several tiles (the 2-slot ring wraps: 130 keys are 3 tiles of 64); splits with the merge.
    # The host emulation runs 384 fibers a CTA through every wgmma and mbarrier wait: small shapes.
    from ...errors import ArgumentError
    from ...ops.mla import uses_sm90
    from ._sm90 import ARCH, sm90_case as _case

    for kind, lens, heads, ps, ns in (("bf16", (130, 0, 1), 16, 16, 1),
                                      ("f16", (40, 17), 64, 1, 2),
                                      ("bf16", (70,), 80, 16, 3),
                                      ("f16", (130,), 16, 16, 1)):
        x = make_mla_inputs(rng, kind, lens, heads, ps)
        scale = 1.0 / np.sqrt(192.0)
        sfx = "_bf16" if kind == "bf16" else "_f16"
        kernels = ("mla_decode_sm90" + sfx,) + (("merge_states" + sfx,) if ns > 1 else ())

        def run(be, x=x, scale=scale, ns=ns, name=kernels[0]):
            if not uses_sm90(be):  # never a fallback to the mma.sync kernel under this case's name
                raise ArgumentError(f"backend: expected one that runs {ARCH} kernels (host with PYKERN_HOST_ARCH="
                                    f"{ARCH}, or nvrtc on a compute-capability 9.0 GPU) for {name}, got {be!r}")
            return run_mla(x, scale, be, ns)

        def ref(x=x, scale=scale):
            o, lse = np_mla_decode(x["q_nope"], x["q_pe"], x["ckv"], x["kpe"], x["kv_indptr"], x["kv_indices"],
                                   x["kv_len"], scale)
            return {"out": o, "lse": lse}

        yield _case("mla_decode", kind, f"b{len(lens)}xh{heads}xp{ps}xL{max(lens)}-s{ns}", kernels, run, ref)
