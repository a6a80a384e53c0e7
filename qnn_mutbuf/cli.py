"""The ``qnn-mutbuf`` command line: argument parsing only; the work is in the API."""

from __future__ import annotations

import argparse
import logging
import math
import sys
import warnings
from pathlib import Path

from qnn_mutbuf.errors import GateMissedError, QnnMutbufError

DEFAULT_SOC = "SM8650"
QUANT_CHOICES = ("8a8w", "16a8w", "16a4w", "16a16w", "fp16")
EXIT_ERROR = 1  # bad input, missing SDK, a device or job that failed
EXIT_GATE_MISSED = 3  # the program ran, but its numbers missed a gate (2 is argparse's)

RUN_EPILOG = f"""\
gates (both need --reference; either makes the run a check that can fail):
  --fail-below-sqnr DB  every step and output has SQNR >= DB against the fp32
                        reference (an fp16 program's only reference).
  --max-steps-off N     every step and output is within N steps of its output
                        encoding (max|err| / output scale) of the fake-quant
                        reference; quantized programs only.
  The table (and --report, --plot) is written first; then one line on stderr
  names the first step and output that missed, the value and the limit.

exit status:
  0  ran, and the numbers met every gate given
  {EXIT_ERROR}  error: bad input, missing SDK, device or AI Hub failure
  2  bad command line
  {EXIT_GATE_MISSED}  ran, but the numbers missed --fail-below-sqnr or --max-steps-off
"""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="qnn-mutbuf",
        description=(
            "Lower PT2E-quantized models whose state lives in mutable buffers (KV caches, "
            "running statistics) to the Qualcomm HTP, and check them step by step against "
            "the CPU on the host simulator, a phone over adb, or Qualcomm AI Hub."
        ),
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log what happens")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    doctor = commands.add_parser(
        "doctor",
        help="check the host toolchain, adb and AI Hub",
        description="Print versions and where the QNN host libraries come from; exit 0 when "
        "the host simulator can create an HTP device for the SoC.",
    )
    doctor.add_argument("--soc", default=DEFAULT_SOC, help="SoC to check (default: SM8650)")

    export = commands.add_parser(
        "export",
        help="quantize and lower a model to a .pte",
        description="Quantize MODEL with calibration steps run in order, lower it for the HTP "
        "and write OUT.pte plus OUT.json (settings, buffers, encodings, partition summary).",
    )
    export.add_argument("model", metavar="MODEL", help="package.module:factory or file.py:factory")
    export.add_argument("-o", "--output", required=True, type=Path, help="the .pte to write")
    _add_lowering_options(export)
    export.add_argument(
        "--calibration-steps",
        type=int,
        default=None,
        metavar="N",
        help="use only the first N calibration steps of the factory",
    )

    run = commands.add_parser(
        "run",
        help="run a .pte step by step on host, adb or aihub",
        # hand-wrapped: the raw formatter that keeps the epilog's layout keeps this one's too
        description="Run the steps in order, state carried between them; with --reference,\n"
        "compare every step with the fp32 and fake-quant references.",
        epilog=RUN_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run.add_argument("target", choices=("host", "adb", "aihub"), help="where to run")
    run.add_argument("pte", type=Path, help="the program to run")
    run.add_argument(
        "--inputs", type=Path, required=True, help="torch.save'd list of per-step input tuples"
    )
    run.add_argument("--steps", type=int, default=None, metavar="N", help="run the first N steps")
    run.add_argument(
        "--reference",
        metavar="MODEL",
        help="MODEL spec to build the fp32 and fake-quant references from",
    )
    run.add_argument("--report", type=Path, help="write the per-step results as JSON")
    run.add_argument(
        "--plot", type=Path, help="write the per-step SQNR curve (needs --reference and matplotlib)"
    )
    run.add_argument(
        "--fail-below-sqnr",
        type=_finite,
        metavar="DB",
        help=f"exit {EXIT_GATE_MISSED} if any step's SQNR vs fp32 is below DB (needs --reference)",
    )
    run.add_argument(
        "--max-steps-off",
        type=_non_negative,
        metavar="N",
        help=f"exit {EXIT_GATE_MISSED} if any step is more than N output-encoding steps off "
        "fake-quant (needs --reference, quantized programs)",
    )
    adb = run.add_argument_group("adb")
    adb.add_argument("-s", "--serial", help="device serial (adb -s)")
    adb.add_argument("-H", "--host", help="adb server host (adb -H)")
    adb.add_argument(
        "--build-folder", type=Path, help="ExecuTorch Android build holding qnn_executor_runner"
    )
    hub = run.add_argument_group("aihub")
    hub.add_argument(
        "--device", default=None, help='AI Hub device (default: "Samsung Galaxy S24 (Family)")'
    )
    hub.add_argument(
        "--chipset", default=None, help="AI Hub chipset attribute, e.g. qualcomm-snapdragon-8gen3"
    )

    demo = commands.add_parser(
        "demo",
        help="the seed KV-cache model on the host simulator",
        description="Quantize the seed KV-cache model, lower it for SM8650, run it on the host "
        "simulator and print the per-step error table against fp32 and fake-quant.",
    )
    demo.add_argument("--steps", type=int, default=8, help="decode steps to run (default 8)")
    demo.add_argument("--quant", choices=QUANT_CHOICES[:-1], default="8a8w")
    demo.add_argument(
        "--no-delegate-buffers",
        action="store_true",
        help="keep the cache at top level instead of inside the delegate",
    )
    demo.add_argument("--small", action="store_true", help="use a (1, 64, 2, 8) cache")

    diagnose = commands.add_parser(
        "diagnose",
        help="name the first op and step where the HTP departs from the CPU",
        description="Quantize MODEL, lower a debug program in which every quantized value is "
        "also an output, run the steps in order on the host simulator and compare every node "
        "at every step with fake-quant (and fake-quant with fp32). The program you ship is "
        "not changed.",
    )
    diagnose.add_argument(
        "model", metavar="MODEL", help="package.module:factory or file.py:factory"
    )
    diagnose.add_argument(
        "--inputs", type=Path, required=True, help="torch.save'd list of per-step input tuples"
    )
    diagnose.add_argument(
        "--steps", type=int, default=None, metavar="N", help="run the first N steps"
    )
    diagnose.add_argument("--soc", default=DEFAULT_SOC, help="target SoC (default: SM8650)")
    diagnose.add_argument("--quant", choices=QUANT_CHOICES[:-1], default="8a8w")
    diagnose.add_argument(
        "--no-delegate-buffers",
        action="store_true",
        help="keep mutable buffers at top level instead of inside the delegate",
    )
    diagnose.add_argument(
        "--calibration-steps",
        type=int,
        default=None,
        metavar="N",
        help="use only the first N calibration steps of the factory",
    )
    diagnose.add_argument(
        "--threshold",
        type=_non_negative,
        default=4.0,
        metavar="N",
        help="a node departs when it is more than N steps of its output encoding off "
        "fake-quant (default 4)",
    )
    diagnose.add_argument("--report", type=Path, help="write every step and node as JSON")
    diagnose.add_argument(
        "--plot", type=Path, help="write a steps x nodes heat map of the error (matplotlib)"
    )
    return parser


def _add_lowering_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--soc", default=DEFAULT_SOC, help="target SoC (default: SM8650)")
    parser.add_argument(
        "--quant",
        choices=QUANT_CHOICES,
        default="8a8w",
        help="quantization scheme, or fp16 (default: 8a8w)",
    )
    parser.add_argument(
        "--no-delegate-buffers",
        action="store_true",
        help="keep mutable buffers at top level instead of inside the delegate",
    )


def _finite(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text} is not a finite number")
    return value


def _non_negative(text: str) -> float:
    value = _finite(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text} is negative; errors are at least 0 steps")
    return value


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    if not args.verbose:
        for handler in logging.getLogger().handlers:
            handler.addFilter(_only_our_warnings)
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        warnings.filterwarnings("ignore", category=UserWarning)
    from qnn_mutbuf import commands

    handler = {
        "doctor": commands.doctor,
        "export": commands.export,
        "run": commands.run,
        "demo": commands.demo,
        "diagnose": commands.diagnose,
    }[args.command]
    args.capture_native = not args.verbose
    try:
        return handler(args)
    except GateMissedError as error:
        print(f"qnn-mutbuf {args.command}: error: {error}", file=sys.stderr)
        return EXIT_GATE_MISSED
    except QnnMutbufError as error:
        print(f"qnn-mutbuf {args.command}: error: {error}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print(f"qnn-mutbuf {args.command}: interrupted", file=sys.stderr)
        return 130


def _only_our_warnings(record: logging.LogRecord) -> bool:
    """ExecuTorch's QNN modules log every op (and deprecation notes) on their own and
    the root logger; without -v only qnn_mutbuf's messages and real errors show."""
    return record.name.startswith("qnn_mutbuf") or record.levelno >= logging.ERROR


if __name__ == "__main__":
    sys.exit(main())
