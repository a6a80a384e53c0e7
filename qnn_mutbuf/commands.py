"""What each ``qnn-mutbuf`` subcommand does, on top of the public API."""

from __future__ import annotations

import argparse
import json
import shutil
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import torch

from qnn_mutbuf.artifacts import read_sidecar, write_atomically, write_sidecar
from qnn_mutbuf.errors import GateMissedError, InputError, SdkNotFoundError
from qnn_mutbuf.native_output import captured_native_output
from qnn_mutbuf.verify import (
    ComparisonTable,
    EagerRunner,
    GateMiss,
    compare_steps,
    format_table,
    output_scales,
    sqnr_misses,
    steps_off_misses,
)


def _version(distribution: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "not installed"


def doctor(args: argparse.Namespace) -> int:
    from qnn_mutbuf.runners.adb import list_adb_devices
    from qnn_mutbuf.runners.aihub import aihub_configuration
    from qnn_mutbuf.sdk import activate_host_sdk
    from qnn_mutbuf.sdk.device import check_htp_device

    print(f"torch          {_version('torch')}")
    print(f"executorch     {_version('executorch')}")
    print(f"torchao        {_version('torchao')}")
    healthy = True
    try:
        with captured_native_output(args.capture_native):
            info = activate_host_sdk()
            check_htp_device(args.soc)
        print(
            f"QAIRT          {info.qairt_version_text} ({info.qairt_build_id}), "
            f"HTP API {info.htp_api_version}, core API {info.core_api_version}"
        )
        print(f"host libraries {info.library_dir}")
        print(f"  from         {info.source_dir} ({info.source})")
        print(
            "  forwarder    "
            + (
                "in use (QAIRT >= 2.47 reads HTP device configs at byte 8)"
                if info.forwarder
                else "not needed for this QAIRT version"
            )
        )
        print(f"HTP device     created for {args.soc} on the host simulator")
    except SdkNotFoundError as error:
        healthy = False
        print(f"host simulator NOT usable: {error}")
    adb = shutil.which("adb")
    if adb is None:
        print("adb            not on PATH (needed only for `qnn-mutbuf run adb`)")
    else:
        try:
            devices = list_adb_devices(adb)
            listed = (
                ", ".join(f"{serial} ({state})" for serial, state in devices) or "none attached"
            )
        except Exception as error:  # doctor reports, it does not fail on adb
            listed = f"could not list devices: {error}"
        print(f"adb            {adb}; devices: {listed}")
    print(f"AI Hub         {aihub_configuration()}")
    return 0 if healthy else 1


def export(args: argparse.Namespace) -> int:
    from qnn_mutbuf.lowering import lower, quantize
    from qnn_mutbuf.model_spec import load_model
    from qnn_mutbuf.sdk import activate_host_sdk

    if args.output.suffix != ".pte":
        raise InputError(f"-o {args.output}: the output file must end in .pte")
    loaded = load_model(args.model, args.calibration_steps)
    delegate = not args.no_delegate_buffers
    with captured_native_output(args.capture_native):
        if args.quant == "fp16":
            program = lower(
                loaded.module,
                loaded.example_inputs,
                soc=args.soc,
                delegate_mutable_buffers=delegate,
                fp16=True,
            )
            record = None
        else:
            quantized = quantize(loaded.module, loaded.calibration, quant=args.quant)
            program = lower(
                quantized, loaded.example_inputs, soc=args.soc, delegate_mutable_buffers=delegate
            )
            record = quantized.meta["qnn_mutbuf"]
    report = program.qnn_mutbuf_report
    write_atomically(args.output, program.buffer)
    buffers = {}
    shapes = (
        record.mutable_buffers
        if record
        else {
            name: (list(value.shape), str(value.dtype).removeprefix("torch."))
            for name, value in loaded.module.named_buffers()
            if name in set(report.delegated_buffers) | set(report.top_level_buffers)
        }
    )
    for name, (shape, dtype) in shapes.items():
        encoding = record.state_encodings.get(name) if record else None
        buffers[name] = {
            "shape": shape,
            "dtype": dtype,
            "location": "delegate" if name in report.delegated_buffers else "top-level",
            "encoding": encoding.__dict__ if encoding else None,
        }
    sidecar = {
        "model": args.model,
        "soc": report.soc,
        "quant": args.quant,
        "delegate_mutable_buffers": delegate,
        "calibration_steps": len(loaded.calibration),
        "buffers": buffers,
        "lowering_seconds": round(report.seconds, 2),
        "partition": {
            "nodes_on_htp": report.nodes_on_htp,
            "nodes_on_cpu": report.nodes_on_cpu,
            "cpu_ops": report.cpu_ops,
        },
        "qairt": activate_host_sdk().qairt_build_id,
        "pte_bytes": len(program.buffer),
    }
    json_path = write_sidecar(args.output, sidecar)
    print(f"wrote {args.output} ({len(program.buffer)} bytes) and {json_path}")
    print(
        f"lowered for {report.soc} at {args.quant} in {report.seconds:.1f}s: "
        f"{report.nodes_on_htp} nodes on HTP, {report.nodes_on_cpu} on CPU "
        f"({', '.join(report.cpu_ops) or 'none'})"
    )
    for name, entry in buffers.items():
        print(
            f"  buffer {name} {entry['dtype']}{entry['shape']} in {entry['location']}"
            + (f", scale {entry['encoding']['scale']:.3g}" if entry["encoding"] else "")
        )
    return 0


def load_steps(path: Path, limit: int | None) -> list[tuple[torch.Tensor, ...]]:
    from qnn_mutbuf.lowering import check_steps

    if not path.is_file():
        raise InputError(f"--inputs {path}: no such file.")
    try:
        steps = torch.load(path, weights_only=True)
    except Exception as error:
        raise InputError(
            f"--inputs {path} is not a torch.save'd list of tuples: {error}"
        ) from error
    steps = check_steps(steps, what=f"--inputs {path}")
    if limit is not None:
        if limit < 1:
            raise InputError("--steps must be at least 1.")
        steps = steps[:limit]
    return steps


def _runner(args: argparse.Namespace):
    if args.target == "host":
        from qnn_mutbuf.runners.host import HostRunner

        return HostRunner(args.pte)
    if args.target == "adb":
        from qnn_mutbuf.runners.adb import AdbRunner

        return AdbRunner(
            args.pte, serial=args.serial, host=args.host, build_folder=args.build_folder
        )
    from qnn_mutbuf.runners.aihub import AiHubRunner

    return AiHubRunner(args.pte, device=args.device, chipset=args.chipset)


@dataclass(frozen=True)
class References:
    """What `run --reference` compares with: fp32 always; for quantized programs also
    the fake-quant outputs and their output scales, which turn errors into steps."""

    fp32: list[list[torch.Tensor]]
    fake_quant: list[list[torch.Tensor]] | None = None
    output_scales: list[float | None] | None = None

    def compare(self, actual: list[list[torch.Tensor]]) -> list[ComparisonTable]:
        tables = [compare_steps("fp32", self.fp32, actual, self.output_scales)]
        if self.fake_quant is not None:
            tables.append(compare_steps("fake-quant", self.fake_quant, actual, self.output_scales))
        return tables


def references(spec: str, sidecar: dict, steps: list) -> References:
    """fp32 and (for quantized programs) fake-quant outputs of MODEL for `steps`."""
    from qnn_mutbuf.lowering import quantize
    from qnn_mutbuf.model_spec import load_model

    loaded = load_model(spec, sidecar.get("calibration_steps"))
    fp32 = EagerRunner(loaded.module).run(steps)
    if not _is_quantized(sidecar):
        return References(fp32)
    quantized = quantize(loaded.module, loaded.calibration, quant=sidecar["quant"])
    return References(fp32, EagerRunner(quantized).run(steps), output_scales(quantized))


def _is_quantized(sidecar: dict) -> bool:
    return sidecar.get("quant", "fp16") != "fp16"


def summarize_outputs(outputs: list[list[torch.Tensor]]) -> str:
    lines = []
    for step, values in enumerate(outputs):
        parts = []
        for value in values:
            data = value.double()
            parts.append(
                f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)} "
                f"min {data.min():.4g} max {data.max():.4g} mean {data.mean():.4g}"
            )
        lines.append(f"step {step:>3}: " + "; ".join(parts))
    return "\n".join(lines)


def _gate_flags(args: argparse.Namespace) -> list[str]:
    return [
        flag
        for flag, limit in (
            ("--fail-below-sqnr", args.fail_below_sqnr),
            ("--max-steps-off", args.max_steps_off),
        )
        if limit is not None
    ]


def gate_misses(args: argparse.Namespace, tables: list[ComparisonTable]) -> list[str]:
    """Every row that missed a gate, one line each, by step then output (gate order).

    --fail-below-sqnr checks SQNR against fp32 (what the user cares about; the only
    reference of an fp16 program); --max-steps-off checks steps of the output
    encoding against fake-quant (what the HTP should reproduce up to rounding).
    """
    by_reference = {table.reference: table for table in tables}
    misses: list[tuple[GateMiss, str]] = []
    if args.fail_below_sqnr is not None:
        limit = args.fail_below_sqnr
        misses += [
            (miss, f"SQNR {miss.value:.1f} dB vs fp32 is below --fail-below-sqnr {limit:g}")
            for miss in sqnr_misses(by_reference["fp32"], limit)
        ]
    if args.max_steps_off is not None:
        limit = args.max_steps_off
        misses += [
            (miss, _steps_off_text(miss, limit))
            for miss in steps_off_misses(by_reference["fake-quant"], limit)
        ]
    misses.sort(key=lambda pair: (pair[0].step, pair[0].output))
    return [f"step {miss.step} output {miss.output}: {text}" for miss, text in misses]


def _steps_off_text(miss: GateMiss, limit: float) -> str:
    if miss.value is None:
        return f"no output encoding to count steps in, so --max-steps-off {limit:g} cannot pass"
    return (
        f"{miss.value:.2f} steps of the output encoding off fake-quant is above "
        f"--max-steps-off {limit:g}"
    )


def run(args: argparse.Namespace) -> int:
    steps = load_steps(args.inputs, args.steps)
    sidecar = read_sidecar(args.pte)
    if args.plot and not args.reference:
        raise InputError("--plot needs --reference: there is nothing to plot without one.")
    gates = _gate_flags(args)
    if gates and not args.reference:
        raise InputError(
            f"{' and '.join(gates)} need{'s' if len(gates) == 1 else ''} --reference: "
            "there is nothing to gate against without one."
        )
    if args.plot:
        from qnn_mutbuf.plot import pyplot

        pyplot()  # before any step runs: a missing matplotlib is one message, not a late one
    if args.reference and sidecar is None:
        raise InputError(
            f"--reference needs {args.pte.with_suffix('.json')} (written by `qnn-mutbuf export`) "
            "to quantize the reference with the same settings."
        )
    if args.max_steps_off is not None and not _is_quantized(sidecar):
        raise InputError(
            f"--max-steps-off needs a quantized program: {args.pte} is fp16, its outputs have "
            "no encoding to count steps in and there is no fake-quant reference; "
            "use --fail-below-sqnr (vs fp32)."
        )
    with captured_native_output(args.capture_native):
        runner = _runner(args)
        try:
            outputs = runner.run(steps)
        finally:
            close = getattr(runner, "close", None)
            if close:
                close()
    print(summarize_outputs(outputs))
    tables: list[ComparisonTable] = []
    if args.reference:
        with captured_native_output(args.capture_native):
            tables = references(args.reference, sidecar, steps).compare(outputs)
        print()
        print(format_table(tables))
    misses = gate_misses(args, tables) if gates else []
    extra = getattr(runner, "profile_summary", None)
    if extra:
        print()
        print(extra)
    if args.report:
        report = {
            "pte": str(args.pte),
            "target": args.target,
            "steps": len(steps),
            "outputs": [[list(v.shape) for v in step] for step in outputs],
            "comparisons": [table.as_dict() for table in tables],
        }
        if gates:
            report["gates"] = {
                "fail_below_sqnr_vs_fp32": args.fail_below_sqnr,
                "max_steps_off_vs_fake_quant": args.max_steps_off,
                "misses": misses,
            }
        if getattr(runner, "profile", None):
            report["profile"] = runner.profile
        write_atomically(args.report, json.dumps(report, indent=2, default=str) + "\n")
        print(f"wrote {args.report}")
    if args.plot:
        from qnn_mutbuf.plot import plot_sqnr

        plot_sqnr(tables, args.plot, title=f"{args.pte.name} on {args.target}")
        print(f"wrote {args.plot}")
    if misses:
        more = f" (first of {len(misses)} misses)" if len(misses) > 1 else ""
        raise GateMissedError(misses[0] + more)
    return 0


def demo(args: argparse.Namespace) -> int:
    from qnn_mutbuf.lowering import lower, quantize
    from qnn_mutbuf.runners.host import HostRunner
    from qnn_mutbuf.seed_models import decode_steps, seed, small

    module, calibration, example = (small if args.small else seed)()
    shape = tuple(module.k_cache.shape)
    print(
        f"seed model: k_cache{list(shape)} written with index_copy_ along dim 1, "
        f"{args.quant}, cache {'at top level' if args.no_delegate_buffers else 'in the delegate'}"
    )
    with captured_native_output(args.capture_native):
        quantized = quantize(module, calibration, quant=args.quant)
        program = lower(
            quantized, example, soc="SM8650", delegate_mutable_buffers=not args.no_delegate_buffers
        )
    report = program.qnn_mutbuf_report
    print(
        f"lowered for SM8650 in {report.seconds:.1f}s: {report.nodes_on_htp} nodes on HTP, "
        f"CPU: {', '.join(report.cpu_ops) or 'none'}"
    )
    steps = decode_steps(args.steps, shape=shape, seed=7)
    with captured_native_output(args.capture_native):
        runner = HostRunner(program.buffer)
        device = runner.run(steps)
        runner.close()
    scales = output_scales(quantized)
    tables = [
        compare_steps("fp32", EagerRunner(module).run(steps), device, scales),
        compare_steps("fake-quant", EagerRunner(quantized).run(steps), device, scales),
    ]
    print(format_table(tables))
    fake_quant = tables[1]
    print(
        f"worst step vs fake-quant: {fake_quant.worst_steps():.2f} quantization steps; "
        f"min SQNR vs fp32: {tables[0].min_sqnr():.1f} dB"
    )
    return 0


def diagnose(args: argparse.Namespace) -> int:
    from qnn_mutbuf.diagnosis import diagnose as run_diagnosis
    from qnn_mutbuf.model_spec import load_model

    if args.plot:
        from qnn_mutbuf.plot import pyplot

        pyplot()  # before the long part: a missing matplotlib is one message, not a late one
    steps = load_steps(args.inputs, args.steps)
    loaded = load_model(args.model, args.calibration_steps)
    with captured_native_output(args.capture_native):
        diagnosis = run_diagnosis(
            loaded.module,
            steps,
            calibration=loaded.calibration,
            quant=args.quant,
            soc=args.soc,
            threshold=args.threshold,
            delegate_mutable_buffers=not args.no_delegate_buffers,
        )
    print(diagnosis.format())
    if args.report:
        diagnosis.write_json(args.report)
        print(f"wrote {args.report}")
    if args.plot:
        from qnn_mutbuf.diagnosis.heatmap import plot_lsb_heatmap

        plot_lsb_heatmap(diagnosis, args.plot, title=f"{args.model} on {diagnosis.soc}")
        print(f"wrote {args.plot}")
    return 0
