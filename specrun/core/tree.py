"""DraftTree: the candidate continuations of one speculative step, and their target batch layout.

Node 0 is the root: the last committed token, not yet in the target's KV cache (the bonus token
of the previous step), at position p0. Every other node continues its parent by one token. Node
ids are assigned in insertion order and a parent always precedes its children, which is also the
order llama.cpp needs in a batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from specrun.limits import MAX_SEQ

# One target pass gives every leaf its own llama.cpp sequence id ("colour"), so that a tree token
# attends only to its ancestors: a tree has at most as many leaves as a context has sequences.
MAX_LEAVES = MAX_SEQ

_INITIAL_CAPACITY = 64


@dataclass(frozen=True, eq=False)
class TreeBatch:
    """A tree laid out for one llama.cpp batch: node i is batch token i, in node order.

    Leaves are coloured 0..n_colours-1 in depth-first order, so the colours below any node form
    the contiguous range first_colour[i] .. first_colour[i] + colour_count[i] - 1. Colour 0 is
    seq 0, which holds the committed prefix; the caller copies seq 0 to colours 1.. before the
    pass. A node's first seq id is its own first colour, which all its ancestors carry too. The
    cells of colour first_colour[a] at positions p0 .. p0 + depth(a) are exactly the path to
    node a, so that colour is the one to copy into seq 0 after accepting a.
    """

    tokens: np.ndarray  # int32 [n]
    positions: np.ndarray  # int32 [n]: offsets from p0 (the depth)
    first_colour: np.ndarray  # int32 [n]: seq_id[i][0]
    colour_count: np.ndarray  # int32 [n]: leaves below node i (1 for a leaf)
    leaf_nodes: np.ndarray  # int32 [n_colours]: the leaf coloured c
    n_colours: int

    def seq_id_matrix(self, width: int) -> np.ndarray:
        """Return int32 [n, width]: row i starts with node i's colours (colour_count[i] of them).

        Entries past colour_count[i] repeat the last colour and are not meant to be read; this
        fills a llama_batch's seq_id rows without a Python loop.
        """
        matrix = np.minimum(np.arange(width, dtype=np.int32), self.colour_count[:, None] - 1)
        matrix += self.first_colour[:, None]
        return matrix

    @cached_property
    def seq_ids(self) -> list[list[int]]:
        """Per node, the colours of all leaves below it, first colour first."""
        return [
            list(range(first, first + count))
            for first, count in zip(self.first_colour.tolist(), self.colour_count.tolist())
        ]


class DraftTree:
    """A tree of draft tokens under a root, with cumulative draft log-probs per node.

    The array properties are views of the filled part; adding nodes may reallocate, so re-read
    them after growing the tree.
    """

    def __init__(self, root_token: int, capacity: int = _INITIAL_CAPACITY):
        capacity = max(1, capacity)
        self._tokens = np.empty(capacity, np.int32)
        self._parents = np.empty(capacity, np.int32)
        self._depths = np.empty(capacity, np.int32)
        self._logps = np.empty(capacity, np.float64)
        self._tokens[0], self._parents[0], self._depths[0], self._logps[0] = root_token, -1, 0, 0.0
        self._children: list[list[int]] = [[]]
        self._n = 1

    @classmethod
    def chain(cls, root_token: int, tokens, logps=None) -> DraftTree:
        """Return a single path root -> tokens[0] -> tokens[1] ... (classic speculative decoding).

        `logps` are cumulative draft log-probs per token (zeros when not given).
        """
        tokens = np.asarray(tokens, np.int32).reshape(-1)
        logps = np.zeros(len(tokens)) if logps is None else np.asarray(logps, np.float64)
        if logps.shape != tokens.shape:
            raise ValueError("chain needs one log-prob per token")
        tree = cls(root_token, capacity=len(tokens) + 1)
        n = len(tokens) + 1
        tree._tokens[1:n] = tokens
        tree._parents[1:n] = np.arange(n - 1)
        tree._depths[1:n] = np.arange(1, n)
        tree._logps[1:n] = logps
        tree._children = [[i + 1] for i in range(n - 1)] + [[]]
        tree._n = n
        return tree

    def copy(self) -> DraftTree:
        """Return an independent tree with the same nodes and ids."""
        tree = DraftTree(int(self._tokens[0]), capacity=self._n)
        n = self._n
        tree._tokens[:n], tree._parents[:n] = self._tokens[:n], self._parents[:n]
        tree._depths[:n], tree._logps[:n] = self._depths[:n], self._logps[:n]
        tree._children = [list(children) for children in self._children]
        tree._n = n
        return tree

    def __len__(self) -> int:
        return self._n

    @property
    def tokens(self) -> np.ndarray:
        return self._tokens[: self._n]

    @property
    def parents(self) -> np.ndarray:
        """Parent id per node; the root's is -1."""
        return self._parents[: self._n]

    @property
    def depths(self) -> np.ndarray:
        return self._depths[: self._n]

    @property
    def logps(self) -> np.ndarray:
        """Cumulative draft log-prob of the path to each node; the root's is 0."""
        return self._logps[: self._n]

    @property
    def max_depth(self) -> int:
        return int(self.depths.max())

    def add(self, parent: int, token: int, logp: float) -> int:
        """Add one child of `parent` with cumulative log-prob `logp`; return its id."""
        self._check_node(parent)
        self._reserve(1)
        i = self._n
        self._tokens[i] = token
        self._parents[i] = parent
        self._depths[i] = self._depths[parent] + 1
        self._logps[i] = logp
        self._children[parent].append(i)
        self._children.append([])
        self._n += 1
        return i

    def add_children(self, parent: int, tokens, logps) -> np.ndarray:
        """Add children of `parent` with the given tokens and cumulative log-probs; return their ids."""
        self._check_node(parent)
        tokens = np.asarray(tokens)
        logps = np.asarray(logps, np.float64)
        if tokens.ndim != 1 or logps.shape != tokens.shape:
            raise ValueError("add_children needs 1-D tokens and one log-prob per token")
        return self._append(np.full(len(tokens), parent), tokens, logps)

    def expand(self, parents, tokens, child_logprobs) -> np.ndarray:
        """Give each of `parents` the children in its row of `tokens`; return the new ids [n, k].

        `child_logprobs[r, j]` is the draft's log-prob of tokens[r, j] after parents[r] (as from
        `sampling.log_softmax_topk`); the stored logp adds the parent's cumulative logp to it.
        """
        parents = np.asarray(parents, np.int64)
        tokens = np.asarray(tokens)
        child_logprobs = np.asarray(child_logprobs, np.float64)
        if tokens.ndim != 2 or tokens.shape != child_logprobs.shape or len(parents) != len(tokens):
            raise ValueError("expand needs parents [n], tokens [n, k] and child_logprobs [n, k]")
        if len(parents) and (parents.min() < 0 or parents.max() >= self._n):
            raise IndexError(f"parent out of range for a tree of {self._n} nodes")
        logps = self._logps[parents][:, None] + child_logprobs
        k = tokens.shape[1]
        ids = self._append(np.repeat(parents, k), tokens.reshape(-1), logps.reshape(-1))
        return ids.reshape(tokens.shape)

    def _append(self, parents: np.ndarray, tokens: np.ndarray, logps: np.ndarray) -> np.ndarray:
        start, count = self._n, len(tokens)
        self._reserve(count)
        new = slice(start, start + count)
        self._tokens[new] = tokens
        self._parents[new] = parents
        self._depths[new] = self._depths[parents] + 1
        self._logps[new] = logps
        for child, parent in enumerate(parents.tolist(), start=start):
            self._children[parent].append(child)
        self._children.extend([] for _ in range(count))
        self._n += count
        return np.arange(start, start + count)

    def children(self, i: int) -> list[int]:
        """Ids of node i's children in insertion order (the tree's own list: do not modify)."""
        return self._children[i]

    def find_child(self, i: int, token: int) -> int | None:
        """Return the first child of node i that carries `token`, or None."""
        tokens = self._tokens
        for child in self._children[i]:
            if tokens[child] == token:
                return child
        return None

    def is_leaf(self, i: int) -> bool:
        return not self._children[i]

    def leaves(self) -> np.ndarray:
        """Ids of all leaves, ascending."""
        n_children = np.bincount(self.parents[1:], minlength=self._n)
        return np.flatnonzero(n_children == 0)

    def with_leaves(self, max_leaves: int) -> tuple[DraftTree, np.ndarray]:
        """Return the best subtree with at most `max_leaves` leaves (this tree where it has no more)
        and the id each of its nodes has here (new id -> old id); this tree is left as it is.

        Nodes join best first by logp (ties to the lower id), each with its ancestors, unless it
        would add a leaf past the limit (one that extends a leaf adds none): a target pass gives
        each leaf a sequence of its own, and a sliding-window target keeps a window per sequence.
        """
        n = self._n
        parents = self._parents[:n]
        if n == 1 or len(self.leaves()) <= max_leaves:
            return self, np.arange(n)
        if max_leaves < 1:
            raise ValueError(f"a tree keeps at least one leaf, not {max_leaves}")
        keep = np.zeros(n, bool)
        keep[0] = True
        kept_children = np.zeros(n, np.int32)
        leaves = 1  # the root alone
        for node in (1 + np.argsort(-self._logps[1:n], kind="stable")).tolist():
            if keep[node]:
                continue  # (joined as an ancestor of a better node)
            chain, above = [node], int(parents[node])
            while not keep[above]:
                chain.append(above)
                above = int(parents[above])
            added = 1 if kept_children[above] else 0  # a kept leaf extended stays one leaf
            if leaves + added > max_leaves:
                continue
            leaves += added
            keep[chain] = True
            kept_children[chain[1:]] += 1
            kept_children[above] += 1
        kept = np.flatnonzero(keep)
        new_id = np.cumsum(keep) - 1
        tree = DraftTree(int(self._tokens[0]), capacity=len(kept))
        for old in kept[1:].tolist():
            tree.add(int(new_id[parents[old]]), int(self._tokens[old]), float(self._logps[old]))
        return tree, kept

    def path_first(self, along: Sequence[int] = (), alone: bool = False) -> tuple[DraftTree, np.ndarray]:
        """Return this tree with its first path as nodes 0..d, the other nodes after it in their
        order (`alone`: that path only, for a step that reads no other row), and their ids here
        (new id -> old id); this tree itself where that is what it is already. The first path
        follows the tokens `along` from the root as far as children carry them (a grammar's
        forced run: the target takes it), then the best-scored child at each node, as
        `best_path` (ties: the lower id; in a draft model's tree its first child). Laid as nodes
        0..d it is the path `colour_batch` gives colour 0. (Following first children, a
        step that verifies this path alone checked a draft chain where a lookup branch grafted
        beside it scored higher.)

        A batch holds a tree's nodes in id order and the KV cache gives a batch consecutive free
        cells, so that path's tokens land in the cells plain decoding gives them, one position a
        cell, in order: where the kernels are batch invariant (engine.runs_batch_invariant) its
        rows are plain decoding's bit for bit, and only its rows (docs/exactness.md)."""
        path = [0]
        for token in along:
            child = self.find_child(path[-1], token)
            if child is None:
                break
            path.append(child)
        while self._children[path[-1]]:
            path.append(max(self._children[path[-1]], key=lambda c: (self._logps[c], -c)))
        n = self._n
        if path[-1] == len(path) - 1 and (len(path) == n or not alone):
            return self, np.arange(n)
        if alone:
            chain = DraftTree(int(self._tokens[0]), capacity=len(path))
            for new, old in enumerate(path[1:]):
                chain.add(new, int(self._tokens[old]), float(self._logps[old]))
            return chain, np.asarray(path, np.int64)
        on_path = np.zeros(n, bool)
        on_path[path] = True
        order = np.concatenate([np.asarray(path, np.int64), np.flatnonzero(~on_path)])
        new_id = np.empty(n, np.int64)
        new_id[order] = np.arange(n)
        tree = DraftTree(int(self._tokens[0]), capacity=n)
        tree._tokens[:n] = self._tokens[order]
        tree._parents[:n] = new_id[self._parents[order]]
        tree._parents[0] = -1
        tree._depths[:n], tree._logps[:n] = self._depths[order], self._logps[order]
        tree._children = [[int(new_id[c]) for c in self._children[old]] for old in order.tolist()]
        tree._n = n
        return tree, order

    def first(self, n: int) -> tuple[DraftTree, np.ndarray]:
        """Return a copy of the root and the n nodes added first (a parent precedes its children,
        so they form a tree) and their ids here (new id -> old id)."""
        kept = np.arange(min(n + 1, self._n))
        tree = DraftTree(int(self._tokens[0]), capacity=len(kept))
        m = len(kept)
        tree._tokens[:m], tree._parents[:m] = self._tokens[:m], self._parents[:m]
        tree._depths[:m], tree._logps[:m] = self._depths[:m], self._logps[:m]
        tree._children = [[c for c in children if c < m] for children in self._children[:m]]
        tree._n = m
        return tree, kept

    def path(self, i: int) -> list[int]:
        """Node ids from the root down to node i."""
        self._check_node(i)
        nodes = []
        while i >= 0:
            nodes.append(i)
            i = int(self._parents[i])
        return nodes[::-1]

    def best_path(self) -> list[int]:
        """Return the node ids from the root to a leaf, taking the best-scored child at each node
        (ties: the lower id): the one chain a verifier that cannot branch should check."""
        path = [0]
        while self._children[path[-1]]:
            path.append(max(self._children[path[-1]], key=lambda c: (self._logps[c], -c)))
        return path

    def subtree(self, node: int) -> tuple[DraftTree, np.ndarray]:
        """Return the tree below `node`, rooted at it (depths and log-probs counted from it), and
        its nodes' old ids (new id -> old id, in their old order)."""
        self._check_node(node)
        n = self._n
        inside = np.zeros(n, bool)
        inside[node] = True
        parents = self._parents[:n]
        for i in range(node + 1, n):  # a parent precedes its children
            inside[i] = inside[parents[i]]
        kept = np.flatnonzero(inside)
        new_id = np.cumsum(inside) - 1
        tree = DraftTree(int(self._tokens[node]), capacity=len(kept))
        m = len(kept)
        tree._tokens[:m] = self._tokens[kept]
        tree._parents[:m] = new_id[parents[kept]]
        tree._parents[0] = -1
        tree._depths[:m] = self._depths[kept] - self._depths[node]
        tree._logps[:m] = self._logps[kept] - self._logps[node]
        tree._n = m
        tree._children = [[] for _ in range(m)]
        for child, parent in enumerate(tree._parents[1:m].tolist(), start=1):
            tree._children[parent].append(child)
        return tree, kept

    def prune_to_best(self, budget: int) -> np.ndarray:
        """Keep the root and the `budget` best other nodes by logp; return the kept old ids.

        Ties go to the lower id. Since logp never rises along a path (and a parent has a lower id
        than its child), the kept nodes form a tree. Nodes are renumbered in their old order, so
        the returned array maps new id -> old id.
        """
        if budget < 0:
            raise ValueError(f"budget must be >= 0, got {budget}")
        n = self._n
        if n - 1 <= budget:
            return np.arange(n)
        best = 1 + np.argsort(-self._logps[1:n], kind="stable")[:budget]
        keep = np.zeros(n, bool)
        keep[0] = True
        keep[best] = True
        if not keep[self._parents[np.flatnonzero(keep)[1:]]].all():
            raise ValueError("cannot prune: a node's logp is higher than its parent's")
        return self.keep(keep)

    def prune_deeper(self, depth: int) -> np.ndarray:
        """Keep the nodes at most `depth` below the root; return the kept old ids (as prune_to_best)."""
        return self.keep(self.depths <= depth)

    def keep(self, keep: np.ndarray) -> np.ndarray:
        """Keep the nodes `keep` marks (every kept node's parent kept too), renumbered in their old
        order; return the kept old ids."""
        kept = np.flatnonzero(keep)
        new_id = np.cumsum(keep) - 1
        parents = new_id[self._parents[kept]]
        parents[0] = -1
        self._tokens[: len(kept)] = self._tokens[kept]
        self._depths[: len(kept)] = self._depths[kept]
        self._logps[: len(kept)] = self._logps[kept]
        self._parents[: len(kept)] = parents
        self._n = len(kept)
        self._children = [[] for _ in range(self._n)]
        for child, parent in enumerate(parents[1:].tolist(), start=1):
            self._children[parent].append(child)
        return kept

    def colour_batch(self, max_leaves: int = MAX_LEAVES) -> TreeBatch:
        """Return the batch layout for one target pass: tokens, positions and leaf colours.

        Raises ValueError when the tree has more than `max_leaves` leaves.
        """
        n = self._n
        parents = self._parents[:n].tolist()
        count = [0 if children else 1 for children in self._children]
        for i in range(n - 1, 0, -1):  # children after parents: a reverse sweep sums subtrees
            count[parents[i]] += count[i]
        if count[0] > max_leaves:
            raise ValueError(
                f"draft tree has {count[0]} leaves; one target pass supports at most {max_leaves} "
                "(one llama.cpp sequence per leaf)"
            )
        # Depth-first colouring: each child takes the next free sub-range of its parent's colours.
        first = [0] * n
        next_free = [0] * n
        for i in range(1, n):
            parent = parents[i]
            first[i] = next_free[i] = next_free[parent]
            next_free[parent] += count[i]
        first_colour = np.array(first, np.int32)
        colour_count = np.array(count, np.int32)
        leaf_nodes = np.empty(count[0], np.int32)
        is_leaf = np.array([not children for children in self._children])
        leaf_nodes[first_colour[is_leaf]] = np.flatnonzero(is_leaf)
        return TreeBatch(
            tokens=self.tokens.copy(),
            positions=self.depths.copy(),
            first_colour=first_colour,
            colour_count=colour_count,
            leaf_nodes=leaf_nodes,
            n_colours=count[0],
        )

    def _check_node(self, i: int) -> None:
        if not 0 <= i < self._n:
            raise IndexError(f"node {i} out of range for a tree of {self._n} nodes")

    def _reserve(self, extra: int) -> None:
        needed = self._n + extra
        capacity = len(self._tokens)
        if needed <= capacity:
            return
        while capacity < needed:
            capacity *= 2
        for name in ("_tokens", "_parents", "_depths", "_logps"):
            old = getattr(self, name)
            grown = np.empty(capacity, old.dtype)
            grown[: self._n] = old[: self._n]
            setattr(self, name, grown)
