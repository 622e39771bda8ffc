"""Verification: which draft nodes the target accepts, the tokens each request gains, and the
compaction of the accepted nodes' K/V.

`Verifier.accept` takes a verify forward's logits over a batch of trees: each row's logits are
masked by its grammar at every node (`grammar.GrammarMatch.bitmask`; a greedy row on a CPU only
where the path it accepts needs it, `GrammarMatch.greedy_targets`) and penalised as its request
asks (`sampling`), greedy rows go to `verify_greedy`, sampled rows to the lossless `verify_sample`,
and the accepted nodes' K/V move to consecutive cache positions (`compact_kv`).
`Verifier.first_tokens` samples a prompt's first token the same way, from its last logits (a
root-only tree). Each reads the device once (`Verified`). This module
does not draft, run the target or append tokens to requests: the engine does.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch

import specserve_kernels as K
from specserve.engine.sampling import (
    apply_grammar,
    apply_penalties,
    draw_uniforms,
    forbidden_tokens,
    greedy_tokens,
    suppress_eos,
    target_probs,
    token_logprobs,
)
from specserve.staging import to_device
from specserve.tree import TreeBatch

if TYPE_CHECKING:
    from specserve.engine.request import Request


@dataclass(frozen=True)
class Verified:
    """What one verify step decided, read to the host once. Per row: `emitted` the tokens it
    appends (its accepted drafts, then the bonus token; as many as its accept length), `accepted`
    its accepted node indices (as many), `logprobs` each token's where the request asked for
    them (see `sampling.token_logprobs`), `tree_sizes` its tree's node count; `result` on the
    device; `device_wait` the seconds the host read waited for the device's queued work."""

    result: K.VerifyResult
    emitted: list[list[int]]
    logprobs: list[list[dict[int, tuple[float, int]]] | None]
    accepted: list[list[int]]
    tree_sizes: list[int]
    device_wait: float = 0.0


class Verifier:
    """Acceptance for the engine's requests: `eos_ids` are masked before a request's min_tokens,
    and requests without a seed draw their coins from one generator of the engine's."""

    def __init__(self, eos_ids: tuple[int, ...], device: torch.device) -> None:
        self.eos_ids = eos_ids
        self.device = device
        self._default_generator = torch.Generator().manual_seed(0)
        self.grammar_seconds = 0.0  # spent building and applying grammar masks (the profile's share)
        self.grammar_nodes = 0

    @staticmethod
    def grammar_trees(reqs: Sequence[Request], batch: TreeBatch) -> GrammarTrees | None:
        """The step's trees on the host for their grammar masks (None without a grammar): taken
        before the target's forward starts, so on a GPU the masks are built while it runs."""
        if all(r.grammar is None for r in reqs):
            return None
        return GrammarTrees(*(x.cpu() for x in (batch.tokens, batch.first_child, batch.next_sibling)))

    def accept(self, reqs: Sequence[Request], batch: TreeBatch, logits: torch.Tensor, cache: torch.Tensor,
               slots: torch.Tensor, cache_lens: torch.Tensor, trees: GrammarTrees | None = None) -> Verified:
        """logits (B, N, V) at the tree nodes -> the step's `Verified`; the accepted nodes' K/V in
        `cache` (the target's KV data) compacted after each row's cache_lens (slots, cache_lens (B,)).
        trees: the step's `grammar_trees` (None: taken here when a request has a grammar)."""
        v = self.verify(reqs, batch, logits, trees)
        # a path down a chain is already where it belongs: nothing to move (the host knows without a device read)
        if not batch.is_root_only and any(nodes != list(range(len(nodes))) for nodes in v.accepted):
            K.compact_kv(cache, slots, cache_lens, v.result.accepted_nodes, v.result.accept_length)
        return v

    def first_tokens(self, reqs: Sequence[Request], logits: torch.Tensor, rows: list[int]) -> Verified:
        """Each request's first token from its prompt's last logits: rows of logits (K, 1, V)."""
        if len(rows) < logits.shape[0]:
            logits = logits[to_device(rows, self.device)]
        roots = TreeBatch.root_only(to_device([r.token_ids[-1] for r in reqs], self.device))
        return self.verify(reqs, roots, logits)

    def verify(self, reqs: Sequence[Request], batch: TreeBatch, logits: torch.Tensor,
               trees: GrammarTrees | None = None) -> Verified:
        """logits (B, N, V) at the tree nodes -> what the step verified (`Verified`).

        Greedy rows and sampled rows go to their own kernel call; results are merged by row.
        """
        if trees is None and self._verifies_on_host(reqs, logits.device):
            return self._greedy_on_host(batch, logits)
        b, n = batch.tokens.shape
        forbidden_rows: list[torch.Tensor | None] = [None] * b
        lazy: list[int] = []  # greedy rows whose grammar is checked along the accepted path only
        trees = trees if trees is not None else self.grammar_trees(reqs, batch)
        if trees is not None:
            start = time.perf_counter()
            for i, r in enumerate(reqs):
                if r.grammar is not None and self._masks_lazily(r, logits.device):
                    lazy.append(i)
                    self.grammar_nodes += n
                elif r.grammar is not None:
                    bitmask = r.grammar.bitmask(trees.tokens[i], trees.first_child[i], trees.next_sibling[i])
                    forbidden = forbidden_tokens(to_device(bitmask, logits.device), logits.shape[-1])
                    apply_grammar(logits[i], forbidden)
                    forbidden_rows[i] = forbidden
                    self.grammar_nodes += n
            self.grammar_seconds += time.perf_counter() - start
        for i, r in enumerate(reqs):
            suppress_eos(logits[i], batch.depth[i], self.eos_ids, r.params.min_tokens - r.num_output_tokens,
                         forbidden_rows[i])
            apply_penalties(logits[i], r.params, r.token_ids, len(r.prompt_ids), batch.tokens[i], batch.mask[i])
        dev = logits.device
        greedy = [i for i, r in enumerate(reqs) if r.params.greedy]
        sampled = [i for i, r in enumerate(reqs) if not r.params.greedy]
        links = (batch.tokens, batch.first_child, batch.next_sibling)
        targets = greedy_tokens(logits) if greedy else None
        if lazy:
            start = time.perf_counter()
            for i in lazy:
                reqs[i].grammar.greedy_targets(trees.tokens[i].tolist(), trees.first_child[i].tolist(),
                                               trees.next_sibling[i].tolist(), logits[i], targets[i])
            self.grammar_seconds += time.perf_counter() - start
        if not sampled:  # all greedy (the common case): one kernel over the whole batch, no row gathers
            result = K.verify_greedy(*links, targets)
            return self._emitted(reqs, batch, logits, result)
        accepted = torch.full((b, n), -1, dtype=torch.int64, device=dev)
        accept_length = torch.zeros(b, dtype=torch.int64, device=dev)
        bonus = torch.zeros(b, dtype=torch.int64, device=dev)
        if greedy:
            g = to_device(greedy, dev)
            res = K.verify_greedy(*(x[g] for x in links), targets[g])
            accepted[g], accept_length[g], bonus[g] = res.accepted_nodes, res.accept_length, res.bonus_tokens
        if sampled:
            s = to_device(sampled, dev)
            probs = torch.stack([target_probs(logits[i], reqs[i].params) for i in sampled])  # (Bs, N, V)
            coins = to_device(torch.stack([draw_uniforms(n + 1, reqs[i].generator or self._default_generator)
                                           for i in sampled]), dev)
            res = K.verify_sample(*(x[s] for x in links), probs, coins[:, :-1].contiguous(), coins[:, -1].contiguous())
            accepted[s], accept_length[s], bonus[s] = res.accepted_nodes, res.accept_length, res.bonus_tokens
        result = K.VerifyResult(accepted_nodes=accepted, accept_length=accept_length, bonus_tokens=bonus)
        return self._emitted(reqs, batch, logits, result)

    @staticmethod
    def _verifies_on_host(reqs: Sequence[Request], device: torch.device) -> bool:
        """Whether a step's rows take `_greedy_on_host`: on a CPU, each one's logits going to argmax untouched
        (greedy, no grammar, penalty, logprobs or EOS held back by min_tokens)."""
        return device.type == "cpu" and all(
            r.params.greedy and r.grammar is None and not r.params.has_penalties and r.params.logprobs is None
            and r.params.min_tokens <= r.num_output_tokens for r in reqs)

    @staticmethod
    def _greedy_on_host(batch: TreeBatch, logits: torch.Tensor) -> Verified:
        """`verify` for the rows `_verifies_on_host` admits: the argmax, the walk and what each row emits on
        host lists (a step's host work runs right after a forward that streamed every weight through the
        caches, where each tensor op costs several times its warm time), the same values as the general path."""
        drafts = batch.tokens.tolist()
        accepted, lengths, bonus = K.greedy_walk(drafts, batch.first_child.tolist(), batch.next_sibling.tolist(),
                                                 greedy_tokens(logits).tolist())
        emitted = [[draft[node] for node in row[1:length]] + [last]
                   for draft, row, length, last in zip(drafts, accepted, lengths, bonus)]
        result = K.VerifyResult(torch.tensor(accepted, dtype=torch.int64).reshape(batch.tokens.shape),
                                torch.tensor(lengths, dtype=torch.int64), torch.tensor(bonus, dtype=torch.int64))
        paths = [row[:length] for row, length in zip(accepted, lengths)]
        return Verified(result, emitted, [None] * len(emitted), paths, batch.num_draft_tokens.tolist())

    @staticmethod
    def _masks_lazily(req: Request, device: torch.device) -> bool:
        """Whether a row's grammar may be applied along its accepted path only
        (`GrammarMatch.greedy_targets`): greedy, no logprobs (they are read from the masked
        distribution at every emitted token), no EOS held back by min_tokens (where the grammar may
        allow only EOS), on a CPU (on a GPU the host walk would wait for the forward; the masks are
        built while it runs instead)."""
        return (device.type == "cpu" and req.params.greedy and req.params.logprobs is None
                and req.params.min_tokens <= req.num_output_tokens)

    def _emitted(self, reqs: Sequence[Request], batch: TreeBatch, logits: torch.Tensor,
                 result: K.VerifyResult) -> Verified:
        """The step's one host read: per row, the tokens it emits, its accepted nodes and tree size."""
        n = batch.tokens.shape[1]
        accepted = result.accepted_nodes
        path_tokens = torch.gather(batch.tokens, 1, accepted.clamp(min=0))  # (B, N): token of accepted node j
        # one row per request: [path tokens (N), accepted nodes (N), accept length, bonus token, tree size]
        extra = torch.stack([result.accept_length, result.bonus_tokens, batch.num_draft_tokens], dim=1)
        read = time.perf_counter()
        rows = self._read(torch.cat([path_tokens, accepted, extra], dim=1))
        waited = time.perf_counter() - read
        emitted = [r[1 : r[2 * n]] + [r[2 * n + 1]] for r in rows]
        # token j of a row was drawn at its accepted node j (node 0 = the root)
        logprobs = [
            token_logprobs(logits[i, accepted[i, : len(tokens)]], tokens, r.params.logprobs)
            if r.params.logprobs is not None else None
            for i, (r, tokens) in enumerate(zip(reqs, emitted))
        ]
        return Verified(result, emitted, logprobs, [r[n : n + len(e)] for r, e in zip(rows, emitted)],
                        [r[2 * n + 2] for r in rows], waited)

    @staticmethod
    def _read(rows: torch.Tensor) -> list[list[int]]:
        """The step's one host read of device values (on a GPU it waits for the step's queued work)."""
        return rows.tolist()



class GrammarTrees(NamedTuple):
    """A step's trees on the host, for the grammar masks: (B, N) each."""

    tokens: torch.Tensor
    first_child: torch.Tensor
    next_sibling: torch.Tensor
