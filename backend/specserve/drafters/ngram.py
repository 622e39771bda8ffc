"""NGRAM drafting (SGLang's lookahead, no draft model): continue the sequence the way it went before.

Each request keeps a trie of its own token windows. Every stream position i inserts the path
tokens[i : i + branch_length], so every substring of length <= branch_length is a path from the top:

    stream:  a b c a b d            (branch_length 3)
    top ─ a(2) ─ b(2) ─ c(1)        a node = one substring; (n) = count, how many windows pass through it
        │             └ d(1)        each node also keeps `stamp`, the stream position where that
        ├ b(2) ─ c(1) ─ a(1)        substring last ended (its recency)
        │      └ d(1)
        ├ c(1) ─ a(1) ─ b(1)
        └ d(1)

Insertion is incremental: the windows that are still shorter than branch_length ("open") each
grow by one node per appended token, so a token costs at most branch_length dict operations.
A node's children dict is kept in recency order (touching a child moves it to the end).

Matching: for w = min(max_match_window, len) down to min_match_window, walk the last w tokens
(ending with the root) from the top; every fully matched node that has children is a match, and
its subtree holds what followed that suffix earlier. Matches are expanded longest first into one
draft tree, merging equal token paths, until num_draft_tokens - 1 drafts are placed (as SGLang).

This module knows nothing about models, KV caches or the engine; it only reads token ids.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterable, Sequence
from itertools import islice

from specserve.config import SpecConfig
from specserve.draft_plan import DraftPlan
from specserve.drafters.base import DraftContext, Drafter, SequenceView
from specserve.tree import DraftShape, DraftTree

# The lazy leaf heap is rebuilt when it holds more than 2 * num_nodes + this many entries.
_HEAP_SLACK = 1024


class NgramTrie:
    """A trie of the windows tokens[i : i + branch_length] of one token stream, at most `capacity`
    nodes (the top not counted); when full, the least recently touched leaves are evicted.

    Nodes are ints indexing flat lists (node 0 = the top), and children are {token: node} dicts of
    ints, which Python's garbage collector does not track: a 2000-token stream makes ~36k nodes,
    and as objects they would make every full collection of the server process slower.

        node_token[n], node_parent[n] (-1: the top or a free slot), node_depth[n] (= substring length)
        node_count[n]: inserted windows passing through n
        node_stamp[n]: stream position where n's substring last ended (its recency)
        node_children[n]: {token: child}, least recently touched first

    Read these outside the trie, never write them. Evicted slots are reused. A lazy min-heap of
    packed ints (stamp, deepest first, node) finds the oldest leaf; entries whose node was
    evicted, grew children or was touched again are skipped.
    """

    TOP = 0

    def __init__(self, branch_length: int, capacity: int) -> None:
        if branch_length < 1 or capacity < 1:
            raise ValueError("ngram trie: branch_length and capacity must be >= 1")
        self.branch_length = branch_length
        self.capacity = capacity
        self.node_token = [-1]
        self.node_parent = [-1]
        self.node_depth = [0]
        self.node_count = [0]
        self.node_stamp = [-1]
        self.node_children: list[dict[int, int]] = [{}]
        self.num_nodes = 0
        self.num_tokens = 0  # tokens inserted so far = stream position of the next one
        self._open: list[int] = []  # deepest node of each window shorter than branch_length
        self._free: list[int] = []
        self._leaves: list[int] = []  # heap of _leaf_key(node)
        # slots in use never exceed capacity + one new node per open window + the top
        self._node_range = capacity + branch_length + 2

    def extend(self, tokens: Iterable[int]) -> None:
        """Append tokens to the stream: open a window at each, grow every open window by one node."""
        b, node_range, heap = self.branch_length, self._node_range, self._leaves
        par, dep, cnt, stm, kids = (
            self.node_parent,
            self.node_depth,
            self.node_count,
            self.node_stamp,
            self.node_children,
        )
        windows, pos = self._open, self.num_tokens
        for token in tokens:
            windows.append(self.TOP)
            grown: list[int] = []
            for node in windows:
                children = kids[node]
                child = children.pop(token, None)
                if child is None:
                    child = self._new_node(token, node)
                cnt[child] += 1
                stm[child] = pos
                children[token] = child  # re-insert: most recent last
                depth = dep[child]
                if not kids[child]:  # a leaf touched: heap entry with its new stamp (= _leaf_key)
                    heapq.heappush(heap, (pos * (b + 1) + b - depth) * node_range + child)
                if depth < b:
                    grown.append(child)
            windows = grown
            pos += 1
            if self.num_nodes > self.capacity:
                self._evict()
                windows = [n for n in windows if par[n] >= 0]  # an evicted window stops growing
        self._open, self.num_tokens = windows, pos
        if len(heap) > 2 * self.num_nodes + _HEAP_SLACK:
            self._rebuild_heap()

    def match(self, tokens: Sequence[int], min_window: int, max_window: int) -> list[int]:
        """Nodes reached by walking the last w tokens, w = min(max_window, len) .. min_window,
        longest first; only nodes with children (something followed that suffix before)."""
        kids, found = self.node_children, []
        tail = tokens[max(0, len(tokens) - max_window) :]
        for w in range(len(tail), min_window - 1, -1):
            node: int | None = self.TOP
            for token in tail[len(tail) - w :]:
                node = kids[node].get(token)
                if node is None:
                    break
            if node is not None and kids[node]:
                found.append(node)
        return found

    def _new_node(self, token: int, parent: int) -> int:
        self.num_nodes += 1
        if self._free:  # an evicted leaf: its children dict is empty and is reused
            node = self._free.pop()
            self.node_token[node], self.node_parent[node] = token, parent
            self.node_depth[node], self.node_count[node] = self.node_depth[parent] + 1, 0
            return node
        self.node_token.append(token)
        self.node_parent.append(parent)
        self.node_depth.append(self.node_depth[parent] + 1)
        self.node_count.append(0)
        self.node_stamp.append(-1)
        self.node_children.append({})
        return len(self.node_token) - 1

    def _leaf_key(self, node: int) -> int:
        """Heap order: older stamp first, then deeper first; the node id in the low digits."""
        b = self.branch_length
        return (self.node_stamp[node] * (b + 1) + b - self.node_depth[node]) * self._node_range + node

    def _evict(self) -> None:
        heap, par, kids = self._leaves, self.node_parent, self.node_children
        while self.num_nodes > self.capacity:
            key = heapq.heappop(heap)
            node = key % self._node_range
            if par[node] < 0 or kids[node] or self._leaf_key(node) != key:
                continue  # stale entry
            parent = par[node]
            del kids[parent][self.node_token[node]]
            par[node] = -1
            self._free.append(node)
            self.num_nodes -= 1
            if parent != self.TOP and not kids[parent]:
                heapq.heappush(heap, self._leaf_key(parent))

    def _rebuild_heap(self) -> None:
        """Drop stale entries: one entry per live leaf."""
        par, kids = self.node_parent, self.node_children
        self._leaves = [self._leaf_key(n) for n in range(1, len(par)) if par[n] >= 0 and not kids[n]]
        heapq.heapify(self._leaves)


class _DraftBuilder:
    """The flat (token, parent) lists of a draft tree, merging equal tokens under one parent."""

    def __init__(self, root: int, num_draft_tokens: int) -> None:
        self.tokens = [root]
        self.parents = [-1]
        self._children: list[dict[int, int]] = [{}]
        self._size = num_draft_tokens

    @property
    def full(self) -> bool:
        return len(self.tokens) >= self._size

    def add(self, parent: int, token: int) -> int | None:
        """Index of `token` under `parent` (existing or new); None when a new node does not fit."""
        idx = self._children[parent].get(token)
        if idx is None:
            if self.full:
                return None
            idx = len(self.tokens)
            self.tokens.append(token)
            self.parents.append(parent)
            self._children.append({})
            self._children[parent][token] = idx
        return idx


def _bfs_breadth_step(spec: SpecConfig) -> float:
    windows = spec.ngram_max_match_window - spec.ngram_min_match_window + 1
    return (spec.ngram_max_bfs_breadth - spec.ngram_min_bfs_breadth) / windows


def _fill_bfs(out: _DraftBuilder, trie: NgramTrie, matches: Sequence[int], spec: SpecConfig) -> None:
    """Level by level, most recent children first.

    A match of w tokens starts at breadth max_bfs_breadth - (w - min_match_window) * step and each
    deeper level loses one step, floored at min_bfs_breadth; step = (max_bfs_breadth -
    min_bfs_breadth) / (max_match_window - min_match_window + 1). Short matches (weak evidence)
    branch wide, long matches go narrow and deep, as SGLang's schedule.
    """
    step, min_breadth = _bfs_breadth_step(spec), spec.ngram_min_bfs_breadth
    kids = trie.node_children
    for match in matches:
        start = spec.ngram_max_bfs_breadth - (trie.node_depth[match] - spec.ngram_min_match_window) * step
        queue = deque([(0, match, start)])  # (draft index, trie node, breadth)
        while queue:
            pos, node, breadth = queue.popleft()
            for token, child in islice(reversed(kids[node].items()), max(min_breadth, int(breadth))):
                idx = out.add(pos, token)
                if idx is None:
                    return
                if kids[child]:
                    queue.append((idx, child, breadth - step))


def _likeliest_children(trie: NgramTrie, node: int, k: int) -> Iterable[int]:
    """The k children with the highest count; equal counts: most recent first."""
    children = trie.node_children[node].values()
    if len(children) <= k:
        return children
    return heapq.nlargest(k, reversed(children), key=trie.node_count.__getitem__)


def _fill_prob(out: _DraftBuilder, trie: NgramTrie, matches: Sequence[int], spec: SpecConfig) -> None:
    """Best first by path probability, the product of count(child) / count(parent) from the match;
    each node offers its max_bfs_breadth most frequent children (SGLang's top-k); equal
    probabilities: most recent first."""
    for match in matches:
        heap: list[tuple[float, int, int, int]] = []  # (-prob, -stamp, parent's draft index, node)
        _offer_children(heap, trie, 0, match, 1.0, spec.ngram_max_bfs_breadth)
        while heap:
            neg_prob, _, pos, node = heapq.heappop(heap)
            idx = out.add(pos, trie.node_token[node])
            if idx is None:
                return
            _offer_children(heap, trie, idx, node, -neg_prob, spec.ngram_max_bfs_breadth)


def _offer_children(
    heap: list[tuple[float, int, int, int]], trie: NgramTrie, pos: int, node: int, prob: float, k: int
) -> None:
    cnt, stamp = trie.node_count, trie.node_stamp
    for child in _likeliest_children(trie, node, k):
        heapq.heappush(heap, (-prob * cnt[child] / cnt[node], -stamp[child], pos, child))


class NgramDrafter(Drafter):
    """The Drafter for algorithm=ngram: one NgramTrie per request over its prompt + generated tokens.

    propose() first inserts the tokens appended since the last call, so on_accept has nothing to do.
    Its trees are nested: the fills add nodes in one order whatever the budget, so the tree of n
    tokens is the first n of any larger one's.
    A finished request's trie stays with its slot: the next request admitted into that slot whose
    reused prefix covers every token the trie saw (a second turn) continues it instead of building
    a trie over its whole prompt again.
    """

    nested_trees = True

    @classmethod
    def build(cls, spec: SpecConfig, ctx: DraftContext) -> Drafter:
        return cls(ctx.draft_plan)  # drafts from the request's tokens alone

    def __init__(self, draft_plan: DraftPlan) -> None:
        """draft_plan: its shape, and its SpecConfig's ngram knobs (checked by `SpecConfig`)."""
        self.draft_plan = draft_plan
        self.spec = draft_plan.spec
        self._tries: dict[str, NgramTrie] = {}
        self._slots: dict[str, int] = {}  # request id -> its slot (where its trie stays after it ends)
        self._kept: dict[int, NgramTrie] = {}  # slot -> the trie of the request that left it

    def propose(self, seqs: Sequence[SequenceView], shape: DraftShape | None = None) -> list[DraftTree]:
        shape = shape or self.draft_plan.shape
        return [self._propose_one(s.request_id, getattr(s, "slot", None), s.token_ids, shape.num_draft_tokens)
                for s in seqs]

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """dst's kept trie goes to its new request when every token it saw is reused in place."""
        trie = self._kept.get(dst)
        if trie is not None and (src != dst or trie.num_tokens > n):
            del self._kept[dst]

    def release(self, request_id: str) -> None:
        trie, slot = self._tries.pop(request_id, None), self._slots.pop(request_id, None)
        if trie is not None and slot is not None:
            self._kept[slot] = trie

    def _propose_one(self, request_id: str, slot: int | None, token_ids: Sequence[int],
                     num_draft_tokens: int) -> DraftTree:
        spec = self.spec
        trie = self._tries.get(request_id)
        if trie is None and slot is not None:
            self._slots[request_id] = slot
            trie = self._kept.pop(slot, None)
        if trie is None or trie.num_tokens > len(token_ids):  # new request (or a stream that shrank)
            trie = NgramTrie(spec.ngram_branch_length, spec.ngram_capacity)
        self._tries[request_id] = trie
        trie.extend(token_ids[trie.num_tokens :])
        matches = trie.match(token_ids, spec.ngram_min_match_window, spec.ngram_max_match_window)
        out = _DraftBuilder(token_ids[-1], num_draft_tokens)
        if matches:
            fill = _fill_bfs if spec.ngram_match_type == "BFS" else _fill_prob
            fill(out, trie, matches, spec)
        return DraftTree.from_parents(out.tokens, out.parents)

