"""Growing a draft tree with the draft model (SpecExec-style best-first expansion).

The draft's KV cache holds the committed text in sequence 0, including the current root. Every
tree node the draft expands gets a sequence id of its own, copied from its parent's, so in one
batch each node sees exactly its ancestors. After verification the accepted path is copied into
sequence 0 and every other sequence is dropped: what the draft computed for the accepted path is
kept, the rest freed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np

from specrun.engine import MAX_SEQ, Batch, Context
from specrun.generate import CachedSequence
from specrun.sampling import log_softmax_topk
from specrun.tree import MAX_LEAVES, DraftTree

MAX_BUDGET = 2048  # nodes per tree; the target's n_batch is sized for budget + 1


@dataclass(frozen=True)
class TreeShape:
    """How big a tree to grow: node budget, depth limit, nodes expanded per draft pass, children each."""

    budget: int = 16
    depth: int = 8
    width: int = 4
    top_k: int = 4

    def __post_init__(self) -> None:
        from specrun.errors import UsageError

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


@dataclass
class GrownTree:
    """A pruned draft tree plus the draft-side bookkeeping needed to commit its accepted path."""

    tree: DraftTree
    node_seq: dict[int, int]  # node id (after pruning) -> draft sequence holding its path
    draft_s: float
    draft_passes: int

    def best_first_ranks(self, nodes) -> list[int]:
        """Return each node's 1-based rank by draft score (ties: lower id first); root excluded.

        A best-first tree with a smaller budget B' is the top-B' of this one, so the ranks on the
        accepted path tell how deep a smaller tree would have reached (one-run calibration).
        """
        logps = self.tree.logps
        out = []
        for node in nodes:
            if node == 0:
                continue
            above = int((logps[1:] > logps[node]).sum()) + int((logps[1:node] == logps[node]).sum())
            out.append(above + 1)
        return out


class TreeGrower:
    """Grows trees with the draft model and keeps the draft's KV cache in step with the target."""

    def __init__(self, model, ctx: Context, shape: TreeShape):
        self.model = model
        self.ctx = ctx
        self.shape = shape
        self.cache = CachedSequence(ctx, Batch(ctx.n_batch, 1))
        self.batch = Batch(min(ctx.n_batch, max(shape.width, 1)), 1)
        self._free_seqs: list[int] = []
        self._used_seqs: list[int] = []
        self.p0 = 0

    def _catch_up(self, committed: Sequence[int], root: int) -> np.ndarray:
        """Make the draft cache hold committed + root; return the draft's logits after the root."""
        cache = self.cache
        keep = 0
        limit = min(cache.n_cached, len(committed))
        while keep < limit and cache.tokens[keep] == committed[keep]:
            keep += 1
        cache.truncate(keep)
        cache.extend(list(committed[keep:]) + [root], want_last_logits=True)
        return self.ctx.logits_row(-1)

    def grow(self, committed: Sequence[int], root: int, budget: int, depth: int) -> GrownTree:
        """Return a tree of at most `budget` nodes below `root`, at most `depth` deep."""
        t_start = time.perf_counter()
        ctx, shape = self.ctx, self.shape
        self.p0 = p0 = len(committed)
        tree = DraftTree(root, capacity=min(4 * budget + 8, 4 * MAX_BUDGET))
        node_seq: dict[int, int] = {0: 0}
        t0 = time.perf_counter()
        row = self._catch_up(committed, root)
        draft_s = time.perf_counter() - t0
        passes = 1
        k = min(shape.top_k, budget)
        ids, lps = log_softmax_topk(row[None, :], k)
        tree.expand([0], ids, lps)
        expanded = np.zeros(tree_capacity := 64, bool)
        expanded[0] = True
        self._free_seqs = list(range(MAX_SEQ - 1, 0, -1))
        self._used_seqs = []
        room = ctx.n_ctx - (p0 + 1)
        while self._free_seqs and room > 0:
            n = len(tree)
            if n > tree_capacity:
                tree_capacity = max(2 * tree_capacity, n)
                expanded = np.concatenate([expanded, np.zeros(tree_capacity - len(expanded), bool)])
            logps, depths = tree.logps, tree.depths
            open_ = ~expanded[:n] & (depths < depth)
            if n - 1 >= budget:
                # A node's children score below it, so only nodes above the budget-th best score
                # can still add a node to the best `budget` (already when the tree is just full).
                threshold = -np.partition(-logps[1:], budget - 1)[budget - 1]
                open_ &= logps > threshold
            candidates = np.flatnonzero(open_)
            if len(candidates) == 0:
                break
            width = min(shape.width, len(self._free_seqs), room, self.batch.capacity)
            if len(candidates) > width:
                best = np.argpartition(-logps[candidates], width - 1)[:width]
                candidates = candidates[best]
            seqs = [self._free_seqs.pop() for _ in candidates]
            parents = tree.parents
            for node, seq in zip(candidates.tolist(), seqs):
                ctx.seq_cp(node_seq[int(parents[node])], seq, -1, -1)
                node_seq[node] = seq
            self._used_seqs.extend(seqs)
            self.batch.set_arrays(tree.tokens[candidates], p0 + depths[candidates], seqs, True)
            t0 = time.perf_counter()
            ctx.decode(self.batch)
            draft_s += time.perf_counter() - t0
            passes += 1
            room -= len(candidates)
            expanded[candidates] = True
            ids, lps = log_softmax_topk(ctx.logits(), k)
            tree.expand(candidates, ids, lps)
        kept = tree.prune_to_best(budget)
        while len(tree.leaves()) > MAX_LEAVES:
            # The worst-scored nodes are leaves (a parent outscores its children): drop them
            # until one target pass can give every leaf its own sequence.
            n_over = len(tree.leaves()) - MAX_LEAVES
            kept = kept[tree.prune_to_best(len(tree) - 1 - n_over)]
        new_id = {int(old): new for new, old in enumerate(kept.tolist())}
        node_seq = {new_id[old]: seq for old, seq in node_seq.items() if old in new_id}
        return GrownTree(tree, node_seq, draft_s, passes)

    def commit(self, grown: GrownTree, accepted_nodes: Sequence[int]) -> None:
        """Keep the draft's cache of the accepted path and free every other tree sequence."""
        tree, ctx = grown.tree, self.ctx
        deepest = 0
        for depth, node in enumerate(accepted_nodes):
            if node in grown.node_seq:
                deepest = depth
        if deepest > 0:
            seq = grown.node_seq[accepted_nodes[deepest]]
            ctx.seq_cp(seq, 0, self.p0 + 1, self.p0 + deepest + 1)
        if self._used_seqs:
            ctx.seq_keep(0)
        self._used_seqs = []
        self.cache.tokens.extend(int(tree.tokens[n]) for n in accepted_nodes[1 : deepest + 1])

    def reset(self) -> None:
        """Forget the draft cache (e.g. after an error left it in an unknown state)."""
        self.ctx.clear()
        self.cache.tokens.clear()
