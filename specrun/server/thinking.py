"""What the server does with a reasoning model's thinking, and the chat settings behind it.

A chat answer's text is split into `reasoning_content` and `content` (see chat.reasoning) when
the chat template's model thinks in a known syntax and the reasoning format is "auto" (the
default; --reasoning-format or a request's reasoning_format "none" leaves the thinking in content).
"""

from __future__ import annotations

from dataclasses import dataclass

from specrun.chat import reasoning
from specrun.chat.reasoning import ReasoningParser


@dataclass(frozen=True)
class ChatSettings:
    """Server-wide chat settings: where thinking goes, and a template replacing the model's."""

    reasoning_format: str = "auto"
    template: str | None = None  # --chat-template: used instead of the GGUF's own


def parser_for(template: str | None, rendered_prompt: str, reasoning_format: str) -> ReasoningParser | None:
    """Return the parser that splits this answer's thinking out, or None to leave the text whole."""
    if reasoning_format == "none":
        return None
    syntax = reasoning.template_syntax(template)
    if syntax is None:
        return None
    return ReasoningParser(syntax, in_reasoning=syntax == "think" and reasoning.opens_thinking(rendered_prompt))
