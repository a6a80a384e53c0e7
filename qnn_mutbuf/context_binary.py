"""QNN context binaries inside a lowered program: extract them and read them back.

The AI Hub runner uploads context binaries (AI Hub does not take `.pte`), and the
tests read back what QNN actually compiled (target SoC and HTP arch, graph I/O and
their encodings) instead of trusting the compile spec.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import numpy as np

from qnn_mutbuf.errors import InputError
from qnn_mutbuf.passes.initial_state import STARTED_BUFFER
from qnn_mutbuf.program_io import load_pte_bytes

_SETTING = re.compile(rb"(soc_type|arch|vtcm_size|min_arch)=([A-Za-z0-9_]+);")


@dataclass(frozen=True)
class ContextBinary:
    """One QNN delegate of a program: its compile spec and stripped context binary."""

    method: str
    index: int
    compile_spec: bytes
    processed: bytes
    binary: bytes


def extract_context_binaries(pte: str | os.PathLike | bytes) -> list[ContextBinary]:
    """Every QNN delegate of a `.pte`, with the protocol header stripped as
    ExecuTorch's ``dump_context_from_pte`` does."""
    import executorch.backends.qualcomm.python.PyQnnManagerAdaptor as adaptor
    from executorch.exir._serialize._program import deserialize_pte_binary

    program = deserialize_pte_binary(load_pte_bytes(pte)).program
    found = []
    for plan in program.execution_plan:
        for index, delegate in enumerate(plan.delegates):
            if delegate.id != "QnnBackend":
                continue
            processed = bytes(program.backend_delegate_data[delegate.processed.index].data)
            spec = next(
                (bytes(s.value) for s in delegate.compile_specs if s.key == "qnn_compile_spec"),
                b"",
            )
            binary = bytes(adaptor.StripProtocol(processed)) or processed
            found.append(ContextBinary(plan.name, index, spec, processed, binary))
    if not found:
        raise InputError("The program has no QNN delegate: nothing was lowered to the HTP.")
    return found


def build_settings(binary: bytes) -> dict[str, str]:
    """Target settings QNN recorded in a context binary (``soc_type``, ``arch``...)."""
    settings: dict[str, str] = {}
    for key, value in _SETTING.findall(binary):
        settings.setdefault(key.decode(), value.decode())
    return settings


def compiled_soc(pte: str | os.PathLike | bytes, default: str = "SM8650") -> str:
    """The SoC the program's (first) QNN delegate was compiled for; `default` when
    the program has no delegate."""
    try:
        (context, *_) = extract_context_binaries(pte)
    except InputError:
        return default
    return build_settings(context.binary).get("soc_type", default)


# QNN data types as numpy stores them (fixed point: the integer codes).
NUMPY_DTYPES = {
    "FLOAT_32": np.float32,
    "FLOAT_16": np.float16,
    "INT_64": np.int64,
    "INT_32": np.int32,
    "INT_16": np.int16,
    "INT_8": np.int8,
    "UINT_32": np.uint32,
    "UINT_16": np.uint16,
    "UINT_8": np.uint8,
    "BOOL_8": np.bool_,
    "UFIXED_POINT_8": np.uint8,
    "UFIXED_POINT_16": np.uint16,
    "SFIXED_POINT_8": np.int8,
    "SFIXED_POINT_16": np.int16,
    "SFIXED_POINT_32": np.int32,
}
_MUTBUF = re.compile(r"mutbuf_(\d+)_")


@dataclass(frozen=True)
class GraphTensor:
    """One input or output of a QNN graph, as QNN reports it, with its encoding."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    scale: float | None = None
    offset: int | None = None

    @property
    def numpy_dtype(self):
        return NUMPY_DTYPES[self.dtype]

    @property
    def quantized(self) -> bool:
        return "FIXED_POINT" in self.dtype and self.scale is not None

    @property
    def mutbuf(self) -> int | None:
        """Index of the delegated mutable buffer this tensor carries, if any."""
        match = _MUTBUF.search(self.name)
        return int(match.group(1)) if match else None

    @property
    def is_loaded_flag(self) -> bool:
        return STARTED_BUFFER in self.name


def graph_io(context: ContextBinary) -> tuple[list[GraphTensor], list[GraphTensor]]:
    """Inputs and outputs of the context's graph with per-tensor encodings, loaded
    through QNN on the host from the stripped binary, so in the binary's own order
    (the order AI Hub, which takes that binary, expects inputs in)."""
    import executorch.backends.qualcomm.python.PyQnnManagerAdaptor as adaptor
    from executorch.backends.qualcomm.partition.utils import generate_qnn_executorch_option

    from qnn_mutbuf.sdk import activate_host_sdk
    from qnn_mutbuf.sdk.device import htp_compile_spec

    activate_host_sdk()
    soc = build_settings(context.binary).get("soc_type", "SM8650")
    option = generate_qnn_executorch_option(htp_compile_spec(soc, from_context_binary=True))
    wrapped = bytes(adaptor.QnnManager(option).MakeBinaryInfo(context.binary))
    manager = adaptor.QnnManager(option, wrapped)
    try:
        if manager.Init() != adaptor.Error.Ok:
            raise InputError("QNN could not open the program's context binary on this host.")
        graph = manager.GetGraphNames()[0]
        manager.AllocateTensor(graph)

        def describe(tensor) -> GraphTensor:
            encodings = list(tensor.GetEncodings().data)
            scale, offset = (
                (float(encodings[0][0]), int(encodings[0][1])) if encodings else (None, None)
            )
            return GraphTensor(
                tensor.GetName(),
                str(tensor.GetDataType()).rsplit(".", 1)[-1].removeprefix("QNN_DATATYPE_"),
                tuple(int(d) for d in tensor.GetDims()),
                scale,
                offset,
            )

        return (
            [describe(t) for t in manager.GetGraphInputs(graph)],
            [describe(t) for t in manager.GetGraphOutputs(graph)],
        )
    finally:
        manager.Destroy()
