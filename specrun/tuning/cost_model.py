"""Cost model and tree-shape optimizer: which speculative tree (if any) is fastest on this machine.

Everything here is pure arithmetic over measured numbers, so it is testable without a model:

- `CostCurve`: seconds per forward pass as a function of the tokens in the batch.
- Acceptance from one calibration run: `tau_curve` (SpecExec, accepted tokens per pass for every
  budget) and `positional_acceptance` (Sequoia, probability that the target picks the draft's k-th
  ranked child).
- `sequoia_tree`: the dynamic-programming optimal static tree for given positional acceptance.
- `choose_config`: the configuration with the best predicted tokens/s, or plain decoding when
  speculation does not pay.

"Accepted tokens per pass" always counts the bonus token: a pass that accepts no draft token still
emits one token drawn from the target, so plain decoding is 1 token per pass.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from specrun.core.tree_shapes import TreeTemplate
from specrun.decoding.pay.rules import predicted_pays
from specrun.limits import MAX_SEQ as MAX_TREE_LEAVES  # one sequence id per leaf

# SpecExec draft-cost model: draft tokens kept per expanded node (tree nodes / internal nodes).
# Best-first trees from a confident draft are a long spine of top-1 children with a few siblings
# hanging off it, which keeps about two nodes per expansion. The profiler can pass the measured
# value (calibration budget / mean expansions per tree) instead.
DEFAULT_BRANCHING = 2.0

DEFAULT_WIDTHS = (1, 2, 4, 8, 16, 32, 64)


# --------------------------------------------------------------------------------------------
# Cost curves


@dataclass(frozen=True)
class CostCurve:
    """Seconds per forward pass as a function of the number of tokens in the batch.

    Between measured sizes the time is linear in n; below the smallest size it is flat; above the
    largest it keeps growing with the slope of the last segment (never shrinking: a negative last
    slope is measurement noise and is treated as flat).
    """

    sizes: tuple[int, ...]
    seconds: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.sizes or len(self.sizes) != len(self.seconds):
            raise ValueError("a cost curve needs at least one (size, seconds) point")
        if any(b <= a for a, b in zip(self.sizes, self.sizes[1:])):
            raise ValueError("cost curve sizes must be strictly increasing")
        if self.sizes[0] < 1 or any(s < 0 or not math.isfinite(s) for s in self.seconds):
            raise ValueError("cost curve sizes must be >= 1 and times finite and >= 0")

    @classmethod
    def from_points(cls, points: Mapping[int, float] | Iterable[tuple[int, float]]) -> CostCurve:
        """Build a curve from (size, seconds) pairs in any order."""
        pairs = sorted(dict(points).items())
        return cls(tuple(int(n) for n, _ in pairs), tuple(float(s) for _, s in pairs))

    def t(self, n: float) -> float:
        """Return the predicted seconds for one pass over n tokens."""
        sizes, seconds = self.sizes, self.seconds
        if n <= sizes[-1]:
            return float(np.interp(n, sizes, seconds))
        if len(sizes) == 1:
            return seconds[0]
        slope = (seconds[-1] - seconds[-2]) / (sizes[-1] - sizes[-2])
        return seconds[-1] + max(slope, 0.0) * (n - sizes[-1])

    def to_dict(self) -> dict:
        return {"sizes": list(self.sizes), "seconds": list(self.seconds)}

    @classmethod
    def from_dict(cls, data: Mapping) -> CostCurve:
        return cls.from_points(zip(data["sizes"], data["seconds"]))


# --------------------------------------------------------------------------------------------
# Acceptance calibration


@dataclass(frozen=True)
class CalibrationStep:
    """One speculative step of the calibration run.

    `path_ranks[i]` is the best-first rank (1-based, the order in which the grower kept nodes,
    root excluded) of the accepted node at depth i + 1. Its length is the depth the target reached.
    """

    path_ranks: tuple[int, ...]

    @property
    def depth(self) -> int:
        return len(self.path_ranks)


def accepted_depth(path_ranks: Sequence[int], budget: int, max_depth: int | None = None) -> int:
    """Return the depth the target would reach in the top-`budget` subtree of a calibration tree.

    The subtree holds exactly the nodes of rank <= budget, so the walk stops at the first path node
    outside it. Ranks increase along a path in a best-first tree, but we do not rely on it.
    """
    depth = 0
    for rank in path_ranks:
        if rank > budget or (max_depth is not None and depth >= max_depth):
            break
        depth += 1
    return depth


def tau_curve(
    steps: Iterable[CalibrationStep | Sequence[int]],
    budgets: Iterable[int],
    max_depth: int | None = None,
) -> dict[int, float]:
    """Return accepted tokens per target pass (bonus included) for every budget, from one run.

    tau(B) = mean over steps of (1 + accepted depth within the top-B nodes). Valid for budgets up
    to the calibration budget, because a best-first tree of budget B is the top-B nodes of the
    bigger tree. `max_depth` caps the accepted depth, an estimate for trees grown with a smaller
    depth limit (a lower bound: such a tree would spend the freed budget elsewhere).
    """
    paths = [tuple(s.path_ranks if isinstance(s, CalibrationStep) else s) for s in steps]
    if not paths:
        raise ValueError("tau_curve needs at least one calibration step")
    return {
        int(b): 1.0 + float(np.mean([accepted_depth(p, b, max_depth) for p in paths]))
        for b in budgets
    }


def positional_acceptance(records: Iterable[int | None], max_rank: int | None = None) -> np.ndarray:
    """Return a with a[k - 1] = P(the target's token is the draft's k-th ranked child), k = 1..K.

    One record per tree node the target visited: the draft rank of the token the target chose
    there, or 0/None when it is not among the draft's top K. Record the rank among the draft's
    candidates at that node even when the tree kept fewer children, or the rates come out low.
    K is `max_rank`, or the largest rank seen; ranks above K count as misses.
    """
    ranks = np.array([0 if r is None else int(r) for r in records], dtype=np.int64)
    if ranks.size == 0:
        raise ValueError("positional_acceptance needs at least one record")
    if (ranks < 0).any():
        raise ValueError("child ranks are 1-based; 0 or None means no child matched")
    k = int(max_rank if max_rank is not None else max(ranks.max(), 1))
    counts = np.bincount(ranks[ranks <= k], minlength=k + 1)[1:]
    return counts / ranks.size


# --------------------------------------------------------------------------------------------
# Static trees (Sequoia)


def expected_accepted(tree: TreeTemplate, accept_probs: Sequence[float]) -> float:
    """Return 1 + sum over non-root nodes of P(the target walks into the node).

    P(reach node) = P(reach parent) * a[rank - 1]: the events "target picks the k-th child" are
    disjoint for different k, and the accepted path is one root-to-node walk, so its expected
    length is the sum of reach probabilities; the 1 is the bonus token.
    """
    a = np.asarray(accept_probs, dtype=float)
    reach = [1.0] * tree.size
    for i in range(1, tree.size):
        rank = tree.ranks[i]
        reach[i] = reach[tree.parents[i]] * (a[rank - 1] if rank <= len(a) else 0.0)
    return 1.0 + sum(reach[1:])


@dataclass(frozen=True)
class _SequoiaTables:
    """DP results for all n <= n_max, d <= d_max (see `_sequoia_tables`)."""

    group_value: np.ndarray  # [d, s] best value of the children of a reached node, s nodes below it
    choice: np.ndarray  # [d, j, s] size of the j-th child's subtree in that optimum (0 = stop)


def _validate_accept_probs(accept_probs: Sequence[float]) -> tuple[float, ...]:
    a = np.asarray(accept_probs, dtype=float).ravel()
    if ((a < 0) | (a > 1) | ~np.isfinite(a)).any() or a.sum() > 1 + 1e-6:
        raise ValueError("acceptance rates must lie in [0, 1] and sum to at most 1")
    nonzero = np.nonzero(a > 0)[0]
    return tuple(float(x) for x in a[: nonzero[-1] + 1]) if nonzero.size else ()


@functools.lru_cache(maxsize=8)
def _sequoia_tables(a: tuple[float, ...], n_max: int, d_max: int) -> _SequoiaTables:
    """Solve the Sequoia DP for every tree size up to n_max and depth up to d_max.

    G(j, s, d): the best expected number of accepted nodes among a reached node's children of
    ranks j, j+1, ... and their subtrees, using at most s nodes, each child's subtree at most d - 1
    levels deep below the child. Child j takes c nodes (itself plus c - 1 descendants):

        G(j, s, d) = max(0, max_{1<=c<=s} a_j * (1 + G(1, c - 1, d - 1)) + G(j + 1, s - c, d))

    Choosing c = 0 stops, so children stay contiguous ranks 1..m. A tree of n nodes and depth d
    has value 1 + G(1, n - 1, d). Cost O(K * n^2 * d) over numpy rows (K = len(a)).
    """
    k_max = min(len(a), n_max - 1)
    s_all = np.arange(n_max)
    c_all = np.arange(n_max)
    # cand[s, c] = V[c] + G_next[s - c], only for 1 <= c <= s; column 0 is "stop here".
    rest = np.clip(s_all[:, None] - c_all[None, :], 0, None)
    valid = (c_all[None, :] >= 1) & (c_all[None, :] <= s_all[:, None])

    group_value = np.zeros((d_max + 1, n_max))
    choice = np.zeros((d_max + 1, k_max + 2, n_max), dtype=np.int32)
    for d in range(1, d_max + 1):
        below = group_value[d - 1]  # G(1, c - 1, d - 1) at index c - 1
        g_next = np.zeros(n_max)  # G(k_max + 1, ., d) = 0: no more ranks
        for j in range(k_max, 0, -1):
            child_value = np.zeros(n_max)
            child_value[1:] = a[j - 1] * (1.0 + below[:-1])
            cand = np.where(valid, child_value[None, :] + g_next[rest], -np.inf)
            cand[:, 0] = 0.0
            best_c = np.argmax(cand, axis=1)  # first maximum: prefer stopping, then small c
            choice[d, j] = best_c
            g_next = cand[s_all, best_c]
        group_value[d] = g_next
    return _SequoiaTables(group_value, choice)


def _rebuild_tree(tables: _SequoiaTables, n_nodes: int, max_depth: int) -> TreeTemplate:
    """Follow the DP choices to the optimal tree, then number its nodes breadth-first."""
    children: list[list[int]] = [[]]
    ranks = [0]
    k_max = tables.choice.shape[1] - 2

    def fill(node: int, budget: int, levels: int) -> None:
        j = 1
        while j <= k_max and budget > 0:
            c = int(tables.choice[levels, j, budget])
            if c == 0:
                break
            child = len(ranks)
            ranks.append(j)
            children.append([])
            children[node].append(child)
            fill(child, c - 1, levels - 1)
            budget -= c
            j += 1

    fill(0, n_nodes - 1, max_depth)
    order, parents, new_ranks = [0], [-1], [0]
    new_index = {0: 0}
    for node in order:  # the list grows while we walk it: breadth-first
        for child in children[node]:
            new_index[child] = len(order)
            order.append(child)
            parents.append(new_index[node])
            new_ranks.append(ranks[child])
    return TreeTemplate(tuple(parents), tuple(new_ranks))


def sequoia_tree(
    accept_probs: Sequence[float], n_nodes: int, max_depth: int
) -> tuple[float, TreeTemplate]:
    """Return (expected accepted tokens, tree) for the best tree of <= n_nodes nodes and depth <= max_depth.

    n_nodes counts the root, as in Sequoia; depth counts edges from the root. A node's i-th child
    is accepted with probability accept_probs[i - 1] once the node is reached. Expected accepted
    tokens = 1 + sum over non-root nodes of P(reach node) (see `expected_accepted`).
    """
    if n_nodes < 1 or max_depth < 0:
        raise ValueError("a tree needs n_nodes >= 1 and max_depth >= 0")
    a = _validate_accept_probs(accept_probs)
    if not a or n_nodes == 1 or max_depth == 0:
        return 1.0, TreeTemplate((-1,), (0,))
    tables = _sequoia_tables(a, n_nodes, max_depth)
    tree = _rebuild_tree(tables, n_nodes, max_depth)
    return 1.0 + float(tables.group_value[max_depth, n_nodes - 1]), tree


def sequoia_expected(accept_probs: Sequence[float], n_max: int, d_max: int) -> np.ndarray:
    """Return E with E[n, d] = expected accepted tokens of the best tree of <= n nodes, depth <= d.

    Rows n = 1..n_max, columns d = 0..d_max (row 0 is unused and holds 0): one DP for the whole
    table, for plots and for choosing n and d.
    """
    a = _validate_accept_probs(accept_probs)
    values = np.ones((n_max + 1, d_max + 1))
    values[0] = 0.0
    if a and n_max >= 2 and d_max >= 1:
        values[1:] += _sequoia_tables(a, n_max, d_max).group_value.T
    return values


# --------------------------------------------------------------------------------------------
# Choosing the configuration


@dataclass(frozen=True)
class Choice:
    """The decoding configuration the tuner picked and what it predicts.

    `budget` is the number of draft tokens per tree (root excluded) for both tree kinds, so the
    target scores budget + 1 tokens per pass. Plain decoding has budget = depth = width = top_k = 0.
    For "sequoia", `tree` is the static template, `width` its widest draft batch and `top_k` its
    largest child rank.
    """

    kind: str  # "plain" | "specexec" | "sequoia"
    budget: int
    depth: int
    width: int
    top_k: int
    predicted_tokens_per_s: float
    predicted_speedup: float
    tree: TreeTemplate | None = field(default=None, compare=False)
    # The most nodes a SpecExec tree grows to online from `budget` where the run's passes pay for
    # more (decoding.drafters.growing), as the untuned default does; 0: it keeps its size.
    grow: int = 0

    def to_dict(self) -> dict:
        data = {
            "kind": self.kind,
            "budget": self.budget,
            "depth": self.depth,
            "width": self.width,
            "top_k": self.top_k,
            "predicted_tokens_per_s": self.predicted_tokens_per_s,
            "predicted_speedup": self.predicted_speedup,
        }
        if self.tree is not None:
            data["tree"] = self.tree.to_dict()
        if self.grow:
            data["grow"] = self.grow
        return data

    @classmethod
    def from_dict(cls, data: Mapping) -> Choice:
        if data["kind"] not in ("plain", "specexec", "sequoia"):
            raise ValueError(f"unknown decoding kind {data['kind']!r}")
        tree = data.get("tree")
        return cls(
            kind=data["kind"],
            budget=int(data["budget"]),
            depth=int(data["depth"]),
            width=int(data["width"]),
            top_k=int(data["top_k"]),
            predicted_tokens_per_s=float(data["predicted_tokens_per_s"]),
            predicted_speedup=float(data["predicted_speedup"]),
            tree=TreeTemplate.from_dict(tree) if tree is not None else None,
            grow=int(data.get("grow", 0)),
        )


def specexec_draft_seconds(
    draft_curve: CostCurve, budget: int, depth: int, width: int, branching: float = DEFAULT_BRANCHING
) -> float:
    """Return the predicted seconds to grow a best-first tree of `budget` nodes (SpecExec).

    Model: a tree of B nodes needs about I = B / branching expanded nodes (each expansion is one
    node in a draft batch), and at least as many as its deepest spine, min(D, B): a node at depth t
    exists only after t passes. A pass expands up to W nodes, so passes P = max(min(D, B),
    ceil(I / W)), each of width ceil(I / P). It ignores the grower stopping early when no candidate
    can enter the top B, so it errs towards slower.
    """
    if budget <= 0:
        return 0.0
    passes, per_pass = specexec_passes(budget, depth, width, branching)
    return passes * draft_curve.t(per_pass)


def step_seconds(target_s: float, draft_s: float, overlapped: bool) -> float:
    """Seconds of a step whose target pass takes `target_s` and whose draft passes `draft_s`: one
    after the other, or, `overlapped`, the draft growing the next tree during the target's pass,
    the longer of the two. The overlap bound is the steady state of a best-first tree grown on
    during the pass (best_first.TreeGrower.extend), which the next step takes where the target
    accepts a path it holds."""
    return max(target_s, draft_s) if overlapped else target_s + draft_s


def specexec_passes(budget: int, depth: int, width: int, branching: float = DEFAULT_BRANCHING) -> tuple[int, int]:
    """Return (draft passes, nodes per pass) to grow a best-first tree; see specexec_draft_seconds."""
    if budget <= 0:
        return 0, 0
    spine = min(depth, budget)
    expansions = max(math.ceil(budget / branching), spine)
    passes = max(spine, math.ceil(expansions / width))
    return passes, math.ceil(expansions / passes)


def sequoia_draft_seconds(draft_curve: CostCurve, tree: TreeTemplate) -> float:
    """Return the seconds to fill a static tree: one draft pass per level over its inner nodes."""
    return sum(draft_curve.t(w) for w in tree.expanding_widths())


def size_grid(first: int, dense_up_to: int, largest: int, ratio: float) -> list[int]:
    """Return sizes to try: every size from `first` to `dense_up_to`, then steps of `ratio` up to
    `largest` (small trees differ a lot per node, large ones little)."""
    sizes = set(range(first, min(largest, dense_up_to) + 1))
    n = float(dense_up_to)
    while n < largest:
        n *= ratio
        sizes.add(min(largest, round(n)))
    return sorted(sizes)


def _sequoia_sizes(n_max: int) -> list[int]:
    """Tree sizes worth trying: every size up to 16, then steps of about 12%."""
    return size_grid(2, 16, n_max, 1.125)


def choose_config(
    target_curve: CostCurve,
    draft_curve: CostCurve,
    overhead: float,
    tau: Mapping[int, float] | None = None,
    accept_probs: Sequence[float] | None = None,
    *,
    depth: int = 16,
    top_k: int = 8,
    tau_by_depth: Mapping[int, Mapping[int, float]] | None = None,
    widths: Sequence[int] = DEFAULT_WIDTHS,
    branching: float = DEFAULT_BRANCHING,
    max_tree_tokens: int = 512,
    sequoia_depths: Sequence[int] = tuple(range(1, 17)),
    plain_overhead: float = 0.0,
    best_even_if_losing: bool = False,
    overhead_per_pass: float = 0.0,
    overlapped: bool = False,
) -> Choice:
    """Return the configuration with the best predicted tokens/s, or plain decoding.

    Predicted tokens/s = E[accepted per pass] / (t_target(B + 1) + t_draft_build + overhead),
    against plain decoding at 1 / (t_target(1) + plain_overhead). Speculation is chosen only when
    it is predicted to pay (decoding.pay.rules.predicted_pays), or
    with `best_even_if_losing` whenever any configuration was weighed. The overhead of a step is `overhead` plus `overhead_per_pass`
    for each forward pass it makes (the draft's and the target's): Python bookkeeping and
    llama_decode's own setup grow with the passes, so a chain and a wide tree pay differently.

    SpecExec: `tau` maps budget B -> accepted tokens per pass measured with depth limit `depth`
    and `top_k` children per expansion (from `tau_curve`); `tau_by_depth` maps several depth
    limits to such curves. The widths W only change the draft cost (`specexec_draft_seconds`).
    Sequoia: `accept_probs` are the positional rates; trees of up to `max_tree_tokens` nodes (root
    included) and each depth in `sequoia_depths` are tried, with at most MAX_TREE_LEAVES leaves.

    `overlapped`: the draft grows its best-first trees while the target's pass runs elsewhere (an
    RPC worker, a GPU: runtime.drafts_while_verifying), so a SpecExec step costs the longer of the
    two (`step_seconds`), not their sum. Sequoia's static trees are drafted after the pass.
    """
    plain_rate = 1.0 / (target_curve.t(1) + plain_overhead)
    candidates: list[Choice] = []

    curves = dict(tau_by_depth or {})
    if tau is not None:
        curves.setdefault(depth, tau)
    for d, curve in curves.items():
        for budget, accepted in curve.items():
            if not 0 < budget < max_tree_tokens:
                continue
            for w in widths:
                draft_passes = specexec_passes(budget, d, w, branching)[0]
                seconds = step_seconds(
                    target_curve.t(budget + 1) + overhead_per_pass,
                    specexec_draft_seconds(draft_curve, budget, d, w, branching) + overhead_per_pass * draft_passes,
                    overlapped,
                ) + overhead
                rate = float(accepted) / seconds
                candidates.append(Choice("specexec", int(budget), int(d), w, top_k, rate, rate / plain_rate))

    if accept_probs is not None and _validate_accept_probs(accept_probs) and max_tree_tokens >= 2:
        candidates.extend(
            _sequoia_candidates(
                target_curve, draft_curve, overhead, accept_probs, max_tree_tokens,
                sequoia_depths, plain_rate, overhead_per_pass,
            )
        )

    best = max(candidates, key=lambda c: (c.predicted_tokens_per_s, -c.budget), default=None)
    if best is None or not (best_even_if_losing or predicted_pays(best.predicted_speedup)):
        return Choice("plain", 0, 0, 0, 0, plain_rate, 1.0)
    return best


def _sequoia_candidates(
    target_curve: CostCurve,
    draft_curve: CostCurve,
    overhead: float,
    accept_probs: Sequence[float],
    n_max: int,
    depths: Sequence[int],
    plain_rate: float,
    overhead_per_pass: float = 0.0,
) -> list[Choice]:
    a = _validate_accept_probs(accept_probs)
    d_max = max(depths)
    tables = _sequoia_tables(a, n_max, d_max)
    found = []
    for n in _sequoia_sizes(n_max):
        for d in depths:
            tree = _rebuild_tree(tables, n, d)
            if tree.size < 2 or tree.n_leaves > MAX_TREE_LEAVES:
                continue
            accepted = 1.0 + float(tables.group_value[d, n - 1])
            passes = len(tree.expanding_widths()) + 1
            seconds = (
                target_curve.t(tree.size) + sequoia_draft_seconds(draft_curve, tree)
                + overhead + overhead_per_pass * passes
            )
            rate = accepted / seconds
            width = max(tree.expanding_widths())
            found.append(
                Choice("sequoia", tree.size - 1, tree.depth, width, tree.max_rank, rate,
                       rate / plain_rate, tree)
            )
    return found
