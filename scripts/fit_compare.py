"""specrun's plan against llama.cpp's own fit (`llama-fit-params`) on emulated cards.

Neither tool needs the weights or a GPU for this: both simulate the load (llama.cpp's no_alloc
path) of a header-only copy of a registry model's published shape (the weights a hole of their
size, models/shapes.py). llama.cpp's fit asks its devices for their free memory, so it is shown the
card as an RPC device: a `specrun worker` on 127.0.0.1 behind a small proxy that passes the RPC
protocol through and answers the device-memory question with the card's size (`CardProxy`).
specrun is shown the card twice: as a local GPU (`--gpu Card=SIZE`), where it keeps room for the
weights llama.cpp copies to a GPU for big-batch matmuls (op offload), and as that same RPC
device (`--rpc`), which runs no op offload, as llama.cpp's fit sees it. Plain decoding
(llama-fit-params knows no draft model); RAM is not the limit for either (llama.cpp's fit does
not weigh it).

For each model and card: the context each picks by default and the layers it puts on the card
(llama.cpp: `-c`, `-ngl`, the layers whose experts it sends to RAM with `-ot`; specrun: `plan
--json`), and specrun's planned device bytes against the card.

    python scripts/fit_compare.py --llama-bin BUILD/bin [--cards 8,12,16,24]
        [--models qwen3.5-27b,gpt-oss-20b,gemma3-27b,qwen3.5-35b-a3b] [--json]

BUILD is the pinned sources built with the RPC backend: in vendor/llama.cpp of the sdist,
`cmake -B build -DGGML_RPC=ON -DLLAMA_CURL=OFF -DCMAKE_BUILD_TYPE=Release && cmake --build build
--target llama-fit-params` (the sdist lacks tools/CMakeLists.txt: one line,
`add_subdirectory(fit-params)`, is enough).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import struct
import subprocess
import sys
import threading
from pathlib import Path

from bench_rpc import LoopbackProxy, _close, _worker

from specrun.models import registry, shapes

GIB = 1024**3
MIB = 1024**2
MODELS = ["qwen3.5-27b", "gpt-oss-20b", "gemma3-27b", "qwen3.5-35b-a3b"]

# The RPC protocol (ggml-rpc.cpp): a request is | command (1 byte) | size (8) | data |, a response
# | size (8) | data |; these commands are answered, the others not.
_ANSWERED = {0, 1, 2, 3, 7, 8, 9, 11, 13, 14, 15}  # ALLOC_BUFFER .. DEVICE_COUNT
_GET_DEVICE_MEMORY = 11


class CardProxy(LoopbackProxy):
    """Passes an RPC connection through to `upstream`, answering the device-memory question with
    `card` bytes free and total."""

    def __init__(self, upstream: tuple[str, int], card: int):
        self.card = card
        super().__init__(upstream)

    def _forward(self, client: socket.socket, server: socket.socket) -> None:
        pending: list[int] = []  # commands sent whose answers are due, in order
        lock = threading.Condition()
        threading.Thread(target=self._requests, args=(client, server, pending, lock), daemon=True).start()
        threading.Thread(target=self._answers, args=(server, client, pending, lock), daemon=True).start()

    @staticmethod
    def _requests(client, server, pending, lock) -> None:
        try:
            while True:
                head = _read(client, 9)
                command, size = head[0], struct.unpack("<Q", head[1:])[0]
                data = _read(client, size)
                if command in _ANSWERED:
                    with lock:
                        pending.append(command)
                        lock.notify()
                server.sendall(head + data)
        except OSError:
            _close(server)  # (shutdown wakes the thread reading it; the server takes one client at a time)

    def _answers(self, server, client, pending, lock) -> None:
        try:
            while True:
                head = _read(server, 8)
                data = _read(server, struct.unpack("<Q", head)[0])
                with lock:
                    lock.wait_for(lambda: pending)
                    command = pending.pop(0)
                if command == _GET_DEVICE_MEMORY and len(data) == 16:
                    data = struct.pack("<QQ", self.card, self.card)
                client.sendall(head + data)
        except OSError:
            _close(client)


def _read(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(min(n - len(out), 1 << 20))
        if not chunk:
            raise OSError("closed")
        out += chunk
    return bytes(out)


def header_copy(alias: str) -> Path:
    spec = registry.resolve(alias)
    if spec.shape is None:
        raise SystemExit(f"{alias}: the registry states no shape for it")
    return shapes.shape_copy(spec.name, spec.shape, spec.quant)


def llama_fit(llama_bin: Path, model: Path, rpc_port: int, margin_mib: int | None = None) -> dict:
    """llama-fit-params' choice on the card behind the proxy: context, layers, expert layers in RAM
    (`margin_mib`: the memory it leaves free on the card, by default its own 1024)."""
    margin = ["-fitt", str(margin_mib)] if margin_mib is not None else []
    run = subprocess.run([str(llama_bin / "llama-fit-params"), "-m", str(model), "--rpc", f"127.0.0.1:{rpc_port}",
                          "-t", "1", *margin], capture_output=True, text=True, timeout=1800)
    found = re.search(r"-c (\d+) -ngl (-?\d+)(.*)", run.stdout)
    if run.returncode != 0 or not found:
        tail = (run.stderr.strip().splitlines() or ["?"])[-1]
        return {"error": tail}
    experts = len(re.findall(r"blk\\\.(\d+)\\\.ffn_", found.group(3)))
    return {"n_ctx": int(found.group(1)), "gpu_layers": int(found.group(2)), "experts_in_ram_layers": experts}


def specrun_plan(model: Path, card_gib: int, rpc_port: int | None = None) -> dict:
    """specrun's plan on the card: a local GPU (`--gpu`), or with `rpc_port` the RPC device behind
    the proxy that llama.cpp's fit is shown (`--rpc`)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    card = ["--rpc", f"127.0.0.1:{rpc_port}"] if rpc_port else ["--gpu", f"Card={card_gib}GiB"]
    run = subprocess.run([sys.executable, "-m", "specrun", "plan", "--json", "--no-spec", "--target", str(model),
                          *card, "--ram-free", "512GiB"],
                         capture_output=True, text=True, timeout=1800, env=env)
    if run.returncode != 0:
        return {"error": (run.stderr.strip().splitlines() or ["?"])[-1]}
    plan = json.loads(run.stdout)
    card = next((d for d in plan["memory"]["breakdown"] if d["name"] != "RAM"), {"total": 0})
    target = plan["target"]
    return {"n_ctx": plan["contexts"]["target"]["n_ctx"], "gpu_layers": target["gpu_layers"],
            "layer_slots": target["layer_slots"], "experts_in_ram_layers": target["experts_in_ram_layers"],
            "card_bytes": card["total"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-bin", type=Path, required=True, help="folder holding llama-fit-params")
    parser.add_argument("--cards", default="8,12,16,24", help="card sizes in GiB")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--fit-margin", type=int, default=None,
                        help="MiB llama.cpp's fit leaves free on the card (-fitt; its default 1024, specrun's 512)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = []
    with _worker(1) as port:
        for alias in args.models.split(","):
            path = header_copy(alias)
            for gib in (int(c) for c in args.cards.split(",")):
                proxy = CardProxy(("127.0.0.1", port), gib * GIB)
                try:
                    peer = llama_fit(args.llama_bin, path, proxy.port, args.fit_margin)
                    ours_rpc = specrun_plan(path, gib, proxy.port)
                finally:
                    proxy.close()
                ours = specrun_plan(path, gib)
                rows.append({"model": alias, "card_gib": gib, "specrun": ours, "specrun_rpc": ours_rpc,
                             "llama_fit": peer})
                if not args.json:
                    print(_line(rows[-1]), file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print("| model | card | specrun context | specrun layers on the card | specrun card use | "
          "specrun over RPC: context | layers | card use | llama.cpp fit context | llama.cpp fit layers |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(_line(row))


def _cells(ours: dict) -> list[str]:
    if "error" in ours:
        return [f"error: {ours['error']}", "", ""]
    experts = f", experts of {ours['experts_in_ram_layers']} in RAM" if ours["experts_in_ram_layers"] else ""
    return [str(ours["n_ctx"]), f"{ours['gpu_layers']}/{ours['layer_slots']}{experts}",
            f"{ours['card_bytes'] / GIB:.1f} GiB"]


def _line(row: dict) -> str:
    peer = row["llama_fit"]
    mine = _cells(row["specrun"]) + _cells(row["specrun_rpc"])
    if "error" in peer:
        theirs = [f"error: {peer['error']}", ""]
    else:
        experts = f", experts of {peer['experts_in_ram_layers']} in RAM" if peer["experts_in_ram_layers"] else ""
        theirs = [str(peer["n_ctx"]), f"{peer['gpu_layers']}{experts}"]
    return "| " + " | ".join([row["model"], f"{row['card_gib']} GiB", *mine, *theirs]) + " |"


if __name__ == "__main__":
    main()
