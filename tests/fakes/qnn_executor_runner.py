"""Emulates ExecuTorch's qnn_executor_runner on the host simulator, for the fake adb.

Reads the same flags, runs every line of input_list.txt as one step of one loaded
method (so state carries), and writes outputs/output_{step}_{k}.raw. Failure
injection: FAKE_RUNNER_EXIT=code exits with that code after a few log lines;
FAKE_RUNNER_TRUNCATE=1 writes outputs one byte short.
"""

import argparse
import os
import sys

import torch

from qnn_mutbuf.program_io import read_program_io
from qnn_mutbuf.runners.host import HostRunner


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model_path", required=True)
    parser.add_argument("--input_list_path", required=True)
    parser.add_argument("--output_folder_path", required=True)
    parser.add_argument("--iteration", type=int, default=1)
    parser.add_argument("--warm_up", type=int, default=0)
    args = parser.parse_args()
    print(f"I qnn_executor_runner: Model file {args.model_path} is loaded.")
    if os.environ.get("FAKE_RUNNER_EXIT"):
        print("E qnn_executor_runner: [Qnn ExecuTorch] Failed to create device: 1008")
        return int(os.environ["FAKE_RUNNER_EXIT"])
    if args.iteration != 1 or args.warm_up != 0:
        print("E extra executions would advance the state", file=sys.stderr)
        return 3
    io = read_program_io(args.model_path)
    runner = HostRunner(args.model_path)
    with open(args.input_list_path) as listing:
        lines = [line.split() for line in listing if line.strip()]
    for step, files in enumerate(lines):
        inputs = []
        for name, spec in zip(files, io.inputs, strict=True):
            data = bytearray(open(name, "rb").read())
            inputs.append(torch.frombuffer(data, dtype=spec.dtype).reshape(spec.shape).clone())
        outputs = runner.step(*inputs)
        for index, value in enumerate(outputs):
            data = value.contiguous().numpy().tobytes()
            if os.environ.get("FAKE_RUNNER_TRUNCATE"):
                data = data[:-1]
            with open(
                os.path.join(args.output_folder_path, f"output_{step}_{index}.raw"), "wb"
            ) as out:
                out.write(data)
        print(f"I qnn_executor_runner: 1 inference took 1.0 ms (step {step})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
