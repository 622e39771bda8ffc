"""Engines over the real SmolLM2-135M-Instruct, shared per module (loading takes a few seconds)."""

from __future__ import annotations

import pytest

from specserve.config import EngineConfig, SpecConfig
from specserve.engine.engine import Engine
from specserve.prompts import load_questions, render_chat


def make_engine(model_dir, algorithm="none", dtype="float32", max_batch_size=8, max_seq_len=1024, cpu_compile=False,
                **fields) -> Engine:
    """`fields`: SpecConfig's, or EngineConfig's other knobs."""
    own = {k: fields.pop(k) for k in list(fields) if k in EngineConfig.__dataclass_fields__}
    return Engine(EngineConfig(model_dir=str(model_dir), max_batch_size=max_batch_size, max_seq_len=max_seq_len,
                               device="cpu", dtype=dtype, cpu_compile=cpu_compile,
                               spec=SpecConfig(algorithm=algorithm, **fields), **({"compiled_steps": "always"} | own)))


@pytest.fixture(scope="session")
def engine_factory(smollm2_dir):
    """make_engine(algorithm=..., dtype=..., max_batch_size=..., **spec) on the real model."""
    return lambda **kw: make_engine(smollm2_dir, **kw)


@pytest.fixture(scope="module")
def engine(smollm2_dir) -> Engine:
    return make_engine(smollm2_dir)


@pytest.fixture(scope="session")
def mtbench_prompts(smollm2_dir) -> list[list[int]]:
    """MT-bench's first 20 first turns, chat template applied, as token ids."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    return [tok.encode(render_chat(str(smollm2_dir), q), add_special_tokens=False).ids
            for q in load_questions("mtbench", 20)]
