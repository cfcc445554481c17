"""`specrun serve`: bind the port, load the pair in the worker thread, serve until Ctrl-C or SIGTERM.

Order of events: missing model files are fetched first, in the foreground (progress bars, Ctrl-C
works as in every other command); then the port is bound, so a port in use is a one-line error
before anything is loaded; then the worker thread loads the models while the HTTP server already
answers /health with {"status": "loading"} (503) and the /v1 routes with a 503 "still loading".
"listening on http://HOST:PORT" is printed once the models are loaded and requests get answers.

Stopping: the first Ctrl-C or SIGTERM cancels the answer in progress (it ends at its next decoder
step), refuses queued requests with a 503, stops accepting connections and releases the port; the
process exits with status 0.
"""

from __future__ import annotations

import ipaddress
import signal
import socket
from dataclasses import replace

import uvicorn

from specrun import engine, ui
from specrun.chat.reasoning import ChatSettings
from specrun.errors import UsageError
from specrun.runtime.model_files import resolve_models
from specrun.runtime.plan import RunOptions
from specrun.runtime.runtime import options_as_loaded
from specrun.server.app import ServerSettings, create_app
from specrun.server.connections import connection_limit, guarded_protocol
from specrun.server.heap import bound_malloc_arenas
from specrun.server.isolated import IsolatedWorker
from specrun.server.worker import GenerationWorker, QueueWorker

# How long a stopping server waits for answers to wind up before it closes their connections.
GRACEFUL_STOP_S = 10
LISTEN_BACKLOG = 128
# An idle connection is closed this long after its last answer (clients reconnect as needed).
KEEP_ALIVE_S = 5


def serve(opts: RunOptions, host: str, port: int, settings: ServerSettings, queue_size: int,
          chat: ChatSettings = ChatSettings()) -> None:
    """Serve the pair until stopped; raise the load error when the models could not be loaded."""
    if not _is_loopback(host) and not settings.api_key:
        ui.warn(f"listening on {host} without an API key: anyone who can reach this machine can use it "
                "(set --api-key or SPECRUN_API_KEY)")
    # Every request reproducible: the runtime loads a draft only where greedy chains measure as
    # one-token passes (RunOptions.reproducible), and nothing it will not load is fetched.
    opts = replace(opts, reproducible=settings.reproducible)
    resolve_models(options_as_loaded(opts))  # fetches what is missing, before the port is taken
    bound_malloc_arenas()
    sock = _bind(host, port)
    url = f"http://{_url_host(host)}:{sock.getsockname()[1]}"
    server: StoppingServer | None = None

    def on_ready(worker: QueueWorker, description: str) -> None:
        ui.dim(description)
        ui.info(f"listening on {url}")

    def on_load_error(error: BaseException) -> None:
        if server is not None:
            server.should_exit = True

    if settings.reproducible and opts.parallel != 1 and not engine.kv_quantized(opts.kv_type):
        ui.warn("--reproducible beside other requests: an f16 KV cache rounds a prompt of 64 tokens or more, or a "
                "cache past 511 cells, by where its cells sit; --kv-type q8_0 does not, --parallel 1 neither "
                "(docs/exactness.md)")
    if opts.rpc:  # a lost RPC worker ends the process that loaded the target: not this one
        worker = IsolatedWorker(opts, queue_size, on_ready, on_load_error, chat, settings.verbose,
                                settings.reproducible)
    else:
        worker = GenerationWorker(opts, queue_size, on_ready, on_load_error, chat, settings.reproducible)
    config = uvicorn.Config(
        create_app(worker, settings), lifespan="off", log_config=None, access_log=False, log_level="warning",
        timeout_graceful_shutdown=GRACEFUL_STOP_S, server_header=False,
        http=guarded_protocol(settings.read_timeout_s, connection_limit()), timeout_keep_alive=KEEP_ALIVE_S,
    )
    server = StoppingServer(config, worker)
    previous = _ignore_late_signals()
    try:
        worker.start()
        server.run(sockets=[sock])
    finally:
        worker.stop()
        worker.join()
        sock.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if worker.load_error is not None:
        raise worker.load_error


class StoppingServer(uvicorn.Server):
    """uvicorn's server, which also tells the worker to end the answer in progress on Ctrl-C or
    SIGTERM (uvicorn alone would wait for a streamed answer to run to its end)."""

    def __init__(self, config: uvicorn.Config, worker: QueueWorker):
        super().__init__(config)
        self.worker = worker

    def handle_exit(self, sig, frame) -> None:
        self.worker.stop()
        super().handle_exit(sig, frame)


def _ignore_late_signals() -> dict:
    """Install no-op SIGINT/SIGTERM handlers; return the previous ones.

    uvicorn re-raises the signal that stopped it once it has shut down, meant for the default
    handlers (which would kill the process with status 143 or raise KeyboardInterrupt). The server
    has already stopped cleanly by then, so the re-raised signal is dropped and the exit status is 0.
    """
    return {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}


def _bind(host: str, port: int) -> socket.socket:
    """Return a listening socket on host:port (port 0: a free one), or raise a one-line error."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise UsageError(f"cannot listen on {host}: {e.strerror}") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(LISTEN_BACKLOG)
    except OSError as e:
        sock.close()
        raise UsageError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    return sock


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
