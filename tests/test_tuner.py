"""The tuner's math: cost curves, one-run acceptance calibration, the Sequoia DP, the optimizer."""

from __future__ import annotations

import functools
import heapq
import itertools
import json
import math
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specrun.core.tree_shapes import TreeTemplate
from specrun.tuning.cost_model import (
    MAX_TREE_LEAVES,
    CalibrationStep,
    Choice,
    CostCurve,
    choose_config,
    expected_accepted,
    positional_acceptance,
    sequoia_expected,
    sequoia_tree,
    specexec_draft_seconds,
    step_seconds,
    tau_curve,
)

# ---------------------------------------------------------------------------------------------
# Cost curves


def test_cost_curve_interpolates_and_extrapolates():
    curve = CostCurve.from_points({8: 0.041, 1: 0.026, 64: 0.124})
    assert curve.t(1) == pytest.approx(0.026)
    assert curve.t(4.5) == pytest.approx((0.026 + 0.041) / 2)
    assert curve.t(36) == pytest.approx((0.041 + 0.124) / 2)
    slope = (0.124 - 0.041) / 56
    assert curve.t(128) == pytest.approx(0.124 + 64 * slope)
    # a noisy last segment that falls is continued flat, never downwards
    noisy = CostCurve.from_points({1: 0.5, 256: 0.52, 512: 0.51})
    assert noisy.t(2048) == pytest.approx(0.51)
    assert CostCurve.from_points({4: 0.2}).t(1) == CostCurve.from_points({4: 0.2}).t(100) == 0.2


def test_cost_curve_round_trips_through_json():
    curve = CostCurve.from_points({1: 0.1, 2: 0.11, 512: 0.3})
    assert CostCurve.from_dict(json.loads(json.dumps(curve.to_dict()))) == curve


def test_cost_curve_rejects_nonsense():
    with pytest.raises(ValueError):
        CostCurve((), ())
    with pytest.raises(ValueError):
        CostCurve((2, 1), (0.1, 0.2))
    with pytest.raises(ValueError):
        CostCurve((1,), (-0.1,))


# ---------------------------------------------------------------------------------------------
# Acceptance calibration


def test_tau_curve_counts_the_deepest_node_within_each_budget():
    steps = [
        CalibrationStep((1, 2, 5, 9)),  # depth 4 at budget 9
        CalibrationStep(()),  # target rejected the first draft token
        (3, 4),  # plain sequences work too
    ]
    tau = tau_curve(steps, [1, 2, 4, 5, 9, 100])
    assert tau == {
        1: 1 + (1 + 0 + 0) / 3,
        2: 1 + (2 + 0 + 0) / 3,
        4: 1 + (2 + 0 + 2) / 3,
        5: 1 + (3 + 0 + 2) / 3,
        9: 1 + (4 + 0 + 2) / 3,
        100: 1 + (4 + 0 + 2) / 3,
    }
    assert tau_curve(steps, [100], max_depth=1) == {100: 1 + 2 / 3}


def test_tau_curve_stops_at_a_path_node_outside_the_budget():
    # not best-first (rank falls along the path): the node at depth 2 is reachable only through
    # the node at depth 1, which budget 3 does not keep
    assert tau_curve([(7, 2)], [3, 7]) == {3: 1.0, 7: 3.0}


def test_positional_acceptance_is_the_share_of_visits_per_rank():
    a = positional_acceptance([1, 1, 2, None, 1, 0, 3, 1])
    np.testing.assert_allclose(a, [4 / 8, 1 / 8, 1 / 8])
    np.testing.assert_allclose(positional_acceptance([1, 5, 2, 2], max_rank=2), [1 / 4, 2 / 4])
    assert positional_acceptance([None, 0]).tolist() == [0.0]


class _SyntheticPair:
    """A made-up draft/target pair over a small vocabulary, deterministic per context."""

    vocab = 5

    def __init__(self, seed: int):
        self.seed = seed

    @functools.lru_cache(maxsize=None)
    def draft_logprobs(self, context: tuple[int, ...]) -> np.ndarray:
        rng = np.random.default_rng([self.seed, *context])
        logits = rng.normal(size=self.vocab) * 2.5
        return logits - np.log(np.exp(logits).sum())

    def target_token(self, context: tuple[int, ...]) -> int:
        # the target mostly agrees with the draft's top tokens: greedy over noisy draft logits
        rng = np.random.default_rng([self.seed + 10_000, *context])
        return int(np.argmax(self.draft_logprobs(context) + rng.normal(size=self.vocab) * 1.5))


def _grow_best_first(pair: _SyntheticPair, budget: int, max_depth: int, top_k: int):
    """Grow a SpecExec tree one expansion at a time; return {path tuple: best-first rank}."""
    kept: dict[tuple[int, ...], int] = {}
    counter = itertools.count()  # stable order for equal scores
    heap = [(0.0, next(counter), ())]  # (-score, tie, path from the root)
    while heap and len(kept) < budget + 1:
        neg_score, _, path = heapq.heappop(heap)
        kept[path] = len(kept)  # root gets rank 0
        if len(path) == max_depth:
            continue
        logq = pair.draft_logprobs(path)
        for token in np.argsort(-logq)[:top_k]:
            heapq.heappush(heap, (neg_score - logq[token], next(counter), path + (int(token),)))
    return kept


def _accepted_path_ranks(pair: _SyntheticPair, tree: dict[tuple[int, ...], int]) -> list[int]:
    path: tuple[int, ...] = ()
    ranks = []
    while (nxt := path + (pair.target_token(path),)) in tree:
        path = nxt
        ranks.append(tree[path])
    return ranks


def test_tau_from_one_run_equals_separate_runs_at_each_budget():
    """The tree at a smaller budget is the best-first prefix of the big one: same accepted depth."""
    seeds = range(40)
    budgets = [1, 2, 3, 5, 8, 13, 21, 34]
    calibration = [
        _accepted_path_ranks(_SyntheticPair(s), _grow_best_first(_SyntheticPair(s), 34, 6, 3))
        for s in seeds
    ]
    predicted = tau_curve(calibration, budgets)
    for budget in budgets:
        depths = [
            len(_accepted_path_ranks(_SyntheticPair(s), _grow_best_first(_SyntheticPair(s), budget, 6, 3)))
            for s in seeds
        ]
        assert predicted[budget] == pytest.approx(1 + np.mean(depths))
    assert predicted[34] > predicted[1] > 1  # the synthetic pair does accept something


# ---------------------------------------------------------------------------------------------
# Sequoia DP


def _forests(n_nodes: int, levels: int):
    """Yield every ordered forest of exactly n_nodes nodes at most `levels` levels deep."""
    if n_nodes == 0:
        yield ()
        return
    if levels == 0:
        return
    for first in range(1, n_nodes + 1):
        for first_children in _forests(first - 1, levels - 1):
            for rest in _forests(n_nodes - first, levels):
                yield (first_children, *rest)


def _forest_value(forest, a) -> float:
    """Expected accepted nodes below a reached node whose children subtrees are `forest`."""
    return sum(
        (a[i] if i < len(a) else 0.0) * (1 + _forest_value(children, a))
        for i, children in enumerate(forest)
    )


def _brute_force_best(a, n_nodes: int, max_depth: int) -> float:
    return 1 + max(
        _forest_value(forest, a)
        for size in range(1, n_nodes + 1)
        for forest in _forests(size - 1, max_depth)
    )


def _check_tree_shape(tree: TreeTemplate, n_nodes: int, max_depth: int) -> None:
    assert tree.parents[0] == -1 and tree.ranks[0] == 0
    assert tree.size <= n_nodes and tree.depth <= max_depth
    children: dict[int, list[int]] = {}
    for node in range(1, tree.size):
        assert tree.parents[node] < node  # ancestors first
        children.setdefault(tree.parents[node], []).append(tree.ranks[node])
    for ranks in children.values():  # a node's children are its draft's top-m tokens
        assert sorted(ranks) == list(range(1, len(ranks) + 1))
    assert list(tree.depths) == sorted(tree.depths)  # breadth-first


acceptance_rates = st.lists(st.floats(0.0, 1.0), min_size=1, max_size=4).flatmap(
    lambda raw: st.floats(0.05, 1.0).map(
        lambda total: [x / max(sum(raw), 1e-9) * total for x in raw] if sum(raw) > 0 else raw
    )
)


@settings(max_examples=60, deadline=None)
@given(a=acceptance_rates, n_nodes=st.integers(1, 7), max_depth=st.integers(0, 4))
def test_sequoia_dp_matches_brute_force(a, n_nodes, max_depth):
    value, tree = sequoia_tree(a, n_nodes, max_depth)
    assert value == pytest.approx(_brute_force_best(a, n_nodes, max_depth), abs=1e-12)
    _check_tree_shape(tree, n_nodes, max_depth)
    assert expected_accepted(tree, a) == pytest.approx(value, abs=1e-12)


def test_sequoia_known_shapes():
    # a perfect top-1 draft: the best tree is a chain
    value, chain = sequoia_tree([1.0], 5, 10)
    assert value == 5.0 and chain.parents == (-1, 0, 1, 2, 3)
    # depth 1 with even acceptance: a star
    value, star = sequoia_tree([0.25, 0.25, 0.25, 0.25], 5, 1)
    assert value == 2.0 and star.parents == (-1, 0, 0, 0, 0) and star.ranks == (0, 1, 2, 3, 4)
    # nothing is ever accepted: no draft tokens at all
    assert sequoia_tree([0.0, 0.0], 8, 3) == (1.0, TreeTemplate((-1,), (0,)))


def test_sequoia_value_grows_with_size_and_depth():
    a = [0.55, 0.15, 0.07, 0.04, 0.02]
    values = np.array([[sequoia_tree(a, n, d)[0] for d in range(0, 6)] for n in range(1, 40)])
    assert (np.diff(values, axis=0) >= -1e-12).all()
    assert (np.diff(values, axis=1) >= -1e-12).all()
    np.testing.assert_allclose(sequoia_expected(a, 39, 5)[1:], values)


def test_sequoia_dp_is_fast_for_large_trees():
    a = [0.5, 0.15, 0.08, 0.05, 0.03, 0.02, 0.01, 0.01]
    start = time.perf_counter()
    value, tree = sequoia_tree(a, 512, 16)
    assert time.perf_counter() - start < 10
    _check_tree_shape(tree, 512, 16)
    assert tree.size == 512
    assert expected_accepted(tree, a) == pytest.approx(value)


def test_tree_template_round_trips_through_json():
    _, tree = sequoia_tree([0.6, 0.2, 0.1], 20, 5)
    assert TreeTemplate.from_dict(json.loads(json.dumps(tree.to_dict()))) == tree


# ---------------------------------------------------------------------------------------------
# Optimizer

GOOD_ACCEPTANCE = [0.6, 0.15, 0.07, 0.04, 0.025, 0.015, 0.01, 0.01]
BUDGETS = [1, 2, 4, 8, 16, 32, 64, 128, 192, 256, 384, 511]


def _tau_from_rates(a, budgets=BUDGETS, depth=16):
    """A plausible tau(B): what the Sequoia tree of that budget would accept."""
    values = sequoia_expected(a, max(budgets) + 1, depth)
    return {b: float(values[b + 1, depth]) for b in budgets}


FLAT_TARGET = CostCurve.from_points({1: 1.00, 32: 1.01, 128: 1.02, 512: 1.05})  # offloading
FAST_DRAFT = CostCurve.from_points({1: 0.008, 16: 0.009, 64: 0.012})


def test_steep_cost_and_poor_acceptance_choose_plain_decoding():
    # 2-core CPU: every extra token costs almost as much as the first
    target = CostCurve.from_points({1: 0.026, 8: 0.15, 64: 1.1, 512: 9.0})
    draft = CostCurve.from_points({1: 0.011, 8: 0.04, 64: 0.3})
    poor = [0.2, 0.05, 0.02]
    choice = choose_config(target, draft, 0.002, _tau_from_rates(poor), poor)
    assert choice.kind == "plain"
    assert choice.predicted_speedup == 1.0
    assert choice.predicted_tokens_per_s == pytest.approx(1 / 0.026)
    assert choice.budget == choice.depth == choice.width == choice.top_k == 0


@pytest.mark.parametrize("kinds", ["specexec", "sequoia", "both"])
def test_flat_cost_curve_chooses_a_large_tree(kinds):
    tau = _tau_from_rates(GOOD_ACCEPTANCE) if kinds in ("specexec", "both") else None
    rates = GOOD_ACCEPTANCE if kinds in ("sequoia", "both") else None
    choice = choose_config(FLAT_TARGET, FAST_DRAFT, 0.01, tau, rates)
    assert choice.kind != "plain"
    assert choice.budget >= 128
    assert choice.predicted_speedup > 3
    if choice.kind == "sequoia":
        assert choice.tree is not None and choice.tree.size == choice.budget + 1
        assert choice.tree.n_leaves <= MAX_TREE_LEAVES


def test_sequoia_prediction_is_consistent_with_its_tree():
    choice = choose_config(FLAT_TARGET, FAST_DRAFT, 0.01, None, GOOD_ACCEPTANCE)
    assert choice.kind == "sequoia"
    tree = choice.tree
    seconds = FLAT_TARGET.t(tree.size) + sum(FAST_DRAFT.t(w) for w in tree.expanding_widths()) + 0.01
    assert choice.predicted_tokens_per_s == pytest.approx(expected_accepted(tree, GOOD_ACCEPTANCE) / seconds)
    assert choice.predicted_speedup == pytest.approx(choice.predicted_tokens_per_s * FLAT_TARGET.t(1))
    assert choice.depth == tree.depth and choice.top_k == tree.max_rank


def test_overhead_per_pass_is_paid_once_per_forward_pass():
    per_pass = 0.004
    choice = choose_config(FLAT_TARGET, FAST_DRAFT, 0.0, None, GOOD_ACCEPTANCE, overhead_per_pass=per_pass)
    tree = choice.tree
    passes = len(tree.expanding_widths()) + 1  # the draft's levels and the target's pass
    seconds = FLAT_TARGET.t(tree.size) + sum(FAST_DRAFT.t(w) for w in tree.expanding_widths()) + per_pass * passes
    assert choice.predicted_tokens_per_s == pytest.approx(expected_accepted(tree, GOOD_ACCEPTANCE) / seconds)


def test_choice_round_trips_through_json():
    for choice in [
        choose_config(FLAT_TARGET, FAST_DRAFT, 0.01, None, GOOD_ACCEPTANCE),
        choose_config(FLAT_TARGET, FAST_DRAFT, 0.01, _tau_from_rates(GOOD_ACCEPTANCE), None),
        Choice("plain", 0, 0, 0, 0, 38.0, 1.0),
    ]:
        again = Choice.from_dict(json.loads(json.dumps(choice.to_dict())))
        assert again == choice and again.tree == choice.tree
    with pytest.raises(ValueError):
        Choice.from_dict({**Choice("plain", 0, 0, 0, 0, 1.0, 1.0).to_dict(), "kind": "turbo"})


def _speedup(target, draft=FAST_DRAFT, overhead=0.01, a=GOOD_ACCEPTANCE, scale=1.0):
    scaled = [x * scale for x in a]
    return choose_config(target, draft, overhead, _tau_from_rates(scaled), scaled).predicted_speedup


def test_predicted_speedup_moves_the_right_way():
    base = _speedup(FLAT_TARGET)
    # better acceptance never predicts less
    assert _speedup(FLAT_TARGET, scale=0.7) <= base <= _speedup(FLAT_TARGET, scale=1.08)
    # costlier big batches, a slower draft, more overhead never predict more
    steeper = CostCurve.from_points({1: 1.0, 32: 1.2, 128: 1.8, 512: 4.0})
    assert _speedup(steeper) <= base
    slower_draft = CostCurve.from_points({1: 0.1, 16: 0.12, 64: 0.2})
    assert _speedup(FLAT_TARGET, draft=slower_draft) <= base
    assert _speedup(FLAT_TARGET, overhead=0.2) <= base
    # the chosen tree never shrinks when big batches get cheaper
    budgets = [
        choose_config(CostCurve.from_points({1: 1.0, 512: 1.0 + extra}), FAST_DRAFT, 0.01,
                      _tau_from_rates(GOOD_ACCEPTANCE), None).budget
        for extra in (8.0, 4.0, 2.0, 1.0, 0.5, 0.1, 0.0)
    ]
    assert budgets == sorted(budgets)


def test_speculation_is_off_below_the_threshold():
    # a tree that would be exactly break-even: one accepted token every other pass at double cost
    target = CostCurve.from_points({1: 0.1, 2: 0.15})
    draft = CostCurve.from_points({1: 0.0})
    choice = choose_config(target, draft, 0.0, {1: 1.5}, None, widths=(1,))
    assert choice.kind == "plain"
    choice = choose_config(target, draft, 0.0, {1: 1.5}, None, widths=(1,), best_even_if_losing=True)
    assert choice.kind == "specexec" and choice.predicted_speedup == pytest.approx(1.0)


def test_specexec_draft_cost_model():
    draft = CostCurve.from_points({1: 0.01, 64: 0.02})
    # a 16-deep spine needs 16 sequential passes however wide they are
    assert specexec_draft_seconds(draft, 16, 16, 64, branching=1.0) == pytest.approx(16 * 0.01)
    # a wide shallow tree: 256 nodes, 128 expansions, 32 per pass -> 4 passes of width 32
    assert specexec_draft_seconds(draft, 256, 2, 32, branching=2.0) == pytest.approx(4 * draft.t(32))
    assert specexec_draft_seconds(draft, 0, 8, 8) == 0.0
    widths = [specexec_draft_seconds(draft, 256, 8, w) for w in (1, 2, 4, 8, 16, 32)]
    assert widths == sorted(widths, reverse=True)  # wider batches build faster on a flat draft curve
    assert math.isfinite(specexec_draft_seconds(draft, 10_000, 16, 1))


def test_drafting_during_the_pass_prices_a_step_at_the_longer_of_the_two():
    """A worker 50 ms away (the demo target's curve through it) and a CPU draft: grown while the
    pass runs, a SpecExec tree costs the pass or its draft passes, whichever is longer, so the
    tuner weighs larger trees than where drafting waits for the pass."""
    network = CostCurve.from_points({1: 0.124, 16: 0.188, 64: 0.318, 128: 0.519, 512: 1.7})
    cpu_draft = CostCurve.from_points({1: 0.006, 4: 0.007, 16: 0.010, 64: 0.025})
    tau = _tau_from_rates(GOOD_ACCEPTANCE)
    after = choose_config(network, cpu_draft, 0.0, tau, overhead_per_pass=0.001)
    during = choose_config(network, cpu_draft, 0.0, tau, overhead_per_pass=0.001, overlapped=True)
    assert after.kind == during.kind == "specexec"
    assert during.budget > after.budget and during.predicted_tokens_per_s > after.predicted_tokens_per_s
    print(f"\nafter the pass: {after.budget} nodes x{after.predicted_speedup:.2f}; "
          f"during it: {during.budget} nodes x{during.predicted_speedup:.2f}")
    assert step_seconds(0.3, 0.1, overlapped=True) == 0.3 and step_seconds(0.3, 0.1, overlapped=False) == 0.4
