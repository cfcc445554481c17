"""Issue 18, section 3: what a hostile probe did to specrun's model files, as real processes.

models.toml values that would write outside the cache (defect 4), typos that were called "a bug"
(7), Ctrl-C during a model conversion (6), and the smaller items of (9): deep nesting, huge values,
a disk that fills during a conversion.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from conftest import specrun_argv  # noqa: E402
from test_hostile import BUG, ROOT, run, user_toml  # noqa: E402

FAMILY = 'family = "smollm2"\n'


def _derived(alias: str, file: str) -> str:
    return f'[models."{alias}"]\n{FAMILY}[[models."{alias}".source]]\nderived = "smollm2-135m-q4"\nftype = "F32"\nfile = "{file}"\n'


@pytest.fixture
def fresh_home(offline_models, tmp_path) -> Path:
    """A model cache holding only the SmolLM2 Q4 file (everything else must be made)."""
    home = tmp_path / "cache"
    (home / "models").mkdir(parents=True)
    os.symlink(offline_models.smollm2_q4, home / "models" / offline_models.smollm2_q4.name)
    return home


@pytest.mark.parametrize("file", ["../../escaped.gguf", "{victim}", "sub/../../x.gguf"])
def test_a_models_toml_file_never_writes_outside_the_cache(fresh_home, tmp_path, file):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    user_toml(_derived("victim", file.format(victim=victim)) + _derived("good", "good.gguf"))
    env = {"SPECRUN_HOME": str(fresh_home)}

    for args in (["pull", "victim"], ["pull", "--force", "victim"]):
        done = run(*args, env=env)
        assert done.returncode != 0
        assert "victim" in done.err and "inside specrun's cache" in done.err and len(done.err.strip().splitlines()) == 1
    assert victim.read_text() == "keep me"
    assert not (tmp_path / "escaped.gguf").exists() and not (fresh_home / "escaped.gguf").exists()

    listed = run("models", env=env)  # the bad alias is left out with a warning; the others are listed
    assert listed.returncode == 0 and "good" in listed.out and "smollm2-135m-q4" in listed.out
    assert "left out" in listed.err and "victim" in listed.err


@pytest.mark.parametrize("source", [
    'hf = "../.."\nfile = "x.gguf"\n',
    'hf = "owner/repo"\nfile = "../../etc/passwd"\n',
    'hf = "own er/repo"\nfile = "x.gguf"\n',
])
def test_a_bad_hf_source_is_one_line_naming_the_alias(models_ready, source):
    user_toml(f'[models."typo"]\n{FAMILY}[[models."typo".source]]\n{source}')
    done = run("pull", "typo")
    assert done.returncode != 0 and "typo" in done.err and len(done.err.strip().splitlines()) == 1
    assert run("models").returncode == 0


@pytest.fixture
def models_ready(offline_models):
    return offline_models


def test_a_bad_hf_reference_on_the_command_line_is_one_line(models_ready):
    done = run("generate", "hi", "--target", "hf:own er/repo/x.gguf")
    assert done.returncode != 0 and "own er/repo" in done.err and "repo id" in done.err
    assert len(done.err.strip().splitlines()) == 1


def test_a_deeply_nested_models_toml_is_one_line(models_ready):
    user_toml("x = " + "[" * 100_000 + "]" * 100_000 + "\n")
    done = run("models")
    assert done.returncode != 0 and "nested too deeply" in done.err and BUG not in done.err


def test_a_huge_bad_value_is_not_echoed_whole(models_ready):
    user_toml('[defaults]\ntarget = "' + "x" * 10_000_000 + '"\n')
    done = run("models")
    assert done.returncode != 0 and "not a known alias" in done.err
    assert len(done.err) < 2000


def test_a_disk_that_fills_during_a_conversion_says_so(fresh_home):
    done = run("pull", "smollm2-135m-f32", env={"SPECRUN_HOME": str(fresh_home)}, limit_file_size=4 << 20)
    last = done.err.strip().splitlines()[-1]
    assert done.returncode != 0 and last.startswith("error: disk full") and "smollm2-135m-f32" in last
    assert [p.name for p in (fresh_home / "models").iterdir() if p.name != ".locks"] == ["SmolLM2-135M-Instruct.Q4_1.gguf"]


def test_ctrl_c_stops_a_conversion(fresh_home):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NO_COLOR": "1", "SPECRUN_HOME": str(fresh_home)}
    proc = subprocess.Popen(specrun_argv("pull", "smollm2-135m-f32"), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    models = fresh_home / "models"
    deadline = time.monotonic() + 120
    while not any(p.name.endswith(".partial") for p in models.iterdir()):  # the conversion has begun
        assert proc.poll() is None and time.monotonic() < deadline, "the conversion never started"
        time.sleep(0.02)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    assert time.monotonic() - t0 < 10 and b"Traceback" not in err and b"Exception ignored" not in err
    assert [p.name for p in models.iterdir() if p.name != ".locks"] == ["SmolLM2-135M-Instruct.Q4_1.gguf"]  # no half-written file
