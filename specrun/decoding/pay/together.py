"""Whether requests decoding together draft with the draft model, measured in turns.

Beside other requests a request's draft passes are shared (decoding.batching: one draft pass
expands every drafting request's tree), but its tree's nodes still fill the one target pass, and
every request waits while the others draft. Whether that pays depends on how a pass's cost grows
with its tokens, which differs from machine to machine (rules.draft_together says what it was
on a CPU, and where the turns are taken). So the requests take turns: while N of them decode together, a turn of TOGETHER_WINDOW
committed tokens drafts with the model, the next leans on what costs no model pass (lookup, a
grammar's forced runs); then the mode with more tokens per second runs, the other again every
TOGETHER_RETRY turns (more where it measured far slower: rules.together_retry_every), cut short
where it runs at under TOGETHER_LOSING of the other's rate. Each count of requests has its own
measurements. Leaning is not measured where it cannot pay: its steps take at most what the
requests' steps took without the draft model (the root, lookup's and forced tokens), a pass no
shorter than their least, and where that is under TOGETHER_LOSING of drafting's rate measured
(a pass over a network, about the same for 4 tokens or 40), drafting keeps the turns
(rules.leaning_loses).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from specrun.decoding.adaptive import Average
from specrun.decoding.pay.rules import (TOGETHER_LOSING, TOGETHER_RETRY, TOGETHER_WINDOW, leaning_loses,
                                        together_retry_every)


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
        self._free: dict[int, Average] = {}  # requests -> tokens a step took without the draft model's
        self._least_s: dict[int, float] = {}  # requests -> their least pass together, seconds

    def drafts(self, requests: int) -> bool:
        """Whether a step of one of `requests` requests decoding together drafts with the model now."""
        with self._lock:
            turn = self._turn
            if turn is None or turn.requests != requests:  # (a request came or went: a new turn)
                turn = self._turn = _Turn(requests, self._choose(requests), self._clock())
            return turn.drafting

    def record(self, requests: int, drafting: bool, tokens: int, free: int | None = None, pass_s: float = 0.0) -> None:
        """A step of the turn (`requests`, `drafting`) committed `tokens`, of which `free` would
        have come without the draft model (the root, lookup's, forced; None: unknown), in a pass
        of `pass_s` seconds (0: untimed, or a one-off)."""
        with self._lock:
            if free is not None:
                self._free.setdefault(requests, Average(TOGETHER_WINDOW)).add(free)
            if pass_s > 0:
                self._least_s[requests] = min(pass_s, self._least_s.get(requests, pass_s))
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

    def leaning_at_most(self, requests: int) -> float | None:
        """Tokens per second `requests` leaning together could make at most: the tokens their
        steps took without the draft model, each a pass no shorter than their least (None
        before both are known)."""
        free, least_s = self._free.get(requests), self._least_s.get(requests)
        if free is None or least_s is None:
            return None
        return requests * float(free.mean) / least_s

    def _choose(self, requests: int) -> bool:
        drafting, leaning = self._rates.get((requests, True)), self._rates.get((requests, False))
        if drafting is None:
            return True
        if leaning is None:
            at_most = self.leaning_at_most(requests)
            return at_most is not None and leaning_loses(drafting, at_most)
        n = self._turns[requests] = self._turns.get(requests, 0) + 1
        best = drafting >= leaning
        every = together_retry_every(self.retry, max(drafting, leaning), min(drafting, leaning))
        return not best if n % every == 0 else best
