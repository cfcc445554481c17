"""`specrun bench`: plain vs speculative tokens/s on the same prompts.

Two tables. By workload (the default): for each prompt set (chat, code edit, rewrite/quote, or a
file) plain decoding, the draft model's tree, lookup trees and hybrid trees, measured in one run
with the modes alternating (each prompt rotates their order, so a machine that slows down or
speeds up meets every mode alike). By budget (`--budget`): plain vs trees of the run's kind at
each size.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Iterable

from specrun import engine, ui
from specrun.experiments.workloads import load_prompts, workload_prompts
from specrun.core.sampling import SamplingParams
from specrun.decoding.plain import PlainDecoder
from specrun.decoding.steps import GenerationStats
from specrun.decoding.stream import token_ids
from specrun.errors import UsageError
from specrun.runtime.plan import RunOptions, build_plan
from specrun.runtime.runtime import Runtime, make_decoder
from specrun.runtime.trees import DEFAULT_SHAPE, LOOKUP_SHAPE, TreePlan
from specrun.tuning import report


def measure(decoder, rt: Runtime, prompts: Iterable[list[int]], max_tokens: int):
    """Return (tokens/s, accepted per pass, overhead fraction, generated ids) over the prompts."""

    greedy = SamplingParams()
    n_tokens = 0
    seconds = overhead = 0.0
    passes = 0
    outputs = []
    for prompt in prompts:
        outputs.append(token_ids(decoder, prompt, greedy, max_tokens))
        stats = decoder.stats
        n_tokens += stats.n_generated
        seconds += stats.decode_s
        overhead += stats.total("overhead_s")
        passes += stats.n_passes
    return (
        n_tokens / seconds if seconds else 0.0,
        n_tokens / passes if passes else 0.0,
        overhead / seconds if seconds else 0.0,
        outputs,
    )


DEFAULT_BUDGETS = (4, 16, 64)


def bench(
    opts: RunOptions, budgets: list[int] | None, prompts_file: Path | None, max_tokens: int, as_json: bool,
    width: int | None = None, children: int | None = None, workload: str | None = None,
) -> list[dict]:
    """Print the workload table, or the budget table when budgets or a tree kind are given."""
    if budgets or width or children:
        if workload is not None:
            raise UsageError("--workload compares drafters; --budget, --width and --children compare tree sizes: pick one")
        return bench_budgets(opts, budgets, prompts_file, max_tokens, as_json, width, children)
    return bench_workloads(opts, workload or "all", prompts_file, max_tokens, as_json)


def bench_budgets(
    opts: RunOptions, budgets: list[int] | None, prompts_file: Path | None, max_tokens: int, as_json: bool,
    width: int | None = None, children: int | None = None,
) -> list[dict]:
    """Compare plain and speculative decoding of the same target on the same prompts; print a table.

    Without `budgets` the configuration this pair actually runs with (tuned profile or default)
    comes first, then trees of its kind at the default budgets; each budget grows trees of the
    tuned (or default) kind at that size; `width` and `children` override the kind's nodes
    expanded per draft pass and children per node.
    """
    texts = load_prompts(prompts_file) if prompts_file else workload_prompts("chat", None)["chat"]
    opts = replace(opts, lookup=opts.lookup is True)  # tree sizes compare the draft model's trees
    configs = bench_configs(opts, budgets, width, children)
    largest = max(configs, key=lambda c: c[1].verified.budget)[1]
    rows = []
    report.warn_if_busy(engine.default_threads(), "speedups measured now may not hold on a quiet machine")
    plan = build_plan(replace(opts, budget=largest.shape.budget)) if opts.lookup_only else build_plan(opts, largest.verified)
    with Runtime(plan) as rt:
        prompts = [rt.tokenize_prompt(t, chat=True) for t in texts]
        plain = PlainDecoder(rt.target, rt.target_ctx)
        measure(plain, rt, prompts[:1], 16)  # warm-up: first decodes pay one-time allocation
        plain_tps, _, plain_overhead, plain_out = measure(plain, rt, prompts, max_tokens)
        for label, tree in configs:
            spec = make_decoder(tree, rt.target, rt.target_ctx, rt.draft, rt.draft_ctx, guard=False)
            measure(spec, rt, prompts[:1], 16)
            spec_tps, per_pass, overhead, spec_out = measure(spec, rt, prompts, max_tokens)
            shape = tree.shape
            row = {
                "config": label,
                "tree": tree.describe(),
                "budget": shape.budget,
                "depth": shape.depth,
                "width": shape.width,
                "top_k": shape.top_k,
                "plain_tokens_per_s": round(plain_tps, 2),
                "spec_tokens_per_s": round(spec_tps, 2),
                "speedup": round(spec_tps / plain_tps, 3) if plain_tps else 0.0,
                "accepted_per_pass": round(per_pass, 3),
                "overhead_fraction": round(overhead, 4),
                "identical_output": spec_out == plain_out,
            }
            rows.append(row)
            if as_json:
                print(json.dumps(row), flush=True)
            else:
                ui.write_text(
                    f"{label:>12}: plain {plain_tps:7.2f} tok/s  spec {spec_tps:7.2f} tok/s  "
                    f"x{row['speedup']:.2f}  accepted/pass {per_pass:.2f}  overhead {overhead:.1%}  ({tree.describe()})"
                    + ("" if row["identical_output"] else "  (OUTPUT DIFFERS)") + "\n"
                )
    return rows


def bench_configs(opts: RunOptions, budgets: list[int] | None, width: int | None, children: int | None) -> list[tuple[str, TreePlan]]:
    """Return the (label, tree) rows to measure: the run's own configuration first when no budgets
    are given, then the tuned (or default) tree kind at each budget."""
    run = build_plan(replace(opts, budget=None), fetch=True)
    run_tree = run.tree or TreePlan(DEFAULT_SHAPE, None, "default")
    if opts.lookup_only:
        configs = [(f"budget {b}", _lookup_plan(replace(LOOKUP_SHAPE, budget=b))) for b in budgets or DEFAULT_BUDGETS]
        return configs
    configs = []
    if not budgets:
        label = {"profile": "tuned", "default": "default", "flags": "flags"}[run_tree.source] if run.tree else "default"
        configs.append((label, run_tree))
        budgets = list(DEFAULT_BUDGETS)
    for budget in budgets:
        shape = _bench_shape(run_tree.shape, budget, opts.depth, width, children)
        configs.append((f"budget {budget}", TreePlan(shape, None, "flags", lookup=run_tree.lookup)))
    return configs


def _bench_shape(base, budget: int, depth: int | None, width: int | None = None, children: int | None = None):
    """Return the tree for one bench budget: the base's kind (chain or tree) at that size."""
    kind = replace(base, width=width or base.width, top_k=children or base.top_k)
    shape = kind.resized(budget)
    return replace(shape, depth=depth) if depth else shape


def _lookup_plan(shape) -> TreePlan:
    return TreePlan(shape, None, "flags", lookup=shape, draft_model=False)


def bench_workloads(opts: RunOptions, workload: str, prompts_file: Path | None, max_tokens: int, as_json: bool,
                    quiet: bool = False) -> list[dict]:
    """Per workload: plain, the draft model's tree, lookup and hybrid on the same prompts, the
    modes alternating prompt by prompt; print one row per workload and mode (unless quiet)."""
    sets = workload_prompts(workload, prompts_file)
    report.warn_if_busy(engine.default_threads(), "speedups measured now may not hold on a quiet machine")
    plan = build_plan(replace(opts, lookup=not opts.lookup_only))
    rows = []
    with Runtime(plan) as rt:
        # What a run with these options uses: its plan, checked as the load checked this one (a
        # profile's figures set aside where the target's pass timed now is not the profile's).
        default = _default_mode(build_plan(opts, fetch=False).checked(rt.target_pass_s).tree)
        trees = _mode_trees(rt.plan)
        decoders = {mode: make_decoder(tree, rt.target, rt.target_ctx, rt.draft, rt.draft_ctx)
                    for mode, tree in trees.items()}
        for name, texts in sets.items():
            prompts = [rt.tokenize_prompt(t, chat=True) for t in texts]
            totals = {mode: GenerationStats() for mode in decoders}
            outputs: dict[str, list] = {mode: [] for mode in decoders}
            modes = list(decoders)
            for i, prompt in enumerate(prompts):
                if i == 0:
                    for mode in modes:  # warm-up: first decodes pay one-time allocations
                        _run(decoders[mode], prompt, 8)
                for mode in modes[i % len(modes):] + modes[: i % len(modes)]:
                    stats, out = _run(decoders[mode], prompt, max_tokens)
                    _add(totals[mode], stats)
                    outputs[mode].append(out)
            for mode in modes:
                row = _workload_row(name, mode, trees[mode], totals[mode], totals["plain"], outputs[mode] == outputs["plain"])
                row["default"] = mode == default
                rows.append(row)
                if not quiet:
                    _print_workload_row(row, as_json)
    return rows


def _default_mode(tree: TreePlan | None) -> str:
    """The bench mode that decodes as a run does by default (the plan's drafter)."""
    if tree is None:
        return "plain"
    if tree.mtp:
        return "mtp"
    if not tree.draft_model:
        return "lookup"
    return "hybrid" if tree.lookup is not None else "draft tree"


def _mode_trees(plan) -> dict[str, TreePlan | None]:
    """Return each mode's tree in the order a workload row decodes them (plain, draft tree,
    lookup, hybrid; without a draft model, no draft rows)."""
    trees: dict[str, TreePlan | None] = {"plain": None}
    if plan.tree is not None and plan.tree.mtp:  # --draft mtp: the target's MTP chains beside lookup
        return {"plain": None, "lookup": _lookup_plan(LOOKUP_SHAPE), "mtp": plan.tree}
    lookup = _lookup_plan(LOOKUP_SHAPE) if plan.tree is None or plan.tree.draft_model else plan.tree
    if plan.draft_loaded:
        trees["draft tree"] = replace(plan.tree, lookup=None)
    trees["lookup"] = replace(lookup, plain_s=plan.tree.plain_s if plan.tree else None)
    if plan.draft_loaded:
        trees["hybrid"] = plan.tree
    return trees


def _run(decoder, prompt: list[int], max_tokens: int):
    """Decode one prompt greedily from an empty cache; return (stats, generated ids).

    The decoders share the target's context: each run starts it afresh (the prefill is not
    timed), while a drafter's own state -- the lookup index of the session -- carries on.
    """
    decoder.reset()
    out = token_ids(decoder, prompt, SamplingParams(), max_tokens)
    return decoder.stats, out


def _add(total: GenerationStats, stats: GenerationStats) -> None:
    total.n_generated += stats.n_generated
    total.decode_s += stats.decode_s
    total.steps.extend(stats.steps)


def _workload_row(workload: str, mode: str, tree, stats: GenerationStats, plain: GenerationStats, identical: bool) -> dict:
    counts = stats.as_dict()
    return {
        "workload": workload,
        "mode": mode,
        "tree": tree.describe() if tree is not None else "plain decoding",
        "tokens_per_s": round(stats.tokens_per_s, 2),
        "ratio_to_plain": round(stats.tokens_per_s / plain.tokens_per_s, 3) if plain.tokens_per_s else 0.0,
        "accepted_per_pass": round(stats.accepted_per_pass, 3),
        "lookup_share": round(counts["lookup_tokens"] / stats.n_generated, 3) if stats.n_generated else 0.0,
        "lookup_tokens": counts["lookup_tokens"],
        "draft_tokens": counts["draft_tokens"],
        "n_tokens": stats.n_generated,
        "identical_output": identical,
    }


def _print_workload_row(row: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(row), flush=True)
        return
    ui.write_text(
        f"{row['workload']:>8} {row['mode'] + ('*' if row.get('default') else ''):>11}: {row['tokens_per_s']:7.2f} tok/s  "
        f"x{row['ratio_to_plain']:.2f} plain  "
        f"accepted/pass {row['accepted_per_pass']:.2f}  from lookup {row['lookup_share']:.0%}"
        + ("" if row["identical_output"] else "  (OUTPUT DIFFERS)") + "\n"
    )
