"""The KV-cache bar as a table: case x quant x delegate -> worst-step error.

Runs the cases of the correctness bar (tests/models.py: the seed IndexCopy cache with
zeros and ones, IndexPut modes 0-5, a tensor-indexed cache) at 8a8w and 16a8w, state
delegated and at top level, for 8 decode steps on the host simulator, and prints the
worst error over all steps and elements, in quantization steps of the output
encoding, against the fake-quant reference and against fp32, plus the fp16 SQNR.

    python benchmarks/kv_cache_table.py [--steps 8] [--out benchmarks/results/kv_cache.md]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def worst_steps(expected, actual, scale: float) -> float:
    return max(
        (g.double() - w.double()).abs().max().item() / scale
        for want, got in zip(expected, actual, strict=True)
        for w, g in zip(want, got, strict=True)
    )


def main() -> int:
    from models import KV_CASES

    from qnn_mutbuf import HostRunner, lower, quantize
    from qnn_mutbuf.native_output import captured_native_output
    from qnn_mutbuf.verify import EagerRunner, output_scales, sqnr_db

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", type=Path, default=None, help="also write the table here")
    args = parser.parse_args()

    lines = [
        "| case | quant | state | lower s | vs fake-quant (steps) | vs fp32 (steps) "
        "| fp32 bound (steps) |",
        "|---|---|---|---|---|---|---|",
    ]
    fp16_lines = ["| case | state | min SQNR vs fp32 (dB) |", "|---|---|---|"]
    for case in sorted(KV_CASES):
        make_model, make_steps = KV_CASES[case]
        model = make_model().eval()
        calibration, steps = make_steps(4, 1), make_steps(args.steps, 2)
        fp32 = EagerRunner(model).run(steps)
        for quant in ("8a8w", "16a8w"):
            with captured_native_output():
                quantized = quantize(model, calibration, quant=quant)
            record = quantized.meta["qnn_mutbuf"]
            (buffer,) = record.mutable_buffers
            state_scale = record.state_encodings[buffer].scale
            (out_scale,) = output_scales(quantized)
            fake_quant = EagerRunner(quantized).run(steps)
            for delegate in (True, False):
                start = time.monotonic()
                with captured_native_output():
                    program = lower(quantized, calibration[0], delegate_mutable_buffers=delegate)
                    seconds = time.monotonic() - start
                    device = HostRunner(program.buffer).run(steps)
                bound = (state_scale + out_scale) / out_scale
                lines.append(
                    f"| {case} | {quant} | {'delegated' if delegate else 'top level'} "
                    f"| {seconds:.1f} | {worst_steps(fake_quant, device, out_scale):.2f} "
                    f"| {worst_steps(fp32, device, out_scale):.2f} | {bound:.2f} |"
                )
                print(lines[-1], flush=True)
        for delegate in (True, False):
            with captured_native_output():
                program = lower(model, calibration[0], delegate_mutable_buffers=delegate, fp16=True)
                device = HostRunner(program.buffer).run(steps)
            worst = min(sqnr_db(f[0], d[0]) for f, d in zip(fp32, device, strict=True))
            fp16_lines.append(
                f"| {case} | {'delegated' if delegate else 'top level'} | {worst:.1f} |"
            )
            print(fp16_lines[-1], flush=True)
    text = "\n".join(lines) + "\n\nfp16:\n\n" + "\n".join(fp16_lines) + "\n"
    print()
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    torch.manual_seed(0)
    sys.exit(main())
