"""Request ids, and one stderr line for every refused request.

The outermost ASGI layer: every response carries `X-Request-Id` (the client's own, when it sent a
sane one, else a new one), and every answer with a 4xx or 5xx status is logged on stderr with the
id, method, path, status and the reason: the error's message, or the status's name where the
answer has none. The request's body (prompt text) is logged only with --verbose, cut short.

An answer that reports the server's state rather than an error (/health's 503 `{"status":
"loading"}`) is logged once per state, not once per poll: a client polling /health while the
model loaded logged a line a second.
"""

from __future__ import annotations

import json
import re
import uuid
from http import HTTPStatus

from specrun import ui

REQUEST_ID_HEADER = "x-request-id"
# An incoming id is reused only when it is short and plain (it goes into logs and headers).
_SANE_ID = re.compile(r"[A-Za-z0-9._:@/+=-]{1,128}")
# How much of an error body is read for its message, and of a refused request's body is logged.
ERROR_BODY_BYTES = 4096
VERBOSE_BODY_CHARS = 500
# Reasons for statuses that an answer may carry without a message (nginx's 499 is no HTTPStatus).
STATUS_REASONS = {499: "client disconnected"}


def request_id(scope) -> str:
    """Return the request id of an ASGI scope (set by RequestLog)."""
    return scope.get("state", {}).get("request_id", "")


def _incoming_id(scope) -> str | None:
    for name, value in scope.get("headers") or ():
        if name == REQUEST_ID_HEADER.encode():
            text = value.decode("latin-1")
            return text if _SANE_ID.fullmatch(text) else None
    return None


def _reason(body: bytes) -> tuple[str, str | None]:
    """Return the message of an error body ({"error": {"message"}} or {"error": "..."}), and the
    state a status body reports instead ({"status": "loading"}; None for an error)."""
    try:
        answer = json.loads(body.decode("utf-8", "replace"))
        error, state = answer.get("error"), answer.get("status")
    except (ValueError, AttributeError):
        return body[:200].decode("utf-8", "replace").strip(), None
    if error is None and isinstance(state, str):
        return state, state
    if isinstance(error, dict):
        return str(error.get("message", "")), None
    return str(error or ""), None


def _status_reason(status: int) -> str:
    """Return the name of an HTTP status, the reason of an answer that gives no message."""
    try:
        return STATUS_REASONS.get(status) or HTTPStatus(status).phrase.lower()
    except ValueError:
        return f"status {status}"


class RequestLog:
    """ASGI middleware: a request id on every response, and a log line for every refusal."""

    def __init__(self, app, verbose: bool = False):
        self.app = app
        self.verbose = verbose
        self._state: str | None = None  # the server state last logged (see the module's doc)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = _incoming_id(scope) or f"req-{uuid.uuid4().hex[:16]}"
        scope.setdefault("state", {})["request_id"] = rid
        status = 0
        error_body = bytearray()
        received = bytearray()

        async def send_with_id(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message = dict(message, headers=[*message.get("headers", []),
                                                 (REQUEST_ID_HEADER.encode(), rid.encode())])
            elif message["type"] == "http.response.body" and status >= 400 and len(error_body) < ERROR_BODY_BYTES:
                error_body.extend(message.get("body", b"")[:ERROR_BODY_BYTES])
            await send(message)

        async def receive_kept():
            message = await receive()
            if message["type"] == "http.request" and len(received) < VERBOSE_BODY_CHARS:
                received.extend(message.get("body", b"")[:VERBOSE_BODY_CHARS])
            return message

        try:
            await self.app(scope, receive_kept if self.verbose else receive, send_with_id)
        finally:
            if status >= 400:
                self._log(rid, scope, status, bytes(error_body), bytes(received))

    def _log(self, rid: str, scope, status: int, error_body: bytes, body: bytes) -> None:
        reason, state = _reason(error_body)
        where = f"{rid}: {scope.get('method', '')} {scope.get('path', '')}"
        if state is not None:
            if state == self._state:
                return
            self._state = state
            line = f'{where} answered {status}, status "{state}" (not logged again while it lasts)'
        else:
            line = f"{where} refused with {status}: {reason or _status_reason(status)}"
        if self.verbose and body:
            line += f" · body: {body[:VERBOSE_BODY_CHARS].decode('utf-8', 'replace')}"
        try:
            ui.dim(line)
        except (OSError, SystemExit):  # stderr is gone: the answer matters more than its log line
            pass
