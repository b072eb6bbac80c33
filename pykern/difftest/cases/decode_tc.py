"""Tensor-core GQA decode (kernels_cu/decode_tc.cu): bf16 queries through paged_decode_attention (16-bit and
FP8 caches, split-KV on and off), f16 queries by launching the kernels as the op launches the bf16 ones
(the serving ops take f16 once paged.cu has f16 kernels). Split-KV merges in the same launch (the last split
CTA of a group); every case also checks that the split tickets are back at zero. References in float64 over
the stored values."""
from __future__ import annotations

from typing import Any, Iterator

import numpy as np

from ..case import Case, register_cases
from .serving import make_paged, make_q, np_ragged_attention


def _ref(q: np.ndarray, pc: dict[str, Any]) -> dict[str, Any]:
    out, lse = np_ragged_attention(np.asarray(q, np.float64), np.arange(q.shape[0] + 1), pc["ks"], pc["vs"])
    return {"out": out, "lse": lse}


def _op_case(rng: np.random.Generator, lens: list[int], page_size: int, h: int, kvh: int, d: int, kv: str,
             num_splits: int, items_per_cta: int | None = None) -> Case:
    from ... import ops

    pc = make_paged(rng, lens, page_size, kvh, d, "NHD", kv)
    q = make_q(rng, (len(lens), h, d), "bf16")
    fp8 = kv in ("e4m3", "e5m2")
    kernels = (f"decode_tc_paged_d{d}{'_' + kv + 'kv' if fp8 else ''}_bf16",)
    scales = {"k_scale": pc["scales"][0], "v_scale": pc["scales"][1]} if fp8 else {}

    def run(backend: str) -> dict[str, Any]:
        plan = ops.PagedDecodePlan(len(lens), h, kvh, d, page_size, q_dtype="bf16", kv_dtype=kv,
                                   num_splits=num_splits, items_per_cta=items_per_cta, like=q)
        out, lse = ops.paged_decode_attention(q, pc["k_pages"], pc["v_pages"], pc["kv_indptr"], pc["kv_indices"],
                                              pc["kv_last_page_len"], return_lse=True, plan=plan, backend=backend,
                                              **scales)
        if np.asarray(plan.counters).any():
            raise AssertionError(f"split tickets left nonzero: {np.asarray(plan.counters)}")
        return {"out": np.asarray(out, np.float32), "lse": np.asarray(lse)}

    return Case(op="paged_decode_attention", dtype="bf16",
                shape=f"B{len(lens)}-H{h}-KV{kvh}-D{d}-P{page_size}-S{num_splits}"
                      f"{'-I%d' % items_per_cta if items_per_cta else ''}-bf16q-{kv}kv-tc",
                kernels=kernels, run=run, reference=lambda: _ref(q, pc))


def f16_pages(rng: np.random.Generator, lens: list[int], page_size: int, kvh: int, d: int, kv: str) -> dict:
    """A paged cache for f16 queries: f16 pages (ks / vs the f16 values), or FP8 pages as raw bytes."""
    pc = make_paged(rng, lens, page_size, kvh, d, "NHD", "f32" if kv == "f16" else kv)
    if kv == "f16":
        pc["k_pages"], pc["v_pages"] = pc["k_pages"].astype(np.float16), pc["v_pages"].astype(np.float16)
        pc["ks"] = [k.astype(np.float16).astype(np.float64) for k in pc["ks"]]
        pc["vs"] = [v.astype(np.float16).astype(np.float64) for v in pc["vs"]]
        pc["scales"] = (1.0, 1.0)
    else:
        pc["k_pages"], pc["v_pages"] = pc["k_pages"].view(np.uint8), pc["v_pages"].view(np.uint8)
    return pc


def launch_f16(q: np.ndarray, pc: dict, page_size: int, kvh: int, kv: str, num_splits: int,
               backend: str, items_per_cta: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """paged_decode_attention's launches for f16 q (NHD pages, one plan's geometry, `items_per_cta` work items a
    CTA): (out, lse)."""
    from ...launcher import launch
    from ...ops.serving import dtc_smem_bytes

    n, h, d = q.shape
    fp8 = kv != "f16"
    out = np.zeros((n, h, d), np.float16)
    lse = np.zeros((n, h), np.float32)
    part_o = np.zeros(max(1, num_splits * n * h * d), np.float16)  # partial o in q's type
    part_lse = np.zeros(max(1, num_splits * n * h), np.float32)
    counters = np.zeros(n * kvh, np.int32)
    name = f"decode_tc_paged_d{d}{'_' + kv + 'kv' if fp8 else ''}_f16"
    launch(name, (-(-n * kvh * num_splits // items_per_cta), 1, 1), (128,), q.reshape(-1), pc["k_pages"].reshape(-1),
           pc["v_pages"].reshape(-1), out.reshape(-1), lse, part_o, part_lse, counters, pc["kv_indptr"], pc["kv_indices"],
           pc["kv_last_page_len"], h, kvh, page_size, page_size * kvh * d, kvh * d, d, 2**30, num_splits, n, 1,
           1.0 / float(np.sqrt(d)), float(pc["scales"][0]), float(pc["scales"][1]), items_per_cta,
           shared_mem=dtc_smem_bytes(d, 1 if fp8 else 2), backend=backend)
    if counters.any():
        raise AssertionError(f"split tickets left nonzero: {counters}")
    return out, lse


def _f16_case(rng: np.random.Generator, lens: list[int], page_size: int, h: int, kvh: int, d: int, kv: str,
              num_splits: int, items_per_cta: int = 1) -> Case:
    pc = f16_pages(rng, lens, page_size, kvh, d, kv)
    q = rng.standard_normal((len(lens), h, d)).astype(np.float16)
    kernels = (f"decode_tc_paged_d{d}{'_' + kv + 'kv' if kv != 'f16' else ''}_f16",)

    def run(backend: str) -> dict[str, Any]:
        out, lse = launch_f16(q, pc, page_size, kvh, kv, num_splits, backend, items_per_cta)
        return {"out": out.astype(np.float32), "lse": lse}

    # Tolerance: the tensor-core attention f16 row (inputs exact, P rounded to f16), as flash_attention's.
    return Case(op="flash_attention", dtype="f16",
                shape=f"B{len(lens)}-H{h}-KV{kvh}-D{d}-P{page_size}-S{num_splits}"
                      f"{'-I%d' % items_per_cta if items_per_cta > 1 else ''}-f16q-{kv}kv-decode_tc",
                kernels=kernels, run=run, reference=lambda: _ref(q, pc),
                note="decode_tc kernels launched directly with f16 queries")


@register_cases("decode_tc")
def cases(rng: np.random.Generator) -> Iterator[Case]:
    # GQA 4 and 8, page sizes 16 and 1, an empty sequence, split-KV on and off; every kernel once; one CTA an item.
    yield _op_case(rng, [37, 0, 5], 16, 8, 2, 64, "bf16", 1)
    yield _op_case(rng, [70, 9], 1, 16, 2, 128, "bf16", 3)
    for kv, d, ns in (("e4m3", 64, 2), ("e5m2", 64, 1), ("e4m3", 128, 1), ("e5m2", 128, 2)):
        yield _op_case(rng, [40, 3], 16, 8, 2, d, kv, ns)
    for kv, d, ns in (("f16", 64, 1), ("f16", 128, 2), ("e4m3", 64, 1), ("e5m2", 64, 2), ("e4m3", 128, 2),
                      ("e5m2", 128, 1)):
        yield _f16_case(rng, [33, 0, 8], 16, 8, 2, d, kv, ns)
    # Persistent grids: several items a CTA streamed through one ring (the fill running into the next item,
    # across an empty sequence, a one-tile item and a last CTA with fewer items), split and unsplit.
    yield _op_case(rng, [37, 0, 130, 5, 64], 16, 8, 2, 64, "bf16", 1, 3)
    yield _op_case(rng, [70, 0, 9, 200], 1, 16, 2, 128, "bf16", 2, 4)
    yield _op_case(rng, [40, 3, 0, 129], 16, 8, 2, 128, "e4m3", 1, 3)
    yield _op_case(rng, [66, 0, 3], 16, 8, 2, 64, "e5m2", 3, 5)
    yield _f16_case(rng, [33, 0, 8, 150], 16, 8, 2, 128, "f16", 1, 3)
    yield _f16_case(rng, [33, 0, 65, 8], 16, 8, 2, 128, "e4m3", 2, 3)
