"""A Llama model computed from a GGUF file's own blocks: `weight_format="gguf"` on a CPU.

`load_llama_gguf` builds the `LlamaModel` of a prepared directory's config from its `model.gguf`:
every linear layer a `GGUFLinear` on the file's Q4_0 / Q4_1 / Q8_0 blocks (q/k/v and gate/up
concatenated by rows, q and k rows put back in Hugging Face's order, which llama.cpp's converter
permutes for its RoPE), the tied embedding a `GGUFEmbedding` reading the same blocks as the lm_head,
and the norms the file's float32 vectors. Activations are float32. With `dequantize=True` the same
weights are plain float32 `nn.Linear`s: the float32 reference the 4-bit path is tested against (what
transformers' GGUF loader computes, before `prepare` rounds it to bf16).

This module does not quantize anything, read other GGUF types (K-quants, float16 matrices) or
architectures than Llama's, or run on CUDA; `gguf_gemm.supported` says whether this machine can.
"""

from __future__ import annotations

import math
import struct
from pathlib import Path

import torch
from torch import nn

from specserve.model_config import ModelConfig
from specserve.models.llama import LlamaModel
from specserve.models.weights import empty_modules
from specserve.prepare import GGUF_NAME
from specserve_kernels import gguf_gemm


class GGUFEmbedding(nn.Module):
    """An embedding lookup on a tied lm_head's blocks: token t's row is the lm_head's output feature t,
    dequantized exactly. `weight` (the whole float32 table) is built on first read, for drafters
    that read the target's embedding as a matrix; the lookup never builds it."""

    def __init__(self, table: gguf_gemm.GGUFLinear) -> None:
        super().__init__()
        self.table = table

    @property
    def weight(self) -> torch.Tensor:
        return self.table.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.table.rows(tokens.reshape(-1)).reshape(*tokens.shape, self.table.in_features)


# GGUF metadata value types -> their size in bytes (8: string, 9: array; sized as they are read)
_VALUE_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_F32, _F16 = 0, 1


def read_gguf(path: str | Path) -> dict[str, tuple[torch.Tensor, int]]:
    """Every tensor of a GGUF file: name -> (raw blocks (rows, bytes) uint8, or float32 / float16 values;
    its ggml type). Only the tensors are read: the metadata (a tokenizer's vocabulary among it) is
    skipped, which gguf-py's reader would parse value by value (seconds for SmolLM2's)."""
    data = Path(path).read_bytes()
    if data[:4] != b"GGUF":
        raise ValueError(f"GGUF: {path} is not a GGUF file")
    pos = 8  # magic, version
    n_tensors, n_kv = struct.unpack_from("<QQ", data, pos)
    pos += 16
    alignment = 32

    def string(at: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", data, at)
        return data[at + 8 : at + 8 + n].decode("utf-8", "replace"), at + 8 + n

    def skip(vtype: int, at: int) -> int:
        if vtype == 8:
            return at + 8 + struct.unpack_from("<Q", data, at)[0]
        if vtype == 9:
            etype, count = struct.unpack_from("<IQ", data, at)
            at += 12
            if etype in _VALUE_BYTES:
                return at + count * _VALUE_BYTES[etype]
            for _ in range(count):
                at = skip(etype, at)
            return at
        return at + _VALUE_BYTES[vtype]

    for _ in range(n_kv):
        key, pos = string(pos)
        (vtype,) = struct.unpack_from("<I", data, pos)
        if key == "general.alignment":
            (alignment,) = struct.unpack_from("<I", data, pos + 4)
        pos = skip(vtype, pos + 4)
    infos = []
    for _ in range(n_tensors):
        name, pos = string(pos)
        (n_dims,) = struct.unpack_from("<I", data, pos)
        dims = struct.unpack_from(f"<{n_dims}Q", data, pos + 4)
        qtype, offset = struct.unpack_from("<IQ", data, pos + 4 + 8 * n_dims)
        pos += 4 + 8 * n_dims + 12
        infos.append((name, dims, qtype, offset))
    start = -(-pos // alignment) * alignment
    buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    tensors = {}
    for name, dims, qtype, offset in infos:
        rows = math.prod(dims[1:])
        if qtype in (_F32, _F16):
            dtype = torch.float32 if qtype == _F32 else torch.float16
            size = dtype.itemsize * dims[0] * rows
            raw = buffer[start + offset : start + offset + size].view(dtype).clone()
        elif qtype in gguf_gemm.FILE_BLOCK_BYTES:
            row_bytes = dims[0] // gguf_gemm.BLOCK * gguf_gemm.FILE_BLOCK_BYTES[qtype]
            raw = buffer[start + offset : start + offset + rows * row_bytes].view(rows, row_bytes)
        else:
            continue  # a type this loader does not serve; `linear` names the missing layer
        tensors[name] = (raw, qtype)
    return tensors


def _unpermute_rows(raw: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's converter orders each q / k head's rows (pair i of its RoPE halves interleaved);
    Hugging Face's order puts them back (transformers' GGUF loader does the same to its floats)."""
    rows = raw.shape[0]
    return raw.reshape(heads, rows // heads // 2, 2, *raw.shape[1:]).transpose(1, 2).reshape(raw.shape)


def load_llama_gguf(model_dir: str | Path, gguf_file: str | Path | None = None,
                    dequantize: bool = False, layout: int | None = None,
                    digits: int = gguf_gemm.EXACT_DIGITS) -> LlamaModel:
    """The model of `model_dir`'s config on the blocks of `gguf_file` (default: `model_dir/model.gguf`),
    float32 activations. dequantize: plain float32 weights instead (the reference). layout: the blocks'
    packed layout (`gguf_gemm.FLOAT_LAYOUT` or `INT_LAYOUT`; default `gguf_gemm.default_layout`). digits:
    the activation digits the integer layout keeps (`gguf_gemm.ACTIVATION_DIGITS`)."""
    cfg = ModelConfig.from_dir(model_dir)
    tensors = read_gguf(gguf_file or Path(model_dir) / GGUF_NAME)
    if not dequantize and not gguf_gemm.load():
        raise RuntimeError("weight_format=gguf: the GGUF matmul kernel cannot run on this machine "
                           "(it needs x86-64 with AVX2, FMA and F16C, g++ and ninja); use weight_format=bf16")

    def raw(name: str) -> tuple[torch.Tensor, int]:
        if name not in tensors:
            raise KeyError(f"GGUF: missing tensor {name!r}")
        return tensors[name]

    def linear(names: list[str], permute: dict[str, int] | None = None) -> nn.Module:
        parts, qtypes = [], set()
        for name in names:
            data, qtype = raw(name)
            heads = (permute or {}).get(name)
            parts.append(_unpermute_rows(data, heads) if heads else data)
            qtypes.add(qtype)
        if len(qtypes) != 1 or next(iter(qtypes)) not in gguf_gemm.FILE_BLOCK_BYTES:
            raise ValueError(f"GGUF: {names} are of types {sorted(qtypes)}; Q4_0, Q4_1 or Q8_0 (one per layer) "
                             "can be served from their blocks")
        layer = gguf_gemm.GGUFLinear.concat(parts, qtypes.pop(), layout, digits)
        if not dequantize:
            return layer
        dense = nn.Linear(layer.in_features, layer.out_features, bias=False)
        dense.weight = nn.Parameter(layer.dequantized(), requires_grad=False)
        return dense

    def vector(name: str) -> nn.Parameter:
        data, _ = raw(name)
        return nn.Parameter(data.float().reshape(-1), requires_grad=False)

    if not cfg.tie_word_embeddings or cfg.attention_bias:
        raise ValueError("GGUF: a tied embedding and no attention biases are served from blocks (SmolLM2's layout)")
    with empty_modules():
        model = LlamaModel(cfg)
    head = linear(["token_embd.weight"])
    model.lm_head = head
    if dequantize:
        model.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=head.weight)
    else:
        model.embed_tokens = GGUFEmbedding(head)
    model.norm.weight = vector("output_norm.weight")
    for i, layer in enumerate(model.layers):
        b = f"blk.{i}."
        qkv = [b + "attn_q.weight", b + "attn_k.weight", b + "attn_v.weight"]
        layer.self_attn.qkv_proj = linear(qkv, {qkv[0]: cfg.num_heads, qkv[1]: cfg.num_kv_heads})
        layer.self_attn.o_proj = linear([b + "attn_output.weight"])
        layer.mlp.gate_up_proj = linear([b + "ffn_gate.weight", b + "ffn_up.weight"])
        layer.mlp.down_proj = linear([b + "ffn_down.weight"])
        layer.input_layernorm.weight = vector(b + "attn_norm.weight")
        layer.post_attention_layernorm.weight = vector(b + "ffn_norm.weight")
    return model.eval().requires_grad_(False)
