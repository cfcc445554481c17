"""Small file utilities every layer uses: atomic writes, JSON bookkeeping files, file identity.

A file specrun writes is either the old one or the whole new one: text goes to a temporary file
in the same directory, which replaces the target in one rename, and a failed write leaves no
temporary file behind. Bookkeeping files (caches of what was verified or paired) are read
leniently: unreadable or of the wrong shape counts as empty, with a warning that names the file.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

log = logging.getLogger("specrun")


def atomic_write_text(path: Path, text: str) -> None:
    """Write text to path atomically, with the permissions a plain open() would give.

    Raises OSError (with the temporary file removed) when the directory cannot be written or the
    disk is full.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextmanager
def atomic_path(dst: Path) -> Iterator[str]:
    """Yield a temporary file's name beside `dst` for a writer that opens it itself: renamed to
    `dst` (mode 0644) when the block completes, removed when it fails (nothing left behind)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{dst.name}.", suffix=".tmp", dir=dst.parent)
    os.close(fd)
    try:
        yield tmp
        os.chmod(tmp, 0o644)  # mkstemp makes it owner-only
        os.replace(tmp, dst)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_json(path: Path, data: Any, indent: int | None = 1) -> None:
    """Write data as JSON to path atomically (see atomic_write_text)."""
    atomic_write_text(path, json.dumps(data, indent=indent, ensure_ascii=False) + "\n")


def read_json(path: Path, kind: type, what: str) -> Any | None:
    """Return the JSON value in path if it is of `kind` (dict, list); None when missing.

    A file that is unreadable, not JSON or of another shape is reported once as a warning naming
    it and `what` it holds, and counts as missing: the caller rebuilds or ignores it.
    """
    try:
        raw = Path(path).read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        warn_once(path, f"ignoring {what} {path}: {e.strerror or e}")
        return None
    try:
        value = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        warn_once(path, f"ignoring {what} {path}: it is not valid JSON (it will be rebuilt)")
        return None
    if not isinstance(value, kind):
        warn_once(path, f"ignoring {what} {path}: expected a JSON {_json_type(kind)}, found "
                         f"{type(value).__name__} (it will be rebuilt)")
        return None
    return value


# Warnings already given in this process: one run may read the same bad file several times
# (read_json's, and its callers' own findings in a file they parsed: warn_once).
_warned: set[tuple[str, str]] = set()


def warn_once(path: Path, message: str) -> None:
    key = (str(path), message)
    if key not in _warned:
        _warned.add(key)
        log.warning("%s", message)


def unwritable_reason(directory: Path) -> str | None:
    """Return why files cannot be created in directory (made if missing), or None when they can.

    Asks the file system itself (creates and removes a probe file): permission bits say nothing
    about read-only mounts, and root passes every permission check.
    """
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory, prefix=".write-probe-"):
            pass
    except OSError as e:
        return e.strerror or str(e)
    return None


def file_key(path: Path) -> dict:
    """Return what identifies a file's contents cheaply: resolved path, size, mtime_ns."""
    real = Path(path).resolve()
    st = real.stat()
    return {"path": str(real), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


_RAISE = object()


def once_per_version(maxsize: int = 64, missing: Any = _RAISE) -> Callable:
    """Decorate fn(path) to read each version of a file (the path as given, its size and mtime)
    once per process; a file that cannot be stat'ed gives `missing` where one is given (else the
    OSError). The path is not resolved: a split model's shards are found by its file name, which
    a cache's symlink keeps and its blob does not."""

    def decorate(fn: Callable[[Path], Any]) -> Callable[[Path], Any]:
        @functools.lru_cache(maxsize=maxsize)
        def read(path: str, _size: int, _mtime_ns: int) -> Any:
            return fn(Path(path))

        @functools.wraps(fn)
        def cached(path: Path) -> Any:
            try:
                stat = Path(path).stat()
            except OSError:
                if missing is _RAISE:
                    raise
                return missing
            return read(str(path), stat.st_size, stat.st_mtime_ns)

        return cached

    return decorate


def human_size(n_bytes: int | None) -> str:
    """Return a size as people read it: '8.4 GB', '98 MB', or '?' when unknown."""
    if n_bytes is None:
        return "?"
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n_bytes >= scale:
            value = n_bytes / scale
            return f"{value:.1f} {unit}" if value < 10 else f"{value:.0f} {unit}"
    return f"{n_bytes} B"


def _json_type(kind: type) -> str:
    return {dict: "object", list: "array"}.get(kind, kind.__name__)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
