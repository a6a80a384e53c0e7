"""What the CPU computes for every probe, step by step: fake-quant and fp32.

The fake-quant value of a probe is the converted module's value at the probe's
quantize node, dequantized: exactly what the HTP should produce up to rounding. The
fp32 value is the same node of the fp32 model's exported graph, found through the
converted node's provenance (``from_node``). Both run eagerly from the initial state
with the state carried, one step per call.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable

import torch
from torch.fx import GraphModule, Interpreter, Node

from qnn_mutbuf.diagnosis.probes import Probe, ProbeKind, qdq_ops
from qnn_mutbuf.records import reset_state


class _Recorder(Interpreter):
    """Runs a GraphModule node by node and keeps the values of the named nodes."""

    def __init__(self, module: GraphModule, names: Iterable[str]) -> None:
        super().__init__(module)
        self.names = set(names)
        self.recorded: dict[str, torch.Tensor] = {}

    def run_node(self, node: Node):
        value = super().run_node(node)
        if node.name in self.names and isinstance(value, torch.Tensor):
            # in-place ops later in the step may change an aliased value
            self.recorded[node.name] = value.detach().clone()
        return value


class FakeQuantReference:
    """The converted module from its initial state, run one step per call.

    `step` returns, by quantize node name, each probed value as fake-quant computes
    it, and as fake-quant computes it when every probed value it depends on is
    taken from the HTP instead (`observed`): the difference between the HTP and the
    latter is what each op adds on its own, whatever its inputs brought.
    """

    def __init__(self, converted: GraphModule, probes: list[Probe]) -> None:
        _, dequantize = qdq_ops()
        wanted = {probe.quantize for probe in probes}
        self.module = reset_state(copy.deepcopy(converted))
        self.encodings = {
            node.name: tuple(node.args[1:6])
            for node in self.module.graph.nodes
            if node.name in wanted
        }
        self.readers = {
            node.name: node.args[0].name
            for node in self.module.graph.nodes
            if node.op == "call_function"
            and node.target == dequantize
            and isinstance(node.args[0], Node)
            and node.args[0].name in wanted
        }

    def step(
        self, inputs: tuple, observed: dict[str, torch.Tensor], state: dict[str, torch.Tensor]
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """(fake-quant values, values fed from the HTP), both by quantize node name.

        `observed` holds the HTP's value of each probed quantize node and `state` the
        buffers as the HTP left them; the fed run reads those, leaves the module's own
        state as it was, and comes first.
        """
        own_state = {name: self.module.get_buffer(name).clone() for name in state}
        fed = _FedFromObserved(self.module, self.encodings, self.readers, observed)
        with torch.no_grad():
            for name, value in state.items():
                self.module.get_buffer(name).copy_(value)
            try:
                fed.run(*inputs)
            finally:
                for name, value in own_state.items():
                    self.module.get_buffer(name).copy_(value)
        recorder = _Recorder(self.module, self.encodings)
        with torch.no_grad():
            recorder.run(*inputs)
        return self._dequantized(recorder.recorded), self._dequantized(fed.recorded)

    def _dequantized(self, recorded: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        _, dequantize = qdq_ops()
        return {name: dequantize(codes, *self.encodings[name]) for name, codes in recorded.items()}


class _FedFromObserved(_Recorder):
    """A run in which every dequantize of a probed value returns the observed value,
    and the write-backs into buffers are skipped (the state stays as it was)."""

    def __init__(self, module, names, readers: dict[str, str], observed) -> None:
        super().__init__(module, names)
        self.readers = readers
        self.observed = observed

    def run_node(self, node: Node):
        source = self.readers.get(node.name)
        if source is not None and source in self.observed:
            value = self.observed[source].to(torch.float32)
            return value.reshape(node.meta["val"].shape) if "val" in node.meta else value
        if node.op == "call_function" and node.target == torch.ops.aten.copy_.default:
            return self.env[node.args[1]] if isinstance(node.args[1], Node) else node.args[1]
        return super().run_node(node)


class Fp32Reference:
    """The fp32 model's exported graph from its initial state; `step` returns the
    fp32 value of every probe that has a counterpart, by probe node name.

    A state read is the buffer before the step, a state write the buffer after it.
    """

    def __init__(
        self, model: torch.nn.Module, example: tuple, converted: GraphModule, probes: list[Probe]
    ) -> None:
        from qnn_mutbuf.lowering import export_for_quantization

        # The same export quantize() starts from, so the node names are the ones
        # the converted graph's provenance records.
        self.graph_module = export_for_quantization(copy.deepcopy(model).eval(), example)
        self.sources = match_fp32_nodes(converted, self.graph_module, probes)
        self.reads = {p.node: p.buffer for p in probes if p.kind is ProbeKind.STATE_READ}
        self.writes = {p.node: p.buffer for p in probes if p.kind is ProbeKind.STATE_WRITE}

    def step(self, inputs: tuple) -> dict[str, torch.Tensor]:
        values = {node: self._buffer(name) for node, name in self.reads.items()}
        recorder = _Recorder(self.graph_module, self.sources.values())
        with torch.no_grad():
            recorder.run(*inputs)
        for node, source in self.sources.items():
            if source in recorder.recorded:
                values[node] = recorder.recorded[source]
        values.update({node: self._buffer(name) for node, name in self.writes.items()})
        return values

    def _buffer(self, name: str) -> torch.Tensor:
        return self.graph_module.get_buffer(name).detach().clone()


def match_fp32_nodes(
    converted: GraphModule, fp32: GraphModule, probes: list[Probe]
) -> dict[str, str]:
    """Probe node -> the fp32 graph's node it was made from.

    Quantization passes replace some nodes by several (a decomposed op): all carry
    the original in their provenance, and only the last of them, which computes
    the original's value, is matched. A node with no provenance (the initial-state
    select, a decomposition's new pieces) or with another shape has no counterpart.
    """
    candidates = {node.name: node for node in fp32.graph.nodes if node.op == "call_function"}
    nodes = {node.name: node for node in converted.graph.nodes}
    last: dict[str, Probe] = {}
    for probe in sorted(probes, key=lambda p: p.position):
        if probe.kind is not ProbeKind.OP:
            continue
        source = _provenance(nodes[probe.node], candidates)
        if source is not None:
            last[source] = probe
    return {
        probe.node: source
        for source, probe in last.items()
        if _shape(nodes[probe.node]) == _shape(candidates[source])
    }


def _provenance(node: Node, names: dict[str, Node]) -> str | None:
    """The nearest node in `node`'s ``from_node`` chain that is one of `names`."""
    level = list(node.meta.get("from_node") or [])
    while level:
        for source in level:
            if source.name in names:
                return source.name
        level = [parent for source in level for parent in (source.from_node or [])]
    return None


def _shape(node: Node) -> tuple | None:
    value = node.meta.get("val")
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None
