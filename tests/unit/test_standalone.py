"""Standalone drafting on a tiny random target: the target as its own draft model accepts every
draft (proves the draft cache's catch-up and scratch masking), a self-speculative prefix of its
layers is lossless, and a foreign vocabulary is refused."""

from __future__ import annotations

import pytest
import torch

from specserve.config import EngineConfig, SamplingParams, SpecConfig
from specserve.engine.engine import Engine
from specserve.tree import DraftShape


def _engine(tiny_target_dir, algorithm="none", batch=2, **spec):
    return Engine(EngineConfig(model_dir=str(tiny_target_dir), device="cpu", dtype="float32", cpu_compile=False,
                               max_batch_size=batch, max_seq_len=256, spec=SpecConfig(algorithm=algorithm, **spec)))


def _prompts():
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, 49152, (n,), generator=g).tolist() for n in (6, 21, 11)]


@pytest.mark.parametrize(("steps", "topk", "ndt"), [(4, 1, 5), (3, 2, 16)])  # 16: every drafted node is kept
def test_target_as_its_own_draft_accepts_everything(tiny_target_dir, steps, topk, ndt):
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    ref = _engine(tiny_target_dir).generate(_prompts(), params)
    eng = _engine(tiny_target_dir, "standalone", drafter_path=str(tiny_target_dir), num_steps=steps, topk=topk,
                  num_draft_tokens=ndt)
    outs = eng.generate(_prompts(), params)
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    for o in outs:  # every step but the budget-trimmed last accepts the whole best path
        assert all(n == steps + 1 for n in o.accept_lengths[:-1]), o.accept_lengths


def test_self_speculative_first_layers_is_lossless(tiny_target_dir):
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    ref = _engine(tiny_target_dir).generate(_prompts(), params)
    eng = _engine(tiny_target_dir, "standalone", standalone_num_layers=3, num_steps=3, topk=2, num_draft_tokens=6)
    assert eng.drafter.model.layers[0] is eng.model.layers[0]  # shared modules, no extra weights
    outs = eng.generate(_prompts(), params)
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]


def test_bad_draft_models_are_refused(tiny_target_dir, tiny_llama_factory):
    with pytest.raises(ValueError, match="standalone_num_layers"):
        _engine(tiny_target_dir, "standalone", standalone_num_layers=99)
    other = tiny_llama_factory(vocab_size=97, num_layers=2)
    with pytest.raises(ValueError, match="drafter_path: draft vocabulary"):
        _engine(tiny_target_dir, "standalone", drafter_path=str(other))


def test_every_draft_model_forward_runs_through_its_runner(tiny_target_dir):
    """The catch-ups over prompt chunks and the drafts' forwards are `DraftModelRunner.hidden`
    calls, one per forward the drafter counts, and the draft model runs no layers outside them."""
    eng = _engine(tiny_target_dir, "standalone", standalone_num_layers=3, num_steps=3, topk=2, num_draft_tokens=6)
    drafter, runner = eng.drafter, eng.drafter.runner
    calls = {"hidden": 0, "layers_inside": 0, "layers_outside": 0}
    inside = [False]

    def counted(name):
        method = getattr(runner, name)

        def run(*args, **kwargs):
            calls[name] += 1
            inside[0] = True
            try:
                return method(*args, **kwargs)
            finally:
                inside[0] = False

        return run

    run_layers = drafter.model.run_layers

    def layers(*args, **kwargs):
        calls["layers_inside" if inside[0] else "layers_outside"] += 1
        return run_layers(*args, **kwargs)

    runner.hidden = counted("hidden")
    drafter.model.run_layers = layers
    outs = eng.generate(_prompts(), SamplingParams(max_tokens=12, ignore_eos=True))
    assert all(len(o.token_ids) == 12 for o in outs)
    # each prompt cached with its prefill, then per draft a catch-up and num_steps - 1 beam steps
    assert calls["hidden"] >= len(outs) + 3
    assert calls["layers_outside"] == 0
    assert calls["layers_inside"] == calls["hidden"] == drafter.num_forwards


@pytest.mark.parametrize("drafting", [False, True])
def test_a_prompt_waits_for_the_first_draft_while_the_chooser_decodes_plainly(tiny_target_dir, drafting):
    """While plain decoding is the chooser's best, a prompt's prefill runs no draft-model forward
    and the first draft's catch-up covers the whole prompt (the answers stay the target's); while a
    draft is, the prefill caches the prompt's draft K/V as it goes."""
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    ref = _engine(tiny_target_dir).generate(_prompts(), params)
    eng = _engine(tiny_target_dir, "standalone", drafter_path=str(tiny_target_dir), num_steps=3, topk=1,
                  num_draft_tokens=4)
    draft = eng.chooser.menu[-1]
    eng.chooser.best = lambda batch_size: draft if drafting else DraftShape(1, 0, 1)
    eng.chooser.choose = lambda batch_size: draft  # every step drafts
    prefilled = []
    on_prefill = eng.drafter.on_prefill
    eng.drafter.on_prefill = lambda seqs, *args: (prefilled.extend(s.slot for s in seqs), on_prefill(seqs, *args))
    outs = eng.generate(_prompts(), params)
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    assert len(prefilled) == (len(outs) if drafting else 0)  # one chunk per prompt
    for o in outs:  # the target drafts for itself: every step accepts the whole chain, caught up or not
        assert all(n == 4 for n in o.accept_lengths[:-1]), o.accept_lengths
