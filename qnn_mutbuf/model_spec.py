"""Loads a MODEL spec: ``package.module:factory`` or ``path/to/file.py:factory``.

The factory returns ``(module, calibration_steps, example_inputs)``, where
``calibration_steps`` is a list of per-step input tuples.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from qnn_mutbuf.errors import InputError
from qnn_mutbuf.lowering import check_steps


@dataclass
class LoadedModel:
    spec: str
    module: torch.nn.Module
    calibration: list[tuple[torch.Tensor, ...]]
    example_inputs: tuple[torch.Tensor, ...]


def load_model(spec: str, calibration_steps: int | None = None) -> LoadedModel:
    """Imports the factory named by `spec`, calls it and checks what it returns."""
    if ":" not in spec:
        raise InputError(
            f"MODEL {spec!r} must be 'package.module:factory' or 'path/to/file.py:factory'."
        )
    location, _, name = spec.rpartition(":")
    if location.endswith(".py") or "/" in location:
        path = Path(location)
        if not path.is_file():
            raise InputError(f"MODEL file {path} does not exist.")
        module_name = f"_qnn_mutbuf_model_{abs(hash(path.resolve()))}"
        loader_spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules[module_name] = module
        loader_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(location)
        except ImportError as error:
            raise InputError(f"Cannot import {location!r} for MODEL {spec!r}: {error}") from error
    factory = getattr(module, name, None)
    if not callable(factory):
        raise InputError(f"MODEL {spec!r}: {location} has no callable {name!r}.")
    produced = factory()
    if not isinstance(produced, (tuple, list)) or len(produced) != 3:
        raise InputError(
            f"MODEL factory {spec!r} must return (module, calibration_steps, example_inputs)."
        )
    model, calibration, example = produced
    if not isinstance(model, torch.nn.Module):
        raise InputError(f"MODEL factory {spec!r} returned {type(model).__name__}, not a Module.")
    calibration = check_steps(calibration)
    if calibration_steps is not None:
        if calibration_steps < 1:
            raise InputError("--calibration-steps must be at least 1.")
        calibration = calibration[:calibration_steps]
    example = check_steps([example], what="example_inputs")[0]
    return LoadedModel(spec, model, calibration, example)
