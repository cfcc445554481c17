"""HTTP connections that cannot stall the server: bounded request heads, read deadlines, a cap.

uvicorn's parser (httptools) buffers a request head without limit and waits for it forever, and
uvicorn closes idle connections only after a first response. So anyone who can reach the port
could fill memory with one endless header, or keep every file descriptor busy with connections
that never send a byte. This protocol adds:

- a head of at most MAX_HEAD_BYTES and MAX_HEADERS headers (else 431 and the connection closes);
- a deadline: a request must arrive whole (head and body) within `read_timeout_s` of the
  connection opening or of the previous answer ending (else 408, or just a close if nothing came);
- at most `max_connections` open connections: a new one beyond that closes the connection that
  has waited longest without sending a whole request, or is closed itself when none is idle.
"""

from __future__ import annotations

import asyncio
import time

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

MAX_HEAD_BYTES = 64 * 1024  # request line and headers; browsers send a few KiB
MAX_HEADERS = 100
DEFAULT_READ_TIMEOUT_S = 30.0
MAX_CONNECTIONS = 512  # and at most half the process's file descriptor limit


def connection_limit() -> int:
    """Return how many connections may be open at once on this process's file descriptor limit."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):
        return MAX_CONNECTIONS
    if soft == resource.RLIM_INFINITY:
        return MAX_CONNECTIONS
    return max(8, min(MAX_CONNECTIONS, soft // 2))


def guarded_protocol(read_timeout_s: float, max_connections: int) -> type[asyncio.Protocol]:
    """Return the uvicorn protocol class with these limits (uvicorn builds one per connection)."""
    return type("GuardedHttpProtocol", (GuardedHttpProtocol,),
                {"read_timeout_s": read_timeout_s, "max_connections": max_connections})


class GuardedHttpProtocol(HttpToolsProtocol):
    read_timeout_s = DEFAULT_READ_TIMEOUT_S
    max_connections = MAX_CONNECTIONS

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        self._waiting_since: float | None = None  # a request is expected but not whole yet
        self._head_done = False
        self._head_bytes = 0
        self._n_headers = 0
        self._head_refused = False

    # -- the connection --
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if len(self.connections) >= self.max_connections and not _close_longest_idle(self.connections):
            self.transport = transport  # uvicorn's connection_lost closes it again
            transport.close()
            return
        super().connection_made(transport)
        self._expect_request()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_deadline()
        self._waiting_since = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if not self._head_done:
            self._head_bytes += len(data)
        super().data_received(data)
        too_large = not self._head_done and self._head_bytes > MAX_HEAD_BYTES
        if (too_large or self._head_refused) and not self.transport.is_closing():
            self._refuse(431, "Request Header Fields Too Large",
                         f"request head larger than {MAX_HEAD_BYTES} bytes or with more than {MAX_HEADERS} headers")

    # -- parser callbacks --
    def on_header(self, name: bytes, value: bytes) -> None:
        self._n_headers += 1
        if self._n_headers <= MAX_HEADERS:
            super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._head_done = True
        if self._n_headers > MAX_HEADERS:
            self._head_refused = True
            return
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        if not self._head_refused:
            super().on_body(body)

    def on_message_complete(self) -> None:
        self._cancel_deadline()
        self._waiting_since = None
        if self._head_refused:
            return
        self._head_done, self._head_bytes, self._n_headers = False, 0, 0  # the next request's head
        super().on_message_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._expect_request()

    # -- deadlines --
    def _expect_request(self) -> None:
        self._cancel_deadline()
        self._waiting_since = time.monotonic()
        self._deadline = self.loop.call_later(self.read_timeout_s, self._deadline_passed)

    def _cancel_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _deadline_passed(self) -> None:
        self._deadline = None
        if self._waiting_since is None or self.transport.is_closing():
            return
        if self._head_bytes or self._head_done:  # something came, too slowly
            self._refuse(408, "Request Timeout", f"the request did not arrive within {self.read_timeout_s:g} s")
        else:
            self.transport.close()

    def _refuse(self, status: int, phrase: str, message: str) -> None:
        body = message.encode()
        self.transport.write(
            f"HTTP/1.1 {status} {phrase}\r\ncontent-type: text/plain; charset=utf-8\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n".encode() + body
        )
        self.transport.close()


def _close_longest_idle(connections) -> bool:
    """Close the connection that has waited longest for a whole request; False if none waits."""
    idle = [c for c in connections if getattr(c, "_waiting_since", None) is not None]
    if not idle:
        return False
    oldest = min(idle, key=lambda c: c._waiting_since)
    oldest._waiting_since = None
    oldest._cancel_deadline()
    oldest.transport.close()
    return True
