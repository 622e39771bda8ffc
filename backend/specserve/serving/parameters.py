"""The decoupled and preprocessing models' config.pbtxt parameters -> frozen configs.

Every parameter is a string in config.pbtxt; this module converts and validates them (errors name
the parameter) into an `EngineConfig` and `RequestLimits`. It does not parse requests.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from specserve.config import EngineConfig, SpecConfig, resolve_device
from specserve.hardware import auto_dtype
from specserve.serving.contract import RequestLimits

# ---- config.pbtxt parameters ----------------------------------------------------------------


def model_parameters(model_config: Mapping[str, Any]) -> dict[str, str]:
    """`parameters` of a Triton model config (as in `args["model_config"]`) as a plain dict."""
    return {k: v.get("string_value", "") for k, v in model_config.get("parameters", {}).items()}


def _parse_bool(name: str, value: str) -> bool:
    v = value.strip().lower()
    if v not in ("true", "false", "1", "0", "yes", "no"):
        raise ValueError(f"{name}: expected true or false, got {value!r}")
    return v in ("true", "1", "yes")


def resolve_path(value: str) -> str:
    """Absolute paths as they are; relative ones against the project root (where models/ is)."""
    from specserve.prepare import repo_root

    path = Path(value).expanduser()
    return str(path if path.is_absolute() else repo_root() / path)


def model_dir_from_parameters(params: Mapping[str, str]) -> str:
    """`model_dir`: empty or missing = the embedded default (`specserve prepare`)."""
    if value := params.get("model_dir", "").strip():
        return resolve_path(value)
    from specserve.prepare import default_model_dir

    return str(default_model_dir())


def request_limits_from_parameters(params: Mapping[str, str]) -> RequestLimits:
    """`max_seq_len`, `default_max_tokens`, `apply_chat_template` (missing or empty = default)."""
    d = RequestLimits()
    try:
        return RequestLimits(
            max_seq_len=int(params.get("max_seq_len") or d.max_seq_len),
            default_max_tokens=int(params.get("default_max_tokens") or d.default_max_tokens),
            apply_chat_template=_parse_bool("apply_chat_template", params.get("apply_chat_template") or "false"),
        )
    except ValueError as e:
        raise ValueError(f"parameters: {e}") from None


_ENGINE_KEYS = ("model_dir", "max_batch_size", "max_seq_len", "dtype", "device", "num_threads", "attention_backend",
                "disable_cuda_graph", "cuda_graph_max_bs", "disable_cpu_compile", "compile_cache_dir", "compiled_steps",
                "step_matmul", "max_queue_size", "request_timeout_s")
_SERVING_KEYS = ("default_max_tokens", "apply_chat_template")


def engine_config_from_parameters(params: Mapping[str, str]) -> EngineConfig:
    """The decoupled model's config.pbtxt parameters -> EngineConfig.

    model_dir / drafter_path / token_map: empty = the embedded default / none; relative paths are resolved
    against the project root. device: empty or "auto" = cuda when available; attention_backend,
    disable_cuda_graph and cuda_graph_max_bs as SGLang names them; disable_cpu_compile (default false:
    the target's compiled forward on CPU), compile_cache_dir (empty = ~/.cache/specserve/compiled) and
    compiled_steps (auto: the compiled step program where measured faster; always), step_matmul
    (auto: the AVX2 few-row kernel in float32 where it runs; inductor). Every SpecConfig
    field (algorithm, num_steps, topk, num_draft_tokens, ngram_*) may be set by its name;
    empty values keep the default. Unknown keys are an error (typos should not pass silently).
    """
    spec_fields = {f.name: f for f in dataclasses.fields(SpecConfig)}
    unknown = sorted(set(params) - set(spec_fields) - set(_ENGINE_KEYS) - set(_SERVING_KEYS))
    if unknown:
        raise ValueError(f"{unknown[0]}: unknown parameter")
    given = {k: v.strip() for k, v in params.items() if v.strip()}

    spec_kw: dict[str, Any] = {}
    for name, value in given.items():
        if name not in spec_fields:
            continue
        if name in ("drafter_path", "token_map"):
            spec_kw[name] = resolve_path(value)
        elif spec_fields[name].default is None or isinstance(spec_fields[name].default, str):
            spec_kw[name] = value
        elif isinstance(spec_fields[name].default, bool):
            if value.lower() not in ("true", "false", "1", "0"):
                raise ValueError(f"{name}: expected true or false, got {value!r}")
            spec_kw[name] = value.lower() in ("true", "1")
        else:
            try:
                spec_kw[name] = type(spec_fields[name].default)(value)
            except ValueError:
                raise ValueError(f"{name}: expected a number, got {value!r}") from None

    model_dir = model_dir_from_parameters(params)
    kw: dict[str, Any] = {"model_dir": model_dir, "device": resolve_device(given.get("device", "auto")),
                          "spec": SpecConfig(**spec_kw)}
    if "request_timeout_s" in given:
        try:
            kw["request_timeout_s"] = float(given["request_timeout_s"])
        except ValueError:
            raise ValueError(f"request_timeout_s: expected a number, got {given['request_timeout_s']!r}") from None
    for name in ("max_batch_size", "max_seq_len", "num_threads", "cuda_graph_max_bs", "max_queue_size"):
        if name in given:
            try:
                kw[name] = int(given[name])
            except ValueError:
                raise ValueError(f"{name}: expected an integer, got {given[name]!r}") from None
    if "dtype" in given:
        kw["dtype"] = auto_dtype(kw["device"]) if given["dtype"] == "auto" else given["dtype"]
    if "attention_backend" in given:
        kw["attention_backend"] = given["attention_backend"]
    if "disable_cuda_graph" in given:
        flag = given["disable_cuda_graph"].lower()
        if flag not in ("true", "false", "1", "0"):
            raise ValueError(f"disable_cuda_graph: expected true or false, got {given['disable_cuda_graph']!r}")
        kw["graph_mode"] = "off" if flag in ("true", "1") else "auto"
    kw["cpu_compile"] = not _parse_bool("disable_cpu_compile", given.get("disable_cpu_compile", "false"))
    if "compile_cache_dir" in given:
        kw["compile_cache_dir"] = resolve_path(given["compile_cache_dir"])
    for name in ("compiled_steps", "step_matmul"):
        if name in given:
            kw[name] = given[name]
    return EngineConfig(**kw)


