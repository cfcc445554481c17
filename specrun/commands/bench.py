"""`specrun bench`: plain vs speculative tokens/s on the same prompts."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Iterable

from specrun import engine, ui
from specrun.core.sampling import SamplingParams
from specrun.decoding.plain import PlainDecoder
from specrun.decoding.stream import token_ids
from specrun.errors import UsageError
from specrun.inputs import decode_utf8
from specrun.runtime.plan import DEFAULT_SHAPE, RunOptions, TreePlan, build_plan
from specrun.runtime.runtime import Runtime, make_decoder
from specrun.tuning import report

BENCH_PROMPTS = [
    "Explain why the sky is blue to a ten-year-old.",
    "Write a Python function that returns the n-th Fibonacci number iteratively, with a docstring.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "List five tips for staying productive when working from home.",
    "What are the main differences between TCP and UDP?",
    "Write a SQL query that finds the ten customers with the highest total order value.",
]


def load_prompts(path: Path | None) -> list[str]:
    if path is None:
        return list(BENCH_PROMPTS)
    try:
        lines = [line.strip() for line in decode_utf8(path.read_bytes(), f"prompts file {path}").splitlines()]
    except OSError as e:
        raise UsageError(f"cannot read prompts file {path}: {e.strerror}") from None
    prompts = [line for line in lines if line]
    if not prompts:
        raise UsageError(f"prompts file {path} has no prompts")
    return prompts


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
    width: int | None = None, children: int | None = None,
) -> list[dict]:
    """Compare plain and speculative decoding of the same target on the same prompts; print a table.

    Without `budgets` the configuration this pair actually runs with (tuned profile or default)
    comes first, then trees of its kind at the default budgets; each budget grows trees of the
    tuned (or default) kind at that size; `width` and `children` override the kind's nodes
    expanded per draft pass and children per node.
    """
    texts = load_prompts(prompts_file)
    configs = bench_configs(opts, budgets, width, children)
    largest = max(configs, key=lambda c: c[1].shape.budget)[1].shape
    rows = []
    report.warn_if_busy(engine.default_threads(), "speedups measured now may not hold on a quiet machine")
    with Runtime(build_plan(opts, largest)) as rt:
        prompts = [rt.tokenize_prompt(t, chat=True) for t in texts]
        plain = PlainDecoder(rt.target, rt.target_ctx)
        measure(plain, rt, prompts[:1], 16)  # warm-up: first decodes pay one-time allocation
        plain_tps, _, plain_overhead, plain_out = measure(plain, rt, prompts, max_tokens)
        for label, tree in configs:
            spec = make_decoder(tree, rt.target, rt.target_ctx, rt.draft, rt.draft_ctx)
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
    configs = []
    if not budgets:
        label = {"profile": "tuned", "default": "default", "flags": "flags"}[run_tree.source] if run.tree else "default"
        configs.append((label, run_tree))
        budgets = list(DEFAULT_BUDGETS)
    for budget in budgets:
        configs.append((f"budget {budget}", TreePlan(_bench_shape(run_tree.shape, budget, opts.depth, width, children), None, "flags")))
    return configs


def _bench_shape(base, budget: int, depth: int | None, width: int | None = None, children: int | None = None):
    """Return the tree for one bench budget: the base's kind (chain or tree) at that size."""
    kind = replace(base, width=width or base.width, top_k=children or base.top_k)
    shape = kind.resized(budget)
    return replace(shape, depth=depth) if depth else shape
