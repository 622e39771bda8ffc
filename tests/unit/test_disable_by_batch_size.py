"""`disable_by_batch_size`: steps with that many requests decode without drafts; the drafter keeps
following every accept, so drafting resumes losslessly when the batch shrinks."""

from __future__ import annotations

import pytest
import torch

from specserve.config import EngineConfig, SamplingParams, SpecConfig
from specserve.engine.engine import Engine


def _engine(tiny_target_dir, algorithm, **spec):
    return Engine(EngineConfig(model_dir=str(tiny_target_dir), device="cpu", dtype="float32", cpu_compile=False,
                               max_batch_size=4, max_seq_len=256, spec=SpecConfig(algorithm=algorithm, **spec)))


@pytest.mark.parametrize("algorithm", ["ngram", "eagle3"])
def test_big_batches_decode_plainly_and_small_ones_draft(tmp_path, tiny_target_dir, algorithm):
    from test_eagle import write_checkpoint  # tests/unit is on sys.path

    spec = {"num_draft_tokens": 6} if algorithm == "ngram" else {
        "drafter_path": str(write_checkpoint(tmp_path / "e3", "eagle3")), "num_steps": 3, "topk": 2,
        "num_draft_tokens": 6}
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 400, (n,), generator=g).tolist() * 3 for n in (4, 7, 5, 9)]  # repetitive: ngram drafts
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (8, 12, 30, 40)]  # the batch shrinks 4 -> 1
    eng = _engine(tiny_target_dir, algorithm, disable_by_batch_size=3, **spec)
    batch_sizes, propose = [], eng.drafter.propose
    eng.drafter.propose = lambda seqs, shape: batch_sizes.append(len(seqs)) or propose(seqs, shape)
    ids = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    while eng.has_work():
        for o in eng.step():
            tokens[o.request_id] += o.token_ids  # deltas
    assert batch_sizes and max(batch_sizes) <= 2  # 4 and 3 running: no drafts asked for
    ref = _engine(tiny_target_dir, "none")
    for rid, p, sp in zip(ids, prompts, params):
        assert tokens[rid] == ref.generate([p], sp)[0].token_ids


def test_disable_by_batch_size_must_not_be_negative():
    with pytest.raises(ValueError, match="disable_by_batch_size"):
        SpecConfig(algorithm="ngram", disable_by_batch_size=-1)
