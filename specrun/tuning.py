"""`specrun tune`: measure this machine with this model pair, choose the tree, check it, store it.

Steps: probe the hardware; measure the target's and the draft's cost curves and plain decoding's
per-token cost; calibrate acceptance with one speculative run at the largest useful budget; let
the tuner pick plain decoding, a SpecExec tree or a Sequoia tree; then check the prediction by
decoding held-out prompts with the choice and with plain decoding; a tree that measures slower
than plain decoding there is turned off. The profile (choice, curves, acceptance, prediction and
measurement) is stored where `chat`, `generate` and `bench` find it.
"""

from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from specrun import profiler, profiles, tuner, ui
from specrun.errors import SpecrunError, UsageError
from specrun.runner import RunOptions


@dataclass(frozen=True)
class TuneSettings:
    """How long and how hard `tune` measures. Times are budgets in seconds per phase."""

    max_budget: int  # largest tree (draft tokens) calibrated
    depth: int  # depth limit of the calibration tree: deeper trees are not considered
    width: int  # nodes per draft pass while calibrating
    top_k: int  # children per expanded node
    curve_repeats: int
    curve_seconds: float
    calibration_prompts: int
    calibration_tokens: int
    calibration_seconds: float
    check_prompts: int
    check_tokens: int
    check_seconds: float


# --quick fits about 3 minutes for a ~100M-parameter pair on 2 CPU cores.
QUICK = TuneSettings(
    max_budget=64, depth=12, width=4, top_k=4, curve_repeats=3, curve_seconds=25,
    calibration_prompts=3, calibration_tokens=48, calibration_seconds=50,
    check_prompts=3, check_tokens=48, check_seconds=50,
)
FULL = TuneSettings(
    max_budget=512, depth=16, width=4, top_k=4, curve_repeats=5, curve_seconds=120,
    calibration_prompts=6, calibration_tokens=96, calibration_seconds=420,
    check_prompts=3, check_tokens=128, check_seconds=300,
)

# Trees of this many tokens (root included) at most for Sequoia: its inner nodes must fit the
# draft's sequence ids (sequoia_draft.MAX_INNER_NODES).
MAX_SEQUOIA_TOKENS = 256
# A tree that measures slower than this against plain decoding on the held-out prompts is
# turned off, whatever the prediction said.
CHECK_MIN_SPEEDUP = 1.0
# Plain decoding measured this much faster or slower in the check than in the cost curves means
# the machine's speed drifted during tuning; the report says so.
DRIFT_WARNING = 0.25
# Fewer calibration passes than this make tau(B) a rough estimate; the report says so.
MIN_CALIBRATION_STEPS = 10
# Other work using more than this share of the CPU when tuning starts gets a warning.
BUSY_FRACTION = 0.25
# Budgets listed in charts.
CHART_BUDGETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)


def run_tune(opts: RunOptions, quick: bool, show: bool, as_json: bool, plot: Path | None) -> None:
    """Tune (or with show=True print the stored profile); JSON on stdout with as_json, PNG with plot."""
    if plot is not None:
        _require_matplotlib()
    if show:
        profile = stored_profile(opts)
    else:
        profile = tune(opts, QUICK if quick else FULL)
    if as_json:
        print(json.dumps(profile_summary(profile), indent=1))
    else:
        for line in report_lines(profile):
            ui.info(line)
    if plot is not None:
        write_plot(profile, plot)
        ui.dim(f"plot written to {plot}")


def stored_profile(opts: RunOptions) -> dict:
    """Return the stored profile for the pair the options name; raise when there is none."""
    from specrun.runner import resolve_models

    models = resolve_models(opts)
    if models.draft_path is None:
        raise UsageError(f"no draft model for {models.target_name}: pass --draft")
    profile = profiles.load(models.target_path, models.draft_path, opts.threads)
    if profile is None:
        raise SpecrunError(
            f"no tuning profile for {models.target_name} with {models.draft_name} on this machine "
            "(or the files or llama.cpp changed since): run `specrun tune`"
        )
    return profile


# --------------------------------------------------------------------------------------------
# Tuning


def tune(opts: RunOptions, settings: TuneSettings) -> dict:
    """Measure, choose, check and store; return the stored profile."""
    from specrun.draft import MAX_BUDGET, TreeShape
    from specrun.runner import Runtime

    t_start = time.monotonic()
    hardware = profiler.probe_hardware()
    _warn_if_busy(hardware)
    max_budget = min(opts.budget or settings.max_budget, MAX_BUDGET)
    depth = opts.depth or settings.depth
    calibration_shape = TreeShape(max_budget, depth, min(settings.width, max_budget), min(settings.top_k, max_budget))
    with Runtime(opts, shape_override=calibration_shape) as rt:
        if not rt.speculative:
            raise UsageError(f"no draft model for {rt.models.target_name}: pass --draft to tune a pair")
        ui.dim(
            f"tuning {rt.models.target_name} with draft {rt.models.draft_name} on {hardware.cpu}, "
            f"{rt.target_ctx.threads} threads" + _gpu_note(hardware)
        )
        calib_prompts = [rt.tokenize_prompt(text, chat=True) for _, text in profiler.CALIBRATION_PROMPTS]
        held_out = [rt.tokenize_prompt(text, chat=True) for _, text in profiler.HELD_OUT_PROMPTS]
        with _progress() as progress:
            measured = _measure(rt, settings, calibration_shape, calib_prompts, progress)
            choice, best_tree = _choose(measured)
            check = _check(rt, choice, best_tree, held_out, settings, progress)
        if choice.kind != "plain" and check.tree_speedup < CHECK_MIN_SPEEDUP:
            # Measured beats predicted: the tree lost on the held-out prompts, so decode plainly.
            choice = tuner.Choice("plain", 0, 0, 0, 0, _plain_rate(measured), 1.0)
        key = profiles.profile_key(
            rt.models.target_path, rt.models.draft_path, hardware.fingerprint(), rt.target_ctx.threads
        )
        profile = _profile(key, rt, hardware, settings, measured, choice, best_tree, check)
    profile["seconds"] = round(time.monotonic() - t_start, 1)
    path = profiles.save(profile)
    ui.dim(f"profile saved to {path}")
    return profile


@dataclass
class Measured:
    """Everything the tuner's choice is made from."""

    target: profiler.CurveMeasurement
    draft: profiler.CurveMeasurement
    plain: profiler.PlainTiming
    calibration: profiler.Calibration
    overhead_s: float  # per calibration step (a tree of the calibration budget)
    overhead_per_pass_s: float  # the same, per forward pass: what the tuner's cost model uses

    @property
    def target_curve(self) -> tuner.CostCurve:
        return self.target.curve()

    @property
    def draft_curve(self) -> tuner.CostCurve:
        return self.draft.curve()


def _measure(rt, settings: TuneSettings, shape, prompts: list[list[int]], progress) -> Measured:
    from specrun.draft import TreeShape

    depth = shape.depth
    sizes = profiler.curve_sizes(shape.budget + 1)
    task = progress.add_task("target cost curve", total=len(sizes))
    target = profiler.measure_curve(
        rt.target_ctx, prompts[0], sizes, repeats=settings.curve_repeats,
        deadline=time.monotonic() + settings.curve_seconds,
        # A tree costing more than depth + 1 plain passes loses even if all of it is accepted.
        stop_ratio=depth + 1.0,
        on_size=lambda n, s: progress.advance(task),
    )
    progress.update(task, completed=len(sizes))
    ui.dim("target pass: " + _curve_text(target.decode))

    widths = profiler.curve_sizes(max(tuner.DEFAULT_WIDTHS[-1], 2 * shape.width))
    task = progress.add_task("draft cost curve", total=len(widths))
    draft = profiler.measure_curve(
        rt.draft_ctx, prompts[0], widths, repeats=settings.curve_repeats,
        deadline=time.monotonic() + settings.curve_seconds / 2, top_k=shape.top_k,
        on_size=lambda n, s: progress.advance(task),
    )
    progress.update(task, completed=len(widths))
    ui.dim("draft pass:  " + _curve_text({n: s + draft.topk.get(n, 0.0) for n, s in draft.decode.items()}))

    plain = profiler.measure_plain(rt.target, rt.target_ctx, prompts[0], 16)

    curve = target.curve()
    budget = _calibration_budget(curve, shape.budget, depth)
    n_prompts = settings.calibration_prompts
    task = progress.add_task(f"calibrating (tree of {budget})", total=n_prompts * settings.calibration_tokens)
    calibration = profiler.calibrate(
        rt.target, rt.target_ctx, rt.draft, rt.draft_ctx, prompts[:n_prompts],
        TreeShape(budget, depth, min(shape.width, budget), min(shape.top_k, budget)),
        settings.calibration_tokens, deadline=time.monotonic() + settings.calibration_seconds,
        on_step=lambda n: progress.advance(task, n),
    )
    progress.update(task, completed=n_prompts * settings.calibration_tokens)
    cal = calibration.summary()
    ui.dim(
        f"calibration: {cal['n_tokens']} tokens in {cal['n_steps']} passes of a {budget}-token tree, "
        f"{cal['accepted_per_pass']:.2f} accepted per pass"
    )
    topk = draft.topk_curve()
    return Measured(
        target, draft, plain, calibration, calibration.overhead_s(topk), calibration.overhead_per_pass_s(topk)
    )


def _calibration_budget(curve: tuner.CostCurve, cap: int, depth: int) -> int:
    """Return the largest budget worth calibrating: a tree of B + 1 tokens can only pay while
    one pass over it costs less than depth + 1 plain passes (all accepted, at best)."""
    limit = (depth + 1) * curve.t(1)
    budget = 1
    for n in range(1, cap + 1):
        if curve.t(n + 1) <= limit:
            budget = n
    return budget


def _budgets(largest: int) -> list[int]:
    """Return budgets to evaluate: every size up to 64, then steps of about 6%."""
    budgets = set(range(1, min(largest, 64) + 1))
    b = 64.0
    while b < largest:
        b *= 1.06
        budgets.add(min(largest, round(b)))
    return sorted(budgets)


def _tuner_inputs(measured: Measured) -> dict:
    cal = measured.calibration
    budgets = _budgets(cal.budget)
    depths = [d for d in (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32) if d < cal.depth] + [cal.depth]
    return dict(
        target_curve=measured.target_curve,
        draft_curve=measured.draft_curve,
        overhead=0.0,
        overhead_per_pass=measured.overhead_per_pass_s,
        tau_by_depth=cal.tau_by_depth(budgets, depths),
        depth=cal.depth,
        top_k=cal.top_k,
        branching=cal.branching(),
        plain_overhead=measured.plain.overhead_s,
        max_tree_tokens=cal.budget + 1,
    )


def _choose(measured: Measured) -> tuple[tuner.Choice, tuner.Choice]:
    """Return (the choice, the best tree even if it loses to plain decoding)."""
    inputs = _tuner_inputs(measured)
    cal = measured.calibration
    best_specexec = tuner.choose_config(**inputs, min_speedup=0.0)
    draft = measured.draft_curve
    sequoia_inputs = {
        **inputs,
        "tau_by_depth": None,
        "max_tree_tokens": min(cal.budget + 1, MAX_SEQUOIA_TOKENS),
        # The tuner prices a static tree's first draft pass at one token; catching up is wider.
        "overhead": inputs["overhead"] + max(0.0, draft.t(cal.catchup_tokens()) - draft.t(1)),
    }
    best_sequoia = tuner.choose_config(
        **sequoia_inputs, accept_probs=cal.accept_probs(), sequoia_depths=tuple(range(1, cal.depth + 1)),
        min_speedup=0.0,
    )
    candidates = [c for c in (best_specexec, best_sequoia) if c.kind != "plain"]
    if not candidates:
        plain = tuner.choose_config(**inputs)
        return plain, plain
    best = max(candidates, key=lambda c: c.predicted_tokens_per_s)
    if best.predicted_speedup < tuner.MIN_SPEEDUP:
        plain_rate = best.predicted_tokens_per_s / best.predicted_speedup
        return tuner.Choice("plain", 0, 0, 0, 0, plain_rate, 1.0), best
    return best, best


@dataclass
class CheckResult:
    """Held-out decoding: the chosen configuration against plain decoding, same prompts."""

    plain_tokens_per_s: float
    tree_tokens_per_s: float  # the best tree (the choice, unless plain decoding was chosen)
    accepted_per_pass: float
    identical_output: bool
    n_prompts: int
    n_tokens: int

    @property
    def tree_speedup(self) -> float:
        return self.tree_tokens_per_s / self.plain_tokens_per_s if self.plain_tokens_per_s else 0.0


def _check(rt, choice: tuner.Choice, tree: tuner.Choice, prompts: list[list[int]], settings: TuneSettings, progress) -> CheckResult:
    """Decode held-out prompts plainly and with the best tree; return the speeds."""
    from specrun.generate import PlainDecoder
    from specrun.sampling import SamplingParams

    greedy = SamplingParams()
    n_prompts = settings.check_prompts
    task = progress.add_task("checking the prediction", total=2 * n_prompts * settings.check_tokens)
    deadline = time.monotonic() + settings.check_seconds
    # Each generation may overrun its share a little; a machine slowed down by other work must
    # not stretch the check without bound.
    seconds_each = 1.5 * settings.check_seconds / (2 * n_prompts)
    totals = {"plain": [0, 0.0, 0], "tree": [0, 0.0, 0]}  # tokens, seconds, passes
    outputs: dict[str, list[int]] = {}
    identical = True
    done = 0
    for i, prompt in enumerate(prompts[:n_prompts]):
        if done and time.monotonic() > deadline:
            break
        # Alternate the order (plain, tree), (tree, plain), ... so a slow drift of the machine's
        # speed hits both alike.
        for kind in ("plain", "tree") if i % 2 == 0 else ("tree", "plain"):
            # Fresh decoders: each one's record of the cached tokens must match the contexts.
            rt.target_ctx.clear()
            rt.draft_ctx.clear()
            decoder = PlainDecoder(rt.target, rt.target_ctx) if kind == "plain" else make_decoder(rt, tree)
            outputs[kind] = _generate(decoder, prompt, greedy, settings.check_tokens, seconds_each)
            progress.advance(task, settings.check_tokens)
            # Steady state, as predicted: the first pass also prefills the draft with the prompt.
            steps = decoder.stats.steps[1:] or decoder.stats.steps
            totals[kind][0] += sum(len(step.tokens) for step in steps)
            totals[kind][1] += sum(step.total_s for step in steps)
            totals[kind][2] += len(steps)
        common = min(len(outputs["plain"]), len(outputs["tree"]))
        identical &= outputs["plain"][:common] == outputs["tree"][:common]
        done += 1
    rt.target_ctx.clear()
    rt.draft_ctx.clear()
    (plain_tokens, plain_s, _), (tree_tokens, tree_s, passes) = totals["plain"], totals["tree"]
    return CheckResult(
        plain_tokens_per_s=plain_tokens / plain_s if plain_s else 0.0,
        tree_tokens_per_s=tree_tokens / tree_s if tree_s else 0.0,
        accepted_per_pass=tree_tokens / passes if passes else 0.0,
        identical_output=identical,
        n_prompts=done,
        n_tokens=plain_tokens,
    )


def _generate(decoder, prompt: list[int], params, max_tokens: int, seconds: float) -> list[int]:
    """Return the generated ids, stopping after max_tokens or once `seconds` have passed."""
    from specrun.sampling import make_rng

    stop_at = time.monotonic() + seconds
    out: list[int] = []
    for step in decoder.steps(prompt, params, max_tokens, make_rng(params.seed)):
        out.extend(step.tokens)
        if time.monotonic() > stop_at:
            break
    return out


def make_decoder(rt, choice: tuner.Choice):
    """Return a decoder on the runtime's contexts for a tuner choice (plain, SpecExec or Sequoia)."""
    from specrun.draft import TreeShape
    from specrun.generate import PlainDecoder
    from specrun.sequoia_draft import StaticTreeGrower, template_shape
    from specrun.speculative import SpeculativeDecoder

    if choice.kind == "plain":
        return PlainDecoder(rt.target, rt.target_ctx)
    if choice.kind == "sequoia":
        grower = StaticTreeGrower(rt.draft, rt.draft_ctx, choice.tree)
        return SpeculativeDecoder(
            rt.target, rt.target_ctx, rt.draft, rt.draft_ctx, template_shape(choice.tree), grower=grower
        )
    shape = TreeShape(choice.budget, choice.depth, choice.width, choice.top_k)
    return SpeculativeDecoder(rt.target, rt.target_ctx, rt.draft, rt.draft_ctx, shape)


def _profile(key, rt, hardware, settings, measured: Measured, choice, best_tree, check: CheckResult) -> dict:
    from specrun import __version__

    cal = measured.calibration
    chosen_tree = choice.kind != "plain"
    budgets = _budgets(cal.budget)
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
            "plain_predicted_tokens_per_s": round(_plain_rate(measured), 3),
            "tree_tokens_per_s": round(check.tree_tokens_per_s, 3),
            "tree_predicted_tokens_per_s": round(best_tree.predicted_tokens_per_s, 3),
            "tree_predicted_speedup": round(best_tree.predicted_speedup, 4),
            "tree_measured_speedup": round(check.tree_speedup, 4),
            "accepted_per_pass": round(check.accepted_per_pass, 3),
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
        "plain": {"target_s": measured.plain.target_s, "overhead_s": measured.plain.overhead_s},
        "acceptance": {
            "tau": {str(b): round(t, 4) for b, t in cal.tau(budgets).items()},
            "accept_probs": [round(a, 5) for a in cal.accept_probs()],
            "branching": round(cal.branching(), 4),
        },
        "calibration": cal.to_dict(),
    }


def _plain_rate(measured: Measured) -> float:
    return 1.0 / (measured.target_curve.t(1) + measured.plain.overhead_s)


def _predicted_accepted(measured: Measured, choice: tuner.Choice) -> float:
    """Return the tokens per target pass the tuner expects from a choice."""
    if choice.kind == "sequoia" and choice.tree is not None:
        return tuner.expected_accepted(choice.tree, measured.calibration.accept_probs())
    if choice.kind == "specexec":
        return measured.calibration.tau([choice.budget], choice.depth)[choice.budget]
    return 1.0


def profile_summary(profile: dict) -> dict:
    """Return the profile as printed by --json (everything but the per-step calibration records)."""
    out = dict(profile)
    if "calibration" in out:
        out["calibration"] = {k: v for k, v in out["calibration"].items() if k not in ("steps", "draft_ranks")}
    return out


# --------------------------------------------------------------------------------------------
# Output


def report_lines(profile: dict) -> list[str]:
    """Return the human-readable report: the choice, prediction vs measurement, small charts."""
    config = profile["config"]
    check = profile.get("check", {})
    lines = [f"{profile['models']['target']} with draft {profile['models']['draft']}, {profile['threads']} threads"]
    if config["kind"] == "plain":
        tree = profile.get("best_tree") or {}
        if tree.get("predicted_speedup", 0.0) >= tuner.MIN_SPEEDUP:
            lines.append("choice: plain decoding (the best tree was predicted faster but measured slower)")
        else:
            lines.append("choice: plain decoding (speculation does not pay here)")
        if tree and tree.get("kind") != "plain":
            lines.append(
                f"  best tree ({_config_text(tree)}): predicted x{tree['predicted_speedup']:.2f}, "
                f"measured x{check.get('tree_measured_speedup', 0.0):.2f}"
            )
    else:
        lines.append(f"choice: {_config_text(config)}")
        lines.append(
            f"  speedup over plain decoding: predicted x{profile['predicted_speedup']:.2f}, "
            f"measured x{profile['measured_speedup']:.2f} "
            f"({check.get('tree_tokens_per_s', 0):.1f} vs {check.get('plain_tokens_per_s', 0):.1f} tok/s, "
            f"{check.get('accepted_per_pass', 0):.2f} tokens per pass)"
        )
        if check.get("predicted_accepted_per_pass"):
            lines.append(
                f"  tokens per pass: predicted {check['predicted_accepted_per_pass']:.2f}, "
                f"measured {check['accepted_per_pass']:.2f}"
            )
        if not check.get("identical_output", True):
            lines.append("  warning: the tree's output differed from plain decoding on a held-out prompt")
    plain_predicted = check.get("plain_predicted_tokens_per_s")
    plain_measured = check.get("plain_tokens_per_s")
    if plain_predicted and plain_measured and abs(plain_measured / plain_predicted - 1) > DRIFT_WARNING:
        lines.append(
            f"  note: plain decoding ran at {plain_measured:.1f} tok/s in the check but "
            f"{plain_predicted:.1f} tok/s when measured: the machine's speed changed while tuning "
            "(other work running?), so predictions are rough"
        )
    n_steps = profile.get("calibration", {}).get("n_steps", MIN_CALIBRATION_STEPS)
    if n_steps < MIN_CALIBRATION_STEPS:
        lines.append(
            f"  note: calibration saw only {n_steps} target passes before its time ran out, so "
            "acceptance is a rough estimate (tune again on a quieter machine, or without --quick)"
        )
    curves = profile["curves"]
    lines.append("target pass time by tokens in the batch:")
    lines += _bars({f"{n:>5}": s * 1000 for n, s in zip(curves["target"]["sizes"], curves["target"]["seconds"])}, "ms")
    lines.append("draft pass time by batch width:")
    lines += _bars({f"{n:>5}": s * 1000 for n, s in zip(curves["draft"]["sizes"], curves["draft"]["seconds"])}, "ms")
    tau = {int(b): t for b, t in profile["acceptance"]["tau"].items()}
    shown = {b: tau[b] for b in CHART_BUDGETS if b in tau}
    largest = max(tau) if tau else 0
    if largest and largest not in shown:
        shown[largest] = tau[largest]
    lines.append("tokens per target pass tau(B) by tree budget B:")
    lines += _bars({f"{b:>5}": t for b, t in sorted(shown.items())}, "tok")
    return lines


def _config_text(config: dict) -> str:
    if config["kind"] == "sequoia":
        return f"Sequoia static tree of {config['budget']} draft tokens, depth {config['depth']}"
    return (
        f"SpecExec tree, budget {config['budget']}, depth {config['depth']}, width {config['width']}, "
        f"top-k {config['top_k']}"
    )


_EIGHTHS = " ▏▎▍▌▋▊▉█"


def _bars(values: dict[str, float], unit: str, width: int = 32) -> list[str]:
    """Return one unicode bar per value, scaled to the largest."""
    top = max(values.values(), default=0.0)
    lines = []
    for label, value in values.items():
        eighths = round(width * 8 * value / top) if top > 0 else 0
        bar = "█" * (eighths // 8) + (_EIGHTHS[eighths % 8] if eighths % 8 else "")
        lines.append(f"  {label} {bar:<{width}} {value:8.2f} {unit}")
    return lines


def _curve_text(points: dict[int, float]) -> str:
    return ", ".join(f"{n}: {s * 1000:.1f} ms" for n, s in sorted(points.items()))


def _gpu_note(hardware: profiler.Hardware) -> str:
    gpus = hardware.gpus
    if not gpus:
        return ", no GPU"
    return ", " + ", ".join(f"{g.name} ({g.free_bytes / 2**30:.1f} of {g.total_bytes / 2**30:.1f} GiB free)" for g in gpus)


def _warn_if_busy(hardware: profiler.Hardware) -> None:
    """Warn when other work is using the CPU: every timing would be slower and noisier."""
    busy = _cpu_busy_fraction()
    if busy is not None:
        if busy > BUSY_FRACTION:
            ui.warn(
                f"the machine is busy ({busy:.0%} of {hardware.cores} cores in use by other work): "
                "timings will be noisy and the profile may not fit a quiet machine"
            )
        return
    try:
        load = os.getloadavg()[0]  # no /proc/stat: the load average also counts work just ended
    except (OSError, AttributeError):
        return
    if load > 0.5 * hardware.cores + 0.5:
        ui.warn(
            f"the machine is busy (load {load:.1f} on {hardware.cores} cores): timings will be noisy "
            "and the profile may not fit a quiet machine"
        )


def _cpu_busy_fraction(seconds: float = 0.5) -> float | None:
    """Return the share of all CPU time used over a short sleep (by others: we sleep), or None."""

    def sample() -> tuple[int, int]:
        with open("/proc/stat", encoding="ascii") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        return sum(fields[:8]), idle

    try:
        total0, idle0 = sample()
        time.sleep(seconds)
        total1, idle1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    total = total1 - total0
    return (total - (idle1 - idle0)) / total if total > 0 else None


@contextmanager
def _progress():
    """Yield a Rich progress display on stderr (transient: it disappears when done)."""
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    progress = Progress(
        SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
        console=ui.err_console(), transient=True,
    )
    with progress:
        yield progress


# --------------------------------------------------------------------------------------------
# Plot


def _require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install 'specrun[plot]' (or pip install matplotlib)") from None


def write_plot(profile: dict, path: Path) -> None:
    """Write the cost curves and tau(B) as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = profile["curves"]
    tau = sorted((int(b), t) for b, t in profile["acceptance"]["tau"].items())
    fig, (ax_cost, ax_tau) = plt.subplots(1, 2, figsize=(10, 4))
    for name, curve in (("target", curves["target"]), ("draft (incl. top-k)", curves["draft"])):
        ax_cost.plot(curve["sizes"], [s * 1000 for s in curve["seconds"]], marker="o", label=name)
    ax_cost.set_xscale("log", base=2)
    ax_cost.set_xlabel("tokens in the batch")
    ax_cost.set_ylabel("ms per forward pass")
    ax_cost.set_title("cost curves")
    ax_cost.legend()
    ax_tau.plot([b for b, _ in tau], [t for _, t in tau], marker=".")
    config = profile["config"]
    if config["kind"] == "specexec":
        ax_tau.axvline(config["budget"], color="grey", linestyle=":", label=f"chosen budget {config['budget']}")
        ax_tau.legend()
    ax_tau.set_xscale("log", base=2)
    ax_tau.set_xlabel("tree budget B (draft tokens)")
    ax_tau.set_ylabel("tokens per target pass")
    ax_tau.set_title("tau(B) from calibration")
    models = profile["models"]
    fig.suptitle(f"{models['target']} / {models['draft']}: {_config_text(config) if config['kind'] != 'plain' else 'plain decoding'}")
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    except OSError as e:
        raise UsageError(f"cannot write plot {path}: {e.strerror or e}") from None
    finally:
        plt.close(fig)
