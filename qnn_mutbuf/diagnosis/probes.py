"""Which values of a quantized graph diagnose observes, and the debug copy that emits them.

A probe is one value the HTP computes in a quantized encoding: the output of an op,
the state a buffer is read as, or the state written back into it. The debug copy of
the converted graph returns every probed value as an extra graph output, dequantized
in its own encoding, so the QNN delegate emits it; the user's module and the program
they ship are not changed.
"""

from __future__ import annotations

import copy
import enum
import operator
from dataclasses import dataclass

import torch
from torch.fx import GraphModule, Node
from torch.utils import _pytree as pytree

from qnn_mutbuf.detect import buffer_nodes, find_mutable_buffers, is_view_op


def qdq_ops() -> tuple:
    import torchao.quantization.pt2e  # noqa: F401  (registers quantized_decomposed)

    ops = torch.ops.quantized_decomposed
    return ops.quantize_per_tensor.default, ops.dequantize_per_tensor.default


class ProbeKind(enum.Enum):
    OP = "op"
    STATE_READ = "state read"
    STATE_WRITE = "state write"


@dataclass(frozen=True)
class Probe:
    """One observed value, named as the report names it.

    `node` is the converted graph's node: the op, the buffer's get_attr (state read)
    or its ``copy_`` write-back (state write). `quantize` is the quantize node whose
    encoding the value has (`scale` its step). `inputs` are the probes this value is
    computed from in the same step; a state read is computed from `carried_from`,
    the write of the previous step.
    """

    node: str
    kind: ProbeKind
    op: str
    module: str
    position: int
    quantize: str
    scale: float
    inputs: tuple[str, ...]
    buffer: str | None = None
    carried_from: str | None = None


def with_state_reads_quantized(converted: GraphModule) -> GraphModule:
    """A copy of `converted` in which every quantized buffer's read has a quantize
    node in its state encoding, so the read can be probed.

    An ``index_copy_`` cache is read unquantized by the op that writes it (the
    annotator shares the written encoding with it); the read is still a value the
    HTP holds in the state encoding, and the initial-state select reads it there.
    """
    quantize, dequantize = qdq_ops()
    probed = GraphModule(converted, copy.deepcopy(converted.graph))
    probed.meta.update(converted.meta)
    graph = probed.graph
    mutable = find_mutable_buffers(probed)
    for read, name in buffer_nodes(probed).items():
        writers = mutable.get(name)
        value = writers[-1].args[1] if writers and len(writers[-1].args) > 1 else None
        quantized = any(user.target == quantize for user in read.users)
        if quantized or not isinstance(value, Node) or value.target != dequantize:
            continue
        encoding = tuple(value.args[1:6])
        with graph.inserting_after(read):
            read_quantize = graph.call_function(quantize, (read, *encoding))
        with graph.inserting_after(read_quantize):
            graph.call_function(dequantize, (read_quantize, *encoding))
        read_quantize.meta["val"] = value.args[0].meta.get("val")
    graph.lint()
    probed.recompile()
    return probed


def find_probes(converted: GraphModule) -> list[Probe]:
    """Every quantized op output, and each mutable buffer's read and write, in graph order.

    Graph inputs are not probed, nor views of them: they arrive as float and are
    quantized by their consumers, and the HTP sends a reshaped input to an output
    through fp16 (12 steps off at 16 bits, measured on QAIRT 2.51, while the op
    consuming the same view reads it exactly). An op with several quantize users is
    observed in the first one's encoding (the others are requantized copies).
    """
    quantize, _ = qdq_ops()
    position = {node: index for index, node in enumerate(converted.graph.nodes)}
    reads = buffer_nodes(converted)
    mutable = find_mutable_buffers(converted)
    observed: dict[Node, Node] = {}  # producer -> its quantize node
    for node in converted.graph.nodes:
        if node.op != "call_function" or node.target != quantize:
            continue
        producer = node.args[0]
        if not isinstance(producer, Node) or producer in observed:
            continue
        if _is_op(producer) and not _view_of_graph_input(producer):
            observed[producer] = node
        elif producer in reads and reads[producer] in mutable:
            observed[producer] = node
    writes = {}
    for name, writers in mutable.items():
        value = writers[-1].args[1] if len(writers[-1].args) > 1 else None
        source = value.args[0] if isinstance(value, Node) and value.args else None
        if isinstance(source, Node) and source.target == quantize:
            writes[name] = (writers[-1], source)

    upstream = _Upstream(observed)
    probes = []
    for producer, quantize_node in observed.items():
        if producer in reads:
            name = reads[producer]
            write = writes.get(name)
            probes.append(
                _probe(
                    producer,
                    ProbeKind.STATE_READ,
                    quantize_node,
                    position,
                    inputs=(),
                    buffer=name,
                    carried_from=write[0].name if write else None,
                )
            )
        else:
            inputs = upstream.of_inputs(producer)
            probes.append(_probe(producer, ProbeKind.OP, quantize_node, position, inputs))
    for name, (write_back, quantize_node) in writes.items():
        inputs = upstream.of(write_back.args[1])
        probes.append(
            _probe(write_back, ProbeKind.STATE_WRITE, quantize_node, position, inputs, buffer=name)
        )
    return sorted(probes, key=lambda probe: probe.position)


def _is_op(node: Node) -> bool:
    quantize, dequantize = qdq_ops()
    return node.op == "call_function" and node.target not in (quantize, dequantize)


def _view_of_graph_input(node: Node) -> bool:
    """A view (through views and (de)quantize nodes) of a graph input."""
    quantize, dequantize = qdq_ops()
    while isinstance(node, Node) and (is_view_op(node) or node.target in (quantize, dequantize)):
        node = node.args[0]
    return isinstance(node, Node) and node.op == "placeholder"


def _probe(node, kind, quantize_node, position, inputs, buffer=None, carried_from=None) -> Probe:
    if kind is ProbeKind.OP:
        op = str(node.target) if node.target is not operator.getitem else "getitem"
        module = module_path(node)
    else:
        op = kind.value
        module = buffer.rpartition(".")[0]
    return Probe(
        node=node.name,
        kind=kind,
        op=op,
        module=module,
        position=position[node],
        quantize=quantize_node.name,
        scale=float(quantize_node.args[1]),
        inputs=tuple(sorted(inputs)),
        buffer=buffer,
        carried_from=carried_from,
    )


def module_path(node: Node) -> str:
    """The user's module the node was traced in (``layers.1.attention.wq``), '' at the root."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    return path if isinstance(path, str) else ""


class _Upstream:
    """The probes a node's value is computed from: through (de)quantize nodes and
    through unquantized ops (integer positions, shapes) to the nearest probed values."""

    def __init__(self, observed: dict[Node, Node]) -> None:
        self.observed = {producer.name for producer in observed}
        self._memo: dict[Node, frozenset[str]] = {}

    def of_inputs(self, node: Node) -> set[str]:
        return set().union(*(self.of(argument) for argument in node.all_input_nodes))

    def of(self, node: Node) -> frozenset[str]:
        if node in self._memo:
            return self._memo[node]
        quantize, dequantize = qdq_ops()
        if node.op == "call_function" and node.target in (quantize, dequantize):
            found = self.of(node.args[0])
        elif node.name in self.observed:
            found = frozenset({node.name})
        elif node.op == "call_function":
            found = frozenset(self.of_inputs(node))
        else:
            found = frozenset()  # graph inputs, weights and constants are exact
        self._memo[node] = found
        return found


def with_probe_outputs(
    converted: GraphModule, probes: list[Probe], *, delegated_state: bool
) -> tuple[GraphModule, list[str]]:
    """A copy of `converted` that also returns every probed value; and the quantize
    node behind each extra output, in output order (after the model's outputs).

    A value leaves as ``dequantize(q)``: QNN's edge passes fold the pair, so the
    producer's own tensor becomes a graph output, dequantized by the delegate in the
    encoding the HTP computed it in. Nothing is put in its way: when a tensor's
    encoding is not the one the next op expects, the HTP computes that op's output
    in its own encoding directly, so a probe through any op could hide what it is
    there to see. With `delegated_state`, a value written into a buffer is not
    emitted (it is a buffer mutation of the delegate, which ExecuTorch does not let
    be a user output too): the next step's state read shows what was stored.
    """
    _, dequantize = qdq_ops()
    debug = GraphModule(converted, copy.deepcopy(converted.graph))
    debug.meta.update(converted.meta)
    graph = debug.graph
    nodes = {node.name: node for node in graph.nodes}
    stored = written_quantize_nodes(probes) if delegated_state else set()
    output = next(node for node in graph.nodes if node.op == "output")
    emitted: list[str] = []
    extras: list[Node] = []
    with graph.inserting_before(output):
        for probe in probes:
            if probe.quantize in emitted or probe.quantize in stored:
                continue
            source = nodes[probe.quantize]
            extras.append(graph.call_function(dequantize, (source, *source.args[1:6])))
            emitted.append(probe.quantize)
    _append_outputs(graph, output, extras)
    graph.lint()
    debug.recompile()
    return debug, emitted


def written_quantize_nodes(probes: list[Probe]) -> set[str]:
    """The quantize nodes whose values are written back into a buffer."""
    return {probe.quantize for probe in probes if probe.kind is ProbeKind.STATE_WRITE}


def _append_outputs(graph: torch.fx.Graph, output: Node, extras: list[Node]) -> None:
    """Outputs become (model outputs..., extras...) once flattened, as ExecuTorch
    flattens them; the pytree output spec of an exported graph follows."""
    info = getattr(graph._codegen, "pytree_info", None)
    if info is None or info.out_spec is None:
        output.args = ((output.args[0], tuple(extras)),)
        return
    leaves = output.args[0]
    leaves = (leaves,) if isinstance(leaves, Node) else tuple(leaves)
    output.args = (leaves + tuple(extras),)
    extra_spec = pytree.tree_structure(tuple(range(len(extras))))
    graph._codegen.pytree_info = info._replace(
        out_spec=pytree.TreeSpec(tuple, None, [info.out_spec, extra_spec])
    )
