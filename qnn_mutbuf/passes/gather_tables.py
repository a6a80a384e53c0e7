"""Narrow lookup tables get one spare row, so the HTP reads their last row right.

Measured on the QAIRT 2.51 HTP (v75): a quantized Gather from a table whose rows
hold 16 or fewer 16-bit values returns code 0 (the bottom of the encoding) for
every lookup of the table's *last* row once it gathers 32 or more indices. T5's
relative position bias (8 buckets x heads) is such a table: its last bucket, first
reached 20 positions into a decode, came back as the most negative bias. A copy of
the last row appended to the table is never looked up, keeps the weight range, and
makes every real row an inner one.
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

aten = torch.ops.aten

NARROW_ROW = 64  # rows up to this many values get the spare row (failures seen at <= 16)
PADDED_META_KEY = "qnn_mutbuf_padded_table"


def _table(node: Node) -> tuple[Node, int] | None:
    """The get_attr table a lookup reads rows from, and the argument index it sits at."""
    if node.target == aten.embedding.default:
        index = 0
    elif node.target == aten.index_select.default and node.args[1] == 0:
        index = 0
    else:
        return None
    table = node.args[index]
    if isinstance(table, Node) and table.op == "get_attr":
        return table, index
    return None


def pad_narrow_gather_tables(graph_module: GraphModule) -> GraphModule:
    """Appends a copy of the last row to every narrow constant table that a lookup
    (``embedding``, ``index_select`` on dim 0) reads; lookups keep their indices."""
    padded: dict[str, Node] = {}
    graph = graph_module.graph
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        found = _table(node)
        if found is None:
            continue
        table, index = found
        value = _attribute(graph_module, str(table.target))
        if (
            not isinstance(value, torch.Tensor)
            or value.dim() != 2
            or value.shape[1] > NARROW_ROW
            or not value.is_floating_point()
        ):
            continue
        replacement = padded.get(str(table.target))
        if replacement is None:
            name = _free_name(graph_module, str(table.target).replace(".", "_") + "_padded")
            spare = torch.cat([value.detach(), value.detach()[-1:]], dim=0)
            graph_module.register_buffer(name, spare)
            with graph.inserting_before(table):
                replacement = graph.get_attr(name)
            replacement.meta.update(table.meta)
            mode = getattr(table.meta.get("val"), "fake_mode", None)
            if mode is not None:
                replacement.meta["val"] = mode.from_tensor(spare)
            replacement.meta[PADDED_META_KEY] = True
            padded[str(table.target)] = replacement
        node.update_arg(index, replacement)
    if padded:
        graph.eliminate_dead_code()
        graph.lint()
        graph_module.recompile()
    return graph_module


def _attribute(graph_module: GraphModule, target: str) -> object:
    owner: object = graph_module
    for part in target.split("."):
        owner = getattr(owner, part, None)
    return owner


def _free_name(graph_module: GraphModule, base: str) -> str:
    name, suffix = base, 0
    while hasattr(graph_module, name):
        suffix += 1
        name = f"{base}_{suffix}"
    return name
