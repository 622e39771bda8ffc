"""Incremental, UTF-8 safe detokenization with stop strings.

Tokens go in one at a time (`tokenizers.decoders.DecodeStream` holds back partial multi-byte
characters); text comes out as deltas. While stop strings are set, the last `max(len(stop)) - 1`
characters are held back so a stop string split across tokens is never streamed.
"""

from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...] = ()) -> None:
        self._tokenizer = tokenizer
        self._stream = DecodeStream(skip_special_tokens=True)
        self._stop = stop
        self._holdback = max((len(s) for s in stop), default=1) - 1
        self.text = ""  # everything decoded so far (truncated at a stop string once one is hit)
        self._emitted = 0

    def add(self, token_id: int) -> bool:
        """Decode one token; True when a stop string appeared (text is then cut before it)."""
        piece = self._stream.step(self._tokenizer, token_id)
        if not piece:
            return False
        start = max(0, len(self.text) - self._holdback)
        self.text += piece
        for s in self._stop:
            at = self.text.find(s, start)
            if at >= 0:
                self.text = self.text[:at]
                return True
        return False

    def delta(self, final: bool) -> str:
        """Text not handed out yet (all of it when final, else minus the held-back tail)."""
        end = len(self.text) if final else max(self._emitted, len(self.text) - self._holdback)
        out = self.text[self._emitted : end]
        self._emitted = end
        return out
