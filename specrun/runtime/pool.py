"""The decoders of a runtime that no request is using, and which one the next request takes.

Several requests decode at once (serve --parallel, generate --jsonl --parallel), each with a
decoder of its own: its lanes of the target's and the draft's context (decoding.batching) and
its own drafting.
Both front ends take and give back decoders here.
"""

from __future__ import annotations

import threading
from typing import Sequence


class DecoderPool:
    """Idle decoders, the least recently used first."""

    def __init__(self, decoders: Sequence):
        self._idle = list(decoders)
        self._cond = threading.Condition()

    def take(self, prompt: Sequence[int]):
        """Return the idle decoder whose cache holds most of the prompt, among equals the one used
        last, drafting with what served the last request (warm: its lookup index, its
        measurements, its draft cache); wait while every decoder is in use.

        Among equals the last used: one client's requests keep to one lane, as with one lane in
        all. Text that other lanes keep cached costs every pass attention over its cells (one
        unified KV cache): one client's requests spread over 4 lanes of the demo pair decoded
        20% slower (49-52 tokens/s against 62)."""
        with self._cond:
            self._cond.wait_for(lambda: self._idle)
            idle = self._idle
            best = max(range(len(idle)), key=lambda i: (shared_prefix(idle[i].cache.tokens, prompt), i))
            decoder, last = idle[best], idle[-1]
            if decoder is not last and hasattr(decoder, "swap_drafting"):
                decoder.swap_drafting(last)
            idle.pop(best)
        # Its lanes' caches are the request's to edit from here on: no shared pass runs meanwhile,
        # so a request takes its decoder when all else is ready (its grammar compiled).
        decoder.cache.lane.join()
        return decoder

    def give_back(self, decoder) -> None:
        """The request is over: its decoder is idle (the others' passes no longer wait for it)."""
        decoder.cache.lane.leave()
        with self._cond:
            self._idle.append(decoder)
            self._cond.notify()


class Lease:
    """The decoder one request holds: taken once its prompt is known, given back (once) when it
    ends."""

    def __init__(self, pool: DecoderPool):
        self.pool = pool
        self.decoder = None

    def take(self, prompt: Sequence[int]):
        self.decoder = self.pool.take(prompt)
        return self.decoder

    def give_back(self) -> None:
        if self.decoder is not None:
            self.pool.give_back(self.decoder)
            self.decoder = None


def shared_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Return how many tokens a and b share from their start."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
