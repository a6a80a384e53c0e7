"""Bounded attention masks: masked values quantize without wrecking the real ones.

T5 masks its relative position bias with ``where(causal, bias, finfo.min)`` and
adds that to the scores; decomposed attention adds ``where(causal, 0, -inf)`` to
the scores. Quantized, a tensor holding -inf gets a range down to -inf (upstream
replaces it with -65535): at 16 bits the real values get a step of about one, and
the bias is lost. We turn ``where(c, x, -inf)`` into one select ``where(c, x,
MASKED)`` tagged for :class:`MaskedScoresObserver`, which ranges over the real
values only and places the masked value ``margin`` below the smallest of them (a
masked position still gets a softmax weight below exp(-margin)). By default, the
additive form ``scores + where(c, 0, -inf)`` and ``masked_fill(scores, m, -inf)``
become the same select over the scores.
"""

from __future__ import annotations

import math
import operator

import torch
from torch.fx import GraphModule, Node
from torch.fx.passes.infra.pass_base import PassBase, PassResult
from torchao.quantization.pt2e import MinMaxObserver

from qnn_mutbuf.passes.graph_edit import edited, fresh_attribute_name

aten = torch.ops.aten

MASKED_META_KEY = "qnn_mutbuf_masked_scores"
MASKED_VALUE = -6.0e4  # finite in fp16, so upstream leaves it as it is
MASK_THRESHOLD = -3.0e4  # below any real attention score, above fp16's lowest
DEFAULT_MARGIN = 20.0


def constant_value(node: object, graph_module: GraphModule) -> float | None:
    """The value of a scalar-like constant node (scalar_tensor, full, 1-element get_attr)."""
    if isinstance(node, (int, float)):
        return float(node)
    if not isinstance(node, Node):
        return None
    if node.op == "call_function" and node.target in (aten.scalar_tensor.default,):
        return float(node.args[0])
    if node.op == "call_function" and node.target in (aten.full.default, aten.full_like.default):
        return float(node.args[1])
    if node.op == "call_function" and node.target in (aten.zeros.default, aten.zeros_like.default):
        return 0.0
    if node.op == "call_function" and node.target in (aten.ones.default, aten.ones_like.default):
        return 1.0
    if node.op == "get_attr":
        value = getattr(graph_module, str(node.target), None)
        if isinstance(value, torch.Tensor) and value.numel() >= 1:
            first = value.flatten()[0]
            if bool((value == first).all()):
                return float(first)
    return None


def is_masked_value(value: float | None) -> bool:
    return value is not None and (math.isinf(value) and value < 0 or value <= MASK_THRESHOLD)


class BoundAttentionMasks(PassBase):
    """Turns -inf masks on attention scores into tagged selects.

    ``where(c, x, -inf)`` with ``x`` a computed tensor (a masked position bias, as T5
    builds it) is always rewritten: quantized as it is, its range runs to -inf and
    ``x`` is lost. Additive masks and ``masked_fill`` are rewritten only with
    ``additive=True``: their 0 / -inf values quantize exactly as they are.
    """

    def __init__(self, additive: bool = True) -> None:
        super().__init__()
        self.additive = additive

    def call(self, graph_module: GraphModule) -> PassResult:
        graph = graph_module.graph
        changed = False
        for node in list(graph.nodes):
            if node.op != "call_function":
                continue
            replacement = None
            if node.target == aten.where.self and not node.meta.get(MASKED_META_KEY):
                replacement = self._from_masked_tensor(node, graph_module)
            elif not self.additive:
                continue
            elif node.target == aten.add.Tensor:
                replacement = self._from_additive(node, graph_module)
            elif node.target in (aten.masked_fill.Scalar, aten.masked_fill.Tensor):
                fill = constant_value(node.args[2], graph_module)
                if is_masked_value(fill):
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
        return edited(graph_module, changed)

    def _from_additive(self, node: Node, graph_module: GraphModule):
        for mask_index in (1, 0):
            mask = node.args[mask_index]
            scores = node.args[1 - mask_index]
            if not (isinstance(mask, Node) and mask.target == aten.where.self):
                continue
            condition, on_true, on_false = mask.args
            true_value = constant_value(on_true, graph_module)
            false_value = constant_value(on_false, graph_module)
            scores_shape = tuple(node.meta["val"].shape) if "val" in node.meta else None
            if (
                scores_shape is None
                or tuple(scores.meta.get("val", torch.empty(0)).shape) != scores_shape
            ):
                continue  # the mask would broadcast the scores: leave it alone
            if true_value == 0.0 and is_masked_value(false_value):
                return condition, scores, self._masked_constant(node)
            if false_value == 0.0 and is_masked_value(true_value):
                return condition, self._masked_constant(node), scores
        for mask_index in (1, 0):
            mask, scores = node.args[mask_index], node.args[1 - mask_index]
            visible = self._visible_from_table(mask, graph_module)
            if visible is not None and _same_shape(scores, node):
                return visible, scores, self._masked_constant(node)
        return None

    def _visible_from_table(self, mask: object, graph_module: GraphModule) -> Node | None:
        """``eq(M'[...], 0)`` for a mask gathered from a constant 0 / -inf table.

        ExecuTorch's Llama reads its mask as ``self.mask[input_pos]`` from a causal
        table of 0 and -inf: the same chain of gathers and views is replayed on the
        table with -inf replaced by MASKED_VALUE (both ends of its range, so exact
        in any encoding) and compared with 0, which gives the select its condition.
        """
        chain: list[Node] = []
        source = mask
        while isinstance(source, Node) and source.op == "call_function":
            if source.target not in _TABLE_READS:
                return None
            chain.append(source)
            source = source.args[0]
        if not chain or not isinstance(source, Node) or source.op != "get_attr":
            return None
        table = operator.attrgetter(str(source.target))(graph_module)
        if not isinstance(table, torch.Tensor) or not table.is_floating_point():
            return None
        masked = table <= MASK_THRESHOLD
        if not bool(masked.any()) or not bool((table[~masked] == 0).all()):
            return None
        bounded = torch.where(masked, torch.tensor(MASKED_VALUE, dtype=table.dtype), 0.0)
        name = fresh_attribute_name(graph_module, str(source.target).replace(".", "_") + "_bounded")
        graph_module.register_buffer(name, bounded.to(table.dtype), persistent=False)
        graph = mask.graph
        with graph.inserting_before(chain[-1]):
            replayed = graph.get_attr(name)
        replayed.meta.update(source.meta)
        for link in reversed(chain):
            with graph.inserting_before(link):
                copied = graph.node_copy(
                    link, lambda n, prev=replayed, link=link: prev if n is link.args[0] else n
                )
            replayed = copied
        with graph.inserting_before(mask.next):
            visible = graph.call_function(aten.eq.Scalar, (replayed, 0.0))
        value = replayed.meta.get("val")
        if isinstance(value, torch.Tensor):
            mode = getattr(value, "fake_mode", None)
            if mode is not None:
                with mode:
                    visible.meta["val"] = torch.empty(value.shape, dtype=torch.bool)
        for key in ("nn_module_stack", "stack_trace", "source_fn_stack"):
            if key in mask.meta:
                visible.meta[key] = mask.meta[key]
        return visible

    def _from_masked_tensor(self, node: Node, graph_module: GraphModule):
        condition, on_true, on_false = node.args
        shape = tuple(node.meta["val"].shape) if "val" in node.meta else None
        for kept, masked in ((on_true, on_false), (on_false, on_true)):
            masked_value = constant_value(masked, graph_module)
            if not (isinstance(kept, Node) and is_masked_value(masked_value)):
                continue
            kept_value = kept.meta.get("val")
            if (
                constant_value(kept, graph_module) is not None
                or not isinstance(kept_value, torch.Tensor)
                or not kept_value.is_floating_point()
                or tuple(kept_value.shape) != shape
            ):
                return None
            constant = self._masked_constant(node)
            if kept is on_true:
                return condition, kept, constant
            return condition, constant, kept
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


_TABLE_READS = {
    aten.index.Tensor,
    aten.slice.Tensor,
    aten.select.int,
    aten.narrow.default,
    aten.index_select.default,
    aten.view.default,
    aten.reshape.default,
    aten._unsafe_view.default,
    aten.unsqueeze.default,
    aten.squeeze.dim,
    aten.expand.default,
    aten.alias.default,
    aten.clone.default,
}


def _same_shape(scores: object, node: Node) -> bool:
    want = node.meta.get("val")
    have = scores.meta.get("val") if isinstance(scores, Node) else None
    return (
        isinstance(want, torch.Tensor)
        and isinstance(have, torch.Tensor)
        and tuple(want.shape) == tuple(have.shape)
    )


class MaskedScoresObserver(MinMaxObserver):
    """Min-max over the real scores only; the range reaches `margin` below them.

    Values at or below MASK_THRESHOLD are masked positions: they clamp to the bottom
    of the range, which sits `margin` below the smallest real score, already during
    calibration.
    """

    def __init__(self, *args, margin: float = DEFAULT_MARGIN, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.margin = margin

    def forward(self, x_orig: torch.Tensor) -> torch.Tensor:
        if x_orig.numel() == 0:
            return x_orig
        masked = x_orig.detach() <= MASK_THRESHOLD
        real = x_orig.detach()[~masked]
        if real.numel():
            super().forward(real.to(self.min_val.dtype))
        if not bool(masked.any()) or not torch.isfinite(self.min_val):
            return x_orig
        # Calibration passes values on unquantized: hand the consumers (the scores
        # sum, the softmax) the masked value they will see after quantization, so
        # their observers do not stretch to -inf.
        floor = (self.min_val - self.margin).to(x_orig.dtype)
        return torch.where(masked, floor, x_orig)

    @torch.jit.export
    def calculate_qparams(self):
        return self._calculate_qparams(self.min_val - self.margin, self.max_val)


def bound_attention_masks(graph_module: GraphModule, additive: bool = True) -> GraphModule:
    return BoundAttentionMasks(additive)(graph_module).graph_module
