"""The target's forwards, behind one call per kind: `prefill` and `step` (decode or tree verify).

Per forward the runner picks, by its `RuntimePlan`: a CUDA-graph bucket (or the same static bucket
run eagerly, `graph_mode=static`), the CPU's compiled program where `PathChooser` measured it
faster, or the eager model. Prefills never run in a bucket: they pack prompt chunks of several
requests into one forward without padding (`runtime.prefill`). The runner also picks the attention
backend each bucket plans and replays.

This module knows nothing about requests, drafts or verification: it runs forwards and times the
paths it chooses between.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Sequence

import torch

from specserve.config import EngineConfig
from specserve.estimates import time_interleaved
from specserve.host_memory import back_with_huge_pages
from specserve.models.attention import TORCH_ATTENTION, AttentionBackend, make_attention_backend
from specserve.models.cpu_linear import pack_for_inference
from specserve.models.kv_cache import KVCache
from specserve.models.llama import ForwardOutput, LlamaModel
from specserve.runtime.compile_cache import compiled_or_none
from specserve.runtime.compiled import CompiledTarget, cache_is_narrower
from specserve.runtime.cuda_graph import GraphRunner, default_batch_sizes
from specserve.runtime.paths import PathChooser
from specserve.runtime.plan import RuntimePlan
from specserve.runtime.prefill import PackedPrompts, PromptChunk, concat_outputs, packed_forward
from specserve.staging import to_device
from specserve_kernels import gguf_gemm

log = logging.getLogger(__name__)


class TargetRunner:
    """Runs the target's forwards on the path its plan and `PathChooser` pick.

    `graphs`: the static buckets (None unless the plan is static); `compiled`: the CPU's compiled
    program (None unless the plan compiles and it built); `paths`: compiled vs eager per step key.
    """

    def __init__(self, model: LlamaModel, cache: KVCache, config: EngineConfig, plan: RuntimePlan,
                 aux_layers: tuple[int, ...], num_draft_tokens: int) -> None:
        """num_draft_tokens: the largest tree a step verifies (the verify buckets' token count)."""
        self.model, self.cache, self.plan, self.aux_layers = model, cache, plan, aux_layers
        self.attention = plan.attention
        self.model.attention_backend = self.make_backend()
        model.use_fused_kernels(plan.fused_kernels)
        self.buckets = default_batch_sizes(config.max_batch_size)
        self.graphs = None
        if plan.static:
            self.graphs = GraphRunner(
                model, cache, batch_sizes=plan.batch_sizes, num_tokens=sorted({1, num_draft_tokens}),
                aux_layers=aux_layers, padding_slot=cache.reserve(),
                make_backend=lambda bs, t: self.make_backend(bs if plan.capture else None, t), capture=plan.capture,
            )
        # on CPU: the target's forwards through one compiled program (exported from the plain weights, so first)
        self.compiled = None
        if plan.compile_cache_dir is not None:
            self.compiled = compiled_or_none("target", lambda: CompiledTarget(
                model, cache, aux_layers, config.max_batch_size, config.max_seq_len, plan.compile_cache_dir,
                plan.step_matmul, plan.step_attention,
            ))
        if pack_for_inference(model, keep_weights=("lm_head",)):  # drafters share the lm_head
            log.info("target: bf16 linear weights prepacked for oneDNN (CPU)")
        if self.compiled is not None:  # a decode streams every weight and program constant: 2 MiB pages
            back_with_huge_pages()
        self.paths = PathChooser(pinned=config.compiled_steps == "always",
                                 compiled_only=self._one_program(config.gguf_activations == "auto"))

    def _one_program(self, quietly: bool) -> bool:
        """Whether every forward must run the compiled programs: GGUF layers that round activations to fewer
        digits turn the last-bit differences between the eager and the compiled forward into different tokens,
        so a verified token would not be the one a decode computes. The compiled programs compute each token
        the same bit for bit whatever else is in the call or how its prompt was chunked. Without them the
        layers keep every digit (float32's precision), whose last-bit differences change no greedy token.
        A KV cache narrower than the model's numbers (`kv_cache_dtype`) needs them too where they run: its
        rounding moves logits enough that the eager attention's last-bit differences between batch shapes
        flip near-ties."""
        if self.compiled is not None and cache_is_narrower(self.cache, self.model):
            return True
        if all(d == gguf_gemm.EXACT_DIGITS for d in gguf_gemm.activation_digits(self.model)):
            return False
        if self.compiled is None:
            (log.info if quietly else log.warning)(
                "gguf_activations: rounding activations needs the compiled CPU programs (cpu_compile); computing "
                "them at float32's precision instead")
            gguf_gemm.set_activation_digits(self.model, gguf_gemm.EXACT_DIGITS)
            return False
        return True

    def make_backend(self, graph_batch_size: int | None = None, graph_num_tokens: int = 1) -> AttentionBackend:
        """The attention backend of one bucket (graph_batch_size: its batch size when captured)."""
        if self.attention == "torch":
            return TORCH_ATTENTION
        return make_attention_backend(self.attention, self.model.cfg, self.cache.max_len, self.cache.data.dtype,
                                      self.cache.data.device, graph_batch_size, graph_num_tokens)

    def bucket(self, batch_size: int) -> int:
        """The batch-size bucket a step of `batch_size` requests counts under."""
        return self.buckets[min(bisect.bisect_left(self.buckets, batch_size), len(self.buckets) - 1)]

    def forward_seconds(self, batch_size: int, max_rows: int) -> list[float | None]:
        """The expected seconds of a CPU step forward of 1, 2, ..., max_rows tokens per request at this
        batch size, on the path each runs: from the row counts measured at its batch bucket, each taken
        as at most any larger count's (more rows never cost less: a figure above that is a stall's),
        and interpolated between the nearest ones. None beyond them, and all None where no compiled
        program's paths are timed (a GPU's graphs, an eager-only CPU)."""
        if self.graphs is not None or self.compiled is None:
            return [None] * max_rows
        bucket = self.bucket(batch_size)
        measured = self.paths.estimates(bucket)
        known: list[tuple[int, float]] = []  # (rows, seconds), rows descending
        for t, e in reversed(measured):
            known.append((t, min(e, known[-1][1]) if known else e))
        known.reverse()
        out: list[float | None] = [None] * max_rows
        for (t0, e0), (t1, e1) in zip(known, known[1:] + [known[-1]] if known else []):
            for rows in range(t0, min(t1, max_rows) + 1):
                out[rows - 1] = e0 + (e1 - e0) * (rows - t0) / (t1 - t0) if t1 > t0 else e0
        return out

    # ---- forwards -------------------------------------------------------------------------------

    def prefill(self, packed: PackedPrompts) -> ForwardOutput:
        """A forward over prompt chunks (`runtime.prefill`): each chunk's tokens after the positions
        its slot holds. Returns logits (1, K, V) at each chunk's last position, hidden (1, N, H) and
        aux over the N packed columns. On a CPU with the compiled program, the chunks of each length
        as the rows of one call of it; else one packed eager forward (no padding either way)."""
        if self.compiled is not None and all(self.compiled.fits(1, len(c.tokens), c.start) for c in packed.chunks):
            return self._compiled_prefill(packed)
        return packed_forward(self.model, self.cache, packed, self.aux_layers)

    def _compiled_prefill(self, packed: PackedPrompts) -> ForwardOutput:
        """One call of the compiled program per chunk length (a call of B rows of T tokens costs far
        less than B calls of one row), its rows put back in the packed order."""
        by_length: dict[int, list[int]] = {}
        for i, c in enumerate(packed.chunks):
            by_length.setdefault(len(c.tokens), []).append(i)
        rows: dict[int, ForwardOutput] = {}
        for group in by_length.values():
            out = self._compiled_rows([packed.chunks[i] for i in group])
            for j, i in enumerate(group):
                aux = None if out.aux_hidden is None else out.aux_hidden[j : j + 1]
                rows[i] = ForwardOutput(logits=out.logits[j : j + 1], hidden=out.hidden[j : j + 1], aux_hidden=aux)
        return concat_outputs([rows[i] for i in range(len(packed.chunks))])

    def _compiled_rows(self, chunks: list[PromptChunk]) -> ForwardOutput:
        """Chunks of one length T as the rows (B, T) of one compiled call, each causal after its
        slot's first `start` entries; logits (B, 1, V) at each row's last token."""
        assert self.compiled is not None
        dev, b, t = self.cache.data.device, len(chunks), len(chunks[0].tokens)
        # (2B, T)
        staged = to_device([list(c.tokens) for c in chunks] + [list(range(c.start, c.end)) for c in chunks], dev)
        # (B,) each
        slots, starts, last = to_device([[c.slot for c in chunks], [c.start for c in chunks], [t - 1] * b], dev)
        causal = torch.ones(t, t, dtype=torch.bool, device=dev).tril().expand(b, t, t)
        return self.compiled.forward(staged[:b], staged[b:], slots, starts, causal, [c.start for c in chunks],
                                     last[:, None])

    def step(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, cache_lens: torch.Tensor,
             mask: torch.Tensor, root_only: bool, host_lens: list[int],
             host_slots: list[int]) -> tuple[ForwardOutput, bool]:
        """A decode or tree-verify forward. tokens, positions (B, N); slots, cache_lens (B,); mask
        (B, N, N) the trees' masks (root_only: N = 1, plain decoding).

        Returns the output and whether the forward ran on the path its key is settled on (a forward
        exploring the other path says nothing about the step's usual cost)."""
        b, n = tokens.shape
        new_mask = None if root_only else mask
        if self.graphs is not None and self.graphs.bucket_for(b, n) is not None:
            return self.graphs.forward(tokens, positions, slots, cache_lens, new_mask, host_lens), True
        if self.compiled is not None and self.compiled.fits(b, n, max(host_lens)):
            key = (self.bucket(b), n)
            path = self.paths.choose(key)
            start = time.perf_counter()
            if path == "compiled":
                out = self.compiled.forward(tokens, positions, slots, cache_lens, mask, host_lens)
            else:
                out = self._eager(tokens, positions, slots, cache_lens, new_mask, host_lens, host_slots)
            self.paths.observe(key, path, time.perf_counter() - start)
            return out, self.paths.settled_on(key, path)
        return self._eager(tokens, positions, slots, cache_lens, new_mask, host_lens, host_slots), True

    def _eager(self, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, cache_lens: torch.Tensor,
               new_mask: torch.Tensor | None, host_lens: list[int], host_slots: list[int]) -> ForwardOutput:
        attn = self.model.attention_inputs(positions, slots, cache_lens, new_mask, self.cache, host_lens, host_slots)
        return self.model(tokens, attn, self.cache, aux_layers=self.aux_layers)

    # ---- the compiled program's paths -----------------------------------------------------------

    def few_rows(self, batch_size: int, share: float = 1.0) -> int | None:
        """Tokens per request a forward of `batch_size` requests may verify and stay within `share`
        of the compiled step program's rows (its few-row matmuls, whose cost grows with every row;
        more rows run the prefill program), at least 1; None without that program (on a GPU more
        rows cost little)."""
        if self.compiled is None or self.compiled.step_runner is None:
            return None
        return max(1, int(self.compiled.step_rows * share) // batch_size)

    @property
    def compiled_step_buckets(self) -> tuple[int, ...]:
        """The batch-size buckets whose decode steps run the compiled step program now."""
        if self.compiled is None:
            return ()
        return tuple(b for b in self.buckets if self.paths.best((b, 1)) == "compiled")

    @torch.inference_mode()
    def seed_paths(self, tree_sizes: Sequence[int], num_free: int, max_seq_len: int, repeats: int = 3) -> None:
        """Seed the path choice: each bucket's step at every tree size (1 = decode) timed through
        the compiled program and eagerly, interleaved, on free slots at a mid-length context; the
        median of `repeats` after two untimed calls, kept with their spread and whether the machine
        looked busy (`time_interleaved`). The K/V written land in free slots, which a prefill
        overwrites. Serving steps keep measuring both paths."""
        if self.compiled is None or self.paths.pinned:
            return
        context = min(256, max_seq_len // 2)
        paths = ("compiled",) if self.paths.compiled_only else self.paths.PATHS
        for b in self.buckets:
            if b > num_free:
                continue
            for t in sorted(set(tree_sizes)):
                forwards = {p: f for p, f in self._step_forwards(b, t, context).items() if p in paths}
                timings = time_interleaved(forwards, repeats, threads=torch.get_num_threads())
                for name, timing in timings.items():
                    self.paths.seed((b, t), name, timing)
                log.info("target step at batch %d, %d token(s): compiled %s, eager %s -> %s", b, t,
                         timings["compiled"], timings.get("eager"), self.paths.best((b, t)))

    def _step_forwards(self, b: int, t: int, context: int) -> dict[str, Callable[[], object]]:
        """A step of b requests with t-node chains at `context` cached tokens, through the compiled
        program and eagerly, on the first b slots."""
        assert self.compiled is not None
        dev = self.cache.data.device
        tokens = torch.zeros(b, t, dtype=torch.int64, device=dev)
        slots, host_lens = torch.arange(b, device=dev), [context] * b
        cache_lens = torch.full((b,), context, device=dev)
        positions = cache_lens[:, None] + torch.arange(t, device=dev)
        mask = torch.ones(t, t, dtype=torch.bool, device=dev).tril().expand(b, t, t)
        compiled = self.compiled
        return {
            "compiled": lambda: compiled.forward(tokens, positions, slots, cache_lens, mask, host_lens),
            "eager": lambda: self._eager(tokens, positions, slots, cache_lens, None if t == 1 else mask, host_lens,
                                         list(range(b))),
        }
