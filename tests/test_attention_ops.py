"""Attention-side patterns real decoders bring, on the host simulator.

* a relative position bias looked up from a narrow table whose last row is first
  reached late in the decode (T5's last bucket), where the HTP's Gather misreads the
  last row of a narrow table;
* that bias masked with ``where(causal, bias, finfo.min)`` and added to the scores,
  which quantized as it is loses the bias to the -inf range;
* the partition merge that keeps a fully supported graph in one delegate.
"""

import pytest
import torch
from torch.fx import Graph

from qnn_mutbuf import HostRunner, lower, quantize
from qnn_mutbuf.partitioner import DELEGATION_TAG, merge_convex_partitions
from qnn_mutbuf.verify import EagerRunner, sqnr_db

CACHE = 32
STEPS = 24  # T5's last bucket (distance >= 20 with 8 buckets, max distance 32) is reached


def _bucket(relative: torch.Tensor, buckets: int = 8, max_distance: int = 32) -> torch.Tensor:
    """T5's unidirectional relative position bucket, written the way transformers does."""
    relative = -torch.min(relative, torch.zeros_like(relative))
    exact = buckets // 2
    large = exact + (
        torch.log(relative.float() / exact) / torch.log(torch.tensor(max_distance / exact)) * exact
    ).to(torch.long)
    large = torch.min(large, torch.full_like(large, buckets - 1))
    return torch.where(relative < exact, relative, large)


class BiasedAttention(torch.nn.Module):
    """One decode step of attention over a KV cache with a T5-style position bias."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.bias = torch.nn.Embedding(8, 2)
        self.register_buffer("keys", torch.zeros(1, 2, CACHE, 8))

    def forward(self, query, key, cache_position):
        self.keys.index_copy_(2, cache_position, key)
        memory = torch.arange(CACHE)[None, :]
        context = cache_position[:, None]
        bias = self.bias(_bucket(memory - context)).permute(2, 0, 1).unsqueeze(0)
        visible = (memory <= context)[None, None]
        masked_bias = torch.where(visible, bias, torch.finfo(torch.float32).min)
        scores = query @ self.keys.transpose(-1, -2) + masked_bias
        return torch.softmax(scores, dim=-1), self.keys * 1


def _steps(count: int, seed: int) -> list[tuple]:
    generator = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(1, 2, 1, 8, generator=generator) * 0.5,
            torch.randn(1, 2, 1, 8, generator=generator),
            torch.tensor([i]),
        )
        for i in range(count)
    ]


@pytest.fixture(scope="module")
def biased(host_sdk):
    model = BiasedAttention().eval()
    quantized = quantize(model, _steps(CACHE, seed=1), quant="16a8w")
    program = lower(quantized, _steps(1, seed=1)[0])
    steps = _steps(STEPS, seed=2)
    return {
        "program": program,
        "device": HostRunner(program.buffer).run(steps),
        "fake_quant": EagerRunner(quantized).run(steps),
        "fp32": EagerRunner(BiasedAttention().eval()).run(steps),
    }


def test_position_bias_survives_the_mask_every_step(biased):
    for step, (device, reference, fp32) in enumerate(
        zip(biased["device"], biased["fake_quant"], biased["fp32"], strict=True)
    ):
        assert sqnr_db(fp32[0], reference[0]) >= 35.0, f"step {step}: fake-quant vs fp32"
        assert sqnr_db(reference[0], device[0]) >= 40.0, f"step {step}: HTP vs fake-quant"


def test_masked_positions_get_no_weight(biased):
    for step, outputs in enumerate(biased["device"]):
        masked = outputs[0][..., step + 1 :]
        assert masked.numel() and float(masked.abs().max()) < 1e-3, f"step {step}"
        assert abs(float(outputs[0].sum(dim=-1).mean()) - 1.0) < 1e-2, f"step {step}"


def test_cache_state_matches_fake_quant(biased):
    assert sqnr_db(biased["fake_quant"][-1][1], biased["device"][-1][1]) >= 40.0


def test_narrow_table_last_row_on_htp(host_sdk):
    class Lookup(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.table = torch.nn.Embedding(8, 4)

        def forward(self, index):
            return self.table(index) * 1

    steps = [(torch.arange(32).remainder(8).view(1, 32),)]
    quantized = quantize(Lookup().eval(), steps, quant="16a8w")
    device = HostRunner(lower(quantized, steps[0]).buffer).run(steps)
    reference = EagerRunner(quantized).run(steps)
    torch.testing.assert_close(device[0][0], reference[0][0], atol=1e-3, rtol=0)


def _chain(tags: list[str | None]) -> Graph:
    """x -> n0 -> n1 -> ... with the given delegation tags."""
    graph = Graph()
    value = graph.placeholder("x")
    for index, tag in enumerate(tags):
        value = graph.call_function(torch.neg, (value,), name=f"n{index}")
        if tag is not None:
            value.meta[DELEGATION_TAG] = tag
    graph.output(value)
    return graph


def test_adjacent_partitions_merge():
    graph = _chain(["qnn_0", "qnn_0", "qnn_1", "qnn_1"])
    assert merge_convex_partitions(graph) == ["qnn_1"]
    assert {n.meta.get(DELEGATION_TAG) for n in graph.nodes if n.op == "call_function"} == {"qnn_0"}


def test_partitions_around_a_cpu_op_stay_apart():
    graph = _chain(["qnn_0", None, "qnn_1"])
    assert merge_convex_partitions(graph) == []
