"""Issue 13: every input a hostile (or unlucky) user gave specrun, run as real processes.

Each case checks what the user would notice: the exit code, a one-line message that names the
problem, the data still there, no temporary files left behind, and never the catch-all
"a bug in specrun". Runs use the tiny random-weight SmolLM2 model (fast) with plain decoding,
except where the case is about the draft pair.
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from specrun.tuning import profiles

sys.path.insert(0, str(Path(__file__).parent))
from fakehub import FakeHub  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
BUG = "a bug in specrun"
FAST = ["--target", "smollm2-tiny-random", "--no-spec", "--threads", "1", "--ctx-size", "256"]


def run(*args: str, input: bytes | None = None, env: dict | None = None, limit_file_size: int | None = None):
    """Run `python -m specrun ARGS` as a user would; return the CompletedProcess (bytes)."""
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "NO_COLOR": "1", **(env or {})}

    def limits() -> None:  # a disk that fills: writes past this size fail (EFBIG), no signal
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_file_size, limit_file_size))

    done = subprocess.run(
        [sys.executable, "-m", "specrun", *args], input=input if input is not None else b"",
        capture_output=True, env=full_env, timeout=300, preexec_fn=limits if limit_file_size is not None else None,
    )
    out, err = done.stdout.decode("utf-8", "replace"), done.stderr.decode("utf-8", "replace")
    assert BUG not in out and BUG not in err, err
    assert "Traceback" not in err, err
    done.out, done.err = out, err
    return done


@pytest.fixture(scope="module")
def models(offline_models):
    return offline_models


def user_toml(text: str) -> None:
    path = Path(os.environ["SPECRUN_CONFIG"]) / "models.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def hf_alias(alias: str, repo: str, file: str, digest: str) -> str:
    return (f'[models."{alias}"]\nfamily = "smollm2"\n[[models."{alias}".source]]\nhf = "{repo}"\n'
            f'files = ["{file}"]\nsha256 = ["{digest}"]\n')


# ---------------------------------------------------------------------------------------------
# 1. data in the shared Hugging Face cache


def test_a_wrong_pin_never_deletes_a_good_cached_file(models, tmp_path):
    data = models.smollm2_random.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    with FakeHub() as fake:
        fake.add_file("fake/smol", "smol.gguf", data)
        user_toml(hf_alias("fake", "fake/smol", "smol.gguf", digest) + hf_alias("fakebad2", "fake/smol", "smol.gguf", "0" * 64))
        pulled = run("pull", "fake", env={"HF_ENDPOINT": fake.endpoint})
        assert pulled.returncode == 0, pulled.err
        path = Path(pulled.out.strip())

        bad = run("generate", "hi", "-n", "4", "--target", "fakebad2", "--no-spec", env={"HF_HUB_OFFLINE": "1"})
        assert bad.returncode == 1
        assert "'fakebad2'" in bad.err and "0" * 64 in bad.err and digest in bad.err
        assert "specrun pull --force fakebad2" in bad.err
        assert path.is_file() and hashlib.sha256(path.read_bytes()).hexdigest() == digest

        good = run("generate", "hi", "-n", "2", "--target", "fake", "--no-spec", "--ctx-size", "256",
                   env={"HF_HUB_OFFLINE": "1"})
        assert good.returncode == 0, good.err

        forced = run("pull", "--force", "fake", env={"HF_ENDPOINT": fake.endpoint})
        assert forced.returncode == 0, forced.err and Path(forced.out.strip()) == path
        assert hashlib.sha256(path.read_bytes()).hexdigest() == digest


# ---------------------------------------------------------------------------------------------
# 2. --jsonl: every line gets its own answer or its own error


BAD_LINES = [
    ({"prompt": "hi", "stop": 5}, "stop"),
    ({"prompt": "hi", "system": 5}, "system"),
    ({"prompt": "hi", "stop": [1]}, "stop"),
    ({"prompt": "hi", "max_tokens": True}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "chat": "yes"}, "chat"),
    ({"prompt": "   "}, "prompt"),
    ({"prompt": 7}, "prompt"),
    ({"prompt": "hi", "temperature": -1}, "temperature"),
    ({"prompt": "hi", "temperature": "hot"}, "temperature"),
    ({"prompt": "hi", "top_k": 1.5}, "top_k"),
    ({"prompt": "hi", "top_p": 0}, "top_p"),
    ({"prompt": "hi", "top_p": 1.5}, "top_p"),
    ({"prompt": "hi", "min_p": 2}, "min_p"),
    ({"prompt": "hi", "seed": -3}, "seed"),
    ({"prompt": "hi", "chat": False, "system": "Be brief."}, "system"),
    ({"prompt": "hi", "colour": "blue"}, "colour"),
]


def test_every_jsonl_line_gets_its_own_result_or_error(models):
    good = json.dumps({"prompt": "hi", "max_tokens": 2, "id": "ok"}).encode()
    lines = [good]
    for obj, _ in BAD_LINES:
        lines += [json.dumps(obj).encode(), good]
    lines += [b'{"prompt": "\\ud800", "id": "surrogate"}', good, b'{"prompt": "caf\xe9 \xff"}', good, b"[1, 2]", good]

    done = run("generate", "--jsonl", "-n", "2", *FAST, input=b"\n".join(lines) + b"\n")

    assert done.returncode == 0, done.err
    out = [json.loads(line) for line in done.out.splitlines()]
    assert len(out) == len(lines)
    for i, result in enumerate(out):
        if lines[i] == good:
            assert result.get("id") == "ok" and result["n_tokens"] >= 1, result
    for k, (obj, field) in enumerate(BAD_LINES):
        result = out[1 + 2 * k]
        assert result["line"] == 2 + 2 * k and result.get("field") == field, (obj, result)
        assert field in result["error"] and "--" not in result["error"], result
    surrogate, invalid, not_object = out[-6], out[-4], out[-2]
    assert surrogate["field"] == "prompt" and "surrogate" in surrogate["error"] and surrogate["id"] == "surrogate"
    assert "not UTF-8" in invalid["error"] and "0xe9" in invalid["error"]
    assert "JSON object" in not_object["error"]


# ---------------------------------------------------------------------------------------------
# 3. invalid UTF-8: argument, stdin, --file, chat, --lines


def test_invalid_utf8_is_one_clear_line_and_exit_2_everywhere(models, tmp_path):
    bad_file = tmp_path / "prompt.txt"
    bad_file.write_bytes(b"ok \xff\xfe abc")

    stdin = run("generate", "-n", "8", *FAST, input=b"\xff\xfe abc")
    assert stdin.returncode == 2 and stdin.out == ""
    assert stdin.err.strip() == "error: stdin is not UTF-8 text (invalid byte 0xff at offset 0)"

    from_file = run("generate", "--file", str(bad_file), *FAST)
    assert from_file.returncode == 2 and "is not UTF-8 text (invalid byte 0xff at offset 3)" in from_file.err

    # argv bytes that are not UTF-8 reach Python as surrogate escapes
    argument = run("generate", os.fsdecode(b"abc\xff"), *FAST)
    assert argument.returncode == 2 and "the prompt argument is not UTF-8 text (invalid byte 0xff at offset 3)" in argument.err


def test_a_chat_line_that_is_not_utf8_is_refused_and_the_chat_goes_on(models):
    done = run("chat", "-n", "2", *FAST, input=b"\xff\xfe abc\nhello\n")

    assert done.returncode == 0, done.err
    assert "this message is not UTF-8 text (invalid byte 0xff at offset 0)" in done.err
    assert done.out.strip() != ""  # the second line was answered


def test_lines_mode_answers_each_line_and_reports_a_bad_one(models):
    done = run("generate", "--lines", "--json", "-n", "2", *FAST, input=b"one\n\xff\ntwo\n")

    assert done.returncode == 2
    out = [json.loads(line) for line in done.out.splitlines()]
    assert len(out) == 3 and "n_tokens" in out[0] and "n_tokens" in out[2]
    assert out[1]["line"] == 2 and "not UTF-8" in out[1]["error"]


# ---------------------------------------------------------------------------------------------
# 4. a corrupt stored tuning profile


def _demo_profile_path(models) -> Path:
    key = profiles.profile_key(models.smollm2_f32, models.smollm2_q4, threads=1)
    return profiles.profile_path(key)


@pytest.mark.parametrize("content", [b"\xff\xfe{garbage", b"[]", b"budget -5"])
def test_a_corrupt_profile_is_named_ignored_and_the_run_goes_on(models, content):
    path = _demo_profile_path(models)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content)

    done = run("plan", "--json", "--threads", "1")

    assert done.returncode == 0, done.err
    assert str(path) in done.err and done.err.count("ignoring tuning profile") == 1
    assert path.read_bytes() == content


def test_a_profile_with_budget_minus_5_is_ignored_not_blamed_on_the_user(models):
    path = _demo_profile_path(models)
    key = profiles.profile_key(models.smollm2_f32, models.smollm2_q4, threads=1)
    config = {"kind": "specexec", "budget": -5, "depth": 3, "width": 1, "top_k": 1,
              "predicted_tokens_per_s": 1.0, "predicted_speedup": 1.0}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"key": key, "config": config}))

    done = run("generate", "hi", "-n", "2", "--threads", "1", "--ctx-size", "256", "--budget", "3")

    assert done.returncode == 0, done.err
    assert str(path) in done.err and "budget" in done.err


# ---------------------------------------------------------------------------------------------
# 6. read-only or full cache


def test_tune_refuses_an_unwritable_profile_directory_before_measuring(models, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    done = run("tune", "--quick", "--threads", "1", env={"SPECRUN_PROFILES": str(blocker / "profiles")})

    assert done.returncode == 1
    assert f"cannot save tuning profiles in {blocker / 'profiles'}" in done.err
    assert len(done.err.strip().splitlines()) == 1  # refused before measuring anything


def test_pull_into_an_unwritable_cache_is_a_clear_error(models, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    done = run("pull", "smollm2-tiny-random", env={"SPECRUN_HOME": str(blocker / "cache")})

    assert done.returncode == 1
    last = done.err.strip().splitlines()[-1]
    assert last.startswith("error: cannot prepare smollm2-tiny-random") and str(blocker) in last


def test_a_disk_that_fills_during_a_write_leaves_no_temporary_file(models, tmp_path):
    home = tmp_path / "cache"
    (home / "models").mkdir(parents=True)
    os.symlink(models.smollm2_random, home / "models" / models.smollm2_random.name)
    done = run("generate", "hi", "-n", "2", "--target", "smollm2-tiny-random", "--draft", "smollm2-tiny-random",
               "--threads", "1", "--ctx-size", "256", env={"SPECRUN_HOME": str(home)}, limit_file_size=1)

    assert done.returncode == 0, done.err
    assert [p.name for p in home.rglob(".*") if p.is_file()] == []


# ---------------------------------------------------------------------------------------------
# 7. silent truncation


def test_a_full_context_is_said_on_stderr_and_ctx_size_is_honoured(models):
    prompt = "Count from one to one hundred: " + "one two three four five six seven eight nine ten " * 4
    done = run("generate", prompt, "-n", "64", "--raw", "--stats", *FAST[:-2], "--ctx-size", "64")

    assert done.returncode == 0, done.err
    assert "the context is full (64 tokens)" in done.err and "finished: context" in done.err

    as_json = run("generate", prompt, "-n", "64", "--raw", "--json", *FAST[:-2], "--ctx-size", "64")
    result = json.loads(as_json.out)
    assert result["finish_reason"] == "context"
    assert result["stats"]["n_prompt"] + result["n_tokens"] <= 64 + 1  # the last token needs no cell


# ---------------------------------------------------------------------------------------------
# 8. smaller ones


@pytest.mark.parametrize(
    "args, code, words",
    [
        (["--target", "hf:a/b/../../x.gguf"], 2, "'..' path segment"),
        (["--target", "/"], 1, "is a directory"),
        (["--top-p", "0"], 2, "0<x<=1"),
    ],
)
def test_smaller_cases_give_one_clear_line(models, args, code, words):
    done = run("generate", "hi", "-n", "2", *args)

    assert done.returncode == code and words in done.err


def test_threads_above_the_cores_are_capped_with_a_warning(models):
    done = run("generate", "hi", "-n", "2", *FAST[:3], "--ctx-size", "256", "--threads", "999")

    assert done.returncode == 0, done.err
    assert "--threads 999 is more than the" in done.err


def test_a_truncated_gguf_says_it_is_shorter_than_its_header(models, tmp_path):
    cut = tmp_path / "cut.gguf"
    with open(models.smollm2_random, "rb") as f:
        cut.write_bytes(f.read(5_000_000))

    done = run("generate", "hi", "--target", str(cut), "--no-spec")

    assert done.returncode == 1 and "shorter than its header says" in done.err


def test_a_vocabulary_mismatch_names_the_tokenizers_first(models):
    done = run("generate", "hi", "-n", "2", "--target", "gemma3-270m-q4", "--draft", str(models.smollm2_q4), "--threads", "1")

    assert done.returncode == 2
    assert "tokenizers differ" in done.err or "vocabularies differ in size" in done.err
    assert "bos" not in done.err


def test_stdin_lines_are_one_prompt_and_help_says_so(models):
    helped = run("generate", "--help")
    assert "--lines" in helped.out and "ONE prompt" in helped.out


def test_verified_record_of_the_wrong_shape_is_rebuilt_by_pull(models, tmp_path):
    home = tmp_path / "cache"
    home.mkdir()
    (home / "verified.json").write_text("[]")
    data = models.smollm2_random.read_bytes()
    with FakeHub() as fake:
        fake.add_file("fake/smol", "smol.gguf", data)
        user_toml(hf_alias("fake", "fake/smol", "smol.gguf", hashlib.sha256(data).hexdigest()))
        done = run("pull", "fake", env={"HF_ENDPOINT": fake.endpoint, "SPECRUN_HOME": str(home)})

    assert done.returncode == 0, done.err
    assert "verified.json" in done.err  # the warning names the file
    record = json.loads((home / "verified.json").read_text())
    assert isinstance(record, dict) and len(record) == 1
