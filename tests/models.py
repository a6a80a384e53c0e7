"""Small stateful models the tests lower, and their per-step inputs.

Every model returns its state (or a copy of it) so tests check the state, not only
an output computed from it. Calibration steps always reach the ends of the input
range, so test steps drawn from that range stay inside the calibrated range.
"""

from __future__ import annotations

import torch

LOW, HIGH = 0.0, 0.95


def ranged(shape, generator) -> torch.Tensor:
    """Uniform values in [LOW, HIGH] with both ends present."""
    values = torch.rand(shape, generator=generator) * (HIGH - LOW) + LOW
    flat = values.view(-1)
    flat[0], flat[-1] = LOW, HIGH
    return values


class ConvLinearAdd(torch.nn.Module):
    """No state at all: conv + linear + add, the model every QNN flow must lower."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x, y):
        return self.linear(self.conv(x).mean(dim=(2, 3))) + y


class IndexCopyCache(torch.nn.Module):
    """The seed model: k_cache (1, 1024, 12, 64), index_copy_ along dim 1."""

    def __init__(self, fill: float = 0.0, shape=(1, 1024, 12, 64)) -> None:
        super().__init__()
        self.register_buffer("k_cache", torch.full(shape, fill))

    def forward(self, input_pos, k_val):
        self.k_cache.index_copy_(1, input_pos, k_val)
        return self.k_cache + 0


class IndexPutCache(torch.nn.Module):
    """ExecuTorch's IndexPut test model, modes 0-5, on a (2, 16, 3, 4) cache."""

    SHAPE = (2, 16, 3, 4)

    def __init__(self, mode: int) -> None:
        super().__init__()
        self.mode = mode
        self.register_buffer("k_cache", torch.zeros(self.SHAPE))

    def forward(self, p0, p1, k_val):
        indices = {
            0: [p0],
            1: [None, p0],
            2: [None, None, p0],
            3: [p0, p1],
            4: [None, p0, p1],
            5: [p0, None, p1],
        }[self.mode]
        torch.ops.aten.index_put_(self.k_cache, indices, k_val)
        return self.k_cache + 0


class TensorIndexCache(torch.nn.Module):
    """A cache written with a tensor index: ``cache[:, pos] = x``."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cache", torch.zeros(1, 16, 8))

    def forward(self, pos, x):
        self.cache[:, pos] = x
        return self.cache * 1


def index_copy_steps(count, seed, shape=(1, 1024, 12, 64)):
    generator = torch.Generator().manual_seed(seed)
    row = (shape[0], 1, *shape[2:])
    return [
        (torch.tensor([(3 * step + seed) % shape[1]]), ranged(row, generator))
        for step in range(count)
    ]


def index_put_steps(mode, count, seed):
    generator = torch.Generator().manual_seed(seed)
    value_shapes = {
        0: (1, 16, 3, 4),
        1: (2, 1, 3, 4),
        2: (2, 16, 1, 4),
        3: (2, 3, 4),
        4: (2, 2, 4),
        5: (2, 16, 4),
    }
    steps = []
    for step in range(count):
        k = step + seed
        if mode == 0:
            p0, p1 = [k % 2], [0]
        elif mode == 1:
            p0, p1 = [k % 16], [0]
        elif mode == 2:
            p0, p1 = [k % 3], [0]
        elif mode == 3:
            p0, p1 = [k % 2, (k + 1) % 2], [k % 16, (k + 5) % 16]
        elif mode == 4:
            p0, p1 = [k % 16, (k + 7) % 16], [k % 3, (k + 1) % 3]
        else:
            p0, p1 = [k % 2, (k + 1) % 2], [k % 3, (k + 2) % 3]
        steps.append(
            (
                torch.tensor(p0, dtype=torch.int32),
                torch.tensor(p1, dtype=torch.int32),
                ranged(value_shapes[mode], generator),
            )
        )
    return steps


def tensor_index_steps(count, seed):
    generator = torch.Generator().manual_seed(seed)
    return [
        (torch.tensor([(step * 5 + seed) % 16]), ranged((1, 1, 8), generator))
        for step in range(count)
    ]


KV_CASES = {
    "index_copy_zeros": (lambda: IndexCopyCache(0.0), index_copy_steps),
    "index_copy_ones": (lambda: IndexCopyCache(1.0), index_copy_steps),
    **{
        f"index_put_mode{mode}": (
            (lambda mode=mode: IndexPutCache(mode)),
            (lambda count, seed, mode=mode: index_put_steps(mode, count, seed)),
        )
        for mode in range(6)
    },
    "tensor_index": (TensorIndexCache, tensor_index_steps),
}


class RunningSum(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("acc", torch.zeros(1, 16))

    def forward(self, x):
        self.acc.add_(x)
        return self.acc + 0


class MovingAverage(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("avg", torch.zeros(1, 16))

    def forward(self, x):
        self.avg.mul_(0.9).add_(0.1 * x)
        return self.avg + 0


class CountedCache(torch.nn.Module):
    """A position counter buffer indexes a KV cache: k.index_copy_(1, pos, x); pos.add_(1)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("k", torch.zeros(1, 16, 8))
        self.register_buffer("pos", torch.zeros(1, dtype=torch.long))

    def forward(self, x):
        self.k.index_copy_(1, self.pos, x)
        self.pos.add_(1)
        return self.k + 0


class CoupledState(torch.nn.Module):
    """Two buffers; the second update reads the first (already updated) one."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("a", torch.zeros(1, 16))
        self.register_buffer("b", torch.zeros(1, 16))

    def forward(self, x):
        self.a.add_(x)
        self.b.mul_(0.5).add_(self.a)
        return self.b + 0


class RingBuffer(torch.nn.Module):
    """A sliding window: write position pos % window."""

    WINDOW = 4

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("ring", torch.zeros(1, self.WINDOW, 8))
        self.register_buffer("pos", torch.zeros(1, dtype=torch.long))

    def forward(self, x):
        self.ring.index_copy_(1, self.pos % self.WINDOW, x)
        self.pos.add_(1)
        return self.ring + 0


def vector_steps(shape):
    def make(count, seed):
        generator = torch.Generator().manual_seed(seed)
        return [(ranged(shape, generator),) for _ in range(count)]

    return make


INPLACE_CASES = {
    # name: (model factory, steps factory, multiplies its own state every step)
    "running_sum": (RunningSum, vector_steps((1, 16)), False),
    "moving_average": (MovingAverage, vector_steps((1, 16)), True),
    "counted_cache": (CountedCache, vector_steps((1, 1, 8)), False),
    "coupled_state": (CoupledState, vector_steps((1, 16)), True),
    "ring_buffer": (RingBuffer, vector_steps((1, 1, 8)), False),
}
