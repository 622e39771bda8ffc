"""`specserve-client`: stream one prompt through `llm_<variant>` and print the tokens as they arrive.

    specserve-client --prompt "What is speculative decoding?" --variant ngram --max-tokens 64
"""

from __future__ import annotations

import argparse
import sys
import time

from specserve_client.stream import Delta, GenerateError, stream
from specserve_client.variants import variant_name

DEFAULT_URLS = {"grpc": "localhost:8001", "http": "localhost:8000"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="specserve-client", description=__doc__.splitlines()[0])
    p.add_argument("--prompt", required=True)
    p.add_argument("--variant", type=variant_name, default="none", help="streams from llm_<variant> (default: none)")
    p.add_argument("--protocol", choices=("grpc", "http"), default="grpc")
    p.add_argument("--url", help="host:port (default: localhost:8001 for grpc, localhost:8000 for http)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--seed", type=int)
    p.add_argument("--no-chat-template", action="store_true", help="send the prompt raw instead of as a chat turn")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    url = args.url or DEFAULT_URLS[args.protocol]
    start = time.perf_counter()
    first: float | None = None
    last: Delta | None = None
    num_tokens = 0
    try:
        for delta in stream(
            args.protocol, url, f"llm_{args.variant}", args.prompt,
            max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed,
            apply_chat_template=not args.no_chat_template,
        ):
            if first is None and delta.token_ids:
                first = time.perf_counter() - start
            num_tokens += len(delta.token_ids)
            print(delta.text, end="", flush=True)
            last = delta
    except GenerateError as e:
        print(f"\nerror: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ncancelled", file=sys.stderr)
        return 130
    except (ConnectionError, OSError) as e:
        print(f"\nerror: cannot reach the server at {url} ({e}); is `specserve serve` running?", file=sys.stderr)
        return 1
    elapsed = time.perf_counter() - start
    stats = last.stats if last else {}
    print(file=sys.stderr)
    print(
        f"[{num_tokens} tokens in {elapsed:.2f}s = {num_tokens / elapsed:.1f} tok/s; "
        f"first token {first or 0:.3f}s; finish {last.finish_reason if last else None}; "
        f"prompt {int(stats.get('num_input_tokens', 0))} tokens; "
        f"accept length {stats.get('accept_length', 0):.2f}; "
        f"drafts accepted {int(stats.get('total_accepted_draft_tokens', 0))}/"
        f"{int(stats.get('total_draft_tokens', 0))}]",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
