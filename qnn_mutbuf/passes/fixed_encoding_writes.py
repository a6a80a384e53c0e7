"""State written by an op whose HTP kernel fixes its output encoding.

The HTP accepts a 16-bit tanh only with the output encoding [-1, 1) (scale 1/32768,
zero point 32768), and upstream annotates it so. When tanh writes state
(``h.copy_(torch.tanh(...))``, an RNN cell) the state encoding replaced that one,
the op failed validation and fell back to the CPU, taking the state with it. Here
tanh keeps its encoding and the state stores ``tanh * 1.0``, which requantizes into
the state encoding on the HTP: one elementwise op. (Sigmoid's kernel accepts the
state encoding, measured, and is left alone.)
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node
from torch.fx.passes.infra.pass_base import PassBase, PassResult

from qnn_mutbuf.passes.functionalize import STATE_META_KEY
from qnn_mutbuf.passes.graph_edit import edited

aten = torch.ops.aten

FIXED_OUTPUT_ENCODING_OPS = {aten.tanh.default}
# Marks the inserted multiply: its input shares the fixed-encoding op's output spec.
REQUANTIZE_META_KEY = "qnn_mutbuf_requantize"


def _is_float_state_write(node: Node) -> bool:
    info = node.meta.get(STATE_META_KEY)
    value = node.meta.get("val")
    return (
        info is not None
        and info.get("role") == "write"
        and isinstance(value, torch.Tensor)
        and value.is_floating_point()
    )


class RequantizeFixedEncodingWrites(PassBase):
    def call(self, graph_module: GraphModule) -> PassResult:
        graph = graph_module.graph
        changed = False
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target not in FIXED_OUTPUT_ENCODING_OPS:
                continue
            if not _is_float_state_write(node):
                continue
            with graph.inserting_after(node):
                stored = graph.call_function(aten.mul.Tensor, (node, 1.0))
            stored.meta.update(
                {key: value for key, value in node.meta.items() if key != STATE_META_KEY}
            )
            stored.meta[STATE_META_KEY] = node.meta.pop(STATE_META_KEY)
            stored.meta[REQUANTIZE_META_KEY] = True
            for user in [user for user in node.users if user is not stored]:
                user.replace_input_with(node, stored)
            changed = True
        return edited(graph_module, changed)


def requantize_fixed_encoding_writes(graph_module: GraphModule) -> GraphModule:
    return RequantizeFixedEncodingWrites()(graph_module).graph_module
