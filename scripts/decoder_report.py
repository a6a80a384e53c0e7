"""Quantize, lower and run a decode step; print the per-step logits table.

Shared by the decoder scripts: qnn_mutbuf's quantize/lower with the caches inside the
delegate, the host simulator, and fp32 / fake-quant references on the same steps.
"""

from __future__ import annotations

import time

import torch


def report(name: str, model: torch.nn.Module, calibration: list, steps: list, quant: str):
    """Quantize, lower for SM8650 with the caches delegated, run, print the table;
    returns the ExecuTorch program."""
    from qnn_mutbuf import HostRunner, lower, quantize
    from qnn_mutbuf.native_output import captured_native_output
    from qnn_mutbuf.verify import EagerRunner, decode_table, format_decode_table

    start = time.monotonic()
    with captured_native_output():
        quantized = quantize(model, calibration, quant=quant)
        program = lower(quantized, calibration[0], soc="SM8650")
    lowering = program.qnn_mutbuf_report
    print(
        f"{name}, {quant}: quantized and lowered in {time.monotonic() - start:.1f}s; "
        f"{lowering.nodes_on_htp} nodes on HTP, CPU ops: {lowering.cpu_ops or 'none'}"
    )
    print(f"state in the delegate: {', '.join(lowering.delegated_buffers)}")
    print(f"state at top level: {', '.join(lowering.top_level_buffers) or 'none'}")
    with captured_native_output():
        device = HostRunner(program.buffer).run(steps)
    rows = decode_table(EagerRunner(model).run(steps), EagerRunner(quantized).run(steps), device)
    print(format_decode_table(rows))
    return program
