"""Issue 37, items 3 to 6: grammars, schemas and tools as real clients send them, against a real
`specrun serve` (the demo pair, speculative, with Qwen 2.5's tool template as in
test_server_structured.py), through the official openai client where a user would use it.

A grammar that llguidance cannot follow is an error the client sees (a 400 before decoding where
its first step shows it, else an error mid-answer), never a short answer called "stop"; bad input
is a 400 in the API's own shape, never a 500; forced calls follow parameters that keep nested
models in $defs; tool_choice, response_format, logprobs and llama.cpp's own `grammar` and
`json_schema` fields are each honoured or refused, never dropped.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pydantic
import pytest
from test_server import API_KEY, TARGET
from test_server_structured import ADD, PERSON, WEATHER, ask, client, server  # noqa: F401 (fixtures)

# A pattern whose regex outgrows llguidance's lexer once the string has begun (mid-answer).
EXPLODING_PATTERN = {"type": "object", "properties": {"s": {"type": "string", "pattern": "^(.{0,20}){20}$"}},
                     "required": ["s"]}
# No JSON value satisfies a $ref cycle: llguidance allows nothing at its first step.
REF_CYCLE = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
# A required property that refers back to its own object: every answer is endless.
ENDLESS = {"$defs": {"node": {"type": "object", "properties": {"next": {"$ref": "#/$defs/node"}},
                              "required": ["next"]}}, "$ref": "#/$defs/node"}


def _schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=300)


def _healthy(server) -> None:
    assert httpx.get(server.url + "/health", timeout=30).json()["status"] == "ok"


# ---------------------------------------------------------------------------------------------
# Item 3: a grammar failure is an error, never a normal stop


@pytest.mark.parametrize("schema", [REF_CYCLE, ENDLESS], ids=["ref cycle", "endless required ref"])
def test_a_schema_no_answer_can_follow_is_a_400_before_decoding(client, schema):
    with pytest.raises(openai.BadRequestError) as caught:
        ask(client, "Answer in JSON.", max_tokens=16, response_format=_schema_format(schema))
    error = caught.value.body
    assert error["param"] == "response_format" and "no answer can follow" in error["message"]
    assert "<state>" not in error["message"] and len(error["message"]) < 300  # no parser state dump


def test_a_schema_llguidance_gives_up_on_mid_answer_is_an_error(server, client):
    with pytest.raises(openai.BadRequestError) as caught:
        ask(client, "Answer in JSON.", max_tokens=32, response_format=_schema_format(EXPLODING_PATTERN))
    error = caught.value.body
    assert error["code"] == "grammar_failed" and error["param"] == "response_format"
    assert "too many expressions" in error["message"]
    streamed = ask(client, "Answer in JSON.", max_tokens=32, stream=True,
                   response_format=_schema_format(EXPLODING_PATTERN))
    with pytest.raises(openai.APIError, match="too many expressions"):  # the stream's error event
        for _ in streamed:
            pass
    _healthy(server)
    assert ask(client, "Name a colour.", max_tokens=4).choices[0].finish_reason in ("stop", "length")


# ---------------------------------------------------------------------------------------------
# Item 4: bad input is a 400 in the API's own shape, and the server stays up

BROKEN_CALL = [{"role": "user", "content": "What is the weather in Paris?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "abc123def", "type": "function",
                    "function": {"name": "get_weather", "arguments": "{not json"}}]},
               {"role": "tool", "tool_call_id": "abc123def", "content": "Sunny"}]

HOSTILE = {
    "tool call arguments not JSON": ({"messages": BROKEN_CALL}, "messages"),
    "logit_bias key a superscript digit": ({"logit_bias": {"²": 1}}, "logit_bias"),
    "required property referring to itself": ({"response_format": _schema_format(ENDLESS)}, "response_format"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_bad_input_is_a_400_never_a_500(server, case):
    fields, param = HOSTILE[case]
    body = {"model": TARGET, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **fields}
    reply = _post(server, "/v1/chat/completions", body)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param
    _healthy(server)


def test_bad_tool_call_arguments_on_the_ollama_api_are_its_400(server):
    reply = _post(server, "/api/chat", {"model": TARGET, "messages": BROKEN_CALL, "stream": False})
    assert reply.status_code == 400, reply.text
    body = reply.json()
    assert set(body) == {"error"} and isinstance(body["error"], str) and "arguments" in body["error"]


def test_an_extreme_repeat_penalty_is_served(client):
    # Sampled: 1e-300 divided a repeated token's logit to inf, and a sample needs a finite maximum.
    reply = ask(client, "List three fruits.", max_tokens=8, temperature=1.0, seed=1,
                extra_body={"repeat_penalty": 1e-300})
    assert reply.choices[0].finish_reason in ("stop", "length")


# ---------------------------------------------------------------------------------------------
# Item 5: forced calls follow parameters that keep nested models in $defs


class Location(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=12)
    country: str = pydantic.Field(max_length=12)


class Forecast(pydantic.BaseModel):
    """The weather to come in a place."""

    where: Location
    days: int = pydantic.Field(ge=1, le=7)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "Forecast"}}],
                         ids=["required", "named"])
def test_a_forced_call_of_a_nested_pydantic_tool(client, choice):
    tool = openai.pydantic_function_tool(Forecast)
    reply = ask(client, "What will the weather be in Paris?", tools=[tool], tool_choice=choice, max_tokens=64)
    call = reply.choices[0].message.tool_calls[0]
    assert reply.choices[0].finish_reason == "tool_calls" and call.function.name == "Forecast"
    Forecast.model_validate_json(call.function.arguments)


# ---------------------------------------------------------------------------------------------
# Item 6: tool_choice, response_format, logprobs, cut answers and llama.cpp's fields


def test_a_forced_call_beats_response_format(client):
    reply = ask(client, "Add 2 and 3.", tools=[WEATHER, ADD], tool_choice="required", max_tokens=48,
                response_format=_schema_format(PERSON))
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_tool_call_answer_keeps_its_logprobs(client, stream):
    reply = ask(client, "Add 2 and 3.", tools=[ADD], tool_choice="required", max_tokens=48, logprobs=True,
                top_logprobs=2, stream=stream)
    if stream:
        chunks = [c for c in reply if c.choices]
        entries = [e for c in chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
        assert [c.choices[0].finish_reason for c in chunks][-1] == "tool_calls"
    else:
        assert reply.choices[0].finish_reason == "tool_calls"
        entries = reply.choices[0].logprobs.content
    text = "".join(e.token for e in entries)
    assert '"name": "add"' in text and all(len(e.top_logprobs) == 2 for e in entries)


def test_a_forced_call_cut_by_max_tokens_is_length_with_no_call(client):
    reply = ask(client, "What is the weather in Paris?", tools=[WEATHER], tool_choice="required", max_tokens=6)
    choice = reply.choices[0]
    assert choice.finish_reason == "length" and choice.message.tool_calls is None
    assert choice.message.content.startswith("<tool_call>")  # the text so far, as written


def test_llama_cpp_grammar_field_is_followed(server):
    grammar = 'root ::= "yes" | "no"'
    chat = _post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Is the sky blue?"}],
                                                  "grammar": grammar, "max_tokens": 8, "temperature": 0})
    assert chat.status_code == 200, chat.text
    assert chat.json()["choices"][0]["message"]["content"] in ("yes", "no")
    text = _post(server, "/v1/completions", {"prompt": "Is the sky blue? Answer:", "grammar": grammar,
                                             "max_tokens": 8, "temperature": 0})
    assert text.status_code == 200, text.text
    assert text.json()["choices"][0]["text"] in ("yes", "no")


def test_llama_cpp_json_schema_field_is_followed(server):
    reply = _post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Describe a person."}],
                                                   "json_schema": PERSON, "max_tokens": 48, "temperature": 0})
    assert reply.status_code == 200, reply.text
    jsonschema.validate(json.loads(reply.json()["choices"][0]["message"]["content"]), PERSON)


CONFLICTS = {
    "grammar and response_format": ({"grammar": 'root ::= "a"', "response_format": {"type": "json_object"}}, "grammar"),
    "json_schema and grammar": ({"json_schema": PERSON, "grammar": 'root ::= "a"'}, "grammar"),
    "grammar beside tools": ({"grammar": 'root ::= "a"', "tools": [WEATHER]}, "grammar"),
    "a grammar llguidance refuses": ({"grammar": "root ::= undefined_rule"}, "grammar"),
}


@pytest.mark.parametrize("case", list(CONFLICTS))
def test_constraints_that_cannot_all_hold_are_400s(server, case):
    fields, param = CONFLICTS[case]
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **fields}
    reply = _post(server, "/v1/chat/completions", body)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param
