"""The model repository's config.pbtxt files, generated from one description.

Every `config.pbtxt` under `model_repository/` is written by `render_repository` (the command
`specserve model-repository`): `preprocessing`, and per variant the decoupled `llm_<variant>`
(vLLM-backend request format, one engine) and the ensemble `ensemble_<variant>` (TensorRT-LLM's
format: `[1, 1]` tensors, `preprocessing` -> `llm_<variant>`). Their tensors come from the request
contract in `contract` (`CONTRACT_INPUTS`, `INTERNAL_INPUTS`, `OUTPUTS`): written out for
`preprocessing` and the ensembles, declared by the llm models themselves (`llm_inputs`,
`llm_outputs`, which their `auto_complete_config` adds). An llm config holds only the parameters
a variant sets (`VARIANTS` below; every other engine knob keeps its `config.knobs()` default), and
the parameter table of model_repository/README.md is rendered from the knobs too, so the tests
check that the committed files equal what this module renders.

This module writes text only: it does not load models, start servers or copy drafters.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specserve.config import knobs
from specserve.methods import METHODS, canonical, method
from specserve.prepare import repo_root
from specserve.serving.contract import CONTRACT_INPUTS, INTERNAL_INPUTS, OUTPUTS, RequestLimits
from specserve.serving.parameters import SERVING_PARAMETERS, default_text, engine_parameters, parameter_text

VARIABLE_LENGTH = {"stop_words", "bad_words", "input_ids", "text_output", "output_ids", "finish_reason"}  # dims [-1]
TRTLLM_BATCH = (1,)  # TensorRT-LLM's ensemble format: a leading batch dimension of 1 on every input

IDENTIFYING = ("model_dir", "algorithm")  # written in every llm config, default or not
PREPROCESSING_PARAMETERS = ("model_dir", "max_seq_len", "default_max_tokens", "apply_chat_template")


def parameter_defaults() -> dict[str, str]:
    """Every parameter of an llm model and its default, as config.pbtxt writes it."""
    limits = RequestLimits()
    return ({name: default_text(k) for name, k in engine_parameters().items()}
            | {name: parameter_text(getattr(limits, name)) for name in SERVING_PARAMETERS})


@dataclass(frozen=True)
class Variant:
    """One served variant: `llm_<name>` runs the drafting method of that name (`methods.METHODS`);
    `parameters` are its config.pbtxt parameters besides (drafter paths are relative to the project
    root)."""

    name: str
    parameters: dict[str, str] = field(default_factory=dict)

    @property
    def algorithm(self) -> str:
        return self.name

    @property
    def description(self) -> str:
        return method(self.name).description


VARIANTS: tuple[Variant, ...] = tuple(Variant(m.name, dict(m.served)) for m in METHODS.values())  # one per method


def served_drafter(algorithm: str) -> dict[str, str]:
    """The SpecConfig fields (`drafter_path`, `token_map`, absolute) of the committed drafter the
    served variant of this algorithm uses; empty for algorithms without one."""
    for v in VARIANTS:
        if v.name == canonical(algorithm):
            return {k: str(repo_root() / v.parameters[k]) for k in ("drafter_path", "token_map") if k in v.parameters}
    return {}


def _tensor(name: str, dtype: str, batch: tuple[int, ...] = ()) -> dict[str, Any]:
    """One tensor as the Python backend's auto-complete takes it (`name`, `data_type`, `dims`)."""
    triton_type = "STRING" if dtype == "BYTES" else dtype
    return {"name": name, "data_type": f"TYPE_{triton_type}", "dims": [*batch, -1 if name in VARIABLE_LENGTH else 1]}


def llm_inputs() -> list[dict[str, Any]]:
    """The llm models' inputs, every one optional: what `preprocessing` hands over, then the client contract."""
    return [{**_tensor(name, dtype), "optional": True}
            for name, dtype in {**INTERNAL_INPUTS, **CONTRACT_INPUTS}.items()]


def llm_outputs() -> list[dict[str, Any]]:
    return [_tensor(name, dtype) for name, dtype in OUTPUTS.items()]


def _tensors(kind: str, names: dict[str, str], optional: bool, batch: tuple[int, ...] = ()) -> str:
    blocks = []
    for name, dtype in names.items():
        t = _tensor(name, dtype, batch)
        lines = [f'    name: "{name}"', f"    data_type: {t['data_type']}",
                 f"    dims: [ {', '.join(map(str, t['dims']))} ]"]
        if optional:
            lines.append("    optional: true")
        blocks.append("  {\n" + "\n".join(lines) + "\n  }")
    return f"{kind} [\n" + ",\n".join(blocks) + "\n]\n"


def _parameters(params: dict[str, str]) -> str:
    return "".join(f'parameters: {{ key: "{k}" value: {{ string_value: "{v}" }} }}\n' for k, v in params.items())


def _maps(kind: str, names: list[str] | dict[str, str], rename: dict[str, str] | None = None) -> str:
    rename = rename or {}
    return "".join(f'      {kind}_map {{ key: "{n}" value: "{rename.get(n, n)}" }}\n' for n in names)


GENERATED = ("# Generated by `specserve model-repository`: edit backend/specserve/serving/repository.py, "
             "not this file.\n")


def _comment(text: str) -> str:
    return "".join(f"# {line}\n" for line in text.strip().splitlines()) + GENERATED


def _config(comment: str, head: str, inputs: dict[str, str], outputs: dict[str, str],
            input_batch: tuple[int, ...] = ()) -> str:
    """The part the explicit configs share: the comment, the model kind, optional inputs and outputs."""
    return (_comment(comment) + head + _tensors("input", inputs, optional=True, batch=input_batch)
            + _tensors("output", outputs, optional=False))


def preprocessing_config() -> str:
    comment = """
The first step of every ensemble_<variant>: validates the request contract in TensorRT-LLM's
`[1, 1]` shapes, applies the chat template when asked and tokenizes; hands `input_ids` +
`request_config` (the validated request as JSON) to llm_<variant>.
Parameters: model_dir (empty = the embedded default, relative = from the project root),
max_seq_len (must match the llm models'), default_max_tokens, apply_chat_template (the default
when a request has no `apply_chat_template` input; false = raw prompt, as vLLM's backend).
"""
    defaults = parameter_defaults()
    return (_config(comment, 'backend: "python"\nmax_batch_size: 0\n', CONTRACT_INPUTS, INTERNAL_INPUTS,
                    input_batch=TRTLLM_BATCH)
            + "instance_group [ { count: 1, kind: KIND_CPU } ]\n"
            + _parameters({name: defaults[name] for name in PREPROCESSING_PARAMETERS}))


def llm_parameters(variant: Variant) -> dict[str, str]:
    """What llm_<variant>/config.pbtxt sets: model_dir and algorithm, then the variant's parameters
    that differ from their defaults."""
    defaults = parameter_defaults()
    unknown = sorted(set(variant.parameters) - set(defaults))
    if unknown:
        raise ValueError(f"{unknown[0]}: not a parameter of the llm models")
    params = {"model_dir": defaults["model_dir"], "algorithm": variant.algorithm}
    return params | {k: v for k, v in variant.parameters.items() if k in IDENTIFYING or v != defaults[k]}


def llm_config(variant: Variant) -> str:
    comment = f"""
llm_{variant.name}: what clients call, the decoupled model that runs the speculative engine
(algorithm={variant.algorithm}: {variant.description}).
Its tensors (the client contract in vLLM's backend format, each [1], and input_ids + request_config
from `preprocessing` for ensemble_{variant.name}), the decoupled transaction policy and max_batch_size 0
are declared by the model (auto_complete_config). A parameter not set here keeps its default:
model_repository/README.md lists them all.
"""
    return (_comment(comment) + 'backend: "python"\n' + "instance_group [ { count: 1, kind: KIND_CPU } ]\n"
            + _parameters(llm_parameters(variant)))


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
        _config(comment, 'platform: "ensemble"\nmax_batch_size: 0\n', CONTRACT_INPUTS, OUTPUTS,
                input_batch=TRTLLM_BATCH)
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


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def parameter_table() -> str:
    """The README's table of the llm models' parameters and the engine flags, from `config.knobs()`."""
    rows = ["| config.pbtxt parameter | `specserve generate` / `bench` flag | default | what it does |",
            "|---|---|---|---|"]
    for k in knobs():
        param = f"— ({k.no_param})" if k.no_param else f"`{k.edge}`"
        flag = f"— ({k.no_flag})" if k.no_flag else f"`{k.flag}`"
        if k.type is bool and not k.switch and not k.no_flag:
            flag += f" / `--no-{k.flag[2:]}`"
        default = f"`{default_text(k)}`" if default_text(k) else "empty"
        choices = f"one of {', '.join(f'`{c}`' for c in k.choices)}: " if k.choices and not k.switch else ""
        rows.append(f"| {param} | {_cell(flag)} | {default} | {_cell(choices + k.help)} |")
    defaults = parameter_defaults()
    for name, help_text in SERVING_PARAMETERS.items():
        rows.append(f"| `{name}` | — | `{defaults[name]}` | {_cell(help_text)} |")
    return "\n".join(rows) + "\n"


README = "README.md"
TABLE_BEGIN = "<!-- the parameter table: generated by `specserve model-repository` -->\n"
TABLE_END = "<!-- end of the generated parameter table -->\n"


def readme_with_table(text: str) -> str:
    """The README's text with its parameter table as `parameter_table` renders it."""
    if TABLE_BEGIN not in text or TABLE_END not in text:
        raise ValueError(f"{README}: the parameter table's markers are missing")
    head, rest = text.split(TABLE_BEGIN, 1)
    return head + TABLE_BEGIN + parameter_table() + TABLE_END + rest.split(TABLE_END, 1)[1]


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


def _rendered(root: Path) -> dict[str, str]:
    """render_repository, plus the README's parameter table where root has the README."""
    files = render_repository()
    if (root / README).is_file():
        files[README] = readme_with_table((root / README).read_text())
    return files


def write_repository(root: Path) -> list[Path]:
    """Write every generated file under root (drafters and anything else there are left alone)."""
    written = []
    for rel, text in _rendered(root).items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        written.append(path)
    return written


def stale_files(root: Path) -> list[str]:
    """The generated files that differ from (or are missing in) root."""
    return [rel for rel, text in _rendered(root).items()
            if not (root / rel).is_file() or (root / rel).read_text() != text]
