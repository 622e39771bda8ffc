"""EAGLE-2 / EAGLE-3 drafting: the draft head's own KV cache, EAGLE-2's dynamic tree, cache refresh.

Positions. The drafter's position j holds (token j+1, target feature j); its output predicts token
j+2. Its cache therefore always has the target's length L (= the request's cache_len): position
L-1 pairs the tree root with the last accepted feature, and the hidden state it produced
(`last_hidden`) gives the root's children without another forward.

propose: step 0 takes topk children of the root from `last_hidden`; each of the num_steps - 1
draft forwards runs the current beam (topk nodes, rope position L + step - 1), writing K/V into a
scratch area after L (entry L + (step-1)*topk + beam row) that only the node's descendants see;
`DynamicTreeBuilder` keeps the scores, the beam and the final rerank.
on_prefill / on_accept: run the head over the new tokens with the target's features, overwriting
the scratch area, so the drafter's cache holds target features only (REFERENCE.md §3).

The drafter does not verify, sample or touch the target's cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from specserve.config import SpecConfig
from specserve.drafters.base import Drafter, SequenceView
from specserve.drafters.eagle_model import load_eagle
from specserve.kv_cache import KVCache
from specserve.model import AttentionInputs, ForwardOutput, prefix_mask, rope_table
from specserve.tree import DraftTree, DynamicTreeBuilder

if TYPE_CHECKING:
    from specserve.engine import Engine


def load_token_map(path: str | Path) -> torch.Tensor:
    """FR-Spec hot token ids: a torch-saved 1-D tensor or list (SGLang's --speculative-token-map)."""
    ids = torch.load(path, map_location="cpu", weights_only=True)
    return torch.as_tensor(ids, dtype=torch.int64)


class EagleDrafter(Drafter):
    def __init__(self, spec: SpecConfig, engine: Engine) -> None:
        if not spec.drafter_path:
            raise ValueError(f"drafter_path: algorithm {spec.algorithm} needs a drafter directory")
        cfg = engine.config
        self.spec = spec
        self.head = load_eagle(spec.drafter_path, engine.model, cfg.torch_dtype, cfg.device)
        if self.head.cfg.kind != spec.algorithm:
            raise ValueError(
                f"drafter_path: {spec.drafter_path} holds an {self.head.cfg.kind} drafter, "
                f"not {spec.algorithm} (set algorithm={self.head.cfg.kind})"
            )
        if spec.token_map:
            self.head.set_hot_ids(load_token_map(spec.token_map))
        self.aux_layers = self.head.cfg.aux_layer_ids
        self.scratch = (spec.num_steps - 1) * spec.topk  # draft K/V entries after L per request
        spare = engine.cache.max_len - cfg.max_seq_len
        if self.scratch > spare:
            raise ValueError(f"num_steps: (num_steps - 1) * topk = {self.scratch} exceeds {spare} scratch entries")
        layer_cfg = self.head.cfg.layer_config()
        self.cache = KVCache(layer_cfg, cfg.max_batch_size, engine.cache.max_len, cfg.torch_dtype, cfg.device)
        cos, sin = rope_table(layer_cfg, engine.cache.max_len, cfg.torch_dtype)
        self.cos, self.sin = cos.to(cfg.device), sin.to(cfg.device)
        self.device = cfg.device
        # (slots, H): the head's output at each request's last position (its root's children)
        self.last_hidden = torch.zeros(cfg.max_batch_size, self.head.cfg.hidden_size, dtype=cfg.torch_dtype,
                                       device=cfg.device)

    # ---- one head forward over the draft cache ------------------------------------------------

    def _forward(
        self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, write_pos: torch.Tensor,
        mask: torch.Tensor | None, key_len: int, host_slots: list[int],
    ) -> torch.Tensor:
        """tokens, positions, write_pos (B, T); hidden (B, T, F); mask (B, 1, T, S) or None for a
        causal fresh prefill -> h (B, T, H)."""
        b, t = tokens.shape
        slots = torch.tensor(host_slots, device=self.device)
        first = host_slots[0]
        a = AttentionInputs(
            slots=slots, cache_lens=write_pos[:, 0], write_slots=slots[:, None].expand(b, t), write_pos=write_pos,
            key_len=key_len, mask=mask, is_causal=mask is None,
            slot_range=(first, b) if host_slots == list(range(first, first + b)) else None,
            cos=self.cos[positions].unsqueeze(2), sin=self.sin[positions].unsqueeze(2),
        )
        layer_cache = self.cache.layer(0)
        return self.head(tokens, hidden, lambda attn, x: attn(x, layer_cache, a))

    def _features(self, out: ForwardOutput) -> torch.Tensor:
        """(B, T, F): the target's final-norm hidden (EAGLE-1/2) or fused aux layer inputs (EAGLE-3)."""
        return out.aux_hidden if self.head.cfg.kind == "eagle3" else out.hidden

    def _extend(self, seqs: Sequence[SequenceView], feats: torch.Tensor, starts: list[int], lens: list[int]) -> None:
        """Run the head over each seq's tokens [start+1, start+1+len) paired with feats[i, :len],
        at positions [start, start+len); keep the last output as the seq's `last_hidden`."""
        b, t = len(seqs), max(lens)
        tokens = torch.zeros(b, t, dtype=torch.int64)
        for i, (s, start, n) in enumerate(zip(seqs, starts, lens)):
            tokens[i, :n] = torch.tensor(s.token_ids[start + 1 : start + 1 + n])
        start_t = torch.tensor(starts, device=self.device)
        positions = start_t[:, None] + torch.arange(t, device=self.device)  # (B, T)
        fresh = max(starts) == 0
        mask = None if fresh else prefix_mask(
            start_t, torch.ones(t, t, dtype=torch.bool, device=self.device).tril().expand(b, t, t), max(starts) + t
        )
        h = self._forward(tokens.to(self.device), feats, positions, positions, mask, max(starts) + t,
                          [s.slot for s in seqs])
        last = torch.tensor(lens, device=self.device) - 1
        self.last_hidden[[s.slot for s in seqs]] = h[torch.arange(b, device=self.device), last]

    # ---- Drafter hooks ------------------------------------------------------------------------

    def on_prefill(self, seqs: Sequence[SequenceView], out: ForwardOutput) -> None:
        lens = [s.cache_len for s in seqs]  # prompt lengths; token_ids[n] is the first generated token
        self._extend(seqs, self._features(out)[:, : max(lens)], [0] * len(seqs), lens)

    def on_accept(self, seqs: Sequence[SequenceView], out: ForwardOutput, accepted: Sequence[torch.Tensor]) -> None:
        lens = [len(a) for a in accepted]
        t = max(lens)
        index = torch.zeros(len(seqs), t, dtype=torch.int64, device=self.device)
        for i, a in enumerate(accepted):
            index[i, : len(a)] = a
        feats = self._features(out)
        feats = torch.gather(feats, 1, index[:, :, None].expand(-1, -1, feats.shape[-1]))  # (B, T, F)
        self._extend(seqs, feats, [s.cache_len - n for s, n in zip(seqs, lens)], lens)

    def _topk(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h (..., H) -> the head's topk (probs, target token ids), each (..., topk), on the host."""
        probs, idx = self.head.logits(h).softmax(-1).topk(self.spec.topk, dim=-1)
        return probs.cpu(), self.head.to_target_ids(idx).cpu()

    def propose(self, seqs: Sequence[SequenceView]) -> list[DraftTree]:
        b, k, dev = len(seqs), self.spec.topk, self.device
        host_slots = [s.slot for s in seqs]
        lens = torch.tensor([s.cache_len for s in seqs], device=dev)  # L per request
        h = self.last_hidden[host_slots]  # (B, H)
        probs, tokens = self._topk(h)  # (B, k)
        builders = [DynamicTreeBuilder(s.token_ids[-1]) for s in seqs]
        rows = []  # per request, the beam's source (row, column) in this step's (k, k) candidates
        for i, builder in enumerate(builders):
            builder.expand(tokens[i : i + 1], probs[i : i + 1], k)
            rows.append([node - 1 for node in builder.beam])
        beam = torch.tensor(rows)  # (B, k) columns of the root's topk
        beam_tokens = torch.gather(tokens, 1, beam)
        parent_h = h[:, None].expand(b, k, h.shape[-1])  # (B, k, H)
        visible = torch.zeros(b, k, max(self.scratch, 1), dtype=torch.bool, device=dev)  # scratch ancestors
        own = torch.arange(k, device=dev)
        for step in range(1, self.spec.num_steps):
            first = (step - 1) * k  # this step's scratch entries: [first, first + k)
            visible[:, own, first + own] = True
            positions = (lens + step - 1)[:, None].expand(b, k)
            write_pos = lens[:, None] + first + own
            key_len = int(lens.max()) + first + k
            mask = prefix_mask(lens, visible[:, :, : first + k], key_len)
            hs = self._forward(beam_tokens.to(dev), parent_h, positions, write_pos, mask, key_len, host_slots)
            probs, tokens = self._topk(hs)  # (B, k, k): children of each beam node
            picks = []
            for i, builder in enumerate(builders):
                base = len(builder.tokens)
                builder.expand(tokens[i], probs[i], k)
                picks.append([node - base for node in builder.beam])  # row * k + column
            flat = torch.tensor(picks)  # (B, k)
            parent_row = (flat // k).to(dev)
            beam_tokens = torch.gather(tokens.view(b, k * k), 1, flat)
            parent_h = torch.gather(hs, 1, parent_row[:, :, None].expand(-1, -1, hs.shape[-1]))
            visible = torch.gather(visible, 1, parent_row[:, :, None].expand(-1, -1, visible.shape[-1]))
        return [builder.build(self.spec.num_draft_tokens) for builder in builders]
