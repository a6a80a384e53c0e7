"""Inlines ``with torch.no_grad():`` / ``torch.enable_grad()`` regions for inference.

torch.export (2.13, strict and non-strict) keeps such a block as a
``higher_order.wrap_with_set_grad_enabled(False, submod, *operands)`` call whose body
lives in a sub-GraphModule. Streaming conv states are written that way
(``conv_state.copy_(window)`` under ``no_grad``): the write is then invisible to buffer
detection, and ExecuTorch's ``LiftConstantScalarOperands`` dies on the call
(``'WrapWithSetGradEnabled' object has no attribute '_schema'``). Gradient mode means
nothing for a lowered program, so the body is copied into the parent graph.
"""

from __future__ import annotations

import operator

import torch
from torch.fx import GraphModule, Node
from torch.fx.passes.infra.pass_base import PassBase, PassResult

from qnn_mutbuf.passes.graph_edit import edited, fresh_attribute_name


def _set_grad_op():
    return getattr(torch.ops.higher_order, "wrap_with_set_grad_enabled", None)


class InlineSetGradRegions(PassBase):
    """Replaces every set-grad region call by the nodes of its body, recursively."""

    def call(self, graph_module: GraphModule) -> PassResult:
        target = _set_grad_op()
        changed = False
        while True:
            calls = [
                n
                for n in graph_module.graph.nodes
                if n.op == "call_function" and target is not None and n.target is target
            ]
            if not calls:
                break
            for node in calls:
                self._inline(graph_module, node)
            changed = True
        return edited(graph_module, changed)

    def _inline(self, graph_module: GraphModule, node: Node) -> None:
        graph = graph_module.graph
        body_node = node.args[1]
        body: GraphModule = getattr(graph_module, body_node.target)
        operands = list(node.args[2:])
        placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
        env: dict[Node, object] = dict(zip(placeholders, operands, strict=True))
        result = None
        with graph.inserting_before(node):
            for inner in body.graph.nodes:
                if inner.op == "placeholder":
                    continue
                if inner.op == "output":
                    result = torch.fx.map_arg(inner.args[0], lambda n: env[n])
                    continue
                if inner.op == "get_attr":
                    # A constant of the body: give it a home in the parent module.
                    base = "_inlined_" + str(inner.target).replace(".", "_")
                    name = fresh_attribute_name(graph_module, base)
                    setattr(graph_module, name, operator.attrgetter(str(inner.target))(body))
                    copied = graph.get_attr(name)
                    copied.meta.update(inner.meta)
                else:
                    copied = graph.node_copy(inner, lambda n: env[n])
                env[inner] = copied
        outputs = result if isinstance(result, (list, tuple)) else (result,)
        for user in list(node.users):
            if user.op == "call_function" and user.target is operator.getitem:
                user.replace_all_uses_with(outputs[user.args[1]])
                graph.erase_node(user)
        if node.users:
            raise AssertionError(f"{node.name}: set-grad region result used as a whole")
        graph.erase_node(node)
        if not body_node.users:
            graph.erase_node(body_node)
            delattr(graph_module, body_node.target)


def inline_set_grad_regions(graph_module: GraphModule) -> GraphModule:
    return InlineSetGradRegions()(graph_module).graph_module
