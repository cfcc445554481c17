"""The same greedy request, run again and again beside other load: how many answers are identical?

Each run is a fresh `specrun generate` process; the runs rotate over three loads: nothing else,
two `yes` processes, and another specrun decoding (a plain `generate` of its own prompt in a loop, on
one thread: two llama.cpp processes whose threads all spin at their barriers slow each other 10-100x
on a 2-core machine, and a run must finish).
For each request kind it prints how many of the runs gave the first run's answer, and how many gave
plain decoding's (a `--no-spec` run on a quiet machine).

    python scripts/bench_reproducible.py                      # 20 runs per kind, the demo pair
    python scripts/bench_reproducible.py --runs 6 --kinds reproducible default
    python scripts/bench_reproducible.py --target smollm2-135m-q4 --kv-type q8_0 --kinds jsonl-parallel
    python scripts/bench_reproducible.py --target smollm2-135m-q4 --draft smollm2-135m-q4 --kv-type q8_0 --kv-split

Kinds: `default` (generate as it runs untuned), `reproducible` (generate --reproducible),
`jsonl-parallel` (the same request as one line of two in generate --jsonl --parallel 2, the other
line a different prompt), `jsonl-parallel-reproducible` (that line with "reproducible": true),
`serve-4` (a fresh `specrun serve --parallel 4` per run, the request sent as a chat completion at
the same moment as three other clients' different ones), `serve-4-reproducible` (that request with
"reproducible": true). A server's answer is compared as text (plain decoding's is generate's).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

PROMPT = "Explain in a few sentences why the sky is blue, and why sunsets are red."
OTHER = "List five animals that live in the sea, with one fact about each."
LOADS = ("idle", "two yes", "another specrun")
KINDS = ("default", "reproducible", "jsonl-parallel", "jsonl-parallel-reproducible", "serve-4", "serve-4-reproducible")
OTHERS = ("Write a short poem about autumn leaves.", "What are the main causes of inflation?",
          "Describe how a bicycle gear system works.")


# Every measured run's threads wait at llama.cpp's barriers without spinning (OpenMP's passive
# policy, under every load alike): a spinning thread whose partner lost its core to the load holds
# its own core for nothing, and runs took minutes. How threads wait changes no number computed.
ENV = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}


def specrun(*args: str, stdin: str | None = None) -> str:
    done = subprocess.run([sys.executable, "-m", "specrun", *args], input=stdin, capture_output=True, text=True,
                          timeout=900, env=ENV)
    if done.returncode:
        raise SystemExit(f"specrun {' '.join(args)} failed: {done.stderr[-2000:]}")
    return done.stdout


def answer(kind: str, common: list[str], max_tokens: int, shared: tuple[str, ...] = ()) -> list[int] | str:
    if kind.startswith("serve"):
        return served(kind.endswith("reproducible"), [*common, *shared], max_tokens)
    if kind in ("default", "reproducible"):
        flags = ["--reproducible"] if kind == "reproducible" else []
        out = specrun("generate", PROMPT, "--json", "--max-tokens", str(max_tokens), *flags, *common)
        return json.loads(out)["token_ids"]
    line = {"prompt": PROMPT, "max_tokens": max_tokens, "id": "probe"}
    if kind.endswith("reproducible"):
        line["reproducible"] = True
    lines = [json.dumps({"prompt": OTHER, "max_tokens": max_tokens, "id": "other"}), json.dumps(line)]
    out = specrun("generate", "--jsonl", "--parallel", "2", *common, *shared, stdin="\n".join(lines) + "\n")
    results = [json.loads(row) for row in out.splitlines() if row.strip()]
    return next(r["token_ids"] for r in results if r.get("id") == "probe")


def served(reproducible: bool, common: list[str], max_tokens: int) -> str:
    """The request's answer from a fresh `serve --parallel 4`, sent beside three other clients'."""
    import re
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    server = subprocess.Popen([sys.executable, "-m", "specrun", "serve", "--port", "0", "--parallel", "4", *common],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        url = next((m.group(1) for line in server.stderr if (m := re.search(r"listening on (http://\S+)", line))), None)
        if url is None:
            raise SystemExit(f"specrun serve exited ({server.wait()}) before listening")
        threading.Thread(target=lambda: [None for _ in server.stderr], daemon=True).start()

        def ask(prompt: str, pinned: bool) -> str:
            body = {"model": "m", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                    "temperature": 0, **({"reproducible": True} if pinned else {})}
            reply = httpx.post(url + "/v1/chat/completions", json=body, timeout=900)
            reply.raise_for_status()
            return reply.json()["choices"][0]["message"]["content"]

        with ThreadPoolExecutor(4) as pool:
            probe = pool.submit(ask, PROMPT, reproducible)
            for other in OTHERS:
                pool.submit(ask, other, False)
            return probe.result()
    finally:
        server.terminate()
        server.wait(60)


def start_load(load: str, common: list[str]) -> list[subprocess.Popen]:
    if load == "two yes":
        return [subprocess.Popen(["yes"], stdout=subprocess.DEVNULL) for _ in range(2)]
    if load == "another specrun":
        loop = (f"while true; do {sys.executable} -m specrun generate --no-spec --max-tokens 64 --threads 1 "
                f"{' '.join(common)} 'Tell me a story about a lighthouse.' >/dev/null 2>&1; done")
        return [subprocess.Popen(["bash", "-c", loop], start_new_session=True)]
    return []


def stop_load(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        try:
            os.killpg(process.pid, 15) if process.args[0] == "bash" else process.terminate()
        except ProcessLookupError:
            pass
        process.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--budget", type=int, default=None, help="a fixed tree size (default: as a run chooses)")
    parser.add_argument("--target", default=None)
    parser.add_argument("--draft", default=None)
    parser.add_argument("--kv-type", default=None, help="the target's KV cache cells (plain decoding's too)")
    parser.add_argument("--kv-split", action="store_true", help="a KV cache per request where requests share passes")
    args = parser.parse_args()
    models = [*(["--target", args.target] if args.target else []), *(["--draft", args.draft] if args.draft else []),
              *(["--kv-type", args.kv_type] if args.kv_type else [])]
    common = models + (["--budget", str(args.budget)] if args.budget else [])
    reference = json.loads(specrun("generate", PROMPT, "--json", "--no-spec", "--max-tokens", str(args.max_tokens),
                                   *models))
    print(f"| request kind | runs | identical to the first run | identical to plain decoding | "
          f"identical to plain, per load ({', '.join(LOADS)}) |")
    print("|---|---|---|---|---|")
    for kind in args.kinds:
        answers, t0 = [], time.monotonic()
        for i in range(args.runs):
            load = start_load(LOADS[i % len(LOADS)], common)
            try:
                answers.append(answer(kind, common, args.max_tokens, ("--kv-split",) if args.kv_split else ()))
            finally:
                stop_load(load)
        first = sum(a == answers[0] for a in answers)
        plain = reference["text"] if kind.startswith("serve") else reference["token_ids"]
        same_as_plain = sum(a == plain for a in answers)
        per_load = []
        for j in range(len(LOADS)):
            mine = answers[j :: len(LOADS)]
            per_load.append(f"{sum(a == plain for a in mine)}/{len(mine)}")
        print(f"| {kind} | {args.runs} | {first}/{args.runs} | {same_as_plain}/{args.runs} | {', '.join(per_load)} |",
              flush=True)
        print(f"  ({time.monotonic() - t0:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
