"""Tool calls in each template family's format, with the real chat templates of the pinned sdist.

For every family: the template takes `tools`; a call the template itself writes back into the
history parses into the same OpenAI call; the grammar that forces a call accepts that text and
only calls of the given tools; tool results go back into the history.
"""

from __future__ import annotations

import json
import os

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


def render(name, messages, generation_prompt):
    return templates._compile(template(name)).render(messages=messages, tools=TOOLS,
                                                     add_generation_prompt=generation_prompt,
                                                     bos_token="", eos_token="</s>")


def written_call(name) -> str:
    """The text of CALL as the template writes an assistant's call back into the history."""
    before = render(name, USER, True)
    after = render(name, USER + [{"role": "assistant", "content": "", "tool_calls": [CALL]}], False)
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
    text = written_call(name)
    # The call without what follows it (end of turn, end of message).
    for end in ("<|im_end|>", "<|eot_id|>", "</s>", "<|call|>", "<|end|>"):
        text = text.split(end)[0]
    text = text.rstrip("\n")
    assert _accepts(grammar, model, text), f"{fmt.family}: the grammar refuses {text!r}"
    assert not _accepts(grammar, model, text.replace("get_weather", "get_wheather")), "an unknown tool must be refused"
    named = Grammar.from_lark(model, fmt.grammar(functions[1:], lambda t: Grammar.literal(model, t)))
    assert not _accepts(named, model, text), "a named call allows only that tool"


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
