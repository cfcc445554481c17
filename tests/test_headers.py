"""Header-only sparse copies of Hugging Face GGUF files: fetched by range requests, cached, loadable.

A real model (SmolLM2-135M Q4_1, whole and split in three shards) is served by the fake hub; the
copy must cost a small part of the file's bytes, carry the real header at the real size, work
offline from the cache, and be loadable by libllama with no_alloc (metadata only, allocations
simulated), as the memory plan uses it.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from types import SimpleNamespace

import gguf
import llama_cpp
import numpy as np
import pytest

from specrun.engine import gguf as engine_gguf
from specrun.engine.backend import ensure_backend
from specrun.models import headers, registry
from specrun.models.gguf_header import NotGGUF, header_length

sys.path.insert(0, str(Path(__file__).parent))
from fakehub import FakeHub, tiny_gguf_bytes

REPO = "fake/SmolLM2-GGUF"
UNREACHABLE = "http://127.0.0.1:9"  # nothing listens on the discard port


@pytest.fixture
def env(tmp_path, monkeypatch):
    """A fake hub that HF_ENDPOINT points at, and a specrun cache of this test's own."""
    monkeypatch.setenv("SPECRUN_HOME", str(tmp_path / "specrun"))
    with FakeHub() as fake:
        monkeypatch.setenv("HF_ENDPOINT", fake.endpoint)
        yield SimpleNamespace(hub=fake, cache=tmp_path / "specrun")


def serve(env, *files: Path, named: int = 0) -> registry.ModelSpec:
    """Serve files (the shards of one model) from REPO; return the spec of `hf:` naming files[named]."""
    for path in files:
        env.hub.add_file(REPO, path.name, path.read_bytes())
    return registry.resolve(f"hf:{REPO}/{files[named].name}")


def fetched_bytes(env) -> int:
    return sum(r.body_bytes for r in env.hub.gets())


def metadata(path: Path) -> dict:
    """Return every key/value of a GGUF header (the gguf package's reading of it)."""
    return {key: field.contents() for key, field in gguf.GGUFReader(path).fields.items()}


def split_gguf(source: Path, folder: Path, max_tensors: int) -> list[Path]:
    """Write source again as shards of at most max_tensors tensors; return their paths, first first."""
    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(folder / source.name, arch=reader.fields["general.architecture"].contents(),
                             split_max_tensors=max_tensors)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue  # the writer writes these itself
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub_type)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)
    shards = writer.format_shard_names(folder / source.name)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return shards


def simulated_load(path: Path, caplog) -> list[str]:
    """Load path with no_alloc (metadata only, allocations simulated), make a 4096-token context,
    free both; return what libllama logged about the KV cache."""
    ensure_backend()
    params = llama_cpp.llama_model_default_params()
    params.no_alloc = True
    params.load_mode = llama_cpp.LLAMA_LOAD_MODE_NONE
    with caplog.at_level(logging.INFO, logger="specrun.llama"):
        model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
        assert model, f"libllama could not load {path}"
        try:
            ctx_params = llama_cpp.llama_context_default_params()
            ctx_params.n_ctx = 4096
            context = llama_cpp.llama_init_from_model(model, ctx_params)
            assert context, f"libllama could not make a context for {path}"
            llama_cpp.llama_free(context)
        finally:
            llama_cpp.llama_model_free(model)
    return [r.getMessage() for r in caplog.records if "KV" in r.getMessage() or "kv_cache" in r.getMessage()]


# ---------------------------------------------------------------------------------------------
# A whole model


def test_copy_costs_a_small_part_of_the_file_and_holds_its_real_header(env, offline_models):
    real = offline_models.smollm2_q4
    spec = serve(env, real)

    copy, reason = headers.header_copy(spec)

    assert reason is None and copy.name == real.name
    size = real.stat().st_size
    assert fetched_bytes(env) <= 2 * header_length(real.read_bytes()[: 8 << 20])  # doubling ranges
    assert fetched_bytes(env) < size / 20  # 2 MiB of a 98 MB file
    assert copy.stat().st_size == size
    assert copy.stat().st_blocks * 512 < size / 10  # a hole: no disk space for the weights
    assert engine_gguf.header_facts(copy) == engine_gguf.header_facts(real)
    assert metadata(copy) == metadata(real)
    assert headers.headers_dir() in copy.parents


def test_second_call_uses_the_cache_offline_online_and_without_network(env, offline_models, monkeypatch):
    spec = serve(env, offline_models.smollm2_q4)
    copy, _ = headers.header_copy(spec)
    n_requests = len(env.hub.requests)

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert headers.header_copy(spec) == (copy, None)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    assert headers.header_copy(spec) == (copy, None)  # never fetched twice
    assert len(env.hub.requests) == n_requests
    monkeypatch.setenv("HF_ENDPOINT", UNREACHABLE)
    assert headers.header_copy(spec) == (copy, None)


def test_libllama_loads_the_copy_with_no_alloc_and_plans_its_kv_cache(env, offline_models, caplog):
    copy, reason = headers.header_copy(serve(env, offline_models.smollm2_q4))
    assert reason is None

    kv_lines = simulated_load(copy, caplog)

    assert any("4096 cells" in line for line in kv_lines), kv_lines


# ---------------------------------------------------------------------------------------------
# A split model


def test_split_model_gets_every_shard_side_by_side_and_loads(env, offline_models, tmp_path, caplog):
    real = offline_models.smollm2_q4
    shards = split_gguf(real, tmp_path, max_tensors=100)
    assert [s.name[-20:] for s in shards] == [f"-0000{i}-of-00003.gguf" for i in (1, 2, 3)]

    copy, reason = headers.header_copy(serve(env, *shards, named=1))  # any shard names them all

    assert reason is None and copy.name == shards[0].name
    for shard in shards:
        sibling = copy.with_name(shard.name)
        assert sibling.stat().st_size == shard.stat().st_size
        assert engine_gguf.header_facts(sibling) == engine_gguf.header_facts(shard)
    assert fetched_bytes(env) < sum(s.stat().st_size for s in shards) / 20
    assert any("4096 cells" in line for line in simulated_load(copy, caplog))


# ---------------------------------------------------------------------------------------------
# When no copy can be had: one line that says why


def test_offline_without_a_cached_header_says_so(env, offline_models, monkeypatch):
    spec = serve(env, offline_models.smollm2_q4)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    copy, reason = headers.header_copy(spec)

    assert copy is None and "HF_HUB_OFFLINE" in reason and REPO in reason and "\n" not in reason
    assert env.hub.requests == []


def test_unreachable_hub_without_a_cached_header_says_so(env, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", UNREACHABLE)

    copy, reason = headers.header_copy(registry.resolve(f"hf:{REPO}/model.gguf"))

    assert copy is None and f"cannot reach {UNREACHABLE}" in reason and "\n" not in reason


def test_a_file_that_is_not_a_gguf_is_refused_after_one_range(env):
    env.hub.add_file(REPO, "model.gguf", b"<html>rate limited</html>" * 100_000)

    copy, reason = headers.header_copy(registry.resolve(f"hf:{REPO}/model.gguf"))

    assert copy is None and "model.gguf" in reason and "not a GGUF" in reason
    assert len(env.hub.gets()) == 1
    assert not list(env.cache.rglob("model.gguf"))


def test_gated_repo_missing_file_and_local_model_give_their_reasons(env, monkeypatch, tmp_path):
    env.hub.add_file(REPO, "tiny.gguf", tiny_gguf_bytes())
    env.hub.gate(REPO, token="hf_secret")
    spec = registry.resolve(f"hf:{REPO}/tiny.gguf")

    _, gated = headers.header_copy(spec)
    assert "gated" in gated and "HF_TOKEN" in gated
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    assert headers.header_copy(spec)[0].stat().st_size == len(tiny_gguf_bytes())

    _, missing = headers.header_copy(registry.resolve(f"hf:{REPO}/other.gguf"))
    assert "has no file other.gguf" in missing

    local = tmp_path / "local.gguf"
    local.write_bytes(tiny_gguf_bytes())
    _, not_hub = headers.header_copy(registry.resolve(str(local)))
    assert "not a Hugging Face repo" in not_hub


# ---------------------------------------------------------------------------------------------
# The header reader


def gguf_file(path: Path, alignment: int | None) -> Path:
    """Write a GGUF with values of every type (arrays of strings and numbers among them)."""
    writer = gguf.GGUFWriter(path, arch="llama")
    if alignment:
        writer.add_custom_alignment(alignment)
    writer.add_string("test.string", "zwölf")
    writer.add_array("test.strings", ["a", "bc", ""])
    writer.add_array("test.floats", [0.5, 1.5])
    for kind in ("UINT8", "INT16", "UINT32", "INT64", "FLOAT64"):
        writer.add_key_value(f"test.{kind.lower()}", 7, gguf.GGUFValueType[kind])
    writer.add_bool("test.bool", True)
    writer.add_tensor("a", np.ones((3, 5), dtype=np.float32))
    writer.add_tensor("b", np.ones(7, dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("alignment", [None, 64, 4096])
def test_header_length_is_where_the_tensor_data_starts(tmp_path, alignment):
    path = gguf_file(tmp_path / "t.gguf", alignment)
    data = path.read_bytes()
    start = gguf.GGUFReader(path).data_offset

    assert header_length(data) == start
    assert header_length(data[:100]) is None  # cut inside the key/value pairs: more bytes needed
    with pytest.raises(NotGGUF):
        header_length(b"GGML" + data[4:])
