"""The record of files whose sha256 was checked (verified.json in specrun's cache).

Hashing a multi-GB model takes a while, so a checked file's digest is remembered under its
identity (resolved path, size, mtime): the same file is not hashed again. The record is only a
cache: a missing, unreadable or malformed record means "hash again", never a failed run.
"""

from __future__ import annotations

from pathlib import Path

from specrun import files, paths
from specrun.errors import DownloadError
from specrun.models.specs import ModelSpec, Source


def record_path() -> Path:
    return paths.cache_dir() / "verified.json"


def known_digest(path: Path) -> str | None:
    """Return the sha256 remembered for this exact file (same size and mtime), if any."""
    records = files.read_json(record_path(), dict, "record of verified files") or {}
    try:
        key = files.file_key(path)
    except OSError:
        return None
    entry = records.get(key["path"])
    if isinstance(entry, list) and len(entry) == 3 and entry[:2] == [key["size"], key["mtime_ns"]]:
        return entry[2]
    return None


def remember_digest(path: Path, digest: str) -> None:
    """Record that this exact file has this sha256 (best effort: a failure only costs a re-hash)."""
    records = files.read_json(record_path(), dict, "record of verified files") or {}
    try:
        key = files.file_key(path)
        records[key["path"]] = [key["size"], key["mtime_ns"], digest]
        files.atomic_write_json(record_path(), records, indent=0)
    except OSError:
        pass


def mismatch_error(spec: ModelSpec, src: Source, name: str, expected: str, digest: str) -> DownloadError:
    return DownloadError(
        f"the pinned sha256 for '{spec.name}' no longer matches: {name} from {src.describe()} has sha256 {digest}, "
        f"{spec.origin} pins {expected}. The file was removed. The publisher may have re-uploaded it (if you "
        f"trust the new file, pin its hash in {paths.user_models_toml()}) or the download was corrupted "
        f"(pull again)"
    )


def cached_mismatch_error(spec: ModelSpec, name: str, path: Path, expected: str, digest: str) -> DownloadError:
    """Return the error for a file already on disk whose sha256 is not the one pinned (it is kept)."""
    return DownloadError(
        f"'{spec.name}' pins sha256 {expected} for {name} ({spec.origin}), but the file on disk has sha256 "
        f"{digest}: {path}. The file was left as it is (other tools or aliases may use it). If it is damaged, "
        f"`specrun pull --force {spec.name}` downloads it again and replaces it once the new copy verifies; "
        f"if the pin is wrong, correct it"
    )
