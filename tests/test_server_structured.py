"""`specrun serve` with tools, response_format, log-probs and penalties, driven by the official
openai client against a real server process (SmolLM2 target and draft, speculative).

SmolLM2's own template takes no tools (test_server.py checks the 400), so this server runs with
Qwen 2.5's real template (--chat-template): the same ChatML turns, plus tools. The demo model does
not call tools by itself; tool_choice required / named force a real call with a grammar.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from pinned_sources import template
from test_server import API_KEY, TARGET, ServerProcess

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two whole numbers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                                  "b": {"type": "integer", "minimum": 0, "maximum": 999}},
                   "required": ["a", "b"], "additionalProperties": False}}}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server(offline_models, tmp_path_factory):
    home = tmp_path_factory.mktemp("serve-structured")
    path = home / "qwen.jinja"
    path.write_text(template("Qwen-Qwen2.5-7B-Instruct"))
    srv = ServerProcess(home, "--api-key", API_KEY, "--chat-template", str(path))
    srv.wait_ready()
    yield srv
    assert srv.terminate() == 0, srv.stderr


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=900)


def ask(client, content, **kwargs):
    kwargs.setdefault("temperature", 0)
    return client.chat.completions.create(model=TARGET, messages=[{"role": "user", "content": content}], **kwargs)


def test_tool_call_loop(client):
    """call -> tool result -> final answer, as an agent runs it."""
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.chat.completions.create(model=TARGET, messages=messages, tools=[WEATHER, ADD],
                                           tool_choice="required", max_tokens=48, temperature=0)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call = choice.message.tool_calls[0]
    assert call.function.name in ("get_weather", "add")
    schema = (WEATHER if call.function.name == "get_weather" else ADD)["function"]["parameters"]
    jsonschema.validate(json.loads(call.function.arguments), schema)
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"}]
    final = client.chat.completions.create(model=TARGET, messages=messages, tools=[WEATHER, ADD],
                                           tool_choice="none", max_tokens=12, temperature=0)
    assert final.choices[0].message.content and final.choices[0].message.tool_calls is None


def test_named_tool_call_streams_as_deltas(client):
    stream = ask(client, "Add 2 and 3.", tools=[WEATHER, ADD], max_tokens=64, stream=True,
                 tool_choice={"type": "function", "function": {"name": "add"}})
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        if not chunk.choices:
            continue
        for delta in chunk.choices[0].delta.tool_calls or ():
            entry = calls.setdefault(delta.index, {"name": "", "arguments": "", "id": None})
            entry["id"] = delta.id or entry["id"]
            if delta.function and delta.function.name:
                entry["name"] += delta.function.name
            if delta.function and delta.function.arguments:
                entry["arguments"] += delta.function.arguments
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and list(calls) == [0]
    assert calls[0]["name"] == "add" and calls[0]["id"]
    jsonschema.validate(json.loads(calls[0]["arguments"]), ADD["function"]["parameters"])


def test_response_format_json_schema_and_json_object(client):
    reply = ask(client, "Describe a person as JSON.", max_tokens=48, response_format={
        "type": "json_schema", "json_schema": {"name": "person", "strict": True, "schema": PERSON}})
    jsonschema.validate(json.loads(reply.choices[0].message.content), PERSON)
    reply = ask(client, "Give me a JSON object.", max_tokens=48, response_format={"type": "json_object"})
    text = reply.choices[0].message.content
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # the token limit cut it: still a prefix of an object
        assert text.startswith("{")


def test_logprobs_chat_completions_and_streamed(client):
    reply = ask(client, "Name a colour.", max_tokens=6, logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    assert "".join(e.token for e in content) == reply.choices[0].message.content
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token  # greedy: the likeliest token was chosen
    streamed = [e for chunk in ask(client, "Name a colour.", max_tokens=6, logprobs=True, stream=True)
                if chunk.choices and chunk.choices[0].logprobs for e in chunk.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-2)
    completion = client.completions.create(model=TARGET, prompt="The sky is", max_tokens=4, temperature=0, logprobs=2)
    lp = completion.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(len(top) == 2 for top in lp.top_logprobs)


def test_penalties_and_logit_bias_are_served(client):
    plain = ask(client, "List three fruits.", max_tokens=12).choices[0].message.content
    penalised = ask(client, "List three fruits.", max_tokens=12, presence_penalty=1.5, frequency_penalty=1.5,
                    extra_body={"repeat_penalty": 1.3}).choices[0].message.content
    assert penalised != plain


BAD = {
    "presence_penalty out of range": ({"presence_penalty": 2.5}, "presence_penalty"),
    "logit_bias out of range": ({"logit_bias": {"5": 150}}, "logit_bias"),
    "logit_bias key not a token": ({"logit_bias": {"hello": 1}}, "logit_bias"),
    "logit_bias token past the vocabulary": ({"logit_bias": {"99999999": 1}}, "logit_bias"),
    "top_logprobs out of range": ({"logprobs": True, "top_logprobs": 30}, "top_logprobs"),
    "unsupported schema feature": ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "dependentRequired": {"a": ["b"]}}}}}, "response_format"),
    "unknown response_format": ({"response_format": {"type": "yaml"}}, "response_format"),
    "tool_choice naming no tool": ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
                                   "tool_choice"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_values_are_400s(server, case):
    fields, param = BAD[case]
    body = {"model": TARGET, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **fields}
    response = httpx.post(server.url + "/v1/chat/completions", json=body,
                          headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
