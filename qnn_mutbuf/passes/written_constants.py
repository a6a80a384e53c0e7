"""Makes tensor constants that the forward writes in place into mutable buffers.

State the model keeps in a plain tensor attribute (transformers 5's
``StaticLayer.cumulative_length`` inside ExecuTorch's own Whisper wrapper) is lifted
by ``torch.export`` as a constant, and its in-place updates land on that constant:
lowered as it is, it would be frozen at its initial value. Such a constant is what
a buffer is, so it becomes one (one log line each). A constant that is the very
tensor of a registered buffer (non-strict export can lift a buffer reached through
another object as a constant) is read and written as that buffer instead.
"""

from __future__ import annotations

import logging

import torch
from torch.fx import GraphModule
from torch.fx.passes.infra.pass_base import PassBase, PassResult

from qnn_mutbuf.detect import writes_into
from qnn_mutbuf.passes.graph_edit import edited, source_line

logger = logging.getLogger(__name__)


def _attribute(module: torch.nn.Module, path: str):
    owner_path, _, name = path.rpartition(".")
    owner = module.get_submodule(owner_path) if owner_path else module
    return owner, name, getattr(owner, name, None)


class PromoteWrittenConstants(PassBase):
    """Registers every in-place-written tensor constant of a GraphModule as a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.promoted: list[str] = []
        self.redirected: dict[str, str] = {}

    def call(self, graph_module: GraphModule) -> PassResult:
        graph = graph_module.graph
        registered = {name for name, _ in graph_module.named_buffers(remove_duplicate=False)}
        registered |= {name for name, _ in graph_module.named_parameters(remove_duplicate=False)}
        constants = {
            node: str(node.target)
            for node in graph.nodes
            if node.op == "get_attr"
            and str(node.target) not in registered
            and isinstance(_attribute(graph_module, str(node.target))[2], torch.Tensor)
        }
        if not constants:
            return PassResult(graph_module, False)
        written = {target: writers[0] for target, writers in writes_into(graph, constants).items()}
        by_storage = {
            _storage_key(value): name
            for name, value in graph_module.named_buffers(remove_duplicate=False)
        }
        for target, writer in written.items():
            owner, attribute, value = _attribute(graph_module, target)
            same_buffer = by_storage.get(_storage_key(value))
            if same_buffer is not None:
                for node in [n for n, t in constants.items() if t == target]:
                    node.target = same_buffer
                self.redirected[target] = same_buffer
                continue
            delattr(owner, attribute)
            owner.register_buffer(attribute, value.detach().clone())
            self.promoted.append(target)
            logger.warning(
                "Tensor constant '%s' is written in place by '%s' (%s): it is kept as a "
                "mutable buffer.",
                target,
                writer.name,
                source_line(writer),
            )
        return edited(graph_module, bool(self.promoted or self.redirected))


def _storage_key(value: object) -> tuple | None:
    if not isinstance(value, torch.Tensor) or value.device.type == "meta":
        return None
    return (value.untyped_storage().data_ptr(), value.storage_offset(), tuple(value.shape))


def promote_written_constants(graph_module: GraphModule) -> GraphModule:
    return PromoteWrittenConstants()(graph_module).graph_module
