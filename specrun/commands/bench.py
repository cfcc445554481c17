"""`specrun bench`: plain vs speculative tokens/s on the same prompts.

Two tables. By workload (the default): for each prompt set (chat, code edit, rewrite/quote, or a
file) plain decoding, the draft model's tree, lookup trees and hybrid trees, measured in one run
with the modes alternating (each prompt rotates their order, so a machine that slows down or
speeds up meets every mode alike). By budget (`--budget`): plain vs trees of the run's kind at
each size, taking turns the same way. The measuring is experiments.speedups'.
"""

from __future__ import annotations

import json
from pathlib import Path

from specrun import engine, ui
from specrun.errors import UsageError
from specrun.experiments import speedups
from specrun.runtime.plan import RunOptions
from specrun.tuning import report


def bench(
    opts: RunOptions, budgets: list[int] | None, prompts_file: Path | None, max_tokens: int, as_json: bool,
    width: int | None = None, children: int | None = None, workload: str | None = None,
) -> list[dict]:
    """Print the workload table, or the budget table when budgets or a tree kind are given."""
    by_budget = bool(budgets or width or children)
    if by_budget and workload is not None:
        raise UsageError("--workload compares drafters; --budget, --width and --children compare tree sizes: pick one")
    report.warn_if_busy(engine.default_threads(), "speedups measured now may not hold on a quiet machine")
    if by_budget:
        rows = speedups.by_budget(opts, budgets, prompts_file, max_tokens, width, children)
        print_row = _print_budget_row
    else:
        rows = speedups.by_workload(opts, workload or "all", prompts_file, max_tokens)
        print_row = _print_workload_row
    for row in rows:
        if as_json:
            print(json.dumps(row), flush=True)
        else:
            print_row(row)
    return rows


def _print_budget_row(row: dict) -> None:
    ui.write_text(
        f"{row['config']:>12}: plain {row['plain_tokens_per_s']:7.2f} tok/s  spec {row['spec_tokens_per_s']:7.2f} tok/s  "
        f"x{row['speedup']:.2f}  accepted/pass {row['accepted_per_pass']:.2f}  overhead {row['overhead_fraction']:.1%}  "
        f"({row['tree']})" + _differs(row) + "\n"
    )


def _print_workload_row(row: dict) -> None:
    ui.write_text(
        f"{row['workload']:>8} {row['mode'] + ('*' if row.get('default') else ''):>11}: {row['tokens_per_s']:7.2f} tok/s  "
        f"x{row['ratio_to_plain']:.2f} plain  "
        f"accepted/pass {row['accepted_per_pass']:.2f}  from lookup {row['lookup_share']:.0%}" + _differs(row) + "\n"
    )


def _differs(row: dict) -> str:
    return "" if row["identical_output"] else "  (OUTPUT DIFFERS)"
