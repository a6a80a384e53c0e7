"""Runs a `.pte` on a Snapdragon phone over adb with ExecuTorch's qnn_executor_runner.

Same conventions as ExecuTorch's Qualcomm test flow: ``-s SERIAL`` and optional
``-H HOST``, a build folder holding ``qnn_executor_runner`` and
``libqnn_executorch_backend.so``, and QNN target libraries from ``QNN_SDK_ROOT``.
Libraries are cached on the phone and pushed only when they changed; each run gets
a unique work folder that is removed afterwards, also on failure or Ctrl-C. One
runner process executes every step (one line of ``input_list.txt`` per step), so
the state carries from step to step as it does in an app.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shlex
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from qnn_mutbuf.context_binary import compiled_soc
from qnn_mutbuf.errors import DeviceError
from qnn_mutbuf.program_io import (
    TensorSpec,
    check_step_inputs,
    load_pte_bytes,
    read_program_io,
)
from qnn_mutbuf.soc import htp_arch

logger = logging.getLogger(__name__)

DEVICE_ROOT = "/data/local/tmp/qnn_mutbuf"
RUNNER_NAME = "qnn_executor_runner"
MANIFEST = ".qnn_mutbuf_manifest"
_EXIT_MARKER = "qnn_mutbuf_exit="


def list_adb_devices(
    adb: str, host: str | None = None, timeout: float = 20.0
) -> list[tuple[str, str]]:
    """(serial, state) of every device `adb devices` reports."""
    command = [adb] + (["-H", host] if host else []) + ["devices"]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise DeviceError(f"`{' '.join(command)}` failed: {error}") from error
    if result.returncode != 0:
        raise DeviceError(f"`{' '.join(command)}` failed: {result.stderr.strip()}")
    devices = []
    for line in result.stdout.splitlines()[1:]:
        parts = line.split()
        if len(parts) >= 2:
            devices.append((parts[0], parts[1]))
    return devices


@dataclass(frozen=True)
class DeviceFile:
    """A file to push: where it is on the host and its name on the phone."""

    local: Path
    name: str


def required_files(build_folder: Path, sdk_root: Path, soc: str) -> list[DeviceFile]:
    """The runner, the ExecuTorch QNN backend and the QNN libraries for `soc`."""
    arch = htp_arch(soc)
    candidates = {
        RUNNER_NAME: [
            build_folder / RUNNER_NAME,
            build_folder / "examples/qualcomm/executor_runner" / RUNNER_NAME,
        ],
        "libqnn_executorch_backend.so": [
            build_folder / "libqnn_executorch_backend.so",
            build_folder / "backends/qualcomm/libqnn_executorch_backend.so",
        ],
    }
    target = sdk_root / "lib" / "aarch64-android"
    for name in (
        "libQnnHtp.so",
        f"libQnnHtpV{arch}Stub.so",
        "libQnnHtpPrepare.so",
        "libQnnSystem.so",
    ):
        candidates[name] = [target / name]
    skel = f"libQnnHtpV{arch}Skel.so"
    candidates[skel] = [sdk_root / "lib" / f"hexagon-v{arch}" / "unsigned" / skel]
    files = []
    for name, paths in candidates.items():
        found = next((path for path in paths if path.is_file()), None)
        if found is None:
            raise DeviceError(
                f"Missing {name} for {soc}: looked for "
                + " and ".join(str(path) for path in paths)
                + ". Build ExecuTorch for Android with QNN (--build-folder) and set "
                "QNN_SDK_ROOT to the QAIRT SDK used for that build."
            )
        files.append(DeviceFile(found, name))
    return files


def _target_sdk_root() -> Path | None:
    """The real QAIRT SDK behind QNN_SDK_ROOT (seeing through our host staging)."""
    from qnn_mutbuf.sdk.activation import STAGE_MARKER

    root = os.environ.get("QNN_SDK_ROOT")
    if not root:
        return None
    marker = Path(root) / STAGE_MARKER
    if marker.is_file():
        import json

        original = json.loads(marker.read_text()).get("original_sdk_root")
        return Path(original) if original else None
    return Path(root)


def _digest(path: Path) -> str:
    hasher = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            hasher.update(chunk)
    return hasher.hexdigest()


class AdbRunner:
    """Runs all steps of a program in one qnn_executor_runner process on a phone.

    Args:
        pte: path or bytes of the program.
        serial: adb serial (``-s``); optional when exactly one device is attached.
        host: adb server host (``-H``).
        build_folder: ExecuTorch Android build with qnn_executor_runner.
        qnn_sdk_root: QAIRT SDK with the target libraries (default: QNN_SDK_ROOT).
        soc: selects the HTP stub/skel libraries (``V75`` for SM8650); by default the
            SoC the program's context binary was compiled for.
    """

    def __init__(
        self,
        pte: str | os.PathLike | bytes,
        *,
        serial: str | None = None,
        host: str | None = None,
        build_folder: str | os.PathLike | None = None,
        qnn_sdk_root: str | os.PathLike | None = None,
        soc: str | None = None,
        adb: str | None = None,
        device_root: str = DEVICE_ROOT,
        timeout: float = 1800.0,
    ) -> None:
        self._data = load_pte_bytes(pte)
        self.io = read_program_io(self._data)
        self.adb = adb or shutil.which("adb")
        if self.adb is None:
            raise DeviceError(
                "adb is not on PATH. Install Android platform-tools (which provides adb) "
                "and connect the phone, or run on the host simulator with `run host`."
            )
        self.host = host
        self.timeout = timeout
        self.device_root = device_root.rstrip("/")
        self.serial = self._pick_device(serial)
        if build_folder is None:
            raise DeviceError(
                "--build-folder is required: the ExecuTorch Android build that holds "
                f"{RUNNER_NAME} and libqnn_executorch_backend.so."
            )
        sdk_root = Path(qnn_sdk_root) if qnn_sdk_root else _target_sdk_root()
        soc = soc or compiled_soc(self._data)
        if sdk_root is None:
            raise DeviceError(
                "QNN_SDK_ROOT is not set: the phone needs the QAIRT target libraries "
                f"(lib/aarch64-android, lib/hexagon-v{htp_arch(soc)}). Point QNN_SDK_ROOT at a "
                "QAIRT SDK."
            )
        self.files = required_files(Path(build_folder), sdk_root, soc)
        self.last_log = ""

    # --- adb plumbing ---------------------------------------------------------------

    def _command(self, *arguments: str) -> list[str]:
        command = [self.adb]
        if self.host:
            command += ["-H", self.host]
        if getattr(self, "serial", None):
            command += ["-s", self.serial]
        return command + list(arguments)

    def _adb(self, *arguments: str, check: bool = True) -> subprocess.CompletedProcess:
        command = self._command(*arguments)
        try:
            result = subprocess.run(command, capture_output=True, text=True, timeout=self.timeout)
        except subprocess.TimeoutExpired as error:
            raise DeviceError(
                f"`{shlex.join(command)}` timed out after {self.timeout:.0f}s"
            ) from error
        if check and result.returncode != 0:
            detail = (result.stderr or result.stdout).strip()
            if "not found" in detail or "offline" in detail or "no devices" in detail:
                raise DeviceError(
                    f"Phone {self.serial} is no longer reachable over adb ({detail}). "
                    "Reconnect it and check `adb devices`."
                )
            raise DeviceError(
                f"`{shlex.join(command)}` failed (exit {result.returncode}): {detail}"
            )
        return result

    def _shell(self, script: str, check: bool = True) -> subprocess.CompletedProcess:
        return self._adb("shell", script, check=check)

    def _pick_device(self, serial: str | None) -> str:
        devices = list_adb_devices(self.adb, self.host)
        ready = [name for name, state in devices if state == "device"]
        seen = ", ".join(f"{name} ({state})" for name, state in devices) or "none"
        if serial is not None:
            if serial not in ready:
                raise DeviceError(
                    f"No ready device with serial {serial}; adb sees: {seen}. "
                    "Check the cable, USB debugging and the -s value."
                )
            return serial
        if not ready:
            raise DeviceError(
                f"No phone attached over adb (adb sees: {seen}). Connect one with USB "
                "debugging enabled, or pass -H for a remote adb server."
            )
        if len(ready) > 1:
            raise DeviceError(
                f"Several phones attached ({', '.join(ready)}); pick one with -s SERIAL."
            )
        return ready[0]

    # --- pushing --------------------------------------------------------------------

    @property
    def library_dir(self) -> str:
        return f"{self.device_root}/libs"

    def _sync_libraries(self, scratch: Path) -> list[str]:
        """Pushes the runner and libraries whose content changed; returns their names."""
        self._shell(f"mkdir -p {shlex.quote(self.library_dir)}")
        listing = self._shell(
            f"cat {shlex.quote(self.library_dir + '/' + MANIFEST)} 2>/dev/null", check=False
        )
        on_device = dict(
            line.split(" ", 1)[::-1] for line in listing.stdout.splitlines() if " " in line
        )
        manifest = []
        pushed = []
        for item in self.files:
            digest = _digest(item.local)
            manifest.append(f"{digest} {item.name}")
            if on_device.get(item.name) != digest:
                self._adb("push", str(item.local), f"{self.library_dir}/{item.name}")
                pushed.append(item.name)
        manifest_file = scratch / MANIFEST
        manifest_file.write_text("\n".join(manifest) + "\n")
        if pushed:
            self._adb("push", str(manifest_file), f"{self.library_dir}/{MANIFEST}")
        return pushed

    # --- running --------------------------------------------------------------------

    def run(self, steps: Sequence[Sequence[torch.Tensor]]) -> list[list[torch.Tensor]]:
        """Runs every step in one process on the phone; returns per-step outputs."""
        checked = [
            check_step_inputs(self.io.inputs, step, index) for index, step in enumerate(steps)
        ]
        constants = [s.describe() for s in self.io.inputs if not isinstance(s, TensorSpec)]
        if constants:
            # qnn_executor_runner reads one raw tensor file per input, nothing else.
            raise DeviceError(
                f"The program takes non-tensor inputs ({', '.join(constants)}), which "
                "qnn_executor_runner cannot feed. Pass them as tensors in the model, or use "
                "`run host`."
            )
        work = f"{self.device_root}/run-{uuid.uuid4().hex[:12]}"
        with tempfile.TemporaryDirectory(prefix="qnn_mutbuf_adb_") as scratch_name:
            scratch = Path(scratch_name)
            try:
                self.pushed = self._sync_libraries(scratch)
                self._shell(f"mkdir -p {shlex.quote(work)}/outputs")
                self._push_program_and_inputs(scratch, work, checked)
                self._execute(work, len(checked))
                return self._pull_outputs(scratch, work, len(checked))
            finally:
                self._cleanup(work)

    def _push_program_and_inputs(self, scratch: Path, work: str, steps: list) -> None:
        program = scratch / "program.pte"
        program.write_bytes(self._data)
        self._adb("push", str(program), f"{work}/program.pte")
        inputs_dir = scratch / "inputs"
        inputs_dir.mkdir()
        lines = []
        for step, inputs in enumerate(steps):
            names = [f"input_{step}_{index}.raw" for index in range(len(inputs))]
            for name, tensor in zip(names, inputs, strict=True):
                tensor.contiguous().numpy().tofile(inputs_dir / name)
            lines.append(" ".join(names))
        (inputs_dir / "input_list.txt").write_text("\n".join(lines) + "\n")
        self._adb("push", f"{inputs_dir}/.", work)

    def _execute(self, work: str, steps: int) -> None:
        libraries = shlex.quote(self.library_dir)
        script = (
            f"cd {shlex.quote(work)} && export LD_LIBRARY_PATH={libraries}:$LD_LIBRARY_PATH && "
            f"export ADSP_LIBRARY_PATH={libraries} && chmod +x {libraries}/{RUNNER_NAME} && "
            f"{libraries}/{RUNNER_NAME} --model_path program.pte --input_list_path input_list.txt "
            "--output_folder_path outputs --iteration 1 --warm_up 0 > runner.log 2>&1; "
            f"echo {_EXIT_MARKER}$?"
        )
        result = self._shell(script)
        code = None
        for line in result.stdout.splitlines():
            if line.startswith(_EXIT_MARKER):
                code = int(line[len(_EXIT_MARKER) :].strip() or -1)
        log = self._shell(f"tail -n 30 {shlex.quote(work)}/runner.log", check=False).stdout
        self.last_log = log
        if code != 0:
            raise DeviceError(
                f"{RUNNER_NAME} exited with code {code} on {self.serial} after {steps} "
                f"requested steps. Last lines of its log:\n{log.strip()}"
            )

    def _pull_outputs(self, scratch: Path, work: str, steps: int) -> list[list[torch.Tensor]]:
        local = scratch / "outputs"
        self._adb("pull", f"{work}/outputs", str(scratch))
        results = []
        for step in range(steps):
            outputs = []
            for index, spec in enumerate(self.io.outputs):
                path = local / f"output_{step}_{index}.raw"
                if not path.is_file():
                    found = sorted(p.name for p in local.glob(f"output_{step}_*.raw"))
                    raise DeviceError(
                        f"Step {step}: the runner wrote {len(found)} outputs, the program has "
                        f"{len(self.io.outputs)} (missing {path.name})."
                    )
                data = path.read_bytes()
                if len(data) != spec.nbytes:
                    raise DeviceError(
                        f"Step {step}: {path.name} has {len(data)} bytes, expected {spec.nbytes} "
                        f"for {spec.describe()}."
                    )
                tensor = torch.frombuffer(bytearray(data), dtype=spec.dtype).reshape(spec.shape)
                outputs.append(tensor.clone())
            results.append(outputs)
        return results

    def _cleanup(self, work: str) -> None:
        try:
            self._shell(f"rm -rf {shlex.quote(work)}", check=True)
        except DeviceError as error:
            logger.warning("Could not remove %s from the phone: %s", work, error)
