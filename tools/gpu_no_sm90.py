"""A difftest --extra module that turns the sm_90a attention path off, so on a Hopper GPU the cases
run the mma.sync (sm_80) kernels instead: `python -m pykern.difftest --extra tools/gpu_no_sm90.py`."""
import pykern.ops._attention_sm90 as _sm90
import pykern.ops.training_attention as _ta


def _off(*args, **kwargs) -> bool:
    return False


_sm90.usable = _off  # the forward and varlen paths look it up in their module
_ta._sm90_usable = _off  # the backward imported it by name
