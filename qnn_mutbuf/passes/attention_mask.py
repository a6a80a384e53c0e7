"""Bounded attention masks: masked scores quantize without wrecking the real ones.

Decomposed attention adds ``where(causal, 0, -inf)`` to the scores before softmax.
Quantized, that sum's range runs to -inf (upstream replaces it with -65535), so the
real scores get a 16-bit step of about one and the HTP and the reference disagree on
how to clamp infinity. We rewrite ``scores + where(c, 0, -inf)`` (and
``masked_fill(scores, m, -inf)``) into one select ``where(c, scores, MASKED)`` and
observe its output with :class:`MaskedScoresObserver`, which ignores the masked value
and places it ``margin`` below the smallest real score: masked positions still get a
softmax weight below exp(-margin), and real scores keep a fine step.
"""

from __future__ import annotations

import math

import torch
from torch.fx import GraphModule, Node
from torch.fx.passes.infra.pass_base import PassBase, PassResult
from torchao.quantization.pt2e import MinMaxObserver

aten = torch.ops.aten

MASKED_META_KEY = "qnn_mutbuf_masked_scores"
MASKED_VALUE = -6.0e4  # finite in fp16, so upstream leaves it as it is
MASK_THRESHOLD = -3.0e4  # below any real attention score, above fp16's lowest
DEFAULT_MARGIN = 10.0


def _constant_value(node: object, graph_module: GraphModule) -> float | None:
    """The value of a scalar-like constant node (scalar_tensor, full, 1-element get_attr)."""
    if isinstance(node, (int, float)):
        return float(node)
    if not isinstance(node, Node):
        return None
    if node.op == "call_function" and node.target in (aten.scalar_tensor.default,):
        return float(node.args[0])
    if node.op == "call_function" and node.target in (aten.full.default, aten.full_like.default):
        return float(node.args[1])
    if node.op == "get_attr":
        value = getattr(graph_module, str(node.target), None)
        if isinstance(value, torch.Tensor) and value.numel() >= 1:
            first = value.flatten()[0]
            if bool((value == first).all()):
                return float(first)
    return None


def _is_masked_value(value: float | None) -> bool:
    return value is not None and (math.isinf(value) and value < 0 or value <= MASK_THRESHOLD)


class BoundAttentionMasks(PassBase):
    """Turns additive -inf masks on attention scores into tagged selects."""

    def call(self, graph_module: GraphModule) -> PassResult:
        graph = graph_module.graph
        changed = False
        for node in list(graph.nodes):
            if node.op != "call_function":
                continue
            replacement = None
            if node.target == aten.add.Tensor:
                replacement = self._from_additive(node, graph_module)
            elif node.target in (aten.masked_fill.Scalar, aten.masked_fill.Tensor):
                fill = _constant_value(node.args[2], graph_module)
                if _is_masked_value(fill):
                    replacement = (node.args[1], self._masked_constant(node), node.args[0])
            if replacement is None:
                continue
            condition, on_true, on_false = replacement
            with graph.inserting_before(node):
                select = graph.call_function(aten.where.self, (condition, on_true, on_false))
            select.meta.update({k: v for k, v in node.meta.items() if k != MASKED_META_KEY})
            select.meta[MASKED_META_KEY] = True
            node.replace_all_uses_with(select)
            graph.erase_node(node)
            changed = True
        if changed:
            graph.eliminate_dead_code()
            graph.lint()
            graph_module.recompile()
        return PassResult(graph_module, changed)

    def _from_additive(self, node: Node, graph_module: GraphModule):
        for mask_index in (1, 0):
            mask = node.args[mask_index]
            scores = node.args[1 - mask_index]
            if not (isinstance(mask, Node) and mask.target == aten.where.self):
                continue
            condition, on_true, on_false = mask.args
            true_value = _constant_value(on_true, graph_module)
            false_value = _constant_value(on_false, graph_module)
            scores_shape = tuple(node.meta["val"].shape) if "val" in node.meta else None
            if (
                scores_shape is None
                or tuple(scores.meta.get("val", torch.empty(0)).shape) != scores_shape
            ):
                continue  # the mask would broadcast the scores: leave it alone
            if true_value == 0.0 and _is_masked_value(false_value):
                return condition, scores, self._masked_constant(node)
            if false_value == 0.0 and _is_masked_value(true_value):
                return condition, self._masked_constant(node), scores
        return None

    @staticmethod
    def _masked_constant(node: Node) -> Node:
        graph = node.graph
        with graph.inserting_before(node):
            constant = graph.call_function(aten.scalar_tensor.default, (MASKED_VALUE,))
        value = node.meta.get("val")
        mode = getattr(value, "fake_mode", None)
        if mode is not None:
            with mode:
                constant.meta["val"] = torch.tensor(MASKED_VALUE)
        return constant


class MaskedScoresObserver(MinMaxObserver):
    """Min-max over the real scores only; the range reaches `margin` below them.

    Values at or below MASK_THRESHOLD are masked positions: they clamp to the bottom
    of the range, which sits `margin` below the smallest real score.
    """

    def __init__(self, *args, margin: float = DEFAULT_MARGIN, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.margin = margin

    def forward(self, x_orig: torch.Tensor) -> torch.Tensor:
        if x_orig.numel() == 0:
            return x_orig
        real = x_orig.detach()
        real = real[real > MASK_THRESHOLD]
        if real.numel():
            super().forward(real.to(self.min_val.dtype))
        return x_orig

    @torch.jit.export
    def calculate_qparams(self):
        return self._calculate_qparams(self.min_val - self.margin, self.max_val)


def bound_attention_masks(graph_module: GraphModule) -> GraphModule:
    return BoundAttentionMasks()(graph_module).graph_module
