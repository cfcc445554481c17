"""Filling a static tree template (Sequoia) with the draft's top-ranked tokens.

The tuner's dynamic program (tuner.sequoia_tree) fixes the tree's shape in advance: node i is the
`ranks[i]`-th most likely draft token after its parent. Growing it takes one draft pass per level
over the level's inner nodes, however the draft's probabilities fall, so the draft cost is known
exactly and the passes are as wide as the template allows.

`StaticTreeGrower` is a drafter (drafters/base.py) for SpeculativeDecoder. It keeps the draft's KV cache the
way TreeGrower does (every decoded node its own sequence, copied from its parent's; the accepted
path copied into sequence 0 afterwards), and reuses its catch-up and commit.
"""

from __future__ import annotations

import time
from typing import Sequence

import numpy as np

from specrun.core.sampling import log_softmax_topk
from specrun.core.tree import DraftTree
from specrun.core.tree_shapes import TreeTemplate, template_shape
from specrun.decoding.batching import Lane
from specrun.decoding.drafters.best_first import GrownTree, TreeGrower
from specrun.engine import Context
from specrun.limits import MAX_SEQ

# Sequence 0 holds the committed text; every decoded inner node needs one more.
MAX_INNER_NODES = MAX_SEQ - 1



def truncate_template(template: TreeTemplate, budget: int, depth: int) -> TreeTemplate:
    """Return the template's first budget + 1 nodes (breadth-first) of depth <= depth.

    Nodes are in breadth-first order with parents first, so any prefix is still a tree; used when
    the context or the token limit leaves room for less than the whole tree.
    """
    keep = [i for i in range(template.size) if template.depths[i] <= depth][: budget + 1]
    index = {old: new for new, old in enumerate(keep)}
    parents = tuple(-1 if old == 0 else index[template.parents[old]] for old in keep)
    return TreeTemplate(parents, tuple(template.ranks[old] for old in keep))


class StaticTreeGrower(TreeGrower):
    """Grows the same tree shape every step: a Sequoia template filled with the draft's top tokens."""

    def __init__(self, model, ctx: Context, template: TreeTemplate, lane: Lane | None = None):
        inner = len(set(template.parents[1:]))
        if inner > MAX_INNER_NODES:
            raise ValueError(
                f"the tree template has {inner} inner nodes; the draft can hold at most {MAX_INNER_NODES}"
            )
        self.template = template
        super().__init__(model, ctx, template_shape(template), lane)

    def propose(self, committed: Sequence[int], root: int, budget: int, depth: int) -> GrownTree:
        """Return the template (cut to budget and depth) filled with draft tokens below `root`."""
        template = self.template
        if budget < template.size - 1 or depth < template.depth:
            template = truncate_template(template, budget, depth)
        ctx = self.ctx
        self.p0 = p0 = len(committed)
        tree = DraftTree(root, capacity=template.size)
        node_seq: dict[int, int] = {0: self.lane.base}
        children = _children_by_node(template)

        t0 = time.perf_counter()
        row = self._catch_up(committed, root)
        draft_s = time.perf_counter() - t0
        passes = 1
        self._free_seqs = self._tree_seqs()
        self._used_seqs = []
        # Template node i becomes tree node i: children are added level by level in template order.
        level = [0]
        logits = row[None, :]
        while level:
            counts = [len(children[node]) for node in level]
            ids, lps = log_softmax_topk(logits, max(counts))
            for r, node in enumerate(level):
                ranks = [template.ranks[c] - 1 for c in children[node]]
                tree.add_children(node, ids[r, ranks], tree.logps[node] + lps[r, ranks])
            level = [c for node in level for c in children[node] if children[c]]
            if not level or len(level) > len(self._free_seqs):
                break  # (a lane of a shared draft context may hold fewer sequences than the template's inner nodes)
            seqs = [self._free_seqs.pop() for _ in level]
            for node, seq in zip(level, seqs):
                ctx.seq_cp(node_seq[template.parents[node]], seq, -1, -1)
                node_seq[node] = seq
            self._used_seqs.extend(seqs)
            nodes = np.asarray(level)
            self.batch.set_arrays(tree.tokens[nodes], p0 + tree.depths[nodes], seqs, True)
            logits, seconds = self._pass(len(nodes))
            draft_s += seconds
            passes += 1
        return GrownTree(tree, draft_s, passes, node_seq=node_seq)


def _children_by_node(template: TreeTemplate) -> list[list[int]]:
    children: list[list[int]] = [[] for _ in range(template.size)]
    for node in range(1, template.size):
        children[template.parents[node]].append(node)
    return children
