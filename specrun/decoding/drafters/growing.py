"""The draft model's trees grown online to the size this run's passes pay for (SpecExec's regime).

Where a target pass costs about the same for 1 token or 500 (layers offloaded to RAM, a target on
an RPC worker across a network), a tree of hundreds of nodes turns one pass into many tokens;
where each verified token costs as much as a sixth of a pass (a CPU), a chain of a few. Without a
tuning profile nobody has said which: `GrowingTrees` starts from the plan's tree and moves between
sizes (core.tree_shapes.growth_levels) by what the run measures:

- what a size's tree would accept: every proposal is watched (reach.Reach), and its cut to
  any smaller size is exactly its best nodes (best-first), so one proposal tells every size up
  to its own. To learn a larger size, a step now and then grows the larger tree and still
  verifies the cut to the size that pays (only the first looks at a size verify it whole, to
  time its pass);
- what a step costs at each size: the target's pass over that many nodes (as timed at that size
  lately, else the measured curve, adaptive.TargetCost), the draft's passes for that size's tree
  (measured per size, until then a pass per level of its depth, priced by the draft's passes so
  far), and the rest of a step.

pay.rules decides (`grow_pays`, `hoped_accepted`); this module only measures and grows.
"""

from __future__ import annotations

import logging
from typing import Sequence

import numpy as np

from specrun.core.tree_shapes import LONGEST_GROWN_CHAIN, LONGEST_NETWORK_CHAIN, TreeShape, grown_shape, growth_levels
from specrun.decoding.adaptive import BUDGETS, Average, TargetCost
from specrun.decoding.drafters.base import ModelDrafter
from specrun.decoding.drafters.best_first import GrownTree, TreeGrower
from specrun.decoding.pay.rules import EXPLORE_EVERY, GROW_EVIDENCE, faster, grow_pays, grows_chains, hoped_accepted
from specrun.decoding.reach import Reach

log = logging.getLogger("specrun")

# Tokens compared with the text already read before trusting the new text to continue it.
_TEXT_CHECK = 16
# Steps after which a size's measured passes give way to the curve of all passes (the machine
# may have changed: a busy moment, a worker that went away).
STALE_STEPS = 48


class GrowingTrees(ModelDrafter):
    """A draft model's best-first trees, sized online between `start` and `limit` nodes."""

    def __init__(self, grower: TreeGrower, start: TreeShape, limit: int, cost: TargetCost | None = None):
        self.grower = grower
        self._start, self._limit = start, max(limit, start.budget)
        self._set_levels(growth_levels(start.budget, self._limit))
        # The target's passes by their size: shared with the hybrid, which feeds it (else fed here).
        self.cost = cost if cost is not None else TargetCost()
        self._feeds_cost = cost is None
        self._verified = 0  # the size the last proposal was cut to
        self._sizes_seen: set[int] = set()  # tree sizes the target has verified
        self._steps = 0  # steps observed
        self.draft_pass = TargetCost()  # the draft's expansion passes, by tokens
        self.rest_s = Average(24)  # a drafting step's seconds beyond its target and draft passes
        self.level = 0  # the size that pays (verified, but for the looks at the sizes around it)
        self._since_explore = 0
        self._text: list[int] = []  # the text fed to `reach` so far
        self._overlapping = False  # the draft grows its tree during the target's pass (overlaps)
        self._chains_to = 0  # sizes up to this may be grown as chains (`overlaps`, `_shape`)

    def _set_levels(self, levels: tuple[int, ...], deep: bool = False) -> None:
        """Size between `levels` (nothing measured yet); `deep`: the trees above the longest
        network chain reach deeper than it."""
        self.levels = levels
        # (With `deep`, the sizes up to the longest network chain are trees here: `_shape` grows
        # them as chains while that pays.)
        longest = LONGEST_NETWORK_CHAIN if deep else LONGEST_GROWN_CHAIN
        self.shapes = [self._start, *(grown_shape(b, longest) if b > longest else grown_shape(b) for b in levels[1:])]
        self.reach = Reach({b for b in BUDGETS if b <= levels[-1]} | set(levels))
        self._at = np.searchsorted(self.reach.budgets, levels)  # each level's column in reach
        self._half = np.searchsorted(self.reach.budgets, [max(1, b // 2) for b in levels], side="right") - 1
        self.draft_s = [Average(24) for _ in levels]  # a proposal's draft passes, per size grown
        self.draft_s_shared = [Average(24) for _ in levels]  # the same, its passes shared with other requests'
        self.target_s = [Average(24) for _ in levels]  # a step's target pass, per size verified
        self._timed_at = [0] * len(levels)  # the step at which each size's pass was last timed

    def first_passes_apart(self) -> None:
        self.cost.set_first_passes_apart()  # (shared with the hybrid, which feeds it)

    def overlaps(self) -> None:
        """The target's passes run elsewhere, and the draft grows its last tree on meanwhile
        (TreeGrower.extend). Above a chain start:
        - a chain LONGEST_GROWN_CHAIN long joins the sizes as the next deeper than a shorter start
          (its nodes mostly drafted during the pass before, as deep again). Without it the demo
          pair's chat stayed on the chain of 5 50 ms away, accepted whole at nearly every step,
          where the 16-node tree, timed from steps that grew it from scratch, looked dearer;
        - the sizes up to LONGEST_NETWORK_CHAIN are chains too while the target takes the draft's
          first choices (pay.rules.grows_chains; `_shape`), and the trees above reach deeper.
          With trees from 16 nodes on, the same chat stayed on the chain of 8 (38 tokens/s, where
          a chain of 16 made 52)."""
        self._overlapping = True
        if not self._start.is_chain:
            return
        levels = self.levels
        if self._start.budget < LONGEST_GROWN_CHAIN < self._limit:
            levels = (self._start.budget, *growth_levels(LONGEST_GROWN_CHAIN, self._limit))
        self._set_levels(levels, deep=True)
        self._chains_to = LONGEST_NETWORK_CHAIN
        # The chain of 5's pass grows its tree on as deep as a chain of LONGEST_GROWN_CHAIN's would
        # (twice its depth, and one), time allowing: a look at that chain then starts from nodes
        # drafted as they are at that size, not from the 5 levels a chain of 5's pass grew (its
        # draft passes in series, 76 ms of a 282 ms step 50 ms from the worker, judged it level
        # with the chain of 5, where a chain of 8 ran 5-13% faster).
        self.grower.extend_depth = 2 * LONGEST_GROWN_CHAIN + 1

    def cost_step(self, step: int) -> None:
        """The target's passes of `step` tokens or more cost another regime (base.Drafter): the
        sizes above the start whose pass stays below the step are left out. On an H100 with 40 of
        a 27B target's 65 layers in RAM a 17-token pass took 530 ms where 32 tokens took 203 (the
        weights then copied to the GPU, pinned: docs/benchmarks.md); a ladder through 16 nodes
        would price every tree above it by that pass and never grow them."""
        self.cost.set_step(step)
        self._set_levels((self.levels[0], *(b for b in self.levels[1:] if b + 1 >= step)), deep=self._overlapping)

    def _shape(self, level: int) -> TreeShape:
        """The shape a proposal of `level` is grown in: a chain of its size where `overlaps` says so."""
        shape, size = self.shapes[level], self.levels[level]
        if size <= self._chains_to and not shape.is_chain and grows_chains(self.grower.calibration.first_choices()):
            return TreeShape.chain(size)
        return shape

    # -- the decoder's and the hybrid's interface: the grower's, sized ----------------------------

    def __getattr__(self, name: str):
        """What the grower has and this class does not (its context, lane, cache): the grower's."""
        if name == "grower":
            raise AttributeError(name)
        return getattr(self.grower, name)

    @property
    def last_catch_up(self):
        return self.grower.last_catch_up

    @property
    def last_passes(self):
        return self.grower.last_passes

    @property
    def last_read(self):
        return self.grower.last_read

    @property
    def last_shared(self):
        return self.grower.last_shared

    @property
    def drafts_beside_others(self) -> bool:
        return self.grower.drafts_beside_others

    def attach(self, lane) -> None:
        self.grower.attach(lane)

    def debt(self, committed: Sequence[int], root: int) -> int:
        return self.grower.debt(committed, root)

    def probe(self):
        return self.grower.probe()

    def propose(self, committed: Sequence[int], root: int, budget: int, depth: int) -> GrownTree:
        self._read(committed, root)
        self.level, grown = self._choose()
        # A size explored for the first time is verified whole, until its pass is timed: then it
        # is measured, not only extrapolated (over a network the curve's first sizes say little
        # of the rest). The size below, when its timing has gone stale, is verified (a cut of
        # this tree: no draft pass more) to time it again, so that a tree can shrink back; over a
        # network only where it was timed before (a size's first pass there costs round trips,
        # four times a pass 200 ms away: the curve prices it).
        verified = self.level
        below = self.level - 1
        if self._sharing():
            pass  # (the pass holds other requests' trees: the curve prices it, not this size's own passes)
        elif not self.target_s[grown].known:
            verified = grown
        elif below >= 0 and grown == self.level and self._timed(below) is None \
                and (self.target_s[below].known or not self._overlapping):
            verified = below
        self._verified = verified
        verify, grow = min(budget, self.levels[verified]), min(budget, self.levels[grown])
        shape = self._shape(grown)
        self.grower.shape = shape
        proposal = self.grower.propose(committed, root, grow, min(depth, shape.depth))
        drafted = max(0.0, proposal.draft_s - self.grower.last_catch_up[1])
        if not self.grower.last_shared:  # (a pass shared with other requests times theirs too)
            self.draft_s[grown].add(drafted)
            for n_tokens, seconds in self.grower.last_passes:
                self.draft_pass.observe(n_tokens, seconds)
        else:  # (what this request waited for its tree, which sizes it beside others)
            self.draft_s_shared[grown].add(drafted)
        if verify < len(proposal.tree) - 1:
            self.reach.watch(proposal.tree)  # (the cut is a copy: this tree stays as grown)
            return proposal.cut(verify)
        self.reach.watch(proposal.tree.copy())  # (the hybrid grafts lookup branches onto the one it gets)
        return proposal

    def prepare(self, text: Sequence[int], done) -> None:
        self.grower.prepare(text, done)

    def extend(self, done) -> None:
        self.grower.extend(done)

    def read_ahead(self, text: Sequence[int], done, fits=None) -> None:
        self.grower.read_ahead(text, done, fits)

    def commit(self, proposal: GrownTree, accepted_nodes: Sequence[int]) -> None:
        self.grower.commit(proposal, accepted_nodes)

    def observe_shared(self, n_tokens: int, seconds: float) -> None:
        if self._feeds_cost:
            self.cost.observe(n_tokens, seconds)

    def observe(self, step) -> None:
        if self._feeds_cost:
            self.cost.observe(step.tree_nodes + 1, step.target_s)
        if step.draft_passes or step.reused_nodes:  # (a tree the draft model drafted, now or during the pass before)
            self.rest_s.add(max(0.0, step.total_s - step.target_s - step.draft_s))
            # The first pass of a size is no measure of the next ones: llama.cpp grows its buffers
            # for it (over an RPC worker the first 17-token pass took 730 ms, the next ones 190).
            if step.tree_nodes in self._sizes_seen:
                if self._timed(self._verified) is None:  # (stale: what it measured then is no guide)
                    self.target_s[self._verified] = Average(24)
                self.target_s[self._verified].add(step.target_s)
                self._timed_at[self._verified] = self._steps
            self._sizes_seen.add(step.tree_nodes)
        self._steps += 1

    def reset(self) -> None:
        self.grower.reset()
        self.reach.forget_open()
        self._text = []

    # -- sizing -----------------------------------------------------------------------------------

    def _read(self, committed: Sequence[int], root: int) -> None:
        """Feed `reach` the tokens emitted since the last proposal (a new text: start again)."""
        n, seen = len(committed) + 1, len(self._text)
        if 0 < seen <= n and list(committed[max(0, seen - _TEXT_CHECK): seen]) == self._text[-_TEXT_CHECK:]:
            new = [*committed[seen:], root] if seen < n else []
            self.reach.feed(new)
            self._text.extend(new)
            return
        self.reach.forget_open()
        self._text = [*committed, root]

    def _sharing(self) -> bool:
        """Whether this step's target pass holds other requests' tokens too (the decoder says so:
        `beside`, what they put into a shared pass lately)."""
        return self.beside.tokens > 0

    def rates(self, going: bool = False) -> np.ndarray:
        """Per level: tokens per second of a step verifying that size (0 where nothing is known);
        `going`: counting the walks still going at what they accepted so far (reach.Reach).
        Beside other requests, of the pass they share: its tokens with theirs (`beside`), as the
        hybrid and lookup size theirs (pay.rules.best_size), less the others' share at the size
        verified now (`_others_now`): a size's rate differs from another's as the whole pass's
        does (a larger tree slows the others' tokens too), and it is compared with this request's
        own rate, by STEP_MARGIN of that, not of the pass's."""
        seconds = self._step_seconds(going)
        return (self.reach.accepted(going)[self._at] + 1.0 + self.beside.emitted) / seconds - self._others_now(seconds)

    def _others_now(self, seconds: np.ndarray) -> float:
        """The others' tokens per second of a shared pass at the size verified now (0 alone)."""
        return self.beside.emitted / float(seconds[self.level]) if self.beside.emitted else 0.0

    def _step_seconds(self, going: bool = False) -> np.ndarray:
        """Per level: seconds of a step verifying that size (its target pass, its draft passes and
        the rest of a step)."""
        rest = float(self.rest_s.mean) if self.rest_s.known else 0.0
        return self._target_seconds(going) + self._draft_seconds() + rest

    def _target_seconds(self, going: bool = False) -> np.ndarray:
        """Per level: a step's target pass, as measured at that size lately, else by the measured
        curve (a size not verified for STALE_STEPS steps: the machine may have changed since).
        Beside other requests, the curve's pass over their tokens too (fed by the shared passes:
        observe_shared), for no size's own passes time that."""
        nodes = self.reach.nodes(going)[self._at] + 1
        if self._sharing():
            return np.asarray(self.cost(nodes + self.beside.tokens), dtype=float)
        curve = self.cost(nodes)
        timed = [self._timed(i) for i in range(len(self.levels))]
        return np.array([float(c) if t is None else t for t, c in zip(timed, curve)])

    def _timed(self, level: int) -> float | None:
        target = self.target_s[level]
        if not target.known or self._steps - self._timed_at[level] > STALE_STEPS:
            return None
        return float(target.mean)

    def _draft_seconds(self) -> np.ndarray:
        """Per level: a proposal's draft passes, as measured at that size (beside other requests,
        with theirs where so measured); a size not grown yet is taken to need a pass per level of
        its depth, each over its width, priced by the draft's passes measured so far (draft_pass)."""
        out = np.zeros(len(self.levels))
        sharing = self._sharing()
        for i in range(len(self.levels)):
            shape = self._shape(i)
            if sharing and self.draft_s_shared[i].known:
                out[i] = float(self.draft_s_shared[i].mean)
            elif self.draft_s[i].known:
                out[i] = float(self.draft_s[i].mean)
            elif self.draft_pass.known:
                out[i] = shape.depth * float(self.draft_pass(np.array([shape.width]))[0])
        return out

    def _choose(self) -> tuple[int, int]:
        """(the level a step verifies, the level it grows): the level that pays, and now and then,
        while the size above it has not been judged, a size above (`_look_above`). The first time
        a size is grown it is verified whole: its passes are then measured, not guessed from a
        curve that has seen none so large."""
        drafted = self.draft_s[self.level].known or (self._sharing() and self.draft_s_shared[self.level].known)
        if len(self.levels) == 1 or not self.cost.known or not drafted:
            return self.level, self.level
        rates, weights = self.rates(), self._judging(self.reach.weight())
        level = grow_pays(rates, weights, self.level)
        if level == self.level:
            level = self._grows_on_walks_going(rates)
        if level != self.level:
            log.info("the draft model's tree %s to %d nodes: %.1f tokens/s expected, against %.1f at %d",
                     "grows" if level > self.level else "shrinks", self.levels[level], rates[level],
                     rates[self.level], self.levels[self.level])
        above = level + 1
        if above >= len(self.levels) or weights[above] >= GROW_EVIDENCE:
            return level, level
        self._since_explore += 1
        if self._since_explore < EXPLORE_EVERY:
            return level, level
        look = self._look_above(level, rates, weights)
        if look is None:
            return level, level
        self._since_explore = 0
        return level, look

    def _grows_on_walks_going(self, rates: np.ndarray) -> int:
        """The larger size a grown tree verifies next where it pays already at what the walks of
        its proposals still going accepted so far (a lower bound: reach.Reach), else the level
        that pays now. A tree the target follows far is walked for steps (a chain of 32, looked
        at while a chain of 5 is verified, accepted whole over five steps): waiting for those
        walks to end kept the demo pair's chat on the chain of 5 for most of an answer 200 ms
        away, where every look at 32 had paid."""
        low = self.rates(going=True)
        low[: self.level + 1] = rates[: self.level + 1]  # (the sizes at or below: as they ended)
        return grow_pays(low, self._judging(self.reach.weight(going=True)), self.level)

    def _judging(self, weight: np.ndarray) -> np.ndarray:
        """Per level, the weight of the proposals that judge it (`weight`: Reach's, per budget).
        Where the draft grows during the target's pass (a network), none for a size whose pass
        was never timed: it is verified only once a look has timed it (`_look_above`), for its
        first pass costs the RPC client's round trips (1.6 s 200 ms away), and sizes that only
        cuts of larger looks had judged, priced by the curve, drew the tree through a size more."""
        weights = weight[self._at]
        if self._overlapping and not self._sharing():
            timed = np.array([target.known for target in self.target_s])
            timed[self.level] = True
            weights = np.where(timed, weights, 0.0)
        return weights

    def _look_above(self, level: int, rates: np.ndarray, weights: np.ndarray) -> int | None:
        """The size a step grows to look at, above `level`, or None.

        Where the draft grows its trees during the target's pass (`overlaps`: a network), a look
        is taken whatever it promises (its draft passes cost little, and the curve's first sizes
        say little of the rest), at the untimed size that promises the most tokens per second
        (`_hoped_rates`), which may lie several sizes up, and there until it is judged. Each
        size's first pass there costs the round trips of llama.cpp's RPC client asking the worker
        the sizes of its products (1.6 s 200 ms away, four times a one-token pass), and a ladder
        through every size (8, 16, 32) cost a fresh process's chat its first answers there (9.4
        tokens/s in the first, 18.8 in the fourth). Elsewhere the size just above, if it promises
        to pay, priced by the curve: a grown tree's draft passes run in series before the target's
        pass, and on the demo pair's CPU two looks at 16 nodes (140-150 ms a step against 52 for
        the chain of 5 and 14 for a plain one) made a fresh process's chat 0.89x plain decoding.

        Over a network no size is looked at whose tree the draft would grow in series for longer
        than a whole step of `level` takes (`_look_cost`): a look at the demo pair's 64-node tree
        from its chain of 32, 200 ms from the worker, drafted 700-930 ms for a 510 ms pass (its
        passes of four nodes cost four times one on this CPU)."""
        above = level + 1
        if self._overlapping and not self._sharing():
            step = float(self._step_seconds()[level])
            sizes = [i for i in range(above, len(self.levels)) if self._look_cost(i) <= step]
            if not sizes or sizes[0] != above:
                return None
            if not self.target_s[above].known:
                seen = self.reach.weight(going=True)[self._at]
                looked = [i for i in sizes if seen[i] > 0]
                if looked:  # (one look is no judgement: the size looked at is looked at again)
                    return looked[-1]
                hoped = self._hoped_rates(level, weights)
                untimed = [i for i in sizes if not self.target_s[i].known]
                return max(untimed, key=lambda i: hoped[i])
        return above if faster(self._hoped_rates(level, weights)[above], float(rates[level])) else None

    def _look_cost(self, level: int) -> float:
        """Seconds a look at `level` drafts in series: as its proposals did, else a pass per level
        of its depth over its width (0 before any draft pass was timed)."""
        if self.draft_s[level].known:
            return float(self.draft_s[level].mean)
        shape = self._shape(level)
        return shape.depth * float(self.draft_pass(np.array([shape.width]))[0]) if self.draft_pass.known else 0.0

    def _hoped_rates(self, level: int, weights: np.ndarray) -> np.ndarray:
        """Per level above `level`: the tokens per second a step verifying it is hoped to make
        (pay.rules.hoped_accepted from what `level` and half its size accepted, or what its own
        proposals accepted so far, whichever is more); 0 at `level` and below."""
        accepted, seconds = self.reach.accepted(), self._step_seconds()
        others = self._others_now(seconds)
        here, half = float(accepted[self._at[level]]), float(accepted[self._half[level]])
        out = np.zeros(len(self.levels))
        for i in range(level + 1, len(self.levels)):
            doublings = float(np.log2(self.levels[i] / self.levels[level]))
            hoped = hoped_accepted(here, half, doublings, self._shape(i).depth)
            if weights[i] > 0:
                hoped = max(hoped, float(accepted[self._at[i]]))
            out[i] = (hoped + 1.0 + self.beside.emitted) / float(seconds[i]) - others
        return out
