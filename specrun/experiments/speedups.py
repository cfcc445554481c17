"""Speed against plain decoding, as `specrun bench` measures it: each drafter per workload, or
trees of each size, every mode decoding the same prompts in turn (runner.decode_in_turn).

By workload: plain decoding, the draft model's tree, lookup trees and hybrid trees (with `--draft
mtp`, MTP chains and lookup) on each workload's prompts, their decoders shared from prompt to
prompt as a session's are. By budget: plain decoding and trees of the run's kind at each size,
each as given (no speed guard).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from specrun.core.tree_shapes import TreeShape
from specrun.experiments.runner import Modes, Run, by_mode, decode_in_turn, merged
from specrun.experiments.workloads import load_prompts, workload_prompts
from specrun.runtime.drafters import BEST_FIRST, LOOKUP
from specrun.runtime.plan import Plan, RunOptions, build_plan
from specrun.runtime.runtime import Runtime
from specrun.runtime.trees import DEFAULT_SHAPE, LOOKUP_SHAPE, TreePlan

DEFAULT_BUDGETS = (4, 16, 64)
# Tokens every mode decodes of the first prompt before any timing: first decodes pay one-time allocations.
WARM_UP_BY_WORKLOAD = 8
WARM_UP_BY_BUDGET = 16


def by_workload(opts: RunOptions, workload: str, prompts_file: Path | None, max_tokens: int) -> list[dict]:
    """Return a row per workload and mode: plain, the draft model's tree, lookup and hybrid on the
    same prompts (`workload`: a built-in set, "all", or the file's prompts); the row of what a run
    with these options decodes by default is marked."""
    sets = workload_prompts(workload, prompts_file)
    plan = build_plan(replace(opts, lookup=not opts.lookup_only))
    rows = []
    with Runtime(plan) as rt:
        # What a run with these options uses: its plan, checked as the load checked this one (a
        # profile's figures set aside where the target's pass timed now is not the profile's).
        default = _default_mode(build_plan(opts, fetch=False).checked(rt.target_pass_s).tree)
        trees = _mode_trees(rt.plan)
        modes = Modes(rt, trees, fresh=False)
        for name, texts in sets.items():
            prompts = [rt.tokenize_prompt(t, chat=True) for t in texts]
            runs = by_mode(decode_in_turn(modes, prompts, max_tokens, warm_up=WARM_UP_BY_WORKLOAD))
            for mode, tree in trees.items():
                row = _workload_row(name, mode, tree, runs[mode], runs["plain"])
                row["default"] = mode == default
                rows.append(row)
    return rows


def by_budget(opts: RunOptions, budgets: list[int] | None, prompts_file: Path | None, max_tokens: int,
              width: int | None = None, children: int | None = None) -> list[dict]:
    """Return a row per tree: plain and speculative decoding of the same target on the same prompts.

    Without `budgets` the configuration this pair actually runs with (tuned profile or default)
    comes first, then trees of its kind at the default budgets; each budget grows trees of the
    tuned (or default) kind at that size; `width` and `children` override the kind's nodes
    expanded per draft pass and children per node.
    """
    texts = load_prompts(prompts_file) if prompts_file else workload_prompts("chat", None)["chat"]
    opts = replace(opts, lookup=opts.lookup is True)  # tree sizes compare the draft model's trees
    configs = budget_configs(opts, budgets, width, children)
    largest = max(configs, key=lambda c: c[1].verified.budget)[1]
    plan = build_plan(replace(opts, budget=largest.shape.budget)) if opts.lookup_only else build_plan(opts, largest.verified)
    with Runtime(plan) as rt:
        prompts = [rt.tokenize_prompt(t, chat=True) for t in texts]
        modes = Modes(rt, {"plain": None, **dict(configs)}, fresh=False, guard=False)
        runs = by_mode(decode_in_turn(modes, prompts, max_tokens, warm_up=WARM_UP_BY_BUDGET))
    plain = merged(runs["plain"])
    return [_budget_row(label, tree, merged(runs[label]), plain, _outputs(runs[label]) == _outputs(runs["plain"]))
            for label, tree in configs]


def budget_configs(opts: RunOptions, budgets: list[int] | None, width: int | None,
                   children: int | None) -> list[tuple[str, TreePlan]]:
    """Return the (label, tree) rows to measure: the run's own configuration first when no budgets
    are given, then the tuned (or default) tree kind at each budget."""
    run = build_plan(replace(opts, budget=None), fetch=True)
    run_tree = run.tree or TreePlan(DEFAULT_SHAPE, BEST_FIRST, "default")
    if opts.lookup_only:
        return [(f"budget {b}", _lookup_plan(replace(LOOKUP_SHAPE, budget=b))) for b in budgets or DEFAULT_BUDGETS]
    configs = []
    if not budgets:
        label = {"profile": "tuned", "default": "default", "flags": "flags"}[run_tree.source] if run.tree else "default"
        configs.append((label, run_tree))
        budgets = list(DEFAULT_BUDGETS)
    for budget in budgets:
        shape = _bench_shape(run_tree.shape, budget, opts.depth, width, children)
        configs.append((f"budget {budget}", TreePlan(shape, BEST_FIRST, "flags", lookup=run_tree.lookup)))
    return configs


def _bench_shape(base: TreeShape, budget: int, depth: int | None, width: int | None = None,
                 children: int | None = None) -> TreeShape:
    """Return the tree for one bench budget: the base's kind (chain or tree) at that size."""
    kind = replace(base, width=width or base.width, top_k=children or base.top_k)
    shape = kind.resized(budget)
    return replace(shape, depth=depth) if depth else shape


def _lookup_plan(shape: TreeShape) -> TreePlan:
    return TreePlan(shape, LOOKUP, "flags", lookup=shape)


def _default_mode(tree: TreePlan | None) -> str:
    """The bench mode that decodes as a run does by default (the plan's drafter)."""
    if tree is None:
        return "plain"
    # A draft model's tree without lookup branches, best-first or Sequoia, is the "draft tree" mode.
    return {"draft model": "draft tree", "sequoia": "draft tree"}.get(tree.drafter, tree.drafter)


def _mode_trees(plan: Plan) -> dict[str, TreePlan | None]:
    """Return each mode's tree in the order a workload row decodes them (plain, draft tree,
    lookup, hybrid; without a draft model, no draft rows)."""
    trees: dict[str, TreePlan | None] = {"plain": None}
    if plan.tree is not None and plan.tree.drafting.loads_mtp:  # --draft mtp: the target's MTP chains beside lookup
        return {"plain": None, "lookup": _lookup_plan(LOOKUP_SHAPE), "mtp": plan.tree}
    lookup = _lookup_plan(LOOKUP_SHAPE) if plan.tree is None or plan.draft_loaded else plan.tree
    if plan.draft_loaded:
        trees["draft tree"] = replace(plan.tree, lookup=None)
    trees["lookup"] = replace(lookup, plain_s=plan.tree.plain_s if plan.tree else None)
    if plan.draft_loaded:
        trees["hybrid"] = plan.tree
    return trees


def _outputs(runs: list[Run]) -> list[list[int]]:
    return [run.tokens for run in runs]


def _workload_row(workload: str, mode: str, tree: TreePlan | None, runs: list[Run], plain_runs: list[Run]) -> dict:
    stats, plain = merged(runs), merged(plain_runs)
    counts = stats.as_dict()
    rate, plain_rate = stats.tokens_per_s or 0.0, plain.tokens_per_s or 0.0  # (None: no token after a first)
    return {
        "workload": workload,
        "mode": mode,
        "tree": tree.describe() if tree is not None else "plain decoding",
        "tokens_per_s": round(rate, 2),
        "ratio_to_plain": round(rate / plain_rate, 3) if plain_rate else 0.0,
        "accepted_per_pass": round(stats.accepted_per_pass, 3),
        "lookup_share": round(counts["lookup_tokens"] / stats.n_generated, 3) if stats.n_generated else 0.0,
        "lookup_tokens": counts["lookup_tokens"],
        "draft_tokens": counts["draft_tokens"],
        "n_tokens": stats.n_generated,
        "identical_output": _outputs(runs) == _outputs(plain_runs),
    }


def _budget_row(label: str, tree: TreePlan, stats, plain, identical: bool) -> dict:
    shape = tree.shape
    rate, plain_rate = stats.tokens_per_s or 0.0, plain.tokens_per_s or 0.0  # (None: no token after a first)
    return {
        "config": label,
        "tree": tree.describe(),
        "budget": shape.budget,
        "depth": shape.depth,
        "width": shape.width,
        "top_k": shape.top_k,
        "plain_tokens_per_s": round(plain_rate, 2),
        "spec_tokens_per_s": round(rate, 2),
        "speedup": round(rate / plain_rate, 3) if plain_rate else 0.0,
        "accepted_per_pass": round(stats.accepted_per_pass, 3),
        "overhead_fraction": round(stats.total("overhead_s") / stats.decode_s, 4) if stats.decode_s else 0.0,
        "identical_output": identical,
    }
