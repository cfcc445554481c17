"""The current families' real chat templates (Qwen3.5, Gemma 4, gpt-oss, Nemotron 3, LFM2.5,
DeepSeek V4, ...) render exactly as Hugging Face renders them, turn by turn, thinking included, and
their text tokenizes into the control tokens of the real vocabularies.

The reference renderer below is written from the behaviour transformers' apply_chat_template
documents (transformers is not a dependency): an immutable Jinja sandbox with trim_blocks and
lstrip_blocks, loop controls, a `{% generation %}` block that only marks text, a JSON `tojson`
that does not escape HTML, `raise_exception` and `strftime_now`.
"""

from __future__ import annotations

import functools
import json
import logging
from datetime import datetime

import jinja2
import pytest
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from specrun.chat import templates
from specrun.chat.templates import render_chat
from pinned_sources import template, vocab_gguf
from test_templates import render_incremental, smollm2_vocab  # noqa: F401 (fixtures: a turn as a chat session renders it)

# ---------------------------------------------------------------------------------------------
# The reference: rendered as transformers renders a chat template


class _Generation(Extension):
    """`{% generation %}...{% endgeneration %}`: transformers uses it to find assistant text; the
    text itself renders unchanged."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _reference_env() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, loopcontrols])

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


@functools.lru_cache(maxsize=None)
def _reference_template(name: str) -> jinja2.Template:
    return _reference_env().from_string(template(name))


def reference(name: str, messages: list[dict], add_generation_prompt: bool, **kwargs) -> str:
    return _reference_template(name).render(
        messages=messages, add_generation_prompt=add_generation_prompt, bos_token="", eos_token="", **kwargs
    )


# ---------------------------------------------------------------------------------------------
# Conversations without tools

SYSTEM = {"role": "system", "content": "You are terse."}
U1 = {"role": "user", "content": "Hi there"}
A1 = {"role": "assistant", "content": "Hello! How can I help?"}
U2 = {"role": "user", "content": "Name a prime, and say why it is one."}
A2 = {"role": "assistant", "content": "7: only 1 and 7 divide it."}
U3 = {"role": "user", "content": "Another one?"}

CONVERSATIONS = {
    "system+user": [SYSTEM, U1],
    "user": [U1],
    "two turns": [SYSTEM, U1, A1, U2],
    "three turns": [SYSTEM, U1, A1, U2, A2, U3],
    "no system, two turns": [U1, A1, U2],
    "ends with the answer": [SYSTEM, U1, A1],
}

# name -> markers every rendering of a system/user/assistant conversation contains
TEMPLATES = {
    "Qwen3.5-4B": ["<|im_start|>user\n", "<|im_end|>"],
    "google-gemma-4-31B-it": ["<|turn>user\n", "<turn|>"],
    "openai-gpt-oss-120b": ["<|start|>user<|message|>", "<|end|>"],
    "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16": ["<|im_start|>user\n", "<|im_end|>"],
    "LFM2.5-Instruct": ["<|im_start|>user\n", "<|im_end|>"],
    "deepseek-ai-DeepSeek-V4": ["<｜User｜>"],
    "Qwen3-Coder": ["<|im_start|>user\n", "<|im_end|>"],
    "LFM2-8B-A1B": ["<|im_start|>user\n", "<|im_end|>"],
    "ibm-granite-granite-4.0": ["<|start_of_role|>user<|end_of_role|>"],
    "GLM-4.7-Flash": ["<|user|>"],
    "Kimi-K3": ['<|open|>message role="user"'],
}

# What each template's generation prompt ends with (thinking templates open a thought section).
GENERATION_PROMPTS = {
    "Qwen3.5-4B": "<|im_start|>assistant\n<think>\n",
    "google-gemma-4-31B-it": "<|turn>model\n<|channel>thought\n<channel|>",  # thinking off: an empty thought
    "openai-gpt-oss-120b": "<|start|>assistant",
    "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16": "<|im_start|>assistant\n<think>\n",
    "LFM2.5-Instruct": "<|im_start|>assistant\n",
}


@pytest.fixture
def no_fallback(caplog):
    """Fail the test if specrun fell back to ChatML (a template that did not run)."""
    templates._warn_once.cache_clear()
    with caplog.at_level(logging.WARNING, logger=templates.__name__):
        yield
    assert [r.getMessage() for r in caplog.records] == []


@pytest.mark.parametrize("conversation", list(CONVERSATIONS))
@pytest.mark.parametrize("name", list(TEMPLATES))
def test_renders_exactly_as_hugging_face(name, conversation, no_fallback):
    messages = CONVERSATIONS[conversation]
    for add_generation_prompt in (True, False):
        ours = render_chat(template(name), messages, add_generation_prompt=add_generation_prompt)
        assert ours == reference(name, messages, add_generation_prompt), (name, conversation, add_generation_prompt)
    for marker in TEMPLATES[name]:
        assert marker in ours, (name, marker)
    assert "You are terse." in ours or SYSTEM not in messages
    if name in GENERATION_PROMPTS:
        with_prompt = render_chat(template(name), messages, add_generation_prompt=True)
        assert with_prompt.endswith(GENERATION_PROMPTS[name]), name


@pytest.mark.parametrize("name, kwargs", [
    ("Qwen3.5-4B", {"enable_thinking": False}),
    ("google-gemma-4-31B-it", {"enable_thinking": True}),
    ("openai-gpt-oss-120b", {"reasoning_effort": "low"}),
    ("NVIDIA-Nemotron-3-Nano-30B-A3B-BF16", {"enable_thinking": False}),
    ("deepseek-ai-DeepSeek-V4", {"enable_thinking": True}),
])
def test_template_options_render_as_hugging_face(name, kwargs, no_fallback):
    messages = CONVERSATIONS["two turns"]
    assert render_chat(template(name), messages, **kwargs) == reference(name, messages, True, **kwargs)
    assert render_chat(template(name), messages, **kwargs) != render_chat(template(name), messages)


# An assistant turn with its thinking: each family names the field differently.
THINKING = {
    "Qwen3.5-4B": ("reasoning_content", "<think>\nSeven has no divisors but 1 and 7.\n</think>", {}),
    "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16": ("reasoning_content", "<think>\nSeven has no divisors but 1 and 7.\n</think>", {}),
    "openai-gpt-oss-120b": ("thinking", "<|channel|>analysis<|message|>Seven has no divisors but 1 and 7.<|end|>", {}),
    "google-gemma-4-31B-it": ("reasoning_content", "7: only 1 and 7 divide it.", {"enable_thinking": True}),
    "deepseek-ai-DeepSeek-V4": ("reasoning_content", "<think>Seven has no divisors but 1 and 7.</think>", {"enable_thinking": True}),
}


@pytest.mark.parametrize("name", list(THINKING))
def test_thinking_sections_render_as_hugging_face(name, no_fallback):
    field, rendered, kwargs = THINKING[name]
    thought = dict(A2, **{field: "Seven has no divisors but 1 and 7."})
    last = [SYSTEM, U1, A1, U2, thought]
    ours = render_chat(template(name), last, add_generation_prompt=False, **kwargs)
    assert ours == reference(name, last, False, **kwargs)
    assert rendered in ours  # the latest answer keeps its thinking (Gemma 4 drops it from history)
    later = last + [U3]
    assert render_chat(template(name), later, **kwargs) == reference(name, later, True, **kwargs)


# ---------------------------------------------------------------------------------------------
# Incremental rendering (chat KV reuse)


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_incremental_turns_agree_with_the_full_rendering(name, no_fallback, render_incremental):
    history = [SYSTEM, U1, A1]
    for new, after in [([U2], [A2]), ([U3], [])]:
        turn = render_incremental(template(name), history, new)
        assert turn.full == reference(name, history + new, True)
        if turn.suffix is not None:
            assert reference(name, history, False) + turn.suffix == turn.full
        history = history + new + after


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_incremental_turn_after_a_generated_reply(name, no_fallback, render_incremental):
    """The chat session's own history text (prompt + reply + end-of-turn marker) either prefixes the
    next rendering, giving the suffix to decode, or the prompt is prefilled again: never a wrong
    suffix."""
    prompt = render_chat(template(name), [SYSTEM, U1])
    end = TEMPLATES[name][-1] if name in GENERATION_PROMPTS else ""
    session_text = prompt + A1["content"] + end
    turn = render_incremental(template(name), [SYSTEM, U1, A1], [U2], rendered_history=session_text)
    assert turn.full == reference(name, [SYSTEM, U1, A1, U2], True)
    if turn.suffix is not None:
        assert session_text + turn.suffix == turn.full
    if name == "LFM2.5-Instruct":
        assert turn.suffix is not None  # nothing re-rendered: the KV cache is reused as it is
    if name == "google-gemma-4-31B-it":
        # The generation prompt opens an empty thought channel that the history does not keep: the
        # prompt is rendered again and the KV cache is reused up to the previous answer only.
        assert turn.suffix is None
        assert turn.full.startswith(prompt[: -len("<|channel>thought\n<channel|>")])


# ---------------------------------------------------------------------------------------------
# The rendered text in the real tokenizers


@pytest.fixture(scope="module")
def vocab():
    from specrun.engine.model import Model

    loaded = {}

    def load(name):
        if name not in loaded:
            loaded[name] = Model(vocab_gguf(name), vocab_only=True)
        return loaded[name]

    yield load
    for model in loaded.values():
        model.close()


# The pinned qwen35 vocab-only GGUF is llama.cpp's tokenizer test file: 151,936 tokens whose last
# specials are <|endoftext|>, <|im_start|>, <|im_end|> (no <think> token), so <think> is text there.
@pytest.mark.parametrize("name, vocab_name, controls, end_of_turn", [
    ("Qwen3.5-4B", "qwen35", ["<|im_start|>", "<|im_end|>"], "<|im_end|>"),
    ("google-gemma-4-31B-it", "gemma-4", ["<|turn>", "<turn|>", "<|channel>", "<channel|>"], "<turn|>"),
    ("Qwen3-Coder", "qwen2", ["<|im_start|>", "<|im_end|>"], "<|im_end|>"),
])
def test_control_tokens_are_single_tokens_of_the_real_vocabulary(vocab, name, vocab_name, controls, end_of_turn):
    model = vocab(vocab_name)
    text = render_chat(template(name), CONVERSATIONS["three turns"], enable_thinking=True)
    tokens = model.tokenize(text, add_special=False, parse_special=True)
    pieces = [model.token_to_piece(t, True).decode("utf-8", "replace") for t in tokens]
    assert "".join(pieces) == text  # the tokens spell the text exactly
    for control in controls:
        ids = model.tokenize(control, add_special=False, parse_special=True)
        assert len(ids) == 1, (control, ids)
        assert pieces.count(control) == text.count(control), control
    # The template's end-of-turn marker is a token the model stops at.
    (stop,) = model.tokenize(end_of_turn, add_special=False, parse_special=True)
    assert model.is_eog(stop), end_of_turn
    # Without parse_special the markers would be plain text: the chat path must parse them.
    assert len(model.tokenize(text, add_special=False, parse_special=False)) > len(tokens)
