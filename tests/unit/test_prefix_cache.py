"""The prefix cache's choices (slot matching, LRU hand-out, the eviction bound), its knobs, the
Prometheus series and the response output that report it. No model: a small KV cache of slots."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_triton_model import FakeFamily, triton_model  # noqa: F401 - the fake Triton backend's fixture

from specserve.config import EngineConfig
from specserve.engine.prefix_cache import PrefixCache, RunningRows, common_prefix
from specserve.model_config import ModelConfig
from specserve.models.kv_cache import KVCache
from specserve.runtime.prefill import PackedPrompts, PromptChunk, split_packs

CFG = ModelConfig(vocab_size=32, hidden_size=8, intermediate_size=16, num_layers=2, num_heads=2, num_kv_heads=1,
                  head_dim=4, rms_norm_eps=1e-5, rope_theta=1e4, max_position_embeddings=64, tie_word_embeddings=True)


def prefix_cache(slots: int = 4, **kw) -> PrefixCache:
    return PrefixCache(KVCache(CFG, slots, 64, torch.float32, "cpu"), **kw)


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 3, 4]) == 3
    assert common_prefix([1, 2, 3, 4], [1, 2, 9, 4]) == 2
    assert common_prefix([5], [6]) == 0
    assert common_prefix([], [1]) == 0
    assert common_prefix(list(range(1000)), list(range(999)) + [0]) == 999
    assert common_prefix([1, 2, 3], [1, 2, 3], limit=2) == 2
    for n in range(1, 40):  # the binary search finds every mismatch position
        a = list(range(40))
        b = a[:n] + [-1] + a[n + 1 :]
        assert common_prefix(a, b) == n


def test_a_miss_takes_the_lowest_empty_slot_then_the_least_recently_used():
    pc = prefix_cache(3)
    slots = [pc.place([i, 100, 101]).slot for i in range(3)]
    assert slots == [0, 1, 2]
    pc.release(1, [1, 100])
    pc.release(0, [0, 100])
    pc.release(2, [2, 100])
    assert pc.cached_tokens == 6
    miss = pc.place([9, 9, 9])
    assert (miss.slot, miss.reused) == (1, 0)  # slot 1 was released first
    assert 1 not in pc.contents and pc.cached_tokens == 4


def test_a_continued_free_slot_is_taken_as_is():
    pc = prefix_cache()
    first = pc.place([1, 2, 3])
    pc.place([7, 7])  # another request elsewhere
    pc.release(first.slot, [1, 2, 3, 4, 5])  # prompt + answer, below cache_len
    second = pc.place([1, 2, 3, 4, 5, 6, 7])
    assert second == type(second)(slot=first.slot, source=first.slot, reused=5)


def test_the_last_prompt_token_is_never_reused():
    pc = prefix_cache()
    pc.release(pc.place([1, 2, 3]).slot, [1, 2, 3])
    again = pc.place([1, 2, 3])
    assert again.reused == 2 and again.source == again.slot  # the whole content matched: in place
    pc2 = prefix_cache()
    pc2.release(pc2.place([1]).slot, [1])
    assert pc2.place([1]).reused == 0


def test_a_partly_matched_free_slot_is_copied_from_and_keeps_its_content():
    pc = prefix_cache(3)
    a = pc.place([1, 2, 3, 4])
    pc.release(a.slot, [1, 2, 3, 4, 5, 6])
    b = pc.place([1, 2, 3, 9, 9])
    assert b.source == a.slot and b.slot != a.slot and b.reused == 3
    assert pc.contents[a.slot] == [1, 2, 3, 4, 5, 6]  # still there for a second turn of A
    # with no other free slot, the partly matched one is the least recently used: taken as is
    pc.place([5, 5])
    c = pc.place([1, 2, 8])
    assert (c.slot, c.source, c.reused) == (a.slot, a.slot, 2)


def test_a_running_request_shares_its_rows_below_its_cache_len():
    pc = prefix_cache()
    running = pc.place([1, 2, 3, 4, 5, 6])
    rows = RunningRows(running.slot, [1, 2, 3, 4, 5, 6, 7], cache_len=4)
    got = pc.place([1, 2, 3, 4, 5, 6, 9], [rows])
    assert got.source == running.slot and got.slot != running.slot and got.reused == 4
    # a free slot's longer match wins; on a tie the free slot (nothing running is read)
    pc.release(got.slot, [1, 2, 3, 4, 5])
    tie = pc.place([1, 2, 3, 4, 5, 0], [RunningRows(running.slot, [1, 2, 3, 4, 5, 6], 6)])
    assert tie.source == got.slot and tie.reused == 5


def test_the_bound_truncates_then_forgets_the_least_recently_used():
    pc = prefix_cache(4, max_cached_tokens=8)
    for i in range(4):
        pc.place([i])
    pc.release(0, [0, 1, 2, 3])
    pc.release(1, [1, 1, 1, 1])
    assert pc.cached_tokens == 8
    pc.release(2, [2, 2, 2])  # 11 > 8: slot 0 (least recent) loses its last 3 tokens
    assert pc.contents == {0: [0], 1: [1, 1, 1, 1], 2: [2, 2, 2]} and pc.cached_tokens == 8
    pc.release(3, [3, 3])  # 10 > 8: slot 0 goes, then slot 1 loses a token
    assert pc.contents == {1: [1, 1, 1], 2: [2, 2, 2], 3: [3, 3]} and pc.cached_tokens == 8


def test_a_zero_bound_keeps_nothing_free_and_disabled_reuses_nothing():
    pc = prefix_cache(max_cached_tokens=0)
    a = pc.place([1, 2, 3])
    pc.release(a.slot, [1, 2, 3])
    assert pc.contents == {} and pc.cached_tokens == 0
    off = prefix_cache(enabled=False)
    a = off.place([1, 2, 3])
    off.release(a.slot, [1, 2, 3])
    again = off.place([1, 2, 3, 4])
    assert (again.slot, again.reused) == (0, 0) and off.contents == {}


def test_forget_clears_the_contents():
    pc = prefix_cache()
    pc.release(pc.place([1, 2]).slot, [1, 2])
    pc.forget()
    assert pc.contents == {} and pc.cached_tokens == 0 and pc.place([1, 2, 3]).reused == 0


def test_kv_cache_copy_prefix_and_allocate_a_given_slot():
    cache = KVCache(CFG, 3, 8, torch.float32, "cpu")
    cache.data.normal_()
    before = cache.data.clone()
    cache.copy_prefix(0, 2, 5)
    assert torch.equal(cache.data[:, :, 2, :, :5], before[:, :, 0, :, :5])
    assert torch.equal(cache.data[:, :, 2, :, 5:], before[:, :, 2, :, 5:])
    assert cache.allocate(1) == 1 and cache.free_slots == [0, 2] and cache.allocate() == 0


def test_packing_chunks():
    chunks = [PromptChunk(0, 0, (1, 2, 3)), PromptChunk(3, 10, (4,)), PromptChunk(1, 5, (5, 6))]
    packed = PackedPrompts.of(chunks)
    assert packed.offsets == (0, 3, 4, 6) and packed.num_tokens == 6 and packed.last_columns == [2, 3, 5]
    assert packed.columns(2) == slice(4, 6) and chunks[1].end == 11
    assert [p.offsets for p in split_packs(chunks, 4)] == [(0, 3, 4), (0, 2)]
    assert [len(p.chunks) for p in split_packs([PromptChunk(0, 0, (1,) * 9)], 4)] == [1]  # a long chunk alone


# ---- knobs ------------------------------------------------------------------------------------


def test_knob_defaults_and_validation():
    cpu = EngineConfig(model_dir="m", device="cpu")
    assert cpu.enable_prefix_caching and cpu.prefix_cache_max_tokens is None and cpu.max_num_batched_tokens is None
    assert cpu.prompt_tokens_per_step == 512
    assert EngineConfig(model_dir="m", device="cuda").prompt_tokens_per_step == 8192
    assert EngineConfig(model_dir="m", device="cpu", max_num_batched_tokens=0).prompt_tokens_per_step == 0
    with pytest.raises(ValueError, match="^max_num_batched_tokens"):
        EngineConfig(model_dir="m", device="cpu", max_num_batched_tokens=-1)
    with pytest.raises(ValueError, match="^prefix_cache_max_tokens"):
        EngineConfig(model_dir="m", device="cpu", prefix_cache_max_tokens=-5)
    assert cpu.prefill_stall_steps == 3.0
    with pytest.raises(ValueError, match="^prefill_stall_steps: must be >= 0"):
        EngineConfig(model_dir="m", device="cpu", prefill_stall_steps=-1)


def test_knobs_are_config_parameters_and_flags():
    from specserve.serving.parameters import engine_config_from_parameters

    cfg = engine_config_from_parameters({"enable_prefix_caching": "false", "max_num_batched_tokens": "64",
                                         "prefix_cache_max_tokens": "1000", "prefill_stall_steps": "1.5",
                                         "device": "cpu"})
    assert (cfg.enable_prefix_caching, cfg.max_num_batched_tokens, cfg.prefix_cache_max_tokens) == (False, 64, 1000)
    assert cfg.prefill_stall_steps == 1.5
    assert engine_config_from_parameters({"device": "cpu"}).prompt_tokens_per_step == 512
    with pytest.raises(ValueError, match="^max_num_batched_tokens: expected an integer"):
        engine_config_from_parameters({"max_num_batched_tokens": "many"})


# ---- what serving reports -----------------------------------------------------------------------


def test_responses_carry_num_cached_tokens():
    from specserve.serving.contract import OUTPUTS, ResponseDelta, output_arrays

    assert OUTPUTS["num_cached_tokens"] == "UINT32"
    arrays = output_arrays(ResponseDelta(text="x", token_ids=[1], finish_reason=None, num_input_tokens=40,
                                         num_output_tokens=1, num_draft_tokens=0, num_accepted_tokens=0,
                                         num_verify_steps=0, num_cached_tokens=31))
    assert arrays["num_cached_tokens"].dtype == np.uint32 and arrays["num_cached_tokens"].tolist() == [31]


def test_prefix_metrics_follow_the_engine_load(triton_model):  # noqa: F811
    from specserve.engine.outputs import EngineLoad
    from specserve.serving.metrics import ServingMetrics

    FakeFamily.created.clear()
    m = ServingMetrics("m", "1")

    def values(name: str) -> list[float]:
        return FakeFamily.created["specserve:" + name].metrics[0][1].values

    m.set_load(EngineLoad(0, 1, 1, prefix_cache_tokens=50, prompt_tokens_reused=30, prompt_tokens_computed=70))
    m.set_load(EngineLoad(0, 1, 1, prefix_cache_tokens=20, prompt_tokens_reused=30, prompt_tokens_computed=75))
    # a new engine
    m.set_load(EngineLoad(0, 0, 0, prefix_cache_tokens=0, prompt_tokens_reused=4, prompt_tokens_computed=6))
    assert values("prefix_cache_tokens") == [50.0, 20.0, 0.0]
    assert values("prompt_tokens_cached_total") == [30.0, 4.0]
    assert values("prompt_tokens_computed_total") == [70.0, 5.0, 6.0]


def test_prefixes_are_shared_only_within_one_cache_salt():
    pc = prefix_cache(3)
    prompt = [1, 2, 3, 4, 5]
    slot = pc.place(prompt, salt="alice").slot
    pc.release(slot, prompt, salt="alice")
    assert pc.place(prompt + [6], salt="bob").reused == 0
    assert pc.place(prompt + [6]).reused == 0  # no salt is a salt of its own
    assert pc.place(prompt + [6], salt="alice").reused == 5
    pc = prefix_cache(3)
    running = [RunningRows(pc.place(prompt, salt="alice").slot, prompt, 5, salt="alice")]
    assert pc.place(prompt + [7], running, salt="bob").reused == 0
    assert pc.place(prompt + [7], running, salt="alice").reused == 5
