"""Keeps positions read with ``.item()`` tensors, so the graph stays static.

ExecuTorch's example KV caches compute their write indices from ``start_pos =
input_pos[0].item()``: ``torch.arange(seq_len) + start_pos``, ``% window`` in the
ring cache, ``arange < start_pos`` and ``mask.narrow(0, start_pos, seq_len)``.
``torch.export`` turns that scalar into an unbacked SymInt (``aten.item`` /
``_local_scalar_dense``, python ``operator.add`` on it, ``_assert_scalar`` checks),
and lowering then fails in ExecuTorch's ``LiftConstantScalarOperands`` with
``TypeError: 'Node' object cannot be interpreted as an integer``. This pass replaces
the scalar by a 0-d view of the tensor it was read from, so the HTP computes the
positions: sym arithmetic becomes aten tensor ops, Scalar operands switch to their
Tensor overloads, and ``arange``/``slice``/``narrow``/``select`` at the position
(of static length) become ``arange(L) + t`` and ``index_select``/``index_copy_``.
The export-time checks on the scalar are dropped: positions out of range are the
caller's to avoid, as they are for any tensor index. Any other use of the scalar (a
shape, a length that depends on it) is refused with the user's source line.
"""

from __future__ import annotations

import operator

import sympy
import torch
from torch._guards import detect_fake_mode
from torch.fx import GraphModule, Node
from torch.fx.passes.infra.pass_base import PassBase, PassResult
from torch.utils import _pytree as pytree

from qnn_mutbuf.detect import (
    alias_roots,
    buffer_nodes,
    find_mutable_buffers,
    is_view_op,
    written_argument_index,
)
from qnn_mutbuf.errors import UnsupportedMutationError
from qnn_mutbuf.passes.graph_edit import edited

aten = torch.ops.aten

_SCALAR_SOURCES = {aten.item.default, aten._local_scalar_dense.default}
_CHECKS = {
    aten._assert_scalar.default,
    aten.sym_constrain_range_for_size.default,
    aten.sym_constrain_range.default,
}
# Conditions on the scalar: export only keeps them to feed the checks above (a
# python branch on an unbacked scalar already fails in torch.export).
_PREDICATES = {
    operator.lt,
    operator.le,
    operator.gt,
    operator.ge,
    operator.eq,
    operator.ne,
    operator.and_,
    operator.or_,
    operator.not_,
    torch.sym_not,
}
_ARITHMETIC = {operator.add, operator.sub, operator.mul, operator.floordiv, operator.mod}
_RANGES = {aten.arange.start, aten.arange.start_step}
_WINDOWS = {aten.slice.Tensor, aten.narrow.default, aten.select.int}
_COPIED_META_KEYS = ("nn_module_stack", "stack_trace", "source_fn_stack")
_FIX = "pass the positions as a tensor and index with index_copy_/index_put_/index_select"


def user_source_line(node: Node) -> str:
    """The innermost frame of `node`'s stack trace with its code, or ''."""
    lines = [line.strip() for line in (node.meta.get("stack_trace") or "").splitlines()]
    lines = [line for line in lines if line and set(line) - set("^~ ")]
    frames = [index for index, line in enumerate(lines) if line.startswith("File ")]
    if not frames:
        return ""
    last = frames[-1]
    code = lines[last + 1] if last + 1 < len(lines) else ""
    return f"{lines[last]}: {code}" if code else lines[last]


def _refusal(node: Node, use: str) -> UnsupportedMutationError:
    where = user_source_line(node)
    return UnsupportedMutationError(
        f"'{node.name}' ({node.target}){f' at {where}' if where else ''} uses a position "
        f"read with .item() {use}, which would make the graph data-dependent on the HTP; "
        f"{_FIX}."
    )


def _bind(node: Node) -> list[tuple[torch.Argument, object, bool]]:
    """(schema argument, value, given positionally) for every argument `node` passes."""
    bound = []
    for index, argument in enumerate(node.target._schema.arguments):
        if index < len(node.args):
            bound.append((argument, node.args[index], True))
        elif argument.name in node.kwargs:
            bound.append((argument, node.kwargs[argument.name], False))
    return bound


def _is_tensor_type(kind: object) -> bool:
    if isinstance(kind, torch.OptionalType):
        kind = kind.getElementType()
    return isinstance(kind, torch.TensorType)


def _can_take(old: torch.Argument, new: torch.Argument, tensorized: bool) -> bool:
    """Whether argument `new` of another overload accepts what was passed to `old`
    (the 0-d position tensor when `tensorized`)."""
    if bool(old.alias_info) != bool(new.alias_info):
        return False
    if tensorized:
        return _is_tensor_type(new.type)
    scalar_to_tensor = isinstance(old.type, torch.NumberType) and _is_tensor_type(new.type)
    return old.type == new.type or scalar_to_tensor


def _tensor_overload(target: torch._ops.OpOverload, names: set[str]) -> object:
    """The overload of `target`'s packet taking Tensors where `target` takes the
    Scalars `names` (``lt.Scalar`` -> ``lt.Tensor``, ``where.ScalarOther`` ->
    ``where.self``), or None."""
    arguments = target._schema.arguments
    packet = target.overloadpacket
    for overload in packet.overloads():
        candidate = getattr(packet, overload)
        other = candidate._schema.arguments
        if candidate is target or [a.name for a in other] != [a.name for a in arguments]:
            continue
        pairs = zip(arguments, other, strict=True)
        if all(_can_take(a, b, a.name in names) for a, b in pairs):
            return candidate
    return None


def _expression(value: object) -> sympy.Expr | None:
    if isinstance(value, int):
        return sympy.Integer(value)
    fake = value.meta.get("val") if isinstance(value, Node) else None
    if isinstance(fake, torch.SymInt):
        return fake.node.expr
    return None


def _static_difference(start: object, end: object) -> int | None:
    """``end - start`` when it is the same integer for every position, else None."""
    start_expr, end_expr = _expression(start), _expression(end)
    if start_expr is None or end_expr is None:
        return None
    difference = sympy.simplify(end_expr - start_expr)
    return int(difference) if difference.is_Integer else None


def _static_shape(value: object) -> tuple[int, ...] | None:
    if not isinstance(value, torch.Tensor):
        return None
    if not all(isinstance(size, int) for size in value.shape):
        return None
    return tuple(value.shape)


class TensorizeScalarPositions(PassBase):
    """Replaces every integer ``.item()`` scalar that feeds index arithmetic and masks
    by a 0-d tensor; the rewritten graph has no SymInt left and computes the same
    values for every position the model's own checks allow."""

    def call(self, graph_module: GraphModule) -> PassResult:
        graph = graph_module.graph
        sources = [
            n for n in graph.nodes if n.op == "call_function" and n.target in _SCALAR_SOURCES
        ]
        if not sources:
            return PassResult(graph_module, False)
        self._graph = graph
        self._fake_mode = detect_fake_mode([n.meta.get("val") for n in graph.nodes])
        if self._fake_mode is None:
            raise _refusal(sources[0], "in a graph without fake values (export it first)")
        self._aliases = alias_roots(graph, buffer_nodes(graph_module))
        self._writers = find_mutable_buffers(graph_module)
        self._order = {node: index for index, node in enumerate(graph.nodes)}
        reads = {source.args[0]: None for source in sources}
        self._tensor: dict[Node, Node] = {}
        self._predicates: set[Node] = set()
        self._dead: dict[Node, None] = {}  # erased at the end, in reverse graph order
        self._created: list[Node] = []

        for source in sources:
            self._tensor[source] = self._scalar_as_tensor(source)
            self._dead[source] = None
        for node in list(graph.nodes):
            if node in self._tensor or node in self._dead:
                continue
            if any(arg in self._tensor or arg in self._predicates for arg in node.all_input_nodes):
                self._rewrite(node)
        for node in sorted(self._dead, key=self._order.__getitem__, reverse=True):
            if node.users:  # every use was rewritten or refused above
                raise _refusal(next(iter(node.users)), "where qnn_mutbuf lost track of it")
            graph.erase_node(node)
        # Reads that fed only checks: the tensor each scalar came from, and its view.
        for node in [*reversed(self._created), *reads]:
            if (
                node.op == "call_function"
                and not node.users
                and written_argument_index(node) is None
            ):
                graph.erase_node(node)
        return edited(graph_module, True)

    # --- new nodes -----------------------------------------------------------------

    def _fake(self, value: object) -> object:
        if isinstance(value, Node):
            if value in self._tensor:
                value = self._tensor[value]
            return value.meta.get("val")
        return value

    def _call(self, target, args: tuple, kwargs: dict | None, like: Node) -> Node:
        """A new node before `like`, with `like`'s source metadata and a fake value."""
        kwargs = kwargs or {}
        with self._graph.inserting_before(like):
            new = self._graph.call_function(target, tuple(args), kwargs)
        self._created.append(new)
        for key in _COPIED_META_KEYS:
            if key in like.meta:
                new.meta[key] = like.meta[key]
        fake_args, fake_kwargs = pytree.tree_map_only(Node, self._fake, (args, kwargs))
        with self._fake_mode:
            new.meta["val"] = target(*fake_args, **fake_kwargs)
        return new

    def _replace(self, node: Node, new: Node) -> None:
        """`new` takes `node`'s place, cast back to `node`'s dtype if it differs."""
        want = node.meta.get("val")
        got = new.meta["val"]
        if isinstance(want, torch.Tensor):
            if _static_shape(want) != tuple(got.shape):
                raise _refusal(node, f"in a result of shape {tuple(want.shape)}")
            if got.dtype != want.dtype:
                new = self._call(aten._to_copy.default, (new,), {"dtype": want.dtype}, node)
        node.replace_all_uses_with(new)
        self._dead[node] = None

    def _scalar_as_tensor(self, source: Node) -> Node:
        read = source.args[0]
        value = read.meta.get("val")
        if not isinstance(value, torch.Tensor) or value.numel() != 1:
            raise _refusal(source, "from a tensor of unknown or non-unit size")
        if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
            raise _refusal(source, f"of dtype {value.dtype} (only integer positions are kept)")
        tensor = read
        buffer = self._aliases.get(read)
        if buffer is not None and buffer in self._writers:
            # .item() copies: a view of a buffer updated later would see the update.
            tensor = self._call(aten.clone.default, (tensor,), None, source)
        if value.dim() != 0:
            tensor = self._call(aten.view.default, (tensor, []), None, source)
        return tensor

    # --- rewrites --------------------------------------------------------------------

    def _rewrite(self, node: Node) -> None:
        target = node.target
        if node.op == "output":
            raise _refusal(node, "as a model output (return the tensor it was read from)")
        if node.op != "call_function":
            raise _refusal(node, f"as an input of {node.op} '{target}'")
        if target in _CHECKS:
            self._dead[node] = None
        elif target in _PREDICATES:
            self._predicates.add(node)
            self._dead[node] = None
        elif target in _ARITHMETIC or target is operator.neg:
            self._tensor[node] = self._arithmetic(node)
            self._dead[node] = None
        elif any(arg in self._predicates for arg in node.all_input_nodes):
            raise _refusal(node, "in a condition")
        elif target in _RANGES:
            self._range(node)
        elif target in _WINDOWS:
            self._window(node)
        elif isinstance(target, torch._ops.OpOverload):
            self._operand(node)
        else:
            raise _refusal(node, "in a python-level computation")

    def _arithmetic(self, node: Node) -> Node:
        target = node.target
        if target is operator.neg:
            return self._call(aten.neg.default, (self._tensor[node.args[0]],), None, node)
        for operand in node.args:
            if isinstance(operand, Node) and operand not in self._tensor:
                raise _refusal(node, f"together with '{operand.name}', which is not a position")
            if not isinstance(operand, (Node, int)):
                raise _refusal(node, f"with the non-integer operand {operand!r}")
        left, right = (self._tensor.get(a, a) if isinstance(a, Node) else a for a in node.args)
        if target in (operator.add, operator.mul) and not isinstance(left, Node):
            left, right = right, left
        if target is operator.sub and not isinstance(left, Node):
            negated = self._call(aten.neg.default, (right,), None, node)
            return self._call(aten.add.Tensor, (negated, left), None, node)
        if not isinstance(left, Node):
            left = self._call(aten.scalar_tensor.default, (left,), {"dtype": torch.int64}, node)
        if target is operator.add:
            return self._call(aten.add.Tensor, (left, right), None, node)
        if target is operator.sub:
            return self._call(aten.sub.Tensor, (left, right), None, node)
        if target is operator.mul:
            return self._call(aten.mul.Tensor, (left, right), None, node)
        if target is operator.floordiv:
            return self._call(aten.div.Tensor_mode, (left, right), {"rounding_mode": "floor"}, node)
        overload = aten.remainder.Tensor if isinstance(right, Node) else aten.remainder.Scalar
        return self._call(overload, (left, right), None, node)

    def _positions(self, start: Node, length: int, step: int, dtype, node: Node) -> Node:
        """``start + arange(0, length, step)``: the positions a window covers."""
        indices = self._call(
            aten.arange.start_step, (0, length, step), {"dtype": dtype, "device": "cpu"}, node
        )
        return self._call(aten.add.Tensor, (indices, self._tensor[start]), None, node)

    def _range(self, node: Node) -> None:
        start, end = node.args[0], node.args[1]
        step = node.args[2] if len(node.args) > 2 else 1
        length = _static_difference(start, end)
        if length is None or start not in self._tensor or step in self._tensor:
            raise _refusal(node, "as an arange bound whose length depends on it")
        indices = self._call(aten.arange.start_step, (0, length, step), dict(node.kwargs), node)
        self._replace(node, self._call(aten.add.Tensor, (indices, self._tensor[start]), None, node))

    def _window(self, node: Node) -> None:
        """``slice``/``narrow``/``select`` at the position: reads become index_select,
        a ``copy_`` into the window becomes index_copy_ into its base."""
        base, dim = node.args[0], node.args[1]
        if base in self._tensor or dim in self._tensor:
            raise _refusal(node, "as the tensor or dim of a slice")
        if node.target == aten.select.int:
            start, length, step = node.args[2], 1, 1
        elif node.target == aten.narrow.default:
            start, length, step = node.args[2], node.args[3], 1
            if length in self._tensor:
                raise _refusal(node, "as the length of a narrow")
        else:
            start, end = (list(node.args[2:4]) + [None, None])[:2]
            step = node.args[4] if len(node.args) > 4 else 1
            length = _static_difference(start, end)
            if step in self._tensor:
                raise _refusal(node, "as the step of a slice")
        if start not in self._tensor or length is None:
            raise _refusal(node, "as a slice bound, making the slice's length depend on it")
        window = node.meta.get("val")
        if _static_shape(window) is None:
            raise _refusal(
                node,
                "as a slice bound the export could not prove in range (add "
                "torch._check(start + length <= size) to the model)",
            )
        positions = self._positions(start, length, step, torch.int64, node)
        copies = [u for u in node.users if u.target == aten.copy_.default and u.args[0] is node]
        later_write = min((self._order[copy] for copy in copies), default=None)
        for copy in copies:
            self._copy_into_window(node, copy, positions)
        if not node.users:
            self._dead[node] = None
            return
        self._check_no_write_through_views(node)
        self._check_not_stale(node, later_write)
        if window.dtype == torch.bool:
            # The HTP's Gather has no BOOL_8 kernel (QAIRT 2.51 rejects it in op
            # validation and the mask read falls back to the CPU): gather int32.
            table = self._call(aten._to_copy.default, (base,), {"dtype": torch.int32}, node)
            read = self._call(aten.index_select.default, (table, dim, positions), None, node)
            read = self._call(aten._to_copy.default, (read,), {"dtype": torch.bool}, node)
        else:
            read = self._call(aten.index_select.default, (base, dim, positions), None, node)
        if node.target == aten.select.int:
            read = self._call(aten.squeeze.dim, (read, dim), None, node)
        self._replace(node, read)

    def _copy_into_window(self, window: Node, copy: Node, positions: Node) -> None:
        if copy.users:
            raise _refusal(copy, "to write a window whose copy_ result is used afterwards")
        base, dim = window.args[0], window.args[1]
        source = copy.args[1]
        shape = tuple(window.meta["val"].shape)
        if not isinstance(source, Node) or _static_shape(source.meta.get("val")) is None:
            raise _refusal(copy, "to write a window from a value of unknown shape")
        value = source.meta["val"]
        if tuple(value.shape) != shape:
            source = self._call(aten.expand.default, (source, list(shape)), None, copy)
        if value.dtype != window.meta["val"].dtype:
            dtype = window.meta["val"].dtype
            source = self._call(aten._to_copy.default, (source,), {"dtype": dtype}, copy)
        if window.target == aten.select.int:
            source = self._call(aten.unsqueeze.default, (source, dim), None, copy)
        self._call(aten.index_copy_.default, (base, dim, positions, source), None, copy)
        self._dead[copy] = None
        copy.args = ()  # the window loses this user now; copy_ is erased with the dead

    def _check_no_write_through_views(self, window: Node) -> None:
        stack = [window]
        while stack:
            current = stack.pop()
            for user in current.users:
                written = written_argument_index(user)
                if written is not None and user.args[written] is current:
                    raise _refusal(user, f"to write in place through the window {window.name}")
                if is_view_op(user):
                    stack.append(user)

    def _check_not_stale(self, window: Node, later_write: int | None) -> None:
        """index_select copies where the window viewed: refuse a window read after a
        write (into it, or into the buffer it views) that the view would have seen."""
        last_read = max(self._order.get(user, -1) for user in _transitive_users(window))
        writes = [later_write] if later_write is not None else []
        buffer = self._aliases.get(window.args[0])
        writes += [self._order.get(writer, -1) for writer in self._writers.get(buffer, [])]
        if any(self._order[window] < write < last_read for write in writes):
            raise _refusal(window, "in a window that is read after a write it would see")

    def _operand(self, node: Node) -> None:
        """An aten op taking the position as an operand: Tensor operands take the 0-d
        tensor as they are, Scalar ones switch to the Tensor overload."""
        scalars = set()
        for argument, value, _ in _bind(node):
            leaves = pytree.tree_leaves(value)
            if not any(isinstance(v, Node) and v in self._tensor for v in leaves):
                continue
            direct = isinstance(value, Node) and value in self._tensor
            if _is_tensor_type(argument.type) and direct:
                continue
            if isinstance(argument.type, torch.NumberType) and direct:
                scalars.add(argument.name)
                continue
            raise _refusal(node, f"as its '{argument.name}' argument ({argument.type})")
        target = node.target
        if scalars:
            target = _tensor_overload(node.target, scalars)
            if target is None:
                raise _refusal(node, f"as its Scalar argument(s) {sorted(scalars)}")
        args, kwargs = [], {}
        schema_arguments = target._schema.arguments
        for argument, value, positional in _bind(node):
            value = self._tensor.get(value, value) if isinstance(value, Node) else value
            target_argument = next(a for a in schema_arguments if a.name == argument.name)
            if positional and not target_argument.kwarg_only:
                args.append(value)
            else:
                kwargs[argument.name] = value
        self._replace(node, self._call(target, tuple(args), kwargs, node))


def _transitive_users(node: Node) -> list[Node]:
    """Users of `node` and, through views, of the views of it."""
    found, stack = [], [node]
    while stack:
        current = stack.pop()
        for user in current.users:
            found.append(user)
            if is_view_op(user):
                stack.append(user)
    return found


def tensorize_scalar_positions(graph_module: GraphModule) -> GraphModule:
    """Runs :class:`TensorizeScalarPositions` and returns the edited module."""
    return TensorizeScalarPositions()(graph_module).graph_module
