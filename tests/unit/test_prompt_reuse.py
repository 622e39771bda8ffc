"""Prefix reuse and chunked prefill on the float32 tiny target, every drafting method.

Greedy outputs and every draft a request is proposed must not depend on whether its prompt's prefix
came from the prefix cache (a free slot taken as it is, or rows copied from a finished or running
request's slot) or on how its prompt was cut into chunks (1, 7, 64 tokens a step, or whole). The
scenario has more requests than slots, prompts sharing a prefix, one arriving while the prompt it
shares was still being prefilled, and second turns (a first turn's prompt + answer + new text).
Where two runs differ, the message says where and the reference's top-2 logit gap there: a float
rounding between forwards of different shapes flips only a near tie, and is never hidden.
"""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from specserve.config import EngineConfig, SamplingParams, SpecConfig
from specserve.engine.engine import Engine
from specserve.models.kv_cache import KVCache
from specserve.tree import TreeBatch

VOCAB = 49152
SLOTS = 2
PARAMS = SamplingParams(max_tokens=10, ignore_eos=True)
SPECS = {
    "none": dict(),
    "ngram": dict(num_draft_tokens=6),
    "eagle": dict(num_steps=3, topk=2, num_draft_tokens=6),
    "eagle3": dict(num_steps=3, topk=2, num_draft_tokens=6),
    "mtp": dict(num_steps=2, topk=2, num_draft_tokens=4),
    "standalone": dict(num_steps=3, topk=1, num_draft_tokens=4),
}
# (prefix caching, max_num_batched_tokens): each against the reference, no reuse and whole prompts
CONFIGS = [(True, 0), (True, 1), (True, 7), (True, 64), (False, 7)]


@pytest.fixture(autouse=True)
def float32_draft_logits(monkeypatch):
    """Every engine's draft heads keep their float32 output layer: `fastest_logits_layer` picks an
    int8 one where it times faster, which on a busy machine differs from one engine to the next, and
    the drafts compared here would differ with it."""
    import specserve.models.eagle_head as eagle_model
    import specserve.models.mtp_head as mtp_model

    for module in (eagle_model, mtp_model):
        monkeypatch.setattr(module, "fastest_logits_layer", lambda weight, rows=(1, 4): None)


@pytest.fixture(scope="module")
def drafter_dirs(tmp_path_factory, tiny_target_dir):
    from test_eagle import write_checkpoint
    from test_mtp import with_mtp_head

    tmp = tmp_path_factory.mktemp("reuse")
    return {"eagle": (tiny_target_dir, write_checkpoint(tmp / "eagle", "eagle")),
            "eagle3": (tiny_target_dir, write_checkpoint(tmp / "eagle3", "eagle3")),
            "mtp": (with_mtp_head(tiny_target_dir, tmp / "mtp", "deepseek"), None)}


def make_engine(model_dir, algorithm="none", drafter=None, caching=True, budget=0, graph_mode="auto",
                slots=SLOTS, max_seq_len=256, **kw) -> Engine:
    spec = SpecConfig(algorithm=algorithm, drafter_path=str(drafter) if drafter else "", adaptive=False,
                      **SPECS[algorithm])
    return Engine(EngineConfig(model_dir=str(model_dir), device="cpu", dtype="float32", cpu_compile=False,
                               max_batch_size=slots, max_seq_len=max_seq_len, graph_mode=graph_mode,
                               enable_prefix_caching=caching, max_num_batched_tokens=budget, spec=spec, **kw))


def _ids(n, seed):
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


A, C = _ids(40, 1), _ids(12, 2)
B = A[:25] + _ids(8, 3)  # shares A's first 25 tokens; arrives while A is prefilled or decodes
D = C[:6] + _ids(5, 4)
FIRST_TURNS = [(0, "a", A), (0, "c", C), (2, "b", B), (3, "d", D)]  # (step it arrives at, name, prompt)


class Drafts:
    """Records, per request, every draft tree proposed for it (tokens and shape), in order."""

    def __init__(self, engine: Engine) -> None:
        self.trees: dict[str, list] = defaultdict(list)
        propose = engine.drafter.propose

        def recording(seqs, shape=None):  # noqa: ANN001, ANN202
            proposal = propose(seqs, shape)
            rows = proposal.unbatch() if isinstance(proposal, TreeBatch) else proposal
            for s, tree in zip(seqs, rows):
                self.trees[s.request_id].append((tree.tokens.tolist(), tree.parents.tolist()))
            return proposal

        engine.drafter.propose = recording


def run_script(engine: Engine, arrivals) -> dict[str, object]:
    """Add each prompt at its step, step until all finish; the merged output per name."""
    from specserve.engine.outputs import merge_outputs

    merged, step = {}, 0
    pending = sorted(arrivals, key=lambda a: a[0])
    while pending or engine.has_work():
        while pending and pending[0][0] <= step:
            _, name, prompt = pending.pop(0)
            engine.add_request(prompt, PARAMS, request_id=name)
        for out in engine.step():
            merged[out.request_id] = merge_outputs(merged.get(out.request_id), out)
        step += 1
    return merged


def conversation(engine: Engine) -> tuple[dict[str, object], dict[str, list[int]]]:
    """First turns (with a prompt arriving while the one it shares is prefilled), then second turns
    (prompt + answer + new text), the most recent conversation first. Returns outputs and prompts."""
    prompts = {name: p for _, name, p in FIRST_TURNS}
    outs = run_script(engine, FIRST_TURNS)
    for name, extra, seed in (("d", 3, 5), ("b", 4, 6), ("a", 2, 7), ("c", 5, 8)):
        prompts[name + "2"] = prompts[name] + outs[name].token_ids + _ids(extra, seed)
    second = [(0, "d2", prompts["d2"]), (1, "b2", prompts["b2"]), (1, "a2", prompts["a2"]), (1, "c2", prompts["c2"])]
    outs |= run_script(engine, second)
    return outs, prompts


def top2_gap(model_dir, prompt: list[int], tokens: list[int], at: int) -> float:
    """The reference forward's gap between its two largest logits before output token `at`."""
    from specserve.models.weights import load_llama

    model = load_llama(model_dir, torch.float32)
    ids = prompt + tokens[:at]
    cache = KVCache(model.cfg, 1, len(ids) + 1, torch.float32, "cpu")
    model.init_rope(len(ids) + 1)
    with torch.inference_mode():
        a = model.attention_inputs(torch.arange(len(ids))[None], torch.tensor([0]), torch.tensor([0]), None, cache,
                                   [0], [0])
        top = model(torch.tensor([ids]), a, cache).logits[0, -1].topk(2).values
    return float(top[0] - top[1])


def divergence(model_dir, prompts, ref, got, label) -> str:
    """'' when every output matches, else where the first differs and the top-2 logit gap there."""
    for name, out in got.items():
        want = ref[name].token_ids
        if out.token_ids != want:
            at = next(i for i, (x, y) in enumerate(zip(out.token_ids, want)) if x != y)
            gap = top2_gap(model_dir, prompts[name], want, at)
            return (f"{label}: request {name} differs at output token {at} ({out.token_ids[at]} vs {want[at]}); "
                    f"the reference's top-2 logit gap there is {gap:.3g}")
    return ""


@pytest.mark.parametrize("algorithm", list(SPECS))
def test_outputs_and_drafts_do_not_depend_on_reuse_or_chunks(tiny_target_dir, drafter_dirs, algorithm):
    model_dir, drafter = drafter_dirs.get(algorithm, (tiny_target_dir, None))
    reference = make_engine(model_dir, algorithm, drafter, caching=False, budget=0)
    ref_drafts = Drafts(reference)
    ref, prompts = conversation(reference)
    assert reference.prompt_counters.reused == 0
    assert reference.prompt_counters.computed == sum(len(p) for p in prompts.values())
    for caching, budget in CONFIGS:
        engine = make_engine(model_dir, algorithm, drafter, caching=caching, budget=budget)
        drafts = Drafts(engine)
        got, _ = conversation(engine)
        label = f"{algorithm}, prefix caching {caching}, max_num_batched_tokens {budget}"
        assert not divergence(model_dir, prompts, ref, got, label), divergence(model_dir, prompts, ref, got, label)
        assert drafts.trees == ref_drafts.trees, f"{label}: the drafts differ"
        assert [got[n].num_accepted_tokens for n in prompts] == [ref[n].num_accepted_tokens for n in prompts]
        counters = engine.prompt_counters
        assert counters.reused == sum(got[n].num_cached_tokens for n in prompts)
        assert counters.reused + counters.computed == sum(len(p) for p in prompts.values()), label
        if caching:
            assert got["b"].num_cached_tokens > 0 or budget == 1  # A's rows, copied while A ran
            # the whole first turn: its last token too where it was an accepted draft, not the bonus token
            assert got["d2"].num_cached_tokens >= len(prompts["d"]) + len(ref["d"].token_ids) - 1
        else:
            assert counters.reused == 0


def test_a_free_slot_continued_is_taken_as_is_and_a_partial_match_is_copied(tiny_target_dir):
    engine = make_engine(tiny_target_dir, slots=3)
    first = engine.generate([A], PARAMS)[0]
    slot_a = next(iter(engine.prefix_cache.contents))
    # a second turn continues A's slot: the same slot, nothing copied
    second_prompt = A + first.token_ids + [11, 12]
    engine.add_request(second_prompt, PARAMS, request_id="a2")
    engine.step()
    (req,) = engine.running
    assert (req.slot, req.num_cached_tokens) == (slot_a, len(A) + len(first.token_ids) - 1)
    # B shares 25 tokens with the running second turn: copied into a slot of its own
    engine.add_request(B, PARAMS, request_id="b")
    engine.step()
    b = next(r for r in engine.running if r.request_id == "b")
    assert b.slot != slot_a and b.num_cached_tokens == 25
    torch.testing.assert_close(engine.cache.data[:, :, b.slot, :, :25], engine.cache.data[:, :, slot_a, :, :25])


def test_prompt_positions_computed_are_the_uncached_tokens_no_padding(tiny_target_dir):
    """One 2,000-token prompt and seven 20-token prompts admitted together cost 2,140 positions,
    whether whole in one step or chunked; a repeat of the long prompt then costs its last token."""
    long, short = _ids(2000, 10), [_ids(20, 20 + i) for i in range(7)]
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    for budget in (0, 512):
        engine = make_engine(tiny_target_dir, slots=8, max_seq_len=2048, budget=budget)
        outs = engine.generate([long, *short], params)
        assert all(o.num_output_tokens == 2 for o in outs)
        assert engine.prompt_counters.computed == 2000 + 7 * 20
        assert engine.prompt_counters.reused == 0
    again = engine.generate([long], params)[0]
    assert again.num_cached_tokens == 1999 and engine.prompt_counters.computed == 2000 + 7 * 20 + 1


def test_running_streams_get_a_token_every_step_while_a_long_prompt_is_chunked(tiny_target_dir):
    engine = make_engine(tiny_target_dir, slots=3, max_seq_len=512, budget=64)
    engine.prefill_budget.observe = lambda *args: None  # no measured times: the configured budget holds
    for i in range(2):
        engine.add_request(_ids(10, 30 + i), SamplingParams(max_tokens=100, ignore_eos=True), request_id=f"s{i}")
    engine.step()
    engine.add_request(_ids(300, 40), SamplingParams(max_tokens=4, ignore_eos=True), request_id="long")
    steps = 0
    while True:
        outs = {o.request_id: o for o in engine.step()}
        steps += 1
        assert all(outs[f"s{i}"].token_ids for i in range(2)), f"a stream got no token in step {steps}"
        if "long" in outs:
            break
    assert steps == 5  # 300 tokens, 64 a step


@pytest.mark.parametrize("stall, beside", [(3.0, [60] * 5), (1.5, [30] * 10), (0.0, [256, 44])])
def test_prompt_work_beside_decoding_streams_is_sized_by_measured_step_times(tiny_target_dir, stall, beside):
    """A decode step measured at 10 ms and a prompt token at 0.5 ms: beside decoding streams a step
    computes prefill_stall_steps x 10 / 0.5 prompt tokens (3: 60; 0: the configured 256, no bound);
    the same prompt alone gets the configured 256 a step."""
    engine = make_engine(tiny_target_dir, slots=3, max_seq_len=512, budget=256, prefill_stall_steps=stall)
    engine.prefill_budget.observe = lambda *args: None
    engine.prefill_budget.decode.add(0.010)
    engine.prefill_budget.prompt.slope = 0.0005

    def computed_per_step(rid: str) -> list[int]:
        per_step = []
        while True:
            before = engine.prompt_counters.computed
            outs = {o.request_id: o for o in engine.step()}
            per_step.append(engine.prompt_counters.computed - before)
            if rid in outs:
                return per_step

    engine.add_request(_ids(300, 40), SamplingParams(max_tokens=1, ignore_eos=True), request_id="alone")
    assert computed_per_step("alone") == [256, 44]
    for i in range(2):
        engine.add_request(_ids(10, 30 + i), SamplingParams(max_tokens=100, ignore_eos=True), request_id=f"s{i}")
    engine.step()
    engine.add_request(_ids(300, 41), SamplingParams(max_tokens=1, ignore_eos=True), request_id="beside")
    assert computed_per_step("beside") == beside


def test_a_full_match_still_computes_the_last_prompt_token(tiny_target_dir):
    engine = make_engine(tiny_target_dir)
    a = engine.generate([A], PARAMS)[0]
    again = engine.generate([A], PARAMS)[0]
    assert again.num_cached_tokens == len(A) - 1 and again.token_ids == a.token_ids


@pytest.mark.parametrize("algorithm", ["none", "eagle"])
def test_the_static_graph_path_reuses_and_chunks_losslessly(tiny_target_dir, drafter_dirs, algorithm):
    """graph_mode=static (the CUDA-graph buckets, run eagerly on CPU): the same outputs and drafts."""
    model_dir, drafter = drafter_dirs.get(algorithm, (tiny_target_dir, None))
    reference = make_engine(model_dir, algorithm, drafter, caching=False, budget=0)
    ref_drafts = Drafts(reference)
    ref, prompts = conversation(reference)
    for budget in (0, 7):
        engine = make_engine(model_dir, algorithm, drafter, budget=budget, graph_mode="static")
        assert engine.runner.graphs is not None
        drafts = Drafts(engine)
        got, _ = conversation(engine)
        label = f"static {algorithm}, max_num_batched_tokens {budget}"
        assert not divergence(model_dir, prompts, ref, got, label), divergence(model_dir, prompts, ref, got, label)
        assert drafts.trees == ref_drafts.trees, f"{label}: the drafts differ"
        assert engine.prompt_counters.reused > 0


@torch.inference_mode()
def test_a_packed_forward_equals_each_chunk_alone(tiny_target_dir):
    """Three chunks in one packed forward (a fresh prompt, two after cached prefixes) against each
    chunk's own forward after the same prefix: the same logits, hidden states and K/V."""
    from specserve.models.weights import load_llama
    from specserve.runtime.prefill import PackedPrompts, PromptChunk, lower_right, packed_forward

    model = load_llama(tiny_target_dir, torch.float32)
    model.init_rope(128)
    cache = KVCache(model.cfg, 4, 128, torch.float32, "cpu")
    cache.data.normal_(generator=torch.Generator().manual_seed(0))  # the prefixes (and stale entries after them)
    # on a CPU: queries of 19 and 21 tokens run padded to 20 and 22, keys to 20, 36 and 28
    chunks = [PromptChunk(2, 0, tuple(_ids(19, 50))), PromptChunk(0, 30, tuple(_ids(5, 51))),
              PromptChunk(3, 7, tuple(_ids(21, 52)))]
    before = cache.data.clone()
    packed = packed_forward(model, cache, PackedPrompts.of(chunks))
    packed_cache, cache.data[:] = cache.data.clone(), before
    for i, c in enumerate(chunks):
        t = len(c.tokens)
        a = model.attention_inputs(torch.arange(c.start, c.end)[None], torch.tensor([c.slot]), torch.tensor([c.start]),
                                   None, cache, [c.start], [c.slot])
        alone = model(torch.tensor([c.tokens]), a, cache, logit_index=torch.tensor([[t - 1]]))
        cols = PackedPrompts.of(chunks).columns(i)
        torch.testing.assert_close(packed.hidden[:, cols], alone.hidden, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(packed.logits[:, i : i + 1], alone.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed_cache, cache.data, rtol=1e-5, atol=1e-5)
    assert torch.equal(lower_right(3, 8, torch.device("cpu")), torch.ones(3, 8, dtype=torch.bool).tril(5))
