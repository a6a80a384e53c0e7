"""`qnn-mutbuf diagnose` (issue 12) on the host simulator.

A fault injected into one op's QNN build (its output scale) is named, with its module
path, at step 0; a model that matches its fake-quant reports no divergence; a state
fault that compounds is named at the step where the write first departs, and a state
written in one encoding and read in another is named at the read. The report's numbers
on the model outputs are those of `run --reference`.
"""

import json
import math

import pytest
import torch
from models import RunningSum, vector_steps

import qnn_mutbuf
from qnn_mutbuf import HostRunner, diagnose, lower, quantize
from qnn_mutbuf.cli import main
from qnn_mutbuf.diagnosis.probes import module_path
from qnn_mutbuf.verify import EagerRunner, compare_steps, output_scales

STEPS = 8
DIM, CONTEXT, LAYERS = 16, 8, 2
NODE_KEYS = {"node", "op", "module", "lsb", "max_abs", "sqnr_db"}


class Attention(torch.nn.Module):
    """One head; the KV cache is written at the step's position, then attended over."""

    def __init__(self) -> None:
        super().__init__()
        self.q_proj = torch.nn.Linear(DIM, DIM, bias=False)
        self.k_proj = torch.nn.Linear(DIM, DIM, bias=False)
        self.v_proj = torch.nn.Linear(DIM, DIM, bias=False)
        self.o_proj = torch.nn.Linear(DIM, DIM, bias=False)
        self.register_buffer("k_cache", torch.zeros(1, CONTEXT, DIM))
        self.register_buffer("v_cache", torch.zeros(1, CONTEXT, DIM))

    def forward(self, x, pos, mask):
        self.k_cache.index_copy_(1, pos, self.k_proj(x))
        self.v_cache.index_copy_(1, pos, self.v_proj(x))
        scores = self.q_proj(x) @ self.k_cache.transpose(1, 2) / math.sqrt(DIM)
        return self.o_proj(torch.softmax(scores + mask, dim=-1) @ self.v_cache)


class Layer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.self_attn = Attention()
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(DIM, 2 * DIM), torch.nn.ReLU(), torch.nn.Linear(2 * DIM, DIM)
        )

    def forward(self, x, pos, mask):
        x = x + self.self_attn(x, pos, mask)
        return x + self.mlp(x)


class TinyDecoder(torch.nn.Module):
    """Two attention + MLP layers with KV caches; q and k weights drawn so that the
    attention scores spread over several units (about -7 to 3), as in a trained model."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(Layer() for _ in range(LAYERS))
        for layer in self.layers:
            torch.nn.init.normal_(layer.self_attn.q_proj.weight, std=0.6)
            torch.nn.init.normal_(layer.self_attn.k_proj.weight, std=0.6)
        self.register_buffer("positions", torch.arange(CONTEXT))

    def forward(self, x, pos):
        mask = torch.where(self.positions <= pos, 0.0, float("-inf"))
        for layer in self.layers:
            x = layer(x, pos, mask)
        return x


def decoder_steps(count: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(1, 1, DIM, generator=generator), torch.tensor([position % CONTEXT]))
        for position in range(count)
    ]


def wrong_output_scale(monkeypatch, target: str, index: int, factor: float) -> list[str]:
    """Makes the QNN build give the `index`-th `target` op of the graph it lowers an
    output encoding `factor` times coarser; returns the edge nodes it changed."""
    from executorch.backends.qualcomm.builders.node_visitor_manager import _node_visitor_dict
    from executorch.backends.qualcomm.utils.constants import QCOM_QUANT_ATTRS

    import qnn_mutbuf.builders  # noqa: F401  (ours are registered: the fault wraps them)

    visitor = _node_visitor_dict[target]
    original = visitor.define_node
    changed = []

    def define_node(self, node, nodes_to_wrappers):
        same = [n for n in node.graph.nodes if getattr(n.target, "__name__", None) == target]
        if same.index(node) != index:
            return original(self, node, nodes_to_wrappers)
        attrs = node.meta[QCOM_QUANT_ATTRS]
        node.meta[QCOM_QUANT_ATTRS] = {**attrs, "scale": attrs["scale"] * factor}
        changed.append(node.name)
        try:
            return original(self, node, nodes_to_wrappers)
        finally:
            node.meta[QCOM_QUANT_ATTRS] = attrs

    monkeypatch.setattr(visitor, "define_node", define_node)
    return changed


def nodes_of(quantized: torch.fx.GraphModule, target) -> list[torch.fx.Node]:
    return [node for node in quantized.graph.nodes if node.target == target]


def no_constants(text: str):
    raise ValueError(f"{text} in JSON")


@pytest.fixture(scope="module")
def decoder(host_sdk):
    model = TinyDecoder().eval()
    return model, quantize(model, decoder_steps(STEPS, 1), quant="8a8w")


@pytest.fixture(scope="module")
def clean(decoder):
    model, quantized = decoder
    return diagnose(quantized, decoder_steps(STEPS, 2), fp32_model=model)


def test_decoder_that_matches_fake_quant_reports_no_divergence(clean, tmp_path):
    assert clean.first_divergence is None, clean.format()
    report = json.loads(
        clean.write_json(tmp_path / "report.json").read_text(), parse_constant=no_constants
    )
    assert list(report) == ["quant", "soc", "threshold", "first_divergence", "steps"]
    assert (report["quant"], report["soc"], report["threshold"]) == ("8a8w", "SM8650", 4.0)
    assert report["first_divergence"] is None
    assert [step["step"] for step in report["steps"]] == list(range(STEPS))
    for step in report["steps"]:
        assert all(NODE_KEYS <= set(node) for node in step["nodes"])
        states = {(node["buffer"], node["op"]) for node in step["nodes"] if "buffer" in node}
        assert states == {
            (f"layers.{layer}.self_attn.{cache}", role)
            for layer in range(LAYERS)
            for cache in ("k_cache", "v_cache")
            for role in ("state read", "state write")
        }
    k_proj = next(
        n for n in report["steps"][3]["nodes"] if n["module"] == "layers.0.self_attn.k_proj"
    )
    assert k_proj["op"] == "aten.linear.default" and k_proj["sqnr_fp32_db"] > 20.0


def test_report_numbers_are_those_of_run_reference_on_the_outputs(decoder, clean):
    _, quantized = decoder
    steps = decoder_steps(STEPS, 2)
    device = HostRunner(lower(quantized, steps[0]).buffer).run(steps)
    table = compare_steps(
        "fake-quant", EagerRunner(quantized).run(steps), device, output_scales(quantized)
    )
    output = next(node for node in quantized.graph.nodes if node.op == "output")
    (produced,) = [value.args[0].args[0].name for value in output.args[0]]
    for row in table.rows:
        node = clean.node(produced, row.step)
        assert node.max_abs == pytest.approx(row.max_abs_error, rel=1e-6, abs=1e-9)
        assert node.lsb == pytest.approx(row.steps_of_encoding, rel=1e-6, abs=1e-9)


def test_fault_in_one_op_is_named_with_its_module_path_at_step_0(decoder, monkeypatch):
    """Layer 1's MLP relu, an op QNN builds as one. (A linear on 3-D inputs is built
    as reshape, FullyConnected, reshape; its value is the last reshape's.)"""
    model, quantized = decoder
    relus = nodes_of(quantized, torch.ops.aten.relu.default)
    faulty = next(n for n in relus if module_path(n) == "layers.1.mlp.1")
    changed = wrong_output_scale(monkeypatch, "aten.relu.default", relus.index(faulty), 64.0)

    diagnosis = diagnose(quantized, decoder_steps(STEPS, 2), fp32_model=model)

    assert changed, "the fault was never injected"
    first = diagnosis.first_divergence
    assert (first.step, first.node, first.op, first.module) == (
        0,
        faulty.name,
        "aten.relu.default",
        "layers.1.mlp.1",
    ), diagnosis.format()
    assert first.lsb > 8.0
    origins = [r.probe.node for r in diagnosis.steps[0].nodes if r.origin]
    assert origins == [faulty.name], "the ops it feeds only pass the error on"


def running_sum(quant: str = "16a8w"):
    model = RunningSum().eval()
    return model, quantize(model, vector_steps((1, 16))(4, 1), quant=quant)


def test_compounding_state_fault_is_named_where_its_write_first_departs(host_sdk, monkeypatch):
    """acc.add_(x) with an output scale 4 times too coarse: each step rounds the sum
    to a coarser grid, and the roundings add up through the state (top level)."""
    model, quantized = running_sum()
    writer = nodes_of(quantized, torch.ops.aten.add.Tensor)[0]
    wrong_output_scale(monkeypatch, "aten.add.Tensor", 0, 4.0)

    diagnosis = diagnose(
        quantized, vector_steps((1, 16))(STEPS, 2), fp32_model=model, delegate_mutable_buffers=False
    )

    writes = [diagnosis.node(writer.name, step) for step in range(STEPS)]
    errors = [write.lsb for write in writes]
    departs = next(step for step, write in enumerate(writes) if write.departs)
    assert departs >= 1 and errors[departs] > errors[0], errors
    first = diagnosis.first_divergence
    assert (first.step, first.node, first.op) == (departs, writer.name, "aten.add.Tensor"), errors
    read = next(r for r in diagnosis.steps[departs].nodes if r.probe.op == "state read")
    assert read.lsb <= 4.0, "the state it reads is still within"


def test_state_stored_in_the_wrong_encoding_is_named_at_its_writer_at_step_0(host_sdk, monkeypatch):
    """Delegated, the same fault makes the writer store codes of its coarse encoding,
    which the next step reads in the state encoding: what was stored is what the next
    step reads, so the writer's value is wrong from step 0 on."""
    model, quantized = running_sum()
    writer = nodes_of(quantized, torch.ops.aten.add.Tensor)[0]
    wrong_output_scale(monkeypatch, "aten.add.Tensor", 0, 4.0)

    diagnosis = diagnose(quantized, vector_steps((1, 16))(3, 2), fp32_model=model)

    first = diagnosis.first_divergence
    assert (first.step, first.node, first.op) == (0, writer.name, "aten.add.Tensor")
    assert first.lsb > 1000.0, "codes of a 4 times coarser encoding, read as the state's"
    read = diagnosis.node("acc", 1)
    assert (read.probe.op, read.origin) == ("state read", False), "it reads what was stored"


def test_cli_prints_the_table_and_writes_report_and_plot(host_sdk, tmp_path, capsys):
    from qnn_mutbuf.seed_models import decode_steps

    pytest.importorskip("matplotlib")
    steps = tmp_path / "steps.pt"
    torch.save(decode_steps(4, shape=(1, 64, 2, 8), seed=7), steps)
    report, plot = tmp_path / "r.json", tmp_path / "p.png"
    arguments = ["diagnose", "qnn_mutbuf.seed_models:small", "--inputs", str(steps)]

    assert main([*arguments, "--report", str(report), "--plot", str(plot)]) == 0

    out = capsys.readouterr().out
    assert "no divergence" in out and "k_cache" in out
    parsed = json.loads(report.read_text(), parse_constant=no_constants)
    assert parsed["quant"] == "8a8w" and len(parsed["steps"]) == 4
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert callable(qnn_mutbuf.diagnose), "the package is not the function"

    assert main([*arguments[:-1], str(tmp_path / "missing.pt")]) == 1
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and "missing.pt: no such file" in error
