"""What a `.pte` expects and returns, read from the file without loading it.

Every runner checks inputs against these specs before anything runs, and the adb
and AI Hub runners decode raw outputs with them. Reading the flatbuffer needs no
QNN library, so this also works on a host without the simulator.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from qnn_mutbuf.errors import InputError

SCALAR_TYPE_TO_DTYPE = {
    0: torch.uint8,
    1: torch.int8,
    2: torch.int16,
    3: torch.int32,
    4: torch.int64,
    5: torch.float16,
    6: torch.float32,
    7: torch.float64,
    11: torch.bool,
    15: torch.bfloat16,
    27: torch.uint16,
    28: torch.uint32,
    29: torch.uint64,
}


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of one program input or output."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count * torch.empty((), dtype=self.dtype).element_size()

    def describe(self) -> str:
        return f"{str(self.dtype).removeprefix('torch.')}{list(self.shape)}"


@dataclass(frozen=True)
class ConstantSpec:
    """A non-tensor program input: torch.export specialised it to this value."""

    value: object

    def describe(self) -> str:
        return f"{type(self.value).__name__} {self.value!r}"


InputSpec = TensorSpec | ConstantSpec


@dataclass(frozen=True)
class ProgramIO:
    """Inputs and outputs of one method of a program, and the CPU kernels it calls
    outside its delegates (``aten::copy_`` is ExecuTorch's buffer write-back)."""

    method: str
    inputs: tuple[InputSpec, ...]
    outputs: tuple[TensorSpec, ...]
    cpu_operators: tuple[str, ...] = ()

    @property
    def tensor_inputs(self) -> tuple[TensorSpec, ...]:
        return tuple(spec for spec in self.inputs if isinstance(spec, TensorSpec))

    @property
    def cpu_compute(self) -> tuple[str, ...]:
        return tuple(op for op in self.cpu_operators if op != "aten::copy_")


def load_pte_bytes(pte: str | os.PathLike | bytes | bytearray) -> bytes:
    """Accepts a path or the bytes of a `.pte`; names the file when it is unusable."""
    if isinstance(pte, (bytes, bytearray, memoryview)):
        data = bytes(pte)
        origin = "the given bytes"
    else:
        path = Path(pte)
        if not path.is_file():
            raise InputError(f"No such .pte file: {path}")
        data = path.read_bytes()
        origin = str(path)
    # ExecuTorch programs carry the flatbuffer identifier "ET" + 2 digits at byte 4.
    if len(data) < 8 or data[4:6] != b"ET":
        raise InputError(f"{origin} is not an ExecuTorch program (.pte): bad header.")
    return data


def read_program_io(pte: str | os.PathLike | bytes, method: str = "forward") -> ProgramIO:
    from executorch.exir._serialize._program import deserialize_pte_binary

    program = deserialize_pte_binary(load_pte_bytes(pte)).program
    plans = {plan.name: plan for plan in program.execution_plan}
    if method not in plans:
        raise InputError(f"The program has no method {method!r}; it has {sorted(plans)}.")
    plan = plans[method]

    def input_spec(index: int) -> InputSpec:
        value = plan.values[index].val
        if hasattr(value, "sizes"):
            return spec(index)
        # Int, Bool, Double, String or Null: a constant leaf of the inputs.
        for attribute in ("int_val", "bool_val", "double_val", "string_val"):
            if hasattr(value, attribute):
                return ConstantSpec(getattr(value, attribute))
        return ConstantSpec(None)

    def spec(index: int) -> TensorSpec:
        value = plan.values[index].val
        if not hasattr(value, "sizes"):
            raise InputError(f"Value {index} of {method} is not a tensor ({type(value).__name__}).")
        dtype = SCALAR_TYPE_TO_DTYPE.get(int(value.scalar_type))
        if dtype is None:
            raise InputError(
                f"Value {index} of {method} has unsupported dtype {value.scalar_type}."
            )
        return TensorSpec(tuple(int(s) for s in value.sizes), dtype)

    operators = tuple(
        f"{op.name}.{op.overload}" if op.overload else op.name for op in plan.operators
    )
    return ProgramIO(
        method=method,
        inputs=tuple(input_spec(i) for i in plan.inputs),
        outputs=tuple(spec(i) for i in plan.outputs),
        cpu_operators=operators,
    )


def flatten_step(inputs: object) -> list[tuple[str, object]]:
    """The leaves of one step's (possibly nested) inputs, each with its path, in the
    order torch.export flattens them: ``input[0]['input_pos']``."""
    from torch.utils import _pytree as pytree

    if isinstance(inputs, list):
        inputs = tuple(inputs)
    leaves, _ = pytree.tree_flatten_with_path(inputs)
    return [(f"input{pytree.keystr(path)}", value) for path, value in leaves]


def check_step_inputs(
    specs: Sequence[InputSpec], inputs: Sequence[object], step: int | None = None
) -> list[object]:
    """The program's flat inputs from one step's nested inputs.

    Raises one InputError naming the step and the leaf that does not fit.
    """
    where = f"step {step}: " if step is not None else ""
    leaves = flatten_step(inputs)
    if len(leaves) != len(specs):
        raise InputError(
            f"{where}the program takes {len(specs)} inputs "
            f"({', '.join(s.describe() for s in specs)}), got {len(leaves)} "
            f"({', '.join(path for path, _ in leaves) or 'none'})."
        )
    checked = []
    for (path, value), spec in zip(leaves, specs, strict=True):
        if isinstance(spec, ConstantSpec):
            if spec.value is not None and value != spec.value:
                raise InputError(
                    f"{where}{path}: the program was exported with the constant "
                    f"{spec.value!r} here, got {value!r}. Export again with this value."
                )
            checked.append(value)
            continue
        if not isinstance(value, torch.Tensor):
            raise InputError(
                f"{where}{path}: expected a tensor {spec.describe()}, got {type(value).__name__}."
            )
        if value.dtype != spec.dtype:
            raise InputError(
                f"{where}{path}: expected dtype {str(spec.dtype).removeprefix('torch.')}, "
                f"got {str(value.dtype).removeprefix('torch.')}."
            )
        if tuple(value.shape) != spec.shape:
            raise InputError(f"{where}{path}: expected {spec.shape}, got {tuple(value.shape)}.")
        checked.append(value.contiguous())
    return checked
