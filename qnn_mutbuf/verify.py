"""Per-step comparison of device (or simulator) outputs against references.

A stateful model is only right if it is right at every step, so every comparison
here is a table with one row per decode step: max abs error, the same error in
quantization steps of the output encoding, and SQNR in dB.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import torch


def sqnr_db(reference: torch.Tensor, actual: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio of `actual` against `reference`, in dB."""
    reference = reference.detach().double().flatten()
    noise = actual.detach().double().flatten() - reference
    noise_power = float((noise**2).sum())
    signal_power = float((reference**2).sum())
    if noise_power == 0.0:
        return math.inf
    if signal_power == 0.0:
        return -math.inf
    return 10.0 * math.log10(signal_power / noise_power)


def max_abs_error(reference: torch.Tensor, actual: torch.Tensor) -> float:
    if reference.numel() == 0:
        return 0.0
    return float((actual.detach().double() - reference.detach().double()).abs().max())


class EagerRunner:
    """Runs a PyTorch module step by step from a fresh copy of its state."""

    def __init__(self, module: torch.nn.Module) -> None:
        self._original = module
        self.reset()

    def reset(self) -> None:
        from qnn_mutbuf.records import reset_state

        # A convert_pt2e module holds what calibration left in its buffers; the
        # reference starts, like every lowered program, from the initial state.
        self.module = reset_state(copy.deepcopy(self._original))

    def step(self, *inputs: torch.Tensor) -> list[torch.Tensor]:
        with torch.no_grad():
            outputs = self.module(*inputs)
        if isinstance(outputs, torch.Tensor):
            outputs = (outputs,)
        return [out.detach().clone() for out in _flatten(outputs)]

    def run(self, steps: Sequence[Sequence[torch.Tensor]]) -> list[list[torch.Tensor]]:
        return [self.step(*inputs) for inputs in steps]


def _flatten(value: object) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [item for part in value for item in _flatten(part)]
    if isinstance(value, dict):
        return [item for part in value.values() for item in _flatten(part)]
    return []


@dataclass
class StepComparison:
    """One step, one output, against one reference."""

    step: int
    output: int
    max_abs_error: float
    sqnr_db: float
    steps_of_encoding: float | None = None


@dataclass
class ComparisonTable:
    """Rows of :class:`StepComparison` for one reference."""

    reference: str
    rows: list[StepComparison] = field(default_factory=list)

    def worst_error(self, output: int | None = None) -> float:
        rows = [r for r in self.rows if output is None or r.output == output]
        return max((r.max_abs_error for r in rows), default=0.0)

    def worst_steps(self, output: int | None = None) -> float:
        rows = [
            r for r in self.rows if (output is None or r.output == output) and r.steps_of_encoding
        ]
        return max((r.steps_of_encoding for r in rows), default=0.0)

    def min_sqnr(self, output: int | None = None) -> float:
        rows = [r for r in self.rows if output is None or r.output == output]
        return min((r.sqnr_db for r in rows), default=math.inf)

    def as_dict(self) -> dict:
        return {"reference": self.reference, "rows": [asdict(r) for r in self.rows]}


@dataclass(frozen=True)
class GateMiss:
    """One row of a table that missed a limit: which step and output, what was measured.

    `value` is None when the row has no number to check (an output without an
    encoding has no steps of encoding): a limit that cannot be checked is missed.
    """

    step: int
    output: int
    reference: str
    value: float | None


def sqnr_misses(table: ComparisonTable, min_sqnr_db: float) -> list[GateMiss]:
    """Rows whose SQNR is below `min_sqnr_db` (NaN misses: a NaN output is not good)."""
    return [
        GateMiss(row.step, row.output, table.reference, row.sqnr_db)
        for row in table.rows
        if not row.sqnr_db >= min_sqnr_db
    ]


def steps_off_misses(table: ComparisonTable, max_steps_off: float) -> list[GateMiss]:
    """Rows more than `max_steps_off` steps of the output encoding away (or without one)."""
    return [
        GateMiss(row.step, row.output, table.reference, row.steps_of_encoding)
        for row in table.rows
        if row.steps_of_encoding is None or not row.steps_of_encoding <= max_steps_off
    ]


def compare_steps(
    reference_name: str,
    reference: Sequence[Sequence[torch.Tensor]],
    actual: Sequence[Sequence[torch.Tensor]],
    output_scales: Sequence[float | None] | None = None,
) -> ComparisonTable:
    """Compares two per-step output lists; `output_scales` converts errors to steps."""
    if len(reference) != len(actual):
        raise ValueError(f"{len(reference)} reference steps but {len(actual)} actual steps.")
    table = ComparisonTable(reference_name)
    for step, (expected_outputs, actual_outputs) in enumerate(zip(reference, actual, strict=True)):
        if len(expected_outputs) != len(actual_outputs):
            raise ValueError(
                f"step {step}: {len(expected_outputs)} reference outputs but "
                f"{len(actual_outputs)} actual outputs."
            )
        for index, (expected, got) in enumerate(zip(expected_outputs, actual_outputs, strict=True)):
            expected = expected.to(torch.float64) if expected.is_floating_point() else expected
            got = got.to(expected.dtype).reshape(expected.shape)
            error = max_abs_error(expected, got)
            scale = output_scales[index] if output_scales and index < len(output_scales) else None
            table.rows.append(
                StepComparison(
                    step=step,
                    output=index,
                    max_abs_error=error,
                    sqnr_db=sqnr_db(expected, got),
                    steps_of_encoding=error / scale if scale else None,
                )
            )
    return table


def output_scales(quantized: torch.fx.GraphModule) -> list[float | None]:
    """Scale of each output's encoding in a converted PT2E module (None if float)."""
    output = next(n for n in quantized.graph.nodes if n.op == "output")
    scales: list[float | None] = []
    for value in _flatten_nodes(output.args[0]):
        if (
            isinstance(value, torch.fx.Node)
            and "dequantize_per_tensor" in str(value.target)
            and isinstance(value.args[1], float)
        ):
            scales.append(float(value.args[1]))
        else:
            scales.append(None)
    return scales


def _flatten_nodes(value: object) -> list[object]:
    if isinstance(value, (list, tuple)):
        return [item for part in value for item in _flatten_nodes(part)]
    return [value]


def format_table(tables: Sequence[ComparisonTable], output: int = 0) -> str:
    """A per-step text table: one column group per reference."""
    header = "step"
    for table in tables:
        header += f" | max|err| vs {table.reference:<12} | SQNR dB"
    lines = [header, "-" * len(header)]
    steps = sorted({row.step for table in tables for row in table.rows})
    for step in steps:
        line = f"{step:>4}"
        for table in tables:
            row = next((r for r in table.rows if r.step == step and r.output == output), None)
            if row is None:
                line += " | " + " " * 24 + " | " + " " * 7
                continue
            units = f" ({row.steps_of_encoding:.2f} q)" if row.steps_of_encoding is not None else ""
            line += f" | {row.max_abs_error:>9.3g}{units:<15} | {row.sqnr_db:7.1f}"
        lines.append(line)
    return "\n".join(lines)


def top1_agreement(reference: torch.Tensor, actual: torch.Tensor) -> float:
    """Fraction of positions where the arg-max token (last dim) is the same."""
    return float((reference.argmax(-1) == actual.argmax(-1)).double().mean())


@dataclass
class DecodeRow:
    """One decode step of a language model, against fp32 and fake-quant."""

    step: int
    sqnr_fp32_db: float
    sqnr_fake_quant_db: float
    top1_fp32: float
    top1_fake_quant: float


def decode_table(
    fp32: Sequence[Sequence[torch.Tensor]],
    fake_quant: Sequence[Sequence[torch.Tensor]] | None,
    device: Sequence[Sequence[torch.Tensor]],
    logits_output: int = 0,
) -> list[DecodeRow]:
    """Logits SQNR and top-1 agreement per step (fake-quant columns NaN if absent)."""
    rows = []
    for step, actual in enumerate(device):
        logits = actual[logits_output]
        reference = fp32[step][logits_output]
        fq = fake_quant[step][logits_output] if fake_quant is not None else None
        rows.append(
            DecodeRow(
                step=step,
                sqnr_fp32_db=sqnr_db(reference, logits),
                sqnr_fake_quant_db=sqnr_db(fq, logits) if fq is not None else math.nan,
                top1_fp32=top1_agreement(reference, logits),
                top1_fake_quant=top1_agreement(fq, logits) if fq is not None else math.nan,
            )
        )
    return rows


def format_decode_table(rows: Sequence[DecodeRow]) -> str:
    lines = [
        "step | logits SQNR vs fp32 dB | vs fake-quant dB | top-1 = fp32 | top-1 = fake-quant",
        "-----|------------------------|------------------|--------------|-------------------",
    ]
    for row in rows:
        lines.append(
            f"{row.step:>4} | {row.sqnr_fp32_db:22.1f} | {row.sqnr_fake_quant_db:16.1f} | "
            f"{row.top1_fp32:12.2f} | {row.top1_fake_quant:18.2f}"
        )
    if rows:
        lines.append(
            f"min  | {min(r.sqnr_fp32_db for r in rows):22.1f} | "
            f"{min(r.sqnr_fake_quant_db for r in rows):16.1f} | "
            f"{sum(r.top1_fp32 for r in rows) / len(rows):12.2f} | "
            f"{sum(r.top1_fake_quant for r in rows) / len(rows):18.2f}"
        )
    return "\n".join(lines)
