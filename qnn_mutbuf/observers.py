"""Observers for calibration sets of a few decode steps.

A decoder is calibrated on a handful of sequences, and the values it meets later
(other tokens, later positions) reach a little beyond what calibration saw. Clipped
activations hurt, clipped state hurts every step after. With 16-bit encodings the
resolution to spare is large, so the range gets headroom on both sides; 8-bit
encodings keep the observed range.
"""

from __future__ import annotations

import torch
from torchao.quantization.pt2e import MinMaxObserver

DEFAULT_HEADROOM_16BIT = 0.25


class HeadroomMinMaxObserver(MinMaxObserver):
    """Min-max observer whose range is widened by `headroom` (a fraction of the
    observed span) on each side that is not pinned at zero."""

    def __init__(self, *args, headroom: float = DEFAULT_HEADROOM_16BIT, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.headroom = headroom

    @torch.jit.export
    def calculate_qparams(self):
        if not bool(torch.isfinite(self.min_val).all() and torch.isfinite(self.max_val).all()):
            return super().calculate_qparams()  # nothing finite observed: no headroom
        span = self.max_val - self.min_val
        extra = torch.clamp(span, min=0) * self.headroom
        low = torch.where(self.min_val < 0, self.min_val - extra, self.min_val)
        high = torch.where(self.max_val > 0, self.max_val + extra, self.max_val)
        return self._calculate_qparams(low, high)


def is_16bit(dtype: torch.dtype, quant_min: int | None, quant_max: int | None) -> bool:
    if quant_min is not None and quant_max is not None:
        return quant_max - quant_min > 255
    return dtype in (torch.int16, torch.uint16, torch.int32)
