"""FunctionalizeMutableBuffers alone: eager semantics step by step, metadata, errors."""

import copy

import pytest
import torch

from qnn_mutbuf.detect import find_mutable_buffers
from qnn_mutbuf.errors import UnsupportedMutationError
from qnn_mutbuf.passes.functionalize import STATE_META_KEY, functionalize_mutable_buffers


class Everything(torch.nn.Module):
    """Chains, several updates of one buffer, another buffer as operand, reads of a
    buffer and of a view of it between updates, writes through slices and select,
    __setitem__ with a tensor index, an integer counter."""

    def __init__(self):
        super().__init__()
        self.register_buffer("k", torch.ones(1, 8, 2, 4))
        self.register_buffer("pos", torch.zeros(1, dtype=torch.long))
        self.register_buffer("acc", torch.zeros(4))
        self.register_buffer("other", torch.ones(4))

    def forward(self, x, v):
        window = self.k[:, 2:4]
        self.k.index_copy_(1, self.pos, v)
        early = self.acc * 1
        self.acc.mul_(0.9).add_(x)
        self.acc.add_(self.other)
        self.other.mul_(self.acc)
        self.k[:, 0:1] = v * 2
        self.k[0, 5, 1] = x
        self.k[:, self.pos + 1] = v
        self.pos.add_(1)
        return self.k + 0, early + window.sum(), self.other * 1, self.pos * 1


def _run(module, steps):
    outputs = []
    for step in steps:
        outputs.append([t.clone() for t in module(*step)])
    return outputs


def test_functionalized_graph_matches_eager_over_steps():
    model = Everything()
    example = (torch.ones(4), torch.ones(1, 1, 2, 4))
    graph_module = torch.export.export(copy.deepcopy(model), example).module()
    functional = functionalize_mutable_buffers(graph_module)
    generator = torch.Generator().manual_seed(0)
    steps = [
        (torch.randn(4, generator=generator), torch.randn(1, 1, 2, 4, generator=generator))
        for _ in range(5)
    ]
    expected = _run(model, steps)
    actual = _run(functional, steps)
    for want, got in zip(expected, actual, strict=True):
        for a, b in zip(want, got, strict=True):
            assert torch.equal(a, b)
    for name, value in model.named_buffers():
        assert torch.equal(value, functional.get_buffer(name)), name


def test_one_write_back_per_buffer_and_no_in_place_left():
    example = (torch.ones(4), torch.ones(1, 1, 2, 4))
    functional = functionalize_mutable_buffers(torch.export.export(Everything(), example).module())
    writers = find_mutable_buffers(functional)
    assert sorted(writers) == ["acc", "k", "other", "pos"]
    for name, nodes in writers.items():
        assert [n.target for n in nodes] == [torch.ops.aten.copy_.default], name
        assert nodes[0].meta[STATE_META_KEY] == {"buffer": name, "role": "write_back"}
    for node in functional.graph.nodes:
        schema = getattr(node.target, "_schema", None)
        if schema is not None and node.target != torch.ops.aten.copy_.default:
            assert not any(a.alias_info and a.alias_info.is_write for a in schema.arguments), node


def test_metadata_points_at_user_code():
    example = (torch.ones(4), torch.ones(1, 1, 2, 4))
    original = torch.export.export(Everything(), example).module()
    source = {n.name: n for n in original.graph.nodes}
    mul_stack = source["mul_"].meta["nn_module_stack"]
    functional = functionalize_mutable_buffers(original)
    writes = [
        n for n in functional.graph.nodes if n.meta.get(STATE_META_KEY, {}).get("role") == "write"
    ]
    assert writes
    for node in writes:
        assert "val" in node.meta and "stack_trace" in node.meta, node
        assert "nn_module_stack" in node.meta, node
    mul = next(
        n
        for n in writes
        if n.target == torch.ops.aten.mul.Tensor and n.meta[STATE_META_KEY]["buffer"] == "acc"
    )
    assert mul.meta["nn_module_stack"] == mul_stack
    assert "self.acc.mul_(0.9)" in mul.meta["stack_trace"]
    assert "source_fn_stack" in mul.meta or "torch_fn" in mul.meta


def test_integer_buffer_stays_integer():
    example = (torch.ones(4), torch.ones(1, 1, 2, 4))
    functional = functionalize_mutable_buffers(torch.export.export(Everything(), example).module())
    (write_back,) = find_mutable_buffers(functional)["pos"]
    assert write_back.args[1].meta["val"].dtype == torch.long


class ExpandWrite(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("buf", torch.zeros(4, 4))

    def forward(self, x):
        self.buf.unfold(0, 2, 2).add_(x)
        return self.buf + 0


def test_write_through_an_unhandled_view_fails_naming_node_and_buffer():
    example = (torch.ones(2, 4, 2),)
    graph_module = torch.export.export(ExpandWrite(), example).module()
    with pytest.raises(UnsupportedMutationError) as error:
        functionalize_mutable_buffers(graph_module)
    message = str(error.value)
    assert "Buffer 'buf'" in message and "'add_'" in message and "unfold" in message
