"""What the generated text does to the next token's logits: bias, penalties and a grammar.

Penalties and grammars depend on the text generated so far. Under tree speculation that text is
different at every node, so the acceptance walk (verify.py) and plain decoding both transform
each logit row with `PathRules.shape` and tell the rules every token they emit (`accept`): the
walk only ever visits nodes on the path the target itself draws, so at each visited node the
rules have seen exactly the committed text plus that node's own path, as plain decoding would.

The order is llama.cpp's: logit_bias, then the penalties (repeat_penalty on the last
repeat_last_n generated tokens, then frequency and presence on the whole generated text, as the
OpenAI API defines them), then the grammar's mask; top-k, top-p, min-p and temperature come
after, in sampling.target_probs. The prompt is never penalised.
"""

from __future__ import annotations

from collections import Counter, deque
from typing import Protocol

import numpy as np

from specrun.core.sampling import SamplingParams

# The largest float32: a penalised logit is held within it, so that an extreme repeat_penalty
# (1e-300 divides a logit by almost nothing) leaves a row with a finite maximum.
_LOGIT_LIMIT = float(np.finfo(np.float32).max)


class GrammarMatcher(Protocol):
    """One grammar's state along one path (engine.grammar implements it with llguidance)."""

    def mask(self, row: np.ndarray) -> None:
        """Set the logits of every token the grammar forbids now to -inf, in place."""

    def consume(self, token: int) -> None:
        """Advance by one emitted token (one the mask allowed)."""

    def forced(self) -> list[int]:
        """Return the tokens the grammar allows as the only continuation from here (may be empty)."""


class PathRules:
    """The logit transforms of one generation, following the text it emits."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.counts: Counter[int] = Counter()
        self.recent: deque[int] = deque(maxlen=params.repeat_last_n)
        self.matcher: GrammarMatcher | None = params.grammar.matcher() if params.grammar is not None else None
        bias = dict(params.logit_bias)
        self._bias_ids = np.fromiter(bias.keys(), np.int64, len(bias))
        self._bias = np.fromiter(bias.values(), np.float32, len(bias))

    @classmethod
    def of(cls, params: SamplingParams) -> PathRules | None:
        """Return the rules for a generation with `params`, or None when none apply."""
        return cls(params) if params.shapes_logits else None

    def shape(self, row: np.ndarray) -> np.ndarray:
        """Return a transformed copy of one logit row (the input is left as it is)."""
        p = self.params
        out = np.array(row, dtype=np.float32)
        if len(self._bias_ids):
            ok = self._bias_ids < len(out)
            out[self._bias_ids[ok]] += self._bias[ok]
        if p.repeat_penalty != 1 and self.recent:
            ids = np.unique(np.fromiter(self.recent, np.int64, len(self.recent)))
            values = out[ids].astype(np.float64)
            penalised = np.where(values > 0, values / p.repeat_penalty, values * p.repeat_penalty)
            out[ids] = np.clip(penalised, -_LOGIT_LIMIT, _LOGIT_LIMIT)
        if (p.presence_penalty or p.frequency_penalty) and self.counts:
            ids = np.fromiter(self.counts.keys(), np.int64, len(self.counts))
            n = np.fromiter(self.counts.values(), np.float32, len(self.counts))
            out[ids] -= n * np.float32(p.frequency_penalty) + np.float32(p.presence_penalty)
        if self.matcher is not None:
            self.matcher.mask(out)
        return out

    def accept(self, token: int) -> None:
        """Take note of one emitted token."""
        self.counts[token] += 1
        if self.recent.maxlen:
            self.recent.append(token)
        if self.matcher is not None:
            self.matcher.consume(token)

    def forced(self, limit: int) -> list[int]:
        """Return up to `limit` tokens the grammar forces next (free drafts: no model proposed them)."""
        if self.matcher is None or limit < 1:
            return []
        return self.matcher.forced()[:limit]
