"""MTP heads (multi-token prediction) as shipped inside target checkpoints, and saving our own.

Two published layouts, each one decoder layer of the target's architecture:
    DeepSeek-V3 NextN, keys `model.layers.{N}.*` (N = num_hidden_layers):
        x = eh_proj(cat(enorm(embed(token)), hnorm(h)));  x = layer(x)
        logits = shared_head.head(shared_head.norm(x))     (the target's lm_head if `head` is absent)
    Xiaomi MiMo, keys `model.mtp_layers.{i}.*`, concatenation reversed:
        x = input_proj(cat(hidden_layernorm(h), token_layernorm(embed(token))));  x = layer(x)
        logits = target.lm_head(final_layernorm(x))
h is the target's final-norm hidden state on the first step, then the head's own pre-norm output
(one head reused autoregressively for every draft step; MiMo's further heads are not used yet).
The head has EagleHead's interface, so `HeadDrafter` runs it; this module knows no caches.
Only Llama/Qwen2-style dense layers are supported (not DeepSeek's MLA / MoE layers).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from specserve.model_config import ModelConfig
from specserve.models.cpu_linear import apply_few_rows, fastest_logits_layer
from specserve.models.eagle_head import SharedLmHead
from specserve.models.llama import Attend, DecoderLayer, LlamaModel, RMSNorm
from specserve.models.weights import empty_modules, read_safetensors, take

LAYOUTS = ("deepseek", "mimo")


@dataclass(frozen=True)
class MtpConfig:
    algorithm = "mtp"
    layout: str  # "deepseek" or "mimo"
    target: ModelConfig  # the head's layer has the target's shapes
    prefix: str  # key prefix of the head used
    own_head: bool = False  # DeepSeek `shared_head.head` present (else the target's lm_head)
    aux_layer_ids: tuple[int, ...] = ()

    @property
    def hidden_size(self) -> int:
        return self.target.hidden_size

    @property
    def feature_size(self) -> int:
        return self.target.hidden_size

    def layer_config(self) -> ModelConfig:
        return replace(self.target, num_layers=1)


class MtpHead(nn.Module):
    """Shapes: tokens (B, T); hidden (B, T, H) -> h (B, T, H); `logits(h)` -> (..., V or V_hot)."""

    def __init__(self, cfg: MtpConfig, target: LlamaModel) -> None:
        super().__init__()
        self.cfg = cfg
        h, eps = cfg.hidden_size, cfg.target.rms_norm_eps
        self.token_norm = RMSNorm(h, eps)  # DeepSeek enorm / MiMo token_layernorm
        self.hidden_norm = RMSNorm(h, eps)  # hnorm / hidden_layernorm
        self.proj = nn.Linear(2 * h, h, bias=False)  # eh_proj / input_proj
        self.layer = DecoderLayer(cfg.layer_config())
        self.final_norm = RMSNorm(h, eps)  # shared_head.norm / final_layernorm
        self.head = nn.Linear(h, cfg.target.vocab_size, bias=False) if cfg.own_head else None
        self._target_embed = target.embed_tokens.weight.detach()
        self.target_head = SharedLmHead(target.lm_head.weight)

    @property
    def embed_weight(self) -> torch.Tensor:
        """(V, H): the target's embedding table, which the head reads."""
        return self._target_embed

    def forward(self, tokens: torch.Tensor, hidden: torch.Tensor, attend: Attend) -> torch.Tensor:
        e = self.token_norm(F.embedding(tokens, self._target_embed).to(hidden.dtype))
        hn = self.hidden_norm(hidden)
        x = self.proj(torch.cat([e, hn] if self.cfg.layout == "deepseek" else [hn, e], dim=-1))
        return self.layer(x, attend)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        h = self.final_norm(h)
        return apply_few_rows(self.head, h).float() if self.head is not None else self.target_head.logits(h)

    def pack_logits(self) -> None:
        """Inference only: the output layer made fast for this CPU (`SharedLmHead.pack`; an own
        float32 head likewise: `fastest_logits_layer`). Call after `set_hot_ids`."""
        if self.head is None:
            self.target_head.pack()
        elif type(self.head) is nn.Linear:
            self.head = fastest_logits_layer(self.head.weight) or self.head

    def set_hot_ids(self, hot_ids: torch.Tensor) -> None:
        if self.head is not None:
            raise ValueError("token_map: this MTP head has its own lm_head (shared_head.head); FR-Spec is not applied")
        self.target_head.restrict(hot_ids)

    def to_target_ids(self, idx: torch.Tensor) -> torch.Tensor:
        return idx if self.head is not None else self.target_head.to_target_ids(idx)


def _names(layout: str) -> dict[str, str]:
    """Our module names -> the layout's key suffixes."""
    if layout == "deepseek":
        return {"token_norm": "enorm", "hidden_norm": "hnorm", "proj": "eh_proj", "final_norm": "shared_head.norm",
                "head": "shared_head.head"}
    return {"token_norm": "token_layernorm", "hidden_norm": "hidden_layernorm", "proj": "input_proj",
            "final_norm": "final_layernorm"}


def find_layout(tensors: dict[str, torch.Tensor], target: ModelConfig) -> tuple[str, str]:
    """(layout, key prefix) of the first MTP head in a checkpoint; a clear error when there is none."""
    deepseek = f"model.layers.{target.num_layers}."
    if any(k.startswith(deepseek + "eh_proj") for k in tensors):
        return "deepseek", deepseek
    if any(k.startswith("model.mtp_layers.0.") for k in tensors):
        return "mimo", "model.mtp_layers.0."
    raise KeyError(
        f"checkpoint: no MTP head (neither {deepseek}eh_proj.weight, DeepSeek-V3, nor model.mtp_layers.0.*, MiMo)"
    )


def mtp_state_dict(tensors: dict[str, torch.Tensor], cfg: MtpConfig) -> dict[str, torch.Tensor]:
    from specserve.models.weights import llama_state_dict

    h = cfg.hidden_size
    names, p = _names(cfg.layout), cfg.prefix
    out = {
        "token_norm.weight": take(tensors, p + names["token_norm"] + ".weight", (h,)),
        "hidden_norm.weight": take(tensors, p + names["hidden_norm"] + ".weight", (h,)),
        "proj.weight": take(tensors, p + names["proj"] + ".weight", (h, 2 * h)),
        "final_norm.weight": take(tensors, p + names["final_norm"] + ".weight", (h,)),
    }
    if cfg.own_head:
        out["head.weight"] = take(tensors, p + names["head"] + ".weight", (cfg.target.vocab_size, h))
    # The decoder layer: reuse the target's key mapping as if it were layer 0 of a one-layer model.
    layer_cfg = replace(cfg.layer_config(), tie_word_embeddings=True)
    renamed = {k.replace(p, "model.layers.0.", 1): v for k, v in tensors.items() if k.startswith(p)}
    renamed |= {"model.embed_tokens.weight": torch.empty(layer_cfg.vocab_size, h), "model.norm.weight": torch.empty(h)}
    layer = llama_state_dict(renamed, layer_cfg)
    out |= {k.replace("layers.0.", "layer.", 1): v for k, v in layer.items() if k.startswith("layers.0.")}
    return out


def load_mtp(path: str | Path, target: LlamaModel, dtype: torch.dtype, device: str = "cpu") -> MtpHead:
    """The first MTP head found in `path` (the target's own directory or a separate one)."""
    tensors = read_safetensors(path)
    layout, prefix = find_layout(tensors, target.cfg)
    own_head = layout == "deepseek" and f"{prefix}shared_head.head.weight" in tensors
    cfg = MtpConfig(layout=layout, target=target.cfg, prefix=prefix, own_head=own_head)
    state = mtp_state_dict(tensors, cfg)
    with empty_modules():
        head = MtpHead(cfg, target)
    head.load_state_dict({k: v.to(device=device, dtype=dtype) for k, v in state.items()}, strict=True, assign=True)
    return head.eval().requires_grad_(False)  # loaded onto the device


def save_mtp(head: MtpHead, out_dir: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """DeepSeek layout (`model.layers.{N}.*`, unfused q/k/v and gate/up), without `shared_head.head`
    when the head reads the target's lm_head; config.json records `num_nextn_predict_layers`."""
    cfg, out_dir = head.cfg, Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    p, names = f"model.layers.{cfg.target.num_layers}.", _names("deepseek")
    t = cfg.target
    q_out, kv_out = t.num_heads * t.head_dim, t.num_kv_heads * t.head_dim
    sd = {k: v.detach() for k, v in head.state_dict().items()}
    q, k, v = sd.pop("layer.self_attn.qkv_proj.weight").split([q_out, kv_out, kv_out])
    gate, up = sd.pop("layer.mlp.gate_up_proj.weight").chunk(2)
    tensors = {p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k, p + "self_attn.v_proj.weight": v,
               p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up}
    if "layer.self_attn.qkv_proj.bias" in sd:  # Qwen2-style targets
        qb, kb, vb = sd.pop("layer.self_attn.qkv_proj.bias").split([q_out, kv_out, kv_out])
        tensors |= {p + "self_attn.q_proj.bias": qb, p + "self_attn.k_proj.bias": kb, p + "self_attn.v_proj.bias": vb}
    for name, value in sd.items():
        module, _, param = name.rpartition(".")
        key = names.get(module, module.removeprefix("layer.")) + "." + param
        tensors[p + key] = value
    tensors = {k: (t.to(dtype) if t.is_floating_point() else t).contiguous().cpu() for k, t in tensors.items()}
    save_file(tensors, out_dir / "model.safetensors")
    (out_dir / "config.json").write_text(json.dumps(
        {"architectures": ["LlamaForCausalLM"], "num_nextn_predict_layers": 1, "mtp_layout": "deepseek",
         "num_hidden_layers": t.num_layers, "hidden_size": t.hidden_size}, indent=2) + "\n")
    return out_dir
