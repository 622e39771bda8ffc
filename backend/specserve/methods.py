"""The drafting methods: one name each, everywhere, and what each one is.

A method's name is SGLang's `--speculative-algorithm` in lower case (`none` for plain decoding):
the engine's `algorithm`, `specserve bench --algorithm`, the bench JSON's `runs.<name>` and the
served models `llm_<name>` / `ensemble_<name>` all use it. Names used before (`base`, `eagle2`)
are accepted as aliases wherever a method is named.

Per method, decided here once: which drafter class runs it (`drafter`, built by
`drafters.factory`), which target features a draft head reads, whether it ships a hot-vocabulary
token map, and its default tree shape. This module imports nothing heavy (no torch): the CLI and
the model repository read it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

Shape = tuple[int, int, int]  # (num_steps, topk, num_draft_tokens); 0 = unset


def root_only(steps: int, topk: int, tokens: int) -> Shape:
    """Plain decoding: every tree is the root alone."""
    return 0, 1, 1


def sglang_tree(steps: int, topk: int, tokens: int) -> Shape:
    """SGLang's defaults for Llama: 5 steps, top-4, 8 tokens; top-1 is a chain of steps + 1."""
    steps, topk = steps or 5, topk or 4
    return steps, topk, steps + 1 if topk == 1 else tokens or 8


def ngram_chain(steps: int, topk: int, tokens: int) -> Shape:
    """SGLang's NGRAM: 12 draft tokens, as deep as the tokens allow."""
    tokens = tokens or 12
    return steps or tokens - 1, topk or 1, tokens


def one_mtp_step(steps: int, topk: int, tokens: int) -> Shape:
    """One MTP step, as DeepSeek-V3 is usually served, with its two likeliest tokens (adaptive
    speculation then chooses per step between none, the top token and both); SGLang's tree
    defaults once any of the three is set."""
    return (1, 2, 3) if not (steps or topk or tokens) else sglang_tree(steps, topk, tokens)


@dataclass(frozen=True)
class Method:
    name: str
    title: str  # for people: the paper's name
    description: str  # one line: what drafts
    drafter: str  # which drafter class runs it: "none", "ngram", "head" (EagleDrafter), "model" (StandaloneDrafter)
    shape: Callable[[int, int, int], Shape]  # the tree shape from the configured (possibly unset) one
    head_features: str = ""  # draft heads: the target features a position reads, "hidden" or "aux_hidden"
    token_map: bool = False  # draft heads: a hot-vocabulary token map ships with the head
    head_in_target: bool = False  # draft heads: may ship inside the target's checkpoint (DeepSeek's MTP layers)
    aliases: tuple[str, ...] = ()

    @property
    def drafts(self) -> bool:
        return self.drafter != "none"

    @property
    def is_head(self) -> bool:
        return self.drafter == "head"

    @property
    def fuses_layers(self) -> bool:
        """Its head reads several target layers' inputs (EAGLE-3), not the final hidden state."""
        return self.head_features == "aux_hidden"


METHODS: dict[str, Method] = {m.name: m for m in (
    Method("none", "plain decoding", "plain decoding, the baseline", "none", root_only, aliases=("base",)),
    Method("ngram", "NGRAM", "n-gram drafts from the request's own tokens", "ngram", ngram_chain),
    Method("eagle", "EAGLE-2", "EAGLE-2 (EAGLE-1/2 heads) with an FR-Spec token map", "head", sglang_tree,
           head_features="hidden", token_map=True, aliases=("eagle2",)),
    Method("eagle3", "EAGLE-3", "EAGLE-3", "head", sglang_tree, head_features="aux_hidden"),
    Method("mtp", "MTP", "a DeepSeek-layout MTP head with its hot-vocabulary token map", "head", one_mtp_step,
           head_features="hidden", token_map=True, head_in_target=True),
    Method("standalone", "standalone draft model", "a small draft model at drafter_path, else the target's first layers", "model",
           sglang_tree),
)}
ALGORITHMS = tuple(METHODS)
HEAD_METHODS = tuple(m.name for m in METHODS.values() if m.is_head)
ALIASES = {alias: m.name for m in METHODS.values() for alias in m.aliases}


def canonical(name: str) -> str:
    """A method's name for any name it goes by; a ValueError names the accepted ones."""
    name = ALIASES.get(name, name)
    if name not in METHODS:
        raise ValueError(f"algorithm: must be one of {', '.join(ALGORITHMS)}, got {name!r}")
    return name


def method(name: str) -> Method:
    return METHODS[canonical(name)]
