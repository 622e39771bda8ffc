"""Run a command on a machine made busy during its start-up, and quiet for the rest.

    .venv/bin/python bench/busy_start.py --hogs 2 --compile --json results/busy.json -- \
        .venv/bin/specserve bench --algorithm ngram,eagle,eagle3,mtp --dataset mtbench --num-prompts 12 \
        --max-new-tokens 128 --no-hf --json results/bench_busy.json

From the command's start until a line of its output contains `--until` (default: the bench's
"chunks of prompts" progress bar, which starts with the timed part), `--hogs` processes spin on
the CPU and, with `--compile`, another engine's programs compile in a process of their own (the
EAGLE-3 engine of a tiny model, from an empty compile cache), as a second server starting beside
it would. Then they are killed and the command runs on alone. The command's output is passed
through; the JSON says how long the machine was kept busy and what ran. This is what the engine's
start-up timings must survive: nothing here measures speed itself.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HOG = "while True: pass"
COMPILE = """
import sys
from specserve.config import EngineConfig, SpecConfig
from specserve.engine.engine import Engine
Engine(EngineConfig(model_dir=sys.argv[1], dtype="float32", compile_cache_dir=sys.argv[2], max_batch_size=4,
                    max_seq_len=512, spec=SpecConfig(algorithm="ngram")))
"""


def disturbers(hogs: int, compile_model: str | None, cache: str) -> list[subprocess.Popen]:
    procs = [subprocess.Popen([sys.executable, "-c", HOG], start_new_session=True) for _ in range(hogs)]
    if compile_model:  # in a session of its own: stopping it stops its compile workers too
        procs.append(subprocess.Popen([sys.executable, "-c", COMPILE, compile_model, cache], start_new_session=True,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    return procs


def stop(procs: list[subprocess.Popen]) -> None:
    """Kill each disturber's whole process group and wait for it."""
    for b in procs:
        try:
            os.killpg(b.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        b.wait()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hogs", type=int, default=2, help="processes spinning on the CPU (default: one per core of 2)")
    p.add_argument("--compile", action="store_true", help="also compile another engine's programs (the embedded model)")
    p.add_argument("--until", default="chunks of prompts", help="the output line that ends the disturbance")
    p.add_argument("--json", default=None)
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command")
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("give the command after --")
    model = None
    if args.compile:
        from specserve.prepare import default_model_dir

        model = str(default_model_dir())
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as cache:
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        busy = disturbers(args.hogs, model, cache)
        busy_s = None
        assert proc.stdout is not None
        marker, seen = args.until.encode(), b""
        # read what arrives, not lines: tqdm draws "\rchunks of prompts: 0%" and ends that line only
        # at its next redraw, a whole chunk later
        while chunk := os.read(proc.stdout.fileno(), 65536):
            sys.stdout.buffer.write(chunk)
            sys.stdout.flush()
            seen = (seen + chunk)[-(len(marker) + 65536):]
            if busy and marker in seen:
                stop(busy)
                busy, busy_s = [], time.monotonic() - start
        rc = proc.wait()
        stop(busy)  # the marker never came
    record = {"command": command, "hogs": args.hogs, "compile": args.compile, "until": args.until,
              "busy_seconds": round(busy_s, 1) if busy_s is not None else None,
              "seconds": round(time.monotonic() - start, 1), "returncode": rc}
    print(json.dumps(record), file=sys.stderr)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(record, indent=1) + "\n")
    return rc


if __name__ == "__main__":
    sys.exit(main())
