"""Start-up of `make serve`: from the command's start to the first answer of every served model,
then to each model's switch to its compiled programs.

    .venv/bin/python bench/startup.py --caches empty --json results/startup_empty.json
    .venv/bin/python bench/startup.py --caches filled --json results/startup_filled.json

`--caches empty` points HOME and TORCHINDUCTOR_CACHE_DIR at fresh directories (no compiled
program, no assembled Triton backend, no built kernel); `filled` keeps this user's caches. It
runs `make serve VARIANTS=...` (default: the five variants `make serve` serves), polls each
`llm_<variant>` with a one-token greedy request until it answers, and reads the server's log for
each model's switch to its compiled programs (`--switch-timeout`, 0 = do not wait). With
`--after-switch N`, once a model has switched it is sent the first N MT-bench questions one at a
time (greedy, `--after-switch-tokens` tokens each, ignore_eos) and their output tokens a second are
recorded: how fast the server serves once its start-up is over, to compare a start from empty
caches with one from filled caches. It writes the seconds of each event and the machine
(`specserve.hardware.describe`) as JSON, then stops the server. Nothing else heavy should run meanwhile: a 2-core
machine's timings are its load.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SWITCHED = re.compile(r"(llm_\w+): switched to its compiled programs")


def main(argv: list[str] | None = None) -> int:
    from specserve.hardware import describe
    from specserve_client.stream import GenerateError, http_generate

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--caches", choices=["empty", "filled"], required=True)
    p.add_argument("--variants", default="none,ngram,eagle,eagle3,mtp")
    p.add_argument("--timeout", type=float, default=600.0, help="give up on the first answers after this long")
    p.add_argument("--switch-timeout", type=float, default=900.0)
    p.add_argument("--after-switch", type=int, default=0, help="MT-bench requests sent to each model after its switch")
    p.add_argument("--after-switch-tokens", type=int, default=128)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--log", type=Path, default=None, help="also write the server's log here")
    args = p.parse_args(argv)
    env = dict(os.environ)
    if args.caches == "empty":
        scratch = tempfile.mkdtemp(prefix="specserve-startup-")
        env |= {"HOME": scratch, "TORCHINDUCTOR_CACHE_DIR": str(Path(scratch) / "inductor")}
    models = [f"llm_{v}" for v in args.variants.split(",")]
    start = time.monotonic()
    proc = subprocess.Popen(["make", "-s", "serve", f"VARIANTS={args.variants}"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    switched: dict[str, float] = {}
    log_lines: list[str] = []

    def read_log() -> None:
        for line in proc.stdout:
            log_lines.append(line)
            m = SWITCHED.search(line)
            if m:
                switched[m.group(1)] = round(time.monotonic() - start, 1)

    threading.Thread(target=read_log, daemon=True).start()
    answered: dict[str, float] = {}
    record: dict = {"caches": args.caches, "variants": args.variants, "machine": describe(),
                    "command": f"make serve VARIANTS={args.variants}"}
    live = None
    try:
        while len(answered) < len(models) and time.monotonic() - start < args.timeout:
            if proc.poll() is not None:
                raise RuntimeError("the server exited:\n" + "".join(log_lines[-40:]))
            if live is None:
                try:
                    urllib.request.urlopen("http://localhost:8000/v2/health/live", timeout=2)
                    live = round(time.monotonic() - start, 1)
                except OSError:
                    time.sleep(0.2)
                    continue
            for model in models:
                if model in answered:
                    continue
                try:
                    http_generate("localhost:8000", model, "Hi", timeout_s=30, max_tokens=1, temperature=0.0)
                    answered[model] = round(time.monotonic() - start, 1)
                    print(f"{model} answered at {answered[model]} s", flush=True)
                except (GenerateError, OSError) as e:
                    print(f"{model}: {round(time.monotonic() - start, 1)} s: {e}", flush=True)
            time.sleep(0.5)
        record |= {"server_live_s": live, "answered_s": answered,
                   "all_answered_s": max(answered.values()) if len(answered) == len(models) else None}
        deadline = time.monotonic() + args.switch_timeout
        while len(switched) < len(models) and time.monotonic() < deadline:
            time.sleep(1)
        record |= {"switched_s": dict(switched), "all_switched_s": max(switched.values())
                   if len(switched) == len(models) else None}
        if args.after_switch:
            record["after_switch"] = {model: after_switch(model, args.after_switch, args.after_switch_tokens)
                                      for model in models if model in switched}
    finally:
        stop(proc)
    print(json.dumps(record, indent=1))
    if args.log:
        args.log.parent.mkdir(parents=True, exist_ok=True)
        args.log.write_text("".join(log_lines))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=1) + "\n")
    return 0 if record["all_answered_s"] is not None else 1


def after_switch(model: str, num: int, max_tokens: int) -> dict:
    """`num` MT-bench questions to `model`, one at a time: output tokens a second over them all."""
    from specserve_client.datasets import load_prompts
    from specserve_client.stream import http_generate

    tokens, seconds = 0, 0.0
    for prompt in load_prompts("mtbench", num):
        out = http_generate("localhost:8000", model, prompt, max_tokens=max_tokens, temperature=0.0,
                            ignore_eos=True, apply_chat_template=True)
        tokens, seconds = tokens + len(out.token_ids), seconds + out.latency_s
    record = {"requests": num, "output_tokens": tokens, "seconds": round(seconds, 2),
              "tokens_per_s": round(tokens / seconds, 2)}
    print(f"{model} after its switch: {record}", flush=True)
    return record


def stop(proc: subprocess.Popen) -> None:
    """Stop make, `specserve serve` and the tritonserver it runs (in a process group of its own),
    and wait until the server's port is free, so the next run starts on a quiet machine."""
    os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen("http://localhost:8000/v2/health/live", timeout=2)
        except OSError:
            return
        time.sleep(1)
    subprocess.run(["pkill", "-9", "-f", f"tritonserver --model-repository={ROOT / 'model_repository'}"], check=False)


if __name__ == "__main__":
    sys.exit(main())
