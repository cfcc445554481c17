"""Whether requests decoding together draft with the draft model, measured in turns.

Beside other requests a request's draft passes are shared (decoding.batching: one draft pass
expands every drafting request's tree), but its tree's nodes still fill the one target pass, and
every request waits while the others draft. Whether that pays depends on how a pass's cost grows
with its tokens, which differs from machine to machine (rules.draft_together says what it was
on a CPU, and where the turns are taken). So the requests take turns: while N of them decode together, a turn of TOGETHER_WINDOW
committed tokens drafts with the model, the next leans on what costs no model pass (lookup, a
grammar's forced runs); then the mode with more tokens per second runs, the other again every
TOGETHER_RETRY turns, cut short where it runs at under TOGETHER_LOSING of the other's rate. Each
count of requests has its own measurements.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from specrun.decoding.pay.rules import TOGETHER_LOSING, TOGETHER_RETRY, TOGETHER_WINDOW


@dataclass
class _Turn:
    requests: int
    drafting: bool
    start: float
    tokens: int = 0


class Together:
    """The turns of the requests decoding together (one object for all their decoders; threadsafe)."""

    def __init__(self, window: int = TOGETHER_WINDOW, retry: int = TOGETHER_RETRY, clock=time.perf_counter):
        self.window = window
        self.retry = retry
        self._clock = clock
        self._lock = threading.Lock()
        self._turn: _Turn | None = None
        self._rates: dict[tuple[int, bool], float] = {}  # (requests, drafting) -> tokens/s
        self._turns: dict[int, int] = {}  # requests -> turns chosen

    def drafts(self, requests: int) -> bool:
        """Whether a step of one of `requests` requests decoding together drafts with the model now."""
        with self._lock:
            turn = self._turn
            if turn is None or turn.requests != requests:  # (a request came or went: a new turn)
                turn = self._turn = _Turn(requests, self._choose(requests), self._clock())
            return turn.drafting

    def record(self, requests: int, drafting: bool, tokens: int) -> None:
        """A step of the turn (`requests`, `drafting`) committed `tokens`."""
        with self._lock:
            turn = self._turn
            if turn is None or (turn.requests, turn.drafting) != (requests, drafting):
                return
            turn.tokens += tokens
            rate = turn.tokens / max(1e-9, self._clock() - turn.start)
            other = self._rates.get((requests, not drafting))
            losing = other is not None and 4 * turn.tokens >= self.window and rate < TOGETHER_LOSING * other
            if turn.tokens < self.window and not losing:
                return
            key = (requests, drafting)
            known = self._rates.get(key)
            self._rates[key] = rate if known is None else (known + rate) / 2
            self._turn = None

    def restart(self, requests: int, drafting: bool) -> None:
        """The turn (`requests`, `drafting`) is measured from now: a step of it paid a one-off (a
        count of tokens new to the process over RPC workers, pay.counts; the draft brought up to a
        request's prompt), which no later step of either mode pays again."""
        with self._lock:
            turn = self._turn
            if turn is not None and (turn.requests, turn.drafting) == (requests, drafting):
                turn.start, turn.tokens = self._clock(), 0

    def rate(self, requests: int, drafting: bool) -> float | None:
        """Tokens per second measured in the mode's turns (None before one ended)."""
        return self._rates.get((requests, drafting))

    def _choose(self, requests: int) -> bool:
        drafting, leaning = self._rates.get((requests, True)), self._rates.get((requests, False))
        if drafting is None:
            return True
        if leaning is None:
            return False
        n = self._turns[requests] = self._turns.get(requests, 0) + 1
        best = drafting >= leaning
        return not best if n % self.retry == 0 else best
