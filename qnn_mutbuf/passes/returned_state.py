"""Gives a returned state value an output node of its own.

A model that returns the state it writes (``h.copy_(new); return new``, an RNN cell's
``return h, c``) exports with one node that is both a buffer mutation and a user
output. Delegated, ExecuTorch 1.5.1 refuses the program (``Constant h was tagged to
be consumed by the buffer ... also used as other types of outputs``,
lowered_backend_module.py). A second dequantize of the same value is merged back
into the first by the QNN passes, so the output becomes ``value + 0`` before
annotation: a real op with an output encoding of its own, the same values.
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node
from torch.fx.passes.infra.pass_base import PassBase, PassResult

from qnn_mutbuf.detect import find_mutable_buffers
from qnn_mutbuf.passes.graph_edit import SOURCE_META_KEYS, edited

aten = torch.ops.aten


class SeparateReturnedState(PassBase):
    """Runs on a functionalized graph (one write-back ``copy_`` per buffer)."""

    def call(self, graph_module: GraphModule) -> PassResult:
        graph = graph_module.graph
        written = {
            writers[-1].args[1]
            for writers in find_mutable_buffers(graph_module).values()
            if writers[-1].target == aten.copy_.default and isinstance(writers[-1].args[1], Node)
        }
        output = next(n for n in graph.nodes if n.op == "output")
        replaced: dict[Node, Node] = {}

        def separate(value: object) -> object:
            if not isinstance(value, Node) or value not in written:
                return value
            if value not in replaced:
                with graph.inserting_before(output):
                    copy = graph.call_function(aten.add.Tensor, (value, 0))
                copy.meta["val"] = value.meta.get("val")
                for key in SOURCE_META_KEYS:
                    if key in value.meta:
                        copy.meta[key] = value.meta[key]
                replaced[value] = copy
            return replaced[value]

        output.args = (torch.fx.map_arg(output.args[0], separate),)
        return edited(graph_module, bool(replaced))


def separate_returned_state(graph_module: GraphModule) -> GraphModule:
    return SeparateReturnedState()(graph_module).graph_module
