"""The decoupled and preprocessing models' config.pbtxt parameters -> frozen configs.

Every parameter is a string in config.pbtxt; this module converts and validates them (errors name
the parameter) into an `EngineConfig` (a parameter per engine knob, `config.knobs()`) and
`RequestLimits` (`SERVING_PARAMETERS`). It does not parse requests.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import MISSING
from pathlib import Path
from typing import Any

from specserve.config import EngineConfig, Knob, engine_config, knobs
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


# The parameters beside the engine knobs (RequestLimits' fields but max_seq_len, which is one), with their help.
SERVING_PARAMETERS: dict[str, str] = {
    "default_max_tokens": "max_tokens of a request that sets none",
    "apply_chat_template": "the default of a request without an `apply_chat_template` input (false = the raw "
                           "prompt, as vLLM's backend)",
}


def parameter_text(value: Any) -> str:
    """A value as config.pbtxt writes it: booleans true / false, None empty."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    return f"{value:g}" if isinstance(value, float) else str(value)


def engine_parameters() -> dict[str, Knob]:
    """The engine knobs that are config.pbtxt parameters, by parameter name."""
    return {k.edge: k for k in knobs() if not k.no_param}


def default_text(k: Knob) -> str:
    """The knob's default as config.pbtxt writes it (a required field's: empty)."""
    return "" if k.default is MISSING else parameter_text(k.to_edge(k.default))


def _parse(k: Knob, text: str) -> Any:
    """One non-empty parameter -> the field's value."""
    if k.switch or k.type is bool:
        return k.from_edge(_parse_bool(k.edge, text))
    if k.path:
        return resolve_path(text)
    if k.type in (int, float):
        try:
            return k.type(text)
        except ValueError:
            kind = "an integer" if k.type is int else "a number"
            raise ValueError(f"{k.edge}: expected {kind}, got {text!r}") from None
    return text


def instance_device(configured: str, instance_kind: str, device_id: str) -> str:
    """The device of one model instance's engine, from the `device` parameter and what Triton passes
    to `initialize` (`model_instance_kind`, `model_instance_device_id`).

    KIND_GPU: the GPU Triton placed the instance on, so `instance_group [{kind: KIND_GPU, gpus: [0, 1]}]`
    runs one engine per GPU; a `device` parameter of `auto` or `cuda` follows it, a different device
    is an error. KIND_CPU and KIND_MODEL: the `device` parameter (auto = the first visible GPU, else the CPU).
    """
    configured = configured.strip() or "auto"
    if instance_kind.upper() != "GPU":
        return configured
    placed = f"cuda:{int(device_id or 0)}"
    if configured not in ("auto", "cuda", placed):
        raise ValueError(f"device: {configured!r} contradicts the instance group: Triton placed this KIND_GPU "
                         f"instance on {placed} (leave device auto, or use KIND_MODEL to choose it here)")
    return placed


def engine_config_from_parameters(params: Mapping[str, str], instance_kind: str = "",
                                  device_id: str = "") -> EngineConfig:
    """The decoupled model's config.pbtxt parameters -> EngineConfig.

    A parameter per engine knob, under the knob's edge name (model_repository/README.md lists them);
    a missing or empty one keeps the default; relative paths are resolved against the project root.
    Unknown keys are an error (typos should not pass silently). `instance_kind` and `device_id` are
    Triton's for the instance being built: they place a KIND_GPU instance (`instance_device`).
    """
    by_name = engine_parameters()
    unknown = sorted(set(params) - set(by_name) - set(SERVING_PARAMETERS))
    if unknown:
        raise ValueError(f"{unknown[0]}: unknown parameter")
    values = {by_name[key].field: _parse(by_name[key], text.strip())
              for key, text in params.items() if key in by_name and text.strip()}
    device = instance_device(params.get("device", ""), instance_kind, device_id)
    return engine_config({**values, "device": device, "model_dir": model_dir_from_parameters(params)})
