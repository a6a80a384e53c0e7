"""Which QNN tensors hold a mutable buffer's state, and giving them its encoding.

Shared by the builders: the buffer tensor must carry exactly the encoding of the
value written back into it, because the delegate reads the same memory next step.
"""

from __future__ import annotations

import torch
from executorch.backends.qualcomm.builders.node_visitor import dq_ops, q_ops
from executorch.backends.qualcomm.builders.utils import is_mutable_buffer_input
from executorch.backends.qualcomm.utils.constants import QCOM_QUANT_ATTRS
from torch.export import ExportedProgram

from qnn_mutbuf.errors import LoweringError

_ENCODING_FIELDS = ("scale", "zero_point", "quant_min", "quant_max", "dtype")


def is_state_tensor(node: object, edge_program: ExportedProgram) -> bool:
    """True for a delegated mutable buffer, or a value that is one (q/dq, or the
    ``where(loaded, buffer, initial)`` select that supplies the initial state)."""
    if not isinstance(node, torch.fx.Node):
        return False
    if node.op == "placeholder":
        return bool(is_mutable_buffer_input(node, edge_program))
    if node.op != "call_function":
        return False
    if node.target in q_ops or node.target in dq_ops:
        return is_state_tensor(node.args[0], edge_program)
    if "where" in str(node.target) and len(node.args) == 3:
        return is_state_tensor(node.args[1], edge_program)
    return False


def same_encoding(first: dict, second: dict) -> bool:
    return all(first.get(key) == second.get(key) for key in _ENCODING_FIELDS)


def give_state_encoding(
    state: torch.fx.Node, writer: torch.fx.Node, edge_program: ExportedProgram
) -> None:
    """Gives `state` the quant attrs of `writer`'s output.

    A state tensor that already carries a different encoding is an error: the
    memory would be read in one encoding and written in another.
    """
    written = writer.meta.get(QCOM_QUANT_ATTRS)
    if written is None:
        return
    current = state.meta.get(QCOM_QUANT_ATTRS)
    if current is None or same_encoding(current, written):
        state.meta[QCOM_QUANT_ATTRS] = dict(written)
        return
    if is_state_tensor(state, edge_program):
        raise LoweringError(
            f"Node '{writer.name}' writes the mutable buffer read by '{state.name}' with "
            f"scale {written.get('scale')} / zero point {written.get('zero_point')}, but the "
            f"buffer is read with scale {current.get('scale')} / zero point "
            f"{current.get('zero_point')}. Quantize with MutableBufferQnnQuantizer so both "
            "share one state encoding."
        )
    # Not a buffer: keep upstream's behaviour of taking the output encoding.
    state.meta[QCOM_QUANT_ATTRS] = dict(written)
