"""Positions read with ``.item()`` (issue 10, item 6): ExecuTorch's own llama KV
caches, whose write indices come from ``input_pos[0].item()``, keep their positions
tensors, match eager at every position (ring wrap-around included) and run on the
HTP simulator, delegated and top-level; uses we cannot keep static are refused."""

import copy

import pytest
import torch
from bar import assert_identical, assert_within_steps
from executorch.examples.models.llama.attention import KVCache, RingKVCache
from executorch.examples.models.llama.llama_transformer import construct_transformer
from executorch.examples.models.llama.model_args import ModelArgs
from executorch.examples.models.llama.rope import Rope
from executorch.examples.models.llama.source_transformation.custom_kv_cache import (
    replace_kv_cache_with_ring_kv_cache,
)

from qnn_mutbuf import HostRunner, lower, quantize
from qnn_mutbuf.errors import UnsupportedMutationError
from qnn_mutbuf.passes.scalar_positions import tensorize_scalar_positions
from qnn_mutbuf.verify import EagerRunner, compare_steps, output_scales

CONTEXT = 16
WINDOW = 4  # RingKVCache keeps 2 * WINDOW slots: writes wrap from position 8 on
STEPS = 12
HEADS, HEAD_DIM = 2, 8
KV_RANGE = 2.0  # k/v projections of a small llama stay within a few units


class GlobalCacheStep(torch.nn.Module):
    """One decode step of AttentionMHA with enable_dynamic_shape=True, minus the
    projections: RoPE frequencies narrowed at ``input_pos[-1].item()`` and the
    KVCache written at ``arange(seq_len) + input_pos[0].item()``. Returns the caches
    and frequencies, so the state and the lookup are both checked."""

    def __init__(self) -> None:
        super().__init__()
        args = ModelArgs(
            dim=HEADS * HEAD_DIM,
            n_heads=HEADS,
            head_dim=HEAD_DIM,
            max_seq_len=CONTEXT,
            max_context_len=CONTEXT,
            use_kv_cache=True,
            enable_dynamic_shape=True,
        )
        self.rope = Rope(args)
        self.kv_cache = KVCache(1, CONTEXT, HEADS, HEAD_DIM, enable_dynamic_shape=True)

    def forward(self, input_pos, k_val, v_val):
        freqs_cos, freqs_sin = self.rope.get_freqs(input_pos, k_val.size(2))
        k, v = self.kv_cache.update(input_pos, k_val, v_val)
        return k + 0, v + 0, freqs_cos + 0, freqs_sin + 0


class RingCacheStep(torch.nn.Module):
    """RingKVCache.update as a ``--local_global_attention`` layer runs it: indices
    ``(arange + start_pos) % 8`` and cache_positions kept with ``arange < start_pos``.
    Returns the caches and the (integer) cache positions."""

    def __init__(self, enable_dynamic_shape: bool = True) -> None:
        super().__init__()
        self.kv_cache = RingKVCache(1, WINDOW, HEADS, HEAD_DIM, enable_dynamic_shape)

    def forward(self, input_pos, k_val, v_val):
        k, v = self.kv_cache.update(input_pos, k_val, v_val)
        positions = self.kv_cache.cache_positions_manager.cache_positions
        return k + 0, v + 0, positions + 0


class RingMaskStep(RingCacheStep):
    """The ring cache plus its sliding-window mask, as AttentionMHA builds it after
    the update (``start_pos + arange``, ``delta < window``, ``where(.., 0, -inf)``)."""

    def forward(self, input_pos, k_val, v_val):
        outputs = super().forward(input_pos, k_val, v_val)
        mask = self.kv_cache.create_causal_mask_for_ring_buffer(input_pos[0].item(), k_val.size(2))
        return *outputs, mask


class CountedWrites(torch.nn.Module):
    """A position counter buffer read with ``.item()`` before it is advanced: the
    write must land where the counter was, not where it is after ``add_``."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("position", torch.zeros(1, dtype=torch.long))
        self.register_buffer("cache", torch.zeros(1, HEADS, CONTEXT, HEAD_DIM))

    def forward(self, input_pos, k_val, v_val):
        start_pos = self.position.item()
        torch._check_is_size(start_pos)
        torch._check(start_pos < CONTEXT)
        self.position.add_(1)
        self.cache.index_copy_(2, torch.arange(k_val.size(2)) + start_pos, k_val + v_val)
        return self.cache + 0, self.position + 0


class TransformerStep(torch.nn.Module):
    """ExecuTorch's llama Transformer called as its runner calls it (tokens and
    ``{"input_pos": ...}``)."""

    def __init__(self, transformer: torch.nn.Module) -> None:
        super().__init__()
        self.transformer = transformer

    def forward(self, tokens, input_pos):
        return self.transformer(tokens, {"input_pos": input_pos})


def decode_steps(count: int, seed: int) -> list[tuple[torch.Tensor, ...]]:
    """Positions 0, 1, ... as int64 tensors (as export_llama feeds them); k and v
    uniform in [-KV_RANGE, KV_RANGE] with both ends present."""
    generator = torch.Generator().manual_seed(seed)
    steps = []
    for position in range(count):
        values = []
        for _ in range(2):
            value = (torch.rand(1, HEADS, 1, HEAD_DIM, generator=generator) * 2 - 1) * KV_RANGE
            value.view(-1)[0], value.view(-1)[-1] = -KV_RANGE, KV_RANGE
            values.append(value)
        steps.append((torch.tensor([position]), *values))
    return steps


SCALAR_READS = (torch.ops.aten.item.default, torch.ops.aten._local_scalar_dense.default)


def _scalars_left(graph_module: torch.fx.GraphModule) -> list[str]:
    return [
        node.name
        for node in graph_module.graph.nodes
        if node.target in SCALAR_READS or isinstance(node.meta.get("val"), torch.SymInt)
    ]


def _new_nodes_without_metadata(rewritten, reference) -> list[str]:
    """New nodes need a fake value and the source metadata of the node they replace."""
    before = {node.name for node in reference.graph.nodes}
    return [
        node.name
        for node in rewritten.graph.nodes
        if node.name not in before
        and not (
            isinstance(node.meta.get("val"), torch.Tensor)
            and all(key in node.meta for key in ("stack_trace", "nn_module_stack"))
        )
    ]


# --- the pass alone, eagerly -----------------------------------------------------------


@pytest.mark.parametrize(
    "make_model",
    [GlobalCacheStep, RingCacheStep, RingMaskStep, lambda: RingMaskStep(False), CountedWrites],
    ids=["kv_cache_and_rope", "ring", "ring_and_mask", "ring_static_shape", "counter_buffer"],
)
def test_positions_stay_tensors_and_match_eager(make_model):
    steps = decode_steps(STEPS, 3)
    graph_module = torch.export.export(make_model().eval(), steps[0], strict=True).module()
    reference = copy.deepcopy(graph_module)
    rewritten = tensorize_scalar_positions(graph_module)
    assert _scalars_left(rewritten) == []
    assert _new_nodes_without_metadata(rewritten, reference) == []
    assert_identical(EagerRunner(reference).run(steps), EagerRunner(rewritten).run(steps))


def test_llama_transformer_with_a_ring_layer_matches_eager():
    args = ModelArgs(
        dim=32,
        n_layers=2,
        n_heads=2,
        vocab_size=64,
        hidden_dim=64,
        max_seq_len=CONTEXT,
        max_context_len=CONTEXT,
        use_kv_cache=True,
        enable_dynamic_shape=True,
    )
    torch.manual_seed(0)
    transformer = construct_transformer(args).eval()
    replace_kv_cache_with_ring_kv_cache(transformer, layer_sizes=[WINDOW, 0])
    steps = [(torch.tensor([[7 * p % 64]]), torch.tensor([p])) for p in range(CONTEXT - 2)]
    model = TransformerStep(transformer)
    graph_module = torch.export.export(model, steps[0], strict=True).module()
    reference = copy.deepcopy(graph_module)
    rewritten = tensorize_scalar_positions(graph_module)
    assert _scalars_left(rewritten) == []
    assert_identical(EagerRunner(reference).run(steps), EagerRunner(rewritten).run(steps))


# --- end to end on the host simulator ------------------------------------------------


def check_on_htp(model, delegate: bool) -> None:
    """16a8w, one lowering: every step within one output step of fake-quant, every
    float output within the state and output steps of fp32, integer state exact."""
    calibration = decode_steps(STEPS, 1)
    steps = decode_steps(STEPS, 2)
    quantized = quantize(model, calibration, quant="16a8w")
    scales = output_scales(quantized)
    fake_quant = EagerRunner(quantized).run(steps)
    fp32 = EagerRunner(model).run(steps)
    state_scale = max(e.scale for e in quantized.meta["qnn_mutbuf"].state_encodings.values())

    program = lower(quantized, calibration[0], delegate_mutable_buffers=delegate)
    report = program.qnn_mutbuf_report
    assert report.cpu_ops == [], f"ops left on CPU: {report.cpu_ops}"
    device = HostRunner(program.buffer).run(steps)

    for index, scale in enumerate(scales):
        want_fq = [[outputs[index]] for outputs in fake_quant]
        want_fp32 = [[outputs[index]] for outputs in fp32]
        got = [[outputs[index]] for outputs in device]
        if scale is None:  # integer state: positions must be exact
            assert_identical(want_fq, got, f"output {index} vs fake-quant:")
            assert_identical(want_fp32, got, f"output {index} vs fp32:")
            continue
        assert_within_steps(want_fq, got, scale, 1.0, f"output {index} vs fake-quant:")
        assert_within_steps(want_fp32, got, 1.0, state_scale + scale, f"output {index} vs fp32:")
    assert compare_steps("fp32", fp32, device).min_sqnr() >= 60.0


@pytest.mark.parametrize("delegate", [True, False], ids=["delegated", "top_level"])
def test_kv_cache_and_rope_positions_on_htp(delegate, host_sdk):
    check_on_htp(GlobalCacheStep().eval(), delegate)


@pytest.mark.parametrize("delegate", [True, False], ids=["delegated", "top_level"])
def test_ring_cache_positions_wrap_on_htp(delegate, host_sdk):
    check_on_htp(RingCacheStep().eval(), delegate)


# --- refused uses ------------------------------------------------------------------


class ZerosOfPositionLength(torch.nn.Module):
    """The position used as a shape."""

    def forward(self, input_pos, x):
        start_pos = input_pos[0].item()
        torch._check_is_size(start_pos)
        torch._check(start_pos < CONTEXT)
        return x + x.new_zeros(start_pos).sum()


class PrefixOfCache(torch.nn.Module):
    """A slice whose length is the position."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cache", torch.zeros(1, CONTEXT, 4))

    def forward(self, input_pos, x):
        start_pos = input_pos[0].item()
        torch._check_is_size(start_pos)
        torch._check(start_pos < CONTEXT)
        self.cache.index_copy_(1, input_pos, x)
        return self.cache[:, :start_pos].sum() + x


class AddIntoWindow(torch.nn.Module):
    """An in-place update through a slice at the position."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cache", torch.zeros(1, CONTEXT, 4))

    def forward(self, input_pos, x):
        start_pos = input_pos[0].item()
        torch._check_is_size(start_pos)
        torch._check(start_pos < CONTEXT)
        self.cache[:, start_pos : start_pos + 1].add_(x)
        return self.cache + 0


@pytest.mark.parametrize(
    ("model", "source_line"),
    [
        (ZerosOfPositionLength, "x.new_zeros(start_pos)"),
        (PrefixOfCache, "self.cache[:, :start_pos]"),
        (AddIntoWindow, "self.cache[:, start_pos : start_pos + 1].add_(x)"),
    ],
    ids=["shape", "position_dependent_length", "in_place_through_window"],
)
def test_unsupported_use_is_refused_with_the_source_line(model, source_line):
    steps = [(torch.tensor([2]), torch.ones(1, 1, 4))]
    with pytest.raises(UnsupportedMutationError) as refused:
        quantize(model().eval(), steps, quant="16a8w")
    message = str(refused.value)
    assert "\n" not in message
    assert source_line in message and "test_scalar_positions.py" in message
    assert "pass the positions as a tensor" in message
