"""Keeps integer position arithmetic (``pos % window``, ``pos // n``) integer-exact.

Upstream decomposes ``remainder`` as ``x - floor(x / y) * y`` with a true division, so
on an integer position the result turns float and ``index_copy_`` rejects it (or, once
quantized, lands on the wrong slot). We decompose integer ``remainder`` and floor
division ourselves through float32 (exact for positions below 2**24) and cast back to
the original integer dtype. The float nodes are tagged so the quantizer leaves them
unquantized: a position must never be rounded to an 8-bit grid.
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node
from torch.fx.passes.infra.pass_base import PassBase, PassResult

from qnn_mutbuf.passes.graph_edit import edited, fake_like

aten = torch.ops.aten
INTEGER_META_KEY = "qnn_mutbuf_integer_arithmetic"

_REMAINDER = {aten.remainder.Scalar, aten.remainder.Tensor}
_FLOOR_DIVIDE = {aten.floor_divide.default, aten.floor_divide.Scalar}


def _is_integer(node: object) -> bool:
    value = node.meta.get("val") if isinstance(node, Node) else None
    return (
        isinstance(value, torch.Tensor)
        and not value.is_floating_point()
        and value.dtype != torch.bool
    )


def _is_floor_division(node: Node) -> bool:
    if node.target in _FLOOR_DIVIDE:
        return True
    return node.target == aten.div.Tensor_mode and node.kwargs.get("rounding_mode") == "floor"


class DecomposeIntegerArithmetic(PassBase):
    """Rewrites integer remainder / floor division as exact float math plus a cast
    back, and integer negation (no HTP kernel) as a subtraction from zero."""

    def call(self, graph_module: GraphModule) -> PassResult:
        graph = graph_module.graph
        changed = False
        for node in list(graph.nodes):
            if node.op != "call_function" or not _is_integer(node):
                continue
            if node.target == aten.neg.default:
                # 0 - x: the HTP's integer subtract is solid, while its integer
                # multiply by -1 intermittently fails op validation (seen with
                # QAIRT 2.51), splitting the graph around it.
                with graph.inserting_before(node):
                    zero = graph.call_function(aten.zeros_like.default, (node.args[0],))
                    negated = graph.call_function(aten.sub.Tensor, (zero, node.args[0]))
                zero.meta["val"] = node.meta["val"]
                negated.meta.update(node.meta)
                node.replace_all_uses_with(negated)
                graph.erase_node(node)
                changed = True
                continue
            remainder = node.target in _REMAINDER
            if not remainder and not _is_floor_division(node):
                continue
            dtype = node.meta["val"].dtype
            value = node.meta["val"]
            created = []

            def call(
                target,
                args,
                kwargs=None,
                out_dtype=torch.float32,
                node=node,
                value=value,
                created=created,
            ):
                new = graph.call_function(target, args, kwargs or {})
                for key in ("nn_module_stack", "stack_trace", "source_fn_stack", "from_node"):
                    if key in node.meta:
                        new.meta[key] = node.meta[key]
                new.meta["val"] = fake_like(value, dtype=out_dtype)
                new.meta[INTEGER_META_KEY] = True
                created.append(new)
                return new

            with graph.inserting_before(node):
                x, y = node.args[0], node.args[1]
                x_float = call(aten._to_copy.default, (x,), {"dtype": torch.float32})
                y_float = (
                    call(aten._to_copy.default, (y,), {"dtype": torch.float32})
                    if isinstance(y, Node)
                    else float(y)
                )
                quotient = call(aten.floor.default, (call(aten.div.Tensor, (x_float, y_float)),))
                result = quotient
                if remainder:
                    product = call(aten.mul.Tensor, (quotient, y_float))
                    result = call(aten.sub.Tensor, (x_float, product))
                back = call(aten._to_copy.default, (result,), {"dtype": dtype}, out_dtype=dtype)
            node.replace_all_uses_with(back)
            graph.erase_node(node)
            changed = True
        return edited(graph_module, changed)


def decompose_integer_arithmetic(graph_module: GraphModule) -> GraphModule:
    return DecomposeIntegerArithmetic()(graph_module).graph_module


def _is_float(node: object) -> bool:
    value = node.meta.get("val") if isinstance(node, Node) else None
    return isinstance(value, torch.Tensor) and value.is_floating_point()


def _integer_derived_float_nodes(graph_module: GraphModule) -> set[Node]:
    """Float nodes computed only from integers and constants, whose result is cast
    back to an integer: index arithmetic such as T5's relative position buckets
    (``log`` of a distance, scaled, truncated to a bucket id)."""
    derived: dict[Node, bool] = {}

    def integer_only(node: Node) -> bool:
        if node in derived:
            return derived[node]
        derived[node] = False  # cycles cannot happen in a DAG; guard anyway
        if not _is_float(node):
            result = node.op != "placeholder" or not _is_float(node)
        elif node.op in ("placeholder",):
            result = False
        elif node.op == "get_attr":
            result = True
        elif node.op == "call_function":
            result = all(integer_only(a) for a in node.all_input_nodes)
        else:
            result = False
        derived[node] = result
        return result

    def _reads_an_integer(node: Node) -> bool:
        """Constants alone make a constant, not a position: require an integer input."""
        return any(not _is_float(a) or a.meta.get(INTEGER_META_KEY) for a in _leaves(node))

    def _leaves(node: Node):
        stack, seen, leaves = [node], set(), []
        while stack:
            current = stack.pop()
            if current in seen:
                continue
            seen.add(current)
            if not _is_float(current) or current.op != "call_function":
                leaves.append(current)
            else:
                stack.extend(current.all_input_nodes)
        return leaves

    found: set[Node] = set()
    for node in graph_module.graph.nodes:
        if node.op != "call_function" or _is_float(node):
            continue
        if not isinstance(node.meta.get("val"), torch.Tensor):
            continue
        for source in node.all_input_nodes:
            if _is_float(source) and integer_only(source) and _reads_an_integer(source):
                found.add(node)  # the cast back to an integer must not observe either
                stack = [source]
                while stack:
                    current = stack.pop()
                    if current in found or not _is_float(current) or current.op != "call_function":
                        continue
                    found.add(current)
                    stack.extend(current.all_input_nodes)
    return found


def integer_arithmetic_nodes(graph_module: GraphModule) -> list[str]:
    """Names of the float nodes that compute integer positions (never quantized)."""
    tagged = {n for n in graph_module.graph.nodes if n.meta.get(INTEGER_META_KEY)}
    return [n.name for n in tagged | _integer_derived_float_nodes(graph_module)]
