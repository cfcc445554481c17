"""architectures.py: how each architecture can speculate, and the registry's current families."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from specrun.errors import RegistryError
from specrun import architectures
from specrun.architectures import speculation
from specrun.models import registry
from specrun.models.registry import HFSource
from pinned_sources import gguf_py


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECRUN_CONFIG", str(tmp_path / "config"))


@pytest.fixture(scope="module")
def shipped():
    return registry.load(user_toml=Path("/nonexistent/models.toml"))


@pytest.fixture(scope="module")
def llama_cpp_arch_names() -> set[str]:
    """Every architecture name the pinned llama.cpp knows (its gguf-py's MODEL_ARCH_NAMES).

    Read from the pinned constants.py itself: an installed `gguf` package may be older.
    """
    spec = importlib.util.spec_from_file_location("pinned_gguf_constants", gguf_py() / "gguf" / "constants.py")
    constants = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(constants)
    return set(constants.MODEL_ARCH_NAMES.values())


# ---------------------------------------------------------------------------------------------
# The table


@pytest.mark.parametrize("arch, mode", [
    ("qwen35", "chains"), ("qwen35moe", "chains"), ("nemotron_h", "chains"), ("lfm2", "chains"),
    ("kimi-k3", "chains"), ("deepseek4", "chains"), ("glm5-next", "chains"),
    ("jamba", "plain"), ("falcon-h1", "plain"), ("granitehybrid", "plain"), ("qwen3next", "plain"),
    ("plamo2", "plain"), ("kimi-linear", "plain"), ("minimax-01", "plain"),
    ("mamba", "plain"), ("mamba2", "plain"), ("rwkv7", "plain"), ("gemma4-assistant", "plain"),
    ("llama", "tree"), ("qwen3", "tree"), ("gemma4", "tree"), ("gpt-oss", "tree"), ("qwen3moe", "tree"),
    (None, "unknown"), ("", "unknown"),
])
def test_each_architecture_speculates_as_llama_cpp_allows(arch, mode):
    result = speculation(arch)
    assert result.mode == mode
    assert result.reason and (arch or "architecture") in result.reason


def test_every_named_architecture_exists_in_the_pinned_llama_cpp(llama_cpp_arch_names):
    named = architectures.ROLLBACK | (architectures.HYBRID - architectures.ROLLBACK) | architectures.RECURRENT | architectures.HEADS
    assert sorted(named - llama_cpp_arch_names) == []
    # The three kinds do not overlap: a hybrid either rolls back or it does not.
    kinds = [architectures.ROLLBACK, architectures.HYBRID - architectures.ROLLBACK, architectures.RECURRENT, architectures.HEADS]
    assert sum(map(len, kinds)) == len(named)


def test_labels_say_mtp_beside_the_mode():
    assert speculation("qwen35", mtp=True).label == "chains, MTP"
    assert speculation("jamba").label == "plain only"
    assert speculation(None, mtp=True).label == "?"
    assert speculation("llama").label == "tree"
    assert speculation("qwen35", mtp=True).as_dict() == {
        "mode": "chains", "reason": speculation("qwen35").reason, "mtp": True,
        "mtp_drafting": architectures.MTP_DRAFTING,
    }


# ---------------------------------------------------------------------------------------------
# The current families in the shipped registry


def test_current_families_are_covered(shipped):
    wanted = [
        "qwen3.5-0.8b", "qwen3.5-2b", "qwen3.5-4b", "qwen3.5-9b", "qwen3.5-27b", "qwen3.5-35b-a3b",
        "qwen3.5-4b-mtp", "qwen3.6-27b", "qwen3.6-35b-a3b", "qwen3.8-27b",
        "gemma4-e2b", "gemma4-e4b", "gemma4-26b-a4b", "gemma4-31b",
        "gpt-oss-20b", "gpt-oss-120b", "lfm2.5-1.2b",
    ]
    assert [name for name in wanted if shipped.get(name) is None] == []


@pytest.mark.parametrize("target, draft", [
    ("qwen3.5-27b", "qwen3.5-0.8b"), ("qwen3.5-35b-a3b", "qwen3.5-0.8b"), ("qwen3.6-27b", "qwen3.5-0.8b"),
    ("gemma4-31b", "gemma4-e2b"), ("gpt-oss-120b", "gpt-oss-20b"), ("lfm2.5-1.2b", "lfm2.5-350m"),
])
def test_each_family_has_its_default_draft(shipped, target, draft):
    assert registry.recommended_draft(shipped.get(target), shipped).name == draft


def test_drafts_recommend_no_draft_of_their_own(shipped):
    for alias in ("qwen3.5-0.8b", "gemma4-e2b", "gpt-oss-20b", "lfm2.5-350m"):
        assert shipped.get(alias).draft is None, alias


def test_architectures_come_from_the_family_or_the_entry(shipped, llama_cpp_arch_names):
    assert shipped.get("qwen3.5-27b").arch == "qwen35"
    assert shipped.get("qwen3.5-35b-a3b").arch == "qwen35moe"  # the entry overrides its family
    assert shipped.get("gpt-oss-120b").arch == "gpt-oss"
    # Every architecture the registry names is one llama.cpp knows.
    named = {spec.arch for spec in shipped.models.values() if spec.arch}
    assert sorted(named - llama_cpp_arch_names) == []


def test_split_models_list_every_shard_first_shard_first(shipped):
    for alias, count, folder in [("gpt-oss-120b", 3, ""), ("qwen3.5-122b-a10b", 3, "Q4_K_M/")]:
        (src,) = shipped.get(alias).sources
        assert isinstance(src, HFSource)
        assert len(src.files) == count and all(f.startswith(folder) for f in src.files)
        assert src.files == registry.shard_names(src.files[-1])
        assert sum(src.sizes) == shipped.get(alias).size


def test_pinned_hashes_are_listed_with_sizes_and_unconfirmed_ones_are_marked(shipped):
    confirmed = ["qwen3.5-0.8b", "qwen3.5-27b", "gemma4-31b", "gpt-oss-120b", "lfm2.5-1.2b", "qwen3.8-27b"]
    for alias in confirmed:
        (src,) = shipped.get(alias).sources
        assert src.verified and all(src.sha256) and sum(src.sizes) == shipped.get(alias).size, alias
    for alias in ("qwen3.5-122b-a10b", "lfm2.5-350m"):
        assert not shipped.get(alias).sources[0].verified, alias


def test_rows_say_how_each_model_speculates(shipped):
    rows = {row.alias: row for row in registry.list_models(shipped)}
    assert rows["qwen3.5-27b"].speculation.mode == "chains"
    assert rows["qwen3.5-4b-mtp"].speculation.label == "chains, MTP"
    assert rows["gemma4-31b"].speculation.mode == "tree"
    assert rows["gpt-oss-120b"].speculation.mode == "tree"
    assert rows["lfm2.5-1.2b"].speculation.mode == "chains"
    assert rows["qwen2.5-14b"].speculation.mode == "tree"
    data = rows["qwen3.5-27b"].as_dict()
    assert data["arch"] == "qwen35" and data["speculation"]["mode"] == "chains"
    json.dumps(data)  # the row is JSON as it is


@pytest.mark.parametrize("text, problem", [
    ('[models.mine]\nfamily = "x"\narch = 3\n[[models.mine.source]]\npath = "a.gguf"\n', "arch must be a string"),
    ('[models.mine]\nfamily = "x"\nmtp = "yes"\n[[models.mine.source]]\npath = "a.gguf"\n', "mtp must be true or false"),
    ('[families.x]\narch = ["a"]\n', "[families.x] arch must be a string"),
    ('[families.x]\nsize = 3\n', "may only set 'draft', 'arch' and 'notes'"),
])
def test_new_keys_are_checked(tmp_path, text, problem):
    path = tmp_path / "config" / "models.toml"
    path.parent.mkdir(parents=True)
    path.write_text(text)
    # A bad [models] entry is left out (naming it gives the error); a bad [families] table stops the file.
    with pytest.raises(RegistryError) as failure:
        reg = registry.load(user_toml=path)
        raise reg.broken["mine"]
    assert problem in str(failure.value)


def test_a_user_entry_can_name_its_architecture(tmp_path):
    path = tmp_path / "models.toml"
    path.write_text('[models.mine]\nfamily = "x"\narch = "jamba"\n[[models.mine.source]]\npath = "a.gguf"\n')
    reg = registry.load(user_toml=path)
    row = next(row for row in registry.list_models(reg) if row.alias == "mine")
    assert row.arch == "jamba" and row.speculation.label == "plain only"
