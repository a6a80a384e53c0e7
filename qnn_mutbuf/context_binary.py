"""QNN context binaries inside a lowered program: extract them and read them back.

The AI Hub runner uploads context binaries (AI Hub does not take `.pte`), and the
tests read back what QNN actually compiled (target SoC and HTP arch, graph I/O and
their encodings) instead of trusting the compile spec.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from qnn_mutbuf.errors import InputError
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


@dataclass(frozen=True)
class GraphTensor:
    """One input or output of a QNN graph, as QNN reports it."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def is_mutable_buffer(self) -> bool:
        return "mutbuf_" in self.name


def graph_io(context: ContextBinary) -> tuple[list[GraphTensor], list[GraphTensor]]:
    """Inputs and outputs of the context's graph, loaded through QNN on the host."""
    import executorch.backends.qualcomm.python.PyQnnManagerAdaptor as adaptor

    from qnn_mutbuf.sdk import activate_host_sdk

    activate_host_sdk()
    manager = adaptor.QnnManager(context.compile_spec, context.processed)
    try:
        if (
            manager.InitBackend() != adaptor.Error.Ok
            or manager.InitContextCache() != adaptor.Error.Ok
        ):
            raise InputError("QNN could not load the context binary on the host simulator.")
        graph = manager.GetGraphNames()[0]
        manager.AllocateTensor(graph)

        def describe(tensors) -> list[GraphTensor]:
            return [
                GraphTensor(
                    t.GetName(),
                    str(t.GetDataType()).rsplit(".", 1)[-1].removeprefix("QNN_DATATYPE_"),
                    tuple(int(d) for d in t.GetDims()),
                )
                for t in tensors
            ]

        return describe(manager.GetGraphInputs(graph)), describe(manager.GetGraphOutputs(graph))
    finally:
        manager.Destroy()
