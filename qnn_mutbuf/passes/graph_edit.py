"""Small pieces every graph-editing pass needs: fake values for new nodes, and the
check-and-regenerate once it has edited."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.fx import GraphModule
from torch.fx.passes.infra.pass_base import PassResult


def edited(graph_module: GraphModule, changed: bool) -> PassResult:
    """Lints and recompiles `graph_module` when the pass changed its graph."""
    if changed:
        graph_module.graph.lint()
        graph_module.recompile()
    return PassResult(graph_module, changed)


def fake_like(
    like: torch.Tensor, *, shape: Sequence[int] | None = None, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """A ``val`` for a new node: `like`'s fake mode (or meta device), shape and dtype,
    either of which can be replaced."""
    shape = tuple(like.shape) if shape is None else tuple(shape)
    dtype = like.dtype if dtype is None else dtype
    mode = getattr(like, "fake_mode", None)
    if mode is None:
        return torch.empty(shape, dtype=dtype, device="meta")
    with mode:
        return torch.empty(shape, dtype=dtype)


def source_line(node: torch.fx.Node) -> str:
    """``file:line: code`` of the user code that produced `node` (from its stack trace)."""
    trace = node.meta.get("stack_trace") or ""
    lines = [line.strip() for line in trace.strip().splitlines() if line.strip()]
    for index in range(len(lines) - 1, -1, -1):
        if lines[index].startswith('File "'):
            location = lines[index]
            path = location.split('"')[1]
            number = location.split(", line ")[1].split(",")[0]
            code = lines[index + 1] if index + 1 < len(lines) else ""
            return f"{path}:{number}: {code}".rstrip(": ")
    return "no source line recorded"


SOURCE_META_KEYS = ("nn_module_stack", "stack_trace", "source_fn_stack", "torch_fn", "from_node")
"""What a node created in place of another keeps of it: the user's module, source
line and provenance, for annotators, diagnose and error messages."""


def fresh_attribute_name(module: torch.nn.Module, base: str) -> str:
    """`base`, or `base_1`, `base_2`... whichever `module` does not have yet."""
    name, index = base, 0
    while hasattr(module, name):
        index += 1
        name = f"{base}_{index}"
    return name
