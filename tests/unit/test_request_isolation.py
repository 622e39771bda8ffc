"""What one request does never reaches another inside the engine: a failure that belongs to one
request ends it alone, and requests of different cache salts never reuse each other's prefixes."""

from __future__ import annotations

import pytest

from specserve.config import EngineConfig, SamplingParams
from specserve.engine.engine import Engine
from specserve.engine.outputs import FINISH_ERROR, FINISH_LENGTH

PARAMS = SamplingParams(max_tokens=8, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13, 14]]


@pytest.fixture(scope="module")
def engine(tiny_target_dir) -> Engine:
    return Engine(EngineConfig(model_dir=str(tiny_target_dir), device="cpu", dtype="float32", cpu_compile=False,
                               max_batch_size=4, max_seq_len=128))


def test_a_detokenizer_failure_ends_its_request_alone(engine):
    alone = engine.generate([PROMPTS[1]], PARAMS)[0]
    engine.prefix_cache.forget()
    bad = engine.add_request(PROMPTS[0], PARAMS)
    good = engine.add_request(PROMPTS[1], PARAMS)
    (req,) = [r for r in engine.waiting if r.request_id == bad] or [r for r in engine._inbox if r.request_id == bad]

    def refuse(token_id: int) -> bool:
        raise Exception("Invalid prefix encountered")

    req.detokenizer.add = refuse
    outputs: dict[str, list] = {bad: [], good: []}
    while engine.has_work():
        for out in engine.step():
            outputs[out.request_id].append(out)
    assert [o.finished for o in outputs[bad]] == [True]
    assert outputs[bad][-1].finish_reason == FINISH_ERROR and "Invalid prefix" in outputs[bad][-1].error
    assert outputs[good][-1].finish_reason == FINISH_LENGTH and outputs[good][-1].error is None
    assert [t for o in outputs[good] for t in o.token_ids] == alone.token_ids


def test_requests_of_another_cache_salt_find_nothing_cached(engine):
    engine.prefix_cache.forget()
    prompt = PROMPTS[0] * 4
    first = engine.generate([prompt], SamplingParams(max_tokens=4, cache_salt="alice"))[0]
    again = prompt + first.token_ids + [20, 21]
    other, none, same = engine.generate(
        [again, again, again],
        [SamplingParams(max_tokens=4, cache_salt="bob"), SamplingParams(max_tokens=4),
         SamplingParams(max_tokens=4, cache_salt="alice")])
    assert other.num_cached_tokens == 0 and none.num_cached_tokens == 0
    assert same.num_cached_tokens >= len(prompt)
    assert other.token_ids == none.token_ids == same.token_ids  # salts change what is reused, not the answer
