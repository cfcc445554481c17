"""Issue 13, one fix at a time, in-process: request checks, UTF-8 input, bookkeeping files,
unwritable caches, model-file diagnostics, pairing messages, the thread cap, the context size."""

from __future__ import annotations

import errno
import json
import logging
import os
from types import SimpleNamespace

import pytest

from specrun import engine, files, inputs
from specrun.errors import DownloadError, ModelFileError, RegistryError, UsageError
from specrun.models import builders, hub, pairing, registry, verified
from specrun.runtime import request_json
from specrun.runtime.plan import RunOptions, build_plan
from specrun.runtime.request import Request
from specrun.tuning import profiles

FAST = ["--target", "smollm2-tiny-random", "--no-spec", "--threads", "1", "--ctx-size", "256"]


# ---------------------------------------------------------------------------------------------
# --jsonl request lines


def test_a_valid_request_line_keeps_the_command_line_defaults_for_what_it_leaves_out():
    base = Request(max_tokens=9, temperature=0.5)
    request, prompt, req_id = request_json.parse_line(
        json.dumps({"prompt": "hi", "stop": ".", "top_p": 1, "seed": None, "id": [1, "x"]}), base)
    assert prompt == "hi" and req_id == [1, "x"]
    assert request.stop == (".",) and request.top_p == 1.0 and request.max_tokens == 9 and request.temperature == 0.5


@pytest.mark.parametrize(
    "obj, field",
    [
        ({"prompt": "hi", "max_tokens": True}, "max_tokens"),
        ({"prompt": "hi", "max_tokens": 2.0}, "max_tokens"),
        ({"prompt": "hi", "temperature": float("nan")}, "temperature"),
        ({"prompt": "hi", "top_p": 0}, "top_p"),
        ({"prompt": "hi", "min_p": -0.1}, "min_p"),
        ({"prompt": "hi", "seed": True}, "seed"),
        ({"prompt": "hi", "stop": ["a", 1]}, "stop"),
        ({"prompt": "hi", "chat": 1}, "chat"),
        ({"prompt": "hi", "system": ["x"]}, "system"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": "hi\ud800"}, "prompt"),
        ({"prompt": "hi", "stop": "\udcff"}, "stop"),
    ],
)
def test_each_bad_field_is_named_and_no_flag_is(obj, field):
    with pytest.raises(request_json.FieldError) as failure:
        request_json.parse_line(json.dumps(obj), Request())
    assert failure.value.field == field and field in str(failure.value) and "--" not in str(failure.value)


def test_output_lines_are_json_even_when_an_id_holds_a_lone_surrogate():
    line = request_json.dumps({"error": "x", "id": "\ud800"})
    assert json.loads(line)["id"] == "\ud800"
    line.encode("utf-8")


# ---------------------------------------------------------------------------------------------
# UTF-8 input


def test_invalid_utf8_names_where_the_byte_and_the_offset():
    with pytest.raises(UsageError, match=r"^stdin is not UTF-8 text \(invalid byte 0xff at offset 2\)$"):
        inputs.decode_utf8(b"ab\xff", "stdin")
    with pytest.raises(UsageError, match=r"invalid byte 0xfe at offset 1"):
        inputs.check_utf8(os.fsdecode(b"a\xfe"), "the prompt argument")
    with pytest.raises(UsageError, match="lone surrogate"):
        inputs.check_utf8("a\ud800", "line 3")
    assert inputs.check_utf8("café", "x") == "café"


def test_stdin_with_invalid_utf8_is_exit_2_in_process(cli):
    result = cli("generate", "-n", "2", *FAST, input=b"\xff\xfe abc")
    assert result.exit_code == 2
    assert "stdin is not UTF-8 text (invalid byte 0xff at offset 0)" in result.stderr


def test_lines_mode_separates_answers_by_a_blank_line(cli):
    result = cli("generate", "--lines", "-n", "2", "--raw", *FAST, input="one\n\ntwo\n")
    assert result.exit_code == 0, result.output
    answers = result.stdout.split("\n\n")
    assert len(answers) == 2 and all(a.strip() for a in answers)


def test_system_with_raw_is_refused_before_loading(cli):
    result = cli("generate", "hi", "--raw", "--system", "Be brief.", *FAST)
    assert result.exit_code == 2 and "--system needs chat mode" in result.stderr


# ---------------------------------------------------------------------------------------------
# Tuning profiles and bookkeeping files


@pytest.fixture
def pair(tmp_path):
    target, draft = tmp_path / "t.gguf", tmp_path / "d.gguf"
    target.write_bytes(b"GGUF" + b"t" * 100)
    draft.write_bytes(b"GGUF" + b"d" * 10)
    return target, draft


def _config(**changes) -> dict:
    config = {"kind": "specexec", "budget": 8, "depth": 4, "width": 1, "top_k": 1,
              "predicted_tokens_per_s": 1.0, "predicted_speedup": 1.2}
    return {**config, **changes}


@pytest.mark.parametrize(
    "content",
    [
        b"\xff\xfe not utf-8",
        "KEY",  # filled in: a profile of the right key whose budget is -5
        "SEQUOIA",  # a Sequoia choice without its tree
    ],
)
def test_a_bad_profile_warns_once_naming_the_file_and_counts_as_none(pair, caplog, content):
    target, draft = pair
    key = profiles.profile_key(target, draft)
    path = profiles.profile_path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    if content == "KEY":
        content = json.dumps({"key": key, "config": _config(budget=-5)}).encode()
    elif content == "SEQUOIA":
        content = json.dumps({"key": key, "config": _config(kind="sequoia")}).encode()
    path.write_bytes(content)

    with caplog.at_level(logging.WARNING):
        assert profiles.choice_for(target, draft) is None
        assert profiles.choice_for(target, draft) is None
    warnings = [r.getMessage() for r in caplog.records if str(path) in r.getMessage()]
    assert len(warnings) == 1 and "ignoring tuning profile" in warnings[0]


@pytest.mark.parametrize("content", ["[]", "7", "{not json", '"text"'])
def test_a_verified_record_of_the_wrong_shape_is_ignored_then_rebuilt(tmp_path, monkeypatch, caplog, content):
    monkeypatch.setenv("SPECRUN_HOME", str(tmp_path))
    record = tmp_path / "verified.json"
    record.write_text(content)
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")

    with caplog.at_level(logging.WARNING):
        assert verified.known_digest(model) is None
        verified.remember_digest(model, "ab" * 32)
    assert any(str(record) in r.getMessage() for r in caplog.records)
    assert verified.known_digest(model) == "ab" * 32


def test_the_vocab_pair_record_of_the_wrong_shape_is_ignored(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECRUN_HOME", str(tmp_path))
    (tmp_path / "vocab_pairs.json").write_text('{"a": 1}')
    assert pairing._known_pairs() == set()


# ---------------------------------------------------------------------------------------------
# Unwritable or full caches


def test_unwritable_reason_asks_the_file_system(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert files.unwritable_reason(tmp_path / "new" / "dir") is None
    assert files.unwritable_reason(blocker / "dir") is not None
    assert [p.name for p in (tmp_path / "new" / "dir").iterdir()] == []


def test_a_failed_atomic_write_leaves_no_temporary_file(tmp_path, monkeypatch):
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(files.os, "replace", full)
    with pytest.raises(OSError):
        files.atomic_write_json(tmp_path / "record.json", {"a": 1})
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "code, words",
    [(errno.EACCES, "cannot write /cache/models while preparing smollm2-tiny-random"),
     (errno.EROFS, "point SPECRUN_HOME / HF_HOME at a writable directory"),
     (errno.ENOSPC, "disk full while preparing smollm2-tiny-random")],
)
def test_a_failed_write_while_preparing_a_model_is_a_clear_error(monkeypatch, code, words):
    def refuse(*args, **kwargs):
        raise OSError(code, os.strerror(code), "/cache/models")

    monkeypatch.setattr(builders, "build_derived", refuse)
    monkeypatch.setattr(hub, "_present_path", lambda src: None)
    with pytest.raises(DownloadError, match=words):
        hub.ensure_local(registry.resolve("smollm2-tiny-random"), progress=False)


# ---------------------------------------------------------------------------------------------
# Model references and files


@pytest.mark.parametrize("name", ["hf:a/b/../../x.gguf", "hf:a/b/./x.gguf", "hf:a/b/..\\x.gguf"])
def test_hf_references_cannot_step_out_of_the_repo(name):
    with pytest.raises(RegistryError, match="path segment"):
        registry.resolve(name)


def test_a_directory_given_as_a_model_says_so(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    for name in (str(tmp_path / "models"), "models"):
        with pytest.raises(ModelFileError, match="is a directory"):
            registry.resolve(name)
    with pytest.raises(ModelFileError, match="not found"):
        registry.resolve(str(tmp_path / "missing"))


def test_a_truncated_gguf_is_named_before_llama_cpp_loads_it(offline_models, tmp_path):
    whole = offline_models.smollm2_random
    cut = tmp_path / "cut.gguf"
    with open(whole, "rb") as f:
        cut.write_bytes(f.read(whole.stat().st_size - 1))
    with pytest.raises(ModelFileError, match="shorter than its header says"):
        engine.Model(cut)
    head = tmp_path / "head.gguf"
    with open(whole, "rb") as f:
        head.write_bytes(f.read(200))
    with pytest.raises(ModelFileError, match="header .* is cut short or damaged"):
        engine.Model(head)


def _vocab(kind: int, n: int, bos: int):
    return SimpleNamespace(vocab_type=kind, n_vocab=n, bos=bos, eos=2, add_bos=True, add_eos=False, path=None)


def test_a_vocabulary_mismatch_names_the_tokenizer_kind_then_the_size_before_special_tokens():
    with pytest.raises(RegistryError, match=r"tokenizers differ \(target SPM, draft BPE\)"):
        pairing.check_vocab(_vocab(1, 32000, 1), _vocab(2, 50257, 50256), "t", "d")
    with pytest.raises(RegistryError, match="vocabularies differ in size"):
        pairing.check_vocab(_vocab(2, 32000, 1), _vocab(2, 50257, 50256), "t", "d")
    with pytest.raises(RegistryError, match="special tokens differ: bos"):
        pairing.check_vocab(_vocab(2, 32000, 1), _vocab(2, 32000, 0), "t", "d")


# ---------------------------------------------------------------------------------------------
# Threads and context size


def test_threads_above_the_cores_are_capped_in_the_plan(offline_models):
    plan = build_plan(RunOptions(target="smollm2-tiny-random", no_spec=True, threads=999, ctx_size=256))
    assert plan.threads == engine.default_threads()
    assert any("--threads 999" in note for note in plan.notes)


def test_a_context_below_llama_cpps_padding_is_honoured(load_model, offline_models):
    model = load_model(offline_models.smollm2_random)
    with engine.Context(model, n_ctx=64, n_batch=64, threads=1) as ctx:
        assert ctx.n_ctx == 64


def test_bench_warns_on_a_busy_machine_before_measuring(cli, monkeypatch, tmp_path):
    from specrun import sysinfo

    monkeypatch.setattr(sysinfo, "cpu_busy_fraction", lambda seconds=0.5: 0.9)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hi\n")
    result = cli("bench", "--target", "smollm2-tiny-random", "--draft", "smollm2-tiny-random", "--threads", "1",
                 "--ctx-size", "256", "--budget", "2", "-n", "2", "--prompts", str(prompts))
    assert result.exit_code == 0, result.output
    assert "the machine is busy" in result.stderr
    assert "budget 2" in result.stdout  # the table is the command's output
