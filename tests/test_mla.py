"""MLA paged decode (pykern.ops.MLAPagedDecodePlan, kernels_cu/mla.cu): the host backend (the .cu itself) and the
numba reference against a float64 NumPy reference within the bf16 / f16 rows of the tolerance table, split-KV
against one split, latent caches as slices of one combined cache, the natural-log lse, and bad input named
before any launch."""
from __future__ import annotations

import numpy as np
import pytest

from pykern import ops
from pykern.difftest.cases.mla import make_mla_inputs, np_mla_decode, run_mla
from pykern.errors import ArgumentError, ArgumentTypeError
from family_helpers import check, need
from launch_spy import record_launches

SCALE = 1.0 / np.sqrt(192.0)

# (kind, kv lengths, heads, page_size, num_splits): lengths 1, 17, 200 and an empty request; 16, 32 and 20 heads
# (20: a second head tile with rows past num_heads); page sizes 1 and 16; one split and several
SHAPES = [
    ("bf16", (1,), 16, 1, 1),
    ("f16", (17,), 32, 16, 1),
    ("bf16", (200, 17, 0), 16, 16, 1),
    ("f16", (200, 0, 1), 32, 1, 2),
    ("bf16", (33, 17), 20, 16, 3),
]


def _ref(x: dict) -> dict:
    o, lse = np_mla_decode(x["q_nope"], x["q_pe"], x["ckv"], x["kpe"], x["kv_indptr"], x["kv_indices"], x["kv_len"],
                           SCALE)
    return {"out": o, "lse": lse}


@pytest.mark.parametrize("backend", ["host", "numba"])
@pytest.mark.parametrize("kind,lens,heads,ps,ns", SHAPES)
def test_matches_float64(backend: str, kind: str, lens: tuple, heads: int, ps: int, ns: int) -> None:
    need(backend)
    x = make_mla_inputs(np.random.default_rng(len(lens) * 100 + heads + ps), kind, lens, heads, ps)
    got, ref = run_mla(x, SCALE, backend, ns), _ref(x)
    check(got, ref, "mla_decode", kind)
    empty = np.asarray(lens) == 0  # an empty request: out 0, lse -inf
    assert (got["out"][empty] == 0).all() and (got["lse"][empty] == -np.inf).all()
    assert np.isfinite(got["lse"][~empty]).all()


def test_splits_agree_with_one_split_and_plan_chooses_splits_for_a_small_batch() -> None:
    x = make_mla_inputs(np.random.default_rng(7), "bf16", (150, 64), 16, 16)
    one, three = run_mla(x, SCALE, "host", 1), run_mla(x, SCALE, "host", 3)
    check(three, _ref(x), "mla_decode", "bf16")
    np.testing.assert_allclose(three["lse"], one["lse"], rtol=1e-5, atol=1e-5)
    plan = ops.MLAPagedDecodePlan()
    lens = np.full(2, 8192)
    plan.plan(np.arange(3), np.array([0, 128, 256]), np.arange(256), lens, 16, 512, 64, 64, False, SCALE, "bf16")
    assert plan.num_splits == 32 and plan.grid == (1, 2, 32)  # 2 CTAs -> two a SM of 132 (8192 keys: 32 of 256)
    assert [n for n, *_ in plan.launches()] == ["mla_decode_bf16", "merge_states_bf16"]


def test_lse_is_natural_log_of_the_scaled_scores() -> None:
    x = make_mla_inputs(np.random.default_rng(3), "f16", (5,), 16, 1)
    got = run_mla(x, SCALE, "host")
    qn, qp = x["q_nope"][0].astype(np.float64), x["q_pe"][0].astype(np.float64)
    pages = x["kv_indices"][:5]
    s = SCALE * (qn @ x["ckv"][pages, 0].astype(np.float64).T + qp @ x["kpe"][pages, 0].astype(np.float64).T)
    np.testing.assert_allclose(got["lse"][0], np.log(np.exp(s).sum(1)), rtol=1e-5, atol=1e-5)


def test_slices_of_one_combined_cache_read_in_place() -> None:
    # vLLM / SGLang keep [ckv | kpe] in one (num_pages, page_size, 576) cache: the two slices are strided views
    x = make_mla_inputs(np.random.default_rng(5), "bf16", (40, 9), 16, 16)
    both = np.concatenate([x["ckv"], x["kpe"]], axis=2)
    y = dict(x, ckv=both[..., :512], kpe=both[..., 512:])
    assert not y["ckv"].flags.c_contiguous
    got = run_mla(y, SCALE, "host")
    np.testing.assert_array_equal(got["out"], run_mla(x, SCALE, "host")["out"])


def _plan(x: dict, **kw) -> ops.MLAPagedDecodePlan:
    args = dict(qo_indptr=x["qo_indptr"], kv_indptr=x["kv_indptr"], kv_indices=x["kv_indices"],
                kv_len_arr=x["kv_len"], num_heads=x["heads"], head_dim_ckv=512, head_dim_kpe=64,
                page_size=x["page_size"], causal=False, sm_scale=SCALE, q_data_type=x["kind"])
    args.update(kw)
    p = ops.MLAPagedDecodePlan()
    p.plan(**args)
    return p


@pytest.mark.parametrize("kw,err,name", [
    ({"head_dim_ckv": 256}, ArgumentError, "head_dim_ckv"),
    ({"head_dim_kpe": 32}, ArgumentError, "head_dim_kpe"),
    ({"qo_indptr": np.array([0, 2, 3])}, ArgumentError, "qo_indptr"),
    ({"kv_len_arr": np.array([40, 17])}, ArgumentError, "kv_len_arr"),  # 17 > request 1's one page of 16
    ({"kv_indices": np.array([0, 1, -1])}, ArgumentError, "kv_indices"),
    ({"kv_data_type": "f16"}, ArgumentTypeError, "kv_data_type"),
    ({"q_data_type": "float32"}, ArgumentTypeError, "q_data_type"),
    ({"sm_scale": None}, ArgumentError, "sm_scale"),
    # the kernel scales the masked (-inf) scores of a tile's keys past the range: 0 or < 0 made them NaN / +inf
    ({"sm_scale": 0.0}, ArgumentError, "sm_scale"),
    ({"sm_scale": -0.1}, ArgumentError, "sm_scale"),
    # sizes past int32 (they reach the kernel as int) failed in the workspace allocation / int conversion
    ({"num_heads": 2**63}, ArgumentError, "num_heads"),
    ({"page_size": np.uint64(2**64 - 1)}, ArgumentError, "page_size"),
    # a longer kv_indptr makes the batch: the other arrays' shape errors say where it comes from
    ({"kv_indptr": np.array([0, 3, 4, 4])}, ArgumentError, "qo_indptr: .*the length of kv_indptr"),
])
def test_bad_plan_arguments_are_named(kw: dict, err: type, name: str) -> None:
    x = make_mla_inputs(np.random.default_rng(0), "bf16", (40, 9), 16, 16)
    with pytest.raises(err, match=name):
        _plan(x, **kw)


def test_meta_index_arrays_are_named() -> None:
    torch = pytest.importorskip("torch")
    x = make_mla_inputs(np.random.default_rng(0), "bf16", (40, 9), 16, 16)
    for name in ("kv_indptr", "kv_indices"):  # were read on the host: torch's NotImplementedError
        with pytest.raises(ArgumentTypeError, match=f"{name}: expected a CPU or CUDA tensor, got one on the meta"):
            _plan(x, **{name: torch.from_numpy(x[name]).to("meta")})


def _bad_run(x: dict, what: str) -> dict:
    y = dict(q_nope=x["q_nope"], q_pe=x["q_pe"], ckv_cache=x["ckv"], kpe_cache=x["kpe"])
    if what == "ckv_cache":  # a head_dim that is not the latent layout's
        y["ckv_cache"] = x["ckv"][..., :256]
    elif what == "kpe_cache":  # dtype mismatch
        y["kpe_cache"] = x["kpe"].astype(np.float16)
    elif what == "q_nope":
        y["q_nope"] = x["q_nope"].astype(np.float16)
    elif what == "q_pe":
        y["q_pe"] = x["q_pe"][:, :, :32]
    elif what == "kv_indices":  # the cache has fewer pages than the table names
        y["ckv_cache"], y["kpe_cache"] = x["ckv"][:2], x["kpe"][:2]
    return y


@pytest.mark.parametrize("what,err", [("ckv_cache", ArgumentError), ("kpe_cache", ArgumentTypeError),
                                      ("q_nope", ArgumentTypeError), ("q_pe", ArgumentError),
                                      ("kv_indices", ArgumentError)])
def test_bad_run_arguments_are_named_before_any_launch(what: str, err: type, monkeypatch) -> None:
    x = make_mla_inputs(np.random.default_rng(0), "bf16", (40, 9), 16, 16)
    plan = _plan(x)
    names = record_launches(monkeypatch)
    with pytest.raises(err, match=what):
        plan.run(**_bad_run(x, what), backend="host")
    assert names == []


def test_a_device_without_mma_sync_is_an_error_naming_the_backend(monkeypatch) -> None:
    from pykern.ops import forward

    x = make_mla_inputs(np.random.default_rng(0), "bf16", (4,), 16, 1)
    plan = _plan(x)
    monkeypatch.setattr(forward, "tensor_cores_available", lambda backend=None: False)  # an sm_75 nvrtc backend
    names = record_launches(monkeypatch)
    with pytest.raises(ArgumentError, match="backend: .*sm_80"):
        plan.run(x["q_nope"], x["q_pe"], x["ckv"], x["kpe"], backend="host")
    assert names == []


def test_queries_of_another_kind_than_the_plan_workspaces_are_named(monkeypatch) -> None:
    torch = pytest.importorskip("torch")
    x = make_mla_inputs(np.random.default_rng(0), "bf16", (4,), 16, 1)
    plan = _plan(x)  # NumPy workspaces (like=None)
    t = {k: torch.from_numpy(x[k].astype(np.float32)).to(torch.bfloat16) for k in ("q_nope", "q_pe", "ckv", "kpe")}
    names = record_launches(monkeypatch)
    with pytest.raises(ArgumentTypeError, match="q_nope: expected the kind of array"):
        plan.run(t["q_nope"], t["q_pe"], t["ckv"], t["kpe"], backend="host")
    assert names == []


def test_torch_tensors_with_a_torch_plan() -> None:
    torch = pytest.importorskip("torch")
    x = make_mla_inputs(np.random.default_rng(4), "bf16", (40, 9), 16, 16)
    tt = {k: torch.from_numpy(x[k].astype(np.float32)).to(torch.bfloat16) for k in ("q_nope", "q_pe", "ckv", "kpe")}
    plan = ops.MLAPagedDecodePlan(like=tt["q_nope"])
    plan.plan(torch.arange(3), torch.from_numpy(x["kv_indptr"]), torch.from_numpy(x["kv_indices"]),
              torch.from_numpy(x["kv_len"]), 16, 512, 64, 16, False, SCALE, torch.bfloat16, torch.bfloat16)
    o, lse = plan.run(tt["q_nope"], tt["q_pe"], tt["ckv"], tt["kpe"], return_lse=True, backend="host")
    assert isinstance(o, torch.Tensor) and o.dtype == torch.bfloat16 and isinstance(lse, torch.Tensor)
    check({"out": o.float().numpy(), "lse": lse.numpy()}, _ref(x), "mla_decode", "bf16")
