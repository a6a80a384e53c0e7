"""quantize() and lower(): the driver from a PyTorch module to an ExecuTorch program.

quantize() exports, prepares with MutableBufferQnnQuantizer, calibrates by running
the steps in order (so the state evolves as in real decoding) and converts. lower()
exports the result for the QNN HTP backend, keeps each mutable buffer either inside
the delegate or at top level, and makes every buffer start each load from the
model's initial contents.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.fx import GraphModule

from qnn_mutbuf.detect import find_mutable_buffers
from qnn_mutbuf.errors import InputError, LoweringError, UnsupportedMutationError
from qnn_mutbuf.passes.initial_state import STARTED_BUFFER
from qnn_mutbuf.progress import progress, stage
from qnn_mutbuf.records import (
    RECORD_KEY,
    StateEncodingRecord,
    record_initial_state,
    record_of,
    replace_buffers,
    reset_state,
)

logger = logging.getLogger(__name__)

QUANT_SCHEMES = ("8a8w", "16a8w", "16a4w", "16a16w")


def quant_dtype(quant: str):
    from executorch.backends.qualcomm.quantizer.quantizer import QuantDtype

    mapping = {
        "8a8w": QuantDtype.use_8a8w,
        "16a8w": QuantDtype.use_16a8w,
        "16a4w": QuantDtype.use_16a4w,
        "16a16w": QuantDtype.use_16a16w,
    }
    if quant not in mapping:
        raise InputError(f"Unknown quant scheme {quant!r}; use one of {', '.join(QUANT_SCHEMES)}.")
    return mapping[quant]


def default_quantizer(quant: str = "8a8w", soc: str = "SM8650"):
    """MutableBufferQnnQuantizer with per-channel weights and min-max activations.

    Calibration for decoders is a few steps; a moving-average observer under-ranges
    activations and state seen over so few samples, a min-max observer does not. With
    16-bit activations the range also gets headroom (see observers.py).
    """
    from qnn_mutbuf.quantizer import MutableBufferQnnQuantizer, default_act_observer
    from qnn_mutbuf.soc import resolve_soc

    quantizer = MutableBufferQnnQuantizer(soc_model=resolve_soc(soc))
    dtype = quant_dtype(quant)
    quantizer.set_default_quant_config(
        dtype,
        is_conv_per_channel=True,
        is_linear_per_channel=True,
        act_observer=default_act_observer(dtype),
    )
    return quantizer


def check_steps(steps: Sequence, what: str = "calibration") -> list[tuple]:
    """Steps are a non-empty list of per-step positional inputs.

    Each step is a tuple of what ``torch.export`` accepts as ``args``: tensors, or
    nested tuples/lists/dicts of them, with non-tensor leaves where export makes them
    constants. Every step must have step 0's structure and tensor shapes; a mismatch
    is one message naming the step and the leaf (``step 3: input[0]['input_pos']``).
    """
    from qnn_mutbuf.program_io import flatten_step

    if isinstance(steps, (tuple, list)) and steps and isinstance(steps[0], torch.Tensor):
        raise InputError(
            f"{what} must be a list of per-step input tuples, e.g. [(x0,), (x1,)], "
            "not a single tuple of tensors."
        )
    if not isinstance(steps, (list, tuple)) or not steps:
        raise InputError(f"{what} must be a non-empty list of per-step input tuples.")
    checked = []
    expected = None
    for index, step in enumerate(steps):
        if isinstance(step, torch.Tensor):
            step = (step,)
        if not isinstance(step, (list, tuple)):
            raise InputError(
                f"{what} step {index} must be a tuple of positional inputs, got "
                f"{type(step).__name__}."
            )
        leaves = [(path, _leaf_signature(value)) for path, value in flatten_step(tuple(step))]
        if not any(isinstance(sig, tuple) for _, sig in leaves):
            raise InputError(f"{what} step {index} holds no tensor.")
        if expected is None:
            expected = leaves
        elif leaves != expected:
            raise InputError(f"{what} step {index}: {_first_difference(expected, leaves)}")
        checked.append(tuple(step))
    return checked


def _leaf_signature(value: object) -> object:
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), value.dtype)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise InputError(
        f"inputs hold a {type(value).__name__}; torch.export takes tensors, nested "
        "tuples/lists/dicts of them and plain numbers."
    )


def _first_difference(expected: list, actual: list) -> str:
    paths = [path for path, _ in expected]
    if paths != [path for path, _ in actual]:
        return (
            f"the inputs have the leaves {', '.join(p for p, _ in actual) or 'none'}, step 0 "
            f"has {', '.join(paths)}."
        )
    for (path, want), (_, got) in zip(expected, actual, strict=True):
        if want == got:
            continue
        if isinstance(want, tuple) and isinstance(got, tuple):
            if want[0] != got[0]:
                return f"{path}: expected {want[0]}, got {got[0]}."
            return f"{path}: expected dtype {want[1]}, got {got[1]}."
        return f"{path}: expected {want!r} (as in step 0), got {got!r}."
    return "differs from step 0."


def quantize(
    module: torch.nn.Module,
    calibration: list[tuple],
    *,
    quant: str = "8a8w",
    quantizer=None,
) -> GraphModule:
    """Exports, prepares, calibrates step by step and converts `module`.

    Mutable buffers are never folded into frozen constants; weights are. The returned
    module is the fake-quant reference: run it eagerly from its returned state to get
    what the phone should compute. Its buffers hold the model's initial state again.
    """
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    steps = check_steps(calibration)
    if quantizer is None:
        quantizer = default_quantizer(quant)
    else:
        quant_dtype(quant)  # validate the name even when the quantizer decides
    if isinstance(module, torch.nn.Module) and not isinstance(module, GraphModule):
        module = module.eval()
    initial_module_state = {name: value.detach().clone() for name, value in module.named_buffers()}
    with stage("export"):
        graph_module = export_for_quantization(module, steps[0])
    with stage("prepare"):
        prepared = prepare_pt2e(graph_module, quantizer)
    # MutableBufferQnnQuantizer records the initial state before calibration; a
    # quantizer of the user's own that does not is covered here.
    record = record_of(prepared) or record_initial_state(
        prepared, sorted(find_mutable_buffers(prepared))
    )
    with torch.no_grad():
        for inputs in progress(steps, description="calibration"):
            prepared(*inputs)
    reset_state(prepared)
    with torch.no_grad():
        # Non-strict export may share buffer tensors with the caller's module.
        for name, value in module.named_buffers():
            if name in initial_module_state:
                value.copy_(initial_module_state[name])
    with stage("convert"):
        converted = convert_pt2e(prepared)
    check_buffers_kept(converted, list(record.mutable_buffers))
    record.quant = quant
    record.state_encodings = read_state_encodings(converted)
    record.calibration_steps = len(steps)
    converted.meta[RECORD_KEY] = record
    return converted


def export_for_quantization(module: torch.nn.Module, inputs: tuple) -> GraphModule:
    """``torch.export`` (strict, as ExecuTorch's QNN flow does), else non-strict, and
    a check that every buffer the model changes is still written in the graph.

    Strict export in torch 2.13 records nothing for a buffer *reassigned* in forward
    (``self.h = f(self.h)``): no mutation, no ``copy_``, the state silently constant.
    Non-strict export keeps a ``copy_``. One eager step on a copy of the module says
    which buffers the model changes; when strict export lost one, non-strict is
    used, and when both lose it, that is refused.
    """
    if isinstance(module, GraphModule):
        return module
    changed = buffers_changed_by_one_step(module, inputs)
    attempts = ("strict", "non-strict")
    graph_module, lost = None, []
    for attempt in attempts:
        try:
            exported = torch.export.export(module, inputs, strict=attempt == "strict")
        except Exception as error:
            if attempt == attempts[-1]:
                raise
            # dynamo cannot trace it: non-strict is the fallback
            logger.info("strict export failed (%s); exporting non-strict", _first_line(error))
            continue
        graph_module = exported.module()
        lost = [name for name in changed if name not in _written_buffers(graph_module)]
        if not lost:
            return graph_module
        logger.info("%s export lost the writes of %s", attempt, ", ".join(lost))
    raise UnsupportedMutationError(
        f"torch.export loses the new value of buffer(s) {', '.join(lost)}: the model "
        "changes them in forward, but neither strict nor non-strict export records the "
        "write, so the lowered state would stay constant. Update them in place "
        "(self.h.copy_(new_h)) instead of assigning a new tensor."
    )


def buffers_changed_by_one_step(module: torch.nn.Module, inputs: tuple) -> list[str]:
    """Buffers one eager forward (on a copy) reassigns or changes in place."""
    import copy

    probe = copy.deepcopy(module)
    identities = {name: id(value) for name, value in probe.named_buffers()}
    with torch.no_grad():
        probe(*copy.deepcopy(inputs))
    original = dict(module.named_buffers())
    changed = []
    for name, value in probe.named_buffers():
        before = original.get(name)
        if before is None or identities.get(name) != id(value):
            changed.append(name)  # reassigned (or registered during forward)
        elif value.shape != before.shape or not torch.equal(value, before):
            changed.append(name)
    return changed


def _written_buffers(graph_module: GraphModule) -> set[str]:
    import copy

    from qnn_mutbuf.passes.set_grad_regions import InlineSetGradRegions

    inlined = GraphModule(graph_module, copy.deepcopy(graph_module.graph))
    InlineSetGradRegions()(inlined)
    return set(find_mutable_buffers(inlined))


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def check_buffers_kept(converted: GraphModule, mutable: Sequence[str]) -> None:
    """Fails when convert folded a mutable buffer into a frozen constant."""
    written = set(find_mutable_buffers(converted))
    lost = [name for name in mutable if name not in written]
    if lost:
        raise LoweringError(
            f"convert_pt2e folded the mutable buffer(s) {', '.join(lost)} into frozen "
            "constants, so they would never change on device. Quantize with "
            "qnn_mutbuf.MutableBufferQnnQuantizer (or qnn_mutbuf.quantize)."
        )


def read_state_encodings(converted: GraphModule) -> dict[str, StateEncodingRecord]:
    """The encoding of each quantized buffer, read from the q/dq of its write-back."""
    encodings = {}
    dequantize = torch.ops.quantized_decomposed.dequantize_per_tensor.default
    for name, writers in find_mutable_buffers(converted).items():
        write_back = writers[-1]
        value = write_back.args[1] if len(write_back.args) > 1 else None
        if isinstance(value, torch.fx.Node) and value.target == dequantize:
            _, scale, zero_point, quant_min, quant_max, dtype = value.args[:6]
            encodings[name] = StateEncodingRecord(
                float(scale),
                int(zero_point),
                int(quant_min),
                int(quant_max),
                str(dtype).removeprefix("torch."),
            )
    return encodings


@dataclass
class LoweringReport:
    """What lower() produced, for logs and the CLI's JSON."""

    soc: str
    fp16: bool
    delegate_mutable_buffers: bool
    seconds: float
    nodes_on_htp: int
    nodes_on_cpu: int
    cpu_ops: list[str]
    delegated_buffers: list[str]
    top_level_buffers: list[str]


def lower(
    model_or_quantized: torch.nn.Module,
    example_inputs: tuple,
    *,
    soc: str = "SM8650",
    delegate_mutable_buffers: bool = True,
    fp16: bool = False,
):
    """Lowers to the QNN HTP backend; returns an ``ExecutorchProgramManager``.

    With ``delegate_mutable_buffers=True`` each KV cache lives inside the delegate
    (one address for its input and output, no top-level copy). Every mutable buffer
    starts each load from the model's initial contents, zeros included.
    """
    from qnn_mutbuf.sdk import activate_host_sdk
    from qnn_mutbuf.soc import resolve_soc

    resolve_soc(soc)  # an unknown name fails here, listing the known ones
    activate_host_sdk()
    (inputs,) = check_steps([example_inputs], what="example_inputs")
    graph_module = _as_graph_module(model_or_quantized, inputs, fp16)
    start = time.monotonic()
    program, report = lower_graph_module(
        graph_module,
        inputs,
        soc=soc.strip().upper(),
        fp16=fp16,
        delegate_mutable_buffers=delegate_mutable_buffers,
    )
    report.seconds = time.monotonic() - start
    program.qnn_mutbuf_report = report
    return program


def _as_graph_module(model: torch.nn.Module, inputs: tuple, fp16: bool) -> GraphModule:
    from qnn_mutbuf.passes.state_graph import functional_state_graph

    quantized = isinstance(model, GraphModule) and any(
        node.op == "call_function" and "quantize_per" in str(node.target)
        for node in model.graph.nodes
    )
    if quantized:
        if fp16:
            raise LoweringError(
                "fp16=True needs the floating-point model; this module is already quantized. "
                "Pass the original nn.Module, or drop fp16 to lower the quantized model."
            )
        return model
    if not fp16:
        raise LoweringError(
            "The model is not quantized. Run qnn_mutbuf.quantize(model, calibration) first, "
            "or pass fp16=True to run it in floating point on the HTP."
        )
    if not isinstance(model, GraphModule):
        model = export_for_quantization(model.eval(), inputs)
    return functional_state_graph(model)


def lower_graph_module(
    graph_module: GraphModule,
    inputs: tuple,
    *,
    soc: str,
    fp16: bool,
    delegate_mutable_buffers: bool,
):
    """Export -> QNN edge passes -> partition -> ExecuTorch program, buffer-aware."""
    import copy

    from executorch.backends.qualcomm._passes.qnn_pass_manager import get_qnn_pass_manager_cls
    from executorch.backends.qualcomm.serialization.qc_schema import QnnExecuTorchBackendType
    from executorch.backends.qualcomm.utils.qnn_manager_lifecycle import QnnManagerContext
    from executorch.backends.qualcomm.utils.utils import (
        get_qnn_context_binary_alignment,
        qnn_edge_config,
    )
    from executorch.exir import ExecutorchBackendConfig
    from executorch.exir.passes import MemoryPlanningPass
    from executorch.exir.program._program import to_edge_transform_and_lower

    import qnn_mutbuf.builders  # noqa: F401  (registers our QNN visitors)
    from qnn_mutbuf.partitioner import MutableBufferQnnPartitioner
    from qnn_mutbuf.passes.initial_state import (
        InsertInitialStateSelect,
        mark_initialized_buffers,
    )
    from qnn_mutbuf.passes.scalar_state import PromoteScalarBuffers
    from qnn_mutbuf.sdk.device import htp_compile_spec

    # A new module over a copy of the graph: passes below edit the graph and add
    # buffers, the caller's module (the fake-quant reference) stays as it was.
    # Parameters are shared, not deep-copied (non-leaf tensors cannot be).
    source = graph_module
    graph_module = GraphModule(source, copy.deepcopy(source.graph))
    graph_module.meta.update(source.meta)
    record = record_of(graph_module)
    if record is not None:
        # The program starts from the model's initial state, not from what
        # calibration left in the buffers of a convert_pt2e module (drop-in path).
        replace_buffers(graph_module, record.initial_state)
    PromoteScalarBuffers()(graph_module)
    mutable = find_mutable_buffers(graph_module)
    if delegate_mutable_buffers and mutable:
        initial = dict(record.initial_state) if record is not None else {}
        for name in initial:
            initial[name] = initial[name].reshape(graph_module.get_buffer(name).shape)
        graph_module = InsertInitialStateSelect(initial)(graph_module).graph_module

    compiler_specs = htp_compile_spec(soc, fp16=fp16)
    with stage("export for QNN"):
        exported = torch.export.export(graph_module, inputs, strict=True)
    pass_manager = get_qnn_pass_manager_cls(QnnExecuTorchBackendType.kHtpBackend)()
    exported = pass_manager.transform_for_export_pipeline(exported)
    transform_passes = pass_manager.get_to_edge_transform_passes(
        exported, compiler_specs=compiler_specs
    )
    partitioner = MutableBufferQnnPartitioner(
        compiler_specs,
        delegate_mutable_buffers=delegate_mutable_buffers,
        top_level_buffers=[STARTED_BUFFER],
    )
    with stage("partition and compile for HTP"), QnnManagerContext({"forward": compiler_specs}):
        edge = to_edge_transform_and_lower(
            {"forward": exported},
            transform_passes={"forward": transform_passes},
            partitioner={"forward": [partitioner]},
            compile_config=qnn_edge_config(),
        )
    top_level = mark_initialized_buffers(edge.exported_program())
    # Before to_executorch, which rewrites the edge program in place (out variants).
    report = _report(
        edge.exported_program(), soc, fp16, delegate_mutable_buffers, mutable, top_level
    )
    with stage("serialize"), warnings.catch_warnings():
        # ExecuTorch warns about every mutable buffer, marked or not; every top-level
        # one is marked above, so the warning would only mislead.
        warnings.filterwarnings("ignore", message="Mutation on a buffer in the model")
        program = edge.to_executorch(
            ExecutorchBackendConfig(
                memory_planning_pass=MemoryPlanningPass(
                    alloc_graph_input=True, alloc_graph_output=True
                ),
                segment_alignment=get_qnn_context_binary_alignment(),
            )
        )
    return program, report


def _report(program, soc, fp16, delegate, mutable, top_level) -> LoweringReport:
    on_htp = 0
    cpu_ops = []
    buffer_inputs = set(program.graph_signature.inputs_to_buffers)
    for node in program.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target == torch.ops.aten.copy_.default and node.args[0].name in buffer_inputs:
            continue  # ExecuTorch's write-back of a top-level buffer, not model compute
        if "executorch_call_delegate" in str(node.target):
            lowered = getattr(program.graph_module, node.args[0].target)
            on_htp += sum(1 for n in lowered.original_module.graph.nodes if n.op == "call_function")
        elif node.target.__name__ != "getitem":
            cpu_ops.append(str(node.target))
    model_buffers = [name for name in mutable if name != STARTED_BUFFER]
    return LoweringReport(
        soc=soc,
        fp16=fp16,
        delegate_mutable_buffers=delegate,
        seconds=0.0,
        nodes_on_htp=on_htp,
        nodes_on_cpu=len(cpu_ops),
        cpu_ops=sorted(set(cpu_ops)),
        delegated_buffers=[n for n in model_buffers if n not in top_level],
        top_level_buffers=[n for n in top_level if n != STARTED_BUFFER],
    )
