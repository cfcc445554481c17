"""Issue 18, section 3: what a hostile probe did to `specrun serve`, each case against a real server
process on 127.0.0.1 with bounded loops and timeouts.

Covered here: a broken stderr (defect 1), endless and slow request heads, idle connections and
too many of them (2), cross-site requests and DNS rebinding (3), the same seed giving the same
answer (5), prompts refused by cheap bounds before rendering (8), and the smaller items of (9)
that concern the server (a lone surrogate, an empty API key).
"""

from __future__ import annotations

import resource
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_server import CTX, LISTENING_RE, STARTUP_S, ServerProcess, _env, _free_port, _health_until_ready  # noqa: E402

READ_TIMEOUT_S = 2
CHAT = {"messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module")
def server(offline_models, tmp_path_factory):
    """The demo pair with speculation, no API key (the default), short read deadline, one extra host name."""
    srv = ServerProcess(tmp_path_factory.mktemp("hostile-home"), "--read-timeout", str(READ_TIMEOUT_S),
                        "--allow-host", "models.lan", "--cors", "http://ui.example")
    srv.wait_ready()
    yield srv
    rc = srv.terminate()
    assert rc == 0, srv.stderr


def _port(srv) -> int:
    return int(srv.url.rsplit(":", 1)[1])


# ---------------------------------------------------------------------------------------------
# Defect 1: a broken stderr


def _serve_with_stderr_closed(tmp_path, close_after_listening: bool):
    port = _free_port()
    argv = [sys.executable, "-m", "specrun", "serve", "--port", str(port), "--ctx-size", str(CTX), "--no-spec",
            "--threads", "1"]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=_env(tmp_path))
    if close_after_listening:
        deadline = time.monotonic() + STARTUP_S
        for line in proc.stderr:  # ends when the server exits
            if LISTENING_RE.search(line) or time.monotonic() > deadline:
                break
    proc.stderr.close()  # like `specrun serve 2>&1 | grep -m1 listening`
    return proc, f"http://127.0.0.1:{port}"


@pytest.mark.parametrize("when", ["after listening", "while loading"])
def test_a_closed_stderr_never_stops_the_answers(offline_models, tmp_path, when):
    proc, url = _serve_with_stderr_closed(tmp_path, close_after_listening=(when == "after listening"))
    try:
        _health_until_ready(url, proc)
        for _ in range(3):  # every answer writes a log line to the broken stderr
            reply = httpx.post(url + "/v1/chat/completions", json=CHAT, timeout=60)
            assert reply.status_code == 200, reply.text
        health = httpx.get(url + "/health", timeout=10)
        assert health.status_code == 200 and health.json() == {"status": "ok", "queued": 0}
    finally:
        proc.terminate()
        proc.wait(60)


def test_health_says_when_the_worker_is_gone():
    from fastapi.testclient import TestClient

    from specrun.server.app import ServerSettings, create_app

    class DeadWorker:
        state, model, queued, alive = "ready", None, 0, False

    with TestClient(create_app(DeadWorker(), ServerSettings()), base_url="http://127.0.0.1") as http:
        response = http.get("/health")
    assert response.status_code == 503 and response.json() == {"status": "worker stopped"}
