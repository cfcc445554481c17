"""Trees grown online to what a pass pays (decoding.drafters.growing), pure: a scripted draft.

The sizing depends on measured seconds and on what the target went on to emit, not on a model:
a scripted draft that knows the text stands in for the draft model, with pass curves shaped as
measured through an RPC worker behind a 50 ms delay (nearly flat) and on the 2-core CPU (steep).
The end-to-end runs with real models are in test_speculative.py and test_rpc.py.
"""

from __future__ import annotations

import numpy as np

from specrun.core.tree import DraftTree
from specrun.core.tree_shapes import LONGEST_NETWORK_CHAIN, TreeShape, grown_shape, growth_levels
from specrun.decoding.reach import Reach
from specrun.decoding.calibration import DraftCalibration
from specrun.decoding.drafters.best_first import GrownTree
from specrun.decoding.drafters.growing import GrowingTrees
from specrun.decoding.pay.rules import ALONE, Beside
from specrun.decoding.steps import Step
from specrun.runtime.trees import DEFAULT_GROWTH, DEFAULT_SHAPE, LOOKUP_SHAPE, TreePlan, fit_tree
from specrun.runtime.drafters import BEST_FIRST

# The target's next token is the draft's first guess at these positions (about 80% of them), and
# its second guess elsewhere: a tree that holds second guesses accepts further than a chain.
TEXT = list(range(1000, 3000))
FIRST_GUESS = np.random.default_rng(7).random(len(TEXT)) < 0.8


class ScriptedGrower:
    """Grows best-first trees over the scripted text: at each node its first two guesses (the
    right token first where FIRST_GUESS says, else second), down to the shape's depth, the best
    `budget` nodes kept. Draft passes cost `pass_s` each, one per level of depth."""

    def __init__(self, pass_s: float = 0.004):
        self.shape = TreeShape.chain(5)
        self.pass_s = pass_s
        self.last_catch_up = (1, pass_s)
        self.last_passes = []
        self.last_shared = False
        self.drafts_beside_others = False
        self.budgets = []
        self.calibration = DraftCalibration()  # (nothing judged: trees stay trees)

    def propose(self, committed, root, budget, depth):
        at = len(committed)  # the position in TEXT of the token after the root
        tree = DraftTree(root, capacity=4 * budget + 8)
        frontier = [(0, at, 0.0)]
        for level in range(depth):
            grown = []
            for node, pos, logp in frontier:
                if pos is None:  # below a wrong guess: tokens the target never writes
                    guesses = [-1 - node, -2 - node]
                elif pos < len(TEXT):
                    right, wrong = TEXT[pos], -TEXT[pos]
                    guesses = [right, wrong] if FIRST_GUESS[pos] else [wrong, right]
                else:
                    continue
                for k, token in enumerate(guesses[: self.shape.top_k]):
                    child = tree.add(node, token, logp - (0.2 if k == 0 else 1.6))
                    right_here = pos is not None and token == TEXT[pos]
                    grown.append((child, pos + 1 if right_here else None, float(tree.logps[child])))
            frontier = sorted(grown, key=lambda f: -f[2])[: 4 * budget]
        tree.prune_to_best(budget)
        self.budgets.append(budget)
        passes = min(depth, tree.max_depth)
        self.last_passes = [(self.shape.width, self.pass_s)] * passes
        return GrownTree(tree, self.pass_s * (1 + passes), 1 + passes)

    def commit(self, proposal, accepted_nodes):
        pass

    def debt(self, committed, root):
        return 1

    def reset(self):
        pass


def _walk(tree: DraftTree, pos: int) -> tuple[list[int], int]:
    """The nodes of `tree` the target takes from TEXT[pos] on, and the position after them."""
    node, accepted = 0, [0]
    while (child := tree.find_child(node, TEXT[pos])) is not None:
        node, pos = child, pos + 1
        accepted.append(node)
    return accepted, pos


def decode(growing: GrowingTrees, pass_s, steps: int = 120, capacity: int = 384):
    """Run `steps` steps over TEXT, a target pass over n tokens taking pass_s(n); return the size
    verified at each step."""
    committed, sizes = [0], []
    for i in range(steps):
        root = TEXT[len(committed) - 1]
        if i % 10 == 9:  # a plain step now and then, as the speed guard asks for
            growing.observe(Step([root], target_s=pass_s(1), total_s=pass_s(1) + 0.001))
            committed.append(root)
            continue
        proposal = growing.propose(committed, root, capacity, 32)
        tree = proposal.tree
        accepted, pos = _walk(tree, len(committed))
        growing.commit(proposal, accepted)
        tokens = TEXT[len(committed): pos + 1]
        target_s = pass_s(len(tree))
        growing.observe(Step(tokens, target_s=target_s, draft_s=proposal.draft_s, total_s=target_s + proposal.draft_s + 0.001,
                             tree_nodes=len(tree) - 1, draft_passes=proposal.draft_passes))
        committed = [0, *TEXT[: pos]]
        sizes.append(len(tree) - 1)
    return sizes


def decode_beside(growing: GrowingTrees, pass_s, emitted: float, steps: int = 120, capacity: int = 384):
    """As `decode`, every target pass shared with three other requests that put 15-21 tokens into
    it and emit `emitted` from it (their draft passes shared too); return the size verified at
    each step."""
    growing.grower.last_shared = True
    committed, sizes = [0], []
    for i in range(steps):
        root = TEXT[len(committed) - 1]
        others = 15 + i % 7
        growing.beside = Beside(float(others), emitted)
        proposal = growing.propose(committed, root, capacity, 32)
        tree = proposal.tree
        accepted, pos = _walk(tree, len(committed))
        growing.commit(proposal, accepted)
        growing.observe_shared(len(tree) + others, pass_s(len(tree) + others))
        committed = [0, *TEXT[: pos]]
        sizes.append(len(tree) - 1)
    growing.beside = ALONE
    return sizes


def fixed(n):  # a target whose layers stream over PCIe each pass: the pass costs the transfer
    return 0.2 + 0.0002 * (n - 1)


def steep(n):  # the demo target on the 2-core CPU: a 64-token pass costs 7x a 1-token one
    return 0.025 + 0.0024 * (n - 1)


def test_grown_shapes_deepen_as_they_grow_and_levels_double():
    assert grown_shape(5) == TreeShape.chain(5)
    shapes = [grown_shape(b) for b in (16, 64, 256, 1024)]
    assert [s.depth for s in shapes] == [16, 24, 32, 40]
    assert all(s.width * 16 == s.budget and s.top_k == 2 for s in shapes)
    assert growth_levels(5, 384) == (5, 16, 32, 64, 128, 256, 384)
    assert growth_levels(5, 5) == (5,)


def test_reach_judges_a_budget_only_by_the_proposals_grown_that_large():
    reach = Reach([1, 2, 4, 8])
    small = DraftTree.chain(1, [2, 3], [-0.1, -0.2])
    large = DraftTree.chain(4, [5, 6, 7, 8, 9, 10, 11, 12], -0.1 * np.arange(1, 9))
    reach.watch(small)
    reach.feed([2, 3, 4])  # the small chain accepted whole
    reach.watch(large)
    reach.feed([5, 6, 7, 8, 9, 10, 11, 12, 13])  # the large one too
    weights = reach.weight()
    assert weights[0] > weights[2] > 0 and weights[2] == weights[3]  # budgets 4 and 8: the large chain only
    accepted = reach.accepted()
    assert accepted[3] == 8 and accepted[2] == 4  # not diluted by the small chain's 2
    assert accepted[1] == 2


def test_where_a_pass_costs_a_fixed_time_the_tree_grows_to_tens_of_nodes_and_more():
    growing = GrowingTrees(ScriptedGrower(pass_s=0.001), TreeShape.chain(5), 384)
    sizes = decode(growing, fixed)
    assert sizes[0] == 5
    assert min(sizes[-20:]) >= 64, sizes
    # Each size was grown (explored, and verified whole to time its pass) before it was chosen.
    assert growing.grower.budgets.index(max(sizes[-20:])) < len(sizes) - 20
    rates = growing.rates()
    assert rates[growing.level] > 1.8 * rates[0]  # measured far faster than the chain it started from


def test_beside_other_requests_a_tree_grows_to_what_the_shared_pass_pays():
    """A request that never had a pass to itself (several clients from the start, over a
    network): its tree is sized by the shared pass, priced by the curve of shared passes over its
    nodes and the others' tokens, its draft passes as they took beside the others'. 200 ms away
    four requests of the demo pair kept the chain of 5 for every step while one alone grew to 16-64
    nodes (a size's draft passes were timed only alone, and rates knew no pass but its own)."""
    growing = GrowingTrees(ScriptedGrower(pass_s=0.0005), TreeShape.chain(5), 384)
    sizes = decode_beside(growing, fixed, emitted=8.0)
    assert sizes[0] == 5
    assert min(sizes[-20:]) >= 32, sizes
    # Where each verified token is dear (a CPU) the others' tokens make the shared pass dear too:
    # the tree stays a chain.
    growing = GrowingTrees(ScriptedGrower(pass_s=0.004), TreeShape.chain(5), 384)
    assert max(decode_beside(growing, lambda n: 0.025 + 0.01 * (n - 1), emitted=12.0)[-20:]) <= 16


def test_drafting_during_the_pass_puts_the_longest_grown_chain_between_a_short_chain_and_trees():
    """Where the draft drafts while the target's pass runs elsewhere (overlaps), a chain of
    LONGEST_GROWN_CHAIN joins the sizes above the chain of 5; a tree start, or none, keeps its own."""
    growing = GrowingTrees(ScriptedGrower(pass_s=0.001), TreeShape.chain(5), 384)
    growing.overlaps()
    assert growing.levels == (5, 8, 16, 32, 64, 128, 256, 384)
    assert growing.shapes[1] == TreeShape.chain(8) and len(growing.draft_s) == len(growing.levels)
    tree_start = GrowingTrees(ScriptedGrower(), TreeShape(16, 8, 2, 2), 384)
    tree_start.overlaps()
    assert tree_start.levels == growth_levels(16, 384)
    # Passes of a fixed cost: it still grows to tens of nodes, through the longer chain.
    sizes = decode(growing, fixed)
    assert 8 in sizes and min(sizes[-20:]) >= 64, sizes


def test_where_the_target_takes_the_drafts_first_choices_sizes_up_to_the_longest_network_chain_are_chains():
    """Drafting during the pass, a draft whose first choices the target takes (pay.rules.grows_chains)
    grows chains up to LONGEST_NETWORK_CHAIN, and the trees above reach deeper than them; one right
    80% of the time (the scripted text), or a run not drafting during the pass, grows trees."""
    sure, unsure = ScriptedGrower(), ScriptedGrower()
    for grower, share in ((sure, 0.95), (unsure, 0.8)):
        grower.calibration.judge(np.log(np.full(100, 0.6)), np.ones(100, bool), np.arange(100) < 100 * share)
    overlapping, local = GrowingTrees(sure, TreeShape.chain(5), 384), GrowingTrees(sure, TreeShape.chain(5), 384)
    overlapping.overlaps()
    assert overlapping.levels == (5, 8, 16, 32, 64, 128, 256, 384)
    shapes = [overlapping._shape(level) for level in range(len(overlapping.levels))]
    assert shapes[:4] == [TreeShape.chain(b) for b in (5, 8, 16, 32)]
    assert all(not s.is_chain and s.depth > LONGEST_NETWORK_CHAIN for s in shapes[4:])
    assert [local._shape(level) for level in range(len(local.levels))] == local.shapes
    assert not any(s.is_chain for s in local.shapes[1:])
    trees = GrowingTrees(unsure, TreeShape.chain(5), 384)
    trees.overlaps()
    assert trees._shape(2) == grown_shape(16) and not trees._shape(3).is_chain


def test_a_walk_still_going_counts_at_what_it_accepted_so_far_only_where_asked():
    reach = Reach([1, 2, 4, 8])
    reach.watch(DraftTree.chain(1, [2, 3], [-0.1, -0.2]))
    reach.feed([2, 3, 4])  # accepted whole: ended
    reach.watch(DraftTree.chain(4, [5, 6, 7, 8, 9, 10, 11, 12], -0.1 * np.arange(1, 9)))
    reach.feed([5, 6, 7])  # three of its eight so far: still going
    assert reach.weight()[3] == 0 and reach.weight(going=True)[3] == 1
    assert reach.accepted(going=True)[3] == 3  # at least that many: a lower bound
    assert reach.accepted(going=True)[1] == 2 and reach.accepted()[1] == 2  # final at 2 either way
    reach.feed([8, 9, 10, 11, 12, 13])
    assert reach.accepted()[3] == 8 == reach.accepted(going=True)[3]


def network(n):  # the demo target on a worker 200 ms away (docs/rpc.md): a round trip, then compute
    return 0.418 + 0.0017 * (n - 1)


def test_where_the_draft_grows_during_the_pass_the_first_look_is_at_the_size_that_promises_most():
    """Each size's first pass over a network costs the round trips of llama.cpp's RPC client
    asking its products' sizes: the first look skips the sizes that promise less than a larger one
    (a chain of 32, where the draft's passes cost little against the pass); on a steep curve it
    stays the size just above (test_where_the_draft_grows_during_the_pass_the_size_above_...)."""
    growing = GrowingTrees(ScriptedGrower(pass_s=0.001), TreeShape.chain(5), 384)
    growing.overlaps()
    for _ in range(2):  # (the speed guard's plain steps time one-token passes; a size's first is set apart)
        growing.cost.observe(1, network(1))
    sizes = decode(growing, network, steps=60)
    looks = [b for b in growing.grower.budgets if b > 5]
    assert looks[0] >= 32, growing.grower.budgets
    # The sizes between, judged by the cuts of the larger trees, are never verified: only a size
    # a look has timed is (each new size's first pass costs round trips); the tree grows on.
    assert not {8, 16} & set(sizes) and max(sizes[-10:]) >= 64, sizes


class NodeCostGrower(ScriptedGrower):
    """As ScriptedGrower, a draft pass costing `pass_s` a node it expands (the demo draft's Q4_1
    passes on the 2-core CPU: a pass of four nodes costs about four of one)."""

    def propose(self, committed, root, budget, depth):
        proposal = super().propose(committed, root, budget, depth)
        width = self.shape.width
        self.last_passes = [(width, self.pass_s * width)] * (proposal.draft_passes - 1)
        return GrownTree(proposal.tree, self.pass_s * (1 + width * (proposal.draft_passes - 1)), proposal.draft_passes)


def test_over_a_network_no_size_is_looked_at_whose_tree_drafts_longer_than_a_step():
    """A look grows its tree in series before the target's pass. 200 ms from the worker, with
    chains a few ms a node, the tree grows to the longest network chain (32); the 64-node tree
    above it (32 passes of four nodes) would draft longer than a whole step, so it is never grown
    to look at (the demo pair: 700-930 ms of drafting for a 510 ms pass)."""
    sure = NodeCostGrower(pass_s=0.007)
    sure.calibration.judge(np.log(np.full(100, 0.6)), np.ones(100, bool), np.arange(100) < 97)
    growing = GrowingTrees(sure, TreeShape.chain(5), 384)
    growing.overlaps()
    for _ in range(2):
        growing.cost.observe(1, network(1))
        growing.draft_pass.observe(4, 4 * sure.pass_s)  # (as a catch-up over four tokens times it)
    guesses = FIRST_GUESS.copy()
    FIRST_GUESS[:] = np.random.default_rng(3).random(len(TEXT)) < 0.97
    try:
        sizes = decode(growing, network, steps=80)
    finally:
        FIRST_GUESS[:] = guesses
    assert max(sizes) == 32, sizes
    assert max(sure.budgets) == 32, sorted(set(sure.budgets))


def test_when_passes_get_dear_the_grown_tree_shrinks_back():
    # The same run, then its passes priced as a CPU's (the worker went away, the machine got busy).
    growing = GrowingTrees(ScriptedGrower(pass_s=0.001), TreeShape.chain(5), 384)
    assert min(decode(growing, fixed)[-10:]) >= 64
    sizes = decode(growing, steep, steps=200)
    assert max(sizes[-20:]) <= 32, sizes


def test_where_each_verified_token_is_dear_the_tree_stays_small():
    growing = GrowingTrees(ScriptedGrower(), TreeShape.chain(5), 384)
    sizes = decode(growing, steep)
    # The size above was never even grown to look at it: priced by the measured curve, with every
    # hoped-for token accepted, it promised less than the chain measured (on the demo pair's CPU
    # two such looks made a fresh chat 0.89x plain decoding).
    assert max(sizes) == 5, sizes
    assert max(growing.grower.budgets) == 5


def test_where_the_draft_grows_during_the_pass_the_size_above_is_looked_at_once_at_any_curve():
    """Drafting during the target's pass (a network): the first look costs little and the curve's
    first sizes say little of the rest, so the size above is grown and verified once, then left."""
    growing = GrowingTrees(ScriptedGrower(), TreeShape.chain(5), 384)
    growing.overlaps()
    sizes = decode(growing, steep)
    assert 8 in sizes and max(sizes[20:]) == 5, sizes


def test_a_new_text_forgets_the_walks_in_progress():
    growing = GrowingTrees(ScriptedGrower(), TreeShape.chain(5), 64)
    decode(growing, fixed, steps=10)
    weight = growing.reach.weight().copy()
    growing.propose([0, 5, 6, 7], 8, 64, 32)  # another request's text: no walk continues into it
    assert np.array_equal(growing.reach.weight(), weight)
    assert growing._text == [0, 5, 6, 7, 8]


def test_a_growing_tree_cut_to_a_smaller_batch_gives_up_growth_before_lookup():
    tree = TreePlan(DEFAULT_SHAPE, BEST_FIRST, "default", lookup=LOOKUP_SHAPE, grow=DEFAULT_GROWTH)
    assert tree.verified.budget == DEFAULT_GROWTH + LOOKUP_SHAPE.budget
    assert tree.verified.depth == max(grown_shape(DEFAULT_GROWTH).depth, LOOKUP_SHAPE.depth)
    smaller = fit_tree(tree, 100)
    assert smaller.grow == 100 - LOOKUP_SHAPE.budget and smaller.verified.budget == 100
    no_room = fit_tree(tree, 50)
    assert no_room.grow is None and no_room.shape == DEFAULT_SHAPE and no_room.verified.budget == 50
    assert "growing to up to 384" in tree.describe() and "growing" not in no_room.describe()


# A 27B Q4_K_M target with 40 of its 65 layers in RAM (read into pinned memory) beside an 8 GiB
# share of an H100, measured by the device kit (docs/benchmarks.md): below 32 tokens the RAM
# layers run on the CPU, from 32 on the GPU after their weights are copied over.
H100_8GIB = {1: 0.130, 2: 0.177, 4: 0.351, 8: 0.477, 9: 0.502, 16: 0.530, 31: 0.764, 32: 0.203, 64: 0.211,
             128: 0.232, 256: 0.307, 512: 0.387}


def offloaded(n):
    below = sorted(k for k in H100_8GIB if k < 32) if n < 32 else sorted(k for k in H100_8GIB if k >= 32)
    return float(np.interp(n, below, [H100_8GIB[k] for k in below]))


def test_where_passes_from_the_op_offload_step_on_cost_less_the_tree_grows_past_it():
    # Told where the regime changes, the ladder leaves out the sizes whose pass stays below the
    # step, and the first tree above it is timed whole: trees of 32 nodes and more from then on.
    growing = GrowingTrees(ScriptedGrower(pass_s=0.004), TreeShape.chain(5), 384)
    growing.cost_step(32)
    assert growing.levels[0] == 5 and all(b + 1 >= 32 for b in growing.levels[1:])
    sizes = decode(growing, offloaded)
    # (Every STALE_STEPS steps the size below is verified once, to time it again.)
    assert sizes[0] == 5 and growing.levels[growing.level] >= 32 and sum(s < 32 for s in sizes[-20:]) <= 1, sizes
    rates = growing.rates()
    assert rates[growing.level] > 2 * rates[0]  # measured: far faster than the chain it started from
    # Not told, the 16-node tree's pass (530 ms, on the CPU) prices every larger one out.
    blind = GrowingTrees(ScriptedGrower(pass_s=0.004), TreeShape.chain(5), 384)
    assert max(decode(blind, offloaded)) < 32


def test_a_pass_cost_above_the_step_is_its_own_line():
    from specrun.decoding.adaptive import TargetCost

    cost = TargetCost()
    cost.set_step(32)
    for n in (1, 6, 17):
        cost.observe(n, offloaded(n))
    assert float(cost(np.array([33]))[0]) == cost(np.array([1]))[0]  # not timed yet: as a one-token pass
    cost.observe(33, offloaded(33))
    assert float(cost(np.array([129]))[0]) == offloaded(33)  # one size timed: flat from the step
    cost.observe(129, offloaded(129))
    assert abs(float(cost(np.array([257]))[0]) - offloaded(257)) < 0.08  # two: the line through them
    assert float(cost(np.array([17]))[0]) > 0.5  # the passes below the step keep their own line
