"""The drafter interface the engine talks to.

A drafter proposes one `DraftTree` per running request before each verify forward, and is told
which nodes were accepted afterwards. It does not know about KV-cache slots, sampling or
tokenization; model-based drafters (EAGLE, MTP) read the target's hidden states from the
`ForwardOutput`s they are handed (asking for layers through `aux_layers`).

A drafter with per-slot state (a draft KV cache, stored target features) keeps it for a slot's
content after its request ends: `copy_prefix` hands a new request the state of a reused prefix
(prefix caching), and `on_prefill` sees a prompt chunk by chunk, after the reused positions.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from specserve.runtime.plan import RuntimePlan
from specserve.tree import DraftTree, TreeBatch

if TYPE_CHECKING:
    from specserve.config import SpecConfig
    from specserve.draft_plan import DraftPlan
    from specserve.models.llama import ForwardOutput, LlamaModel
    from specserve.runtime.cuda_graph import DraftGraphs
    from specserve.runtime.prefill import PackedPrompts
    from specserve.tree import DraftShape


@dataclass(frozen=True)
class DraftContext:
    """What a drafter is built from: the target and the engine's fixed sizes, not the engine.

    num_slots: drafter-cache slots, the static buckets' padding slot (the last) included when the
    runtime plan is static; max_len: cache entries per slot (max_seq_len plus the trees' scratch
    area); draft_plan: the shapes steps may draft (`draft_plan.DraftPlan`); runtime: how the
    drafter's forwards run (`runtime.plan.RuntimePlan`).
    """

    target: LlamaModel
    model_dir: str
    num_slots: int
    max_len: int
    max_seq_len: int
    dtype: torch.dtype
    device: str
    draft_plan: DraftPlan
    runtime: RuntimePlan = field(default_factory=lambda: RuntimePlan(torch.device("cpu")))


class SequenceView(Protocol):
    """What a drafter may read of a request."""

    @property
    def request_id(self) -> str: ...

    @property
    def token_ids(self) -> list[int]:
        """Prompt + generated tokens; the last one is the tree root (not yet in the KV cache)."""
        ...

    @property
    def slot(self) -> int:
        """The request's KV-cache slot (a drafter with its own cache may use the same index)."""
        ...

    @property
    def cache_len(self) -> int:
        """Tokens whose K/V are in the target's cache: all of token_ids but the root."""
        ...

    @property
    def cache_salt(self) -> str | None:
        """Its cache salt: a drafter that learns from requests keeps each salt's text apart."""
        ...


class Drafter:
    """Base class: the hooks default to doing nothing; `propose` must be written."""

    aux_layers: tuple[int, ...] = ()  # target layers whose inputs the drafter needs (EAGLE-3)
    # whether the tree for a smaller num_draft_tokens (same topk) is always a prefix of the tree for a
    # larger one, so one verify also tells the accept length every smaller shape would have had
    nested_trees: bool = False
    # whether `propose` runs a model over the tokens a request gained since its last draft (its
    # whole prompt at first), so a draft after plain steps costs more than one after a draft
    catches_up: bool = False
    # whether `on_prefill` only saves a later catch-up work (a standalone draft model's prompt K/V:
    # token ids are all it needs), so the engine skips it while the chooser decodes plainly; a head
    # needs the target's prompt features, which only the prefill forward has
    prefill_optional: bool = False
    # draft model forwards run so far (catch-ups and beam steps; none for NGRAM): `StepProfile`
    # divides the draft phase's time by the forwards each propose ran
    num_forwards: int = 0
    # host seconds spent inside those forwards and the draft model's output layer (its logits and
    # top-k): the rest of the draft phase is the beam's tensor ops and Python (on CUDA: launches only)
    forward_seconds: float = 0.0
    # the engine's expected seconds of verify steps: (batch size, n) -> seconds for trees of 1, 2, ..., n
    # nodes per request, None where it has no estimate; a drafter that knows how likely each node is
    # sizes its trees by it
    step_cost: Callable[[int, int], list[float | None]] | None = None
    # whether the last `propose` had drafts and cut them all as not paying at `step_cost`'s costs: the
    # step's shape was weighed and found wanting, not left unmeasured for lack of a draft
    declined: bool = False

    @classmethod
    def build(cls, spec: SpecConfig, ctx: DraftContext) -> Drafter:
        """The drafter for a resolved config (`drafters.factory` calls this)."""
        return cls(spec, ctx)

    @contextmanager
    def model_forward(self, count: bool = True) -> Iterator[None]:
        """Times a draft model forward (count=False: its output layer, which is no new forward)."""
        self.num_forwards += int(count)
        start = time.perf_counter()
        try:
            yield
        finally:
            self.forward_seconds += time.perf_counter() - start

    @property
    def graphs(self) -> DraftGraphs | None:
        """Its drafts captured as CUDA graphs (`runtime.cuda_graph.DraftGraphs`), None where none are."""
        return None

    def propose(self, seqs: Sequence[SequenceView], shape: DraftShape | None = None) -> list[DraftTree] | TreeBatch:
        """One tree per sequence, root = seq.token_ids[-1], of at most `shape.num_draft_tokens`
        nodes, `shape.num_steps` deep (default: the configured shape, `DraftPlan.shape`): host trees, or a batch of
        them built on the device (row i for seqs[i]). Steps without drafts do not call it; a
        drafter catches up here on what it has not seen."""
        raise NotImplementedError

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """A request admitted into slot `dst` reuses the first n tokens of slot `src`'s content
        (src == dst: in place; n = 0: nothing). Make dst's state for those tokens src's (copied
        when the slots differ) and forget dst's state beyond them. Rows of src below n never change
        while this runs, and the target's K/V are copied already."""

    def on_prefill(self, seqs: Sequence[SequenceView], out: ForwardOutput, packed: PackedPrompts) -> None:
        """After a prefill forward computed a chunk of each of these sequences' prompts.

        out: that forward's output, its columns packed (`runtime.prefill`): seqs[i]'s chunk is
        `packed.chunks[i]`, prompt positions [start, end), its columns `packed.columns(i)`;
        seqs[i].cache_len = end. A chunk that ends the prompt comes after the first token is
        appended (token_ids then holds it, the tree root); other chunks leave more prompt to come.
        """

    def on_accept(self, seqs: Sequence[SequenceView], out: ForwardOutput, accepted: Sequence[torch.Tensor]) -> None:
        """After verify, when seqs' token_ids already hold the new tokens (requests that finished
        this step included: their slot's content may be reused).

        out: the verify forward's output (rows in `seqs` order, columns = tree nodes).
        accepted: per sequence, the accepted node indices of its tree (root first).
        """

    def release(self, request_id: str) -> None:
        """Forget a finished or aborted request."""

    @property
    def cached_tokens(self) -> int:
        """Tokens of earlier requests it keeps to draft from (the suffix drafter's store; 0 for the others)."""
        return 0

    def mix(self) -> dict[str, int]:
        """Rows each of its drafters drafted so far (a hybrid's; {} for the others)."""
        return {}

    def forget(self) -> None:
        """Drop what earlier requests taught it (the suffix drafter's shared store; the others
        keep nothing across requests but a slot's state for prefix caching)."""

    def inherit(self, previous: Drafter) -> None:
        """Take over what `previous`, the drafter of the engine this one's replaces, learned across
        requests (the suffix drafter's shared store: one store for both while the old engine finishes
        its requests, reported by this drafter alone). The others keep nothing to take over."""


class NoDrafter(Drafter):
    """algorithm=none: every tree is the root alone, so verify is plain decoding."""

    @classmethod
    def build(cls, spec: SpecConfig, ctx: DraftContext) -> Drafter:
        return cls()

    def propose(self, seqs: Sequence[SequenceView], shape: DraftShape | None = None) -> list[DraftTree]:
        return [DraftTree.root_only(s.token_ids[-1]) for s in seqs]
