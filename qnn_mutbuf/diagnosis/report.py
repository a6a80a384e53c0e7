"""The numbers diagnose reports per step and node, the first divergence, and the
report as a table and as strict JSON (no Infinity or NaN: those become null)."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from qnn_mutbuf.artifacts import write_atomically
from qnn_mutbuf.diagnosis.probes import Probe
from qnn_mutbuf.verify import max_abs_error, sqnr_db


@dataclass
class NodeResult:
    """One probe at one step.

    `lsb` is max|HTP - fake-quant| in steps of the probe's encoding; `sqnr_db` is the
    HTP against fake-quant (how far the HTP departs), `sqnr_fp32_db` fake-quant
    against fp32 (what quantization alone costs; None without an fp32 counterpart).
    `local_lsb` is what the op adds on its own: the HTP against fake-quant fed with
    the HTP's values of everything it is computed from. `origin` marks a node that
    departs on its own (see :func:`mark_origins`).
    """

    probe: Probe
    on: str
    max_abs: float
    lsb: float
    local_lsb: float
    sqnr_db: float
    sqnr_fp32_db: float | None
    departs: bool
    departs_alone: bool
    slack: float
    origin: bool = False

    def as_dict(self) -> dict:
        entry = {
            "node": self.probe.node,
            "op": self.probe.op,
            "module": self.probe.module,
            "lsb": _finite(self.lsb),
            "local_lsb": _finite(self.local_lsb),
            "max_abs": _finite(self.max_abs),
            "sqnr_db": _finite(self.sqnr_db),
            "sqnr_fp32_db": _finite(self.sqnr_fp32_db),
            "on": self.on,
            "departs": self.departs,
            "origin": self.origin,
        }
        if self.probe.buffer is not None:
            entry["buffer"] = self.probe.buffer
        return entry


def compare_probe(
    probe: Probe,
    htp: torch.Tensor,
    fake_quant: torch.Tensor,
    fed_from_htp: torch.Tensor,
    fp32: torch.Tensor | None,
    on: str,
    threshold: float,
) -> NodeResult:
    actual = htp.detach().double().reshape(fake_quant.shape)
    error = max_abs_error(fake_quant, actual) if actual.numel() else 0.0
    lsb = error / probe.scale
    local = fed_from_htp.reshape(fake_quant.shape)
    local_error = max_abs_error(local, actual) if actual.numel() else 0.0
    magnitude = float(fake_quant.abs().max()) if fake_quant.numel() else 0.0
    slack = FLOAT_SLACK * max(1.0, magnitude)
    limit = threshold * probe.scale * (1 + 1e-3) + slack
    quantization_loss = None
    if fp32 is not None and fp32.shape == fake_quant.shape and fp32.is_floating_point():
        quantization_loss = sqnr_db(fp32, fake_quant)
    return NodeResult(
        probe=probe,
        on=on,
        max_abs=error,
        lsb=lsb,
        local_lsb=local_error / probe.scale,
        sqnr_db=sqnr_db(fake_quant, actual),
        sqnr_fp32_db=quantization_loss,
        departs=not error <= limit,  # NaN departs
        departs_alone=not local_error <= limit,
        slack=slack,
    )


FLOAT_SLACK = 1e-6
"""Relative float32 noise of dequantized values (4 steps of 7e-5 near 4.0 read as
4.0016 steps); the same slack as the correctness bars in tests/bar.py."""


@dataclass
class StepResult:
    step: int
    nodes: list[NodeResult]

    def as_dict(self) -> dict:
        return {"step": self.step, "nodes": [node.as_dict() for node in self.nodes]}


@dataclass(frozen=True)
class Divergence:
    """Where the HTP first departs: the step, and the node that departs there while
    every value it is computed from is still within the threshold."""

    step: int
    node: str
    op: str
    module: str
    lsb: float

    def as_dict(self) -> dict:
        return {
            "step": self.step,
            "node": self.node,
            "op": self.op,
            "module": self.module,
            "lsb": _finite(self.lsb),
        }


def mark_origins(steps: list[StepResult], threshold: float) -> Divergence | None:
    """Marks every node that departs on its own; returns the earliest by (step, position).

    A departing node is an origin when every value it is computed from is within
    `threshold` steps of the finer of its encoding and the node's (a relu after a
    linear has half the linear's step: the linear's normal rounding is twice as
    many of the relu's steps, and the relu only passes it on), or when it adds more
    than `threshold` steps on its own (`local_lsb`). A node's inputs are the probes
    it is computed from in the same step; a state read's is the previous step's
    write (none at step 0: the initial state).
    """
    first = None
    previous: dict[str, NodeResult] = {}
    for step in steps:
        current = {result.probe.node: result for result in step.nodes}
        for result in step.nodes:
            inputs = [current[name] for name in result.probe.inputs if name in current]
            carried = previous.get(result.probe.carried_from or "")
            if carried is not None:
                inputs.append(carried)
            inherited = any(not _within(value, result, threshold) for value in inputs)
            result.origin = result.departs and (not inherited or result.departs_alone)
        origins = [result for result in step.nodes if result.origin]
        if first is None and origins:
            earliest = min(origins, key=lambda result: result.probe.position)
            first = Divergence(
                step.step,
                earliest.probe.node,
                earliest.probe.op,
                earliest.probe.module,
                earliest.lsb,
            )
        previous = current
    return first


def _within(value: NodeResult, user: NodeResult, threshold: float) -> bool:
    """Within `threshold` steps of the finer of the two encodings."""
    if value.probe.scale <= user.probe.scale:
        return not value.departs
    return value.max_abs <= threshold * user.probe.scale * (1 + 1e-3) + value.slack


@dataclass
class Diagnosis:
    """What `qnn_mutbuf.diagnose` found. `as_dict` is the JSON report."""

    quant: str | None
    soc: str
    threshold: float
    steps: list[StepResult]
    first_divergence: Divergence | None
    seconds: float = 0.0
    debug_cpu_ops: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {
            "quant": self.quant,
            "soc": self.soc,
            "threshold": self.threshold,
            "first_divergence": (
                self.first_divergence.as_dict() if self.first_divergence else None
            ),
            "steps": [step.as_dict() for step in self.steps],
        }

    def write_json(self, path: str | os.PathLike) -> Path:
        text = json.dumps(self.as_dict(), indent=2, allow_nan=False)
        return write_atomically(path, text + "\n")

    def node(self, name: str, step: int) -> NodeResult:
        """The result of node `name` at `step`."""
        return next(r for r in self.steps[step].nodes if r.probe.node == name)

    def format(self, worst: int = 10) -> str:
        """A short table: the worst nodes over all steps, then the first divergence."""
        nodes = self.steps[0].nodes if self.steps else []
        on_htp = sum(1 for result in nodes if result.on == "htp")
        lines = [
            f"diagnose: {self.quant or 'quantized'} on {self.soc}, {len(self.steps)} steps x "
            f"{len(nodes)} nodes ({on_htp} on the HTP), threshold {self.threshold:g} steps "
            f"of each node's encoding ({self.seconds:.0f} s)",
            "lsb: max|HTP - fake-quant| in steps of the node's encoding; own: what the op adds "
            "when fed the HTP's inputs",
        ]
        if self.debug_cpu_ops:
            lines.append(f"  CPU ops in the debug program: {', '.join(self.debug_cpu_ops)}")
        rows = _worst_per_node(self.steps)[:worst]
        if rows:
            width = max(len(row.probe.node) for _, row in rows)
            op_width = max(len(row.probe.op) for _, row in rows)
            lines.append(
                f"{'lsb':>9} {'own':>8}  step  {'node':<{width}}  {'op':<{op_width}}  "
                "vs fake-quant  fake-quant vs fp32  module"
            )
            for step, row in rows:
                lines.append(
                    f"{_number(row.lsb):>9} {_number(row.local_lsb):>8}  {step:>4}  "
                    f"{row.probe.node:<{width}}  {row.probe.op:<{op_width}}  "
                    f"{_db(row.sqnr_db):>13}  {_db(row.sqnr_fp32_db):>18}  "
                    f"{row.probe.module or '(root)'}"
                )
        first = self.first_divergence
        departing = {r.probe.node for step in self.steps for r in step.nodes if r.departs}
        if first is not None:
            lines.append(
                f"first divergence: step {first.step}, {first.node} ({first.op}) in "
                f"{first.module or '(root)'}: {_number(first.lsb)} steps of its encoding off "
                "fake-quant"
            )
        elif departing:
            lines.append(
                f"no divergence: {len(departing)} node(s) exceed {self.threshold:g} steps only "
                "through their inputs (an encoding finer than its inputs'), none on its own"
            )
        else:
            lines.append(
                f"no divergence: every node is within {self.threshold:g} steps of its "
                "encoding of fake-quant at every step"
            )
        return "\n".join(lines)


def _worst_per_node(steps: list[StepResult]) -> list[tuple[int, NodeResult]]:
    """(step, result) of each node's largest error, largest first (NaN first)."""
    worst: dict[str, tuple[int, NodeResult]] = {}
    for step in steps:
        for result in step.nodes:
            kept = worst.get(result.probe.node)
            if kept is None or _rank(result.lsb) > _rank(kept[1].lsb):
                worst[result.probe.node] = (step.step, result)
    return sorted(worst.values(), key=lambda pair: -_rank(pair[1].lsb))


def _rank(value: float) -> float:
    return math.inf if math.isnan(value) else value


def _finite(value: float | None) -> float | None:
    if value is None or not math.isfinite(value):
        return None
    return float(value)


def _number(value: float) -> str:
    return f"{value:.2f}" if math.isfinite(value) else str(value)


def _db(value: float | None) -> str:
    if value is None:
        return "-"
    if math.isinf(value) and value > 0:
        return "identical"
    return f"{value:.1f} dB"
