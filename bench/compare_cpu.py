"""`make compare-cpu`: specserve `none` and llama.cpp side by side on this CPU, the same GGUF, the same prompts.

Each held-out chat prompt (chat template applied by specserve, the same token ids to both) goes through
llama.cpp (llama-cpp-python in its own venv, `bench/llama_cpp_worker.py`), specserve on the GGUF's blocks
(`load_format=gguf`) and specserve on the prepared bf16 checkpoint, one after another, the order rotating
from prompt to prompt so a slow spell weighs on all alike. Batch 1, the same threads for all, end-to-end
wall time per request (prompt and decode). Beside the tokens/s: specserve's forward per decode step
against the memory floor of the bytes it reads (the median of read-bandwidth tests after each round of
the same run, with their range: on a shared host the bandwidth swings by 2x within minutes) and its time
per token outside the forward; the CPU's flags. Writes a JSON report.

    .venv/bin/python bench/compare_cpu.py --llama-python .venv-llama-cpp/bin/python [--prompts 12] [--tokens 128]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import torch

from specserve.bench import EngineRun, read_bandwidth_gbs, weight_bytes_per_token
from specserve.config import EngineConfig
from specserve.engine.engine import Engine
from specserve.engine.profile import StepProfile
from specserve.hardware import describe
from specserve.prepare import GGUF_NAME, prepare
from specserve.prompts import load_questions, render_chat

HERE = Path(__file__).resolve().parent


class LlamaCpp:
    """llama.cpp in its own process, one request at a time."""

    def __init__(self, python: str, model: Path, threads: int) -> None:
        self.proc = subprocess.Popen([python, str(HERE / "llama_cpp_worker.py")], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self._send({"model": str(model), "threads": threads, "n_ctx": 2048})
        self.outputs: list[list[int]] = []
        self.seconds = 0.0

    def _send(self, message: dict) -> dict:
        assert self.proc.stdin and self.proc.stdout
        self.proc.stdin.write(json.dumps(message) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("llama.cpp worker exited (see its stderr above)")
        return json.loads(line)

    def run(self, prompt: list[int], max_tokens: int, timed: bool = True) -> None:
        answer = self._send({"prompt": prompt, "max_tokens": max_tokens})
        if timed:
            self.outputs.append([0] * answer["tokens"])
            self.seconds += answer["seconds"]

    @property
    def tokens_per_s(self) -> float:
        return sum(len(o) for o in self.outputs) / self.seconds

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        self.proc.wait(timeout=60)


def forward_figures(engine: Engine, read_gbs: float) -> dict:
    """The engine's decode forward against the floor of the bytes it reads, and its time outside the forward."""
    per_step = engine.profile.per_step_ms()
    nbytes = weight_bytes_per_token(engine.model)
    floor_ms = nbytes / (read_gbs * 1e9) * 1e3
    return {"weight_mb_per_token": round(nbytes / 1e6, 1), "floor_ms": round(floor_ms, 2),
            "forward_ms": per_step["forward"], "total_ms": per_step["total"],
            "outside_forward_ms": round(per_step["total"] - per_step["forward"], 2),
            "forward_share_of_floor": round(floor_ms / per_step["forward"], 3)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-python", required=True, help="the python of a venv with llama-cpp-python")
    ap.add_argument("--dataset", default=str(HERE / "chat_heldout.jsonl"))
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default="results/compare_cpu.json")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    model_dir = prepare()
    engines = {}
    for name, fmt in (("specserve gguf", "gguf"), ("specserve bf16", "safetensors")):
        config = EngineConfig(model_dir=str(model_dir), device="cpu", max_batch_size=1, load_format=fmt,
                              num_threads=args.threads, profile=True, serve_while_compiling=False)
        engines[name] = EngineRun(Engine(config), args.tokens)
    first = next(iter(engines.values())).engine
    prompts = [first.tokenizer.encode(render_chat(str(model_dir), q), add_special_tokens=False).ids
               for q in load_questions(args.dataset, args.prompts)]
    llama = LlamaCpp(args.llama_python, model_dir / GGUF_NAME, args.threads)
    runs: dict = {"llama.cpp": llama, **engines}
    for run in engines.values():
        run.warm_up(prompts[0])
        run.engine.profile = StepProfile()
    llama.run(prompts[0], args.tokens, timed=False)
    order = list(runs)
    bandwidths = []  # the read bandwidth after each round: on a shared host it swings by 2x within minutes
    for i, prompt in enumerate(prompts):
        for name in order[i % len(order):] + order[: i % len(order)]:
            run = runs[name]
            run.run([prompt], i) if isinstance(run, EngineRun) else run.run(prompt, args.tokens)
        bandwidths.append(read_bandwidth_gbs(repeats=3))
    llama.close()
    read_gbs = statistics.median(bandwidths)
    base = llama.tokens_per_s
    report = {
        "hardware": describe(), "threads": args.threads, "prompts": len(prompts), "max_tokens": args.tokens,
        "dataset": args.dataset, "read_bandwidth_gbs": round(read_gbs, 1),
        "read_bandwidth_gbs_range": [round(min(bandwidths), 1), round(max(bandwidths), 1)],
        "tokens_per_s": {name: round(r.tokens_per_s, 2) for name, r in runs.items()},
        "vs_llama_cpp": {name: round(r.tokens_per_s / base, 3) for name, r in engines.items()},
        "forward": {name: forward_figures(r.engine, read_gbs) for name, r in engines.items()},
        "same_tokens_gguf_bf16": sum(a == b for a, b in zip(*(r.outputs for r in engines.values()))),
    }
    text = json.dumps(report, indent=2)
    print(text)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
