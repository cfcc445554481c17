"""`specrun tune`: measure this machine with this model pair, choose the tree, check it, store it.

Steps: probe the hardware; measure the target's and the draft's cost curves and plain decoding's
per-token cost; calibrate acceptance with one speculative run at the largest useful budget; let
the tuner pick a SpecExec tree or a Sequoia tree; then check it by decoding held-out prompts with
the tree and with plain decoding: measured, not predicted, decides whether the draft model's
trees stay on (lookup always does). Last, the default a run will use is measured per workload
(tune_workloads). The profile (the measured facts -- curves, acceptance, plain rate -- the
choice, predictions and measurements) is stored where `chat`, `generate`, `bench` and `serve`
find it; runs decide from its facts and their own measurements.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path

from specrun import __version__, files, paths, ui
from specrun.commands import tune_workloads as workloads
from specrun.core.tree_shapes import MAX_BUDGET, TreeShape
from specrun.decoding.pay import rules as pay
from specrun.errors import SpecrunError, UsageError
from specrun.experiments.runner import Modes, Run, by_mode, decode_in_turn
from specrun.hardware.machine import probe_hardware
from specrun.runtime.model_files import resolve_models
from specrun.runtime.plan import RunOptions, build_plan, connect_workers
from specrun.runtime.runtime import Runtime, drafts_while_verifying, target_pass_s
from specrun.runtime.trees import DEFAULT_GROWTH, DEFAULT_SHAPE, tree_of_choice
from specrun.tuning import attention, flash_attention
from specrun.tuning import cost_model as tuner
from specrun.tuning import measure as profiler
from specrun.tuning import profiles, report
from specrun.tuning.pair import (
    Measured,
    PairSettings,
    choose,
    measure_pair,
    tau_budgets,
)


@dataclass(frozen=True)
class TuneSettings(PairSettings):
    """How long and how hard `tune` measures: the pair (PairSettings), then the check of its
    choice on held-out prompts and the default per workload. Times are budgets in seconds."""

    check_prompts: int
    check_tokens: int
    check_seconds: float
    workload_tokens: int = 96  # tokens per answer when measuring the default per workload
    workload_prompts: int = 16  # prompts per workload (half predict, half measure)
    workload_seconds: float | None = None  # for all workloads; fewer prompts past it (None: no limit)


# --quick fits about 3 minutes for a ~100M-parameter pair on 2 CPU cores.
QUICK = TuneSettings(
    max_budget=64, depth=12, width=4, top_k=4, curve_repeats=3, curve_seconds=25,
    calibration_prompts=3, calibration_tokens=48, calibration_seconds=50,
    check_prompts=3, check_tokens=48, check_seconds=50, workload_tokens=64, workload_prompts=32,
    workload_seconds=150,
)
FULL = TuneSettings(
    max_budget=512, depth=16, width=4, top_k=4, curve_repeats=5, curve_seconds=120,
    calibration_prompts=6, calibration_tokens=96, calibration_seconds=420,
    check_prompts=3, check_tokens=128, check_seconds=300, workload_tokens=128, workload_prompts=32, workload_seconds=600,
)
# Where a pass costs a round trip plus compute (a worker 50 ms away: 124 ms for 1 token, 318 ms
# for 64, 519 for 128 on the demo target), the largest tree weighed and its depth: a deep tree is
# drafted while the pass runs.
FIXED_COST_SHAPE = TreeShape(1024, 24, 4, 4)


def tune(opts: RunOptions, settings: TuneSettings) -> dict:
    """Measure, choose, check and store; return the stored profile."""

    t_start = time.monotonic()
    _check_profiles_writable()
    connect_workers(opts)  # their devices are part of the machine the profile is made for
    hardware = probe_hardware()
    report.warn_if_busy(hardware.cores)
    settings = _for_the_passes(opts, settings)
    max_budget = min(opts.budget or settings.max_budget, MAX_BUDGET)
    depth = opts.depth or settings.depth
    calibration_shape = TreeShape(max_budget, depth, min(settings.width, max_budget), min(settings.top_k, max_budget))
    rt, passes_by_attention = _runtime_after_attention(opts, calibration_shape)
    with rt:
        if not rt.speculative:
            raise UsageError(f"no draft model for {rt.models.target_name}: pass --draft to tune a pair")
        ui.dim(
            f"tuning {rt.models.target_name} with draft {rt.models.draft_name} on {hardware.cpu}, "
            f"{rt.target_ctx.threads} threads" + report.gpu_note(hardware)
        )
        # The one-token pass as a run times it at load (runtime.target_pass_s: the least of a
        # few, the cache empty), for the run's check against this profile: plain decoding's mean
        # pass, taken below, is a slower statistic (over RPC workers by more than the check's
        # drift: a profile made for the network was set aside by two runs of three).
        load_pass_s = target_pass_s(rt.target_ctx)
        held_out = [rt.tokenize_prompt(text, chat=True) for _, text in profiler.HELD_OUT_PROMPTS]
        with report.progress() as progress:
            measured = measure_pair(rt, settings, calibration_shape, progress)
            _say_measured(measured)
            choice, best_tree = choose(measured)
            default = _untuned_default(best_tree, max_budget)
            check = _check(rt, best_tree, held_out, settings, progress, default)
        choice, best_tree, check = _prefer_the_default(choice, best_tree, default, check)
        # Measured beats predicted, both ways.
        if choice.kind != "plain" and not pay.check_keeps(check.tree_speedup):
            # The tree lost on the held-out prompts: the draft model's trees are turned off.
            choice = tuner.Choice("plain", 0, 0, 0, 0, measured.plain_tokens_per_s, 1.0)
        elif choice.kind == "plain" and best_tree.kind != "plain" and pay.check_keeps(check.tree_speedup):
            choice = best_tree  # predicted to lose, measured level or faster: it stays
        key = profiles.profile_key(rt.models.target_path, rt.models.draft_path, hardware.fingerprint(),
                                   **{**opts.profile_options(), "threads": rt.target_ctx.threads})
        profile = _profile(key, rt, hardware, settings, measured, choice, best_tree, check, load_pass_s)
        untuned = _untuned_default(choice, max_budget)
        with report.progress() as progress:
            kept, profile["workloads"] = workloads.measure_default(
                rt, choice, profiles.facts_of(profile), settings.workload_prompts, settings.workload_tokens, progress,
                untuned=untuned, seconds=settings.workload_seconds)
        if kept is not choice:
            _keep_untuned(profile, kept, check)
        if passes_by_attention is not None:
            profile["attention"] = passes_by_attention.to_dict()  # (the advice, with the figures: tuning.report)
    profile["seconds"] = round(time.monotonic() - t_start, 1)
    try:
        path = profiles.save(profile)
    except OSError as e:
        raise SpecrunError(f"cannot save the tuning profile in {paths.profiles_dir()}: {e.strerror or e}") from None
    ui.dim(f"profile saved to {path}")
    return profile


def _runtime_after_attention(opts: RunOptions, shape: TreeShape) -> tuple[Runtime, attention.AttentionCosts | None]:
    """The runtime tune measures on and, where --flash-attn was not given and the target's attention
    runs on this CPU, its passes timed with and without flash attention (attention.attention_here),
    kept for later runs (attention.save_record). Where that record changes the target's context
    (flash attention off where it pays), the runtime is opened again with it: the cost curves are
    then the ones later runs meet."""
    rt = Runtime(opts, shape_override=shape)
    try:
        found = attention.attention_here(rt, opts) if opts.flash_attn is None and rt.speculative else None
        if found is None:
            return rt, None
        target, plan = rt.models.target_path, rt.plan
        try:
            attention.save_record(target, plan.threads, found)
        except OSError as e:
            raise SpecrunError(f"cannot save the flash attention record in {paths.profiles_dir()}: {e.strerror or e}") from None
        chosen, why = flash_attention.choose_flash_attn(opts, target, not plan.devices, plan.target_ctx.parallel, plan.threads)
        if chosen == plan.target_ctx.flash_attn:
            return rt, found
    except BaseException:
        rt.close()
        raise
    rt.close()
    ui.dim(why or "flash attention as llama.cpp chooses it: the target's passes measured no faster without it here")
    return Runtime(replace(opts, quiet=True), shape_override=shape), found


def _for_the_passes(opts: RunOptions, settings: TuneSettings) -> TuneSettings:
    """The settings for this machine's passes: where the draft grows its trees while the target's
    pass runs elsewhere (RPC workers, a GPU: runtime.drafts_while_verifying), a pass costs about
    as much for one token as for hundreds, and trees are weighed up to FIXED_COST_SHAPE's size
    and depth (the target's curve still stops where a tree could no longer pay, and the
    calibration tree is cut to the largest that could)."""
    if not drafts_while_verifying(build_plan(opts, DEFAULT_SHAPE)):
        return settings
    return replace(settings, max_budget=max(settings.max_budget, FIXED_COST_SHAPE.budget),
                   depth=max(settings.depth, FIXED_COST_SHAPE.depth))


def _say_measured(measured: Measured) -> None:
    """Print the passes' costs and the calibration's acceptance (on stderr)."""
    draft, cal = measured.draft, measured.calibration.summary()
    ui.dim("target pass: " + report.curve_text(measured.target.decode))
    ui.dim("draft pass:  " + report.curve_text({n: s + draft.topk.get(n, 0.0) for n, s in draft.decode.items()}))
    ui.dim(
        f"calibration: {cal['n_tokens']} tokens in {cal['n_steps']} passes of a {measured.calibration.budget}-token tree, "
        f"{cal['accepted_per_pass']:.2f} accepted per pass"
    )


def _check_profiles_writable() -> None:
    """Refuse before minutes of measuring when the profile could not be saved afterwards."""
    folder = paths.profiles_dir()
    reason = files.unwritable_reason(folder)
    if reason:
        raise SpecrunError(
            f"cannot save tuning profiles in {folder} ({reason}): make it writable, or point SPECRUN_HOME "
            "(or SPECRUN_PROFILES) at a writable directory"
        )


@dataclass
class CheckResult:
    """Held-out decoding: the chosen configuration against plain decoding, same prompts."""

    plain_tokens_per_s: float
    tree_tokens_per_s: float  # the best tree (the choice, unless plain decoding was chosen)
    accepted_per_pass: float
    identical_output: bool
    n_prompts: int
    n_tokens: int
    default_tokens_per_s: float = 0.0  # the untuned default's tree, when it differs (else 0)
    default_accepted_per_pass: float = 0.0

    @property
    def default_speedup(self) -> float:
        return self.default_tokens_per_s / self.plain_tokens_per_s if self.plain_tokens_per_s else 0.0

    def with_default_as_tree(self) -> CheckResult:
        """The same check, with the untuned default's figures as the tree's."""
        return replace(self, tree_tokens_per_s=self.default_tokens_per_s,
                       accepted_per_pass=self.default_accepted_per_pass)

    @property
    def tree_speedup(self) -> float:
        return self.tree_tokens_per_s / self.plain_tokens_per_s if self.plain_tokens_per_s else 0.0


def _prefer_the_default(choice: tuner.Choice, best_tree: tuner.Choice, default: tuner.Choice | None,
                        check: CheckResult) -> tuple[tuner.Choice, tuner.Choice, CheckResult]:
    """Where the tuner's best tree measured slower than the untuned default's (pay.default_wins),
    storing it would make every later run slower: the default takes its place (its measured
    figures standing for the prediction). Return (choice, best tree, check)."""
    if default is None or not pay.default_wins(check.default_tokens_per_s, check.tree_tokens_per_s):
        return choice, best_tree, check
    # With plain decoding chosen, the default is what is weighed against it next, not stored yet.
    then = "weighing the default against plain decoding" if choice.kind == "plain" else "storing the default"
    ui.dim(f"the tuned tree ({report.config_text(best_tree.to_dict())}) measured slower than the untuned "
           f"default ({report.config_text(default.to_dict())}): {then}")
    kept = replace(default, predicted_tokens_per_s=check.default_tokens_per_s, predicted_speedup=check.default_speedup)
    return (choice if choice.kind == "plain" else kept), kept, check.with_default_as_tree()


def _keep_untuned(profile: dict, untuned: tuner.Choice, check: CheckResult) -> None:
    """Store the untuned default in the profile in place of the tuned choice, which ran some
    workload slower with lookup branches on (tune_workloads); what was tuned stays on record."""
    # The tree check decoded the untuned chain beside the best tree, or as the best tree itself.
    ran = check.with_default_as_tree() if check.default_tokens_per_s else check
    untuned = replace(untuned, predicted_tokens_per_s=ran.tree_tokens_per_s, predicted_speedup=ran.tree_speedup)
    profile["tuned_config"] = profile["config"]
    profile["config"] = untuned.to_dict()
    profile["predicted_speedup"] = round(untuned.predicted_speedup, 4)
    profile["measured_speedup"] = round(ran.tree_speedup, 4)
    profile["predicted_tokens_per_s"] = round(untuned.predicted_tokens_per_s, 3)


def _untuned_default(best_tree: tuner.Choice, max_budget: int) -> tuner.Choice | None:
    """What runs without a profile (a chain of DEFAULT_SHAPE growing online up to DEFAULT_GROWTH
    nodes where the run's passes pay for more), as a tuner choice; None when the best tree is
    that already, or the tune was limited to smaller trees.

    Stored, it grows as it did unstored: a profile that kept the chain at 5 nodes ran code edits
    50 ms away at 38.4 tokens/s, where no profile ran them at 50.8."""
    shape = DEFAULT_SHAPE
    if shape.budget > max_budget:
        return None
    default = tuner.Choice("specexec", shape.budget, shape.depth, shape.width, shape.top_k, 0.0, 0.0,
                           grow=DEFAULT_GROWTH)
    if best_tree.kind != "plain" and _same_tree(best_tree, default):
        return None
    return default


def _same_tree(a: tuner.Choice, b: tuner.Choice) -> bool:
    """Whether two choices draft the same best-first tree, growing alike."""
    return (a.kind, a.budget, a.depth, a.width, a.grow) == (b.kind, b.budget, b.depth, b.width, b.grow)


def _check(rt, tree: tuner.Choice, prompts: list[list[int]], settings: TuneSettings, progress,
           default: tuner.Choice | None = None) -> CheckResult:
    """Decode held-out prompts plainly, with the best tree and (when given) with the untuned
    default's tree, each as given (no speed guard) and fresh for every prompt; return the speeds."""

    n_prompts = settings.check_prompts
    trees = {"plain": None, "tree": tree_of_choice(tree)}
    if default is not None:
        trees["default"] = tree_of_choice(default)
    task = progress.add_task("checking the prediction", total=len(trees) * n_prompts * settings.check_tokens)
    runs = decode_in_turn(
        Modes(rt, trees, fresh=True, guard=False), prompts[:n_prompts], settings.check_tokens,
        deadline=time.monotonic() + settings.check_seconds * len(trees) / 2,
        # Each generation may overrun its share a little; a machine slowed down by other work must
        # not stretch the check without bound.
        seconds_each=1.5 * settings.check_seconds / (2 * n_prompts),
        after_each=lambda run: progress.advance(task, settings.check_tokens),
    )
    rt.clear_contexts()
    steady = {mode: _steady_state(mine) for mode, mine in by_mode(runs).items()}
    plain_runs = by_mode(runs)["plain"]
    return CheckResult(
        plain_tokens_per_s=steady["plain"][0],
        tree_tokens_per_s=steady["tree"][0],
        accepted_per_pass=steady["tree"][1],
        identical_output=all(_same_start(run.tokens, plain_runs[run.prompt].tokens) for run in runs),
        n_prompts=len(plain_runs),
        n_tokens=sum(len(step.tokens) for run in plain_runs for step in _steady_steps(run)),
        default_tokens_per_s=steady.get("default", (0.0, 0.0))[0],
        default_accepted_per_pass=steady.get("default", (0.0, 0.0))[1],
    )


def _steady_steps(run: Run) -> list:
    """A run's steps in the steady state the tuner predicts: the first pass also prefills the
    draft with the prompt."""
    return run.stats.steps[1:] or run.stats.steps


def _steady_state(runs: list[Run]) -> tuple[float, float]:
    """Return (tokens per second, tokens per pass) over the runs' steady-state steps (0: none)."""
    steps = [step for run in runs for step in _steady_steps(run)]
    tokens, seconds = sum(len(step.tokens) for step in steps), sum(step.total_s for step in steps)
    return (tokens / seconds if seconds else 0.0), (tokens / len(steps) if steps else 0.0)


def _same_start(tokens: list[int], plain: list[int]) -> bool:
    """Whether two answers agree as far as both went (a time limit may stop either early)."""
    common = min(len(tokens), len(plain))
    return tokens[:common] == plain[:common]


def _profile(key, rt, hardware, settings, measured: Measured, choice, best_tree, check: CheckResult,
             load_pass_s: float | None) -> dict:

    cal = measured.calibration
    chosen_tree = choice.kind != "plain"
    budgets = tau_budgets(cal.budget)
    return {
        "key": key,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "specrun": __version__,
        "models": {"target": rt.models.target_name, "draft": rt.models.draft_name},
        "threads": rt.target_ctx.threads,
        "quick": settings is QUICK,
        "config": choice.to_dict(),
        "predicted_speedup": round(choice.predicted_speedup, 4),
        "measured_speedup": round(check.tree_speedup, 4) if chosen_tree else 1.0,
        "predicted_tokens_per_s": round(choice.predicted_tokens_per_s, 3),
        "best_tree": best_tree.to_dict(),
        "check": {
            "plain_tokens_per_s": round(check.plain_tokens_per_s, 3),
            "plain_predicted_tokens_per_s": round(measured.plain_tokens_per_s, 3),
            "tree_tokens_per_s": round(check.tree_tokens_per_s, 3),
            "tree_predicted_tokens_per_s": round(best_tree.predicted_tokens_per_s, 3),
            "tree_predicted_speedup": round(best_tree.predicted_speedup, 4),
            "tree_measured_speedup": round(check.tree_speedup, 4),
            "accepted_per_pass": round(check.accepted_per_pass, 3),
            "default_tokens_per_s": round(check.default_tokens_per_s, 3),
            "predicted_accepted_per_pass": round(_predicted_accepted(measured, best_tree), 3),
            "identical_output": check.identical_output,
            "prompts": check.n_prompts,
            "tokens": check.n_tokens,
        },
        "hardware": hardware.to_dict(),
        "curves": {
            "target": measured.target_curve.to_dict(),
            "draft": measured.draft_curve.to_dict(),
            "draft_topk": measured.draft.topk_curve().to_dict() if measured.draft.topk else None,
        },
        "overhead_s": measured.overhead_s,
        "overhead_per_pass_s": measured.overhead_per_pass_s,
        # load_pass_s: None where the pass could not be timed (the check then uses target_s).
        "plain": {"target_s": measured.plain.target_s, "overhead_s": measured.plain.overhead_s, "load_pass_s": load_pass_s},
        "acceptance": {
            "tau": {str(b): round(t, 4) for b, t in cal.tau(budgets).items()},
            "accept_probs": [round(a, 5) for a in cal.accept_probs()],
            "branching": round(cal.branching(), 4),
        },
        "calibration": cal.to_dict(),
    }


def _predicted_accepted(measured: Measured, choice: tuner.Choice) -> float:
    """Return the tokens per target pass the tuner expects from a choice."""
    if choice.kind == "sequoia" and choice.tree is not None:
        return tuner.expected_accepted(choice.tree, measured.calibration.accept_probs())
    if choice.kind == "specexec":
        return measured.calibration.tau([choice.budget], choice.depth)[choice.budget]
    return 1.0


def run_tune(opts: RunOptions, quick: bool, show: bool, as_json: bool, plot: Path | None) -> None:
    """Tune (or with show=True print the stored profile); JSON on stdout with as_json, PNG with plot."""
    if plot is not None:
        report.require_matplotlib()
    if opts.lookup_only:
        # Nothing to profile: lookup trees size themselves from what each run measures.
        ui.info("lookup drafting needs no tuning: it adapts to each run's acceptance and target cost "
                "(`specrun bench --draft lookup` measures it here)")
        return
    if opts.mtp_only:
        ui.info("MTP drafting needs no tuning: its chain length is --depth (default 3), and the speed guard "
                "shortens it online where it does not pay (`specrun bench --draft mtp` measures it here)")
        return
    if opts.lookup:
        ui.dim("--lookup: tuning the draft model's tree; lookup branches join it and adapt online")
    opts = replace(opts, lookup=False)  # tune measures the draft model's trees alone
    if show:
        profile = stored_profile(opts)
    else:
        profile = tune(opts, QUICK if quick else FULL)
    if as_json:
        print(json.dumps(report.profile_summary(profile), indent=1))
    else:
        for line in report.report_lines(profile):
            ui.info(line)
    if plot is not None:
        report.write_plot(profile, plot)
        ui.dim(f"plot written to {plot}")


def stored_profile(opts: RunOptions) -> dict:
    """Return the stored profile for the pair the options name; raise when there is none."""

    models = resolve_models(opts)
    if models.draft_path is None:
        raise UsageError(f"no draft model for {models.target_name}: pass --draft")
    connect_workers(opts)
    profile = profiles.load(models.target_path, models.draft_path, **opts.profile_options())
    if profile is None:
        raise SpecrunError(
            f"no tuning profile for {models.target_name} with {models.draft_name} on this machine "
            "(or the files or llama.cpp changed since): run `specrun tune`"
        )
    return profile
