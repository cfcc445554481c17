"""What a request's prompt may hold and how much it may generate (the tokens of a conversation's
next turn: chat.session.ConversationMemory)."""

from __future__ import annotations

from specrun.server.schemas import APIError


# Roles whose text every chat template writes out in full (earlier assistant turns may be
# shortened: reasoning templates drop their thinking), so their size bounds the prompt from below.
_ALWAYS_RENDERED = ("system", "user", "tool")


def refuse_what_cannot_fit(messages: list[dict], n_ctx: int, max_token_bytes: int) -> None:
    """Raise a 400 for a conversation that cannot fit the context, judged without rendering it.

    Rendering and tokenizing are the slow part of a refusal (a request of many thousands of
    messages took seconds of the only worker's time), so two cheap lower bounds go first: every
    template writes at least one token per message, and no token spells more than
    `max_token_bytes` bytes of the messages' text."""
    if len(messages) >= n_ctx:
        raise _too_long(f"the request has {len(messages)} messages, and each takes at least one token of "
                        f"the {n_ctx}-token context", "messages")
    text_bytes = sum(len(m["content"].encode("utf-8", "surrogatepass")) for m in messages
                     if m.get("role") in _ALWAYS_RENDERED and isinstance(m.get("content"), str))
    at_least = -(-text_bytes // max_token_bytes)
    if at_least >= n_ctx:
        raise _too_long(f"the messages hold {text_bytes} bytes of text, at least {at_least} tokens, and the "
                        f"context holds {n_ctx}", "messages")


def _too_long(reason: str, param: str) -> APIError:
    return APIError(400, f"{reason}: shorten the conversation (or restart the server with a larger --ctx-size)",
                    param=param, code="context_length_exceeded")


def token_budget(n_prompt: int, n_ctx: int, requested: int | None, param: str) -> int:
    """Return how many tokens may be generated: the request's limit, capped by the room in the context."""
    room = n_ctx - n_prompt
    if room < 2:
        raise _too_long(f"the prompt has {n_prompt} tokens but the context holds {n_ctx}", param)
    # One token of room stays free: the last generated token is never decoded into the cache.
    return room - 1 if requested is None else min(requested, room - 1)
