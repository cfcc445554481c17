"""Load test for `specrun serve` on loopback, and its overhead against in-process generation.

    python scripts/bench_server.py [--requests 200] [--concurrency 4] [--max-tokens 64] [--json]
                                   [--ctx-size 2048] [--threads N] [--target ...] [--draft ...] [--no-spec]

Starts a server (`python -m specrun serve --port 0`) with the given model options, warms it up,
then sends --requests streamed chat requests from --concurrency clients (the built-in bench
prompts, round robin, greedy). Reports requests/s and generated tokens/s overall, p50/p95 time to
the first piece of text and to the last, and the server's RSS after warm-up and after the load.

Overhead: the same prompts, one at a time, through the server and then in this process with the
same Runtime code `specrun generate` uses (the server idles meanwhile); tokens/s of each, counting
the whole request (prefill + decode) as the user waits for it, and whether the texts agree.
Run it on a quiet machine: other processes on the cores make every figure noise.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
LISTENING_RE = re.compile(r"listening on (http://\S+)")
WARMUP_REQUESTS = 8


def main() -> None:
    args = _parse_args()
    from specrun.experiments.workloads import WORKLOADS

    prompts = WORKLOADS["chat"]

    server = ServerProcess(args)
    try:
        url = server.url
        _load(url, prompts, WARMUP_REQUESTS, args.concurrency, args.max_tokens)
        rss_before = _rss_mb(server.proc.pid)
        t0 = time.perf_counter()
        results = _load(url, prompts, args.requests, args.concurrency, args.max_tokens)
        wall = time.perf_counter() - t0
        rss_after = _rss_mb(server.proc.pid)
        served = _one_by_one(url, prompts, args.max_tokens)
    finally:
        server.stop()
    local = _in_process(args, prompts)
    report = _report(args, results, wall, rss_before, rss_after, served, local)
    print(json.dumps(report, indent=2) if args.json else _summary(report))


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--ctx-size", type=int, default=2048)
    parser.add_argument("--threads", type=int, help="CPU threads for llama.cpp (default: all cores)")
    parser.add_argument("--target")
    parser.add_argument("--draft")
    parser.add_argument("--no-spec", action="store_true")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    return parser.parse_args()


def _model_args(args) -> list[str]:
    out = ["--ctx-size", str(args.ctx_size)]
    if args.threads:
        out += ["--threads", str(args.threads)]
    if args.target:
        out += ["--target", args.target]
    if args.draft:
        out += ["--draft", args.draft]
    if args.no_spec:
        out.append("--no-spec")
    return out


# ---------------------------------------------------------------------------------------------
# The server process


class ServerProcess:
    def __init__(self, args):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
                   NO_COLOR="1")
        argv = [sys.executable, "-m", "specrun", "serve", "--port", "0", *_model_args(args)]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
        self.url = self._wait_listening()
        # Keep draining stderr (one line per request) so the pipe never fills up.
        threading.Thread(target=lambda: [None for _ in self.proc.stderr], daemon=True).start()

    def _wait_listening(self) -> str:
        for line in self.proc.stderr:
            sys.stderr.write(line)
            match = LISTENING_RE.search(line)
            if match:
                return match.group(1)
        raise SystemExit(f"the server exited ({self.proc.wait()}) before listening")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)


def _rss_mb(pid: int) -> float:
    """Return a process's resident memory in MB (Linux /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


# ---------------------------------------------------------------------------------------------
# Requests


def _stream_one(http: httpx.Client, prompt: str, max_tokens: int) -> dict:
    """Send one streamed greedy chat request; return its latencies, tokens and text."""
    return stream_chat(http, {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                              "temperature": 0})


def stream_chat(http: httpx.Client, body: dict) -> dict:
    """Send one chat request (`body`), streamed with usage; return the time to its first piece of
    text and to its last (ttft, ttlt), its generated tokens and its text."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = None
    parts, usage = [], {}
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", ()):
                text = choice.get("delta", {}).get("content")
                if text:
                    first = first or time.perf_counter()
                    parts.append(text)
    last = time.perf_counter()
    return {"ttft": (first or last) - t0, "ttlt": last - t0, "tokens": usage.get("completion_tokens", 0),
            "text": "".join(parts)}


def _load(url: str, prompts: list[str], n: int, concurrency: int, max_tokens: int) -> list[dict]:
    """Send n requests from `concurrency` clients at once; return each request's figures."""
    local = threading.local()

    def one(i: int) -> dict:
        if not hasattr(local, "http"):
            local.http = httpx.Client(base_url=url, timeout=600)
        return _stream_one(local.http, prompts[i % len(prompts)], max_tokens)

    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, range(n)))


def _one_by_one(url: str, prompts: list[str], max_tokens: int) -> dict:
    with httpx.Client(base_url=url, timeout=600) as http:
        results = [_stream_one(http, p, max_tokens) for p in prompts]
    seconds = sum(r["ttlt"] for r in results)
    tokens = sum(r["tokens"] for r in results)
    return {"tokens_per_s": tokens / seconds if seconds else 0.0, "texts": [r["text"] for r in results]}


def _in_process(args, prompts: list[str]) -> dict:
    """Generate the same prompts with the code `specrun generate` runs, timing each whole call."""
    from specrun.runtime.plan import RunOptions
    from specrun.runtime.request import Request, run_request
    from specrun.runtime.runtime import Runtime

    opts = RunOptions(target=args.target, draft=args.draft, ctx_size=args.ctx_size, threads=args.threads,
                      no_spec=args.no_spec, quiet=True)
    request = Request(max_tokens=args.max_tokens, temperature=0.0, chat=True)
    with Runtime(opts) as rt:
        run_request(rt, request, prompts[0])  # warm-up, as the server had
        seconds, tokens, texts = 0.0, 0, []
        for prompt in prompts:
            t0 = time.perf_counter()
            result = run_request(rt, request, prompt)
            seconds += time.perf_counter() - t0
            tokens += len(result.tokens)
            texts.append(result.text)
    return {"tokens_per_s": tokens / seconds if seconds else 0.0, "texts": texts}


# ---------------------------------------------------------------------------------------------
# Report


def _percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1] if len(values) > 1 else values[0]


def _report(args, results, wall, rss_before, rss_after, served, local) -> dict:
    ttft = [r["ttft"] for r in results]
    ttlt = [r["ttlt"] for r in results]
    tokens = sum(r["tokens"] for r in results)
    return {
        "requests": len(results),
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "wall_s": round(wall, 2),
        "requests_per_s": round(len(results) / wall, 3),
        "tokens_per_s": round(tokens / wall, 2),
        "ttft_p50_s": round(_percentile(ttft, 50), 3),
        "ttft_p95_s": round(_percentile(ttft, 95), 3),
        "ttlt_p50_s": round(_percentile(ttlt, 50), 3),
        "ttlt_p95_s": round(_percentile(ttlt, 95), 3),
        "rss_after_warmup_mb": round(rss_before, 1),
        "rss_after_load_mb": round(rss_after, 1),
        "rss_growth_mb": round(rss_after - rss_before, 1),
        "served_tokens_per_s": round(served["tokens_per_s"], 2),
        "in_process_tokens_per_s": round(local["tokens_per_s"], 2),
        "server_overhead": round(1 - served["tokens_per_s"] / local["tokens_per_s"], 4) if local["tokens_per_s"] else None,
        "same_text": served["texts"] == local["texts"],
    }


def _summary(r: dict) -> str:
    return "\n".join([
        f"{r['requests']} requests from {r['concurrency']} clients, {r['max_tokens']} tokens max, in {r['wall_s']} s: "
        f"{r['requests_per_s']} requests/s, {r['tokens_per_s']} tokens/s",
        f"time to first token: p50 {r['ttft_p50_s']} s, p95 {r['ttft_p95_s']} s",
        f"time to last token:  p50 {r['ttlt_p50_s']} s, p95 {r['ttlt_p95_s']} s",
        f"server RSS: {r['rss_after_warmup_mb']} MB after warm-up, {r['rss_after_load_mb']} MB after the load "
        f"({r['rss_growth_mb']:+} MB)",
        f"one request at a time: {r['served_tokens_per_s']} tokens/s through the server, "
        f"{r['in_process_tokens_per_s']} in process (overhead {r['server_overhead']:.1%}); "
        f"same text: {'yes' if r['same_text'] else 'NO'}",
    ])


if __name__ == "__main__":
    main()
