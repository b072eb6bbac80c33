// The activations of the experts' gate (moe.cu's moe_act / moe_gemm_act_tc and grouped_gemm_sm90.cu's fused
// gate_up epilogue share them, so both compute act(gate) * up with the same instructions).
#pragma once
#include "pk_common.cuh"  // pk_gelu_tanh_s / pk_gelu_tanh_grad, shared with norm_act_loss.cu's gelu

#define MOE_ACT_SILU 0
#define MOE_ACT_GELU_TANH 1

// gelu_tanh as norm_act_loss.cu's gelu: x * 0.5 (1 + tanh u) = x s on one ex2 and one rcp (pk_common.cuh's
// pk_gelu_tanh_s), not tanhf (its range selects, ~25 issued instructions, and 1 + tanh u cancelling for x < 0).
// silu as forward.cu's silu_gate: g / (1 + e^-g) on one MUFU.EX2 (pk_exp_fast) and __fdividef's MUFU.RCP, not
// the accurate expf (its range reduction, ~10 instructions) and the IEEE division (FCHK and a called slow path).
// e^-g is inf for g < -88 and g / inf is -0, the limit; __fdividef gives 0 for a divisor in (2^126, 2^128),
// g in (-88.7, -87.3), where the exact value is below 1e-36. g >= 0 loses nothing: e^-g <= 1 and the rcp is
// within 1 ulp (tests/test_moe.py::test_silu_activation_against_float64 holds the error over a dense sweep).
__device__ __forceinline__ float moe_silu_s(float g) { return __fdividef(1.0f, 1.0f + pk_exp_fast(-g)); }

__device__ __forceinline__ float moe_act_f(float g, int act) {
    if (act == MOE_ACT_GELU_TANH) return g * pk_gelu_tanh_s(g);
    return __fdividef(g, 1.0f + pk_exp_fast(-g));
}

// d act(g) / dg (the MoE backward's): silu' = s (1 + g (1 - s)) with s = sigmoid(g) (0 or 1 at the far ends,
// where the derivative's limits are 0 and 1)
__device__ __forceinline__ float moe_act_grad(float g, int act) {
    if (act == MOE_ACT_GELU_TANH) return pk_gelu_tanh_grad(g);
    const float s = moe_silu_s(g);
    return s * fmaf(g, 1.0f - s, 1.0f);
}
