"""The model repository's config.pbtxt files, generated from one description.

Every `config.pbtxt` under `model_repository/` is written by `render_repository` (the command
`specserve model-repository`): `preprocessing`, and per variant the decoupled `llm_<variant>`
(vLLM-backend request format, one engine) and the ensemble `ensemble_<variant>` (TensorRT-LLM's
format: `[1, 1]` tensors, `preprocessing` -> `llm_<variant>`). Their tensors come from the request contract in
`contract` (`CONTRACT_INPUTS`, `INTERNAL_INPUTS`, `OUTPUTS`), their engine parameters from
`VARIANTS` below, so a new input, output or parameter is added in one place and the tests check
that the committed files equal what this module renders.

This module writes text only: it does not load models, start servers or copy drafters.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from specserve.prepare import repo_root
from specserve.serving.contract import CONTRACT_INPUTS, INTERNAL_INPUTS, OUTPUTS

VARIABLE_LENGTH = {"stop_words", "bad_words", "input_ids", "text_output", "output_ids", "finish_reason"}  # dims [-1]
TRTLLM_BATCH = "1, "  # TensorRT-LLM's ensemble format: a leading batch dimension of 1 on every input

# The decoupled model's parameters, in file order, with the served defaults.
ENGINE_PARAMETERS: tuple[tuple[str, str], ...] = (
    ("model_dir", ""),
    ("algorithm", "none"),
    ("drafter_path", ""),
    ("num_steps", "0"),
    ("topk", "0"),
    ("num_draft_tokens", "0"),
    ("max_batch_size", "8"),
    ("max_seq_len", "2048"),
    ("max_queue_size", "64"),
    ("request_timeout_s", "0"),
    ("dtype", "auto"),
    ("device", "auto"),
    ("num_threads", ""),
    ("attention_backend", "auto"),
    ("disable_cuda_graph", "false"),
    ("cuda_graph_max_bs", "0"),
    ("disable_cpu_compile", "false"),
    ("compile_cache_dir", ""),
    ("compiled_steps", "auto"),
    ("step_matmul", "auto"),
    ("default_max_tokens", "128"),
    ("apply_chat_template", "false"),
)
PREPROCESSING_PARAMETERS: tuple[tuple[str, str], ...] = (
    ("model_dir", ""),
    ("max_seq_len", "2048"),
    ("default_max_tokens", "128"),
    ("apply_chat_template", "false"),
)
DRAFTING_PARAMETERS: tuple[tuple[str, str], ...] = (("adaptive", "true"), ("disable_by_batch_size", "0"))


@dataclass(frozen=True)
class Variant:
    """One served variant: `llm_<name>` runs `algorithm`; `parameters` override or extend
    ENGINE_PARAMETERS (drafter paths are relative to the project root)."""

    name: str
    algorithm: str
    description: str
    parameters: dict[str, str] = field(default_factory=dict)


VARIANTS: tuple[Variant, ...] = (
    Variant("base", "none", "plain decoding, the baseline"),
    Variant("ngram", "ngram", "n-gram drafts from the request's own tokens"),
    Variant("eagle2", "eagle", "EAGLE-2 with an FR-Spec token map", {
        "drafter_path": "model_repository/llm_eagle2/drafter",
        "token_map": "model_repository/llm_eagle2/drafter/token_map.pt",
    }),
    Variant("eagle3", "eagle3", "EAGLE-3", {"drafter_path": "model_repository/llm_eagle3/drafter"}),
    Variant("mtp", "mtp", "a DeepSeek-layout MTP head trained for SmolLM2, with its hot-vocabulary token map", {
        "drafter_path": "model_repository/llm_mtp/drafter",
        "token_map": "model_repository/llm_mtp/drafter/token_map.pt",
    }),
    Variant("standalone", "standalone",
            "empty drafter_path = the target's first standalone_num_layers layers (0 = a quarter)",
            {"standalone_num_layers": "0"}),
)


VARIANT_ALGORITHM = {v.name: v.algorithm for v in VARIANTS}  # the one table from served names to algorithms


def served_drafter(algorithm: str) -> dict[str, str]:
    """The SpecConfig fields (`drafter_path`, `token_map`, absolute) of the committed drafter the
    served variant of this algorithm uses; empty for algorithms without one."""
    for v in VARIANTS:
        if v.algorithm == algorithm:
            return {k: str(repo_root() / v.parameters[k]) for k in ("drafter_path", "token_map") if k in v.parameters}
    return {}


def _tensors(kind: str, names: dict[str, str], optional: bool, batch: str = "") -> str:
    blocks = []
    for name, dtype in names.items():
        triton_type = "STRING" if dtype == "BYTES" else dtype
        dims = batch + ("-1" if name in VARIABLE_LENGTH else "1")
        lines = [f'    name: "{name}"', f"    data_type: TYPE_{triton_type}", f"    dims: [ {dims} ]"]
        if optional:
            lines.append("    optional: true")
        blocks.append("  {\n" + "\n".join(lines) + "\n  }")
    return f"{kind} [\n" + ",\n".join(blocks) + "\n]\n"


def _parameters(params: tuple[tuple[str, str], ...]) -> str:
    return "".join(f'parameters: {{ key: "{k}" value: {{ string_value: "{v}" }} }}\n' for k, v in params)


def _maps(kind: str, names: list[str] | dict[str, str], rename: dict[str, str] | None = None) -> str:
    rename = rename or {}
    return "".join(f'      {kind}_map {{ key: "{n}" value: "{rename.get(n, n)}" }}\n' for n in names)


GENERATED = "# Generated by `specserve model-repository`: edit backend/specserve/serving/repository.py, not this file.\n"


def _config(comment: str, head: str, inputs: dict[str, str], outputs: dict[str, str], input_batch: str = "") -> str:
    """The part every config shares: the comment, the model kind, optional inputs and outputs."""
    return ("".join(f"# {line}\n" for line in comment.strip().splitlines()) + GENERATED + head
            + _tensors("input", inputs, optional=True, batch=input_batch) + _tensors("output", outputs, optional=False))


def preprocessing_config() -> str:
    comment = """
The first step of every ensemble_<variant>: validates the request contract in TensorRT-LLM's
`[1, 1]` shapes, applies the chat template when asked and tokenizes; hands `input_ids` +
`request_config` (the validated request as JSON) to llm_<variant>.
Parameters: model_dir (empty = the embedded default, relative = from the project root),
max_seq_len (must match the llm models'), default_max_tokens, apply_chat_template (the default
when a request has no `apply_chat_template` input; false = raw prompt, as vLLM's backend).
"""
    return (_config(comment, 'backend: "python"\nmax_batch_size: 0\n', CONTRACT_INPUTS, INTERNAL_INPUTS,
                    input_batch=TRTLLM_BATCH)
            + "instance_group [ { count: 1, kind: KIND_CPU } ]\n" + _parameters(PREPROCESSING_PARAMETERS))


def llm_config(variant: Variant) -> str:
    params = dict(ENGINE_PARAMETERS)
    params["algorithm"] = variant.algorithm
    extra = {k: v for k, v in variant.parameters.items() if k not in params}
    params.update({k: v for k, v in variant.parameters.items() if k in params})
    ordered = tuple(params.items()) + tuple(extra.items())
    if variant.algorithm != "none":
        ordered += DRAFTING_PARAMETERS
    comment = f"""
What clients call: the decoupled model that runs the speculative engine (algorithm={variant.algorithm}:
{variant.description}). Takes the client contract in vLLM's backend format (text_input, stream,
sampling_parameters, ... each [1]); cancelling a stream frees its slot at the next engine step.
The ensemble ensemble_{variant.name} feeds it input_ids + request_config from `preprocessing`.
Parameters: see model_repository/README.md. adaptive: each step drafts the tree (or none) that the
measured step costs and acceptance say is fastest here; num_steps / topk / num_draft_tokens pin one shape.
"""
    head = 'backend: "python"\nmax_batch_size: 0\nmodel_transaction_policy { decoupled: true }\n'
    return (_config(comment, head, {**INTERNAL_INPUTS, **CONTRACT_INPUTS}, OUTPUTS)
            + "instance_group [ { count: 1, kind: KIND_CPU } ]\n" + _parameters(ordered))


def ensemble_config(variant: Variant) -> str:
    internal = {name: f"_{name}" for name in INTERNAL_INPUTS}
    comment = f"""
The same contract in TensorRT-LLM's ensemble format (every input [1, 1], as Triton's OpenAI frontend
and genai-perf's tensorrtllm backend send it): preprocessing -> llm_{variant.name} (decoupled, so the
ensemble streams). Every output comes from the decoupled step (Triton's rule for ensembles with a
decoupled step). Triton does not pass an ensemble's cancellation on to a running decoupled step:
cancel through llm_{variant.name}.
"""
    return (
        _config(comment, 'platform: "ensemble"\nmax_batch_size: 0\n', CONTRACT_INPUTS, OUTPUTS, input_batch=TRTLLM_BATCH)
        + "ensemble_scheduling {\n  step [\n    {\n"
        + '      model_name: "preprocessing"\n      model_version: -1\n'
        + _maps("input", CONTRACT_INPUTS)
        + _maps("output", list(INTERNAL_INPUTS), internal)
        + "    },\n    {\n"
        + f'      model_name: "llm_{variant.name}"\n      model_version: -1\n'
        + _maps("input", list(INTERNAL_INPUTS), internal)
        + _maps("output", OUTPUTS)
        + "    }\n  ]\n}\n"
    )


PREPROCESSING_MODEL_PY = (
    '"""Triton entry point of `preprocessing`: see specserve.serving.triton_preprocess."""\n\n'
    "from specserve.serving.triton_preprocess import TritonPythonModel  # noqa: F401\n"
)
LLM_MODEL_PY = (
    '"""Triton entry point of a decoupled llm_<variant> model: see specserve.serving.triton_model."""\n\n'
    "from specserve.serving.triton_model import TritonPythonModel  # noqa: F401\n"
)


def render_repository() -> dict[str, str]:
    """Relative path -> text of every generated file: each model's config.pbtxt and its version
    folder (`1/model.py` for the Python models, `1/.gitkeep` for the ensembles)."""
    files = {"preprocessing/config.pbtxt": preprocessing_config(), "preprocessing/1/model.py": PREPROCESSING_MODEL_PY}
    for v in VARIANTS:
        files[f"llm_{v.name}/config.pbtxt"] = llm_config(v)
        files[f"llm_{v.name}/1/model.py"] = LLM_MODEL_PY
        files[f"ensemble_{v.name}/config.pbtxt"] = ensemble_config(v)
        files[f"ensemble_{v.name}/1/.gitkeep"] = ""
    return files


def write_repository(root: Path) -> list[Path]:
    """Write every generated file under root (drafters and anything else there are left alone)."""
    written = []
    for rel, text in render_repository().items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        written.append(path)
    return written


def stale_files(root: Path) -> list[str]:
    """The generated files that differ from (or are missing in) root."""
    return [rel for rel, text in render_repository().items()
            if not (root / rel).is_file() or (root / rel).read_text() != text]
