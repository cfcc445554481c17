"""decoding.pay: the one place that decides whether speculation pays.

The rules with their thresholds, the step sizer that asks the speed guard of each kind of request,
and a check that no other module keeps a threshold of its own. The decoders' behaviour with real
models under these rules is tested where they are (test_lookup_decoding, test_runtime_profile).
"""

from __future__ import annotations

import ast
import logging
from pathlib import Path

import numpy as np
import pytest

from specrun.core.sampling import SamplingParams
from specrun.core.tree import DraftTree
from specrun.decoding.adaptive import Hindsight
from specrun.decoding.pay import rules
from specrun.decoding.pay.counts import MetCounts, met_counts
from specrun.decoding.pay.guard import SpeedGuard
from specrun.decoding.pay.steps import StepSizer
from specrun.decoding.pay.together import Together
from specrun.decoding.steps import Step

PACKAGE = Path(rules.__file__).resolve().parents[2]
GREEDY = SamplingParams()
SAMPLED = SamplingParams(temperature=0.8)
SEEDED = SamplingParams(temperature=0.8, seed=7)


def test_a_tree_must_beat_what_it_replaces_by_the_step_margin():
    assert rules.faster(105.0, 100.0) and not rules.faster(104.0, 100.0)
    assert rules.lost_to(94.0, 100.0, 0.05) and not rules.lost_to(96.0, 100.0, 0.05)
    # The draft model whose whole-accepted tree cannot beat plain steps stays off; untimed, it may run.
    assert rules.draft_could_pay(None) and rules.draft_could_pay(1.0 + rules.STEP_MARGIN)
    assert not rules.draft_could_pay(1.0 + rules.STEP_MARGIN / 2)


def test_tune_decides_by_its_thresholds():
    assert rules.predicted_pays(rules.PREDICTED_GAIN) and not rules.predicted_pays(rules.PREDICTED_GAIN - 0.01)
    assert rules.check_keeps(rules.CHECK_FLOOR) and not rules.check_keeps(rules.CHECK_FLOOR - 0.01)
    tuned = 50.0
    assert not rules.default_wins(tuned * (1 + rules.DEFAULT_MARGIN), tuned)
    assert rules.default_wins(tuned * (1 + rules.DEFAULT_MARGIN) + 0.1, tuned)


def test_flash_attention_off_only_where_the_target_rounds_as_near_plain_decoding_without_it():
    # (largest logit differences of a chain's pass from one-token passes, measured 2026-11-30)
    assert rules.attention_off_rounds_alike(0.0102, 0.0068)  # the F32 demo target: tinyBLAS either way
    assert rules.attention_off_rounds_alike(6.36, 6.94)  # Gemma-3 Q4_K_M: repacked weights either way
    assert rules.attention_off_rounds_alike(0.0, 0.0005)  # (under the floor)
    assert not rules.attention_off_rounds_alike(0.0, 0.488)  # its Q4_1 file: bit for bit only with it
    assert not rules.attention_off_rounds_alike(0.01, 0.05)


def test_a_profile_holds_within_its_drift_either_way():
    profiled = 0.010
    inside, outside = 1.0 + rules.PROFILE_DRIFT * 0.9, 1.0 + rules.PROFILE_DRIFT * 1.1
    assert rules.profile_holds(profiled * inside, profiled) and rules.profile_holds(profiled / inside, profiled)
    assert not rules.profile_holds(profiled * outside, profiled) and not rules.profile_holds(profiled / outside, profiled)


def test_over_a_network_a_pass_is_filled_to_a_met_count_within_a_round_trip_and_twice_its_tokens():
    round_trip = 0.1
    assert rules.fill_pays(6, 17, 0.02, round_trip)  # a chain and a lookup branch: the 16-node tree's count
    assert not rules.fill_pays(6, 17, 0.12, round_trip)  # the filler costs more a pass than a round trip
    limit = rules.FILL_FACTOR * 6 + rules.FILL_SLACK
    assert rules.fill_pays(6, limit, 0.0, round_trip) and not rules.fill_pays(6, limit + 1, 0.0, round_trip)
    assert not rules.fill_pays(3, 6, 0.001, 0.0)  # no network: a new count costs nothing to avoid
    # Filler is paid for on every pass that takes it: no more in all than the new count's round trips.
    spent = (rules.NEW_COUNT_TRIPS - 1) * round_trip
    assert rules.fill_pays(6, 17, 0.1, round_trip, spent) and not rules.fill_pays(6, 17, 0.1, round_trip, spent + 0.01)


def test_a_pass_is_filled_to_the_least_met_count_above_it_where_that_pays():
    met = MetCounts()
    assert met.fill_to(1, 512, 0.1) == 1 and met.fill_to(7, 512, 0.1) == 7  # only one token met yet
    met.note(40, 0.9)  # a count's first pass: met, not timed
    met.note(90, 1.0)
    assert met.fill_to(30, 512, 0.1) == 40  # untimed: only the filler's tokens bound it
    assert met.fill_to(10, 512, 0.1) == 10  # 40 is more than twice 10 and FILL_SLACK
    assert met.fill_to(30, 39, 0.1) == 30  # no room for it (or a pass that must stay under TILE_ROWS)
    assert met.fill_to(40, 512, 0.1) == 40  # met already
    for n, seconds in ((30, 0.20), (40, 0.35)):  # timed: 40 tokens cost 0.15 s more than 30
        met.note(n, seconds)
        met.note(n, seconds)
    # The filler's 5 tokens of a 35-token pass: half those 0.15 s (the difference is shared by the
    # tokens between the timed counts, not charged whole to the filler).
    assert met.gap(35, 40) == pytest.approx(0.075) and met.gap(31, 40) == pytest.approx(0.135)
    assert met.fill_to(35, 512, 0.05) == 35  # the filler would cost more than a round trip a pass
    assert met.fill_to(35, 512, 0.1) == 40
    # Each pass filled so counts what its filler cost (0.075 s): past NEW_COUNT_TRIPS round trips
    # in all (0.4 s), a pass over 35 tokens meets that count instead.
    assert rules.NEW_COUNT_TRIPS == 4
    assert [met.fill_to(35, 512, 0.1) for _ in range(7)] == [40] * 4 + [35] * 3
    # Where no met count pays the pass meets a new count anyway: one of `shared` within FILL_GRID.
    assert met.fill_to(35, 512, 0.05, shared=(33, 41, 49)) == 41
    assert met.fill_to(35, 40, 0.05, shared=(33, 41, 49)) == 35 and met.fill_to(30, 512, 0.05, shared=(41,)) == 30
    assert met_counts(type("M", (), {"path": "/x.gguf"})()) is met_counts(type("M", (), {"path": "/x.gguf"})())
    # A tree is filled only to a count a tree's pass met (not a prompt's, which its filler nodes would
    # take at every step); a count any pass met is met for it.
    met = MetCounts()
    met.note(49, 0.5)
    met.note(9, 0.3, tree=True)
    assert met.fill_to(33, 512, 0.4, tree=True) == 33 and met.fill_to(33, 512, 0.4) == 49
    assert met.fill_to(7, 512, 0.4, tree=True) == 9 and met.fill_to(49, 512, 0.4, tree=True) == 49


def test_a_filler_priced_by_timed_passes_is_not_bounded_by_the_pass_s_own_tokens():
    """Over a worker 200 ms away four requests' chains (12 tokens) met a new count (2.1 s) where a
    timed 41-token pass cost 46 ms more than theirs would: a measured price decides, not the
    pass's size. A tree's filler nodes stay bounded by it (the target verifies them)."""
    assert rules.fill_pays(12, 41, 0.046, 0.4, priced=True) and not rules.fill_pays(12, 41, 0.046, 0.4)
    assert not rules.fill_pays(12, 41, 0.5, 0.4, priced=True)  # dearer than a round trip a pass
    for tree in (False, True):
        met = MetCounts()
        for n, seconds in ((6, 0.44), (41, 0.52)):
            for _ in range(2):  # (a count's first pass is not timed)
                met.note(n, seconds, tree=tree)
        assert met.gap(12, 41) == pytest.approx(0.08 * 29 / 35)
        assert met.fill_to(12, 63, 0.4, tree=tree) == (12 if tree else 41)
        assert met.fill_to(12, 63, 0.05, tree=tree) == 12  # the filler costs more than a round trip
    untimed = MetCounts()
    untimed.note(41, 0.52)
    assert untimed.fill_to(12, 63, 0.4) == 12  # no price measured: bounded by twice its tokens and 8


def test_a_tree_that_reaches_its_answers_last_tokens_is_filled_as_far_as_its_timed_price_allows():
    """200 ms from the worker a 6-node chain cut to an answer's last 7 tokens met a new count (2.04
    s against 0.44): filled to the chain of 32's count, where that filler's price was timed, it
    takes no round trip. Mid-answer a tree's filler stays bounded by its size, and an untimed price
    bounds it at the answer's end too."""
    met = MetCounts()
    for n, seconds in ((6, 0.44), (33, 0.50)):
        for _ in range(2):  # (a count's first pass is not timed)
            met.note(n, seconds, tree=True)
    assert met.fill_to(7, 512, 0.4, tree=True) == 7  # 33 is more than twice 7 and FILL_SLACK
    assert met.fill_to(7, 512, 0.4, tree=True, ending=True) == 33
    assert met.fill_to(7, 512, 0.001, tree=True, ending=True) == 7  # dearer than a round trip a pass
    untimed = MetCounts()
    untimed.note(33, 0.5, tree=True)
    assert untimed.fill_to(7, 512, 0.4, tree=True, ending=True) == 7


def test_a_pass_asks_for_rows_of_logits_in_a_count_met_before():
    """Over RPC workers the last layer's products are over the rows of logits a pass asks for:
    their count is a shape of its own (two round trips where it is new). A shared pass's filler
    asks for rows up to the least count met (MetCounts.rows_for)."""
    met = MetCounts()
    assert met.rows_for(1, 9) == 1 and met.rows_for(0, 4) == 0  # a prompt's last row, or none
    assert met.rows_for(4, 9) == 9  # none met from 4 to 9: all, which a pass filled to 9 asks again
    met.note(17, 0.2, tree=True)  # a tree's pass: a row for each token
    met.note(13, 0.2, rows=6)  # a shared pass of 13 tokens that asked for 6 rows
    assert met.rows_for(4, 20) == 6 and met.rows_for(7, 20) == 17 and met.rows_for(7, 16) == 16
    assert 13 not in met.rows and 13 in met.counts


def test_a_turn_of_requests_together_is_timed_without_one_offs_and_ends_early_where_it_loses():
    """A turn restarts after a step that paid a one-off (the draft brought up to the prompts, a
    count of tokens new to the process over RPC workers); a turn that runs under TOGETHER_LOSING
    of the other mode's rate ends after a quarter of its window; one above it runs it whole."""
    now = [0.0]
    together = Together(window=16, retry=4, clock=lambda: now[0])
    assert together.drafts(4) is True
    now[0] += 2.0
    together.restart(4, True)
    together.restart(4, False)  # (not the turn under way: nothing)
    for _ in range(4):
        now[0] += 0.1
        together.record(4, True, 4)
    assert together.rate(4, True) == pytest.approx(40)  # 16 tokens in 0.4 s, the one-off left out
    assert together.drafts(4) is False
    for _ in range(2):  # 4 tokens in 0.4 s: a quarter of the window at a quarter of drafting's rate
        now[0] += 0.2
        together.record(4, False, 2)
    assert together.rate(4, False) == pytest.approx(10)
    assert together.drafts(4) is True  # the turn ended: the faster mode's
    for _ in range(4):
        now[0] += 0.1
        together.record(4, True, 4)
    # 2 requests: leaning at 0.6 of drafting's rate runs its whole window.
    assert together.drafts(2) is True
    for _ in range(4):
        now[0] += 0.1
        together.record(2, True, 4)
    assert together.drafts(2) is False
    for _ in range(7):
        now[0] += 1 / 12
        together.record(2, False, 2)
    assert together.rate(2, False) is None
    now[0] += 1 / 12
    together.record(2, False, 2)
    assert together.rate(2, False) == pytest.approx(24)


def test_the_assumed_prior_is_a_modest_gain_over_the_measured_pass():
    prior = rules.assumed_prior(plain_s=0.02, catch_up_s=0.001)
    # A drafting step right after another (no catch-up): the assumed speedup over plain steps.
    assert prior.draft_rate(1, 100.0) * prior.plain_s == pytest.approx(rules.ASSUMED_SPEEDUP)
    assert prior.accepted == rules.ASSUMED_ACCEPTED and prior.catch_up_s == 0.001


def _watched(accepted_of_four: int, steps: int = 12) -> Hindsight:
    """A hindsight of `steps` proposals of a 4-token chain, each accepted `accepted_of_four` deep."""
    hindsight = Hindsight(max_budget=4)
    for i in range(steps):
        tokens = [10 * i + k for k in range(1, 5)]
        hindsight.watch(DraftTree.chain(1, tokens, -0.1 * np.arange(1, 5)))
        hindsight.feed(tokens[:accepted_of_four] + [999])
    return hindsight


def test_a_drafter_gets_the_size_that_pays_and_none_where_a_tree_only_breaks_even():
    seconds = lambda nodes: 0.010 + 0.002 * np.asarray(nodes)  # a pass over the tree + its root
    assert rules.best_size(_watched(4), seconds, 4) == 4  # every token accepted: the whole chain
    assert rules.best_size(_watched(4), seconds, 2) == 2  # never above what the step may verify
    assert rules.best_size(_watched(0), seconds, 4) == 0  # nothing accepted: a plain step
    # One token accepted a step: a one-node tree emits 2 tokens a pass where a plain step emits 1.
    # It pays only where its pass costs less than twice a plain one by the margin (larger trees
    # are priced out here).
    def passes(one_node_s: float):
        return lambda nodes: np.select([np.asarray(nodes) == 0, np.asarray(nodes) == 1], [0.010, one_node_s], 1.0)
    margin = rules.STEP_MARGIN
    assert rules.best_size(_watched(1), passes(0.020 / (1 + 2 * margin)), 4) == 1
    assert rules.best_size(_watched(1), passes(0.020 / (1 + margin / 2)), 4) == 0


def test_beside_other_requests_a_tree_pays_for_what_it_adds_to_their_shared_pass():
    """One budget across requests: a request's tree is sized by the rate of the pass it shares
    (every request's tokens over the pass's seconds), the others' tokens in it as they posted."""
    # A CPU's pass: the first extra token is dear (the batched kernels take over), the next cheap.
    # One token accepted a step does not pay alone, but does beside three plain steps, which
    # have paid that jump already.
    jump = lambda nodes: np.where(np.asarray(nodes) < 1.5, 0.010, 0.020 + 0.0005 * (np.asarray(nodes) - 1))
    alone = lambda nodes: jump(np.asarray(nodes) + 1)  # the root and the tree
    assert rules.best_size(_watched(1), alone, 4) == 0
    assert rules.best_size(_watched(1), alone, 4, rules.Beside(tokens=3, emitted=3)) == 1
    # A pass whose every token costs alike: two tokens accepted of four pay alone (3 tokens for
    # 1.8 plain passes' time), but beside seven plain steps each node slows eight requests' tokens
    # and gains one request's: within the step margin, a plain step.
    line = lambda nodes: 0.010 + 0.004 * np.asarray(nodes)
    assert rules.best_size(_watched(2), line, 4) == 2
    assert rules.best_size(_watched(2), line, 4, rules.Beside(tokens=7, emitted=7)) == 0
    # The budget goes where acceptance is likeliest, whichever request it belongs to: beside a
    # copy (its whole 4-token chain accepted each pass), a free-text request's one-token bets stop
    # paying, while the copy keeps its whole chain beside the other's plain steps.
    line = lambda nodes: 0.010 + 0.003 * np.asarray(nodes)
    assert rules.best_size(_watched(1), line, 4) == 1
    assert rules.best_size(_watched(1), line, 4, rules.Beside(tokens=5, emitted=5)) == 0
    assert rules.best_size(_watched(4), line, 4, rules.Beside(tokens=1, emitted=1)) == 4


def _step(tokens: int, seconds: float, nodes: int) -> Step:
    return Step(list(range(tokens)), target_s=seconds, total_s=seconds, tree_nodes=nodes)


def test_a_step_is_plain_for_a_seeded_sample_and_as_large_as_allowed_without_a_guard():
    sizer = StepSizer()
    sizer.start(GREEDY)
    assert sizer.size(24, GREEDY) == 24
    assert sizer.size(24, SEEDED) == 0


def test_greedy_and_sampled_requests_have_guards_of_their_own(caplog):
    """A guard cut by greedy requests' losing trees does not cut sampled ones, and says so once at
    info level."""
    sizer = StepSizer(SpeedGuard(16, plain_s=0.010, window=4))
    sizer.start(GREEDY)
    with caplog.at_level(logging.DEBUG, logger="specrun"):
        for _ in range(3):
            for _ in range(4):
                if sizer.size(16, GREEDY):
                    sizer.record(_step(1, 0.020, 16))  # one token a step at twice a plain step's time
                else:
                    sizer.record(_step(1, 0.010, 0))  # the guard's own plain step
    greedy_cap = sizer.guard.cap
    assert greedy_cap < 16
    switches = [r for r in caplog.records if "switching to" in r.getMessage()]
    assert switches and [r.levelno for r in switches].count(logging.INFO) == 1
    sizer.start(SAMPLED)
    assert sizer.guard.cap == 16 and sizer.size(16, SAMPLED) == 16
    sizer.start(GREEDY)  # back to greedy: its guard, its cap grown back by GUARD_RECOVER at most
    assert sizer.guard.cap == min(16, max(1, greedy_cap) * rules.GUARD_RECOVER)


def test_no_module_outside_pay_keeps_a_threshold_of_its_own():
    """Thresholds that weigh speculation against plain decoding (margins, minimum speedups, drifts)
    are defined in decoding/pay/rules.py only; memory margins (bytes, allocations) are no such thing."""
    stray = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.parent.name == "pay":
            continue
        for node in ast.parse(path.read_text()).body:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
            for target in targets:
                name = getattr(target, "id", "").lstrip("_")
                if name.startswith("ALLOCATION") or "BYTES" in name:
                    continue  # memory: what llama.cpp allocated against the plan
                if name.endswith(("MARGIN", "SPEEDUP", "DRIFT", "GAIN", "FLOOR")) or "ASSUMED" in name:
                    stray.append(f"{path.relative_to(PACKAGE)}: {name}")
    assert stray == []


def test_requests_together_take_turns_and_keep_the_faster_mode():
    """Per count of requests: a turn drafting with the model, one leaning, then the faster one,
    the slower again every `retry` turns; a request coming or going starts a turn of its count."""
    now = [0.0]
    together = Together(window=10, retry=4, clock=lambda: now[0])

    def turn(requests: int, seconds: float) -> bool:
        drafting = together.drafts(requests)
        for _ in range(5):  # 5 steps of 2 tokens: one window
            now[0] += seconds / 5
            together.record(requests, drafting, 2)
        return drafting

    # 4 requests: drafting 10 tokens in 1 s, leaning in 0.5 s.
    assert turn(4, 1.0) is True and turn(4, 0.5) is False
    assert together.rate(4, True) == pytest.approx(10) and together.rate(4, False) == pytest.approx(20)
    assert [turn(4, 0.5 if not together.drafts(4) else 1.0) for _ in range(8)] == [False, False, False, True] * 2
    # 2 requests have their own turns: drafting wins there.
    assert turn(2, 0.2) is True and turn(2, 0.5) is False and turn(2, 0.2) is True
    # A step of a turn that ended (or of another count) is not counted.
    together.record(3, True, 100)
    assert together.rate(3, True) is None


def test_requests_together_measure_leaning_only_where_it_could_pay_and_retry_it_by_its_cost():
    """Leaning (no draft model) takes at most what the steps took without it, a pass no shorter
    than their least: 200 ms from a worker four requests' steps took 1 token each without the
    model in passes of 0.44 s or more (9 tokens/s at most) while drafting measured 54, and its
    first turn cost as much as six drafting turns. Where lookup brings many tokens a step it is
    measured. A slower mode measured is retried more rarely the slower it is."""
    now = [0.0]

    def drafting_turn(together, free: int) -> None:
        assert together.drafts(4) is True
        for _ in range(4):  # 4 steps of 6 tokens each in 0.44 s: 24 tokens, a window
            now[0] += 0.44 / 4
            together.record(4, True, 6, free=free, pass_s=0.44)

    together = Together(window=24, retry=4, clock=lambda: now[0])
    drafting_turn(together, free=1)
    assert together.rate(4, True) == pytest.approx(24 / 0.44)
    assert together.leaning_at_most(4) == pytest.approx(4 / 0.44)
    assert together.drafts(4) is True and together.rate(4, False) is None  # not measured: it cannot pay
    # Lookup accepting 4 tokens a step: leaning could make 5 a request a pass, more than half: measured.
    together = Together(window=24, retry=4, clock=lambda: now[0])
    drafting_turn(together, free=5)
    assert together.drafts(4) is False
    # Without figures for the steps (a caller that gives none) leaning is measured, as before.
    together = Together(window=24, retry=4, clock=lambda: now[0])
    assert together.drafts(4) is True
    for _ in range(4):
        now[0] += 0.11
        together.record(4, True, 6)
    assert together.leaning_at_most(4) is None and together.drafts(4) is False
    # The slower mode's retry: every `retry` turns while it is at least half as fast, then rarer.
    assert rules.together_retry_every(8, 20.0, 12.0) == 8 and rules.together_retry_every(8, 20.0, 10.0) == 8
    assert rules.together_retry_every(8, 54.0, 9.0) == 24
    assert rules.leaning_loses(54.0, 9.1) and not rules.leaning_loses(54.0, 30.0)
