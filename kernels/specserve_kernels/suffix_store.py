"""Suffix decoding's token store and draft tree in C++ (`cpu/suffix_store.cpp`), for the host cost of a step.

`specserve.drafters.suffix` holds the reference in Python: `TokenStore` (token segments, a ring of them for
the shared store, a k-gram index per cache salt) and `draft_nodes` (the draft tree of the candidates'
continuations). The module `load` returns has the same two with the same results, tie-breaks included:

    TokenStore(capacity, k, ring)   append(tokens, salt=None), close(), match(context, max_len, salt=None),
                                    match_store(other, max_len, salt=None) (other's tokens as the context),
                                    continuations(positions, depth), tokens(), last(), capacity, num_tokens,
                                    high, low, index (as the Python store's), index_size()
    draft_nodes(root, rows, match_len, num_draft_tokens, min_token_prob, max_spec_factor)
                                    -> (tokens, parents, score), lists as the Python one's
    propose(own, shared, salt, max_depth, num_draft_tokens, min_token_prob, max_spec_factor)
                                    -> (links, mask, score): one request's step in one call, both stores
                                    matched against the own store's tokens (read in place, no copy through
                                    Python) and the better scored tree laid out as `DraftTree.from_parents`
                                    lays it out (links: tokens, parents, depth, first_child, next_sibling)

Tokens cross as Python lists (cheapest for the few tokens of a step) or integer arrays; positions and
rows as numpy arrays.

Salts are any hashable Python objects (None is one), compared as a dict compares them. It is built once
per source and torch version with torch's extension builder (`cpp_build`), as a plain Python module: no
torch op, nothing on CUDA, no threads and no GIL released. It does not decide when to draft or which tree
size to ask for (the drafter does); where it cannot be built `load` warns and returns None, and the drafter
keeps the Python store.
"""

from __future__ import annotations

import logging
from pathlib import Path
from types import ModuleType

from specserve_kernels import cpp_build

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu") / "suffix_store.cpp"
_module: ModuleType | None | bool = None  # False: tried, not available


def load(build_root: Path | None = None) -> ModuleType | None:
    """The built module (once per source and torch version under `build_root`), or None, with a
    warning, where it cannot be built. Only the first call of a process builds or loads anything."""
    global _module
    if _module is None:
        _module = _build(build_root or Path.home() / ".cache/specserve/kernels") or False
    return _module or None


def _build(build_root: Path) -> ModuleType | None:
    try:
        return cpp_build.build("specserve_suffix_store", SOURCE, build_root, extra_cflags=["-O3"])
    except Exception as e:  # noqa: BLE001 - the C++ toolchain: the drafter keeps its Python store
        log.warning("suffix decoding keeps its Python token store: native one not built (%s: %s)",
                    type(e).__name__, e)
        return None
