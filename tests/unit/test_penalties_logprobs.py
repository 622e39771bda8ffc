"""Penalties and logprobs: the per-node arithmetic against a direct reference, and speculative
engines (float32) giving plain decoding's outputs and logprobs with them on."""

from __future__ import annotations

import pytest
import torch

from specserve.config import EngineConfig, SamplingParams, SpecConfig
from specserve.engine.engine import Engine
from specserve.engine.sampling import apply_penalties, greedy_tokens, token_logprobs
from specserve.tree import DraftTree


def _reference(logits: torch.Tensor, context: list[int], num_prompt: int, params: SamplingParams) -> torch.Tensor:
    """vLLM's order on one position, written out token by token."""
    out = logits.clone()
    output = context[num_prompt:]
    for t in set(context):
        if params.repetition_penalty != 1.0:
            out[t] = out[t] / params.repetition_penalty if out[t] > 0 else out[t] * params.repetition_penalty
    for t in set(output):
        out[t] -= params.frequency_penalty * output.count(t) + params.presence_penalty
    return out


def test_greedy_tokens_are_argmax_with_its_ties_and_non_finite_values():
    """The first largest index, as argmax: ties, NaN (argmax's largest), infinities, a whole row of -inf."""
    x = torch.randn(6, 3, 49152, generator=torch.Generator().manual_seed(0))
    x[:, :, 100] = x[:, :, 30000] = 9.0  # a tie: the first wins
    x[0, 0, 7] = 9.0
    x[1, 1, 500] = x[1, 1, 40000] = float("nan")
    x[2, 2] = float("-inf")
    x[3, 0, 1] = x[3, 0, 2] = float("inf")
    got = greedy_tokens(x)
    assert got.dtype == torch.int64 and torch.equal(got, x.argmax(-1))
    assert got[0, 0] == 7 and got[0, 1] == 100 and got[1, 1] == 500 and got[2, 2] == 0 and got[3, 0] == 1
    view = x[:, 1:]  # a step program's logits cut to the real tokens: strided rows
    assert torch.equal(greedy_tokens(view), view.argmax(-1)) and torch.equal(greedy_tokens(x[4, 2]), x[4, 2].argmax())
    assert torch.equal(greedy_tokens(x.bfloat16()), x.bfloat16().argmax(-1))  # other dtypes: torch's max


def test_penalties_at_each_tree_node_equal_plain_decoding_at_that_point():
    g = torch.Generator().manual_seed(0)
    vocab = 50
    prompt, output = [3, 4, 5, 3], [7, 7, 9]  # the root (9) is the last output token
    # root 9 -> a(7) -> b(11); root -> c(4)
    tree = DraftTree.from_parents([9, 7, 11, 4], [-1, 0, 1, 0])
    logits = torch.randn(4, vocab, generator=g)
    params = SamplingParams(frequency_penalty=0.4, presence_penalty=0.3, repetition_penalty=1.3)
    got = logits.clone()
    apply_penalties(got, params, prompt + output, len(prompt), tree.tokens, tree.mask)
    paths = {0: [], 1: [7], 2: [7, 11], 3: [4]}  # drafts on each node's path, itself included
    for node, path in paths.items():
        expected = _reference(logits[node], prompt + output + path, len(prompt), params)
        torch.testing.assert_close(got[node], expected)
    untouched = logits.clone()
    apply_penalties(untouched, SamplingParams(), prompt + output, len(prompt), tree.tokens, tree.mask)
    assert torch.equal(untouched, logits)


def test_token_logprobs_ranks_and_alternatives():
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0], [3.0, 0.0, 0.0, 0.0]])
    out = token_logprobs(logits, [2, 0], top_n=2)
    logp = torch.log_softmax(logits, -1)
    assert set(out[0]) == {1, 2} and out[0][2] == pytest.approx((logp[0, 2].item(), 2))
    assert out[0][1][1] == 1
    assert out[1][0] == pytest.approx((logp[1, 0].item(), 1)) and len(out[1]) == 2  # chosen is also the top-1
    assert token_logprobs(logits, [3, 1], top_n=0) == [{3: pytest.approx((logp[0, 3].item(), 4))},
                                                        {1: pytest.approx((logp[1, 1].item(), 2))}]


def _engine(tiny_target_dir, algorithm: str, batch: int) -> Engine:
    return Engine(EngineConfig(model_dir=str(tiny_target_dir), device="cpu", dtype="float32", cpu_compile=False,
                               max_batch_size=batch, max_seq_len=256,
                               spec=SpecConfig(algorithm=algorithm, adaptive=False)))


PROMPTS = [[int(t) for t in torch.randint(3, 400, (n,), generator=torch.Generator().manual_seed(n))] * 3
           for n in (4, 7, 5)]


@pytest.mark.parametrize("algorithm", ["ngram", "standalone"])
def test_speculation_with_penalties_and_logprobs_equals_plain_decoding(tiny_target_dir, algorithm):
    # a negative frequency penalty favours repeats, so NGRAM's drafts still get accepted
    params = SamplingParams(max_tokens=24, ignore_eos=True, frequency_penalty=-0.5, presence_penalty=0.1,
                            repetition_penalty=1.1, logprobs=2)
    ref = _engine(tiny_target_dir, "none", 2).generate(PROMPTS, params)
    spec_engine = _engine(tiny_target_dir, algorithm, 2)
    outs = spec_engine.generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    assert sum(o.num_accepted_tokens for o in outs) > 0, "drafts were accepted: the tree path was exercised"
    for o, r in zip(outs, ref):
        assert len(o.logprobs) == len(o.token_ids)
        for tok, got, want in zip(o.token_ids, o.logprobs, r.logprobs):
            assert set(got) == set(want) and got[tok][1] == 1  # greedy: the chosen token ranks first
            for t in got:
                assert got[t][0] == pytest.approx(want[t][0], abs=1e-4)
        assert o.cumulative_logprob == pytest.approx(sum(lp[t][0] for t, lp in zip(o.token_ids, o.logprobs)), abs=1e-3)
    plain = _engine(tiny_target_dir, "none", 2).generate(PROMPTS, SamplingParams(max_tokens=24, ignore_eos=True))
    assert [o.token_ids for o in plain] != [r.token_ids for r in ref], "the penalties changed the output"
