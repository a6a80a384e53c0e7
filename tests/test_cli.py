"""The qnn-mutbuf command line: demo, export + run host with --reference, errors, help."""

import json
import subprocess
import sys

import pytest
import torch

SMALL = "qnn_mutbuf.seed_models:small"


def cli(*arguments, check=True):
    result = subprocess.run(
        [sys.executable, "-m", "qnn_mutbuf.cli", *arguments], capture_output=True, text=True
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


def test_doctor_passes_on_this_machine():
    result = cli("doctor")
    assert "QAIRT          2." in result.stdout
    assert "HTP device     created for SM8650" in result.stdout
    assert "api_token" not in result.stdout.lower() or "configure" in result.stdout


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
    )
    assert "step   4:" in result.stdout
    assert "vs fake-quant" in result.stdout
    data = json.loads(report.read_text())
    assert data["steps"] == 5
    fake_quant = next(c for c in data["comparisons"] if c["reference"] == "fake-quant")
    assert max(float(row["steps_of_encoding"] or 0) for row in fake_quant["rows"]) <= 1.01 or all(
        float(row["max_abs_error"]) < 0.01 for row in fake_quant["rows"]
    )
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


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
