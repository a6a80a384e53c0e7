"""HostRunner and the host toolchain on models without state."""

import pytest
import torch
from bar import assert_within_steps
from executorch.backends.qualcomm.quantizer.quantizer import QnnQuantizer, QuantDtype
from models import ConvLinearAdd
from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

from qnn_mutbuf import HostRunner, lower
from qnn_mutbuf.context_binary import build_settings, extract_context_binaries, graph_io
from qnn_mutbuf.errors import InputError
from qnn_mutbuf.verify import EagerRunner, compare_steps, output_scales


def _upstream_quantize(model, steps, dtype):
    quantizer = QnnQuantizer()
    quantizer.set_default_quant_config(dtype, is_conv_per_channel=True)
    prepared = prepare_pt2e(torch.export.export(model, steps[0]).module(), quantizer)
    for step in steps:
        prepared(*step)
    return convert_pt2e(prepared)


@pytest.fixture(scope="module")
def conv_program(host_sdk):
    torch.manual_seed(0)
    model = ConvLinearAdd().eval()
    steps = [(torch.randn(1, 3, 8, 8), torch.randn(1, 8)) for _ in range(4)]
    quantized = _upstream_quantize(model, steps, QuantDtype.use_8a8w)
    return model, quantized, steps, lower(quantized, steps[0], soc="SM8650")


def test_upstream_quantized_model_matches_fake_quant(conv_program):
    _, quantized, steps, program = conv_program
    assert program.qnn_mutbuf_report.cpu_ops == []
    device = HostRunner(program.buffer).run(steps)
    (scale,) = output_scales(quantized)
    assert_within_steps(EagerRunner(quantized).run(steps), device, scale, 1.0, "conv+linear+add")


def test_context_binary_targets_htp_v75(conv_program):
    program = conv_program[3]
    (context,) = extract_context_binaries(program.buffer)
    settings = build_settings(context.binary)
    assert settings["soc_type"] == "SM8650"
    assert settings["arch"] == "75"
    inputs, outputs = graph_io(context)
    assert sorted(t.shape for t in inputs) == [(1, 3, 8, 8), (1, 8)]
    assert outputs[0].shape == (1, 8)


def test_fp16_float_model_is_close_to_fp32(host_sdk):
    torch.manual_seed(1)
    model = ConvLinearAdd().eval()
    steps = [(torch.randn(1, 3, 8, 8), torch.randn(1, 8)) for _ in range(3)]
    program = lower(model, steps[0], fp16=True)
    table = compare_steps(
        "fp32", EagerRunner(model).run(steps), HostRunner(program.buffer).run(steps)
    )
    assert table.min_sqnr() >= 50.0


class LayerNormBmm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(8)

    def forward(self, a, b):
        return self.norm(torch.bmm(a, b))


def test_16bit_bmm_is_delegated_and_runs(host_sdk):
    """16-bit bmm and layer_norm validate only from HTP v73: the guard against a
    device that silently fell back to arch 68."""
    torch.manual_seed(2)
    model = LayerNormBmm().eval()
    steps = [(torch.randn(2, 4, 8), torch.randn(2, 8, 8)) for _ in range(3)]
    quantized = _upstream_quantize(model, steps, QuantDtype.use_16a16w)
    program = lower(quantized, steps[0])
    report = program.qnn_mutbuf_report
    assert report.cpu_ops == [], f"fell back to CPU: {report.cpu_ops}"
    device = HostRunner(program.buffer).run(steps)
    # Within a few 16-bit steps: the HTP's fixed-point layer norm rounds differently.
    table = compare_steps("fake-quant", EagerRunner(quantized).run(steps), device)
    assert table.min_sqnr() >= 60.0


def test_runner_rejects_bad_inputs_by_name(conv_program):
    runner = HostRunner(conv_program[3].buffer)
    x, y = conv_program[2][0]
    with pytest.raises(InputError, match="takes 2 inputs"):
        runner.step(x)
    with pytest.raises(InputError, match=r"step 0: input\[1\]: expected \(1, 8\), got \(1, 9\)"):
        runner.step(x, torch.zeros(1, 9))
    with pytest.raises(InputError, match=r"input\[0\]: expected dtype float32, got float64"):
        runner.step(x.double(), y)
    with pytest.raises(InputError, match=r"input\[1\]\[0\]: expected a tensor"):
        runner.step(x, [1.0])
    assert runner.steps_run == 0


def test_runner_rejects_files_that_are_not_programs(tmp_path):
    with pytest.raises(InputError, match="No such .pte file"):
        HostRunner(tmp_path / "missing.pte")
    bogus = tmp_path / "bogus.pte"
    bogus.write_bytes(b"not a program at all")
    with pytest.raises(InputError, match="not an ExecuTorch program"):
        HostRunner(bogus)
