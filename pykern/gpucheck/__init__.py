"""`python -m pykern.gpucheck`: the whole GPU check in one command, one report folder.

Steps (each one's result is a section of report.md / report.json):

1. device: name, driver, compute capability, NVRTC, attributes, which backends are usable and why not;
2. limits: the kernels compiled (or loaded from PYKERN_CUBIN_DIR) for the device's arch, and every
   launch the ops make (block size, dynamic shared memory) checked against the device's limits;
3. difftest: every case on nvrtc vs numba vs the float64 NumPy reference (a subprocess);
4. pytest -m gpu (a subprocess), when pytest and the tests/ folder are present;
5. sanitizer: one case per kernel under compute-sanitizer memcheck / racecheck / initcheck / synccheck;
6. bench: CUDA-event timings, GB/s or TFLOP/s and % of the device's peak, beside torch / Liger / FlashInfer /
   QuACK (the memory-bound ops: `python -m pykern.bench`'s table, pykern.bench.suite).

Exit status: see EXIT_* below (also in --help and docs/gpu-ci.md).
"""
from __future__ import annotations

EXIT_OK = 0  # every step that ran passed
EXIT_FAILED = 1  # a failure: a kernel that cannot launch, a difftest or pytest failure, a sanitizer finding, ...
EXIT_USAGE = 2  # bad command line (argparse)
EXIT_NO_GPU = 3  # no CUDA driver or no device: nothing was checked (the report says why)

__all__ = ["EXIT_FAILED", "EXIT_NO_GPU", "EXIT_OK", "EXIT_USAGE"]
