"""`specrun serve` with tools, response_format, log-probs and penalties, driven by the official
openai client against a real server process (SmolLM2 target and draft, speculative); Ollama's
`format` and `tools` on the same server, driven by the official ollama client.

SmolLM2's own template takes no tools (test_server.py checks the 400), so this server runs with
Qwen 2.5's real template (--chat-template): the same ChatML turns, plus tools. The demo model does
not call tools by itself; tool_choice required / named force a real call with a grammar.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone

import httpx
import jsonschema
import ollama
import openai
import pytest
from pinned_sources import template
from pydantic import BaseModel, ConfigDict, Field
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


@pytest.fixture(scope="module")
def olm(server) -> ollama.Client:
    return ollama.Client(host=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=900)


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


# ---------------------------------------------------------------------------------------------
# Ollama's format and tools (issue 37, item 7)


class Person(BaseModel):
    """What an ollama user passes as format= (its JSON schema), and reads the answer back into."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(max_length=16)
    age: int = Field(ge=0, le=120)


GREEDY = {"temperature": 0, "num_predict": 48}


def test_ollama_format_is_a_schema_enforced_as_response_format(client, olm):
    messages = [{"role": "user", "content": "Describe a person as JSON."}]
    whole = olm.chat(model=TARGET, messages=messages, format=Person.model_json_schema(), options=GREEDY)
    assert whole.done_reason == "stop"
    Person.model_validate_json(whole.message.content)
    parts = list(olm.chat(model=TARGET, messages=messages, format=Person.model_json_schema(), options=GREEDY,
                          stream=True))
    assert parts[-1].done and "".join(p.message.content for p in parts) == whole.message.content
    # The same request on the OpenAI API: the same grammar over the same tree decoding, the same answer.
    openai_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": Person.model_json_schema()}}
    same = ask(client, messages[0]["content"], max_tokens=48, response_format=openai_format)
    assert same.choices[0].message.content == whole.message.content
    generated = olm.generate(model=TARGET, prompt="Give me a JSON object.", format="json", options=GREEDY)
    if generated.done_reason == "stop":
        assert isinstance(json.loads(generated.response), dict)
    else:  # the token limit cut it: still a prefix of an object
        assert generated.response.startswith("{")


def get_weather(city: str) -> str:
    """Get the current weather in a city.

    Args:
      city: The city's name
    """
    return "Rainy, 12 C"


def _called(city: str) -> dict:
    return {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather",
                                                                               "arguments": {"city": city}}}]}


# Two earlier turns show the demo model what a call looks like: it then calls the tool by itself
# (Ollama has no tool_choice to force one).
ASKED = [{"role": "user", "content": "Weather in Paris?"}, _called("Paris"), {"role": "user", "content": "Weather in Rome?"}]


def test_ollama_tools_come_back_as_ollamas_tool_calls(client, olm):
    whole = olm.chat(model=TARGET, messages=ASKED, tools=[get_weather], options=GREEDY)
    calls = whole.message.tool_calls
    assert whole.done and not whole.message.content
    assert [(c.function.name, dict(c.function.arguments)) for c in calls] == [("get_weather", {"city": "Rome"})]
    # A tool as a dict, streamed: the call arrives in a line of its own before the last one.
    parts = list(olm.chat(model=TARGET, messages=ASKED, tools=[WEATHER], options=GREEDY, stream=True))
    streamed = [c for p in parts for c in p.message.tool_calls or ()]
    assert parts[-1].done and [(c.function.name, dict(c.function.arguments)) for c in streamed] == [
        ("get_weather", {"city": "Rome"})]
    # The OpenAI API finds the same call in the same answer.
    same = client.chat.completions.create(model=TARGET, messages=[*ASKED[:1], _openai_call("Paris"), ASKED[2]],
                                          tools=[WEATHER], max_tokens=48, temperature=0)
    call = same.choices[0].message.tool_calls[0]
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Rome"})
    # The tool's result goes back with tool_name, as the ollama client sends it; the model answers.
    result = {"role": "tool", "content": get_weather("Rome"), "tool_name": "get_weather"}
    final = olm.chat(model=TARGET, messages=[*ASKED, whole.message, result], tools=[get_weather], options=GREEDY)
    assert final.done and (final.message.content or final.message.tool_calls)


def _openai_call(city: str) -> dict:
    return {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call00001", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}]}


def test_ollama_show_lists_tools_and_bad_formats_are_ollama_400s(server, olm, offline_models):
    shown = olm.show(TARGET)
    assert "tools" in shown.capabilities
    # The model as the ollama client lists it: its size label, and when its file was written.
    (listed,) = olm.list().models
    written = datetime.fromtimestamp(offline_models.smollm2_f32.stat().st_mtime, timezone.utc)
    for model in (listed, shown):
        assert model.details.parameter_size == "135M" and model.details.quantization_level == "F32"
        assert abs((model.modified_at - written).total_seconds()) < 1
    with pytest.raises(ollama.ResponseError) as refused:
        olm.chat(model=TARGET, messages=[{"role": "user", "content": "Hi"}], options=GREEDY,
                 format={"type": "object", "dependentRequired": {"a": ["b"]}})
    assert refused.value.status_code == 400 and "dependentRequired" in refused.value.error, refused.value.error
    # What the ollama client would not send: plain HTTP.
    for fields, said in (({"format": "yaml"}, 'format must be "json" or a JSON schema'),
                         ({"tools": [{"type": "retrieval"}]}, "only function tools")):
        bad = httpx.post(server.url + "/api/chat", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120,
                         json={"model": TARGET, "messages": [{"role": "user", "content": "Hi"}], **fields})
        assert bad.status_code == 400 and list(bad.json()) == ["error"] and said in bad.json()["error"], bad.text
