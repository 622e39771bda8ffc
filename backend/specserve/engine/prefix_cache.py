"""Prefix reuse over the static slot cache: which slot an admitted prompt takes, and how many of its
tokens it finds computed already.

A request that ends leaves its prompt and answer in its slot (the tokens below its cache_len): the
slot goes back to the free list *with its content*, remembered here as the token ids whose K/V it
holds, until the slot is handed out again or evicted. `place` looks for the longest common prefix of
a new prompt among

  * the free slots' contents, and
  * the running requests' rows below their cache_len (rows a running request never rewrites),

and reuses it (at most all but the prompt's last token, which is computed for its logits):

  * a free slot whose whole content the prompt continues (a second turn: the first turn's prompt and
    answer, then new text) is taken as it is: nothing to copy;
  * otherwise the prompt gets the least recently used free slot (an empty one first) and the engine
    copies the matched rows into it from the source (`Placement.source`), so a free slot matched
    only in part keeps the rest of its content for a later request.

A prefix is shared only between requests of the same cache salt (vLLM's `cache_salt`; None is a
salt too): a client that sets its own never finds, nor shows in `num_cached_tokens`, what requests
of another salt computed.

The free slots' contents are bounded by `max_cached_tokens` (None: whatever they hold): the least
recently used are truncated from their end, then forgotten, until the total fits.

This module moves no K/V and knows no drafters: the engine copies what a `Placement` says.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from specserve.models.kv_cache import KVCache


@dataclass(frozen=True)
class Placement:
    """Where an admitted prompt goes: `slot`, whose first `reused` positions hold the K/V of the
    prompt's first `reused` tokens once the rows [0, reused) of `source` are copied there
    (source == slot: they are in place; reused 0: nothing is reused)."""

    slot: int
    source: int
    reused: int


@dataclass(frozen=True)
class RunningRows:
    """A running request as a source of prefixes: its slot, its token ids, how many of them have
    their K/V in the slot (rows that never change while it runs) and its cache salt."""

    slot: int
    token_ids: Sequence[int]
    cache_len: int
    salt: str | None = None


@dataclass
class PromptCounters:
    """Cumulative prompt work: `reused` tokens found cached, `computed` positions the target ran
    (every prefill chunk's tokens, no padding)."""

    reused: int = 0
    computed: int = 0


def common_prefix(a: Sequence[int], b: Sequence[int], limit: int | None = None) -> int:
    """The length of the longest common prefix of a and b, at most `limit`: one C-level slice
    compare when all of it matches, a binary search over slice compares otherwise."""
    n = min(len(a), len(b), len(a) if limit is None else limit)
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class PrefixCache:
    """The free slots' contents and their recency; allocation goes through it (module docstring).

    enabled False: every prompt gets the lowest free slot and reuses nothing (`allocate` as before)."""

    def __init__(self, cache: KVCache, enabled: bool = True, max_cached_tokens: int | None = None) -> None:
        self.cache, self.enabled, self.max_cached_tokens = cache, enabled, max_cached_tokens
        self.contents: dict[int, list[int]] = {}  # free slot -> the token ids whose K/V it holds
        self.salts: dict[int, str | None] = {}  # free slot with content -> the salt of the request that left it
        self.last_used: dict[int, int] = {}  # slot -> tick of its last release or use as a source
        self.cached_tokens = 0  # sum of the contents' lengths: read by other threads as one int
        self._ticks = itertools.count()

    def place(self, prompt: Sequence[int], running: Sequence[RunningRows] = (), salt: str | None = None) -> Placement:
        """The slot for `prompt` (one of the cache's free slots, now allocated) and what it reuses of
        the contents and running rows left by requests of the same `salt`."""
        if not self.enabled:
            slot = self.cache.allocate()
            return Placement(slot, slot, 0)
        limit = len(prompt) - 1  # the last prompt token is always computed: its logits give the first token
        # (tokens reused, whether it is a free slot whose whole content the prompt continues, slot)
        candidates = [(min(n, limit), n == len(tokens), slot)
                      for slot, tokens in self.contents.items() if self.salts.get(slot) == salt
                      for n in [common_prefix(prompt, tokens)]]
        candidates += [(min(n, limit), False, r.slot)
                       for r in running if r.salt == salt for n in [common_prefix(prompt, r.token_ids, r.cache_len)]]
        reused, whole, source = max(candidates, default=(0, False, -1), key=lambda c: c[:2])
        if reused == 0:
            slot = self._take(self._least_recent())
            return Placement(slot, slot, 0)
        if source in self.contents and (whole or source == self._least_recent()):
            return Placement(self._take(source), source, reused)
        self.last_used[source] = next(self._ticks)
        return Placement(self._take(self._least_recent()), source, reused)

    def release(self, slot: int, token_ids: Sequence[int], salt: str | None = None) -> None:
        """A request of cache salt `salt` left `slot` holding the K/V of `token_ids`: keep them for
        reuse by requests of that salt (then evict what exceeds the bound), and hand the slot back
        to the cache's free list."""
        self.cache.free(slot)
        if self.enabled and token_ids:
            self.contents[slot] = list(token_ids)
            self.salts[slot] = salt
            self.cached_tokens += len(token_ids)
            self.last_used[slot] = next(self._ticks)
            self._evict()

    def forget(self) -> None:
        """Drop every free slot's content (after a warm-up, or when their K/V are no longer trusted)."""
        self.contents.clear()
        self.salts.clear()
        self.cached_tokens = 0

    def _least_recent(self) -> int:
        """The free slot to hand out on a miss: the lowest empty one, else the least recently used."""
        free = self.cache.free_slots
        empty = [s for s in free if s not in self.contents]
        return empty[0] if empty else min(free, key=lambda s: self.last_used.get(s, -1))

    def _take(self, slot: int) -> int:
        self.cached_tokens -= len(self.contents.pop(slot, ()))
        self.salts.pop(slot, None)
        return self.cache.allocate(slot)

    def _evict(self) -> None:
        """Truncate, then forget, the least recently used contents until they fit the bound."""
        bound = self.max_cached_tokens
        while bound is not None and self.cached_tokens > bound:
            slot = min(self.contents, key=lambda s: self.last_used[s])
            keep = max(len(self.contents[slot]) - (self.cached_tokens - bound), 0)
            self.cached_tokens -= len(self.contents[slot]) - keep
            if keep:
                self.contents[slot] = self.contents[slot][:keep]
            else:
                del self.contents[slot]
                del self.salts[slot]
