"""The KV-cache correctness bar (host simulator): index_copy_/index_put_ caches at
8a8w and 16a8w, delegated and top-level, 8 decode steps, against the fake-quant
reference and fp32, state included (every model returns its cache)."""

import pytest
import torch
from bar import assert_identical, assert_within_steps
from models import KV_CASES

from qnn_mutbuf import HostRunner, lower, quantize
from qnn_mutbuf.verify import EagerRunner, output_scales

STEPS = 8


@pytest.mark.parametrize("delegate", [True, False], ids=["delegated", "top_level"])
@pytest.mark.parametrize("quant", ["8a8w", "16a8w"])
@pytest.mark.parametrize("case", sorted(KV_CASES))
def test_cache_matches_references_every_step(case, quant, delegate, host_sdk):
    make_model, make_steps = KV_CASES[case]
    model = make_model().eval()
    calibration = make_steps(4, 1)
    steps = make_steps(STEPS, 2)
    quantized = quantize(model, calibration, quant=quant)
    record = quantized.meta["qnn_mutbuf"]
    (buffer,) = record.mutable_buffers
    state_scale = record.state_encodings[buffer].scale
    (out_scale,) = output_scales(quantized)

    program = lower(quantized, calibration[0], delegate_mutable_buffers=delegate)
    report = program.qnn_mutbuf_report
    assert report.cpu_ops == [], f"ops left on CPU: {report.cpu_ops}"
    assert (buffer in report.delegated_buffers) == delegate

    runner = HostRunner(program.buffer)
    device = runner.run(steps)
    fake_quant = EagerRunner(quantized).run(steps)
    fp32 = EagerRunner(model).run(steps)

    assert_within_steps(fake_quant, device, out_scale, 1.0, f"{case} vs fake-quant:")
    assert_within_steps(fp32, device, 1.0, state_scale + out_scale, f"{case} vs fp32:")

    runner.reset()
    assert_identical(device, runner.run(steps), f"{case} after reset:")
    assert_identical(device, HostRunner(program.buffer).run(steps), f"{case} fresh load:")


def test_ones_initialised_cache_keeps_its_ones(host_sdk):
    """A cache of ones written with values in [0, 0.95] must come back with its ones."""
    make_model, make_steps = KV_CASES["index_copy_ones"]
    model = make_model().eval()
    calibration = make_steps(4, 1)
    quantized = quantize(model, calibration, quant="8a8w")
    encoding = quantized.meta["qnn_mutbuf"].state_encodings["k_cache"]
    top = (encoding.quant_max - encoding.zero_point) * encoding.scale
    assert top >= 1.0 - encoding.scale / 2, f"state encoding tops out at {top}, clipping the ones"
    for delegate in (True, False):
        program = lower(quantized, calibration[0], delegate_mutable_buffers=delegate)
        (out,) = HostRunner(program.buffer).step(*make_steps(1, 3)[0])
        written = (make_steps(1, 3)[0][0]).item()
        untouched = torch.cat([out[:, :written], out[:, written + 1 :]], dim=1)
        assert torch.allclose(untouched, torch.ones_like(untouched), atol=encoding.scale), delegate
