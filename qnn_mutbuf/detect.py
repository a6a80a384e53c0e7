"""Which buffers a graph mutates, and which nodes write them, read from the graph.

`torch.export` keeps in-place updates of buffers in-place and its graph signature
can lose ``buffers_to_mutate``, so the signature is not trusted: a buffer is mutable
when it is the written argument of an in-place op (directly or through a view of
it), or the destination of a ``copy_``. Functional graphs (after
``run_decompositions``) are covered through the signature's mutation outputs.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable

import torch
from torch.export import ExportedProgram
from torch.fx import GraphModule, Node


def written_argument_index(node: Node) -> int | None:
    """Index of the argument an in-place/out op writes, or None for pure ops."""
    schema = getattr(node.target, "_schema", None)
    if node.op != "call_function" or schema is None:
        return None
    for index, argument in enumerate(schema.arguments):
        if argument.alias_info is not None and argument.alias_info.is_write:
            if argument.kwarg_only:
                return None  # out= variants write a fresh tensor, not an input
            return index
    return None


def is_view_op(node: Node) -> bool:
    """True for ops whose output aliases their first input without writing it."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        source = node.args[0]
        return isinstance(source, Node) and is_view_op(source)
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.returns or not schema.arguments:
        return False
    if is_conditional_alias(node):
        return _same_dtype_and_shape(node.args[0], node)
    first = schema.arguments[0].alias_info
    returned = schema.returns[0].alias_info
    # Multi-output views (split, unbind) annotate the list's elements, so the
    # return's own alias set is empty: any read-only alias pair counts.
    return (
        first is not None and returned is not None and not returned.is_write and not first.is_write
    )


_CONDITIONAL_ALIASES = ("to", "type_as", "contiguous", "detach")


def is_conditional_alias(node: Node) -> bool:
    """``x.to(dtype)`` and friends alias `x` only when they convert nothing."""
    packet = getattr(node.target, "overloadpacket", None)
    return packet is not None and packet.__name__ in _CONDITIONAL_ALIASES


def _same_dtype_and_shape(source: object, node: Node) -> bool:
    before = source.meta.get("val") if isinstance(source, Node) else None
    after = node.meta.get("val")
    return (
        isinstance(before, torch.Tensor)
        and isinstance(after, torch.Tensor)
        and before.dtype == after.dtype
        and tuple(before.shape) == tuple(after.shape)
    )


def buffer_nodes(graph_owner: GraphModule | ExportedProgram) -> dict[Node, str]:
    """Maps each node that reads a buffer directly (get_attr or lifted placeholder)
    to the buffer's fully qualified name."""
    if isinstance(graph_owner, ExportedProgram):
        graph = graph_owner.graph_module.graph
        inputs_to_buffers = graph_owner.graph_signature.inputs_to_buffers
        return {
            node: inputs_to_buffers[node.name]
            for node in graph.nodes
            if node.op == "placeholder" and node.name in inputs_to_buffers
        }
    names = {name for name, _ in graph_owner.named_buffers(remove_duplicate=False)}
    return {
        node: str(node.target)
        for node in graph_owner.graph.nodes
        if node.op == "get_attr" and str(node.target) in names
    }


def alias_roots(graph: torch.fx.Graph, roots: dict[Node, str]) -> dict[Node, str]:
    """Extends `roots` with every node that aliases a buffer: views of it and the
    results of in-place ops that wrote it (chains like ``s.mul_(a).add_(b)``)."""
    aliases = dict(roots)
    for node in graph.nodes:
        if node in aliases or node.op != "call_function":
            continue
        if is_view_op(node):
            source = node.args[0]
            if isinstance(source, Node) and source in aliases:
                aliases[node] = aliases[source]
            continue
        index = written_argument_index(node)
        if index is not None and index < len(node.args):
            written = node.args[index]
            if isinstance(written, Node) and written in aliases:
                aliases[node] = aliases[written]
    return aliases


def writes_into(graph: torch.fx.Graph, roots: dict[Node, str]) -> dict[str, list[Node]]:
    """The in-place writes into each root (directly or through a view or an earlier
    write of it), keyed by the root's name, in graph order."""
    aliases = alias_roots(graph, roots)
    found: dict[str, list[Node]] = {}
    for node in graph.nodes:
        index = written_argument_index(node)
        if index is None or index >= len(node.args):
            continue
        written = node.args[index]
        if isinstance(written, Node) and written in aliases:
            found.setdefault(aliases[written], []).append(node)
    return found


def find_mutable_buffers(
    graph_module: GraphModule | ExportedProgram,
) -> dict[str, list[Node]]:
    """Buffers the graph mutates, each with the nodes that write it, in graph order.

    Accepts the GraphModule of ``ExportedProgram.module()`` (buffers are get_attr
    nodes), a prepared or converted PT2E module, or an ExportedProgram (buffers are
    placeholders). In-place writes to anything that is not a buffer (a clone, an
    input) are not reported.
    """
    graph = (
        graph_module.graph_module.graph
        if isinstance(graph_module, ExportedProgram)
        else graph_module.graph
    )
    found = writes_into(graph, buffer_nodes(graph_module))
    if isinstance(graph_module, ExportedProgram):
        _add_signature_mutations(graph_module, found)
    return found


def _add_signature_mutations(program: ExportedProgram, found: dict[str, list[Node]]) -> None:
    """Functional graphs write buffers through outputs named in the signature."""
    output = next(n for n in program.graph.nodes if n.op == "output")
    produced = {n.name: n for n in _flatten(output.args[0]) if isinstance(n, Node)}
    for output_name, buffer_name in program.graph_signature.buffers_to_mutate.items():
        writer = produced.get(output_name)
        if writer is not None and writer not in found.get(buffer_name, []):
            found.setdefault(buffer_name, []).append(writer)


def _flatten(value: object) -> Iterable[object]:
    if isinstance(value, (list, tuple)):
        for item in value:
            yield from _flatten(item)
    else:
        yield value
