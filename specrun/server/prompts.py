"""Prompt tokens for a request, what the KV cache already holds of them, and how much room is left."""

from __future__ import annotations

from specrun.server.schemas import APIError


class ConversationMemory:
    """The text and tokens of the latest chats (prompt + answer), so a conversation's next turn
    tokenizes only its new part.

    Re-tokenizing the whole conversation could split an earlier answer into other tokens than the
    model generated, and the cache would then be reused only up to that point. As in `specrun
    chat`, a rendered conversation that starts with a remembered text reuses its tokens. Several
    conversations are remembered (the server answers several clients, each in a lane of the cache
    of its own), the least recently used forgotten first.
    """

    def __init__(self, capacity: int = 1) -> None:
        self.capacity = max(1, capacity)
        self._chats: list[tuple[str, list[int]]] = []  # (text, tokens), the most recently used last

    def tokens_for(self, fmt, rendered) -> list[int]:
        """Return the tokens of `rendered` (a chat.control.Marked), reusing those of the longest
        remembered chat it continues."""
        found = [i for i, (known, _) in enumerate(self._chats)
                 if len(rendered.text) > len(known) and rendered.continues(known)]
        if not found:
            return fmt.tokenize_start(rendered)
        best = max(found, key=lambda i: len(self._chats[i][0]))
        known, tokens = self._chats[best]
        self._chats.append(self._chats.pop(best))
        return tokens + fmt.tokenize_more(rendered, len(known))

    def remember(self, text: str, tokens: list[int]) -> None:
        """Keep a chat's text and tokens, in place of the turns before it (a text it continues)."""
        self._chats = [(known, t) for known, t in self._chats if not text.startswith(known)]
        self._chats.append((text, list(tokens)))
        del self._chats[: -self.capacity]

    def forget(self) -> None:
        self._chats = []


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
