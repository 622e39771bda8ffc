"""The target's forward compiled ahead of time for the CPU: the CPU counterpart of `cuda_graph`.

One program covers prefill, decode and tree verification at every batch size up to the engine's,
every token count and every context length: `torch.export` with dynamic batch, token and key
dimensions, compiled by AOTInductor (inductor's C++ backend) with the weights frozen and
prepacked for oneDNN. Eager PyTorch spends about a third of a SmolLM2 decode step between the
matmuls (dispatch, small ops); the compiled program does not.

The package is stored in a compile cache under a key of everything the program depends on (the
weights as loaded, dtype, the EAGLE-3 layers asked for, the cache's shape, this module's source,
torch's version, the CPU's flags), so a restart loads it in well under a second instead of
compiling again. Processes that want the same package take turns through a file lock: one
compiles, the others load.

The program only reads the KV cache: it returns the new tokens' K/V, which `CompiledTarget.forward`
writes with one indexed copy (inductor would copy a cache mutated inside the program whole).
Keys are each request's first S cache entries (S: the longest prefix, rounded up to KEY_ALIGN)
followed by the new tokens; the mask hides entries past a request's prefix. Logits come from the
eager, prepacked lm_head at the positions asked for, so a prefill does not pay for every
prompt position's logits.

This module does not decide when it is used (the engine does) and does nothing on CUDA.
"""

from __future__ import annotations

import hashlib
import logging
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from filelock import FileLock
from torch import nn

from specserve.hardware import cpu_flags
from specserve.models.kv_cache import KVCache
from specserve.models.llama import Attention, ForwardOutput, LlamaModel

log = logging.getLogger(__name__)

KEY_ALIGN = 64  # prefix keys read per request: a multiple of this


def can_compile(device: torch.device) -> bool:
    """AOTInductor's C++ backend needs a CPU and a C++ compiler (gcc, which set-up installs)."""
    import shutil

    return device.type == "cpu" and shutil.which("g++") is not None


class ReadOnlyForward(nn.Module):
    """What is exported: the target's layers over (prefix keys read from the cache, new tokens).

    forward(tokens (B, T), positions (B, T), slots (B,), cache_lens (B,), new_mask (B, T, T) bool,
    kv (L, 2, slots, Hkv, S, D): the cache's first S entries per slot) ->
    hidden (B, T, H) final-norm output, new_kv (B, T, L, 2, Hkv, D), and with aux layers
    aux (B, T, len(aux_layers) * H).
    Token t of row b sees prefix entries s < cache_lens[b] and new token j where new_mask[b, t, j].
    """

    def __init__(self, model: LlamaModel, aux_layers: tuple[int, ...]) -> None:
        super().__init__()
        self.model, self.aux_layers = model, aux_layers
        cos, sin = model.rope
        self.register_buffer("cos", cos, persistent=False)  # (max_len, D)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, cache_lens: torch.Tensor,
                new_mask: torch.Tensor, kv: torch.Tensor) -> tuple[torch.Tensor, ...]:
        b, t = tokens.shape
        s = kv.shape[-2]
        cos, sin = self.cos[positions].unsqueeze(2), self.sin[positions].unsqueeze(2)  # (B, T, 1, D)
        in_prefix = torch.arange(s, device=tokens.device)[None, :] < cache_lens[:, None]  # (B, S)
        mask = torch.cat([in_prefix[:, None, :].expand(b, t, s), new_mask], dim=-1)[:, None]  # (B, 1, T, S + T)
        new_kv = []

        def attend(i: int, attn: Attention, x: torch.Tensor) -> torch.Tensor:
            q, k, v = attn.project(x, cos, sin)  # q (B, Hq, T, D); k, v (B, T, Hkv, D)
            new_kv.append(torch.stack([k, v], dim=2))  # (B, T, 2, Hkv, D)
            keys = torch.cat([kv[i, 0][slots], k.transpose(1, 2)], dim=2)  # (B, Hkv, S + T, D)
            values = torch.cat([kv[i, 1][slots], v.transpose(1, 2)], dim=2)
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)  # (B, Hq, T, D)
            return attn.o_proj(out.transpose(1, 2).reshape(b, t, -1))

        hidden, aux = self.model.run_layers(tokens, attend, self.aux_layers)
        outputs = (hidden, torch.stack(new_kv, dim=2))
        return outputs if aux is None else (*outputs, aux)


def program_key(model: LlamaModel, cache_shape: tuple[int, ...], aux_layers: tuple[int, ...], max_batch_size: int,
                max_tokens: int) -> str:
    """A digest of everything a compiled program depends on: the weights as loaded (dtype
    included), the cache's shape (its strides are baked in), the outputs and sizes asked for,
    this module's source, torch's version and the CPU's flags (the code is vectorised for them)."""
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().contiguous().view(torch.uint8).numpy())
    parts = (torch.__version__, cache_shape, aux_layers, max_batch_size, max_tokens, sorted(cpu_flags()),
             Path(__file__).read_bytes())
    h.update(repr(parts).encode())
    return h.hexdigest()[:24]


class CompiledTarget:
    """The compiled forward of one target with one KV cache; build it before the target's linears
    are prepacked for eager use (export reads the plain weights)."""

    def __init__(self, model: LlamaModel, cache: KVCache, aux_layers: tuple[int, ...], max_batch_size: int,
                 max_tokens: int, cache_dir: Path) -> None:
        self.model, self.cache, self.aux_layers = model, cache, tuple(aux_layers)
        self.max_batch_size, self.max_tokens = max_batch_size, max_tokens
        key = program_key(model, tuple(cache.data.shape), self.aux_layers, max_batch_size, max_tokens)
        self.path = cache_dir / f"target-{key}.pt2"
        start = time.perf_counter()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(self.path) + ".lock"):
            compiled_now = not self.path.is_file()
            if compiled_now:
                self._compile()
            self.runner = torch._inductor.aoti_load_package(str(self.path))
        log.info("compiled target forward (AOTInductor, batch <= %d, tokens <= %d, any context): %s %s in %.1f s",
                 max_batch_size, max_tokens, "compiled to" if compiled_now else "loaded from", self.path,
                 time.perf_counter() - start)
        self.compiled_now = compiled_now

    def _example(self, b: int, t: int, s: int) -> tuple[torch.Tensor, ...]:
        dev = self.cache.data.device
        return (torch.zeros(b, t, dtype=torch.int64, device=dev), torch.arange(t, device=dev).expand(b, t).contiguous(),
                torch.zeros(b, dtype=torch.int64, device=dev), torch.zeros(b, dtype=torch.int64, device=dev),
                torch.ones(b, t, t, dtype=torch.bool, device=dev).tril(), self._prefix_keys(s))

    def _prefix_keys(self, s: int) -> torch.Tensor:
        return self.cache.data[..., :s, :]  # (L, 2, slots, Hkv, S, D): a view

    def _compile(self) -> None:
        Dim = torch.export.Dim
        batch = Dim("batch", min=1, max=max(2, self.max_batch_size))  # a Dim spans two sizes at least
        tokens = Dim("tokens", min=1, max=self.max_tokens)
        keys = Dim("keys", min=2, max=self.cache.max_len - 1)
        dynamic = ({0: batch, 1: tokens}, {0: batch, 1: tokens}, {0: batch}, {0: batch},
                   {0: batch, 1: tokens, 2: tokens}, {4: keys})
        example = self._example(2, 3, KEY_ALIGN)  # sizes of 1 would be specialised
        log.info("compiling the target forward for this CPU (once; stored in %s)", self.path.parent)
        with torch.inference_mode(False), torch.no_grad():
            program = torch.export.export(ReadOnlyForward(self.model, self.aux_layers).eval(), example,
                                          dynamic_shapes=dynamic, strict=False)
        tmp = self.path.with_suffix(".tmp.pt2")
        torch._inductor.aoti_compile_and_package(program, package_path=str(tmp), inductor_configs={"freezing": True})
        tmp.replace(self.path)  # whole packages only: a crash mid-compile leaves no half file under the key

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, cache_lens: torch.Tensor,
                new_mask: torch.Tensor, host_cache_lens: list[int], logit_index: torch.Tensor | None = None
                ) -> ForwardOutput:
        """Like `LlamaModel.forward`: tokens, positions (B, T); slots, cache_lens (B,); new_mask
        (B, T, T) bool (causal for a prefill); writes the new tokens' K/V at cache_lens[b] + j."""
        b, t = tokens.shape
        s = max(KEY_ALIGN, -(-max(host_cache_lens) // KEY_ALIGN) * KEY_ALIGN)
        if b > self.max_batch_size or t > self.max_tokens or s + t > self.cache.max_len:
            raise ValueError(f"compiled forward: batch {b} x {t} tokens after {max(host_cache_lens)} do not fit")
        # the program reads its inputs with the strides it was exported with: contiguous, and the cache's own
        inputs = (x.contiguous() for x in (tokens, positions, slots, cache_lens, new_mask))
        outputs = self.runner(*inputs, self._prefix_keys(s))
        hidden, new_kv = outputs[0], outputs[1]
        write_pos = cache_lens[:, None] + torch.arange(t, device=tokens.device)  # (B, T)
        self.cache.data[:, :, slots[:, None], :, write_pos] = new_kv  # (B, T, L, 2, Hkv, D) into each (slot, position)
        return self.model.output(hidden, outputs[2] if self.aux_layers else None, logit_index)
