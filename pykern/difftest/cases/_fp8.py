"""The e4m3 quantization the FP8 difftest cases share (gemm_fp8's 128-wide blocks, the sm_90a FP8 attention's
tensors and heads): a descale amax / 448 in fp32 and the codes e4m3(x / descale), saturated to the finite range."""
from __future__ import annotations

from typing import Any

import numpy as np

E4M3_MAX = 448.0  # float8_e4m3fn's largest finite value


def e4m3(stand_in: bool = False) -> Any:
    """ml_dtypes.float8_e4m3fn. Without ml_dtypes: MissingDependency (the runner skips the case, naming the extra),
    or with stand_in float32, for a case that builds its codes before its run (its run needs ml_dtypes anyway, so
    such a case never runs)."""
    try:
        import ml_dtypes
    except ImportError:
        if stand_in:
            return np.float32
        from ...errors import MissingDependency

        raise MissingDependency("ml_dtypes", "test", "float8_e4m3fn NumPy arrays") from None

    return ml_dtypes.float8_e4m3fn


def e4m3_descale(amax: Any) -> np.ndarray:
    """amax / 448 in fp32: the descale that maps a block's (tensor's, head's) largest magnitude onto e4m3's largest
    finite value."""
    return (np.asarray(amax, np.float32) / np.float32(E4M3_MAX)).astype(np.float32)


def e4m3_quantize(x: Any, descale: Any, stand_in: bool = False) -> np.ndarray:
    """The e4m3 codes of x / descale (fp32, descale broadcast against x), saturated to +-448 and rounded to nearest
    even (ml_dtypes' cast), as vLLM's and FlashAttention-3's FP8 callers quantize; stand_in as `e4m3`'s."""
    return np.clip(np.asarray(x, np.float32) / descale, -E4M3_MAX, E4M3_MAX).astype(e4m3(stand_in))
