"""The rewrites every stateful graph gets before it is quantized or lowered in fp16.

Both paths need the same functional form of the state updates; keeping the list in
one place keeps them from drifting apart (fp16 once missed the compound-op rewrite).
"""

from __future__ import annotations

from torch.fx import GraphModule

from qnn_mutbuf.passes.compound_ops import spell_out_compound_ops
from qnn_mutbuf.passes.functionalize import functionalize_mutable_buffers
from qnn_mutbuf.passes.integer_arithmetic import decompose_integer_arithmetic


def functional_state_graph(graph_module: GraphModule) -> GraphModule:
    """In-place buffer updates made functional, compound ops spelled out, integer
    index arithmetic made exact."""
    graph_module = functionalize_mutable_buffers(graph_module)
    graph_module = spell_out_compound_ops(graph_module)
    return decompose_integer_arithmetic(graph_module)
