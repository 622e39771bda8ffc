"""Standalone drafting: a small LLM with the target's vocabulary drafts token by token.

The draft model is either a separate HF directory (`drafter_path`, loaded like the target) or,
with no path, a self-speculative draft made of the target's first `standalone_num_layers` layers
plus its final norm and lm_head (the same modules, no extra weights). It keeps its own KV cache
(one slot per request, like the target's) and, before drafting, catches up on every token not yet
in that cache (the accepted tokens and the root), so no refresh after verify is needed. A prompt
is cached chunk by chunk with its prefill (`on_prefill`) while the engine expects drafts, else by
the catch-up of its first draft (`prefill_optional`); a slot's draft K/V stay after its request
ends, and `copy_prefix` hands them to a request that reuses its prefix. Trees come from
`beam.grow_trees_on_device` (topk=1 is a chain), from the root's hidden state the catch-up leaves
in `last_hidden`, as a draft head drafts from its own. Every draft-model forward runs through
`runtime.draft_model.DraftModelRunner` (a compiled program on a CPU where the runtime plan
compiles, else eagerly), which on a static plan also replays the configured shape's whole beam
from a CUDA graph per batch size.

The draft model never sees the target's hidden states; it does not verify or sample.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch
from torch import nn

from specserve.config import SpecConfig
from specserve.drafters.base import DraftContext, Drafter, SequenceView
from specserve.drafters.beam import grow_trees, grow_trees_on_device, propose_beam
from specserve.models.cpu_linear import pack_for_inference
from specserve.models.kv_cache import KVCache
from specserve.models.llama import ForwardOutput, KeyMask, LlamaModel
from specserve.models.weights import empty_modules, load_llama
from specserve.runtime.cuda_graph import DraftGraphs
from specserve.runtime.draft_model import DraftModelRunner
from specserve.runtime.prefill import PackedPrompts
from specserve.staging import to_device
from specserve.tree import DraftShape, DraftTree, TreeBatch


def first_layers(target: LlamaModel, k: int) -> LlamaModel:
    """A LlamaModel made of the target's embedding, first k layers, final norm and lm_head (shared)."""
    if not 0 < k < target.cfg.num_layers:
        raise ValueError(f"standalone_num_layers: must be in [1, {target.cfg.num_layers - 1}], got {k}")
    with empty_modules():
        model = LlamaModel(replace(target.cfg, num_layers=k))
    model.embed_tokens, model.norm, model.lm_head = target.embed_tokens, target.norm, target.lm_head
    model.layers = nn.ModuleList(list(target.layers[:k]))
    return model.eval()


class StandaloneDrafter(Drafter):
    nested_trees = True  # trees come out in rank order (`DynamicTreeBuilder.build`)
    catches_up = True
    prefill_optional = True

    def __init__(self, spec: SpecConfig, ctx: DraftContext) -> None:
        self.spec = spec
        if spec.drafter_path:
            self.model = load_llama(spec.drafter_path, ctx.dtype, ctx.device)
            if self.model.cfg.vocab_size != ctx.target.cfg.vocab_size:
                raise ValueError(
                    f"drafter_path: draft vocabulary {self.model.cfg.vocab_size} differs from the target's "
                    f"{ctx.target.cfg.vocab_size}"
                )
        else:
            self.model = first_layers(ctx.target, spec.standalone_num_layers or ctx.target.cfg.num_layers // 4)
        self.model.requires_grad_(False)
        self.draft_plan = ctx.draft_plan
        scratch = ctx.draft_plan.scratch + 1  # + the root, which sits after the target's cache_len
        if scratch > ctx.max_len - ctx.max_seq_len:
            raise ValueError(f"num_steps: (num_steps - 1) * topk = {scratch - 1} exceeds the scratch entries")
        self.model.init_rope(ctx.max_len)
        self.cache = KVCache(self.model.cfg, ctx.num_slots, ctx.max_len, ctx.dtype, ctx.device)
        # runs every draft-model forward; its program is compiled from the plain weights, then packed
        self.runner = DraftModelRunner(self.model, self.cache, ctx.runtime)
        if spec.drafter_path:
            pack_for_inference(self.model)  # the target's own layers are packed with the target
        self.cached = [0] * ctx.num_slots  # per slot: tokens whose K/V are in the draft cache
        self.device = ctx.device
        # (slots, H): the draft model's final-norm hidden at each request's root (its children's logits)
        self.last_hidden = torch.zeros(ctx.num_slots, self.model.cfg.hidden_size, dtype=ctx.dtype, device=ctx.device)
        self.runner.capture_drafts(self._draft_static, self.draft_plan.shape)

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """The draft K/V of the reused tokens [0, n), as far as src's draft cache has them."""
        keep = min(self.cached[src], n)
        if src != dst:
            self.cache.copy_prefix(src, dst, keep)
        self.cached[dst] = keep

    def on_prefill(self, seqs: Sequence[SequenceView], out: ForwardOutput, packed: PackedPrompts) -> None:
        """The draft model over each sequence's prompt tokens it has not cached, up to the chunk's
        end, one sequence per forward: a long prompt's draft K/V come chunk by chunk with its prefill."""
        for s in seqs:
            start, end = self.cached[s.slot], s.cache_len
            if end <= start:
                continue
            tokens, positions = to_device([s.token_ids[start:end], list(range(start, end))], self.device)  # (T,) each
            mask = None if start == 0 else KeyMask(positions[:1])
            with self.model_forward():  # the layers alone: no logits needed
                self.runner.hidden(tokens[None], positions[None], positions[None], [s.slot], mask, end)
            self.cached[s.slot] = end

    @property
    def graphs(self) -> DraftGraphs | None:
        return self.runner.graphs

    def _catch_up(self, seqs: Sequence[SequenceView]) -> None:
        """The draft model over each request's tokens not yet in its cache (the root last), one
        forward for the batch; the root's final-norm hidden goes to `last_hidden`."""
        host_slots = [s.slot for s in seqs]
        starts = [self.cached[s.slot] for s in seqs]
        if all(start == len(s.token_ids) for s, start in zip(seqs, starts)):
            return  # caught up already (a second draft of the same step)
        news = [s.token_ids[start:] for s, start in zip(seqs, starts)]  # uncached tokens, root last
        b, t = len(seqs), max(len(n) for n in news)
        tokens = to_device([n + [0] * (t - len(n)) for n in news], self.device)  # (B, T)
        start_t, last, slots = to_device([starts, [len(n) - 1 for n in news], host_slots], self.device)  # (B,) each
        positions = start_t[:, None] + torch.arange(t, device=self.device)
        mask = None if max(starts) == 0 else KeyMask(start_t)
        with self.model_forward():
            hidden = self.runner.hidden(tokens, positions, positions, host_slots, mask, max(starts) + t)  # (B, T, H)
        self.last_hidden[slots] = hidden[torch.arange(b, device=self.device), last]
        for s in seqs:
            self.cached[s.slot] = len(s.token_ids)

    def _topk(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden (..., H) -> the draft model's topk (probs, tokens), each (..., topk), on the device."""
        with self.model_forward(count=False):
            return self.runner.logits(hidden).softmax(-1).topk(self.spec.topk, dim=-1)

    def _draft(self, slots: list[int] | torch.Tensor, base: torch.Tensor, roots: torch.Tensor, shape: DraftShape,
               key_len: int) -> TreeBatch:
        """The whole beam from tensors (`grow_trees_on_device`): no per-request Python, no host
        sync. slots: host ints (eager) or a (B,) tensor (`DraftGraphs`, key_len = the whole slot);
        base (= the root's position + 1), roots (B,) -> B trees of equal size."""
        h = self.last_hidden[slots if isinstance(slots, torch.Tensor) else to_device(slots, self.device)]  # (B, H)
        probs, tokens = self._topk(h)

        def step(beam_tokens, state, positions, write_pos, mask, key_len):  # noqa: ANN001, ANN202
            with self.model_forward():
                hs = self.runner.hidden(beam_tokens, positions, write_pos, slots, mask, key_len)  # (B, k, H)
            return (state, *self._topk(hs))

        state = torch.zeros(roots.shape[0], 1, device=self.device)  # token-level drafting carries no state
        return grow_trees_on_device(roots, base, probs, tokens, state, step, shape.num_steps, shape.topk,
                                    shape.num_draft_tokens, key_len=key_len)

    def _draft_static(self, slots: torch.Tensor, base: torch.Tensor, roots: torch.Tensor) -> TreeBatch:
        """The configured shape's draft with keys over the whole cache slot: what `DraftGraphs` captures."""
        return self._draft(slots, base, roots, self.draft_plan.shape, self.cache.max_len)

    def propose(self, seqs: Sequence[SequenceView], shape: DraftShape | None = None) -> TreeBatch:
        shape = shape or self.draft_plan.shape
        self._catch_up(seqs)
        base = [len(s.token_ids) for s in seqs]  # the beam's first scratch entry: after the root
        return propose_beam(seqs, shape, base, self.runner.draft, self._draft, self.device)

    def draft_on_host(self, seqs: Sequence[SequenceView], shape: DraftShape) -> list[DraftTree]:
        """The same draft with the beam picked on the host by `DynamicTreeBuilder`: the reference
        the tests hold `propose` to (call it after a propose, so the model has caught up)."""
        host_slots = [s.slot for s in seqs]
        probs, children = (x.cpu() for x in self._topk(self.last_hidden[to_device(host_slots, self.device)]))

        def step(beam_tokens, state, positions, write_pos, mask, key_len):  # noqa: ANN001, ANN202
            with self.model_forward():
                hs = self.runner.hidden(beam_tokens, positions, write_pos, host_slots, mask, key_len)
            return (state, *(x.cpu() for x in self._topk(hs)))

        base = to_device([len(s.token_ids) for s in seqs], self.device)  # after the root
        state = torch.zeros(len(seqs), 1, device=self.device)
        return grow_trees(seqs, base, probs, children, state, step, shape.num_steps, shape.topk, shape.num_draft_tokens)
