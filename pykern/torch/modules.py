"""nn.Module wrappers of pykern.torch functions (drop-in for HF LLaMA-family layers)."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from . import _amp, functional as F

__all__ = ["RMSNorm", "SwiGLUMLP", "GatedMLP", "FusedGateUpMLP", "CrossEntropyLoss"]


class RMSNorm(nn.Module):
    """RMSNorm over the last axis with a learned weight (HF LlamaRMSNorm semantics).

    x and weight of different dtypes (e.g. bf16 activations with an fp32 weight)
    are computed like HF does: normalise in fp32, cast to x's dtype, multiply by
    the weight with torch's type promotion.

    offset=1.0 is Gemma's RMSNorm (GemmaRMSNorm, Gemma2/3RMSNorm): x * (1 + weight),
    normalised and scaled in float32, then cast to x's dtype; its weight starts at zeros.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, *, weight: Optional[nn.Parameter] = None,
                 offset: float = 0.0) -> None:
        super().__init__()
        init = torch.zeros(hidden_size) if offset == 1.0 else torch.ones(hidden_size)
        self.weight = weight if weight is not None else nn.Parameter(init)
        self.variance_epsilon = eps  # HF's attribute name, so code reading it keeps working
        self.offset = float(offset)

    @classmethod
    def from_module(cls, module: nn.Module) -> "RMSNorm":
        """Wrap an HF RMSNorm, sharing its weight Parameter (state_dict and optimizer state stay valid)."""
        return cls(module.weight.shape[0], module.variance_epsilon, weight=module.weight)

    @classmethod
    def from_gemma(cls, module: nn.Module) -> "RMSNorm":
        """Wrap a Gemma-style RMSNorm (x * (1 + weight), attribute `eps`), sharing its weight Parameter."""
        return cls(module.weight.shape[0], module.eps, weight=module.weight, offset=1.0)

    @property
    def eps(self) -> float:  # Gemma's attribute name
        return self.variance_epsilon

    def forward(self, x: Tensor) -> Tensor:
        if self.offset != 0.0:
            return self._forward_offset(x)
        # HF's RMSNorm does its own casting, which autocast leaves alone (no autocast-listed op in it):
        # so the norm runs with autocast off and the promotion below is HF's
        with _amp.disabled(x):
            if x.dtype == self.weight.dtype and x.dtype in _amp.KERNEL_DTYPES:
                return F.rms_norm(x, self.weight, self.variance_epsilon)
            if x.dtype in _amp.KERNEL_DTYPES:
                return self.weight * F.rms_norm(x, torch.ones_like(self.weight, dtype=x.dtype), self.variance_epsilon)
            if not x.is_floating_point():
                raise TypeError(f"pykern RMSNorm: x must be a floating tensor, got {x.dtype}")
            # a dtype the kernels lack (float64): HF normalises in float32 and casts back
            ones = torch.ones_like(self.weight, dtype=torch.float32)
            return self.weight * F.rms_norm(x.float(), ones, self.variance_epsilon).to(x.dtype)

    def _forward_offset(self, x: Tensor) -> Tensor:
        # Gemma: (x.float() normalised) * (offset + weight.float()), then .type_as(x): all in fp32, one
        # rounding at the end; the kernel does exactly that when x and weight share a dtype
        with _amp.disabled(x):
            if x.dtype == self.weight.dtype and x.dtype in _amp.KERNEL_DTYPES:
                return F.rms_norm(x, self.weight, self.variance_epsilon, self.offset)
            if not x.is_floating_point():
                raise TypeError(f"pykern RMSNorm: x must be a floating tensor, got {x.dtype}")
            w = self.weight.float()
            return F.rms_norm(x.float(), w, self.variance_epsilon, self.offset).to(x.dtype)

    def extra_repr(self) -> str:
        off = f", offset={self.offset}" if self.offset else ""
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}{off}, pykern"


class SwiGLUMLP(nn.Module):
    """down_proj(silu(gate_proj(x)) * up_proj(x)) with pykern's fused SiLU gate."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False, *,
                 gate_proj: Optional[nn.Linear] = None, up_proj: Optional[nn.Linear] = None,
                 down_proj: Optional[nn.Linear] = None) -> None:
        super().__init__()
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.gate_proj = gate_proj if gate_proj is not None else nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = up_proj if up_proj is not None else nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = down_proj if down_proj is not None else nn.Linear(intermediate_size, hidden_size, bias=bias)

    @classmethod
    def from_module(cls, module: nn.Module) -> "SwiGLUMLP":
        """Wrap an HF LLaMA-style MLP, sharing its three Linear layers."""
        g = module.gate_proj
        return cls(g.in_features, g.out_features, gate_proj=g, up_proj=module.up_proj, down_proj=module.down_proj)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.swiglu(self.gate_proj(x), self.up_proj(x)))


# transformers' ACT2FN names of the gated MLPs pykern fuses -> (kernel, approximate)
GATE_ACTIVATIONS = {"silu": ("silu", None), "swish": ("silu", None), "gelu_pytorch_tanh": ("gelu", "tanh"),
                    "gelu": ("gelu", "none")}


def _gate(gate: Tensor, up: Tensor, activation: str) -> Tensor:
    from .training import gelu_gate

    kind, approx = GATE_ACTIVATIONS[activation]
    return F.swiglu(gate, up) if kind == "silu" else gelu_gate(gate, up, approx)


class GatedMLP(nn.Module):
    """down_proj(act(gate_proj(x)) * up_proj(x)) with pykern's fused gate: SwiGLU (silu) or GeGLU
    (Gemma's gelu_pytorch_tanh = gelu(approximate="tanh"), or the exact gelu)."""

    def __init__(self, gate_proj: nn.Linear, up_proj: nn.Linear, down_proj: nn.Linear, activation: str) -> None:
        super().__init__()
        if activation not in GATE_ACTIVATIONS:
            raise ValueError(f"activation: expected one of {sorted(GATE_ACTIVATIONS)}, got {activation!r}")
        self.gate_proj, self.up_proj, self.down_proj, self.activation = gate_proj, up_proj, down_proj, activation

    @classmethod
    def from_module(cls, module: nn.Module, activation: str) -> "GatedMLP":
        """Wrap an HF gate/up/down MLP (Gemma's), sharing its three Linear layers."""
        return cls(module.gate_proj, module.up_proj, module.down_proj, activation)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(_gate(self.gate_proj(x), self.up_proj(x), self.activation))

    def extra_repr(self) -> str:
        return f"activation={self.activation}, pykern"


class FusedGateUpMLP(nn.Module):
    """Phi-3's MLP: gate, up = gate_up_proj(x).chunk(2, -1); down_proj(up * act(gate)), the gate fused
    (the split is the same chunk; the one gate_up_proj Linear and its Parameter are kept)."""

    def __init__(self, gate_up_proj: nn.Linear, down_proj: nn.Linear, activation: str) -> None:
        super().__init__()
        if activation not in GATE_ACTIVATIONS:
            raise ValueError(f"activation: expected one of {sorted(GATE_ACTIVATIONS)}, got {activation!r}")
        self.gate_up_proj, self.down_proj, self.activation = gate_up_proj, down_proj, activation

    @classmethod
    def from_module(cls, module: nn.Module, activation: str) -> "FusedGateUpMLP":
        return cls(module.gate_up_proj, module.down_proj, activation)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(_gate(gate, up, self.activation))

    def extra_repr(self) -> str:
        return f"activation={self.activation}, pykern"


class CrossEntropyLoss(nn.Module):
    """torch.nn.CrossEntropyLoss(weight=, ignore_index=, reduction=, label_smoothing=) on pykern's fused
    kernel, plus z_loss (Liger's lse_square_scale), return_z_loss and softcap (see
    pykern.torch.cross_entropy); input (N, vocab). Accepts LigerCrossEntropyLoss's keywords."""

    def __init__(self, weight: Optional[Tensor] = None, ignore_index: int = -100, reduction: str = "mean",
                 label_smoothing: float = 0.0, z_loss: float = 0.0, softcap: float | None = None, *,
                 lse_square_scale: float | None = None, return_z_loss: bool = False) -> None:
        super().__init__()
        from ..ops.training import ce_z_loss

        if weight is not None and not isinstance(weight, Tensor):
            # the positional slot was ignore_index before class weights existed: say so rather than misread it
            from ..errors import ArgumentTypeError

            raise ArgumentTypeError(f"weight: expected a tensor of class weights or None, got {weight!r} "
                                    "(pass ignore_index= by keyword)")
        self.register_buffer("weight", weight)
        self.ignore_index, self.reduction = ignore_index, reduction
        self.label_smoothing, self.softcap = label_smoothing, softcap
        self.z_loss = ce_z_loss(z_loss, lse_square_scale)
        self.return_z_loss = return_z_loss

    @property
    def lse_square_scale(self) -> float:  # Liger-Kernel's name
        return self.z_loss

    def forward(self, logits: Tensor, targets: Tensor):
        return F.cross_entropy(logits, targets, self.ignore_index, self.reduction,
                               label_smoothing=self.label_smoothing, z_loss=self.z_loss, softcap=self.softcap,
                               weight=self.weight, return_z_loss=self.return_z_loss)
