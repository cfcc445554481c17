"""Agent traces replayed against `specrun serve` and llama-server: what repeated work costs each.

    python scripts/bench_agents.py [--traces tools,refine,siblings,regenerate,shared] [--ctx-size 4096]
                                   [--servers specrun,specrun-plain,peer-plain,peer-ngram-mod,peer-ngram-cache,peer-draft]
                                   [--peer-bin LLAMA_CPP/build/bin] [--baseline CHECKOUT] [--rounds 1] [--turns] [--per-request] [--json]

Five traces this project writes (below, `TRACES`), each a list of conversations sent in order, one
request at a time, greedy, streamed, as an agent or a script sends them:
  tools       a tool-calling loop: a system prompt with a tool list, a task, then 10 turns, each
              answer a JSON tool call (response_format json_schema), each tool's result fed back
              as the next message; the conversation grows every turn
  refine      one function rewritten 6 times, one small change asked per turn
  siblings    20 sibling tasks sent as separate conversations: 10 SQL queries over tables of the
              same schema, 10 JSON records of the same keys for other items
  regenerate  a 3-turn chat whose every answer is asked for twice (a user pressing "regenerate")
  shared      8 tasks sent as separate conversations under one long system prompt (the tool list,
              the rules and the files an agent sends every time, about 1,000 tokens): each prompt
              parts from the one before only at its task
Every assistant answer the server gives is put back into its conversation, as a client does.

Servers, started in turn on the same files (specrun's --target/--draft, by default the demo pair):
`specrun` is `specrun serve` with its defaults, `specrun-plain` the same with --no-spec (plain
decoding: the reference every answer is compared with), `specrun-throughput` with --parallel 2
--throughput (any cached prefix of a prompt reused, not only whole prefill batches: answers may
part at near-ties); a `-fa-off` suffix adds --flash-attn off (`specrun-fa-off`, `specrun-plain-fa-off`); `base` and `base-plain` run the checkout
--baseline names (e.g. `git worktree add /tmp/base <commit>`), to measure a change against its
parent in turns. `peer-*` are llama.cpp's llama-server from --peer-bin (built from the pinned
sources: `cmake -B build -DLLAMA_CURL=OFF -DGGML_NATIVE=ON -DCMAKE_BUILD_TYPE=Release && cmake
--build build -j2 --target llama-server`), one slot, `--cache-reuse 256`: plain, `ngram-mod`,
`ngram-cache`, and the draft model (`peer-draft`); a `-fa-off` suffix adds `-fa off` to them too.

Reported per trace and server: requests, prompt tokens sent and evaluated (sent less what the
server's cache held: its timings' cache_n), completion tokens, the whole trace's wall time as the
agent waits for it (every request's time to its last token), the mean time to first token, decode
tokens/s (the servers' own timings: predicted_n over predicted_ms), and how many answers equal
plain decoding's. `--turns` adds the per-turn figures of the growing conversations (prompt tokens,
evaluated, time to first token), `--per-request` each request's decoding speed (a regenerated answer
against its first, the later siblings against the first ones). Run it on a quiet machine: other processes make every figure noise.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench_parallel import _free_port, _Server, specrun_server  # noqa: E402  (scripts/, beside this one)

# ---------------------------------------------------------------------------------------------
# The traces

TOOLS = [
    {"name": "list_files", "arguments": {"path": "directory to list"}},
    {"name": "read_file", "arguments": {"path": "file to read"}},
    {"name": "search", "arguments": {"pattern": "text to find", "path": "directory to search"}},
    {"name": "run_tests", "arguments": {"path": "test file or directory"}},
    {"name": "write_file", "arguments": {"path": "file to write", "content": "the whole new file"}},
    {"name": "finish", "arguments": {"summary": "what was done"}},
]
TOOL_CALL_SCHEMA = {
    "type": "object",
    "properties": {"thought": {"type": "string", "maxLength": 160},
                   "tool": {"type": "string", "enum": [t["name"] for t in TOOLS]},
                   "path": {"type": "string", "maxLength": 60}},
    "required": ["thought", "tool", "path"], "additionalProperties": False,
}
TOOL_SYSTEM = (
    "You are a coding agent working in a Python repository. Each answer is exactly one tool call, "
    "a JSON object with the keys thought, tool and path. The tools:\n"
    + "\n".join(f"- {t['name']}: " + ", ".join(f"{k} ({v})" for k, v in t["arguments"].items()) for t in TOOLS)
    + "\nCall finish when the task is done."
)
TOOL_TASK = "The test tests/test_totals.py::test_skips_refunds fails. Find the cause and fix it."
TOOL_RESULTS = [
    "list_files(.): README.md  pyproject.toml  shop/  tests/",
    "list_files(shop): __init__.py  orders.py  totals.py  refunds.py",
    "run_tests(tests/test_totals.py): 1 failed, 4 passed. FAILED test_skips_refunds: assert 130 == 100",
    "read_file(tests/test_totals.py):\ndef test_skips_refunds():\n    orders = [Order(100, 'paid'), Order(30, 'refunded')]\n"
    "    assert order_total(orders) == 100",
    "read_file(shop/totals.py):\ndef order_total(orders):\n    total = 0\n    for order in orders:\n"
    "        total += order.amount\n    return total",
    "search(refunded, shop): shop/refunds.py:3: REFUNDED = 'refunded'\nshop/orders.py:12: self.status = status",
    "read_file(shop/refunds.py):\nREFUNDED = 'refunded'\n\ndef is_refund(order):\n    return order.status == REFUNDED",
    "write_file(shop/totals.py): written, 7 lines",
    "run_tests(tests/test_totals.py): 5 passed",
    "run_tests(tests): 31 passed",
]

REFINE_SYSTEM = "You are a coding assistant. Answer with the whole function in one Python code block, nothing else."
REFINE_FUNCTION = '''def summarize(data):
    totals = {}
    for line in data:
        name, amount = line.split(",")
        amount = float(amount)
        if name in totals:
            totals[name] = totals[name] + amount
        else:
            totals[name] = amount
    result = []
    for name in sorted(totals):
        result.append(name + ": " + str(round(totals[name], 2)))
    return result'''
REFINE_ASKS = [
    f"Here is a function:\n\n```python\n{REFINE_FUNCTION}\n```\n\nAdd a docstring to it.",
    "Now also skip blank lines.",
    "Now rename `data` to `lines`.",
    "Now also strip spaces around each name.",
    "Now raise ValueError when an amount is negative.",
    "Now return the list and the grand total as a tuple.",
]

SQL_TASKS = [(region, status, year) for region, status, year in [
    ("europe", "shipped", 2023), ("asia", "paid", 2024), ("africa", "shipped", 2022), ("americas", "returned", 2024),
    ("oceania", "paid", 2023), ("europe", "cancelled", 2024), ("asia", "shipped", 2021), ("africa", "paid", 2024),
    ("americas", "shipped", 2023), ("oceania", "returned", 2022)]]
PRODUCTS = ["desk lamp", "office chair", "coffee grinder", "rain jacket", "trail shoes", "water bottle",
            "bike helmet", "travel mug", "phone stand", "wool scarf"]
RECORD_SCHEMA = {
    "type": "object",
    "properties": {"id": {"type": "integer"}, "name": {"type": "string", "maxLength": 40},
                   "category": {"type": "string", "maxLength": 30}, "price_eur": {"type": "number"},
                   "in_stock": {"type": "boolean"}, "tags": {"type": "array", "items": {"type": "string", "maxLength": 20},
                                                             "maxItems": 3}},
    "required": ["id", "name", "category", "price_eur", "in_stock", "tags"], "additionalProperties": False,
}

REGENERATE_ASKS = [
    "What are three good habits for writing maintainable code? Keep it short.",
    "Which of those matters most in a team of two people, and why?",
    "Give one concrete example of that habit in a Python project.",
]


def _json_format(name: str, schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def _tools_trace() -> list[dict]:
    """One conversation of 10 turns: each turn appends the tool's result (the first: the task)."""
    turns = [{"content": TOOL_TASK}] + [{"content": f"Tool result: {result}"} for result in TOOL_RESULTS[:9]]
    return [{"system": TOOL_SYSTEM, "turns": turns, "max_tokens": 96,
             "response_format": _json_format("tool_call", TOOL_CALL_SCHEMA)}]


def _refine_trace() -> list[dict]:
    return [{"system": REFINE_SYSTEM, "turns": [{"content": ask} for ask in REFINE_ASKS], "max_tokens": 256}]


def _siblings_trace() -> list[dict]:
    sql = [{"turns": [{"content": f"Table orders_{region} has the columns id, customer_id, amount, status, created_at. "
                                  f"Write one SQL query that returns each customer_id with the sum of amount of its "
                                  f"orders whose status is '{status}' and that were created in {year}, largest sum "
                                  f"first. Answer with the query only."}], "max_tokens": 80}
           for region, status, year in SQL_TASKS]
    records = [{"turns": [{"content": f"Give the catalogue record of product number {100 + i}, a {name}, as JSON."}],
                "max_tokens": 80, "response_format": _json_format("record", RECORD_SCHEMA)}
               for i, name in enumerate(PRODUCTS)]
    return sql + records


SHARED_SYSTEM = (
    TOOL_SYSTEM + "\n\nRules:\n"
    + "\n".join(f"- {rule}" for rule in (
        "Read a file before you change it, and change only what the task needs.",
        "Run the tests of a module after every change to it, then the whole suite before you finish.",
        "Keep the style of the code around you: names, quotes, line length of 100.",
        "Never write outside the repository, and never delete a test to make a suite pass.",
        "When a test fails, read its assertion and the code it calls before you guess at a fix.",
        "Say in the thought what you expect the tool to show you, in one sentence."))
    + "\n\nThe repository's files, as they are now:\n"
    + "\n\n".join(result.split(":", 1)[1].strip() for result in TOOL_RESULTS if result.startswith("read_file"))
    + "\n\nshop/orders.py:\n" + "\n".join(
        f"class {name}:\n    def __init__(self, amount, status='paid'):\n        self.amount = amount\n"
        f"        self.status = status\n\n    def describe(self):\n        return f'{name} of {{self.amount}} ({{self.status}})'\n"
        for name in ("Order", "Refund", "Invoice", "Voucher", "Shipment", "Return", "Credit", "Payment"))
)
SHARED_TASKS = [
    "Add a test for order_total with no orders.", "Make is_refund accept the status 'REFUNDED' in any case.",
    "Find where Invoice is used and list the files.", "Rename order_total to orders_total everywhere.",
    "Add a describe test for Shipment.", "Make Voucher amounts negative in order_total.",
    "Run the whole test suite and report.", "Add type hints to shop/refunds.py.",
]


def _shared_trace() -> list[dict]:
    return [{"system": SHARED_SYSTEM, "turns": [{"content": task}], "max_tokens": 48,
             "response_format": _json_format("tool_call", TOOL_CALL_SCHEMA)} for task in SHARED_TASKS]


def _regenerate_trace() -> list[dict]:
    return [{"turns": [{"content": ask, "times": 2} for ask in REGENERATE_ASKS], "max_tokens": 96}]


TRACES = {"tools": _tools_trace, "refine": _refine_trace, "siblings": _siblings_trace,
          "regenerate": _regenerate_trace, "shared": _shared_trace}


# ---------------------------------------------------------------------------------------------
# Replaying


def replay(url: str, conversations: list[dict]) -> list[dict]:
    """Send a trace's conversations in order, one request at a time; return every request's
    figures (turn, tokens sent and evaluated, times, answer)."""
    results = []
    with httpx.Client(base_url=url, timeout=1800, headers={"Connection": "close"}) as http:
        for c, conversation in enumerate(conversations):
            messages = [{"role": "system", "content": conversation["system"]}] if conversation.get("system") else []
            for t, turn in enumerate(conversation["turns"]):
                messages.append({"role": "user", "content": turn["content"]})
                body = {"model": "m", "messages": messages, "max_tokens": conversation["max_tokens"], "temperature": 0}
                if conversation.get("response_format"):
                    body["response_format"] = conversation["response_format"]
                for _ in range(turn.get("times", 1)):
                    results.append({"conversation": c, "turn": t, **_stream(http, body)})
                messages.append({"role": "assistant", "content": results[-1]["text"]})
    return results


def _stream(http: httpx.Client, body: dict) -> dict:
    """One streamed chat request: time to first text and to the end, tokens sent, cached and
    generated (the usage and timings chunks both servers send), and the text."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first, parts, usage, timings = None, [], {}, {}
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            response.read()
            raise SystemExit(f"the server answered {response.status_code}: {response.text[:300]}")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            usage = chunk.get("usage") or usage
            timings = chunk.get("timings") or timings
            for choice in chunk.get("choices", ()):
                if text := (choice.get("delta") or {}).get("content"):
                    first = first or time.perf_counter()
                    parts.append(text)
    last = time.perf_counter()
    prompt = usage.get("prompt_tokens", 0)
    cached = timings.get("cache_n", (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
    return {"ttft": (first or last) - t0, "ttlt": last - t0, "prompt": prompt, "evaluated": prompt - cached,
            "tokens": usage.get("completion_tokens", 0), "text": "".join(parts),
            # the server's own decoding time (both servers report it): a stream's first text can
            # come several tokens in, so the client's clock would flatter one server or the other
            "predicted": (timings.get("predicted_n", 0), timings.get("predicted_ms", 0.0) / 1e3)}


def summarize(server: str, trace: str, round_: int, results: list[dict]) -> dict:
    decode_s = sum(r["predicted"][1] for r in results)
    predicted = sum(r["predicted"][0] for r in results)
    tokens = sum(r["tokens"] for r in results)
    return {
        "server": server, "trace": trace, "round": round_, "requests": len(results),
        "prompt_tokens": sum(r["prompt"] for r in results), "evaluated": sum(r["evaluated"] for r in results),
        "completion_tokens": tokens, "wall_s": round(sum(r["ttlt"] for r in results), 2),
        "ttft_mean_s": round(sum(r["ttft"] for r in results) / len(results), 3),
        "decode_tokens_per_s": round(predicted / decode_s, 1) if decode_s > 0 else None,
        "turns": [{"turn": r["turn"], "prompt": r["prompt"], "evaluated": r["evaluated"], "ttft_s": round(r["ttft"], 3)}
                  for r in results if r["conversation"] == 0],
        # each request's decoding speed (the server's own timings), in the order sent
        "per_request": [round(r["predicted"][0] / r["predicted"][1], 1) if r["predicted"][1] > 0 else None
                        for r in results],
        "texts": [r["text"] for r in results],
    }


def compare_with_plain(rows: list[dict]) -> None:
    """Give every row the number of its answers equal to plain decoding's (a `specrun-plain` row of
    the same trace and round, else of any round; `specrun-plain-fa-off` for a `-fa-off` server: flash
    attention on or off rounds otherwise, so plain decoding's own answers may differ) and the ratios
    against it."""
    plain = {(r["server"], r["trace"], r["round"]): r for r in rows if r["server"].startswith("specrun-plain")}
    for row in rows:
        server = "specrun-plain-fa-off" if row["server"].endswith("-fa-off") else "specrun-plain"
        reference = plain.get((server, row["trace"], row["round"])) or next(
            (r for (s, trace, _), r in plain.items() if s == server and trace == row["trace"]), None)
        if reference is None:
            continue
        row["same_as_plain"] = sum(a == b for a, b in zip(row["texts"], reference["texts"]))
        if row["decode_tokens_per_s"] and reference["decode_tokens_per_s"]:
            row["decode_vs_plain"] = round(row["decode_tokens_per_s"] / reference["decode_tokens_per_s"], 2)
        row["wall_vs_plain"] = round(row["wall_s"] / reference["wall_s"], 2)


def table(rows: list[dict], turns: bool, per_request: bool = False) -> str:
    lines = ["| trace | server | requests | prompt tokens / evaluated | completion | wall s | first token s (mean) | "
             "decode tok/s | vs plain | same as plain |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "failed" in r:
            lines.append(f"| {r['trace']} | {r['server']} | failed: {r['failed'][:100]} | | | | | | | |")
            continue
        lines.append(f"| {r['trace']} | {r['server']} | {r['requests']} | {r['prompt_tokens']} / {r['evaluated']} | "
                     f"{r['completion_tokens']} | {r['wall_s']} | {r['ttft_mean_s']} | {r['decode_tokens_per_s']} | "
                     f"{r.get('decode_vs_plain', '')} | {r.get('same_as_plain', '')}/{r['requests']} |")
    if turns:
        lines += ["", "| trace | server | per turn of the first conversation: prompt / evaluated / first token s |",
                  "|---|---|---|"]
        lines += [f"| {r['trace']} | {r['server']} | " + "; ".join(
            f"{t['prompt']}/{t['evaluated']}/{t['ttft_s']}" for t in r["turns"]) + " |" for r in rows if "turns" in r]
    if per_request:
        lines += ["", "| trace | server | decode tok/s of each request, in the order sent |", "|---|---|---|"]
        lines += [f"| {r['trace']} | {r['server']} | " + " ".join(str(v) for v in r["per_request"]) + " |"
                  for r in rows if "per_request" in r]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Servers


def start(name: str, args) -> _Server | None:
    if name.startswith(("specrun", "base")):
        if name.startswith("base") and args.baseline is None:
            print(f"{name}: skipped (no --baseline)", file=sys.stderr)
            return None
        repo = args.baseline if name.startswith("base") else REPO
        # (--throughput takes effect where requests may decode together: two lanes, for one agent)
        return specrun_server(repo, args, 2 if name.removesuffix("-fa-off").endswith("-throughput") else 1, name)
    if args.peer_bin is None:
        print(f"{name}: skipped (no --peer-bin)", file=sys.stderr)
        return None
    from specrun import sysinfo
    from specrun.runtime.model_files import resolve_models
    from specrun.runtime.plan import RunOptions

    files = resolve_models(RunOptions(target=args.target, draft=args.draft, quiet=True))
    port = _free_port()
    argv = [str(args.peer_bin / "llama-server"), "-m", str(files.target_path), "--port", str(port), "-np", "1",
            "-c", str(args.ctx_size), "-t", str(args.threads or os.cpu_count()), "--no-webui", "--cache-reuse", "256",
            *(["--no-repack"] if sysinfo.repacking_crashes() else [])]
    modes = {"peer-plain": [], "peer-ngram-mod": ["--spec-type", "ngram-mod"],
             "peer-ngram-cache": ["--spec-type", "ngram-cache"],
             "peer-draft": ["-md", str(files.draft_path), "--spec-draft-n-max", "5"]}
    mode = name.removesuffix("-fa-off")
    if mode not in modes:
        raise SystemExit(f"unknown server {name!r}")
    return _Server(argv + modes[mode] + (["-fa", "off"] if mode != name else []), url=f"http://127.0.0.1:{port}")


def main() -> None:
    args = _parse_args()
    traces = args.traces.split(",")
    unknown = [t for t in traces if t not in TRACES]
    if unknown:
        raise SystemExit(f"unknown trace(s) {', '.join(unknown)}: choose from {', '.join(TRACES)}")
    rows = []
    names = args.servers.split(",")
    for round_ in range(args.rounds):
        # Odd rounds take the servers in reverse: on a 2-core host the later server of a pair ran a
        # few percent slower in every round (refine, which no change between them touched, 3-5%).
        for name in names if round_ % 2 == 0 else names[::-1]:
            server = start(name, args)
            if server is None:
                continue
            try:
                # Every server starts cold and meets the traces in the same order, each a fresh
                # task for it: what one trace leaves in the server's memory, the next may use.
                for trace in traces:
                    rows.append(summarize(name, trace, round_, replay(server.url, TRACES[trace]())))
                    r = rows[-1]
                    print(f"{name:<16} {trace:<10} {r['wall_s']:7.1f} s, first token {r['ttft_mean_s']:.2f} s, "
                          f"{r['decode_tokens_per_s']} tokens/s decoding, {r['evaluated']} of {r['prompt_tokens']} "
                          f"prompt tokens evaluated", file=sys.stderr, flush=True)
            except httpx.HTTPError as e:  # a server that fails or dies: said, and the sweep goes on
                rows.append({"server": name, "trace": trace, "round": round_,
                             "failed": f"{type(e).__name__}: {e}; " + " | ".join(server.last_lines[-3:])})
                print(f"{name}: {rows[-1]['failed']}", file=sys.stderr, flush=True)
            finally:
                server.stop()
    compare_with_plain(rows)
    for row in rows:
        row.pop("texts", None)
    print(json.dumps(rows, indent=2) if args.json else table(rows, args.turns, args.per_request))


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", default=",".join(TRACES))
    parser.add_argument("--servers", default="specrun-plain,specrun,peer-plain,peer-ngram-mod,peer-ngram-cache,peer-draft")
    parser.add_argument("--ctx-size", type=int, default=4096)
    parser.add_argument("--threads", type=int)
    parser.add_argument("--target", default="smollm2-135m-f32")
    parser.add_argument("--draft", default="smollm2-135m-q4")
    parser.add_argument("--peer-bin", type=Path, help="llama.cpp's build/bin, with llama-server")
    parser.add_argument("--baseline", type=Path, help="another checkout of specrun: the servers base and base-plain run it")
    parser.add_argument("--rounds", type=int, default=1, help="sweeps, the servers in reverse order in odd ones")
    parser.add_argument("--turns", action="store_true", help="also the per-turn figures of the growing conversations")
    parser.add_argument("--per-request", action="store_true", help="also each request's decoding speed (a repeat against a first)")
    parser.add_argument("--json", action="store_true")
    return parser.parse_args()


if __name__ == "__main__":
    main()
