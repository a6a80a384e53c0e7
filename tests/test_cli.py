"""The qnn-mutbuf command line: demo, export + run host with --reference, errors, help."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

SMALL = "qnn_mutbuf.seed_models:small"
GATE_MISSED = 3  # exit status when the numbers miss a gate (`qnn-mutbuf run --help`)
# The small seed model at 8a8w, 6 calibration steps, 5 steps of decode_steps(seed=3) on
# the host simulator (SM8650): step 0 writes -0.9915, below the output encoding's minimum
# -0.9771 (scale 0.00776, zero point 126), so every step is 0.0143 = 1.85 output steps off
# fp32; fake-quant is matched exactly on steps 0-3 and one output step off on step 4.
MIN_SQNR_VS_FP32_DB = 58.0  # measured 63.5 dB falling to 60.0 dB at step 4
WORST_STEPS_VS_FAKE_QUANT = 1.01  # measured 1.00 (step 4); fake-quant SQNR there 72.1 dB


def cli(*arguments, check=True, env=None):
    result = subprocess.run(
        [sys.executable, "-m", "qnn_mutbuf.cli", *arguments],
        capture_output=True,
        text=True,
        env=None if env is None else {**os.environ, **env},
    )
    if check:
        assert result.returncode == 0, result.stderr + result.stdout
    return result


@pytest.mark.parametrize(
    "command",
    [[], ["doctor"], ["export"], ["run"], ["demo"]],
    ids=["main", "doctor", "export", "run", "demo"],
)
def test_help_reads_well(command):
    result = cli(*command, "--help")
    assert "usage: qnn-mutbuf" in result.stdout
    assert len(result.stdout.splitlines()) > 4


def test_demo_prints_the_per_step_table():
    result = cli("demo", "--small", "--steps", "4")
    lines = result.stdout.splitlines()
    assert any("vs fp32" in line and "vs fake-quant" in line for line in lines)
    rows = [line for line in lines if line.strip()[:1].isdigit() and "|" in line]
    assert len(rows) == 4
    assert "worst step vs fake-quant" in result.stdout
    assert "[INFO]" not in result.stdout + result.stderr, "QNN's own logs leaked into the output"


def test_doctor_passes_on_this_machine(tmp_path):
    # This machine has no ~/.qai_hub/client.ini; pointing qai-hub at a missing file
    # gives the same line on a machine that has one.
    missing = tmp_path / "client.ini"
    result = cli("doctor", env={"QAIHUB_CLIENT_INI": str(missing)})
    assert "QAIRT          2." in result.stdout
    assert "HTP device     created for SM8650" in result.stdout
    aihub = next(line for line in result.stdout.splitlines() if line.startswith("AI Hub"))
    status = "not configured: run `qai-hub configure --api_token <your token>`"
    assert aihub == f"AI Hub         {status}"


def test_doctor_never_shows_the_ai_hub_token(tmp_path, monkeypatch):
    # doctor prints `AI Hub` + aihub_configuration(); a subprocess would cost a doctor run.
    from qnn_mutbuf.runners.aihub import aihub_configuration

    config = tmp_path / "client.ini"
    token = "t0ken-that-must-not-be-printed"
    url = "https://app.aihub.qualcomm.com"
    config.write_text(f"[api]\napi_token = {token}\napi_url = {url}\nweb_url = {url}\n")
    monkeypatch.setenv("QAIHUB_CLIENT_INI", str(config))
    assert aihub_configuration() == f"configured ({config})"


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cli")
    pte = folder / "model.pte"
    cli("export", SMALL, "-o", str(pte), "--quant", "8a8w", "--calibration-steps", "6")
    from qnn_mutbuf.seed_models import decode_steps

    torch.save(decode_steps(5, shape=(1, 64, 2, 8), seed=3), folder / "steps.pt")
    return folder, pte


def test_export_writes_program_and_sidecar(exported):
    folder, pte = exported
    sidecar = json.loads(pte.with_suffix(".json").read_text())
    assert sidecar["soc"] == "SM8650" and sidecar["quant"] == "8a8w"
    assert sidecar["calibration_steps"] == 6
    buffer = sidecar["buffers"]["k_cache"]
    assert buffer["shape"] == [1, 64, 2, 8] and buffer["location"] == "delegate"
    assert buffer["encoding"]["scale"] > 0
    assert sidecar["partition"]["nodes_on_cpu"] == 0 and sidecar["partition"]["nodes_on_htp"] > 0
    assert not [p for p in folder.iterdir() if p.name.startswith(".")], "temporary files left"
    umask = os.umask(0)
    os.umask(umask)
    for written in (pte, pte.with_suffix(".json")):
        assert written.stat().st_mode & 0o777 == 0o666 & ~umask, "not an ordinary file mode"


def test_run_host_with_reference_report_and_plot(exported):
    folder, pte = exported
    report = folder / "report.json"
    plot = folder / "errors.png"
    result = cli(
        "run",
        "host",
        str(pte),
        "--inputs",
        str(folder / "steps.pt"),
        "--reference",
        SMALL,
        "--report",
        str(report),
        "--plot",
        str(plot),
        "--fail-below-sqnr",
        str(MIN_SQNR_VS_FP32_DB),
        "--max-steps-off",
        str(WORST_STEPS_VS_FAKE_QUANT),
    )
    assert "step   4:" in result.stdout
    assert "vs fake-quant" in result.stdout
    data = json.loads(report.read_text())
    assert data["steps"] == 5
    assert data["gates"]["misses"] == []
    comparisons = {c["reference"]: c["rows"] for c in data["comparisons"]}
    assert [len(rows) for rows in comparisons.values()] == [5, 5]
    for rows in comparisons.values():
        assert all(row["steps_of_encoding"] is not None for row in rows), rows
    assert max(row["steps_of_encoding"] for row in comparisons["fake-quant"]) <= 1.01
    assert min(row["sqnr_db"] for row in comparisons["fake-quant"]) > 70.0
    fp32_sqnr = [row["sqnr_db"] for row in comparisons["fp32"]]
    assert all(math.isfinite(db) and db > MIN_SQNR_VS_FP32_DB for db in fp32_sqnr), fp32_sqnr
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_run_gates_that_cannot_pass_exit_3_naming_the_step(exported, tmp_path):
    folder, pte = exported
    report = tmp_path / "report.json"
    result = cli(
        "run",
        "host",
        str(pte),
        "--inputs",
        str(folder / "steps.pt"),
        "--reference",
        SMALL,
        "--report",
        str(report),
        "--fail-below-sqnr",
        "200",
        "--max-steps-off",
        "0",
        check=False,
    )
    assert result.returncode == GATE_MISSED, result.stderr + result.stdout
    assert "vs fake-quant" in result.stdout, "the table is printed before the gate fails"
    assert result.stderr.splitlines() == [
        "qnn-mutbuf run: error: step 0 output 0: SQNR 63.5 dB vs fp32 is below "
        "--fail-below-sqnr 200 (first of 6 misses)"
    ]
    misses = json.loads(report.read_text())["gates"]["misses"]
    assert [miss.split(":")[0] for miss in misses] == [
        *(f"step {step} output 0" for step in range(5)),
        "step 4 output 0",
    ]
    assert misses[-1] == (
        "step 4 output 0: 1.00 steps of the output encoding off fake-quant is above "
        "--max-steps-off 0"
    )


def test_run_errors_are_one_line_each(exported, tmp_path):
    folder, pte = exported
    result = cli("run", "host", str(pte), "--inputs", str(tmp_path / "nope.pt"), check=False)
    assert (
        result.returncode == 1 and "--inputs" in result.stderr and "no such file" in result.stderr
    )
    bad = tmp_path / "bad.pt"
    torch.save([(torch.zeros(3),)], bad)
    result = cli("run", "host", str(pte), "--inputs", str(bad), check=False)
    assert result.returncode == 1
    assert "step 0: the program takes 2 inputs" in result.stderr
    result = cli("export", "no_such_module:factory", "-o", str(tmp_path / "x.pte"), check=False)
    assert result.returncode == 1 and "Cannot import 'no_such_module'" in result.stderr
    result = cli("export", SMALL, "-o", str(tmp_path / "x.pte"), "--soc", "SM0000", check=False)
    assert result.returncode == 1 and "Unknown SoC 'SM0000'" in result.stderr
    assert not (tmp_path / "x.pte").exists()
    report = tmp_path / "report.json"
    steps = str(folder / "steps.pt")
    arguments = ("run", "host", str(pte), "--inputs", steps, "--report", str(report))
    result = cli(*arguments, "--plot", str(tmp_path / "e.png"), check=False)
    assert result.returncode == 1 and "--plot needs --reference" in result.stderr
    assert "step   0" not in result.stdout, "the steps ran before the bad option was refused"
    assert not report.exists() and not (tmp_path / "e.png").exists()
    result = cli(*arguments, "--fail-below-sqnr", "30", "--max-steps-off", "1", check=False)
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        "qnn-mutbuf run: error: --fail-below-sqnr and --max-steps-off need --reference: "
        "there is nothing to gate against without one."
    ]
    assert "step   0" not in result.stdout, "the steps ran before the bad option was refused"
    assert not report.exists()
