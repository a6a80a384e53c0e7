"""Data movement and outputs next to state stay on the HTP (host simulator, 16a8w).

ExecuTorch's Llama (examples/models/llama, plain KV cache, grouped-query heads) used to
crash lowering with the caches delegated: ``repeat_interleave`` had no quant config,
the Reshape QNN built around it was float-in/fixed-out, and ExecuTorch died in
``_unsafe_adjust_original_program``. Its boolean causal mask, gathered with
``mask[input_pos]``, fell back to the CPU. Each workaround has a test of the HTP
behaviour behind it.
"""

from __future__ import annotations

import pytest
import torch

from qnn_mutbuf import HostRunner, lower, quantize
from qnn_mutbuf.verify import EagerRunner, compare_steps

STEPS = 8


def tiny_llama() -> torch.nn.Module:
    from executorch.examples.models.llama.llama_transformer import construct_transformer
    from executorch.examples.models.llama.model_args import ModelArgs

    torch.manual_seed(0)
    args = ModelArgs(
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,  # grouped-query heads: the cache read goes through repeat_interleave
        vocab_size=128,
        hidden_dim=128,
        max_seq_len=16,
        max_context_len=16,
        max_batch_size=1,
        use_kv_cache=True,
        enable_dynamic_shape=False,
    )
    model = construct_transformer(args).eval()
    with torch.no_grad():  # attention scores spread over several units: the mask matters
        for name, parameter in model.named_parameters():
            if name.endswith(("wq.weight", "wk.weight")):
                parameter.mul_(4.0)
    return model


def llama_steps(count: int, seed: int) -> list[tuple]:
    generator = torch.Generator().manual_seed(seed)
    return [
        (torch.randint(0, 128, (1, 1), generator=generator), {"input_pos": torch.tensor([p])})
        for p in range(count)
    ]


@pytest.fixture(scope="module")
def llama(host_sdk):
    model = tiny_llama()
    calibration = llama_steps(STEPS, 1)
    return model, calibration, quantize(model, calibration, quant="16a8w")


@pytest.mark.parametrize("delegate", [True, False], ids=["delegated", "top_level"])
def test_executorch_llama_lowers_with_grouped_query_heads(llama, delegate):
    model, calibration, quantized = llama
    program = lower(quantized, calibration[0], delegate_mutable_buffers=delegate)
    report = program.qnn_mutbuf_report
    assert report.cpu_ops == [], report.cpu_ops
    assert len(report.delegated_buffers if delegate else report.top_level_buffers) == 4
    steps = llama_steps(STEPS, 2)
    device = HostRunner(program.buffer).run(steps)
    versus_fq = compare_steps("fake-quant", EagerRunner(quantized).run(steps), device)
    assert versus_fq.min_sqnr() >= 40.0, versus_fq.min_sqnr()


class BoolMaskGather(torch.nn.Module):
    """``scores`` masked with rows of a boolean causal table, as ExecuTorch's Llama."""

    def __init__(self, length: int = 16) -> None:
        super().__init__()
        self.register_buffer("mask", torch.ones(length, length, dtype=torch.bool).tril())

    def forward(self, scores, input_pos):
        visible = self.mask[input_pos]
        return torch.where(visible, scores, float("-inf")).softmax(-1)


def mask_steps(count: int, seed: int) -> list[tuple]:
    generator = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(1, 16, generator=generator) * 3, torch.tensor([step % 16]))
        for step in range(count)
    ]


def test_htp_gather_has_no_bool_kernel(host_sdk, monkeypatch):
    """QAIRT 2.51: a Gather of a boolean table falls back to the CPU. When this test
    fails, the HTP gathers booleans and passes/bool_gathers.py can go."""
    from qnn_mutbuf.passes import state_graph

    monkeypatch.setattr(state_graph, "gather_bool_tables_as_int", lambda graph_module: graph_module)
    calibration = mask_steps(4, 1)
    program = lower(quantize(BoolMaskGather().eval(), calibration, quant="16a8w"), calibration[0])
    assert any("index" in op for op in program.qnn_mutbuf_report.cpu_ops)


def test_bool_mask_gather_runs_on_the_htp(host_sdk):
    model = BoolMaskGather().eval()
    calibration = mask_steps(16, 1)
    quantized = quantize(model, calibration, quant="16a8w")
    program = lower(quantized, calibration[0])
    assert program.qnn_mutbuf_report.cpu_ops == [], program.qnn_mutbuf_report.cpu_ops
    steps = mask_steps(STEPS, 2)
    device = HostRunner(program.buffer).run(steps)
    for step, (out,) in enumerate(device):
        assert float(out[0, step + 1 :].abs().max()) < 1e-3, f"step {step}"
    assert compare_steps("fp32", EagerRunner(model).run(steps), device).min_sqnr() >= 40.0


class FloatMaskTable(torch.nn.Module):
    """Older ExecuTorch Llama: a float causal table of 0 and -inf, added to the scores."""

    def __init__(self, length: int = 16) -> None:
        super().__init__()
        self.register_buffer("mask", torch.full((length, length), float("-inf")).triu(1))

    def forward(self, scores, input_pos):
        return (scores + self.mask[input_pos]).softmax(-1)


def test_float_mask_table_is_bounded(host_sdk):
    """Quantized as it is, a 0/-inf table added to the scores takes the scores' range
    to -inf; it becomes a select whose masked value sits just below the real scores."""
    from qnn_mutbuf.passes.attention_mask import MASKED_META_KEY

    model = FloatMaskTable().eval()
    calibration = mask_steps(16, 1)
    quantized = quantize(model, calibration, quant="16a8w")
    assert any(node.meta.get(MASKED_META_KEY) for node in quantized.graph.nodes)
    program = lower(quantized, calibration[0])
    assert program.qnn_mutbuf_report.cpu_ops == [], program.qnn_mutbuf_report.cpu_ops
    steps = mask_steps(STEPS, 2)
    device = HostRunner(program.buffer).run(steps)
    assert compare_steps("fp32", EagerRunner(model).run(steps), device).min_sqnr() >= 40.0


class ReturnsItsState(torch.nn.Module):
    """``h.copy_(new); return new``: the returned value is the buffer's new value."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("h", torch.zeros(1, 8))

    def forward(self, x):
        new = self.h * 0.5 + x
        self.h.copy_(new)
        return new


def state_steps(count: int, seed: int) -> list[tuple]:
    generator = torch.Generator().manual_seed(seed)
    return [(torch.rand(1, 8, generator=generator),) for _ in range(count)]


def test_executorch_refuses_a_delegated_buffer_that_is_also_an_output(host_sdk, monkeypatch):
    """ExecuTorch 1.5.1's delegate signature cannot give one node both roles; when
    this test fails, passes/returned_state.py can go."""
    from qnn_mutbuf.passes import state_graph

    monkeypatch.setattr(state_graph, "separate_returned_state", lambda graph_module: graph_module)
    calibration = state_steps(4, 1)
    quantized = quantize(ReturnsItsState().eval(), calibration, quant="16a8w")
    with pytest.raises(AssertionError, match="used as other types of outputs"):
        lower(quantized, calibration[0], delegate_mutable_buffers=True)


@pytest.mark.parametrize("delegate", [True, False], ids=["delegated", "top_level"])
def test_returned_state_lowers_in_both_placements(delegate, host_sdk):
    model = ReturnsItsState().eval()
    calibration = state_steps(STEPS, 1)
    quantized = quantize(model, calibration, quant="16a8w")
    program = lower(quantized, calibration[0], delegate_mutable_buffers=delegate)
    assert program.qnn_mutbuf_report.cpu_ops == [], program.qnn_mutbuf_report.cpu_ops
    steps = state_steps(STEPS, 2)
    device = HostRunner(program.buffer).run(steps)
    assert compare_steps("fake-quant", EagerRunner(quantized).run(steps), device).min_sqnr() >= 60
    assert compare_steps("fp32", EagerRunner(model).run(steps), device).min_sqnr() >= 60
