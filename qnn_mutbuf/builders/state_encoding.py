"""Which QNN tensors hold a mutable buffer's state, and giving them its encoding.

Shared by the builders: the buffer tensor must carry exactly the encoding of the
value written back into it, because the delegate reads the same memory next step.
"""

from __future__ import annotations

import logging

import torch
from executorch.backends.qualcomm.builders.node_visitor import dq_ops, q_ops
from executorch.backends.qualcomm.builders.utils import is_mutable_buffer_input
from executorch.backends.qualcomm.utils.constants import QCOM_QUANT_ATTRS
from torch.export import ExportedProgram

logger = logging.getLogger(__name__)

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

    The buffer's memory holds what was written, so the written encoding is the one
    to read it with. A buffer quantized without MutableBufferQnnQuantizer can carry a
    different read encoding (calibrated separately, maybe not covering the initial
    contents); it is replaced, as upstream does, with a warning naming both.
    """
    written = writer.meta.get(QCOM_QUANT_ATTRS)
    if written is None:
        return
    current = state.meta.get(QCOM_QUANT_ATTRS)
    if (
        current is not None
        and not same_encoding(current, written)
        and is_state_tensor(state, edge_program)
    ):
        logger.warning(
            "Mutable buffer read by '%s' (scale %s, zero point %s) is written by '%s' with "
            "scale %s, zero point %s; reading it in the written encoding. Quantize with "
            "MutableBufferQnnQuantizer to give both one encoding that covers the initial state.",
            state.name,
            current.get("scale"),
            current.get("zero_point"),
            writer.name,
            written.get("scale"),
            written.get("zero_point"),
        )
    state.meta[QCOM_QUANT_ATTRS] = dict(written)
