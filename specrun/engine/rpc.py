"""llama.cpp's RPC backend: other machines' devices as places for the target's layers, and the
worker that serves this machine's devices to another.

A worker (`specrun worker`, or llama.cpp's own ggml-rpc-server) serves its devices over TCP to
one client at a time. `connect(endpoints)` adds each worker's devices beside this machine's
(engine.devices lists them, with the worker's address as their host); only a model loaded with
`across_hosts` (the target) places layers there: the draft stays on this machine.

llama.cpp's RPC client aborts the whole process when a worker's connection breaks (ggml-rpc.cpp:
RPC_STATUS_ASSERT, GGML_ABORT), from its dispatcher thread, mid-pass. Once connected, ggml's abort
callback turns that into one line naming the worker that went away, handed to `on_lost_worker`'s
handler (by default: written to stderr) before the process ends: nothing can resume the pass.
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from specrun import ui
from specrun.engine.backend import last_llama_error
from specrun.engine.devices import (
    InitParams,
    add_remote_devices,
    device_by_name,
    ggml_lib,
    local_devices,
    remote_hosts,
)
from specrun.errors import EngineError, SpecrunError, UsageError
from specrun.limits import RPC_DEFAULT_PORT

log = logging.getLogger("specrun")

# The install line of a llama-cpp-python built with the RPC backend (pip's cache may hold a wheel
# built without it, hence --no-cache-dir).
RPC_INSTALL = 'CMAKE_ARGS="-DGGML_RPC=on" pip install --force-reinstall --no-cache-dir "llama-cpp-python>=0.3.36,<0.4"'
# How long a worker has to answer a hello (a worker busy with another client does not answer).
HELLO_TIMEOUT_S = 5.0
# How long a worker that went away has to accept a connection before it is named as gone, and
# how long its port is watched for closing after its connection broke.
LOST_PROBE_TIMEOUT_S = 1.0
LOST_PROBE_WINDOW_S = 2.0
# The exit status of a process whose worker went away mid-pass (llama.cpp cannot go on).
LOST_WORKER_EXIT = 1
# A worker whose machine vanishes (power, cable) sends no reset, and llama.cpp would wait for its
# answer for ever: TCP keepalive probes on llama.cpp's connection to it notice within about
# KEEPALIVE_IDLE_S + KEEPALIVE_COUNT * KEEPALIVE_INTERVAL_S (the machine's kernel answers them,
# however long a pass computes), and data left unacknowledged for UNACKED_TIMEOUT_S ends it too;
# the pass then fails as for a worker that was killed.
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_COUNT = 10, 5, 3
UNACKED_TIMEOUT_S = 30

# The hello every client opens with (ggml-rpc.cpp): command 14, its size, then transport
# capabilities (RPC_CONN_CAPS_SIZE bytes, all zero: plain TCP). The answer: its size, the protocol
# version (major, minor, patch, padding) and the worker's capabilities.
_RPC_CMD_HELLO = 14
_RPC_CONN_CAPS_SIZE = 24
_HELLO_REPLY_SIZE = 4 + _RPC_CONN_CAPS_SIZE

_ENDPOINT = re.compile(r"^([A-Za-z0-9._-]+):(\d{1,5})$")


def parse_endpoints(specs: str | Sequence[str]) -> tuple[str, ...]:
    """Return the workers' "HOST:PORT" endpoints from "HOST:PORT[,HOST:PORT...]" (or several such
    strings); UsageError for anything llama.cpp could not connect to."""
    texts = [specs] if isinstance(specs, str) else list(specs)
    endpoints: list[str] = []
    for part in (p.strip() for text in texts for p in text.split(",")):
        match = _ENDPOINT.match(part)
        if not match or not 0 < int(match.group(2)) < 65536:
            raise UsageError(f"--rpc {part!r}: expected HOST:PORT (e.g. 192.168.1.20:{RPC_DEFAULT_PORT}); "
                             "several are separated by commas")
        if part not in endpoints:
            endpoints.append(part)
    if not endpoints:
        raise UsageError(f"--rpc: expected HOST:PORT (e.g. 192.168.1.20:{RPC_DEFAULT_PORT})")
    return tuple(endpoints)


def split_endpoint(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":")
    return host, int(port)


# ---------------------------------------------------------------------------------------------
# Reaching a worker


def hello(endpoint: str, timeout: float = HELLO_TIMEOUT_S) -> float:
    """Return the seconds one round trip to the worker takes (its hello); raise SpecrunError
    naming it where it is not there, busy with another client, or not a worker of this version."""
    host, port = split_endpoint(endpoint)
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except OSError as e:
        raise SpecrunError(f"cannot reach the RPC worker at {endpoint}: {_reason(e)} "
                           "(is `specrun worker` running there?)") from None
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        start = time.perf_counter()
        sock.sendall(struct.pack("<BQ", _RPC_CMD_HELLO, _RPC_CONN_CAPS_SIZE) + bytes(_RPC_CONN_CAPS_SIZE))
        reply = _receive(sock, 8 + _HELLO_REPLY_SIZE)
        seconds = time.perf_counter() - start
    except TimeoutError:
        # Reset rather than close: the worker must not answer into a closed connection later.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        raise SpecrunError(f"the RPC worker at {endpoint} does not answer within {timeout:g} s: a worker serves "
                           "one client at a time (is another run using it?)") from None
    except OSError as e:
        raise SpecrunError(f"the RPC worker at {endpoint} broke the connection: {_reason(e)}") from None
    finally:
        sock.close()
    if reply is None or struct.unpack_from("<Q", reply)[0] != _HELLO_REPLY_SIZE:
        raise SpecrunError(f"{endpoint} does not answer as an RPC worker of this llama.cpp version "
                           "(run the same llama-cpp-python on both machines)")
    return seconds


def _receive(sock: socket.socket, size: int) -> bytes | None:
    """Return exactly `size` bytes, or None if the peer closed first."""
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def _reason(error: OSError) -> str:
    if isinstance(error, ConnectionRefusedError):
        return "connection refused"
    if isinstance(error, TimeoutError):
        return "no answer"
    return error.strerror or str(error)


def unreachable(endpoints: Sequence[str], timeout: float = LOST_PROBE_TIMEOUT_S) -> dict[str, str]:
    """Return {endpoint: why} for the workers that do not accept a connection now. (Only a
    connection, nothing sent: a worker busy with this process still accepts one.)"""
    gone = {}
    for endpoint in endpoints:
        try:
            socket.create_connection(split_endpoint(endpoint), timeout=timeout).close()
        except OSError as e:
            gone[endpoint] = _reason(e)
    return gone


# ---------------------------------------------------------------------------------------------
# The client side


def _rpc_function(name: str, restype, *argtypes):
    """Return one of the RPC backend's functions (through its registry entry, however it was
    built into the library); SpecrunError naming the install line where the build has none."""
    lib = ggml_lib()
    reg = lib.ggml_backend_reg_by_name(b"RPC")
    address = lib.ggml_backend_reg_get_proc_address(reg, name.encode()) if reg else None
    if not address:
        raise SpecrunError(f"this llama-cpp-python was built without the RPC backend: reinstall it with {RPC_INSTALL}")
    return ctypes.CFUNCTYPE(restype, *argtypes)(address)


_connected: dict[str, float] = {}  # endpoint: the round trip measured when it was added
_first_device: dict[str, int] = {}  # endpoint: its first device (asked for its memory to time a round trip)
_held_backends: list[int] = []
_lock = threading.Lock()


def connect(endpoints: Sequence[str]) -> None:
    """Add these workers' devices beside this machine's (once per process), after checking that
    each answers; from then on a lost worker ends the process with one line naming it."""
    with _lock:
        new = [e for e in endpoints if e not in _connected]
        if not new:
            return
        add_server = _rpc_function("ggml_backend_rpc_add_server", ctypes.c_void_p, ctypes.c_char_p)
        round_trips = {endpoint: hello(endpoint) for endpoint in new}
        _catch_aborts()
        lib = ggml_lib()
        for endpoint in new:
            reg = add_server(endpoint.encode())
            count = lib.ggml_backend_reg_dev_count(reg) if reg else 0
            if not count:
                raise EngineError(f"the RPC worker at {endpoint} offers no device")
            devices = [lib.ggml_backend_reg_dev_get(reg, i) for i in range(count)]
            # A backend held for the process keeps llama.cpp's one connection to the worker open:
            # loads and passes then reuse it instead of connecting again.
            backend = lib.ggml_backend_dev_init(devices[0], None)
            if not backend:
                raise EngineError(f"the RPC worker at {endpoint}: {last_llama_error('llama.cpp could not open it')}")
            _held_backends.append(backend)
            _keep_alive(endpoint)
            add_remote_devices(endpoint, devices)
            _connected[endpoint] = round_trips[endpoint]
            _first_device[endpoint] = devices[0]
            log.info("RPC worker %s: %d device(s), a round trip takes %.2f ms", endpoint, count,
                     round_trips[endpoint] * 1e3)


def _keep_alive(endpoint: str) -> None:
    """Turn TCP keepalive on for llama.cpp's connections to this worker (found among this
    process's sockets by their peer; where /proc is not there, nothing is done)."""
    host, port = split_endpoint(endpoint)
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_STREAM)}
        descriptors = [int(fd) for fd in os.listdir("/proc/self/fd")]
    except OSError:
        return
    for fd in descriptors:
        try:
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue  # closed meanwhile, or not a socket
        with sock:
            try:
                peer = sock.getpeername()
            except OSError:
                continue
            if sock.family == socket.AF_INET and peer[1] == port and peer[0] in addresses:
                _set_keepalive(sock)


def _set_keepalive(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", KEEPALIVE_IDLE_S), ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
                        ("TCP_KEEPCNT", KEEPALIVE_COUNT), ("TCP_USER_TIMEOUT", UNACKED_TIMEOUT_S * 1000)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def round_trip_s(endpoint: str) -> float | None:
    """Return the round trip to a connected worker, as measured when it was added."""
    return _connected.get(endpoint)


def round_trips_now() -> str:
    """Return each connected worker's round trip timed now, over the connection passes use (a
    memory query), beside the one measured when it was added: "" without workers. Call it
    between passes."""
    lib = ggml_lib()
    free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
    timed = []
    for endpoint, device in _first_device.items():
        start = time.perf_counter()
        lib.ggml_backend_dev_memory(device, ctypes.byref(free), ctypes.byref(total))
        seconds = time.perf_counter() - start
        timed.append(f"{endpoint} {seconds * 1e3:.2f} ms ({_connected[endpoint] * 1e3:.2f} ms when connected)")
    return "RPC round trips now: " + ", ".join(timed) if timed else ""


_fetched: dict[tuple[str, int], float] = {}  # (endpoint, bytes): seconds, as measured once a process


def fetch_s(endpoint: str, sizes: Sequence[int], repeats: int = 2) -> dict[int, float]:
    """Return {bytes: seconds} that reading that many bytes back from a connected worker takes
    (the least of `repeats` reads of a buffer on its first device, over the connection passes
    use: what a pass's results take to come back over this link). Measured once a process per
    size; call it between passes."""
    lib = ggml_lib()
    todo = sorted({size for size in sizes if (endpoint, size) not in _fetched})
    if todo:
        largest = -(-max(todo) // 4) * 4
        ctx = lib.ggml_init(InitParams(1 << 12, None, True))
        tensor = lib.ggml_new_tensor_1d(ctx, 0, largest // 4)  # (GGML_TYPE_F32)
        buffer = lib.ggml_backend_buft_alloc_buffer(lib.ggml_backend_dev_buffer_type(_first_device[endpoint]), largest)
        try:
            if not buffer or lib.ggml_backend_tensor_alloc(buffer, tensor, lib.ggml_backend_buffer_get_base(buffer)):
                raise EngineError(f"the RPC worker at {endpoint} could not hold a buffer of {largest} bytes")
            host = ctypes.create_string_buffer(largest)
            for size in todo:
                timings = []
                for _ in range(repeats):
                    start = time.perf_counter()
                    lib.ggml_backend_tensor_get(tensor, host, 0, size)
                    timings.append(time.perf_counter() - start)
                _fetched[endpoint, size] = min(timings)
        finally:
            if buffer:
                lib.ggml_backend_buffer_free(buffer)
            lib.ggml_free(ctx)
    return {size: _fetched[endpoint, size] for size in sizes}


# ---------------------------------------------------------------------------------------------
# A worker that goes away


def _say_lost(message: str) -> None:
    ui.error(message)


_lost_handler: Callable[[str], None] = _say_lost


def on_lost_worker(handler: Callable[[str], None]) -> None:
    """Make `handler(message)` hear of a worker lost mid-pass, instead of stderr (the process
    still ends right after, with LOST_WORKER_EXIT)."""
    global _lost_handler
    _lost_handler = handler


def lost_worker_message(endpoints: Sequence[str], abort_text: str = "") -> str:
    """Return the one line that says which worker went away: the ones that stop accepting
    connections within LOST_PROBE_WINDOW_S (a killed worker's connection may break a moment before
    its port closes), or the only one; else all of them."""
    deadline = time.monotonic() + LOST_PROBE_WINDOW_S
    gone = unreachable(endpoints)
    while not gone and time.monotonic() < deadline:
        time.sleep(0.05)
        gone = unreachable(endpoints)
    if not gone and len(endpoints) == 1:
        gone = {endpoints[0]: "the connection broke"}
    if gone:
        names = ", ".join(f"{endpoint} ({why})" for endpoint, why in gone.items())
        return f"lost the RPC worker at {names} in the middle of a pass: this answer ends here"
    detail = abort_text.split(": ", 1)[-1].strip() if abort_text else "it stopped answering"
    return f"an RPC worker ({', '.join(endpoints)}) failed in the middle of a pass: {detail}"


_ABORT_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_char_p)


@_ABORT_CALLBACK
def _on_abort(raw: bytes | None) -> None:
    """ggml aborts the process right after this returns. An abort of the RPC client (a worker
    gone, or one that cannot be connected to) is said in one line naming the worker, and the
    process ends here (an abort would print a backtrace and may dump core); any other abort is
    printed as ggml would and goes on."""
    text = (raw or b"").decode("utf-8", errors="replace")
    if "RPC" not in text and "Failed to connect" not in text:
        print(text, file=sys.stderr, flush=True)
        return
    try:
        message = lost_worker_message(remote_hosts(), text)
        sys.stdout.flush()
        _lost_handler(message)
        sys.stderr.flush()
    finally:
        os._exit(LOST_WORKER_EXIT)


def _catch_aborts() -> None:
    lib = ggml_lib()
    lib.ggml_set_abort_callback.argtypes = [_ABORT_CALLBACK]
    lib.ggml_set_abort_callback.restype = ctypes.c_void_p
    lib.ggml_set_abort_callback(_on_abort)


# ---------------------------------------------------------------------------------------------
# The worker side


def worker_devices(names: Sequence[str] = ()) -> list[tuple[str, int]]:
    """Return (name, device) for the devices a worker serves: the ones named, else this machine's
    accelerators, else its CPU (as llama.cpp's own worker chooses)."""
    local = local_devices()
    if names:
        chosen = []
        for name in names:
            device = device_by_name(name)
            if not device:
                known = ", ".join(info.name for info, _ in local)
                raise UsageError(f"--device {name!r}: no such device here (these are: {known})")
            chosen.append((name, device))
        return chosen
    accelerators = [(info.name, ptr) for info, ptr in local if info.kind in ("gpu", "igpu")]
    return accelerators or [(info.name, ptr) for info, ptr in local if info.kind == "cpu"][:1]


def serve_devices(endpoint: str, devices: Sequence[int], threads: int, cache: Path | None = None) -> None:
    """Serve these devices to RPC clients on endpoint ("HOST:PORT"); returns only if llama.cpp
    could not start serving (it says why in its log). `cache`: a folder where llama.cpp keeps
    every weight tensor over 10 MB a client sends, named by its hash: a client that loads the
    same weights again sends the hash (one round trip) instead of the tensor."""
    start_server = _rpc_function("ggml_backend_rpc_start_server", None, ctypes.c_char_p, ctypes.c_char_p,
                                 ctypes.c_size_t, ctypes.c_size_t, ctypes.POINTER(ctypes.c_void_p))
    array = (ctypes.c_void_p * len(devices))(*devices)
    cache_dir = str(cache).encode() if cache is not None else None  # (alive while the server runs)
    start_server(endpoint.encode(), cache_dir, threads, len(devices), array)


def check_rpc_build() -> None:
    """Raise SpecrunError naming the install line where llama.cpp was built without RPC."""
    _rpc_function("ggml_backend_rpc_add_server", ctypes.c_void_p, ctypes.c_char_p)
