"""Annotators that give mutable buffers one state encoding (one file per op family)."""

import torch

from qnn_mutbuf.annotators.index_copy import annotate_index_copy
from qnn_mutbuf.annotators.index_put import annotate_index_put

aten = torch.ops.aten

# The annotate functions MutableBufferQnnQuantizer registers in place of upstream's.
STATE_OP_ANNOTATORS = {
    aten.index_put.default: annotate_index_put,
    aten.index_put_.default: annotate_index_put,
    aten.index_copy.default: annotate_index_copy,
    aten.index_copy_.default: annotate_index_copy,
}

__all__ = ["STATE_OP_ANNOTATORS", "annotate_index_copy", "annotate_index_put"]
