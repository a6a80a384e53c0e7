"""Compound arithmetic spelled out in the ops the QNN quantizer annotates.

``s.lerp_(x, w)``, ``s.addcmul_(a, b, value=v)``, ``s.addcdiv_(a, b, value=v)`` and
``add``/``sub`` with ``alpha`` are common ways to update state. Functionalized they
become ``lerp``/``addcmul``/... (strict export writes ``addcmul`` as ``prims.fma``),
which QnnQuantizer does not annotate; ExecuTorch later decomposes them into float
ops inside a quantized graph, and the QNN context binary fails to build. We rewrite
them before annotation into ``add``/``sub``/``mul``/``div`` exactly as PyTorch
defines them (``lerp(s, x, w) = s + w * (x - s)``), so each part is annotated and
the state encoding reaches the final ``add``. ``repeat_interleave`` (how
ExecuTorch's Llama expands a cache for grouped-query heads) has no quant config
either; left float next to a delegated cache, QNN rejects the Reshape around it
("float32 in, ufixed16 out") and ExecuTorch then dies in
``_unsafe_adjust_original_program`` ("Tried to erase Node getitem_19 but it still had
1 users"). It becomes unsqueeze + expand + reshape.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.fx import GraphModule, Node
from torch.fx.passes.infra.pass_base import PassBase, PassResult

from qnn_mutbuf.passes.functionalize import STATE_META_KEY
from qnn_mutbuf.passes.graph_edit import SOURCE_META_KEYS, edited

aten = torch.ops.aten


def _lerp(emit, node: Node):
    start, end, weight = node.args[:3]
    return emit(
        aten.add.Tensor, start, emit(aten.mul.Tensor, emit(aten.sub.Tensor, end, start), weight)
    )


def _addc(inner):
    def rewrite(emit, node: Node):
        start, first, second = node.args[:3]
        value = node.kwargs.get("value", node.args[3] if len(node.args) > 3 else 1)
        product = emit(inner, first, second)
        if value != 1:
            product = emit(aten.mul.Tensor, product, value)
        return emit(aten.add.Tensor, start, product)

    return rewrite


def _fma(emit, node: Node):
    first, second, addend = node.args[:3]
    return emit(aten.add.Tensor, emit(aten.mul.Tensor, first, second), addend)


def _repeat_interleave(emit, node: Node):
    """``x.repeat_interleave(r, dim)`` (grouped-query heads) as unsqueeze, expand and
    reshape, the data movement QnnQuantizer annotates and the HTP runs."""
    source, repeats = node.args[:2]
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")
    value = source.meta.get("val") if isinstance(source, Node) else None
    if not isinstance(repeats, int) or dim is None or not isinstance(value, torch.Tensor):
        return None
    shape = list(value.shape)
    dim = dim % len(shape)
    expanded = shape[: dim + 1] + [repeats] + shape[dim + 1 :]
    merged = shape[:dim] + [shape[dim] * repeats] + shape[dim + 1 :]
    unsqueezed = emit(aten.unsqueeze.default, source, dim + 1)
    return emit(aten.reshape.default, emit(aten.expand.default, unsqueezed, expanded), merged)


def _with_alpha(base):
    def rewrite(emit, node: Node):
        alpha = node.kwargs.get("alpha", 1)
        if alpha == 1:
            return None
        first, second = node.args[:2]
        if isinstance(second, int | float):
            return emit(base, first, second * alpha)
        return emit(base, first, emit(aten.mul.Tensor, second, alpha))

    return rewrite


REWRITES: dict[object, Callable] = {
    aten.lerp.Scalar: _lerp,
    aten.lerp.Tensor: _lerp,
    aten.addcmul.default: _addc(aten.mul.Tensor),
    aten.addcdiv.default: _addc(aten.div.Tensor),
    aten.repeat_interleave.self_int: _repeat_interleave,
    aten.add.Tensor: _with_alpha(aten.add.Tensor),
    aten.sub.Tensor: _with_alpha(aten.sub.Tensor),
}


def _rewrite_of(node: Node) -> Callable | None:
    if node.op != "call_function":
        return None
    # Strict export spells addcmul as prims.fma, an op torch registers only once
    # inductor's prims are imported, so it is matched by name.
    if str(node.target) == "prims.fma.default":
        return _fma
    return REWRITES.get(node.target)


class SpellOutCompoundOps(PassBase):
    def call(self, graph_module: GraphModule) -> PassResult:
        graph = graph_module.graph
        changed = False
        for node in list(graph.nodes):
            rewrite = _rewrite_of(node)
            value = node.meta.get("val")
            if rewrite is None or not isinstance(value, torch.Tensor):
                continue
            if not value.is_floating_point():
                continue
            with graph.inserting_before(node):
                result = rewrite(self._emitter(node), node)
            if result is None:
                continue
            if STATE_META_KEY in node.meta:  # the last op now writes the state
                result.meta[STATE_META_KEY] = node.meta[STATE_META_KEY]
            node.replace_all_uses_with(result)
            graph.erase_node(node)
            changed = True
        return edited(graph_module, changed)

    @staticmethod
    def _emitter(node: Node):
        """Creates nodes before `node` that carry its source metadata and a fake value."""
        graph = node.graph
        mode = getattr(node.meta.get("val"), "fake_mode", None)

        def fake(arg):
            return arg.meta.get("val") if isinstance(arg, Node) else arg

        def emit(target, *args):
            created = graph.call_function(target, args)
            for key in SOURCE_META_KEYS:
                if key in node.meta:
                    created.meta[key] = node.meta[key]
            if mode is not None:
                with mode:
                    created.meta["val"] = target(*(fake(a) for a in args))
            return created

        return emit


def spell_out_compound_ops(graph_module: GraphModule) -> GraphModule:
    return SpellOutCompoundOps()(graph_module).graph_module
