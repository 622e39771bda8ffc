"""llama.cpp's side of `bench/compare_cpu.py`, run in llama-cpp-python's own venv (`make compare-cpu`).

Reads JSON lines on stdin: first {"model": path, "threads": n, "n_ctx": n}, then one request per line
{"prompt": [token ids], "max_tokens": n}; answers each with {"ids": [...], "seconds": s} on stdout:
greedy (temperature 0), the wall time of the whole request (prompt and decode), as a user of
`Llama.create_completion` would see it.
"""

from __future__ import annotations

import json
import sys
import time

from llama_cpp import Llama


def main() -> int:
    config = json.loads(sys.stdin.readline())
    llm = Llama(model_path=config["model"], n_threads=config["threads"], n_threads_batch=config["threads"],
                n_ctx=config["n_ctx"], verbose=False)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        start = time.perf_counter()
        out = llm.create_completion(prompt=request["prompt"], max_tokens=request["max_tokens"], temperature=0.0,
                                    top_k=1)
        seconds = time.perf_counter() - start
        ids = llm.tokenize(out["choices"][0]["text"].encode(), add_bos=False, special=True)
        print(json.dumps({"ids": ids, "tokens": out["usage"]["completion_tokens"], "seconds": seconds}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
