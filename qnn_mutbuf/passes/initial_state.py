"""Makes every mutable buffer start each load from the model's initial contents.

ExecuTorch drops a mutable buffer's initial value unless the placeholder carries
``et_init_buffer`` (a cache initialised to ones comes back as zeros), and a buffer
delegated to QNN lives in memory the delegate allocates and never initialises
(garbage that changes from one load to the next). Two mechanisms:

* top-level buffers: :func:`mark_initialized_buffers` sets ``et_init_buffer`` on every
  buffer placeholder, so the program carries and restores the initial contents;
* delegated buffers: :class:`InsertInitialStateSelect` adds a one-element boolean
  buffer ``started`` (top level, initialised to False) and reads each buffer as
  ``where(started, buffer, initial)``; the step then sets ``started``. The first step
  after each load therefore sees the initial contents, bit-exactly in the state
  encoding, and later steps see the state they wrote.
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node
from torch.fx.passes.infra.pass_base import PassBase, PassResult

from qnn_mutbuf.detect import buffer_nodes, find_mutable_buffers
from qnn_mutbuf.passes.functionalize import STATE_META_KEY

aten = torch.ops.aten

STARTED_BUFFER = "_state_loaded"
INITIAL_PREFIX = "_state_initial_"


def _qdq_ops():
    # quantized_decomposed ops exist once torchao's pt2e package is imported.
    import torchao.quantization.pt2e  # noqa: F401

    ops = torch.ops.quantized_decomposed
    return ops.quantize_per_tensor.default, ops.dequantize_per_tensor.default


class InsertInitialStateSelect(PassBase):
    """Reads each mutable buffer through ``where(started, buffer, initial)``.

    Runs on a (quantized or floating-point) PT2E GraphModule before export. In a
    quantized graph the select is wrapped in the buffer's state encoding, so the
    initial contents enter the state exactly as the reference quantizes them.
    """

    def __init__(self, initial_state: dict[str, torch.Tensor] | None = None) -> None:
        super().__init__()
        self.initial_state = initial_state or {}

    def call(self, graph_module: GraphModule) -> PassResult:
        mutable = find_mutable_buffers(graph_module)
        mutable.pop(STARTED_BUFFER, None)
        if not mutable:
            return PassResult(graph_module, False)
        reads = {name: node for node, name in buffer_nodes(graph_module).items()}
        graph = graph_module.graph
        graph_module.register_buffer(STARTED_BUFFER, torch.zeros(1, dtype=torch.bool))
        first = next(n for n in graph.nodes if n.op in ("get_attr", "placeholder"))
        with graph.inserting_before(first):
            started = graph.get_attr(STARTED_BUFFER)
        started.meta["val"] = _fake_like(reads[next(iter(mutable))], (1,), torch.bool)

        for name, writers in mutable.items():
            read = reads[name]
            initial = self.initial_state.get(name, graph_module.get_buffer(name)).detach().clone()
            self._select_initial(graph_module, read, writers[-1], started, name, initial)

        output = next(n for n in graph.nodes if n.op == "output")
        with graph.inserting_before(output):
            not_started = graph.call_function(aten.logical_not.default, (started,))
            now_started = graph.call_function(aten.bitwise_or.Tensor, (started, not_started))
            write_back = graph.call_function(aten.copy_.default, (started, now_started))
        for node in (not_started, now_started, write_back):
            node.meta["val"] = started.meta["val"]
        write_back.meta[STATE_META_KEY] = {"buffer": STARTED_BUFFER, "role": "write_back"}
        graph.eliminate_dead_code()  # the buffers' own q/dq, now bypassed
        graph.lint()
        graph_module.recompile()
        return PassResult(graph_module, True)

    def _select_initial(
        self,
        graph_module: GraphModule,
        read: Node,
        write_back: Node,
        started: Node,
        name: str,
        initial: torch.Tensor,
    ) -> None:
        graph = graph_module.graph
        Q_PER_TENSOR, DQ_PER_TENSOR = _qdq_ops()
        readers = [user for user in read.users if user is not write_back]
        if not readers:
            return  # overwritten before it is ever read: its initial value never matters
        encoding = _read_encoding(read)
        constant_name = INITIAL_PREFIX + name.replace(".", "_")
        uniform = initial.numel() > 0 and bool((initial == initial.flatten()[0]).all())
        constant = initial.flatten()[:1].reshape([1] * initial.dim()) if uniform else initial
        insert_after = max(read, started, key=_position)
        with graph.inserting_before(insert_after.next):
            if encoding is None:
                graph_module.register_buffer(constant_name, constant)
                initial_node = graph.get_attr(constant_name)
                initial_node.meta["val"] = _fake_like(read, constant.shape, constant.dtype)
                select = graph.call_function(aten.where.self, (started, read, initial_node))
                select.meta["val"] = read.meta.get("val")
                replacement = select
            else:
                scale, zero_point, quant_min, quant_max, dtype = encoding
                quantized = Q_PER_TENSOR(
                    constant.float(), scale, zero_point, quant_min, quant_max, dtype
                )
                graph_module.register_buffer(constant_name, quantized)
                qargs = (scale, zero_point, quant_min, quant_max, dtype)
                q_read = graph.call_function(Q_PER_TENSOR, (read, *qargs))
                dq_read = graph.call_function(DQ_PER_TENSOR, (q_read, *qargs))
                initial_node = graph.get_attr(constant_name)
                dq_initial = graph.call_function(DQ_PER_TENSOR, (initial_node, *qargs))
                select = graph.call_function(aten.where.self, (started, dq_read, dq_initial))
                q_select = graph.call_function(Q_PER_TENSOR, (select, *qargs))
                replacement = graph.call_function(DQ_PER_TENSOR, (q_select, *qargs))
                value = read.meta.get("val")
                for node in (dq_read, select, replacement):
                    node.meta["val"] = value
                q_read.meta["val"] = _fake_like(read, value.shape, dtype)
                q_select.meta["val"] = q_read.meta["val"]
                initial_node.meta["val"] = _fake_like(read, quantized.shape, dtype)
                dq_initial.meta["val"] = _fake_like(read, quantized.shape, value.dtype)
        for user in readers:
            if user.target == Q_PER_TENSOR and encoding is not None:
                # The buffer's own q/dq: its dequantized users now read the selected value.
                for dq_user in list(user.users):
                    dq_user.replace_all_uses_with(replacement)
                continue
            user.replace_input_with(read, replacement)


def _read_encoding(read: Node) -> tuple | None:
    """The state encoding of a buffer read: from its q node, else from its write-back."""
    Q_PER_TENSOR, DQ_PER_TENSOR = _qdq_ops()
    for user in read.users:
        if user.target == Q_PER_TENSOR:
            return tuple(user.args[1:6])
    for user in read.users:
        if user.target == aten.copy_.default and isinstance(user.args[1], Node):
            value = user.args[1]
            if value.target == DQ_PER_TENSOR:
                return tuple(value.args[1:6])
    return None


def _position(node: Node) -> int:
    for index, other in enumerate(node.graph.nodes):
        if other is node:
            return index
    return -1


def _fake_like(node: Node, shape, dtype) -> torch.Tensor:
    value = node.meta.get("val")
    mode = getattr(value, "fake_mode", None)
    if mode is None:
        return torch.empty(shape, dtype=dtype, device="meta")
    with mode:
        return torch.empty(shape, dtype=dtype)


def mark_initialized_buffers(exported_program: torch.export.ExportedProgram) -> list[str]:
    """Sets ``et_init_buffer`` on every top-level buffer placeholder.

    The program then stores each mutable buffer's initial contents and ExecuTorch
    copies them into planned memory on every method load. Returns the buffer names.
    """
    marked = []
    inputs_to_buffers = exported_program.graph_signature.inputs_to_buffers
    mutated = set(exported_program.graph_signature.buffers_to_mutate.values())
    for node in exported_program.graph.nodes:
        if node.op == "placeholder" and inputs_to_buffers.get(node.name) in mutated:
            node.meta["et_init_buffer"] = True
            marked.append(inputs_to_buffers[node.name])
    return marked
