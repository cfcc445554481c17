"""The experiment runner on the demo pair: modes take turns prompt by prompt, decoders fresh or
shared, a deadline and a time limit per decode; every mode's greedy output is plain decoding's."""

from __future__ import annotations

import time

import pytest

from specrun.core.tree_shapes import TreeShape
from specrun.experiments.runner import Modes, by_mode, decode_halves, decode_in_turn, merged
from specrun.runtime import drafters
from specrun.runtime.drafters import BEST_FIRST
from specrun.runtime.plan import RunOptions
from specrun.runtime.runtime import Runtime
from specrun.runtime.trees import LOOKUP_SHAPE, TreePlan

CHAIN = TreePlan(TreeShape.chain(3), BEST_FIRST, "flags")
LOOKUP = TreePlan(LOOKUP_SHAPE, drafters.LOOKUP, "flags", lookup=LOOKUP_SHAPE)
TEXTS = ["Name three fruits.", "Repeat after me: the cat sat on the mat.", "Count from one to five."]


@pytest.fixture(scope="module")
def rt(offline_models):
    with Runtime(RunOptions(threads=1, ctx_size=512, quiet=True)) as runtime:
        yield runtime


def test_every_mode_decodes_each_prompt_in_turn_as_plain_decoding_does(rt):
    prompts = [rt.tokenize_prompt(t, chat=True) for t in TEXTS]
    modes = Modes(rt, {"plain": None, "chain": CHAIN, "lookup": LOOKUP}, fresh=True)

    runs = decode_in_turn(modes, prompts, 12, warm_up=2)

    assert [run.prompt for run in runs] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert [run.mode for run in runs[::3]] == ["plain", "chain", "lookup"]  # each goes first once
    mine = by_mode(runs)
    for mode in ("chain", "lookup"):
        assert [run.tokens for run in mine[mode]] == [run.tokens for run in mine["plain"]]
    assert merged(mine["plain"]).n_generated == sum(len(run.tokens) for run in mine["plain"])


def test_shared_decoders_carry_their_session_from_prompt_to_prompt_and_fresh_ones_start_anew(rt):
    shared = Modes(rt, {"lookup": LOOKUP}, fresh=False)
    fresh = Modes(rt, {"lookup": LOOKUP}, fresh=True)

    assert shared.decoder("lookup") is shared.decoder("lookup")  # its lookup index learns on
    assert fresh.decoder("lookup") is not fresh.decoder("lookup")


def test_past_the_deadline_no_prompt_starts_but_the_first(rt):
    prompts = [rt.tokenize_prompt(t, chat=True) for t in TEXTS]
    modes = Modes(rt, {"plain": None, "chain": CHAIN}, fresh=True)

    runs = decode_in_turn(modes, prompts, 4, deadline=time.monotonic() - 1.0)

    assert [(run.mode, run.prompt) for run in runs] == [("plain", 0), ("chain", 0)]


def test_past_the_deadline_halves_stop_at_a_pair_so_both_hold_as_many_prompts(rt):
    prompts = [rt.tokenize_prompt(t, chat=True) for t in TEXTS]
    modes = Modes(rt, {"plain": None}, fresh=True)

    first, second = decode_halves(modes, (prompts[:2], prompts[1:]), 4, deadline=time.monotonic() - 1.0)
    assert [run.prompt for run in first] == [0] and [run.prompt for run in second] == [0]

    first, second = decode_halves(modes, (prompts[:2], prompts[1:]), 4, deadline=time.monotonic() + 600)
    assert [run.prompt for run in first] == [0, 1] and [run.prompt for run in second] == [0, 1]
    assert first[0].tokens == decode_in_turn(modes, prompts[:1], 4)[0].tokens


def test_a_decode_stops_once_its_seconds_have_passed(rt):
    prompts = [rt.tokenize_prompt(TEXTS[0], chat=True)]
    modes = Modes(rt, {"plain": None}, fresh=True)

    runs = decode_in_turn(modes, prompts, 64, seconds_each=0.0)

    assert len(runs[0].tokens) == 1  # the first step's token, then the time was up


def test_a_mode_decodes_the_tokens_given_it_and_the_others_max_tokens(rt):
    prompts = [rt.tokenize_prompt(t, chat=True) for t in TEXTS[:2]]
    modes = Modes(rt, {"plain": None, "chain": CHAIN}, fresh=True)

    runs = by_mode(decode_in_turn(modes, prompts, 8, tokens={"plain": 3}))

    assert [len(run.tokens) for run in runs["plain"]] == [3, 3]
    assert [len(run.tokens) for run in runs["chain"]] == [8, 8]
    assert [run.tokens[:3] for run in runs["chain"]] == [run.tokens for run in runs["plain"]]
    assert all(run.stats.decoded[0] == 2 for run in runs["plain"])  # the first token is the prompt's
