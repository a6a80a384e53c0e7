"""AiHubRunner through an injected client with qai_hub's call surface, whose devices
run the uploaded context binary statelessly on the host simulator."""

import inspect

import pytest
import qai_hub
import torch
from bar import assert_identical
from fakes.aihub import FakeHub

from qnn_mutbuf import AiHubRunner, HostRunner
from qnn_mutbuf.errors import AiHubError
from qnn_mutbuf.runners.aihub import DEFAULT_DEVICE, summarize_profile


@pytest.fixture(scope="module")
def quantized_seed(host_sdk):
    from qnn_mutbuf import quantize
    from qnn_mutbuf.seed_models import small

    module, calibration, example = small()
    return quantize(module, calibration, quant="8a8w"), example


@pytest.fixture(scope="module")
def program(quantized_seed):
    from qnn_mutbuf import lower
    from qnn_mutbuf.seed_models import decode_steps

    quantized, example = quantized_seed
    program = lower(quantized, example)
    return program.buffer, decode_steps(5, shape=(1, 64, 2, 8), seed=9)


def test_top_level_state_is_refused_with_the_fix(quantized_seed):
    from qnn_mutbuf import lower

    quantized, example = quantized_seed
    program = lower(quantized, example, delegate_mutable_buffers=False)
    with pytest.raises(AiHubError, match="delegate_mutable_buffers=True"):
        AiHubRunner(program.buffer, client=FakeHub())


def test_state_threaded_through_stateless_jobs_matches_the_host(program):
    data, steps = program
    hub = FakeHub()
    runner = AiHubRunner(data, client=hub)
    outputs = runner.run(steps)
    assert_identical(HostRunner(data).run(steps), outputs, "AI Hub vs host")
    assert len(hub.uploaded) == 1 and len(hub.jobs) == len(steps)
    assert all(job.options == f"--qairt_version {runner.qairt_version}" for job in hub.jobs)
    assert runner.qairt_version == "2.51"
    assert [job.profile is not None for job in hub.jobs] == [True] + [False] * (len(steps) - 1)
    assert hub.jobs[0].device.name == DEFAULT_DEVICE
    assert "estimated inference time 1.234 ms" in runner.profile_summary
    assert "index_put (ScatterNd, NPU)" in runner.profile_summary


def test_delegated_state_is_fed_from_the_previous_step(program):
    data, steps = program
    hub = FakeHub()
    runner = AiHubRunner(data, client=hub)
    runner.run(steps)
    for state_in, state_out in runner.state_pairs.values():
        for previous, job in zip(hub.jobs, hub.jobs[1:], strict=False):
            assert (job.inputs[state_in.name][0] == previous.outputs[state_out.name][0]).all()
    if runner.flag_input is not None:
        flags = [bool(job.inputs[runner.flag_input.name][0][0]) for job in hub.jobs]
        assert flags == [False] + [True] * (len(steps) - 1)


def test_chipset_selects_by_attribute(program):
    runner = AiHubRunner(program[0], client=FakeHub(), chipset="qualcomm-snapdragon-8gen3")
    assert runner.device.attributes == ["chipset:qualcomm-snapdragon-8gen3"]


def test_missing_token_is_one_clear_error(program, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("QAIHUB_CLIENT_INI", raising=False)
    with pytest.raises(AiHubError, match="qai-hub configure --api_token"):
        AiHubRunner(program[0])


def test_every_qai_hub_call_we_make_exists_with_that_signature():
    upload = inspect.signature(qai_hub.upload_model).parameters
    assert "model" in upload
    submit = inspect.signature(qai_hub.submit_inference_job).parameters
    for keyword in ("model", "device", "inputs", "name", "options", "profile"):
        assert keyword in submit, keyword
    device = inspect.signature(qai_hub.Device).parameters
    assert "name" in device and "attributes" in device
    for method in ("download_output_data", "download_profile"):
        assert callable(getattr(qai_hub.client.InferenceJob, method))
    # Our fake must not accept calls the real client would reject.
    fake = inspect.signature(FakeHub.submit_inference_job).parameters
    assert set(fake) - {"self"} <= set(submit)


def test_profile_summary_without_profile():
    assert summarize_profile(None) == "no profile returned"
    text = summarize_profile({"execution_summary": {"estimated_inference_time": 2000}})
    assert "2.000 ms" in text and "peak memory n/a" in text


def test_program_with_cpu_ops_is_refused(host_sdk):
    from qnn_mutbuf import lower

    class WithCpuOp(torch.nn.Module):
        def forward(self, x):
            return torch.cumprod(x, dim=1) + 1  # no HTP builder for cumprod

    program = lower(WithCpuOp().eval(), (torch.rand(1, 8),), fp16=True)
    with pytest.raises(AiHubError, match="CPU"):
        AiHubRunner(program.buffer, client=FakeHub())
