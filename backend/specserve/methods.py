"""The drafting methods: one name each, everywhere, and what each one is.

A method's name is SGLang's `--speculative-algorithm` in lower case (`none` for plain decoding):
the engine's `algorithm`, `specserve bench --algorithm`, the bench JSON's `runs.<name>` and the
served models `llm_<name>` / `ensemble_<name>` all use it. Names used before (`base`, `eagle2`)
are accepted as aliases wherever a method is named.

Per method, decided here once: which drafter class runs it (`drafter`, built by
`drafters.factory`), which target features a draft head reads, whether it ships a hot-vocabulary
token map, its default tree shape, how its head is trained (`Recipe`) and which committed drafter
the served variant uses. This module imports nothing heavy (no torch): the CLI and
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


def suffix_tree(steps: int, topk: int, tokens: int) -> Shape:
    """Suffix decoding: up to 24 draft tokens (Arctic Inference's tree depth), as deep as they go."""
    tokens = tokens or 24
    return steps or tokens - 1, topk or 1, tokens


def hybrid_tree(steps: int, topk: int, tokens: int) -> Shape:
    """A head's SGLang tree (5 steps, top-4) with room for suffix decoding's deeper drafts: 16 tokens."""
    return sglang_tree(steps, topk, tokens or 16)


def one_mtp_step(steps: int, topk: int, tokens: int) -> Shape:
    """One MTP step, as DeepSeek-V3 is usually served, with its two likeliest tokens (adaptive
    speculation then chooses per step between none, the top token and both); SGLang's tree
    defaults once any of the three is set."""
    return (1, 2, 3) if not (steps or topk or tokens) else sglang_tree(steps, topk, tokens)


@dataclass(frozen=True)
class Recipe:
    """How a drafting method's head is trained (`train-drafter`, `train-drafters`)."""

    name: str  # as the model card says it
    steps: int  # unrolled draft steps when `train-drafters` trains the heads together
    alone_steps: int  # unrolled draft steps when `train-drafter` trains this head alone (no --ttt-steps)
    feature_noise: float = 0.0  # width of the uniform noise on the features it reads (EAGLE: 0.2)
    feature_regression: bool = False  # EAGLE's smooth-L1 of step 0's output to the next feature, token loss x 0.1


DRAFTERS = "specserve.drafters"


@dataclass(frozen=True)
class Method:
    """Everything that differs from one drafting method to the next. Adding a method: a row in
    `METHODS` and, for a new kind of drafter, its class (`drafter`); a new head format also goes
    into `models.draft_heads.HEADS` under the method's name."""

    name: str
    title: str  # for people: the paper's name
    description: str  # one line: what drafts
    drafter: str  # the class that runs it, "module:Class" (`drafters.factory` imports it when first built)
    shape: Callable[[int, int, int], Shape]  # the tree shape from the configured (possibly unset) one
    head_features: str = ""  # draft heads: the target features a position reads, "hidden" or "aux_hidden"
    token_map: bool = False  # draft heads: a hot-vocabulary token map ships with the head
    head_in_target: bool = False  # draft heads: may ship inside the target's checkpoint (DeepSeek's MTP layers)
    draft_model: bool = False  # drafts with a small LM of its own (its KV cache is that model's layers)
    recipe: Recipe | None = None  # draft heads: how they are trained
    served: tuple[tuple[str, str], ...] = ()  # llm_<name>'s drafter parameters, paths relative to the project
    hf_lookup_baseline: bool = False  # HF's prompt-lookup decoding is its like-for-like baseline (`bench`)
    combines: tuple[str, ...] = ()  # a hybrid: the methods whose drafters it runs side by side, the head's first
    aliases: tuple[str, ...] = ()

    @property
    def drafts(self) -> bool:
        return self.shape is not root_only

    @property
    def is_head(self) -> bool:
        return bool(self.head_features)

    @property
    def runs_head(self) -> bool:
        """A draft head runs in its engine: its own, or that of a method it combines."""
        return self.is_head or any(METHODS[name].is_head for name in self.combines)

    @property
    def fuses_layers(self) -> bool:
        """Its head reads several target layers' inputs (EAGLE-3), not the final hidden state."""
        return self.head_features == "aux_hidden"


def _served(name: str, token_map: bool = False) -> tuple[tuple[str, str], ...]:
    """The committed drafter of llm_<name> (and its token map)."""
    folder = f"model_repository/llm_{name}/drafter"
    return (("drafter_path", folder),) + ((("token_map", f"{folder}/token_map.pt"),) if token_map else ())


METHODS: dict[str, Method] = {m.name: m for m in (
    Method("none", "plain decoding", "plain decoding, the baseline", f"{DRAFTERS}.base:NoDrafter", root_only,
           aliases=("base",)),
    Method("ngram", "NGRAM", "n-gram drafts from the request's own tokens", f"{DRAFTERS}.ngram:NgramDrafter",
           ngram_chain, hf_lookup_baseline=True),
    Method("eagle", "EAGLE-2", "EAGLE-2 (EAGLE-1/2 heads) with an FR-Spec token map", f"{DRAFTERS}.head:HeadDrafter",
           sglang_tree, head_features="hidden", token_map=True, served=_served("eagle", token_map=True),
           recipe=Recipe("EAGLE-2", steps=3, alone_steps=1, feature_noise=0.2, feature_regression=True),
           aliases=("eagle2",)),
    Method("eagle3", "EAGLE-3", "EAGLE-3", f"{DRAFTERS}.head:HeadDrafter", sglang_tree, head_features="aux_hidden",
           served=_served("eagle3"), recipe=Recipe("EAGLE-3", steps=5, alone_steps=5)),
    Method("mtp", "MTP", "a DeepSeek-layout MTP head with its hot-vocabulary token map", f"{DRAFTERS}.head:HeadDrafter",
           one_mtp_step, head_features="hidden", token_map=True, head_in_target=True,
           served=_served("mtp", token_map=True),
           recipe=Recipe("MTP (DeepSeek-V3 NextN layout)", steps=3, alone_steps=3)),
    Method("standalone", "standalone draft model",
           "a small draft model at drafter_path, else the target's first layers",
           f"{DRAFTERS}.standalone:StandaloneDrafter", sglang_tree, draft_model=True),
    Method("suffix", "suffix decoding", "what followed the same tokens in earlier requests and in its own",
           f"{DRAFTERS}.suffix:SuffixDrafter", suffix_tree),
    Method("hybrid", "EAGLE-3 + suffix decoding", "per request and step, EAGLE-3's tree or suffix decoding's, "
           "by expected tokens per measured step cost", f"{DRAFTERS}.hybrid:HybridDrafter", hybrid_tree,
           served=_served("eagle3"), combines=("eagle3", "suffix")),
)}
ALGORITHMS = tuple(METHODS)
HEAD_METHODS = tuple(m.name for m in METHODS.values() if m.is_head)
RECIPES = {m.name: m.recipe for m in METHODS.values() if m.recipe is not None}
TRAINED_TOGETHER = ("eagle3", "eagle", "mtp")  # what `train-drafters` trains by default, in this order
ALIASES = {alias: m.name for m in METHODS.values() for alias in m.aliases}


def renamed(name: str) -> str:
    """The method's name for a name it went by earlier (`base` -> `none`); any other name as it is.
    Every place that takes a method's name resolves it here (or through `canonical`)."""
    return ALIASES.get(name, name)


def canonical(name: str) -> str:
    """A method's name for any name it goes by; a ValueError names the accepted ones."""
    name = renamed(name)
    if name not in METHODS:
        raise ValueError(f"algorithm: must be one of {', '.join(ALGORITHMS)}, got {name!r}")
    return name


def method(name: str) -> Method:
    return METHODS[canonical(name)]
