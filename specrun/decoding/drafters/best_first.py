"""Growing a draft tree with the draft model (SpecExec-style best-first expansion).

The draft's KV cache holds the committed text in the first sequence of the drafter's lane (its
share of the draft context: all of it, unless several requests draft together and their draft
passes are shared, decoding.batching), including the current root. Every tree node the draft
expands gets a sequence id of its own, copied from its parent's, so in one batch each node sees
exactly its ancestors. After verification the accepted path is copied into the first sequence
and every other sequence is dropped: what the draft computed for the accepted path is kept, the
rest freed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from specrun.core.sampling import log_softmax_topk
from specrun.core.tree import MAX_LEAVES, DraftTree
from specrun.core.tree_shapes import MAX_BUDGET, TreeShape
from specrun.decoding.batching import Lane
from specrun.decoding.drafters.base import ModelDrafter, Proposal
from specrun.decoding.kv import CachedSequence, probe_passes
from specrun.engine import Batch, Context
from specrun.limits import MAX_SEQ

# Cached tokens compared with the text before trusting the cache to hold a prefix of it.
_DEBT_CHECK = 16
# Tokens of the timed pass that prices the draft's catch-up (TreeGrower.probe): past a
# dozen tokens a pass costs about the same per token on a CPU as over hundreds.
_PROBE_TOKENS = 16


@dataclass
class GrownTree(Proposal):
    """A pruned draft tree plus the draft-side bookkeeping needed to commit its accepted path."""

    # node id (after pruning) -> draft sequence holding its path (only nodes the draft decoded)
    node_seq: dict[int, int] = field(default_factory=dict)

    def cut(self, budget: int) -> GrownTree:
        """This proposal cut to its `budget` best nodes (a copy; the draft's sequences of the nodes
        cut stay in use until the commit frees every tree sequence)."""
        tree = self.tree.copy()
        kept = tree.prune_to_best(budget)
        new_id = {int(old): new for new, old in enumerate(kept.tolist())}
        node_seq = {new_id[old]: seq for old, seq in self.node_seq.items() if old in new_id}
        return GrownTree(tree, self.draft_s, self.draft_passes, node_seq=node_seq)

    def path_ranks(self, nodes) -> tuple[int, ...]:
        return tuple(self.best_first_ranks(nodes))

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


class TreeGrower(ModelDrafter):
    """A drafter that grows trees best-first with the draft model, its KV cache in step with the target."""

    def __init__(self, model, ctx: Context, shape: TreeShape, lane: Lane | None = None):
        self.model = model
        self.ctx = ctx
        self.shape = shape
        self.lane = lane if lane is not None else Lane(ctx)
        self.cache = CachedSequence(ctx, Batch(ctx.n_batch, 1), self.lane)
        self.batch = Batch(min(ctx.n_batch, max(shape.width, 1)), 1)
        self._free_seqs: list[int] = []
        self._used_seqs: list[int] = []
        self.p0 = 0
        self.last_catch_up = (0, 0.0)  # (tokens, seconds) the last proposal's catch-up decoded
        self.last_passes: list[tuple[int, float]] = []  # (tokens, seconds) of its expansion passes
        self.last_shared = False  # whether a pass of the last proposal held other requests' trees too

    @property
    def drafts_beside_others(self) -> bool:
        return self.lane.gate is not None

    def attach(self, lane: Lane) -> None:
        self.lane.owner = lane.owner

    def debt(self, committed: Sequence[int], root: int) -> int:
        """Return how many tokens the next proposal's catch-up would decode (the root included)."""
        cached = self.cache.tokens
        n = len(cached)
        # Within an answer the cache holds a prefix of the text: its last tokens tell (cheaply).
        if 0 < n <= len(committed) and cached[-_DEBT_CHECK:] == list(committed[max(0, n - _DEBT_CHECK) : n]):
            return len(committed) + 1 - n
        text = [*committed, root]
        return len(text) - self.cache.reusable(text)

    def probe(self) -> dict[int, float] | None:
        """Return {tokens: seconds} of the draft's passes over one token (an expansion pass, its
        top-k included) and over _PROBE_TOKENS (a catch-up), timed now (None when the cache holds
        text: the probe needs it empty, and leaves it so). The least of two timings each, as the
        target's are (runtime.drafters): a pass of a few ms timed once can meet a scheduler
        hiccup, and this figure decides whether the draft model drafts at all."""
        seconds = probe_passes(self.cache, (1, _PROBE_TOKENS), repeats=2)
        if not seconds:
            return None
        row = self.ctx.logits_row(-1)[None, :]
        top_k_s = []
        for _ in range(2):
            t0 = time.perf_counter()
            log_softmax_topk(row, self.shape.top_k)
            top_k_s.append(time.perf_counter() - t0)
        seconds[min(seconds)] += min(top_k_s)
        return seconds

    def _catch_up(self, committed: Sequence[int], root: int) -> np.ndarray:
        """Make the draft cache hold committed + root; return the draft's logits after the root."""
        _, tokens, seconds = self.cache.sync([*committed, root], include_last=True)
        # (A prompt's chunks run in passes of their own, but wait for other requests' between them.)
        self.last_shared = self.lane.sharing
        self.last_catch_up = (tokens, seconds)
        self.last_passes = []
        return self.cache.logits

    def _expand(self, n_tokens: int) -> tuple[np.ndarray, float]:
        """Decode the batch of n_tokens tree nodes; return their logits rows and the pass's seconds
        (llama.cpp's, not a wait for other requests' passes), noted too."""
        rows = self.lane.run(self.batch)
        seconds = self.lane.pass_s
        self.last_shared |= self.lane.shared > 1
        self.last_passes.append((n_tokens, seconds))
        return rows, seconds

    def _tree_seqs(self) -> list[int]:
        """The lane's sequences a tree's nodes may take, the next to take last (the committed text
        keeps the first)."""
        seqs = self.lane.seqs
        return list(seqs[1: MAX_SEQ])[::-1]

    def propose(self, committed: Sequence[int], root: int, budget: int, depth: int) -> GrownTree:
        """Return a tree of at most `budget` nodes below `root`, at most `depth` deep."""
        ctx, shape = self.ctx, self.shape
        self.p0 = p0 = len(committed)
        tree = DraftTree(root, capacity=min(4 * budget + 8, 4 * MAX_BUDGET))
        node_seq: dict[int, int] = {0: self.lane.base}
        t0 = time.perf_counter()
        row = self._catch_up(committed, root)
        draft_s = time.perf_counter() - t0
        passes = 1
        k = min(shape.top_k, budget)
        ids, lps = log_softmax_topk(row[None, :], k)
        tree.expand([0], ids, lps)
        expanded = np.zeros(tree_capacity := 64, bool)
        expanded[0] = True
        # A draft with a recurrent state keeps one state per sequence: its context has few.
        self._free_seqs = self._tree_seqs()
        self._used_seqs = []
        room = self.lane.n_ctx - (p0 + 1)
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
            rows, seconds = self._expand(len(candidates))
            draft_s += seconds
            passes += 1
            room -= len(candidates)
            expanded[candidates] = True
            ids, lps = log_softmax_topk(rows, k)
            tree.expand(candidates, ids, lps)
        kept = tree.prune_to_best(budget)
        while len(tree.leaves()) > MAX_LEAVES:
            # The worst-scored nodes are leaves (a parent outscores its children): drop them
            # until one target pass can give every leaf its own sequence.
            n_over = len(tree.leaves()) - MAX_LEAVES
            kept = kept[tree.prune_to_best(len(tree) - 1 - n_over)]
        new_id = {int(old): new for new, old in enumerate(kept.tolist())}
        node_seq = {new_id[old]: seq for old, seq in node_seq.items() if old in new_id}
        return GrownTree(tree, draft_s, passes, node_seq=node_seq)

    def commit(self, grown: GrownTree, accepted_nodes: Sequence[int]) -> None:
        """Keep the draft's cache of the accepted path and free every other tree sequence."""
        tree, lane = grown.tree, self.lane
        deepest = 0
        for depth, node in enumerate(accepted_nodes):
            if node in grown.node_seq:
                deepest = depth
        if deepest > 0:
            seq = grown.node_seq[accepted_nodes[deepest]]
            self.ctx.seq_cp(seq, lane.base, self.p0 + 1, self.p0 + deepest + 1)
        if self._used_seqs:
            lane.keep(lane.base, used=max(self._used_seqs) - lane.base + 1)
        self._used_seqs = []
        self.cache.tokens.extend(int(tree.tokens[n]) for n in accepted_nodes[1 : deepest + 1])

    def reset(self) -> None:
        """Forget the draft cache (e.g. after an error left it in an unknown state)."""
        self.cache.clear()
