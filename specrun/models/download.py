"""Moving bytes safely: resumable HTTP downloads, file locks, disk-space checks, progress.

A download goes to `<dest>.incomplete` with a running sha256, resumes from there after a dropped
connection or an interrupted run, asks for a fresh link when a signed link expires, and is renamed
to its final name only when complete and verified. fcntl locks keep two processes from preparing
the same file at once.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import http.client
import os
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from specrun.errors import DownloadError
from specrun.files import human_size
from specrun.models.verified import remember_digest

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no cross-process lock, downloads still atomic
    fcntl = None

CHUNK = 1 << 20
READ_TIMEOUT = 60.0  # seconds without a byte before a connection counts as dropped
# A dropped connection is retried (resuming) this many times in a row without progress.
MAX_RETRIES = 5
RETRY_DELAY = 0.5  # seconds, times the attempt number



class DiskFull(DownloadError):
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


def download_resumable(
    locate: Callable[[], tuple[str, dict]], dest: Path, size: int | None, expected: str | None, lock: Path,
    report: "Reporter", label: str, alias: str, on_mismatch: Callable[[str], DownloadError],
) -> None:
    """Download to dest through dest.incomplete, resuming from what an earlier run left.

    locate() returns the URL and headers; it is called again when a link stops working (signed
    CDN links expire while a large file is still downloading).
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(lock, report, label):
        if dest.exists():
            return  # another process finished it while we waited
        part = _PartFile(dest.with_name(dest.name + ".incomplete"))
        if size is not None and part.size > size:
            part.restart()
        if size is not None:
            check_space(dest.parent, size - part.size, label)
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
        remember_digest(dest, digest)


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
        total = total_size(response, part.size)
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
                raise DiskFull(
                    f"disk full while downloading into {part.path.parent} ({human_size(part.size)} of "
                    f"{human_size(size)} kept): free some space and run `specrun pull {alias}` to resume"
                ) from None
            raise
    if size is not None and part.size < size:
        raise _ShortRead(f"connection closed after {part.size} of {size} bytes")
    return size


def _open_for_append(path: Path):
    return path.open("ab")


def total_size(response, offset: int) -> int | None:
    """Return the whole file's size from an HTTP response that starts at byte offset, if it says."""
    content_range = response.headers.get("Content-Range")
    if content_range and "/" in content_range and not content_range.endswith("/*"):
        return int(content_range.rsplit("/", 1)[1])
    length = response.headers.get("Content-Length")
    return int(length) + offset if length is not None else None


def _reason(error: BaseException) -> str:
    return str(getattr(error, "reason", None) or error) or error.__class__.__name__


def hash_file(path: Path, report: "Reporter", label: str) -> str:
    hasher = hashlib.sha256()
    with report.bar(label, path.stat().st_size, 0) as advance, path.open("rb") as f:
        for chunk in iter(lambda: f.read(CHUNK), b""):
            hasher.update(chunk)
            advance(len(chunk))
    return hasher.hexdigest()


def lock_path(final: Path) -> Path:
    return final.parent / ".locks" / f"{final.name}.lock"


@contextlib.contextmanager
def file_lock(path: Path, report: "Reporter", what: str) -> Iterator[None]:
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


def check_space(folder: Path, needed: int | None, what: str) -> None:
    if not needed or needed <= 0:
        return
    probe = folder
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if needed > free:
        raise DiskFull(
            f"not enough disk space for {what}: needs {human_size(needed)}, {human_size(free)} free in {folder}"
        )




class Reporter:
    """Rich progress bars and short notes on stderr, or nothing (quiet, or stderr not a terminal)."""

    def __init__(self, progress: bool, console=None):
        self.console = console
        self.enabled = bool(progress)
        if self.enabled:
            if self.console is None:
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
