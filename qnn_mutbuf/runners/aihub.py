"""Runs a lowered program on Qualcomm AI Hub's cloud devices, step by step.

AI Hub does not take `.pte` files, so the runner extracts the QNN context binary
(ExecuTorch's ``dump_context_from_pte`` stripping), uploads it as a ``.bin`` model
and submits one inference job per step, pinned to the QAIRT version that compiled
the binary. AI Hub runs each sample without state: the runner feeds the delegated
buffers (``mutbuf`` graph inputs) itself from the previous step's state outputs,
and the ``state_loaded`` flag that makes the first step load the initial state.
The API token comes from qai-hub's own configuration and is never logged.
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from qnn_mutbuf.context_binary import GraphTensor, extract_context_binaries, graph_io
from qnn_mutbuf.errors import AiHubError
from qnn_mutbuf.program_io import check_step_inputs, load_pte_bytes, read_program_io

logger = logging.getLogger(__name__)

DEFAULT_DEVICE = "Samsung Galaxy S24 (Family)"  # Snapdragon 8 Gen 3, SM8650
_BUILD_ID = re.compile(rb"v(\d+)\.(\d+)\.(\d+)\.\d{6,}")


def aihub_configuration() -> str:
    """Whether qai-hub has an API token configured (the token is never shown)."""
    try:
        from qai_hub import api_utils

        path = api_utils.get_config_path()
        config = api_utils.load_default_api_config()
    except Exception:
        return "not configured: run `qai-hub configure --api_token <your token>`"
    if not getattr(config, "api_token", None):
        return f"not configured: {path} has no api_token"
    return f"configured ({path})"


def _default_client():
    try:
        import qai_hub
        from qai_hub import api_utils

        config = api_utils.load_default_api_config()
    except Exception as error:
        raise AiHubError(
            "No Qualcomm AI Hub API token is configured. Run `qai-hub configure "
            "--api_token <your token>` (token from https://aihub.qualcomm.com, Settings)."
        ) from error
    if not getattr(config, "api_token", None):
        raise AiHubError("The qai-hub configuration has no api_token; run `qai-hub configure`.")
    return qai_hub


def qairt_version_of(binary: bytes) -> str:
    """``major.minor`` of the QAIRT that compiled a context binary, e.g. "2.51"."""
    match = _BUILD_ID.search(binary)
    if match is None:
        raise AiHubError("The context binary carries no QAIRT build id; cannot pin the version.")
    return f"{int(match.group(1))}.{int(match.group(2))}"


def _sort_key(tensor: GraphTensor) -> int:
    match = re.match(r"(?:input|output)_(\d+)_", tensor.name)
    return int(match.group(1)) if match else 10**6


class AiHubRunner:
    """Runs a program's steps as AI Hub inference jobs, threading the state itself.

    Args:
        pte: path or bytes of a program lowered by :func:`qnn_mutbuf.lower`.
        device: AI Hub device name (default: Samsung Galaxy S24 (Family), SM8650).
        chipset: select a device by chipset attribute instead, e.g.
            ``qualcomm-snapdragon-8gen3``.
        client: object with qai_hub's call surface (``upload_model``,
            ``submit_inference_job``, ``Device``); defaults to the ``qai_hub`` module.
    """

    def __init__(
        self,
        pte: str | os.PathLike | bytes,
        *,
        device: str | None = None,
        chipset: str | None = None,
        client=None,
    ) -> None:
        self._data = load_pte_bytes(pte)
        self.io = read_program_io(self._data)
        if self.io.cpu_compute:
            raise AiHubError(
                "Part of the program runs on the CPU ("
                + ", ".join(self.io.cpu_compute)
                + "), which AI Hub cannot run: it runs only the QNN context binary. "
                "Use `run host` or `run adb`, or keep every op on the HTP."
            )
        contexts = extract_context_binaries(self._data)
        if len(contexts) != 1:
            raise AiHubError(
                f"The program has {len(contexts)} QNN delegates; AI Hub runs one context "
                "binary. Lower the model so that it is one HTP partition."
            )
        self.context = contexts[0]
        self.client = client if client is not None else _default_client()
        self.qairt_version = qairt_version_of(self.context.binary)
        self.inputs, self.outputs = graph_io(self.context)
        self._classify()
        if chipset:
            self.device = self.client.Device(attributes=[f"chipset:{chipset}"])
        else:
            self.device = self.client.Device(name=device or DEFAULT_DEVICE)
        self.model = None
        self.profile: dict | None = None
        self.profile_summary: str | None = None
        self.jobs: list = []

    def _classify(self) -> None:
        """Which graph inputs are the program's inputs, the state and the flag."""
        user_inputs = sorted(
            (t for t in self.inputs if t.mutbuf is None and not t.is_loaded_flag), key=_sort_key
        )
        if len(user_inputs) != len(self.io.tensor_inputs):
            raise AiHubError(
                f"The context binary takes {len(user_inputs)} inputs besides its delegated "
                f"state, the program {len(self.io.tensor_inputs)}: part of the program runs on "
                "the CPU or its mutable buffers were kept at top level. AI Hub runs only the "
                "context binary: lower with delegate_mutable_buffers=True "
                "(no --no-delegate-buffers) and every op on the HTP, or use `run host` / `run adb`."
            )
        self.user_inputs = user_inputs
        state_inputs = {t.mutbuf: t for t in self.inputs if t.mutbuf is not None}
        state_outputs = {t.mutbuf: t for t in self.outputs if t.mutbuf is not None}
        if set(state_inputs) != set(state_outputs):
            raise AiHubError(
                "The context binary's mutable-buffer inputs and outputs do not pair up."
            )
        self.state_pairs = {k: (state_inputs[k], state_outputs[k]) for k in state_inputs}
        self.flag_input = next((t for t in self.inputs if t.is_loaded_flag), None)
        rest = [t for t in self.outputs if t.mutbuf is None]
        if self.flag_input is not None:
            flags = [t for t in rest if t.dtype == "BOOL_8" and t.shape == (1,)]
            if flags:
                rest.remove(flags[-1])
        if len(rest) != len(self.io.outputs):
            raise AiHubError(
                f"The context binary returns {len(rest)} outputs besides its delegated state, "
                f"the program {len(self.io.outputs)}: part of the program runs on the CPU or "
                "its mutable buffers were kept at top level; lower with "
                "delegate_mutable_buffers=True for AI Hub."
            )
        self.user_outputs = rest

    def _upload(self) -> None:
        if self.model is not None:
            return
        with tempfile.TemporaryDirectory(prefix="qnn_mutbuf_aihub_") as folder:
            path = Path(folder) / "model.bin"
            path.write_bytes(self.context.binary)
            self.model = self.client.upload_model(str(path))

    @staticmethod
    def _to_graph(tensor: torch.Tensor, spec: GraphTensor) -> np.ndarray:
        array = tensor.detach().cpu().numpy()
        if spec.quantized:
            quantized = np.round(array.astype(np.float64) / spec.scale) - spec.offset
            info = np.iinfo(spec.numpy_dtype)
            array = np.clip(quantized, info.min, info.max)
        return np.ascontiguousarray(array.astype(spec.numpy_dtype).reshape(spec.shape))

    @staticmethod
    def _from_graph(array: np.ndarray, spec: GraphTensor, dtype: torch.dtype) -> torch.Tensor:
        array = np.asarray(array).reshape(spec.shape)
        if spec.quantized:
            array = (array.astype(np.float64) + spec.offset) * spec.scale
        return torch.from_numpy(np.ascontiguousarray(array)).to(dtype)

    def run(self, steps: Sequence[Sequence[torch.Tensor]]) -> list[list[torch.Tensor]]:
        """One inference job per step; the state outputs of step k feed step k+1."""
        from qnn_mutbuf.progress import progress

        # Constant (non-tensor) inputs were folded into the graph at export.
        checked = [
            [v for v in check_step_inputs(self.io.inputs, s, i) if isinstance(v, torch.Tensor)]
            for i, s in enumerate(steps)
        ]
        self._upload()
        state = {
            k: np.zeros(pair[0].shape, dtype=pair[0].numpy_dtype)
            for k, pair in self.state_pairs.items()
        }
        results = []
        for index, step_inputs in enumerate(progress(checked, description="AI Hub steps")):
            feed = {}
            user = iter(zip(step_inputs, self.user_inputs, strict=True))
            by_name = {spec.name: self._to_graph(value, spec) for value, spec in user}
            for spec in self.inputs:
                if spec.name in by_name:
                    feed[spec.name] = [by_name[spec.name]]
                elif spec.mutbuf is not None:
                    feed[spec.name] = [state[spec.mutbuf]]
                elif spec.is_loaded_flag:
                    # False on the first step: the graph then reads the initial state.
                    feed[spec.name] = [np.array([index > 0], dtype=np.bool_)]
            job = self.client.submit_inference_job(
                model=self.model,
                device=self.device,
                inputs=feed,
                name=f"qnn_mutbuf step {index}",
                options=f"--qairt_version {self.qairt_version}",
                profile=index == 0,
            )
            self.jobs.append(job)
            produced = job.download_output_data()
            if produced is None:
                raise AiHubError(f"AI Hub job for step {index} returned no output data ({job}).")
            for key, (_, output_spec) in self.state_pairs.items():
                state[key] = np.asarray(produced[output_spec.name][0]).reshape(output_spec.shape)
            results.append(
                [
                    self._from_graph(produced[spec.name][0], spec, program_spec.dtype)
                    for spec, program_spec in zip(self.user_outputs, self.io.outputs, strict=True)
                ]
            )
            if index == 0:
                self.profile = job.download_profile()
                self.profile_summary = summarize_profile(self.profile)
        self.final_state = {
            key: self._from_graph(state[key], pair[1], torch.float32)
            for key, pair in self.state_pairs.items()
        }
        return results


def summarize_profile(profile: dict | None, top: int = 5) -> str:
    """Estimated inference time, peak memory, load times and the slowest layers."""
    if not profile:
        return "no profile returned"
    summary = profile.get("execution_summary", {})

    def ms(key: str) -> str:
        value = summary.get(key)
        return f"{value / 1000:.3f} ms" if isinstance(value, (int, float)) else "n/a"

    def mib(key: str) -> str:
        value = summary.get(key)
        if isinstance(value, (list, tuple)) and value:
            value = max(value)
        return f"{value / 2**20:.2f} MiB" if isinstance(value, (int, float)) else "n/a"

    lines = [
        f"estimated inference time {ms('estimated_inference_time')}, "
        f"peak memory {mib('estimated_inference_peak_memory')}",
        f"load: first {ms('first_load_time')}, warm {ms('warm_load_time')}",
    ]
    layers = profile.get("execution_detail", []) or []
    slowest = sorted(layers, key=lambda layer: layer.get("execution_time", 0), reverse=True)[:top]
    for layer in slowest:
        lines.append(
            f"  {layer.get('name', '?')} ({layer.get('type', '?')}, "
            f"{layer.get('compute_unit', '?')}): {layer.get('execution_time', 0) / 1000:.3f} ms"
        )
    return "\n".join(lines)
