"""`specserve bench`: side-by-side tokens/s on the same prompts, dtype and token budget.

One run measures, in this order: HF transformers `generate()` (batch 1, greedy), our engine with
algorithm=none (the baseline every speed-up is a ratio of), and each speculative algorithm asked
for (`runs`, one row each) — checking that its greedy output equals `none`'s token for token
(`lossless`).
It also estimates the memory-bandwidth limit for batch 1 (weight bytes per token ÷ copy bandwidth).
"""

from __future__ import annotations

import logging
import platform
import time
from dataclasses import replace

import torch
from tqdm import tqdm

from specserve.config import EngineConfig, SamplingParams, SpecConfig
from specserve.cpu_linear import PackedLinear
from specserve.engine import Engine, StepProfile
from specserve.hardware import describe
from specserve.model import RMSNorm
from specserve.prompts import load_questions, render_chat

log = logging.getLogger(__name__)


def copy_bandwidth_gbs(nbytes: int = 256 * 2**20, repeats: int = 10) -> float:
    """Measured read bandwidth: a large tensor copy moves each byte in and out once."""
    src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    start = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    seconds = (time.perf_counter() - start) / repeats
    return 2 * nbytes / seconds / 1e9 / 2  # read+write traffic, reported as the read half


def read_bandwidth_gbs(nbytes: int = 256 * 2**20, repeats: int = 10) -> float:
    """Measured read-only bandwidth: a reduction over a large tensor reads each byte once (about
    twice `copy_bandwidth_gbs` on this project's CPU: a copy also writes, and allocates on write)."""
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    src.sum()
    start = time.perf_counter()
    for _ in range(repeats):
        src.sum()
    return nbytes / ((time.perf_counter() - start) / repeats) / 1e9


def weight_bytes_per_token(model: torch.nn.Module) -> int:
    """Bytes of weights one decode step reads: every linear (plain or packed, the lm_head
    included) and every norm; the embedding gives one row per token and is left out."""
    total = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            total += module.weight.nbytes + (0 if module.bias is None else module.bias.nbytes)
        elif isinstance(module, PackedLinear):
            total += module.weight_nbytes + (0 if module.bias is None else module.bias.nbytes)
        elif isinstance(module, RMSNorm):
            total += module.weight.nbytes
    return total


def run_engine(engine: Engine, prompts: list[list[int]], max_new_tokens: int, desc: str) -> dict:
    params = SamplingParams(max_tokens=max_new_tokens)
    engine.generate([prompts[0]], params)  # warm-up on a real prompt and budget, untimed
    engine.profile = StepProfile()
    engine.chooser.chosen.clear()
    start = time.perf_counter()
    bar = tqdm(total=len(prompts), desc=desc, unit="prompt")
    ids = [engine.add_request(p, params) for p in prompts]
    merged: dict[str, list[int]] = {i: [] for i in ids}
    finals = {}
    while engine.has_work():
        for out in engine.step():
            merged[out.request_id] += out.token_ids
            if out.finished:
                finals[out.request_id] = out
                bar.update()
    seconds = time.perf_counter() - start
    bar.close()
    outs = [merged[i] for i in ids]
    tokens = sum(len(o) for o in outs)
    steps = sum(finals[i].num_verify_steps for i in ids)
    accepted = sum(finals[i].num_accepted_tokens for i in ids)
    return {
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "accept_length": (accepted + steps) / max(steps, 1),
        "outputs": outs,
        "profile_ms": engine.profile.per_step_ms(),
        "shapes": engine.chooser.summary(),
    }


def run_hf(model, prompts: list[list[int]], max_new_tokens: int, eos: tuple[int, ...], desc: str,
           **generate_kwargs: object) -> dict:
    """HF `generate()` at batch 1, greedy; extra kwargs e.g. prompt_lookup_num_tokens."""
    kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=list(eos), pad_token_id=eos[0],
                  **generate_kwargs)
    with torch.inference_mode():
        model.generate(torch.tensor([prompts[0]]), **kwargs)  # warm-up on a real prompt and budget, untimed
        start = time.perf_counter()
        outs = []
        for p in tqdm(prompts, desc=desc, unit="prompt"):
            ids = model.generate(torch.tensor([p]), **kwargs)[0, len(p):].tolist()
            outs.append(ids)
        seconds = time.perf_counter() - start
    tokens = sum(len(o) for o in outs)
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, "outputs": outs}


def run_bench(config: EngineConfig, dataset: str, num_prompts: int, max_new_tokens: int, batch_size: int,
              hf_baseline: bool = True, specs: list[SpecConfig] | None = None, profile: bool = False) -> dict:
    """specs: the algorithms to compare with none (default: config.spec alone). profile: add each
    run's per-step phase times (`profile_ms`) and the shapes its steps chose (`shapes`)."""
    specs = [s for s in (specs or [config.spec]) if s.algorithm != "none"]
    questions = load_questions(dataset, num_prompts)
    base_engine = Engine(replace(config, spec=SpecConfig(algorithm="none")))
    prompts = [base_engine.tokenizer.encode(render_chat(config.model_dir, q), add_special_tokens=False).ids
               for q in questions]
    report: dict = {
        "algorithms": ["none", *(s.algorithm for s in specs)],
        "dataset": dataset,
        "num_prompts": len(prompts),
        "max_new_tokens": max_new_tokens,
        "batch_size": batch_size,
        "dtype": config.dtype,
        "machine": f"{platform.machine()} {torch.get_num_threads()} threads",
        "hardware": describe(),
    }
    hf = lookup = None
    if hf_baseline:
        from transformers import AutoModelForCausalLM

        hf_model = AutoModelForCausalLM.from_pretrained(config.model_dir, dtype=config.torch_dtype).eval()
        hf = run_hf(hf_model, prompts, max_new_tokens, base_engine.eos_ids, "hf generate")
        report["hf_tokens_per_s"] = round(hf["tokens_per_s"], 2)
        if any(s.algorithm == "ngram" for s in specs):  # HF's own n-gram drafting, the like-for-like baseline
            lookup = run_hf(hf_model, prompts, max_new_tokens, base_engine.eos_ids, "hf prompt lookup",
                            prompt_lookup_num_tokens=10)
            report["hf_prompt_lookup_tokens_per_s"] = round(lookup["tokens_per_s"], 2)
        del hf_model
    base = run_engine(base_engine, prompts, max_new_tokens, "none")
    report["baseline_tokens_per_s"] = round(base["tokens_per_s"], 2)
    if profile:
        report["baseline_profile_ms"] = base["profile_ms"]
    if hf is not None:
        report["none_vs_hf"] = round(base["tokens_per_s"] / hf["tokens_per_s"], 3)
        report["hf_same_output"] = sum(a == b for a, b in zip(hf["outputs"], base["outputs"])) / len(prompts)
    if batch_size == 1:
        weight_bytes = weight_bytes_per_token(base_engine.model)
        bw, read_bw = copy_bandwidth_gbs(), read_bandwidth_gbs()
        report["weight_bytes"] = weight_bytes
        report["copy_bandwidth_gbs"] = round(bw, 2)
        report["bandwidth_limit_tokens_per_s"] = round(bw * 1e9 / weight_bytes, 2)
        report["fraction_of_bandwidth_limit"] = round(base["tokens_per_s"] / report["bandwidth_limit_tokens_per_s"], 3)
        report["read_bandwidth_gbs"] = round(read_bw, 2)
        report["read_bandwidth_limit_tokens_per_s"] = round(read_bw * 1e9 / weight_bytes, 2)
    del base_engine
    report["runs"] = {}
    for spec in specs:
        engine = Engine(replace(config, spec=spec))
        resolved, engine_menu = engine.spec, engine.chooser.menu
        run = run_engine(engine, prompts, max_new_tokens, spec.algorithm)
        del engine
        row = {
            "num_steps": resolved.num_steps, "topk": resolved.topk, "num_draft_tokens": resolved.num_draft_tokens,
            "tokens_per_s": round(run["tokens_per_s"], 2),
            "accept_length": round(run["accept_length"], 3),
            "speedup": round(run["tokens_per_s"] / base["tokens_per_s"], 3),
            "lossless": run["outputs"] == base["outputs"],
            "same_output_fraction": sum(a == b for a, b in zip(run["outputs"], base["outputs"])) / len(prompts),
            "tokens": run["tokens"],
            "adaptive": len(engine_menu) > 1,
            "shapes": run["shapes"],
        }
        if profile:
            row["profile_ms"] = run["profile_ms"]
        if lookup is not None and spec.algorithm == "ngram":
            row["vs_hf_prompt_lookup"] = round(run["tokens_per_s"] / lookup["tokens_per_s"], 3)
        if hf is not None:
            row["vs_hf"] = round(run["tokens_per_s"] / hf["tokens_per_s"], 3)
        report["runs"][spec.algorithm] = row
    return report


def format_profile(report: dict) -> str:
    """The per-step phase times of every run in a report made with profile=True, as a table."""
    phases = ("draft", "forward", "verify", "drafter_update", "bookkeeping", "total")
    rows = [("none", report.get("baseline_profile_ms", {}))]
    rows += [(alg, run.get("profile_ms", {})) for alg, run in report.get("runs", {}).items()]
    lines = [f"{'ms per step':<12}" + "".join(f"{p:>15}" for p in phases)]
    for name, prof in rows:
        lines.append(f"{name:<12}" + "".join(f"{prof.get(p, 0.0):>15.2f}" for p in phases))
    return "\n".join(lines)
