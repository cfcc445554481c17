"""Acceptance walk over a scored draft tree: the target's own choices, exact at any temperature.

At each node on the way down the target draws its next token exactly as plain decoding would
(`sampling.choose_token` on that node's logits); the draft only decides how far one target pass
reaches. So every emitted token is a draw from the target's distribution given everything
before it: the same tokens as plain greedy decoding at temperature 0, the same distribution
otherwise. Each emitted token consumes exactly one uniform from the generator, as in plain
sampling, so with the same seed (and the same logits) speculative and plain sampling emit the
same tokens.

Penalties, logit_bias and grammars (rules.py) depend on the text so far: `rules` transforms each
visited node's row given the committed text plus that node's path, and hears each token drawn.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from specrun.core.rules import PathRules
from specrun.core.sampling import NEAR_TIE_NATS, NearTie, SamplingParams, choose_token, near_tie
from specrun.core.tree import DraftTree


@dataclass(frozen=True)
class Acceptance:
    """What one target pass over a draft tree commits."""

    nodes: tuple[int, ...]  # accepted node ids from the root (node 0, always included) down
    tokens: tuple[int, ...]  # to emit now: the tokens of nodes[1:], then `bonus` if one was drawn
    bonus: int | None  # target token no child carried: next step's root, not in the KV cache;
    # None when the walk stopped on a tree node (end-of-generation or max_tokens reached there)
    end_of_generation: bool  # tokens[-1] ends generation
    near_ties: tuple[NearTie, ...] = ()  # greedy: tokens chosen at a near-tie (`at`: index in tokens)
    left_to: int | None = None  # first_path: the node off the first path that carried `bonus`

    @property
    def accepted_depth(self) -> int:
        """Draft tokens accepted: the depth of the deepest accepted node."""
        return len(self.nodes) - 1


def accept_path(
    tree: DraftTree,
    target_logits: np.ndarray,
    params: SamplingParams,
    rng: np.random.Generator,
    eog_ids: frozenset[int] | Callable[[int], bool] = frozenset(),
    max_tokens: int | None = None,
    rules: PathRules | None = None,
    tie_nats: float = NEAR_TIE_NATS,
    first_path: bool = False,
) -> Acceptance:
    """Return the accepted path and the tokens to emit, given the target's logits for every node.

    `target_logits[i]` is the target's logit row after node i (row 0: after the root). Only the
    rows on the walked path are read. The walk stops after an end-of-generation token (which is
    emitted; the caller decides whether to print it) and never emits more than `max_tokens`.
    tokens[i] is drawn from row nodes[i]. `rules`, if given, shape every row the walk reads and
    follow every token it emits. A greedy walk notes each token chosen at a near-tie
    (sampling.near_tie, within `tie_nats`): a pass of another shape may have chosen the other token there.

    `first_path`: the walk stops where it leaves the tree's first path (nodes 0..d, laid first in
    the pass: DraftTree.path_first): the token the target drew there, from a first-path row, is
    emitted last as the bonus (the node that carried it is `left_to`), and no row off that path is
    read, so every emitted token was chosen by a row computed in the cells plain decoding gives
    those positions (docs/exactness.md).
    """
    if target_logits.ndim != 2 or target_logits.shape[0] < len(tree):
        raise ValueError(f"need one logit row per tree node ({len(tree)}), got shape {target_logits.shape}")
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    is_eog = eog_ids if callable(eog_ids) else eog_ids.__contains__
    limit = len(tree) if max_tokens is None else max_tokens
    node, nodes, tokens, ties = 0, [0], [], []
    while True:
        # the rules have seen exactly this node's path: the row is shaped as plain decoding would
        row = target_logits[node] if rules is None else rules.shape(target_logits[node])
        token = choose_token(row, params, rng)
        if rules is not None:
            rules.accept(token)
        if params.greedy and (tie := near_tie(row, token, len(tokens), tie_nats)) is not None:
            ties.append(tie)
        tokens.append(token)
        # The target drew `token` itself; the draft is right iff a child carries it: descend, else stop.
        child = tree.find_child(node, token)
        if child is None or (first_path and child != len(nodes)):
            return Acceptance(tuple(nodes), tuple(tokens), token, bool(is_eog(token)), tuple(ties), left_to=child)
        node = child
        nodes.append(child)
        if is_eog(token) or len(tokens) >= limit:
            return Acceptance(tuple(nodes), tuple(tokens), None, bool(is_eog(token)), tuple(ties))
