"""`--draft lookup` and `--lookup` through the CLI: the plan names the drafter, generate, chat and
bench count what lookup contributed, and the session's index serves later requests."""

from __future__ import annotations

import json

import pytest
from test_runtime_profile import PLAIN, store_measured
from typer.testing import CliRunner

from specrun.cli import app
from specrun.experiments.workloads import KINDS, WORKLOADS, load_prompts, workload_prompts

COPY = "Repeat this line exactly, twice: the quick brown fox jumps over the lazy dog near the river bank."


def invoke(*args: str, input: str | None = None):
    return CliRunner().invoke(app, list(args), input=input)


def test_plan_names_the_lookup_drafter_and_loads_no_draft(offline_models):
    result = invoke("plan", "--draft", "lookup", "--json")

    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)
    assert plan["drafter"] == "lookup" and plan["draft"] is None
    assert plan["contexts"]["draft"] is None
    # One target pass holds the largest lookup tree and its root.
    assert plan["contexts"]["target"]["n_batch"] >= plan["tree"]["budget"] + 1
    text = invoke("plan", "--draft", "lookup", "--budget", "12")
    assert text.exit_code == 0 and "drafter  lookup: lookup trees of up to 12 tokens" in text.stdout


def test_plan_with_lookup_is_hybrid_and_sizes_the_target_batch_for_both(offline_models):
    result = invoke("plan", "--lookup", "--json")

    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)
    assert plan["drafter"] == "hybrid" and plan["draft"] is not None
    tree = plan["tree"]
    # The draft model's chain may grow online (no profile): the batch holds its largest tree too.
    assert tree["grows_to"] > tree["budget"]
    assert tree["verified_budget"] == tree["grows_to"] + tree["lookup_budget"]
    assert plan["contexts"]["target"]["n_batch"] >= tree["verified_budget"] + 1
    assert "hybrid" in invoke("plan", "--lookup").stdout


def test_lookup_branches_join_the_draft_model_by_default_and_no_lookup_turns_them_off(offline_models):
    default = json.loads(invoke("plan", "--json").stdout)
    assert default["drafter"] == "hybrid" and default["tree"]["lookup_budget"] > 0
    off = json.loads(invoke("plan", "--no-lookup", "--json").stdout)
    assert off["drafter"] == "draft model" and off["tree"]["lookup_budget"] == 0
    plain = invoke("plan", "--no-spec", "--json")
    assert plain.exit_code == 0 and json.loads(plain.stdout)["drafter"] == "none"
    refused = invoke("plan", "--no-spec", "--lookup")
    assert refused.exit_code != 0 and "--no-spec" in refused.output


def test_no_spec_does_not_go_with_lookup(offline_models):
    for args in (["--lookup"], ["--draft", "lookup"]):
        result = invoke("plan", "--no-spec", *args)
        assert result.exit_code == 2 and "--no-spec" in result.output and "Traceback" not in result.output


def test_generate_with_lookup_counts_tokens_from_the_text(offline_models, virtual_clock):
    virtual_clock(lambda n_tokens: 0.020 + 0.0005 * n_tokens)  # (conftest.VirtualClock: trees sized alike anywhere)
    result = invoke("generate", "--draft", "lookup", "--json", "-n", "24", COPY)

    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["drafter"] == "lookup" and out["speculative"]
    stats = out["stats"]
    assert stats["lookup_tokens"] > 0 and stats["draft_tokens"] == 0
    assert stats["accepted_per_pass"] > 1


def test_jsonl_requests_share_the_session_index(offline_models, virtual_clock):
    """The second of two identical requests finds the first one's answer in the session's text."""
    virtual_clock(lambda n_tokens: 0.020 + 0.0005 * n_tokens)
    line = json.dumps({"prompt": "Name three colours.", "max_tokens": 16}) + "\n"

    result = invoke("generate", "--jsonl", "--draft", "lookup", input=line * 2)

    assert result.exit_code == 0, result.output
    first, second = [json.loads(row) for row in result.stdout.splitlines()]
    assert first["drafter"] == "lookup" and first["text"] == second["text"]
    assert second["stats"]["lookup_tokens"] > first["stats"]["lookup_tokens"]
    assert second["stats"]["n_passes"] < first["stats"]["n_passes"]


def test_chat_stats_say_where_accepted_drafts_came_from(offline_models):
    result = invoke("chat", "--draft", "lookup", "-n", "12", input="Say hello.\n/stats\n/exit\n")

    assert result.exit_code == 0, result.output
    assert "from lookup" in result.output and "drafter lookup" in result.output


def test_bench_workload_rows_compare_four_modes(tmp_path, offline_models):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": COPY.replace(": ", ":\n")}) + "\n", encoding="utf-8")

    result = invoke("bench", "--json", "--prompts", str(prompts), "--max-tokens", "8")

    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.strip()]
    assert [row["mode"] for row in rows] == ["plain", "draft tree", "lookup", "hybrid"]
    assert [row["mode"] for row in rows if row["default"]] == ["hybrid"]  # what a run uses: no profile here
    for row in rows:
        assert row["workload"] == "prompts" and row["tokens_per_s"] > 0 and row["n_tokens"] == 8
        assert row["ratio_to_plain"] == pytest.approx(row["tokens_per_s"] / rows[0]["tokens_per_s"], rel=0.02)
    # Which tokens came from where (how many is timing-dependent: both lookup modes adapt).
    assert rows[0]["lookup_tokens"] == rows[0]["draft_tokens"] == 0
    assert rows[1]["lookup_tokens"] == 0 and rows[2]["draft_tokens"] == 0
    assert rows[2]["lookup_share"] == round(rows[2]["lookup_tokens"] / 8, 3)


def test_bench_marks_what_a_run_uses_after_the_profile_check(tmp_path, offline_models):
    """A profile found the draft's trees slower when the target's pass took 10 s: this machine is
    not in that state now, so runs decide as without the profile and bench marks the hybrid."""
    store_measured(offline_models, PLAIN, pass_s=10.0, threads=None)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "Name a colour."}) + "\n", encoding="utf-8")

    result = invoke("bench", "--json", "--prompts", str(prompts), "--max-tokens", "8")

    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.strip()]
    assert [row["mode"] for row in rows] == ["plain", "draft tree", "lookup", "hybrid"]
    assert [row["mode"] for row in rows if row["default"]] == ["hybrid"]


def test_bench_workload_options(tmp_path, offline_models):
    assert set(workload_prompts("all", None)) == {"chat", "code", "rewrite"}
    assert workload_prompts("code", None) == {"code": WORKLOADS["code"][:KINDS]}  # one of each kind
    assert all("\n" in prompt for prompt in WORKLOADS["code"])  # a pasted function
    lines = tmp_path / "lines.txt"
    lines.write_text("one\n\ntwo\n", encoding="utf-8")
    assert load_prompts(lines) == ["one", "two"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"text": "no prompt"}\n', encoding="utf-8")

    unknown = invoke("bench", "--workload", "poetry")
    broken = invoke("bench", "--prompts", str(bad))
    mixed = invoke("bench", "--workload", "chat", "--budget", "4")

    assert unknown.exit_code == 2 and "unknown workload" in unknown.output
    assert broken.exit_code == 2 and "line 2" in broken.output
    assert mixed.exit_code == 2 and "pick one" in " ".join(mixed.output.split())


def test_tune_accepts_lookup_drafting(offline_models):
    result = invoke("tune", "--draft", "lookup")

    assert result.exit_code == 0, result.output
    assert "needs no tuning" in result.output
