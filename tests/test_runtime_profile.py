"""A stored tuning profile decides how chat, generate and bench decode, without being asked.

Real demo models; the profile is written directly (tuning itself is tested in test_tuning.py).
"""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest

from specrun.core.sampling import SamplingParams
from specrun.core.tree_shapes import TreeTemplate
from specrun.decoding.drafters.best_first import TreeGrower
from specrun.decoding.drafters.sequoia import StaticTreeGrower
from specrun.decoding.plain import PlainDecoder
from specrun.decoding.speculative import SpeculativeDecoder
from specrun.decoding.stream import token_ids
from specrun.experiments.workloads import WORKLOADS
from specrun.decoding.pay import rules as pay_rules
from specrun.runtime.plan import WINDOW_LEAVES, RunOptions, build_plan
from specrun.runtime.runtime import Runtime
from specrun.runtime.trees import DEFAULT_SHAPE
from specrun.tuning import profiles
from specrun.tuning.cost_model import Choice

OPTS = RunOptions(threads=1, ctx_size=512, quiet=True, lookup=False)  # the draft model's tree alone (lookup branches join it by default)
PLAIN = Choice("plain", 0, 0, 0, 0, 20.0, 1.0)
# A root with two children; the first has one child of its own.
TEMPLATE = TreeTemplate(parents=(-1, 0, 0, 1), ranks=(0, 1, 2, 1))
SEQUOIA = Choice("sequoia", 3, 2, 2, 2, 30.0, 1.3, TEMPLATE)
SPECEXEC = Choice("specexec", 12, 6, 2, 3, 30.0, 1.3)
REWRITE = WORKLOADS["rewrite"][0]  # a copy task: drafts get accepted


def _store(offline_models, choice: Choice) -> None:
    key = profiles.profile_key(offline_models.smollm2_f32, offline_models.smollm2_q4, threads=OPTS.threads)
    profiles.save({"key": key, "config": choice.to_dict(), "predicted_speedup": 1.0, "measured_speedup": 1.0})


def test_without_a_profile_the_default_is_a_short_chain(offline_models):
    with Runtime(OPTS) as rt:
        assert isinstance(rt.decoder, SpeculativeDecoder)
        assert rt.shape == DEFAULT_SHAPE


def test_a_profile_that_chose_plain_decoding_decodes_plainly_without_loading_the_draft(offline_models):
    _store(offline_models, PLAIN)
    with Runtime(OPTS) as rt:
        assert type(rt.decoder) is PlainDecoder
        assert rt.draft is None and rt.draft_ctx is None
        assert not rt.speculative
        prompt = rt.tokenize_prompt("Name a colour.", chat=True)
        assert len(token_ids(rt.decoder, prompt, SamplingParams(), 8)) == 8


def test_a_profile_whose_draft_tree_lost_still_runs_lookup_on_a_copy(offline_models, caplog):
    """A stored "plain" (as older profiles and a tree that measured slower both store) turns off
    the draft model's trees, never lookup: a copy prompt is still drafted from its own text."""
    _store(offline_models, PLAIN)
    with caplog.at_level(logging.WARNING, logger="specrun"):
        rt = Runtime(replace(OPTS, lookup=None))
    with rt:
        assert rt.draft is None and rt.plan.drafter == "lookup" and "lookup alone" in rt.plan.why
        prompt = rt.tokenize_prompt(REWRITE, chat=True)
        token_ids(rt.decoder, prompt, SamplingParams(), 64)
        assert sum(step.lookup_tokens for step in rt.decoder.stats.steps) > 0
    assert any("older specrun" in r.getMessage() for r in caplog.records)  # an old profile: said once


def test_an_explicit_budget_overrides_a_plain_profile(offline_models):
    _store(offline_models, PLAIN)
    with Runtime(replace(OPTS, budget=7)) as rt:
        assert isinstance(rt.decoder, SpeculativeDecoder)
        assert rt.shape.budget == 7 and rt.shape.depth == 7  # the default kind (a chain) at that size


def test_a_sequoia_profile_grows_its_static_tree(offline_models):
    _store(offline_models, SEQUOIA)
    with Runtime(OPTS) as rt:
        grower = rt.decoder.drafter
        assert isinstance(grower, StaticTreeGrower)
        rt.decoder.path_alone = False  # (a greedy step here passes its first path alone: the whole tree, as on a GPU)
        prompt = rt.tokenize_prompt("Name a colour.", chat=True)
        token_ids(rt.decoder, prompt, SamplingParams(), 12)
        assert {s.tree_nodes for s in rt.decoder.stats.steps} <= {0, 1, 2, 3}
        assert max(s.tree_nodes for s in rt.decoder.stats.steps) == 3


@pytest.mark.parametrize("override, expected", [({}, (12, 6, 2, 3)), ({"depth": 3}, (12, 3, 2, 3)), ({"budget": 2}, (2, 6, 2, 2))])
def test_a_specexec_profile_and_its_overrides(offline_models, override, expected):
    _store(offline_models, SPECEXEC)
    with Runtime(replace(OPTS, **override)) as rt:
        assert type(rt.decoder.drafter) is TreeGrower
        s = rt.shape
        assert (s.budget, s.depth, s.width, s.top_k) == expected


def test_an_untuned_pair_gets_the_tuning_tip_once(offline_models, capsys):
    with Runtime(replace(OPTS, quiet=False)):
        pass
    with Runtime(replace(OPTS, quiet=False)):
        pass
    assert capsys.readouterr().err.count("specrun tune") == 1


def test_without_a_profile_a_long_copy_prompt_is_not_read_by_the_draft_before_lookup_has_looked(offline_models):
    """A fresh process, no profile, the default (draft tree + lookup): the draft model would first
    have to read the whole prompt. The first step is a plain or lookup step (it measures the
    target), and lookup carries the copy from there; the answer is the target's own."""
    with Runtime(replace(OPTS, lookup=None)) as rt:
        assert rt.plan.drafter == "hybrid"
        assert 0 < rt.decoder.drafter.catch_up_s < 1  # probed at load, the draft's cache left empty
        assert rt.decoder.drafter.draft.cache.tokens == []
        prompt = rt.tokenize_prompt(REWRITE, chat=True)
        assert len(prompt) > 100
        out = token_ids(rt.decoder, prompt, SamplingParams(), 48)
        steps = rt.decoder.stats.steps
        assert steps[1].draft_passes == 0 and steps[1].draft_s == 0.0
        assert sum(step.lookup_tokens for step in steps) > 0
    with Runtime(replace(OPTS, no_spec=True)) as plain:
        assert token_ids(plain.decoder, plain.tokenize_prompt(REWRITE, chat=True), SamplingParams(), 48) == out


def store_measured(offline_models, choice: Choice, pass_s: float, threads: int | None = OPTS.threads,
                   pair: tuple | None = None) -> None:
    """A profile with what tune measures, its target's one-token pass taking `pass_s` (`pair`:
    the target's and draft's paths, by default the demo pair)."""
    target, draft = pair or (offline_models.smollm2_f32, offline_models.smollm2_q4)
    key = profiles.profile_key(target, draft, threads=threads)
    profiles.save({
        "key": key, "config": choice.to_dict(), "best_tree": choice.to_dict(), "workloads": {},
        "predicted_speedup": 1.0, "measured_speedup": 1.0,
        "curves": {"target": {"sizes": [1, 8, 64], "seconds": [pass_s, 2 * pass_s, 8 * pass_s]},
                   "draft": {"sizes": [1, 64], "seconds": [0.7 * pass_s, 30 * pass_s]}, "draft_topk": None},
        "plain": {"target_s": pass_s, "overhead_s": 0.00003},
        "acceptance": {"tau": {"4": 3.1, "5": 3.4}},
    })


def test_a_profile_from_another_state_of_the_machine_is_set_aside_at_load(offline_models, capsys):
    """The profile found the draft's trees slower, when the target's pass took 10 s (another
    machine state, as far as this run can tell). The run times the pass at load, sees it is
    not so now, and decides as without the profile: the draft model loads and the hybrid, which
    times both models itself, decodes the target's own text."""
    store_measured(offline_models, PLAIN, pass_s=10.0)
    opts = replace(OPTS, lookup=None, quiet=False)
    with Runtime(opts) as rt:
        assert rt.profile_set_aside and 0 < rt.target_pass_s < 1
        assert rt.plan.drafter == "hybrid" and rt.draft is not None and rt.draft_ctx is not None
        assert rt.plan.check is None and "when the tuning profile was made" in rt.plan.why
        assert rt.decoder.drafter.prior is None  # its first steps come from its own timing
        prompt = rt.tokenize_prompt(REWRITE, chat=True)
        out = token_ids(rt.decoder, prompt, SamplingParams(), 48)
    err = capsys.readouterr().err
    assert "when this machine was tuned: this run decides as without the tuning profile" in err
    assert "tip:" not in err  # the pair is tuned: no suggestion to tune it
    with Runtime(replace(OPTS, no_spec=True)) as plain:
        assert token_ids(plain.decoder, plain.tokenize_prompt(REWRITE, chat=True), SamplingParams(), 48) == out


def test_a_profile_whose_timing_holds_decides_the_run(offline_models, monkeypatch):
    """Where the pass timed at load is the profile's (here: any pass is, with the drift widened),
    the profile's verdict stands: lookup alone, no draft model loaded."""
    store_measured(offline_models, PLAIN, pass_s=0.01)
    monkeypatch.setattr(pay_rules, "PROFILE_DRIFT", 1e6)
    with Runtime(replace(OPTS, lookup=None)) as rt:
        assert not rt.profile_set_aside and rt.target_pass_s > 0
        assert rt.plan.drafter == "lookup" and rt.draft is None and rt.plan.check is not None
        prompt = rt.tokenize_prompt(REWRITE, chat=True)
        token_ids(rt.decoder, prompt, SamplingParams(), 48)
        assert sum(step.lookup_tokens for step in rt.decoder.stats.steps) > 0


def test_a_sliding_window_target_with_a_profile_keeps_its_check(offline_models):
    """A sliding-window target opens a sequence per leaf of its largest tree. The profile's tree
    (12 nodes) and the default's it falls back to differ, so both plans open the target context
    for the larger: the fallback loads on the same context and the profile's check stays offered."""
    store_measured(offline_models, SPECEXEC, pass_s=0.01, pair=(offline_models.gemma_f32, offline_models.gemma_q4))
    opts = RunOptions(target="gemma3-270m-f32", draft="gemma3-270m-q4", ctx_size=1024, threads=1, quiet=True,
                      lookup=False)
    plan = build_plan(opts)
    assert plan.check is not None
    fallback = plan.check.fallback
    assert plan.tree.verified.budget == SPECEXEC.budget != fallback.tree.verified.budget
    widest = max(plan.tree.verified.budget, fallback.tree.verified.budget)
    # (the default's tree may grow to hundreds of nodes: a window per leaf up to WINDOW_LEAVES)
    assert plan.target_ctx == fallback.target_ctx and plan.target_ctx.n_seq_max == min(widest, WINDOW_LEAVES) + 1
    untuned = build_plan(opts, shape=DEFAULT_SHAPE)  # (the default alone sizes for itself)
    assert untuned.check is None and untuned.target_ctx.n_seq_max == DEFAULT_SHAPE.budget + 1
