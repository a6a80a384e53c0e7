"""MutableBufferQnnQuantizer: ExecuTorch's QnnQuantizer, made right for mutable state.

A drop-in for ``QnnQuantizer`` in ``prepare_pt2e``/``convert_pt2e``. On top of
upstream it (1) functionalizes in-place updates of buffers before annotation, (2)
registers our annotators for ``index_put``/``index_copy`` so the buffer input is never
annotated, and (3) gives every floating-point mutable buffer one state encoding
shared by its read, every stored value and its write-back. Because each buffer
keeps a trailing ``copy_`` into it, ``convert_pt2e`` does not fold the buffer into a
frozen constant, while weights are still folded.
"""

from __future__ import annotations

import dataclasses

from executorch.backends.qualcomm.quantizer.quantizer import QnnQuantizer
from executorch.backends.qualcomm.quantizer.rules import OpQuantRule
from torch.fx import GraphModule

from qnn_mutbuf.annotators import STATE_OP_ANNOTATORS
from qnn_mutbuf.annotators.attention_mask import annotate_masked_scores
from qnn_mutbuf.annotators.inplace import annotate_state_writes
from qnn_mutbuf.annotators.state import (
    finalize_state_specs,
    plan_state_encodings,
    share_reader_edges,
)
from qnn_mutbuf.detect import find_mutable_buffers
from qnn_mutbuf.passes.attention_mask import bound_attention_masks
from qnn_mutbuf.passes.fixed_encoding_writes import requantize_fixed_encoding_writes
from qnn_mutbuf.passes.functionalize import STATE_META_KEY
from qnn_mutbuf.passes.gather_tables import pad_narrow_gather_tables
from qnn_mutbuf.passes.integer_arithmetic import integer_arithmetic_nodes
from qnn_mutbuf.passes.state_graph import functional_state_graph
from qnn_mutbuf.records import RECORD_KEY, record_initial_state, replace_buffers
from qnn_mutbuf.sdk.activation import activate_for_quantization


def default_act_observer(quant_dtype):
    """Min-max for 8-bit activations, min-max with headroom for 16-bit ones; None
    (upstream's choice) for floating-point activations."""
    from torchao.quantization.pt2e import MinMaxObserver

    from qnn_mutbuf.observers import HeadroomMinMaxObserver

    if quant_dtype.name.startswith("use_16a"):
        return HeadroomMinMaxObserver
    if quant_dtype.name.startswith("use_8a"):
        return MinMaxObserver
    return None


class MutableBufferQnnQuantizer(QnnQuantizer):
    """QnnQuantizer whose mutable buffers keep one encoding from step to step.

    Takes exactly the arguments of ``QnnQuantizer`` and supports all of its setters
    (``set_default_quant_config``, ``set_submodule_qconfig_list``, recipes...).

    Args:
        bound_attention_masks: rewrite additive ``-inf`` masks on the scores
            (``scores + where(c, 0, -inf)``, ``masked_fill``) into a bounded select
            (see passes/attention_mask.py). On by default: quantized as they are, the
            masks cost real decoders most of their accuracy (16a8w, transformers
            Qwen3 13 dB vs fp32, Gemma3 with a sliding window 2 dB; bounded 41 and
            32 dB). ``False`` keeps them as they are. A masked position bias
            (``where(c, bias, -inf)``) is always bounded.
    """

    def __init__(self, *args, bound_attention_masks: bool = True, **kwargs) -> None:
        activate_for_quantization()
        super().__init__(*args, **kwargs)
        self.bound_attention_masks = bound_attention_masks
        # Upstream's rule table is a process-wide cache: replace entries in our copy.
        self._rules_map = dict(self._rules_map)
        for op, annotate_fn in STATE_OP_ANNOTATORS.items():
            upstream = self._rules_map.get(op)
            self._rules_map[op] = OpQuantRule(
                aten_op=op,
                qnn_op=upstream.qnn_op if upstream else None,
                annotate_fn=annotate_fn,
                validate_fn=upstream.validate_fn if upstream else None,
            )
            self.supported_ops.add(op)
            self.quant_ops.add(op)
        self.state_encodings: dict = {}
        self._observer_chosen = False
        self._declared_config = self.default_quant_config

    def set_default_quant_config(self, quant_dtype, *args, act_observer=None, **kwargs) -> None:
        """As upstream's. For a model with mutable buffers, activations default to
        min-max observers (with headroom at 16 bits) instead of a moving average.

        A decoder or streaming model is calibrated on a few steps, and a moving
        average mostly remembers the first: state that grows, or a window that fills,
        is then clipped (measured: a running sum 0.07 off fp32 by step 1 at 16a8w, a
        streaming conv 13.6 dB). Pass ``act_observer`` to choose another; a model
        without buffers gets exactly upstream's quantization.
        """
        super().set_default_quant_config(quant_dtype, *args, act_observer=act_observer, **kwargs)
        self._observer_chosen = act_observer is not None
        self._declared_config = self.default_quant_config

    def _config_for(self, stateful: bool):
        config = self._declared_config
        if not stateful or self._observer_chosen:
            return config
        observer = default_act_observer(config.quant_dtype)
        return config if observer is None else dataclasses.replace(config, act_observer=observer)

    def _get_quant_config(self, node):
        # The write-back copy_ is bookkeeping, not an op to quantize (and upstream
        # prints a warning for every op it has no config for).
        info = node.meta.get(STATE_META_KEY)
        if info is not None and info.get("role") == "write_back":
            return None
        return super()._get_quant_config(node)

    def transform_for_annotation(self, model: GraphModule) -> GraphModule:
        original_meta = model.meta
        model = functional_state_graph(model)
        # prepare_pt2e calls this before calibration: the buffers still hold the
        # model's initial state, which every lowered program must start from (the
        # module convert_pt2e returns holds what calibration left behind).
        mutable = sorted(find_mutable_buffers(model))
        self.default_quant_config = self._config_for(stateful=bool(mutable))
        record = record_initial_state(model, mutable)
        original_meta[RECORD_KEY] = record
        # Non-strict export shares buffer tensors with the user's module: without
        # copies of its own, calibration would also change the user's eager model.
        replace_buffers(model, {name: model.get_buffer(name) for name in mutable})
        model = requantize_fixed_encoding_writes(model)
        model = pad_narrow_gather_tables(model)
        model = super().transform_for_annotation(model)
        model = bound_attention_masks(model, additive=self.bound_attention_masks)
        return model

    def annotate(self, model: GraphModule) -> GraphModule:
        self.state_encodings = plan_state_encodings(model, self._get_quant_config)
        # Position arithmetic computed in float must stay exact: never annotate it.
        user_discards = set(self.discard_nodes)
        self.discard_nodes = user_discards | set(integer_arithmetic_nodes(model))
        try:
            super().annotate(model)
        finally:
            self.discard_nodes = user_discards
        annotate_state_writes(model, self._get_quant_config)
        annotate_masked_scores(model, self._get_quant_config)
        share_reader_edges(model, self.state_encodings)
        finalize_state_specs(model)
        return model
