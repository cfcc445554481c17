"""What the draft model's trees grown online would have accepted at each size (drafters.growing).

adaptive.Hindsight averages every proposal at every budget; a drafter that grows its trees online
watches trees of changing sizes, and a budget must be judged by the proposals that reached it.
"""

from __future__ import annotations

import numpy as np

from specrun.core.tree import DraftTree
from specrun.decoding.adaptive import HALF_LIFE, Walk, decay


class Reach:
    """Per budget of a grid: mean tokens accepted per step by the best-first cut to that budget,
    counting only the proposals that were grown at least that large.

    Hindsight averages every proposal at every budget (a proposal smaller than a budget counts
    as its own size there), which is right where every step proposes the same largest tree. A
    drafter that grows its trees online (drafters.growing) watches trees of changing sizes: a
    budget must be judged by the proposals that reached it, or the many small trees of the
    first steps would hide what a larger one gains.
    """

    def __init__(self, budgets, half_life: float = HALF_LIFE):
        self.budgets = np.array(sorted(set(int(b) for b in budgets)), np.int64)
        self.keep = decay(half_life)
        self._sum = np.zeros(len(self.budgets))
        self._nodes = np.zeros(len(self.budgets))
        self._weight = np.zeros(len(self.budgets))
        self._open: list[tuple[Walk, int]] = []

    def watch(self, tree: DraftTree) -> None:
        """Follow this step's proposal (grown best-first: the cut to budget B is its B best nodes)."""
        watch = Walk(tree, np.zeros(0), None)
        size = len(tree) - 1
        if watch.done or watch.at_leaf:
            self._finish(watch, size)
        else:
            self._open.append((watch, size))

    def feed(self, tokens) -> None:
        """Take the tokens the target emitted (in order, across steps)."""
        for token in tokens:
            if not self._open:
                return
            for watch, _ in self._open:
                watch.feed(int(token))
            for item in [item for item in self._open if item[0].done or item[0].at_leaf]:
                self._finish(*item)
                self._open.remove(item)

    def forget_open(self) -> None:
        self._open.clear()

    def _finish(self, watch: Walk, size: int) -> None:
        covered, accepted, nodes = self._counts(watch, size)
        self._sum[covered] = self.keep * self._sum[covered] + accepted
        self._nodes[covered] = self.keep * self._nodes[covered] + nodes
        self._weight[covered] = self.keep * self._weight[covered] + 1.0

    def _counts(self, watch: Walk, size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(the budgets a proposal of `size` nodes reached, tokens its walk accepted at each, the
        nodes its cut to each held)."""
        covered = self.budgets <= size
        return covered, watch.accepted(self.budgets[covered]), np.minimum(self.budgets[covered], size)

    def _totals(self, going: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(tokens accepted, nodes, weight) summed per budget over the walks that ended, recent
        ones weighing most; `going`: and the walks still going, as the newest, at what they
        accepted so far (final at the budgets a walk has gone past, since a cut keeps the path
        nodes ranked up to its budget and ranks rise along a path; a lower bound above)."""
        sums, nodes, weight = self._sum.copy(), self._nodes.copy(), self._weight.copy()
        for watch, size in self._open if going else ():
            covered, accepted, held = self._counts(watch, size)
            sums[covered] += accepted
            nodes[covered] += held
            weight[covered] += 1.0
        return sums, nodes, weight

    def weight(self, going: bool = False) -> np.ndarray:
        """Per budget: how many proposals (recent ones weighing most) reached it (`_totals`)."""
        return self._totals(going)[2]

    def accepted(self, going: bool = False) -> np.ndarray:
        """Per budget: mean tokens accepted per step (the bonus token not counted; 0 where unknown)."""
        sums, _, weight = self._totals(going)
        return np.divide(sums, weight, out=np.zeros_like(sums), where=weight > 0)

    def nodes(self, going: bool = False) -> np.ndarray:
        """Per budget: mean nodes the cut held (a tree may stop short of its budget)."""
        _, nodes, weight = self._totals(going)
        return np.divide(nodes, weight, out=self.budgets.astype(np.float64), where=weight > 0)
