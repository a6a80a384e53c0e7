"""Annotation of ``index_put`` / ``index_put_`` (KV-cache writes, ``cache[:, pos] = x``).

On a mutable buffer the buffer input is never annotated (an observer there would be
a second, wrong encoding of the same memory) and the written values and the result
take the state encoding, so the scatter on the HTP is a pure copy. On anything else
(a clone, an input) upstream's annotation is kept unchanged.
"""

from __future__ import annotations

from executorch.backends.qualcomm.quantizer.annotators.htp_rules import IndexPut
from torch.fx import Node

from qnn_mutbuf.annotators.state import annotate, encoding_of, is_float_value, output_spec

VALUE_ARGUMENT = 2


def annotate_index_put(node: Node, quantization_config: object) -> None:
    encoding = encoding_of(node)
    if encoding is None or not is_float_value(node):
        IndexPut.annotate(node, quantization_config)
        return
    value = node.args[VALUE_ARGUMENT]
    inputs = {value: encoding.shared} if is_float_value(value) else {}
    annotate(node, inputs, output_spec(node, encoding))
