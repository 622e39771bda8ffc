"""What rounding the GGUF target's activations (`gguf_activations`) costs and saves: the integer kernel over
SmolLM2's 121 matrices at 1-32 rows with 3 digits (float32's precision), 2 (q16) and 1 (q8), timed
alternately in one process; and the eager target's quality with each, over the text of
bench/grounded.jsonl, bench/chat_heldout.jsonl and ten bench/structured.jsonl prompts: perplexity, and
how often its top token agrees with float32's along float32's own greedy answers to the chat prompts.

    .venv/bin/python bench/gguf_activations.py [--rows 1 2 4 8 16 32] [--answer-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import math

import torch
import torch.nn.functional as F
from cpu_linear import best_seconds_alternately
from tokenizers import Tokenizer

from specserve.hardware import describe
from specserve.models.gguf import load_llama_gguf
from specserve.models.kv_cache import KVCache
from specserve.prepare import prepare
from specserve.prompts import render_chat
from specserve_kernels import gguf_gemm

DIGITS = (3, 2, 1)


def logits(model, ids: list[int]) -> torch.Tensor:  # noqa: ANN001
    cache = KVCache(model.cfg, 1, 2048, torch.float32, "cpu")
    a = model.attention_inputs(torch.arange(len(ids))[None], torch.tensor([0]), torch.tensor([0]), None, cache, [0],
                               [0])
    return model(torch.tensor([ids]), a, cache, logit_index=torch.arange(len(ids))[None]).logits[0].double()


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--answer-tokens", type=int, default=64)
    args = parser.parse_args()
    assert gguf_gemm.load() and gguf_gemm.default_layout(gguf_gemm.Q4_1) == gguf_gemm.INT_LAYOUT, "needs AVX-512 VNNI"
    model_dir = prepare()
    print(describe())
    models = {d: load_llama_gguf(model_dir, digits=d).eval() for d in DIGITS}
    layers = [m for m in models[3].modules() if isinstance(m, gguf_gemm.GGUFLinear)]
    for rows in args.rows:
        x = {n: torch.randn(rows, n) for n in {m.in_features for m in layers}}
        fns = [lambda d=d, x=x: [gguf_gemm.gguf_mm(x[m.in_features], m.packed, m.out_features, m.qtype, m.layout, d)
                                 for m in layers] for d in DIGITS]
        seconds = best_seconds_alternately(fns, 9)
        print(f"rows {rows:2d}: " + "   ".join(f"{d} digits {s * 1e3:6.2f} ms" for d, s in zip(DIGITS, seconds)),
              flush=True)
    for m in models.values():
        m.init_rope(2048)
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    texts = [json.loads(line)["prompt"] for f in ("bench/grounded.jsonl", "bench/chat_heldout.jsonl")
             for line in open(f)] + [json.loads(line)["prompt"] for line in open("bench/structured.jsonl")][:10]
    nll, count = dict.fromkeys(DIGITS, 0.0), 0
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False).ids[:1000]
        for d, m in models.items():
            nll[d] += float(F.cross_entropy(logits(m, ids)[:-1], torch.tensor(ids[1:]), reduction="sum"))
        count += len(ids) - 1
    print(f"perplexity over {count} tokens: "
          + ", ".join(f"{d} digits {math.exp(nll[d] / count):.3f}" for d in DIGITS))
    agree, total = dict.fromkeys(DIGITS[1:], 0), 0
    for line in open("bench/chat_heldout.jsonl"):
        ids = tok.encode(render_chat(str(model_dir), json.loads(line)["prompt"]), add_special_tokens=False).ids
        start = len(ids)
        for _ in range(args.answer_tokens):  # float32's greedy answer
            ids.append(int(logits(models[3], ids)[-1].argmax()))
        want = logits(models[3], ids)[start - 1 : -1].argmax(-1)
        for d in DIGITS[1:]:
            agree[d] += int((logits(models[d], ids)[start - 1 : -1].argmax(-1) == want).sum())
        total += len(want)
    print("top token as float32's along its greedy answers: " + ", ".join(
        f"{d} digits {agree[d] / total:.4f} ({agree[d]}/{total})" for d in DIGITS[1:]))


if __name__ == "__main__":
    main()
