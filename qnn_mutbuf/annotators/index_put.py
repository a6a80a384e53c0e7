"""Annotation of ``index_put`` / ``index_put_`` (KV-cache writes, ``cache[:, pos] = x``).

The written values (argument 2) and the result carry the buffer's state encoding;
see :func:`qnn_mutbuf.annotators.state.scatter_annotator`.
"""

from __future__ import annotations

from executorch.backends.qualcomm.quantizer.annotators.htp_rules import IndexPut

from qnn_mutbuf.annotators.state import scatter_annotator

VALUE_ARGUMENT = 2

annotate_index_put = scatter_annotator(IndexPut, VALUE_ARGUMENT)
