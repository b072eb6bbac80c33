"""pykern.torch.apply on tiny random-weight Hugging Face models (built from configs: nothing is downloaded).

A patched model must match the unpatched one: logits, loss, every parameter's
gradient, and greedy generation (prefill + KV-cached decode with n_q != n_k).
"""
from __future__ import annotations

import copy
from collections import Counter

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import pykern.torch as pt  # noqa: E402
import pykern.torch.functional as ptf  # noqa: E402
from pykern.torch.hf import QKNormDeferred  # noqa: E402
from pykern.errors import ArgumentTypeError  # noqa: E402
from pykern.tolerance import tolerance  # noqa: E402

from gpu import requires_gpu  # noqa: E402

MODELS = ["Llama", "Mistral", "Qwen2", "Qwen3"]


def tiny(name: str, **extra):
    kw = dict(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=False, rms_norm_eps=1e-5,
    )
    if name == "Qwen3":
        kw["head_dim"] = 16
    kw.update(extra)
    return build_tiny(name + "Config", name + "ForCausalLM", kw)


def build_tiny(cfg_cls: str, model_cls: str, kw: dict, norm_base: float = 1.0):
    """transformers' model_cls over cfg_cls(**kw), random weights (seed 0), fp32, and random non-trivial norm
    weights norm_base + 0.3 N(0, 1), so a norm that drops its weight cannot pass."""
    cfg = getattr(transformers, cfg_cls)(**kw)
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(cfg).float()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.copy_(norm_base + 0.3 * torch.randn_like(p))
    return model


def assert_grads_close(model, ref, what: str = "grad", every: bool = False) -> None:
    """Each parameter's gradient in model close to that of ref's parameter of the same name (`what name` in a
    failure); every: each parameter has a gradient and none of ref's is left out."""
    named_ref = dict(ref.named_parameters())
    n = 0
    for pname, p in model.named_parameters():
        if every:
            assert p.grad is not None, pname
        assert_close(p.grad, named_ref[pname].grad, f"{what} {pname}")
        n += 1
    if every:
        assert n == len(named_ref)


def left_padding_mask(ids):
    """An attention mask over ids with the second row's first 4 positions padding (left padding)."""
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    return mask


def loss_backward_both(ref, model, calls, ids, labels):
    """(o, o_ref): model's and ref's outputs on (ids, labels), each loss backpropagated; ref runs first and must
    launch no pykern kernel (calls: the spy's counts)."""
    o_ref = ref(input_ids=ids, labels=labels)
    assert not calls, "the unpatched model must not run pykern kernels"
    o = model(input_ids=ids, labels=labels)
    o_ref.loss.backward()
    o.loss.backward()
    return o, o_ref


def assert_apply_generates_same(ref, prompt, max_new_tokens: int = 5):
    """pt.apply on a copy of ref; greedy generation from prompt (all positions attended) gives the same tokens on
    both. Returns the patched copy."""
    model = pt.apply(copy.deepcopy(ref))
    kw = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=max_new_tokens, do_sample=False)
    want = ref.generate(prompt, **kw)
    got = model.generate(prompt, **kw)
    assert got.tolist() == want.tolist()
    return model


def assert_close(out, ref, what: str, dtype: str = "f32"):
    atol, rtol = tolerance("torch_apply", dtype)
    out, ref = out.detach().double(), ref.detach().double()
    err = (out - ref).abs()
    assert bool((err <= atol + rtol * ref.abs()).all()), f"{what}: max err {err.max().item():.3g}"


@pytest.fixture
def spy(monkeypatch):
    """Counts the pykern ops the torch layer runs (op name -> calls) and the flash-attention shapes."""
    calls: Counter = Counter()
    shapes: list = []
    real = ptf.call

    def call(name, *args, **kw):
        calls[name] += 1
        if name == "flash_attention":
            shapes.append((args[0].shape[1], args[1].shape[1]))
        return real(name, *args, **kw)

    monkeypatch.setattr(ptf, "call", call)
    return calls, shapes


def batch(low: int = 0):
    """Token ids (2 x 9, from [low, 128), seed 1) and their labels, the first row's first 3 masked (-100)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(low, 128, (2, 9), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100
    return ids, labels


def assert_apply_keeps_parameters(model) -> None:
    """pt.apply patches `model` in place: the same object, the same state_dict keys, the same Parameter objects."""
    params = {n: p for n, p in model.named_parameters()}
    keys = list(model.state_dict())
    assert pt.apply(model) is model
    assert list(model.state_dict()) == keys
    for n, p in model.named_parameters():
        assert p is params[n], n


@pytest.mark.parametrize("name", MODELS)
def test_patched_model_matches_logits_loss_and_gradients(name, spy):
    calls, _ = spy
    ref = tiny(name)
    model = pt.apply(copy.deepcopy(ref), fused_linear_cross_entropy=False)  # compares the logits too
    ids, labels = batch()
    o, o_ref = loss_backward_both(ref, model, calls, ids, labels)
    for op in ("rms_norm", "qk_norm_rope", "silu_gate", "flash_attention", "cross_entropy_fwd_bwd",
               "rms_norm_backward", "silu_gate_backward", "attention_backward"):
        assert calls[op] > 0, f"{op} did not run on pykern"
    assert_close(o.logits, o_ref.logits, "logits")
    assert_close(o.loss, o_ref.loss, "loss")
    assert_grads_close(model, ref, every=True)
    if name == "Qwen3":  # q_norm / k_norm on the head dim run fused into the rotation (their pykern RMSNorm inside)
        attn = model.model.layers[0].self_attn
        for norm in (attn.q_norm, attn.k_norm):
            assert isinstance(norm, QKNormDeferred) and isinstance(norm.norm, pt.RMSNorm)
        assert calls["qk_norm_rope_backward"] == model.config.num_hidden_layers


@pytest.mark.parametrize("name", MODELS)
def test_patched_model_greedy_generate_same_tokens(name, spy):
    calls, shapes = spy
    ref = tiny(name)
    assert_apply_generates_same(ref, batch()[0][:1, :6])
    # prefill (6 queries, 6 keys) and KV-cached decode steps (1 query, 7.. keys) ran on pykern
    assert (6, 6) in shapes and (1, 7) in shapes and (1, 10) in shapes, shapes


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_steps_run_the_tensor_core_decode_kernel(dtype, spy):
    """A one-token step of a 16-bit model whose heads the tensor-core decode kernel takes (head_dim 64, 2 query
    heads a kv head) runs pykern.ops.batched_decode_attention on the cache in place (no flash attention, no
    copy); the prefill stays on flash attention. Tokens and the decode step's logits match the unpatched model."""
    calls, shapes = spy
    ref = tiny("Llama", hidden_size=128, num_attention_heads=2, num_key_value_heads=1).to(dtype)
    model = pt.apply(copy.deepcopy(ref))
    prompt = batch()[0][:2, :6]
    kw = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=4, do_sample=False)
    want = ref.generate(prompt, **kw)
    assert model.generate(prompt, **kw).tolist() == want.tolist()
    assert calls["batched_decode_attention"] == 2 * 3  # 2 layers x 3 decode steps (the 4th token needs none)
    assert shapes == [(6, 6)] * 2  # flash attention ran the prefill only
    with torch.no_grad():  # a decode step's logits, beside the unpatched model's
        pre = ref(input_ids=prompt, use_cache=True)
        pre_p = model(input_ids=prompt, use_cache=True)
        nxt = want[:, 6:7]
        o_ref = ref(input_ids=nxt, past_key_values=pre.past_key_values, use_cache=True).logits
        o = model(input_ids=nxt, past_key_values=pre_p.past_key_values, use_cache=True).logits
    assert_close(o, o_ref, "decode-step logits", "bf16" if dtype == torch.bfloat16 else "f16")
    # with gradients wanted the step stays on flash attention (the decode kernel has no backward)
    n = calls["batched_decode_attention"]
    model(input_ids=nxt, past_key_values=pre_p.past_key_values, use_cache=True).logits.sum().backward()
    assert calls["batched_decode_attention"] == n


def test_apply_enable_pdl_reaches_the_decode_launch(monkeypatch):
    """apply(enable_pdl=True): every one-token step's batched_decode_attention call launches the tensor-core decode
    kernel with programmatic dependent launch (an ordinary launch on the host backend: the same tokens); the default
    is off; a non-bool is refused before anything is patched."""
    seen: list = []
    real = ptf.call

    def call(name, *args, **kw):
        if name == "batched_decode_attention":
            seen.append(kw.get("enable_pdl"))
        return real(name, *args, **kw)

    monkeypatch.setattr(ptf, "call", call)
    ref = tiny("Llama", hidden_size=128, num_attention_heads=2, num_key_value_heads=1).to(torch.bfloat16)
    prompt = batch()[0][:2, :6]
    kw = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=3, do_sample=False)
    want = ref.generate(prompt, **kw)
    for pdl in (True, False):
        seen.clear()
        model = pt.apply(copy.deepcopy(ref), enable_pdl=True) if pdl else pt.apply(copy.deepcopy(ref))
        assert model.generate(prompt, **kw).tolist() == want.tolist()
        assert seen == [pdl] * (2 * 2), seen  # 2 layers x 2 decode steps
    with pytest.raises(ArgumentTypeError, match=r"^enable_pdl: expected a bool, got str 'yes'"):
        pt.apply(copy.deepcopy(ref), enable_pdl="yes")


@pytest.mark.parametrize("name", ["Llama", "Qwen3"])
def test_bf16_patched_model_matches_unpatched(name, spy):
    calls, _ = spy
    ref = tiny(name).to(torch.bfloat16)
    model = pt.apply(copy.deepcopy(ref), fused_linear_cross_entropy=False)  # compares the logits too
    ids, labels = batch()
    o_ref, o = ref(input_ids=ids, labels=labels), model(input_ids=ids, labels=labels)
    assert calls["qk_norm_rope"] and calls["flash_attention"] and calls["cross_entropy_fwd_bwd"]
    assert o.logits.dtype == torch.bfloat16 and o.loss.dtype == torch.float32  # as HF: the loss is fp32
    assert_close(o.logits, o_ref.logits, "bf16 logits", "bf16")
    assert_close(o.loss, o_ref.loss, "bf16 loss", "bf16")
    o.loss.backward()
    assert all(p.grad is not None and p.grad.dtype == torch.bfloat16 for p in model.parameters())


def test_chunked_prefill_after_cache_is_bottom_right(spy):
    _, shapes = spy
    ref = tiny("Qwen3")
    model = pt.apply(copy.deepcopy(ref))
    ids, _ = batch()
    outs = []
    for m in (ref, model):
        first = m(input_ids=ids[:, :6], use_cache=True)
        outs.append(m(input_ids=ids[:, 6:], past_key_values=first.past_key_values, use_cache=True).logits)
    assert (3, 9) in shapes, shapes  # 3 new queries over 9 keys ran on pykern
    assert_close(outs[1], outs[0], "logits of a 3-token chunk after a 6-token cache")


def test_gradient_checkpointing_matches(spy):
    calls, _ = spy
    ref = tiny("Llama")
    model = pt.apply(copy.deepcopy(ref))
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()
    model.train()
    ref.train()
    ids, labels = batch()
    ref(input_ids=ids, labels=labels).loss.backward()
    model(input_ids=ids, labels=labels).loss.backward()
    assert calls["qk_norm_rope"] == 3 * 2  # q and k in one launch: the forward, the recomputed forward and the backward
    # of 2 layers
    named_ref = dict(ref.named_parameters())
    for pname, p in model.named_parameters():
        assert_close(p.grad, named_ref[pname].grad, f"grad {pname} (checkpointed)")


def test_num_items_in_batch_loss_matches_hf():
    ref = tiny("Llama")
    model = pt.apply(copy.deepcopy(ref))
    ids, labels = batch()
    n = torch.tensor(11)
    assert_close(model(input_ids=ids, labels=labels, num_items_in_batch=n).loss,
                 ref(input_ids=ids, labels=labels, num_items_in_batch=n).loss, "loss (sum / num_items)")


def test_padding_mask_falls_back_and_stays_correct(spy):
    calls, shapes = spy
    ref = tiny("Llama")
    model = pt.apply(copy.deepcopy(ref))
    ids, _ = batch()
    mask = left_padding_mask(ids)
    o_ref = ref(input_ids=ids, attention_mask=mask).logits
    o = model(input_ids=ids, attention_mask=mask).logits
    assert not shapes, "a padded batch must not reach the plain-causal pykern attention"
    assert calls["rms_norm"] > 0
    assert_close(o[0], o_ref[0], "logits row 0")
    assert_close(o[1, 4:], o_ref[1, 4:], "logits row 1 (valid tokens)")
    # an all-ones mask is the plain causal case again
    o = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    assert shapes == [(9, 9), (9, 9)]
    assert_close(o, ref(input_ids=ids).logits, "logits, all-ones mask")


def test_sliding_window_shorter_than_sequence_runs_on_pykern(spy):
    calls, _ = spy
    ref = tiny("Mistral", sliding_window=4)
    model = pt.apply(copy.deepcopy(ref))
    ids, _ = batch()
    assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits, "logits with a 4-token window")
    assert calls["flash_attention"] == ref.config.num_hidden_layers  # the window runs on pykern, not SDPA


def test_apply_keeps_parameters_and_state_dict():
    ref = tiny("Qwen2")
    model = copy.deepcopy(ref)
    assert_apply_keeps_parameters(model)
    assert model.config._attn_implementation == "pykern"
    assert isinstance(model.model.norm, pt.RMSNorm)
    assert isinstance(model.model.layers[1].mlp, pt.SwiGLUMLP)
    model.load_state_dict(ref.state_dict())
    assert pt.apply(model) is model  # idempotent: nothing is wrapped twice
    assert len(model.model.layers[0].self_attn._forward_pre_hooks) == 1


def compiled_loss_backward(model, ref, ids, labels):
    """(o, o_ref): model under torch.compile(fullgraph=True) and the unpatched ref on (ids, labels), each loss
    backpropagated."""
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    o = compiled(input_ids=ids, labels=labels)
    o.loss.backward()
    o_ref = ref(input_ids=ids, labels=labels)
    o_ref.loss.backward()
    return o, o_ref


@pytest.mark.parametrize("name", ["Llama", "Qwen3"])  # Qwen3: q_norm / k_norm deferred into qk_norm_rope
def test_patched_model_compiles_fullgraph(spy, name):
    calls, _ = spy
    ref = tiny(name)
    model = pt.apply(copy.deepcopy(ref), fused_linear_cross_entropy=False)  # compares the logits too
    o, o_ref = compiled_loss_backward(model, ref, *batch())
    assert calls["qk_norm_rope"] and calls["flash_attention"] and calls["attention_backward"]
    if name == "Qwen3":  # the norm ran fused (its backward is the fused one), also under torch.compile
        assert calls["qk_norm_rope_backward"] == model.config.num_hidden_layers
    assert_close(o.logits, o_ref.logits, "compiled logits")
    assert_close(o.loss, o_ref.loss, "compiled loss")
    assert_grads_close(model, ref, "compiled grad")


def test_unsupported_model_raises_naming_its_class():
    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    with pytest.raises(ArgumentTypeError, match="GPT2LMHeadModel"):
        pt.apply(transformers.GPT2LMHeadModel(cfg))
    with pytest.raises(ArgumentTypeError, match="Linear"):
        pt.apply(torch.nn.Linear(2, 2))


def test_unsupported_activation_raises():
    with pytest.raises(ArgumentTypeError, match="hidden_act"):
        pt.apply(tiny("Llama", hidden_act="gelu"))


@requires_gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs torch with CUDA")
@pytest.mark.parametrize("name", MODELS)
def test_patched_model_on_cuda(name):
    ref = tiny(name).cuda()
    model = pt.apply(copy.deepcopy(ref), fused_linear_cross_entropy=False)  # compares the logits too
    ids, labels = (t.cuda() for t in batch())
    o_ref, o = ref(input_ids=ids, labels=labels), model(input_ids=ids, labels=labels)
    o_ref.loss.backward()
    o.loss.backward()
    assert_close(o.logits, o_ref.logits, "logits")
    assert_close(o.loss, o_ref.loss, "loss")
    assert_grads_close(model, ref)
    prompt = ids[:1, :6]
    kw = dict(attention_mask=torch.ones_like(prompt), max_new_tokens=5, do_sample=False)
    assert model.generate(prompt, **kw).tolist() == ref.generate(prompt, **kw).tolist()


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_fused_linear_cross_entropy_loss_and_gradients_match_unpatched(dtype, monkeypatch):
    """In training with labels the patched Llama takes its loss from the fused linear cross-entropy
    (no logits); the loss and every parameter's gradient still match the unpatched model."""
    import pykern.torch.training as ptt

    used = Counter()
    real = ptt.call

    def call(name, *args, **kw):
        used[name] += 1
        return real(name, *args, **kw)

    monkeypatch.setattr(ptt, "call", call)
    ref = tiny("Llama")
    if dtype == "bf16":
        ref = ref.to(torch.bfloat16)
    model = pt.apply(copy.deepcopy(ref))
    ids, labels = batch()
    o_ref, o = ref(input_ids=ids, labels=labels), model(input_ids=ids, labels=labels)
    assert used["fused_linear_cross_entropy"] == 1 and o.logits is None
    o_ref.loss.backward()
    o.loss.backward()
    assert_close(o.loss, o_ref.loss, "loss", dtype)
    named_ref = dict(ref.named_parameters())
    for pname, p in model.named_parameters():
        assert p.grad is not None, pname
        assert_close(p.grad, named_ref[pname].grad, f"grad {pname}", dtype)
    n = torch.tensor(11)
    assert_close(model(input_ids=ids, labels=labels, num_items_in_batch=n).loss,
                 ref(input_ids=ids, labels=labels, num_items_in_batch=n).loss, "loss (sum / num_items)", dtype)
    model.eval()  # eval mode: logits are returned again, the loss from the cross-entropy kernel
    o = model(input_ids=ids, labels=labels)
    assert o.logits is not None and used["fused_linear_cross_entropy"] == 2
    assert_close(o.loss, ref.eval()(input_ids=ids, labels=labels).loss, "eval loss", dtype)


def test_fused_linear_cross_entropy_model_compiles_fullgraph():
    ref = tiny("Llama")
    model = pt.apply(copy.deepcopy(ref))
    ids, labels = batch()
    torch._dynamo.reset()
    o = torch.compile(model, fullgraph=True, backend="aot_eager")(input_ids=ids, labels=labels)
    assert o.logits is None
    o.loss.backward()
    o_ref = ref(input_ids=ids, labels=labels)
    o_ref.loss.backward()
    assert_close(o.loss, o_ref.loss, "compiled fused loss")
    assert_grads_close(model, ref, "compiled fused grad")


@pytest.mark.parametrize("name", MODELS)
def test_f16_patched_model_matches_unpatched(name, spy):
    calls, _ = spy
    ref = tiny(name).to(torch.float16)
    model = pt.apply(copy.deepcopy(ref), fused_linear_cross_entropy=False)  # compares the logits too
    ids, labels = batch()
    o_ref, o = ref(input_ids=ids, labels=labels), model(input_ids=ids, labels=labels)
    for op in ("rms_norm", "qk_norm_rope", "silu_gate", "cross_entropy_fwd_bwd"):  # the f16 kernels
        assert calls[op] > 0, f"{op} did not run on pykern"
    assert o.logits.dtype == torch.float16 and o.loss.dtype == torch.float32
    assert_close(o.logits, o_ref.logits, "f16 logits", "f16")
    assert_close(o.loss, o_ref.loss, "f16 loss", "f16")
    o.loss.backward()
    assert calls["rms_norm_backward"] and calls["silu_gate_backward"]
    assert all(p.grad is not None and p.grad.dtype == torch.float16 and torch.isfinite(p.grad).all()
               for p in model.parameters())


@pytest.mark.parametrize("name", ["Llama", "Qwen2"])
def test_trains_under_f16_autocast_with_grad_scaler(name, spy):
    # mixed precision the float16 way: fp32 master weights, float16 autocast, a loss scale that
    # GradScaler unscales before the step; the patched model follows the unpatched one step for step
    calls, _ = spy
    ref = tiny(name)
    model = pt.apply(copy.deepcopy(ref))
    ids, labels = batch()
    losses = {}
    for tag, m in (("ref", ref), ("pykern", model)):
        m.train()
        opt = torch.optim.SGD(m.parameters(), lr=0.05)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12)
        seen = []
        for _ in range(3):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = m(input_ids=ids, labels=labels).loss
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            seen.append(loss.item())
        assert scaler.get_scale() == 2.0 ** 12, "a step overflowed and was skipped"
        losses[tag] = seen
    assert calls["rms_norm_backward"] and calls["silu_gate"] and calls["silu_gate_backward"]
    assert losses["pykern"][-1] < losses["pykern"][0]  # it learns
    for a, b in zip(losses["pykern"], losses["ref"]):
        assert abs(a - b) <= 2e-2 * abs(b) + 2e-2, (losses["pykern"], losses["ref"])


def _packed_batch():
    """Two rows, each several sequences packed back to back (position_ids restart at 0), no attention_mask."""
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 128, (2, 12), generator=g)
    pos = torch.tensor([list(range(5)) + list(range(7)), list(range(3)) + list(range(4)) + list(range(5))])
    labels = ids.clone()
    labels[:, 5] = -100  # as a packing collator: no target across a sequence boundary
    return ids, pos, labels


@pytest.mark.parametrize("name,extra,use_cache,dtype", [("Llama", {}, False, "bf16"), ("Llama", {}, True, "bf16"),
                                                        ("Mistral", {"sliding_window": 3}, False, "bf16"),
                                                        ("Llama", {}, True, "f32")])
def test_packed_sequences_train_on_flash_attention_varlen(name, extra, use_cache, dtype, spy):
    # Without a cache object transformers builds the packed sequences' block-causal mask from position_ids (the
    # reference runs it on SDPA); with one it leaves the mask causal and, as its flash-attention path, apply
    # reads the packing from position_ids (in training). Either way: flash_attention_varlen, forward and backward.
    calls, shapes = spy
    ref = tiny(name, **extra).to({"bf16": torch.bfloat16, "f32": torch.float32}[dtype])
    model = pt.apply(copy.deepcopy(ref), fused_linear_cross_entropy=False)
    model.train()  # (no dropout in these configs: train mode changes nothing else)
    ids, pos, labels = _packed_batch()
    o_ref = ref(input_ids=ids, position_ids=pos, labels=labels, use_cache=False)
    o = model(input_ids=ids, position_ids=pos, labels=labels, use_cache=use_cache)
    n_layers = ref.config.num_hidden_layers
    assert calls["flash_attention_varlen"] == n_layers and not shapes  # not the dense path, not SDPA
    assert_close(o.logits, o_ref.logits, "logits of packed sequences", dtype)
    assert_close(o.loss, o_ref.loss, "loss of packed sequences", dtype)
    o.loss.backward()
    o_ref.loss.backward()
    assert calls["flash_attention_varlen_backward"] == n_layers
    named_ref = dict(ref.named_parameters())
    for pname, p in model.named_parameters():
        assert_close(p.grad, named_ref[pname].grad, f"grad {pname} (packed)", dtype)
    # a packed sequence gives what it gives alone (the first row's second one)
    with torch.no_grad():
        alone = ref(input_ids=ids[:1, 5:], use_cache=False).logits
    assert_close(o.logits[:1, 5:], alone, "logits of one packed sequence vs alone", dtype)


def test_packed_sequences_with_padding_keep_the_sdpa_path(spy):
    # a padding mask on top of packing is not the packed causal mask: SDPA, never approximated
    calls, _ = spy
    ref = tiny("Llama").to(torch.bfloat16)
    model = pt.apply(copy.deepcopy(ref), fused_linear_cross_entropy=False)
    ids, pos, _ = _packed_batch()
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    o = model(input_ids=ids, position_ids=pos, attention_mask=mask, use_cache=False).logits
    assert calls["flash_attention_varlen"] == 0
    o_ref = ref(input_ids=ids, position_ids=pos, attention_mask=mask, use_cache=False).logits
    assert_close(o[0], o_ref[0], "row 0", "bf16")
