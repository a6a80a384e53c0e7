"""Real decoders end to end at 16a8w, caches inside the delegate, 8 decode steps on
the host simulator (CI budget): a tiny transformers Qwen2 with StaticCache, and the
Whisper and T5 decoders with static self- and cross-attention caches."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

pytest.importorskip("transformers")

import t5_decoder  # noqa: E402
import whisper_decoder  # noqa: E402
from qwen2_static_cache import build_model, decode_steps  # noqa: E402
from seq2seq_decoder import decode_steps as seq2seq_steps  # noqa: E402
from seq2seq_decoder import encoder_states  # noqa: E402

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


class WithSeq2SeqCaches(torch.nn.Module):
    """An encoder-decoder step, also returning its self- and cross-attention caches."""

    def __init__(self, step: torch.nn.Module) -> None:
        super().__init__()
        self.step = step

    def forward(self, input_ids, encoder_hidden_states, cache_position):
        logits = self.step(input_ids, encoder_hidden_states, cache_position)
        caches = [
            getattr(self.step, f"{attention}_{kind}_{i}")
            for attention in ("self", "cross")
            for i in range(2)
            for kind in ("key", "value")
        ]
        return (logits, *(cache * 1 for cache in caches))


@pytest.fixture(scope="module", params=["whisper", "t5"])
def seq2seq(request, host_sdk):
    script = {"whisper": whisper_decoder, "t5": t5_decoder}[request.param]
    model = WithSeq2SeqCaches(script.build_model()).eval()
    states = encoder_states(script.ENCODER_LENGTH, 64)
    calibration = seq2seq_steps(32, states, seed=1, vocab=256)
    quantized = quantize(model, calibration, quant="16a8w")
    program = lower(quantized, calibration[0], soc="SM8650")
    steps = seq2seq_steps(STEPS, states, seed=2, vocab=256)
    return {
        "name": request.param,
        "program": program,
        "device": HostRunner(program.buffer).run(steps),
        "fp32": EagerRunner(model).run(steps),
        "fake_quant": EagerRunner(quantized).run(steps),
    }


def test_seq2seq_decoder_is_one_delegate_with_all_caches_inside(seq2seq):
    report = seq2seq["program"].qnn_mutbuf_report
    assert report.cpu_ops == [], f"{seq2seq['name']}: ops on the CPU: {report.cpu_ops}"
    expected = {
        f"step.{attention}_{kind}_{i}"
        for attention in ("self", "cross")
        for i in range(2)
        for kind in ("key", "value")
    }
    assert expected <= set(report.delegated_buffers)


def test_seq2seq_logits_against_fp32_and_fake_quant_every_step(seq2seq):
    rows = decode_table(seq2seq["fp32"], seq2seq["fake_quant"], seq2seq["device"])
    for row in rows:
        where = f"{seq2seq['name']} step {row.step}"
        assert row.sqnr_fp32_db >= 30.0, f"{where}: {row.sqnr_fp32_db:.1f} dB vs fp32"
        assert row.sqnr_fake_quant_db >= 40.0, (
            f"{where}: {row.sqnr_fake_quant_db:.1f} dB vs fake-quant"
        )


def test_seq2seq_caches_after_the_last_step_match_fake_quant(seq2seq):
    last_device, last_reference = seq2seq["device"][-1], seq2seq["fake_quant"][-1]
    for index in range(1, len(last_device)):
        assert last_reference[index].abs().sum() > 0, f"cache {index} holds nothing"
        sqnr = sqnr_db(last_reference[index], last_device[index])
        assert sqnr >= 40.0, f"{seq2seq['name']} cache {index}: {sqnr:.1f} dB"
