"""`Verifier`'s host path for plainly greedy CPU rows against its general path (the one a GPU runs)."""

from types import SimpleNamespace

import pytest
import torch

from specserve.config import SamplingParams
from specserve.engine.verification import Verifier
from specserve.tree import DraftTree, TreeBatch


def request(**params: object) -> SimpleNamespace:
    """What verification reads of a request."""
    return SimpleNamespace(params=SamplingParams(max_tokens=64, **params), grammar=None, num_output_tokens=3,
                           token_ids=list(range(10, 30)), prompt_ids=list(range(10, 20)), generator=None)


def random_tree(gen: torch.Generator, vocab: int) -> DraftTree:
    """Up to 9 nodes, parents before children, tokens from a small vocabulary (siblings may repeat a token)."""
    n = int(torch.randint(1, 10, (1,), generator=gen))
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]
    return DraftTree.from_parents(torch.randint(0, vocab, (n,), generator=gen).tolist(), parents)


def both_paths(monkeypatch: pytest.MonkeyPatch, reqs: list, batch: TreeBatch, logits: torch.Tensor,
               cache: torch.Tensor, lens: torch.Tensor) -> tuple:
    """(host path's Verified, its cache; general path's Verified, its cache), each from the same cache."""
    out = []
    for on_host in (True, False):
        with monkeypatch.context() as m:
            if not on_host:
                m.setattr(Verifier, "_verifies_on_host", staticmethod(lambda reqs, device: False))
            kv = cache.clone()
            out += [Verifier((0,), torch.device("cpu")).accept(reqs, batch, logits.clone(), kv,
                                                                torch.arange(len(reqs)), lens), kv]
    return tuple(out)


@pytest.mark.parametrize("seed", range(8))
def test_the_host_path_verifies_as_the_general_path(monkeypatch, seed):
    gen = torch.Generator().manual_seed(seed)
    vocab = 6  # few tokens: drafts often match the argmax, so paths run deep and branch
    trees = [random_tree(gen, vocab) for _ in range(int(torch.randint(1, 5, (1,), generator=gen)))]
    batch = TreeBatch.from_trees(trees)
    b, n = batch.tokens.shape
    logits = torch.randn(b, n, vocab, generator=gen)
    logits[0, 0, 3] = float("nan")  # argmax's semantics: NaN counts as the largest
    cache = torch.randn(2, 2, b, 1, 24, 4, generator=gen)  # (L, 2, slots, Hkv, S, D)
    lens = torch.randint(0, 8, (b,), generator=gen)
    reqs = [request() for _ in range(b)]
    assert Verifier._verifies_on_host(reqs, torch.device("cpu"))
    host, host_kv, general, general_kv = both_paths(monkeypatch, reqs, batch, logits, cache, lens)
    assert host.emitted == general.emitted and host.accepted == general.accepted
    assert host.tree_sizes == general.tree_sizes and host.logprobs == general.logprobs
    for field in ("accepted_nodes", "accept_length", "bonus_tokens"):
        assert torch.equal(getattr(host.result, field), getattr(general.result, field)), field
    assert torch.equal(host_kv, general_kv)  # compacted alike (left alone where every path is a chain)
    assert all(len(e) == len(a) for e, a in zip(host.emitted, host.accepted))


def test_a_branch_accepted_off_the_chain_is_compacted(monkeypatch):
    tree = DraftTree.from_parents([5, 1, 2], [-1, 0, 0])  # root, then two children: 1 and 2
    logits = torch.zeros(1, 3, 4)
    logits[0, 0, 2] = logits[0, 2, 3] = 1.0  # the target takes child 2 (node 2), then 3: bonus
    cache = torch.arange(2 * 2 * 1 * 1 * 8 * 1, dtype=torch.float32).reshape(2, 2, 1, 1, 8, 1)
    host, host_kv, general, general_kv = both_paths(monkeypatch, [request()], TreeBatch.from_trees([tree]), logits,
                                                    cache, torch.tensor([2]))
    assert host.emitted == [[2, 3]] and host.accepted == [[0, 2]] == general.accepted
    assert torch.equal(host_kv, general_kv) and not torch.equal(host_kv, cache)
    assert torch.equal(host_kv[..., 3, :], cache[..., 4, :])  # node 2's K/V (at 2 + 2) moved to position 3


@pytest.mark.parametrize("params", [dict(temperature=0.7), dict(repetition_penalty=1.2), dict(logprobs=2),
                                    dict(min_tokens=10)])
def test_rows_that_change_their_logits_take_the_general_path(params):
    cpu = torch.device("cpu")
    assert not Verifier._verifies_on_host([request(), request(**params)], cpu)
    assert Verifier._verifies_on_host([request(min_tokens=3)], cpu)  # min_tokens already reached
    assert not Verifier._verifies_on_host([request()], torch.device("meta"))  # a GPU reads its device once
    with_grammar = request()
    with_grammar.grammar = object()
    assert not Verifier._verifies_on_host([with_grammar], cpu)
