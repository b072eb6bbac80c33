"""pykern.torch.apply on tiny random-weight mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE,
OLMoE; built from configs, nothing downloaded).

A patched model must match the unpatched one (transformers' default "grouped_mm" experts): logits,
router logits, the load-balancing loss, the loss and every gradient; the losses of a few AdamW
steps; greedy generation. A spy checks that pykern's experts and routing actually ran.
"""
from __future__ import annotations

import copy
from collections import Counter

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import pykern.torch as pt  # noqa: E402
import pykern.torch.functional as ptf  # noqa: E402
import pykern.torch.moe as ptm  # noqa: E402
import pykern.torch.training as ptt  # noqa: E402
from test_torch_apply import assert_close  # the one comparison against the torch_apply tolerance row
from test_torch_apply import assert_apply_keeps_parameters, assert_grads_close, batch as apply_batch

FAMILIES = ["Mixtral", "Qwen2Moe", "Qwen3Moe", "Olmoe"]
LAYERS = 2


def tiny(name: str, **extra):
    kw = dict(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=False, rms_norm_eps=1e-5, num_experts_per_tok=2,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    if name == "Mixtral":
        kw["num_local_experts"] = 8
    else:
        kw.update(num_experts=8, moe_intermediate_size=32)
    if name == "Qwen2Moe":
        kw["shared_expert_intermediate_size"] = 48
    if name == "Qwen3Moe":
        kw["head_dim"] = 16
    kw.update(extra)
    cfg = getattr(transformers, name + "Config")(**kw)
    torch.manual_seed(0)
    model = getattr(transformers, name + "ForCausalLM")(cfg).float()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:  # a norm that drops its weight cannot pass
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif n.endswith("mlp.gate.weight"):  # decisive routing: distinct top-k, uneven weights
                p.normal_(0.0, 0.5)
    return model



@pytest.fixture
def spy(monkeypatch):
    """Counts the pykern ops the torch layer runs (op name -> calls)."""
    calls: Counter = Counter()
    for mod in (ptf, ptm, ptt):
        real = mod.call

        def call(name, *args, _real=real, **kw):
            calls[name] += 1
            return _real(name, *args, **kw)

        monkeypatch.setattr(mod, "call", call)
    return calls


def batch():
    return apply_batch(low=3)


@pytest.mark.parametrize("name,extra", [(f, {}) for f in FAMILIES]
                         + [("Qwen3Moe", {"norm_topk_prob": True}), ("Qwen2Moe", {"norm_topk_prob": True})])
def test_moe_model_matches_logits_router_aux_loss_and_gradients(name, extra, spy):
    ref = tiny(name, **extra)
    model = pt.apply(copy.deepcopy(ref), fused_linear_cross_entropy=False)  # compares the logits too
    ids, labels = batch()
    o_ref = ref(input_ids=ids, labels=labels, output_router_logits=True)
    assert not spy, "the unpatched model must not run pykern kernels"
    o = model(input_ids=ids, labels=labels, output_router_logits=True)
    o_ref.loss.backward()
    o.loss.backward()
    assert spy["moe_route"] == LAYERS and spy["moe_experts"] == LAYERS and spy["moe_experts_backward"] == LAYERS
    for op in ("rms_norm", "qk_norm_rope", "flash_attention", "cross_entropy_fwd_bwd"):
        assert spy[op] > 0, f"{op} did not run on pykern"
    assert_close(o.logits, o_ref.logits, "logits")
    assert len(o.router_logits) == LAYERS
    for layer, (a, b) in enumerate(zip(o.router_logits, o_ref.router_logits)):
        assert_close(a, b, f"router logits of layer {layer}")
    assert o.aux_loss is not None and float(o_ref.aux_loss.detach()) > 0
    assert_close(o.aux_loss, o_ref.aux_loss, "load-balancing loss")
    assert_close(o.loss, o_ref.loss, "loss (with the router aux loss)")
    assert_grads_close(model, ref, every=True)


@pytest.mark.parametrize("name", FAMILIES)
def test_moe_adamw_training_losses_match(name, spy):
    """Four AdamW steps in training mode (fused linear cross-entropy + router aux loss): the loss and
    the aux loss of every step match the unpatched model's. (Parameters are not compared: Adam
    divides by sqrt(v), so gradient entries that are rounding noise move by up to lr either way.)"""
    ref = tiny(name, output_router_logits=True)
    model = pt.apply(copy.deepcopy(ref))
    ref.train()
    model.train()
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids, labels = batch()
    for step in range(4):
        losses = []
        for m, opt_ in ((ref, opt_ref), (model, opt)):
            opt_.zero_grad()
            out = m(input_ids=ids, labels=labels)
            out.loss.backward()
            opt_.step()
            losses.append((out.loss.detach(), out.aux_loss.detach()))
        (l_ref, a_ref), (l, a) = losses
        assert_close(a, a_ref, f"aux loss, step {step}")
        assert_close(l, l_ref, f"loss, step {step}")
    assert spy["fused_linear_cross_entropy"] == 4
    assert spy["moe_experts_backward"] == 4 * LAYERS and spy["moe_route"] == 4 * LAYERS


@pytest.mark.parametrize("name", FAMILIES)
def test_moe_greedy_generate_same_tokens(name, spy):
    ref = tiny(name)
    model = pt.apply(copy.deepcopy(ref))
    ids, _ = batch()
    prompt = ids[:1, :6]
    kw = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=5, do_sample=False)
    want = ref.generate(prompt, **kw)
    assert not spy
    got = model.generate(prompt, **kw)
    assert got.tolist() == want.tolist()
    assert got.shape[1] == 11
    # the prefill and each decode step routed and ran its experts on pykern
    assert spy["moe_experts"] == spy["moe_route"] == 5 * LAYERS


def test_apply_keeps_parameters_routers_and_state_dict():
    ref = tiny("Qwen2Moe")
    model = copy.deepcopy(ref)
    assert_apply_keeps_parameters(model)
    assert model.config._experts_implementation == "pykern"
    from transformers.models.qwen2_moe import modeling_qwen2_moe as mq

    block = model.model.layers[0].mlp
    assert isinstance(block.gate, mq.Qwen2MoeTopKRouter)  # the router-logits recorder still matches it
    assert type(block.gate) is not mq.Qwen2MoeTopKRouter
    # the shared expert is a SwiGLU MLP (patched); its sigmoid gate stays transformers' Linear
    assert isinstance(block.shared_expert, pt.SwiGLUMLP)
    assert type(block.shared_expert_gate) is torch.nn.Linear
    model.load_state_dict(ref.state_dict())
    router_cls = type(block.gate)
    assert pt.apply(model) is model and type(block.gate) is router_cls  # idempotent


def test_experts_layout_pykern_does_not_cover_falls_back_to_grouped_mm(spy, caplog):
    """An activation the fused epilogue does not have (exact GELU) goes to transformers' grouped_mm, said once
    (info, the "pykern" logger); routing stays on pykern and the model still matches."""
    from pykern.torch import hf_moe

    ref = tiny("Mixtral", hidden_act="gelu")
    model = pt.apply(copy.deepcopy(ref), fused_linear_cross_entropy=False)
    ids, _ = batch()
    hf_moe._FELL_BACK.discard("MixtralExperts")
    with caplog.at_level("INFO", logger="pykern"):
        assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits, "logits (gelu experts)")
        model(input_ids=ids)
    said = [r.getMessage() for r in caplog.records if "grouped_mm runs its experts" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("MixtralExperts:"), said
    assert spy["moe_experts"] == 0 and spy["moe_route"] == 2 * LAYERS


def test_router_and_experts_flags_turn_each_off(spy):
    ref = tiny("Olmoe")
    model = pt.apply(copy.deepcopy(ref), router=False, fused_linear_cross_entropy=False)
    ids, _ = batch()
    assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits, "logits (router=False)")
    assert spy["moe_route"] == 0 and spy["moe_experts"] == LAYERS
    model = pt.apply(copy.deepcopy(ref), experts=False, fused_linear_cross_entropy=False)
    assert model.config._experts_implementation != "pykern"


def test_bf16_mixtral_matches_unpatched(spy):
    ref = tiny("Mixtral").to(torch.bfloat16)
    model = pt.apply(copy.deepcopy(ref), fused_linear_cross_entropy=False)
    ids, labels = batch()
    o_ref = ref(input_ids=ids, labels=labels, output_router_logits=True)
    o = model(input_ids=ids, labels=labels, output_router_logits=True)
    assert spy["moe_experts"] == LAYERS and o.logits.dtype == torch.bfloat16
    assert_close(o.logits, o_ref.logits, "bf16 logits", "bf16")
    assert_close(o.loss, o_ref.loss, "bf16 loss", "bf16")
    o.loss.backward()
    assert all(p.grad is not None and p.grad.dtype == torch.bfloat16 for p in model.parameters())


def test_f16_mixtral_runs_pykern_experts_and_matches_unpatched(spy):
    # float16 experts and routers run pykern's f16 kernels (no fallback to transformers' grouped_mm)
    ref = tiny("Mixtral").to(torch.float16)
    model = pt.apply(copy.deepcopy(ref), fused_linear_cross_entropy=False)
    ids, labels = batch()
    o_ref = ref(input_ids=ids, labels=labels, output_router_logits=True)
    o = model(input_ids=ids, labels=labels, output_router_logits=True)
    assert spy["moe_experts"] == LAYERS and spy["moe_route"] == LAYERS and o.logits.dtype == torch.float16
    assert_close(o.logits, o_ref.logits, "f16 logits", "f16")
    assert_close(o.loss, o_ref.loss, "f16 loss", "f16")
    o.loss.backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float16 and torch.isfinite(p.grad).all()
               for p in model.parameters())


def test_patched_moe_model_compiles_fullgraph(spy):
    """torch.compile(fullgraph=True) traces the swapped routers and the registry's experts (custom ops).
    (Router-logit capture itself does not trace: transformers installs its hooks under a lock, patched
    or not.)"""
    ref = tiny("Qwen3Moe")
    model = pt.apply(copy.deepcopy(ref), fused_linear_cross_entropy=False)
    ids, labels = batch()
    torch._dynamo.reset()
    o = torch.compile(model, fullgraph=True, backend="aot_eager")(input_ids=ids, labels=labels)
    o.loss.backward()
    o_ref = ref(input_ids=ids, labels=labels)
    o_ref.loss.backward()
    assert spy["moe_experts"] == spy["moe_route"] == spy["moe_experts_backward"] == LAYERS
    assert_close(o.logits, o_ref.logits, "compiled logits")
    assert_grads_close(model, ref, "compiled grad")
