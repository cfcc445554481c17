"""The speed guard: speculation that measures slower than plain decoding shrinks, down to plain.

When measured seconds per emitted token stay above plain decoding's, the guard halves the budget,
down to plain decoding, and tries a larger one again now and then. Pure: the decoder reports each
step and asks it for the cap (pay.steps). Its figures are pay.rules' GUARD_ ones.
"""

from __future__ import annotations

from specrun.decoding.adaptive import Average
from specrun.decoding.pay.rules import (
    GUARD_MARGIN,
    GUARD_PROBE_EVERY,
    GUARD_RECOVER,
    GUARD_RETRY_AFTER,
    GUARD_WINDOW,
)


class SpeedGuard:
    """Shrinks the tree (down to plain decoding) while speculation is measured slower than plain.

    Every `window` speculative steps it compares their seconds per emitted token with a plain
    step's, measured by an occasional plain step the decoder makes when `wants_plain_step` says
    so (a tuning profile's figure stands in until the first one: a profile made on a busier or a
    quieter machine must not decide for long). Slower by more than `margin`: the cap becomes half
    the largest tree those steps verified (0 = plain decoding): halving a cap far above the trees
    that run would change nothing (the hybrid's budget counts its lookup branches, 5 + 64, while
    on free text its draft chain of 5 is what runs: four cuts, 64 steps, before it shrank). After
    `retry_after` steps at a lower cap it tries twice the cap again, and every new request
    (`new_request`) starts from GUARD_RECOVER times the cap: whatever one request taught (a busy
    moment, text that did not repeat) is forgotten within a few requests.
    """

    def __init__(self, budget: int, plain_s: float | None = None, window: int = GUARD_WINDOW, margin: float = GUARD_MARGIN,
                 retry_after: int = GUARD_RETRY_AFTER, probe_every: int = GUARD_PROBE_EVERY):
        self.budget = budget
        self.cap = budget
        self.window = window
        self.margin = margin
        self.retry_after = retry_after
        self.probe_every = probe_every
        self._profiled_plain_s = plain_s
        self._plain = Average(8)
        self._spec_s = 0.0
        self._spec_tokens = 0
        self._spec_steps = 0
        self._spec_nodes = 0  # the largest tree verified in the window
        self._since_plain = 0
        self._whole = False  # the last step's tree cost no draft pass and was accepted whole
        self._since_shrink = 0
        self.events: list[str] = []  # what the guard did, for --verbose (the caller says it once)
        self.said = 0  # events the caller has said

    def copy(self) -> SpeedGuard:
        """A guard with the same settings and nothing measured (for another kind of request)."""
        return SpeedGuard(self.budget, self._profiled_plain_s, self.window, self.margin, self.retry_after, self.probe_every)

    def new_request(self) -> None:
        """A request begins: a cut cap grows back GUARD_RECOVER-fold (from plain decoding: to
        GUARD_RECOVER nodes), and the window restarts (the last request's steps judge nothing here)."""
        if self.cap < self.budget:
            self.cap = min(self.budget, max(1, self.cap) * GUARD_RECOVER)
            self._since_shrink = 0
        self._spec_s, self._spec_tokens, self._spec_steps, self._spec_nodes = 0.0, 0, 0, 0

    def plain_s(self) -> float | None:
        if self._plain.known:
            return float(self._plain.mean)
        return self._profiled_plain_s

    def wants_plain_step(self) -> bool:
        """Whether the next step should decode plainly, to measure plain decoding on this machine.

        Due every probe_every speculative steps (never measured here: soon, after the first
        judgement when a profile gave a figure), it waits while the last tree was one that cost
        no draft pass accepted whole, up to as long again: a copy or a repeat under way is where
        a plain step loses the most (a regenerated answer's first step, 26 tokens a pass after
        it, was that plain step). A draft model's chain accepted whole may still cost more than
        plain steps (the demo draft's on this CPU): it does not put the measurement off."""
        if self.cap == 0:
            return True
        if self._plain.known:
            due = self.probe_every
        else:
            due = self.window if self._profiled_plain_s is not None else self.window // 2
        return self._since_plain >= (2 * due if self._whole else due)

    def record(self, n_tokens: int, seconds: float, tree_nodes: int, whole: bool = False) -> None:
        """Take one step's emitted tokens, seconds and verified tree size (`whole`: a tree that
        cost no draft pass, accepted to its deepest node)."""
        self._whole = tree_nodes > 0 and whole
        self._since_shrink += 1
        if tree_nodes == 0:
            self._plain.add(seconds / max(n_tokens, 1))
            self._since_plain = 0
        else:
            self._since_plain += 1
            self._spec_s += seconds
            self._spec_tokens += n_tokens
            self._spec_steps += 1
            self._spec_nodes = max(self._spec_nodes, tree_nodes)
        if self.cap < self.budget and self._since_shrink >= self.retry_after:
            self.cap = max(1, 2 * self.cap)
            self._since_shrink = 0
            self.events.append(f"trying a tree of up to {self.cap} nodes again")
        if self._spec_steps >= self.window:
            self._judge()

    def _judge(self) -> None:
        per_token = self._spec_s / max(self._spec_tokens, 1)
        largest = self._spec_nodes
        self._spec_s, self._spec_tokens, self._spec_steps, self._spec_nodes = 0.0, 0, 0, 0
        plain = self.plain_s()
        if plain is None or per_token <= plain * (1 + self.margin):
            return
        self.cap = min(self.cap, largest) // 2
        self._since_shrink = 0
        what = f"a tree of at most {self.cap} nodes" if self.cap else "plain decoding"
        self.events.append(
            f"speculation ran at {1e3 * per_token:.1f} ms per token, plain decoding at {1e3 * plain:.1f}: switching to {what}"
        )
