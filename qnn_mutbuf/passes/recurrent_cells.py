"""Recurrent cells spelled out in the ops the QNN quantizer annotates.

``nn.LSTMCell``, ``nn.GRUCell`` and ``nn.RNNCell`` export (strict and non-strict,
torch 2.13) as one ``aten.lstm_cell``/``gru_cell``/``rnn_tanh_cell``/``rnn_relu_cell``,
and ``nn.LSTM``/``nn.GRU``/``nn.RNN`` as one ``aten.lstm.input``/``gru.input``/....
QnnQuantizer has no config for them, so they stay float; ExecuTorch decomposes them
later inside a quantized graph, and with the state in mutable buffers QNN validation
fails (``Tensor 0 and 0 have mismatching datatypes``, ``ElementWiseMultiply failed
3110``), then ``aten.linear ... was not decomposed or delegated``. We rewrite them
before annotation into linear/add/sub/mul/sigmoid/tanh/relu/split/select/cat exactly
as PyTorch defines them (LSTM gates i, f, g, o; GRU gates r, z, n with
``n = tanh(W_in x + b_in + r * (W_hn h + b_hn))``), so every op is annotated and each
state buffer keeps one encoding.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch.fx import GraphModule, Node
from torch.fx.node import map_aggregate
from torch.fx.passes.infra.pass_base import PassBase, PassResult

from qnn_mutbuf.errors import UnsupportedMutationError
from qnn_mutbuf.passes.graph_edit import SOURCE_META_KEYS, edited, source_line

aten = torch.ops.aten


Emit = Callable[..., Node]


@dataclass(frozen=True)
class CellWeights:
    """The parameters of one cell (one layer and direction of a stacked RNN)."""

    input_weight: Node
    hidden_weight: Node
    input_bias: Node | None = None
    hidden_bias: Node | None = None


def _linear(emit: Emit, value: Node, weight: Node, bias: Node | None) -> Node:
    if bias is None:
        return emit(aten.linear.default, value, weight)
    return emit(aten.linear.default, value, weight, bias)


def _chunks(emit: Emit, value: Node, count: int) -> list[Node]:
    """``value.chunk(count, 1)`` as one split (one QNN Split op)."""
    width = value.meta["val"].shape[1] // count
    parts = emit(aten.split_with_sizes.default, value, [width] * count, 1)
    return [emit(operator.getitem, parts, index) for index in range(count)]


def lstm_step(emit: Emit, x: Node, state: Sequence[Node], w: CellWeights) -> list[Node]:
    """ATen's LSTMCell: gates = W_ih x + b_ih + W_hh h + b_hh, chunked i, f, g, o;
    c' = f * c + i * g, h' = o * tanh(c')."""
    hidden, cell = state
    gates = emit(
        aten.add.Tensor,
        _linear(emit, hidden, w.hidden_weight, w.hidden_bias),
        _linear(emit, x, w.input_weight, w.input_bias),
    )
    in_gate, forget_gate, cell_gate, out_gate = _chunks(emit, gates, 4)
    in_gate = emit(aten.sigmoid.default, in_gate)
    forget_gate = emit(aten.sigmoid.default, forget_gate)
    cell_gate = emit(aten.tanh.default, cell_gate)
    out_gate = emit(aten.sigmoid.default, out_gate)
    new_cell = emit(
        aten.add.Tensor,
        emit(aten.mul.Tensor, forget_gate, cell),
        emit(aten.mul.Tensor, in_gate, cell_gate),
    )
    new_hidden = emit(aten.mul.Tensor, out_gate, emit(aten.tanh.default, new_cell))
    return [new_hidden, new_cell]


def gru_step(emit: Emit, x: Node, state: Sequence[Node], w: CellWeights) -> list[Node]:
    """ATen's GRUCell: r, z = sigmoid(W_h{r,z} h + b_h{r,z} + W_i{r,z} x + b_i{r,z}),
    n = tanh(W_in x + b_in + r * (W_hn h + b_hn)), h' = (h - n) * z + n."""
    (hidden,) = state
    input_reset, input_update, input_new = _chunks(
        emit, _linear(emit, x, w.input_weight, w.input_bias), 3
    )
    hidden_reset, hidden_update, hidden_new = _chunks(
        emit, _linear(emit, hidden, w.hidden_weight, w.hidden_bias), 3
    )
    reset = emit(aten.sigmoid.default, emit(aten.add.Tensor, hidden_reset, input_reset))
    update = emit(aten.sigmoid.default, emit(aten.add.Tensor, hidden_update, input_update))
    new = emit(
        aten.tanh.default,
        emit(aten.add.Tensor, input_new, emit(aten.mul.Tensor, hidden_new, reset)),
    )
    difference = emit(aten.sub.Tensor, hidden, new)
    # The final add usually writes the state, and a sum into state takes its operands
    # in the state encoding; PT2E then merges tanh's output into that encoding, and
    # the HTP rejects the tanh (16-bit, QAIRT 2.51: ``incorrect Value -32399, expected
    # equal to -32768``) and runs it on the CPU. ``n * 1.0`` (exact in float) keeps
    # tanh's fixed encoding and requantizes, as passes/fixed_encoding_writes.py does
    # for a tanh that is itself the write.
    requantized = emit(aten.mul.Tensor, new, 1.0)
    return [emit(aten.add.Tensor, emit(aten.mul.Tensor, difference, update), requantized)]


def _rnn_step(activation) -> Callable[..., list[Node]]:
    def step(emit: Emit, x: Node, state: Sequence[Node], w: CellWeights) -> list[Node]:
        """ATen's RNNCell: h' = act(W_hh h + b_hh + W_ih x + b_ih)."""
        (hidden,) = state
        total = emit(
            aten.add.Tensor,
            _linear(emit, hidden, w.hidden_weight, w.hidden_bias),
            _linear(emit, x, w.input_weight, w.input_bias),
        )
        return [emit(activation, total)]

    return step


rnn_tanh_step = _rnn_step(aten.tanh.default)
rnn_relu_step = _rnn_step(aten.relu.default)


def _cell(step, returns_tuple: bool):
    """Rewrite of ``aten.<cell>(input, hx, w_ih, w_hh, b_ih=None, b_hh=None)``."""

    def rewrite(emit: Emit, node: Node) -> list[Node]:
        x, hx, input_weight, hidden_weight, *biases = node.args
        biases += [None] * (2 - len(biases))
        input_bias = node.kwargs.get("b_ih", biases[0])
        hidden_bias = node.kwargs.get("b_hh", biases[1])
        state = list(hx) if returns_tuple else [hx]
        weights = CellWeights(input_weight, hidden_weight, input_bias, hidden_bias)
        return step(emit, x, state, weights)

    return rewrite


def _stacked(step, state_count: int):
    """Rewrite of ``aten.<rnn>.input(input, hx, params, has_biases, num_layers,
    dropout, train, bidirectional, batch_first)``: the cells of every layer, direction
    and time step, as ``torch.nn.LSTM``/``GRU``/``RNN`` define them."""

    def rewrite(emit: Emit, node: Node) -> list[Node]:
        x, hx, params, has_biases, layers, dropout, train, bidirectional, batch_first = node.args
        directions = 2 if bidirectional else 1
        per_cell = 4 if has_biases else 2
        if len(params) != layers * directions * per_cell:
            projected = len(params) == layers * directions * (per_cell + 1)
            if projected and node.target is aten.lstm.input:
                projection = params[per_cell].meta["val"].shape[0]
                raise UnsupportedMutationError(
                    f"{node.name} ({source_line(node)}): nn.LSTM with "
                    f"proj_size={projection} is not supported; use proj_size=0, or write "
                    "the cell out in PyTorch ops (gates from nn.Linear layers, "
                    "h = W_hr(o * tanh(c)))."
                )
            raise UnsupportedMutationError(
                f"{node.name} ({source_line(node)}): {len(params)} weights for "
                f"{layers} layer(s) x {directions} direction(s); expected "
                f"{layers * directions * per_cell}; step the layers as nn.LSTMCell/GRUCell/RNNCell."
            )
        if train and dropout:
            raise UnsupportedMutationError(
                f"{node.name} ({source_line(node)}): exported in training mode with "
                f"dropout={dropout}; call model.eval() before quantizing."
            )
        time_dim = 1 if batch_first else 0
        length = x.meta["val"].shape[time_dim]
        if not isinstance(length, int):
            raise UnsupportedMutationError(
                f"{node.name} ({source_line(node)}): the sequence length is dynamic "
                f"({length}); export with a fixed length (one token per step)."
            )
        states = list(hx) if state_count > 1 else [hx]
        inputs = [emit(aten.select.int, x, time_dim, t) for t in range(length)]
        finals: list[list[Node]] = [[] for _ in states]
        for layer in range(layers):
            outputs = []
            for direction in range(directions):
                index = layer * directions + direction
                weights = CellWeights(*params[index * per_cell : (index + 1) * per_cell])
                carried = [emit(aten.select.int, state, 0, index) for state in states]
                sequence: list[Node | None] = [None] * length
                times = range(length) if direction == 0 else range(length - 1, -1, -1)
                for t in times:
                    carried = step(emit, inputs[t], carried, weights)
                    sequence[t] = carried[0]
                outputs.append(sequence)
                for kept, value in zip(finals, carried, strict=True):
                    kept.append(value)
            if directions == 1:
                inputs = outputs[0]
            else:
                inputs = [
                    emit(aten.cat.default, list(pair), -1) for pair in zip(*outputs, strict=True)
                ]
        return [_stack(emit, inputs, time_dim), *(_stack(emit, kept, 0) for kept in finals)]

    return rewrite


def _stack(emit: Emit, values: Sequence[Node], dim: int) -> Node:
    """``torch.stack`` as PyTorch defines it, ``cat`` of ``unsqueeze``s: a cat writing
    state takes every input in the state encoding (annotators/inplace.py)."""
    expanded = [emit(aten.unsqueeze.default, value, dim) for value in values]
    return expanded[0] if len(expanded) == 1 else emit(aten.cat.default, expanded, dim)


REWRITES: dict[object, Callable[[Emit, Node], list[Node]]] = {
    aten.lstm_cell.default: _cell(lstm_step, returns_tuple=True),
    aten.gru_cell.default: _cell(gru_step, returns_tuple=False),
    aten.rnn_tanh_cell.default: _cell(rnn_tanh_step, returns_tuple=False),
    aten.rnn_relu_cell.default: _cell(rnn_relu_step, returns_tuple=False),
    aten.lstm.input: _stacked(lstm_step, state_count=2),
    aten.gru.input: _stacked(gru_step, state_count=1),
    aten.rnn_tanh.input: _stacked(rnn_tanh_step, state_count=1),
    aten.rnn_relu.input: _stacked(rnn_relu_step, state_count=1),
}


class DecomposeRecurrentCells(PassBase):
    """Replaces every recurrent cell or stacked RNN op by its elementwise definition."""

    def call(self, graph_module: GraphModule) -> PassResult:
        graph = graph_module.graph
        changed = False
        for node in list(graph.nodes):
            rewrite = REWRITES.get(node.target) if node.op == "call_function" else None
            if rewrite is None or not _is_floating(node):
                continue
            emit, created = self._emitter(node)
            with graph.inserting_before(node):
                results = rewrite(emit, node)
            self._replace(node, results)
            for unused in reversed(created):  # e.g. c_n of an nn.LSTM whose c is dropped
                if not unused.users:
                    graph.erase_node(unused)
            changed = True
        return edited(graph_module, changed)

    @staticmethod
    def _replace(node: Node, results: list[Node]) -> None:
        if not isinstance(node.meta.get("val"), (tuple, list)):
            node.replace_all_uses_with(results[0])
        for user in list(node.users):
            if user.op != "call_function" or user.target is not operator.getitem:
                raise UnsupportedMutationError(
                    f"{node.name} ({source_line(node)}): its outputs are used as a whole by "
                    f"{user.name}; expected getitem of each output, as torch.export writes."
                )
            user.replace_all_uses_with(results[user.args[1]])
            node.graph.erase_node(user)
        node.graph.erase_node(node)

    @staticmethod
    def _emitter(node: Node) -> tuple[Emit, list[Node]]:
        """Creates nodes before `node` that carry its source metadata and a fake value;
        returns the emitter and the list of nodes it created."""
        graph = node.graph
        value = node.meta.get("val")
        first = value[0] if isinstance(value, (tuple, list)) else value
        mode = getattr(first, "fake_mode", None)
        created: list[Node] = []

        def fake(arg):
            if not isinstance(arg, Node):
                return arg
            value = arg.meta["val"]
            if mode is None and isinstance(value, torch.Tensor):
                return torch.empty_like(value, device="meta")
            return value

        def emit(target, *args) -> Node:
            new = graph.call_function(target, args)
            for key in SOURCE_META_KEYS:
                if key in node.meta:
                    new.meta[key] = node.meta[key]
            fake_args = map_aggregate(args, fake)
            if mode is not None:
                with mode:
                    new.meta["val"] = target(*fake_args)
            else:
                new.meta["val"] = target(*fake_args)
            created.append(new)
            return new

        return emit, created


def _is_floating(node: Node) -> bool:
    value = node.meta.get("val")
    first = value[0] if isinstance(value, (tuple, list)) and value else value
    return isinstance(first, torch.Tensor) and first.is_floating_point()


def decompose_recurrent_cells(graph_module: GraphModule) -> GraphModule:
    return DecomposeRecurrentCells()(graph_module).graph_module
