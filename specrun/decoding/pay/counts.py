"""Token counts a model's passes have met in this process, and whether a pass is filled to one.

Over RPC workers a pass over a count of tokens not met before in the process costs round trips:
llama.cpp's RPC client asks the worker, one round trip each, the size of every kind of matrix
product of an output shape it has not met (ggml-rpc's alloc-size cache, kept per process). The
demo target 50 ms away: a 7-token pass took 640 ms the first time, 138 after; 200 ms away a
44-token prompt's pass 2.10 s, the same count's next pass 0.44. A tree verified there is cut to a
few node counts or filled to one met before (SpeculativeDecoder._network_shape), and so is a
prompt's pass (kv.CachedSequence.extend): a prompt's length is new nearly every request.
"""

from __future__ import annotations

from typing import Sequence

from specrun.decoding.adaptive import Average
from specrun.decoding.pay.rules import fill_pays


# A pass that meets a new count anyway takes one of the counts other passes will meet up to this
# many times its own tokens (core.tree_shapes.NETWORK_SIZES: at most 1.25 apart above 4 nodes).
FILL_GRID = 1.25


class MetCounts:
    """The token counts one model's passes met in this process, and their passes' seconds after
    each count's first (a first pass asks the worker its shapes' sizes: no measure of the next)."""

    def __init__(self):
        self.counts: set[int] = {1}  # (a one-token pass is met when the context is made: llama.cpp reserves its graph)
        # Those of passes over trees: a tree is filled only to one of them (a prompt's count filled
        # with a tree's filler nodes had 33-token passes over a 32-node tree take 49 tokens, and
        # the demo pair's chat 200 ms away accepted 10.2 tokens a pass against 11.6).
        self.tree_counts: set[int] = {1}
        # The counts of rows of logits passes asked for: the last layer computes only those rows,
        # and its products are new shapes to the worker too (two round trips; a tree's pass asks
        # every node's row, a prompt's its last).
        self.rows: set[int] = {0, 1}
        self._seconds: dict[int, Average] = {}
        self._spent: dict[int, float] = {}  # seconds of filler passes over a count not met took on (fill_pays)

    def note(self, n_tokens: int, seconds: float, tree: bool = False, rows: int | None = None) -> None:
        """A pass over n_tokens (a tree's, with `tree`: a row of logits each) took `seconds`;
        `rows`: the rows of logits it asked for."""
        if n_tokens in self.counts:
            self._seconds.setdefault(n_tokens, Average(8)).add(seconds)
        self.counts.add(n_tokens)
        if tree:
            self.tree_counts.add(n_tokens)
            self.rows.add(n_tokens)
        if rows is not None:
            self.rows.add(rows)

    def rows_for(self, n_rows: int, most: int) -> int:
        """The rows of logits a pass that needs n_rows asks for, up to `most` (filler rows): the
        least count met before, else `most`, which a pass filled to the same count asks again."""
        return min((m for m in self.rows if n_rows <= m <= most), default=most)

    def gap(self, n_tokens: int, up: int) -> float:
        """Seconds a pass over `up` tokens takes above one over n_tokens: the timed passes over
        `up` and over the largest timed count below n_tokens, their difference shared by the
        tokens between them (0 while either is untimed). (Their whole difference overstated the
        filler where the count below was far below: a 39-token prompt over a worker 50 ms away,
        next to passes of 6 and 49, was priced 140 ms of filler for 10 tokens of 2 ms each, and
        met a new count at 0.6 s instead.)"""
        below = max((m for m in self._seconds if m <= n_tokens), default=0)
        if not below or up not in self._seconds or up <= below:
            return 0.0
        whole = float(self._seconds[up].mean) - float(self._seconds[below].mean)
        return max(0.0, whole) * (up - n_tokens) / (up - below)

    def fill_to(self, n_tokens: int, most: int, network_s: float, shared: Sequence[int] = (), tree: bool = False,
                ending: bool = False) -> int:
        """The count a pass over n_tokens holds: n_tokens where it was met, else the least met
        count above it (a tree's pass, with `tree`: one a tree's pass met) up to `most` where the
        filler pays (pay.rules.fill_pays: priced by the passes timed around it, a tree's bounded
        by its size too, with what filler cost this count's passes so far, counted as they are
        filled; `ending`: a tree that reaches its answer's last tokens, bounded by the timed price
        only). Where none does the pass meets a new count anyway: the least of `shared`
        (counts other passes will meet: a prompt's pass takes a tree's) from n_tokens up to
        `most` and FILL_GRID times n_tokens, or n_tokens."""
        if n_tokens in self.counts:
            return n_tokens
        up = min((m for m in (self.tree_counts if tree else self.counts) if m > n_tokens), default=0)
        extra_s, spent_s = self.gap(n_tokens, up), self._spent.get(n_tokens, 0.0)
        if 0 < up <= most and fill_pays(n_tokens, up, extra_s, network_s, spent_s, priced=extra_s > 0 and (ending or not tree)):
            self._spent[n_tokens] = spent_s + extra_s
            return up
        return min((m for m in shared if n_tokens <= m <= min(most, FILL_GRID * n_tokens)), default=n_tokens)


# Per model file: ggml-rpc's cache outlives a model loaded again in the same process.
_MET: dict[str, MetCounts] = {}


def met_counts(model) -> MetCounts:
    """The counts `model`'s passes met in this process."""
    return _MET.setdefault(str(model.path), MetCounts())
