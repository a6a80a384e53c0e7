"""The debug program: lowered with the same ``lower()`` as the program you ship,
and where (HTP or CPU) each of its extra outputs was computed."""

from __future__ import annotations

import torch
from torch.fx import GraphModule

from qnn_mutbuf.errors import LoweringError, QnnMutbufError


def lower_debug_program(
    debug: GraphModule, example: tuple, *, soc: str, delegate_mutable_buffers: bool
):
    """``qnn_mutbuf.lower`` of the debug copy; a failure that only the extra outputs
    cause is one LoweringError saying so."""
    from qnn_mutbuf.lowering import lower

    try:
        return lower(debug, example, soc=soc, delegate_mutable_buffers=delegate_mutable_buffers)
    except QnnMutbufError:
        raise
    except Exception as error:
        text = str(error).strip().splitlines()
        raise LoweringError(
            "The debug program (every quantized value also returned as an output) did not "
            f"lower: {text[0] if text else type(error).__name__}. The program you ship is "
            "not changed by diagnose; run `qnn-mutbuf export` to check that it lowers."
        ) from error


def probe_locations(program, count: int) -> list[str]:
    """ "htp" or "cpu" for each of the last `count` user outputs of `program`.

    An output is the HTP's when a QNN delegate computes it from something inside
    the delegate; a value the delegate only passes through (its producer fell back
    to the CPU, the delegate just reshapes it) is the CPU's.
    """
    exported = program.exported_program()
    output = next(node for node in exported.graph.nodes if node.op == "output")
    values = list(output.args[0])[-count:] if count else []
    return ["htp" if _computed_in_delegate(exported, value) else "cpu" for value in values]


_PASS_THROUGH = ("view", "reshape", "quantize_per_tensor", "dequantize_per_tensor", "alias")


def _computed_in_delegate(exported, value: object) -> bool:
    import operator

    if not (
        isinstance(value, torch.fx.Node)
        and value.target is operator.getitem
        and "executorch_call_delegate" in str(value.args[0].target)
    ):
        return False
    call, index = value.args
    lowered = getattr(exported.graph_module, call.args[0].target, None)
    inner = getattr(lowered, "original_module", None)
    if inner is None:
        return True
    inner_output = next(node for node in inner.graph.nodes if node.op == "output")
    node = list(inner_output.args[0])[index]
    while (
        isinstance(node, torch.fx.Node)
        and node.op == "call_function"
        and any(name in str(node.target) for name in _PASS_THROUGH)
    ):
        node = node.args[0]
    return isinstance(node, torch.fx.Node) and node.op != "placeholder"
