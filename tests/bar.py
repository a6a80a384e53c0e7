"""Shared assertions of the correctness bars: per step, per output, in quantization steps."""

from __future__ import annotations

import torch

FLOAT_SLACK = 1e-6  # float32 representation of dequantized values near 1


def assert_within_steps(expected, actual, scale, steps=1.0, what=""):
    """Every element of every step within `steps` quantization steps of `scale`."""
    for index, (want, got) in enumerate(zip(expected, actual, strict=True)):
        for k, (w, g) in enumerate(zip(want, got, strict=True)):
            error = (g.double() - w.double()).abs().max().item()
            limit = steps * scale * (1 + 1e-3) + FLOAT_SLACK * max(1.0, w.abs().max().item())
            assert error <= limit, (
                f"{what} step {index} output {k}: max|err| {error:.3g} = {error / scale:.2f} "
                f"steps of {scale:.3g} (limit {steps})"
            )


def assert_identical(first, second, what=""):
    for index, (a, b) in enumerate(zip(first, second, strict=True)):
        for k, (x, y) in enumerate(zip(a, b, strict=True)):
            assert torch.equal(x, y), f"{what} step {index} output {k} differs"
