"""EAGLE-2 / EAGLE-3 and MTP drafting (`HeadDrafter`): the draft head's own KV cache, EAGLE-2's dynamic tree,
cache refresh. Any head that reads the target's features runs here: EAGLE heads (`models.eagle_head`)
and MTP heads (`models.mtp_head`), as SGLang runs MTP through its EAGLE worker.

Positions. The drafter's position j holds (token j+1, target feature j); its output predicts token
j+2. Its cache therefore always has the target's length L (= the request's cache_len): position
L-1 pairs the tree root with the last accepted feature, and the hidden state it produced
(`last_hidden`) gives the root's children without another forward.

on_accept only stores the target's features of the new positions (`features`); the head catches
up over everything it has not seen at the start of the next propose, overwriting the scratch area,
so the drafter's cache holds target features only. Steps that decode without drafts therefore cost
the drafter nothing. on_prefill stores a prompt chunk's features and catches the head up on them at
once, so a long prompt's catch-up is spread over its prefill chunks. A slot keeps its features and
head K/V after its request ends; `copy_prefix` hands them to a request that reuses its prefix. How
each head forward runs (eager, the CPU's compiled programs, few-row chunks of a long catch-up) is
`runtime.head_runner.HeadRunner`'s choice.
propose: after the catch-up, step 0 takes topk children of the root from `last_hidden`;
`beam.grow_trees_on_device` runs the num_steps - 1 draft forwards over the beam (rope position
L + step - 1, K/V in a scratch area after L that only the node's descendants see), each node
carrying its parent's hidden state, and picks the beam and the final tree by tensor ops. On a
static runtime plan (CUDA graphs) the configured shape's draft, with keys over the whole slot, is
what the runner captures once per batch size; other shapes run eagerly. `draft_on_host` is the
same draft with the host's `DynamicTreeBuilder`: the tests' reference.

The drafter does not verify, sample or touch the target's cache.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from specserve.config import SpecConfig
from specserve.drafters.base import DraftContext, Drafter, SequenceView
from specserve.drafters.beam import grow_trees, grow_trees_on_device, propose_beam
from specserve.models.cpu_linear import draft_quantization, quantize_linears
from specserve.models.draft_heads import HEADS, load_token_map
from specserve.models.kv_cache import KVCache
from specserve.models.llama import ForwardOutput, KeyMask, rope_table
from specserve.runtime.cuda_graph import DraftGraphs
from specserve.runtime.head_runner import HeadRunner
from specserve.runtime.prefill import PackedPrompts
from specserve.staging import to_device
from specserve.tree import DraftShape, DraftTree, TreeBatch

log = logging.getLogger(__name__)


class HeadDrafter(Drafter):
    nested_trees = True  # trees come out in rank order (`grow_trees_on_device`)
    catches_up = True
    # on_prefill catches the head up on each prompt chunk at once (False: at the request's first draft,
    # for an owner that may never draft a row with the head)
    catch_up_on_prefill = True

    def __init__(self, spec: SpecConfig, ctx: DraftContext) -> None:
        self.spec = spec
        self.method = spec.method
        path = spec.drafter_path or (ctx.model_dir if self.method.head_in_target else None)
        if not path:
            raise ValueError(f"drafter_path: algorithm {spec.algorithm} needs a drafter directory")
        self.head = HEADS[spec.algorithm].load(path, ctx.target, ctx.dtype, ctx.device)
        if spec.token_map:
            self.head.set_hot_ids(load_token_map(spec.token_map))
        self.quantization = draft_quantization(spec.draft_model_quantization, ctx.device, ctx.dtype)
        if self.quantization == "q8_0":
            quantize_linears(self.head)  # before its programs are compiled: their keys read the weights
        self.aux_layers = self.head.cfg.aux_layer_ids
        layer_cfg = self.head.cfg.layer_config()
        self.cache = KVCache(layer_cfg, ctx.num_slots, ctx.max_len, ctx.dtype, ctx.device)
        self.rope = tuple(t.to(ctx.device) for t in rope_table(layer_cfg, ctx.max_len, ctx.dtype))
        self.device = ctx.device
        # (slots, H): the head's output at each request's last position (its root's children)
        self.last_hidden = torch.zeros(ctx.num_slots, self.head.cfg.hidden_size, dtype=ctx.dtype, device=ctx.device)
        # (slots, max_len, F): the target's features per position, read by the next catch-up
        self.features = torch.zeros(ctx.num_slots, ctx.max_len, self.head.cfg.feature_size, dtype=ctx.dtype,
                                    device=ctx.device)
        self.synced = [0] * ctx.num_slots  # per slot: positions the head's cache holds (the rest wait in `features`)
        self.draft_plan = ctx.draft_plan  # its scratch K/V fit the cache's spare positions (`SpecConfig`)
        # EAGLE-3 reads the target's fused features on catch-up and its own states in the beam
        widths = (self.head.cfg.feature_size, self.head.cfg.hidden_size)
        self.runner = HeadRunner(spec.algorithm, self.head, self.rope, self.cache, ctx.runtime, widths)
        self.runner.capture_drafts(self._draft_static, self.draft_plan.shape)

    # ---- one head forward over the draft cache ------------------------------------------------

    def _forward(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, write_pos: torch.Tensor,
                 mask: KeyMask | None, key_len: int, slots: list[int] | torch.Tensor) -> torch.Tensor:
        """tokens, positions, write_pos (B, T); hidden (B, T, F); mask: the keys each token sees, None
        for a causal fresh prefill -> h (B, T, H)."""
        with self.model_forward():
            return self.runner.forward(tokens, hidden, positions, write_pos, mask, key_len, slots)

    def _features(self, out: ForwardOutput) -> torch.Tensor:
        """(B, T, F): the target's final-norm hidden (EAGLE-1/2) or fused aux layer inputs (EAGLE-3)."""
        return getattr(out, self.method.head_features)

    def _extend(self, seqs: Sequence[SequenceView], feats: torch.Tensor, starts: list[int], lens: list[int]) -> None:
        """Run the head over each seq's tokens [start+1, start+1+len) paired with feats[i, :len],
        at positions [start, start+len); keep the last output as the seq's `last_hidden`."""
        b, t = len(seqs), max(lens)
        rows = [s.token_ids[start + 1 : start + 1 + n] + [0] * (t - n) for s, start, n in zip(seqs, starts, lens)]
        tokens = to_device(rows, self.device)  # (B, T)
        start_t, last, slots_t = to_device([starts, [n - 1 for n in lens], [s.slot for s in seqs]], self.device)
        positions = start_t[:, None] + torch.arange(t, device=self.device)  # (B, T)
        slots = [s.slot for s in seqs]
        hs = []
        for a, z in self.runner.chunks(b, t):  # columns [a, z): each chunk sees the ones before it in the cache
            key_len = max(starts) + z
            mask = None if max(starts) + a == 0 else KeyMask(start_t + a)  # after the prefix, causal
            pos = positions[:, a:z].contiguous()  # the programs take dense inputs
            hs.append(self._forward(tokens[:, a:z].contiguous(), feats[:, a:z].contiguous(), pos, pos, mask, key_len,
                                    slots))
        h = torch.cat(hs, dim=1) if len(hs) > 1 else hs[0]  # (B, T, H)
        self.last_hidden[slots_t] = h[torch.arange(b, device=self.device), last]

    # ---- Drafter hooks ------------------------------------------------------------------------

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """The features of positions [0, n) and the head's K/V of [0, n - 1) (position j pairs
        token j + 1, the first that may differ, with feature j) as far as src's head has them."""
        keep = max(min(self.synced[src], n - 1), 0)
        if src != dst:
            self.cache.copy_prefix(src, dst, keep)
            self.features[dst, :n] = self.features[src, :n]
        self.synced[dst] = keep

    def on_prefill(self, seqs: Sequence[SequenceView], out: ForwardOutput, packed: PackedPrompts) -> None:
        """Store the chunk's features, then (`catch_up_on_prefill`) catch the head up on them, one
        sequence per forward (no padding): a long prompt's catch-up goes chunk by chunk with its prefill."""
        feats = self._features(out)  # (1, N, F) over the packed chunks
        for i, (s, c) in enumerate(zip(seqs, packed.chunks)):
            self.features[s.slot, c.start : c.end] = feats[0, packed.columns(i)]
        if self.catch_up_on_prefill:
            for s in seqs:
                self._catch_up([s])

    @property
    def graphs(self) -> DraftGraphs | None:
        return self.runner.graphs

    def on_accept(self, seqs: Sequence[SequenceView], out: ForwardOutput, accepted: Sequence[torch.Tensor]) -> None:
        if self.features.device.type == "cpu":  # on the host, a row's features go straight to its slot
            feats = self._features(out)
            for i, (s, a) in enumerate(zip(seqs, accepted)):
                n = len(a)  # accepted node j holds position cache_len - n + j; node 0 is the root
                self.features[s.slot, s.cache_len - n : s.cache_len] = feats[i, :1] if n == 1 else feats[i, a]
            return
        t = max(len(a) for a in accepted)
        if t == 1:  # a plain step: each row's root feature to its position; one copy in, one write
            slots, positions = to_device([[s.slot for s in seqs], [s.cache_len - 1 for s in seqs]], self.device)
            self.features[slots, positions] = self._features(out)[:, 0]
            return
        index = torch.zeros(len(seqs), t, dtype=torch.int64, device=self.device)
        for i, a in enumerate(accepted):
            index[i, : len(a)] = a
        feats = self._features(out)
        feats = torch.gather(feats, 1, index[:, :, None].expand(-1, -1, feats.shape[-1]))  # (B, T, F)
        # accepted node j of row i holds position cache_len - len + j; padding writes past cache_len
        starts, slots = to_device([[s.cache_len - len(a) for s, a in zip(seqs, accepted)], [s.slot for s in seqs]],
                                  self.device)  # (B,) each
        self.features[slots[:, None], starts[:, None] + torch.arange(t, device=self.device)] = feats

    def _catch_up(self, seqs: Sequence[SequenceView]) -> None:
        """Run the head over every position it has not seen, with the stored target features."""
        # a synced row re-runs its last position (same token, feature and K/V) to keep one batch
        starts = [min(self.synced[s.slot], s.cache_len - 1) for s in seqs]
        lens = [s.cache_len - start for s, start in zip(seqs, starts)]
        if all(self.synced[s.slot] == s.cache_len for s in seqs):
            return
        t = max(lens)
        if max(starts) + t > self.cache.max_len:  # a long backlog beside a long context: one row at a time
            for s in seqs:
                self._catch_up([s])
            return
        slots, start_t = to_device([[s.slot for s in seqs], starts], self.device)  # (B,) each
        positions = start_t[:, None] + torch.arange(t, device=self.device)  # (B, T)
        feats = self.features[slots[:, None], positions.clamp(max=self.features.shape[1] - 1)]  # (B, T, F)
        self._extend(seqs, feats, starts, lens)
        for s in seqs:
            self.synced[s.slot] = s.cache_len

    def _topk(self, h: torch.Tensor, on_host: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """h (..., H) -> the head's topk (probs, target token ids), each (..., topk)."""
        with self.model_forward(count=False):
            probs, idx = self.head.logits(h).softmax(-1).topk(self.spec.topk, dim=-1)
        tokens = self.head.to_target_ids(idx)
        return (probs.cpu(), tokens.cpu()) if on_host else (probs, tokens)

    def _draft(self, slots: list[int] | torch.Tensor, base: torch.Tensor, roots: torch.Tensor, shape: DraftShape,
               key_len: int) -> TreeBatch:
        """The whole draft from tensors, the beam picked by tensor ops (`grow_trees_on_device`): no
        per-request Python, no host sync. slots: host ints (eager) or a (B,) tensor (`DraftGraphs`,
        key_len = the whole slot); base (= cache_len), roots (B,) -> B trees of equal size."""
        h = self.last_hidden[slots if isinstance(slots, torch.Tensor) else to_device(slots, self.device)]  # (B, H)
        probs, tokens = self._topk(h, on_host=False)

        def step(beam_tokens, parent_h, positions, write_pos, mask, key_len):  # noqa: ANN001, ANN202
            hs = self._forward(beam_tokens, parent_h, positions, write_pos, mask, key_len, slots)
            return (hs, *self._topk(hs, on_host=False))

        return grow_trees_on_device(roots, base, probs, tokens, h, step, shape.num_steps, shape.topk,
                                    shape.num_draft_tokens, key_len=key_len)

    def _draft_static(self, slots: torch.Tensor, base: torch.Tensor, roots: torch.Tensor) -> TreeBatch:
        """The configured shape's draft with keys over the whole cache slot: what `DraftGraphs` captures."""
        return self._draft(slots, base, roots, self.draft_plan.shape, self.cache.max_len)

    def propose(self, seqs: Sequence[SequenceView], shape: DraftShape | None = None) -> TreeBatch:
        shape = shape or self.draft_plan.shape
        self._catch_up(seqs)
        return propose_beam(seqs, shape, [s.cache_len for s in seqs], self.runner.draft, self._draft, self.device)

    def draft_on_host(self, seqs: Sequence[SequenceView], shape: DraftShape) -> list[DraftTree]:
        """The same draft with the beam picked on the host by `DynamicTreeBuilder`: the reference
        the tests hold `propose` to (call it after a propose, so the head has caught up)."""
        host_slots = [s.slot for s in seqs]
        h = self.last_hidden[to_device(host_slots, self.device)]
        probs, tokens = self._topk(h)

        def step(beam_tokens, parent_h, positions, write_pos, mask, key_len):  # noqa: ANN001, ANN202
            hs = self._forward(beam_tokens, parent_h, positions, write_pos, mask, key_len, host_slots)
            return (hs, *self._topk(hs))

        base = to_device([s.cache_len for s in seqs], self.device)
        return grow_trees(seqs, base, probs, tokens, h, step, shape.num_steps, shape.topk, shape.num_draft_tokens)
