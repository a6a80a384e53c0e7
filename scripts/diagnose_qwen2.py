"""diagnose on a real decoder: the tiny transformers Qwen2 of qwen2_static_cache.py.

Quantizes it at 16a8w, lowers the debug program with the caches delegated, runs 8
decode steps on the host simulator and writes the report, the table and the lsb heat
map next to each other (the README shows this run):

    python scripts/diagnose_qwen2.py [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()

    from qwen2_static_cache import build_model, decode_steps

    import qnn_mutbuf
    from qnn_mutbuf.diagnosis.heatmap import plot_lsb_heatmap
    from qnn_mutbuf.native_output import captured_native_output

    model = build_model()
    with captured_native_output(True):
        diagnosis = qnn_mutbuf.diagnose(
            model,
            decode_steps(args.steps, seed=2),
            calibration=decode_steps(32, seed=1),
            quant="16a8w",
        )
    table = diagnosis.format()
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "diagnose_qwen2.txt").write_text(table + "\n")
    diagnosis.write_json(args.out / "diagnose_qwen2.json")
    plot_lsb_heatmap(diagnosis, args.out / "diagnose_qwen2.png", title="tiny Qwen2, 16a8w")
    return 0


if __name__ == "__main__":
    sys.exit(main())
