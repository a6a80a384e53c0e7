"""MutableBufferQnnQuantizer as a drop-in, find_mutable_buffers, folding and errors."""

import copy

import pytest
import torch
from bar import assert_identical
from executorch.backends.qualcomm.quantizer.quantizer import QnnQuantizer, QuantDtype
from models import ConvLinearAdd
from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

from qnn_mutbuf import HostRunner, MutableBufferQnnQuantizer, find_mutable_buffers, lower, quantize
from qnn_mutbuf.errors import UnsupportedMutationError


def _pt2e(model, quantizer, steps):
    prepared = prepare_pt2e(torch.export.export(model, steps[0]).module(), quantizer)
    for step in steps:
        prepared(*step)
    return convert_pt2e(prepared)


def test_model_without_buffers_quantizes_and_lowers_as_upstream(host_sdk):
    torch.manual_seed(0)
    model = ConvLinearAdd().eval()
    steps = [(torch.randn(1, 3, 8, 8), torch.randn(1, 8)) for _ in range(3)]
    ours, theirs = MutableBufferQnnQuantizer(), QnnQuantizer()
    for quantizer in (ours, theirs):
        quantizer.set_default_quant_config(QuantDtype.use_8a8w, is_conv_per_channel=True)
    converted_ours = _pt2e(copy.deepcopy(model), ours, steps)
    converted_theirs = _pt2e(copy.deepcopy(model), theirs, steps)
    assert converted_ours.code == converted_theirs.code
    for step in steps:
        assert torch.equal(converted_ours(*step), converted_theirs(*step))

    from executorch.backends.qualcomm.utils.utils import to_edge_transform_and_lower_to_qnn

    from qnn_mutbuf.sdk.device import htp_compile_spec

    upstream = to_edge_transform_and_lower_to_qnn(
        converted_theirs, steps[0], htp_compile_spec("SM8650")
    ).to_executorch()
    mine = lower(converted_ours, steps[0])
    assert_identical(HostRunner(mine.buffer).run(steps), HostRunner(upstream.buffer).run(steps))


class Mixed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("cache", torch.zeros(1, 8, 4))
        self.register_buffer("pos", torch.zeros(1, dtype=torch.long))
        self.register_buffer("constant", torch.ones(4))

    def forward(self, x):
        scratch = x.clone()
        scratch.add_(1)  # in-place on a clone: not a buffer
        x.mul_(1)  # in-place on an input: not a buffer
        self.cache.index_copy_(1, self.pos, scratch.unsqueeze(1))
        self.pos.add_(1)
        return self.cache * self.constant


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "non_strict"])
def test_find_mutable_buffers_from_the_graph(strict):
    example = (torch.randn(1, 4),)
    program = torch.export.export(Mixed(), example, strict=strict)
    for graph_owner in (program.module(), program, program.run_decompositions({})):
        found = find_mutable_buffers(graph_owner)
        assert sorted(found) == ["cache", "pos"], type(graph_owner)
        assert all(found[name] for name in found)


def test_find_mutable_buffers_when_the_signature_lost_them():
    """torch.export keeps in-place updates in-place and its signature then lists no
    buffer mutation; detection must come from the graph itself."""
    program = torch.export.export(Mixed(), (torch.randn(1, 4),), strict=False)
    assert not program.graph_signature.buffers_to_mutate  # what this torch version does
    assert sorted(find_mutable_buffers(program)) == ["cache", "pos"]
    writers = find_mutable_buffers(program.module())
    assert [n.target.__name__ for n in writers["cache"]] == ["index_copy_.default"]


def test_convert_keeps_buffers_and_folds_weights():
    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 4)
            self.register_buffer("state", torch.zeros(1, 4))

        def forward(self, x):
            self.state.mul_(0.5).add_(self.linear(x))
            return self.state * 1

    steps = [(torch.rand(1, 4),) for _ in range(4)]
    quantized = quantize(Scaled().eval(), steps)
    targets = {str(n.target) for n in quantized.graph.nodes if n.op == "get_attr"}
    assert "state" in targets
    assert "linear.weight" not in targets and any(t.startswith("_frozen_param") for t in targets)
    assert torch.equal(quantized.state, torch.zeros(1, 4)), "initial state not restored"


class SplitWrite(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("buf", torch.zeros(4, 4))

    def forward(self, x):
        first, _ = self.buf.split(2)
        first.add_(x)
        return self.buf + 0


def test_unsupported_view_write_names_node_and_buffer():
    with pytest.raises(UnsupportedMutationError) as error:
        quantize(SplitWrite().eval(), [(torch.rand(2, 4),)])
    message = str(error.value)
    assert "'buf'" in message and "add_" in message and "split" in message
