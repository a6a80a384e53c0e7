"""Finding the first op and step where the HTP departs from the CPU.

:func:`diagnose` lowers a debug copy of the quantized model in which every quantized
value is also a graph output, runs it on the host simulator step by step with the
state carried, and compares each value with the fake-quant module's (and fake-quant
with fp32) at the same node. The earliest node that departs while its inputs do not
is the first divergence. The package is ``diagnosis`` because a submodule named
``diagnose`` would replace the function ``qnn_mutbuf.diagnose`` once imported.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import torch
from torch.fx import GraphModule

from qnn_mutbuf.diagnosis.report import Diagnosis, Divergence, NodeResult, StepResult
from qnn_mutbuf.errors import DeviceError, InputError, QnnMutbufError

__all__ = ["DEFAULT_THRESHOLD", "Diagnosis", "Divergence", "NodeResult", "StepResult", "diagnose"]

DEFAULT_THRESHOLD = 4.0
"""Steps of a node's output encoding; rounding differences stay at one or two."""


def diagnose(
    model: torch.nn.Module,
    steps: Sequence[tuple],
    *,
    calibration: Sequence[tuple] | None = None,
    quant: str | None = None,
    fp32_model: torch.nn.Module | None = None,
    soc: str = "SM8650",
    threshold: float = DEFAULT_THRESHOLD,
    delegate_mutable_buffers: bool = True,
) -> Diagnosis:
    """Names the first op and step where the HTP departs from fake-quant.

    `model` is the fp32 module (quantized here with `calibration` and `quant`,
    default 8a8w) or a converted PT2E module (then `fp32_model`, if given, supplies
    the fp32 values). `steps` run in order from the initial state. A node departs
    when it is more than `threshold` steps of its output encoding off fake-quant.
    The program you ship is not changed.
    """
    from qnn_mutbuf.diagnosis.probes import (
        ProbeKind,
        find_probes,
        with_probe_outputs,
        with_state_reads_quantized,
    )
    from qnn_mutbuf.diagnosis.program import lower_debug_program, probe_locations
    from qnn_mutbuf.diagnosis.references import FakeQuantReference, Fp32Reference
    from qnn_mutbuf.diagnosis.report import compare_probe, mark_origins
    from qnn_mutbuf.lowering import check_steps
    from qnn_mutbuf.progress import progress
    from qnn_mutbuf.runners.host import HostRunner

    start = time.monotonic()
    steps = check_steps(steps, what="steps")
    if not (isinstance(threshold, (int, float)) and math.isfinite(threshold) and threshold >= 0):
        raise InputError(f"threshold must be a finite number of steps >= 0, got {threshold!r}.")
    quantized, fp32_model, quant = _quantized(model, calibration, quant, fp32_model)
    quantized = with_state_reads_quantized(quantized)
    delegated = delegate_mutable_buffers
    probes = _observable(find_probes(quantized), delegated)
    if not probes:
        raise InputError("The model has no quantized values to compare: nothing to diagnose.")
    debug, emitted = with_probe_outputs(quantized, probes, delegated_state=delegated)
    program = lower_debug_program(debug, steps[0], soc=soc, delegate_mutable_buffers=delegated)
    locations = dict(zip(emitted, probe_locations(program, len(emitted)), strict=True))
    fake_quant = FakeQuantReference(quantized, probes)
    fp32 = (
        Fp32Reference(fp32_model, steps[0], quantized, probes) if fp32_model is not None else None
    )
    reads = {p.buffer: p.quantize for p in probes if p.kind is ProbeKind.STATE_READ}
    writes = {p.buffer: p.quantize for p in probes if p.kind is ProbeKind.STATE_WRITE}
    # The state between steps as the HTP left it (the initial state before step 0).
    stored = {name: fake_quant.module.get_buffer(name).detach().clone() for name in reads}

    def run_step(runner: HostRunner, index: int, inputs: tuple) -> dict[str, torch.Tensor]:
        try:
            outputs = runner.step(*inputs)
        except QnnMutbufError:
            raise
        except Exception as error:
            raise DeviceError(
                f"The debug program failed on the host simulator at step {index}: {error}"
            ) from error
        first = len(outputs) - len(emitted)
        return {name: outputs[first + position] for position, name in enumerate(emitted)}

    results = []
    with HostRunner(program.buffer) as runner:
        # One step ahead: a delegated buffer's written value is what the next step
        # reads, and a last step with the last inputs again reads the final state.
        ahead = run_step(runner, 0, steps[0])
        for index, inputs in enumerate(progress(steps, description="diagnose steps")):
            following = steps[min(index + 1, len(steps) - 1)]
            observed, ahead = ahead, run_step(runner, index + 1, following)
            on = {name: locations[name] for name in observed}
            carried = {}
            for buffer, read in reads.items():
                carried[read] = _in_encoding(stored[buffer], fake_quant.encodings[read])
                if not delegated:
                    # A top-level buffer is a float tensor the delegate quantizes on the
                    # way in, which cannot be observed apart from its consumers (see
                    # README): the read is the stored value in the read encoding.
                    observed[read], on[read] = carried[read], "cpu"
                elif buffer in writes:
                    observed[writes[buffer]], on[writes[buffer]] = ahead[read], on[read]
            state = {buffer: observed[read] for buffer, read in reads.items()}
            expected, fed = fake_quant.step(inputs, observed, state)
            fp32_values = fp32.step(inputs) if fp32 is not None else {}
            nodes = [
                compare_probe(
                    probe,
                    observed[probe.quantize],
                    expected[probe.quantize],
                    carried.get(probe.quantize, fed[probe.quantize]),
                    fp32_values.get(probe.node),
                    on[probe.quantize],
                    threshold,
                )
                for probe in probes
            ]
            for buffer, write in writes.items():
                if buffer in stored:
                    stored[buffer] = observed[write].reshape(stored[buffer].shape)
            results.append(StepResult(index, nodes))
    lowering = program.qnn_mutbuf_report
    return Diagnosis(
        quant=quant,
        soc=lowering.soc,
        threshold=float(threshold),
        steps=results,
        first_divergence=mark_origins(results, threshold),
        seconds=time.monotonic() - start,
        debug_cpu_ops=lowering.cpu_ops,
    )


def _observable(probes: list, delegated: bool) -> list:
    """Drops the state probes that cannot be observed: with delegated state a write
    is seen through the buffer's read, at top level a read through its write."""
    from qnn_mutbuf.diagnosis.probes import ProbeKind

    read = {p.buffer for p in probes if p.kind is ProbeKind.STATE_READ}
    written = {p.buffer for p in probes if p.kind is ProbeKind.STATE_WRITE}
    if delegated:
        unseen = {
            p.quantize for p in probes if p.kind is ProbeKind.STATE_WRITE and p.buffer not in read
        }
        return [p for p in probes if p.quantize not in unseen]
    unseen_reads = read - written
    return [p for p in probes if not (p.kind is ProbeKind.STATE_READ and p.buffer in unseen_reads)]


def _quantized(model, calibration, quant, fp32_model):
    """(converted module, fp32 module or None, quant name) for `model`."""
    from qnn_mutbuf.lowering import quant_dtype, quantize
    from qnn_mutbuf.records import record_of

    if quant is not None:
        quant_dtype(quant)  # an unknown name fails here, listing the known ones
    if _is_quantized(model):
        record = record_of(model)
        recorded = record.quant if record is not None else None
        if quant is not None and recorded is not None and quant != recorded:
            raise InputError(
                f"quant={quant!r}, but the module was quantized with {recorded!r}; drop "
                "quant= or pass the fp32 model with calibration steps."
            )
        return model, fp32_model, quant or recorded
    if calibration is None:
        raise InputError(
            "diagnose needs calibration steps to quantize an fp32 model: pass calibration=, "
            "or a module returned by qnn_mutbuf.quantize."
        )
    quant = quant or "8a8w"
    return quantize(model, list(calibration), quant=quant), fp32_model or model, quant


def _is_quantized(model: torch.nn.Module) -> bool:
    return isinstance(model, GraphModule) and any(
        node.op == "call_function" and "quantize_per" in str(node.target)
        for node in model.graph.nodes
    )


def _in_encoding(value: torch.Tensor, encoding: tuple) -> torch.Tensor:
    from qnn_mutbuf.diagnosis.probes import qdq_ops

    quantize, dequantize = qdq_ops()
    return dequantize(quantize(value.float(), *encoding), *encoding)
