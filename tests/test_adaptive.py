"""Adapting the verified tree to measured acceptance and cost (pure, no model)."""

import copy
from dataclasses import replace

import numpy as np
import pytest

from specrun.core.tree import DraftTree
from specrun.decoding.adaptive import (
    LONG_MATCH,
    REPEAT_MATCH,
    REPEAT_TRUST,
    DraftPrior,
    Hindsight,
    HindsightByKind,
    TargetCost,
)
from specrun.decoding.calibration import MAX_CHANCE, DraftCalibration
from specrun.decoding.drafters.base import ModelDrafter
from specrun.decoding.drafters.best_first import GrownTree
from specrun.decoding.drafters.hybrid import HybridDrafter
from specrun.decoding.drafters.lookup import LookupDrafter, SessionText
from specrun.decoding.lookup_index import graft
from specrun.decoding.pay.guard import SpeedGuard
from specrun.decoding.pay.rules import ALONE, STEP_MARGIN, Beside, best_lookup_size, best_size
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


def twenty_accepted_of_thirty() -> Hindsight:
    """The hindsight of 20 chains of 30 lookup tokens, each accepted 20 deep (a long copy)."""
    hindsight = Hindsight(max_budget=64)
    for _ in range(20):
        tokens = list(range(10, 40))
        hindsight.watch(chain(1, tokens))
        hindsight.feed(tokens[:20] + [0])
    return hindsight


def test_long_accepted_runs_pick_a_budget_that_pays():
    hindsight = twenty_accepted_of_thirty()
    cost = TargetCost()
    cost.observe(1, 0.010)
    cost.observe(17, 0.010 + 16 * 0.001)
    budget, _ = hindsight.best(lambda n: cost(n + 1))
    assert budget in (16, 24, 32)  # 20 accepted: beyond that a node only costs


def test_at_an_answers_last_tokens_a_budget_buys_no_more_than_the_depth_left():
    """What deep proposals accepted does not size a tree cut to an answer's last few tokens: there
    a large budget buys a wide shallow tree (lookup verified 26 nodes 6 deep, 48 ms for 7 tokens)."""
    hindsight = twenty_accepted_of_thirty()
    steep = lambda n: 0.010 + 0.0015 * n + 0.008 * (np.asarray(n) > 0)  # a CPU's pass: a tree dearer at once
    deep, _ = hindsight.best(steep, STEP_MARGIN)
    shallow, _ = hindsight.best(steep, STEP_MARGIN, depth=6)
    assert deep >= 16 and shallow <= 6, (deep, shallow)
    assert best_size(hindsight, steep, 64, depth=6) == shallow


def test_an_answers_last_tokens_between_two_budgets_go_in_one_pass():
    """A trusted repeat with 29 tokens left (depth 28): the grid's 24 would leave a pass of 4 after
    it; a tree cut to the 28 takes the answer's end in one pass. Mid-answer the grid is unchanged."""
    hindsight = Hindsight(max_budget=64, trust=REPEAT_TRUST)
    cpu = lambda n: 0.020 + 0.002 * np.asarray(n)  # a pass's fixed cost, then each token's
    assert hindsight.best(cpu, STEP_MARGIN, depth=28)[0] == 28
    assert hindsight.best(cpu, STEP_MARGIN, depth=64)[0] == 64 and hindsight.best(cpu, STEP_MARGIN)[0] == 64
    copied = twenty_accepted_of_thirty()  # 20 accepted of 30: 28 left buys no more than the 20
    assert copied.best(cpu, STEP_MARGIN, depth=28)[0] == copied.best(cpu, STEP_MARGIN)[0]


def test_one_dear_tree_pass_does_not_price_lookup_trees_out_for_good():
    """The run's first tree pass met a busy moment: alone it prices every tree out. Until
    SETTLED_PASSES tree passes were measured, the size the prior price picks is tried; then what
    they measured decides, a tree where they were cheap, none where they were all dear."""
    hindsight = twenty_accepted_of_thirty()
    busy = TargetCost()
    busy.observe(1, 0.010)
    busy.observe(3, 0.300)
    assert best_size(hindsight, lambda n: busy(n + 1), 64) == 0 and not busy.settled
    tried = best_lookup_size(hindsight, busy, 0.001, 64)
    assert tried >= 16
    quiet, dear = copy.deepcopy(busy), copy.deepcopy(busy)
    for _ in range(2):
        quiet.observe(tried + 1, 0.010 + tried * 0.001)
        dear.observe(tried + 1, 0.300 + tried * 0.010)
    assert quiet.settled and best_lookup_size(hindsight, quiet, 0.001, 64) >= 16
    assert dear.settled and best_lookup_size(hindsight, dear, 0.001, 64) == 0


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


def test_speed_guard_cuts_the_trees_that_run_not_a_nominal_budget():
    """The hybrid's budget counts its lookup branches (5 + 64) while on free text only its draft
    chain of 5 runs: halving 69 would take four windows (64 steps) to touch that chain."""
    guard = SpeedGuard(budget=69, plain_s=0.010, window=4)
    for _ in range(4):
        guard.record(6, 0.075, 5)  # 12.5 ms per token against plain's 10
    assert guard.cap == 2 and "at most 2 nodes" in guard.events[-1]
    guard.new_request()
    assert guard.cap == 8  # grows back from what it cut to


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


def test_speed_guard_measures_plain_after_a_tree_not_accepted_whole():
    """The plain step due (window // 2 speculative steps without a plain figure) waits while the
    last tree was accepted whole, up to as long again; after a tree cut short it comes at once."""
    guard = SpeedGuard(budget=16, window=4, probe_every=4)
    for _ in range(2):
        guard.record(6, 0.015, 5, whole=True)
    assert not guard.wants_plain_step()  # due, but a copy is under way
    guard.record(3, 0.015, 5, whole=False)
    assert guard.wants_plain_step()
    guard.record(1, 0.010, 0)  # measured: due every probe_every steps from now on
    for _ in range(7):
        guard.record(6, 0.015, 5, whole=True)
    assert not guard.wants_plain_step()
    guard.record(6, 0.015, 5, whole=True)
    assert guard.wants_plain_step()  # twice the interval: measured even so


def simulate(drafter, text, prompt_len, seconds=lambda n: 0.010 + 0.002 * (n - 1), overhead=None, guard=None):
    """Decode `text` after its first prompt_len tokens as a decoder would, the target "choosing"
    the text's own next tokens; return the steps' (tree nodes, accepted) pairs. `overhead(drafted)`:
    a step's seconds beside the target's and the draft's passes (0.2 ms); `guard`: a SpeedGuard
    whose plain steps measure plain decoding, as the decoder's does."""
    committed, root, at, out = list(text[: prompt_len - 1]), text[prompt_len - 1], prompt_len, []
    while at < len(text):
        probe = guard is not None and guard.wants_plain_step()
        grown = None if probe else drafter.propose(committed, root, 64, 16)
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
        draft_s, passes = (grown.draft_s, grown.draft_passes) if grown is not None else (0.0, 0)
        extra = overhead(passes > 0) if overhead is not None else 0.0002
        step = Step(emitted, target_s=seconds(nodes + 1), draft_s=draft_s, total_s=seconds(nodes + 1) + draft_s + extra,
                    tree_nodes=nodes, draft_passes=passes)
        drafter.observe(step)
        if guard is not None:
            guard.record(len(emitted), step.total_s, nodes)
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
    # Plain steps and, where a chance match looked promising, a node or two: once the copy is
    # forgotten, a token costs what plain decoding's does (10 ms here), give or take 3%.
    tail = free[-100:]
    seconds = sum(0.010 + 0.002 * n for n, _ in tail)
    assert seconds / sum(a + 1 for _, a in tail) <= 0.0103
    assert sum(n == 0 for n, _ in tail) >= 50


def test_a_quote_gets_its_first_tree_within_five_steps_wherever_it_starts():
    """An answer that turns to quoting its prompt, after 0 to 7 tokens of its own: while nothing
    pays, lookup looks at only every fourth proposal, but at every strong match (3 tokens or
    more), so the quote's first tree never waits on that schedule (it waited up to 7 steps)."""
    rng = np.random.default_rng(5)
    words = lambda n: [int(t) for t in rng.integers(100, 30000, n)]
    document = words(120)
    prompt = words(20) + document + [7]
    for lead in range(8):
        steps = simulate(LookupDrafter(64), prompt + words(lead) + document[:60] + words(5), prompt_len=len(prompt))
        emitted, start, first = 0, None, None
        for i, (nodes, accepted) in enumerate(steps):
            if start is None and emitted >= lead:
                start = i
            if first is None and nodes:
                first = i
            emitted += accepted + 1
        assert first - start <= 5, f"after {lead} tokens of its own, the quote's first tree came {first - start} steps in"


def test_session_text_indexes_only_what_is_new():

    text = SessionText(max_step=10)
    assert text.catch_up([1, 2, 3], 4) is None  # the first prompt
    assert text.catch_up([1, 2, 3, 4, 5], 6) == [5, 6]  # a step accepted 5, then drew 6
    assert text.index.live.tolist() == [1, 2, 3, 4, 5, 6]
    assert text.catch_up([1, 2, 3, 9], 9) is None  # a new prompt sharing a prefix
    assert text.index.live.tolist() == [1, 2, 3, 9, 9]
    assert text.catch_up([1, 2, 3, 9, 9] + list(range(100, 120)), 7) is None  # a long new turn


def test_target_cost_keeps_the_jump_to_batched_passes():
    """On a CPU a two-token pass costs far more than a one-token pass plus one token's share of a
    big pass: the line through the multi-token passes is not forced through the one-token figure."""
    cost = TargetCost()
    for _ in range(10):
        cost.observe(1, 0.015)
        cost.observe(2, 0.023)
        cost.observe(5, 0.031)
        cost.observe(17, 0.064)
    predicted = cost(np.array([1, 2, 5, 17, 33]))
    assert abs(predicted[0] - 0.015) < 1e-9
    assert 0.021 < predicted[1] < 0.027 and 0.029 < predicted[2] < 0.036 and 0.060 < predicted[3] < 0.068
    assert predicted[4] > predicted[3] + 16 * 0.002  # still rising by ~3 ms per token


def test_a_stalled_pass_does_not_make_every_size_cost_the_same():
    """Four requests' shared passes of 4-8 tokens (the demo target on a 2-core host: 27 ms, 2 ms a
    token more), then one 5-token pass that took 2.3 s (another process had the cores). Taken as
    measured, it pulled the line through the passes flat: every size cost the same 83 ms, so
    lookup's trees of 17-64 nodes looked free beside the other requests. Taken as STALL_FACTOR
    times the curve, the curve keeps rising with the tokens; passes of a machine that stays
    slower (up to that factor) move it as before."""
    rng = np.random.default_rng(0)
    curve = lambda n: 0.025 if n == 1 else 0.027 + 0.002 * (n - 2)
    cost = TargetCost()
    for _ in range(60):
        n = int(rng.choice([1, 4, 4, 5, 5, 6, 8]))
        cost.observe(n, curve(n) * (1 + 0.05 * rng.standard_normal()))
    five, deep = (float(s) for s in cost(np.array([5, 29])))
    cost.observe(5, 2.3)
    after_five, after_deep = (float(s) for s in cost(np.array([5, 29])))
    assert after_five < 1.25 * five, f"{1e3 * five:.1f} -> {1e3 * after_five:.1f} ms"
    assert after_deep - after_five > 0.75 * (deep - five), "24 more tokens should still cost about 2 ms each"
    for _ in range(12):  # (the machine is three times slower now, for good)
        cost.observe(5, 3 * curve(5))
    assert float(cost(np.array([5]))[0]) > 1.5 * five


def test_one_lucky_proposal_is_not_trusted_but_a_run_of_them_is():
    hindsight = Hindsight(max_budget=16, doubt=8.0)
    hindsight.watch(chain(1, [2, 3, 4, 5]))
    hindsight.feed([2, 3, 4, 5, 0])  # the first proposal ever: all four accepted
    cost = TargetCost()
    cost.observe(1, 0.015)
    cost.observe(5, 0.031)
    assert hindsight.best(lambda n: cost(n + 1))[0] == 0
    for _ in range(12):
        hindsight.watch(chain(1, [2, 3, 4, 5]))
        hindsight.feed([2, 3, 4, 5, 0])
    assert hindsight.best(lambda n: cost(n + 1))[0] == 4


def test_a_copy_in_progress_counts_what_it_will_likely_match_on():
    """A walk still matching is censored, not finished: with past proposals matching long runs,
    one that has matched 3 tokens so far is expected to go on, so deep trees pay at once."""
    hindsight = Hindsight(max_budget=32)
    for _ in range(6):
        tokens = list(range(10, 40))
        hindsight.watch(chain(1, tokens))
        hindsight.feed(tokens[:20] + [0])  # 20 matched, then a miss
    assert 15 < hindsight.expected_more() < 25
    hindsight.watch(chain(1, list(range(50, 80))))
    hindsight.feed([50, 51, 52])
    i = list(hindsight.budgets).index(16)
    assert hindsight.accepted()[i] > 14


def test_chance_matches_and_copies_are_told_apart():
    kinds = HindsightByKind(max_budget=16)
    assert kinds.kind(order=1) == (0, False)
    kinds[kinds.kind(order=4)].watch(chain(1, [2, 3, 4, 5, 6, 7, 8, 9]))
    kinds.feed([2, 3])
    assert kinds.kind(order=4) == (1, True)  # two matched: a short run (may be chance)
    kinds.feed([4, 5, 6, 7])
    assert kinds.kind(order=2) == (2, False)  # six: the text is copying
    kinds.feed([0])
    assert kinds.kind(order=4) == (0, True)  # the copy ended


def test_a_copy_under_way_does_not_earn_trust_again_at_each_run_level():
    kinds = HindsightByKind(max_budget=16)
    cost = lambda n: 0.010 + 0.002 * n  # seconds of a pass over n nodes
    for start in (0, 100, 200):
        kinds[(1, True)].watch(chain(1, list(range(start + 2, start + 10))))
        kinds.feed(list(range(start + 2, start + 10)))  # matched in full, three times
    assert kinds[(2, True)].best(cost)[0] == 0  # nothing of its own yet
    assert kinds.record((2, True)) is kinds[(1, True)] and kinds.record((2, True)).best(cost)[0] >= 8
    assert kinds.record((2, False)) is kinds[(2, False)]  # weak matches borrow only from weak ones
    kinds[(2, True)].watch(chain(1, [7, 8]))
    assert kinds.record((2, True)) is kinds[(1, True)]  # watched, but not yet met a token
    kinds.feed([0])
    assert kinds.record((2, True)) is kinds[(2, True)]  # its own record from now on


def test_a_long_match_among_earlier_answers_is_a_kind_of_its_own():
    """Copies of earlier answers (a long match measured backward) are sized by a record of their
    own: repeated answers accepted whole must not size the short matches of structured text (a
    JSON key among records of other values), nor those theirs; with nothing measured yet, a long
    match takes a strong one's record."""
    kinds = HindsightByKind(max_budget=32)
    assert kinds.kind(order=LONG_MATCH) == (0, 2) and kinds.kind(order=LONG_MATCH - 1) == (0, 1)
    cost = lambda n: 0.010 + 0.002 * n
    for start in (0, 100, 200):  # three repeated answers, each accepted whole
        kinds[(0, 2)].watch(chain(1, list(range(start + 2, start + 34))))
        kinds.feed(list(range(start + 2, start + 34)))
        kinds.feed([-1])  # (the answer ends: the next starts a new run)
    assert kinds.record((0, 2)).best(cost)[0] >= 24
    assert kinds.record((0, 1)) is kinds[(0, 1)] and kinds.record((0, 1)).best(cost)[0] == 0
    fresh = HindsightByKind(max_budget=32)
    fresh[(0, 1)].watch(chain(1, [2, 3, 4]))
    fresh.feed([2, 3, 4, -1])
    assert fresh.record((0, 2)) is fresh[(0, 1)]  # nothing long measured: the strong record


def test_a_greedy_repeat_starts_trusted_and_learns_otherwise():
    """A greedy request whose text repeats earlier text (the same prompt again) is sized from its
    first step as if proposals were accepted whole, as deep as the step may reach; a repeat that
    does not go on as before is cut down within a few steps, and the other kinds are untouched."""
    kinds = HindsightByKind(max_budget=64)
    assert kinds.kind(order=REPEAT_MATCH, repeat=True) == (0, 3) and kinds.kind(order=REPEAT_MATCH) == (0, 2)
    cost = lambda n: 0.020 + 0.002 * n  # a pass over n nodes
    repeat = kinds.record((0, 3))
    assert repeat is kinds[(0, 3)] and repeat.known
    assert best_lookup_size(repeat, TargetCost(), 0.0, 64, depth=32) > 0
    assert repeat.best(cost, depth=32)[0] == 32 and repeat.best(cost)[0] == 64
    assert kinds.record((0, 2)).best(cost)[0] == 0  # a long match alone earns its trust as before
    repeat.watch(chain(1, list(range(2, 66))))
    kinds.feed([1000])  # the repeat parts at its first token
    assert repeat.best(cost)[0] == 0
    again = HindsightByKind(max_budget=64)
    again[(0, 3)].watch(chain(1, list(range(2, 66))))
    again.feed(list(range(2, 34)))  # the repeat goes on as before
    assert again.record((2, 3)) is again[(2, 3)] and again[(0, 3)].best(cost, depth=32)[0] == 32


class ScriptedDraft(ModelDrafter):
    """A draft-model drafter that knows the text: it proposes the next 5 tokens right (a draft
    model that always agrees) for 5 ms a step, but catching up costs 4 ms per unread token, as
    the Q4_1 demo draft's does on a 2-core CPU."""

    def __init__(self, text):
        self.text, self.cached, self.calls = text, 0, 0
        self.last_catch_up = (0, 0.0)

    def debt(self, committed, root):
        return len(committed) + 1 - self.cached

    def propose(self, committed, root, budget, depth):
        self.calls += 1
        caught = self.debt(committed, root)
        self.last_catch_up = (caught, 0.004 * caught + 0.005)
        self.cached = len(committed) + 1
        at = len(committed) + 1
        tree = chain(root, self.text[at : at + min(5, budget, depth)] or [0])
        return GrownTree(tree, self.last_catch_up[1] + 0.005, 1 + len(tree) - 1)

    def commit(self, proposal, accepted_nodes):
        self.cached += len(accepted_nodes) - 1

    def reset(self):
        self.cached = 0


def hybrid_session(prompts_and_answers, max_tokens=96, prior=None, catch_up_s=None):
    """Decode each (prompt, answer) with a hybrid drafter over a ScriptedDraft; return the
    drafter, its draft and the (tree nodes, accepted) steps of the last answer. `catch_up_s`:
    what probing the draft's catch-up at load measured, per token."""
    text = [t for prompt, answer in prompts_and_answers for t in prompt + answer]
    draft = ScriptedDraft(text)
    hybrid = HybridDrafter(draft, 5, 64, prior=prior, catch_up_s=catch_up_s)
    start, steps = 0, []
    for prompt, answer in prompts_and_answers:
        draft.reset()  # a new request: the draft reads the whole prompt again
        hybrid.start(len(prompt), max_tokens)
        whole = text[start : start + len(prompt) + len(answer)]
        draft.text = whole
        calls = draft.calls
        steps = simulate(hybrid, whole, prompt_len=len(prompt), seconds=lambda n: 0.016 + (0.008 + 0.003 * (n - 2) if n > 1 else 0))
        hybrid.learn(whole, complete=True)
        start += len(prompt) + len(answer)
    return hybrid, draft.calls - calls, steps


def test_the_hybrid_leans_on_lookup_for_copies_after_long_prompts_and_drafts_free_text():
    rng = np.random.default_rng(3)
    words = lambda n: [int(t) for t in rng.integers(100, 30000, n)]  # noqa: E731
    # Copies: a 150-token document, then an answer that repeats 40 tokens of it. The draft model
    # would have to read 150 tokens (0.6 s) for a 40-token answer: lookup alone carries it.
    sessions = []
    for _ in range(5):
        document = words(150)
        sessions.append((document, document[60:100]))
    _, draft_calls, steps = hybrid_session(sessions)
    # (Were the catch-up free, the agreeing draft model would run on every step: 3 here.)
    assert draft_calls <= 1, f"the draft model ran {draft_calls} times for a copied answer"
    assert sum(a for _, a in steps) >= 25  # mostly verified from lookup
    # Free text after short prompts: nothing repeats, the draft model agrees -- it runs throughout.
    free = [(words(20), words(90)) for _ in range(3)]
    _, draft_calls, steps = hybrid_session(free)
    assert draft_calls >= len(steps) - 2 and sum(a for _, a in steps) >= 60


class MeasuredDraft(ScriptedDraft):
    """A draft chain of 5 that gets the first 4 tokens right (in its first chain, the first 2),
    with the demo pair's Q4_1 draft's costs on a 2-core host: 6.5 ms an expansion pass (one
    token), and a catch-up of n tokens 7.5 ms + 2.4 ms a token beyond the first (a 49-token chat
    prompt: 123 ms)."""

    def __init__(self, text):
        super().__init__(text)
        self.last_passes = []

    def propose(self, committed, root, budget, depth):
        self.calls += 1
        caught = self.debt(committed, root)
        self.last_catch_up = (caught, 0.0075 + 0.0024 * (caught - 1))
        at = len(committed) + 1
        right = 2 if self.calls == 1 else 4
        tokens = self.text[at : at + right] + [1] * (5 - right)  # the rest is wrong
        n = min(5, budget, depth)
        self.last_passes = [(1, 0.0065)] * (n - 1)
        self.cached = at + min(n - 1, right)  # the nodes up to the first wrong one are kept
        return GrownTree(chain(root, tokens[:n]), self.last_catch_up[1] + 0.0065 * (n - 1), n)

    def commit(self, proposal, accepted_nodes):
        pass  # `cached` already counts the chain's decoded nodes; the rejected one is dropped


def _measured_pair_run(target_s, prompt_len=49, answer_len=200):
    """A fresh hybrid (no profile) decoding free text with MeasuredDraft: a leaning step costs
    0.5 ms beside its target pass, a drafting step 2.5 ms (the draft's top-k rows, its sequences);
    return (seconds per token of the answer's second half, of plain decoding, the hybrid)."""
    rng = np.random.default_rng(12)
    text = [int(t) for t in rng.integers(100, 30000, prompt_len + answer_len)]
    draft = MeasuredDraft(text)
    hybrid = HybridDrafter(draft, 5, 64, catch_up_s=0.0024)
    hybrid.start(prompt_len, answer_len)
    overhead = lambda drafted: 0.0025 if drafted else 0.0005
    guard = SpeedGuard(64)  # its plain steps measure a plain step's cost
    steps = simulate(hybrid, text, prompt_len=prompt_len, seconds=target_s, overhead=overhead, guard=guard)
    late, tokens = [], 0
    for nodes, accepted in steps:
        tokens += accepted + 1
        if tokens > answer_len // 2:
            draft_s = 0.0075 + 0.0065 * (nodes - 1) if nodes else 0.0
            late.append((accepted + 1, target_s(nodes + 1) + draft_s + overhead(nodes > 0)))
    return sum(s for _, s in late) / sum(n for n, _ in late), target_s(1) + overhead(False), hybrid


def test_the_hybrid_prices_plain_steps_and_one_token_catch_ups_as_they_were_measured():
    """Two states of one 2-core host, the demo pair without a profile, free text after a 49-token
    chat prompt. Slow: a plain step 13.5 ms, verifying the chain 25 ms; drafting pays (5 tokens
    for 59 ms), though the first chain accepted only 2 of 5: the hybrid drafts. Fast: a plain
    step 10.1 ms, verifying the chain 25 ms; drafting loses (12.3 ms a token against 10.6). With
    a drafting step's bookkeeping taken for a plain step's (2.5 ms against 0.5) drafting looked
    the faster (chat ran at 0.85x plain); and leaning, running the draft again every 8 plain
    steps to measure it cost a catch-up of 9 tokens each time (0.94x plain here)."""
    slow = lambda n: 0.0135 if n == 1 else 0.0135 + 0.0023 * (n - 1)
    per_token, plain, hybrid = _measured_pair_run(slow)
    assert per_token < 0.9 * plain, f"{1e3 * per_token:.1f} ms a token against {1e3 * plain:.1f} plain"
    # A one-token catch-up is priced as the draft's one-token passes measured (6.5 ms), not from
    # the prompt's 49-token catch-up at a tenth of its cost a token (19 ms).
    assert float(hybrid.draft_pass(np.array([1]))[0]) == pytest.approx(0.0065, rel=0.1)
    fast = lambda n: 0.0101 if n == 1 else 0.0101 + 0.003 * (n - 1)
    per_token, plain, _ = _measured_pair_run(fast)
    assert per_token <= 1.03 * plain, f"{1e3 * per_token:.1f} ms a token against {1e3 * plain:.1f} plain"


def test_beside_other_requests_the_hybrid_prices_its_draft_in_the_pass_they_share():
    """The slow host of the test above, where the draft's chain pays alone (0.9x plain's time a
    token). Beside seven requests that each put a token into the target pass and emit one, the
    chain's five nodes and its draft passes (about 33 ms, every request waiting) slow eight
    requests' tokens: the pass gives 8 tokens in 30 ms leaning, 12 in 78 ms drafting. So the
    same hybrid leans beside them (the draft runs only to refresh its figures), and drafts
    again alone."""
    slow = lambda n: 0.0135 if n == 1 else 0.0135 + 0.0023 * (n - 1)
    _, _, hybrid = _measured_pair_run(slow)
    draft, rng = hybrid.draft, np.random.default_rng(13)

    def draft_calls(beside: Beside) -> tuple[int, int]:
        text = [int(t) for t in rng.integers(100, 30000, 200)]
        draft.text = text
        draft.reset()
        hybrid.start(49, 151)
        hybrid.beside = beside
        calls = draft.calls
        steps = simulate(hybrid, text, prompt_len=49, seconds=slow,
                         overhead=lambda drafted: 0.0025 if drafted else 0.0005)
        return draft.calls - calls, len(steps)

    calls, steps = draft_calls(Beside(tokens=7.0, emitted=7.0))
    assert calls <= steps // 4, f"beside seven requests the draft ran in {calls} of {steps} steps"
    calls, steps = draft_calls(ALONE)
    assert calls >= steps // 2, f"alone the draft ran in only {calls} of {steps} steps"


def test_where_even_a_whole_chain_loses_a_new_answer_does_not_start_by_running_the_draft():
    """A host where even the draft's chain accepted whole loses to plain steps (a plain step
    10.1 ms, verifying the chain 35 ms: 6 tokens in 71 ms with the draft's passes, against 94
    tokens/s plain). Sibling requests (JSON records under one schema, SQL over one table) share
    all of a prompt but its last tokens with the one before, so the draft has little to catch up
    with at an answer's start: the hybrid used to run it there once an answer to measure it again
    (110 ms a record on the demo pair, a tenth of its decoding), for nothing it could pay back."""
    fast = lambda n: 0.0101 if n == 1 else 0.0101 + 0.005 * (n - 1)
    _, _, hybrid = _measured_pair_run(fast)
    draft, rng = hybrid.draft, np.random.default_rng(14)
    calls = []
    for _ in range(4):
        text = [int(t) for t in rng.integers(100, 30000, 49 + 60)]
        draft.text, draft.cached = text, 49 - 10  # (the draft read all of this prompt but its last 10 tokens)
        hybrid.start(49, 60)
        before = draft.calls
        simulate(hybrid, text, prompt_len=49, seconds=fast, overhead=lambda drafted: 0.0025 if drafted else 0.0005)
        calls.append(draft.calls - before)
    assert calls == [0, 0, 0, 0], f"the draft ran {calls} times in four answers where it could not pay"


def test_without_a_profile_a_draft_that_could_not_pay_even_accepted_whole_never_runs():
    """The load's timings (no profile): plain steps 10 ms; the draft's chain of 5 accepted whole
    would pass 6 tokens for 62 ms (a 25 ms target pass, 37 ms of draft passes): 0.97x plain at
    best. The draft model never runs; free text decodes on plain steps. Where its chain would
    pass 6 tokens for 35 ms, it drafts from the first step."""
    rng = np.random.default_rng(9)
    words = lambda n: [int(t) for t in rng.integers(100, 30000, n)]
    prompt, answer = words(40), words(120)
    for step_s, drafts in ((0.037, False), (0.010, True)):
        best = DraftPrior(plain_s=0.010, tree_s=0.025, step_s=step_s, catch_up_s=0.0024, accepted=5.0)
        draft = ScriptedDraft(prompt + answer)
        hybrid = HybridDrafter(draft, 5, 64, catch_up_s=0.0024, best_case=best)
        hybrid.start(len(prompt), 160)
        assert hybrid.could_pay() == drafts
        steps = simulate(hybrid, prompt + answer, prompt_len=len(prompt))
        if drafts:
            assert draft.calls >= len(steps) - 1
        else:
            assert draft.calls == 0 and all(nodes == 0 for nodes, _ in steps)


# What a tuning profile measured for the scripted pair: a plain step 16 ms, a pass over the
# 5-token chain 36 ms, the draft's passes 5 ms, its catch-up 4 ms per token, 4 of 5 accepted.
PRIOR = DraftPrior(plain_s=0.016, tree_s=0.036, step_s=0.005, catch_up_s=0.004, accepted=4.0)


def test_a_fresh_process_does_not_pay_a_long_prompts_catch_up_for_an_answer_that_copies_it():
    """The first request of a process: nothing measured, no earlier answers. A 150-token prompt
    would cost the draft 0.6 s to read; the profile says drafting saves far less over the few
    steps in which lookup shows the answer is a copy: the draft model never runs."""
    rng = np.random.default_rng(5)
    document = [int(t) for t in rng.integers(100, 30000, 150)]
    session = [(document, document[60:100])]
    _, draft_calls, steps = hybrid_session(session, prior=PRIOR)
    assert draft_calls == 0 and sum(a for _, a in steps) >= 25
    # Without a profile: the catch-up cost probed at load, against a modest assumed gain from
    # drafting -- far dearer: no draft either.
    _, draft_calls, steps = hybrid_session(session, catch_up_s=0.004)
    assert draft_calls == 0 and sum(a for _, a in steps) >= 25
    # Even at a tenth of that cost, 150 tokens cost more than drafting is assumed to save over
    # the waiting steps.
    _, draft_calls, _ = hybrid_session(session, catch_up_s=0.0004)
    assert draft_calls == 0
    # Knowing nothing of the catch-up's cost, the first step reads the prompt.
    _, draft_calls, _ = hybrid_session(session)
    assert draft_calls >= 1


def test_after_a_copy_ends_a_fresh_process_weighs_the_draft_against_what_leaning_made_of_the_answer():
    """A fresh process, a long prompt, an answer that copies 100 tokens of it and then goes on in
    its own words. Where the copy ends, a few plain steps look at no lookup proposal; the draft
    model's catch-up is weighed against what leaning has made of the answer's recent steps, not
    against plain steps alone (Gemma's rewrites paid a 0.7 s catch-up there: 0.93x of leaning
    on). Once the answer's own words outweigh the copy, the draft model runs to the end."""
    rng = np.random.default_rng(8)
    words = lambda n: [int(t) for t in rng.integers(100, 30000, n)]
    document = words(150)
    # Gemma's draft reads a token in a tenth of a plain step's time.
    prior = replace(PRIOR, catch_up_s=0.0015)
    _, draft_calls, steps = hybrid_session([(document, document[20:120] + words(30))], max_tokens=600, prior=prior)
    assert draft_calls == 0 and sum(a for _, a in steps) >= 80
    _, draft_calls, steps = hybrid_session([(document, document[20:120] + words(400))], max_tokens=600, prior=prior)
    assert draft_calls >= 40 and all(nodes >= 5 for nodes, _ in steps[-30:-1])  # (the last: what max_tokens left)


def _first_draft_step(steps) -> int | None:
    return next((i for i, (nodes, _) in enumerate(steps) if nodes > 0), None)


def test_a_fresh_process_drafts_free_text_at_once_after_a_short_prompt_and_once_a_long_one_pays():
    rng = np.random.default_rng(6)
    words = lambda n: [int(t) for t in rng.integers(100, 30000, n)]  # noqa: E731
    _, draft_calls, steps = hybrid_session([(words(20), words(90))], prior=PRIOR)
    assert draft_calls >= len(steps) - 1  # a cheap catch-up: from the first step
    # 60 tokens (a question in a chat template with a system prompt) cost 0.24 s to read: more
    # than drafting saves over the first 16 tokens, but a short catch-up never waits (the
    # demo pair's tuned profile otherwise ran chat on plain steps: 0.95x).
    _, draft_calls, steps = hybrid_session([(words(60), words(90))], prior=PRIOR)
    assert draft_calls >= len(steps) - 1
    # A long prompt (0.6 s to read) and free text: nobody knows how long the answer will run.
    # Plain steps while the gain forgone is less than the catch-up (which grows with the
    # answer); a 90-token answer ends first, a 300-token one then drafts to its end.
    _, draft_calls, steps = hybrid_session([(words(150), words(90))], max_tokens=400, prior=PRIOR)
    assert draft_calls == 0
    _, draft_calls, steps = hybrid_session([(words(150), words(300))], max_tokens=400, prior=PRIOR)
    first = _first_draft_step(steps)
    assert first is not None and first >= 4 and draft_calls >= len(steps) - first - 1
    assert sum(a for _, a in steps) >= 100


def test_without_a_profile_free_text_is_drafted_at_once_after_a_short_prompt_and_once_a_long_one_pays():
    rng = np.random.default_rng(6)
    words = lambda n: [int(t) for t in rng.integers(100, 30000, n)]  # noqa: E731
    _, draft_calls, steps = hybrid_session([(words(20), words(90))], catch_up_s=0.004)
    assert draft_calls >= len(steps) - 1  # a short catch-up is never put off
    # A long prompt: the cheaper the draft reads it, the sooner the modest gain assumed pays
    # for reading it (a GPU's draft reads a prompt in a few milliseconds).
    starts = []
    for catch_up_s in (0.0005, 0.001, 0.002):
        _, draft_calls, steps = hybrid_session([(words(150), words(300))], max_tokens=400, catch_up_s=catch_up_s)
        starts.append(_first_draft_step(steps))
        assert starts[-1] is not None and draft_calls >= len(steps) - starts[-1] - 1
    assert all(nodes == 0 for nodes, _ in steps[:4]) and starts == sorted(starts) and starts[0] < starts[-1]
    # 4 ms a token (the demo draft on 2 CPU cores) costs more than that gain ever saves: plain steps.
    _, draft_calls, steps = hybrid_session([(words(150), words(300))], max_tokens=400, catch_up_s=0.004)
    assert draft_calls == 0


def test_a_new_request_wins_back_what_the_speed_guard_cut():
    """A busy moment (or text that never repeated) cut the guard to plain steps; within a few
    requests the full tree is back, each request judged on its own steps."""
    guard = SpeedGuard(budget=64, plain_s=0.010, window=4)
    while guard.cap:
        guard.record(1, 0.030, max(1, guard.cap))  # 30 ms per token against plain's 10
    assert guard.wants_plain_step()
    guard.record(1, 0.010, 0)  # a plain step, measured
    caps = []
    for _ in range(4):
        guard.new_request()
        caps.append(guard.cap)
    assert caps == [4, 16, 64, 64] and not guard.wants_plain_step()
    copy = guard.copy()
    assert copy.cap == 64 and copy.plain_s() == 0.010 and not copy.events


def test_leaning_on_lookup_the_hybrid_costs_no_more_than_lookup_alone():
    """A session whose earlier answers each began by copying a long stretch of their prompt, then
    an answer that never does, over a text full of chance matches. Leaning on lookup (the draft's
    catch-up is too dear to pay here), the hybrid must not keep verifying big trees on those
    chance matches where lookup alone tries one only now and then (a batch of Gemma rewrites
    ran at 0.81x lookup alone before): in simulated seconds, within 3% of lookup alone."""
    rng = np.random.default_rng(11)
    words = lambda n: [int(t) for t in rng.integers(100, 30000, n)]
    sessions = []
    for _ in range(3):
        document = words(150)
        sessions.append((document, document[:40] + words(30)))
    noise = [int(t) for t in rng.integers(100, 116, 150)]  # a tiny vocabulary: everything matches somewhere
    sessions.append((noise, [int(t) for t in rng.integers(100, 116, 120)]))
    seconds = lambda n: 0.016 + (0.008 + 0.003 * (n - 2) if n > 1 else 0)

    def total(drafter, draft=None):
        spent = 0.0
        for prompt, answer in sessions:
            if draft is not None:
                draft.reset()
                draft.text = prompt + answer
                drafter.start(len(prompt), 128)
            steps = simulate(drafter, prompt + answer, prompt_len=len(prompt), seconds=seconds)
            drafter.learn(prompt + answer, complete=True)
            spent = sum(seconds(n + 1) for n, _ in steps)  # the last request's
        return spent

    draft = ScriptedDraft([])
    hybrid = HybridDrafter(draft, 5, 64, catch_up_s=0.05)  # reading a prompt costs seconds: lean
    lean = total(hybrid, draft)
    assert draft.calls == 0
    alone = total(LookupDrafter(64))
    assert lean <= 1.03 * alone, f"the hybrid spent {lean:.3f} s where lookup alone spent {alone:.3f} s"


def test_a_fresh_hybrid_leaning_on_lookup_makes_lookup_alones_steps():
    """A fresh process whose long prompt the draft model would be slow to read, and an answer
    that quotes it after a few words of its own: leaning on lookup, the hybrid verifies exactly
    the trees lookup alone would (looking at its first step, which lookup alone leaves to its
    idle schedule, it sized the demo pair's rewrites' trees otherwise: 0.96x lookup alone)."""
    rng = np.random.default_rng(7)
    words = lambda n: [int(t) for t in rng.integers(100, 30000, n)]
    for lead in range(4):
        document = words(150)
        prompt, answer = words(10) + document + [7], words(lead) + document[20:90] + words(5)
        draft = ScriptedDraft(prompt + answer)
        hybrid = HybridDrafter(draft, 5, 64, catch_up_s=0.05)  # reading the prompt costs seconds
        hybrid.start(len(prompt), 128)
        lean = simulate(hybrid, prompt + answer, prompt_len=len(prompt))
        assert draft.calls == 0
        assert lean == simulate(LookupDrafter(64), prompt + answer, prompt_len=len(prompt))


class GemmaLikeDraft(ScriptedDraft):
    """A draft model that always agrees (its chain of 5 accepted whole), at the Gemma pair's costs
    on a 2-core host: 10 ms an expansion pass, a catch-up of n tokens 10 ms + 1 ms a token beyond
    the first, beside the target's 20 ms one-token passes: its steps pay (6 tokens for 70-80 ms
    against 20 ms a token), but a tenth of a pass less than lookup branches that carry the text
    alone."""

    def propose(self, committed, root, budget, depth):
        self.calls += 1
        caught = self.debt(committed, root)
        self.last_catch_up = (caught, 0.010 + 0.001 * (caught - 1))
        at = len(committed) + 1
        n = min(5, budget, depth)
        self.last_passes = [(1, 0.010)] * (n - 1)
        self.cached = at + n - 1
        return GrownTree(chain(root, (self.text[at: at + n] + [1] * n)[:n]), self.last_catch_up[1] + 0.010 * (n - 1), n)

    def commit(self, proposal, accepted_nodes):
        pass  # `cached` already counts the chain's decoded nodes


def test_where_lookup_branches_carry_the_drafting_steps_the_hybrid_leans_on_lookup_as_soon_as_it_would():
    """A chat answer that repeats its question line after line, as Gemma-270M's do: drafting
    steps whose lookup branches carry 17 tokens teach each kind of lookup proposal little (a
    kind's record starts from steps of nothing accepted, which fade with the proposals it
    watches, and each such step is one). What lookup alone would have made of the steps that
    drafted prices leaning meanwhile: the hybrid takes no more than 1.1x lookup alone's seconds
    (drafting on through the copies, it took 1.42x: Gemma's chat ran at 0.78x lookup alone so),
    and its first steps draft, as lookup alone has nothing yet."""
    rng = np.random.default_rng(1)
    question, extra = [int(t) for t in rng.integers(100, 30000, 16)], [int(t) for t in rng.integers(100, 30000, 4)]
    prompt = [1, 2, 3] + question + [4, 5]
    answer = question + [77] + ([88] + extra + question + [77]) * 8
    text = prompt + answer
    seconds = lambda n: 0.020 + 0.0015 * (n - 1)

    def run(drafter):
        spent = []
        observe = drafter.observe
        drafter.observe = lambda step: (spent.append(step.total_s), observe(step))
        steps = simulate(drafter, text, prompt_len=len(prompt), seconds=seconds)
        return steps, sum(spent)

    draft = GemmaLikeDraft(text)
    hybrid = HybridDrafter(draft, 5, 64, catch_up_s=0.001)
    hybrid.start(len(prompt), 256)
    steps, hybrid_s = run(hybrid)
    _, alone_s = run(LookupDrafter(64))
    assert hybrid_s <= 1.1 * alone_s, f"the hybrid took {hybrid_s:.3f} s where lookup alone took {alone_s:.3f} s"
    assert draft.calls >= 2 and steps[0] == (5, 5)  # the draft's chain, accepted whole


def test_draft_calibration_scores_children_by_how_often_the_target_took_them():
    calibration = DraftCalibration()
    rows = np.log(np.array([[0.55, 0.30], [0.52, 0.35], [0.995, 0.004]]))
    # Nothing judged yet: the draft's own probabilities (capped below certainty).
    assert np.allclose(calibration.scores(rows), np.log(np.minimum(np.exp(rows), MAX_CHANCE)))
    assert calibration.first_choices() == (0.0, 0.0)
    # A draft far surer than it says: its first choices near 0.5 taken 19 times of 20, its second
    # choices near 0.3 never.
    n = 200
    first = np.log(np.full(n, 0.55))
    second = np.log(np.full(n, 0.32))
    calibration.judge(first, np.ones(n, bool), np.arange(n) % 20 != 0)
    calibration.judge(second, np.zeros(n, bool), np.zeros(n, bool))
    judged, share = calibration.first_choices()
    assert judged == pytest.approx(n * calibration.keep ** n, rel=0.01) and share == pytest.approx(0.95, abs=0.01)
    scores = np.exp(calibration.scores(rows))
    assert scores[0, 0] > 0.85 and scores[1, 0] > 0.85  # first choices: the target's 0.95, not the draft's 0.55
    assert scores[0, 1] < 0.1 and scores[1, 1] < 0.1  # second choices: the target never took them
    assert scores[0, 0] > scores[1, 0]  # the draft's order within a tenth stays
    assert scores[2, 0] == pytest.approx(MAX_CHANCE)  # never certain: a child scores below its parent
    # A best-first tree of 16 nodes scored so is the chain of first choices, where the draft's own
    # scores spent its nodes on second choices.

    def grown_depth(score) -> int:
        tree = DraftTree(1)
        for _ in range(16):
            leaves = tree.leaves()
            best = int(leaves[np.argmax(tree.logps[leaves])])
            tree.expand([best], np.array([[10, 20]]), score(rows[:1]))
        tree.prune_to_best(16)
        return tree.max_depth

    assert grown_depth(calibration.scores) == 16 > 2 * grown_depth(lambda lps: lps)


def test_over_rpc_workers_a_sizes_first_pass_prices_nothing_once_others_are_measured():
    """200 ms from its worker the demo target's first 6-token pass took 2.05 s (llama.cpp asks the
    worker the sizes of a new shape's products), the next ones 0.44 s."""
    apart = TargetCost()
    apart.set_first_passes_apart()
    apart.observe(6, 2.05)
    assert apart.known and float(apart(np.array([6]))[0]) == pytest.approx(2.05)  # nothing else yet: it stands in
    for n, seconds in ((6, 0.44), (1, 2.0), (1, 0.418), (33, 2.10)):  # (33: a new size's first pass)
        apart.observe(n, seconds)
    assert float(apart(np.array([6]))[0]) == pytest.approx(0.44)
    assert float(apart(np.array([1]))[0]) == pytest.approx(0.418)
    assert float(apart(np.array([33]))[0]) < 0.6
    kept = TargetCost()  # (the target on this machine: every pass is a point of the curve)
    kept.observe(6, 2.05)
    kept.observe(6, 0.44)
    assert float(kept(np.array([6]))[0]) > 1.0
