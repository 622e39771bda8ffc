"""Load HF safetensors checkpoints (single file or sharded index) by their published key names."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from specserve.model_config import ModelConfig


def read_safetensors(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of `model.safetensors` or of the shards listed in `model.safetensors.index.json`."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (model_dir / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"model_dir: no model.safetensors or model.safetensors.index.json in {model_dir}")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        with safe_open(model_dir / name, framework="pt") as f:
            for key in f.keys():
                tensors[key] = f.get_tensor(key)
    return tensors


def take(tensors: dict[str, torch.Tensor], key: str, shape: tuple[int, ...]) -> torch.Tensor:
    """tensors[key], checked: a missing or misshapen key is an error naming it."""
    if key not in tensors:
        raise KeyError(f"checkpoint: missing tensor {key!r}")
    t = tensors[key]
    if tuple(t.shape) != shape:
        raise ValueError(f"checkpoint: tensor {key!r} has shape {tuple(t.shape)}, expected {shape}")
    return t


def llama_state_dict(tensors: dict[str, torch.Tensor], cfg: ModelConfig,
                     prefix: str = "model.") -> dict[str, torch.Tensor]:
    """Map HF Llama/Qwen2 keys onto `LlamaModel`'s (fused qkv and gate_up)."""
    h, d = cfg.hidden_size, cfg.head_dim
    q_out, kv_out = cfg.num_heads * d, cfg.num_kv_heads * d
    out = {
        "embed_tokens.weight": take(tensors, f"{prefix}embed_tokens.weight", (cfg.vocab_size, h)),
        "norm.weight": take(tensors, f"{prefix}norm.weight", (h,)),
    }
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = take(tensors, "lm_head.weight", (cfg.vocab_size, h))
    for i in range(cfg.num_layers):
        src, dst = f"{prefix}layers.{i}.", f"layers.{i}."
        attn = src + "self_attn."
        out[dst + "self_attn.qkv_proj.weight"] = torch.cat([
            take(tensors, attn + "q_proj.weight", (q_out, h)),
            take(tensors, attn + "k_proj.weight", (kv_out, h)),
            take(tensors, attn + "v_proj.weight", (kv_out, h)),
        ])
        if cfg.attention_bias:
            out[dst + "self_attn.qkv_proj.bias"] = torch.cat([
                take(tensors, attn + "q_proj.bias", (q_out,)),
                take(tensors, attn + "k_proj.bias", (kv_out,)),
                take(tensors, attn + "v_proj.bias", (kv_out,)),
            ])
        out[dst + "self_attn.o_proj.weight"] = take(tensors, attn + "o_proj.weight", (h, q_out))
        mlp = src + "mlp."
        out[dst + "mlp.gate_up_proj.weight"] = torch.cat([
            take(tensors, mlp + "gate_proj.weight", (cfg.intermediate_size, h)),
            take(tensors, mlp + "up_proj.weight", (cfg.intermediate_size, h)),
        ])
        out[dst + "mlp.down_proj.weight"] = take(tensors, mlp + "down_proj.weight", (h, cfg.intermediate_size))
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out[dst + norm + ".weight"] = take(tensors, src + norm + ".weight", (h,))
    return out


INITIALISERS = ("kaiming_uniform_", "uniform_", "normal_", "trunc_normal_", "ones_", "zeros_", "constant_")


@contextmanager
def empty_modules() -> Iterator[None]:
    """Modules built in here get shape-only parameters on the meta device and no initial values:
    the checkpoint's weights replace them. (Initialising a meta tensor runs torch's Python meta
    kernels, whose first call imports its compiler stack: seconds of every server's start.)"""
    saved = {name: getattr(nn.init, name) for name in INITIALISERS}
    try:
        for name in INITIALISERS:
            setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
        with torch.device("meta"):
            yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


def load_llama(model_dir: str | Path, dtype: torch.dtype, device: str = "cpu") -> LlamaModel:  # noqa: F821
    from specserve.models.llama import LlamaModel

    cfg = ModelConfig.from_dir(model_dir)
    with empty_modules():
        model = LlamaModel(cfg)
    state = {k: v.to(device=device, dtype=dtype) for k, v in llama_state_dict(read_safetensors(model_dir), cfg).items()}
    missing = model.load_state_dict(state, strict=False, assign=True).missing_keys
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
        missing = [n for n in missing if n != "lm_head.weight"]
    if missing:
        raise KeyError(f"checkpoint: no weights for {missing[:5]}")
    return model.eval().requires_grad_(False)  # loaded onto the device; frozen: no autograd in serving or graphs
