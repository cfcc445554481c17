"""The model pair measured for the tuner on a loaded runtime, and the tree the tuner chooses.

One experiment, two users: `specrun tune` measures the target's and the draft's cost curves,
plain decoding and one calibration run, chooses, then checks the choice on held-out prompts;
`specrun bench --report` measures the same way (the whole target curve: the report shows where
it jumps) and shows the figures beside the choice.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from specrun.core.tree_shapes import TreeShape
from specrun.decoding.pay.rules import predicted_pays
from specrun.hardware import offload
from specrun.limits import MAX_SEQ
from specrun.tuning import cost_model as tuner
from specrun.tuning import measure

# Trees of this many tokens (root included) at most for Sequoia: its inner nodes must fit the
# draft's sequence ids (sequoia_draft.MAX_INNER_NODES).
MAX_SEQUOIA_TOKENS = MAX_SEQ
# Depth limits the tuner weighs below the calibrated depth (which it always weighs).
DEPTHS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32)


@dataclass(frozen=True)
class PairSettings:
    """How hard the pair is measured: the calibration tree's size and kind, and time budgets in
    seconds per phase."""

    max_budget: int  # largest tree (draft tokens) calibrated
    depth: int  # depth limit of the calibration tree: deeper trees are not considered
    width: int  # nodes per draft pass while calibrating
    top_k: int  # children per expanded node
    curve_repeats: int
    curve_seconds: float
    calibration_prompts: int
    calibration_tokens: int
    calibration_seconds: float


@dataclass
class Measured:
    """Everything the tuner's choice is made from."""

    target: measure.CurveMeasurement
    draft: measure.CurveMeasurement
    plain: measure.PlainTiming
    calibration: measure.Calibration
    overhead_s: float  # per calibration step (a tree of the calibration budget)
    overhead_per_pass_s: float  # the same, per forward pass: what the tuner's cost model uses
    # The draft grows its trees during the target's passes (runtime.drafts_while_verifying).
    overlapped: bool = False

    @property
    def target_curve(self) -> tuner.CostCurve:
        return self.target.curve()

    @property
    def draft_curve(self) -> tuner.CostCurve:
        return self.draft.curve()

    @property
    def plain_tokens_per_s(self) -> float:
        """Plain decoding's rate as predicted from the target's one-token pass and its overhead."""
        return 1.0 / (self.target_curve.t(1) + self.plain.overhead_s)


def measure_pair(rt, settings: PairSettings, shape: TreeShape, progress, whole_curve: bool = False) -> Measured:
    """Measure the runtime's pair on the built-in calibration prompts: the target's cost curve up to
    a tree of `shape`, the draft's, plain decoding and a calibration run, each phase a bar of
    `progress` (a rich Progress). The target's curve stops where a tree could no longer pay, and
    the calibration tree is cut to the largest that could; `whole_curve` measures every size and
    calibrates `shape` itself."""
    prompts = [rt.tokenize_prompt(text, chat=True) for _, text in measure.CALIBRATION_PROMPTS]
    steps = offload.cost_steps(rt.plan.placement)
    sizes = measure.curve_sizes(shape.budget + 1, steps)
    task = progress.add_task("target cost curve", total=len(sizes))
    target = measure.measure_curve(
        rt.target_ctx, prompts[0], sizes, repeats=settings.curve_repeats, steps=steps,
        deadline=time.monotonic() + settings.curve_seconds,
        # A tree costing more than depth + 1 plain passes loses even if all of it is accepted.
        stop_ratio=None if whole_curve else shape.depth + 1.0,
        on_size=lambda n, s: progress.advance(task),
    )
    progress.update(task, completed=len(sizes))

    widths = measure.curve_sizes(max(tuner.DEFAULT_WIDTHS[-1], 2 * shape.width))
    task = progress.add_task("draft cost curve", total=len(widths))
    draft = measure.measure_curve(
        rt.draft_ctx, prompts[0], widths, repeats=settings.curve_repeats,
        deadline=time.monotonic() + settings.curve_seconds / 2, top_k=shape.top_k,
        on_size=lambda n, s: progress.advance(task),
    )
    progress.update(task, completed=len(widths))

    plain = measure.measure_plain(rt.target, rt.target_ctx, prompts[0], 16)

    budget = shape.budget if whole_curve else _calibration_budget(target.curve(), shape.budget, shape.depth)
    n_prompts = settings.calibration_prompts
    task = progress.add_task(f"calibrating (tree of {budget})", total=n_prompts * settings.calibration_tokens)
    calibration = measure.calibrate(
        rt.target, rt.target_ctx, rt.draft, rt.draft_ctx, prompts[:n_prompts],
        TreeShape(budget, shape.depth, min(shape.width, budget), min(shape.top_k, budget)),
        settings.calibration_tokens, deadline=time.monotonic() + settings.calibration_seconds,
        on_step=lambda n: progress.advance(task, n),
    )
    progress.update(task, completed=n_prompts * settings.calibration_tokens)
    topk = draft.topk_curve()
    return Measured(
        target, draft, plain, calibration, calibration.overhead_s(topk), calibration.overhead_per_pass_s(topk),
        overlapped=rt.overlap,
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


def tau_budgets(largest: int) -> list[int]:
    """Return the budgets the tuner weighs (and a profile's tau curve holds): every size up to
    64, then steps of about 6%."""
    return tuner.size_grid(1, 64, largest, 1.06)


def choose(measured: Measured) -> tuple[tuner.Choice, tuner.Choice]:
    """Return (the choice, the best tree even if it loses to plain decoding): the best SpecExec
    and Sequoia trees the measured curves and acceptance predict, or plain decoding where neither
    is predicted to pay (decoding.pay.rules.predicted_pays)."""
    inputs = _tuner_inputs(measured)
    cal = measured.calibration
    best_specexec = tuner.choose_config(**inputs, best_even_if_losing=True)
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
        best_even_if_losing=True,
    )
    candidates = [c for c in (best_specexec, best_sequoia) if c.kind != "plain"]
    if not candidates:
        plain = tuner.choose_config(**inputs)
        return plain, plain
    best = max(candidates, key=lambda c: c.predicted_tokens_per_s)
    if not predicted_pays(best.predicted_speedup):
        plain_rate = best.predicted_tokens_per_s / best.predicted_speedup
        return tuner.Choice("plain", 0, 0, 0, 0, plain_rate, 1.0), best
    return best, best


def _tuner_inputs(measured: Measured) -> dict:
    cal = measured.calibration
    budgets = tau_budgets(cal.budget)
    depths = [d for d in DEPTHS if d < cal.depth] + [cal.depth]
    return {
        "target_curve": measured.target_curve,
        "draft_curve": measured.draft_curve,
        "overhead": 0.0,
        "overhead_per_pass": measured.overhead_per_pass_s,
        "tau_by_depth": cal.tau_by_depth(budgets, depths),
        "depth": cal.depth,
        "top_k": cal.top_k,
        "branching": cal.branching(),
        "plain_overhead": measured.plain.overhead_s,
        "max_tree_tokens": cal.budget + 1,
        "overlapped": measured.overlapped,
    }
