"""Window and softcap arguments of the attention ops: validation and the kernels' normalized form.

flash-attn's semantics (flash_attention, flash_attention_varlen, attention_backward): window_size=(left,
right), -1 = unbounded on that side; query i (aligned bottom-right: i' = i + n_k - n_q) sees keys
i' - left <= j <= i' + right; causal=True is right = 0 (a positive right is overridden, as flash-attn
does). FlashInfer's names on the serving ops: window_left (the left side only; causal gives the
right side) and logits_soft_cap. softcap c > 0 turns a score x = scale * q.k into c * tanh(x / c)
before the mask and the softmax (Gemma 2); 0 is off.

The kernels take normalized sides (pk_attn_window.cuh): an unbounded left is n_k, an unbounded
right n_q (every key either way), so they never test for -1 and every window arithmetic fits in
64 bits. Serving kernels know lengths per sequence only, so there unbounded is SERVING_UNBOUNDED.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..errors import ArgumentError, ArgumentTypeError

SERVING_UNBOUNDED = 2**30  # >= every sequence length the serving ops accept


def _int_ge(name: str, v: Any, lo: int) -> int:
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
        raise ArgumentTypeError(f"{name}: expected an int >= {lo}, got {type(v).__name__} {v!r}")
    if int(v) < lo:
        raise ArgumentError(f"{name}: expected an int >= {lo} (-1 = unbounded), got {int(v)}")
    return int(v)


def check_window_size(window_size: Any) -> tuple[int, int]:
    """(left, right) from flash-attn's window_size: a pair of ints >= -1."""
    if isinstance(window_size, (str, bytes)) or not hasattr(window_size, "__len__") or len(window_size) != 2:
        raise ArgumentTypeError(f"window_size: expected a pair (left, right) of ints >= -1, got {window_size!r}")
    return _int_ge("window_size[0]", window_size[0], -1), _int_ge("window_size[1]", window_size[1], -1)


def check_window_left(window_left: Any) -> int:
    """FlashInfer's window_left: an int >= -1."""
    return _int_ge("window_left", window_left, -1)


_F32_OVERFLOW = 3.4028235677973366e38  # the smallest double that rounds to float32 inf
_F32_TINY = math.nextafter(2.0**-150, 1.0)  # the smallest double that rounds to a nonzero float32 (2**-150 ties to 0)


def check_softcap(softcap: Any, name: str = "softcap") -> float:
    """A finite float >= 0 (0 = off), rounded to the float32 the kernels take."""
    if isinstance(softcap, (bool, np.bool_)) or not isinstance(softcap, (int, float, np.integer, np.floating)):
        raise ArgumentTypeError(f"{name}: expected a float >= 0 (0 = off), got {type(softcap).__name__} {softcap!r}")
    c = float(softcap)
    if not math.isfinite(c) or c < 0.0:
        raise ArgumentError(f"{name}: expected a finite float >= 0 (0 = off), got {softcap!r}")
    # 1e300 would reach the kernels as float32 inf (inf * tanh(0) = NaN), 1e-50 as 0 (softcap off). Plain
    # comparisons with the float32 rounding bounds, not a NumPy cast: torch.compile traces this function.
    if c > 0.0 and not _F32_TINY <= c < _F32_OVERFLOW:
        raise ArgumentError(f"{name}: expected 0 or a value representable in float32, got {softcap!r}")
    return c


def normalize(left: int, right: int, causal: bool, n_q: int, n_k: int) -> tuple[int, int]:
    """The kernels' (window_left, window_right): causal sets right to 0, unbounded sides become n_k / n_q."""
    if causal:
        right = 0
    wl = n_k if left < 0 else min(left, n_k)
    wr = n_q if right < 0 else min(right, n_q)
    return wl, wr


def normalize_serving(left: int, right: int, causal: bool) -> tuple[int, int]:
    """As normalize, for kernels that read lengths per sequence: unbounded is SERVING_UNBOUNDED."""
    if causal:
        right = 0
    wl = SERVING_UNBOUNDED if left < 0 else min(left, SERVING_UNBOUNDED)
    wr = SERVING_UNBOUNDED if right < 0 else min(right, SERVING_UNBOUNDED)
    return wl, wr
