"""A draft head's catch-up on the CPU: one forward of the general program against consecutive
few-row forwards (what `HeadRunner.chunks_pay` chooses between at start-up), per row count.

    .venv/bin/python bench/catch_up.py --algorithm eagle3 --rows 1,4,16,24,48,96,192 [--json results/catch_up.json]

A catch-up runs the head over the tokens a request gained since its last draft (after plain steps:
one row per step skipped); each forward here writes its rows after a 120-token prefix of slot 0.
Prints the median of `--repeats` timings per row count; it does not measure drafting steps.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from specserve import cli
from specserve.engine.engine import Engine
from specserve.hardware import describe
from specserve.methods import HEAD_METHODS
from specserve.models.cpu_linear import median_ms
from specserve.models.llama import KeyMask
from specserve.runtime.few_row_head import FEW_ROWS

PREFIX = 120


def forward(program, feature_size: int, start: int, rows: int) -> None:  # noqa: ANN001
    tokens = torch.zeros(1, rows, dtype=torch.int64)
    hidden = torch.zeros(1, rows, feature_size)
    positions = torch.arange(start, start + rows)[None]
    mask = KeyMask(torch.tensor([start])).dense(rows, start + rows)
    program.forward(tokens, hidden, positions, positions, mask, torch.zeros(1, dtype=torch.int64))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--algorithm", default="eagle3", choices=HEAD_METHODS)
    p.add_argument("--rows", default="1,4,16,24,48,96,192")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    parsed = cli.build_parser().parse_args(["bench", "--algorithm", args.algorithm])
    drafter = Engine(cli._engine_config(parsed, args.algorithm, 1)).drafter
    if drafter.runner.compiled is None or drafter.runner.few_rows is None:
        raise SystemExit("the head's programs are off (no g++?): nothing to compare")
    width = drafter.head.cfg.feature_size
    rows_ms = []
    with torch.inference_mode():
        for rows in (int(r) for r in args.rows.split(",")):
            def chunked(rows: int = rows) -> None:
                for a in range(0, rows, FEW_ROWS):
                    forward(drafter.runner.few_rows, width, PREFIX + a, min(FEW_ROWS, rows - a))

            whole = round(median_ms(lambda rows=rows: forward(drafter.runner.compiled, width, PREFIX, rows),
                                    args.repeats), 3)
            chunks = round(median_ms(chunked, args.repeats), 3)
            rows_ms.append({"rows": rows, "one_forward_ms": whole, "few_row_forwards_ms": chunks})
            print(f"{args.algorithm} {rows:4d} rows: one forward {whole:7.2f} ms, "
                  f"{FEW_ROWS}-row forwards {chunks:7.2f} ms", flush=True)
    report = {"algorithm": args.algorithm, "few_rows": FEW_ROWS, "prefix": PREFIX, "hardware": describe(),
              "chunked_catch_up": drafter.runner.chunked_catch_up, "rows": rows_ms}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
