"""lower(..., fp16=True) on the KV-cache cases: fp32 within fp16 precision, every step."""

import pytest
from bar import assert_identical
from models import KV_CASES

from qnn_mutbuf import HostRunner, lower
from qnn_mutbuf.verify import EagerRunner, compare_steps


@pytest.mark.parametrize("delegate", [True, False], ids=["delegated", "top_level"])
@pytest.mark.parametrize("case", sorted(KV_CASES))
def test_fp16_cache_tracks_fp32(case, delegate, host_sdk):
    make_model, make_steps = KV_CASES[case]
    model = make_model().eval()
    steps = make_steps(8, 2)
    program = lower(model, steps[0], fp16=True, delegate_mutable_buffers=delegate)
    assert program.qnn_mutbuf_report.cpu_ops == []
    runner = HostRunner(program.buffer)
    device = runner.run(steps)
    table = compare_steps("fp32", EagerRunner(model).run(steps), device)
    worst = min(table.rows, key=lambda row: row.sqnr_db)
    assert worst.sqnr_db >= 60.0, f"step {worst.step}: {worst.sqnr_db:.1f} dB"
    runner.reset()
    assert_identical(device, runner.run(steps), "after reset")
