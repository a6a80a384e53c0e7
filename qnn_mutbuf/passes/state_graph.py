"""The rewrites every stateful graph gets before it is quantized or lowered in fp16.

Both paths need the same functional form of the state updates; keeping the list in
one place keeps them from drifting apart (fp16 once missed the compound-op rewrite).
"""

from __future__ import annotations

from torch.fx import GraphModule

from qnn_mutbuf.passes.bool_gathers import gather_bool_tables_as_int
from qnn_mutbuf.passes.compound_ops import spell_out_compound_ops
from qnn_mutbuf.passes.functionalize import functionalize_mutable_buffers
from qnn_mutbuf.passes.integer_arithmetic import decompose_integer_arithmetic
from qnn_mutbuf.passes.recurrent_cells import decompose_recurrent_cells
from qnn_mutbuf.passes.returned_state import separate_returned_state
from qnn_mutbuf.passes.scalar_positions import tensorize_scalar_positions
from qnn_mutbuf.passes.set_grad_regions import inline_set_grad_regions
from qnn_mutbuf.passes.written_constants import promote_written_constants


def functional_state_graph(graph_module: GraphModule) -> GraphModule:
    """Set-grad regions inlined, written constants made buffers, in-place buffer
    updates made functional, compound ops spelled out, integer index arithmetic exact."""
    graph_module = inline_set_grad_regions(graph_module)
    graph_module = tensorize_scalar_positions(graph_module)
    graph_module = promote_written_constants(graph_module)
    graph_module = decompose_recurrent_cells(graph_module)
    graph_module = functionalize_mutable_buffers(graph_module)
    graph_module = separate_returned_state(graph_module)
    graph_module = spell_out_compound_ops(graph_module)
    graph_module = gather_bool_tables_as_int(graph_module)
    return decompose_integer_arithmetic(graph_module)
