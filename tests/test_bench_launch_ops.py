"""tools/bench_launch.py --ops runs its whole-op rows on the fake H100 (the sm_90a flash_attention, the
tensor-core paged decode and the sampling kernel, asserted inside) and reports positive times."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))


def test_op_rows_take_the_intended_kernels() -> None:
    import bench_launch

    from pykern import arrays, backends

    before = backends._instances.get("nvrtc"), arrays.empty, arrays.zeros
    rows = bench_launch._op_rows(2, 1)
    assert set(rows) == {"op_flash_attention_sm90_us", "op_paged_decode_plan_run_us",
                         "op_paged_decode_plan_run_new_table_us", "op_top_k_top_p_sampling_us"}
    assert all(v > 0 for v in rows.values())
    assert (backends._instances.get("nvrtc"), arrays.empty, arrays.zeros) == before  # put back
