"""What every graph-editing pass does once it has edited: check and regenerate."""

from __future__ import annotations

from torch.fx import GraphModule
from torch.fx.passes.infra.pass_base import PassResult


def edited(graph_module: GraphModule, changed: bool) -> PassResult:
    """Lints and recompiles `graph_module` when the pass changed its graph."""
    if changed:
        graph_module.graph.lint()
        graph_module.recompile()
    return PassResult(graph_module, changed)
