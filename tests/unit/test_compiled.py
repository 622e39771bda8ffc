"""The target's AOTInductor-compiled forward on CPU (`runtime/compiled.py`) against the eager one.

float32 on the tiny target: prefill, decode and tree verification give the eager logits, hidden
states, EAGLE-3 features and K/V cache entries; engines with the compiled forward emit the eager
engine's greedy tokens for every algorithm at batch 1 and 4; a second build loads the stored
package instead of compiling. One compile cache serves the module (each package takes ~25 s).
"""

from __future__ import annotations

import getpass
import tempfile
import time

import pytest
import torch

from specserve.config import EngineConfig, SamplingParams, SpecConfig
from specserve.engine.engine import Engine
from specserve.models.cpu_linear import padded_rows
from specserve.models.kv_cache import KVCache
from specserve.models.weights import load_llama
from specserve.runtime.compile_cache import can_compile, program_key
from specserve.runtime.compiled import (
    CompiledTarget,
    ReadOnlyForward,
    choose_step_attention,
    choose_step_matmul,
    prefix_keys,
)
from specserve.runtime.few_row_head import FEW_ROWS
from specserve.runtime.target import TargetRunner
from specserve_kernels import few_row_gemm, gguf_gemm, slot_attention

pytestmark = pytest.mark.skipif(not can_compile(torch.device("cpu")), reason="needs g++ (make setup installs it)")

VOCAB = 49152
AUX = (1, 4, 5)


@pytest.fixture(scope="module")
def compile_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("compiled")


def _cache(model, slots=3):
    cache = KVCache(model.cfg, slots, 128, torch.float32, "cpu")
    model.init_rope(cache.max_len)
    return cache


def _tree_mask(b: int) -> torch.Tensor:
    """(B, 4, 4): root -> a, root -> b, a -> c (ancestors visible)."""
    parents = [-1, 0, 0, 1]
    mask = torch.eye(4, dtype=torch.bool)
    for i, p in enumerate(parents):
        while p >= 0:
            mask[i, p] = True
            p = parents[p]
    return mask.expand(b, 4, 4).clone()


@pytest.mark.parametrize("bf16_values", [False, True], ids=["float32 weights", "bf16-valued weights"])
def test_compiled_forward_matches_eager(tiny_target_dir, compile_dir, tmp_path, monkeypatch, bf16_values):
    """bf16-valued weights (a bf16 checkpoint served in float32): the few-row kernel's panels are
    stored in bf16 inside the step program, and must give the same forwards."""
    model = load_llama(tiny_target_dir, torch.float32)
    if bf16_values:
        with torch.no_grad():
            for param in model.parameters():
                param.copy_(param.bfloat16().float())
        compile_dir = tmp_path / "programs"  # the module's directory holds the float32 model's programs only
        tmp_path = tmp_path / "scratch"
        tmp_path.mkdir()
    eager_cache, compiled_cache = _cache(model), _cache(model)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where compiling and loading put their scratch
    compiled = CompiledTarget(model, compiled_cache, AUX, max_batch_size=3, max_tokens=64, cache_dir=compile_dir)
    assert compiled.compiled_now and compiled.step_runner is not None
    # float32 on an AVX2 CPU: the step program's matmuls are the few-row kernel, checked against eager below
    assert compiled.step_matmul == ("few_row_gemm" if few_row_gemm.load() else "inductor")
    # and its attention reads each slot's prefix in place where that kernel runs (checked against eager below)
    assert compiled.step_attention == ("in_place" if slot_attention.load() else "sdpa")
    # no inductor cache or unpacked package left behind; inductor keeps its precompiled headers (once)
    left = {str(p.relative_to(tmp_path)) for p in tmp_path.glob("*/*")} | {p.name for p in tmp_path.glob("*")}
    assert left <= {f"torchinductor_{getpass.getuser()}", f"torchinductor_{getpass.getuser()}/precompiled_headers"}
    assert sorted(p.name for p in compile_dir.glob("*.pt2")) == sorted([compiled.path.name, compiled.step_path.name])
    g = torch.Generator().manual_seed(3)
    slots = torch.tensor([2, 0, 1])  # not in order: keys are gathered per slot
    lens = [7, 27, 12]  # a prefill of 27 tokens: the program runs it padded to 28

    def both(tokens, positions, cache_lens, new_mask, host_lens, logit_index=None):
        a = model.attention_inputs(positions, slots[: len(tokens)], cache_lens, new_mask, eager_cache, host_lens,
                                   slots[: len(tokens)].tolist())
        with torch.inference_mode():
            ref = model(tokens, a, eager_cache, logit_index=logit_index, aux_layers=AUX)
            mask = new_mask if new_mask is not None else torch.ones(1, 1, 1, dtype=torch.bool).expand(len(tokens), 1, 1)
            out = compiled.forward(tokens, positions, slots[: len(tokens)], cache_lens, mask, host_lens, logit_index)
        for name in ("logits", "hidden", "aux_hidden"):
            torch.testing.assert_close(getattr(out, name), getattr(ref, name), rtol=1e-4, atol=1e-4, msg=name)
        torch.testing.assert_close(compiled_cache.data, eager_cache.data, rtol=1e-4, atol=1e-4)

    # prefill of three prompts of different lengths (padded; logits at each prompt's last token)
    t = max(lens)
    tokens = torch.randint(3, VOCAB, (3, t), generator=g)
    causal = torch.ones(t, t, dtype=torch.bool).tril().expand(3, t, t)
    both(tokens, torch.arange(t).expand(3, t), torch.zeros(3, dtype=torch.int64), causal, [0, 0, 0],
         torch.tensor(lens)[:, None] - 1)
    # decode: one token each after prefixes of different lengths
    cache_lens = torch.tensor(lens)
    both(torch.randint(3, VOCAB, (3, 1), generator=g), cache_lens[:, None], cache_lens, None, lens)
    # tree verification of 4 nodes for the first two requests (batch 2, tokens 4: another shape, same program)
    depth = torch.tensor([0, 1, 1, 2])
    both(torch.randint(3, VOCAB, (2, 4), generator=g), cache_lens[:2, None] + 1 + depth, cache_lens[:2] + 1,
         _tree_mask(2), [n + 1 for n in lens[:2]])


def test_programs_run_a_bounded_set_of_token_counts():
    sizes = {padded_rows(t) for t in range(1, 2049)}
    assert len(sizes) == 72 and max(sizes) == 2048
    assert all(t <= padded_rows(t) <= t * 1.125 for t in range(1, 4097))
    assert [padded_rows(t) for t in (16, 17, 18, 19, 33, 65, 1025)] == [16, 18, 18, 20, 36, 72, 1152]


def test_a_second_build_loads_the_stored_package(tiny_target_dir, compile_dir):
    model = load_llama(tiny_target_dir, torch.float32)
    first = CompiledTarget(model, _cache(model), AUX, max_batch_size=3, max_tokens=64, cache_dir=compile_dir)
    again = CompiledTarget(model, _cache(model), AUX, max_batch_size=3, max_tokens=64, cache_dir=compile_dir)
    assert not again.compiled_now and again.path == first.path
    # one process loads a package once: the programs (each the model's size) are shared
    assert again.runner is first.runner and again.step_runner is first.step_runner

    def key(slots=3, aux=AUX, dtype=torch.float32):
        return program_key(model.state_dict().items(), "target", tuple(_cache(model, slots).data.shape), dtype, aux,
                           3, 64, gguf_gemm.activation_digits(model))

    assert key() in first.path.name
    assert key(slots=5) != key()  # the cache's strides are baked in
    assert key(dtype=torch.float16) != key()  # and its numbers
    assert key(aux=()) != key()
    before = key()
    model.layers[0].mlp.down_proj.weight.data[0, 0] += 1  # other weights, another program
    assert key() != before


def test_a_running_program_lets_the_other_python_threads_run(tiny_target_dir, compile_dir):
    """A server's other threads (sending responses, taking requests) run while a program computes:
    it is called without the GIL. With a long switch interval a thread waiting for the GIL gets it
    only when the calling thread lets it go: beside torch's own call (which keeps it) a counting
    thread hardly counts, beside ours it counts all along."""
    import sys
    import threading

    from specserve.runtime.unlocked import UnlockedRunner

    model = load_llama(tiny_target_dir, torch.float32)
    compiled = CompiledTarget(model, _cache(model), AUX, max_batch_size=3, max_tokens=64, cache_dir=compile_dir)
    assert isinstance(compiled.runner, UnlockedRunner), "the programs keep the GIL: the extension did not load"
    b, t = 3, 64
    inputs = (torch.randint(3, VOCAB, (b, t)), torch.arange(t).expand(b, t).contiguous(), torch.arange(b),
              torch.zeros(b, dtype=torch.int64), torch.ones(b, t, t, dtype=torch.bool).tril(),
              prefix_keys(compiled.cache, 16))
    torch.testing.assert_close(compiled.runner(*inputs)[0], compiled.runner.model(*inputs)[0], rtol=0, atol=0)

    def counted_beside(call) -> int:  # noqa: ANN001
        count, started, done = [0], threading.Event(), threading.Event()

        def counter() -> None:
            started.set()
            while not done.is_set():
                count[0] += 1
                time.sleep(0)  # lets the GIL go at once: the calling thread never waits for it

        thread = threading.Thread(target=counter)
        thread.start()
        started.wait()
        before = count[0]
        with torch.inference_mode():
            for _ in range(20):
                call(*inputs)
        counted = count[0] - before
        done.set()
        thread.join()
        return counted

    interval = sys.getswitchinterval()
    sys.setswitchinterval(5.0)  # the counter gets the GIL only when the calling thread lets it go
    try:
        held, released = counted_beside(compiled.runner.model), counted_beside(compiled.runner)
    finally:
        sys.setswitchinterval(interval)
    assert released > 20 * max(held, 1), (held, released)


def test_the_step_matmul_is_the_kernel_only_for_float32_where_it_runs(tmp_path):
    linear = torch.nn.Linear(8, 8)
    kernel = "few_row_gemm" if few_row_gemm.load() else "inductor"
    assert choose_step_matmul(linear, tmp_path) == kernel
    assert choose_step_matmul(linear, tmp_path, "inductor") == "inductor"
    assert choose_step_matmul(linear.to(torch.bfloat16), tmp_path) == "inductor"


def test_the_step_attention_is_the_in_place_kernel_where_it_runs(tiny_target_dir, tmp_path):
    model = load_llama(tiny_target_dir, torch.float32)
    kernel = "in_place" if slot_attention.load() else "sdpa"
    assert choose_step_attention(_cache(model), tmp_path) == kernel
    assert choose_step_attention(_cache(model), tmp_path, "sdpa") == "sdpa"
    half = KVCache(model.cfg, 2, 32, torch.float16, "cpu")
    assert choose_step_attention(half, tmp_path) == kernel
    wide = KVCache(model.cfg, 2, 32, torch.float64, "cpu")
    assert choose_step_attention(wide, tmp_path) == "sdpa"


@pytest.mark.skipif(not slot_attention.load(), reason="the in-place attention kernel does not run here")
@pytest.mark.parametrize("dtype, cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                (torch.float32, torch.float16)])
def test_in_place_attention_computes_the_step_as_sdpa_does(tiny_target_dir, dtype, cache_dtype):
    """The step program's forward, eagerly, with the in-place kernel and with SDPA over gathered keys: a
    tree of 4 tokens after cached prefixes of different lengths, in slots out of order; bf16 models too
    (their cache bf16, the kernel's new tokens widened to float32), and a float32 model on a float16
    cache (kv_cache_dtype; the kernel rounds the new tokens' K/V to it first, SDPA here does not)."""
    model = load_llama(tiny_target_dir, dtype).eval()
    cache = KVCache(model.cfg, 3, 128, cache_dtype, "cpu")
    model.init_rope(cache.max_len)
    cache.data.normal_(generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 4), generator=g)
    lens = torch.tensor([37, 5])
    positions = lens[:, None] + torch.tensor([0, 1, 1, 2])
    args = (tokens, positions, torch.tensor([2, 0]), lens, _tree_mask(2), prefix_keys(cache, 48))
    with torch.inference_mode():
        sdpa = ReadOnlyForward(model, AUX, with_logits=True)(*args)
        in_place = ReadOnlyForward(model, AUX, with_logits=True, in_place=True)(*args)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.05, rtol=0.05)
    for a, b in zip(sdpa, in_place, strict=True):
        assert a.dtype == b.dtype
        torch.testing.assert_close(b.float(), a.float(), **tol)


def _engine(tiny_target_dir, compile_dir, cpu_compile, algorithm="none", **spec):
    return Engine(EngineConfig(model_dir=str(tiny_target_dir), device="cpu", dtype="float32", max_batch_size=4,
                               max_seq_len=128, cpu_compile=cpu_compile, compile_cache_dir=str(compile_dir),
                               compiled_steps="always", spec=SpecConfig(algorithm=algorithm, **spec)))


@pytest.mark.parametrize("algorithm", ["none", "ngram", "eagle", "eagle3", "standalone"])
def test_compiled_engines_are_lossless(tmp_path, tiny_target_dir, compile_dir, algorithm):
    """Greedy tokens of an engine on the compiled forward equal the eager `none` engine's, at batch
    4 and one request at a time; the drafting engines pin a tree so drafts are verified."""
    from test_eagle import write_checkpoint  # tests/unit is on sys.path (rootdir-relative imports)

    spec = {}
    if algorithm in ("eagle", "eagle3"):
        spec = dict(drafter_path=str(write_checkpoint(tmp_path / algorithm, algorithm)), num_steps=3, topk=2,
                    num_draft_tokens=6)
    elif algorithm == "ngram":
        spec = dict(num_draft_tokens=6)
    elif algorithm == "standalone":
        spec = dict(standalone_num_layers=3, num_steps=3, topk=2, num_draft_tokens=6)
    eng = _engine(tiny_target_dir, compile_dir, True, algorithm, **spec)
    assert eng.runner.compiled is not None
    assert getattr(getattr(eng.drafter, "runner", None), "compiled", None) is not None or algorithm in ("none", "ngram")
    ref = _engine(tiny_target_dir, compile_dir, False)
    assert ref.runner.compiled is None
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, VOCAB, (k,), generator=g).tolist() for k in (5, 23, 9, 40)]
    prompts[1] = prompts[1][:8] * 3  # repeats give NGRAM something to draft
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    expected = [o.token_ids for o in ref.generate(prompts, params)]
    assert [o.token_ids for o in eng.generate(prompts, params)] == expected
    assert [eng.generate([p], params)[0].token_ids for p in prompts] == expected
    if algorithm != "none":
        assert eng.drafter is not None and sum(o.num_draft_tokens for o in eng.generate(prompts, params)) > 0


def test_a_float16_cache_is_lossless_compiled_and_eager(tiny_target_dir, compile_dir):
    """kv_cache_dtype float16 under a float32 model: half the cache's bytes; the compiled NGRAM engine's greedy
    tokens equal the eager `none` engine's on the same cache, batched and alone (a tree's new K/V are rounded
    as a later decode reads them back)."""
    def engine(cpu_compile, algorithm):  # noqa: ANN001, ANN202
        return Engine(EngineConfig(model_dir=str(tiny_target_dir), device="cpu", dtype="float32", max_batch_size=4,
                                   max_seq_len=128, cpu_compile=cpu_compile, compile_cache_dir=str(compile_dir),
                                   compiled_steps="always", kv_cache_dtype="float16",
                                   spec=SpecConfig(algorithm=algorithm, num_draft_tokens=6)))

    eng, ref = engine(True, "ngram"), engine(False, "none")
    assert eng.runner.compiled is not None and eng.cache.data.dtype == ref.cache.data.dtype == torch.float16
    wide = Engine(EngineConfig(model_dir=str(tiny_target_dir), device="cpu", dtype="float32", max_batch_size=4,
                               max_seq_len=128, cpu_compile=False))
    assert wide.cache.nbytes == 2 * ref.cache.nbytes
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(3, VOCAB, (k,), generator=g).tolist() for k in (7, 24, 11, 33)]
    prompts[1] = prompts[1][:8] * 3  # repeats give NGRAM something to draft
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    expected = [o.token_ids for o in ref.generate(prompts, params)]
    outputs = eng.generate(prompts, params)
    assert [o.token_ids for o in outputs] == expected and sum(o.num_draft_tokens for o in outputs) > 0
    assert [eng.generate([p], params)[0].token_ids for p in prompts] == expected


@pytest.mark.parametrize("algorithm", ["eagle", "eagle3"])
def test_compiled_head_matches_eager(tmp_path, tiny_target_dir, compile_dir, algorithm):
    """A draft head's compiled forwards give the eager head's states and K/V: a catch-up over fresh
    prompts (EAGLE-3: the fused target features), one after a prefix, then a beam step whose nodes
    sit at scattered cache entries and see their prefix and themselves. Forwards of more than
    FEW_ROWS rows run the head's program, the beam's run its few-row program."""
    from test_eagle import write_checkpoint

    from specserve.models.llama import KeyMask

    spec = dict(drafter_path=str(write_checkpoint(tmp_path / algorithm, algorithm)), num_steps=3, topk=2,
                num_draft_tokens=6)
    compiled = _engine(tiny_target_dir, compile_dir, True, algorithm, **spec).drafter
    eager = _engine(tiny_target_dir, compile_dir, False, algorithm, **spec).drafter
    assert (compiled.runner.compiled is not None and compiled.runner.few_rows is not None
            and eager.runner.compiled is None)
    ran = {"head": 0, "few rows": 0}
    for name, program in (("head", compiled.runner.compiled), ("few rows", compiled.runner.few_rows)):
        for width, runner in program.runners.items():
            program.runners[width] = lambda *a, runner=runner, name=name: (ran.__setitem__(name, ran[name] + 1),
                                                                           runner(*a))[1]
    g = torch.Generator().manual_seed(9)
    cfg = compiled.head.cfg
    b, t, first = 2, FEW_ROWS + 8, FEW_ROWS + 3  # the first catch-up: more than FEW_ROWS rows, padded to 20
    tokens = torch.randint(3, VOCAB, (b, t), generator=g)
    feats = torch.randn(b, t, cfg.feature_size, generator=g)
    positions = torch.arange(t).expand(b, t)
    steps = [(tokens[:, :first], feats[:, :first], positions[:, :first], positions[:, :first], None, first)]
    start = torch.tensor([first, first])  # the catch-up over the rest, after a prefix
    steps.append((tokens[:, first:], feats[:, first:], positions[:, first:], positions[:, first:],
                  KeyMask(start), t))
    base = torch.tensor([t, t])
    visible = torch.eye(2, dtype=torch.bool).expand(b, 2, 2)
    beam_pos = torch.tensor([[t + 1, t + 2], [t + 1, t + 2]])  # after a scratch entry nobody sees
    steps.append((torch.randint(3, VOCAB, (b, 2), generator=g), torch.randn(b, 2, cfg.hidden_size, generator=g),
                   base[:, None].expand(b, 2), beam_pos, KeyMask(base, torch.cat(
                       [torch.zeros(b, 2, 1, dtype=torch.bool), visible], -1)), t + 3))
    with torch.inference_mode():
        for tok, hid, pos, wpos, mask, key_len in steps:
            got = compiled._forward(tok, hid, pos, wpos, mask, key_len, [0, 1])
            want = eager._forward(tok, hid, pos, wpos, mask, key_len, [0, 1])
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(compiled.cache.data, eager.cache.data, rtol=1e-4, atol=1e-4)
    # the catch-up after the prefix is a few rows: a few-row program takes it (EAGLE-3's at the fused features' width)
    assert ran == {"head": 1, "few rows": 2}
    assert sorted(compiled.runner.few_rows.runners) == sorted({cfg.feature_size, cfg.hidden_size})


def test_compiled_draft_model_matches_eager(tiny_target_dir, compile_dir):
    """A standalone draft model's compiled forwards give the eager hidden states and K/V: fresh prompts, a catch-up
    after a prefix (logits at the last column), a beam step at scattered cache entries, a prompt chunk."""
    from specserve.models.llama import KeyMask

    spec = dict(drafter_path=str(tiny_target_dir), num_steps=3, topk=2, num_draft_tokens=6)
    compiled = _engine(tiny_target_dir, compile_dir, True, "standalone", **spec).drafter.runner
    eager = _engine(tiny_target_dir, compile_dir, False, "standalone", **spec).drafter.runner
    assert compiled.compiled is not None and eager.compiled is None
    g = torch.Generator().manual_seed(11)
    b, t, first = 2, 20, 13
    tokens = torch.randint(3, VOCAB, (b, t), generator=g)
    positions = torch.arange(t).expand(b, t)
    last = torch.full((b, 1), t - first - 1)
    base = torch.tensor([t, t])
    visible = torch.eye(2, dtype=torch.bool).expand(b, 2, 2)
    beam_pos = torch.tensor([[t + 1, t + 2], [t + 1, t + 2]])  # after a scratch entry nobody sees
    beam_mask = KeyMask(base, torch.cat([torch.zeros(b, 2, 1, dtype=torch.bool), visible], -1))
    steps = [(tokens[:, :first], positions[:, :first], positions[:, :first], None, first, None),
             (tokens[:, first:], positions[:, first:], positions[:, first:], KeyMask(torch.tensor([first, first])),
              t, last),
             (torch.randint(3, VOCAB, (b, 2), generator=g), base[:, None].expand(b, 2), beam_pos, beam_mask, t + 3,
              None)]
    with torch.inference_mode():
        for tok, pos, wpos, mask, key_len, index in steps:
            got, want = (r.hidden(tok, pos, wpos, [0, 1], mask, key_len) for r in (compiled, eager))
            if index is not None:  # the logits of the last column
                pick = index[:, :, None].expand(-1, -1, got.shape[-1])
                got, want = compiled.logits(got.gather(1, pick)), eager.logits(want.gather(1, pick))
            assert got.shape == want.shape
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(compiled.cache.data, eager.cache.data, rtol=1e-4, atol=1e-4)
        chunk, chunk_pos = torch.randint(3, VOCAB, (1, 9), generator=g), torch.arange(t + 3, t + 12)[None]
        for runner in (compiled, eager):
            runner.hidden(chunk, chunk_pos, chunk_pos, [1], KeyMask(torch.tensor([t + 3])), t + 12)
        torch.testing.assert_close(compiled.cache.data, eager.cache.data, rtol=1e-4, atol=1e-4)


class _Seq:
    def __init__(self, token_ids: list[int], slot: int, cache_len: int) -> None:
        self.request_id, self.token_ids, self.slot, self.cache_len = f"r{slot}", token_ids, slot, cache_len


@pytest.mark.parametrize("algorithm", ["eagle", "eagle3"])
def test_a_catch_up_in_few_row_chunks_matches_one_forward(tmp_path, tiny_target_dir, compile_dir, algorithm):
    """A catch-up of more rows than the few-row programs take, run as consecutive few-row forwards
    (`chunked_catch_up`), leaves the head's states and K/V of one forward of the general program:
    two requests, one with a longer backlog than the other, after a prefix each."""
    from test_eagle import write_checkpoint

    from specserve.runtime.head_runner import CHUNKED_CATCH_UP_ROWS

    spec = dict(drafter_path=str(write_checkpoint(tmp_path / algorithm, algorithm)), num_steps=3, topk=2,
                num_draft_tokens=6)
    drafters = [_engine(tiny_target_dir, compile_dir, True, algorithm, **spec).drafter for _ in range(2)]
    g = torch.Generator().manual_seed(11)
    lens, synced = (2 * FEW_ROWS + 4, FEW_ROWS + 4), (7, 2)
    assert 2 * max(n - s for n, s in zip(lens, synced)) <= CHUNKED_CATCH_UP_ROWS
    tokens = [torch.randint(3, VOCAB, (n + 1,), generator=g).tolist() for n in lens]
    feats = torch.randn(2, max(lens), drafters[0].head.cfg.feature_size, generator=g)
    for d, chunked in zip(drafters, (True, False)):
        d.runner.chunked_catch_up = chunked
        d.features[:2, : max(lens)] = feats
    seqs = [_Seq(tokens[i], i, lens[i]) for i in range(2)]
    with torch.inference_mode():
        for d in drafters:
            d._catch_up([_Seq(tokens[i][: synced[i] + 1], i, synced[i]) for i in range(2)])  # the prefixes
        forwards = [d.num_forwards for d in drafters]
        for d in drafters:
            d._catch_up(seqs)
    backlog = max(n - s for n, s in zip(lens, synced))
    assert drafters[0].num_forwards - forwards[0] == -(-backlog // (FEW_ROWS // 2))
    assert drafters[1].num_forwards - forwards[1] == 1
    torch.testing.assert_close(drafters[0].last_hidden[:2], drafters[1].last_hidden[:2], rtol=1e-4, atol=1e-4)
    for i, n in enumerate(lens):  # each request's entries; the padding columns' scratch writes differ
        torch.testing.assert_close(drafters[0].cache.data[:, :, i, :, :n], drafters[1].cache.data[:, :, i, :, :n],
                                   rtol=1e-4, atol=1e-4)


def test_catch_ups_run_in_chunks_only_where_timed_faster(tmp_path, tiny_target_dir, compile_dir):
    """`chunks_pay` times a catch-up both ways: stand-in programs with known costs here."""
    from test_eagle import write_checkpoint

    spec = dict(drafter_path=str(write_checkpoint(tmp_path / "eagle", "eagle")), num_steps=3, topk=2,
                num_draft_tokens=6)
    drafter = _engine(tiny_target_dir, compile_dir, True, "eagle", **spec).drafter
    assert not drafter.cache.data.any()  # the timing at start-up gave back the entries it used
    for whole_s, chunk_s, expected in ((0.004, 0.0001, True), (0.0005, 0.002, False)):
        drafter.runner.compiled.forward = lambda *a, c=whole_s: time.sleep(c)
        drafter.runner.few_rows.forward = lambda *a, c=chunk_s: time.sleep(c)
        assert drafter.runner.chunks_pay() is expected


def test_steps_run_compiled_only_where_timed_faster(tiny_target_dir, compile_dir, monkeypatch):
    """compiled_steps=auto: per batch bucket, the faster of the two step forwards as timed at
    start-up (stand-in forwards with known costs here); a mix of both stays lossless."""
    def fake_forwards(self, b, t, context):
        costs = {"compiled": 0.002 if b == 1 else 0.006, "eager": 0.004}
        return {name: (lambda c=c: time.sleep(c)) for name, c in costs.items()}

    monkeypatch.setattr(TargetRunner, "_step_forwards", fake_forwards)
    eng = Engine(EngineConfig(model_dir=str(tiny_target_dir), device="cpu", dtype="float32", max_batch_size=4,
                              max_seq_len=128, cpu_compile=True, compile_cache_dir=str(compile_dir)))
    assert eng.chooser.buckets == [1, 2, 4] and eng.runner.compiled_step_buckets == (1,)
    monkeypatch.undo()
    ref = _engine(tiny_target_dir, compile_dir, False)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, VOCAB, (k,), generator=g).tolist() for k in (6, 17, 30)]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    expected = [o.token_ids for o in ref.generate(prompts, params)]
    assert [o.token_ids for o in eng.generate(prompts, params)] == expected  # batch 3: eager
    assert [eng.generate([p], params)[0].token_ids for p in prompts] == expected  # batch 1: compiled


@pytest.mark.parametrize("budget", [0, 7])
def test_compiled_prefill_reuses_and_chunks_losslessly(tiny_target_dir, compile_dir, budget):
    """Prompt chunks through the compiled program, the chunks of one length as the rows of one
    call (their cached prefixes of different lengths): the eager engine's greedy tokens, without
    prefix caching or chunks; second turns reuse their first turn."""
    def engine(cpu_compile, **kw):  # noqa: ANN001, ANN202
        return Engine(EngineConfig(model_dir=str(tiny_target_dir), device="cpu", dtype="float32", max_batch_size=4,
                                   max_seq_len=128, cpu_compile=cpu_compile, compile_cache_dir=str(compile_dir),
                                   compiled_steps="always", **kw))

    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(3, VOCAB, (k,), generator=g).tolist() for k in (21, 21, 14, 35)]
    prompts[1] = prompts[0][:10] + prompts[1][10:]  # a shared prefix, the same length
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    ref = engine(False, enable_prefix_caching=False, max_num_batched_tokens=0)
    eng = engine(True, max_num_batched_tokens=budget)
    assert eng.runner.compiled is not None
    expected = [o.token_ids for o in ref.generate(prompts, params)]
    assert [o.token_ids for o in eng.generate(prompts, params)] == expected
    turns = [p + e + [7, 8] for p, e in zip(prompts, expected)]
    second = eng.generate(turns, params)
    assert [o.token_ids for o in second] == [o.token_ids for o in ref.generate(turns, params)]
    assert sum(o.num_cached_tokens for o in second) > 0
