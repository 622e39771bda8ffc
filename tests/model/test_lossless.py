"""Lossless: greedy speculative output equals greedy `none` output, token for token.

Run in fp32 on the real SmolLM2 over 20 MT-bench prompts at batch 8 and the first 8 of them at batch 1. (bf16 is not
batch-invariant on CPU: a different matmul shape can flip a near-tie; `specserve bench` reports the
bf16 match rate as `lossless`.)
"""

from __future__ import annotations

import pytest
import torch

from specserve.config import SamplingParams

MAX_TOKENS = 32
BATCH_1_PROMPTS = 8  # at batch 1 requests run one after another: the first 8 prompts (batch 8 takes all 20)
# the compiled engines take the e2e servers' slots and context, so they load the programs those compiled
SERVED_E2E = {"max_batch_size": 4, "max_seq_len": 512}


@pytest.fixture(scope="module")
def reference(engine, mtbench_prompts) -> list[list[int]]:
    return [o.token_ids for o in engine.generate(mtbench_prompts, SamplingParams(max_tokens=MAX_TOKENS))]


def cases(batch_size: int, prompts: list[list[int]], reference: list[list[int]]) -> tuple[list, list]:
    """The prompts a test at this batch size runs, and their reference outputs."""
    n = BATCH_1_PROMPTS if batch_size == 1 else len(prompts)
    return prompts[:n], reference[:n]


@pytest.mark.parametrize("batch_size", [1, 8])
@pytest.mark.parametrize(
    "spec",
    [
        dict(num_draft_tokens=12, ngram_min_match_window=1),
        dict(num_draft_tokens=4, ngram_match_type="PROB"),
        dict(num_draft_tokens=8, ngram_max_bfs_breadth=3),
    ],
    ids=["bfs-12-window1", "prob-4", "bfs-8-narrow"],
)
def test_ngram_greedy_is_lossless(engine_factory, mtbench_prompts, reference, batch_size, spec):
    engine = engine_factory(algorithm="ngram", max_batch_size=batch_size, **spec)
    prompts, expected = cases(batch_size, mtbench_prompts, reference)
    outs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))
    assert [o.token_ids for o in outs] == expected
    assert sum(o.num_accepted_tokens for o in outs) > 0  # drafts were really proposed and accepted


@pytest.mark.parametrize("batch_size", [1, 8])
@pytest.mark.parametrize("algorithm", ["suffix", "hybrid"])
def test_drafters_that_learn_are_lossless_as_their_store_fills(engine_factory, mtbench_prompts, reference,
                                                              batch_size, algorithm):
    """Suffix decoding (and the hybrid of EAGLE-3 and it) at the served tree size: the first pass
    drafts from each request's own tokens and the requests before it, the second from all of the
    first's text (long matches, deep trees). The size is pinned so that the acceptance compared
    depends on the text alone: the adaptive chooser's picks follow measured step times, and on a busy
    machine it may decode plainly for a whole pass (`test_adaptive_shapes_are_lossless` switches)."""
    from specserve.serving.repository import served_drafter

    engine = engine_factory(algorithm=algorithm, max_batch_size=batch_size, adaptive=False,
                            **served_drafter(algorithm))
    params = SamplingParams(max_tokens=MAX_TOKENS)
    prompts, expected = cases(batch_size, mtbench_prompts, reference)
    first = engine.generate(prompts, params)
    assert [o.token_ids for o in first] == expected
    second = engine.generate(prompts, params)
    assert [o.token_ids for o in second] == expected
    accepted = [sum(o.num_accepted_tokens for o in outs) for outs in (first, second)]
    assert 0 < accepted[0] < accepted[1]  # the text served before drafts
    if algorithm == "hybrid":  # both of its drafters drafted
        assert min(engine.drafter.mix().values()) > 0


@pytest.mark.parametrize("batch_size", [1, 8])
@pytest.mark.parametrize(
    ("algorithm", "spec"),
    [
        ("eagle", dict(num_steps=5, topk=4, num_draft_tokens=8)),
        ("eagle", dict(num_steps=4, topk=1)),
        ("eagle3", dict(num_steps=5, topk=4, num_draft_tokens=8)),
        ("eagle3", dict(num_steps=3, topk=2, num_draft_tokens=6)),
        ("mtp", dict(num_steps=1, topk=1, num_draft_tokens=2)),  # its default shape, pinned
        ("mtp", dict(num_steps=3, topk=2, num_draft_tokens=6)),  # the head reused for later steps
    ],
    ids=["eagle-5x4x8", "eagle-chain4", "eagle3-5x4x8", "eagle3-3x2x6", "mtp-1x1x2", "mtp-3x2x6"],
)
def test_model_drafter_greedy_is_lossless(engine_factory, mtbench_prompts, reference, batch_size, algorithm, spec):
    """The committed drafters for SmolLM2 (EAGLE-2 and MTP with their FR-Spec token maps, EAGLE-3)."""
    from specserve.serving.repository import served_drafter

    engine = engine_factory(algorithm=algorithm, max_batch_size=batch_size, **served_drafter(algorithm), **spec)
    prompts, expected = cases(batch_size, mtbench_prompts, reference)
    outs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))
    assert [o.token_ids for o in outs] == expected
    steps = sum(o.num_verify_steps for o in outs)
    # a trained drafter (an untrained head accepts almost nothing): EAGLE > 1.25 tokens per step; the
    # MTP head, trained on fewer tokens per parameter, > 1.2 (it measures 1.25-1.32, README)
    assert sum(o.num_accepted_tokens for o in outs) > steps // (5 if algorithm == "mtp" else 4)


def test_a_head_caught_up_at_its_first_draft_drafts_as_one_caught_up_at_prefill(engine_factory, mtbench_prompts,
                                                                                 reference):
    """A head that skips the prefill's catch-up (the hybrid's) runs it over the whole prompt at its
    first draft: the same outputs, and the same drafts accepted step by step."""
    from specserve.serving.repository import served_drafter

    engine = engine_factory(algorithm="eagle3", max_batch_size=1, adaptive=False, **served_drafter("eagle3"))
    prompts, expected = cases(1, mtbench_prompts, reference)
    prompts, expected = prompts[:3], expected[:3]
    runs = {}
    for at_prefill in (True, False):
        engine.drafter.catch_up_on_prefill = at_prefill
        engine.prefix_cache.forget()  # each pass prefills its prompts afresh
        outs = [engine.generate([p], SamplingParams(max_tokens=MAX_TOKENS))[0] for p in prompts]
        assert [o.token_ids for o in outs] == expected
        runs[at_prefill] = [o.accept_lengths for o in outs]
    assert runs[False] == runs[True]
    assert sum(sum(n) - len(n) for n in runs[False]) > 0  # the head's drafts were accepted


# suffix and the hybrid at batch 8 only: batch 1 runs them in the test above, at the served size
@pytest.mark.parametrize(
    ("algorithm", "batch_size"),
    [(a, b) for a in ("ngram", "eagle", "eagle3", "mtp") for b in (1, 8)] + [("suffix", 8), ("hybrid", 8)],
)
def test_adaptive_shapes_are_lossless(engine_factory, mtbench_prompts, reference, batch_size, algorithm):
    """The served default: each step's shape chosen by the cost model, switching shapes every other
    step (exploration forced), the EAGLE / MTP drafters catching up after plain steps."""
    from specserve.serving.repository import served_drafter

    engine = engine_factory(algorithm=algorithm, max_batch_size=batch_size, **served_drafter(algorithm))
    assert len(engine.chooser.menu) > 1
    engine.chooser.explore_every = 2
    prompts, expected = cases(batch_size, mtbench_prompts, reference)
    outs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))
    assert [o.token_ids for o in outs] == expected
    assert len(engine.chooser.chosen) >= 2


@pytest.fixture(scope="module")
def compiled_reference(engine_factory, mtbench_prompts) -> list[list[int]]:
    """`none` on the compiled target forward (as served on CPU)."""
    engine = engine_factory(cpu_compile=True, **SERVED_E2E)
    assert engine.runner.compiled is not None and engine.cache.data.dtype == torch.float16  # the served cache
    return [o.token_ids for o in engine.generate(mtbench_prompts, SamplingParams(max_tokens=MAX_TOKENS))]


@pytest.mark.parametrize("algorithm", ["ngram", "eagle", "eagle3", "mtp"])
def test_compiled_adaptive_is_lossless(engine_factory, mtbench_prompts, compiled_reference, algorithm):
    """The served default on CPU: compiled target and draft-head forwards, adaptive shapes switching
    every other step; equal to compiled `none` with 4 slots (the e2e servers' shape) and one request at a time."""
    from specserve.serving.repository import served_drafter

    engine = engine_factory(algorithm=algorithm, cpu_compile=True, **SERVED_E2E, **served_drafter(algorithm))
    assert engine.runner.compiled is not None
    assert algorithm == "ngram" or engine.drafter.runner.compiled is not None
    engine.chooser.explore_every = 2
    params = SamplingParams(max_tokens=MAX_TOKENS)
    assert [o.token_ids for o in engine.generate(mtbench_prompts, params)] == compiled_reference
    assert [engine.generate([p], params)[0].token_ids for p in mtbench_prompts[:8]] == compiled_reference[:8]
    assert len(engine.chooser.chosen) >= 2


@pytest.fixture(scope="module")
def structured_prompts(smollm2_dir) -> list[tuple[list[int], SamplingParams]]:
    """The structured-output benchmark's first 8 prompts, each with its JSON schema."""
    import json

    from tokenizers import Tokenizer

    from specserve.grammar import GrammarSpec
    from specserve.prepare import repo_root
    from specserve.prompts import load_questions, load_schemas, render_chat

    path = str(repo_root() / "bench" / "structured.jsonl")
    tok = Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    return [(tok.encode(render_chat(str(smollm2_dir), q), add_special_tokens=False).ids,
             SamplingParams(max_tokens=64, structured_output=GrammarSpec("json_schema", json.dumps(s))))
            for q, s in zip(load_questions(path, 8), load_schemas(path, 8))]


@pytest.fixture(scope="module")
def structured_reference(engine_factory, structured_prompts) -> list[list[int]]:
    """Plain decoding under each prompt's schema: masks alone, no forced text drafted."""
    engine = engine_factory(max_batch_size=4, structured_output_jump_forward=False)
    prompts, params = zip(*structured_prompts)
    return [o.token_ids for o in engine.generate(list(prompts), list(params))]


@pytest.mark.parametrize("algorithm", ["none", "ngram", "eagle", "eagle3", "mtp", "standalone"])
def test_greedy_under_a_json_schema_is_lossless(engine_factory, structured_prompts, structured_reference, algorithm):
    """Every method under a grammar, its forced text drafted beside the drafter's tree (`none`'s
    alone), adaptive shapes switching every other step: plain decoding's tokens under the schema."""
    from specserve.serving.repository import served_drafter

    engine = engine_factory(algorithm=algorithm, max_batch_size=4, **served_drafter(algorithm))
    engine.chooser.explore_every = 2
    prompts, params = zip(*structured_prompts)
    outs = engine.generate(list(prompts), list(params))
    assert [o.token_ids for o in outs] == structured_reference
    assert sum(o.num_accepted_tokens for o in outs) > 0  # forced text or drafts were accepted
