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

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from specrun.core.sampling import log_softmax_topk
from specrun.core.tree import MAX_LEAVES, DraftTree
from specrun.core.tree_shapes import MAX_BUDGET, TreeShape
from specrun.decoding.calibration import DraftCalibration
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
# Nodes a draft pass expands at least while the target's pass runs elsewhere (extend): on a CPU a
# pass of four tokens costs little more than one.
_EXTEND_WIDTH = 4
# Tokens a pass of read_ahead decodes: one such pass is what may outlast the target's pass it
# runs beside (8 tokens of the demo draft on one core of the test CPU: about 50 ms).
READ_AHEAD = 8


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
        return GrownTree(tree, self.draft_s, self.draft_passes, reused=self.reused, node_seq=node_seq)

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


@dataclass(eq=False)
class _Live:
    """A tree as the draft grew it, before its cut: which nodes it expanded, the sequence that
    holds each expanded node's path, the position of its root, and the budget and depth it was
    grown for; `anchor`: after a commit, the last accepted node, whose branches were kept. Per
    node too, the draft's own log-prob for it (`own`; the tree scores it calibrated) and whether
    it was the draft's first choice there (`first`)."""

    tree: DraftTree
    expanded: np.ndarray
    node_seq: dict[int, int]
    p0: int
    budget: int = 0
    depth: int = 0
    anchor: int | None = None
    own: np.ndarray = field(default_factory=lambda: np.zeros(64))
    first: np.ndarray = field(default_factory=lambda: np.zeros(64, bool))

    def marks(self) -> np.ndarray:
        """`expanded`, as long as the tree at least (the nodes added since are not expanded)."""
        n = len(self.tree)
        if n > len(self.expanded):
            size = max(n, 2 * len(self.expanded))
            self.expanded, self.own, self.first = (_longer(a, size) for a in (self.expanded, self.own, self.first))
        return self.expanded

    def add_children(self, parents, ids: np.ndarray, lps: np.ndarray, calibration: DraftCalibration) -> None:
        """Expand `parents` with the draft's best children (rows of ids and log-probs, best first),
        scored by `calibration`."""
        new = self.tree.expand(parents, ids, calibration.scores(lps))
        self.marks()[parents] = True
        self.own[new] = lps
        self.first[new] = np.arange(ids.shape[1]) == 0

    def judge(self, node: int, token: int, calibration: DraftCalibration) -> None:
        """The target chose `token` after `node`: tell `calibration` how the draft's children there fared."""
        children = self.tree.children(node)
        if children:
            calibration.judge(self.own[children], self.first[children], self.tree.tokens[children] == token)

    def below(self, node: int, p0: int) -> tuple[_Live, np.ndarray]:
        """The part below `node`, rooted there at position `p0`, and its nodes' old ids (their
        sequences not carried over: `node_seq` is for the caller to fill)."""
        tree, old = self.tree.subtree(node)
        self.marks()
        return _Live(tree, self.expanded[old], {}, p0, own=self.own[old], first=self.first[old]), old


def _longer(a: np.ndarray, size: int) -> np.ndarray:
    out = np.zeros(size, a.dtype)
    out[: len(a)] = a
    return out


class TreeGrower(ModelDrafter):
    """A drafter that grows trees best-first with the draft model, its KV cache in step with the target."""

    def __init__(self, model, ctx: Context, shape: TreeShape, lane: Lane | None = None):
        self.model = model
        self.ctx = ctx
        self.shape = shape
        self.lane = lane if lane is not None else Lane(ctx)
        self.cache = CachedSequence(ctx, Batch(ctx.n_batch, 1), self.lane)
        self.batch = Batch(min(ctx.n_batch, max(shape.width, _EXTEND_WIDTH)), 1)
        self._free_seqs: list[int] = []
        self._used_seqs: list[int] = []
        self.p0 = 0
        self.last_catch_up = (0, 0.0)  # (tokens, seconds) the last proposal's catch-up decoded
        self.last_passes: list[tuple[int, float]] = []  # (tokens, seconds) of its expansion passes
        self.last_shared = False  # whether a pass of the last proposal held other requests' trees too
        self._live: _Live | None = None  # the last tree as grown (uncut), while it may serve the next
        self.extended = 0  # tree nodes grown while the target's pass ran elsewhere (extend)
        # The least depth `extend` grows a tree to (else twice the verified depth, and one):
        # GrowingTrees.overlaps sets it, so that a short chain's pass prepares a longer chain's look.
        self.extend_depth = 0
        # How often the target takes the draft's children, by the draft's probability: what the
        # tree's nodes are scored by (kept across answers: it measures the pair, not the text).
        self.calibration = DraftCalibration()
        self.prepared = 0  # prompt tokens read while the target's prefill ran elsewhere (prepare)
        self.last_read: list[tuple[int, float]] = []  # (tokens, seconds) of the last read_ahead's passes

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

    def _pass(self, n_tokens: int) -> tuple[np.ndarray, float]:
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
        """Return a tree of at most `budget` nodes below `root`, at most `depth` deep: the part of
        the last tree below `root` where the target's pass took a path that tree had grown (its
        nodes and their cache kept), grown on from there; else a tree grown from the root."""
        self.p0 = p0 = len(committed)
        live = self._reused(committed, root)
        reused = 0 if live is None else len(live.tree) - 1
        t0 = time.perf_counter()
        if live is None:
            tree = DraftTree(root, capacity=min(4 * budget + 8, 4 * MAX_BUDGET))
            live = _Live(tree, np.zeros(64, bool), {0: self.lane.base}, p0)
            row = self._catch_up(committed, root)
            ids, lps = log_softmax_topk(row[None, :], min(self.shape.top_k, budget))
            live.add_children([0], ids, lps, self.calibration)
            passes = 1
        else:
            self.last_shared, self.last_catch_up, self.last_passes = self.lane.sharing, (0, 0.0), []
            passes = 0
        draft_s = time.perf_counter() - t0
        room = self.lane.n_ctx - (p0 + 1) - len(live.node_seq) + 1
        while room > 0:
            grew = self._expand(live, budget, depth, min(self.shape.width, room), min(self.shape.top_k, budget))
            if not grew:
                break
            draft_s += self.lane.pass_s
            passes += 1
            room -= grew
        live.budget, live.depth = budget, depth
        self._live = live
        tree = live.tree.copy()
        kept = np.arange(len(tree))
        if self.shape.is_chain and len(tree) - 1 > min(budget, depth):
            # A chain is the draft's first choice at every node (what extend added beside it waits
            # for a path the target may take instead).
            on_path = np.zeros(len(tree), bool)
            on_path[tree.best_path()[: min(budget, depth) + 1]] = True
            kept = tree.keep(on_path)
        if tree.max_depth > depth:  # (a tree taken from the last one may reach deeper)
            kept = kept[tree.prune_deeper(depth)]
        kept = kept[tree.prune_to_best(budget)]
        while len(tree.leaves()) > MAX_LEAVES:
            # The worst-scored nodes are leaves (a parent outscores its children): drop them
            # until one target pass can give every leaf its own sequence.
            n_over = len(tree.leaves()) - MAX_LEAVES
            kept = kept[tree.prune_to_best(len(tree) - 1 - n_over)]
        new_id = {int(old): new for new, old in enumerate(kept.tolist())}
        node_seq = {new_id[old]: seq for old, seq in live.node_seq.items() if old in new_id}
        return GrownTree(tree, draft_s, passes, reused=reused, node_seq=node_seq)

    def prepare(self, text: Sequence[int], done: threading.Event) -> None:
        """Read `text` into the draft cache, a batch at a time, until all of it is read or the
        target's pass over it ends (`done`); the first proposal catches up with the rest. The
        prompt's catch-up then costs no step anything: a 150-token prompt took the draft 0.7 s on
        one core, which the target's prefill 50 ms away left idle. Beside other requests only
        within a pass of the target's that holds this prompt alone (batching.PassGate._run), where
        every request waits for it: the draft's passes then run at once, not through its gate."""
        if not self.lane.may_run_alone:
            return
        with self.lane.alone():
            keep = self._agreeing(text)
            self.cache.extend(text[keep:], until=done)
            self.prepared += len(self.cache.tokens) - keep

    def read_ahead(self, text: Sequence[int], done: threading.Event, fits: Callable[[], int] | None = None) -> None:
        """Read `text` into the draft cache, a short pass at a time, until all of it is read or
        `done` is set: while a step that leans on lookup waits for the target's pass elsewhere,
        the text the draft has not read (and the lookup tree's best path, which the target may
        take), so that a later drafting step's catch-up is short (a rewrite's 26 copied tokens
        took the demo draft 375 ms in series with the passes, 50 ms from the worker). What the
        target does not take is cut at the next catch-up (CachedSequence.sync keeps what agrees).
        `fits()`: the tokens the next pass may hold and still end within the target's (0: stop);
        else READ_AHEAD. The passes are noted in `last_read` ((tokens, seconds) each)."""
        self.last_read = []
        if not self.lane.may_run_alone:
            return
        with self.lane.alone():
            keep = self._agreeing(text)
            while keep < len(text) and not done.is_set():
                n = min(READ_AHEAD, fits()) if fits is not None else READ_AHEAD
                if n < 1:
                    break
                self.cache.extend(text[keep : keep + n])
                self.last_read.append((len(self.cache.tokens) - keep, self.lane.pass_s))
                keep = len(self.cache.tokens)

    def _agreeing(self, text: Sequence[int]) -> int:
        """Cut the draft cache to the part that agrees with `text` (the last tree forgotten);
        return its length."""
        self._drop_tree()
        keep = self.cache.reusable(text)
        self.cache.truncate(keep)
        return keep

    def extend(self, done: threading.Event) -> None:
        """Grow the last tree on, best first, until the target's pass over its cut ends (`done`):
        where the target takes a path this part holds, the next proposal starts from it (SpecExec's
        regime: a pass that runs elsewhere leaves this machine's cores idle). Deeper than the tree
        verified and two children a node, at least four nodes a pass."""
        live = self._live
        if live is None or live.anchor is not None:
            return
        if not self.lane.may_run_alone:
            return
        with self.lane.alone():
            self._extend(live, done)

    def _extend(self, live: _Live, done: threading.Event) -> None:
        budget = 4 * live.budget + 32
        depth = min(max(2 * live.depth + 1, self.extend_depth), self.lane.n_ctx - live.p0 - 2)
        width, top_k = max(self.shape.width, _EXTEND_WIDTH), self.shape.top_k
        room = self.lane.n_ctx - (live.p0 + 1) - len(live.node_seq) + 1
        while room > 0 and not done.is_set():
            grew = self._expand(live, budget, depth, min(width, room), top_k)
            if not grew:
                break
            room -= grew
            self.extended += grew

    def _expand(self, live: _Live, budget: int, depth: int, width: int, top_k: int) -> int:
        """Expand the best open nodes of the live tree in one draft pass (at most `width`, none
        that cannot reach its best `budget` nodes or lies `depth` deep); return how many."""
        tree, ctx = live.tree, self.ctx
        n = len(tree)
        logps, depths = tree.logps, tree.depths
        open_ = ~live.marks()[:n] & (depths < depth)
        if n - 1 >= budget:
            # A node's children score below it, so only nodes above the budget-th best score
            # can still add a node to the best `budget` (already when the tree is just full).
            threshold = -np.partition(-logps[1:], budget - 1)[budget - 1]
            open_ &= logps > threshold
        candidates = np.flatnonzero(open_)
        width = min(width, len(self._free_seqs), self.batch.capacity)
        if len(candidates) == 0 or width < 1:
            return 0
        if len(candidates) > width:
            best = np.argpartition(-logps[candidates], width - 1)[:width]
            candidates = candidates[best]
        seqs = [self._free_seqs.pop() for _ in candidates]
        parents = tree.parents
        for node, seq in zip(candidates.tolist(), seqs):
            ctx.seq_cp(live.node_seq[int(parents[node])], seq, -1, -1)
            live.node_seq[node] = seq
        self._used_seqs.extend(seqs)
        self.batch.set_arrays(tree.tokens[candidates], live.p0 + depths[candidates], seqs, True)
        rows, _ = self._pass(len(candidates))
        ids, lps = log_softmax_topk(rows, top_k)
        live.add_children(candidates, ids, lps, self.calibration)
        return len(candidates)

    def commit(self, grown: GrownTree, accepted_nodes: Sequence[int]) -> None:
        """Keep the draft's cache of the accepted path, and of the parts of the tree that may
        hold the next root (the branches below the last accepted node); free every other tree
        sequence."""
        lane, live = self.lane, self._live
        tokens = grown.tree.tokens[list(accepted_nodes)].tolist()
        node = 0
        walked = live is not None and int(live.tree.tokens[0]) == tokens[0]
        if walked:
            # The accepted path in the tree as grown (the proposal is a cut of it, with lookup's
            # branches grafted on): as far as the draft decoded it.
            for token in tokens[1:]:
                live.judge(node, token, self.calibration)
                child = live.tree.find_child(node, token)
                if child is None or child not in live.node_seq:
                    break
                node = child
            deepest = int(live.tree.depths[node])
        else:
            deepest = 0
            for depth, n in enumerate(accepted_nodes):
                if n in grown.node_seq:
                    deepest = depth
        if deepest > 0:
            seq = live.node_seq[node] if walked else grown.node_seq[accepted_nodes[deepest]]
            self.ctx.seq_cp(seq, lane.base, self.p0 + 1, self.p0 + deepest + 1)
        self.cache.tokens.extend(tokens[1: deepest + 1])
        keep: set[int] = set()
        if walked and deepest == len(tokens) - 1:  # (the branches below the last accepted node)
            below = live.tree.subtree(node)[1][1:].tolist()
            keep = {live.node_seq[n] for n in below if n in live.node_seq}
        if keep:
            live.anchor = node
            for seq in self._used_seqs:
                if seq not in keep:
                    self.ctx.seq_rm(seq, -1, -1)
            self._used_seqs = sorted(keep)
        else:
            self._drop_tree()

    def _drop_tree(self) -> None:
        """Forget the last tree and free its sequences."""
        self._live = None
        if self._used_seqs:
            self.lane.keep(self.lane.base, used=max(self._used_seqs) - self.lane.base + 1)
        self._used_seqs = []

    def _reused(self, committed: Sequence[int], root: int) -> _Live | None:
        """The last tree's part below `root`, rooted there, with its nodes' cache (the root's
        cell copied into the committed sequence), where the last commit kept it and the text
        went on as it says; else None (every kept sequence freed)."""
        live, self._live = self._live, None
        kept, self._used_seqs = self._used_seqs, []
        self._free_seqs = self._tree_seqs()
        child = None
        cached, n = self.cache.tokens, len(committed)
        if live is not None and live.anchor is not None and len(cached) == n \
                and live.p0 + int(live.tree.depths[live.anchor]) + 1 == n \
                and cached[-_DEBT_CHECK:] == list(committed[-_DEBT_CHECK:]):
            live.judge(live.anchor, root, self.calibration)
            child = live.tree.find_child(live.anchor, root)
        if child is None or child not in live.node_seq:
            for seq in kept:
                self.ctx.seq_rm(seq, -1, -1)
            return None
        below, old = live.below(child, n)
        node_seq = below.node_seq
        node_seq.update((new, live.node_seq[o]) for new, o in enumerate(old.tolist()) if o in live.node_seq)
        root_seq = node_seq[0]
        self.ctx.seq_cp(root_seq, self.lane.base, n, n + 1)
        self.cache.tokens.append(root)
        node_seq[0] = self.lane.base
        carried = set(node_seq.values())
        for seq in kept:
            if seq not in carried:
                self.ctx.seq_rm(seq, -1, -1)
        self._used_seqs = sorted(carried - {self.lane.base})
        self._free_seqs = [s for s in self._free_seqs if s not in carried]
        return below

    def reset(self) -> None:
        """Forget the draft cache (e.g. after an error left it in an unknown state)."""
        self._live, self._used_seqs = None, []
        self.cache.clear()
