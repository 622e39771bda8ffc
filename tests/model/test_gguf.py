"""`load_format=gguf`: SmolLM2 computed from its GGUF's own Q4_1 / Q8_0 blocks, against the float32
reference of the same file (transformers' GGUF loader) and against itself under speculation. Skipped
where the kernel cannot run."""

from __future__ import annotations

import logging

import pytest
import torch

from specserve.config import SamplingParams
from specserve_kernels import gguf_gemm

pytestmark = pytest.mark.skipif(not (gguf_gemm.supported() and gguf_gemm.load()),
                                reason="needs an AVX2 + FMA + F16C CPU, g++ and ninja")

MAX_TOKENS = 32
PROMPTS = 8
GAP = 1e-3  # a divergence from the reference is accepted only where its top-2 logits are this close


@pytest.fixture(scope="module")
def gguf_engine(engine_factory):
    return engine_factory(load_format="gguf")


@pytest.fixture(scope="module")
def gguf_none(gguf_engine, mtbench_prompts) -> list[list[int]]:
    return [o.token_ids for o in gguf_engine.generate(mtbench_prompts[:PROMPTS], SamplingParams(max_tokens=MAX_TOKENS))]


def test_the_file_reader_gives_every_tensor_as_gguf_py_does(smollm2_gguf):
    """Our reader skips the metadata that gguf-py parses value by value; the tensors are the same bytes."""
    import numpy as np
    from gguf import GGUFReader

    from specserve.models.gguf import read_gguf

    ours = read_gguf(smollm2_gguf)
    theirs = {t.name: t for t in GGUFReader(str(smollm2_gguf)).tensors}
    assert set(ours) == set(theirs)
    for name, t in theirs.items():
        raw, qtype = ours[name]
        assert qtype == int(t.tensor_type), name
        want = torch.from_numpy(np.array(t.data)).reshape(-1).view(torch.uint8)
        assert torch.equal(raw.reshape(-1).view(torch.uint8), want), name


def test_the_blocks_hold_the_weights_the_prepared_checkpoint_rounds(smollm2_dir):
    """Every layer's blocks, dequantized, rounded to bf16, are the prepared bf16 checkpoint's weights:
    the names, the fused rows and llama.cpp's q / k row order are mapped as transformers maps them."""
    from specserve.models.gguf import load_llama_gguf
    from specserve.models.weights import load_llama

    blocks = load_llama_gguf(smollm2_dir)
    prepared = load_llama(smollm2_dir, torch.bfloat16)
    for name, weight in prepared.state_dict().items():
        module = blocks.get_submodule(name.rsplit(".", 1)[0])
        ours = module.dequantized() if isinstance(module, gguf_gemm.GGUFLinear) else module.weight
        assert torch.equal(ours.bfloat16(), weight), name
    assert isinstance(blocks.layers[0].mlp.gate_up_proj, gguf_gemm.GGUFLinear)
    assert blocks.embed_tokens.table is blocks.lm_head  # the tied table, read once


def test_greedy_on_the_blocks_is_the_float32_reference_of_the_file(smollm2_dir, smollm2_gguf, mtbench_prompts,
                                                                   gguf_none):
    """transformers' GGUF loader dequantizes the file to float32; our greedy tokens equal its greedy
    tokens, or where they part, its top-2 logits there are within `GAP` (reported, never hidden)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name,
                                                 dtype=torch.float32).eval()
    divergences = []
    for prompt, ours in zip(mtbench_prompts[:PROMPTS], gguf_none):
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                 output_scores=True, return_dict_in_generate=True, pad_token_id=0)
        ref = out.sequences[0, len(prompt):].tolist()
        if ours == ref:
            continue
        i = next((j for j, (a, b) in enumerate(zip(ours, ref)) if a != b), min(len(ours), len(ref)))
        top2 = out.scores[i][0].topk(2).values
        divergences.append((i, float(top2[0] - top2[1])))
    print("divergences (position, reference top-2 gap):", divergences)
    assert all(gap < GAP for _, gap in divergences), divergences


@pytest.mark.parametrize("algorithm", ["ngram", "eagle", "eagle3", "mtp", "standalone", "suffix", "hybrid"])
def test_speculation_on_the_blocks_is_lossless(engine_factory, mtbench_prompts, gguf_none, algorithm):
    """A tree verification computes each row as a decode does (the kernel's rows are independent), so
    speculation on the 4-bit path gives its own greedy tokens (the served tree, pinned: drafts every step)."""
    from specserve.serving.repository import served_drafter

    engine = engine_factory(algorithm=algorithm, load_format="gguf", adaptive=False, **served_drafter(algorithm))
    outs = engine.generate(mtbench_prompts[:PROMPTS], SamplingParams(max_tokens=MAX_TOKENS))
    assert [o.token_ids for o in outs] == gguf_none
    assert sum(o.num_accepted_tokens for o in outs) > 0


@pytest.mark.skipif(gguf_gemm.default_layout(gguf_gemm.Q4_1) != gguf_gemm.INT_LAYOUT,
                    reason="only the integer layout rounds activations (AVX-512 VNNI)")
def test_activations_rounded_to_8_bits_stay_lossless_on_the_compiled_programs(engine_factory, mtbench_prompts):
    """q8 rounds each block of a layer's activations to 8 bits, which would turn the last-bit differences
    between two ways of computing a token into different tokens: every forward runs the compiled programs
    (the eager path is never explored), which compute a token the same bit for bit whatever else is in the
    call (a tree's other rows, other requests) and however its prompt was chunked. Here the plain engine
    prefills in chunks of 24 tokens and decodes up to 4 requests a step; the drafting one prefills whole
    prompts and verifies 4 x 5 rows a step (past the step program's rows: the prefill program's path)."""
    prompts, params = mtbench_prompts[:6], SamplingParams(max_tokens=40)
    plain = engine_factory(load_format="gguf", cpu_compile=True, max_batch_size=4, max_num_batched_tokens=24,
                           compiled_steps="auto")  # gguf_activations auto: q8 where the programs run
    assert gguf_gemm.activation_digits(plain.model) == (1,) and plain.runner.paths.compiled_only
    want = [o.token_ids for o in plain.generate(prompts, params)]
    assert plain.runner.paths.chosen["eager"] == 0
    drafting = engine_factory(algorithm="ngram", load_format="gguf", gguf_activations="q8", cpu_compile=True,
                              max_batch_size=4, compiled_steps="auto", adaptive=False, num_steps=4, topk=1,
                              num_draft_tokens=5)
    outs = drafting.generate(prompts, params)
    assert [o.token_ids for o in outs] == want
    assert sum(o.num_accepted_tokens for o in outs) > 0 and drafting.runner.paths.chosen["eager"] == 0


def test_rounded_activations_without_compiled_programs_keep_float32s_precision(engine_factory, caplog):
    """The eager forward is not the compiled one bit for bit: without the programs the layers keep every
    digit (whose last-bit differences change no greedy token), and the log says so."""
    with caplog.at_level(logging.WARNING, logger="specserve.runtime.target"):
        engine = engine_factory(load_format="gguf", gguf_activations="q8", cpu_compile=False)
    assert gguf_gemm.activation_digits(engine.model) in ((), (gguf_gemm.EXACT_DIGITS,))
    assert not engine.runner.paths.compiled_only
    if gguf_gemm.activation_digits(engine.model):
        assert "needs the compiled CPU programs" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="specserve.runtime.target"):  # auto: q8 only where it runs
        engine = engine_factory(load_format="gguf", cpu_compile=False)
    assert gguf_gemm.activation_digits(engine.model) in ((), (gguf_gemm.EXACT_DIGITS,)) and not caplog.text


def test_auto_serves_the_blocks_where_they_run_and_the_checkpoint_elsewhere(smollm2_dir, tmp_path):
    from specserve.config import EngineConfig

    auto = EngineConfig(model_dir=str(smollm2_dir), device="cpu")
    assert (auto.load_format, auto.dtype) == ("gguf", "float32")
    asked_bf16 = EngineConfig(model_dir=str(smollm2_dir), device="cpu", dtype="bfloat16")
    assert asked_bf16.load_format == "safetensors"
    (tmp_path / "config.json").write_text("{}")  # a directory without model.gguf
    assert EngineConfig(model_dir=str(tmp_path), device="cpu").load_format == "safetensors"
    with pytest.raises(ValueError, match="float32"):
        EngineConfig(model_dir=str(smollm2_dir), device="cpu", dtype="bfloat16", load_format="gguf")
    assert EngineConfig(model_dir=str(smollm2_dir), device="cpu", load_format="gguf").dtype == "float32"
