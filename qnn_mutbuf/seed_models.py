"""The seed KV-cache model the project started from, and its MODEL factory.

``IndexCopyCache`` keeps a key cache of shape (1, 1024, 12, 64) in a registered
buffer and writes one position per step with ``index_copy_`` along dim 1, like a
decoder's KV cache. ``qnn-mutbuf demo`` and the README's first command run it.
"""

from __future__ import annotations

import torch


class IndexCopyCache(torch.nn.Module):
    """``k_cache.index_copy_(1, pos, k)``; returns the whole cache (``k_cache + 0``)."""

    def __init__(self, shape: tuple[int, ...] = (1, 1024, 12, 64), fill: float = 0.0) -> None:
        super().__init__()
        self.register_buffer("k_cache", torch.full(shape, fill))

    def forward(self, input_pos: torch.Tensor, k_val: torch.Tensor) -> torch.Tensor:
        self.k_cache.index_copy_(1, input_pos, k_val)
        return self.k_cache + 0


def decode_steps(
    count: int, shape: tuple[int, ...] = (1, 1024, 12, 64), seed: int = 0, start: int = 0
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`count` decode steps: position start+i and a new row of values in [-1, 1]."""
    generator = torch.Generator().manual_seed(seed)
    row = (shape[0], 1, *shape[2:])
    steps = []
    for index in range(count):
        values = torch.rand(row, generator=generator) * 2 - 1
        steps.append((torch.tensor([(start + index) % shape[1]]), values))
    return steps


def seed(calibration_steps: int = 8) -> tuple[torch.nn.Module, list, tuple]:
    """MODEL factory: ``qnn_mutbuf.seed_models:seed``."""
    module = IndexCopyCache().eval()
    calibration = decode_steps(calibration_steps, seed=1)
    return module, calibration, calibration[0]


def small(calibration_steps: int = 8) -> tuple[torch.nn.Module, list, tuple]:
    """MODEL factory with a (1, 64, 2, 8) cache initialised to ones, for quick runs."""
    shape = (1, 64, 2, 8)
    module = IndexCopyCache(shape, fill=1.0).eval()
    calibration = decode_steps(calibration_steps, shape=shape, seed=1)
    return module, calibration, calibration[0]
