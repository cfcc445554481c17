"""--kv-split: requests decoding together, each in a KV cache of its own (llama.cpp's kv_unified off).

In one unified cache a pass's tokens take the free cells llama.cpp finds from its head, so a
request's later tokens fill the holes other requests' rejected drafts left before its own cells:
its attention then sums its cells in another order, and a greedy answer can part from the same
request alone. A cache per request keeps every request's cells in its own order; with a target
whose rows round alike in any pass (a Q4_1 target over a quantized cache: docs/exactness.md)
each answer is then the one it gets alone, bit for bit, whatever the others do.
"""

from __future__ import annotations

import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai

from specrun.runtime.plan import RunOptions, build_plan

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_server import running_server  # noqa: E402

GB = 1 << 30
MODELS = ["--target", "smollm2-135m-q4", "--draft", "lookup", "--kv-type", "q8_0", "--ctx-size", "1024"]
PROMPTS = {
    "copies": ("Copy this text exactly, twice: The lighthouse keeper climbed the stairs every evening, lit the lamp, "
               "and watched the ships pass through the narrow channel until morning."),
    "repeats": "Repeat this list three times, one item per line: apple, banana, cherry, date, elderberry, fig.",
    "story": "Write a short story about a lighthouse keeper.",
    "facts": "List five facts about the moon.",
}


def test_each_request_in_a_split_cache_writes_what_it_writes_alone(cli, virtual_clock):
    virtual_clock(lambda n_tokens: 0.020 + 0.0005 * n_tokens)  # (conftest.VirtualClock: sizing is the curve's)
    alone = {}
    for name, prompt in PROMPTS.items():
        done = cli("generate", "--json", "-n", "64", "--no-spec", *MODELS[:2], *MODELS[4:], prompt)
        assert done.exit_code == 0, done.output
        alone[name] = json.loads(done.stdout)["token_ids"]
    lines = "".join(json.dumps({"prompt": p, "id": name, "max_tokens": 64}) + "\n" for name, p in PROMPTS.items())
    # Whether lookup's chains pay is sized by the run's pass times, here a fixed curve: on measured
    # times, at a busy moment of a long suite, a list of short items was decoded in plain steps in
    # all three runs, which proves nothing of chains verified beside others. A request also copies
    # a sentence of its prompt (lookup accepted 2.6 tokens a pass, where the list made 1.3): every
    # run must write the answers alone; one of three must have speculated.
    for _ in range(3):
        together = cli("generate", "--jsonl", "--parallel", "2", "--kv-split", *MODELS, input=lines)
        assert together.exit_code == 0, together.output
        results = {r["id"]: r for r in map(json.loads, together.stdout.splitlines())}
        assert {name: results[name]["token_ids"] for name in PROMPTS} == alone
        copies = results["copies"]["stats"]
        if copies["n_passes"] < copies["n_tokens"] and copies["shared_passes"] > 0:
            break  # chains verified beside others
    assert copies["n_passes"] < copies["n_tokens"] and copies["shared_passes"] > 0, copies


def test_the_plan_opens_a_sequence_per_request_in_a_split_cache():
    opts = RunOptions(ctx_size=1024, quiet=True, threads=1, parallel=3, kv_split=True)
    plan = build_plan(opts, None, devices=[], ram_free_bytes=16 * GB)
    target = plan.to_dict()["contexts"]["target"]
    assert target["split"] is True and target["n_seq_max"] == 3 and target["cells"] == 3 * 1024
    assert plan.draft_ctx.split is False  # (the draft's trees keep their colours in one cache)
    alone = build_plan(RunOptions(ctx_size=1024, quiet=True, threads=1, parallel=1, kv_split=True), None, devices=[],
                       ram_free_bytes=16 * GB)
    assert alone.target_ctx.split is False  # one request: its cache is its own anyway


def test_the_plan_says_so(cli):
    shown = cli("plan", "--parallel", "2", "--kv-split", "--ctx-size", "512")
    assert shown.exit_code == 0, shown.output
    assert "1 sequence each in a KV cache of its own (--kv-split: chains verified)" in shown.stdout


def _chat(server, content: str) -> tuple[str, dict]:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)
    reply = client.chat.completions.create(model="specrun", messages=[{"role": "user", "content": content}],
                                           max_tokens=48, temperature=0)
    return reply.choices[0].message.content, reply.model_extra["timings"]


def test_a_server_with_a_cache_per_request_answers_each_as_alone(offline_models, tmp_path):
    # Three clients at once through the official client; every answer is the --no-spec server's.
    with running_server(tmp_path / "alone", "--no-spec", *MODELS[:2], *MODELS[4:6], "--parallel", "1") as alone:
        reference = {name: _chat(alone, prompt)[0] for name, prompt in PROMPTS.items()}
    with running_server(tmp_path / "split", *MODELS[:6], "--parallel", "3", "--kv-split") as split:
        assert "3 requests at once, a KV cache each (--kv-split)" in split.stderr
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            futures = {name: pool.submit(_chat, split, prompt) for name, prompt in PROMPTS.items()}
            answers = {name: f.result() for name, f in futures.items()}
    assert {name: text for name, (text, _) in answers.items()} == reference
    assert sum(timings["shared_passes"] for _, timings in answers.values()) > 0  # (they did share passes)
