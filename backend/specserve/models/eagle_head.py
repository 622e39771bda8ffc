"""EAGLE-1/2 and EAGLE-3 draft heads: the network, and loading / saving their published formats.

EAGLE-1/2 (SafeAILab `cnets1.py`, SGLang `LlamaForCausalLMEagle`), feature f = the target's
final-norm hidden state (H):
    x = fc(cat(embed(token), f));  h = x + attn(x);  h = h + mlp(post_ln(h))
    logits = target.lm_head(h)            (no input_layernorm, no final norm; FR-Spec hot ids optional)
EAGLE-3 (SafeAILab `cnets.py`, SGLang `LlamaForCausalLMEagle3`), f = the inputs of 3 target layers
(3 * H_target), fused by fc on the first draft step only:
    g = fc(f) or the previous step's h;  x = cat(input_ln(embed(token)), hidden_norm(g))   (2H)
    h = g + attn(x);  h = h + mlp(post_ln(h))          h (pre-norm) is carried to the next step
    logits = lm_head(norm(h)) over the draft vocabulary;  target id = d + d2t[d]

Both read the target's embedding (EAGLE-3 may ship its own) and EAGLE-1/2 its lm_head.
This module knows nothing about KV caches, trees or requests: `forward` takes an `attend` callable
that runs the attention (cached in `drafters/head.py`, dense with the training-time-test mask in training).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from specserve.model_config import ModelConfig
from specserve.models.cpu_linear import (
    PackedLinear,
    apply_few_rows,
    can_pack,
    fastest_logits_layer,
    few_row_linear,
)
from specserve.models.llama import MLP, Attend, Attention, LlamaModel, RMSNorm
from specserve.models.weights import empty_modules, read_safetensors, take


@dataclass(frozen=True)
class EagleConfig:
    """A draft head's shape, read from its HF-style config.json."""

    algorithm: str  # the method (EAGLE-1/2 or EAGLE-3): the key of its class in HEAD_CLASSES
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int  # the target's
    draft_vocab_size: int  # EAGLE-3's lm_head rows; = vocab_size for EAGLE-1/2
    target_hidden_size: int
    fc_bias: bool = False  # EAGLE-1/2 only (config `bias`)
    aux_layer_ids: tuple[int, ...] = field(default=())  # EAGLE-3: target layers whose inputs are fused

    def __post_init__(self) -> None:
        if self.algorithm not in HEAD_CLASSES:
            raise ValueError(f"algorithm: must be one of {tuple(HEAD_CLASSES)}, got {self.algorithm!r}")
        fused = self.head_class.fused_layers
        if fused > 1 and len(self.aux_layer_ids) != fused:
            raise ValueError(f"eagle_aux_hidden_state_layer_ids: {self.head_class.title} fuses {fused} layers, "
                             f"got {self.aux_layer_ids}")

    @property
    def head_class(self) -> type[EagleHead]:
        return HEAD_CLASSES[self.algorithm]

    @property
    def feature_size(self) -> int:
        """F: the target features one position reads (final hidden, or 3 fused layer inputs)."""
        return self.target_hidden_size * self.head_class.fused_layers

    @property
    def fc_in(self) -> int:
        return self.head_class.fc_in(self)

    def layer_config(self) -> ModelConfig:
        """The draft decoder layer as a one-layer ModelConfig (for rope and the KV cache)."""
        return ModelConfig(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_layers=1, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps, rope_theta=self.rope_theta, max_position_embeddings=8192,
            tie_word_embeddings=False,
        )

    @classmethod
    def from_hf(cls, cfg: dict, target: ModelConfig, has_fc_bias: bool = False) -> EagleConfig:
        arch = " ".join(cfg.get("architectures") or [])
        head = Eagle3Head if Eagle3Head.architecture in arch or "draft_vocab_size" in cfg else Eagle2Head
        hidden = cfg.get("hidden_size", target.hidden_size)
        heads = cfg.get("num_attention_heads", target.num_heads)
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        eagle_cfg = cfg.get("eagle_config") or {}
        aux = eagle_cfg.get("eagle_aux_hidden_state_layer_ids") or target.default_aux_layers()
        return cls(
            algorithm=head.algorithm,
            hidden_size=hidden,
            intermediate_size=cfg.get("intermediate_size", target.intermediate_size),
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or hidden // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", target.rms_norm_eps),
            rope_theta=float(cfg.get("rope_theta", rope.get("rope_theta", target.rope_theta))),
            vocab_size=cfg.get("vocab_size", target.vocab_size),
            draft_vocab_size=cfg.get("draft_vocab_size", cfg.get("vocab_size", target.vocab_size)),
            target_hidden_size=cfg.get("target_hidden_size") or target.hidden_size,
            fc_bias=bool(cfg.get("bias", has_fc_bias)) and head.fc_may_have_bias,
            aux_layer_ids=tuple(aux) if head.fused_layers > 1 else (),
        )

    def to_hf(self) -> dict:
        """The config.json SGLang / SafeAILab read."""
        return {
            "architectures": [self.head_class.architecture],
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": 1,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "vocab_size": self.vocab_size,
            "hidden_act": "silu",
            "torch_dtype": "bfloat16",
        } | self.head_class.hf_fields(self)


class EagleHead(nn.Module):
    """One draft decoder layer plus its input fusion and output head (see the module docstring);
    `Eagle2Head` and `Eagle3Head` say how features enter and logits leave.

    Shapes: tokens (B, T); hidden (B, T, fc_in) target features or (B, T, H) carried draft states;
    returns h (B, T, H). `logits(h)` -> (..., V') over the draft vocabulary (or the hot ids).
    """

    algorithm: ClassVar[str]  # EagleConfig.algorithm, the method's name
    title: ClassVar[str]
    architecture: ClassVar[str]  # config.json `architectures`
    layer_prefix: ClassVar[str]  # the decoder layer's published key prefix
    fused_layers: ClassVar[int]  # target layers whose states a position reads
    attn_in: ClassVar[int]  # the attention's input width in draft hidden sizes
    fc_may_have_bias: ClassVar[bool] = False
    own_embedding: ClassVar[bool] = False  # its checkpoint may ship `embed_tokens`

    def __init__(self, cfg: EagleConfig, target: LlamaModel) -> None:
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        layer_cfg = cfg.layer_config()
        self.fc = nn.Linear(cfg.fc_in, h, bias=cfg.fc_bias)
        self.attn = Attention(layer_cfg, in_features=self.attn_in * h)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.mlp = MLP(layer_cfg)
        self.own_embed: nn.Embedding | None = None  # see `own_embedding`
        # Shared with the target, not parameters of this module (never saved, never trained).
        self._target_embed = target.embed_tokens.weight.detach()
        self.target_head = SharedLmHead(target.lm_head.weight)  # EAGLE-1/2's output head

    @classmethod
    def fc_in(cls, cfg: EagleConfig) -> int:
        raise NotImplementedError

    @classmethod
    def hf_fields(cls, cfg: EagleConfig) -> dict:
        """config.json fields beyond the decoder layer's."""
        return {}

    @classmethod
    def published_extras(cls, tensors: dict[str, torch.Tensor], cfg: EagleConfig) -> dict[str, torch.Tensor]:
        """Tensors beyond the shared decoder layer and fc, published keys -> this module's."""
        return {}

    @property
    def embed_weight(self) -> torch.Tensor:
        """(V, H): the embedding table the head reads (its own, or the target's)."""
        return self.own_embed.weight if self.own_embed is not None else self._target_embed

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.own_embed(tokens) if self.own_embed is not None else F.embedding(tokens, self._target_embed)

    def forward(self, tokens: torch.Tensor, hidden: torch.Tensor, attend: Attend) -> torch.Tensor:
        residual, x = self.layer_input(self.embed(tokens).to(hidden.dtype), hidden)
        h = residual + attend(self.attn, x)
        return h + self.mlp(self.post_attention_layernorm(h))

    def layer_input(self, e: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Embeddings e (B, T, H) and features -> (residual, attention input)."""
        raise NotImplementedError

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """(..., H) -> (..., V') float32; V' = hot ids or the target vocab (EAGLE-3: its draft vocab)."""
        return self.target_head.logits(h)

    def pack_logits(self) -> None:
        """Inference only: the output layer made fast for this CPU (`SharedLmHead.pack`). Call
        after `set_hot_ids`."""
        self.target_head.pack()

    def set_hot_ids(self, hot_ids: torch.Tensor) -> None:
        """FR-Spec: restrict the lm_head to these target token ids (a 1-D int tensor)."""
        self.target_head.restrict(hot_ids)

    def to_target_ids(self, idx: torch.Tensor) -> torch.Tensor:
        """Indices into `logits`' last dim -> target token ids."""
        return self.target_head.to_target_ids(idx)

    def published_tensors(self) -> dict[str, torch.Tensor]:
        """Tensors a release carries that the module does not hold."""
        return {}


class Eagle2Head(EagleHead):
    """EAGLE-1/2: x = fc(cat(embed(token), f)) over the target's final hidden; the target's lm_head."""

    algorithm, title, architecture, layer_prefix = "eagle", "EAGLE-2", "LlamaForCausalLMEagle", "layers.0."
    fused_layers, attn_in, fc_may_have_bias = 1, 1, True

    @classmethod
    def fc_in(cls, cfg: EagleConfig) -> int:
        return cfg.hidden_size + cfg.target_hidden_size

    @classmethod
    def hf_fields(cls, cfg: EagleConfig) -> dict:
        return {"bias": cfg.fc_bias}

    def layer_input(self, e: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.fc(torch.cat([e, hidden], dim=-1))
        return x, x


class Eagle3Head(EagleHead):
    """EAGLE-3: 3 target layers' inputs fused by fc (first step only), cat(embedding, state) into
    the attention, its own norm and lm_head over a draft vocabulary (d2t maps it to target ids)."""

    algorithm, title, architecture, layer_prefix = "eagle3", "EAGLE-3", "LlamaForCausalLMEagle3", "midlayer."
    fused_layers, attn_in, own_embedding = 3, 2, True

    def __init__(self, cfg: EagleConfig, target: LlamaModel) -> None:
        super().__init__(cfg, target)
        h = cfg.hidden_size
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))

    @classmethod
    def fc_in(cls, cfg: EagleConfig) -> int:
        return cls.fused_layers * cfg.target_hidden_size

    @classmethod
    def hf_fields(cls, cfg: EagleConfig) -> dict:
        return {"draft_vocab_size": cfg.draft_vocab_size, "target_hidden_size": cfg.target_hidden_size,
                "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids)}}

    @classmethod
    def published_extras(cls, tensors: dict[str, torch.Tensor], cfg: EagleConfig) -> dict[str, torch.Tensor]:
        h, src = cfg.hidden_size, cls.layer_prefix
        return {
            "input_layernorm.weight": take(tensors, f"{src}input_layernorm.weight", (h,)),
            "hidden_norm.weight": take(tensors, f"{src}hidden_norm.weight", (h,)),
            "norm.weight": take(tensors, "norm.weight", (h,)),
            "lm_head.weight": take(tensors, "lm_head.weight", (cfg.draft_vocab_size, h)),
            "d2t": take(tensors, "d2t", (cfg.draft_vocab_size,)).to(torch.int64),
        }

    def layer_input(self, e: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        residual = self.fc(hidden) if hidden.shape[-1] != self.cfg.hidden_size else hidden
        return residual, torch.cat([self.input_layernorm(e), self.hidden_norm(residual)], dim=-1)  # (B, T, 2H)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return apply_few_rows(self.lm_head, self.norm(h)).float()

    def pack_logits(self) -> None:
        """Its own float32 lm_head: `fastest_logits_layer`."""
        if type(self.lm_head) is nn.Linear:
            self.lm_head = fastest_logits_layer(self.lm_head.weight) or self.lm_head

    def set_hot_ids(self, hot_ids: torch.Tensor) -> None:
        raise ValueError("token_map: FR-Spec applies to EAGLE-1/2; EAGLE-3 has its own draft vocabulary")

    def to_target_ids(self, idx: torch.Tensor) -> torch.Tensor:
        return idx + self.d2t[idx]

    def published_tensors(self) -> dict[str, torch.Tensor]:
        """t2d: which target ids the draft vocabulary holds."""
        t2d = torch.zeros(self.cfg.vocab_size, dtype=torch.bool)
        t2d[torch.arange(self.cfg.draft_vocab_size) + self.d2t.cpu()] = True
        return {"t2d": t2d}


HEAD_CLASSES: dict[str, type[EagleHead]] = {c.algorithm: c for c in (Eagle2Head, Eagle3Head)}


class SharedLmHead:
    """The target's lm_head, shared by a draft head (frozen, never saved), optionally restricted to
    FR-Spec hot token ids: logits over V_hot rows, indices mapped back to target ids."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight.detach()  # (V, H)
        self.rows = self.weight
        self.hot_ids: torch.Tensor | None = None
        self.packed: PackedLinear | None = None  # inference on CPU: see `pack`

    def restrict(self, hot_ids: torch.Tensor) -> None:
        vocab = self.weight.shape[0]
        if hot_ids.ndim != 1 or not 0 < hot_ids.numel() <= vocab:
            raise ValueError(f"token_map: expected a 1-D list of token ids, got shape {tuple(hot_ids.shape)}")
        if int(hot_ids.min()) < 0 or int(hot_ids.max()) >= vocab:
            raise ValueError("token_map: token id outside the target vocabulary")
        self.hot_ids = hot_ids.to(torch.int64).to(self.weight.device)
        self.rows = self.weight[self.hot_ids].contiguous()  # (V_hot, H)
        self.packed = None

    def pack(self) -> None:
        """Inference only (no autograd), on CPU: multiply by a oneDNN-packed copy of the rows when
        they are bf16 on a CPU that can pack them, or through the fastest layer timed here when they
        are float32 (`cpu_linear.fastest_logits_layer`). Call after `restrict`."""
        if can_pack(self.rows.device, self.rows.dtype):
            self.packed = PackedLinear(self.rows)
        else:
            self.packed = fastest_logits_layer(self.rows)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return (self.packed(h) if self.packed is not None else few_row_linear(h, self.rows)).float()

    def to_target_ids(self, idx: torch.Tensor) -> torch.Tensor:
        return idx if self.hot_ids is None else self.hot_ids[idx]


# ---- published key names ------------------------------------------------------------------------

def _read_checkpoint(path: Path) -> dict[str, torch.Tensor]:
    if (path / "model.safetensors").is_file() or (path / "model.safetensors.index.json").is_file():
        tensors = read_safetensors(path)
    elif (path / "pytorch_model.bin").is_file():  # most EAGLE-1/2 releases
        tensors = torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise FileNotFoundError(f"drafter_path: no model.safetensors or pytorch_model.bin in {path}")
    return {k.removeprefix("model."): v for k, v in tensors.items()}


def eagle_state_dict(tensors: dict[str, torch.Tensor], cfg: EagleConfig) -> dict[str, torch.Tensor]:
    """Published keys -> EagleHead's (fused qkv and gate_up); missing or misshapen keys are named."""
    h, d, hi = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    attn_in = cfg.head_class.attn_in * h
    q_out, kv_out = cfg.num_heads * d, cfg.num_kv_heads * d
    src = cfg.head_class.layer_prefix
    out = {
        "fc.weight": take(tensors, "fc.weight", (h, cfg.fc_in)),
        "attn.qkv_proj.weight": torch.cat([
            take(tensors, f"{src}self_attn.q_proj.weight", (q_out, attn_in)),
            take(tensors, f"{src}self_attn.k_proj.weight", (kv_out, attn_in)),
            take(tensors, f"{src}self_attn.v_proj.weight", (kv_out, attn_in)),
        ]),
        "attn.o_proj.weight": take(tensors, f"{src}self_attn.o_proj.weight", (h, q_out)),
        "mlp.gate_up_proj.weight": torch.cat([
            take(tensors, f"{src}mlp.gate_proj.weight", (hi, h)),
            take(tensors, f"{src}mlp.up_proj.weight", (hi, h)),
        ]),
        "mlp.down_proj.weight": take(tensors, f"{src}mlp.down_proj.weight", (h, hi)),
        "post_attention_layernorm.weight": take(tensors, f"{src}post_attention_layernorm.weight", (h,)),
    }
    if cfg.fc_bias:
        out["fc.bias"] = take(tensors, "fc.bias", (h,))
    return out | cfg.head_class.published_extras(tensors, cfg)


def load_eagle(path: str | Path, target: LlamaModel, dtype: torch.dtype, device: str = "cpu") -> EagleHead:
    """A draft head from a local directory (config.json + safetensors or pytorch_model.bin)."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"drafter_path: no config.json in {path}")
    tensors = _read_checkpoint(path)
    cfg = EagleConfig.from_hf(json.loads((path / "config.json").read_text()), target.cfg, "fc.bias" in tensors)
    if cfg.target_hidden_size != target.cfg.hidden_size or cfg.vocab_size != target.cfg.vocab_size:
        raise ValueError(
            f"drafter_path: drafter expects target hidden {cfg.target_hidden_size} / vocab {cfg.vocab_size}, "
            f"target has {target.cfg.hidden_size} / {target.cfg.vocab_size}"
        )
    if cfg.aux_layer_ids and max(cfg.aux_layer_ids) >= target.cfg.num_layers:
        raise ValueError(f"eagle_aux_hidden_state_layer_ids: {cfg.aux_layer_ids} outside the target's layers")
    state = eagle_state_dict(tensors, cfg)
    with empty_modules():
        head = cfg.head_class(cfg, target)
    head.load_state_dict({k: v.to(device) if k == "d2t" else v.to(device=device, dtype=dtype)
                          for k, v in state.items()}, strict=True, assign=True)
    if head.own_embedding and "embed_tokens.weight" in tensors:
        head.own_embed = nn.Embedding.from_pretrained(
            take(tensors, "embed_tokens.weight", (cfg.vocab_size, cfg.hidden_size)).to(device=device, dtype=dtype))
    return head.eval().requires_grad_(False)  # loaded onto the device


def save_eagle(head: EagleHead, out_dir: str | Path, dtype: torch.dtype = torch.bfloat16,
               extra_tensors: dict[str, torch.Tensor] | None = None) -> Path:
    """Write config.json + model.safetensors under the published key names (unfused q/k/v, gate/up)."""
    cfg, out_dir = head.cfg, Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    src = cfg.head_class.layer_prefix
    q_out, kv_out = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    sd = {k: v.detach() for k, v in head.state_dict().items()}
    q, k, v = sd.pop("attn.qkv_proj.weight").split([q_out, kv_out, kv_out])
    gate, up = sd.pop("mlp.gate_up_proj.weight").chunk(2)
    tensors = {
        f"{src}self_attn.q_proj.weight": q, f"{src}self_attn.k_proj.weight": k, f"{src}self_attn.v_proj.weight": v,
        f"{src}self_attn.o_proj.weight": sd.pop("attn.o_proj.weight"),
        f"{src}mlp.gate_proj.weight": gate, f"{src}mlp.up_proj.weight": up,
        f"{src}mlp.down_proj.weight": sd.pop("mlp.down_proj.weight"),
        f"{src}post_attention_layernorm.weight": sd.pop("post_attention_layernorm.weight"),
    }
    for name in ("input_layernorm", "hidden_norm"):
        if f"{name}.weight" in sd:
            tensors[f"{src}{name}.weight"] = sd.pop(f"{name}.weight")
    tensors |= sd  # fc.*, norm, lm_head, d2t: already under their published names
    tensors |= head.published_tensors() | (extra_tensors or {})
    tensors = {k: (t.to(dtype) if t.is_floating_point() else t).contiguous().cpu() for k, t in tensors.items()}
    save_file(tensors, out_dir / "model.safetensors")
    (out_dir / "config.json").write_text(json.dumps(cfg.to_hf(), indent=2) + "\n")
    return out_dir
