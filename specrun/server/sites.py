"""Refusing requests from web pages: a browser's Origin must be allowed, and the Host must be ours.

Any page a user visits can send a "simple" POST to 127.0.0.1 (no preflight needed), and through
DNS rebinding (a name of the attacker's that resolves to 127.0.0.1) it can even read the answer.
Browsers always say where such a request comes from (Origin) and which name it was sent to
(Host); command-line clients and servers send no Origin. So:

- a request with an Origin that `--cors` does not allow gets a 403;
- without an API key, a request whose Host is a name other than the server's own (localhost, the
  address or name it listens on, this machine's name, or one given to `--allow-host`) gets a 403.
  An address (127.0.0.1, [::1], 192.168.1.5) is always fine: rebinding needs a name. With an API
  key a rebound page gets a 401 anyway, so names are not checked then.
"""

from __future__ import annotations

import ipaddress
import socket

from fastapi.responses import JSONResponse

from specrun.server.schemas import APIError

LOOPBACK_NAMES = ("localhost",)


class SiteGuard:
    """ASGI middleware: 403 for a disallowed Origin or, without an API key, a foreign Host name."""

    def __init__(self, app, cors_origins: tuple[str, ...], allowed_hosts: tuple[str, ...], check_host: bool):
        self.app = app
        self.any_origin = "*" in cors_origins
        self.origins = {o.rstrip("/").lower() for o in cors_origins}
        self.any_host = "*" in allowed_hosts
        self.hosts = {_bare_host(h) for h in (*allowed_hosts, *LOOPBACK_NAMES, socket.gethostname()) if h}
        self.check_host = check_host

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            refusal = self.refusal(dict(scope.get("headers") or ()))
            if refusal is not None:
                response = JSONResponse(refusal.body(), status_code=refusal.status, headers=refusal.headers)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def refusal(self, headers: dict[bytes, bytes]) -> APIError | None:
        host = headers.get(b"host", b"").decode("latin-1")
        origin = headers.get(b"origin")
        if origin is not None and not self._origin_allowed(origin.decode("latin-1"), host):
            return APIError(403, "requests from web pages are refused unless the server is started with "
                            "--cors ORIGIN for that page's origin", code="origin_not_allowed")
        if self.check_host and host and not self._host_allowed(host):
            return APIError(403, f"the Host header names {_bare_host(host)[:100]!r}, not this server; start it "
                            "with --allow-host NAME (or --api-key) to answer requests sent to that name",
                            code="host_not_allowed")
        return None

    def _origin_allowed(self, origin: str, host: str) -> bool:
        origin = origin.rstrip("/").lower()
        if self.any_origin or origin in self.origins:
            return True
        # A page served from this very address (same origin) is not a cross-site request.
        return bool(host) and origin in (f"http://{host.lower()}", f"https://{host.lower()}")

    def _host_allowed(self, host: str) -> bool:
        name = _bare_host(host)
        return self.any_host or name in self.hosts or _is_address(name)


def _bare_host(host: str) -> str:
    """Return a Host header's name or address without port, brackets, case or a final dot."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].split("]", 1)[0]
    if host.count(":") == 1:
        host = host.split(":", 1)[0]
    return host.rstrip(".")


def _is_address(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True
