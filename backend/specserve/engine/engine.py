"""The speculative engine: continuous batching over a static KV cache, one verify forward per step.

Each `step()`:
  1. takes new requests and aborts from the inbox (thread-safe `add_request` / `abort`);
  2. admits waiting requests into free slots and prefills them in one batched forward; each gets
     its first token (which becomes its tree root);
  3. for all other running requests: drafter.propose -> one target forward over every tree with
     tree attention -> verify (greedy or lossless sampling) -> compact accepted KV -> drafter.on_accept;
  4. appends tokens, checks stop conditions, and returns one `RequestOutput` delta per request.

`algorithm=none` is the degenerate tree (root only), so plain decoding is the same code path.
Each step's tree shape comes from `adaptive.ShapeChooser` (the configured shape alone when the user
pins it): a step that would not pay for its draft decodes plainly. `StepProfile` accumulates where
step time goes. The engine knows nothing about Triton; `loop.py` runs it on a thread, `triton_model.py` serves it.
"""

from __future__ import annotations

import itertools
import json
import logging
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tokenizers import Tokenizer

import specserve_kernels as K
from specserve.config import EngineConfig, SamplingParams
from specserve.drafters import DraftContext, Drafter
from specserve.drafters.factory import build_drafter
from specserve.engine.adaptive import PathChooser, ShapeChooser, shape_menu
from specserve.engine.detokenize import IncrementalDetokenizer
from specserve.engine.outputs import (
    FINISH_ABORT,
    FINISH_ERROR,
    FINISH_LENGTH,
    FINISH_STOP,
    FINISH_TIMEOUT,
    EngineLoad,
    RequestOutput,
)
from specserve.engine.sampling import (
    apply_penalties,
    draw_uniforms,
    suppress_eos,
    target_probs,
    token_logprobs,
)
from specserve.host_memory import keep_freed_memory
from specserve.models.attention import (
    TORCH_ATTENTION,
    AttentionBackend,
    FlashInferAttention,
    resolve_attention,
)
from specserve.models.compiled import CompiledTarget, can_compile, compiled_or_none
from specserve.models.cpu_linear import pack_for_inference
from specserve.models.cuda_graph import GraphRunner, default_batch_sizes
from specserve.models.kv_cache import KVCache
from specserve.models.llama import ForwardOutput
from specserve.models.weights import load_llama
from specserve.tree import DraftShape, DraftTree, TreeBatch

log = logging.getLogger(__name__)

MAX_TREE_NODES = 64  # the cache keeps this many spare positions so padded tree nodes never overflow
WARM_UP_TEXT = (
    "The quick brown fox jumps over the lazy dog. Speculative decoding drafts a few tokens cheaply and "
    "verifies them with one forward of the target model, so the output stays exactly the same. "
)


class QueueFull(RuntimeError):
    """`add_request` while `max_queue_size` requests already wait: try again later."""


@dataclass
class StepProfile:
    """Seconds spent per phase of the verify steps so far (prefill steps are left out).

    draft: drafter.propose (catch-up forward included); forward: the target's verify forward;
    verify: acceptance and KV compaction (the step's one host sync); drafter_update: on_accept;
    bookkeeping: the rest of the step (appending tokens, stop checks, detokenizing, outputs).
    drafting_steps: the steps that drafted; draft_forwards: the draft model forwards their
    proposes ran (catch-ups included); draft_model: the part of the draft phase spent inside those
    forwards and the draft model's output layer (`Drafter.forward_seconds`).
    """

    steps: int = 0
    drafting_steps: int = 0
    draft_forwards: int = 0
    draft: float = 0.0
    draft_model: float = 0.0
    forward: float = 0.0
    verify: float = 0.0
    drafter_update: float = 0.0
    total: float = 0.0  # whole verify steps, outputs included

    def per_step_ms(self) -> dict[str, float]:
        """Milliseconds per step of each phase, bookkeeping = total - the timed phases; the draft
        phase also per drafting step and per draft forward."""
        counts = ("steps", "drafting_steps", "draft_forwards")
        n = max(self.steps, 1)
        out = {k: round(v * 1e3 / n, 3) for k, v in asdict(self).items() if k not in counts}
        out["bookkeeping"] = round(out["total"] - out["draft"] - out["forward"] - out["verify"] - out["drafter_update"], 3)
        if self.drafting_steps:
            out["draft_per_drafting_step"] = round(self.draft * 1e3 / self.drafting_steps, 3)
        if self.draft_forwards:
            out["draft_per_forward"] = round(self.draft * 1e3 / self.draft_forwards, 3)
            out["draft_model_per_forward"] = round(self.draft_model * 1e3 / self.draft_forwards, 3)
        return {k: getattr(self, k) for k in counts} | out


@dataclass(eq=False)
class Request:
    """One request's mutable state, owned by the engine thread."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    generator: torch.Generator | None
    arrival: float = field(default_factory=time.monotonic)
    token_ids: list[int] = field(default_factory=list)  # prompt + generated; last = tree root
    slot: int = -1
    cache_len: int = 0  # tokens whose K/V are in the slot (all of token_ids but the root)
    finish_reason: str | None = None
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_verify_steps: int = 0
    drafted_last_step: bool = False  # so the drafter has seen all but the last step's tokens
    pending_ids: list[int] = field(default_factory=list)  # generated since the last output
    pending_accept_lengths: list[int] = field(default_factory=list)
    pending_tree_sizes: list[int] = field(default_factory=list)
    pending_logprobs: list[dict[int, tuple[float, int]]] = field(default_factory=list)
    cumulative_logprob: float = 0.0

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_ids)

    def output(self) -> RequestOutput:
        finished = self.finish_reason is not None
        out = RequestOutput(
            request_id=self.request_id,
            token_ids=self.pending_ids,
            text=self.detokenizer.delta(final=finished),
            finished=finished,
            finish_reason=self.finish_reason,
            num_prompt_tokens=len(self.prompt_ids),
            num_output_tokens=self.num_output_tokens,
            num_draft_tokens=self.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens,
            num_verify_steps=self.num_verify_steps,
            accept_lengths=self.pending_accept_lengths,
            tree_sizes=self.pending_tree_sizes,
            logprobs=self.pending_logprobs if self.params.logprobs is not None else None,
            cumulative_logprob=self.cumulative_logprob,
        )
        self.pending_ids, self.pending_accept_lengths, self.pending_tree_sizes = [], [], []
        self.pending_logprobs = []
        return out


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.spec = config.spec.resolved()
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.device = torch.device(config.device)
        if self.device.type == "cpu":  # step buffers reused from the heap, not mapped anew each step
            keep_freed_memory()
        self.model = load_llama(config.model_dir, config.torch_dtype, config.device)
        self.model_config = self.model.cfg
        # static shapes (decode, verify, drafts) run through buckets; on CUDA in auto mode they are captured
        self.use_graphs = config.graph_mode == "static" or (config.graph_mode == "auto" and self.device.type == "cuda")
        self.capture_graphs = self.device.type == "cuda" and config.graph_mode == "auto"
        max_bs = min(config.cuda_graph_max_bs or config.max_batch_size, config.max_batch_size)
        self.graph_batch_sizes = default_batch_sizes(max_bs)
        self.cache = KVCache(  # with graphs, one more slot than requests: padding rows write there
            self.model_config, config.max_batch_size + int(self.use_graphs), config.max_seq_len + MAX_TREE_NODES,
            config.torch_dtype, config.device,
        )
        self.model.init_rope(self.cache.max_len)
        self.attention = resolve_attention(config.attention_backend, self.device, config.torch_dtype)
        self.model.attention_backend = self._attention_backend()
        self.tokenizer = Tokenizer.from_file(f"{config.model_dir}/tokenizer.json")
        self.eos_ids = self._eos_ids()
        compile_on_cpu = config.cpu_compile and not self.use_graphs and can_compile(self.device)
        self.drafter: Drafter = build_drafter(self.spec, DraftContext(
            target=self.model, model_dir=config.model_dir, num_slots=config.max_batch_size + int(self.use_graphs),
            max_len=self.cache.max_len, max_seq_len=config.max_seq_len, dtype=config.torch_dtype, device=config.device,
            graph_batch_sizes=self.graph_batch_sizes if self.use_graphs else (), capture_graphs=self.capture_graphs,
            compile_cache_dir=config.compile_cache_path if compile_on_cpu else None, step_matmul=config.step_matmul,
        ))
        self.graphs = self._graph_runner() if self.use_graphs else None
        # on CPU: the target's forwards through one compiled program (exported from the plain weights, so first)
        self.compiled = compiled_or_none("target", lambda: CompiledTarget(
            self.model, self.cache, self.drafter.aux_layers, config.max_batch_size, config.max_seq_len,
            config.compile_cache_path, config.step_matmul,
        )) if compile_on_cpu else None
        if pack_for_inference(self.model, keep_weights=("lm_head",)):  # drafters share the lm_head
            log.info("target: bf16 linear weights prepacked for oneDNN (CPU)")
        self._default_generator = torch.Generator().manual_seed(0)
        self._forced_shape: DraftShape | None = None  # warm-up runs each shape in turn
        self._observe = True  # whether steps feed the chooser's estimates
        self._warming_up = False  # steps then seed the chooser's time estimates (`ShapeChooser.observe`)
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._inbox: deque[Request] = deque()
        self._aborts: set[str] = set()
        self._outputs: list[RequestOutput] = []  # the step's outputs so far: `fail_running` still sends them
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.profile = StepProfile()
        spec = self.spec
        full = DraftShape.configured(spec)
        pinned = not config.spec.adaptive or bool(config.spec.num_steps or config.spec.topk or config.spec.num_draft_tokens)
        menu = (full,) if pinned or spec.algorithm == "none" else shape_menu(spec.num_steps, spec.topk, spec.num_draft_tokens)
        self.chooser = ShapeChooser(menu, default_batch_sizes(config.max_batch_size),
                                    drafts_catch_up=self.drafter.catches_up)
        # per step: the compiled step program or the eager forward, whichever is measured faster
        self.paths = PathChooser(pinned=config.compiled_steps == "always")
        if self.compiled is not None and config.compiled_steps == "auto":
            self._time_step_paths(self.chooser.buckets)
        if len(menu) > 1:
            self._warm_up()

    @torch.inference_mode()
    def _time_step_paths(self, buckets: Sequence[int], repeats: int = 3) -> None:
        """Seed the path choice: each bucket's step at every tree size of the shape menu (1 = decode)
        timed through the compiled program and eagerly, interleaved, on free slots at a mid-length
        context; the median of `repeats` after two untimed calls. The K/V written land in free
        slots, which a prefill overwrites. Serving steps keep measuring both paths. Seeding every
        size lets the warm-up's shape timings, and serving's first steps, run on the faster path."""
        context = min(256, self.config.max_seq_len // 2)
        sizes = sorted({1, *(min(s.num_draft_tokens, MAX_TREE_NODES) for s in self.chooser.menu)})
        for b in buckets:
            if b > self.cache.num_free:
                continue
            for t in sizes:
                run = self._step_forwards(b, t, context)
                samples: dict[str, list[float]] = {name: [] for name in run}
                for i in range(repeats + 2):
                    for name, forward in run.items():
                        start = time.perf_counter()
                        forward()
                        if i >= 2:
                            samples[name].append(time.perf_counter() - start)
                for name in run:
                    self.paths.seed((b, t), name, statistics.median(samples[name]))
                log.info("target step at batch %d, %d token(s): compiled %.1f ms, eager %.1f ms -> %s", b, t,
                         statistics.median(samples["compiled"]) * 1e3, statistics.median(samples["eager"]) * 1e3,
                         self.paths.best((b, t)))

    @property
    def compiled_step_buckets(self) -> tuple[int, ...]:
        """The batch-size buckets whose decode steps run the compiled step program now."""
        if self.compiled is None:
            return ()
        return tuple(b for b in self.chooser.buckets if self.paths.best((b, 1)) == "compiled")

    def _step_forwards(self, b: int, t: int, context: int) -> dict[str, Callable[[], object]]:
        """A step of b requests with t-node chains at `context` cached tokens, through the compiled
        program and eagerly (what `_verify_step` runs), on the first b slots."""
        dev = self.device
        tokens = torch.zeros(b, t, dtype=torch.int64, device=dev)
        slots, host_lens = torch.arange(b, device=dev), [context] * b
        cache_lens = torch.full((b,), context, device=dev)
        positions = cache_lens[:, None] + torch.arange(t, device=dev)
        mask = torch.ones(t, t, dtype=torch.bool, device=dev).tril().expand(b, t, t)
        aux = self.drafter.aux_layers

        def eager() -> object:
            attn = self.model.attention_inputs(positions, slots, cache_lens, None if t == 1 else mask, self.cache,
                                               host_lens, list(range(b)))
            return self.model(tokens, attn, self.cache, aux_layers=aux)

        return {"compiled": lambda: self.compiled.forward(tokens, positions, slots, cache_lens, mask, host_lens),
                "eager": eager}

    def _attention_backend(self, graph_batch_size: int | None = None, graph_num_tokens: int = 1) -> AttentionBackend:
        if self.attention == "torch":
            return TORCH_ATTENTION
        cfg = self.model_config
        return FlashInferAttention(
            cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, self.cache.max_len, self.config.torch_dtype,
            self.device, graph_batch_size, graph_num_tokens,
        )

    def _graph_runner(self) -> GraphRunner:
        """Buckets: batch sizes up to cuda_graph_max_bs, and 1 token (decode) or a full tree."""
        capture = self.capture_graphs
        return GraphRunner(
            self.model,
            self.cache,
            batch_sizes=self.graph_batch_sizes,
            num_tokens=sorted({1, min(self.spec.num_draft_tokens, MAX_TREE_NODES)}),
            aux_layers=self.drafter.aux_layers,
            padding_slot=self.cache.reserve(),
            make_backend=lambda bs, t: self._attention_backend(bs if capture else None, t),
            capture=capture,
        )

    def _eos_ids(self) -> tuple[int, ...]:
        ids = set(self.model_config.eos_token_ids)
        gen = Path(self.config.model_dir) / "generation_config.json"
        if gen.is_file():
            eos = json.loads(gen.read_text()).get("eos_token_id")
            ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        return tuple(sorted(ids))

    # ---- called from any thread -------------------------------------------------------------

    def add_request(self, prompt_ids: Sequence[int], params: SamplingParams, request_id: str | None = None) -> str:
        """Queue a request; raises ValueError naming the field if it can never run, QueueFull while
        `max_queue_size` requests wait."""
        if len(prompt_ids) == 0:
            raise ValueError("prompt: is empty")
        if len(prompt_ids) >= self.config.max_seq_len:
            raise ValueError(
                f"prompt: {len(prompt_ids)} tokens do not fit the context of {self.config.max_seq_len} tokens"
            )
        if any(not 0 <= t < self.model_config.vocab_size for t in prompt_ids):
            raise ValueError("prompt: token id outside the vocabulary")
        limit = self.config.max_queue_size
        if limit and len(self._inbox) + len(self.waiting) >= limit:
            raise QueueFull(f"max_queue_size: {limit} requests are already waiting for a slot; retry later")
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        gen = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        req = Request(
            request_id=rid,
            prompt_ids=list(prompt_ids),
            params=params,
            detokenizer=IncrementalDetokenizer(self.tokenizer, params.stop),
            generator=gen,
            token_ids=list(prompt_ids),
        )
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
        return EngineLoad(waiting=waiting, running=len(self.running), kv_slots_used=len(self.running))

    # ---- the engine thread ------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        self._outputs = outputs = self._take_inbox()
        outputs += self._expire()
        admitted = self._admit()
        decoding = [r for r in self.running if r not in admitted]
        if admitted:
            self._prefill(admitted)
        start = time.perf_counter()
        if decoding:
            self._verify_step(decoding)
        for req in admitted + decoding:
            if req.finish_reason is not None or req.pending_ids:
                outputs.append(req.output())
            if req.finish_reason is not None:
                self._release(req)
        if decoding:
            self.profile.total += time.perf_counter() - start
        self._outputs = []
        return outputs

    @torch.inference_mode()
    def _warm_up(self, steps_per_shape: int = 2) -> None:
        """Measure every shape's step time at every batch-size bucket on a synthetic prompt (the
        first step of each shape is discarded), so the chooser starts from this machine's costs."""
        prompt = self.tokenizer.encode(WARM_UP_TEXT * 2, add_special_tokens=False).ids
        prompt = prompt[: max(1, self.config.max_seq_len // 4)]
        params = SamplingParams(max_tokens=self.config.max_seq_len - len(prompt), ignore_eos=True)
        start = time.perf_counter()
        self._warming_up = True
        for bs in self.chooser.buckets:
            ids = [self.add_request(prompt, params, request_id=f"warm-up-{bs}-{i}") for i in range(bs)]
            self.step()  # admit and prefill
            for shape in self.chooser.menu:
                for i in range(steps_per_shape):
                    self._forced_shape, self._observe = shape, i > 0
                    self.step()
            for rid in ids:
                self.abort(rid)
            self.step()
        self._forced_shape, self._observe, self._warming_up = None, True, False
        self.chooser.forget_acceptance()
        self.profile = StepProfile()
        log.info("adaptive speculation: %d shapes x batch sizes %s measured in %.1f s",
                 len(self.chooser.menu), self.chooser.buckets, time.perf_counter() - start)

    def fail_running(self, error: str) -> list[RequestOutput]:
        """After an exception inside a step: the outputs that step had made (aborts, timeouts), and an
        error output ending every running request."""
        outputs, self._outputs = self._outputs, []
        return outputs + [self._end(req, FINISH_ERROR, error) for req in list(self.running)]

    def _end(self, req: Request, reason: str, error: str | None = None) -> RequestOutput:
        """Finish a waiting or running request early (abort, timeout, error): its last output."""
        req.finish_reason = reason
        out = req.output()
        out.error = error
        if req in self.waiting:
            self.waiting.remove(req)
        else:
            self._release(req)
        return out

    def _take_inbox(self) -> list[RequestOutput]:
        with self._lock:
            self.waiting.extend(self._inbox)
            self._inbox.clear()
            aborts, self._aborts = self._aborts, set()
        return [self._end(req, FINISH_ABORT) for req in [r for r in (*self.waiting, *self.running) if r.request_id in aborts]]

    def _expire(self) -> list[RequestOutput]:
        """End the requests older than request_timeout_s, waiting or running."""
        timeout = self.config.request_timeout_s
        if not timeout:
            return []
        now, error = time.monotonic(), f"request timed out after {timeout:g} s (request_timeout_s)"
        return [self._end(req, FINISH_TIMEOUT, error) for req in [r for r in (*self.waiting, *self.running)
                                                                  if now - r.arrival > timeout]]

    def _admit(self) -> list[Request]:
        admitted = []
        while self.waiting and self.cache.num_free:
            req = self.waiting.popleft()
            req.slot = self.cache.allocate()
            admitted.append(req)
            self.running.append(req)
        self.running.sort(key=lambda r: r.slot)  # consecutive slots -> the model reads a cache view
        return admitted

    def _release(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
            self.cache.free(req.slot)
            self.drafter.release(req.request_id)

    def _prefill(self, reqs: list[Request]) -> None:
        """One padded causal forward over the prompts; samples each request's first token."""
        lens = [len(r.prompt_ids) for r in reqs]
        t = max(lens)
        tokens = torch.zeros(len(reqs), t, dtype=torch.int64)
        for i, r in enumerate(reqs):
            tokens[i, : lens[i]] = torch.tensor(r.prompt_ids)
        dev = self.device
        positions = torch.arange(t, device=dev).expand(len(reqs), t)
        slots = [r.slot for r in reqs]
        slots_t, zeros = torch.tensor(slots, device=dev), torch.zeros(len(reqs), dtype=torch.int64, device=dev)
        last = torch.tensor(lens, device=dev)[:, None] - 1  # (B, 1)
        if self.compiled is not None and self.compiled.fits(len(reqs), t, 0):
            causal = torch.ones(t, t, dtype=torch.bool, device=dev).tril().expand(len(reqs), t, t)
            out = self.compiled.forward(tokens.to(dev), positions, slots_t, zeros, causal, [0] * len(reqs), last)
        else:
            attn = self.model.attention_inputs(positions, slots_t, zeros, None, self.cache, [0] * len(reqs), slots)
            out = self.model(tokens.to(dev), attn, self.cache, logit_index=last, aux_layers=self.drafter.aux_layers)
        for r, n in zip(reqs, lens):
            r.cache_len = n
        roots = TreeBatch.root_only(torch.tensor([r.token_ids[-1] for r in reqs], device=dev))
        _, emitted, logprobs = self._verify(reqs, roots, out.logits)
        for r, tokens, lp in zip(reqs, emitted, logprobs):
            self._append_tokens(r, tokens, lp)
        self.drafter.on_prefill(reqs, out)

    def _fit_trees(self, reqs: list[Request], proposal: list[DraftTree] | TreeBatch) -> TreeBatch:
        """Trim each tree to the context its request has left (nodes are parent-ordered, so a
        prefix is a tree) and batch them on the device. A drafter's on-device batch passes as is."""
        rooms = [min(self.config.max_seq_len - r.cache_len, MAX_TREE_NODES) for r in reqs]
        if isinstance(proposal, TreeBatch):
            if proposal.tokens.shape[1] <= min(rooms):
                return proposal
            proposal = proposal.unbatch()
        trees = [
            t if t.num_nodes <= room else DraftTree.from_parents(t.tokens[:room].tolist(), t.parents[:room].tolist())
            for t, room in zip(proposal, rooms)
        ]
        return TreeBatch.from_trees(trees).to(self.device)

    def _shape_for(self, batch_size: int) -> DraftShape:
        if self._forced_shape is not None:
            return self._forced_shape
        limit = self.spec.disable_by_batch_size
        if limit and batch_size >= limit:
            return DraftShape(1, 0, 1)
        return self.chooser.choose(batch_size)

    def _verify_step(self, reqs: list[Request]) -> None:
        p, clock = self.profile, self._clock
        start = t0 = clock()
        shape = self._shape_for(len(reqs))
        # a draft after plain steps (or a request's first, over its whole prompt) catches the drafter
        # up on the tokens it skipped: the cost of switching, not of the shape's steady state
        catching_up = shape.drafts and self.drafter.catches_up and not all(r.drafted_last_step for r in reqs)
        if shape.drafts:
            forwards, model_seconds = self.drafter.num_forwards, self.drafter.forward_seconds
            proposal: list[DraftTree] | TreeBatch = self.drafter.propose(reqs, shape)
            p.drafting_steps += 1
            p.draft_forwards += self.drafter.num_forwards - forwards
            p.draft_model += self.drafter.forward_seconds - model_seconds
            batch = self._fit_trees(reqs, proposal)
        else:  # plain decoding this step; a drafter catches up on what it missed when it drafts again
            batch = TreeBatch.root_only(torch.tensor([r.token_ids[-1] for r in reqs], device=self.device))
        t1 = clock()
        p.draft += t1 - t0
        host_lens = [r.cache_len for r in reqs]
        cache_lens = torch.tensor(host_lens, device=self.device)
        slots = torch.tensor([r.slot for r in reqs], device=self.device)
        positions = cache_lens[:, None] + batch.depth  # (B, N)
        new_mask = None if batch.is_root_only else batch.mask
        bucket = self.graphs.bucket_for(*batch.tokens.shape) if self.graphs else None
        path_key = (self.chooser.bucket(len(reqs)), batch.tokens.shape[1])
        path = None
        if self.compiled is not None and self.compiled.fits(*batch.tokens.shape, max(host_lens)):
            path = self.paths.choose(path_key)
        if bucket is not None:
            out = self.graphs.forward(batch.tokens, positions, slots, cache_lens, new_mask, host_lens)
        elif path == "compiled":
            out = self.compiled.forward(batch.tokens, positions, slots, cache_lens, batch.mask, host_lens)
        else:
            attn = self.model.attention_inputs(
                positions, slots, cache_lens, new_mask, self.cache, host_lens, [r.slot for r in reqs]
            )
            out = self.model(batch.tokens, attn, self.cache, aux_layers=self.drafter.aux_layers)
        t2 = clock()
        p.forward += t2 - t1
        if path is not None:
            self.paths.observe(path_key, path, t2 - t1)
        result, emitted, logprobs = self._verify(reqs, batch, out.logits)
        if not batch.is_root_only:
            K.compact_kv(self.cache.data, slots, cache_lens, result.accepted_nodes, result.accept_length)
        t3 = clock()
        p.verify += t3 - t2
        p.steps += 1
        for r, num_nodes, tokens, lp in zip(reqs, batch.num_nodes.tolist(), emitted, logprobs):
            n = len(tokens)  # accept_length: root + accepted drafts; the bonus is the next root
            r.cache_len += n
            r.num_verify_steps += 1
            r.drafted_last_step = shape.drafts
            r.num_draft_tokens += num_nodes - 1
            r.num_accepted_tokens += n - 1
            r.pending_accept_lengths.append(n)
            r.pending_tree_sizes.append(num_nodes)
            self._append_tokens(r, tokens, lp)
        live = [i for i, r in enumerate(reqs) if r.finish_reason is None]
        if live:
            t4 = clock()
            if len(live) < len(reqs):
                rows = torch.tensor(live, device=self.device)
                aux = out.aux_hidden[rows] if out.aux_hidden is not None else None
                out = ForwardOutput(logits=out.logits[rows], hidden=out.hidden[rows], aux_hidden=aux)
            accepted = [result.accepted_nodes[i, : len(emitted[i])] for i in live]
            self.drafter.on_accept([reqs[i] for i in live], out, accepted)
            p.drafter_update += clock() - t4
        if self._observe:
            lengths = [len(e) for e in emitted]
            settled = path is None or self.paths.settled_on(path_key, path)
            seconds = clock() - start if settled and not catching_up else None
            nested = None
            if shape.drafts and self.drafter.nested_trees and len(self.chooser.menu) > 1:
                nested = [row[:n] for row, n in zip(result.accepted_nodes.tolist(), lengths)]
            self.chooser.observe(len(reqs), shape, seconds, lengths, nested, warm_up=self._warming_up)

    def _clock(self) -> float:
        """Host time; on CUDA, after the queued work (only when profiling: it costs a sync)."""
        if self.config.profile and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _verify(
        self, reqs: list[Request], batch: TreeBatch, logits: torch.Tensor
    ) -> tuple[K.VerifyResult, list[list[int]], list[list[dict[int, tuple[float, int]]] | None]]:
        """logits (B, N, V) at the tree nodes -> the verify result; per row, the tokens it emits
        (its accepted drafts, then the bonus token; as many as its accept_length) and, for rows
        that asked for logprobs, each token's (see `sampling.token_logprobs`).

        Greedy rows and sampled rows go to their own kernel call; results are merged by row.
        """
        b, n = batch.tokens.shape
        for i, r in enumerate(reqs):
            suppress_eos(logits[i], batch.depth[i], self.eos_ids, r.params.min_tokens - r.num_output_tokens)
            apply_penalties(logits[i], r.params, r.token_ids, len(r.prompt_ids), batch.tokens[i], batch.mask[i])
        dev = logits.device
        accepted = torch.full((b, n), -1, dtype=torch.int64, device=dev)
        accept_length = torch.zeros(b, dtype=torch.int64, device=dev)
        bonus = torch.zeros(b, dtype=torch.int64, device=dev)
        greedy = [i for i, r in enumerate(reqs) if r.params.greedy]
        sampled = [i for i, r in enumerate(reqs) if not r.params.greedy]
        links = (batch.tokens, batch.first_child, batch.next_sibling)
        if greedy:
            g = torch.tensor(greedy, device=dev)
            res = K.verify_greedy(*(x[g] for x in links), logits[g].argmax(-1))
            accepted[g], accept_length[g], bonus[g] = res.accepted_nodes, res.accept_length, res.bonus_tokens
        if sampled:
            s = torch.tensor(sampled, device=dev)
            probs = torch.stack([target_probs(logits[i], reqs[i].params) for i in sampled])  # (Bs, N, V)
            coins = torch.stack([draw_uniforms(n + 1, reqs[i].generator or self._default_generator) for i in sampled]).to(dev)
            res = K.verify_sample(*(x[s] for x in links), probs, coins[:, :-1].contiguous(), coins[:, -1].contiguous())
            accepted[s], accept_length[s], bonus[s] = res.accepted_nodes, res.accept_length, res.bonus_tokens
        result = K.VerifyResult(accepted_nodes=accepted, accept_length=accept_length, bonus_tokens=bonus)
        path_tokens = torch.gather(batch.tokens, 1, accepted.clamp(min=0))  # (B, N): token of accepted node j
        # the step's one host sync: what was accepted decides what comes next
        paths, lengths, bonuses = path_tokens.tolist(), accept_length.tolist(), bonus.tolist()
        emitted = [p[1:k] + [t] for p, k, t in zip(paths, lengths, bonuses)]
        # token j of a row was drawn at its accepted node j (node 0 = the root)
        logprobs = [
            token_logprobs(logits[i, accepted[i, : len(tokens)]], tokens, r.params.logprobs)
            if r.params.logprobs is not None else None
            for i, (r, tokens) in enumerate(zip(reqs, emitted))
        ]
        return result, emitted, logprobs

    def _append_tokens(self, req: Request, tokens: list[int],
                       logprobs: list[dict[int, tuple[float, int]]] | None = None) -> None:
        p = req.params
        for j, tok in enumerate(tokens):
            req.token_ids.append(tok)
            req.pending_ids.append(tok)
            if logprobs is not None:
                req.pending_logprobs.append(logprobs[j])
                req.cumulative_logprob += logprobs[j][tok][0]
            hit_stop = req.detokenizer.add(tok)
            if hit_stop or (tok in self.eos_ids and not p.ignore_eos):  # EOS is masked before min_tokens
                req.finish_reason = FINISH_STOP
            elif req.num_output_tokens >= p.max_tokens or len(req.token_ids) >= self.config.max_seq_len:
                req.finish_reason = FINISH_LENGTH
            if req.finish_reason is not None:
                return

    # ---- convenience for the CLI, benchmarks and tests --------------------------------------

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]) -> list[RequestOutput]:
        """Run prompts to completion (continuous batching); one merged output per prompt, in order."""
        plist = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        merged: dict[str, RequestOutput] = {}
        while self.has_work():
            for out in self.step():
                merged[out.request_id] = merge_outputs(merged.get(out.request_id), out)
        return [merged[i] for i in ids]


def merge_outputs(acc: RequestOutput | None, out: RequestOutput) -> RequestOutput:
    """Fold a delta into the running total (counters are cumulative already)."""
    if acc is None:
        return out
    out.token_ids = acc.token_ids + out.token_ids
    out.text = acc.text + out.text
    out.accept_lengths = acc.accept_lengths + out.accept_lengths
    out.tree_sizes = acc.tree_sizes + out.tree_sizes
    if acc.logprobs is not None and out.logprobs is not None:
        out.logprobs = acc.logprobs + out.logprobs
    return out
