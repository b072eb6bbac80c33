// The activations of the experts' gate (moe.cu's moe_act / moe_gemm_act_tc and grouped_gemm_sm90.cu's fused
// gate_up epilogue share them, so both compute act(gate) * up with the same instructions).
#pragma once
#include "pk_common.cuh"  // pk_gelu_tanh_s / pk_gelu_tanh_grad, shared with norm_act_loss.cu's gelu

#define MOE_ACT_SILU 0
#define MOE_ACT_GELU_TANH 1

// gelu_tanh as norm_act_loss.cu's gelu: x * 0.5 (1 + tanh u) = x s on one ex2 and one rcp (pk_common.cuh's
// pk_gelu_tanh_s), not tanhf (its range selects, ~25 issued instructions, and 1 + tanh u cancelling for x < 0).
__device__ __forceinline__ float moe_act_f(float g, int act) {
    if (act == MOE_ACT_GELU_TANH) return g * pk_gelu_tanh_s(g);
    return g / (1.0f + expf(-g));
}

// d act(g) / dg (the MoE backward's)
__device__ __forceinline__ float moe_act_grad(float g, int act) {
    if (act == MOE_ACT_GELU_TANH) return pk_gelu_tanh_grad(g);
    const float s = 1.0f / (1.0f + expf(-g));
    return s * (1.0f + g * (1.0f - s));
}
