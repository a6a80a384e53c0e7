"""Real decoders end to end: a tiny transformers Qwen2 with StaticCache at 16a8w,
caches inside the delegate, 8 decode steps on the host simulator (CI budget)."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

pytest.importorskip("transformers")

from qwen2_static_cache import build_model, decode_steps  # noqa: E402

from qnn_mutbuf import HostRunner, lower, quantize  # noqa: E402
from qnn_mutbuf.verify import EagerRunner, decode_table, sqnr_db  # noqa: E402

STEPS = 8


class WithCaches(torch.nn.Module):
    """The decode step, also returning every KV cache after the step."""

    def __init__(self, step: torch.nn.Module) -> None:
        super().__init__()
        self.step = step

    def forward(self, input_ids, cache_position):
        logits = self.step(input_ids, cache_position)
        wrapper = self.step.wrapper
        caches = [
            getattr(wrapper, f"{kind}_cache_{i}") for i in range(2) for kind in ("key", "value")
        ]
        return (logits, *(cache * 1 for cache in caches))


@pytest.fixture(scope="module")
def qwen2(host_sdk):
    model = WithCaches(build_model()).eval()
    calibration = decode_steps(32, seed=1)
    quantized = quantize(model, calibration, quant="16a8w")
    program = lower(quantized, calibration[0], soc="SM8650")
    steps = decode_steps(STEPS, seed=2)
    device = HostRunner(program.buffer).run(steps)
    return {
        "program": program,
        "device": device,
        "fp32": EagerRunner(model).run(steps),
        "fake_quant": EagerRunner(quantized).run(steps),
    }


def test_decode_step_is_one_htp_delegate_with_caches_inside(qwen2):
    report = qwen2["program"].qnn_mutbuf_report
    assert report.cpu_ops == [], f"ops on the CPU: {report.cpu_ops}"
    assert sorted(report.delegated_buffers) == sorted(
        f"step.wrapper.{kind}_cache_{i}" for i in range(2) for kind in ("key", "value")
    )


def test_logits_against_fp32_and_fake_quant_every_step(qwen2):
    rows = decode_table(qwen2["fp32"], qwen2["fake_quant"], qwen2["device"])
    for row in rows:
        assert row.sqnr_fp32_db >= 30.0, f"step {row.step}: {row.sqnr_fp32_db:.1f} dB vs fp32"
        assert row.sqnr_fake_quant_db >= 40.0, (
            f"step {row.step}: {row.sqnr_fake_quant_db:.1f} dB vs fake-quant"
        )
        assert row.top1_fake_quant == 1.0


def test_cache_state_after_the_last_step_matches_fake_quant(qwen2):
    last_device, last_reference = qwen2["device"][-1], qwen2["fake_quant"][-1]
    for index in range(1, len(last_device)):
        written = last_reference[index].abs().sum(dim=-1) > 0
        assert written.any(), "the cache holds nothing after the last step"
        assert sqnr_db(last_reference[index], last_device[index]) >= 40.0, f"cache {index}"
