"""Per-step SQNR curves as a PNG (matplotlib is an optional extra: ``[plot]``)."""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from pathlib import Path

from qnn_mutbuf.artifacts import write_atomically
from qnn_mutbuf.errors import InputError
from qnn_mutbuf.verify import ComparisonTable

CAP_DB = 150.0  # identical outputs have infinite SQNR; draw them at the cap


def pyplot():
    """matplotlib's pyplot on a file backend, or one message saying how to get it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise InputError("--plot needs matplotlib: pip install 'qnn-mutbuf[plot]'") from error
    return plt


def plot_sqnr(tables: Sequence[ComparisonTable], path: Path, title: str = "") -> Path:
    plt = pyplot()
    figure, axis = plt.subplots(figsize=(7, 4))
    for table in tables:
        outputs = sorted({row.output for row in table.rows})
        for output in outputs:
            rows = [r for r in table.rows if r.output == output]
            values = [min(r.sqnr_db, CAP_DB) if not math.isnan(r.sqnr_db) else 0 for r in rows]
            label = f"vs {table.reference}" + (f" (output {output})" if len(outputs) > 1 else "")
            axis.plot([r.step for r in rows], values, marker="o", label=label)
    axis.set_xlabel("decode step")
    axis.set_ylabel(f"SQNR (dB, capped at {CAP_DB:.0f})")
    axis.set_title(title or "per-step SQNR")
    axis.grid(True, alpha=0.3)
    axis.legend()
    figure.tight_layout()
    image = io.BytesIO()
    figure.savefig(image, format="png", dpi=120)
    plt.close(figure)
    return write_atomically(path, image.getvalue())
