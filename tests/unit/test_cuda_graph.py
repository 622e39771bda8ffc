"""The bucketed static forward that CUDA graphs capture, run eagerly on CPU (`graph_mode="static"`).

What is checked here is everything but the capture itself: padding a batch up to its bucket (rows
into the spare slot, tree nodes that see only themselves), keys over the whole slot behind a
device-built mask, and slicing outputs back. The capture and replay are checked by the `gpu`
tests in tests/gpu/.
"""

from __future__ import annotations

import pytest
import torch

from specserve.config import EngineConfig, SamplingParams, SpecConfig
from specserve.engine.engine import Engine
from specserve.models.llama import ForwardOutput
from specserve.runtime.cuda_graph import default_batch_sizes
from specserve.tree import TreeBatch

VOCAB = 49152


def _engine(tiny_target_dir, graph_mode, algorithm="none", batch=4, cuda_graph_max_bs=0, **kw):
    spec = SpecConfig(algorithm=algorithm, **kw)
    return Engine(EngineConfig(model_dir=str(tiny_target_dir), device="cpu", dtype="float32", cpu_compile=False,
                               max_batch_size=batch, max_seq_len=256, graph_mode=graph_mode,
                               cuda_graph_max_bs=cuda_graph_max_bs, spec=spec))


def _prompts(n=6):
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, VOCAB, (k,), generator=g).tolist() for k in (5, 23, 9, 40, 2, 14)[:n]]


def test_default_batch_sizes():
    assert default_batch_sizes(1) == (1,)
    assert default_batch_sizes(6) == (1, 2, 4, 6)
    assert default_batch_sizes(20) == (1, 2, 4, 8, 16, 20)


def test_buckets_and_padding_slot(tiny_target_dir):
    eng = _engine(tiny_target_dir, "static", "ngram", batch=6, num_draft_tokens=8)
    runner = eng.runner.graphs
    assert runner is not None
    assert runner.num_tokens == [1, 8] and runner.batch_sizes == [1, 2, 4, 6]
    assert runner.bucket_for(3, 5) == (4, 8)
    assert runner.bucket_for(1, 1) == (1, 1)
    assert runner.bucket_for(7, 1) is None and runner.bucket_for(2, 9) is None
    # the padding slot is a 7th slot no request ever gets
    assert eng.cache.num_slots == 7 and runner.padding_slot == 6
    assert sorted(eng.cache.allocate() for _ in range(6)) == list(range(6)) and eng.cache.num_free == 0
    assert _engine(tiny_target_dir, "off").runner.graphs is None
    assert _engine(tiny_target_dir, "auto").runner.graphs is None  # auto captures on CUDA only


@torch.inference_mode()
def test_static_forward_equals_eager_forward(tiny_target_dir):
    """One padded tree-verify forward (3 rows in a 4-row bucket, 5 nodes in an 8-token bucket)
    against the dynamic forward: same logits, hidden states and K/V written."""
    eng = _engine(tiny_target_dir, "static", "ngram", batch=4, num_draft_tokens=8)
    model, cache = eng.model, eng.cache
    g = torch.Generator().manual_seed(0)
    cache.data.normal_(generator=g)  # a prefix in every slot, including the padding slot
    slots, lens = torch.tensor([2, 0, 1]), torch.tensor([17, 3, 40])
    tokens = torch.randint(0, VOCAB, (3, 5), generator=g)
    parents = [-1, 0, 0, 1, 2]
    mask = torch.eye(5, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            mask[i] |= mask[p]
    depth = mask.sum(-1) - 1
    new_mask = mask.expand(3, 5, 5)
    positions = lens[:, None] + depth
    before = cache.data.clone()
    static = eng.runner.graphs.forward(tokens, positions, slots, lens, new_mask, lens.tolist())
    static_cache = cache.data.clone()
    cache.data.copy_(before)
    a = model.attention_inputs(positions, slots, lens, new_mask, cache, lens.tolist(), slots.tolist())
    eager: ForwardOutput = model(tokens, a, cache)
    torch.testing.assert_close(static.logits, eager.logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(static.hidden, eager.hidden, rtol=1e-4, atol=1e-4)
    # real rows wrote the same K/V at [len, len + 5); padding rows wrote only the padding slot
    for s, n in zip(slots.tolist(), lens.tolist()):
        torch.testing.assert_close(static_cache[:, :, s, :, : n + 5], cache.data[:, :, s, :, : n + 5])
    torch.testing.assert_close(static_cache[:, :, 3], before[:, :, 3])  # slot 3: no request, untouched


def _chain_mask(rows: int, n: int) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool).tril().expand(rows, n, n)


def test_a_full_bucket_after_a_padded_one_and_back_equals_eager(tiny_target_dir):
    """A batch that fills its bucket skips the padding defaults: nothing left from a padded call
    reaches it, and a padded call after it pads again (4-row x 8-token bucket, chains)."""
    eng = _engine(tiny_target_dir, "static", "ngram", batch=4, num_draft_tokens=8)
    model, cache, runner = eng.model, eng.cache, eng.runner.graphs
    g = torch.Generator().manual_seed(1)
    cache.data.normal_(generator=g)
    for rows, n in ((3, 5), (4, 8), (2, 3), (4, 8)):
        slots, lens = torch.arange(rows), torch.randint(1, 60, (rows,), generator=g)
        tokens = torch.randint(0, VOCAB, (rows, n), generator=g)
        positions = lens[:, None] + torch.arange(n)
        mask = _chain_mask(rows, n)
        before = cache.data.clone()
        static = runner.forward(tokens, positions, slots, lens, mask, lens.tolist())
        cache.data.copy_(before)
        eager = model(tokens, model.attention_inputs(positions, slots, lens, mask, cache, lens.tolist(),
                                                     slots.tolist()), cache)
        torch.testing.assert_close(static.logits, eager.logits, rtol=1e-4, atol=1e-4)


def test_a_full_decode_bucket_copies_in_its_inputs_alone(tiny_target_dir, monkeypatch):
    """A batch of 1 in the (1, 1) bucket: four copies (tokens, cache lengths, positions, slots)
    before the forward, no padding defaults and no mask."""
    from torch.utils._python_dispatch import TorchDispatchMode

    eng = _engine(tiny_target_dir, "static", batch=4)
    runner = eng.runner.graphs
    monkeypatch.setattr(runner, "_run", lambda bk: bk.output)
    runner.buckets[(1, 1)].output = ForwardOutput(torch.zeros(1, 1, 8), torch.zeros(1, 1, 4), None)
    ops: list[str] = []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            if not func.is_view:
                ops.append(func.__name__.split(".")[0])
            return func(*args, **(kwargs or {}))

    one = torch.tensor([[5]]), torch.tensor([[7]]), torch.tensor([0]), torch.tensor([7])
    with Ops():
        runner.forward(*one, None, [7])
    assert ops == ["copy_"] * 4, ops


@pytest.mark.parametrize(("algorithm", "kw"), [("none", {}), ("ngram", {"num_draft_tokens": 6})])
def test_static_engine_is_lossless_with_continuous_batching(tiny_target_dir, algorithm, kw):
    """6 prompts through 4 slots: requests join and leave, so batches of 1-4 rows hit buckets
    1, 2 and 4, with padding rows and (ngram) trees smaller than the bucket."""
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    ref = _engine(tiny_target_dir, "off").generate(_prompts(), params)
    eng = _engine(tiny_target_dir, "static", algorithm, **kw)
    outs = eng.generate(_prompts(), params)
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]


def test_static_engine_eagle3_slices_aux_features(tmp_path, tiny_target_dir):
    """EAGLE-3 reads the fused aux-layer features of the accepted nodes from the padded output."""
    from test_eagle import write_checkpoint  # tests/unit is on sys.path (rootdir-relative imports)

    path = write_checkpoint(tmp_path / "e3", "eagle3")
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    ref = _engine(tiny_target_dir, "off").generate(_prompts(4), params)
    eng = _engine(tiny_target_dir, "static", "eagle3", batch=3, drafter_path=str(path), num_steps=3, topk=2,
                  num_draft_tokens=6)
    outs = eng.generate(_prompts(4), params)
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    off = _engine(tiny_target_dir, "off", "eagle3", batch=3, drafter_path=str(path), num_steps=3, topk=2,
                  num_draft_tokens=6).generate(_prompts(4), params)
    assert [o.accept_lengths for o in outs] == [o.accept_lengths for o in off]  # same drafts as eager


@pytest.mark.parametrize("graph_mode", ["static", "off"])
@pytest.mark.parametrize(("algorithm", "num_steps", "topk", "num_draft_tokens"),
                         [("eagle", 4, 2, 8), ("eagle3", 3, 1, 4), ("eagle3", 3, 4, 12), ("standalone", 3, 2, 6)])
def test_device_beam_builds_the_host_drafts_trees(tmp_path, tiny_target_dir, algorithm, num_steps, topk,
                                                  num_draft_tokens, graph_mode):
    """Every propose (the on-device beam: static, as `DraftGraphs` captures it, padded to its
    bucket; or eager, keys cut to the longest request) gives the trees the host's
    `DynamicTreeBuilder` gives for the same drafter state. Static buckets 1, 2, 4
    (cuda_graph_max_bs=4): 3 requests are padded to 4, 5 are drafted eagerly."""
    from test_eagle import write_checkpoint

    spec = dict(num_steps=num_steps, topk=topk, num_draft_tokens=num_draft_tokens)
    spec |= (dict(standalone_num_layers=2) if algorithm == "standalone"
             else dict(drafter_path=str(write_checkpoint(tmp_path / algorithm, algorithm))))
    eng = _engine(tiny_target_dir, graph_mode, algorithm, batch=5, cuda_graph_max_bs=4, **spec)
    drafter, compared, above = eng.drafter, [], []
    if graph_mode == "static":
        assert drafter.runner.graphs is not None and drafter.runner.graphs.batch_sizes == [1, 2, 4]
    propose = drafter.propose

    def both(seqs, shape):  # noqa: ANN001, ANN202
        proposal = propose(seqs, shape)
        host = TreeBatch.from_trees(drafter.draft_on_host(seqs, shape))  # the catch-up ran already
        assert proposal.tokens.shape == (len(seqs), num_draft_tokens)
        assert torch.equal(proposal.tokens, host.tokens) and torch.equal(proposal.parents, host.parents)
        assert torch.equal(proposal.mask, host.mask)
        (compared if len(seqs) <= 4 else above).append(len(seqs))  # in a graph bucket, or eager above them
        return proposal

    drafter.propose = both
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    ref = _engine(tiny_target_dir, "off")
    for n in (5, 3, 1):
        prompts = _prompts(6)[:n]
        assert ([o.token_ids for o in eng.generate(prompts, params)]
                == [o.token_ids for o in ref.generate(prompts, params)])
    assert set(compared) == {3, 1} and set(above) == {5}


@pytest.mark.parametrize("algorithm", ["eagle", "eagle3", "standalone"])
def test_an_adaptive_menus_shapes_come_from_the_captured_beam(tmp_path, tiny_target_dir, monkeypatch, algorithm):
    """Every drafting shape of the adaptive menu (the method's default shape, not pinned) is served
    by the draft graph of the largest (static buckets, as captured on a GPU), as its first nodes,
    and they are the host builder's tree for that shape: no shape drafts eagerly at a batch a
    bucket holds."""
    from test_eagle import write_checkpoint

    spec = (dict(standalone_num_layers=2) if algorithm == "standalone"
            else dict(drafter_path=str(write_checkpoint(tmp_path / algorithm, algorithm))))
    eng = _engine(tiny_target_dir, "static", algorithm, batch=4, **spec)
    eng = _engine(tiny_target_dir, "static", algorithm, batch=4, **spec)
    drafter, graphs = eng.drafter, eng.drafter.runner.graphs
    shapes = [s for s in eng.draft_plan.menu if s.drafts]
    assert len(shapes) > 2 and all(graphs.serves(s) for s in shapes)
    served, eager = graphs.__call__, []

    def bucket_or_eager(*args):  # noqa: ANN002, ANN202
        batch = served(*args)
        if batch is None:
            eager.append(args[0])
        return batch

    monkeypatch.setattr(drafter.runner, "draft", bucket_or_eager)
    propose, checked = drafter.propose, []

    def every_shape(seqs, shape):  # noqa: ANN001, ANN202
        for s in shapes:
            proposal = propose(seqs, s)
            host = TreeBatch.from_trees(drafter.draft_on_host(seqs, s))
            assert proposal.tokens.shape == (len(seqs), s.num_draft_tokens)
            for name in ("tokens", "parents", "depth", "mask", "first_child", "next_sibling", "num_draft_tokens"):
                assert torch.equal(getattr(proposal, name), getattr(host, name)), (s, name)
            checked.append(s)
        return propose(seqs, shape)

    drafter.propose = every_shape
    eng.generate(_prompts(3), SamplingParams(max_tokens=10, ignore_eos=True))
    assert set(checked) == set(shapes) and eager == []


@pytest.mark.parametrize("algorithm", ["ngram", "eagle3"])
def test_the_gpu_step_is_lossless_on_cpu(tmp_path, tiny_target_dir, monkeypatch, algorithm):
    """The GPU engine's code path, kernels included, on CPU: static buckets, the Triton attention
    backend and the fused layer kernels (all under the Triton interpreter), greedy output equal to
    the plain eager engine's at batch 3 in a 4-row bucket."""
    from test_eagle import write_checkpoint

    monkeypatch.setenv("SPECSERVE_FORCE_TRITON", "1")
    spec = dict(num_draft_tokens=6)
    if algorithm == "eagle3":
        spec |= dict(drafter_path=str(write_checkpoint(tmp_path / "e3", "eagle3")), num_steps=3, topk=2)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    prompts = _prompts(3)
    ref = _engine(tiny_target_dir, "off").generate(prompts, params)
    eng = Engine(EngineConfig(model_dir=str(tiny_target_dir), device="cpu", dtype="float32", max_batch_size=4,
                              max_seq_len=256, graph_mode="static", attention_backend="triton",
                              spec=SpecConfig(algorithm=algorithm, **spec)))
    eng.model.use_fused_kernels()
    outs = eng.generate(prompts, params)
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    assert algorithm == "ngram" or all(o.num_draft_tokens > 0 for o in outs)  # the drafts were verified


@pytest.mark.parametrize("algorithm", ["none", "eagle3", "standalone"])
def test_a_bucket_whose_capture_fails_runs_eagerly_and_the_engine_serves(tmp_path, tiny_target_dir, monkeypatch,
                                                                         caplog, algorithm):
    """With CUDA graphs on (`disable_cuda_graph` unset), every capture failing (as on the GPU where
    capture crashed): the engine builds, logs the cause once per runner, and its greedy output
    equals the plain eager engine's."""
    import dataclasses

    from test_eagle import write_checkpoint

    import specserve.runtime.cuda_graph as cuda_graph
    from specserve.runtime.plan import RuntimePlan

    attempts = []

    def failing_capture(fn, device, pool):
        attempts.append(device)
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

    plan = RuntimePlan.from_config
    monkeypatch.setattr(RuntimePlan, "from_config",
                        classmethod(lambda cls, c: dataclasses.replace(plan(c), capture=True)))
    monkeypatch.setattr(cuda_graph, "capture", failing_capture)
    monkeypatch.setattr(cuda_graph.torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(cuda_graph.torch.cuda, "memory_allocated", lambda device=None: 0)
    spec = dict(num_draft_tokens=6)
    if algorithm == "eagle3":
        spec |= dict(drafter_path=str(write_checkpoint(tmp_path / "e3", "eagle3")), num_steps=3, topk=2)
    elif algorithm == "standalone":
        spec |= dict(standalone_num_layers=2, num_steps=3, topk=2)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    ref = _engine(tiny_target_dir, "off").generate(_prompts(3), params)
    with caplog.at_level("WARNING", logger=cuda_graph.__name__):
        eng = _engine(tiny_target_dir, "static", algorithm, **spec)
    failures = [eng.runner.graphs.failures]
    if algorithm != "none":
        failures.append(eng.drafter.graphs.failures)
    assert len(attempts) == sum(len(f.keys) for f in failures) > 0
    for f in failures:
        assert list(f.causes) == ["RuntimeError: CUDA error: operation not permitted when stream is capturing"]
    warnings = [r.getMessage() for r in caplog.records if "failed, so it runs eagerly" in r.getMessage()]
    assert len(warnings) == len(failures)  # once per runner and cause, not once per bucket
    assert all(bk.graph is None for bk in eng.runner.graphs.buckets.values())
    outs = eng.generate(_prompts(3), params)
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
