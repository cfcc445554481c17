"""Chat prompts from a model's own Jinja chat template, as Hugging Face renders them.

GGUF files carry the template in `tokenizer.chat_template`. It is foreign code, so it runs in
Jinja's immutable sandbox with the helpers HF templates expect (`raise_exception`,
`strftime_now`, a JSON-faithful `tojson`, `{% generation %}`, loop controls). A missing or broken
template falls back to ChatML with a warning rather than stopping the chat.

Chat sessions keep the KV cache between turns, so they need only the text a new turn appends:
`render_incremental` renders the whole conversation and checks that the already-rendered history is
its prefix; templates that re-render earlier turns differently are reported, not papered over.
"""

from __future__ import annotations

import functools
import json
import logging
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

logger = logging.getLogger(__name__)

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Gemma's turn format, for GGUF files that ship without a template (the Gemma 3 270M one does).
# Gemma has no system role: the system prompt opens the first user turn. The assistant is "model".
GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% set system_prefix = messages[0]['content'] + '\n\n' %}{% set turns = messages[1:] %}"
    "{% else %}{% set system_prefix = '' %}{% set turns = messages %}{% endif %}"
    "{% for message in turns %}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\n' }}"
    "{{ (system_prefix if loop.first else '') + message['content'] | trim }}"
    "{{ '<end_of_turn>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)

# Architectures (GGUF `general.architecture`) whose files may lack a template but whose turn format
# is known. Anything else without a template gets ChatML.
_BUILTIN_BY_ARCH_PREFIX = {"gemma": GEMMA_TEMPLATE}


@dataclass(frozen=True)
class TurnRender:
    """A conversation rendered with a new turn, and the text that turn appends to the history."""

    full: str
    # The text after the rendered history, or None when the template renders the history
    # differently once the new turn follows it: then the caller must prefill `full` again.
    suffix: str | None


def builtin_template(architecture: str | None) -> str | None:
    """Return specrun's template for a model family known to ship GGUFs without one, else None."""
    for prefix, template in _BUILTIN_BY_ARCH_PREFIX.items():
        if architecture and architecture.startswith(prefix):
            return template
    return None


def render_chat(
    template: str | None,
    messages: list[dict],
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
    **variables: Any,
) -> str:
    """Return `messages` rendered with `template`, or with ChatML if it is missing or fails.

    `bos_token` defaults to "" because llama.cpp's tokenizer adds BOS itself for models that
    want it; pass the real token only when tokenizing without BOS. Extra keyword arguments
    (`tools`, `enable_thinking`, ...) are passed to the template.
    """
    context = dict(
        variables,
        messages=messages,
        add_generation_prompt=add_generation_prompt,
        bos_token=bos_token,
        eos_token=eos_token,
    )
    if template is None:
        _warn_once("the model has no chat template; using ChatML")
    else:
        try:
            return _compile(template).render(**context)
        except Exception as err:  # a template is foreign code: any failure means "can't use it"
            _warn_once(f"the model's chat template failed ({type(err).__name__}: {err}); using ChatML")
    return _compile(CHATML_TEMPLATE).render(**context)


def render_incremental(
    template: str | None,
    history: list[dict],
    new_messages: list[dict],
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
    rendered_history: str | None = None,
    **variables: Any,
) -> TurnRender:
    """Return the conversation `history + new_messages` rendered, and what it appends to history.

    `rendered_history` is the text already in the context, if the caller tracks it (a generated
    reply may stop before the newline the template puts after it); by default the history is
    rendered without a generation prompt.
    """
    render = functools.partial(
        render_chat, template, bos_token=bos_token, eos_token=eos_token, **variables
    )
    full = render(history + new_messages, add_generation_prompt=add_generation_prompt)
    if rendered_history is None:
        # Many templates index messages[0] unguarded; an empty history renders as nothing.
        rendered_history = render(history, add_generation_prompt=False) if history else ""
    if full.startswith(rendered_history):
        return TurnRender(full=full, suffix=full[len(rendered_history):])
    logger.debug("chat template re-renders the history differently; the prompt must be re-prefilled")
    return TurnRender(full=full, suffix=None)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, indent: int | None = None, separators=None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes <, >, & and ' for HTML; prompts need the JSON text unchanged.
    return json.dumps(value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)


class _GenerationBlock(Extension):
    """Accept HF's `{% generation %}...{% endgeneration %}` (marks assistant text for training)."""

    tags = {"generation"}

    def parse(self, parser: Any) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


@functools.lru_cache(maxsize=64)
def _warn_once(message: str) -> None:
    # A chat renders every turn; say each distinct problem once, not once per turn.
    logger.warning(message)
