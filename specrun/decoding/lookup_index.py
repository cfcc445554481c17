"""Lookup drafting: draft trees from what followed earlier occurrences of the latest tokens.

No model runs. An n-gram index over the session's text (prompts, generated text, earlier turns)
finds where the last few tokens occurred before; the tokens that followed each occurrence are
candidate continuations. They are merged into a trie under the pending root token, so several
different continuations become several branches and continuations that share a prefix share
nodes. The target verifies the tree like any other (verify.py), so the output stays exactly the
target's; lookup only decides how far one target pass reaches.

The index is zlib's hash chain, once per n-gram order: `heads[bucket]` holds the newest position
whose n-gram hashes to `bucket`, `prev[position]` the one before it. Extending indexes only the
new positions (vectorised); a proposal walks at most `max_matches` verified occurrences per
order, so its work does not grow with the history.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from specrun.core.tree import MAX_LEAVES, DraftTree

ORDERS = (4, 3, 2, 1)  # n-gram lengths looked up, longest first
# One occurrence of an n-gram one token longer counts as much as this many of the shorter one:
# a long match predicts its continuation far better than the last token alone does.
ORDER_WEIGHT = 4.0
MAX_MATCHES = 64  # occurrences read per proposal, newest first: bounds the work of one step
MAX_TOKENS = 1 << 16  # history kept; older text is forgotten (memory bound: see LookupIndex)
# Score charged per token of depth (log 0.8): a continuation that followed once is not certain
# to follow again, and the further it reaches the less so. The decoder may adapt it.
TOKEN_LOGP = math.log(0.8)
# Tokens a match is measured over, backward from the latest token (`match_lengths`): how much of
# the text before a proposal's occurrences equals the text now (decoding.adaptive.REPEAT_MATCH).
MATCH_SPAN = 64

_SEPARATOR = -1  # ends a stretch of history: no n-gram and no continuation crosses it
_MIN_CAPACITY = 1024
_VISITS_PER_MATCH = 4  # chain steps allowed per wanted match (hash collisions cost steps)
_SMALL_APPEND = 8  # appends up to this many tokens are indexed by a plain loop (cheaper than numpy)
_POLY = 1_000_003
_FIBONACCI = 0x9E3779B97F4A7C15  # multiplicative hashing: the top bits of key * this are the bucket
_MASK64 = (1 << 64) - 1


def _buckets(tokens: np.ndarray, ends: np.ndarray, n: int, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """Return (bucket, valid) for the n-grams tokens[end - n + 1 .. end] of each end.

    An n-gram is valid when it lies inside `tokens` and holds no separator.
    """
    key = np.zeros(len(ends), np.uint64)  # uint64 arrays wrap around, like _bucket's mask
    valid = ends >= n - 1
    for back in range(n):
        token = tokens[np.maximum(ends - back, 0)]
        valid &= token >= 0
        key = key * np.uint64(_POLY) + (token.astype(np.int64) + 1).astype(np.uint64)
    return (key * np.uint64(_FIBONACCI)) >> np.uint64(64 - bits), valid


def _bucket(ngram: list[int], bits: int) -> int:
    """The bucket of one n-gram (its tokens oldest first): `_buckets` for a single n-gram."""
    key = 0
    for token in reversed(ngram):
        key = (key * _POLY + token + 1) & _MASK64
    return ((key * _FIBONACCI) & _MASK64) >> (64 - bits)


class LookupIndex:
    """An incrementally maintained n-gram index over a session's token history.

    The history is append-only: the text the caller commits (`sync`, `extend`), in stretches.
    When the caller's sequence is rewound or replaced (a new prompt sharing only a prefix with
    the last one), the old text stays in the history, usable for lookup, and the new tokens start
    a new stretch after a separator, preceded by a copy of the last `max(orders)` shared tokens,
    so that n-grams reaching back into the shared prefix are found with their new continuation.

    Memory bound: at most `max_tokens` history tokens are kept (the oldest quarter is forgotten
    when full). With C = the next power of two >= the tokens kept (at least 1024), the index holds
    C * (5 + 8 * len(orders)) bytes: history (int32) + an indexed flag (bool) + per order a
    bucket table and a chain link per position (int32 each); plus the caller's current sequence
    (int32, which the model's context length bounds). `nbytes()` reports the total.
    """

    def __init__(self, orders: Sequence[int] = ORDERS, max_tokens: int = MAX_TOKENS, max_matches: int = MAX_MATCHES):
        self.orders = tuple(sorted(set(int(n) for n in orders), reverse=True))
        if not self.orders or self.orders[-1] < 1:
            raise ValueError(f"n-gram orders must be >= 1, got {orders}")
        if max_tokens < 2 * self.orders[0]:
            raise ValueError(f"max_tokens must be at least {2 * self.orders[0]}, got {max_tokens}")
        if max_matches < 1:
            raise ValueError(f"max_matches must be >= 1, got {max_matches}")
        self.max_tokens = max_tokens
        self.max_matches = max_matches
        self._n = 0  # history length
        self._allocate(_MIN_CAPACITY)
        self._live = np.empty(_MIN_CAPACITY, np.int32)  # the caller's current sequence
        self._n_live = 0
        self._live_at_end = True  # the history ends with the live sequence: appends continue it
        self.last_order = 0  # the longest n-gram order the last proposal matched, or its memory match (0: none)
        # How many tokens before the last proposal's best occurrence, here or in the memory, equal
        # the latest ones (up to MATCH_SPAN; 0: none): the same prompt again matches all of them.
        self.last_match = 0

    def __len__(self) -> int:
        """Tokens of history kept (separators and context copies included)."""
        return self._n

    @property
    def live(self) -> np.ndarray:
        """The caller's current sequence, as last synced or extended (a view: do not modify)."""
        return self._live[: self._n_live]

    def nbytes(self) -> int:
        """Return the bytes the index's arrays hold."""
        arrays = [self._hist, self._indexed, self._live, *self._heads.values(), *self._prev.values()]
        return sum(a.nbytes for a in arrays)

    # --- telling the index what is new -------------------------------------------------------

    def sync(self, tokens: Sequence[int]) -> int:
        """Make `tokens` the current sequence, indexing what differs from the last one; return how
        many tokens were new.

        The common case appends (the same sequence plus tokens): only the tail is indexed. When
        `tokens` rewinds or replaces the last sequence, the old text stays indexed and the tokens
        after the shared prefix start a new stretch. Costs one vectorised comparison with the
        last sequence; callers that know they only append can call `extend` instead.
        """
        tokens = self._as_tokens(tokens)
        shared = min(len(tokens), self._n_live)
        differ = np.flatnonzero(self._live[:shared] != tokens[:shared])
        keep = int(differ[0]) if len(differ) else shared
        if keep < self._n_live:
            self._n_live = keep
            self._live_at_end = False
        self.extend(tokens[keep:])
        return len(tokens) - keep

    def extend(self, tokens: Sequence[int]) -> None:
        """Append tokens to the current sequence and index them."""
        tokens = self._as_tokens(tokens)
        if len(tokens) == 0:
            return
        if not self._live_at_end:
            # A rewound sequence goes on: a new stretch, led by the shared tokens its n-grams need.
            # Only the last of them is indexed again: what follows it now is new; what followed
            # the ones before it is indexed already.
            context = self._live[max(0, self._n_live - self.orders[0]) : self._n_live]
            self._append(np.array([_SEPARATOR], np.int32), indexed=False)
            if len(context):
                self._append(context[:-1], indexed=False)
                self._append(context[-1:], indexed=True)
            self._live_at_end = True
        self._append(tokens, indexed=True)
        self._grow_live(self._n_live + len(tokens))
        self._live[self._n_live : self._n_live + len(tokens)] = tokens
        self._n_live += len(tokens)

    def add_text(self, tokens: Sequence[int], unindexed: int = 0) -> None:
        """Index `tokens` as a stretch of their own, apart from the current sequence (which the
        next `extend` continues in a stretch of its own too). The first `unindexed` of them are
        kept without an n-gram ending at them: a match is measured back through them
        (`match_lengths`), but they are never looked up."""
        tokens = self._as_tokens(tokens)
        if len(tokens) == 0:
            return
        self._append(np.array([_SEPARATOR], np.int32), indexed=False)
        self._append(tokens[:unindexed], indexed=False)
        self._append(tokens[unindexed:], indexed=True)
        self._live_at_end = False

    def history(self) -> np.ndarray:
        """Return a copy of the history kept (what `restore` takes): tokens, -1 between stretches,
        and -2 - t for a token t kept unindexed."""
        history = self._hist[: self._n].copy()
        unindexed = ~self._indexed[: self._n] & (history >= 0)
        history[unindexed] = -2 - history[unindexed]
        return history

    def restore(self, history: np.ndarray) -> None:
        """Index a history as `history` returned it (its stretches apart), after what is kept."""
        history = np.asarray(history, np.int32)
        indexed = history >= _SEPARATOR
        tokens = np.where(indexed, history, -2 - history).astype(np.int32)
        self._append(tokens, indexed=indexed)  # (no n-gram holds a separator, nor follows one)
        self._live_at_end = False

    # --- proposing -----------------------------------------------------------------------------

    def propose(self, context: Sequence[int], budget: int, depth: int, token_logp: float = TOKEN_LOGP,
                max_leaves: int = MAX_LEAVES, memory=None) -> DraftTree | None:
        """Return a draft tree below context[-1] built from earlier occurrences, or None.

        `context` is the committed text ending in the pending root token; only its last
        max(orders) tokens are read. Occurrences are sought for the longest order first; shorter
        orders add theirs while fewer than `max_matches` were found. Each occurrence contributes
        the up to `depth` tokens that followed it (never past a stretch's end). A node's score
        (stored as its logp) is log(weight of the occurrences through it / weight of all) +
        depth * token_logp, where an occurrence found at order n weighs ORDER_WEIGHT**(n-1). It
        falls along every path, so the tree keeps the `budget` best nodes (and at most
        `max_leaves` leaves), as `DraftTree.prune_to_best` would. None when nothing matched.

        `memory` (decoding.memory.OutputMemory): earlier answers of other requests, whose
        continuations (`memory.continuations`) join this index's in the same trie, weighed on the
        same scale.
        """
        self.last_order = self.last_match = 0
        if budget < 1 or depth < 1 or len(context) == 0:
            return None
        query = np.asarray(context[-self.orders[0] :], np.int64)
        positions, orders = self._matches(query)
        rows = np.empty((0, depth), np.int64)
        weights = np.empty(0)
        if len(positions):
            self.last_order = int(orders.max())
            self.last_match = int(self.match_lengths(positions, context, MATCH_SPAN).max())
            rows, weights = self.continuations(positions, ORDER_WEIGHT ** (orders - 1), depth)
        if memory is not None:
            more, more_weights, order, whole = memory.continuations(context, depth)
            if len(more):
                rows, weights = np.concatenate([rows, more]), np.concatenate([weights, more_weights])
                self.last_order = max(self.last_order, order)
                self.last_match = max(self.last_match, whole)
        if len(rows) == 0:
            return None
        parents, tokens, scores = _trie(rows, weights, token_logp)
        keep = _best_nodes(parents, scores, budget, max_leaves)
        return _build_tree(int(context[-1]), parents, tokens, scores, keep)

    def match_order(self, context: Sequence[int], at_least: int = 1) -> int:
        """The longest order, `at_least` or more, at which the n-gram ending `context` occurred
        earlier (with a token after it): what `propose` would report as `last_order`, for a few
        hash probes instead of a tree. 0 when there is none."""
        query = np.asarray(context[-self.orders[0] :], np.int64)
        for n in self.orders:
            if at_least <= n <= len(query) and next(self._occurrences(query, n, 1, ()), None) is not None:
                return n
        return 0

    def _matches(self, query: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Return history positions where a suffix of `query` ended, newest first per order, and
        the longest order that matched at each."""
        found: dict[int, int] = {}
        for n in self.orders:
            if len(query) < n or len(found) >= self.max_matches:
                continue
            for position in self._occurrences(query, n, self.max_matches - len(found), found):
                found[position] = n
        positions = np.fromiter(found.keys(), np.int64, len(found))
        return positions, np.fromiter(found.values(), np.float64, len(found))

    def _occurrences(self, query: np.ndarray, n: int, wanted: int, skip):
        """Yield up to `wanted` history positions, newest first, where query's last n tokens
        ended earlier with a token after them, leaving out those in `skip`."""
        hist, n_hist = self._hist, self._n
        ngram = query[-n:].tolist()
        prev = self._prev[n]
        position = int(self._heads[n][_bucket(ngram, self._bits)])
        visits = _VISITS_PER_MATCH * self.max_matches
        while position >= 0 and visits > 0 and wanted > 0:
            visits -= 1
            # Same bucket is not same n-gram: compare the tokens. The occurrence that is the
            # query itself (at the end of the history) has no continuation yet: skip it.
            if position + 1 < n_hist and position not in skip and hist[position - n + 1 : position + 1].tolist() == ngram:
                wanted -= 1
                yield position
            position = int(prev[position])

    def occurrences(self, context: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """Return the history positions (with a token after them) where a suffix of `context`
        ended earlier, and the longest order that matched at each (what `propose` reads)."""
        return self._matches(np.asarray(context[-self.orders[0] :], np.int64))

    def match_lengths(self, positions: np.ndarray, context: Sequence[int], longest: int,
                      indexed_only: bool = False) -> np.ndarray:
        """Return, per history position, how many tokens ending there equal the end of `context`
        (at most `longest`; never across a stretch's start, nor, `indexed_only`, into tokens kept
        unindexed: add_text)."""
        back = np.arange(min(longest, len(context)))
        tail = np.asarray(context[len(context) - len(back) :], np.int64)[::-1]
        index = positions[:, None] - back
        same = (index >= 0) & (self._hist[np.maximum(index, 0)] == tail)
        if indexed_only:
            same &= self._indexed[np.maximum(index, 0)]
        return np.logical_and.accumulate(same, axis=1).sum(axis=1)

    def continuations(self, positions: np.ndarray, weights: np.ndarray, depth: int) -> tuple[np.ndarray, np.ndarray]:
        """Return the tokens that followed each position [m, depth] (-1 past the end) and their
        weights, leaving out positions nothing followed."""
        index = positions[:, None] + 1 + np.arange(depth)
        inside = index < self._n
        rows = self._hist[np.minimum(index, self._n - 1)].astype(np.int64)
        valid = np.logical_and.accumulate(inside & (rows >= 0), axis=1)
        rows[~valid] = -1
        some = valid[:, 0]
        return rows[some], weights[some]

    # --- storage ---------------------------------------------------------------------------------

    def _as_tokens(self, tokens: Sequence[int]) -> np.ndarray:
        tokens = np.asarray(tokens, np.int64).reshape(-1)
        if len(tokens) and tokens.min() < 0:
            raise ValueError("token ids must be >= 0")
        return tokens.astype(np.int32)

    def _allocate(self, capacity: int) -> None:
        """Size every array for `capacity` tokens (a power of two: also the bucket count)."""
        self._bits = capacity.bit_length() - 1
        for name, dtype in (("_hist", np.int32), ("_indexed", bool)):
            grown = np.zeros(capacity, dtype)
            if hasattr(self, name):
                grown[: self._n] = getattr(self, name)[: self._n]
            setattr(self, name, grown)
        self._heads = {n: np.full(capacity, -1, np.int32) for n in self.orders}
        self._prev = {n: np.full(capacity, -1, np.int32) for n in self.orders}

    def _grow_live(self, needed: int) -> None:
        if needed > len(self._live):
            grown = np.empty(max(needed, 2 * len(self._live)), np.int32)
            grown[: self._n_live] = self._live[: self._n_live]
            self._live = grown

    def _append(self, values: np.ndarray, indexed: bool | np.ndarray) -> None:
        """Append values to the history, forgetting the oldest text when full, and index those
        `indexed` says (all, none, or one flag per value)."""
        values = values[-self.max_tokens :]
        if isinstance(indexed, np.ndarray):
            indexed = indexed[-self.max_tokens :]
        rebuild = False
        overflow = self._n + len(values) - self.max_tokens
        if overflow > 0:
            # Forget at least a quarter at once: the rebuild that follows is paid rarely.
            self._forget(min(self._n, max(overflow, self.max_tokens // 4)))
            rebuild = True
        needed = self._n + len(values)
        if needed > len(self._hist):
            self._allocate(1 << (needed - 1).bit_length())
            rebuild = True
        start = self._n
        self._hist[start:needed] = values
        self._indexed[start:needed] = indexed
        self._n = needed
        if rebuild:
            for n in self.orders:
                self._heads[n].fill(-1)
            start = 0
        if self._n - start <= _SMALL_APPEND:
            self._index_few(start)
        else:
            self._index(start)

    def _index_few(self, start: int) -> None:
        """`_index` for a few positions (one decoding step's tokens), without numpy overhead."""
        reach = self.orders[0] - 1
        first = max(0, start - reach)
        window = self._hist[first : self._n].tolist()
        indexed = self._indexed[start : self._n].tolist()
        for n in self.orders:
            heads, prev = self._heads[n], self._prev[n]
            for end in range(max(start, n - 1), self._n):
                ngram = window[end - n + 1 - first : end + 1 - first]
                if indexed[end - start] and min(ngram) >= 0:
                    bucket = _bucket(ngram, self._bits)
                    prev[end] = heads[bucket]
                    heads[bucket] = end

    def _forget(self, count: int) -> None:
        """Drop the oldest `count` history tokens (the caller rebuilds the chains)."""
        keep = self._n - count
        self._hist[:keep] = self._hist[count : self._n].copy()
        self._indexed[:keep] = self._indexed[count : self._n].copy()
        self._n = keep

    def _index(self, start: int) -> None:
        """Link every indexed position from `start` on into its order's hash chain."""
        hist = self._hist[: self._n]
        ends = np.arange(start, self._n)
        for n in self.orders:
            buckets, valid = _buckets(hist, ends, n, self._bits)
            valid &= self._indexed[start : self._n]
            positions, buckets = ends[valid], buckets[valid]
            if len(positions) == 0:
                continue
            # Group positions by bucket (a stable sort keeps each group in history order): each
            # links to the one before it in its group, the first to the bucket's old head.
            order = np.argsort(buckets, kind="stable")
            buckets, positions = buckets[order], positions[order]
            first = np.ones(len(buckets), bool)
            first[1:] = buckets[1:] != buckets[:-1]
            heads, links = self._heads[n], np.empty(len(positions), np.int32)
            links[1:] = positions[:-1]
            links[first] = heads[buckets[first]]
            self._prev[n][positions] = links
            last = np.append(first[1:], True)
            heads[buckets[last]] = positions[last]


def _trie(rows: np.ndarray, weights: np.ndarray, token_logp: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merge continuations [m, depth] (-1 padded) into a trie; return per node (ids 1.., breadth
    first, so a parent precedes its children, and siblings best first) its parent id (0 = root),
    token and score."""
    order = np.lexsort(rows.T[::-1])
    rows, weights = rows[order], weights[order]
    m, depth = rows.shape
    # After sorting, rows with the same prefix are adjacent: a row starts a new node at column d
    # when its first d + 1 tokens differ from the previous row's.
    starts = np.ones((m, depth), bool)
    starts[1:] = np.logical_or.accumulate(rows[1:] != rows[:-1], axis=1)
    # Numbering the starts column by column gives every (row, column) its node, breadth first.
    flat_starts = starts.T.ravel()
    group = (np.cumsum(flat_starts) - 1).reshape(depth, m).T
    support = np.bincount(group.ravel(), weights=np.repeat(weights, depth))
    start_at = np.flatnonzero(flat_starts)
    column, row = start_at // m, start_at % m
    tokens = rows[row, column]
    real = tokens >= 0  # groups of rows that had already ended are no nodes
    node_id = np.cumsum(real)  # 1-based id of each real group
    parent_group = np.where(column > 0, group[row, np.maximum(column - 1, 0)], -1)
    parents = np.where(parent_group >= 0, node_id[parent_group], 0)[real]
    scores = np.log(support[real] / weights.sum()) + (column[real] + 1) * token_logp
    return _siblings_best_first(parents, tokens[real], scores, column[real])


def _siblings_best_first(parents: np.ndarray, tokens: np.ndarray, scores: np.ndarray, column: np.ndarray,
                         ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Number a breadth-first trie's nodes again so that each node's children come best first
    (by score; ties in their old order), as a draft model's trees have them: a child's position is
    then its rank (a step's child_ranks), and a cut to the nodes added first (DraftTree.first: a
    network size, a tile) keeps the likelier siblings. In token order a lookup tree's first
    children were its lowest tokens (a regenerated answer's first tree, verified down them, took
    a continuation weighing 1 against the earlier answer's 16,000 and accepted nothing)."""
    if len(np.unique(parents)) == len(parents):
        return parents, tokens, scores  # a chain, or branches that never split again
    new_id = np.zeros(len(parents) + 1, np.int64)  # old 1-based id -> new (0: the root)
    order = np.empty(len(parents), np.int64)
    at = 0
    for c in range(int(column[-1]) + 1):  # (breadth first: each column's nodes are consecutive)
        nodes = np.flatnonzero(column == c)
        if len(nodes) > 1:
            nodes = nodes[np.lexsort((nodes, -scores[nodes], new_id[parents[nodes]]))]
        order[at: at + len(nodes)] = nodes
        new_id[nodes + 1] = np.arange(at + 1, at + len(nodes) + 1)
        at += len(nodes)
    return new_id[parents[order]], tokens[order], scores[order]


def _best_nodes(parents: np.ndarray, scores: np.ndarray, budget: int, max_leaves: int) -> np.ndarray:
    """Return the ids (ascending) of the best `budget` nodes, fewer while they form more than
    `max_leaves` leaves.

    A child never outscores its parent and ties go to the lower id (the parent), so any best-k
    set is a tree, and its worst nodes are leaves.
    """
    ranked = 1 + np.argsort(-scores, kind="stable")
    count = min(budget, len(ranked))
    while True:
        kept = np.sort(ranked[:count])
        has_child = np.zeros(len(parents) + 1, bool)
        has_child[parents[kept - 1]] = True
        leaves = count - int(has_child[kept].sum())
        if leaves <= max_leaves:
            return kept
        count -= leaves - max_leaves


def _build_tree(root: int, parents: np.ndarray, tokens: np.ndarray, scores: np.ndarray, kept: np.ndarray) -> DraftTree:
    new_id = np.zeros(len(parents) + 1, np.int64)
    new_id[kept] = np.arange(1, len(kept) + 1)
    tree = DraftTree(root, capacity=len(kept) + 1)
    for parent, token, score in zip(new_id[parents[kept - 1]].tolist(), tokens[kept - 1].tolist(), scores[kept - 1].tolist()):
        tree.add(parent, token, score)
    return tree


def graft(tree: DraftTree, branches: DraftTree, max_leaves: int = MAX_LEAVES, at: int = 0) -> np.ndarray:
    """Add to `tree` the nodes of `branches` (rooted at the token of `tree`'s node `at`, by default
    its root) that it lacks below that node; return, for each node of `branches` (root excluded),
    the id it has in `tree` (-1 where the leaf limit left it out).

    Existing nodes keep their ids and new ones are appended, so ids >= the old length are the
    grafted nodes, and whatever the caller keeps per existing node stays valid. A grafted node's
    logp is its score in `branches`, capped at its new parent's, so logps still fall along paths.
    """
    if int(branches.tokens[0]) != int(tree.tokens[at]):
        raise ValueError("graft needs trees below the same root token")
    placed = np.full(len(branches), -1, np.int64)
    placed[0] = at
    leaves = len(tree.leaves())  # colours of one target pass: a lone root is one
    b_parents, b_tokens, b_logps = branches.parents.tolist(), branches.tokens.tolist(), branches.logps.tolist()
    for node in range(1, len(branches)):  # parents first: ids are in insertion order
        parent = int(placed[b_parents[node]])
        if parent < 0:
            continue
        child = tree.find_child(parent, b_tokens[node])
        if child is None:
            # A child under a leaf replaces that leaf; under an inner node it adds one.
            adds_leaf = not tree.is_leaf(parent)
            if adds_leaf and leaves >= max_leaves:
                continue
            leaves += adds_leaf
            child = tree.add(parent, b_tokens[node], min(b_logps[node], float(tree.logps[parent])))
        placed[node] = child
    return placed[1:]


def cut(tree: DraftTree, budget: int, max_leaves: int = MAX_LEAVES) -> DraftTree:
    """Return a new tree of `tree`'s best `budget` nodes (what `prune_to_best` would keep), which
    is left as it is; for trees whose children follow their parents in id order."""
    if len(tree) - 1 <= budget:
        return tree
    parents, tokens, scores = tree.parents[1:], tree.tokens[1:], tree.logps[1:]
    return _build_tree(int(tree.tokens[0]), parents, tokens, scores, _best_nodes(parents, scores, budget, max_leaves))


def new_by_rank(tree: DraftTree, branches: DraftTree) -> np.ndarray:
    """Return, for the nodes of `branches` best-first (by logp, ties to the lower id), whether
    grafting it would add a node to `tree` (its path is not in `tree` already)."""
    present = np.zeros(len(branches), bool)
    present[0] = True
    where = np.zeros(len(branches), np.int64)
    b_parents, b_tokens = branches.parents.tolist(), branches.tokens.tolist()
    for node in range(1, len(branches)):
        parent = b_parents[node]
        if present[parent]:
            child = tree.find_child(int(where[parent]), b_tokens[node])
            if child is not None:
                present[node], where[node] = True, child
    order = 1 + np.argsort(-branches.logps[1:], kind="stable")
    return ~present[order]
