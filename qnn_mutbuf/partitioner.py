"""QnnPartitioner that decides, buffer by buffer, what lives inside the delegate.

Upstream delegates either every mutable buffer or none. We need finer control: with
``delegate_mutable_buffers=True`` the model's buffers live in the delegate, while the
one-byte "started" flag that tells the delegate to load the initial state stays at
top level, where ExecuTorch initialises it from the program on every load.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from executorch.backends.qualcomm.partition.qnn_partitioner import QnnPartitioner
from executorch.exir.backend.partitioner import PartitionResult

from qnn_mutbuf.passes.quantized_state import keep_delegated_state_quantized

DELEGATION_TAG = "delegation_tag"
logger = logging.getLogger(__name__)


class MutableBufferQnnPartitioner(QnnPartitioner):
    """Args as QnnPartitioner, plus which buffers go where.

    Args:
        delegate_mutable_buffers: keep mutable buffers inside the delegate.
        top_level_buffers: buffer names that stay at top level regardless.
    """

    def __init__(
        self,
        compiler_specs,
        *,
        delegate_mutable_buffers: bool = True,
        top_level_buffers: Iterable[str] = (),
        **kwargs,
    ) -> None:
        super().__init__(compiler_specs, skip_mutable_buffer=not delegate_mutable_buffers, **kwargs)
        self.top_level_buffers = set(top_level_buffers)

    def partition(self, edge_program: torch.export.ExportedProgram) -> PartitionResult:
        result = super().partition(edge_program)
        for tag in merge_convex_partitions(edge_program.graph):
            result.partition_tags.pop(tag, None)
        inputs_to_buffers = edge_program.graph_signature.inputs_to_buffers
        mutated = set(edge_program.graph_signature.buffers_to_mutate.values())
        for node in edge_program.graph.nodes:
            if node.op != "placeholder":
                continue
            buffer = inputs_to_buffers.get(node.name)
            if buffer in self.top_level_buffers:
                node.meta.pop(DELEGATION_TAG, None)
            elif buffer in mutated and not node.users:
                # Written but never read (StaticCache's cumulative_length is overwritten
                # first thing): the QNN graph has no input for it, so the delegate would
                # have no memory to write it to. It stays at top level.
                node.meta.pop(DELEGATION_TAG, None)
        keep_state_with_its_writer(edge_program)
        self.quantized_state_buffers = keep_delegated_state_quantized(edge_program)
        return result


def keep_state_with_its_writer(edge_program: torch.export.ExportedProgram) -> None:
    """A buffer lives in a delegate only if that delegate also computes its new value.

    Upstream tags a buffer with the partition of its readers; when the op that writes
    it falls back to the CPU, the delegate would own memory that the CPU writes and
    ExecuTorch rejects the program. Such a buffer stays at top level.
    """
    from torch.export.graph_signature import OutputKind

    writers = {
        spec.target: spec.arg.name
        for spec in edge_program.graph_signature.output_specs
        if spec.kind == OutputKind.BUFFER_MUTATION
    }
    nodes = {node.name: node for node in edge_program.graph.nodes}
    inputs_to_buffers = edge_program.graph_signature.inputs_to_buffers
    for node in edge_program.graph.nodes:
        buffer = inputs_to_buffers.get(node.name) if node.op == "placeholder" else None
        tag = node.meta.get(DELEGATION_TAG)
        if buffer not in writers or tag is None:
            continue
        writer = nodes.get(writers[buffer])
        if writer is not None and writer.meta.get(DELEGATION_TAG) != tag:
            logger.warning(
                "Buffer '%s' stays at top level: its new value comes from '%s' (%s), "
                "which is not in the delegate that reads it.",
                buffer,
                writer.name,
                getattr(writer.target, "__name__", writer.target),
            )
            node.meta.pop(DELEGATION_TAG, None)


def merge_convex_partitions(graph: torch.fx.Graph) -> list[str]:
    """Merges delegate partitions whose union is still convex; returns the tags gone.

    torch's capability-based partitioner merges greedily, so the order it visits
    nodes in (which follows Python's string hashing) can leave a fully supported
    graph split in two delegates with the CPU copying tensors between them. Two
    partitions can become one whenever no node outside both lies on a path from
    one to the other.
    """
    merged: list[str] = []
    while True:
        members: dict[str, set[torch.fx.Node]] = {}
        for node in graph.nodes:
            tag = node.meta.get(DELEGATION_TAG)
            if tag is not None and node.op == "call_function":
                members.setdefault(tag, set()).add(node)
        tags = sorted(members)
        pair = next(
            (
                (a, b)
                for i, a in enumerate(tags)
                for b in tags[i + 1 :]
                if _is_convex(members[a] | members[b])
            ),
            None,
        )
        if pair is None:
            return merged
        keep, gone = pair
        for node in graph.nodes:
            if node.meta.get(DELEGATION_TAG) == gone:
                node.meta[DELEGATION_TAG] = keep
        merged.append(gone)


def _is_convex(nodes: set[torch.fx.Node]) -> bool:
    """No path leaves `nodes` and comes back into them."""
    outside = set()
    frontier = [user for node in nodes for user in node.users if user not in nodes]
    while frontier:
        node = frontier.pop()
        if node in outside:
            continue
        outside.add(node)
        for user in node.users:
            if user in nodes:
                return False
            frontier.append(user)
    return True
