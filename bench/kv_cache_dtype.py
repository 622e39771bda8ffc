"""What the KV cache's numbers (`kv_cache_dtype`) cost and save on the GGUF target: the served engine
(compiled programs, 8-bit activations) with a float32, float16 and bfloat16 cache, decoding the same
prompts in turn, one prompt each before the next (so a drift of the machine weighs on all alike): decode
tokens per second per cache on MT-bench and on long prompts (five bench/grounded.jsonl tasks in one, the
last one to answer: 700-900 tokens read every step); and the eager target's quality with
each, over the text of bench/grounded.jsonl and bench/chat_heldout.jsonl: perplexity, and how often its
top token agrees with the float32 cache's along that cache's own greedy answers to the chat prompts.

    .venv/bin/python bench/kv_cache_dtype.py [--num-prompts 12] [--max-new-tokens 128] [--digits 1]
                                             [--skip-speed] [--skip-quality] [--json results/kv.json]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from specserve.config import EngineConfig, SamplingParams
from specserve.engine.engine import Engine
from specserve.hardware import describe
from specserve.models.gguf import load_llama_gguf
from specserve.models.kv_cache import KVCache
from specserve.prepare import prepare
from specserve.prompts import load_questions, render_chat
from specserve_kernels import gguf_gemm

CACHES = ("float32", "float16", "bfloat16")
GROUNDED = "bench/grounded.jsonl"


def long_prompts(n: int) -> list[str]:
    """n prompts of five grounded tasks each (the earlier four as context, the last one to do)."""
    tasks = [json.loads(line)["prompt"] for line in open(GROUNDED)]
    return ["Earlier tasks, for context:\n\n" + "\n\n".join(tasks[(i + j) % len(tasks)] for j in range(4))
            + "\n\nThe task to do now:\n\n" + tasks[(i + 4) % len(tasks)] for i in range(n)]


def logits(model, ids: list[int], dtype: torch.dtype) -> torch.Tensor:  # noqa: ANN001
    cache = KVCache(model.cfg, 1, 2048, dtype, "cpu")
    a = model.attention_inputs(torch.arange(len(ids))[None], torch.tensor([0]), torch.tensor([0]), None, cache, [0],
                               [0])
    return model(torch.tensor([ids]), a, cache, logit_index=torch.arange(len(ids))[None]).logits[0].double()


def speed(model_dir: str, workloads: dict[str, list[str]], max_new_tokens: int) -> dict[str, dict[str, float]]:
    """Per workload and cache: decode tokens per second (each prompt's tokens after the first over its time
    after the prefill is left out: timed as the whole request less a one-token request's time)."""
    engines = {c: Engine(EngineConfig(model_dir=model_dir, kv_cache_dtype=c, serve_while_compiling=False,
                                      max_batch_size=1)) for c in CACHES}
    tok = next(iter(engines.values())).tokenizer
    out: dict[str, dict[str, float]] = {}
    for name, questions in workloads.items():
        prompts = [tok.encode(render_chat(model_dir, q), add_special_tokens=False).ids for q in questions]
        seconds, tokens = dict.fromkeys(CACHES, 0.0), dict.fromkeys(CACHES, 0)
        for p in prompts:
            for c, e in engines.items():
                e.generate([p], SamplingParams(max_tokens=1))  # its prompt now cached: the next call decodes
                start = time.perf_counter()
                o = e.generate([p], SamplingParams(max_tokens=max_new_tokens))[0]
                seconds[c] += time.perf_counter() - start
                tokens[c] += len(o.token_ids)
        out[name] = {c: tokens[c] / seconds[c] for c in CACHES}
        out[name]["context"] = statistics.mean(len(p) for p in prompts) + max_new_tokens / 2
        print(f"{name}: " + ", ".join(f"{c} {out[name][c]:.1f} tok/s" for c in CACHES)
              + f" (float16 {out[name]['float16'] / out[name]['float32']:.3f}x float32; "
              f"mean context {out[name]['context']:.0f})", flush=True)
    return out


@torch.inference_mode()
def quality(model_dir, answer_tokens: int, digits: int) -> dict[str, float]:  # noqa: ANN001
    model = load_llama_gguf(model_dir, digits=digits).eval()
    model.init_rope(2048)
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    texts = [json.loads(line)["prompt"] for f in (GROUNDED, "bench/chat_heldout.jsonl") for line in open(f)]
    nll, count = dict.fromkeys(CACHES, 0.0), 0
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False).ids[:1000]
        for c in CACHES:
            nll[c] += float(F.cross_entropy(logits(model, ids, getattr(torch, c))[:-1], torch.tensor(ids[1:]),
                                            reduction="sum"))
        count += len(ids) - 1
    result = {f"perplexity_{c}": math.exp(nll[c] / count) for c in CACHES}
    print(f"perplexity over {count} tokens: " + ", ".join(f"{c} {result[f'perplexity_{c}']:.3f}" for c in CACHES))
    agree, total = dict.fromkeys(CACHES[1:], 0), 0
    for line in open("bench/chat_heldout.jsonl"):
        ids = tok.encode(render_chat(str(model_dir), json.loads(line)["prompt"]), add_special_tokens=False).ids
        start = len(ids)
        for _ in range(answer_tokens):  # the float32 cache's greedy answer
            ids.append(int(logits(model, ids, torch.float32)[-1].argmax()))
        want = logits(model, ids, torch.float32)[start - 1 : -1].argmax(-1)
        for c in CACHES[1:]:
            agree[c] += int((logits(model, ids, getattr(torch, c))[start - 1 : -1].argmax(-1) == want).sum())
        total += len(want)
    result.update({f"top_token_agreement_{c}": agree[c] / total for c in CACHES[1:]})
    print("top token as the float32 cache's along its greedy answers: "
          + ", ".join(f"{c} {agree[c] / total:.4f} ({agree[c]}/{total})" for c in CACHES[1:]))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=12)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--answer-tokens", type=int, default=64)
    parser.add_argument("--skip-quality", action="store_true")
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--digits", type=int, default=1, choices=(1, 2, 3),
                        help="the quality model's activation digits (1: the served 8-bit activations, whose rounding "
                             "makes a token sensitive to the last bits of its input; 3: float32's precision)")
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    assert gguf_gemm.load(), "needs the GGUF kernel (x86-64 with AVX2, FMA and F16C)"
    model_dir = prepare()
    print(describe())
    workloads = {"mtbench": load_questions("mtbench", args.num_prompts),
                 "long": long_prompts(args.num_prompts)}
    result = {"machine": describe()}
    if not args.skip_speed:
        result["speed"] = speed(str(model_dir), workloads, args.max_new_tokens)
    if not args.skip_quality:
        result["quality"] = quality(model_dir, args.answer_tokens, args.digits) | {"digits": args.digits}
    if args.json:
        json.dump(result, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
