"""`specrun tune` end to end, the Sequoia static-tree grower, and the tune report.

The end-to-end tests run the demo pair (SmolLM2 F32 target + Q4_1 draft) on one thread with tiny
settings; the real `--quick` run, on a tenth of its time budgets, is marked slow (deselect with
-m "not slow").
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time

import pytest

from specrun import engine, sysinfo
from specrun.commands import tune as tune_command
from specrun.commands import tune_workloads
from specrun.core.sampling import SamplingParams
from specrun.core.tree_shapes import TreeTemplate, template_shape
from specrun.decoding.drafters.sequoia import StaticTreeGrower, truncate_template
from specrun.decoding.plain import PlainDecoder
from specrun.decoding.speculative import SpeculativeDecoder
from specrun.decoding.stream import token_ids
from specrun.errors import SpecrunError, UsageError
from specrun.experiments.workloads import KINDS, ROUNDS, WORKLOADS
from specrun.runtime.plan import RunOptions, build_plan
from specrun.runtime.runtime import Runtime
from specrun.runtime.trees import DEFAULT_GROWTH, DEFAULT_SHAPE, tree_of_choice, tuned_default
from specrun.tuning import attention as tuning_attention
from specrun.tuning import profiles, report
from specrun.tuning.cost_model import sequoia_tree

PROMPT = "<|im_start|>user\nWrite a haiku about autumn leaves.<|im_end|>\n<|im_start|>assistant\n"
TINY = tune_command.TuneSettings(
    max_budget=8, depth=4, width=2, top_k=2, curve_repeats=1, curve_seconds=10,
    calibration_prompts=1, calibration_tokens=16, calibration_seconds=30,
    check_prompts=1, check_tokens=16, check_seconds=30, workload_tokens=8, workload_prompts=2,
)


# --------------------------------------------------------------------------------------------
# Sequoia grower


def test_truncated_template_is_a_breadth_first_prefix_within_the_depth():
    _, tree = sequoia_tree([0.6, 0.2, 0.1], 20, 5)

    cut = truncate_template(tree, budget=6, depth=2)

    assert cut.size == 7 and cut.depth <= 2
    for i in range(1, cut.size):
        assert cut.parents[i] < i
    # node i of the cut is the i-th node of depth <= 2 in the original
    kept = [i for i in range(tree.size) if tree.depths[i] <= 2][:7]
    assert list(cut.ranks) == [tree.ranks[i] for i in kept]


def test_template_shape_describes_the_tree():
    tree = TreeTemplate((-1, 0, 0, 1, 1, 2), (0, 1, 2, 1, 2, 1))

    shape = template_shape(tree)

    assert (shape.budget, shape.depth, shape.width, shape.top_k) == (5, 2, 2, 2)


@pytest.fixture(scope="module")
def contexts(offline_models, load_model):
    target = load_model(offline_models.smollm2_f32)
    tctx = engine.Context(target, n_ctx=1024, n_batch=64, n_seq_max=engine.MAX_SEQ, threads=1)
    yield target, tctx
    tctx.close()


@pytest.mark.parametrize("draft_name", ["smollm2_q4", "smollm2_random"])
def test_static_tree_output_is_exactly_plain_greedy(contexts, offline_models, load_model, draft_name):
    target, tctx = contexts
    draft = load_model(getattr(offline_models, draft_name))
    _, tree = sequoia_tree([0.75, 0.12, 0.05], 14, 5)
    prompt = target.tokenize(PROMPT)
    with engine.Context(draft, n_ctx=1024, n_batch=64, n_seq_max=engine.MAX_SEQ, threads=1) as dctx:
        tctx.clear()
        plain = token_ids(PlainDecoder(target, tctx), prompt, SamplingParams(), 40)
        tctx.clear()
        grower = StaticTreeGrower(draft, dctx, tree)
        spec = SpeculativeDecoder(target, tctx, grower, template_shape(tree))
        spec.path_alone = False  # (the whole tree in the pass, its first path read: the tree passes under test)
        out = token_ids(spec, prompt, SamplingParams(), 40)
        steps = spec.stats.steps

    assert out == plain
    full = [s for s in steps if s.tree_nodes == tree.size - 1]
    assert full, "no step grew the whole template"
    # one catch-up pass, then one pass per level that has inner nodes
    assert all(s.draft_passes == 1 + len(tree.expanding_widths()) - 1 for s in full)
    if draft_name == "smollm2_q4":
        assert spec.stats.accepted_per_pass > 2.0


# --------------------------------------------------------------------------------------------
# End to end


def _demo_opts() -> RunOptions:
    return RunOptions(threads=1, ctx_size=1024, quiet=True)


def test_tune_stores_a_checked_profile_that_runs_find(offline_models, capsys):
    profile = tune_command.tune(_demo_opts(), TINY)

    assert profile["config"]["kind"] in ("plain", "specexec", "sequoia")
    assert profile["predicted_speedup"] > 0 and profile["measured_speedup"] > 0
    assert profile["check"]["identical_output"] is True
    assert profile["check"]["tokens"] > 0
    # The check also decoded the untuned default (unless the best tree is that chain already).
    chain5 = (profile["best_tree"]["budget"], profile["best_tree"]["depth"], profile["best_tree"]["width"]) == (5, 5, 1)
    assert profile["check"]["default_tokens_per_s"] > 0 or chain5
    assert profile["calibration"]["n_steps"] > 0
    assert profile["curves"]["target"]["sizes"][0] == 1
    # The one-token pass as a run times it at load, for its check against this profile.
    assert 0 < profile["plain"]["load_pass_s"] < 1
    # What runs by default, predicted on half of each workload's prompts and measured on the rest.
    assert set(profile["workloads"]) == {"chat", "code", "rewrite"}
    for row in profile["workloads"].values():
        assert row["predicted_speedup"] > 0 and row["measured_speedup"] > 0
        assert row["prompts"] == 2 and 0 < row["measured_range"][0] <= row["measured_range"][1]
        low, high = row["predicted_range"]  # one prompt a half: no spread known, a point
        assert low == pytest.approx(row["predicted_speedup"], abs=1e-3) == pytest.approx(high, abs=1e-3)
        assert row["drafter"] == ("lookup" if profile["config"]["kind"] == "plain" else "hybrid")
    # The untuned default decoded the predicting prompts too (unless it is what the tune chose);
    # it is stored exactly where the tuned tree ran some workload slower than it.
    rows = profile["workloads"].values()
    if all("untuned_speedup" in row for row in rows):
        assert all(row["tuned_speedup"] > 0 and row["untuned_speedup"] > 0 for row in rows)
        kept_untuned = any(row["tuned_slower"] for row in rows)
        assert ("tuned_config" in profile) == kept_untuned
        # Both decoded the held-out prompts too; the figure reported is that of what was stored.
        kept = "untuned" if kept_untuned else "tuned"
        assert all(row["measured_speedup"] == row[f"{kept}_measured_speedup"] > 0 for row in rows)
        tuned = profile["tuned_config"] if kept_untuned else profile["config"]
        assert all(row["tuned_drafter"] == ("lookup" if tuned["kind"] == "plain" else "hybrid") for row in rows)
        if kept_untuned:
            assert (profile["config"]["kind"], profile["config"]["budget"], profile["config"]["depth"]) == ("specexec", 5, 5)
    else:
        assert chain5 and profile["config"]["kind"] != "plain" and "tuned_config" not in profile
    assert profiles.facts_of(profile) is not None
    # chat/generate/bench look it up by the model files (and thread count)
    choice = profiles.choice_for(offline_models.smollm2_f32, offline_models.smollm2_q4, threads=1)
    assert choice is not None and choice.to_dict() == profile["config"]

    capsys.readouterr()
    tune_command.run_tune(_demo_opts(), quick=False, show=True, as_json=True, plot=None)
    shown = json.loads(capsys.readouterr().out)
    assert {"config", "predicted_speedup", "measured_speedup"} <= set(shown)
    assert shown["config"] == profile["config"]

    tune_command.run_tune(_demo_opts(), quick=False, show=True, as_json=False, plot=None)
    report = capsys.readouterr().err
    assert "speedup" in report or "plain decoding" in report
    assert "tau(B)" in report
    assert "stored:" in report and "code (" in report and "held-out" in report and " each)" in report


def test_show_without_a_profile_says_to_tune(offline_models):
    with pytest.raises(SpecrunError, match="specrun tune"):
        tune_command.run_tune(_demo_opts(), quick=False, show=True, as_json=False, plot=None)


def test_tune_without_a_draft_is_a_usage_error(offline_models):
    opts = RunOptions(threads=1, ctx_size=1024, quiet=True, no_spec=True)
    with pytest.raises(UsageError, match="draft"):
        tune_command.tune(opts, TINY)


def test_plot_without_matplotlib_is_a_clear_error_before_any_work(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if not installed
    with pytest.raises(UsageError, match=r"specrun\[plot\]"):
        tune_command.run_tune(_demo_opts(), quick=True, show=False, as_json=False, plot=tmp_path / "p.png")


def _synthetic_profile(kind: str = "specexec") -> dict:
    config = {"kind": kind, "budget": 24 if kind != "plain" else 0, "depth": 8 if kind != "plain" else 0,
              "width": 4 if kind != "plain" else 0, "top_k": 4 if kind != "plain" else 0,
              "predicted_tokens_per_s": 60.0, "predicted_speedup": 1.5 if kind != "plain" else 1.0}
    return {
        "models": {"target": "t", "draft": "d"},
        "threads": 2,
        "config": config,
        "predicted_speedup": config["predicted_speedup"],
        "measured_speedup": 1.4 if kind != "plain" else 1.0,
        "best_tree": {**config, "kind": "specexec", "budget": 4, "depth": 4, "width": 1, "top_k": 1, "predicted_speedup": 0.9},
        "check": {"plain_tokens_per_s": 40.0, "tree_tokens_per_s": 56.0, "tree_measured_speedup": 0.85,
                  "accepted_per_pass": 3.2, "identical_output": True},
        "curves": {"target": {"sizes": [1, 2, 4, 8], "seconds": [0.026, 0.028, 0.031, 0.041]},
                   "draft": {"sizes": [1, 2, 4], "seconds": [0.011, 0.012, 0.013]}},
        "acceptance": {"tau": {str(b): 1 + min(b, 6) * 0.8 for b in range(1, 25)}},
    }


def test_report_shows_choice_prediction_and_charts():
    lines = report.report_lines(_synthetic_profile())
    text = "\n".join(lines)

    assert "SpecExec tree, budget 24, depth 8" in text
    assert "predicted x1.50, measured x1.40" in text
    assert "█" in text and "ms" in text
    assert any(line.strip().startswith("24 ") for line in lines)  # the largest budget is charted

    plain = "\n".join(report.report_lines(_synthetic_profile("plain")))
    assert "plain decoding" in plain and "measured x0.85" in plain
    assert "flash attention:" not in text  # (a profile without the figures: a GPU's, or from before them)
    timed = {**_synthetic_profile(), "attention": {"advice": "with flash attention ...: keep the default"}}
    assert "flash attention: with flash attention ...: keep the default" in report.report_lines(timed)


def test_plot_is_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "tune.png"

    report.write_plot(_synthetic_profile(), path)

    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_quick_tune_of_the_demo_pair(offline_models, capsys, monkeypatch):
    """`specrun tune --quick --json` on the demo pair at the default thread count: --quick's trees,
    prompts and token counts, on a tenth of its time budgets (half a minute rather than three:
    the budgets only say when no further prompt starts, and their deadlines are tested in
    test_experiments and below; a quiet 2-core machine still measures the same cost curves and
    every check prompt, and four prompts a workload). How long the real --quick takes is for
    docs/tuning.md to say, not for a timed assertion on a machine of unknown speed."""
    quick = tune_command.QUICK
    monkeypatch.setattr(tune_command, "QUICK", dataclasses.replace(
        quick, curve_seconds=quick.curve_seconds / 10, calibration_seconds=quick.calibration_seconds / 10,
        check_seconds=quick.check_seconds / 10, workload_seconds=quick.workload_seconds / 10))
    tune_command.run_tune(RunOptions(quiet=True), quick=True, show=False, as_json=True, plot=None)
    profile = json.loads(capsys.readouterr().out)

    assert {"config", "predicted_speedup", "measured_speedup"} <= set(profile)
    assert profile["check"]["identical_output"] is True
    assert set(profile["workloads"]) == set(WORKLOADS)
    assert all(2 <= w["prompts"] <= tune_command.QUICK.workload_prompts for w in profile["workloads"].values())
    assert profile["seconds"] > 0
    # The target's attention runs on this CPU: its passes timed with flash attention and without
    attention = profile["attention"]
    assert attention["cells"] == 1024 and list(attention["with_s"]) == ["1", "8", "16"]
    assert all(s > 0 for s in {**attention["with_s"], **attention["without_s"]}.values())
    assert ("`--flash-attn off` suits" in attention["advice"]) is attention["off_pays"]
    # ...kept for later runs of one request at a time, plain decoding's included, which open the
    # target's context as they say (and tune measured its curves on that context)
    kept = tuning_attention.stored_costs(offline_models.smollm2_f32, engine.default_threads())
    assert kept is not None and kept.to_dict() == attention
    for opts in (RunOptions(quiet=True), RunOptions(quiet=True, no_spec=True)):
        assert build_plan(opts).target_ctx.flash_attn == ("off" if attention["off_pays"] else None)


def test_busy_machine_is_detected_from_current_cpu_use_not_past_load():
    import multiprocessing

    quiet = sysinfo.cpu_busy_fraction(0.3)
    assert quiet is not None and 0.0 <= quiet <= 1.0
    spinners = [multiprocessing.Process(target=_spin, args=(3.0,)) for _ in range(os.cpu_count() or 2)]
    for p in spinners:
        p.start()
    try:
        time.sleep(0.3)
        busy = sysinfo.cpu_busy_fraction(0.5)
    finally:
        for p in spinners:
            p.join()
    assert busy is not None and busy > report.BUSY_FRACTION
    assert busy > quiet


def _spin(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def _check_result(plain: float, tree: float, default: float) -> tune_command.CheckResult:
    return tune_command.CheckResult(plain, tree, 3.0, True, 3, 100, default_tokens_per_s=default, default_accepted_per_pass=5.5)


def test_a_tuned_tree_that_measures_slower_than_the_untuned_default_is_not_stored():
    """Full tune on the demo pair picked a chain of 3 (predicted 0.99x, measured 1.13x) where the
    untuned chain of 5 decodes chat at ~1.2x: stored, it made every later chat slower."""
    chain3 = tune_command.tuner.Choice("sequoia", 3, 3, 1, 1, 39.0, 0.99)
    default = tune_command._untuned_default(chain3, max_budget=512)
    assert (default.budget, default.depth, default.width, default.grow) == (5, 5, 1, DEFAULT_GROWTH)
    choice, best, check = tune_command._prefer_the_default(chain3, chain3, default, _check_result(36.5, 41.3, 46.0))
    assert choice == best and (best.kind, best.budget, best.depth) == ("specexec", 5, 5)
    assert check.tree_tokens_per_s == 46.0 and check.accepted_per_pass == 5.5
    assert best.predicted_speedup == pytest.approx(46.0 / 36.5)  # what it measured, for the report
    # Within the margin the tuned tree stays; a plain choice stays plain (the later rules decide).
    assert tune_command._prefer_the_default(chain3, chain3, default, _check_result(36.5, 41.3, 42.0))[0] == chain3
    plain = tune_command.tuner.Choice("plain", 0, 0, 0, 0, 36.0, 1.0)
    choice, best, _ = tune_command._prefer_the_default(plain, chain3, default, _check_result(36.5, 41.3, 46.0))
    assert choice == plain and best.budget == 5
    # A tune limited to smaller trees, or whose best tree is the default chain, checks no default.
    assert tune_command._untuned_default(chain3, max_budget=4) is None
    growing = tune_command.tuner.Choice("specexec", 5, 5, 1, 1, 40.0, 1.1, grow=DEFAULT_GROWTH)
    assert tune_command._untuned_default(growing, 512) is None
    # A chain of 5 that keeps its size is not what runs untuned: the default is checked beside it.
    assert tune_command._untuned_default(dataclasses.replace(growing, grow=0), 512) == default


def test_the_untuned_default_stored_grows_online_as_it_does_unstored():
    """A profile that keeps the untuned default stores a chain that grows where the run's passes
    pay for more, as runs without a profile do; one that kept it at 5 nodes ran code edits 50 ms
    from a worker at 38.4 tokens/s, where no profile ran them at 50.8."""
    default = tune_command._untuned_default(tune_command.tuner.Choice("sequoia", 3, 3, 1, 1, 39.0, 0.99), 512)
    stored = tune_command.tuner.Choice.from_dict(json.loads(json.dumps(default.to_dict())))
    assert stored == default and stored.grow == DEFAULT_GROWTH
    plan = tree_of_choice(stored)
    assert plan.grow == DEFAULT_GROWTH and plan.shape == DEFAULT_SHAPE
    assert "growing to up to 384" in plan.describe()
    assert tree_of_choice(dataclasses.replace(stored, grow=0)).grow is None
    assert "growing online to up to 384" in report.config_text(stored.to_dict())


def test_the_untuned_default_is_stored_where_the_tuned_tree_runs_a_workload_slower():
    def half(speedup):
        return tune_workloads._Half(plain=[(100, 2.0)], default=[(100, 2.0 / speedup)])

    # The Gemma pair after a full tune: a Sequoia tree of 15 with lookup branches ran chat at
    # 0.82x of the untuned chain, though it won code edits.
    predicting = {
        "chat": {"tuned": half(1.40), "untuned": half(1.70)},
        "code": {"tuned": half(3.90), "untuned": half(3.40)},
        "rewrite": {"tuned": half(2.70), "untuned": half(2.72)},  # within the margin: noise
    }
    slower = tune_workloads._slower_workloads(predicting)
    assert list(slower) == ["chat"] and slower["chat"] == (pytest.approx(1.40), pytest.approx(1.70))
    del predicting["chat"]
    assert tune_workloads._slower_workloads(predicting) == {}
    # Where only the tuned default ran (it is the untuned chain), nothing is compared.
    assert tune_workloads._slower_workloads({"chat": {"tuned": half(0.5)}}) == {}
    # Slower on every workload, each within the margin (the Gemma pair's full tune, Sequoia 15
    # against the chain): slower on the whole, so the untuned default is stored.
    losing = {"chat": {"tuned": half(2.96), "untuned": half(3.00)},
              "code": {"tuned": half(3.49), "untuned": half(3.56)},
              "rewrite": {"tuned": half(2.27), "untuned": half(2.35)}}
    assert list(tune_workloads._slower_workloads(losing)) == ["chat", "code", "rewrite"]
    # Slower on one within the margin, faster on the whole: the tuned tree stays.
    winning = {"chat": {"tuned": half(2.65), "untuned": half(2.72)},
               "code": {"tuned": half(4.11), "untuned": half(4.05)},
               "rewrite": {"tuned": half(2.97), "untuned": half(2.87)}}
    assert tune_workloads._slower_workloads(winning) == {}
    # Faster on the whole but losing on one by more than the margin still stores the untuned one.
    winning["chat"]["tuned"] = half(2.50)
    assert list(tune_workloads._slower_workloads(winning)) == ["chat"]


def test_keeping_the_untuned_default_stores_the_chain_with_its_checked_figures():
    profile = _synthetic_profile()
    tuned = dict(profile["config"])
    chain = tune_command._untuned_default(tune_command.tuner.Choice.from_dict(tuned), 512)
    tune_command._keep_untuned(profile, chain, _check_result(36.0, 50.0, 45.0))
    assert profile["tuned_config"] == tuned
    assert (profile["config"]["kind"], profile["config"]["budget"], profile["config"]["depth"]) == ("specexec", 5, 5)
    assert profile["measured_speedup"] == pytest.approx(45.0 / 36.0, abs=1e-3)
    assert profiles._checked_choice(profile["config"]).budget == 5
    # What the report says of it.
    profile["workloads"] = {"chat": {"drafter": "hybrid", "predicted_speedup": 1.7, "measured_speedup": 1.6,
                                     "tuned_speedup": 1.4, "untuned_speedup": 1.7, "tuned_slower": True}}
    text = "\n".join(report.report_lines(profile))
    assert "stored: SpecExec tree, budget 5, depth 5, width 1, top-k 1, growing online to up to 384 (the untuned default)" in text
    assert "the tuned tree (SpecExec tree, budget 24, depth 8, width 4, top-k 4) x0.85, this one x1.25" in text
    assert "the tuned tree ran slower than the untuned default on chat: the untuned default is stored" in text
    assert "tuned tree x1.40, untuned default x1.70 on the predicting prompts\n" in text
    assert "chat (hybrid): predicted x1.70, measured x1.60 on held-out prompts" in text
    profile["workloads"]["chat"].update(predicted_range=[1.4, 2.05], prompts=12)
    assert ("chat (hybrid): predicted x1.70 (x1.40 to x2.05 expected), measured x1.60 on 6 held-out prompts"
            in "\n".join(report.report_lines(profile)))
    # With held-out figures of both, and where the tune chose lookup alone.
    profile["workloads"]["chat"].update(tuned_drafter="lookup", tuned_measured_speedup=1.3, untuned_measured_speedup=1.6)
    text = "\n".join(report.report_lines(profile))
    assert "lookup alone (tuned) x1.40, untuned default x1.70 on the predicting prompts (held-out: x1.30 and x1.60)" in text


def test_a_workload_half_sums_its_prompts_and_keeps_each_ones_speedup():
    half = tune_workloads._Half(plain=[(100, 4.0), (50, 2.0)], default=[(100, 2.0), (50, 0.5)])
    assert half.speedup == pytest.approx((150 / 2.5) / (150 / 6.0))
    assert half.each == [pytest.approx(2.0), pytest.approx(4.0)]
    assert tune_workloads._Half().each == []


def test_plain_decoding_decodes_a_quarter_of_the_tokens_of_a_workloads_prompts():
    """Plain decoding's speed is one whatever the prompt, the default's is not: the time plain's
    shorter runs save measures more prompts (a speedup is a ratio of rates, so it stands)."""
    assert tune_workloads.plain_tokens(64) == 16 and tune_workloads.plain_tokens(128) == 32
    assert tune_workloads.plain_tokens(40) == 16 and tune_workloads.plain_tokens(4) == 4
    assert tune_workloads._Half(plain=[(15, 1.5)], default=[(63, 2.1)]).speedup == pytest.approx(3.0)


def test_a_prediction_expects_a_range_as_wide_as_its_prompts_are_unlike():
    def half(speedups):
        return tune_workloads._Half(plain=[(100, 1.0)] * len(speedups), default=[(100, 1.0 / s) for s in speedups])

    alike, unlike = half([2.0, 2.1, 1.9, 2.0, 2.05, 1.95, 2.0, 2.0]), half([1.0, 3.0, 2.0, 1.2, 2.8, 1.5, 2.5, 2.0])
    for h in (alike, unlike):
        low, high = h.expected_range()
        assert low < h.speedup < high and low * high == pytest.approx(h.speedup ** 2)
    assert alike.expected_range()[1] / alike.speedup < 1.05  # within 5%: prompts alike
    assert unlike.expected_range()[1] / unlike.speedup > 1.3  # 0.9x to 3x plain: no closer than 30%
    # Twice the prompts, the same spread: a narrower range (by about the square root of two).
    twice = half([1.0, 3.0, 2.0, 1.2, 2.8, 1.5, 2.5, 2.0] * 2)
    assert math.log(twice.expected_range()[1] / twice.speedup) < 0.75 * math.log(unlike.expected_range()[1] / unlike.speedup)
    assert half([2.0]).expected_range() == (pytest.approx(2.0), pytest.approx(2.0))  # one prompt: no spread known


def test_each_workload_asks_every_kind_of_request_eight_times():
    # tune predicts from the even rounds of the requests and measures on the odd ones: the same
    # kinds, other prompts.
    for prompts in WORKLOADS.values():
        assert len(prompts) == ROUNDS * KINDS and len(set(prompts)) == len(prompts)
    def pasted(prompt):
        return prompt.split("```python\n")[1].split("```")[0]

    for i in range(KINDS):  # a code edit's siblings paste the same function
        assert len({pasted(WORKLOADS["code"][r * KINDS + i]) for r in range(ROUNDS)}) == 1


def test_tune_predicts_and_measures_on_the_same_kinds_of_request():
    predicted, measured = tune_workloads._half_rounds(16)
    assert predicted == [0, 1, 2, 3, 8, 9, 10, 11] and measured == [4, 5, 6, 7, 12, 13, 14, 15]
    for n in (2, 4, 8, 12, 16, 24, 32, 40):
        predicted, measured = tune_workloads._half_rounds(n)
        assert len(predicted) == len(measured) and not set(predicted) & set(measured)
        assert sorted(i % KINDS for i in predicted) == sorted(i % KINDS for i in measured)
        assert len(predicted) + len(measured) <= max(2, min(n, ROUNDS * KINDS))
    assert tune_workloads._half_rounds(8) == ([0, 1, 2, 3], [4, 5, 6, 7])
    for settings in (tune_command.QUICK, tune_command.FULL):  # both take every prompt: four a kind per half
        predicted, measured = tune_workloads._half_rounds(settings.workload_prompts)
        assert sorted(predicted + measured) == list(range(ROUNDS * KINDS))
        assert {i // KINDS % 2 for i in predicted} == {0} and {i // KINDS % 2 for i in measured} == {1}
        assert all(sum(i % KINDS == kind for i in measured) == 4 for kind in range(KINDS))


def test_the_predicting_and_held_out_prompts_take_turns_with_every_mode(offline_models, decodes):
    """A machine whose speed moves during a tune moves both halves alike: a prompt of one half,
    then one of the other, each decoded plainly and by every candidate, the modes' order rotating."""
    chain3 = tune_command.tuner.Choice("specexec", 3, 3, 1, 1, 0.0, 0.0)
    chain5 = tune_command._untuned_default(chain3, max_budget=512)
    with Runtime(RunOptions(target="smollm2-135m-f32", draft="smollm2-135m-q4", threads=1, ctx_size=512)) as rt:
        trees = {"tuned": tuned_default(chain3, None), "untuned": tuned_default(chain5, None)}
        halves = ([rt.tokenize_prompt(t, chat=True) for t in WORKLOADS["code"][:2]],
                  [rt.tokenize_prompt(t, chat=True) for t in WORKLOADS["code"][4:6]])
        predicting, held_out = tune_workloads._decode_halves(rt, trees, halves, 4, lambda: None)
    order = [halves[0][0], halves[1][0], halves[0][1], halves[1][1]]
    assert [d.prompt for d in decodes[::3]] == [tuple(p) for p in order]  # the halves alternate
    for turn in range(4):
        runs = decodes[3 * turn: 3 * turn + 3]
        assert len({d.prompt for d in runs}) == 1  # every mode on one prompt, then the next
        assert sorted(d.kind for d in runs) == ["PlainDecoder", "SpeculativeDecoder", "SpeculativeDecoder"]
    assert [d.kind for d in decodes[::3]][:3] != ["PlainDecoder"] * 3  # plain does not always go first
    for half in (predicting, held_out):
        assert set(half) == {"tuned", "untuned"} and half["tuned"].plain is half["untuned"].plain
        assert all(len(h.plain) == len(h.default) == 2 and h.speedup > 0 for h in half.values())


def test_the_default_per_workload_keeps_to_its_time_and_says_where_it_ran_out(offline_models, capsys):
    """Past its seconds no further pair of prompts starts but the first MIN_PAIRS: each workload
    is measured on those (predicting and held-out prompts of the same kinds), and the run says so."""
    chain3 = tune_command.tuner.Choice("specexec", 3, 3, 1, 1, 0.0, 0.0)
    with Runtime(RunOptions(target="smollm2-135m-f32", draft="smollm2-135m-q4", threads=1, ctx_size=512)) as rt:
        with report.progress() as progress:
            kept, out = tune_workloads.measure_default(rt, chain3, None, 32, 4, progress, seconds=0.0)

    assert kept is chain3 and set(out) == set(WORKLOADS)
    pairs = tune_workloads.MIN_PAIRS
    assert all(w["prompts"] == 2 * pairs and w["measured_speedup"] > 0 for w in out.values())
    said = capsys.readouterr().err
    assert "the time for the default per workload ran out" in said
    assert all(f"{name} on {2 * pairs} of 32 prompts" in said for name in WORKLOADS)
