"""Forwards compiled ahead of time for the CPU: the CPU counterpart of `cuda_graph`.

A compiled program covers every batch size up to the engine's, every token count and every
context length: `torch.export` with dynamic batch, token and key dimensions, compiled by
AOTInductor (inductor's C++ backend) with the weights frozen and prepacked for oneDNN. Eager
PyTorch spends a good part of a small model's step between the matmuls (dispatch, small ops); the
compiled program does not (docs/performance.md has the figures).

`CompiledTarget` is the target's forward in two programs: a step program for forwards of a few rows
(decode, tree verification, short prompt chunks; its matmuls chosen for this CPU, `STEP_CONFIGS`, or
the few-row kernel in float32 on AVX2) and a prefill program with oneDNN's prepacked matmuls.
`CompiledHead` is one forward of a one-layer draft head over its own cache (a standalone draft
model's, `runtime.draft_model`, is called the same way: `scattered_call`). Packages are cached
under a key of everything a program depends on (`program_key`), compiled by one process while
the others wait on a file lock, and a package that does not load is set aside and compiled again
once. The programs only read their KV cache (the new K/V are written afterwards); the classes'
docstrings say how rows, padding and logits are handled.

This module does not decide when programs are used: the runtime layer's runners do
(`runtime.target.TargetRunner` for the target, `runtime.head_runner.HeadRunner` for a draft
head, by the `RuntimePlan` and, for the target's steps, `PathChooser`'s timings); the engine and
the drafters never ask. It does nothing on CUDA.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specserve.models.cpu_linear import padded_rows
from specserve.models.kv_cache import KVCache
from specserve.models.llama import Attend, Attention, ForwardOutput, LlamaModel
from specserve.runtime.compile_cache import PREFILL_CONFIGS, Runner, compiled_or_none, load_or_compile, program_key
from specserve_kernels import few_row_gemm, gguf_gemm, slot_attention

log = logging.getLogger(__name__)

KEY_ALIGN = 16  # prefix keys read per request: a multiple of this (fewer distinct sizes, never 0 or 1)
STEP_ROWS = 16  # forwards of at most this many rows (batch x tokens) run the step program
TEMPLATE_STEP_ROWS = 64  # the same where its matmuls are inductor's (`choose_step_matmul`)
STEP_CONFIGS = {**PREFILL_CONFIGS, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN"}


def choose_step_matmul(module: nn.Module, cache_dir: Path, requested: str = "auto") -> str:
    """The matmuls of a few-row program of `module` on this machine: "few_row_gemm" (the AVX2
    kernel, built into `cache_dir`) for float32 weights where it runs and `requested` is "auto",
    else "inductor" (autotuned)."""
    weight = next(module.parameters())
    if (requested == "inductor" or weight.dtype != torch.float32 or weight.device.type != "cpu"
            or not few_row_gemm.load(cache_dir / "kernels")):
        return "inductor"
    return "few_row_gemm"


def compute_dtype(model: LlamaModel) -> torch.dtype:
    """The dtype of the model's activations (its norms' weights are kept in it)."""
    return model.norm.weight.dtype


def cache_is_narrower(cache: KVCache, model: LlamaModel) -> bool:
    """Whether the KV cache keeps fewer bits a number than the model's activations (`kv_cache_dtype`)."""
    return cache.data.dtype.itemsize < compute_dtype(model).itemsize


def readonly_attend(kv: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    new_kv: list[torch.Tensor]) -> Attend:
    """Attention over one layer's cached prefix and the new tokens, leaving the cache as it is.

    kv (2, slots, Hkv, S, D) the layer's first S entries per slot; mask (B, 1, T, S + T) over
    [prefix entries | new tokens]; cos, sin (B, T, 1, D). The new tokens' K/V go to `new_kv`
    as (B, T, 2, Hkv, D)."""

    def attend(attn: Attention, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = attn.project(x, cos, sin)  # q (B, Hq, T, D); k, v (B, T, Hkv, D)
        new_kv.append(torch.stack([k, v], dim=2))
        keys = torch.cat([kv[0][slots].to(k.dtype), k.transpose(1, 2)], dim=2)  # (B, Hkv, S + T, D)
        values = torch.cat([kv[1][slots].to(v.dtype), v.transpose(1, 2)], dim=2)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)  # (B, Hq, T, D)
        return attn.o_proj(out.transpose(1, 2).reshape(b, t, -1))

    return attend


def slot_attend(kv: torch.Tensor, slots: torch.Tensor, cache_lens: torch.Tensor, new_mask: torch.Tensor,
                cos: torch.Tensor, sin: torch.Tensor, new_kv: list[torch.Tensor]) -> Attend:
    """`readonly_attend` through the CPU op that reads each request's prefix in place
    (`specserve_kernels.slot_attention`): token t sees entries [0, cache_lens[b]) of its slot and new
    token j where new_mask[b, t, j]. No gathered prefix, no (B, 1, T, S + T) mask."""

    def attend(attn: Attention, x: torch.Tensor) -> torch.Tensor:
        q, k, v = attn.project(x, cos, sin)  # q (B, Hq, T, D); k, v (B, T, Hkv, D)
        new_kv.append(torch.stack([k, v], dim=2))
        out = slot_attention.slot_attention(q.transpose(1, 2).float(), k.float(), v.float(), kv[0], kv[1], slots,
                                            cache_lens, new_mask)  # float32 new K/V, rounded there to the cache
        return attn.o_proj(out.to(x.dtype))

    return attend


def write_new_kv(cache: KVCache, slots: torch.Tensor, write_pos: torch.Tensor, new_kv: torch.Tensor,
                 host_start: int | None = None) -> None:
    """new_kv (B, T, L, 2, Hkv, D) into each request's slot at write_pos (B, T). host_start: one request's
    write_pos[0, 0] on the host: on a CPU its entries are then one slice (13 against 52 us at 8 rows)."""
    if host_start is not None and new_kv.shape[0] == 1 and cache.data.device.type == "cpu":
        t = new_kv.shape[1]
        cache.data[:, :, int(slots[0]), :, host_start : host_start + t] = new_kv[0].permute(1, 2, 3, 0, 4)
    else:
        cache.data[:, :, slots[:, None], :, write_pos] = new_kv.to(cache.data.dtype)


def prefix_keys(cache: KVCache, s: int) -> torch.Tensor:
    """(L, 2, slots, Hkv, S, D): the first S entries of every slot, a view (its strides are the cache's)."""
    return cache.data[..., :s, :]


def aligned_keys(n: int) -> int:
    return max(KEY_ALIGN, -(-n // KEY_ALIGN) * KEY_ALIGN)


def pad_columns(x: torch.Tensor, t: int, value: float = 0) -> torch.Tensor:
    """x (B, T, ...) -> (B, t, ...): columns T.. filled with value."""
    pad = x.new_full((x.shape[0], t - x.shape[1], *x.shape[2:]), value)
    return torch.cat([x, pad], dim=1)


def continued_positions(positions: torch.Tensor, t: int, limit: int) -> torch.Tensor:
    """positions (B, T) -> (B, t): the padded columns continue each row's last position (below limit)."""
    extra = torch.arange(1, t - positions.shape[1] + 1, device=positions.device)
    return torch.cat([positions, (positions[:, -1:] + extra).clamp(max=limit - 1)], dim=1)


class ReadOnlyForward(nn.Module):
    """What `CompiledTarget` exports: the target's layers over (cached prefix, new tokens).

    forward(tokens (B, T), positions (B, T), slots (B,), cache_lens (B,), new_mask (B, T, T) bool,
    kv (L, 2, slots, Hkv, S, D)) -> hidden (B, T, H) final-norm output, new_kv (B, T, L, 2, Hkv, D),
    with aux layers aux (B, T, len(aux_layers) * H), and with_logits logits (B, T, V) float32 last.
    Token t of row b sees prefix entries s < cache_lens[b] and new token j where new_mask[b, t, j].
    """

    def __init__(self, model: LlamaModel, aux_layers: tuple[int, ...], with_logits: bool = False,
                 in_place: bool = False) -> None:
        """in_place: attention through `slot_attend` (the CPU op loaded), else SDPA over gathered keys."""
        super().__init__()
        self.model, self.aux_layers, self.with_logits, self.in_place = model, aux_layers, with_logits, in_place
        cos, sin = model.rope
        self.register_buffer("cos", cos, persistent=False)  # (max_len, D)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, cache_lens: torch.Tensor,
                new_mask: torch.Tensor, kv: torch.Tensor) -> tuple[torch.Tensor, ...]:
        b, t = tokens.shape
        s = kv.shape[-2]
        cos, sin = self.cos[positions].unsqueeze(2), self.sin[positions].unsqueeze(2)  # (B, T, 1, D)
        new_kv: list[torch.Tensor] = []
        if self.in_place:
            def attend(i: int, attn: Attention, x: torch.Tensor) -> torch.Tensor:
                return slot_attend(kv[i], slots, cache_lens, new_mask, cos, sin, new_kv)(attn, x)
        else:
            in_prefix = torch.arange(s, device=tokens.device)[None, :] < cache_lens[:, None]  # (B, S)
            mask = torch.cat([in_prefix[:, None, :].expand(b, t, s), new_mask], dim=-1)[:, None]  # (B, 1, T, S + T)

            def attend(i: int, attn: Attention, x: torch.Tensor) -> torch.Tensor:
                return readonly_attend(kv[i], slots, mask, cos, sin, new_kv)(attn, x)
        hidden, aux = self.model.run_layers(tokens, attend, self.aux_layers)
        outputs = (hidden, torch.stack(new_kv, dim=2), *(() if aux is None else (aux,)))
        return (*outputs, self.model.lm_head(hidden).float()) if self.with_logits else outputs


def choose_step_attention(cache: KVCache, cache_dir: Path, requested: str = "auto") -> str:
    """The programs' attention: "in_place" (the CPU op reading each slot's prefix where it lies,
    built into `cache_dir`) where it runs, the cache is float32, bfloat16 or float16 and `requested` is
    "auto", else "sdpa" (over gathered keys)."""
    if (requested == "auto" and cache.data.device.type == "cpu"
            and cache.data.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and slot_attention.load(cache_dir / "kernels")):
        return "in_place"
    return "sdpa"


class CompiledTarget:
    """The compiled forwards of one target with one KV cache (a step program and a prefill
    program); build it before the target's linears are prepacked for eager use (export reads the
    plain weights).

    A forward of more new tokens than the step program takes runs padded to one of a bounded set of
    token counts (`cpu_linear.padded_rows`, at most 12.5 % more): oneDNN keeps memory for every
    shape it meets, and prompt chunks and catch-ups of every length grew a server without bound.

    The programs only read their KV cache: they return the new tokens' K/V, which are written
    afterwards with one indexed copy (inductor would copy a cache mutated inside the program whole).
    Keys are each request's first S cache entries followed by the new tokens; the mask says which of
    them a token sees. The step program computes every row's logits itself (a step needs them all);
    after the prefill program they come from the eager, prepacked lm_head at the positions asked for,
    so a prefill does not pay for every prompt position's logits.
    """

    def __init__(self, model: LlamaModel, cache: KVCache, aux_layers: tuple[int, ...], max_batch_size: int,
                 max_tokens: int, cache_dir: Path, step_matmul: str = "auto", step_attention: str = "auto") -> None:
        self.model, self.cache, self.aux_layers = model, cache, tuple(aux_layers)
        self.max_batch_size, self.max_tokens = max_batch_size, max_tokens
        key = program_key(model.state_dict().items(), "target", tuple(cache.data.shape), cache.data.dtype,
                          self.aux_layers, max_batch_size, max_tokens, gguf_gemm.activation_digits(model))
        self.step_matmul = choose_step_matmul(model, cache_dir, step_matmul)
        self.step_attention = choose_step_attention(cache, cache_dir, step_attention)
        if self.step_attention != "in_place" and cache_is_narrower(cache, model):
            # SDPA in a program would attend to the new K/V unrounded (inductor drops a round trip through
            # float16), so a tree's tokens would not see what their decodes read back from the cache
            raise ValueError(f"a {cache.data.dtype} cache under a {compute_dtype(model)} model needs the in-place "
                             "attention kernel in its programs")
        self.step_rows = TEMPLATE_STEP_ROWS if self.step_matmul == "inductor" else STEP_ROWS
        if self.step_attention == "in_place":  # both programs call the op
            key += f"-attn{slot_attention.source_digest()[:8]}"
        step_key = key if self.step_matmul == "inductor" else f"{key}-rows{few_row_gemm.source_digest()[:8]}"
        self.path, self.step_path = cache_dir / f"target-{key}.pt2", cache_dir / f"target-step-{step_key}.pt2"
        self.runner, self.compiled_now = load_or_compile(self.path, lambda: self._export(max_tokens, False))
        log.info("target step program: %s matmuls, %s attention", self.step_matmul, self.step_attention)
        step = compiled_or_none("target step program", lambda: load_or_compile(
            self.step_path, lambda: self._export_step(min(self.step_rows, max_tokens)), STEP_CONFIGS))
        self.step_runner = step[0] if step else None
        self.compiled_now |= bool(step and step[1])

    def _export_step(self, max_tokens: int) -> torch.export.ExportedProgram:
        if self.step_matmul == "inductor":
            return self._export(max_tokens, True)
        with few_row_gemm.few_row_linears(self.model):
            return self._export(max_tokens, True)

    def _export(self, max_tokens: int, with_logits: bool) -> torch.export.ExportedProgram:
        """The prefill program (chunks of many tokens), or the step program (with_logits). In a float32 model
        both attend in place where the step program does, so that a token comes out of either bit for bit the
        same however its prompt was chunked (as fast for prompts); a bf16 model's prefill keeps SDPA."""
        Dim = torch.export.Dim
        batch = Dim("batch", min=1, max=max(2, self.max_batch_size))  # a Dim spans two sizes at least
        tokens = Dim("tokens", min=1, max=max_tokens)
        keys = Dim("keys", min=2, max=self.cache.max_len - 1)
        dynamic = ({0: batch, 1: tokens}, {0: batch, 1: tokens}, {0: batch}, {0: batch},
                   {0: batch, 1: tokens, 2: tokens}, {4: keys})
        i64 = dict(dtype=torch.int64, device=self.cache.data.device)
        b, t = 2, 3  # sizes of 1 would be specialised
        example = (torch.zeros(b, t, **i64), torch.arange(t, **i64).expand(b, t).contiguous(), torch.zeros(b, **i64),
                   torch.zeros(b, **i64), torch.ones(b, t, t, dtype=torch.bool).tril(),
                   prefix_keys(self.cache, KEY_ALIGN))
        in_place = self.step_attention == "in_place" and (with_logits or compute_dtype(self.model) == torch.float32)
        return torch.export.export(ReadOnlyForward(self.model, self.aux_layers, with_logits, in_place).eval(), example,
                                   dynamic_shapes=dynamic, strict=False)

    def fits(self, batch_size: int, num_tokens: int, max_cache_len: int) -> bool:
        """Whether the program covers this forward (else the caller runs it eagerly)."""
        return (batch_size <= self.max_batch_size and num_tokens <= self.max_tokens
                and max_cache_len < self.cache.max_len)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, cache_lens: torch.Tensor,
                new_mask: torch.Tensor, host_cache_lens: list[int], logit_index: torch.Tensor | None = None
                ) -> ForwardOutput:
        """Like `LlamaModel.forward`: tokens, positions (B, T); slots, cache_lens (B,); new_mask
        (B, T, T) bool (causal for a prefill); writes the new tokens' K/V at cache_lens[b] + j."""
        b, t = tokens.shape
        s = min(aligned_keys(max(host_cache_lens)), self.cache.max_len - 1)  # the programs' largest key count
        assert self.fits(b, t, max(host_cache_lens)), "check fits() first"
        small = b * t <= self.step_rows and self.step_runner is not None
        padded = t if small else min(padded_rows(t), self.max_tokens)
        if padded > t:  # padded tokens come after the real ones and see only themselves and the prefix
            mask = torch.zeros(b, padded, padded, dtype=torch.bool, device=new_mask.device)
            mask[:, :t, :t] = new_mask
            mask[:, t:, t:] = torch.eye(padded - t, dtype=torch.bool, device=new_mask.device)
            tokens, new_mask = pad_columns(tokens, padded), mask
            positions = continued_positions(positions, padded, self.model.rope[0].shape[0])
        # the program reads its inputs with the strides it was exported with: contiguous, and the cache's own
        inputs = (x.contiguous() for x in (tokens, positions, slots, cache_lens, new_mask))
        outputs = [o[:, :t] for o in (self.step_runner if small else self.runner)(*inputs, prefix_keys(self.cache, s))]
        write_new_kv(self.cache, slots, cache_lens[:, None] + torch.arange(t, device=tokens.device), outputs[1],
                     host_cache_lens[0])
        aux = outputs[2] if self.aux_layers else None
        if not small:
            return self.model.output(outputs[0], aux, logit_index)
        logits = outputs[-1]  # (B, T, V): every row's
        if logit_index is not None:
            logits = torch.gather(logits, 1, logit_index[:, :, None].expand(-1, -1, logits.shape[-1]))
        return ForwardOutput(logits=logits, hidden=outputs[0], aux_hidden=aux)


class ReadOnlyHeadStep(nn.Module):
    """What `CompiledHead` exports: one forward of a one-layer draft head over its own cache.

    forward(tokens (B, T), hidden (B, T, F), positions (B, T) rope positions, write_pos (B, T) the
    cache entries the new tokens take, slots (B,), mask (B, 1, T, S) bool over cache entries as if
    the new tokens were written already, kv (1, 2, slots, Hkv, S, D)) -> h (B, T, H),
    new_kv (B, T, 1, 2, Hkv, D). `head(tokens, hidden, attend)` is an EAGLE or MTP head.
    """

    def __init__(self, head: nn.Module, rope: tuple[torch.Tensor, torch.Tensor]) -> None:
        super().__init__()
        self.head = head
        self.register_buffer("cos", rope[0], persistent=False)  # (max_len, D)
        self.register_buffer("sin", rope[1], persistent=False)

    def forward(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, write_pos: torch.Tensor,
                slots: torch.Tensor, mask: torch.Tensor, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        full = prefix_then_new(mask, write_pos)
        cos, sin = self.cos[positions].unsqueeze(2), self.sin[positions].unsqueeze(2)
        new_kv: list[torch.Tensor] = []
        h = self.head(tokens, hidden, readonly_attend(kv[0], slots, full, cos, sin, new_kv))
        return h, torch.stack(new_kv, dim=2)


def prefix_then_new(mask: torch.Tensor, write_pos: torch.Tensor) -> torch.Tensor:
    """mask (B, 1, T, S) over cache entries as if the new tokens were written at write_pos (B, T)
    -> (B, 1, T, S + T) over [the cache as it is | the new tokens] (`readonly_attend`'s keys)."""
    b, t = write_pos.shape
    at_new = write_pos[:, None, :].expand(b, t, t)
    own = torch.gather(mask[:, 0], 2, at_new)  # (B, T, T): new token j visible to new token i
    prefix = mask[:, 0].scatter(2, at_new, False)  # the new tokens' entries are not in the cache yet
    return torch.cat([prefix, own], dim=-1)[:, None]


class CompiledHead:
    """The compiled forward of a one-layer draft head with its cache: one program per feature
    width it reads (EAGLE-3 fuses 3 target layers on catch-up, then reads its own states). Build
    it before the head's linears are prepacked for eager use."""

    def __init__(self, head: nn.Module, embed: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cache: KVCache,
                 feature_sizes: tuple[int, ...], cache_dir: Path) -> None:
        self.head, self.rope, self.cache = head, rope, cache
        self.runners: dict[int, Runner] = {}
        self.compiled_now = False
        tensors = [*head.state_dict().items(), ("embed", embed)]
        for f in sorted(set(feature_sizes)):
            key = program_key(tensors, "head", f, tuple(cache.data.shape))
            self.runners[f], now = load_or_compile(cache_dir / f"head-{key}.pt2", lambda f=f: self._export(f))
            self.compiled_now |= now

    def _export(self, feature_size: int) -> torch.export.ExportedProgram:
        Dim = torch.export.Dim
        batch = Dim("batch", min=1, max=max(2, self.cache.num_slots))
        tokens = Dim("tokens", min=1, max=self.cache.max_len - 1)
        keys = Dim("keys", min=2, max=self.cache.max_len - 1)
        dynamic = ({0: batch, 1: tokens}, {0: batch, 1: tokens}, {0: batch, 1: tokens}, {0: batch, 1: tokens},
                   {0: batch}, {0: batch, 2: tokens, 3: keys}, {4: keys})
        dev, dtype = self.cache.data.device, self.cache.data.dtype
        b, t = 2, 3  # sizes of 1 would be specialised
        pos = torch.arange(t, device=dev).expand(b, t).contiguous()
        example = (torch.zeros(b, t, dtype=torch.int64, device=dev),
                   torch.zeros(b, t, feature_size, dtype=dtype, device=dev),
                   pos, pos.clone(), torch.zeros(b, dtype=torch.int64, device=dev),
                   torch.ones(b, 1, t, KEY_ALIGN, dtype=torch.bool, device=dev), prefix_keys(self.cache, KEY_ALIGN))
        return torch.export.export(ReadOnlyHeadStep(self.head, self.rope).eval(), example, dynamic_shapes=dynamic,
                                   strict=False)

    def fits(self, key_len: int) -> bool:
        """Whether the program covers a forward reading key_len entries (else run the head eagerly)."""
        return aligned_keys(key_len) < self.cache.max_len

    def forward(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, write_pos: torch.Tensor,
                mask: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """As the head's eager forward over the cache: mask (B, 1, T, key_len) over cache entries,
        the new ones (write_pos) included; writes their K/V. -> h (B, T, H)."""
        assert self.fits(mask.shape[-1]), "check fits() first"
        return scattered_call(self.runners[hidden.shape[-1]], self.cache, self.rope[0].shape[0], tokens, (hidden,),
                              positions, write_pos, mask, slots)


def scattered_call(runner: Runner, cache: KVCache, rope_len: int, tokens: torch.Tensor,
                   per_token: tuple[torch.Tensor, ...], positions: torch.Tensor, write_pos: torch.Tensor,
                   mask: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """One call of a program exported as `ReadOnlyHeadStep` is (tokens, *per_token, positions,
    write_pos, slots, mask, kv) -> (out, new_kv): the new tokens written at arbitrary cache entries
    `write_pos` (B, T), mask (B, 1, T, key_len) over cache entries as if they were written. Runs
    padded to `padded_rows(T)` tokens where the cache has room; writes the new K/V; -> out (B, T, ...)."""
    (b, t), key_len = tokens.shape, mask.shape[-1]
    padded = min(padded_rows(t), cache.max_len - 1)
    if padded > t and aligned_keys(key_len + 1) >= cache.max_len:
        padded = t
    # padded tokens take cache entry key_len, past every real token's keys, and see only that entry
    s = aligned_keys(key_len + (padded > t))
    full = torch.zeros(b, 1, padded, s, dtype=torch.bool, device=mask.device)
    full[:, :, :t, :key_len] = mask
    full[:, :, t:, key_len:key_len + 1] = padded > t
    if padded > t:
        tokens, per_token = pad_columns(tokens, padded), tuple(pad_columns(x, padded) for x in per_token)
        positions = continued_positions(positions, padded, rope_len)
        write_pos = pad_columns(write_pos, padded, key_len)
    inputs = (x.contiguous() for x in (tokens, *per_token, positions, write_pos, slots, full))
    out, new_kv = runner(*inputs, prefix_keys(cache, s))
    write_new_kv(cache, slots, write_pos[:, :t], new_kv[:, :t])
    return out[:, :t]
