"""AdbRunner end to end through a fake adb whose "phone" runs the program on the host
simulator, plus failure injection: the numbers are real, only adb is emulated."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from bar import assert_identical

from qnn_mutbuf import AdbRunner, HostRunner
from qnn_mutbuf.errors import DeviceError

FAKES = Path(__file__).parent / "fakes"
SOC_LIBRARIES = {
    "lib/aarch64-android/libQnnHtp.so",
    "lib/aarch64-android/libQnnHtpV75Stub.so",
    "lib/aarch64-android/libQnnHtpPrepare.so",
    "lib/aarch64-android/libQnnSystem.so",
    "lib/hexagon-v75/unsigned/libQnnHtpV75Skel.so",
}


@pytest.fixture(scope="module")
def program(host_sdk):
    from qnn_mutbuf import lower, quantize
    from qnn_mutbuf.seed_models import decode_steps, small

    module, calibration, example = small()
    quantized = quantize(module, calibration, quant="8a8w")
    return lower(quantized, example).buffer, decode_steps(6, shape=(1, 64, 2, 8), seed=5)


@pytest.fixture
def phone(tmp_path, monkeypatch):
    """PATH with the fake adb first, a fake Android build and a fake QAIRT SDK."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shutil.copy(FAKES / "adb", bin_dir / "adb")
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_ADB_ROOT", str(tmp_path / "phone"))
    build = tmp_path / "build-android"
    runner = build / "examples/qualcomm/executor_runner/qnn_executor_runner"
    runner.parent.mkdir(parents=True)
    runner.write_text(
        "#!/bin/sh\n"
        'echo "$LD_LIBRARY_PATH|$ADSP_LIBRARY_PATH" >> "$FAKE_ADB_ROOT/runner_env.txt"\n'
        "unset LD_LIBRARY_PATH ADSP_LIBRARY_PATH QNN_SDK_ROOT\n"
        f'exec {sys.executable} {FAKES / "qnn_executor_runner.py"} "$@"\n'
    )
    runner.chmod(0o755)
    (build / "backends/qualcomm").mkdir(parents=True)
    (build / "backends/qualcomm/libqnn_executorch_backend.so").write_bytes(b"backend")
    sdk = tmp_path / "qairt"
    for relative in SOC_LIBRARIES:
        (sdk / relative).parent.mkdir(parents=True, exist_ok=True)
        (sdk / relative).write_bytes(relative.encode())
    return {"build": build, "sdk": sdk, "root": tmp_path / "phone"}


def _device_runs(root: Path) -> list[str]:
    base = root / "fs/data/local/tmp/qnn_mutbuf"
    return (
        sorted(p.name for p in base.iterdir() if p.name.startswith("run-")) if base.exists() else []
    )


def test_steps_on_the_phone_match_the_host_and_state_carries(program, phone):
    data, steps = program
    runner = AdbRunner(data, build_folder=phone["build"], qnn_sdk_root=phone["sdk"])
    outputs = runner.run(steps)
    assert_identical(HostRunner(data).run(steps), outputs, "adb vs host")
    assert not torch.equal(outputs[0][0], outputs[-1][0]), "state did not carry between steps"
    assert sorted(runner.pushed) == sorted(
        ["qnn_executor_runner", "libqnn_executorch_backend.so"]
        + [Path(p).name for p in SOC_LIBRARIES]
    )
    assert _device_runs(phone["root"]) == [], "work folder left on the phone"
    # Second run: nothing changed, nothing pushed but the program and inputs.
    again = AdbRunner(data, build_folder=phone["build"], qnn_sdk_root=phone["sdk"])
    assert_identical(outputs, again.run(steps), "second run")
    assert again.pushed == []
    calls = (phone["root"] / "calls.log").read_text()
    assert "--iteration 1 --warm_up 0" in calls
    library_path, adsp_path = (
        (phone["root"] / "runner_env.txt").read_text().splitlines()[0].split("|")
    )
    assert library_path.split(":")[0].endswith("/data/local/tmp/qnn_mutbuf/libs")
    assert adsp_path.endswith("/data/local/tmp/qnn_mutbuf/libs")


def test_runner_failure_reports_exit_code_and_log_and_cleans_up(program, phone, monkeypatch):
    monkeypatch.setenv("FAKE_RUNNER_EXIT", "7")
    runner = AdbRunner(program[0], build_folder=phone["build"], qnn_sdk_root=phone["sdk"])
    with pytest.raises(DeviceError) as error:
        runner.run(program[1])
    message = str(error.value)
    assert "exited with code 7" in message and "Failed to create device: 1008" in message
    assert _device_runs(phone["root"]) == []


def test_short_output_is_reported(program, phone, monkeypatch):
    monkeypatch.setenv("FAKE_RUNNER_TRUNCATE", "1")
    runner = AdbRunner(program[0], build_folder=phone["build"], qnn_sdk_root=phone["sdk"])
    with pytest.raises(DeviceError, match=r"output_0_0.raw has \d+ bytes, expected 4096"):
        runner.run(program[1])
    assert _device_runs(phone["root"]) == []


def test_phone_that_disappears_mid_run(program, phone, monkeypatch):
    monkeypatch.setenv("FAKE_ADB_DISAPPEAR_AFTER", "4")
    runner = AdbRunner(program[0], build_folder=phone["build"], qnn_sdk_root=phone["sdk"])
    with pytest.raises(DeviceError, match="no longer reachable"):
        runner.run(program[1])


def test_setup_errors_name_what_is_missing(program, phone, monkeypatch, tmp_path):
    data = program[0]
    with pytest.raises(
        DeviceError, match="No ready device with serial nope; adb sees: emulator-5554"
    ):
        AdbRunner(data, serial="nope", build_folder=phone["build"], qnn_sdk_root=phone["sdk"])
    with pytest.raises(DeviceError, match="Missing libQnnHtpV75Skel.so for SM8650"):
        (phone["sdk"] / "lib/hexagon-v75/unsigned/libQnnHtpV75Skel.so").unlink()
        AdbRunner(data, build_folder=phone["build"], qnn_sdk_root=phone["sdk"])
    with pytest.raises(DeviceError, match="--build-folder is required"):
        AdbRunner(data, qnn_sdk_root=phone["sdk"])
    monkeypatch.setenv("FAKE_ADB_DEVICES", "")
    with pytest.raises(DeviceError, match="No phone attached"):
        AdbRunner(data, build_folder=phone["build"], qnn_sdk_root=phone["sdk"])
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(DeviceError, match="adb is not on PATH"):
        AdbRunner(data, build_folder=phone["build"], qnn_sdk_root=phone["sdk"])


def test_libraries_follow_the_soc_the_program_was_compiled_for(phone):
    from qnn_mutbuf import lower, quantize
    from qnn_mutbuf.seed_models import small

    module, calibration, example = small()
    quantized = quantize(module, calibration, quant="8a8w")
    sm8550 = lower(quantized, example, soc="SM8550").buffer  # HTP v73
    # The fake SDK holds the v75 libraries only, so the runner names the v73 one.
    with pytest.raises(DeviceError, match="Missing libQnnHtpV73Stub.so for SM8550"):
        AdbRunner(sm8550, build_folder=phone["build"], qnn_sdk_root=phone["sdk"])


def test_cli_run_adb(program, phone, tmp_path):
    data, steps = program
    pte = tmp_path / "model.pte"
    pte.write_bytes(data)
    torch.save(steps, tmp_path / "steps.pt")
    env = dict(os.environ, QNN_SDK_ROOT=str(phone["sdk"]))
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "qnn_mutbuf.cli",
            "run",
            "adb",
            str(pte),
            "--inputs",
            str(tmp_path / "steps.pt"),
            "--build-folder",
            str(phone["build"]),
            "-s",
            "emulator-5554",
        ],
        env=env,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    assert "step   5:" in result.stdout
