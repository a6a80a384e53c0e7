"""Annotation of ``index_copy`` / ``index_copy_`` (``k.index_copy_(dim, pos, x)``).

The copied values (argument 3) and the result carry the buffer's state encoding;
see :func:`qnn_mutbuf.annotators.state.scatter_annotator`.
"""

from __future__ import annotations

from executorch.backends.qualcomm.quantizer.annotators.htp_rules import IndexCopy

from qnn_mutbuf.annotators.state import scatter_annotator

SOURCE_ARGUMENT = 3

annotate_index_copy = scatter_annotator(IndexCopy, SOURCE_ARGUMENT)
