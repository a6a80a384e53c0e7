"""The in-place state bar (host simulator, 16 steps): running sum, moving average, a
counter indexing a cache, two coupled buffers and a ring buffer, at 8a8w and 16a8w,
delegated and top-level. Calibration runs the same number of steps as the test, so
the accumulated state stays inside the calibrated range."""

import pytest
from bar import assert_identical
from models import INPLACE_CASES

from qnn_mutbuf import HostRunner, lower, quantize
from qnn_mutbuf.verify import EagerRunner, compare_steps, output_scales

STEPS = 16
# A state that multiplies itself (s.mul_(0.9), b.mul_(0.5).add_(a)) requantizes every
# step, and the HTP's fixed-point multiply rounds a little differently from the
# reference; the recurrence contracts, so the difference stays bounded (measured:
# at most 3 state steps over 16 steps, reached by step 6, not growing after). Sums
# into the state are bit-exact: their operands share the state encoding.
CONTRACTING_STEPS = 3.0


@pytest.mark.parametrize("delegate", [True, False], ids=["delegated", "top_level"])
@pytest.mark.parametrize("quant", ["8a8w", "16a8w"])
@pytest.mark.parametrize("case", sorted(INPLACE_CASES))
def test_state_tracks_references(case, quant, delegate, host_sdk):
    make_model, make_steps, contracting = INPLACE_CASES[case]
    model = make_model().eval()
    calibration = make_steps(STEPS, 1)
    steps = make_steps(STEPS, 1)  # same distribution and length; values stay in range
    quantized = quantize(model, calibration, quant=quant)
    record = quantized.meta["qnn_mutbuf"]
    state_scales = {name: enc.scale for name, enc in record.state_encodings.items()}
    assert state_scales, "no floating-point state was quantized"
    (out_scale,) = output_scales(quantized)

    program = lower(quantized, calibration[0], delegate_mutable_buffers=delegate)
    assert program.qnn_mutbuf_report.cpu_ops == [], program.qnn_mutbuf_report.cpu_ops
    runner = HostRunner(program.buffer)
    device = runner.run(steps)
    fake_quant = EagerRunner(quantized).run(steps)
    fp32 = EagerRunner(model).run(steps)

    versus_fq = compare_steps("fake-quant", fake_quant, device, [out_scale])
    step_unit = max(out_scale, max(state_scales.values()))
    for row in versus_fq.rows:
        allowed = CONTRACTING_STEPS if contracting else 1.0
        assert row.max_abs_error <= allowed * step_unit * 1.001 + 1e-6, (
            f"step {row.step}: {row.max_abs_error / step_unit:.2f} state steps from fake-quant"
        )
    versus_fp32 = compare_steps("fp32", fp32, device)
    if case == "running_sum" and quant == "16a8w":
        assert versus_fp32.min_sqnr() >= 30.0
    assert versus_fp32.min_sqnr() >= (15.0 if quant == "8a8w" else 30.0)

    runner.reset()
    assert_identical(device, runner.run(steps), "after reset")
