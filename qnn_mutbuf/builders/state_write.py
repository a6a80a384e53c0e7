"""Builders for compute ops that produce a delegated buffer's next state.

``acc.add_(x)`` reaches the backend as an ``add`` whose output is the buffer's
mutation output. These visitors wrap upstream's, unchanged, and first make sure the
buffer tensor read by the op carries the encoding of the value it writes back.
"""

from __future__ import annotations

from executorch.backends.qualcomm.builders.utils import is_mutable_buffer_output

from qnn_mutbuf.builders.state_encoding import give_state_encoding, is_state_tensor
from qnn_mutbuf.builders.wrapping import register_wrapped_visitors

# Ops that functionalized in-place updates of state turn into.
STATE_WRITE_TARGETS = (
    "aten.add.Tensor",
    "aten.sub.Tensor",
    "aten.mul.Tensor",
    "aten.div.Tensor",
    "aten.where.self",
    "aten.slice_scatter.default",
    "aten.clamp.default",
    "aten.maximum.default",
    "aten.minimum.default",
)


def _state_writing(upstream: type) -> type:
    class StateWriteVisitor(upstream):
        target = list(upstream.target)

        def define_node(self, node, nodes_to_wrappers):
            if is_mutable_buffer_output(node, self.edge_program):
                for arg in node.args:
                    if is_state_tensor(arg, self.edge_program):
                        give_state_encoding(self.get_node(arg), node, self.edge_program)
            return super().define_node(node, nodes_to_wrappers)

    return StateWriteVisitor


def register_state_write_visitors() -> None:
    """Wraps the upstream visitor of each state-writing op, once."""
    register_wrapped_visitors(STATE_WRITE_TARGETS, "StateWrite", _state_writing)
