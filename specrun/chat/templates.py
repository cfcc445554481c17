"""Chat prompts from a model's own Jinja chat template, as Hugging Face renders them.

GGUF files carry the template in `tokenizer.chat_template`. It is foreign code, so it runs in
Jinja's immutable sandbox with the helpers HF templates expect (`raise_exception`,
`strftime_now`, a JSON-faithful `tojson`, `{% generation %}`, loop controls). A missing or broken
template falls back to ChatML with a warning rather than stopping the chat.

Chat sessions keep the KV cache between turns, so they need only the text a new turn appends:
`chat.session.ConversationMemory` renders the whole conversation and reuses the tokens of a
remembered text that is its prefix; where a template re-renders earlier turns differently, the
whole conversation is tokenized again (the cache still keeps the common prefix).
"""

from __future__ import annotations

import functools
import json
import logging
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
