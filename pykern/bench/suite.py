"""The memory-bound op table of `python -m pykern.bench`: per op, its LLaMA-sized shape (the bytes model's,
pykern.bench.bytes_model; --quick uses fewer tokens), the minimum bytes it must move (each input read once,
each output written once), and how to build, on torch tensors, the pykern call, the equivalent torch eager
expression and the peers' calls (Liger-Kernel, FlashInfer, QuACK; each only when importable).

`CASES` must name every memory-bound op pykern.ops exports; `EXEMPT` lists the others with the reason
(tests/test_bench_cli.py fails when an op is in neither). torch is imported only inside `Context`.
"""
from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

from . import bytes_model as bm
from .runner import Impl, Workload, lookup, optional

# Op dimensions: T tokens, H hidden, F FFN width, NH/D query heads x head dim, V vocabulary,
# S sequence length and SH heads of the attention-score ops. FULL is the bytes model's LLaMA-3-8B step.
FULL: dict[str, int] = dict(T=bm.TOKENS, H=bm.HIDDEN, F=bm.FFN, NH=bm.HEADS, KH=bm.KV_HEADS, D=bm.HEAD_DIM,
                            V=bm.VOCAB, S=bm.SEQ, SH=bm.HEADS)
QUICK: dict[str, int] = dict(FULL, T=2048, S=1024)

# Exported by pykern.ops but not in the table, with the reason (checked by the tests).
EXEMPT: dict[str, str] = {
    "flash_attention": "compute-bound (tensor-core attention; tools/bench_attention.py, gpucheck)",
    "flash_attention_varlen": "compute-bound (prefill attention)",
    "paged_prefill_attention": "compute-bound (prefill attention)",
    "attention_backward": "compute-bound (attention backward; tools/bench_attention.py)",
    "flash_attention_varlen_backward": "compute-bound (the attention backward's tensor-core kernels, per packed "
                                       "sequence)",
    "fused_linear_cross_entropy": "compute-bound (the logits matmul dominates; tools/bench_flce.py)",
    "decode_attention": "KV-cache attention: timed per method and length by tools/bench_decode.py --time and gpucheck",
    "batched_decode_attention": "KV-cache attention: tools/bench_decode.py --time",
    "paged_decode_attention": "KV-cache attention: tools/bench_decode.py --time",
    "shared_prefix_decode": "KV-cache attention: flash_attention + paged_decode_attention + merge_state, each timed",
    "append_paged_kv_cache": "a scatter of one step's few tokens: launch-latency bound, not bandwidth",
    "PagedDecodePlan": "a plan object, not a kernel",
    "MLAPagedDecodePlan": "MLA decode over a paged latent cache: its modelled bound in tools/mla_model.py",
    "attn_tiling": "a helper, not a kernel",
    "decode_plan": "a helper, not a kernel",
    "get_batch_indices_positions": "an index helper: host arrays stay on the host, device arrays take one small launch",
    "sampling_from_probs": "sampling: one CTA per row, latency-bound at decode batch sizes (tests/test_sampling.py)",
    "top_k_sampling_from_probs": "sampling: one CTA per row (see sampling_from_probs)",
    "top_p_sampling_from_probs": "sampling: one CTA per row (see sampling_from_probs)",
    "min_p_sampling_from_probs": "sampling: one CTA per row (see sampling_from_probs)",
    "top_k_top_p_sampling_from_probs": "sampling: one CTA per row (see sampling_from_probs)",
    "top_k_renorm_probs": "sampling: multi-pass radix select per row (see sampling_from_probs)",
    "top_p_renorm_probs": "sampling: multi-pass radix select per row (see sampling_from_probs)",
    "top_k_mask_logits": "sampling: multi-pass radix select per row (see sampling_from_probs)",
    "chain_speculative_sampling": "sampling: one CTA per request, latency-bound (see sampling_from_probs)",
    "sampling_from_logits": "sampling: one CTA per row, the softmax fused (see sampling_from_probs)",
    "top_k_top_p_sampling_from_logits": "sampling: one CTA per row, the softmax fused (see sampling_from_probs)",
    "softmax": "sampling: one CTA per row, two reads and a write (see sampling_from_probs)",
    "gemm_fp8": "compute-bound (FP8 tensor-core GEMM; its loop metric: tools/sass_report.py --loops)",
    "grouped_gemm_fp8": "compute-bound (FP8 tensor-core grouped GEMM)",
    "fp8_quantize": "memory-bound but not in this table yet: the table compares outputs with torch's in the "
                    "input dtype, and its outputs are float8 codes and scales (tests/test_gemm_fp8.py checks them)",
    "grouped_gemm_wgrad_tc": "compute-bound (the tensor-core weight gradient of the experts)",
    "grouped_gemm": "compute-bound (tensor-core grouped GEMM; its loop metric: tools/sass_report.py --loops)",
    "moe_experts": "compute-bound (two grouped GEMMs)",
    "moe_experts_backward": "compute-bound (grouped GEMMs)",
    "moe_route": "T x E router logits, a few hundred bytes per token: latency-bound",
    "moe_align": "integer bookkeeping of the routing: latency-bound, part of moe_experts",
}

BF16_F32 = ("bf16", "f32")
MERGE_STATES = 4  # states a token in the merge_states row (a split decode's partials)


@dataclass(frozen=True)
class Case:
    name: str  # the row's op name (rope_inverse: rope(..., inverse=True))
    ops: tuple[str, ...]  # the pykern.ops functions it times
    dtypes: tuple[str, ...]
    shape: Callable[[dict[str, int]], str]
    min_bytes: Callable[[dict[str, int], int], int]  # (dims, element size) -> bytes
    model: str = ""  # the bytes model's row for this op (its HBM bytes are shown beside pykern's time)


def _e(dtype: str) -> int:
    return 2 if dtype == "bf16" else 4


def _rope_tab(d: dict[str, int]) -> int:
    return 2 * d["T"] * (d["D"] // 2) * 4  # fp32 cos and sin, (T, D/2) each


def _qk_elems(d: dict[str, int]) -> int:
    return d["T"] * (d["NH"] + d["KH"]) * d["D"]  # q and k elements


def _qk_shape(d: dict[str, int]) -> str:
    return f"{d['T']}x({d['NH']}+{d['KH']})x{d['D']}"


def _vis(d: dict[str, int]) -> int:
    return d["SH"] * d["S"] * (d["S"] + 1) // 2  # visible (unmasked) causal scores


CASES: tuple[Case, ...] = (
    Case("rms_norm", ("rms_norm",), BF16_F32, lambda d: f"{d['T']}x{d['H']}",
         lambda d, e: 2 * d["T"] * d["H"] * e + d["H"] * e, "rms_norm"),
    Case("rms_norm_backward", ("rms_norm_backward",), BF16_F32, lambda d: f"{d['T']}x{d['H']}",
         # x, grad read; grad_x written; weight read, grad_weight written (the row statistics are recomputed)
         lambda d, e: 3 * d["T"] * d["H"] * e + 2 * d["H"] * e, "rms_norm_backward"),
    Case("add_rms_norm", ("add_rms_norm",), BF16_F32, lambda d: f"{d['T']}x{d['H']}",
         lambda d, e: 4 * d["T"] * d["H"] * e + d["H"] * e, "add_rms_norm"),  # x, residual read; out, new residual written
    Case("add_rms_norm_backward", ("add_rms_norm_backward",), BF16_F32, lambda d: f"{d['T']}x{d['H']}",
         lambda d, e: 4 * d["T"] * d["H"] * e + 2 * d["H"] * e, "add_rms_norm_backward"),  # h, grad_y, grad_h read; grad written
    Case("layer_norm", ("layer_norm",), BF16_F32, lambda d: f"{d['T']}x{d['H']}",
         lambda d, e: 2 * d["T"] * d["H"] * e + 2 * d["H"] * e, "layer_norm"),
    Case("layer_norm_backward", ("layer_norm_backward",), BF16_F32, lambda d: f"{d['T']}x{d['H']}",
         lambda d, e: 3 * d["T"] * d["H"] * e + 3 * d["H"] * e, "layer_norm_backward"),  # weight read; grad_weight, grad_bias written
    Case("silu_gate", ("silu_gate",), BF16_F32, lambda d: f"{d['T']}x{d['F']}",
         lambda d, e: 3 * d["T"] * d["F"] * e, "silu_gate"),
    Case("silu_gate_backward", ("silu_gate_backward",), BF16_F32, lambda d: f"{d['T']}x{d['F']}",
         lambda d, e: 5 * d["T"] * d["F"] * e, "silu_gate_backward"),
    Case("gelu", ("gelu",), BF16_F32, lambda d: f"{d['T']}x{d['F']}", lambda d, e: 2 * d["T"] * d["F"] * e, "gelu"),
    Case("gelu_backward", ("gelu_backward",), BF16_F32, lambda d: f"{d['T']}x{d['F']}",
         lambda d, e: 3 * d["T"] * d["F"] * e, "gelu_backward"),
    Case("gelu_gate", ("gelu_gate",), BF16_F32, lambda d: f"{d['T']}x{d['F']}", lambda d, e: 3 * d["T"] * d["F"] * e,
         "gelu_gate"),
    Case("gelu_gate_backward", ("gelu_gate_backward",), BF16_F32, lambda d: f"{d['T']}x{d['F']}",
         lambda d, e: 5 * d["T"] * d["F"] * e, "gelu_gate_backward"),
    Case("rope", ("rope",), BF16_F32, lambda d: f"{d['T']}x{d['NH']}x{d['D']}",
         lambda d, e: 2 * d["T"] * d["NH"] * d["D"] * e + _rope_tab(d)),
    # q and k in one launch (qk_norm_rope without weights), with the fused norm, and the norm's backward
    Case("rope_qk", ("qk_norm_rope",), BF16_F32, _qk_shape, lambda d, e: 2 * _qk_elems(d) * e + _rope_tab(d),
         "rope (q+k)"),
    Case("qk_norm_rope", ("qk_norm_rope",), BF16_F32, _qk_shape,
         lambda d, e: 2 * _qk_elems(d) * e + _rope_tab(d) + 2 * d["D"] * e, "qk_norm_rope"),
    Case("qk_norm_rope_backward", ("qk_norm_rope_backward",), BF16_F32, _qk_shape,
         lambda d, e: 3 * _qk_elems(d) * e + _rope_tab(d) + 4 * d["D"] * e, "qk_norm_rope_backward"),
    Case("rope_inverse", ("rope",), BF16_F32, lambda d: f"{d['T']}x{d['NH']}x{d['D']}",
         lambda d, e: 2 * d["T"] * d["NH"] * d["D"] * e + _rope_tab(d)),
    Case("embedding", ("embedding",), BF16_F32, lambda d: f"{d['T']} ids, {d['V']}x{d['H']}",
         lambda d, e: d["T"] * 8 + 2 * d["T"] * d["H"] * e, "embedding"),
    Case("embedding_backward", ("embedding_backward",), BF16_F32, lambda d: f"{d['T']}x{d['H']} -> {d['V']}x{d['H']}",
         # grad rows and int64 ids read; the fp32 (V, H) gradient written whole (unused rows are zeros)
         lambda d, e: d["T"] * d["H"] * e + d["T"] * 8 + d["V"] * d["H"] * 4, "embedding_backward"),
    Case("softmax_backward", ("softmax_backward",), BF16_F32, lambda d: f"{d['S'] * d['SH']}x{d['S']}",
         lambda d, e: 3 * d["S"] * d["SH"] * d["S"] * e, "softmax_backward"),
    Case("causal_attn_softmax", ("causal_attn_softmax",), ("f32",), lambda d: f"{d['S']}x{d['SH']}x{d['S']}",
         # the visible scores read, every score written (the masked ones as 0)
         lambda d, e: (_vis(d) + d["S"] * d["SH"] * d["S"]) * 4, "causal_attn_softmax"),
    Case("transpose_2d", ("transpose_2d",), BF16_F32, lambda d: f"{d['H']}x{d['F']}",
         lambda d, e: 2 * d["H"] * d["F"] * e, "transpose_2d"),
    Case("cross_entropy_fwd_bwd", ("cross_entropy_fwd_bwd",), BF16_F32, lambda d: f"{d['T']}x{d['V']}",
         # logits read once, their gradient written once, int64 targets read
         lambda d, e: 2 * d["T"] * d["V"] * e + d["T"] * 8, "cross_entropy_fwd_bwd"),
    Case("merge_state", ("merge_state", "merge_state_in_place"), BF16_F32,
         lambda d: f"2 x {d['T']}x{d['NH']}x{d['D']}",
         # two states read (v and its fp32 lse), the merged one written
         lambda d, e: 3 * d["T"] * d["NH"] * (d["D"] * e + 4)),
    Case("merge_states", ("merge_states",), BF16_F32, lambda d: f"{d['T']}x{MERGE_STATES}x{d['NH']}x{d['D']}",
         lambda d, e: (MERGE_STATES + 1) * d["T"] * d["NH"] * (d["D"] * e + 4)),
)


def select(patterns: Sequence[str] = (), dtypes: Sequence[str] = BF16_F32) -> list[tuple[Case, str]]:
    """(case, dtype) pairs whose op name matches any of the glob `patterns` (all when none), in table order."""
    out = []
    for c in CASES:
        if patterns and not any(fnmatch.fnmatchcase(c.name, p) for p in patterns):
            continue
        out += [(c, dt) for dt in dtypes if dt in c.dtypes]
    return out


def model_hbm_bytes(case: Case, dtype: str, dims: dict[str, int]) -> int | None:
    """The bytes model's HBM bytes for this op, when the model has the op and `dims` are its shapes."""
    if not case.model or dims != FULL:
        return None
    for r in bm.rows("all", _e(dtype)):
        if r.op == case.model:
            return r.hbm_bytes
    return None


# ---------------------------------------------------------------------------------------------- torch side

Builder = Callable[[Case, str, dict[str, int]], list[Impl]]


class Context:
    """Builds each case's implementations on torch tensors of `device` (cuda on the GPU; the tests use cpu with
    the host backend and tiny dims). Peers are imported once, lazily."""

    def __init__(self, device: str = "cuda", backend: str = "nvrtc", eps: float = 1e-6, compile: bool = False) -> None:
        import torch
        import torch.nn.functional as F

        from .. import ops

        self.torch, self.F, self.ops, self.dev, self.backend, self.eps = torch, F, ops, device, backend, eps
        self.compile = compile
        self._peers: dict[str, tuple[Any, str]] = {}

    def peer(self, impl: str, module: str, path: str, make: Callable[[Any], Callable[[], Any]]) -> Impl:
        """Impl `impl` calling module.path through `make`, or a skipped Impl saying why (not importable,
        no such function); building the call itself failing is an error row, not a crash."""
        if module not in self._peers:
            self._peers[module] = optional(module)
        mod, why = self._peers[module]
        fn, why = lookup(mod, why, path, module)
        if fn is None:
            return Impl(impl, None, why)
        try:
            return Impl(impl, make(fn))
        except Exception as e:
            return Impl(impl, _raiser(f"{type(e).__name__}: {e}"))

    def __call__(self, case: Case, dtype: str, d: dict[str, int]) -> list[Impl]:
        self.torch.manual_seed(0)
        impls = getattr(self, "_" + case.name)(d, self.torch.bfloat16 if dtype == "bf16" else self.torch.float32)
        if self.compile:
            # torch.compile (inductor) of the row's torch expression: what a user gets from compiling the eager
            # code; it compiles on the first (untimed) call
            eager = next(i for i in impls if i.name == "torch")
            impls.append(Impl("compile", self.torch.compile(eager.fn, dynamic=False)) if eager.fn is not None
                         else Impl("compile", None, "no torch expression to compile"))
        return impls

    # -- helpers
    def randn(self, *shape: int, dtype: Any) -> Any:
        return self.torch.randn(*shape, device=self.dev, dtype=dtype)

    def k(self, name: str, *a: Any, **kw: Any) -> Callable[[], Any]:
        fn = getattr(self.ops, name)
        return lambda: fn(*a, backend=self.backend, **kw)

    def _rms_ref(self, x: Any, w: Any) -> Any:
        F, eps = self.F, self.eps
        if hasattr(F, "rms_norm"):
            return F.rms_norm(x, (x.shape[-1],), w, eps)
        xf = x.float()
        return (xf * self.torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w

    def _rms_bwd_ref(self, x: Any, w: Any, g: Any) -> tuple[Any, Any]:
        xf, wf, gf = x.float(), w.float(), g.float()
        r = self.torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        wg = gf * wf
        gx = r * (wg - xf * (r * r) * (wg * xf).mean(-1, keepdim=True))
        return gx.to(x.dtype), (gf * xf * r).sum(0).to(w.dtype)

    # -- norms
    def _rms_norm(self, d: dict[str, int], dt: Any) -> list[Impl]:
        x, w = self.randn(d["T"], d["H"], dtype=dt), self.randn(d["H"], dtype=dt)
        eps = self.eps
        return [Impl("pykern", self.k("rms_norm", x, w, eps)), Impl("torch", lambda: self._rms_ref(x, w)),
                self.peer("liger", "liger_kernel.ops.rms_norm", "LigerRMSNormFunction", lambda f: lambda: f.apply(x, w, eps)),
                self.peer("flashinfer", "flashinfer", "norm.rmsnorm", lambda f: lambda: f(x, w, eps)),
                self.peer("quack", "quack.rmsnorm", "rmsnorm", lambda f: lambda: f(x, w, eps))]

    def _rms_norm_backward(self, d: dict[str, int], dt: Any) -> list[Impl]:
        x, w, g = self.randn(d["T"], d["H"], dtype=dt), self.randn(d["H"], dtype=dt), self.randn(d["T"], d["H"], dtype=dt)
        return [Impl("pykern", self.k("rms_norm_backward", x, w, g, self.eps)),
                Impl("torch", lambda: self._rms_bwd_ref(x, w, g)), *_no_peer_backward()]

    def _add_rms_norm(self, d: dict[str, int], dt: Any) -> list[Impl]:
        x, r, w = self.randn(d["T"], d["H"], dtype=dt), self.randn(d["T"], d["H"], dtype=dt), self.randn(d["H"], dtype=dt)
        eps = self.eps

        def ref() -> Any:
            h = x + r
            return self._rms_ref(h, w), h

        # flashinfer's fused_add_rmsnorm works in place (x <- norm, residual <- sum): it runs on its own copies
        xi, ri = x.clone(), r.clone()
        return [Impl("pykern", self.k("add_rms_norm", x, r, w, eps)), Impl("torch", ref),
                self.peer("flashinfer", "flashinfer", "norm.fused_add_rmsnorm", lambda f: lambda: f(xi, ri, w, eps)),
                Impl("liger", None, "Liger-Kernel has no fused add + RMSNorm"),
                Impl("quack", None, "not compared (QuACK's residual norm has another signature)")]

    def _add_rms_norm_backward(self, d: dict[str, int], dt: Any) -> list[Impl]:
        h, w = self.randn(d["T"], d["H"], dtype=dt), self.randn(d["H"], dtype=dt)
        gy, gh = self.randn(d["T"], d["H"], dtype=dt), self.randn(d["T"], d["H"], dtype=dt)

        def ref() -> Any:
            gx, gw = self._rms_bwd_ref(h, w, gy)
            return gx + gh, gw

        return [Impl("pykern", self.k("add_rms_norm_backward", h, w, gy, gh, self.eps)), Impl("torch", ref),
                *_no_peer_backward()]

    def _layer_norm(self, d: dict[str, int], dt: Any) -> list[Impl]:
        x, w, b = self.randn(d["T"], d["H"], dtype=dt), self.randn(d["H"], dtype=dt), self.randn(d["H"], dtype=dt)
        return [Impl("pykern", self.k("layer_norm", x, w, b, 1e-5)),
                Impl("torch", lambda: self.F.layer_norm(x, (d["H"],), w, b, 1e-5)),
                self.peer("liger", "liger_kernel.ops.layer_norm", "LigerLayerNormFunction",
                          lambda f: lambda: f.apply(x, w, b, 1e-5))]

    def _layer_norm_backward(self, d: dict[str, int], dt: Any) -> list[Impl]:
        x, w, g = self.randn(d["T"], d["H"], dtype=dt), self.randn(d["H"], dtype=dt), self.randn(d["T"], d["H"], dtype=dt)

        def ref() -> Any:
            xf, wf, gf = x.float(), w.float(), g.float()
            mu = xf.mean(-1, keepdim=True)
            rstd = self.torch.rsqrt((xf - mu).pow(2).mean(-1, keepdim=True) + 1e-5)
            xh = (xf - mu) * rstd
            wg = gf * wf
            gx = rstd * (wg - wg.mean(-1, keepdim=True) - xh * (wg * xh).mean(-1, keepdim=True))
            return gx.to(dt), (gf * xh).sum(0).to(dt), gf.sum(0).to(dt)

        return [Impl("pykern", self.k("layer_norm_backward", x, w, g, 1e-5)), Impl("torch", ref), *_no_peer_backward()]

    # -- gated activations
    def _silu_gate(self, d: dict[str, int], dt: Any) -> list[Impl]:
        g, u = self.randn(d["T"], d["F"], dtype=dt), self.randn(d["T"], d["F"], dtype=dt)
        gu = self.torch.cat([g, u], -1)
        return [Impl("pykern", self.k("silu_gate", g, u)), Impl("torch", lambda: self.F.silu(g) * u),
                self.peer("liger", "liger_kernel.ops.swiglu", "LigerSiLUMulFunction", lambda f: lambda: f.apply(g, u)),
                self.peer("flashinfer", "flashinfer", "activation.silu_and_mul", lambda f: lambda: f(gu))]

    def _silu_gate_backward(self, d: dict[str, int], dt: Any) -> list[Impl]:
        g, u, go = (self.randn(d["T"], d["F"], dtype=dt) for _ in range(3))

        def ref() -> Any:
            gf, uf, of = g.float(), u.float(), go.float()
            s = self.torch.sigmoid(gf)
            return (of * uf * s * (1 + gf * (1 - s))).to(dt), (of * gf * s).to(dt)

        return [Impl("pykern", self.k("silu_gate_backward", g, u, go)), Impl("torch", ref), *_no_peer_backward()]

    def _gelu_parts(self, xf: Any) -> tuple[Any, Any]:
        """(Phi(x), phi(x)) of the exact (erf) GELU."""
        cdf = 0.5 * (1 + self.torch.erf(xf * (1 / math.sqrt(2))))
        return cdf, self.torch.exp(-0.5 * xf * xf) * (1 / math.sqrt(2 * math.pi))

    def _gelu(self, d: dict[str, int], dt: Any) -> list[Impl]:
        x = self.randn(d["T"], d["F"], dtype=dt)
        return [Impl("pykern", self.k("gelu", x)), Impl("torch", lambda: self.F.gelu(x))]

    def _gelu_backward(self, d: dict[str, int], dt: Any) -> list[Impl]:
        x, go = self.randn(d["T"], d["F"], dtype=dt), self.randn(d["T"], d["F"], dtype=dt)
        aten = getattr(self.torch.ops.aten, "gelu_backward", None)
        return [Impl("pykern", self.k("gelu_backward", x, go)), Impl("torch", lambda: aten(go, x))]

    def _gelu_gate(self, d: dict[str, int], dt: Any) -> list[Impl]:
        g, u = self.randn(d["T"], d["F"], dtype=dt), self.randn(d["T"], d["F"], dtype=dt)
        gu = self.torch.cat([g, u], -1)
        return [Impl("pykern", self.k("gelu_gate", g, u)), Impl("torch", lambda: self.F.gelu(g) * u),
                self.peer("flashinfer", "flashinfer", "activation.gelu_and_mul", lambda f: lambda: f(gu)),
                Impl("liger", None, "Liger's GEGLU is the tanh approximation (pykern's default is erf)")]

    def _gelu_gate_backward(self, d: dict[str, int], dt: Any) -> list[Impl]:
        g, u, go = (self.randn(d["T"], d["F"], dtype=dt) for _ in range(3))

        def ref() -> Any:
            gf, uf, of = g.float(), u.float(), go.float()
            cdf, pdf = self._gelu_parts(gf)
            return (of * uf * (cdf + gf * pdf)).to(dt), (of * gf * cdf).to(dt)

        return [Impl("pykern", self.k("gelu_gate_backward", g, u, go)), Impl("torch", ref), *_no_peer_backward()]

    # -- rope
    def _rope_case(self, d: dict[str, int], dt: Any, inverse: bool) -> list[Impl]:
        t, nh, hd = d["T"], d["NH"], d["D"]
        x = self.randn(t, nh, hd, dtype=dt)
        pos = self.torch.arange(t, device=self.dev, dtype=self.torch.float32)[:, None]
        inv = 1.0 / (10000.0 ** (self.torch.arange(0, hd, 2, device=self.dev, dtype=self.torch.float32) / hd))
        ang = pos * inv[None, :]
        cos, sin = self.torch.cos(ang), self.torch.sin(ang)
        sgn = -1.0 if inverse else 1.0
        cos_f = self.torch.cat([cos, cos], -1)[:, None, :].to(dt)
        sin_f = (sgn * self.torch.cat([sin, sin], -1))[:, None, :].to(dt)

        def ref() -> Any:  # HF LLaMA's rotate_half form
            x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
            return x * cos_f + self.torch.cat([-x2, x1], -1) * sin_f

        why = "not compared: Liger / FlashInfer rotate q and k together in their own layouts"
        return [Impl("pykern", self.k("rope", x, cos, sin, style="half", inverse=inverse)), Impl("torch", ref),
                Impl("liger", None, why), Impl("flashinfer", None, why)]

    def _qk_inputs(self, d: dict[str, int], dt: Any) -> tuple[Any, ...]:
        t, hd = d["T"], d["D"]
        q, k = self.randn(1, t, d["NH"], hd, dtype=dt), self.randn(1, t, d["KH"], hd, dtype=dt)
        pos = self.torch.arange(t, device=self.dev, dtype=self.torch.float32)[:, None]
        inv = 1.0 / (10000.0 ** (self.torch.arange(0, hd, 2, device=self.dev, dtype=self.torch.float32) / hd))
        ang = pos * inv[None, :]
        cos, sin = self.torch.cos(ang), self.torch.sin(ang)
        wq, wk = 1 + 0.1 * self.randn(hd, dtype=dt), 1 + 0.1 * self.randn(hd, dtype=dt)
        return q, k, cos, sin, wq, wk

    def _qk_ref(self, q: Any, k: Any, cos: Any, sin: Any, wq: Any = None, wk: Any = None) -> Any:
        """HF's order: q_norm / k_norm (Qwen3RMSNorm), then rotate_half with tables in q's dtype."""
        hd = q.shape[-1]
        cf = self.torch.cat([cos, cos], -1)[None, :, None, :].to(q.dtype)
        sf = self.torch.cat([sin, sin], -1)[None, :, None, :].to(q.dtype)

        def one(x: Any, w: Any) -> Any:
            if w is not None:
                xf = x.float()
                x = w * (xf * self.torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
            return x * cf + self.torch.cat([-x[..., hd // 2:], x[..., : hd // 2]], -1) * sf

        return one(q, wq), one(k, wk)

    def _rope_qk(self, d: dict[str, int], dt: Any) -> list[Impl]:
        q, k, cos, sin, _, _ = self._qk_inputs(d, dt)
        why = "not compared: their rope kernels take their own table / position layouts"
        return [Impl("pykern", self.k("qk_norm_rope", q, k, cos, sin)),
                Impl("torch", lambda: self._qk_ref(q, k, cos, sin)), Impl("liger", None, why),
                Impl("flashinfer", None, why)]

    def _qk_norm_rope(self, d: dict[str, int], dt: Any) -> list[Impl]:
        q, k, cos, sin, wq, wk = self._qk_inputs(d, dt)
        why = "not compared: no fused q/k norm + rope"
        return [Impl("pykern", self.k("qk_norm_rope", q, k, cos, sin, q_weight=wq, k_weight=wk, eps=self.eps)),
                Impl("torch", lambda: self._qk_ref(q, k, cos, sin, wq, wk)), Impl("liger", None, why),
                Impl("flashinfer", None, why)]

    def _qk_norm_rope_backward(self, d: dict[str, int], dt: Any) -> list[Impl]:
        q, k, cos, sin, wq, wk = self._qk_inputs(d, dt)
        gq, gk = self.randn(*q.shape, dtype=dt), self.randn(*k.shape, dtype=dt)
        leaves = [t.detach().requires_grad_() for t in (q, k, wq, wk)]

        def ref() -> Any:  # torch autograd through HF's formula
            oq, ok = self._qk_ref(leaves[0], leaves[1], cos, sin, leaves[2], leaves[3])
            return self.torch.autograd.grad((oq, ok), leaves, (gq, gk))

        return [Impl("pykern", self.k("qk_norm_rope_backward", q, k, gq, gk, cos, sin, wq, wk, eps=self.eps)),
                Impl("torch", ref), *_no_peer_backward()]

    def _rope(self, d: dict[str, int], dt: Any) -> list[Impl]:
        return self._rope_case(d, dt, False)

    def _rope_inverse(self, d: dict[str, int], dt: Any) -> list[Impl]:
        return self._rope_case(d, dt, True)

    # -- embedding
    def _embedding(self, d: dict[str, int], dt: Any) -> list[Impl]:
        table = self.randn(d["V"], d["H"], dtype=dt)
        ids = self.torch.randint(0, d["V"], (d["T"],), device=self.dev, dtype=self.torch.int64)
        return [Impl("pykern", self.k("embedding", ids, table)), Impl("torch", lambda: self.F.embedding(ids, table))]

    def _embedding_backward(self, d: dict[str, int], dt: Any) -> list[Impl]:
        g = self.randn(d["T"], d["H"], dtype=dt)
        ids = self.torch.randint(0, d["V"], (d["T"],), device=self.dev, dtype=self.torch.int64)
        aten = self.torch.ops.aten.embedding_dense_backward  # what F.embedding's autograd runs
        return [Impl("pykern", self.k("embedding_backward", g, ids, d["V"])),
                Impl("torch", lambda: aten(g, ids, d["V"], -1, False))]

    # -- softmax family, transpose, cross-entropy
    def _softmax_backward(self, d: dict[str, int], dt: Any) -> list[Impl]:
        rows, n = d["S"] * d["SH"], d["S"]
        p = self.torch.softmax(self.randn(rows, n, dtype=self.torch.float32), -1).to(dt)
        g = self.randn(rows, n, dtype=dt)
        return [Impl("pykern", self.k("softmax_backward", p, g)),
                Impl("torch", lambda: p * (g - (p * g).sum(-1, keepdim=True))),
                Impl("quack", None, "not compared (QuACK's softmax backward is internal to its autograd)")]

    def _causal_attn_softmax(self, d: dict[str, int], dt: Any) -> list[Impl]:
        s, h = d["S"], d["SH"]
        scores = self.randn(s, h, s, dtype=dt)
        mask = self.torch.ones(s, s, device=self.dev, dtype=self.torch.bool).triu(1)[:, None, :]
        return [Impl("pykern", self.k("causal_attn_softmax", scores)),
                Impl("torch", lambda: self.torch.softmax(scores.masked_fill(mask, float("-inf")), -1))]

    def _merge_ref(self, v: Any, s: Any, dt: Any) -> tuple[Any, Any]:
        """torch eager: the states on axis 1 merged by their lse (v (T, n, H, D), s (T, n, H))."""
        torch = self.torch
        m = s.amax(1, keepdim=True)
        w = torch.exp(s - m)
        tot = w.sum(1)
        return ((w[..., None] * v.float()).sum(1) / tot[..., None]).to(dt), m[:, 0] + torch.log(tot)

    def _merge_state(self, d: dict[str, int], dt: Any) -> list[Impl]:
        torch, t, h, dd = self.torch, d["T"], d["NH"], d["D"]
        va, vb = self.randn(t, h, dd, dtype=dt), self.randn(t, h, dd, dtype=dt)
        sa, sb = self.randn(t, h, dtype=torch.float32), self.randn(t, h, dtype=torch.float32)
        return [Impl("pykern", self.k("merge_state", va, sa, vb, sb)),
                Impl("torch", lambda: self._merge_ref(torch.stack([va, vb], 1), torch.stack([sa, sb], 1), dt)),
                # FlashInfer's lse is base 2: the same work, so the same timing
                self.peer("flashinfer", "flashinfer", "merge_state", lambda fn: lambda: fn(va, sa, vb, sb))]

    def _merge_states(self, d: dict[str, int], dt: Any) -> list[Impl]:
        torch, t, h, dd = self.torch, d["T"], d["NH"], d["D"]
        v = self.randn(t, MERGE_STATES, h, dd, dtype=dt)
        s = self.randn(t, MERGE_STATES, h, dtype=torch.float32)
        return [Impl("pykern", self.k("merge_states", v, s)), Impl("torch", lambda: self._merge_ref(v, s, dt)),
                self.peer("flashinfer", "flashinfer", "merge_states", lambda fn: lambda: fn(v, s))]

    def _transpose_2d(self, d: dict[str, int], dt: Any) -> list[Impl]:
        x = self.randn(d["H"], d["F"], dtype=dt)
        return [Impl("pykern", self.k("transpose_2d", x)), Impl("torch", lambda: x.t().contiguous())]

    def _cross_entropy_fwd_bwd(self, d: dict[str, int], dt: Any) -> list[Impl]:
        torch, F = self.torch, self.F
        logits = self.randn(d["T"], d["V"], dtype=dt)
        targets = torch.randint(0, d["V"], (d["T"],), device=self.dev, dtype=torch.int64)

        def ref() -> Any:
            lg = logits.detach().requires_grad_(True)
            return torch.autograd.grad(F.cross_entropy(lg.float(), targets), lg)

        def autograd_peer(f: Callable[[Any], Any]) -> Callable[[], Any]:
            def go() -> Any:
                lg = logits.detach().requires_grad_(True)
                loss = f(lg)
                loss = loss[0] if isinstance(loss, tuple) else loss
                return torch.autograd.grad(loss.float().mean() if loss.dim() else loss, lg)
            return go

        return [Impl("pykern", self.k("cross_entropy_fwd_bwd", logits, targets)), Impl("torch", ref),
                self.peer("liger", "liger_kernel.ops.cross_entropy", "LigerCrossEntropyFunction",
                          lambda f: autograd_peer(lambda lg: f.apply(lg, targets, *_liger_weight(f)))),
                self.peer("quack", "quack.cross_entropy", "cross_entropy",
                          lambda f: autograd_peer(lambda lg: f(lg, targets)))]


def _liger_weight(fn: Any) -> tuple[Any, ...]:
    """Liger-Kernel 0.5+ takes a class-weight tensor (None: unweighted) right after target; older ones do not."""
    import inspect

    return (None,) if "weight" in inspect.signature(fn.forward).parameters else ()


def _no_peer_backward() -> list[Impl]:
    why = "not compared: the peers' backward runs only inside their autograd function"
    return [Impl("liger", None, why)]


def _raiser(msg: str) -> Callable[[], Any]:
    def go() -> Any:
        raise RuntimeError(msg)
    return go


def workloads(selected: Sequence[tuple[Case, str]], dims: dict[str, int], build: Builder) -> Iterator[Workload]:
    """One Workload per (case, dtype), built when the consumer reaches it (inputs of one op live at a time).
    A case whose inputs cannot be built yields one error row per implementation name instead."""
    for case, dtype in selected:
        try:
            impls = build(case, dtype, dims)
        except Exception as e:
            impls = [Impl("pykern", _raiser(f"building the inputs failed: {type(e).__name__}: {e}"))]
        yield Workload(case.name, case.shape(dims), dtype, "memory", case.min_bytes(dims, _e(dtype)), impls)


__all__ = ["BF16_F32", "CASES", "Case", "Context", "EXEMPT", "FULL", "QUICK", "model_hbm_bytes", "select",
           "workloads"]
