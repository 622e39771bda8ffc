"""`specserve bench`: side-by-side tokens/s on the same prompts, dtype and token budget.

One run measures HF transformers `generate()` (batch 1, greedy), our engine with algorithm=none
(the baseline every speed-up is a ratio of) and each speculative algorithm asked for (`runs`, one
row each) on the same chunks of prompts, the engines a few steps each in turn — checking that each
algorithm's greedy output equals `none`'s token for token (`lossless`).
It also estimates the memory-bandwidth limit for batch 1 (weight bytes per token ÷ copy bandwidth).
"""

from __future__ import annotations

import json
import logging
import platform
import time
from dataclasses import replace

import torch
from tqdm import tqdm

from specserve.config import EngineConfig, SamplingParams, SpecConfig
from specserve.engine.engine import Engine
from specserve.engine.outputs import RequestOutput, merge_outputs
from specserve.engine.profile import StepProfile
from specserve.grammar import GrammarSpec
from specserve.hardware import describe
from specserve.models.cpu_linear import PackedLinear
from specserve.models.llama import RMSNorm
from specserve.prompts import load_questions, load_schemas, render_chat
from specserve.tree import DraftShape
from specserve_kernels import gguf_gemm
from specserve_kernels.gguf_gemm import GGUFLinear

log = logging.getLogger(__name__)

STEPS_PER_TURN = 8  # an engine's steps a turn when the engines of a run take turns (`run_in_lockstep`)


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
    """Bytes of weights one decode step reads: every linear (plain, packed or GGUF blocks, the lm_head
    included) and every norm; the embedding gives one row per token and is left out."""
    total = 0
    for module in model.modules():  # a tied lm_head and embedding are one GGUF module, met once
        if isinstance(module, GGUFLinear):
            total += module.weight_nbytes
        elif isinstance(module, torch.nn.Linear):
            total += module.weight.nbytes + (0 if module.bias is None else module.bias.nbytes)
        elif isinstance(module, PackedLinear):
            total += module.weight_nbytes + (0 if module.bias is None else module.bias.nbytes)
        elif isinstance(module, RMSNorm):
            total += module.weight.nbytes
    return total


class EngineRun:
    """One engine under test; `run` times it on a chunk of prompts and accumulates its outputs.
    `grammars`: per prompt index, the structured output its request asks for (none: free text)."""

    def __init__(self, engine: Engine, max_new_tokens: int, grammars: list[GrammarSpec] | None = None) -> None:
        self.engine, self.max_new_tokens, self.grammars = engine, max_new_tokens, grammars
        self.outputs: list[list[int]] = []
        self.texts: list[str] = []
        self.finish_reasons: list[str | None] = []
        self.seconds = 0.0
        self.steps = self.accepted = 0
        self.chunks: list[tuple[int, int, float]] = []  # (first prompt, tokens, seconds) per `run`
        # the queued chunk (`start`): its first prompt, its request ids, its steps' seconds, its outputs so far
        self._first, self._ids, self._chunk_seconds = 0, [], 0.0
        self._merged: dict[str, RequestOutput] = {}

    def params(self, first: int, count: int) -> list[SamplingParams]:
        """The requests' parameters for prompts first .. first + count - 1."""
        return [SamplingParams(max_tokens=self.max_new_tokens,
                               structured_output=self.grammars[i] if self.grammars else None)
                for i in range(first, first + count)]

    def warm_up(self, prompt: list[int]) -> None:
        """A real prompt and budget, untimed; then the profile, shape and path counts start afresh."""
        self.engine.generate([prompt], self.params(0, 1))
        self.engine.drafter.forget()  # a drafter that learns from requests starts the stream knowing none
        self.engine.profile = StepProfile()
        self.engine.chooser.chosen.clear()
        self.engine.runner.paths.chosen.clear()

    def run(self, prompts: list[list[int]], first: int = 0) -> None:
        """Time prompts (numbered from `first`) through the engine together (continuous batching)."""
        self.start(prompts, first)
        while self.advance():
            pass
        self.finish()

    def start(self, prompts: list[list[int]], first: int = 0) -> None:
        """Queue prompts (numbered from `first`) for `advance` to run; the clock does not run yet."""
        params = self.params(first, len(prompts))
        if self.grammars:  # compiled before the clock starts, as a server compiles before queueing
            for p in params:
                self.engine.grammar_match(p)
        self._first, self._ids = first, [self.engine.add_request(p, sp) for p, sp in zip(prompts, params)]
        self._chunk_seconds, self._merged = 0.0, {}

    def advance(self) -> bool:
        """One timed engine step of the queued prompts; False once all of them have finished."""
        start = time.perf_counter()
        outs = self.engine.step()
        seconds = time.perf_counter() - start
        self._chunk_seconds += seconds
        self.seconds += seconds
        for out in outs:
            self._merged[out.request_id] = merge_outputs(self._merged.get(out.request_id), out)
        return self.engine.has_work()

    def finish(self) -> None:
        """Record the queued prompts' outputs, in prompt order, and their chunk's tokens and seconds."""
        outs = [self._merged[i] for i in self._ids]
        self.chunks.append((self._first, sum(len(o.token_ids) for o in outs), self._chunk_seconds))
        self.outputs += [o.token_ids for o in outs]
        self.texts += [o.text for o in outs]
        self.finish_reasons += [o.finish_reason for o in outs]
        self.steps += sum(o.num_verify_steps for o in outs)
        self.accepted += sum(o.num_accepted_tokens for o in outs)

    @property
    def tokens_per_s(self) -> float:
        return sum(len(o) for o in self.outputs) / self.seconds

    @property
    def accept_length(self) -> float:
        return (self.accepted + self.steps) / max(self.steps, 1)

    def tokens_per_s_from(self, first: int) -> float:
        """Tokens/s over the chunks from prompt `first` on (e.g. a stream's last half, when a
        drafter that learns from earlier requests has seen the first)."""
        chunks = [(n, sec) for start, n, sec in self.chunks if start >= first]
        return sum(n for n, _ in chunks) / max(sum(sec for _, sec in chunks), 1e-9)


def output_repetition(outputs: list[list[int]], n: int = 8) -> float:
    """The share of the outputs' n-grams that an earlier output (in stream order) already had:
    how much a drafter that learns from served requests could find."""
    seen: set[tuple[int, ...]] = set()
    repeated = total = 0
    for out in outputs:
        grams = [tuple(out[i : i + n]) for i in range(len(out) - n + 1)]
        repeated += sum(g in seen for g in grams)
        total += len(grams)
        seen.update(grams)
    return repeated / max(total, 1)


def path_mix(engine: Engine) -> dict[str, int]:
    """Target forwards per path (compiled program / eager) since the warm-up."""
    return dict(sorted(engine.runner.paths.chosen.items()))


def shape_mix(engine: Engine) -> dict[str, int]:
    """Steps per draft shape since the warm-up: the chooser's picks, and plain steps it was not
    asked about (`disable_by_batch_size`)."""
    mix = {str(s): n for s, n in sorted(engine.chooser.chosen.items())}
    unchosen = engine.profile.steps - sum(engine.chooser.chosen.values())
    if unchosen > 0:
        plain = str(DraftShape(1, 0, 1))
        mix[plain] = mix.get(plain, 0) + unchosen
    return mix


def start_flagged(engine: Engine) -> bool:
    """Whether a start-up timing of the target's step paths was taken while the machine looked
    busy (its choices then began from a skewed figure)."""
    return engine.runner.paths.start_flagged


def structured_counts(run: EngineRun, schemas: list[dict]) -> dict[str, int]:
    """A structured run's outputs: `valid` (parse and validate against their schema), `invalid`,
    and `cut` (ended at max_tokens, counted apart: a grammar cannot end a text it was not given
    room for)."""
    import jsonschema

    counts = {"valid": 0, "invalid": 0, "cut": 0}
    for text, reason, schema in zip(run.texts, run.finish_reasons, schemas):
        if reason == "length":
            counts["cut"] += 1
            continue
        try:
            jsonschema.validate(json.loads(text), schema)
            counts["valid"] += 1
        except (ValueError, jsonschema.ValidationError):
            counts["invalid"] += 1
    return counts


def run_in_lockstep(runs: list[EngineRun], prompts: list[list[int]], first: int,
                    steps_per_turn: int = STEPS_PER_TURN) -> None:
    """The same prompts through every engine, `steps_per_turn` steps of each in turn until all have finished,
    the turn rotating each round: a slow spell of a shared machine, seconds or a few steps long, falls on every
    engine alike (timed one after the other, chunk by chunk, their ratios spread by several per cent). Not one
    step each: consecutive steps of one program find part of its weights still in the CPU's last-level cache,
    as they do when an engine serves alone, and an engine whose program holds its own copy of them (EAGLE-3's,
    which also returns three layers' features) found less of it there than the engines sharing `none`'s, and
    ran 6 % slower than `none` at one step a turn (1.5 % at eight)."""
    for r in runs:
        r.start(prompts, first)
    busy = list(runs)
    while busy:
        busy = [r for r in busy if all(r.advance() for _ in range(steps_per_turn))]
        busy = busy[1:] + busy[:1]
    for r in runs:
        r.finish()


def run_engine(engine: Engine, prompts: list[list[int]], max_new_tokens: int) -> dict:
    """One engine alone over all prompts at once (continuous batching), after a warm-up:
    tokens_per_s, accept_length and the outputs (for scripts that compare runs themselves)."""
    run = EngineRun(engine, max_new_tokens)
    run.warm_up(prompts[0])
    run.run(prompts)
    return {"tokens_per_s": run.tokens_per_s, "accept_length": run.accept_length, "outputs": run.outputs}


class HFRun:
    """HF `generate()` at batch 1, greedy; extra kwargs e.g. prompt_lookup_num_tokens."""

    def __init__(self, model: torch.nn.Module, max_new_tokens: int, eos: tuple[int, ...],
                 **generate_kwargs: object) -> None:
        self.model = model
        self.kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=list(eos), pad_token_id=eos[0],
                           **generate_kwargs)
        self.outputs: list[list[int]] = []
        self.seconds = 0.0

    def _generate(self, prompt: list[int]) -> list[int]:
        with torch.inference_mode():
            return self.model.generate(torch.tensor([prompt]), **self.kwargs)[0, len(prompt):].tolist()

    def warm_up(self, prompt: list[int]) -> None:
        self._generate(prompt)

    def run(self, prompts: list[list[int]]) -> None:
        for p in prompts:
            start = time.perf_counter()
            self.outputs.append(self._generate(p))
            self.seconds += time.perf_counter() - start

    @property
    def tokens_per_s(self) -> float:
        return sum(len(o) for o in self.outputs) / self.seconds


def run_bench(config: EngineConfig, dataset: str, num_prompts: int, max_new_tokens: int, batch_size: int,
              hf_baseline: bool = True, specs: list[SpecConfig] | None = None, profile: bool = False,
              structured: bool = False) -> dict:
    """specs: the algorithms to compare with none (default: config.spec alone). profile: add each
    run's per-step phase times (`profile_ms`). Every run also reports the shapes its steps chose.
    structured: each dataset row has a JSON `schema` its answer must follow; the baseline is
    `none` under the schema without forced-text drafting, `none+forced` runs beside it with it,
    and every run counts its outputs that validate (`structured_counts`); no HF baseline.

    The runs are interleaved: each chunk of `batch_size` prompts goes through HF, then through `none`
    and every algorithm together, a few engine steps of each in turn (`run_in_lockstep`), so a slow
    spell of a shared machine weighs on all of them alike; the turn rotates from one chunk (and round
    of steps) to the next, so no run always follows the same other one."""
    specs = [s for s in (specs or [config.spec]) if s.method.drafts]
    questions = load_questions(dataset, num_prompts)
    schemas = load_schemas(dataset, num_prompts) if structured else []
    grammars = [GrammarSpec("json_schema", json.dumps(s)) for s in schemas] or None
    hf_baseline = hf_baseline and not structured
    base_config = replace(config, spec=SpecConfig(algorithm="none"))
    if structured:
        base_config = replace(base_config, structured_output_jump_forward=False)
    base_engine = Engine(base_config)
    prompts = [base_engine.tokenizer.encode(render_chat(config.model_dir, q), add_special_tokens=False).ids
               for q in questions]
    report: dict = {
        "algorithms": ["none", *(s.algorithm for s in specs)],
        "dataset": dataset,
        "num_prompts": len(prompts),
        "max_new_tokens": max_new_tokens,
        "batch_size": batch_size,
        "max_batch_size": config.max_batch_size,  # KV-cache slots: at least batch_size; more keep more prefixes
        "dtype": config.dtype,
        "kv_cache_dtype": str(base_engine.cache.data.dtype).removeprefix("torch."),  # the cache's numbers as built
        "machine": f"{platform.machine()} {torch.get_num_threads()} threads",
        "hardware": describe(),
        "interleaved": True,
        "rotated": True,  # each chunk starts with the next run
        "lockstep": True,  # within a chunk the engines take their steps in turn (`run_in_lockstep`)
        "steps_per_turn": STEPS_PER_TURN,
        "cpu_compile": base_engine.runner.compiled is not None,  # the target's AOTInductor-compiled forward
        # the step program's matmuls: the AVX2 few-row kernel or inductor's autotuned ones
        "step_matmul": getattr(base_engine.runner.compiled, "step_matmul", None),
        "step_attention": getattr(base_engine.runner.compiled, "step_attention", None),
        # the GGUF layers' activation digits as served (3: float32's precision; empty: no integer-layout layer)
        "gguf_activation_digits": list(gguf_gemm.activation_digits(base_engine.model)),
    }
    hf = lookup = None
    if hf_baseline:
        from transformers import AutoModelForCausalLM

        hf_model = AutoModelForCausalLM.from_pretrained(config.model_dir, dtype=config.torch_dtype).eval()
        hf = HFRun(hf_model, max_new_tokens, base_engine.eos_ids)
        if any(s.method.hf_lookup_baseline for s in specs):  # HF's own n-gram drafting
            lookup = HFRun(hf_model, max_new_tokens, base_engine.eos_ids, prompt_lookup_num_tokens=10)
    base = EngineRun(base_engine, max_new_tokens, grammars)
    runs = {spec.algorithm: EngineRun(Engine(replace(config, spec=spec)), max_new_tokens, grammars)
            for spec in specs}
    if structured:
        forced = replace(config, spec=SpecConfig(algorithm="none"), structured_output_jump_forward=True)
        runs = {"none+forced": EngineRun(Engine(forced), max_new_tokens, grammars), **runs}
    report["structured"] = structured
    timed: dict[str, EngineRun | HFRun] = {"none": base, **runs}
    if hf is not None:
        timed["hf generate"] = hf
    if lookup is not None:
        timed["hf prompt lookup"] = lookup
    for r in timed.values():
        r.warm_up(prompts[0])
    order = list(timed.values())
    for n, i in enumerate(tqdm(range(0, len(prompts), batch_size), desc="chunks of prompts", unit="chunk")):
        # each chunk starts one run later: a run that pays for following another (HF's allocations,
        # cold caches) pays it in turn, not always the same one
        turn = order[n % len(order):] + order[: n % len(order)]
        chunk = prompts[i : i + batch_size]
        for r in turn:
            if isinstance(r, HFRun):
                r.run(chunk)
        run_in_lockstep([r for r in turn if isinstance(r, EngineRun)], chunk, i)

    report["baseline_tokens_per_s"] = round(base.tokens_per_s, 2)
    half = (len(prompts) // 2 + batch_size - 1) // batch_size * batch_size  # the first chunk of the last half
    report["last_half_first_prompt"] = half
    report["baseline_output_repetition"] = round(output_repetition(base.outputs), 3)
    report["compiled_step_buckets"] = list(base_engine.runner.compiled_step_buckets)  # as chosen at the end
    report["baseline_step_paths"] = base_engine.runner.paths.summary()
    report["baseline_path_mix"] = path_mix(base_engine)
    report["baseline_start_flagged"] = start_flagged(base_engine)
    if structured:
        report["baseline_structured"] = structured_counts(base, schemas)
    if profile:
        report["baseline_profile_ms"] = base.engine.profile.per_step_ms()
    if hf is not None:
        report["hf_tokens_per_s"] = round(hf.tokens_per_s, 2)
        report["none_vs_hf"] = round(base.tokens_per_s / hf.tokens_per_s, 3)
        report["hf_same_output"] = sum(a == b for a, b in zip(hf.outputs, base.outputs)) / len(prompts)
    if lookup is not None:
        report["hf_prompt_lookup_tokens_per_s"] = round(lookup.tokens_per_s, 2)
    if batch_size == 1:
        weight_bytes = weight_bytes_per_token(base_engine.model)
        bw, read_bw = copy_bandwidth_gbs(), read_bandwidth_gbs()
        report["weight_bytes"] = weight_bytes
        report["copy_bandwidth_gbs"] = round(bw, 2)
        report["bandwidth_limit_tokens_per_s"] = round(bw * 1e9 / weight_bytes, 2)
        report["fraction_of_bandwidth_limit"] = round(base.tokens_per_s / report["bandwidth_limit_tokens_per_s"], 3)
        report["read_bandwidth_gbs"] = round(read_bw, 2)
        report["read_bandwidth_limit_tokens_per_s"] = round(read_bw * 1e9 / weight_bytes, 2)
    report["runs"] = {}
    for algorithm, run in runs.items():
        resolved = run.engine.spec
        row = {
            "num_steps": resolved.num_steps, "topk": resolved.topk, "num_draft_tokens": resolved.num_draft_tokens,
            "tokens_per_s": round(run.tokens_per_s, 2),
            "accept_length": round(run.accept_length, 3),
            "speedup": round(run.tokens_per_s / base.tokens_per_s, 3),
            # the same over the stream's last half, after the first taught the drafters that learn
            "speedup_last_half": round(run.tokens_per_s_from(half) / base.tokens_per_s_from(half), 3),
            "lossless": run.outputs == base.outputs,
            "same_output_fraction": sum(a == b for a, b in zip(run.outputs, base.outputs)) / len(prompts),
            "tokens": sum(len(o) for o in run.outputs),
            "adaptive": len(run.engine.chooser.menu) > 1,
            "compiled_step_buckets": list(run.engine.runner.compiled_step_buckets),
            "step_paths": run.engine.runner.paths.summary(),  # forwards through the compiled program / eagerly
            "shapes": run.engine.chooser.summary(),
            "path_mix": path_mix(run.engine),  # target forwards per path in the timed runs
            "shape_mix": shape_mix(run.engine),  # steps per draft shape in the timed runs
            "start_flagged": start_flagged(run.engine),  # a start-up timing taken on a busy machine
        }
        if run.engine.drafter.mix():  # a hybrid: the rows each of its drafters drafted
            row["drafter_mix"] = run.engine.drafter.mix()
        if structured:
            row["structured"] = structured_counts(run, schemas)
        if profile:
            row["profile_ms"] = prof = run.engine.profile.per_step_ms()
            if "draft_model_per_forward" in prof:  # a draft model's forward against a plain decode step
                row["draft_forward_vs_decode"] = round(prof["draft_model_per_forward"]
                                                       / report["baseline_profile_ms"]["forward"], 3)
        if lookup is not None and run.engine.config.spec.method.hf_lookup_baseline:
            row["vs_hf_prompt_lookup"] = round(run.tokens_per_s / lookup.tokens_per_s, 3)
        if hf is not None:
            row["vs_hf"] = round(run.tokens_per_s / hf.tokens_per_s, 3)
        report["runs"][algorithm] = row
    return report


def format_profile(report: dict) -> str:
    """The per-step phase times of every run in a report made with profile=True, as a table; the
    draft phase also per drafting step and per draft model forward (catch-ups included), the
    time inside the draft model per forward (its output layer included) and, for a structured run,
    the grammar's time per step and per masked tree node. A last column marks a run
    whose start-up path timings were taken on a busy machine ("busy start")."""
    phases = ("draft", "forward", "verify", "drafter_update", "bookkeeping", "total",
              "draft_per_drafting_step", "draft_per_forward", "draft_model_per_forward")
    heads = ("draft", "forward", "verify", "drafter_update", "bookkeeping", "total", "draft/drafting", "draft/forward",
             "model/forward")
    if report.get("structured"):  # the grammar's share of the step, and per masked tree node
        phases, heads = (*phases, "grammar", "grammar_per_node"), (*heads, "grammar", "grammar/node")
    rows = [("none", report.get("baseline_profile_ms", {}), report.get("baseline_start_flagged", False))]
    rows += [(alg, run.get("profile_ms", {}), run.get("start_flagged", False))
             for alg, run in report.get("runs", {}).items()]
    lines = [f"{'ms per step':<12}" + "".join(f"{h:>15}" for h in heads) + f"{'start':>12}"]
    for name, prof, flagged in rows:
        lines.append(f"{name:<12}" + "".join(f"{prof[p]:>15.2f}" if p in prof else f"{'':>15}" for p in phases)
                     + f"{'busy start' if flagged else '':>12}")
    return "\n".join(lines)
