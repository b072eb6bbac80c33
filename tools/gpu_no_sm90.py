"""A difftest --extra module that turns the sm_90a attention path off, so on a Hopper GPU the cases
run the mma.sync (sm_80) kernels instead: `python -m pykern.difftest --extra tools/gpu_no_sm90.py`.
It sets the public switch PYKERN_SM90=0 (docs/attention_sm90.md); `PYKERN_SM90=0 python -m pykern.difftest` is
the same without this module."""
import os

os.environ["PYKERN_SM90"] = "0"
