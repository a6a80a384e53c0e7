"""Annotation of ``index_copy`` / ``index_copy_`` (``k.index_copy_(dim, pos, x)``).

Same rule as ``index_put``: the buffer input stays unannotated, the copied values and
the result carry the buffer's state encoding; non-buffer uses keep upstream's rule.
"""

from __future__ import annotations

from executorch.backends.qualcomm.quantizer.annotators.htp_rules import IndexCopy
from torch.fx import Node

from qnn_mutbuf.annotators.state import annotate, encoding_of, is_float_value, output_spec

SOURCE_ARGUMENT = 3


def annotate_index_copy(node: Node, quantization_config: object) -> None:
    encoding = encoding_of(node)
    if encoding is None or not is_float_value(node):
        IndexCopy.annotate(node, quantization_config)
        return
    source = node.args[SOURCE_ARGUMENT]
    inputs = {source: encoding.shared} if is_float_value(source) else {}
    annotate(node, inputs, output_spec(node, encoding))
