"""Adapting the verified tree to measured acceptance and cost (pure, no model)."""

import numpy as np

from specrun.core.tree import DraftTree
from specrun.decoding.adaptive import Hindsight, SpeedGuard, TargetCost
from specrun.decoding.drafters.lookup import LookupDrafter, SessionText
from specrun.decoding.lookup_index import graft
from specrun.decoding.steps import Step


def chain(root, tokens, step=-0.1):
    return DraftTree.chain(root, tokens, step * np.arange(1, len(tokens) + 1))


def at(hindsight, budget):
    i = list(hindsight.budgets).index(budget)
    return hindsight.accepted()[i], hindsight.nodes()[i]


def test_hindsight_measures_every_smaller_budget_from_one_tree():
    hindsight = Hindsight(max_budget=8)
    hindsight.watch(chain(1, [2, 3, 4, 5, 6]))
    hindsight.feed([2, 3])  # a step that accepted two, then the rest arrives in the next step
    hindsight.feed([4, 9])
    assert at(hindsight, 0) == (0, 0)
    assert at(hindsight, 1) == (1, 1)
    assert at(hindsight, 2) == (2, 2)
    assert at(hindsight, 8) == (3, 5)  # the whole tree: 5 nodes, 3 of them accepted


def test_hindsight_of_a_graft_takes_the_deeper_walk():
    base = chain(1, [2, 3])
    branches = chain(1, [7, 8, 9])
    merged = chain(1, [2, 3])
    placed = graft(merged, branches)
    assert (placed >= len(base)).all()  # all three are new
    hindsight = Hindsight(max_budget=4)
    base = chain(1, [2, 3])
    hindsight.watch(branches, base=base, new_by_rank=placed >= 3)
    graft(base, branches)  # grafting after the watch began does not make them base nodes
    hindsight.feed([7, 8, 0])
    assert at(hindsight, 0) == (0, 2)
    assert at(hindsight, 2) == (2, 4)
    hindsight.watch(branches, base=chain(1, [2, 3]), new_by_rank=placed >= 3)
    hindsight.feed([2, 3, 5])
    assert at(hindsight, 1)[0] > 0  # the base tree's walk counts at every budget


def test_nothing_proposed_counts_as_nothing_accepted():
    hindsight = Hindsight(max_budget=16)
    for _ in range(10):
        hindsight.watch(None)
    assert hindsight.known and (hindsight.accepted() == 0).all() and (hindsight.nodes() == 0).all()
    cost = TargetCost()
    cost.observe(1, 0.010)
    budget, rate = hindsight.best(lambda n: cost(n + 1))
    assert budget == 0 and abs(rate - 100) < 1e-6


def test_long_accepted_runs_pick_a_budget_that_pays():
    hindsight = Hindsight(max_budget=64)
    for _ in range(20):
        tokens = list(range(10, 40))
        hindsight.watch(chain(1, tokens))
        hindsight.feed(tokens[:20] + [0])
    cost = TargetCost()
    cost.observe(1, 0.010)
    cost.observe(17, 0.010 + 16 * 0.001)
    budget, _ = hindsight.best(lambda n: cost(n + 1))
    assert budget in (16, 24, 32)  # 20 accepted: beyond that a node only costs


def test_target_cost_fits_a_line_and_scales_a_profile():
    cost = TargetCost()
    assert not cost.known
    cost.observe(1, 0.02)
    assert abs(cost(np.array([11]))[0] - 0.02 * (1 + 10 * 0.1)) < 1e-9  # the prior per token
    for _ in range(30):
        cost.observe(9, 0.02 + 8 * 0.0005)
    assert abs(cost(np.array([101]))[0] - (0.02 + 100 * 0.0005)) < 1e-6
    profiled = TargetCost(curve=lambda n: 0.01 + 0.001 * (np.asarray(n) - 1))
    assert profiled.plain_s() == 0.01
    for _ in range(50):
        profiled.observe(5, 2 * 0.014)  # this run is twice as slow as the profile
    assert abs(profiled(np.array([1]))[0] - 0.02) < 1e-6


def test_speed_guard_shrinks_to_plain_and_retries():
    guard = SpeedGuard(budget=16, plain_s=0.010, window=4, retry_after=50)
    for _ in range(4):
        guard.record(2, 0.030, 16)  # 15 ms per token against plain's 10
    assert guard.cap == 8 and len(guard.events) == 1
    for _ in range(16):  # 8 -> 4 -> 2 -> 1 -> 0, a window each
        guard.record(1, 0.020, guard.cap)
    assert guard.cap == 0 and "plain decoding" in guard.events[-1]
    assert guard.wants_plain_step()
    for _ in range(50):
        guard.record(1, 0.010, 0)
    assert guard.cap == 1  # tries again


def test_speed_guard_leaves_a_paying_tree_alone_and_measures_plain_without_a_profile():
    guard = SpeedGuard(budget=16, window=4)
    assert not guard.wants_plain_step()
    for _ in range(2):
        guard.record(3, 0.015, 16)
    assert guard.wants_plain_step()  # no plain figure yet: measure one
    guard.record(1, 0.010, 0)
    for _ in range(40):
        guard.record(3, 0.015, 16)  # 5 ms per token
    assert guard.cap == 16 and not guard.events


def simulate(drafter, text, prompt_len, seconds=lambda n: 0.010 + 0.002 * (n - 1)):
    """Decode `text` after its first prompt_len tokens as a decoder would, the target "choosing"
    the text's own next tokens; return the steps' (tree nodes, accepted) pairs."""
    committed, root, at, out = list(text[: prompt_len - 1]), text[prompt_len - 1], prompt_len, []
    while at < len(text):
        grown = drafter.propose(committed, root, 64, 16)
        node, accepted = 0, []
        while grown is not None and at + len(accepted) < len(text):
            child = grown.tree.find_child(node, text[at + len(accepted)])
            if child is None:
                break
            node = child
            accepted.append(text[at + len(accepted)])
        nodes = len(grown.tree) - 1 if grown is not None else 0
        emitted = accepted + ([text[at + len(accepted)]] if at + len(accepted) < len(text) else [])
        committed += [root] + accepted
        root = emitted[-1]
        at += len(emitted)
        drafter.observe(Step(emitted, target_s=seconds(nodes + 1), total_s=seconds(nodes + 1) + 0.0002, tree_nodes=nodes))
        out.append((nodes, len(accepted)))
    return out


def test_lookup_drafter_verifies_long_copies_and_stops_proposing_for_text_that_never_repeats():

    rng = np.random.default_rng(0)
    document = [int(t) for t in rng.integers(0, 30000, 300)]
    drafter = LookupDrafter(64)
    copy = simulate(drafter, document + [5] + document, prompt_len=301)
    assert sum(a for _, a in copy) >= 250 and len(copy) <= 40  # long verified runs
    assert drafter.chosen >= 8
    # Then free text over a tiny vocabulary: every token "matches" somewhere, nothing continues.
    noise = [int(t) for t in rng.integers(0, 8, 400)]
    free = simulate(drafter, document + noise, prompt_len=301)
    assert drafter.chosen == 0
    # Mostly plain steps; now and then a small tree where a chance match looked promising.
    assert sum(n == 0 for n, _ in free[-50:]) >= 40 and sum(n for n, _ in free[-50:]) <= 50


def test_session_text_indexes_only_what_is_new():

    text = SessionText(max_step=10)
    assert text.catch_up([1, 2, 3], 4) is None  # the first prompt
    assert text.catch_up([1, 2, 3, 4, 5], 6) == [5, 6]  # a step accepted 5, then drew 6
    assert text.index.live.tolist() == [1, 2, 3, 4, 5, 6]
    assert text.catch_up([1, 2, 3, 9], 9) is None  # a new prompt sharing a prefix
    assert text.index.live.tolist() == [1, 2, 3, 9, 9]
    assert text.catch_up([1, 2, 3, 9, 9] + list(range(100, 120)), 7) is None  # a long new turn
