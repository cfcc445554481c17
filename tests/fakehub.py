"""A local HTTP server that answers like the Hugging Face Hub, for download tests.

It serves `HEAD` and `GET /{owner}/{repo}/resolve/{revision}/{path}` with the headers that
huggingface_hub and specrun rely on: ETag (the file's sha256, as the hub gives for LFS files),
X-Repo-Commit, Content-Length, Accept-Ranges, and 206 partial content for `Range: bytes=N-` and
`bytes=N-M`. Each request's body bytes are counted (`Request.body_bytes`).
Gated repos answer 401 with X-Error-Code: GatedRepo unless the right bearer token is sent.
A file can be set to drop the connection part-way, once or every time.

    with FakeHub() as hub:
        hub.add_file("owner/repo", "model.gguf", data)
        os.environ["HF_ENDPOINT"] = hub.endpoint
"""

from __future__ import annotations

import hashlib
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote

RESOLVE_RE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<revision>[^/]+)/(?P<path>.+)$")


@dataclass
class FakeFile:
    data: bytes
    etag: str  # what the hub claims; normally the sha256 of data
    drop_after: int | None = None  # close the connection after this many body bytes
    drops_left: int = 0  # how many more responses to cut short (-1: all of them)
    refuse_ranged: int = 0  # answer this many resuming GETs with 403, like an expired signed link


@dataclass
class FakeRepo:
    commit: str
    files: dict[str, FakeFile] = field(default_factory=dict)
    token: str | None = None  # gated: this bearer token is required


@dataclass
class Request:
    method: str
    path: str
    headers: dict[str, str]
    status: int = 0
    body_bytes: int = 0


class FakeHub:
    """The server plus the repos it serves and a log of the requests it answered."""

    def __init__(self):
        self.repos: dict[str, FakeRepo] = {}
        self.requests: list[Request] = []
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _make_handler(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,), daemon=True)

    @property
    def endpoint(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> "FakeHub":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def add_file(self, repo: str, path: str, data: bytes, etag: str | None = None) -> FakeFile:
        """Serve data as repo/path; the ETag defaults to its sha256 (as for LFS files)."""
        fake_repo = self.repos.setdefault(repo, FakeRepo(commit=hashlib.sha1(repo.encode()).hexdigest()))
        fake = FakeFile(data, etag or hashlib.sha256(data).hexdigest())
        fake_repo.files[path] = fake
        return fake

    def gate(self, repo: str, token: str) -> None:
        """Make repo answer 401 unless `Authorization: Bearer {token}` is sent."""
        self.repos[repo].token = token

    def drop(self, repo: str, path: str, after: int, times: int = 1) -> None:
        """Cut the next `times` responses for a file after `after` body bytes (-1: always)."""
        fake = self.repos[repo].files[path]
        fake.drop_after, fake.drops_left = after, times

    def gets(self, path_suffix: str = "") -> list[Request]:
        return [r for r in self.requests if r.method == "GET" and r.path.endswith(path_suffix)]


def _make_handler(hub: FakeHub):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"  # one request per connection: dropping one is simple

        def log_message(self, *args) -> None:  # keep test output clean
            pass

        def do_HEAD(self) -> None:
            self._answer(send_body=False)

        def do_GET(self) -> None:
            self._answer(send_body=True)

        def _answer(self, send_body: bool) -> None:
            record = Request(self.command, unquote(self.path), {k.lower(): v for k, v in self.headers.items()})
            with hub._lock:
                hub.requests.append(record)
            match = RESOLVE_RE.match(record.path)
            repo = hub.repos.get(match.group("repo")) if match else None
            if repo is None:
                return self._error(record, 404, "RepoNotFound", "Repository not found")
            if repo.token and record.headers.get("authorization") != f"Bearer {repo.token}":
                return self._error(record, 401, "GatedRepo", "Access to this model is restricted. Please log in.")
            if match.group("revision") not in ("main", repo.commit):
                return self._error(record, 404, "RevisionNotFound", "Invalid rev id", repo.commit)
            fake = repo.files.get(match.group("path"))
            if fake is None:
                return self._error(record, 404, "EntryNotFound", "Entry not found", repo.commit)
            start, last = _byte_range(record.headers.get("range"))
            if start and send_body and fake.refuse_ranged:
                fake.refuse_ranged -= 1
                return self._error(record, 403, "", "Request has expired")
            total = len(fake.data)
            if start is not None and start >= total:
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{total}")
                self.end_headers()
                record.status = 416
                return
            status = 206 if start or last is not None else 200
            start = start or 0
            stop = total if last is None else min(last + 1, total)
            self.send_response(status)
            self.send_header("ETag", f'"{fake.etag}"')
            self.send_header("X-Repo-Commit", repo.commit)
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(stop - start))
            if status == 206:
                self.send_header("Content-Range", f"bytes {start}-{stop - 1}/{total}")
            self.end_headers()
            record.status = status
            if not send_body:
                return
            body = fake.data[start:stop]
            if fake.drops_left and fake.drop_after is not None:
                fake.drops_left -= 1 if fake.drops_left > 0 else 0
                body = body[: max(fake.drop_after - start, 0)] if fake.drop_after > start else b""
            self.wfile.write(body)
            self.wfile.flush()
            record.body_bytes = len(body)

        def _error(self, record: Request, status: int, code: str, message: str, commit: str | None = None) -> None:
            self.send_response(status)
            if code:
                self.send_header("X-Error-Code", code)
            self.send_header("X-Error-Message", message)
            if commit:
                self.send_header("X-Repo-Commit", commit)
            payload = f'{{"error": "{message}"}}'.encode()
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(payload)
            record.status = status

    return Handler


def _byte_range(header: str | None) -> tuple[int | None, int | None]:
    """Return (first byte, last byte or None) of a `Range: bytes=N-` or `bytes=N-M` header."""
    match = re.fullmatch(r"bytes=(\d+)-(\d*)", header or "")
    if not match:
        return None, None
    return int(match.group(1)), int(match.group(2)) if match.group(2) else None


def tiny_gguf_bytes(n_floats: int = 65536, seed: int = 0) -> bytes:
    """Return a small valid GGUF file (one F32 tensor) written with the gguf package."""
    import os
    import tempfile

    import gguf
    import numpy as np

    fd, name = tempfile.mkstemp(suffix=".gguf")
    os.close(fd)
    try:
        writer = gguf.GGUFWriter(name, arch="llama")
        writer.add_name(f"fakehub test file {seed}")
        writer.add_tensor("weights", np.random.default_rng(seed).standard_normal(n_floats).astype(np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        with open(name, "rb") as f:
            return f.read()
    finally:
        os.unlink(name)
