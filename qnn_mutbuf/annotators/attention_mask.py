"""Annotation of the bounded attention-mask select (see passes/attention_mask.py).

The scores, the masked constant and the select's output share one
:class:`MaskedScoresObserver`, which ranges over the real scores and puts the masked
value just below them (the HTP's Select needs one encoding on all of them).
"""

from __future__ import annotations

from torch.fx import GraphModule
from torchao.quantization.pt2e.quantizer import (
    QuantizationAnnotation,
    SharedQuantizationSpec,
)
from torchao.quantization.pt2e.quantizer.quantizer import Q_ANNOTATION_KEY

from qnn_mutbuf.annotators.state import is_float_value, with_observer
from qnn_mutbuf.passes.attention_mask import (
    MASKED_META_KEY,
    MaskedScoresObserver,
    constant_value,
    is_masked_value,
)


def annotate_masked_scores(graph_module: GraphModule, quantization_config_for) -> None:
    for node in graph_module.graph.nodes:
        if not node.meta.get(MASKED_META_KEY):
            continue
        config = quantization_config_for(node)
        activation = getattr(config, "output_activation", None)
        if activation is None:
            continue
        masked_spec = with_observer(activation, MaskedScoresObserver)
        _, on_true, on_false = node.args
        constant = next(
            (
                v
                for v in (on_true, on_false)
                if is_float_value(v) and is_masked_value(constant_value(v, graph_module))
            ),
            None,
        )
        scores = next(
            (v for v in (on_true, on_false) if is_float_value(v) and v is not constant), None
        )
        if constant is None or scores is None:
            continue
        # The HTP's Select does not requantize its inputs: scores, masked value and
        # result all take the masked-scores encoding.
        inputs = {constant: masked_spec, scores: SharedQuantizationSpec((constant, node))}
        # No implicit sharing: the masked constant's own output encoding (from the
        # upstream constant rule) must not replace the masked-scores observer.
        node.meta[Q_ANNOTATION_KEY] = QuantizationAnnotation(
            input_qspec_map=inputs,
            output_qspec=SharedQuantizationSpec((constant, node)),
            allow_implicit_sharing=False,
            _annotated=True,
        )
