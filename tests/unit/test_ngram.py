"""NGRAM drafter: trie insertion and eviction, matching, BFS / PROB draft selection."""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

import pytest

from specserve.config import SpecConfig
from specserve.draft_plan import DraftPlan
from specserve.drafters.ngram import NgramDrafter, NgramTrie
from specserve.tree import DraftShape, DraftTree


@dataclass
class Seq:
    request_id: str
    token_ids: list[int]


def ngram_spec(**kw) -> SpecConfig:
    # SGLang's min window of 1 (our default is 2): the hand-built cases match on single tokens
    return SpecConfig(algorithm="ngram", **{"num_draft_tokens": 12, "ngram_min_match_window": 1, **kw})


def propose(drafter: NgramDrafter, tokens: list[int], request_id: str = "r") -> DraftTree:
    (tree,) = drafter.propose([Seq(request_id, tokens)])
    return tree


def ids(text: str) -> list[int]:
    """One token per character (spaces dropped): "ab c" -> [97, 98, 99]."""
    return [ord(c) for c in text.replace(" ", "")]


def text(tree: DraftTree) -> str:
    return "".join(chr(t) for t in tree.tokens.tolist())


def snapshot(trie: NgramTrie) -> dict[tuple[int, ...], tuple[int, int, list[int]]]:
    """path -> (count, stamp, child tokens in stored recency order), checking the links."""
    out = {}
    stack: list[tuple[tuple[int, ...], int]] = [((), NgramTrie.TOP)]
    while stack:
        path, node = stack.pop()
        for token, child in trie.node_children[node].items():
            assert trie.node_parent[child] == node and trie.node_token[child] == token
            assert trie.node_depth[child] == len(path) + 1
            stack.append(((*path, token), child))
        if path:
            out[path] = (trie.node_count[node], trie.node_stamp[node], list(trie.node_children[node]))
    return out


def reference_trie(tokens: list[int], branch_length: int) -> dict[tuple[int, ...], tuple[int, int]]:
    """path -> (count, stamp) straight from the definition: windows tokens[i : i + branch_length]."""
    ref: dict[tuple[int, ...], tuple[int, int]] = {}
    for i in range(len(tokens)):
        window = tokens[i : i + branch_length]
        for d in range(1, len(window) + 1):
            count, _ = ref.get(tuple(window[:d]), (0, -1))
            ref[tuple(window[:d])] = (count + 1, i + d - 1)
    return ref


def check_tree_shape(tree: DraftTree, tokens: list[int], num_draft_tokens: int) -> None:
    toks, parents = tree.tokens.tolist(), tree.parents.tolist()
    assert 1 <= len(toks) <= num_draft_tokens
    assert toks[0] == tokens[-1] and parents[0] == -1
    assert all(0 <= p < i for i, p in enumerate(parents) if i > 0), "parents before children"
    siblings = [(p, t) for p, t in zip(parents[1:], toks[1:], strict=True)]
    assert len(siblings) == len(set(siblings)), "siblings must have distinct tokens"
    stream = "," + ",".join(map(str, tokens)) + ","
    for i in range(1, len(toks)):  # root + path to every node occurred in the stream
        path, j = [], i
        while j >= 0:
            path.append(toks[j])
            j = parents[j]
        assert "," + ",".join(map(str, reversed(path))) + "," in stream


def test_repeated_pattern_drafts_its_continuation_as_a_chain():
    tokens = ids("a b c d a b c d a b c")
    for match_type in ("BFS", "PROB"):
        tree = propose(NgramDrafter(DraftPlan.of(ngram_spec(ngram_match_type=match_type))), tokens)
        assert text(tree) == "cdabcdabc"  # root c, then what followed "...a b c" before
        assert tree.parents.tolist() == list(range(-1, 8))


def test_bfs_takes_recent_first_prob_takes_frequent_first():
    # after "x": A three times (long ago), B once (most recently)
    tokens = ids("x A x A x A x B x")
    bfs = propose(NgramDrafter(DraftPlan.of(ngram_spec(num_draft_tokens=3, ngram_match_type="BFS"))), tokens)
    assert text(bfs) == "xBA" and bfs.parents.tolist() == [-1, 0, 0]
    prob = propose(NgramDrafter(DraftPlan.of(ngram_spec(num_draft_tokens=3, ngram_match_type="PROB"))), tokens)
    # p(A) = 3/5 and p(x | A) = 1 beat p(B) = 1/5
    assert text(prob) == "xAx" and prob.parents.tolist() == [-1, 0, 1]
    prob4 = propose(NgramDrafter(DraftPlan.of(ngram_spec(num_draft_tokens=4, ngram_match_type="PROB"))), tokens)
    assert text(prob4) == "xAxA" and prob4.parents.tolist() == [-1, 0, 1, 2]  # 3/5 * 1 * 2/3 = 0.4 > 0.2


def test_bfs_breadth_shrinks_per_level():
    # "x" was followed by 1..5, each of them by "x" again; min_match_window = max_match_window = 1
    tokens = ids("x1x2x3x4x5x")
    spec = ngram_spec(
        ngram_min_match_window=1, ngram_max_match_window=1, ngram_min_bfs_breadth=1, ngram_max_bfs_breadth=3
    )
    spec = replace(spec, num_draft_tokens=8)
    tree = propose(NgramDrafter(DraftPlan.of(spec)), tokens)
    # step = (3 - 1) / 1 = 2. Level 0: breadth 3, most recent first (5 4 3, not 2 1); level 1:
    # 3 - 2 = 1 child each; level 2: floored at 1 ("x5x" ends the stream, so it has no child)
    assert text(tree) == "x543xxx5"
    assert tree.parents.tolist() == [-1, 0, 0, 0, 1, 2, 3, 5]


def test_longest_match_goes_first_and_shorter_matches_merge():
    # "q z" was followed by "r", a bare "z" also by "s" (more recently): the longer match's "r"
    # comes first, then "z"'s continuations merge in ("r" again is not duplicated)
    tokens = ids("q z r p z s y q z")
    tree = propose(NgramDrafter(DraftPlan.of(ngram_spec())), tokens)
    toks, parents = text(tree), tree.parents.tolist()
    assert [toks[i] for i, p in enumerate(parents) if p == 0] == ["r", "s"]
    assert toks[:8] == "zrpzsyqz"  # everything after "q z" first, as a chain
    check_tree_shape(tree, tokens, 12)


@pytest.mark.parametrize("tokens", [[5], ids("abcdefg"), ids("abcab") + [0]])
def test_no_match_gives_root_only(tokens):
    tree = propose(NgramDrafter(DraftPlan.of(ngram_spec())), tokens)
    assert tree.tokens.tolist() == [tokens[-1]] and tree.parents.tolist() == [-1]


@pytest.mark.parametrize("match_type", ["BFS", "PROB"])
@pytest.mark.parametrize("num_draft_tokens", [1, 2, 5, 12, 30])
def test_random_streams_give_valid_bounded_trees(match_type, num_draft_tokens):
    rng = random.Random(num_draft_tokens)
    spec = ngram_spec(
        num_draft_tokens=num_draft_tokens,
        ngram_match_type=match_type,
        ngram_branch_length=8,
        ngram_max_match_window=5,
        ngram_max_bfs_breadth=4,
    )
    drafter = NgramDrafter(DraftPlan.of(spec))
    tokens: list[int] = []
    sizes = set()
    for _ in range(60):
        tokens += [rng.randrange(6) for _ in range(rng.randrange(1, 4))]
        tree = propose(drafter, tokens)
        check_tree_shape(tree, tokens, num_draft_tokens)
        sizes.add(tree.num_draft_tokens)
    assert max(sizes) == num_draft_tokens  # a small vocabulary fills the budget


@pytest.mark.parametrize("match_type", ["BFS", "PROB"])
def test_the_tree_of_fewer_tokens_is_the_first_nodes_of_a_larger_one(match_type):
    """`nested_trees`: one step's tree of n tokens also tells what every smaller shape would have won."""
    rng = random.Random(7)
    spec = ngram_spec(ngram_match_type=match_type, ngram_branch_length=8, ngram_max_match_window=5,
                      ngram_max_bfs_breadth=4)
    drafter = NgramDrafter(DraftPlan.of(spec))
    assert drafter.nested_trees
    tokens: list[int] = []
    for _ in range(40):
        tokens += [rng.randrange(6) for _ in range(rng.randrange(1, 4))]
        (large,) = drafter.propose([Seq("r", tokens)], DraftShape(12, 11, 1))
        for n in range(1, 12):
            (small,) = drafter.propose([Seq("r", tokens)], DraftShape(n, n - 1, 1))
            assert small.tokens.tolist() == large.tokens[:n].tolist()[: small.num_draft_tokens]
            assert small.parents.tolist() == large.parents[: small.num_draft_tokens].tolist()
            assert small.num_draft_tokens == min(n, large.num_draft_tokens)


@pytest.mark.parametrize("chunk", [1, 3, 7, 1000])
def test_incremental_insertion_equals_inserting_everything(chunk):
    rng = random.Random(chunk)
    tokens = [rng.randrange(4) for _ in range(200)]
    whole, pieces = NgramTrie(branch_length=6, capacity=10**6), NgramTrie(branch_length=6, capacity=10**6)
    whole.extend(tokens)
    for i in range(0, len(tokens), chunk):
        pieces.extend(tokens[i : i + chunk])
    assert snapshot(pieces) == snapshot(whole)
    assert pieces.num_tokens == whole.num_tokens == len(tokens)
    ref = reference_trie(tokens, 6)
    got = snapshot(whole)
    assert {path: (count, stamp) for path, (count, stamp, _) in got.items()} == ref
    assert whole.num_nodes == len(ref)
    for path, (_, _, children) in got.items():  # children kept least recent first
        stamps = [ref[(*path, c)][1] for c in children]
        assert stamps == sorted(stamps)


def test_capacity_bound_with_lru_eviction():
    rng = random.Random(0)
    trie = NgramTrie(branch_length=5, capacity=40)
    tokens: list[int] = []
    for _ in range(300):
        new = [rng.randrange(10) for _ in range(rng.randrange(1, 4))]
        tokens += new
        trie.extend(new)
        nodes = snapshot(trie)
        assert trie.num_nodes == len(nodes) <= 40
        assert len(trie.node_token) <= 40 + 5 + 2  # evicted slots are reused
    # what survives is true: each path is a substring of the stream, counted at most as often
    ref = reference_trie(tokens, 5)
    assert all(path in ref and 1 <= count <= ref[path][0] for path, (count, _, _) in nodes.items())
    assert all(stamp <= ref[path][1] for path, (_, stamp, _) in nodes.items())
    # the newest windows (all suffixes of the stream) are never evicted while older leaves exist
    assert all(tuple(tokens[-d:]) in nodes for d in range(1, 6))
    # still drafts from recent history: repeat the last window
    spec = ngram_spec(ngram_capacity=40, ngram_branch_length=5, ngram_max_match_window=4)
    drafter = NgramDrafter(DraftPlan.of(spec))
    stream = tokens + tokens[-4:]
    tree = propose(drafter, stream)
    assert tree.num_draft_tokens > 1
    check_tree_shape(tree, stream, 12)


def test_eviction_takes_the_least_recently_used_leaf():
    trie = NgramTrie(branch_length=1, capacity=3)  # windows of one token: every node is a leaf
    trie.extend([1, 2, 3, 1, 4])
    assert set(snapshot(trie)) == {(3,), (1,), (4,)}  # 2 was touched least recently
    trie.extend([5])
    assert set(snapshot(trie)) == {(1,), (4,), (5,)}


def test_tiny_capacity_keeps_working():
    trie = NgramTrie(branch_length=4, capacity=1)
    for t in [1, 2, 3, 1, 2, 3, 4]:
        trie.extend([t])
        assert trie.num_nodes == len(snapshot(trie)) <= 1


def test_release_forgets_the_request():
    drafter = NgramDrafter(DraftPlan.of(ngram_spec()))
    assert text(propose(drafter, ids("p q r s p q r"))).startswith("rs")
    drafter.release("r")
    # a longer, unrelated stream for the same id: a remembered trie would still draft "s" after "r"
    assert text(propose(drafter, ids("z y x w v u t r"))) == "r"
    drafter.release("never-seen")  # no error


def test_requests_do_not_share_tries():
    drafter = NgramDrafter(DraftPlan.of(ngram_spec()))
    a, b = drafter.propose([Seq("a", ids("k m k m k")), Seq("b", ids("n k"))])
    assert text(a)[:2] == "km" and text(b) == "k"


def test_propose_catches_up_with_appended_tokens():
    drafter = NgramDrafter(DraftPlan.of(ngram_spec()))
    tokens = ids("a b")
    propose(drafter, tokens)
    tokens += ids("c a b")  # as if verify accepted 3 tokens
    drafter.on_accept([Seq("r", tokens)], None, [])
    assert text(propose(drafter, tokens)) == "bcab"


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"num_draft_tokens": 65}, "num_draft_tokens"),
        ({"ngram_min_match_window": 0}, "ngram_min_match_window"),
        ({"ngram_min_match_window": 5, "ngram_max_match_window": 4}, "ngram_min_match_window"),
        ({"ngram_branch_length": 12}, "ngram_branch_length"),
        ({"ngram_min_bfs_breadth": 3, "ngram_max_bfs_breadth": 2}, "ngram_min_bfs_breadth"),
        ({"ngram_capacity": 0}, "ngram_capacity"),
    ],
)
def test_bad_config_names_the_field(kw, field):
    """NGRAM's knobs are checked where the SpecConfig is built, before any drafter."""
    with pytest.raises(ValueError, match=f"^{field}:"):
        ngram_spec(**kw)


def test_unset_num_draft_tokens_drafts_the_default_tree():
    drafter = NgramDrafter(DraftPlan.of(ngram_spec(num_draft_tokens=0)))
    assert drafter.draft_plan.shape.num_draft_tokens == 12
    tokens = ids("q z r p z s y q z")
    check_tree_shape(propose(drafter, tokens), tokens, 12)
