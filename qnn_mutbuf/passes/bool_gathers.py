"""Gathers from boolean tables read through int32.

ExecuTorch's Llama reads its causal mask as ``self.mask[input_pos]`` from a boolean
table. The HTP's Gather has no boolean kernel (QAIRT 2.51: the op fails validation),
so the gather falls back to the CPU, splitting the delegate around every attention
layer. The table is cast to int32, gathered, and cast back: three HTP ops, the same
values.
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node
from torch.fx.passes.infra.pass_base import PassBase, PassResult

from qnn_mutbuf.passes.graph_edit import SOURCE_META_KEYS, edited, fake_like

aten = torch.ops.aten

_GATHERS = (aten.index.Tensor, aten.index_select.default)


def _is_bool(node: object) -> bool:
    value = node.meta.get("val") if isinstance(node, Node) else None
    return isinstance(value, torch.Tensor) and value.dtype == torch.bool


class GatherBoolTablesAsInt(PassBase):
    """``index(table, idx)`` on a bool table -> ``index(table.int(), idx).bool()``."""

    def call(self, graph_module: GraphModule) -> PassResult:
        graph = graph_module.graph
        changed = False
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target not in _GATHERS:
                continue
            table = node.args[0]
            if not (_is_bool(table) and _is_bool(node)):
                continue
            with graph.inserting_before(node):
                as_int = graph.call_function(
                    aten._to_copy.default, (table,), {"dtype": torch.int32}
                )
                gathered = graph.call_function(node.target, (as_int, *node.args[1:]), node.kwargs)
            with graph.inserting_after(gathered):
                as_bool = graph.call_function(
                    aten._to_copy.default, (gathered,), {"dtype": torch.bool}
                )
            as_int.meta["val"] = fake_like(table.meta["val"], dtype=torch.int32)
            gathered.meta["val"] = fake_like(node.meta["val"], dtype=torch.int32)
            as_bool.meta["val"] = node.meta["val"]
            for created in (as_int, gathered, as_bool):
                for key in SOURCE_META_KEYS:
                    if key in node.meta:
                        created.meta[key] = node.meta[key]
            node.replace_all_uses_with(as_bool)
            graph.erase_node(node)
            changed = True
        return edited(graph_module, changed)


def gather_bool_tables_as_int(graph_module: GraphModule) -> GraphModule:
    return GatherBoolTablesAsInt()(graph_module).graph_module
