"""Tree shapes: how big a speculative tree is (TreeShape) and static tree templates (Sequoia).

Plain data shared by the drafters, the decoders, the tuner and the runtime plan.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, replace

from specrun.errors import UsageError

MAX_BUDGET = 2048  # nodes per tree; the target's n_batch is sized for budget + 1


@dataclass(frozen=True)
class TreeShape:
    """How big a tree to grow: node budget, depth limit, nodes expanded per draft pass, children each."""

    budget: int = 16
    depth: int = 8
    width: int = 4
    top_k: int = 4

    def __post_init__(self) -> None:
        if not 1 <= self.budget <= MAX_BUDGET:
            raise UsageError(f"budget must be between 1 and {MAX_BUDGET} nodes, got {self.budget}")
        if self.depth < 1:
            raise UsageError(f"tree depth must be at least 1, got {self.depth}")
        if self.width < 1 or self.top_k < 1:
            raise UsageError("tree width and top-k must be at least 1")

    @classmethod
    def chain(cls, depth: int) -> "TreeShape":
        """Classic speculative decoding: one path of `depth` draft tokens."""
        return cls(budget=depth, depth=depth, width=1, top_k=1)

    @property
    def is_chain(self) -> bool:
        return self.width == 1 and self.top_k == 1

    def resized(self, budget: int) -> "TreeShape":
        """Return the same kind of tree with `budget` nodes: a chain stays a chain (its depth is
        its budget); a tree keeps its depth limit, with width and top-k at most the budget."""
        if self.is_chain:
            return TreeShape.chain(budget)
        return replace(self, budget=budget, width=min(self.width, budget), top_k=min(self.top_k, budget))


@dataclass(frozen=True)
class TreeTemplate:
    """A static tree shape: node i hangs under `parents[i]` as its `ranks[i]`-th child.

    Node 0 is the root (parent -1, rank 0): the last emitted token. At run time a node of rank k
    gets its parent's k-th most likely draft token. Nodes are in breadth-first order, so
    ancestors come first and each level is contiguous; a node's children have ranks 1..m.
    """

    parents: tuple[int, ...]
    ranks: tuple[int, ...]

    @functools.cached_property
    def depths(self) -> tuple[int, ...]:
        depths = [0] * len(self.parents)
        for i in range(1, len(self.parents)):
            depths[i] = depths[self.parents[i]] + 1
        return tuple(depths)

    @property
    def size(self) -> int:
        """Nodes including the root: the tokens the target scores in one pass."""
        return len(self.parents)

    @property
    def depth(self) -> int:
        return max(self.depths)

    @property
    def n_leaves(self) -> int:
        return self.size - len(set(self.parents[1:]))

    @property
    def max_rank(self) -> int:
        return max(self.ranks)

    def expanding_widths(self) -> list[int]:
        """Return, per depth, how many nodes have children: the draft batch width at that level."""
        widths = [0] * self.depth
        for node in set(self.parents[1:]):
            widths[self.depths[node]] += 1
        return widths

    def to_dict(self) -> dict:
        return {"parents": list(self.parents), "ranks": list(self.ranks)}

    @classmethod
    def from_dict(cls, data: Mapping) -> TreeTemplate:
        return cls(tuple(int(p) for p in data["parents"]), tuple(int(r) for r in data["ranks"]))


def template_shape(template: TreeTemplate) -> TreeShape:
    """Return the TreeShape that describes a template (for context sizing and reporting)."""
    widths = template.expanding_widths() or [1]
    return TreeShape(
        budget=max(template.size - 1, 1),
        depth=max(template.depth, 1),
        width=max(widths),
        top_k=max(template.max_rank, 1),
    )


# The sizes a tree grown online (decoding.drafters.growing) moves between above the tree it starts
# from: each about twice the last. (A chain's next size is a tree: a longer chain gains only
# where the draft's first guess is right many times in a row; a tree also where its second is.)
GROWTH_LEVELS = (16, 32, 64, 128, 256, 384, 512, 768, 1024)
# Up to this size a grown tree is a chain: where a step pays for so few nodes the draft's first
# guess is what a wider tree would keep anyway, and a chain costs one token a draft pass.
LONGEST_GROWN_CHAIN = 8
# ... and up to this size where the draft grows its trees during the target's pass (a network:
# drafting.growing's `overlaps`). There a chain accepted whole was drafted on during the pass, so
# the next step's chain is mostly drafted already; a tree's second choices wait for a miss. The
# demo pair 50 ms away, chat: chains of 16 and 32 ran at 52-54 tokens/s (10.7 and 16.0 accepted a
# pass), best-first trees of 16 and 32 nodes (scored by the draft's calibrated chances) at 36
# and 27 (8.8 and 11.1), and the chain of 8 at 49.
LONGEST_NETWORK_CHAIN = 32


def grown_shape(budget: int, longest_chain: int = LONGEST_GROWN_CHAIN) -> TreeShape:
    """The best-first tree a drafter grows online at `budget` nodes (SpecExec's regime): a chain
    up to `longest_chain` nodes.

    Narrow and deep: two children a node, and a draft pass expands a sixteenth of the nodes (one
    for 16, 16 for 256), down to a depth that grows four levels a doubling (16 -> 16, 64 -> 24,
    256 -> 32, 1024 -> 40), and four deeper a doubling than the longest chain. On the demo pair (a
    draft that agrees with its target most of the time) such trees accepted far more than wider
    ones of the same size: 8.9 tokens a pass at 16 nodes against 5.3 for four children a node 8
    deep, 15.2 at 64 against 11.0, for about the same draft passes (four chat prompts of a probe
    run; `scripts/bench_growth.py --shape` compares shapes on the built-in chat prompts)."""
    if budget <= longest_chain:
        return TreeShape.chain(budget)
    doublings = max(0, (budget // 16).bit_length() - 1)
    beyond_chain = max(1, (budget // longest_chain).bit_length() - 1)
    depth = min(budget, max(16 + 4 * doublings, longest_chain + 4 * beyond_chain))
    return TreeShape(budget=budget, depth=depth, width=max(1, budget // 16), top_k=2)


def growth_levels(start: int, limit: int) -> tuple[int, ...]:
    """The sizes from `start` up to `limit` a tree grown online may take (both included)."""
    return (start, *(b for b in GROWTH_LEVELS if start < b < limit), *((limit,) if limit > start else ()))


# The node counts a tree verified over an RPC worker is cut to (its best part: the nodes drafted
# first). llama.cpp's RPC client asks the worker, a round trip each, for the size of every matrix
# product of a shape it has not seen: the first pass over a new number of tokens took 640 ms where
# the next took 138 (the demo target 50 ms away), and trees sized freely (lookup branches grafted
# on) met a new number nearly every step. A grid keeps the shapes few (ratio <= 1.25 above 4).
NETWORK_SIZES = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 40, 48, 64, 80, 96, 128, 160, 192, 256, 320, 384,
                 448, 512, 640, 768, 1024, 1280, 1536, 2048)


# The token counts of passes over such trees: their nodes and the root (a prompt's pass over RPC
# workers that meets a new count anyway takes one of these: decoding.kv.CachedSequence._fill).
NETWORK_PASSES = tuple(n + 1 for n in NETWORK_SIZES)


def network_size(nodes: int) -> int:
    """The largest NETWORK_SIZES entry within `nodes` (0 for 0)."""
    return max((n for n in NETWORK_SIZES if n <= nodes), default=0)
