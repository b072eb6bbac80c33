"""pykern.torch under torch.autocast: every function and module gives what its torch counterpart gives
under the same autocast (output dtypes exactly; values and gradients within the bf16 tolerance, which
also bounds float16's finer rounding), on CPU here and on CUDA where a GPU is present."""
from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as TF  # noqa: E402

import pykern.torch as pt  # noqa: E402
from pykern.tolerance import tolerance  # noqa: E402

from gpu import requires_gpu  # noqa: E402

AMP = [torch.bfloat16, torch.float16]


def _rot(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), -1)


def _hf_rope(q, k, cos, sin):  # HF LLaMA's apply_rotary_pos_emb on (b, s, heads, d) tensors
    c, s = cos.unsqueeze(2), sin.unsqueeze(2)
    return q * c + _rot(q) * s, k * c + _rot(k) * s


def _sdpa(q, k, v):
    return TF.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True).transpose(1, 2)


def _rope_tables(s, d):
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    f = torch.outer(torch.arange(s).float(), inv)
    emb = torch.cat((f, f), -1)[None]
    return emb.cos(), emb.sin()


T = torch.tensor
# name -> (pykern fn, torch fn, inputs(generator, device); float inputs get gradients)
CASES = {
    "rms_norm": (lambda x, w: pt.rms_norm(x, w, 1e-5), lambda x, w: TF.rms_norm(x, (x.shape[-1],), w, 1e-5),
                 lambda g: (torch.randn(5, 32, generator=g), 1 + 0.3 * torch.randn(32, generator=g))),
    "rms_norm mixed": (lambda x, w: pt.rms_norm(x, w, 1e-5), lambda x, w: TF.rms_norm(x, (32,), w, 1e-5),
                       lambda g: (torch.randn(5, 32, generator=g).bfloat16(), 1 + 0.3 * torch.randn(32, generator=g))),
    "layer_norm": (lambda x, w, b: pt.layer_norm(x, w, b), lambda x, w, b: TF.layer_norm(x, (32,), w, b),
                   lambda g: (torch.randn(5, 32, generator=g), 1 + 0.3 * torch.randn(32, generator=g),
                              torch.randn(32, generator=g))),
    "add_rms_norm": (lambda x, r, w: pt.add_rms_norm(x, r, w, 1e-5),
                     lambda x, r, w: (TF.rms_norm(x + r, (32,), w, 1e-5), x + r),
                     lambda g: (torch.randn(5, 32, generator=g).bfloat16(), torch.randn(5, 32, generator=g),
                                1 + 0.3 * torch.randn(32, generator=g))),
    "swiglu": (pt.swiglu, lambda a, b: TF.silu(a) * b,
               lambda g: (torch.randn(4, 24, generator=g).bfloat16(), torch.randn(4, 24, generator=g))),
    "gelu": (pt.gelu, TF.gelu, lambda g: (torch.randn(4, 24, generator=g),)),
    "gelu_gate": (pt.gelu_gate, lambda a, b: TF.gelu(a) * b,
                  lambda g: (torch.randn(4, 24, generator=g), torch.randn(4, 24, generator=g).bfloat16())),
    "rope": (lambda q, k, c, s: pt.rope(q, k, c, s), _hf_rope,
             lambda g: (torch.randn(2, 7, 4, 16, generator=g).bfloat16(), torch.randn(2, 7, 2, 16, generator=g).bfloat16(),
                        *_rope_tables(7, 16))),
    "flash_attention": (lambda q, k, v: pt.flash_attention(q, k, v, causal=True), _sdpa,
                        lambda g: tuple(torch.randn(2, 9, 2, 16, generator=g) for _ in range(3))),
    "cross_entropy": (lambda lg, t: pt.cross_entropy(lg, t), lambda lg, t: TF.cross_entropy(lg, t),
                      lambda g: (3 * torch.randn(6, 50, generator=g), torch.randint(0, 50, (6,), generator=g))),
    "fused_linear_cross_entropy": (
        lambda h, w, t, b: pt.fused_linear_cross_entropy(h, w, t, b),
        lambda h, w, t, b: TF.cross_entropy(TF.linear(h, w, b), t),
        lambda g: (torch.randn(6, 32, generator=g), 0.3 * torch.randn(50, 32, generator=g),
                   torch.randint(0, 50, (6,), generator=g), torch.randn(50, generator=g))),
    "embedding": (pt.embedding, lambda i, w: TF.embedding(i, w),
                  lambda g: (torch.randint(0, 10, (3, 4), generator=g), torch.randn(10, 8, generator=g))),
}


def _leaves(name, args, device):
    # every floating input is differentiated, except RoPE's cos/sin tables (constants, as in HF)
    n_grad = 2 if name == "rope" else len(args)
    return [a.to(device).requires_grad_(a.is_floating_point() and i < n_grad) for i, a in enumerate(args)]


def _run(fn, args, device, amp):
    args = [a.detach().clone().requires_grad_(a.requires_grad) for a in args]
    with torch.autocast(device, dtype=amp):
        out = fn(*args)
    outs = out if isinstance(out, tuple) else (out,)
    g = torch.Generator().manual_seed(7)
    total = sum((o.float() * torch.randn(o.shape, generator=g).to(device)).sum() for o in outs)
    total.backward()
    return outs, [a.grad for a in args if isinstance(a, torch.Tensor) and a.requires_grad]


def _close(what, out, ref, op):
    assert out.dtype == ref.dtype, f"{what}: dtype {out.dtype}, torch under autocast gives {ref.dtype}"
    atol, rtol = tolerance(op, "bf16")
    o, r = out.detach().double().cpu(), ref.detach().double().cpu()
    err = (o - r).abs()
    assert bool((err <= atol + rtol * r.abs()).all()), f"{what}: max err {err.max().item():.3g}"


_OPS = {"rms_norm": "rms_norm", "swiglu": "silu_gate", "cross_entropy": "cross_entropy_fwd_bwd"}


def _check_case(name, device, amp):
    fn, ref_fn, make = CASES[name]
    args = make(torch.Generator().manual_seed(0))
    if name == "rope":  # q, k as autocast's projections give them, with float32 tables (HF's, in a float32 model)
        args = (args[0].to(amp), args[1].to(amp), *args[2:])
    args = _leaves(name, args, device)
    outs, grads = _run(fn, args, device, amp)
    routs, rgrads = _run(ref_fn, args, device, amp)
    op = _OPS.get(name.split()[0], name.split()[0])
    for i, (o, r) in enumerate(zip(outs, routs)):
        _close(f"{name} output {i}", o, r, op)
    assert len(grads) == len(rgrads)
    for i, (o, r) in enumerate(zip(grads, rgrads)):
        _close(f"{name} grad {i}", o, r, op)


@pytest.mark.parametrize("amp", AMP, ids=["bf16", "f16"])
@pytest.mark.parametrize("name", list(CASES))
def test_functions_match_torch_under_cpu_autocast(name, amp):
    _check_case(name, "cpu", amp)


def test_fused_linear_cross_entropy_loss_is_float32_with_input_dtype_grads():
    g = torch.Generator().manual_seed(3)
    h = torch.randn(8, 32, generator=g, requires_grad=True)
    w = torch.randn(64, 32, generator=g, requires_grad=True)
    t = torch.randint(0, 64, (8,), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = pt.fused_linear_cross_entropy(h, w, t)
        ref = TF.cross_entropy(TF.linear(h, w), t)
    assert loss.dtype == ref.dtype == torch.float32
    # the matmul ran in bf16, as autocast's linear does: far from the fp32 loss, close to torch's
    exact = TF.cross_entropy(TF.linear(h, w), t)
    assert abs(loss.item() - ref.item()) < abs(exact.item() - ref.item()) + 2e-2 * abs(ref.item())
    loss.backward()
    assert h.grad.dtype == w.grad.dtype == torch.float32 and math.isfinite(h.grad.abs().sum().item())


def test_functions_match_without_autocast_after_an_autocast_region():
    # autocast is turned off inside the ops only for their duration
    x, w = torch.randn(3, 16), torch.ones(16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        pt.rms_norm(x, w)
        assert torch.is_autocast_enabled("cpu")
    assert pt.rms_norm(x.bfloat16(), w.bfloat16()).dtype == torch.bfloat16


def _tiny_llama():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=False, rms_norm_eps=1e-5)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).float()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.copy_(1 + 0.3 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("amp", AMP, ids=["bf16", "f16"])
def test_patched_model_trains_under_autocast_like_unpatched(amp):
    import copy

    ref = _tiny_llama()
    model = pt.apply(copy.deepcopy(ref))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (2, 11), generator=g)
    out = {}
    for key, m in (("pykern", model), ("torch", ref)):
        m.train()
        with torch.autocast("cpu", dtype=amp):
            loss = m(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        out[key] = (loss, {n: p.grad for n, p in m.named_parameters()})
    (loss, grads), (rloss, rgrads) = out["pykern"], out["torch"]
    _close("loss", loss, rloss, "torch_apply")
    for n, gr in rgrads.items():
        assert grads[n] is not None, n
        # gradients of a bf16 forward: compare at the scale of each tensor (bf16 tolerance of its norm)
        err = (grads[n] - gr).norm() / gr.norm().clamp_min(1e-12)
        assert err.item() < tolerance("torch_apply", "bf16")[1], f"{n}: relative error {err.item():.3g}"


@requires_gpu
@pytest.mark.parametrize("amp", AMP, ids=["bf16", "f16"])
@pytest.mark.parametrize("name", list(CASES))
def test_functions_match_torch_under_cuda_autocast(name, amp):
    _check_case(name, "cuda", amp)


def test_norm_policy_is_read_from_the_dispatcher(monkeypatch):
    # Measured on an H200 with torch 2.11: CUDA autocast had no rms_norm entry (bf16 x, float32 weight gave
    # bf16); torch 2.13 registers one (float32). The policy follows whatever torch is installed.
    from pykern.torch import _amp

    assert _amp.fp32_listed("layer_norm", "cuda")
    has = torch._C._dispatch_has_kernel_for_dispatch_key("aten::rms_norm", "AutocastCUDA")
    assert _amp.fp32_listed("rms_norm", "cuda") == has
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 32, generator=g).bfloat16(), 1 + 0.3 * torch.randn(32, generator=g)
    r = torch.randn(5, 32, generator=g).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert pt.rms_norm(x, w, 1e-5).dtype == torch.bfloat16  # no AutocastCPU entry: the input's dtype
        assert pt.add_rms_norm(x, r, w, 1e-5)[0].dtype == torch.bfloat16
    monkeypatch.setattr(_amp, "fp32_listed", lambda op, dev: op == "rms_norm")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = pt.rms_norm(x, w, 1e-5)
        assert out.dtype == torch.float32
        assert pt.add_rms_norm(x, r, w, 1e-5)[0].dtype == torch.float32
    ref = TF.rms_norm(x.float(), (32,), w, 1e-5)
    atol, rtol = tolerance("rms_norm", "f32")
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)
