"""pykern.torch.apply on the families past LLaMA's layout, tiny random-weight models built from configs
(nothing is downloaded): Mistral with a sliding window, Qwen2/3 with window layers, Gemma 1/2/3 (text)
and Phi-3. Each has local (sliding-window) and global layers where the family has them; every attention
runs on pykern's kernels with the layer's window and softcap (a spy proves no SDPA / eager fallback for
prefill and cached decode); logits, loss and gradients match the unpatched model, training losses stay
equal over AdamW steps and greedy generation gives the same tokens."""
from __future__ import annotations

import copy
from collections import Counter

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import pykern.torch as pt  # noqa: E402
import pykern.torch.functional as ptf  # noqa: E402
import pykern.torch.hf as hf  # noqa: E402
import pykern.torch.training as ptt  # noqa: E402
from test_torch_apply import assert_close  # the one comparison against the torch_apply tolerance row
from test_torch_apply import (
    assert_grads_close, loss_backward_both, assert_apply_generates_same, batch as apply_batch, build_tiny,
    compiled_loss_backward, left_padding_mask,
)

W = 4  # sliding window (tokens, the current one included): shorter than the 9-token batch

BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
FAMILIES = {
    # name: (config class, model class, extra config, sliding layers, has attention softcap)
    "Mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=W), {0, 1}),
    "Qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(use_sliding_window=True, sliding_window=W,
                                                      max_window_layers=1), {1}),
    "Qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(use_sliding_window=True, sliding_window=W, max_window_layers=1,
                                                      head_dim=16), {1}),
    "Gemma": ("GemmaConfig", "GemmaForCausalLM", dict(head_dim=16, hidden_act="gelu_pytorch_tanh"), set()),
    "Gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(head_dim=16, sliding_window=W, query_pre_attn_scalar=24,
                                                         attn_logit_softcapping=1.5, final_logit_softcapping=3.0,
                                                         hidden_activation="gelu_pytorch_tanh"), {0}),
    "Gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(head_dim=16, sliding_window=W, query_pre_attn_scalar=24,
                                                             layer_types=["sliding_attention", "full_attention"],
                                                             final_logit_softcapping=3.0,
                                                             hidden_activation="gelu_pytorch_tanh"), {0}),
    "Phi3": ("Phi3Config", "Phi3ForCausalLM", dict(sliding_window=W, pad_token_id=0), {0, 1}),
}
NAMES = list(FAMILIES)


def tiny(name: str):
    cfg_cls, model_cls, extra, _ = FAMILIES[name]
    # Gemma's norm weights are offsets from 1: non-trivial ones are around 0
    return build_tiny(cfg_cls, model_cls, dict(BASE, **extra), norm_base=0.0 if name.startswith("Gemma") else 1.0)


def rel_diff(out, ref) -> float:
    return float((out.double() - ref.double()).abs().max() / ref.double().abs().max())



@pytest.fixture
def spy(monkeypatch):
    """pykern ops run (name -> calls), flash-attention (n_q, n_k, window_size, softcap) and fallbacks."""
    calls: Counter = Counter()
    attn: list = []
    real_call, real_fb = ptf.call, hf._fallback

    def call(name, *args, **kw):
        calls[name] += 1
        if name == "flash_attention":
            attn.append((args[0].shape[1], args[1].shape[1], kw.get("window_size"), kw.get("softcap")))
        return real_call(name, *args, **kw)

    def fallback(*a, **kw):
        calls["fallback"] += 1
        return real_fb(*a, **kw)

    monkeypatch.setattr(ptf, "call", call)
    monkeypatch.setattr(ptt, "call", call)
    monkeypatch.setattr(hf, "_fallback", fallback)
    return calls, attn


def batch():
    return apply_batch(low=1)


def _expected_attention(name: str, model) -> list:
    """(window_size, softcap) per layer, in layer order."""
    sliding = FAMILIES[name][3]
    cap = getattr(model.config, "attn_logit_softcapping", None) if name == "Gemma2" else None
    return [((W - 1, 0) if i in sliding else (-1, 0), 0.0 if cap is None else float(cap))
            for i in range(model.config.num_hidden_layers)]


@pytest.mark.parametrize("name", NAMES)
def test_logits_loss_gradients_match_and_every_attention_runs_on_pykern(name, spy):
    calls, attn = spy
    ref = tiny(name)
    model = pt.apply(copy.deepcopy(ref), fused_linear_cross_entropy=False)
    ids, labels = batch()
    o, o_ref = loss_backward_both(ref, model, calls, ids, labels)
    gated = "gelu_gate" if name.startswith("Gemma") else "silu_gate"
    for op in ("rms_norm", "qk_norm_rope", gated, "flash_attention", "cross_entropy_fwd_bwd", "rms_norm_backward",
               gated + "_backward", "attention_backward"):
        assert calls[op] > 0, f"{op} did not run on pykern"
    assert calls["fallback"] == 0, "an attention fell back to SDPA / eager"
    assert [(a[2], a[3]) for a in attn] == _expected_attention(name, model)
    assert_close(o.logits, o_ref.logits, "logits")
    assert rel_diff(o.logits, o_ref.logits) <= 1e-4
    assert_close(o.loss, o_ref.loss, "loss")
    assert_grads_close(model, ref)
    if name == "Gemma3":  # q_norm / k_norm are Gemma RMSNorms too, run fused into the rotation
        a = model.model.layers[0].self_attn
        assert isinstance(a.q_norm, hf.QKNormDeferred) and isinstance(a.q_norm.norm, pt.RMSNorm)
        assert a.q_norm.norm.offset == 1.0 and a.q_norm.offset == 1.0


@pytest.mark.parametrize("name", NAMES)
def test_greedy_generate_same_tokens_prefill_and_decode_on_pykern(name, spy):
    calls, attn = spy
    ref = tiny(name)
    model = assert_apply_generates_same(ref, batch()[0][:1, :6])
    assert calls["fallback"] == 0, "an attention fell back to SDPA / eager"
    sliding = FAMILIES[name][3]
    n_layers = model.config.num_hidden_layers
    prefill, decode = attn[:n_layers], attn[n_layers:]
    assert all(a[:2] == (6, 6) for a in prefill)
    assert len(decode) == 4 * n_layers and all(a[0] == 1 for a in decode)
    for i, a in enumerate(decode):  # sliding layers decode over their W - 1 cached keys + the new one
        step, layer = divmod(i, n_layers)
        assert a[1] == (min(W, 7 + step) if layer in sliding else 7 + step), (i, a)


@pytest.mark.parametrize("name", NAMES)
def test_training_losses_stay_equal_over_adamw_steps(name):
    ref = tiny(name)
    model = pt.apply(copy.deepcopy(ref))  # the fused linear cross-entropy (with Gemma's final softcap)
    ref.train()
    model.train()
    o_ref, o_pk = (torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (ref, model))
    ids, labels = batch()
    for step in range(4):
        losses = []
        for m, opt in ((ref, o_ref), (model, o_pk)):
            opt.zero_grad()
            loss = m(input_ids=ids, labels=labels).loss
            loss.backward()
            opt.step()
            losses.append(loss)
        assert_close(losses[1], losses[0], f"loss at step {step}")


def _gemma3_qk_norm_fused(model, calls) -> None:
    """Gemma 3's q_norm / k_norm ran inside qk_norm_rope (forward and backward), one launch a layer, and no
    separate RMSNorm ran for them: the 4 RMSNorms a layer and the final one only."""
    n = model.config.num_hidden_layers
    assert calls["qk_norm_rope"] == n and calls["qk_norm_rope_backward"] == n, calls
    assert calls["rms_norm"] == 4 * n + 1 and calls["rms_norm_backward"] == 4 * n + 1, calls


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_gemma3_qk_norm_runs_fused_into_rope(dtype, spy):
    """Gemma 3 normalises q and k (x * (1 + w)) after the head transpose, then rotates them with the layer's
    tables (local layers: rope_local_base_freq, global ones: rope_theta): apply fuses the norm into the
    rotation as Qwen3's, keeping the Parameters and state_dict keys, and matches the unpatched model."""
    calls, _ = spy
    ref = tiny("Gemma3")
    assert ref.config.rope_parameters["sliding_attention"]["rope_theta"] != \
        ref.config.rope_parameters["full_attention"]["rope_theta"]  # the two kinds of layers rotate differently
    if dtype == "bf16":
        ref = ref.to(torch.bfloat16)
    model = copy.deepcopy(ref)
    params = dict(model.named_parameters())
    keys = list(model.state_dict())
    pt.apply(model, fused_linear_cross_entropy=False)
    assert list(model.state_dict()) == keys and all(p is params[k] for k, p in model.named_parameters())
    for layer in model.model.layers:
        for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
            assert isinstance(norm, hf.QKNormDeferred) and norm.offset == 1.0
    ids, labels = batch()
    o, o_ref = loss_backward_both(ref, model, calls, ids, labels)
    _gemma3_qk_norm_fused(model, calls)
    assert calls["fallback"] == 0
    assert_close(o.logits, o_ref.logits, "logits", dtype)
    assert_close(o.loss, o_ref.loss, "loss", dtype)
    if dtype == "f32":
        assert_grads_close(model, ref)
    else:  # the bf16 gradients against the f32 model's (HF's bf16 ones round every step, ours fewer)
        f32 = tiny("Gemma3")
        f32(input_ids=ids, labels=labels).loss.backward()
        named = dict(f32.named_parameters())
        for pname, p in model.named_parameters():
            assert p.grad.dtype == torch.bfloat16, pname
            assert_close(p.grad, named[pname].grad, f"bf16 grad {pname}", "bf16")


def test_gemma3_qk_norm_fused_without_the_rms_norm_swap(spy):
    """rms_norm=False leaves transformers' Gemma3RMSNorm (no offset attribute) in q_norm / k_norm: the fused
    kernel still applies its x * (1 + w)."""
    calls, _ = spy
    ref = tiny("Gemma3")
    model = pt.apply(copy.deepcopy(ref), rms_norm=False, fused_linear_cross_entropy=False)
    q_norm = model.model.layers[0].self_attn.q_norm
    assert type(q_norm.norm).__name__ == "Gemma3RMSNorm" and q_norm.offset == 1.0
    ids, labels = batch()
    o, o_ref = loss_backward_both(ref, model, calls, ids, labels)
    n = model.config.num_hidden_layers
    assert calls["qk_norm_rope"] == n and calls["qk_norm_rope_backward"] == n and calls["rms_norm"] == 0
    assert_close(o.logits, o_ref.logits, "logits")
    assert_grads_close(model, ref)


def test_gemma3_qk_norm_fused_compiles_fullgraph(spy):
    calls, _ = spy
    ref = tiny("Gemma3")
    model = pt.apply(copy.deepcopy(ref), fused_linear_cross_entropy=False)
    o, o_ref = compiled_loss_backward(model, ref, *batch())
    _gemma3_qk_norm_fused(model, calls)
    assert_close(o.logits, o_ref.logits, "compiled logits")
    assert_grads_close(model, ref, "compiled grad")


def test_gemma_rms_norm_and_geglu_are_swapped_exactly():
    model = pt.apply(tiny("Gemma2"))
    layer = model.model.layers[0]
    norms = [layer.input_layernorm, layer.post_attention_layernorm, layer.pre_feedforward_layernorm,
             layer.post_feedforward_layernorm, model.model.norm]
    assert all(isinstance(n, pt.RMSNorm) and n.offset == 1.0 for n in norms)
    assert type(layer.mlp).__name__ == "GatedMLP" and layer.mlp.activation == "gelu_pytorch_tanh"
    phi = pt.apply(tiny("Phi3"))
    assert type(phi.model.layers[0].mlp).__name__ == "FusedGateUpMLP"


def test_phi3_longrope_keeps_transformers_rope(spy):
    calls, _ = spy
    cfg = transformers.Phi3Config(**dict(BASE, pad_token_id=0, original_max_position_embeddings=32,
                                         rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                                          "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}))
    torch.manual_seed(0)
    ref = transformers.Phi3ForCausalLM(cfg).float()
    model = pt.apply(copy.deepcopy(ref))
    ids, _ = batch()
    assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits, "logits")
    assert calls["qk_norm_rope"] == 0 and calls["flash_attention"] > 0


def test_padding_mask_with_an_attention_softcap_falls_back_exactly(spy):
    calls, _ = spy
    ref = tiny("Gemma2")
    model = pt.apply(copy.deepcopy(ref))
    ids, _ = batch()
    mask = left_padding_mask(ids)
    o_ref, o = ref(input_ids=ids, attention_mask=mask).logits, model(input_ids=ids, attention_mask=mask).logits
    assert calls["fallback"] > 0  # padding masks go to transformers' formula (eager with the softcap)
    assert_close(o[0], o_ref[0], "logits row 0")
    assert_close(o[1, 4:], o_ref[1, 4:], "logits row 1 (valid tokens)")
