"""Frozen configuration, built once at the edge (CLI flags, config.pbtxt parameters, HF config.json).

Nothing below the edge reads raw dicts or environment variables: it receives one of these.
Validation errors are `ValueError`s whose message starts with the offending field's name, so a
server can hand them back to the client unchanged.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

ALGORITHMS = ("none", "ngram", "eagle", "eagle3", "mtp", "standalone")
GRAPH_MODES = ("auto", "off", "static")
STEP_MATMULS = ("auto", "inductor")
ATTENTION_BACKENDS = ("auto", "torch", "flashinfer")
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def resolve_device(device: str) -> str:
    """'auto' (or empty) -> 'cuda' when torch sees a GPU, else 'cpu'; anything else unchanged."""
    if device in ("", "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


@dataclass(frozen=True)
class ModelConfig:
    """The target's architecture, read from an HF `config.json` (Llama family; Qwen2 adds qkv bias)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"model_dir: no config.json in {model_dir}")
        cfg = json.loads(path.read_text())
        model_type = cfg.get("model_type", "llama")
        if model_type not in ("llama", "qwen2", "mistral"):
            raise ValueError(f"model_type: {model_type!r} is not supported (llama, qwen2, mistral)")
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        rope_theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
        if rope.get("rope_type", "default") not in ("default", None):
            raise ValueError(f"rope_parameters: rope_type {rope.get('rope_type')!r} is not supported")
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        num_heads = cfg["num_attention_heads"]
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads", num_heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", model_type == "qwen2"),
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
        )

    def default_aux_layers(self) -> tuple[int, int, int]:
        """EAGLE-3's fused target layers: the inputs of layers 2, N/2 and N-3."""
        n = self.num_layers
        return (2, n // 2, n - 3)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding parameters. temperature == 0 means greedy.

    Penalties as vLLM applies them, before temperature: repetition_penalty divides positive
    (multiplies negative) logits of every token already in the prompt or the output;
    frequency_penalty subtracts per occurrence in the output, presence_penalty once per token
    that occurred in the output.
    """

    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = disabled
    seed: int | None = None
    stop: tuple[str, ...] = ()
    min_tokens: int = 0
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # per output token: its log-probability and this many top alternatives

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise ValueError(f"max_tokens: must be a positive integer, got {self.max_tokens!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature: must be >= 0, got {self.temperature!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p!r}")
        if self.top_k < 0:
            raise ValueError(f"top_k: must be >= 0 (0 disables it), got {self.top_k!r}")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens: must be in [0, max_tokens], got {self.min_tokens!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop: every stop string must be a non-empty string")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not math.isfinite(value) or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name}: must be in [-2, 2], got {value!r}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs: must be in [0, 20], got {self.logprobs!r}")
        if not math.isfinite(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty: must be > 0, got {self.repetition_penalty!r}")

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding knobs; one name per concept, as SGLang names them.

    num_steps: draft depth; topk: branching per step; num_draft_tokens: tree size verified,
    root included. `for_model` fills unset values with SGLang's defaults.
    """

    algorithm: str = "none"
    num_steps: int = 0
    topk: int = 0
    num_draft_tokens: int = 0
    drafter_path: str | None = None
    token_map: str | None = None  # FR-Spec hot token ids for EAGLE-1/2 (SGLang: --speculative-token-map)
    standalone_num_layers: int = 0  # standalone without drafter_path: the target's first k layers (0 = N/4)
    # plain decoding for a step whose batch has at least this many requests (0 = never); vLLM's
    # --speculative-disable-by-batch-size: where a verify forward of many trees is no longer free
    disable_by_batch_size: int = 0
    # choose each step's tree among smaller budgets of the configured one (plain decoding included)
    # from measured step costs and acceptance; setting num_steps, topk or num_draft_tokens pins the shape
    adaptive: bool = True
    # NGRAM (SGLang's names and defaults)
    ngram_min_match_window: int = 2  # SGLang: 1. Measured on MT-bench: same accept gain, 1/5 the drafts
    ngram_max_match_window: int = 12
    ngram_min_bfs_breadth: int = 1
    ngram_max_bfs_breadth: int = 10
    ngram_match_type: str = "BFS"
    ngram_branch_length: int = 18
    ngram_capacity: int = 1_000_000

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm: {self.algorithm!r} is not one of {', '.join(ALGORITHMS)}")
        for name in ("num_steps", "topk", "num_draft_tokens", "disable_by_batch_size"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")
        if self.ngram_match_type not in ("BFS", "PROB"):
            raise ValueError(f"ngram_match_type: must be BFS or PROB, got {self.ngram_match_type!r}")

    def resolved(self) -> SpecConfig:
        """Fill unset (0) values with SGLang's defaults: Llama (5, 4, 8); NGRAM 12 draft tokens;
        MTP with nothing set: one step with its two likeliest tokens (1, 2, 3)."""
        if self.algorithm == "none":
            return SpecConfig(algorithm="none", num_steps=0, topk=1, num_draft_tokens=1)
        if self.algorithm == "ngram":
            n = self.num_draft_tokens or 12
            return replace(self, num_draft_tokens=n, num_steps=self.num_steps or n - 1, topk=self.topk or 1)
        if self.algorithm == "mtp" and not (self.num_steps or self.topk or self.num_draft_tokens):
            # one MTP step, as DeepSeek-V3 is usually served, with its two likeliest tokens: adaptive
            # speculation then chooses per step between none, the top token (1/2/2) and both (1/2/3)
            return replace(self, num_steps=1, topk=2, num_draft_tokens=3)
        steps, topk = self.num_steps or 5, self.topk or 4
        n = self.num_draft_tokens or (steps + 1 if topk == 1 else 8)
        if topk == 1:
            n = steps + 1
        return replace(self, num_steps=steps, topk=topk, num_draft_tokens=n)


@dataclass(frozen=True)
class EngineConfig:
    """What the engine is built from.

    max_batch_size: KV-cache slots, i.e. requests decoded together; more wait in a queue.
    max_seq_len: prompt + generated tokens per request (the cache is slots × max_seq_len).
    max_queue_size: requests that may wait for a slot; beyond it `add_request` refuses (0 = no bound).
    request_timeout_s: a request still unfinished this long after it arrived ends with
    finish_reason "timeout" (0 = never).
    """

    model_dir: str
    max_batch_size: int = 8
    max_seq_len: int = 2048
    dtype: str = "bfloat16"
    device: str = "cpu"
    spec: SpecConfig = field(default_factory=SpecConfig)
    num_threads: int | None = None
    attention_backend: str = "auto"  # torch | flashinfer | auto (flashinfer on CUDA when installed)
    graph_mode: str = "auto"  # auto: CUDA graphs on CUDA | off | static: bucketed forward, no capture
    cuda_graph_max_bs: int = 0  # largest captured batch size (0 = max_batch_size)
    # on CPU, run the target's forwards through its AOTInductor-compiled program (models/compiled.py);
    # off here, on in the CLI and the served configs (their disable_cpu_compile switch)
    cpu_compile: bool = False
    compile_cache_dir: str = ""  # compiled programs kept across restarts ("" = ~/.cache/specserve/compiled)
    # with cpu_compile: which steps (decode, tree verify) run the compiled step program. auto: per
    # batch-size bucket and tree size, whichever of it and the eager forward is faster, timed at
    # start-up and on every step (on some CPUs oneDNN's eager bf16 matmuls win); always: every step
    # the program covers
    compiled_steps: str = "auto"
    # with cpu_compile: the matmuls of the few-row programs (target steps, draft heads). auto: the
    # AVX2 few-row kernel in float32 where it builds and runs (specserve_kernels.few_row_gemm), else
    # inductor's autotuned ones; inductor: always inductor's
    step_matmul: str = "auto"
    profile: bool = False  # on CUDA, synchronize around each step phase so StepProfile is exact
    max_queue_size: int = 0
    request_timeout_s: float = 0.0

    def __post_init__(self) -> None:
        if self.compiled_steps not in ("auto", "always"):
            raise ValueError(f"compiled_steps: must be auto or always, got {self.compiled_steps!r}")
        if self.step_matmul not in STEP_MATMULS:
            raise ValueError(f"step_matmul: must be one of {', '.join(STEP_MATMULS)}, got {self.step_matmul!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.max_batch_size <= 0:
            raise ValueError(f"max_batch_size: must be positive, got {self.max_batch_size}")
        if self.max_seq_len <= 0:
            raise ValueError(f"max_seq_len: must be positive, got {self.max_seq_len}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend: must be one of {', '.join(ATTENTION_BACKENDS)}, got {self.attention_backend!r}"
            )
        if self.graph_mode not in GRAPH_MODES:
            raise ValueError(f"graph_mode: must be one of {', '.join(GRAPH_MODES)}, got {self.graph_mode!r}")
        if self.cuda_graph_max_bs < 0:
            raise ValueError(f"cuda_graph_max_bs: must be >= 0, got {self.cuda_graph_max_bs}")
        if self.max_queue_size < 0:
            raise ValueError(f"max_queue_size: must be >= 0, got {self.max_queue_size}")
        if self.request_timeout_s < 0:
            raise ValueError(f"request_timeout_s: must be >= 0, got {self.request_timeout_s}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def compile_cache_path(self) -> Path:
        return Path(self.compile_cache_dir) if self.compile_cache_dir else Path.home() / ".cache/specserve/compiled"
