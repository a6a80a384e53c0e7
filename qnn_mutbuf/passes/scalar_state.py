"""Stores zero-dimensional mutable buffers as one-element tensors.

transformers' StaticCache keeps ``cumulative_length`` as a 0-d int64 buffer. The QNN
passes turn 0-d tensors into 1-d ones (Remove0DTensor, I64toI32), so the value written
back has shape (1,) while the buffer still has shape (): lowering then fails with
``expand: the requested shape has too few dimensions``. We give such buffers shape
(1,), read them through ``view([])`` and write them back through ``view([1])``; the
model computes exactly what it did, and every tensor QNN sees has a dimension.
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule
from torch.fx.passes.infra.pass_base import PassBase, PassResult

from qnn_mutbuf.detect import buffer_nodes, find_mutable_buffers
from qnn_mutbuf.passes.graph_edit import fake_like

aten = torch.ops.aten


class PromoteScalarBuffers(PassBase):
    """Gives every 0-d mutable buffer of a PT2E GraphModule the shape (1,)."""

    def __init__(self) -> None:
        super().__init__()
        self.promoted: list[str] = []

    def call(self, graph_module: GraphModule) -> PassResult:
        graph = graph_module.graph
        reads = {name: node for node, name in buffer_nodes(graph_module).items()}
        for name, writers in find_mutable_buffers(graph_module).items():
            value = graph_module.get_buffer(name)
            if value.dim() != 0 or name not in reads:
                continue
            read = reads[name]
            module_path, _, attribute = name.rpartition(".")
            owner = graph_module.get_submodule(module_path) if module_path else graph_module
            owner.register_buffer(attribute, value.detach().reshape(1).clone())
            scalar_val = read.meta.get("val")
            if scalar_val is not None:
                read.meta["val"] = fake_like(scalar_val, shape=(1,))
            write_back = writers[-1]
            users = [u for u in read.users if u is not write_back]
            with graph.inserting_after(read):
                as_scalar = graph.call_function(aten.view.default, (read, []))
            as_scalar.meta["val"] = scalar_val
            for user in users:
                user.replace_input_with(read, as_scalar)
            written = write_back.args[1]
            with graph.inserting_before(write_back):
                as_vector = graph.call_function(aten.view.default, (written, [1]))
            if isinstance(written, torch.fx.Node) and written.meta.get("val") is not None:
                as_vector.meta["val"] = fake_like(written.meta["val"], shape=(1,))
            write_back.args = (read, as_vector)
            self.promoted.append(name)
        if self.promoted:
            graph.lint()
            graph_module.recompile()
        return PassResult(graph_module, bool(self.promoted))
