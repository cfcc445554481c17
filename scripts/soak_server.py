"""A soak of `specrun serve`: mixed requests from several clients for a while, the server's memory,
threads and open files sampled as it goes.

    python scripts/soak_server.py [--minutes 10] [--clients 6] [--parallel 4] [--sample-s 30]
                                  [--target ...] [--draft ...] [--ctx-size 2048] [--rpc HOST:PORT] [--json]

Starts `specrun serve --parallel N` on the demo pair (or --target/--draft), then each client sends
requests one after the other, every one a prompt of its own (the built-in prompts with a number
that makes them new), in turn: a streamed chat answer, a whole one with log-probs, a JSON-schema
answer, a raw completion, an Ollama chat, a stream the client drops after a few pieces, and a
request the server must refuse (over the context; a field of the wrong type). Every --sample-s
seconds it notes the server's RSS (its anonymous part apart from mapped model pages, and of that,
llama.cpp's buffers apart from the heap), threads and open files. At the end: the samples, the
counts of answers by status, whether any was a 5xx, and whether Ctrl-C stopped the server cleanly
(exit 0). With --rpc the server's target is on that worker (`specrun worker`): the samples are of
the server's own process, which relays the requests to its child's.
A line that keeps rising after the first minutes is a leak; one that levels off is a cache filling
(each sample also says what the memory of earlier answers holds: `/v1/models`' meta.answers_memory).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))
from bench_parallel import ANSWER_SCHEMA, specrun_server  # noqa: E402  (scripts/, beside this one)


def main() -> None:
    args = _parse_args()
    from specrun.experiments.workloads import WORKLOADS

    prompts = [p for kind in ("chat", "code", "rewrite") for p in WORKLOADS[kind]]
    server = specrun_server(REPO, args, args.parallel)
    url, pid = server.url, server.proc.pid
    counter = itertools.count()
    statuses: Counter = Counter()
    lock = threading.Lock()
    stop = time.monotonic() + args.minutes * 60
    samples = [_sample(pid, 0.0, url)]
    t0 = time.monotonic()

    def client(c: int) -> None:
        with httpx.Client(base_url=url, timeout=600) as http:
            while time.monotonic() < stop:
                i = next(counter)
                status = _request(http, i, f"{prompts[i % len(prompts)]} (request {i})", args)
                with lock:
                    statuses[status] += 1

    threads = [threading.Thread(target=client, args=(c,), daemon=True) for c in range(args.clients)]
    for t in threads:
        t.start()
    while time.monotonic() < stop:
        time.sleep(min(args.sample_s, max(0.0, stop - time.monotonic())))
        samples.append(_sample(pid, time.monotonic() - t0, url))
    for t in threads:
        t.join()
    time.sleep(2)
    samples.append(_sample(pid, time.monotonic() - t0, url))  # idle again
    server.proc.send_signal(signal.SIGINT)
    try:
        code = server.proc.wait(60)
    except Exception:
        code = None
        server.proc.kill()
    report = {"requests": sum(statuses.values()), "statuses": dict(statuses),
              "server_errors": sum(n for s, n in statuses.items() if isinstance(s, int) and s >= 500),
              "exit_code_after_ctrl_c": code, "samples": samples}
    print(json.dumps(report, indent=2) if args.json else _table(report))


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10)
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--parallel", type=int, default=4)
    parser.add_argument("--sample-s", type=float, default=30)
    parser.add_argument("--ctx-size", type=int, default=2048)
    parser.add_argument("--threads", type=int)
    parser.add_argument("--target", default="smollm2-135m-f32")
    parser.add_argument("--draft", default="smollm2-135m-q4")
    parser.add_argument("--rpc", help="HOST:PORT of a `specrun worker`: the server's target there (serve --rpc; its "
                        "models then live in a child process, whose memory the samples do not include)")
    parser.add_argument("--json", action="store_true")
    return parser.parse_args()


def _request(http: httpx.Client, i: int, prompt: str, args) -> int | str:
    """Send request i's kind (see the module doc); return its HTTP status ("dropped": a stream left)."""
    kind = i % 7
    chat = {"model": "m", "messages": [{"role": "user", "content": prompt}], "max_tokens": 48, "temperature": 0}
    try:
        if kind == 0:
            with http.stream("POST", "/v1/chat/completions", json={**chat, "stream": True}) as r:
                for _ in r.iter_lines():
                    pass
                return r.status_code
        if kind == 1:
            return http.post("/v1/chat/completions", json={**chat, "logprobs": True, "top_logprobs": 3}).status_code
        if kind == 2:
            schema = {"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER_SCHEMA, "strict": True}}
            return http.post("/v1/chat/completions", json={**chat, "response_format": schema}).status_code
        if kind == 3:
            return http.post("/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 48,
                                                      "temperature": 0.7, "seed": i}).status_code
        if kind == 4:
            body = {"model": "m", "messages": chat["messages"], "stream": False, "options": {"num_predict": 48}}
            return http.post("/api/chat", json=body).status_code
        if kind == 5:
            with http.stream("POST", "/v1/chat/completions", json={**chat, "max_tokens": 200, "stream": True}) as r:
                for n, _ in enumerate(r.iter_lines()):
                    if n >= 3:
                        break  # the client goes away mid-answer
            return "dropped"
        if i % 2:  # refused: a prompt over the context, or a field of the wrong type
            return http.post("/v1/chat/completions", json={**chat, "messages": [
                {"role": "user", "content": "word " * (args.ctx_size * 2)}]}).status_code
        return http.post("/v1/chat/completions", json={**chat, "stream": "yes"}).status_code
    except httpx.HTTPError as e:
        return type(e).__name__


def _sample(pid: int, at_s: float, url: str) -> dict:
    status = {line.split(":")[0]: line.split()[1] for line in Path(f"/proc/{pid}/status").read_text().splitlines()
              if len(line.split()) > 1}
    # RSS in all, and its anonymous part (the heap: malloc's arenas, Python's objects, llama.cpp's
    # buffers) apart from pages of mapped files (the model's weights, read in as they are used).
    rss, anon = int(status["VmRSS"]) / 1024, int(status.get("RssAnon", 0)) / 1024
    threads = int(status["Threads"])
    buffers = _buffers_mib(pid)
    # The memory of earlier answers, which grows (by doubling) up to its bound: /v1/models says it.
    memory = httpx.get(f"{url}/v1/models", timeout=60).json()["data"][0]["meta"].get("answers_memory") or {}
    return {"at_s": round(at_s, 1), "rss_mib": round(rss, 1), "anon_mib": round(anon, 1),
            "buffers_mib": round(buffers, 1), "heap_mib": round(anon - buffers, 1), "threads": threads,
            "open_files": len(os.listdir(f"/proc/{pid}/fd")), "memory_answers": memory.get("answers"),
            "memory_mib": round(memory["bytes"] / 2**20, 1) if memory else None}


# llama.cpp's buffers (KV cache, compute, logits) are single allocations larger than any heap of
# malloc's (64 MiB at most): mapped apart, their pages resident once a pass first touches them.
BUFFER_MIN_MIB = 64


def _buffers_mib(pid: int) -> float:
    """Resident MiB of the process's anonymous mappings larger than BUFFER_MIN_MIB: llama.cpp's
    buffers, whose resident part grows with the largest pass so far (a pass of n outputs touches n
    rows of logits) up to what they were allocated, while the rest of the anonymous RSS is the heap."""
    resident, size = 0.0, 0.0
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = line.split()
        if "-" in head[0] and len(head) >= 5:  # a mapping's first line: its range, then its fields
            low, high = (int(x, 16) for x in head[0].split("-"))
            size = (high - low) / 2**20 if len(head) == 5 else 0.0  # (a path: a mapped file)
        elif head[0] == "Anonymous:" and size > BUFFER_MIN_MIB:
            resident += int(head[1]) / 1024
    return resident


def _table(report: dict) -> str:
    lines = ["| at (s) | RSS (MiB) | of it anonymous | llama.cpp's buffers | the rest (heap) | threads | open files | "
             "memory of answers: answers / MiB |", "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {s['at_s']} | {s['rss_mib']} | {s['anon_mib']} | {s['buffers_mib']} | {s['heap_mib']} | "
              f"{s['threads']} | {s['open_files']} | {s['memory_answers']} / {s['memory_mib']} |"
              for s in report["samples"]]
    lines += ["", f"{report['requests']} requests: {report['statuses']}; 5xx: {report['server_errors']}; "
                  f"exit code after Ctrl-C: {report['exit_code_after_ctrl_c']}"]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
