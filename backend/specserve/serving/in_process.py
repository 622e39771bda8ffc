"""The engine in-process, as `llm_<variant>` runs it minus Triton (`specserve in-process-bench`):
the figures the client's servebench compares its Triton figures with.

The engine is built from llm_<variant>'s config.pbtxt parameters (with `num_threads` overridden
when asked), on its own `EngineLoop` thread (built there too), as the Triton model runs it. The
prompts go one at a time, after a warm-up request, each tokenized in the model's chat template as
the Triton model tokenizes a request with `apply_chat_template`; greedy. The prompts come from
`specserve_client.datasets.load_prompts`, as those servebench sends through Triton do. tokens/s = generated
tokens / wall time, prefill included.

This module starts no server and compares nothing: servebench runs it as a subprocess and reads
its JSON.
"""

from __future__ import annotations

import gc
import threading
import time
from pathlib import Path
from typing import Any

from specserve.config import SamplingParams
from specserve.engine.engine import Engine
from specserve.engine.loop import EngineLoop
from specserve.engine.outputs import merge_outputs
from specserve.serving.parameters import engine_config_from_parameters, model_dir_from_parameters
from specserve.serving.server import default_repository, read_parameters
from specserve.serving.tokenizer import PromptTokenizer
from specserve_client.datasets import load_prompts

ENGINE_FIELDS = ("algorithm", "max_batch_size", "max_seq_len", "dtype", "num_threads")  # reported as configured


def in_process(variant_params: dict[str, str], prompt_ids: list[list[int]], max_tokens: int) -> dict[str, Any]:
    """The prompts through an engine built from `variant_params` on its `EngineLoop` thread, one at
    a time -> tokens, seconds, tokens_per_s and each prompt's generated token_ids."""
    loop = EngineLoop(lambda: Engine(engine_config_from_parameters(variant_params)))

    def run(ids: list[int], params: SamplingParams) -> Any:
        done, merged = threading.Event(), [None]

        def on_output(out: Any) -> None:
            merged[0] = merge_outputs(merged[0], out)
            if out.finished:
                done.set()

        loop.submit(ids, params, on_output)
        done.wait()
        return merged[0]

    try:
        run(prompt_ids[0], SamplingParams(max_tokens=4))  # warm-up
        outputs, start = [], time.perf_counter()
        for ids in prompt_ids:
            outputs.append(run(ids, SamplingParams(max_tokens=max_tokens)))
        elapsed = time.perf_counter() - start
    finally:
        loop.shutdown()
    tokens = sum(len(o.token_ids) for o in outputs)
    gc.collect()
    return {"tokens": tokens, "seconds": elapsed, "tokens_per_s": tokens / elapsed,
            "token_ids": [o.token_ids for o in outputs]}


def run_variant(variant: str, dataset: str, num_prompts: int, max_tokens: int, repository: Path | None = None,
                num_threads: int | None = None) -> dict[str, Any]:
    """`in_process` for llm_<variant> of `repository` (default: the project's) on the dataset's
    first `num_prompts` prompts (cycled) -> its figures, with the variant, the prompt count,
    max_tokens and the engine's configured `ENGINE_FIELDS`."""
    prompts = load_prompts(dataset, num_prompts)
    params = read_parameters(Path(repository or default_repository()) / f"llm_{variant}" / "config.pbtxt")
    if num_threads:
        params["num_threads"] = str(num_threads)
    tokenizer = PromptTokenizer(model_dir_from_parameters(params))
    prompt_ids = [tokenizer.encode(q, True) for q in prompts]
    return {
        "variant": variant,
        "num_prompts": len(prompts),
        "max_tokens": max_tokens,
        "engine": {k: params.get(k) for k in ENGINE_FIELDS},
        **in_process(params, prompt_ids, max_tokens),
    }
