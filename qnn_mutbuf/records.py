"""What quantization hands to lowering: the record kept on the quantized module.

The record travels with the module because that is the only object the drop-in
PT2E path (``prepare_pt2e`` -> calibrate -> ``convert_pt2e`` -> ``lower``) hands on;
prepare_pt2e and convert_pt2e both carry ``GraphModule.meta`` over. The quantizer
writes it before calibration (so the initial state is the model's, not what
calibration leaves behind) and quantize() completes it after conversion.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.fx import GraphModule

RECORD_KEY = "qnn_mutbuf"


@dataclass
class StateEncodingRecord:
    """Scale, zero point and integer range of one buffer's state encoding."""

    scale: float
    zero_point: int
    quant_min: int
    quant_max: int
    dtype: str


@dataclass
class QuantizationRecord:
    """The mutable buffers of a quantized module and the state every load starts from.

    ``quant`` is None when the module came through the drop-in path, where the
    user's quantizer configuration, not a scheme name, decided the encodings.
    """

    quant: str | None
    mutable_buffers: dict[str, tuple[list[int], str]] = field(default_factory=dict)
    state_encodings: dict[str, StateEncodingRecord] = field(default_factory=dict)
    initial_state: dict[str, torch.Tensor] = field(default_factory=dict)
    calibration_steps: int = 0


def record_of(module: torch.nn.Module) -> QuantizationRecord | None:
    meta = getattr(module, "meta", None)
    record = meta.get(RECORD_KEY) if isinstance(meta, dict) else None
    return record if isinstance(record, QuantizationRecord) else None


def record_initial_state(graph_module: GraphModule, names: list[str]) -> QuantizationRecord:
    """Snapshots the named buffers as the state every run and every load starts from."""
    record = record_of(graph_module) or QuantizationRecord(quant=None)
    for name in names:
        value = graph_module.get_buffer(name).detach()
        record.initial_state[name] = value.clone()
        record.mutable_buffers[name] = (list(value.shape), str(value.dtype).removeprefix("torch."))
    graph_module.meta[RECORD_KEY] = record
    return record


def replace_buffers(graph_module: GraphModule, values: dict[str, torch.Tensor]) -> None:
    """Registers a copy of each value in place of the named buffer (reshaped to it),
    so that `graph_module` stops sharing that tensor with any other module."""
    for name, value in values.items():
        try:
            current = graph_module.get_buffer(name)
        except AttributeError:
            continue
        owner_path, _, attribute = name.rpartition(".")
        owner = graph_module.get_submodule(owner_path) if owner_path else graph_module
        owner.register_buffer(attribute, value.detach().clone().reshape(current.shape))


def reset_state(module: torch.nn.Module) -> torch.nn.Module:
    """Puts a quantized module's mutable buffers back to their initial contents.

    ``convert_pt2e`` returns a module whose buffers hold what calibration left in
    them; call this on it before using it as the fake-quant reference. Returns the
    module (changed in place).
    """
    record = record_of(module)
    if record is None:
        return module
    with torch.no_grad():
        for name, initial in record.initial_state.items():
            try:
                buffer = module.get_buffer(name)
            except AttributeError:
                continue
            buffer.copy_(initial.reshape(buffer.shape))
    return module
