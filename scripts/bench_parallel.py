"""Several clients at once: `specrun serve --parallel` against one request at a time and llama-server.

    python scripts/bench_parallel.py [--clients 1,2,4,8] [--requests 2] [--max-tokens 64] [--ctx-size 2048]
                                     [--target ...] [--draft ...] [--peer-bin LLAMA_CPP/build/bin]
                                     [--servers specrun-1,specrun-N,peer-draft,peer-ngram] [--rounds 1] [--json]

Each server is started in turn on the same model files (specrun's --target/--draft, by default the
demo pair), warmed up, then driven by 1, 2, 4 and 8 clients at once; each client sends --requests
streamed greedy requests, every prompt a different one, mixed: a chat question, a code edit, and a
chat question whose answer must follow a JSON schema (response_format). Reported per server and
client count: the aggregate generated tokens/s, each request's own tokens/s (median), and the time
to its first token (p50, p95). Answers of specrun with several requests at once are checked
against the same prompts answered one at a time.

Servers: `specrun-1` is `specrun serve --parallel 1` (one request at a time), `specrun-N` is
`--parallel N` with N the most clients (either with `-plain`: --no-spec, plain decoding; `-throughput`:
--throughput, prompts evaluated in the passes of the other requests' steps; any of them with
`-split` and then `-fa-off` last: --kv-split, a KV cache per request as llama-server's slots,
and --flash-attn off); `base-1`,
`base-N`, `base-N-plain` are the same from the checkout --baseline names (`git worktree add
/tmp/base HEAD~1`), to measure a change in turns with its parent; `peer-plain` is llama.cpp's `llama-server -np N`
decoding plainly (requests batched together, no speculation), `peer-draft` the same with the
same draft model, `peer-ngram` with its `ngram-mod` drafts, each with a `-fa-off` suffix adding `-fa off`
(all of them need --peer-bin, llama.cpp built
from the pinned sources: `cmake -B build -DLLAMA_CURL=OFF -DGGML_NATIVE=ON -DCMAKE_BUILD_TYPE=Release
&& cmake --build build -j2 --target llama-server`). --rounds repeats the whole sweep, servers in
turn, so slow drifts of the machine show. Run it on a quiet machine.

With --latency-ms L every server runs its target on one `specrun worker` on this machine behind
bench_rpc.py's delay proxy (L ms one way, --bandwidth-mbit): specrun's `--rpc`, llama-server's
`--rpc` with every layer there (llama.cpp built with -DGGML_RPC=ON).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench_server import stream_chat  # noqa: E402  (scripts/, beside this one)
LISTENING_RE = re.compile(r"listening on (http://\S+)")
ANSWER_SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 200},
                                                  "confident": {"type": "boolean"}},
                 "required": ["answer", "confident"], "additionalProperties": False}


def main() -> None:
    args = _parse_args()
    if args.latency_ms is None:
        return _sweep(args)
    # The target on a worker behind bench_rpc's delay proxy (its output layer where each server
    # puts it by default), every server through the same worker in turn.
    from bench_rpc import DelayProxy, _worker  # (scripts/, beside this one)

    with _worker(args.worker_threads) as port:
        proxy = DelayProxy(("127.0.0.1", port), args.latency_ms / 1e3, args.bandwidth_mbit * 1e6 / 8)
        try:
            args.rpc = f"127.0.0.1:{proxy.port}"
            _sweep(args)
        finally:
            proxy.close()


def _sweep(args) -> None:
    clients = [int(c) for c in args.clients.split(",")]
    # Every request of a sweep a prompt of its own (a repeated prompt is drafted from its earlier
    # answer): the warm-up's first, then each row's.
    work = _requests(2 + sum(clients) * args.requests)
    rows = []
    for round_ in range(args.rounds):
        for name in args.servers.split(","):
            server = _start(name, args, max(clients))
            if server is None:
                continue
            try:
                _drive(server.url, work[:2], 2, args.max_tokens)  # warm-up
                start = 2
                for n in clients:
                    t0 = time.perf_counter()
                    results = _drive(server.url, work[start: start + n * args.requests], n, args.max_tokens)
                    for r in results:
                        r["index"] += start
                    start += n * args.requests
                    rows.append(_row(name, n, round_, results, time.perf_counter() - t0))
                    print(_line(rows[-1]), file=sys.stderr, flush=True)
            except httpx.HTTPError as e:  # a server that fails or dies: said, and the sweep goes on
                rows.append({"server": name, "clients": n if "n" in locals() else 0, "round": round_,
                             "failed": f"{type(e).__name__}: {e}; exit code {server.proc.poll()}; "
                                       + " | ".join(server.last_lines[-3:])})
                print(f"{name}: {rows[-1]['failed']}", *server.last_lines, sep="\n", file=sys.stderr, flush=True)
            finally:
                server.stop()
    _check_same(rows)
    print(json.dumps(rows, indent=2) if args.json else _table(rows))


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", default="1,2,4,8")
    parser.add_argument("--requests", type=int, default=2, help="requests each client sends, one after the other")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--ctx-size", type=int, default=2048, help="tokens one request may hold")
    parser.add_argument("--threads", type=int)
    parser.add_argument("--target", default="smollm2-135m-f32")
    parser.add_argument("--draft", default="smollm2-135m-q4")
    parser.add_argument("--peer-bin", type=Path, help="llama.cpp's build/bin, with llama-server")
    parser.add_argument("--servers", default="specrun-1,specrun-N,peer-plain,peer-draft,peer-ngram")
    parser.add_argument("--baseline", type=Path, help="another checkout of specrun (an earlier commit): the servers "
                        "base-1, base-N and base-N-plain run its code, to compare with this one's in turns")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--latency-ms", type=float, help="the target on a worker this far away one way (bench_rpc.py's "
                        "delay proxy), for every server: specrun's and llama-server's --rpc")
    parser.add_argument("--bandwidth-mbit", type=float, default=1000, help="the link's speed, with --latency-ms")
    parser.add_argument("--worker-threads", type=int, default=1, help="the worker's threads, with --latency-ms")
    return parser.parse_args()


# ---------------------------------------------------------------------------------------------
# Requests: every prompt a different one, three kinds mixed


def _requests(n: int) -> list[dict]:
    from specrun.experiments.workloads import WORKLOADS

    chat, code = WORKLOADS["chat"], WORKLOADS["code"]
    out = []
    for i in range(n):
        kind = ("chat", "code", "json")[i % 3]
        if kind == "code":
            body = {"messages": [{"role": "user", "content": code[i % len(code)]}]}
        else:
            body = {"messages": [{"role": "user", "content": chat[(i + 16) % len(chat) if kind == "json" else i % len(chat)]}]}
        if kind == "json":
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA, "strict": True}}
        out.append({"kind": kind, "body": body})
    return out


def _stream(http: httpx.Client, request: dict, max_tokens: int) -> dict:
    result = stream_chat(http, {**request["body"], "model": "m", "max_tokens": max_tokens, "temperature": 0})
    return {**result, "kind": request["kind"]}


def _drive(url: str, work: list[dict], clients: int, max_tokens: int) -> list[dict]:
    """`clients` clients at once, each sending its share of `work` one request after the other."""
    def client(c: int) -> list[dict]:
        # A connection per request (llama-server closes idle ones, which a reused one meets as an error).
        with httpx.Client(base_url=url, timeout=900, headers={"Connection": "close"}) as http:
            return [_stream(http, work[i], max_tokens) | {"index": i} for i in range(c, len(work), clients)]

    with ThreadPoolExecutor(clients) as pool:
        return [r for rs in pool.map(client, range(clients)) for r in rs]


def _percentile(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def _row(name: str, clients: int, round_: int, results: list[dict], wall: float) -> dict:
    tokens = sum(r["tokens"] for r in results)
    return {
        "server": name, "clients": clients, "round": round_, "requests": len(results),
        "tokens_per_s": round(tokens / wall, 2),
        "request_tokens_per_s_p50": round(statistics.median(r["tokens"] / r["ttlt"] for r in results), 2),
        "ttft_p50_s": round(_percentile([r["ttft"] for r in results], 50), 3),
        "ttft_p95_s": round(_percentile([r["ttft"] for r in results], 95), 3),
        "latency_p95_s": round(_percentile([r["ttlt"] for r in results], 95), 3),  # a whole answer's
        "texts": {r["index"]: r["text"] for r in results},
    }


def _check_same(rows: list[dict]) -> None:
    """Mark specrun's rows whose answers differ from those specrun gives one at a time (the same
    decoding: speculative or plain) for the same prompts: a specrun-1 server's, or any specrun
    server's with one client."""
    alone: dict[tuple[bool, bool], dict] = {}
    for row in rows:
        one_at_a_time = row["server"].startswith("specrun-1") or row["clients"] == 1
        if row["server"].startswith("specrun") and one_at_a_time and "texts" in row:
            alone.setdefault(_decoding(row["server"]), {}).update(row["texts"])
    for row in rows:
        reference = alone.get(_decoding(row["server"]), {})
        if row["server"].startswith("specrun") and reference and "texts" in row:
            row["parted"] = sum(i in reference and reference[i] != text for i, text in row["texts"].items())
            row["same_as_alone"] = row["parted"] == 0
            for i, text in row["texts"].items():
                if reference.get(i, text) != text:
                    _say_where_they_part(row, i, reference[i], text)
    for row in rows:
        row.pop("texts", None)


def _say_where_they_part(row: dict, index: int, alone: str, together: str) -> None:
    """Print on stderr where an answer given beside others parts from the one given alone (a
    near-tie of the target's two best tokens rounds either way in batches of other sizes:
    docs/exactness.md)."""
    at = next((k for k, (a, b) in enumerate(zip(alone, together)) if a != b), min(len(alone), len(together)))
    print(f"{row['server']} {row['clients']} clients, round {row['round']}: request {index} parts from its answer "
          f"alone after {at} characters: {alone[max(0, at - 40):at]!r} then alone {alone[at:at + 30]!r}, "
          f"beside others {together[at:at + 30]!r}", file=sys.stderr)


def _line(row: dict) -> str:
    return (f"{row['server']:<11} {row['clients']} clients: {row['tokens_per_s']:7.1f} tokens/s in all, "
            f"{row['request_tokens_per_s_p50']:6.1f} per request (p50), first token p50 {row['ttft_p50_s']:.2f} s, "
            f"p95 {row['ttft_p95_s']:.2f} s, whole answer p95 {row['latency_p95_s']:.2f} s")


def _table(rows: list[dict]) -> str:
    lines = ["| server | clients | tokens/s in all | per request (p50) | first token p50 / p95 s | answer p95 s | same as alone |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "failed" in r:
            lines.append(f"| {r['server']} | {r['clients']} | failed: {r['failed'][:120]} | | | | |")
            continue
        same = {True: "yes", False: f"NO ({r.get('parted')} of {r['requests']} parted)"}.get(r.get("same_as_alone"), "")
        lines.append(f"| {r['server']} | {r['clients']} | {r['tokens_per_s']} | {r['request_tokens_per_s_p50']} | "
                     f"{r['ttft_p50_s']} / {r['ttft_p95_s']} | {r['latency_p95_s']} | {same} |")
    return "\n".join(lines + _against_best(rows))


def _against_best(rows: list[dict]) -> list[str]:
    """Per round and client count: llama-server's best mode (plain included) and each specrun
    server's tokens/s in all against it, the comparison a user makes."""
    out = []
    for key in sorted({(r["round"], r["clients"]) for r in rows if "failed" not in r}):
        here = [r for r in rows if "failed" not in r and (r["round"], r["clients"]) == key]
        peers = [r for r in here if r["server"].startswith("peer")]
        if not peers:
            continue
        best = max(peers, key=lambda r: r["tokens_per_s"])
        ours = ", ".join(f"{r['server']} {r['tokens_per_s'] / best['tokens_per_s']:.2f}x" for r in here
                         if not r["server"].startswith("peer"))
        out.append(f"round {key[0]}, {key[1]} clients: llama-server's best is {best['server']} "
                   f"({best['tokens_per_s']} tokens/s); {ours}")
    return [""] + out if out else []


# ---------------------------------------------------------------------------------------------
# Servers


class _Server:
    def __init__(self, argv: list[str], env: dict | None = None, url: str | None = None, cwd: Path | None = None):
        # `cwd`: a checkout's own root, so `python -m specrun` imports its code (the working
        # directory comes first on sys.path, before PYTHONPATH).
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
                                     cwd=cwd)
        self.last_lines: list[str] = []
        self.url = url or self._listening()
        threading.Thread(target=self._drain, daemon=True).start()
        if url is not None:
            self._healthy()

    def _drain(self) -> None:
        for line in self.proc.stderr:
            self.last_lines = [*self.last_lines[-20:], line.rstrip()]

    def _listening(self) -> str:
        for line in self.proc.stderr:
            match = LISTENING_RE.search(line)
            if match:
                return match.group(1)
        raise SystemExit(f"the server exited ({self.proc.wait()}) before listening")

    def _healthy(self) -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None:
                raise SystemExit(f"llama-server exited ({self.proc.returncode})")
            time.sleep(0.5)
        raise SystemExit("llama-server did not become healthy")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(60)


def _options(server: str) -> tuple[str, bool, bool]:
    """A specrun server's name without its last options, and whether it has them: `-split`
    (--kv-split), then `-fa-off` (--flash-attn off)."""
    fa_off = server.endswith("-fa-off")
    server = server.removesuffix("-fa-off")
    return server.removesuffix("-split"), server.endswith("-split"), fa_off


def _decoding(server: str) -> tuple[bool, bool, bool]:
    """What a specrun server's answers are compared within: plain decoding or not, a cache per
    request or one, flash attention off or not (each rounds otherwise, so their answers one at a
    time may differ)."""
    base, split, fa_off = _options(server)
    return base.endswith("-plain"), split, fa_off


def _start(name: str, args, parallel: int) -> _Server | None:
    if name.startswith(("specrun", "base")):
        if name.startswith("base") and args.baseline is None:
            print(f"{name}: skipped (no --baseline)", file=sys.stderr)
            return None
        n = 1 if name.split("-")[1] == "1" else parallel
        repo = args.baseline if name.startswith("base") else REPO
        return specrun_server(repo, args, n, name)
    if args.peer_bin is None:
        print(f"{name}: skipped (no --peer-bin)", file=sys.stderr)
        return None
    from specrun import sysinfo
    from specrun.runtime.model_files import resolve_models
    from specrun.runtime.plan import RunOptions

    files = resolve_models(RunOptions(target=args.target, draft=args.draft, quiet=True))
    target, draft = files.target_path, files.draft_path
    port = _free_port()
    argv = [str(args.peer_bin / "llama-server"), "-m", str(target), "--port", str(port), "-np", str(parallel),
            "-c", str(args.ctx_size * parallel), "-t", str(args.threads or os.cpu_count()), "--no-webui",
            *(["--no-repack"] if sysinfo.repacking_crashes() else []),
            *(["--rpc", args.rpc, "-ngl", "99"] if getattr(args, "rpc", None) else [])]
    mode = name.removesuffix("-fa-off")
    if mode == "peer-plain":
        pass  # llama-server's plain decoding: requests batched together, no speculation
    elif mode == "peer-draft":
        argv += ["-md", str(draft), "--spec-draft-n-max", "5"]
    elif mode == "peer-ngram":
        argv += ["--spec-type", "ngram-mod"]
    return _Server(argv + (["-fa", "off"] if mode != name else []), url=f"http://127.0.0.1:{port}")


def specrun_server(repo: Path, args, parallel: int, name: str = "specrun") -> _Server:
    """`specrun serve` of the checkout `repo` (this one, or a --baseline) on args' models, context
    and threads, `parallel` requests at once; the server's `name` says the rest: `-plain` with
    --no-spec, `-throughput` with --throughput, either with `-split` (--kv-split) and then `-fa-off`
    (--flash-attn off) last."""
    base, split, fa_off = _options(name)
    plain, throughput = base.endswith("-plain"), base.endswith("-throughput")
    extra = (*(["--kv-split"] if split else []), *(["--flash-attn", "off"] if fa_off else []))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")])),
               NO_COLOR="1")
    argv = [sys.executable, "-m", "specrun", "serve", "--port", "0", "--ctx-size", str(args.ctx_size),
            "--target", args.target, "--draft", args.draft, "--parallel", str(parallel),
            *(["--threads", str(args.threads)] if args.threads else []), *(["--no-spec"] if plain else []),
            *(["--throughput"] if throughput else []), *(["--rpc", args.rpc] if getattr(args, "rpc", None) else []), *extra]
    return _Server(argv, env, cwd=repo)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


if __name__ == "__main__":
    main()
