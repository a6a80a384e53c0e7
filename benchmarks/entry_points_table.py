"""The entry-points bar as a table: pattern x path x placement x quant -> worst step.

Runs the models of tests/entry_models.py (a ones-initialised cache, a reassigned
buffer, a no_grad conv state, the LLM dict signature, unregistered state) through
``qnn_mutbuf.quantize`` and the drop-in PT2E path (torch.export non-strict and strict),
at 8a8w and 16a8w, state delegated and at top level, for 8 steps on the host
simulator. Prints, per combination, the worst error against fake-quant in steps of
the coarser of the output and state encodings, the worst error against fp32 in state
steps, and the min SQNR against fp32 over all outputs.

    python benchmarks/entry_points_table.py [--steps 8] [--out benchmarks/results/entry_points.md]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def main() -> int:
    from entry_models import ENTRY_CASES, PATHS, TORCH_LIMITS

    from qnn_mutbuf import HostRunner, lower
    from qnn_mutbuf.lowering import read_state_encodings
    from qnn_mutbuf.native_output import captured_native_output
    from qnn_mutbuf.verify import EagerRunner, compare_steps, output_scales

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    header = (
        "| pattern | path | placement | quant | worst vs fake-quant (steps) "
        "| worst vs fp32 (state steps) | min SQNR vs fp32 dB |"
    )
    lines = [header, "|---|---|---|---|---|---|---|"]
    for case in sorted(ENTRY_CASES):
        make_model, make_steps, state_outputs = ENTRY_CASES[case]
        for path in sorted(PATHS):
            for quant in ("8a8w", "16a8w"):
                if (case, path) in TORCH_LIMITS:
                    row = f"| {case} | {path} | both | {quant} | refused by torch.export: "
                    lines.append(row + f"{TORCH_LIMITS[case, path]} | | |")
                    continue
                model = make_model().eval()
                calibration = make_steps(args.steps, 1)
                steps = make_steps(args.steps, 2)
                with captured_native_output(True):
                    quantized = PATHS[path](model, calibration, quant)
                state_step = max(e.scale for e in read_state_encodings(quantized).values())
                scales = output_scales(quantized)
                fake_quant = EagerRunner(quantized).run(steps)
                fp32 = EagerRunner(make_model().eval()).run(steps)
                for delegate in (True, False):
                    with captured_native_output(True):
                        program = lower(
                            quantized, calibration[0], delegate_mutable_buffers=delegate
                        )
                        device = HostRunner(program.buffer).run(steps)
                    versus_fq = compare_steps("fake-quant", fake_quant, device, scales)
                    versus_fp32 = compare_steps("fp32", fp32, device, scales)
                    worst_fq = max(
                        row.max_abs_error / max(scales[row.output] or state_step, state_step)
                        for row in versus_fq.rows
                    )
                    worst_fp32 = max(
                        row.max_abs_error / state_step
                        for row in versus_fp32.rows
                        if row.output in state_outputs
                    )
                    placement = "delegated" if delegate else "top level"
                    lines.append(
                        f"| {case} | {path} | {placement} | {quant} | {worst_fq:.2f} "
                        f"| {worst_fp32:.2f} | {versus_fp32.min_sqnr():.1f} |"
                    )
                    print(lines[-1], flush=True)
    table = "\n".join(lines) + "\n"
    print(table)
    if args.out:
        args.out.write_text(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
