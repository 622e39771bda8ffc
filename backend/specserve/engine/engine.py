"""The speculative engine: continuous batching over a static KV cache, one verify forward per step.

Each `step()`:
  1. takes new requests and aborts from the inbox (thread-safe `add_request` / `abort`);
  2. admits waiting requests into free slots, each reusing the longest cached prefix of its prompt
     (`prefix_cache`), and prefills the rest of the prompts within `max_num_batched_tokens`, chunk
     by chunk over several steps when longer, packed into one forward without padding
     (`runtime.prefill`); a prompt's last chunk gives its first token (its tree root);
  3. for all other running requests: drafter.propose -> one target forward over every tree with
     tree attention -> verify (greedy or lossless sampling) -> compact accepted KV -> drafter.on_accept;
  4. appends tokens, checks stop conditions, and returns one `RequestOutput` delta per request.

`algorithm=none` is the degenerate tree (root only), so plain decoding is the same code path. Each step's
tree shape comes from `adaptive.ShapeChooser` over the `DraftPlan`'s menu, costs measured first by
`Engine.warm_up`: a step that would not pay for its draft, or whose drafter finds nothing, decodes plainly.
`verification.Verifier` decides what a step accepts; `profile.StepProfile` accumulates where step time
goes. The engine knows nothing about Triton; `loop.py` runs it, `triton_model.py` serves it.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import torch
from tokenizers import Tokenizer

from specserve.config import EngineConfig, SamplingParams
from specserve.draft_plan import DraftPlan
from specserve.drafters import DraftContext, Drafter
from specserve.drafters.factory import build_drafter
from specserve.engine.adaptive import ShapeChooser
from specserve.engine.detokenize import IncrementalDetokenizer
from specserve.engine.grammar import (
    FORCED_ROWS_SHARE,
    FORCED_TOKENS_FOR_NO_DRAFT,
    GrammarCompiler,
    GrammarMatch,
    forced_tokens,
    shape_trees,
)
from specserve.engine.outputs import (
    FINISH_ABORT,
    FINISH_ERROR,
    FINISH_LENGTH,
    FINISH_STOP,
    FINISH_TIMEOUT,
    EngineLoad,
    QueueFull,  # noqa: F401 - callers import it from here too
    RequestOutput,
    merge_outputs,
)
from specserve.engine.prefill_budget import PrefillBudget
from specserve.engine.prefix_cache import PrefixCache, PromptCounters, RunningRows
from specserve.engine.profile import StepProfile, step_clock
from specserve.engine.request import Request
from specserve.engine.verification import Verifier
from specserve.host_memory import keep_freed_memory
from specserve.models.kv_cache import KVCache
from specserve.models.loading import eos_ids, load_target
from specserve.runtime.memory import DeviceMemory, check_kv_cache_fits, compiled_weight_copies
from specserve.runtime.plan import RuntimePlan
from specserve.runtime.prefill import PromptChunk, split_packs
from specserve.runtime.target import TargetRunner
from specserve.staging import to_device
from specserve.tree import DraftShape, DraftTree, TreeBatch

MAX_PACKED_TOKENS = 32768  # prompt tokens per prefill forward (its staged inputs fit the staging ring)
WARM_UP_TEXT = (
    "The quick brown fox jumps over the lazy dog. Speculative decoding drafts a few tokens cheaply and "
    "verifies them with one forward of the target model, so the output stays exactly the same. "
)
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepMode:
    """How a step runs: `shape` forced on every request (None: the chooser's), `observe` whether
    its time and acceptance feed the chooser, `warm_up` whether they seed it (`ShapeChooser.observe`)."""

    shape: DraftShape | None = None
    observe: bool = True
    warm_up: bool = False


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.draft_plan = DraftPlan.of(config.spec)
        self.spec = self.draft_plan.spec
        max_nodes = self.draft_plan.max_nodes  # spare cache positions per slot: padded tree nodes never overflow
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.device = torch.device(config.device)
        if self.device.type == "cpu":  # step buffers reused from the heap, not mapped anew each step
            keep_freed_memory()
        self.model = load_target(config)
        self.model_config = self.model.cfg
        self.plan = RuntimePlan.from_config(config)
        num_slots = config.max_batch_size + self.plan.spare_slots  # static buckets' padding rows write in the spare
        check_kv_cache_fits(config, self.model_config, num_slots, config.max_seq_len + max_nodes,
                            self.draft_plan.shape.num_draft_tokens, DeviceMemory.of(self.device),
                            compiled_weight_copies(self.plan))
        self.cache = KVCache(self.model_config, num_slots, config.max_seq_len + max_nodes, config.kv_torch_dtype,
                             config.device)
        self.model.init_rope(self.cache.max_len)
        self.tokenizer = Tokenizer.from_file(f"{config.model_dir}/tokenizer.json")
        self.eos_ids = eos_ids(config.model_dir, self.model_config)
        self.verifier = Verifier(self.eos_ids, self.device)
        self.drafter: Drafter = build_drafter(self.spec, DraftContext(
            target=self.model, model_dir=config.model_dir, num_slots=config.max_batch_size + self.plan.spare_slots,
            max_len=self.cache.max_len, max_seq_len=config.max_seq_len, dtype=config.torch_dtype, device=config.device,
            draft_plan=self.draft_plan, runtime=self.plan,
        ))
        self.runner = TargetRunner(
            self.model, self.cache, config, self.plan, aux_layers=self.drafter.aux_layers,
            num_draft_tokens=self.draft_plan.shape.num_draft_tokens,
        )
        self.drafter.step_cost = self._step_cost
        # after the runner, which reserves the static buckets' padding slot
        self.prefix_cache = PrefixCache(self.cache, config.enable_prefix_caching, config.prefix_cache_max_tokens)
        self.prompt_counters = PromptCounters()
        self._mode = StepMode()  # the running step's (`step(mode)`)
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self.grammars = GrammarCompiler(config.model_dir, self.model_config.vocab_size, self.eos_ids,
                                        config.structured_output_max_bytes, config.structured_output_compile_timeout_s)
        self._inbox: deque[Request] = deque()
        self._aborts: set[str] = set()
        self._outputs: list[RequestOutput] = []  # the step's outputs so far: `fail_running` still sends them
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.profile = StepProfile()
        self.prefill_budget = PrefillBudget(config.prompt_tokens_per_step, stall=config.prefill_stall_steps)
        menu = self.draft_plan.menu
        self.chooser = ShapeChooser(menu, self.runner.buckets, drafts_catch_up=self.drafter.catches_up)
        # seeding every tree size of the menu lets the warm-up's shape timings run on the faster path
        self.runner.seed_paths(list(self.draft_plan.tree_sizes), self.cache.num_free, config.max_seq_len)
        if len(menu) > 1:
            self.warm_up()

    # ---- called from any thread -------------------------------------------------------------

    def grammar_match(self, params: SamplingParams) -> GrammarMatch | None:
        """A fresh matcher for the request's grammar (None without one), or ValueError. Thread-safe."""
        return None if (spec := params.structured_output) is None else self.grammars.match(spec, params.cache_salt)

    def add_request(self, prompt_ids: Sequence[int], params: SamplingParams, request_id: str | None = None,
                    grammar: GrammarMatch | None = None) -> str:
        """Queue a request; raises ValueError naming the field if it can never run, QueueFull while
        `max_queue_size` requests wait. `grammar`: its structured output's fresh matcher when the
        caller compiled it (`grammar_match`); otherwise it is compiled here."""
        if len(prompt_ids) == 0:
            raise ValueError("prompt: is empty")
        if len(prompt_ids) >= self.config.max_seq_len:
            raise ValueError(f"prompt: {len(prompt_ids)} tokens do not fit max_seq_len ({self.config.max_seq_len})")
        if any(not 0 <= t < self.model_config.vocab_size for t in prompt_ids):
            raise ValueError("prompt: token id outside the vocabulary")
        limit = self.config.max_queue_size
        if limit and len(self._inbox) + len(self.waiting) >= limit:
            raise QueueFull(f"max_queue_size: {limit} requests are already waiting for a slot; retry later")
        if grammar is None:
            grammar = self.grammar_match(params)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        gen = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        req = Request(request_id=rid, prompt_ids=list(prompt_ids), params=params, generator=gen, grammar=grammar,
                      detokenizer=IncrementalDetokenizer(self.tokenizer, params.stop), token_ids=list(prompt_ids))
        with self._lock:
            self._inbox.append(req)
        return rid

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._aborts.add(request_id)

    def has_work(self) -> bool:
        with self._lock:
            return bool(self._inbox or self._aborts or self.waiting or self.running)

    def load(self) -> EngineLoad:
        with self._lock:
            waiting = len(self._inbox) + len(self.waiting)
        counters, running = self.prompt_counters, len(self.running)
        return EngineLoad(waiting=waiting, running=running, kv_slots_used=running,
                          prefix_cache_tokens=self.prefix_cache.cached_tokens,
                          prompt_tokens_reused=counters.reused, prompt_tokens_computed=counters.computed,
                          drafter_cache_tokens=self.drafter.cached_tokens)

    # ---- the engine thread ------------------------------------------------------------------

    @torch.inference_mode()
    def step(self, mode: StepMode = StepMode()) -> list[RequestOutput]:
        """One engine step; `mode` forces a draft shape and says how its time counts (the warm-up's)."""
        self._mode = mode
        step_start = time.perf_counter()
        self._outputs = outputs = self._take_inbox()
        outputs += self._expire()
        self._admit()
        decoding = [r for r in self.running if not r.prefilling]
        budget = self.prefill_budget.tokens(bool(decoding), self.config.max_seq_len * len(self.running))
        work = self._prompt_chunks(budget)
        prefilled = self._prefill(work)
        start = time.perf_counter()
        if decoding:
            self._verify_step(decoding)
        for req in prefilled + decoding:
            if req.finish_reason is not None or req.pending_ids:
                outputs.append(req.output())
            if req.finish_reason is not None:
                self._release(req)
        end = time.perf_counter()
        if decoding:
            self.profile.total += end - start
        self.prefill_budget.observe(end - step_start, sum(len(c.tokens) for _, c in work), bool(decoding))
        self._outputs = []
        return outputs

    def fail_running(self, error: str) -> list[RequestOutput]:
        """After an exception inside a step: the outputs that step had made (aborts, timeouts), and an
        error output ending every running request."""
        outputs, self._outputs = self._outputs, []
        return outputs + [self._end(req, FINISH_ERROR, error) for req in list(self.running)]

    def _end(self, req: Request, reason: str, error: str | None = None) -> RequestOutput:
        """Finish a waiting or running request early (abort, timeout, error): its last output."""
        req.finish_reason, req.error = reason, error
        out = req.output()
        if req in self.waiting:
            self.waiting.remove(req)
        else:
            self._release(req, keep=reason != FINISH_ERROR)  # after an error its K/V are not trusted
        return out

    def _take_inbox(self) -> list[RequestOutput]:
        with self._lock:
            self.waiting.extend(self._inbox)
            self._inbox.clear()
            aborts, self._aborts = self._aborts, set()
        return [self._end(req, FINISH_ABORT)
                for req in [r for r in (*self.waiting, *self.running) if r.request_id in aborts]]

    def _expire(self) -> list[RequestOutput]:
        """End the requests older than request_timeout_s, waiting or running."""
        if not (timeout := self.config.request_timeout_s):
            return []
        now, error = time.monotonic(), f"request timed out after {timeout:g} s (request_timeout_s)"
        return [self._end(req, FINISH_TIMEOUT, error) for req in [r for r in (*self.waiting, *self.running)
                                                                  if now - r.arrival > timeout]]

    def _admit(self) -> None:
        """Waiting requests into free slots (`PrefixCache.place`): each starts with the K/V of its
        prompt's longest cached prefix, copied into its slot with the drafter's state for it."""
        while self.waiting and self.cache.num_free:
            req = self.waiting.popleft()
            rows = [RunningRows(r.slot, r.token_ids, r.cache_len, r.params.cache_salt) for r in self.running]
            place = self.prefix_cache.place(req.prompt_ids, rows, req.params.cache_salt)
            self.cache.copy_prefix(place.source, place.slot, place.reused)
            self.drafter.copy_prefix(place.source, place.slot, place.reused)
            req.slot, req.cache_len, req.num_cached_tokens = place.slot, place.reused, place.reused
            self.prompt_counters.reused += place.reused
            self.running.append(req)
        self.running.sort(key=lambda r: r.slot)  # consecutive slots -> the model reads a cache view

    def _release(self, req: Request, keep: bool = True) -> None:
        """Free its slot, which keeps the K/V of its tokens below cache_len for reuse (unless not `keep`)."""
        if req in self.running:
            self.running.remove(req)
            self.prefix_cache.release(req.slot, req.token_ids[: req.cache_len] if keep else (), req.params.cache_salt)
            self.drafter.release(req.request_id)

    def _prompt_chunks(self, budget: int) -> list[tuple[Request, PromptChunk]]:
        """This step's prompt work: the prefilling requests in arrival order, each its next chunk,
        until `budget` prompt tokens (`PrefillBudget`)."""
        chunks = []
        for req in sorted((r for r in self.running if r.prefilling), key=lambda r: r.arrival):
            n = min(len(req.prompt_ids) - req.cache_len, budget)
            if n <= 0:
                break
            tokens = tuple(req.prompt_ids[req.cache_len : req.cache_len + n])
            chunks.append((req, PromptChunk(req.slot, req.cache_len, tokens)))
            budget -= n
        return chunks

    def _prefill(self, work: list[tuple[Request, PromptChunk]]) -> list[Request]:
        """Prompt chunks packed into forwards without padding (`runtime.prefill`); a request whose
        prompt this completes samples its first token. Returns the requests whose chunk ran."""
        first = 0
        for packed in split_packs([c for _, c in work], MAX_PACKED_TOKENS):  # consecutive chunks each
            reqs = [r for r, _ in work[first : first + len(packed.chunks)]]
            first += len(packed.chunks)
            out = self.runner.prefill(packed)
            for r, c in zip(reqs, packed.chunks):
                r.cache_len = c.end
            self.prompt_counters.computed += packed.num_tokens
            done = [i for i, r in enumerate(reqs) if r.cache_len == len(r.prompt_ids)]
            if done:
                self._first_tokens([reqs[i] for i in done], out.logits.transpose(0, 1), done)  # (K, 1, V)
            if not self.drafter.prefill_optional or self._shape_for(len(self.running), explore=False).drafts:
                self.drafter.on_prefill(reqs, out, packed)
        return [r for r, _ in work]

    def _first_tokens(self, reqs: list[Request], logits: torch.Tensor, rows: list[int]) -> None:
        """Sample each request's first token from its prompt's last logits: rows of logits (K, 1, V)."""
        v = self.verifier.first_tokens(reqs, logits, rows)
        for r, tokens, lp in zip(reqs, v.emitted, v.logprobs):
            self._append_tokens(r, tokens, lp)

    def _fit_trees(self, proposal: list[DraftTree] | TreeBatch, rooms: list[int]) -> TreeBatch:
        """Trim each tree to the nodes its request has room for (nodes are parent-ordered, so a
        prefix is a tree) and batch them on the device. A drafter's on-device batch passes as is."""
        if isinstance(proposal, TreeBatch):
            if proposal.tokens.shape[1] <= min(rooms):
                return proposal
            proposal = proposal.unbatch()
        return TreeBatch.from_trees([t.prefix(room) for t, room in zip(proposal, rooms)]).to(self.device)

    def _step_cost(self, batch_size: int, max_rows: int) -> list[float | None]:
        """Verify steps' expected seconds (`Drafter.step_cost`): their forwards', and the rest of a step's mean."""
        rest = self.profile.overhead_seconds()
        return [None if f is None else f + rest for f in self.runner.forward_seconds(batch_size, max_rows)]

    def _shape_for(self, batch_size: int, explore: bool = True) -> DraftShape:
        """The step's shape: the mode's, plain from disable_by_batch_size on, else the chooser's
        (with `explore` False its best, read without counting a step or exploring)."""
        if self._mode.shape is not None:
            return self._mode.shape
        limit = self.spec.disable_by_batch_size
        if limit and batch_size >= limit:
            return DraftShape(1, 0, 1)
        return self.chooser.choose(batch_size) if explore else self.chooser.best(batch_size)

    def _verify_step(self, reqs: list[Request]) -> None:
        p = self.profile
        clock = partial(step_clock, p, self.device, self.config.profile)  # host time of the profile's phases
        start = t0 = clock()
        shape = self._shape_for(len(reqs))
        forced, drafter_declined = None, False
        if self.config.structured_output_jump_forward and any(r.grammar is not None for r in reqs):
            forced_start = time.perf_counter()
            rows = self.runner.few_rows(len(reqs), FORCED_ROWS_SHARE)  # forced text costs rows like drafts
            limit = self.draft_plan.max_nodes - 1 if rows is None else min(self.draft_plan.max_nodes, rows) - 1
            costs = self._step_cost(len(reqs), limit + 1)  # and fewer where they do not pay (`paying_forced`)
            forced = forced_tokens([r.grammar for r in reqs], self.tokenizer, limit, costs)
            p.grammar += time.perf_counter() - forced_start
            if shape.drafts and all(len(f) >= FORCED_TOKENS_FOR_NO_DRAFT for f in forced):
                shape = DraftShape(1, 0, 1)  # the grammars draft this step (`FORCED_TOKENS_FOR_NO_DRAFT`)
        # a draft after plain steps (or a request's first, over its whole prompt) catches the drafter
        # up on the tokens it skipped: the cost of switching, not of the shape's steady state
        catching_up = shape.drafts and self.drafter.catches_up and not all(r.drafted_last_step for r in reqs)
        rooms = [min(self.config.max_seq_len - r.cache_len, self.draft_plan.max_nodes) for r in reqs]  # tree nodes
        if shape.drafts:
            forwards, model_seconds = self.drafter.num_forwards, self.drafter.forward_seconds
            proposal: list[DraftTree] | TreeBatch = self.drafter.propose(reqs, shape)
            p.drafting_steps += 1
            p.draft_forwards += self.drafter.num_forwards - forwards
            p.draft_model += self.drafter.forward_seconds - model_seconds
            nothing = isinstance(proposal, list) and all(t.num_draft_tokens == 1 for t in proposal)
            batch = None if nothing else self._fit_trees(proposal, rooms)
            if batch is None or batch.is_root_only:  # the drafter found nothing (worth) drafting: a plain step
                shape, drafter_declined = DraftShape(1, 0, 1), self.drafter.declined
        if not shape.drafts:  # plain decoding; a drafter catches up on what it missed when it drafts again
            batch = TreeBatch.root_only(to_device([r.token_ids[-1] for r in reqs], self.device))
        shaped, drafted_rows = None, batch.tokens.shape[1]
        if any(r.grammar is not None for r in reqs):
            grammar_start = time.perf_counter()
            shaped = shape_trees(batch, [r.grammar for r in reqs], forced, rooms)
            batch = shaped.batch.to(self.device) if shaped.changed else batch
            p.grammar += time.perf_counter() - grammar_start
            p.grammar_pruned += shaped.pruned
        t1 = clock()
        p.draft += t1 - t0
        host_lens = [r.cache_len for r in reqs]
        cache_lens, slots = to_device([host_lens, [r.slot for r in reqs]], self.device)  # (B,) each
        positions = cache_lens[:, None] + batch.depth  # (B, N)
        trees = self.verifier.grammar_trees(reqs, batch)  # on a GPU the masks are built while the forward runs
        out, settled = self.runner.step(batch.tokens, positions, slots, cache_lens, batch.mask, batch.is_root_only,
                                        host_lens, [r.slot for r in reqs])
        t2 = clock()
        p.forward += t2 - t1
        masked, mask_seconds = self.verifier.grammar_nodes, self.verifier.grammar_seconds
        v = self.verifier.accept(reqs, batch, out.logits, self.cache.data, slots, cache_lens, trees)
        p.grammar_nodes += self.verifier.grammar_nodes - masked
        p.grammar += self.verifier.grammar_seconds - mask_seconds
        result, emitted, logprobs = v.result, v.emitted, v.logprobs
        if self.device.type != "cpu":  # on a GPU the step's host read waits for its queued work
            p.device_wait += v.device_wait
        t3 = clock()
        p.verify += t3 - t2
        p.steps += 1
        for r, tree_size, tokens, lp in zip(reqs, v.tree_sizes, emitted, logprobs):
            n = len(tokens)  # accept_length: root + accepted drafts; the bonus is the next root
            r.cache_len += n
            r.num_verify_steps += 1
            r.drafted_last_step = shape.drafts
            r.num_draft_tokens += tree_size - 1
            r.num_accepted_tokens += n - 1
            r.pending_accept_lengths.append(n)
            r.pending_tree_sizes.append(tree_size)
            self._append_tokens(r, tokens, lp)
        # finished requests too: the drafter's state for their slot's content may be reused
        t4 = clock()
        accepted = [result.accepted_nodes[i, : len(emitted[i])] for i in range(len(reqs))]
        self.drafter.on_accept(reqs, out, accepted)
        p.drafter_update += clock() - t4
        if self._mode.observe:
            # the chooser weighs a shape by what its drafter's own nodes won
            accepted = v.accepted if shaped is None else shaped.drafters_own(v.accepted)
            lengths = [len(nodes) for nodes in accepted]
            seconds = clock() - start if settled and not catching_up else None
            if seconds is not None and shaped is not None and shaped.changed:  # a grammar changed the rows
                timed = self.chooser.timed(len(reqs), shape)
                seconds = None if timed else self._as_drafted(seconds, len(reqs), drafted_rows, batch.tokens.shape[1])
            nested = None
            if shape.drafts and self.drafter.nested_trees and len(self.chooser.menu) > 1:
                nested = accepted
            self.chooser.observe(len(reqs), shape, seconds, lengths, nested, self._mode.warm_up, drafter_declined)

    def _as_drafted(self, seconds: float, batch_size: int, drafted: int, verified: int) -> float | None:
        """A step's time as if it had verified the drafter's rows per request, not the `verified` ones a grammar
        left (forced text added, drafts pruned): the forward's measured cost of the one swapped for the other's;
        None where either is unmeasured. Only for a shape with no real step time yet (`ShapeChooser.timed`): under
        a grammar nearly every step at batch 8 is reshaped, and the chooser runs untimed shapes first."""
        costs = self.runner.forward_seconds(batch_size, max(drafted, verified))
        if costs[drafted - 1] is None or costs[verified - 1] is None:
            return None
        return seconds - costs[verified - 1] + costs[drafted - 1]

    def _append_tokens(self, req: Request, tokens: list[int],
                       logprobs: list[dict[int, tuple[float, int]]] | None = None) -> None:
        p = req.params
        for j, tok in enumerate(tokens):
            if req.grammar is not None and not req.grammar.accept(tok):  # verification masks: never expected
                req.finish_reason, req.error = FINISH_ERROR, f"structured_output: token {tok} breaks the grammar"
                return
            req.token_ids.append(tok)
            req.pending_ids.append(tok)
            if logprobs is not None:
                req.pending_logprobs.append(logprobs[j])
                req.cumulative_logprob += logprobs[j][tok][0]
            try:
                hit_stop = req.detokenizer.add(tok)
            except Exception as e:  # noqa: BLE001 - tokenizers refuses some byte sequences: this request ends alone
                req.finish_reason, req.error = FINISH_ERROR, f"detokenization failed: {type(e).__name__}: {e}"
                return
            ended = req.grammar is not None and req.grammar.terminated  # its grammar ended with EOS
            if hit_stop or ended or (tok in self.eos_ids and not p.ignore_eos):  # EOS is masked before min_tokens
                req.finish_reason = FINISH_STOP
            elif req.num_output_tokens >= p.max_tokens or len(req.token_ids) >= self.config.max_seq_len:
                req.finish_reason = FINISH_LENGTH
            if req.finish_reason is not None:
                return

    @torch.inference_mode()
    def warm_up(self, steps_per_shape: int = 2) -> None:
        """Measure every draft shape's step time at every batch-size bucket of the chooser on a
        synthetic prompt (the first step of each shape is discarded), so the chooser starts from
        this machine's costs; then leave the engine as if nothing had run (no profile, no cached
        prompt, no counters, the chooser's acceptance forgotten)."""
        chooser = self.chooser
        prompt = self.tokenizer.encode(WARM_UP_TEXT * 2, add_special_tokens=False).ids
        prompt = prompt[: max(1, self.config.max_seq_len // 4)]
        params = SamplingParams(max_tokens=self.config.max_seq_len - len(prompt), ignore_eos=True)
        start, admitting = time.perf_counter(), StepMode(warm_up=True)
        for bs in chooser.buckets:
            ids = [self.add_request(prompt, params, request_id=f"warm-up-{bs}-{i}") for i in range(bs)]
            self.step(admitting)  # admit and prefill
            while any(r.prefilling for r in self.running):  # a prompt longer than max_num_batched_tokens
                self.step(admitting)
            for shape in chooser.menu:
                for i in range(steps_per_shape):
                    self.step(StepMode(shape, observe=i > 0, warm_up=True))
            for rid in ids:
                self.abort(rid)
            self.step(admitting)
        chooser.forget_acceptance()
        self.profile = StepProfile()
        self.prefill_budget.forget_decode_time()
        self.prefix_cache.forget()  # the synthetic prompt is no one's prefix
        self.prompt_counters = PromptCounters()
        log.info("adaptive speculation: %d shapes x batch sizes %s measured in %.1f s",
                 len(chooser.menu), chooser.buckets, time.perf_counter() - start)

    # ---- convenience for the CLI, benchmarks and tests --------------------------------------

    def generate(self, prompts: Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams]) -> list[RequestOutput]:
        """Run prompts to completion (continuous batching); one merged output per prompt, in order."""
        plist = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        merged: dict[str, RequestOutput] = {}
        while self.has_work():
            for out in self.step():
                merged[out.request_id] = merge_outputs(merged.get(out.request_id), out)
        return [merged[i] for i in ids]
