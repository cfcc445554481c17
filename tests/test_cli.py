"""The command line as users meet it: output streams, exit codes, messages, help, start-up time.

Commands run in-process through Typer's CliRunner (stdout and stderr captured apart). Generation
uses the offline SmolLM2 models with one thread and a small context, so each call takes a second
or two even on a busy machine.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from specrun import __version__

sys.path.insert(0, str(Path(__file__).parent))
from fakehub import FakeHub  # noqa: E402

QUESTION = "What is the capital of France?"
ANSWER = "The capital of France is Paris."  # SmolLM2-135M F32, greedy
# Plain decoding of the F32 demo target: the reference output.
PLAIN = ["--target", "smollm2-135m-f32", "--no-spec", "--threads", "1", "--ctx-size", "512"]
COMMANDS = ["generate", "chat", "bench", "tune", "plan", "serve", "pull", "models"]


def config_file(name: str) -> Path:
    path = Path(os.environ["SPECRUN_CONFIG"]) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def one_error_line(result) -> str:
    """Assert stderr is exactly one 'error: ...' line without a traceback; return it."""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    assert "Traceback" not in result.stderr and result.stdout == ""
    return lines[0]


# ---------------------------------------------------------------------------------------------
# generate: where the prompt comes from, where the output goes


def test_generate_prompt_argument_streams_only_text_to_stdout(cli):
    result = cli("generate", QUESTION, "-n", "12", "--stats", *PLAIN)

    assert result.exit_code == 0, result.output
    assert result.stdout == ANSWER + "\n"
    # the summary is on stderr, so `specrun generate ... > out.txt` holds only the answer
    assert "tok/s" in result.stderr and "tokens" in result.stderr
    assert ANSWER not in result.stderr


def test_generate_reads_stdin_and_file(cli, tmp_path):
    from_stdin = cli("generate", "-n", "12", *PLAIN, input=QUESTION + "\n")
    dash = cli("generate", "-", "-n", "12", *PLAIN, input=QUESTION)
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text(QUESTION)
    from_file = cli("generate", "--file", str(prompt_file), "-n", "12", *PLAIN)

    for result in (from_stdin, dash, from_file):
        assert result.exit_code == 0, result.output
        assert result.stdout == ANSWER + "\n"


def test_raw_mode_skips_the_chat_template(cli):
    result = cli("generate", "--raw", "-n", "6", "--json", "The capital of France is", *PLAIN)

    assert result.exit_code == 0, result.output
    text = json.loads(result.stdout)["text"]
    assert "Paris" in text and "<|im_start|>" not in text


def test_stop_string_ends_the_text_before_it(cli):
    result = cli("generate", QUESTION, "-n", "12", "--stop", "Paris", "--stop", "never-seen", "--json", *PLAIN)

    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["text"] == "The capital of France is "
    assert out["finish_reason"] == "stop"


def test_json_prints_one_object_with_text_tokens_and_stats(cli):
    result = cli("generate", QUESTION, "-n", "12", "--json", *PLAIN)

    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert len(lines) == 1
    out = json.loads(lines[0])
    assert out["text"] == ANSWER
    assert out["n_tokens"] == len(out["token_ids"]) > 0
    assert out["tokens_per_s"] > 0 and out["accepted_per_pass"] == 1.0
    assert out["finish_reason"] == "eog" and out["speculative"] is False


def test_default_demo_pair_speculates_and_writes_the_same_text(cli):
    result = cli("generate", QUESTION, "-n", "12", "--json", "--threads", "1", "--ctx-size", "512", "--verbose")

    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["speculative"] is True
    assert out["text"] == ANSWER  # exactly the target's own greedy answer
    if "the draft model stays off" in result.stderr:
        # Timed at load, this machine's passes say the draft's tree could not pay even accepted
        # whole (a host whose target passes are fast): lookup and plain steps decode.
        assert out["stats"]["draft_tokens"] == 0, result.stderr
    else:
        assert out["accepted_per_pass"] > 1.0


def test_sampling_options_and_seed_repeat_a_sampled_answer(cli):
    sampled = ["generate", QUESTION, "-n", "10", "--json", "--temperature", "1.5", "--top-k", "40",
               "--top-p", "0.95", "--min-p", "0.01", *PLAIN]

    first, second = cli(*sampled, "--seed", "7"), cli(*sampled, "--seed", "7")

    assert first.exit_code == second.exit_code == 0, first.output
    assert json.loads(first.stdout)["token_ids"] == json.loads(second.stdout)["token_ids"]
    others = {json.dumps(json.loads(cli(*sampled, "--seed", str(seed)).stdout)["token_ids"]) for seed in (1, 2, 3)}
    assert len(others | {json.dumps(json.loads(first.stdout)["token_ids"])}) > 1  # the seed matters


def test_budget_and_depth_shape_the_tree(cli):
    result = cli("generate", QUESTION, "-n", "12", "--json", "--budget", "2", "--depth", "2", "--threads", "1", "--ctx-size", "512")

    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["text"] == ANSWER
    assert 1.0 < out["accepted_per_pass"] <= 3.0  # at most 2 drafted + 1 bonus token per pass
    assert out["stats"]["mean_tree_nodes"] <= 2


def test_jsonl_answers_each_line_and_reports_bad_lines(cli):
    requests = "\n".join([
        json.dumps({"prompt": QUESTION, "id": "a"}),
        "{not json",
        "",
        json.dumps({"prompt": "Name a colour.", "max_tokens": 3, "id": 7}),
        json.dumps({"prompt": QUESTION, "temperature": -1, "id": "bad-temp"}),
        json.dumps({"max_tokens": 3}),
        json.dumps({"prompt": "The capital of France is", "chat": False, "max_tokens": 4}),
    ]) + "\n"

    result = cli("generate", "--jsonl", "-n", "12", *PLAIN, input=requests)

    assert result.exit_code == 0, result.output
    out = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(out) == 6  # the blank line is skipped
    first, malformed, short, bad_temp, no_prompt, raw = out
    assert first["id"] == "a" and first["text"] == ANSWER
    assert first["n_tokens"] == len(first["token_ids"]) and "tokens_per_s" in first and "accepted_per_pass" in first
    assert malformed["line"] == 2 and "not valid JSON" in malformed["error"]
    assert short["id"] == 7 and short["n_tokens"] == 3 and short["finish_reason"] == "length"
    assert bad_temp["id"] == "bad-temp" and "error" in bad_temp and bad_temp["line"] == 5
    assert "prompt" in no_prompt["error"]
    assert "Paris" in raw["text"]
    # the models stayed loaded, and a bad line did not disturb the next answers
    assert first["text"] == ANSWER


def test_jsonl_reads_a_file(cli, tmp_path):
    requests = tmp_path / "requests.jsonl"
    requests.write_text(json.dumps({"prompt": QUESTION}) + "\n")

    result = cli("generate", "--jsonl", "--file", str(requests), "-n", "12", *PLAIN)

    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["text"] == ANSWER


def test_jsonl_lines_may_carry_a_conversation(cli):
    """A line's "messages" are rendered by the chat template as a prompt's chat mode renders one
    message: the same answers, token for token; a system message, `--system`, and several turns;
    a bad conversation is that line's error, naming the field."""
    user = {"role": "user", "content": QUESTION}
    system = {"role": "system", "content": "You answer in one word."}
    turns = [system, user, {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And of Italy?"}]
    bad = [
        {"messages": [user], "prompt": QUESTION},
        {"messages": []},
        {"messages": [{"role": "bot", "content": "hi"}]},
        {"messages": [user, {"role": "assistant", "content": "Paris."}]},
        {"messages": [{"role": "user", "content": 5}]},
        {"messages": [user], "system": "Be brief."},
    ]
    lines = [{"messages": [user]}, {"prompt": QUESTION},
             {"messages": [system, user]}, {"prompt": QUESTION, "system": system["content"]},
             {"messages": turns}, *bad]
    result = cli("generate", "--jsonl", "-n", "12", *PLAIN, input="\n".join(map(json.dumps, lines)) + "\n")

    assert result.exit_code == 0, result.output
    out = [json.loads(line) for line in result.stdout.splitlines()]
    key = lambda r: (r["stats"]["n_prompt"], r["token_ids"])  # the prompt's length and the answer
    prompt_len = lambda r: r["stats"]["n_prompt"]
    assert key(out[0]) == key(out[1]) and out[0]["text"] == ANSWER
    assert key(out[2]) == key(out[3]) and prompt_len(out[2]) != prompt_len(out[0])  # (the template has a default one)
    assert out[4]["n_tokens"] > 0 and prompt_len(out[4]) > prompt_len(out[2])
    errors = out[5:]
    assert [e.get("field") for e in errors] == ["messages"] * 5 + ["system"]
    assert all("text" not in e and e["line"] == 6 + i for i, e in enumerate(errors))
    assert "not both" in errors[0]["error"] and "role" in errors[2]["error"] and "last message" in errors[3]["error"]

    # --system opens a conversation that has no system message of its own (and only such a one).
    result = cli("generate", "--jsonl", "-n", "12", *PLAIN, "--system", system["content"],
                 input=json.dumps({"messages": [user]}) + "\n" + json.dumps({"messages": [
                     {"role": "system", "content": "You answer every question at great length, with examples."}, user]}) + "\n")
    assert result.exit_code == 0, result.output
    with_flag, own = (json.loads(line) for line in result.stdout.splitlines())
    assert key(with_flag) == key(out[2]) and prompt_len(own) != prompt_len(out[2])


# ---------------------------------------------------------------------------------------------
# exit codes and messages


@pytest.mark.parametrize(
    "args, words",
    [
        (["generate", "hi", "--max-tokens", "0"], "--max-tokens"),
        (["generate", "hi", "--temperature", "-1"], "--temperature"),
        (["generate", "hi", "--no-such-option"], "No such option"),
        (["chat", "--top-p", "2"], "--top-p"),
        (["pull"], "Missing argument"),
        (["frobnicate"], "No such command"),
    ],
)
def test_bad_options_exit_2_with_usage_message(cli, args, words):
    result = cli(*args)

    assert result.exit_code == 2
    assert words in result.stderr and result.stdout == ""


@pytest.mark.parametrize(
    "args, input, words",
    [
        (["generate"], "", "the prompt is empty"),
        (["generate", "hi", "--file", "x.txt"], None, "not both"),
        (["generate", "--raw", "--system", "Be brief.", "hi"], None, "--system needs chat mode"),
        (["generate", "--json", "--jsonl"], "", "do not go together"),
        (["generate", "--jsonl", "hi"], None, "not from an argument"),
        (["generate", "--file", "/no/such/prompt.txt"], None, "cannot read prompt file"),
    ],
)
def test_usage_errors_are_one_line_exit_2(cli, args, input, words):
    result = cli(*args, *PLAIN, input=input)

    assert result.exit_code == 2, result.output
    assert words in one_error_line(result)


def test_unknown_alias_suggests_close_names(cli):
    for args in (["generate", "hi", "--target", "qwen-14"], ["pull", "smolm2-135m-q4"]):
        result = cli(*args)

        assert result.exit_code == 2
        line = one_error_line(result)
        assert "unknown model" in line and "Did you mean" in line
    assert "qwen-14b" in one_error_line(cli("generate", "hi", "--target", "qwen-14"))
    assert "smollm2-135m-q4" in one_error_line(cli("pull", "smolm2-135m-q4"))


def test_missing_or_broken_model_file_exits_1(cli, tmp_path):
    missing = cli("generate", "hi", "--target", str(tmp_path / "nope.gguf"), "--no-spec")
    assert missing.exit_code == 1
    assert "not found" in one_error_line(missing) and "nope.gguf" in missing.stderr

    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"definitely not a model" * 10)
    broken = cli("generate", "hi", "--target", str(junk), "--no-spec")
    assert broken.exit_code == 1
    assert "not a GGUF" in one_error_line(broken)


def test_missing_model_says_what_to_pull_when_offline(cli):
    # huggingface_hub reads HF_HUB_OFFLINE once, at import: import it online so later tests can download.
    import huggingface_hub.constants  # noqa: F401

    result = cli("generate", "hi", "--target", "qwen2.5-0.5b", "--no-spec", env={"HF_HUB_OFFLINE": "1"})

    assert result.exit_code == 1
    assert "pulling qwen2.5-0.5b (" in result.stderr  # said what and how big before trying
    error = result.stderr.strip().splitlines()[-1]
    assert error.startswith("error: ") and "qwen2.5-0.5b" in error
    assert "Traceback" not in result.stderr


def test_malformed_user_models_toml_names_file_and_line(cli):
    toml = config_file("models.toml")
    toml.write_text('[models.mine]\nfamily = "smollm2"\nsize = "big"\n')

    # One bad entry is left out with a warning; the other aliases keep working.
    listed = cli("models")
    assert listed.exit_code == 0 and "smollm2-135m-q4" in listed.stdout
    warning = next(line for line in listed.stderr.splitlines() if line.startswith("warning: left out"))
    assert str(toml) in warning and "line 3" in warning and "size" in warning
    # Naming it gives its error.
    result = cli("generate", "hi", "--target", "mine", "--no-spec")
    assert result.exit_code == 2
    line = one_error_line(result)
    assert str(toml) in line and "line 3" in line and "size" in line

    toml.write_text("[models.mine\n")
    result = cli("models")
    assert result.exit_code == 2 and str(toml) in one_error_line(result)


def test_incompatible_pair_names_both_models(cli):
    result = cli("generate", "hi", "--target", "smollm2-135m-f32", "--draft", "gemma3-270m-q4")

    assert result.exit_code == 2
    line = one_error_line(result)
    assert "smollm2-135m-f32" in line and "gemma3-270m-q4" in line and "tokenizer" in line


def test_incompatible_files_are_caught_by_the_vocabulary_check(cli, offline_models):
    # Paths have no family: only the loaded vocabularies can tell.
    result = cli("generate", "hi", "--target", str(offline_models.smollm2_q4), "--draft", str(offline_models.gemma_q4), "--threads", "1")

    assert result.exit_code == 2
    line = one_error_line(result)
    assert "cannot draft for target" in line and offline_models.gemma_q4.name in line


def test_verbose_shows_the_traceback(cli):
    result = cli("generate", "hi", "--target", "qwen-14", "--verbose")

    assert result.exit_code == 2
    assert "Traceback" in result.stderr and "unknown model" in result.stderr


def test_a_bug_is_one_line_unless_verbose(cli, monkeypatch):
    from specrun.commands import models as commands

    def broken(*args, **kwargs):
        raise ZeroDivisionError("division by zero")

    monkeypatch.setattr(commands, "list_models", broken)

    quiet = cli("models")
    assert quiet.exit_code == 1
    assert "ZeroDivisionError" in one_error_line(quiet) and "--verbose" in quiet.stderr

    loud = cli("models", "--verbose")
    assert loud.exit_code == 1 and "Traceback" in loud.stderr


def test_no_color_and_pipes_give_plain_text(cli):
    env = {"FORCE_COLOR": "1", "NO_COLOR": None, "TERM": "xterm-256color"}
    coloured = cli("generate", "hi", "--target", "qwen-14", env=env)
    assert "\x1b[" in coloured.stderr  # a terminal gets colour...

    plain = cli("generate", "hi", "--target", "qwen-14", env={**env, "NO_COLOR": "1"})
    assert "\x1b[" not in plain.stderr and "unknown model" in plain.stderr  # ...unless NO_COLOR

    # a real pipe, no NO_COLOR: plain text too
    piped = subprocess.run(
        [sys.executable, "-m", "specrun", "generate", "hi", "--target", "qwen-14"],
        capture_output=True, text=True, env={k: v for k, v in os.environ.items() if k not in ("NO_COLOR", "FORCE_COLOR")},
    )
    assert piped.returncode == 2
    assert piped.stderr.startswith("error: unknown model") and "\x1b[" not in piped.stderr


# ---------------------------------------------------------------------------------------------
# help, version, start-up


def test_every_command_help_has_examples(cli):
    for command in [None, *COMMANDS]:
        result = cli(*([command] if command else []), "--help")

        assert result.exit_code == 0, result.output
        assert "Example" in result.stdout
        if command:
            assert f"specrun {command}" in result.stdout.split("Example", 1)[1]


def test_version(cli):
    result = cli("--version")

    assert result.exit_code == 0
    assert result.stdout.strip() == f"specrun {__version__}"


def test_help_does_not_import_llama_cpp():
    script = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "from specrun.cli import app\n"
        f"for args in [['--help'], ['--version'], *[[c, '--help'] for c in {COMMANDS!r}]]:\n"
        "    assert CliRunner().invoke(app, args).exit_code == 0, args\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('llama_cpp', 'numpy', 'jinja2', 'huggingface_hub'))\n"
        "print(heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


# ---------------------------------------------------------------------------------------------
# tune


def test_tune_without_the_tuning_module_says_so(cli, monkeypatch):
    # Whether or not specrun.tuning exists yet, a missing module gives one clear line.
    import specrun

    monkeypatch.setitem(sys.modules, "specrun.tuning", None)
    monkeypatch.setitem(sys.modules, "specrun.commands.tune", None)  # may be imported by an earlier test
    monkeypatch.delattr(specrun, "tuning", raising=False)
    import specrun.commands

    monkeypatch.delattr(specrun.commands, "tune", raising=False)
    result = cli("tune", "--quick")

    assert result.exit_code == 1
    assert "specrun tune" in one_error_line(result)


# ---------------------------------------------------------------------------------------------
# models and pull


def test_models_table_goes_to_stdout(cli):
    result = cli("models")

    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].split()[:3] == ["ALIAS", "FAMILY", "PARAMS"]
    row = next(line.split() for line in lines if line.startswith("smollm2-135m-q4 "))
    assert row[1] == "smollm2" and "yes" in row  # present: the offline models are in the cache
    qwen = next(line.split() for line in lines if line.startswith("qwen2.5-14b"))
    assert "yes" not in qwen and qwen[-1] == "qwen2.5-0.5b" and "tree" in qwen
    hybrid = next(line.split() for line in lines if line.startswith("qwen3.5-27b "))
    assert "chains" in hybrid and hybrid[-1] == "qwen3.5-0.8b"
    assert "chains, MTP" in next(line for line in lines if line.startswith("qwen3.5-4b-mtp "))
    assert "default: --target smollm2-135m-f32" in result.stderr
    assert "chains = up to four draft chains per step" in result.stderr


def test_models_json(cli):
    result = cli("models", "--json")

    assert result.exit_code == 0
    rows = {row["alias"]: row for row in json.loads(result.stdout)}
    assert rows["smollm2-135m-q4"]["present"] is True
    assert rows["qwen2.5-14b"]["draft"] == "qwen2.5-0.5b" and rows["qwen2.5-14b"]["size"] > 1e9
    assert set(rows["qwen2.5-14b"]) >= {"family", "params", "quant", "size", "present", "draft"}
    assert rows["qwen3.5-27b"]["arch"] == "qwen35" and rows["qwen3.5-27b"]["speculation"]["mode"] == "chains"
    assert "roll" in rows["qwen3.5-27b"]["speculation"]["reason"]
    assert rows["gpt-oss-120b"]["speculation"]["mode"] == "tree" and rows["gpt-oss-120b"]["draft"] == "gpt-oss-20b"


@pytest.fixture
def fake_hub(monkeypatch, tmp_path):
    """A local server answering like the Hugging Face Hub, with HF_ENDPOINT pointing at it."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with FakeHub() as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
        yield hub


def serve_alias(fake_hub, alias: str, path: Path) -> bytes:
    data = path.read_bytes()
    fake_hub.add_file("fake/SmolLM2-GGUF", path.name, data)
    config_file("models.toml").write_text(
        f'[models."{alias}"]\nfamily = "smollm2"\nsize = {len(data)}\n'
        f'[[models."{alias}".source]]\nhf = "fake/SmolLM2-GGUF"\nfile = "{path.name}"\n'
        f'sha256 = "{hashlib.sha256(data).hexdigest()}"\n'
    )
    return data


def test_pull_says_what_and_prints_the_path(cli, fake_hub, offline_models):
    data = serve_alias(fake_hub, "tiny-smol", offline_models.smollm2_random)

    result = cli("pull", "tiny-smol")

    assert result.exit_code == 0, result.output
    assert "pulling tiny-smol (27 MB) from Hugging Face repo fake/SmolLM2-GGUF" in result.stderr
    path = Path(result.stdout.strip())
    assert path.read_bytes() == data

    again = cli("pull", "tiny-smol")
    assert again.exit_code == 0 and again.stdout.strip() == str(path)
    # one download of the whole file; before it, only the header's ranges (the fit check)
    whole = [r for r in fake_hub.gets(path.name) if "range" not in r.headers]
    header = [r for r in fake_hub.gets(path.name) if "range" in r.headers]
    assert "already here" in again.stderr and len(whole) == 1
    assert sum(r.body_bytes for r in header) < len(data) // 4


def test_generate_pulls_a_missing_model_after_saying_so(cli, fake_hub, offline_models):
    serve_alias(fake_hub, "tiny-smol", offline_models.smollm2_random)

    result = cli("generate", "hi", "--target", "tiny-smol", "--no-spec", "-n", "3", "--threads", "1", "--ctx-size", "256")

    assert result.exit_code == 0, result.output
    assert "pulling tiny-smol (27 MB) from Hugging Face repo fake/SmolLM2-GGUF..." in result.stderr
    assert result.stdout  # a random-weight model, but it ran
