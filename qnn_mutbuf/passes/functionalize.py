"""Rewrites in-place updates of mutable buffers into functional ops plus one write-back.

`torch.export` leaves ``k.index_copy_(...)``, ``s.mul_(0.9).add_(x)`` or
``k[:, 0:1] = v`` in-place in the graph. Quantization needs each stored value as a
node of its own (so it can carry the state encoding) and ExecuTorch needs exactly one
``copy_`` back into the buffer. This pass edits the graph in place, without
re-exporting or re-tracing, and keeps node metadata (``nn_module_stack``,
``stack_trace``, ``source_fn_stack``, ``val``) so later annotators and error messages
still point at user code.

Eager semantics are preserved: a read of the buffer (or of a view of it) after an
update sees the updated value, writes through ``slice``/``select``/``view``-like views
are scattered back into the whole buffer, and integer buffers are handled the same way.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch.fx import GraphModule, Node
from torch.fx.passes.infra.pass_base import PassBase, PassResult
from torch.utils import _pytree as pytree

from qnn_mutbuf.detect import (
    buffer_nodes,
    find_mutable_buffers,
    is_conditional_alias,
    is_view_op,
    written_argument_index,
)
from qnn_mutbuf.errors import UnsupportedMutationError
from qnn_mutbuf.passes.graph_edit import SOURCE_META_KEYS, fake_like

aten = torch.ops.aten

STATE_META_KEY = "qnn_mutbuf_state"
"""node.meta key: {"buffer": fqn, "role": "read" | "write" | "write_back"}."""


_RESHAPE_VIEWS = {
    aten.view.default,
    aten._unsafe_view.default,
    aten.reshape.default,
    aten.unsqueeze.default,
    aten.squeeze.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.flatten.using_ints,
    aten.unflatten.int,
    aten.alias.default,
    aten.view_as.default,
    aten.expand_as.default,
}


@dataclass
class _BufferState:
    current: Node
    version: int = 0


@dataclass
class _Alias:
    buffer: str
    chain: tuple[Node, ...]
    version: int
    value: Node


def describe_node(node: Node) -> str:
    """`name` (target) plus the innermost user source line, for error messages."""
    text = f"'{node.name}' ({node.target})"
    trace = node.meta.get("stack_trace")
    if trace:
        lines = [line.strip() for line in trace.strip().splitlines() if line.strip()]
        if lines:
            text += f" at {lines[-2] if len(lines) > 1 else lines[-1]}"
    return text


def _functional_counterpart(node: Node) -> torch._ops.OpOverload | None:
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or target.namespace != "aten":
        return None
    name = target.overloadpacket.__name__
    if not name.endswith("_"):
        return None
    packet = getattr(aten, name[:-1], None)
    if packet is None:
        return None
    return getattr(packet, target._overloadname, None)


class FunctionalizeMutableBuffers(PassBase):
    """Functionalizes every update of a mutable buffer in a PT2E GraphModule.

    After the pass each mutated buffer has exactly one get_attr node (the state read
    at the start of a step), a chain of functional nodes that compute each stored
    value (tagged ``role="write"``), and one trailing ``copy_`` (``role="write_back"``).
    """

    def call(self, graph_module: GraphModule) -> PassResult:
        graph = graph_module.graph
        canonical = self._canonical_reads(graph_module)
        mutated = [name for name in find_mutable_buffers(graph_module) if name in canonical]
        if not mutated:
            return PassResult(graph_module, False)

        self._graph = graph
        self._states = {name: _BufferState(canonical[name]) for name in mutated}
        self._aliases: dict[Node, _Alias] = {}
        self._rederived: dict[tuple[Node, int], Node] = {}
        for name in mutated:
            read = canonical[name]
            read.meta[STATE_META_KEY] = {"buffer": name, "role": "read"}
            self._aliases[read] = _Alias(name, (), 0, read)

        replaced: list[Node] = []
        for node in list(graph.nodes):
            if node.op == "output":
                self._rewrite_reads(node)
                continue
            if node.op not in ("call_function", "call_method", "call_module"):
                continue
            written = written_argument_index(node)
            if written is not None and self._is_alias(node.args[written]):
                self._functionalize_write(node, written)
                replaced.append(node)
            elif node.op == "call_function" and is_view_op(node) and self._is_alias(node.args[0]):
                self._track_view(node)
            else:
                self._rewrite_reads(node)

        output = next(n for n in graph.nodes if n.op == "output")
        for name, state in self._states.items():
            if state.version == 0:
                continue
            read = canonical[name]
            with graph.inserting_before(output):
                write_back = graph.call_function(aten.copy_.default, (read, state.current))
            write_back.meta["val"] = read.meta.get("val")
            write_back.meta[STATE_META_KEY] = {"buffer": name, "role": "write_back"}
        for node in reversed(list(self._aliases)):
            # Views of the buffer that every reader now takes from a fresher value.
            if node.op == "call_function" and not node.users and node not in replaced:
                if is_view_op(node):
                    graph.erase_node(node)
        for node in reversed(replaced):
            if node.users:
                users = ", ".join(describe_node(user) for user in node.users)
                raise UnsupportedMutationError(
                    f"In-place node {describe_node(node)} on buffer "
                    f"'{self._aliases[node].buffer}' is still used by {users} after "
                    "functionalization; qnn_mutbuf cannot rewrite that use."
                )
            graph.erase_node(node)
        graph.lint()
        graph_module.recompile()
        return PassResult(graph_module, True)

    # --- bookkeeping -------------------------------------------------------------

    @staticmethod
    def _canonical_reads(graph_module: GraphModule) -> dict[str, Node]:
        """One get_attr node per buffer; later duplicates are redirected to it."""
        canonical: dict[str, Node] = {}
        for node, name in buffer_nodes(graph_module).items():
            if node.op != "get_attr":
                continue
            if name in canonical:
                node.replace_all_uses_with(canonical[name])
                graph_module.graph.erase_node(node)
            else:
                canonical[name] = node
        return canonical

    def _is_alias(self, value: object) -> bool:
        return isinstance(value, Node) and value in self._aliases

    def _resolve(self, alias_node: Node, before: Node) -> Node:
        """The value `alias_node` has now, re-deriving a view that an update made stale."""
        alias = self._aliases[alias_node]
        state = self._states[alias.buffer]
        if alias.version == state.version:
            return alias.value
        key = (alias_node, state.version)
        if key not in self._rederived:
            value = state.current
            with self._graph.inserting_before(before):
                for view in alias.chain:
                    value = self._copy_call(view, (value, *view.args[1:]), view.kwargs, view)
            self._rederived[key] = value
        return self._rederived[key]

    def _resolve_args(self, args: object, before: Node) -> object:
        return pytree.tree_map_only(
            Node, lambda arg: self._resolve(arg, before) if self._is_alias(arg) else arg, args
        )

    def _rewrite_reads(self, node: Node) -> None:
        node.args = self._resolve_args(node.args, node)
        node.kwargs = self._resolve_args(node.kwargs, node)

    def _track_view(self, node: Node) -> None:
        source = self._aliases[node.args[0]]
        rest = self._resolve_args(node.args[1:], node)
        node.args = (self._resolve(node.args[0], node), *rest)
        version = self._states[source.buffer].version
        self._aliases[node] = _Alias(source.buffer, (*source.chain, node), version, node)

    def _copy_call(
        self, template: Node, args: tuple, kwargs: dict, meta_from: Node, target: object = None
    ) -> Node:
        new = self._graph.call_function(target or template.target, tuple(args), dict(kwargs))
        for key in (*SOURCE_META_KEYS, "val", "tensor_meta"):
            if key in meta_from.meta:
                new.meta[key] = meta_from.meta[key]
        return new

    # --- writes --------------------------------------------------------------------

    def _functionalize_write(self, node: Node, written: int) -> None:
        destination = node.args[written]
        alias = self._aliases[destination]
        state = self._states[alias.buffer]
        view_value = self._resolve(destination, node)
        args = list(self._resolve_args(node.args, node))
        kwargs = self._resolve_args(node.kwargs, node)
        args[written] = view_value
        with self._graph.inserting_before(node):
            if node.target in (aten.copy_.default, aten.copy.default):
                new_view = self._broadcast_to(args[1], view_value, node)
            else:
                functional = _functional_counterpart(node)
                if functional is None:
                    raise UnsupportedMutationError(
                        f"Buffer '{alias.buffer}' is updated in place by {describe_node(node)}, "
                        "which has no functional counterpart qnn_mutbuf knows. Use an "
                        "out-of-place op and assign the result with copy_/index_copy_."
                    )
                new_view = self._copy_call(node, args, kwargs, node, target=functional)
            self._mark_write(new_view, alias.buffer)
            bases = [state.current] if alias.chain else []
            for view in alias.chain[:-1]:
                bases.append(self._resolve(view, node))
            updated = new_view
            for view, base in zip(reversed(alias.chain), reversed(bases), strict=True):
                updated = self._scatter(view, base, updated, node, alias.buffer)
                self._mark_write(updated, alias.buffer)
        state.current = updated
        state.version += 1
        self._aliases[destination] = _Alias(alias.buffer, alias.chain, state.version, new_view)
        self._aliases[node] = _Alias(alias.buffer, alias.chain, state.version, new_view)

    @staticmethod
    def _mark_write(node: Node, buffer: str) -> None:
        if node.op == "call_function":
            node.meta[STATE_META_KEY] = {"buffer": buffer, "role": "write"}

    def _broadcast_to(self, source: object, destination: Node, node: Node) -> Node:
        """What ``destination.copy_(source)`` stores: source broadcast and cast."""
        target_val = destination.meta["val"]
        if not isinstance(source, Node):
            filled = self._copy_call(node, (destination, source), {}, destination, aten.fill.Scalar)
            return filled
        value = source
        source_val = source.meta.get("val")
        if source_val is None:
            raise UnsupportedMutationError(
                f"{describe_node(node)} copies {source.name} into a buffer, but its shape is "
                "unknown (no 'val' metadata)."
            )
        if tuple(source_val.shape) != tuple(target_val.shape):
            value = self._copy_call(
                node, (value, list(target_val.shape)), {}, node, aten.expand.default
            )
            value.meta["val"] = fake_like(target_val, dtype=source_val.dtype)
        if source_val.dtype != target_val.dtype:
            value = self._copy_call(
                node, (value,), {"dtype": target_val.dtype}, node, aten._to_copy.default
            )
            value.meta["val"] = fake_like(target_val)
        return value

    def _scatter(self, view: Node, base: Node, source: Node, node: Node, buffer: str) -> Node:
        """Writes `source` (the new value of `view`) back into `base`."""
        target = view.target
        args = view.args
        base_val = base.meta["val"]

        def call(op: object, call_args: tuple) -> Node:
            new = self._copy_call(node, call_args, {}, node, op)
            new.meta["val"] = base_val
            return new

        if target == aten.slice.Tensor:
            dim, start, end, step = (list(args[1:]) + [0, None, None, 1][len(args) - 1 :])[:4]
            return call(aten.slice_scatter.default, (base, source, dim, start, end, step))
        if target == aten.select.int:
            return call(aten.select_scatter.default, (base, source, args[1], args[2]))
        if target == aten.narrow.default:
            dim, start, length = args[1], args[2], args[3]
            return call(aten.slice_scatter.default, (base, source, dim, start, start + length, 1))
        if target == aten.diagonal.default:
            return call(aten.diagonal_scatter.default, (base, source, *args[1:]))
        if target == aten.as_strided.default:
            return call(aten.as_strided_scatter.default, (base, source, *args[1:]))
        if is_conditional_alias(view):
            return source  # a conversion that converted nothing is the tensor itself
        if target in _RESHAPE_VIEWS:
            return call(aten.view.default, (source, list(base_val.shape)))
        if target == aten.permute.default:
            dims = [d % base_val.dim() for d in args[1]]
            inverse = sorted(range(len(dims)), key=dims.__getitem__)
            return call(aten.permute.default, (source, inverse))
        if target == aten.transpose.int:
            return call(aten.transpose.int, (source, args[1], args[2]))
        if target == aten.t.default:
            return call(aten.t.default, (source,))
        if target is operator.getitem and isinstance(args[0], Node):
            kind = f"an output of the multi-output view {args[0].target}"
        else:
            kind = str(target)
        raise UnsupportedMutationError(
            f"Buffer '{buffer}' is written by {describe_node(node)} through the view "
            f"'{view.name}' ({kind}), which qnn_mutbuf cannot write back. Write the buffer "
            "with index_copy_/index_put_ or through slicing/select instead."
        )


def functionalize_mutable_buffers(graph_module: GraphModule) -> GraphModule:
    """Runs :class:`FunctionalizeMutableBuffers` and returns the edited module."""
    return FunctionalizeMutableBuffers()(graph_module).graph_module
