"""PyTorch integration: autograd-aware pykern kernels, nn.Modules and `apply(model)` for HF models.

The only pykern package that imports torch (`import pykern` never does).
"""
from __future__ import annotations

try:
    import torch as _torch  # noqa: F401  (checked here so a missing torch names the extra to install)
except ModuleNotFoundError as e:
    if e.name != "torch":
        raise
    from ..errors import MissingDependency

    raise MissingDependency("torch", "torch", "pykern.torch") from None

from .functional import (cross_entropy, embedding, flash_attention, flash_attention_varlen, qk_norm_rope, rms_norm,
                         rope, swiglu)
from .hf import apply
from . import moe
from .moe import moe_experts, moe_route
from .training import add_rms_norm, fused_linear_cross_entropy, gelu, gelu_gate, layer_norm
from .modules import CrossEntropyLoss, RMSNorm, SwiGLUMLP

__all__ = [
    "rms_norm", "rope", "qk_norm_rope", "swiglu", "flash_attention", "flash_attention_varlen", "cross_entropy",
    "embedding",
    "RMSNorm", "SwiGLUMLP", "CrossEntropyLoss", "apply",
    "add_rms_norm", "layer_norm", "gelu", "gelu_gate", "fused_linear_cross_entropy", "moe_route", "moe_experts",
]
