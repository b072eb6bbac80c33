"""The one tolerance table: a result passes when |out - ref| <= atol + rtol * |ref|.

Keyed by (op, dtype) where dtype names the I/O precision ("f32", "bf16" or "f16").
References are NumPy float64 on the same (bf16- / f16-rounded) inputs. bf16 entries
are bounded by bf16's own rounding of the output (2**-8 relative), not by the
kernels' fp32 accumulation; f16 entries likewise by f16's (2**-11 relative, about
4x below F16's 2e-3). Loosening an entry to make a test pass is a defect:
find out why it fails instead.
"""
from __future__ import annotations

from .errors import ArgumentError

F32 = (1e-5, 1e-4)
BF16 = (2e-2, 2e-2)
F16 = (2e-3, 2e-3)
F16_ATTENTION = (BF16[0] / 8, BF16[1] / 8)  # (2.5e-3, 2.5e-3): see the attention rows

TOLERANCES: dict[tuple[str, str], tuple[float, float]] = {
    # training kernels
    ("transpose_2d", "f32"): (0.0, 0.0),
    ("transpose_2d", "bf16"): (0.0, 0.0),
    ("transpose_2d", "f16"): (0.0, 0.0),
    ("softmax_backward", "f32"): F32,
    ("softmax_backward", "bf16"): BF16,
    ("softmax_backward", "f16"): F16,
    ("rms_norm_backward", "f32"): F32,
    ("rms_norm_backward", "bf16"): BF16,
    ("rms_norm_backward", "f16"): F16,
    ("embedding_backward", "f32"): F32,
    ("embedding_backward", "bf16"): BF16,
    ("embedding_backward", "f16"): F16,
    ("cross_entropy_fwd_bwd", "f32"): F32,
    ("cross_entropy_fwd_bwd", "bf16"): BF16,
    ("cross_entropy_fwd_bwd", "f16"): F16,
    ("training_f32_to", "bf16"): (0.0, 0.0),  # one rounding of an fp32 value, as the reference's cast
    ("training_f32_to", "f16"): (0.0, 0.0),
    ("attention_backward", "f32"): (1e-5, 1e-4),
    # the norm / activation / loss family (norm_act_loss.cu)
    ("add_rms_norm", "f32"): F32,
    ("add_rms_norm", "bf16"): BF16,
    ("add_rms_norm", "f16"): F16,
    ("add_rms_norm_backward", "f32"): F32,
    ("add_rms_norm_backward", "bf16"): BF16,
    ("add_rms_norm_backward", "f16"): F16,
    ("layer_norm", "f32"): F32,
    ("layer_norm", "bf16"): BF16,
    ("layer_norm", "f16"): F16,
    ("layer_norm_backward", "f32"): F32,
    ("layer_norm_backward", "bf16"): BF16,
    ("layer_norm_backward", "f16"): F16,
    ("gelu", "f32"): F32,
    ("gelu", "bf16"): BF16,
    ("gelu", "f16"): F16,
    ("gelu_backward", "f32"): F32,
    ("gelu_backward", "bf16"): BF16,
    ("gelu_backward", "f16"): F16,
    ("gelu_gate", "f32"): F32,
    ("gelu_gate", "bf16"): BF16,
    ("gelu_gate", "f16"): F16,
    ("gelu_gate_backward", "f32"): F32,
    ("gelu_gate_backward", "bf16"): BF16,
    ("gelu_gate_backward", "f16"): F16,
    ("fused_linear_cross_entropy", "f32"): F32,
    ("fused_linear_cross_entropy", "bf16"): BF16,
    ("fused_linear_cross_entropy", "f16"): F16,
    ("attention_backward", "bf16"): BF16,
    # f16 attention: the bf16 row's error model (inputs exact, P / dS rounded to the I/O type for the
    # tensor-core products, each output rounded once) with f16's rounding, 2**-11 instead of bf16's 2**-8
    # (3 more mantissa bits): BF16 / 8
    ("attention_backward", "f16"): F16_ATTENTION,
    # the varlen backward runs the same tensor-core kernels per packed sequence: the same rows
    ("flash_attention_varlen_backward", "bf16"): BF16,
    ("flash_attention_varlen_backward", "f16"): F16_ATTENTION,
    # float32: the fp32-FMA kernels with the varlen prologue (the same math), attention_backward's f32 row
    ("flash_attention_varlen_backward", "f32"): (1e-5, 1e-4),
    # forward / prefill kernels
    ("embedding", "f32"): (0.0, 0.0),
    ("embedding", "bf16"): (0.0, 0.0),
    ("embedding", "f16"): (0.0, 0.0),
    ("rope", "f32"): F32,
    ("rope", "bf16"): BF16,
    ("rope", "f16"): F16,
    ("qk_norm_rope", "f32"): F32,
    ("qk_norm_rope", "bf16"): BF16,
    ("qk_norm_rope", "f16"): F16,
    ("qk_norm_rope_backward", "f32"): F32,
    ("qk_norm_rope_backward", "bf16"): BF16,
    ("qk_norm_rope_backward", "f16"): F16,
    ("silu_gate", "f32"): F32,
    ("silu_gate", "bf16"): BF16,
    ("silu_gate", "f16"): F16,
    ("silu_gate_backward", "f32"): F32,
    ("silu_gate_backward", "bf16"): BF16,
    ("silu_gate_backward", "f16"): F16,
    ("rms_norm", "f32"): F32,
    ("rms_norm", "bf16"): BF16,
    ("rms_norm", "f16"): F16,
    ("causal_attn_softmax", "f32"): F32,
    ("flash_attention", "f32"): F32,
    ("flash_attention", "bf16"): BF16,
    ("flash_attention", "f16"): F16_ATTENTION,  # as attention_backward f16 above
    # FP8 forward (float8_e4m3fn q, k, v with descales; bf16 out) against float64 attention on the dequantized
    # inputs (x8 * descale). P is rounded to e4m3 for the P V product (3 mantissa bits: each probability moves by
    # at most 2**-4 of itself, as in FlashAttention-3's FP8 path), so an output element moves by at most 2**-4 of
    # max |v| (the difftest cases scale v to max |v| = 1: atol 2**-4), plus the bf16 rounding of the output
    # (rtol 2**-8); lse comes from fp32 scores of the exact e4m3 products.
    ("flash_attention", "fp8"): (2.0**-4, 2.0**-8),
    # ... and over a whole output the rounding errors average: a relative RMS bound, rms(out - ref) / rms(ref) <=
    # rtol (atol unused), which tests/test_attention_fp8.py asserts. e4m3 rounds a probability by about 2.6e-2 of
    # itself (RMS over a binade); only the P that are exactly 8 (each key tile's new row max) escape it, so diffuse
    # attention over random v comes near 2.6e-2 in any kernel that rounds P to e4m3. The floor of that rounding
    # (tests/test_attention_fp8.py's e4m3_floor: the kernel's algorithm in float64 but for P), over d 64 / 128 /
    # 256, n_q and n_k in 64 .. 1000, causal and not, per-tensor and per-head descales (inputs quantized with
    # amax / 448 descales, as FP8 callers do; 432 shapes): 1.12e-2 to 2.54e-2, above this bound on two (d256, 700
    # x 1000 and 1000 x 700, a head of diffuse rows). The kernel measures its floor to within 0.3%; the test holds
    # it to <= 1.01 times the floor there and to this bound on its other shapes (docs/attention_sm90.md, Accuracy).
    ("flash_attention_rel_rms", "fp8"): (0.0, 2.5e-2),
    # decode attention
    ("decode_attention", "f32"): F32,
    ("decode_attention", "bf16"): BF16,
    ("decode_attention", "f16"): F16,
    ("batched_decode_attention", "f32"): F32,
    ("batched_decode_attention", "bf16"): BF16,
    ("batched_decode_attention", "f16"): F16,
    # serving attention (paged KV cache, varlen)
    ("paged_decode_attention", "f32"): F32,
    ("paged_decode_attention", "bf16"): BF16,
    ("paged_decode_attention", "f16"): F16,
    ("paged_prefill_attention", "f32"): F32,
    ("paged_prefill_attention", "bf16"): BF16,
    ("paged_prefill_attention", "f16"): F16,
    ("flash_attention_varlen", "f32"): F32,
    ("flash_attention_varlen", "bf16"): BF16,
    ("flash_attention_varlen", "f16"): F16,
    ("append_paged_kv_cache", "f32"): (0.0, 0.0),
    # FP8 KV caches (f32 queries): the references attend over the same dequantized values, so the
    # error is the fp32 math's; the append's bytes are bit-exact
    ("paged_decode_attention", "fp8"): F32,
    ("paged_prefill_attention", "fp8"): F32,
    ("append_paged_kv_cache", "fp8"): (0.0, 0.0),
    ("append_paged_kv_cache", "bf16"): (0.0, 0.0),
    ("append_paged_kv_cache", "f16"): (0.0, 0.0),  # a bit copy
    ("get_batch_indices_positions", "int32"): (0.0, 0.0),  # integer indices: exact
    # attention-state merges (kernels_cu/cascade.cu): a weighted mean in fp32, then one rounding of the output
    ("merge_state", "f32"): F32,
    ("merge_state", "bf16"): BF16,
    ("merge_state", "f16"): F16,
    ("merge_states", "f32"): F32,
    ("merge_states", "bf16"): BF16,
    ("merge_states", "f16"): F16,
    # sampling (kernels_cu/sampling.cu): tokens are integer decisions, exact on every backend
    ("sampling_philox", "f32"): (0.0, 0.0),
    ("sampling_mass", "f32"): (0.0, 0.0),
    ("sampling_from_probs", "f32"): (0.0, 0.0),
    ("sampling_from_probs", "bf16"): (0.0, 0.0),
    ("sampling_from_probs", "f16"): (0.0, 0.0),
    ("top_k_sampling_from_probs", "f32"): (0.0, 0.0),
    ("top_k_sampling_from_probs", "bf16"): (0.0, 0.0),
    ("top_k_sampling_from_probs", "f16"): (0.0, 0.0),
    ("top_p_sampling_from_probs", "f32"): (0.0, 0.0),
    ("top_p_sampling_from_probs", "bf16"): (0.0, 0.0),
    ("top_p_sampling_from_probs", "f16"): (0.0, 0.0),
    ("min_p_sampling_from_probs", "f32"): (0.0, 0.0),
    ("min_p_sampling_from_probs", "bf16"): (0.0, 0.0),
    ("min_p_sampling_from_probs", "f16"): (0.0, 0.0),
    ("top_k_top_p_sampling_from_probs", "f32"): (0.0, 0.0),
    ("top_k_top_p_sampling_from_probs", "bf16"): (0.0, 0.0),
    ("top_k_top_p_sampling_from_probs", "f16"): (0.0, 0.0),
    ("sampling_exp_mass", "f32"): (0.0, 0.0),
    ("sampling_from_logits", "f32"): (0.0, 0.0),
    ("sampling_from_logits", "bf16"): (0.0, 0.0),
    ("sampling_from_logits", "f16"): (0.0, 0.0),
    ("top_k_top_p_sampling_from_logits", "f32"): (0.0, 0.0),
    ("top_k_top_p_sampling_from_logits", "bf16"): (0.0, 0.0),
    ("top_k_top_p_sampling_from_logits", "f16"): (0.0, 0.0),
    # softmax writes fp32 from inputs widened exactly: fp32 math whatever the input type
    ("softmax", "f32"): F32,
    ("softmax", "bf16"): F32,
    ("softmax", "f16"): F32,
    ("top_k_renorm_probs", "f32"): F32,
    ("top_k_renorm_probs", "bf16"): BF16,
    ("top_k_renorm_probs", "f16"): F16,
    ("top_p_renorm_probs", "f32"): F32,
    ("top_p_renorm_probs", "bf16"): BF16,
    ("top_p_renorm_probs", "f16"): F16,
    ("top_k_mask_logits", "f32"): (0.0, 0.0),
    ("top_k_mask_logits", "bf16"): (0.0, 0.0),
    ("top_k_mask_logits", "f16"): (0.0, 0.0),
    ("chain_speculative_sampling", "f32"): (0.0, 0.0),
    ("chain_speculative_sampling", "bf16"): (0.0, 0.0),
    ("chain_speculative_sampling", "f16"): (0.0, 0.0),
    # mixture of experts (moe.cu); ids compare exactly under either row (integers differ by >= 1)
    ("moe_route", "f32"): F32,
    ("moe_route", "bf16"): F32,  # fp32 math on bf16 logits: the reference sees the same rounded inputs
    ("moe_route", "f16"): F32,
    ("grouped_gemm", "f32"): F32,
    ("grouped_gemm", "bf16"): BF16,
    ("grouped_gemm", "f16"): F16,
    # FP8 block-scaled GEMMs (gemm_fp8.cu): bf16 output against float64 on the dequantized inputs; the
    # quantization is bit-exact against its definition (fp32 division, e4m3 rounding to nearest even)
    ("gemm_fp8", "bf16"): BF16,
    ("grouped_gemm_fp8", "bf16"): BF16,
    ("fp8_quantize", "f32"): (0.0, 0.0),
    ("fp8_quantize", "bf16"): (0.0, 0.0),
    ("fp8_quantize", "f16"): (0.0, 0.0),
    ("moe_experts", "f32"): F32,
    ("moe_experts", "bf16"): BF16,
    ("moe_experts", "f16"): F16,
    ("moe_experts_backward", "f32"): F32,
    ("moe_experts_backward", "bf16"): BF16,
    ("moe_experts_backward", "f16"): F16,
    # MLA paged decode (mla.cu, mla_sm90.cu): fp32 scores and sums, P rounded to the I/O type for the tensor-core
    # P V (as the tensor-core paged decode), one rounding of the output (of each split's partial, then of the merge)
    ("mla_decode", "bf16"): BF16,
    ("mla_decode", "f16"): F16,
    # pykern.torch.apply: a patched HF model against the unpatched one (logits, loss, gradients)
    ("torch_apply", "f32"): F32,
    ("torch_apply", "bf16"): BF16,
    # float16: both models round every activation to f16 (2**-11), at different places; over the layers
    # and the vocab projection that stays within the bf16 bound
    ("torch_apply", "f16"): (2e-2, 2e-2),
    # test-only kernels (tests/difftest_extra/cu, tests/wrong_cu): never registered in kernels_cu/
    ("pk_test_axpy", "f32"): F32,
    ("pk_test_axpy", "bf16"): BF16,
    ("pk_test_rowsum", "f32"): F32,
    ("pk_test_scale", "f32"): F32,
}


def tolerance(op: str, dtype: str) -> tuple[float, float]:
    """(atol, rtol) for an op and I/O dtype; an unknown pair is an error, never a default."""
    try:
        return TOLERANCES[(op, dtype)]
    except KeyError:
        raise ArgumentError(f"no tolerance for op={op!r} dtype={dtype!r}; add it to pykern/tolerance.py") from None
