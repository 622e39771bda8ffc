"""One real tritonserver for the whole e2e test run, on free ports, always reaped.

The server runs a temporary copy of model_repository/ with small limits (4 KV slots, 512-token
context) and float32, so greedy outputs do not depend on how requests happen to be batched
(bf16 matmuls do, on this CPU) and can be compared token for token with an in-process `Engine`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from specserve.serving.server import TritonProcess, copy_repository, default_repository, free_port, models_for

SLOTS = 4
MAX_SEQ_LEN = 512
DTYPE = "float32"
QUEUE = 16  # more than the 16 concurrent streams of one test minus the 4 slots
# the compiled programs from the first request on (tests/e2e/test_startup.py serves while they build), on
# every step, as the reference engine: outputs do not depend on which path start-up timings pick, and no
# model spends its start timing paths (the choice is the unit tests' subject; test_startup serves it)
ENGINE_PARAMS = {"max_batch_size": str(SLOTS), "max_seq_len": str(MAX_SEQ_LEN), "dtype": DTYPE,
                 "max_queue_size": str(QUEUE), "serve_while_compiling": "false", "compiled_steps": "always"}
VARIANTS = ("none", "ngram", "eagle", "eagle3", "mtp", "standalone", "suffix", "hybrid")


@dataclass(frozen=True)
class E2EConfig:
    slots: int = SLOTS
    max_seq_len: int = MAX_SEQ_LEN
    max_queue_size: int = QUEUE
    variants: tuple[str, ...] = ()

    @property
    def long_request_tokens(self) -> int:
        """max_tokens of the requests a test holds its slots with: as many as the context leaves after their
        prompts, so that none ends on its own while the test still counts on it being busy."""
        return self.max_seq_len - 64


@pytest.fixture(scope="session")
def e2e() -> E2EConfig:
    return E2EConfig(variants=VARIANTS)


@pytest.fixture(scope="session")
def engine_params() -> dict[str, str]:
    """config.pbtxt parameters of every llm model the e2e servers run."""
    return dict(ENGINE_PARAMS)


@pytest.fixture(scope="module")  # gone after the module: its engines hold gigabytes the later tests need
def server(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path, e2e: E2EConfig) -> Iterator[TritonProcess]:
    root = tmp_path_factory.mktemp("triton")
    chosen = list(e2e.variants)
    # drafting variants draft their configured tree on every step here, so the tests see drafts served;
    # the adaptive choice of shapes is tested on the engine (tests/model, tests/unit)
    overrides = {f"llm_{v}": ENGINE_PARAMS | ({"adaptive": "false"} if v != "none" else {}) for v in chosen}
    overrides["preprocessing"] = {"max_seq_len": str(MAX_SEQ_LEN)}
    repo = copy_repository(default_repository(), root / "model_repository", overrides)
    ports = [free_port() for _ in range(3)]
    process = TritonProcess(repo, models_for(chosen), *ports, log=root / "tritonserver.log")
    with process:
        yield process


@pytest.fixture(scope="session")
def tokenizer(smollm2_dir: Path):
    from specserve.serving.tokenizer import PromptTokenizer

    return PromptTokenizer(smollm2_dir)


@pytest.fixture(scope="module")
def reference_engine(smollm2_dir: Path):
    """The same engine as the server's, in this process (for greedy references): the compiled target
    forward, as served (its package comes from the same compile cache)."""
    from specserve.config import EngineConfig
    from specserve.engine.engine import Engine

    return Engine(EngineConfig(model_dir=str(smollm2_dir), max_batch_size=SLOTS, max_seq_len=MAX_SEQ_LEN, dtype=DTYPE,
                               cpu_compile=True, compiled_steps="always"))


@pytest.fixture(scope="session")
def mtbench_prompts() -> list[str]:
    from specserve.prompts import load_questions

    return load_questions("mtbench", 80)
