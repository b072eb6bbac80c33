// The activations of the experts' gate (moe.cu's moe_act / moe_gemm_act_tc and grouped_gemm_sm90.cu's fused
// gate_up epilogue share them, so both compute act(gate) * up with the same instructions).
#pragma once

#define MOE_ACT_SILU 0
#define MOE_ACT_GELU_TANH 1

__device__ __forceinline__ float moe_act_f(float g, int act) {
    if (act == MOE_ACT_GELU_TANH) {
        const float u = 0.7978845608028654f * (g + 0.044715f * g * g * g);
        return 0.5f * g * (1.0f + tanhf(u));
    }
    return g / (1.0f + expf(-g));
}
