"""Recurrent cells whose state lives in mutable buffers, on the host simulator.

Issue 11, item 2: ``nn.LSTMCell``/``GRUCell``/``RNNCell`` and stacked ``nn.LSTM``/
``nn.GRU`` export as one aten op that QnnQuantizer leaves float; QNN validation then
failed (``ElementWiseMultiply failed 3110``) and ``aten.linear ... was not decomposed
or delegated``. passes/recurrent_cells.py spells them out before annotation: every op
runs on the HTP and tracks fake-quant and fp32 at every step, outputs and state.
"""

import copy
import functools

import pytest
import torch
from torch import nn

from qnn_mutbuf import HostRunner, lower, quantize
from qnn_mutbuf.errors import UnsupportedMutationError
from qnn_mutbuf.passes.recurrent_cells import decompose_recurrent_cells
from qnn_mutbuf.verify import EagerRunner, compare_steps

STEPS = 8
FAKE_QUANT_DB, FP32_DB = 40.0, 30.0


# The models of the issue, unchanged: each returns its new state.
class LSTMCellState(nn.Module):
    def __init__(s):
        super().__init__()
        s.cell = nn.LSTMCell(16, 32)
        s.register_buffer("h", torch.zeros(1, 32))
        s.register_buffer("c", torch.zeros(1, 32))

    def forward(s, x):
        h, c = s.cell(x, (s.h, s.c))
        s.h.copy_(h)
        s.c.copy_(c)
        return h, c


class GRUCellState(nn.Module):
    def __init__(s, bias=True):
        super().__init__()
        s.cell = nn.GRUCell(16, 32, bias=bias)
        s.register_buffer("h", torch.zeros(1, 32))

    def forward(s, x):
        h = s.cell(x, s.h)
        s.h.copy_(h)
        return h


class RNNCellState(nn.Module):
    def __init__(s, nonlinearity="tanh"):
        super().__init__()
        s.cell = nn.RNNCell(16, 32, nonlinearity=nonlinearity)
        s.register_buffer("h", torch.zeros(1, 32))

    def forward(s, x):
        h = s.cell(x, s.h)
        s.h.copy_(h)
        return h


class LSTMState(nn.Module):
    """Two layers stepped one token at a time, (h, c) of shape (2, 1, 32)."""

    def __init__(s, **options):
        super().__init__()
        options = {"num_layers": 2, "batch_first": True, **options}
        s.lstm = nn.LSTM(16, 32, **options)
        states = options["num_layers"] * (2 if options.get("bidirectional") else 1)
        s.register_buffer("h", torch.zeros(states, 1, options.get("proj_size") or 32))
        s.register_buffer("c", torch.zeros(states, 1, 32))

    def forward(s, x):
        y, (h, c) = s.lstm(x, (s.h, s.c))
        s.h.copy_(h)
        s.c.copy_(c)
        return y, h, c


class GRUState(nn.Module):
    def __init__(s, **options):
        super().__init__()
        options = {"num_layers": 2, "batch_first": True, **options}
        s.gru = nn.GRU(16, 32, **options)
        states = options["num_layers"] * (2 if options.get("bidirectional") else 1)
        s.register_buffer("h", torch.zeros(states, 1, 32))

    def forward(s, x):
        y, h = s.gru(x, s.h)
        s.h.copy_(h)
        return y, h


CELLS = {
    # name: (model factory, input shape of one step)
    "lstm_cell": (LSTMCellState, (1, 16)),
    "gru_cell": (GRUCellState, (1, 16)),
    "rnn_cell": (RNNCellState, (1, 16)),
    "lstm_2_layers": (LSTMState, (1, 1, 16)),
    "gru_2_layers": (GRUState, (1, 1, 16)),
}


def steps(shape, seed, count=STEPS):
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(shape, generator=generator),) for _ in range(count)]


@functools.cache
def quantized_cell(cell: str):
    make_model, shape = CELLS[cell]
    torch.manual_seed(0)
    model = make_model().eval()
    return model, quantize(model, steps(shape, seed=1), quant="16a8w")


def assert_tracks_references(model, quantized, program, inputs):
    report = program.qnn_mutbuf_report
    assert report.cpu_ops == [], report.cpu_ops
    device = HostRunner(program.buffer).run(inputs)
    references = {
        "fake-quant": (EagerRunner(quantized).run(inputs), FAKE_QUANT_DB),
        "fp32": (EagerRunner(model).run(inputs), FP32_DB),
    }
    for name, (reference, bar) in references.items():
        worst = min(compare_steps(name, reference, device).rows, key=lambda row: row.sqnr_db)
        assert worst.sqnr_db >= bar, (
            f"step {worst.step}, output {worst.output}: {worst.sqnr_db:.1f} dB against {name}"
        )


@pytest.mark.parametrize("cell", sorted(CELLS))
def test_state_at_top_level(cell, host_sdk):
    model, quantized = quantized_cell(cell)
    inputs = steps(CELLS[cell][1], seed=2)
    program = lower(quantized, inputs[0], delegate_mutable_buffers=False)
    assert sorted(program.qnn_mutbuf_report.top_level_buffers) == sorted(
        name for name, _ in model.named_buffers()
    )
    assert_tracks_references(model, quantized, program, inputs)


@pytest.mark.parametrize("cell", sorted(CELLS))
def test_state_in_delegate(cell, host_sdk):
    model, quantized = quantized_cell(cell)
    inputs = steps(CELLS[cell][1], seed=2)
    program = lower(quantized, inputs[0], delegate_mutable_buffers=True)
    assert sorted(program.qnn_mutbuf_report.delegated_buffers) == sorted(
        name for name, _ in model.named_buffers()
    )
    assert_tracks_references(model, quantized, program, inputs)


DECOMPOSED = {
    **CELLS,
    "lstm_cell_no_bias": (lambda: _without_bias(LSTMCellState()), (1, 16)),
    "gru_cell_no_bias": (lambda: GRUCellState(bias=False), (1, 16)),
    "rnn_cell_relu": (lambda: RNNCellState("relu"), (1, 16)),
    "lstm_3_tokens_bidirectional": (lambda: LSTMState(bidirectional=True), (1, 3, 16)),
    "gru_3_tokens_time_first": (lambda: GRUState(batch_first=False), (3, 1, 16)),
    "gru_no_bias": (lambda: GRUState(bias=False), (1, 1, 16)),
}


def _without_bias(model):
    model.cell = nn.LSTMCell(16, 32, bias=False)
    return model


def _recurrent_ops(graph_module):
    names = ("lstm", "gru", "rnn_")
    return [
        node
        for node in graph_module.graph.nodes
        if node.op == "call_function" and any(name in str(node.target) for name in names)
    ]


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "non-strict"])
@pytest.mark.parametrize("case", sorted(DECOMPOSED))
def test_decomposition_equals_the_cell(case, strict):
    make_model, shape = DECOMPOSED[case]
    torch.manual_seed(0)
    model = make_model().eval()
    inputs = steps(shape, seed=3, count=6)
    exported = torch.export.export(copy.deepcopy(model), inputs[0], strict=strict).module()
    (cell,) = _recurrent_ops(exported)
    decomposed = decompose_recurrent_cells(exported)

    assert _recurrent_ops(decomposed) == []
    kept = {
        key for key in ("nn_module_stack", "stack_trace", "source_fn_stack") if key in cell.meta
    }
    for node in decomposed.graph.nodes:
        if node.op == "call_function" and node.target is not torch.ops.aten.copy_.default:
            assert "val" in node.meta and kept <= node.meta.keys(), node.format_node()
    eager = EagerRunner(model).run(inputs)
    spelled_out = EagerRunner(decomposed).run(inputs)
    for row in compare_steps("eager", eager, spelled_out).rows:
        assert row.max_abs_error <= 1e-5, row


def test_projected_lstm_is_refused():
    with pytest.raises(UnsupportedMutationError, match=r"lstm \(.*proj_size=8 is not supported"):
        quantize(LSTMState(proj_size=8), steps((1, 1, 16), seed=1, count=1), quant="16a8w")
