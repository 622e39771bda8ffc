"""CUDA graphs for the target's decode and tree-verify forwards, one per (batch size, tokens) bucket,
and for a drafter's whole multi-step draft, one per batch size (`DraftGraphs`).

A bucket (bs, T) owns static input buffers (tokens, positions, slots, cache lengths, tree mask),
its own attention backend instance and, on CUDA, a captured graph whose outputs live in the
graph's memory pool. `forward` pads a batch of B <= bs requests with n <= T tokens each up to
the bucket, copies it into the buffers, replays, and slices the outputs back to (B, n).

Padding never touches a real request: padding rows write their K/V into a spare slot that the
engine never hands out (`padding_slot`), and padding tokens of a real row sit after its tree, see
only themselves, and write K/V beyond the row's cache length (scratch the next step overwrites).

With `capture=False` the same static forward runs eagerly; that is how the CPU tests check the
padding and slicing logic, and it is what a bucket does on CPU. Every captured function runs
under inference mode and, once before its capture, under `capture_guard`. A bucket whose capture
fails (the guard, or CUDA) runs the same static forward eagerly: the failure is logged once per
cause (`CaptureFailures`) and the model serves. This module does not
decide when graphs are used (the runtime plan does), does not capture prefill, and does not know how a drafter
drafts (it captures the function it is given).
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace
from typing import TypeVar

import torch

from specserve.models.attention import AttentionBackend
from specserve.models.kv_cache import KVCache
from specserve.models.llama import ForwardOutput, LlamaModel
from specserve.runtime.capture_guard import check_capturable
from specserve.staging import to_device
from specserve.tree import DraftShape, TreeBatch

T = TypeVar("T")

log = logging.getLogger(__name__)


def default_batch_sizes(max_batch_size: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then every 8 up to max_batch_size (SGLang's spacing), max_batch_size included."""
    sizes = {b for b in (1, 2, 4) if b <= max_batch_size}
    sizes |= set(range(8, max_batch_size + 1, 8)) | {max_batch_size}
    return tuple(sorted(sizes))


@dataclass
class _Bucket:
    """Static buffers of one (bs, T) bucket. Shapes: tokens, positions (bs, T); slots, cache_lens
    (bs,); new_mask (bs, T, T) bool. `output` is what the last run/replay wrote."""

    tokens: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    cache_lens: torch.Tensor
    new_mask: torch.Tensor
    default_mask: torch.Tensor  # (bs, T, T): each padding token sees itself alone
    backend: AttentionBackend
    graph: torch.cuda.CUDAGraph | None = None
    output: ForwardOutput | None = None


class GraphRunner:
    def __init__(
        self,
        model: LlamaModel,
        cache: KVCache,
        batch_sizes: Sequence[int],
        num_tokens: Sequence[int],
        aux_layers: tuple[int, ...],
        padding_slot: int,
        make_backend: Callable[[int, int], AttentionBackend],
        capture: bool,
    ) -> None:
        """make_backend(bs, T) -> the attention backend a bucket plans and its graph replays."""
        self.model, self.cache, self.aux_layers = model, cache, aux_layers
        self.batch_sizes, self.num_tokens = sorted(set(batch_sizes)), sorted(set(num_tokens))
        self.padding_slot = padding_slot
        self.device = cache.data.device
        self.buckets: dict[tuple[int, int], _Bucket] = {}
        self.graph_bytes = 0
        self.failures = CaptureFailures("target")
        pool = torch.cuda.graph_pool_handle() if capture else None
        before = torch.cuda.memory_allocated(self.device) if capture else 0
        for t in self.num_tokens:
            for bs in reversed(self.batch_sizes):  # largest first, as SGLang: smaller ones reuse its pool
                bucket = self._new_bucket(bs, t, make_backend(bs, t))
                if capture:
                    self._capture(bucket, pool, (bs, t))
                self.buckets[(bs, t)] = bucket
        if capture:
            self.graph_bytes = torch.cuda.memory_allocated(self.device) - before
            log.info(
                "CUDA graphs: %d of %d captured (batch sizes %s x tokens %s), %.1f MiB",
                len(self.buckets) - len(self.failures.keys), len(self.buckets), self.batch_sizes, self.num_tokens,
                self.graph_bytes / 2**20,
            )

    @property
    def num_captured(self) -> int:
        """The buckets that replay a captured graph (the others run their static forward eagerly)."""
        return sum(bk.graph is not None for bk in self.buckets.values())

    def bucket_for(self, batch_size: int, num_tokens: int) -> tuple[int, int] | None:
        """The smallest bucket holding the batch, or None (the caller runs it eagerly)."""
        i = bisect.bisect_left(self.batch_sizes, batch_size)
        j = bisect.bisect_left(self.num_tokens, num_tokens)
        if i == len(self.batch_sizes) or j == len(self.num_tokens):
            return None
        return self.batch_sizes[i], self.num_tokens[j]

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        cache_lens: torch.Tensor,
        new_mask: torch.Tensor | None,
        host_cache_lens: list[int],
    ) -> ForwardOutput:
        """tokens, positions (B, n); slots, cache_lens (B,); new_mask (B, n, n) or None (one token
        each, n = 1) -> logits (B, n, V), hidden (B, n, H), aux (B, n, A) like the eager forward."""
        b, n = tokens.shape
        key = self.bucket_for(b, n)
        assert key is not None, f"no bucket for batch {b} x {n} tokens; check bucket_for first"
        bk = self.buckets[key]
        bs, t = key
        # a batch that fills its bucket overwrites every buffer; a smaller one pads: defaults first
        padded = b < bs or n < t
        if padded:
            bk.tokens.zero_()
            bk.cache_lens.zero_()
            bk.slots.fill_(self.padding_slot)
        bk.tokens[:b, :n] = tokens
        bk.cache_lens[:b] = cache_lens
        if padded:
            bk.positions.copy_(bk.cache_lens[:, None].expand(bs, t))
        bk.positions[:b, :n] = positions
        bk.slots[:b] = slots
        if padded or (new_mask is None and t > 1):  # (a 1-token bucket's mask is always all True)
            bk.new_mask.copy_(bk.default_mask)
        if new_mask is not None:
            bk.new_mask[:b, :n, :n] = new_mask
        if bk.backend.needs_prepare:
            self._plan(bk, list(host_cache_lens) + [0] * (bs - b))
        if bk.graph is not None:
            bk.graph.replay()
        else:
            bk.output = self._run(bk)
        out = bk.output
        assert out is not None
        aux = out.aux_hidden[:b, :n] if out.aux_hidden is not None else None
        return ForwardOutput(logits=out.logits[:b, :n], hidden=out.hidden[:b, :n], aux_hidden=aux)

    # ---- internals ---------------------------------------------------------------------------

    def _new_bucket(self, bs: int, t: int, backend: AttentionBackend) -> _Bucket:
        i64 = dict(dtype=torch.int64, device=self.device)
        default_mask = torch.eye(t, dtype=torch.bool, device=self.device).repeat(bs, 1, 1)
        return _Bucket(
            tokens=torch.zeros(bs, t, **i64),
            positions=torch.zeros(bs, t, **i64),
            slots=torch.full((bs,), self.padding_slot, **i64),
            cache_lens=torch.zeros(bs, **i64),
            new_mask=default_mask.clone(),
            default_mask=default_mask,
            backend=backend,
        )

    def _plan(self, bk: _Bucket, host_cache_lens: list[int]) -> None:
        """Plan the bucket's backend for the buffers' current contents; keys and mask are cut to
        the longest request (flashinfer flattens the mask per request up to its own key count)."""
        a = self.model.static_attention_inputs(bk.positions, bk.slots, bk.cache_lens, bk.new_mask, self.cache,
                                               bk.backend)
        key_len = max(host_cache_lens) + bk.tokens.shape[1]
        assert a.mask is not None
        bk.backend.prepare(replace(a, key_len=key_len, mask=a.mask[..., :key_len]), host_cache_lens)

    def _run(self, bk: _Bucket) -> ForwardOutput:
        """The static forward: every shape from the buffers, nothing read from the host."""
        a = self.model.static_attention_inputs(bk.positions, bk.slots, bk.cache_lens, bk.new_mask, self.cache,
                                               bk.backend)
        return self.model(bk.tokens, a, self.cache, aux_layers=self.aux_layers)

    def captured_functions(self) -> dict[tuple[int, int], Callable[[], ForwardOutput]]:
        """Per bucket, the function its graph captures (what the capture-guard tests run)."""
        return {key: capturable(lambda bk=bk: self._run(bk)) for key, bk in self.buckets.items()}

    def _capture(self, bk: _Bucket, pool: object, key: tuple[int, int]) -> None:
        if bk.backend.needs_prepare:
            self._plan(bk, [0] * bk.tokens.shape[0])  # padding rows only: a valid plan to capture
        bk.graph, bk.output = self.failures.capture(key, capturable(lambda: self._run(bk)), self.device, pool)


def capturable(fn: Callable[[], T]) -> Callable[[], T]:
    """`fn` as a graph captures it: under inference mode (autograd records nothing)."""

    def run() -> T:
        with torch.inference_mode():
            return fn()

    return run


def capture(fn: Callable[[], T], device: torch.device, pool: object) -> tuple[torch.cuda.CUDAGraph, T]:
    """Run `fn` once under the capture guard (a host read or a host operand fails here, named,
    rather than as a capture error), warm it up twice on a side stream (lazy inits and autotuning
    stay outside the graph), then capture one call into `pool`; returns the graph and the output
    its replays rewrite."""
    check_capturable(fn, device.type)
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        output = fn()
    return graph, output


class CaptureFailures:
    """The buckets of one runner whose capture failed; each runs its static forward eagerly.

    `capture` returns (None, None) for such a bucket and logs a warning the first time a cause is
    seen (one line per distinct error, with the buckets counted at the end), so a model whose
    graphs cannot be captured still loads and serves, more slowly, and says why."""

    def __init__(self, runner: str) -> None:
        self.runner = runner
        self.keys: list[object] = []
        self.causes: dict[str, list[object]] = {}

    def capture(self, key: object, fn: Callable[[], T], device: torch.device,
                pool: object) -> tuple[torch.cuda.CUDAGraph | None, T | None]:
        try:
            return capture(fn, device, pool)
        except Exception as e:  # noqa: BLE001 - any failure: this bucket runs eagerly
            cause = f"{type(e).__name__}: {e}".splitlines()[0]
            if cause not in self.causes:
                log.warning("CUDA graph capture of the %s's bucket %s failed, so it runs eagerly: %s",
                            self.runner, key, cause)
            self.causes.setdefault(cause, []).append(key)
            self.keys.append(key)
            _recover(device)
            return None, None


def _recover(device: torch.device) -> None:
    """After a failed capture: end what the failed capture left queued (errors of its own are the
    capture's, already reported)."""
    if device.type == "cuda":
        try:
            torch.cuda.synchronize(device)
        except Exception:  # noqa: BLE001
            pass


@dataclass
class _DraftBucket:
    """Static inputs of one batch size: `inputs` (3, bs) int64, its rows slots, base, roots."""

    inputs: torch.Tensor
    graph: torch.cuda.CUDAGraph | None = None
    output: TreeBatch | None = None

    @property
    def slots(self) -> torch.Tensor:
        return self.inputs[0]

    @property
    def base(self) -> torch.Tensor:
        return self.inputs[1]

    @property
    def roots(self) -> torch.Tensor:
        return self.inputs[2]


class DraftGraphs:
    """A drafter's whole multi-step draft of one tree shape, one CUDA graph per batch-size bucket.

    `draft(slots, base, roots)` must run on tensors only, with shapes fixed by the batch size
    (e.g. `beam.grow_trees_on_device` with keys over the whole cache slot); it drafts `shape`
    ranking its nodes (parents first, best first), so a smaller shape of the same beam is the first
    nodes of its trees (`serves`); a call for another shape is the caller's to run eagerly. Padding
    rows draft for `padding_slot`, a drafter-cache slot no request gets, from base 0 and root token 0.
    """

    def __init__(
        self,
        draft: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], TreeBatch],
        shape: DraftShape,
        batch_sizes: Sequence[int],
        padding_slot: int,
        device: torch.device,
        capture_graphs: bool,
    ) -> None:
        self.draft, self.shape, self.padding_slot, self.device = draft, shape, padding_slot, device
        self.batch_sizes = sorted(set(batch_sizes))
        self.buckets: dict[int, _DraftBucket] = {}
        self.graph_bytes = 0
        self.failures = CaptureFailures("drafter")
        pool = torch.cuda.graph_pool_handle() if capture_graphs else None
        before = torch.cuda.memory_allocated(device) if capture_graphs else 0
        for bs in reversed(self.batch_sizes):
            i64 = dict(dtype=torch.int64, device=device)
            bk = _DraftBucket(torch.stack([torch.full((bs,), padding_slot, **i64), torch.zeros(bs, **i64),
                                           torch.zeros(bs, **i64)]))
            if capture_graphs:
                bk.graph, bk.output = self.failures.capture(bs, self._captured(bk), device, pool)
            self.buckets[bs] = bk
        if capture_graphs:
            self.graph_bytes = torch.cuda.memory_allocated(device) - before
            log.info("CUDA graphs: %d of %d drafts captured (batch sizes %s), %.1f MiB",
                     len(self.buckets) - len(self.failures.keys), len(self.buckets), self.batch_sizes,
                     self.graph_bytes / 2**20)

    @property
    def num_captured(self) -> int:
        """The batch sizes that replay a captured draft (the others draft eagerly)."""
        return sum(bk.graph is not None for bk in self.buckets.values())

    def serves(self, shape: DraftShape) -> bool:
        """The captured shape, or a smaller one of its beam (an adaptive menu's): the same topk, as
        deep as its tree can go (steps = min(captured steps, nodes - 1)). Its tree is the captured
        tree's first nodes: a node of depth d ranks after its d ancestors, so the best n - 1 nodes
        lie within depth n - 1, where both beams are the same."""
        c = self.shape
        return shape == c or (shape.topk == c.topk and shape.num_draft_tokens <= c.num_draft_tokens
                              and shape.num_steps == min(c.num_steps, shape.num_draft_tokens - 1))

    def _captured(self, bk: _DraftBucket) -> Callable[[], TreeBatch]:
        return capturable(lambda: self.draft(bk.slots, bk.base, bk.roots))

    def captured_functions(self) -> dict[int, Callable[[], TreeBatch]]:
        """Per batch size, the function its graph captures (what the capture-guard tests run)."""
        return {bs: self._captured(bk) for bs, bk in self.buckets.items()}

    def __call__(self, shape: DraftShape, slots: list[int], base: list[int], roots: list[int]) -> TreeBatch | None:
        """The B = len(slots) trees of `shape`, or None (draft eagerly) for a shape it does not
        serve or when B is above the largest bucket."""
        b = len(slots)
        i = bisect.bisect_left(self.batch_sizes, b)
        if not self.serves(shape) or i == len(self.batch_sizes):
            return None
        bs = self.batch_sizes[i]
        bk = self.buckets[bs]
        pad = bs - b
        bk.inputs.copy_(to_device([slots + [self.padding_slot] * pad, base + [0] * pad, roots + [0] * pad],
                                  self.device))  # (3, bs): one copy
        if bk.graph is not None:
            bk.graph.replay()
        else:
            bk.output = self.draft(bk.slots, bk.base, bk.roots)
        out = bk.output
        assert out is not None
        return TreeBatch(*(getattr(out, f.name)[:b] for f in fields(TreeBatch))).prefix(shape.num_draft_tokens)

