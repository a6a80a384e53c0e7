"""Ours vs "Approach 1" for in-place updates of buffers, on the same cases.

Approach 1 is the fix suggested upstream: re-trace with ``ep.run_decompositions({})``
so in-place updates become functional, quantize with ``QnnQuantizer`` and convert with
``fold_quantize=False`` so the buffer is not frozen (which stops folding weights too).
Ours: ``qnn_mutbuf.quantize`` (graph-level functionalization, one state encoding).
Both are lowered with ``qnn_mutbuf.lower`` so that only the quantization differs;
Approach 1 reads and writes its buffers with different encodings, which cannot be
kept inside the delegate, so it is lowered with the buffers at top level.

    python scripts/compare_functionalization.py [--steps 16] [--quant 16a8w]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from models import INPLACE_CASES, MovingAverage, vector_steps  # noqa: E402

from qnn_mutbuf import HostRunner, lower, quantize  # noqa: E402
from qnn_mutbuf.errors import LoweringError  # noqa: E402
from qnn_mutbuf.lowering import quant_dtype  # noqa: E402
from qnn_mutbuf.native_output import captured_native_output  # noqa: E402
from qnn_mutbuf.verify import EagerRunner, compare_steps, output_scales  # noqa: E402


class MovingAverageFromOnes(MovingAverage):
    """The moving average starting from ones: the initial state is outside the range
    of every value written later."""

    def __init__(self) -> None:
        super().__init__()
        self.avg.fill_(1.0)


class ProjectedState(torch.nn.Module):
    """A state fed through a 64x64 linear layer: weights to fold (or not)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(64, 64)
        self.register_buffer("state", torch.zeros(1, 64))

    def forward(self, x):
        self.state.mul_(0.5).add_(self.proj(x))
        return self.state + 0


EXTRA_CASES = {
    "ema_from_ones": (MovingAverageFromOnes, vector_steps((1, 16)), True),
    "projected_state": (ProjectedState, vector_steps((1, 64)), True),
}


def approach_one(model, steps, quant):
    from executorch.backends.qualcomm.quantizer.quantizer import QnnQuantizer
    from torchao.quantization.pt2e import MinMaxObserver
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    exported = torch.export.export(model, steps[0]).run_decompositions({})
    quantizer = QnnQuantizer()
    quantizer.set_default_quant_config(
        quant_dtype(quant), is_linear_per_channel=True, act_observer=MinMaxObserver
    )
    prepared = prepare_pt2e(exported.module(), quantizer)
    # The model's own buffers go back to their initial state after calibration (as
    # qnn_mutbuf.quantize does); observer statistics are kept.
    model_buffers = {name for name, _ in model.named_buffers()}
    initial = {n: v.clone() for n, v in prepared.named_buffers() if n in model_buffers}
    for step in steps:
        prepared(*step)
    with torch.no_grad():
        for name, value in initial.items():
            prepared.get_buffer(name).copy_(value)
    return convert_pt2e(prepared, fold_quantize=False)


def measure(name, make_quantized, model, steps, quant, delegate):
    start = time.monotonic()
    try:
        quantized = make_quantized()
    except Exception as error:  # the approach itself fails on this case
        return {
            "approach": name,
            "delegated": delegate,
            "stage": "quantize",
            "error": str(error).splitlines()[0][:90],
        }
    try:
        program = lower(quantized, steps[0], delegate_mutable_buffers=delegate)
    except Exception as error:  # upstream's pass manager raises a bare Exception
        message = (
            str(getattr(error, "__cause__", None) or error)
            if not isinstance(error, LoweringError)
            else str(error)
        )
        return {
            "approach": name,
            "delegated": delegate,
            "stage": "lower",
            "error": message.split(". ")[0][:120],
        }
    seconds = time.monotonic() - start
    device = HostRunner(program.buffer).run(steps)
    versus_fp32 = compare_steps("fp32", EagerRunner(model).run(steps), device)
    scales = output_scales(quantized)
    versus_fq = compare_steps("fake-quant", EagerRunner(quantized).run(steps), device, scales)
    return {
        "approach": name,
        "delegated": delegate,
        "seconds": seconds,
        "pte_bytes": len(program.buffer),
        "worst_err_fp32": versus_fp32.worst_error(),
        "min_sqnr_fp32": versus_fp32.min_sqnr(),
        "worst_steps_fq": versus_fq.worst_steps(),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--quant", default="16a8w", choices=["8a8w", "16a8w", "16a4w", "16a16w"])
    args = parser.parse_args()
    rows = []
    cases = {**INPLACE_CASES, **EXTRA_CASES}
    for case in sorted(cases):
        make_model, make_steps, _ = cases[case]
        steps = make_steps(args.steps, 1)
        print(f"{case} ...", file=sys.stderr, flush=True)
        model = make_model().eval()

        def ours_quantized(make_model=make_model, steps=steps):
            return quantize(make_model().eval(), steps, quant=args.quant)

        def approach_one_quantized(make_model=make_model, steps=steps):
            return approach_one(make_model().eval(), steps, args.quant)

        with captured_native_output():
            ours = measure("qnn_mutbuf", ours_quantized, model, steps, args.quant, True)
            first_try = measure(
                "approach 1", approach_one_quantized, model, steps, args.quant, True
            )
            fallback = None
            if first_try.get("stage") == "lower":
                fallback = measure(
                    "approach 1", approach_one_quantized, model, steps, args.quant, False
                )
        rows.append((case, ours, first_try, fallback))

    print(f"\n{args.quant}, {args.steps} steps, host simulator (SM8650)\n")
    print(
        "| case | approach | buffers | lower+quantize s | .pte bytes | worst max err vs fp32 | min SQNR vs fp32 dB | worst vs own fake-quant (steps) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for case, *results in rows:
        for result in results:
            if result is None:
                continue
            where = "delegated" if result["delegated"] else "top level"
            if "error" in result:
                print(
                    f"| {case} | {result['approach']} | {where} | {result['stage']} fails: "
                    f"{result['error']} | | | | |"
                )
                continue
            print(
                f"| {case} | {result['approach']} | {where} | {result['seconds']:.1f} | "
                f"{result['pte_bytes']} | {result['worst_err_fp32']:.3g} | "
                f"{result['min_sqnr_fp32']:.1f} | {result['worst_steps_fq']:.2f} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
