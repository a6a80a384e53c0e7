"""Stateful models written the way users write them, for the entry-point tests.

Each one keeps its state in a way our own tests used to avoid: a cache that starts
at ones, a buffer *reassigned* in forward, a state written under ``no_grad``, the
LLM signature ``forward(tokens, {"input_pos": ...})``, and state kept in a plain
tensor attribute that was never registered. Every model returns its state.
"""

from __future__ import annotations

import torch
from models import IndexCopyCache, index_copy_steps, ranged

from qnn_mutbuf import MutableBufferQnnQuantizer, quantize
from qnn_mutbuf.lowering import quant_dtype

CACHE_SHAPE = (1, 16, 4, 8)


def ones_cache() -> torch.nn.Module:
    return IndexCopyCache(fill=1.0, shape=CACHE_SHAPE)


def ones_cache_steps(count: int, seed: int) -> list[tuple]:
    return index_copy_steps(count, seed, shape=CACHE_SHAPE)


class ReassignedSum(torch.nn.Module):
    """``self.total = self.total + x``: strict export records no write for it."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("total", torch.zeros(1, 16))

    def forward(self, x):
        self.total = self.total + x
        return self.total * 1


class ReassignedRecurrence(torch.nn.Module):
    """An RNN-style cell whose hidden state is reassigned: ``self.h = tanh(...)``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.proj = torch.nn.Linear(16, 16)
        self.register_buffer("h", torch.zeros(1, 16))

    def forward(self, x):
        self.h = torch.tanh(self.proj(x) + 0.5 * self.h)
        return self.h * 1


class NoGradConvState(torch.nn.Module):
    """A streaming depthwise conv whose window is written under ``torch.no_grad()``."""

    def __init__(self, channels: int = 8, kernel: int = 4) -> None:
        super().__init__()
        torch.manual_seed(4)
        self.weight = torch.nn.Parameter(torch.rand(channels, kernel) - 0.3)
        self.register_buffer("conv_state", torch.zeros(1, channels, kernel))

    def forward(self, x):
        with torch.no_grad():
            window = torch.cat([self.conv_state[:, :, 1:], x], dim=-1)
            self.conv_state.copy_(window)
        return (window * self.weight).sum(-1), window * 1


class DictPositionsCache(torch.nn.Module):
    """ExecuTorch's LLM signature: ``forward(tokens, {"input_pos": positions})``."""

    def __init__(self, vocab: int = 32) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.embed = torch.nn.Embedding(vocab, CACHE_SHAPE[2] * CACHE_SHAPE[3])
        self.register_buffer("k_cache", torch.zeros(CACHE_SHAPE))

    def forward(self, tokens, attn_options):
        values = self.embed(tokens).view(1, -1, CACHE_SHAPE[2], CACHE_SHAPE[3])
        self.k_cache.index_copy_(1, attn_options["input_pos"], values)
        return self.k_cache + 0


class UnregisteredPosition(torch.nn.Module):
    """Keeps its write position in a plain tensor attribute, as transformers 5's
    ``StaticLayer.cumulative_length`` does, and advances it in place."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cache", torch.zeros(1, 16, 8))
        self.position = torch.zeros(1, dtype=torch.long)

    def forward(self, x):
        self.cache.index_copy_(1, self.position, x)
        self.position.add_(1)
        return self.cache + 0


def vector_steps(shape, high: float = 0.95):
    def make(count: int, seed: int) -> list[tuple]:
        generator = torch.Generator().manual_seed(seed)
        return [(ranged(shape, generator) * (high / 0.95),) for _ in range(count)]

    return make


def dict_position_steps(count: int, seed: int) -> list[tuple]:
    # Tokens from the four that any four calibration steps all see, so that no test
    # value lies outside the calibrated output range (where fake-quant clips and the
    # HTP, having folded ``cache + 0`` into the state's encoding, does not).
    return [
        (
            torch.tensor([[(3 * step + seed) % 4]]),
            {"input_pos": torch.tensor([(5 * step + seed) % CACHE_SHAPE[1]])},
        )
        for step in range(count)
    ]


# name: (model factory, steps factory, indices of the outputs that are the state)
ENTRY_CASES = {
    "ones_cache": (ones_cache, ones_cache_steps, (0,)),
    "reassigned_sum": (ReassignedSum, vector_steps((1, 16), high=0.1), (0,)),
    "no_grad_conv_state": (NoGradConvState, vector_steps((1, 8, 1)), (1,)),
    "dict_positions": (DictPositionsCache, dict_position_steps, (0,)),
    "unregistered_position": (UnregisteredPosition, vector_steps((1, 1, 8)), (0,)),
}


def drop_in_quantize(model, calibration, quant, strict=False):
    """What a user's own export script does, with our quantizer where QnnQuantizer was:
    torch.export's default (non-strict) or, as ExecuTorch's QNN scripts do, strict."""
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    exported = torch.export.export(model, calibration[0], strict=strict)
    quantizer = MutableBufferQnnQuantizer()
    quantizer.set_default_quant_config(quant_dtype(quant))
    prepared = prepare_pt2e(exported.module(), quantizer)
    with torch.no_grad():
        for inputs in calibration:
            prepared(*inputs)
    return convert_pt2e(prepared)


PATHS = {
    "quantize": lambda m, c, q: quantize(m, c, quant=q),
    "drop_in": lambda m, c, q: drop_in_quantize(m, c, q),
    "drop_in_strict": lambda m, c, q: drop_in_quantize(m, c, q, strict=True),
}
# What torch.export itself breaks before any quantizer sees the graph (torch 2.13),
# shown by tests/test_entry_points.py; qnn_mutbuf.quantize handles both.
TORCH_LIMITS = {
    ("reassigned_sum", "drop_in_strict"): "strict export drops a reassigned buffer's write",
    ("unregistered_position", "drop_in"): "non-strict export advances unregistered state",
}
