"""The target LLM (Llama family) in plain torch, with a static KV cache and tree-shaped inputs.

One forward takes, per request b, T new tokens with explicit rope positions, writes their K/V at
cache positions `cache_lens[b] + j` of the request's slot, and lets token t attend to the slot's
prefix `[0, cache_lens[b])` plus the new tokens j with `new_mask[b, t, j]` (causal when None).
That single call covers prefill, decode and tree verification.

This module knows nothing about requests, sampling or drafting; it loads HF safetensors by their
key names (`weights.py`) and returns logits and the hidden states asked for.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import specserve_kernels as K
from specserve.model_config import ModelConfig
from specserve.models.attention import TORCH_ATTENTION, AttentionBackend, AttentionInputs
from specserve.models.kv_cache import KVCache
from specserve.staging import to_device

log = logging.getLogger(__name__)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # As HF Llama: normalise in fp32, scale in the model dtype (one fused op for the fp32 part).
        return self.weight * F.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(x.dtype)


def rope_table(cfg: ModelConfig, length: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, signed sin: (length, head_dim), computed in fp32 and cast, as HF does.

    The sin table's first half is negated so that HF's `rotate_half(x) * sin` becomes
    `roll(x, D/2) * signed_sin` (bit-identical, two ops fewer).
    """
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim))
    freqs = torch.outer(torch.arange(length, dtype=torch.float32), inv_freq)  # (L, D/2)
    emb = torch.cat([freqs, freqs], dim=-1)  # (L, D)
    signed_sin = torch.cat([-freqs.sin(), freqs.sin()], dim=-1)
    return emb.cos().to(dtype), signed_sin.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x: (B, T, H, D); cos/signed_sin: (B, T, 1, D)."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


def prefix_mask(cache_lens: torch.Tensor, new_mask: torch.Tensor, key_len: int) -> torch.Tensor:
    """(B, 1, T, S) bool: key s is visible to new token i if s is in the request's prefix
    (s < cache_lens[b]), or s = cache_lens[b] + j with new_mask[b, i, j].

    new_mask: (B, T, N), N >= T new-key entries after the prefix (a drafter's scratch area may hold
    more entries than the tokens of this forward).
    """
    b, t, n = new_mask.shape
    rel = torch.arange(key_len, device=cache_lens.device)[None, :] - cache_lens[:, None]  # (B, S)
    in_prefix = rel < 0
    in_new = (rel >= 0) & (rel < n)
    gathered = torch.gather(new_mask, 2, rel.clamp(0, n - 1)[:, None, :].expand(b, t, key_len))  # (B, T, S)
    return (in_prefix[:, None, :] | (in_new[:, None, :] & gathered)).unsqueeze(1)


@dataclass(frozen=True)
class KeyMask:
    """Which keys of its cache slot each of T new tokens sees: the request's prefix [0, prefix[b]),
    and of the N entries after it those `new[b, t]` marks (None: causal among the new tokens, N = T).
    A drafter's beam writes its nodes into a scratch area after the prefix (N >= T).

    Shape: prefix (B,) int64; new (B, T, N) bool or None."""

    prefix: torch.Tensor
    new: torch.Tensor | None = None

    def dense(self, t: int, key_len: int) -> torch.Tensor:
        """(B, 1, T, S) bool over keys [0, key_len) (`prefix_mask`)."""
        new = self.new
        if new is None:
            new = torch.ones(t, t, dtype=torch.bool, device=self.prefix.device).tril().expand(len(self.prefix), t, t)
        return prefix_mask(self.prefix, new, key_len)


def scattered_attention_inputs(
    rope: tuple[torch.Tensor, torch.Tensor], positions: torch.Tensor, write_pos: torch.Tensor,
    slots: list[int] | torch.Tensor, mask: KeyMask | None, key_len: int, backend: AttentionBackend = TORCH_ATTENTION,
) -> AttentionInputs:
    """AttentionInputs for tokens written at arbitrary cache entries `write_pos` (B, T) of their
    slots, with rope `positions` (B, T), the keys `mask` says (None: causal over a fresh prefill),
    for `backend` (a dense mask only if it reads one).

    slots: host ints (consecutive slots are read as a cache view), or a (B,) device tensor for a
    static, capturable forward (keys gathered per slot)."""
    b, t = positions.shape
    slot_range = None
    if not isinstance(slots, torch.Tensor):
        first = slots[0]
        slot_range = (first, b) if slots == list(range(first, first + b)) else None
        slots = to_device(slots, positions.device)
    cos, sin = rope
    return AttentionInputs(
        slots=slots, cache_lens=write_pos[:, 0] if mask is None else mask.prefix,
        write_slots=slots[:, None].expand(b, t), write_pos=write_pos, key_len=key_len,
        mask=mask.dense(t, key_len) if mask is not None and backend.reads_mask else None, is_causal=mask is None,
        slot_range=slot_range, cos=cos[positions].unsqueeze(2), sin=sin[positions].unsqueeze(2), backend=backend,
        new_mask=None if mask is None else mask.new,
    )


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, in_features: int | None = None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_out, kv_out = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        # q, k, v fused in one matmul: rows [q | k | v]. EAGLE-3's draft layer reads 2H inputs.
        self.qkv_proj = nn.Linear(in_features or cfg.hidden_size, q_out + 2 * kv_out, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(q_out, cfg.hidden_size, bias=False)
        self.split = (q_out, kv_out, kv_out)
        self.fused = False  # the GPU step's fused kernels (`LlamaModel.use_fused_kernels`)

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (B, T, in) -> q (B, Hq, T, D), k and v (B, T, Hkv, D); rope applied to q and k."""
        b, t, _ = x.shape
        qkv = self.qkv_proj(x)  # (B, T, (Hq + 2 Hkv) D)
        q_out, kv_out, _ = self.split
        qk = qkv[..., : q_out + kv_out].view(b, t, self.num_heads + self.num_kv_heads, self.head_dim)
        qk = apply_rope(qk, cos, sin)  # q and k heads together: (B, T, Hq + Hkv, D)
        q = qk[:, :, : self.num_heads].transpose(1, 2)
        k = qk[:, :, self.num_heads :]
        v = qkv[..., q_out + kv_out :].view(b, t, self.num_kv_heads, self.head_dim)
        return q, k, v

    def forward(self, x: torch.Tensor, layer_cache: tuple[torch.Tensor, torch.Tensor],
                a: AttentionInputs) -> torch.Tensor:
        k_cache, v_cache = layer_cache  # (slots, Hkv, max_len, D)
        if self.fused:  # one kernel: rope on q and k, k and v into the cache
            q = K.rope_kv_write(self.qkv_proj(x), a.cos, a.sin, k_cache, v_cache, a.write_slots, a.write_pos,
                                self.num_heads, self.num_kv_heads)
        else:
            q, k, v = self.project(x, a.cos, a.sin)
            k_cache[a.write_slots, :, a.write_pos] = k.to(k_cache.dtype)  # scattered per (slot, position)
            v_cache[a.write_slots, :, a.write_pos] = v.to(v_cache.dtype)
        return self.o_proj(a.backend.attend(q, k_cache, v_cache, a))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)  # rows [gate | up]
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.fused = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return self.down_proj(K.silu_mul(self.gate_up_proj(x)))
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


Attend = Callable[[Attention, torch.Tensor], torch.Tensor]  # (attention module, x (B, T, in)) -> (B, T, H)


class DecoderLayer(nn.Module):
    """A pre-norm Llama layer; `attend` runs its attention (over a KV cache, or densely in training)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, attend: Attend) -> torch.Tensor:
        x = x + attend(self.self_attn, self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


@dataclass(frozen=True)
class ForwardOutput:
    """Shape:
    logits: (B, K, V) float32, K = positions asked for (all T by default)
    hidden: (B, T, H) the final-norm output (EAGLE-1/2's feature)
    aux_hidden: (B, T, len(aux_layers) * H), the inputs of the asked-for layers, concatenated (EAGLE-3)
    """

    logits: torch.Tensor
    hidden: torch.Tensor
    aux_hidden: torch.Tensor | None


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None
        self.fused = False  # `use_fused_kernels`
        self.attention_backend: AttentionBackend = TORCH_ATTENTION  # the engine may pick flashinfer

    @property
    def rope(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, signed sin), each (max_len, head_dim), after `init_rope`."""
        assert self._rope is not None, "call init_rope first"
        return self._rope

    def init_rope(self, max_len: int) -> None:
        self._rope = rope_table(self.cfg, max_len, self.embed_tokens.weight.dtype)
        self._rope = (self._rope[0].to(self.embed_tokens.weight.device),
                      self._rope[1].to(self.embed_tokens.weight.device))

    def attention_inputs(
        self,
        positions: torch.Tensor,
        slots: torch.Tensor,
        cache_lens: torch.Tensor,
        new_mask: torch.Tensor | None,
        cache: KVCache,
        host_cache_lens: list[int],
        host_slots: list[int],
        backend: AttentionBackend | None = None,
    ) -> AttentionInputs:
        """positions (B, T); slots, cache_lens (B,); new_mask (B, T, T) bool or None (causal).

        Plans `backend` (default: the model's) for these inputs.
        """
        assert self._rope is not None, "call init_rope first"
        b, t = positions.shape
        key_len = max(host_cache_lens) + t
        if key_len > cache.max_len:
            raise ValueError(f"context: {key_len} tokens exceed the KV cache's {cache.max_len}")
        offsets = torch.arange(t, device=positions.device)
        write_pos = cache_lens[:, None] + offsets  # (B, T)
        write_slots = slots[:, None].expand(b, t)
        cos = self._rope[0][positions].unsqueeze(2)  # (B, T, 1, D)
        sin = self._rope[1][positions].unsqueeze(2)

        backend = backend or self.attention_backend
        fresh_causal = new_mask is None and max(host_cache_lens) == 0
        if fresh_causal:
            mask, is_causal = None, True
        elif (new_mask is None and t == 1 and len(set(host_cache_lens)) == 1) or not backend.reads_mask:
            mask, is_causal = None, False  # one new token, equal lengths (every key is visible), or no mask read
        else:
            if new_mask is None:
                new_mask = torch.ones(t, t, dtype=torch.bool, device=positions.device).tril().expand(b, t, t)
            mask, is_causal = prefix_mask(cache_lens, new_mask, key_len), False
        first = host_slots[0]
        consecutive = host_slots == list(range(first, first + b))
        a = AttentionInputs(
            slots=slots,
            cache_lens=cache_lens,
            write_slots=write_slots,
            write_pos=write_pos,
            key_len=key_len,
            mask=mask,
            is_causal=is_causal,
            slot_range=(first, b) if consecutive else None,
            cos=cos,
            sin=sin,
            backend=backend,
            new_mask=new_mask,
        )
        a.backend.prepare(a, host_cache_lens)
        return a

    def static_attention_inputs(
        self,
        positions: torch.Tensor,
        slots: torch.Tensor,
        cache_lens: torch.Tensor,
        new_mask: torch.Tensor,
        cache: KVCache,
        backend: AttentionBackend,
    ) -> AttentionInputs:
        """The same inputs with every shape fixed by the tensors' shapes and no host values: keys
        span the whole slot (key_len = max_len) behind a mask built on the device (a backend that
        reads the live length instead, `reads_mask` False, gets none). This is what a CUDA graph
        captures; the caller plans `backend` itself before each replay.

        positions (B, T); slots, cache_lens (B,); new_mask (B, T, T) bool.
        """
        assert self._rope is not None, "call init_rope first"
        b, t = positions.shape
        return AttentionInputs(
            slots=slots,
            cache_lens=cache_lens,
            write_slots=slots[:, None].expand(b, t),
            write_pos=cache_lens[:, None] + torch.arange(t, device=positions.device),
            key_len=cache.max_len,
            mask=prefix_mask(cache_lens, new_mask, cache.max_len) if backend.reads_mask else None,
            is_causal=False,
            slot_range=None,
            cos=self._rope[0][positions].unsqueeze(2),
            sin=self._rope[1][positions].unsqueeze(2),
            backend=backend,
            new_mask=new_mask,
        )

    def forward(
        self,
        tokens: torch.Tensor,
        a: AttentionInputs,
        cache: KVCache,
        logit_index: torch.Tensor | None = None,
        aux_layers: tuple[int, ...] = (),
    ) -> ForwardOutput:
        """tokens (B, T); logit_index (B, K) picks the positions that get logits (all when None)."""
        hidden, aux = self.run_layers(tokens, lambda i, attn, x: attn(x, cache.layer(i), a), aux_layers)
        return self.output(hidden, aux, logit_index)

    def run_layers(
        self, tokens: torch.Tensor, attend: Callable[[int, Attention, torch.Tensor], torch.Tensor],
        aux_layers: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """tokens (B, T) -> the final-norm hidden (B, T, H) and the asked-for layers' inputs
        (B, T, len(aux_layers) * H) or None; attend(layer index, attention module, x) runs attention."""
        x = self.embed_tokens(tokens)  # (B, T, H)
        if self.fused:
            return self._run_fused_layers(x, attend, aux_layers)
        aux = []
        for i, layer in enumerate(self.layers):
            if i in aux_layers:
                aux.append(x)
            x = layer(x, lambda attn, h, i=i: attend(i, attn, h))
        return self.norm(x), torch.cat(aux, dim=-1) if aux else None

    def _run_fused_layers(self, x: torch.Tensor, attend: Callable[[int, Attention, torch.Tensor], torch.Tensor],
                          aux_layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`run_layers` with each residual add fused into the norm after it (one kernel for both):
        x is the residual stream, h the normed input of the next block."""
        aux = []
        h = self.layers[0].input_layernorm(x)
        norms = [layer.input_layernorm for layer in self.layers[1:]] + [self.norm]
        for i, (layer, next_norm) in enumerate(zip(self.layers, norms)):
            if i in aux_layers:
                aux.append(x)
            post = layer.post_attention_layernorm
            x, h = K.add_rms_norm(x, attend(i, layer.self_attn, h), post.weight, post.eps)
            x, h = K.add_rms_norm(x, layer.mlp(h), next_norm.weight, next_norm.eps)
        return h, torch.cat(aux, dim=-1) if aux else None

    def use_fused_kernels(self, on: bool = True) -> None:
        """The GPU step: residual adds fused into the norms, RoPE with the cache write, silu * up, each
        one Triton kernel (the CPU keeps the eager ops, which its compiled programs fuse)."""
        self.fused = on
        for layer in self.layers:
            layer.self_attn.fused = layer.mlp.fused = on

    def output(self, hidden: torch.Tensor, aux: torch.Tensor | None, logit_index: torch.Tensor | None) -> ForwardOutput:
        """Logits (through lm_head) at logit_index (B, K) of hidden (B, T, H), all T when None."""
        picked = hidden if logit_index is None else torch.gather(
            hidden, 1, logit_index[:, :, None].expand(-1, -1, hidden.shape[-1])
        )  # (B, K, H)
        logits = self.lm_head(picked).float()  # (B, K, V)
        return ForwardOutput(logits=logits, hidden=hidden, aux_hidden=aux)
