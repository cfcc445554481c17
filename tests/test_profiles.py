"""Stored tuning profiles: found for the same files, hardware and llama.cpp; ignored otherwise.

A profile must never outlive what it was measured on (a changed model file, another llama.cpp
build) and a broken profile file must never stop a run: it is ignored with a warning.
"""

from __future__ import annotations

import json
import logging
import os
import shutil

import pytest

from specrun import engine, paths
from specrun.core.tree_shapes import TreeShape
from specrun.runtime.trees import tree_of_choice
from specrun.tuning import profiles
from specrun.tuning.cost_model import Choice, sequoia_tree

SPECEXEC = Choice("specexec", 24, 8, 4, 4, 30.0, 1.6)
PLAIN = Choice("plain", 0, 0, 0, 0, 20.0, 1.0)


@pytest.fixture
def model_files(tmp_path):
    """Two small files standing in for a target and a draft (profiles only stat them)."""
    target = tmp_path / "target.gguf"
    draft = tmp_path / "draft.gguf"
    target.write_bytes(b"GGUF" + b"t" * 1000)
    draft.write_bytes(b"GGUF" + b"d" * 100)
    return target, draft


def _store(target, draft, choice: Choice, **extra) -> dict:
    profile = {
        "key": profiles.profile_key(target, draft),
        "config": choice.to_dict(),
        "predicted_speedup": choice.predicted_speedup,
        "measured_speedup": 1.5,
        **extra,
    }
    profiles.save(profile)
    return profile



def _tuned_shape(target, draft):
    """Return the tree shape the stored profile gives this pair (None: no profile, or plain)."""
    choice = profiles.choice_for(target, draft)
    tree = tree_of_choice(choice) if choice is not None else None
    return tree.shape if tree is not None else None

def test_saved_profile_is_found_and_gives_the_tree_shape(model_files):
    target, draft = model_files
    saved = _store(target, draft, SPECEXEC)

    assert profiles.load(target, draft) == saved
    assert profiles.choice_for(target, draft) == SPECEXEC
    assert _tuned_shape(target, draft) == TreeShape(budget=24, depth=8, width=4, top_k=4)
    assert profiles.profile_path(saved["key"]).parent == paths.profiles_dir()


def test_no_profile_means_none_and_no_warning(model_files, caplog):
    target, draft = model_files
    with caplog.at_level(logging.WARNING):
        assert _tuned_shape(target, draft) is None
        assert profiles.choice_for(target, draft) is None
    assert not caplog.records


def test_plain_choice_gives_no_shape_but_a_plain_choice(model_files):
    target, draft = model_files
    _store(target, draft, PLAIN)

    assert _tuned_shape(target, draft) is None
    assert profiles.choice_for(target, draft).kind == "plain"


def test_sequoia_choice_keeps_its_tree(model_files):
    target, draft = model_files
    _, tree = sequoia_tree([0.7, 0.15, 0.05], 12, 4)
    choice = Choice("sequoia", tree.size - 1, tree.depth, max(tree.expanding_widths()), tree.max_rank, 30.0, 1.4, tree)
    _store(target, draft, choice)

    loaded = profiles.choice_for(target, draft)
    assert loaded.tree == tree
    shape = _tuned_shape(target, draft)
    assert (shape.budget, shape.depth) == (tree.size - 1, tree.depth)


def test_touched_model_file_invalidates_the_profile(model_files):
    target, draft = model_files
    _store(target, draft, SPECEXEC)
    st = target.stat()
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))

    assert profiles.choice_for(target, draft) is None


def test_replaced_draft_file_invalidates_the_profile(model_files, tmp_path):
    target, draft = model_files
    _store(target, draft, SPECEXEC)
    other = tmp_path / "other.gguf"
    other.write_bytes(b"GGUF" + b"x" * 200)  # another model put in its place
    shutil.copyfile(other, draft)

    assert profiles.choice_for(target, draft) is None


def test_other_llama_cpp_build_invalidates_the_profile(model_files, monkeypatch):
    target, draft = model_files
    _store(target, draft, SPECEXEC)
    monkeypatch.setattr(engine, "llama_version_info", lambda: "llama-cpp-python 9.9.9")

    assert profiles.choice_for(target, draft) is None


def test_other_hardware_or_thread_count_invalidates_the_profile(model_files, monkeypatch):
    target, draft = model_files
    _store(target, draft, SPECEXEC)

    assert profiles.choice_for(target, draft, threads=engine.default_threads() + 1) is None
    monkeypatch.setattr(profiles, "hardware_fingerprint", lambda: "another-machine")
    assert profiles.choice_for(target, draft) is None


@pytest.mark.parametrize(
    "content",
    [
        "{ not json",
        "",
        "[1, 2, 3]",
        '{"key": null}',
        "\x00\x01garbage",
    ],
)
def test_corrupt_profile_is_ignored_with_a_warning(model_files, caplog, content):
    target, draft = model_files
    path = profiles.profile_path(profiles.profile_key(target, draft))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(content, encoding="utf-8", errors="surrogateescape")

    with caplog.at_level(logging.WARNING, logger="specrun.profiles"):
        assert _tuned_shape(target, draft) is None
    assert any("ignoring tuning profile" in r.getMessage() for r in caplog.records)


def test_profile_with_a_broken_config_is_ignored_with_a_warning(model_files, caplog):
    target, draft = model_files
    saved = _store(target, draft, SPECEXEC)
    saved["config"] = {"kind": "magic", "budget": 3}
    profiles.profile_path(saved["key"]).write_text(json.dumps(saved), encoding="utf-8")

    with caplog.at_level(logging.WARNING, logger="specrun.profiles"):
        assert profiles.choice_for(target, draft) is None
    assert any("ignoring tuning profile" in r.getMessage() for r in caplog.records)


def test_missing_model_file_is_a_warning_not_a_crash(model_files, caplog):
    target, draft = model_files
    _store(target, draft, SPECEXEC)
    draft.unlink()

    with caplog.at_level(logging.WARNING, logger="specrun.profiles"):
        assert profiles.choice_for(target, draft) is None


def test_save_replaces_the_file_atomically(model_files):
    target, draft = model_files
    _store(target, draft, SPECEXEC)
    _store(target, draft, PLAIN)

    assert profiles.choice_for(target, draft).kind == "plain"
    leftovers = [p.name for p in paths.profiles_dir().iterdir() if p.name.startswith(".profile-")]
    assert leftovers == []


def test_tuning_is_suggested_once_per_pair(model_files, tmp_path):
    target, draft = model_files
    other = tmp_path / "other-draft.gguf"
    other.write_bytes(b"GGUF")
    assert profiles.first_suggestion(target, draft) is True
    assert profiles.first_suggestion(target, draft) is False
    assert profiles.first_suggestion(target, other) is True


def test_a_corrupt_suggestion_record_only_means_suggesting_again(model_files):
    target, draft = model_files
    record = paths.profiles_dir() / "suggested.json"
    record.parent.mkdir(parents=True, exist_ok=True)
    record.write_text("{not json", encoding="utf-8")
    assert profiles.first_suggestion(target, draft) is True
    assert profiles.first_suggestion(target, draft) is False


def _measured_profile(best_tree: dict, accepted_per_pass: float) -> dict:
    """A profile's measurements, as tune stores them (the demo pair on a 2-core CPU)."""
    return {
        "config": best_tree, "best_tree": best_tree,
        "curves": {"target": {"sizes": [1, 8, 64], "seconds": [0.030, 0.054, 0.236]},
                   "draft": {"sizes": [1, 64], "seconds": [0.014, 0.464]}, "draft_topk": None},
        "plain": {"target_s": 0.027, "overhead_s": 0.001},
        "acceptance": {"tau": {"4": 3.76, "7": 4.76, "8": 5.12}},
        "check": {"tree_measured_speedup": 1.19, "accepted_per_pass": accepted_per_pass},
    }


def test_the_check_at_load_compares_with_the_pass_tune_timed_as_a_run_does():
    """A run times the target's one-token pass at load as the least of a few; tune times it so
    too and the check compares like with like. Plain decoding's mean pass (slower, through RPC
    workers by more than the check's drift) stands in only for profiles made before."""
    chain = {"kind": "sequoia", "budget": 4, "depth": 4, "width": 1, "top_k": 1}
    profile = _measured_profile(chain, 4.7)
    assert profiles.facts_of(profile).pass_s == pytest.approx(0.027)
    profile["plain"]["load_pass_s"] = 0.0242
    facts = profiles.facts_of(profile)
    assert facts.pass_s == pytest.approx(0.0242)
    assert facts.plain_s == pytest.approx(0.028)  # plain decoding's rate is still its own


def test_the_draft_prior_of_the_checked_tree_takes_the_tokens_per_pass_the_check_measured():
    """A chain of 7 from a draft that nearly always agrees passed 7.8 tokens in the check; the
    calibration's best-first trees of 7 pass 4.8. Priced with the latter, drafting looked slower
    than plain decoding and a tuned profile kept the draft model off free chat, where it pays."""
    chain = {"kind": "sequoia", "budget": 7, "depth": 7, "width": 1, "top_k": 1}
    facts = profiles.facts_of(_measured_profile(chain, 7.83))
    prior = facts.draft_prior(TreeShape(7, 7, 1, 1))
    assert prior.accepted == pytest.approx(6.83)
    assert prior.draft_rate(1, 100.0) > 1.0 / facts.plain_s  # drafting pays, as the check measured
    # Another shape (a --budget override) is priced from the calibration's tau.
    assert facts.draft_prior(TreeShape(4, 4, 1, 1)).accepted == pytest.approx(2.76)
    # A profile without the check's figure (older, or the tree was never checked) uses tau too.
    assert profiles.facts_of(_measured_profile(chain, 0.0)).draft_prior(TreeShape(7, 7, 1, 1)).accepted == pytest.approx(3.76)
