"""Runs a `.pte` on this machine: QNN delegates execute in the HTP host simulator.

State held in mutable buffers persists between :meth:`HostRunner.step` calls exactly
as it does on a phone, because the same ExecuTorch method instance runs every step.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Sequence

import torch

from qnn_mutbuf.program_io import ProgramIO, check_step_inputs, load_pte_bytes, read_program_io
from qnn_mutbuf.sdk import activate_host_sdk


class HostRunner:
    """Executes the ``forward`` method of a program step by step on the host.

    Args:
        pte: path to a `.pte` file, or its bytes.
        method: the method to run.
    """

    def __init__(self, pte: str | os.PathLike | bytes, method: str = "forward") -> None:
        self._data = load_pte_bytes(pte)
        self.io: ProgramIO = read_program_io(self._data, method)
        self.method_name = method
        self.steps_run = 0
        activate_host_sdk()
        self._program = None
        self._method = None
        self._load()

    def _load(self) -> None:
        from executorch.runtime import Runtime

        # A QNN delegate handle dies with its method; releasing the previous program
        # first keeps two live handles from sharing (and deleting) one QNN context.
        self._method = None
        self._program = None
        gc.collect()
        self._program = Runtime.get().load_program(self._data)
        self._method = self._program.load_method(self.method_name)
        self.steps_run = 0

    def step(self, *inputs: torch.Tensor) -> list[torch.Tensor]:
        """Runs one step; returns the outputs as independent tensors."""
        checked = check_step_inputs(self.io.inputs, inputs, self.steps_run)
        outputs = self._method.execute(checked)
        self.steps_run += 1
        return [out.clone() if isinstance(out, torch.Tensor) else out for out in outputs]

    def reset(self) -> None:
        """Restores the initial state by loading the method again."""
        self._load()

    def run(self, steps: Sequence[Sequence[torch.Tensor]]) -> list[list[torch.Tensor]]:
        """Runs `steps` in order from the current state; one output list per step."""
        from qnn_mutbuf.progress import progress

        results = []
        for inputs in progress(steps, description="host steps"):
            results.append(self.step(*inputs))
        return results

    def close(self) -> None:
        self._method = None
        self._program = None
        gc.collect()

    def __enter__(self) -> HostRunner:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
