"""Keeps a delegated buffer stored in its state encoding inside the QNN graph.

Upstream inserts a Quantize after every graph input and a Dequantize before every
graph output, mutable buffers included, so a delegated 8-bit KV cache is stored as
float32 (four times the memory) and quantized and dequantized in full every step.
The delegate owns that memory and ExecuTorch never sees it, so it can hold the
quantized values directly: we tag the buffer's placeholder and the node that
produces its new value as quantized I/O, which makes the buffer's input and output
tensors carry exactly the state encoding.
"""

from __future__ import annotations

import logging

import torch
from executorch.backends.qualcomm.builders.node_visitor import dq_ops, q_ops
from executorch.backends.qualcomm.utils.constants import (
    QCOM_DTYPE,
    QCOM_QUANT_ATTRS,
    QCOM_QUANTIZED_IO,
)
from torch.export import ExportedProgram

logger = logging.getLogger(__name__)

DELEGATION_TAG = "delegation_tag"


def _attrs_key(attrs: dict) -> tuple:
    return tuple(
        (key, float(value) if isinstance(value, float) else value)
        for key, value in sorted(attrs.items())
        if key in ("scale", "zero_point", "quant_min", "quant_max", "dtype")
    )


def _producer(node: torch.fx.Node) -> torch.fx.Node:
    """The op whose value a (de)quantize chain carries."""
    while node.op == "call_function" and (node.target in dq_ops or node.target in q_ops):
        node = node.args[0]
    return node


def keep_delegated_state_quantized(edge_program: ExportedProgram) -> list[str]:
    """Tags delegated floating-point mutable buffers as quantized I/O.

    Returns the names of the buffers tagged. The buffer is read in the encoding it
    is written with (its memory holds written values); a different read encoding is
    replaced, with a warning.
    """
    signature = edge_program.graph_signature
    output = next(n for n in edge_program.graph.nodes if n.op == "output")
    produced = {n.name: n for n in output.args[0] if isinstance(n, torch.fx.Node)}
    placeholders = {
        signature.inputs_to_buffers[n.name]: n
        for n in edge_program.graph.nodes
        if n.op == "placeholder" and n.name in signature.inputs_to_buffers
    }
    tagged = []
    for output_name, buffer in signature.buffers_to_mutate.items():
        placeholder = placeholders.get(buffer)
        written = produced.get(output_name)
        if placeholder is None or written is None or DELEGATION_TAG not in placeholder.meta:
            continue
        producer = _producer(written)
        write_attrs = producer.meta.get(QCOM_QUANT_ATTRS)
        if write_attrs is None:
            continue  # floating-point or integer state: nothing to keep quantized
        read_attrs = placeholder.meta.get(QCOM_QUANT_ATTRS)
        if read_attrs is not None and _attrs_key(read_attrs) != _attrs_key(write_attrs):
            logger.warning(
                "Mutable buffer '%s' is read with %s but written with %s (node '%s'); it is "
                "kept in the written encoding. MutableBufferQnnQuantizer gives both one "
                "encoding that also covers the initial state.",
                buffer,
                dict(_attrs_key(read_attrs)),
                dict(_attrs_key(write_attrs)),
                producer.name,
            )
        placeholder.meta[QCOM_QUANT_ATTRS] = dict(write_attrs)
        dtype = write_attrs[QCOM_DTYPE]
        placeholder.meta[QCOM_QUANTIZED_IO] = dtype
        producer.meta[QCOM_QUANTIZED_IO] = dtype
        tagged.append(buffer)
    return tagged
