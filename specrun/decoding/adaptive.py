"""How much one speculative step should verify, from what this run has measured.

Two pieces, both pure:

- `Hindsight`: for every budget of a grid, how many tokens a tree cut to that budget would have
  had accepted, learned by matching each step's full proposal against the tokens the target went
  on to emit. At any temperature every emitted token is the target's own draw, the same whatever
  tree was verified (verify.py), so the walk down any tree would have met exactly those tokens:
  one proposal per step measures every smaller budget at once.
- `TargetCost`: seconds of one target pass over n tokens here: the tuning profile's curve scaled
  to this run's measurements, or a line fitted online.

(How often the target takes a draft model's proposal, by the draft's own probability, which
best-first trees score their nodes by, is decoding.calibration's.)

What pays, and so how large a tree a step verifies, is decided by decoding.pay from these figures.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from specrun.core.tree import DraftTree

# Budgets compared each step: dense where trees are cheap, sparse where a pass gets dear.
BUDGETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048)
# Recent steps count most (half weight after this many): a session alternates long copies and
# free-form text, and the choice should follow within a few dozen tokens.
HALF_LIFE = 24
# Per kind of lookup proposal (HindsightByKind) a kind's steps are fewer and what they mean
# changes with the text (a copy, then free text): its memory is shorter.
KIND_HALF_LIFE = 8
# Before this run has measured a multi-token pass: each extra verified token costs this fraction
# of a one-token pass (the CPU demo pair measures 0.06-0.11; a GPU far less).
PRIOR_TOKEN_COST = 0.1
# Multi-token passes a run measures before their figure alone may price every tree out
# (TargetCost.settled). One pass is one sample: the first a fresh process ran at a busy moment
# (a 2-node lookup tree, on a loaded machine) priced a remembered answer's trees out for all of
# its 64 tokens, 1.03 tokens a pass where 7.5 were there to take.
SETTLED_PASSES = 3
# A pass that took over this many times what the curve measured says for its size was held up
# (another process had the cores), not its size's cost: it is taken as that many times (passes of
# a machine that stays slower, by up to that much a pass, move the curve as they did). Four lanes
# of the demo pair beside the test suite on a 2-core host met 5-token shared passes of 2.3 s
# where the curve said 40 ms; the line through the passes went flat (every size 2.3 s), and
# lookup proposed trees of 17-64 nodes beside the other requests, 3% of their nodes accepted.
STALL_FACTOR = 4.0
# A lookup proposal found by an n-gram this long or longer is "strong" (HindsightByKind).
STRONG_ORDER = 3
# A proposal whose text matched an earlier answer over this many tokens or more, measured backward
# (decoding.memory: a regenerated answer, a retried step, a sibling's repeated query; a request's
# own index matches ORDERS[0] tokens at most), is a kind of its own. Sized by one record with the
# strong n-grams, the 32-node chains that repeated SQL answers paid for were tried on the JSON
# records sent after them (keys matched among records of other values), accepting 1-3 tokens at
# 4x a plain step's cost: the first two records decoded at 74-81 tokens/s, 82-94 apart.
LONG_MATCH = 8
# A greedy request whose latest text equals earlier text over this many tokens, measured backward
# (the same prompt again: an answer regenerated, an agent's step retried, a request resent), is
# expected to go on as that text went on: at temperature 0 the same context gives the same
# tokens, up to a near-tie. Such a proposal is a kind of its own that starts trusted (REPEAT_TRUST),
# not doubted: the demo pair's regenerated chat answer grew its trees 3, 3, 5, 8, 16, 32 nodes
# while the other kinds' records earned trust, 9 passes for 96 tokens it had written before
# (trusted: 4 passes, 32, 32, 24 and 3 nodes).
REPEAT_MATCH = 64
# A text shorter than REPEAT_MATCH repeats where all of it matched (the same short prompt again),
# from this many tokens.
REPEAT_MIN = 16
# Steps of "every proposal accepted whole" a repeat starts from, until its first step is measured:
# from then on what its steps accept sizes it, so a repeat that does not go on as before (a
# near-tie parted it) is cut down at once.
REPEAT_TRUST = 1.0
# Steps of "nothing accepted" each kind starts from (Hindsight.doubt): a proposal made while the
# text follows an earlier one is credible sooner than one after a chance match.
DOUBT, RUN_DOUBT = 8.0, 2.0
LONG_RUN = 6
# The most tokens a walk still matching is expected to match on (Hindsight.expected_more).
MAX_MORE = 64.0
# ... and at most this many times what it has matched so far.
RAMP = 2.0


def decay(half_life: float) -> float:
    """The weight kept per step by a mean whose steps lose half their weight after `half_life`."""
    return 0.5 ** (1.0 / half_life)


class Average:
    """An exponentially weighted mean of arrays (or floats), with early steps not biased to 0."""

    def __init__(self, half_life: float, shape=()):
        self.keep = decay(half_life)
        self.sum = np.zeros(shape)
        self.weight = 0.0
        self.count = 0

    def add(self, value) -> None:
        self.sum = self.keep * self.sum + np.asarray(value, np.float64)
        self.weight = self.keep * self.weight + 1.0
        self.count += 1

    @property
    def known(self) -> bool:
        return self.weight > 0

    @property
    def mean(self):
        return self.sum / self.weight if self.weight else self.sum


class Walk:
    """One step's proposal, walked down by the tokens emitted since its root."""

    def __init__(self, tree: DraftTree | None, nodes: np.ndarray, base: DraftTree | None):
        self.tree, self.nodes, self.base = tree, nodes, base
        self.node = 0 if tree is not None and len(tree) > 1 else None
        self.base_node = 0 if base is not None and len(base) > 1 else None
        # Nodes grafted onto `base` after this watch began are not the base's own.
        self.base_len = len(base) if base is not None else 0
        self.base_depth = 0
        self.ranks: list[int] = []
        self.fed = 0  # tokens fed so far
        self.missed = False  # the tree's walk ended at a token it did not hold
        if self.node is not None:
            order = np.argsort(-tree.logps[1:], kind="stable")
            self.rank = np.empty(len(tree), np.int64)
            self.rank[0] = 0
            self.rank[1 + order] = np.arange(1, len(tree))

    @property
    def done(self) -> bool:
        return self.node is None and self.base_node is None

    @property
    def at_leaf(self) -> bool:
        """Whether no further token can go deeper in either tree."""
        tree_end = self.node is None or self.tree.is_leaf(self.node)
        base_end = self.base_node is None or self.base.is_leaf(self.base_node)
        return tree_end and base_end

    def feed(self, token: int) -> None:
        self.fed += 1
        if self.node is not None:
            child = self.tree.find_child(self.node, token)
            self.missed = child is None  # (a walk that reached a leaf ends without a miss)
            self.node = child
            if child is not None:
                self.ranks.append(int(self.rank[child]))
        if self.base_node is not None:
            child = self.base.find_child(self.base_node, token)
            if child is not None and child >= self.base_len:
                child = None
            self.base_node = child
            self.base_depth += child is not None

    def accepted(self, budgets: np.ndarray, more: float = 0.0) -> np.ndarray:
        """Tokens accepted at each budget: ranks rise along a path (a child scores below its
        parent), so a cut to budget B keeps exactly the path nodes ranked <= B. `more`: tokens
        expected to match after those matched so far (for a walk still going), taken to be the
        next-ranked nodes."""
        depth = np.searchsorted(np.array(self.ranks, np.int64), budgets, side="right").astype(np.float64)
        if more and self.node is not None:
            last = self.ranks[-1] if self.ranks else 0
            depth += np.clip(budgets - last, 0, more)
        return np.maximum(depth, self.base_depth)


class Hindsight:
    """Per budget of a grid: mean tokens accepted and nodes verified per step, learned after the fact.

    Each step the caller `watch`es the largest tree it could verify (ranked by logp, as
    `DraftTree.prune_to_best` cuts), then `feed`s every emitted token. A step may also verify a
    fixed `base` tree (the draft model's) with the watched tree's nodes grafted onto it: then the
    accepted depth is the deeper of the two walks, and `nodes` counts base + grafted nodes.
    """

    def __init__(self, max_budget: int, half_life: float = HALF_LIFE, doubt: float = 0.0, trust: float = 0.0):
        budgets = sorted({b for b in BUDGETS if b < max_budget} | {max_budget})
        self.budgets = np.array(budgets, np.int64)
        # Steps of "nothing accepted" assumed before any was watched: a lucky first proposal or
        # two must not make every later one look good (each weighs as one step, then fades).
        self.doubt = doubt
        # Steps of "every budget's tree accepted whole" assumed before any was measured (a repeat:
        # REPEAT_TRUST).
        self.trust = trust
        self._accepted = Average(half_life, len(budgets))
        self._nodes = Average(half_life, len(budgets))
        self._walks = Average(half_life, 2)  # [tokens matched, walk ended by a miss] per proposal
        self._open: list[Walk] = []

    def watch(self, tree: DraftTree | None, base: DraftTree | None = None, new_by_rank: np.ndarray | None = None) -> None:
        """Follow this step's proposal. `new_by_rank[r]`: whether the tree's r-th best node adds a
        node to `base` (all do when there is no base)."""
        n = len(tree) - 1 if tree is not None else 0
        added = np.ones(n, np.int64) if new_by_rank is None else np.asarray(new_by_rank, np.int64)
        cumulative = np.concatenate([[0], np.cumsum(added)])
        nodes = cumulative[np.minimum(self.budgets, n)] + (len(base) - 1 if base is not None else 0)
        watch = Walk(tree, nodes, base)
        if watch.done or watch.at_leaf:
            self._finish(watch)
        else:
            self._open.append(watch)

    def feed(self, tokens) -> None:
        """Take the tokens the target emitted (in order, across steps)."""
        for token in tokens:
            if not self._open:
                return
            self.feed_one(int(token))

    def feed_one(self, token: int) -> bool:
        """Take one emitted token; return whether a proposal being followed held it."""
        held = False
        for watch in self._open:
            depth = len(watch.ranks)
            watch.feed(token)
            held |= len(watch.ranks) > depth
        for watch in [w for w in self._open if w.done or w.at_leaf]:
            self._finish(watch)
            self._open.remove(watch)
        return held

    def forget_open(self) -> None:
        """Drop proposals still being followed (the text was replaced: they will never finish)."""
        self._open.clear()

    def _finish(self, watch: Walk) -> None:
        self._accepted.add(watch.accepted(self.budgets))
        self._nodes.add(watch.nodes)
        self._walks.add([len(watch.ranks), float(watch.missed)])

    def expected_more(self) -> float:
        """Tokens a walk that is still matching is expected to match on: with each token matching
        with probability p, p / (1 - p), p estimated from the tokens matched and the misses of
        the proposals watched (those still going count what they matched; `doubt` adds misses)."""
        matched, misses = self._walks.sum if self._walks.known else (0.0, 0.0)
        for watch in self._open:
            matched += len(watch.ranks)
        misses += self.doubt * self._walks.keep ** self._walks.count
        return float(min(MAX_MORE, matched / misses)) if misses > 0 else float(MAX_MORE)

    @property
    def known(self) -> bool:
        """Whether any proposal was watched (finished, or still followed: a lower bound), or the
        record starts trusted."""
        return self._accepted.known or bool(self._open) or self.trust > 0

    @property
    def watched(self) -> int:
        """How many proposals were watched (finished, or still followed)."""
        return self._accepted.count + len(self._open)

    @property
    def measured(self) -> bool:
        """Whether any watched proposal has met an emitted token yet (matched it or not)."""
        return self._accepted.known or any(watch.fed > 0 for watch in self._open)

    def accepted(self) -> np.ndarray:
        """Mean tokens accepted per step, per budget (the bonus token not counted).

        Proposals still being followed count with what they matched so far (a lower bound), as
        the newest steps: a copy that just began shows at once, not only once it ends.
        """
        # Trusted only as far as a walk has shown itself: one matched token may be chance.
        more = self.expected_more()
        return self._with_open(self._accepted, lambda w: w.accepted(self.budgets, min(more, RAMP * len(w.ranks))), self.doubt)

    def nodes(self) -> np.ndarray:
        """Mean nodes verified per step, per budget."""
        return self._with_open(self._nodes, lambda w: w.nodes)

    def _with_open(self, average: Average, value, doubt: float = 0.0) -> np.ndarray:
        total, weight = average.sum, average.weight
        for watch in self._open:
            if watch.fed == 0:
                continue  # made this step: nothing known about it yet
            total = average.keep * total + value(watch)
            weight = average.keep * weight + 1.0
        # The doubt steps came first: they fade as real steps follow. A trusted step (accepted,
        # and verified, each budget's nodes whole) holds until the first real one is measured.
        fade = average.keep ** (average.count + sum(w.fed > 0 for w in self._open))
        trust = 0.0 if self.measured else self.trust
        total = total + trust * self.budgets
        weight += doubt * fade + trust
        return total / weight if weight else total

    def best(self, step_seconds: Callable[[np.ndarray], np.ndarray], margin: float = 0.0,
             emitted_beside: float = 0.0, depth: int | None = None) -> tuple[int, float]:
        """Return (budget, tokens/s) with the most tokens per second, given the seconds of a step
        that verifies n nodes: `step_seconds(n)` (vectorised). A tree must beat no tree (budget
        0) by `margin`: a bet that only breaks even on estimates loses to their noise.
        `emitted_beside`: tokens other requests emit from the same pass (its rate is theirs too).
        `depth`: the deepest this step's tree may reach (an answer's last tokens), which caps
        what any budget accepts: what deep trees accepted does not buy a wide shallow one. Where
        it falls between two budgets, it is a budget too (accepted and nodes interpolated): a tree
        cut to an answer's last tokens takes them in one pass, where the budget below leaves a
        pass of a few (a repeat's last 29 tokens went in passes of 25 and 4, 106 ms, against one
        of 29, about 81)."""
        budgets, accepted, nodes = self.budgets, self.accepted(), self.nodes()
        if depth is not None and budgets[0] < depth < budgets[-1] and depth not in budgets:
            at = int(np.searchsorted(budgets, depth))
            budgets = np.insert(budgets, at, depth)
            accepted = np.insert(accepted, at, np.interp(depth, self.budgets, accepted))
            nodes = np.insert(nodes, at, np.interp(depth, self.budgets, nodes))
        if depth is not None:
            accepted = np.minimum(accepted, depth)
        rates = (accepted + 1.0 + emitted_beside) / step_seconds(nodes)
        i = int(np.argmax(rates))
        if i and rates[i] < rates[0] * (1.0 + margin):
            i = 0
        return int(budgets[i]), float(rates[i])


class HindsightByKind:
    """A Hindsight per kind of proposal: how a proposal was found says much about its chances.

    A kind is (run, strength). `run` says how long the emitted text has been following earlier
    proposals (every latest token held by one): 0 (not, or for one token, which may be chance),
    1 (a few tokens) or 2 (LONG_RUN tokens or more). `strength`: 0 where the proposal's longest
    match has fewer than STRONG_ORDER tokens, 1 from STRONG_ORDER, 2 from LONG_MATCH (measured
    backward among earlier answers), 3 for a greedy request's repeat (REPEAT_MATCH tokens or more,
    measured backward in the session's text or among earlier answers), which starts trusted.
    Mid-copy, proposals are accepted for long stretches; in free text, a match on the last token
    or two rarely is.
    """

    def __init__(self, max_budget: int, half_life: float = KIND_HALF_LIFE):
        self.kinds = {
            (run, strength): Hindsight(max_budget, half_life, doubt=RUN_DOUBT if run else DOUBT)
            for run in (0, 1, 2)
            for strength in (0, 1, 2)
        }
        for run in (0, 1, 2):
            self.kinds[(run, 3)] = Hindsight(max_budget, half_life, trust=REPEAT_TRUST)
        self.streak = 0  # the latest emitted tokens that some proposal held, in a row

    def __getitem__(self, kind: tuple[int, int]) -> Hindsight:
        return self.kinds[kind]

    def record(self, kind: tuple[int, int]) -> Hindsight:
        """The Hindsight that sizes a proposal of `kind`: its own once it has measured one; until
        then that of the same strength a run level below (the text having followed earlier
        proposals for longer only raises the odds), so that a copy under way is not made to
        earn trust from nothing again at each run level (a fresh process's rewrites took 7%
        more passes so); a long match with nothing of its own measured takes a strong one's."""
        run, strength = kind
        if strength == 3:
            return self.kinds[kind]  # a repeat's own record, trusted from the start
        for level in (2, 1) if strength == 2 else (strength,):
            for lower in range(run, -1, -1):
                if self.kinds[(lower, level)].measured:
                    return self.kinds[(lower, level)]
        return self.kinds[kind]

    def kind(self, order: int, repeat: bool = False) -> tuple[int, int]:
        """The kind of a proposal made now, whose longest match has `order` tokens; `repeat`: a
        greedy request's text matched earlier text over REPEAT_MATCH tokens or more."""
        run = 2 if self.run(LONG_RUN) else 1 if self.run(2) else 0
        return run, 3 if repeat else 2 if order >= LONG_MATCH else 1 if order >= STRONG_ORDER else 0

    @staticmethod
    def copying(kind: tuple[int, int]) -> bool:
        """Whether a proposal of this `kind` continues a copy that running the draft model again
        would only interrupt: the text has followed earlier proposals over LONG_RUN tokens, or a
        greedy request repeats earlier text (its proposal is the target's own earlier output)."""
        return kind[0] == 2 or kind[1] == 3

    def run(self, tokens: int = 2) -> bool:
        """Whether the text has followed earlier proposals for the last `tokens` tokens at least
        (across proposals: one that ended at its deepest node hands over to the next)."""
        return self.streak >= tokens

    def feed(self, tokens) -> None:
        for token in tokens:
            held = [hindsight.feed_one(int(token)) for hindsight in self.kinds.values()]
            self.streak = self.streak + 1 if any(held) else 0

    def forget_open(self) -> None:
        self.streak = 0
        for hindsight in self.kinds.values():
            hindsight.forget_open()


class TargetCost:
    """Seconds of one target pass over n tokens on this machine, as measured so far.

    With the tuning profile's curve, the curve scaled by the measured/profiled ratio. Without one,
    two pieces: one-token passes (their mean), and a line fitted to the passes over more tokens
    (recent ones weigh most). On a CPU the first extra token costs far more than each one after
    it (the batched kernels take over), so the line is not forced through the one-token figure;
    while every multi-token pass so far had the same size, the line runs from the one-token
    figure to theirs. Before any multi-token pass, each extra token costs PRIOR_TOKEN_COST of a
    one-token pass.
    """

    def __init__(self, curve: Callable[[np.ndarray], np.ndarray] | None = None, half_life: float = 4 * HALF_LIFE):
        self.curve = curve
        self._half_life = half_life
        self._ratio = Average(half_life)
        self._base = Average(half_life)
        # Weighted sums for the line over x = n - 1: [1, x, x*x, seconds, seconds*x].
        self._fit = Average(half_life, 5)
        self.step = 0  # passes of this many tokens or more: another regime (set_step), their own line
        self._above = Average(half_life, 5)  # (over x = n - step)
        self._sizes: set[int] = set()  # (set_first_passes_apart)
        self._first: TargetCost | None = None

    def observe(self, n_tokens: int, seconds: float) -> None:
        if n_tokens < 1 or seconds <= 0:
            return
        if self._first is not None and n_tokens not in self._sizes:
            self._sizes.add(n_tokens)
            self._first.observe(n_tokens, seconds)
            return
        # The passes this one joins (one-token passes, or the line below or above the step), and
        # the figure its size's price rests on: theirs, or a profile's curve scaled.
        points = self._base if n_tokens == 1 else self._above if self.step and n_tokens >= self.step else self._fit
        if (self._ratio if self.curve is not None else points).known:  # (not the prior's guess)
            seconds = min(seconds, STALL_FACTOR * float(self(np.array([n_tokens]))[0]))  # (a stall: STALL_FACTOR)
        if self.curve is not None:
            self._ratio.add(seconds / float(self.curve(np.array([n_tokens]))[0]))
        if points is self._base:
            points.add(seconds)
        else:
            x = n_tokens - (self.step if points is self._above else 1)
            points.add([1.0, x, x * x, seconds, seconds * x])

    def set_first_passes_apart(self) -> None:
        """Keep each size's first pass out of the curve, pricing passes only while nothing else
        was measured: over RPC workers llama.cpp asks the worker the sizes of a new shape's
        products, a round trip each (200 ms away a 6-token pass took 2.05 s the first time, 0.44 s
        after), and such passes priced every size the tree had not verified yet as several times
        dearer. Where the target runs on this machine every pass is kept."""
        if self._first is None:
            self._first = TargetCost(self.curve, self._half_life)
            self._first.set_step(self.step)

    def set_step(self, step: int) -> None:
        """Passes of `step` tokens or more cost another regime (layers in RAM run on the GPU after a copy:
        hardware.offload.cost_steps): as a one-token pass until one is timed, flat while one size was."""
        self.step = step
        if self._first is not None:
            self._first.set_step(step)

    @property
    def known(self) -> bool:
        return self._measured or (self._first is not None and self._first.known)

    @property
    def _measured(self) -> bool:
        """Whether a pass beyond its size's first has been measured (or a profile's curve scaled)."""
        return self._ratio.known or self._base.known or self._fit.known or self._above.known

    def _stand_in(self) -> TargetCost | None:
        """The first passes of their sizes, while nothing else was measured."""
        return self._first if not self._measured and self._first is not None and self._first.known else None

    @property
    def settled(self) -> bool:
        """Whether the cost of a multi-token pass rests on a profile's curve or on SETTLED_PASSES
        such passes measured in this run."""
        return self.curve is not None or self._fit.count + self._above.count >= SETTLED_PASSES

    def prior(self, n_tokens: np.ndarray) -> np.ndarray:
        """Seconds of an n-token pass as assumed before any multi-token pass was measured: the
        one-token figure, and PRIOR_TOKEN_COST of it per extra token."""
        if (first := self._stand_in()) is not None:
            return first.prior(n_tokens)
        base = self._one_token_s()
        return _priced(n_tokens, base, base, PRIOR_TOKEN_COST * base)

    def plain_s(self) -> float | None:
        """Seconds of a one-token pass, or None when nothing was measured or profiled."""
        if (first := self._stand_in()) is not None:
            return first.plain_s()
        if self.curve is not None:
            return float(self(np.array([1]))[0])
        return float(self._base.mean) if self._base.known else None

    def __call__(self, n_tokens: np.ndarray) -> np.ndarray:
        n = np.asarray(n_tokens, np.float64)
        if (first := self._stand_in()) is not None:
            return first(n)
        if self.curve is not None:
            ratio = self._ratio.mean if self._ratio.known else 1.0
            return self.curve(n) * ratio
        base = self._one_token_s()
        below = _priced(n, base, *self._line(base))
        at, slope = self._above_line(base)  # (base, 0 without a step: nothing is observed above it)
        return np.where(n >= self.step, at + slope * (n - self.step), below) if self.step else below

    def _one_token_s(self) -> float:
        """Seconds of a one-token pass: measured, else the multi-token passes' mean taken back
        to one token at the prior cost per extra token (1 s before anything was measured)."""
        if self._base.known:
            return float(self._base.mean)
        if self._fit.known:
            w, sx, _, sy, _ = (float(v) for v in self._fit.sum)
            return (sy / w) / (1.0 + PRIOR_TOKEN_COST * sx / w)
        return 1.0

    def _line(self, base: float) -> tuple[float, float]:
        """Return (intercept, seconds per extra token) of passes over more than one token."""
        if not self._fit.known:
            return base, PRIOR_TOKEN_COST * base
        w, sx, _, sy, _ = (float(v) for v in self._fit.sum)
        # Passes of different sizes: the line through them; one size so far: from the one-token figure to theirs.
        return _fitted(self._fit) or (base, max(0.0, (sy / w - base) / (sx / w)))

    def _above_line(self, base: float) -> tuple[float, float]:
        """Return (seconds at the step, per token beyond it) of passes at or above the step."""
        if not self._above.known:
            return base, 0.0
        w, _, _, sy, _ = (float(v) for v in self._above.sum)
        return _fitted(self._above) or (sy / w, 0.0)  # one size so far: flat


def _fitted(fit: Average) -> tuple[float, float] | None:
    """Return (intercept, slope >= 0) of the weighted line through `fit`'s passes, None while they had one size."""
    w, sx, sxx, sy, sxy = (float(v) for v in fit.sum)
    spread = w * sxx - sx * sx
    if spread <= 1e-9 * w * w:
        return None
    slope = max(0.0, (w * sxy - sx * sy) / spread)
    return (sy - slope * sx) / w, slope


def _priced(n_tokens: np.ndarray, base: float, intercept: float, slope: float) -> np.ndarray:
    """Seconds of n-token passes: `base` for one token, else the line (`intercept` at one token,
    `slope` per extra one), never below `base`."""
    n = np.asarray(n_tokens, np.float64)
    return np.where(n <= 1, base, np.maximum(base, intercept + slope * (n - 1)))


@dataclass(frozen=True)
class DraftPrior:
    """What the tuning profile measured for the draft model on this machine, for a process that
    has measured nothing yet (its first step: see HybridDrafter). Seconds are scaled online by
    what the run's own target passes measure against the profile's (TargetCost)."""

    plain_s: float  # a plain step: one target pass over one token, and the step's bookkeeping
    tree_s: float  # one target pass over the draft model's tree and its root
    step_s: float  # the draft model's expansion passes for one tree (catch-up aside)
    catch_up_s: float  # seconds per token of the draft's catch-up with unread text
    accepted: float  # draft tokens accepted per target pass (the bonus token not counted)

    def draft_rate(self, debt: int, ahead: float, scale: float = 1.0) -> float:
        """Tokens per second of draft-model steps, a catch-up over `debt` tokens spread over the
        `ahead` tokens the answer is expected to still have; `scale`: this run's seconds per
        profiled second."""
        tokens = self.accepted + 1.0
        seconds = self.tree_s + self.step_s + self.catch_up_s * max(0, debt - 1) * tokens / max(ahead, 1.0)
        return tokens / (seconds * scale)

