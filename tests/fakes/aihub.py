"""A stand-in for the ``qai_hub`` module: the same call surface, with "cloud devices"
that run the uploaded QNN context binary on the host simulator.

Like AI Hub, every inference job is stateless: each graph input, the delegated state
included, must be supplied. To run the binary that way on the host, the emulator
renames its ``mutbuf_`` tensors (ExecuTorch's runtime would otherwise keep that
state inside the delegate) and wraps the binary with ExecuTorch's
``from_context_binary``.
"""

from __future__ import annotations

import itertools
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import qai_hub
import torch

_UPLOADS = itertools.count()


@dataclass
class FakeModel:
    model_id: str
    input_names: list[str]
    output_names: list[str]
    program: bytes


@dataclass
class FakeJob:
    outputs: dict
    profile: dict | None
    name: str
    options: str
    device: object
    inputs: dict = field(repr=False, default_factory=dict)

    def download_output_data(self, filename: str | None = None):
        return self.outputs

    def download_profile(self, filename: str | None = None):
        return self.profile

    def wait(self, timeout=None):
        return "SUCCESS"


class FakeHub:
    Device = qai_hub.Device

    def __init__(self) -> None:
        self.jobs: list[FakeJob] = []
        self.uploaded: list[Path] = []

    def upload_model(self, model, name=None, project=None) -> FakeModel:
        from executorch.backends.qualcomm.utils.utils import from_context_binary

        path = Path(model)
        assert path.suffix == ".bin", f"AI Hub takes a .bin context binary, got {path.name}"
        self.uploaded.append(path)
        binary = path.read_bytes().replace(b"mutbuf_", b"mutbxf_")
        import executorch.backends.qualcomm.qnn_preprocess as qnn_preprocess

        # from_context_binary leaves torch.range bound to the name `range` in
        # qnn_preprocess's globals (an upstream side effect that breaks every later
        # lowering in the process); keep that module's globals as they were.
        saved = dict(vars(qnn_preprocess))
        try:
            with tempfile.TemporaryDirectory() as folder:
                renamed = Path(folder) / "renamed.bin"
                renamed.write_bytes(binary)
                bundle = from_context_binary(str(renamed), f"fake_hub_{next(_UPLOADS)}")
        finally:
            for key in set(vars(qnn_preprocess)) - set(saved):
                delattr(qnn_preprocess, key)
        program = bundle["edge_program_manager"].to_executorch().buffer
        restore = lambda name: name.replace("mutbxf_", "mutbuf_")  # noqa: E731
        return FakeModel(
            model_id=f"m{len(self.uploaded)}",
            input_names=[restore(n) for n in bundle["inputs"]],
            output_names=[restore(n) for n in bundle["outputs"]],
            program=program,
        )

    def submit_inference_job(
        self,
        model,
        device,
        inputs=None,
        name=None,
        options="",
        retry=True,
        profile=True,
        project=None,
    ) -> FakeJob:
        from executorch.runtime import Runtime

        assert list(inputs) == model.input_names, "inputs not in the model's input order"
        assert "--qairt_version" in options
        arrays = []
        for key in model.input_names:
            (array,) = inputs[key]
            arrays.append(torch.from_numpy(np.ascontiguousarray(array)))
        program = Runtime.get().load_program(model.program)
        method = program.load_method(next(iter(program.method_names)))
        produced = method.execute(arrays)
        outputs = {n: [t.numpy().copy()] for n, t in zip(model.output_names, produced, strict=True)}
        report = None
        if profile:
            report = {
                "execution_summary": {
                    "estimated_inference_time": 1234,
                    "estimated_inference_peak_memory": 3 * 2**20,
                    "first_load_time": 50_000,
                    "warm_load_time": 20_000,
                },
                "execution_detail": [
                    {
                        "name": "index_put",
                        "type": "ScatterNd",
                        "compute_unit": "NPU",
                        "execution_time": 900,
                    },
                    {
                        "name": "select",
                        "type": "ElementWiseSelect",
                        "compute_unit": "NPU",
                        "execution_time": 300,
                    },
                ],
            }
        job = FakeJob(outputs, report, name, options, device, inputs)
        self.jobs.append(job)
        return job
