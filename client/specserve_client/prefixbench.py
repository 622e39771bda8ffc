"""Prompt work through a running tritonserver: prefix caching and chunked prefill, seen by a client.

    python -m specserve_client.prefixbench --url localhost:8001 --metrics-url http://localhost:8002/metrics \\
        --variant none --json results/prefixbench.json

Three scenarios over gRPC streaming (`stream.grpc_stream`), prompts sent raw in ChatML (the
template of the served SmolLM2; `--system` sets its system turn), greedy:

  multi_turn      MT-bench two-turn conversations, one after another: turn 1 answered with up to
                  --turn-tokens tokens, then turn 2 = turn 1's prompt + its answer + the second
                  question. Median TTFT of turn 2, and of the same turn-2 prompts sent "cold" (behind
                  a number of their own, so no cached prefix matches them).
  shared_system   a ~--system-tokens token system prompt: one request first, then --shared-requests
                  requests with different questions after it, --shared-concurrency at a time.
                  Median TTFT of those, beside the first's.
  long_prompt     --streams streams decode; a ~--long-tokens token prompt arrives while they do.
                  The longest gap between a stream's responses while that prompt is prefilled
                  vs the median gap before it arrived, once every stream decoded (the streams'
                  own prompts are prefilled before that), and the long prompt's TTFT vs the same
                  length alone (another text: only the chat header is cached).

The long texts (the shared system prompt, the long prompts) are drawn from --seed: a warm-up run
with another seed shares nothing with the measured one but the chat header.

Requests reuse open gRPC connections, as a serving client does (`--connection-per-request`
opens one for each instead). Each scenario reports the `num_cached_tokens` its responses carry (`responses`: summed
over every request it sent) and, with --metrics-url, how much the server's
`specserve:prompt_tokens_cached_total` / `_computed_total` grew meanwhile. The report
is JSON. This module talks to a server; it starts none and imports nothing of the server package.
"""

from __future__ import annotations

import argparse
import json
import queue
import random
import re
import statistics
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specserve_client.stream import Delta, grpc_stream
from specserve_client.variants import variant_name

DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
FILLER_WORDS = ("river stone lantern orchard copper meadow signal harbor quiet ledger winter thread canyon "
                "pocket violet engine marble sparrow candle forest mirror anchor silver garden rhythm").split()
CHARS_PER_TOKEN = 7.0  # filler words and their spaces per token, measured with SmolLM2's tokenizer


def chatml(system: str, turns: list[tuple[str, str | None]]) -> str:
    """A ChatML conversation: system turn, then (user, assistant) pairs; the last answer None ends
    with the assistant's prompt."""
    text = f"<|im_start|>system\n{system}<|im_end|>\n"
    for user, answer in turns:
        text += f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
        if answer is not None:
            text += f"{answer}<|im_end|>\n"
    return text


def filler(num_tokens: int, seed: int) -> str:
    """About `num_tokens` tokens of words (the server's num_input_tokens says exactly how many)."""
    rng = random.Random(seed)
    words, size = [], 0
    while size < num_tokens * CHARS_PER_TOKEN:
        words.append(rng.choice(FILLER_WORDS))
        size += len(words[-1]) + 1
    return " ".join(words)


def conversations(num: int) -> list[tuple[str, str]]:
    """MT-bench's first `num` questions with two turns (`datasets.mtbench_file`)."""
    from specserve_client.datasets import mtbench_file

    out = []
    for line in mtbench_file().read_text().splitlines():
        if line.strip():
            turns = json.loads(line)["turns"]
            if len(turns) >= 2:
                out.append((turns[0], turns[1]))
    if not out:
        raise ValueError("dataset: MT-bench has no two-turn questions")
    return [out[i % len(out)] for i in range(num)]


# ---- one request ------------------------------------------------------------------------------


@dataclass
class Timed:
    """One streamed request: when each response arrived (perf_counter), its text and counters."""

    sent: float
    arrivals: list[float] = field(default_factory=list)
    text: str = ""
    num_input_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0

    @property
    def ttft(self) -> float:
        return self.arrivals[0] - self.sent

    @property
    def gaps(self) -> list[tuple[float, float]]:
        """(end time, seconds since the previous response) per response after the first."""
        return [(b, b - a) for a, b in zip(self.arrivals, self.arrivals[1:])]


Send = Callable[..., Iterator[Delta]]  # (prompt, max_tokens, ignore_eos=False) -> its responses


def timed(send: Send, prompt: str, max_tokens: int, on_response: Callable[[Timed], None] | None = None,
          ignore_eos: bool = False) -> Timed:
    t = Timed(sent=time.perf_counter())
    for d in send(prompt, max_tokens, ignore_eos):
        if d.token_ids:
            t.arrivals.append(time.perf_counter())
        t.text += d.text
        t.num_input_tokens = int(d.stats.get("num_input_tokens", 0))
        t.num_cached_tokens = int(d.stats.get("num_cached_tokens", 0))
        t.num_output_tokens += int(d.stats.get("num_output_tokens", 0))
        if on_response is not None:
            on_response(t)
    return t


def cold(prompt: str, i: int) -> str:
    """The prompt behind a number of its own (`i`), its first character dropped: about the same
    length, and no prefix of it cached (a token or two at most, where the numbers share digits)."""
    return f"{i}#" + prompt[1:]


def cache_stats(requests: list[Timed]) -> dict[str, Any]:
    return {"num_input_tokens": [r.num_input_tokens for r in requests],
            "num_cached_tokens": [r.num_cached_tokens for r in requests]}


def totals(requests: list[Timed]) -> dict[str, int]:
    """Prompt tokens of every request a scenario sent, and how many of them were cached."""
    return {"prompt_tokens": sum(r.num_input_tokens for r in requests),
            "cached_tokens": sum(r.num_cached_tokens for r in requests)}


# ---- the server's counters ------------------------------------------------------------------------


def scrape(metrics_url: str | None, model: str) -> dict[str, float]:
    """specserve:prompt_tokens_{cached,computed}_total of `model` (empty without a metrics url)."""
    if not metrics_url:
        return {}
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    out = {}
    for name in ("prompt_tokens_cached_total", "prompt_tokens_computed_total"):
        m = re.search(rf'^specserve:{name}\{{[^}}]*model="{re.escape(model)}"[^}}]*\}} (\S+)$', text, re.MULTILINE)
        if m:
            out[name] = float(m.group(1))
    return out


def grown(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0.0) for k in after}


# ---- scenarios --------------------------------------------------------------------------------


def multi_turn(send: Send, system: str, num: int, turn_tokens: int) -> dict[str, Any]:
    firsts, seconds, colds = [], [], []
    for i, (q1, q2) in enumerate(conversations(num)):
        first = timed(send, chatml(system, [(q1, None)]), turn_tokens)
        prompt = chatml(system, [(q1, first.text), (q2, None)])
        seconds.append(timed(send, prompt, turn_tokens))
        colds.append(timed(send, cold(prompt, i), 1))
        firsts.append(first)
    return {
        "conversations": num,
        "turn1_ttft_s_median": statistics.median(r.ttft for r in firsts),
        "turn2_ttft_s_median": statistics.median(r.ttft for r in seconds),
        "turn2_cold_ttft_s_median": statistics.median(r.ttft for r in colds),
        "turn1": cache_stats(firsts),
        "turn2": cache_stats(seconds),
        "turn2_cold": cache_stats(colds),
        "responses": totals(firsts + seconds + colds),
    }


def shared_system(send: Send, system_tokens: int, num: int, concurrency: int, max_tokens: int,
                  seed: int = 0) -> dict[str, Any]:
    system = filler(system_tokens, seed=seed + 1)
    questions = [q1 for q1, _ in conversations(num + 1)]
    first = timed(send, chatml(system, [(questions[0], None)]), max_tokens)
    with ThreadPoolExecutor(concurrency) as pool:
        rest: list[Timed] = []
        for i in range(0, num, concurrency):  # `concurrency` at a time, the next group after them
            group = [chatml(system, [(q, None)]) for q in questions[1 + i : 1 + i + concurrency]]
            rest += pool.map(lambda p: timed(send, p, max_tokens), group)
    return {
        "requests": num,
        "concurrency": concurrency,
        "first_ttft_s": first.ttft,
        "ttft_s_median": statistics.median(r.ttft for r in rest),
        "first": cache_stats([first]),
        "rest": cache_stats(rest),
        "responses": totals([first, *rest]),
    }


def long_prompt(send: Send, system: str, streams: int, long_tokens: int, stream_tokens: int,
                warm_responses: int = 12, seed: int = 0) -> dict[str, Any]:
    alone = timed(send, chatml(system, [(filler(long_tokens, seed=seed + 2), None)]), 4)
    questions = [q1 for q1, _ in conversations(streams)]
    decoding = [threading.Event() for _ in questions]  # set at a stream's `warm_responses`-th response

    def decode(q: str, ready: threading.Event) -> Timed:
        def on_response(t: Timed) -> None:  # never blocks: arrival times stay exact
            if len(t.arrivals) >= warm_responses:
                ready.set()

        return timed(send, chatml(system, [(q, None)]), stream_tokens, on_response, ignore_eos=True)

    with ThreadPoolExecutor(streams) as pool:
        running = [pool.submit(decode, q, ready) for q, ready in zip(questions, decoding)]
        for ready in decoding:
            ready.wait()
        arrived = time.perf_counter()
        contended = timed(send, chatml(system, [(filler(long_tokens, seed=seed + 3), None)]), 4)
        decoded = [r.result() for r in running]
    window = (arrived, contended.arrivals[0])
    all_decode = max(r.arrivals[0] for r in decoded)  # from here every stream decodes
    before = [g for r in decoded for end, g in r.gaps if end - g >= all_decode and end <= arrived]
    during = [g for r in decoded for end, g in r.gaps if end > window[0] and end - g < window[1]]
    return {
        "streams": streams,
        "long_prompt_tokens": contended.num_input_tokens,
        "median_gap_s": statistics.median(before) if before else None,
        "longest_gap_during_prefill_s": max(during) if during else None,
        "responses_during_prefill": len(during),
        "long_ttft_s": contended.ttft,
        "long_ttft_alone_s": alone.ttft,
        "long": cache_stats([alone, contended]),
        "responses": totals([alone, contended, *decoded]),
    }


class Connections:
    """gRPC clients whose connections stay open between requests, as a serving client's do: a
    request takes an idle one (or opens one) and gives it back, so a TTFT is the request's own and
    not a connection's set-up. `per_request`: a new connection for every request instead."""

    def __init__(self, url: str, per_request: bool = False) -> None:
        self.url, self.per_request = url, per_request
        self._idle: queue.SimpleQueue = queue.SimpleQueue()

    def open(self, count: int) -> None:
        """Open `count` connections now (before anything is timed)."""
        import tritonclient.grpc as grpcclient

        if not self.per_request:
            for _ in range(count):
                client = grpcclient.InferenceServerClient(self.url)
                client.is_server_live()
                self._idle.put(client)

    def stream(self, model: str, prompt: str, **kwargs: Any) -> Iterator[Delta]:
        if self.per_request:
            yield from grpc_stream(self.url, model, prompt, **kwargs)
            return
        try:
            client = self._idle.get_nowait()
        except queue.Empty:
            import tritonclient.grpc as grpcclient

            client = grpcclient.InferenceServerClient(self.url)
        try:
            yield from grpc_stream(self.url, model, prompt, client=client, **kwargs)
        finally:
            self._idle.put(client)


def run(url: str, model: str, args: argparse.Namespace) -> dict[str, Any]:
    connections = Connections(url, per_request=args.connection_per_request)
    connections.open(max(args.streams + 1, args.shared_concurrency))

    def send(prompt: str, max_tokens: int, ignore_eos: bool = False) -> Iterator[Delta]:
        return connections.stream(model, prompt, max_tokens=max_tokens, temperature=0.0, apply_chat_template=False,
                                  ignore_eos=ignore_eos, timeout_s=args.timeout_s)

    report: dict[str, Any] = {"model": model, "settings": {k: v for k, v in vars(args).items() if k != "json"}}
    scenarios = {
        "multi_turn": lambda: multi_turn(send, args.system, args.conversations, args.turn_tokens),
        "shared_system": lambda: shared_system(send, args.system_tokens, args.shared_requests,
                                               args.shared_concurrency, args.turn_tokens, seed=args.seed),
        "long_prompt": lambda: long_prompt(send, args.system, args.streams, args.long_tokens, args.stream_tokens,
                                           seed=args.seed),
    }
    for name in args.scenarios.split(","):
        before = scrape(args.metrics_url, model)
        start = time.perf_counter()
        report[name] = scenarios[name]()
        report[name]["seconds"] = time.perf_counter() - start
        if args.metrics_url:
            report[name]["server_counters"] = grown(before, scrape(args.metrics_url, model))
    return report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m specserve_client.prefixbench", description=__doc__.splitlines()[0])
    p.add_argument("--url", default="localhost:8001", help="gRPC host:port of a running server")
    p.add_argument("--metrics-url", help="its Prometheus endpoint, e.g. http://localhost:8002/metrics")
    p.add_argument("--variant", type=variant_name, default="none", help="requests go to llm_<variant>")
    p.add_argument("--scenarios", default="multi_turn,shared_system,long_prompt")
    p.add_argument("--system", default=DEFAULT_SYSTEM, help="the system turn of multi_turn and long_prompt")
    p.add_argument("--conversations", type=int, default=8, help="multi_turn: MT-bench conversations")
    p.add_argument("--turn-tokens", type=int, default=64,
                   help="tokens each answer may have (multi_turn, shared_system)")
    p.add_argument("--system-tokens", type=int, default=1000, help="shared_system: the system prompt's length (about)")
    p.add_argument("--shared-requests", type=int, default=16)
    p.add_argument("--shared-concurrency", type=int, default=4)
    p.add_argument("--streams", type=int, default=4, help="long_prompt: streams decoding when it arrives")
    p.add_argument("--long-tokens", type=int, default=1500, help="long_prompt: its length (about)")
    p.add_argument("--stream-tokens", type=int, default=256, help="long_prompt: tokens each stream decodes")
    p.add_argument("--seed", type=int, default=0, help="draws the long texts (another one for a warm-up run)")
    p.add_argument("--timeout-s", type=float, default=600.0)
    p.add_argument("--connection-per-request", action="store_true",
                   help="open a new gRPC connection for every request (its set-up then counts in the TTFT)")
    p.add_argument("--json", type=Path, help="also write the report here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = run(args.url, f"llm_{args.variant}", args)
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
