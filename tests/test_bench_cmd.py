"""`specrun bench` end to end on the offline demo pair, driven through the CLI."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from specrun.cli import app

BENCH_KEYS = {"budget", "plain_tokens_per_s", "spec_tokens_per_s", "speedup", "accepted_per_pass", "identical_output"}


def test_bench_json_compares_plain_and_speculative_per_budget(tmp_path, offline_models):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("What is the capital of France?\n\nWrite a haiku about rain.\n", encoding="utf-8")

    result = CliRunner().invoke(
        app, ["bench", "--json", "--budget", "1", "--budget", "4", "--max-tokens", "16", "--prompts", str(prompts)]
    )

    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.strip()]
    assert [row["budget"] for row in rows] == [1, 4]
    for row in rows:
        assert BENCH_KEYS <= set(row), row
        assert row["plain_tokens_per_s"] > 0 and row["spec_tokens_per_s"] > 0
        # Speeds are rounded to 0.01 tok/s: at a slow moment that alone moves their ratio.
        spec, plain = row["spec_tokens_per_s"], row["plain_tokens_per_s"]
        rounding = (spec + 0.005) / max(plain - 0.005, 1e-9) - spec / plain
        assert abs(row["speedup"] - spec / plain) <= 0.001 + rounding
        # The Q4_1 draft agrees with its F32 target: a budget-1 tree is accepted most of the time.
        assert 1.3 <= row["accepted_per_pass"] <= row["budget"] + 1
        assert row["identical_output"] is True


def test_bench_rejects_an_empty_prompts_file(tmp_path, offline_models):
    prompts = tmp_path / "empty.txt"
    prompts.write_text("\n  \n", encoding="utf-8")

    result = CliRunner().invoke(app, ["bench", "--json", "--budget", "1", "--prompts", str(prompts)])

    assert result.exit_code != 0
    assert "has no prompts" in " ".join(result.output.split())  # one line, however the terminal wraps it
    assert "Traceback" not in result.output


def test_bench_tree_kind_follows_width_and_children(tmp_path, offline_models):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Name three fruits.\n", encoding="utf-8")
    args = ["bench", "--json", "--max-tokens", "8", "--prompts", str(prompts), "--budget", "3"]

    chain = CliRunner().invoke(app, args + ["--width", "1", "--children", "1"])
    tree = CliRunner().invoke(app, args + ["--width", "2", "--children", "2", "--depth", "2"])

    assert chain.exit_code == 0 and tree.exit_code == 0, chain.output + tree.output
    chain_row, tree_row = json.loads(chain.stdout), json.loads(tree.stdout)
    # A chain's depth is its budget; a tree keeps the depth it was given.
    assert (chain_row["depth"], chain_row["width"], chain_row["top_k"]) == (3, 1, 1)
    assert (tree_row["depth"], tree_row["width"], tree_row["top_k"]) == (2, 2, 2)
    assert chain_row["identical_output"] and tree_row["identical_output"]


def test_bench_measures_plain_decoding_and_every_tree_size_in_turn_prompt_by_prompt(tmp_path, offline_models, decodes):
    """A machine that slows down while the budget table is measured meets every row alike: each
    prompt is decoded plainly and by every tree before the next, the order rotating, as the
    workload table does (measured one after the other, a later row ran on a slower machine)."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Name three fruits.\nName three colours.\nName three rivers.\n", encoding="utf-8")

    result = CliRunner().invoke(app, ["bench", "--json", "--budget", "1", "--budget", "2", "--max-tokens", "4",
                                      "--prompts", str(prompts)])

    assert result.exit_code == 0, result.output
    timed = [d for d in decodes if d.max_tokens == 4]  # the warm-up decodes ask for more
    blocks = [timed[i:i + 3] for i in range(0, len(timed), 3)]
    assert len(blocks) == 3 and all(len({d.prompt for d in block}) == 1 for block in blocks)
    assert len({d.prompt for d in timed}) == 3
    assert all(len({d.decoder for d in block}) == 3 for block in blocks)  # plain and both trees, each once
    assert len({block[0].decoder for block in blocks}) == 3  # each mode goes first once
