"""The C++ token store and draft tree (`specserve_kernels.suffix_store`) against the Python reference
(`drafters.suffix`): random streams of appends, closes, matches and continuations through small rings and
several salts, the index compared after every operation; draft trees over random rows with ties; whole
drafters side by side; bad inputs. Those are skipped where the module cannot be built (no g++ or ninja);
the fallback to the Python store is tested everywhere."""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specserve.config import SpecConfig
from specserve.draft_plan import DraftPlan
from specserve.drafters import suffix
from specserve.tree import DraftTree
from specserve_kernels import suffix_store

native = suffix_store.load()
needs_native = pytest.mark.skipif(native is None, reason="the C++ token store cannot be built here (g++, ninja)")

SALTS = [None, "a", "b", ""]
BIG = (1 << 24) - 1  # the largest token id: its bytes fill a k-gram key's


def token_ids(small: int) -> st.SearchStrategy[int]:
    """Mostly a few small ids (so k-grams repeat and matches are long), now and then the largest one."""
    return st.one_of(st.integers(0, small), st.just(BIG))


def ops(small: int) -> st.SearchStrategy[list[tuple]]:
    """Appends, closes and matches; a match's context is a few tokens, then (mostly) a stretch of what
    the store holds ending `back` positions before its end, so that long matches are common."""
    append = st.tuples(st.just("append"), st.lists(token_ids(small), max_size=12), st.sampled_from(SALTS))
    close = st.tuples(st.just("close"))
    match = st.tuples(st.just("match"), st.lists(token_ids(small), max_size=4), st.integers(0, 12),
                      st.integers(0, 12), st.integers(1, 10), st.sampled_from(SALTS), st.integers(0, 6))
    return st.lists(st.one_of(append, append, close, match, match), min_size=10, max_size=80)


def stream_of(rng: np.random.Generator, n: int, small: int) -> list[tuple]:
    """`ops`'s kind of stream from a seed, longer: many evictions and sweeps."""
    stream: list[tuple] = []
    salts = SALTS[: int(rng.integers(1, len(SALTS) + 1))]
    for _ in range(n):
        kind = rng.random()
        if kind < 0.45:
            tokens = rng.integers(0, small + 1, size=int(rng.integers(0, 14))).tolist()
            stream.append(("append", tokens, salts[int(rng.integers(len(salts)))]))
        elif kind < 0.6:
            stream.append(("close",))
        else:
            stream.append(("match", rng.integers(0, small + 1, size=int(rng.integers(0, 4))).tolist(),
                           int(rng.integers(0, 10)), int(rng.integers(0, 16)), int(rng.integers(1, 12)),
                           salts[int(rng.integers(len(salts)))], int(rng.integers(0, 8))))
    return stream


def same_state(py: suffix.TokenStore, cc: object) -> None:
    assert (cc.high, cc.low, cc.num_tokens, cc.capacity) == (py.high, py.low, py.num_tokens, py.capacity)
    assert cc.tokens().tolist() == py.tokens().tolist()
    if py.high:
        assert cc.last() == py.last()
    assert cc.index == py.index
    assert cc.index_size() == sum(len(p) for keys in py.index.values() for p in keys.values())


def run_both(py: suffix.TokenStore, cc: object, stream: list[tuple]) -> None:
    for op in stream:
        if op[0] == "append":
            py.append(op[1], op[2])
            cc.append(op[1], op[2])
        elif op[0] == "close":
            py.close()
            cc.close()
        else:
            _, prefix, back, n, max_len, salt, depth = op
            held = py.tokens().tolist()  # segment ends (-1) included: compared as the reference does
            context = np.asarray(prefix + held[max(0, len(held) - back - n) : max(0, len(held) - back)])
            want_len, want_at = py.match(context, max_len, salt)
            got_len, got_at = cc.match(context, max_len, salt)
            assert (got_len, got_at.tolist()) == (want_len, want_at.tolist())
            assert got_at.dtype == np.int64
            if len(want_at):
                want_rows = py.continuations(want_at, depth)
                got_rows = cc.continuations(got_at, depth)
                assert got_rows.dtype == np.int32 and got_rows.shape == want_rows.shape
                assert got_rows.tolist() == want_rows.tolist()
        same_state(py, cc)


@needs_native
@settings(max_examples=150, deadline=None)
@given(capacity=st.integers(2, 40), k=st.integers(1, 4), stream=ops(3))
def test_ring_store_equals_the_reference(capacity, k, stream):
    """Small rings: eviction of whole segments, of an open segment's oldest tokens, of a segment longer
    than the ring, lazy pruning in `match` and the sweeps, each leaving the same index."""
    run_both(suffix.TokenStore(capacity, k, ring=True), native.TokenStore(capacity, k, True), stream)


@needs_native
@pytest.mark.parametrize("seed", range(30))
def test_long_streams_through_small_rings(seed):
    rng = np.random.default_rng(seed)
    capacity, k = int(rng.integers(2, 60)), int(rng.integers(1, 4))
    stream = stream_of(rng, 600, int(rng.integers(1, 4)))
    run_both(suffix.TokenStore(capacity, k, ring=True), native.TokenStore(capacity, k, True), stream)


@needs_native
@settings(max_examples=80, deadline=None)
@given(capacity=st.integers(2, 12), k=st.integers(1, 4), stream=ops(2))
def test_growing_store_equals_the_reference(capacity, k, stream):
    run_both(suffix.TokenStore(capacity, k, ring=False), native.TokenStore(capacity, k, False), stream)


@needs_native
def test_many_candidates_keep_the_most_recent():
    """More positions after a k-gram than one lookup weighs, through a sweep or two."""
    py, cc = suffix.TokenStore(3000, 2, ring=True), native.TokenStore(3000, 2, True)
    rng = np.random.default_rng(0)
    for i in range(400):
        tokens = [1, 2, *rng.integers(0, 3, size=int(rng.integers(1, 12))).tolist()]
        salt = SALTS[i % 3]
        py.append(tokens, salt), cc.append(tokens, salt)
        py.close(), cc.close()
        context = np.asarray([0, *rng.integers(0, 3, size=8).tolist(), 1, 2])
        for s in SALTS:
            (want_len, want_at), (got_len, got_at) = py.match(context, 12, s), cc.match(context, 12, s)
            assert (got_len, got_at.tolist()) == (want_len, want_at.tolist())
            assert len(got_at) <= native.MAX_CANDIDATES == suffix.MAX_CANDIDATES
    same_state(py, cc)


@needs_native
@pytest.mark.parametrize("seed", range(20))
def test_match_store_reads_the_other_store_as_its_context(seed):
    rng = np.random.default_rng(seed)
    shared = native.TokenStore(int(rng.integers(8, 80)), int(rng.integers(1, 4)), True)
    for _ in range(30):
        shared.append(rng.integers(0, 3, size=int(rng.integers(1, 10))).tolist(), "s")
        shared.close()
    for ring in (False, True):  # read in place, or (wrapped) in order first
        other = native.TokenStore(int(rng.integers(2, 20)), 2, ring)
        for _ in range(int(rng.integers(1, 6))):
            other.append(rng.integers(0, 3, size=int(rng.integers(1, 10))).tolist())
        want_len, want_at = shared.match(other.tokens(), 12, "s")
        got_len, got_at = shared.match_store(other, 12, "s")
        assert (got_len, got_at.tolist()) == (want_len, want_at.tolist())


@needs_native
def test_salts_are_kept_apart():
    cc = native.TokenStore(64, 2, True)
    cc.append([1, 2, 3, 4], "x")
    cc.close()
    for salt in (None, "y", ""):
        assert cc.match(np.asarray([1, 2]), 8, salt)[0] == 0
    assert cc.match(np.asarray([1, 2]), 8, "x")[0] == 2
    cc.append([1, 2, 5], None)
    assert cc.match(np.asarray([1, 2]), 8, None)[1].tolist() == [7]
    with pytest.raises(TypeError):
        cc.match(np.asarray([1, 2]), 8, [])  # salts are hashable


@needs_native
def test_match_on_a_list_and_on_int32_arrays():
    cc = native.TokenStore(64, 2, True)
    cc.append(np.asarray([4, 5, 6, 4, 5, 7], dtype=np.int32))
    for context in ([9, 4, 5], np.asarray([9, 4, 5], dtype=np.int32), (9, 4, 5)):
        length, at = cc.match(context, 8)
        assert length == 2 and at.tolist() == [2, 5]


@needs_native
@pytest.mark.parametrize("bad", [[-1], [1 << 24], [3, 1 << 40]])
def test_token_ids_out_of_range_change_nothing(bad):
    py, cc = suffix.TokenStore(16, 2, ring=True), native.TokenStore(16, 2, True)
    py.append([1, 2, 3]), cc.append([1, 2, 3])
    with pytest.raises(ValueError, match="token ids"):
        py.append(bad)
    with pytest.raises(ValueError, match="token ids"):
        cc.append(bad)
    same_state(py, cc)


@needs_native
@pytest.mark.parametrize(("capacity", "k"), [(1, 2), (0, 1), (16, 0), (-3, -1)])
def test_bad_capacity_or_k(capacity, k):
    with pytest.raises(ValueError, match="capacity must be >= 2 and k >= 1"):
        native.TokenStore(capacity, k, True)
    with pytest.raises(ValueError, match="capacity must be >= 2 and k >= 1"):
        suffix.TokenStore(capacity, k, ring=True)


@dataclass(frozen=True)
class Spec:
    suffix_min_token_prob: float
    suffix_max_spec_factor: float


def rows_with_ties(rng: np.random.Generator) -> np.ndarray:
    """Continuations as `continuations` gives them: few distinct tokens, repeated rows, SENTINEL to the end."""
    alphabet = int(rng.integers(1, 5))
    rows = rng.integers(0, alphabet + 1, size=(int(rng.integers(0, 40)), int(rng.integers(0, 9))), dtype=np.int32)
    if len(rows) and rng.random() < 0.5:  # whole rows repeated
        rows = rows[rng.integers(0, len(rows), size=len(rows))]
    rows[rng.random(rows.shape) < 0.1] = suffix.SENTINEL
    rows[np.maximum.accumulate(rows == suffix.SENTINEL, axis=1)] = suffix.SENTINEL
    return rows


@needs_native
@pytest.mark.parametrize("seed", range(300))
def test_draft_nodes_equals_the_reference(seed):
    rng = np.random.default_rng(seed)
    rows = rows_with_ties(rng)
    spec = Spec(float(rng.choice([0.0, 0.05, 0.1, 0.25, 1 / 3, 0.5, 1.0])), float(rng.choice([0.5, 1.0, 1.5, 3.0])))
    match_len, ndt, root = int(rng.integers(0, 8)), int(rng.integers(0, 24)), int(rng.integers(0, 9))
    want = suffix.draft_nodes(root, rows, match_len, ndt, spec)
    got = native.draft_nodes(root, rows, match_len, ndt, spec.suffix_min_token_prob, spec.suffix_max_spec_factor)
    assert (got[0], got[1]) == (want[0], want[1])
    assert got[2] == want[2]  # the same division of the same ints


@needs_native
def test_draft_nodes_breaks_ties_by_the_newest_row():
    rows = np.array([[1, 2], [3, 4], [5, 6], [3, 9]], dtype=np.int32)  # newest last
    tokens, parents, score = native.draft_nodes(0, rows, 2, 16, 0.0, 1.0)
    # 3 twice, then 5 (the newer row) before 1; below them 9, 6, 4, 2 newest first
    assert tokens == [0, 3, 5, 1, 9, 6, 4, 2] and parents == [-1, 0, 0, 0, 1, 2, 1, 3]
    assert (tokens, parents, score) == suffix.draft_nodes(0, rows, 2, 16, Spec(0.0, 1.0))


@dataclass
class Seq:
    request_id: str
    token_ids: list[int]
    cache_salt: str | None = None
    slot: int = 0
    cache_len: int = 0


def same_tree(got: DraftTree, want: DraftTree) -> None:
    """Every field the same, dtype and shape included (the C++ path lays out what `from_parents` does)."""
    for f in fields(DraftTree):
        a, b = getattr(got, f.name), getattr(want, f.name)
        assert a.dtype == b.dtype and a.shape == b.shape and a.is_contiguous() and torch.equal(a, b), f.name


@needs_native
@pytest.mark.parametrize("seed", range(6))
def test_drafters_draft_the_same_trees(seed):
    """A stream of requests through a small shared ring, several salts, drafting every step at
    several tree sizes: the same trees and scores, and the same shared store."""
    rng = np.random.default_rng(seed)
    spec = SpecConfig(algorithm="suffix", suffix_cache_tokens=int(rng.choice([40, 300, 5000])),
                      suffix_min_match=int(rng.integers(1, 4)), suffix_max_depth=int(rng.integers(4, 12)),
                      suffix_min_token_prob=float(rng.choice([0.0, 0.1, 0.3])),
                      suffix_max_spec_factor=float(rng.choice([0.5, 1.0, 2.0])))
    py = suffix.SuffixDrafter(DraftPlan.of(spec), native=False)
    cc = suffix.SuffixDrafter(DraftPlan.of(spec), native=True)
    assert cc.native and not py.native
    templates = [rng.integers(0, 6, size=30).tolist() for _ in range(3)]
    running: dict[str, Seq] = {}
    for step in range(300):
        if len(running) < 4:
            template = templates[int(rng.integers(0, 3))]
            start = template[: int(rng.integers(1, 12))] + rng.integers(0, 6, size=int(rng.integers(0, 4))).tolist()
            running[f"r{step}"] = Seq(f"r{step}", start, [None, "a", "b"][int(rng.integers(0, 3))])
        for seq in running.values():
            ndt = int(rng.integers(1, 12))
            (want, want_score), (got, got_score) = py.propose_scored(seq, ndt), cc.propose_scored(seq, ndt)
            same_tree(got, want)
            assert got_score == want_score
        for seq in running.values():
            template = templates[int(rng.integers(0, 3))]
            at = int(rng.integers(0, len(template) - 4))
            seq.token_ids = seq.token_ids + template[at : at + int(rng.integers(1, 5))]
        py.on_accept(list(running.values()), None, None)
        cc.on_accept(list(running.values()), None, None)
        for request_id in [r for r in running if rng.random() < 0.05]:
            del running[request_id]
            py.release(request_id), cc.release(request_id)
        same_state(py.shared, cc.shared)
    assert cc.cached_tokens == py.cached_tokens


def test_the_drafter_falls_back_to_the_python_store(monkeypatch, caplog):
    def no_compiler(*args: object, **kwargs: object) -> None:
        raise RuntimeError("no g++")

    monkeypatch.setattr(suffix_store, "_module", None)  # not loaded yet in this process
    monkeypatch.setattr(suffix_store.cpp_build, "build", no_compiler)
    plan = DraftPlan.of(SpecConfig(algorithm="suffix"))
    d = suffix.SuffixDrafter(plan)
    assert not d.native and isinstance(d.shared, suffix.TokenStore) and "no g++" in caplog.text
    with pytest.raises(RuntimeError, match="not built"):
        suffix.SuffixDrafter(plan, native=True)
    # [1 2] matched 2 in its own text: 2 deep
    assert d.propose_scored(Seq("a", [1, 2, 3, 1, 2]), 8)[0].tokens.tolist() == [2, 3, 1]
