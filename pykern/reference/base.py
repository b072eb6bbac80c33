"""Registration of numba.cuda reference kernels (numba is imported only when one is built)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

# factory(cuda) -> (jitted_kernel, config); config(args) -> (grid, block), where
# args are the launch arguments in the kernel's parameter order (arrays as
# numba device arrays, scalars as Python numbers).
Factory = Callable[[Any], tuple[Any, Callable[[Sequence[Any]], tuple[tuple[int, ...], tuple[int, ...]]]]]


@dataclass
class Reference:
    names: tuple[str, ...]
    factory: Factory
    _built: Any = None

    def build(self, cuda: Any) -> tuple[Any, Callable]:
        if self._built is None:
            self._built = self.factory(cuda)
        return self._built


_REFERENCES: dict[str, Reference] = {}


def reference(*names: str) -> Callable[[Factory], Factory]:
    """Register a factory as the reference of one or more kernels (e.g. the f32 and bf16 twins).

    bf16 (`unsigned short*`) arrays reach the reference widened to float32 and
    its outputs are narrowed back by the numba backend, so one fp32 body can
    serve both twins.
    """

    def deco(factory: Factory) -> Factory:
        ref = Reference(tuple(names), factory)
        for n in names:
            if n in _REFERENCES:
                raise ValueError(f"reference for kernel {n!r} registered twice")
            _REFERENCES[n] = ref
        return factory

    return deco


def references() -> dict[str, Reference]:
    """Every registered reference by kernel name (importing pykern.reference registers them)."""
    from . import _load_all

    _load_all()
    return dict(_REFERENCES)


_DEVICE_FNS: dict[tuple[int, Any], Any] = {}  # (id of the cuda module, Python function) -> its device function


def device_function(cuda: Any, fn: Callable) -> Any:
    """`fn` compiled once as a numba device function of `cuda` (the GPU module or the simulator's), for the
    helpers several references call."""
    key = (id(cuda), fn)
    dev = _DEVICE_FNS.get(key)
    if dev is None:
        dev = _DEVICE_FNS[key] = cuda.jit(device=True)(fn)
    return dev


def _softmax_stats(a: Any, base: int, n: int, cap: float) -> tuple[float, float]:
    m = -math.inf
    for i in range(n):
        z = a[base + i]
        if cap > 0:
            z = cap * math.tanh(z / cap)
        m = max(m, z)
    s = 0.0
    for i in range(n):
        z = a[base + i]
        if cap > 0:
            z = cap * math.tanh(z / cap)
        s += math.exp(z - m)
    return m, s


def softmax_stats(cuda: Any) -> Any:
    """The numba device function `(m, s) = stats(a, base, n, cap)` the references build a softmax from: over the
    row a[base : base + n], with z = cap * tanh(x / cap) when cap > 0 (a logit soft-cap) else z = x,
    m = max z and s = sum exp(z - m), so p_i = exp(z_i - m) / s and logsumexp = m + log(s). Two plain passes in
    index order. A row of -inf (m = -inf) or a NaN or +inf anywhere makes s NaN, as the kernels' results
    are then (and a division by s stays a NaN on the simulator, where dividing by 0.0 would raise)."""
    return device_function(cuda, _softmax_stats)


def _capped_score(s: float, scale: float, softcap: float) -> float:
    x = s * scale
    if softcap > 0.0:
        x = softcap * math.tanh(x / softcap)
    return x


def capped_score(cuda: Any) -> Any:
    """The numba device function score(s, scale, softcap) of the attention references (dense, varlen, paged): the
    scaled score x = s * scale, soft-capped to softcap * tanh(x / softcap) when softcap > 0."""
    return device_function(cuda, _capped_score)


_S2PI = math.sqrt(2.0 / math.pi)


def _gelu(x: float, approx: int) -> float:
    if approx:
        return 0.5 * x * (1.0 + math.tanh(_S2PI * (x + 0.044715 * x * x * x)))
    return 0.5 * x * (1.0 + math.erf(x / math.sqrt(2.0)))


def _gelu_grad(x: float, approx: int) -> float:
    if approx:
        t = math.tanh(_S2PI * (x + 0.044715 * x * x * x))
        return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * _S2PI * (1.0 + 3.0 * 0.044715 * x * x)
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0))) + x * math.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)


def gelu_fns(cuda: Any) -> tuple[Any, Any]:
    """The numba device functions (gelu(x, approx), gelu'(x, approx)) of torch's GELU: approx 0 the erf form,
    1 the tanh form (the GELU ops and the MoE experts' gelu_tanh activation)."""
    return device_function(cuda, _gelu), device_function(cuda, _gelu_grad)


def _rms_norm_grad_row(h: Any, w: Any, gy: Any, gres: Any, has_gres: int, out: Any, base: int, dim: int, eps: float,
                       offset: float) -> float:
    ss = 0.0
    dot = 0.0
    for i in range(dim):
        ss += h[base + i] * h[base + i]
        dot += h[base + i] * (offset + w[i]) * gy[base + i]
    r = 1.0 / math.sqrt(ss / dim + eps)
    for i in range(dim):
        v = r * (offset + w[i]) * gy[base + i] - h[base + i] * r * r * r * dot / dim
        if has_gres:
            v += gres[base + i]
        out[base + i] = v
    return r


def rms_norm_grad_row(cuda: Any) -> Any:
    """The numba device function `r = grad_row(h, w, gy, gres, has_gres, out, base, dim, eps, offset)`: RMSNorm's
    input gradient of the row at `base`, out = r * (offset + w) * gy - h * r^3 * sum(h * (offset + w) * gy) / dim
    (+ gres when has_gres), with r = 1 / sqrt(mean(h^2) + eps) returned (rms_norm_backward, add_rms_norm_backward)."""
    return device_function(cuda, _rms_norm_grad_row)
