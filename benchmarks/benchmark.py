"""qnn_mutbuf vs upstream's recipe on the seed KV-cache model and the Qwen2 tiny decoder.

For each model, in one run: quantize+lower seconds for qnn_mutbuf and for upstream
(``QnnQuantizer`` + ``to_edge_transform_and_lower_to_qnn``, where it lowers at all);
host-simulated step latency with the caches delegated and at top level; .pte size
and planned memory; SQNR against fp32 at every step. Writes a markdown table and a
JSON file. Under 10 minutes on 2 cores.

    python benchmarks/benchmark.py [--out benchmarks/results] [--steps 16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from qnn_mutbuf import HostRunner, lower, quantize  # noqa: E402
from qnn_mutbuf.native_output import captured_native_output  # noqa: E402
from qnn_mutbuf.verify import EagerRunner, compare_steps  # noqa: E402


def planned_memory(program_bytes: bytes) -> int:
    from executorch.exir._serialize._program import deserialize_pte_binary

    plan = deserialize_pte_binary(program_bytes).program.execution_plan[0]
    return int(sum(plan.non_const_buffer_sizes))


def run_steps(program_bytes: bytes, steps: list) -> tuple[list, float]:
    runner = HostRunner(program_bytes)
    outputs, times = [], []
    for inputs in steps:
        start = time.perf_counter()
        outputs.append(runner.step(*inputs))
        times.append(time.perf_counter() - start)
    runner.close()
    return outputs, statistics.median(times[1:] or times) * 1000


def ours(model, calibration, steps, quant: str, delegate: bool) -> dict:
    start = time.monotonic()
    quantized = quantize(model, calibration, quant=quant)
    program = lower(quantized, calibration[0], delegate_mutable_buffers=delegate)
    seconds = time.monotonic() - start
    outputs, latency = run_steps(program.buffer, steps)
    table = compare_steps("fp32", EagerRunner(model).run(steps), outputs)
    return {
        "recipe": "qnn_mutbuf",
        "caches": "delegated" if delegate else "top level",
        "quantize_lower_s": round(seconds, 1),
        "step_ms": round(latency, 2),
        "pte_bytes": len(program.buffer),
        "planned_bytes": planned_memory(program.buffer),
        "sqnr_fp32_db": [round(r.sqnr_db, 1) for r in table.rows if r.output == 0],
        "cpu_ops": program.qnn_mutbuf_report.cpu_ops,
    }


def upstream(model, calibration, steps, quant: str, delegate: bool) -> dict:
    from executorch.backends.qualcomm.quantizer.quantizer import QnnQuantizer
    from executorch.backends.qualcomm.utils.utils import to_edge_transform_and_lower_to_qnn
    from executorch.exir import ExecutorchBackendConfig
    from executorch.exir.passes.init_mutable_pass import InitializedMutableBufferPass
    from torchao.quantization.pt2e import MinMaxObserver
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    from qnn_mutbuf.lowering import quant_dtype
    from qnn_mutbuf.sdk.device import htp_compile_spec

    entry = {"recipe": "upstream", "caches": "delegated" if delegate else "top level"}
    start = time.monotonic()
    try:
        quantizer = QnnQuantizer()
        quantizer.set_default_quant_config(
            quant_dtype(quant),
            is_conv_per_channel=True,
            is_linear_per_channel=True,
            act_observer=MinMaxObserver,
        )
        initial = {n: b.clone() for n, b in model.named_buffers()}
        prepared = prepare_pt2e(torch.export.export(model, calibration[0]).module(), quantizer)
        for inputs in calibration:
            prepared(*inputs)
        with torch.no_grad():
            for name, value in model.named_buffers():
                value.copy_(initial[name])
        converted = convert_pt2e(prepared)
        edge = to_edge_transform_and_lower_to_qnn(
            converted, calibration[0], htp_compile_spec("SM8650"), skip_mutable_buffer=not delegate
        )
        # The recipe's documented way to keep initial values (top-level buffers only).
        names = [n.rsplit(".", 1)[-1] for n in initial]
        program = edge.to_executorch(
            ExecutorchBackendConfig(passes=[InitializedMutableBufferPass(names)])
        )
    except Exception as error:  # report where upstream stops, keep benchmarking
        entry["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:120]}"
        entry["quantize_lower_s"] = round(time.monotonic() - start, 1)
        traceback.print_exc(limit=1, file=sys.stderr)
        return entry
    entry["quantize_lower_s"] = round(time.monotonic() - start, 1)
    outputs, latency = run_steps(program.buffer, steps)
    table = compare_steps("fp32", EagerRunner(model).run(steps), outputs)
    entry.update(
        step_ms=round(latency, 2),
        pte_bytes=len(program.buffer),
        planned_bytes=planned_memory(program.buffer),
        sqnr_fp32_db=[round(r.sqnr_db, 1) for r in table.rows if r.output == 0],
    )
    return entry


def cases(steps: int):
    from qwen2_static_cache import build_model, decode_steps

    from qnn_mutbuf.seed_models import IndexCopyCache
    from qnn_mutbuf.seed_models import decode_steps as seed_steps

    shape = (1, 1024, 12, 64)
    yield (
        "seed KV cache (1,1024,12,64), ones init",
        "8a8w",
        lambda: IndexCopyCache(shape, fill=1.0).eval(),
        seed_steps(8, shape=shape, seed=1),
        seed_steps(steps, shape=shape, seed=7, start=8),
    )
    yield (
        "Qwen2 tiny, StaticCache 64",
        "16a8w",
        build_model,
        decode_steps(32, seed=1),
        decode_steps(steps, seed=2),
    )


def markdown(results: list[dict]) -> str:
    lines = [
        "| model | recipe | caches | quantize+lower s | step ms (host) | .pte bytes | planned bytes | min SQNR vs fp32 dB | mean SQNR dB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for result in results:
        for entry in result["entries"]:
            if "error" in entry:
                lines.append(
                    f"| {result['model']} ({result['quant']}) | {entry['recipe']} | {entry['caches']} | "
                    f"fails after {entry['quantize_lower_s']}s: {entry['error']} | | | | | |"
                )
                continue
            sqnr = entry["sqnr_fp32_db"]
            lines.append(
                f"| {result['model']} ({result['quant']}) | {entry['recipe']} | {entry['caches']} | "
                f"{entry['quantize_lower_s']} | {entry['step_ms']} | {entry['pte_bytes']} | "
                f"{entry['planned_bytes']} | {min(sqnr):.1f} | {sum(sqnr) / len(sqnr):.1f} |"
            )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--steps", type=int, default=16)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for name, quant, make_model, calibration, steps in cases(args.steps):
        entries = []
        for recipe in (ours, upstream):
            for delegate in (True, False):
                print(
                    f"{name}: {recipe.__name__}, delegated={delegate} ...",
                    file=sys.stderr,
                    flush=True,
                )
                with captured_native_output():
                    entries.append(recipe(make_model(), calibration, steps, quant, delegate))
        results.append({"model": name, "quant": quant, "entries": entries})
    table = markdown(results)
    (args.out / "benchmark.md").write_text(table + "\n")
    (args.out / "benchmark.json").write_text(json.dumps(results, indent=2) + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
