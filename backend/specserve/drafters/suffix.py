"""Suffix decoding (Arctic Inference's, arXiv 2411.04975): draft what followed the request's last
tokens earlier, in the text of the requests served before it and in its own.

Two kinds of `TokenStore` are searched every step:

    shared store, one per drafter: prompt + output of every finished request, one segment each, in a
        ring of `suffix_cache_tokens` positions; the oldest segments are evicted first
    own store, one per running request: its prompt and the tokens generated so far

    ring:   ... | a b c d e -1 | a b x y -1 | ...      -1 ends every segment
    index:  (a, b) -> [p_c, p_x]                       each k-gram -> the positions that follow it

Lookup (`TokenStore.match`): the request's last k tokens (k = suffix_min_match) give candidate
positions, the most recent `MAX_CANDIDATES`; a candidate's match length is how many tokens before it
equal the request's last ones (at most suffix_max_depth), and the candidates of the longest match are
kept, as a suffix tree's deepest matching node would be. Their continuations (up to a segment's end)
are merged into one tree (`draft_nodes`), each node counting the candidates that pass through it: a
node is drafted when its share count / candidates >= suffix_min_token_prob and its depth is at most
suffix_max_spec_factor x the match length, the most frequent nodes first, so the tree for fewer
tokens is always a prefix of the tree for more (`nested_trees`). Each store builds its tree and the
one with the larger score (the sum of its nodes' shares: the tokens it expects accepted) drafts.

The shared store keeps one index per cache salt (None is a salt too): a request drafts only from the
text of requests of its own salt, and the ring's memory bound holds across all salts.

`TokenStore`, `draft_nodes` and `propose` (one request's step) here are the reference; the drafter runs
`specserve_kernels.suffix_store`'s C++ ones where that module builds (one call per request and step,
the tree's arrays laid out there too), these where it does not: the same trees and scores either way.

This module reads token ids only; it knows nothing of models, KV caches or the engine.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import deque
from collections.abc import Hashable, Sequence
from types import ModuleType

import numpy as np
import torch

from specserve.config import SpecConfig
from specserve.draft_plan import DraftPlan
from specserve.drafters.base import DraftContext, Drafter, SequenceView
from specserve.estimates import RunningAverage
from specserve.tree import DraftShape, DraftTree
from specserve_kernels import suffix_store

SENTINEL = -1  # ends a segment; never a token id
MAX_CANDIDATES = 256  # the most recent positions after a k-gram that one lookup weighs
_TOKEN_BITS = 24  # a k-gram's index key packs its token ids into one int, this many bits each
HORIZON = 64  # rows before the calibration's averages become moving averages
# the calibration counts this many rows that turned out as scored beside the real ones: an unlucky
# first tree (0 accepted) must not scale every later score to 0, which would keep suffix decoding from
# ever drafting again, and a long match still drafts after many short ones failed
GAIN_PRIOR_ROWS = 8


def calibrated_gain(accepted: RunningAverage, scored: RunningAverage) -> float:
    """Accepted drafts per unit of score over the recent rows (`accepted` and `scored` averaged over
    the same rows), with `GAIN_PRIOR_ROWS` rows that turned out as scored (1 before any; never 0)."""
    n = min(scored.samples, HORIZON)
    return (n * accepted.value + GAIN_PRIOR_ROWS) / (max(n * scored.value, 0.0) + GAIN_PRIOR_ROWS)


class TokenStore:
    """Token segments at absolute positions, and for each k-gram the positions that follow it.

    `ring=True`: at most `capacity` positions live (sentinels included); appending past that evicts
    the oldest closed segments first (the open one's oldest tokens only when it alone is too long).
    `ring=False`: the buffer grows and nothing is evicted (one request's own tokens).
    Position p is at buf[p % len(buf)]; live positions are [low, high).
    """

    def __init__(self, capacity: int, k: int, ring: bool) -> None:
        if capacity < 2 or k < 1:
            raise ValueError("token store: capacity must be >= 2 and k >= 1")
        self.k, self.ring = k, ring
        self.buf = np.full(capacity, SENTINEL, dtype=np.int32)
        self.low = self.high = 0
        self._starts: deque[int] = deque()  # each segment's first position, oldest first
        self._open = False  # the newest segment is still being appended to
        self._key = 0  # rolling key of the open segment's last (up to k) tokens
        self._run = 0  # tokens of the open segment written so far
        self._mask = (1 << (_TOKEN_BITS * k)) - 1
        self.index: dict[Hashable, dict[int, list[int]]] = {}  # salt -> k-gram key -> positions, increasing
        self._evicted = 0  # positions evicted since the last sweep

    @property
    def capacity(self) -> int:
        return len(self.buf)

    @property
    def num_tokens(self) -> int:
        """Live positions, segment ends included."""
        return self.high - self.low

    def tokens(self) -> np.ndarray:
        """The live tokens (positions [low, high), segment ends included) in order."""
        return self.buf[np.arange(self.low, self.high) % self.capacity]

    def last(self) -> int:
        """The token at position high - 1."""
        return int(self.buf[(self.high - 1) % self.capacity])

    def append(self, tokens: Sequence[int], salt: Hashable = None) -> None:
        """Add tokens to the open segment (a new one if none is open)."""
        tokens = np.asarray(tokens, dtype=np.int64)
        if not len(tokens):
            return
        if tokens.min() < 0 or tokens.max() >= 1 << _TOKEN_BITS:
            raise ValueError(f"token store: token ids must be in [0, {1 << _TOKEN_BITS})")
        if not self._open:
            self._starts.append(self.high)
            self._open, self._key, self._run = True, 0, 0
        if self.ring and len(tokens) >= self.capacity:  # only the last ones fit, with nothing before them
            tokens = tokens[-(self.capacity - 1):]
            self._key = self._run = 0
        self._make_room(len(tokens))
        positions = np.arange(self.high, self.high + len(tokens))
        self.buf[positions % self.capacity] = tokens
        keys = self.index.setdefault(salt, {})
        k, key, run, mask = self.k, self._key, self._run, self._mask
        for p, t in zip(positions.tolist(), tokens.tolist()):
            if run >= k:  # k tokens precede p in this segment: p follows their k-gram
                keys.setdefault(key, []).append(p)
            key = ((key << _TOKEN_BITS) | t) & mask
            run += 1
        self._key, self._run, self.high = key, run, self.high + len(tokens)

    def close(self) -> None:
        """End the open segment: a sentinel, so no continuation runs into the next one."""
        if self._open:
            self._make_room(1)
            self.buf[self.high % self.capacity] = SENTINEL
            self.high += 1
            self._open = False

    def match(self, context: np.ndarray, max_len: int, salt: Hashable = None) -> tuple[int, np.ndarray]:
        """(match length, positions): the positions whose preceding tokens equal the longest suffix
        of `context` found (k <= length <= max_len); (0, empty) when its last k tokens are unseen."""
        k, none = self.k, np.empty(0, dtype=np.int64)
        if len(context) < k:
            return 0, none
        key = 0
        for t in context[-k:].tolist():
            key = (key << _TOKEN_BITS) | t
        keys = self.index.get(salt)
        positions = keys.get(key) if keys else None
        if not positions:
            return 0, none
        if positions[0] < self.low:  # evicted positions go lazily
            del positions[: bisect_left(positions, self.low)]
            if not positions:
                del keys[key]
                return 0, none
        cands = np.asarray(positions[-MAX_CANDIDATES:], dtype=np.int64)
        n = min(max_len, len(context))
        if n <= k:
            return k, cands
        # every candidate's tokens before it against the context's last ones, all at once: the
        # match length is the run of equal tokens (the first k equal by the key)
        before = cands[:, None] - np.arange(k + 1, n + 1)  # (candidates, n - k)
        same = (self.buf[before % self.capacity] == context[-k - 1 :: -1][: n - k]) & (before >= self.low)
        runs = k + np.cumprod(same, axis=1).sum(axis=1)
        length = int(runs.max())
        return length, cands[runs == length]

    def continuations(self, positions: np.ndarray, depth: int) -> np.ndarray:
        """(len(positions), depth) int32: the tokens from each position on, SENTINEL from the end of
        its segment (or of what is written) on."""
        at = positions[:, None] + np.arange(depth)
        rows = self.buf[at % self.capacity]
        rows[at >= self.high] = SENTINEL
        rows[np.maximum.accumulate(rows == SENTINEL, axis=1)] = SENTINEL
        return rows

    def _make_room(self, n: int) -> None:
        if self.high + n - self.low <= self.capacity:
            return
        if not self.ring:  # grow: positions equal indices, nothing wraps
            size = max(2 * self.capacity, self.high + n)
            self.buf = np.concatenate([self.buf, np.full(size - self.capacity, SENTINEL, dtype=np.int32)])
            return
        low = self.high + n - self.capacity
        while len(self._starts) > 1 and self._starts[0] < low:
            self._starts.popleft()
            self.low = self._starts[0]
        if self.low < low:  # the open segment alone is too long: its oldest tokens go
            self.low = low
        self._evicted += n
        if self._evicted > self.capacity:  # one sweep per capacity of writes: the index stays bounded
            self._sweep()

    def _sweep(self) -> None:
        self._evicted, low = 0, self.low
        for salt in list(self.index):
            keys = self.index[salt]
            for key in list(keys):
                positions = keys[key]
                if positions[-1] < low:
                    del keys[key]
                elif positions[0] < low:
                    del positions[: bisect_left(positions, low)]
            if not keys:
                del self.index[salt]


def draft_nodes(root: int, rows: np.ndarray, match_len: int, num_draft_tokens: int,
                spec: SpecConfig) -> tuple[list[int], list[int], float]:
    """`ranked_nodes`' tokens, parents and score."""
    tokens, parents, _, score = ranked_nodes(root, rows, match_len, num_draft_tokens, spec)
    return tokens, parents, score


def ranked_nodes(root: int, rows: np.ndarray, match_len: int, num_draft_tokens: int,
                 spec: SpecConfig) -> tuple[list[int], list[int], list[float], float]:
    """The draft tree of `rows` (one continuation per candidate, SENTINEL-padded) as its tokens and
    parents (`DraftTree.from_parents`'s inputs): the nodes that at least suffix_min_token_prob of the
    candidates pass through, at most suffix_max_spec_factor x match_len deep, most frequent first
    (ties: shallower, then the most recent candidate's), num_draft_tokens in all with the root.
    Rows come oldest candidate first.

    Also each node's share of the candidates (the root's 1), which estimates the chance that the
    target's text passes through it: the tree's score, the tokens it expects accepted, is their sum
    below the root, and a prefix of the ranking is a smaller tree with the same shares.

    Built level by level over the distinct continuations: a node below the share is not expanded
    (its children have no more candidates than it), so rare branches cost nothing."""
    depth = min(rows.shape[1], int(spec.suffix_max_spec_factor * match_len))
    if depth < 1 or num_draft_tokens < 2 or not len(rows):
        return [root], [-1], [1.0], 0.0
    # distinct continuations, newest first (rows come oldest first), so equal counts rank by recency
    distinct: dict[tuple[int, ...], int] = {}
    for row in reversed(rows[:, :depth].tolist()):
        key = tuple(row)
        distinct[key] = distinct.get(key, 0) + 1
    paths, weights = list(distinct), list(distinct.values())
    total = len(rows)
    min_count = spec.suffix_min_token_prob * total
    # per node: token, parent, level, count, first (the newest continuation through it)
    nodes: list[tuple[int, int, int, int, int]] = []
    frontier: list[tuple[int, list[int]]] = [(-1, list(range(len(paths))))]  # (node, its continuations)
    for level in range(depth):
        grown: list[tuple[int, list[int]]] = []
        for node, members in frontier:
            by_token: dict[int, list[int]] = {}
            for m in members:
                t = paths[m][level]
                if t != SENTINEL:
                    by_token.setdefault(t, []).append(m)
            for t, group in by_token.items():
                count = sum(weights[m] for m in group)
                if count >= min_count:
                    nodes.append((t, node, level, count, group[0]))
                    grown.append((len(nodes) - 1, group))
        frontier = grown
    kept = sorted(range(len(nodes)), key=lambda n: (-nodes[n][3], nodes[n][2], nodes[n][4]))
    kept = kept[: num_draft_tokens - 1]  # a parent comes before its children: count >= theirs, shallower
    new = {-1: 0, **{n: i + 1 for i, n in enumerate(kept)}}
    return ([root] + [nodes[n][0] for n in kept], [-1] + [new[nodes[n][1]] for n in kept],
            [1.0] + [nodes[n][3] / total for n in kept], sum(nodes[n][3] for n in kept) / total)


def propose(own: TokenStore, shared: TokenStore, salt: Hashable, num_draft_tokens: int,
            spec: SpecConfig) -> tuple[list[int], list[int], float, list[float]]:
    """One request's tree (`ranked_nodes`' tokens, parents, then its score and shares): its own store
    (salt None) and the shared store (its salt) matched against its tokens, the better scored tree
    kept (Arctic's rule); the root alone, score 0, where neither matches."""
    context, root = own.buf[: own.high], own.last()
    depth = min(spec.suffix_max_depth, num_draft_tokens - 1)
    best = [root], [-1], [1.0], 0.0
    if depth >= 1:
        for store, store_salt in ((own, None), (shared, salt)):
            length, at = store.match(context, spec.suffix_max_depth, store_salt)
            if length:
                tree = ranked_nodes(root, store.continuations(at, depth), length, num_draft_tokens, spec)
                if tree[3] > best[3]:
                    best = tree
    tokens, parents, shares, score = best
    return tokens, parents, score, shares


class SuffixDrafter(Drafter):
    """The Drafter for algorithm=suffix: a shared store of finished requests' text and each running
    request's own store. A request's text enters the shared store when it is released.

    With the engine's `step_cost`, a drafting step's trees take the count of nodes per tree (`tree_size`,
    up to the configured shape's) that maximises the batch's expected tokens per second, each tree's
    ranked nodes expected accepted by their shares scaled by how the shares have turned out so far
    (`calibrated_gain`): a match seen by most candidates is drafted deep, a weak one not at all. The
    chooser's shape then only says whether the step drafts; without cost estimates (a GPU's graphs,
    an eager-only CPU) its budget bounds the trees."""

    nested_trees = True  # `draft_nodes` ranks nodes once; fewer tokens take a prefix of the ranking

    @classmethod
    def build(cls, spec: SpecConfig, ctx: DraftContext) -> Drafter:
        return cls(ctx.draft_plan)

    def __init__(self, draft_plan: DraftPlan, native: bool | None = None) -> None:
        """native: the C++ store and trees (True: required), the Python ones (False), or the C++ ones
        where they build (None)."""
        self.draft_plan = draft_plan
        self.spec = spec = draft_plan.spec
        self._native: ModuleType | None = suffix_store.load() if native is not False else None
        if native and self._native is None:
            raise RuntimeError("suffix drafter: the native token store is not built")
        self._store = self._native.TokenStore if self._native else TokenStore
        self.shared = self._store(spec.suffix_cache_tokens, spec.suffix_min_match, ring=True)
        self._reports_shared = True  # False once a successor took the shared store over (`inherit`)
        self._own: dict[str, tuple[TokenStore, Hashable]] = {}  # request id -> (its tokens, its cache salt)
        self.accepted = RunningAverage(HORIZON)  # accepted drafts per row drafted ...
        self.scored = RunningAverage(HORIZON)  # ... and the shares of its verified nodes
        self._scored: dict[str, float] = {}  # request id -> its verified nodes' shares, this step

    @property
    def native(self) -> bool:
        """Whether it runs the C++ store and trees."""
        return self._native is not None

    def propose(self, seqs: Sequence[SequenceView], shape: DraftShape | None = None) -> list[DraftTree]:
        shape = shape or self.draft_plan.shape
        largest = self.draft_plan.shape.num_draft_tokens
        costs = self.step_cost(len(seqs), largest) if self.step_cost is not None else [None] * largest
        self.declined = False
        if all(c is None for c in costs):  # nothing to weigh: the chooser's budget
            return [self.propose_ranked(s, shape.num_draft_tokens)[0] for s in seqs]
        trees, scores, _ = self.sized_trees(seqs, costs)
        for s, tree, score in zip(seqs, trees, scores):
            if tree.num_draft_tokens > 1:
                self._scored[s.request_id] = score
        return trees

    def sized_trees(self, seqs: Sequence[SequenceView], costs: Sequence[float | None], gain: float | None = None
                    ) -> tuple[list[DraftTree], list[float], int]:
        """Every row's ranked tree cut to the size that pays (`tree_size` over costs, one per node count up
        to the largest tree), each cut tree's score (its drafts' shares) and that size. Sets `declined` where
        some row had drafts and none paid."""
        ranked = [self.propose_ranked(s, len(costs)) for s in seqs]
        size = self.tree_size([shares for _, shares, _ in ranked], costs, gain)
        self.declined = size == 1 and any(len(shares) > 1 for _, shares, _ in ranked)
        return [tree.prefix(size) for tree, _, _ in ranked], [sum(shares[1:size]) for _, shares, _ in ranked], size

    def tree_size(self, shares: Sequence[Sequence[float]], costs: Sequence[float | None],
                  gain: float | None = None) -> int:
        """Nodes per tree (root included) that maximise sum over rows of (1 + gain x the shares of the
        row's first n - 1 ranked drafts) / costs[n - 1], the step's seconds with n nodes per tree (None:
        not estimated); the largest tree when none is. A prefix of a ranking is a tree, and the rows'
        trees are padded to one size anyway. gain: accepted drafts per unit of share (None: as its own
        drafts turned out, `calibrated_gain`)."""
        largest = min(max(len(row) for row in shares), len(costs))
        gain = calibrated_gain(self.accepted, self.scored) if gain is None else gain
        best, best_rate = largest, 0.0
        drafted = [0.0] * largest  # the batch's summed shares of the drafts in trees of n + 1 nodes
        for row in shares:  # plain lists: a few dozen numbers a step, where numpy's calls cost more
            total = -1.0  # the root's share, 1
            for i in range(largest):
                if i < len(row):
                    total += row[i]
                drafted[i] += total
        for n, cost in enumerate(costs[:largest], start=1):
            rate = (len(shares) + gain * drafted[n - 1]) / cost if cost else 0.0
            if rate > best_rate:
                best, best_rate = n, rate
        return best

    def on_accept(self, seqs: Sequence[SequenceView], out: object, accepted: Sequence[torch.Tensor]) -> None:
        for s, nodes in zip(seqs, accepted or ()):
            scored = self._scored.pop(s.request_id, None)
            if scored is not None:
                self.accepted.add(len(nodes) - 1)
                self.scored.add(scored)
        for s in seqs:  # finished requests too: their last tokens go to the shared store with them
            self._own_store(s)

    def release(self, request_id: str) -> None:
        self._scored.pop(request_id, None)
        own = self._own.pop(request_id, None)
        if own is not None:
            store, salt = own
            self.shared.append(store.tokens(), salt)
            self.shared.close()

    @property
    def cached_tokens(self) -> int:
        return self.shared.num_tokens if self._reports_shared else 0

    def forget(self) -> None:
        """Drop the shared store (what earlier requests taught it)."""
        self.shared = self._store(self.spec.suffix_cache_tokens, self.spec.suffix_min_match, ring=True)
        self._reports_shared = True

    def inherit(self, previous: Drafter) -> None:
        """Share `previous`'s store (its requests still to finish add to it) where it is of the same kind
        and size; else keep this one's own, empty."""
        if not isinstance(previous, SuffixDrafter) or type(previous.shared) is not type(self.shared):
            return
        if (previous.shared.capacity, previous.spec.suffix_min_match) != (self.shared.capacity,
                                                                         self.spec.suffix_min_match):
            return
        self.shared, previous._reports_shared = previous.shared, False

    def _own_store(self, seq: SequenceView) -> tuple[TokenStore, Hashable]:
        """(its own store, brought up to its tokens; its cache salt)."""
        own = self._own.get(seq.request_id)
        tokens = seq.token_ids
        if own is None or own[0].high > len(tokens):  # new (or a stream that shrank: start over)
            own = self._own[seq.request_id] = (self._store(max(2, 2 * len(tokens)), self.spec.suffix_min_match,
                                                           ring=False), seq.cache_salt)
        store = own[0]
        store.append(tokens[store.high:])
        return own

    def propose_scored(self, seq: SequenceView, num_draft_tokens: int) -> tuple[DraftTree, float]:
        """The better scored of the trees of its own store and of the shared store (Arctic's rule),
        and its score (`draft_nodes`)."""
        tree, _, score = self.propose_ranked(seq, num_draft_tokens)
        return tree, score

    def propose_ranked(self, seq: SequenceView, num_draft_tokens: int) -> tuple[DraftTree, list[float], float]:
        """`propose_scored`'s tree, its nodes' shares (`ranked_nodes`) and its score."""
        spec, (own, salt) = self.spec, self._own_store(seq)
        if not self._native:
            tokens, parents, score, shares = propose(own, self.shared, salt, num_draft_tokens, spec)
            return DraftTree.from_parents(tokens, parents), shares, score
        # the same tree, its links and mask laid out in C++ as `DraftTree.from_parents` lays them out
        links, mask, score, shares = self._native.propose(own, self.shared, salt, spec.suffix_max_depth,
                                                          num_draft_tokens, spec.suffix_min_token_prob,
                                                          spec.suffix_max_spec_factor)
        tokens, parents, depth, first_child, next_sibling = torch.from_numpy(links).unbind()
        return DraftTree(tokens=tokens, parents=parents, depth=depth, mask=torch.from_numpy(mask),
                         first_child=first_child, next_sibling=next_sibling), shares.tolist(), score
