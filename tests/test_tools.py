"""Tool calls in each template family's format, with the real chat templates of the pinned sdist.

For every family: the template takes `tools`; a call the template itself writes back into the
history parses into the same OpenAI call; the grammar that forces a call accepts that text and
only calls of the given tools; tool results go back into the history.
"""

from __future__ import annotations

import json
import os

import openai
import pydantic
import pytest
from pinned_sources import template, vocab_gguf

from specrun import engine
from specrun.chat import templates
from specrun.chat.tools import tool_format
from specrun.engine.grammar import Grammar
from specrun.errors import UsageError

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                     "required": ["city"]}}},
    {"type": "function", "function": {"name": "add", "description": "Add two numbers",
                                      "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                                                     "b": {"type": "integer"}},
                                                     "required": ["a", "b"]}}},
]
CALL = {"id": "abc123def", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]

FAMILIES = {
    "Qwen-Qwen2.5-7B-Instruct": "hermes",
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use": "hermes",
    "Qwen3.5-4B": "qwen-xml",
    "meta-llama-Llama-3.1-8B-Instruct": "llama3",
    "meta-llama-Llama-3.3-70B-Instruct": "llama3",
    "mistralai-Mistral-Nemo-Instruct-2407": "mistral",
    "Mistral-Small-3.2-24B-Instruct-2506": "mistral-args",
    "openai-gpt-oss-120b": "harmony",
    "google-gemma-4-31B-it": "gemma4",
}


def render(name, messages, generation_prompt, tools=TOOLS):
    return templates._compile(template(name)).render(messages=messages, tools=tools,
                                                     add_generation_prompt=generation_prompt,
                                                     bos_token="", eos_token="</s>")


def written_call(name, call=CALL, tools=TOOLS) -> str:
    """The text of `call` as the template writes an assistant's call back into the history."""
    before = render(name, USER, True, tools)
    after = render(name, USER + [{"role": "assistant", "content": "", "tool_calls": [call]}], False, tools)
    # Some generation prompts open a (thinking) channel the history does not show: cut where they part.
    n = len(os.path.commonprefix([before, after]))
    while n and after[n - 1] in "<|":  # not half a marker
        n -= 1
    return after[n:]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_is_detected_and_tools_are_rendered(name):
    fmt = tool_format(template(name))
    assert fmt is not None and fmt.family == FAMILIES[name]
    assert "get_weather" in render(name, USER, True), "the template renders the tools"


@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_call_written_by_the_template_parses_back(name):
    content, calls = tool_format(template(name)).parse(written_call(name))
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert all(len(c.id) == 9 and c.id.isalnum() for c in calls)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_tool_results_go_back_into_the_history(name):
    history = USER + [
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "abc123def", "name": "get_weather", "content": "Sunny, 21 C"},
    ]
    assert "Sunny, 21 C" in render(name, history, True)


def test_no_tool_support_and_plain_text():
    assert tool_format(templates.CHATML_TEMPLATE) is None
    assert tool_format(None) is None
    content, calls = tool_format(template("Qwen-Qwen2.5-7B-Instruct")).parse("Just an answer.")
    assert content == "Just an answer." and calls == []


@pytest.fixture(scope="module")
def vocabularies(offline_models):
    owned = {"smollm2": engine.Model(offline_models.smollm2_q4, vocab_only=True),
             "qwen2": engine.Model(vocab_gguf("qwen2"), vocab_only=True),
             "llama-bpe": engine.Model(vocab_gguf("llama-bpe"), vocab_only=True)}
    yield owned
    for model in owned.values():
        model.close()


GRAMMAR_VOCAB = {"hermes": "qwen2", "llama3": "llama-bpe"}


@pytest.mark.parametrize("name", [n for n in FAMILIES if FAMILIES[n] != "gemma4"])
def test_forced_call_grammar_accepts_the_templates_call_and_nothing_else(name, vocabularies):
    fmt = tool_format(template(name))
    model = vocabularies[GRAMMAR_VOCAB.get(fmt.family, "smollm2")]
    functions = [t["function"] for t in TOOLS]
    grammar = Grammar.from_lark(model, fmt.grammar(functions, lambda text: Grammar.literal(model, text)))
    text = _call_text(written_call(name))
    assert _accepts(grammar, model, text), f"{fmt.family}: the grammar refuses {text!r}"
    assert not _accepts(grammar, model, text.replace("get_weather", "get_wheather")), "an unknown tool must be refused"
    named = Grammar.from_lark(model, fmt.grammar(functions[1:], lambda t: Grammar.literal(model, t)))
    assert not _accepts(named, model, text), "a named call allows only that tool"


def _call_text(written: str) -> str:
    """The call without what follows it (end of turn, end of message)."""
    for end in ("<|im_end|>", "<|eot_id|>", "</s>", "<|call|>", "<|end|>"):
        written = written.split(end)[0]
    return written.rstrip("\n")


class Location(pydantic.BaseModel):
    city: str
    country: str


class Forecast(pydantic.BaseModel):
    """The weather to come in a place."""

    where: Location
    days: int


# As the openai library writes a nested pydantic model: {"$defs": {"Location": ...}, "properties":
# {"where": {"$ref": "#/$defs/Location"}, ...}}.
FORECAST = json.loads(json.dumps(openai.pydantic_function_tool(Forecast, name="forecast")))
FORECAST_CALL = {"id": "abc123def", "type": "function", "function": {
    "name": "forecast", "arguments": {"where": {"city": "Paris", "country": "France"}, "days": 2}}}


@pytest.mark.parametrize("name", [n for n in FAMILIES if FAMILIES[n] != "gemma4"])
def test_a_forced_call_follows_parameters_that_refer_to_their_defs(name, vocabularies):
    """Issue 37, item 5: a forced call of a tool whose parameters keep a nested model in $defs
    failed with "Pointer '/$defs/Location' does not exist" (the parameters were placed inside the
    call object, and their $refs still pointed at its root)."""
    assert "$defs" in FORECAST["function"]["parameters"]
    fmt = tool_format(template(name))
    model = vocabularies[GRAMMAR_VOCAB.get(fmt.family, "smollm2")]
    tools = [FORECAST, TOOLS[1]]
    functions = [t["function"] for t in tools]
    grammar = Grammar.from_lark(model, fmt.grammar(functions, lambda text: Grammar.literal(model, text)))
    text = _call_text(written_call(name, FORECAST_CALL, tools))
    assert _accepts(grammar, model, text), f"{fmt.family}: the grammar refuses {text!r}"
    assert not _accepts(grammar, model, text.replace("Paris", "Paris\", \"zip\": \"75001")), "$defs still bind"


@pytest.mark.parametrize("name", ["Qwen-Qwen2.5-7B-Instruct", "mistralai-Mistral-Nemo-Instruct-2407"])
def test_tools_beside_response_format_allow_a_call_or_the_formatted_answer(name, vocabularies):
    """Issue 37, item 6: with response_format, tools the model may call were silently dropped
    (the schema's grammar left no room for a call)."""
    fmt = tool_format(template(name))
    model = vocabularies[GRAMMAR_VOCAB.get(fmt.family, "smollm2")]
    person = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"],
              "additionalProperties": False}
    functions = [t["function"] for t in TOOLS]
    grammar = Grammar.from_lark(model, fmt.call_or_answer(functions, lambda t: Grammar.literal(model, t), person))
    assert _accepts(grammar, model, _call_text(written_call(name)))
    assert _accepts(grammar, model, '{"name": "Ada"}')
    assert not _accepts(grammar, model, '{"age": 36}') and not _accepts(grammar, model, "Ada")


@pytest.mark.parametrize("name", [n for n in FAMILIES if FAMILIES[n] not in ("gemma4", "qwen-xml")])
def test_a_call_cut_by_the_token_limit_is_no_call(name):
    """A call cut short (max_tokens) is no call at all: not the first complete object nested in
    its arguments."""
    nested = {"id": "abc123def", "type": "function", "function": {
        "name": "get_weather", "arguments": {"city": {"name": "add", "arguments": {}}, "more": 1}}}
    text = _call_text(written_call(name, nested))
    cut = text[: text.index('"more"')]
    assert tool_format(template(name)).parse(cut)[1] == []


def _accepts(grammar, model, text) -> bool:
    """Whether the grammar's matcher takes the tokens of `text` and is then complete."""
    matcher = grammar.matcher()
    for token in model.tokenize(text, add_special=False, parse_special=True):
        if not matcher.allowed()[token]:
            return False
        matcher.consume(token)
    return matcher.accepting()


def test_gemma_forced_calls_are_refused_clearly(vocabularies):
    fmt = tool_format(template("google-gemma-4-31B-it"))
    with pytest.raises(UsageError, match="tool_choice auto"):
        fmt.grammar([TOOLS[0]["function"]], json.dumps)
