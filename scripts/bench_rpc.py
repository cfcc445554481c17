"""The target over RPC workers behind an emulated network: plain, default and tuned tokens/s.

    python scripts/bench_rpc.py [--pair demo] [--pair gemma] [--workers 1] [--workers 2]
                                [--latency-ms 0 0.5 2 5] [--bandwidth-mbit 1000] [--max-tokens 64]
                                [--workload all] [--head auto|workers|here] [--quick] [--no-tune] [--llama-bin DIR]
                                [--llama-modes "server plain,speculative-simple"] [--draft-max 3 8 16] [--json]

For each pair, number of local RPC workers (`specrun worker` on 127.0.0.1) and one-way latency,
the target's layers are spread over the workers through a delay proxy (userspace: each direction
of each connection delivers its bytes the set latency after they arrived, no faster than the
bandwidth cap): `specrun bench --json` gives plain tokens/s and the default's (the drafter a run
uses untuned); `specrun tune` (with --quick: its quick form) then stores a profile for exactly
that setting (a profiles folder of its own), and `specrun bench` again gives the tuned default's,
with the tree tune picked. With --llama-bin (a llama.cpp build with -DGGML_RPC=ON holding
llama-speculative-simple and llama-server), llama.cpp's draft-model speculation and its n-gram
modes run on the same workers and proxies, on the same prompts.

Timings mean nothing on a busy machine: run it with nothing else on the cores. A short check that
it runs end to end: --pair demo --workers 1 --latency-ms 2 --max-tokens 16 --workload chat --no-tune.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PAIRS = {"demo": ("smollm2-135m-f32", "smollm2-135m-q4"), "gemma": ("gemma3-270m-f32", "gemma3-270m-q4")}
CHUNK = 1 << 16
LLAMA_MODES = ("server plain", "server draft", "server ngram-mod", "server ngram-simple", "speculative-simple")
WORKER_START_S = 60.0


# ---------------------------------------------------------------------------------------------
# The delay proxy


class LoopbackProxy:
    """Listens on a free loopback port and forwards each connection to `upstream`, as `_forward`
    says (a thread or two of its own for each)."""

    def __init__(self, upstream: tuple[str, int]):
        self.upstream = upstream
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.upstream)
            except OSError:
                client.close()
                continue
            for sock in (client, server):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._forward(client, server)

    def _forward(self, client: socket.socket, server: socket.socket) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self._listener.close()


class DelayProxy(LoopbackProxy):
    """Forwards each connection to `upstream`, every byte delivered `delay_s` after it arrived and
    no faster than `bytes_per_s` (per direction)."""

    def __init__(self, upstream: tuple[str, int], delay_s: float, bytes_per_s: float):
        self.delay_s, self.bytes_per_s = delay_s, bytes_per_s
        super().__init__(upstream)

    def _forward(self, client: socket.socket, server: socket.socket) -> None:
        self._pipe(client, server)
        self._pipe(server, client)

    def _pipe(self, source: socket.socket, sink: socket.socket) -> None:
        """Start one direction: a reader stamping chunks as they arrive, a writer delivering them."""
        chunks: queue.Queue = queue.Queue()

        def read() -> None:
            while True:
                try:
                    data = source.recv(CHUNK)
                except OSError:
                    data = b""
                chunks.put((time.perf_counter(), data))
                if not data:
                    return

        def write() -> None:
            free_at = 0.0  # when the emulated link has sent everything before this chunk
            while True:
                arrived, data = chunks.get()
                if not data:
                    _close(sink)
                    return
                # Sent once the link has carried it, received the delay after: a payload takes
                # its size over the bandwidth on top of the latency, as on a wire. (Delivering at
                # the later of the two hid up to delay x bandwidth bytes in the latency: 6 MiB at
                # 50 ms and 1 Gbit/s, a 33-token pass's rows of logits for the demo pair.)
                free_at = max(free_at, arrived) + len(data) / self.bytes_per_s
                _sleep_until(free_at + self.delay_s)
                try:
                    sink.sendall(data)
                except OSError:
                    _close(source)
                    return

        threading.Thread(target=read, daemon=True).start()
        threading.Thread(target=write, daemon=True).start()


def _sleep_until(deadline: float) -> None:
    """Sleep to the deadline, spinning its last 0.2 ms (a sleep alone overshoots by tens of µs)."""
    while True:
        left = deadline - time.perf_counter()
        if left <= 0:
            return
        time.sleep(left - 2e-4 if left > 3e-4 else 0)


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


# ---------------------------------------------------------------------------------------------
# Workers and runs


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def _worker(threads: int):
    """Yield the port of a `specrun worker` on 127.0.0.1, stopped afterwards."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "specrun", "worker", "--port", str(port), "--threads", str(threads)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=_env(), cwd=REPO)
    deadline = time.monotonic() + WORKER_START_S
    try:
        for line in proc.stderr:
            if "specrun worker: serving" in line:
                break
            if time.monotonic() > deadline:
                raise RuntimeError("the worker did not start")
        else:
            raise RuntimeError(f"the worker did not start (exit {proc.wait()})")
        threading.Thread(target=proc.stderr.read, daemon=True).start()  # keep its pipe drained
        yield port
    finally:
        proc.terminate()
        proc.wait(30)


def _env(**extra: str) -> dict:
    env = dict(os.environ, NO_COLOR="1", **extra)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def _specrun(args: list[str], env: dict) -> str:
    result = subprocess.run([sys.executable, "-m", "specrun", *args], capture_output=True, text=True, env=env,
                            cwd=REPO, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"specrun {' '.join(args)} failed:\n{result.stderr[-2000:]}")
    return result.stdout


def _bench(pair: tuple[str, str], rpc: str, args, env: dict) -> list[dict]:
    out = _specrun(["bench", "--json", "--target", pair[0], "--draft", pair[1], "--rpc", rpc, "--threads",
                    str(args.threads), "--max-tokens", str(args.max_tokens), "--workload", args.workload,
                    "--head", args.head], env)
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def _summary(rows: list[dict]) -> dict:
    """{workload: {"plain": tok/s, "default": tok/s, "default_mode": mode, "tree": text}}."""
    found: dict[str, dict] = {}
    for row in rows:
        entry = found.setdefault(row["workload"], {})
        if row["mode"] == "plain":
            entry["plain"] = row["tokens_per_s"]
        if row.get("default"):
            entry.update(default=row["tokens_per_s"], default_mode=row["mode"], tree=row["tree"],
                         identical=row["identical_output"])
    return found


def _tuned(pair: tuple[str, str], rpc: str, args, env: dict) -> tuple[dict, dict]:
    """Tune for this setting; return (bench summary with the profile, tune's stored choice)."""
    tune = ["tune", "--json", "--target", pair[0], "--draft", pair[1], "--rpc", rpc, "--threads", str(args.threads),
            "--head", args.head]
    _specrun(tune + (["--quick"] if args.quick else []), env)
    shown = json.loads(_specrun(["tune", "--show", "--json", "--target", pair[0], "--draft", pair[1], "--rpc", rpc,
                                 "--threads", str(args.threads), "--head", args.head], env))
    return _summary(_bench(pair, rpc, args, env)), shown


def _tree_choice(profile: dict) -> str:
    """The tree a stored profile picks (and the best tree it measured), as short text."""
    from specrun.tuning.report import config_text

    config, best = profile["config"], profile.get("best_tree") or {}
    stored = "no draft-model tree" if config["kind"] == "plain" else config_text(config)
    measured = f"; best tree measured: {config_text(best)}" if best and best.get("kind") not in (None, "plain") else ""
    return stored + measured


# ---------------------------------------------------------------------------------------------
# llama.cpp's own speculation on the same workers


def _llama_runs(llama_bin: Path, pair: tuple[str, str], rpc: str, args, env: dict) -> dict:
    """{run: {workload: tokens/s}} of llama.cpp on the same prompts as specrun's bench, through the
    model's chat template: its server plain, with the draft model and with two n-gram modes, and
    llama-speculative-simple (draft model) on the prompts the server rendered."""
    from specrun.experiments.workloads import workload_prompts
    from specrun.models import hub, registry

    target, draft = (str(hub.ensure_local(registry.resolve(name), progress=False)) for name in pair)
    prompts = workload_prompts(args.workload, None)
    runs: dict[str, dict] = {}
    rendered: dict[str, list[str]] = {}
    for name, spec in (("server plain", []), ("server draft", ["-md", draft, "-ngld", "0", "--spec-type", "draft-simple"]),
                       ("server ngram-mod", ["--spec-type", "ngram-mod"]),
                       ("server ngram-simple", ["--spec-type", "ngram-simple"])):
        if spec and name not in args.llama_modes:
            continue  # (server plain always runs: it renders the prompts llama-speculative-simple reads)
        runs[name] = _server_speeds(llama_bin, target, rpc, spec, prompts, args, rendered if not spec else None)
    if "speculative-simple" in args.llama_modes:
        for n_max in args.draft_max:  # (its best is the one to beat: 3 by default, 16 paid most at 50 ms)
            runs[f"speculative-simple n{n_max}"] = {
                workload: _rate([_speculative_simple(llama_bin, target, draft, rpc, text, args, n_max) for text in texts])
                for workload, texts in rendered.items()}
    return runs


def _rate(runs: list[tuple[int, float] | None]) -> float | None:
    """Tokens/s over all runs of (tokens, seconds); None when any failed."""
    if not runs or any(run is None for run in runs):
        return None
    return sum(n for n, _ in runs) / max(1e-9, sum(s for _, s in runs))


def _speculative_simple(llama_bin: Path, target: str, draft: str, rpc: str, prompt: str,
                        args, n_max: int) -> tuple[int, float] | None:
    from specrun import sysinfo

    cmd = [str(llama_bin / "llama-speculative-simple"), "-m", target, "-md", draft, "--rpc", rpc, "-ngl", "99",
           "-ngld", "0", "--spec-type", "draft-simple", "-t", str(args.threads), "-n", str(args.max_tokens),
           "-p", prompt, "--temp", "0", "--spec-draft-n-max", str(n_max),
           *(["--no-repack"] if sysinfo.repacking_crashes() else [])]
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    match = re.search(r"decoded +(\d+) tokens in +([\d.]+) seconds", result.stderr + result.stdout)
    return (int(match.group(1)), float(match.group(2))) if match else None


def _server_speeds(llama_bin: Path, target: str, rpc: str, spec: list[str], prompts: dict[str, list[str]], args,
                   rendered: dict[str, list[str]] | None) -> dict[str, float | None]:
    """{workload: tokens/s} of llama-server answering each prompt as a chat (greedy, no prompt
    cache); `rendered`, when given, receives each prompt as the chat template rendered it."""
    import httpx

    port = _free_port()
    cmd = [str(llama_bin / "llama-server"), "-m", target, "--rpc", rpc, "-ngl", "99", "-t", str(args.threads),
           "--port", str(port), "-c", "4096", "-np", "1", *spec]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    speeds: dict[str, float | None] = {}
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        first = next(iter(prompts.values()))[0]
        _chat(url, first, 8)  # warm-up
        for workload, texts in prompts.items():
            runs = [_chat(url, text, args.max_tokens) for text in texts]
            speeds[workload] = _rate(runs)
            if rendered is not None:
                rendered[workload] = [httpx.post(url + "/apply-template", json={"messages": _messages(text)},
                                                 timeout=60).json()["prompt"] for text in texts]
    except httpx.HTTPError:
        pass
    finally:
        proc.terminate()
        proc.wait(30)
    return speeds


def _messages(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def _chat(url: str, text: str, max_tokens: int) -> tuple[int, float] | None:
    """(tokens generated, seconds generating them) of one greedy chat answer, by the server's timings."""
    import httpx

    body = {"messages": _messages(text), "max_tokens": max_tokens, "temperature": 0, "cache_prompt": False}
    timings = httpx.post(url + "/v1/chat/completions", json=body, timeout=600).json().get("timings") or {}
    if not timings.get("predicted_n"):
        return None
    return timings["predicted_n"], timings["predicted_ms"] / 1e3


# ---------------------------------------------------------------------------------------------


def main() -> None:
    args = _parse_args()
    results = []
    for pair_name in args.pair:
        pair = PAIRS[pair_name]
        for n_workers in args.workers:
            with ExitStack() as stack:
                ports = [stack.enter_context(_worker(args.worker_threads)) for _ in range(n_workers)]
                for latency_ms in args.latency_ms:
                    proxies = [DelayProxy(("127.0.0.1", port), latency_ms / 1e3, args.bandwidth_mbit * 1e6 / 8)
                               for port in ports]
                    rpc = ",".join(f"127.0.0.1:{p.port}" for p in proxies)
                    try:
                        results.append(_measure(pair_name, pair, n_workers, latency_ms, rpc, args))
                    finally:
                        for proxy in proxies:
                            proxy.close()
                    _report_one(results[-1], args.json)
    if args.json:
        print(json.dumps(results, indent=1))


def _measure(pair_name: str, pair: tuple[str, str], n_workers: int, latency_ms: float, rpc: str, args) -> dict:
    with tempfile.TemporaryDirectory(prefix="specrun-rpc-profiles-") as profiles:
        env = _env(SPECRUN_PROFILES=profiles)  # each setting tunes for itself
        result = {"pair": pair_name, "workers": n_workers, "latency_ms": latency_ms, "bandwidth_mbit": args.bandwidth_mbit,
                  "head": args.head,
                  "untuned": _summary(_bench(pair, rpc, args, env))}
        if not args.no_tune:
            result["tuned"], profile = _tuned(pair, rpc, args, env)
            result["tune_choice"] = _tree_choice(profile)
            # tune's own figures: per workload its prediction and its held-out measurement
            result["tune_workloads"] = profile.get("workloads", {})
        if args.llama_bin:
            result["llama.cpp"] = _llama_runs(args.llama_bin, pair, rpc, args, env)
    return result


def _report_one(result: dict, as_json: bool) -> None:
    out = sys.stderr if as_json else sys.stdout
    head = (f"{result['pair']:>5} · {result['workers']} worker(s) · {result['latency_ms']:g} ms one way · "
            f"{result['bandwidth_mbit']:g} Mbit/s · head {result['head']}")
    for workload, row in result["untuned"].items():
        tuned = result.get("tuned", {}).get(workload, {})
        llama = {name: speeds.get(workload) for name, speeds in result.get("llama.cpp", {}).items()}
        line = (f"{head} · {workload:>8}: plain {row.get('plain', 0):6.2f} tok/s · default {row.get('default', 0):6.2f}"
                f" ({row.get('default_mode')})")
        if tuned:
            line += f" · tuned {tuned.get('default', 0):6.2f} ({tuned.get('default_mode')}: {tuned.get('tree')})"
        if llama:
            line += " · llama.cpp " + ", ".join(f"{name} {'failed' if v is None else f'{v:.2f}'}"
                                                for name, v in llama.items())
        print(line, file=out, flush=True)


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", action="append", choices=sorted(PAIRS), help="demo, gemma (repeatable; default both)")
    parser.add_argument("--workers", action="append", type=int, help="local RPC workers (repeatable; default 1 and 2)")
    parser.add_argument("--latency-ms", nargs="+", type=float, default=[0, 0.5, 2, 5], help="one-way delays to emulate")
    parser.add_argument("--bandwidth-mbit", type=float, default=1000, help="each direction's cap, Mbit/s")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--workload", default="all", help="chat, code, rewrite or all")
    parser.add_argument("--threads", type=int, default=1, help="threads of the process that runs the model")
    parser.add_argument("--worker-threads", type=int, default=1, help="threads of each worker")
    parser.add_argument("--head", choices=["auto", "workers", "here"], default="auto",
                        help="where specrun's runs compute the target's output layer (specrun's --head; llama.cpp's runs keep theirs)")
    parser.add_argument("--quick", action="store_true", help="tune --quick")
    parser.add_argument("--no-tune", action="store_true", help="plain and default only")
    parser.add_argument("--llama-bin", type=Path, help="a llama.cpp build with RPC: its llama-speculative-simple and llama-server")
    parser.add_argument("--llama-modes", default=",".join(LLAMA_MODES),
                        help="llama.cpp's runs, comma-separated (server plain always runs)")
    parser.add_argument("--draft-max", nargs="+", type=int, default=[3, 8, 16],
                        help="llama-speculative-simple's --spec-draft-n-max values to run (its default is 3)")
    parser.add_argument("--json", action="store_true", help="all results as one JSON array on stdout")
    args = parser.parse_args()
    args.pair = args.pair or ["demo", "gemma"]
    args.workers = args.workers or [1, 2]
    args.llama_modes = {mode.strip() for mode in args.llama_modes.split(",")}
    if args.llama_modes - set(LLAMA_MODES):
        parser.error(f"unknown llama.cpp mode(s): {', '.join(sorted(args.llama_modes - set(LLAMA_MODES)))}")
    return args


if __name__ == "__main__":
    main()
