"""A serving decode step launches kernels and does nothing else: no allocation, no synchronisation, no host read
of a device value, so it can be captured in one CUDA graph (docs/serving.md, "CUDA-graph capture").

The step (append the new token's K/V, paged decode, for each of several layers; then sampling with device seed /
offset) runs on the nvrtc backend over the test suite's fake driver with the launch stubbed and CPU tensors
treated as device memory (tools/bench_launch.py's stubbed_gpu), under tests/step_audit.py's recorder of driver
calls, new torch memory, synchronising torch ops and host reads. The GPU counterpart, capturing the same step in
torch.cuda.graph and replaying it, is `python tools/measure_gpu.py decode-graph` and
tests/test_torch_ops.py::test_cuda_graph_capture_of_a_paged_decode_step_with_sampling.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("cuda.bindings", reason="stubbed_gpu encodes tensor maps with cuda.bindings' types")

from step_audit import StepAudit, bench_launch  # noqa: E402

import measure_gpu  # noqa: E402  (tools/, on the path through step_audit)

from pykern import ops  # noqa: E402
from pykern.errors import ArgumentError, ArgumentTypeError  # noqa: E402

B, LAYERS = 4, 3


def Step() -> Any:
    """tools/measure_gpu.py's decode step (the one `decode-graph` captures on a GPU), small, on CPU tensors: 3 layers
    of a batch of 4 sequences of 49..64 tokens, 8 query / 2 KV heads of 128, pages of 16, 2 KV splits (the
    tensor-core kernel's split tickets and partials are part of the step), a vocabulary of 1000."""
    return measure_gpu.DecodeStep(B, LAYERS, 64, heads=8, kv_heads=2, vocab=1000, num_splits=2, device="cpu")


STEP_KERNELS = ["paged_append_kv_bf16", "decode_tc_paged_d128_bf16"] * LAYERS + ["sampling_from_logits"]


@pytest.fixture
def gpu() -> Any:
    with bench_launch.stubbed_gpu() as g:
        yield g


def _audit(gpu: Any, step: Callable[[], Any]) -> StepAudit:
    step()  # warm-up: kernels planned, the ops' kept dummies made
    audit = StepAudit(gpu)
    with audit:
        step()
    return audit


def test_decode_step_launches_kernels_and_nothing_else(gpu):
    step = Step()
    audit = _audit(gpu, step)
    assert audit.problems() == []
    assert audit.kernels == STEP_KERNELS
    tokens, valid = step()
    assert tokens is step.tokens and valid.data_ptr() == step.valid.data_ptr()  # the caller's buffers


@pytest.mark.parametrize("pdl", [True, False])
def test_decode_step_launches_with_pdl_when_enabled(gpu, pdl):
    """The whole step with enable_pdl on (append, L layers of paged decode, sampling): every launch carries the
    programmatic stream serialization attribute (the fake driver is an sm_90 one), so each kernel's CTAs may start
    while the one before it finishes and wait inside; with it off, none does. The first launch's predecessor is the
    previous step's sampling: it may take it too."""
    step = Step()
    step.pdl = pdl
    step()  # warm-up
    asked: list[bool] = []  # what each launch asks the driver for (the stubbed launch itself does nothing)
    gpu.driver.launch_kernel = lambda func, grid, block, smem, stream, params, pdl=False: asked.append(pdl)
    audit = StepAudit(gpu)
    with audit:
        step()
    assert audit.problems() == []
    assert audit.kernels == STEP_KERNELS and len(asked) == len(STEP_KERNELS)
    assert asked[1:] == [pdl] * (len(STEP_KERNELS) - 1)  # the rule: every launch after the first
    assert asked[0] == pdl


@pytest.mark.parametrize("fault, want", [
    ("alloc", ("alloc", "aten.empty.memory_format -> (4,) torch.float32")),
    ("item", ("sync", "aten._local_scalar_dense.default")),
    ("cpu", ("host_read", "Tensor.cpu (4,)")),
    ("numpy", ("host_read", "Tensor.numpy (4,)")),
    ("stream_synchronize", ("driver", "stream_synchronize")),
    ("mem_alloc", ("driver", "mem_alloc")),
    ("event_synchronize", ("driver", "event_synchronize")),
])
def test_audit_reports_a_deliberate_allocation_or_synchronisation(gpu, fault, want):
    """Each fault put into the middle of the step (after the second layer) is reported, and nothing else."""
    step = Step()
    drv = gpu.driver
    drv.current = 0xC0  # (the fake allocates and makes events in a current context)
    event = drv.event_create()
    faults = {
        "alloc": lambda: torch.empty(4),
        "item": lambda: int(step.last[0]),  # a host read of a length: .item() behind int()
        "cpu": lambda: step.last.cpu(),
        "numpy": lambda: step.last.numpy(),
        "stream_synchronize": lambda: drv.stream_synchronize(0),
        "mem_alloc": lambda: drv.mem_alloc(64),
        "event_synchronize": lambda: drv.event_synchronize(event),
    }
    step(faults[fault])
    audit = StepAudit(gpu)
    with audit:
        step(lambda: faults[fault]())
    assert audit.problems() == [want]
    assert audit.kernels == STEP_KERNELS


# Each rule of docs/serving.md's CUDA-graph section, broken: what the step then does besides its launches.
@pytest.mark.parametrize("broken, want", [
    ("sampling without out / valid", [("alloc", "aten.empty.memory_format -> (4,) torch.int32"),
                                      ("alloc", "aten.empty.memory_format -> (4,) torch.uint8")]),
    ("seed of shape (1,)", [("alloc", "aten.clone.default -> (4,) torch.int64")]),
    ("int64 page table", [("alloc", "aten._to_copy.default -> (5,) torch.int32"),
                          ("alloc", "aten._to_copy.default -> (16,) torch.int32"),
                          ("alloc", "aten._to_copy.default -> (4,) torch.int32")]),
    ("strided q", [("alloc", "aten.clone.default -> (4, 8, 128) torch.bfloat16")]),
    ("decode without out", []),  # the plan's own output: allocated once, when the plan is made
    ("top_k as a Python list", [("alloc", "torch.from_numpy (a host array onto the device)")]),
])
def test_each_capture_rule_broken_shows_in_the_audit(gpu, broken, want):
    step = Step()
    if broken == "sampling without out / valid":
        step.sample_kw = {}
    elif broken == "seed of shape (1,)":
        step.seed = torch.tensor([1234], dtype=torch.int64)
    elif broken == "int64 page table":
        step.indptr, step.indices, step.last = step.indptr.long(), step.indices.long(), step.last.long()
    elif broken == "strided q":
        step.q[0] = torch.empty(B, 8, 256, dtype=torch.bfloat16)[:, :, :128]
    elif broken == "decode without out":
        step.attn = [None] * LAYERS
    elif broken == "top_k as a Python list":
        step.sample_kw["top_k"] = [50] * B
    audit = _audit(gpu, step)
    got = audit.problems()
    if broken == "int64 page table":  # one conversion of each index array a layer (append and decode)
        assert got == want * (2 * LAYERS)
    else:
        assert got == want


@pytest.mark.parametrize("op, args", [
    ("sampling_from_probs", ()),
    ("top_k_sampling_from_probs", (50,)),
    ("top_p_sampling_from_probs", (0.9,)),
    ("min_p_sampling_from_probs", (0.1,)),
    ("top_k_top_p_sampling_from_probs", (50, 0.9)),
    ("sampling_from_logits", ()),
    ("top_k_top_p_sampling_from_logits", (50, 0.9)),
])
def test_every_sampling_op_with_out_allocates_nothing(gpu, op, args):
    fn = getattr(ops, op)
    x = torch.softmax(torch.randn(B, 1000), -1)
    seed, offset = torch.full((B,), 7, dtype=torch.int64), torch.arange(B, dtype=torch.int64)
    out, valid = torch.empty(B, dtype=torch.int32), torch.empty(B, dtype=torch.uint8)
    # per-row parameters as device arrays too
    audit = _audit(gpu, lambda: fn(x, *args, seed=seed, offset=offset, out=out, valid=valid, return_valid=True))
    assert audit.problems() == []
    assert audit.kernels == ["sampling_from_logits" if "logits" in op else "sampling_from_probs"]
    k_arr, p_arr = torch.full((B,), 50, dtype=torch.int32), torch.full((B,), 0.9)
    audit = _audit(gpu, lambda: ops.top_k_top_p_sampling_from_probs(x, k_arr, p_arr, seed=seed, offset=offset,
                                                                    out=out, valid=valid))
    assert audit.problems() == []


def test_sampling_out_and_valid_are_checked():
    probs = np.full((3, 10), 0.1, np.float32)
    with pytest.raises(ArgumentTypeError, match="out: expected dtype int32, got int64"):
        ops.sampling_from_probs(probs, seed=1, out=np.zeros(3, np.int64))
    with pytest.raises(ArgumentError, match=r"out: expected shape \(3,\), got \(4,\)"):
        ops.sampling_from_probs(probs, seed=1, out=np.zeros(4, np.int32))
    with pytest.raises(ArgumentTypeError, match="valid: expected dtype uint8, got int32"):
        ops.sampling_from_probs(probs, seed=1, valid=np.zeros(3, np.int32))
    with pytest.raises(ArgumentError, match=r"valid: expected shape \(3,\), got \(2,\)"):
        ops.sampling_from_probs(probs, seed=1, valid=np.zeros(2, np.bool_))


@pytest.mark.parametrize("logits", [False, True])
def test_sampling_into_out_gives_the_tokens_of_a_fresh_output(logits):
    """Host backend: the same tokens and flags into the caller's buffers as into the op's own; the buffers are
    what comes back (a NaN row: valid False)."""
    r = np.random.default_rng(3)
    x = r.random((5, 300)).astype(np.float32)
    x[2, 7] = np.nan
    fn = ops.top_k_top_p_sampling_from_logits if logits else ops.top_k_top_p_sampling_from_probs
    want, want_valid = fn(x, 20, 0.8, seed=11, offset=3, return_valid=True, backend="host")
    out, valid = np.full(5, -1, np.int32), np.ones(5, np.bool_)
    got, got_valid = fn(x, 20, 0.8, seed=11, offset=3, return_valid=True, out=out, valid=valid, backend="host")
    assert got is out and np.shares_memory(got_valid, valid)
    np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(valid, want_valid)
    assert not valid[2] and valid[[0, 1, 3, 4]].all()


def test_decode_step_on_the_plans_memo_allocates_nothing(gpu, monkeypatch):
    """On a GPU a plan's second run with the same device arrays re-issues the first run's prepared launches
    (tests/test_serving_run_memo.py); `_array_key` keys CUDA tensors only, so here the CPU tensors are keyed as CUDA
    ones would be, and the audited step (one layer: the memo holds one run's arrays) runs on the memo: no check of
    q, the launches alone."""
    from pykern import arrays
    from pykern.ops import serving

    real_key, real_check_q = serving._array_key, serving._check_q
    checked = []

    def key(a: Any) -> Any:
        if arrays.is_torch(a) and not a.is_cuda:
            return id(a), a.data_ptr(), tuple(a.shape), a.stride(), a.dtype, 0
        return real_key(a)

    monkeypatch.setattr(serving, "_array_key", key)
    monkeypatch.setattr(serving, "_check_q", lambda *a: (checked.append(1), real_check_q(*a))[1])
    step = measure_gpu.DecodeStep(B, 1, 64, heads=8, kv_heads=2, vocab=1000, num_splits=2, device="cpu")
    step()
    checked.clear()
    audit = StepAudit(gpu)
    with audit:
        step()
    assert checked == [] and len(step.plan._memo) == 1
    assert audit.problems() == []
    assert audit.kernels == ["paged_append_kv_bf16", "decode_tc_paged_d128_bf16", "sampling_from_logits"]


def _llama_decode_events(patch: bool) -> tuple[list[tuple[str, str]], Any]:
    """(audit events, logits) of one decode step of a tiny LlamaForCausalLM with transformers' StaticCache (after a
    5-token prefill and one warm-up step), patched by pykern.torch.apply (host backend) or not."""
    transformers = pytest.importorskip("transformers")
    import pykern.torch as pt

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(cfg).eval()
    if patch:
        pt.apply(model)
    cache = transformers.StaticCache(config=cfg, max_cache_len=32)
    tok, pos = torch.tensor([[3]]), torch.tensor([5])
    with torch.no_grad():
        model(torch.randint(0, 128, (1, 5)), past_key_values=cache, use_cache=True, cache_position=torch.arange(5))
        model(tok, past_key_values=cache, use_cache=True, cache_position=pos)  # warm-up
        pos = torch.tensor([6])
        audit = StepAudit(None)
        with audit:
            logits = model(tok, past_key_values=cache, use_cache=True, cache_position=pos).logits
    return audit.events, logits


def test_patched_llama_static_cache_decode_step_does_nothing_transformers_does_not(monkeypatch):
    """The pykern.torch-patched model's decode step over transformers' StaticCache (host backend): no
    synchronisation, no host read, no host-to-device copy — none in transformers' own step either — and new memory
    only where transformers' step makes it too, or as the output of a pykern op that replaces several of its
    ops (fewer allocations in all). The step's logits match the unpatched model's."""
    monkeypatch.setenv("PYKERN_BACKEND", "host")
    base, want = _llama_decode_events(False)
    patched, got = _llama_decode_events(True)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert [e for e in base if e[0] != "alloc"] == []
    assert [e for e in patched if e[0] != "alloc"] == []
    allocs = [w for _, w in patched]
    extra = set(allocs) - {w for _, w in base}
    assert extra == {"pykern.rms_norm.default -> (1, 1, 64) torch.float32",
                     "pykern.rope.default -> (1, 1, 4, 16) torch.float32",
                     "pykern.swiglu.default -> (1, 1, 128) torch.float32"}
    assert len(allocs) < len(base)
