"""The GPU path on SmolLM2 (or a random-weight model of its shape, `conftest.gpu_model_dir`) and on
Llama-3.1-8B's width in 2 layers: CUDA graphs, every bucket captured, the Triton and flashinfer
attention backends, against the eager torch path, for every algorithm.

Every test here is marked `gpu` and skipped without CUDA (tests/conftest.py). The Triton kernels
are checked on the GPU by tests/kernels/ itself, which launches them on CUDA tensors when CUDA
is present. Run with `bench/gpu/check.sh` (or `pytest tests/gpu tests/kernels` on a CUDA machine).
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from specserve.config import EngineConfig, SamplingParams, SpecConfig
from specserve.engine.engine import Engine
from specserve.engine.verification import Verifier
from specserve.grammar import GrammarSpec
from specserve.models.attention import flashinfer_available
from specserve.prompts import load_questions, render_chat

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

PARAMS = SamplingParams(max_tokens=48, ignore_eos=True)


def _engine(model_dir, algorithm="none", dtype="float32", batch=4, **kw) -> Engine:
    spec = SpecConfig(algorithm=algorithm, num_draft_tokens=8 if algorithm != "none" else 0)
    return Engine(EngineConfig(model_dir=str(model_dir), device="cuda", dtype=dtype, max_batch_size=batch,
                               max_seq_len=1024, spec=spec, **kw))


def assert_captured(engine: Engine, drafts: bool = False) -> None:
    """Every CUDA-graph bucket of the target (and, with `drafts`, of the drafter) captured: a failed
    capture runs eagerly, and its step would pass for a graph's."""
    graphs = engine.runner.graphs
    assert graphs is not None and graphs.failures.keys == [] and graphs.num_captured == len(graphs.buckets) > 0
    if drafts:
        drafted = engine.drafter.graphs
        assert drafted is not None and drafted.failures.keys == [] and drafted.num_captured == len(drafted.buckets) > 0


@pytest.fixture(scope="module")
def prompts(gpu_model_dir, gpu_dataset) -> list[list[int]]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(gpu_model_dir / "tokenizer.json"))
    return [tok.encode(render_chat(str(gpu_model_dir), q), add_special_tokens=False).ids
            for q in load_questions(gpu_dataset, 6)]


@pytest.mark.parametrize("algorithm", ["none", "ngram"])
def test_cuda_graphs_equal_eager(gpu_model_dir, prompts, algorithm):
    """fp32: a captured graph with the Triton attention kernel gives the eager torch forward's tokens."""
    eager = _engine(gpu_model_dir, algorithm, graph_mode="off", attention_backend="torch")
    graphs = _engine(gpu_model_dir, algorithm, graph_mode="auto", attention_backend="triton")
    assert_captured(graphs)
    ref = eager.generate(prompts, PARAMS)
    out = graphs.generate(prompts, PARAMS)
    assert [o.token_ids for o in out] == [r.token_ids for r in ref]


def _spec(algorithm: str) -> SpecConfig:
    from specserve.serving.repository import served_drafter

    shape = {"none": {}, "mtp": dict(num_steps=1, topk=2, num_draft_tokens=3)}.get(
        algorithm, dict(num_steps=5, topk=4, num_draft_tokens=8))
    return SpecConfig(algorithm=algorithm, **served_drafter(algorithm), **shape)


@pytest.mark.parametrize("algorithm", ["eagle", "eagle3", "mtp", "standalone"])
def test_captured_drafts_equal_eager(gpu_model_dir, prompts, algorithm):
    """fp32: with graphs on (the target's buckets and the drafter's whole multi-step draft replayed
    from CUDA graphs), the eager engine's tokens and accept lengths."""
    engines = [Engine(EngineConfig(model_dir=str(gpu_model_dir), device="cuda", dtype="float32", max_batch_size=4,
                                   max_seq_len=1024, spec=_spec(algorithm), graph_mode=mode, attention_backend="torch"))
               for mode in ("off", "auto")]
    assert_captured(engines[1], drafts=True)
    ref, out = (e.generate(prompts, PARAMS) for e in engines)
    assert [o.token_ids for o in out] == [r.token_ids for r in ref]
    assert [o.accept_lengths for o in out] == [r.accept_lengths for r in ref]


@pytest.mark.parametrize("algorithm", ["ngram", "eagle", "eagle3", "mtp", "standalone", "suffix", "hybrid"])
def test_greedy_speculation_equals_none_with_graphs(gpu_model_dir, random_weights, prompts, algorithm):
    """fp32, graphs on, the Triton attention kernel: every algorithm's greedy output is `none`'s."""
    def engine(spec: SpecConfig) -> Engine:
        return Engine(EngineConfig(model_dir=str(gpu_model_dir), device="cuda", dtype="float32", max_batch_size=4,
                                   max_seq_len=1024, spec=spec, attention_backend="triton"))

    ref = engine(_spec("none")).generate(prompts, PARAMS)
    spec = engine(_spec(algorithm))
    assert_captured(spec)
    out = spec.generate(prompts, PARAMS)
    assert [o.token_ids for o in out] == [r.token_ids for r in ref]
    assert sum(o.num_draft_tokens for o in out) > 0
    assert random_weights or any(o.num_accepted_tokens > 0 for o in out)


def test_steps_issue_no_host_sync_inside_the_forward(gpu_model_dir, prompts):
    """A bf16 decode step with graphs: the forward replays without a synchronizing call."""
    eng = _engine(gpu_model_dir, "none", "bfloat16", attention_backend="triton")
    eng.generate(prompts[:1], SamplingParams(max_tokens=4, ignore_eos=True))
    fn = eng.runner.graphs
    assert fn is not None
    bk = fn.buckets[(1, 1)]
    torch.cuda.set_sync_debug_mode("error")
    try:
        bk.graph.replay()
    finally:
        torch.cuda.set_sync_debug_mode("default")


SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                          "nights": {"type": "integer", "minimum": 1, "maximum": 30}},
          "required": ["city", "nights"], "additionalProperties": False}


def syncs_while_the_forward_runs(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> list[int]:
    """Per verify step, the synchronising CUDA calls between its forward's launch (`runner.step`
    returning) and the step's one host read (`Verifier._read`, itself not counted)."""
    counts: list[int] = []
    opened: list[int] = []  # where the open step's window began among the recorded warnings
    step, read = engine.runner.step, Verifier.__dict__["_read"]

    def launch(*args, **kwargs):
        out = step(*args, **kwargs)
        opened.append(len(caught))
        torch.cuda.set_sync_debug_mode("warn")
        return out

    def host_read(rows: torch.Tensor) -> list[list[int]]:
        if opened:  # a verify step's read (a prefill's first tokens open no window)
            torch.cuda.set_sync_debug_mode("default")
            counts.append(sum("synchroniz" in str(w.message) for w in caught[opened.pop():]))
        return read.__func__(rows)

    engine.runner.step = launch
    Verifier._read = staticmethod(host_read)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            engine.generate(prompts, params)
    finally:
        torch.cuda.set_sync_debug_mode("default")
        Verifier._read = read
        del engine.runner.step  # the class's method again
    return counts


@pytest.mark.parametrize("algorithm", ["none", "ngram", "suffix"])
def test_a_grammar_adds_no_host_sync_while_the_forward_runs(gpu_model_dir, prompts, algorithm):
    """bf16, graphs on: under a JSON schema each verify step's masks are built on the host and copied
    to the GPU without a synchronising call between the forward's launch and the step's one read, as
    in a step without a grammar: the grammar leaves the GPU no idle time."""
    pytest.importorskip("xgrammar", reason="structured outputs need xgrammar (make gpu-stage carries its wheels)")
    if json.loads((gpu_model_dir / "tokenizer.json").read_text())["model"]["type"] != "BPE":
        pytest.skip("the random model's word-level tokenizer cannot spell JSON: needs the staged SmolLM2")
    eng = _engine(gpu_model_dir, algorithm, "bfloat16", attention_backend="triton")
    plain = syncs_while_the_forward_runs(eng, prompts[:4], SamplingParams(max_tokens=24))
    grammar = SamplingParams(max_tokens=24, structured_output=GrammarSpec("json_schema", json.dumps(SCHEMA)))
    structured = syncs_while_the_forward_runs(eng, prompts[:4], grammar)
    assert plain and structured and eng.verifier.grammar_nodes > 0
    assert max(structured) == max(plain) == 0, f"syncs a step: {structured} under the grammar, {plain} without"


@pytest.mark.skipif(not flashinfer_available(), reason="flashinfer is not installed")
@pytest.mark.parametrize("graph_mode", ["off", "auto"])
def test_flashinfer_logits_close_to_torch(gpu_model_dir, graph_mode):
    """bf16: one tree-verify forward through flashinfer (eager and in a graph) vs torch SDPA."""
    ref_engine = _engine(gpu_model_dir, "ngram", "bfloat16", graph_mode=graph_mode, attention_backend="torch")
    fi_engine = _engine(gpu_model_dir, "ngram", "bfloat16", graph_mode=graph_mode, attention_backend="flashinfer")
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, 40000, (300,), generator=g).tolist()
    first = [e.generate([prompt], SamplingParams(max_tokens=1))[0] for e in (ref_engine, fi_engine)]
    assert first[0].token_ids == first[1].token_ids
    outs = [e.generate([prompt] * 3, PARAMS) for e in (ref_engine, fi_engine)]
    same = sum(a.token_ids == b.token_ids for a, b in zip(*outs))
    assert same >= 2, "bf16 flashinfer should agree with torch on most greedy continuations"


@pytest.mark.skipif(not flashinfer_available(), reason="flashinfer is not installed")
def test_flashinfer_graphs_lossless_speculation(gpu_model_dir, prompts):
    """The production GPU configuration (flashinfer + graphs, bf16): greedy ngram equals greedy
    none under the same configuration, on most prompts (bf16 batch-shape effects aside)."""
    base = _engine(gpu_model_dir, "none", "bfloat16").generate(prompts, PARAMS)
    spec = _engine(gpu_model_dir, "ngram", "bfloat16").generate(prompts, PARAMS)
    same = sum(a.token_ids == b.token_ids for a, b in zip(base, spec))
    assert same >= len(prompts) // 2


@pytest.mark.parametrize("algorithm", ["none", "ngram"])
def test_llama8b_width_graphs_equal_eager(llama8b_width_dir, algorithm):
    """fp32 at Llama-3.1-8B's width (hidden 4096, head dim 128, 32 / 8 heads, 128k vocabulary), 2
    layers: captured graphs with the Triton attention kernel give the eager torch forward's tokens."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(10, 128000, (n,), generator=g).tolist() for n in (7, 40, 150)]
    prompts[1] = prompts[1][:10] * 4  # repeats give NGRAM something to draft
    eager = _engine(llama8b_width_dir, algorithm, graph_mode="off", attention_backend="torch", batch=3)
    graphs = _engine(llama8b_width_dir, algorithm, graph_mode="auto", attention_backend="triton", batch=3)
    assert_captured(graphs)
    ref, out = (e.generate(prompts, PARAMS) for e in (eager, graphs))
    assert [o.token_ids for o in out] == [r.token_ids for r in ref]
