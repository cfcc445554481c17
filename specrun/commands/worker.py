"""`specrun worker`: serve this machine's devices to another machine's specrun (`--rpc HOST:PORT`)
over llama.cpp's RPC protocol, until Ctrl-C or SIGTERM.

llama.cpp's server loop never returns to Python, so it runs in a thread of its own while the main
thread waits for Ctrl-C; the process then ends at once (a C loop cannot be asked to stop).
"""

from __future__ import annotations

import ipaddress
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

from specrun import engine, paths, ui
from specrun.engine import rpc
from specrun.engine.backend import last_llama_error
from specrun.errors import SpecrunError, UsageError
from specrun.files import human_size

NO_AUTHENTICATION = ("the RPC protocol has no authentication and no encryption: anyone who reaches this port can "
                     "run code on these devices and read what they hold; never let it face an untrusted network")
# How long llama.cpp has to start listening before the worker says it could not.
LISTEN_WAIT_S = 30.0


def worker(host: str, port: int, threads: int | None, device_names: list[str], cache: bool = False) -> None:
    """Serve the chosen devices (default: the accelerators, else the CPU) on host:port; with
    `cache`, keep the weights clients send (paths.worker_cache_dir) for their next loads."""
    _check_address(host, port)
    rpc.check_rpc_build()
    devices = rpc.worker_devices(device_names)
    endpoint = f"{host}:{port}"
    folder = _cache_folder() if cache else None
    ui.warn(NO_AUTHENTICATION if host == "127.0.0.1" else
            f"listening on {host}, not only this machine: {NO_AUTHENTICATION}")
    # llama.cpp prints its progress on stdout; this command writes no text of its own there.
    sys.stdout.flush()
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    server = threading.Thread(target=rpc.serve_devices, name="specrun-rpc-worker", daemon=True,
                              args=(endpoint, [dev for _, dev in devices], threads or engine.default_threads(), folder))
    server.start()
    _wait_listening(server, host, port)
    names = ", ".join(name for name, _ in devices)
    ui.info(f"specrun worker: serving {names} on {endpoint}: use it with --rpc {_client_address(host)}:{port} "
            "(Ctrl-C stops it)")
    if folder is not None:
        ui.dim(f"specrun worker: keeping the weights clients send in {folder} ({_size(folder)} so far; "
               "a model loaded again sends only their hashes; delete the folder to free the space)")
    signal.signal(signal.SIGTERM, _stop)
    try:
        while server.is_alive():
            server.join(0.5)
    except KeyboardInterrupt:
        ui.dim("specrun worker: stopped")
        _exit_now(0)
    raise SpecrunError(f"the RPC worker on {endpoint} stopped: {last_llama_error('llama.cpp ended it')}")


def _cache_folder() -> Path:
    """The folder the weights are kept in, created; SpecrunError where it cannot be."""
    folder = paths.worker_cache_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SpecrunError(f"cannot keep the weights in {folder}: {e.strerror or e}") from None
    return folder


def _size(folder: Path) -> str:
    """What the files in `folder` hold, in words."""
    return human_size(sum(entry.stat().st_size for entry in folder.iterdir() if entry.is_file()))


def _stop(signum, frame) -> None:
    raise KeyboardInterrupt  # SIGTERM stops the worker as Ctrl-C does


def _check_address(host: str, port: int) -> None:
    """UsageError unless llama.cpp can listen on host:port (an IPv4 address, a free port)."""
    try:
        ipaddress.IPv4Address(host)
    except ValueError:
        raise UsageError(f"--host {host!r}: the worker listens on an IPv4 address, e.g. 127.0.0.1 or 0.0.0.0") from None
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as llama.cpp binds
        try:
            probe.bind((host, port))
        except OSError as e:
            raise UsageError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def _wait_listening(server: threading.Thread, host: str, port: int) -> None:
    """Return once llama.cpp accepts connections on the port; SpecrunError if it gave up."""
    deadline = time.monotonic() + LISTEN_WAIT_S
    while server.is_alive() and time.monotonic() < deadline:
        try:
            socket.create_connection((_client_address(host), port), timeout=1.0).close()
            return
        except OSError:
            time.sleep(0.05)
    raise SpecrunError(f"the RPC worker could not listen on {host}:{port}: "
                       f"{last_llama_error('llama.cpp did not say why')}")


def _client_address(host: str) -> str:
    """Return the address this machine reaches the worker at (a wildcard means every address)."""
    return "127.0.0.1" if host == "0.0.0.0" else host


def _exit_now(status: int) -> None:
    """End the process without running interpreter shutdown under the C server thread."""
    sys.stderr.flush()
    os._exit(status)
