"""Annotation of the functional ops that replaced in-place updates of a buffer.

After functionalization ``s.mul_(0.9).add_(x)`` is ``mul`` then ``add`` whose results
are stored in ``s``. Each stored result takes the state encoding; its state input
(the buffer read, or the previous stored value) shares it too. Other inputs keep
their own encoding for compute ops (``x`` above), but data-movement ops (scatters,
reshapes, casts, copies) take every input in the state encoding, so they stay exact.
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node
from torchao.quantization.pt2e.quantizer import SharedQuantizationSpec
from torchao.quantization.pt2e.quantizer.quantizer import Q_ANNOTATION_KEY

from qnn_mutbuf.annotators.state import (
    StateEncoding,
    annotate,
    encoding_of,
    is_float_value,
    output_spec,
    state_info,
)
from qnn_mutbuf.passes.fixed_encoding_writes import REQUANTIZE_META_KEY

aten = torch.ops.aten

# Buffers written by these keep their own annotators (buffer input unannotated).
OWN_ANNOTATORS = {
    aten.index_put.default,
    aten.index_put_.default,
    aten.index_copy.default,
    aten.index_copy_.default,
}

DATA_MOVEMENT_OPS = {
    aten.slice_scatter.default,
    aten.select_scatter.default,
    aten.diagonal_scatter.default,
    aten.as_strided_scatter.default,
    aten.scatter.src,
    aten.scatter.value,
    aten.view.default,
    aten.reshape.default,
    aten._unsafe_view.default,
    aten.unsqueeze.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.squeeze.default,
    aten.expand.default,
    aten.permute.default,
    aten.transpose.int,
    aten.t.default,
    aten._to_copy.default,
    aten.clone.default,
    aten.copy.default,
    aten.slice.Tensor,
    aten.select.int,
    aten.cat.default,
    aten.where.self,
}


# Sums into the state take every operand in the state encoding: the add is then an
# integer add on the HTP, bit-exact, instead of a requantization whose rounding HTP's
# 16-bit kernels bias (measured -0.24 steps per add). The operand's own rounding onto
# the state grid is the same one step the requantized sum would have cost, and the
# shared observer also sees the operand, so its range is covered.
SHARED_OPERAND_OPS = {aten.add.Tensor, aten.sub.Tensor}


def _tensor_args(node: Node) -> list[Node]:
    found = []
    for arg in (*node.args, *node.kwargs.values()):
        items = arg if isinstance(arg, (list, tuple)) else [arg]
        found.extend(item for item in items if isinstance(item, Node))
    return found


def annotate_state_writes(graph_module: GraphModule, quantization_config_for) -> None:
    """Gives every stored value of a buffer (and its state inputs) the state encoding."""
    for node in graph_module.graph.nodes:
        encoding = encoding_of(node)
        if encoding is None or state_info(node)["role"] != "write":
            continue
        if node.target in OWN_ANNOTATORS or not is_float_value(node):
            continue
        _annotate_write(node, encoding, quantization_config_for(node))


def _annotate_write(node: Node, encoding: StateEncoding, config: object) -> None:
    previous = node.meta.get(Q_ANNOTATION_KEY)
    previous_inputs = dict(previous.input_qspec_map) if previous is not None else {}
    moves_data = node.target in DATA_MOVEMENT_OPS or node.target in SHARED_OPERAND_OPS
    inputs = {}
    for arg in _tensor_args(node):
        if not is_float_value(arg):
            continue
        arg_encoding = encoding_of(arg)
        if node.meta.get(REQUANTIZE_META_KEY) and arg is node.args[0]:
            inputs[arg] = SharedQuantizationSpec(arg)  # the op's own (fixed) encoding
        elif arg_encoding is not None:
            inputs[arg] = arg_encoding.shared
        elif moves_data:
            inputs[arg] = encoding.shared
        elif arg in previous_inputs:
            inputs[arg] = previous_inputs[arg]
        elif config is not None and config.input_activation is not None:
            inputs[arg] = config.input_activation
    annotate(node, inputs, output_spec(node, encoding))
