"""`specrun serve` end to end: a real server process on 127.0.0.1, driven by the official openai
client and by plain HTTP (httpx).

Most tests share one server (module scope; it requires an API key, so every test also exercises
the key check). The shutdown test starts its own small-queue server because it stops it; clients
that give up on a whole answer meet a server whose answers come fast and long (`fast_server`).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import ollama
import openai
import pytest
from conftest import MODEL_CACHE

REPO = Path(__file__).resolve().parents[1]
CTX = 1024
API_KEY = "test-key-7f3a"
TARGET = "smollm2-135m-f32"
PROMPT = "Name three colours."
STARTUP_S = 180.0  # generous: the CPU is shared with other test runs
LISTENING_RE = re.compile(r"listening on (http://\S+)")


def _env(home: Path) -> dict:
    env = dict(os.environ)
    env.update(
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])),
        SPECRUN_HOME=str(MODEL_CACHE), SPECRUN_CONFIG=str(home / "config"), SPECRUN_PROFILES=str(home / "profiles"),
        HF_HOME=str(home / "hf"), NO_COLOR="1",
    )
    env.pop("SPECRUN_API_KEY", None)
    return env


class ServerProcess:
    """`specrun serve` in a subprocess; stderr is collected line by line as it arrives."""

    def __init__(self, home: Path, *args: str, port: int = 0, ctx: int | None = CTX):
        """ctx=None: the server's default context (the model's trained one)."""
        ctx_args = ["--ctx-size", str(ctx)] if ctx is not None else []
        argv = [sys.executable, "-m", "specrun", "serve", "--port", str(port), *ctx_args, *args]
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(home))
        self.stderr_lines: list[str] = []
        self.stdout = ""
        self._reader = threading.Thread(target=self._read_stderr, daemon=True)
        self._reader.start()
        self.url = ""

    def _read_stderr(self) -> None:
        for line in self.proc.stderr:
            self.stderr_lines.append(line.rstrip("\n"))

    @property
    def stderr(self) -> str:
        return "\n".join(self.stderr_lines)

    def wait_ready(self) -> str:
        """Return the base URL once the server says it is listening (models loaded)."""
        deadline = time.monotonic() + STARTUP_S
        while time.monotonic() < deadline:
            for line in list(self.stderr_lines):
                match = LISTENING_RE.search(line)
                if match:
                    self.url = match.group(1)
                    return self.url
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        self.proc.kill()
        pytest.fail(f"the server did not start (exit {self.proc.poll()}):\n{self.stderr}", pytrace=False)

    def terminate(self, timeout: float = 60.0) -> int:
        """Send SIGTERM and return the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        # wait(), not communicate(): communicate would read stderr too, beside the reader thread,
        # and keep the last lines the server wrote (a request's log line) from stderr_lines.
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            pytest.fail(f"the server did not stop within {timeout:.0f} s after SIGTERM:\n{self.stderr}", pytrace=False)
        self.stdout = self.proc.stdout.read()  # (a server writes nothing there: the pipe never fills)
        self._reader.join(30)
        return self.proc.returncode


@contextmanager
def running_server(home: Path, *args: str, ctx: int | None = CTX):
    """Yield a server once it listens; then check that it stops cleanly (exit 0, nothing on stdout)."""
    srv = ServerProcess(home, *args, ctx=ctx)
    srv.wait_ready()
    yield srv
    rc = srv.terminate()
    assert rc == 0, srv.stderr
    assert srv.stdout == "", "the server wrote to stdout"


@pytest.fixture(scope="module")
def server(offline_models, tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("serve-home"), "--api-key", API_KEY) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def _http(server, **kwargs) -> httpx.Client:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    return httpx.Client(base_url=server.url, headers=headers, timeout=120, **kwargs)


def _chat_body(content: str = PROMPT, **fields) -> dict:
    return {"model": TARGET, "messages": [{"role": "user", "content": content}], "max_tokens": 16, **fields}


# ---------------------------------------------------------------------------------------------
# Answers


def test_health_and_models(server, client):
    assert httpx.get(server.url + "/health").json() == {"status": "ok", "queued": 0}  # no key needed
    models = client.models.list().data
    assert [m.id for m in models] == [TARGET]
    assert models[0].model_extra["meta"]["draft"] == "smollm2-135m-q4"


def test_chat_answer_with_usage_and_timings(client):
    reply = client.chat.completions.create(model="anything", messages=[{"role": "user", "content": PROMPT}],
                                           max_tokens=16, temperature=0)
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and choice.message.content.strip()
    assert choice.finish_reason in ("stop", "length")
    assert reply.model == TARGET  # any model name is answered by the loaded pair
    assert 0 < reply.usage.completion_tokens <= 16
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    timings = reply.model_extra["timings"]
    for key in ("prompt_n", "prompt_ms", "prompt_per_second", "predicted_n", "predicted_ms", "predicted_per_second",
                "draft_n", "draft_n_accepted", "accepted_per_pass", "n_passes", "cache_n"):
        assert key in timings, key
    assert timings["predicted_n"] == reply.usage.completion_tokens
    assert timings["prompt_n"] + timings["cache_n"] == reply.usage.prompt_tokens
    assert timings["draft_n_accepted"] <= timings["draft_n"]
    # The answer joined the memory of answers, which /v1/models measures (the soak watches it grow).
    memory = client.models.list().data[0].model_extra["meta"]["answers_memory"]
    assert memory["answers"] >= 1 and memory["tokens"] > reply.usage.completion_tokens and memory["bytes"] > 0


def test_chat_stream_arrives_in_pieces(client):
    arrivals = []
    stream = client.chat.completions.create(
        model=TARGET, messages=[{"role": "user", "content": "Write a short poem about rain."}], max_tokens=32,
        temperature=0, stream=True, stream_options={"include_usage": True},
    )
    for chunk in stream:
        arrivals.append((time.monotonic(), chunk))
    pieces = [(t, c.choices[0].delta.content) for t, c in arrivals if c.choices and c.choices[0].delta.content]
    assert len(pieces) >= 2, "the answer came in one piece"
    assert pieces[0][0] < arrivals[-1][0], "nothing arrived before the end"
    finishes = [c.choices[0].finish_reason for _, c in arrivals if c.choices and c.choices[0].finish_reason]
    assert finishes in (["stop"], ["length"])
    usage_chunk = arrivals[-1][1]
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens > 0
    assert "timings" in usage_chunk.model_extra


def test_stream_without_usage_option_has_no_usage_chunk(server):
    with _http(server) as http:
        lines = http.post("/v1/chat/completions", json=_chat_body(max_tokens=8, stream=True)).text.split("\n\n")
    events = [line.removeprefix("data: ") for line in lines if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(chunk["choices"] for chunk in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length") and "timings" in chunks[-1]


def test_completions(client):
    reply = client.completions.create(model=TARGET, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert reply.object == "text_completion"
    assert reply.choices[0].text.strip()
    assert reply.usage.prompt_tokens > 0 and 0 < reply.usage.completion_tokens <= 8


def _generate_cli(home: Path, requests: list[dict]) -> list[str]:
    """Return the texts `specrun generate --temperature 0 --jsonl` writes for the requests (one model load)."""
    out = subprocess.run(
        [sys.executable, "-m", "specrun", "generate", "--temperature", "0", "--ctx-size", str(CTX), "--jsonl"],
        input="".join(json.dumps(r) + "\n" for r in requests), capture_output=True, text=True, env=_env(home),
        timeout=STARTUP_S,
    )
    assert out.returncode == 0, out.stderr
    return [json.loads(line)["text"] for line in out.stdout.splitlines()]


def test_greedy_text_is_what_generate_prints(client, tmp_path):
    raw = "def fibonacci(n):"
    cli_chat, cli_raw = _generate_cli(tmp_path, [{"prompt": PROMPT, "max_tokens": 24, "chat": True},
                                                 {"prompt": raw, "max_tokens": 24, "chat": False}])
    reply = client.chat.completions.create(model=TARGET, messages=[{"role": "user", "content": PROMPT}],
                                           max_tokens=24, temperature=0)
    assert reply.choices[0].message.content == cli_chat
    reply = client.completions.create(model=TARGET, prompt=raw, max_tokens=24, temperature=0)
    assert reply.choices[0].text == cli_raw


def test_lookup_drafting_through_the_server(offline_models, tmp_path):
    """`serve --draft lookup`: text that repeats what the conversation holds is drafted from it,
    the answer is still the target's greedy text, and timings say where accepted tokens came from."""
    passage = ("The lighthouse keeper climbed the spiral stairs every evening at dusk, lit the great lamp, "
               "and wrote the weather in a leather logbook before the ships came in.")
    request = f"Repeat this sentence exactly: {passage}"
    srv = ServerProcess(tmp_path / "home", "--draft", "lookup")
    try:
        srv.wait_ready()
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120)
        meta = client.models.list().data[0].model_extra["meta"]
        assert meta["draft"] is None and meta["drafter"] == "lookup"  # no draft model loaded
        reply = client.chat.completions.create(model=TARGET, messages=[{"role": "user", "content": request}],
                                               max_tokens=40, temperature=0)
    finally:
        assert srv.terminate() == 0, srv.stderr
    (cli_text,) = _generate_cli(tmp_path, [{"prompt": request, "max_tokens": 40, "chat": True}])
    assert reply.choices[0].message.content == cli_text
    timings = reply.model_extra["timings"]
    assert timings["lookup_n_accepted"] > 0 and timings["lookup_n_accepted"] == timings["draft_n_accepted"]
    assert timings["accepted_per_pass"] > 1.0


def test_seeded_sampling_is_reproducible(client):
    def sample(seed: int) -> str:
        reply = client.chat.completions.create(
            model=TARGET, messages=[{"role": "user", "content": "Tell me a fact about cats."}], max_tokens=16,
            temperature=1.0, top_p=0.95, seed=seed,
        )
        return reply.choices[0].message.content

    assert sample(1234) == sample(1234)


def test_the_speed_of_a_short_answer_is_measured_not_made_up(server, client):
    """Issue 53: a one-token answer reported tens of thousands of tokens/s (its token comes from the
    prompt's pass, and only the draw was timed). The speed is that of the decoding passes: none for
    one token, the second token's pass for two."""
    messages = [{"role": "user", "content": PROMPT}]
    one = client.chat.completions.create(model=TARGET, messages=messages, max_tokens=1, temperature=0)
    timings = one.model_extra["timings"]
    assert timings["predicted_n"] == 1
    assert timings["predicted_per_second"] is None and timings["predicted_per_token_ms"] is None
    logged = server.stderr_lines[_logged(server, one.id)]
    assert "· 1 tokens ·" in logged and "tok/s" not in logged, logged
    two = client.chat.completions.create(model=TARGET, messages=messages, max_tokens=2, temperature=0)
    timings = two.model_extra["timings"]
    assert timings["predicted_n"] == 2
    # One pass wrote the second token: about one token over the decoding time (two, counting the first).
    assert timings["predicted_per_second"] * timings["predicted_ms"] / 1000 < 1.5, timings
    assert timings["predicted_per_token_ms"] == pytest.approx(1000 / timings["predicted_per_second"], rel=0.01)


def test_stop_string_ends_the_answer(client):
    reply = client.completions.create(model=TARGET, prompt="1, 2, 3, 4,", max_tokens=24, temperature=0, stop=[" 7"])
    assert " 7" not in reply.choices[0].text and reply.choices[0].finish_reason == "stop"


def test_max_tokens_capped_by_the_context(server):
    # The limit is set before generating; the stop string then ends the answer after a word or two.
    with _http(server) as http:
        response = http.post("/v1/chat/completions", json=_chat_body(max_tokens=100_000, stop=[" ", "\n"]))
    assert response.status_code == 200, response.text
    limit = int(response.headers["X-Specrun-Max-Tokens"])
    assert limit < CTX and response.headers["X-Specrun-Max-Tokens-Capped"] == "100000"
    assert response.json()["choices"][0]["finish_reason"] == "stop"
    assert any("lowered to" in line for line in server.stderr_lines)


# ---------------------------------------------------------------------------------------------
# Keys and bad requests


def test_api_key_required(server):
    body = _chat_body(max_tokens=4)
    missing = httpx.post(server.url + "/v1/chat/completions", json=body)
    wrong = httpx.post(server.url + "/v1/chat/completions", json=body, headers={"Authorization": "Bearer nope"})
    for response in (missing, wrong):
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.url + "/v1/models").status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()


BIG = "x" * (2 << 20)

BAD_REQUESTS = {
    "malformed JSON": ("/v1/chat/completions", b'{"messages": [', 400, None),
    "not an object": ("/v1/chat/completions", b"[1, 2]", 400, None),
    "empty body": ("/v1/chat/completions", b"", 400, None),
    "messages of the wrong type": ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    "temperature of the wrong type": ("/v1/chat/completions", _chat_body(temperature="hot"), 400, "temperature"),
    "max_tokens of the wrong type": ("/v1/chat/completions", _chat_body(max_tokens="lots"), 400, "max_tokens"),
    "negative max_tokens": ("/v1/chat/completions", _chat_body(max_tokens=-3), 400, "max_tokens"),
    "top_p out of range": ("/v1/chat/completions", _chat_body(top_p=1.5), 400, "top_p"),
    "unknown role": ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages"),
    "image content": ("/v1/chat/completions",
                      {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
                      400, "messages"),
    "no messages": ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    "n=2": ("/v1/chat/completions", _chat_body(n=2), 400, "n"),
    "tools": ("/v1/chat/completions", _chat_body(tools=[{"type": "function", "function": {"name": "f"}}]), 400, "tools"),
    "prompt batch": ("/v1/completions", {"prompt": ["a", "b"]}, 400, "prompt"),
    "prompt longer than the context": ("/v1/completions", {"prompt": "hello " * 2000, "max_tokens": 4}, 400, "prompt"),
    "streamed prompt longer than the context": ("/v1/chat/completions", _chat_body("hello " * 2000, stream=True),
                                                400, "messages"),
    "body too large": ("/v1/chat/completions", _chat_body(BIG), 413, None),
    # Issue 53: booleans are JSON's true and false only, as in the OpenAI API ("yes" was read as true).
    "stream as a string": ("/v1/chat/completions", _chat_body(stream="yes"), 400, "stream"),
    "include_usage as a number": ("/v1/chat/completions", _chat_body(stream=True, stream_options={"include_usage": 1}),
                                  400, "stream_options"),
    "chat logprobs as a string": ("/v1/chat/completions", _chat_body(logprobs="true"), 400, "logprobs"),
    "parse_special as a string": ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "parse_special": "false"},
                                  400, "parse_special"),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request_is_refused_and_server_keeps_serving(server, case):
    path, body, status, param = BAD_REQUESTS[case]
    with _http(server) as http:
        if isinstance(body, bytes):
            response = http.post(path, content=body, headers={"Content-Type": "application/json"})
        else:
            response = http.post(path, json=body)
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
        assert "Traceback" not in response.text
        if param is not None:
            assert error["param"] == param, error
        if case.endswith(("as a string", "as a number")):
            assert "must be true or false" in error["message"] and error["message"].startswith(param), error
        assert http.post("/v1/chat/completions", json=_chat_body(max_tokens=2)).status_code == 200


def test_unknown_route_and_wrong_method(server):
    with _http(server) as http:
        assert http.get("/v1/nothing").status_code == 404
        assert http.get("/v1/chat/completions").status_code == 405
        assert http.get("/v1/nothing").json()["error"]["code"] == "not_found"


# ---------------------------------------------------------------------------------------------
# Many clients, disconnects, conversation reuse


def test_eight_concurrent_clients_all_answered(client):
    def ask(i: int) -> str:
        reply = client.chat.completions.create(
            model=TARGET, messages=[{"role": "user", "content": f"Give me a word that rhymes with {i}."}],
            max_tokens=8, temperature=0,
        )
        return reply.choices[0].message.content

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, range(8)))
    assert len(answers) == 8 and all(a.strip() for a in answers)


def test_client_that_disconnects_frees_the_server(server, client):
    body = _chat_body("Write a very long story about a dragon.", max_tokens=600, temperature=0, stream=True)
    with _http(server) as http:
        with http.stream("POST", "/v1/chat/completions", json=body) as response:
            for line in response.iter_lines():
                if line.startswith("data: ") and '"content": "' in line and '"content": ""' not in line:
                    job_id = json.loads(line.removeprefix("data: "))["id"]
                    break
        # Leaving the block closed the connection after the first piece of the answer.
    t0 = time.monotonic()
    reply = client.chat.completions.create(model=TARGET, messages=[{"role": "user", "content": PROMPT}], max_tokens=4)
    assert reply.choices[0].message.content
    deadline = time.monotonic() + 30
    while not any(job_id in line for line in server.stderr_lines) and time.monotonic() < deadline:
        time.sleep(0.1)
    logged = next(line for line in server.stderr_lines if job_id in line)
    assert logged.endswith("cancelled"), logged
    generated = int(re.search(r"· (\d+) tokens", logged).group(1))
    assert generated < 600
    assert time.monotonic() - t0 < 60


@pytest.fixture(scope="module")
def fast_server(offline_models, tmp_path_factory):
    """A server whose answers come token after token without pause and run to their limit: the tiny
    random-weight model (no end-of-turn in its first thousands of greedy tokens), plain decoding, one
    thread (hundreds of tokens a second even on a busy machine, where threads wait for each other), one
    request at a time (a request that came second waits for the one before: with lanes it would run
    beside it and could finish before the first was found abandoned)."""
    with running_server(tmp_path_factory.mktemp("serve-fast"), "--target", "smollm2-tiny-random", "--no-spec",
                        "--threads", "1", "--parallel", "1", ctx=8192) as srv:
        yield srv


# Tokens of an answer whose client leaves after half a second: several seconds of the tiny model even
# on a fast machine (1500, which it once took two seconds for, it wrote within the second on another).
LONG = 8000


def _leave_early(url: str, route: str) -> None:
    """Ask for a LONG-token answer, not streamed, with the official client of the route's API,
    which gives up after half a second."""
    messages = [{"role": "user", "content": "Write a very long story about a dragon."}]
    if route.startswith("/v1/"):
        impatient = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=0.5)
        with pytest.raises(openai.APITimeoutError):
            if route == "/v1/chat/completions":
                impatient.chat.completions.create(model=TARGET, messages=messages, max_tokens=LONG, temperature=0)
            else:
                impatient.completions.create(model=TARGET, prompt="Once upon a time", max_tokens=LONG, temperature=0)
        return
    impatient = ollama.Client(host=url, timeout=0.5)
    options = {"temperature": 0, "num_predict": LONG}
    with pytest.raises(httpx.TimeoutException):
        if route == "/api/chat":
            impatient.chat(model=TARGET, messages=messages, options=options)
        else:
            impatient.generate(model=TARGET, prompt="Once upon a time", options=options)


def _log_mark(srv: ServerProcess) -> int:
    """Return how many lines the server has logged once everything before now is among them (a
    refused request with an id of its own marks the place)."""
    mark = f"mark-{time.monotonic_ns()}"
    httpx.post(srv.url + "/v1/completions", content=b"", headers={"X-Request-Id": mark}, timeout=30)
    return _logged(srv, mark) + 1


def _logged(srv: ServerProcess, text: str, start: int = 0) -> int:
    """Return the index of the first line from `start` on that holds `text` (waiting for it)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        found = next((i for i, line in enumerate(srv.stderr_lines[start:], start) if text in line), None)
        if found is not None:
            return found
        time.sleep(0.05)
    pytest.fail(f"the server never logged {text!r}:\n{srv.stderr}", pytrace=False)


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions", "/api/chat", "/api/generate"])
def test_a_whole_answer_stops_when_its_client_gives_up(fast_server, route):
    """Issue 37, item 2: a non-streamed answer whose client timed out is cancelled at the next step,
    so the next request does not wait for it."""
    start = _log_mark(fast_server)
    _leave_early(fast_server.url, route)
    client = openai.OpenAI(base_url=fast_server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    reply = client.chat.completions.create(model=TARGET, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    queue_s = reply.model_extra["timings"]["queue_ms"] / 1000
    lines = fast_server.stderr_lines[start:_logged(fast_server, reply.id, start)]
    left = next(line for line in lines if re.match(r"(chatcmpl|cmpl|ollama)-\w+: prompt", line))
    assert left.endswith("cancelled"), left
    # Issue 53: the refusal's log line says why (it had an empty reason).
    refusal = fast_server.stderr_lines[_logged(fast_server, f"POST {route} refused with 499", start)]
    assert refusal.endswith("refused with 499: client disconnected before the answer was sent"), refusal
    generated, rate = re.search(r"· (\d+) tokens · ([\d.]+) tok/s", left).groups()
    assert int(generated) < LONG
    # The whole answer would have taken LONG / rate seconds; the second request waited for a small part of it.
    assert queue_s < LONG / float(rate) / 4, (queue_s, left)


# More tokens than fast_server's 8192-token context.
OVER_CONTEXT = "hello " * 12_000


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/api/generate"])
def test_a_prompt_over_the_context_is_refused_on_arrival(fast_server, route):
    """Issue 53: a prompt that cannot fit is refused when it arrives, with the same 400, not after
    the answers before it (it waited 55 s under load)."""
    long_body = {"messages": [{"role": "user", "content": "Write a very long story about a dragon."}],
                 "max_tokens": LONG, "temperature": 0, "stream": True}
    over = {"model": TARGET, "prompt": OVER_CONTEXT, "stream": False} if route.startswith("/api/") else \
        {"messages": [{"role": "user", "content": OVER_CONTEXT}], "max_tokens": 4}
    with httpx.Client(base_url=fast_server.url, timeout=300) as http:
        with http.stream("POST", "/v1/chat/completions", json=long_body) as streaming:
            lines = streaming.iter_lines()  # (kept: a lines iterator let go of closes the connection)
            first = next(line for line in lines if '"content": "' in line and '"content": ""' not in line)
            long_id = json.loads(first.removeprefix("data: "))["id"]  # the long answer runs
            refused = http.post(route, json=over)
        # Leaving the block closed the long answer's connection: it is cancelled at its next step.
    assert refused.status_code == 400, refused.text
    if route.startswith("/api/"):
        assert "context" in refused.json()["error"]
    else:
        error = refused.json()["error"]
        assert error["code"] == "context_length_exceeded" and error["param"] == "messages", error
    # A refusal that waited for its turn would have come after the long answer ran to its end.
    logged = fast_server.stderr_lines[_logged(fast_server, long_id)]
    assert logged.endswith("cancelled"), logged


ADA = [{"role": "user", "content": "Describe a person named Ada in a few sentences."}]
# Shares the chat template's opening with ADA, then parts from it.
SHARING = [{"role": "user", "content": "Describe a city in two sentences."}]


def _ada(client: openai.OpenAI, max_tokens: int = 64):
    return client.chat.completions.create(model=TARGET, messages=ADA, max_tokens=max_tokens, temperature=0,
                                          logprobs=True)


def _logprobs(reply) -> list[float]:
    return [entry.logprob for entry in reply.choices[0].logprobs.content]


def test_a_greedy_answer_is_the_same_whatever_ran_before(fast_server):
    """Issue 37, item 8, where decoding is plain: the same greedy request gets the same answer, to
    the last digit of its log-probs, after a request sharing its beginning, after itself and after
    a sampled one (each left other KV in the cache)."""
    client = openai.OpenAI(base_url=fast_server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    first = _ada(client)
    answers, cached = [], []
    for before in ({"messages": SHARING, "temperature": 0}, {"messages": ADA, "temperature": 0},
                   {"messages": ADA, "temperature": 1.0}):
        client.chat.completions.create(model=TARGET, max_tokens=8, **before)
        again = _ada(client)
        answers.append((again.choices[0].message.content, _logprobs(again)))
        cached.append(again.usage.prompt_tokens_details.cached_tokens)
    assert answers == [(first.choices[0].message.content, _logprobs(first))] * 3
    # After a prompt sharing its beginning, the prompt (under 512 tokens) was evaluated whole: the
    # cache held parts of it that a fresh prefill would have computed in another batch. After
    # itself, greedy or sampled, the cache still held it as its prefill wrote it, with that
    # prefill's last row: nothing was evaluated (an answer regenerated costs no prompt pass).
    prompt = first.usage.prompt_tokens
    assert cached == [0, prompt, prompt]


def test_tasks_under_one_long_system_prompt_resume_inside_its_batch_and_answer_as_fresh(fast_server):
    """An agent's separate tasks under one long system prompt part from the cached prompt inside a
    batch: on a slot of its own, measured at start to allow it (decoding.kv.resumes_alike), the
    next task keeps the cache up to a multiple of 32 tokens before where they part (not the batch's
    start: nothing under 512 tokens), and gets, to the last digit of its log-probs, the answer it
    gets when its prompt is evaluated whole."""
    client = openai.OpenAI(base_url=fast_server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    system = {"role": "system", "content": "You are a coding agent. " + " ".join(
        f"Rule {i}: keep file {i} tidy and test it." for i in range(40))}

    def task(text: str):
        return client.chat.completions.create(model=TARGET, messages=[system, {"role": "user", "content": text}],
                                              max_tokens=8, temperature=0, logprobs=True)

    client.chat.completions.create(model=TARGET, messages=ADA, max_tokens=4, temperature=0)  # nothing shared
    task("Fix the failing test.")
    resumed = task("List the files.")
    client.chat.completions.create(model=TARGET, messages=ADA, max_tokens=4, temperature=0)
    whole = task("List the files.")
    cached = resumed.usage.prompt_tokens_details.cached_tokens
    assert whole.usage.prompt_tokens_details.cached_tokens == 0 and resumed.usage.prompt_tokens > 200
    assert cached > 0 and cached % 32 == 0 and resumed.usage.prompt_tokens - cached >= 64
    assert resumed.usage.prompt_tokens - cached < 64 + 32 + 16  # the task's own tokens, and the rest of a pass
    assert (resumed.choices[0].message.content, _logprobs(resumed)) == (whole.choices[0].message.content, _logprobs(whole))


def test_a_greedy_prompt_gets_the_same_first_token_under_speculation(client):
    """Issue 37, item 8, with trees: the prompt's evaluation (which gives the first token) no longer
    depends on what ran before; later tokens come from tree passes, whose shape does (see README)."""
    first = _logprobs(_ada(client, max_tokens=1))
    client.chat.completions.create(model=TARGET, messages=SHARING, max_tokens=8, temperature=0)
    after_other = _logprobs(_ada(client, max_tokens=1))
    repeated = _logprobs(_ada(client, max_tokens=1))
    assert first == after_other == repeated


def test_second_turn_prefills_only_the_new_message(client):
    messages = [{"role": "system", "content": "You are a terse assistant."},
                {"role": "user", "content": "Write two sentences about the moon and its phases."}]
    first = client.chat.completions.create(model=TARGET, messages=messages, max_tokens=24, temperature=0)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And the sun?"}]
    second = client.chat.completions.create(model=TARGET, messages=messages, max_tokens=8, temperature=0)
    timings = second.model_extra["timings"]
    seen = first.usage.prompt_tokens + first.usage.completion_tokens
    # Everything the first turn put in the cache is reused; only the new message (and its template
    # markers) is evaluated.
    assert timings["cache_n"] >= seen - 1, timings
    assert timings["prompt_n"] <= second.usage.prompt_tokens - seen + 1, timings
    assert second.usage.prompt_tokens_details.cached_tokens == timings["cache_n"]


def test_an_answer_regenerated_evaluates_nothing_and_is_the_same(client):
    # A client's "regenerate" sends a request again: at any turn, greedy, the cache still holds its
    # prompt as it was evaluated, and that evaluation's last row is kept, so the first token's
    # logits are the same without a prompt pass (later ones come from tree passes, whose shapes
    # follow the clock: see test_a_greedy_prompt_gets_the_same_first_token_under_speculation).
    messages = [{"role": "user", "content": "Name three rivers of Europe."}]
    first = client.chat.completions.create(model=TARGET, messages=messages, max_tokens=16, temperature=0)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "Which is the longest?"}]
    replies = [client.chat.completions.create(model=TARGET, messages=messages, max_tokens=1, temperature=0,
                                              logprobs=True, top_logprobs=3) for _ in range(2)]
    original, again = [[(t.token, t.logprob, [(a.token, a.logprob) for a in t.top_logprobs])
                        for t in r.choices[0].logprobs.content] for r in replies]
    assert again == original
    timings = replies[1].model_extra["timings"]
    assert timings["prompt_n"] == 0 and timings["cache_n"] == replies[1].usage.prompt_tokens, timings


# ---------------------------------------------------------------------------------------------
# Startup and shutdown


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _health_until_ready(url: str, proc: subprocess.Popen) -> set:
    """Poll /health from the moment the port opens until it says ok; return what it answered."""
    return set(_health_polls(url, proc))


def _health_polls(url: str, proc: subprocess.Popen) -> list:
    """Poll /health from the moment the port opens until it says ok; return each answer."""
    seen = []
    deadline = time.monotonic() + STARTUP_S
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            response = httpx.get(url + "/health", timeout=5)
        except httpx.TransportError:
            time.sleep(0.05)
            continue
        seen.append((response.status_code, response.json()["status"]))
        if response.status_code == 200:
            return seen
        time.sleep(0.05)
    pytest.fail(f"/health never said ok; answers: {set(seen)}", pytrace=False)


def _wait_until_queued(url: str, n: int) -> None:
    deadline = time.monotonic() + 60
    while httpx.get(url + "/health").json().get("queued") != n:
        assert time.monotonic() < deadline, f"no {n} request(s) queued after 60 s"
        time.sleep(0.05)


def test_queue_full_then_sigterm_ends_answer_and_exits_0(offline_models, tmp_path):
    port = _free_port()
    srv = ServerProcess(tmp_path, "--queue-size", "1", "--parallel", "1", port=port)
    try:
        polls = _health_polls(f"http://127.0.0.1:{port}", srv.proc)
        assert set(polls) <= {(503, "loading"), (200, "ok")}
        url = srv.wait_ready()
        # Issue 53: the polls while loading are logged once, with the state (a line each before, no reason).
        assert polls.count((503, "loading")) >= 2, polls
        health_lines = [line for line in srv.stderr_lines if "/health" in line]
        assert len(health_lines) == 1 and 'answered 503, status "loading"' in health_lines[0], health_lines
        long_body = _chat_body("Write a very long story about a dragon.", max_tokens=800, temperature=0, stream=True)
        waiting: dict = {}
        with httpx.Client(base_url=url, timeout=120) as http, http.stream("POST", "/v1/chat/completions", json=long_body) as streaming:
            lines = streaming.iter_lines()
            next(line for line in lines if '"content": "' in line and '"content": ""' not in line)  # answering now
            waiter = threading.Thread(target=lambda: waiting.update(r=httpx.post(url + "/v1/chat/completions",
                                                                                 json=_chat_body(), timeout=120)))
            waiter.start()
            _wait_until_queued(url, 1)  # the second request waits in the queue (size 1)
            full = httpx.post(url + "/v1/chat/completions", json=_chat_body(), timeout=30)
            assert full.status_code == 503 and int(full.headers["Retry-After"]) >= 1
            assert full.json()["error"]["code"] == "queue_full"

            srv.proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]  # the answer in progress ends instead of running to 800 tokens
        assert rest[-1] == "data: [DONE]"
        assert any("shutting down" in line for line in rest)
        waiter.join(30)
        assert waiting["r"].status_code == 503
    finally:
        rc = srv.terminate()
    assert rc == 0, srv.stderr
    assert srv.stdout == ""
    with socket.socket() as sock:
        # Nothing listens there any more (SO_REUSEADDR, as servers bind: closed connections may linger in TIME_WAIT).
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        sock.listen(1)


def test_exposed_without_key_warns_and_bad_target_fails_cleanly(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "specrun", "serve", "--host", "0.0.0.0", "--port", "0", "--target", str(tmp_path / "missing.gguf")],
        capture_output=True, text=True, env=_env(tmp_path), timeout=120,
    )
    assert out.returncode != 0
    assert "without an API key" in out.stderr
    assert "error:" in out.stderr and "Traceback" not in out.stderr
    assert out.stdout == ""


def test_port_in_use_is_a_one_line_error(offline_models, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        out = subprocess.run(
            [sys.executable, "-m", "specrun", "serve", "--port", str(port), "--ctx-size", str(CTX)],
            capture_output=True, text=True, env=_env(tmp_path), timeout=120,
        )
    assert out.returncode == 2
    assert f"cannot listen on 127.0.0.1:{port}" in out.stderr and "Traceback" not in out.stderr


# ---------------------------------------------------------------------------------------------
# In process, without a model: a bug in a route is a JSON 500 and the app keeps answering


class _BrokenWorker:
    state = "ready"
    model = None
    queued = 0
    alive = True

    async def admit(self, job):
        raise RuntimeError("boom")


def test_unexpected_error_is_a_json_500():
    from fastapi.testclient import TestClient

    from specrun.server.app import ServerSettings, create_app
    from specrun.server.worker import ModelInfo

    worker = _BrokenWorker()
    worker.model = ModelInfo(TARGET, None, "none", CTX, None)
    with TestClient(create_app(worker, ServerSettings()), raise_server_exceptions=False, base_url="http://127.0.0.1") as http:
        response = http.post("/v1/chat/completions", json=_chat_body())
        assert response.status_code == 500
        assert response.json()["error"]["type"] == "server_error" and "Traceback" not in response.text
        assert http.get("/health").json()["status"] == "ok"


def test_cors_only_when_asked_for():
    from fastapi.testclient import TestClient

    from specrun.server.app import ServerSettings, create_app

    origin = "http://ui.example"
    preflight = {"Origin": origin, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    with TestClient(create_app(_BrokenWorker(), ServerSettings(api_key="k", cors_origins=(origin,)))) as http:
        allowed = http.options("/v1/chat/completions", headers=preflight)
        assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == origin
    with TestClient(create_app(_BrokenWorker(), ServerSettings()), base_url="http://127.0.0.1") as http:
        response = http.get("/health", headers={"Origin": origin})
        assert "access-control-allow-origin" not in response.headers and response.status_code == 403


def test_the_vocabulary_is_read_before_the_server_is_ready(offline_models):
    """What the first chat and the first schema would read of the vocabulary (its longest token,
    its control tokens, llguidance's tokenizer: seconds on a 262k vocabulary) is read while the
    server loads, so the first requests' first token does not wait for it."""
    from specrun.engine import grammar
    from specrun.runtime.plan import RunOptions
    from specrun.server.worker import GenerationWorker

    ready = threading.Event()
    worker = GenerationWorker(RunOptions(ctx_size=512, no_spec=True, parallel=1, quiet=True), 4,
                              lambda w, description: ready.set(), lambda e: ready.set())
    worker.start()
    try:
        assert ready.wait(120) and worker.state == "ready", worker.load_error
        rt = worker.runtime
        assert "max_token_bytes" in vars(rt.target) and "control" in vars(rt.chat_format)
        assert grammar._tokenizers.get(id(rt.target), (None,))[0] is rt.target
    finally:
        worker.stop()
        worker.join(60)
