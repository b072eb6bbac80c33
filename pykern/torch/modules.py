"""nn.Module wrappers of pykern.torch functions (drop-in for HF LLaMA-family layers)."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from . import _amp, functional as F

__all__ = ["RMSNorm", "SwiGLUMLP", "CrossEntropyLoss"]


class RMSNorm(nn.Module):
    """RMSNorm over the last axis with a learned weight (HF LlamaRMSNorm semantics).

    x and weight of different dtypes (e.g. bf16 activations with an fp32 weight)
    are computed like HF does: normalise in fp32, cast to x's dtype, multiply by
    the weight with torch's type promotion.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, *, weight: Optional[nn.Parameter] = None) -> None:
        super().__init__()
        self.weight = weight if weight is not None else nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps  # HF's attribute name, so code reading it keeps working

    @classmethod
    def from_module(cls, module: nn.Module) -> "RMSNorm":
        """Wrap an HF RMSNorm, sharing its weight Parameter (state_dict and optimizer state stay valid)."""
        return cls(module.weight.shape[0], module.variance_epsilon, weight=module.weight)

    def forward(self, x: Tensor) -> Tensor:
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

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}, pykern"


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


class CrossEntropyLoss(nn.Module):
    """torch.nn.CrossEntropyLoss(ignore_index=, reduction=, label_smoothing=) on pykern's fused kernel,
    plus z_loss and softcap (see pykern.torch.cross_entropy); input (N, vocab)."""

    def __init__(self, ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0,
                 z_loss: float = 0.0, softcap: float | None = None) -> None:
        super().__init__()
        self.ignore_index, self.reduction = ignore_index, reduction
        self.label_smoothing, self.z_loss, self.softcap = label_smoothing, z_loss, softcap

    def forward(self, logits: Tensor, targets: Tensor) -> Tensor:
        return F.cross_entropy(logits, targets, self.ignore_index, self.reduction,
                               label_smoothing=self.label_smoothing, z_loss=self.z_loss, softcap=self.softcap)
