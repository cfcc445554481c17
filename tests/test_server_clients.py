"""What clients need from `specrun serve`, on real server processes on 127.0.0.1 (the demo pair):
the context where clients look for it, Ollama's API driven by the official `ollama` client,
request ids and logged refusals, and fairness (liveness under load, queue position and wait).

One server (module scope) runs with the default context, which must be the model's trained one;
the reasoning tests run their own with a real reasoning template (tests/test_server_reasoning.py).
"""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest
from test_server import API_KEY, PROMPT, TARGET, running_server

ollama = pytest.importorskip("ollama", reason="the ollama client library is not installed (dev extra)")

TRAINED_CTX = 8192  # SmolLM2-135M's context_length
SECRET = "zebra-7731"  # prompt text that must not reach the log of a refused request


@pytest.fixture(scope="module")
def server(offline_models, tmp_path_factory):
    # One request at a time: the queue test below waits behind an answer (test_parallel.py serves several).
    with running_server(tmp_path_factory.mktemp("serve-home"), "--api-key", API_KEY, "--parallel", "1", ctx=None) as srv:
        yield srv


@pytest.fixture(scope="module")
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=600)


@pytest.fixture(scope="module")
def olm(server) -> "ollama.Client":
    return ollama.Client(host=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=600)


def _http(server, **headers) -> httpx.Client:
    return httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}", **headers}, timeout=600)


# ---------------------------------------------------------------------------------------------
# The context


def test_default_context_is_the_trained_one_and_said_where_clients_look(server, oai, olm):
    assert f"{TRAINED_CTX}-token context (the model's trained context)" in server.stderr
    entry = oai.models.list().data[0]
    assert entry.model_extra["context_length"] == entry.model_extra["max_model_len"] == TRAINED_CTX
    assert entry.model_extra["meta"]["n_ctx_train"] == TRAINED_CTX
    with _http(server) as http:
        props = http.get("/props").json()
    assert props["default_generation_settings"]["n_ctx"] == TRAINED_CTX and props["total_slots"] == 1
    assert "<|im_start|>" in props["chat_template"]
    assert olm.show(TARGET).parameters == f"num_ctx {TRAINED_CTX}"
    assert olm.ps().models[0].context_length == TRAINED_CTX


# ---------------------------------------------------------------------------------------------
# Ollama's API, driven by the official client


def test_ollama_chat_agrees_with_the_openai_route(oai, olm):
    messages = [{"role": "user", "content": PROMPT}]
    want = oai.chat.completions.create(model=TARGET, messages=messages, max_tokens=12, temperature=0)
    whole = olm.chat(model=TARGET, messages=messages, options={"temperature": 0, "num_predict": 12})
    assert whole.message.role == "assistant" and whole.message.content == want.choices[0].message.content
    assert whole.done and whole.done_reason in ("stop", "length") and whole.model == TARGET
    assert 0 < whole.eval_count <= 12 and whole.prompt_eval_count == want.usage.prompt_tokens
    assert whole.total_duration >= whole.eval_duration > 0
    parts = list(olm.chat(model=TARGET, messages=messages, options={"temperature": 0, "num_predict": 12}, stream=True))
    assert len(parts) >= 2 and parts[-1].done and not any(p.done for p in parts[:-1])
    assert "".join(p.message.content for p in parts) == whole.message.content
    assert parts[-1].eval_count == whole.eval_count


def test_ollama_generate_streams_and_honours_options(olm):
    opts = {"temperature": 0, "num_predict": 10, "num_ctx": 2048, "repeat_penalty": 1.1}  # the last two: ignored
    whole = olm.generate(model=TARGET, prompt=PROMPT, options=opts)
    assert whole.done and whole.response.strip() and 0 < whole.eval_count <= 10
    parts = list(olm.generate(model=TARGET, prompt=PROMPT, options=opts, stream=True))
    assert "".join(p.response for p in parts) == whole.response and parts[-1].done
    raw = olm.generate(model=TARGET, prompt="1, 2, 3, 4,", raw=True, options={"temperature": 0, "num_predict": 6})
    assert raw.response.strip().startswith("5")  # raw: no chat template around the prompt
    stopped = olm.generate(model=TARGET, prompt="1, 2, 3, 4,", raw=True,
                           options={"temperature": 0, "num_predict": 20, "stop": ["7"]})
    assert "7" not in stopped.response and stopped.done_reason == "stop"
    seeded = [olm.generate(model=TARGET, prompt=PROMPT, options={"seed": 42, "temperature": 1, "num_predict": 8}).response
              for _ in range(2)]
    assert seeded[0] == seeded[1]


def test_ollama_model_routes(server, olm):
    listed = olm.list().models
    assert [m.model for m in listed] == [TARGET] and listed[0].details.format == "gguf"
    assert listed[0].details.family == "llama" and listed[0].details.quantization_level == "F32"
    assert listed[0].size > 100_000_000
    shown = olm.show(TARGET)
    assert "completion" in shown.capabilities and "thinking" not in shown.capabilities
    assert shown.modelinfo["llama.context_length"] == TRAINED_CTX and "<|im_start|>" in shown.template
    assert olm.ps().models[0].model == TARGET
    with _http(server) as http:
        assert http.get("/api/version").json()["version"]


def test_ollama_errors_are_ollamas_shape(server, olm):
    with pytest.raises(ollama.ResponseError) as bad_option:
        olm.generate(model=TARGET, prompt=PROMPT, options={"top_p": 7})
    assert bad_option.value.status_code == 400 and "top_p" in bad_option.value.error
    tool = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}
    with pytest.raises(ollama.ResponseError) as no_tools:  # SmolLM2's own template takes no tools
        olm.chat(model=TARGET, messages=[{"role": "user", "content": "hi"}], tools=[tool])
    assert no_tools.value.status_code == 400 and "no tool support" in no_tools.value.error
    assert "tools" not in olm.show(TARGET).capabilities
    with pytest.raises(ollama.ResponseError) as images:
        olm.chat(model=TARGET, messages=[{"role": "user", "content": "what is this?", "images": ["aGVsbG8="]}])
    assert images.value.status_code == 400 and "images are not supported" in images.value.error
    nokey = ollama.Client(host=server.url)
    with pytest.raises(ollama.ResponseError) as unauthorised:
        nokey.list()
    assert unauthorised.value.status_code == 401


@pytest.mark.parametrize("route, field, value", [
    ("/api/generate", "stream", "false"), ("/api/generate", "raw", "yes"), ("/api/chat", "stream", 0),
    ("/api/chat", "think", "yes"),
])
def test_ollama_booleans_are_true_or_false(server, route, field, value):
    """Issue 53: pydantic's lax booleans read "yes", "false" or 0 as booleans; Ollama refuses them."""
    body = {"model": TARGET, "stream": False, field: value}
    body.update({"prompt": PROMPT} if route == "/api/generate" else {"messages": [{"role": "user", "content": PROMPT}]})
    with _http(server) as http:
        response = http.post(route, json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"].startswith(f"{field}: must be true"), response.json()


# ---------------------------------------------------------------------------------------------
# Request ids and logged refusals


def test_every_response_carries_a_request_id_and_refusals_are_logged(server):
    with _http(server, **{"X-Request-Id": "client-id-42"}) as http:
        ok = http.get("/v1/models")
        refused = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": SECRET}], "n": 3})
    assert ok.headers["x-request-id"] == "client-id-42" and refused.status_code == 400
    assert "send the request several times" in refused.json()["error"]["message"]  # n > 1: what to do instead
    with httpx.Client(base_url=server.url, timeout=30) as http:
        fresh = http.get("/health").headers["x-request-id"]
        insane = http.get("/health", headers={"X-Request-Id": "bad id\twith spaces" + "x" * 200}).headers["x-request-id"]
        unauthorised = http.post("/v1/completions", json={"prompt": SECRET})
    assert fresh.startswith("req-") and insane.startswith("req-") and fresh != insane
    rid = unauthorised.headers["x-request-id"]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and rid not in server.stderr:
        time.sleep(0.05)
    log = server.stderr
    assert "client-id-42: POST /v1/chat/completions refused with 400: n: only n=1 is supported" in log
    assert f"{rid}: POST /v1/completions refused with 401: missing or wrong API key" in log
    assert SECRET not in log  # prompt text only with --verbose


# ---------------------------------------------------------------------------------------------
# Fairness: liveness under load, queue position and wait


def test_health_answers_at_once_while_an_answer_decodes_and_the_queue_is_reported(server, oai):
    first_text = threading.Event()
    finished = threading.Event()
    stop = threading.Event()

    def long_answer() -> None:
        stream = oai.completions.create(model=TARGET, prompt="1, 2, 3, 4, 5, 6, 7, 8,", max_tokens=3000,
                                        temperature=0, stream=True)
        try:
            for chunk in stream:
                if chunk.choices and chunk.choices[0].text:
                    first_text.set()
                if (chunk.choices and chunk.choices[0].finish_reason) or stop.is_set():
                    break
        finally:
            stream.close()  # the server cancels the answer
            finished.set()

    queued: dict = {}

    def queued_request() -> None:
        with _http(server) as http:
            response = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                               "max_tokens": 2, "temperature": 0})
        queued["headers"], queued["body"] = response.headers, response.json()

    runner = threading.Thread(target=long_answer)
    runner.start()
    try:
        assert first_text.wait(600), "the long answer did not start"
        waiter = threading.Thread(target=queued_request)
        waiter.start()
        with httpx.Client(base_url=server.url, timeout=30) as http:
            deadline = time.monotonic() + 30
            while http.get("/health").json()["queued"] < 1 and time.monotonic() < deadline:
                time.sleep(0.05)
            times = []
            for _ in range(5):
                t0 = time.perf_counter()
                assert http.get("/health").json() == {"status": "ok", "queued": 1}
                assert http.get("/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200
                times.append(time.perf_counter() - t0)
                time.sleep(0.2)
        assert not finished.is_set(), "the long answer ended before the checks: they proved nothing"
        # A blocked server would answer after the 3000-token answer (minutes); these take milliseconds
        # on a quiet machine, and stayed under 1.1 s with the 2 cores ~12x oversubscribed.
        assert max(times) < 2.5, times
        held_s = 1.0
        time.sleep(held_s)  # the queued request keeps waiting behind the answer
    finally:
        stop.set()
        runner.join(600)
    waiter.join(600)
    assert queued["headers"]["x-queue-position"] == "1"
    assert queued["body"]["timings"]["queue_ms"] >= held_s * 1000
    assert queued["body"]["choices"][0]["message"]["content"] is not None
