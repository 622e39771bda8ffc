"""Suffix decoding's stores and trees (`drafters.suffix`), against brute force where it can be."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specserve.config import SpecConfig
from specserve.draft_plan import DraftPlan
from specserve.drafters.suffix import SENTINEL, SuffixDrafter, TokenStore, draft_nodes
from specserve.tree import DraftShape


@dataclass
class Seq:
    request_id: str
    token_ids: list[int]
    cache_salt: str | None = None
    slot: int = 0
    cache_len: int = field(default=0)


def drafter(**knobs: object) -> SuffixDrafter:
    return SuffixDrafter(DraftPlan.of(SpecConfig(algorithm="suffix", **knobs)))


def serve(d: SuffixDrafter, request_id: str, tokens: list[int], salt: str | None = None) -> None:
    """A request that drafted once, gained its tokens and finished."""
    seq = Seq(request_id, tokens, salt)
    d.propose([seq])
    d.on_accept([seq], None, None)
    d.release(request_id)


def longest_match(segments: list[list[int]], context: list[int], k: int, max_len: int) -> int:
    """Brute force: the longest suffix of context (k..max_len tokens) followed by a token in a segment."""
    best = 0
    for n in range(k, min(max_len, len(context)) + 1):
        tail = context[-n:]
        if any(seg[i : i + n] == tail for seg in segments for i in range(len(seg) - n)):
            best = n
    return best


@settings(max_examples=60, deadline=None)
@given(segments=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=30), min_size=1, max_size=6),
       context=st.lists(st.integers(0, 3), min_size=1, max_size=12), k=st.integers(1, 3))
def test_match_is_the_longest_suffix_seen(segments, context, k):
    store = TokenStore(4096, k, ring=True)
    for seg in segments:
        store.append(seg)
        store.close()
    length, at = store.match(np.asarray(context, dtype=np.int32), max_len=8)
    assert length == longest_match(segments, context, k, 8)
    flat = store.buf[: store.high].tolist()
    for p in at.tolist():  # every candidate is preceded by the matched suffix and followed by a token
        assert flat[p - length : p] == context[-length:] and flat[p] != SENTINEL


def test_continuations_stop_at_the_segment_end():
    store = TokenStore(64, 2, ring=True)
    store.append([1, 2, 3])
    store.close()
    store.append([1, 2, 9, 8, 7])
    store.close()
    length, at = store.match(np.asarray([5, 1, 2]), max_len=8)
    rows = store.continuations(at, 4)
    assert length == 2
    assert sorted(rows.tolist()) == [[3, SENTINEL, SENTINEL, SENTINEL], [9, 8, 7, SENTINEL]]


def test_ring_evicts_oldest_segments_and_the_index_stays_bounded():
    store = TokenStore(100, 2, ring=True)
    for i in range(200):  # 200 segments of 10 tokens (+ the end) through a ring of 100
        store.append([i % 7, 100 + i, 200 + i % 5, 3, 4, 5, 6, 7, 8, 9])
        store.close()
        assert store.num_tokens <= 100
    _, at = store.match(np.asarray([3, 4]), max_len=8)
    assert len(at) and at.min() >= store.low  # only live positions come back
    assert sum(len(p) for keys in store.index.values() for p in keys.values()) <= 2 * 100
    length, _ = store.match(np.asarray([0, 100]), max_len=8)  # the first segment is long gone
    assert length == 0


def test_a_segment_longer_than_the_ring_keeps_its_end():
    store = TokenStore(16, 2, ring=True)
    store.append(list(range(40)))
    store.close()
    length, at = store.match(np.asarray([35, 36]), max_len=8)
    assert length == 2 and store.continuations(at, 3).tolist() == [[37, 38, 39]]
    assert store.match(np.asarray([3, 4]), max_len=8)[0] == 0


def test_tree_ranks_by_frequency_and_is_nested():
    spec = SpecConfig(algorithm="suffix", suffix_min_token_prob=0.2)
    rows = np.array([[5, 6, 7], [5, 6, 7], [5, 6, 8], [5, 9, SENTINEL], [4, 1, 2]], dtype=np.int32)
    tokens, parents, score = draft_nodes(0, rows, match_len=3, num_draft_tokens=8, spec=spec)
    # counts 5:4, 6:3, 7:2, then the ones (1 of 5 = 0.2 is kept) shallowest first, the newest row's first
    assert tokens == [0, 5, 6, 7, 4, 1, 9, 2]
    assert parents == [-1, 0, 1, 2, 0, 4, 1, 5]
    assert score == pytest.approx((4 + 3 + 2 + 1 + 1 + 1 + 1) / 5)
    for n in range(1, 8):  # a smaller tree is a prefix of a larger one
        small_tokens, small_parents, _ = draft_nodes(0, rows, match_len=3, num_draft_tokens=n, spec=spec)
        assert small_tokens == tokens[:n] and small_parents == parents[:n]


def _full_trie_reference(root, rows, match_len, num_draft_tokens, spec):
    """Every continuation's whole path in one trie, then the nodes ranked: what `draft_nodes` builds
    level by level, skipping branches below the share."""
    depth = min(rows.shape[1], int(spec.suffix_max_spec_factor * match_len))
    token, parent, level, count, kids = [root], [-1], [0], [0], [{}]
    for row in reversed(rows[:, :depth].tolist()):
        node = 0
        for t in row:
            if t == SENTINEL:
                break
            if t not in kids[node]:
                kids[node][t] = len(token)
                token.append(t), parent.append(node), level.append(level[node] + 1), count.append(0), kids.append({})
            node = kids[node][t]
            count[node] += 1
    kept = sorted((n for n in range(1, len(token)) if count[n] >= spec.suffix_min_token_prob * len(rows)),
                  key=lambda n: (-count[n], level[n], n))[: num_draft_tokens - 1]
    new = {0: 0, **{n: i + 1 for i, n in enumerate(kept)}}
    return [root] + [token[n] for n in kept], [-1] + [new[parent[n]] for n in kept], sum(count[n] for n in kept)


@pytest.mark.parametrize("seed", range(40))
def test_tree_equals_the_full_trie_reference(seed):
    rng = np.random.default_rng(seed)
    rows = rng.integers(1, 4, size=(int(rng.integers(1, 30)), int(rng.integers(1, 8))), dtype=np.int32)
    rows[rng.random(rows.shape) < 0.1] = SENTINEL
    rows[np.maximum.accumulate(rows == SENTINEL, axis=1)] = SENTINEL
    spec = SpecConfig(algorithm="suffix", suffix_min_token_prob=float(rng.choice([0.0, 0.1, 0.3])))
    ndt = int(rng.integers(2, 20))
    tokens, parents, score = draft_nodes(0, rows, 6, ndt, spec)
    want_tokens, want_parents, want_count = _full_trie_reference(0, rows, 6, ndt, spec)
    assert (tokens, parents) == (want_tokens, want_parents)
    assert score == pytest.approx(want_count / len(rows))


def test_tree_depth_is_bounded_by_the_match_and_rare_tokens_are_dropped():
    spec = SpecConfig(algorithm="suffix", suffix_min_token_prob=0.5, suffix_max_spec_factor=1.0)
    rows = np.array([[5, 6, 7, 8], [5, 6, 7, 8], [5, 1, 2, 3]], dtype=np.int32)
    tokens, _, _ = draft_nodes(0, rows, match_len=2, num_draft_tokens=16, spec=spec)
    assert tokens == [0, 5, 6]  # 2 deep at a match of 2; 1 (1 in 3) under the 0.5 share


def test_a_finished_request_drafts_for_the_next():
    d = drafter()
    serve(d, "a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    tree = d.propose([Seq("b", [40, 41, 2, 3, 4, 5])])[0]
    assert tree.tokens.tolist() == [5, 6, 7, 8, 9]  # match of 4 ([2 3 4 5]) drafts 4 deep


def test_requests_of_another_cache_salt_never_draft_from_it():
    d = drafter()
    serve(d, "a", [1, 2, 3, 4, 5, 6, 7, 8, 9], salt="tenant-a")
    for salt in (None, "tenant-b"):
        assert d.propose([Seq(f"b-{salt}", [40, 2, 3, 4, 5], salt)])[0].tokens.tolist() == [5]
    assert d.propose([Seq("c", [40, 2, 3, 4, 5], "tenant-a")])[0].tokens.tolist() == [5, 6, 7, 8, 9]


def test_the_better_scored_store_drafts():
    d = drafter()
    serve(d, "a", [1, 2, 3, 4, 5, 6])
    serve(d, "b", [8, 2, 3, 4])
    # shared: [1 2 3] matched, 4 5 6 (score 3); own: [2 3] -> 9 0 / 9 1 (score 1 + 0.5 + 0.5)
    assert d.propose([Seq("c", [2, 3, 9, 0, 2, 3, 9, 1, 2, 3])])[0].tokens.tolist() == [3, 4, 5, 6]
    # shared: [2 3] -> 4 5 / 4 (score 1 + 0.5); own: [2 3] -> 9 7 twice (score 2)
    assert d.propose([Seq("d", [2, 3, 9, 7, 0, 2, 3, 9, 7, 6, 2, 3])])[0].tokens.tolist() == [3, 9, 7]


def test_own_tokens_draft_before_anything_is_shared():
    d = drafter()
    tree = d.propose([Seq("a", [7, 8, 9, 10, 11, 0, 7, 8, 9])])[0]
    assert tree.tokens.tolist() == [9, 10, 11, 0]  # [7 8 9] matched 3: 3 deep


def test_memory_stays_within_the_knob():
    d = drafter(suffix_cache_tokens=500)
    rng = np.random.default_rng(0)
    for i in range(100):
        serve(d, str(i), rng.integers(0, 1000, 60).tolist(), salt=str(i % 3))
        assert d.shared.num_tokens <= 500
    assert sum(len(p) for keys in d.shared.index.values() for p in keys.values()) <= 2 * 500
    assert not d._own  # released requests leave nothing behind


def test_a_successor_takes_the_store_over_and_alone_reports_it():
    """An engine replaced by a better-built one: its drafter's store passes to the new drafter, which
    drafts from what the old one learned; the old one's requests still finishing add to the same store,
    and only the new drafter reports it (the served gauge sums both engines)."""
    old, new = drafter(), drafter()
    serve(old, "a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    old.propose([Seq("still-open", [20, 21, 22, 23, 24, 25])])
    new.inherit(old)
    assert new.shared is old.shared and old.cached_tokens == 0 and new.cached_tokens == 10  # a separator each
    assert new.propose([Seq("b", [40, 2, 3, 4, 5])])[0].tokens.tolist() == [5, 6, 7, 8, 9]
    serve(old, "still-open", [20, 21, 22, 23, 24, 25])  # the old engine finishes its request
    assert new.propose([Seq("c", [7, 21, 22, 23])])[0].tokens.tolist() == [23, 24, 25]
    assert old.cached_tokens == 0 and new.cached_tokens == 17


def test_a_store_of_another_size_is_not_taken_over():
    old, new = drafter(suffix_cache_tokens=500), drafter()
    serve(old, "a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    new.inherit(old)
    assert new.shared is not old.shared and new.cached_tokens == 0 and old.cached_tokens == 10


def test_knobs_are_checked():
    with pytest.raises(ValueError, match="suffix_min_match"):
        SpecConfig(algorithm="suffix", suffix_min_match=30, suffix_max_depth=24)
    with pytest.raises(ValueError, match="suffix_min_token_prob"):
        SpecConfig(algorithm="suffix", suffix_min_token_prob=1.5)
    with pytest.raises(ValueError, match="suffix_cache_tokens"):
        SpecConfig(algorithm="suffix", suffix_cache_tokens=1)


def test_trees_are_sized_by_their_shares_against_the_step_cost():
    """A drafting step takes the nodes per tree that maximise expected tokens per second: deep where
    most candidates agree, nothing where they scatter."""
    d = drafter(suffix_min_token_prob=0.0)
    cost = [5.0, 6.0, 6.5, 7.0, 10.0, 10.5, 11.0, 11.5]  # seconds with 1, 2, ... nodes per tree
    sure = [1.0, 0.95, 0.95, 0.9, 0.9, 0.9, 0.85, 0.8]
    assert d.tree_size([sure], cost) == 8  # (1 + 6.25) / 11.5 = 0.63 beats 4 nodes' (1 + 2.8) / 7 = 0.54
    assert d.tree_size([[1.0, 0.1, 0.05]], cost) == 1  # (1 + 0.1) / 6 < 1 / 5: plain decoding
    assert d.tree_size([[1.0, 0.9, 0.6, 0.5, 0.1]], cost) == 4  # (1 + 2.0) / 7 beats (1 + 1.5) / 6.5
    assert d.tree_size([[1.0, 0.1], sure], cost) == 8  # one size for the batch: the rows' sum decides
    assert d.tree_size([sure], cost[:4] + [None] * 4) == 4  # no estimate beyond 4 nodes
    assert d.tree_size([[1.0, 0.1, 0.05]], [None] * 8) == 3  # none at all: the largest


def test_a_step_whose_drafts_do_not_pay_is_declined_not_empty():
    """`declined` tells the chooser a draft was weighed and lost, not missing: set where a row had drafts
    and the costs cut them all, clear where no row had any."""
    d = drafter(suffix_min_token_prob=0.0)
    serve(d, "old", [1, 2, 3, 4, 5, 6])
    d.step_cost = lambda batch_size, n: [0.01 * (1 + i) for i in range(n)]  # every node costs a step
    assert d.propose([Seq("a", [50, 2, 3])])[0].num_draft_tokens == 1 and d.declined
    d.step_cost = lambda batch_size, n: [0.01] * n  # free nodes
    assert d.propose([Seq("a", [50, 2, 3])])[0].num_draft_tokens > 1 and not d.declined
    assert d.propose([Seq("b", [70, 71, 72])])[0].num_draft_tokens == 1 and not d.declined  # nothing matched


def test_sized_trees_are_prefixes_and_the_gain_follows_what_was_accepted():
    d = drafter(suffix_min_token_prob=0.0, suffix_max_spec_factor=4.0)
    for i in range(6):  # one continuation seen over and over: every share 1
        serve(d, f"r{i}", [40 + i, 1, 2, 3, 4, 5, 6, 7])
    seq = Seq("new", [50, 1, 2])
    full, shares, _ = d.propose_ranked(seq, 6)
    assert full.tokens.tolist() == [2, 3, 4, 5, 6, 7] and shares == [1.0] * 6
    assert d.propose([seq], DraftShape(3, 2, 1))[0].tokens.tolist() == [2, 3, 4]  # no step cost: the budget
    cost = {1: 5.0, 2: 6.0, 3: 6.5, 4: 7.0}  # 5+ nodes: no estimate
    d.step_cost = lambda batch_size, n: [cost.get(rows) for rows in range(1, n + 1)]
    assert d.draft_plan.shape.num_draft_tokens >= 6
    (tree,) = d.propose([seq], DraftShape(2, 1, 1))  # drafting: the chooser's budget no longer bounds it
    assert tree.tokens.tolist() == [2, 3, 4, 5]  # 4 nodes: (1 + 3) / 7 beats (1 + 2) / 6.5
    assert tree.first_child.tolist() == [1, 2, 3, -1] and tree.next_sibling.tolist() == [-1] * 4
    assert tree.mask.shape == (4, 4) and tree.depth.tolist() == [0, 1, 2, 3]
    d.on_accept([seq], None, [np.array([0])])  # none of its 3 drafts accepted
    assert d.accepted.value == 0 and d.scored.value == 3.0
    for _ in range(20):  # the shares keep turning out too high: it stops drafting
        d.propose([seq], DraftShape(6, 5, 1))
        d.on_accept([seq], None, [np.array([0])])
    assert d.tree_size([shares], [cost.get(n) for n in range(1, 7)]) == 1
