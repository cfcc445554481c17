"""The one interface between the speculative decoder and whatever proposes its trees.

A drafter proposes a tree of candidate tokens below the pending token each step; the decoder
verifies it with one target pass and tells the drafter which path the target accepted. The
decoder never needs to know what the drafter is (a draft model growing best-first, a static
Sequoia template, n-gram lookup in the text so far, or a mix).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

from specrun.core.tree import DraftTree


@dataclass
class Proposal:
    """A proposed tree (node 0 is the pending root token) and what proposing it cost."""

    tree: DraftTree
    draft_s: float = 0.0  # seconds spent in draft-model forward passes
    draft_passes: int = 0
    lookup_from: int | None = None  # node ids >= this came from text lookup (None: none did)
    forced_from: int | None = None  # node ids >= this are a grammar's forced run, grafted by the decoder

    def lookup_tokens(self, nodes: Sequence[int]) -> int:
        """Return how many of the accepted nodes (root first) came from text lookup."""
        first, end = self.lookup_from, self.forced_from
        return 0 if first is None else sum(1 for n in nodes[1:] if n >= first and (end is None or n < end))

    def forced_tokens(self, nodes: Sequence[int]) -> int:
        """Return how many of the accepted nodes (root first) a grammar forced (no drafter proposed them)."""
        first = self.forced_from
        return 0 if first is None else sum(1 for n in nodes[1:] if n >= first)

    def path_ranks(self, nodes: Sequence[int]) -> tuple[int, ...]:
        """Return calibration ranks of the accepted nodes (best-first drafters only; else empty)."""
        return ()


class Drafter(Protocol):
    """Proposes trees for the speculative decoder and follows what the target accepted."""

    def propose(self, committed: Sequence[int], root: int, budget: int, depth: int) -> Proposal | None:
        """Return a tree of at most `budget` nodes below `root`, at most `depth` deep (None: nothing
        to propose; the step then decodes the root alone). `committed` is the text in the
        target's cache, before the root."""
        ...

    def commit(self, proposal: Proposal, accepted_nodes: Sequence[int]) -> None:
        """Take note that the target accepted the path `accepted_nodes` (root first) of `proposal`."""
        ...

    def reset(self) -> None:
        """Forget any cached state (after an error left the caches in an unknown state)."""
        ...

    # Optional: `observe(step)`, called with every Step the decoder made (its timings and tree
    # size), for drafters that adapt to what this run measures (lookup, hybrid); `learn(text,
    # complete)`, called with prompt + answer when a generation ends (complete: the model ended
    # it, rather than a token limit), for drafters that index the text;
    # `start(n_prompt, max_tokens)`, called when a generation begins.
