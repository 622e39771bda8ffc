"""Kernel tests run the Triton kernels on CUDA when there is a GPU, else under the Triton
interpreter on CPU tensors.

TRITON_INTERPRET is read when `@triton.jit` decorates a kernel, i.e. when a specserve_kernels
module is first imported, so it is set here, before any test module imports them.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import importlib  # noqa: E402

import pytest  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from specserve.tree import DraftTree  # noqa: E402


@pytest.fixture
def kernel_device(monkeypatch: pytest.MonkeyPatch) -> torch.device:
    """Where to put a launcher's inputs so that it runs the Triton kernel, not the reference."""
    if torch.cuda.is_available():
        return torch.device("cuda")
    kernel = importlib.import_module("specserve_kernels.tree_build")._build_tree_kernel
    if not isinstance(kernel, InterpretedFunction):
        pytest.fail(
            "specserve_kernels was imported before TRITON_INTERPRET=1 was set; set it in the environment"
        )
    monkeypatch.setenv("SPECSERVE_FORCE_TRITON", "1")
    return torch.device("cpu")


def _eagle_tree(
    gen: torch.Generator, topk: int, depth: int, num_draft_tokens: int, vocab_size: int
) -> DraftTree:
    """A random tree shaped like EAGLE-2's: grow `depth` levels, each expanding the `topk` best
    nodes of the level before by `topk` children, then keep the `num_draft_tokens` best nodes.

    A node's score is its parent's minus a random positive amount (a cumulative log-prob), so a
    kept node's parent is always kept too. Siblings get distinct tokens.
    """
    tokens = [int(torch.randint(vocab_size, (1,), generator=gen))]
    parents, score = [-1], [0.0]
    frontier = [0]
    for _ in range(depth):
        level = []
        for p in frontier:
            for t in torch.randperm(vocab_size, generator=gen)[:topk].tolist():
                tokens.append(t)
                parents.append(p)
                score.append(score[p] - 0.1 - float(torch.rand(1, generator=gen)))
                level.append(len(tokens) - 1)
        frontier = sorted(level, key=lambda i: -score[i])[:topk]
    kept = sorted(sorted(range(1, len(tokens)), key=lambda i: -score[i])[:num_draft_tokens])
    new_index = {old: new for new, old in enumerate([0, *kept])}
    return DraftTree.from_parents(
        [tokens[0]] + [tokens[i] for i in kept], [-1] + [new_index[parents[i]] for i in kept]
    )


@pytest.fixture
def eagle_tree():
    """`eagle_tree(gen, topk, depth, num_draft_tokens, vocab_size) -> DraftTree` (see `_eagle_tree`)."""
    return _eagle_tree
