"""The diagnosis as a picture: a steps x nodes heat map of the error in steps of each
node's encoding, the first divergence marked (matplotlib, the ``[plot]`` extra)."""

from __future__ import annotations

import io
import math
import os
from pathlib import Path

from qnn_mutbuf.artifacts import write_atomically
from qnn_mutbuf.diagnosis.report import Diagnosis

LABELLED_NODES = 60  # more node names than this on the axis are unreadable


def plot_lsb_heatmap(diagnosis: Diagnosis, path: str | os.PathLike, title: str = "") -> Path:
    """Rows are steps, columns nodes in graph order; green is within the threshold,
    red beyond it (a NaN is drawn as the worst value)."""
    import numpy as np
    from matplotlib.colors import TwoSlopeNorm

    from qnn_mutbuf.plot import pyplot

    plt = pyplot()
    names = [result.probe.node for result in diagnosis.steps[0].nodes] if diagnosis.steps else []
    values = np.array(
        [[result.lsb for result in step.nodes] for step in diagnosis.steps], dtype=float
    ).reshape(len(diagnosis.steps), len(names))
    finite = values[np.isfinite(values)]
    threshold = max(diagnosis.threshold, 1e-9)
    top = max(2 * threshold, float(finite.max()) if finite.size else 0.0)
    values = np.where(np.isfinite(values), values, top)

    figure, axis = plt.subplots(figsize=(min(4 + 0.25 * len(names), 24), 2 + 0.4 * len(values)))
    image = axis.imshow(
        values,
        aspect="auto",
        interpolation="nearest",
        cmap="RdYlGn_r",
        norm=TwoSlopeNorm(vmin=0.0, vcenter=threshold, vmax=top),
    )
    colorbar = figure.colorbar(image, ax=axis)
    colorbar.set_label(f"max|HTP - fake-quant| in steps (threshold {diagnosis.threshold:g})")
    every = max(1, math.ceil(len(names) / LABELLED_NODES))
    axis.set_xticks(range(0, len(names), every))
    axis.set_xticklabels(names[::every], rotation=90, fontsize=7)
    axis.set_yticks(range(len(values)))
    axis.set_ylabel("step")
    first = diagnosis.first_divergence
    if first is not None:
        column = names.index(first.node)
        axis.add_patch(
            plt.Rectangle(
                (column - 0.5, first.step - 0.5), 1, 1, fill=False, edgecolor="black", linewidth=2
            )
        )
        axis.annotate(
            f"first divergence: {first.node}",
            (column, first.step),
            xytext=(8, -8),
            textcoords="offset points",
            fontsize=8,
            bbox={"boxstyle": "round", "facecolor": "white", "alpha": 0.8},
        )
    axis.set_title(title or "diagnose: error per step and node")
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=120)
    plt.close(figure)
    return write_atomically(path, buffer.getvalue())
