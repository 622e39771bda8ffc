"""Frozen configuration, built once at the edge (CLI flags, config.pbtxt parameters, HF config.json).

Nothing below the edge reads raw dicts or environment variables: it receives one of these.
Validation errors are `ValueError`s whose message starts with the offending field's name, so a
server can hand them back to the client unchanged.

Every `EngineConfig` and `SpecConfig` field is an engine knob declared once, with its `Knob`
(help, choices, edge name): the `specserve generate/bench` flags, the llm_<variant> config.pbtxt
parameters and the parameter table of model_repository/README.md are generated from `knobs()`.
The training commands' configs (`training.configs`, `training.regenerate`) declare their fields
the same way, and their flags are generated from `config_knobs(cls)`.
"""

from __future__ import annotations

import functools
import math
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from specserve.grammar import GrammarSpec
from specserve.hardware import auto_dtype, auto_load_format
from specserve.knobs import Knob, check_choices, config_knobs, knob, knob_of, shown
from specserve.methods import ALGORITHMS, METHODS, Method, canonical

if typing.TYPE_CHECKING:
    import torch

GRAPH_MODES = ("auto", "off", "static")
STEP_MATMULS = ("auto", "inductor")
COMPILED_STEPS = ("auto", "always")
LOAD_FORMATS = ("auto", "safetensors", "gguf")
NGRAM_MATCH_TYPES = ("BFS", "PROB")
ATTENTION_BACKENDS = ("auto", "torch", "triton", "flashinfer")
DRAFT_QUANTIZATIONS = ("auto", "unquant", "q8_0")  # SGLang's --speculative-draft-model-quantization
DTYPES = ("bfloat16", "float32", "float16")  # torch dtypes by name (torch is imported where one is used)
# max_num_batched_tokens by default: small on a CPU, whose forward time grows with every prompt
# token the decoding streams wait behind; large on a GPU, whose forward time hardly grows below
# thousands of tokens
CPU_BATCHED_TOKENS = 512
GPU_BATCHED_TOKENS = 8192


def resolve_device(device: str) -> str:
    """'auto' (or empty) -> 'cuda' when torch sees a GPU, else 'cpu'; anything else unchanged."""
    if device in ("", "auto"):
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding parameters. temperature == 0 means greedy; a temperature below
    `SAMPLING_EPS` decodes greedily too (it is stored as 0.0), as vLLM does.

    Penalties as vLLM applies them, before temperature: repetition_penalty divides positive
    (multiplies negative) logits of every token already in the prompt or the output;
    frequency_penalty subtracts per occurrence in the output, presence_penalty once per token
    that occurred in the output. cache_salt (vLLM's name): requests with different salts never
    share cached prompt prefixes, nor drafts learned from each other's text.

    Every field's type is checked, strictly: an int field takes an int (not a bool), a float field
    an int or a finite float (not a bool; stored as a float), so no request can build parameters
    the engine's step would fail on. Each error is a ValueError whose message starts with the field.
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
    cache_salt: str | None = None  # at most MAX_CACHE_SALT_CHARS characters, non-empty
    structured_output: GrammarSpec | None = None  # the grammar every output token must follow

    SAMPLING_EPS = 1e-5  # vLLM's: a lower temperature decodes greedily (1e-40 would overflow the logits)
    MAX_CACHE_SALT_CHARS = 256
    _INT_FIELDS = ("max_tokens", "top_k", "min_tokens")
    _FLOAT_FIELDS = ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty")

    def __post_init__(self) -> None:
        self._check_types()
        self._check_ranges()
        if self.temperature < self.SAMPLING_EPS:
            object.__setattr__(self, "temperature", 0.0)

    @staticmethod
    def _is_int(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    def _float(self, name: str) -> float:
        """The float field `name` as a finite float."""
        value = getattr(self, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{name}: must be a number, got {shown(value)}")
        try:
            number = float(value)
        except OverflowError:
            number = math.inf
        if not math.isfinite(number):
            raise ValueError(f"{name}: must be a finite number, got {shown(value)}")
        return number

    def _check_types(self) -> None:
        for name in self._INT_FIELDS:
            if not self._is_int(getattr(self, name)):
                raise ValueError(f"{name}: must be an integer, got {shown(getattr(self, name))}")
        for name in self._FLOAT_FIELDS:
            object.__setattr__(self, name, self._float(name))
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos: must be true or false, got {shown(self.ignore_eos)}")
        if self.seed is not None and not (self._is_int(self.seed) and 0 <= self.seed < 2**64):
            raise ValueError(f"seed: must be an integer in [0, 2**64) or None, got {shown(self.seed)}")
        if self.logprobs is not None and not self._is_int(self.logprobs):
            raise ValueError(f"logprobs: must be an integer or None, got {shown(self.logprobs)}")
        if not isinstance(self.stop, tuple) or any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop: must be a tuple of non-empty strings, got {shown(self.stop)}")
        if self.structured_output is not None and not isinstance(self.structured_output, GrammarSpec):
            raise ValueError(f"structured_output: must be a GrammarSpec or None, got {shown(self.structured_output)}")
        salt = self.cache_salt
        if salt is not None and not (isinstance(salt, str) and 0 < len(salt) <= self.MAX_CACHE_SALT_CHARS):
            raise ValueError(f"cache_salt: must be a non-empty string of at most {self.MAX_CACHE_SALT_CHARS} "
                             f"characters, got {shown(salt)}")

    def _check_ranges(self) -> None:
        if self.max_tokens <= 0:
            raise ValueError(f"max_tokens: must be a positive integer, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature: must be >= 0, got {self.temperature!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p!r}")
        if self.top_k < 0:
            raise ValueError(f"top_k: must be >= 0 (0 disables it), got {self.top_k!r}")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens: must be in [0, max_tokens], got {self.min_tokens!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name}: must be in [-2, 2], got {value!r}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs: must be in [0, 20], got {self.logprobs!r}")
        if self.repetition_penalty <= 0:
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
    root included. `resolved` fills unset values with SGLang's defaults; a resolved shape beyond
    the kernels' tree limit is refused here (`draft_plan` works out the rest of it).
    """

    algorithm: str = knob("none", choices=ALGORITHMS, help="the drafting method (none = plain decoding)",
                          no_flag="generate takes --variant, a served variant's name; bench --algorithm, a list")
    num_steps: int = knob(0, help="draft depth (0 = SGLang's default)")
    topk: int = knob(0, help="branching per draft step (0 = SGLang's default)")
    num_draft_tokens: int = knob(0, help="tree size verified, root included (0 = SGLang's default)")
    drafter_path: str | None = knob(None, path=True, help="the drafter: an EAGLE-1/2/3 or MTP head, or "
                                    "the standalone method's draft model (empty: none; that method then drafts with "
                                    "the target's first standalone_num_layers layers)")
    token_map: str | None = knob(None, path=True, help="FR-Spec hot token ids (.pt) for EAGLE-1/2 "
                                 "(SGLang's --speculative-token-map)")
    standalone_num_layers: int = knob(0, help="standalone without drafter_path: the target's first k layers "
                                      "draft (0 = a quarter of them)")
    disable_by_batch_size: int = knob(0, help="plain decoding for a step whose batch has at least this many requests, "
                                      "where a verify forward of many trees is no longer free (0 = never; vLLM's "
                                      "--speculative-disable-by-batch-size)")
    adaptive: bool = knob(True, help="each step drafts the tree (or none) among smaller num_draft_tokens than the "
                          "configured one that measured step costs and acceptance say is fastest; setting num_steps, "
                          "topk or num_draft_tokens pins one shape")
    draft_model_quantization: str = knob("auto", choices=DRAFT_QUANTIZATIONS, help="a draft head's (EAGLE, MTP) "
                                         "linears: q8_0 = 8-bit GGUF blocks (drafts only rank candidates: output "
                                         "unchanged); unquant = the checkpoint's weights; auto = q8_0 where the head "
                                         "runs in float32 on a CPU")
    # NGRAM: SGLang's names and defaults
    ngram_min_match_window: int = knob(2, help="shortest suffix looked up (SGLang: 1; measured on MT-bench: the "
                                       "same accept gain from a fifth of the drafts)")
    ngram_max_match_window: int = knob(12, help="longest suffix looked up")
    ngram_min_bfs_breadth: int = knob(1, help="BFS: the fewest children a draft node takes (long matches, deep levels)")
    ngram_max_bfs_breadth: int = knob(10, help="BFS: the most children a draft node takes (short matches); PROB: "
                                      "children offered per node")
    ngram_match_type: str = knob("BFS", choices=NGRAM_MATCH_TYPES, help="BFS: level by level, breadth by match "
                                 "length; PROB: best first by path frequency")
    ngram_branch_length: int = knob(18, help="tokens stored after each position (must exceed ngram_max_match_window)")
    ngram_capacity: int = knob(1_000_000, help="n-gram trie nodes per request; the least recent leaves go first")
    # suffix decoding: Arctic Inference's (vLLM's suffix_decoding_*) where it has the knob
    suffix_cache_tokens: int = knob(65536, help="tokens of finished requests' prompts and outputs kept to draft "
                                    "from, all cache salts together; the least recently served go first")
    suffix_max_depth: int = knob(24, help="longest suffix matched, and deepest draft")
    suffix_max_spec_factor: float = knob(1.0, help="a draft is at most this many times as deep as its match is long")
    suffix_min_token_prob: float = knob(0.1, help="a draft token's least share of the matches that continue with it")
    suffix_min_match: int = knob(2, help="the fewest last tokens that must match before anything is drafted")

    def __post_init__(self) -> None:
        object.__setattr__(self, "algorithm", canonical(self.algorithm))  # an alias -> the method's name
        check_choices(self)
        for name in ("num_steps", "topk", "num_draft_tokens", "disable_by_batch_size"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")
        m = self.method
        if m.drafts:
            _check_tree_limits(*m.shape(self.num_steps, self.topk, self.num_draft_tokens), self.num_draft_tokens)
        _check_ngram(self)  # whichever method runs: a bad value is an error, not ignored
        _check_suffix(self)

    @property
    def method(self) -> Method:
        """The drafting method (`algorithm` is its canonical name once constructed)."""
        return METHODS[self.algorithm]

    def resolved(self) -> SpecConfig:
        """Fill unset (0) values with the method's default shape (`methods.Method.shape`)."""
        m = self.method
        steps, topk, tokens = m.shape(self.num_steps, self.topk, self.num_draft_tokens)
        if not m.drafts:  # nothing else applies to plain decoding
            return SpecConfig(algorithm=m.name, num_steps=steps, topk=topk, num_draft_tokens=tokens)
        return replace(self, num_steps=steps, topk=topk, num_draft_tokens=tokens)


def _check_tree_limits(num_steps: int, topk: int, num_draft_tokens: int, configured_tokens: int) -> None:
    """A resolved shape within the kernels' node limit, its beam's scratch K/V within the cache's
    spare positions per request (as many)."""
    from specserve_kernels import MAX_NODES  # torch comes with it: imported where a shape is checked

    if num_draft_tokens > MAX_NODES:
        name = "num_draft_tokens" if configured_tokens == num_draft_tokens else "num_steps"  # topk 1: steps + 1
        raise ValueError(f"{name}: a tree of {num_draft_tokens} tokens (num_steps {num_steps}, topk {topk}) exceeds "
                         f"the limit of {MAX_NODES} tokens per tree, root included")
    scratch = (num_steps - 1) * topk
    if scratch > MAX_NODES:
        raise ValueError(f"num_steps: (num_steps - 1) * topk = {scratch} draft K/V entries exceed the limit of "
                         f"{MAX_NODES} scratch entries per request")


def _check_ngram(spec: SpecConfig) -> None:
    """NGRAM's knobs (checked for every method, as every knob is)."""
    if not 1 <= spec.ngram_min_match_window <= spec.ngram_max_match_window:
        raise ValueError(
            "ngram_min_match_window: need 1 <= ngram_min_match_window <= ngram_max_match_window, got "
            f"{spec.ngram_min_match_window} and {spec.ngram_max_match_window}"
        )
    if spec.ngram_branch_length <= spec.ngram_max_match_window:
        raise ValueError(
            f"ngram_branch_length: must exceed ngram_max_match_window ({spec.ngram_max_match_window}), "
            f"got {spec.ngram_branch_length}"
        )
    if not 1 <= spec.ngram_min_bfs_breadth <= spec.ngram_max_bfs_breadth:
        raise ValueError(
            "ngram_min_bfs_breadth: need 1 <= ngram_min_bfs_breadth <= ngram_max_bfs_breadth, got "
            f"{spec.ngram_min_bfs_breadth} and {spec.ngram_max_bfs_breadth}"
        )
    if spec.ngram_capacity < 1:
        raise ValueError(f"ngram_capacity: must be >= 1, got {spec.ngram_capacity}")


def _check_suffix(spec: SpecConfig) -> None:
    """Suffix decoding's knobs (checked for every method)."""
    if spec.suffix_cache_tokens < 2:
        raise ValueError(f"suffix_cache_tokens: must be >= 2, got {spec.suffix_cache_tokens}")
    if not 1 <= spec.suffix_min_match <= spec.suffix_max_depth:
        raise ValueError("suffix_min_match: need 1 <= suffix_min_match <= suffix_max_depth, got "
                         f"{spec.suffix_min_match} and {spec.suffix_max_depth}")
    if not spec.suffix_max_spec_factor > 0:
        raise ValueError(f"suffix_max_spec_factor: must be > 0, got {spec.suffix_max_spec_factor}")
    if not 0 <= spec.suffix_min_token_prob <= 1:
        raise ValueError(f"suffix_min_token_prob: must be in [0, 1], got {spec.suffix_min_token_prob}")


@dataclass(frozen=True)
class EngineConfig:
    """What the engine is built from: each field's `Knob` says what it does. device and dtype
    `auto` are resolved here, for this machine; `spec`'s fields are knobs of their own."""

    model_dir: str = knob(path=True, help="the target's HF model directory (empty = the embedded SmolLM2 of `prepare`)")
    max_batch_size: int = knob(8, help="KV-cache slots, i.e. requests decoded together; more wait in a queue",
                               no_flag="generate decodes one request, bench as many as its --batch-size")
    max_seq_len: int = knob(2048, help="prompt + generated tokens per request (the cache is slots x max_seq_len)")
    dtype: str = knob("auto", choices=(*DTYPES, "auto"),
                      help="auto = bfloat16 on CUDA and on CPUs with AVX512-BF16 / AMX, else float32")
    device: str = knob("auto", help="cpu, cuda, cuda:N (auto = cuda when available)")
    load_format: str = knob("auto", choices=LOAD_FORMATS,
                            help="the target's weights: gguf = on a CPU, the model directory's model.gguf computed "
                                 "from its own 4- and 8-bit blocks (Q4_0, Q4_1, Q8_0 layers); safetensors = the "
                                 "checkpoint at `dtype`; auto = gguf on x86-64 with AVX2, FMA and F16C where the "
                                 "directory has model.gguf and dtype is auto or float32, else safetensors (vLLM's)")
    gguf_activations: str = knob("auto", choices=("auto", "q8", "q16", "float32"), help="load_format gguf: each "
                                 "block of 32 activations rounded to 8 or 16 bits of its largest (q8: llama.cpp's) or "
                                 "kept at float32's precision; auto = q8 where the compiled CPU programs run")
    kv_cache_dtype: str = knob("auto", choices=(*DTYPES, "auto"),
                               help="the numbers the KV cache keeps (vLLM's name): auto = float16 for load_format "
                                    "gguf with the compiled CPU programs (llama.cpp's cache: half the bytes a decode "
                                    "reads, the same top tokens), else dtype; a narrower cache than the model's runs "
                                    "every forward on the compiled programs where they run; on CUDA only dtype")
    spec: SpecConfig = field(default_factory=SpecConfig)
    num_threads: int | None = knob(None, help="torch intra-op threads (empty = torch's default)")
    attention_backend: str = knob("auto", choices=ATTENTION_BACKENDS,
                                  help="auto = on CUDA flashinfer when installed (bf16/fp16), else our Triton kernel; "
                                  "on CPU torch, and in the compiled step program our kernel that reads each "
                                  "request's cached keys in place (torch: SDPA there too)")
    # auto: CUDA graphs on CUDA; off; static: the bucketed forward graphs capture, run without capture
    graph_mode: str = knob("auto", choices=GRAPH_MODES, name="disable_cuda_graph", switch=("auto", "off"),
                           help="run decode / verify eagerly on CUDA (no CUDA graphs)")
    cuda_graph_max_bs: int = knob(0, help="largest captured batch size (0 = max_batch_size)")
    gpu_memory_utilization: float = knob(0.9, help="on CUDA, the share of the GPU's memory this model may use (vLLM's "
                                         "knob): its weights, KV caches and step workspace must fit, or loading "
                                         "fails saying how many max_batch_size slots would")
    # on CPU, the target's forwards run through its AOTInductor-compiled program (runtime/compiled.py)
    cpu_compile: bool = knob(True, name="disable_cpu_compile", switch=(True, False),
                             help="run the target eagerly on CPU (default: its AOTInductor-compiled forward, compiled "
                                  "once per model and CPU and kept in compile_cache_dir)")
    compile_cache_dir: str = knob("", path=True, help="where compiled programs are kept across restarts "
                                  "(empty = ~/.cache/specserve/compiled)")
    compiled_steps: str = knob("auto", choices=COMPILED_STEPS,
                               help="with compiled forwards on CPU, which decode / verify steps run the compiled step "
                                    "program: auto = per batch size and tree size, the faster of it and the eager "
                                    "forward, timed at start-up and while serving; always = every step it covers")
    serve_while_compiling: bool = knob(True, help="served on CPU with compiled forwards: answer at once with the "
                                       "eager engine (the configured tree, no start-up timings) while a background "
                                       "process compiles or loads the programs; the model then switches, at its "
                                       "first idle moment (or between two steps under constant load), to an engine "
                                       "that runs them (the log says when)",
                                       no_flag="generate and bench build their programs before the first request")
    step_matmul: str = knob("auto", choices=STEP_MATMULS,
                            help="the compiled few-row programs' matmuls: auto = the AVX2 few-row kernel in float32 "
                                 "where it runs (specserve_kernels.few_row_gemm), else inductor's autotuned ones; "
                                 "inductor = always inductor's")
    profile: bool = knob(False, help="time each step's phases (drafting, verify forward, accept / compaction, drafter "
                         "update, bookkeeping; on CUDA synchronized so the times are exact); bench reports them",
                         no_param="a served model reports no step profile")
    max_queue_size: int = knob(64, help="requests that may wait for a slot; a new one beyond it is refused "
                               "(UNAVAILABLE when served; 0 = no bound)",
                               no_flag="generate and bench queue every prompt they are given, without bound")
    request_timeout_s: float = knob(600.0, help="a request still unfinished this long after it arrived ends with "
                                    "finish_reason timeout, freeing its slot though nobody reads it (0 = never)")
    structured_output_max_bytes: int = knob(65536, help="the longest JSON schema, regex or grammar a request may "
                                            "constrain its output with; a longer one is refused")
    structured_output_compile_timeout_s: float = knob(5.0, help="a request's grammar that takes longer to compile is "
                                                      "refused (compiled off the engine thread, cached by text)")
    structured_output_jump_forward: bool = knob(True, help="draft the text a request's grammar forces next (xgrammar's "
                                                "jump-forward string) beside the drafter's tree, for every method, "
                                                "none included; verification accepts it like any draft")
    enable_prefix_caching: bool = knob(True, help="reuse the K/V of a new prompt's longest cached prefix: a slot keeps "
                                       "its request's prompt and answer after it ends, and a prompt continuing a free "
                                       "slot's content takes that slot, one sharing a prefix with another slot gets "
                                       "those rows copied (vLLM's name)")
    prefix_cache_max_tokens: int | None = knob(None, help="tokens the free slots keep for reuse; beyond it the least "
                                               "recently used are evicted (empty = all they hold; 0 = none, only "
                                               "running requests' prefixes are reused)")
    max_num_batched_tokens: int | None = knob(None, help="prompt tokens a step computes beside the decoding requests: "
                                              "a longer prompt is prefilled in chunks over several steps, while the "
                                              "running streams keep getting a token each step, beside them no more "
                                              "prompt tokens a step than prefill_stall_steps allows (vLLM's name; "
                                              f"empty = {CPU_BATCHED_TOKENS} on CPU, {GPU_BATCHED_TOKENS} on CUDA; "
                                              "0 = whole prompts in one step)")
    prefill_stall_steps: float = knob(3.0, help="beside decoding requests, a step computes no more prompt tokens than "
                                      "cost this many of their decode steps (measured on this engine's own steps), so "
                                      "a stream's longest gap stays near this plus one decode steps; fewer: smoother "
                                      "streams, a long prompt answered later; 0 = max_num_batched_tokens alone")

    def __post_init__(self) -> None:
        object.__setattr__(self, "device", resolve_device(self.device))  # frozen: resolved once, here
        if self.load_format == "auto":
            object.__setattr__(self, "load_format", auto_load_format(self.model_dir, self.device, self.dtype))
        if self.load_format == "gguf":
            if self.device != "cpu":
                raise ValueError(f"load_format: gguf runs on a CPU, not on {self.device}")
            if self.dtype not in ("auto", "float32"):
                raise ValueError(f"load_format: gguf computes in float32 (dtype auto or float32), not {self.dtype}")
            object.__setattr__(self, "dtype", "float32")
        if self.dtype == "auto":
            object.__setattr__(self, "dtype", auto_dtype(self.device))
        check_choices(self)
        if self.kv_cache_dtype == "auto":
            narrow = self.load_format == "gguf" and self.cpu_compile  # the compiled programs' attention rounds
            object.__setattr__(self, "kv_cache_dtype", "float16" if narrow else self.dtype)
        if self.device != "cpu" and self.kv_cache_dtype != self.dtype:
            raise ValueError(f"kv_cache_dtype: on {self.device} the cache keeps dtype's numbers ({self.dtype}), "
                             f"not {self.kv_cache_dtype}")
        for name in ("max_batch_size", "max_seq_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be positive, got {getattr(self, name)}")
        for name in ("prefix_cache_max_tokens", "max_num_batched_tokens"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")
        if self.prefill_stall_steps < 0:
            raise ValueError(f"prefill_stall_steps: must be >= 0, got {self.prefill_stall_steps}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization: must be in (0, 1], got {self.gpu_memory_utilization!r}")
        for name in ("structured_output_max_bytes", "structured_output_compile_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be positive, got {getattr(self, name)}")
        for name in ("cuda_graph_max_bs", "max_queue_size", "request_timeout_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")

    @property
    def prompt_tokens_per_step(self) -> int:
        """max_num_batched_tokens, empty resolved for the device (0: whole prompts)."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return CPU_BATCHED_TOKENS if self.device == "cpu" else GPU_BATCHED_TOKENS

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype)

    @property
    def kv_torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.kv_cache_dtype)

    @property
    def compile_cache_path(self) -> Path:
        return Path(self.compile_cache_dir) if self.compile_cache_dir else Path.home() / ".cache/specserve/compiled"


@functools.cache
def knobs() -> tuple[Knob, ...]:
    """Every engine knob: EngineConfig's fields in order, SpecConfig's in place of `spec`."""
    out: list[Knob] = []
    for f in fields(EngineConfig):
        out += config_knobs(SpecConfig) if f.name == "spec" else [knob_of(EngineConfig, f)]
    return tuple(out)


def spec_config(values: Mapping[str, Any]) -> SpecConfig:
    """SpecConfig from the SpecConfig fields among `values`."""
    return SpecConfig(**{f.name: values[f.name] for f in fields(SpecConfig) if f.name in values})


def engine_config(values: Mapping[str, Any]) -> EngineConfig:
    """EngineConfig from field values, SpecConfig's beside EngineConfig's (as `knobs()` lists them)."""
    own = {f.name: values[f.name] for f in fields(EngineConfig) if f.name in values and f.name != "spec"}
    return EngineConfig(spec=spec_config(values), **own)
